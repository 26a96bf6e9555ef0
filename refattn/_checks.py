"""Validation helpers shared by every public entry point.

Each helper raises :class:`~refattn.errors.RefAttnError` with the tensor's name, the offending
index or axis and the expectation. None of them casts: a non-float64 array is an error.

Every number that comes from outside (an argument, a manifest, a SPEC) passes one bound helper
before any arithmetic or allocation uses it, one helper per kind of bound:
:func:`bounded_int` (an integer scalar in ``[lo, hi]``), :func:`bounded_float` (a real scalar,
finite, in a closed or open interval) and :func:`index_array` (an integer array whose entries
that are actually used lie in ``[lo, hi]``). :data:`INT64_MIN` / :data:`INT64_MAX` are the
widest range an index may have (numpy and the kernels index in int64).
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from typing import SupportsIndex

import numpy as np

from gradcheck._boundary import int_text, shown
from refattn.errors import RefAttnError

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "as_array",
    "bounded_float",
    "bounded_int",
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
    "index_array",
    "int_text",
    "memory_error",
    "shown_shape",
]

#: the widest range of an integer index, a length or a position (numpy's and the kernels' int64)
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


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
    except ValueError as exc:
        if "inhomogeneous" in str(exc):  # a ragged nested list: numpy names the axis
            shape = str(exc).split("detected shape was ", 1)[-1].rstrip(".")
            raise RefAttnError(
                f"{name}: a ragged nested sequence (rows of different lengths; numpy reads "
                f"the shape as {shape}) is not an array: every row along an axis must have "
                "the same length") from None
        raise RefAttnError(f"{name}: cannot be read as an array ({exc})") from None
    except Exception as exc:  # pragma: no cover - exotic objects
        raise RefAttnError(f"{name}: cannot be read as an array ({exc})") from None


def shown_shape(x: object) -> str:
    """``x``'s shape for a message (``[2, 3]``), without failing on what has none (a ragged
    list, an object numpy cannot read): then its type.

    Examples
    --------
    >>> shown_shape(np.zeros((2, 3))), shown_shape([[1.0, 2.0], [3.0]])
    ('[2, 3]', 'list')
    """
    try:
        return str(list(np.shape(x)))  # type: ignore[call-overload]  # any object
    except Exception:  # a ragged sequence, or an object without a shape
        return type(x).__name__


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


# -- bounds: one helper per kind, for every number that comes from outside ----------------------
def _float_text(x: float) -> str:
    """A float bound for a message: ``2**64`` for a large or small power of two, else repr."""
    if x != 0 and math.isfinite(x):
        m, e = math.frexp(abs(x))
        if m == 0.5 and abs(e - 1) >= 16:
            return f"{'-' if x < 0 else ''}2**{e - 1}"
    return repr(x)


def _got(value: object) -> str:
    """What a refused value was (:func:`gradcheck._boundary.shown`: a huge int is described,
    not printed; 80 characters at most)."""
    return shown(value, limit=80)


def bounded_int(name: str, value: object, *, lo: int, hi: int) -> int:
    """``value`` as a Python int in ``[lo, hi]``, or a :class:`RefAttnError` naming ``name``
    and the range.

    Accepts Python ints and integer scalars (numpy's, ``np.uint64`` included, a 0-d integer
    array); refuses bool (``True`` is not a count), floats (``3.0`` and ``2.5`` alike: no
    silent truncation), strings and integers outside the range (without printing a
    4,300-digit one).

    Examples
    --------
    >>> bounded_int("page_size", np.uint64(16), lo=1, hi=INT64_MAX)
    16
    >>> for bad in (2**70, True, 4.0):
    ...     try:
    ...         bounded_int("window_size[0]", bad, lo=INT64_MIN, hi=INT64_MAX)
    ...     except RefAttnError as exc:
    ...         print(exc)
    window_size[0]: 2**70 is outside the allowed range [-2**63, 2**63 - 1]
    window_size[0]: expected an integer in [-2**63, 2**63 - 1], got True
    window_size[0]: expected an integer in [-2**63, 2**63 - 1], got 4.0
    """
    where = f"[{int_text(lo)}, {int_text(hi)}]"
    n = None
    if not isinstance(value, (bool, np.bool_)) and getattr(
            getattr(value, "dtype", None), "kind", "i") != "b":
        try:
            n = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            n = None
    if n is None:
        raise RefAttnError(f"{name}: expected an integer in {where}, got {_got(value)}")
    if not lo <= n <= hi:
        raise RefAttnError(f"{name}: {int_text(n)} is outside the allowed range {where}")
    return n


def bounded_float(name: str, value: object, *, lo: float | None = None,
                  hi: float | None = None, lo_open: bool = False, hi_open: bool = False,
                  finite: bool = True) -> float:
    """``value`` as a float in the interval ``lo .. hi`` (closed unless ``lo_open`` /
    ``hi_open``; None: unbounded on that side), or a :class:`RefAttnError` naming ``name``
    and the interval.

    Accepts Python and numpy reals (an int converts exactly or is out of range, never an
    ``OverflowError``) and 0-d real arrays; refuses bool, strings, complex numbers, NaN
    always and +/-inf unless ``finite=False``.

    Examples
    --------
    >>> bounded_float("softcap", 5, lo=0.0, lo_open=True)
    5.0
    >>> for bad in (0.0, 10**400, float("nan"), "1"):
    ...     try:
    ...         bounded_float("scale", bad, lo=0.0, hi=2.0**64, lo_open=True)
    ...     except RefAttnError as exc:
    ...         print(exc)
    scale: 0.0 is outside the allowed range (0.0, 2**64]
    scale: an integer of 1329 bits (about 10**400) is outside the allowed range (0.0, 2**64]
    scale: expected a finite number, got nan (allowed range (0.0, 2**64])
    scale: expected a number in (0.0, 2**64], got '1'
    """
    where = (("(" if lo_open else "[") + ("-inf" if lo is None else _float_text(lo)) + ", "
             + ("inf" if hi is None else _float_text(hi)) + (")" if hi_open else "]"))
    real = isinstance(value, numbers.Real) or (
        isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iuf")
    if not real or isinstance(value, (bool, np.bool_)):
        raise RefAttnError(f"{name}: expected a number in {where}, got {_got(value)}")
    try:
        x = float(value)  # type: ignore[arg-type]
    except OverflowError:  # an int beyond float64's range
        raise RefAttnError(f"{name}: {_got(value)} is outside the allowed range "
                           f"{where}") from None
    if math.isnan(x) or (finite and math.isinf(x)):
        what = "a finite number" if finite else "a number, not NaN"
        raise RefAttnError(f"{name}: expected {what}, got {x!r} (allowed range {where})")
    if (lo is not None and (x < lo or (lo_open and x == lo))) or (
            hi is not None and (x > hi or (hi_open and x == hi))):
        raise RefAttnError(f"{name}: {x!r} is outside the allowed range {where}")
    return x


def index_array(name: str, x: object, *, lo: int, hi: int, dtype: object = None,
                ndim: int | None = None, used: np.ndarray | None = None,
                letters: Sequence[str] | None = None, expected: str | None = None
                ) -> np.ndarray:
    """An integer array as int64, every entry that is read (``used``, a bool array of its
    shape; default: every entry) in ``[lo, hi]``; or a :class:`RefAttnError` naming the first
    entry outside (``letters`` name its axes: ``b=0``, ``(b=0, p=1)``) and ``expected``
    (default: the range).

    ``dtype`` asks for one integer dtype exactly (FlashAttention's int32 tables); otherwise
    any integer dtype is accepted (bool and floats are not). Entries that are not read are
    not range-checked (-1 padding past a sequence's last block), but the whole array must
    convert to int64 losslessly. Nothing the size of a declared extent is allocated: only
    masks of the array's own size.

    Examples
    --------
    >>> index_array("block_table", np.array([[2, 0, -1]], np.int32), lo=0, hi=2,
    ...             used=np.array([[True, True, False]])).tolist()
    [[2, 0, -1]]
    >>> try:
    ...     index_array("block_table", np.array([[2, 7]]), lo=0, hi=2, letters="bp")
    ... except RefAttnError as exc:
    ...     print(exc)
    block_table: entry (b=0, p=1) is 7, expected a value in [0, 2]
    """
    def entry(idx: tuple[int, ...]) -> str:
        text = format_index(idx, letters)
        return text[1:-1] if letters is not None and len(idx) == 1 else text

    arr = as_array(name, x)
    if dtype is not None and arr.dtype != np.dtype(dtype):  # type: ignore[call-overload]
        raise RefAttnError(f"{name}: expected dtype {np.dtype(dtype)}, got "  # type: ignore
                           f"{arr.dtype}")
    if arr.dtype.kind not in "iu":  # bool is kind "b": refused too
        raise RefAttnError(f"{name}: expected an integer array, got dtype {arr.dtype}")
    if ndim is not None and arr.ndim != ndim:
        raise RefAttnError(f"{name}: expected {ndim} axes, got shape {list(arr.shape)}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and arr.size and int(
            arr.max()) > INT64_MAX:
        wide = first_index(arr > INT64_MAX) or ()
        raise RefAttnError(f"{name}: value {int(arr[wide] if wide else arr.max())} does not fit "
                           f"in int64 (entry {entry(wide)}; at most {int_text(INT64_MAX)})")
    bad = (arr < lo) | (arr > hi)
    if used is not None:
        bad &= used
    idx = first_index(bad)
    if idx is not None:
        want = expected or f"a value in [{int_text(lo)}, {int_text(hi)}]"
        raise RefAttnError(f"{name}: entry {entry(idx)} is {int(arr[idx])}, expected {want}")
    return arr.astype(np.int64, copy=False)
