"""refattn.states: merges against plain loops from the cited sources, bases, layouts, the
backward by finite differences (gradcheck), empty partials and bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradcheck import assert_gradients
from refattn.errors import RefAttnError
from refattn.states import (
    merge_state,
    merge_state_backward,
    merge_states,
    merge_states_backward,
)


# -- independent oracles -------------------------------------------------------------------
def flashinfer_loop(v, s, base):
    """FlashInfer's MergeStatesKernel and state_t (include/flashinfer/attention/cascade.cuh,
    state.cuh), written as a plain loop: v (N, S, H, D), s (N, S, H); exp2/log2 for base 2."""
    exp = (lambda x: 2.0**x) if base == 2 else math.exp
    log = math.log2 if base == 2 else math.log
    N, S, H, D = v.shape
    out, lse = np.zeros((N, H, D)), np.zeros((N, H))
    for n in range(N):
        for h in range(H):
            if S == 0 or all(s[n, i, h] == -math.inf for i in range(S)):
                out[n, h], lse[n, h] = 0.0, -math.inf  # num_index_sets == 0: v = 0, s = -inf
                continue
            m, d, o = -math.inf, 1.0, np.zeros(D)  # state_t::init
            for i in range(S):
                other_m = s[n, i, h]
                m_prev, d_prev = m, d
                m = max(m_prev, other_m)
                d = d_prev * exp(m_prev - m) + 1.0 * exp(other_m - m)
                o = o * exp(m_prev - m) + v[n, i, h] * exp(other_m - m)
            out[n, h] = o / d  # normalize
            lse[n, h] = m + log(d)  # get_lse
    return out, lse


def direct(x, v):
    """Softmax attention of one row set over all its keys: x (R, K), v (K, D)."""
    m = x.max(axis=1, keepdims=True)
    e = np.exp(x - m)
    return (e / e.sum(1, keepdims=True)) @ v, (m[:, 0] + np.log(e.sum(1)))


def partial(x, v, keys):
    """The partial state of rows over a key subset (natural lse); empty: (0, -inf)."""
    if len(keys) == 0:
        return np.zeros((x.shape[0], v.shape[1])), np.full(x.shape[0], -np.inf)
    return direct(x[:, keys], v[keys])


rng = np.random.default_rng(7)


def random_states(S=3, N=4, H=2, D=5, scale=3.0):
    return rng.standard_normal((N, S, H, D)), scale * rng.standard_normal((N, S, H))


# -- forward ---------------------------------------------------------------------------------
@pytest.mark.parametrize("base", ["e", 2])
def test_matches_flashinfer_loop(base):
    v, s = random_states()
    s[0, 1, 0] = -np.inf  # one empty partial
    s[1, :, 1] = -np.inf  # a row with every partial empty
    out, lse = merge_states(v, s, base=base, layout="flashinfer")
    ref_out, ref_lse = flashinfer_loop(v, s, base)
    np.testing.assert_allclose(out, ref_out, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-14, atol=1e-15)
    assert lse[1, 1] == -np.inf and not out[1, 1].any()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.integers(1, 8), st.integers(0, 2**32 - 1))
def test_merge_of_key_split_is_full_attention(K, S, seed):
    r = np.random.default_rng(seed)
    x, v = 4.0 * r.standard_normal((3, K)), r.standard_normal((K, 2))
    groups = r.integers(0, S, size=K)  # some groups may be empty
    parts = [partial(x, v, np.flatnonzero(groups == g)) for g in range(S)]
    outs = np.stack([p[0] for p in parts])[:, None, None]  # (S, 1, 1, 3, 2)
    lses = np.stack([p[1] for p in parts])[:, None, None]  # (S, 1, 1, 3)
    out, lse = merge_states(outs, lses)
    ref_out, ref_lse = direct(x, v)
    np.testing.assert_allclose(out[0, 0], ref_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse[0, 0], ref_lse, rtol=1e-13, atol=1e-13)


def test_layouts_agree():
    B, H, L, D, S = 2, 3, 4, 5, 3
    o = rng.standard_normal((S, B, H, L, D))
    s = rng.standard_normal((S, B, H, L))
    out, lse = merge_states(o, s, base=2)
    fa_out, fa_lse = merge_states(o.transpose(0, 1, 3, 2, 4), s, base=2, layout="flash_attn")
    assert np.array_equal(fa_out, out.transpose(0, 2, 1, 3)) and np.array_equal(fa_lse, lse)
    fi_o = o.transpose(1, 3, 0, 2, 4).reshape(B * L, S, H, D)  # tokens = (b, l)
    fi_s = s.transpose(1, 3, 0, 2).reshape(B * L, S, H)
    fi_out, fi_lse = merge_states(fi_o, fi_s, base=2, layout="flashinfer")
    assert np.array_equal(fi_out, out.transpose(0, 2, 1, 3).reshape(B * L, H, D))
    assert np.array_equal(fi_lse, lse.transpose(0, 2, 1).reshape(B * L, H))


def test_pair_is_two_states():
    v, s = random_states(S=2)
    pair = merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1], layout="flashinfer")
    both = merge_states(v, s, layout="flashinfer")
    assert all(np.array_equal(a, b) for a, b in zip(pair, both, strict=True))


def test_base_two_is_natural_over_ln2():
    v, s = random_states()
    out_e, lse_e = merge_states(v, s, layout="flashinfer")
    out_2, lse_2 = merge_states(v, s / math.log(2), base=2, layout="flashinfer")
    np.testing.assert_allclose(out_2, out_e, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(lse_2 * math.log(2), lse_e, rtol=1e-13, atol=1e-14)
    # reading base-2 lses as natural is a different merge
    assert not np.allclose(merge_states(v, s / math.log(2), layout="flashinfer")[0], out_e)


def test_empty_partials_exact():
    o = rng.standard_normal((1, 1, 2, 3))
    lse = rng.standard_normal((1, 1, 2))
    empty = np.full_like(lse, -np.inf)
    out, merged = merge_state(o, lse, np.full_like(o, 7.0), empty)
    assert np.array_equal(out, o) and np.array_equal(merged, lse)  # weight 1 and 0 exactly
    out, merged = merge_state(o, empty, o, empty)
    assert not out.any() and (merged == -np.inf).all()
    g = merge_state_backward(o, empty, o, lse, np.ones_like(o), np.ones_like(lse))
    assert not g[0].any() and not g[1].any()  # an empty partial gets no gradient
    assert np.array_equal(g[2], np.ones_like(o)) and np.allclose(g[3], 1.0)


def test_single_state_is_its_own_merge():
    o, s = rng.standard_normal((1, 2, 3, 4, 5)), rng.standard_normal((1, 2, 3, 4))
    out, lse = merge_states(o, s)
    assert np.array_equal(out, o[0]) and np.array_equal(lse, s[0])


# -- backward --------------------------------------------------------------------------------
@pytest.mark.parametrize("base", ["e", 2])
@pytest.mark.parametrize("layout", ["refattn", "flashinfer", "flash_attn"])
def test_backward_by_finite_differences(base, layout):
    S = 3
    if layout == "flashinfer":
        outs, lses = rng.standard_normal((2, S, 2, 3)), rng.standard_normal((2, S, 2))
    elif layout == "refattn":
        outs, lses = rng.standard_normal((S, 1, 2, 2, 3)), rng.standard_normal((S, 1, 2, 2))
    else:
        outs, lses = rng.standard_normal((S, 1, 2, 2, 3)), rng.standard_normal((S, 1, 2, 2))
    out0, lse0 = merge_states(outs, lses, base=base, layout=layout)

    def fn(outs, lses):
        out, lse = merge_states(outs, lses, base=base, layout=layout)
        return np.concatenate([out.ravel(), lse.ravel()])

    def vjp(g, outs, lses):
        g_out = g[:out0.size].reshape(out0.shape)
        g_lse = g[out0.size:].reshape(lse0.shape)
        g_outs, g_lses = merge_states_backward(outs, lses, g_out, g_lse, base=base,
                                               layout=layout)
        return {"outs": g_outs, "lses": g_lses}

    assert_gradients(fn, vjp, {"outs": outs, "lses": lses}, method="central")


def test_backward_without_grad_lse_is_zero_grad_lse():
    v, s = random_states()
    g = rng.standard_normal((4, 2, 5))
    a = merge_states_backward(v, s, g, layout="flashinfer", base=2)
    b = merge_states_backward(v, s, g, np.zeros((4, 2)), layout="flashinfer", base=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_backward_formula_base2_ln2():
    """d s_i = w_i (ln 2 <dO, o_i - o> + dS) in base 2, written out for two states."""
    o = np.array([[[1.0]], [[3.0]]])  # (N=1, S=2, H=1, D=1) after reshape
    s = np.array([[0.0, 1.0]])
    w = np.array([1.0, 2.0]) / 3.0
    merged = w @ o[:, 0, 0]
    g_outs, g_lses = merge_states_backward(o.reshape(1, 2, 1, 1), s.reshape(1, 2, 1),
                                           np.ones((1, 1, 1)), base=2, layout="flashinfer")
    expect = w * math.log(2) * (o[:, 0, 0] - merged)
    np.testing.assert_allclose(g_lses.ravel(), expect, rtol=1e-14)
    np.testing.assert_allclose(g_outs.ravel(), w, rtol=1e-15)


# -- bad input -------------------------------------------------------------------------------
def test_refusals_name_tensor_and_index():
    v, s = random_states()
    bad = s.copy()
    bad[2, 1, 0] = np.inf
    with pytest.raises(RefAttnError, match=r"lses: inf at index \(2, 1, 0\)"):
        merge_states(v, bad, layout="flashinfer")
    bad[2, 1, 0] = np.nan
    with pytest.raises(RefAttnError, match=r"lses: nan at index \(2, 1, 0\)"):
        merge_states(v, bad, layout="flashinfer")
    with pytest.raises(RefAttnError, match=r"lses: axis 2 has length 3, expected 2"):
        merge_states(v, np.zeros((4, 3, 3)), layout="flashinfer")
    with pytest.raises(RefAttnError, match="float64"):
        merge_states(v.astype(np.float32), s, layout="flashinfer")
    vv = v.copy()
    vv[0, 0, 1, 4] = np.inf
    with pytest.raises(RefAttnError, match=r"outs: non-finite value inf at index \(0, 0, 1, 4\)"):
        merge_states(vv, s, layout="flashinfer")
    a, sa = np.zeros((1, 2, 3, 4)), np.zeros((1, 3, 2))
    with pytest.raises(RefAttnError, match=r"lse_b: inf at index \(0, 2, 1\)"):
        merge_state(a, sa, a, np.where(np.arange(6).reshape(1, 3, 2) == 5, np.inf, 0.0),
                    layout="flash_attn")
    with pytest.raises(RefAttnError, match=r"lse_a: axis 1 has length 2, expected 3"):
        merge_state(a, np.zeros((1, 2, 2)), a, sa, layout="flash_attn")
    with pytest.raises(RefAttnError, match=r"out_b: axis 3 has length 5, expected 4"):
        merge_state(np.zeros((1, 2, 3, 4)), np.zeros((1, 2, 3)), np.zeros((1, 2, 3, 5)),
                    np.zeros((1, 2, 3)))
    with pytest.raises(RefAttnError, match="base"):
        merge_states(v, s, base=10, layout="flashinfer")
    with pytest.raises(RefAttnError, match="grad_out: expected shape"):
        merge_states_backward(v, s, np.zeros((4, 2, 4)), layout="flashinfer")
    with pytest.raises(RefAttnError, match="grad_lse"):
        merge_states_backward(v, s, np.zeros((4, 2, 5)), np.full((4, 2), np.inf),
                              layout="flashinfer")


def test_inputs_never_modified():
    v, s = random_states()
    v0, s0 = v.copy(), s.copy()
    merge_states(v, s, layout="flashinfer")
    merge_states_backward(v, s, np.ones((4, 2, 5)), np.ones((4, 2)), layout="flashinfer")
    assert np.array_equal(v, v0) and np.array_equal(s, s0)
