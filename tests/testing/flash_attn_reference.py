"""FlashAttention's documented interface, written from its docstrings in NumPy float64,
independently of refattn (Dao-AILab/flash-attention, flash_attn/flash_attn_interface.py,
FlashAttention 2): ``flash_attn_func``, ``flash_attn_varlen_func`` and
``flash_attn_with_kvcache`` with their signatures, the (batch, seqlen, nheads, headdim) layout
(a paged cache: k_cache ``(num_blocks, page_block_size, nheads_k, headdim)`` read through
``block_table`` ``(batch_size, max_num_blocks_per_seq)`` int32, the sequence's blocks end to
end), GQA "head 0, 1, 2 of Q will attention to head 0 of K, V", the causal mask "aligned to the
bottom right corner", ``window_size`` keeping keys in "[i + seqlen_k - seqlen_q -
window_size[0], i + seqlen_k - seqlen_q + window_size[1]] inclusive", ALiBi "(-alibi_slope * |i
+ seqlen_k - seqlen_q - j|)", softcap on the scaled score (``softcap * tanh(score / softcap)``,
the kernel's order: scale, softcap, ALiBi, mask), "If the row of the mask is all zero, the
output will be zero", ``softmax_lse`` the logsumexp of each row (+inf for an empty row, as the
kernel writes it). ``dout=`` (not part of the interface) returns the gradients of ``sum(dout *
out)`` with respect to q, k, v as well, by the textbook backward.
"""

from __future__ import annotations

import numpy as np


def _one(q, k, v, scale, causal, window, softcap, slopes, dout):
    """One sequence: q (Lq, H, D), k, v (Lk, Hk, D); slopes (H,) or None."""
    Lq, H, D = q.shape
    Lk, Hk, _ = k.shape
    g = H // Hk
    kh, vh = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # head h reads kv head h // g
    i = np.arange(Lq)[:, None]
    j = np.arange(Lk)[None, :]
    diag = i + Lk - Lq
    left, right = window
    if causal:
        right = 0
    keep = np.ones((Lq, Lk), bool)
    if left >= 0:
        keep &= j >= diag - left
    if right >= 0:
        keep &= j <= diag + right
    raw = scale * np.einsum("qhd,khd->hqk", q, kh)  # (H, Lq, Lk)
    t = np.tanh(raw / softcap) if softcap > 0 else None
    s = softcap * t if softcap > 0 else raw
    if slopes is not None:
        s = s - slopes[:, None, None] * np.abs(diag - j)[None]
    s = np.where(keep[None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    empty = ~keep.any(axis=-1)[None, :, None]  # (1, Lq, 1)
    m = np.where(empty, 0.0, m)
    e = np.where(keep[None], np.exp(s - m), 0.0)
    den = e.sum(axis=-1, keepdims=True)
    p = np.where(empty, 0.0, e / np.where(empty, 1.0, den))
    out = np.einsum("hqk,khd->qhd", p, vh)
    lse = np.where(empty[..., 0], np.inf, (m + np.log(np.where(empty, 1.0, den)))[..., 0])
    if dout is None:
        return out, lse, None
    dp = np.einsum("qhd,khd->hqk", dout, vh)
    ds = p * (dp - np.einsum("qhd,qhd->hq", dout, out)[..., None])
    if softcap > 0:
        ds = ds * (1 - t**2)
    dq = scale * np.einsum("hqk,khd->qhd", ds, kh)
    dk = scale * np.einsum("hqk,qhd->khd", ds, q).reshape(Lk, Hk, g, D).sum(2)
    dv = np.einsum("hqk,qhd->khd", p, dout).reshape(Lk, Hk, g, D).sum(2)
    return out, lse, (dq, dk, dv)


def _slopes(alibi_slopes, b):
    if alibi_slopes is None:
        return None
    a = np.asarray(alibi_slopes, np.float64)
    return a if a.ndim == 1 else a[b]


def _scale(softmax_scale, q):
    return q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, dout=None):
    assert dropout_p == 0.0
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    res = [_one(q[b], k[b], v[b], _scale(softmax_scale, q), causal, window_size, softcap,
                _slopes(alibi_slopes, b), None if dout is None else dout[b])
           for b in range(q.shape[0])]
    out = np.stack([r[0] for r in res])
    lse = np.stack([r[1] for r in res])  # (batch, nheads, seqlen)
    grads = None if dout is None else tuple(np.stack([r[2][n] for r in res]) for n in range(3))
    result = (out, lse, None) if return_attn_probs else out
    return result if dout is None else (result, grads)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *,
                           dout=None):
    assert dropout_p == 0.0 and block_table is None
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    cq, ck = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k)
    assert np.diff(cq).max() <= max_seqlen_q and np.diff(ck).max() <= max_seqlen_k
    out = np.zeros((*q.shape[:2], v.shape[-1]))
    lse = np.zeros((q.shape[1], q.shape[0]))  # (nheads, total_q)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for b in range(len(cq) - 1):
        sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        o, s, g = _one(q[sq], k[sk], v[sk], _scale(softmax_scale, q), causal, window_size,
                       softcap, _slopes(alibi_slopes, b), None if dout is None else dout[sq])
        out[sq], lse[:, sq] = o, s
        if g is not None:
            dq[sq], dk[sk], dv[sk] = g
    result = (out, lse, None) if return_attn_probs else out
    return result if dout is None else (result, (dq, dk, dv))


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    assert k is None and v is None and rotary_cos is None
    assert cache_leftpad is None
    q = np.asarray(q, np.float64)
    kc, vc = np.asarray(k_cache, np.float64), np.asarray(v_cache, np.float64)
    B = q.shape[0]
    if block_table is None:  # k_cache (batch_size_cache, seqlen_cache, nheads_k, headdim)
        idx = np.arange(B) if cache_batch_idx is None else np.asarray(cache_batch_idx)
        capacity = kc.shape[1]

        def cache(x, b, n):
            return x[idx[b], :n]
    else:  # k_cache (num_blocks, page_block_size, nheads_k, headdim), "if there's a block_table"
        assert cache_batch_idx is None
        table = np.asarray(block_table)
        assert table.dtype == np.int32 and table.shape[0] == B
        page = kc.shape[1]
        capacity = table.shape[1] * page

        def cache(x, b, n):  # the sequence's blocks, laid end to end, cut at its length
            blocks = table[b, :(n + page - 1) // page]
            assert ((blocks >= 0) & (blocks < x.shape[0])).all()
            return np.concatenate([x[blk] for blk in blocks])[:n]
    lens = (np.full(B, capacity) if cache_seqlens is None else
            np.broadcast_to(np.asarray(cache_seqlens), (B,)))
    res = [_one(q[b], cache(kc, b, lens[b]), cache(vc, b, lens[b]), _scale(softmax_scale, q),
                causal, window_size, softcap, _slopes(alibi_slopes, b), None)
           for b in range(B)]
    out = np.stack([r[0] for r in res])
    lse = np.stack([r[1] for r in res])
    return (out, lse) if return_softmax_lse else out
