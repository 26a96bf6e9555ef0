"""The index lists a golden case stores beside its dense call (the bundle's layout protocol).

Owns :class:`IndexListLayout`: a golden case whose ``call`` is the dense equivalent of a
sparse call (:func:`~refattn.sparse.call.to_dense_call`) keeps the lists a sparse kernel
reads: ``tensors()`` gives ``indices`` (B, H_idx, Q, k) int64 (and ``block_indices`` for the
block form), ``gradient_tensors`` nothing (the lists have no gradient), ``conventions()``
``kv_layout = "index_list"`` with the padding, sharing and order rules. :func:`read_index_list`
rebuilds it from a case file (:data:`refattn.bundle.golden.layouts.READERS`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from refattn._boundary import public
from refattn._checks import bounded_int
from refattn.errors import RefAttnError
from refattn.sparse.lists import MAX_KEYS, IndexVisibility, block_visibility, index_visibility

__all__ = ["IndexListLayout", "read_index_list"]


@public
@dataclass(frozen=True, eq=False)
class IndexListLayout:
    """The stored form of an :class:`~refattn.sparse.lists.IndexVisibility`.

    Examples
    --------
    >>> vis = index_visibility(np.array([[[[1, -1], [0, 1]]]]), 2)
    >>> lay = IndexListLayout(vis)
    >>> sorted(lay.tensors()), lay.conventions()["kv_layout"], lay.gradient_tensors(None)
    (['indices'], 'index_list', {})
    """

    visibility: IndexVisibility

    def tensors(self) -> dict[str, np.ndarray]:
        """``indices`` (and ``block_indices`` for the block form) as int64 (the bundle schema's
        index dtype; the kernels read int32)."""
        out = {"indices": self.visibility.indices.astype(np.int64)}
        if self.visibility.block is not None:
            out["block_indices"] = self.visibility.block[2].astype(np.int64)
        return out

    def gradient_tensors(self, grads: Any) -> dict[str, np.ndarray]:
        """None: index lists have no gradient."""
        return {}

    def conventions(self) -> dict[str, Any]:
        """What the manifest records about the lists."""
        vis = self.visibility
        out: dict[str, Any] = {
            "kv_layout": "index_list", "num_keys": vis.num_keys,
            "index_padding": "-1 (anywhere in a row); every other entry in [0, K)",
            "index_heads": "H_idx = 1: one list for every query head; H_idx = Hkv: one per kv "
                           "head, read by its query heads h // (Hq // Hkv); H_idx = Hq: one "
                           "per query head",
            "index_duplicates": "refused", "index_sorted": bool(vis.is_sorted),
            "empty_rows": "output 0, zero gradients (query_valid False in the dense call)"}
        if vis.block is not None:
            out.update({"block_q": vis.block[0], "block_k": vis.block[1]})
        return out


@public
def read_index_list(tensors: Mapping[str, Any], conventions: Mapping[str, Any],
                    case_id: str) -> IndexListLayout:
    """Rebuild the layout from a case file's tensors and conventions (validated again).

    Parameters
    ----------
    tensors : mapping of str to ndarray
        ``indices`` (B, H_idx, Q, k) and, for the block form, ``block_indices``.
    conventions : mapping
        ``num_keys``; ``block_q`` and ``block_k`` for the block form.
    case_id : str
        Named in errors.

    Raises
    ------
    RefAttnError
        A missing tensor, a convention out of range, lists the validation refuses, or
        ``indices`` that differ from the expansion of ``block_indices``.

    Examples
    --------
    >>> lay = read_index_list({"indices": np.array([[[[0, -1], [1, 0]]]])}, {"num_keys": 2}, "c")
    >>> lay.conventions()["kv_layout"], lay.visibility.nnz
    ('index_list', 3)
    """
    if "indices" not in tensors:
        raise RefAttnError(f"{case_id}: an index_list case needs tensor 'indices'")
    K = bounded_int(f"{case_id}: conventions.num_keys", conventions.get("num_keys"), lo=1,
                    hi=MAX_KEYS)
    if "block_q" in conventions:
        if "block_indices" not in tensors:
            raise RefAttnError(f"{case_id}: a block index_list case needs 'block_indices'")
        bq = bounded_int(f"{case_id}: conventions.block_q", conventions.get("block_q"), lo=1,
                         hi=MAX_KEYS)
        bk = bounded_int(f"{case_id}: conventions.block_k", conventions.get("block_k"), lo=1,
                         hi=MAX_KEYS)
        shape = np.shape(tensors["indices"])
        if len(shape) != 4:
            raise RefAttnError(f"{case_id}: indices: expected (B, H_idx, Q, k), got shape "
                               f"{list(shape)}")
        Q = int(shape[2])
        vis = block_visibility(tensors["block_indices"], block_q=bq, block_k=bk,
                               num_queries=Q, num_keys=K)
        if not np.array_equal(vis.indices, tensors["indices"]):
            raise RefAttnError(f"{case_id}: indices differ from the expansion of block_indices")
        return IndexListLayout(vis)
    return IndexListLayout(index_visibility(tensors["indices"], K))
