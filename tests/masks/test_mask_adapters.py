"""Issue 3: the polarity firewall (contract "Boolean and additive conventions", "The visibility
adapter is a polarity firewall", "Dense support, compact metadata, and predicate kernels")."""

from __future__ import annotations

import numpy as np
import pytest

from refattn import RefAttnError
from refattn.masks import causal, cu_seqlens_from_lengths, relation, segments_from_cu_seqlens
from refattn.masks.blocks import ABSENT, FULL, PARTIAL, block_mask_to_dense, to_block_mask
from refattn.masks.framework import (
    SdpaCausal,
    from_additive_bias,
    from_cu_seqlens,
    from_key_padding_mask,
    from_mha_attn_mask,
    from_sdpa_bool,
    from_sdpa_causal,
    to_additive_bias,
    to_cu_seqlens,
    to_key_padding_mask,
    to_mha_attn_mask,
    to_sdpa_bool,
    to_sdpa_causal,
)

# The contract's polarity example: the same support in two encodings.
SEMANTIC = np.array([[1, 0, 0], [1, 1, 0], [1, 1, 1]], bool)
MHA_BLOCKED = np.array([[0, 1, 1], [0, 0, 1], [0, 0, 0]], bool)


def test_contract_polarity_example():
    assert np.array_equal(to_sdpa_bool(SEMANTIC), SEMANTIC)
    assert np.array_equal(to_mha_attn_mask(SEMANTIC, num_heads=4), MHA_BLOCKED)
    assert np.array_equal(from_mha_attn_mask(MHA_BLOCKED, batch=1, num_heads=4)[0, 0], SEMANTIC)


def test_a_float_one_zero_matrix_is_neither_representation():
    # under additive semantics 0 keeps a score and 1 rewards it: it masks nothing
    with pytest.raises(RefAttnError, match="finite positive value is a preference"):
        from_additive_bias(SEMANTIC.astype(np.float64))


def test_additive_bias_is_zero_or_minus_infinity():
    bias = to_additive_bias(SEMANTIC)
    assert bias.dtype == np.float64
    assert set(bias.ravel().tolist()) == {0.0, -np.inf}
    assert np.array_equal(np.isneginf(bias), ~SEMANTIC)
    # no finite score revives an illegal edge: scores + bias is -inf exactly where blocked
    scores = np.random.default_rng(0).standard_normal((3, 3)) * 1e300
    assert np.array_equal(np.isneginf(scores + bias), ~SEMANTIC)
    assert np.array_equal(from_additive_bias(bias), SEMANTIC)


def test_mha_three_axis_mask_uses_b_times_h_plus_h():
    rng = np.random.default_rng(4)
    vis = rng.random((2, 3, 4, 5)) < 0.6
    vis[..., 0] = True  # keep every row legal
    mha = to_mha_attn_mask(vis, num_heads=3)
    assert mha.shape == (6, 4, 5)
    for b in range(2):
        for h in range(3):
            assert np.array_equal(mha[b * 3 + h], ~vis[b, h])
    assert np.array_equal(from_mha_attn_mask(mha, batch=2, num_heads=3), vis)
    # a per-head relation with B=1 broadcasts over the batch the caller names
    mha1 = to_mha_attn_mask(vis[:1], num_heads=3, batch=2)
    assert np.array_equal(mha1[3:], mha1[:3])


def test_key_padding_mask_only_for_key_column_validity():
    kv = np.array([[True, True, False], [True, False, False]])
    pos = np.arange(3)[None].repeat(2, 0)
    padding = relation(pos, pos, kv)
    kpm = to_key_padding_mask(padding)
    assert np.array_equal(kpm, ~kv)
    assert np.array_equal(np.broadcast_to(from_key_padding_mask(kpm), (2, 1, 3, 3)),
                          padding.dense())
    with pytest.raises(RefAttnError, match=r"visible: not key-column validity: edge "
                                           r"\(b=0, h=0, i=1, j=1\) is True but "
                                           r"\(b=0, h=0, i=0, j=1\) is False; a key_padding_mask"):
        to_key_padding_mask(causal(3, 3, alignment="upper_left"))


def test_contract_lengths_lower_to_cu_seqlens():
    cu = cu_seqlens_from_lengths([3, 4, 5, 4])
    seg = segments_from_cu_seqlens(cu)
    pos, ids = seg.positions[None], seg.segment_ids[None]
    low = to_cu_seqlens(relation(pos, pos, causal=True, q_segment=ids, k_segment=ids))
    assert low.cu_seqlens_q.tolist() == low.cu_seqlens_k.tolist() == [0, 3, 7, 12, 16]
    assert low.causal and (low.max_seqlen_q, low.max_seqlen_k) == (5, 5)
    full = to_cu_seqlens(relation(pos, pos, q_segment=ids, k_segment=ids))
    assert not full.causal and full.cu_seqlens_q.tolist() == [0, 3, 7, 12, 16]


def test_cu_seqlens_for_rectangular_cross_blocks():
    vis = from_cu_seqlens([0, 2, 3], cu_seqlens_k=[0, 4, 7], causal=False)
    low = to_cu_seqlens(vis)
    assert low.cu_seqlens_q.tolist() == [0, 2, 3] and low.cu_seqlens_k.tolist() == [0, 4, 7]
    assert not low.causal


def test_is_causal_only_for_upper_left():
    ul = to_sdpa_causal(causal(2, 5, alignment="upper_left"), mode="flag")
    assert ul.is_causal and ul.attn_mask is None
    assert np.array_equal(from_sdpa_causal(ul, q_len=2, k_len=5)[0, 0].astype(int),
                          [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    lr = to_sdpa_causal(causal(2, 5, alignment="lower_right"))
    assert not lr.is_causal
    assert lr.attn_mask[0, 0].astype(int).tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert np.array_equal(from_sdpa_causal(lr, q_len=2, k_len=5),
                          causal(2, 5, alignment="lower_right").dense())
    # a square lower-right relation is the upper-left one: the flag is exact
    assert to_sdpa_causal(causal(4, 4, alignment="lower_right"), mode="flag").is_causal
    # a plain dense upper-left triangle also lowers to the flag
    flag = to_sdpa_causal(np.tril(np.ones((3, 6), bool)))
    assert flag.is_causal and flag.attn_mask is None


def test_block_mask_classifies_and_round_trips():
    vis = causal(5, 7, alignment="lower_right")
    bm = to_block_mask(vis, (2, 3))
    dense = vis.dense()
    assert bm.kv_indices.shape == (1, 1, 3, 3)
    classes = bm.classes()[0, 0]
    for qb in range(3):
        for kb in range(3):
            block = dense[0, 0, qb * 2:qb * 2 + 2, kb * 3:kb * 3 + 3]
            want = FULL if block.all() else ABSENT if not block.any() else PARTIAL
            assert classes[qb, kb] == want
    assert np.array_equal(block_mask_to_dense(bm), dense)
    # the dense path and the tile path agree
    bm_dense = to_block_mask(dense, (2, 3))
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        assert np.array_equal(getattr(bm, name), getattr(bm_dense, name))


def test_block_mask_skips_cross_document_blocks():
    cu = cu_seqlens_from_lengths([4, 4])
    bm = to_block_mask(from_cu_seqlens(cu, causal=True), 4)
    assert bm.classes()[0, 0].tolist() == [[PARTIAL, ABSENT], [ABSENT, PARTIAL]]
    assert bm.kv_indices[0, 0].tolist() == [[0, -1], [1, -1]]
    assert bm.full_kv_num_blocks.sum() == 0


def test_empty_rows_are_refused_unless_allowed():
    vis = np.array([[True, False], [False, False]])
    for adapter in (to_sdpa_bool, to_additive_bias,
                    lambda v, **kw: to_mha_attn_mask(v, num_heads=1, **kw)):
        with pytest.raises(RefAttnError, match=r"visible: row \(b=0, h=0, i=1\) has no legal "
                                               r"key; the lowered mask would give a NaN row"):
            adapter(vis)
        adapter(vis, all_masked_rows="allow")
    with pytest.raises(RefAttnError, match=r"row \(b=1, h=0, i=0\) has no legal key"):
        to_key_padding_mask(np.array([[True], [False]])[:, None, None, :])


PER_HEAD = np.ones((1, 2, 2, 2), bool)
PER_HEAD[0, 1, 0, 1] = False  # head 1 differs from head 0

ADAPTER_REJECTIONS = [
    (lambda: to_sdpa_bool(np.ones((2, 2), np.int64)),
     "visible: expected dtype bool with True meaning legal, got int64"),
    (lambda: to_sdpa_bool(np.ones((2, 2), np.float64)), "visible: expected dtype bool"),
    (lambda: to_sdpa_bool(np.ones(3, bool)),
     r"visible: expected \[Q,K\], \[H,Q,K\] or \[B,H,Q,K\] axes, got shape \[3\]"),
    (lambda: to_sdpa_bool(np.ones((1, 1, 1, 2, 2), bool)),
     r"visible: expected \[Q,K\], \[H,Q,K\] or \[B,H,Q,K\] axes"),
    (lambda: to_sdpa_bool(np.ones((3, 2, 2), bool), score_shape=(1, 2, 2, 2)),
     r"visible: axis 0 \(aligned with Hq\) has size 3, expected 1 or 2"),
    (lambda: to_sdpa_bool(SEMANTIC, all_masked_rows="zero"),
     "all_masked_rows: expected 'reject' or 'allow', got 'zero'"),
    (lambda: from_sdpa_bool(np.ones(2)), "sdpa_mask: expected dtype bool"),
    (lambda: to_mha_attn_mask(np.ones((2, 3, 3), bool), num_heads=2),
     r"visible: a 3-axis relation \[2, 3, 3\] is ambiguous here"),
    (lambda: to_mha_attn_mask(np.ones((1, 3, 2, 2), bool), num_heads=2),
     "visible: head axis has size 3, expected 1 or num_heads=2"),
    (lambda: to_mha_attn_mask(np.ones((3, 1, 2, 2), bool), num_heads=2, batch=2),
     "visible: batch axis has size 3, expected 1 or batch=2"),
    (lambda: to_mha_attn_mask(PER_HEAD, num_heads=2),
     "batch: needed to expand a per-head relation with B=1"),
    (lambda: from_mha_attn_mask(np.zeros((5, 2, 2), bool), batch=2, num_heads=2),
     r"mha_attn_mask: expected \[Q,K\] or \[B\*H=4,Q,K\], got \[5, 2, 2\]"),
    (lambda: from_mha_attn_mask(np.zeros((2, 2), np.int8), batch=1, num_heads=1),
     "mha_attn_mask: expected dtype bool"),
    (lambda: to_key_padding_mask(np.ones((2, 2), bool)),
     r"visible: expected \[B,H,Q,K\] \(e.g. \[B,1,1,K\]\) axes, got \[2, 2\]"),
    (lambda: from_key_padding_mask(np.zeros(3, bool)),
     r"key_padding_mask: expected shape \[B,K\], got \[3\]"),
    (lambda: from_key_padding_mask(np.zeros((1, 3))), "key_padding_mask: expected dtype bool"),
    (lambda: from_additive_bias(np.array([0.0, -1e9])),
     r"additive_bias: entry \(1\) is -1000000000.0; a finite negative value is ambiguous"),
    (lambda: from_additive_bias(np.array([[0.0, np.nan]])),
     r"additive_bias: entry \(0, 1\) is nan; NaN is not a visibility value"),
    (lambda: from_additive_bias(np.array([np.inf])), r"\+inf is not a visibility value"),
    (lambda: from_additive_bias(np.array([0.0, 0.5])),
     "a finite positive value is a preference \\(bias\\), not visibility"),
    (lambda: from_additive_bias(np.zeros(2, np.float32)),
     "additive_bias: expected dtype float64, got float32"),
    (lambda: to_cu_seqlens(np.ones((2, 1, 3, 3), bool)),
     "visible: cu_seqlens describes one packed row shared by all heads; expected B=1 and H=1"),
    (lambda: to_cu_seqlens(np.ones((1, 3, 3), bool)),
     r"visible: expected \[Q,K\] or \[1,1,Q,K\], got \[1, 3, 3\]"),
    (lambda: to_cu_seqlens(np.tril(np.ones((4, 4), bool)) | np.eye(4, k=1, dtype=bool)),
     "visible: not a block-diagonal relation that cu_seqlens can express"),
    (lambda: to_cu_seqlens(np.tril(np.ones((4, 4), bool))[::-1]),
     "not a block-diagonal relation that cu_seqlens can express"),
    (lambda: to_cu_seqlens(causal(2, 5, alignment="lower_right")),
     r"not a block-diagonal relation that cu_seqlens can express \(some block is neither"),
    (lambda: to_cu_seqlens(np.array([[True, False], [False, False]])),
     r"visible: row \(b=0, h=0, i=1\) has no legal key"),
    (lambda: from_cu_seqlens([0, 2], cu_seqlens_k=[0, 3], causal=True),
     "causal: varlen causal blocks must be square"),
    (lambda: from_cu_seqlens([0, 2, 3], cu_seqlens_k=[0, 3], causal=False),
     "cu_seqlens_k: expected 3 offsets like cu_seqlens_q, got 2"),
    (lambda: from_cu_seqlens([0, 2, 1], causal=False),
     r"cu_seqlens: must be sorted \(non-decreasing\), got 2 then 1 at entries 1, 2"),
    (lambda: to_sdpa_causal(causal(2, 5, alignment="lower_right"), mode="flag"),
     r"refusing to lower a lower-right causal relation \(Q=2, K=5\) to is_causal=True: "
     "PyTorch reads is_causal as upper-left"),
    (lambda: to_sdpa_causal(relation(np.arange(3)[None], np.arange(3)[None],
                                     np.array([[True, True, False]]), causal=True), mode="flag"),
     r"visible: differs from the upper-left causal relation that is_causal=True means at edge "
     r"\(b=0, h=0, i=2, j=2\) \(visible=False\)"),
    (lambda: to_sdpa_causal(SEMANTIC, mode="maybe"), "mode: expected 'auto' or 'flag'"),
    (lambda: from_sdpa_causal(SdpaCausal(False, None), q_len=1, k_len=1),
     "lowering: is_causal=False needs an attn_mask"),
    (lambda: to_block_mask(SEMANTIC, 0),
     r"block_size: expected a positive int or a pair \(q_block, kv_block\), got 0"),
    (lambda: to_block_mask(SEMANTIC, (2, 2, 2)), "block_size: expected a positive int or a pair"),
    (lambda: to_block_mask(SEMANTIC, 1.5), "block_size: expected a positive int or a pair"),
    (lambda: to_block_mask(np.ones((2, 2, 2), bool), 1),
     r"visible: expected \[Q,K\] or \[B,H,Q,K\], got \[2, 2, 2\]"),
    (lambda: to_block_mask(np.ones((2, 2)), 1), "visible: expected dtype bool"),
]


@pytest.mark.parametrize("make,message", ADAPTER_REJECTIONS,
                         ids=[m[:40] for _, m in ADAPTER_REJECTIONS])
def test_adapter_rejections(make, message):
    with pytest.raises(RefAttnError, match=message):
        make()
