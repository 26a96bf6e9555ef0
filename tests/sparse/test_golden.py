"""The sparse suite's golden cases: the sparse engine equals the dense engine on each case's
call (its dense equivalent), the L = 8192, k = 2048 case included (once, timed), and the small
cases write and verify as a bundle with their index lists.

Bounds (float64, absolute): ``1e-12`` on the small cases (sums of at most a dozen O(1)
terms); ``1e-11`` on the L = 8192 case, whose key gradients sum up to a few thousand terms
(observed: below ``6e-14``).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import refattn
from refattn.bundle.golden.case import compute
from refattn.bundle.golden.layouts import read_layout
from refattn.bundle.suites.sparse import BIG_CASE, cases, causal_topk_indices, sparse_calls
from refattn.bundle.verification.verifier import verify
from refattn.bundle.writing.write import write_bundle
from refattn.sparse import IndexListLayout, sparse_value_and_grad

SMALL = ("sparse_block_gqa_partial_blocks", "sparse_padded_gqa_ragged",
         "sparse_per_query_head_dk_ne_dv", "sparse_empty_row", "sparse_sink_empty_row")


def _check(trace, grads, dense_out, dense_grads, tol, query_valid=None):
    keep = np.ones(trace.output.shape[:3], bool) if query_valid is None else np.broadcast_to(
        query_valid[..., 0], trace.output.shape[:3])
    np.testing.assert_allclose(trace.output, dense_out, atol=tol, rtol=0)
    for name in ("grad_q", "grad_k", "grad_v", "grad_sink"):
        a, b = getattr(grads, name), getattr(dense_grads, name)
        if a is None:
            assert b is None
            continue
        np.testing.assert_allclose(a, b, atol=tol, rtol=0, err_msg=name)
    return keep


@pytest.mark.parametrize("case", cases(SMALL), ids=lambda c: c.case_id)
def test_small_cases_match_dense_engine(case):
    sparse = sparse_calls((case.case_id,))[case.case_id]
    trace = refattn.forward(case.call)
    grads = refattn.backward(trace, case.grad_output)
    for backend in ("numpy", "numba"):
        tr, g = sparse_value_and_grad(sparse, case.grad_output, backend=backend)
        keep = _check(tr, g, trace.output, grads, 1e-12, case.call.query_valid)
        np.testing.assert_allclose(tr.lse[keep], trace.lse[keep], atol=1e-12, rtol=0)
    assert case.conventions["kv_layout"] == "index_list"


def test_big_case_matches_dense_numba_generator():
    (case,) = cases((BIG_CASE,))
    sparse = sparse_calls((BIG_CASE,))[BIG_CASE]
    assert sparse.axes["Q"] == 8192 and sparse.axes["k"] == 2048
    assert sparse.visibility.is_sorted
    t0 = time.perf_counter()
    tr, g = sparse_value_and_grad(sparse, case.grad_output)
    t1 = time.perf_counter()
    dense = compute(case, "numba")
    t2 = time.perf_counter()
    print(f"L=8192 k=2048: sparse numba {t1 - t0:.2f} s, dense numba generator {t2 - t1:.2f} s")
    _check(tr, g, dense.trace.output, dense.grads, 1e-11)
    np.testing.assert_allclose(tr.lse, dense.trace.lse, atol=1e-11, rtol=0)


def test_small_cases_write_and_verify_as_a_bundle(tmp_path):
    write_bundle(tmp_path / "sparse", cases(SMALL), suite="sparse")
    report = verify(tmp_path / "sparse")
    assert not report.problems and len(report.cases) == len(SMALL)
    assert all(not c.problems for c in report.cases)
    stored = {c.case_id: c for c in report.cases}
    assert stored["sparse_block_gqa_partial_blocks"].bit_identical


def test_layout_round_trip():
    call = sparse_calls(("sparse_block_gqa_partial_blocks",))["sparse_block_gqa_partial_blocks"]
    lay = IndexListLayout(call.visibility)
    back = read_layout(lay.tensors(), lay.conventions(), "c")
    assert (back.visibility.indices == call.visibility.indices).all()
    assert back.visibility.block[:2] == call.visibility.block[:2]
    bad = {**lay.tensors(), "indices": lay.tensors()["indices"][..., ::-1].copy()}
    with pytest.raises(refattn.RefAttnError, match="differ from the expansion"):
        read_layout(bad, lay.conventions(), "c")


def test_causal_topk_lists_are_dsa_like():
    idx = causal_topk_indices(64, 16, 3)[0, 0]
    for i in range(64):
        row = idx[i][idx[i] >= 0]
        assert len(row) == min(i + 1, 16) and (np.diff(row) > 0).all() and row[-1] == i
        assert set(range(i - len(row) // 2 + 1, i + 1)) <= set(row.tolist())
