"""Diagnoses of a failing ``flash_attn_with_kvcache`` candidate with rotary embeddings: which
RoPE bug, recomputed, fits the kernel's output (and its updated cache).

Owns :func:`diagnose_kvcache` and :class:`KVCacheDiagnosis`. As in
:mod:`refattn.bundle.comparison.diagnosis`, a diagnosis is a hypothesis that was recomputed
and found to fit, never a guess from one element: each bug below is expressed as the same
call with transformed arguments (through :mod:`refattn.rope`), run by
:func:`refattn.adapters.flash_attn.flash_attn_with_kvcache`, and the candidate's output must
lie within the tolerance of that result (its updated k_cache too, where given: within the
tolerance of the hypothesis's cache, or of the honest one where the bug leaves the cache
alone):

- ``rope_layout``: the other pairing (GPT-NeoX half-split where the call asks for GPT-J's
  interleaved pairs, or the reverse): ``rotary_interleaved`` flipped;
- ``rope_twice``: the appended keys rotated twice (RoPE applied again after the cache
  append): ``k`` passed already rotated at its cache rows;
- ``rope_q_missing``: q not rotated: q passed through the inverse rotation at its positions
  (``[[c, s], [-s, c]] / (c^2 + s^2)`` per pair), so that the kernel's rotation restores it;
- ``rope_leftpad``: rotary positions measured from ``cache_leftpad`` (``cache_seqlens[b] -
  cache_leftpad[b] + t``) where FlashAttention rotates at absolute cache rows (its
  ``row_offset_cossin`` adds ``leftpad_k`` back): k and q passed through ``R(p)^-1 R(p -
  leftpad)``.

An honest candidate (within the tolerance of the call itself) gets no diagnosis.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from refattn._boundary import public
from refattn._checks import as_array, bounded_float
from refattn.adapters.flash_attn import flash_attn_with_kvcache, kvcache_call
from refattn.errors import RefAttnError
from refattn.rope import apply

__all__ = ["HYPOTHESES", "KVCacheDiagnosis", "diagnose_kvcache"]

#: the hypotheses, by kind, in the order they are tried
HYPOTHESES = {
    "rope_layout": "RoPE layout swapped (rotary_interleaved flipped: GPT-J pairs (2i, 2i+1) "
                   "vs GPT-NeoX pairs (i, i + rotary_dim/2))",
    "rope_twice": "RoPE applied twice to the appended keys (rotated again after the cache "
                  "append)",
    "rope_q_missing": "RoPE not applied to q",
    "rope_leftpad": "rotary positions measured from cache_leftpad instead of the absolute "
                    "cache row",
}


@public
@dataclass(frozen=True)
class KVCacheDiagnosis:
    """What :func:`diagnose_kvcache` found.

    Attributes
    ----------
    matches_reference : bool
        The candidate is within the tolerance of the call itself (no diagnosis).
    kinds : tuple of str
        The hypotheses (keys of :data:`HYPOTHESES`) that fit; empty when the candidate
        matches, or when it fails and no hypothesis explains it.
    lines : tuple of str
        One ``diagnosis: ...`` line per fitting hypothesis.
    max_error : float
        The candidate output's largest absolute difference from the reference.
    """

    matches_reference: bool
    kinds: tuple[str, ...]
    lines: tuple[str, ...]
    max_error: float


def _close(a: np.ndarray, b: np.ndarray, rtol: float, atol: float) -> bool:
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=rtol, atol=atol))


def _inverse(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, pos: np.ndarray,
             interleaved: bool) -> np.ndarray | None:
    """(B, T, H, D) through the inverse rotation at (B, T) positions, or None where a used
    table row is singular (c = s = 0)."""
    norm = cos * cos + sin * sin
    if not (norm[np.unique(pos)] > 0).all():
        return None
    y = apply(np.ascontiguousarray(x.transpose(0, 2, 1, 3)), cos / norm, -(sin / norm), pos,
              interleaved)
    return np.ascontiguousarray(y.transpose(0, 2, 1, 3))


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, pos: np.ndarray,
            interleaved: bool) -> np.ndarray:
    y = apply(np.ascontiguousarray(x.transpose(0, 2, 1, 3)), cos, sin, pos, interleaved)
    return np.ascontiguousarray(y.transpose(0, 2, 1, 3))


def _variants(args: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The transformed arguments of each hypothesis that applies to this call."""
    kv = kvcache_call(**{n: a for n, a in args.items() if n not in (
        "num_splits", "return_softmax_lse", "return_updated_cache")})
    lay = kv.append
    cos, sin = lay.rotary_cos, lay.rotary_sin
    if cos is None or sin is None or lay.k is None:
        return {}
    inter = lay.rotary_interleaved
    kpos, qpos = lay.k_positions(), lay.q_positions()
    out: dict[str, dict[str, Any]] = {
        "rope_layout": {**args, "rotary_interleaved": not inter},
        "rope_twice": {**args, "k": _rotate(lay.k, cos, sin, kpos, inter)},
    }
    q_plain = _inverse(lay.q, cos, sin, qpos, inter)
    if q_plain is not None:
        out["rope_q_missing"] = {**args, "q": q_plain}
    lp = lay.cache_leftpad
    if lp is not None and lp.any():
        k_back = _inverse(lay.k, cos, sin, kpos, inter)
        q_back = _inverse(lay.q, cos, sin, qpos, inter)
        if k_back is not None and q_back is not None:
            shift = lp[:, None]
            out["rope_leftpad"] = {
                **args, "k": _rotate(k_back, cos, sin, kpos - shift, inter),
                "q": _rotate(q_back, cos, sin, qpos - shift, inter)}
    return out


@public
def _candidate(name: str, x: Any) -> np.ndarray:
    """A candidate tensor in float64: any floating dtype (the kernel's own, bfloat16 too) widened
    exactly; anything else (an integer beyond every float, an object array) refused."""
    arr = as_array(name, x)
    if arr.dtype.kind != "f" and arr.dtype.name != "bfloat16":
        raise RefAttnError(f"{name}: expected a floating-point array (the kernel's output in its "
                           f"own dtype), got dtype {arr.dtype}")
    return arr.astype(np.float64)


def diagnose_kvcache(arguments: Mapping[str, Any], output: Any, k_cache: Any = None, *,
                     rtol: float = 1e-6, atol: float = 1e-6) -> KVCacheDiagnosis:
    """Which RoPE bug fits a kernel's ``flash_attn_with_kvcache`` result.

    Parameters
    ----------
    arguments : mapping
        The keyword arguments of the call (``q``, ``k_cache``, ``v_cache``, ``k``, ``v``,
        ``rotary_cos``, ...), float64, as :func:`refattn.adapters.flash_attn.
        flash_attn_with_kvcache` takes them (the caches before the kernel's append).
    output : (B, Q, Hq, D) ndarray
        The candidate's ``out`` (converted to float64 for the comparison).
    k_cache : ndarray, optional
        The candidate's k_cache after its in-place append.
    rtol, atol : float
        The tolerance of every comparison (``np.allclose``), in ``[0, 1]``.

    Returns
    -------
    KVCacheDiagnosis

    Raises
    ------
    RefAttnError
        Arguments the call refuses, a candidate of another shape than the reference's.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> angle = rng.random((8, 4))
    >>> args = dict(q=rng.standard_normal((1, 1, 2, 8)),
    ...             k_cache=rng.standard_normal((1, 8, 1, 8)),
    ...             v_cache=rng.standard_normal((1, 8, 1, 8)),
    ...             k=rng.standard_normal((1, 1, 1, 8)), v=rng.standard_normal((1, 1, 1, 8)),
    ...             rotary_cos=np.cos(angle), rotary_sin=np.sin(angle),
    ...             cache_seqlens=np.array([4], np.int32), causal=True)
    >>> buggy = flash_attn_with_kvcache(**{**args, "rotary_interleaved": False})
    >>> diagnose_kvcache(args, buggy).kinds
    ('rope_layout',)
    >>> diagnose_kvcache(args, flash_attn_with_kvcache(**args)).matches_reference
    True
    """
    if not isinstance(arguments, Mapping):
        raise RefAttnError(f"arguments: expected a mapping of flash_attn_with_kvcache's "
                           f"keyword arguments, got {type(arguments).__name__}")
    rt = bounded_float("rtol", rtol, lo=0.0, hi=1.0)
    at = bounded_float("atol", atol, lo=0.0, hi=1.0)
    args = {n: a for n, a in arguments.items() if n not in (
        "return_softmax_lse", "return_updated_cache")}
    cand = _candidate("output", output)
    cand_k = None if k_cache is None else _candidate("k_cache", k_cache)
    ref, ref_k, _ = flash_attn_with_kvcache(**args, return_updated_cache=True)
    if cand.shape != ref.shape:
        raise RefAttnError(f"output: expected shape {list(ref.shape)} (B, Q, Hq, D), got "
                           f"{list(cand.shape)}")
    if cand_k is not None and cand_k.shape != ref_k.shape:
        raise RefAttnError(f"k_cache: expected shape {list(ref_k.shape)}, got "
                           f"{list(cand_k.shape)}")
    err = float(np.abs(cand - ref).max()) if cand.size else 0.0
    honest_cache = cand_k is None or _close(cand_k, ref_k, rt, at)
    if _close(cand, ref, rt, at) and honest_cache:
        return KVCacheDiagnosis(True, (), (), err)
    kinds: list[str] = []
    lines: list[str] = []
    for kind, variant in _variants(args).items():
        out, k_new, _ = flash_attn_with_kvcache(**variant, return_updated_cache=True)
        if not _close(cand, out, rt, at):
            continue
        where = "output"
        if cand_k is not None:
            if _close(cand_k, k_new, rt, at):
                where = "output and k_cache"
            elif not honest_cache:
                continue
        kinds.append(kind)
        lines.append(f"diagnosis: {where}: candidate = the call with {HYPOTHESES[kind]}")
    return KVCacheDiagnosis(False, tuple(kinds), tuple(lines), err)
