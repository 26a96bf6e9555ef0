"""Issue 3: encoder, decoder, cross-attention and cache call sites (contract "Mask algebra
across encoder, decoder, cross-attention, and cache modes"), and AttentionCall integration."""

from __future__ import annotations

import json

import numpy as np
import pytest

import refattn
from refattn import AttentionCall, RefAttnError
from refattn.masks import causal, compile_visibility, from_positions, relation
from refattn.masks.framework import to_key_padding_mask

B, S, T, H, D = 2, 5, 3, 2, 4  # unequal source and target lengths (S != T)
SRC_LEN = np.array([5, 3])
TGT_LEN = np.array([3, 2])


def _states(seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((B, H, S, D)), rng.standard_normal((B, H, T, D))


def _masks():
    src_pos = np.arange(S)[None].repeat(B, 0)
    tgt_pos = np.arange(T)[None].repeat(B, 0)
    src_valid = src_pos < SRC_LEN[:, None]
    tgt_valid = tgt_pos < TGT_LEN[:, None]
    encoder = relation(src_pos, src_pos, src_valid)  # every real query reads every real key
    decoder = relation(tgt_pos, tgt_pos, tgt_valid, causal=True)  # causal AND target key real
    cross = relation(tgt_pos, src_pos, src_valid)  # source columns, no target triangle
    return encoder, decoder, cross, src_valid, tgt_valid


def test_encoder_decoder_cross_call_sites_run():
    src, tgt = _states()
    encoder, decoder, cross, src_valid, tgt_valid = _masks()
    memory = refattn.attention(src, src, src, visible=encoder,
                               query_valid=src_valid[:, None, :, None])
    target = refattn.attention(tgt, tgt, tgt, visible=decoder,
                               query_valid=tgt_valid[:, None, :, None])
    out = refattn.attention(target, memory, memory, visible=cross,
                            query_valid=tgt_valid[:, None, :, None])
    assert memory.shape == (B, H, S, D) and out.shape == (B, H, T, D)
    assert decoder.dense().shape == (B, 1, T, T) and cross.dense().shape == (B, 1, T, S)
    # cross-attention: every target row reads the same real source columns
    assert (cross.dense() == src_valid[:, None, None, :]).all()
    # padded source keys never contribute: changing them changes nothing
    memory2 = memory.copy()
    memory2[1, :, 3:] += 100.0
    out2 = refattn.attention(target, memory2, memory2, visible=cross,
                             query_valid=tgt_valid[:, None, :, None])
    assert np.array_equal(out, out2)


@pytest.mark.parametrize("dense", [False, True])
def test_swapping_self_and_cross_masks_fails(dense):
    src, tgt = _states()
    _, decoder, cross, _, _ = _masks()
    if dense:
        decoder, cross = decoder.dense(), cross.dense()
    # cross-attention given the decoder's self mask: [B,1,T,T] cannot cover [B,Hq,T,S]
    with pytest.raises(RefAttnError, match=r"visible: axis 3 \(aligned with K\) has size 3, "
                                           r"expected 1 or 5"):
        AttentionCall(tgt, src, src, visible=decoder)
    # decoder self-attention given the cross mask: [B,1,T,S] cannot cover [B,Hq,T,T]
    with pytest.raises(RefAttnError, match=r"visible: axis 3 \(aligned with K\) has size 5, "
                                           r"expected 1 or 3"):
        AttentionCall(tgt, tgt, tgt, visible=cross)


def test_cross_mask_is_key_column_validity_and_decoder_mask_is_not():
    _, decoder, cross, src_valid, _ = _masks()
    assert np.array_equal(to_key_padding_mask(cross), ~src_valid)
    with pytest.raises(RefAttnError, match="not key-column validity"):
        to_key_padding_mask(decoder)


def test_decode_step_at_127_equals_the_last_prefill_row():
    rng = np.random.default_rng(7)
    n = 128
    q, k, v = (rng.standard_normal((1, 1, n, 8)) for _ in range(3))
    prefill = refattn.forward(AttentionCall(q, k, v, visible=causal(n, n, alignment="upper_left")))
    step = refattn.forward(AttentionCall(q[:, :, -1:], k, v, visible=from_positions([127],
                                                                                   np.arange(n))))
    np.testing.assert_allclose(step.output[:, :, 0], prefill.output[:, :, -1], rtol=1e-13)
    # the local-row-zero bug reads key 0 only: its output is v[0]
    wrong = refattn.attention(q[:, :, -1:], k, v, visible=causal(1, n, alignment="upper_left"))
    assert np.array_equal(wrong[0, 0, 0], v[0, 0, 0])


def test_chunked_decode_in_a_static_cache_buffer():
    rng = np.random.default_rng(8)
    slots, used = 10, 7  # 10 allocated slots, 7 initialised; the 2-token chunk is at 5, 6
    q, k, v = (rng.standard_normal((1, 1, slots, 4)) for _ in range(3))
    full = refattn.forward(AttentionCall(q[:, :, :used], k[:, :, :used], v[:, :, :used],
                                         visible=causal(used, used, alignment="upper_left")))
    rel = from_positions([5, 6], np.arange(slots), key_valid=np.arange(slots) < used)
    chunk = refattn.forward(AttentionCall(q[:, :, 5:7], k, v, visible=rel))
    np.testing.assert_allclose(chunk.output, full.output[:, :, 5:7], rtol=1e-13)
    # uninitialised slots get exactly zero probability
    assert (chunk.probs[..., used:] == 0.0).all()


# -- AttentionCall integration --------------------------------------------------------------
def test_call_keeps_the_relation_and_builds_its_dense_form_on_demand():
    _, tgt = _states()
    _, decoder, _, _, _ = _masks()
    call = AttentionCall(tgt, tgt, tgt, visible=decoder)
    assert call.relation is decoder and call.visible is decoder
    assert np.array_equal(call.visible_array(), decoder.dense())
    assert not call.visible_array().flags.writeable
    assert call.visible_array() is call.visible_array()  # built once
    assert np.array_equal(call.row_has_key(), call.visible_full().any(axis=-1))
    m = call.manifest()["visibility"]
    assert m["layout"] == "padded" and m["alignment"] == "explicit_positions"
    assert m["window_convention"] is None and m["head_sharing"] == "shared"
    assert m["all_masked_row_policy"] == "reject"
    assert m["relation"] == decoder.manifest()
    json.dumps(call.manifest(), allow_nan=False)


def test_call_with_plain_bool_visibility_is_unchanged():
    src, _ = _states()
    vis = np.tril(np.ones((S, S), bool))
    call = AttentionCall(src, src, src, visible=vis)
    assert call.relation is None
    m = call.manifest()["visibility"]
    assert "layout" not in m and "relation" not in m and m["shape"] == [S, S]
    same = AttentionCall(src, src, src, visible=causal(S, S, alignment="upper_left"))
    assert np.array_equal(refattn.forward(call).output, refattn.forward(same).output)


def test_call_manifest_records_cache_window_and_per_head_relations():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 3, 2, 4))
    k, v = rng.standard_normal((1, 1, 6, 4)), rng.standard_normal((1, 1, 6, 4))
    rel = from_positions([4, 5], np.arange(6), window=(np.array([1, 2, 6]), 1),
                         window_convention="includes_query")
    m = AttentionCall(q, k, v, visible=rel).manifest()["visibility"]
    assert (m["layout"], m["alignment"]) == ("cache", "explicit_positions")
    assert (m["window_convention"], m["head_sharing"]) == ("includes_query", "per_head")
    assert m["relation"]["window"]["left"] == [0, 1, 5]
    # a per-head relation must match Hq
    with pytest.raises(RefAttnError, match=r"visible: axis 1 \(aligned with Hq\) has size 3, "
                                           r"expected 1 or 2"):
        AttentionCall(q[:, :2], k, v, visible=rel)


def test_call_applies_the_all_masked_row_policy_to_a_relation():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 1, n, 2)) for n in (3, 2, 2))
    rel = causal(3, 2, alignment="lower_right")  # query row 0 sits at position -1: no key
    with pytest.raises(RefAttnError, match=r"visible: row \(b=0, h=0, i=0\) has no legal key "
                                           r"under policy 'reject'"):
        AttentionCall(q, k, v, visible=rel)
    qv = np.array([False, True, True])[None, None, :, None]
    call = AttentionCall(q, k, v, visible=rel, query_valid=qv,
                         all_masked_rows="sanitize_then_zero_invalid_query")
    m = call.manifest()["visibility"]
    assert m["all_masked_row_policy"] == "sanitize_then_zero_invalid_query"
    assert m["alignment"] == "lower_right" and m["sanitized_rows"] == 1
    assert (refattn.forward(call).output[0, 0, 0] == 0.0).all()


def test_compile_visibility_feeds_the_engine_like_the_relation():
    src, _ = _states()
    pos = np.arange(S)[None].repeat(B, 0)
    dense = compile_visibility(pos, pos, None, causal=True, window=(1, 0))
    rel = relation(pos, pos, causal=True, window=(1, 0))
    a = refattn.attention(src, src, src, visible=dense)
    b = refattn.attention(src, src, src, visible=rel)
    assert np.array_equal(a, b)
