"""The NumPy reference of sparse attention: a per-query gather, chunked, ``O(Q x k)`` memory.

Owns the ``"numpy"`` backend of :mod:`refattn.sparse.engine`: for each batch row, query head
and chunk of query rows, the keys and values the rows list are gathered (``(rows, k, D)``,
the chunk sized so that this stays under :data:`CHUNK_BYTES`), the scores of the valid slots
computed and normalised (padding slots get probability 0; the sink joins the denominator),
and the output mixed. The backward recomputes the probabilities from ``lse`` and scatters the
key and value gradients with ``np.add.at`` (the reference: clear, not fast).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

__all__ = ["CHUNK_BYTES", "backward", "forward"]

#: the gathered operands of one chunk of query rows stay under this many bytes
CHUNK_BYTES = 1 << 25


def _chunks(q: np.ndarray, v: np.ndarray, idx: np.ndarray, index_head: np.ndarray,
            kv_head: np.ndarray) -> Iterator[tuple[int, int, int, slice, np.ndarray, np.ndarray]]:
    """``(b, h, kv head, rows, safe keys (c, k) int64, valid (c, k))`` for each batch row,
    query head and chunk of query rows (the gathered ``(c, k, D)`` under :data:`CHUNK_BYTES`);
    padding slots read key 0 and are masked by ``valid``."""
    B, Hq, Q, Dk = q.shape
    kk = idx.shape[3]
    step = max(1, CHUNK_BYTES // max(1, 8 * kk * max(Dk, v.shape[3])))
    for b in range(B):
        for h in range(Hq):
            ih, kh = int(index_head[h]), int(kv_head[h])
            for i0 in range(0, Q, step):
                sl = slice(i0, i0 + step)
                ids = idx[b, ih, sl].astype(np.int64)  # (c, k)
                valid = ids >= 0
                yield b, h, kh, sl, np.where(valid, ids, 0), valid


def forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, idx: np.ndarray,
            index_head: np.ndarray, kv_head: np.ndarray, scale: float,
            sink: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(output (B, Hq, Q, Dv), lse (B, Hq, Q), row_max (B, Hq, Q))``."""
    B, Hq, Q, _ = q.shape
    out = np.zeros((B, Hq, Q, v.shape[3]))
    lse = np.full((B, Hq, Q), -np.inf)
    row_max = np.full((B, Hq, Q), -np.inf)
    for b, h, kh, sl, safe, valid in _chunks(q, v, idx, index_head, kv_head):
        kg = k[b, kh][safe]  # (c, k, Dk)
        s = scale * np.einsum("cd,csd->cs", q[b, h, sl], kg)
        s = np.where(valid, s, -np.inf)
        m = s.max(axis=1) if idx.shape[3] else np.full(s.shape[0], -np.inf)
        if sink is not None:
            m = np.maximum(m, sink[h])
        live = np.isfinite(m)
        mm = np.where(live, m, 0.0)
        e = np.where(valid, np.exp(s - mm[:, None]), 0.0)
        denom = e.sum(axis=1)
        if sink is not None:
            denom = denom + np.exp(sink[h] - mm)
        safe_denom = np.where(live, denom, 1.0)
        p = e / safe_denom[:, None]
        out[b, h, sl] = np.einsum("cs,csd->cd", p, v[b, kh][safe])
        lse[b, h, sl] = np.where(live, mm + np.log(safe_denom), -np.inf)
        row_max[b, h, sl] = m
    return out, lse, row_max


def backward(q: np.ndarray, k: np.ndarray, v: np.ndarray, idx: np.ndarray,
             index_head: np.ndarray, kv_head: np.ndarray, scale: float,
             sink: np.ndarray | None, out: np.ndarray, lse: np.ndarray,
             grad_output: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """``(grad_q, grad_k, grad_v, grad_sink)``; ``D = rowsum(dO * O)``,
    ``dS = P (dO . v - D)``."""
    gq = np.zeros_like(q)
    gk = np.zeros(k.shape)
    gv = np.zeros(v.shape)
    dsum = np.einsum("bhqd,bhqd->bhq", grad_output, out)  # (B, Hq, Q)
    gsink = None if sink is None else np.zeros(q.shape[1])
    for b, h, kh, sl, safe, valid in _chunks(q, v, idx, index_head, kv_head):
        L = lse[b, h, sl]
        live = np.isfinite(L)
        kg, vg = k[b, kh][safe], v[b, kh][safe]
        s = scale * np.einsum("cd,csd->cs", q[b, h, sl], kg)
        p = np.where(valid & live[:, None], np.exp(s - np.where(live, L, 0.0)[:, None]), 0.0)
        dp = np.einsum("cd,csd->cs", grad_output[b, h, sl], vg)
        ds = p * (dp - dsum[b, h, sl][:, None])
        gq[b, h, sl] = scale * np.einsum("cs,csd->cd", ds, kg)
        rows = np.nonzero(valid)
        keys = safe[rows]
        np.add.at(gv[b, kh], keys, p[rows][:, None] * grad_output[b, h, sl][rows[0]])
        np.add.at(gk[b, kh], keys, scale * ds[rows][:, None] * q[b, h, sl][rows[0]])
        if gsink is not None and sink is not None:
            ps = np.where(live, np.exp(sink[h] - np.where(live, L, 0.0)), 0.0)
            gsink[h] -= float((ps * dsum[b, h, sl]).sum())
    return gq, gk, gv, gsink
