"""The NumPy reference backend: the contract's equations, vectorised, in float64.

Owns the arithmetic of the dense forward trace and the hand-written backward. The pure
functions :func:`forward_arrays` and :func:`backward_arrays` take plain arrays (and accept
complex input, so a complex-step derivative check gets the exact method); the thin wrappers
:func:`forward` and :func:`backward` turn an :class:`~refattn.AttentionCall` into a
:class:`~refattn.engine.trace.Trace` and :class:`~refattn.engine.trace.Gradients`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from refattn.call import AttentionCall
from refattn.call.placement import OperandMultipliers, ScalePlacement, operand_multipliers
from refattn.call.scores import Dot, ScoreFamily
from refattn.engine.memory import check_memory
from refattn.engine.reduce import gather_heads, reduce_to_shape, sum_heads
from refattn.engine.trace import Gradients, Trace
from refattn.errors import RefAttnError

__all__ = ["backward", "backward_arrays", "forward", "forward_arrays"]


def _core(x: np.ndarray) -> np.ndarray:
    """The un-broadcast part of a view: every stride-0 axis sliced to length 1."""
    return x[tuple(slice(None, 1) if n == 0 else slice(None) for n in x.strides)]


def _into(ufunc: np.ufunc, a: np.ndarray, b: np.ndarray | complex) -> np.ndarray:
    """``ufunc(a, b)``, written into ``a`` when that keeps its dtype and shape (else a new
    array: complex-step inputs can promote a real ``a``). ``a`` must be a temporary."""
    if np.result_type(a, b) == a.dtype and np.broadcast_shapes(a.shape, np.shape(b)) == a.shape:
        return ufunc(a, b, out=a)
    return ufunc(a, b)


def _scaled_operands(
    q: np.ndarray, k_eff: np.ndarray, scale: float, scale_placement: ScalePlacement
) -> tuple[np.ndarray, np.ndarray, OperandMultipliers]:
    """q and k_eff with alpha's operand share applied (unchanged when it is 1).

    Returns ``(q_s, k_s, mult)``: q_s (B, Hq, Q, Dq), k_s (B, Hq, K, Dk) and the multipliers.
    """
    mult = operand_multipliers(scale, scale_placement)  # alpha applied exactly once in total
    q_s = q if mult.query == 1.0 else q * mult.query
    k_s = k_eff if mult.key == 1.0 else k_eff * mult.key
    return q_s, k_s, mult


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
    score: ScoreFamily | None = None,
    scale_placement: ScalePlacement = "post",
    softcap: float | None = None,
    sink: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Dense forward over plain arrays (no validation; real or complex dtype).

    Order: compatibility u (the score family) with alpha at its placement, softcap, finite
    bias, visibility, softmax (the sink joins the denominator), dropout, value mixing.

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
    score : ScoreFamily, optional
        Compatibility family (default :class:`~refattn.call.scores.Dot`).
    scale_placement : {"post", "q", "k", "split"}
        Where alpha is applied (see :mod:`refattn.call.placement`).
    softcap : float, optional
        Cap c: ``scores = c * tanh(alpha u / c)``, before bias and visibility.
    sink : (Hq,) ndarray, optional
        Per-head sink logit in every row's denominator (no value row).

    Returns
    -------
    dict
        The canonical forward tensors plus ``sanitized_rows`` (B, Hq, Q): rows without a
        legal key that received the temporary key 0 (callers guarantee those are unused);
        ``softcap_input`` (B, Hq, Q, K) with a softcap and ``sink_probs`` (B, Hq, Q) with a
        sink. No needless copies: without a bias ``biased_scores`` is ``scores``, with every
        edge legal ``masked_scores`` is ``biased_scores``, and without dropout ``consumed`` is
        ``probs`` and ``dropout_multiplier`` a read-only broadcast of 1.0.

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

    family = Dot() if score is None else score
    q_s, k_s, _ = _scaled_operands(q, k_eff, scale, scale_placement)  # pre-scaled operands
    scores = family.compatibility(q_s, k_s)  # (B, Hq, Q, K) u; dot: q @ k_eff^T
    if scale_placement == "post":
        scores *= scale  # alpha applied exactly once, after the product
    softcap_input = None
    if softcap is not None:  # FlashAttention/ONNX order: cap the scaled scores, then mask
        softcap_input = scores
        scores = softcap * np.tanh(scores / softcap)  # (B, Hq, Q, K), in (-c, c)
    # finite preference first, then authoritative visibility: no bias can revive an edge
    biased = scores if bias is None else scores + bias  # (B, Hq, Q, K)

    vis = np.broadcast_to(visible, full)
    all_legal = bool(_core(vis).all())  # every edge legal (read without the broadcast)
    # (B, Hq, Q) rows with an empty legal support; with a sink such a row is well defined
    # (the sink takes all the mass) and keeps its empty support
    sanitized = ~vis.any(axis=-1) if sink is None else np.zeros(full[:3], dtype=bool)
    if sanitized.any():
        vis = vis.copy()
        vis[..., 0] |= sanitized  # temporary legal key for unused rows only (Policy 3)
    # with every edge legal the select is the identity: masked_scores is biased_scores
    masked = biased if all_legal else np.where(vis, biased, -np.inf)  # (B, Hq, Q, K)

    row_max = masked.real.max(axis=-1)  # (B, Hq, Q), over the legal support only
    if sink is not None:  # the sink logit is part of every row's support
        sink_row = np.broadcast_to(sink[None, :, None], (B, Hq, Q))  # (B, Hq, Q)
        row_max = np.maximum(row_max, sink_row.real)
    e = masked - row_max[..., None]  # (B, Hq, Q, K)
    np.exp(e, out=e)  # exactly 0 where masked (exp(-inf))
    denom = e.sum(axis=-1)  # (B, Hq, Q)
    if sink is not None:
        e_sink = np.exp(sink_row - row_max)  # (B, Hq, Q): denominator only, no value row
        denom = denom + e_sink
    probs = _into(np.divide, e, denom[..., None])  # (B, Hq, Q, K), e's storage reused
    lse = row_max + np.log(denom)

    if multiplier is None:  # no dropout: Z == 1 (one stored value) and P * Z is P itself
        z = np.broadcast_to(np.float64(1.0), full)
        consumed = probs
    else:
        z = np.ascontiguousarray(np.broadcast_to(multiplier, full))
        consumed = probs * z  # (B, Hq, Q, K)
    output = consumed @ v_eff  # (B, Hq, Q, Dv)
    qv = np.broadcast_to(query_valid, (B, 1, Q, 1))
    output = np.where(qv, output, 0.0)  # unused rows are exactly zero
    extra = {}
    if softcap_input is not None:
        extra["softcap_input"] = softcap_input
    if sink is not None:
        extra["sink_probs"] = e_sink / denom  # (B, Hq, Q)
    return {
        **extra,
        "scores": scores,
        "biased_scores": biased,
        "masked_scores": masked,
        "row_max": row_max,
        "lse": lse,
        "probs": probs,
        "dropout_multiplier": z,
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
    score: ScoreFamily | None = None,
    scale_placement: ScalePlacement = "post",
    softcap: float | None = None,
    sink: np.ndarray | None = None,
) -> dict[str, Any]:
    """The contract's backward equations over plain arrays (no validation).

    Parameters
    ----------
    fwd : dict
        Output of :func:`forward_arrays` (needs probs, dropout_multiplier, consumed, output;
        also scores with a softcap and sink_probs with a sink).
    grad_output : (B, Hq, Q, Dv) ndarray
        G_O.
    q, k, v, head_map, scale, query_valid
        As for :func:`forward_arrays`.
    bias_shape : tuple or None
        Shape to which grad_bias is reduced (None: no bias).
    score, scale_placement, softcap, sink
        As for :func:`forward_arrays`.

    Returns
    -------
    dict
        grad_output, grad_v, grad_consumed, grad_probs, row_dot, row_dot_output, grad_scores,
        grad_q, grad_k, grad_bias (None without a bias); with a softcap grad_softcap_input,
        with a sink grad_sink (Hq,), with a parametrised family grad_score_params.

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
    # G_P: the fixed multiplier gates the direct gradient (Z == 1: G_P is G_Pdrop itself)
    grad_probs = grad_consumed if bool((_core(z) == 1.0).all()) else grad_consumed * z
    work = probs * grad_probs  # (B, Hq, Q, K)
    row_dot = work.sum(axis=-1)  # (B, Hq, Q)  D = sum_j P G_P
    row_dot_output = (g_o * fwd["output"]).sum(axis=-1)  # (B, Hq, Q)  D = sum_d G_O O
    if np.result_type(grad_probs, row_dot) == work.dtype:  # reuse work's storage
        grad_scores = np.subtract(grad_probs, row_dot[..., None], out=work)
    else:
        grad_scores = grad_probs - row_dot[..., None]
    grad_scores = _into(np.multiply, grad_scores, probs)  # P (G_P - D): exactly 0 where P == 0
    extra: dict[str, Any] = {}  # arrays, and grad_score_params: a dict of them
    grad_scaled = grad_scores  # gradient w.r.t. alpha * u
    if softcap is not None:
        t = fwd["scores"] / softcap  # tanh(alpha u / c), (B, Hq, Q, K)
        grad_scaled = grad_scores * (1.0 - t * t)
        extra["grad_softcap_input"] = grad_scaled
    family = Dot() if score is None else score
    q_s, k_s, mult = _scaled_operands(q, k_eff, scale, scale_placement)
    sg = family.compatibility_backward(grad_scaled, q_s, k_s)  # linear in its cotangent
    grad_q = sg.grad_q * (mult.query * mult.post)  # (B, Hq, Q, Dk); dot post: (G_S k) alpha
    grad_k_eff = sg.grad_k * (mult.key * mult.post)  # (B, Hq, K, Dk)
    if sg.params:
        extra["grad_score_params"] = {n: g * mult.post for n, g in sg.params.items()}
    if sink is not None:  # d lse / d sink = sink_probs; the sink carries no value row
        extra["grad_sink"] = -(fwd["sink_probs"] * row_dot).sum(axis=(0, 2))  # (Hq,)
    return {
        **extra,
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
        "score": call.score,
        "scale_placement": call.scale_placement,
        "softcap": call.softcap,
        "sink": call.sink,
    }


def forward(call: AttentionCall, *, max_bytes: int | None = None, **options: object) -> Trace:
    """Reference forward of a validated call (see :func:`refattn.forward`).

    The reference is always dense; its one option is ``max_bytes``: the estimated peak
    memory (:func:`refattn.engine.memory.dense_bytes`) is checked against it, or against the
    available memory, before anything is allocated. Any other option is an error.

    Examples
    --------
    >>> import refattn
    >>> x = np.zeros((1, 1, 4096, 8))
    >>> try:
    ...     refattn.forward(refattn.AttentionCall(x, x, x), max_bytes=2**20)
    ... except RefAttnError as exc:
    ...     print("materialize=False" in str(exc))
    True
    """
    if options:
        raise RefAttnError(
            f"backend: 'numpy' takes only max_bytes, got {sorted(options)} (the reference "
            "always materialises every tensor; use backend='numba' for materialize=False)"
        )
    check_memory(call, "forward", backend="numpy", max_bytes=max_bytes)
    fwd: dict[str, Any] = forward_arrays(
        call.q, call.k, call.v, visible=call.visible_full(), bias=call.bias,
        multiplier=call.multiplier_full(), **_call_arrays(call),
    )
    return Trace(call=call, backend="numpy", **fwd)


def backward(trace: Trace, grad_output: np.ndarray) -> Gradients:
    """Reference backward of a trace (see :func:`refattn.backward`); its peak memory is
    checked against the available memory first."""
    call = trace.call
    check_memory(call, "backward", backend="numpy")
    fwd = {name: getattr(trace, name) for name in
           ("probs", "dropout_multiplier", "consumed", "output", "scores", "sink_probs")}
    grads: dict[str, Any] = backward_arrays(
        fwd, grad_output, q=call.q, k=call.k, v=call.v,
        bias_shape=None if call.bias is None else call.bias.shape, **_call_arrays(call),
    )
    return Gradients(**grads)
