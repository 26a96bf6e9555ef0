"""numba backend behaviour beyond exactness: options, what streaming materialises, tile
skipping, dropout bits, determinism, task layouts and memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import refattn
from refattn.dropout import Philox
from refattn.engine.numba import backend as numba_backend
from refattn.masks import causal, relation


def _qkv(rng, B=1, Hq=2, Hkv=1, Q=9, K=11, Dk=4, Dv=3):
    return (rng.standard_normal((B, Hq, Q, Dk)), rng.standard_normal((B, Hkv, K, Dk)),
            rng.standard_normal((B, Hkv, K, Dv)))


def test_unknown_and_invalid_options_raise():
    call = refattn.AttentionCall(*_qkv(np.random.default_rng(0)))
    with pytest.raises(refattn.RefAttnError, match=r"unknown option.*tile"):
        refattn.forward(call, backend="numba", tile=4)
    with pytest.raises(refattn.RefAttnError, match="materialize: expected True or False"):
        refattn.forward(call, backend="numba", materialize="no")
    with pytest.raises(refattn.RefAttnError, match="block_q: expected a positive int"):
        refattn.forward(call, backend="numba", materialize=False, block_q=0)
    with pytest.raises(refattn.RefAttnError, match="block_k: expected a positive int"):
        refattn.forward(call, backend="numba", materialize=False, block_k=2.0)
    with pytest.raises(refattn.RefAttnError, match="only with materialize=False"):
        refattn.forward(call, backend="numba", block_q=4)


def test_streaming_rejects_streams_it_cannot_replay_by_coordinates():
    class Ones:  # a MultiplierSource that is not the portable Philox stream
        p = 0.0

        def multiplier(self, B, Hq, Q, K):
            return np.ones((B, Hq, Q, K))

        def manifest(self):
            return {"algorithm": "ones"}

    call = refattn.AttentionCall(*_qkv(np.random.default_rng(1)), dropout=Ones())
    with pytest.raises(refattn.RefAttnError, match=r"streaming mode regenerates.*Ones"):
        refattn.forward(call, backend="numba", materialize=False)
    dense = refattn.forward(call, backend="numba")  # dense mode asks the stream for Z
    np.testing.assert_array_equal(dense.dropout_multiplier, 1.0)


def test_streaming_trace_says_what_it_did_not_materialise():
    rng = np.random.default_rng(2)
    call = refattn.AttentionCall(*_qkv(rng), visible=causal(9, 11, alignment="lower_right"),
                                 bias=rng.standard_normal((9, 11)),
                                 dropout=Philox(0.2, seed=7))
    t = refattn.forward(call, backend="numba", materialize=False, block_q=4, block_k=4)
    m = t.materialized
    assert m["mode"] == "streaming" and m["scores"] is False and m["probabilities"] is False
    assert m["saved"] == ["output", "row_max", "lse", "sanitized_rows"]
    assert set(m["not_materialized"]) == {"scores", "biased_scores", "masked_scores", "probs",
                                          "dropout_multiplier", "consumed"}
    for name in m["not_materialized"]:
        assert getattr(t, name) is None
    assert m["visibility"] == "coordinates"
    assert m["dropout"].startswith("philox4x32-10")
    assert (m["block_q"], m["block_k"]) == (4, 4)
    manifest = t.manifest()
    json.dumps(manifest, allow_nan=False)
    assert manifest["materialization"] == m
    dense = refattn.forward(call, backend="numba")
    assert dense.materialized["mode"] == "dense" and dense.probs is not None


def _invisible_tiles(dense: np.ndarray, bq: int, bk: int) -> int:
    """Count the tiles of a (B, H, Q, K) mask with no visible edge (brute force)."""
    B, H, Q, K = dense.shape
    return sum(
        not dense[b, h, i:i + bq, j:j + bk].any()
        for b in range(B) for h in range(H)
        for i in range(0, Q, bq) for j in range(0, K, bk)
    )


@pytest.mark.parametrize("bq, bk", [(4, 4), (3, 5), (8, 2)])
def test_fully_invisible_tiles_are_skipped_and_counted(bq, bk):
    rng = np.random.default_rng(3)
    B, Hq, Q, K = 2, 3, 17, 23
    pos_q = np.tile(np.arange(K - Q, K), (B, 1))
    pos_k = np.tile(np.arange(K), (B, 1))
    valid = np.ones((B, K), dtype=bool)
    valid[1, 15:] = False  # a padded key range in batch row 1
    rel = relation(pos_q, pos_k, valid, causal=True, window=(np.array([3, 6, 30]), None))
    q, k, v = _qkv(rng, B=B, Hq=Hq, Q=Q, K=K)
    dense = np.broadcast_to(rel.dense(), (B, Hq, Q, K))
    used = dense.any(axis=3).all(axis=1)[:, None, :, None]  # rows left keyless by padding
    assert not used.all()
    policy = {"query_valid": used, "all_masked_rows": "sanitize_then_zero_invalid_query"}
    call = refattn.AttentionCall(q, k, v, visible=rel, **policy)
    t = refattn.forward(call, backend="numba", materialize=False, block_q=bq, block_k=bk)
    np.testing.assert_array_equal(t.sanitized_rows, ~dense.any(axis=-1))
    skipped = _invisible_tiles(dense, bq, bk)
    assert skipped > 0
    assert t.materialized["tiles_skipped"] == skipped
    nt = B * Hq * -(-Q // bq) * -(-K // bk)
    assert t.materialized["tiles_computed"] == nt - skipped
    # a dense mask of the same relation is read per tile and skips the same tiles
    dense_call = refattn.AttentionCall(q, k, v, visible=rel.dense(), **policy)
    td = refattn.forward(dense_call, backend="numba", materialize=False, block_q=bq,
                         block_k=bk)
    assert td.materialized["visibility"] == "dense_per_tile"
    assert td.materialized["tiles_skipped"] == skipped
    np.testing.assert_array_equal(td.output, t.output)


def test_dense_dropout_multiplier_is_bit_identical_to_the_stream():
    rng = np.random.default_rng(4)
    stream = Philox(0.37, seed=2**64 - 3, offset=2**32 - 1)
    call = refattn.AttentionCall(*_qkv(rng, B=2, Hq=3, Hkv=3, Q=5, K=13), dropout=stream)
    t = refattn.forward(call, backend="numba")
    assert t.dropout_multiplier.dtype == np.float64
    np.testing.assert_array_equal(t.dropout_multiplier, stream.multiplier(2, 3, 5, 13))
    np.testing.assert_array_equal(t.consumed, t.probs * t.dropout_multiplier)


@pytest.mark.parametrize("materialize", [True, False])
def test_run_to_run_bit_identical(materialize):
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, B=2, Hq=4, Hkv=2, Q=37, K=41, Dk=8, Dv=5)
    vis = rng.random((2, 1, 37, 41)) < 0.8
    vis[..., 0] = True
    call = refattn.AttentionCall(q, k, v, visible=vis, bias=rng.standard_normal((1, 4, 1, 41)),
                                 dropout=Philox(0.1, seed=99))
    g = rng.standard_normal((2, 4, 37, 5))
    opts = {} if materialize else {"block_q": 8, "block_k": 16}
    runs = []
    for _ in range(3):
        t = refattn.forward(call, backend="numba", materialize=materialize, **opts)
        runs.append({**t.tensors(), **refattn.backward(t, g).tensors()})
    for other in runs[1:]:
        assert other.keys() == runs[0].keys()
        for name, value in runs[0].items():
            assert np.array_equal(value, other[name], equal_nan=True), name


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_backward_task_layouts_agree(monkeypatch, threads):
    # more task-layout threads than heads: key blocks are dealt to chunks whose partial dQ,
    # row sums and (keys-broadcast) bias gradients are added afterwards
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, B=1, Hq=1, Hkv=1, Q=19, K=29)
    g = rng.standard_normal((1, 1, 19, 3))
    for bias in (None, rng.standard_normal((1, 1, 19, 1)), rng.standard_normal((19, 29))):
        call = refattn.AttentionCall(q, k, v, bias=bias)
        ref = refattn.backward(refattn.forward(call), g)
        monkeypatch.setattr(numba_backend, "_task_threads", lambda: threads)
        t = refattn.forward(call, backend="numba", materialize=False, block_q=4, block_k=4)
        got = refattn.backward(t, g)
        for name in ("grad_q", "grad_k", "grad_v", "row_dot", "grad_bias"):
            want = getattr(ref, name)
            if want is None:
                assert getattr(got, name) is None
                continue
            scale = np.abs(want).max()
            if name == "grad_bias":  # sums of G_S over keys cancel to ~0: use the terms' size
                scale = np.abs(ref.grad_scores).sum(axis=-1).max()
            np.testing.assert_allclose(getattr(got, name), want, rtol=0, atol=1e-12 * scale)


def test_partition_never_lets_two_tasks_write_one_bias_element(monkeypatch):
    monkeypatch.setattr(numba_backend, "_task_threads", lambda: 2)
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, B=2, Hq=2, Hkv=2, Q=4, K=16)
    cases = {
        None: (True, True, 1, 1),
        (2, 2, 4, 16): (True, True, 1, 1),
        (1, 2, 4, 16): (False, True, 1, 1),  # shared over b: b is looped inside a task
        (2, 1, 1, 16): (True, False, 1, 1),
        (4, 16): (False, False, 2, 1),  # key blocks split into chunks: disjoint columns
        (1, 1, 4, 1): (False, False, 2, 2),  # keys broadcast: one partial per chunk
    }
    for shape, expected in cases.items():
        bias = None if shape is None else rng.standard_normal(shape)
        call = refattn.AttentionCall(q, k, v, bias=bias)
        assert numba_backend._partition(call, nkb=4) == expected, shape


def test_streaming_never_allocates_a_score_sized_array():
    rng = np.random.default_rng(8)
    B, H, Q, K, D = 1, 1, 2048, 2048, 8
    q, k, v = _qkv(rng, B=B, Hq=H, Hkv=H, Q=Q, K=K, Dk=D, Dv=D)
    call = refattn.AttentionCall(q, k, v, bias=rng.standard_normal((1, 1, 1, K)),
                                 dropout=Philox(0.1, seed=3))
    g = rng.standard_normal((B, H, Q, D))
    t = refattn.forward(call, backend="numba", materialize=False)  # compile outside the trace
    refattn.backward(t, g)
    tracemalloc.start()
    try:
        t = refattn.forward(call, backend="numba", materialize=False)
        refattn.backward(t, g)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    score_bytes = B * H * Q * K * 8  # one (B, Hq, Q, K) float64 tensor: 32 MiB
    # (Q, D)-sized arrays (128 KiB) and a few (block_q, block_k) tiles per thread (512 KiB);
    # tracemalloc sees numpy's and the kernels' allocations alike
    assert peak < score_bytes / 4, peak
    tracemalloc.start()
    try:
        refattn.forward(call, backend="numba")  # the dense trace, for contrast
        _, dense_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert dense_peak > 3 * score_bytes


def test_a_fresh_process_loads_every_kernel_from_the_cache():
    script = """
import json, numpy as np, refattn
from refattn.dropout import Philox
from refattn.engine.numba import kernels, philox, stream
rng = np.random.default_rng(0)
q = rng.standard_normal((1, 2, 5, 3))
call = refattn.AttentionCall(q, q, q, bias=rng.standard_normal((5, 5)),
                             dropout=Philox(0.5, seed=1))
for materialize in (True, False):
    t = refattn.forward(call, backend="numba", materialize=materialize)
    refattn.backward(t, q)
jitted = (stream.stream_forward, stream.stream_backward, kernels.dense_forward_rows,
          kernels.dense_backward_rows, philox.philox_fill)
print(json.dumps({k.__name__: [sum(k.stats.cache_hits.values()),
                               sum(k.stats.cache_misses.values())] for k in jitted}))
"""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    runs = []
    for _ in range(2):  # the first run may populate the cache; the second must only load it
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              env=env, cwd=root, timeout=600, check=True)
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    for name, (hits, misses) in runs[1].items():
        assert (hits, misses) == (1, 0), (name, hits, misses)


def test_a_batch_shared_relation_applies_to_every_batch_row():
    rng = np.random.default_rng(9)
    q, k, v = _qkv(rng, B=3, Hq=2, Hkv=2, Q=7, K=12)
    call = refattn.AttentionCall(q, k, v, visible=causal(7, 12, alignment="lower_right"))
    assert call.relation.shape[0] == 1
    g = rng.standard_normal((3, 2, 7, 3))
    ref = refattn.forward(call)
    rg = refattn.backward(ref, g)
    t = refattn.forward(call, backend="numba", materialize=False, block_q=3, block_k=5)
    assert t.materialized["visibility"] == "coordinates"
    got = refattn.backward(t, g)
    np.testing.assert_allclose(t.output, ref.output, rtol=0, atol=1e-13)
    for name in ("grad_q", "grad_k", "grad_v"):
        np.testing.assert_allclose(getattr(got, name), getattr(rg, name), rtol=0, atol=1e-12)
    assert json.loads(json.dumps(refattn.forward(call, backend="numba").manifest()))


def test_streaming_gradients_are_separate_arrays():
    # the streaming outputs are views of one zero-filled block (engine.alloc): they must not
    # overlap, and each must start at zero so that accumulation is exact
    rng = np.random.default_rng(12)
    q, k, v = _qkv(rng, B=2, Hq=2, Hkv=2, Q=5, K=7)
    bias = rng.standard_normal((1, 2, 1, 7))
    call = refattn.AttentionCall(q, k, v, bias=bias)
    g = rng.standard_normal((2, 2, 5, 3))
    t = refattn.forward(call, backend="numba", materialize=False)
    grads = refattn.backward(t, g)
    ref = refattn.backward(refattn.forward(call), g)
    arrays = [t.output, t.lse, t.row_max, grads.grad_q, grads.grad_k, grads.grad_v,
              grads.grad_bias, grads.row_dot]
    for i, a in enumerate(arrays):
        for b in arrays[i + 1:]:
            assert not np.shares_memory(a, b)
    for name in ("grad_q", "grad_k", "grad_v", "grad_bias"):
        np.testing.assert_allclose(getattr(grads, name), getattr(ref, name), rtol=1e-12,
                                   atol=1e-13)


def test_a_relation_call_streams_without_its_dense_relation():
    # AttentionCall keeps a VisibilityRelation as coordinates: the gate checks rows block by
    # block and the streaming kernels evaluate tiles, so no (Q, K) mask is ever built
    Q = K = 4096
    rng = np.random.default_rng(13)
    q, k, v = _qkv(rng, B=1, Hq=1, Hkv=1, Q=Q, K=K, Dk=4, Dv=4)
    g = rng.standard_normal((1, 1, Q, 4))
    rel = causal(Q, K, alignment="upper_left")
    small = refattn.AttentionCall(q[:, :, :64], k[:, :, :64], v[:, :, :64],
                                  visible=causal(64, 64, alignment="upper_left"))
    refattn.backward(refattn.forward(small, backend="numba", materialize=False),
                     g[:, :, :64])  # compile outside the trace
    tracemalloc.start()
    try:
        call = refattn.AttentionCall(q, k, v, visible=rel)
        t = refattn.forward(call, backend="numba", materialize=False)
        refattn.backward(t, g)
        call.manifest()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    mask_bytes = Q * K  # the dense bool relation: 16 MiB
    assert peak < mask_bytes / 2, peak
    assert "_visible_dense" not in call.__dict__
    dense = call.visible_array()  # dense consumers (the reference) build it once, on demand
    assert dense is call.visible_array() and dense.shape == (1, 1, Q, K)
    assert np.array_equal(dense[0, 0, :5, :5], np.tri(5, dtype=bool))
