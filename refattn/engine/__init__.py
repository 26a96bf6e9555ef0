"""The engine: run a validated call forward and backward on one of several backends.

Owns the named results (:class:`~refattn.engine.trace.Trace`, :class:`Gradients`), the backend
registry below (lookup by name, lazy import: the one place where a backend outside refattn, such
as ``gpu_backend``, may be loaded), the checks on ``grad_output``, the NumPy reference
(:mod:`~refattn.engine.reference`, the oracle), the numba backend (:mod:`refattn.engine.numba`)
and the reductions they share. It reads :mod:`refattn.call` and never imports analysis, bundle,
adapters or cli.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from refattn._boundary import public
from refattn._checks import as_array, check_finite, check_float64, check_shape, memory_error
from refattn.call import AttentionCall
from refattn.call.gate import check_head_map
from refattn.call.hazards import check_backward_overflow
from refattn.engine.trace import Gradients, Trace
from refattn.errors import RefAttnError

__all__ = ["BACKENDS", "ValueAndGrad", "attention", "backward", "forward", "get_backend",
           "value_and_grad"]

#: backend name -> module implementing ``forward(call, **options)`` and ``backward(trace, g)``
BACKENDS: dict[str, str] = {
    "numpy": "refattn.engine.reference",
    "numba": "refattn.engine.numba.backend",
    "exact": "refattn.engine.exact.backend",
    # the GPU path lives outside refattn (gpu_backend depends on refattn, never the reverse)
    "cuda_emulator": "gpu_backend.emulator_backend",
    "cupy": "gpu_backend.cupy_backend",
}


@public
def get_backend(name: str) -> ModuleType:
    """Import and return the backend module registered under ``name``.

    Examples
    --------
    >>> get_backend("numpy").__name__
    'refattn.engine.reference'
    """
    if name not in BACKENDS:
        raise RefAttnError(f"backend: unknown backend {name!r}; known backends: {sorted(BACKENDS)}")
    try:
        return importlib.import_module(BACKENDS[name])
    except ImportError as exc:
        raise RefAttnError(f"backend: {name!r} is not available here ({exc})") from None


@public
def forward(call: AttentionCall, *, backend: str = "numpy", **options: Any) -> Trace:
    """Run the forward pass of ``call`` and return every canonical intermediate.

    Parameters
    ----------
    call : AttentionCall
        A validated call.
    backend : str
        A name in :data:`BACKENDS` (``"numpy"`` is the reference).
    **options
        Backend-specific options (e.g. ``materialize=False`` for streaming backends).

    Returns
    -------
    Trace
        scores, biased_scores, masked_scores : (B, Hq, Q, K); row_max, lse : (B, Hq, Q);
        probs, dropout_multiplier, consumed : (B, Hq, Q, K); output : (B, Hq, Q, Dv).

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import AttentionCall
    >>> x = np.zeros((1, 1, 2, 4))
    >>> t = forward(AttentionCall(x, x, np.ones((1, 1, 2, 3))))
    >>> t.probs[0, 0].tolist(), t.output.shape
    ([[0.5, 0.5], [0.5, 0.5]], (1, 1, 2, 3))
    """
    if not isinstance(call, AttentionCall):
        raise RefAttnError(f"call: expected an AttentionCall, got {type(call).__name__}")
    module = get_backend(backend)
    check_head_map(call)  # every backend indexes k and v with it
    try:
        return module.forward(call, **options)
    except MemoryError as exc:
        raise memory_error(exc, f"the {backend} forward") from None


def _check_grad_output(call: AttentionCall, grad_output: object) -> np.ndarray:
    g = as_array("grad_output", grad_output)
    check_float64("grad_output", g)
    B, Hq, Q, _ = call.q.shape
    check_shape("grad_output", g, (B, Hq, Q, call.v.shape[3]), "B,Hq,Q,Dv")
    check_finite("grad_output", g)
    check_backward_overflow(call, g)  # every gradient stays finite
    return g


@public
def backward(trace: Trace, grad_output: np.ndarray) -> Gradients:
    """Hand-written backward of the exact sampled forward program (no autograd).

    Parameters
    ----------
    trace : Trace
        The forward trace (its backend also runs the backward).
    grad_output : (B, Hq, Q, Dv) float64 ndarray
        G_O, the gradient of the loss with respect to ``trace.output``.

    Returns
    -------
    Gradients
        grad_q (B, Hq, Q, Dk), grad_k (B, Hkv, K, Dk), grad_v (B, Hkv, K, Dv), grad_bias
        (shape of the bias), and the intermediates grad_consumed, grad_probs, row_dot (both
        contractions) and grad_scores.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import AttentionCall
    >>> rng = np.random.default_rng(1)
    >>> q, k, v = (rng.standard_normal(s) for s in [(1, 2, 3, 4), (1, 1, 5, 4), (1, 1, 5, 2)])
    >>> t = forward(AttentionCall(q, k, v))
    >>> g = backward(t, np.ones((1, 2, 3, 2)))
    >>> g.grad_k.shape, bool(np.allclose(g.row_dot, g.row_dot_output, rtol=1e-13))
    ((1, 1, 5, 4), True)
    """
    if not isinstance(trace, Trace):
        raise RefAttnError(f"trace: expected a Trace, got {type(trace).__name__}")
    g = _check_grad_output(trace.call, grad_output)
    module = get_backend(trace.backend)
    check_head_map(trace.call)
    try:
        return module.backward(trace, g)
    except MemoryError as exc:
        raise memory_error(exc, f"the {trace.backend} backward") from None


class ValueAndGrad(NamedTuple):
    """The output of a call and its gradients (:func:`value_and_grad`)."""

    output: np.ndarray
    gradients: Gradients


@public
def value_and_grad(call: AttentionCall, grad_output: np.ndarray, *, backend: str = "numpy",
                   **options: Any) -> ValueAndGrad:
    """Output and gradients of ``call`` for ``grad_output``, without keeping the full trace.

    A backend that has its own ``value_and_grad`` (numba's fused kernel, the GPU's streaming
    path) runs it; otherwise this is ``forward`` then ``backward``.

    Parameters
    ----------
    call : AttentionCall
    grad_output : (B, Hq, Q, Dv) float64 ndarray
    backend : str
        A name in :data:`BACKENDS`.
    **options
        Backend options, as for :func:`forward`.

    Returns
    -------
    ValueAndGrad
        ``output`` (B, Hq, Q, Dv) and ``gradients`` (:class:`Gradients`).

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import AttentionCall
    >>> x = np.arange(8.0).reshape(1, 1, 2, 4) / 8
    >>> out, grads = value_and_grad(AttentionCall(x, x, x), np.ones((1, 1, 2, 4)))
    >>> out.shape, grads.grad_q.shape
    ((1, 1, 2, 4), (1, 1, 2, 4))
    """
    if not isinstance(call, AttentionCall):
        raise RefAttnError(f"call: expected an AttentionCall, got {type(call).__name__}")
    module = get_backend(backend)
    if hasattr(module, "value_and_grad"):
        g = _check_grad_output(call, grad_output)
        check_head_map(call)
        try:
            return ValueAndGrad(*module.value_and_grad(call, g, **options))
        except MemoryError as exc:
            raise memory_error(exc, f"the {backend} value_and_grad") from None
    trace = forward(call, backend=backend, **options)
    return ValueAndGrad(trace.output, backward(trace, grad_output))


@public
def attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, *, backend: str = "numpy", **kwargs: Any
) -> np.ndarray:
    """Output of scaled-dot-product attention; keywords as for :class:`AttentionCall`.

    ``backend`` selects the engine (default ``"numpy"``).

    Returns
    -------
    (B, Hq, Q, Dv) float64 ndarray

    Examples
    --------
    >>> import numpy as np
    >>> v = np.arange(6.0).reshape(1, 1, 3, 2)
    >>> attention(np.zeros((1, 1, 1, 2)), np.zeros((1, 1, 3, 2)), v).tolist()
    [[[[2.0, 3.0]]]]
    """
    return forward(AttentionCall(q, k, v, **kwargs), backend=backend).output
