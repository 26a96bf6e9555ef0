"""FlashAttention lowering: one golden case as the exact arguments of FlashAttention's interface.

Owns :class:`FlashCall`, :func:`flash_call` (``case.to_flash_attn()``,
``case.to_flash_attn_varlen()``, ``case.to_flash_attn_kvcache()``) and :func:`ineligible`
(a golden case -> FlashAttention's arguments), and the other direction for the KV cache:
:func:`kvcache_call` and :func:`flash_attn_with_kvcache` (FlashAttention's arguments, appends
``k`` / ``v``, rotary tables, ``cache_leftpad`` and ``cache_batch_idx`` included -> the
inputs as given, :class:`refattn.call.kvcache.KVCacheAppend`, and refattn's canonical call
through :func:`refattn.call.paged.paged_call`, run by the reference forward; the updated
caches returned as copies with ``return_updated_cache=True``).
The interface is the one ``flash_attn/flash_attn_interface.py`` of Dao-AILab/flash-attention
(FlashAttention 2) documents, which Triton and CUDA kernels that follow FlashAttention's API
take as-is:

- ``flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
  window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
  return_attn_probs=False)``: q ``(batch_size, seqlen, nheads, headdim)``, k and v
  ``(batch_size, seqlen, nheads_k, headdim)``;
- ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
  ...)``: q ``(total_q, nheads, headdim)``, k and v ``(total_k, nheads_k, headdim)``,
  ``cu_seqlens_q/k`` ``(batch_size + 1,)`` int32 cumulative sequence lengths;
- ``flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
  rotary_sin=None, cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
  block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
  rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False)``:
  k_cache and v_cache ``(batch_size_cache, seqlen_cache, nheads_k, headdim)``, cache_seqlens
  ``(batch_size,)`` int32 ("Does not support backward pass").

Their documented semantics, which the lowering relies on (quoted from the docstrings):
GQA "head 0, 1, 2 of Q will attention to head 0 of K, V" (query head h reads kv head
h // (Hq // Hkv)); "If causal=True, the causal mask is aligned to the bottom right corner of
the attention matrix" (key j <= i + seqlen_k - seqlen_q, per sequence); with ``window_size``
"Query at position i will only attend to keys between [i + seqlen_k - seqlen_q -
window_size[0], i + seqlen_k - seqlen_q + window_size[1]] inclusive" (-1: unbounded); "If the
row of the mask is all zero, the output will be zero"; ``alibi_slopes`` "(nheads,) or
(batch_size, nheads), fp32. A bias of (-alibi_slope * |i + seqlen_k - seqlen_q - j|) is added
to the attention score of query i and key j"; ``softmax_scale`` "Default to 1 /
sqrt(headdim)"; ``softcap`` "Anything > 0 activates softcapping attention" (the kernel caps
the scaled score, ``softcap * tanh(softmax_scale * qk / softcap)``, then adds ALiBi and masks:
refattn's order); ``softmax_lse`` ``(batch_size, nheads, seqlen)`` or ``(nheads, total_q)``,
"The logsumexp of each row of the matrix QK^T * scaling".

A case is expressible when its scores are dot products, it has no dropout multiplier
(FlashAttention draws its own), no sink logit, Dk == Dv, grouped heads, a bias only if it is
exactly FlashAttention's ALiBi, and a visibility that is exactly the support the arguments
generate: one window band per sequence, the same for every head; :func:`ineligible` names
what fails. A paged case (``kv_layout: paged``) lowers to ``flash_attn_with_kvcache`` with
its pages and block table as stored (:func:`page_size_note` names the page sizes
FlashAttention 2's CUDA kernel refuses). Arrays are NumPy, in the run's dtype (the real
kernels take float16 / bfloat16 CUDA tensors: :meth:`FlashCall.torch_arguments`). Nothing
here imports torch or flash_attn.

The paged interface, as read in the sources (Dao-AILab/flash-attention):
``flash_attn/flash_attn_interface.py`` ``flash_attn_with_kvcache`` (the signature; k_cache
``(num_blocks, page_block_size, nheads_k, headdim)`` "if there's a block_table"; block_table
``(batch_size, max_num_blocks_per_seq)`` int32; an int ``cache_seqlens`` filled into a
tensor); ``csrc/flash_attn/flash_api.cpp`` ``mha_fwd_kvcache`` (block_table and seqlens_k
must be int32, ``seqlen_k = max_num_blocks_per_seq * page_block_size`` when no seqlens are
given, page_block_size divisible by 256 in FlashAttention 2's kernels, ``cache_batch_idx``
and ``leftpad_k`` refused with a paged cache, causal sets the right window bound to 0) and
``set_params_fprop`` (a negative window bound is unbounded); ``flash_attn/src/softmax.h``
``normalize_softmax_lse`` (lse ``INFINITY`` for a row whose sum is 0: no visible key).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from refattn._boundary import public
from refattn._checks import (
    INT64_MAX,
    INT64_MIN,
    as_array,
    bounded_float,
    bounded_int,
    check_finite,
    first_index,
    format_index,
    index_array,
)
from refattn._memory import check_bytes
from refattn.adapters import semantic_limits
from refattn.bundle.comparison.tolerances import precision_name, resolve_dtype
from refattn.bundle.golden.spec import CaseSpec
from refattn.call.gate import AttentionCall
from refattn.call.kvcache import KV_LAYOUT, KVCacheAppend
from refattn.call.paged import READ_LESS, PagedKV, gather_bytes
from refattn.call.placement import operand_multipliers
from refattn.engine import forward
from refattn.errors import RefAttnError

__all__ = ["FUNCTIONS", "FlashCall", "KVCacheCall",
           "flash_attn_with_kvcache", "flash_call", "ineligible", "kvcache_call",
           "page_size_note"]

Function = Literal["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]
#: the three entry points, by lowering name
FUNCTIONS: dict[str, Function] = {"flash_attn": "flash_attn_func",
                                  "flash_attn_varlen": "flash_attn_varlen_func",
                                  "flash_attn_kvcache": "flash_attn_with_kvcache"}

#: one sequence: (batch row, first query row, end, first key row, end) in the case's frame
Sequence = tuple[int, int, int, int, int]
#: float32's largest finite value (FlashAttention's alibi_slopes are fp32)
_FP32_MAX = float(np.finfo(np.float32).max)


def _sequences(spec: CaseSpec, variant: str) -> list[Sequence]:
    B, _, Q, K = spec.score_shape
    if variant == "flash_attn":
        return [(b, 0, Q, 0, K) for b in range(B)]
    if variant == "flash_attn_kvcache" and _paged(spec):  # queries at the end of the cache
        lens = index_array("seqlens", spec.tensors["seqlens"], lo=1, hi=K, ndim=1, letters="b")
        if lens.shape != (B,):
            raise RefAttnError(f"{spec.case_id}: seqlens: expected shape [B={B}], got "
                               f"{list(lens.shape)}")
        return [(b, 0, Q, 0, int(lens[b])) for b in range(B)]
    vis = spec.visible_full()[:, 0]  # (B, Q, K); head independence is checked later
    segments = None
    relation = spec.relation()
    if variant == "flash_attn_varlen" and relation is not None:
        with_segments = [r for r in relation.leaves() if r.q_segment is not None]
        if len(with_segments) == 1:
            segments = with_segments[0]
    out: list[Sequence] = []
    for b in range(B):
        if segments is None:
            seen = np.flatnonzero(vis[b].any(axis=0))
            out.append((b, 0, Q, 0, int(seen[-1]) + 1 if seen.size else 0))
            continue
        qs = segments.q_segment[min(b, segments.q_segment.shape[0] - 1)]
        ks = segments.k_segment[min(b, segments.k_segment.shape[0] - 1)]
        for s in dict.fromkeys(qs.tolist()):  # segment ids in order of first query row
            rows, keys = np.flatnonzero(qs == s), np.flatnonzero(ks == s)
            if rows.size != rows[-1] - rows[0] + 1 or (
                    keys.size and keys.size != keys[-1] - keys[0] + 1):
                return []  # not contiguous: no varlen packing
            k0 = int(keys[0]) if keys.size else 0
            seen = np.flatnonzero(vis[b][rows[0]:rows[-1] + 1, k0:k0 + keys.size].any(axis=0))
            k1 = k0 + (int(seen[-1]) + 1 if seen.size else 0)
            out.append((b, int(rows[0]), int(rows[-1]) + 1, k0, k1))
    return out


def _geometry(spec: CaseSpec, seqs: list[Sequence], window: tuple[int, int]
              ) -> tuple[np.ndarray, np.ndarray]:
    """(B, Q, K) support that ``window`` generates over ``seqs`` and |diagonal - key|."""
    B, _, Q, K = spec.score_shape
    support = np.zeros((B, Q, K), bool)
    dist = np.zeros((B, Q, K), np.int64)
    left, right = window
    for b, q0, q1, k0, k1 in seqs:
        ii = np.arange(q1 - q0)[:, None]
        jj = np.arange(k1 - k0)[None, :]
        d = jj - (ii + (k1 - k0) - (q1 - q0))  # key - diagonal (bottom-right aligned)
        support[b, q0:q1, k0:k1] = ((left < 0) | (d >= -left)) & ((right < 0) | (d <= right))
        dist[b, q0:q1, k0:k1] = np.abs(d)
    return support, dist


def _paged(spec: CaseSpec) -> bool:
    """Whether the case stores a paged KV cache as given (k_pages, v_pages, block_table,
    seqlens: :class:`refattn.call.paged.PagedKV`'s convention, FlashAttention's paged
    layout)."""
    return spec.conventions.get("kv_layout") == "paged"


@public
def page_size_note(page_size: int) -> str | None:
    """What a FlashAttention kernel may refuse about ``page_size``, or None.

    The interface (``flash_attn_with_kvcache``'s docstring) accepts any ``page_block_size``;
    FlashAttention 2's CUDA kernel checks ``page_block_size % 256 == 0`` ("Paged KV cache
    block size must be divisible by 256", ``csrc/flash_attn/flash_api.cpp``), while
    FlashAttention 3's kernels and Triton kernels of the same interface take smaller pages.
    The lowering therefore keeps the case's pages and says so here.

    Examples
    --------
    >>> page_size_note(256) is None
    True
    >>> page_size_note(4)[:40]
    'page_block_size=4: FlashAttention 2 CUDA'
    """
    page_size = bounded_int("page_size", page_size, lo=1, hi=INT64_MAX)
    if page_size % 256 == 0:
        return None
    return (f"page_block_size={page_size}: FlashAttention 2 CUDA kernel refuses it (its "
            "flash_api.cpp requires a multiple of 256); the interface, FlashAttention 3 and "
            "Triton kernels of the same interface accept it")


def _window(spec: CaseSpec, seqs: list[Sequence]) -> tuple[int, int] | None:
    vis = spec.visible_full()  # (B, Hq, Q, K)
    if not (vis == vis[:, :1]).all():
        return None
    vis = vis[:, 0]
    covered, _ = _geometry(spec, seqs, (-1, -1))
    if (vis & ~covered).any():
        return None
    dmin, dmax = 0, 0
    for b, q0, q1, k0, k1 in seqs:
        ii = np.arange(q1 - q0)[:, None]
        jj = np.arange(k1 - k0)[None, :]
        d = (jj - (ii + (k1 - k0) - (q1 - q0)))[vis[b, q0:q1, k0:k1]]
        if d.size:
            dmin, dmax = min(dmin, int(d.min())), max(dmax, int(d.max()))
    window = (-dmin, dmax)
    if not np.array_equal(_geometry(spec, seqs, window)[0], vis):
        return None
    if np.array_equal(_geometry(spec, seqs, (-1, window[1]))[0], vis):
        window = (-1, window[1])
    if np.array_equal(_geometry(spec, seqs, (window[0], -1))[0], vis):
        window = (window[0], -1)
    return window


def _alibi(spec: CaseSpec, seqs: list[Sequence], window: tuple[int, int]) -> Any:
    """The slopes ((Hq,) or (B, Hq)) whose ALiBi is the case's bias on every visible score,
    or a string saying why there are none."""
    B, Hq, Q, K = spec.score_shape
    bias = np.broadcast_to(np.asarray(spec.tensors["bias"], np.float64), (B, Hq, Q, K))
    support, dist = _geometry(spec, seqs, window)
    slopes = np.zeros((B, Hq))
    for b in range(B):
        for h in range(Hq):
            on = support[b] & (dist[b] > 0)
            if not on.any():
                continue
            s = -bias[b, h][on] / dist[b][on]
            slopes[b, h] = s[0]
    expected = -slopes[:, :, None, None] * dist[:, None]
    on = np.broadcast_to(support[:, None], bias.shape)
    if not np.array_equal(np.where(on, expected, 0.0), np.where(on, bias, 0.0)):
        return "bias tensor (FlashAttention takes only ALiBi slopes; this bias is not " \
               "-slope * |i + seqlen_k - seqlen_q - j|)"
    if not np.array_equal(slopes.astype(np.float32).astype(np.float64), slopes):
        return "ALiBi slopes not representable in float32 (alibi_slopes are fp32)"
    return slopes[0] if (slopes == slopes[:1]).all() else slopes


@dataclass(frozen=True)
class _Plan:
    sequences: list[Sequence]
    window: tuple[int, int]
    alibi: np.ndarray | None


def _plan(spec: CaseSpec, variant: str) -> _Plan | str:
    if variant not in FUNCTIONS:
        raise RefAttnError(f"variant: expected one of {list(FUNCTIONS)}, got {variant!r}")
    lim = semantic_limits(spec)
    if lim["family"] != "dot":
        return f"score family {lim['family']!r} (FlashAttention computes dot products)"
    if lim["dropout"]:
        return "dropout multiplier (FlashAttention draws its own dropout mask from dropout_p)"
    if lim["sink"]:
        return "sink logit (not a FlashAttention argument)"
    if not lim["equal_kv_width"]:
        return "Dk != Dv (FlashAttention takes one headdim for q, k and v)"
    a = spec.axes
    if spec.head_map_mode == "explicit" and not np.array_equal(
            np.asarray(spec.tensors["head_map"]), np.arange(a["Hq"]) // (a["Hq"] // a["Hkv"])):
        return "explicit head map (FlashAttention's query head h reads kv head h // (Hq // Hkv))"
    seqs = _sequences(spec, variant)
    window = _window(spec, seqs) if seqs else None
    if window is None:
        what = {"flash_attn": "one window band over the whole (Q, K) matrix",
                "flash_attn_varlen": "one window band per packed sequence",
                "flash_attn_kvcache": "one window band per cache (queries at the end of the "
                "first cache_seqlens[b] keys)"}[variant]
        return f"visibility is not {what}, the same for every head (bottom-right aligned)"
    alibi = None
    if "bias" in spec.tensors:
        alibi = _alibi(spec, seqs, window)
        if isinstance(alibi, str):
            return alibi
    return _Plan(seqs, window, alibi)


@public
def ineligible(spec: CaseSpec, variant: str = "flash_attn") -> str | None:
    """Why FlashAttention's ``variant`` (``flash_attn``, ``flash_attn_varlen``,
    ``flash_attn_kvcache``) cannot express ``spec`` exactly, or None when it can.

    Examples
    --------
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites.conformance import CASES
    >>> ineligible(case_spec(CASES["causal_upper_left_q3_k7"]()))[:64]
    'visibility is not one window band over the whole (Q, K) matrix, '
    >>> ineligible(case_spec(CASES["key_padding_lengths_7_5_2"]()), "flash_attn_varlen") is None
    True
    """
    if variant == "flash_attn_kvcache" and spec.conventions.get("kv_layout") == KV_LAYOUT:
        if spec.scale_placement != "post" or spec.softcap is not None:
            return "the scale applied after the product, no softcap (kvcache with appends)"
        return None  # lowered with its inputs as given (_append_call)
    plan = _plan(spec, variant)
    return plan if isinstance(plan, str) else None


@public
@dataclass(frozen=True, eq=False)
class FlashCall:
    """One case lowered to a FlashAttention entry point: ``getattr(flash_attn,
    c.function)(*c.args, **c.kwargs)``; :meth:`finish` maps what it returns back.

    Attributes
    ----------
    function : {"flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"}
    args : tuple of ndarray
        ``flash_attn_func``: q ``(B, Q, Hq, D)``, k, v ``(B, K, Hkv, D)``.
        ``flash_attn_varlen_func``: q ``(total_q, Hq, D)``, k, v ``(total_k, Hkv, D)``,
        ``cu_seqlens_q``, ``cu_seqlens_k`` ``(n_seq + 1,)`` int32, ``max_seqlen_q``,
        ``max_seqlen_k`` (int). ``flash_attn_with_kvcache``: q ``(B, Q, Hq, D)``, k_cache,
        v_cache ``(B, K, Hkv, D)``, or for a paged case its pages as stored,
        ``(num_blocks, page_block_size, Hkv, D)``. Floats in the run's dtype, rounded once
        from float64.
    kwargs : dict
        ``softmax_scale`` (None where the case leaves the scale to the kernel), ``causal``,
        ``window_size``, ``softcap`` (0.0: off), ``alibi_slopes`` (None, ``(Hq,)`` or
        ``(B, Hq)`` float32); ``dropout_p=0.0``, ``deterministic=False`` and
        ``return_attn_probs=True`` (func, varlen: returns the lse), or ``cache_seqlens``
        ``(B,)`` int32, ``return_softmax_lse=True`` and, for a paged case, ``block_table``
        ``(B, max_num_blocks_per_seq)`` int32 as stored (entries past a sequence's last
        block unread) (kvcache).
    sequences : list of (b, q0, q1, k0, k1)
        Each packed sequence (one per batch row for func and kvcache) as query and key row
        ranges of the case.
    grad_output : ndarray
        G_O in :attr:`args`' q layout, for the backward of func and varlen (zero on the rows
        refattn leaves unused, whose output it zeroes).
    query_valid : (B, 1, Q, 1) bool ndarray
    dtype : str
    notes : tuple of str
        What a particular kernel of the interface may refuse although the interface
        expresses the case (:func:`page_size_note`).
    updated : tuple of str
        A case with appends (``kv_layout: kvcache_append``): the golden tensors
        ``("kvcache_k_cache_updated", "kvcache_v_cache_updated")`` that ``args[1]`` and
        ``args[2]`` (``k_cache``, ``v_cache``) must equal after the kernel updated them in
        place; empty otherwise.
    """

    function: Function
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    sequences: list[Sequence]
    grad_output: np.ndarray
    query_valid: np.ndarray
    dtype: str
    shape: tuple[int, ...]
    query_multiplier: float = 1.0
    key_multiplier: float = 1.0
    notes: tuple[str, ...] = ()
    updated: tuple[str, ...] = ()

    @property
    def packed(self) -> bool:
        return self.function == "flash_attn_varlen_func"

    def _rows(self, kind: str) -> tuple[np.ndarray, np.ndarray]:
        b = np.concatenate([np.full((s[2] if kind == "q" else s[4]) - (s[1] if kind == "q"
                                                                       else s[3]), s[0])
                            for s in self.sequences] or [np.zeros(0, int)])
        r = np.concatenate([np.arange(s[1], s[2]) if kind == "q" else np.arange(s[3], s[4])
                            for s in self.sequences] or [np.zeros(0, int)])
        return b.astype(np.int64), r.astype(np.int64)

    def _unpack(self, x: np.ndarray, kind: str, rows: int) -> np.ndarray:
        """(total, H, D) or (B, T, H, D) -> (B, H, T, D) zero-filled outside the sequences."""
        B = self.shape[0]
        if not self.packed:
            return np.ascontiguousarray(x.transpose(0, 2, 1, 3))
        b, r = self._rows(kind)
        out = np.zeros((B, rows, *x.shape[1:]), x.dtype)
        out[b, r] = x
        return np.ascontiguousarray(out.transpose(0, 2, 1, 3))

    def outputs(self, output: Any, lse: Any = None, grads: Any = None) -> dict[str, np.ndarray]:
        """The entry point's ``out``, ``softmax_lse`` and gradients of ``(q, k, v)`` under
        refattn's names and layout (B, H, T, D): rows where :attr:`query_valid` is False
        zeroed, placement multipliers applied to the gradients; ``lse`` ``(B, Hq, Q)`` only
        where every query row is used (an unused row's golden lse is that of its sanitised
        row)."""
        B, Hq, Q, K = self.shape
        out = self._unpack(_np(output), "q", Q)
        tensors = {"output": np.where(self.query_valid, out, 0).astype(out.dtype)}
        if lse is not None and self.query_valid.all():
            lse = _np(lse)
            if self.packed:  # (nheads, total_q) -> (B, Hq, Q)
                full = np.zeros((B, Q, Hq), lse.dtype)
                b, r = self._rows("q")
                full[b, r] = lse.T
                lse = full.transpose(0, 2, 1)
            tensors["lse"] = np.ascontiguousarray(lse)
        if grads is not None:
            g_q, g_k, g_v = (_np(g) for g in grads[:3])
            tensors.update(grad_q=_scaled(self._unpack(g_q, "q", Q), self.query_multiplier),
                           grad_k=_scaled(self._unpack(g_k, "k", K), self.key_multiplier),
                           grad_v=self._unpack(g_v, "k", K))
        return tensors

    def finish(self, result: Any, grads: Any = None) -> dict[str, np.ndarray]:
        """:meth:`outputs` of what the entry point returned: ``out``, ``(out, softmax_lse)``
        (kvcache) or ``(out, softmax_lse, S_dmask)`` (func, varlen with
        ``return_attn_probs=True``)."""
        if isinstance(result, tuple):
            return self.outputs(result[0], result[1], grads)
        return self.outputs(result, None, grads)

    def torch_arguments(self, *, device: Any = "cuda", dtype: Any = None) -> tuple[Any, dict]:
        """``(args, kwargs)`` as torch tensors on ``device`` (floats in ``dtype``, default
        the run's; cu_seqlens and cache_seqlens int32; alibi_slopes float32), for the real
        kernels."""
        import torch

        def conv(x: Any, name: str = "") -> Any:
            if not isinstance(x, np.ndarray):
                return x
            t = torch.from_numpy(np.ascontiguousarray(x)).to(device)
            if dtype is not None and x.dtype.kind == "f" and name != "alibi_slopes":
                t = t.to(dtype)
            return t

        return (tuple(conv(a) for a in self.args),
                {k: conv(v, k) for k, v in self.kwargs.items()})


def _np(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def _scaled(g: np.ndarray, m: float) -> np.ndarray:  # d/dx f(m x) = m f'(m x)
    return g if m == 1.0 else (g.astype(np.float64) * m).astype(g.dtype)


@public
def flash_call(spec: CaseSpec, variant: str = "flash_attn", *, dtype: Any = "float64"
               ) -> FlashCall:
    """The FlashAttention call of ``spec`` (``variant``: ``flash_attn``,
    ``flash_attn_varlen`` or ``flash_attn_kvcache``) in ``dtype`` (see :class:`FlashCall`).

    Raises
    ------
    RefAttnError
        When the entry point cannot express the case, naming why (:func:`ineligible`).

    Examples
    --------
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites.conformance import CASES
    >>> c = flash_call(case_spec(CASES["causal_lower_right_q3_k7"]()))
    >>> c.function, [x.shape for x in c.args], c.kwargs["causal"], c.kwargs["window_size"]
    ('flash_attn_func', [(1, 3, 2, 4), (1, 7, 2, 4), (1, 7, 2, 4)], True, (-1, -1))
    >>> c = flash_call(case_spec(CASES["key_padding_lengths_7_5_2"]()), "flash_attn_varlen")
    >>> c.args[3].tolist(), c.args[4].tolist(), c.args[5:]
    ([0, 4, 8, 12], [0, 7, 12, 14], (4, 7))
    """
    if variant == "flash_attn_kvcache" and spec.conventions.get("kv_layout") == KV_LAYOUT:
        return _append_call(spec, dtype)
    plan = _plan(spec, variant)
    if isinstance(plan, str):
        raise RefAttnError(f"{spec.case_id}: {FUNCTIONS.get(variant, variant)} cannot express "
                           f"this case: {plan}")
    precision = precision_name(resolve_dtype(dtype))
    np_dtype = resolve_dtype(precision)
    t = spec.tensors
    mult = operand_multipliers(spec.scale, spec.scale_placement)

    def btnh(x: Any, m: float = 1.0) -> np.ndarray:  # (B, H, T, D) -> (B, T, H, D)
        x = np.asarray(x, np.float64)
        x = x if m == 1.0 else x * m
        return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).astype(np_dtype)

    q, k, v = btnh(t["q"], mult.query), btnh(t["k"], mult.key), btnh(t["v"])
    # refattn zeroes the output rows it leaves unused: they carry no cotangent
    g_o = btnh(np.where(spec.query_valid_full(), t["grad_output"], 0.0))
    causal = plan.window == (-1, 0)
    common: dict[str, Any] = {
        "softmax_scale": None if spec.scale_is_default and spec.scale_placement == "post"
        else float(mult.post),
        "causal": causal,
        "window_size": (-1, -1) if causal else plan.window,
        "softcap": 0.0 if spec.softcap is None else float(spec.softcap),
        "alibi_slopes": None if plan.alibi is None else plan.alibi.astype(np.float32),
    }
    seqs = plan.sequences
    function = FUNCTIONS[variant]
    notes: tuple[str, ...] = ()
    if variant == "flash_attn":
        args: tuple[Any, ...] = (q, k, v)
        kwargs = {"dropout_p": 0.0, **common, "deterministic": False,
                  "return_attn_probs": True}
    elif variant == "flash_attn_varlen":
        qb = np.concatenate([np.full(s[2] - s[1], s[0]) for s in seqs]).astype(np.int64)
        qr = np.concatenate([np.arange(s[1], s[2]) for s in seqs]).astype(np.int64)
        kb = np.concatenate([np.full(s[4] - s[3], s[0]) for s in seqs]).astype(np.int64)
        kr = np.concatenate([np.arange(s[3], s[4]) for s in seqs]).astype(np.int64)
        lq = [s[2] - s[1] for s in seqs]
        lk = [s[4] - s[3] for s in seqs]
        cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
        args = (q[qb, qr], k[kb, kr], v[kb, kr], cu_q, cu_k, int(max(lq)), int(max(lk)))
        g_o = g_o[qb, qr]
        kwargs = {"dropout_p": 0.0, **common, "deterministic": False,
                  "return_attn_probs": True}
    else:
        args = (q, k, v)
        kwargs = {"cache_seqlens": np.array([s[4] for s in seqs], np.int32), **common,
                  "return_softmax_lse": True}
        if _paged(spec):  # the pages and block table as stored: FlashAttention's layout
            def pages(x: Any, m: float = 1.0) -> np.ndarray:
                x = np.asarray(x, np.float64)
                return np.ascontiguousarray(x if m == 1.0 else x * m).astype(np_dtype)

            table = np.asarray(t["block_table"])
            if table.size and (table.min() < np.iinfo(np.int32).min
                               or table.max() > np.iinfo(np.int32).max):
                raise RefAttnError(f"{spec.case_id}: block_table: entries beyond int32 "
                                   "(FlashAttention's block_table is torch.int32)")
            args = (q, pages(t["k_pages"], mult.key), pages(t["v_pages"]))
            kwargs = {**kwargs, "block_table": table.astype(np.int32)}
            note = page_size_note(int(args[1].shape[1]))
            notes = () if note is None else (note,)
    return FlashCall(function, args, kwargs, seqs, np.ascontiguousarray(g_o),
                     np.ascontiguousarray(spec.query_valid_full()), precision,
                     spec.score_shape, float(mult.query), float(mult.key), notes)


def _append_call(spec: CaseSpec, dtype: Any) -> FlashCall:
    """A ``kvcache_append`` case lowered to ``flash_attn_with_kvcache`` with its inputs as
    given: q before rotation, the caches before the append, ``k``/``v``, the rotary tables,
    ``cache_seqlens``, ``cache_leftpad``, ``cache_batch_idx``, ``block_table`` and the
    ``causal`` / ``window_size`` the case records (``kvcache_causal``, ``kvcache_window``)."""
    layout = spec.input_layout()
    conv = spec.conventions
    precision = precision_name(resolve_dtype(dtype))
    np_dtype = resolve_dtype(precision)
    if spec.scale_placement != "post" or spec.softcap is not None:
        raise RefAttnError(f"{spec.case_id}: flash_attn_with_kvcache cannot express this "
                           "case: the scale applied after the product, no softcap")
    causal = conv.get("kvcache_causal")
    window = conv.get("kvcache_window")
    if not isinstance(causal, bool) or not (window == "none" or (
            isinstance(window, list) and len(window) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) for w in window))):
        raise RefAttnError(f"{spec.case_id}: conventions kvcache_causal / kvcache_window: "
                           f"expected a bool and 'none' or [left, right], got {causal!r}, "
                           f"{window!r}")

    def cast(x: Any) -> Any:
        return None if x is None else np.ascontiguousarray(x).astype(np_dtype)

    def int32(x: Any) -> Any:
        return None if x is None else np.asarray(x).astype(np.int32)

    kwargs: dict[str, Any] = {
        "rotary_cos": cast(layout.rotary_cos), "rotary_sin": cast(layout.rotary_sin),
        "cache_seqlens": int32(layout.cache_seqlens),
        "cache_batch_idx": int32(layout.cache_batch_idx),
        "cache_leftpad": int32(layout.cache_leftpad), "block_table": int32(layout.block_table),
        "softmax_scale": None if spec.scale_is_default else float(spec.scale),
        "causal": causal, "window_size": (-1, -1) if window == "none" else tuple(window),
        "rotary_interleaved": bool(layout.rotary_interleaved), "return_softmax_lse": True}
    args = (cast(layout.q), cast(layout.k_cache), cast(layout.v_cache), cast(layout.k),
            cast(layout.v))
    g_o = np.where(spec.query_valid_full(), spec.tensors["grad_output"], 0.0)
    B, Q = layout.q.shape[:2]
    seqs = [(b, 0, Q, 0, 0) for b in range(B)]
    return FlashCall("flash_attn_with_kvcache", args, kwargs, seqs,
                     np.ascontiguousarray(g_o.transpose(0, 2, 1, 3)).astype(np_dtype),
                     np.ascontiguousarray(spec.query_valid_full()), precision,
                     spec.score_shape,
                     updated=("kvcache_k_cache_updated", "kvcache_v_cache_updated"))


# -- the interface as a reference: flash_attn_with_kvcache's arguments -> refattn's paged call --

_FA_LAYOUT = {"q": "(batch_size, seqlen, nheads, headdim)",
              "k_cache": "(num_blocks, page_block_size, nheads_k, headdim)",
              "v_cache": "(num_blocks, page_block_size, nheads_k, headdim)",
              "k": "(batch_size, seqlen_new, nheads_k, headdim)",
              "v": "(batch_size, seqlen_new, nheads_k, headdim)"}


def _fa_float64(name: str, x: Any, ndim: int = 4) -> np.ndarray:
    arr = as_array(name, x)
    if arr.dtype != np.float64:
        raise RefAttnError(f"{name}: expected dtype float64 (the reference computes in float64 "
                           f"and never casts; FlashAttention's kernels take float16/bfloat16), "
                           f"got {arr.dtype}")
    if arr.ndim != ndim:
        layout = _FA_LAYOUT.get(name, "(seqlen_ro, rotary_dim / 2)")
        raise RefAttnError(f"{name}: expected shape {layout}, got {list(arr.shape)}")
    return arr


def _fa_int32(name: str, x: Any, ndim: int, B: int, letters: str) -> np.ndarray:
    """An int32 array of ``ndim`` axes whose first is the batch, as given (the entries a call
    reads are bounded by :func:`refattn._checks.index_array`)."""
    arr = as_array(name, x)
    if arr.dtype != np.int32:
        raise RefAttnError(f"{name}: expected dtype int32 (flash_attn_with_kvcache's {name} is "
                           f"torch.int32), got {arr.dtype}")
    if arr.ndim != ndim or arr.shape[0] != B:
        raise RefAttnError(f"{name}: expected shape [batch_size={B}{letters}], got "
                           f"{list(arr.shape)}")
    return arr


@public
@dataclass(frozen=True, eq=False)
class KVCacheCall:
    """``flash_attn_with_kvcache``'s arguments as refattn's canonical call.

    Attributes
    ----------
    call : AttentionCall
        q ``(B, Hq, Q, D)`` (rotated when rotary tables are given); keys and values of the
        caches after the append, gathered through the block table (or row
        ``cache_batch_idx[b]``), ``(B, Hkv, K, D)`` with ``K`` the slots of the blocks the
        longest sequence reads, ``ceil(max_b seqlens[b] / page_block_size) *
        page_block_size`` (without a block table: ``max_b seqlens[b]``), never the table's
        declared width; ``seqlens = cache_seqlens + seqlen_new``; key t of sequence b is its
        token t; visibility the cache-layout relation (query i of sequence b at position
        ``seqlens[b] - Q + i``, keys ``cache_leftpad[b] <= t < seqlens[b]``); ALiBi as a
        bias, softcap and scale as given.
    paged : PagedKV or None
        The (updated) cache as read, with the gather and its inverse; sequences may share
        pages (a common prefix), as FlashAttention allows. None with ``cache_leftpad``.
    row_has_key : (B, Q) bool ndarray
        Whether query i of sequence b sees at least one key; FlashAttention writes a zero
        output row and lse +inf for one that does not (refattn zeroes it through
        ``query_valid``).
    append : KVCacheAppend
        The inputs as given (:class:`refattn.call.kvcache.KVCacheAppend`):
        ``append.updated_caches()`` are the caches FlashAttention leaves behind, and the
        object is the golden layout of the call.
    """

    call: AttentionCall
    paged: PagedKV | None
    row_has_key: np.ndarray
    append: KVCacheAppend

    def outputs(self, trace: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(out, softmax_lse)`` in FlashAttention's layouts from a forward of :attr:`call`:
        out ``(B, Q, Hq, Dv)``, softmax_lse ``(B, Hq, Q)`` (+inf on a row without a key)."""
        out = np.ascontiguousarray(trace.output.transpose(0, 2, 1, 3))  # (B, Q, Hq, Dv)
        lse = np.where(self.row_has_key[:, None, :], trace.lse, np.inf)  # (B, Hq, Q)
        return out, lse


@public
def kvcache_call(q: Any, k_cache: Any, v_cache: Any, *, k: Any = None, v: Any = None,
                 rotary_cos: Any = None, rotary_sin: Any = None, cache_seqlens: Any = None,
                 cache_batch_idx: Any = None, cache_leftpad: Any = None,
                 block_table: Any = None, softmax_scale: float | None = None,
                 causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                 softcap: float = 0.0, rotary_interleaved: bool = True,
                 alibi_slopes: Any = None) -> KVCacheCall:
    """The canonical call of one ``flash_attn_with_kvcache`` call, with FlashAttention's
    semantics (appends, rotary embeddings, left padding and cache_batch_idx included).

    Parameters
    ----------
    q : (B, Q, Hq, D) float64 ndarray
        The Q newest tokens of each sequence (FlashAttention's ``(batch_size, seqlen,
        nheads, headdim)``), before any rotation.
    k_cache, v_cache : (num_blocks, page_block_size, Hkv, D) float64 ndarray
        With ``block_table``; without it ``(batch_size_cache, seqlen_cache, Hkv, D)``, read
        as one page per sequence (sequence b reads row b, or ``cache_batch_idx[b]``). Any
        page size: FlashAttention 2's kernels need a multiple of 256, FlashAttention 3's do
        not. Never changed: the appended caches are ``.append.updated_caches()``.
    k, v : (B, seqlen_new, Hkv, D) float64 ndarray, optional
        Appended at cache rows ``cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1``
        (k after rotation); the call reads the caches after the append.
    rotary_cos, rotary_sin : (seqlen_ro, rotary_dim / 2) float64 ndarray, optional
        Only with k and v: k rotated at its cache rows, q at ``cache_seqlens[b] + i`` when
        causal or local (a window bound in ``[0, seqlen_k)``, seqlen_k the cache's declared
        length, as ``mha_fwd_kvcache`` resets larger ones), else all at
        ``cache_seqlens[b]``; every such position must lie in the table.
    cache_seqlens : int or (B,) int32 ndarray, optional
        Tokens in each sequence's cache before the append, ``cache_seqlens[b] + seqlen_new
        <= capacity`` (``max_num_blocks_per_seq * page_block_size``, or ``seqlen_cache``) and
        ``>= 1`` without an append; default: the whole table. An int may be a numpy integer
        scalar.
    cache_batch_idx : (B,) int32 ndarray, optional
        Distinct rows of a non-paged cache.
    cache_leftpad : (B,) int32 ndarray, optional
        Keys before ``cache_leftpad[b] <= cache_seqlens[b]`` are invisible (non-paged).
    block_table : (B, max_num_blocks_per_seq) int32 ndarray, optional
        Block p of sequence b is page ``block_table[b, p]``; entries past a sequence's last
        block are not read (-1 padding is fine), and the memory the call needs depends on
        the blocks read, not on the table's width.
    softmax_scale : float, optional
        Default ``1 / sqrt(D)``; otherwise positive and finite.
    causal : bool
        Keys up to the query's position (bottom-right aligned); right window bound 0.
    window_size : (int, int)
        ``(left, right)``: keys in ``[pos - left, pos + right]``; negative means unbounded,
        and so does a bound at or beyond every distance in the call (``>= K + Q``); each an
        integer in ``[-2**63, 2**63 - 1]``.
    softcap : float
        ``> 0``: scores become ``softcap * tanh(score / softcap)`` (``<= 0``: off); finite.
    rotary_interleaved : bool
        True (FlashAttention's default): GPT-J pairs ``(2i, 2i + 1)``; False: GPT-NeoX pairs
        ``(i, i + rotary_dim / 2)``.
    alibi_slopes : (Hq,) or (B, Hq) float32 or float64 ndarray, optional
        Adds ``-slope * |pos - j|`` to the score of key j; finite, within float32's range.

    Returns
    -------
    KVCacheCall

    Raises
    ------
    RefAttnError
        On a dtype other than float64 (q, caches, k, v, rotary tables) or int32
        (block_table, cache_seqlens, cache_leftpad, cache_batch_idx), a shape that does not
        match FlashAttention's layout, a block-table entry outside ``[0, num_blocks)`` among
        the blocks a sequence reads (naming ``block_table[b, p]``), ``cache_seqlens[b]``
        beyond the table (or below 1 without an append), an append past the cache's
        capacity, a rotary position past the table's rows, a leftpad beyond
        ``cache_seqlens[b]``, a ``cache_batch_idx`` out of range or duplicated, a scalar
        argument that is not a number of its kind or lies outside its range (naming it and
        the range), or a call whose keys, values and ALiBi bias would need more memory than
        is available (refused before anything is gathered).

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> pages = rng.standard_normal((3, 2, 1, 4))             # 3 pages of 2 slots, Hkv=1, D=4
    >>> kv = kvcache_call(rng.standard_normal((1, 1, 2, 4)), pages, pages, causal=True,
    ...                   block_table=np.array([[2, 0]], np.int32),
    ...                   cache_seqlens=np.array([3], np.int32))
    >>> kv.call.axes["K"], kv.call.relation.q_pos.tolist(), kv.row_has_key.tolist()
    (4, [[2]], [[True]])
    """
    qa = _fa_float64("q", q)
    kc, vc = _fa_float64("k_cache", k_cache), _fa_float64("v_cache", v_cache)
    B, Q, Hq, D = qa.shape
    nb, ps, Hkv, Dk = kc.shape
    if Dk != D:
        raise RefAttnError(f"k_cache: headdim {Dk} must equal q's headdim {D}")
    if vc.shape[:3] != kc.shape[:3]:
        raise RefAttnError(f"v_cache: shape {list(vc.shape)} must match k_cache "
                           f"{list(kc.shape)} on (num_blocks, page_block_size, nheads_k)")
    if Hkv == 0 or Hq % Hkv:
        raise RefAttnError(f"q: nheads={Hq} must be a multiple of k_cache's nheads_k={Hkv} "
                           "(FlashAttention's GQA: query head h reads kv head h // (Hq // Hkv))")
    if not isinstance(causal, (bool, np.bool_)):
        raise RefAttnError(f"causal: expected True or False, got {causal!r}")
    if not isinstance(rotary_interleaved, (bool, np.bool_)):
        raise RefAttnError(f"rotary_interleaved: expected True or False, got "
                           f"{rotary_interleaved!r}")
    # every scalar bounded before any arithmetic uses it
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(
            window_size) != 2:
        raise RefAttnError(f"window_size: expected (left, right) ints (-1: unbounded), "
                           f"got {window_size!r}")
    w_left, w_right = (bounded_int(f"window_size[{i}]", w, lo=INT64_MIN, hi=INT64_MAX)
                       for i, w in enumerate(window_size))
    cap = bounded_float("softcap", softcap)  # <= 0: off
    scale = None if softmax_scale is None else bounded_float(
        "softmax_scale", softmax_scale, lo=0.0, lo_open=True)
    ka = va = None
    if (k is None) != (v is None):
        raise RefAttnError("k, v: pass both (the new keys and values) or neither")
    new = 0
    if k is not None:
        ka, va = _fa_float64("k", k), _fa_float64("v", v)
        new = ka.shape[1]
    cos = sin = None
    if rotary_cos is not None or rotary_sin is not None:
        if rotary_cos is None or rotary_sin is None:
            raise RefAttnError("rotary_cos, rotary_sin: pass both or neither")
        cos, sin = _fa_float64("rotary_cos", rotary_cos, 2), _fa_float64("rotary_sin",
                                                                         rotary_sin, 2)
    leftpad = None if cache_leftpad is None else _fa_int32("cache_leftpad", cache_leftpad, 1,
                                                           B, "")
    batch_idx = None if cache_batch_idx is None else _fa_int32("cache_batch_idx",
                                                               cache_batch_idx, 1, B, "")
    if block_table is None:
        if batch_idx is None and nb < B:
            raise RefAttnError(f"k_cache: batch_size_cache={nb} holds fewer caches than q's "
                               f"batch_size={B} (without a block_table sequence b reads row b)")
        given = None
        columns = 1
    else:
        given = _fa_int32("block_table", block_table, 2, B, ", max_num_blocks_per_seq")
        columns = given.shape[1]
        if columns == 0:
            raise RefAttnError("block_table: expected at least one block per sequence, got "
                               f"shape {list(given.shape)}")
    capacity = columns * ps
    lo = 0 if new else 1
    seqlens_range = (f"{lo} <= cache_seqlens[b] <= max_num_blocks_per_seq * page_block_size = "
                     f"{columns} * {ps} = {capacity}")
    if cache_seqlens is None:
        lens = np.full(B, capacity, dtype=np.int64)
    elif isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        lens = np.full(B, bounded_int("cache_seqlens", cache_seqlens, lo=lo, hi=capacity),
                       dtype=np.int64)
    else:
        lens = index_array("cache_seqlens", _fa_int32("cache_seqlens", cache_seqlens, 1, B, ""),
                           lo=lo, hi=capacity, letters="b", expected=seqlens_range)
    total = lens + new  # over the capacity: refused by KVCacheAppend, naming the append
    # everything from here on is sized from the tokens actually read, never from the table's
    # declared width: sequence b reads its first ceil(seqlens[b] / page_block_size) blocks
    if given is not None and int(total.max()) <= capacity:
        read = int(-(-int(total.max()) // ps))
        used = np.arange(read)[None, :] < -(-total // ps)[:, None]  # (B, read)
        index_array("block_table", given[:, :read], lo=0, hi=nb - 1, used=used, letters="bp",
                    expected=f"a block in [0, num_blocks={nb}) of k_cache (sequence b reads "
                             "its first ceil(cache_seqlens[b] / page_block_size) blocks)")
    # FlashAttention's mha_fwd_kvcache: bounds at or past seqlen_k are unbounded; q is rotated
    # token by token when causal or local
    local = 0 <= w_left < capacity or 0 <= w_right < capacity
    layout = KVCacheAppend(qa, kc, vc, lens, ka, va, cos, sin, bool(rotary_interleaved),
                           leftpad, batch_idx, given, bool(causal) or local)
    K = int(-(-int(total.max()) // ps) * ps) if given is not None else int(total.max())
    # a window bound at or beyond every distance |position - key| < K + Q is no bound
    span = K + Q
    left = None if w_left < 0 or w_left >= span else w_left
    right = 0 if causal else (None if w_right < 0 or w_right >= span else w_right)
    # query i of sequence b sits at position seqlens[b] - Q + i (bottom-right aligned)
    pos = total[:, None] - Q + np.arange(Q)[None, :]  # (B, Q)
    first = np.zeros((B, 1), np.int64) if layout.cache_leftpad is None else \
        layout.cache_leftpad[:, None]
    lo_key = first if left is None else np.maximum(pos - left, first)
    hi_key = total[:, None] - 1 if right is None else np.minimum(pos + right,
                                                                 total[:, None] - 1)
    row_has_key = lo_key <= hi_key  # (B, Q): the documented window, intersected with the cache
    kwargs: dict[str, Any] = {}
    if not row_has_key.all():  # FlashAttention: "the output will be zero"
        kwargs = {"query_valid": row_has_key[:, None, :, None],
                  "all_masked_rows": "sanitize_then_zero_invalid_query"}
    bias_bytes = 0 if alibi_slopes is None else 8 * B * Q * K * (1 + 3 * Hq)
    check_bytes(gather_bytes(B, K, Hkv, D, D) + 2 * qa.nbytes + bias_bytes,
                f"flash_attn_with_kvcache over (batch_size, nheads_k, tokens read) = "
                f"({B}, {Hkv}, {K})", READ_LESS)
    if alibi_slopes is not None:
        slopes = as_array("alibi_slopes", alibi_slopes)
        if slopes.dtype not in (np.float32, np.float64):
            raise RefAttnError(f"alibi_slopes: expected dtype float32 (FlashAttention's) or "
                               f"float64, got {slopes.dtype}")
        if slopes.shape not in ((Hq,), (B, Hq)):
            raise RefAttnError(f"alibi_slopes: expected shape [nheads={Hq}] or "
                               f"[batch_size={B}, nheads={Hq}], got {list(slopes.shape)}")
        slopes = slopes.astype(np.float64)  # exact widening
        check_finite("alibi_slopes", slopes)
        big = first_index(np.abs(slopes) > _FP32_MAX)
        if big is not None:  # |slope| * distance stays finite: distances are below 2**63
            raise RefAttnError(f"alibi_slopes: entry {format_index(big)} is "
                               f"{float(slopes[big])!r}, beyond float32's range (FlashAttention's "
                               f"slopes are fp32: |slope| <= {_FP32_MAX!r})")
        slopes = np.broadcast_to(slopes, (B, Hq))
        dist = np.abs(pos[:, :, None] - np.arange(K)[None, None, :])  # (B, Q, K)
        kwargs["bias"] = -slopes[:, :, None, None] * dist[:, None]  # (B, Hq, Q, K)
    window: tuple[int | None, int | None] | None
    if causal:  # the causal relation bounds the right side
        window = None if left is None else (left, None)
    else:
        window = None if left is None and right is None else (left, right)
    call, paged = layout.canonical(causal=bool(causal), window=window, scale=scale,
                                   softcap=cap if cap > 0 else None, **kwargs)
    return KVCacheCall(call, paged, row_has_key, layout)


@public
def flash_attn_with_kvcache(q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None,
                            rotary_cos: Any = None, rotary_sin: Any = None,
                            cache_seqlens: Any = None, cache_batch_idx: Any = None,
                            cache_leftpad: Any = None, block_table: Any = None,
                            softmax_scale: float | None = None, causal: bool = False,
                            window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, alibi_slopes: Any = None,
                            num_splits: int = 0, return_softmax_lse: bool = False,
                            *, return_updated_cache: bool = False) -> Any:
    """FlashAttention's ``flash_attn_with_kvcache``, computed by refattn in float64.

    The signature of ``flash_attn/flash_attn_interface.py`` (Dao-AILab/flash-attention), so
    that a test can call it where it calls the kernel; the arguments are lowered by
    :func:`kvcache_call` (appends, rotary embeddings, ``cache_leftpad`` and
    ``cache_batch_idx`` with FlashAttention's semantics) and run by the reference forward.
    ``num_splits`` changes nothing here. FlashAttention writes ``k`` / ``v`` into
    ``k_cache`` / ``v_cache`` in place; refattn never changes its arguments and returns the
    updated caches as new arrays with ``return_updated_cache=True``, so that a test compares
    the kernel's in-place-updated caches with them.

    Returns
    -------
    out : (B, Q, Hq, Dv) float64 ndarray
    softmax_lse : (B, Hq, Q) float64 ndarray
        Only with ``return_softmax_lse=True``: the logsumexp of each row's scores (+inf on a
        row without a key).
    k_cache, v_cache : float64 ndarray
        Only with ``return_updated_cache=True`` (keyword only, refattn's): the caches after
        the append, in the layout given (copies of the given ones without ``k``). The result
        is then ``(out, [softmax_lse,] k_cache, v_cache)``.

    Examples
    --------
    >>> pages = np.arange(24.0).reshape(3, 2, 1, 4) / 24
    >>> out, lse = flash_attn_with_kvcache(np.ones((1, 1, 1, 4)), pages, pages,
    ...                                    cache_seqlens=np.array([1], np.int32),
    ...                                    block_table=np.array([[2, 0]], np.int32),
    ...                                    return_softmax_lse=True)
    >>> out[0, 0, 0].tolist() == pages[2, 0, 0].tolist(), lse.shape  # one key: its value
    (True, (1, 1, 1))
    >>> new = np.full((1, 1, 1, 4), 9.0)                             # append one token
    >>> out, kc, vc = flash_attn_with_kvcache(np.ones((1, 1, 1, 4)), pages, pages, new, new,
    ...                                       cache_seqlens=np.array([1], np.int32),
    ...                                       block_table=np.array([[2, 0]], np.int32),
    ...                                       return_updated_cache=True)
    >>> kc[2, 1, 0].tolist(), pages[2, 1, 0].tolist() != [9.0] * 4    # the copy, not pages
    ([9.0, 9.0, 9.0, 9.0], True)
    """
    bounded_int("num_splits", num_splits, lo=0, hi=INT64_MAX)
    kv = kvcache_call(q, k_cache, v_cache, k=k, v=v, rotary_cos=rotary_cos,
                      rotary_sin=rotary_sin, cache_seqlens=cache_seqlens,
                      cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                      block_table=block_table, softmax_scale=softmax_scale, causal=causal,
                      window_size=window_size, softcap=softcap,
                      rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes)
    out, lse = kv.outputs(forward(kv.call))
    result: tuple[Any, ...] = (out, lse) if return_softmax_lse else (out,)
    if return_updated_cache:
        result = (*result, *kv.append.updated_caches())
    return result if len(result) > 1 else out
