"""FlashAttention's kvcache test matrix on refattn: appends (k=, v=), rotary embeddings
(interleaved and not, partial rotary_dim), cache_leftpad, cache_batch_idx, paged and not,
causal, local, ALiBi, MHA / MQA / GQA.

The expected values follow ``tests/test_flash_attn.py::test_flash_attn_kvcache`` of
Dao-AILab/flash-attention (commit 0251105a2fb1), ported to NumPy without refattn in
tests/adapters/fa_kvcache_reference.py:
``apply_rotary_emb_torch`` with ``seqlen_offsets=cache_seqlens`` (q at ``cache_seqlens + i``
when causal or local, else every q token at ``cache_seqlens`` through ``"b s h d -> b 1 (s
h) d"``), ``k_cache_ref = k_cache[cache_batch_idx]`` (or the paged cache gathered through
``block_table``), ``k_cache_ref[update_mask] = k_ro`` on ``cache_seqlens <= arange <
cache_seqlens + seqlen_new``, the key padding mask ``arange < cache_seqlens + seqlen_new``
and ``arange >= cache_leftpad``, then ``attention_ref`` with ``construct_local_mask``'s
leftpad-relative columns (``col_idx - key_leftpad``, ``sk = key_padding_mask.sum()``), one
loop per row. The cache FlashAttention leaves behind (``k_cache_select``) is compared bit for
bit with refattn's returned copy, as the FA test compares it with ``k_cache_ref``.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

from refattn.adapters.flash_attn import (
    flash_attn_with_kvcache,
    flash_call,
    ineligible,
    kvcache_call,
)
from refattn.bundle.golden.spec import case_spec
from refattn.bundle.suites import kvcache as kvcache_suite
from refattn.errors import RefAttnError

sys.path.insert(0, str(Path(__file__).parent))
from fa_kvcache_reference import fa_case, fa_reference


def _matrix():
    """The FA matrix, its skips, on a covering subset of the axes that need no pairing."""
    out = []
    for (paged, has_leftpad, has_batch_idx, rotary_fraction, interleaved, new_kv,
         causal, local) in itertools.product([None, 4], [False, True], [False, True],
                                             [0.0, 0.5, 1.0], [False, True], [False, True],
                                             [False, True], [False, True]):
        if not new_kv and rotary_fraction > 0.0:
            continue  # FA: rotary only with new kv
        if paged is not None and (has_batch_idx or has_leftpad):
            continue  # FA: refused with a paged cache
        if rotary_fraction == 0.0 and interleaved:
            continue  # the layout of no table
        n = len(out)
        seqlen_q = (1, 3)[n % 2]
        out.append((seqlen_q, 32, has_batch_idx, has_leftpad, paged, rotary_fraction,
                    interleaved, n % 3 != 0, causal, local, n % 5 == 0, new_kv,
                    ("mha", "mqa", "gqa")[n % 3], n))
    return out


MATRIX = _matrix()


def _id(p):
    return (f"q{p[0]}-{'paged' if p[4] else 'flat'}-lp{int(p[3])}-bi{int(p[2])}-ro{p[5]}"
            f"{'i' if p[6] else 'n'}-new{int(p[11])}-c{int(p[8])}-l{int(p[9])}-{p[12]}"
            f"{'-alibi' if p[10] else ''}")


@pytest.mark.parametrize("params", MATRIX, ids=[_id(p) for p in MATRIX])
def test_the_kvcache_matrix_matches_flash_attentions_reference(params):
    args = fa_case(*params)
    kept = {n: a.copy() for n, a in args.items() if isinstance(a, np.ndarray)}
    out, k_new, v_new = flash_attn_with_kvcache(**args, return_updated_cache=True)
    for name, a in kept.items():  # the caller's arrays are never changed
        assert np.array_equal(args[name], a), name
    want, kc_ref, vc_ref = fa_reference(
        args["q"], args["k_cache"], args["v_cache"], args["k"], args["v"], args["rotary_cos"],
        args["rotary_sin"], args["cache_seqlens"], args["cache_leftpad"],
        args["cache_batch_idx"], args["block_table"], args["causal"], args["window_size"],
        args["rotary_interleaved"], args["alibi_slopes"])
    assert np.allclose(out, want, rtol=1e-12, atol=1e-12), np.abs(out - want).max()
    # the cache the kernel leaves behind: FA's k_cache_select against k_cache_ref
    B = args["q"].shape[0]
    if args["block_table"] is None:
        rows = np.arange(B) if args["cache_batch_idx"] is None else args["cache_batch_idx"]
        k_sel, v_sel = k_new[rows], v_new[rows]
        others = np.setdiff1d(np.arange(k_new.shape[0]), rows)
        assert np.array_equal(k_new[others], args["k_cache"][others])  # untouched rows
    else:
        t = args["block_table"].ravel()
        k_sel = k_new[t].reshape(B, -1, *k_new.shape[2:])
        v_sel = v_new[t].reshape(B, -1, *v_new.shape[2:])
    assert np.array_equal(k_sel, kc_ref)  # the same rotation, bit for bit
    assert np.array_equal(v_sel, vc_ref)


def test_appended_rows_are_rotated_once_and_counted_in_the_lengths():
    rng = np.random.default_rng(0)
    kc = rng.standard_normal((1, 8, 1, 16))
    k, v = rng.standard_normal((1, 2, 1, 16)), rng.standard_normal((1, 2, 1, 16))
    angle = rng.random((8, 8))
    kv = kvcache_call(rng.standard_normal((1, 2, 2, 16)), kc, kc, k=k, v=v,
                      rotary_cos=np.cos(angle), rotary_sin=np.sin(angle),
                      cache_seqlens=np.array([3], np.int32), causal=True)
    assert kv.call.axes["K"] == 5 and kv.call.relation.q_pos.tolist() == [[3, 4]]
    assert kv.append.k_positions().tolist() == [[3, 4]]
    assert kv.append.q_positions().tolist() == [[3, 4]]


def _bad(**kw):
    with pytest.raises(RefAttnError) as info:
        flash_attn_with_kvcache(**kw)
    return str(info.value)


def _small(**over):
    rng = np.random.default_rng(1)
    args = dict(q=rng.standard_normal((2, 2, 2, 16)), k_cache=rng.standard_normal((3, 8, 1, 16)),
                v_cache=rng.standard_normal((3, 8, 1, 16)), k=rng.standard_normal((2, 2, 1, 16)),
                v=rng.standard_normal((2, 2, 1, 16)), rotary_cos=np.ones((8, 4)),
                rotary_sin=np.zeros((8, 4)), cache_seqlens=np.array([3, 5], np.int32),
                causal=True)
    args.update(over)
    return args


def test_bad_inputs_name_the_tensor_the_index_and_the_limit():
    assert _small() and flash_attn_with_kvcache(**_small()).shape == (2, 2, 2, 16)
    msg = _bad(**_small(cache_seqlens=np.array([3, 7], np.int32)))
    assert msg.startswith("cache_seqlens: entry b=1 is 7; appending seqlen_new=2 tokens needs "
                          "cache_seqlens[b] + 2 <= the cache's capacity seqlen_cache = 8 "
                          "(k_cache's rows), got 9"), msg
    msg = _bad(**_small(rotary_cos=np.ones((6, 4)), rotary_sin=np.zeros((6, 4))))
    assert msg.startswith("k positions (cache_seqlens[b] + t): entry (b=1, t=1) is 6, expected "
                          "a position in [0, 6) (rotary_cos has 6 rows: the RoPE table is "
                          "shorter than the positions)"), msg
    msg = _bad(**_small(cache_batch_idx=np.array([0, 3], np.int32)))
    assert msg.startswith("cache_batch_idx: entry b=1 is 3, expected a row in "
                          "[0, batch_size_cache=3) of k_cache"), msg
    msg = _bad(**_small(cache_batch_idx=np.array([2, 2], np.int32)))
    assert msg.startswith("cache_batch_idx: entries b=0 and b=1 are both 2; a duplicate is a "
                          "race"), msg
    msg = _bad(**_small(cache_leftpad=np.array([0, 6], np.int32)))
    assert msg.startswith("cache_leftpad: entry b=1 is 6, beyond cache_seqlens[b] = 5"), msg
    assert _bad(**_small(k=None, v=None)).startswith(
        "rotary_cos: rotary embeddings apply only with k and v appended")
    assert _bad(**_small(rotary_cos=np.ones((8, 9)), rotary_sin=np.zeros((8, 9)))).startswith(
        "rotary_cos: rotary_dim = 2 x 9 = 18 exceeds headdim 16")
    assert _bad(**_small(rotary_cos=np.ones((8, 4), np.float32))).startswith(
        "rotary_cos: expected dtype float64")
    assert _bad(**_small(rotary_sin=np.zeros((8, 2)))).startswith(
        "rotary_sin: shape [8, 2] must equal rotary_cos's [8, 4]")
    assert _bad(**_small(k=np.zeros((2, 2, 1, 16), np.float32))).startswith(
        "k: expected dtype float64")
    assert _bad(**_small(cache_leftpad=np.array([0, 1], np.int64))).startswith(
        "cache_leftpad: expected dtype int32")


def test_appends_past_a_paged_cache_and_shared_slots_are_refused():
    rng = np.random.default_rng(2)
    pages = rng.standard_normal((4, 4, 1, 8))
    new = rng.standard_normal((2, 2, 1, 8))
    table = np.array([[0, 1], [2, 3]], np.int32)
    msg = _bad(q=new, k_cache=pages, v_cache=pages, k=new, v=new, block_table=table,
               cache_seqlens=np.array([7, 1], np.int32))
    assert msg.startswith("cache_seqlens: entry b=0 is 7; appending seqlen_new=2 tokens needs "
                          "cache_seqlens[b] + 2 <= the cache's capacity max_num_blocks_per_seq "
                          "* page_block_size = 2 * 4 = 8, got 9"), msg
    shared = np.array([[0, 1], [0, 3]], np.int32)  # both append into page 0, slot 1
    msg = _bad(q=new, k_cache=pages, v_cache=pages, k=new, v=new, block_table=shared,
               cache_seqlens=np.array([1, 1], np.int32))
    assert msg.startswith("block_table: two appended tokens write page 0, slot 1"), msg


def test_leftpad_hides_the_keys_before_it_and_keeps_absolute_rotary_positions():
    rng = np.random.default_rng(5)
    kc = rng.standard_normal((1, 10, 1, 16))
    k, v = rng.standard_normal((1, 1, 1, 16)), rng.standard_normal((1, 1, 1, 16))
    q = rng.standard_normal((1, 1, 1, 16))
    angle = rng.random((10, 8))
    args = dict(k=k, v=v, rotary_cos=np.cos(angle), rotary_sin=np.sin(angle),
                cache_seqlens=np.array([6], np.int32), causal=True)
    padded = kvcache_call(q, kc, kc, cache_leftpad=np.array([4], np.int32), **args)
    assert padded.call.visible_array()[0, 0, 0].tolist() == [False] * 4 + [True] * 3
    assert padded.append.k_positions().tolist() == [[6]]  # the cache row, not 6 - 4
    # the keys before the pad change nothing
    kc2 = kc.copy()
    kc2[0, :4] = 1e3
    a = flash_attn_with_kvcache(q, kc, kc, cache_leftpad=np.array([4], np.int32), **args)
    b = flash_attn_with_kvcache(q, kc2, kc2, cache_leftpad=np.array([4], np.int32), **args)
    assert np.array_equal(a, b)


def test_a_window_bound_past_the_cache_is_not_local_for_the_rotation():
    """mha_fwd_kvcache resets a bound >= seqlen_k to -1: not local, q at cache_seqlens only."""
    args = _small(causal=False)
    far = kvcache_call(**{**args, "window_size": (8, -1)})   # seqlen_k = 8: unbounded
    near = kvcache_call(**{**args, "window_size": (7, -1)})  # a real window
    assert far.append.q_positions().tolist() == [[3, 3], [5, 5]]
    assert near.append.q_positions().tolist() == [[3, 4], [5, 6]]
    plain = flash_attn_with_kvcache(**args)
    assert np.array_equal(flash_attn_with_kvcache(**{**args, "window_size": (8, -1)}), plain)


def test_without_an_append_the_updated_caches_are_copies():
    rng = np.random.default_rng(3)
    kc = rng.standard_normal((2, 6, 1, 8))
    out, k_after, v_after = flash_attn_with_kvcache(
        rng.standard_normal((2, 1, 2, 8)), kc, kc, cache_seqlens=np.array([3, 6], np.int32),
        return_updated_cache=True)
    assert np.array_equal(k_after, kc) and k_after is not kc and out.shape == (2, 1, 2, 8)
    assert np.array_equal(v_after, kc) and v_after is not kc


# -- a golden case with appends lowers to flash_attn_with_kvcache with its inputs as given ---
@pytest.mark.parametrize("case_id", sorted(kvcache_suite.CASES))
def test_a_kvcache_case_lowers_to_its_inputs_and_reproduces_its_golden(case_id):
    """``case.to_flash_attn_kvcache()`` hands the kernel q before rotation, the caches before
    the append, k, v and the tables: run through refattn's own flash_attn_with_kvcache, the
    output matches the golden and the updated caches equal the golden's bit for bit."""
    spec = case_spec(kvcache_suite.CASES[case_id](), backend="numpy")
    c = flash_call(spec, "flash_attn_kvcache")
    assert ineligible(spec, "flash_attn_kvcache") is None
    assert c.updated == ("kvcache_k_cache_updated", "kvcache_v_cache_updated")
    k_before = c.args[1].copy()
    out, lse, k_cache, v_cache = flash_attn_with_kvcache(*c.args, **c.kwargs,
                                                         return_updated_cache=True)
    got = c.finish((out, lse))
    np.testing.assert_allclose(got["output"], spec.tensors["output"], rtol=1e-12, atol=1e-13)
    assert np.array_equal(k_cache, spec.tensors[c.updated[0]])
    assert np.array_equal(v_cache, spec.tensors[c.updated[1]])
    assert np.array_equal(c.args[1], k_before)  # the arguments are not changed
    assert not np.array_equal(k_cache, k_before)  # the append wrote something
