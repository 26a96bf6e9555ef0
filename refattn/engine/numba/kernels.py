"""Dense-mode row kernels: the fused per-row work between the BLAS products of the full trace.

Owns two ``@njit(parallel=True)`` kernels over (b, h, i) rows. :func:`dense_forward_rows` turns
the raw product ``q k^T`` (in place) into the scaled scores and writes biased scores, masked
scores, the row max, probabilities, lse and ``P * Z`` in one pass per row.
:func:`dense_backward_rows` writes ``G_P = G_Pdrop * Z``, both contractions of ``D`` and
``G_S = P (G_P - D)``. The GEMMs stay on (multi-threaded) BLAS in the caller; the order of
operations per element is the reference's, so results agree to rounding of the row sums and
of exp. Defers the row primitives to :mod:`~refattn.engine.numba.math`.
"""

from __future__ import annotations

import math

import numpy as np
from numba import prange

from refattn.engine.numba._jit import kernel
from refattn.engine.numba.math import exp_shift, row_dot, row_sum
from refattn.engine.numba.math import row_max as max_of_row
from refattn.engine.numba.operands import at

__all__ = ["dense_backward_rows", "dense_forward_rows"]


@kernel(inline="always")
def _unravel_row(row, Hq, Q):
    """(b, h, i) of flat row index ``row`` of a C-ordered (B, Hq, Q) grid."""
    bh = row // Q
    b = bh // Hq
    return b, bh - b * Hq, row - bh * Q


@kernel(parallel=True)
def dense_forward_rows(scores, scale, has_bias, bias, biased, has_vis, visible, masked,
                       has_drop, z, probs, consumed, row_max, lse, sanitized):
    """Fused row pass of the dense forward (rows in parallel).

    Parameters
    ----------
    scores : (B, Hq, Q, K) float64
        ``q @ k_eff^T`` on entry; ``alpha * (q @ k_eff^T)`` on exit.
    scale : float
    has_bias : bool; bias : float64 Strided operand (dummy when absent)
    biased : (B, Hq, Q, K) float64, written when has_bias (else it is ``scores``)
    has_vis : bool; visible : bool Strided operand (dummy when absent)
    masked, probs : (B, Hq, Q, K) float64; written
    has_drop : bool; z : float64 Strided operand (dummy when absent)
    consumed : (B, Hq, Q, K) float64, written when has_drop (else it is ``probs``)
    row_max, lse : (B, Hq, Q) float64; sanitized : (B, Hq, Q) bool; written
    """
    B, Hq, Q, K = scores.shape
    for row in prange(B * Hq * Q):
        b, h, i = _unravel_row(row, Hq, Q)
        s = scores[b, h, i]
        bs = biased[b, h, i]
        ms = masked[b, h, i]
        p = probs[b, h, i]
        n_legal = 0
        for j in range(K):
            x = s[j] * scale  # alpha applied exactly once, after the product
            s[j] = x
            if has_bias:
                x = x + at(bias[0], bias[1], b, h, i, j)  # finite preference first
                bs[j] = x
            legal = at(visible[0], visible[1], b, h, i, j) if has_vis else True
            ms[j] = x if legal else -np.inf  # then authoritative visibility
            n_legal += legal
        sanitized[b, h, i] = n_legal == 0
        if n_legal == 0:  # temporary legal key 0 for an unused row (Policy 3)
            ms[0] = bs[0] if has_bias else s[0]
        mx = max_of_row(ms, K)
        for j in range(K):
            p[j] = ms[j]
        exp_shift(p, K, mx)  # exactly 0 where masked
        den = row_sum(p, K)
        for j in range(K):
            p[j] = p[j] / den
        row_max[b, h, i] = mx
        lse[b, h, i] = mx + math.log(den)
        if has_drop:
            c = consumed[b, h, i]
            for j in range(K):
                c[j] = p[j] * at(z[0], z[1], b, h, i, j)


@kernel(parallel=True)
def dense_backward_rows(grad_consumed, has_drop, z, grad_probs, probs, g_o, output, row_dot_p,
                        row_dot_o, grad_scores):
    """Fused row pass of the dense backward (rows in parallel).

    Parameters
    ----------
    grad_consumed : (B, Hq, Q, K) float64
        ``G_O @ v_eff^T``.
    has_drop : bool; z : float64 Strided operand (dummy when absent)
    grad_probs : (B, Hq, Q, K) float64, written when has_drop (else it is grad_consumed)
    probs : (B, Hq, Q, K) float64
    g_o, output : (B, Hq, Q, Dv) float64
        G_O (unused rows zeroed) and the forward output.
    row_dot_p, row_dot_o : (B, Hq, Q) float64; written: ``sum P G_P`` and ``sum G_O O``
    grad_scores : (B, Hq, Q, K) float64; written: ``P (G_P - D)`` with D = ``row_dot_p``
    """
    B, Hq, Q, K = probs.shape
    Dv = g_o.shape[3]
    for row in prange(B * Hq * Q):
        b, h, i = _unravel_row(row, Hq, Q)
        gp = grad_probs[b, h, i]
        if has_drop:
            gc = grad_consumed[b, h, i]
            for j in range(K):
                gp[j] = gc[j] * at(z[0], z[1], b, h, i, j)  # Z gates the direct gradient
        p = probs[b, h, i]
        d = row_dot(p, gp, K)
        row_dot_p[b, h, i] = d
        row_dot_o[b, h, i] = row_dot(g_o[b, h, i], output[b, h, i], Dv)
        gs = grad_scores[b, h, i]
        for j in range(K):
            gs[j] = p[j] * (gp[j] - d)  # exactly 0 where P == 0

