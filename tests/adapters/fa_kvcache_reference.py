"""FlashAttention's ``tests/test_flash_attn.py::test_flash_attn_kvcache`` reference, ported to
NumPy without refattn (Dao-AILab/flash-attention, commit 0251105a2fb1): ``rotate_half`` and
``apply_rotary_emb_torch`` with ``seqlen_offsets``, ``k_cache_ref`` with the appended rotated
keys, the arange / leftpad key padding mask, the ``cache_batch_idx`` gather, ``attention_ref``
with ``construct_local_mask``'s leftpad-relative columns and ALiBi; and the inputs of one
case of its matrix (shapes scaled down). ``bug`` plants the RoPE bugs that
refattn.adapters.rope_diagnosis names, for its tests.
"""

from __future__ import annotations

import math

import numpy as np


def rotate_half(x, interleaved):
    if not interleaved:
        x1, x2 = np.split(x, 2, axis=-1)
        return np.concatenate([-x2, x1], axis=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return np.stack([-x2, x1], axis=-1).reshape(x.shape)


def apply_rotary(x, cos, sin, offsets, interleaved):
    """apply_rotary_emb(x, cos, sin, seqlen_offsets=offsets): x (B, L, H, D)."""
    ro = cos.shape[-1] * 2
    out = x.copy()
    for b in range(x.shape[0]):
        c = cos[offsets[b]:offsets[b] + x.shape[1]]
        s = sin[offsets[b]:offsets[b] + x.shape[1]]
        rep = (lambda t: np.repeat(t, 2, axis=-1)) if interleaved else (
            lambda t: np.concatenate([t, t], axis=-1))
        c, s = rep(c)[:, None, :], rep(s)[:, None, :]
        xr = x[b, ..., :ro]
        out[b, ..., :ro] = xr * c + rotate_half(xr, interleaved) * s
    return out


def fa_reference(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens, leftpad, batch_idx,
                  block_table, causal, window, interleaved, alibi, bug=None):
    """FA's reference; ``bug``: None, "rope_layout", "rope_twice", "rope_q_missing" or
    "rope_leftpad" (the kernel bug it plants)."""
    B, Q, H, D = q.shape
    if bug == "rope_layout":
        interleaved = not interleaved
    offsets = cache_seqlens
    if bug == "rope_leftpad" and leftpad is not None:
        offsets = cache_seqlens - leftpad
    local = window != (-1, -1)
    new = 0 if k is None else k.shape[1]
    if cos is not None:
        if causal or local:
            q_ro = apply_rotary(q, cos, sin, offsets, interleaved)
        else:  # "b s h d -> b 1 (s h) d": every query token at position cache_seqlens
            q_ro = apply_rotary(q.reshape(B, 1, Q * H, D), cos, sin, offsets,
                                 interleaved).reshape(B, Q, H, D)
        k_ro = apply_rotary(k, cos, sin, offsets, interleaved)
        if bug == "rope_twice":
            k_ro = apply_rotary(k_ro, cos, sin, offsets, interleaved)
        if bug == "rope_q_missing":
            q_ro = q
    else:
        q_ro, k_ro = q, k
    if block_table is None:
        kc = (k_cache if batch_idx is None else k_cache[batch_idx]).copy()
        vc = (v_cache if batch_idx is None else v_cache[batch_idx]).copy()
    else:
        kc = k_cache[block_table.ravel()].reshape(B, -1, *k_cache.shape[2:]).copy()
        vc = v_cache[block_table.ravel()].reshape(B, -1, *v_cache.shape[2:]).copy()
    S = kc.shape[1]
    arange = np.arange(S)[None, :]
    cs = cache_seqlens[:, None]
    if new:
        update = (cs <= arange) & (arange < cs + new)
        kc[update] = k_ro.reshape(-1, *k_ro.shape[2:])
        vc[update] = v.reshape(-1, *v.shape[2:])
    kpm = arange < cs + new
    if leftpad is not None:
        kpm &= arange >= leftpad[:, None]
    Hkv = kc.shape[2]
    out = np.zeros((B, Q, H, v_cache.shape[3]))
    w = (window[0], 0) if causal else window
    for b in range(B):
        lp = 0 if leftpad is None else int(leftpad[b])
        sk = int(kpm[b].sum())
        for h in range(H):
            kh = h // (H // Hkv)
            for i in range(Q):
                s = (q_ro[b, i, h] / math.sqrt(D)) @ kc[b, :, kh].T  # (S,)
                keep = kpm[b].copy()
                if w[0] >= 0 or w[1] >= 0:  # construct_local_mask, leftpad-relative columns
                    col = np.where(arange[0] >= lp, arange[0] - lp, 2**32)
                    if w[0] < 0:
                        masked = col > i + sk - Q + w[1]
                    else:
                        masked = (col > min(i + sk - Q + w[1], sk)) | (col < i + sk - Q - w[0])
                    keep &= ~masked
                if alibi is not None:  # attn_bias_from_alibi_slopes with key_leftpad
                    col = np.where(arange[0] >= lp, arange[0] - lp, 2**32)
                    s = s - alibi[b, h] * np.abs(i + sk - Q - col)
                if not keep.any():
                    continue
                e = np.exp(s[keep] - s[keep].max())
                out[b, i, h] = e @ vc[b, keep, kh] / e.sum()
    return out, kc, vc


def fa_case(seqlen_q, d, has_batch_idx, has_leftpad, paged, rotary_fraction, interleaved,
          new_eq_q, causal, local, alibi, new_kv, mha, seed):
    """The inputs of one test_flash_attn_kvcache case (its shapes scaled down)."""
    rng = np.random.default_rng(seed)
    B, H, seqlen_k = 2, 6, 20
    Bc = B if not has_batch_idx else 2 * B
    rotary_dim = math.floor(int(rotary_fraction * d) / 16) * 16
    Hkv = {"mha": H, "mqa": 1, "gqa": 3}[mha]
    window = (-1, -1) if not local else tuple(int(x) for x in rng.integers(0, seqlen_k, 2))
    q = rng.standard_normal((B, seqlen_q, H, d))
    seqlen_new = seqlen_q if new_eq_q else int(rng.integers(1, seqlen_q + 1))
    k = v = None
    if new_kv:
        k = rng.standard_normal((B, seqlen_new, Hkv, d))
        v = rng.standard_normal((B, seqlen_new, Hkv, d))
    block_table = None
    if paged is None:
        k_cache = rng.standard_normal((Bc, seqlen_k, Hkv, d))
        v_cache = rng.standard_normal((Bc, seqlen_k, Hkv, d))
        table_rows = seqlen_k
    else:  # _generate_block_kvcache: a random permutation of 3x the blocks needed
        num_blocks = math.ceil(seqlen_k / paged) * B * 3
        k_cache = rng.standard_normal((num_blocks, paged, Hkv, d))
        v_cache = rng.standard_normal((num_blocks, paged, Hkv, d))
        block_table = rng.permutation(num_blocks).astype(np.int32).reshape(B, -1)
        table_rows = num_blocks * paged
    hi = ((seqlen_k - (seqlen_q if (causal or local) and rotary_dim > 1 else seqlen_new) + 1)
          if new_kv else seqlen_k + 1)
    cache_seqlens = rng.integers(0 if new_kv else 1, hi, B).astype(np.int32)
    leftpad = None
    if has_leftpad:
        leftpad = np.array([rng.integers(0, n) if n > 0 else 0 for n in cache_seqlens],
                           np.int32)
    batch_idx = rng.permutation(Bc)[:B].astype(np.int32) if has_batch_idx else None
    slopes = rng.random((B, H)).astype(np.float32) * 0.3 if alibi else None
    cos = sin = None
    if rotary_dim > 0:
        angle = rng.random((table_rows, rotary_dim // 2)) * 2 * math.pi
        cos, sin = np.cos(angle), np.sin(angle)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, rotary_cos=cos,
                rotary_sin=sin, cache_seqlens=cache_seqlens, cache_batch_idx=batch_idx,
                cache_leftpad=leftpad, block_table=block_table, causal=causal,
                window_size=window, rotary_interleaved=interleaved, alibi_slopes=slopes)
