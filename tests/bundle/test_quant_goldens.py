"""Quantised golden cases (issue 28 item 4): what a case file stores, verify recomputing the
real result and the emulated intervals bit for bit, and compare judging a candidate by them."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from refattn.bundle import write_bundle
from refattn.bundle.comparison.candidates import write_candidate
from refattn.bundle.golden.spec import case_spec
from refattn.bundle.storage.format import tensor_sha256
from refattn.bundle.storage.manifest import check_schema
from refattn.bundle.storage.read import load
from refattn.bundle.suites.conformance import CASES
from refattn.bundle.verification.verifier import verify
from refattn.cli import main
from refattn.errors import RefAttnError
from refattn.quant.formats import quantize
from refattn.quant.pipeline import emulate
from refattn.quant.spec import QuantSpec
from tests.bundle.resealing import reseal_case_file

FA3 = "quant_fa3_fp8_gqa_causal"
VLLM = "quant_vllm_fp8_kv_saturating"
SAGE = "quant_sageattention_int8_causal"
QUANT_CASES = [c for c in CASES if c.startswith("quant_")]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("quant") / "b"
    write_bundle(out, [CASES[c]() for c in (FA3, VLLM, SAGE)], suite="conformance")
    return out


@pytest.fixture
def bundle(pristine, tmp_path) -> Path:
    out = tmp_path / "b"
    shutil.copytree(pristine, out)
    return out


def _e4m3fn(code: int) -> float:
    """An e4m3fn code's value from its bit fields (bias 7, no infinity), independently of
    refattn.quant.formats."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    return sign * (m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


# -- what a quantised case stores ------------------------------------------------------------

def test_a_quantised_case_stores_codes_scales_intervals_and_the_spec(pristine):
    case = load(pristine / "cases" / f"{FA3}.safetensors")
    t, entry = case.tensors, case.manifest_entry
    spec = QuantSpec.from_manifest(entry["quant"]["spec"])
    assert spec.name == "fa3_fp8" and spec == CASES[FA3]().quant.spec
    for name in ("q", "k", "v"):  # uint8 codes; the real input is code x descale of its kv head
        codes, scale = t[f"quant_{name}_codes"], t[f"quant_{name}_scale"]
        assert codes.dtype == np.uint8 and scale.dtype == np.float64
        assert entry["tensors"][f"quant_{name}_codes"]["dtype"] == "uint8"
        values = np.vectorize(_e4m3fn)(codes)
        heads = np.arange(t[name].shape[1]) // (t[name].shape[1] // scale.shape[1])
        assert np.array_equal(t[name], values * scale[:, heads, None, None])
    built = CASES[FA3]().quant
    emulated = emulate(built.call, built.spec)  # the pipeline on the suite's own kernel call
    assert sorted(emulated) == ["lse", "output", "probs_q", "row_max", "row_sum", "scores"]
    for name, interval in emulated.items():
        mid, rad = t[f"quant_{name}_mid"], t[f"quant_{name}_rad"]
        assert (rad >= 0).all()
        assert mid.tobytes() == interval.mid.tobytes() and rad.tobytes() == interval.rad.tobytes()
    assert t["output"].shape == t["quant_output_mid"].shape  # the real result, as for any case


def test_a_cast_input_stores_no_codes_and_a_computed_scale_none():
    """vLLM casts q, k, v itself (no codes, scales stored); SageAttention computes its own
    q/k scales (none stored) and casts v to fp16 with scale 1."""
    vllm = case_spec(CASES[VLLM]())
    assert not any(n.endswith("_codes") for n in vllm.tensors)
    assert {"quant_q_scale", "quant_k_scale", "quant_v_scale"} <= set(vllm.tensors)
    sage = case_spec(CASES[SAGE]())
    assert "quant_q_scale" not in sage.tensors and "quant_v_scale" in sage.tensors
    assert "quant_lse_mid" not in sage.tensors  # the kernel returns no lse


def test_the_manifest_schema_checks_the_quant_record(pristine):
    manifest = json.loads((pristine / "manifest.json").read_text())
    check_schema(manifest)
    bad = json.loads(json.dumps(manifest))
    bad["cases"][FA3]["quant"] = {"spec": {"name": 3}}
    with pytest.raises(RefAttnError, match=rf"cases/{FA3}/quant/spec/name"):
        check_schema(bad)
    bad["cases"][FA3]["quant"] = {"spec": {"name": "fa3_fp8"}, "extra": 1}
    with pytest.raises(RefAttnError, match="Additional properties"):
        check_schema(bad)


def test_every_preset_and_the_issue_s_conditions_are_in_the_suite():
    specs = {cid: CASES[cid]() for cid in QUANT_CASES}
    presets = {c.quant.spec.name for c in specs.values()}
    assert presets == {"fa3_fp8", "flashinfer_sm90_fp8", "flashinfer_fp8_kv", "vllm_fp8_kv",
                       "sageattention_int8"}
    causal = [c for c in specs.values() if c.call.relation is not None]
    plain = [c for c in specs.values() if c.call.relation is None]
    gqa = [c for c in specs.values() if c.call.k.shape[1] < c.call.q.shape[1]]
    assert causal and plain and gqa
    limits = [c for c in specs.values() if (np.abs(c.quant.call.q) == 448).any()]
    assert limits  # codes at e4m3fn's largest value
    s_real = {cid: np.abs(np.einsum("bhqd,bhkd->bhqk", c.call.q,
                                    np.repeat(c.call.k, c.call.q.shape[1] // c.call.k.shape[1],
                                              axis=1))).max() * c.call.scale
              for cid, c in specs.items()}
    # past float32's exponent range: every real score below its smallest normal number
    assert min(s_real.values()) < float(np.finfo(np.float32).tiny)


# -- verify ----------------------------------------------------------------------------------

def _reseal(bundle: Path, case: str, change) -> None:
    """Change stored tensors and re-seal every checksum, so only recomputation can tell."""
    new, tensors = reseal_case_file(bundle, case, change)
    manifest = json.loads((bundle / "manifest.json").read_text())
    entry = manifest["cases"][case]
    entry["sha256"] = hashlib.sha256(new).hexdigest()
    entry["tensors"] = {n: {"sha256": tensor_sha256(t), "dtype": str(t.dtype),
                            "shape": list(t.shape)} for n, t in tensors.items()}
    (bundle / "manifest.json").write_text(json.dumps(manifest))


def test_verify_recomputes_a_quantised_bundle_bit_for_bit(pristine):
    report = verify(pristine, gradcheck=False)
    assert report.passed, report.format()
    assert all(c.bit_identical for c in report.cases)


def _ulp(t: dict, name: str, index: tuple[int, ...]) -> None:
    t[name][index] = np.nextafter(t[name][index], np.inf)


@pytest.mark.parametrize(("name", "index", "expected"), [
    ("quant_output_mid", (0, 1, 2, 3), "quant_output_mid.*first difference at \\(0, 1, 2, 3\\)"),
    ("quant_output_rad", (0, 3, 1, 0), "quant_output_rad.*first difference at \\(0, 3, 1, 0\\)"),
    ("quant_lse_mid", (0, 2, 1), "quant_lse_mid.*first difference at \\(0, 2, 1\\)"),
    ("quant_k_scale", (0, 1), "quant_k_scale' at index \\(0, 1\\)"),
    ("quant_v_codes", (0, 1, 4, 5), "v at index \\(0, 1, 4, 5\\).*quant_v_codes"),
])
def test_a_one_ulp_edit_of_a_quantised_tensor_fails_naming_tensor_and_index(
        bundle, name, index, expected):
    def change(t):
        if t[name].dtype == np.uint8:
            t[name][index] ^= 1  # the neighbouring code
        else:
            _ulp(t, name, index)
    _reseal(bundle, FA3, change)
    report = verify(bundle, gradcheck=False)
    problems = [p for p in report.all_problems if p.case_id == FA3]
    assert not report.passed and problems
    text = " | ".join(f"{p.tensor}: {p.reason}" for p in problems)
    assert __import__("re").search(expected, text), text
    assert all(c.passed for c in report.cases if c.case_id != FA3)


def test_a_missing_code_tensor_or_a_spec_that_does_not_read_back_fails(bundle):
    _reseal(bundle, FA3, lambda t: t.pop("quant_q_codes"))
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["cases"][VLLM]["quant"]["spec"]["p_offset"] = "0x1.0p+7"  # 128: outside [0, 64]
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    report = verify(bundle, gradcheck=False)
    reasons = {p.case_id: p.reason for p in report.all_problems}
    assert "'quant_q_codes' is missing" in reasons[FA3]
    assert "manifest quant: p_offset" in reasons[VLLM]


def test_the_real_inputs_must_be_the_dequantised_codes(bundle):
    """A file whose q is not codes x descale (everything re-sealed) is refused by name."""
    _reseal(bundle, FA3, lambda t: _ulp(t, "q", (0, 2, 1, 3)))
    report = verify(bundle, gradcheck=False)
    text = " ".join(p.reason for p in report.all_problems)
    assert "q at index (0, 2, 1, 3)" in text and "quant_q_codes x quant_q_scale" in text


# -- compare ---------------------------------------------------------------------------------

def test_compare_judges_a_candidate_by_the_emulated_interval(pristine, tmp_path, capsys):
    t = load(pristine / "cases" / f"{FA3}.safetensors").tensors
    good, bad = tmp_path / "good.safetensors", tmp_path / "bad.safetensors"
    def bf16(x: np.ndarray) -> np.ndarray:  # what FA3 returns, stored as float32
        return quantize(np.asarray(x, dtype=np.float64), "bf16", "nearest_even").astype(np.float32)

    write_candidate(good, {"output": bf16(t["quant_output_mid"])})  # inside: ends are bf16
    write_candidate(bad, {"output": bf16(np.array(t["output"]) * 1.25)})
    golden = str(pristine / "cases" / f"{FA3}.safetensors")
    assert main(["compare", golden, str(good)]) == 0
    assert "fa3_fp8: PASS" in capsys.readouterr().out
    float32 = tmp_path / "float32.safetensors"  # a float32 reference is not the kernel's bf16
    write_candidate(float32, {"output": np.array(t["output"]).astype(np.float32)})
    assert main(["compare", golden, str(float32)]) == 2
    err = capsys.readouterr().err
    assert "is not a bf16 value, the format fa3_fp8 returns output in" in err
    assert len(err.strip().splitlines()) == 1
    assert main(["compare", str(pristine), str(bad), "--case", FA3, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["passed"] is False and doc["tensors"]["output"]["outside"] > 0
    assert main(["compare", golden, str(good), "--atol", "1"]) == 2
    assert "does not apply to a quantised case" in capsys.readouterr().err


# -- a file's own claims never lower the checks ------------------------------------------------

def test_dropping_the_quant_record_leaves_the_quant_tensors_unexplained(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["cases"][FA3].pop("quant")
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    report = verify(bundle, gradcheck=False)
    bad = {p.tensor for p in report.all_problems if p.case_id == FA3}
    assert {"quant_output_mid", "quant_q_codes"} <= bad


def test_a_quant_record_on_a_float_case_or_codes_of_another_dtype_fail_by_name(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["cases"][VLLM]["quant"] = manifest["cases"][FA3]["quant"]  # codes it lacks
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    _reseal(bundle, SAGE, lambda t: t.update(quant_v_scale=np.ones(1)))  # () -> (1,)
    report = verify(bundle, gradcheck=False)
    reasons = {p.case_id: p.reason for p in report.all_problems}
    assert "quant_q_scale" in reasons[VLLM] or "quant_q_codes" in reasons[VLLM]
    assert "'quant_v_scale': expected float64 [], got float64 [1]" in reasons[SAGE]
    assert not report.passed


def test_a_nan_code_is_refused_by_the_gate_naming_tensor_and_index(bundle):
    def nan_code(t):
        t["quant_k_codes"][0, 1, 2, 3] = 0x7F  # e4m3fn's NaN
    _reseal(bundle, FA3, nan_code)
    report = verify(bundle, gradcheck=False)
    text = " ".join(p.reason for p in report.all_problems if p.case_id == FA3)
    assert "k:" in text and "(0, 1, 2, 3)" in text and "nan" in text.lower(), text


def test_the_quantized_flag_needs_a_quant_record(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["cases"][SAGE].pop("quant")
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    report = verify(bundle, gradcheck=False)
    assert any(p.case_id == SAGE and p.stage == "manifest" and "flag 'Quantized'" in p.reason
               for p in report.all_problems)


def test_a_numpy_generated_quantised_bundle_verifies_on_the_machine_that_wrote_it(tmp_path):
    out = tmp_path / "n"
    write_bundle(out, [CASES[FA3]()], suite="conformance", backend="numpy")
    report = verify(out, gradcheck=False)
    assert report.passed, report.format()
