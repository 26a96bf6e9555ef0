"""The ``"exact"`` backend: every canonical tensor correctly rounded, step by step.

Each canonical tensor is the round-to-nearest-even binary64 value of its defining real-number
operation applied to the already-rounded canonical tensors before it; the rounding points are
defined once in :mod:`refattn.engine.exact.program` (listed in ``docs/EXACT_ROUNDING.md``) and
named in every manifest this backend writes. The result depends on the inputs alone: not on
BLAS, thread counts, numpy's SIMD paths, its version or the machine.

Owns the backend interface (``forward``/``backward`` returning Trace/Gradients); the up-front
time estimate that refuses a call too large for correctly rounded arithmetic is
:mod:`refattn.engine.exact.estimate`'s (which needs no python-flint).
"""

from __future__ import annotations

import numpy as np

from refattn.call import AttentionCall
from refattn.engine.exact.estimate import DEFAULT_MAX_SECONDS, SECONDS_PER_ELEMENT, estimate_seconds
from refattn.engine.exact.program import Stepwise, backward_tensors, forward_tensors
from refattn.engine.trace import Gradients, Trace
from refattn.errors import RefAttnError

__all__ = ["ARITHMETIC_MODE", "DEFAULT_MAX_SECONDS", "SECONDS_PER_ELEMENT", "backward",
           "estimate_seconds", "forward"]

ARITHMETIC_MODE = "stepwise_correctly_rounded"


def forward(call: AttentionCall, *, max_seconds: float = DEFAULT_MAX_SECONDS) -> Trace:
    """Correctly rounded forward trace of a validated call (see :func:`refattn.forward`).

    Parameters
    ----------
    call : AttentionCall
    max_seconds : float
        Refuse, before any arithmetic, a call whose estimated forward+backward time
        (:func:`estimate_seconds`) exceeds this.

    Examples
    --------
    >>> import refattn
    >>> x = np.array([[[[0.1, 0.2], [0.3, 0.4]]]])
    >>> t = refattn.forward(refattn.AttentionCall(x, x, x), backend="exact")
    >>> t.backend, t.arithmetic
    ('exact', 'stepwise_correctly_rounded')
    """
    need = estimate_seconds(call)
    if need > max_seconds:
        a = call.axes
        raise RefAttnError(
            f"backend 'exact': this call would take about {need:.0f} s "
            f"(B*Hq*Q*K = {a['B'] * a['Hq'] * a['Q'] * a['K']} score elements, each correctly "
            f"rounded), over max_seconds={max_seconds:g}; pass a larger max_seconds or use "
            "backend='numpy' (or 'numba') for calls of this size"
        )
    tensors = forward_tensors(call, Stepwise())
    return Trace(call=call, backend="exact", arithmetic=ARITHMETIC_MODE, **tensors)


def backward(trace: Trace, grad_output: np.ndarray) -> Gradients:
    """Correctly rounded gradients of an exact trace (see :func:`refattn.backward`).

    Examples
    --------
    >>> import refattn
    >>> x = np.array([[[[0.1, 0.2], [0.3, 0.4]]]])
    >>> t = refattn.forward(refattn.AttentionCall(x, x, x), backend="exact")
    >>> g = refattn.backward(t, np.ones_like(x))
    >>> bool(np.allclose(g.row_dot, g.row_dot_output, rtol=1e-15)), g.grad_q.shape
    (True, (1, 1, 2, 2))
    """
    fwd = {name: getattr(trace, name) for name in
           ("probs", "dropout_multiplier", "consumed", "output", "scores", "sink_probs")}
    return Gradients(**backward_tensors(trace.call, fwd, grad_output, Stepwise()))
