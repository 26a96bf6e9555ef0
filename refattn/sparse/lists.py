"""Index-list visibility: which keys each query reads, as lists of key indices with -1 padding.

Owns :class:`IndexVisibility` and its two constructors. :func:`index_visibility` takes per-query
lists ``indices[b, h, i, :]`` (DeepSeek Sparse Attention's top-k lists, as FlashMLA's
``flash_mla_sparse_fwd`` reads them: deepseek-ai/FlashMLA ``flash_mla/flash_mla_interface.py``
at commit 02fe0d02e83f15ae5a049cc4acc009a50553e64c, ``indices: [s_q, h_kv, topk] int32``, -1 =
invalid). :func:`block_visibility` takes selected key blocks per query block (NSA / MoBA / the
rows of FlashInfer's BSR layout) and expands them, block by block, into the same per-query
lists: memory ``O(Q x k)``, never ``(Q, K)``.

The index axis ``H_idx`` is 1 (one list per token, shared by every query head: DSA's indexer
produces one top-k list per token for all the heads of its kv head, and FlashMLA's MLA has one
kv head), ``Hkv`` (one list per kv head, shared by the query heads that read it) or ``Hq`` (one
list per query head).

Rules (checked before anything proportional to a claimed size is allocated): entries lie in
``[-1, K)`` (-1 = padding, anywhere in a row); a key appears at most once in a row (a
duplicate is refused, naming the row, the two slots and the key: FlashMLA's reference,
``tests/ref.py::ref_sparse_attn_fwd``, would gather it twice and count it twice, which no
visibility relation can express); ``require_sorted=True`` asks for strictly increasing valid
entries with the padding after them; ``max_k`` bounds the list length. A row with no valid
entry is allowed: its output is 0 (FlashMLA's convention; refattn's with a sink).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from refattn._boundary import public
from refattn._checks import as_array, bounded_int, format_index, immutable_copy
from refattn._memory import check_bytes
from refattn.errors import RefAttnError

__all__ = ["IndexVisibility", "block_visibility", "index_visibility"]

#: the largest key count an index list may address (entries are stored as int32)
MAX_KEYS = 2**31 - 1
#: rows validated at once (bounds the scratch of the duplicate check)
_CHUNK_ENTRIES = 1 << 22
_LETTERS = ("b", "h", "i")
#: marks the visibilities this module's constructors validated
_TOKEN = object()


@dataclass(frozen=True, eq=False)
class IndexVisibility:
    """Per-query key index lists (validated; read-only).

    Attributes
    ----------
    indices : (B, H_idx, Q, k) int32 ndarray
        Key indices per query row, -1 = padding (read-only).
    num_keys : int
        ``K``: every valid entry is below it.
    counts : (B, H_idx, Q) int32 ndarray
        Valid entries per row.
    is_sorted : bool
        Whether every row's valid entries increase strictly with the padding after them.
    block : tuple of (block_q, block_k, block_indices) or None
        The block form this was expanded from (:func:`block_visibility`), for storage.

    Build one with :func:`index_visibility` or :func:`block_visibility`: a hand-made instance
    is refused by :class:`~refattn.sparse.call.SparseCall` (its lists were never checked).
    """

    indices: np.ndarray
    num_keys: int
    counts: np.ndarray
    is_sorted: bool
    block: tuple[int, int, np.ndarray] | None = None
    _token: object = field(default=None, repr=False)

    @property
    def checked(self) -> bool:
        """Whether :func:`index_visibility` or :func:`block_visibility` built this (only
        those are accepted by :class:`~refattn.sparse.call.SparseCall`)."""
        return self._token is _TOKEN

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, H_idx, Q, k)``."""
        b, h, q, k = self.indices.shape
        return (int(b), int(h), int(q), int(k))

    @property
    def nnz(self) -> int:
        """Valid entries in all rows."""
        return int(self.counts.sum(dtype=np.int64))

    def index_head(self, Hq: int, Hkv: int) -> np.ndarray:
        """``(Hq,)`` int64: the index head each query head reads (grouped heads).

        Examples
        --------
        >>> vis = index_visibility(np.array([[[[0, -1]]], [[[1, 0]]]]).reshape(1, 2, 1, 2), 2)
        >>> vis.index_head(4, 2).tolist()
        [0, 0, 1, 1]
        """
        H = self.shape[1]
        if H == 1:
            return np.zeros(Hq, np.int64)
        if H == Hq:
            return np.arange(Hq, dtype=np.int64)
        if H == Hkv:
            return np.arange(Hq, dtype=np.int64) // (Hq // Hkv)
        raise RefAttnError(f"indices: axis H_idx is {H}, expected 1, Hkv={Hkv} or Hq={Hq}")


def _check_rows(idx: np.ndarray, K: int, name: str, require_sorted: bool,
                ) -> tuple[np.ndarray, bool]:
    """Range, duplicate and order checks of ``idx`` (B, H, Q, k) in chunks of rows; returns
    the per-row counts and whether every row is sorted."""
    B, H, Q, k = idx.shape
    counts = np.empty((B, H, Q), np.int32)
    flat = idx.reshape(-1, k) if k else idx.reshape(-1, 0)
    cflat = counts.reshape(-1)
    rows = flat.shape[0]
    step = max(1, _CHUNK_ENTRIES // max(k, 1))
    all_sorted = True
    for r0 in range(0, rows, step):
        part = flat[r0:r0 + step]
        bad = (part < -1) | (part >= K)
        if bad.any():
            r, s = (int(x) for x in np.argwhere(bad)[0])
            where = format_index(np.unravel_index(r0 + r, (B, H, Q)), _LETTERS)
            raise RefAttnError(f"{name}: entry {where[:-1]}, slot={s}) is {int(part[r, s])}, "
                               f"expected -1 (padding) or a key index in [0, {K})")
        valid = part >= 0
        cflat[r0:r0 + part.shape[0]] = valid.sum(axis=1)
        if k < 2:
            continue
        srt = np.sort(part, axis=1)
        dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
        if dup.any():
            r, s = (int(x) for x in np.argwhere(dup)[0])
            key = int(srt[r, s + 1])
            slots = np.flatnonzero(part[r] == key)[:2].tolist()
            where = format_index(np.unravel_index(r0 + r, (B, H, Q)), _LETTERS)
            raise RefAttnError(
                f"{name}: row {where} holds key {key} twice (slots {slots[0]} and {slots[1]}); "
                "a key may appear once per row (FlashMLA's reference would count it twice)")
        # sorted: valid entries strictly increasing, padding only after the last valid one
        after_pad = valid[:, 1:] & ~valid[:, :-1]
        down = valid[:, 1:] & valid[:, :-1] & (part[:, 1:] <= part[:, :-1])
        unsorted = after_pad | down
        if unsorted.any():
            all_sorted = False
            if require_sorted:
                r, s = (int(x) for x in np.argwhere(unsorted)[0])
                where = format_index(np.unravel_index(r0 + r, (B, H, Q)), _LETTERS)
                what = ("a valid entry after padding" if after_pad[r, s] else
                        f"{int(part[r, s + 1])} after {int(part[r, s])}")
                raise RefAttnError(
                    f"{name}: row {where} is not sorted at slot {s + 1} ({what}); "
                    "require_sorted=True expects strictly increasing key indices with the -1 "
                    "padding after them")
    return counts, all_sorted


@public
def index_visibility(indices: np.ndarray, num_keys: int, *, max_k: int | None = None,
                     require_sorted: bool = False) -> IndexVisibility:
    """Validate per-query key index lists.

    Parameters
    ----------
    indices : (B, H_idx, Q, k) integer ndarray
        ``indices[b, h, i, s]``: the s-th key query ``i`` reads (-1: padding). ``H_idx`` is 1
        (one list shared by every query head), ``Hkv`` or ``Hq``.
    num_keys : int
        ``K``, the number of keys.
    max_k : int, optional
        The most entries a row may have (a kernel's top-k); a longer ``k`` is refused.
    require_sorted : bool
        Refuse rows whose valid entries do not increase strictly (padding last).

    Returns
    -------
    IndexVisibility
        The lists as int32 (a read-only copy: the caller's array is never changed).

    Raises
    ------
    RefAttnError
        Naming the tensor, the entry ``(b, h, i, slot)`` and the limit it breaks.

    Examples
    --------
    >>> vis = index_visibility(np.array([[[[2, 0, -1], [1, -1, -1]]]]), 3)
    >>> vis.counts.tolist(), vis.is_sorted
    ([[[2, 1]]], False)
    >>> try:
    ...     index_visibility(np.array([[[[2, 2]]]]), 3)
    ... except RefAttnError as exc:
    ...     print(exc)
    indices: row (b=0, h=0, i=0) holds key 2 twice (slots 0 and 1); a key may appear once \
per row (FlashMLA's reference would count it twice)
    """
    K = bounded_int("num_keys", num_keys, lo=1, hi=MAX_KEYS)
    arr = as_array("indices", indices)
    if arr.dtype.kind not in "iu":
        raise RefAttnError(f"indices: expected an integer array, got dtype {arr.dtype}")
    if arr.ndim != 4:
        raise RefAttnError(f"indices: expected 4 axes (B, H_idx, Q, k), got shape "
                           f"{list(arr.shape)}")
    if 0 in arr.shape[:3]:
        raise RefAttnError(f"indices: axes B, H_idx, Q must be non-empty, got {list(arr.shape)}")
    k = int(arr.shape[3])
    if max_k is not None:
        limit = bounded_int("max_k", max_k, lo=1, hi=MAX_KEYS)
        if k > limit:
            raise RefAttnError(f"indices: {k} entries per row (axis k), more than max_k="
                               f"{limit}")
    check_bytes(arr.size * 4 + arr.shape[0] * arr.shape[1] * arr.shape[2] * 4
                + min(arr.size, _CHUNK_ENTRIES) * 24, "copying the index lists")
    counts, srt = _check_rows(arr, K, "indices", require_sorted)
    # values checked: int32 is lossless; memory nobody can make writeable again (the kernels
    # index with these entries unchecked)
    own = immutable_copy(arr.astype(np.int32))
    counts.flags.writeable = False
    return IndexVisibility(own, K, counts, srt, _token=_TOKEN)


@public
def block_visibility(block_indices: np.ndarray, *, block_q: int, block_k: int,
                     num_queries: int, num_keys: int, max_blocks: int | None = None,
                     require_sorted: bool = False) -> IndexVisibility:
    """Per-query lists from selected key blocks per query block (NSA, MoBA, BSR rows).

    Query block ``qb`` holds queries ``[qb * block_q, (qb + 1) * block_q)`` (the last one
    possibly shorter); key block ``kb`` keys ``[kb * block_k, (kb + 1) * block_k)`` (likewise).
    Every query of a block reads every key of each block in its list, in list order.

    Parameters
    ----------
    block_indices : (B, H_idx, ceil(Q / block_q), nb) integer ndarray
        Key-block ids per query block, -1 padded; duplicates refused.
    block_q, block_k : int
        Block sizes.
    num_queries, num_keys : int
        ``Q`` and ``K``.
    max_blocks : int, optional
        The most blocks a row may list.
    require_sorted : bool
        Refuse unsorted block rows.

    Returns
    -------
    IndexVisibility
        With ``k = nb * block_k`` entries per query (the last key block's missing keys are
        -1) and ``block`` set.

    Examples
    --------
    >>> vis = block_visibility(np.array([[[[1, -1], [0, 1]]]]), block_q=2, block_k=2,
    ...                        num_queries=3, num_keys=3)
    >>> vis.indices[0, 0].tolist()
    [[2, -1, -1, -1], [2, -1, -1, -1], [0, 1, 2, -1]]
    """
    bq = bounded_int("block_q", block_q, lo=1, hi=MAX_KEYS)
    bk = bounded_int("block_k", block_k, lo=1, hi=MAX_KEYS)
    Q = bounded_int("num_queries", num_queries, lo=1, hi=MAX_KEYS)
    K = bounded_int("num_keys", num_keys, lo=1, hi=MAX_KEYS)
    arr = as_array("block_indices", block_indices)
    if arr.dtype.kind not in "iu" or arr.ndim != 4:
        raise RefAttnError(f"block_indices: expected a 4-axis integer array (B, H_idx, QB, "
                           f"nb), got dtype {arr.dtype}, shape {list(arr.shape)}")
    QB, KB = -(-Q // bq), -(-K // bk)
    if arr.shape[2] != QB:
        raise RefAttnError(f"block_indices: axis QB is {arr.shape[2]}, expected ceil(Q / "
                           f"block_q) = {QB}")
    blocks = index_visibility(arr, KB, max_k=max_blocks, require_sorted=require_sorted)
    B, H, _, nb = blocks.shape
    k = nb * bk
    check_bytes(B * H * Q * k * 4 * 2, "expanding the key blocks to per-query lists",
                "use fewer or smaller blocks")
    out = np.full((B, H, Q, k), -1, np.int32)
    offs = np.arange(bk, dtype=np.int64)
    for qb in range(QB):  # one query block at a time: (B, H, nb, bk) per block
        ids = blocks.indices[:, :, qb, :].astype(np.int64)  # (B, H, nb)
        keys = ids[..., None] * bk + offs  # (B, H, nb, bk)
        keys = np.where((ids[..., None] >= 0) & (keys < K), keys, -1)
        out[:, :, qb * bq:(qb + 1) * bq, :] = keys.reshape(B, H, 1, k)
    counts = (out >= 0).sum(axis=3, dtype=np.int32)
    out = immutable_copy(out)
    counts.flags.writeable = False
    own_blocks = blocks.indices  # already a read-only int32 copy
    # block rows sorted -> key rows sorted, unless a partial last block pads mid-row
    srt = blocks.is_sorted and _rows_sorted(out)
    return IndexVisibility(out, K, counts, srt, (bq, bk, own_blocks), _token=_TOKEN)


def _rows_sorted(idx: np.ndarray) -> bool:
    """Whether every row of ``idx`` (…, k) is strictly increasing over its valid entries with
    the padding after them."""
    valid = idx >= 0
    return not bool(((valid[..., 1:] & ~valid[..., :-1])
                     | (valid[..., 1:] & valid[..., :-1] & (idx[..., 1:] <= idx[..., :-1]))
                     ).any())
