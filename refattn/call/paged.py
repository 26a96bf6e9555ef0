"""Paged KV caches: keys and values read from fixed-size pages through a block table.

Owns :func:`paged_call`, which turns a decode kernel's paged inputs (FlashAttention's
``k_cache`` / ``v_cache`` of shape ``(num_pages, page_size, Hkv, D)`` with ``block_table`` and
``cache_seqlens``, the layout vLLM's paged attention reads through its block tables) into the
canonical :class:`~refattn.AttentionCall` with the cache-offset visibility, and
:class:`PagedKV`, which keeps the paged inputs as given (for a golden file that a paged kernel
reads directly) and maps the canonical key/value gradients back onto the pages.

Convention: sequence b holds ``seqlens[b]`` tokens; token t of it lives in page
``block_table[b, t // page_size]`` at slot ``t % page_size``. The canonical keys are the
table's slots in order, ``K = max_pages * page_size``; key slot t is valid iff
``t < seqlens[b]``; the Q queries are the last Q tokens of their sequence (absolute positions
``seqlens[b] - Q + i``, the cache offset), causal by coordinates. Block-table entries past a
sequence's last page are not read (they may hold any value, e.g. -1 padding). Defers the
relation to :mod:`refattn.masks` and the arithmetic to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from refattn._checks import as_array, check_finite, check_float64, immutable_copy
from refattn.call.gate import AttentionCall
from refattn.errors import RefAttnError
from refattn.masks import relation

__all__ = ["PAGE_LAYOUT", "PageGradients", "PagedKV", "paged_call"]

#: the page tensor layout (FlashAttention ``flash_attn_with_kvcache`` with ``block_table``)
PAGE_LAYOUT = "(num_pages, page_size, Hkv, D)"


@dataclass(frozen=True)
class PageGradients:
    """Gradients of the page tensors (pages and slots no sequence reads are exactly 0)."""

    grad_k_pages: np.ndarray
    """(num_pages, page_size, Hkv, Dk) float64."""
    grad_v_pages: np.ndarray
    """(num_pages, page_size, Hkv, Dv) float64."""


def _int_table(name: str, x: object, ndim: int) -> np.ndarray:
    arr = as_array(name, x)
    if arr.dtype.kind not in "iu":
        raise RefAttnError(f"{name}: expected an integer array, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise RefAttnError(f"{name}: expected {ndim} axes, got shape {list(arr.shape)}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise RefAttnError(f"{name}: value {int(arr.max())} does not fit in int64")
    return immutable_copy(arr.astype(np.int64, copy=False))  # never writeable again


def _pages(name: str, x: object) -> np.ndarray:
    arr = as_array(name, x)
    check_float64(name, arr)
    if arr.ndim != 4:
        raise RefAttnError(f"{name}: expected shape [num_pages, page_size, Hkv, D] "
                           f"{PAGE_LAYOUT}, got {list(arr.shape)}")
    check_finite(name, arr)
    out = np.array(arr, copy=True)
    out.flags.writeable = False
    return out


@dataclass(frozen=True, eq=False)
class PagedKV:
    """A paged KV cache as given, with the gather to canonical keys and its inverse.

    Attributes
    ----------
    k_pages : (num_pages, page_size, Hkv, Dk) float64 ndarray
    v_pages : (num_pages, page_size, Hkv, Dv) float64 ndarray
    block_table : (B, max_pages) int64 ndarray
        Page of each block of each sequence.
    seqlens : (B,) int64 ndarray
        Tokens in each sequence's cache, ``1 <= seqlens[b] <= max_pages * page_size``.
    page_size : int
    shared_pages : bool
        False (default): each page belongs to one block. True: blocks may share a page (prefix
        caching: sequences that start alike read the same pages); a shared page's gradient is
        then the sum over the blocks that read it.

    Raises
    ------
    RefAttnError
        On non-float64 or non-finite pages, mismatched page shapes, a page size that does
        not match the pages, a sequence length out of range, a block-table entry out of
        range (naming ``block_table[b, p]`` and its value), or, unless ``shared_pages``, one
        page read by two blocks ("overlapping pages": their gradients would be summed into
        one page), naming both entries.

    Examples
    --------
    >>> kp = np.arange(24.0).reshape(3, 2, 1, 4)            # 3 pages of 2 slots, Hkv=1, D=4
    >>> paged = PagedKV(kp, kp, np.array([[2, 0]]), np.array([3]), 2)
    >>> paged.keys()[0, 0, :, 0].tolist()                  # page 2's slots, then page 0's
    [16.0, 20.0, 0.0, 4.0]
    >>> paged.referenced().tolist()                        # 3 tokens: page 0's slot 1 unread
    [[True, False], [False, False], [True, True]]
    """

    k_pages: np.ndarray
    v_pages: np.ndarray
    block_table: np.ndarray
    seqlens: np.ndarray
    page_size: int
    shared_pages: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        kp = _pages("k_pages", self.k_pages)
        vp = _pages("v_pages", self.v_pages)
        if kp.shape[:3] != vp.shape[:3]:
            raise RefAttnError(
                f"v_pages: shape {list(vp.shape)} must match k_pages {list(kp.shape)} on "
                "(num_pages, page_size, Hkv)")
        ps = self.page_size
        if isinstance(ps, (bool, np.bool_)) or not isinstance(ps, (int, np.integer)) or ps < 1:
            raise RefAttnError(f"page_size: expected a positive int, got {ps!r}")
        if kp.shape[1] != int(ps):
            raise RefAttnError(f"page_size: {int(ps)} but k_pages holds {kp.shape[1]} slots per "
                               f"page (layout {PAGE_LAYOUT})")
        table = _int_table("block_table", self.block_table, 2)
        lens = _int_table("seqlens", self.seqlens, 1)
        B, max_pages = table.shape
        if B == 0 or max_pages == 0:
            raise RefAttnError(f"block_table: expected a non-empty [B, max_pages], got "
                               f"{list(table.shape)}")
        if lens.shape != (B,):
            raise RefAttnError(f"seqlens: expected shape [B={B}] (one per block-table row), "
                               f"got {list(lens.shape)}")
        capacity = max_pages * int(ps)
        for b, n in enumerate(lens.tolist()):
            if not 1 <= n <= capacity:
                raise RefAttnError(f"seqlens: entry b={b} is {n}, expected 1 <= seqlens[b] <= "
                                   f"max_pages * page_size = {capacity}")
        if not isinstance(self.shared_pages, (bool, np.bool_)):
            raise RefAttnError(f"shared_pages: expected True or False, got {self.shared_pages!r}")
        num_pages = kp.shape[0]
        used = self._used(table, lens, int(ps))
        owner: dict[int, tuple[int, int]] = {}
        for b, p in zip(*np.nonzero(used), strict=True):
            page = int(table[b, p])
            if not 0 <= page < num_pages:
                raise RefAttnError(f"block_table: entry (b={b}, p={p}) is {page}, expected a "
                                   f"page in [0, {num_pages}) (num_pages of k_pages)")
            if page in owner and not self.shared_pages:
                b0, p0 = owner[page]
                raise RefAttnError(
                    f"block_table: overlapping pages: entries (b={b0}, p={p0}) and (b={b}, "
                    f"p={p}) both read page {page}; each page must belong to one block "
                    "(shared_pages=True for a shared prefix)")
            owner.setdefault(page, (int(b), int(p)))
        set_(self, "k_pages", kp)
        set_(self, "v_pages", vp)
        set_(self, "block_table", table)
        set_(self, "seqlens", lens)
        set_(self, "page_size", int(ps))
        set_(self, "shared_pages", bool(self.shared_pages))

    @staticmethod
    def _used(table: np.ndarray, lens: np.ndarray, ps: int) -> np.ndarray:
        """(B, max_pages) bool: the blocks a sequence reads (its first ceil(len / ps))."""
        need = -(-lens // ps)  # (B,)
        return np.arange(table.shape[1])[None, :] < need[:, None]

    @property
    def B(self) -> int:
        return int(self.block_table.shape[0])

    @property
    def K(self) -> int:
        """Canonical key rows: every slot of the block table, ``max_pages * page_size``."""
        return int(self.block_table.shape[1] * self.page_size)

    def _slots(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(page, slot, read) of every canonical key row: each (B, K)."""
        t = np.arange(self.K)
        used = self._used(self.block_table, self.seqlens, self.page_size)  # (B, max_pages)
        read = np.repeat(used, self.page_size, axis=1)  # (B, K): blocks the sequence reads
        page = np.where(read, np.repeat(self.block_table, self.page_size, axis=1), 0)
        slot = np.broadcast_to(t % self.page_size, page.shape)
        return page, slot, read

    def _gather(self, pages: np.ndarray) -> np.ndarray:
        page, slot, read = self._slots()
        out = pages[page, slot]  # (B, K, Hkv, D); unread blocks read page 0, then zeroed
        out = np.where(read[..., None, None], out, 0.0)
        return np.ascontiguousarray(out.transpose(0, 2, 1, 3))  # (B, Hkv, K, D)

    def keys(self) -> np.ndarray:
        """Canonical keys (B, Hkv, K, Dk): the pages gathered in block-table order (rows of
        blocks the sequence does not read are 0; they are invalid keys)."""
        return self._gather(self.k_pages)

    def values(self) -> np.ndarray:
        """Canonical values (B, Hkv, K, Dv), like :meth:`keys`."""
        return self._gather(self.v_pages)

    def key_valid(self) -> np.ndarray:
        """(B, K) bool: slot t of sequence b holds a token iff ``t < seqlens[b]``."""
        return np.arange(self.K)[None, :] < self.seqlens[:, None]

    def referenced(self) -> np.ndarray:
        """(num_pages, page_size) bool: the page slots some sequence's valid key reads."""
        out = np.zeros(self.k_pages.shape[:2], dtype=bool)
        page, slot, read = self._slots()
        valid = read & self.key_valid()
        out[page[valid], slot[valid]] = True
        return out

    def scatter(self, grad: np.ndarray, name: str) -> np.ndarray:
        """Map a canonical (B, Hkv, K, D) gradient back onto pages (the inverse gather).

        Each page slot receives the gradient of the one canonical key that reads it, or with
        ``shared_pages`` the sum over the keys that read it; unreferenced slots get 0.
        """
        g = as_array(name, grad)
        check_float64(name, g)
        B, Hkv, K, D = g.shape if g.ndim == 4 else (None, None, None, None)
        if g.ndim != 4 or (B, K) != (self.B, self.K) or Hkv != self.k_pages.shape[2]:
            raise RefAttnError(f"{name}: expected shape [B={self.B}, Hkv={self.k_pages.shape[2]},"
                               f" K={self.K}, D], got {list(g.shape)}")
        out = np.zeros((*self.k_pages.shape[:3], D))  # (num_pages, page_size, Hkv, D)
        page, slot, read = self._slots()
        valid = read & self.key_valid()  # (B, K)
        b_idx, t_idx = np.nonzero(valid)
        rows = g[b_idx, :, t_idx, :]  # (n, Hkv, D)
        if self.shared_pages:  # a slot read by several sequences: the sum of their gradients
            np.add.at(out, (page[b_idx, t_idx], slot[b_idx, t_idx]), rows)
        else:  # one reader per slot: stored as computed (a -0.0 stays -0.0)
            out[page[b_idx, t_idx], slot[b_idx, t_idx]] = rows
        return out

    def page_gradients(self, grads: Any) -> PageGradients:
        """The page gradients from the canonical call's :class:`~refattn.Gradients`.

        Examples
        --------
        >>> import refattn
        >>> kp = np.random.default_rng(0).standard_normal((3, 2, 1, 4))
        >>> pc = paged_call(np.ones((1, 1, 1, 4)), kp, kp, np.array([[2, 0]]), np.array([3]), 2)
        >>> g = pc.paged.page_gradients(refattn.backward(refattn.forward(pc.call),
        ...                                               np.ones((1, 1, 1, 4))))
        >>> g.grad_k_pages.shape, bool((g.grad_k_pages[1] == 0).all())   # page 1: unread
        ((3, 2, 1, 4), True)
        """
        return PageGradients(self.scatter(grads.grad_k, "grad_k"),
                             self.scatter(grads.grad_v, "grad_v"))

    def tensors(self) -> dict[str, np.ndarray]:
        """The paged inputs as given, under their golden names."""
        return {"k_pages": self.k_pages, "v_pages": self.v_pages,
                "block_table": self.block_table, "seqlens": self.seqlens}

    def conventions(self) -> dict[str, Any]:
        """What a golden manifest records about the paged layout."""
        out: dict[str, Any] = {
            "kv_layout": "paged", "page_size": self.page_size, "page_layout": PAGE_LAYOUT,
            "block_table": "token t of sequence b: page block_table[b, t // page_size], "
                           "slot t % page_size; entries past a sequence's last page unread",
            "cache_offset": "query i of sequence b at position seqlens[b] - Q + i"}
        if self.shared_pages:  # recorded only when set: other manifests stay as they were
            out["shared_pages"] = True
        return out


@dataclass(frozen=True, eq=False)
class PagedCall:
    """The canonical call of a paged cache and the paged inputs it was built from."""

    call: AttentionCall
    paged: PagedKV


def paged_call(q: Any, k_pages: Any, v_pages: Any, block_table: Any, seqlens: Any,
               page_size: int, *, causal: bool = True,
               window: tuple[int | None, int | None] | None = None,
               shared_pages: bool = False, **call_kwargs: Any) -> PagedCall:
    """The canonical call of a decode step over a paged KV cache.

    Parameters
    ----------
    q : (B, Hq, Q, Dk) float64 ndarray
        The Q newest tokens of each sequence (already in the cache).
    k_pages : (num_pages, page_size, Hkv, Dk) float64 ndarray
    v_pages : (num_pages, page_size, Hkv, Dv) float64 ndarray
    block_table : (B, max_pages) integer ndarray
    seqlens : (B,) integer ndarray
        Tokens in each sequence's cache (the new ones included).
    page_size : int
    causal : bool
        True (default): query i of sequence b reads keys at positions up to
        ``seqlens[b] - Q + i`` (cache-offset causal); False: every valid key.
    window : (left, right), optional
        A sliding window around each query's position: at most ``left`` keys before it and
        ``right`` after it (None: unbounded on that side; the excludes-query convention of
        :func:`refattn.masks.relation`, FlashAttention's ``window_size`` with None for -1).
        With ``causal`` the keys after the query are excluded anyway.
    shared_pages : bool
        Blocks may share pages (see :class:`PagedKV`).
    **call_kwargs
        Any other :class:`~refattn.AttentionCall` keyword (bias, sink, softcap, head_map,
        scale, dropout, ...).

    Returns
    -------
    PagedCall
        ``.call`` (keys ``(B, Hkv, max_pages * page_size, Dk)``, visibility a cache-layout
        relation with explicit positions) and ``.paged`` (the inputs as given, with
        :meth:`PagedKV.page_gradients`).

    Raises
    ------
    RefAttnError
        As :class:`PagedKV` and :class:`~refattn.AttentionCall`; ``visible=`` is refused
        (the block table and seqlens define it).

    Examples
    --------
    >>> import refattn
    >>> rng = np.random.default_rng(0)
    >>> kp, vp = rng.standard_normal((4, 2, 1, 4)), rng.standard_normal((4, 2, 1, 4))
    >>> pc = paged_call(rng.standard_normal((2, 2, 1, 4)), kp, vp,
    ...                 np.array([[3, 1], [0, -1]]), np.array([4, 2]), 2)
    >>> pc.call.axes["K"], pc.call.relation.q_pos.tolist(), pc.call.relation.layout
    (4, [[3], [1]], 'cache')
    """
    if "visible" in call_kwargs:
        raise RefAttnError("visible: a paged call's visibility comes from block_table and "
                           "seqlens (cache-offset causal); do not pass visible=")
    if not isinstance(causal, (bool, np.bool_)):
        raise RefAttnError(f"causal: expected True or False, got {causal!r}")
    paged = PagedKV(k_pages, v_pages, block_table, seqlens, page_size, shared_pages)
    q_arr = as_array("q", q)
    if q_arr.ndim != 4 or q_arr.shape[0] != paged.B:
        raise RefAttnError(f"q: expected shape [B={paged.B}, Hq, Q, Dk] (B = block_table "
                           f"rows), got {list(q_arr.shape)}")
    Q = q_arr.shape[2]
    q_pos = paged.seqlens[:, None] - Q + np.arange(Q)[None, :]  # (B, Q) cache offsets
    k_pos = np.broadcast_to(np.arange(paged.K), (paged.B, paged.K))  # (B, K)
    positional = bool(causal) or window is not None
    rel = relation(q_pos, k_pos, paged.key_valid(), causal=bool(causal), window=window,
                   layout="cache", alignment="explicit_positions" if positional else None)
    call = AttentionCall(q_arr, paged.keys(), paged.values(), visible=rel, **call_kwargs)
    return PagedCall(call, paged)
