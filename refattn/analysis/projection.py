"""Projection gradients: reconnect one attention call to the model's W_Q, W_K, W_V.

Owns the projections ``Q = X W_Q + b_Q``, ``K = M W_K + b_K``, ``V = M W_V + b_V`` in
equation orientation ``[Din, Dout]`` (with a converter from ``nn.Linear``'s ``[Dout, Din]``),
the head split into the call's ``(B, H, L, D)`` layout, and the chain rule back to the weights
and the input states (contract: "Projection gradients reconnect the local attention call to the
model"). Self-attention (no memory) accumulates the Q, K and V branches into X;
cross-attention sends the Q branch to the target stream X and the K and V branches to the
memory stream M. Defers the attention call itself to :class:`~refattn.AttentionCall` and
:mod:`refattn.engine`.

Cached self-attention is a caller variant: pass ``memory = concat(history, X)`` and the cache
receives its K/V gradients in ``grad_memory`` (contract: "Self-attention, cross-attention, and
cached self-attention are caller variants").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from refattn._checks import float64_input
from refattn.call import AttentionCall
from refattn.engine import backward, forward
from refattn.engine.trace import Gradients, Trace
from refattn.errors import RefAttnError

__all__ = [
    "ProjectedAttention",
    "ProjectionGradients",
    "linear_weight_to_equation",
    "project_attention",
    "projection_backward",
]


def linear_weight_to_equation(weight: np.ndarray) -> np.ndarray:
    """``nn.Linear.weight`` ``[Dout, Din]`` -> equation orientation ``[Din, Dout]`` (a copy).

    ``nn.Linear`` computes ``x @ weight.T + bias``; the equations here read ``x @ W + b``, so
    ``W = weight.T`` and the bias is unchanged.

    Examples
    --------
    >>> linear_weight_to_equation(np.arange(6.0).reshape(2, 3)).shape
    (3, 2)
    """
    w = float64_input("weight", weight, 2)
    return np.ascontiguousarray(w.T)


def _split_heads(x: np.ndarray, heads: int) -> np.ndarray:
    B, L, D = x.shape
    return x.reshape(B, L, heads, D // heads).transpose(0, 2, 1, 3)  # (B, H, L, D/H)


def _merge_heads(x: np.ndarray) -> np.ndarray:
    B, H, L, D = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, L, H * D)  # (B, L, H*D)


@dataclass(frozen=True, eq=False)
class ProjectedAttention:
    """One projected attention call: its inputs, projections, call and forward trace.

    Attributes
    ----------
    x : (B, Q, Dmodel) ndarray
        Target (query) stream; also the key/value source for self-attention.
    memory : (B, K, Dmem) ndarray or None
        Source memory for cross-attention (None: self-attention).
    w_q, w_k, w_v : (Dmodel, Hq*Dk), (Dsrc, Hkv*Dk), (Dsrc, Hkv*Dv) ndarray
    b_q, b_k, b_v : (Hq*Dk,), (Hkv*Dk,), (Hkv*Dv,) ndarray or None
    call : AttentionCall
        The call on the projected, head-split q, k, v.
    trace : Trace
        Its forward trace; ``trace.output`` is (B, Hq, Q, Dv).
    """

    x: np.ndarray
    memory: np.ndarray | None
    w_q: np.ndarray
    w_k: np.ndarray
    w_v: np.ndarray
    b_q: np.ndarray | None
    b_k: np.ndarray | None
    b_v: np.ndarray | None
    call: AttentionCall
    trace: Trace

    @property
    def source(self) -> np.ndarray:
        """The stream K and V are read from (memory, or x for self-attention)."""
        return self.x if self.memory is None else self.memory


@dataclass(frozen=True, eq=False)
class ProjectionGradients:
    """Gradients of the loss with respect to the projections and the input states.

    Attributes
    ----------
    grad_w_q, grad_w_k, grad_w_v : ndarray
        Shapes of ``w_q``, ``w_k``, ``w_v`` (``X^T G_Q`` etc., summed over the batch).
    grad_b_q, grad_b_k, grad_b_v : ndarray or None
        Shapes of the biases (None where a bias was not given).
    grad_x : (B, Q, Dmodel) ndarray
        Self-attention: Q + K + V branches; cross-attention: the Q branch only.
    grad_memory : (B, K, Dmem) ndarray or None
        Cross-attention: K + V branches; None for self-attention.
    branches : dict
        ``{"q": G_Q W_Q^T, "k": G_K W_K^T, "v": G_V W_V^T}``, each role's contribution to the
        stream it reads.
    attention : Gradients
        The call's own gradients (grad_q, grad_k, grad_v, ...).
    """

    grad_w_q: np.ndarray
    grad_w_k: np.ndarray
    grad_w_v: np.ndarray
    grad_b_q: np.ndarray | None
    grad_b_k: np.ndarray | None
    grad_b_v: np.ndarray | None
    grad_x: np.ndarray
    grad_memory: np.ndarray | None
    branches: dict[str, np.ndarray]
    attention: Gradients


def project_attention(
    x: np.ndarray,
    w_q: np.ndarray,
    w_k: np.ndarray,
    w_v: np.ndarray,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    memory: np.ndarray | None = None,
    b_q: np.ndarray | None = None,
    b_k: np.ndarray | None = None,
    b_v: np.ndarray | None = None,
    backend: str = "numpy",
    **call_options: Any,
) -> ProjectedAttention:
    """Project X (and memory M), split heads, and run the attention call forward.

    Parameters
    ----------
    x : (B, Q, Dmodel) float64 ndarray
        Target stream (queries; also keys and values when ``memory`` is None).
    w_q : (Dmodel, Hq*Dk) float64 ndarray
        Query projection in equation orientation (``q = x @ w_q + b_q``).
    w_k : (Dsrc, Hkv*Dk) float64 ndarray
    w_v : (Dsrc, Hkv*Dv) float64 ndarray
        Key and value projections of the source stream (``Dsrc`` = Dmodel for self-attention).
    num_heads : int
        Hq.
    num_kv_heads : int, optional
        Hkv (default Hq).
    memory : (B, K, Dsrc) float64 ndarray, optional
        Source memory for cross-attention (K may differ from Q).
    b_q, b_k, b_v : 1-D float64 ndarray, optional
        Projection biases.
    backend : str
        Engine backend (default ``"numpy"``).
    **call_options
        Keywords for :class:`~refattn.AttentionCall` (visible, bias, scale, score, ...).

    Returns
    -------
    ProjectedAttention

    Raises
    ------
    RefAttnError
        On non-float64 input, mismatched widths or a width not divisible by the head count.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> x, m = rng.standard_normal((1, 2, 4)), rng.standard_normal((1, 3, 5))
    >>> w_q, w_k, w_v = (rng.standard_normal(s) for s in [(4, 6), (5, 6), (5, 2)])
    >>> r = project_attention(x, w_q, w_k, w_v, memory=m, num_heads=2)
    >>> r.call.axes
    {'B': 1, 'Hq': 2, 'Hkv': 2, 'Q': 2, 'K': 3, 'Dk': 3, 'Dv': 1}
    """
    x = float64_input("x", x, 3)
    src = x if memory is None else float64_input("memory", memory, 3)
    if src.shape[0] != x.shape[0]:
        raise RefAttnError(f"memory: batch B={src.shape[0]} must equal x's B={x.shape[0]}")
    Hq = int(num_heads)
    Hkv = Hq if num_kv_heads is None else int(num_kv_heads)
    if Hq < 1 or Hkv < 1:
        raise RefAttnError(f"num_heads/num_kv_heads: expected >= 1, got {Hq}, {Hkv}")
    weights: dict[str, Any] = {}  # w_q, w_k, w_v arrays; b_q, b_k, b_v arrays or None
    src_name = "x" if memory is None else "memory"
    for name, w, stream, s_name, heads, b_name, b in (
        ("w_q", w_q, x, "x", Hq, "b_q", b_q),
        ("w_k", w_k, src, src_name, Hkv, "b_k", b_k),
        ("w_v", w_v, src, src_name, Hkv, "b_v", b_v),
    ):
        w = float64_input(name, w, 2)
        if w.shape[0] != stream.shape[2]:
            raise RefAttnError(
                f"{name}: input axis {w.shape[0]} must equal {s_name}'s width {stream.shape[2]} "
                "(equation orientation [Din, Dout]; convert nn.Linear weights with "
                "linear_weight_to_equation)"
            )
        if w.shape[1] % heads:
            raise RefAttnError(
                f"{name}: output width {w.shape[1]} is not divisible by {heads} heads"
            )
        if b is not None:
            b = float64_input(b_name, b, 1)
            if b.shape != (w.shape[1],):
                raise RefAttnError(f"{b_name}: expected shape [{w.shape[1]}], got {list(b.shape)}")
        weights[name], weights[b_name] = w, b

    def proj(stream: np.ndarray, w: np.ndarray, b: np.ndarray | None, heads: int) -> np.ndarray:
        y = stream @ w if b is None else stream @ w + b  # (B, L, H*D)
        return np.ascontiguousarray(_split_heads(y, heads))  # (B, H, L, D)

    q = proj(x, weights["w_q"], weights["b_q"], Hq)  # (B, Hq, Q, Dk)
    k = proj(src, weights["w_k"], weights["b_k"], Hkv)  # (B, Hkv, K, Dk)
    v = proj(src, weights["w_v"], weights["b_v"], Hkv)  # (B, Hkv, K, Dv)
    call = AttentionCall(q, k, v, **call_options)
    trace = forward(call, backend=backend)
    return ProjectedAttention(x=x, memory=None if memory is None else src, call=call,
                              trace=trace, **weights)


def projection_backward(result: ProjectedAttention, grad_output: np.ndarray) -> ProjectionGradients:
    """Hand-written backward from the attention output to the weights and input states.

    Parameters
    ----------
    result : ProjectedAttention
    grad_output : (B, Hq, Q, Dv) float64 ndarray
        G_O, the gradient with respect to ``result.trace.output``.

    Returns
    -------
    ProjectionGradients

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((2, 3, 4))
    >>> w_q, w_k, w_v = (rng.standard_normal((4, 4)) for _ in range(3))
    >>> r = project_attention(x, w_q, w_k, w_v, num_heads=2)
    >>> g = projection_backward(r, np.ones((2, 2, 3, 2)))
    >>> g.grad_memory is None, bool(np.allclose(g.grad_x, sum(g.branches.values())))
    (True, True)
    """
    att = backward(result.trace, grad_output)
    x, src = result.x, result.source
    g_q = _merge_heads(att.grad_q)  # (B, Q, Hq*Dk)
    g_k = _merge_heads(att.grad_k)  # (B, K, Hkv*Dk)
    g_v = _merge_heads(att.grad_v)  # (B, K, Hkv*Dv)
    branches = {
        "q": g_q @ result.w_q.T,  # (B, Q, Dmodel): target stream
        "k": g_k @ result.w_k.T,  # (B, K, Dsrc): source stream
        "v": g_v @ result.w_v.T,  # (B, K, Dsrc)
    }
    if result.memory is None:  # one stream feeds Q, K and V
        grad_x, grad_memory = branches["q"] + branches["k"] + branches["v"], None
    else:  # target receives Q; memory receives K + V
        grad_x, grad_memory = branches["q"], branches["k"] + branches["v"]

    def bias_grad(b: np.ndarray | None, g: np.ndarray) -> np.ndarray | None:
        return None if b is None else g.sum(axis=(0, 1))

    return ProjectionGradients(
        grad_w_q=np.einsum("bld,blo->do", x, g_q),  # X^T G_Q summed over the batch
        grad_w_k=np.einsum("bld,blo->do", src, g_k),
        grad_w_v=np.einsum("bld,blo->do", src, g_v),
        grad_b_q=bias_grad(result.b_q, g_q),
        grad_b_k=bias_grad(result.b_k, g_k),
        grad_b_v=bias_grad(result.b_v, g_v),
        grad_x=grad_x,
        grad_memory=grad_memory,
        branches=branches,
        attention=att,
    )
