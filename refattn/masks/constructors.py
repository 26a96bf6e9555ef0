"""Visibility from coordinates: the contract's one predicate compiler.

Owns the constructors :func:`relation`, :func:`compile_visibility`, :func:`causal` and
:func:`from_positions`, which build a :class:`~refattn.masks.relation.VisibilityRelation` from
named conventions (alignment, layout, window convention). Lowering to framework encodings
belongs to :mod:`refattn.masks.framework`, block metadata to :mod:`refattn.masks.blocks`;
applying the relation to scores belongs to :class:`refattn.AttentionCall` and the engine.

Polarity inside refattn is always True = the edge (query i reads key j) exists.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from refattn._boundary import public
from refattn._checks import INT64_MAX, as_array, bounded_int
from refattn._memory import check_bytes
from refattn.errors import RefAttnError
from refattn.masks._inputs import WindowBound, window_bounds
from refattn.masks.relation import (
    _CONVENTIONS,
    Alignment,
    Layout,
    VisibilityRelation,
    WindowConvention,
)
from refattn.masks.windows import window_from_inclusive

__all__ = ["CausalAlignment", "causal", "compile_visibility", "from_positions", "relation"]

CausalAlignment = Literal["upper_left", "lower_right"]


@public
def relation(
    q_pos: Any,
    k_pos: Any,
    key_valid: Any = None,
    *,
    causal: bool = False,
    q_segment: Any = None,
    k_segment: Any = None,
    prefix_length: Any = None,
    window: tuple[WindowBound, WindowBound] | None = None,
    layout: Layout | None = None,
    alignment: Alignment | None = None,
    window_convention: WindowConvention = "excludes_query",
) -> VisibilityRelation:
    """Build a :class:`VisibilityRelation` from coordinates (see its docstring for the predicate).

    Parameters
    ----------
    q_pos : (B, Q) integer array_like
    k_pos : (B, K) integer array_like
    key_valid : (B, K) bool array_like, optional
        True = the key may contribute; default every key is valid.
    causal : bool
        Key coordinate <= query coordinate. Rejected together with ``prefix_length``.
    q_segment, k_segment : (B, Q), (B, K) integer array_like, optional
        Packed-document ids (both or neither).
    prefix_length : int, (B,) or (B, H) integer array_like, optional
    window : (left, right), optional
        Keys strictly before / after the query (or counting the query itself when
        ``window_convention="includes_query"``; converted by :func:`window_from_inclusive`).
    layout, alignment : str, optional
        Labels; see :class:`VisibilityRelation`.
    window_convention : {"excludes_query", "includes_query"}

    Returns
    -------
    VisibilityRelation

    Raises
    ------
    RefAttnError
        On non-integer coordinates, shape mismatches, segments on one side only, a prefix
        combined with ``causal=True``, a negative window or prefix, or a label that
        contradicts the coordinates.

    Examples
    --------
    >>> rel = relation([[0, 1, 2]], [[0, 1, 2]], causal=True, window=(2, 1),
    ...                window_convention="includes_query")
    >>> rel.window, rel.manifest()["window"]["given"]
    (Window(left=1, right=0), [2, 1])
    """
    if window_convention not in _CONVENTIONS:
        raise RefAttnError(
            f"window_convention: expected one of {list(_CONVENTIONS)}, got {window_convention!r}"
        )
    if window is not None and window_convention == "includes_query":
        left, right = window_bounds(window) or (None, None)
        window = window_from_inclusive(left, right)
    return VisibilityRelation(
        q_pos, k_pos, key_valid, causal=causal, q_segment=q_segment, k_segment=k_segment,
        prefix_length=prefix_length, window=window, layout=layout, alignment=alignment,
        window_convention=window_convention,
    )


@public
def compile_visibility(
    q_pos: Any,
    k_pos: Any,
    key_valid: Any,
    *,
    causal: bool = False,
    q_segment: Any = None,
    k_segment: Any = None,
    prefix_length: Any = None,
    window: tuple[WindowBound, WindowBound] | None = None,
) -> np.ndarray:
    """Compile declared visibility inputs into one dense relation (the contract's compiler).

    Parameters
    ----------
    q_pos : (B, Q) integer array_like
        Absolute or segment-local query coordinates.
    k_pos : (B, K) integer array_like
    key_valid : (B, K) bool array_like or None
    causal : bool
    q_segment, k_segment : (B, Q), (B, K) integer array_like, optional
    prefix_length : int, (B,) or (B, H) integer array_like, optional
    window : (left, right), optional
        Keys strictly before / after the query; None on a side means unbounded; (H,) arrays
        give per-head windows.

    Returns
    -------
    (B, 1, Q, K) bool ndarray, or (B, H, Q, K) when a window or prefix is given per head

    Raises
    ------
    RefAttnError
        As for :func:`relation` (e.g. prefix with a separate causal flag, segments on one
        side only).

    Examples
    --------
    >>> pos = np.array([[0, 1, 2, 0, 1]]); seg = np.array([[0, 0, 0, 1, 1]])
    >>> vis = compile_visibility(pos, pos, None, causal=True, q_segment=seg, k_segment=seg)
    >>> vis[0, 0].astype(int).tolist()
    [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
    """
    return relation(
        q_pos, k_pos, key_valid, causal=causal, q_segment=q_segment, k_segment=k_segment,
        prefix_length=prefix_length, window=window,
    ).dense()


def _length(name: str, n: object) -> int:
    return bounded_int(name, n, lo=1, hi=INT64_MAX)


@public
def causal(q_len: int, k_len: int, *, alignment: CausalAlignment) -> VisibilityRelation:
    """Rectangular causal relation with a named alignment (there is no default).

    ``"upper_left"``: query row i has coordinate i (rows start with the keys).
    ``"lower_right"``: query row i has coordinate ``k_len - q_len + i`` (the queries are the
    last rows of the key history, e.g. a decode chunk). For ``q_len > k_len`` the first
    ``q_len - k_len`` lower-right rows have no legal key.

    Parameters
    ----------
    q_len, k_len : int
        Q and K.
    alignment : {"upper_left", "lower_right"}

    Returns
    -------
    VisibilityRelation
        B = 1, head-shared; ``.dense()`` is (1, 1, Q, K).

    Examples
    --------
    >>> from refattn.masks.render import render
    >>> print(render(causal(2, 5, alignment="upper_left").dense()[0, 0]))
    q\\k  0 1 2 3 4
     0   1 0 0 0 0
     1   1 1 0 0 0
    >>> causal(2, 5, alignment="lower_right").dense()[0, 0].astype(int).tolist()
    [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    """
    Q = _length("q_len", q_len)
    K = _length("k_len", k_len)
    check_bytes(32 * (Q + K), f"a causal relation of (q_len, k_len) = ({Q}, {K})",
                "its positions are held per query and per key")
    layout: Layout
    match alignment:
        case "upper_left":
            offset, layout = 0, "padded"
        case "lower_right":
            offset, layout = K - Q, "cache"
        case _:
            raise RefAttnError(
                f"alignment: expected 'upper_left' or 'lower_right', got {alignment!r}"
            )
    return VisibilityRelation(
        (np.arange(Q) + offset)[None, :], np.arange(K)[None, :], causal=True,
        layout=layout, alignment=alignment,
    )


@public
def from_positions(
    q_pos: Any,
    k_pos: Any,
    *,
    key_valid: Any = None,
    window: tuple[WindowBound, WindowBound] | None = None,
    window_convention: WindowConvention = "excludes_query",
) -> VisibilityRelation:
    """Causal relation from absolute cache positions: key r is visible to query p iff r <= p.

    Parameters
    ----------
    q_pos : (Q,) or (B, Q) integer array_like
        Absolute positions of the current queries (e.g. ``[127]`` for one decode step).
    k_pos : (K,) or (B, K) integer array_like
        Absolute positions of the cached keys.
    key_valid : (K,) or (B, K) bool array_like, optional
        Initialized / non-padding cache slots.
    window, window_convention
        As for :func:`relation`.

    Returns
    -------
    VisibilityRelation
        Layout "cache", alignment "explicit_positions".

    Examples
    --------
    >>> int(from_positions([127], np.arange(128)).dense().sum())   # reads keys 0..127
    128
    """
    def batched(name: str, x: Any) -> Any:
        arr = as_array(name, x)
        if arr.ndim == 1:
            return arr[None, :]
        if arr.ndim != 2:
            raise RefAttnError(f"{name}: expected shape [Q] / [K] or [B,Q] / [B,K], "
                               f"got {list(arr.shape)}")
        return arr

    return relation(
        batched("q_pos", q_pos), batched("k_pos", k_pos),
        None if key_valid is None else batched("key_valid", key_valid),
        causal=True, window=window, window_convention=window_convention, layout="cache",
        alignment="explicit_positions",
    )
