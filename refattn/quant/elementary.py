"""Deterministic float64 ``exp2`` and ``log``: the same bits on every machine, with proved bounds.

Owns the two transcendental functions the emulated quantised pipeline evaluates element-wise
(:func:`refattn.quant.bounds.exp2`'s interval ends, the lse's ``ln(l)`` in
:mod:`refattn.quant.pipeline`). numpy's ``np.exp2`` / ``np.log`` dispatch to CPU-specific SIMD
code (AVX512F, AVX2, scalar) and glibc picks FMA variants by CPU; their last bits differ between
machines, and the interval ends they feed are stored in golden bundles and verified bit for bit.
Here every step is an IEEE basic operation that numpy evaluates identically everywhere: ``+``,
``-``, ``*``, ``/`` (correctly rounded, round to nearest even, never contracted into an FMA: each
is its own ufunc call), ``rint``, ``frexp``, ``ldexp`` of 1 (exact), comparisons and selections.
Every constant is a float64 literal (no ``math.log`` at import). Defers nothing.

Error model used in the proofs: for floats ``a, b`` and ``o`` in ``+ - * /``,
``fl(a o b) = (a o b)(1 + d) + t`` with ``|d| <= u = 2**-53``, ``|t| <= 2**-1075`` and ``t = 0``
for ``+`` and ``-`` (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., sec. 2.2).
An error-free transformation (Fast2Sum, Dekker's product) gives a result and its exact error.
A relative error ``rho`` is at most ``rho * 2**53`` ulps of the result (an ulp of ``y`` in
``[2**e, 2**(e+1))`` is ``2**(e-52) >= 2 u |y| / 2``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["EXP2_MAX_REL_ERROR", "LOG_MAX_REL_ERROR", "exp2", "log"]

U = 2.0**-53

#: ``|exp2(x) - 2**x| <= EXP2_MAX_REL_ERROR * 2**x + 2**-1075`` below the overflow threshold
#: (proof in :func:`exp2`; the last term only where the result is subnormal).
EXP2_MAX_REL_ERROR = 2.0 * U
#: ``|log(x) - ln x| <= LOG_MAX_REL_ERROR * |ln x|`` for every positive finite ``x`` (proof in
#: :func:`log`).
LOG_MAX_REL_ERROR = 1.5 * U

# c_i = fl(ln2**i / i!), i = 0..14: the Taylor coefficients of 2**f (correctly rounded; checked
# against mpmath in tests/quant/test_elementary.py).
_EXP2_COEFFS = (
    1.0,
    0.6931471805599453,
    0.24022650695910072,
    0.05550410866482158,
    0.009618129107628477,
    0.0013333558146428443,
    0.0001540353039338161,
    1.5252733804059841e-05,
    1.321548679014431e-06,
    1.01780860092397e-07,
    7.054911620801123e-09,
    4.4455382718708116e-10,
    2.5678435993488206e-11,
    1.3691488853904128e-12,
    6.778726354822545e-14,
)
# L_j = fl(2 / (2j + 1)), j = 1..10: 2 atanh(s) = 2s + s sum_j L_j z**j, z = s**2.
_LOG_COEFFS = (
    0.6666666666666666,
    0.4,
    0.2857142857142857,
    0.2222222222222222,
    0.18181818181818182,
    0.15384615384615385,
    0.13333333333333333,
    0.11764705882352941,
    0.10526315789473684,
    0.09523809523809523,
)
# ln 2 = LN2_HI + LN2_LO + e, |e| < 2**-86 (fdlibm's split: LN2_HI has 32 significant bits, so
# n * LN2_HI is exact for |n| < 2**21).
_LN2_HI = 6.93147180369123816490e-01  # 0x3FE62E42FEE00000
_LN2_LO = 1.90821492927058770002e-10  # 0x3DEA39EF35793C76
_SQRT_HALF = 0.7071067811865476  # fl(sqrt(1/2)), 0x3FE6A09E667F3BCD: the reduction's split
_SPLIT = 134217729.0  # 2**27 + 1 (Dekker)


def two_prod(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``a b = p + e`` exactly (Dekker; no overflow, and every partial product above 2**-969)."""
    p = a * b
    ca = _SPLIT * a
    ah = ca - (ca - a)
    al = a - ah
    cb = _SPLIT * b
    bh = cb - (cb - b)
    bl = b - bh
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def _pow2(n: np.ndarray) -> np.ndarray:
    """``2**n`` exactly for integer-valued float ``n`` in [-1022, 1023]."""
    return np.ldexp(1.0, n.astype(np.int64))


def exp2(x: np.ndarray | float) -> np.ndarray:
    """``2**x`` element-wise, bit-identical on every machine.

    Parameters
    ----------
    x : (...) float64 array_like

    Returns
    -------
    (...) float64 ndarray
        ``y`` with ``|y - 2**x| <= EXP2_MAX_REL_ERROR 2**x + 2**-1075`` (2 u relative, at most
        2 ulps; the absolute term only for subnormal results), where ``2**x`` is at most
        ``(1 - 4 u)`` times the largest float64; ``inf`` for ``x >= 1024`` (and possibly for
        ``2**x`` within ``4 u`` of float64's largest value), ``0`` for ``x <= -1076`` (the exact
        value is below ``2**-1076`` and rounds to 0), ``exp2(-inf) = 0``, NaN for NaN.

    Notes
    -----
    Algorithm: clamp ``x`` to [-1100, 1100] (exact; changes no result), ``k = rint(x)``,
    ``f = x - k``, ``p(f) = 1 + f q_1(f)`` with ``q_1 = sum_{1<=i<=14} c_i f**(i-1)`` by
    Horner's rule (``c_i = fl(ln2**i / i!)``), the last step compensated (``f q_1 = h + lo`` by
    Dekker's product, ``1 + h = y0 + err`` by Fast2Sum, ``p = fl(y0 + fl(err + lo))``), and
    ``y = (p 2**k1) 2**k2`` with ``k1 = floor(k / 2)``, ``k2 = k - k1``.

    Proof of the bound. (1) *Reduction*: ``k`` is the integer nearest ``x`` and ``f = x - k``
    is exact (both are multiples of ``ulp(x)`` when ``|x| >= 1/2``, and ``f = x`` otherwise),
    ``phi = |f| <= 1/2``. ``2**k1``, ``2**k2`` are exact powers of two (``|k1|, |k2| <= 550``),
    ``p 2**k1`` is exact (a normal number) and ``(p 2**k1) 2**k2`` one correctly rounded
    product: exact for a normal result, within ``2**-1075`` for a subnormal one. So the
    relative error is that of ``p`` against ``2**f``. (2) *Horner*: with
    ``q_i = sum_{j>=i} c_j f**(j-i)``, ``|q_i| <= M_i = sum_{j>=i} c_j phi**(j-i)`` (every
    ``c_j > 0``) and computed ``q^_i = fl(c_i + fl(f q^_{i+1}))``, the model gives
    ``|q^_i - q_i| <= E_i``: ``E_14 = 0``, ``D_i = phi E_{i+1} + u phi (M_{i+1} + E_{i+1}) +
    2**-1075``, ``E_i = D_i (1 + u) + u M_i``. (3) *Last step*: ``y0 + err + lo = 1 + f q^_1``
    exactly (up to ``16 * 2**-1075`` where Dekker's partial products underflow, ``phi <
    2**-900``), ``|fl(err + lo) - (err + lo)| <= 2 u**2``, so ``p = v (1 + d)`` with
    ``|v - q_0| <= phi E_1 + 2 u**2 + 16 * 2**-1075``. (4) *Coefficients*: ``|q_0 - P| <= C(phi)
    = sum |c_i - ln2**i / i!| phi**i``, ``P`` the Taylor polynomial. (5) *Truncation*:
    ``|P - 2**f| <= T(phi) = ((phi ln2)**15 / 15!) / (1 - phi ln2 / 16)``. With ``A = phi E_1 +
    2 u**2 + 16 * 2**-1075 + C + T`` and ``2**f >= 2**-phi``:
    ``|p - 2**f| / 2**f <= u + (1 + u) A(phi) 2**phi``, increasing in ``phi``: at most its
    value at ``phi = 1/2``, ``1.985 u`` (computed with exact rationals in
    ``tests/quant/test_elementary.py``, which also measures the error against mpmath on
    random, integer, half-integer, tiny and threshold arguments); stated as ``2 u``.

    Examples
    --------
    >>> exp2(np.array([0.0, 8.0, -1074.0, 1024.0, -np.inf])).tolist()
    [1.0, 256.0, 5e-324, inf, 0.0]
    >>> bool(abs(exp2(0.5) - 1.4142135623730951) <= 2 * 2.0**-52)
    True
    """
    x = np.asarray(x, dtype=np.float64)
    nan = np.isnan(x)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        xc = np.where(nan, 0.0, np.minimum(np.maximum(x, -1100.0), 1100.0))
        k = np.rint(xc)
        f = xc - k  # exact, |f| <= 1/2
        q = np.full(f.shape, _EXP2_COEFFS[-1])
        for c in _EXP2_COEFFS[-2:0:-1]:  # Horner down to q_1: q = c + f q, two roundings
            np.multiply(q, f, out=q)  # a step, never an FMA (two ufunc calls)
            np.add(q, c, out=q)
        h, lo = two_prod(f, q)  # f q_1 = h + lo exactly
        y0 = 1.0 + h
        err = (1.0 - y0) + h  # Fast2Sum (|h| < 1): y0 + err = 1 + h exactly
        q = y0 + (err + lo)  # p(f), one rounding of the nearly exact 1 + f q_1
        k1 = np.floor(0.5 * k)
        y = (q * _pow2(k1)) * _pow2(k - k1)  # the first product exact, the second rounds once
    return np.where(nan, np.nan, y)


def log(x: np.ndarray | float) -> np.ndarray:
    """Natural logarithm element-wise, bit-identical on every machine.

    Parameters
    ----------
    x : (...) float64 array_like

    Returns
    -------
    (...) float64 ndarray
        ``y`` with ``|y - ln x| <= LOG_MAX_REL_ERROR |ln x|`` (1.5 u relative: at most 1.5 ulps)
        for every positive finite ``x`` (subnormals included; ``log(1) = 0`` exactly);
        ``log(0) = -inf``, ``log(inf) = inf``, NaN for a negative ``x``, ``-inf`` and NaN.

    Notes
    -----
    Algorithm: a subnormal ``x`` is multiplied by ``2**54`` (exact); ``x = m 2**e`` exactly with
    ``m`` in ``[h, 2h)``, ``h = fl(sqrt(1/2))`` (``frexp``, then ``m = 2 m``, ``e = e - 1`` below
    ``h``: exact); ``ln x = e ln2 + ln m`` and ``ln m = 2 atanh(s) = 2 s + T(s)`` with
    ``s = f / (2 + f)``, ``f = m - 1``, ``T(s) = s sum_{j>=1} (2 / (2j+1)) s**(2j)``.

    Proof of the bound. (1) ``f = m - 1`` is exact (Sterbenz: ``m / 2 <= 1 <= 2 m``),
    ``|f| <= 0.4143``, ``|s| <= 0.1716``, ``z = s**2 <= 0.02944``. (2) *s to twice the
    precision*: ``d_hi = fl(2 + f)``, ``d_lo = (2 - d_hi) + f`` (Fast2Sum, exact:
    ``d_hi + d_lo = 2 + f``, ``|d_lo| <= 2**-52``); ``s_hi = fl(f / d_hi)``, so
    ``|s_hi - s| <= 2.01 u |s|``; ``f - s_hi d_hi`` is exactly representable (the remainder of a
    correctly rounded quotient) and computed exactly from Dekker's product ``p_hi + p_lo =
    s_hi d_hi`` (``f - p_hi`` exact by Sterbenz); ``s - s_hi = (f - s_hi d_hi - s_hi d_lo) /
    (2 + f)`` is computed as ``s_lo`` with three roundings and ``d_hi`` for ``2 + f``:
    ``|s_lo - (s - s_hi)| <= 6 u (|s_hi d_lo| + |s - s_hi| |2 + f|) / 1.58 <= 20 u**2 |s|``.
    (3) *The tail*: ``T^ = fl(s_hi W)``, ``W`` the Horner evaluation of ``sum_{j=1}^{10} L_j
    z^**j`` at ``z^ = fl(s_hi s_hi)`` (``|z^ - z| <= 5.1 u z``). ``T`` has relative
    sensitivity ``z T'(z) / T <= 1.04`` to ``z``; the coefficients ``L_j`` are within ``u`` of
    ``2 / (2j+1)``; Horner's 20 roundings with ``z <= 0.0295`` cost at most ``2.1 u``
    relative; the truncation ``sum_{j>10} <= z**11 / 23 / (1 - z) * 2|s| <= 0.006 u |2 s|``;
    the last product ``u`` and ``s_hi`` ``2.01 u``. So ``|T^ - T| <= 11.5 u |T| + 0.006 u |2s|``
    with ``|T| <= z / 3 / (1 - z) |2 s| <= 0.0102 |2 s|``: at most ``0.124 u |2 s|``.
    (4) *Assembly*: ``A = e LN2_HI`` (exact) and ``2 s_hi`` (exact) are added by TwoSum into
    ``S + err`` (exact); ``B = fl(fl(e LN2_LO) + fl(2 s_lo + T^))``; ``y = fl(S + fl(err + B))``.
    With ``L = ln x``: if ``e = 0`` then ``|2 s| <= |L|``; if ``e != 0`` then ``|L| >= |e| ln2 -
    ln(2h) >= 0.3465 |e|`` and ``|2 s| <= |ln m| <= 0.3466 <= 1.0003 |L|``. The exact
    remainder ``B* = L - S - err`` has ``|B*| <= 0.0105 |L|`` (``|e| LN2_LO <= 5.6e-10 |L|``),
    and ``|B - B*| <= (0.124 + 2 * 0.0105 + 1e-5) u 1.0003 |L| + |e| 2**-86 <= 0.15 u |L|``
    (the ln2 split, ``e LN2_LO``'s and both additions' roundings, ``2 |s_lo| 20 u``). Then
    ``|y - L| <= u |L| (1 + 0.0106 u) + u |err + B| + 0.15 u |L| <= 1.17 u |L|`` with
    ``|err| <= u |S|``; stated as ``1.5 u``. ``tests/quant/test_elementary.py`` measures the
    error against mpmath (random, near 1, subnormal, extreme and power-of-two arguments).

    Examples
    --------
    >>> log(np.array([1.0, 0.0, np.inf, -1.0])).tolist()
    [0.0, -inf, inf, nan]
    >>> bool(abs(log(2.0) - 0.6931471805599453) <= 2.0**-53)
    True
    """
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore", under="ignore"):
        ok = (x > 0) & (x < np.inf)
        xs = np.where(ok, x, 1.0)
        sub = xs < 2.0**-1022
        xs = np.where(sub, xs * 18014398509481984.0, xs)  # 2**54: exact
        m, e = np.frexp(xs)  # m in [1/2, 1)
        e = e.astype(np.float64) - np.where(sub, 54.0, 0.0)
        low = m < _SQRT_HALF
        m = np.where(low, m + m, m)  # exact
        e = np.where(low, e - 1.0, e)  # x = m 2**e, m in [h, 2h)
        f = m - 1.0  # exact (Sterbenz)
        d_hi = 2.0 + f
        d_lo = (2.0 - d_hi) + f  # Fast2Sum: d_hi + d_lo = 2 + f exactly
        s_hi = f / d_hi
        p_hi, p_lo = two_prod(s_hi, d_hi)
        r = (f - p_hi) - p_lo  # exact: f - s_hi d_hi
        s_lo = (r - s_hi * d_lo) / d_hi  # s - s_hi to relative O(u)
        z = s_hi * s_hi
        w = np.full(z.shape, _LOG_COEFFS[-1])
        for c in _LOG_COEFFS[-2::-1]:  # w = c + z w
            np.multiply(w, z, out=w)
            np.add(w, c, out=w)
        tail = s_hi * (z * w)  # T(s) = s sum_j L_j z**j
        a = e * _LN2_HI  # exact: e has <= 11 bits, LN2_HI 32
        b = 2.0 * s_hi  # exact
        big = a + b  # TwoSum: big + err = a + b exactly
        bb = big - a
        err = (a - (big - bb)) + (b - bb)
        small = e * _LN2_LO + (2.0 * s_lo + tail)
        y = big + (err + small)
    y = np.where(ok, y, np.nan)
    y = np.where(x == 0, -np.inf, y)
    return np.where(x == np.inf, np.inf, y)
