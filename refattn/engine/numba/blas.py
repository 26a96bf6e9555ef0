"""BLAS ``dgemm`` callable from inside numba kernels, on row-major operands, one thread.

Owns the bridge from ``@njit`` code to scipy's ``cython_blas.dgemm`` (the same OpenBLAS that
numba's own ``np.dot`` uses) and the context that pins that BLAS to one thread while numba's
``prange`` threads call it concurrently. The function pointer is a run-time argument (never a
compile-time constant), so every kernel that calls :func:`gemm` can be cached with
``cache=True``. Defers everything else to the kernels that call it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import cache

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import get_cython_function_address, intrinsic

from refattn.engine.numba._jit import kernel

__all__ = ["dgemm_address", "gemm", "gemm_pair", "gemm_split", "single_thread_blas"]

_N = 78  # ord("N")
_T = 84  # ord("T")


@cache
def dgemm_address() -> int:
    """Address of scipy's ``cython_blas.dgemm`` (Fortran ABI, column-major).

    Examples
    --------
    >>> dgemm_address() > 0
    True
    """
    return int(get_cython_function_address("scipy.linalg.cython_blas", "dgemm"))


@cache
def _controller() -> object:
    from threadpoolctl import ThreadpoolController

    dgemm_address()  # load scipy's BLAS (the one the kernels call) before listing libraries
    return ThreadpoolController()


@contextlib.contextmanager
def single_thread_blas() -> Iterator[None]:
    """Pin the BLAS libraries to one thread (numba's threads call dgemm concurrently).

    The library list is read once per process (scipy's BLAS is loaded first), so entering
    the context costs microseconds, not a scan of the loaded libraries.

    Examples
    --------
    >>> with single_thread_blas():
    ...     pass
    """
    with _controller().limit(limits=1, user_api="blas"):
        yield


@intrinsic
def _dgemm_call(typingctx, fptr, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """Call the Fortran dgemm at address ``fptr``; scalars are passed by reference."""
    sig = types.void(
        types.intp, types.uint8, types.uint8, types.int32, types.int32, types.int32,
        types.float64, types.intp, types.int32, types.intp, types.int32,
        types.float64, types.intp, types.int32,
    )

    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i8p] * 13)
        fn = builder.inttoptr(args[0], fnty.as_pointer())
        ptrs = []
        for idx, val in enumerate(args[1:]):
            if idx in (6, 8, 11):  # a, b, c are addresses already
                ptrs.append(builder.inttoptr(val, i8p))
            else:
                slot = cgutils.alloca_once_value(builder, val)
                ptrs.append(builder.bitcast(slot, i8p))
        builder.call(fn, ptrs)
        return context.get_dummy_value()

    return sig, codegen


@kernel
def gemm(fptr, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """Row-major ``C = alpha * op(A) @ op(B) + beta * C`` on raw addresses.

    ``op(A)`` is (m, k), ``op(B)`` is (k, n), ``C`` is (m, n); ``a``, ``b``, ``c`` are byte
    addresses of the first element and ``lda``, ``ldb``, ``ldc`` row strides in elements of the
    stored (untransposed) matrices. Column-major BLAS computes ``C^T = op(B)^T op(A)^T``.
    """
    ta = np.uint8(_T) if trans_a else np.uint8(_N)
    tb = np.uint8(_T) if trans_b else np.uint8(_N)
    _dgemm_call(fptr, tb, ta, np.int32(n), np.int32(m), np.int32(k), alpha,
                b, np.int32(ldb), a, np.int32(lda), beta, c, np.int32(ldc))


@kernel
def gemm_split(fptr, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, cm, ck):
    """:func:`gemm` as sub-products of at most ``cm`` rows of C and ``ck`` of the inner axis.

    Each sub-product is small enough for OpenBLAS's unpacked small-matrix kernels
    (``m n k <= 100**3``), which run these (tile x 64) products about 20% faster than the
    packed path; the inner axis is accumulated chunk by chunk in a fixed order.
    """
    for i0 in range(0, m, cm):
        mi = min(cm, m - i0)
        for l0 in range(0, k, ck):
            kl = min(ck, k - l0)
            a_off = (l0 * lda + i0) if trans_a else (i0 * lda + l0)
            b_off = l0 if trans_b else l0 * ldb
            gemm(fptr, trans_a, trans_b, mi, n, kl, alpha, a + 8 * a_off, lda, b + 8 * b_off,
                 ldb, beta if l0 == 0 else 1.0, c + 8 * i0 * ldc, ldc)


@kernel
def gemm_pair(fptr, m, k, a, lda, alpha1, b1, n1, beta1, c1, alpha2, b2, n2, c2, cm1, ck1, cm2,
              ck2):
    """Two products of one row-major ``A`` (m x k, row stride ``lda``), slab by slab of its
    columns, so that each slab is read by both while it is in cache:

    ``C1 = alpha1 A B1 + beta1 C1`` (``B1`` k x n1, ``C1`` m x n1) as :func:`gemm_split` with
    tiles ``(cm1, ck1)``, and ``C2 += alpha2 A^T B2`` (``B2`` m x n2, ``C2`` k x n2) as
    :func:`gemm_split` with tiles ``(cm2, ck2)``; a slab is ``cm2`` columns of ``A`` (one tile
    row of ``C2``). With ``cm2`` a multiple of ``ck1`` every element of ``C1`` and ``C2`` is
    summed in the same order as by the two :func:`gemm_split` calls (the fused kernel's
    ``O`` and ``dV``, ``dQ`` and ``dK``: both read the score block). Row strides of ``B1``,
    ``C1`` are ``n1``, of ``B2``, ``C2`` ``n2``.
    """
    for j0 in range(0, k, cm2):
        sl = min(cm2, k - j0)
        for i0 in range(0, m, cm1):
            mi = min(cm1, m - i0)
            for l0 in range(j0, j0 + sl, ck1):
                kl = min(ck1, j0 + sl - l0)
                gemm(fptr, False, False, mi, n1, kl, alpha1, a + 8 * (i0 * lda + l0), lda,
                     b1 + 8 * l0 * n1, n1, beta1 if l0 == 0 else 1.0, c1 + 8 * i0 * n1, n1)
        for l0 in range(0, m, ck2):
            kl = min(ck2, m - l0)
            gemm(fptr, True, False, sl, n2, kl, alpha2, a + 8 * (l0 * lda + j0), lda,
                 b2 + 8 * l0 * n2, n2, 1.0, c2 + 8 * j0 * n2, n2)
