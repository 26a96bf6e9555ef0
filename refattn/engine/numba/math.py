"""Row primitives for the numba kernels: a vectorisable float64 exp and fixed-order row sums.

Owns :func:`exp_shift` (``x[j] <- exp(x[j] - m)`` over a row, branch-free so LLVM vectorises
it; accurate to about 1 ulp, exactly 0 for -inf, subnormal results rounded once),
:func:`row_sum` (eight interleaved partial sums combined in a fixed tree, so the result is
deterministic and does not wait on one add chain) and :func:`softcap_row` (softcap's tanh on
the same exp). numba has no SVML here, so ``math.exp`` in a loop is scalar libm; this exp is
about 3x faster. Defers everything else to the kernels.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from refattn.engine.numba._jit import kernel

__all__ = ["dot_grad", "exp1", "exp_shift", "exp_sum", "row_dot", "row_max", "row_sum",
           "softcap_row"]

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


@intrinsic
def _fma(typingctx, a, b, c):
    """``a * b + c`` rounded once (``llvm.fma.f64``: vectorisable, the same on every CPU)."""
    sig = types.float64(types.float64, types.float64, types.float64)

    def codegen(context, builder, signature, args):
        d = ir.DoubleType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(d, [d, d, d]),
                                            "llvm.fma.f64")
        return builder.call(fn, args)

    return sig, codegen


_V8 = ir.VectorType(ir.DoubleType(), 8)
_HORNER = (_C13, _C12, _C11, _C10, _C9, _C8, _C7, _C6, _C5, _C4, _C3, _C2, 1.0, 1.0)


@kernel(inline="always")
def _exp(t):
    """exp(t) for t <= 709.7 (t = -inf gives exactly 0.0).

    Every rounding is explicit (fused multiply-adds where the scheme wants them), so the
    result does not depend on the caller's fastmath flags; :func:`_exp8_shift` is the same
    sequence of operations on eight lanes.
    """
    x = min(max(t, -746.0), _MAX_ARG)
    kf = np.floor(_fma(x, _LOG2E, 0.5))
    r = _fma(-kf, _LN2_LO, _fma(-kf, _LN2_HI, x))  # |r| <= ln2 / 2
    p = _fma(_C13, r, _C12)
    p = _fma(p, r, _C11)
    p = _fma(p, r, _C10)
    p = _fma(p, r, _C9)
    p = _fma(p, r, _C8)
    p = _fma(p, r, _C7)
    p = _fma(p, r, _C6)
    p = _fma(p, r, _C5)
    p = _fma(p, r, _C4)
    p = _fma(p, r, _C3)
    p = _fma(p, r, _C2)
    p = _fma(p, r, 1.0)
    p = _fma(p, r, 1.0)
    k = np.int64(kf)
    k1 = k >> 1  # 2^k = 2^k1 * 2^(k-k1): both factors normal, so subnormals round once
    s1 = _bits_to_float((k1 + 1023) << 52)
    s2 = _bits_to_float((k - k1 + 1023) << 52)
    y = (p * s1) * s2
    return 0.0 if t < _MIN_ARG else y


def _lanes_tuple(context, builder, signature, acc):
    """The ``<8 x double>`` held at ``acc`` as the intrinsic's 8-tuple return value."""
    a = builder.load(acc)
    items = [builder.extract_element(a, ir.Constant(ir.IntType(32), i)) for i in range(8)]
    return context.make_tuple(builder, signature.return_type, items)


def _vconst(value: float) -> ir.Constant:
    return ir.Constant(_V8, [value] * 8)


def _exp8_intrinsic(accumulate: bool):
    """The intrinsic ``_exp8_shift`` (``accumulate`` False: returns nothing) or
    ``_exp8_shift_sum`` (True: returns the eight lane sums of the results, lane ``l`` adding
    ``x[8 i + l]`` in order of i from 0.0, as :func:`row_sum`'s lanes would after the store)."""

    @intrinsic
    def exp8(typingctx, x, blocks, m):
        if not (isinstance(x, types.Array) and x.ndim == 1 and x.dtype == types.float64
                and x.layout == "C"):
            return None
        sig = (_LANES if accumulate else types.void)(x, blocks, types.float64)
        return sig, _exp8_codegen(accumulate)

    return exp8


def _exp8_codegen(accumulate: bool):
    """In place on ``x[:8 * blocks]``: ``x[j] = exp(x[j] - m)``, eight lanes at a time.

    The operations of :func:`_exp` on ``<8 x double>`` (so results are bit-identical to it),
    written as explicit vectors: LLVM's loop vectoriser stops at 256 bits on CPUs it tunes to
    prefer them (Intel's AVX-512 server cores), explicit vectors use the full 512.
    """

    def codegen(context, builder, signature, args):
        mod = builder.module
        i64v = ir.VectorType(ir.IntType(64), 8)

        def vfn(name: str, arity: int) -> ir.Function:
            return cgutils.get_or_insert_function(mod, ir.FunctionType(_V8, [_V8] * arity),
                                                  name)

        fma, floor = vfn("llvm.fma.v8f64", 3), vfn("llvm.floor.v8f64", 1)
        xa = context.make_array(signature.args[0])(context, builder, args[0])
        px = builder.bitcast(xa.data, _V8.as_pointer())
        mvec = ir.Constant(_V8, ir.Undefined)
        for i in range(8):
            mvec = builder.insert_element(mvec, args[2], ir.Constant(ir.IntType(32), i))
        acc = cgutils.alloca_once_value(builder, _vconst(0.0))
        with cgutils.for_range(builder, args[1]) as loop:
            ptr = builder.gep(px, [loop.index])
            t = builder.fsub(builder.load(ptr, align=8), mvec)
            lo = builder.select(builder.fcmp_ordered(">=", t, _vconst(-746.0)), t,
                                _vconst(-746.0))  # max(t, -746)
            xc = builder.select(builder.fcmp_ordered("<=", lo, _vconst(_MAX_ARG)), lo,
                                _vconst(_MAX_ARG))  # min(., 709.7)
            kf = builder.call(floor, [builder.call(fma, [xc, _vconst(_LOG2E), _vconst(0.5)])])
            nk = builder.fneg(kf)
            r = builder.call(fma, [nk, _vconst(_LN2_LO),
                                   builder.call(fma, [nk, _vconst(_LN2_HI), xc])])
            p = _vconst(_HORNER[0])
            for c in _HORNER[1:]:
                p = builder.call(fma, [p, r, _vconst(c)])
            k = builder.fptosi(kf, i64v)
            k1 = builder.ashr(k, ir.Constant(i64v, [1] * 8))
            bias, shift = ir.Constant(i64v, [1023] * 8), ir.Constant(i64v, [52] * 8)
            s1 = builder.bitcast(builder.shl(builder.add(k1, bias), shift), _V8)
            s2 = builder.bitcast(builder.shl(builder.add(builder.sub(k, k1), bias), shift), _V8)
            y = builder.fmul(builder.fmul(p, s1), s2)
            under = builder.fcmp_ordered("<", t, _vconst(_MIN_ARG))
            e = builder.select(under, _vconst(0.0), y)
            builder.store(e, ptr, align=8)
            if accumulate:
                builder.store(builder.fadd(builder.load(acc), e), acc)
        if not accumulate:
            return context.get_dummy_value()
        return _lanes_tuple(context, builder, signature, acc)

    return codegen


_LANES = types.UniTuple(types.float64, 8)
_exp8_shift, _exp8_shift_sum = _exp8_intrinsic(False), _exp8_intrinsic(True)


@kernel
def exp_shift(x, n, m):
    """In place: ``x[j] = exp(x[j] - m)`` for j < n (``x`` a contiguous 1-D float64 view).

    Examples
    --------
    >>> x = np.array([0.0, -np.inf, 1.0])
    >>> exp_shift(x, 3, 1.0)
    >>> bool(abs(x[0] - np.exp(-1.0)) < 1e-16), x[1:].tolist()
    (True, [0.0, 1.0])
    """
    blocks = n // 8
    _exp8_shift(x, blocks, m)
    for j in range(8 * blocks, n):
        x[j] = _exp(x[j] - m)


@kernel
def exp_sum(x, n, m):
    """:func:`exp_shift` then :func:`row_sum` of the results in one pass: in place
    ``x[j] = exp(x[j] - m)`` for j < n, returning ``sum(x[:n])`` in :func:`row_sum`'s order
    (the same bits as the two calls; the row is read once).

    Examples
    --------
    >>> x = np.array([0.0, -np.inf, 1.0] + [0.5] * 9)
    >>> y = x.copy()
    >>> total = exp_sum(x, 12, 1.0)
    >>> exp_shift(y, 12, 1.0)
    >>> bool(np.array_equal(x, y)), total == row_sum(y, 12)
    (True, True)
    """
    blocks = n // 8
    lanes = _exp8_shift_sum(x, blocks, m)
    tail = 0.0
    for j in range(8 * blocks, n):
        x[j] = _exp(x[j] - m)
        tail += x[j]
    return _tree(lanes) + tail


@kernel(inline="always")
def exp1(t):
    """Scalar exp with the same rounding as :func:`exp_shift` (for single corrections)."""
    return _exp(t)


def _tanh_taylor(terms: int) -> list[float]:
    """Coefficients of x, x^3, ... of tanh's Taylor series, from exact Bernoulli numbers:
    2^(2n) (2^(2n) - 1) B_2n / (2n)! for n = 1 .. terms, each rounded once to float64."""
    bern = [Fraction(1)]  # B_0 .. B_2terms by the recurrence sum_k C(m+1, k) B_k = 0
    for m in range(1, 2 * terms + 1):
        bern.append(-sum(math.comb(m + 1, k) * bern[k] for k in range(m)) / (m + 1))
    return [float(4 ** n * (4 ** n - 1) * bern[2 * n] / math.factorial(2 * n))
            for n in range(1, terms + 1)]


# |x| < 0.35: 13 terms leave a remainder below 2^-56 of tanh(x); above, (1 - e)/(1 + e) with
# e = exp(-2|x|) <= 0.5 loses nothing to cancellation
_TANH_SMALL = 0.35
# the coefficient of x is exactly 1 (the series' first term is b itself below)
_T3, _T5, _T7, _T9, _T11, _T13, _T15, _T17, _T19, _T21, _T23, _T25 = _tanh_taylor(13)[1:]


@kernel(inline="always")
def _tanh_from(x, e):
    """tanh(x) given e = exp(-2 |x|) (blended without a branch; finite for every finite x)."""
    a = abs(x)
    large = (1.0 - e) / (1.0 + e)
    b = min(a, _TANH_SMALL)  # keeps the unused polynomial finite for large |x|
    z = b * b
    p = _fma(_T25, z, _T23)
    p = _fma(p, z, _T21)
    p = _fma(p, z, _T19)
    p = _fma(p, z, _T17)
    p = _fma(p, z, _T15)
    p = _fma(p, z, _T13)
    p = _fma(p, z, _T11)
    p = _fma(p, z, _T9)
    p = _fma(p, z, _T7)
    p = _fma(p, z, _T5)
    p = _fma(p, z, _T3)
    small = _fma(b * z, p, b)
    w = np.float64(a < _TANH_SMALL)  # 1.0 or 0.0: both products below are exact
    return math.copysign(_fma(w, small, (1.0 - w) * large), x)


@kernel
def softcap_row(row, capped, n, c):
    """``row[j] = capped[j] = c * tanh(row[j] / c)`` for j < n: the softcap of a score row.

    The exponentials run in a loop of their own (which vectorises), then a branch-free blend
    of tanh's Taylor series (|x| < 0.35) and ``(1 - e) / (1 + e)``; within 4 ulp of c tanh
    (tested against mpmath at 120 bits), about 3x faster than libm's scalar ``math.tanh``.

    Parameters
    ----------
    row : (>= n,) float64 ndarray
        Scores, replaced by their capped values.
    capped : (>= n,) float64 ndarray
        Receives the capped values too (the backward's slope ``1 - (capped / c)^2``).
    n : int
    c : float
        The cap, > 0.

    Examples
    --------
    >>> import numpy as np
    >>> row, capped = np.array([0.0, 1.0, -50.0]), np.empty(3)
    >>> softcap_row(row, capped, 3, 5.0)
    >>> bool(np.allclose(row, 5.0 * np.tanh(np.array([0.0, 1.0, -50.0]) / 5.0), rtol=1e-15))
    True
    """
    for j in range(n):
        capped[j] = _exp(-2.0 * abs(row[j] / c))
    for j in range(n):
        x = c * _tanh_from(row[j] / c, capped[j])
        capped[j] = x
        row[j] = x


def _lanes8(step: str):
    """An intrinsic ``(x, y, blocks) -> 8 lanes``: lane l folds ``x[8 i + l]`` (times
    ``y[8 i + l]`` for ``dot``) over blocks i = 0 .. blocks - 1 in order, with ``<8 x double>``
    loads and one vector operation per block (no reassociation: each lane is the scalar chain
    ``a = a (+|max) x``, so the result equals eight interleaved scalar accumulators bit for
    bit). ``x`` and ``y`` are contiguous 1-D float64 arrays of at least ``8 * blocks`` items.
    """

    @intrinsic
    def lanes(typingctx, x, y, blocks):
        for a in (x, y):
            if not (isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.float64
                    and a.layout == "C"):
                return None
        sig = _LANES(x, y, blocks)

        def codegen(context, builder, signature, args):
            xa = context.make_array(signature.args[0])(context, builder, args[0])
            ya = context.make_array(signature.args[1])(context, builder, args[1])
            start = -math.inf if step == "max" else 0.0
            acc = cgutils.alloca_once_value(builder, ir.Constant(_V8, [start] * 8))
            px = builder.bitcast(xa.data, _V8.as_pointer())
            py = builder.bitcast(ya.data, _V8.as_pointer())
            with cgutils.for_range(builder, args[2]) as loop:
                v = builder.load(builder.gep(px, [loop.index]), align=8)
                a = builder.load(acc)
                if step == "max":  # a = max(a, v): v where v > a (exact in any order)
                    new = builder.select(builder.fcmp_ordered(">", v, a), v, a)
                elif step == "dot":  # no contraction: the product rounds, then the sum
                    w = builder.load(builder.gep(py, [loop.index]), align=8)
                    new = builder.fadd(a, builder.fmul(v, w))
                else:
                    new = builder.fadd(a, v)
                builder.store(new, acc)
            return _lanes_tuple(context, builder, signature, acc)

        return sig, codegen

    return lanes


_sum8, _dot8, _max8 = _lanes8("sum"), _lanes8("dot"), _lanes8("max")


@intrinsic
def _dot_grad8(typingctx, e, g, blocks, d, inv):
    """On ``e[:8 * blocks]``, ``g[:8 * blocks]``: the eight lanes of :func:`row_dot`'s
    ``e . g`` (each product rounded, then added: no contraction) and, in place,
    ``e = (e * (g - d)) * inv`` (the score gradient), reading each pair of vectors once."""
    for a in (e, g):
        if not (isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.float64
                and a.layout == "C"):
            return None
    sig = _LANES(e, g, blocks, types.float64, types.float64)

    def codegen(context, builder, signature, args):
        ea = context.make_array(signature.args[0])(context, builder, args[0])
        ga = context.make_array(signature.args[1])(context, builder, args[1])
        dvec, ivec = ir.Constant(_V8, ir.Undefined), ir.Constant(_V8, ir.Undefined)
        for i in range(8):
            idx = ir.Constant(ir.IntType(32), i)
            dvec = builder.insert_element(dvec, args[3], idx)
            ivec = builder.insert_element(ivec, args[4], idx)
        acc = cgutils.alloca_once_value(builder, _vconst(0.0))
        pe = builder.bitcast(ea.data, _V8.as_pointer())
        pg = builder.bitcast(ga.data, _V8.as_pointer())
        with cgutils.for_range(builder, args[2]) as loop:
            ptr = builder.gep(pe, [loop.index])
            x = builder.load(ptr, align=8)
            w = builder.load(builder.gep(pg, [loop.index]), align=8)
            builder.store(builder.fadd(builder.load(acc), builder.fmul(x, w)), acc)
            builder.store(builder.fmul(builder.fmul(x, builder.fsub(w, dvec)), ivec), ptr,
                          align=8)
        return _lanes_tuple(context, builder, signature, acc)

    return sig, codegen


@kernel(inline="always")
def _tree(v):
    """The fixed combination of eight lanes: ((0+1)+(2+3))+((4+5)+(6+7))."""
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]))


@kernel
def row_sum(x, n):
    """``sum(x[:n])`` with eight interleaved partial sums (lane ``l`` adds ``x[8 i + l]``)
    combined in a fixed tree, then the tail; ``x`` a contiguous 1-D float64 view.

    Examples
    --------
    >>> row_sum(np.arange(11.0), 11)
    55.0
    """
    blocks = n // 8
    tail = 0.0
    for j in range(8 * blocks, n):
        tail += x[j]
    return _tree(_sum8(x, x, blocks)) + tail


@kernel
def row_dot(x, y, n):
    """``sum(x[:n] * y[:n])`` in the same fixed order as :func:`row_sum`.

    Examples
    --------
    >>> row_dot(np.arange(3.0), np.ones(3), 3)
    3.0
    """
    blocks = n // 8
    tail = 0.0
    for j in range(8 * blocks, n):
        tail += x[j] * y[j]
    return _tree(_dot8(x, y, blocks)) + tail


@kernel
def dot_grad(e, g, n, d, inv):
    """:func:`row_dot` of ``e`` and ``g`` (returned, in its order), then in place
    ``e[j] = (e[j] * (g[j] - d)) * inv`` for j < n, in one pass over the two rows.

    Examples
    --------
    >>> e, g = np.arange(1.0, 12.0), np.linspace(0.0, 1.0, 11)
    >>> dot = row_dot(e, g, 11)
    >>> want = (e * (g - 0.5)) * 0.25
    >>> dot_grad(e, g, 11, 0.5, 0.25) == dot, bool(np.array_equal(e, want))
    (True, True)
    """
    blocks = n // 8
    lanes = _dot_grad8(e, g, blocks, d, inv)
    tail = 0.0
    for j in range(8 * blocks, n):
        tail += e[j] * g[j]
        e[j] = (e[j] * (g[j] - d)) * inv
    return _tree(lanes) + tail


@kernel
def row_max(x, n):
    """``max(x[:n])`` (-inf for n == 0) with eight interleaved maxima (exact in any order).

    Examples
    --------
    >>> row_max(np.array([1.0, -np.inf, 3.0, 2.0]), 4)
    3.0
    """
    blocks = n // 8
    v = _max8(x, x, blocks)
    m = max(max(max(v[0], v[1]), max(v[2], v[3])), max(max(v[4], v[5]), max(v[6], v[7])))
    for j in range(8 * blocks, n):
        m = max(m, x[j])
    return m
