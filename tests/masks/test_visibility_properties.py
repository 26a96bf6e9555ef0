"""Issue 3 property tests (hypothesis): the compiler against a per-element predicate and the
contract's own compiler, boolean versus additive composition, adapter round trips and block
classification."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from refattn.masks import (
    VisibilityRelation,
    compile_visibility,
    cu_seqlens_from_lengths,
    relation,
    segments_from_cu_seqlens,
    window_from_inclusive,
)
from refattn.masks.blocks import ABSENT, FULL, PARTIAL, block_mask_to_dense, to_block_mask
from refattn.masks.framework import (
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
from tests.strategies import bool_relations, packed_lengths, visibility_inputs

SETTINGS = settings(max_examples=60, deadline=None)


def _bound(bound, h):
    return bound if bound is None or np.ndim(bound) == 0 else int(bound[h])


def legal(kw: dict, b: int, h: int, i: int, j: int) -> bool:
    """The relation at one element, written from the contract's predicates."""
    p, r = int(kw["q_pos"][b, i]), int(kw["k_pos"][b, j])
    ok = bool(kw["key_valid"][b, j])
    if "q_segment" in kw:
        ok = ok and kw["q_segment"][b, i] == kw["k_segment"][b, j]
    if "prefix_length" in kw:
        P = np.asarray(kw["prefix_length"])
        P = int(P[b] if P.ndim == 1 else P[b, h])
        if p < P:
            ok = ok and r < P  # prefix rows see the whole prefix
        else:
            ok = ok and r <= p  # continuation rows are causal
    elif kw.get("causal", False):
        ok = ok and r <= p
    if "window" in kw:
        left, right = (_bound(x, h) for x in kw["window"])
        ok = ok and (left is None or p - r <= left) and (right is None or r - p <= right)
    return ok


def contract_compile_visibility(q_pos, k_pos, key_valid, *, causal=False, q_segment=None,
                                k_segment=None, prefix_length=None, window=None):
    """The contract's reference compiler, line by line in NumPy (its window counts the query)."""
    visible = key_valid[:, None, :]  # [B,1,K]
    if q_segment is not None or k_segment is not None:
        visible = visible & (q_segment[:, :, None] == k_segment[:, None, :])
    if prefix_length is not None:
        P = np.asarray(prefix_length)
        if P.ndim == 0:
            P = np.broadcast_to(P, (q_pos.shape[0],))
        q_in_prefix = q_pos < P[:, None]
        k_in_prefix = k_pos < P[:, None]
        topology = ((q_in_prefix[:, :, None] & k_in_prefix[:, None, :])
                    | (~q_in_prefix[:, :, None] & (k_pos[:, None, :] <= q_pos[:, :, None])))
        visible = visible & topology
    elif causal:
        visible = visible & (k_pos[:, None, :] <= q_pos[:, :, None])
    if window is not None:
        distance = q_pos[:, :, None] - k_pos[:, None, :]
        visible = visible & (distance >= 0) & (distance < window)
    return visible[:, None, :, :]  # [B,1,Q,K]


@SETTINGS
@given(visibility_inputs())
def test_compile_visibility_agrees_with_a_per_element_predicate(kw):
    vis = compile_visibility(**kw)
    B, Q = kw["q_pos"].shape
    K = kw["k_pos"].shape[1]
    assert vis.dtype == bool and vis.shape[0] == B and vis.shape[2:] == (Q, K)
    for b, h, i, j in np.ndindex(vis.shape):
        assert vis[b, h, i, j] == legal(kw, b, h, i, j), (b, h, i, j)


@SETTINGS
@given(visibility_inputs(), st.integers(1, 4))
def test_agrees_with_the_contract_compiler(kw, w):
    kw = {k: v for k, v in kw.items() if k != "window"}
    if np.ndim(kw.get("prefix_length", 0)) == 2:
        kw["prefix_length"] = kw["prefix_length"][:, 0]
    ours = compile_visibility(**kw, window=window_from_inclusive(w, 1))
    theirs = contract_compile_visibility(**kw, window=w)
    assert np.array_equal(ours, theirs)
    # without a pairwise rule the contract's result is only [B,1,1,K]: compare broadcast
    ours, theirs = compile_visibility(**kw), contract_compile_visibility(**kw)
    assert np.array_equal(ours, np.broadcast_to(theirs, ours.shape))


@SETTINGS
@given(visibility_inputs(), st.data())
def test_tiles_and_manifest_reproduce_the_dense_relation(kw, data):
    rel = relation(**kw)
    dense = rel.dense()
    B, H, Q, K = dense.shape
    b, h = data.draw(st.integers(0, B - 1)), data.draw(st.integers(0, H - 1))
    i0, i1 = sorted(data.draw(st.lists(st.integers(0, Q), min_size=2, max_size=2)))
    j0, j1 = sorted(data.draw(st.lists(st.integers(0, K), min_size=2, max_size=2)))
    assert np.array_equal(rel.tile(b, i0, i1, j0, j1, h=h), dense[b, h, i0:i1, j0:j1])
    again = VisibilityRelation.from_manifest(rel.manifest())
    assert np.array_equal(again.dense(), dense)


def kernel_edge(a, b: int, h: int, i: int, j: int) -> bool:
    """The KernelArguments formula, element by element (what a compiled tile kernel runs)."""
    p, r = a.q_pos[b, i], a.k_pos[b, j]
    P = a.prefix_length[b, h]
    topo = (a.topology == 0 or (a.topology == 1 and r <= p)
            or (a.topology == 2 and ((p < P and r < P) or (p >= P and r <= p))))
    return bool(a.key_valid[b, j]
                and (not a.has_segments or a.q_segment[b, i] == a.k_segment[b, j])
                and topo
                and (a.left[h] < 0 or p - r <= a.left[h])
                and (a.right[h] < 0 or r - p <= a.right[h]))


@SETTINGS
@given(visibility_inputs())
def test_kernel_arguments_reproduce_the_relation(kw):
    rel = relation(**kw)
    args = rel.kernel_arguments()
    dense = rel.dense()
    B, H = dense.shape[:2]
    assert args.prefix_length.shape == (B, H) and args.left.shape == args.right.shape == (H,)
    for b, h, i, j in np.ndindex(dense.shape):
        assert dense[b, h, i, j] == kernel_edge(args, b, h, i, j)


def _components(kw: dict) -> list[np.ndarray]:
    """Each declared rule compiled alone (the others left unrestricted)."""
    base = {"q_pos": kw["q_pos"], "k_pos": kw["k_pos"], "key_valid": None}
    parts = [compile_visibility(**{**base, "key_valid": kw["key_valid"]})]
    for keys in (("q_segment", "k_segment"), ("causal",), ("prefix_length",), ("window",)):
        if all(k in kw for k in keys):
            parts.append(compile_visibility(**base, **{k: kw[k] for k in keys}))
    return parts


@SETTINGS
@given(visibility_inputs())
def test_boolean_composition_equals_additive_composition(kw):
    full = compile_visibility(**kw)
    parts = _components(kw)
    boolean = np.logical_and.reduce(np.broadcast_arrays(*parts))
    assert np.array_equal(boolean, np.broadcast_to(full, boolean.shape))
    additive = sum(to_additive_bias(p, all_masked_rows="allow") for p in parts)
    assert np.array_equal(additive, np.broadcast_to(
        to_additive_bias(full, all_masked_rows="allow"), additive.shape))
    assert np.array_equal(from_additive_bias(additive), boolean)
    # either illegal rule stays authoritative after any finite score is added
    scores = np.random.default_rng(0).standard_normal(additive.shape) * 1e300
    assert np.array_equal(np.isneginf(scores + additive), ~boolean)


@SETTINGS
@given(bool_relations(), st.integers(1, 3))
def test_dense_adapters_round_trip(vis, num_heads):
    B, H, Q, K = vis.shape
    allow = {"all_masked_rows": "allow"}
    assert np.array_equal(from_sdpa_bool(to_sdpa_bool(vis, **allow)), vis)
    assert np.array_equal(from_additive_bias(to_additive_bias(vis, **allow)), vis)
    heads = H if H > 1 else num_heads
    mha = to_mha_attn_mask(vis, num_heads=heads, batch=B, **allow)
    back = from_mha_attn_mask(mha, batch=B, num_heads=heads)
    assert np.array_equal(np.broadcast_to(back, (B, heads, Q, K)),
                          np.broadcast_to(vis, (B, heads, Q, K)))
    low = to_sdpa_causal(vis, **allow)
    assert np.array_equal(np.broadcast_to(from_sdpa_causal(low, q_len=Q, k_len=K), vis.shape), vis)


@SETTINGS
@given(bool_relations(max_heads=2), st.integers(1, 4), st.integers(1, 4))
def test_block_metadata_classifies_each_block(vis, q_block, kv_block):
    bm = to_block_mask(vis, (q_block, kv_block))
    classes = bm.classes()
    B, H, Q, K = vis.shape
    for b, h in np.ndindex(B, H):
        for qb, i0 in enumerate(range(0, Q, q_block)):
            for kb, j0 in enumerate(range(0, K, kv_block)):
                block = vis[b, h, i0:i0 + q_block, j0:j0 + kv_block]
                want = FULL if block.all() else ABSENT if not block.any() else PARTIAL
                assert classes[b, h, qb, kb] == want
    # absent blocks are not listed; partial and full lists never overlap
    assert ((bm.kv_indices >= 0).sum(-1) == bm.kv_num_blocks).all()
    assert ((bm.full_kv_indices >= 0).sum(-1) == bm.full_kv_num_blocks).all()
    assert np.array_equal(block_mask_to_dense(bm), vis)


@SETTINGS
@given(visibility_inputs(max_q=5, max_k=5), st.integers(1, 3), st.integers(1, 3))
def test_block_metadata_from_tiles_equals_dense(kw, q_block, kv_block):
    rel = relation(**kw)
    from_tiles = to_block_mask(rel, (q_block, kv_block))
    from_dense = to_block_mask(rel.dense(), (q_block, kv_block))
    assert np.array_equal(from_tiles.classes(), from_dense.classes())
    assert np.array_equal(block_mask_to_dense(from_tiles), rel.dense())


@SETTINGS
@given(st.integers(1, 3), st.integers(1, 2), st.integers(1, 4), st.integers(1, 5), st.data())
def test_key_padding_round_trips_for_column_validity(B, H, Q, K, data):
    kv = np.array(data.draw(st.lists(st.lists(st.booleans(), min_size=K, max_size=K),
                                     min_size=B, max_size=B)), dtype=bool)
    kv[:, 0] = True
    vis = np.broadcast_to(kv[:, None, None, :], (B, H, Q, K)).copy()  # physical copy
    kpm = to_key_padding_mask(vis)
    assert kpm.shape == (B, K)
    assert np.array_equal(np.broadcast_to(from_key_padding_mask(kpm), vis.shape), vis)


@SETTINGS
@given(packed_lengths(), st.booleans(), st.booleans())
def test_cu_seqlens_round_trip(lengths, is_causal, as_relation):
    cu = cu_seqlens_from_lengths(lengths)
    vis = from_cu_seqlens(cu, causal=is_causal)
    if as_relation:
        seg = segments_from_cu_seqlens(cu)
        pos, ids = seg.positions[None], seg.segment_ids[None]
        rel = relation(pos, pos, causal=is_causal, q_segment=ids, k_segment=ids)
        assert np.array_equal(rel.dense(), vis)
        vis = rel
    low = to_cu_seqlens(vis)
    assert low.cu_seqlens_q.tolist() == cu.tolist() == low.cu_seqlens_k.tolist()
    # blocks of one token are both causal and full; otherwise the flag is recovered
    assert low.causal == is_causal or max(lengths) == 1
    assert np.array_equal(from_cu_seqlens(low.cu_seqlens_q, cu_seqlens_k=low.cu_seqlens_k,
                                          causal=low.causal),
                          from_cu_seqlens(cu, causal=is_causal))


@SETTINGS
@given(kw=visibility_inputs(), block=st.integers(1, 40))
def test_row_any_in_blocks_equals_the_dense_relation(kw, block):
    # the gate's empty-row check reads this instead of building the dense relation
    rel = relation(**kw)
    assert np.array_equal(rel.row_any(block_elements=block), rel.dense().any(axis=-1))
