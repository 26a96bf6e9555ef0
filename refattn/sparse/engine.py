"""Forward and backward of a :class:`~refattn.sparse.call.SparseCall` on two backends.

Owns :class:`SparseTrace`, :class:`SparseGradients`, :func:`sparse_forward`,
:func:`sparse_backward` and :func:`sparse_value_and_grad`. Backends: ``"numpy"`` (the
reference, :mod:`refattn.sparse.reference`) and ``"numba"`` (:mod:`refattn.sparse.kernels`:
parallel, the same bits on every thread count). Both hold ``O(Q x k)`` at most, never
``(Q, K)``; the memory each needs is checked before it allocates (:func:`~refattn._memory.
check_bytes`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Literal, cast

import numpy as np

from refattn._boundary import public
from refattn._checks import float64_input
from refattn._memory import check_bytes
from refattn.errors import RefAttnError
from refattn.sparse import reference
from refattn.sparse.call import SparseCall, sparse_bytes

__all__ = ["FUSED_ROWS", "SparseGradients", "SparseTrace", "fused_bytes", "sparse_backward",
           "sparse_forward", "sparse_value_and_grad"]

Backend = Literal["numpy", "numba"]


@dataclass(frozen=True, eq=False)
class SparseTrace:
    """The forward of a sparse call.

    Attributes
    ----------
    call : SparseCall
    output : (B, Hq, Q, Dv) ndarray
        0 on rows with no valid key.
    lse : (B, Hq, Q) ndarray
        Natural-log sum of exp over the row's valid scores and the sink; -inf on an empty row
        without sink.
    row_max : (B, Hq, Q) ndarray
        The largest valid score (or the sink); -inf on an empty row without sink.
    """

    call: SparseCall
    output: np.ndarray
    lse: np.ndarray
    row_max: np.ndarray


@dataclass(frozen=True, eq=False)
class SparseGradients:
    """Gradients of ``<grad_output, output>``.

    Attributes
    ----------
    grad_q : (B, Hq, Q, Dk) ndarray
    grad_k : (B, Hkv, K, Dk) ndarray
    grad_v : (B, Hkv, K, Dv) ndarray
    grad_sink : (Hq,) ndarray or None
    row_dot : (B, Hq, Q) ndarray
        ``D = rowsum(grad_output * output)``.
    """

    grad_q: np.ndarray
    grad_k: np.ndarray
    grad_v: np.ndarray
    grad_sink: np.ndarray | None
    row_dot: np.ndarray


def _kernels() -> Any:
    return importlib.import_module("refattn.sparse.kernels")


def _scale(call: SparseCall) -> float:
    """The call's scale (always set once the call is built)."""
    return float(cast(float, call.scale))


def _sink_args(call: SparseCall) -> tuple[np.ndarray, bool]:
    if call.sink is None:
        return np.zeros(call.q.shape[1]), False
    return call.sink, True


@public
def sparse_forward(call: SparseCall, backend: Backend = "numpy") -> SparseTrace:
    """Output, lse and row max of a sparse call.

    Parameters
    ----------
    call : SparseCall
    backend : {"numpy", "numba"}

    Examples
    --------
    >>> from refattn.sparse.lists import index_visibility
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 1, 3, 4)) for _ in range(3))
    >>> vis = index_visibility(np.array([[[[0, -1], [0, 1], [-1, -1]]]]), 3)
    >>> tr = sparse_forward(SparseCall(q, k, v, vis))
    >>> bool(np.allclose(tr.output[0, 0, 0], v[0, 0, 0])), tr.output[0, 0, 2].tolist()
    (True, [0.0, 0.0, 0.0, 0.0])
    """
    check_bytes(sparse_bytes(call, "forward"), "the sparse forward")
    idx = call.visibility.indices
    if backend == "numpy":
        out, lse, row_max = reference.forward(call.q, call.k, call.v, idx, call.index_head,
                                              call.kv_head, _scale(call), call.sink)
    else:
        B, Hq, Q, _ = call.q.shape
        out = np.empty((B, Hq, Q, call.v.shape[3]))
        lse = np.empty((B, Hq, Q))
        row_max = np.empty((B, Hq, Q))
        sink, has_sink = _sink_args(call)
        _kernels().forward(call.q, call.k, call.v, idx, call.index_head, call.kv_head,
                           call.scale, sink, has_sink, out, lse, row_max)
    return SparseTrace(call, out, lse, row_max)


@public
def sparse_backward(trace: SparseTrace, grad_output: np.ndarray,
                    backend: Backend = "numpy") -> SparseGradients:
    """Gradients of ``<grad_output, output>`` with respect to q, k, v (and the sink).

    Parameters
    ----------
    trace : SparseTrace
    grad_output : (B, Hq, Q, Dv) float64 ndarray
    backend : {"numpy", "numba"}

    Examples
    --------
    >>> from refattn.sparse.lists import index_visibility
    >>> x = np.ones((1, 1, 2, 2))
    >>> call = SparseCall(x, x, x, index_visibility(np.array([[[[0, 1], [1, -1]]]]), 2))
    >>> g = sparse_backward(sparse_forward(call), np.ones((1, 1, 2, 2)))
    >>> g.grad_v[0, 0].round(12).tolist()
    [[0.5, 0.5], [1.5, 1.5]]
    """
    if not isinstance(trace, SparseTrace):
        raise RefAttnError(f"trace: expected a SparseTrace, got {type(trace).__name__}")
    call = trace.call
    go = float64_input("grad_output", grad_output, 4)
    if go.shape != trace.output.shape:
        raise RefAttnError(f"grad_output: expected shape {list(trace.output.shape)} "
                           f"(B, Hq, Q, Dv), got {list(go.shape)}")
    check_bytes(sparse_bytes(call, "backward"), "the sparse backward")
    idx = call.visibility.indices
    if backend == "numpy":
        gq, gk, gv, gsink = reference.backward(
            call.q, call.k, call.v, idx, call.index_head, call.kv_head, _scale(call),
            call.sink, trace.output, trace.lse, go)
        dsum = np.einsum("bhqd,bhqd->bhq", go, trace.output)
        return SparseGradients(gq, gk, gv, gsink, dsum)
    kern = _kernels()
    go = np.ascontiguousarray(go)
    B, Hq, Q, _ = call.q.shape
    sink, has_sink = _sink_args(call)
    gq = np.empty_like(call.q)
    dsum = np.empty((B, Hq, Q))
    sink_term = np.empty((B, Hq, Q))
    kern.backward_rows(call.q, call.k, call.v, idx, call.index_head, call.kv_head, call.scale,
                       sink, has_sink, trace.output, trace.lse, go, gq, dsum, sink_term)
    ptr, rows = kern.transpose(idx, call.visibility.num_keys)
    gk = np.empty(call.k.shape)
    gv = np.empty(call.v.shape)
    kern.backward_keys(call.q, call.k, call.v, ptr, rows, idx.shape[1], call.index_head,
                       call.kv_head, call.scale, trace.lse, go, dsum, gk, gv)
    gsink = sink_term.sum(axis=(0, 2)) if has_sink else None
    return SparseGradients(gq, gk, gv, gsink, dsum)


#: rows of one (batch, query head) the fused path holds P and dS for at once (4 MiB each at
#: k = 2048): small enough that the key-major pass finds the window's q and dO rows in the
#: core's L2 cache; the row passes split it into chunks of ``kernels.CHUNK_ROWS``
FUSED_ROWS = 256


def fused_bytes(call: SparseCall) -> int:
    """Bytes :func:`sparse_value_and_grad`'s fused numba path allocates beyond its inputs:
    outputs, gradients, row statistics and one window's sorted lists, block starts, P and dS.

    Examples
    --------
    >>> from refattn.sparse.lists import index_visibility
    >>> x = np.ones((1, 1, 2, 4))
    >>> fused_bytes(SparseCall(x, x, x, index_visibility(np.array([[[[0], [1]]]]), 2)))
    440
    """
    a = call.axes
    rows = a["B"] * a["Hq"] * a["Q"]
    window = min(a["Q"], FUSED_ROWS)
    blocks = -(-a["K"] // _kernels().BLOCK_KEYS)
    return (8 * rows * (a["Dv"] + a["Dk"] + 4)
            + 8 * a["B"] * a["Hkv"] * a["K"] * (a["Dk"] + a["Dv"])
            + window * (16 * a["k"] + 16 * a["k"] + 4 * (blocks + 1) + 8)
            + 8 * (a["K"] + 1))


def _fused(call: SparseCall, go: np.ndarray) -> tuple[SparseTrace, SparseGradients]:
    kern = _kernels()
    B, Hq, Q, _ = call.q.shape
    _, _, K, Dv = call.v.shape
    idx = call.visibility.indices
    kk = idx.shape[3]
    scale = _scale(call)
    sink, has_sink = _sink_args(call)
    out = np.empty((B, Hq, Q, Dv))
    lse, row_max, dsum, sink_term = (np.empty((B, Hq, Q)) for _ in range(4))
    gq = np.empty_like(call.q)
    gk = np.zeros(call.k.shape)
    gv = np.zeros(call.v.shape)
    rows = min(Q, FUSED_ROWS)
    P = np.empty((rows, kk))
    DS = np.empty((rows, kk))
    m = np.empty(rows)
    sidx = np.empty((rows, kk), np.int64)
    starts = np.empty((rows, -(-K // kern.BLOCK_KEYS) + 1), np.int32)
    tptr = np.empty(K + 1, np.int64)
    tpos = np.empty(rows * kk, np.int64)
    for b in range(B):
        for i0 in range(0, Q, rows):
            n = min(rows, Q - i0)
            listed = -1
            for h in range(Hq):  # query heads in order: each kv head's sums in a fixed order
                ih, kh = int(call.index_head[h]), int(call.kv_head[h])
                if ih != listed:
                    kern.window_lists(idx[b, ih, i0:i0 + n], call.visibility.is_sorted,
                                      sidx[:n], starts[:n])
                    kern.block_transpose(sidx[:n], starts[:n], tptr, tpos)
                    listed = ih
                qh, kh_, vh, goh = call.q[b, h], call.k[b, kh], call.v[b, kh], go[b, h]
                kern.block_scores(qh, kh_, sidx[:n], starts[:n], i0, scale, P, m)
                kern.block_softmax(starts[:n], i0, float(sink[h]), has_sink, P, m, out[b, h],
                                   lse[b, h], row_max[b, h], gq[b, h])
                kern.block_values(vh, goh, sidx[:n], starts[:n], i0, P, DS, out[b, h])
                kern.block_grad_q(kh_, goh, sidx[:n], starts[:n], i0, scale, float(sink[h]),
                                  has_sink, P, DS, out[b, h], lse[b, h], dsum[b, h],
                                  sink_term[b, h], gq[b, h])
                kern.block_grad_kv(qh, goh, tptr, tpos, i0, kk, scale, P, DS, gk[b, kh],
                                   gv[b, kh])
    gsink = sink_term.sum(axis=(0, 2)) if has_sink else None
    return (SparseTrace(call, out, lse, row_max),
            SparseGradients(gq, gk, gv, gsink, dsum))


@public
def sparse_value_and_grad(call: SparseCall, grad_output: np.ndarray,
                          backend: Backend = "numba") -> tuple[SparseTrace, SparseGradients]:
    """Forward and backward at once (default on numba: the fused path).

    On numba, a window of :data:`FUSED_ROWS` rows at a time: passes over its sorted lists,
    key block by key block (a block's K or V rows read from memory once per chunk of rows,
    then from cache), compute the output, ``lse``, ``D`` and ``dQ`` and keep each slot's
    ``P`` and ``dS``; a key-major pass then adds the window into ``dK`` and ``dV`` (six
    length-D vector operations per listed key instead of the nine of forward then
    backward). The same bits on every thread count. On numpy: :func:`sparse_forward` then
    :func:`sparse_backward`.

    Examples
    --------
    >>> from refattn.sparse.lists import index_visibility
    >>> x = np.ones((1, 1, 2, 2))
    >>> call = SparseCall(x, x, x, index_visibility(np.array([[[[0, 1], [1, -1]]]]), 2))
    >>> tr, g = sparse_value_and_grad(call, np.ones((1, 1, 2, 2)), backend="numpy")
    >>> tr.lse.shape, g.grad_q.shape
    ((1, 1, 2), (1, 1, 2, 2))
    """
    if backend == "numba":
        go = float64_input("grad_output", grad_output, 4)
        want = (*call.q.shape[:3], call.v.shape[3])
        if go.shape != want:
            raise RefAttnError(f"grad_output: expected shape {list(want)} (B, Hq, Q, Dv), got "
                               f"{list(go.shape)}")
        check_bytes(fused_bytes(call), "the fused sparse forward and backward")
        return _fused(call, np.ascontiguousarray(go))
    trace = sparse_forward(call, backend)
    return trace, sparse_backward(trace, grad_output, backend)
