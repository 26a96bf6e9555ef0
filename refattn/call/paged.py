"""Paged KV caches: keys and values read from fixed-size pages through a block table.

Owns :func:`paged_call`, which turns a decode kernel's paged inputs (FlashAttention's
``k_cache`` / ``v_cache`` of shape ``(num_pages, page_size, Hkv, D)`` with ``block_table`` and
``cache_seqlens``, the layout vLLM's paged attention reads through its block tables) into the
canonical :class:`~refattn.AttentionCall` with the cache-offset visibility, and
:class:`PagedKV`, which keeps the paged inputs as given (for a golden file that a paged kernel
reads directly) and maps the canonical key/value gradients back onto the pages.

Convention: sequence b holds ``seqlens[b]`` tokens; token t of it lives in page
``block_table[b, t // page_size]`` at slot ``t % page_size``. The canonical keys are the
slots of the blocks the longest sequence reads, in order, ``K = max_pages * page_size`` with
``max_pages = max_b ceil(seqlens[b] / page_size)``; key slot t is valid iff
``t < seqlens[b]``; the Q queries are the last Q tokens of their sequence (absolute positions
``seqlens[b] - Q + i``, the cache offset), causal by coordinates. Block-table entries past a
sequence's last page are not read (they may hold any value, e.g. -1 padding), and columns past
the longest sequence's last page are dropped: everything is sized from the blocks actually
read, never from the table's declared width (a (1, 2**20) table padded with -1 whose one
sequence reads one block costs one block). A call whose gathered keys and values would need
more memory than is available is refused before anything is gathered
(:func:`refattn._memory.check_bytes`). Defers the relation to :mod:`refattn.masks` and the
arithmetic to the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
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
from refattn.errors import RefAttnError
from refattn.masks import relation

__all__ = ["PAGE_LAYOUT", "PageGradients", "PagedKV", "gather_bytes",
           "paged_call"]

#: how a paged call too large for the memory asks for less
READ_LESS = "read fewer tokens (cache_seqlens) or fewer heads per call"

#: the page tensor layout (FlashAttention ``flash_attn_with_kvcache`` with ``block_table``)
PAGE_LAYOUT = "(num_pages, page_size, Hkv, D)"


@dataclass(frozen=True)
class PageGradients:
    """Gradients of the page tensors (pages and slots no sequence reads are exactly 0)."""

    grad_k_pages: np.ndarray
    """(num_pages, page_size, Hkv, Dk) float64."""
    grad_v_pages: np.ndarray
    """(num_pages, page_size, Hkv, Dv) float64."""


def gather_bytes(B: int, K: int, Hkv: int, Dk: int, Dv: int) -> int:
    """Peak bytes of gathering a paged cache's canonical keys and values (B, Hkv, K, D) and
    of the call that holds them (an upper estimate: the gather's slot tables, its gathered,
    masked and transposed copies, the kept keys and values and the call's own copies).

    Examples
    --------
    >>> gather_bytes(1, 2**24, 8, 128, 128) // 2**30   # 16 Mi tokens of 8 heads of 128
    1025
    """
    return 8 * B * K * (4 * Hkv * (Dk + Dv) + 8)


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


@public
@dataclass(frozen=True, eq=False)
class PagedKV:
    """A paged KV cache as given, with the gather to canonical keys and its inverse.

    Attributes
    ----------
    k_pages : (num_pages, page_size, Hkv, Dk) float64 ndarray
    v_pages : (num_pages, page_size, Hkv, Dv) float64 ndarray
    block_table : (B, max_pages) int64 ndarray
        Page of each block of each sequence; given with any number of columns, it keeps the
        ``max_pages = max_b ceil(seqlens[b] / page_size)`` that some sequence reads (the
        columns after them are never read).
    seqlens : (B,) int64 ndarray
        Tokens in each sequence's cache, ``1 <= seqlens[b] <= columns * page_size`` (the
        columns of the table as given).
    page_size : int
    shared_pages : bool
        False (default): each page belongs to one block. True: blocks may share a page (prefix
        caching: sequences that start alike read the same pages); a shared page's gradient is
        then the sum over the blocks that read it.

    Raises
    ------
    RefAttnError
        On non-float64 or non-finite pages, mismatched page shapes, a page size that does
        not match the pages (or is not an integer), a sequence length out of range, a
        block-table entry that a sequence reads out of range (naming ``block_table[b, p]``
        and its value), or, unless ``shared_pages``, one
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
        ps = bounded_int("page_size", self.page_size, lo=1, hi=INT64_MAX)
        if kp.shape[1] != ps:
            raise RefAttnError(f"page_size: {ps} but k_pages holds {kp.shape[1]} slots per "
                               f"page (layout {PAGE_LAYOUT})")
        given = as_array("block_table", self.block_table)
        if given.dtype.kind not in "iu":
            raise RefAttnError(f"block_table: expected an integer array, got dtype "
                               f"{given.dtype}")
        if given.ndim != 2:
            raise RefAttnError(f"block_table: expected 2 axes, got shape {list(given.shape)}")
        B, columns = given.shape
        if B == 0 or columns == 0:
            raise RefAttnError(f"block_table: expected a non-empty [B, max_pages], got "
                               f"{list(given.shape)}")
        capacity = columns * ps
        lens = index_array("seqlens", self.seqlens, lo=1, hi=capacity, ndim=1, letters="b",
                           expected=f"1 <= seqlens[b] <= max_pages * page_size = {capacity}")
        if lens.shape != (B,):
            raise RefAttnError(f"seqlens: expected shape [B={B}] (one per block-table row), "
                               f"got {list(lens.shape)}")
        if not isinstance(self.shared_pages, (bool, np.bool_)):
            raise RefAttnError(f"shared_pages: expected True or False, got {self.shared_pages!r}")
        num_pages = kp.shape[0]
        read = int(-(-int(lens.max()) // ps))  # blocks of the longest sequence: all that is read
        used = self._used(given[:, :read], lens, ps)  # (B, read)
        table = index_array("block_table", given[:, :read], lo=0, hi=num_pages - 1,
                            used=used, letters="bp",
                            expected=f"a page in [0, {num_pages}) (num_pages of k_pages)")
        owner: dict[int, tuple[int, int]] = {}
        if not self.shared_pages:
            for b, p in zip(*np.nonzero(used), strict=True):
                page = int(table[b, p])
                if page in owner:
                    b0, p0 = owner[page]
                    raise RefAttnError(
                        f"block_table: overlapping pages: entries (b={b0}, p={p0}) and (b={b}, "
                        f"p={p}) both read page {page}; each page must belong to one block "
                        "(shared_pages=True for a shared prefix)")
                owner[page] = (int(b), int(p))
        table = immutable_copy(table)  # never writeable again
        lens = immutable_copy(lens)
        set_(self, "k_pages", kp)
        set_(self, "v_pages", vp)
        set_(self, "block_table", table)
        set_(self, "seqlens", lens)
        set_(self, "page_size", ps)
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
        """Canonical key rows: every slot of the blocks read, ``max_pages * page_size``."""
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
        check_bytes(gather_bytes(self.B, self.K, pages.shape[2], pages.shape[3], 0),
                    f"gathering (B, K) = ({self.B}, {self.K}) canonical keys or values", READ_LESS)
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

    def gradient_tensors(self, grads: Any) -> dict[str, np.ndarray]:
        """:meth:`page_gradients` under their golden names (the layout protocol of
        :mod:`refattn.bundle.golden.layouts`)."""
        pages = self.page_gradients(grads)
        return {"grad_k_pages": pages.grad_k_pages, "grad_v_pages": pages.grad_v_pages}

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


@public
@dataclass(frozen=True, eq=False)
class PagedCall:
    """The canonical call of a paged cache and the paged inputs it was built from."""

    call: AttentionCall
    paged: PagedKV


@public
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
        ``.call`` (keys ``(B, Hkv, max_pages * page_size, Dk)``, ``max_pages`` the blocks
        the longest sequence reads; visibility a cache-layout
        relation with explicit positions) and ``.paged`` (the inputs as given, with
        :meth:`PagedKV.page_gradients`).

    Raises
    ------
    RefAttnError
        As :class:`PagedKV` and :class:`~refattn.AttentionCall`; ``visible=`` is refused
        (the block table and seqlens define it); a call whose keys and values would need more
        memory than is available (:func:`gather_bytes`) is refused before they are gathered.

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
    extra = sum(2 * x.nbytes for x in (q_arr, *call_kwargs.values()) if isinstance(x, np.ndarray))
    Hkv, Dk, Dv = paged.k_pages.shape[2], paged.k_pages.shape[3], paged.v_pages.shape[3]
    check_bytes(gather_bytes(paged.B, paged.K, Hkv, Dk, Dv) + extra,
                f"the paged call of (B, Hkv, K) = ({paged.B}, {Hkv}, {paged.K}) keys", READ_LESS)
    q_pos = paged.seqlens[:, None] - Q + np.arange(Q)[None, :]  # (B, Q) cache offsets
    k_pos = np.broadcast_to(np.arange(paged.K), (paged.B, paged.K))  # (B, K)
    positional = bool(causal) or window is not None
    rel = relation(q_pos, k_pos, paged.key_valid(), causal=bool(causal), window=window,
                   layout="cache", alignment="explicit_positions" if positional else None)
    call = AttentionCall(q_arr, paged.keys(), paged.values(), visible=rel, **call_kwargs)
    return PagedCall(call, paged)
