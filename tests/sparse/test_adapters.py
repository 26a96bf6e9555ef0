"""The FlashMLA and FlashInfer lowerings against plain loops written from the sources.

``flashmla_loop`` follows deepseek-ai/FlashMLA ``tests/ref.py::ref_sparse_attn_fwd`` (commit
a123d0b0191e0da7aa1e044f8644e0989cc63220): slots past ``topk_length`` and indices < 0 or >= s_kv
invalid, ``P = scale * q . kv`` with -inf on invalid slots, ``lse = logsumexp(P)``,
``max_logits = max(P)``, the output ``exp(P - logaddexp(lse, attn_sink)) @ kv[:, :d_v]`` (0
where that is -inf), lse +inf on a row with no valid slot. ``bsr_loop`` builds the dense mask of
SciPy's BSR definition (flashinfer ``BlockSparseAttentionWrapper`` docstring) and runs a softmax
per row; its lse is base 2 (``log2``), FlashInfer's convention.
"""

from __future__ import annotations

import numpy as np
import pytest

from refattn.adapters.sparse import (
    block_sparse_attention,
    blocks_from_bsr,
    bsr_from_blocks,
    flash_mla_sparse_fwd,
)
from refattn.errors import RefAttnError
from refattn.sparse import block_visibility

TOL = 1e-12


def flashmla_loop(q, kv, indices, sm_scale, d_v, attn_sink=None, topk_length=None):
    s_q, h_q, _ = q.shape
    s_kv, h_kv, _ = kv.shape
    topk = indices.shape[2]
    out = np.zeros((s_q, h_q, d_v))
    max_logits = np.full((s_q, h_q), -np.inf)
    lse = np.full((s_q, h_q), np.inf)
    for i in range(s_q):
        for h in range(h_q):
            g = h // (h_q // h_kv)
            n = topk if topk_length is None else int(topk_length[i])
            keys = [int(j) for j in indices[i, g, :n] if 0 <= j < s_kv]
            if not keys:
                continue
            P = np.array([sm_scale * float(q[i, h] @ kv[j, g]) for j in keys])
            lse[i, h] = np.log(np.sum(np.exp(P - P.max()))) + P.max()
            max_logits[i, h] = P.max()
            lse_o = lse[i, h] if attn_sink is None else np.logaddexp(lse[i, h], attn_sink[h])
            if lse_o == np.inf:
                continue
            out[i, h] = np.exp(P - lse_o) @ kv[keys, g, :d_v]
    return out, max_logits, lse


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("h_kv", [1, 2])
@pytest.mark.parametrize("extras", ["none", "sink", "sink_inf", "topk_length"])
def test_flash_mla_sparse_fwd_matches_reference(backend, h_kv, extras):
    rng = np.random.default_rng(h_kv)
    s_q, h_q, s_kv, d_qk, d_v, topk = 6, 4, 10, 12, 8, 5
    q = rng.standard_normal((s_q, h_q, d_qk))
    kv = rng.standard_normal((s_kv, h_kv, d_qk))
    idx = np.full((s_q, h_kv, topk), -1, np.int32)
    for i in range(s_q - 1):  # the last row stays empty ("lonely")
        for g in range(h_kv):
            n = int(rng.integers(1, topk + 1))
            idx[i, g, :n] = rng.choice(s_kv, n, replace=False)
    sink = tl = None
    if extras == "sink":
        sink = rng.standard_normal(h_q)
    if extras == "sink_inf":
        sink = np.array([np.inf, -np.inf, 0.5, -np.inf])
    if extras == "topk_length":
        tl = rng.integers(0, topk + 1, s_q).astype(np.int32)
    got = flash_mla_sparse_fwd(q, kv, idx, 0.2, d_v, sink, tl, backend=backend)
    want = flashmla_loop(q, kv, idx, 0.2, d_v, sink, tl)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=TOL, rtol=0)
    assert got[2][-1].tolist() == [np.inf] * h_q and (got[0][-1] == 0).all()


def test_flash_mla_out_of_range_padding_and_refusals():
    rng = np.random.default_rng(0)
    q, kv = rng.standard_normal((2, 2, 4)), rng.standard_normal((3, 1, 4))
    idx = np.array([[[0, 5]], [[2, -1]]], np.int32)
    with pytest.raises(RefAttnError, match=r"indices: entry \(b=0, h=0, i=0, slot=1\) is 5"):
        flash_mla_sparse_fwd(q, kv, idx, 0.5, 4)
    got = flash_mla_sparse_fwd(q, kv, idx, 0.5, 4, out_of_range="pad")
    for g, w in zip(got, flashmla_loop(q, kv, idx, 0.5, 4), strict=True):
        np.testing.assert_allclose(g, w, atol=TOL, rtol=0)
    with pytest.raises(RefAttnError, match="indices: expected dtype int32, got int64"):
        flash_mla_sparse_fwd(q, kv, idx.astype(np.int64), 0.5, 4)
    with pytest.raises(RefAttnError, match="indexer_topk: 512 is not emulated"):
        flash_mla_sparse_fwd(q, kv, idx, 0.5, 4, indexer_topk=512, out_of_range="pad")
    with pytest.raises(RefAttnError, match=r"topk_length: entry i=1 is 3, expected a value in "
                                           r"\[0, 2\]"):
        flash_mla_sparse_fwd(q, kv, idx, 0.5, 4, topk_length=np.array([1, 3], np.int32),
                             out_of_range="pad")
    with pytest.raises(RefAttnError, match="d_v"):
        flash_mla_sparse_fwd(q, kv, idx, 0.5, 5, out_of_range="pad")
    with pytest.raises(RefAttnError, match="attn_sink: entry 0 is NaN"):
        flash_mla_sparse_fwd(q, kv, idx, 0.5, 4, np.array([np.nan, 0.0]), out_of_range="pad")


def bsr_loop(q, k, v, indptr, indices, R, C, scale):
    M, Hq, _ = q.shape
    N, Hkv, _ = k.shape
    mask = np.zeros((M, N), bool)
    for r in range(len(indptr) - 1):
        for c in indices[indptr[r]:indptr[r + 1]]:
            mask[r * R:(r + 1) * R, c * C:(c + 1) * C] = True
    o = np.zeros((M, Hq, v.shape[2]))
    lse2 = np.full((M, Hq), -np.inf)
    for i in range(M):
        for h in range(Hq):
            g = h // (Hq // Hkv)
            keys = np.flatnonzero(mask[i])
            if keys.size == 0:
                continue
            s = scale * (k[keys, g] @ q[i, h])
            p = np.exp(s - s.max())
            o[i, h] = p / p.sum() @ v[keys, g]
            lse2[i, h] = (s.max() + np.log(p.sum())) / np.log(2)
    return o, lse2


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("R, C", [(1, 1), (2, 3), (4, 2)])
def test_block_sparse_attention_matches_bsr_loop(backend, R, C):
    rng = np.random.default_rng(R * 10 + C)
    M, N, Hq, Hkv = 9, 11, 4, 2
    MB, NB = -(-M // R), -(-N // C)
    rows = [np.sort(rng.choice(NB, int(rng.integers(0, NB + 1)), replace=False))
            for _ in range(MB)]
    indptr = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int32)
    indices = np.concatenate(rows).astype(np.int32)
    q, k, v = (rng.standard_normal(s) for s in ((M, Hq, 6), (N, Hkv, 6), (N, Hkv, 5)))
    o, lse = block_sparse_attention(q, k, v, indptr, indices, R, C, return_lse=True,
                                    backend=backend)
    wo, wl = bsr_loop(q, k, v, indptr, indices, R, C, 6 ** -0.5)
    np.testing.assert_allclose(o, wo, atol=TOL, rtol=0)
    np.testing.assert_allclose(lse, wl, atol=TOL, rtol=0)
    _, ln = block_sparse_attention(q, k, v, indptr, indices, R, C, return_lse=True,
                                   lse_base="ln")
    np.testing.assert_allclose(ln, wl * np.log(2), atol=TOL, rtol=0)


def test_bsr_round_trip_and_refusals():
    blocks = np.array([[[[2, 0], [-1, -1], [1, -1]]]])
    vis = block_visibility(blocks, block_q=2, block_k=3, num_queries=5, num_keys=8)
    indptr, indices, R, C = bsr_from_blocks(vis)
    assert indptr.tolist() == [0, 2, 2, 3] and indices.tolist() == [2, 0, 1] and (R, C) == (2, 3)
    back = blocks_from_bsr(indptr, indices, 5, 8, R, C)
    assert (back.indices == vis.indices).all()
    with pytest.raises(RefAttnError, match=r"indices: entry n=1 is 3, expected a key-block index "
                                           r"in \[0, 3\)"):
        blocks_from_bsr(np.array([0, 2]), np.array([0, 3]), 2, 8, 2, 3)
    with pytest.raises(RefAttnError, match=r"holds key 1 twice"):
        blocks_from_bsr(np.array([0, 2]), np.array([1, 1]), 2, 8, 2, 3)
    with pytest.raises(RefAttnError, match=r"indptr: expected shape \[3\]"):
        blocks_from_bsr(np.array([0, 2]), np.array([0, 1]), 3, 8, 2, 3)
    with pytest.raises(RefAttnError, match="non-decreasing"):
        blocks_from_bsr(np.array([0, 2, 1]), np.array([0, 1]), 3, 8, 2, 3)
    with pytest.raises(RefAttnError, match="more than max_blocks=1"):
        blocks_from_bsr(np.array([0, 2]), np.array([0, 1]), 2, 8, 2, 3, max_blocks=1)
    with pytest.raises(RefAttnError, match="one pattern for every head"):
        bsr_from_blocks(block_visibility(np.zeros((1, 2, 1, 1), np.int64), block_q=2,
                                         block_k=2, num_queries=2, num_keys=2))
