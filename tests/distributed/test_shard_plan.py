"""Shard plans and shard arithmetic without a cluster: the query and key shards, run here one
after another and assembled, are bit-identical to the single-process streaming run."""

from __future__ import annotations

import sys
from pathlib import Path

import numba
import numpy as np
import pytest

import refattn
from refattn.distributed.cluster import connect
from refattn.distributed.shard import (
    _assemble,
    _check_grad_output,
    key_shard,
    plan_shards,
    query_shard,
    value_and_grad,
)
from refattn.dropout import Philox
from refattn.errors import RefAttnError
from refattn.masks import relation

NAMES = ("grad_q", "grad_k", "grad_v", "grad_bias", "row_dot", "row_dot_output")


def run_here(call, g, plan):
    """The tasks value_and_grad submits, run in this process in plan order."""
    g = _check_grad_output(call, g)
    results = {}
    for u, unit in enumerate(plan.units):
        threads = plan.unit_threads(unit)
        fwd = []
        for r, rng in enumerate(plan.query_ranges):
            res = query_shard(call, g, unit, rng, plan.block_q, plan.block_k,
                              not plan.split_backward, threads)
            results[("q", (u, r))] = res
            fwd.append(res)
        if plan.split_backward:
            for r, rng in enumerate(plan.key_ranges):
                results[("k", (u, r))] = key_shard(call, g, unit, rng, plan.block_q,
                                                   plan.block_k, fwd, threads)
    return _assemble(call, g, plan, results)


def local(call, g, bq, bk):
    trace = refattn.forward(call, backend="numba", materialize=False, block_q=bq, block_k=bk)
    return trace.output, refattn.backward(trace, g)


def assert_same(a, b):
    out0, g0 = a
    out1, g1 = b
    assert out0.tobytes() == out1.tobytes()
    for n in NAMES:
        x, y = getattr(g0, n), getattr(g1, n)
        assert (x is None) == (y is None), n
        if x is not None:
            assert x.shape == y.shape and x.tobytes() == y.tobytes(), n


def _inputs(B=2, Hq=4, Hkv=2, Q=24, K=20, D=4, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, Hq, Q, D)), rng.standard_normal((B, Hkv, K, D)),
            rng.standard_normal((B, Hkv, K, D)), rng.standard_normal((B, Hq, Q, D)), rng)


@pytest.mark.parametrize("kind", ["plain", "prefix_segments_philox", "bias_q", "bias_k",
                                  "bias_both", "one_head"])
@pytest.mark.parametrize("rows", [None, 8])
def test_shards_run_here_are_bit_identical(kind, rows):
    q, k, v, g, rng = _inputs()
    B, Hq, Q, _ = q.shape
    K = k.shape[2]
    kw = {}
    if kind == "prefix_segments_philox":
        pos = np.arange(Q)[None]
        seg = (np.arange(Q) >= 10)[None].astype(np.int64)
        kpos, kseg = pos[:, :K], seg[:, :K]
        kw = {"visible": relation(pos, kpos, prefix_length=4)
              & relation(pos, kpos, q_segment=seg, k_segment=kseg, layout="packed"),
              "dropout": Philox(0.3, seed=11, offset=2),
              "all_masked_rows": "sanitize_then_zero_invalid_query",
              "query_valid": (np.arange(Q) < 20)[None, None, :, None]}
    elif kind == "bias_q":  # broadcast over keys: its gradient comes from the query shards
        kw = {"bias": rng.standard_normal((B, 1, Q, 1))}
    elif kind == "bias_k":  # broadcast over queries: from the key shards
        kw = {"bias": rng.standard_normal((1, Hq, 1, K))}
    elif kind == "bias_both":
        kw = {"bias": rng.standard_normal((B, 1, 1, 1))}
    if kind == "one_head":  # B * Hq = 1 < numba's threads: the local run deals key chunks
        q, k, v, g = q[:1, :1], k[:1, :1], v[:1, :1], g[:1, :1]
    call = refattn.AttentionCall(q, k, v, **kw)
    plan = plan_shards(call, block_q=4, block_k=4, rows_per_shard=rows)
    if kind == "bias_both" and rows is not None:
        assert not plan.split_backward and "both queries and keys" in plan.reason
    assert_same(local(call, g, 4, 4), run_here(call, g, plan))


def test_plan_follows_the_bias_and_head_map():
    q, k, v, _g, rng = _inputs(B=2, Hq=4, Hkv=2)
    call = refattn.AttentionCall(q, k, v, head_map=np.array([1, 1, 1, 0]))
    plan = plan_shards(call, block_q=4, block_k=4, rows_per_shard=8, threads=1)
    assert [(u.batch, u.heads, u.kv) for u in plan.units] == [
        ((0,), (3,), (0,)), ((0,), (0, 1, 2), (1,)), ((1,), (3,), (0,)), ((1,), (0, 1, 2), (1,))]
    assert plan.query_ranges == ((0, 8), (8, 16), (16, 24))
    assert plan.key_ranges == ((0, 8), (8, 16), (16, 20))
    assert plan.tasks == 4 * 3 + 4 * 3
    shared = refattn.AttentionCall(q, k, v, bias=rng.standard_normal((1, 4, 24, 20)))
    assert [u.batch for u in plan_shards(shared, threads=1).units] == [(0, 1), (0, 1)]
    per_b = refattn.AttentionCall(q, k, v, bias=rng.standard_normal((2, 1, 24, 20)))
    assert [u.heads for u in plan_shards(per_b, threads=1).units] == [(0, 1, 2, 3)] * 2
    one = refattn.AttentionCall(q[:1, :1], k[:1, :1], v[:1, :1])
    plan = plan_shards(one, block_k=4, threads=3)
    assert plan.key_chunks == 3 and plan.unit_threads(plan.units[0]) == 3


@pytest.mark.parametrize("kw, expected", [
    ({"rows_per_shard": 0}, "rows_per_shard: expected a positive int"),
    ({"block_q": 0}, "block_q: expected a positive int"),
    ({"threads": 0}, "threads: expected a positive int"),
])
def test_bad_plan_arguments_are_named(kw, expected):
    q, k, v, _g, _ = _inputs()
    with pytest.raises(RefAttnError) as err:
        plan_shards(refattn.AttentionCall(q, k, v), **kw)
    assert expected in str(err.value)


@pytest.mark.parametrize("kw, expected", [
    ({"softcap": 2.0}, "softcap: the numba streaming backend supports only None"),
    ({"returned_weights": "pre_dropout"}, "returned_weights: 'pre_dropout' asks for weights"),
    ({"scale_placement": "q"}, "scale_placement"),
])
def test_calls_the_streaming_backend_cannot_run_are_refused_before_any_task(kw, expected):
    q, k, v, g, _ = _inputs()
    with pytest.raises(RefAttnError) as err:
        value_and_grad(refattn.AttentionCall(q, k, v, **kw), g, client=object())
    assert expected in str(err.value)


def test_bad_grad_output_and_missing_client_are_named():
    q, k, v, g, _ = _inputs()
    call = refattn.AttentionCall(q, k, v)
    with pytest.raises(RefAttnError, match="grad_output"):
        value_and_grad(call, g[..., :2], client=object())
    with pytest.raises(RefAttnError, match="grad_output"):
        value_and_grad(call, g.astype(np.float32), client=object())
    with pytest.raises(RefAttnError, match="client: value_and_grad shards a call"):
        value_and_grad(call, g, client=None)


def test_oversized_philox_shard_is_refused_before_any_task(monkeypatch):
    from refattn.distributed import shard

    q, k, v, g, _ = _inputs()
    monkeypatch.setattr(shard, "MAX_SHARD_MULTIPLIER_BYTES", 1000)
    call = refattn.AttentionCall(q, k, v, dropout=Philox(0.1, seed=1))
    with pytest.raises(RefAttnError, match="pass a smaller rows_per_shard"):
        value_and_grad(call, g, client=object(), block_q=4, block_k=4)


def test_more_threads_than_a_worker_has_is_named():
    q, k, v, g, _ = _inputs()
    call = refattn.AttentionCall(q[:1, :1], k[:1, :1], v[:1, :1])
    plan = plan_shards(call, block_k=4, threads=numba.config.NUMBA_NUM_THREADS + 1)
    with pytest.raises(RefAttnError, match=r"needs \d+ numba threads in a task"):
        run_here(call, g[:1, :1], plan)


def test_without_dask_every_entry_point_says_how_to_install_it(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "distributed", None)  # as if not installed
    # the hint names the index package or, from a checkout, the checkout (refattn._install)
    with pytest.raises(RefAttnError, match=r"pip install .*\[distributed\]"):
        with connect(workers=1):
            pass
    from refattn.cli import main

    spec = Path(__file__).resolve().parents[2] / "examples" / "sweep.toml"
    out = tmp_path / "b"
    assert main(["sweep", str(spec), "--out", str(out), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "[distributed]" in err and "pip install" in err
    assert not out.exists()


def test_workers_and_scheduler_together_are_refused():
    with pytest.raises(RefAttnError, match="give one or the other"):
        with connect(workers=1, scheduler="tcp://127.0.0.1:1"):
            pass
