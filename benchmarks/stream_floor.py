"""The GEMM floor of the streaming algorithm: its BLAS calls alone, with no softmax work.

Owns two ``@njit(parallel=True)`` kernels that issue exactly the matrix products of the numba
streaming forward and backward (:mod:`refattn.engine.numba.stream`), at the same tile and
sub-product sizes and with one task per (b, h, query block) forward and per (b, h) backward,
but skip every per-element step (scale, mask, max, exp, sums, dS, dropout). Their outputs are
meaningless; their time is a lower bound on any implementation of that tiled algorithm on this
BLAS: 2 products of ``2 B Hq Q K D`` flops forward and 5 backward (``Q K^T`` is recomputed).
``benchmarks/attention.py`` prints it beside the real kernels and PyTorch as the variant
``stream_floor``: PyTorch's time over the floor is the largest speed-up those GEMM calls allow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from numba import njit, prange

from refattn import AttentionCall
from refattn.engine.alloc import zeros_block
from refattn.engine.numba.backend import BLOCK_K, BLOCK_Q, _sub_block
from refattn.engine.numba.blas import dgemm_address, gemm, gemm_split, single_thread_blas
from refattn.engine.numba.operands import address

__all__ = ["floor_runner"]


@njit(cache=True, parallel=True)
def _forward_gemms(q, k, v, BQ, BK, sub, fptr, nt, out):
    B, Hq, Q, Dk = q.shape
    K = k.shape[2]
    Dv = v.shape[3]
    nqb = (Q + BQ - 1) // BQ
    s_ws = np.empty((nt, BQ, BK))  # written by beta = 0 products
    for task in prange(B * Hq * nqb):
        bh = task // nqb
        ib = task - bh * nqb
        b = bh // Hq
        h = bh - b * Hq
        i0 = ib * BQ
        bq = min(BQ, Q - i0)
        s = s_ws[numba.get_thread_id()]
        for j0 in range(0, K, BK):
            bk = min(BK, K - j0)
            gemm(fptr, False, True, bq, bk, Dk, 1.0, address(q, b, h, i0), Dk,
                 address(k, b, h, j0), Dk, 0.0, s.ctypes.data, BK)
            gemm_split(fptr, False, False, bq, Dv, bk, 1.0, s.ctypes.data, BK,
                       address(v, b, h, j0), Dv, 1.0, address(out, b, h, i0), Dv, sub, sub)


@njit(cache=True, parallel=True)
def _backward_gemms(q, k, v, g, BQ, BK, sub, fptr, nt, dq, dk, dv):
    B, Hq, Q, Dk = q.shape
    K = k.shape[2]
    Dv = v.shape[3]
    p_ws = np.empty((nt, BQ, BK))  # written by beta = 0 products
    gs_ws = np.empty((nt, BQ, BK))
    for task in prange(B * Hq):
        b = task // Hq
        h = task - b * Hq
        tid = numba.get_thread_id()
        p = p_ws[tid]
        gs = gs_ws[tid]
        for j0 in range(0, K, BK):
            bk = min(BK, K - j0)
            for i0 in range(0, Q, BQ):
                bq = min(BQ, Q - i0)
                gemm(fptr, False, True, bq, bk, Dk, 1.0, address(q, b, h, i0), Dk,
                     address(k, b, h, j0), Dk, 0.0, p.ctypes.data, BK)
                gemm(fptr, False, True, bq, bk, Dv, 1.0, address(g, b, h, i0), Dv,
                     address(v, b, h, j0), Dv, 0.0, gs.ctypes.data, BK)
                gemm_split(fptr, True, False, bk, Dv, bq, 1.0, p.ctypes.data, BK,
                           address(g, b, h, i0), Dv, 1.0, address(dv, b, h, j0), Dv, sub, sub)
                gemm_split(fptr, False, False, bq, Dk, bk, 1.0, gs.ctypes.data, BK,
                           address(k, b, h, j0), Dk, 1.0, address(dq, b, h, i0), Dk, sub, sub)
                gemm_split(fptr, True, False, bk, Dk, bq, 1.0, gs.ctypes.data, BK,
                           address(q, b, h, i0), Dk, 1.0, address(dk, b, h, j0), Dk, sub, sub)


def floor_runner(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray
                 ) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(forward, forward_backward) closures timing the streaming GEMMs alone.

    Parameters
    ----------
    q, g : (B, Hq, Q, D) float64, C-contiguous
    k, v : (B, Hq, K, D) float64, C-contiguous (one kv head per query head)

    Returns
    -------
    tuple of callables
        Each allocates the outputs as the real kernels do (:func:`zeros_block`) and runs the
        products; the forward_backward closure returns ``(out, dq, dk, dv)``.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> q, k, v, g = (rng.standard_normal((1, 2, 8, 4)) for _ in range(4))
    >>> fwd, fwd_bwd = floor_runner(q, k, v, g)
    >>> [x.shape for x in fwd_bwd()]
    [(1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4)]
    """
    B, Hq, Q, _ = q.shape
    K = k.shape[2]
    BQ, BK = min(BLOCK_Q, Q), min(BLOCK_K, K)
    sub = _sub_block(AttentionCall(q[:, :, :1], k[:, :, :1], v[:, :, :1]))
    nt = numba.get_num_threads()

    def fwd() -> np.ndarray:
        (out,) = zeros_block((B, Hq, Q, v.shape[3]))
        with single_thread_blas(), numba.parallel_chunksize(1):
            _forward_gemms(q, k, v, BQ, BK, sub, dgemm_address(), nt, out)
        return out

    def fwd_bwd() -> tuple[np.ndarray, ...]:
        out = fwd()
        dq, dk, dv = zeros_block(q.shape, k.shape, v.shape)
        with single_thread_blas(), numba.parallel_chunksize(1):
            _backward_gemms(q, k, v, g, BQ, BK, sub, dgemm_address(), nt, dq, dk, dv)
        return out, dq, dk, dv

    return fwd, fwd_bwd
