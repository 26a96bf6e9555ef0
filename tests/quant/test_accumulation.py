"""The k-block accumulation model (refattn.quant.accumulation) against every accumulator it
claims to enclose, simulated here from their definitions on tiny dot products with a tiny
``bits`` (so that every rounding shows): alignment to the block's largest exponent with
truncation or with rounding to nearest, the exact block sum rounded once, products aligned
among themselves then added to the accumulator, and plain fp32 in every order of additions.
Also the numba exp2 against refattn.quant.elementary.exp2, bit for bit.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from refattn.engine.numba.quant_softmax import exp2_f64
from refattn.quant import elementary
from refattn.quant.accumulation import dot_block_model
from refattn.quant.bounds import Interval, point
from refattn.quant.formats import quantize


def _grid(x: float, q: float, mode: str) -> float:
    """x on the grid of spacing q: toward zero ("rz") or to nearest, ties to even ("rn")."""
    if q == 0:
        return x
    t = x / q
    return (math.trunc(t) if mode == "rz" else round(t)) * q


def _round_bits(x: float, bits: int, mode: str) -> float:
    """x rounded to ``bits`` significant bits (toward zero or to nearest)."""
    if x == 0:
        return 0.0
    e = math.frexp(abs(x))[1] - 1
    return _grid(x, math.ldexp(1.0, e - bits + 1), mode)


def _f32(x: float) -> float:
    return float(np.float32(x))


def _f32_rz(x: float) -> float:
    return _round_bits(x, 24, "rz")


def _aligned(c: float, xs: list[float], bits: int, mode: str, include_c: bool) -> float:
    """One block: the addends aligned to the largest exponent (with or without C), each put on
    the grid of its ``bits``-th bit (toward zero or nearest), summed exactly."""
    group = [c, *xs] if include_c else list(xs)
    big = max(abs(t) for t in group)
    if big == 0:
        s = 0.0
    else:
        q = math.ldexp(1.0, math.frexp(big)[1] - 1 - bits + 1)
        s = math.fsum(_grid(t, q, mode) for t in group)
    return s if include_c else c + _round_bits(s, bits, mode)


def _models(a: np.ndarray, b: np.ndarray, k_block: int, bits: int) -> list[float]:
    """Every accumulator's result for one dot product (float64 values of the results)."""
    D = a.size
    prods = [float(a[d] * b[d]) for d in range(D)]
    out = []
    for mode, include_c in itertools.product(("rz", "rn"), (True, False)):
        for store in (_f32, _f32_rz):
            c = 0.0
            for s in range(0, D, k_block):
                c = store(_aligned(c, prods[s:s + k_block], bits, mode, include_c))
            out.append(c)
    for mode in ("rz", "rn"):  # the exact block sum rounded once to bits, stored in fp32
        c = 0.0
        for s in range(0, D, k_block):
            c = _f32(_round_bits(c + math.fsum(prods[s:s + k_block]), bits, mode))
        out.append(c)
    for perm in itertools.permutations(range(D)):  # plain fp32, every order
        c = np.float32(0)
        for d in perm:
            c = np.float32(c + np.float32(prods[d]))
        out.append(float(c))
    return out


def _e4m3(rng: np.random.Generator, shape: tuple[int, ...], spread: float) -> np.ndarray:
    return quantize(rng.normal(size=shape) * spread, "e4m3fn", "nearest_even_satfinite")


@pytest.mark.parametrize("exact", [False, True], ids=["counted", "exact"])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("bits", [4, 7])
def test_every_accumulator_lands_inside(seed, bits, exact):
    rng = np.random.default_rng(seed)
    D, k_block = 6, 3
    a = _e4m3(rng, (3, D), 2.0)
    b = _e4m3(rng, (4, D), 2.0)
    if seed % 2:  # same-sign products: truncation errors add up instead of cancelling
        a, b = np.abs(a), np.abs(b)
    iv = dot_block_model(point(a), point(b), k_block=k_block, bits=bits,
                         exact_truncation=exact)
    for r in range(a.shape[0]):
        for c in range(b.shape[0]):
            vals = np.array(_models(a[r], b[c], k_block, bits))
            assert np.all((iv.lo[r, c] <= vals) & (vals <= iv.hi[r, c])), (r, c)


def test_interval_operands_land_inside():
    """The operands known only as intervals (a value each side of a cast's boundary): every
    corner choice and every accumulator lands inside."""
    rng = np.random.default_rng(7)
    D, k_block, bits = 4, 2, 5
    lo = _e4m3(rng, (2, D), 2.0)
    hi = lo + np.where(rng.random((2, D)) < 0.5, 0.125, 0.0)
    b = _e4m3(rng, (2, D), 2.0)
    iv = dot_block_model(Interval(lo, hi), point(b), k_block=k_block, bits=bits)
    for r in range(2):
        for pick in itertools.product((0, 1), repeat=D):
            a = np.where(np.array(pick) == 1, hi[r], lo[r])
            for c in range(2):
                vals = np.array(_models(a, b[c], k_block, bits))
                assert np.all((iv.lo[r, c] <= vals) & (vals <= iv.hi[r, c]))


@pytest.mark.parametrize("exact", [False, True], ids=["counted", "exact"])
def test_the_bound_is_attained_within_a_small_factor(exact):
    """A tight case: positive products below the quantum of a large accumulator all lose
    almost a whole quantum under truncation; the bound is within 2.5x of that loss."""
    D, k_block, bits = 8, 8, 5
    a = np.array([[16.0] + [0.875] * (D - 1)])
    b = np.array([[1.0] + [1.125] * (D - 1)])
    iv = dot_block_model(point(a), point(b), k_block=k_block, bits=bits, exact_truncation=exact)
    exact = float((a @ b.T)[0, 0])
    worst = min(_models(a[0], b[0], k_block, bits))
    assert iv.lo[0, 0] <= worst < exact
    assert exact - iv.lo[0, 0] <= 2.5 * (exact - worst)


def test_exp2_numba_is_bit_identical_to_elementary():
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.uniform(-1100, 1100, 20000), rng.uniform(-2, 2, 20000),
                        rng.integers(-1080, 1030, 500) + 0.0, rng.uniform(-30, 10, 20000),
                        [0.0, -0.0, np.inf, -np.inf, 1023.9, -1074.5, -1075.0]])
    ours = np.array([exp2_f64(float(t)) for t in x])
    assert np.array_equal(ours.view(np.int64), elementary.exp2(x).view(np.int64))


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "fp16", "bf16", "fp32"])
def test_numba_format_rounding_is_bit_identical_to_quantize(fmt):
    """The online softmax kernel casts P with round_to_format; quantize is the reference."""
    from refattn.engine.numba.quant_softmax import round_to_format
    from refattn.quant.formats import format_info
    from refattn.quant.rows import _cast_args
    from refattn.quant.spec import QuantSpec, TensorQuant

    rng = np.random.default_rng(11)
    mags = np.exp2(rng.uniform(-160, 140, 4000)) * rng.choice([-1.0, 1.0], 4000)
    x = np.concatenate([mags, rng.normal(size=2000) * 300, [0.0, -0.0, np.inf, -np.inf]])
    info = format_info(fmt)
    tq = TensorQuant("fp16", 1.0, "tensor", "nearest_even", "codes")
    for rounding in info.rounds:
        spec = QuantSpec(tq, tq, tq, s_accumulation="fp32", p_format=fmt, p_rounding=rounding,
                         output_format="fp32")
        _, emin, prec, fmax, over = _cast_args(spec)
        ours = np.array([round_to_format(float(t), emin, prec, fmax, over) for t in x])
        want = quantize(x, fmt, rounding)
        same = (ours == want) | (np.isnan(ours) & np.isnan(want))
        assert same.all(), (rounding, x[~same][:3], ours[~same][:3], want[~same][:3])
        assert np.array_equal(np.signbit(ours[want == 0]), np.signbit(want[want == 0]))


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "fp16", "bf16", "fp32"])
def test_quantize_fast_path_equals_the_numpy_path(fmt):
    """quantize casts arrays of 4096 elements or more in numba; chunks below that take the
    numpy path: the two agree bit for bit (signed zeros and NaN included)."""
    from refattn.quant.formats import format_info

    rng = np.random.default_rng(12)
    x = np.concatenate([np.exp2(rng.uniform(-160, 140, 6000)) * rng.choice([-1.0, 1.0], 6000),
                        [0.0, -0.0, np.inf, -np.inf, np.nan]])
    for rounding in format_info(fmt).rounds:
        fast = quantize(x, fmt, rounding)
        slow = np.concatenate([quantize(x[i:i + 1000], fmt, rounding)
                               for i in range(0, x.size, 1000)])
        assert np.array_equal(fast.view(np.int64), slow.view(np.int64)) or np.array_equal(
            fast, slow, equal_nan=True), rounding


def test_exact_truncation_is_tighter_and_still_holds_the_block_simulations():
    """At a real head width (D = 128, four WGMMA k-blocks, 13 and 14 bits): the exact sums of
    the truncations give an interval several times narrower than the counted one, and both
    hold the block accumulator simulated from its definition (tests/quant/sims.py) and the
    exact dot."""
    from . import sims

    rng = np.random.default_rng(5)
    a = _e4m3(rng, (16, 128), 1.0)
    b = _e4m3(rng, (24, 128), 1.0)
    counted = dot_block_model(point(a), point(b), k_block=32, bits=13, to_fp32=True)
    exact = dot_block_model(point(a), point(b), k_block=32, bits=13, to_fp32=True,
                            exact_truncation=True)
    assert np.median(exact.rad) * 3 < np.median(counted.rad)
    values = [a @ b.T] + [np.asarray(sims.matmul32(a[None], b[None], accumulate=f"wgmma{n}"),
                                     dtype=np.float64)[0] for n in (13, 14)]
    for x in values:
        for iv in (counted, exact):
            assert np.all((iv.lo <= x) & (x <= iv.hi))


def test_bf16_bit_trick_equals_the_two_casts():
    from refattn.quant.check import bf16

    rng = np.random.default_rng(13)
    x = np.concatenate([np.exp2(rng.uniform(-150, 129, 20000)) * rng.choice([-1.0, 1.0], 20000),
                        [0.0, -0.0, np.inf, -np.inf, np.nan, 3.3961e38, -3.3961e38]])
    with np.errstate(over="ignore"):
        want = quantize(quantize(x, "fp32", "nearest_even"), "bf16", "nearest_even")
    got = bf16(x)
    assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(np.signbit(got), np.signbit(want))
