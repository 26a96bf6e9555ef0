"""numba kernels of sparse attention: query-major forward and dQ, key-major dK/dV.

Owns the ``"numba"`` backend's compiled loops. Every output element is written by one
iteration of a ``prange`` and summed in a fixed order, so the bits do not depend on the thread
count: the forward and ``dQ`` run one query row per iteration (slots in list order); ``dK`` and
``dV`` run one key per iteration over the transposed (CSR) lists, query heads in order and the
rows that read the key in increasing order, recomputing each probability from ``lse`` (nothing
of size ``Q x k`` is stored). :func:`transpose` builds those lists by a counting sort.

This module imports nothing from refattn (numba's own on-disk cache, keyed on this file's
source, is then exact: nothing is inlined from another file). Exempt from mypy like the
engine's kernels. ``fastmath`` allows reassociation, contraction, nsz and arcp only (no NaN/inf
assumptions: -inf marks padding and empty rows; no signed-zero or reciprocal rules matter here).
"""

import numpy as np
from numba import njit, prange

_FM = {"reassoc", "contract", "nsz", "arcp"}


@njit(cache=True, fastmath=_FM, inline="always")
def _dot(a, b):
    acc = 0.0
    for d in range(a.shape[0]):
        acc += a[d] * b[d]
    return acc


@njit(cache=True)
def transpose(idx, num_keys):
    """Key-major lists: ``ptr`` ((B * H_idx * K) + 1,) int64 (:func:`key_counts`) and ``rows``
    (nnz,) int32, the rows reading key j of (b, h) being ``rows[ptr[(b*H + h)*K + j] :
    ptr[... + 1]]``, increasing (:func:`fill_positions` without the slots)."""
    ptr = key_counts(idx, num_keys)
    rows = np.empty(ptr[-1], np.int32)
    fill_positions(idx, num_keys, ptr, rows, False)
    return ptr, rows


@njit(cache=True, parallel=True, fastmath=_FM)
def forward(q, k, v, idx, index_head, kv_head, scale, sink, has_sink, out, lse, row_max):
    """Fill ``out`` (B, Hq, Q, Dv), ``lse`` and ``row_max`` (B, Hq, Q), one row per task."""
    B, Hq, Q, _ = q.shape
    Dv = v.shape[3]
    kk = idx.shape[3]
    for r in prange(B * Hq * Q):
        b = r // (Hq * Q)
        h = (r // Q) % Hq
        i = r % Q
        ih = index_head[h]
        kh = kv_head[h]
        sc = np.empty(kk)
        m = -np.inf
        qi = q[b, h, i]
        for s in range(kk):
            j = idx[b, ih, i, s]
            if j >= 0:
                x = scale * _dot(qi, k[b, kh, j])
                sc[s] = x
                if x > m:
                    m = x
        if has_sink and sink[h] > m:
            m = sink[h]
        row_max[b, h, i] = m
        o = out[b, h, i]
        for d in range(Dv):
            o[d] = 0.0
        if m == -np.inf:
            lse[b, h, i] = -np.inf
            continue
        den = 0.0
        for s in range(kk):
            if idx[b, ih, i, s] >= 0:
                e = np.exp(sc[s] - m)
                sc[s] = e
                den += e
        if has_sink:
            den += np.exp(sink[h] - m)
        for s in range(kk):
            j = idx[b, ih, i, s]
            if j >= 0:
                p = sc[s] / den
                vj = v[b, kh, j]
                for d in range(Dv):
                    o[d] += p * vj[d]
        lse[b, h, i] = m + np.log(den)


@njit(cache=True, parallel=True, fastmath=_FM)
def backward_rows(q, k, v, idx, index_head, kv_head, scale, sink, has_sink, out, lse, grad_out,
                  grad_q, dsum, sink_term):
    """``grad_q``, ``dsum = rowsum(dO * O)`` and ``sink_term = -p_sink * dsum``, one query row
    per task."""
    B, Hq, Q, Dk = q.shape
    kk = idx.shape[3]
    for r in prange(B * Hq * Q):
        b = r // (Hq * Q)
        h = (r // Q) % Hq
        i = r % Q
        ih = index_head[h]
        kh = kv_head[h]
        go = grad_out[b, h, i]
        dd = _dot(go, out[b, h, i])
        dsum[b, h, i] = dd
        g = grad_q[b, h, i]
        for d in range(Dk):
            g[d] = 0.0
        L = lse[b, h, i]
        if L == -np.inf:
            sink_term[b, h, i] = 0.0
            continue
        sink_term[b, h, i] = -np.exp(sink[h] - L) * dd if has_sink else 0.0
        qi = q[b, h, i]
        for s in range(kk):
            j = idx[b, ih, i, s]
            if j >= 0:
                kj = k[b, kh, j]
                p = np.exp(scale * _dot(qi, kj) - L)
                ds = p * (_dot(go, v[b, kh, j]) - dd)
                for d in range(Dk):
                    g[d] += ds * kj[d]
        for d in range(Dk):
            g[d] *= scale


@njit(cache=True, parallel=True, fastmath=_FM)
def backward_keys(q, k, v, ptr, rows, num_index_heads, index_head, kv_head, scale, lse,
                  grad_out, dsum, grad_k, grad_v):
    """``grad_k`` and ``grad_v``, one key (of one kv head) per task: query heads in order,
    then the rows reading the key in increasing order."""
    B, Hq, _, Dk = q.shape
    Hkv, K, Dv = k.shape[1], k.shape[2], v.shape[3]
    H = num_index_heads
    for t in prange(B * Hkv * K):
        b = t // (Hkv * K)
        kh = (t // K) % Hkv
        j = t % K
        gk = grad_k[b, kh, j]
        gv = grad_v[b, kh, j]
        for d in range(Dk):
            gk[d] = 0.0
        for d in range(Dv):
            gv[d] = 0.0
        kj = k[b, kh, j]
        vj = v[b, kh, j]
        for h in range(Hq):
            if kv_head[h] != kh:
                continue
            ih = index_head[h]
            base = (b * H + ih) * K + j
            for e in range(ptr[base], ptr[base + 1]):
                i = rows[e]
                L = lse[b, h, i]
                if L == -np.inf:
                    continue
                qi = q[b, h, i]
                go = grad_out[b, h, i]
                p = np.exp(scale * _dot(qi, kj) - L)
                ds = p * (_dot(go, vj) - dsum[b, h, i])
                for d in range(Dv):
                    gv[d] += p * go[d]
                for d in range(Dk):
                    gk[d] += ds * qi[d]
        for d in range(Dk):
            gk[d] *= scale


@njit(cache=True)
def key_counts(idx, num_keys):
    """``ptr`` ((B * H_idx * K) + 1,) int64: the prefix sums of how many rows read each key of
    each (b, h)."""
    B, H, Q, kk = idx.shape
    K = num_keys
    ptr = np.zeros(B * H * K + 1, np.int64)
    for b in range(B):
        for h in range(H):
            base = (b * H + h) * K
            for i in range(Q):
                for s in range(kk):
                    j = idx[b, h, i, s]
                    if j >= 0:
                        ptr[base + j + 1] += 1
    for t in range(B * H * K):
        ptr[t + 1] += ptr[t]
    return ptr


@njit(cache=True)
def fill_positions(idx, num_keys, ptr, pos, slots=True):
    """Fill ``pos`` (nnz,) with ``i * k + slot`` (``slots``) or ``i`` of the rows reading key
    j of (b, h), at ``ptr[(b*H + h)*K + j] ...``, increasing in i (a counting sort)."""
    B, H, Q, kk = idx.shape
    K = num_keys
    fill = ptr[:-1].copy()
    for b in range(B):
        for h in range(H):
            base = (b * H + h) * K
            for i in range(Q):
                for s in range(kk):
                    j = idx[b, h, i, s]
                    if j >= 0:
                        pos[fill[base + j]] = i * kk + s if slots else i
                        fill[base + j] += 1


#: rows (keys) a task of the fused kernels walks in lockstep, slot chunk by slot chunk: the
#: keys (rows) neighbouring rows (keys) share are then read once per tile from the cache
TILE = 8
#: slots per lockstep step
SLOTS = 64
#: tasks are dealt to tiles by ``t * SPREAD mod ntiles`` (SPREAD prime: a permutation unless it
#: divides ntiles, then the identity): numba hands each thread a
#: contiguous range of tasks, and consecutive tiles have very different work (a causal key
#: range, say), so the tiles a thread gets are spread over the whole range
SPREAD = 1000003


@njit(cache=True, inline="always")
def _spread(t, ntiles):
    t = np.int64(t)
    n = np.int64(ntiles)
    if n % SPREAD == 0:
        return t
    return (t * SPREAD) % n


@njit(cache=True, parallel=True, fastmath=_FM)
def fused_rows(qh, kh, vh, idx_rows, i0, scale, sink_h, has_sink, goh, out, lse, row_max,
               dsum, grad_q, sink_term, P, DS):
    """Forward and the row half of the backward of rows ``i0 .. i0 + len(idx_rows)`` of one
    (batch, query head): ``qh`` (Q, Dk), ``kh`` (K, Dk), ``vh`` (K, Dv), ``goh`` (Q, Dv);
    the outputs are that head's (Q, ...) slices; ``P`` and ``DS`` (rows, k) receive each
    slot's probability and score gradient (0 on padding) for :func:`fused_keys`.

    One task per tile of :data:`TILE` rows, which it walks in lockstep :data:`SLOTS` slots at
    a time (sorted local lists make neighbouring rows read neighbouring keys). Each row's
    arithmetic is the same whatever the tile: the bits do not depend on the thread count."""
    n, kk = idx_rows.shape
    Dk = qh.shape[1]
    Dv = vh.shape[1]
    ntiles = (n + TILE - 1) // TILE
    for task in prange(ntiles):
        tile = _spread(task, ntiles)
        c0 = tile * TILE
        c1 = min(n, c0 + TILE)
        m = np.full(TILE, -np.inf)
        dp = np.empty((TILE, kk))
        # 1. scores and row maxima
        for s0 in range(0, kk, SLOTS):
            s1 = min(kk, s0 + SLOTS)
            for c in range(c0, c1):
                qi = qh[i0 + c]
                pr = P[c]
                mc = m[c - c0]
                for s in range(s0, s1):
                    j = idx_rows[c, s]
                    if j >= 0:
                        x = scale * _dot(qi, kh[j])
                        pr[s] = x
                        if x > mc:
                            mc = x
                    else:
                        pr[s] = 0.0
                m[c - c0] = mc
        # 2. softmax per row
        for c in range(c0, c1):
            i = i0 + c
            mc = m[c - c0]
            if has_sink and sink_h > mc:
                mc = sink_h
                m[c - c0] = mc
            row_max[i] = mc
            o = out[i]
            g = grad_q[i]
            for d in range(Dv):
                o[d] = 0.0
            for d in range(Dk):
                g[d] = 0.0
            pr = P[c]
            if mc == -np.inf:
                lse[i] = -np.inf
                for s in range(kk):
                    pr[s] = 0.0
                continue
            den = 0.0
            for s in range(kk):
                if idx_rows[c, s] >= 0:
                    e = np.exp(pr[s] - mc)
                    pr[s] = e
                    den += e
            if has_sink:
                den += np.exp(sink_h - mc)
            lse[i] = mc + np.log(den)
            for s in range(kk):
                pr[s] = pr[s] / den  # 0 stays 0 on padding
        # 3. output and dP = dO . v
        for s0 in range(0, kk, SLOTS):
            s1 = min(kk, s0 + SLOTS)
            for c in range(c0, c1):
                i = i0 + c
                if m[c - c0] == -np.inf:
                    continue
                o = out[i]
                go = goh[i]
                pr = P[c]
                for s in range(s0, s1):
                    j = idx_rows[c, s]
                    if j >= 0:
                        p = pr[s]
                        vj = vh[j]
                        for d in range(Dv):
                            o[d] += p * vj[d]
                        dp[c - c0, s] = _dot(go, vj)
        # 4. D = dO . O and the sink's term
        for c in range(c0, c1):
            i = i0 + c
            if m[c - c0] == -np.inf:
                dsum[i] = 0.0
                sink_term[i] = 0.0
                continue
            dd = _dot(goh[i], out[i])
            dsum[i] = dd
            sink_term[i] = -np.exp(sink_h - lse[i]) * dd if has_sink else 0.0
        # 5. dS = P (dP - D) and dQ
        for s0 in range(0, kk, SLOTS):
            s1 = min(kk, s0 + SLOTS)
            for c in range(c0, c1):
                i = i0 + c
                dsr = DS[c]
                if m[c - c0] == -np.inf:
                    for s in range(s0, s1):
                        dsr[s] = 0.0
                    continue
                g = grad_q[i]
                dd = dsum[i]
                pr = P[c]
                for s in range(s0, s1):
                    j = idx_rows[c, s]
                    if j >= 0:
                        ds = pr[s] * (dp[c - c0, s] - dd)
                        dsr[s] = ds
                        kj = kh[j]
                        for d in range(Dk):
                            g[d] += ds * kj[d]
                    else:
                        dsr[s] = 0.0
        for c in range(c0, c1):
            g = grad_q[i0 + c]
            for d in range(Dk):
                g[d] *= scale


@njit(cache=True, parallel=True, fastmath=_FM)
def fused_keys(qh, goh, ptr, pos, base, cursor, i0, n, kk, scale, P, DS, grad_k, grad_v):
    """Add rows ``i0 .. i0 + n`` of one query head into ``grad_k`` / ``grad_v`` (K, D) of its
    kv head: each key's positions from ``cursor[j]`` on while their row is below ``i0 + n``,
    in increasing rows (the same order on every thread count). One task per tile of
    :data:`TILE` keys, walked in lockstep :data:`SLOTS` positions at a time."""
    K = grad_k.shape[0]
    Dk = grad_k.shape[1]
    Dv = grad_v.shape[1]
    stop = (i0 + n) * kk
    ntiles = (K + TILE - 1) // TILE
    for task in prange(ntiles):
        tile = _spread(task, ntiles)
        j0 = tile * TILE
        j1 = min(K, j0 + TILE)
        ends = np.empty(TILE, np.int64)
        longest = 0
        for j in range(j0, j1):
            lo = cursor[j]
            hi = ptr[base + j + 1]
            e = lo + np.searchsorted(pos[lo:hi], stop)
            ends[j - j0] = e
            if e - lo > longest:
                longest = e - lo
        for r0 in range(0, longest, SLOTS):
            for j in range(j0, j1):
                gk = grad_k[j]
                gv = grad_v[j]
                e0 = cursor[j] + r0
                e1 = min(ends[j - j0], e0 + SLOTS)
                for e in range(e0, e1):
                    t = pos[e]
                    i = t // kk
                    c = i - i0
                    s = t - i * kk
                    p = P[c, s]
                    ds = DS[c, s] * scale
                    go = goh[i]
                    qi = qh[i]
                    for d in range(Dv):
                        gv[d] += p * go[d]
                    for d in range(Dk):
                        gk[d] += ds * qi[d]
        for j in range(j0, j1):
            cursor[j] = ends[j - j0]
