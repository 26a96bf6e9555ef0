"""Warp pairs (SPLIT = 2): the general forward, dq and dk/dv at D = 128, the general dk/dv at
D = 64 (dV in registers, half of dK in shared memory: two blocks per SM) (forward.cuh,
backward.cuh) and the wide dq (H100/H200: 32-key tiles in 208 KiB). Every pair splits the head
width for its first products, swaps the partial sums of each other's half of the tile and adds
them. The two warps of a forward pair (16 query rows, 16-key tiles: two blocks per SM on an
H100/H200) then swap row maxima, P~ Z halves and row sums through shared memory and split the
output's columns for P V. A dq pair (16 query rows) or dk/dv pair (16 keys) swaps dS (and P Z)
and splits dQ's (dV's and dK's) columns; dq pairs add their row sums of row_dot and the bias
gradient. Every
feature that touches those (the sink's share of the row sum, rows with nothing visible yet, a
tail tile, dense and Philox dropout, softcap, masks, query_valid, GQA, every bias gradient mode)
against the NumPy reference on the CPU emulator, and the emulator catching a pair's missing
barrier or a wrong exchange."""

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
from tests.gpu.test_feature_instances import (
    A100_SHARED,
    H100_SHARED,
    _assert_bit_identical,
    _backward_twice,
)

Q, K = 45, 100  # 2 query blocks of 32 rows (the second ends inside it), 4 key tiles (a tail)


def _block_sparse() -> np.ndarray:
    """Blocks of 32 queries x 40 keys plus each query's first 3 keys; rows 5-8 see nothing."""
    qi, kj = np.arange(Q)[:, None], np.arange(K)[None, :]
    vis = (qi // 32 == kj // 40) | (kj < 3)
    vis[5:9] = False
    return vis


def _call(kind: str, rng: np.random.Generator, dk: int = 100,
          dv: int = 128) -> refattn.AttentionCall:
    q = rng.standard_normal((1, 2, Q, dk))
    k = rng.standard_normal((1, 1, K, dk))
    v = rng.standard_normal((1, 1, K, dv))
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
    assert t.materialized["block_k"] == 16
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


@pytest.mark.parametrize(("mutant", "original"), [
    ("", "            __syncthreads();  // the partner's partial sums of this warp's keys "
         "written\n"),
    ("refattn_pair_add<MRW, NTW>(s, sXS, half ^ 1, warp, lane);",
     "refattn_pair_add<MRW, NTW>(s, sXS, half, warp, lane);"),
], ids=["no-partial-sums-barrier", "own-partial-sums-added"])
def test_a_wrong_partial_sum_exchange_in_the_forward_is_caught(tmp_path, mutant, original):
    """Mutations of the forward pair's S over split head widths: without the barrier between
    the partial sums' writes and reads a warp adds whatever its partner has not yet written
    (caught in some warp order), and adding the warp's own partial sums instead of its
    partner's doubles half of every score."""
    d = _mutated(tmp_path, original, mutant, "forward.cuh")
    call = _call("relation", np.random.default_rng(3))
    ref = refattn.forward(call).output
    outs = _outputs(d, call)
    assert any(not np.allclose(o, ref, rtol=1e-12, atol=1e-12) for o in outs)


def test_an_exchange_written_and_read_in_different_orders_is_caught(tmp_path):
    """P~ Z, dS and P Z cross the pairs in A fragment order (products.cuh refattn_a_order):
    written in C order and read in A order, the two middle values of every lane's n-tile trade
    places (row g's second column with row g + 8's first), which the forward's P V shows."""
    d = _mutated(tmp_path, "(A_ORDER ? refattn_a_order<MR>(e) : e)] =\n", "e] =\n",
                 "products.cuh")  # (refattn_pair_put)
    call = _call("relation", np.random.default_rng(4))
    ref = refattn.forward(call).output
    assert all(not np.allclose(o, ref, rtol=1e-12, atol=1e-12) for o in _outputs(d, call))


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
    """The wide dq (warp pairs, 32-key tiles, 208 KiB) on an H100's shared memory, the general
    one (warp pairs, 16-key tiles, 136 KiB) on an A100's; both give the reference's gradients,
    row_dot (through the sink's gradient) and the bias gradient of each mode (per element:
    written by dq; summed over keys: dq's row sums; summed over queries: dk/dv), bit-identical
    run to run."""
    rng = np.random.default_rng(7)
    call = _call("dense", rng)
    call = dataclasses.replace(call, bias=rng.standard_normal(bias_shape))
    g_o = rng.standard_normal((1, 2, Q, 128))
    t, grads, kernels = _backward_twice(limit, call, g_o, "attention_dq")
    assert kernels == [[dq]] * 2
    assert grads[0].grad_bias.shape == bias_shape
    assert_matches_reference(call, g_o, t, grads[0], dq)
    _assert_bit_identical(grads, ("grad_q", "grad_bias", "grad_sink"))


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
    t, grads, kernels = _backward_twice(limit, call, g_o, "attention_dkdv")
    assert kernels == [["attention_dkdv_d128"]] * 2
    assert_matches_reference(call, g_o, t, grads[0], f"dkdv pairs {kind}")
    _assert_bit_identical(grads, ("grad_k", "grad_v", "grad_bias"))


@pytest.mark.parametrize("kind", ["dense", "relation"])
def test_the_d64_dkdv_on_warp_pairs_matches_the_reference(kind):
    """The general dk/dv at D = 64 (pairs: dV in registers, half of dK in shared memory, 80 KiB)
    with every feature: gradients of K, V and the bias; bit-identical run to run."""
    rng = np.random.default_rng(64)
    call = _call(kind, rng, 60, 64)
    g_o = rng.standard_normal((1, 2, Q, 64))
    t, grads, kernels = _backward_twice(H100_SHARED, call, g_o, "attention_dkdv")
    assert kernels == [["attention_dkdv_d64"]] * 2
    assert_matches_reference(call, g_o, t, grads[0], f"dkdv d64 pairs {kind}")
    _assert_bit_identical(grads, ("grad_k", "grad_v", "grad_bias"))


def _wrong_grads(directory, seeds=(0, 1, 2), widths=(100, 128),
                 shared=A100_SHARED) -> list[set[str]]:
    """For each of the debug emulator's warp orders, the gradients of Q, K and V off the
    reference's, on an A100's shared memory by default (at D = 128 the general dq and dk/dv,
    both on pairs; at D = 64 the dk/dv; an H100's runs the wide dq at D = 128). The dense
    call: no Philox draws (warp shuffles) between the pairs' exchanges, so a warp runs from one
    exchange to the next without stopping (the emulator's threads run until a warp operation
    or a barrier) and a missing barrier between them shows in every warp order."""
    rng = np.random.default_rng(5)
    call = _call("dense", rng, *widths)
    g_o = rng.standard_normal((1, 2, Q, widths[1]))
    want = refattn.backward(refattn.forward(call), g_o)
    wrong = []
    for seed in seeds:
        dev = EmulatorDevice(directory, debug=True, seed=seed)
        dev.max_shared_bytes = shared
        g = launch.backward(dev, launch.forward(dev, call, materialize=False), g_o)
        wrong.append({name for name in ("grad_q", "grad_k", "grad_v") if not np.allclose(
            getattr(g, name), getattr(want, name), rtol=1e-12, atol=1e-12)})
    return wrong


@pytest.mark.parametrize(("widths", "shared"), [((100, 128), A100_SHARED),
                                                ((100, 128), H100_SHARED),
                                                ((60, 64), A100_SHARED)],
                         ids=["d128", "d128-wide", "d64"])
def test_the_unmutated_pairs_are_right_in_every_warp_order(widths, shared):
    from gpu_backend.source import KERNEL_DIR

    assert _wrong_grads(KERNEL_DIR, widths=widths, shared=shared) == [set()] * 3


@pytest.mark.parametrize(("old", "new", "grads"), [
    # both: the partner's partial sums read before it wrote them (those of the second product:
    # the first one's were written before the warp's second product, so only dS goes wrong,
    # and with it dQ and dK)
    ("        __syncthreads();  // the partner's partial sums of this warp's columns written\n",
     "", {"grad_q", "grad_k"}),
    # dq: the partner's dS half read from the V buffer before it wrote it
    ("            refattn_pair_put<MRW, NTW>(sV + buf * BK * D, s, warp, lane);\n"
     "            __syncthreads();\n",
     "            refattn_pair_put<MRW, NTW>(sV + buf * BK * D, s, warp, lane);\n", {"grad_q"}),
    # dk/dv: P Z written over partial sums the partner has not read yet
    ("                __syncthreads();  // the regions free for P Z and dS\n", "",
     {"grad_k", "grad_v"}),
], ids=["partial-sums-barrier", "dq-ds-barrier", "dkdv-regions-free-barrier"])
def test_a_broken_pair_exchange_is_caught(tmp_path, old, new, grads):
    """Mutations of the dq and dk/dv pairs' exchanges (backward.cuh), each caught in every warp
    order in the gradients it feeds."""
    assert all(grads <= w for w in _wrong_grads(_mutated(tmp_path, old, new, "backward.cuh")))


def test_a_pair_adding_its_own_partial_sum_is_caught(tmp_path):
    """The warp's own partial sum added to itself instead of the partner's (products.cuh):
    S and dP wrong in both kernels, so are dQ, dK and dV, in every warp order; at D = 64 (only
    the dk/dv on pairs) dK and dV."""
    old = "refattn_pair_get<MR, NT, false>(part, ex, half ^ 1, warp, lane);"
    d = _mutated(tmp_path, old, old.replace("half ^ 1", "half"), "products.cuh")
    assert _wrong_grads(d) == [{"grad_q", "grad_k", "grad_v"}] * 3
    assert _wrong_grads(d, widths=(60, 64)) == [{"grad_k", "grad_v"}] * 3


def test_the_wide_dq_s_swapped_n_tiles_are_checked(tmp_path):
    """The wide dq (32-key tiles, NT = 4) computes the odd warp's own n-tiles first
    (refattn_mma_abt's swap): with the second half's offset left unswapped the odd warp sends
    its own keys' partial sums as its partner's, and dQ is wrong in every warp order on an
    H100's shared memory (the A100's general dq, NT = 2, does not swap)."""
    old = "off_hi = swap ? -HALF_ROWS : 0;"
    d = _mutated(tmp_path, old, "off_hi = 0;", "products.cuh")
    assert all("grad_q" in w for w in _wrong_grads(d, shared=H100_SHARED))
    assert _wrong_grads(d, seeds=(0,)) == [set()]


def test_the_d64_dkdv_pairs_regions_barrier_is_caught(tmp_path):
    """dk/dv at D = 64 on pairs: P Z written over partial sums the partner has not read yet
    (backward.cuh's barrier removed), caught in every warp order in dK and dV."""
    d = _mutated(tmp_path, "                __syncthreads();  // the regions free for P Z and dS\n",
                 "", "backward.cuh")
    assert all({"grad_k", "grad_v"} <= w for w in _wrong_grads(d, widths=(60, 64)))


def test_the_paired_instances_are_the_ones_source_paired_lists():
    """source.PAIRED (which launch.shared_bytes reads for a paired dk/dv's layout) names exactly
    the entry points of attention.cu instantiated with SPLIT = 2."""
    from gpu_backend.source import KERNEL_DIR, PAIRED

    src = (KERNEL_DIR / "attention.cu").read_text()
    entries = re.findall(r"void attention_(\w+?)_(?:(plain|wide)_)?d(\d+)\(REFATTN_ARGS\) \{\s*"
                         r"(?:REFATTN_SM90_ONLY\()?refattn_\1<\d+, \d+, \d+, \w+, 2(?:, [012])?>",
                         src)
    found = {(fs or "general", kind, int(d)) for kind, fs, d in entries}
    assert found == {(fs, kind, d) for fs, kinds in PAIRED.items() for kind, dims in kinds.items()
                     for d in dims}
    assert {("general", "dq", 128), ("general", "dkdv", 128), ("plain", "dkdv", 128),
            ("general", "dkdv", 64)} <= found
