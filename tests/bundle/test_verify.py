"""`refattn verify`: checksums, recomputation, gradient check and the schema-version gate."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings

import refattn
from refattn import RefAttnError
from refattn.bundle import SCHEMA_VERSION, write_bundle
from refattn.bundle.storage.manifest import READERS, check_schema
from refattn.bundle.suites import build_suite
from refattn.bundle.verification.gradients import gradient_check
from refattn.bundle.verification.verifier import verify
from refattn.cli import main
from tests.strategies import engine_calls

CASE = "gqa_broadcast_bias_cross"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle")
    write_bundle(out, build_suite("contract"), suite="contract")
    return out



def _file(bundle: Path, case: str = CASE) -> Path:
    return bundle / "cases" / f"{case}.safetensors"


def _tensor_span(path: Path, name: str) -> tuple[int, int]:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    start, stop = json.loads(data[8 : 8 + n])[name]["data_offsets"]
    return 8 + n + start, 8 + n + stop


def _problems(report):
    return [(p.case_id, p.tensor, p.stage) for p in report.all_problems]


def test_pristine_bundle_passes_bit_identically(pristine, capsys):
    r = verify(pristine)
    assert r.passed, r.format()
    assert all(c.bit_identical for c in r.cases)
    assert all(c.gradcheck_error is not None and c.gradcheck_error <= 1 for c in r.cases)
    assert {c.gradcheck_method for c in r.cases} == {"check_vjp full"}  # small cases: all
    assert {"q", "k", "v", "bias"} <= set(next(c for c in r.cases if c.case_id == CASE)
                                           .gradcheck_inputs)
    assert main(["verify", str(pristine)]) == 0
    out = capsys.readouterr().out
    assert CASE in out and out.rstrip().endswith("PASS")
    assert main(["verify", str(pristine), "--gradcheck-method", "central_difference"]) == 0
    assert "central_difference" in capsys.readouterr().out
    with pytest.raises(RefAttnError, match="gradcheck_method: expected one of 'auto'"):
        verify(pristine, gradcheck_method="autograd")


def test_tampered_byte_names_case_and_tensor(bundle, capsys):
    path = _file(bundle)
    start, _ = _tensor_span(path, "grad_k")
    data = bytearray(path.read_bytes())
    data[start + 3] ^= 0x01  # one bit of one float
    path.write_bytes(bytes(data))
    r = verify(bundle)
    assert not r.passed
    assert _problems(r) == [(CASE, "grad_k", "tensor")]
    assert "sha256 mismatch" in r.all_problems[0].reason
    assert main(["verify", str(bundle)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL case={CASE} tensor=grad_k [tensor]" in out


def test_truncated_file(bundle):
    path = _file(bundle)
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    last = max((k for k in header if k != "__metadata__"),
               key=lambda k: header[k]["data_offsets"][1])
    path.write_bytes(data[:-1])
    r = verify(bundle)
    assert _problems(r) == [(CASE, last, "tensor")]
    assert "truncated" in r.all_problems[0].reason
    # a file cut inside its header
    path.write_bytes(data[:20])
    r = verify(bundle)
    assert [(p.tensor, p.stage) for p in r.all_problems] == [(None, "file")]
    assert "truncated" in r.all_problems[0].reason


def test_missing_tensor(bundle):
    from safetensors.numpy import load as st_load
    from safetensors.numpy import save

    path = _file(bundle)
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + n])["__metadata__"]
    tensors = st_load(data)
    del tensors["row_dot"]
    path.write_bytes(save(tensors, metadata=meta))
    r = verify(bundle)
    assert (CASE, "row_dot", "tensor") in _problems(r)
    assert any("missing tensor" in p.reason for p in r.all_problems)


def test_header_only_change_and_unlisted_file(bundle):
    path = _file(bundle)
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    assert data[8 + n - 1 : 8 + n] == b" "  # safetensors pads its JSON header with spaces
    data[8 + n - 1] = ord("\n")  # still valid JSON, every tensor byte unchanged
    path.write_bytes(bytes(data))
    shutil.copy(_file(bundle, "all_dropped_row"), bundle / "cases" / "stray.safetensors")
    r = verify(bundle)
    assert sorted(_problems(r), key=str) == sorted([(None, None, "bundle"),
                                                    (CASE, None, "file")], key=str)
    assert "stray.safetensors" in r.problems[0].reason
    assert "header" in next(p for p in r.all_problems if p.case_id == CASE).reason


def _rewrite(bundle: Path, case: str, mutate) -> None:
    """Change stored tensors and re-seal every checksum (a consistent but wrong file)."""
    from safetensors.numpy import load as st_load
    from safetensors.numpy import save

    from refattn.bundle import tensor_sha256

    path = _file(bundle, case)
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(json.loads(data[8 : 8 + n])["__metadata__"]["refattn"])
    tensors = st_load(data)
    mutate(tensors)
    meta["tensors"] = {k: tensor_sha256(v) for k, v in sorted(tensors.items())}
    new = save(tensors, metadata={"refattn": json.dumps(meta, sort_keys=True,
                                                         separators=(",", ":"))})
    path.write_bytes(new)
    mpath = bundle / "manifest.json"
    manifest = json.loads(mpath.read_text())
    entry = manifest["cases"][case]
    entry["sha256"] = hashlib.sha256(new).hexdigest()
    for k, v in tensors.items():
        entry["tensors"][k]["sha256"] = tensor_sha256(v)
    mpath.write_text(json.dumps(manifest))


def test_wrong_gradient_is_caught_by_recompute_and_gradcheck(bundle):
    def scale_grad_k(t):
        t["grad_k"] = t["grad_k"] * 1.001

    _rewrite(bundle, CASE, scale_grad_k)
    r = verify(bundle)
    got = _problems(r)
    assert (CASE, "grad_k", "recompute") in got
    assert (CASE, "grad_k", "gradcheck") in got
    assert all(p[0] == CASE for p in got)
    # the gradient check alone also names it
    r = verify(bundle, recompute=False)
    assert _problems(r) == [(CASE, "grad_k", "gradcheck")]


def test_central_difference_gradient_check(bundle):
    r = verify(bundle, recompute=False, gradcheck_method="central_difference")
    assert r.passed and {c.gradcheck_method for c in r.cases} == {"central_difference"}

    def scale_grad_v(t):
        t["grad_v"] = t["grad_v"] * 1.001

    _rewrite(bundle, CASE, scale_grad_v)
    r = verify(bundle, recompute=False, gradcheck_method="central_difference")
    assert _problems(r) == [(CASE, "grad_v", "gradcheck")]


def test_wrong_forward_value_is_caught_by_recompute(bundle):
    def shift_lse(t):
        t["lse"] = t["lse"] + 1e-9

    _rewrite(bundle, "all_dropped_row", shift_lse)
    r = verify(bundle, gradcheck=False)
    assert _problems(r) == [("all_dropped_row", "lse", "recompute")]


def test_gradient_check_detects_each_wrong_input():
    call = build_suite("contract")[4].call  # GQA + broadcast bias
    rng = np.random.default_rng(3)
    g_o = rng.standard_normal((2, 4, 3, 3))
    grads = refattn.backward(refattn.forward(call), g_o).tensors()
    assert all(c.passed for c in gradient_check(call, g_o, grads))
    for name in ("q", "k", "v", "bias"):
        wrong = dict(grads)
        wrong[f"grad_{name}"] = grads[f"grad_{name}"] * 1.0001
        checks = {c.name: c.passed for c in gradient_check(call, g_o, wrong)}
        assert checks == {n: n != name for n in ("q", "k", "v", "bias")}



def test_gradient_check_noise_floor_follows_the_terms_of_a_cancelling_loss():
    # a bias constant along keys cannot move softmax: its exact gradient is 0, and the finite
    # difference is pure rounding. With G_O chosen so that L = sum(O * G_O) cancels to ~0 the
    # rounding is that of the large terms; a floor taken from |L| (found by hypothesis in
    # test_generated_calls_round_trip_through_a_bundle) failed this check
    rng = np.random.default_rng(5)
    q, k, v = (6.0 * rng.standard_normal((1, 2, 4, 3)) for _ in range(3))
    call = refattn.AttentionCall(q, k, v, bias=rng.standard_normal((1, 2, 4, 1)))
    out = refattn.forward(call).output
    g_o = rng.standard_normal(out.shape)
    g_o -= np.sum(out * g_o) / np.sum(out * out) * out  # L = 0 up to rounding
    assert abs(np.sum(out * g_o)) < 1e-12 * np.sum(np.abs(out * g_o))
    grads = refattn.backward(refattn.forward(call), g_o).tensors()
    assert np.abs(grads["grad_bias"]).max() < 1e-12
    assert all(c.passed for c in gradient_check(call, g_o, grads))
    wrong = dict(grads, grad_bias=grads["grad_bias"] + 1e-3)  # a real error still fails
    assert not {c.name: c.passed for c in gradient_check(call, g_o, wrong)}["bias"]

# -- schema version ----------------------------------------------------------------------

def test_schema_version_gate(bundle):
    assert SCHEMA_VERSION.split(".")[0] == "1" and sorted(READERS) == [1]
    base = {"schema": "refattn_golden", "cases": {}}
    assert check_schema({**base, "schema_version": "1.0"})["cases"] == {}
    assert check_schema({**base, "schema_version": "1.9"})["cases"] == {}  # additive minor
    for bad, match in (("2.0", "major 2"), ("0.9", "major 0"), ("one", "MAJOR.MINOR"),
                       ("1", "MAJOR.MINOR")):
        with pytest.raises(RefAttnError, match=match):
            check_schema({**base, "schema_version": bad})
    with pytest.raises(RefAttnError, match="schema_version is missing"):
        check_schema(base)
    with pytest.raises(RefAttnError, match="schema is"):
        check_schema({"schema": "other", "schema_version": "1.0", "cases": {}})
    # a bundle from a future major version is refused by the command (exit 2, one line)
    mpath = bundle / "manifest.json"
    manifest = json.loads(mpath.read_text())
    manifest["schema_version"] = "2.0"
    mpath.write_text(json.dumps(manifest))
    assert main(["verify", str(bundle)]) == 2
    # and a newer minor version still verifies
    manifest["schema_version"] = "1.1"
    mpath.write_text(json.dumps(manifest))
    assert verify(bundle).passed


# -- property: any call survives the bundle round trip ------------------------------------------

@settings(max_examples=25, deadline=None)
@given(call=engine_calls(max_len=6))
def test_generated_calls_round_trip_through_a_bundle(call):
    """CaseSpec rebuilds every call feature (relations, head maps, streams, policies, strides)
    exactly: the rebuilt manifest and every recomputed tensor match, and the stored gradients
    pass gradcheck's check_vjp and the directional central-difference check."""
    from refattn.bundle import GoldenCase

    g_o = np.random.default_rng(0).standard_normal((*call.q.shape[:3], call.v.shape[3]))
    with tempfile.TemporaryDirectory() as d:
        write_bundle(d, [GoldenCase("generated", call, g_o, "generated call")], suite="prop")
        r = verify(d)
        assert r.passed, r.format()
        assert r.cases[0].bit_identical and r.cases[0].gradcheck_method.startswith("check_vjp")
        r = verify(d, recompute=False, gradcheck_method="central_difference")
        assert r.passed, r.format()


def test_recompute_with_another_backend(pristine, capsys):
    pytest.importorskip("numba")
    r = verify(pristine, backend="numba", gradcheck=False)
    assert r.passed, r.format()
    assert all(c.recompute_error is not None and c.recompute_error < 1e-12 for c in r.cases)
    assert main(["verify", str(pristine), "--backend", "numba", "--no-gradcheck"]) == 0
    capsys.readouterr()
    with pytest.raises(RefAttnError, match="unknown backend"):
        verify(pristine, backend="cuda")


def test_cases_another_backend_cannot_run_are_noted_not_failed(tmp_path):
    pytest.importorskip("numba")
    from refattn.bundle.suites.conformance import CASES

    write_bundle(tmp_path, [CASES["softcap_5"](), CASES["bias_full"]()], suite="mixed")
    r = verify(tmp_path, backend="numba", gradcheck=False)
    assert r.passed
    noted = {c.case_id: c.notes for c in r.cases}
    assert noted["bias_full"] == () and "softcap" in noted["softcap_5"][0]
    assert "note case=softcap_5" in r.format()
    assert "backend 'numba': ran 1 of 2 case(s), max|stored - recomputed|" in r.format()
    # the exact generator still recomputed both: the bundle's guarantee does not depend on it
    assert [c.guarantee.kind for c in r.cases] == ["bit_identical"] * 2


def test_the_rounding_certificate_catches_a_consistent_one_ulp_change(bundle, capsys):
    def nudge_output(t):
        t["output"] = np.nextafter(t["output"], np.inf)  # every element one ulp up

    assert main(["verify", "--exact", "--no-recompute", "--no-gradcheck", str(bundle)]) == 0
    assert "rounding cert." in capsys.readouterr().out
    _rewrite(bundle, CASE, nudge_output)  # checksums re-sealed: integrity passes
    r = verify(bundle, recompute=False, gradcheck=False, exact=True)
    assert ("output", "certificate") in {(p.tensor, p.stage) for p in r.all_problems}
    assert main(["verify", "--exact", "--no-recompute", "--no-gradcheck", str(bundle)]) == 1


def test_recomputation_of_an_exact_case_must_be_bit_identical(bundle):
    def one_ulp(t):
        t["lse"] = np.nextafter(t["lse"], np.inf)

    _rewrite(bundle, CASE, one_ulp)
    r = verify(bundle, gradcheck=False)
    (problem,) = [p for p in r.all_problems if p.stage == "recompute"]
    assert problem.tensor == "lse" and "first difference at (0, 0, 0)" in problem.reason


def test_a_numpy_generated_bundle_is_verified_by_the_float64_rule(tmp_path):
    write_bundle(tmp_path, build_suite("contract")[:3], suite="contract", backend="numpy")
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["generator"]["backend"] == "numpy"
    assert manifest["generator"]["numpy"]  # a machine-dependent bundle says what made it
    r = verify(tmp_path, gradcheck=False)
    assert r.passed, r.format()
    r = verify(tmp_path, gradcheck=False, backend="exact")  # another engine: float64 rule
    assert r.passed and not any(c.bit_identical is None for c in r.cases), r.format()
