"""Streaming (tiled, online-softmax) forward and backward kernels; no [Q, K] tensor anywhere.

Owns the two ``@njit(parallel=True)`` kernels of the numba backend's streaming mode:

- :func:`stream_forward`: one task per (b, h, query block); for every key block it forms the
  score tile with BLAS, applies scale, bias and visibility, updates the running max ``m`` and
  sum ``l`` (rescaling the output accumulator by ``exp(m_old - m_new)``), multiplies by the
  dropout multiplier and accumulates ``P~ Z V`` with BLAS. It saves only the output, the
  row max and ``lse = m + log l`` (B, Hq, Q).
- :func:`stream_backward`: one task per (batch set, head set, key chunk); for every tile it
  recomputes ``P = exp(s - lse)`` and the multiplier from coordinates, then accumulates
  ``dV += (P Z)^T dO``, ``dS = P (dO V^T Z - D)``, ``dQ += alpha dS K``, ``dK += alpha dS^T Q``
  with ``D = sum(dO * O)`` (and the other contraction ``sum(P * G_P)`` as a by-product).

The (tile x D) products run as sub-GEMMs of at most ``sub`` rows and inner length (OpenBLAS
then uses its unpacked small-matrix kernels, about 20% faster on these shapes); the score
products stay whole tiles, which the packed kernels run fastest. Every task owns the rows it
writes (key blocks are dealt round-robin to chunks; chunk-partial dQ and row sums are added in
chunk order afterwards), and each thread reuses one tile workspace, so results are
bit-identical run to run for a fixed thread count. Fully invisible tiles are skipped before any
arithmetic. Defers BLAS to :mod:`~refattn.engine.numba.blas`, visibility to
:mod:`~refattn.engine.numba.tiles`, the dropout stream to :mod:`~refattn.engine.numba.philox`
and the row primitives to
:mod:`~refattn.engine.numba.math`. BLAS must be pinned to one thread around these kernels.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from refattn.engine.numba._jit import kernel
from refattn.engine.numba.blas import gemm, gemm_split
from refattn.engine.numba.math import exp1, exp_shift, row_dot, row_sum
from refattn.engine.numba.math import row_max as max_of_row
from refattn.engine.numba.operands import DROP_NONE, address, at, multiplier_row
from refattn.engine.numba.tiles import FULL, INVISIBLE, PARTIAL, classify, tile_mask

__all__ = ["stream_backward", "stream_forward"]

@kernel(inline="always")
def _tile_class(mask, tv, b, h, i0, bq, j0, bk):
    """INVISIBLE, PARTIAL (``mask`` filled) or FULL, exactly: block bounds first, then the
    element mask of a tile the bounds could not decide."""
    cls = classify(tv, b, h, i0, i0 + bq, j0, j0 + bk)
    if cls == PARTIAL:
        n = tile_mask(mask, tv, b, h, i0, i0 + bq, j0, j0 + bk)
        if n == 0:
            return INVISIBLE
        if n == bq * bk:
            return FULL
    return cls


@kernel(inline="always")
def _bias_and_mask(row, n, has_bias, bias, b, h, i, j0, cls, mask_row):
    """``row[j] += bias`` (the finite preference), then -inf where not visible."""
    for j in range(n):
        x = row[j]
        if has_bias:
            x += at(bias[0], bias[1], b, h, i, j0 + j)
        if cls != FULL and not mask_row[j]:
            x = -np.inf  # visibility after the bias: no bias revives an edge
        row[j] = x


@kernel(parallel=True)
def stream_forward(q, k, v, head_map, scale, tv, has_bias, bias, drop, zdense, query_valid,
                   BQ, BK, sub, fptr, nt, out, lse, row_max, sanitized, tiles):
    """Tiled online-softmax forward.

    Parameters
    ----------
    q : (B, Hq, Q, Dk) float64, C-contiguous
    k : (B, Hkv, K, Dk) float64, C-contiguous
    v : (B, Hkv, K, Dv) float64, C-contiguous
    head_map : (Hq,) int64
    scale : float
    tv : TileVisibility
    has_bias : bool; bias : Strided float64 operand broadcast to (B, Hq, Q, K) (a dummy
        when absent)
    drop : (mode, key0, key1, offset, threshold, keep_multiplier);
        zdense : Strided float64 operand (mode 1) or a dummy
    query_valid : (B, Q) bool
    BQ, BK : int
        Query and key block sizes.
    sub : int
        Largest side of the sub-products the (tile x D) GEMMs are split into (see
        :func:`~refattn.engine.numba.blas.gemm_split`).
    fptr : int
        Address of BLAS dgemm.
    nt : int
        numba's thread count (one tile workspace per thread).
    out : (B, Hq, Q, Dv) float64, zero-filled; written
    lse, row_max : (B, Hq, Q) float64; written
    sanitized : (B, Hq, Q) bool; written (rows with no legal key, given key 0)
    tiles : (B * Hq * nqb, 2) int64; written (tiles computed, tiles skipped) per task
    """
    B, Hq, Q, Dk = q.shape
    K = k.shape[2]
    Dv = v.shape[3]
    nqb = (Q + BQ - 1) // BQ
    nkb = (K + BK - 1) // BK
    drop_mode = drop[0]
    # one workspace per thread (nt = numba's thread count), reused by all of its tasks
    s_ws = np.empty((nt, BQ, BK))  # score tile, then P~ Z in place
    mask_ws = np.empty((nt, BQ, BK), dtype=np.bool_)
    zrow_ws = np.empty((nt, BK))
    m_ws = np.empty((nt, BQ))  # running max of each row
    ell_ws = np.empty((nt, BQ))  # running sum of exp(x - m)
    for task in prange(B * Hq * nqb):
        bh = task // nqb
        ib = task - bh * nqb
        b = bh // Hq
        h = bh - b * Hq
        hk = head_map[h]
        i0 = ib * BQ
        bq = min(BQ, Q - i0)
        tid = numba.get_thread_id()
        s = s_ws[tid]
        mask = mask_ws[tid]
        zrow = zrow_ws[tid]
        m = m_ws[tid]
        ell = ell_ws[tid]
        m[:] = -np.inf
        ell[:] = 0.0
        o = out[b, h]
        done = 0
        skipped = 0
        for jb in range(nkb):
            j0 = jb * BK
            bk = min(BK, K - j0)
            cls = _tile_class(mask, tv, b, h, i0, bq, j0, bk)
            if cls == INVISIBLE:
                skipped += 1
                continue
            done += 1
            # s = alpha * (q_i @ k_j^T): (bq, Dk) x (Dk, bk); BLAS applies alpha to the sum
            gemm(fptr, False, True, bq, bk, Dk, scale, address(q, b, h, i0), Dk,
                 address(k, b, hk, j0), Dk, 0.0, s.ctypes.data, BK)
            for r in range(bq):
                i = i0 + r
                row = s[r]
                if has_bias or cls != FULL:
                    _bias_and_mask(row, bk, has_bias, bias, b, h, i, j0, cls, mask[r])
                m_new = max(m[r], max_of_row(row, bk))
                if m_new == -np.inf:  # nothing legal in this row so far
                    for j in range(bk):
                        row[j] = 0.0
                    continue
                corr = exp1(m[r] - m_new)  # 0.0 on the first legal tile of the row
                exp_shift(row, bk, m_new)
                ell[r] = ell[r] * corr + row_sum(row, bk)
                m[r] = m_new
                if corr != 1.0:
                    for d in range(Dv):
                        o[i, d] *= corr
                if drop_mode != DROP_NONE:
                    multiplier_row(zrow, drop, zdense, b, h, Hq, i, j0, bk)
                    for j in range(bk):
                        row[j] *= zrow[j]
            # o_i += (P~ Z)_ij @ v_j: (bq, bk) x (bk, Dv)
            gemm_split(fptr, False, False, bq, Dv, bk, 1.0, s.ctypes.data, BK,
                       address(v, b, hk, j0), Dv, 1.0, address(out, b, h, i0), Dv, sub, sub)
        for r in range(bq):
            i = i0 + r
            if ell[r] == 0.0:  # no legal key: the temporary key 0 (the gate allows it only
                x = 0.0        # for rows whose output is unused)
                for d in range(Dk):
                    x += q[b, h, i, d] * k[b, hk, 0, d]
                x *= scale
                if has_bias:
                    x += at(bias[0], bias[1], b, h, i, 0)
                m[r] = x
                ell[r] = 1.0
                sanitized[b, h, i] = True
                z0 = 1.0
                if drop_mode != DROP_NONE:
                    multiplier_row(zrow, drop, zdense, b, h, Hq, i, 0, 1)
                    z0 = zrow[0]
                for d in range(Dv):
                    o[i, d] = z0 * v[b, hk, 0, d]
            else:
                sanitized[b, h, i] = False
                for d in range(Dv):
                    o[i, d] /= ell[r]
            row_max[b, h, i] = m[r]
            lse[b, h, i] = m[r] + math.log(ell[r])
            if not query_valid[b, i]:
                for d in range(Dv):
                    o[i, d] = 0.0  # unused rows are exactly zero
        tiles[task, 0] = done
        tiles[task, 1] = skipped


@kernel(parallel=True)
def stream_backward(q, k, v, head_map, scale, tv, has_bias, bias, drop, zdense, g_o, lse,
                    dvec, BQ, BK, sub, split_b, split_h, C, fptr, nt, dq, dk, dv, rowdot, gbias,
                    tiles):
    """Tiled backward that recomputes P from ``lse`` and Z from coordinates.

    Parameters
    ----------
    q, k, v, head_map, scale, tv, has_bias, bias, drop, zdense, BQ, BK, sub, fptr, nt
        As for :func:`stream_forward`.
    g_o : (B, Hq, Q, Dv) float64
        G_O with unused query rows already zeroed.
    lse, dvec : (B, Hq, Q) float64
        Saved log-sum-exp and ``D = sum(G_O * O)``.
    split_b, split_h : bool
        Whether tasks split the batch / head axes (False when a broadcast bias gradient would
        otherwise be written by two tasks); C : int, key chunks per task group.
    dq : (C, B, Hq, Q, Dk) float64, zero-filled; partial per chunk, written already
        multiplied by alpha
    dk, dv : (B, Hq, K, Dk), (B, Hq, K, Dv) float64, zero-filled; per query head
    rowdot : (C, B, Hq, Q) float64, zero-filled; partial ``sum(P * G_P)`` per chunk
    gbias : (Cb, Bb, Hb, Qb, Kb) float64, zero-filled; the bias's own (padded) shape, one copy
        per chunk when the bias broadcasts over keys and C > 1 (Cb = 1 otherwise)
    tiles : (tasks, 2) int64; written
    """
    B, Hq, Q, Dk = q.shape
    K = k.shape[2]
    Dv = v.shape[3]
    nqb = (Q + BQ - 1) // BQ
    nkb = (K + BK - 1) // BK
    nb = B if split_b else 1
    nh = Hq if split_h else 1
    drop_mode = drop[0]
    Bb, Hb, Qb, Kb = gbias.shape[1], gbias.shape[2], gbias.shape[3], gbias.shape[4]
    # one workspace per thread (nt = numba's thread count), reused by all of its tasks
    nz = BQ if drop_mode != DROP_NONE else 1  # dropout buffers only with dropout
    p_ws = np.empty((nt, BQ, BK))  # P, recomputed
    gs_ws = np.empty((nt, BQ, BK))  # G_Pdrop, then dS in place
    pz_ws = np.empty((nt, nz, BK))  # P * Z
    zt_ws = np.empty((nt, nz, BK))  # Z
    mask_ws = np.empty((nt, BQ, BK), dtype=np.bool_)
    for task in prange(nb * nh * C):
        c = task % C
        g = task // C
        tb = g // nh
        th = g - tb * nh
        cb = c if gbias.shape[0] > 1 else 0
        tid = numba.get_thread_id()
        p = p_ws[tid]
        gs = gs_ws[tid]
        pz = pz_ws[tid]
        zt = zt_ws[tid]
        mask = mask_ws[tid]
        done = 0
        skipped = 0
        for b in range(tb if split_b else 0, tb + 1 if split_b else B):
            for h in range(th if split_h else 0, th + 1 if split_h else Hq):
                hk = head_map[h]
                for jb in range(c, nkb, C):  # key blocks dealt round-robin to chunks
                    j0 = jb * BK
                    bk = min(BK, K - j0)
                    for ib in range(nqb):
                        i0 = ib * BQ
                        bq = min(BQ, Q - i0)
                        cls = _tile_class(mask, tv, b, h, i0, bq, j0, bk)
                        if cls == INVISIBLE:
                            skipped += 1
                            continue
                        done += 1
                        gemm(fptr, False, True, bq, bk, Dk, scale, address(q, b, h, i0), Dk,
                             address(k, b, hk, j0), Dk, 0.0, p.ctypes.data, BK)
                        # G_Pdrop = dO_i @ v_j^T: (bq, Dv) x (Dv, bk)
                        gemm(fptr, False, True, bq, bk, Dv, 1.0, address(g_o, b, h, i0), Dv,
                             address(v, b, hk, j0), Dv, 0.0, gs.ctypes.data, BK)
                        for r in range(bq):
                            i = i0 + r
                            row = p[r]
                            if has_bias or cls != FULL:
                                _bias_and_mask(row, bk, has_bias, bias, b, h, i, j0, cls,
                                               mask[r])
                            exp_shift(row, bk, lse[b, h, i])  # P = exp(x - lse)
                            if drop_mode != DROP_NONE:
                                zr = zt[r]
                                multiplier_row(zr, drop, zdense, b, h, Hq, i, j0, bk)
                                for j in range(bk):
                                    pz[r, j] = row[j] * zr[j]
                                    gs[r, j] *= zr[j]  # G_P = G_Pdrop * Z
                            rowdot[c, b, h, i] += row_dot(row, gs[r], bk)
                            d_i = dvec[b, h, i]
                            for j in range(bk):
                                gs[r, j] = row[j] * (gs[r, j] - d_i)  # dS = P (G_P - D)
                            if has_bias:
                                bi = b if Bb > 1 else 0
                                bh_ = h if Hb > 1 else 0
                                qi = i if Qb > 1 else 0
                                for j in range(bk):
                                    gbias[cb, bi, bh_, qi, j0 + j if Kb > 1 else 0] += gs[r, j]
                        pa = pz.ctypes.data if drop_mode != DROP_NONE else p.ctypes.data
                        # dv_j += (P Z)^T dO_i: (bk, bq) x (bq, Dv)
                        gemm_split(fptr, True, False, bk, Dv, bq, 1.0, pa, BK,
                                   address(g_o, b, h, i0), Dv, 1.0, address(dv, b, h, j0), Dv,
                                   sub, sub)
                        # dq_i += alpha dS k_j: (bq, bk) x (bk, Dk)
                        gemm_split(fptr, False, False, bq, Dk, bk, scale, gs.ctypes.data, BK,
                                   address(k, b, hk, j0), Dk, 1.0, address(dq[c], b, h, i0), Dk,
                                   sub, sub)
                        # dk_j += alpha dS^T q_i: (bk, bq) x (bq, Dk)
                        gemm_split(fptr, True, False, bk, Dk, bq, scale, gs.ctypes.data, BK,
                                   address(q, b, h, i0), Dk, 1.0, address(dk, b, h, j0), Dk,
                                   sub, sub)
        tiles[task, 0] = done
        tiles[task, 1] = skipped
