"""The simulations of ``sims.py`` checked on their own, before they judge the pipeline.

Witnesses: ml_dtypes' float8/bfloat16 casts and numpy's float16 cast for the bit-level casts,
exact rationals for the fused multiply-add, the float64 attention of the dequantised inputs for
each simulated kernel (its error must be of the size of its roundings), and the planted bugs
(each must change the simulated result on the inputs built to expose it).
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest

from . import sims

ml_dtypes = pytest.importorskip("ml_dtypes")

ML = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2,
      "bf16": ml_dtypes.bfloat16, "fp16": np.float16}


def _witness(x32: np.ndarray, fmt: str) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return x32.astype(ML[fmt]).astype(np.float32)


def _probe_values(fmt: str) -> np.ndarray:
    """Every finite value of the format, the midpoints between neighbours and the float32
    numbers on either side of each, values past the maximum, +-inf, NaN, +-0, and a
    log-uniform sample over float32's range: float32."""
    if fmt in ("e4m3fn", "e5m2"):
        vals = np.arange(256, dtype=np.uint8).view(ML[fmt]).astype(np.float32)
    else:  # every bf16 / fp16 value with an exponent near the extremes and the middle
        bits = np.concatenate([np.arange(0, 2048), np.arange(0x3C00, 0x4400),
                               np.arange(0x7800, 0x7C00 if fmt == "fp16" else 0x7F80)])
        vals = bits.astype(np.uint16).view(ML[fmt]).astype(np.float32)
    vals = np.unique(vals[np.isfinite(vals)])
    mids = ((vals[:-1].astype(np.float64) + vals[1:]) / 2).astype(np.float32)
    fmax = sims.FORMATS[fmt][2]
    rng = np.random.default_rng(7)
    wide = np.exp2(rng.uniform(-149, 127, 4000)).astype(np.float32)
    with np.errstate(over="ignore"):
        extra = np.array([fmax * 1.03, fmax * 1.07, fmax * 2, 3e38, np.inf, np.nan, 0.0],
                         dtype=np.float32)
    probes = np.concatenate([vals, mids, np.nextafter(mids, np.float32(np.inf)),
                             np.nextafter(mids, np.float32(-np.inf)), wide, extra])
    return np.concatenate([probes, -probes]).astype(np.float32)


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "bf16", "fp16"])
def test_cast_without_saturation_matches_the_witness(fmt):
    x = _probe_values(fmt)
    got = sims.cast(x, fmt, saturate=False)
    want = _witness(x, fmt)
    np.testing.assert_array_equal(got, want)  # NaN == NaN here; -0 vs 0 checked next
    assert np.array_equal(np.signbit(got), np.signbit(want))


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_satfinite_cast_is_clamp_then_round(fmt):
    """cvt.rn.satfinite: a finite overflow and +-inf become +-max, NaN stays NaN."""
    x = _probe_values(fmt)
    fmax = np.float32(sims.FORMATS[fmt][2])
    got = sims.cast(x, fmt, saturate=True)
    np.testing.assert_array_equal(got, _witness(np.clip(x, -fmax, fmax), fmt))
    edge = np.array([464, 465, 480, 1e30, np.inf, -np.inf], np.float32)
    if fmt == "e4m3fn":
        np.testing.assert_array_equal(sims.cast(edge, fmt, saturate=True),
                                      [448, 448, 448, 448, 448, -448])
        # without saturation: the nearest even of 465 is 480, the NaN code (not from 480 on)
        np.testing.assert_array_equal(sims.cast(edge, fmt, saturate=False),
                                      [448, np.nan, np.nan, np.nan, np.nan, np.nan])


def _round_f32(x: Fraction) -> np.float32:
    """The float32 nearest the rational x, ties to even (exact: candidates compared as
    rationals)."""
    f = np.float32(float(x))
    cands = [f, np.nextafter(f, np.float32(np.inf)), np.nextafter(f, np.float32(-np.inf))]
    best = min(cands, key=lambda c: (abs(Fraction(float(c)) - x),
                                     int(np.array(c).view(np.uint32)) & 1))
    return np.float32(best)


def test_fma32_rounds_once():
    rng = np.random.default_rng(3)
    a = (rng.normal(size=300) * 50).astype(np.float32)
    b = (rng.normal(size=300) * 0.3).astype(np.float32)
    c = -(a.astype(np.float64) * b).astype(np.float32)  # a b + c is the product's rounding error
    c[::3] = (rng.normal(size=100) * 40).astype(np.float32)
    # products one float32 half-ulp from c's neighbour: the double rounding cases
    a[:10] = np.float32(1 + 2.0 ** -23)
    b[:10] = np.float32(1 + 2.0 ** -22)
    c[:10] = np.float32(3.0)
    got = sims.fma32(a, b, c)
    for i in range(a.size):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        assert got[i] == _round_f32(exact), (i, a[i], b[i], c[i])
    # infinities pass through
    assert sims.fma32(np.float32(2), np.float32(3), np.float32(-np.inf)) == -np.inf


def test_int8_half_away_rounds_in_float32():
    x = np.array([0.5, -0.5, 1.5, -2.5, 126.5, 0.49999997, -0.49999997, 0.4999999],
                 np.float32)
    # 0.49999997 + 0.5 rounds to 1.0 in float32: the kernel's add, not an exact round
    np.testing.assert_array_equal(sims.int8_half_away(x), [1, -1, 2, -3, 127, 1, -1, 0])


# -- the simulated kernels against the float64 attention of their dequantised inputs ----------
def _real(q, k, v, scale, *, causal=False, alignment="lower_right"):
    """float64 attention (B, Hq, Q, Dv) and natural LSE of already dequantised inputs."""
    Hq, Hkv = q.shape[1], k.shape[1]
    hk = np.arange(Hq) // (Hq // Hkv)
    s = np.einsum("bhqd,bhkd->bhqk", q, k[:, hk]) * scale
    Q, K = s.shape[-2:]
    off = K - Q if alignment == "lower_right" else 0
    vis = np.arange(K)[None, :] <= np.arange(Q)[:, None] + off if causal else np.ones((Q, K),
                                                                                       bool)
    s = np.where(vis, s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    return (np.einsum("bhqk,bhkd->bhqd", e / e.sum(-1, keepdims=True), v[:, hk]),
            np.log(e.sum(-1)) + m[..., 0])


def _kv(d, hk):
    return d[:, hk][..., None, None]


@pytest.mark.parametrize("causal", [False, True])
def test_fa3_sim_is_within_its_roundings_of_the_real_result(causal):
    rng = np.random.default_rng(11)
    B, Hq, Hkv, Q, K, D = 2, 4, 2, 6, 9, 16
    q = sims.fp8_values(rng, (B, Hq, Q, D))
    k = sims.fp8_values(rng, (B, Hkv, K, D))
    v = sims.fp8_values(rng, (B, Hkv, K, D))
    qd, kd, vd = (sims.f32_scales(rng, (B, Hkv)) for _ in range(3))
    r = sims.fa3_fp8(q, k, v, scale=D ** -0.5, q_descale=qd, k_descale=kd, v_descale=vd,
                     causal=causal)
    hk = np.arange(Hq) // 2
    o, lse = _real(q * _kv(qd, hk), k * kd[..., None, None], v * vd[..., None, None],
                   D ** -0.5, causal=causal)
    # P rounded to e4m3 (relative 2^-4 each) then bf16 (2^-9): |O - real| <= 2^-4 max|V|
    vmax = np.abs(v * vd[..., None, None]).max()
    assert np.abs(r.output - o).max() <= 2.0 ** -4 * vmax
    assert np.abs(r.lse - lse).max() <= 1e-5 * np.abs(lse).max()  # l is summed unrounded


def test_fa3_online_blocks_change_p_but_not_the_value():
    rng = np.random.default_rng(12)
    q = sims.fp8_values(rng, (1, 2, 4, 16))
    k = sims.fp8_values(rng, (1, 2, 24, 16))
    v = sims.fp8_values(rng, (1, 2, 24, 16))
    one = sims.fa3_fp8(q, k, v, scale=0.25)
    same = sims.fa3_fp8(q, k, v, scale=0.25, block_n=24)  # all keys in one block
    np.testing.assert_array_equal(one.output, same.output)
    tiled = sims.fa3_fp8(q, k, v, scale=0.25, block_n=8)
    assert not np.array_equal(one.output, tiled.output)  # P8 from the running max
    assert np.abs(one.output - tiled.output).max() <= 2.0 ** -4 * np.abs(v).max()


def test_flashinfer_sm90_sim_is_within_its_roundings():
    rng = np.random.default_rng(13)
    B, Hq, Hkv, Q, K, D = 1, 4, 2, 5, 8, 16
    q = sims.fp8_values(rng, (B, Hq, Q, D), "e5m2")
    k = sims.fp8_values(rng, (B, Hkv, K, D), "e5m2")
    v = sims.fp8_values(rng, (B, Hkv, K, D), "e5m2")
    qs = sims.f32_scales(rng, (B, Hq))
    ks, vs = sims.f32_scales(rng, (B, Hkv)), sims.f32_scales(rng, (B, Hkv))
    r = sims.flashinfer_sm90_fp8(q, k, v, scale=0.25, q_scale=qs, k_scale=ks, v_scale=vs,
                                 fmt="e5m2")
    hk = np.arange(Hq) // 2
    o, lse = _real(q * qs[..., None, None], k * ks[..., None, None], v * vs[..., None, None],
                   0.25)
    vmax = np.abs(v * vs[..., None, None]).max()
    assert np.abs(r.output - o).max() <= 2.0 ** -3 * vmax  # e5m2 P: relative 2^-3
    assert np.abs(r.lse - lse).max() <= 1e-5 * np.abs(lse).max()
    assert hk.shape == (Hq,)


def test_flashinfer_fp8_kv_sim_is_within_its_roundings():
    rng = np.random.default_rng(14)
    q = sims.grid_values(rng, (1, 2, 4, 16), "fp16")
    k = sims.fp8_values(rng, (1, 1, 8, 16))
    v = sims.fp8_values(rng, (1, 1, 8, 16))
    r = sims.flashinfer_fp8_kv(q, k, v, scale=0.25, k_scale=0.5, v_scale=2.0)
    o, lse = _real(q, k * 0.5, v * 2.0, 0.25)
    assert np.abs(r.output - o).max() <= 2.0 ** -8 * np.abs(v * 2).max()  # fp16 P and O
    assert np.abs(r.lse - lse).max() <= 1e-3


def test_vllm_sim_quantises_like_the_cache_write():
    rng = np.random.default_rng(15)
    q = sims.grid_values(rng, (1, 2, 4, 16), "bf16")
    k = sims.grid_values(rng, (1, 2, 8, 16), "bf16", spread=3.0)
    v = sims.grid_values(rng, (1, 2, 8, 16), "bf16")
    r = sims.vllm_fp8_kv(q, k, v, scale=0.25, q_scale=0.01, k_scale=0.02, v_scale=0.005)
    o, _ = _real(q, k, v, 0.25)
    assert np.abs(r.output - o).max() <= 0.1 * np.abs(v).max()  # three e4m3 casts and P's
    # values past 448 x k_scale: satfinite keeps 448, the unsaturated cast gives NaN
    k[0, 0, 0, 0] = 448 * 0.02 * 1.1
    bad = sims.vllm_fp8_kv(q, k, v, scale=0.25, q_scale=0.01, k_scale=0.02, v_scale=0.005,
                           bug="no_saturate")
    good = sims.vllm_fp8_kv(q, k, v, scale=0.25, q_scale=0.01, k_scale=0.02, v_scale=0.005)
    assert np.isnan(bad.output[0, 0]).all() and np.isfinite(good.output).all()


@pytest.mark.parametrize("causal", [False, True])
def test_sage_sim_is_within_its_roundings(causal):
    rng = np.random.default_rng(16)
    q = sims.grid_values(rng, (1, 2, 8, 16), "fp16")
    k = sims.grid_values(rng, (1, 2, 80, 16), "fp16") + 2.0  # a mean for the smoothing
    v = sims.grid_values(rng, (1, 2, 80, 16), "fp16")
    if causal:
        q = sims.grid_values(rng, (1, 2, 80, 16), "fp16")
    r = sims.sageattention_int8(q, k, v, scale=0.25, causal=causal)
    o, _ = _real(q, k, v, 0.25, causal=causal, alignment="upper_left")
    # int8 Q and K (relative 2^-8 of each block's max), fp16 P and tile sums
    assert np.abs(r.output - o).max() <= 0.02 * np.abs(v).max()
    exact = sims.sageattention_int8(q, k, v, scale=0.25, causal=causal, round_smoothing=False)
    assert np.abs(exact.output - o).max() <= 0.02 * np.abs(v).max()


# -- each planted bug changes the simulated result on the inputs meant to expose it -----------
def _fa3_inputs(rng):
    B, Hq, Hkv, Q, K, D = 1, 4, 2, 4, 8, 16
    q = sims.fp8_values(rng, (B, Hq, Q, D), spread=1.0)  # diffuse rows: many mid-size p
    k = sims.fp8_values(rng, (B, Hkv, K, D), spread=1.0)
    v = sims.fp8_values(rng, (B, Hkv, K, D))
    d = {name: np.array([[0.5, 3.0]]) for name in ("q_descale", "k_descale", "v_descale")}
    return q, k, v, d


@pytest.mark.parametrize("bug", ["no_q_descale", "no_k_descale", "no_v_descale",
                                 "wrong_kv_head", "l_after_rounding"])
def test_fa3_bugs_change_random_results(bug):
    q, k, v, d = _fa3_inputs(np.random.default_rng(17))
    good = sims.fa3_fp8(q, k, v, scale=0.25, **d)
    bad = sims.fa3_fp8(q, k, v, scale=0.25, bug=bug, **d)
    # more than bf16's rounding of the largest output
    assert np.abs(bad.output - good.output).max() > 2.0 ** -8 * np.abs(good.output).max()


def test_fa3_missing_offset_loses_the_small_probabilities():
    q, k, v = sims.dominant_key_codes(np.random.default_rng(18), 1, 2, 2, 3, 12, 16)
    good = sims.fa3_fp8(q, k, v, scale=0.25)
    bad = sims.fa3_fp8(q, k, v, scale=0.25, bug="no_offset")
    assert np.abs(good.output).max() > 0 and np.abs(bad.output).max() == 0
    np.testing.assert_allclose(bad.lse, good.lse, rtol=1e-6)  # Max_offset = 0 fixes the LSE


def test_bug_names_are_checked():
    q, k, v, d = _fa3_inputs(np.random.default_rng(19))
    with pytest.raises(ValueError, match="not modelled"):
        sims.fa3_fp8(q, k, v, scale=0.25, bug="l_before_rounding", **d)


# -- issue 41: the accumulation orders of FA3's products, each against its own witness ----------
def _fp8_pair(rng, M, N, n, spread=3.0):
    return sims.fp8_values(rng, (M, n), spread=spread), sims.fp8_values(rng, (N, n),
                                                                         spread=spread)


def _exact(a, b):
    """The exact sums of the products (float64 products of e4m3 values are exact; the sum as
    rationals)."""
    return np.array([[float(sum(Fraction(float(x)) * Fraction(float(y)) for x, y in
                                zip(a[i], b[j], strict=True)))
                      for j in range(b.shape[0])] for i in range(a.shape[0])])


def _gamma(k):
    u = 2.0 ** -24
    return k * u / (1 - k * u)


def test_sequential_is_the_default_and_the_old_order():
    rng = np.random.default_rng(40)
    a, b = _fp8_pair(rng, 5, 6, 37)
    want = np.zeros((5, 6), np.float32)
    for d in range(37):  # float32 adds, d ascending
        want = (want + (a[:, None, d] * b[None, :, d]).astype(np.float32)).astype(np.float32)
    np.testing.assert_array_equal(sims.matmul32(a, b), want)
    np.testing.assert_array_equal(sims.matmul32(a, b, "sequential"), want)


def _pairwise_scalar(xs):
    if len(xs) == 1:
        return np.float32(xs[0])
    mid = len(xs) // 2
    return np.float32(_pairwise_scalar(xs[:mid]) + _pairwise_scalar(xs[mid:]))


@pytest.mark.parametrize("n", [1, 2, 7, 32, 100])
def test_pairwise_matches_a_scalar_recursion_and_its_bound(n):
    rng = np.random.default_rng(41 + n)
    a, b = _fp8_pair(rng, 4, 5, n)
    got = sims.matmul32(a, b, "pairwise")
    for i in range(4):
        for j in range(5):
            prods = [np.float32(a[i, d] * b[j, d]) for d in range(n)]
            assert got[i, j] == _pairwise_scalar(prods), (i, j)
    # |pairwise - exact| <= gamma_ceil(log2 n) sum |products| (the products are exact)
    bound = _gamma(int(np.ceil(np.log2(n))) if n > 1 else 0) * (np.abs(a) @ np.abs(b).T)
    assert (np.abs(got - _exact(a, b)) <= bound).all()


def test_random_order_is_some_order_per_element_and_follows_the_seed():
    """Three addends whose float32 sum depends on the order (1 + u + u = 1 ascending, 1 + 2u
    when the two u go first): every element's result is one of the orders' results, both
    appear, and the seed decides which."""
    u = 2.0 ** -24
    a = np.ones((40, 3))
    b = np.tile([1.0, u, u], (50, 1))
    orders = {float(np.float32(np.float32(np.float32(x) + np.float32(y)) + np.float32(z)))
              for x, y, z in itertools.permutations([1.0, u, u])}
    got = sims.matmul32(a, b, "random", rng=5)
    assert set(np.unique(got).tolist()) == orders == {1.0, 1.0 + 2 * u}
    np.testing.assert_array_equal(got, sims.matmul32(a, b, "random", rng=5))
    np.testing.assert_array_equal(
        got, sims.matmul32(a, b, "random", rng=np.random.default_rng(5)))
    assert not np.array_equal(got, sims.matmul32(a, b, "random", rng=6))


def test_random_order_is_within_the_sequential_bound():
    rng = np.random.default_rng(43)
    a, b = _fp8_pair(rng, 6, 7, 90)
    got = sims.matmul32(a[None], b[None], "random", rng=1)[0]
    bound = _gamma(89) * (np.abs(a) @ np.abs(b).T)
    assert (np.abs(got - _exact(a, b)) <= bound).all()


def _wgmma_witness(c, prods, bits):
    """The WGMMA block model in exact rationals (the spec written again, scalar)."""
    vals = [Fraction(float(c))] + [Fraction(float(p)) for p in prods]
    big = max(abs(x) for x in vals)
    if big == 0:
        return float(c)
    e = 0
    while Fraction(2) ** (e + 1) <= big:
        e += 1
    while Fraction(2) ** e > big:
        e -= 1
    quantum = Fraction(2) ** (e - (bits - 1))
    total = sum(int(x / quantum) * quantum for x in vals)  # int(): toward zero
    f = np.float32(float(total))
    if abs(Fraction(float(f))) > abs(total):  # store toward zero
        f = np.nextafter(f, np.float32(0))
    return float(f)


def test_wgmma_block_on_hand_made_blocks():
    blk = sims.wgmma_block
    # products that fit in b bits below the largest exponent: the exact sum
    ints = np.arange(1, 33, dtype=np.float64) * 37  # max 1184 < 2^11: quantum <= 1
    assert blk(np.float32(0), ints, 13) == ints.sum()
    # 2^13 sets E = 13, quantum 2 at 13 bits (the three ones are dropped), 1 at 14 bits
    p = np.array([2.0 ** 13, 1.0, 1.0, 1.0])
    assert blk(np.float32(0), p, 13) == 2.0 ** 13
    assert blk(np.float32(0), p, 14) == 2.0 ** 13 + 3
    # truncation toward zero, negative addends included: -8192 + trunc(3/2)*2 - trunc(3/2)*2
    assert blk(np.float32(0), np.array([-(2.0 ** 13), 3.0, -3.0]), 13) == -(2.0 ** 13)
    assert blk(np.float32(0), np.array([-(2.0 ** 13), 3.0]), 13) == -(2.0 ** 13) + 2
    # the accumulator takes part: C = 2^20 sets the quantum 2^7 at 14 bits, 32 ones vanish
    # (a float32 add per product would give 2^20 + 32), and C itself is truncated
    assert blk(np.float32(2.0 ** 20), np.ones(32), 14) == 2.0 ** 20
    assert blk(np.float32(2.0 ** 20 + 127), np.ones(32), 14) == 2.0 ** 20
    assert blk(np.float32(2.0 ** 20 + 127), np.ones(32), 24) == 2.0 ** 20 + 127 + 32
    # all zero: C unchanged; NaN and inf pass through
    assert blk(np.float32(0), np.zeros(32), 13) == 0
    assert np.isnan(blk(np.float32(1), np.array([np.nan, 1.0]), 13))
    assert blk(np.float32(1), np.array([np.inf, 1.0]), 13) == np.inf


def test_wgmma_matches_the_rational_witness():
    rng = np.random.default_rng(44)
    a, b = _fp8_pair(rng, 3, 4, 70)  # blocks of 32, 32 and 6
    init = (rng.normal(size=(3, 4)) * 100).astype(np.float32)
    for bits in (13, 14):
        got = sims.matmul32(a, b, f"wgmma{bits}", init=init)
        for i in range(3):
            for j in range(4):
                c = init[i, j]
                for lo in range(0, 70, 32):
                    prods = a[i, lo:lo + 32] * b[j, lo:lo + 32]
                    c = np.float32(_wgmma_witness(c, prods, bits))
                assert got[i, j] == c, (bits, i, j)


def test_float32_toward_zero():
    x = np.array([1 + 2.0 ** -30, -(1 + 2.0 ** -24 + 2.0 ** -30), 1e39, -1e39, np.inf, 0.5])
    got = sims._f32_toward_zero(x)
    f32max = float(np.finfo(np.float32).max)
    np.testing.assert_array_equal(got, [1.0, -1.0, f32max, -f32max, np.inf, 0.5])


@pytest.mark.parametrize("accumulate", sims.ACCUMULATORS)
def test_fa3_accumulators_stay_within_the_roundings(accumulate):
    rng = np.random.default_rng(45)
    B, Hq, Hkv, Q, K, D = 1, 2, 1, 5, 70, 64
    q = sims.fp8_values(rng, (B, Hq, Q, D), spread=1.0)
    k = sims.fp8_values(rng, (B, Hkv, K, D), spread=1.0)
    v = sims.fp8_values(rng, (B, Hkv, K, D))
    r = sims.fa3_fp8(q, k, v, scale=D ** -0.5, block_n=48, accumulate=accumulate, rng=3)
    o, _ = _real(q, k, v, D ** -0.5)
    assert np.abs(r.output - o).max() <= 2.0 ** -4 * np.abs(v).max()
    exact_s = np.einsum("bhqd,bhkd->bhqk", q, k[:, [0, 0]])
    # 13-bit truncation: each of the 2 blocks of 32 loses < 33 quanta, a quantum at most
    # 2^-12 of its largest addend, itself at most sum |q k|
    bound = 2 * 33 * 2.0 ** -12 * np.einsum("bhqd,bhkd->bhqk", np.abs(q), np.abs(k[:, [0, 0]]))
    assert (np.abs(r.scores - exact_s) <= bound).all()
    if accumulate == "sequential":
        np.testing.assert_array_equal(r.output, sims.fa3_fp8(q, k, v, scale=D ** -0.5,
                                                             block_n=48).output)


@pytest.mark.parametrize("bug", ["no_log2e", "scale_twice", "natural_exp", "p_e5m2",
                                 "drop_last_tile"])
def test_fa3_new_bugs_change_random_results(bug):
    q, k, v, d = _fa3_inputs(np.random.default_rng(46))
    good = sims.fa3_fp8(q, k, v, scale=0.25, block_n=3, **d)
    bad = sims.fa3_fp8(q, k, v, scale=0.25, block_n=3, bug=bug, **d)
    assert np.abs(bad.output - good.output).max() > 2.0 ** -8 * np.abs(good.output).max()


def test_fa3_drop_last_tile():
    q, k, v, d = _fa3_inputs(np.random.default_rng(47))  # K = 8
    one = sims.fa3_fp8(q, k, v, scale=0.25, bug="drop_last_tile", **d)  # one tile: empty rows
    assert (one.output == 0).all() and np.isneginf(one.lse).all() and (one.row_sum == 0).all()
    # tiles of 3: keys 6, 7 are never visited; the result is FA3 on keys 0..5
    bad = sims.fa3_fp8(q, k, v, scale=0.25, block_n=3, bug="drop_last_tile", **d)
    cut = sims.fa3_fp8(q, k[:, :, :6], v[:, :, :6], scale=0.25, block_n=3, **d)
    np.testing.assert_array_equal(bad.output, cut.output)
    np.testing.assert_array_equal(bad.lse, cut.lse)


def test_fa3_natural_exp_and_missing_log2e_are_distinct_bugs():
    """The kernel's weights are 2^(S scale log2 e) = e^(S scale); without log2 e they are
    2^(S scale), with exp for exp2 e^(S scale log2 e): three different softmax temperatures."""
    q, k, v, d = _fa3_inputs(np.random.default_rng(48))
    nat = sims.fa3_fp8(q, k, v, scale=0.25, bug="natural_exp", **d)
    nolog = sims.fa3_fp8(q, k, v, scale=0.25, bug="no_log2e", **d)
    good = sims.fa3_fp8(q, k, v, scale=0.25, **d)
    assert not np.array_equal(nat.output, good.output)
    assert not np.array_equal(nolog.output, good.output)
    assert not np.array_equal(nat.output, nolog.output)


def _sage_inputs(rng, Q=8, K=150, D=16):
    q = sims.grid_values(rng, (1, 2, Q, D), "fp16")
    k = sims.grid_values(rng, (1, 1, K, D), "fp16") + sims.grid_values(rng, (1, 1, 1, D),
                                                                       "fp16")
    v = sims.grid_values(rng, (1, 1, K, D), "fp16")
    return q, sims.cast(k, "fp16", saturate=False).astype(np.float64), v


def test_sage_scale_orders_are_both_near_the_real_result():
    q, k, v = _sage_inputs(np.random.default_rng(49))
    a = sims.sageattention_int8(q, k, v, scale=0.25)
    b = sims.sageattention_int8(q, k, v, scale=0.25, scale_order="sequential")
    assert not np.array_equal(a.scores, b.scores)  # one rounding apart somewhere
    np.testing.assert_allclose(b.scores, a.scores, rtol=2.0 ** -22, atol=0)
    o, _ = _real(q, k, v, 0.25)
    assert np.abs(b.output - o).max() <= 0.02 * np.abs(v).max()
    with pytest.raises(ValueError, match="scale_order"):
        sims.sageattention_int8(q, k, v, scale=0.25, scale_order="reversed")


@pytest.mark.parametrize("bug", ["no_log2e_prescale", "no_alpha_rescale", "single_k_scale"])
def test_sage_bugs_change_multi_block_results(bug):
    q, k, v = _sage_inputs(np.random.default_rng(50))  # three 64-key blocks
    good = sims.sageattention_int8(q, k, v, scale=0.25)
    bad = sims.sageattention_int8(q, k, v, scale=0.25, bug=bug)
    assert np.abs(bad.output - good.output).max() > 2.0 ** -6 * np.abs(good.output).max()


@pytest.mark.parametrize("bug", ["no_alpha_rescale", "single_k_scale"])
def test_sage_tile_bugs_need_two_blocks(bug):
    q, k, v = _sage_inputs(np.random.default_rng(51), K=64)  # one 64-key block
    good = sims.sageattention_int8(q, k, v, scale=0.25)
    bad = sims.sageattention_int8(q, k, v, scale=0.25, bug=bug)
    np.testing.assert_array_equal(bad.output, good.output)
