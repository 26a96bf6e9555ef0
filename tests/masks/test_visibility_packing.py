"""Issue 3: packing metadata and the contract's "Packing conformance test", run through
refattn.forward / refattn.backward."""

from __future__ import annotations

import numpy as np
import pytest

import refattn
from refattn import AttentionCall, RefAttnError
from refattn.masks import (
    causal,
    cu_seqlens_from_lengths,
    pack,
    pair_counts,
    relation,
    segments_from_cu_seqlens,
    unpack,
)
from refattn.masks.framework import from_cu_seqlens, to_cu_seqlens

LENGTHS = [3, 4, 5, 4]  # A11's lengths in the contract
H, DK, DV = 2, 4, 3


def test_contract_pair_counts_and_cu_seqlens():
    assert cu_seqlens_from_lengths(LENGTHS).tolist() == [0, 3, 7, 12, 16]
    assert pair_counts(LENGTHS) == (100, 66, 256)


def test_pair_counts_equal_counted_relations():
    cu = cu_seqlens_from_lengths(LENGTHS)
    counts = pair_counts(LENGTHS)
    # independent = edges of the block-diagonal (non-causal) relation, counted
    assert counts.independent == int(from_cu_seqlens(cu, causal=False).sum())
    # padded = every slot pair of a B x L x L batch; unrestricted = the full T x T matrix
    L, T = max(LENGTHS), sum(LENGTHS)
    assert counts.padded == int(np.ones((len(LENGTHS), L, L)).sum())
    assert counts.unrestricted == int(np.ones((T, T)).sum())


def test_contract_segment_ids_and_positions():
    seg = segments_from_cu_seqlens(cu_seqlens_from_lengths([3, 4, 2, 3]))
    # the contract's packed example, verbatim
    assert seg.segment_ids.tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3]
    assert seg.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 0, 1, 2]


def test_pack_unpack_round_trip():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, H, 5, DK))
    packed = pack(x, LENGTHS)
    assert packed.values.shape == (1, H, 16, DK)
    assert packed.segment_ids.shape == packed.positions.shape == (1, 16)
    back = unpack(packed.values, packed.cu_seqlens)
    for b, n in enumerate(LENGTHS):
        assert np.array_equal(back[b, :, :n], x[b, :, :n])
        assert (back[b, :, n:] == 0.0).all()
    assert unpack(packed.values, packed.cu_seqlens, length=7).shape == (4, H, 7, DK)


# -- packing conformance: packed block-diagonal causal == each example alone ----------------
def _examples(seed: int = 0, lengths=LENGTHS):
    rng = np.random.default_rng(seed)
    L = max(lengths)
    q, k, v, g = (rng.standard_normal((len(lengths), H, L, d)) for d in (DK, DK, DV, DV))
    return q, k, v, g


def _alone(q, k, v, g, lengths=LENGTHS):
    """Each example run on its own with its own causal triangle (an empty one has no rows)."""
    outs, grads = [], []
    for b, n in enumerate(lengths):
        if n == 0:
            outs.append(None)
            grads.append(None)
            continue
        call = AttentionCall(q[b:b + 1, :, :n], k[b:b + 1, :, :n], v[b:b + 1, :, :n],
                             visible=causal(n, n, alignment="upper_left"))
        trace = refattn.forward(call)
        outs.append(trace.output)
        grads.append(refattn.backward(trace, g[b:b + 1, :, :n]))
    return outs, grads


def _packed_run(q, k, v, g, *, segments: bool, causal_: bool = True, global_positions=False,
                lengths=LENGTHS):
    pq, pk, pv, pg = (pack(x, lengths) for x in (q, k, v, g))
    T = int(sum(lengths))
    pos = np.arange(T)[None] if global_positions else pq.positions
    ids = pq.segment_ids if segments else None
    rel = relation(pos, pos, causal=causal_, q_segment=ids, k_segment=ids)
    trace = refattn.forward(AttentionCall(pq.values, pk.values, pv.values, visible=rel))
    grads = refattn.backward(trace, pg.values)
    return rel, trace, grads, pq.cu_seqlens


#: the contract's lengths, and batches with empty sequences (repeated cu_seqlens offsets) at
#: the start, in the middle, twice in a row and at the end
EQUIVALENCE_LENGTHS = [LENGTHS, [0, 3, 4], [3, 0, 4, 5], [2, 0, 0, 3, 1], [4, 1, 0]]


@pytest.mark.parametrize("lengths", EQUIVALENCE_LENGTHS, ids=str)
def test_packed_equals_separate_with_empty_sequences(lengths):
    q, k, v, g = _examples(5, lengths)
    outs, grads = _alone(q, k, v, g, lengths)
    rel, trace, pgrads, cu = _packed_run(q, k, v, g, segments=True, lengths=lengths)
    assert cu.tolist() == [0, *np.cumsum(lengths).tolist()]  # empty ones repeat an offset
    tol = dict(rtol=1e-12, atol=1e-14)
    out = unpack(trace.output, cu)
    gq, gk, gv = (unpack(getattr(pgrads, n), cu) for n in ("grad_q", "grad_k", "grad_v"))
    assert out.shape[0] == len(lengths)
    for b, n in enumerate(lengths):
        if n == 0:  # an empty sequence: nothing packed, an all-zero row block unpacked
            assert (out[b] == 0.0).all() and (gk[b] == 0.0).all()
            continue
        np.testing.assert_allclose(out[b:b + 1, :, :n], outs[b], **tol)
        np.testing.assert_allclose(gq[b:b + 1, :, :n], grads[b].grad_q, **tol)
        np.testing.assert_allclose(gk[b:b + 1, :, :n], grads[b].grad_k, **tol)
        np.testing.assert_allclose(gv[b:b + 1, :, :n], grads[b].grad_v, **tol)
    # the varlen encoding: the dense relation equals the packed segments' relation
    dense = from_cu_seqlens(cu, causal=True)
    np.testing.assert_array_equal(dense, rel.dense())
    # lowering back gives the same relation (the empty sequences leave no trace in it)
    low = to_cu_seqlens(dense)
    np.testing.assert_array_equal(from_cu_seqlens(low.cu_seqlens_q, causal=low.causal), dense)
    assert low.cu_seqlens_q.tolist() == [0, *np.cumsum([n for n in lengths if n]).tolist()]
    # the pair counts count no pair for an empty sequence
    assert pair_counts(lengths).independent == int(from_cu_seqlens(cu, causal=False).sum())


def test_packed_call_with_empty_sequences_gradients_match_complex_step():
    from tests.call_vjp import assert_call_gradients

    lengths = [2, 0, 3, 0]
    q, k, v, _ = _examples(6, lengths)
    pq, pk, pv = (pack(x, lengths) for x in (q, k, v))
    ids, pos = pq.segment_ids, pq.positions
    call = AttentionCall(pq.values, pk.values, pv.values,
                         visible=relation(pos, pos, causal=True, q_segment=ids, k_segment=ids))
    assert_call_gradients(call, ["q", "k", "v"])  # every element, complex step


def test_varlen_cross_attention_with_an_empty_key_sequence():
    # sequence 1 has 2 queries and no key: its rows are empty (rejected by default, and
    # well defined with a sink: the sink takes all the mass)
    vis = from_cu_seqlens([0, 2, 4, 5], cu_seqlens_k=[0, 3, 3, 5], causal=False)
    assert vis.shape == (1, 1, 5, 5)
    assert not vis[0, 0, 2:4].any() and vis[0, 0, :2, :3].all() and vis[0, 0, 4, 3:].all()
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 1, 5, 2))
    with pytest.raises(RefAttnError, match=r"row \(b=0, h=0, i=2\) has no legal key"):
        AttentionCall(q, q, q, visible=vis)
    t = refattn.forward(AttentionCall(q, q, q, visible=vis, sink=np.array([0.25])))
    assert (t.output[0, 0, 2:4] == 0.0).all() and (t.lse[0, 0, 2:4] == 0.25).all()


def test_packed_block_diagonal_causal_equals_each_example_alone_forward_and_backward():
    q, k, v, g = _examples()
    outs, grads = _alone(q, k, v, g)
    rel, trace, pgrads, cu = _packed_run(q, k, v, g, segments=True)
    assert rel.layout == "packed"
    tol = dict(rtol=1e-12, atol=1e-14)
    out = unpack(trace.output, cu)
    gq, gk, gv = (unpack(getattr(pgrads, n), cu) for n in ("grad_q", "grad_k", "grad_v"))
    for b, n in enumerate(LENGTHS):
        np.testing.assert_allclose(out[b:b + 1, :, :n], outs[b], **tol)
        np.testing.assert_allclose(gq[b:b + 1, :, :n], grads[b].grad_q, **tol)
        np.testing.assert_allclose(gk[b:b + 1, :, :n], grads[b].grad_k, **tol)
        np.testing.assert_allclose(gv[b:b + 1, :, :n], grads[b].grad_v, **tol)
    # no probability mass and no score gradient ever crosses a document boundary
    seg = rel.q_segment[0]
    cross = seg[:, None] != seg[None, :]
    assert (trace.probs[..., cross] == 0.0).all()
    assert (pgrads.grad_scores[..., cross] == 0.0).all()
    # the varlen encoding of the same relation is the contract's cu_seqlens
    low = to_cu_seqlens(rel)
    assert low.cu_seqlens_q.tolist() == [0, 3, 7, 12, 16] and low.causal


def _max_gap(packed_out, outs, cu, b):
    n = LENGTHS[b]
    return float(np.abs(unpack(packed_out, cu)[b:b + 1, :, :n] - outs[b]).max())


def test_unrestricted_concatenation_demonstrably_differs():
    q, k, v, g = _examples()
    outs, grads = _alone(q, k, v, g)
    # one causal sequence over the concatenation: later documents read earlier ones
    _, trace, pgrads, cu = _packed_run(q, k, v, g, segments=False, global_positions=True)
    # the first document has nothing before it, so only leakage can explain a difference
    assert _max_gap(trace.output, outs, cu, 0) < 1e-12
    for b in range(1, len(LENGTHS)):
        assert _max_gap(trace.output, outs, cu, b) > 1e-2
    assert np.abs(unpack(pgrads.grad_k, cu)[0:1, :, :3] - grads[0].grad_k).max() > 1e-2
    # fully unrestricted (no causal, no segments) differs for every document
    _, trace, _, cu = _packed_run(q, k, v, g, segments=False, causal_=False)
    for b in range(len(LENGTHS)):
        assert _max_gap(trace.output, outs, cu, b) > 1e-2


def test_position_reset_matters_for_causal_positions():
    # segments without per-document position reset still isolate documents when positions
    # are global, but segment-local positions without segments leak: the pairing is required
    q, k, v, g = _examples(1)
    outs, _ = _alone(q, k, v, g)
    _, trace, _, cu = _packed_run(q, k, v, g, segments=True, global_positions=True)
    for b in range(len(LENGTHS)):
        assert _max_gap(trace.output, outs, cu, b) < 1e-12
    _, trace, _, cu = _packed_run(q, k, v, g, segments=False)  # local positions, no segments
    assert max(_max_gap(trace.output, outs, cu, b) for b in range(1, 4)) > 1e-2


def test_padded_batch_matches_packed():
    q, k, v, g = _examples(2)
    outs, _ = _alone(q, k, v, g)
    L = max(LENGTHS)
    pos = np.arange(L)[None].repeat(len(LENGTHS), 0)
    key_valid = pos < np.array(LENGTHS)[:, None]
    rel = relation(pos, pos, key_valid, causal=True)
    trace = refattn.forward(AttentionCall(q, k, v, visible=rel,
                                          query_valid=key_valid[:, None, :, None]))
    for b, n in enumerate(LENGTHS):
        np.testing.assert_allclose(trace.output[b:b + 1, :, :n], outs[b], rtol=1e-12, atol=1e-14)
        assert (trace.output[b, :, n:] == 0.0).all()


PACKING_REJECTIONS = [
    (lambda: cu_seqlens_from_lengths([3, -1, 2]),
     "lengths: entry 1 is -1; a sequence length is >= 0"),
    (lambda: cu_seqlens_from_lengths([0, 0]),
     "lengths: every one of the 2 sequences is empty"),
    (lambda: cu_seqlens_from_lengths([3.0, 2.0]),
     "lengths: expected an integer array, got dtype float64"),
    (lambda: cu_seqlens_from_lengths([[1, 2]]),
     r"lengths: expected a non-empty 1-D array, got shape \[1, 2\]"),
    (lambda: segments_from_cu_seqlens([1, 3]), "cu_seqlens: must start at 0, got 1"),
    (lambda: segments_from_cu_seqlens([0, 3, 2, 5]),
     r"cu_seqlens: must be sorted \(non-decreasing\), got 3 then 2 at entries 1, 2"),
    (lambda: segments_from_cu_seqlens([0, 0, 0]),
     "cu_seqlens: every one of the 2 sequences is empty"),
    (lambda: from_cu_seqlens([0, 2, 1], causal=False), "cu_seqlens: must be sorted"),
    (lambda: pack(np.zeros((2, 1, 3, 1)), [0, 0]), "lengths: every one of the 2 sequences"),
    (lambda: segments_from_cu_seqlens([0]),
     r"cu_seqlens: expected a 1-D array of at least 2 offsets, got shape \[1\]"),
    (lambda: segments_from_cu_seqlens([0.0, 2.0]),
     "cu_seqlens: expected an integer array, got dtype float64"),
    (lambda: pack(np.zeros((2, 1, 3, 1), np.float32), [1, 1]),
     "x: expected dtype float64, got float32"),
    (lambda: pack(np.zeros((2, 3, 1)), [1, 1]), r"x: expected shape \[B,H,L,D\], got \[2, 3, 1\]"),
    (lambda: pack(np.zeros((2, 1, 3, 1)), [1, 1, 1]),
     "lengths: expected 2 entries \\(one per batch row\\), got 3"),
    (lambda: pack(np.zeros((2, 1, 3, 1)), [1, 4]), "lengths: entry 1 is 4, longer than L=3"),
    (lambda: unpack(np.zeros((1, 1, 4, 1)), [0, 2, 5]),
     "cu_seqlens: last offset 5 must equal T=4"),
    (lambda: unpack(np.zeros((2, 1, 4, 1)), [0, 4]),
     r"values: expected shape \[1,H,T,D\], got \[2, 1, 4, 1\]"),
    (lambda: unpack(np.zeros((1, 1, 4, 1), np.float32), [0, 4]),
     "values: expected dtype float64, got float32"),
    (lambda: unpack(np.zeros((1, 1, 4, 1)), [0, 4], length=3),
     r"length: 3 is shorter than the longest example \(4\)"),
    (lambda: pair_counts(np.array([], dtype=np.int64)),
     r"lengths: expected a non-empty 1-D array, got shape \[0\]"),
    # a uint64 beyond int64 must be refused, not wrapped to a negative length / offset
    (lambda: cu_seqlens_from_lengths(np.array([2**64 - 1, 2], dtype=np.uint64)),
     "lengths: value 18446744073709551615 does not fit in int64"),
    (lambda: segments_from_cu_seqlens(np.array([0, 2**63], dtype=np.uint64)),
     "cu_seqlens: value 9223372036854775808 does not fit in int64"),
]


@pytest.mark.parametrize("make,message", PACKING_REJECTIONS,
                         ids=[m[:40] for _, m in PACKING_REJECTIONS])
def test_packing_rejections(make, message):
    with pytest.raises(RefAttnError, match=message):
        make()
