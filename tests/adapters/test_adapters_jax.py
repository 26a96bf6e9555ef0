"""JAX adapter: lowering decisions (pure numpy, always run) and, when jax is installed,
every eligible conformance case through jax.nn.dot_product_attention."""

from __future__ import annotations

import numpy as np
import pytest

from refattn import RefAttnError
from refattn.adapters import jax as adapter
from refattn.bundle.golden.spec import case_spec
from refattn.bundle.suites.conformance import CASES


@pytest.fixture(scope="module")
def specs():
    return {case_id: case_spec(make()) for case_id, make in CASES.items()}


def _eligible(specs):
    return [s for s in specs.values() if adapter.ineligible(s) is None]


# -- decisions: no jax needed ---------------------------------------------------------------

def test_native_support_matches_the_relation_compiler():
    from refattn.masks import causal, relation

    for T, S in ((4, 4), (3, 7)):
        ul = causal(T, S, alignment="upper_left").dense()[0, 0]
        assert np.array_equal(adapter.native_support(T, S, is_causal=True, window=None), ul)
    pos = np.arange(6)[None, :]
    for left, right in ((2, 0), (1, 3), (0, 0)):
        rel = relation(pos, pos, window=(left, right)).dense()[0, 0]
        got = adapter.native_support(6, 6, is_causal=False, window=(left, right))
        assert np.array_equal(got, rel)


def test_native_arguments_only_where_exact(specs):
    expected = {
        "causal_square": (True, None),
        "causal_upper_left_q3_k7": (True, None),
        "sliding_window_causal_incl3": (True, (2, 0)),
        "sliding_window_bidirectional": (False, (2, 2)),
        "gqa_hq8_hkv2_causal": (True, None),
    }
    for case_id, (causal, window) in expected.items():
        a = adapter.call_arguments(specs[case_id], native="auto")
        assert (a.is_causal, a.local_window_size, a.mask) == (causal, window, False), case_id
        explicit = adapter.call_arguments(specs[case_id])
        assert (explicit.is_causal, explicit.local_window_size, explicit.mask) == (
            False, None, True)
    for spec in specs.values():
        a = adapter.call_arguments(spec, native="auto")
        ax = spec.axes
        alignment = spec.call_manifest["visibility"].get("alignment")
        if ax["Q"] != ax["K"] and alignment in ("lower_right", "explicit_positions"):
            assert not a.is_causal, spec.case_id
        if a.is_causal or a.local_window_size is not None:  # native support is the relation
            support = adapter.native_support(ax["Q"], ax["K"], is_causal=a.is_causal,
                                             window=a.local_window_size)
            vis = spec.visible_full(sanitized=True)
            assert np.array_equal(vis, np.broadcast_to(support, vis.shape)), spec.case_id
    # sanitised rows and per-head windows always travel as an explicit mask
    assert adapter.call_arguments(specs["causal_lower_right_q6_k4_sanitized"],
                                  native="auto").mask
    assert adapter.call_arguments(specs["sliding_window_per_head"], native="auto").mask


def test_scale_and_heads(specs):
    a = adapter.call_arguments(specs["explicit_scale_0p2"])
    assert (a.scale, a.query_multiplier, a.key_multiplier) == (0.2, 1.0, 1.0)
    split = adapter.call_arguments(specs["scale_placement_split"])
    assert split.scale == 1.0 and split.query_multiplier == split.key_multiplier
    assert split.query_multiplier ** 2 == pytest.approx(specs["scale_placement_split"].scale)
    assert not adapter.call_arguments(specs["gqa_hq8_hkv2_causal"]).expand_kv
    assert adapter.call_arguments(specs["gqa_explicit_head_map"]).expand_kv


def test_ineligible_cases_say_why(specs):
    assert "Dk != Dv" in adapter.ineligible(specs["dk16_dv3"])
    assert "dropout" in adapter.ineligible(specs["dropout_philox"])
    assert "score family" in adapter.ineligible(specs["score_cosine_zero_key"])
    assert "sink" in adapter.ineligible(specs["sink_per_head"])
    assert len(_eligible(specs)) >= 40
    with pytest.raises(RefAttnError, match="cannot run this case"):
        adapter.run(specs["dropout_philox"])


# -- with jax -------------------------------------------------------------------------------

@pytest.mark.jax
@pytest.mark.parametrize("native", ["explicit", "auto"])
def test_float64_every_eligible_case(specs, native):
    pytest.importorskip("jax")
    eligible = _eligible(specs)
    if native == "auto":  # only the cases auto lowers differently: the others would run the
        # explicit pass's program on its inputs again (native changes call_arguments alone)
        eligible = [s for s in eligible if adapter.call_arguments(s, native="auto")
                    != adapter.call_arguments(s, native="explicit")]
        assert len(eligible) >= 5  # is_causal and local_window_size lowerings are run
    for spec in eligible:
        res = adapter.run(spec, dtype="float64", native=native)
        assert res.precision == "float32"  # JAX evaluates the softmax in float32
        assert res.manifest["numerical"]["softmax_accumulation_dtype"] == "float32"
        assert res.tensors["output"].dtype == np.float64
        report = res.compare(spec)
        assert report.passed, f"{spec.case_id}\n{report.format()}"


@pytest.mark.jax
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lower_precision_every_eligible_case(specs, dtype):
    pytest.importorskip("jax")
    pytest.importorskip("ml_dtypes")
    for spec in _eligible(specs):
        res = adapter.run(spec, dtype=dtype)
        report = res.compare(spec)
        assert report.passed, f"{spec.case_id} {dtype}\n{report.format()}"


@pytest.mark.jax
def test_manifest_and_layout(specs):
    jax = pytest.importorskip("jax")
    spec = specs["noncontiguous_btnh_views"]
    res = adapter.run(spec)
    b = res.manifest["backend"]
    assert b["framework_revision"] == f"jax {jax.__version__}"
    assert b["entrypoint"] == "jax.nn.dot_product_attention"
    assert b["requested_backend"] == "auto" and b["selected_backend"] in ("xla", "cudnn")
    assert res.tensors["grad_q"].shape == spec.tensors["q"].shape
    gqa = adapter.run(specs["gqa_explicit_head_map"])
    assert gqa.tensors["grad_k"].shape == specs["gqa_explicit_head_map"].tensors["k"].shape
    assert gqa.compare(specs["gqa_explicit_head_map"]).passed
