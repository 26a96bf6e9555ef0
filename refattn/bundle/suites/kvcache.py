"""The kvcache suite: golden cases of FlashAttention's ``flash_attn_with_kvcache`` with appends
and rotary embeddings, stored with their inputs as given.

Owns :data:`CASES` and :func:`cases`. Each case is one decode step
(:class:`refattn.call.kvcache.KVCacheAppend`, ``kv_layout: kvcache_append``) covering the
axes of FlashAttention's ``tests/test_flash_attn.py::test_flash_attn_kvcache`` matrix
(Dao-AILab/flash-attention, commit 0251105a2fb1): rotary interleaved (GPT-J) and not
(GPT-NeoX), ``rotary_dim < D``, appends of more than one token (``seqlen_new > 1``),
``cache_leftpad``, ``cache_batch_idx``, paged caches (page sizes 256, FlashAttention 2's, and
4, FlashAttention 3's and Triton's) and not, causal, local and neither (q then rotated at
``cache_seqlens`` only), MHA, GQA and MQA, at kernel head dims (64, 128) and small lengths
so that each case builds in well under a second. The canonical call is the one the kernel
computes (rotated q, the caches after the append); the layout stores q before rotation, the
caches' old contents, k, v, the tables, the indices and the updated caches, with the
gradients of those inputs (``grad_kvcache_*``). Every query row sees at least one key.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from refattn._boundary import public
from refattn.bundle.golden.case import GoldenCase
from refattn.call.kvcache import KVCacheAppend
from refattn.errors import RefAttnError
from refattn.rope import rope_tables

__all__ = ["CASES", "DEFAULT_GENERATOR", "cases"]

#: the generator the suite is written with by default (its cases are small)
DEFAULT_GENERATOR = "exact"
#: case id -> builder
CASES: dict[str, Callable[[], GoldenCase]] = {}


def _tables(rng: np.random.Generator, rows: int, rotary_dim: int, kind: str
            ) -> tuple[np.ndarray, np.ndarray]:
    if kind == "random":  # FlashAttention's test: angles uniform in [0, 2 pi)
        angle = rng.random((rows, rotary_dim // 2)) * 2 * np.pi
        return np.cos(angle), np.sin(angle)
    if kind == "yarn":
        t = rope_tables(rows, rotary_dim, scaling="yarn", factor=4.0,
                        original_max_position_embeddings=16)
    else:
        t = rope_tables(rows, rotary_dim)
    return t.cos, t.sin


def _register(case_id: str, comment: str, *flags: str, B: int = 2, Q: int = 1, new: int = 1,
              Hq: int = 4, Hkv: int = 2, D: int = 64, S: int = 16, lens: Sequence[int] = (5, 9),
              rotary_dim: int | None = None, interleaved: bool = False, tables: str = "random",
              causal: bool = True, window: tuple[int | None, int | None] | None = None,
              leftpad: Sequence[int] | None = None, batch_idx: Sequence[int] | None = None,
              page: int | None = None) -> None:
    def make() -> GoldenCase:
        rng = np.random.default_rng(zlib.crc32(case_id.encode()))
        q = rng.standard_normal((B, Q, Hq, D))  # (B, Q, Hq, D) before rotation
        k = rng.standard_normal((B, new, Hkv, D))  # (B, seqlen_new, Hkv, D)
        v = rng.standard_normal((B, new, Hkv, D))
        table = None
        if page is None:
            rows = B if batch_idx is None else max(batch_idx) + 1
            k_cache = rng.standard_normal((rows, S, Hkv, D))  # (batch_size_cache, S, Hkv, D)
            v_cache = rng.standard_normal((rows, S, Hkv, D))
            ro_rows = S
        else:  # FlashAttention's _generate_block_kvcache: a permutation of 3x the blocks
            per = -(-S // page)
            num_blocks = per * B * 3
            k_cache = rng.standard_normal((num_blocks, page, Hkv, D))
            v_cache = rng.standard_normal((num_blocks, page, Hkv, D))
            table = rng.permutation(num_blocks).reshape(B, -1)[:, :per].astype(np.int32)
            ro_rows = per * page
        cos = sin = None
        if rotary_dim is not None:
            cos, sin = _tables(rng, ro_rows, rotary_dim, tables)
        local = window is not None
        layout = KVCacheAppend(
            q, k_cache, v_cache, np.asarray(lens, np.int32), k, v, cos, sin, interleaved,
            None if leftpad is None else np.asarray(leftpad, np.int32),
            None if batch_idx is None else np.asarray(batch_idx, np.int32), table,
            causal or local)
        call = layout.call(causal=causal, window=window)
        g_o = rng.standard_normal((B, Hq, Q, D))  # (B, Hq, Q, Dv)
        conv: dict[str, Any] = {**layout.conventions(), "kvcache_causal": causal,
                                "kvcache_window": "none" if window is None else
                                [-1 if w is None else w for w in window]}
        if page is not None:
            conv["page_block_size"] = page
        return GoldenCase(case_id, call, g_o, comment, tuple(flags), conv, layout)

    if case_id in CASES:
        raise RefAttnError(f"case_id: duplicate kvcache case {case_id!r}")
    CASES[case_id] = make


_register("kvcache_neox_d64_causal_gqa_append2",
          "GPT-NeoX rotary over the whole head, two appended tokens, causal, GQA 4/2",
          "RotaryHalfSplit", "Append", "Causal", "GQA", Q=2, new=2, rotary_dim=64)
_register("kvcache_gptj_d128_partial_not_causal_mqa",
          "GPT-J rotary on 64 of 128 columns; not causal: every q token at cache_seqlens",
          "RotaryInterleaved", "PartialRotary", "MQA", Q=3, new=1, Hq=4, Hkv=1, D=128,
          rotary_dim=64, interleaved=True, causal=False, lens=(4, 10))
_register("kvcache_leftpad_neox_d64_append3",
          "cache_leftpad: keys before it invisible, rotary at absolute cache rows",
          "Leftpad", "RotaryHalfSplit", "Append", "Causal", Q=3, new=3, rotary_dim=32,
          leftpad=(2, 0), lens=(6, 3))
_register("kvcache_batch_idx_gptj_d64",
          "cache_batch_idx: sequences read and append to rows 3 and 1 of 4",
          "BatchIdx", "RotaryInterleaved", "Causal", Q=1, new=1, rotary_dim=64,
          interleaved=True, batch_idx=(3, 1), lens=(7, 2))
_register("kvcache_paged256_neox_d64_causal",
          "paged cache of 256-slot pages (FlashAttention 2's size), block table permuted",
          "Paged", "RotaryHalfSplit", "Causal", Q=2, new=2, rotary_dim=64, page=256,
          S=256, lens=(5, 11), Hq=2, Hkv=1)
_register("kvcache_paged4_gptj_d128_local",
          "4-slot pages (FlashAttention 3's, Triton's), local window (3, 1) not causal: q "
          "rotated token by token", "Paged", "RotaryInterleaved", "Local", "PartialRotary",
          Q=2, new=2, D=128, rotary_dim=32, interleaved=True, page=4, causal=False,
          window=(3, 1), lens=(6, 9))
_register("kvcache_append_no_rotary_d128_mha",
          "appends without rotary tables (rotary_fraction 0), MHA", "Append", "MHA",
          Q=2, new=2, Hq=2, Hkv=2, D=128, lens=(0, 7))
_register("kvcache_yarn_tables_neox_d64",
          "YaRN tables (factor 4 over 16 positions: the attention factor on cos and sin)",
          "RotaryHalfSplit", "YaRN", "Causal", Q=1, new=1, rotary_dim=64, tables="yarn")


@public
def cases() -> list[GoldenCase]:
    """The suite's cases, in order.

    Examples
    --------
    >>> [c.case_id for c in cases()][:2]
    ['kvcache_neox_d64_causal_gqa_append2', 'kvcache_gptj_d128_partial_not_causal_mqa']
    """
    return [make() for make in CASES.values()]
