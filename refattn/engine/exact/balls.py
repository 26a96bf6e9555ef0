"""Arrays of arb balls: the exact backend's arithmetic on numpy object arrays.

Owns the few array operations the rounding points need, on object arrays whose elements are
python-flint ``arb`` balls: matrix products through FLINT's ``arb_mat`` (one product per
leading index, exact when the working precision covers the operands' exponent span),
element-wise ``exp``, ``log``, ``log1p``, ``tanh``, ``sech**2`` and ``sqrt``, sums over axes,
and the conversion of a binary64 array into exact balls. Arithmetic with ``+ - * /`` is
numpy's object dispatch to arb's operators; every result is a rigorous enclosure at the
current precision.
"""

from __future__ import annotations

import numpy as np
from flint import arb, arb_mat

from refattn.engine.exact.rounding import to_balls

__all__ = ["ZERO", "balls", "exp", "log", "log1p", "matmul", "sech2", "sqrt", "tanh", "total"]

ZERO = arb(0)

exp = np.frompyfunc(lambda x: x.exp(), 1, 1)
log = np.frompyfunc(lambda x: x.log(), 1, 1)
log1p = np.frompyfunc(lambda x: x.log1p(), 1, 1)
tanh = np.frompyfunc(lambda x: x.tanh(), 1, 1)
#: sech(x)**2 = 1 - tanh(x)**2 with a relative enclosure: 1 - t*t loses every bit for large x
sech2 = np.frompyfunc(lambda x: x.sech() ** 2, 1, 1)
sqrt = np.frompyfunc(lambda x: x.sqrt(), 1, 1)


def balls(x: np.ndarray) -> np.ndarray:
    """A binary64 array as exact balls (an object array is returned unchanged).

    Examples
    --------
    >>> balls(np.ones((2, 1))).shape, balls(np.ones(1))[0].is_exact()
    ((2, 1), True)
    """
    x = np.asarray(x)
    return x if x.dtype == object else to_balls(x)


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` over object arrays of balls: (..., M, N) @ (..., N, P) -> (..., M, P).

    Leading axes broadcast as in numpy; each 2-D product is one ``arb_mat`` product.

    Examples
    --------
    >>> a = balls(np.arange(6.0).reshape(2, 3)); b = balls(np.ones((3, 1)))
    >>> [float(x.mid()) for x in matmul(a, b).ravel()]
    [3.0, 12.0]
    """
    a, b = balls(a), balls(b)
    lead = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = np.broadcast_to(a, (*lead, *a.shape[-2:]))
    b = np.broadcast_to(b, (*lead, *b.shape[-2:]))
    M, P = a.shape[-2], b.shape[-1]
    out = np.empty((*lead, M, P), dtype=object)
    for idx in np.ndindex(*lead):
        if a.shape[-1] == 0:
            out[idx] = np.full((M, P), ZERO, dtype=object)
            continue
        prod = arb_mat(a[idx].tolist()) * arb_mat(b[idx].tolist())
        out[idx] = np.array(prod.entries(), dtype=object).reshape(M, P)
    return out


def total(x: np.ndarray, axis: int | tuple[int, ...], keepdims: bool = False) -> np.ndarray:
    """Sum of balls over ``axis`` (an empty sum is an exact 0).

    Examples
    --------
    >>> float(total(balls(np.array([[1.0, 2.0], [3.0, 4.0]])), axis=(0, 1)).mid())
    10.0
    """
    x = balls(x)
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    axes = tuple(a % x.ndim for a in axes)
    if any(x.shape[a] == 0 for a in axes):
        shape = tuple(1 if a in axes else n for a, n in enumerate(x.shape)) if keepdims else \
            tuple(n for a, n in enumerate(x.shape) if a not in axes)
        return np.full(shape, ZERO, dtype=object)
    if keepdims:
        return np.add.reduce(x, axis=axes, keepdims=True)
    return np.add.reduce(x, axis=axes)  # over every axis: one ball, not an array
