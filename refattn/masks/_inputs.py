"""Input checks for visibility coordinates: integer positions, segments, prefixes, windows.

Owns turning caller-supplied coordinates into read-only int64 / bool arrays of the documented
shapes, and every rejection that goes with it. Defers the predicate itself to
:mod:`refattn.masks`.
"""

from __future__ import annotations

import numbers
from typing import Any, SupportsInt, TypeGuard

import numpy as np

from refattn._checks import (
    INT64_MAX,
    INT64_MIN,
    as_array,
    bounded_int,
    check_bool,
    check_shape,
    first_index,
    format_index,
    immutable_copy,
    index_array,
)
from refattn.errors import RefAttnError

__all__ = [
    "POSITION_MAX",
    "POSITION_MIN",
    "WindowBound",
    "frozen",
    "head_count",
    "int_array",
    "int_coordinates",
    "key_validity",
    "prefix_lengths",
    "window_bounds",
]

#: one side of a window: unbounded (None), one bound for every head, or one bound per head
WindowBound = int | np.ndarray | None
#: the range of a query or key position: the difference of two positions (what a window bound
#: is compared with, here and in every kernel) then fits in int64
POSITION_MIN, POSITION_MAX = -(2**62), 2**62 - 1


def frozen(x: np.ndarray) -> np.ndarray:
    """A read-only C-contiguous copy of ``x`` (positions, segments, lengths, bounds) that
    nobody can make writeable again (:func:`refattn._checks.immutable_copy`)."""
    return immutable_copy(x)


def _is_int_scalar(x: Any) -> TypeGuard[SupportsInt]:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def int_array(name: str, x: object) -> np.ndarray:
    """``x`` as int64 when it holds integers that fit (no float, bool or wrapping uint64).

    Examples
    --------
    >>> int_array("lengths", np.array([3, 4], dtype=np.uint8)).tolist()
    [3, 4]
    """
    arr = index_array(name, x, lo=INT64_MIN, hi=INT64_MAX)  # lossless: integers only
    return np.array(arr, dtype=np.int64)  # a copy: never the caller's array


def int_coordinates(
    name: str, x: object, shape: tuple[int, ...] | None, letters: str, *,
    lo: int = INT64_MIN, hi: int = INT64_MAX,
) -> np.ndarray:
    """Integer coordinates of an exact 2-D shape (``shape=None``: any 2-D shape), each in
    ``[lo, hi]`` (positions: :data:`POSITION_MIN`, :data:`POSITION_MAX`).

    Examples
    --------
    >>> int_coordinates("q_pos", [[0, 1]], (1, 2), "B,Q").dtype
    dtype('int64')
    >>> try:
    ...     int_coordinates("k_pos", [[0, 2**62]], None, "B,K", lo=POSITION_MIN,
    ...                     hi=POSITION_MAX)
    ... except RefAttnError as exc:
    ...     print(str(exc)[:60])
    k_pos: entry (b=0, k=1) is 4611686018427387904, expected a v
    """
    arr = np.array(index_array(name, x, lo=lo, hi=hi, letters=letters.lower().split(",")))
    if shape is None:
        if arr.ndim != 2:
            raise RefAttnError(f"{name}: expected shape [{letters}], got {list(arr.shape)}")
    else:
        check_shape(name, arr, shape, letters)
    return frozen(arr)


def key_validity(x: object, shape: tuple[int, int]) -> np.ndarray:
    """``key_valid`` as a read-only (B, K) bool array (None: every key is valid)."""
    if x is None:
        return frozen(np.ones(shape, dtype=bool))
    arr = as_array("key_valid", x)
    check_bool("key_valid", arr)
    check_shape("key_valid", arr, shape, "B,K")
    return frozen(arr)


def prefix_lengths(x: object, B: int) -> np.ndarray:
    """``prefix_length`` as (B,) or (B, H) non-negative int64 (a scalar is shared by rows)."""
    arr = int_array("prefix_length", x)
    if arr.ndim == 0:
        arr = np.broadcast_to(arr, (B,))
    if arr.ndim not in (1, 2) or arr.shape[0] != B:
        raise RefAttnError(
            f"prefix_length: expected a scalar, shape [B={B}] or [B={B},H], "
            f"got {list(arr.shape)}"
        )
    idx = first_index(arr < 0)
    if idx is not None:
        raise RefAttnError(
            f"prefix_length: entry {format_index(idx)} is {int(arr[idx])}, expected >= 0"
        )
    return frozen(arr)


def _window_side(name: str, x: object) -> WindowBound:
    if x is None:
        return None
    if _is_int_scalar(x):
        if int(x) < 0:
            raise RefAttnError(
                f"window: {name} bound is {int(x)}, expected >= 0 (None means unbounded)"
            )
        # int64 like every kernel's bound; at 2**63 - 1 it bounds nothing (positions differ
        # by less)
        return bounded_int(f"window {name}", x, lo=0, hi=INT64_MAX)
    if isinstance(x, (bool, np.bool_, float, np.floating)):
        raise RefAttnError(
            f"window: {name} bound must be an int, None or an (H,) int array, got {x!r}"
        )
    arr = int_array(f"window {name}", x)
    if arr.ndim != 1 or arr.size == 0:
        raise RefAttnError(
            f"window: per-head {name} bounds must have shape [H], got {list(arr.shape)}"
        )
    idx = first_index(arr < 0)
    if idx is not None:
        raise RefAttnError(
            f"window: {name} bound of head h={idx[0]} is {int(arr[idx])}, expected >= 0"
        )
    return frozen(arr)


def window_bounds(window: Any) -> tuple[WindowBound, WindowBound] | None:
    """``window`` as ``(left, right)``: each None, an int >= 0, or an (H,) int64 array."""
    if window is None:
        return None
    if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
        raise RefAttnError(
            f"window: expected a pair (left, right) of keys before / after the query, "
            f"got {window!r}"
        )
    left = _window_side("left", window[0])
    right = _window_side("right", window[1])
    if left is None and right is None:
        raise RefAttnError("window: (None, None) restricts nothing; pass window=None")
    return (left, right)


def head_count(
    prefix: np.ndarray | None, window: tuple[WindowBound, WindowBound] | None
) -> int:
    """The head axis size implied by per-head prefixes and windows (1 when all are shared)."""
    sizes: dict[str, int] = {}
    if prefix is not None and prefix.ndim == 2:
        sizes["prefix_length"] = prefix.shape[1]
    if window is not None:
        for side, bound in zip(("left", "right"), window, strict=True):
            if isinstance(bound, np.ndarray):
                sizes[f"window {side}"] = bound.shape[0]
    if len(set(sizes.values())) > 1:
        listed = ", ".join(f"{k} H={v}" for k, v in sizes.items())
        raise RefAttnError(f"head axis: per-head inputs disagree on H ({listed})")
    return next(iter(sizes.values()), 1)
