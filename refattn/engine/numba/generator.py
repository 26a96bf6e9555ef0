"""The numba golden generator: the fused kernel on a layout fixed by constants.

Owns :func:`generate`, what ``refattn golden --backend numba`` runs for every case: the fused
forward+backward kernel (:mod:`~refattn.engine.numba.fused_host`) with scipy's OpenBLAS on one
thread per task, a fixed buffer budget and small-matrix tile, and query chunks sized for
:data:`NOMINAL_THREADS` threads whatever the machine has. Each task (batch row, kv head, chunk
of query blocks) computes its rows alone and the chunks' partial sums are added on the host in
a fixed order, so the bits depend on the BLAS library and its kernel (recorded in the bundle)
but never on the run or the thread count. :func:`environment` is that record.

The tensors are those of a saved-state kernel: output, row max, lse and the sanitised rows of
the forward, and every gradient (dQ, dK, dV, the bias and sink gradients, the score family's
parameters, both row dots); no ``(B, Hq, Q, K)`` tensor. Calls the fused kernel does not run
(the additive score, attention weights requested) are refused, naming the field.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numba
import numpy as np

from refattn.call import AttentionCall
from refattn.engine.numba.fused_host import KEY_CHUNK, task_layout, value_and_grad
from refattn.engine.numba.providers import TILE_KIB, Provider, available_providers
from refattn.engine.trace import FORWARD_NAMES, SAVED_STATE_NAMES, Gradients, Trace
from refattn.errors import RefAttnError

__all__ = ["BUDGET", "NOMINAL_THREADS", "SAVED", "Generated", "environment", "generate",
           "materialization", "refusal"]

#: threads the query chunks are sized for (whatever runs them)
NOMINAL_THREADS = 4
#: per-thread bytes of the score buffers (sets the query block)
BUDGET = 8 << 20
#: forward tensors the generator stores
SAVED = SAVED_STATE_NAMES


class Generated(NamedTuple):
    """A saved-state trace (no (B, Hq, Q, K) tensor) and the gradients of one call."""

    trace: Trace
    grads: Gradients


def _provider() -> Provider:
    """scipy's OpenBLAS (always present), heads layout, fixed budget and tile."""
    return available_providers()[0].with_layout("heads", BUDGET, tile_kib=TILE_KIB[0])


def environment() -> dict[str, Any]:
    """What the generator's bits depend on: numba, the BLAS library and kernel, the layout.

    Examples
    --------
    >>> sorted(environment())
    ['blas_provider', 'layout', 'numba']
    """
    record = _provider().record()
    return {"numba": numba.__version__,
            "blas_provider": {"library": record["provider"], "version": record["version"],
                              "tile_kib": record["tile_kib"]},
            "layout": {"nominal_threads": NOMINAL_THREADS, "budget_bytes": BUDGET,
                       "key_chunk": KEY_CHUNK}}


def refusal(call: AttentionCall) -> str | None:
    """Why the generator cannot run ``call`` (naming the field and what would), or None.

    Examples
    --------
    >>> x = np.zeros((1, 1, 2, 2))
    >>> refusal(AttentionCall(x, x, x)) is None
    True
    >>> refusal(AttentionCall(x, x, x, returned_weights="pre_dropout"))[:40]
    "returned_weights: 'pre_dropout' asks for"
    """
    if call.score.name == "additive":
        return ("score: the numba generator has no fused kernel for the 'additive' family; "
                "use backend 'exact' or 'numpy'")
    if call.returned_weights != "none":
        return (f"returned_weights: {call.returned_weights!r} asks for the attention weights, "
                "which the numba generator never materialises; use backend 'exact' or 'numpy'")
    return None


def materialization(call: AttentionCall) -> dict[str, Any]:
    """The ``materialization`` record of a generated call: what it stores and its layout, a
    function of the call alone (the same on every machine and thread count).

    Examples
    --------
    >>> x = np.zeros((1, 2, 300, 64))
    >>> m = materialization(AttentionCall(x, x, x))
    >>> m["mode"], m["block_q"], m["chunks"]
    ('saved_state', 160, 2)
    """
    provider = _provider()
    lay = task_layout(call, provider, BUDGET, nominal_threads=NOMINAL_THREADS)
    return {"scores": False, "probabilities": False, "mode": "saved_state",
            "saved": list(SAVED), "not_materialized": [n for n in FORWARD_NAMES if n not in SAVED],
            "block_q": int(lay.block_q), "chunks": int(lay.chunks), "key_chunk": KEY_CHUNK}


def generate(call: AttentionCall, grad_output: np.ndarray) -> Generated:
    """Forward and backward of ``call`` for a golden file, bit-identical on every thread count.

    Parameters
    ----------
    call : AttentionCall
        Any call but the additive score family and requested weights (:func:`refusal`).
    grad_output : (B, Hq, Q, Dv) float64 ndarray

    Returns
    -------
    Generated
        ``trace`` holds output, row_max, lse and sanitized_rows (``backend == "numba"``,
        ``materialized["mode"] == "saved_state"``); ``grads`` every input gradient and both
        row dots.

    Raises
    ------
    RefAttnError
        For a call the fused kernel does not run.

    Examples
    --------
    >>> import refattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 70, 40)) for _ in range(3))
    >>> call = refattn.AttentionCall(q, k, v, softcap=5.0)
    >>> g = generate(call, np.ones((1, 2, 70, 40)))
    >>> g.trace.probs is None, g.grads.grad_q.shape, g.trace.materialized["mode"]
    (True, (1, 2, 70, 40), 'saved_state')
    """
    why = refusal(call)
    if why is not None:
        raise RefAttnError(why)
    out, grads, info = value_and_grad(call, grad_output, provider=_provider(), budget=BUDGET,
                                      nominal_threads=NOMINAL_THREADS)
    materialized = materialization(call)
    if (materialized["block_q"], materialized["chunks"]) != (info["block_q"], info["chunks"]):
        raise RefAttnError(  # pragma: no cover - the layout is a function of the call alone
            f"numba generator: the kernel ran blocks of {info['block_q']} rows in "
            f"{info['chunks']} chunks, not the {materialized['block_q']} x "
            f"{materialized['chunks']} its record names")
    sanitized = np.ascontiguousarray(np.broadcast_to(info["sanitized"], call.score_shape[:3]))
    trace = Trace(call=call, scores=None, biased_scores=None, masked_scores=None,
                  row_max=info["row_max"], lse=info["lse"], probs=None,
                  dropout_multiplier=None, consumed=None, output=out,
                  sanitized_rows=sanitized, backend="numba", materialized=materialized)
    return Generated(trace, grads)
