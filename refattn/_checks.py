"""Validation helpers shared by every public entry point.

Each helper raises :class:`~refattn.errors.RefAttnError` with the tensor's name, the offending
index or axis and the expectation. None of them casts: a non-float64 array is an error.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from refattn.errors import RefAttnError

__all__ = [
    "as_array",
    "check_bool",
    "check_broadcastable",
    "check_finite",
    "check_float64",
    "check_shape",
    "first_index",
    "float64_input",
    "format_index",
]


def as_array(name: str, x: object) -> np.ndarray:
    """Return ``x`` as an ndarray without changing its dtype (DLPack/``__array__`` accepted)."""
    if isinstance(x, np.ndarray):
        return x
    try:
        return np.asarray(x)
    except Exception as exc:  # pragma: no cover - exotic objects
        raise RefAttnError(f"{name}: cannot be read as an array ({exc})") from None


def format_index(index: Sequence[int], letters: Sequence[str] | None = None) -> str:
    """Render an index as ``(b=0, h=1, i=3)`` when letters are given, else ``(0, 1, 3)``."""
    if letters is not None and len(letters) == len(index):
        return "(" + ", ".join(f"{a}={int(i)}" for a, i in zip(letters, index, strict=True)) + ")"
    return "(" + ", ".join(str(int(i)) for i in index) + ")"


def first_index(mask: np.ndarray) -> tuple[int, ...] | None:
    """Index of the first True element of ``mask`` in C order, or None."""
    flat = np.flatnonzero(mask)
    if flat.size == 0:
        return None
    return tuple(int(i) for i in np.unravel_index(flat[0], mask.shape))


def check_float64(name: str, x: np.ndarray) -> None:
    """Reject anything that is not float64 (no silent cast)."""
    if x.dtype != np.float64:
        raise RefAttnError(f"{name}: expected dtype float64, got {x.dtype} (refattn never casts)")


def check_bool(name: str, x: np.ndarray) -> None:
    """Reject non-bool masks (an int or float 'mask' hides its polarity)."""
    if x.dtype != np.bool_:
        raise RefAttnError(
            f"{name}: expected dtype bool with True meaning legal, got {x.dtype}"
        )


def check_finite(name: str, x: np.ndarray) -> None:
    """Reject NaN and +/-inf, naming the first offending index and its value."""
    bad = ~np.isfinite(x)
    idx = first_index(bad)
    if idx is not None:
        raise RefAttnError(
            f"{name}: non-finite value {x[idx].item()!r} at index {format_index(idx)}; "
            "expected finite float64"
        )


def float64_input(name: str, x: object, ndim: int | tuple[int, ...] | None = None) -> np.ndarray:
    """Read ``x`` as a finite float64 array with ``ndim`` axes (or one of them); never cast.

    Examples
    --------
    >>> float64_input("w", np.zeros((2, 3)), (2, 3)).shape
    (2, 3)
    >>> float64_input("w", np.zeros(3), 2)
    Traceback (most recent call last):
        ...
    refattn.errors.RefAttnError: w: expected 2 axes, got 1 (shape [3])
    """
    arr = as_array(name, x)
    check_float64(name, arr)
    allowed = (ndim,) if isinstance(ndim, int) else ndim
    if allowed is not None and arr.ndim not in allowed:
        want = " or ".join(str(n) for n in allowed)
        raise RefAttnError(
            f"{name}: expected {want} axes, got {arr.ndim} (shape {list(arr.shape)})"
        )
    check_finite(name, arr)
    return arr


def check_shape(name: str, x: np.ndarray, expected: Sequence[int], letters: str) -> None:
    """Require an exact shape; ``letters`` names the axes for the message."""
    if tuple(x.shape) != tuple(expected):
        exp = "[" + ",".join(f"{a}={n}" for a, n in zip(letters.split(","), expected, strict=True))
        raise RefAttnError(f"{name}: expected shape {exp}], got {list(x.shape)}")


def check_broadcastable(name: str, x: np.ndarray, target: Sequence[int], letters: str) -> None:
    """Require that ``x`` broadcasts to ``target`` without changing ``target``.

    Every axis of ``x`` (aligned from the right) must be 1 or equal the target's size.
    """
    target = tuple(target)
    names = letters.split(",")
    if x.ndim > len(target):
        raise RefAttnError(
            f"{name}: has {x.ndim} axes, expected at most {len(target)} "
            f"(broadcastable to [{letters}] = {list(target)})"
        )
    offset = len(target) - x.ndim
    for axis, size in enumerate(x.shape):
        want = target[offset + axis]
        if size not in (1, want):
            raise RefAttnError(
                f"{name}: axis {axis} (aligned with {names[offset + axis]}) has size {size}, "
                f"expected 1 or {want} to broadcast to [{letters}] = {list(target)}"
            )
