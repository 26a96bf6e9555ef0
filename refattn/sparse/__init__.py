"""Sparse attention by index lists (DeepSeek Sparse Attention, NSA, MoBA, block-sparse BSR),
computed in ``O(Q x k)`` memory.

Owns the index-list visibility (:mod:`~refattn.sparse.lists`: per-query key lists with -1
padding, or selected key blocks per query block), the sparse call and its dense equivalent
(:mod:`~refattn.sparse.call`), and a separate engine (:mod:`~refattn.sparse.engine`) on two
backends: the NumPy reference (:mod:`~refattn.sparse.reference`) and numba
(:mod:`~refattn.sparse.kernels`, deterministic across thread counts). Sits beside
:mod:`refattn.quant`: imports :mod:`refattn.call` and below (never :mod:`refattn.bundle`,
:mod:`refattn.adapters` or the CLI, which use it).

Examples
--------
>>> import numpy as np
>>> from refattn.sparse import SparseCall, index_visibility, sparse_forward
>>> x = np.ones((1, 1, 2, 4))
>>> vis = index_visibility(np.array([[[[0, -1], [1, 0]]]]), num_keys=2)
>>> sparse_forward(SparseCall(x, x, x, vis)).lse.round(4).tolist()
[[[2.0, 2.6931]]]
"""

from refattn.sparse.call import DENSE_MASK_LIMIT, SparseCall, sparse_bytes, to_dense_call
from refattn.sparse.engine import (
    SparseGradients,
    SparseTrace,
    sparse_backward,
    sparse_forward,
    sparse_value_and_grad,
)
from refattn.sparse.layout import IndexListLayout, read_index_list
from refattn.sparse.lists import IndexVisibility, block_visibility, index_visibility

__all__ = [
    "DENSE_MASK_LIMIT",
    "IndexListLayout",
    "IndexVisibility",
    "SparseCall",
    "SparseGradients",
    "SparseTrace",
    "block_visibility",
    "index_visibility",
    "read_index_list",
    "sparse_backward",
    "sparse_bytes",
    "sparse_forward",
    "sparse_value_and_grad",
    "to_dense_call",
]
