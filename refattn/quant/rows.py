"""One block of query rows of one head through the emulated pipeline's stages 2-5.

Owns :func:`emulate_rows`: the kernel's S, its online softmax, l, the PV accumulator and the
output for a block of query rows, as intervals, in working memory proportional to the block
(``R x K`` for the scores, ``T x R x Dv`` for the per-tile sums); :mod:`refattn.quant.pipeline`
loops it over heads and query blocks. Defers the k-block accumulation model to
:mod:`refattn.quant.accumulation`, the online softmax's per-row interval arithmetic to
:mod:`refattn.engine.numba.quant_softmax`, the casts to :mod:`refattn.quant.bounds`.

What makes the intervals tight, and why each step stays rigorous
----------------------------------------------------------------
* **S per k-block** (:func:`refattn.quant.accumulation.dot_block_model`): the accumulator's bits
  as the preset states them, per MMA k-block, over the actual partial sums (every product's
  truncation summed exactly where the caller asks).
* **p in [0, 2**off]**: the kernel's S never exceeds its running max, so ``S - m`` is taken at
  most 0 (``min(S_hi - m_lo, 0)``) before the exponent: ``p <= 2**off`` up to the exponent's
  rounding and exp2's error, whatever the S intervals.
* **l's lower bound from the row maximum's own term.** The kernel's final max ``m`` is one of
  its own S values, say ``S_j*``; when the kernel visits ``j*``'s tile its running max becomes
  ``m`` and stays ``m``, so ``p_j* = exp2(fl(m c - fl(m c - off)))`` (an exponent within
  ``4 u (|m c| + off)`` of ``off``), every later rescale is ``exp2(0)`` (within ``exp2_ulp`` of
  1), and l, a sum of nonnegative terms, is at least that term times those factors and one
  minus its own rounding. Whatever the S intervals, ``l >= 2**off (1 - small)``.
* **The ratio, not two intervals.** With ``A_t`` the exact sum of tile ``t``'s ``P v``,
  ``L_t`` its sum of the terms l adds, ``w_t`` the product of the rescales after it, and
  ``e_A``, ``e_l`` the accumulators' errors: ``acc = sum_t w_t A_t + e_A`` and
  ``l = sum_t w_t L_t + e_l`` exactly, so for any number ``lam``

      acc / l - lam = (sum_t w_t (A_t - lam L_t) + e_A - lam e_l) / l.

  With ``lam`` the midpoint ratio, ``A_t - lam L_t`` is small, so the uncertainty of the
  rescale factors ``w_t`` (which multiply a tile's ``A_t`` and ``L_t`` alike) nearly cancels,
  where two independent intervals for acc and l would each carry it. The result is intersected
  with the independent quotient (both are enclosures).
* **The PV accumulator per k-block**: the same model as S, over the keys of each kv tile in
  ascending order, with the running accumulator's bound carried through the rescales
  (``C <- fl(alpha C)``, error ``u |alpha C|``, earlier errors scaled by ``alpha``); joined with
  the any-order fp32 bound.
* **|O| <= max |v|** up to P's rounding and the accumulators' errors: the independent quotient
  ``[sum_t w_t A_t + e_A] / [l]`` that the ratio is intersected with is at most
  ``(sum_j w_j P_j |v_j| + |e_A|) / l`` with ``l >= sum_j w_j p_j - e_l``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import refattn.quant.bounds as bd
from refattn.engine.numba.quant_blocks import pv_blocks
from refattn.engine.numba.quant_softmax import online_softmax_rows
from refattn.errors import RefAttnError
from refattn.quant.accumulation import dot_block_model, fixed_matmul, grid_quantum, slack
from refattn.quant.bounds import Interval, gamma, point
from refattn.quant.formats import format_info, format_max
from refattn.quant.spec import QuantSpec

__all__ = ["RowsResult", "emulate_rows", "kv_tiles"]

U32 = 2.0**-24
U64 = 2.0**-53
FP32_MIN_NORMAL = 2.0**-126
FP32_MAX = format_max("fp32")
FP16_MAX = format_max("fp16")
_EXP2_SLACK = 4 * U64  # refattn.quant.bounds.exp2's slack for float64 exp2's own error


@dataclass(frozen=True)
class RowsResult:
    """Stages 2-5 of a block of R query rows (intervals; lse is computed by the caller).

    ``acc_over_l`` is the exact quotient the kernel's output rounds, (R, Dv); ``row_sum`` its
    l (fp32) and ``row_max`` its final max, (R,); ``scores`` and ``probs_q`` (R, K) only when
    asked for."""

    acc_over_l: Interval
    row_sum: Interval
    row_max: Interval
    scores: Interval | None = None
    probs_q: Interval | None = None


def kv_tiles(K: int, kv_tile: int | None, order: str) -> tuple[np.ndarray, np.ndarray]:
    """The kv tiles ``[start, end)`` in the kernel's visiting order.

    Examples
    --------
    >>> s, e = kv_tiles(10, 4, "descending")
    >>> s.tolist(), e.tolist()
    ([8, 4, 0], [10, 8, 4])
    """
    size = K if kv_tile is None else min(kv_tile, max(K, 1))
    starts = np.arange(0, K, max(size, 1), dtype=np.int64)
    ends = np.minimum(starts + size, K)
    if order == "descending":
        starts, ends = starts[::-1].copy(), ends[::-1].copy()
    return starts, ends


def _mag(iv: Interval) -> np.ndarray:
    m = np.maximum(np.abs(iv.lo), np.abs(iv.hi))
    return np.where(np.isfinite(m), m, 0.0)


# -- stage 2: S --------------------------------------------------------------------------------
def scores(q: Interval, k: Interval, spec: QuantSpec,
           descale: tuple[Interval, Interval] | None, *, exact_truncation: bool = False
           ) -> Interval:
    """The kernel's raw S (R, K) in fp32 for q rows (R, Dk) and keys (K, Dk); ``descale`` the
    q and k scales, (R, 1) and (1, K), where they multiply the dot (INT8): either order of the
    two fp32 products, ``fl(S fl(x y))`` or ``fl(fl(S x) y)``, lies inside (exact S: times
    ``fl(x y)``, unrounded). ``exact_truncation``: the block model's truncations summed
    product by product (:func:`refattn.quant.accumulation.dot_block_model`)."""
    quanta = (grid_quantum(spec.q.format), grid_quantum(spec.k.format))
    match spec.s_accumulation:
        case "fp32":
            s = dot_block_model(q, k, k_block=spec.mma_k, bits=spec.mma_bits,
                                tiny=FP32_MIN_NORMAL, to_fp32=True, quanta=quanta,
                                exact_truncation=exact_truncation)
        case "int32" | "exact":  # an exact integer (or exact) sum
            s = dot_block_model(q, k, k_block=0, bits=53, quanta=quanta)
            if spec.s_accumulation == "int32":
                s = bd.cast(s, "fp32")
        case other:  # pragma: no cover - QuantSpec refuses it
            raise ValueError(other)
    if descale is None:
        return s
    x, y = descale
    folded = bd.mul(s, bd.cast(bd.mul(x, y), "fp32"))
    if spec.s_accumulation == "exact":
        return folded
    one = bd.cast(folded, "fp32")
    two = bd.cast(bd.mul(bd.cast(bd.mul(s, x), "fp32"), y), "fp32")
    return Interval(np.minimum(one.lo, two.lo), np.maximum(one.hi, two.hi))


# -- stage 4: the sums -------------------------------------------------------------------------
def _tile_sum(x: np.ndarray, starts: np.ndarray, ends: np.ndarray, up: bool) -> np.ndarray:
    """(R, T) float64 sums of x's nonnegative columns per tile, rounded outward."""
    out = np.empty((x.shape[0], starts.size))
    for t, (a, b) in enumerate(zip(starts, ends, strict=True)):
        s = x[:, a:b].sum(axis=1)
        g = gamma(b - a + 1, U64)
        out[:, t] = np.nextafter(s * (1 + g), np.inf) if up else np.maximum(
            np.nextafter(s * (1 - g), -np.inf), 0.0)
    return out


def _suffix_products(a_lo: np.ndarray, a_hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w_t = prod_{s > t} alpha_s (R, T), rounded outward (alpha >= 0)."""
    R, T = a_lo.shape
    w_lo, w_hi = np.ones((R, T)), np.ones((R, T))
    acc_lo, acc_hi = np.ones(R), np.ones(R)
    for t in range(T - 1, -1, -1):
        w_lo[:, t], w_hi[:, t] = acc_lo, acc_hi
        with np.errstate(invalid="ignore", over="ignore"):
            acc_lo = np.maximum(np.nextafter(acc_lo * a_lo[:, t], -np.inf), 0.0)
            acc_hi = np.nextafter(acc_hi * a_hi[:, t], np.inf)
        acc_hi = np.where(np.isnan(acc_hi), np.inf, acc_hi)
    return w_lo, w_hi


def _pv_blocks(spec: QuantSpec) -> tuple[int, int, int]:
    """(keys per k-block, significant bits, accumulator precision) of the PV product."""
    match spec.pv_accumulation:
        case "fp32":
            return spec.mma_k, spec.mma_bits, 24
        case "fp16_per_tile":
            return spec.mma_k, spec.mma_bits, 11
        case _:  # "exact"
            return 0, 53, 53


def _block_keys(starts: np.ndarray, ends: np.ndarray, kb: int,
                K: int) -> tuple[np.ndarray, np.ndarray]:
    """The k-blocks of the PV product in the kernel's order: (N, kb) key indices (``K`` pads
    a block past its tile's end) and (N,) the tile of each block."""
    rows, tile = [], []
    for t, (j0, j1) in enumerate(zip(starts, ends, strict=True)):
        for b0 in range(int(j0), int(j1), kb):
            keys = np.arange(b0, b0 + kb)
            rows.append(np.where(keys < j1, keys, K))
            tile.append(t)
    if not rows:
        return np.zeros((0, kb), dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.array(rows, dtype=np.int64), np.array(tile, dtype=np.int64)


def _tiles_pv(P: Interval, v: Interval, a: Interval, starts: np.ndarray, ends: np.ndarray,
              spec: QuantSpec) -> tuple[np.ndarray, np.ndarray, Interval, np.ndarray]:
    """Each tile's exact ``A_t = sum_j P_j v_j`` as midpoint and radius (T, R, Dv), the PV
    accumulator's error ``e_A`` against ``sum_t w_t A_t`` as an interval (R, Dv), and where the
    accumulator may overflow (R, Dv) bool.

    The kernel's accumulator ``C`` is followed as an enclosure (its magnitude and sign bound
    each k-block's error, as in :func:`refattn.quant.accumulation.dot_block_model`):
    ``C <- fl(alpha_t C)`` at a tile's start (error ``u |alpha C|``, earlier errors scaled by
    ``alpha``), then each k-block of the tile's keys, ascending, adds its products ``P_j v_j``
    (``P >= 0``: a product's sign is ``v``'s) with the block model's signed error (fp16 tiles:
    into a fresh fp16 sum, added to the fp32 accumulator at the tile's end with one more
    rounding); joined at the end with the any-order bound of a plain fp32 accumulator
    (:func:`refattn.engine.numba.quant_blocks.pv_blocks`). The blocks' sums are batched
    matrix products of the gathered keys."""
    R, K = P.shape
    Dv, T = v.shape[1], starts.size
    kb, bits, prec = _pv_blocks(spec)
    blocked = kb > 0 and spec.pv_accumulation != "exact"
    step = kb if kb > 0 else max(int((ends - starts).max()) if T else 1, 1)
    keys, tile = _block_keys(starts, ends, step, K)  # (N, step), (N,)
    vmag = _mag(v)

    def gather_p(x: np.ndarray) -> np.ndarray:  # (R, K) -> (N, R, step)
        ext = np.concatenate([x, np.zeros((R, 1))], axis=1)
        return np.ascontiguousarray(ext[:, keys].transpose(1, 0, 2))

    def gather_v(x: np.ndarray) -> np.ndarray:  # (K, Dv) -> (N, step, Dv)
        return np.concatenate([x, np.zeros((1, Dv), dtype=x.dtype)], axis=0)[keys]

    ph = gather_p(P.hi)
    with np.errstate(invalid="ignore", over="ignore"):
        rad = 0.5 * (P.hi - P.lo)  # P's ends lie on a narrow format's grid: exact here
        mid = P.lo + rad
        if not np.array_equal(mid - rad, P.lo) or not np.array_equal(mid + rad, P.hi):
            mid, rad = P.mid, P.rad  # an infinite end, or an inexact step: rounded outward
    pm, pr = gather_p(mid), gather_p(rad)
    vm, vg = gather_v(v.mid), gather_v(vmag)
    qp, qv = grid_quantum(spec.p_format), grid_quantum(spec.v.format)
    x = fixed_matmul(pm, vm, qp / 2, qv / 2)  # (N, R, Dv)
    mag = fixed_matmul(ph, vg, qp, qv)
    n = (keys < K).sum(axis=1).astype(np.float64)  # (N,)
    xr = fixed_matmul(pr, vg, qp / 2, qv) + gamma(step + 2, U64) * mag
    if v.rad.any():
        xr = xr + fixed_matmul(np.abs(pm), gather_v(v.rad), qp / 2, qv / 2)
    f32 = np.float32  # the sign counts: small integers, exact in float32
    nz = (ph > 0).astype(f32)
    vpos, vneg = gather_v((v.hi > 0).astype(f32)), gather_v((v.lo < 0).astype(f32))
    n_sum, n_diff = nz @ (vpos + vneg), nz @ (vpos - vneg)
    per_tile = spec.pv_accumulation == "fp16_per_tile"
    a_mid, a_rad = np.empty((T, R, Dv)), np.empty((T, R, Dv))
    e_lo, e_hi = np.empty((R, Dv)), np.empty((R, Dv))
    any_mag = np.empty((R, Dv))
    overflow = np.empty((R, Dv), dtype=bool)
    pv_blocks(x, xr, mag, np.ascontiguousarray(ph.max(axis=2)),
              np.ascontiguousarray(vg.max(axis=1)), n_sum, n_diff, n, tile,
              np.ascontiguousarray(a.lo), np.ascontiguousarray(a.hi), blocked, per_tile,
              math.ldexp(1.0, 1 - bits), math.ldexp(1.0, 1 - prec),
              FP16_MAX if per_tile else FP32_MAX, a_mid, a_rad, e_lo, e_hi, any_mag, overflow)
    with np.errstate(over="ignore", invalid="ignore"):
        if spec.pv_accumulation != "exact":
            tiny = K * (2.0**-23 if per_tile else FP32_MIN_NORMAL)
            if kb <= 0:  # no block structure: every addition of a bits-bit accumulator
                g = gamma(1.0, (K - 1 + T) * math.ldexp(1.0, 1 - bits) + 2 * T * U32) * any_mag
                e_lo, e_hi = e_lo - g, e_hi + g
            else:  # joined with plain fp32 in any order
                g = gamma(1.0, (K - 1 + T) * 2.0**-23 + 2 * T * U32) * any_mag
                e_lo, e_hi = np.minimum(e_lo, -g), np.maximum(e_hi, g)
            e_lo, e_hi = e_lo - tiny, e_hi + tiny
        e_lo, e_hi = slack(e_lo), slack(e_hi)
    overflow |= ~(np.isfinite(e_lo) & np.isfinite(e_hi))
    return a_mid, a_rad, Interval(np.where(overflow, 0.0, e_lo), np.where(overflow, 0.0, e_hi)), \
        overflow


# -- stages 3-5 --------------------------------------------------------------------------------
def _cast_args(spec: QuantSpec) -> tuple[float, int, int, float, int]:
    """P's cast for :func:`refattn.engine.numba.quant_softmax.online_softmax_rows`."""
    info = format_info(spec.p_format)
    mult = spec.p_multiplier if spec.p_handling == "multiplier" else 1.0
    over = {"nearest_even_satfinite": 0, "nearest_even": 2}.get(spec.p_rounding,
                                                                1 if not info.has_inf else 2)
    return float(mult), int(info.emin), int(info.precision), float(info.max), over


def _cast_p(p: Interval, spec: QuantSpec) -> Interval:
    """P = cast(fl32(p mult)) in the kernel's P format."""
    mult = spec.p_multiplier if spec.p_handling == "multiplier" else 1.0
    scaled = p if mult == 1.0 else bd.cast(bd.mul(p, point(mult)), "fp32")
    return bd.cast(scaled, spec.p_format, spec.p_rounding)


def _l_floor(m: Interval, c: tuple[float, float], spec: QuantSpec, rel: float, T: int,
             g_l: float) -> np.ndarray:
    """A lower bound of the kernel's l from the row maximum's own term (module docstring):
    ``(1 - g_l) w* t*``, ``t*`` the argmax key's p (or P), ``w*`` the later rescales
    ``exp2(0)``; 0 for a row with no visible key or where ``m c`` leaves fp32's range."""
    off = spec.p_offset if spec.p_handling == "offset" else 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        mc = np.maximum(np.abs(m.lo), np.abs(m.hi)) * c[1]  # inf where m is unbounded
        err = (1 + 1e-6) * 4 * U32 * (mc + off)
        ok = (m.hi > -np.inf) & np.isfinite(mc) & (mc * (1 + 4 * U32) < FP32_MAX)
        star = bd.exp2(Interval(np.where(ok, off - err, -np.inf), np.where(ok, off + err, 0.0)),
                       spec.exp2_ulp)
        if spec.l_from == "rounded":
            star = _cast_p(star, spec)
        one = bd.exp2(point(0.0), spec.exp2_ulp).lo  # a later tile's exp2(0)
        w_star = float(one) ** max(T - 1, 0) * (1 - 2 * T * U64)
        floor = star.lo * w_star * (1 - g_l) * (1 - 4 * U64)
    return np.where(ok, np.maximum(floor, 0.0), 0.0)


def emulate_rows(S: Interval, vis: np.ndarray, c: tuple[float, float], v: Interval,
                 spec: QuantSpec, starts: np.ndarray, ends: np.ndarray, *,
                 keep: bool = False) -> RowsResult:
    """Stages 3-5 for R query rows of one head.

    Parameters
    ----------
    S : Interval of (R, K)
        The kernel's raw scores (:func:`scores`), any value where not visible.
    vis : (R, K) bool
    c : (float, float)
        The exponent multiplier's interval.
    v : Interval of (K, Dv)
        The values the PV product reads (codes).
    spec : QuantSpec
    starts, ends : (T,) int64
        :func:`kv_tiles`.
    keep : bool
        Also return ``scores`` and ``probs_q``.

    Returns
    -------
    RowsResult
    """
    R, K = S.shape
    T = starts.size
    off = spec.p_offset if spec.p_handling == "offset" else 0.0
    rel = float(np.nextafter(spec.exp2_ulp * 2.0**-23 + _EXP2_SLACK, np.inf))
    p_lo, p_hi = np.empty((R, K)), np.empty((R, K))
    q_lo, q_hi = np.empty((R, K)), np.empty((R, K))
    m_lo, m_hi = np.empty(R), np.empty(R)
    a_lo, a_hi = np.empty((R, T)), np.empty((R, T))
    online_softmax_rows(np.ascontiguousarray(S.lo), np.ascontiguousarray(S.hi),
                        np.ascontiguousarray(vis), float(c[0]), float(c[1]), float(off), rel,
                        starts, ends, _cast_args(spec), p_lo, p_hi, q_lo, q_hi, m_lo, m_hi,
                        a_lo, a_hi)
    p = Interval(p_lo, p_hi)
    P = Interval(q_lo, q_hi)
    alpha = Interval(a_lo, a_hi)
    w_lo, w_hi = _suffix_products(a_lo, a_hi)  # (R, T)
    terms = p if spec.l_from == "unrounded" else P
    L_lo = _tile_sum(terms.lo, starts, ends, up=False)  # (R, T)
    L_hi = _tile_sum(terms.hi, starts, ends, up=True)
    a_mid, a_rad, e_acc, overflow = _tiles_pv(P, v, alpha, starts, ends, spec)

    # l: sum_t w_t L_t, each fp32 addition and rescale rounded; at least the max term
    u_l = U32 if spec.l_from == "unrounded" else max(U32, math.ldexp(1.0, 1 - spec.mma_bits))
    g_l = gamma((K - 1) * 1.0 + T * U32 / u_l, u_l)
    with np.errstate(over="ignore", invalid="ignore"):
        lw_lo = np.maximum(np.nextafter((w_lo * L_lo).sum(axis=1) * (1 - gamma(T + 1, U64)),
                                        -np.inf), 0.0)
        lw_hi = np.nextafter((w_hi * L_hi).sum(axis=1) * (1 + gamma(T + 1, U64)), np.inf)
        e_l = slack(g_l * lw_hi)
        l_lo = np.maximum(np.nextafter(lw_lo - e_l, -np.inf), 0.0)
        l_hi = np.nextafter(lw_hi + e_l, np.inf)
    m = Interval(m_lo, m_hi)
    l_lo = np.maximum(l_lo, _l_floor(m, c, spec, rel, T, g_l))
    row_sum = bd.cast(Interval(l_lo, np.maximum(l_hi, l_lo)), "fp32")  # (R,)
    lk_lo, lk_hi = row_sum.lo[:, None], row_sum.hi[:, None]  # the kernel's l (fp32)

    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        # the ratio: acc / l - lam = (sum_t w_t (A_t - lam L_t) + e_A - lam e_l) / l
        w_mid = 0.5 * (w_lo + w_hi)  # (R, T)
        L_mid, L_rad = 0.5 * (L_lo + L_hi), 0.5 * (L_hi - L_lo)
        num = np.einsum("rt,trd->rd", w_mid, a_mid)
        den = (w_mid * L_mid).sum(axis=1)[:, None]
        lam = np.where((den > 0) & np.isfinite(num / den), num / den, 0.0)  # (R, Dv)
        n_lo = np.zeros_like(lam)
        n_hi = np.zeros_like(lam)
        spread = np.zeros_like(lam)
        for t in range(T):
            nm = a_mid[t] - lam * L_mid[:, t, None]
            nr = slack(a_rad[t] + np.abs(lam) * L_rad[:, t, None]
                       + 2.0**-52 * (np.abs(a_mid[t]) + np.abs(lam * L_mid[:, t, None])))
            lo_t, hi_t = nm - nr, nm + nr
            wl, wh = w_lo[:, t, None], w_hi[:, t, None]
            n_lo += np.where(lo_t >= 0, wl * lo_t, wh * lo_t)
            n_hi += np.where(hi_t >= 0, wh * hi_t, wl * hi_t)
            spread += wh * (np.abs(lo_t) + np.abs(hi_t))
        e_n = slack(np.abs(lam) * e_l[:, None] + 2.0**-40 * spread)
        n_lo, n_hi = n_lo + e_acc.lo - e_n, n_hi + e_acc.hi + e_n
        q_lo = np.where(n_lo >= 0, n_lo / lk_hi, n_lo / lk_lo)
        q_hi = np.where(n_hi >= 0, n_hi / lk_lo, n_hi / lk_hi)
        r_lo = np.nextafter(lam + np.nextafter(q_lo, -np.inf), -np.inf)
        r_hi = np.nextafter(lam + np.nextafter(q_hi, np.inf), np.inf)
        # the independent quotient [acc] / [l], and |acc / l| <= sum w P |v| / l
        acc_lo = np.zeros_like(lam)
        acc_hi = np.zeros_like(lam)
        for t in range(T):
            lo_t, hi_t = a_mid[t] - a_rad[t], a_mid[t] + a_rad[t]
            wl, wh = w_lo[:, t, None], w_hi[:, t, None]
            acc_lo += np.where(lo_t >= 0, wl * lo_t, wh * lo_t)
            acc_hi += np.where(hi_t >= 0, wh * hi_t, wl * hi_t)
        acc_lo, acc_hi = acc_lo + e_acc.lo, acc_hi + e_acc.hi
        ind = bd.div(Interval(np.nextafter(acc_lo, -np.inf), np.nextafter(acc_hi, np.inf)),
                     Interval(lk_lo, lk_hi))
        lo = np.maximum(r_lo, ind.lo)
        hi = np.minimum(r_hi, ind.hi)
        if np.any(lo > hi):  # two enclosures of one value cannot be disjoint
            raise RefAttnError("quantised emulation: the ratio and the quotient enclosures "
                               "of the output are disjoint (an enclosure bug)")
    # a visible score unbounded on a side may be inf or NaN in the kernel (a NaN code, an
    # overflowed sum): its row's max, l and output are then unknown
    wild = (vis & ~(np.isfinite(S.lo) & np.isfinite(S.hi))).any(axis=1)  # (R,)
    unknown = (overflow | ~(lk_lo > 0) | np.isnan(lo) | np.isnan(hi) | ~np.isfinite(lam)
               | wild[:, None])
    out = Interval(np.where(unknown, -np.inf, lo), np.where(unknown, np.inf, hi))
    if wild.any():
        row_sum = Interval(np.where(wild, -np.inf, row_sum.lo), np.where(wild, np.inf, row_sum.hi))
        m = Interval(np.where(wild, -np.inf, m.lo), np.where(wild, np.inf, m.hi))
    return RowsResult(out, row_sum, m, S if keep else None, P if keep else None)
