"""The sparse engine against a plain per-query loop, the dense engine and finite differences;
numba's thread-count determinism; planted bugs in the padding and duplicate handling caught.

Expected values come from :func:`loop_attention`, written here from the definition (FlashMLA's
``tests/ref.py::ref_sparse_attn_fwd``: gather the listed keys, -inf on invalid slots,
``softmax`` over the rest; a sink only in the denominator), and from refattn's dense engine on
:func:`refattn.sparse.to_dense_call`. Bound: float64 sums of a few terms of size O(1) agree to
``1e-12`` (absolute); the observed differences are below ``4e-15``.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gradcheck
import refattn
from refattn.sparse import (
    SparseCall,
    block_visibility,
    index_visibility,
    sparse_backward,
    sparse_forward,
    sparse_value_and_grad,
    to_dense_call,
)

TOL = 1e-12


def loop_attention(q, k, v, idx, scale, sink=None):
    """Per-query loop: output (B, Hq, Q, Dv) and lse (B, Hq, Q), grouped heads, H_idx in
    {1, Hkv, Hq}; an empty row without sink gives output 0 and lse -inf."""
    B, Hq, Q, _ = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    H = idx.shape[1]
    out = np.zeros((B, Hq, Q, Dv))
    lse = np.full((B, Hq, Q), -np.inf)
    for b in range(B):
        for h in range(Hq):
            kh = h // (Hq // Hkv)
            ih = 0 if H == 1 else (h if H == Hq else kh)
            for i in range(Q):
                keys = [int(j) for j in idx[b, ih, i] if j >= 0]
                s = [scale * float(q[b, h, i] @ k[b, kh, j]) for j in keys]
                terms = s + ([float(sink[h])] if sink is not None else [])
                if not terms:
                    continue
                m = max(terms)
                den = sum(np.exp(t - m) for t in terms)
                for j, sj in zip(keys, s, strict=True):
                    out[b, h, i] += np.exp(sj - m) / den * v[b, kh, j]
                lse[b, h, i] = m + np.log(den)
    return out, lse


def _lists(rng, B, H, Q, K, k, empty_prob=0.0):
    idx = np.full((B, H, Q, k), -1, np.int64)
    for b in range(B):
        for h in range(H):
            for i in range(Q):
                if rng.random() < empty_prob:
                    continue
                n = int(rng.integers(1, min(k, K) + 1))
                slots = rng.choice(k, n, replace=False)
                idx[b, h, i, slots] = rng.choice(K, n, replace=False)
    return idx


def _call(seed, B=2, Hq=4, Hkv=2, Q=7, K=9, Dk=5, Dv=3, k=4, H=None, sink=False, empty=0.0):
    rng = np.random.default_rng(seed)
    H = Hkv if H is None else H
    q = rng.standard_normal((B, Hq, Q, Dk))
    kk = rng.standard_normal((B, Hkv, K, Dk))
    v = rng.standard_normal((B, Hkv, K, Dv))
    idx = _lists(rng, B, H, Q, K, k, empty)
    s = rng.standard_normal(Hq) if sink else None
    return SparseCall(q, kk, v, index_visibility(idx, K), sink=s), rng


def _dense(call, go):
    trace = refattn.forward(to_dense_call(call))
    return trace, refattn.backward(trace, go)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("H", ["one", "kv", "q"])
@pytest.mark.parametrize("sink", [False, True])
def test_matches_loop_and_dense(backend, H, sink):
    Hq, Hkv = 4, 2
    call, rng = _call(1, H={"one": 1, "kv": Hkv, "q": Hq}[H], sink=sink)
    go = rng.standard_normal((2, Hq, 7, 3))
    out, lse = loop_attention(call.q, call.k, call.v, call.visibility.indices, call.scale,
                              call.sink)
    tr, g = sparse_value_and_grad(call, go, backend=backend)
    np.testing.assert_allclose(tr.output, out, atol=TOL, rtol=0)
    np.testing.assert_allclose(tr.lse, lse, atol=TOL, rtol=0)
    dtr, dg = _dense(call, go)
    np.testing.assert_allclose(tr.output, dtr.output, atol=TOL, rtol=0)
    for name in ("grad_q", "grad_k", "grad_v") + (("grad_sink",) if sink else ()):
        np.testing.assert_allclose(getattr(g, name), getattr(dg, name), atol=TOL, rtol=0,
                                   err_msg=name)


def test_three_numba_paths_agree_with_numpy():
    call, rng = _call(2, Q=11, K=13, k=6, sink=True)
    go = rng.standard_normal((2, 4, 11, 3))
    ref_tr, ref_g = sparse_value_and_grad(call, go, backend="numpy")
    tr = sparse_forward(call, "numba")
    g = sparse_backward(tr, go, "numba")
    ftr, fg = sparse_value_and_grad(call, go, backend="numba")
    for a, b in ((tr, ref_tr), (ftr, ref_tr)):
        np.testing.assert_allclose(a.output, b.output, atol=TOL, rtol=0)
        np.testing.assert_allclose(a.row_max, b.row_max, atol=TOL, rtol=0)
    for a in (g, fg):
        for name in ("grad_q", "grad_k", "grad_v", "grad_sink"):
            np.testing.assert_allclose(getattr(a, name), getattr(ref_g, name), atol=TOL,
                                       rtol=0, err_msg=name)


def test_empty_rows_give_zero_and_no_gradient():
    call, rng = _call(3, H=1, empty=0.4)
    empty = call.empty_rows()
    assert empty.any()
    go = rng.standard_normal((2, 4, 7, 3))
    for backend in ("numpy", "numba"):
        tr, g = sparse_value_and_grad(call, go, backend=backend)
        assert (tr.output[empty] == 0).all() and np.isneginf(tr.lse[empty]).all()
        assert (g.grad_q[empty] == 0).all()
    _, dg = _dense(call, go)
    np.testing.assert_allclose(g.grad_k, dg.grad_k, atol=TOL, rtol=0)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), B=st.integers(1, 2), groups=st.sampled_from([(1, 1),
       (2, 1), (4, 2), (3, 3)]), Q=st.integers(1, 30), K=st.integers(1, 30),
       k=st.integers(1, 6), H=st.sampled_from(["one", "kv", "q"]), sink=st.booleans(),
       block=st.booleans())
def test_hypothesis_against_loop(seed, B, groups, Q, K, k, H, sink, block):
    rng = np.random.default_rng(seed)
    Hq, Hkv = groups
    Hi = {"one": 1, "kv": Hkv, "q": Hq}[H]
    q = rng.standard_normal((B, Hq, Q, 3))
    kk = rng.standard_normal((B, Hkv, K, 3))
    v = rng.standard_normal((B, Hkv, K, 2))
    if block:
        bq, bk = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        QB, KB = -(-Q // bq), -(-K // bk)
        blocks = _lists(rng, B, Hi, QB, KB, min(k, KB))
        vis = block_visibility(blocks, block_q=bq, block_k=bk, num_queries=Q, num_keys=K)
    else:
        vis = index_visibility(_lists(rng, B, Hi, Q, K, k, 0.2), K)
    s = rng.standard_normal(Hq) if sink else None
    call = SparseCall(q, kk, v, vis, sink=s)
    out, lse = loop_attention(q, kk, v, vis.indices, call.scale, s)
    go = rng.standard_normal(out.shape)
    results = [sparse_value_and_grad(call, go, backend=b) for b in ("numpy", "numba")]
    results.append((sparse_forward(call, "numba"), None))
    for tr, _ in results:
        np.testing.assert_allclose(tr.output, out, atol=TOL, rtol=0)
        np.testing.assert_allclose(tr.lse, lse, atol=TOL, rtol=0)
    np.testing.assert_allclose(results[1][1].grad_k, results[0][1].grad_k, atol=TOL, rtol=0)
    np.testing.assert_allclose(results[1][1].grad_v, results[0][1].grad_v, atol=TOL, rtol=0)
    np.testing.assert_allclose(results[1][1].grad_q, results[0][1].grad_q, atol=TOL, rtol=0)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_gradients_by_finite_differences(backend):
    call, _ = _call(4, B=1, Hq=2, Hkv=1, Q=4, K=5, Dk=3, Dv=2, k=3, H=1, sink=True)
    vis = call.visibility

    def fn(q, k, v, sink):
        return sparse_forward(SparseCall(q, k, v, vis, sink=sink), backend).output

    def vjp(grad_output, q, k, v, sink):
        c = SparseCall(q, k, v, vis, sink=sink)
        g = sparse_backward(sparse_forward(c, backend), grad_output, backend)
        return {"q": g.grad_q, "k": g.grad_k, "v": g.grad_v, "sink": g.grad_sink}

    inputs = {"q": np.array(call.q), "k": np.array(call.k), "v": np.array(call.v),
              "sink": np.array(call.sink)}
    report = gradcheck.check_vjp(fn, vjp, inputs, method="central")
    assert report.passed, report


def test_numba_same_bits_on_one_and_two_threads():
    call, rng = _call(5, B=1, Hq=4, Hkv=2, Q=40, K=50, Dk=16, Dv=8, k=12, H=1, sink=True)
    go = rng.standard_normal((1, 4, 40, 8))
    before = numba.get_num_threads()
    runs = []
    try:
        for n in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(n)
            tr = sparse_forward(call, "numba")
            g = sparse_backward(tr, go, "numba")
            ftr, fg = sparse_value_and_grad(call, go, backend="numba")
            runs.append([tr.output, tr.lse, g.grad_q, g.grad_k, g.grad_v, g.grad_sink,
                         ftr.output, fg.grad_q, fg.grad_k, fg.grad_v, fg.grad_sink])
    finally:
        numba.set_num_threads(before)
    for a, b in zip(*runs, strict=True):
        assert a.tobytes() == b.tobytes()


# -- planted bugs: the checks above must notice them ------------------------------------------
def _padding_read_as_last_key(call):
    """Planted: -1 used as a Python index (reads key K-1) instead of skipped."""
    idx = np.array(call.visibility.indices, dtype=np.int64)
    B, Hq = call.q.shape[:2]
    out = np.zeros((B, Hq, call.q.shape[2], call.v.shape[3]))
    for b in range(B):
        for h in range(Hq):
            kh, ih = int(call.kv_head[h]), int(call.index_head[h])
            for i in range(call.q.shape[2]):
                keys = idx[b, ih, i]  # the bug: no `keys >= 0` filter
                s = call.scale * call.k[b, kh][keys] @ call.q[b, h, i]
                p = np.exp(s - s.max())
                out[b, h, i] = (p / p.sum()) @ call.v[b, kh][keys]
    return out


def _duplicate_counted_twice(call):
    """Planted: the duplicate check skipped and a repeated key gathered twice (FlashMLA's
    reference's behaviour), via a list with one key written into a padding slot."""
    idx = np.array(call.visibility.indices, dtype=np.int64)
    row = idx[0, 0, 0]
    row[np.flatnonzero(row < 0)[0]] = row[row >= 0][0]
    out, _ = loop_attention(call.q, call.k, call.v, idx, call.scale)
    return out


@pytest.mark.parametrize("planted", [_padding_read_as_last_key, _duplicate_counted_twice])
def test_planted_bugs_are_caught(planted):
    call, rng = _call(6, B=1, Hq=2, Hkv=1, Q=6, K=8, k=5, H=1)
    idx = call.visibility.indices
    assert (idx[0, 0, 0] < 0).any()  # a padded row for the planted duplicate
    dtr, _ = _dense(call, rng.standard_normal((1, 2, 6, 3)))
    bad = planted(call)
    assert np.abs(bad - dtr.output).max() > 1e-3
    with pytest.raises(refattn.RefAttnError, match="twice"):
        dup = np.array(idx, dtype=np.int64)
        dup[0, 0, 0, np.flatnonzero(dup[0, 0, 0] < 0)[0]] = dup[0, 0, 0][dup[0, 0, 0] >= 0][0]
        index_visibility(dup, 8)


def test_fused_tiles_all_visited():
    """Regression: the tasks' spread over tiles is a permutation for every tile count (a
    multiplier sharing a factor with the count visited one tile several times, another never)."""
    from refattn.sparse.kernels import SPREAD, _spread

    for n in [*range(1, 300), 3 * 13501, SPREAD, 2 * SPREAD, 2**20 + 7]:
        seen = {int(_spread(t, n)) for t in range(n)} if n < 10**5 else {
            int(_spread(t, n)) for t in range(0, n, max(1, n // 997))}
        assert len(seen) == (n if n < 10**5 else len(range(0, n, max(1, n // 997))))


def _windows_and_blocks():
    """Rows over several fused windows (the last one partial), keys over several key blocks
    (the last one partial), unsorted lists with padding anywhere and empty rows, GQA."""
    from refattn.sparse.engine import FUSED_ROWS
    from refattn.sparse.kernels import BLOCK_KEYS

    Q, K = 2 * FUSED_ROWS + 37, 3 * BLOCK_KEYS + 5
    return _call(8, B=1, Hq=4, Hkv=2, Q=Q, K=K, Dk=9, Dv=6, k=23, H=2, sink=True, empty=0.05)


@pytest.mark.parametrize("Q", [17, 25, 40, 64, 65, None])
def test_fused_path_many_tiles(Q):
    if Q is None:
        call, rng = _windows_and_blocks()
        assert not call.visibility.is_sorted
    else:
        call, rng = _call(7, B=1, Hq=2, Hkv=1, Q=Q, K=Q + 3, k=6, H=1, sink=True, empty=0.1)
    go = rng.standard_normal((*call.q.shape[:3], call.v.shape[3]))
    ref_tr, ref_g = sparse_value_and_grad(call, go, backend="numpy")
    tr, g = sparse_value_and_grad(call, go, backend="numba")
    np.testing.assert_allclose(tr.output, ref_tr.output, atol=TOL, rtol=0)
    np.testing.assert_allclose(tr.lse, ref_tr.lse, atol=TOL, rtol=0)
    for name in ("grad_q", "grad_k", "grad_v", "grad_sink", "row_dot"):
        np.testing.assert_allclose(getattr(g, name), getattr(ref_g, name), atol=TOL, rtol=0)


def test_fused_same_bits_on_one_and_two_threads_across_windows_and_blocks():
    call, rng = _windows_and_blocks()
    go = rng.standard_normal((*call.q.shape[:3], call.v.shape[3]))
    before = numba.get_num_threads()
    runs = []
    try:
        for n in (1, min(2, numba.config.NUMBA_NUM_THREADS)):
            numba.set_num_threads(n)
            tr, g = sparse_value_and_grad(call, go, backend="numba")
            runs.append([tr.output, tr.lse, g.grad_q, g.grad_k, g.grad_v, g.grad_sink])
    finally:
        numba.set_num_threads(before)
    for a, b in zip(*runs, strict=True):
        assert a.tobytes() == b.tobytes()
