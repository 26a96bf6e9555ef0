"""The quantised pipeline's online softmax as intervals, one query row per thread (numba).

Owns :func:`online_softmax_rows`: for each row of a block of the kernel's raw scores (given as
intervals ``[s_lo, s_hi]``), the running max over the kernel's kv tiles in its visiting order,
each tile's rescale factor ``alpha = exp2((m_prev - m_new) c)`` and every key's
``p = exp2((S - m) c + off)``, each an interval that holds every value the kernel's fp32
arithmetic can give (products and sums rounded outward, every fp32 rounding of the exponent
bounded, ``ex2.approx`` within ``rel`` relative with flush to zero, the ends then rounded to
fp32). :func:`exp2_f64` is :func:`refattn.quant.elementary.exp2` written again for numba, step
for step (the same IEEE operations in the same order, never contracted: numba compiles without
fast-math), so the interval ends are the same bits on every machine.

Imports nothing from refattn but this package (the numba kernels' import contract).
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from ._jit import kernel

__all__ = ["cast_array", "exp2_f64", "online_softmax_rows", "round_to_format"]

U32 = 2.0**-24
FP32_MAX = 3.4028234663852886e38
FP32_MIN_NORMAL = 2.0**-126
_SPLIT = 134217729.0  # 2**27 + 1 (Dekker)
# c_i = fl(ln2**i / i!), i = 0..14 (refattn.quant.elementary._EXP2_COEFFS)
_C = (1.0, 0.6931471805599453, 0.24022650695910072, 0.05550410866482158,
      0.009618129107628477, 0.0013333558146428443, 0.0001540353039338161,
      1.5252733804059841e-05, 1.321548679014431e-06, 1.01780860092397e-07,
      7.054911620801123e-09, 4.4455382718708116e-10, 2.5678435993488206e-11,
      1.3691488853904128e-12, 6.778726354822545e-14)


@kernel
def exp2_f64(x: float) -> float:
    """``2**x`` (float64), bit-identical to :func:`refattn.quant.elementary.exp2`.

    Examples
    --------
    >>> exp2_f64(8.0), exp2_f64(-np.inf), exp2_f64(1024.0)
    (256.0, 0.0, inf)
    """
    if math.isnan(x):
        return math.nan
    xc = min(max(x, -1100.0), 1100.0)
    k = np.rint(xc)
    f = xc - k
    q = _C[14]
    q = q * f
    q = q + _C[13]
    q = q * f
    q = q + _C[12]
    q = q * f
    q = q + _C[11]
    q = q * f
    q = q + _C[10]
    q = q * f
    q = q + _C[9]
    q = q * f
    q = q + _C[8]
    q = q * f
    q = q + _C[7]
    q = q * f
    q = q + _C[6]
    q = q * f
    q = q + _C[5]
    q = q * f
    q = q + _C[4]
    q = q * f
    q = q + _C[3]
    q = q * f
    q = q + _C[2]
    q = q * f
    q = q + _C[1]
    # h + lo = f q exactly (Dekker)
    h = f * q
    ca = _SPLIT * f
    ah = ca - (ca - f)
    al = f - ah
    cb = _SPLIT * q
    bh = cb - (cb - q)
    bl = q - bh
    lo = ((ah * bh - h) + ah * bl + al * bh) + al * bl
    y0 = 1.0 + h
    err = (1.0 - y0) + h
    p = y0 + (err + lo)
    k1 = np.floor(0.5 * k)
    return (p * math.ldexp(1.0, int(k1))) * math.ldexp(1.0, int(k - k1))


@kernel
def _up(x: float) -> float:
    return np.nextafter(x, np.inf)


@kernel
def _down(x: float) -> float:
    return np.nextafter(x, -np.inf)


@kernel
def _f32(x: float) -> float:
    """Round to the nearest float32 (ties to even; overflow to +-inf)."""
    return float(np.float32(x))


@kernel
def _mag(lo: float, hi: float) -> float:
    m = max(abs(lo), abs(hi))
    return m if math.isfinite(m) else 0.0


@kernel
def _corner(a: float, b: float) -> float:
    p = a * b
    return 0.0 if math.isnan(p) else p  # 0 x an unbounded side: the exact product is 0


@kernel
def _mul(alo: float, ahi: float, blo: float, bhi: float) -> tuple[float, float]:
    """Enclosure of ``x y`` for ``x`` in ``[alo, ahi]``, ``y`` in ``[blo, bhi]``."""
    c1 = _corner(alo, blo)
    c2 = _corner(alo, bhi)
    c3 = _corner(ahi, blo)
    c4 = _corner(ahi, bhi)
    lo = min(min(c1, c2), min(c3, c4))
    hi = max(max(c1, c2), max(c3, c4))
    return (lo if lo == 0.0 else _down(lo)), (hi if hi == 0.0 else _up(hi))


@kernel
def _exp2_iv(lo: float, hi: float, rel: float) -> tuple[float, float]:
    """fp32 ``ex2.approx`` of a value in ``[lo, hi]``: within ``rel`` relative of ``2**x``
    (``rel`` includes float64 exp2's own error), results below 2**-126 flushed to zero, the
    ends rounded to fp32 (refattn.quant.bounds.exp2)."""
    if math.isnan(lo) or math.isnan(hi):
        return -math.inf, math.inf
    a = max(_down(exp2_f64(lo) * (1.0 - rel)), 0.0)
    if a < FP32_MIN_NORMAL:
        a = 0.0
    b = _up(exp2_f64(hi) * (1.0 + rel))
    return _f32(a), _f32(b)


@kernel
def _widen_cast32(lo: float, hi: float, err: float) -> tuple[float, float]:
    """fp32 enclosure of a value within ``err`` of ``[lo, hi]``."""
    e = _up(err)
    a = lo if math.isinf(lo) else _down(lo - e)
    b = hi if math.isinf(hi) else _up(hi + e)
    return _f32(a), _f32(b)


@kernel
def _bounded_arg(d_lo: float, d_hi: float, c_lo: float, c_hi: float, m_mag: float,
                 s_mag: float, off: float) -> tuple[float, float]:
    """fp32 enclosure of the kernel's exponent ``(S - m) c + off`` for ``d = S - m <= 0``,
    whatever order and fusion the kernel uses (``fma(S, c, -fl(fl(m c) - off))`` or the
    products rounded separately): each of its <= 4 roundings errs by ``u`` of its operand
    (refattn.quant.pipeline's argument, unchanged)."""
    x = s_mag * c_hi  # |S c|
    y = m_mag * c_hi  # |m c|
    if max(x, y) * (1.0 + 4.0 * U32) >= FP32_MAX:
        return -math.inf, math.inf  # |S c| or |m c| past fp32's range: anything
    a_lo, a_hi = _mul(d_lo, d_hi, c_lo, c_hi)
    a_lo = a_lo if math.isinf(a_lo) else _down(a_lo + off)
    a_hi = a_hi if math.isinf(a_hi) else _up(a_hi + off)
    amag = _mag(a_lo, a_hi)
    e1 = U32 * (x + 2.0 * y * (1.0 + U32) + off)
    err = (1.0 + 1e-6) * (e1 + U32 * (amag + e1))
    return _widen_cast32(a_lo, a_hi, err)


@kernel
def round_to_format(x: float, emin: int, precision: int, fmax: float, over: int) -> float:
    """``x`` rounded to nearest (ties to even) on a float format's grid, bit-identical to
    :func:`refattn.quant.formats.quantize` for the float formats: ``emin`` the smallest normal
    exponent, ``precision`` the significand bits, ``fmax`` the largest finite value; past it
    (after rounding) ``over`` 0 saturates to +-fmax, 1 gives NaN, 2 gives +-inf.

    Examples
    --------
    >>> round_to_format(0.30, -6, 4, 448.0, 0), round_to_format(500.0, -6, 4, 448.0, 0)
    (0.3125, 448.0)
    """
    if x == 0.0 or math.isnan(x):
        return x
    if math.isfinite(x):
        _, e2 = math.frexp(x)
        quantum = max(e2 - 1, emin) - (precision - 1)
        r = math.ldexp(np.rint(math.ldexp(x, -quantum)), quantum)
    else:
        r = x
    if abs(r) > fmax:
        if over == 0:
            return math.copysign(fmax, r)
        if over == 1:
            return math.nan
        return math.copysign(math.inf, r)
    return r


@kernel(parallel=True)
def cast_array(x: np.ndarray, emin: int, precision: int, fmax: float, over: int,
               out: np.ndarray) -> None:
    """:func:`round_to_format` of every element of the 1-d ``x`` into ``out``, vectorised:
    ``2**floor(log2 |x|)`` by clearing the fraction bits (through a uint64 view of a scratch
    chunk), the quantum ``max(that, 2**emin) 2**(1 - precision)`` (a power of two), and
    ``rint(x / quantum) quantum`` (both steps exact)."""
    n = x.shape[0]
    chunk = 4096
    low = math.ldexp(1.0, emin)
    shift = math.ldexp(1.0, 1 - precision)
    mask = np.uint64(0x7FF0000000000000)
    for ci in prange((n + chunk - 1) // chunk):
        s = ci * chunk
        e = min(n, s + chunk)
        buf = np.empty(e - s)
        bits = buf.view(np.uint64)
        for i in range(s, e):
            buf[i - s] = x[i]
        for i in range(e - s):
            bits[i] = bits[i] & mask  # |x| rounded down to a power of two (inf/NaN: inf)
        for i in range(s, e):
            v = x[i]
            if v == 0.0 or math.isnan(v):
                out[i] = v
                continue
            r = v
            if math.isfinite(v):
                q = max(buf[i - s], low) * shift
                r = np.rint(v / q) * q
            if abs(r) > fmax:
                if over == 0:
                    r = math.copysign(fmax, r)
                elif over == 1:
                    r = math.nan
                else:
                    r = math.copysign(math.inf, r)
            out[i] = r


@kernel(parallel=True)
def online_softmax_rows(s_lo: np.ndarray, s_hi: np.ndarray, vis: np.ndarray, c_lo: float,
                        c_hi: float, off: float, rel: float, starts: np.ndarray,
                        ends: np.ndarray, cast: tuple[float, int, int, float, int],
                        p_lo: np.ndarray, p_hi: np.ndarray, q_lo: np.ndarray, q_hi: np.ndarray,
                        m_lo_out: np.ndarray, m_hi_out: np.ndarray, a_lo: np.ndarray,
                        a_hi: np.ndarray) -> None:
    """The online softmax of a block of rows, as intervals, written into the output arrays.

    Parameters
    ----------
    s_lo, s_hi : (R, K) float64
        The kernel's raw scores (fp32 values), any value where ``vis`` is False.
    vis : (R, K) bool
    c_lo, c_hi : float
        The exponent multiplier's interval.
    off : float
        The offset added to the exponent (FA3: 8).
    rel : float
        exp2's relative error bound (the kernel's and float64 exp2's).
    starts, ends : (T,) int64
        The kv tiles in the kernel's visiting order (key ranges ``[start, end)``).
    cast : (float, int, int, float, int)
        P's cast: the multiplier (P = cast(fl32(p mult))), then :func:`round_to_format`'s
        ``emin``, ``precision``, ``fmax`` and overflow rule.
    p_lo, p_hi : (R, K) float64, out
        ``p`` of every key (0 where not visible), with the running max of its tile's time.
    q_lo, q_hi : (R, K) float64, out
        ``P``, the cast ``p`` (an end that becomes NaN: that side unbounded).
    m_lo_out, m_hi_out : (R,) float64, out
        The final row max (-inf for a row with no visible key).
    a_lo, a_hi : (R, T) float64, out
        Each tile's rescale factor of what came before it (1 for the first tile with a key).
    """
    R = s_lo.shape[0]
    T = starts.shape[0]
    mult, emin, prec, fmax, over = cast
    for r in prange(R):
        m_lo = -math.inf
        m_hi = -math.inf
        for t in range(T):
            j0 = starts[t]
            j1 = ends[t]
            t_lo = -math.inf
            t_hi = -math.inf
            for j in range(j0, j1):
                if vis[r, j]:
                    t_lo = max(t_lo, s_lo[r, j])
                    t_hi = max(t_hi, s_hi[r, j])
            n_lo = max(m_lo, t_lo)
            n_hi = max(m_hi, t_hi)
            first = m_hi == -math.inf
            unchanged = (t_hi < m_lo) or (t_hi == -math.inf)
            if first:
                al, ah = 1.0, 1.0
            else:
                prev_mag = max(abs(m_lo), abs(m_hi))
                new_mag = _mag(n_lo, n_hi)
                if unchanged:
                    d_lo, d_hi, dmag = 0.0, 0.0, 0.0
                else:
                    d_lo = _down(m_lo - n_hi)
                    dh = min(m_hi - n_lo, 0.0)
                    d_hi = 0.0 if dh == 0.0 else _up(dh)
                    dmag = _up(3.0 * U32 * (prev_mag + new_mag) * c_hi)
                if (prev_mag + new_mag) * c_hi * (1.0 + 4.0 * U32) >= FP32_MAX:
                    x_lo, x_hi = -math.inf, math.inf
                else:
                    x_lo, x_hi = _mul(d_lo, d_hi, c_lo, c_hi)
                    if dmag > 0.0:
                        x_lo, x_hi = _widen_cast32(x_lo, x_hi, dmag)
                    else:
                        x_lo, x_hi = _f32(x_lo), _f32(x_hi)
                al, ah = _exp2_iv(x_lo, x_hi, rel)
            a_lo[r, t] = al
            a_hi[r, t] = ah
            m_mag = _mag(n_lo, n_hi)
            for j in range(j0, j1):
                if not vis[r, j]:
                    p_lo[r, j] = 0.0
                    p_hi[r, j] = 0.0
                    q_lo[r, j] = 0.0
                    q_hi[r, j] = 0.0
                    continue
                ds_lo = s_lo[r, j] - n_hi
                ds_hi = min(s_hi[r, j] - n_lo, 0.0)
                if math.isnan(ds_lo):
                    ds_lo = -math.inf
                if math.isnan(ds_hi):
                    ds_hi = 0.0
                x_lo, x_hi = _bounded_arg(ds_lo, ds_hi, c_lo, c_hi, m_mag,
                                          _mag(s_lo[r, j], s_hi[r, j]), off)
                pl, ph = _exp2_iv(x_lo, x_hi, rel)
                p_lo[r, j] = pl
                p_hi[r, j] = ph
                if mult != 1.0:
                    pl = _f32(pl * mult)  # p mult is exact in float64 (fp32 times fp32)
                    ph = _f32(ph * mult)
                ql = round_to_format(pl, emin, prec, fmax, over)
                qh = round_to_format(ph, emin, prec, fmax, over)
                q_lo[r, j] = -math.inf if math.isnan(ql) else ql
                q_hi[r, j] = math.inf if math.isnan(qh) else qh
            m_lo = n_lo
            m_hi = n_hi
        m_lo_out[r] = m_lo
        m_hi_out[r] = m_hi
