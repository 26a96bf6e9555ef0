"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2): calls whose values are the
first ``Dv`` columns of the keys.

Owns the three MLA input forms and the canonical :class:`~refattn.AttentionCall` each one
builds, with the map of the canonical gradients back onto the inputs as given:

- :func:`mla_call`: a latent cache ``kv (B, Hkv, K, Dk)`` read as keys ``kv`` and values
  ``kv[..., :Dv]`` (:class:`LatentKV`);
- :func:`paged_mla_call`: FlashMLA's paged latent cache ``(num_blocks, page_block_size,
  h_kv, Dk)`` with ``block_table`` and ``cache_seqlens`` (zero-length caches allowed),
  bottom-right causal over the cache when asked (:class:`PagedLatentKV`, which gathers through
  :class:`refattn.call.paged.PagedKV`);
- :func:`absorbed_call`: the absorbed form of DeepSeek's inference code, ``q_nope (B, Hq, Q,
  Dc)``, ``q_pe (B, Hq, Q, Dr)``, ``kv_c (B, Hkv, K, Dc)``, ``k_pe (B, Hkv, K, Dr)``: q =
  ``[q_nope, q_pe]``, latent ``[kv_c, k_pe]``, V = ``kv_c`` (:class:`AbsorbedLatent`).

The canonical call holds V as a copy of the latent's first ``Dv`` columns (the gate copies
every array anyway), so the engine computes ``grad_k`` and ``grad_v`` as for any call; the
gradient of the latent is their sum on the shared columns::

    grad_latent = grad_k + [grad_v, 0]        (grad_v zero-padded from Dv to Dk columns)

Each layout object follows the protocol of :mod:`refattn.bundle.golden.layouts`
(``tensors()``, ``gradient_tensors(grads)``, ``conventions()`` with ``kv_layout:
"mla_latent"``, ``mla_form`` and ``head_dim_v``).

Sources (read for this module):

- deepseek-ai/FlashMLA ``flash_mla/flash_mla_interface.py`` ``flash_mla_with_kvcache``
  (commit 9241ae3ef9bac614dd25e45e507e089f888280e0; the first version 414a2f3): q
  ``(batch_size, seq_len_q, num_heads_q, head_dim)``, k_cache ``(num_blocks,
  page_block_size, num_heads_k, head_dim)``, ``head_dim_v`` the leading columns of k_cache
  read as V ("head_dim should be 576 while head_dim_v should be 512"), softmax_scale default
  ``head_dim ** -0.5``; ``tests/test_flash_mla_dense_decoding.py`` ``reference_torch`` /
  ``scaled_dot_product_attention``: ``mask.tril(diagonal=s_k - s_q)`` (query i of the s_q new
  tokens reads keys ``j <= i + s_k - s_q``: bottom-right aligned), ``kv[..., :dv]`` as V, a
  query without a key (a zero-length cache) gets output 0 and lse ``+inf``.
- deepseek-ai/DeepSeek-V3 ``inference/model.py`` ``MLA.forward`` (attn_impl ``"absorb"``,
  commit 1ea5a1a7ed7429e25ba2fa2c76fe74fa5968d348): ``q_nope`` absorbed with
  ``wkv_b[:, :qk_nope_head_dim]`` into the ``kv_lora_rank`` (512) latent, ``scores =
  (einsum(q_nope, kv_cache) + einsum(q_pe, pe_cache)) * softmax_scale``, ``x =
  einsum(scores, kv_cache)`` (the output in the latent space, projected by ``wkv_b[:,
  -v_head_dim:]`` afterwards). DeepSeek's softmax_scale is ``qk_head_dim ** -0.5`` (times
  ``mscale ** 2`` with YaRN), not ``576 ** -0.5``: pass ``scale=`` for it.

Defers the relation to :mod:`refattn.masks`, the paged gather to :mod:`refattn.call.paged`
and the arithmetic to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from refattn._boundary import public
from refattn._checks import (
    INT64_MAX,
    as_array,
    bounded_int,
    check_finite,
    check_float64,
    immutable_copy,
    index_array,
)
from refattn._memory import check_bytes
from refattn.call.gate import AttentionCall
from refattn.call.paged import PAGE_LAYOUT, READ_LESS, PagedKV, gather_bytes
from refattn.errors import RefAttnError
from refattn.masks import relation

__all__ = ["KV_LAYOUT", "AbsorbedGradients", "AbsorbedLatent", "LatentKV", "MlaCall",
           "PagedLatentKV", "absorbed_call", "latent_gradient", "mla_call", "paged_mla_call"]

#: the ``kv_layout`` a golden manifest records for every MLA form
KV_LAYOUT = "mla_latent"
#: what the manifest says about the shared columns
_SHARED = ("v = latent[..., :head_dim_v]; grad_latent = grad_k + grad_v zero-padded to Dk "
           "(the shared columns' gradients summed)")


def _float4(name: str, x: object, layout: str) -> np.ndarray:
    """A finite float64 4-axis array (never cast)."""
    arr = as_array(name, x)
    check_float64(name, arr)
    if arr.ndim != 4:
        raise RefAttnError(f"{name}: expected shape {layout}, got {list(arr.shape)}")
    check_finite(name, arr)
    return arr


def _head_dim_v(head_dim_v: object, name: str, shape: tuple[int, ...]) -> int:
    """``head_dim_v`` bounded by the latent's width: V is its first ``head_dim_v`` columns."""
    dk = int(shape[-1])
    if isinstance(head_dim_v, (bool, np.bool_)) or not isinstance(head_dim_v, (int, np.integer)):
        raise RefAttnError(f"head_dim_v: expected an integer, got {head_dim_v!r}")
    dv = int(head_dim_v)
    if not 1 <= dv <= dk:
        raise RefAttnError(
            f"head_dim_v: {dv} is outside [1, {dk}]: V is columns [0, head_dim_v) of {name} "
            f"(shape {list(shape)}, axis {len(shape) - 1} has Dk = {dk} columns), so "
            f"head_dim_v (Dv) may not exceed Dk = {dk}")
    return dv


def _no(call_kwargs: dict[str, Any], names: tuple[str, ...], why: str) -> None:
    for name in names:
        if name in call_kwargs:
            raise RefAttnError(f"{name}: {why}; do not pass {name}=")


@public
def latent_gradient(grad_k: Any, grad_v: Any) -> np.ndarray:
    """The gradient of a latent whose first ``Dv`` columns are also V: ``grad_k`` plus
    ``grad_v`` zero-padded to ``Dk`` columns (both paths summed).

    Parameters
    ----------
    grad_k : (..., Dk) float64 ndarray
    grad_v : (..., Dv) float64 ndarray
        ``Dv <= Dk``; the leading axes equal ``grad_k``'s.

    Returns
    -------
    (..., Dk) float64 ndarray
        A new array (the arguments are not modified).

    Raises
    ------
    RefAttnError
        On non-float64 or non-finite input, mismatched leading axes or ``Dv > Dk``.

    Examples
    --------
    >>> latent_gradient(np.ones((1, 3)), np.full((1, 2), 2.0)).tolist()
    [[3.0, 3.0, 1.0]]
    """
    gk, gv = as_array("grad_k", grad_k), as_array("grad_v", grad_v)
    check_float64("grad_k", gk)
    check_float64("grad_v", gv)
    check_finite("grad_k", gk)  # a NaN would pass into the sum silently
    check_finite("grad_v", gv)
    if gk.ndim == 0 or gk.shape[:-1] != gv.shape[:-1]:
        raise RefAttnError(f"grad_v: shape {list(gv.shape)} must match grad_k "
                           f"{list(gk.shape)} on every axis but the last")
    if gv.shape[-1] > gk.shape[-1]:
        raise RefAttnError(f"grad_v: {gv.shape[-1]} columns (axis {gv.ndim - 1}) exceed "
                           f"grad_k's Dk = {gk.shape[-1]}: V is the first Dv <= Dk columns")
    out = np.array(gk, dtype=np.float64, copy=True)
    out[..., :gv.shape[-1]] += gv
    return out


@public
@dataclass(frozen=True, eq=False)
class LatentKV:
    """A latent cache read as keys (all its columns) and values (its first ``head_dim_v``).

    Attributes
    ----------
    kv : (B, Hkv, K, Dk) float64 ndarray
        The latent (a read-only copy of the argument).
    head_dim_v : int
        ``1 <= head_dim_v <= Dk``.

    Examples
    --------
    >>> lat = LatentKV(np.ones((1, 1, 2, 3)), 2)
    >>> lat.values().shape, lat.conventions()["head_dim_v"]
    ((1, 1, 2, 2), 2)
    """

    kv: np.ndarray
    head_dim_v: int

    def __post_init__(self) -> None:
        kv = _float4("kv", self.kv, "[B, Hkv, K, Dk]")
        dv = _head_dim_v(self.head_dim_v, "kv", kv.shape)
        object.__setattr__(self, "kv", immutable_copy(kv))
        object.__setattr__(self, "head_dim_v", dv)

    def keys(self) -> np.ndarray:
        """(B, Hkv, K, Dk): the latent itself."""
        return self.kv

    def values(self) -> np.ndarray:
        """(B, Hkv, K, Dv): a copy of the latent's first ``head_dim_v`` columns."""
        return np.ascontiguousarray(self.kv[..., :self.head_dim_v])

    def latent_gradient(self, grads: Any) -> np.ndarray:
        """(B, Hkv, K, Dk): ``grad_k + [grad_v, 0]`` from the canonical call's gradients."""
        return latent_gradient(grads.grad_k, grads.grad_v)

    def tensors(self) -> dict[str, np.ndarray]:
        """The latent as given, under its golden name."""
        return {"kv_latent": self.kv}

    def gradient_tensors(self, grads: Any) -> dict[str, np.ndarray]:
        """The summed latent gradient, under its golden name."""
        return {"grad_kv_latent": self.latent_gradient(grads)}

    def conventions(self) -> dict[str, Any]:
        """What a golden manifest records about the latent layout."""
        return {"kv_layout": KV_LAYOUT, "mla_form": "dense", "head_dim_v": self.head_dim_v,
                "latent_layout": "(B, Hkv, K, Dk)", "shared_columns": _SHARED}


@public
@dataclass(frozen=True, eq=False)
class PagedLatentKV:
    """FlashMLA's paged latent cache as given, with the gather and the page gradients.

    Sequence b holds ``seqlens[b]`` tokens (0 allowed: a zero-length cache); token t lives in
    page ``block_table[b, t // page_size]`` at slot ``t % page_size`` (the convention of
    :class:`refattn.call.paged.PagedKV`, which does the gather; entries past a sequence's
    last block are not read). The canonical keys are ``K = max_pages * page_size`` slots,
    ``max_pages`` the blocks the longest sequence reads (at least one).

    Attributes
    ----------
    kv_pages : (num_pages, page_size, Hkv, Dk) float64 ndarray
    block_table : (B, max_pages) integer ndarray
    seqlens : (B,) integer ndarray
        ``0 <= seqlens[b] <= max_pages * page_size``.
    page_size : int
    head_dim_v : int
    shared_pages : bool
        False (default): a page read by two blocks is refused; True: allowed, its gradient
        the sum over the blocks that read it.

    Raises
    ------
    RefAttnError
        As :class:`refattn.call.paged.PagedKV` (naming ``block_table[b, p]``), and on
        ``head_dim_v`` outside ``[1, Dk]``.

    Examples
    --------
    >>> pages = np.arange(24.0).reshape(3, 2, 1, 4)
    >>> lat = PagedLatentKV(pages, np.array([[2, 0], [-1, -1]]), np.array([3, 0]), 2, 3)
    >>> lat.keys()[0, 0, :, 0].tolist(), lat.key_valid().tolist()
    ([16.0, 20.0, 0.0, 4.0], [[True, True, True, False], [False, False, False, False]])
    """

    kv_pages: np.ndarray
    block_table: np.ndarray
    seqlens: np.ndarray
    page_size: int
    head_dim_v: int
    shared_pages: bool = False
    _gather: PagedKV = field(init=False, repr=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        kp = _float4("kv_pages", self.kv_pages, f"[num_pages, page_size, Hkv, Dk] {PAGE_LAYOUT}")
        dv = _head_dim_v(self.head_dim_v, "kv_pages", kp.shape)
        ps = bounded_int("page_size", self.page_size, lo=1, hi=INT64_MAX)
        if kp.shape[1] != ps:
            raise RefAttnError(f"page_size: {ps} but kv_pages holds {kp.shape[1]} slots per "
                               f"page (layout {PAGE_LAYOUT})")
        if kp.shape[0] == 0:
            raise RefAttnError("kv_pages: expected at least one page, got shape "
                               f"{list(kp.shape)}")
        if not isinstance(self.shared_pages, (bool, np.bool_)):
            raise RefAttnError(f"shared_pages: expected True or False, got {self.shared_pages!r}")
        given = as_array("block_table", self.block_table)
        if given.dtype.kind not in "iu" or given.ndim != 2 or 0 in given.shape:
            raise RefAttnError(f"block_table: expected a non-empty integer [B, max_pages], got "
                               f"dtype {given.dtype}, shape {list(given.shape)}")
        B, columns = given.shape
        capacity = columns * ps
        lens = index_array("seqlens", self.seqlens, lo=0, hi=capacity, ndim=1, letters="b",
                           expected=f"0 <= seqlens[b] <= max_pages * page_size = {capacity}")
        if lens.shape != (B,):
            raise RefAttnError(f"seqlens: expected shape [B={B}] (one per block-table row), "
                               f"got {list(lens.shape)}")
        # a zero-length sequence reads nothing: PagedKV (which needs one token) gathers its
        # slot 0 from page 0, an invalid key whose gradient is exactly 0
        clamped = np.maximum(lens, 1)
        read = int(-(-int(clamped.max()) // ps))
        # int64 (lossless or refused); the entries read are range-checked by PagedKV
        whole = np.array(index_array("block_table", given, lo=0, hi=0,
                                     used=np.zeros(given.shape, bool)), dtype=np.int64)
        table = whole[:, :read].copy()
        table[lens == 0, 0] = 0
        gather = PagedKV(kp, kp[..., :dv], table, clamped, ps, shared_pages=True)
        if not self.shared_pages:
            self._check_overlap(gather.block_table, lens, ps)
        set_(self, "_gather", gather)
        set_(self, "kv_pages", gather.k_pages)
        set_(self, "block_table", immutable_copy(whole))
        set_(self, "seqlens", immutable_copy(lens))
        set_(self, "page_size", ps)
        set_(self, "head_dim_v", dv)
        set_(self, "shared_pages", bool(self.shared_pages))

    @staticmethod
    def _check_overlap(table: np.ndarray, lens: np.ndarray, ps: int) -> None:
        used = np.arange(table.shape[1])[None, :] < -(-lens // ps)[:, None]
        owner: dict[int, tuple[int, int]] = {}
        for b, p in zip(*np.nonzero(used), strict=True):
            page = int(table[b, p])
            if page in owner:
                b0, p0 = owner[page]
                raise RefAttnError(
                    f"block_table: overlapping pages: entries (b={b0}, p={p0}) and (b={b}, "
                    f"p={p}) both read page {page}; each page must belong to one block "
                    "(shared_pages=True for a shared prefix)")
            owner[page] = (int(b), int(p))

    @property
    def B(self) -> int:
        return int(self.seqlens.shape[0])

    @property
    def K(self) -> int:
        """Canonical key rows: ``max_pages * page_size`` (at least one page)."""
        return int(self._gather.K)

    def keys(self) -> np.ndarray:
        """(B, Hkv, K, Dk): the pages gathered in block-table order."""
        return self._gather.keys()

    def values(self) -> np.ndarray:
        """(B, Hkv, K, Dv): the keys' first ``head_dim_v`` columns."""
        return self._gather.values()

    def key_valid(self) -> np.ndarray:
        """(B, K) bool: slot t of sequence b holds a token iff ``t < seqlens[b]``."""
        return np.arange(self.K)[None, :] < self.seqlens[:, None]

    def latent_gradient(self, grads: Any) -> np.ndarray:
        """(B, Hkv, K, Dk): ``grad_k + [grad_v, 0]`` in the canonical frame."""
        return latent_gradient(grads.grad_k, grads.grad_v)

    def page_gradient(self, grads: Any) -> np.ndarray:
        """(num_pages, page_size, Hkv, Dk): the summed latent gradient on the pages (slots
        that no valid key reads are exactly 0)."""
        g = self.latent_gradient(grads)
        g[~np.broadcast_to(self.key_valid()[:, None, :], g.shape[:3])] = 0.0
        return self._gather.scatter(g, "grad_kv_latent")

    def tensors(self) -> dict[str, np.ndarray]:
        """The paged inputs as given, under their golden names."""
        return {"kv_latent_pages": self.kv_pages, "block_table": self.block_table,
                "seqlens": self.seqlens}

    def gradient_tensors(self, grads: Any) -> dict[str, np.ndarray]:
        """The summed page gradient, under its golden name."""
        return {"grad_kv_latent_pages": self.page_gradient(grads)}

    def conventions(self) -> dict[str, Any]:
        """What a golden manifest records about the paged latent layout."""
        out: dict[str, Any] = {
            "kv_layout": KV_LAYOUT, "mla_form": "paged", "head_dim_v": self.head_dim_v,
            "page_size": self.page_size, "page_layout": PAGE_LAYOUT,
            "block_table": "token t of sequence b: page block_table[b, t // page_size], "
                           "slot t % page_size; entries past a sequence's last page unread",
            "cache_offset": "query i of sequence b at position seqlens[b] - Q + i",
            "shared_columns": _SHARED}
        if self.shared_pages:
            out["shared_pages"] = True
        return out


@public
@dataclass(frozen=True, eq=False)
class AbsorbedGradients:
    """The gradients of the absorbed form's four inputs."""

    grad_q_nope: np.ndarray
    """(B, Hq, Q, Dc) float64."""
    grad_q_pe: np.ndarray
    """(B, Hq, Q, Dr) float64."""
    grad_kv_c: np.ndarray
    """(B, Hkv, K, Dc) float64: the key path and the value path summed."""
    grad_k_pe: np.ndarray
    """(B, Hkv, K, Dr) float64."""


@public
@dataclass(frozen=True, eq=False)
class AbsorbedLatent:
    """The absorbed form's inputs as given: ``q = [q_nope, q_pe]``, latent ``[kv_c, k_pe]``,
    V = ``kv_c``.

    Attributes
    ----------
    q_nope : (B, Hq, Q, Dc) float64 ndarray
        The no-position part of q, absorbed into the latent space (DeepSeek-V3:
        ``einsum("bshd,hdc->bshc", q_nope, wkv_b[:, :qk_nope_head_dim])``).
    q_pe : (B, Hq, Q, Dr) float64 ndarray
        The rotary part of q.
    kv_c : (B, Hkv, K, Dc) float64 ndarray
        The compressed latent (DeepSeek-V3's ``kv_cache``).
    k_pe : (B, Hkv, K, Dr) float64 ndarray
        The rotary key part (DeepSeek-V3's ``pe_cache``).

    Examples
    --------
    >>> a = AbsorbedLatent(np.ones((1, 2, 1, 3)), np.ones((1, 2, 1, 1)), np.ones((1, 1, 4, 3)),
    ...                    np.ones((1, 1, 4, 1)))
    >>> a.q().shape, a.keys().shape, a.values().shape
    ((1, 2, 1, 4), (1, 1, 4, 4), (1, 1, 4, 3))
    """

    q_nope: np.ndarray
    q_pe: np.ndarray
    kv_c: np.ndarray
    k_pe: np.ndarray

    def __post_init__(self) -> None:
        qn = _float4("q_nope", self.q_nope, "[B, Hq, Q, Dc]")
        qp = _float4("q_pe", self.q_pe, "[B, Hq, Q, Dr]")
        kc = _float4("kv_c", self.kv_c, "[B, Hkv, K, Dc]")
        kp = _float4("k_pe", self.k_pe, "[B, Hkv, K, Dr]")
        if qp.shape[:3] != qn.shape[:3]:
            raise RefAttnError(f"q_pe: shape {list(qp.shape)} must match q_nope "
                               f"{list(qn.shape)} on (B, Hq, Q)")
        if kp.shape[:3] != kc.shape[:3]:
            raise RefAttnError(f"k_pe: shape {list(kp.shape)} must match kv_c "
                               f"{list(kc.shape)} on (B, Hkv, K)")
        if kc.shape[3] != qn.shape[3]:
            raise RefAttnError(f"kv_c: latent width Dc = {kc.shape[3]} (axis 3) must equal "
                               f"q_nope's {qn.shape[3]} (q_nope is absorbed into the latent)")
        if kp.shape[3] != qp.shape[3]:
            raise RefAttnError(f"k_pe: rope width Dr = {kp.shape[3]} (axis 3) must equal "
                               f"q_pe's {qp.shape[3]}")
        if kc.shape[0] != qn.shape[0]:
            raise RefAttnError(f"kv_c: batch {kc.shape[0]} (axis 0) must equal q_nope's "
                               f"{qn.shape[0]}")
        for name, arr in (("q_nope", qn), ("q_pe", qp), ("kv_c", kc), ("k_pe", kp)):
            object.__setattr__(self, name, immutable_copy(arr))

    @property
    def head_dim_v(self) -> int:
        """Dv = Dc: V is the compressed latent."""
        return int(self.kv_c.shape[3])

    def q(self) -> np.ndarray:
        """(B, Hq, Q, Dc + Dr): ``[q_nope, q_pe]``."""
        return np.concatenate([self.q_nope, self.q_pe], axis=-1)

    def keys(self) -> np.ndarray:
        """(B, Hkv, K, Dc + Dr): ``[kv_c, k_pe]``."""
        return np.concatenate([self.kv_c, self.k_pe], axis=-1)

    def values(self) -> np.ndarray:
        """(B, Hkv, K, Dc): ``kv_c``."""
        return np.array(self.kv_c, copy=True)

    def split(self, grads: Any) -> AbsorbedGradients:
        """The four inputs' gradients from the canonical call's :class:`~refattn.Gradients`
        (``grad_kv_c = grad_k[..., :Dc] + grad_v``)."""
        dc = self.head_dim_v
        g_lat = latent_gradient(grads.grad_k, grads.grad_v)
        gq = np.asarray(grads.grad_q)
        return AbsorbedGradients(np.array(gq[..., :dc]), np.array(gq[..., dc:]),
                                 np.array(g_lat[..., :dc]), np.array(g_lat[..., dc:]))

    def tensors(self) -> dict[str, np.ndarray]:
        """The four inputs as given, under their golden names."""
        return {"q_nope": self.q_nope, "q_pe": self.q_pe, "kv_c": self.kv_c, "k_pe": self.k_pe}

    def gradient_tensors(self, grads: Any) -> dict[str, np.ndarray]:
        """The four inputs' gradients, under their golden names."""
        g = self.split(grads)
        return {"grad_q_nope": g.grad_q_nope, "grad_q_pe": g.grad_q_pe,
                "grad_kv_c": g.grad_kv_c, "grad_k_pe": g.grad_k_pe}

    def conventions(self) -> dict[str, Any]:
        """What a golden manifest records about the absorbed form."""
        return {"kv_layout": KV_LAYOUT, "mla_form": "absorbed", "head_dim_v": self.head_dim_v,
                "rope_dim": int(self.k_pe.shape[3]),
                "absorbed": "q = [q_nope, q_pe], k = [kv_c, k_pe], v = kv_c",
                "shared_columns": _SHARED}


@public
@dataclass(frozen=True, eq=False)
class MlaCall:
    """The canonical call of an MLA input form and the layout it was built from.

    Attributes
    ----------
    call : AttentionCall
    layout : LatentKV or PagedLatentKV or AbsorbedLatent
        ``layout.latent_gradient(grads)`` / ``layout.page_gradient(grads)`` /
        ``layout.split(grads)`` map the canonical gradients back.
    row_has_key : (B, Q) bool ndarray
        Whether query i of sequence b reads at least one key (FlashMLA writes output 0 and
        lse ``+inf`` where it does not; refattn zeroes the row through ``query_valid``).
    """

    call: AttentionCall
    layout: Any
    row_has_key: np.ndarray

    def outputs(self, trace: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(out, lse)`` in FlashMLA's layouts from a forward of :attr:`call`: out ``(B, Q,
        Hq, Dv)``, lse ``(B, Hq, Q)`` (natural log; ``+inf`` on a row without a key)."""
        out = np.ascontiguousarray(np.asarray(trace.output).transpose(0, 2, 1, 3))
        lse = np.where(self.row_has_key[:, None, :], trace.lse, np.inf)
        return out, lse


def _dense_bytes(q: np.ndarray, B: int, Hkv: int, K: int, Dk: int, Dv: int) -> None:
    check_bytes(8 * B * Hkv * K * 2 * (Dk + Dv) + 2 * q.nbytes,
                f"the MLA call of (B, Hkv, K) = ({B}, {Hkv}, {K}) latent rows", READ_LESS)


def _dense_rows(call: AttentionCall) -> np.ndarray:
    return np.asarray(np.asarray(call.row_has_key()).any(axis=1))


@public
def mla_call(q: Any, kv: Any, head_dim_v: int, **call_kwargs: Any) -> MlaCall:
    """The canonical call of a latent cache whose first ``head_dim_v`` columns are also V.

    Parameters
    ----------
    q : (B, Hq, Q, Dk) float64 ndarray
    kv : (B, Hkv, K, Dk) float64 ndarray
        The latent (MLA: Dk = 576, the 512 compressed columns then the 64 rotary ones).
    head_dim_v : int
        Dv: V = ``kv[..., :head_dim_v]``, ``1 <= Dv <= Dk`` (MLA: 512).
    **call_kwargs
        Any other :class:`~refattn.AttentionCall` keyword (visible, scale, query_valid, ...).

    Returns
    -------
    MlaCall
        ``.call`` (keys the latent, values a copy of its first Dv columns) and ``.layout``
        (:class:`LatentKV`: ``latent_gradient(grads)`` sums the shared columns).

    Raises
    ------
    RefAttnError
        On non-float64 or non-finite input, ``head_dim_v`` beyond Dk (naming kv, its axis 3
        and the limit Dk), and as :class:`~refattn.AttentionCall`.

    Examples
    --------
    >>> import refattn
    >>> rng = np.random.default_rng(0)
    >>> m = mla_call(rng.standard_normal((1, 2, 1, 6)), rng.standard_normal((1, 1, 3, 6)), 4)
    >>> grads = refattn.backward(refattn.forward(m.call), np.ones((1, 2, 1, 4)))
    >>> m.call.axes["Dv"], m.layout.latent_gradient(grads).shape
    (4, (1, 1, 3, 6))
    """
    lat = LatentKV(kv, head_dim_v)
    qa = as_array("q", q)
    B, Hkv, K, Dk = lat.kv.shape
    _dense_bytes(qa, B, Hkv, K, Dk, lat.head_dim_v)
    call = AttentionCall(qa, lat.keys(), lat.values(), **call_kwargs)
    return MlaCall(call, lat, _dense_rows(call))


@public
def absorbed_call(q_nope: Any, q_pe: Any, kv_c: Any, k_pe: Any, **call_kwargs: Any) -> MlaCall:
    """The canonical call of MLA's absorbed form (DeepSeek-V3 ``MLA.forward``, ``"absorb"``).

    ``scores = (q_nope . kv_c + q_pe . k_pe) * scale``, ``out = softmax(scores) @ kv_c``:
    the call of q ``[q_nope, q_pe]``, keys ``[kv_c, k_pe]`` and values ``kv_c``.

    Parameters
    ----------
    q_nope : (B, Hq, Q, Dc) float64 ndarray
    q_pe : (B, Hq, Q, Dr) float64 ndarray
    kv_c : (B, Hkv, K, Dc) float64 ndarray
    k_pe : (B, Hkv, K, Dr) float64 ndarray
    **call_kwargs
        Any other :class:`~refattn.AttentionCall` keyword; ``scale`` defaults to
        ``(Dc + Dr) ** -0.5`` (FlashMLA's default); DeepSeek-V3 passes ``qk_head_dim **
        -0.5`` (times ``mscale ** 2``).

    Returns
    -------
    MlaCall
        ``.layout`` is :class:`AbsorbedLatent`; ``.layout.split(grads)`` gives the four
        inputs' gradients.

    Examples
    --------
    >>> import refattn
    >>> rng = np.random.default_rng(0)
    >>> m = absorbed_call(rng.standard_normal((1, 2, 1, 4)), rng.standard_normal((1, 2, 1, 2)),
    ...                   rng.standard_normal((1, 1, 3, 4)), rng.standard_normal((1, 1, 3, 2)))
    >>> g = m.layout.split(refattn.backward(refattn.forward(m.call), np.ones((1, 2, 1, 4))))
    >>> g.grad_kv_c.shape, g.grad_k_pe.shape, m.call.scale == 6 ** -0.5
    ((1, 1, 3, 4), (1, 1, 3, 2), True)
    """
    lat = AbsorbedLatent(q_nope, q_pe, kv_c, k_pe)
    B, Hkv, K, Dc = lat.kv_c.shape
    Dk = Dc + lat.k_pe.shape[3]
    _dense_bytes(lat.q_nope, B, Hkv, K, Dk, Dc)
    call = AttentionCall(lat.q(), lat.keys(), lat.values(), **call_kwargs)
    return MlaCall(call, lat, _dense_rows(call))


@public
def paged_mla_call(q: Any, kv_pages: Any, block_table: Any, seqlens: Any, head_dim_v: int,
                   page_size: int | None = None, *, causal: bool = False,
                   shared_pages: bool = False, **call_kwargs: Any) -> MlaCall:
    """The canonical call of a decode step over FlashMLA's paged latent cache.

    Parameters
    ----------
    q : (B, Hq, Q, Dk) float64 ndarray
        The Q newest tokens of each sequence (already in the cache), head-major.
    kv_pages : (num_pages, page_size, Hkv, Dk) float64 ndarray
        FlashMLA's ``k_cache`` (page 64, Hkv 1, Dk 576); its first ``head_dim_v`` columns are
        V.
    block_table : (B, max_pages) integer ndarray
    seqlens : (B,) integer ndarray
        Tokens in each cache, ``0 <= seqlens[b] <= max_pages * page_size``; a zero-length
        cache's queries read no key (output 0, lse ``+inf`` in FlashMLA's convention).
    head_dim_v : int
        ``1 <= head_dim_v <= Dk``.
    page_size : int, optional
        Default ``kv_pages.shape[1]``.
    causal : bool
        False (FlashMLA's default): every query reads the ``seqlens[b]`` keys of its cache.
        True: query i reads keys ``j <= seqlens[b] - Q + i`` (bottom-right aligned,
        FlashMLA's ``mask.tril(diagonal=s_k - s_q)``).
    shared_pages : bool
        Blocks may share pages (their page gradients summed).
    **call_kwargs
        Any other :class:`~refattn.AttentionCall` keyword but ``visible`` and
        ``query_valid`` (the cache defines them) and ``all_masked_rows``.

    Returns
    -------
    MlaCall
        ``.layout`` is :class:`PagedLatentKV` (``page_gradient(grads)``: both paths summed
        on the pages); ``.row_has_key`` (B, Q).

    Raises
    ------
    RefAttnError
        As :class:`PagedLatentKV` and :class:`~refattn.AttentionCall`; ``visible=``,
        ``query_valid=`` or ``all_masked_rows=`` given; a call that would need more memory
        than is available (before anything is gathered).

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> pages = rng.standard_normal((3, 2, 1, 4))
    >>> m = paged_mla_call(rng.standard_normal((2, 2, 2, 4)), pages, np.array([[2, 0], [1, -1]]),
    ...                    np.array([3, 0]), 3, causal=True)
    >>> m.call.axes["K"], m.call.axes["Dv"], m.row_has_key.tolist()
    (4, 3, [[True, True], [False, False]])
    """
    _no(call_kwargs, ("visible", "query_valid", "all_masked_rows"),
        "a paged MLA call's visibility comes from block_table, seqlens and causal")
    if not isinstance(causal, (bool, np.bool_)):
        raise RefAttnError(f"causal: expected True or False, got {causal!r}")
    pages = as_array("kv_pages", kv_pages)
    if page_size is None:
        page_size = int(pages.shape[1]) if pages.ndim == 4 else 0
    lat = PagedLatentKV(pages, block_table, seqlens, page_size, head_dim_v, shared_pages)
    qa = as_array("q", q)
    if qa.ndim != 4 or qa.shape[0] != lat.B:
        raise RefAttnError(f"q: expected shape [B={lat.B}, Hq, Q, Dk] (B = block_table rows), "
                           f"got {list(qa.shape)}")
    Q = int(qa.shape[2])
    Hkv, Dk = int(lat.kv_pages.shape[2]), int(lat.kv_pages.shape[3])
    check_bytes(gather_bytes(lat.B, lat.K, Hkv, Dk, lat.head_dim_v) + 2 * qa.nbytes,
                f"the paged MLA call of (B, Hkv, K) = ({lat.B}, {Hkv}, {lat.K}) latent rows",
                READ_LESS)
    lens = lat.seqlens
    q_pos = lens[:, None] - Q + np.arange(Q)[None, :]  # (B, Q): bottom-right aligned
    k_pos = np.broadcast_to(np.arange(lat.K), (lat.B, lat.K))
    rel = relation(q_pos, k_pos, lat.key_valid(), causal=bool(causal), layout="cache",
                   alignment="explicit_positions" if causal else None)
    rows = (lens[:, None] > 0) & ((q_pos >= 0) if causal else True)  # (B, Q)
    rows = np.broadcast_to(rows, (lat.B, Q)).copy()
    if not rows.all():  # FlashMLA: "Correct for q tokens which has no attendable k"
        call_kwargs = {**call_kwargs, "query_valid": rows[:, None, :, None],
                       "all_masked_rows": "sanitize_then_zero_invalid_query"}
    call = AttentionCall(qa, lat.keys(), lat.values(), visible=rel, **call_kwargs)
    return MlaCall(call, lat, rows)
