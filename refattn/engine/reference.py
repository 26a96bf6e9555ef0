"""The NumPy reference backend: the contract's equations, vectorised, in float64.

Owns the arithmetic of the dense forward trace and the hand-written backward. The pure
functions :func:`forward_arrays` and :func:`backward_arrays` take plain arrays (and accept
complex input, so a complex-step derivative check gets the exact method); the thin wrappers
:func:`forward` and :func:`backward` turn an :class:`~refattn.AttentionCall` into a
:class:`~refattn.trace.Trace` and :class:`~refattn.trace.Gradients`.
"""

from __future__ import annotations

import numpy as np

from refattn.call import AttentionCall
from refattn.engine.reduce import gather_heads, reduce_to_shape, sum_heads
from refattn.trace import Gradients, Trace

__all__ = ["backward", "backward_arrays", "forward", "forward_arrays"]


def forward_arrays(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    head_map: np.ndarray,
    scale: float,
    visible: np.ndarray,
    query_valid: np.ndarray,
    bias: np.ndarray | None = None,
    multiplier: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Dense forward over plain arrays (no validation; real or complex dtype).

    Parameters
    ----------
    q : (B, Hq, Q, Dk) ndarray
    k : (B, Hkv, K, Dk) ndarray
    v : (B, Hkv, K, Dv) ndarray
    head_map : (Hq,) int ndarray
    scale : float
        alpha, applied once to ``q @ k^T``.
    visible : bool ndarray broadcastable to (B, Hq, Q, K)
    query_valid : bool ndarray broadcastable to (B, 1, Q, 1)
    bias : ndarray broadcastable to (B, Hq, Q, K), optional
    multiplier : ndarray broadcastable to (B, Hq, Q, K), optional
        Dropout multiplier Z.

    Returns
    -------
    dict
        The canonical forward tensors plus ``sanitized_rows`` (B, Hq, Q): rows without a
        legal key that received the temporary key 0 (callers guarantee those are unused).

    Examples
    --------
    >>> q = np.zeros((1, 1, 1, 2)); kv = np.ones((1, 1, 2, 2))
    >>> out = forward_arrays(q, kv, kv, head_map=np.array([0]), scale=1.0,
    ...                      visible=np.array([True, False]), query_valid=np.array(True))
    >>> out["probs"].ravel().tolist(), out["masked_scores"].ravel().tolist()
    ([1.0, 0.0], [0.0, -inf])
    """
    B, Hq, Q, _ = q.shape
    K = k.shape[2]
    full = (B, Hq, Q, K)
    k_eff = gather_heads(k, head_map)  # (B, Hq, K, Dk)
    v_eff = gather_heads(v, head_map)  # (B, Hq, K, Dv)

    scores = q @ k_eff.swapaxes(-1, -2)  # (B, Hq, Q, K)
    scores *= scale  # alpha applied exactly once, after the product
    # finite preference first, then authoritative visibility: no bias can revive an edge
    biased = scores if bias is None else scores + bias  # (B, Hq, Q, K)

    vis = np.broadcast_to(visible, full)
    sanitized = ~vis.any(axis=-1)  # (B, Hq, Q) rows with an empty legal support
    if sanitized.any():
        vis = vis.copy()
        vis[..., 0] |= sanitized  # temporary legal key for unused rows only (Policy 3)
    masked = np.where(vis, biased, -np.inf)  # (B, Hq, Q, K)

    row_max = masked.real.max(axis=-1)  # (B, Hq, Q), over the legal support only
    e = np.exp(masked - row_max[..., None])  # exactly 0 where masked (exp(-inf))
    denom = e.sum(axis=-1)  # (B, Hq, Q)
    probs = e / denom[..., None]  # (B, Hq, Q, K)
    lse = row_max + np.log(denom)

    z = np.ones(full) if multiplier is None else np.broadcast_to(multiplier, full)
    consumed = probs * z  # (B, Hq, Q, K)
    output = consumed @ v_eff  # (B, Hq, Q, Dv)
    qv = np.broadcast_to(query_valid, (B, 1, Q, 1))
    output = np.where(qv, output, 0.0)  # unused rows are exactly zero
    return {
        "scores": scores,
        "biased_scores": biased,
        "masked_scores": masked,
        "row_max": row_max,
        "lse": lse,
        "probs": probs,
        "dropout_multiplier": np.ascontiguousarray(z),
        "consumed": consumed,
        "output": output,
        "sanitized_rows": sanitized,
    }


def backward_arrays(
    fwd: dict[str, np.ndarray],
    grad_output: np.ndarray,
    *,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    head_map: np.ndarray,
    scale: float,
    query_valid: np.ndarray,
    bias_shape: tuple[int, ...] | None,
) -> dict[str, np.ndarray]:
    """The contract's backward equations over plain arrays (no validation).

    Parameters
    ----------
    fwd : dict
        Output of :func:`forward_arrays` (needs probs, dropout_multiplier, consumed, output).
    grad_output : (B, Hq, Q, Dv) ndarray
        G_O.
    q, k, v, head_map, scale, query_valid
        As for :func:`forward_arrays`.
    bias_shape : tuple or None
        Shape to which grad_bias is reduced (None: no bias).

    Returns
    -------
    dict
        grad_output, grad_v, grad_consumed, grad_probs, row_dot, row_dot_output, grad_scores,
        grad_q, grad_k, grad_bias (None without a bias).

    Examples
    --------
    >>> q = np.zeros((1, 1, 1, 2)); kv = np.eye(2).reshape(1, 1, 2, 2)
    >>> kw = dict(head_map=np.array([0]), scale=1.0, query_valid=np.array(True))
    >>> f = forward_arrays(q, kv, kv, visible=np.array(True), **kw)
    >>> g = backward_arrays(f, np.ones((1, 1, 1, 2)), q=q, k=kv, v=kv, bias_shape=None, **kw)
    >>> g["grad_v"].ravel().tolist(), g["row_dot"].ravel().tolist()
    ([0.5, 0.5, 0.5, 0.5], [1.0])
    """
    B, _, Q, _ = q.shape
    Hkv = k.shape[1]
    probs, z, consumed = fwd["probs"], fwd["dropout_multiplier"], fwd["consumed"]
    k_eff = gather_heads(k, head_map)  # (B, Hq, K, Dk)
    v_eff = gather_heads(v, head_map)  # (B, Hq, K, Dv)

    # unused query rows consume nothing: their G_O never reaches the call
    qv = np.broadcast_to(query_valid, (B, 1, Q, 1))
    g_o = np.where(qv, grad_output, 0.0)  # (B, Hq, Q, Dv)

    grad_v_eff = consumed.swapaxes(-1, -2) @ g_o  # (B, Hq, K, Dv) = Pdrop^T G_O
    grad_consumed = g_o @ v_eff.swapaxes(-1, -2)  # (B, Hq, Q, K)  = G_O V^T
    grad_probs = grad_consumed * z  # G_P: the fixed multiplier gates the direct gradient
    row_dot = (probs * grad_probs).sum(axis=-1)  # (B, Hq, Q)  D = sum_j P G_P
    row_dot_output = (g_o * fwd["output"]).sum(axis=-1)  # (B, Hq, Q)  D = sum_d G_O O
    grad_scores = probs * (grad_probs - row_dot[..., None])  # exactly 0 where P == 0
    grad_q = (grad_scores @ k_eff) * scale  # (B, Hq, Q, Dk)
    grad_k_eff = (grad_scores.swapaxes(-1, -2) @ q) * scale  # (B, Hq, K, Dk)
    return {
        "grad_output": grad_output,
        "grad_v": sum_heads(grad_v_eff, head_map, Hkv),
        "grad_consumed": grad_consumed,
        "grad_probs": grad_probs,
        "row_dot": row_dot,
        "row_dot_output": row_dot_output,
        "grad_scores": grad_scores,
        "grad_q": grad_q,
        "grad_k": sum_heads(grad_k_eff, head_map, Hkv),
        "grad_bias": None if bias_shape is None else reduce_to_shape(grad_scores, bias_shape),
    }


def _call_arrays(call: AttentionCall) -> dict:
    return {
        "head_map": call.head_map,
        "scale": call.scale,
        "query_valid": call.query_valid_full(),
    }


def forward(call: AttentionCall) -> Trace:
    """Reference forward of a validated call (see :func:`refattn.forward`)."""
    fwd = forward_arrays(
        call.q, call.k, call.v, visible=call.visible_full(), bias=call.bias,
        multiplier=call.multiplier_full(), **_call_arrays(call),
    )
    return Trace(call=call, backend="numpy", **fwd)


def backward(trace: Trace, grad_output: np.ndarray) -> Gradients:
    """Reference backward of a trace (see :func:`refattn.backward`)."""
    call = trace.call
    fwd = {name: getattr(trace, name) for name in
           ("probs", "dropout_multiplier", "consumed", "output")}
    grads = backward_arrays(
        fwd, grad_output, q=call.q, k=call.k, v=call.v,
        bias_shape=None if call.bias is None else call.bias.shape, **_call_arrays(call),
    )
    return Gradients(**grads)
