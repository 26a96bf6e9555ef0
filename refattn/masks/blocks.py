"""FlexAttention-style block metadata for a visibility relation, and its exact inverse.

Owns :class:`BlockMask` (per query block: the kv blocks that are partial and those that are
full; fully invisible blocks are absent), :func:`to_block_mask` and
:func:`block_mask_to_dense`. Partial blocks keep a ``mask_mod`` predicate, so the metadata
loses nothing. Defers the relation itself to :mod:`refattn.masks` and the dense
polarity adapters to :mod:`refattn.masks.framework`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from refattn._checks import as_array, check_bool
from refattn.errors import RefAttnError
from refattn.masks.algebra import BaseRelation
from refattn.masks.render import as4

__all__ = ["ABSENT", "FULL", "PARTIAL", "BlockMask", "block_mask_to_dense", "to_block_mask"]

ABSENT, PARTIAL, FULL = 0, 1, 2

MaskMod = Callable[[Any, Any, Any, Any], np.ndarray]


@dataclass(frozen=True, eq=False)
class BlockMask:
    """Block-sparse description of a relation (the layout of FlexAttention's ``BlockMask``).

    Query rows are cut into blocks of ``q_block`` rows and key rows into blocks of
    ``kv_block`` rows; the last block of an axis may be shorter (it covers what is left) and is
    classified on its real extent. FlexAttention instead pads Q and K up to block multiples and
    counts the padding as invisible, so there a ragged last block is never "full"; when Q and K
    are multiples of the block sizes the two agree block for block.

    Attributes
    ----------
    shape : (B, H, Q, K) tuple
        Shape of the relation (B and H may be 1: broadcast).
    q_block, kv_block : int
    kv_num_blocks : (B, H, nQ) int64 ndarray
        Number of partial kv blocks per query block (they need the predicate).
    kv_indices : (B, H, nQ, nK) int64 ndarray
        Partial kv block ids in ascending order, then -1.
    full_kv_num_blocks : (B, H, nQ) int64 ndarray
        Number of fully visible kv blocks (no per-element test needed).
    full_kv_indices : (B, H, nQ, nK) int64 ndarray
        Full kv block ids in ascending order, then -1.
    mask_mod : callable
        ``mask_mod(b, h, q_idx, kv_idx) -> bool ndarray`` on broadcastable index arrays;
        evaluated only inside partial blocks.
    """

    shape: tuple[int, int, int, int]
    q_block: int
    kv_block: int
    kv_num_blocks: np.ndarray
    kv_indices: np.ndarray
    full_kv_num_blocks: np.ndarray
    full_kv_indices: np.ndarray
    mask_mod: MaskMod

    def classes(self) -> np.ndarray:
        """Block classes from the metadata: (B, H, nQ, nK) int8 of ABSENT, PARTIAL, FULL."""
        out = np.full(self.kv_indices.shape, ABSENT, dtype=np.int8)
        for idx, cls in ((self.kv_indices, PARTIAL), (self.full_kv_indices, FULL)):
            b, h, qb, slot = np.nonzero(idx >= 0)
            out[b, h, qb, idx[b, h, qb, slot]] = cls
        return out


def _block_size(block_size: Any) -> tuple[int, int]:
    sizes = block_size if isinstance(block_size, (tuple, list)) else (block_size, block_size)
    if len(sizes) != 2 or any(
        isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, np.integer)) or s < 1
        for s in sizes
    ):
        raise RefAttnError(
            f"block_size: expected a positive int or a pair (q_block, kv_block), "
            f"got {block_size!r}"
        )
    return int(sizes[0]), int(sizes[1])


def _starts(n: int, block: int) -> np.ndarray:
    return np.arange(0, n, block)


def _counts_dense(vis: np.ndarray, qs: np.ndarray, ks: np.ndarray) -> np.ndarray:
    per_q = np.add.reduceat(vis.astype(np.int64), qs, axis=2)  # (B, H, nQ, K)
    return np.add.reduceat(per_q, ks, axis=3)  # (B, H, nQ, nK)


def _counts_tiles(rel: BaseRelation, qs: np.ndarray, ks: np.ndarray) -> np.ndarray:
    B, H, Q, K = rel.shape
    qe = np.append(qs[1:], Q)
    counts = np.zeros((B, H, qs.size, ks.size), dtype=np.int64)
    for b in range(B):
        for h in range(H):
            for qb, (i0, i1) in enumerate(zip(qs, qe, strict=True)):
                # one band of query rows against every key, summed per kv block
                per_key = rel.tile(b, i0, i1, 0, K, h=h).sum(axis=0, dtype=np.int64)
                counts[b, h, qb] = np.add.reduceat(per_key, ks)
    return counts


def _ordered(selected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per query block: how many kv blocks are selected, and their ids ascending then -1."""
    nK = selected.shape[-1]
    num = selected.sum(axis=-1).astype(np.int64)  # (B, H, nQ)
    # stable sort puts selected blocks first, in ascending kv order
    order = np.argsort(~selected, axis=-1, kind="stable")  # (B, H, nQ, nK)
    idx = np.where(np.arange(nK) < num[..., None], order, -1).astype(np.int64)
    return num, idx


def to_block_mask(visible: Any, block_size: Any = 128) -> BlockMask:
    """Classify every (query block, kv block) as absent, partial or full.

    Parameters
    ----------
    visible : bool ndarray of shape (Q, K) or (B, H, Q, K), or a relation
        A relation (coordinates or a union / intersection of them) is evaluated tile by
        tile from its coordinates (no dense mask is built).
    block_size : int or (int, int)
        ``q_block`` and ``kv_block`` (FlexAttention's default is 128).

    Returns
    -------
    BlockMask

    Examples
    --------
    >>> from refattn.masks import causal
    >>> bm = to_block_mask(causal(4, 4, alignment="upper_left"), 2)
    >>> bm.kv_num_blocks[0, 0].tolist(), bm.full_kv_num_blocks[0, 0].tolist()
    ([1, 1], [0, 1])
    >>> bm.classes()[0, 0].tolist()   # 1 = partial, 2 = full, 0 = absent
    [[1, 0], [2, 1]]
    """
    q_block, kv_block = _block_size(block_size)
    if isinstance(visible, BaseRelation):
        shape = visible.shape
        qs, ks = _starts(shape[2], q_block), _starts(shape[3], kv_block)
        counts = _counts_tiles(visible, qs, ks)
        mask_mod: MaskMod = visible.mask_mod
    else:
        vis = as_array("visible", visible)
        check_bool("visible", vis)
        if vis.ndim not in (2, 4):
            raise RefAttnError(f"visible: expected [Q,K] or [B,H,Q,K], got {list(vis.shape)}")
        vis = as4(vis).copy()
        vis.flags.writeable = False
        shape = vis.shape
        qs, ks = _starts(shape[2], q_block), _starts(shape[3], kv_block)
        counts = _counts_dense(vis, qs, ks)

        def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> np.ndarray:
            return vis[b, h, q_idx, kv_idx]

    q_sizes = np.diff(np.append(qs, shape[2]))  # (nQ,)
    k_sizes = np.diff(np.append(ks, shape[3]))  # (nK,)
    full = counts == q_sizes[:, None] * k_sizes[None, :]  # (B, H, nQ, nK)
    partial = (counts > 0) & ~full
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask(tuple(int(n) for n in shape), q_block, kv_block,  # type: ignore[arg-type]
                     kv_num, kv_idx, full_num, full_idx, mask_mod)


def block_mask_to_dense(block_mask: BlockMask) -> np.ndarray:
    """Inverse of :func:`to_block_mask`: full blocks True, partial blocks by ``mask_mod``.

    Returns
    -------
    (B, H, Q, K) bool ndarray

    Examples
    --------
    >>> vis = np.tril(np.ones((3, 5), bool))
    >>> bool((block_mask_to_dense(to_block_mask(vis, 2))[0, 0] == vis).all())
    True
    """
    bm = block_mask
    B, H, Q, K = bm.shape
    out = np.zeros(bm.shape, dtype=bool)
    for b in range(B):
        for h in range(H):
            for qb in range(bm.kv_indices.shape[2]):
                i0, i1 = qb * bm.q_block, min((qb + 1) * bm.q_block, Q)
                for kb in bm.full_kv_indices[b, h, qb, : bm.full_kv_num_blocks[b, h, qb]]:
                    out[b, h, i0:i1, kb * bm.kv_block: min((kb + 1) * bm.kv_block, K)] = True
                for kb in bm.kv_indices[b, h, qb, : bm.kv_num_blocks[b, h, qb]]:
                    j0, j1 = kb * bm.kv_block, min((kb + 1) * bm.kv_block, K)
                    out[b, h, i0:i1, j0:j1] = bm.mask_mod(
                        b, h, np.arange(i0, i1)[:, None], np.arange(j0, j1)[None, :]
                    )
    return out
