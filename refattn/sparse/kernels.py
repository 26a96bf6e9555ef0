"""numba kernels of sparse attention: the separate forward and backward, and the fused path.

Owns the ``"numba"`` backend's compiled loops. Every output element is written by one
iteration of a ``prange`` and summed in a fixed order, so the bits do not depend on the thread
count.

- :func:`forward` and :func:`backward_rows` run one query row per iteration (slots in list
  order); :func:`backward_keys` one key per iteration over the transposed (CSR) lists of
  :func:`transpose`, query heads in order and the rows that read the key in increasing order,
  recomputing each probability from ``lse``.
- The fused path (``sparse_value_and_grad``) works on a window of rows at a time, their lists
  sorted (:func:`window_lists`) and cut into blocks of :data:`BLOCK_KEYS` keys. The row passes
  (:func:`block_scores`, :func:`block_softmax`, :func:`block_values`, :func:`block_grad_q`)
  walk key block by key block within a chunk of :data:`CHUNK_ROWS` rows, so a block's K or V
  rows are read from memory once per chunk and then from cache, not once per row that lists
  them; they keep each slot's P and dS. :func:`block_grad_kv` adds the window into dK and dV
  key by key over :func:`block_transpose`'s key-major positions. Each row's sums run in
  increasing key order and each key's in increasing row order, whatever the thread count.

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
    ptr[... + 1]]``, increasing (:func:`fill_rows`)."""
    ptr = key_counts(idx, num_keys)
    rows = np.empty(ptr[-1], np.int32)
    fill_rows(idx, num_keys, ptr, rows)
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
def fill_rows(idx, num_keys, ptr, rows):
    """Fill ``rows`` (nnz,) with the rows i reading key j of (b, h), at
    ``ptr[(b*H + h)*K + j] ...``, increasing in i (a counting sort)."""
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
                        rows[fill[base + j]] = i
                        fill[base + j] += 1


#: keys per block of the fused path: one block's K or V rows (128 KiB at D = 128) stay in the
#: core's L2 cache while a chunk of rows reads them, instead of each listed key being fetched
#: from memory once per row that lists it
BLOCK_KEYS = 128
#: rows per task of the fused path's row passes: their q (or O and dO, or dQ) rows stay in L2
#: across the key blocks, so each block is streamed from memory once per chunk of rows
CHUNK_ROWS = 128
#: key-block tasks are dealt by ``t * SPREAD mod ntasks`` (SPREAD prime: a permutation unless
#: it divides ntasks, then the identity): numba hands each thread a contiguous range of tasks,
#: and consecutive key blocks have very different work (the most recent keys are in every
#: causal row's list), so the blocks a thread gets are spread over the whole range
SPREAD = 1000003


@njit(cache=True, inline="always")
def _spread(t, ntiles):
    t = np.int64(t)
    n = np.int64(ntiles)
    if n % SPREAD == 0:
        return t
    return (t * SPREAD) % n


@njit(cache=True, parallel=True)
def window_lists(idx_rows, is_sorted, sidx, starts):
    """Sorted lists and block starts of a window of rows: ``sidx`` (n, k) int32 receives each
    row's valid keys in increasing order (-1 after them); ``starts`` (n, nb + 1) int32 the
    number of a row's keys below ``b * BLOCK_KEYS``, so block b's keys of row c are
    ``sidx[c, starts[c, b] : starts[c, b + 1]]``. ``is_sorted``: the lists are known sorted
    (no sort needed)."""
    n, kk = idx_rows.shape
    nb = starts.shape[1] - 1
    for c in prange(n):
        row = sidx[c]
        cnt = 0
        for s in range(kk):
            j = idx_rows[c, s]
            if j >= 0:
                row[cnt] = j
                cnt += 1
        if not is_sorted:
            row[:cnt] = np.sort(row[:cnt])
        for s in range(cnt, kk):
            row[s] = -1
        s = 0
        for b in range(nb + 1):
            lim = b * BLOCK_KEYS
            while s < cnt and row[s] < lim:
                s += 1
            starts[c, b] = s


@njit(cache=True, parallel=True, fastmath=_FM)
def block_scores(qh, kh, sidx, starts, i0, scale, P, m):
    """Scores ``P[c, s] = scale * q[i0 + c] . k[sidx[c, s]]`` and row maxima ``m`` (n,) of a
    window, key block by key block within each chunk of :data:`CHUNK_ROWS` rows."""
    n = sidx.shape[0]
    nb = starts.shape[1] - 1
    Dk = qh.shape[1]
    for task in prange((n + CHUNK_ROWS - 1) // CHUNK_ROWS):
        c0 = task * CHUNK_ROWS
        c1 = min(n, c0 + CHUNK_ROWS)
        for c in range(c0, c1):
            m[c] = -np.inf
        for b in range(nb):
            for c in range(c0, c1):
                s0 = starts[c, b]
                s1 = starts[c, b + 1]
                if s0 == s1:
                    continue
                qi = qh[i0 + c]
                pr = P[c]
                row = sidx[c]
                s = s0
                while s + 4 <= s1:  # four keys per pass over q: a quarter of its loads
                    k0, k1, k2, k3 = kh[row[s]], kh[row[s + 1]], kh[row[s + 2]], kh[row[s + 3]]
                    a0 = 0.0
                    a1 = 0.0
                    a2 = 0.0
                    a3 = 0.0
                    for d in range(Dk):
                        x = qi[d]
                        a0 += x * k0[d]
                        a1 += x * k1[d]
                        a2 += x * k2[d]
                        a3 += x * k3[d]
                    pr[s] = scale * a0
                    pr[s + 1] = scale * a1
                    pr[s + 2] = scale * a2
                    pr[s + 3] = scale * a3
                    s += 4
                for t in range(s, s1):
                    pr[t] = scale * _dot(qi, kh[row[t]])
                mc = m[c]
                for t in range(s0, s1):
                    if pr[t] > mc:
                        mc = pr[t]
                m[c] = mc


@njit(cache=True, parallel=True, fastmath=_FM)
def block_softmax(starts, i0, sink_h, has_sink, P, m, out, lse, row_max, grad_q):
    """Probabilities in ``P`` (in place), ``lse`` and ``row_max`` of a window's rows; their
    ``out`` and ``grad_q`` rows zeroed for the passes that add into them."""
    n = starts.shape[0]
    nb = starts.shape[1] - 1
    Dv = out.shape[1]
    Dk = grad_q.shape[1]
    for c in prange(n):
        i = i0 + c
        cnt = starts[c, nb]
        mc = m[c]
        if has_sink and sink_h > mc:
            mc = sink_h
        row_max[i] = mc
        o = out[i]
        g = grad_q[i]
        for d in range(Dv):
            o[d] = 0.0
        for d in range(Dk):
            g[d] = 0.0
        if mc == -np.inf:
            lse[i] = -np.inf
            continue
        pr = P[c]
        den = 0.0
        for s in range(cnt):
            e = np.exp(pr[s] - mc)
            pr[s] = e
            den += e
        if has_sink:
            den += np.exp(sink_h - mc)
        lse[i] = mc + np.log(den)
        for s in range(cnt):
            pr[s] = pr[s] / den


@njit(cache=True, parallel=True, fastmath=_FM)
def block_values(vh, goh, sidx, starts, i0, P, DP, out):
    """``out[i0 + c] += P v`` and ``DP[c, s] = dO[i0 + c] . v[sidx[c, s]]``, key block by key
    block within each chunk of rows."""
    n = sidx.shape[0]
    nb = starts.shape[1] - 1
    Dv = vh.shape[1]
    for task in prange((n + CHUNK_ROWS - 1) // CHUNK_ROWS):
        c0 = task * CHUNK_ROWS
        c1 = min(n, c0 + CHUNK_ROWS)
        for b in range(nb):
            for c in range(c0, c1):
                s0 = starts[c, b]
                s1 = starts[c, b + 1]
                if s0 == s1:
                    continue
                o = out[i0 + c]
                go = goh[i0 + c]
                pr = P[c]
                dp = DP[c]
                row = sidx[c]
                s = s0
                while s + 4 <= s1:  # four keys per pass over O and dO
                    v0, v1, v2, v3 = vh[row[s]], vh[row[s + 1]], vh[row[s + 2]], vh[row[s + 3]]
                    p0, p1, p2, p3 = pr[s], pr[s + 1], pr[s + 2], pr[s + 3]
                    a0 = 0.0
                    a1 = 0.0
                    a2 = 0.0
                    a3 = 0.0
                    for d in range(Dv):
                        x0, x1, x2, x3 = v0[d], v1[d], v2[d], v3[d]
                        o[d] += ((p0 * x0 + p1 * x1) + p2 * x2) + p3 * x3
                        y = go[d]
                        a0 += y * x0
                        a1 += y * x1
                        a2 += y * x2
                        a3 += y * x3
                    dp[s] = a0
                    dp[s + 1] = a1
                    dp[s + 2] = a2
                    dp[s + 3] = a3
                    s += 4
                for t in range(s, s1):
                    vj = vh[row[t]]
                    p = pr[t]
                    for d in range(Dv):
                        o[d] += p * vj[d]
                    dp[t] = _dot(go, vj)


@njit(cache=True, parallel=True, fastmath=_FM)
def block_grad_q(kh, goh, sidx, starts, i0, scale, sink_h, has_sink, P, DS, out, lse, dsum,
                 sink_term, grad_q):
    """``D = dO . O``, the sink's term, ``dS = P (dP - D)`` (in ``DS``, which holds dP on
    entry) and ``grad_q``, key block by key block within each chunk of rows."""
    n = sidx.shape[0]
    nb = starts.shape[1] - 1
    Dk = kh.shape[1]
    for task in prange((n + CHUNK_ROWS - 1) // CHUNK_ROWS):
        c0 = task * CHUNK_ROWS
        c1 = min(n, c0 + CHUNK_ROWS)
        for c in range(c0, c1):
            i = i0 + c
            if lse[i] == -np.inf:
                dsum[i] = 0.0
                sink_term[i] = 0.0
                continue
            dd = _dot(goh[i], out[i])
            dsum[i] = dd
            sink_term[i] = -np.exp(sink_h - lse[i]) * dd if has_sink else 0.0
        for b in range(nb):
            for c in range(c0, c1):
                s0 = starts[c, b]
                s1 = starts[c, b + 1]
                if s0 == s1:
                    continue
                g = grad_q[i0 + c]
                dd = dsum[i0 + c]
                pr = P[c]
                dsr = DS[c]
                row = sidx[c]
                for t in range(s0, s1):
                    dsr[t] = pr[t] * (dsr[t] - dd)
                s = s0
                while s + 4 <= s1:  # four keys per pass over dQ
                    k0, k1, k2, k3 = kh[row[s]], kh[row[s + 1]], kh[row[s + 2]], kh[row[s + 3]]
                    e0, e1, e2, e3 = dsr[s], dsr[s + 1], dsr[s + 2], dsr[s + 3]
                    for d in range(Dk):
                        g[d] += ((e0 * k0[d] + e1 * k1[d]) + e2 * k2[d]) + e3 * k3[d]
                    s += 4
                for t in range(s, s1):
                    kj = kh[row[t]]
                    e = dsr[t]
                    for d in range(Dk):
                        g[d] += e * kj[d]
        for c in range(c0, c1):
            g = grad_q[i0 + c]
            for d in range(Dk):
                g[d] *= scale


@njit(cache=True, parallel=True)
def block_transpose(sidx, starts, tptr, tpos):
    """Key-major positions of a window: ``tpos[tptr[j] : tptr[j + 1]]`` are ``c * k + s`` of
    the window's slots that list key j, in increasing rows c (``tptr`` (K + 1,) int64,
    ``tpos`` (n * k,) int64). One task per key block: a counting sort within the block."""
    n, kk = sidx.shape
    nb = starts.shape[1] - 1
    K = tptr.shape[0] - 1
    tot = np.zeros(nb + 1, np.int64)
    for b in prange(nb):
        acc = 0
        for c in range(n):
            acc += starts[c, b + 1] - starts[c, b]
        tot[b + 1] = acc
    for b in range(nb):
        tot[b + 1] += tot[b]
    tptr[K] = tot[nb]
    for b in prange(nb):
        j0 = b * BLOCK_KEYS
        j1 = min(K, j0 + BLOCK_KEYS)
        fill = np.zeros(BLOCK_KEYS, np.int64)
        for c in range(n):
            for s in range(starts[c, b], starts[c, b + 1]):
                fill[sidx[c, s] - j0] += 1
        at = tot[b]
        for j in range(j0, j1):
            cnt = fill[j - j0]
            tptr[j] = at
            fill[j - j0] = at
            at += cnt
        for c in range(n):
            for s in range(starts[c, b], starts[c, b + 1]):
                t = sidx[c, s] - j0
                tpos[fill[t]] = c * kk + s
                fill[t] += 1


@njit(cache=True, parallel=True, fastmath=_FM)
def block_grad_kv(qh, goh, tptr, tpos, i0, kk, scale, P, DS, grad_k, grad_v):
    """Add a window's rows into ``grad_k`` / ``grad_v`` (K, D) of their kv head: one task per
    key block (dealt by :func:`_spread`), each key's rows in increasing order from the
    :func:`block_transpose` positions (the same order on every thread count). A key's P and
    dS are gathered first (independent loads), then four rows per pass over its gradient
    rows."""
    K, Dk = grad_k.shape
    Dv = grad_v.shape[1]
    n = P.shape[0]
    nb = (K + BLOCK_KEYS - 1) // BLOCK_KEYS
    Pf = P.reshape(-1)
    Sf = DS.reshape(-1)
    for task in prange(nb):
        b = _spread(task, nb)
        pt = np.empty(n)
        xt = np.empty(n)
        rt = np.empty(n, np.int64)
        for j in range(b * BLOCK_KEYS, min(K, (b + 1) * BLOCK_KEYS)):
            e0 = tptr[j]
            m = tptr[j + 1] - e0
            if m == 0:
                continue
            for e in range(m):
                t = tpos[e0 + e]
                pt[e] = Pf[t]
                xt[e] = Sf[t] * scale
                rt[e] = i0 + t // kk
            gv = grad_v[j]
            gk = grad_k[j]
            e = 0
            while e + 4 <= m:
                r0, r1, r2, r3 = rt[e], rt[e + 1], rt[e + 2], rt[e + 3]
                p0, p1, p2, p3 = pt[e], pt[e + 1], pt[e + 2], pt[e + 3]
                y0, y1, y2, y3 = goh[r0], goh[r1], goh[r2], goh[r3]
                for d in range(Dv):
                    gv[d] += ((p0 * y0[d] + p1 * y1[d]) + p2 * y2[d]) + p3 * y3[d]
                x0, x1, x2, x3 = xt[e], xt[e + 1], xt[e + 2], xt[e + 3]
                y0, y1, y2, y3 = qh[r0], qh[r1], qh[r2], qh[r3]
                for d in range(Dk):
                    gk[d] += ((x0 * y0[d] + x1 * y1[d]) + x2 * y2[d]) + x3 * y3[d]
                e += 4
            for f in range(e, m):
                p = pt[f]
                x = xt[f]
                y = goh[rt[f]]
                for d in range(Dv):
                    gv[d] += p * y[d]
                y = qh[rt[f]]
                for d in range(Dk):
                    gk[d] += x * y[d]
