"""Lowerings of sparse attention to FlashMLA's sparse interface and FlashInfer's BSR layout.

Owns three float64 NumPy entry points with the sources' signatures and return conventions (no
torch, no flash_mla or flashinfer import), each running :mod:`refattn.sparse`'s engine:

- :func:`flash_mla_sparse_fwd`: deepseek-ai/FlashMLA ``flash_mla/flash_mla_interface.py::
  flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None,
  indexer_topk=0)`` (commit 02fe0d02e83f15ae5a049cc4acc009a50553e64c) with the semantics of its
  test reference ``tests/ref.py::ref_sparse_attn_fwd`` (commit
  a123d0b0191e0da7aa1e044f8644e0989cc63220): q ``[s_q, h_q, d_qk]``, kv ``[s_kv, h_kv, d_qk]``
  (keys; its first ``d_v`` columns are the values), indices ``[s_q, h_kv, topk]`` int32 with -1
  invalid, ``topk_length[i]`` keeping only the leftmost slots; returns ``(out [s_q, h_q, d_v],
  max_logits [s_q, h_q], lse [s_q, h_q])`` with lse in natural log (``torch.logsumexp``), a row
  with no valid index giving out 0, max_logits -inf and lse **+inf**; ``attn_sink[h]``
  multiplies the output by ``exp(lse) / (exp(lse) + exp(attn_sink))`` and leaves lse and
  max_logits alone (+inf zeroes the output, -inf has no effect).
- :func:`bsr_from_blocks` / :func:`blocks_from_bsr`: refattn's key-block lists <-> FlashInfer's
  block-sparse row layout (flashinfer-ai/flashinfer ``flashinfer/sparse.py::
  BlockSparseAttentionWrapper.plan(indptr, indices, M, N, R, C, num_qo_heads, num_kv_heads,
  head_dim, mask=None, ...)``, commit 0090a5f832577b0ddf97c3e0c687cd814a56c556: ``indptr``
  ``(MB + 1,)``, ``indices`` ``(nnz,)`` block columns, ``MB = ceil(M / R)``, one pattern for
  every head, SciPy's ``bsr_matrix`` definition).
- :func:`block_sparse_attention`: ``plan`` + ``run`` in FlashInfer's NHD layout: q ``(M, Hq,
  D)``, k ``(N, Hkv, D)``, v ``(N, Hkv, Dv)`` -> o ``(M, Hq, Dv)`` and, with
  ``return_lse=True``, lse ``(M, Hq)`` in **base 2** by default (FlashInfer's prefill kernels
  return ``log2`` sums: flashinfer-ai/flashinfer issue #2113, PR #5257's ``lse_base``).

Duplicates (a key twice in a row, a block twice in a BSR row) are refused: FlashMLA's reference
would gather and count a repeated index twice, SciPy's BSR would sum the two blocks; no
attention mask can express either. Every index is bounded before anything proportional to a
claimed size is allocated.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from refattn._boundary import public
from refattn._checks import as_array, bounded_int, check_float64, float64_input, index_array
from refattn.errors import RefAttnError
from refattn.sparse import (
    IndexVisibility,
    SparseCall,
    block_visibility,
    index_visibility,
    sparse_forward,
)
from refattn.sparse.lists import MAX_KEYS

__all__ = ["block_sparse_attention", "blocks_from_bsr", "bsr_from_blocks",
           "flash_mla_sparse_fwd"]

Backend = Literal["numpy", "numba"]


def _int_dtype(name: str, x: object, dtype: type, ndim: int) -> np.ndarray:
    arr = as_array(name, x)
    if arr.dtype != np.dtype(dtype):
        raise RefAttnError(f"{name}: expected dtype {np.dtype(dtype)}, got {arr.dtype}")
    if arr.ndim != ndim:
        raise RefAttnError(f"{name}: expected {ndim} axes, got shape {list(arr.shape)}")
    return arr


@public
def flash_mla_sparse_fwd(q: np.ndarray, kv: np.ndarray, indices: np.ndarray, sm_scale: float,
                         d_v: int = 512, attn_sink: np.ndarray | None = None,
                         topk_length: np.ndarray | None = None, indexer_topk: int = 0, *,
                         out_of_range: Literal["refuse", "pad"] = "refuse",
                         backend: Backend = "numpy",
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashMLA's sparse prefill forward in float64.

    Parameters
    ----------
    q : (s_q, h_q, d_qk) float64 ndarray
    kv : (s_kv, h_kv, d_qk) float64 ndarray
        Keys; ``kv[..., :d_v]`` are the values (MLA's latent cache).
    indices : (s_q, h_kv, topk) int32 ndarray
        Key indices per query and kv head; -1 invalid. FlashMLA also treats entries ``>= s_kv``
        as invalid: ``out_of_range="pad"`` does too, the default refuses them.
    sm_scale : float
    d_v : int
        Value width, at most ``d_qk`` (FlashMLA's kernel: 512 only; any here).
    attn_sink : (h_q,) float64 ndarray, optional
        May hold +-inf (FlashMLA's rules above).
    topk_length : (s_q,) int32 ndarray, optional
        Query i reads only ``indices[i, :, :topk_length[i]]``.
    indexer_topk : int
        0 only (the indexer's separate lse is not emulated).
    out_of_range : {"refuse", "pad"}
    backend : {"numpy", "numba"}

    Returns
    -------
    out : (s_q, h_q, d_v) ndarray
    max_logits : (s_q, h_q) ndarray
    lse : (s_q, h_q) ndarray
        Natural log; +inf on a row with no valid index.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> q, kv = rng.standard_normal((2, 2, 8)), rng.standard_normal((3, 1, 8))
    >>> idx = np.array([[[0, 2]], [[-1, -1]]], np.int32)
    >>> out, m, lse = flash_mla_sparse_fwd(q, kv, idx, 0.25, d_v=4)
    >>> out.shape, float(lse[1, 0]), float(m[1, 0]), out[1].tolist()
    ((2, 2, 4), inf, -inf, [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    """
    qq = float64_input("q", q, 3)
    kvv = float64_input("kv", kv, 3)
    s_q, h_q, d_qk = qq.shape
    s_kv, h_kv, d_kv = kvv.shape
    if d_kv != d_qk:
        raise RefAttnError(f"kv: feature axis is {d_kv}, expected q's d_qk={d_qk}")
    if h_kv < 1 or h_q % h_kv:
        raise RefAttnError(f"kv: h_kv={h_kv} must divide q's h_q={h_q}")
    dv = bounded_int("d_v", d_v, lo=1, hi=d_qk)
    if bounded_int("indexer_topk", indexer_topk, lo=0, hi=MAX_KEYS) != 0:
        raise RefAttnError(f"indexer_topk: {indexer_topk} is not emulated (only 0: FlashMLA's "
                           "lse_indexer over the first indexer_topk entries is not computed)")
    idx = _int_dtype("indices", indices, np.int32, 3)
    if idx.shape[:2] != (s_q, h_kv):
        raise RefAttnError(f"indices: expected shape [{s_q}, {h_kv}, topk] (s_q, h_kv, topk), "
                           f"got {list(idx.shape)}")
    own = np.array(idx, dtype=np.int32, copy=True)
    if out_of_range == "pad":
        own[own >= s_kv] = -1
    if topk_length is not None:
        tl = _int_dtype("topk_length", topk_length, np.int32, 1)
        if tl.shape != (s_q,):
            raise RefAttnError(f"topk_length: expected shape [{s_q}] (s_q), got "
                               f"{list(tl.shape)}")
        tl = index_array("topk_length", tl, lo=0, hi=idx.shape[2], letters="i")
        cut = np.arange(idx.shape[2])[None, None, :] >= tl[:, None, None]  # (s_q, 1, topk)
        own[np.broadcast_to(cut, own.shape)] = -1
    vis = index_visibility(own.transpose(1, 0, 2)[None], s_kv)
    sink = None
    if attn_sink is not None:
        sink = as_array("attn_sink", attn_sink)  # +-inf allowed (FlashMLA's rules), NaN not
        check_float64("attn_sink", sink)
        if sink.shape != (h_q,):
            raise RefAttnError(f"attn_sink: expected shape [{h_q}] (h_q), got "
                               f"{list(sink.shape)}")
        if np.isnan(sink).any():
            raise RefAttnError(f"attn_sink: entry {int(np.flatnonzero(np.isnan(sink))[0])} is "
                               "NaN; expected a float64 logit (+-inf allowed)")
    qh = qq.transpose(1, 0, 2)[None]  # (1, h_q, s_q, d_qk)
    kh = kvv.transpose(1, 0, 2)[None]  # (1, h_kv, s_kv, d_qk)
    call = SparseCall(qh, kh, kh[..., :dv], vis, scale=sm_scale)
    tr = sparse_forward(call, backend)
    lse = tr.lse[0].T.copy()  # (s_q, h_q), without the sink
    out = tr.output[0].transpose(1, 0, 2).copy()
    max_logits = tr.row_max[0].T.copy()
    if sink is not None:
        live = np.isfinite(lse)
        with np.errstate(over="ignore", invalid="ignore"):
            factor = np.where(live, np.exp(lse - np.logaddexp(lse, sink[None, :])), 0.0)
        out *= factor[..., None]
    lse[~np.isfinite(lse)] = np.inf  # FlashMLA's "lonely" rows
    return out, max_logits, lse


def _bsr(indptr: object, indices: object, MB: int, NB: int
         ) -> tuple[np.ndarray, np.ndarray]:
    ptr = index_array("indptr", indptr, lo=0, hi=MAX_KEYS, ndim=1, letters="r")
    if ptr.shape != (MB + 1,):
        raise RefAttnError(f"indptr: expected shape [{MB + 1}] (MB + 1 = ceil(M / R) + 1), got "
                           f"{list(ptr.shape)}")
    ind = index_array("indices", indices, lo=0, hi=NB - 1, ndim=1, letters="n",
                      expected=f"a key-block index in [0, {NB}) (NB = ceil(N / C))")
    if ptr[0] != 0 or (np.diff(ptr) < 0).any() or ptr[-1] != ind.shape[0]:
        bad = int(np.argmax(np.diff(ptr) < 0)) + 1 if (np.diff(ptr) < 0).any() else (
            0 if ptr[0] != 0 else MB)
        raise RefAttnError(f"indptr: entry {bad} is {int(ptr[bad])}; expected indptr[0] = 0, "
                           f"non-decreasing, indptr[MB] = len(indices) = {ind.shape[0]}")
    return ptr, ind


@public
def blocks_from_bsr(indptr: np.ndarray, indices: np.ndarray, M: int, N: int, R: int, C: int,
                    *, max_blocks: int | None = None) -> IndexVisibility:
    """FlashInfer's BSR layout as refattn's block visibility (B = 1, one list for all heads).

    Examples
    --------
    >>> vis = blocks_from_bsr(np.array([0, 1, 3]), np.array([1, 0, 1]), 3, 4, 2, 2)
    >>> vis.block[2].tolist(), vis.indices[0, 0].tolist()
    ([[[[1, -1], [0, 1]]]], [[2, 3, -1, -1], [2, 3, -1, -1], [0, 1, 2, 3]])
    """
    m = bounded_int("M", M, lo=1, hi=MAX_KEYS)
    n = bounded_int("N", N, lo=1, hi=MAX_KEYS)
    r = bounded_int("R", R, lo=1, hi=MAX_KEYS)
    c = bounded_int("C", C, lo=1, hi=MAX_KEYS)
    MB, NB = -(-m // r), -(-n // c)
    ptr, ind = _bsr(indptr, indices, MB, NB)
    lens = np.diff(ptr)
    nb = max(1, int(lens.max()) if lens.size else 1)
    if max_blocks is not None and nb > bounded_int("max_blocks", max_blocks, lo=1,
                                                   hi=MAX_KEYS):
        row = int(np.argmax(lens))
        raise RefAttnError(f"indptr: block row {row} lists {nb} blocks, more than max_blocks="
                           f"{max_blocks}")
    blocks = np.full((1, 1, MB, nb), -1, np.int64)
    for row in range(MB):
        blocks[0, 0, row, :lens[row]] = ind[ptr[row]:ptr[row + 1]]
    return block_visibility(blocks, block_q=r, block_k=c, num_queries=m, num_keys=n)


@public
def bsr_from_blocks(visibility: IndexVisibility) -> tuple[np.ndarray, np.ndarray, int, int]:
    """refattn's block visibility as FlashInfer's ``(indptr, indices, R, C)`` (int32).

    Needs a visibility built by :func:`~refattn.sparse.block_visibility` with B = 1 and
    H_idx = 1 (FlashInfer's BSR pattern is shared by every head). Padding is dropped; list
    order is kept.

    Examples
    --------
    >>> from refattn.sparse import block_visibility
    >>> vis = block_visibility(np.array([[[[1, -1], [0, 1]]]]), block_q=2, block_k=2,
    ...                        num_queries=3, num_keys=4)
    >>> [a.tolist() if hasattr(a, "tolist") else a for a in bsr_from_blocks(vis)]
    [[0, 1, 3], [1, 0, 1], 2, 2]
    """
    if not isinstance(visibility, IndexVisibility) or visibility.block is None:
        raise RefAttnError("visibility: expected a block visibility (block_visibility(), "
                           "blocks_from_bsr())")
    R, C, blocks = visibility.block
    if blocks.shape[:2] != (1, 1):
        raise RefAttnError(f"visibility: FlashInfer's BSR holds one pattern for every head and "
                           f"one sequence; got B={blocks.shape[0]}, H_idx={blocks.shape[1]}")
    rows = blocks[0, 0]
    valid = rows >= 0
    indptr = np.zeros(rows.shape[0] + 1, np.int32)
    indptr[1:] = np.cumsum(valid.sum(axis=1))
    return indptr, rows[valid].astype(np.int32), int(R), int(C)


@public
def block_sparse_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, indptr: np.ndarray,
                           indices: np.ndarray, R: int, C: int, *,
                           sm_scale: float | None = None, return_lse: bool = False,
                           lse_base: Literal["log2", "ln"] = "log2",
                           backend: Backend = "numpy",
                           ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """FlashInfer's ``BlockSparseAttentionWrapper`` (``plan`` then ``run``) in float64.

    Parameters
    ----------
    q : (M, Hq, D) float64 ndarray
    k : (N, Hkv, D) float64 ndarray
    v : (N, Hkv, Dv) float64 ndarray
    indptr : (ceil(M / R) + 1,) integer ndarray
    indices : (nnz,) integer ndarray
        Key-block columns of each block row (duplicates refused).
    R, C : int
        Block rows (queries) and columns (keys).
    sm_scale : float, optional
        Default ``D ** -0.5``.
    return_lse : bool
    lse_base : {"log2", "ln"}
        FlashInfer returns base 2 (``log2(sum 2 ** (s * log2 e))``); "ln" the natural log.
    backend : {"numpy", "numba"}

    Returns
    -------
    o : (M, Hq, Dv) ndarray
        0 on a query row whose block row is empty.
    lse : (M, Hq) ndarray, with ``return_lse``
        -inf on an empty row.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((3, 2, 4)) for _ in range(3))
    >>> o = block_sparse_attention(q, k, v, np.array([0, 1, 3, 5]), np.array([2, 0, 2, 1, 2]),
    ...                            1, 1)
    >>> bool(np.allclose(o[0], v[2]))
    True
    """
    qq = float64_input("q", q, 3)
    kk = float64_input("k", k, 3)
    vv = float64_input("v", v, 3)
    vis = blocks_from_bsr(indptr, indices, qq.shape[0], kk.shape[0], R, C)
    call = SparseCall(qq.transpose(1, 0, 2)[None], kk.transpose(1, 0, 2)[None],
                      vv.transpose(1, 0, 2)[None], vis, scale=sm_scale)
    tr = sparse_forward(call, backend)
    o = tr.output[0].transpose(1, 0, 2).copy()
    if not return_lse:
        return o
    lse = tr.lse[0].T.copy()
    return o, (lse / np.log(2.0) if lse_base == "log2" else lse)

