"""The conformance suite: named golden cases for every convention users trip over.

Owns the case definitions of ``refattn golden --suite conformance`` (checked in under
``data/golden/``). Each case is one :class:`~refattn.bundle.GoldenCase` with Wycheproof-style
flags (``LowerRightCausal``, ``AllDroppedRow``, ``LargeLogits``, ...) and a one-line comment
saying what it pins down. Every case draws its tensors from its own generator seeded by the
crc32 of its id, so adding, removing or reordering cases never changes another case's bytes.
Defers the arithmetic to the engine, relations to :mod:`refattn.masks`, the dropout
stream to :mod:`refattn.dropout`, ALiBi to :mod:`refattn.call.bias` and score families to
:mod:`refattn.call.scores`.

Coverage: self- and cross-attention (Q != K); causal upper-left, lower-right and explicit
cache positions (one-token decode at position 127, chunked decode, a ring-buffer cache); key
padding; query_valid with the sanitise policy; packed segments; prefix-LM; sliding windows
(both window conventions, per head); GQA (Hq=8, Hkv=2), MQA and an explicit head map; full and
broadcast bias, ALiBi; Philox dropout, explicit inverted and real multipliers, an all-dropped
row, returned weights; logits around +-1000, tied maxima, singleton support, a single key,
Dk != Dv, non-contiguous inputs, explicit and pre-applied scales; every score family
(dot, bilinear, additive, cosine), every scale placement and every modifier (softcap, sink);
a sink over rows with no legal key, unions and intersections of relations (StreamingLLM's
window OR first tokens, document-causal masks), packed batches with empty sequences, a paged
KV cache stored as given, and ALiBi slopes per batch row and head.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from refattn.bundle.golden.case import GoldenCase
from refattn.bundle.golden.quantized import quant_case
from refattn.bundle.suites.contract import LOOP6_GRAD_OUTPUT, loop6_call, loop7_call
from refattn.call import AttentionCall
from refattn.call.bias import alibi, alibi_slopes
from refattn.call.paged import paged_call
from refattn.call.scores import Additive, Bilinear, Cosine
from refattn.dropout import Philox
from refattn.errors import RefAttnError
from refattn.masks import causal, from_positions, relation, segments_from_cu_seqlens
from refattn.quant.formats import quantize
from refattn.quant.presets import preset

__all__ = ["CASES", "cases"]

#: case id -> builder; filled by the @_case decorator below, in definition order
CASES: dict[str, Callable[[], GoldenCase]] = {}


def _rng(case_id: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(case_id.encode()))


def _case(case_id: str, comment: str, *flags: str, conventions: dict[str, Any] | None = None
          ) -> Callable[[Callable[[np.random.Generator], dict[str, Any]]],
                        Callable[[np.random.Generator], dict[str, Any]]]:
    """Register a builder ``f(rng) -> dict(q, k, v, [grad_output], **call keywords)``, or
    ``dict(paged=PagedCall, [grad_output])`` for a case stored with its paged inputs, or
    ``dict(q, k, v, quant=QuantSpec, **call keywords)`` for a quantised case (q, k, v as the
    kernel receives them; the case's call holds the dequantised inputs)."""

    def register(build: Callable[[np.random.Generator], dict[str, Any]]) -> Any:
        def make() -> GoldenCase:
            rng = _rng(case_id)
            kw = build(rng)
            g_o = kw.pop("grad_output", None)
            quant = None
            paged = kw.pop("paged", None)  # a PagedCall: the call and its paged inputs
            if paged is not None:
                call, layout = paged.call, paged.paged
                conv = {**(conventions or {}), **layout.conventions()}
            else:
                q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
                spec = kw.pop("quant", None)  # a QuantSpec: q, k, v as the kernel reads them
                layout, conv = None, conventions or {}
                if spec is None:
                    call = AttentionCall(q, k, v, **kw)
                else:
                    call, quant = quant_case(q, k, v, spec, **kw)
            if g_o is None:
                g_o = rng.standard_normal((*call.q.shape[:3], call.v.shape[3]))  # (B,Hq,Q,Dv)
            return GoldenCase(case_id, call, g_o, comment, tuple(flags), conv, layout, quant)

        if case_id in CASES:
            raise RefAttnError(f"case_id: duplicate conformance case {case_id!r}")
        CASES[case_id] = make
        return build

    return register


def _qkv(rng: np.random.Generator, B: int, Hq: int, Hkv: int, Q: int, K: int, Dk: int,
         Dv: int | None = None) -> dict[str, np.ndarray]:
    Dv = Dk if Dv is None else Dv
    return {"q": rng.standard_normal((B, Hq, Q, Dk)),  # (B, Hq, Q, Dk)
            "k": rng.standard_normal((B, Hkv, K, Dk)),  # (B, Hkv, K, Dk)
            "v": rng.standard_normal((B, Hkv, K, Dv))}  # (B, Hkv, K, Dv)


UL = {"causal_alignment": "upper_left"}
LR = {"causal_alignment": "lower_right"}
POS = {"causal_alignment": "explicit_positions"}


# -- self / cross attention ------------------------------------------------------------------
@_case("self_attention_basic", "Self-attention, every edge legal, default scale Dk**-0.5",
       "SelfAttention", "AllLegal", "DefaultScale")
def _(rng):
    return _qkv(rng, 2, 2, 2, 5, 5, 4)


@_case("cross_attention_q3_k7", "Cross-attention with Q=3 target rows reading K=7 sources",
       "CrossAttention", "AllLegal")
def _(rng):
    return _qkv(rng, 2, 2, 2, 3, 7, 4)


# -- causal alignment and cache positions ----------------------------------------------------
@_case("causal_square", "Square causal prefill: upper-left and lower-right coincide",
       "CausalSquare", "UpperLeftCausal", "LowerRightCausal", conventions=UL)
def _(rng):
    return {**_qkv(rng, 2, 2, 2, 6, 6, 4), "visible": causal(6, 6, alignment="upper_left")}


@_case("causal_upper_left_q3_k7", "Rectangular causal, upper-left: query row i reads keys <= i "
       "(what torch is_causal=True means)", "UpperLeftCausal", "CrossAttention", conventions=UL)
def _(rng):
    return {**_qkv(rng, 1, 2, 2, 3, 7, 4), "visible": causal(3, 7, alignment="upper_left")}


@_case("causal_lower_right_q3_k7", "Rectangular causal, lower-right: the 3 queries are the last "
       "rows of a 7-key history (is_causal=True would be wrong)", "LowerRightCausal",
       "CrossAttention", conventions=LR)
def _(rng):
    return {**_qkv(rng, 1, 2, 2, 3, 7, 4), "visible": causal(3, 7, alignment="lower_right")}


@_case("causal_lower_right_q6_k4_sanitized", "Lower-right with Q > K: the first 2 rows have no "
       "key, are unused (query_valid False) and sanitised to exact zeros", "LowerRightCausal",
       "SanitizedRow", "QueryValid", "AllMaskedRow", conventions=LR)
def _(rng):
    qv = np.ones((1, 1, 6, 1), bool)
    qv[0, 0, :2] = False
    return {**_qkv(rng, 1, 2, 2, 6, 4, 4), "visible": causal(6, 4, alignment="lower_right"),
            "query_valid": qv, "all_masked_rows": "sanitize_then_zero_invalid_query"}


@_case("decode_one_token_pos127", "One-token decode at absolute position 127 over a 128-slot "
       "cache: the query reads every key 0..127", "Decode", "ExplicitPositions",
       "LowerRightCausal", conventions=POS)
def _(rng):
    return {**_qkv(rng, 1, 2, 2, 1, 128, 8),
            "visible": from_positions([127], np.arange(128))}


@_case("decode_batched_positions", "Batched decode: stream 0 at position 127, stream 1 at 60 over "
       "the same 128 slots (slots past 60 are future tokens for stream 1)", "Decode",
       "ExplicitPositions", conventions=POS)
def _(rng):
    rel = from_positions([[127], [60]], np.tile(np.arange(128), (2, 1)))
    return {**_qkv(rng, 2, 2, 2, 1, 128, 4), "visible": rel}


@_case("chunked_decode_4_at_124", "Chunked decode: 4 queries at positions 124..127 over 128 "
       "cached keys (lower-right by coordinates)", "ChunkedDecode", "ExplicitPositions",
       conventions=POS)
def _(rng):
    rel = from_positions(np.arange(124, 128), np.arange(128))
    return {**_qkv(rng, 1, 2, 2, 4, 128, 4), "visible": rel}


@_case("chunked_decode_ring_cache", "Chunk of 3 at positions 13..15 over a ring-buffer cache whose "
       "slots hold positions out of order; two slots never written", "ChunkedDecode",
       "ExplicitPositions", "PermutedCache", "KeyPadding", conventions=POS)
def _(rng):
    k_pos = np.roll(np.arange(16), 5)  # slot s holds position (s - 5) mod 16
    valid = np.ones(16, bool)
    valid[[2, 9]] = False  # allocated but never written
    rel = from_positions(np.arange(13, 16), k_pos, key_valid=valid)
    return {**_qkv(rng, 1, 2, 2, 3, 16, 4), "visible": rel}


# -- padding and query validity --------------------------------------------------------------
@_case("key_padding_lengths_7_5_2", "Key padding: batch rows hold 7, 5 and 2 valid keys "
       "(dense (B,1,1,K) relation)", "KeyPadding", "CrossAttention")
def _(rng):
    lengths = np.array([7, 5, 2])
    valid = np.arange(7)[None, :] < lengths[:, None]  # (B, K)
    return {**_qkv(rng, 3, 2, 2, 4, 7, 4), "visible": valid[:, None, None, :]}


@_case("key_padding_causal", "Causal self-attention with right padding: padded keys are "
       "excluded, padded queries still read earlier valid keys", "KeyPadding", "CausalSquare",
       conventions=UL)
def _(rng):
    valid = np.arange(6)[None, :] < np.array([6, 4])[:, None]  # (B, K)
    rel = relation(np.tile(np.arange(6), (2, 1)), np.tile(np.arange(6), (2, 1)), valid,
                          causal=True, alignment="upper_left")
    return {**_qkv(rng, 2, 2, 2, 6, 6, 4), "visible": rel}


@_case("query_valid_sanitize", "Both sides padded: padded query rows have no legal key, are "
       "unused, and contribute exact zeros (Policy 3)", "QueryValid", "SanitizedRow",
       "AllMaskedRow", "KeyPadding")
def _(rng):
    valid = np.arange(5)[None, :] < np.array([5, 3])[:, None]  # (B, L)
    vis = valid[:, None, :, None] & valid[:, None, None, :]  # (B, 1, Q, K)
    return {**_qkv(rng, 2, 2, 2, 5, 5, 4), "visible": vis, "query_valid": valid[:, None, :, None],
            "all_masked_rows": "sanitize_then_zero_invalid_query"}


@_case("query_valid_rows_with_keys", "Unused query rows that still have legal keys: output rows "
       "are zero, their probabilities are still defined", "QueryValid")
def _(rng):
    qv = np.ones((2, 1, 4, 1), bool)
    qv[0, 0, 1] = qv[1, 0, 3] = False
    return {**_qkv(rng, 2, 2, 2, 4, 5, 4), "query_valid": qv}


# -- packing, prefix, windows ----------------------------------------------------------------
_SEG = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2]])
_LOCAL = np.array([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2]])


@_case("packed_segments", "Three documents packed in one row: block-diagonal bidirectional",
       "PackedSegments")
def _(rng):
    rel = relation(_LOCAL, _LOCAL, q_segment=_SEG, k_segment=_SEG)
    return {**_qkv(rng, 1, 2, 2, 10, 10, 4), "visible": rel}


@_case("packed_segments_causal", "Packed documents with causal visibility inside each document",
       "PackedSegments", "CausalSquare", conventions=POS)
def _(rng):
    rel = relation(_LOCAL, _LOCAL, q_segment=_SEG, k_segment=_SEG, causal=True)
    return {**_qkv(rng, 1, 2, 2, 10, 10, 4), "visible": rel}


@_case("prefix_lm_4_of_8", "Prefix-LM: the first 4 positions see each other, the rest is causal",
       "PrefixLM", conventions=POS)
def _(rng):
    pos = np.arange(8)[None, :]
    return {**_qkv(rng, 1, 2, 2, 8, 8, 4), "visible": relation(pos, pos, prefix_length=4)}


@_case("prefix_lm_per_batch", "Prefix-LM with prefix lengths 2 and 5 in two batch rows",
       "PrefixLM", conventions=POS)
def _(rng):
    pos = np.tile(np.arange(7), (2, 1))
    rel = relation(pos, pos, prefix_length=np.array([2, 5]))
    return {**_qkv(rng, 2, 2, 2, 7, 7, 4), "visible": rel}


@_case("sliding_window_causal_incl3", "Causal sliding window of 3 tokens counting the query "
       "itself (xFormers convention; 2 keys before the query)", "SlidingWindow",
       "WindowIncludesQuery", conventions={**POS, "window_convention": "includes_query"})
def _(rng):
    pos = np.arange(8)[None, :]
    rel = relation(pos, pos, causal=True, window=(3, 1),
                          window_convention="includes_query")
    return {**_qkv(rng, 1, 2, 2, 8, 8, 4), "visible": rel}


@_case("sliding_window_bidirectional", "Bidirectional local window: 2 keys on each side of the "
       "query (excludes-query convention)", "SlidingWindow", "WindowExcludesQuery",
       conventions={**POS, "window_convention": "excludes_query"})
def _(rng):
    pos = np.arange(9)[None, :]
    return {**_qkv(rng, 1, 2, 2, 9, 9, 4), "visible": relation(pos, pos, window=(2, 2))}


@_case("sliding_window_per_head", "Per-head causal windows: head 0 sees 1 earlier key, head 1 "
       "sees 3", "SlidingWindow", "PerHeadMask",
       conventions={**POS, "window_convention": "excludes_query"})
def _(rng):
    pos = np.arange(7)[None, :]
    rel = relation(pos, pos, causal=True, window=(np.array([1, 3]), 0))
    return {**_qkv(rng, 1, 2, 2, 7, 7, 4), "visible": rel}


# -- head mapping ----------------------------------------------------------------------------
@_case("gqa_hq8_hkv2_causal", "GQA Hq=8, Hkv=2 (query head h reads kv head h // 4), causal",
       "GQA", "CausalSquare", conventions=UL)
def _(rng):
    return {**_qkv(rng, 2, 8, 2, 5, 5, 4), "visible": causal(5, 5, alignment="upper_left")}


@_case("mqa_hq4_hkv1", "MQA: four query heads share one kv head", "MQA", "GQA")
def _(rng):
    return _qkv(rng, 2, 4, 1, 3, 6, 4)


@_case("gqa_explicit_head_map", "Interleaved explicit head_map [1, 0, 1, 0] (not h // G)",
       "GQA", "ExplicitHeadMap")
def _(rng):
    return {**_qkv(rng, 1, 4, 2, 3, 5, 4), "head_map": np.array([1, 0, 1, 0])}


@_case("gqa_lower_right_decode", "GQA Hq=8, Hkv=2 with a 2-token lower-right decode chunk over 9 "
       "keys", "GQA", "LowerRightCausal", "ChunkedDecode", conventions=LR)
def _(rng):
    return {**_qkv(rng, 1, 8, 2, 2, 9, 4), "visible": causal(2, 9, alignment="lower_right")}


# -- bias ------------------------------------------------------------------------------------
@_case("bias_full", "Full (B, Hq, Q, K) finite bias", "BiasFull")
def _(rng):
    return {**_qkv(rng, 2, 2, 2, 3, 5, 4), "bias": rng.standard_normal((2, 2, 3, 5))}


@_case("bias_broadcast_head_key", "Bias (1, Hq, 1, K) broadcast over batch and queries; its "
       "gradient is summed back to that shape", "BiasBroadcast")
def _(rng):
    return {**_qkv(rng, 2, 2, 2, 3, 5, 4), "bias": rng.standard_normal((1, 2, 1, 5))}


@_case("bias_broadcast_query_key", "2-D (Q, K) relative-position bias shared by every batch row "
       "and head", "BiasBroadcast")
def _(rng):
    return {**_qkv(rng, 2, 2, 2, 4, 4, 4), "bias": rng.standard_normal((4, 4))}


@_case("bias_cannot_revive", "A padded key column carries bias +30 and stays excluded: "
       "visibility is applied after the finite bias", "BiasCannotRevive", "KeyPadding")
def _(rng):
    bias = rng.standard_normal((1, 1, 4, 5))
    bias[..., 4] = 30.0
    vis = np.array([True, True, True, True, False])  # (K,)
    return {**_qkv(rng, 1, 2, 2, 4, 5, 4), "bias": bias, "visible": vis}


@_case("alibi_causal", "ALiBi slopes of 4 heads as a finite bias under causal visibility",
       "ALiBi", "BiasBroadcast", "CausalSquare", conventions=UL)
def _(rng):
    bias = alibi(alibi_slopes(4), np.arange(6), np.arange(6))  # (1, H, Q, K)
    return {**_qkv(rng, 1, 4, 4, 6, 6, 4), "bias": bias,
            "visible": causal(6, 6, alignment="upper_left")}


# -- dropout ---------------------------------------------------------------------------------
@_case("dropout_explicit_inverted", "Explicit inverted-dropout multiplier (p=0.1): Z is 0 or "
       "1/(1-p), realised once and replayed", "ExplicitMultiplier", "DroppedLegalEdge")
def _(rng):
    keep = rng.random((2, 2, 4, 6)) >= 0.1
    return {**_qkv(rng, 2, 2, 2, 4, 6, 4), "dropout": keep / (1.0 - 0.1)}


@_case("dropout_real_multiplier", "Gaussian multiplicative noise: Z is any finite real "
       "(negative entries included)", "RealMultiplier")
def _(rng):
    return {**_qkv(rng, 1, 2, 2, 4, 5, 4), "dropout": 1.0 + 0.5 * rng.standard_normal((1, 2, 4, 5))}


@_case("dropout_philox", "Portable Philox4x32-10 stream, p=0.2: every backend regenerates Z "
       "from (p, seed, offset)", "PhiloxDropout")
def _(rng):
    return {**_qkv(rng, 2, 2, 2, 5, 7, 4), "dropout": Philox(0.2, seed=20261130, offset=3)}


@_case("dropout_philox_gqa_causal", "Philox dropout p=0.3 with GQA and causal visibility",
       "PhiloxDropout", "GQA", "CausalSquare", conventions=UL)
def _(rng):
    return {**_qkv(rng, 1, 4, 2, 6, 6, 4), "visible": causal(6, 6, alignment="upper_left"),
            "dropout": Philox(0.3, seed=2**40 + 7)}


@_case("all_dropped_row", "Query row 2 loses every legal route to dropout: zero output and zero "
       "value gradient, but defined probabilities", "AllDroppedRow", "ExplicitMultiplier",
       "CausalSquare", conventions=UL)
def _(rng):
    z = np.where(rng.random((1, 1, 5, 5)) >= 0.25, 1.0 / 0.75, 0.0)
    z[..., 2, :] = 0.0
    return {**_qkv(rng, 1, 1, 1, 5, 5, 4), "visible": causal(5, 5, alignment="upper_left"),
            "dropout": z}


@_case("returned_weights_post_dropout", "Weights requested post-dropout (P * Z) with a Philox "
       "stream; the manifest says which object is returned", "ReturnedWeights", "PhiloxDropout")
def _(rng):
    return {**_qkv(rng, 1, 2, 2, 3, 4, 4), "dropout": Philox(0.25, seed=7),
            "returned_weights": "post_dropout"}


@_case("returned_weights_pre_dropout", "Weights requested pre-dropout (P, not the P * Z the "
       "output consumed) with a Philox stream; the manifest says which object is returned",
       "ReturnedWeights", "PhiloxDropout")
def _(rng):
    return {**_qkv(rng, 1, 2, 2, 3, 4, 4), "dropout": Philox(0.25, seed=7),
            "returned_weights": "pre_dropout"}


# -- numerics ----------------------------------------------------------------------------------
@_case("large_logits_positive", "Scores around +1000 (spread of a few units): the row maximum "
       "must be subtracted before exp", "LargeLogits")
def _(rng):
    x = _qkv(rng, 1, 2, 2, 3, 6, 4)
    x["q"][..., 0] = 40.0 + 0.05 * rng.standard_normal((1, 2, 3))
    x["k"][..., 0] = 50.0 + 0.05 * rng.standard_normal((1, 2, 6))
    return x  # alpha = 0.5: scores = 0.5 * (2000 + O(3))


@_case("large_logits_negative", "Scores around -1000: exp would underflow without the row "
       "maximum", "LargeLogits")
def _(rng):
    x = _qkv(rng, 1, 2, 2, 3, 6, 4)
    x["q"][..., 0] = 40.0 + 0.05 * rng.standard_normal((1, 2, 3))
    x["k"][..., 0] = -50.0 + 0.05 * rng.standard_normal((1, 2, 6))
    return x


@_case("tied_maxima", "Exact ties in the row maximum (duplicate keys, dyadic inputs so every "
       "summation order ties)", "TiedMaxima")
def _(rng):
    q = rng.integers(-4, 5, (1, 2, 3, 4)) / 4.0
    k = rng.integers(-4, 5, (1, 2, 5, 4)) / 4.0
    k[:, :, 3] = k[:, :, 1]  # keys 1 and 3 score identically for every query
    k[:, :, 4] = k[:, :, 1]
    return {"q": q, "k": k, "v": rng.standard_normal((1, 2, 5, 4)), "scale": 0.5}


@_case("singleton_support", "Every query sees exactly one key: P is one-hot and the score "
       "gradient is exactly zero", "SingletonSupport")
def _(rng):
    return {**_qkv(rng, 1, 2, 2, 4, 4, 4), "visible": np.eye(4, dtype=bool)}


@_case("single_key", "K = 1: the only key gets probability 1", "SingletonSupport", "CrossAttention")
def _(rng):
    return _qkv(rng, 2, 2, 2, 3, 1, 4)


@_case("tiny_logit_spread", "Scores that differ by about 1e-9: nearly uniform probabilities",
       "TinyLogits")
def _(rng):
    x = _qkv(rng, 1, 2, 2, 3, 5, 4)
    x["q"] *= 1e-5
    x["k"] *= 1e-4
    return x


@_case("zero_queries_uniform", "All-zero queries: exactly uniform probabilities over legal keys",
       "UniformRows", "KeyPadding")
def _(rng):
    x = _qkv(rng, 1, 2, 2, 3, 5, 4)
    x["q"] = np.zeros_like(x["q"])
    return {**x, "visible": np.array([True, True, False, True, True])}


@_case("masked_maximum", "The largest score sits on a masked edge: the row maximum is over the "
       "legal support only", "MaskedMaximum")
def _(rng):
    x = _qkv(rng, 1, 1, 1, 2, 4, 4)
    x["k"][0, 0, 3] = 10.0 * x["q"][0, 0, 0]  # key 3 dominates query 0 ...
    return {**x, "visible": np.array([[True, True, True, False], [True, True, True, True]])}


@_case("per_head_mask", "Visibility that differs per batch row and head (B, Hq, Q, K)",
       "PerHeadMask")
def _(rng):
    vis = rng.random((2, 2, 4, 5)) < 0.6
    vis[..., 0] = True  # every row keeps one legal key
    return {**_qkv(rng, 2, 2, 2, 4, 5, 4), "visible": vis}


@_case("longer_sequence_causal_64", "A longer causal self-attention (Q=K=64, Dk=16): realistic "
       "accumulation lengths", "CausalSquare", "LongerSequence", conventions=UL)
def _(rng):
    return {**_qkv(rng, 1, 2, 2, 64, 64, 16),
            "visible": causal(64, 64, alignment="upper_left")}


# -- shapes and layouts ------------------------------------------------------------------------
@_case("dk16_dv3", "Dk = 16 and Dv = 3: value width differs from key width", "DkNotDv")
def _(rng):
    return _qkv(rng, 1, 2, 2, 3, 5, 16, 3)


@_case("noncontiguous_btnh_views", "q, k, v are head-major views of BTNH storage (strides "
       "recorded in the manifest)", "NonContiguous")
def _(rng):
    def btnh(B: int, T: int, H: int, D: int) -> np.ndarray:
        return rng.standard_normal((B, T, H, D)).transpose(0, 2, 1, 3)  # (B, H, T, D) view

    return {"q": btnh(2, 3, 2, 4), "k": btnh(2, 5, 2, 4), "v": btnh(2, 5, 2, 4)}


# -- scale -----------------------------------------------------------------------------------
@_case("explicit_scale_0p2", "Explicit multiplier alpha = 0.2 (not Dk**-0.5), applied once",
       "ExplicitScale")
def _(rng):
    return {**_qkv(rng, 1, 2, 2, 3, 5, 4), "scale": 0.2}


@_case("prescaled_query_scale_one", "q already carries Dk**-0.5; the call passes scale=1.0 so "
       "the multiplier is not applied twice", "ExplicitScale", "PrescaledQuery")
def _(rng):
    x = _qkv(rng, 1, 2, 2, 3, 5, 16)
    x["q"] = x["q"] * 0.25
    return {**x, "scale": 1.0}


@_case("scale_placement_q", "alpha moved onto q before the product (pre_query placement)",
       "ScalePlacement")
def _(rng):
    return {**_qkv(rng, 1, 2, 2, 3, 5, 4), "scale_placement": "q"}


@_case("scale_placement_k", "alpha moved onto k before the product (pre_key placement)",
       "ScalePlacement")
def _(rng):
    return {**_qkv(rng, 1, 2, 2, 3, 5, 4), "scale_placement": "k"}


@_case("scale_placement_split", "sqrt(alpha) on q and on k (split placement; not alpha on each)",
       "ScalePlacement")
def _(rng):
    return {**_qkv(rng, 1, 2, 2, 3, 5, 8), "scale_placement": "split"}


# -- score families and modifiers -------------------------------------------------------------
@_case("score_bilinear_per_head", "Bilinear (Luong general) score with a per-head metric W",
       "ScoreBilinear", "ExplicitScale")
def _(rng):
    return {**_qkv(rng, 1, 2, 2, 3, 5, 4), "score": Bilinear(rng.standard_normal((2, 4, 4))),
            "scale": 0.5}


@_case("score_bilinear_shared_dq6_dk4", "Bilinear score with one shared metric and unequal widths "
       "Dq=6, Dk=4", "ScoreBilinear", "UnequalQKWidth", "ExplicitScale")
def _(rng):
    x = _qkv(rng, 1, 2, 2, 3, 5, 4)
    x["q"] = rng.standard_normal((1, 2, 3, 6))
    return {**x, "score": Bilinear(rng.standard_normal((6, 4))), "scale": 0.5}


@_case("score_additive", "Additive (Bahdanau) score v . tanh(Wq q + Wk k + b), Da=3",
       "ScoreAdditive", "ExplicitScale")
def _(rng):
    H, Da, D = 2, 3, 4
    fam = Additive(rng.standard_normal((H, Da, D)), rng.standard_normal((H, Da, D)),
                   rng.standard_normal((H, Da)), rng.standard_normal((H, Da)))
    return {**_qkv(rng, 1, H, H, 3, 5, D), "score": fam, "scale": 1.0}


@_case("score_cosine_zero_key", "Cosine score with an explicit multiplier 8; key 2 is the zero "
       "vector (norm clamped to eps, scores 0)", "ScoreCosine", "ExplicitScale", "ZeroNorm")
def _(rng):
    x = _qkv(rng, 1, 2, 2, 3, 5, 4)
    x["k"][:, :, 2] = 0.0
    return {**x, "score": Cosine(), "scale": 8.0}


@_case("softcap_5", "Softcap c=5 on scaled scores of magnitude about 10 (tanh saturates), "
       "before bias and visibility", "Softcap", "BiasBroadcast", "KeyPadding")
def _(rng):
    x = _qkv(rng, 1, 2, 2, 3, 6, 4)
    x["q"] *= 4.0
    return {**x, "softcap": 5.0, "bias": rng.standard_normal((1, 2, 1, 6)),
            "visible": np.array([True, True, True, True, True, False])}


@_case("sink_per_head", "Per-head sink logits join every row's denominator with no value row",
       "Sink")
def _(rng):
    return {**_qkv(rng, 2, 2, 2, 3, 4, 4), "sink": np.array([0.5, 2.0])}


@_case("sink_softcap_gqa_causal", "Sink, softcap and GQA together under causal visibility",
       "Sink", "Softcap", "GQA", "CausalSquare", conventions=UL)
def _(rng):
    return {**_qkv(rng, 1, 4, 2, 5, 5, 4), "sink": rng.standard_normal(4), "softcap": 3.0,
            "visible": causal(5, 5, alignment="upper_left")}


# -- what kernel authors test (issue 19) ---------------------------------------------------------
@_case("sink_empty_rows_lower_right", "Sink over rows with no legal key: lower-right causal with "
       "Q=5 > K=3, rows 0 and 1 read nothing; all mass to the sink, output 0, lse = sink logit",
       "Sink", "EmptyRowWithSink", "LowerRightCausal",
       conventions={**LR, "empty_row_with_sink": "probs 0, sink_probs 1, output 0, lse = sink"})
def _(rng):
    return {**_qkv(rng, 1, 2, 1, 5, 3, 4), "visible": causal(5, 3, alignment="lower_right"),
            "sink": np.array([0.75, -1.5])}


def _streaming_llm(T: int, window: int, first: int):
    pos = np.arange(T)[None]
    return (relation(pos, pos, causal=True, window=(window, 0))
            | relation(pos, pos, pos < first, causal=True))


@_case("streaming_llm_window_or_first_tokens", "Union of relations: a causal window of 2 keys "
       "before the query OR the first 3 tokens (StreamingLLM, FlashAttention sink_token_length)",
       "ComposedRelation", "RelationUnion", "SlidingWindow",
       conventions={**POS, "window_convention": "excludes_query", "relation_composition": "or"})
def _(rng):
    return {**_qkv(rng, 1, 2, 2, 10, 10, 4), "visible": _streaming_llm(10, 2, 3)}


@_case("document_causal_intersection", "Intersection of a union: causal AND (same document OR "
       "the shared prompt token 0), documents starting at 0, 3 and 6", "ComposedRelation",
       "RelationIntersection", "RelationUnion", "PackedSegments",
       conventions={"causal_alignment": "composed", "window_convention": "none",
                    "relation_composition": "and(causal, or(same_document, key_0))"})
def _(rng):
    pos = np.arange(9)[None]
    seg = np.array([[0, 0, 0, 1, 1, 1, 2, 2, 2]])
    rel = causal(9, 9, alignment="upper_left") & (
        relation(pos, pos, q_segment=seg, k_segment=seg) | relation(pos, pos, pos == 0))
    return {**_qkv(rng, 1, 2, 1, 9, 9, 4), "visible": rel}


_CU_EMPTY = np.array([0, 3, 3, 7, 7, 9])  # sequences 1 and 3 are empty (repeated offsets)


@_case("packed_empty_sequences", "Varlen batch with empty sequences: cu_seqlens [0, 3, 3, 7, 7, 9] "
       "(sequences 1 and 3 hold no token), block-diagonal causal", "PackedSegments",
       "EmptySequence", "CausalSquare",
       conventions={**POS, "cu_seqlens": _CU_EMPTY.tolist(), "empty_sequences": [1, 3]})
def _(rng):
    seg = segments_from_cu_seqlens(_CU_EMPTY)
    ids, local = seg.segment_ids[None], seg.positions[None]
    rel = relation(local, local, q_segment=ids, k_segment=ids, causal=True)
    return {**_qkv(rng, 1, 2, 2, 9, 9, 4), "visible": rel}


@_case("paged_kv_decode", "Paged KV cache: 2 decode tokens per sequence, pages of 4 slots via a "
       "block table; the pages stored as given, their gradients mapped back (unread pages 0)",
       "PagedKV", "ChunkedDecode", "ExplicitPositions", "GQA", conventions=POS)
def _(rng):
    table = np.array([[4, 1, 6], [0, 5, -1]])  # -1: padding past sequence 1's last page
    lens = np.array([11, 6])
    q = rng.standard_normal((2, 4, 2, 4))  # (B, Hq, Q, Dk)
    k_pages = rng.standard_normal((7, 4, 2, 4))  # (num_pages, page_size, Hkv, Dk)
    v_pages = rng.standard_normal((7, 4, 2, 3))  # (num_pages, page_size, Hkv, Dv)
    return {"paged": paged_call(q, k_pages, v_pages, table, lens, 4)}


@_case("alibi_per_batch_slopes", "ALiBi with slopes per batch row and head (B, Hq), as "
       "FlashAttention's alibi_slopes (batch, nheads), bottom-right positions, causal",
       "ALiBi", "PerBatchSlopes", "LowerRightCausal",
       conventions={**LR, "alibi_slopes": "per batch row and head (B, Hq)",
                    "alibi_bias": "-slope[b, h] * |q_pos[i] - k_pos[j]|, "
                                  "q_pos = arange(Q) + K - Q"})
def _(rng):
    slopes = np.array([[0.5, 0.125], [0.25, 0.0625]])  # (B, Hq)
    bias = alibi(slopes, np.arange(3) + 3, np.arange(6))  # (B, Hq, Q, K)
    return {**_qkv(rng, 2, 2, 2, 3, 6, 4), "bias": bias,
            "visible": causal(3, 6, alignment="lower_right")}


# -- quantised kernels (issue 28): codes, scales, the real result and the emulated intervals --
def _grid(rng: np.random.Generator, shape: tuple[int, ...], fmt: str, amp: float = 1.0
          ) -> np.ndarray:
    """Normal draws times ``amp`` rounded onto ``fmt``'s grid (saturating): a kernel's codes
    or its 16-bit inputs, as float64."""
    rounding = "nearest_even_satfinite" if fmt in ("e4m3fn", "e5m2") else "nearest_even"
    return quantize(rng.standard_normal(shape) * amp, fmt, rounding)


def _f32(rng: np.random.Generator, shape: tuple[int, ...], lo: float, hi: float) -> np.ndarray:
    """Scales drawn from [lo, hi) and rounded to float32 (the kernels keep them in float32)."""
    return quantize(rng.uniform(lo, hi, shape), "fp32", "nearest_even")


def _lr(Q: int, K: int) -> Any:
    return causal(Q, K, alignment="lower_right")  # the quantised kernels' causal mask


@_case("quant_fa3_fp8", "FA3 FP8 forward: e4m3fn codes, float32 descales per (batch, kv "
       "head), P offset +8, e4m3 satfinite P, bf16 output; real result and emulated intervals",
       "Quantized", "QuantFA3FP8")
def _(rng):
    spec = preset("fa3_fp8", q_descale=_f32(rng, (2, 2), 0.01, 0.1),
                  k_descale=_f32(rng, (2, 2), 0.01, 0.1), v_descale=_f32(rng, (2, 2), 0.01, 0.1))
    return {"q": _grid(rng, (2, 2, 5, 8), "e4m3fn", 16.0),
            "k": _grid(rng, (2, 2, 5, 8), "e4m3fn", 16.0),
            "v": _grid(rng, (2, 2, 5, 8), "e4m3fn", 16.0), "quant": spec}


@_case("quant_fa3_fp8_gqa_causal", "FA3 FP8 with GQA (Hq=4, Hkv=2: query heads use their kv "
       "head's descale) and a lower-right causal mask over a 7-key history", "Quantized",
       "QuantFA3FP8", "GQA", "LowerRightCausal", "CrossAttention", conventions=LR)
def _(rng):
    spec = preset("fa3_fp8", q_descale=_f32(rng, (1, 2), 0.02, 0.2),
                  k_descale=_f32(rng, (1, 2), 0.02, 0.2), v_descale=_f32(rng, (1, 2), 0.02, 0.2))
    return {"q": _grid(rng, (1, 4, 3, 8), "e4m3fn", 8.0),
            "k": _grid(rng, (1, 2, 7, 8), "e4m3fn", 8.0),
            "v": _grid(rng, (1, 2, 7, 8), "e4m3fn", 8.0), "visible": _lr(3, 7), "quant": spec}


@_case("quant_fa3_fp8_format_limits", "FA3 FP8 with codes at e4m3fn's limits: +-448, +-416, "
       "the subnormals +-2**-9 and 2**-7, zeros; q and k descales 2**-6, v's 1", "Quantized",
       "QuantFA3FP8", "FormatLimits")
def _(rng):
    values = np.array([448.0, -448.0, 416.0, -416.0, 2.0**-9, -(2.0**-9), 2.0**-7, 0.0, 1.0])

    def draw(shape: tuple[int, ...]) -> np.ndarray:
        return values[rng.integers(0, len(values), shape)]

    d = np.full((1, 2), 2.0**-6)
    return {"q": draw((1, 2, 4, 4)), "k": draw((1, 2, 5, 4)), "v": draw((1, 2, 5, 4)),
            "quant": preset("fa3_fp8", q_descale=d, k_descale=d)}


@_case("quant_fa3_fp8_tiny_descales", "FA3 FP8 with q and k descales 2**-70: real scores below "
       "float32's range; q_descale * k_descale = 2**-140, a float32 subnormal, in the exponent",
       "Quantized", "QuantFA3FP8", "ScalesPastFloat32")
def _(rng):
    tiny = np.full((1, 2), 2.0**-70)
    spec = preset("fa3_fp8", q_descale=tiny, k_descale=tiny, v_descale=np.full((1, 2), 0.5))
    return {"q": _grid(rng, (1, 2, 4, 8), "e4m3fn", 64.0),
            "k": _grid(rng, (1, 2, 4, 8), "e4m3fn", 64.0),
            "v": _grid(rng, (1, 2, 4, 8), "e4m3fn", 4.0), "quant": spec}


@_case("quant_flashinfer_sm90_fp8_gqa", "FlashInfer SM90 FP8: scales per head without a batch "
       "axis (q (Hq,), k and v (Hkv,)), P = satfinite(p * 448), GQA Hq=4, Hkv=2", "Quantized",
       "QuantFlashInferSM90FP8", "GQA")
def _(rng):
    # the kernel has no head dim 8 (quant.tiles asks for the tile): head dim 64's 128, one tile
    spec = preset("flashinfer_sm90_fp8", q_scale=_f32(rng, (4,), 0.01, 0.1),
                  k_scale=_f32(rng, (2,), 0.01, 0.1), v_scale=_f32(rng, (2,), 0.01, 0.1),
                  kv_tile=128)
    return {"q": _grid(rng, (1, 4, 5, 8), "e4m3fn", 16.0),
            "k": _grid(rng, (1, 2, 5, 8), "e4m3fn", 16.0),
            "v": _grid(rng, (1, 2, 5, 8), "e4m3fn", 16.0), "quant": spec}


@_case("quant_flashinfer_sm90_e5m2_causal", "FlashInfer SM90 with e5m2 codes (P = satfinite(p "
       "* 57344)), causal", "Quantized", "QuantFlashInferSM90FP8", "CausalSquare",
       "LowerRightCausal", conventions=LR)
def _(rng):
    spec = preset("flashinfer_sm90_fp8", kv_format="e5m2", q_scale=0.125, k_scale=0.25,
                  v_scale=0.5, kv_tile=128)  # no head dim 4 in the kernel: one tile of 128
    return {"q": _grid(rng, (1, 2, 5, 4), "e5m2", 4.0), "k": _grid(rng, (1, 2, 5, 4), "e5m2", 4.0),
            "v": _grid(rng, (1, 2, 5, 4), "e5m2", 4.0), "visible": _lr(5, 5), "quant": spec}


@_case("quant_flashinfer_fp8_kv_causal", "FlashInfer FA2, FP8 KV cache: fp16 q, e4m3fn K and V "
       "codes, l summed from the fp16-rounded P, v_scale after the kernel; lower-right causal",
       "Quantized", "QuantFlashInferFP8KV", "LowerRightCausal", "CrossAttention", conventions=LR)
def _(rng):
    # FA2's kv tile is chosen at dispatch (32, 64 or 128): 64, all 6 keys in one tile
    spec = preset("flashinfer_fp8_kv", k_scale=0.0625, v_scale=0.03125, kv_tile=64)
    return {"q": _grid(rng, (1, 2, 3, 8), "fp16"), "k": _grid(rng, (1, 2, 6, 8), "e4m3fn", 16.0),
            "v": _grid(rng, (1, 2, 6, 8), "e4m3fn", 16.0), "visible": _lr(3, 6), "quant": spec}


@_case("quant_vllm_fp8_kv_saturating", "vLLM's FP8 KV cache read by FA3: bf16 q, k, v cast by "
       "the kernel (x / scale, satfinite), some beyond 448 * scale (saturated); GQA, "
       "lower-right causal", "Quantized", "QuantVLLMFP8KV", "GQA", "LowerRightCausal",
       "CrossAttention", "FormatLimits", conventions=LR)
def _(rng):
    spec = preset("vllm_fp8_kv", q_scale=0.0078125, k_scale=0.015625, v_scale=0.0078125)
    return {"q": _grid(rng, (1, 4, 4, 8), "bf16", 2.0), "k": _grid(rng, (1, 2, 6, 8), "bf16", 4.0),
            "v": _grid(rng, (1, 2, 6, 8), "bf16", 2.0), "visible": _lr(4, 6), "quant": spec}


@_case("quant_sageattention_int8_causal", "SageAttention (Triton): K smoothed, Q pre-scaled, INT8 "
       "per Q/K token block (half away from zero), fp16 P, fp16 PV per tile; MQA, causal",
       "Quantized", "QuantSageAttentionINT8", "MQA", "GQA", "CausalSquare", "LowerRightCausal",
       conventions=LR)
def _(rng):
    return {"q": _grid(rng, (1, 2, 6, 8), "fp16"), "k": _grid(rng, (1, 1, 6, 8), "fp16"),
            "v": _grid(rng, (1, 1, 6, 8), "fp16"), "visible": _lr(6, 6),
            "quant": preset("sageattention_int8")}


@_case("quant_sageattention_int8_blocks", "SageAttention with 70 keys: two K blocks of 64 and "
       "6 tokens, each its own INT8 scale, and two kv tiles of the online softmax", "Quantized",
       "QuantSageAttentionINT8", "CrossAttention")
def _(rng):
    return {"q": _grid(rng, (1, 1, 3, 8), "fp16"), "k": _grid(rng, (1, 1, 70, 8), "fp16"),
            "v": _grid(rng, (1, 1, 70, 8), "fp16"), "quant": preset("sageattention_int8")}


# -- the contract's own fixtures ---------------------------------------------------------------
@_case("loop6_two_query_training_trace", "Contract Loop 6 fixture: rho=0.25, one realised keep "
       "mask, published P, O, D and G_S", "ContractFixture", "ExplicitMultiplier",
       "DroppedLegalEdge", "MaskedEdge", "CrossAttention")
def _(rng):
    call = loop6_call()
    return {"q": call.q, "k": call.k, "v": call.v, "visible": call.visible,
            "dropout": call.dropout, "grad_output": LOOP6_GRAD_OUTPUT}


@_case("loop7_cross_attention_padded_source", "Contract Loop 7 fixture: padded source row with "
       "bias +7 stays excluded; published P and O", "ContractFixture", "CrossAttention",
       "KeyPadding", "BiasCannotRevive")
def _(rng):
    call = loop7_call()
    return {"q": call.q, "k": call.k, "v": call.v, "visible": call.visible, "bias": call.bias,
            "grad_output": np.array([[[[0.5, -1.0], [1.5, 0.25]]]])}


def cases() -> list[GoldenCase]:
    """Every conformance case, in definition order.

    Examples
    --------
    >>> all_cases = cases()
    >>> len(all_cases) >= 40, all_cases[0].case_id
    (True, 'self_attention_basic')
    """
    return [make() for make in CASES.values()]
