"""refattn.rope against its sources' own definitions, written here from scratch.

- the rotation: FlashAttention's ``apply_rotary_emb_torch`` / ``rotate_half``
  (Dao-AILab/flash-attention ``flash_attn/layers/rotary.py``) ported to NumPy line by line:
  ``cos`` repeated ``"... d -> ... 1 (2 d)"`` (half-split) or ``"(d 2)"`` (interleaved),
  ``x * cos + rotate_half(x) * sin`` on the first ``rotary_dim`` columns;
- the tables: HuggingFace's ``modeling_rope_utils.py`` formulas (default, linear, dynamic
  NTK, YaRN with ``get_mscale``, ``find_correction_range``, ``linear_ramp_factor``) written
  again with Python floats, element by element;
- the backward: gradcheck's central differences, and the transpose identity
  ``<R x, g> = <x, R^T g>``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gradcheck
from refattn.errors import RefAttnError
from refattn.rope import apply, apply_backward, cos_sin, inverse_frequencies, rope_tables


def _rotate_half(x, interleaved):
    if not interleaved:
        x1, x2 = np.split(x, 2, axis=-1)
        return np.concatenate([-x2, x1], axis=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return np.stack([-x2, x1], axis=-1).reshape(x.shape)


def _fa_apply(x, cos, sin, interleaved):
    """apply_rotary_emb_torch: x (batch, seqlen, nheads, headdim), cos/sin (seqlen, r/2)."""
    ro = cos.shape[-1] * 2
    rep = (lambda t: np.repeat(t, 2, axis=-1)) if interleaved else (
        lambda t: np.concatenate([t, t], axis=-1))
    c, s = rep(cos)[..., None, :], rep(sin)[..., None, :]  # "... d -> ... 1 (2 d)"
    return np.concatenate([x[..., :ro] * c + _rotate_half(x[..., :ro], interleaved) * s,
                           x[..., ro:]], axis=-1)


def _loop(x, cos, sin, positions, interleaved):
    """x (B, L, H, D), positions (B, L): one token at a time through _fa_apply."""
    out = np.empty_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            p = positions[b, t]
            out[b, t:t + 1] = _fa_apply(x[b, t:t + 1], cos[p:p + 1], sin[p:p + 1],
                                        interleaved)
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [2, 8, 16])
def test_both_layouts_match_flash_attentions_reference(interleaved, rotary_dim):
    rng = np.random.default_rng(rotary_dim)
    x = rng.standard_normal((2, 5, 3, 16))                 # (B, L, H, D)
    t = rope_tables(40, rotary_dim)
    pos = rng.integers(0, 40, (2, 5))                      # per token: varlen, paged, leftpad
    got = apply(x.transpose(0, 2, 1, 3), t.cos, t.sin, pos, interleaved)  # (B, H, L, D)
    want = _loop(x, t.cos, t.sin, pos, interleaved)
    assert np.array_equal(got.transpose(0, 2, 1, 3), want)  # the same roundings, bit for bit
    assert np.array_equal(got[..., rotary_dim:], x.transpose(0, 2, 1, 3)[..., rotary_dim:])


def test_the_two_layouts_pair_different_columns():
    c, s = np.array([[0.0, 0.0]]), np.array([[1.0, 1.0]])  # a quarter turn for both pairs
    x = np.array([[[1.0, 2.0, 3.0, 4.0]]])
    assert apply(x, c, s, np.array([[0]]), False).tolist() == [[[-3.0, -4.0, 1.0, 2.0]]]
    assert apply(x, c, s, np.array([[0]]), True).tolist() == [[[-2.0, 1.0, -4.0, 3.0]]]


def _hf_inv_freq(dim, base):
    return [1.0 / (base ** (i / dim)) for i in range(0, dim, 2)]


def test_default_linear_and_ntk_follow_hf():
    dim, base = 16, 10000.0
    # numpy's vectorised pow and Python's may differ by an ulp: 1e-15 relative
    default = inverse_frequencies(dim, theta=base)[0]
    assert np.allclose(default, _hf_inv_freq(dim, base), rtol=1e-15, atol=0)
    lin = inverse_frequencies(dim, theta=base, scaling="linear", factor=4.0)[0]
    assert lin.tolist() == (default / 4.0).tolist()  # HF divides the frequencies
    ntk = inverse_frequencies(dim, theta=base, scaling="ntk", factor=4.0)[0]
    assert np.allclose(ntk, _hf_inv_freq(dim, base * 4.0 ** (dim / (dim - 2))), rtol=1e-15)


@pytest.mark.parametrize(("seq_len", "changes"), [(None, False), (100, False), (4096, True)])
def test_dynamic_ntk_changes_the_base_past_max_position_embeddings(seq_len, changes):
    dim, base, mpe, factor = 8, 500.0, 2048, 2.0
    got = inverse_frequencies(dim, theta=base, scaling="dynamic", factor=factor,
                              seq_len=seq_len, max_position_embeddings=mpe)[0]
    L = seq_len if seq_len is not None and seq_len > mpe else mpe
    new_base = base * ((factor * L / mpe) - (factor - 1)) ** (dim / (dim - 2))
    assert np.allclose(got, _hf_inv_freq(dim, new_base), rtol=1e-15)
    assert (not np.allclose(got, _hf_inv_freq(dim, base), rtol=1e-15)) == changes


def _hf_yarn(dim, base, factor, original, beta_fast=32, beta_slow=1, attention_factor=None,
             mscale=None, mscale_all_dim=None, truncate=True):
    def get_mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)

    def corr(rot):
        return (dim * math.log(original / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr(beta_fast), corr(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    out = []
    for j, i in enumerate(range(0, dim, 2)):
        pos_freq = base ** (i / dim)
        ramp = min(max((j - low) / (high - low), 0.0), 1.0)
        extra = 1 - ramp
        out.append(1.0 / (factor * pos_freq) * (1 - extra) + 1.0 / pos_freq * extra)
    return out, attention_factor


@pytest.mark.parametrize("kw", [{}, {"truncate": False}, {"mscale": 0.707, "mscale_all_dim": 1.0},
                                {"attention_factor": 1.25}, {"beta_fast": 8, "beta_slow": 2}])
def test_yarn_follows_hf(kw):
    dim, base, factor, original = 64, 10000.0, 8.0, 4096
    got, attn = inverse_frequencies(dim, theta=base, scaling="yarn", factor=factor,
                                    original_max_position_embeddings=original, **kw)
    want, want_attn = _hf_yarn(dim, base, factor, original, **kw)
    assert np.allclose(got, want, rtol=1e-14, atol=0)
    assert attn == pytest.approx(want_attn, rel=1e-15)
    t = rope_tables(3, dim, theta=base, scaling="yarn", factor=factor,
                    original_max_position_embeddings=original, **kw)
    assert np.array_equal(t.cos[2], np.cos(2.0 * got) * attn)  # HF: emb.cos() * scaling


def test_tables_are_cos_and_sin_of_position_times_frequency():
    inv = np.array([1.0, 0.25])
    c, s = cos_sin(3, inv)
    for p in range(3):
        assert c[p].tolist() == [math.cos(p * f) for f in inv.tolist()]
        assert s[p].tolist() == [math.sin(p * f) for f in inv.tolist()]


@pytest.mark.parametrize("interleaved", [False, True])
def test_backward_passes_central_differences(interleaved):
    rng = np.random.default_rng(3)
    t = rope_tables(12, 6, scaling="yarn", factor=2.0, original_max_position_embeddings=8)
    pos = rng.integers(0, 12, (2, 3))

    def fn(x):
        return apply(x, t.cos, t.sin, pos, interleaved)

    def vjp(g, x):
        return {"x": apply_backward(g, t.cos, t.sin, pos, interleaved)}

    report = gradcheck.check_vjp(fn, vjp, {"x": rng.standard_normal((2, 2, 3, 8))},
                                 method="central")
    assert report.passed, report


def test_a_planted_backward_bug_is_caught():
    rng = np.random.default_rng(4)
    t = rope_tables(12, 8)
    pos = rng.integers(1, 12, (1, 3))

    def vjp(g, x):  # the forward rotation where its transpose belongs
        return {"x": apply(g, t.cos, t.sin, pos)}

    report = gradcheck.check_vjp(lambda x: apply(x, t.cos, t.sin, pos), vjp,
                                 {"x": rng.standard_normal((1, 3, 8))}, method="central")
    assert not report.passed


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 3), L=st.integers(1, 6), half=st.integers(1, 4),
       extra=st.integers(0, 3), interleaved=st.booleans(), seed=st.integers(0, 2**16))
def test_transpose_identity_and_reference_over_shapes(B, L, half, extra, interleaved, seed):
    rng = np.random.default_rng(seed)
    R, D, T = 2 * half, 2 * half + extra, 10
    cos, sin = rng.standard_normal((T, half)), rng.standard_normal((T, half))  # any table
    pos = rng.integers(0, T, (B, L))
    x, g = rng.standard_normal((B, L, 2, D)), rng.standard_normal((B, L, 2, D))
    y = apply(x.transpose(0, 2, 1, 3), cos, sin, pos, interleaved, R)
    assert np.array_equal(y.transpose(0, 2, 1, 3), _loop(x, cos, sin, pos, interleaved))
    gx = apply_backward(g.transpose(0, 2, 1, 3), cos, sin, pos, interleaved, R)
    lhs = float(np.sum(y * g.transpose(0, 2, 1, 3)))
    rhs = float(np.sum(x.transpose(0, 2, 1, 3) * gx))
    assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-12)


def test_bad_inputs_name_the_tensor_the_index_and_the_limit():
    t = rope_tables(4, 4)
    x = np.zeros((1, 3, 4))

    def bad(**kw):
        args = {"x": x, "cos": t.cos, "sin": t.sin, "positions": np.array([[0, 1, 2]])}
        args.update(kw)
        with pytest.raises(RefAttnError) as info:
            apply(**args)
        return str(info.value)

    assert bad(positions=np.array([[0, 1, 4]])).startswith(
        "positions: entry (b=0, l=2) is 4, expected a position in [0, 4) (cos has 4 rows: the "
        "RoPE table is shorter than the positions)")
    assert "entry (b=0, l=0) is -1" in bad(positions=np.array([[-1, 0, 0]]))
    assert bad(x=x.astype(np.float32)).startswith("x: expected dtype float64")
    assert bad(cos=t.cos.astype(np.float32)).startswith("cos: expected dtype float64")
    assert bad(sin=t.sin[:, :1]).startswith("sin: shape [4, 1] must equal cos's [4, 2]")
    assert bad(x=np.zeros((1, 3, 2))).startswith("rotary_dim: 4 (2 x cos's columns) exceeds")
    assert bad(rotary_dim=2).startswith("rotary_dim: 2 but cos has 2 columns")
    with pytest.raises(RefAttnError, match="rotary_dim: 5 is odd"):
        inverse_frequencies(5)
    with pytest.raises(RefAttnError, match="max_position_embeddings: the dynamic NTK"):
        inverse_frequencies(8, scaling="dynamic", factor=2.0)
    with pytest.raises(RefAttnError, match=r"theta: 1.0 is outside the allowed range"):
        inverse_frequencies(8, theta=1.0)


def test_the_callers_arrays_are_not_changed():
    t = rope_tables(4, 4)
    x = np.arange(12.0).reshape(1, 3, 4)
    keep = x.copy()
    apply(x, t.cos, t.sin, np.array([[0, 1, 3]]), True)
    apply_backward(x, t.cos, t.sin, np.array([[0, 1, 3]]))
    assert np.array_equal(x, keep)
