"""Fused forward+backward in query blocks: output and gradients with no trace and no recompute.

Owns :func:`fused_value_and_grad`, the kernel of the numba backend's ``value_and_grad``. Each task
owns one (batch, kv head, chunk of query blocks); for every query head of that kv head and every
query block of ``BQ`` rows it holds the block's whole score row range (``BQ x K``) in a per-thread
buffer, so the softmax is exact per row (no online rescaling) and the backward runs at once from
the same probabilities: six BLAS products per block (``S = Q K^T``, ``O = P~ Z V``,
``dV += (P~ Z)^T dO``, ``dP = dO V^T``, ``dQ = dS K``, ``dK += dS^T Q``), the 12 counted units of
forward+backward and no recomputation of ``Q K^T``. ``BQ = Q`` is the whole-head form; a smaller
``BQ`` bounds the buffers for long keys. The four products whose output is thin (``O``, ``dV``,
``dQ``, ``dK``: ``D`` columns) can be issued in tiles (``split``) that OpenBLAS runs on its
unpacked small-matrix kernels instead of packing the score block. Key chunks of ``KC`` columns that
a block's rows cannot see are skipped (their products and row work), and runs of visible chunks are
one product each. The row work (softcap, bias, visibility, the sink, max, exp, sums, the dropout
multiplier, ``D``, ``dS``) is fused per row, in three passes over a row's visible chunks (max; exp
and sum; dot and dS) with vector reductions: ``P = E / ell`` with ``E = exp(s - m)`` is never
formed -- the products take ``E`` and the ``1 / ell`` of a row goes into ``O``, the rows of ``dO``
that ``dV`` reads, and ``dS = E (G_P - D) / ell``. Each task writes only its own rows of dq and its
own chunk's partial dk/dv, so results are bit-identical run to run for a given thread count. BLAS
must be pinned to one thread around the kernel.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from numba import prange

from refattn.engine.numba._jit import kernel
from refattn.engine.numba.blas import gemm, gemm_pair
from refattn.engine.numba.math import dot_grad, exp_sum, row_dot, softcap_row
from refattn.engine.numba.math import row_max as max_of_row
from refattn.engine.numba.operands import DROP_NONE, address, at, multiplier_row
from refattn.engine.numba.tiles import FULL, INVISIBLE, classify, tile_mask

__all__ = ["GBIAS_NONE", "GBIAS_OVER_K", "GBIAS_OVER_Q", "GBIAS_PER_ELEMENT",
           "fused_value_and_grad"]

GBIAS_NONE, GBIAS_PER_ELEMENT, GBIAS_OVER_Q, GBIAS_OVER_K = 0, 1, 2, 3


@kernel(inline="always")
def _visible_runs(cls, nkc, KC, K, runs):
    """``runs[:n]`` = (first, end) key columns of each run of visible chunks; returns n."""
    n = 0
    kc = 0
    while kc < nkc:
        if cls[kc] == INVISIBLE:
            kc += 1
            continue
        ke = kc
        while ke < nkc and cls[ke] != INVISIBLE:
            ke += 1
        runs[n, 0] = kc * KC
        runs[n, 1] = min(ke * KC, K)
        n += 1
        kc = ke
    return n


@kernel(parallel=True)
def fused_value_and_grad(q, k, v, head_map, post, fq, fk, tv, has_bias, bias, drop, zdense,
                         softcap, sink, query_valid, sanitized, g_o, BQ, KC, LD, LP, C, fptr,
                         split, nt, s_ws, w_ws, p_ws, t_ws, z_ws, u_ws, out, lse, row_max, dq, dk,
                         dv, rowdot, dvec, gbias, gbias_mode, tiles):
    """Forward and backward of a dot-score call, query block by query block.

    Parameters
    ----------
    q : (B, Hq, Q, Dk) float64, C-contiguous; the placement's rounded query operand
    k : (B, Hkv, K, Dk); v : (B, Hkv, K, Dv) float64, C-contiguous
    head_map : (Hq,) int64
    post, fq, fk : float
        Multiplier of ``q . k`` (alpha for the post placement, else 1); factors of dq and dk.
    tv : TileVisibility
    has_bias : bool; bias : Strided float64 operand broadcast to (B, Hq, Q, K)
    drop : (mode, key0, key1, offset, threshold, keep); zdense : Strided multiplier (mode 1)
    softcap : float
        c (0.0: no softcap).
    sink : (Hq,) float64 (empty: no sink)
    query_valid : (B, Q) bool
    sanitized : (B, Hq, Q) bool; rows that get the temporary legal key 0
    g_o : (B, Hq, Q, Dv) float64; G_O with unused rows zeroed
    BQ, KC : int
        Query block rows; key chunk columns (the skipping granularity).
    LD, LP : int
        Row strides (elements) of the per-thread score buffers (>= K) and of the dP slab
        (>= KC) (:func:`~refattn.engine.numba.fused_host.score_stride`: padded so that the
        rows of a tile do not share cache sets).
    C : int
        Chunks of query blocks per (b, kv head) (tasks = B * Hkv * C).
    fptr : int
        Address of a Fortran-ABI dgemm.
    split : (8,) int64
        Tiles of the four thin products (O, dV, dQ, dK), as (rows of C, inner) pairs for
        :func:`~refattn.engine.numba.blas.gemm_split`; tiles at least as large as the product
        issue it whole (:func:`~refattn.engine.numba.fused_host.split_tiles`).
    nt : int
        numba's thread count (one workspace per thread).
    s_ws : (>= nt, >= BQ * LD) float64
        Scratch: per thread the scores, then E = exp(s - m), then dS (contents ignored).
    w_ws : (>= nt, >= BQ * LD) float64 with dropout (E Z), else any
    p_ws : (>= nt, >= BQ * LP) float64: one key chunk of dP = dO V^T (then G_P)
    t_ws : (>= nt, >= BQ * LD) float64 with a softcap (capped scores), else any
    z_ws : (>= nt, >= K) float64 with dropout (one row of multipliers), else any
    u_ws : (>= nt, >= BQ * (Dv + 1)) float64: the block's G_O rows over ell, and 1 / ell
    out : (B, Hq, Q, Dv); lse, row_max, rowdot, dvec : (B, Hq, Q); dq : (B, Hq, Q, Dk)
        Written.
    dk : (C, B, Hkv, K, Dk), dv : (C, B, Hkv, K, Dv)
        Zero-filled; partials per chunk.
    gbias : 4-D, per ``gbias_mode``: 1 (B, Hq, Q, K) per element; 2 (C, B, Hq, K) summed
        over queries; 3 (B, Hq, Q, 1) summed over keys; zero-filled.
    tiles : (tasks, 2) int64
        Written: key chunks computed and skipped.
    """
    B, Hq, Q, Dk = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    Dv = v.shape[3]
    nqb = (Q + BQ - 1) // BQ
    nkc = (K + KC - 1) // KC
    has_cap = softcap > 0.0
    has_sink = sink.shape[0] > 0
    dropping = drop[0] != DROP_NONE
    cls_ws = np.empty((nt, nkc), dtype=np.int64)
    runs_ws = np.empty((nt, (nkc + 1) // 2, 2), dtype=np.int64)
    mask_ws = np.empty((nt, 1, KC), dtype=np.bool_)
    acc_ws = np.empty((nt, 2, BQ))  # per row: row_dot and the over-keys bias gradient
    for task in prange(B * Hkv * C):
        c = task % C
        bg = task // C
        b = bg // Hkv
        g = bg - b * Hkv
        tid = numba.get_thread_id()
        s = s_ws[tid, :BQ * LD].reshape((BQ, LD))
        w = w_ws[tid, :BQ * LD].reshape((BQ, LD)) if dropping else w_ws[tid, :1].reshape((1, 1))
        p = p_ws[tid, :BQ * LP].reshape((BQ, LP))
        rd_acc, gb_acc = acc_ws[tid, 0], acc_ws[tid, 1]
        tcap = t_ws[tid, :BQ * LD].reshape((BQ, LD)) if has_cap else t_ws[tid, :1].reshape((1, 1))
        z = z_ws[tid]
        inv_ell = u_ws[tid, :BQ]
        g_scaled = u_ws[tid, BQ:BQ * (Dv + 1)].reshape((BQ, Dv))
        cls, mask, runs = cls_ws[tid], mask_ws[tid], runs_ws[tid]
        done = 0
        skipped = 0
        for h in range(Hq):
            if head_map[h] != g:
                continue
            for qb in range(c, nqb, C):
                i0 = qb * BQ
                bq = min(BQ, Q - i0)
                any_sanitized = False
                for r in range(bq):
                    any_sanitized = any_sanitized or sanitized[b, h, i0 + r]
                for kc in range(nkc):
                    j0 = kc * KC
                    cls[kc] = classify(tv, b, h, i0, i0 + bq, j0, j0 + min(KC, K - j0))
                    if kc == 0 and any_sanitized and cls[0] == INVISIBLE:
                        cls[0] = 1  # PARTIAL: the temporary key 0 of a sanitised row
                    if cls[kc] == INVISIBLE:
                        skipped += 1
                    else:
                        done += 1
                # S = post * Q K^T over each run of visible chunks
                nruns = _visible_runs(cls, nkc, KC, K, runs)
                empty = nruns == 0
                for u in range(nruns):
                    ja, jb = runs[u, 0], runs[u, 1]
                    gemm(fptr, False, True, bq, jb - ja, Dk, post, address(q, b, h, i0), Dk,
                         address(k, b, g, ja), Dk, 0.0, s.ctypes.data + 8 * ja, LD)
                # the forward row pass: softcap, bias, visibility, softmax, dropout
                for r in range(bq):
                    i = i0 + r
                    m = sink[h] if has_sink else -np.inf
                    for kc in range(nkc):
                        if cls[kc] == INVISIBLE:
                            continue
                        j0 = kc * KC
                        kw = min(KC, K - j0)
                        row = s[r, j0:j0 + kw]
                        if has_cap:
                            softcap_row(row, tcap[r, j0:j0 + kw], kw, softcap)
                        if has_bias:
                            for j in range(kw):
                                row[j] += at(bias[0], bias[1], b, h, i, j0 + j)
                        if cls[kc] != FULL:  # this row's visibility in the chunk
                            tile_mask(mask, tv, b, h, i, i + 1, j0, j0 + kw)
                            keep0 = j0 == 0 and sanitized[b, h, i]
                            for j in range(kw):
                                if not mask[0, j] and not (keep0 and j == 0):
                                    row[j] = -np.inf  # after the bias: no bias revives an edge
                        m = max(m, max_of_row(row, kw))
                    ell = math.exp(sink[h] - m) if has_sink else 0.0
                    for kc in range(nkc):
                        if cls[kc] == INVISIBLE:
                            continue
                        j0 = kc * KC
                        kw = min(KC, K - j0)
                        row = s[r, j0:j0 + kw]
                        ell += exp_sum(row, kw, m)  # E = exp(s - m) and its row sum
                    inv_ell[r] = 1.0 / ell  # P = E / ell is never formed: O, dV and dS scale
                    if dropping:
                        for kc in range(nkc):
                            if cls[kc] == INVISIBLE:
                                continue
                            j0 = kc * KC
                            kw = min(KC, K - j0)
                            multiplier_row(z, drop, zdense, b, h, Hq, i, j0, kw)
                            for j in range(kw):
                                w[r, j0 + j] = s[r, j0 + j] * z[j]
                    lse[b, h, i] = m + math.log(ell)
                    row_max[b, h, i] = m
                    for d in range(Dv):
                        g_scaled[r, d] = g_o[b, h, i, d] * inv_ell[r]
                pz = w if dropping else s  # E Z (E = exp(s - m)): P~ Z = E Z / ell
                # O = (E Z V) / ell and dV += (E Z)^T (dO / ell) over the visible runs, key
                # slab by key slab (a block with no run keeps zeros)
                for u in range(nruns):
                    ja, jb = runs[u, 0], runs[u, 1]
                    gemm_pair(fptr, bq, jb - ja, pz.ctypes.data + 8 * ja, LD,
                              1.0, address(v, b, g, ja), Dv, 1.0 if u > 0 else 0.0,
                              address(out, b, h, i0), 1.0, g_scaled.ctypes.data, Dv,
                              address(dv[c], b, g, ja), split[0], split[1], split[2], split[3])
                for r in range(bq):
                    i = i0 + r
                    if empty or not query_valid[b, i]:
                        for d in range(Dv):
                            out[b, h, i, d] = 0.0  # unused rows are exactly zero
                    else:
                        for d in range(Dv):
                            out[b, h, i, d] *= inv_ell[r]
                    dvec[b, h, i] = row_dot(g_o[b, h, i], out[b, h, i], Dv)  # D = G_O . O
                # the backward chunk by chunk: dP = dO V^T of the chunk into a slab that stays
                # in cache, then its row pass: G_P = dP Z, row_dot, dS = P (G_P - D) (x cap
                # slope) into s; row sums accumulate chunk by chunk in key order
                for r in range(bq):
                    rd_acc[r] = 0.0
                    gb_acc[r] = 0.0
                for kc in range(nkc):
                    if cls[kc] == INVISIBLE:
                        continue
                    j0 = kc * KC
                    kw = min(KC, K - j0)
                    gemm(fptr, False, True, bq, kw, Dv, 1.0, address(g_o, b, h, i0), Dv,
                         address(v, b, g, j0), Dv, 0.0, p.ctypes.data, LP)
                    for r in range(bq):
                        i = i0 + r
                        d_i = dvec[b, h, i]
                        inv = inv_ell[r]
                        e_row, g_row = s[r, j0:j0 + kw], p[r, :kw]
                        if dropping:
                            multiplier_row(z, drop, zdense, b, h, Hq, i, j0, kw)
                            for j in range(kw):
                                g_row[j] *= z[j]
                        if gbias_mode == GBIAS_NONE and not has_cap:  # row_dot; dS in place
                            rd_acc[r] += dot_grad(e_row, g_row, kw, d_i, inv)
                            continue
                        rd_acc[r] += row_dot(e_row, g_row, kw)
                        gb_row = gb_acc[r]  # one running sum per row, in key order
                        for j in range(kw):
                            gs = (e_row[j] * (g_row[j] - d_i)) * inv  # grad_scores
                            if gbias_mode == GBIAS_PER_ELEMENT:
                                gbias[b, h, i, j0 + j] = gs
                            elif gbias_mode == GBIAS_OVER_Q:
                                gbias[c, b, h, j0 + j] += gs
                            elif gbias_mode == GBIAS_OVER_K:
                                gb_row += gs
                            if has_cap:
                                t = tcap[r, j0 + j] / softcap
                                gs *= 1.0 - t * t
                            e_row[j] = gs
                        gb_acc[r] = gb_row
                for r in range(bq):
                    rowdot[b, h, i0 + r] = rd_acc[r] * inv_ell[r]
                    if gbias_mode == GBIAS_OVER_K:
                        gbias[b, h, i0 + r, 0] = gb_acc[r]
                # dQ = fq dS K; dK += fk dS^T Q over the visible runs, key slab by key slab
                for u in range(nruns):
                    ja, jb = runs[u, 0], runs[u, 1]
                    gemm_pair(fptr, bq, jb - ja, s.ctypes.data + 8 * ja, LD,
                              fq, address(k, b, g, ja), Dk, 1.0 if u > 0 else 0.0,
                              address(dq, b, h, i0), fk, address(q, b, h, i0), Dk,
                              address(dk[c], b, g, ja), split[4], split[5], split[6], split[7])
                if empty:
                    for r in range(bq):
                        for d in range(Dk):
                            dq[b, h, i0 + r, d] = 0.0
        tiles[task, 0] = done
        tiles[task, 1] = skipped
