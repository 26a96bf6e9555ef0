"""Every bad input of the sparse package is a RefAttnError naming the tensor, the index and the
limit, raised before anything proportional to a claimed size is allocated."""

from __future__ import annotations

import numpy as np
import pytest

from refattn.errors import RefAttnError
from refattn.sparse import (
    SparseCall,
    block_visibility,
    index_visibility,
    sparse_backward,
    sparse_forward,
    sparse_value_and_grad,
    to_dense_call,
)

IDX = np.array([[[[0, 2, -1], [1, -1, -1]]]])


@pytest.mark.parametrize("idx, kw, match", [
    (np.array([[[[0, 3]]]]), {}, r"entry \(b=0, h=0, i=0, slot=1\) is 3, expected -1 \(padding\) "
                                 r"or a key index in \[0, 3\)"),
    (np.array([[[[0, -2]]]]), {}, r"slot=1\) is -2"),
    (np.array([[[[1, 0]]]]), {"require_sorted": True}, r"row \(b=0, h=0, i=0\) is not sorted at "
                                                       r"slot 1 \(0 after 1\)"),
    (np.array([[[[-1, 0]]]]), {"require_sorted": True}, "a valid entry after padding"),
    (np.array([[[[0, 1, 2]]]]), {"max_k": 2}, r"3 entries per row \(axis k\), more than "
                                              "max_k=2"),
    (np.array([[[[2, 1], [0, 0]]]]), {}, r"row \(b=0, h=0, i=1\) holds key 0 twice \(slots 0 "
                                         r"and 1\)"),
    (np.array([[[[0.0, 1.0]]]]), {}, "expected an integer array"),
    (np.array([[[0, 1]]]), {}, "expected 4 axes"),
    (np.array([[[[True, False]]]]), {}, "expected an integer array"),
])
def test_bad_lists(idx, kw, match):
    with pytest.raises(RefAttnError, match=match):
        index_visibility(idx, 3, **kw)


def test_claimed_sizes_bounded_before_allocating():
    with pytest.raises(RefAttnError, match="num_keys"):
        index_visibility(IDX, 2**40)
    with pytest.raises(RefAttnError, match=r"axis QB is 1, expected ceil\(Q / block_q\)"):
        block_visibility(np.zeros((1, 1, 1, 1), np.int64), block_q=1, block_k=1,
                         num_queries=2**30, num_keys=4)
    # one block of 2**30 keys per query: the expansion is refused from its size, not attempted
    with pytest.raises(RefAttnError, match="memory: expanding the key blocks"):
        block_visibility(np.zeros((1, 1, 1, 1), np.int64), block_q=2**20, block_k=2**30,
                         num_queries=2**20, num_keys=2**31 - 1)


def test_bad_calls():
    x = np.ones((1, 2, 2, 4))
    vis = index_visibility(IDX, 3)
    with pytest.raises(RefAttnError, match="q: expected dtype float64, got float32"):
        SparseCall(x.astype(np.float32), np.ones((1, 1, 3, 4)), np.ones((1, 1, 3, 4)), vis)
    with pytest.raises(RefAttnError, match=r"num_keys=3\) do not match the call's B=1, Q=2, K=4"):
        SparseCall(x, np.ones((1, 1, 4, 4)), np.ones((1, 1, 4, 4)), vis)
    vis3 = index_visibility(np.zeros((1, 3, 2, 1), np.int64), 3)
    with pytest.raises(RefAttnError, match=r"axis H_idx is 3, expected 1, Hkv=1 or Hq=2"):
        SparseCall(x, np.ones((1, 1, 3, 4)), np.ones((1, 1, 3, 4)), vis3)
    with pytest.raises(RefAttnError, match=r"sink: expected shape \[2\]"):
        SparseCall(x, np.ones((1, 1, 3, 4)), np.ones((1, 1, 3, 4)), vis, sink=np.zeros(3))
    with pytest.raises(RefAttnError, match="scale"):
        SparseCall(x, np.ones((1, 1, 3, 4)), np.ones((1, 1, 3, 4)), vis, scale=-1.0)
    with pytest.raises(RefAttnError, match="visibility: expected an IndexVisibility"):
        SparseCall(x, np.ones((1, 1, 3, 4)), np.ones((1, 1, 3, 4)), IDX)  # type: ignore
    call = SparseCall(x, np.ones((1, 1, 3, 4)), np.ones((1, 1, 3, 4)), vis)
    tr = sparse_forward(call)
    for fn in (lambda g: sparse_backward(tr, g), lambda g: sparse_value_and_grad(call, g)):
        with pytest.raises(RefAttnError, match=r"grad_output: expected shape \[1, 2, 2, 4\]"):
            fn(np.ones((1, 2, 2, 3)))
    with pytest.raises(RefAttnError, match="backend"):
        sparse_forward(call, "cuda")  # type: ignore[arg-type]


def test_caller_arrays_unchanged():
    idx = IDX.copy()
    q = np.ones((1, 1, 2, 4))
    vis = index_visibility(idx, 3)
    call = SparseCall(q, q[:, :, :1].repeat(3, 2), q[:, :, :1].repeat(3, 2), vis)
    sparse_value_and_grad(call, np.ones((1, 1, 2, 4)))
    assert (idx == IDX).all() and idx.flags.writeable and (q == 1).all()
    assert not vis.indices.flags.writeable and not call.q.flags.writeable


def test_dense_mask_refused_before_allocating():
    L = 32768
    idx = np.broadcast_to(np.arange(4, dtype=np.int32), (1, 1, L, 4))  # no (L, L) anything
    q = np.broadcast_to(np.zeros(1), (1, 8, L, 1))
    call = SparseCall(q, q, q, index_visibility(idx, L))
    with pytest.raises(RefAttnError, match=r"dense mask: the call's \(B=1, 1, Q=32768, "
                                           r"K=32768\) bool mask needs 1073741824 bytes"):
        to_dense_call(call)
    with pytest.raises(RefAttnError, match="max_mask_bytes=100"):
        to_dense_call(SparseCall(np.ones((1, 1, 20, 2)), np.ones((1, 1, 20, 2)),
                                 np.ones((1, 1, 20, 2)),
                                 index_visibility(np.zeros((1, 1, 20, 1), np.int64), 20)),
                      max_mask_bytes=100)


def test_dense_refuses_rows_empty_for_some_heads_only():
    x = np.ones((1, 2, 2, 2))
    vis = index_visibility(np.array([[[[0], [1]], [[-1], [1]]]]), 2)
    with pytest.raises(RefAttnError, match=r"row \(b=0, i=0\) is empty for some heads"):
        to_dense_call(SparseCall(x, x, x, vis))


def test_hand_made_visibility_refused():
    from refattn.sparse import IndexVisibility

    forged = IndexVisibility(np.array([[[[5]]]], np.int32), 1, np.ones((1, 1, 1), np.int32),
                             True)
    x = np.ones((1, 1, 1, 2))
    with pytest.raises(RefAttnError, match="visibility: expected an IndexVisibility"):
        SparseCall(x, x, x, forged)
    with pytest.raises(ValueError):
        index_visibility(IDX, 3).indices.flags.writeable = True
