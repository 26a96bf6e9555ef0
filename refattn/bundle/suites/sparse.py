"""The sparse suite: golden cases of attention by index lists (DSA top-k, NSA/MoBA blocks).

Owns the case definitions. Each case is a :class:`~refattn.sparse.SparseCall` (built by
:func:`sparse_calls`) stored as its dense equivalent (:func:`~refattn.sparse.to_dense_call`:
the call every generator computes and ``refattn verify`` checks) with the lists a sparse
kernel reads as its layout (:class:`~refattn.sparse.IndexListLayout`, ``kv_layout =
"index_list"``). One case has L = 8192 and k = 2048 (its (1, 1, 8192, 8192) mask is 64 MiB);
the others are small: the block form, GQA with per-kv-head lists, per-query-head lists, -1
padding with rows of fewer valid entries, an empty row, a sink, Dk != Dv.

:func:`causal_topk_indices` makes DSA-like lists: sorted, causal, the most recent half of each
row's budget local and the rest scattered over earlier tokens (a stand-in for the lightning
indexer's top-k, which this suite does not run).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from functools import partial

import numpy as np

from refattn.bundle.golden.case import GoldenCase
from refattn.sparse import (
    IndexListLayout,
    SparseCall,
    block_visibility,
    index_visibility,
    to_dense_call,
)

__all__ = ["BIG_CASE", "CASES", "DEFAULT_GENERATOR", "cases", "causal_topk_indices",
           "sparse_calls"]

#: the case with L = 8192 and k = 2048
BIG_CASE = "sparse_dsa_causal_topk_L8192_k2048"
#: the generator ``refattn golden --suite sparse`` uses unless told otherwise (numba: the
#: exact generator over the 8192 x 8192 case would take hours)
DEFAULT_GENERATOR = "numba"


def causal_topk_indices(L: int, k: int, seed: int, heads: int = 1,
                        local_fraction: float = 0.5) -> np.ndarray:
    """``(1, heads, L, k)`` int32 DSA-like lists: row i lists ``n = min(i + 1, k)`` keys,
    sorted, the last ``local_fraction`` of them the most recent tokens (i included) and the
    rest ``f`` distinct earlier tokens (``f`` sorted draws from ``[0, pool - f]`` plus
    ``0, 1, ..., f - 1``: distinct and spread over the whole history); -1 after them.
    Vectorised over rows (32768 rows in about a second).

    Examples
    --------
    >>> causal_topk_indices(5, 4, 0)[0, 0].tolist()
    [[0, -1, -1, -1], [0, 1, -1, -1], [0, 1, 2, -1], [0, 1, 2, 3], [1, 2, 3, 4]]
    """
    rng = np.random.default_rng(seed)
    out = np.full((1, heads, L, k), -1, np.int32)
    slot = np.arange(k, dtype=np.int64)
    for h in range(heads):
        for i0 in range(0, L, 4096):
            i = np.arange(i0, min(L, i0 + 4096), dtype=np.int64)
            n = np.minimum(i + 1, k)
            loc = np.maximum(1, (n * local_fraction).astype(np.int64))
            far = n - loc
            pool = i - loc + 1  # the earlier tokens: [0, pool)
            width = int(far.max()) if far.size else 0
            draws = rng.integers(0, (pool - far + 1)[:, None], (i.size, max(width, 1)))
            draws = np.sort(np.where(slot[None, :max(width, 1)] < far[:, None], draws,
                                     np.iinfo(np.int64).max // 2), axis=1)
            draws += slot[None, :max(width, 1)]
            rows = np.full((i.size, k), -1, np.int64)
            rows[:, :width] = np.where(slot[None, :width] < far[:, None], draws[:, :width], -1)
            local = pool[:, None] + slot[None, :] - far[:, None]  # slot far + t holds pool + t
            mask = (slot[None, :] >= far[:, None]) & (slot[None, :] < n[:, None])
            rows[mask] = local[mask]
            out[0, h, i0:i0 + i.size] = rows
    return out


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


def _ragged(rng: np.random.Generator, B: int, H: int, Q: int, K: int, k: int,
            empty: tuple[int, ...] = ()) -> np.ndarray:
    """Unsorted lists with a random count of valid entries per row, -1 anywhere."""
    idx = np.full((B, H, Q, k), -1, np.int64)
    for b in range(B):
        for h in range(H):
            for i in range(Q):
                if i in empty:
                    continue
                n = int(rng.integers(1, min(k, K) + 1))
                slots = rng.choice(k, n, replace=False)
                idx[b, h, i, slots] = rng.choice(K, n, replace=False)
    return idx


def _qkv(rng: np.random.Generator, B: int, Hq: int, Hkv: int, Q: int, K: int, Dk: int,
         Dv: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (rng.standard_normal((B, Hq, Q, Dk)), rng.standard_normal((B, Hkv, K, Dk)),
            rng.standard_normal((B, Hkv, K, Dv)))


def _big(rng: np.random.Generator) -> SparseCall:
    L, k = 8192, 2048
    q, kk, v = _qkv(rng, 1, 2, 1, L, L, 16, 16)
    return SparseCall(q, kk, v, index_visibility(causal_topk_indices(L, k, 1), L,
                                                 require_sorted=True))


def _block_gqa(rng: np.random.Generator) -> SparseCall:
    Q, K, bq, bk = 22, 26, 4, 4  # partial last blocks on both axes
    q, k, v = _qkv(rng, 2, 4, 2, Q, K, 8, 8)
    QB, KB = -(-Q // bq), -(-K // bk)
    blocks = np.full((2, 2, QB, 4), -1, np.int64)
    for b in range(2):
        for h in range(2):
            for r in range(QB):
                n = int(rng.integers(1, 5))
                blocks[b, h, r, :n] = np.sort(rng.choice(KB, n, replace=False))
    return SparseCall(q, k, v, block_visibility(blocks, block_q=bq, block_k=bk,
                                                num_queries=Q, num_keys=K))


def _padded_gqa(rng: np.random.Generator) -> SparseCall:
    q, k, v = _qkv(rng, 1, 4, 2, 9, 13, 8, 8)
    return SparseCall(q, k, v, index_visibility(_ragged(rng, 1, 2, 9, 13, 6), 13))


def _per_head_mla(rng: np.random.Generator) -> SparseCall:
    q, k, v = _qkv(rng, 1, 3, 1, 7, 11, 12, 8)  # Dk != Dv (MLA's 576 / 512 in miniature)
    return SparseCall(q, k, v, index_visibility(_ragged(rng, 1, 3, 7, 11, 5), 11), scale=0.3)


def _empty_row(rng: np.random.Generator) -> SparseCall:
    q, k, v = _qkv(rng, 1, 2, 2, 6, 8, 4, 4)
    return SparseCall(q, k, v, index_visibility(_ragged(rng, 1, 1, 6, 8, 3, empty=(2,)), 8))


def _sink(rng: np.random.Generator) -> SparseCall:
    q, k, v = _qkv(rng, 1, 2, 1, 6, 9, 4, 4)
    return SparseCall(q, k, v, index_visibility(_ragged(rng, 1, 1, 6, 9, 4, empty=(0,)), 9),
                      sink=rng.standard_normal(2))


#: case id -> (comment, builder)
_CASES: dict[str, tuple[str, Callable[[np.random.Generator], SparseCall]]] = {
    BIG_CASE: ("DSA-like causal top-2048 lists over 8192 tokens, one list per token shared "
               "by both query heads of the one kv head", _big),
    "sparse_block_gqa_partial_blocks": ("NSA/MoBA-style key blocks per query block (4 x 4, "
                                        "partial last blocks), one list per kv head", _block_gqa),
    "sparse_padded_gqa_ragged": ("per-kv-head lists, unsorted, -1 padding anywhere, rows with "
                                 "fewer valid entries", _padded_gqa),
    "sparse_per_query_head_dk_ne_dv": ("one list per query head, Dk 12 != Dv 8, scale 0.3",
                                       _per_head_mla),
    "sparse_empty_row": ("a query whose list is all padding: output 0, no gradient",
                         _empty_row),
    "sparse_sink_empty_row": ("a per-head sink in every denominator; an empty row gives all "
                              "the mass to the sink", _sink),
}


def sparse_calls(names: tuple[str, ...] | None = None) -> dict[str, SparseCall]:
    """The sparse calls of the suite by case id (all, or ``names``).

    Examples
    --------
    >>> sorted(sparse_calls(("sparse_empty_row",)))
    ['sparse_empty_row']
    """
    return {name: _CASES[name][1](_rng(name)) for name in (names or tuple(_CASES))}


def _golden(name: str) -> GoldenCase:
    """One case: the sparse call's dense equivalent, with its lists as the layout."""
    call = sparse_calls((name,))[name]
    rng = _rng(name + "/grad_output")
    g_o = rng.standard_normal((*call.q.shape[:3], call.v.shape[3]))
    layout = IndexListLayout(call.visibility)
    return GoldenCase(name, to_dense_call(call), g_o, _CASES[name][0], ("SparseIndexList",),
                      layout.conventions(), layout)


#: case id -> builder (the kernel suite runs these after its own)
CASES: dict[str, Callable[[], GoldenCase]] = {name: partial(_golden, name) for name in _CASES}


def cases(names: tuple[str, ...] | None = None) -> list[GoldenCase]:
    """The suite's golden cases: each sparse call's dense equivalent, with its lists.

    Examples
    --------
    >>> [c.case_id for c in cases(("sparse_empty_row",))]
    ['sparse_empty_row']
    """
    return [CASES[name]() for name in (names or tuple(_CASES))]
