"""Warp pairs (SPLIT = 2): the general forward at D = 128 (forward.cuh), the wide dq at D = 128
(backward.cuh, H100/H200: 32-key tiles in 192 KiB) and the general dk/dv at D = 128
(backward.cuh). The two warps of a forward or dq pair own the same 16 query rows and split the
tile's keys for S (and dP) and the output's columns for P V (dQ's for dS K); the forward swaps
row maxima, P~ Z halves and row sums, the dq dS halves and the row sums of row_dot and the bias
gradient, through shared memory. A dk/dv pair owns 16 keys, splits the head width for K Q^T and
V G_O^T, swaps the partial sums of each other's queries, then P Z and dS, and splits dV's and
dK's columns. Every feature that touches those (the sink's share of the row sum, rows with
nothing visible yet, a tail tile, dense and Philox dropout, softcap, masks, query_valid, GQA,
every bias gradient mode) against the NumPy reference on the CPU emulator, and the emulator
catching a pair's missing barrier or a wrong exchange."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

import refattn
from gpu_backend import launch
from gpu_backend.emulator_backend import EmulatorDevice
from refattn.dropout import Philox
from refattn.masks import causal
from tests.gpu.test_emulator import _mutated, assert_matches_reference
from tests.gpu.test_feature_instances import A100_SHARED, H100_SHARED, _Device

Q, K = 45, 100  # 2 query blocks of 32 rows (the second ends inside it), 4 key tiles (a tail)


def _block_sparse() -> np.ndarray:
    """Blocks of 32 queries x 40 keys plus each query's first 3 keys; rows 5-8 see nothing."""
    qi, kj = np.arange(Q)[:, None], np.arange(K)[None, :]
    vis = (qi // 32 == kj // 40) | (kj < 3)
    vis[5:9] = False
    return vis


def _call(kind: str, rng: np.random.Generator) -> refattn.AttentionCall:
    q = rng.standard_normal((1, 2, Q, 100))
    k = rng.standard_normal((1, 1, K, 100))
    v = rng.standard_normal((1, 1, K, 128))
    sink = np.array([0.5, -1.0])
    if kind == "dense":  # a dense mask, dense dropout multipliers, sanitised rows
        vis = _block_sparse()
        z = (rng.random((1, 2, Q, K)) >= 0.25) / 0.75
        return refattn.AttentionCall(q, k, v, visible=vis, dropout=z, sink=sink,
                                     bias=rng.standard_normal((1, 2, Q, K)),
                                     all_masked_rows="sanitize_then_zero_invalid_query",
                                     query_valid=vis.any(axis=1)[None, None, :, None])
    # a relation (the first rows see no key before the diagonal's tiles), Philox, softcap
    return refattn.AttentionCall(q, k, v, visible=causal(Q, K, alignment="upper_left"),
                                 dropout=Philox(0.2, 13), sink=sink, softcap=4.0,
                                 bias=rng.standard_normal((1, 1, 1, K)))


@pytest.mark.parametrize("kind", ["dense", "relation"])
def test_the_d128_forward_on_warp_pairs_matches_the_reference(kind):
    rng = np.random.default_rng(128)
    call = _call(kind, rng)
    g_o = rng.standard_normal((1, 2, Q, 128))
    t = refattn.forward(call, backend="cuda_emulator", materialize=False)
    assert (t.materialized["head_width"], t.materialized["block_q"]) == (128, 32)
    assert t.materialized["block_k"] == 32
    g = refattn.backward(t, g_o)
    assert_matches_reference(call, g_o, t, g, f"pairs {kind}")
    again = refattn.forward(call, backend="cuda_emulator", materialize=False)
    for name, value in t.tensors().items():  # bit-identical run to run
        np.testing.assert_array_equal(again.tensors()[name], value, err_msg=name)


def _outputs(directory, call, seeds=(0, 1, 2)) -> list[np.ndarray]:
    return [launch.forward(EmulatorDevice(directory, debug=True, seed=s), call,
                           materialize=False).output for s in seeds]


def test_a_missing_pair_barrier_is_caught(tmp_path):
    """Mutation: without the barrier between the pair's P~ Z writes and its reads, a warp
    reads its partner's half before it is written (the K values still in the buffer)."""
    put = "    refattn_pair_put<MR, NT>(ex, p, warp, lane);\n"
    d = _mutated(tmp_path, put + "    __syncthreads();\n", put,
                 "products.cuh")  # (refattn_pair_pb)
    call = _call("relation", np.random.default_rng(1))
    ref = refattn.forward(call).output
    outs = _outputs(d, call)
    assert any(not np.allclose(o, ref, rtol=1e-12, atol=1e-12) for o in outs)


def test_the_sink_counted_by_both_warps_of_a_pair_is_caught(tmp_path):
    """Mutation: the sink's exp(0) = 1 joins the row sum once; counted by both warps of the
    pair, every row's sum is 1 too large and the output too small."""
    d = _mutated(tmp_path, "l[mr] = c.has_sink && half == 0 ? 1.0 : 0.0;",
                 "l[mr] = c.has_sink ? 1.0 : 0.0;", "forward.cuh")
    call = _call("relation", np.random.default_rng(2))
    out = _outputs(d, call, (0,))[0]
    assert not np.allclose(out, refattn.forward(call).output, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bias_shape", [(1, 2, Q, K), (1, 2, Q, 1), (1, 1, 1, K)],
                         ids=["per-element", "per-query", "per-key"])
@pytest.mark.parametrize(("limit", "dq"), [(H100_SHARED, "attention_dq_wide_d128"),
                                           (A100_SHARED, "attention_dq_d128")],
                         ids=["H100", "A100"])
def test_the_d128_dq_on_warp_pairs_where_the_device_holds_it(limit, dq, bias_shape):
    """The wide dq (warp pairs, 192 KiB) on an H100's shared memory, the general one on an
    A100's; both give the reference's gradients, row_dot (through the sink's gradient) and the
    bias gradient of each mode (per element: written by dq; summed over keys: dq's row sums;
    summed over queries: dk/dv)."""
    rng = np.random.default_rng(7)
    call = _call("dense", rng)
    call = dataclasses.replace(call, bias=rng.standard_normal(bias_shape))
    g_o = rng.standard_normal((1, 2, Q, 128))
    dev = _Device(limit)
    t = launch.forward(dev, call, materialize=False)
    g = launch.backward(dev, t, g_o)
    assert [k for k in dev.kernels if k.startswith("attention_dq")] == [dq]
    assert g.grad_bias.shape == bias_shape
    assert_matches_reference(call, g_o, t, g, dq)


def test_a_missing_dq_pair_barrier_is_caught(tmp_path):
    """Mutation: without the barrier after every warp's dP, a warp writes its dS half over the
    V tile that another warp's G_O V^T may still be reading. Caught because the debug emulator
    lets warps drift apart between barriers (one warp operation resolved per round); with the
    warps in lockstep, as before, every seed gave the reference's dQ (1.6e-15 off)."""
    computed = "            // dP is computed\n"
    d = _mutated(tmp_path, computed + "            __syncthreads();\n", computed, "backward.cuh")
    rng = np.random.default_rng(3)
    call = _call("relation", rng)
    g_o = rng.standard_normal((1, 2, Q, 128))
    want = refattn.backward(refattn.forward(call), g_o).grad_q
    wrong = 0
    for seed in (0, 1, 2):
        dev = EmulatorDevice(d, debug=True, seed=seed)
        g = launch.backward(dev, launch.forward(dev, call, materialize=False), g_o)
        wrong += not np.allclose(g.grad_q, want, rtol=1e-12, atol=1e-12)
    assert wrong


@pytest.mark.parametrize("kind", ["dense", "relation"])
@pytest.mark.parametrize("limit", [H100_SHARED, A100_SHARED], ids=["H100", "A100"])
def test_the_d128_dkdv_on_warp_pairs_matches_the_reference(kind, limit):
    """The general dk/dv at D = 128 (pairs) on both devices' limits: gradients of K, V and the
    bias (per element, summed over queries by the pair's row sums for the per-key bias), two
    query heads on one kv head, a key block ending inside its first pair (K = 100) and a query
    tail tile; bit-identical run to run."""
    rng = np.random.default_rng(11)
    call = _call(kind, rng)
    g_o = rng.standard_normal((1, 2, Q, 128))
    grads = []
    for _ in range(2):
        dev = _Device(limit)
        t = launch.forward(dev, call, materialize=False)
        grads.append(launch.backward(dev, t, g_o))
        assert [k for k in dev.kernels if k.startswith("attention_dkdv")] == [
            "attention_dkdv_d128"]
    assert_matches_reference(call, g_o, t, grads[0], f"dkdv pairs {kind}")
    for name in ("grad_k", "grad_v", "grad_bias"):
        np.testing.assert_array_equal(getattr(grads[1], name), getattr(grads[0], name),
                                      err_msg=name)


def _dkdv_wrong(directory, seeds=(0, 1, 2)) -> int:
    """How many of the debug emulator's warp orders give a dK or dV off the reference's. The
    dense call: no Philox draws (warp shuffles) between the pair's exchanges, so a warp runs
    from one exchange to the next without stopping (the emulator's threads run until a warp
    operation or a barrier) and a missing barrier between them shows in every warp order."""
    rng = np.random.default_rng(5)
    call = _call("dense", rng)
    g_o = rng.standard_normal((1, 2, Q, 128))
    want = refattn.backward(refattn.forward(call), g_o)
    wrong = 0
    for seed in seeds:
        dev = EmulatorDevice(directory, debug=True, seed=seed)
        g = launch.backward(dev, launch.forward(dev, call, materialize=False), g_o)
        wrong += not (np.allclose(g.grad_k, want.grad_k, rtol=1e-12, atol=1e-12)
                      and np.allclose(g.grad_v, want.grad_v, rtol=1e-12, atol=1e-12))
    return wrong


def test_the_unmutated_dkdv_pairs_are_right_in_every_warp_order():
    from gpu_backend.source import KERNEL_DIR

    assert _dkdv_wrong(KERNEL_DIR) == 0


@pytest.mark.parametrize(("old", "new"), [
    # the partner's partial sums read before it wrote them
    ("                __syncthreads();\n                double part[NTW * W];",
     "                double part[NTW * W];"),
    # P Z written over partial sums the partner has not read yet
    ("                __syncthreads();  // the regions free for P Z and dS\n", ""),
    # the warp's own partial sum added to itself instead of the partner's
    ("refattn_pair_get<MRW, NTW>(part, sXS, half ^ 1, warp, lane);",
     "refattn_pair_get<MRW, NTW>(part, sXS, half, warp, lane);"),
], ids=["partial-sums-barrier", "regions-free-barrier", "own-partial-sum"])
def test_a_broken_dkdv_pair_exchange_is_caught(tmp_path, old, new):
    """Mutations of the dk/dv pair's exchanges, each caught in every warp order."""
    assert _dkdv_wrong(_mutated(tmp_path, old, new, "backward.cuh")) == 3


def test_the_paired_instances_are_the_ones_source_paired_lists():
    """source.PAIRED (which launch.shared_bytes reads for a paired dk/dv's layout) names exactly
    the entry points of attention.cu instantiated with SPLIT = 2."""
    from gpu_backend.source import KERNEL_DIR, PAIRED

    src = (KERNEL_DIR / "attention.cu").read_text()
    entries = re.findall(r"void attention_(\w+?)_(?:(plain|wide)_)?d(\d+)\(REFATTN_ARGS\) \{\s*"
                         r"(?:REFATTN_SM90_ONLY\()?refattn_\1<\d+, \d+, \d+, \w+, 2>", src)
    found = {(fs or "general", kind, int(d)) for kind, fs, d in entries}
    assert found == {(fs, kind, d) for fs, kinds in PAIRED.items() for kind, dims in kinds.items()
                     for d in dims}
    assert ("general", "dkdv", 128) in found and ("plain", "dkdv", 128) in found
