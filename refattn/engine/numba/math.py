"""Row primitives for the numba kernels: a vectorisable float64 exp and fixed-order row sums.

Owns :func:`exp_shift` (``x[j] <- exp(x[j] - m)`` over a row, branch-free so LLVM vectorises
it; accurate to about 1 ulp, exactly 0 for -inf, subnormal results rounded once) and
:func:`row_sum` (eight interleaved partial sums combined in a fixed tree, so the result is
deterministic and does not wait on one add chain). numba has no SVML here, so ``math.exp`` in a
loop is scalar libm; this exp is about 3x faster. Defers everything else to the kernels.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from refattn.engine.numba._jit import kernel

__all__ = ["exp1", "exp_shift", "row_dot", "row_max", "row_sum"]

_LOG2E = 1.4426950408889634
# fdlibm's split of ln 2: the high part has enough trailing zero bits that k * LN2_HI is exact
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_MIN_ARG = -745.2  # below this exp() rounds to +0.0 in float64
_MAX_ARG = 709.7  # never reached by softmax (arguments are <= 0); clamped for safety
# Taylor coefficients 1/n!, n = 2..13: the remainder r^14/14! < 5e-18 for |r| <= ln2/2
_C = [1.0 / math.factorial(n) for n in range(14)]
_C2, _C3, _C4, _C5, _C6, _C7 = _C[2], _C[3], _C[4], _C[5], _C[6], _C[7]
_C8, _C9, _C10, _C11, _C12, _C13 = _C[8], _C[9], _C[10], _C[11], _C[12], _C[13]


@intrinsic
def _bits_to_float(typingctx, x):
    """Reinterpret the bits of an int64 as a float64 (vectorisable)."""
    sig = types.float64(types.int64)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return sig, codegen


@kernel(fastmath={"contract"}, inline="always")
def _exp(t):
    """exp(t) for t <= 709.7 (t = -inf gives exactly 0.0)."""
    x = min(max(t, -746.0), _MAX_ARG)
    kf = np.floor(x * _LOG2E + 0.5)
    r = (x - kf * _LN2_HI) - kf * _LN2_LO  # |r| <= ln2 / 2
    p = _C13
    p = p * r + _C12
    p = p * r + _C11
    p = p * r + _C10
    p = p * r + _C9
    p = p * r + _C8
    p = p * r + _C7
    p = p * r + _C6
    p = p * r + _C5
    p = p * r + _C4
    p = p * r + _C3
    p = p * r + _C2
    p = p * r + 1.0
    p = p * r + 1.0
    k = np.int64(kf)
    k1 = k >> 1  # 2^k = 2^k1 * 2^(k-k1): both factors normal, so subnormals round once
    s1 = _bits_to_float((k1 + 1023) << 52)
    s2 = _bits_to_float((k - k1 + 1023) << 52)
    y = (p * s1) * s2
    return 0.0 if t < _MIN_ARG else y


@kernel(fastmath={"contract"})
def exp_shift(x, n, m):
    """In place: ``x[j] = exp(x[j] - m)`` for j < n (``x`` a 1-D float64 view).

    Examples
    --------
    >>> x = np.array([0.0, -np.inf, 1.0])
    >>> exp_shift(x, 3, 1.0)
    >>> bool(abs(x[0] - np.exp(-1.0)) < 1e-16), x[1:].tolist()
    (True, [0.0, 1.0])
    """
    for j in range(n):
        x[j] = _exp(x[j] - m)


@kernel(inline="always")
def exp1(t):
    """Scalar exp with the same rounding as :func:`exp_shift` (for single corrections)."""
    return _exp(t)


@kernel
def row_sum(x, n):
    """``sum(x[:n])`` with eight interleaved partial sums combined in a fixed tree.

    Examples
    --------
    >>> row_sum(np.arange(11.0), 11)
    55.0
    """
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    j = 0
    while j + 8 <= n:
        s0 += x[j]
        s1 += x[j + 1]
        s2 += x[j + 2]
        s3 += x[j + 3]
        s4 += x[j + 4]
        s5 += x[j + 5]
        s6 += x[j + 6]
        s7 += x[j + 7]
        j += 8
    tail = 0.0
    while j < n:
        tail += x[j]
        j += 1
    return (((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))) + tail


@kernel
def row_dot(x, y, n):
    """``sum(x[:n] * y[:n])`` in the same fixed order as :func:`row_sum`.

    Examples
    --------
    >>> row_dot(np.arange(3.0), np.ones(3), 3)
    3.0
    """
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    j = 0
    while j + 8 <= n:
        s0 += x[j] * y[j]
        s1 += x[j + 1] * y[j + 1]
        s2 += x[j + 2] * y[j + 2]
        s3 += x[j + 3] * y[j + 3]
        s4 += x[j + 4] * y[j + 4]
        s5 += x[j + 5] * y[j + 5]
        s6 += x[j + 6] * y[j + 6]
        s7 += x[j + 7] * y[j + 7]
        j += 8
    tail = 0.0
    while j < n:
        tail += x[j] * y[j]
        j += 1
    return (((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))) + tail


@kernel
def row_max(x, n):
    """``max(x[:n])`` (-inf for n == 0) with eight interleaved maxima (exact in any order).

    Examples
    --------
    >>> row_max(np.array([1.0, -np.inf, 3.0, 2.0]), 4)
    3.0
    """
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = -np.inf
    j = 0
    while j + 8 <= n:
        m0 = max(m0, x[j])
        m1 = max(m1, x[j + 1])
        m2 = max(m2, x[j + 2])
        m3 = max(m3, x[j + 3])
        m4 = max(m4, x[j + 4])
        m5 = max(m5, x[j + 5])
        m6 = max(m6, x[j + 6])
        m7 = max(m7, x[j + 7])
        j += 8
    while j < n:
        m0 = max(m0, x[j])
        j += 1
    return max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))
