"""PyTorch adapter: every eligible conformance case through SDPA, eager and MHA.

float64 must pass the float64 rule (forward and autograd gradients); float32 and bfloat16
must pass the reference-relative rule. Lowering decisions (polarity, is_causal, scale, GQA)
are checked on the arguments torch actually receives.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

torch = pytest.importorskip("torch")
pytest.importorskip("ml_dtypes")

import torch.nn.functional as F  # noqa: E402

from refattn import RefAttnError  # noqa: E402
from refattn.adapters import torch as adapter  # noqa: E402
from refattn.bundle.comparison.harness import compare  # noqa: E402
from refattn.bundle.comparison.tolerances import Tolerances  # noqa: E402
from refattn.bundle.golden.spec import case_spec  # noqa: E402
from refattn.bundle.suites.conformance import CASES  # noqa: E402
from tests.strategies import engine_calls  # noqa: E402

pytestmark = pytest.mark.torch

IDS = list(CASES)

@pytest.fixture(scope="module")
def specs():
    return {case_id: case_spec(make()) for case_id, make in CASES.items()}


def _eligible(specs, path):
    return [s for s in specs.values() if adapter.ineligible(s, path) is None]


# -- every case, every path, three precisions ---------------------------------------------

@pytest.mark.parametrize("path", adapter.PATHS)
def test_float64_every_eligible_case(specs, path):
    eligible = _eligible(specs, path)
    assert len(eligible) >= {"sdpa": 40, "eager": 60, "mha": 40}[path]
    for spec in eligible:
        res = adapter.run(spec, path, dtype="float64")
        assert {"output", "grad_q", "grad_k", "grad_v"} <= set(res.tensors), spec.case_id
        if "bias" in spec.tensors:
            assert res.tensors["grad_bias"].shape == spec.tensors["bias"].shape
        report = res.compare(spec)
        assert report.passed, f"{path} {spec.case_id}\n{report.format()}"
        assert report.precision == "float64"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("path", adapter.PATHS)
def test_lower_precision_every_eligible_case(specs, path, dtype):
    for spec in _eligible(specs, path):
        res = adapter.run(spec, path, dtype=dtype)
        assert all(x.dtype.name == dtype for x in res.tensors.values()
                   if x.dtype.kind == "f" or x.dtype.name == "bfloat16")
        report = res.compare(spec)
        assert report.passed, f"{path} {dtype} {spec.case_id}\n{report.format()}"
        assert all(row.rule in ("reference_relative", "exact") for row in report.tensors)


def test_flash_backward_is_judged_against_the_lse_recompute_route(specs):
    """flash_attention_cpu recomputes P = exp(S - lse) from a float32 lse near -1000; the
    naive yardstick includes that saved-state route, so the fused kernel and the math
    backend both meet the default rule."""
    from refattn.bundle.comparison.lowp import naive_lowp

    spec = specs["large_logits_negative"]
    fused = adapter.run(spec, "sdpa", dtype="float32")
    assert fused.manifest["backend"]["selected_backend"] == "flash_attention_cpu"
    math = adapter.run(spec, "sdpa", dtype="float32", backend="math")
    assert math.manifest["backend"]["selected_backend"] == "math"
    assert fused.compare(spec).passed and math.compare(spec).passed
    g = spec.tensors["grad_q"]
    f32 = np.dtype(np.float32)
    stored, rec = (np.abs(naive_lowp(spec, f32, route=r)["grad_q"] - g).max()
                   for r in ("stored_probs", "lse_recompute"))
    assert rec > 2 * stored  # recomputing from a rounded lse costs accuracy at |lse| ~ 1000
    only_stored = Tolerances(naive_routes=("stored_probs",))
    assert fused.compare(spec, tolerances=only_stored)["grad_q"].ratio > 3


def test_eager_path_returns_the_whole_trace(specs):
    spec = specs["softcap_5"]
    res = adapter.run(spec, "eager")
    for name in ("softcap_input", "scores", "biased_scores", "masked_scores", "row_max", "lse",
                 "probs", "consumed", "output", "grad_consumed", "grad_probs", "grad_scores",
                 "grad_softcap_input", "grad_q", "grad_k", "grad_v", "grad_bias"):
        assert name in res.tensors, name
    assert res.compare(spec).passed
    sink = adapter.run(specs["sink_per_head"], "eager")
    assert {"sink_probs", "grad_sink"} <= set(sink.tensors)
    additive = adapter.run(specs["score_additive"], "eager")
    assert {"grad_score_Wq", "grad_score_Wk", "grad_score_b", "grad_score_v"} <= set(
        additive.tensors)


def test_eager_injects_the_golden_dropout_multiplier(specs):
    for case_id in ("dropout_philox", "all_dropped_row", "dropout_real_multiplier",
                    "loop6_two_query_training_trace"):
        spec = specs[case_id]
        assert adapter.ineligible(spec, "sdpa") is not None
        assert adapter.ineligible(spec, "mha") is not None
        res = adapter.run(spec, "eager")
        assert np.array_equal(res.tensors["dropout_multiplier"],
                              spec.tensors["dropout_multiplier"])
        assert res.compare(spec).passed
        assert res.manifest["dropout"]["adapter"] == "injected_golden_multiplier"


def test_mha_without_weights_takes_the_sdpa_path(specs):
    spec = specs["key_padding_lengths_7_5_2"]
    with_w = adapter.run(spec, "mha", need_weights=True)
    without = adapter.run(spec, "mha", need_weights=False)
    assert "probs" in with_w.tensors and "probs" not in without.tensors
    assert with_w.manifest["backend"]["selected_backend"] == "mha_explicit_softmax"
    assert without.manifest["backend"]["selected_backend"] in ("flash_attention_cpu", "math")
    assert with_w.compare(spec).passed and without.compare(spec).passed


# -- lowering decisions, checked on what torch receives ---------------------------------------

def _record(monkeypatch, name):
    calls = []
    real = getattr(F, name)

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, name, spy)
    return calls


@pytest.mark.parametrize("causal", ["explicit", "auto"])
def test_is_causal_never_for_non_square_lower_right(specs, monkeypatch, causal):
    calls = _record(monkeypatch, "scaled_dot_product_attention")
    checked = 0
    for spec in _eligible(specs, "sdpa"):
        a = spec.axes
        alignment = spec.call_manifest["visibility"].get("alignment")
        if a["Q"] == a["K"] or alignment not in ("lower_right", "explicit_positions"):
            continue
        calls.clear()
        adapter.run(spec, "sdpa", causal=causal)
        (_, kwargs), = calls
        assert kwargs["is_causal"] is False, spec.case_id
        mask = kwargs["attn_mask"]
        if mask is None:  # every edge legal (e.g. decode at 127 over 128 slots)
            assert spec.visible_full().all()
        elif mask.dtype == torch.bool:  # SDPA polarity: True participates
            assert np.array_equal(mask.numpy(), spec.visible_full(sanitized=True))
        checked += 1
    assert checked >= 6


def test_is_causal_only_where_it_is_the_whole_support(specs, monkeypatch):
    calls = _record(monkeypatch, "scaled_dot_product_attention")
    for case_id, expected in (("causal_square", True), ("causal_upper_left_q3_k7", True),
                              ("causal_lower_right_q3_k7", False), ("key_padding_causal", False),
                              ("alibi_causal", False), ("gqa_hq8_hkv2_causal", True)):
        calls.clear()
        res = adapter.run(specs[case_id], "sdpa", causal="auto")
        (_, kwargs), = calls
        assert kwargs["is_causal"] is expected, case_id
        assert (kwargs["attn_mask"] is None) is expected
        assert res.manifest["backend"]["is_causal"] is expected
        assert res.compare(specs[case_id]).passed


def test_scale_is_always_explicit_and_gqa_is_native_or_expanded(specs, monkeypatch):
    calls = _record(monkeypatch, "scaled_dot_product_attention")
    for spec in _eligible(specs, "sdpa"):
        calls.clear()
        adapter.run(spec, "sdpa")
        (_, kw), = calls
        expected = spec.scale if spec.scale_placement == "post" else 1.0
        assert kw["scale"] == expected and kw["dropout_p"] == 0.0
        a = spec.axes
        grouped = spec.head_map_mode == "grouped"
        assert kw["enable_gqa"] is (grouped and a["Hq"] != a["Hkv"])
    calls.clear()
    spec = specs["gqa_explicit_head_map"]
    res = adapter.run(spec, "sdpa")
    (args, kw), = calls
    assert kw["enable_gqa"] is False and args[1].shape[1] == 4  # expanded by head_map
    assert res.manifest["backend"]["gqa"] == "expanded_kv" and res.compare(spec).passed
    calls.clear()
    spec = specs["gqa_hq8_hkv2_causal"]
    expanded = adapter.run(spec, "sdpa", gqa="expand")
    (args, kw), = calls
    assert kw["enable_gqa"] is False and args[1].shape[1] == 8
    assert expanded.compare(spec).passed


def test_mha_inverted_polarity(specs, monkeypatch):
    calls = _record(monkeypatch, "multi_head_attention_forward")
    spec = specs["key_padding_lengths_7_5_2"]
    adapter.run(spec, "mha")
    (_, kw), = calls
    valid = spec.tensors["visible"][:, 0, 0, :]  # (B, K)
    assert kw["attn_mask"] is None
    assert np.array_equal(kw["key_padding_mask"].numpy(), ~valid)  # True = ignored
    calls.clear()
    spec = specs["causal_lower_right_q3_k7"]
    adapter.run(spec, "mha")
    (_, kw), = calls
    blocked = kw["attn_mask"].numpy().reshape(spec.score_shape)
    assert np.array_equal(blocked, ~spec.visible_full())  # True = blocked


def test_polarity_and_alignment_bugs_are_caught(specs):
    """Negative controls: the mistakes the adapters avoid fail the comparison."""
    tc = adapter.case_tensors(specs["key_padding_lengths_7_5_2"])
    spec = specs["key_padding_lengths_7_5_2"]
    inverted = F.scaled_dot_product_attention(
        tc.q, tc.k, tc.v, attn_mask=~tc.visible, scale=spec.scale)  # MHA polarity into SDPA
    assert not compare({"output": inverted.detach()}, spec).passed
    spec = specs["causal_lower_right_q3_k7"]
    tc = adapter.case_tensors(spec)
    upper_left = F.scaled_dot_product_attention(tc.q, tc.k, tc.v, is_causal=True,
                                                scale=spec.scale)
    assert not compare({"output": upper_left.detach()}, spec).passed
    spec = specs["explicit_scale_0p2"]
    tc = adapter.case_tensors(spec)
    default = F.scaled_dot_product_attention(tc.q, tc.k, tc.v)  # scale=None: Dk**-0.5
    assert not compare({"output": default.detach()}, spec).passed


# -- manifest, tensors, errors ------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore:.*[Ff]lash attention:UserWarning")
def test_manifest_records_requested_and_observed_backend(specs):
    spec = specs["self_attention_basic"]
    auto = adapter.run(spec, "sdpa")
    b = auto.manifest["backend"]
    assert b["framework_revision"] == f"torch {torch.__version__}"
    assert b["entrypoint"] == "torch.nn.functional.scaled_dot_product_attention"
    assert b["requested_backend"] == "auto"
    assert b["selected_backend"] == "flash_attention_cpu"  # Dk == Dv, no mask: fused CPU kernel
    assert auto.manifest["dropout"]["p"] == 0.0 and auto.manifest["dropout"]["training"] is False
    math = adapter.run(spec, "sdpa", backend="math")
    assert (math.manifest["backend"]["requested_backend"],
            math.manifest["backend"]["selected_backend"]) == ("math", "math")
    assert math.manifest["materialization"] == {"scores": True, "probabilities": True}
    flash = adapter.run(spec, "sdpa", backend="flash")
    assert flash.manifest["backend"]["selected_backend"] == "flash_attention_cpu"
    with pytest.raises(RefAttnError, match="torch sdpa"):
        adapter.run(specs["dk16_dv3"], "sdpa", backend="flash")  # Dk != Dv: not eligible
    assert adapter.run(specs["bias_full"], "eager").manifest["backend"]["selected_backend"] == \
        "eager"


def test_case_tensors_keep_dtype_and_recorded_strides(specs):
    spec = specs["noncontiguous_btnh_views"]
    for dtype in ("float64", "float32", "bfloat16"):
        tc = adapter.case_tensors(spec, dtype=dtype)
        assert list(tc.q.stride()) == spec.layout("query")["stride"]
        assert not tc.q.is_contiguous() and str(tc.q.dtype) == f"torch.{dtype}"
    res = adapter.run(spec, "sdpa", dtype="float64")
    assert res.compare(spec).passed


def test_bfloat16_inputs_round_once_like_the_naive_reference(specs):
    from refattn.bundle.comparison.lowp import naive_lowp
    from refattn.bundle.comparison.tolerances import resolve_dtype

    spec = specs["bias_full"]
    tc = adapter.case_tensors(spec, dtype="bfloat16")
    lp = naive_lowp(spec, resolve_dtype("bfloat16"))
    assert np.array_equal(tc.q.detach().float().numpy(), lp["q"])
    assert np.array_equal(tc.bias.detach().float().numpy(), lp["bias"])


def test_ineligible_paths_say_why(specs):
    assert "score family" in adapter.ineligible(specs["score_additive"], "sdpa")
    assert "softcap" in adapter.ineligible(specs["softcap_5"], "mha")
    assert "sink" in adapter.ineligible(specs["sink_per_head"], "sdpa")
    assert "Dk != Dv" in adapter.ineligible(specs["dk16_dv3"], "mha")
    with pytest.raises(RefAttnError, match="cannot run this case"):
        adapter.run(specs["dropout_philox"], "sdpa")
    with pytest.raises(RefAttnError, match="path"):
        adapter.ineligible(specs["bias_full"], "flex")


# -- property: generated calls of every feature --------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(call=engine_calls(max_len=6))
def test_generated_calls_every_path(call):
    """Random relations, head maps, biases, dropout and sanitised rows: each eligible path
    passes in float64 and bfloat16."""
    from refattn.bundle import GoldenCase

    g_o = np.random.default_rng(1).standard_normal((*call.q.shape[:3], call.v.shape[3]))
    spec = case_spec(GoldenCase("generated", call, g_o, "generated call"))
    for path in adapter.PATHS:
        if adapter.ineligible(spec, path) is not None:
            continue
        for dtype in ("float64", "bfloat16"):
            report = adapter.run(spec, path, dtype=dtype).compare(spec)
            assert report.passed, f"{path} {dtype}\n{report.format()}"


def test_compare_takes_torch_tensors_directly(specs):
    spec = specs["bias_full"]
    tc = adapter.case_tensors(spec, dtype="float64")
    out = F.scaled_dot_product_attention(tc.q, tc.k, tc.v, attn_mask=tc.bias,
                                         scale=spec.scale)  # a tensor that requires grad
    assert compare({"output": out}, spec).passed
    tb = adapter.case_tensors(spec, dtype="bfloat16")
    out_bf16 = F.scaled_dot_product_attention(tb.q, tb.k, tb.v, attn_mask=tb.bias,
                                              scale=spec.scale)
    report = compare({"output": out_bf16}, spec)
    assert report.precision == "bfloat16" and report.passed
