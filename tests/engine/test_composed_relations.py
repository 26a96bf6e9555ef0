"""Unions and intersections of relations (issue 19 item 2) on every backend.

Each backend runs a call whose ``visible`` is a composition (evaluated from coordinates, per
tile where the backend tiles) and the same call with the composition's dense mask; the two
must agree, and tile skipping must skip exactly the tiles the composition leaves invisible.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import refattn
from refattn import AttentionCall
from refattn.masks import causal, relation
from refattn.masks.blocks import ABSENT, to_block_mask
from tests.engine_compare import assert_close, natural_scales
from tests.strategies import composed_relations


def streaming_llm(T: int, window: int, sink_tokens: int):
    """A causal window OR the first ``sink_tokens`` tokens (FlashAttention sink_token_length)."""
    pos = np.arange(T)[None]
    return (relation(pos, pos, causal=True, window=(window, 0))
            | relation(pos, pos, pos < sink_tokens, causal=True))


def document_causal(T: int, starts: list[int]):
    """Causal AND (same document OR a global key at position 0): document masking with a
    shared prompt token, an intersection of a union."""
    pos = np.arange(T)[None]
    seg = np.searchsorted(starts, np.arange(T), side="right")[None] - 1
    same_doc = relation(pos, pos, q_segment=seg, k_segment=seg)
    global_key = relation(pos, pos, pos == 0)
    return causal(T, T, alignment="upper_left") & (same_doc | global_key)


def _pair(rel, seed=0, *, Hq=2, Hkv=1, D=4, **kw):
    B, H, Q, K = rel.shape
    Hq = max(Hq, H)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, Q, D))
    k = rng.standard_normal((B, Hkv, K, D))
    v = rng.standard_normal((B, Hkv, K, D))
    g = rng.standard_normal((B, Hq, Q, D))
    return (AttentionCall(q, k, v, visible=rel, **kw),
            AttentionCall(q, k, v, visible=rel.dense(), **kw), g)


RELATIONS = {
    "streaming_llm": streaming_llm(48, 5, 4),
    "document_causal": document_causal(40, [0, 9, 22, 31]),
    "window_and_not_first": relation([np.arange(33)], [np.arange(33)], window=(4, 4))
    & relation([np.arange(33)], [np.arange(33)], np.arange(33)[None] > 0),
}


@pytest.mark.parametrize("name", sorted(RELATIONS))
def test_reference_and_exact_give_the_dense_masks_results(name):
    rel = RELATIONS[name]
    composed, dense, g = _pair(rel)
    t1, t2 = refattn.forward(composed), refattn.forward(dense)
    np.testing.assert_array_equal(t1.output, t2.output)
    np.testing.assert_array_equal(refattn.backward(t1, g).grad_k, refattn.backward(t2, g).grad_k)
    small, small_dense, g = _pair(rel if rel.shape[2] <= 40 else streaming_llm(12, 3, 2))
    e1, e2 = refattn.forward(small, backend="exact"), refattn.forward(small_dense, backend="exact")
    np.testing.assert_array_equal(e1.output, e2.output)  # correctly rounded: bit for bit


@pytest.mark.parametrize("name", sorted(RELATIONS))
def test_numba_streaming_skips_exactly_the_invisible_tiles(name):
    rel = RELATIONS[name]
    composed, dense, g = _pair(rel)
    bq = bk = 8
    t1 = refattn.forward(composed, backend="numba", materialize=False, block_q=bq, block_k=bk)
    t2 = refattn.forward(dense, backend="numba", materialize=False, block_q=bq, block_k=bk)
    assert t1.materialized["visibility"] == "coordinates"
    # the same arithmetic tile for tile: bit-identical results
    np.testing.assert_array_equal(t1.output, t2.output)
    np.testing.assert_array_equal(t1.lse, t2.lse)
    g1, g2 = refattn.backward(t1, g), refattn.backward(t2, g)
    for name_ in ("grad_q", "grad_k", "grad_v"):
        np.testing.assert_array_equal(getattr(g1, name_), getattr(g2, name_))
    # skipped tiles: the absent blocks of the block mask (per query head)
    bm = to_block_mask(rel, (bq, bk))
    Hq = composed.q.shape[1]
    absent = int((bm.classes() == ABSENT).sum()) * (Hq // rel.shape[1])
    assert t1.materialized["tiles_skipped"] == absent > 0
    # against the reference
    ref = refattn.forward(dense)
    np.testing.assert_allclose(t1.output, ref.output, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", sorted(RELATIONS))
def test_numba_dense_and_fused_value_and_grad(name):
    rel = RELATIONS[name]
    composed, dense, g = _pair(rel, 1, Hq=4, Hkv=2)
    ref = refattn.forward(dense)
    rg = refattn.backward(ref, g)
    t = refattn.forward(composed, backend="numba")
    np.testing.assert_allclose(t.probs, ref.probs, rtol=1e-13, atol=1e-16)
    out, grads = refattn.value_and_grad(composed, g, backend="numba")
    np.testing.assert_allclose(out, ref.output, rtol=1e-12, atol=1e-14)
    natural = natural_scales(dense, ref, rg)
    for n in ("grad_q", "grad_k", "grad_v"):
        assert_close(n, getattr(grads, n), getattr(rg, n), natural[n], 1e-12, zeros=False)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rel=composed_relations())
def test_generated_compositions_stream_like_their_dense_masks(rel):
    want = rel.dense()
    has_key = want.any(axis=-1)  # (B, H, Q)
    if not has_key.all():  # every row needs a key for the reject policy: add the diagonal
        return
    composed, dense, g = _pair(rel, 2)
    t1 = refattn.forward(composed, backend="numba", materialize=False, block_q=2, block_k=3)
    t2 = refattn.forward(dense, backend="numba", materialize=False, block_q=2, block_k=3)
    np.testing.assert_array_equal(t1.output, t2.output)
    g1, g2 = refattn.backward(t1, g), refattn.backward(t2, g)
    np.testing.assert_array_equal(g1.grad_q, g2.grad_q)


@pytest.mark.parametrize("name", ["streaming_llm", "document_causal"])
def test_gradients_through_a_composed_relation_match_complex_step(name):
    from tests.call_vjp import assert_call_gradients

    rel = streaming_llm(9, 2, 2) if name == "streaming_llm" else document_causal(9, [0, 4, 6])
    composed, _, _ = _pair(rel, 4, Hq=2, Hkv=1, bias=np.full((1, 2, 9, 9), 0.5))
    assert_call_gradients(composed, ["q", "k", "v", "bias"])  # every element, complex step
