"""One ``flash_attn_with_kvcache`` call with appends and rotary embeddings, as given.

Owns :class:`KVCacheAppend`: the inputs of one decode step exactly as FlashAttention's
``flash_attn_with_kvcache`` receives them (q, the caches' old contents, the new keys and
values ``k`` / ``v``, the rotary tables, ``cache_seqlens``, ``cache_leftpad``,
``cache_batch_idx``, ``block_table``); it builds the caches the kernel leaves behind (new
arrays: FlashAttention writes ``k_cache`` / ``v_cache`` in place, refattn never changes the
caller's arrays), the rotated q and appended keys, and the canonical
:class:`~refattn.AttentionCall` (through :func:`refattn.call.paged.paged_call` where there is
no left padding). It is also a golden *layout* (:mod:`refattn.bundle.golden.layouts`,
``kv_layout: kvcache_append``): its inputs as given, and the gradients of those inputs from
the canonical call's (q before rotation, the appended k through RoPE's backward, v, the
caches' old contents with the overwritten rows at zero gradient).

Semantics, as read in Dao-AILab/flash-attention (commit 0251105a2fb1):
``flash_attn/flash_attn_interface.py`` ``flash_attn_with_kvcache`` (k "rotated by rotary_cos
and rotary_sin at indices cache_seqlens, cache_seqlens + 1, etc."; q at the same indices "if
causal or local", else "all tokens in @q to be at position cache_seqlens"; rotary only "if k
and v are passed in"; ``cache_leftpad`` "the index that the KV cache starts"), the reference
of ``tests/test_flash_attn.py::test_flash_attn_kvcache`` (``k_cache_ref[update_mask] = k_ro``
at ``cache_seqlens <= arange < cache_seqlens + seqlen_new``; key padding mask ``arange <
cache_seqlens + seqlen_new`` and ``arange >= cache_leftpad``; ``k_cache[cache_batch_idx]``;
rotary ``seqlen_offsets=cache_seqlens``) and ``csrc/flash_attn/src/flash_fwd_kernel.h``
(``row_offset_cossin`` adds ``leftpad_k[bidb]`` back: the rotary positions are absolute cache
rows, ``block_info.h`` measures the mask's positions from the left pad, which changes no
key-query distance). Leftpad and batch_idx are refused with a paged cache, as
``mha_fwd_kvcache`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from refattn._boundary import public
from refattn._checks import (
    INT64_MAX,
    as_array,
    check_float64,
    float64_input,
    immutable_copy,
    index_array,
)
from refattn._memory import check_bytes
from refattn.call.gate import AttentionCall
from refattn.call.paged import PagedKV, paged_call
from refattn.errors import RefAttnError
from refattn.masks import relation
from refattn.rope import LAYOUTS, apply, apply_backward, check_positions

__all__ = ["KV_LAYOUT", "TENSOR_NAMES", "KVCacheAppend"]

#: the golden ``kv_layout`` name of this layout
KV_LAYOUT = "kvcache_append"
#: golden name -> attribute of :class:`KVCacheAppend` (inputs as given, optional ones last)
TENSOR_NAMES = {"kvcache_q": "q", "kvcache_k_cache": "k_cache", "kvcache_v_cache": "v_cache",
                "kvcache_cache_seqlens": "cache_seqlens", "kvcache_k": "k", "kvcache_v": "v",
                "kvcache_rotary_cos": "rotary_cos", "kvcache_rotary_sin": "rotary_sin",
                "kvcache_cache_leftpad": "cache_leftpad",
                "kvcache_cache_batch_idx": "cache_batch_idx",
                "kvcache_block_table": "block_table"}


def _float(name: str, x: Any, ndim: int) -> np.ndarray:
    return immutable_copy(float64_input(name, x, ndim))


def _ints(name: str, x: Any, B: int) -> np.ndarray:
    arr = as_array(name, x)
    if arr.dtype.kind not in "iu" or arr.shape != (B,):
        raise RefAttnError(f"{name}: expected an integer array of shape [batch_size={B}], got "
                           f"dtype {arr.dtype} shape {list(arr.shape)}")
    return arr


@public
@dataclass(frozen=True, eq=False)
class KVCacheAppend:
    """The inputs of one ``flash_attn_with_kvcache`` call as given, and what it computes.

    Attributes
    ----------
    q : (B, Q, Hq, D) float64 ndarray
        Before rotation.
    k_cache, v_cache : float64 ndarray
        The caches' contents before the call: ``(batch_size_cache, seqlen_cache, Hkv, D)``,
        or ``(num_blocks, page_block_size, Hkv, D)`` with a ``block_table``.
    cache_seqlens : (B,) integer ndarray
        Tokens in each cache before the append (with ``cache_leftpad``: the end index).
    k, v : (B, seqlen_new, Hkv, D) float64 ndarray, optional
        Appended at rows ``cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1``; both or
        neither.
    rotary_cos, rotary_sin : (seqlen_ro, rotary_dim / 2) float64 ndarray, optional
        Only with ``k``: k rotated at its rows, q at ``cache_seqlens[b] + i``
        (``rotate_q_per_token``) or all at ``cache_seqlens[b]``.
    rotary_interleaved : bool
        True: GPT-J pairs; False: GPT-NeoX pairs (:data:`refattn.rope.LAYOUTS`).
    cache_leftpad : (B,) integer ndarray, optional
        Keys before ``cache_leftpad[b]`` are invisible; ``0 <= cache_leftpad[b] <=
        cache_seqlens[b]``. Not with a block table.
    cache_batch_idx : (B,) integer ndarray, optional
        Sequence b reads (and appends to) cache row ``cache_batch_idx[b]``; distinct entries
        in ``[0, batch_size_cache)`` (a duplicate is a race of two in-place writes). Not with
        a block table.
    block_table : (B, max_num_blocks_per_seq) integer ndarray, optional
        A paged cache (:class:`refattn.call.paged.PagedKV`'s convention); kept as its
        columns some sequence reads, entries past a sequence's blocks set to -1.
    rotate_q_per_token : bool
        FlashAttention's ``causal or local``.

    Raises
    ------
    RefAttnError
        A non-float64 or non-finite tensor, mismatched shapes, an append past the cache's
        capacity (naming ``cache_seqlens[b]``, the append length and the capacity), a rotary
        position past the table (naming the tensor, the entry and the table's length), a
        leftpad beyond ``cache_seqlens[b]``, a ``cache_batch_idx`` out of range or
        duplicated, two appends to one page slot.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> kc = np.zeros((1, 4, 1, 2))
    >>> a = KVCacheAppend(rng.standard_normal((1, 1, 1, 2)), kc, kc, np.array([2]),
    ...                   k=np.ones((1, 1, 1, 2)), v=np.ones((1, 1, 1, 2)),
    ...                   rotary_cos=np.array([[1.0], [1.0], [0.0]]),
    ...                   rotary_sin=np.array([[0.0], [0.0], [1.0]]))
    >>> a.updated_caches()[0][0, :, 0].tolist()         # row 2 holds k rotated a quarter turn
    [[0.0, 0.0], [0.0, 0.0], [-1.0, 1.0], [0.0, 0.0]]
    >>> bool((kc == 0).all()), a.seqlens().tolist()     # the caller's cache is unchanged
    (True, [3])
    """

    q: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    cache_seqlens: np.ndarray
    k: np.ndarray | None = None
    v: np.ndarray | None = None
    rotary_cos: np.ndarray | None = None
    rotary_sin: np.ndarray | None = None
    rotary_interleaved: bool = False
    cache_leftpad: np.ndarray | None = None
    cache_batch_idx: np.ndarray | None = None
    block_table: np.ndarray | None = None
    rotate_q_per_token: bool = True

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        sizes = [as_array(n, getattr(self, n)).size for n in ("q", "k_cache", "v_cache")]
        check_bytes(8 * (6 * sizes[0] + 4 * sizes[1] + 4 * sizes[2]), "the kvcache call's "
                    "copies of its caches, the updated caches and the rotated q",
                    "pass smaller caches")  # before any copy
        q = _float("q", self.q, 4)
        kc, vc = _float("k_cache", self.k_cache, 4), _float("v_cache", self.v_cache, 4)
        B, Q, Hq, D = q.shape
        n0, S, Hkv, Dk = kc.shape
        if B == 0 or Q == 0 or Hq == 0 or D == 0 or n0 == 0 or S == 0 or Hkv == 0:
            raise RefAttnError(f"q / k_cache: empty axes (q {list(q.shape)}, k_cache "
                               f"{list(kc.shape)})")
        if Dk != D or vc.shape[:3] != kc.shape[:3]:
            raise RefAttnError(f"k_cache / v_cache: shapes {list(kc.shape)} and "
                               f"{list(vc.shape)} must share (rows, slots, nheads_k) and k's "
                               f"headdim must be q's D={D}")
        if Hq % Hkv:
            raise RefAttnError(f"q: nheads={Hq} must be a multiple of nheads_k={Hkv}")
        for flag in ("rotary_interleaved", "rotate_q_per_token"):
            if not isinstance(getattr(self, flag), (bool, np.bool_)):
                raise RefAttnError(f"{flag}: expected True or False, got "
                                   f"{getattr(self, flag)!r}")
        if (self.k is None) != (self.v is None):
            raise RefAttnError("k, v: pass both (the new keys and values) or neither")
        new = 0
        k_new = v_new = None
        if self.k is not None:
            k_new, v_new = _float("k", self.k, 4), _float("v", self.v, 4)
            new = k_new.shape[1]
            if k_new.shape != (B, new, Hkv, D) or new == 0:
                raise RefAttnError(f"k: expected shape [batch_size={B}, seqlen_new >= 1, "
                                   f"nheads_k={Hkv}, headdim={D}], got {list(k_new.shape)}")
            if v_new.shape[:3] != k_new.shape[:3] or v_new.shape[3] != vc.shape[3]:
                raise RefAttnError(f"v: expected shape [{B}, {new}, {Hkv}, {vc.shape[3]}], "
                                   f"got {list(v_new.shape)}")
        if (self.rotary_cos is None) != (self.rotary_sin is None):
            raise RefAttnError("rotary_cos, rotary_sin: pass both or neither")
        cos = sin = None
        if self.rotary_cos is not None:
            if k_new is None:
                raise RefAttnError("rotary_cos: rotary embeddings apply only with k and v "
                                   "appended (flash_attn_with_kvcache: \"Only applicable if k "
                                   "and v are passed in\")")
            cos = _float("rotary_cos", self.rotary_cos, 2)
            sin = _float("rotary_sin", self.rotary_sin, 2)
            if cos.shape != sin.shape or cos.shape[0] == 0 or cos.shape[1] == 0:
                raise RefAttnError(f"rotary_sin: shape {list(sin.shape)} must equal rotary_cos"
                                   f"'s {list(cos.shape)}, both [seqlen_ro, rotary_dim / 2]")
            if 2 * cos.shape[1] > D:
                raise RefAttnError(f"rotary_cos: rotary_dim = 2 x {cos.shape[1]} = "
                                   f"{2 * cos.shape[1]} exceeds headdim {D}")
        paged = self.block_table is not None
        table = None
        if paged:
            if self.cache_leftpad is not None or self.cache_batch_idx is not None:
                raise RefAttnError("cache_leftpad / cache_batch_idx: not with a block_table "
                                   "(FlashAttention's mha_fwd_kvcache refuses them with a "
                                   "paged cache)")
            given = as_array("block_table", self.block_table)
            if given.dtype.kind not in "iu" or given.ndim != 2 or given.shape[0] != B \
                    or given.shape[1] == 0:
                raise RefAttnError(f"block_table: expected an integer array of shape "
                                   f"[batch_size={B}, max_num_blocks_per_seq >= 1], got dtype "
                                   f"{given.dtype} shape {list(given.shape)}")
            capacity = given.shape[1] * S
            where = (f"max_num_blocks_per_seq * page_block_size = {given.shape[1]} * {S} = "
                     f"{capacity}")
        else:
            capacity = S
            where = f"seqlen_cache = {S} (k_cache's rows)"
        lo = 0 if new else 1
        lens = index_array("cache_seqlens", _ints("cache_seqlens", self.cache_seqlens, B),
                           lo=lo, hi=INT64_MAX - new, letters="b",
                           expected=f"{lo} <= cache_seqlens[b]")
        over = lens + new > capacity
        if over.any():
            b = int(np.flatnonzero(over)[0])
            raise RefAttnError(
                f"cache_seqlens: entry b={b} is {int(lens[b])}; appending seqlen_new={new} "
                f"tokens needs cache_seqlens[b] + {new} <= the cache's capacity {where}, got "
                f"{int(lens[b]) + new}" if new else
                f"cache_seqlens: entry b={b} is {int(lens[b])}, beyond the cache's capacity "
                f"{where}")
        total = lens + new
        if paged:  # kept: the columns some sequence reads (sized from them, not the width)
            need = -(-total // S)
            read = int(need.max())
            used = np.arange(read)[None, :] < need[:, None]
            table = index_array("block_table", given[:, :read], lo=0, hi=n0 - 1, used=used,
                                letters="bp",
                                expected=f"a block in [0, num_blocks={n0}) (sequence b reads "
                                         "its first ceil((cache_seqlens[b] + seqlen_new) / "
                                         "page_block_size) blocks)")
            table = immutable_copy(np.where(used, table, -1))
        leftpad = None
        if self.cache_leftpad is not None:
            lp = index_array("cache_leftpad", _ints("cache_leftpad", self.cache_leftpad, B),
                             lo=0, hi=INT64_MAX, letters="b")
            bad = lp > lens
            if bad.any():
                b = int(np.flatnonzero(bad)[0])
                raise RefAttnError(f"cache_leftpad: entry b={b} is {int(lp[b])}, beyond "
                                   f"cache_seqlens[b] = {int(lens[b])} (the cache starts at "
                                   "cache_leftpad[b] and ends at cache_seqlens[b])")
            leftpad = immutable_copy(lp)
        batch_idx = None
        if self.cache_batch_idx is not None:
            bi = index_array("cache_batch_idx", _ints("cache_batch_idx", self.cache_batch_idx,
                                                      B), lo=0, hi=n0 - 1, letters="b",
                             expected=f"a row in [0, batch_size_cache={n0}) of k_cache")
            seen: dict[int, int] = {}
            for b, row in enumerate(bi.tolist()):
                if row in seen:
                    raise RefAttnError(f"cache_batch_idx: entries b={seen[row]} and b={b} are "
                                       f"both {row}; a duplicate is a race of in-place writes "
                                       "(FlashAttention: \"might come from any of the "
                                       "duplicate indices\")")
                seen[row] = b
            batch_idx = immutable_copy(bi)
        elif not paged and n0 < B:
            raise RefAttnError(f"k_cache: batch_size_cache={n0} holds fewer caches than q's "
                               f"batch_size={B} (without cache_batch_idx sequence b reads row "
                               "b)")
        set_(self, "q", q)
        set_(self, "k_cache", kc)
        set_(self, "v_cache", vc)
        set_(self, "k", k_new)
        set_(self, "v", v_new)
        set_(self, "rotary_cos", cos)
        set_(self, "rotary_sin", sin)
        set_(self, "rotary_interleaved", bool(self.rotary_interleaved))
        set_(self, "rotate_q_per_token", bool(self.rotate_q_per_token))
        set_(self, "cache_seqlens", immutable_copy(lens))
        set_(self, "cache_leftpad", leftpad)
        set_(self, "cache_batch_idx", batch_idx)
        set_(self, "block_table", table)
        if cos is not None:  # every rotary position inside the table, named as given
            rows = cos.shape[0]
            check_positions(self.k_positions(), rows, name="k positions (cache_seqlens[b] + "
                            "t)", table="rotary_cos", letters="bt")
            check_positions(self.q_positions(), rows, name="q positions (cache_seqlens[b]"
                            + (" + i)" if self.rotate_q_per_token else ")"), table="rotary_cos",
                            letters="bi")

    # -- geometry ------------------------------------------------------------------------------

    @property
    def seqlen_new(self) -> int:
        return 0 if self.k is None else int(self.k.shape[1])

    def seqlens(self) -> np.ndarray:
        """(B,) tokens of each cache after the append: ``cache_seqlens + seqlen_new``."""
        return self.cache_seqlens + self.seqlen_new

    def k_positions(self) -> np.ndarray:
        """(B, seqlen_new): the rotary position (= cache row) of each appended token."""
        return self.cache_seqlens[:, None] + np.arange(self.seqlen_new)[None, :]

    def q_positions(self) -> np.ndarray:
        """(B, Q): the rotary position of each query (``cache_seqlens[b] + i`` when causal or
        local, else ``cache_seqlens[b]``)."""
        Q = self.q.shape[1]
        step = np.arange(Q) if self.rotate_q_per_token else np.zeros(Q, np.int64)
        return self.cache_seqlens[:, None] + step[None, :]

    def _written(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, slots) of the cache each appended token (b, t) overwrites, each (B, new)."""
        pos = self.k_positions()
        if self.block_table is None:
            rows = (np.arange(self.q.shape[0]) if self.cache_batch_idx is None
                    else self.cache_batch_idx)
            return np.broadcast_to(rows[:, None], pos.shape), pos
        S = self.k_cache.shape[1]
        page = np.take_along_axis(self.block_table, pos // S, axis=1)
        return page, pos % S

    # -- what the kernel computes ----------------------------------------------------------------

    def _rope(self, x: np.ndarray, positions: np.ndarray, backward: bool = False) -> np.ndarray:
        """(B, T, H, D) rotated at (B, T) positions (a copy when there are no tables)."""
        cos, sin = self.rotary_cos, self.rotary_sin
        if cos is None or sin is None:
            return np.array(x, copy=True)
        f = apply_backward if backward else apply
        y = f(np.ascontiguousarray(x.transpose(0, 2, 1, 3)), cos, sin, positions,
              self.rotary_interleaved)
        return np.ascontiguousarray(y.transpose(0, 2, 1, 3))

    def rotated_q(self) -> np.ndarray:
        """(B, Q, Hq, D): q as the kernel multiplies it (rotated, or q itself)."""
        return self._rope(self.q, self.q_positions())

    def rotated_k(self) -> np.ndarray | None:
        """(B, seqlen_new, Hkv, D): the appended keys as written into the cache."""
        return None if self.k is None else self._rope(self.k, self.k_positions())

    def updated_caches(self) -> tuple[np.ndarray, np.ndarray]:
        """``(k_cache, v_cache)`` after the call: new arrays, the appended rows written (what
        FlashAttention leaves in the caller's caches)."""
        kc, vc = np.array(self.k_cache, copy=True), np.array(self.v_cache, copy=True)
        if self.k is not None:
            rows, slots = self._written()
            if self.block_table is not None:
                flat = rows.ravel() * kc.shape[1] + slots.ravel()
                if np.unique(flat).size != flat.size:
                    i = int(np.flatnonzero(np.bincount(flat) > 1)[0])
                    raise RefAttnError(f"block_table: two appended tokens write page "
                                       f"{i // kc.shape[1]}, slot {i % kc.shape[1]} (a race "
                                       "of in-place writes)")
            kc[rows, slots] = self.rotated_k()
            vc[rows, slots] = self.v
        return kc, vc

    def call(self, *, causal: bool = False,
             window: tuple[int | None, int | None] | None = None, **call_kwargs: Any
             ) -> AttentionCall:
        """The canonical call: rotated q ``(B, Hq, Q, D)``, the updated caches' keys and
        values as read (``(B, Hkv, K, D)``; K: the slots of the blocks read, or the longest
        sequence's tokens without a block table), visibility of keys ``cache_leftpad[b] <= t
        < seqlens()[b]`` with query i at ``seqlens()[b] - Q + i`` (bottom-right), ``causal``
        and ``window`` as :func:`refattn.call.paged.paged_call` takes them."""
        return self.canonical(causal=causal, window=window, **call_kwargs)[0]

    def canonical(self, *, causal: bool = False,
                  window: tuple[int | None, int | None] | None = None, **kwargs: Any
                  ) -> tuple[AttentionCall, PagedKV | None]:
        """:meth:`call` and the :class:`~refattn.call.paged.PagedKV` of the updated caches
        as read (None with ``cache_leftpad``: the keys before the pad are not a paged
        layout's)."""
        q = np.ascontiguousarray(self.rotated_q().transpose(0, 2, 1, 3))
        kc, vc = self.updated_caches()
        lens = self.seqlens()
        B = q.shape[0]
        if self.block_table is not None:
            pc = paged_call(q, kc, vc, self.block_table, lens, kc.shape[1], causal=causal,
                            window=window, shared_pages=True, **kwargs)
            return pc.call, pc.paged
        K = int(lens.max())
        rows = np.arange(B) if self.cache_batch_idx is None else self.cache_batch_idx
        ks, vs = kc[rows, :K], vc[rows, :K]  # (B, K, Hkv, D)
        if self.cache_leftpad is None:
            pc = paged_call(q, ks, vs, np.arange(B)[:, None], lens, K, causal=causal,
                            window=window, shared_pages=True, **kwargs)
            return pc.call, pc.paged
        if "visible" in kwargs:
            raise RefAttnError("visible: the kvcache call's visibility comes from "
                               "cache_seqlens and cache_leftpad; do not pass visible=")
        Q = q.shape[2]
        t = np.arange(K)[None, :]
        valid = (t >= self.cache_leftpad[:, None]) & (t < lens[:, None])
        q_pos = lens[:, None] - Q + np.arange(Q)[None, :]
        k_pos = np.broadcast_to(np.arange(K), (B, K))
        positional = bool(causal) or window is not None
        rel = relation(q_pos, k_pos, valid, causal=bool(causal), window=window, layout="cache",
                       alignment="explicit_positions" if positional else None)
        keys = np.where(valid[:, :, None, None], ks, 0.0).transpose(0, 2, 1, 3)
        values = np.where(valid[:, :, None, None], vs, 0.0).transpose(0, 2, 1, 3)
        return AttentionCall(q, np.ascontiguousarray(keys), np.ascontiguousarray(values),
                             visible=rel, **kwargs), None

    # -- the layout protocol (refattn.bundle.golden.layouts) ----------------------------------

    def tensors(self) -> dict[str, np.ndarray]:
        """The inputs as given under their golden names (``kvcache_*``), and the caches the
        call leaves behind (``kvcache_k_cache_updated``, ``kvcache_v_cache_updated``)."""
        out = {name: getattr(self, attr) for name, attr in TENSOR_NAMES.items()
               if getattr(self, attr) is not None}
        kc, vc = self.updated_caches()
        out["kvcache_k_cache_updated"], out["kvcache_v_cache_updated"] = kc, vc
        return out

    def gradient_tensors(self, grads: Any) -> dict[str, np.ndarray]:
        """The gradients of the inputs as given from the canonical call's
        :class:`~refattn.Gradients`: ``grad_kvcache_q`` (through RoPE's backward),
        ``grad_kvcache_k`` (RoPE's backward of the appended rows' gradient),
        ``grad_kvcache_v``, ``grad_kvcache_k_cache`` and ``grad_kvcache_v_cache`` (the old
        contents: rows the append overwrites get zero gradient, as do rows no sequence
        reads)."""
        g_q = np.ascontiguousarray(np.asarray(grads.grad_q).transpose(0, 2, 1, 3))
        out = {"grad_kvcache_q": self._rope(g_q, self.q_positions(), backward=True)}
        g_kc, g_vc = self._cache_gradient(grads.grad_k, "grad_k"), self._cache_gradient(
            grads.grad_v, "grad_v")
        if self.k is not None:
            rows, slots = self._written()
            out["grad_kvcache_k"] = self._rope(g_kc[rows, slots], self.k_positions(),
                                               backward=True)
            out["grad_kvcache_v"] = np.array(g_vc[rows, slots], copy=True)
            g_kc[rows, slots] = 0.0
            g_vc[rows, slots] = 0.0
        out["grad_kvcache_k_cache"], out["grad_kvcache_v_cache"] = g_kc, g_vc
        return out

    def _cache_gradient(self, grad: Any, name: str) -> np.ndarray:
        """A canonical (B, Hkv, K, D) gradient onto the updated cache's layout."""
        g = as_array(name, grad)
        check_float64(name, g)
        cache = self.k_cache if name == "grad_k" else self.v_cache
        B, lens = self.q.shape[0], self.seqlens()
        if self.block_table is not None:
            kc, vc = self.updated_caches()
            paged = PagedKV(kc, vc, self.block_table, lens, kc.shape[1], shared_pages=True)
            return paged.scatter(g, name)
        K = int(lens.max())
        if g.ndim != 4 or g.shape[0] != B or g.shape[2] != K or g.shape[1] != cache.shape[2]:
            raise RefAttnError(f"{name}: expected shape [B={B}, Hkv={cache.shape[2]}, K={K}, "
                               f"D], got {list(g.shape)}")
        out = np.zeros((*cache.shape[:3], g.shape[3]))
        rows = np.arange(B) if self.cache_batch_idx is None else self.cache_batch_idx
        t = np.arange(K)[None, :]
        lp = np.zeros(B, np.int64) if self.cache_leftpad is None else self.cache_leftpad
        valid = (t >= lp[:, None]) & (t < lens[:, None])  # (B, K)
        b_idx, t_idx = np.nonzero(valid)
        out[rows[b_idx], t_idx] = g[b_idx, :, t_idx, :]
        return out

    def conventions(self) -> dict[str, Any]:
        """What a golden manifest records about this layout."""
        paged = self.block_table is not None
        return {
            "kv_layout": KV_LAYOUT,
            "kvcache_function": "flash_attn_with_kvcache (Dao-AILab/flash-attention)",
            "kvcache_tensor_layout": "q (B, Q, Hq, D); k, v (B, seqlen_new, Hkv, D); caches "
                                     + ("(num_blocks, page_block_size, Hkv, D) through "
                                        "block_table" if paged else
                                        "(batch_size_cache, seqlen_cache, Hkv, D)"),
            "kvcache_append": "k, v written at cache rows cache_seqlens[b] .. cache_seqlens[b] "
                              "+ seqlen_new - 1 of sequence b (in place in the kernel; "
                              "kvcache_*_cache_updated hold the result)",
            "kvcache_rotary": "none" if self.rotary_cos is None else
                              LAYOUTS[self.rotary_interleaved],
            "rotary_interleaved": self.rotary_interleaved,
            "rotary_positions": "k at its cache row cache_seqlens[b] + t (absolute, leftpad "
                                "included); q at " + ("cache_seqlens[b] + i (causal or local)"
                                                      if self.rotate_q_per_token else
                                                      "cache_seqlens[b] (not causal, not local)"),
            "rotate_q_per_token": self.rotate_q_per_token,
            "kvcache_visibility": "keys cache_leftpad[b] <= t < cache_seqlens[b] + seqlen_new; "
                                  "query i at cache_seqlens[b] + seqlen_new - Q + i",
            "kvcache_gradients": "grad_kvcache_q through RoPE's backward; grad_kvcache_k of the "
                                 "appended keys before rotation; the caches' old rows the "
                                 "append overwrites get zero gradient",
        }

