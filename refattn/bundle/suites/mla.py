"""The MLA suite: golden cases at FlashMLA's decode shapes (multi-head latent attention).

Owns the case definitions of ``mla``: the paged latent cache FlashMLA's
``flash_mla_with_kvcache`` reads (h_q 16, 32, 64, 128; h_kv 1; d 576; dv 512; pages of 64;
varlen ``cache_seqlens`` with a zero-length cache among them; causal s_q = 1, 2, 4; the
shapes of deepseek-ai/FlashMLA ``tests/test_flash_mla_dense_decoding.py``, commit 9241ae3),
the dense latent form and DeepSeek-V3's absorbed form (:mod:`refattn.call.mla`). Caches are
short (at most 256 tokens) so that each case builds and computes in about a second on two
cores with the numba generator. Builds calls and GoldenCases only.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from refattn._boundary import public
from refattn.bundle.golden.case import GoldenCase
from refattn.call.mla import absorbed_call, mla_call, paged_mla_call
from refattn.errors import RefAttnError
from refattn.masks import causal as causal_mask

__all__ = ["CASES", "DEFAULT_GENERATOR", "build_case", "cases"]

#: the generator ``mla`` is written with unless told otherwise (kernel shapes: numba)
DEFAULT_GENERATOR = "numba"
#: FlashMLA's latent width, value width, rope width and page size
D, DV, DR, PAGE = 576, 512, 64, 64
#: block-table padding past a sequence's last block, as FlashMLA's test writes it
PAD = 2147480000


def _rng(case_id: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(case_id.encode()))


def _paged(case_id: str, h_q: int, s_q: int, lens: Sequence[int], causal: bool,
           comment: str, flags: tuple[str, ...]) -> GoldenCase:
    """FlashMLA's dense decode: one paged latent cache, blocks shuffled (as its test does)."""
    rng = _rng(case_id)
    B = len(lens)
    per_seq = max(1, -(-max(lens) // PAGE))
    pages = B * per_seq + 2  # two pages no sequence reads
    table = rng.permutation(pages)[:B * per_seq].reshape(B, per_seq).astype(np.int32)
    for b, n in enumerate(lens):  # FlashMLA's padding past a sequence's last block
        table[b, -(-n // PAGE):] = PAD
    kv_pages = rng.standard_normal((pages, PAGE, 1, D))  # (num_pages, 64, h_kv=1, 576)
    q = rng.standard_normal((B, h_q, s_q, D))  # (B, h_q, s_q, 576)
    made = paged_mla_call(q, kv_pages, table, np.array(lens, np.int32), DV, causal=causal)
    g_o = rng.standard_normal((B, h_q, s_q, DV))
    conv = {"causal_alignment": "explicit_positions", **made.layout.conventions(),
            "flash_mla_causal": bool(causal)}
    return GoldenCase(case_id, made.call, g_o, comment, flags, conv, made.layout)


def _dense(case_id: str) -> GoldenCase:
    rng = _rng(case_id)
    q = rng.standard_normal((1, 128, 1, D))
    kv = rng.standard_normal((1, 1, 96, D))  # (B, h_kv, K, 576)
    made = mla_call(q, kv, DV)
    g_o = rng.standard_normal((1, 128, 1, DV))
    return GoldenCase(case_id, made.call, g_o,
                      "dense latent (B, 1, 96, 576), V = its first 512 columns, h_q 128",
                      ("MLA", "SharedKV"), made.layout.conventions(), made.layout)


def _absorbed(case_id: str) -> GoldenCase:
    rng = _rng(case_id)
    B, Hq, Q, K = 2, 16, 2, 100
    q_nope, q_pe = rng.standard_normal((B, Hq, Q, DV)), rng.standard_normal((B, Hq, Q, DR))
    kv_c, k_pe = rng.standard_normal((B, 1, K, DV)), rng.standard_normal((B, 1, K, DR))
    scale = 192 ** -0.5  # DeepSeek-V3: qk_head_dim = 128 + 64
    made = absorbed_call(q_nope, q_pe, kv_c, k_pe, scale=scale,
                         visible=causal_mask(Q, K, alignment="lower_right"))
    g_o = rng.standard_normal((B, Hq, Q, DV))
    conv = {"causal_alignment": "lower_right", **made.layout.conventions()}
    return GoldenCase(case_id, made.call, g_o,
                      "absorbed form: q = [q_nope 512, q_pe 64], k = [kv_c, k_pe], v = kv_c, "
                      "scale 192**-0.5, bottom-right causal", ("MLA", "Absorbed", "SharedKV"),
                      conv, made.layout)


#: case id -> builder, in suite order
CASES: dict[str, Callable[[], GoldenCase]] = {
    "mla_h16_sq2_causal_page64_tiny": lambda: _paged(
        "mla_h16_sq2_causal_page64_tiny", 16, 2, (70, 0), True,
        "h_q 16, s_q 2 causal, cache_seqlens (70, 0): a zero-length cache",
        ("MLA", "Paged", "ZeroLengthCache", "LowerRightCausal")),
    "mla_h16_sq1_varlen_zero": lambda: _paged(
        "mla_h16_sq1_varlen_zero", 16, 1, (200, 0, 65, 1), False,
        "h_q 16, s_q 1, varlen cache_seqlens (200, 0, 65, 1): page edges and an empty cache",
        ("MLA", "Paged", "Varlen", "ZeroLengthCache")),
    "mla_h32_sq2_causal_short": lambda: _paged(
        "mla_h32_sq2_causal_short", 32, 2, (150, 1, 0), True,
        "h_q 32, s_q 2 causal, cache_seqlens (150, 1, 0): a query before its cache's first "
        "token reads no key", ("MLA", "Paged", "Varlen", "LowerRightCausal", "EmptyRow")),
    "mla_h64_sq4_causal": lambda: _paged(
        "mla_h64_sq4_causal", 64, 4, (256, 3), True,
        "h_q 64, s_q 4 causal (multi-token decode), cache_seqlens (256, 3)",
        ("MLA", "Paged", "LowerRightCausal", "EmptyRow")),
    "mla_h128_sq2_noncausal": lambda: _paged(
        "mla_h128_sq2_noncausal", 128, 2, (128, 77), False,
        "h_q 128, s_q 2 not causal, cache_seqlens (128, 77)", ("MLA", "Paged", "Varlen")),
    "mla_h128_sq1_dense": lambda: _dense("mla_h128_sq1_dense"),
    "mla_absorbed_h16_sq2": lambda: _absorbed("mla_absorbed_h16_sq2"),
}


@public
def build_case(case_id: str) -> GoldenCase:
    """One case of the suite by id.

    Examples
    --------
    >>> c = build_case("mla_h16_sq2_causal_page64_tiny")
    >>> c.call.axes["Dk"], c.call.axes["Dv"], c.layout.seqlens.tolist()
    (576, 512, [70, 0])
    """
    if case_id not in CASES:
        raise RefAttnError(f"case_id: unknown MLA case {case_id!r}; known: {sorted(CASES)}")
    return CASES[case_id]()


@public
def cases() -> Sequence[GoldenCase]:
    """Every MLA case, in definition order.

    Examples
    --------
    >>> [c.case_id for c in cases()][:2]
    ['mla_h16_sq2_causal_page64_tiny', 'mla_h16_sq1_varlen_zero']
    """
    out: list[Any] = [build() for build in CASES.values()]
    return out
