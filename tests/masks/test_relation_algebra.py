"""Issue 19 item 2: union and intersection of visibility relations (``a | b``, ``a & b``).

Every evaluation path of a composition is compared with the logical OR / AND of its terms'
own dense relations (an independent second formula): mask_mod, tile, row_any, dense, block
masks, rendering, the framework adapters, the manifest round trip, the call gate, and the
reference engine (against the same call with the dense mask).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refattn
from refattn import AttentionCall, RefAttnError
from refattn.masks import (
    ComposedRelation,
    causal,
    empty_rows,
    relation,
    relation_from_manifest,
    render,
)
from refattn.masks.algebra import AND, MAX_DEPTH, OR
from refattn.masks.blocks import block_mask_to_dense, to_block_mask
from refattn.masks.framework import to_additive_bias, to_mha_attn_mask, to_sdpa_bool
from tests.strategies import composed_relations


def _oracle(rel) -> np.ndarray:
    """The composition's truth table from its terms' own dense relations (numpy OR / AND)."""
    if not isinstance(rel, ComposedRelation):
        return rel.dense()
    B, H, Q, K = rel.shape
    parts = [np.broadcast_to(_oracle(t), (B, H, Q, K)) for t in rel.terms]
    combine = np.logical_or if rel.op == "or" else np.logical_and
    out = parts[0]
    for p in parts[1:]:
        out = combine(out, p)
    return out


def streaming_llm(T: int, window: int, sink_tokens: int):
    """StreamingLLM / FlashAttention ``sink_token_length``: a causal window OR the first n."""
    pos = np.arange(T)[None]
    recent = relation(pos, pos, causal=True, window=(window, 0))
    first = relation(pos, pos, pos < sink_tokens, causal=True)
    return recent | first


def test_streaming_llm_by_hand():
    rel = streaming_llm(7, 1, 2)
    want = np.array([[int(j <= i and (i - j <= 1 or j < 2)) for j in range(7)]
                     for i in range(7)])
    np.testing.assert_array_equal(rel.dense()[0, 0], want)
    assert rel.op == "or" and len(rel.terms) == 2 and rel.shape == (1, 1, 7, 7)
    assert rel.layout == "padded" and rel.topology == "composed"
    print(render(rel.dense()[0, 0]))


def test_intersection_and_flattening():
    a = causal(4, 4, alignment="upper_left")
    b = relation([np.arange(4)], [np.arange(4)], window=(1, 1))
    c = relation([np.arange(4)], [np.arange(4)], np.array([[True, True, False, True]]))
    both = a & b & c  # flattened: one intersection of three terms
    assert both.op == "and" and len(both.terms) == 3 and both.depth == 1
    np.testing.assert_array_equal(both.dense(), a.dense() & b.dense() & c.dense())
    nested = (a | b) & c
    assert nested.depth == 2 and nested.program().tolist() == [0, 1, OR, 2, AND]
    np.testing.assert_array_equal(nested.dense(), (a.dense() | b.dense()) & c.dense())


@settings(max_examples=80, deadline=None)
@given(rel=composed_relations(), data=st.data())
def test_every_evaluation_path_equals_the_terms_combined(rel, data):
    want = _oracle(rel)
    B, H, Q, K = rel.shape
    np.testing.assert_array_equal(rel.dense(), want)
    np.testing.assert_array_equal(rel.row_any(block_elements=data.draw(st.integers(1, 40))),
                                  want.any(axis=-1))
    b, h = data.draw(st.integers(0, B - 1)), data.draw(st.integers(0, H - 1))
    i0 = data.draw(st.integers(0, Q - 1))
    i1 = data.draw(st.integers(i0 + 1, Q))
    j0 = data.draw(st.integers(0, K - 1))
    j1 = data.draw(st.integers(j0 + 1, K))
    np.testing.assert_array_equal(rel.tile(b, i0, i1, j0, j1, h=h), want[b, h, i0:i1, j0:j1])
    # the manifest rebuilds the same relation, coordinates and all
    m = rel.manifest()
    json.dumps(m, allow_nan=False)
    back = relation_from_manifest(json.loads(json.dumps(m)))
    np.testing.assert_array_equal(back.dense(), want)
    assert back.program().tolist() == rel.program().tolist()
    # block metadata from tiles (no dense relation) and its inverse
    bm = to_block_mask(rel, data.draw(st.integers(1, 4)))
    np.testing.assert_array_equal(block_mask_to_dense(bm), want)


@settings(max_examples=25, deadline=None)
@given(rel=composed_relations())
def test_adapters_and_the_reference_engine_accept_compositions(rel):
    want = _oracle(rel)
    B, H, Q, K = rel.shape
    assert empty_rows(rel) == empty_rows(want)
    np.testing.assert_array_equal(to_sdpa_bool(rel, all_masked_rows="allow"), want)
    np.testing.assert_array_equal(to_additive_bias(rel, all_masked_rows="allow") == 0.0, want)
    if H == 1 or B == 1:
        mha = to_mha_attn_mask(rel, num_heads=H, batch=B, all_masked_rows="allow")
        np.testing.assert_array_equal(~mha if mha.ndim == 2 else
                                      ~mha.reshape(B, H, Q, K), want[0, 0] if mha.ndim == 2
                                      else np.broadcast_to(want, (B, H, Q, K)))
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, Q, 3))
    kv = rng.standard_normal((B, H, K, 3))
    qv = want.any(axis=-1).all(axis=1)[:, None, :, None]  # rows with a key on every head
    kw = dict(query_valid=qv, all_masked_rows="sanitize_then_zero_invalid_query")
    if not want.any(axis=-1).all(axis=1).any():
        return
    if (want.any(axis=-1) != want.any(axis=-1).all(axis=1, keepdims=True)).any():
        return  # a row empty on some heads only: not expressible with query_valid
    composed = AttentionCall(q, kv, kv, visible=rel, **kw)
    dense = AttentionCall(q, kv, kv, visible=want, **kw)
    assert composed.relation is rel
    np.testing.assert_array_equal(composed.row_has_key(), dense.row_has_key())
    t1, t2 = refattn.forward(composed), refattn.forward(dense)
    for name in ("probs", "output", "lse"):
        np.testing.assert_array_equal(getattr(t1, name), getattr(t2, name))
    m = composed.manifest()["visibility"]
    assert m["relation"]["schema"] == "visibility_composition_v1"
    assert m["layout"] == rel.layout and m["alignment"] == rel.alignment


def test_composition_rejections():
    a = causal(3, 4, alignment="upper_left")
    with pytest.raises(RefAttnError, match=r"term 1 of the union has shape .* \[1, 1, 3, 5\]"):
        _ = a | causal(3, 5, alignment="upper_left")
    with pytest.raises(RefAttnError, match=r"terms\[0\]: expected a BaseRelation, got a bool"):
        ComposedRelation("and", [np.ones((3, 4), bool), a])
    with pytest.raises(RefAttnError, match=r"op: expected one of 'or', 'and', got 'xor'"):
        ComposedRelation("xor", [a, a])
    with pytest.raises(RefAttnError, match=r"a union needs at least two relations"):
        ComposedRelation("or", [a])
    pos2 = np.tile(np.arange(4), (2, 1))
    b2 = relation(pos2, pos2, causal=True)  # B = 2
    pos3 = np.tile(np.arange(4), (3, 1))
    with pytest.raises(RefAttnError, match=r"term 0 of the union has shape \(B, H, Q, K\) = "
                                           r"\[2, 1, 4, 4\], which does not broadcast with "
                                           r"\[3, 1, 4, 4\]"):
        _ = b2 | relation(pos3, pos3, causal=True)
    deep = a
    for _ in range(MAX_DEPTH // 2):  # each round nests two levels: (x | a) & a
        deep = (deep | a) & a
    assert deep.depth == MAX_DEPTH
    with pytest.raises(RefAttnError, match=r"compositions nest 9 deep, at most 8"):
        _ = deep | a
    assert (a | a).__or__(np.ones(3)) is NotImplemented


def test_numba_tiles_classify_compositions_soundly_and_usefully():
    from refattn.engine.numba.tiles import FULL, INVISIBLE, PARTIAL, classify, tile_visibility

    rel = streaming_llm(16, 3, 4)
    tv = tile_visibility((1, 1, 16, 16), relation=rel)
    assert classify(tv, 0, 0, 12, 16, 4, 8) == INVISIBLE  # past the window, not a first token
    assert classify(tv, 0, 0, 8, 16, 0, 4) == FULL  # the first tokens, causal: full by the union
    assert classify(tv, 0, 0, 0, 4, 0, 4) == PARTIAL  # the diagonal
    inter = causal(16, 16, alignment="upper_left") & relation(
        [np.arange(16)], [np.arange(16)], window=(3, 3))
    tv = tile_visibility((1, 1, 16, 16), relation=inter)
    assert classify(tv, 0, 0, 8, 12, 0, 4) == INVISIBLE  # causal FULL but outside the window
    assert classify(tv, 0, 0, 4, 8, 12, 16) == INVISIBLE  # window INVISIBLE (and future)
