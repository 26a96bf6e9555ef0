"""quantized(): the real result is the engines' on the dequantised call, and the intervals hold
the exact values they claim to hold (exact rationals where the pipeline does not round)."""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest

from refattn import AttentionCall, forward
from refattn.masks import causal
from refattn.quant import bounds as bd
from refattn.quant import preset, quantized
from refattn.quant.bounds import Interval, point
from refattn.quant.formats import quantize

B, Hq, Hkv, Q, K, D = 2, 4, 2, 3, 6, 8


def _codes(shape, seed, fmt="e4m3fn"):
    rng = np.random.default_rng(seed)
    return quantize(rng.standard_normal(shape) * 2, fmt, "nearest_even_satfinite")


def _qkv(fmt="e4m3fn"):
    return (_codes((B, Hq, Q, D), 0, fmt), _codes((B, Hkv, K, D), 1, fmt),
            _codes((B, Hkv, K, D), 2, fmt))


def _descales(seed):
    rng = np.random.default_rng(seed)
    return quantize(rng.uniform(0.25, 2.0, (B, Hkv)), "fp32", "nearest_even")


@pytest.mark.parametrize("visible", [None, "causal"])
def test_real_result_is_the_engine_on_codes_times_descale(visible):
    q, k, v = _qkv()
    qd, kd, vd = _descales(3), _descales(4), _descales(5)
    vis = causal(Q, K, alignment="lower_right") if visible else None
    res = quantized(AttentionCall(q, k, v, visible=vis),
                    preset("fa3_fp8", q_descale=qd, k_descale=kd, v_descale=vd),
                    backend="numpy")
    # dequantise element by element: query head h reads kv head h // (Hq // Hkv)
    qx = np.empty_like(q)
    for b, h in itertools.product(range(B), range(Hq)):
        qx[b, h] = q[b, h] * qd[b, h // (Hq // Hkv)]
    kx = k * kd[:, :, None, None]
    vx = v * vd[:, :, None, None]
    want = forward(AttentionCall(qx, kx, vx, visible=vis))
    for name in ("output", "lse", "probs", "scores", "row_max"):
        np.testing.assert_array_equal(getattr(res.real, name), getattr(want, name), name)
    assert res.real.call.visible is vis


def test_real_result_from_the_exact_backend():
    q, k, v = _qkv()
    call = AttentionCall(q, k, v)
    exact = quantized(call, preset("fa3_fp8", v_descale=0.5), backend="exact")
    numpy = quantized(call, preset("fa3_fp8", v_descale=0.5))
    assert exact.real.arithmetic == "stepwise_correctly_rounded"
    np.testing.assert_allclose(exact.real.output, numpy.real.output, rtol=1e-13, atol=1e-15)
    for name, iv in exact.emulated.items():  # the emulation does not depend on the backend
        np.testing.assert_array_equal(iv.lo, numpy.emulated[name].lo, name)


def test_cast_inputs_enter_the_real_result_as_given():
    rng = np.random.default_rng(7)
    q, k, v = (quantize(rng.standard_normal(s), "bf16", "nearest_even")
               for s in ((B, Hq, Q, D), (B, Hkv, K, D), (B, Hkv, K, D)))
    res = quantized(AttentionCall(q, k, v), preset("vllm_fp8_kv", k_scale=0.5, v_scale=0.25),
                    backend="numpy")
    np.testing.assert_array_equal(res.real.output, forward(AttentionCall(q, k, v)).output)


def _exact_dot(a, b):
    return sum((Fraction(x) * Fraction(y) for x, y in zip(a, b, strict=True)), Fraction(0))


def test_scores_hold_the_exact_dot_of_the_codes_in_every_order():
    """S is fp32-accumulated on the codes; its interval must hold the exact rational dot (and
    so every order's result within the bound). Without k-blocks (``mma_k=0``) the bound is
    the any-order one."""
    q, k, v = _qkv()
    spec = preset("fa3_fp8", mma_bits=24).replace(mma_k=0)
    res = quantized(AttentionCall(q, k, v), spec)
    S = res.emulated["scores"]
    for b, h, i, j in itertools.product(range(B), range(Hq), range(Q), range(K)):
        exact = _exact_dot(q[b, h, i], k[b, h // 2, j])
        assert Fraction(S.lo[b, h, i, j]) <= exact <= Fraction(S.hi[b, h, i, j])
    # the interval is the any-order bound, not wider: gamma_{D-1}(2^-23) sum |q k| plus an ulp
    width = S.hi - S.lo
    mag = np.abs(q) @ np.abs(k[:, np.arange(Hq) // 2]).swapaxes(2, 3)
    assert np.all(width <= 2 * (D * 2.0**-23 * mag) + 2 * np.spacing(np.float32(mag)) + 1e-30)


def test_exact_spec_scores_and_row_max_are_the_exact_values():
    q, k, v = _qkv()
    spec = preset("fa3_fp8").replace(s_accumulation="exact", name="custom")
    res = quantized(AttentionCall(q, k, v), spec)
    exact = np.einsum("bhqd,bhkd->bhqk", q, k[:, np.arange(Hq) // 2])  # exact: 8 e4m3 products
    assert np.all(res.emulated["scores"].contains(exact))
    assert np.all(res.emulated["row_max"].contains(exact.max(-1)))


# -- the interval operations against exact rationals ----------------------------------------
class _Inf:
    """An unbounded end: compares past every rational."""

    def __init__(self, sign):
        self.sign = sign

    def __le__(self, other):
        return self.sign < 0

    def __ge__(self, other):
        return self.sign > 0


def _fr(iv, idx):
    lo, hi = float(iv.lo[idx]), float(iv.hi[idx])
    return (_Inf(-1) if lo == -np.inf else Fraction(lo),
            _Inf(1) if hi == np.inf else Fraction(hi))


VALUES = [0.0, 1.0, -3.0, 0.1, 1e-300, -7.25e10, 2.0**-1074, 1 / 3, 448.0]


def test_add_mul_div_hold_the_exact_rational_results():
    xs = np.array(VALUES)
    for a, b in itertools.product(xs, xs):
        s = bd.add(point(a), point(b))
        lo, hi = _fr(s, ())
        assert lo <= Fraction(a) + Fraction(b) <= hi
        p = bd.mul(point(a), point(b))
        lo, hi = _fr(p, ())
        assert lo <= Fraction(a) * Fraction(b) <= hi
        if b > 0:
            d = bd.div(point(a), point(b))
            lo, hi = _fr(d, ())
            assert lo <= Fraction(a) / Fraction(b) <= hi
    # exact operations stay points (the error-free transforms see they are exact)
    assert bd.add(point(1.0), point(2.0)).rad == 0
    assert bd.mul(point(0.75), point(448.0)).rad == 0


def test_mul_of_intervals_takes_every_corner():
    a = Interval(np.array(-2.0), np.array(3.0))
    b = Interval(np.array(-5.0), np.array(-1.0))
    r = bd.mul(a, b)
    corners = [x * y for x in (-2, 3) for y in (-5, -1)]
    assert r.lo <= min(corners) and r.hi >= max(corners) and r.lo > -15.01 and r.hi < 10.01


def test_signed_dot_bound_holds_every_float32_order():
    rng = np.random.default_rng(11)
    a = quantize(rng.standard_normal((1, 5)), "fp16", "nearest_even")
    b = quantize(rng.standard_normal((1, 5)) * 1e3, "fp16", "nearest_even")
    iv = bd.signed_dot(point(a), point(b), "id,jd->ij", n=5, u_acc=2.0**-24)
    for perm in itertools.permutations(range(5)):
        s = np.float32(0)
        for d in perm:
            s = np.float32(s + np.float32(a[0, d] * b[0, d]))
        assert iv.lo[0, 0] <= float(s) <= iv.hi[0, 0], perm


def test_cast_interval_is_monotone_rounding_of_its_ends():
    iv = Interval(np.array([0.30, 440.0, -500.0]), np.array([0.34, 470.0, -460.0]))
    sat = bd.cast(iv, "e4m3fn", "nearest_even_satfinite")
    assert sat.lo.tolist() == [0.3125, 448.0, -448.0]
    assert sat.hi.tolist() == [0.34375, 448.0, -448.0]
    nan = bd.cast(iv, "e4m3fn", "nearest_even_nan")  # 470 may be NaN: the side is unbounded
    assert nan.hi[1] == np.inf and nan.lo[2] == -np.inf


def test_exp2_bound_holds_float64_exp2_and_flushes():
    x = np.array([-150.0, -10.5, 0.0, 3.25, 8.0])
    r = bd.exp2(point(x), 2.0)
    assert np.all(r.contains(np.exp2(x).astype(np.float32).astype(np.float64)))
    assert r.lo[0] == 0.0  # 2^-150 flushes to zero under ftz
    assert np.all(r.hi[1:] / r.lo[1:] - 1 < 6 * 2.0**-23)


def test_gamma_is_an_upper_bound():
    for k in (1, 7, 1000):
        u = 2.0**-24
        ku = Fraction(k) * Fraction(u)
        assert Fraction(bd.gamma(k, u)) >= ku / (1 - ku)


def test_descales_after_the_dot_scale_the_scores():
    """A custom spec that multiplies S by q_scale k_scale after the dot (as SageAttention does
    with its int8 scales) holds the exact scaled dot; the exponent multiplier is then the bare
    scale log2e, and the emulated P equals the FA3-style spec's where no rounding differs."""
    q, k, v = _qkv()
    qd, kd = _descales(3), _descales(4)
    folded = preset("fa3_fp8", q_descale=qd, k_descale=kd)
    after = folded.replace(s_descale="after_dot", s_accumulation="exact", name="custom")
    call = AttentionCall(q, k, v)
    em = quantized(call, after).emulated
    for b, h, i, j in itertools.product(range(B), range(Hq), range(Q), range(K)):
        exact = _exact_dot(q[b, h, i], k[b, h // 2, j])
        exact *= Fraction(float(np.float32(qd[b, h // 2] * kd[b, h // 2])))
        assert Fraction(em["scores"].lo[b, h, i, j]) <= exact
        assert exact <= Fraction(em["scores"].hi[b, h, i, j])
    probs = quantized(call, folded, backend="numpy").real.probs
    r = probs / probs.max(-1, keepdims=True)  # exp(s - m): P / 256 up to e4m3's rounding
    assert np.all(np.abs(em["probs_q"].mid / 256 - r) <= 2.0**-4 * r + 2.0**-9)
