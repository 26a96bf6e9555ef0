"""The conformance suite: coverage, labels that tell the truth, and the checked-in bundle.

``data/golden`` must be exactly what ``refattn golden --suite conformance --out DIR`` writes:
CI regenerates it and compares the sha256 of every file.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest

from refattn.bundle import write_bundle
from refattn.bundle.golden.spec import case_spec
from refattn.bundle.suites import SUITES, build_suite
from refattn.bundle.suites.conformance import CASES
from refattn.bundle.verification.verifier import verify
from refattn.cli import main

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "data" / "golden"


@pytest.fixture(scope="module")
def specs():
    return {case_id: case_spec(make()) for case_id, make in CASES.items()}


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# -- the checked-in bundle ------------------------------------------------------------------

def test_checked_in_suite_regenerates_bit_for_bit(tmp_path):
    assert main(["golden", "--suite", "conformance", "--out", str(tmp_path)]) == 0
    fresh, stored = _tree(tmp_path), _tree(GOLDEN)
    assert sorted(fresh) == sorted(stored), "data/golden lists other files than the generator"
    changed = [name for name in fresh if fresh[name] != stored[name]]
    assert not changed, (f"data/golden differs from `refattn golden --suite conformance` in "
                         f"{changed[:5]}; regenerate it with that command")


def test_checked_in_suite_verifies_and_is_small():
    report = verify(GOLDEN, exact=True)  # bit-identical recomputation and the certificate
    assert report.passed, report.format()
    assert len(report.cases) == len(CASES) and all(c.bit_identical for c in report.cases)
    assert all(c.certified for c in report.cases)
    size = sum(p.stat().st_size for p in GOLDEN.rglob("*") if p.is_file())
    assert size < 20 * 2**20
    manifest = json.loads((GOLDEN / "manifest.json").read_text())
    assert manifest["suite"] == "conformance"


def test_cases_are_independent_of_each_other(tmp_path):
    """Each case draws from its own seed: writing one case alone gives the same bytes."""
    stored = json.loads((GOLDEN / "manifest.json").read_text())["cases"]
    for case_id in ("tied_maxima", "dropout_philox", "noncontiguous_btnh_views"):
        out = tmp_path / case_id
        write_bundle(out, [CASES[case_id]()], suite="conformance")
        data = (out / "cases" / f"{case_id}.safetensors").read_bytes()
        assert hashlib.sha256(data).hexdigest() == stored[case_id]["sha256"]


# -- labels ---------------------------------------------------------------------------------

def test_registry_names_and_labels():
    assert "conformance" in SUITES and "contract" in SUITES
    cases = build_suite("conformance")
    assert len(cases) >= 40
    assert len({c.case_id for c in cases}) == len(cases)
    for c in cases:
        assert c.comment and "\n" not in c.comment and len(c.comment) < 160, c.case_id
        assert c.flags and all(re.fullmatch(r"[A-Z][A-Za-z0-9]+", f) for f in c.flags)
    flags = {f for c in cases for f in c.flags}
    required = {
        "SelfAttention", "CrossAttention", "UpperLeftCausal", "LowerRightCausal",
        "ExplicitPositions", "Decode", "ChunkedDecode", "KeyPadding", "QueryValid",
        "SanitizedRow", "PackedSegments", "PrefixLM", "SlidingWindow", "GQA", "MQA",
        "BiasFull", "BiasBroadcast", "ALiBi", "PhiloxDropout", "ExplicitMultiplier",
        "RealMultiplier", "AllDroppedRow", "LargeLogits", "TiedMaxima", "SingletonSupport",
        "DkNotDv", "NonContiguous", "ScalePlacement", "ExplicitScale", "ScoreBilinear",
        "ScoreAdditive", "ScoreCosine", "Softcap", "Sink",
    }
    assert required <= flags, sorted(required - flags)


def test_every_family_placement_and_modifier(specs):
    manifests = [s.call_manifest for s in specs.values()]
    assert {m["score"]["family"] for m in manifests} == {"dot", "bilinear", "additive", "cosine"}
    assert {m["scale"]["placement"] for m in manifests} == {
        "post_qk_product", "pre_query", "pre_key", "split_sqrt_query_and_key"}
    assert any(m["score_modifiers"]["softcap"] for m in manifests)
    assert any(m["score_modifiers"]["sink"] for m in manifests)
    assert {m["visibility"].get("alignment") for m in manifests} >= {
        "upper_left", "lower_right", "explicit_positions"}
    assert {m["dropout"]["mode"] for m in manifests} == {"none", "explicit_multiplier",
                                                        "stream"}


def _with_flag(specs, flag):
    out = [s for s in specs.values() if flag in s.flags]
    assert out, flag
    return out


def test_flags_describe_the_tensors(specs):
    for s in _with_flag(specs, "LowerRightCausal"):  # key j visible iff j <= i + K - Q
        Q, K = s.axes["Q"], s.axes["K"]
        lower_right = np.broadcast_to(np.tri(Q, K, K - Q, dtype=bool), s.score_shape)
        assert np.array_equal(s.visible_full(), lower_right), s.case_id
    s = specs["causal_lower_right_q3_k7"]
    assert np.array_equal(s.visible_full()[0, 0], np.tri(3, 7, 4, dtype=bool))
    s = specs["causal_upper_left_q3_k7"]
    assert np.array_equal(s.visible_full()[0, 0], np.tri(3, 7, 0, dtype=bool))
    s = specs["decode_one_token_pos127"]
    assert s.axes["Q"] == 1 and s.call_manifest["visibility"]["relation"]["q_positions"] == [[127]]
    assert s.visible_full().all()
    returned = _with_flag(specs, "ReturnedWeights")
    assert {s.returned_weights for s in returned} == {"pre_dropout", "post_dropout"}
    for s in returned:  # P and P * Z differ here, so the manifest's label decides the object
        assert not np.array_equal(s.tensors["probs"], s.tensors["consumed"]), s.case_id
    for s in _with_flag(specs, "AllDroppedRow"):
        dropped = (s.tensors["consumed"] == 0).all(-1) & (s.tensors["probs"] > 0).any(-1)
        assert dropped.any() and (s.tensors["output"][dropped] == 0).all()
    for s in _with_flag(specs, "LargeLogits"):
        legal = s.tensors["scores"][s.visible_full()]
        assert np.abs(legal).min() > 900 and np.abs(legal).max() < 1100
    for s in _with_flag(specs, "TiedMaxima"):
        ms = s.tensors["masked_scores"]
        ties = (ms == s.tensors["row_max"][..., None]).sum(-1)
        assert (ties >= 2).any()
    for s in _with_flag(specs, "SingletonSupport"):
        assert (s.visible_full().sum(-1) == 1).all()
        assert (s.tensors["grad_scores"] == 0).all()
    for s in _with_flag(specs, "SanitizedRow"):
        rows = s.tensors["sanitized_rows"]
        assert rows.any() and (s.tensors["output"][rows] == 0).all()
    for s in _with_flag(specs, "NonContiguous"):
        assert not s.layout("query")["contiguous"]
    for s in _with_flag(specs, "PhiloxDropout"):
        assert s.dropout["mode"] == "stream" and "philox" in s.dropout["algorithm"].lower()
    for s in _with_flag(specs, "DkNotDv"):
        assert s.axes["Dk"] != s.axes["Dv"]
    for s in _with_flag(specs, "CrossAttention"):
        assert s.axes["Q"] != s.axes["K"]
    for s in _with_flag(specs, "MQA"):
        assert s.axes["Hkv"] == 1 and s.axes["Hq"] > 1
    assert any(s.axes["Hq"] == 8 and s.axes["Hkv"] == 2 for s in _with_flag(specs, "GQA"))
    for s in _with_flag(specs, "BiasCannotRevive"):
        assert (s.tensors["probs"][~s.visible_full(sanitized=True)] == 0).all()
