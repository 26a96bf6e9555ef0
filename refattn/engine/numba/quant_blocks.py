"""The k-block accumulation model's element-wise recurrences, fused (numba).

Owns :func:`dot_blocks` (a dot product accumulated block by block, the truncations bounded by
the products' sign counts: the kernel's S), :func:`dot_exact` (the same with every product's
truncation summed), :func:`pv_blocks` (the PV accumulator over the kv tiles in the kernel's
order, rescaled at each tile's start) and :func:`matmul_fixed` (a product summed in a fixed
order: the same bits on every machine). The block kernels take the blocks' exact sums,
magnitudes and sign counts computed by BLAS (:mod:`refattn.quant.accumulation`,
:mod:`refattn.quant.rows`) and run the recurrence of :mod:`refattn.quant.accumulation`'s model
for every output element in one pass. One step, for
an accumulator known to lie in ``[lo, hi]`` and a block of ``n`` products with exact sum
``x +- r``, ``n+`` possibly positive and ``n-`` possibly negative products, the largest at most
``top``, and ``q`` the unit of the ``bits``-th bit of ``max(|C|, top)``:

    lose = q max(n+ + [hi > 0], (n + 1) / 2)     gain = q max(n- + [lo < 0], (n + 1) / 2)
    once = unit of the bits-th bit of (|C| + |x| + r)     store = that of the accumulator's
    [lo, hi] <- [lo + x - r - max(lose, once) - store, hi + x + r + max(gain, once) + store]

(truncation toward zero loses less than ``q`` per positive addend and gains less than ``q`` per
negative one; rounding to nearest moves each by at most ``q / 2``; one rounding of the exact
block sum moves it by at most ``once``; the store by at most ``store``).

Imports nothing from refattn but this package (the numba kernels' import contract).
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from ._jit import kernel

__all__ = ["dot_blocks", "dot_exact", "matmul_fixed", "pv_blocks"]

_MASK = np.uint64(0xFFF0000000000000)  # sign and exponent: m with its fraction bits cleared
_GROW = 1.0 + 2.0**-40  # float64 roundings of this arithmetic, on magnitudes
_WIDEN = 2.0**-45  # and on the enclosure's ends, per step


@kernel
def _steps(lo: np.ndarray, hi: np.ndarray, xm: np.ndarray, xr: np.ndarray, top: np.ndarray,
           sa: np.ndarray, ns: np.ndarray, nd: np.ndarray, n: float, bits_unit: float,
           acc_unit: float, down: np.ndarray, up: np.ndarray, buf: np.ndarray) -> None:
    """One k-block for a row of elements (module docstring), in place on ``lo`` and ``hi``;
    the error's (down, up) into ``down`` and ``up``. ``buf`` (2 C) is scratch: each element's
    magnitudes, then (their fraction bits cleared through the uint64 view) ``2**floor(log2
    m)``: exact for normal ``m``, 2**-1022 for subnormal (a larger bound), inf for inf/NaN.
    ``sa`` is the block's sum of product magnitudes: the products aligned among themselves
    lose less than ``n+ q`` (gain less than ``n- q``) and their sum, at most ``sa + n q``, is
    then rounded once to ``bits`` bits."""
    C = lo.shape[0]
    bits = buf.view(np.uint64)
    for c in range(C):
        c_mag = max(abs(lo[c]), abs(hi[c])) * _GROW
        buf[c] = max(c_mag, top[c])
        buf[C + c] = (c_mag + abs(xm[c]) + xr[c]) * _GROW
    for i in range(2 * C):
        bits[i] = bits[i] & _MASK
    for c in range(C):
        q = buf[c]
        if q == 0.0 and max(max(abs(lo[c]), abs(hi[c])), top[c]) != 0.0:
            q = 2.0**-1022
        buf[2 * C + c] = (sa[c] + n * q * bits_unit) * _GROW
    for i in range(2 * C, 3 * C):
        bits[i] = bits[i] & _MASK
    for c in range(C):
        c_mag = max(abs(lo[c]), abs(hi[c])) * _GROW
        q = buf[c]
        if q == 0.0 and max(c_mag, top[c]) != 0.0:
            q = 2.0**-1022
        q *= bits_unit
        new_top = buf[C + c]
        if new_top == 0.0 and c_mag + abs(xm[c]) + xr[c] != 0.0:
            new_top = 2.0**-1022
        half = 0.5 * (min(ns[c], n) + 1.0)
        pos = 1.0 if hi[c] + c_mag * _WIDEN > 0.0 else 0.0
        neg = 1.0 if lo[c] - c_mag * _WIDEN < 0.0 else 0.0
        lose = q * max(0.5 * (ns[c] + nd[c]) + pos, half)
        gain = q * max(0.5 * (ns[c] - nd[c]) + neg, half)
        once = new_top * bits_unit
        once_p = buf[2 * C + c] * bits_unit  # the products' aligned sum rounded once
        if once_p == 0.0 and sa[c] != 0.0:
            once_p = 2.0**-1022
        store = new_top * acc_unit
        dn = max(max(lose, once), q * 0.5 * (ns[c] + nd[c]) + once_p) + store
        u = max(max(gain, once), q * 0.5 * (ns[c] - nd[c]) + once_p) + store
        a = lo[c] + xm[c] - xr[c] - dn
        b = hi[c] + xm[c] + xr[c] + u
        lo[c] = a - abs(a) * _WIDEN
        hi[c] = b + abs(b) * _WIDEN
        down[c] = dn
        up[c] = u


@kernel
def _joined(a: float, b: float, total: float, w: float, tiny: float,
            to_fp32: bool) -> tuple[float, float]:
    """The block model's enclosure ``[a, b]`` joined with plain fp32's ``total +- w``, widened by
    ``tiny`` and the float64 roundings, rounded outward (to fp32 with ``to_fp32``); an end that
    is NaN: that side unbounded."""
    w = w + abs(total) * _WIDEN
    x_lo = min(a, total - w)
    x_hi = max(b, total + w)
    pad = (tiny + 2.0**-50 * max(abs(x_lo), abs(x_hi))) * _GROW
    x_lo = np.nextafter(x_lo - pad, -math.inf)
    x_hi = np.nextafter(x_hi + pad, math.inf)
    if to_fp32:
        x_lo = float(np.float32(x_lo))
        x_hi = float(np.float32(x_hi))
    return (-math.inf if math.isnan(x_lo) else x_lo), (math.inf if math.isnan(x_hi) else x_hi)


@kernel(parallel=True)
def dot_blocks(x: np.ndarray, xr: np.ndarray, block_abs: np.ndarray, a_max: np.ndarray,
               b_max: np.ndarray, n_sum: np.ndarray, n_diff: np.ndarray, n: np.ndarray,
               bits_unit: float, acc_unit: float, any_order: np.ndarray, tiny: float,
               to_fp32: bool, lo: np.ndarray, hi: np.ndarray) -> None:
    """The enclosure of a dot product accumulated block by block, joined with plain fp32.

    Parameters
    ----------
    x, xr, block_abs : (N, R, C) float64
        Per block: the exact sum's midpoint and radius, and the sum of the products'
        magnitudes.
    a_max, b_max : (N, R) and (N, C) float64
        Per block, each row's and column's largest magnitude: the largest product is at most
        ``min(a_max b_max, block_abs)``.
    n_sum, n_diff : (N, R, C) float32
        ``n+ + n-`` and ``n+ - n-`` (small integers, exact in float32).
    n : (N,) float64
        Terms per block.
    bits_unit, acc_unit : float
        ``2**(1 - mma_bits)`` and ``2**(1 - accumulator precision)``.
    any_order : (R, C) float64
        The any-order fp32 bound (without the exact sum's radius, added here).
    tiny : float
        An absolute widening (underflow).
    to_fp32 : bool
        Round the ends to fp32 (the kernel's S is an fp32 value: ``[fl(lo), fl(hi)]``).
    lo, hi : (R, C) float64, out
        The enclosure, rounded outward (an end that is NaN: that side unbounded).
    """
    N, R, C = x.shape
    for r in prange(R):
        a = np.zeros(C)
        b = np.zeros(C)
        total = np.zeros(C)
        spread = np.zeros(C)
        down = np.empty(C)
        up = np.empty(C)
        buf = np.empty(3 * C)
        top = np.empty(C)
        for t in range(N):
            for c in range(C):
                top[c] = min(a_max[t, r] * b_max[t, c], block_abs[t, r, c])
            _steps(a, b, x[t, r], xr[t, r], top, block_abs[t, r], n_sum[t, r], n_diff[t, r],
                   n[t], bits_unit, acc_unit, down, up, buf)
            for c in range(C):
                total[c] += x[t, r, c]
                spread[c] += xr[t, r, c]
        for c in range(C):
            w = (any_order[r, c] + spread[c]) * _GROW
            lo[r, c], hi[r, c] = _joined(a[c], b[c], total[c], w, tiny, to_fp32)


@kernel(parallel=True)
def pv_blocks(x: np.ndarray, xr: np.ndarray, mag: np.ndarray, p_max: np.ndarray,
              v_max: np.ndarray, n_sum: np.ndarray, n_diff: np.ndarray, n: np.ndarray,
              tile: np.ndarray, a_lo: np.ndarray, a_hi: np.ndarray, blocked: bool,
              per_tile: bool, bits_unit: float, acc_unit: float, tile_limit: float,
              t_mid: np.ndarray, t_rad: np.ndarray, e_lo: np.ndarray, e_hi: np.ndarray,
              any_mag: np.ndarray, overflow: np.ndarray) -> None:
    """The PV accumulator's error over the kv tiles, blocks in the kernel's order.

    Parameters
    ----------
    x, xr, mag : (N, R, Dv) float64
        Per block, in the kernel's order: the exact sum of ``P v`` (midpoint, radius) and the
        sum of ``P |v|``.
    p_max, v_max : (N, R) and (N, Dv) float64
        Per block, the largest ``P`` of each row and ``|v|`` of each column: the largest
        product is at most ``min(p_max v_max, mag)``.
    n_sum, n_diff : (N, R, Dv) float32
        ``n+ + n-`` and ``n+ - n-``.
    n : (N,) float64
        Keys per block.
    tile : (N,) int64
        The tile (index into the visiting order) of each block; nondecreasing.
    a_lo, a_hi : (R, T) float64
        Each tile's rescale factor of what came before it.
    blocked : bool
        The block model (False: the exact sums only, no model error; the caller adds its own).
    per_tile : bool
        A fresh accumulator per tile (fp16), added to the fp32 one at the tile's end.
    bits_unit, acc_unit : float
        ``2**(1 - mma_bits)`` and ``2**(1 - precision)`` of the (tile) accumulator.
    tile_limit : float
        The tile accumulator's largest finite value (fp16: 65504; else fp32's).
    t_mid, t_rad : (T, R, Dv) float64, out
        Each tile's exact sum ``A_t`` (midpoint, radius).
    e_lo, e_hi, any_mag : (R, Dv) float64, out
        The errors against ``sum_t w_t A_t`` (e_lo <= 0 <= e_hi) and ``sum_t w_t sum P |v|``.
    overflow : (R, Dv) bool, out
        Where the accumulator may pass fp32's (or the tile accumulator's) range.
    """
    N, R, Dv = x.shape
    fp32_max = 3.4028234663852886e38
    u32 = 2.0**-24
    for r in prange(R):
        c_lo = np.zeros(Dv)
        c_hi = np.zeros(Dv)
        s_lo = np.zeros(Dv)
        s_hi = np.zeros(Dv)
        el = np.zeros(Dv)
        eh = np.zeros(Dv)
        am = np.zeros(Dv)
        over = np.zeros(Dv, dtype=np.bool_)
        down = np.zeros(Dv)
        up = np.zeros(Dv)
        buf = np.empty(3 * Dv)
        top = np.empty(Dv)
        for t in range(t_mid.shape[0]):
            for d in range(Dv):
                t_mid[t, r, d] = 0.0
                t_rad[t, r, d] = 0.0
        cur = -1
        for i in range(N):
            t = tile[i]
            if t != cur:  # a tile starts: close the previous fp16 sum, then rescale
                al = a_lo[r, t]
                ah = a_hi[r, t]
                for d in range(Dv):
                    if per_tile and cur >= 0:
                        e_add = u32 * (max(abs(c_lo[d]), abs(c_hi[d]))
                                       + max(abs(s_lo[d]), abs(s_hi[d])))
                        c_lo[d] = c_lo[d] + s_lo[d] - e_add
                        c_hi[d] = c_hi[d] + s_hi[d] + e_add
                        el[d] -= e_add
                        eh[d] += e_add
                    lo2 = min(al * c_lo[d], ah * c_lo[d])
                    hi2 = max(al * c_hi[d], ah * c_hi[d])
                    e_mul = u32 * max(abs(lo2), abs(hi2)) * _GROW
                    c_lo[d] = lo2 - e_mul
                    c_hi[d] = hi2 + e_mul
                    el[d] = ah * el[d] - e_mul
                    eh[d] = ah * eh[d] + e_mul
                    am[d] = ah * am[d]
                    s_lo[d] = 0.0 if per_tile else c_lo[d]
                    s_hi[d] = 0.0 if per_tile else c_hi[d]
                cur = t
            if blocked:
                for d in range(Dv):
                    top[d] = min(p_max[i, r] * v_max[i, d], mag[i, r, d])
                _steps(s_lo, s_hi, x[i, r], xr[i, r], top, mag[i, r], n_sum[i, r],
                       n_diff[i, r], n[i], bits_unit, acc_unit, down, up, buf)
            for d in range(Dv):
                t_mid[t, r, d] += x[i, r, d]
                t_rad[t, r, d] += xr[i, r, d]
                am[d] += mag[i, r, d]
                if blocked:
                    el[d] -= down[d]
                    eh[d] += up[d]
                else:
                    s_lo[d] = s_lo[d] + x[i, r, d] - xr[i, r, d]
                    s_hi[d] = s_hi[d] + x[i, r, d] + xr[i, r, d]
                if max(abs(s_lo[d]), abs(s_hi[d])) >= tile_limit:
                    over[d] = True
                if not per_tile:
                    c_lo[d] = s_lo[d]
                    c_hi[d] = s_hi[d]
        for d in range(Dv):
            if per_tile and cur >= 0:
                e_add = u32 * (max(abs(c_lo[d]), abs(c_hi[d])) + max(abs(s_lo[d]), abs(s_hi[d])))
                c_lo[d] = c_lo[d] + s_lo[d] - e_add
                c_hi[d] = c_hi[d] + s_hi[d] + e_add
                el[d] -= e_add
                eh[d] += e_add
            if max(abs(c_lo[d]), abs(c_hi[d])) >= fp32_max or not (
                    math.isfinite(el[d]) and math.isfinite(eh[d])):
                over[d] = True
            e_lo[r, d] = el[d]
            e_hi[r, d] = eh[d]
            any_mag[r, d] = am[d]
            overflow[r, d] = over[d]


@kernel(parallel=True)
def matmul_fixed(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """``out = a @ b`` for (N, R, k) and (N, k, C) float64, every element summed over ``k`` in
    ascending order with one rounding per product and per addition (no reassociation: the
    same bits on every machine and thread count; the vectorised loop runs over ``C``)."""
    N, R, k = a.shape
    C = b.shape[2]
    for nr in prange(N * R):
        n = nr // R
        r = nr - n * R
        for c in range(C):
            out[n, r, c] = 0.0
        for j in range(k):
            x = a[n, r, j]
            for c in range(C):
                out[n, r, c] += x * b[n, j, c]


@kernel
def _floor_pow2(m: float) -> float:
    """``2**floor(log2 m)`` for ``m > 0`` (exact); 0 for 0; inf for inf or NaN."""
    if m == 0.0:
        return 0.0
    if not math.isfinite(m):
        return math.inf
    return math.ldexp(1.0, math.frexp(m)[1] - 1)


@kernel(parallel=True)
def dot_exact(a: np.ndarray, bt: np.ndarray, k_block: int, bits: int, acc_unit: float,
              any_unit: float, tiny: float, to_fp32: bool, lo_out: np.ndarray,
              hi_out: np.ndarray) -> None:
    """The k-block model of ``a @ bt`` with every addend's truncation computed, not counted.

    For point operands (R, D) and (D, C), each block's products are formed exactly (float64:
    two narrow significands), and for each candidate quantum ``q`` (the unit of the
    ``bits``-th bit of ``max(|C|, max |x|)``: one or two powers of two, as the accumulator's
    enclosure decides ``|C|``'s exponent) the truncation of every product toward zero is
    summed exactly (``x/q - trunc(x/q)``, in units of ``q``); the accumulator's own
    truncation is the one unknown addend (less than ``q``, toward zero). The models joined:
    alignment to the block's largest exponent with the accumulator (each candidate ``q``) or
    among the products only (then the block sum rounded once to ``bits`` bits and added),
    the exact block sum rounded once to ``bits`` bits, the store to the accumulator's
    precision (``acc_unit``), and plain fp32 in any order (``any_unit`` times the sum of
    magnitudes). Where the exponent of ``|C|`` spans more than two values the block falls back
    to the counted bound ``(n + 1) q``.

    Parameters
    ----------
    a : (R, D) float64
    bt : (D, C) float64
    k_block, bits : int
    acc_unit, any_unit, tiny : float
    to_fp32 : bool
        Round the ends to fp32.
    lo_out, hi_out : (R, C) float64, out
    """
    R, D = a.shape
    C = bt.shape[1]
    bits_unit = math.ldexp(1.0, 1 - bits)
    u64 = 2.0**-53
    for r in prange(R):
        clo = np.zeros(C)
        chi = np.zeros(C)
        total = np.zeros(C)
        sabs = np.zeros(C)
        s = np.empty(C)
        mx = np.empty(C)
        sa = np.empty(C)
        inv = np.empty((3, C))
        z = np.empty((3, C))
        for t0 in range(0, D, k_block):
            t1 = min(t0 + k_block, D)
            n = t1 - t0
            for c in range(C):
                s[c] = 0.0
                mx[c] = 0.0
                sa[c] = 0.0
            for d in range(t0, t1):
                ad = a[r, d]
                for c in range(C):
                    x = ad * bt[d, c]
                    ax = abs(x)
                    s[c] += x
                    sa[c] += ax
                    mx[c] = max(mx[c], ax)
            for c in range(C):
                lo = clo[c]
                hi = chi[c]
                cmax = max(abs(lo), abs(hi)) * _GROW
                cmin = 0.0 if lo <= 0.0 <= hi else min(abs(lo), abs(hi)) * (1.0 - 2.0**-40)
                qa = _floor_pow2(max(cmax, mx[c])) * bits_unit
                qb = _floor_pow2(max(cmin, mx[c])) * bits_unit
                qp = _floor_pow2(mx[c]) * bits_unit
                inv[0, c] = 1.0 / qa if qa > 0.0 and math.isfinite(qa) else 0.0
                inv[1, c] = 1.0 / qb if qb > 0.0 and math.isfinite(qb) else 0.0
                inv[2, c] = 1.0 / qp if qp > 0.0 and math.isfinite(qp) else 0.0
                z[0, c] = 0.0
                z[1, c] = 0.0
                z[2, c] = 0.0
            for d in range(t0, t1):
                ad = a[r, d]
                for c in range(C):
                    x = ad * bt[d, c]
                    y0 = x * inv[0, c]
                    y1 = x * inv[1, c]
                    y2 = x * inv[2, c]
                    z[0, c] += y0 - math.trunc(y0)
                    z[1, c] += y1 - math.trunc(y1)
                    z[2, c] += y2 - math.trunc(y2)
            for c in range(C):
                lo = clo[c]
                hi = chi[c]
                cmax = max(abs(lo), abs(hi)) * _GROW
                q_top = 0.0 if inv[0, c] == 0.0 else 1.0 / inv[0, c]
                # the float64 sums of this block: of the products, and of the truncations
                f64 = ((n + 2) * u64 * sa[c] + n * n * u64 * q_top) * _GROW
                can_pos = hi + cmax * _WIDEN > 0.0
                can_neg = lo - cmax * _WIDEN < 0.0
                e_lo = 0.0
                e_hi = 0.0
                qa = 0.0 if inv[0, c] == 0.0 else 1.0 / inv[0, c]
                qb = 0.0 if inv[1, c] == 0.0 else 1.0 / inv[1, c]
                if not math.isfinite(cmax) or not math.isfinite(sa[c]):
                    e_lo = -math.inf
                    e_hi = math.inf
                else:
                    if qa > 2.0 * qb and qb > 0.0:  # |C|'s exponent spans > 2 values: counted
                        e_lo = -qa * (n + 1.0)
                        e_hi = qa * (n + 1.0)
                    else:
                        for w in range(2):  # alignment with the accumulator, each candidate q
                            q = qa if w == 0 else qb
                            loss = z[w, c] * q  # the products' truncations, exact up to f64
                            e_lo = min(e_lo, -loss - (q if can_pos else 0.0))
                            e_hi = max(e_hi, -loss + (q if can_neg else 0.0))
                    qp = 0.0 if inv[2, c] == 0.0 else 1.0 / inv[2, c]
                    once_p = _floor_pow2((sa[c] + n * qp) * _GROW) * bits_unit
                    e_lo = min(e_lo, -z[2, c] * qp - once_p)  # products aligned, then added
                    e_hi = max(e_hi, -z[2, c] * qp + once_p)
                new_mag = (cmax + abs(s[c]) + sa[c] * u64 * (n + 2)) * _GROW
                once = _floor_pow2(new_mag) * bits_unit  # the exact block sum rounded once
                store = _floor_pow2(new_mag + (e_hi - e_lo)) * acc_unit
                e_lo = min(e_lo, -once) - store - f64
                e_hi = max(e_hi, once) + store + f64
                a_ = lo + s[c] + e_lo
                b_ = hi + s[c] + e_hi
                clo[c] = a_ - abs(a_) * _WIDEN
                chi[c] = b_ + abs(b_) * _WIDEN
                total[c] += s[c]
                sabs[c] += sa[c]
        for c in range(C):
            w = (any_unit * sabs[c] + (D + 2) * u64 * sabs[c]) * _GROW
            lo_out[r, c], hi_out[r, c] = _joined(clo[c], chi[c], total[c], w, tiny, to_fp32)
