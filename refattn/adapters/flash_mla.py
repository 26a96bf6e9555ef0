"""FlashMLA lowering: MLA decode calls in FlashMLA's interface, both directions.

Owns :func:`flash_mla_with_kvcache` and :func:`get_mla_metadata` (FlashMLA's signature,
computed by refattn in float64 through :func:`refattn.call.mla.paged_mla_call`),
:class:`FlashMlaCall`, :func:`to_flash_mla` (``case.to_flash_mla()``: a golden case as the
exact arguments a user passes to ``flash_mla_with_kvcache``) and :func:`ineligible` (why
FlashMLA cannot express a case). NumPy only: nothing here imports torch or flash_mla.

The interface, as read in deepseek-ai/FlashMLA (commit
9241ae3ef9bac614dd25e45e507e089f888280e0, ``flash_mla/flash_mla_interface.py``; the first
version, 414a2f3, had the same positional arguments):

- ``get_mla_metadata(*args, **kwargs) -> (FlashMLASchedMeta, None)`` (an empty scheduler
  object, filled on the first call; the first version took ``(cache_seqlens,
  num_heads_per_head_k, num_heads_k)`` and returned ``(tile_scheduler_metadata,
  num_splits)`` int32 tensors);
- ``flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v,
  tile_scheduler_metadata, num_splits=None, softmax_scale=None, causal=False,
  is_fp8_kvcache=False, indices=None, attn_sink=None, extra_k_cache=None,
  extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None)``: q
  ``(batch_size, seq_len_q, num_heads_q, head_dim)``, k_cache ``(num_blocks,
  page_block_size, num_heads_k, head_dim)`` whose first ``head_dim_v`` columns are V
  (DeepSeek V3: head_dim 576, head_dim_v 512), block_table ``(batch_size,
  max_num_blocks_per_seq)`` int32, cache_seqlens ``(batch_size,)`` int32; softmax_scale
  "Default to 1 / sqrt(head_dim_k)" (``q.shape[-1] ** -0.5``); returns ``out (batch_size,
  seq_len_q, num_heads_q, head_dim_v)`` and ``softmax_lse (batch_size, num_heads_q,
  seq_len_q)`` float32.

Semantics from ``tests/test_flash_mla_dense_decoding.py`` (``reference_torch`` and its
``scaled_dot_product_attention``): sequence b reads the first ``cache_seqlens[b]`` tokens of
its blocks; with ``causal`` and ``s_q > 1`` the mask is ``tril(diagonal=s_k - s_q)``
(query i reads keys ``j <= i + s_k - s_q``: bottom-right aligned); the lse is
``torch.logsumexp`` (natural log) of the scaled scores; a query with no key (a zero-length
cache, ``have_zero_seqlen_k``) gets output 0 and lse ``+inf``; NaN in slots no sequence reads
are ignored (``kv[kv != kv] = 0.0``). Its cases: h_q 1..128, h_kv 1..8, d 576, dv 512, page
64, s_q 1, 2, 4, varlen; outputs compared with a cosine-similarity bound (5e-6 at this
commit; 1e-5 in earlier versions).

Sparse decoding (``indices``, FP8 caches, ``attn_sink``, the ``extra_*`` caches,
``topk_length``) is refused here with a message naming the argument.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from refattn._boundary import public
from refattn._checks import (
    as_array,
    bounded_float,
    first_index,
    format_index,
    index_array,
)
from refattn._memory import check_bytes
from refattn.adapters import semantic_limits
from refattn.bundle.comparison.tolerances import precision_name, resolve_dtype
from refattn.bundle.golden.spec import CaseSpec
from refattn.call.mla import KV_LAYOUT, MlaCall, paged_mla_call
from refattn.call.paged import READ_LESS
from refattn.engine import forward
from refattn.errors import RefAttnError

__all__ = ["PAGE_BLOCK_SIZE", "UNSUPPORTED", "FlashMlaCall", "MlaSchedMeta",
           "flash_mla_call", "flash_mla_with_kvcache", "get_mla_metadata", "ineligible",
           "to_flash_mla"]

#: FlashMLA's page size (``block_size = 64`` in its tests; the kernels' only one)
PAGE_BLOCK_SIZE = 64

#: arguments of ``flash_mla_with_kvcache`` refused here, and why
UNSUPPORTED = {
    "indices": "sparse decoding (indices=) is not supported by this reference yet "
               "(index-list sparsity is refattn.sparse's); pass indices=None",
    "is_fp8_kvcache": "an FP8 cache is not float64: dequantise it and pass is_fp8_kvcache=False",
    "attn_sink": "attn_sink (sparse decoding's sink, which leaves the lse unchanged) is not "
                 "supported here; pass attn_sink=None",
    "extra_k_cache": "extra caches belong to sparse decoding; pass extra_k_cache=None",
    "extra_indices_in_kvcache": "extra caches belong to sparse decoding; pass None",
    "topk_length": "topk_length belongs to sparse decoding; pass topk_length=None",
    "extra_topk_length": "extra_topk_length belongs to sparse decoding; pass None",
}


@public
@dataclass
class MlaSchedMeta:
    """Stands in for FlashMLA's ``FlashMLASchedMeta``: the reference does not split the
    cache, so it holds nothing and is never read."""

    config: Any = None
    notes: tuple[str, ...] = field(default=("refattn: no tile scheduling",))


@public
def get_mla_metadata(*args: Any, **kwargs: Any) -> tuple[MlaSchedMeta, None]:
    """FlashMLA's ``get_mla_metadata``: any arguments (the first version's
    ``cache_seqlens, num_heads_per_head_k, num_heads_k`` too), ignored.

    Returns
    -------
    (MlaSchedMeta, None)
        As FlashMLA returns ``(FlashMLASchedMeta(), None)``.

    Examples
    --------
    >>> meta, splits = get_mla_metadata(np.array([4], np.int32), 128, 1)
    >>> type(meta).__name__, splits
    ('MlaSchedMeta', None)
    """
    return MlaSchedMeta(), None


def _float64(name: str, x: object) -> np.ndarray:
    arr = as_array(name, x)
    if arr.dtype != np.float64:
        raise RefAttnError(f"{name}: expected dtype float64 (the reference computes in float64; "
                           f"FlashMLA's bfloat16 / float16 tensors: pass them as float64), "
                           f"got {arr.dtype}")
    if arr.ndim != 4:
        raise RefAttnError(f"{name}: expected 4 axes, got shape {list(arr.shape)}")
    return arr


def _int32(name: str, x: object, ndim: int, B: int, letters: str) -> np.ndarray:
    if x is None:
        raise RefAttnError(f"{name}: required for dense decoding (FlashMLA: \"block_table and "
                           "cache_seqlens must be provided when dense attention is used\")")
    arr = as_array(name, x)
    if arr.dtype != np.int32:
        raise RefAttnError(f"{name}: expected dtype int32 (FlashMLA's {name} is torch.int32), "
                           f"got {arr.dtype}")
    if arr.ndim != ndim or arr.shape[0] != B:
        raise RefAttnError(f"{name}: expected shape [batch_size={B}{letters}], got "
                           f"{list(arr.shape)}")
    return arr


@public
def flash_mla_call(q: Any, k_cache: Any, block_table: Any, cache_seqlens: Any, head_dim_v: int,
                   softmax_scale: float | None = None, causal: bool = False) -> MlaCall:
    """The canonical call (:func:`refattn.call.mla.paged_mla_call`) of one dense
    ``flash_mla_with_kvcache`` call.

    Parameters
    ----------
    q : (B, s_q, h_q, d) float64 ndarray
    k_cache : (num_blocks, page_block_size, h_kv, d) float64 ndarray
        Slots that no sequence reads may hold anything, NaN included (FlashMLA's test fills
        them with NaN): they are set to 0 in a copy; the slots read must be finite.
    block_table : (B, max_num_blocks_per_seq) int32 ndarray
        Entries past a sequence's last block are not read.
    cache_seqlens : (B,) int32 ndarray
        ``0 <= cache_seqlens[b] <= max_num_blocks_per_seq * page_block_size``.
    head_dim_v : int
        ``1 <= head_dim_v <= d``: V is ``k_cache[..., :head_dim_v]``.
    softmax_scale : float, optional
        Default ``d ** -0.5``; otherwise positive and finite.
    causal : bool

    Returns
    -------
    MlaCall

    Raises
    ------
    RefAttnError
        On a dtype other than float64 (q, k_cache) or int32 (block_table, cache_seqlens),
        mismatched shapes, ``head_dim_v`` beyond d (naming k_cache's axis 3 and the limit),
        a block-table entry out of range among the blocks read, a sequence length out of
        range, a non-finite slot that a sequence reads (naming its index), or a call that
        would need more memory than is available.

    Examples
    --------
    >>> pages = np.arange(24.0).reshape(3, 2, 1, 4) / 24
    >>> m = flash_mla_call(np.ones((1, 1, 1, 4)), pages, np.array([[2, 0]], np.int32),
    ...                    np.array([3], np.int32), 2)
    >>> m.call.axes["K"], m.call.axes["Dv"]
    (4, 2)
    """
    qa, kc = _float64("q", q), _float64("k_cache", k_cache)
    B, _, Hq, D = qa.shape
    nb, ps, Hkv, Dk = kc.shape
    if Dk != D:
        raise RefAttnError(f"k_cache: head_dim {Dk} (axis 3) must equal q's head_dim {D}")
    if isinstance(head_dim_v, (bool, np.bool_)) or not isinstance(head_dim_v, (int, np.integer)):
        raise RefAttnError(f"head_dim_v: expected an integer, got {head_dim_v!r}")
    if not 1 <= int(head_dim_v) <= D:
        raise RefAttnError(
            f"head_dim_v: {int(head_dim_v)} is outside [1, {D}]: V is k_cache[..., :head_dim_v] "
            f"(k_cache {list(kc.shape)}, axis 3 has head_dim = {D} columns), so head_dim_v may "
            f"not exceed head_dim = {D}")
    if Hkv == 0 or Hq % Hkv:
        raise RefAttnError(f"q: num_heads_q={Hq} must be a multiple of k_cache's "
                           f"num_heads_k={Hkv}")
    if not isinstance(causal, (bool, np.bool_)):
        raise RefAttnError(f"causal: expected True or False, got {causal!r}")
    scale = None if softmax_scale is None else bounded_float(
        "softmax_scale", softmax_scale, lo=0.0, lo_open=True)
    table = _int32("block_table", block_table, 2, B, ", max_num_blocks_per_seq")
    if table.shape[1] == 0 or nb == 0:
        raise RefAttnError(f"block_table: expected at least one block per sequence and k_cache "
                           f"at least one block, got {list(table.shape)} and {list(kc.shape)}")
    capacity = table.shape[1] * ps
    lens = index_array("cache_seqlens", _int32("cache_seqlens", cache_seqlens, 1, B, ""),
                       lo=0, hi=capacity, letters="b",
                       expected=f"0 <= cache_seqlens[b] <= max_num_blocks_per_seq * "
                                f"page_block_size = {table.shape[1]} * {ps} = {capacity}")
    used = np.arange(table.shape[1])[None, :] < -(-lens // ps)[:, None]  # (B, columns)
    checked = index_array(
        "block_table", table, lo=0, hi=nb - 1, used=used, letters="bp",
        expected=f"a block in [0, num_blocks={nb}) of k_cache (sequence b reads its first "
                 "ceil(cache_seqlens[b] / page_block_size) blocks)")
    check_bytes(2 * kc.nbytes + 2 * qa.nbytes, "copying k_cache and q", READ_LESS)
    # the slots the sequences read must be finite; the others are zeroed in a copy
    referenced = np.zeros((nb, ps), bool)
    b_idx, t_idx = np.nonzero(np.arange(capacity)[None, :] < lens[:, None])
    referenced[checked[b_idx, t_idx // ps], t_idx % ps] = True
    bad = first_index(~np.isfinite(kc) & referenced[:, :, None, None])
    if bad is not None:
        raise RefAttnError(f"k_cache: entry {format_index(bad)} is {float(kc[bad])!r}, in a slot "
                           "that a sequence reads (t < cache_seqlens[b]): expected a finite value")
    pages = np.where(referenced[:, :, None, None], kc, 0.0)
    return paged_mla_call(np.ascontiguousarray(qa.transpose(0, 2, 1, 3)), pages, checked, lens,
                          int(head_dim_v), ps, causal=bool(causal), shared_pages=True,
                          scale=scale)


@public
def flash_mla_with_kvcache(q: Any, k_cache: Any, block_table: Any, cache_seqlens: Any,
                           head_dim_v: int, tile_scheduler_metadata: Any = None,
                           num_splits: Any = None, softmax_scale: float | None = None,
                           causal: bool = False, is_fp8_kvcache: bool = False,
                           indices: Any = None, attn_sink: Any = None,
                           extra_k_cache: Any = None, extra_indices_in_kvcache: Any = None,
                           topk_length: Any = None, extra_topk_length: Any = None, *,
                           backend: str = "numba") -> tuple[np.ndarray, np.ndarray]:
    """FlashMLA's ``flash_mla_with_kvcache`` (dense decoding), computed by refattn in float64.

    The signature of ``flash_mla/flash_mla_interface.py`` (deepseek-ai/FlashMLA, 9241ae3);
    ``tile_scheduler_metadata`` and ``num_splits`` (from :func:`get_mla_metadata`, or from
    FlashMLA's) are accepted and ignored: the reference does not split the cache. The
    arguments are lowered by :func:`flash_mla_call`; ``backend`` (refattn's addition,
    keyword-only) runs the forward: ``"numba"`` (default: its streaming forward,
    ``materialize=False``: no ``(B, h_q, s_q, K)`` tensor is held) or ``"numpy"`` (the
    reference backend, dense). The sparse-decoding
    arguments of :data:`UNSUPPORTED` are refused.

    Returns
    -------
    out : (B, s_q, h_q, head_dim_v) float64 ndarray
        0 on a query without a key.
    softmax_lse : (B, h_q, s_q) float64 ndarray
        Natural-log logsumexp of each row's scaled scores; ``+inf`` on a query without a key
        (a zero-length cache, or with ``causal`` a query before the cache's first token).

    Examples
    --------
    >>> pages = np.arange(24.0).reshape(3, 2, 1, 4) / 24
    >>> meta, splits = get_mla_metadata()
    >>> out, lse = flash_mla_with_kvcache(np.ones((2, 1, 1, 4)), pages,
    ...                                   np.array([[2, 0], [1, -1]], np.int32),
    ...                                   np.array([1, 0], np.int32), 3, meta, splits,
    ...                                   backend="numpy")
    >>> out[0, 0, 0].tolist() == pages[2, 0, 0, :3].tolist(), out[1].tolist(), lse[1].tolist()
    (True, [[[0.0, 0.0, 0.0]]], [[inf]])
    """
    for name, value in (("indices", indices), ("attn_sink", attn_sink),
                        ("extra_k_cache", extra_k_cache),
                        ("extra_indices_in_kvcache", extra_indices_in_kvcache),
                        ("topk_length", topk_length), ("extra_topk_length", extra_topk_length)):
        if value is not None:
            raise RefAttnError(f"{name}: {UNSUPPORTED[name]}")
    if is_fp8_kvcache is not False:
        raise RefAttnError(f"is_fp8_kvcache: {UNSUPPORTED['is_fp8_kvcache']}")
    made = flash_mla_call(q, k_cache, block_table, cache_seqlens, head_dim_v,
                          softmax_scale=softmax_scale, causal=causal)
    # numba streams (no (B, h_q, s_q, K) tensor is held); the other backends run dense
    options = {"materialize": False} if backend == "numba" else {}
    return made.outputs(forward(made.call, backend=backend, **options))


# -- a golden case -> FlashMLA's arguments -------------------------------------------------


@public
@dataclass(frozen=True, eq=False)
class FlashMlaCall:
    """One case lowered to ``flash_mla_with_kvcache(*c.args, **c.kwargs)``.

    Attributes
    ----------
    args : tuple
        ``q (B, s_q, h_q, d)``, ``k_cache (num_blocks, 64, h_kv, d)`` (a paged MLA case's pages
        as stored; otherwise the case's keys cut into pages of 64), ``block_table (B,
        max_num_blocks_per_seq)`` int32, ``cache_seqlens (B,)`` int32, ``head_dim_v``,
        ``tile_scheduler_metadata`` and ``num_splits`` (:func:`get_mla_metadata`'s; pass
        FlashMLA's own to the real kernel). Floats in the run's dtype, rounded once.
    kwargs : dict
        ``softmax_scale`` (None where the case uses the default ``d ** -0.5``), ``causal``.
    row_has_key : (B, s_q) bool ndarray
    dtype : str
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    row_has_key: np.ndarray
    dtype: str

    def expected(self, spec: CaseSpec) -> tuple[np.ndarray, np.ndarray]:
        """The golden ``(out, softmax_lse)`` of ``spec`` in FlashMLA's layouts: out ``(B, s_q,
        h_q, dv)``, lse ``(B, h_q, s_q)`` (``+inf`` on a row without a key)."""
        out = np.ascontiguousarray(np.asarray(spec.tensors["output"]).transpose(0, 2, 1, 3))
        lse = np.where(self.row_has_key[:, None, :], spec.tensors["lse"], np.inf)
        return out, lse


def _cache(spec: CaseSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray] | str:
    """(k_cache, block_table, cache_seqlens) of a case, or why there is none."""
    t, conv = spec.tensors, spec.conventions
    B, _, _, K = spec.score_shape
    if conv.get("kv_layout") == KV_LAYOUT and conv.get("mla_form") == "paged":
        pages = np.asarray(t["kv_latent_pages"])
        if pages.shape[1] != PAGE_BLOCK_SIZE:
            return (f"page size {pages.shape[1]} (FlashMLA's kernels read pages of "
                    f"{PAGE_BLOCK_SIZE} tokens)")
        table = np.asarray(t["block_table"])
        if table.size and (table.min() < np.iinfo(np.int32).min
                           or table.max() > np.iinfo(np.int32).max):
            return "block_table entries beyond int32 (FlashMLA's block_table is int32)"
        return pages, table.astype(np.int32), np.asarray(t["seqlens"]).astype(np.int32)
    if conv.get("kv_layout") is not None and conv.get("kv_layout") != KV_LAYOUT:
        return f"kv_layout {conv.get('kv_layout')!r} (FlashMLA reads one latent cache)"
    keys = np.asarray(spec.tensors["k"])  # (B, Hkv, K, Dk)
    vis = spec.visible_full()
    valid = vis.any(axis=(1, 2))  # (B, K): keys some query reads
    lens = valid.sum(axis=1)
    if not (valid == (np.arange(K)[None, :] < lens[:, None])).all():
        return ("the keys some query reads are not a prefix of each sequence's keys "
                "(FlashMLA reads the first cache_seqlens[b] tokens)")
    blocks = -(-K // PAGE_BLOCK_SIZE)
    padded = np.zeros((B, blocks * PAGE_BLOCK_SIZE, *keys.shape[1:2], keys.shape[3]))
    padded[:, :K] = keys.transpose(0, 2, 1, 3)
    pages = padded.reshape(B * blocks, PAGE_BLOCK_SIZE, keys.shape[1], keys.shape[3])
    table = np.arange(B * blocks, dtype=np.int32).reshape(B, blocks)
    return pages, table, lens.astype(np.int32)


def _plan(spec: CaseSpec) -> dict[str, Any] | str:
    lim = semantic_limits(spec)
    for key, why in (("dropout", "dropout (FlashMLA has none)"),
                     ("softcap", "softcap (not a FlashMLA argument)"),
                     ("sink", "a sink logit (dense FlashMLA decoding has none)"),
                     ("bias", "a bias (not a FlashMLA argument)")):
        if lim[key]:
            return why
    if lim["family"] != "dot":
        return f"score family {lim['family']!r} (FlashMLA computes dot products)"
    if not lim["equal_qk_width"]:
        return "q and k widths differ (FlashMLA's q and k_cache share head_dim)"
    if not lim["grouped_heads"]:
        return "an explicit head map (FlashMLA groups query heads: h // (h_q // h_kv))"
    a = spec.axes
    _, _, Q, K = spec.score_shape
    Dk, Dv = a["Dk"], a["Dv"]
    if Dv > Dk:
        return f"Dv = {Dv} exceeds Dk = {Dk} (V is the first head_dim_v columns of k_cache)"
    k, v = np.asarray(spec.tensors["k"]), np.asarray(spec.tensors["v"])
    if not np.array_equal(v, k[..., :Dv]):
        return "V is not the first Dv columns of K (FlashMLA reads V from k_cache[..., :dv])"
    made = _cache(spec)
    if isinstance(made, str):
        return made
    pages, table, lens = made
    if (lens < 0).any() or (lens > K).any():
        return "cache_seqlens outside the case's keys"
    pos = lens[:, None] - Q + np.arange(Q)[None, :]  # (B, Q): bottom-right aligned
    keys = np.arange(K)[None, None, :]
    vis = np.asarray(spec.visible_full())
    causal = None
    for candidate in (False, True):
        want = keys < lens[:, None, None]
        if candidate:
            want = want & (keys <= pos[:, :, None])
        if (vis == want[:, None]).all():
            causal = candidate
            break
    if causal is None:
        return ("visibility is neither the first cache_seqlens[b] keys of each sequence nor "
                "that with FlashMLA's bottom-right causal mask")
    rows = vis.any(axis=(1, 3))  # (B, Q)
    qv = np.asarray(spec.query_valid_full())[:, 0, :, 0]
    if not (qv | ~rows).all():  # a row with keys that the case leaves unused
        idx = first_index(~qv & rows) or ()
        return (f"query_valid hides row {format_index(idx, 'bi')} although it reads keys "
                "(FlashMLA computes every row)")
    scale = None if spec.scale == Dk ** -0.5 else spec.scale
    return {"pages": pages, "table": table, "lens": lens, "causal": causal, "scale": scale,
            "rows": rows, "Dv": Dv}


@public
def ineligible(spec: CaseSpec) -> str | None:
    """Why ``flash_mla_with_kvcache`` cannot express ``spec`` exactly, or None when it can.

    Examples
    --------
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites.conformance import CASES
    >>> ineligible(case_spec(CASES["causal_square"]()))
    'V is not the first Dv columns of K (FlashMLA reads V from k_cache[..., :dv])'
    """
    plan = _plan(spec)
    return plan if isinstance(plan, str) else None


@public
def to_flash_mla(spec: CaseSpec, *, dtype: Any = "float64") -> FlashMlaCall:
    """The arguments of ``flash_mla_with_kvcache`` that compute ``spec``, in ``dtype``.

    ``flash_mla_with_kvcache(*c.args, **c.kwargs)`` returns ``(out, softmax_lse)`` to compare
    with ``c.expected(spec)``.

    Raises
    ------
    RefAttnError
        Naming why (:func:`ineligible`) when FlashMLA cannot express the case.

    Examples
    --------
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites.mla import build_case
    >>> spec = case_spec(build_case("mla_h16_sq2_causal_page64_tiny"), backend="numpy")
    >>> c = to_flash_mla(spec)
    >>> c.args[1].shape[1:], c.args[4], c.kwargs
    ((64, 1, 576), 512, {'softmax_scale': None, 'causal': True})
    """
    plan = _plan(spec)
    if isinstance(plan, str):
        raise RefAttnError(f"{spec.case_id}: flash_mla_with_kvcache cannot express this case: "
                           f"{plan}")
    precision = precision_name(resolve_dtype(dtype))
    np_dtype = resolve_dtype(precision)
    q = np.ascontiguousarray(np.asarray(spec.tensors["q"]).transpose(0, 2, 1, 3))
    meta, splits = get_mla_metadata()
    args = (q.astype(np_dtype), np.ascontiguousarray(plan["pages"]).astype(np_dtype),
            plan["table"], plan["lens"], int(plan["Dv"]), meta, splits)
    return FlashMlaCall(args, {"softmax_scale": plan["scale"], "causal": plan["causal"]},
                        plan["rows"], precision)
