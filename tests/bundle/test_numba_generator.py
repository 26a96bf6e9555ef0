"""The numba golden generator (issue 39, item 2): fast float64 goldens with a stated guarantee.

Its tensors are within the float64 backend bound of the correctly rounded result (checked here
against the exact generator, not against verify); its bytes do not depend on the thread count
(separate processes); the bound its manifest records is the one verify applies, and verify
cannot be talked into a looser one: a loosened, missing or relabelled record, a numba case
that claims exact, a tensor a saved-state case does not store, a bundle whose generator record
disagrees with its cases, and one ulp moved on a case this machine's libraries wrote all fail.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from refattn.bundle.golden.case import case_tensors, compute, stored_by
from refattn.bundle.golden.guarantee import (
    audit_record,
    check_bound,
    guarantee_record,
    kappa,
    natural_scales,
    saved_state_scales,
)
from refattn.bundle.storage.format import tensor_sha256
from refattn.bundle.suites import build_suite
from refattn.bundle.suites.kernels import SPECS, build
from refattn.bundle.verification.verifier import verify
from refattn.bundle.writing.write import write_bundle
from refattn.cli import main
from refattn.engine.numba.generator import refusal
from refattn.errors import RefAttnError
from tests.bundle.resealing import reseal_case_file

ROOT = Path(__file__).resolve().parents[2]

#: small kernel cases, one per feature family (the exact generator takes well under a second
#: on each)
SMALL = ("edge_causal_lr_q1_k65", "window_lr_q1_k147", "alibi_q1_k147", "paged1_q1_k300",
         "decode_q1_k147", "dkdv_q1_k147", "varlen_q64_k101", "sink_q239_k1",
         "softcap_q239_k1", "keypad_q239_k1", "dropout_q239_k1", "model_gptoss_q257_k129",
         "edge_causal_ul_q65_k63")


def _small_cases() -> list:
    chosen = []
    for prefix in SMALL:
        spec = next(s for s in SPECS if s.case_id.startswith(prefix))
        chosen.append(build(spec))
    return chosen


@pytest.fixture(scope="module")
def numba_bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("numba") / "bundle"
    write_bundle(out, _small_cases()[:6], suite="kernels", backend="numba")
    return out


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    (dst / "cases").mkdir()
    for p in src.rglob("*"):
        if p.is_file():
            (dst / p.relative_to(src)).write_bytes(p.read_bytes())
    return dst


def _edit_manifest(bundle: Path, edit) -> None:
    path = bundle / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


def _reseal(bundle: Path, case: str, change) -> None:
    """Change stored tensors and re-seal every sha256 (only the recomputation can tell)."""
    new, tensors = reseal_case_file(bundle, case, change)

    def edit(m):
        entry = m["cases"][case]
        entry["sha256"] = hashlib.sha256(new).hexdigest()
        entry["tensors"] = {n: {"sha256": tensor_sha256(t), "dtype": str(t.dtype),
                                "shape": list(t.shape)} for n, t in tensors.items()}

    _edit_manifest(bundle, edit)


# -- the guarantee, against the exact generator -----------------------------------------------
@pytest.mark.parametrize("case", _small_cases(), ids=lambda c: c.case_id)
def test_numba_goldens_meet_the_bound_of_the_correctly_rounded_result(case):
    exact = compute(case, "exact")
    fast = compute(case, "numba")
    reference = case_tensors(exact.trace, exact.grads, case.layout)
    stored = case_tensors(fast.trace, fast.grads, case.layout)
    assert set(stored) == set(stored_by("numba", reference))
    checked = check_bound(stored, reference, kappa=kappa(exact.trace.scores),
                          scales=natural_scales(case.call, exact.trace, exact.grads))
    assert checked and not [t for t in checked if t.reason], checked
    assert max(t.fraction for t in checked) < 0.5  # measured at most 0.2


def test_the_recorded_bound_equals_the_bound_verify_derives_from_exact():
    """The record is computed in blocks from the numba run; verify's from the exact trace:
    the same allowances (to the roundings of two runs), and audit_record finds nothing."""
    for case in _small_cases()[:4]:
        fast, exact = compute(case, "numba"), compute(case, "exact")
        tensors = case_tensors(fast.trace, fast.grads, case.layout)
        kap, scales = saved_state_scales(case.call, fast.trace, fast.grads)
        record = guarantee_record("numba", tensors, kap, scales)
        ref = stored_by("numba", case_tensors(exact.trace, exact.grads, case.layout))
        ref_kap = kappa(exact.trace.scores)
        ref_scales = natural_scales(case.call, exact.trace, exact.grads)
        assert kap == pytest.approx(ref_kap, rel=1e-12)
        for name, value in scales.items():
            assert value == pytest.approx(ref_scales[name], rel=1e-12), name
        assert audit_record(record, "numba", ref, ref_kap, ref_scales, tensors) == []


def test_the_numba_generator_refuses_what_its_kernel_does_not_run(tmp_path):
    by_id = {c.case_id: c for c in build_suite("conformance")}
    assert "additive" in refusal(by_id["score_additive"].call)
    assert "returned_weights" in refusal(by_id["returned_weights_post_dropout"].call)
    with pytest.raises(RefAttnError, match=r"--backend numba: case 'score_additive'.*exact"):
        write_bundle(tmp_path / "b", [by_id["score_additive"]], suite="x", backend="numba")
    assert not (tmp_path / "b").exists()  # refused before anything was written


# -- determinism ---------------------------------------------------------------------------
GENERATE = """
import sys, numba
from threadpoolctl import threadpool_limits
from refattn.bundle.suites.kernels import SPECS, build
from refattn.bundle.writing.write import write_bundle
out, threads, ids = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
numba.set_num_threads(threads)
with threadpool_limits(limits=threads):
    cases = [build(s) for s in SPECS if s.case_id in ids]
    write_bundle(out, cases, suite="kernels", backend="numba")
"""


def test_numba_golden_bytes_do_not_depend_on_the_thread_count(tmp_path):
    """Cases whose layout has several query chunks per (batch, kv head) (one kv head, long
    queries) and several tasks, written on 1 and on 2 threads in processes of their own."""
    ids = [s.case_id for s in SPECS if s.case_id.startswith(
        ("shape_q1024_k1023", "model_llama_q1023", "dropout_q512", "sink_q1023",
         "edge_causal_lr_q320"))]
    assert len(ids) >= 5
    digests = []
    for threads in (1, 2):
        out = tmp_path / f"t{threads}"
        proc = subprocess.run([sys.executable, "-c", GENERATE, str(out), str(threads),
                               ",".join(ids)], capture_output=True, text=True, timeout=600,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stderr[-3000:]
        digests.append({p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                        for p in sorted(out.rglob("*")) if p.is_file()})
    assert digests[0] == digests[1] and len(digests[0]) == len(ids) + 1


# -- verify ---------------------------------------------------------------------------------
def test_an_honest_numba_bundle_verifies_within_the_bound(numba_bundle):
    report = verify(numba_bundle, gradcheck=False)
    assert report.passed, report.format()
    assert {c.guarantee.kind for c in report.cases} == {"within_bound"}
    m = json.loads((numba_bundle / "manifest.json").read_text())
    assert m["generator"]["backend"] == "numba"
    for entry in m["cases"].values():
        assert entry["guarantee"]["generator"] == "numba"
        assert "probs" not in entry["tensors"] and "output" in entry["tensors"]


def test_one_ulp_on_a_case_written_here_fails_the_bit_identical_regeneration(
        numba_bundle, tmp_path):
    bundle = _copy(numba_bundle, tmp_path / "b")
    case = next(iter(json.loads((bundle / "manifest.json").read_text())["cases"]))

    def change(t):
        idx = np.unravel_index(np.argmax(np.abs(t["grad_q"])), t["grad_q"].shape)
        t["grad_q"][idx] = np.nextafter(t["grad_q"][idx], np.inf)

    _reseal(bundle, case, change)
    report = verify(bundle, gradcheck=False)
    reasons = [p.reason for p in report.all_problems]
    assert [p.tensor for p in report.all_problems] == ["grad_q"]
    assert reasons[0].startswith("regenerated by numba on the libraries that wrote it")


@pytest.mark.parametrize("edit, expected", [
    (lambda r: r["tensors"]["output"].update(elementwise=r["tensors"]["output"]["elementwise"]
                                             * 10), "looser than the numba guarantee"),
    (lambda r: r.update(gradient_bound=1e-10), "gradient_bound is 1e-10"),
    (lambda r: r["tensors"].pop("grad_k"), "grad_k: stored but not listed"),
], ids=["loosened", "constant", "unlisted"])
def test_a_recorded_guarantee_verify_would_not_apply_is_refused(numba_bundle, tmp_path, edit,
                                                                 expected):
    bundle = _copy(numba_bundle, tmp_path / "b")
    case = next(iter(json.loads((bundle / "manifest.json").read_text())["cases"]))
    _edit_manifest(bundle, lambda m: edit(m["cases"][case]["guarantee"]))
    report = verify(bundle, gradcheck=False)
    assert not report.passed
    assert any(expected in p.reason for p in report.all_problems), report.all_problems


def test_a_numba_case_without_its_record_is_refused(numba_bundle, tmp_path):
    bundle = _copy(numba_bundle, tmp_path / "b")
    case = next(iter(json.loads((bundle / "manifest.json").read_text())["cases"]))
    _edit_manifest(bundle, lambda m: m["cases"][case].pop("guarantee"))
    report = verify(bundle, gradcheck=False)
    (problem,) = report.all_problems
    assert problem.reason.startswith("a numba case must record its guarantee")


@pytest.mark.parametrize("exact_max_seconds", [600.0, 0.0])
def test_a_numba_bundle_relabelled_exact_is_refused(numba_bundle, tmp_path, exact_max_seconds):
    """Whether or not the exact generator runs: an exact case stores the whole trace, so a
    saved-state case claiming exact lacks tensors the recomputation has."""
    bundle = _copy(numba_bundle, tmp_path / "b")

    def relabel(m):
        m["generator"] = {"backend": "exact", "refattn": "0.1.0",
                          "arithmetic": {"mode": "stepwise_correctly_rounded"}}
        for entry in m["cases"].values():
            entry["call"]["backend"].update(requested_backend="exact",
                                            selected_backend="exact")
            entry.pop("guarantee")

    _edit_manifest(bundle, relabel)
    report = verify(bundle, gradcheck=False, exact_max_seconds=exact_max_seconds)
    assert not report.passed
    for c in report.cases:
        assert any("not store" in p.reason for p in c.problems), c.problems


def test_a_tensor_a_saved_state_case_does_not_store_is_refused(numba_bundle, tmp_path):
    bundle = _copy(numba_bundle, tmp_path / "b")
    case = next(iter(json.loads((bundle / "manifest.json").read_text())["cases"]))
    _reseal(bundle, case, lambda t: t.update(probs=np.zeros((1, 1, 1, 1))))
    report = verify(bundle, gradcheck=False)
    assert ("probs", "stored tensor is not produced by the recomputation") in [
        (p.tensor, p.reason) for p in report.all_problems]


def test_a_bundle_generator_record_that_disagrees_with_its_cases_is_refused(numba_bundle,
                                                                            tmp_path):
    bundle = _copy(numba_bundle, tmp_path / "b")
    _edit_manifest(bundle, lambda m: m["generator"].update(backend="numpy"))
    report = verify(bundle, gradcheck=False)
    assert any("the bundle's generator record names ['numpy'], the case's call manifest "
               "'numba'" in p.reason for p in report.all_problems)


def test_an_exact_case_with_a_float64_record_is_refused(tmp_path):
    out = tmp_path / "b"
    write_bundle(out, build_suite("contract")[:1], suite="contract")
    case = next(iter(json.loads((out / "manifest.json").read_text())["cases"]))
    record = guarantee_record("numba", {"output": np.ones(1)}, 1.0, {})
    _edit_manifest(out, lambda m: m["cases"][case].update(guarantee=record))
    report = verify(out, gradcheck=False)
    assert any("records a float64 guarantee" in p.reason for p in report.all_problems)


# -- the command line ---------------------------------------------------------------------------
def test_golden_refuses_the_exact_generator_for_the_kernel_suite_before_any_work(
        tmp_path, capsys):
    out = tmp_path / "k"
    assert main(["golden", "--suite", "kernels", "--backend", "exact", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    from refattn.bundle.suites import kernels

    n = len(kernels.builders())  # the designed specs and the feature suites' cases
    assert f"--backend exact: the {n} case(s) of suite 'kernels' would take about" in err
    assert "--max-seconds" in err and "--backend numba" in err
    assert not any(out.rglob("*.safetensors"))


def test_golden_refuses_an_unknown_suite_in_one_line(tmp_path, capsys):
    assert main(["golden", "--suite", "kernel", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "kernels" in err[0]


def test_sweep_backend_that_contradicts_the_spec_is_refused(tmp_path, capsys):
    spec = tmp_path / "s.toml"
    spec.write_text('name = "k"\n[[grid]]\nshape = [[1, 2, 1, 65, 63, 40, 40]]\n'
                    'generator = ["exact"]\n')
    assert main(["sweep", str(spec), "--out", str(tmp_path / "o"), "--backend", "numba"]) == 2
    err = capsys.readouterr().err
    assert "generator: the SPEC names 'exact' and --backend 'numba'" in err


def test_sweep_writes_numba_cases_that_verify(tmp_path, capsys):
    spec = tmp_path / "s.toml"
    spec.write_text('name = "k"\n[[grid]]\nshape = [[1, 4, 2, 65, 129, 59, 59]]\n'
                    'mask = ["causal_lower_right", "none"]\n')
    assert main(["sweep", str(spec), "--out", str(tmp_path / "o"), "--backend", "numba",
                 "--quiet"]) == 0
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert m["generator"]["backend"] == "numba" and len(m["cases"]) == 2
    assert all(cid.split("-")[-2] == "numba" for cid in m["cases"])
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "o"), "--no-gradcheck", "--quiet"]) == 0
