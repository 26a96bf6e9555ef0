"""Kernel-ready operands: fixed numba types for broadcast inputs and read-only arrays.

Owns :func:`strided` (a (B, Hq, Q, K)-broadcastable array as a flat C buffer plus four element
strides, 0 along broadcast axes) with its ``@njit`` reader :func:`at`, and :func:`ro` (a
read-only C-contiguous view). numba specialises a kernel on every array layout and
writeability it sees, so a bias that happens to be full-shaped (C layout) and one that
broadcasts (A layout) would compile the same large kernel twice; in this form every call has
the same argument types, and one cached compilation serves them all. Defers validation of the
arrays to :class:`refattn.AttentionCall`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from refattn.engine.numba._jit import kernel
from refattn.engine.numba.philox import philox_row

__all__ = ["DROP_DENSE", "DROP_NONE", "DROP_PHILOX", "Strided", "address", "at", "multiplier_row",
           "ro", "strided"]

#: dropout modes of the kernels' ``drop`` tuple: none, a dense multiplier operand, Philox
DROP_NONE, DROP_DENSE, DROP_PHILOX = 0, 1, 2


def ro(x: np.ndarray) -> np.ndarray:
    """A read-only C-contiguous view of ``x`` (copied only if ``x`` is not C-contiguous).

    Examples
    --------
    >>> ro(np.zeros((2, 3)).T).flags.c_contiguous, ro(np.zeros(2)).flags.writeable
    (True, False)
    """
    view = np.ascontiguousarray(x).view()
    view.flags.writeable = False
    return view


class Strided(NamedTuple):
    """A broadcast operand: ``data[b*s0 + h*s1 + i*s2 + j*s3]`` is element (b, h, i, j)."""

    data: np.ndarray  # 1-D, read-only, C-contiguous
    strides: np.ndarray  # (4,) int64 element strides, 0 along broadcast axes


def strided(x: np.ndarray | None, full: tuple[int, int, int, int], dtype: type) -> Strided:
    """The broadcast of ``x`` to ``full`` as a flat buffer and element strides.

    ``x`` None gives a one-element dummy of ``dtype`` with zero strides.

    Examples
    --------
    >>> s = strided(np.arange(3.0), (2, 1, 4, 3), np.float64)
    >>> s.data.tolist(), s.strides.tolist()
    ([0.0, 1.0, 2.0], [0, 0, 0, 1])
    >>> float(at(s.data, s.strides, 1, 0, 3, 2))
    2.0
    """
    if x is None:
        return Strided(ro(np.zeros(1, dtype=dtype)), ro(np.zeros(4, dtype=np.int64)))
    arr = np.ascontiguousarray(x)
    if arr.dtype != dtype:  # pragma: no cover - the call gate guarantees the dtype
        raise TypeError(f"expected {dtype}, got {arr.dtype}")
    arr = arr.reshape((1,) * (4 - arr.ndim) + arr.shape)
    np.broadcast_shapes(arr.shape, full)  # raises if it does not broadcast
    steps = np.array(arr.strides, dtype=np.int64) // arr.itemsize
    steps[np.array(arr.shape) == 1] = 0
    return Strided(ro(arr.reshape(-1)), ro(steps))


@kernel(inline="always")
def at(data, st, b, h, i, j):
    """Element (b, h, i, j) of a :class:`Strided` operand."""
    return data[b * st[0] + h * st[1] + i * st[2] + j * st[3]]


@kernel(inline="always")
def address(x, a0, a1, n):
    """Byte address of ``x[a0, a1, n, ...]`` (``x`` C-contiguous after its first three axes)."""
    return x.ctypes.data + a0 * x.strides[0] + a1 * x.strides[1] + n * x.strides[2]


@kernel(inline="always")
def multiplier_row(z, drop, zdense, b, h, Hq, i, j0, n):
    """``z[:n]`` = dropout multiplier of keys [j0, j0 + n) of row (b, h, i).

    ``drop`` is (mode, key0, key1, offset, threshold, keep); mode DROP_PHILOX draws the
    stream by coordinates, DROP_DENSE reads the :class:`Strided` operand ``zdense``.
    """
    mode, k0, k1, offset, threshold, keep = drop
    if mode == DROP_PHILOX:
        philox_row(z, b * Hq + h, i, j0, n, k0, k1, offset, threshold, keep)
    else:
        for j in range(n):
            z[j] = at(zdense[0], zdense[1], b, h, i, j0 + j)
