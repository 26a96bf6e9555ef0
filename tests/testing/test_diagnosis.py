"""Planted bugs: each failing comparison names the kind of error (a hypothesis recomputed and
found to fit), and a correct kernel gets no diagnosis.

The kernel under test is plain NumPy (forward and the hand-written backward of softmax
attention with a head map, a visibility mask and query_valid rows); each test plants one bug
a real kernel makes and checks the diagnosis line of ``assert_matches`` and ``compare``.
"""

from __future__ import annotations

import numpy as np
import pytest

from refattn.bundle.comparison.harness import compare
from refattn.testing import Case, assert_matches, load_cases

SPECS = {s.case_id: s for s in load_cases()}


def case(name: str, dtype: str = "float64") -> Case:
    return Case(SPECS[name], dtype)


def attend(q, k, v, *, visible, head_map, query_valid, grad_output=None, scale=None,
           default=lambda d: d ** -0.5, group_sum=True, zero_invalid=True):
    """softmax(scale q k^T, visible) v, with its gradients for ``grad_output``.

    q (B, Hq, Q, Dk), k (B, Hkv, K, Dk), v (B, Hkv, K, Dv), visible (B, Hq, Q, K),
    query_valid (B, 1, Q, 1); the planted bugs are keyword switches."""
    scale = default(q.shape[-1]) if scale is None else scale
    kh, vh = k[:, head_map], v[:, head_map]                      # (B, Hq, K, D)
    s = np.where(visible, scale * q @ kh.swapaxes(-1, -2), -np.inf)  # (B, Hq, Q, K)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = p @ vh                                                  # (B, Hq, Q, Dv)
    if zero_invalid:
        out = np.where(query_valid, out, 0.0)
    if grad_output is None:
        return {"output": out}
    go = np.where(query_valid, grad_output, 0.0)
    dp = go @ vh.swapaxes(-1, -2)                                 # (B, Hq, Q, K)
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
    dq = scale * ds @ kh
    dk_h, dv_h = scale * ds.swapaxes(-1, -2) @ q, p.swapaxes(-1, -2) @ go  # (B, Hq, K, D)
    dk, dv = np.zeros(k.shape), np.zeros(v.shape)
    for h, j in enumerate(head_map):
        if group_sum:
            dk[:, j] += dk_h[:, h]
            dv[:, j] += dv_h[:, h]
        elif not np.any(head_map[:h] == j):  # the bug: only the first head of a group
            dk[:, j], dv[:, j] = dk_h[:, h], dv_h[:, h]
    return {"output": out, "grad_q": dq, "grad_k": dk, "grad_v": dv}


def run(c: Case, *, gradients: bool = False, visible=None, **bugs):
    scale = None if c.scale_is_default else c.scale
    return attend(c.q, c.k, c.v, visible=c.visible if visible is None else visible,
                  head_map=c.head_map, query_valid=c.query_valid, scale=scale,
                  grad_output=c.grad_output if gradients else None, **bugs)


def diagnosis_of(c: Case, outputs) -> str:
    """The diagnosis lines of assert_matches' message (it must fail)."""
    with pytest.raises(AssertionError) as err:
        assert_matches(c, outputs)
    summary, table = str(err.value).split("\n\n", 1)  # the failures, then the report
    lines = [ln.strip() for ln in summary.splitlines() if "diagnosis:" in ln]
    report = compare(outputs, c.spec, dtype=c.dtype)
    assert not report.passed
    assert [d.line() for d in report.diagnoses] == lines  # the same in compare's report
    assert all(line in table for line in lines)
    return "\n".join(lines)


@pytest.mark.parametrize("name", ["self_attention_basic", "causal_lower_right_q3_k7",
                                  "gqa_hq8_hkv2_causal", "query_valid_rows_with_keys",
                                  "explicit_scale_0p2", "sliding_window_causal_incl3"])
def test_a_correct_kernel_passes_with_no_diagnosis(name):
    c = case(name)
    report = assert_matches(c, run(c, gradients=True))
    assert report.passed and report.diagnoses == ()
    assert "diagnosis" not in report.format()


def test_constant_ratio_is_named():
    c = case("self_attention_basic")
    out = run(c)
    out["output"] = 0.5 * out["output"]
    assert diagnosis_of(c, out) == ("diagnosis: output: candidate = 0.5 x golden "
                                    "(every element)")


def test_constant_ratio_in_float32():
    c = case("cross_attention_q3_k7", "float32")
    out = {"output": (0.5 * run(c)["output"]).astype(np.float32)}
    assert "output: candidate = 0.5 x golden" in diagnosis_of(c, out)


def test_a_sign_flip_is_named():
    c = case("self_attention_basic")
    out = run(c, gradients=True)
    out["grad_q"] = -out["grad_q"]
    assert diagnosis_of(c, out) == ("diagnosis: grad_q: candidate = -golden (the sign is "
                                    "flipped; every element)")


def test_a_default_scale_of_one_over_d_is_named():
    c = case("self_attention_basic")  # Dk = 4: 1/sqrt(Dk) = 0.5, 1/Dk = 0.25
    assert c.scale_is_default
    text = diagnosis_of(c, run(c, gradients=True, default=lambda d: 1.0 / d))
    assert text == ("diagnosis: output, grad_q, grad_k, grad_v match a recomputation with "
                    "scale 1/Dk = 0.25 where the case's is 1/sqrt(Dk) = 0.5, the default: "
                    "the kernel's default scale is 1/Dk, not 1/sqrt(Dk)")


def test_an_ignored_scale_argument_is_named():
    c = case("explicit_scale_0p2")
    assert not c.scale_is_default
    out = attend(c.q, c.k, c.v, visible=c.visible, head_map=c.head_map,
                 query_valid=c.query_valid)  # the scale never passed
    assert "scale 1/sqrt(Dk) = 0.5 where the case's is 0.2, passed explicitly: the scale " \
           "argument is ignored" in diagnosis_of(c, out)


def test_the_other_causal_triangle_is_named():
    c = case("causal_lower_right_q3_k7")
    Q, K = c.q.shape[2], c.k.shape[2]
    upper_left = np.arange(K)[None, :] <= np.arange(Q)[:, None]  # (Q, K) the wrong triangle
    text = diagnosis_of(c, run(c, visible=np.broadcast_to(upper_left, c.visible.shape)))
    assert text == ("diagnosis: output matches a recomputation whose probability support is "
                    "the upper-left causal triangle (key j <= query i); the case's is the "
                    "lower-right causal triangle (Q=3, K=7)")


def test_an_ignored_mask_is_named():
    c = case("causal_square")
    text = diagnosis_of(c, run(c, visible=np.ones(c.visible.shape, bool)))
    assert "probability support is no mask (every key visible)" in text


def test_ignored_key_padding_is_named():
    c = case("key_padding_causal")
    Q, K = c.q.shape[2], c.k.shape[2]
    causal = np.broadcast_to(np.arange(K)[None, :] <= np.arange(Q)[:, None], c.visible.shape)
    text = diagnosis_of(c, run(c, visible=causal))
    assert "the key padding ignored (keys where key_valid is False read)" in text


def test_a_window_one_key_too_wide_is_named():
    c = case("sliding_window_causal_incl3")  # 2 keys left of the query's own, causal
    i, j = np.arange(8)[:, None], np.arange(8)[None, :]
    wide = np.broadcast_to((j <= i) & (j >= i - 3), c.visible.shape)
    text = diagnosis_of(c, run(c, visible=wide))
    assert text == ("diagnosis: output matches a recomputation whose probability support is "
                    "a window of 3 keys to the left of the query's own (the case's has 2: one "
                    "key off)")


def test_a_missing_gqa_sum_is_named():
    c = case("gqa_hq8_hkv2_causal")
    text = diagnosis_of(c, run(c, gradients=True, group_sum=False))
    assert text == ("diagnosis: grad_k, grad_v equal one query head's share (the first of "
                    "each group of 4, query heads [0, 4]): the sum over the query heads that "
                    "share a kv head is missing")


def test_a_gqa_mean_instead_of_a_sum_is_named():
    c = case("gqa_hq8_hkv2_causal")
    out = run(c, gradients=True)
    out["grad_k"] = out["grad_k"] / 4
    assert "grad_k: candidate = 0.25 x golden (every element); 1/4: the mean over the 4 " \
           "query heads that share a kv head, not their sum" in diagnosis_of(c, out)


def test_a_btnh_output_is_named():
    c = case("self_attention_basic")
    out = run(c)
    out["output"] = np.ascontiguousarray(out["output"].swapaxes(1, 2))  # (B, Q, Hq, Dv)
    assert diagnosis_of(c, out) == ("diagnosis: output is in the BTNH layout [2, 5, 2, 4] "
                                    "(B, T, H, D); transposed to BHTD (B, H, T, D) it matches")


def test_a_reshape_where_a_transpose_was_needed_is_named():
    c = case("self_attention_basic")
    out = run(c)
    B, H, T, D = out["output"].shape
    out["output"] = out["output"].swapaxes(1, 2).copy().reshape(B, H, T, D)  # the bug
    assert "a BTNH (B, T, H, D) array reshaped, not transposed" in diagnosis_of(c, out)


def test_a_missing_query_valid_zeroing_is_named():
    c = case("query_valid_rows_with_keys")
    assert not c.query_valid.all()
    text = diagnosis_of(c, run(c, zero_invalid=False))
    n = int((~c.query_valid).sum()) * c.q.shape[1]
    assert text == (f"diagnosis: output: {n} row(s) where query_valid is False are not zero; "
                    "zeroed, it matches (the query_valid zeroing is missing)")


def test_an_unrecognised_error_gets_no_diagnosis():
    c = case("self_attention_basic")
    out = run(c)
    out["output"] = out["output"].copy()
    out["output"][0, 1, 2, 3] += 1e-3  # one element off: no shape fits it
    with pytest.raises(AssertionError) as err:
        assert_matches(c, out)
    assert "diagnosis" not in str(err.value)


@pytest.mark.parametrize("name", ["gqa_hq8_hkv2_causal", "dropout_philox", "softcap_5",
                                  "paged_kv_decode", "score_additive"])
def test_garbage_never_makes_the_diagnosis_raise(name):
    c = case(name)
    rng = np.random.default_rng(7)
    for kind in ("noise", "nan", "huge"):
        out = {n: rng.standard_normal(np.shape(c.expected[n]))
               for n in ("output", "grad_q", "grad_k", "grad_v")}
        if kind == "nan":
            out["output"][..., 0] = np.nan
        elif kind == "huge":
            out = {n: 1e300 * x for n, x in out.items()}
        report = compare(out, c.spec, check="gradients")
        assert not report.passed and report.diagnoses == ()  # noise fits no hypothesis


def flash_like(c: Case, *, causal: bool, alignment: str):
    """A causal-only kernel (FlashAttention's interface: causal=True, no mask tensor)."""
    Q, K = c.q.shape[2], c.k.shape[2]
    offset = K - Q if alignment == "lower_right" else 0
    tri = np.arange(K)[None, :] <= np.arange(Q)[:, None] + offset  # (Q, K)
    visible = np.broadcast_to(tri if causal else True, c.visible.shape)
    return run(c, visible=visible)


def test_a_causal_only_kernel_with_the_wrong_triangle_fails_naming_it():
    from refattn.testing import Supports
    from refattn.testing.supports import ineligibility

    lower = Supports(masks="causal", causal_alignment="lower_right", bias=False)
    eligible = [Case(s) for s in SPECS.values() if ineligibility(s, lower) is None]
    rectangular = [c for c in eligible if c.is_causal and c.q.shape[2] != c.k.shape[2]]
    assert rectangular  # the declaration selects lower-right cases with Q != K
    for c in eligible:  # the right kernel passes every eligible case
        out = flash_like(c, causal=c.is_causal, alignment="lower_right")
        assert_matches(c, out)
    for c in rectangular:  # the wrong triangle fails each, and the diagnosis names it
        out = flash_like(c, causal=True, alignment="upper_left")
        text = diagnosis_of(c, out)
        assert "probability support is the upper-left causal triangle" in text, c.name
        assert "the case's is the lower-right causal triangle" in text, c.name
