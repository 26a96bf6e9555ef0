"""The ``numba`` CPU backend: dense (the full trace) or streaming (output and lse only).

``refattn.forward(call, backend="numba")`` computes the same full
:class:`~refattn.engine.trace.Trace` as the NumPy reference: GEMMs on multi-threaded BLAS, the
per-row work (scale, bias, visibility, max, exp, normalise, multiplier) fused in parallel numba
kernels, no needless temporaries (like the reference: ``biased_scores`` is ``scores`` without a
bias, ``masked_scores`` is ``biased_scores`` without a mask, ``consumed`` is ``probs`` without
dropout, and the all-ones multiplier is a broadcast view). ``refattn.backward`` likewise.

``refattn.forward(call, backend="numba", materialize=False)`` streams: a tiled online softmax
that saves only output, row max and lse ``(B, Hq, Q)``; its backward recomputes P per tile from
lse and regenerates the dropout multiplier from the Philox stream by coordinates. No
``(Q, K)``-sized tensor is allocated; visibility given as a
:class:`~refattn.masks.VisibilityRelation` is evaluated per tile from coordinates
(fully invisible tiles are skipped), and a dense ``visible``, ``bias`` or multiplier array is
read per tile. ``Trace.materialized`` records what was not materialised.

Owns option parsing, the dense/streaming dispatch and the assembly of kernel arguments; defers
arithmetic to :mod:`~refattn.engine.numba.kernels` (dense rows) and
:mod:`~refattn.engine.numba.stream` (tiles). Kernels are compiled once and cached on disk
(``cache=True``); the thread count follows numba's (``numba.set_num_threads``), and results are
bit-identical run to run for a fixed thread count.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np

from refattn._memory import check_bytes
from refattn.call import AttentionCall
from refattn.call.gate import check_head_map
from refattn.dropout import Philox
from refattn.engine.alloc import zeros_block
from refattn.engine.memory import check_memory
from refattn.engine.numba.blas import dgemm_address, single_thread_blas
from refattn.engine.numba.kernels import dense_backward_rows, dense_forward_rows
from refattn.engine.numba.operands import DROP_DENSE, DROP_NONE, DROP_PHILOX, Strided, ro, strided
from refattn.engine.numba.philox import philox_fill, philox_params
from refattn.engine.numba.stream import stream_backward as _stream_backward_kernel
from refattn.engine.numba.stream import stream_forward as _stream_forward_kernel
from refattn.engine.numba.tiles import tile_visibility
from refattn.engine.reduce import gather_heads, reduce_to_shape, sum_heads
from refattn.engine.trace import FORWARD_NAMES, Gradients, Trace
from refattn.errors import RefAttnError

__all__ = ["BLOCK_K", "BLOCK_Q", "backward", "forward"]

#: default streaming tile: query rows x key rows
BLOCK_Q = 256
BLOCK_K = 256

_STREAM_SAVED = ("output", "row_max", "lse", "sanitized_rows")
# (attribute, default) pairs of score modifiers this backend does not implement
_DEFAULT_MODIFIERS = (("scale_placement", "post"), ("softcap", None), ("sink", None))


def _check_supported(call: AttentionCall) -> None:
    name = call.score.name  # the gate sets Dot() when no score is given
    if name != "dot":
        raise RefAttnError(
            f"score: the numba backend implements the dot score only, got {name!r}; "
            "use backend='numpy'"
        )
    for attr, default in _DEFAULT_MODIFIERS:
        value = getattr(call, attr)
        if value is None if default is None else value == default:
            continue
        shown = "an array" if isinstance(value, np.ndarray) else repr(value)
        raise RefAttnError(
            f"{attr}: the numba backend supports only {default!r}, got {shown}; "
            "use backend='numpy'"
        )


def _sub_block(call: AttentionCall) -> int:
    """Side of the sub-products of the (tile x D) GEMMs: ``s * s * D <= 100**3`` (the size
    OpenBLAS runs with its unpacked small-matrix kernels), a multiple of 8."""
    D = max(call.q.shape[3], call.v.shape[3])
    return max(8, math.isqrt(1_000_000 // D) // 8 * 8)


def _block(name: str, value: Any, default: int, n: int) -> int:
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise RefAttnError(f"{name}: expected a positive int, got {value!r}")
    return int(min(int(value), n))


def _query_valid(call: AttentionCall) -> np.ndarray:
    return ro(call.query_valid_full()[:, 0, :, 0])  # (B, Q)


def _zero_unused_rows(x: np.ndarray, call: AttentionCall) -> None:
    """In place: rows of a (B, Hq, Q, D) array whose query is unused become exactly +0.0."""
    if call.query_valid is not None:
        np.copyto(x, 0.0, where=~call.query_valid_full())


_NO_PHILOX = (np.uint64(0), np.uint64(0), np.uint64(0), np.uint64(0), 1.0)


def _drop_args(mode: int, params: tuple = _NO_PHILOX) -> tuple:
    return (np.int64(mode), *params)


# -- dense mode ------------------------------------------------------------------------------
def _dense_multiplier(call: AttentionCall, full: tuple[int, ...]) -> tuple[Any, Strided | None]:
    """(Z for the trace, kernel operand) of a dense forward; (ones view, None) without dropout."""
    source = call.dropout
    if source is None:
        return np.broadcast_to(np.float64(1.0), full), None
    if isinstance(source, np.ndarray):
        return np.broadcast_to(source, full), strided(source, full, np.float64)
    if isinstance(source, Philox):
        z = np.empty(full)
        philox_fill(z, *philox_params(source))  # bit-identical to source.multiplier
    else:
        z = call.multiplier_full()
    return z, strided(z, full, np.float64)


def _dense_forward(call: AttentionCall) -> Trace:
    full = call.score_shape
    B, Hq, Q, _ = full
    q, k, v = ro(call.q), ro(call.k), ro(call.v)
    k_eff = gather_heads(k, call.head_map)  # (B, Hq, K, Dk)
    v_eff = gather_heads(v, call.head_map)  # (B, Hq, K, Dv)
    scores = q @ k_eff.swapaxes(-1, -2)  # (B, Hq, Q, K); scaled in place by the row kernel
    has_bias = call.bias is not None
    visible = call.visible_array()
    biased = np.empty_like(scores) if has_bias else scores
    masked = biased if visible is None else np.empty_like(scores)  # every edge legal
    probs = np.empty_like(scores)
    z_trace, z_op = _dense_multiplier(call, full)
    consumed = probs if z_op is None else np.empty_like(scores)
    row_max = np.empty((B, Hq, Q))
    lse = np.empty((B, Hq, Q))
    sanitized = np.empty((B, Hq, Q), dtype=bool)
    dense_forward_rows(
        scores, call.scale, has_bias, strided(call.bias, full, np.float64), biased,
        visible is not None, strided(visible, full, np.bool_), masked,
        z_op is not None, z_op if z_op is not None else strided(None, full, np.float64),
        probs, consumed, row_max, lse, sanitized,
    )
    output = consumed @ v_eff  # (B, Hq, Q, Dv)
    _zero_unused_rows(output, call)
    return Trace(
        call=call, scores=scores, biased_scores=biased, masked_scores=masked, row_max=row_max,
        lse=lse, probs=probs, dropout_multiplier=z_trace, consumed=consumed, output=output,
        sanitized_rows=sanitized, backend="numba",
        materialized={"scores": True, "probabilities": True, "mode": "dense",
                      "aliases": _aliases(has_bias, visible is not None,
                                          z_op is not None)},
    )


def _aliases(has_bias: bool, has_vis: bool, has_drop: bool) -> list[str]:
    out = [] if has_bias else ["biased_scores is scores (no bias)"]
    if not has_vis:
        out += ["masked_scores is biased_scores (every edge legal)"]
    if not has_drop:
        out += ["consumed is probs (no dropout)", "dropout_multiplier is a broadcast 1.0"]
    return out


def _dense_backward(trace: Trace, grad_output: np.ndarray) -> Gradients:
    call = trace.call
    full = call.score_shape
    B, Hq, Q, _ = full
    q, k, v = ro(call.q), ro(call.k), ro(call.v)
    k_eff = gather_heads(k, call.head_map)
    v_eff = gather_heads(v, call.head_map)
    g_o = np.array(grad_output, dtype=np.float64, order="C")  # (B, Hq, Q, Dv)
    _zero_unused_rows(g_o, call)  # unused rows consume nothing
    grad_v_eff = trace.consumed.swapaxes(-1, -2) @ g_o  # (B, Hq, K, Dv) = Pdrop^T G_O
    grad_consumed = g_o @ v_eff.swapaxes(-1, -2)  # (B, Hq, Q, K) = G_O V^T
    has_drop = call.dropout is not None
    if not has_drop:
        z_op = strided(None, full, np.float64)
    elif isinstance(call.dropout, np.ndarray):
        z_op = strided(call.dropout, full, np.float64)
    else:
        z_op = strided(trace.dropout_multiplier, full, np.float64)  # full C array: no copy
    grad_probs = np.empty_like(grad_consumed) if has_drop else grad_consumed
    row_dot = np.empty((B, Hq, Q))
    row_dot_output = np.empty((B, Hq, Q))
    grad_scores = np.empty_like(grad_consumed)
    dense_backward_rows(grad_consumed, has_drop, z_op, grad_probs, ro(trace.probs), g_o,
                        ro(trace.output), row_dot, row_dot_output, grad_scores)
    grad_q = grad_scores @ k_eff  # (B, Hq, Q, Dk)
    grad_q *= call.scale
    grad_k_eff = grad_scores.swapaxes(-1, -2) @ q  # (B, Hq, K, Dk)
    grad_k_eff *= call.scale
    Hkv = k.shape[1]
    return Gradients(
        grad_output=grad_output, grad_v=_head_sum(grad_v_eff, call.head_map, Hkv),
        grad_consumed=grad_consumed, grad_probs=grad_probs, row_dot=row_dot,
        row_dot_output=row_dot_output, grad_scores=grad_scores, grad_q=grad_q,
        grad_k=_head_sum(grad_k_eff, call.head_map, Hkv),
        grad_bias=None if call.bias is None else reduce_to_shape(grad_scores, call.bias.shape),
    )


def _head_sum(x_eff: np.ndarray, head_map: np.ndarray, Hkv: int) -> np.ndarray:
    if np.array_equal(head_map, np.arange(Hkv)):
        return x_eff
    return sum_heads(x_eff, head_map, Hkv)


# -- streaming mode --------------------------------------------------------------------------
def _stream_dropout(call: AttentionCall, full: tuple[int, ...]) -> tuple[tuple, Strided, str]:
    source = call.dropout
    if source is None:
        return _drop_args(DROP_NONE), strided(None, full, np.float64), "none"
    if isinstance(source, np.ndarray):
        return (_drop_args(DROP_DENSE), strided(source, full, np.float64),
                "dense multiplier read per tile")
    if isinstance(source, Philox):
        return (_drop_args(DROP_PHILOX, tuple(philox_params(source))),
                strided(None, full, np.float64), "philox4x32-10 regenerated by coordinates")
    raise RefAttnError(
        f"dropout: streaming mode regenerates the multiplier by coordinates and supports "
        f"refattn.dropout.Philox or an explicit multiplier array, got "
        f"{type(source).__name__}; pass materialize=True or the multiplier array"
    )


def _stream_forward(call: AttentionCall, block_q: Any, block_k: Any) -> Trace:
    if call.returned_weights != "none":
        raise RefAttnError(
            f"returned_weights: {call.returned_weights!r} asks for attention weights, which "
            "streaming mode never materialises; pass materialize=True (dense mode)"
        )
    full = call.score_shape
    B, Hq, Q, K = full
    BQ = _block("block_q", block_q, BLOCK_Q, Q)
    BK = _block("block_k", block_k, BLOCK_K, K)
    drop, z_op, drop_kind = _stream_dropout(call, full)
    tv = _tile_visibility(call)
    out, lse, row_max = zeros_block((B, Hq, Q, call.v.shape[3]), (B, Hq, Q), (B, Hq, Q))
    sanitized = np.zeros((B, Hq, Q), dtype=bool)
    nqb = -(-Q // BQ)
    tiles = np.zeros((B * Hq * nqb, 2), dtype=np.int64)
    with single_thread_blas(), numba.parallel_chunksize(1):  # tasks dealt dynamically
        _stream_forward_kernel(
            ro(call.q), ro(call.k), ro(call.v), ro(call.head_map), call.scale, tv,
            call.bias is not None, strided(call.bias, full, np.float64), drop, z_op,
            _query_valid(call), BQ, BK, _sub_block(call), dgemm_address(),
            numba.get_num_threads(), out, lse,
            row_max, sanitized, tiles,
        )
    done, skipped = (int(x) for x in tiles.sum(axis=0))
    materialized = {
        "scores": False, "probabilities": False, "mode": "streaming",
        "saved": list(_STREAM_SAVED),
        "not_materialized": [n for n in FORWARD_NAMES if n not in _STREAM_SAVED],
        "block_q": BQ, "block_k": BK, "visibility": tv.mode, "dropout": drop_kind,
        "tiles_computed": done, "tiles_skipped": skipped,
    }
    return Trace(
        call=call, scores=None, biased_scores=None, masked_scores=None, row_max=row_max,
        lse=lse, probs=None, dropout_multiplier=None, consumed=None, output=out,
        sanitized_rows=sanitized, backend="numba", materialized=materialized,
    )


def _tile_visibility(call: AttentionCall) -> Any:
    """Kernel form of the call's visibility; a relation stays coordinates (never dense)."""
    if call.relation is not None:
        return tile_visibility(call.score_shape, relation=call.relation)
    return tile_visibility(call.score_shape, visible=call.visible)


def _task_threads() -> int:
    """Threads the backward's task layout is sized for (numba's current thread count)."""
    return numba.get_num_threads()


def _partition(call: AttentionCall, nkb: int) -> tuple[bool, bool, int, int]:
    """(split_b, split_h, C, Cb): task layout so that no two tasks write one element.

    Tasks split B and Hq unless a bias broadcast over that axis would collect its gradient
    from two tasks; when that leaves fewer task groups than threads, each group's key blocks
    are dealt round-robin to C chunks (chunk-partial dQ and row sums, added in chunk order).
    The layout depends on the thread count, so results are bit-identical for a fixed one.
    """
    B, Hq = call.q.shape[:2]
    split_b = split_h = True
    Kb = 1
    if call.bias is not None:
        Bb, Hb, _, Kb = (1,) * (4 - call.bias.ndim) + call.bias.shape
        split_b = Bb == B or B == 1  # a bias shared across b collects from every b
        split_h = Hb == Hq or Hq == 1
    groups = (B if split_b else 1) * (Hq if split_h else 1)
    threads = _task_threads()
    C = 1 if groups >= threads else min(nkb, math.ceil(threads / groups))
    Cb = C if call.bias is not None and Kb == 1 else 1
    return split_b, split_h, C, Cb


def _stream_backward(trace: Trace, grad_output: np.ndarray) -> Gradients:
    call = trace.call
    full = call.score_shape
    B, Hq, Q, K = full
    Dk = call.q.shape[3]
    Dv = call.v.shape[3]
    BQ = int(trace.materialized["block_q"])
    BK = int(trace.materialized["block_k"])
    drop, z_op, _ = _stream_dropout(call, full)
    tv = _tile_visibility(call)
    if call.query_valid is None:  # read only by the kernel: no copy needed
        g_o = np.ascontiguousarray(grad_output, dtype=np.float64)  # (B, Hq, Q, Dv)
    else:
        g_o = np.array(grad_output, dtype=np.float64, order="C")
        _zero_unused_rows(g_o, call)
    # (B, Hq, Q) D = sum_d G_O O, before any dS; einsum needs no (B, Hq, Q, Dv) temporary
    dvec = np.einsum("bhqd,bhqd->bhq", g_o, trace.output)
    nkb = -(-K // BK)
    split_b, split_h, C, Cb = _partition(call, nkb)
    bias_shape = None if call.bias is None else call.bias.shape
    gshape = (1, 1, 1, 1) if bias_shape is None else (1,) * (4 - len(bias_shape)) + bias_shape
    Hkv = call.k.shape[1]
    # per query head dK and dV partials (summed over a kv head's query heads afterwards, in
    # order: the same bits on every thread count), the per-chunk dQ and the sums: refused
    # before any allocation when they would not fit (a 128:1 MLA call needs Hq x the kv size)
    check_bytes(8 * (C * B * Hq * Q * (Dk + 1) + B * (Hq + Hkv) * K * (Dk + Dv)
                     + B * Hq * Q * Dv + Cb * math.prod(gshape)),
                f"the numba streaming backward's per-query-head dK/dV partials over (B, Hq, K) "
                f"= ({B}, {Hq}, {K})",
                "refattn.engine.value_and_grad(call, grad_output, backend='numba') (the fused "
                "kernel sums a kv head's query heads as it goes), or fewer heads per call")
    dq, dk, dv, rowdot, gbias = zeros_block(
        (C, B, Hq, Q, Dk), (B, Hq, K, Dk), (B, Hq, K, Dv), (C, B, Hq, Q), (Cb, *gshape)
    )
    ntasks = (B if split_b else 1) * (Hq if split_h else 1) * C
    tiles = np.zeros((ntasks, 2), dtype=np.int64)
    with single_thread_blas(), numba.parallel_chunksize(1):  # tasks dealt dynamically
        _stream_backward_kernel(
            ro(call.q), ro(call.k), ro(call.v), ro(call.head_map), call.scale, tv,
            call.bias is not None, strided(call.bias, full, np.float64), drop, z_op, ro(g_o),
            ro(trace.lse), ro(dvec), BQ, BK, _sub_block(call), split_b, split_h, C,
            dgemm_address(),
            numba.get_num_threads(), dq, dk, dv, rowdot, gbias, tiles,
        )
    return Gradients(
        grad_output=grad_output, grad_v=_head_sum(dv, call.head_map, Hkv),
        grad_consumed=None, grad_probs=None, row_dot=rowdot.sum(axis=0) if C > 1 else rowdot[0],
        row_dot_output=dvec, grad_scores=None,
        grad_q=dq.sum(axis=0) if C > 1 else dq[0],
        grad_k=_head_sum(dk, call.head_map, Hkv),
        grad_bias=None if bias_shape is None else gbias.sum(axis=0).reshape(bias_shape),
    )


# -- public interface ------------------------------------------------------------------------
def forward(
    call: AttentionCall,
    *,
    materialize: bool = True,
    block_q: int | None = None,
    block_k: int | None = None,
    max_bytes: int | None = None,
    **unknown: Any,
) -> Trace:
    """numba forward of a validated call (see :func:`refattn.forward`).

    Parameters
    ----------
    call : AttentionCall
        Dot score, post scale placement, no softcap and no sink (others raise).
    materialize : bool
        True (dense): the full trace, like the reference. False (streaming): output, row_max,
        lse and sanitized_rows only; every (B, Hq, Q, K) field of the trace is None.
    block_q, block_k : int, optional
        Streaming tile (default :data:`BLOCK_Q` x :data:`BLOCK_K`, capped at Q and K).
    max_bytes : int, optional
        Dense mode: refuse, before allocating, a call whose estimated peak memory
        (:func:`refattn.engine.memory.dense_bytes`) exceeds this (default: the available
        memory).

    Returns
    -------
    Trace
        ``backend == "numba"``; ``materialized["mode"]`` is "dense" or "streaming", and a
        streaming trace lists what it did not materialise and how many tiles it skipped.

    Raises
    ------
    RefAttnError
        On an unknown option, an unsupported score modifier, weights requested from a
        streaming call, or a non-Philox dropout stream in streaming mode.

    Examples
    --------
    >>> import numpy as np, refattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 5, 4)) for _ in range(3))
    >>> call = refattn.AttentionCall(q, k, v, visible=np.tril(np.ones((5, 5), bool)))
    >>> ref = refattn.forward(call)
    >>> t = refattn.forward(call, backend="numba", materialize=False, block_q=2, block_k=2)
    >>> t.probs is None, t.materialized["tiles_skipped"], bool(np.allclose(t.output, ref.output))
    (True, 6, True)
    """
    if unknown:
        raise RefAttnError(
            f"numba backend: unknown option(s) {sorted(unknown)}; known: materialize, "
            "block_q, block_k, max_bytes"
        )
    if not isinstance(materialize, (bool, np.bool_)):
        raise RefAttnError(f"materialize: expected True or False, got {materialize!r}")
    _check_supported(call)
    check_head_map(call)  # the kernels index k and v with it unchecked
    if materialize:
        if block_q is not None or block_k is not None:
            raise RefAttnError("block_q/block_k: tile sizes apply only with materialize=False")
        check_memory(call, "forward", backend="numba", max_bytes=max_bytes)
        return _dense_forward(call)
    return _stream_forward(call, block_q, block_k)


def backward(trace: Trace, grad_output: np.ndarray) -> Gradients:
    """numba backward of a numba trace (see :func:`refattn.backward`).

    A dense trace gives every gradient intermediate; a streaming trace recomputes P per tile
    and returns grad_consumed, grad_probs and grad_scores as None.

    Examples
    --------
    >>> import numpy as np, refattn
    >>> rng = np.random.default_rng(1)
    >>> q, k, v = (rng.standard_normal((1, 1, 3, 2)) for _ in range(3))
    >>> t = refattn.forward(refattn.AttentionCall(q, k, v), backend="numba", materialize=False)
    >>> g = refattn.backward(t, np.ones((1, 1, 3, 2)))
    >>> g.grad_scores is None, g.grad_q.shape
    (True, (1, 1, 3, 2))
    """
    check_head_map(trace.call)  # the kernels index k and v with it unchecked
    if trace.materialized.get("mode") == "streaming":
        return _stream_backward(trace, grad_output)
    check_memory(trace.call, "backward", backend="numba")
    return _dense_backward(trace, grad_output)


#: value_and_grad streams (tiled online softmax; the backward recomputes P per tile) once key
#: rows reach this length at D = 64, proportionally longer at larger D: the fused kernel's row
#: passes then leave the caches. Measured f+b on a 2-core AMD EPYC (Zen 5), OpenBLAS
#: SkylakeX: (1, 4, 8192, 64) streaming 136 GF/s, fused 119-121; (1, 2, 16384, 64) 137 against
#: 112-121; (1, 8, 4096, 64) 144 against 146; (1, 4, 8192, 128) 143 against 140-147.
STREAM_KEYS_AT_D64 = 8192


def _streams(call: AttentionCall) -> bool:
    """Whether value_and_grad takes the streaming kernels for ``call`` (long keys, and a call
    they run: the dot score, post placement, no softcap or sink)."""
    D = max(call.q.shape[3], call.v.shape[3])
    if call.k.shape[2] * 64 < STREAM_KEYS_AT_D64 * D:
        return False
    try:
        _check_supported(call)
    except RefAttnError:
        return False
    return True


def value_and_grad(call: AttentionCall, grad_output: np.ndarray, *,
                   budget_bytes: int | None = None) -> tuple[np.ndarray, Gradients]:
    """Output and gradients with no trace: the fused kernel (see :mod:`.fused`), or the
    streaming kernels for long key rows (:data:`STREAM_KEYS_AT_D64`).

    Every call the NumPy reference accepts runs: the dot, bilinear and cosine families, every
    scale placement, softcap, sinks, bias, masks, dropout and GQA on the fused kernel, with the
    calibrated BLAS provider and layout (:mod:`.calibration`); the additive family (whose pair
    tensor is (B, Hq, Q, K, Da)) falls back to the NumPy reference.

    Parameters
    ----------
    call : AttentionCall
    grad_output : (B, Hq, Q, Dv) float64 ndarray
    budget_bytes : int, optional
        Per-thread bytes of the (BQ x K) score buffers; the query block is the largest that
        fits (the whole head when it does). Given, the fused kernel runs at any length.

    Examples
    --------
    >>> import numpy as np, refattn
    >>> rng = np.random.default_rng(2)
    >>> q, k, v = (rng.standard_normal((1, 2, 6, 4)) for _ in range(3))
    >>> call = refattn.AttentionCall(q, k, v, softcap=2.0)
    >>> out, g = refattn.value_and_grad(call, np.ones((1, 2, 6, 4)), backend="numba")
    >>> ref = refattn.backward(refattn.forward(call), np.ones((1, 2, 6, 4)))
    >>> bool(np.allclose(g.grad_q, ref.grad_q, rtol=1e-12, atol=1e-14))
    True
    """
    from refattn.engine.numba import fused_host
    from refattn.engine.numba.calibration import current_provider
    from refattn.engine.reference import backward as ref_backward
    from refattn.engine.reference import forward as ref_forward

    check_head_map(call)  # the kernels index k and v with it unchecked
    if call.score.name == "additive":  # no fast path: the reference (documented fallback)
        trace = ref_forward(call)
        return trace.output, ref_backward(trace, grad_output)
    if budget_bytes is None and _streams(call):
        trace = _stream_forward(call, None, None)
        return trace.output, backward(trace, grad_output)
    options = {} if budget_bytes is None else {"budget": int(budget_bytes)}
    out, grads, _ = fused_host.value_and_grad(call, grad_output, provider=current_provider(),
                                              **options)
    return out, grads
