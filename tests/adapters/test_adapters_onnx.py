"""Issue 19 item 6: the conformance suite through the ONNX Attention operator (opsets 23 and
24), run by the ONNX reference evaluator and by onnxruntime, compared with the goldens in
float32 under refattn's reference-relative rule; the backend-test export; the cases the
operator cannot express. Skips cleanly where onnx (or onnxruntime) is absent."""

from __future__ import annotations

import numpy as np
import pytest

from refattn import RefAttnError
from refattn.bundle.golden.spec import case_spec
from refattn.bundle.suites import build_suite
from refattn.bundle.suites.conformance import CASES

onnx = pytest.importorskip("onnx")
ox = pytest.importorskip("refattn.adapters.onnx")

SPECS = {c.case_id: case_spec(c) for c in build_suite("conformance")}
EXPRESSIBLE = sorted(n for n, s in SPECS.items() if ox.ineligible(s) is None)
RUNTIMES = ["reference", "onnxruntime"]
FLT_LOWEST = float(np.finfo(np.float32).min)

#: every conformance case the operator cannot express, and why (pinned)
NOT_EXPRESSIBLE = {
    "dropout multiplier": ["all_dropped_row", "dropout_explicit_inverted", "dropout_philox",
                           "dropout_philox_gqa_causal", "dropout_real_multiplier",
                           "loop6_two_query_training_trace", "returned_weights_post_dropout",
                           "returned_weights_pre_dropout"],
    "sink logit": ["sink_empty_rows_lower_right", "sink_per_head", "sink_softcap_gqa_causal"],
    "score family": ["score_additive", "score_bilinear_per_head",
                     "score_bilinear_shared_dq6_dk4", "score_cosine_zero_key"],
    "query_valid is False on row": ["query_valid_rows_with_keys"],
}


def _runtime(name):
    if name == "onnxruntime":
        pytest.importorskip("onnxruntime")
    return name


def test_the_cases_the_operator_cannot_express():
    found: dict[str, list[str]] = {}
    for case_id, spec in SPECS.items():
        why = ox.ineligible(spec)
        if why is not None:
            key = next(k for k in NOT_EXPRESSIBLE if why.startswith(k))
            found.setdefault(key, []).append(case_id)
    assert {k: sorted(v) for k, v in found.items()} == NOT_EXPRESSIBLE
    assert len(EXPRESSIBLE) == len(SPECS) - sum(map(len, NOT_EXPRESSIBLE.values()))
    with pytest.raises(RefAttnError, match=r"dropout_philox: not expressible as an ONNX "
                                           r"Attention node: dropout multiplier"):
        ox.lowering(SPECS["dropout_philox"])


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("case_id", EXPRESSIBLE)
def test_every_expressible_case_matches_its_golden_in_float32(case_id, runtime):
    spec = SPECS[case_id]
    for opset in ox.OPSETS:
        res = ox.run(spec, runtime=_runtime(runtime), opset=opset)
        report = res.compare(spec)
        assert res.precision == "float32" and "output" in res.tensors
        assert report.passed, f"opset {opset}: {report.format()}"
        if res.manifest["backend"]["past_key_length"]:  # present = past ++ current
            assert {"k", "v"} <= set(res.tensors)


def test_lowering_decisions():
    low = {n: ox.lowering(SPECS[n]) for n in SPECS if n in EXPRESSIBLE}
    assert (low["causal_square"].is_causal, low["causal_square"].past) == (True, 0)
    assert (low["causal_upper_left_q3_k7"].is_causal, low["causal_upper_left_q3_k7"].past) == (
        True, 0)  # no cache: offset 0, the upper-left triangle
    assert (low["causal_lower_right_q3_k7"].is_causal, low["causal_lower_right_q3_k7"].past) == (
        True, 4)  # the first K - Q keys as past_key: offset = past length
    assert low["chunked_decode_4_at_124"].past == 124
    assert low["key_padding_lengths_7_5_2"].mask == "bool"  # opset 23: no nonpad_kv_seqlen
    v24 = ox.lowering(SPECS["key_padding_lengths_7_5_2"], opset=24)
    assert v24.mask == "none" and v24.nonpad_kv_seqlen == (7, 5, 2)
    assert low["bias_cannot_revive"].mask == "float" and low["alibi_causal"].mask == "float"
    assert low["gqa_explicit_head_map"].expand_kv and not low["gqa_hq8_hkv2_causal"].expand_kv
    assert low["streaming_llm_window_or_first_tokens"].mask == "bool"
    assert low["scale_placement_q"].scale == SPECS["scale_placement_q"].scale
    with pytest.raises(RefAttnError, match=r"opset: 22 is outside the allowed range \[23, 24\]"):
        ox.lowering(SPECS["causal_square"], opset=22)
    with pytest.raises(RefAttnError, match=r"qk_mode: 4 is outside the allowed range \[0, 3\]"):
        ox.lowering(SPECS["causal_square"], qk_mode=4)
    # issue 40: an integer attribute is an integer (True is not mode 1, 23.0 not opset 23)
    with pytest.raises(RefAttnError, match=r"qk_mode: expected an integer .*, got True"):
        ox.lowering(SPECS["causal_square"], qk_mode=True)
    with pytest.raises(RefAttnError, match=r"opset: expected an integer .*, got 23.0"):
        ox.lowering(SPECS["causal_square"], opset=23.0)
    assert ox.lowering(SPECS["causal_square"], opset=np.int64(24), qk_mode=np.int8(3)) == (
        ox.lowering(SPECS["causal_square"], opset=24, qk_mode=3))
    with pytest.raises(RefAttnError, match=r"runtime: expected one of 'reference', 'onnxruntime'"):
        ox.run(SPECS["causal_square"], runtime="tvm")


QK_CASES = ["causal_lower_right_q3_k7", "softcap_5", "bias_full", "key_padding_causal",
            "causal_lower_right_q6_k4_sanitized", "gqa_hq8_hkv2_causal"]


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("case_id", QK_CASES)
def test_qk_matmul_output_modes(case_id, runtime):
    """Modes 0-3 against softcap_input / scores, scores, masked_scores and probs, with the two
    runtimes' documented departures pinned: onnxruntime writes float32's lowest finite value
    (not -inf) at entries a bool mask or is_causal removes in mode 2; onnx 1.23's reference
    evaluator returns the capped scores in mode 0 (its schema says the raw product). Where
    refattn sanitises a row (an unused row with no key gets the temporary key 0) the
    operator's rows are all masked, so modes 2 and 3 differ on those rows by the convention,
    and are compared off them."""
    spec = SPECS[case_id]
    sanitized = spec.tensors["sanitized_rows"]  # (B, Hq, Q)
    for mode in (0, 1, 2, 3):
        res = ox.run(spec, runtime=_runtime(runtime), qk_mode=mode)
        name = ox.QK_OUTPUT[mode] if not (mode == 0 and spec.softcap) else "softcap_input"
        got = np.asarray(res.tensors[name], dtype=np.float64)
        gold = np.asarray(spec.tensors[name])
        keep = np.ones(gold.shape, bool)
        if mode >= 2:  # off the sanitised rows
            keep = ~np.broadcast_to(sanitized[..., None], gold.shape)
        if mode == 2 and runtime == "onnxruntime":
            masked = np.isneginf(gold) & keep
            # an additive -inf mask stays -inf; entries a bool mask or is_causal removes get
            # float32's lowest finite value
            stand_in = -np.inf if ox.lowering(spec).mask == "float" else FLT_LOWEST
            assert (got[masked] == stand_in).all()
            got = np.where(got == FLT_LOWEST, -np.inf, got)
        if mode == 0 and spec.softcap and runtime == "reference":
            name, gold = "scores", np.asarray(spec.tensors["scores"])  # the evaluator's cap
        fin = np.isfinite(gold) & keep
        np.testing.assert_array_equal(np.isneginf(got)[keep], np.isneginf(gold)[keep])
        np.testing.assert_allclose(got[fin], gold[fin], rtol=2e-6, atol=2e-6,
                                   err_msg=f"mode {mode} ({name})")
        if not sanitized.any() and not (mode == 0 and spec.softcap and runtime == "reference"):
            clean = {n: x for n, x in res.tensors.items()}
            if mode == 2 and runtime == "onnxruntime":
                clean[name] = np.where(clean[name] == FLT_LOWEST, -np.inf, clean[name])
            assert res.__class__(res.case_id, res.path, res.precision, clean).compare(
                spec).passed


def test_float64_node_on_the_reference_evaluator_meets_the_float64_rule():
    for case_id in ("causal_lower_right_q3_k7", "bias_full", "alibi_per_batch_slopes",
                    "paged_kv_decode"):
        spec = SPECS[case_id]
        res = ox.run(spec, dtype="float64")
        assert res.precision == "float64"
        assert res.compare(spec).passed, res.compare(spec).format()


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize(("case_id", "opset", "qk_mode"), [
    ("causal_lower_right_q3_k7", 23, None), ("key_padding_lengths_7_5_2", 24, None),
    ("softcap_5", 23, 3), ("streaming_llm_window_or_first_tokens", 23, None)])
def test_backend_test_export_runs_as_an_onnx_node_test(tmp_path, case_id, opset, qk_mode,
                                                        runtime):
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    root = ox.export_backend_test(SPECS[case_id], tmp_path, opset=opset, qk_mode=qk_mode)
    assert root.name == f"test_refattn_{case_id}"
    model = onnx.load(root / "model.onnx")
    onnx.checker.check_model(model)
    assert model.opset_import[0].version == opset
    data = root / "test_data_set_0"
    inputs = [numpy_helper.to_array(onnx.load_tensor(str(data / f"input_{n}.pb")))
              for n in range(len(model.graph.input))]
    names = [i.name for i in model.graph.input]
    for n, i in enumerate(model.graph.input):  # each .pb is named after its graph input
        assert onnx.load_tensor(str(data / f"input_{n}.pb")).name == i.name
    expected = [numpy_helper.to_array(onnx.load_tensor(str(data / f"output_{n}.pb")))
                for n in range(len(model.graph.output))]
    feeds = dict(zip(names, inputs, strict=True))
    if _runtime(runtime) == "reference":
        got = ReferenceEvaluator(model).run(None, feeds)
    else:
        import onnxruntime

        got = onnxruntime.InferenceSession(model.SerializeToString(),
                                           providers=["CPUExecutionProvider"]).run(None, feeds)
    for g, e in zip(got, expected, strict=True):
        # ONNX's backend test runner's default tolerances
        np.testing.assert_allclose(g, e, rtol=1e-3, atol=1e-7)
    gold = SPECS[case_id].tensors["output"].astype(np.float32)
    np.testing.assert_array_equal(expected[0], gold)  # output_0.pb is the golden, rounded


def test_case_registry_is_the_suite():
    assert set(SPECS) == set(CASES)
