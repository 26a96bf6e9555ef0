"""Validation helpers shared by every public entry point.

Each helper raises :class:`~refattn.errors.RefAttnError` with the tensor's name, the offending
index or axis and the expectation. None of them casts: a non-float64 array is an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import SupportsIndex

import numpy as np

from refattn.errors import RefAttnError

__all__ = [
    "as_array",
    "check_bool",
    "check_broadcastable",
    "check_finite",
    "check_float64",
    "check_shape",
    "compact",
    "first_index",
    "float64_input",
    "format_index",
    "immutable_copy",
    "memory_error",
]


def as_array(name: str, x: object) -> np.ndarray:
    """Return ``x`` as a plain ndarray without changing its dtype (DLPack/``__array__``
    accepted); the one gate every array input passes.

    An ndarray subclass never reaches the checks as itself (its own ``isfinite``, ``max`` or
    indexing could hide values): a masked array is accepted only when no element is masked (a
    masked element has no value, and refattn never fills one), ``np.matrix`` is refused (it is
    always 2-D and ``*`` is its matrix product), and any other subclass (``np.memmap``, say)
    is read as the plain array of its data.

    Examples
    --------
    >>> z = np.ma.masked_invalid([1.0, np.nan])
    >>> try:
    ...     as_array("dropout", z)
    ... except RefAttnError as exc:
    ...     print(str(exc)[:73])
    dropout: a masked array with 1 masked element(s), the first at index (1);
    >>> type(as_array("q", np.ma.masked_array([1.0, 2.0]))).__name__
    'ndarray'
    """
    if type(x) is np.ndarray:
        return x
    if isinstance(x, np.ma.MaskedArray):
        mask = np.ma.getmaskarray(x)
        idx = first_index(mask)
        if idx is not None:
            raise RefAttnError(
                f"{name}: a masked array with {int(mask.sum())} masked element(s), the first "
                f"at index {format_index(idx)}; a masked element has no value and refattn "
                "never fills one: pass x.filled(value), or express the mask with visible= / "
                "query_valid=")
        return np.asarray(np.ma.getdata(x))
    if isinstance(x, np.matrix):
        raise RefAttnError(f"{name}: np.matrix is not accepted (always 2-D, and * is its matrix "
                           "product); pass np.asarray(x) reshaped to the documented axes")
    try:
        return np.asarray(x)  # a plain ndarray: subclasses are read as their data
    except MemoryError as exc:
        raise memory_error(exc, f"{name}: reading the input as an array") from None
    except Exception as exc:  # pragma: no cover - exotic objects
        raise RefAttnError(f"{name}: cannot be read as an array ({exc})") from None


def compact(x: np.ndarray) -> np.ndarray:
    """The smallest view of ``x`` that broadcasts back to it: each axis of stride 0 (a
    broadcast axis) cut to length 1. Checks run on it, so a broadcast input costs what its
    data costs, not what its shape claims.

    Examples
    --------
    >>> compact(np.broadcast_to(np.arange(3.0), (1000, 1000, 3))).shape
    (1, 1, 3)
    """
    cut = tuple(slice(0, 1) if st == 0 and n > 1 else slice(None)
                for st, n in zip(x.strides, x.shape, strict=True))
    return x[cut]


def memory_error(exc: BaseException, doing: str) -> RefAttnError:
    """A :class:`RefAttnError` for a ``MemoryError`` raised while ``doing`` something,
    naming the bytes the failed allocation asked for when numpy says so.

    Examples
    --------
    >>> try:
    ...     np.empty(2**50)
    ... except MemoryError as exc:
    ...     print(str(memory_error(exc, "forward"))[:73])
    memory: forward needs an array of 9007199254740992 bytes (8388608.00 GiB)
    """
    size = getattr(exc, "_total_size", None)  # numpy's _ArrayMemoryError knows the request
    if isinstance(size, int):
        need = f"an array of {size} bytes ({size / 2**30:.2f} GiB)"
    else:
        need = "more memory than it could get"
    return RefAttnError(f"memory: {doing} needs {need}, more than this machine can give")


def format_index(index: Sequence[SupportsIndex], letters: Sequence[str] | None = None) -> str:
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
    small = compact(x)  # a broadcast input is checked once per stored element
    bad = ~np.isfinite(small)
    idx = first_index(bad)
    if idx is not None:
        raise RefAttnError(
            f"{name}: non-finite value {small[idx].item()!r} at index {format_index(idx)}; "
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


def immutable_copy(x: np.ndarray) -> np.ndarray:
    """A private C-ordered copy of ``x`` (an index table, a head map) that nobody can make
    writeable again.

    Its memory belongs to an immutable ``bytes`` object, so ``flags.writeable = True``
    raises (a copy that owns its memory could be unlocked by anyone holding it, and an index
    changed after the gate checked it would send a kernel out of bounds).

    Examples
    --------
    >>> h = immutable_copy(np.array([0, 1]))
    >>> try:
    ...     h.flags.writeable = True
    ... except ValueError:
    ...     print("locked")
    locked
    """
    data = np.ascontiguousarray(x)
    return np.frombuffer(data.tobytes(), dtype=data.dtype).reshape(data.shape)
