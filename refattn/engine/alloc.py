"""Zero-filled float64 output arrays for the numba kernels, allocated so pages fault once.

Owns :func:`zeros_block`. The streaming kernels accumulate into their outputs with ``beta = 1``
GEMMs. An ``np.zeros`` array of a few MiB is fresh ``calloc`` memory: every 4 KiB page then
faults twice inside the kernel (a read fault maps the shared zero page, the write copies it),
and on a virtual machine each fault costs microseconds: about a third of the time of a
(1, 8, 512, 512, 64) forward and backward here. One block for all outputs of a call, filled
by a single write pass before the kernel, faults each page once, and numpy backs blocks of
4 MiB or more with transparent huge pages. The arrays returned are views of that block (the
block lives while any of them does). Defers everything else to the backend.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["zeros_block"]


def zeros_block(*shapes: tuple[int, ...]) -> list[np.ndarray]:
    """C-contiguous float64 zero arrays of ``shapes``: consecutive views of one block.

    Parameters
    ----------
    *shapes : tuple of int
        One shape per array.

    Returns
    -------
    list of numpy.ndarray
        Writable, C-contiguous, zero-filled; each is a view of one shared allocation.

    Examples
    --------
    >>> a, b = zeros_block((2, 3), (4,))
    >>> a.shape, b.shape, float(a.sum() + b.sum()), a.flags.c_contiguous
    ((2, 3), (4,), 0.0, True)
    >>> a.base is b.base
    True
    """
    sizes = [math.prod(s) for s in shapes]
    block = np.empty(sum(sizes))
    block.fill(0.0)  # one write per page here, not a read fault and a write fault later
    out, start = [], 0
    for shape, n in zip(shapes, sizes, strict=True):
        out.append(block[start:start + n].reshape(shape))
        start += n
    return out
