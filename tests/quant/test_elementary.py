"""refattn.quant.elementary: exp2 and log within their stated bounds (against mpmath), the bound
of exp2 re-derived with exact rationals, and an emulated pipeline that calls no numpy/libm
transcendental function (so its interval ends are the same bits on every machine)."""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import numpy as np
import pytest

import refattn.quant.pipeline as pipeline
from refattn import AttentionCall
from refattn.quant import bounds as bd
from refattn.quant import elementary as el
from refattn.quant.formats import quantize
from refattn.quant.presets import PRESETS, preset

U = Fraction(1, 2**53)
TINY = Fraction(1, 2**1075)


@pytest.fixture(autouse=True)
def _precision():
    with mpmath.workprec(200):
        yield


def _mp(x: float | Fraction) -> mpmath.mpf:
    if isinstance(x, Fraction):
        return mpmath.mpf(x.numerator) / x.denominator
    return mpmath.mpf(float(x))


def _frac(x: mpmath.mpf) -> Fraction:
    m, e = mpmath.mpf(x).man_exp
    return Fraction(int(m)) * Fraction(2) ** int(e)


# -- constants ---------------------------------------------------------------------------------
def test_constants_are_the_correctly_rounded_values():
    ln2 = mpmath.log(2)
    for i, c in enumerate(el._EXP2_COEFFS):
        assert c == float(ln2**i / mpmath.factorial(i)), i
    for j, c in enumerate(el._LOG_COEFFS, start=1):
        assert c == float(mpmath.mpf(2) / (2 * j + 1)), j
    assert el._SQRT_HALF == float(mpmath.sqrt(mpmath.mpf(0.5)))
    assert pipeline.LN2 == float(ln2)
    # the ln2 split: LN2_HI has at most 32 significant bits (e * LN2_HI exact for |e| < 2**21)
    # and LN2_HI + LN2_LO is within 2**-86 of ln 2
    hi = Fraction(el._LN2_HI)
    assert (hi * 2**32).denominator == 1
    assert abs(hi + Fraction(el._LN2_LO) - _frac(ln2)) < Fraction(1, 2**86)


# -- exp2 --------------------------------------------------------------------------------------
def test_exp2_bound_rederived_with_exact_rationals():
    """The docstring's bound ``u + (1 + u) A(1/2) sqrt(2)`` with exact rationals (mpmath for
    ln 2's powers at 200 bits, far below the u**2 scale of the terms) is below the constant."""
    phi = Fraction(1, 2)
    c = [Fraction(v) for v in el._EXP2_COEFFS]
    n = len(c) - 1
    M = [sum(c[j] * phi ** (j - i) for j in range(i, n + 1)) for i in range(n + 1)]
    E = [Fraction(0)] * (n + 1)
    for i in range(n - 1, 0, -1):
        D = phi * E[i + 1] + U * phi * (M[i + 1] + E[i + 1]) + TINY
        E[i] = D * (1 + U) + U * M[i]
    ln2 = mpmath.log(2)
    C = sum(abs(_mp(c[i]) - ln2**i / mpmath.factorial(i)) * _mp(phi) ** i for i in range(n + 1))
    T = (_mp(phi) * ln2) ** 15 / mpmath.factorial(15) / (1 - _mp(phi) * ln2 / 16)
    A = _mp(phi * E[1] + 2 * U * U + 16 * TINY) + C + T
    rel = _mp(U) + (1 + _mp(U)) * A * mpmath.sqrt(2)
    assert rel <= _mp(Fraction(el.EXP2_MAX_REL_ERROR))
    assert rel > _mp(Fraction(el.EXP2_MAX_REL_ERROR)) * 0.9  # the statement is not loose
    # bounds.exp2's slack covers it: (1 + e)(1 - r - s) <= 1 - r, (1 - e)(1 + r + s) >= 1 + r
    e, s, r = Fraction(el.EXP2_MAX_REL_ERROR), Fraction(bd._EXP2_SLACK), Fraction(1, 2)
    assert (1 + e) * (1 - r - s) <= 1 - r and (1 - e) * (1 + r + s) >= 1 + r


def _exp2_arguments() -> np.ndarray:
    rng = np.random.default_rng(28)
    return np.concatenate([
        rng.uniform(-1076.0, 1024.0, 1500),
        rng.uniform(-1.0, 1.0, 1500),
        rng.uniform(-30.0, 30.0, 1000),
        np.arange(-60, 61) + 0.5, np.arange(-1080.0, 1025.0, 37.0),
        rng.uniform(-1.0, 1.0, 200) * 1e-12, [1e-300, -1e-300, 5e-324, -5e-324, 0.0, -0.0],
        [-1022.0, -1022.5, -1074.0, -1074.5, -1075.0, -1075.5, -1076.0, 1023.0, 1023.5,
         1023.999999999, np.nextafter(1024.0, 0.0), -126.0, -149.0, 127.99999999, 128.0],
    ])


def test_exp2_is_within_its_bound_of_mpmath():
    x = _exp2_arguments()
    y = el.exp2(x)
    rel = _mp(Fraction(el.EXP2_MAX_REL_ERROR))
    worst = mpmath.mpf(0)
    for xi, yi in zip(x.tolist(), y.tolist(), strict=True):
        t = mpmath.power(2, mpmath.mpf(xi))
        if yi == math.inf:  # only where 2**x is within 4u of float64's largest value
            assert xi >= 1024 or t >= _mp(Fraction(np.finfo(np.float64).max)) * (1 - 4 * _mp(U))
            continue
        err = abs(mpmath.mpf(yi) - t)
        assert err <= rel * t + _mp(TINY), (xi, yi)
        if t >= mpmath.mpf(2) ** -1022:
            worst = max(worst, err / t)
    assert worst > 0.3 * _mp(U)  # the arguments do reach rounding errors
    n = np.arange(-1074, 1024)
    assert np.array_equal(el.exp2(n.astype(np.float64)), np.ldexp(1.0, n))  # exact


def test_exp2_special_values_and_shapes():
    x = np.array([np.nan, np.inf, -np.inf, 1024.0, 2000.0, -1076.0, -5000.0, 0.0, -0.0])
    y = el.exp2(x)
    assert np.isnan(y[0]) and y[1] == np.inf and y[2] == 0.0 and y[3] == np.inf
    assert y[4] == np.inf and y[5] == 0.0 and y[6] == 0.0 and y[7] == 1.0 and y[8] == 1.0
    assert el.exp2(3.0).shape == () and el.exp2(np.zeros((2, 0, 3))).shape == (2, 0, 3)
    with np.errstate(all="raise"):  # no floating-point warning escapes
        el.exp2(x)


# -- log ---------------------------------------------------------------------------------------
def _log_arguments() -> np.ndarray:
    rng = np.random.default_rng(29)
    bits = rng.integers(1, 0x7FF0000000000000, 2500, dtype=np.int64)  # every positive finite
    near_one = 1.0 + rng.uniform(-1e-6, 1e-6, 500)
    ulps = np.nextafter(1.0, 2.0) + np.arange(-40, 40) * 2.0**-53
    return np.concatenate([
        bits.view(np.float64), rng.uniform(0.5, 2.0, 1500), near_one, ulps,
        np.ldexp(1.0, np.arange(-1074, 1024, 29)), np.ldexp(rng.uniform(0.5, 1.0, 200), -1060),
        [5e-324, 2.0**-1022, np.nextafter(2.0**-1022, 0.0), np.finfo(np.float64).max,
         el._SQRT_HALF, np.nextafter(el._SQRT_HALF, 0.0), 2 * el._SQRT_HALF,
         np.nextafter(2 * el._SQRT_HALF, 0.0), np.nextafter(1.0, 0.0), np.nextafter(1.0, 2.0)],
    ])


def test_log_is_within_its_bound_of_mpmath():
    x = _log_arguments()
    y = el.log(x)
    rel = _mp(Fraction(el.LOG_MAX_REL_ERROR))
    worst = mpmath.mpf(0)
    for xi, yi in zip(x.tolist(), y.tolist(), strict=True):
        t = mpmath.log(mpmath.mpf(xi))
        if xi == 1.0:
            assert yi == 0.0
            continue
        err = abs(mpmath.mpf(yi) - t)
        assert err <= rel * abs(t), (xi, yi)
        worst = max(worst, err / abs(t))
    assert worst > 0.3 * _mp(U)


def test_log_special_values():
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -1.0, -5e-324, 1.0])
    y = el.log(x)
    assert y[0] == -np.inf and y[1] == -np.inf and y[2] == np.inf
    assert np.isnan(y[3:7]).all() and y[7] == 0.0
    assert el.log(np.ones((3, 0))).shape == (3, 0)
    with np.errstate(all="raise"):
        el.log(x)


# -- no transcendental ufunc in the emulated pipeline --------------------------------------------
_TRANSCENDENTAL_NP = ("exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "power",
                      "float_power", "logaddexp", "logaddexp2", "sinh", "cosh", "tanh")
_TRANSCENDENTAL_MATH = ("exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "pow")


def _preset_call(name: str, seed: int) -> AttentionCall:
    spec = preset(name, tile_table="")
    rng = np.random.default_rng(seed)

    def tensor(shape, tq):
        x = rng.standard_normal(shape) * 2.0
        if tq.source == "codes":
            return quantize(x, tq.format, "nearest_even_satfinite")
        return quantize(x, tq.input_format, "nearest_even") if tq.input_format else x

    B, Hq, Hkv, Q, K, D = 1, 4, 2, 5, 9, 8
    return AttentionCall(tensor((B, Hq, Q, D), spec.q), tensor((B, Hkv, K, D), spec.k),
                         tensor((B, Hkv, K, D), spec.v), scale=0.4)


@pytest.mark.parametrize("name", PRESETS)
def test_quantized_calls_no_transcendental_function(name, monkeypatch):
    """quantized() with numpy's and math's transcendental functions replaced by functions that
    raise: the same emulated intervals, bit for bit (the engine's real result, which uses
    np.exp, is taken from the unpatched run)."""
    spec = preset(name, tile_table="")  # head dim 8: one tile, not the kernel's
    call = _preset_call(name, PRESETS.index(name))
    before = pipeline.quantized(call, spec)

    def forbidden(*args, **kwargs):
        raise AssertionError("a transcendental function was called")

    for attr in _TRANSCENDENTAL_NP:
        monkeypatch.setattr(np, attr, forbidden)
    for attr in _TRANSCENDENTAL_MATH:
        if hasattr(math, attr):
            monkeypatch.setattr(math, attr, forbidden)
    monkeypatch.setattr(pipeline, "forward", lambda *a, **kw: before.real)
    with pytest.raises(AssertionError, match="transcendental"):  # the patch is live
        np.exp2(np.zeros(1))
    after = pipeline.quantized(call, spec)
    assert sorted(after.emulated) == sorted(before.emulated)
    for key, iv in before.emulated.items():
        for end in ("lo", "hi"):
            a, b = getattr(iv, end), getattr(after.emulated[key], end)
            assert np.array_equal(a, b, equal_nan=True), (name, key, end)
    assert "lse" not in before.emulated or np.isfinite(before.emulated["lse"].lo).any()
