"""verify and compare mean what they say (issue 16, item 5): recorded conventions and flags are
checked against the rebuilt call, a regenerated numpy case must be bit-identical where numpy
and its BLAS are the same, and a candidate must hold the tensors its check needs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from refattn.bundle import write_bundle
from refattn.bundle.comparison.candidates import write_candidate
from refattn.bundle.comparison.harness import compare, required_tensors
from refattn.bundle.storage.format import tensor_sha256
from refattn.bundle.storage.read import load
from refattn.bundle.suites import build_suite
from refattn.bundle.verification.verifier import verify
from refattn.cli import main
from tests.bundle.resealing import reseal_case_file

LOOP6 = "loop6_two_query_training_trace"
LOOP7 = "loop7_cross_attention_padded_source"




def _edit_entry(bundle: Path, case: str, edit) -> None:
    path = bundle / "manifest.json"
    m = json.loads(path.read_text())
    edit(m["cases"][case])
    path.write_text(json.dumps(m))


@pytest.mark.parametrize(("edit", "reason"), [
    (lambda e: e["conventions"].update(all_masked_rows="sanitize_then_zero_invalid_query"),
     "convention 'all_masked_rows': recorded 'sanitize_then_zero_invalid_query'"),
    (lambda e: e["conventions"].update(scale={"decimal": "0.25", "hex": (0.25).hex()}),
     "convention 'scale'"),
    (lambda e: e["conventions"].update(returned_weights="post_dropout"),
     "convention 'returned_weights'"),
    (lambda e: e["conventions"].pop("gqa_mapping"), "convention 'gqa_mapping' is not recorded"),
    (lambda e: e["flags"].append("Softcap"), "flag 'Softcap' claims a softcap"),
    (lambda e: e["flags"].append("PhiloxDropout"), "flag 'PhiloxDropout' claims"),
])
def test_recorded_conventions_and_flags_must_match_the_rebuilt_call(bundle, edit, reason):
    """Before: verify rebuilt the call and never looked at what the entry claimed about it."""
    _edit_entry(bundle, LOOP6, edit)
    r = verify(bundle, gradcheck=False)
    problems = [p for p in r.all_problems if p.case_id == LOOP6]
    assert problems and all(p.stage == "manifest" for p in problems)
    assert any(reason in p.reason for p in problems), [p.reason for p in problems]


def _reseal(bundle: Path, case: str, change) -> None:
    """Change a stored tensor and re-seal every checksum, so only recomputation can tell."""
    new, tensors = reseal_case_file(bundle, case, change)

    def fix(entry):
        entry["sha256"] = hashlib.sha256(new).hexdigest()
        for n, t in tensors.items():
            entry["tensors"][n]["sha256"] = tensor_sha256(t)
    _edit_entry(bundle, case, fix)


def test_a_numpy_bundle_3e_11_off_fails_on_the_machine_that_made_it(tmp_path):
    """Before: the float64 rule (1e-12 + 1e-10 |g|) accepted a 3e-11 change of output."""
    out = tmp_path / "b"
    write_bundle(out, build_suite("contract")[:1], suite="contract", backend="numpy")
    assert verify(out, gradcheck=False).passed

    def nudge(t):
        t["output"][0, 0, 1, 0] += 3e-11

    _reseal(out, LOOP6, nudge)
    r = verify(out, gradcheck=False)
    bound, regenerated = [p for p in r.all_problems if p.stage == "recompute"]
    assert bound.tensor == "output" and "beyond the float64 backend bound" in bound.reason
    assert regenerated.tensor == "output" and "not bit-identical" in regenerated.reason
    assert "worst at (0, 0, 1, 0)" in regenerated.reason and "|d| = 3.0" in regenerated.reason


def test_a_numpy_bundle_from_another_blas_is_held_to_the_float64_backend_bound(tmp_path):
    """Before: another BLAS's numpy bundle met ``1e-12 + 1e-10 |g|``, and a 5e-11 relative
    change of output passed; now it is held to the float64 backend bound of the correctly
    rounded result (issue 25), which an untouched bundle from another BLAS still meets."""
    out = tmp_path / "b"
    write_bundle(out, build_suite("contract")[:1], suite="contract", backend="numpy")
    m = json.loads((out / "manifest.json").read_text())
    m["generator"]["blas"] = [{"library": "mkl", "version": "2025", "architecture": "x"}]
    (out / "manifest.json").write_text(json.dumps(m))
    r = verify(out, gradcheck=False)
    assert r.passed and r.cases[0].guarantee.kind in ("within_bound", "bit_identical")

    def nudge(t):
        t["output"][0, 0, 1, 0] *= 1 + 5e-11  # 2e5 ulp: no float64 backend is that far

    _reseal(out, LOOP6, nudge)
    r = verify(out, gradcheck=False)
    (problem,) = r.all_problems
    assert (problem.tensor, problem.stage) == ("output", "recompute")
    assert problem.reason.startswith("beyond the float64 backend bound of the correctly "
                                     "rounded result: at (0, 0, 1, 0)")


# -- compare ---------------------------------------------------------------------------------

def test_an_empty_candidate_fails(bundle, tmp_path, capsys):
    case = bundle / "cases" / f"{LOOP7}.safetensors"
    empty = write_candidate(tmp_path / "empty.safetensors", {})
    assert main(["compare", str(case), str(empty)]) == 1
    out = capsys.readouterr().out
    assert "FAIL output: missing" in out
    assert not compare({}, load(case), check="listed").passed


def test_a_candidate_missing_every_required_tensor_fails(bundle, tmp_path, capsys):
    gold = load(bundle / "cases" / f"{LOOP7}.safetensors").tensors
    only_lse = write_candidate(tmp_path / "lse.safetensors", {"lse": gold["lse"]})
    case = str(bundle / "cases" / f"{LOOP7}.safetensors")
    assert main(["compare", case, str(only_lse)]) == 1
    assert "'output', which a forward comparison needs" in capsys.readouterr().out
    assert main(["compare", case, str(only_lse), "--check", "listed"]) == 0
    capsys.readouterr()
    grads = write_candidate(tmp_path / "g.safetensors",
                            {"output": gold["output"], "grad_q": gold["grad_q"]})
    assert main(["compare", case, str(grads)]) == 1
    out = capsys.readouterr().out
    for name in ("grad_k", "grad_v", "grad_bias"):
        assert f"FAIL {name}: missing" in out


def test_required_tensors_follow_the_golden_case():
    assert required_tensors("forward", ["output", "grad_q"]) == ("output",)
    assert required_tensors("gradients", ["output", "grad_q", "grad_k", "grad_v", "grad_sink",
                                          "grad_score_W"]) == (
        "output", "grad_q", "grad_k", "grad_v", "grad_sink", "grad_score_W")
    with pytest.raises(ValueError, match="check: expected one of"):
        required_tensors("everything", [])
