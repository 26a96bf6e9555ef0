"""Building blocks of the numba kernels: exp, fixed-order row sums, broadcast operands, the
in-kernel BLAS call and tile visibility (against VisibilityRelation.dense())."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refattn.engine.numba.blas import dgemm_address, gemm, gemm_split, single_thread_blas
from refattn.engine.numba.math import exp_shift, row_dot, row_max, row_sum, softcap_row
from refattn.engine.numba.operands import at, strided
from refattn.engine.numba.tiles import (
    FULL,
    INVISIBLE,
    PARTIAL,
    classify,
    tile_mask,
    tile_visibility,
)
from refattn.masks import relation
from tests.strategies import visibility_inputs


def _ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return np.abs(got - want) / np.spacing(np.abs(want))


@pytest.mark.parametrize("lo, hi", [(-1.0, 0.0), (-40.0, 0.0), (-708.0, -600.0),
                                    (-745.0, -708.5), (0.0, 709.0)])
def test_exp_is_within_one_ulp_of_libm(lo, hi):
    x = np.random.default_rng(0).uniform(lo, hi, 20000)
    got = x.copy()
    exp_shift(got, x.size, 0.0)
    want = np.array([math.exp(t) for t in x])  # the platform libm, an independent oracle
    assert _ulps(got, want).max() <= 1.0


def test_exp_special_values_and_shift():
    x = np.array([-np.inf, -1000.0, -745.2, -745.1, 0.0, 1e-300, -1e-300, 2.5])
    got = x.copy()
    exp_shift(got, x.size, 0.0)
    assert got[:3].tolist() == [0.0, 0.0, 0.0]  # below the subnormal range: exactly +0
    assert got[3] == math.exp(-745.1) == 5e-324
    assert got[4:7].tolist() == [1.0, 1.0, 1.0]
    shifted = x[4:].copy()
    exp_shift(shifted, 4, 2.5)  # exp(x - m), as the softmax rows use it
    assert _ulps(shifted, np.exp(x[4:] - 2.5)).max() <= 1.0
    assert shifted[-1] == 1.0
    tail = np.array([-1.0, 7.0])
    exp_shift(tail, 1, 0.0)  # only the first n entries are touched
    assert tail[1] == 7.0


def test_exp_vector_lanes_and_scalar_tail_agree_bit_for_bit():
    # the same values at every lane of a block of eight and in the scalar tail (n % 8)
    rng = np.random.default_rng(5)
    values = np.concatenate([-np.abs(rng.standard_normal(50)) * 40, [-np.inf, -745.15, -0.0]])
    for offset in range(9):
        x = np.concatenate([np.zeros(offset), values])
        vec = x.copy()
        exp_shift(vec, x.size, 0.25)
        one = np.array([v for t in x for v in _exp_alone(t)])
        np.testing.assert_array_equal(vec.view(np.int64), one.view(np.int64))


@pytest.mark.parametrize("c", [1.0, 5.0, 30.0])
def test_softcap_row_against_tanh_at_120_bits(c):
    # both sides of the 0.35 switch between the series and (1 - e) / (1 + e), tiny, huge and
    # signed-zero scores; the oracle is mpmath's tanh at 120 bits, rounded once
    import mpmath

    rng = np.random.default_rng(2)
    scales = (1e-300, 1e-8, 0.1, 0.3, 0.35, 0.4, 1.0, 3.0, 10.0, 30.0)
    x = np.concatenate([rng.standard_normal(400) * s * c for s in scales]
                       + [np.array([0.0, -0.0, 0.35 * c, -0.35 * c, 40.0 * c, -1e300])])
    row, capped = x.copy(), np.full_like(x, np.nan)
    softcap_row(row, capped, x.size - 1, c)  # the last entry is past n: untouched
    assert row[-1] == -1e300 and np.isnan(capped[-1])
    np.testing.assert_array_equal(row[:-1], capped[:-1])
    with mpmath.workprec(120):
        want = np.array([float(c * mpmath.tanh(mpmath.mpf(t) / c)) for t in x[:-1]])
    assert np.array_equal(np.signbit(row[:-1]), np.signbit(x[:-1]))  # tanh keeps the sign
    assert _ulps(row[:-1], want).max() <= 4.0


def _exp_alone(t: float) -> np.ndarray:
    y = np.array([t])
    exp_shift(y, 1, 0.25)  # n = 1: the scalar tail only
    return y


def test_row_reductions_are_eight_interleaved_partial_sums():
    # the order is part of the result: lane l adds x[8 i + l] in order, then a fixed tree
    x = np.random.default_rng(6).standard_normal(37) * 10.0 ** np.arange(-18, 19)
    y = np.linspace(-1.0, 1.0, x.size)
    lanes = [0.0] * 8
    dots = [0.0] * 8
    for j in range(32):
        lanes[j % 8] += x[j]
        dots[j % 8] += x[j] * y[j]

    def tree(v):
        return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]))

    assert row_sum(x, 37) == tree(lanes) + sum(x[32:].tolist())
    assert row_dot(x, y, 37) == tree(dots) + sum((x[32:] * y[32:]).tolist())


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=0, max_size=40))
def test_row_reductions_against_exact_sums(values):
    x = np.array(values, dtype=np.float64)
    y = np.linspace(-2.0, 3.0, x.size)
    n = x.size
    bound = 2 * n * np.finfo(float).eps
    assert abs(row_sum(x, n) - math.fsum(values)) <= bound * np.abs(x).sum()
    exact_dot = math.fsum(a * b for a, b in zip(x.tolist(), y.tolist(), strict=True))
    assert abs(row_dot(x, y, n) - exact_dot) <= bound * np.abs(x * y).sum() + 1e-300
    assert row_max(x, n) == (max(values) if values else -np.inf)


def test_strided_operand_reads_every_broadcast_element():
    rng = np.random.default_rng(1)
    full = (2, 3, 4, 5)
    for shape in [full, (3, 1, 5), (4, 5), (2, 1, 1, 5), (1, 3, 4, 1), ()]:
        x = rng.standard_normal(shape)
        op = strided(x, full, np.float64)
        want = np.broadcast_to(x, full)
        got = np.array([[[[at(op.data, op.strides, b, h, i, j) for j in range(5)]
                          for i in range(4)] for h in range(3)] for b in range(2)])
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError):
        strided(np.zeros((3, 4)), full, np.float64)


@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (False, True), (True, False),
                                              (True, True)])
def test_gemm_row_major_with_strides_alpha_and_beta(trans_a, trans_b):
    rng = np.random.default_rng(2)
    m, n, k = 5, 7, 3
    a = rng.standard_normal((k, m) if trans_a else (m, k))
    b = rng.standard_normal((n, k) if trans_b else (k, n))
    c = rng.standard_normal((m, 9))  # row stride 9 > n: a sub-block of a wider buffer
    want = c.copy()
    want[:, :n] = 0.5 * (a.T if trans_a else a) @ (b.T if trans_b else b) + 2.0 * c[:, :n]
    with single_thread_blas():
        gemm(dgemm_address(), trans_a, trans_b, m, n, k, 0.5, a.ctypes.data, a.shape[1],
             b.ctypes.data, b.shape[1], 2.0, c.ctypes.data, 9)
    np.testing.assert_allclose(c, want, rtol=1e-14, atol=1e-14)


@settings(max_examples=40, deadline=None)
@given(trans_a=st.booleans(), trans_b=st.booleans(), m=st.integers(1, 9), n=st.integers(1, 5),
       k=st.integers(1, 9), cm=st.integers(1, 10), ck=st.integers(1, 10),
       beta=st.sampled_from([0.0, 1.0]))
def test_gemm_split_equals_one_product(trans_a, trans_b, m, n, k, cm, ck, beta):
    rng = np.random.default_rng(m * 100 + n * 10 + k)
    a = rng.standard_normal((k, m) if trans_a else (m, k))
    b = rng.standard_normal((n, k) if trans_b else (k, n))
    c = rng.standard_normal((m, n + 2))
    want = c.copy()
    want[:, :n] = 0.5 * (a.T if trans_a else a) @ (b.T if trans_b else b) + beta * c[:, :n]
    with single_thread_blas():
        gemm_split(dgemm_address(), trans_a, trans_b, m, n, k, 0.5, a.ctypes.data, a.shape[1],
                   b.ctypes.data, b.shape[1], beta, c.ctypes.data, n + 2, cm, ck)
    np.testing.assert_allclose(c, want, rtol=1e-13, atol=1e-13)


@settings(max_examples=60, deadline=None)
@given(kw=visibility_inputs(), data=st.data())
def test_tiles_agree_with_the_dense_relation(kw, data):
    rel = relation(**kw)
    B, H, Q, K = rel.shape
    Hq = H if H > 1 else data.draw(st.integers(1, 3))
    dense = np.broadcast_to(rel.dense(), (B, Hq, Q, K))
    for tv in (tile_visibility((B, Hq, Q, K), relation=rel),
               tile_visibility((B, Hq, Q, K), visible=rel.dense())):
        b, h = data.draw(st.integers(0, B - 1)), data.draw(st.integers(0, Hq - 1))
        i0 = data.draw(st.integers(0, Q - 1))
        i1 = data.draw(st.integers(i0 + 1, Q))
        j0 = data.draw(st.integers(0, K - 1))
        j1 = data.draw(st.integers(j0 + 1, K))
        want = dense[b, h, i0:i1, j0:j1]
        out = np.zeros((i1 - i0 + 1, j1 - j0 + 1), dtype=bool)
        n = tile_mask(out, tv, b, h, i0, i1, j0, j1)
        np.testing.assert_array_equal(out[: i1 - i0, : j1 - j0], want)
        assert n == want.sum()
        cls = classify(tv, b, h, i0, i1, j0, j1)
        assert cls in (INVISIBLE, PARTIAL, FULL)
        if cls == INVISIBLE:  # sound: bounds never hide a visible edge...
            assert not want.any()
        if cls == FULL:  # ...nor an invisible one
            assert want.all()


def test_bounds_decide_causal_tiles_without_elements():
    rel = relation([np.arange(8)], [np.arange(8)], causal=True)
    tv = tile_visibility((1, 1, 8, 8), relation=rel)
    assert classify(tv, 0, 0, 0, 4, 4, 8) == INVISIBLE  # strictly above the diagonal
    assert classify(tv, 0, 0, 4, 8, 0, 4) == FULL  # strictly below it
    assert classify(tv, 0, 0, 0, 4, 0, 4) == PARTIAL  # on it
