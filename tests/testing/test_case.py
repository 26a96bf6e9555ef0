"""Cases as test parameters: the plain-NumPy description and its stated rules (checked by a
from-scratch NumPy attention over the whole suite), the framework lowerings and why they
refuse a case, eligibility against the adapters' own verdicts, and assert_matches' message."""

from __future__ import annotations

import numpy as np
import pytest

from refattn import RefAttnError
from refattn.adapters import jax as jax_adapter
from refattn.adapters import torch as torch_adapter
from refattn.adapters.plain import PlainCall
from refattn.testing import Case, Supports, assert_matches, load_cases
from refattn.testing.supports import ineligibility

SPECS = load_cases()
BY_NAME = {s.case_id: s for s in SPECS}
#: everything the plain description's rules cover except other score families
RULES = Supports(dropout=("multiplier",), softcap=True, sink=True)


def numpy_attention(c: PlainCall) -> dict[str, np.ndarray]:
    """Rules 1-8 of refattn.adapters.plain, written out independently of the engine."""
    k, v = c.k[:, c.head_map], c.v[:, c.head_map]  # (B, Hq, K, Dk), (B, Hq, K, Dv)
    s = c.scale * np.einsum("bhqd,bhkd->bhqk", c.q, k)  # (B, Hq, Q, K)
    if c.softcap is not None:
        s = c.softcap * np.tanh(s / c.softcap)
    if c.bias is not None:
        s = s + c.bias
    s = np.where(c.visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)  # (B, Hq, Q, 1)
    sink = None if c.sink is None else c.sink[None, :, None, None]
    if sink is not None:
        m = np.maximum(m, sink)
    e = np.exp(s - m)
    den = e.sum(axis=-1, keepdims=True)
    if sink is not None:
        den = den + np.exp(sink - m)
    p = e / den
    consumed = p if c.dropout is None else p * c.dropout
    out = np.where(c.query_valid, consumed @ v, 0.0)  # (B, Hq, Q, Dv)
    return {"output": out, "lse": (m + np.log(den))[..., 0], "probs": p}


@pytest.mark.parametrize("spec", SPECS, ids=[s.case_id for s in SPECS])
def test_the_stated_rules_reproduce_every_case_they_cover(spec):
    if ineligibility(spec, RULES) is not None:
        assert spec.score_family_name != "dot"  # only other score families are left out
        return
    case = Case(spec)
    assert_matches(case, numpy_attention(case.to_numpy()), check="listed")


def test_the_rules_cover_all_but_the_other_score_families():
    covered = [s for s in SPECS if ineligibility(s, RULES) is None]
    assert len(covered) == len(SPECS) - sum(s.score_family_name != "dot" for s in SPECS)
    assert len(covered) >= 60


def test_plain_arrays_are_read_only_copies():
    case = Case(BY_NAME["bias_full"])
    assert not case.q.flags.writeable and not case.visible.flags.writeable
    assert case.q is not case.expected["q"] and np.array_equal(case.q, case.expected["q"])
    assert set(case.inputs) == {"q", "k", "v", "bias"}


def test_every_visible_row_has_a_key_or_a_sink():
    for spec in SPECS:
        c = Case(spec).to_numpy()
        empty = ~c.visible.any(axis=-1)  # (B, Hq, Q)
        assert not empty.any() or c.sink is not None, spec.case_id


# -- eligibility agrees with what the lowerings can express -----------------------------------

def test_default_support_is_exactly_what_sdpa_expresses():
    for spec in SPECS:
        ours = ineligibility(spec, Supports()) is None
        theirs = torch_adapter.ineligible(spec, "sdpa") is None
        assert ours == theirs, spec.case_id


def test_jax_support_is_exactly_what_dot_product_attention_expresses():
    jax_like = Supports(distinct_value_width=False)
    for spec in SPECS:
        ours = ineligibility(spec, jax_like) is None
        assert ours == (jax_adapter.ineligible(spec) is None), spec.case_id


def test_declared_limits_skip_with_the_limit_named():
    spec = BY_NAME["gqa_hq8_hkv2_causal"]
    assert "Supports.gqa" in ineligibility(spec, Supports(gqa=False))
    upper = Supports(masks="causal", causal_alignment="upper_left")
    assert ineligibility(spec, upper) is None  # upper-left triangle
    assert "masks='none'" in ineligibility(spec, Supports(masks="none"))
    explicit = BY_NAME["gqa_explicit_head_map"]
    assert "Supports.head_map" in ineligibility(explicit, Supports(head_map=False))
    lower = BY_NAME["causal_lower_right_q3_k7"]
    assert ineligibility(lower, Supports(masks="causal", causal_alignment="lower_right")) is None
    assert "the lower_right causal triangle, not the upper_left" in ineligibility(lower, upper)
    with pytest.raises(RefAttnError, match="causal_alignment='upper_left'"):
        Supports(masks="causal")  # the triangle must be named
    philox = BY_NAME["dropout_philox"]
    assert ineligibility(philox, Supports(dropout=("philox",))) is None
    assert ineligibility(BY_NAME["loop6_two_query_training_trace"],
                         Supports(dropout=("philox",))) is not None  # an explicit Z


def test_a_dtype_that_overflows_the_inputs_is_skipped():
    spec = BY_NAME["causal_square"]
    big = dict(spec.tensors, q=spec.tensors["q"] * 1e5)  # beyond float16's 65504
    from dataclasses import replace
    assert ineligibility(replace(spec, tensors=big), Supports(), "float16") == (
        "q overflows float16")
    assert ineligibility(spec, Supports(), "float16") is None


def test_bad_declarations_are_named():
    with pytest.raises(RefAttnError, match=r"Supports: masks: expected one of 'dense'"):
        Supports(masks="sliding")
    with pytest.raises(RefAttnError, match=r"Supports\.scores"):
        Supports(scores=("dot", "rbf"))
    assert Supports(dtypes="float32").dtypes == ("float32",)


# -- lowerings say why not --------------------------------------------------------------------

@pytest.mark.parametrize(("name", "target", "why"), [
    ("softcap_5", "torch_sdpa", "softcap"),
    ("dropout_philox", "torch_sdpa", "dropout"),
    ("score_bilinear_per_head", "jax", "score family 'bilinear'"),
    ("sink_per_head", "jax", "sink"),
])
def test_lowerings_refuse_with_the_reason(name, target, why):
    case = Case(BY_NAME[name])
    assert why in case.not_expressible(target)
    lower = case.to_torch_sdpa if target == "torch_sdpa" else case.to_jax
    with pytest.raises(RefAttnError, match=f"{name}: .*cannot express this case: .*{why}"):
        lower()
    assert case.not_expressible("numpy") is None and case.to_numpy() is case.plain


def test_jax_lowering_layout_and_the_x64_guard():
    case = Case(BY_NAME["gqa_explicit_head_map"], "float64")
    j = case.to_jax()
    a = case.spec.axes
    assert j.primals[0].shape == (a["B"], a["Q"], a["Hq"], a["Dk"])
    assert j.primals[1].shape[2] == a["Hq"]  # an explicit head map expands K/V
    assert j.precision == "float32" and j.dtype == "float64"
    out = np.zeros((a["B"], a["Q"], a["Hq"], a["Dv"]), np.float32)
    with pytest.raises(RefAttnError, match="enable x64"):
        j.outputs(out)
    grads = tuple(np.ones_like(p) for p in j.primals)
    got = j.outputs(out.astype(np.float64), grads)
    # K/V expanded to Hq heads: their gradients are summed back onto the Hkv heads
    counts = np.bincount(case.head_map, minlength=a["Hkv"]).astype(float)
    np.testing.assert_array_equal(got["grad_k"][0, :, 0, 0], counts)
    assert got["grad_q"].shape == case.q.shape


def test_torch_lowering_is_the_exact_sdpa_call():
    torch = pytest.importorskip("torch")
    case = Case(BY_NAME["key_padding_lengths_7_5_2"], "float32")
    sdpa = case.to_torch_sdpa()
    assert set(sdpa.kwargs) == {"attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"}
    mask = sdpa.kwargs["attn_mask"]
    assert mask.dtype == torch.bool and np.array_equal(mask.numpy(), case.visible)
    assert sdpa.kwargs["scale"] == case.scale and sdpa.kwargs["dropout_p"] == 0.0
    assert sdpa.args[0] is sdpa.q and sdpa.q.dtype == torch.float32
    bias = Case(BY_NAME["bias_full"]).to_torch_sdpa()
    m = bias.kwargs["attn_mask"]
    assert m.dtype == torch.float64
    assert torch.equal(torch.isinf(m), torch.from_numpy(~Case(BY_NAME["bias_full"]).visible))


# -- assert_matches ---------------------------------------------------------------------------

def test_assert_matches_names_the_worst_element_and_its_tolerance():
    case = Case(BY_NAME["causal_square"])
    g = case.expected["output"]
    out = g.copy()
    out[1, 0, 4, 2] += 3e-9
    out[0, 1, 5, 1] += 1e-9
    with pytest.raises(AssertionError) as info:
        assert_matches(case, {"output": out})
    first, worst = str(info.value).splitlines()[:2]
    assert first.startswith("causal_square (float64, rule |a-g| <= 1e-12 + 1e-10*|g|")
    assert "1 of 1 tensor(s)" in first
    assert "output: worst element (1, 0, 4, 2)" in worst
    tol = 1e-12 + 1e-10 * abs(g[1, 0, 4, 2])
    assert f"tolerance there {tol:.3e}" in worst and "2 element(s) fail" in worst
    assert f"golden {float(g[1, 0, 4, 2])!r}" in worst


def test_assert_matches_in_float32_uses_the_reference_relative_rule():
    case = Case(BY_NAME["causal_square"], "float32")
    g = case.expected["output"]
    report = assert_matches(case, {"output": g.astype(np.float32)})
    assert report.precision == "float32" and report["output"].rule == "reference_relative"
    bad = g.astype(np.float32)
    bad[0, 0, 3, 1] += 0.01
    with pytest.raises(AssertionError, match=r"worst element \(0, 0, 3, 1\).*tolerance of the "
                                             r"tensor \(float32 rule\)"):
        assert_matches(case, {"output": bad})


def test_assert_matches_wants_every_gradient_once_one_is_given():
    case = Case(BY_NAME["bias_full"])
    t = case.expected
    with pytest.raises(AssertionError, match="grad_bias: missing"):
        assert_matches(case, {"output": t["output"], "grad_q": t["grad_q"], "grad_k": t["grad_k"],
                              "grad_v": t["grad_v"], "grad_bias": None})
    full = {n: t[n] for n in ("output", "grad_q", "grad_k", "grad_v", "grad_bias")}
    assert assert_matches(case, full).passed
