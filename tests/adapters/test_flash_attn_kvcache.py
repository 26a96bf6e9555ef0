"""FlashAttention's paged-KV interface on refattn: ``flash_attn_with_kvcache(q, k_cache,
v_cache, cache_seqlens=, block_table=, ...)`` lowered to refattn's paged call
(refattn.adapters.flash_attn.kvcache_call / flash_attn_with_kvcache).

The expected values come from a from-scratch NumPy implementation of the documented interface
written here: gather each sequence's first ``cache_seqlens[b]`` tokens page by page through
``block_table``, then plain attention with the documented mask ("[i + seqlen_k - seqlen_q -
window_size[0], i + seqlen_k - seqlen_q + window_size[1]] inclusive", causal = right bound 0),
ALiBi "(-alibi_slope * |i + seqlen_k - seqlen_q - j|)", softcap on the scaled score, GQA head
h -> kv head h // (Hq // Hkv), zero output and lse +inf on a row without a key. One loop per
row, no refattn.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import refattn
from refattn.adapters.flash_attn import flash_attn_with_kvcache, kvcache_call
from refattn.errors import RefAttnError


def _reference(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None,
               causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
    B, Q, H, D = q.shape
    ps, Hkv, Dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    out, lse = np.zeros((B, Q, H, Dv)), np.full((B, H, Q), np.inf)
    for b in range(B):
        n = int(cache_seqlens[b])
        blocks = block_table[b, : -(-n // ps)]  # the blocks sequence b reads
        k = np.concatenate([k_cache[p] for p in blocks])[:n]  # (n, Hkv, D): token order
        v = np.concatenate([v_cache[p] for p in blocks])[:n]
        j = np.arange(n)
        for h in range(H):
            kv_head = h // (H // Hkv)
            for i in range(Q):
                pos = i + n - Q  # i + seqlen_k - seqlen_q
                s = scale * (k[:, kv_head] @ q[b, i, h])  # (n,)
                if softcap > 0:
                    s = softcap * np.tanh(s / softcap)
                if alibi_slopes is not None:
                    slope = alibi_slopes[h] if alibi_slopes.ndim == 1 else alibi_slopes[b, h]
                    s = s - float(slope) * np.abs(pos - j)
                left, right = window_size[0], 0 if causal else window_size[1]
                keep = np.ones(n, bool)
                if left >= 0:
                    keep &= j >= pos - left
                if right >= 0:
                    keep &= j <= pos + right
                if not keep.any():
                    continue  # "If the row of the mask is all zero, the output will be zero"
                m = s[keep].max()
                e = np.exp(s[keep] - m)
                out[b, i, h] = e @ v[keep, kv_head] / e.sum()
                lse[b, h, i] = m + np.log(e.sum())
    return out, lse


def _inputs(*, B=2, Q=1, Hq=4, Hkv=2, D=8, ps=4, max_blocks=3, lens=(9, 5), seed=0):
    """A paged cache whose pages are shuffled among sequences, -1 past each one's blocks."""
    rng = np.random.default_rng(seed)
    num_blocks = B * max_blocks + 1
    k_cache = rng.standard_normal((num_blocks, ps, Hkv, D))
    v_cache = rng.standard_normal((num_blocks, ps, Hkv, D))
    order = rng.permutation(num_blocks)
    table = np.full((B, max_blocks), -1, np.int32)
    used = 0
    for b, n in enumerate(lens):
        need = -(-n // ps)
        table[b, :need] = order[used:used + need]
        used += need
    return (rng.standard_normal((B, Q, Hq, D)), k_cache, v_cache,
            np.asarray(lens, np.int32), table)


CASES: dict[str, tuple[dict, dict]] = {
    "decode_causal_gqa": ({"Q": 1}, {"causal": True}),
    "three_queries_causal": ({"Q": 3, "lens": (11, 3)}, {"causal": True}),
    "not_causal": ({"Q": 2, "lens": (6, 12)}, {}),
    "sliding_window": ({"Q": 3}, {"causal": True, "window_size": (2, -1)}),
    "two_sided_window": ({"Q": 3, "lens": (10, 7)}, {"window_size": (1, 1)}),
    "right_window_only": ({"Q": 2}, {"window_size": (-1, 0)}),
    "softcap_and_scale": ({"Q": 2}, {"causal": True, "softcap": 1.5, "softmax_scale": 0.7}),
    "alibi_per_head_fp32": ({"Q": 2}, {"causal": True, "alibi": (4,)}),
    "alibi_per_batch_fp64": ({"Q": 3, "lens": (12, 8)}, {"window_size": (3, 1),
                                                         "alibi": (2, 4)}),
    "mqa_page_of_one": ({"Hkv": 1, "ps": 1, "max_blocks": 7, "lens": (7, 2), "Q": 2},
                        {"causal": True}),
    "rows_without_keys": ({"Q": 3, "lens": (2, 9)}, {"causal": True}),
    "window_empties_rows": ({"Q": 3, "lens": (2, 9)}, {"window_size": (0, 0)}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_the_gather_then_attend_reference(name):
    shape, options = CASES[name]
    q, k_cache, v_cache, lens, table = _inputs(**shape)
    kw = dict(options)
    if "alibi" in kw:
        slopes: Any = np.random.default_rng(1).uniform(0.05, 0.5, kw.pop("alibi"))
        kw["alibi_slopes"] = slopes.astype(np.float32 if slopes.ndim == 1 else np.float64)
    given = [x.copy() for x in (q, k_cache, v_cache, lens, table)]
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                       block_table=table, return_softmax_lse=True, **kw)
    want_out, want_lse = _reference(q, k_cache, v_cache, lens, table, **kw)
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)
    assert np.array_equal(np.isinf(lse), np.isinf(want_lse))  # +inf exactly on empty rows
    np.testing.assert_allclose(lse, want_lse, rtol=1e-13, atol=1e-13)
    for before, after in zip(given, (q, k_cache, v_cache, lens, table), strict=True):
        assert np.array_equal(before, after)  # the caches are read, never written
    if name.endswith(("without_keys", "empties_rows")):
        assert np.isinf(want_lse).any() and not out[np.isinf(lse).transpose(0, 2, 1)].any()


def test_a_contiguous_cache_reads_row_b_and_an_int_cache_seqlens():
    q, k_cache, v_cache, _, _ = _inputs(Q=2, ps=6, max_blocks=1, lens=(6, 6))
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5, causal=True)
    identity = np.arange(2, dtype=np.int32)[:, None]
    want, _ = _reference(q, k_cache, v_cache, [5, 5], identity, causal=True)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-13)


def test_the_call_is_the_paged_call_with_the_cache_offsets():
    q, k_cache, v_cache, lens, table = _inputs(Q=3, lens=(11, 3))
    kv = kvcache_call(q, k_cache, v_cache, cache_seqlens=lens, block_table=table, causal=True)
    assert kv.call.axes == {"B": 2, "Hq": 4, "Hkv": 2, "Q": 3, "K": 12, "Dk": 8, "Dv": 8}
    rel: Any = kv.call.relation
    assert rel.q_pos.tolist() == [[8, 9, 10], [0, 1, 2]]
    assert rel.layout == "cache"
    assert np.array_equal(kv.paged.block_table, table)
    # canonical key t of sequence b is token t: page table[b, t // 4], slot t % 4
    assert np.array_equal(kv.call.k[1, 0, 2], k_cache[table[1, 0], 2, 0])
    assert np.array_equal(kv.call.k[0, 1, 9], k_cache[table[0, 2], 1, 1])


def _bad(**changes):
    q, k_cache, v_cache, lens, table = _inputs(Q=2)
    kw = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": lens,
          "block_table": table, **changes}
    with pytest.raises(RefAttnError) as info:
        flash_attn_with_kvcache(**kw)
    return str(info.value)


def test_a_block_index_out_of_range_names_the_entry():
    table = _inputs(Q=2)[4].copy()
    table[1, 1] = 99  # sequence 1 (5 tokens) reads blocks 0 and 1
    msg = _bad(block_table=table)
    assert msg.startswith("block_table: entry (b=1, p=1) is 99, expected a block in "
                          "[0, num_blocks=7)"), msg
    table[1, 1] = -1
    assert "entry (b=1, p=1) is -1" in _bad(block_table=table)


def test_entries_past_a_sequences_blocks_are_not_read():
    q, k_cache, v_cache, lens, table = _inputs(Q=2)
    padded = table.copy()
    padded[1, 2] = 12345  # sequence 1 reads 2 blocks: the third is never read
    a = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=padded)
    b = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=table)
    assert np.array_equal(a, b)


def test_sequences_may_share_pages_and_their_gradients_add_up():
    """A common prefix cached once (vLLM's prefix caching): both sequences read page P. The
    forward matches the reference; the page gradients equal those of the same call with the
    shared page copied once per reader, summed back (d/dP of f(P, P) = f_1 + f_2)."""
    q, k_cache, v_cache, lens, table = _inputs(Q=2, lens=(9, 7))
    shared = table.copy()
    shared[1, 0] = table[0, 0]  # sequence 1 starts with sequence 0's first page
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, block_table=shared,
                                  causal=True)
    want, _ = _reference(q, k_cache, v_cache, lens, shared, causal=True)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-13)

    kv = kvcache_call(q, k_cache, v_cache, cache_seqlens=lens, block_table=shared, causal=True)
    t = refattn.forward(kv.call)
    g_out = np.random.default_rng(5).standard_normal(t.output.shape)  # (B, Hq, Q, Dv)
    pages = kv.paged.page_gradients(refattn.backward(t, g_out))
    # the same call with a private copy of the shared page for sequence 1
    spare = int(np.setdiff1d(np.arange(k_cache.shape[0]), shared[shared >= 0])[0])
    private = shared.copy()
    private[1, 0] = spare
    k2, v2 = k_cache.copy(), v_cache.copy()
    k2[spare], v2[spare] = k_cache[shared[0, 0]], v_cache[shared[0, 0]]
    kv2 = kvcache_call(q, k2, v2, cache_seqlens=lens, block_table=private, causal=True)
    t2 = refattn.forward(kv2.call)
    assert np.array_equal(t2.output, t.output)  # the same keys, the same call
    pages2 = kv2.paged.page_gradients(refattn.backward(t2, g_out))
    p0 = shared[0, 0]
    for got, sep in ((pages.grad_k_pages, pages2.grad_k_pages),
                     (pages.grad_v_pages, pages2.grad_v_pages)):
        np.testing.assert_allclose(got[p0], sep[p0] + sep[spare], rtol=1e-14, atol=1e-15)
        others = np.setdiff1d(np.arange(k_cache.shape[0]), [p0, spare])
        assert np.array_equal(got[others], sep[others])
        assert not got[spare].any()  # the spare page is read by nobody in the shared call
    assert kv.paged.conventions()["shared_pages"] is True


def test_cache_seqlens_beyond_the_table_or_empty_are_refused():
    msg = _bad(cache_seqlens=np.array([13, 5], np.int32))
    assert msg.startswith("cache_seqlens: entry b=0 is 13, expected 1 <= cache_seqlens[b] <= "
                          "max_num_blocks_per_seq * page_block_size = 3 * 4 = 12"), msg
    assert _bad(cache_seqlens=np.array([9, 0], np.int32)).startswith(
        "cache_seqlens: entry b=1 is 0, expected 1 <= cache_seqlens[b]")
    assert "cache_seqlens: expected shape [batch_size=2]" in _bad(
        cache_seqlens=np.array([9, 5, 1], np.int32))


@pytest.mark.parametrize(("name", "value", "start"), [
    ("q", np.float32, "q: expected dtype float64"),
    ("k_cache", np.float16, "k_cache: expected dtype float64"),
    ("v_cache", np.float32, "v_cache: expected dtype float64"),
    ("block_table", np.int64, "block_table: expected dtype int32"),
    ("cache_seqlens", np.float64, "cache_seqlens: expected dtype int32"),
    ("alibi_slopes", np.int32, "alibi_slopes: expected dtype float32"),
])
def test_wrong_dtypes_name_the_tensor(name, value, start):
    q, k_cache, v_cache, lens, table = _inputs(Q=2)
    given = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": lens,
             "block_table": table, "alibi_slopes": np.ones(4)}
    msg = _bad(**{name: given[name].astype(value)})
    assert msg.startswith(start), msg


def test_layouts_and_bad_arguments_are_refused():
    q, k_cache, _, lens, table = _inputs(Q=2)
    assert _bad(k_cache=k_cache[0]).startswith(
        "k_cache: expected shape (num_blocks, page_block_size, nheads_k, headdim)")
    assert _bad(q=q[:, :, :3]).startswith("q: nheads=3 must be a multiple of k_cache's "
                                          "nheads_k=2")
    assert _bad(block_table=table[:1]).startswith(
        "block_table: expected shape [batch_size=2, max_num_blocks_per_seq]")
    # appends, rotary tables, leftpad and batch_idx are computed (test_flash_attn_kvcache_rope);
    # what stays refused: half an append, leftpad or batch_idx with a paged cache
    assert _bad(k=q).startswith("k, v: pass both (the new keys and values) or neither")
    assert _bad(cache_leftpad=lens).startswith("cache_leftpad / cache_batch_idx: not with a "
                                               "block_table")
    assert _bad(window_size=(1.5, 0)).startswith(
        "flash_attn_with_kvcache: window_size[0]: expected an integer below 2**128 in magnitude, "
        "got 1.5")
    assert _bad(window_size=(1, 2, 3)).startswith(
        "flash_attn_with_kvcache: window_size: expected a pair (a tuple or list of 2)")
