"""Issue 3: the adapters checked against PyTorch itself (SDPA, MultiheadAttention, CausalBias,
FlexAttention block masks). Skipped cleanly without torch."""

from __future__ import annotations

import numpy as np
import pytest

import refattn
from refattn.masks import causal, relation
from refattn.masks.blocks import to_block_mask
from refattn.masks.framework import (
    to_additive_bias,
    to_key_padding_mask,
    to_mha_attn_mask,
    to_sdpa_bool,
    to_sdpa_causal,
)

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

TOL = dict(rtol=1e-12, atol=1e-13)


def _qkv(B, H, Q, K, D, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, H, Q, D)), rng.standard_normal((B, H, K, D)),
            rng.standard_normal((B, H, K, D)))


def _sdpa(q, k, v, **kw):
    t = [torch.from_numpy(x) for x in (q, k, v)]
    if isinstance(kw.get("attn_mask"), np.ndarray):
        kw["attn_mask"] = torch.from_numpy(kw["attn_mask"])
    return torch.nn.functional.scaled_dot_product_attention(*t, **kw).numpy()


def test_is_causal_true_is_upper_left_for_rectangular_scores():
    q, k, v = _qkv(1, 2, 2, 5, 4)
    flagged = _sdpa(q, k, v, is_causal=True)
    upper = refattn.attention(q, k, v, visible=causal(2, 5, alignment="upper_left"))
    lower = refattn.attention(q, k, v, visible=causal(2, 5, alignment="lower_right"))
    np.testing.assert_allclose(flagged, upper, **TOL)
    assert np.abs(flagged - lower).max() > 1e-3  # the flag does not mean cache alignment


def test_lowered_lower_right_relation_matches_sdpa_and_causal_bias():
    from torch.nn.attention.bias import causal_lower_right

    rel = causal(2, 5, alignment="lower_right")
    assert np.array_equal(causal_lower_right(2, 5)._materialize().numpy(), rel.dense()[0, 0])
    low = to_sdpa_causal(rel)
    assert not low.is_causal
    q, k, v = _qkv(1, 2, 2, 5, 4, seed=1)
    np.testing.assert_allclose(_sdpa(q, k, v, attn_mask=low.attn_mask),
                               refattn.attention(q, k, v, visible=rel), **TOL)


def test_sdpa_bool_and_additive_masks_match_the_reference():
    B, H, Q, K, D = 2, 3, 4, 6, 5
    q, k, v = _qkv(B, H, Q, K, D, seed=2)
    pos = np.arange(K)[None].repeat(B, 0)
    kv = pos < np.array([[6], [4]])
    rel = relation(pos[:, :Q] + 2, pos, kv, causal=True, window=(np.array([2, 3, 9]), 0))
    ref = refattn.attention(q, k, v, visible=rel)
    np.testing.assert_allclose(_sdpa(q, k, v, attn_mask=to_sdpa_bool(rel)), ref, **TOL)
    np.testing.assert_allclose(_sdpa(q, k, v, attn_mask=to_additive_bias(rel)), ref, **TOL)


def _mha(q, k, v, **masks):
    """nn.functional multi-head attention with identity projections on head-major inputs."""
    B, H, Q, D = q.shape
    E = H * D

    def seq_major(x):  # (B, H, L, D) -> (L, B, E)
        return torch.from_numpy(x.transpose(2, 0, 1, 3).reshape(x.shape[2], B, E))

    eye = torch.eye(E, dtype=torch.float64)
    out, _ = torch.nn.functional.multi_head_attention_forward(
        seq_major(q), seq_major(k), seq_major(v), E, H,
        in_proj_weight=torch.cat([eye, eye, eye]), in_proj_bias=None, bias_k=None,
        bias_v=None, add_zero_attn=False, dropout_p=0.0, out_proj_weight=eye,
        out_proj_bias=None, training=False, need_weights=False,
        **{n: torch.from_numpy(m) for n, m in masks.items()},
    )
    return out.numpy().reshape(Q, B, H, D).transpose(1, 2, 0, 3)


def test_mha_attn_mask_polarity_and_head_order():
    B, H, Q, K, D = 2, 3, 4, 5, 2
    q, k, v = _qkv(B, H, Q, K, D, seed=3)
    rng = np.random.default_rng(5)
    vis = rng.random((B, H, Q, K)) < 0.5
    vis[..., 0] = True
    mask = to_mha_attn_mask(vis, num_heads=H)
    assert mask.shape == (B * H, Q, K)
    np.testing.assert_allclose(_mha(q, k, v, attn_mask=mask),
                               refattn.attention(q, k, v, visible=vis), **TOL)
    shared = causal(Q, K, alignment="lower_right")
    np.testing.assert_allclose(_mha(q, k, v, attn_mask=to_mha_attn_mask(shared, num_heads=H)),
                               refattn.attention(q, k, v, visible=shared), **TOL)


def test_mha_key_padding_mask_with_a_causal_attn_mask():
    B, H, Q, K, D = 2, 2, 5, 5, 3
    q, k, v = _qkv(B, H, Q, K, D, seed=4)
    pos = np.arange(K)[None].repeat(B, 0)
    kv = pos < np.array([[5], [3]])
    padding = relation(pos, pos, kv)
    tri = causal(Q, K, alignment="upper_left")
    both = relation(pos, pos, kv, causal=True)
    out = _mha(q, k, v, key_padding_mask=to_key_padding_mask(padding),
               attn_mask=to_mha_attn_mask(tri, num_heads=H))
    np.testing.assert_allclose(out, refattn.attention(q, k, v, visible=both), **TOL)


def test_block_metadata_matches_flex_attention():
    from torch.nn.attention.flex_attention import create_block_mask

    pos = np.arange(8)[None]
    seg = np.array([[0, 0, 0, 1, 1, 1, 1, 1]])
    rel = relation(pos, pos, causal=True, q_segment=seg, k_segment=seg)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (torch.from_numpy(seg[0])[q_idx]
                                    == torch.from_numpy(seg[0])[kv_idx])

    theirs = create_block_mask(mask_mod, 1, 1, 8, 8, device="cpu", BLOCK_SIZE=2)
    ours = to_block_mask(rel, 2)
    for num, idx in (("kv_num_blocks", "kv_indices"),
                     ("full_kv_num_blocks", "full_kv_indices")):
        n_ours, n_theirs = getattr(ours, num), getattr(theirs, num).numpy()
        assert np.array_equal(n_ours, n_theirs)
        i_ours, i_theirs = getattr(ours, idx), getattr(theirs, idx).numpy()
        for qb in range(4):
            n = n_ours[0, 0, qb]
            assert i_ours[0, 0, qb, :n].tolist() == sorted(i_theirs[0, 0, qb, :n].tolist())
