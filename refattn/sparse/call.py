"""The description of one sparse attention call, and its dense equivalent for cross-checks.

Owns :class:`SparseCall` (q, k, v, an :class:`~refattn.sparse.lists.IndexVisibility`, the
scale and an optional per-head sink; validated and copied read-only before any arithmetic),
its memory estimate (:func:`sparse_bytes`) and :func:`to_dense_call`: the same call as a
:class:`refattn.call.AttentionCall` with a dense visible mask, refused (naming the bytes,
before anything is allocated) when the mask would not fit.

Semantics (those of the dense call the lists describe): ``score = scale * q . k``, softmax over
the row's valid keys (and the sink, which joins the denominator with no value row, as in
:class:`~refattn.call.AttentionCall`), output ``sum_s p_s v_j``. Query heads are grouped onto
kv heads (``h // (Hq // Hkv)``), ``Dk != Dv`` is allowed (MLA: 576 / 512). A row with no
valid key and no sink has output 0, zero gradients and ``lse = -inf`` (FlashMLA's output;
its reference reports ``lse = +inf`` for it, which :mod:`refattn.adapters.sparse` returns).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from refattn._boundary import public
from refattn._checks import bounded_float, float64_input, immutable_copy
from refattn._memory import check_bytes
from refattn.call import AttentionCall
from refattn.errors import RefAttnError
from refattn.sparse.lists import IndexVisibility

__all__ = ["DENSE_MASK_LIMIT", "SparseCall", "sparse_bytes", "to_dense_call"]

#: the largest dense mask :func:`to_dense_call` builds unless told otherwise (256 MiB)
DENSE_MASK_LIMIT = 2**28


def _frozen(x: np.ndarray) -> np.ndarray:
    """A private C-ordered read-only copy (one copy: the operands can be large)."""
    out = np.array(x, dtype=np.float64, order="C", copy=True)
    out.flags.writeable = False
    return out


@public
@dataclass(frozen=True, eq=False)
class SparseCall:
    """One attention call whose visibility is per-query key index lists.

    Parameters
    ----------
    q : (B, Hq, Q, Dk) float64 ndarray
    k : (B, Hkv, K, Dk) float64 ndarray
    v : (B, Hkv, K, Dv) float64 ndarray
    visibility : IndexVisibility
        ``(B, H_idx, Q, k)`` lists with ``num_keys == K`` and ``H_idx`` in {1, Hkv, Hq}.
    scale : float, optional
        Positive multiplier of ``q . k``; default ``Dk ** -0.5``.
    sink : (Hq,) float64 ndarray, optional
        Per-head sink logit joining every row's denominator (refattn's ``sink``).

    Examples
    --------
    >>> from refattn.sparse.lists import index_visibility
    >>> x = np.ones((1, 2, 3, 4))
    >>> vis = index_visibility(np.array([[[[0, -1], [1, 0], [2, 1]]]]), 3)
    >>> SparseCall(x, x[:, :1], x[:, :1], vis).scale
    0.5
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    visibility: IndexVisibility
    scale: float | None = None
    sink: np.ndarray | None = None
    index_head: np.ndarray = field(init=False, repr=False)
    kv_head: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        q = float64_input("q", self.q, 4)
        k = float64_input("k", self.k, 4)
        v = float64_input("v", self.v, 4)
        B, Hq, Q, Dk = q.shape
        Bk, Hkv, K, Dk2 = k.shape
        if 0 in q.shape or 0 in k.shape or 0 in v.shape:
            raise RefAttnError("q/k/v: every axis must be non-empty")
        if Bk != B or v.shape[0] != B or v.shape[1] != Hkv or v.shape[2] != K or Dk2 != Dk:
            raise RefAttnError(f"q/k/v: shapes {list(q.shape)}, {list(k.shape)}, "
                               f"{list(v.shape)} do not agree on B, Hkv, K, Dk")
        if Hq % Hkv:
            raise RefAttnError(f"q: Hq={Hq} is not a multiple of k's Hkv={Hkv}")
        vis = self.visibility
        if not isinstance(vis, IndexVisibility) or not vis.checked:
            what = "one built by hand" if isinstance(vis, IndexVisibility) else type(vis).__name__
            raise RefAttnError("visibility: expected an IndexVisibility built (and checked) by "
                               f"index_visibility() or block_visibility(), got {what}")
        vb, _, vq, _ = vis.shape
        if vb != B or vq != Q or vis.num_keys != K:
            raise RefAttnError(f"indices: lists (B={vb}, Q={vq}, num_keys={vis.num_keys}) do "
                               f"not match the call's B={B}, Q={Q}, K={K}")
        index_head = vis.index_head(Hq, Hkv)
        scale = Dk ** -0.5 if self.scale is None else bounded_float(
            "scale", self.scale, lo=0.0, lo_open=True)
        sink = None
        if self.sink is not None:
            sink = float64_input("sink", self.sink, 1)
            if sink.shape != (Hq,):
                raise RefAttnError(f"sink: expected shape [{Hq}] (Hq), got {list(sink.shape)}")
            sink = immutable_copy(sink)
        kv_head = np.arange(Hq, dtype=np.int64) // (Hq // Hkv)
        for name, value in (("q", _frozen(q)), ("k", _frozen(k)), ("v", _frozen(v)),
                            ("scale", float(scale)), ("sink", sink),
                            ("index_head", index_head), ("kv_head", kv_head)):
            object.__setattr__(self, name, value)

    @property
    def axes(self) -> dict[str, int]:
        """``B, Hq, Hkv, Q, K, Dk, Dv, H_idx, k``."""
        B, Hq, Q, Dk = self.q.shape
        _, Hkv, K, Dv = self.v.shape
        _, H, _, kk = self.visibility.shape
        return {"B": B, "Hq": Hq, "Hkv": Hkv, "Q": Q, "K": K, "Dk": Dk, "Dv": Dv, "H_idx": H,
                "k": kk}

    def empty_rows(self) -> np.ndarray:
        """``(B, Hq, Q)`` bool: rows with no valid key."""
        return self.visibility.counts[:, self.index_head, :] == 0


@public
def sparse_bytes(call: SparseCall, stage: Literal["forward", "backward"] = "backward") -> int:
    """Upper estimate of the bytes a sparse forward (or backward) allocates beyond its inputs:
    the outputs, the row statistics and (backward) the key-major transposed lists.

    Examples
    --------
    >>> from refattn.sparse.lists import index_visibility
    >>> x = np.ones((1, 1, 2, 4))
    >>> sparse_bytes(SparseCall(x, x, x, index_visibility(np.array([[[[0], [1]]]]), 2)))
    368
    """
    a = call.axes
    rows = a["B"] * a["Hq"] * a["Q"]
    fwd = 8 * rows * (a["Dv"] + 3)
    if stage == "forward":
        return fwd
    nnz = a["B"] * a["H_idx"] * a["Q"] * a["k"]
    grads = 8 * (rows * (a["Dk"] + 2) + a["B"] * a["Hkv"] * a["K"] * (a["Dk"] + a["Dv"]))
    return fwd + grads + 4 * nnz + 8 * (a["B"] * a["H_idx"] * a["K"] + 1)


@public
def to_dense_call(call: SparseCall, *, max_mask_bytes: int = DENSE_MASK_LIMIT) -> AttentionCall:
    """The same call as an :class:`~refattn.call.AttentionCall` with a dense visible mask.

    The mask is ``(B, 1, Q, K)`` when ``H_idx`` is 1, else ``(B, Hq, Q, K)``. Rows with no
    valid key (and no sink) become ``query_valid=False`` rows under
    ``all_masked_rows="sanitize_then_zero_invalid_query"`` (output 0, zero gradients, as the
    sparse engine gives); that needs such a row to be empty for every head.

    Parameters
    ----------
    call : SparseCall
    max_mask_bytes : int
        The largest mask built (default :data:`DENSE_MASK_LIMIT`, 256 MiB); the memory
        available is checked too.

    Raises
    ------
    RefAttnError
        ``dense mask: ... needs N bytes ...`` before allocating, when the mask is larger than
        ``max_mask_bytes`` or the memory available.

    Examples
    --------
    >>> from refattn.sparse.lists import index_visibility
    >>> x = np.ones((1, 1, 2, 4))
    >>> dense = to_dense_call(SparseCall(x, x, x, index_visibility(np.array([[[[0], [1]]]]), 2)))
    >>> dense.visible_array()[0, 0].tolist()
    [[True, False], [False, True]]
    """
    a = call.axes
    vis = call.visibility
    H = 1 if a["H_idx"] == 1 else a["Hq"]
    need = a["B"] * H * a["Q"] * a["K"]
    if need > max_mask_bytes:
        raise RefAttnError(
            f"dense mask: the call's (B={a['B']}, {H}, Q={a['Q']}, K={a['K']}) bool mask needs "
            f"{need} bytes ({need / 2**30:.2f} GiB), more than max_mask_bytes="
            f"{max_mask_bytes}; the dense engine would hold (B, Hq, Q, K) float64 arrays of "
            f"{8 * a['B'] * a['Hq'] * a['Q'] * a['K']} bytes each: use the sparse engine "
            "(refattn.sparse.sparse_forward) instead")
    check_bytes(need, "building the dense mask of the index lists")
    mask = np.zeros((a["B"], H, a["Q"], a["K"]), bool)
    heads = np.zeros(1, np.int64) if H == 1 else call.index_head
    for hh, ih in enumerate(heads):
        for b in range(a["B"]):
            idx = vis.indices[b, ih]  # (Q, k)
            rows, slots = np.nonzero(idx >= 0)
            mask[b, hh, rows, idx[rows, slots]] = True
    kwargs: dict[str, Any] = {}
    empty = call.empty_rows()
    if call.sink is None and empty.any():
        per_query = empty.all(axis=1)  # (B, Q)
        if (empty.any(axis=1) != per_query).any():
            b, i = (int(x) for x in np.argwhere(empty.any(axis=1) != per_query)[0])
            raise RefAttnError(
                f"dense mask: row (b={b}, i={i}) is empty for some heads but not all; the dense "
                "call's query_valid is per query, so it cannot zero one head's row: give a sink "
                "or a valid key")
        kwargs = {"query_valid": ~np.asarray(per_query)[:, None, :, None],
                  "all_masked_rows": "sanitize_then_zero_invalid_query"}
    return AttentionCall(call.q, call.k, call.v, visible=mask, scale=call.scale,
                         sink=call.sink, **kwargs)
