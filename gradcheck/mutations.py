"""Planted bugs in refattn's backward: the evidence that a gradient checker bites.

Owns a small catalogue of realistic hand-written-backward mistakes, each a
``backward(trace, grad_output) -> Gradients`` built on the reference equations with one
change, plus where the bug lives (so a test can demand that a report's worst index points at
it). Defers the correct equations to :func:`refattn.engine.reference.backward_arrays`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from refattn.engine.reduce import gather_heads, reduce_to_shape, sum_heads
from refattn.engine.reference import backward as reference_backward
from refattn.engine.trace import Gradients, Trace

__all__ = [
    "Mutation",
    "bias_unreduced",
    "gqa_wrong_head",
    "grad_q_scaled",
    "grad_scores_scaled",
    "missing_scale",
    "one_element",
]

Backward = Callable[[Trace, np.ndarray], Gradients]


@dataclass(frozen=True)
class Mutation:
    """One planted bug.

    Attributes
    ----------
    name : str
    description : str
    backward : callable
        ``backward(trace, grad_output) -> Gradients`` with the bug.
    broken : tuple of str
        The inputs whose gradients the bug changes.
    """

    name: str
    description: str
    backward: Backward
    broken: tuple[str, ...]


def _grads(trace: Trace, grad_output: np.ndarray, **changes: Any) -> Gradients:
    return dataclasses.replace(reference_backward(trace, grad_output), **changes)


def _reference_grad_scores(ref: Gradients) -> np.ndarray:
    """G_S of the reference backward (which always returns it)."""
    return cast(np.ndarray, ref.grad_scores)


def _from_scores(trace: Trace, gs: np.ndarray, *, scale: float) -> dict[str, np.ndarray]:
    """grad_q, grad_k from a (possibly wrong) G_S with a (possibly wrong) scale."""
    call = trace.call
    hm = cast(np.ndarray, call.head_map)  # validated: (Hq,) int64
    k_eff = gather_heads(call.k, hm)  # (B, Hq, K, Dk)
    grad_q = (gs @ k_eff) * scale  # (B, Hq, Q, Dk)
    grad_k = sum_heads((gs.swapaxes(-1, -2) @ call.q) * scale, hm, call.k.shape[1])
    return {"grad_q": grad_q, "grad_k": grad_k}


def grad_scores_scaled(factor: float = 1.001) -> Mutation:
    """G_S off by 0.1%: every score gradient multiplied by ``factor``.

    Examples
    --------
    >>> grad_scores_scaled().broken
    ('q', 'k', 'bias')
    """
    def backward(trace: Trace, grad_output: np.ndarray) -> Gradients:
        ref = reference_backward(trace, grad_output)
        gs = _reference_grad_scores(ref) * factor  # the planted error
        bias = trace.call.bias
        return _grads(trace, grad_output, grad_scores=gs,
                      **_from_scores(trace, gs, scale=cast(float, trace.call.scale)),
                      grad_bias=None if bias is None else reduce_to_shape(gs, bias.shape))

    return Mutation("grad_scores_scaled", f"G_S multiplied by {factor} ({factor - 1:.1%} error)",
                    backward, ("q", "k", "bias"))


def missing_scale(*, twice: bool = False) -> Mutation:
    """The score scale alpha omitted from (or, ``twice=True``, applied twice in) G_Q and G_K.

    Examples
    --------
    >>> missing_scale(twice=True).name
    'double_scale'
    """
    def backward(trace: Trace, grad_output: np.ndarray) -> Gradients:
        ref = reference_backward(trace, grad_output)
        alpha = cast(float, trace.call.scale)  # validated: never None
        return _grads(trace, grad_output, **_from_scores(trace, _reference_grad_scores(ref),
                                                          scale=alpha**2 if twice else 1.0))

    name = "double_scale" if twice else "missing_scale"
    what = "applied twice" if twice else "omitted"
    return Mutation(name, f"score scale alpha {what} in G_Q and G_K", backward, ("q", "k"))


def gqa_wrong_head(*, query_head: int = -1, kv_head: int = 0) -> Mutation:
    """Query head ``query_head``'s G_K and G_V summed into kv head ``kv_head``.

    Examples
    --------
    >>> gqa_wrong_head().broken
    ('k', 'v')
    """
    def backward(trace: Trace, grad_output: np.ndarray) -> Gradients:
        call = trace.call
        ref = reference_backward(trace, grad_output)
        Hq, Hkv = call.q.shape[1], call.k.shape[1]
        wrong = cast(np.ndarray, call.head_map).copy()
        wrong[query_head % Hq] = kv_head  # the planted misrouting
        gs = _reference_grad_scores(ref)
        # (B, Hq, K, Dk) and (B, Hq, K, Dv) per query head, then summed with the wrong map
        grad_k = sum_heads((gs.swapaxes(-1, -2) @ call.q) * call.scale, wrong, Hkv)
        consumed = cast(np.ndarray, trace.consumed)  # the reference trace materialises it
        grad_v = sum_heads(consumed.swapaxes(-1, -2) @ _valid(trace, grad_output),
                           wrong, Hkv)
        return _grads(trace, grad_output, grad_k=grad_k, grad_v=grad_v)

    return Mutation("gqa_wrong_head",
                    f"query head {query_head}'s G_K and G_V summed into kv head {kv_head}",
                    backward, ("k", "v"))


def _valid(trace: Trace, grad_output: np.ndarray) -> np.ndarray:
    B, _, Q, _ = trace.call.q.shape
    qv = np.broadcast_to(trace.call.query_valid_full(), (B, 1, Q, 1))
    return np.where(qv, grad_output, 0.0)


def one_element(
    tensor: str = "k", index: tuple[int, ...] = (0, 0, 0, 0), factor: float = 1.1
) -> Mutation:
    """One element of ``grad_<tensor>`` multiplied by ``factor`` (10% wrong by default).

    Examples
    --------
    >>> one_element("v", (0, 0, 1, 0)).description
    'grad_v[0, 0, 1, 0] multiplied by 1.1'
    """
    def backward(trace: Trace, grad_output: np.ndarray) -> Gradients:
        ref = reference_backward(trace, grad_output)
        g = np.array(getattr(ref, f"grad_{tensor}"), copy=True)
        g[index] *= factor  # the planted error
        return _grads(trace, grad_output, **{f"grad_{tensor}": g})

    where = ", ".join(str(i) for i in index)
    return Mutation("one_element", f"grad_{tensor}[{where}] multiplied by {factor}",
                    backward, (tensor,))


def grad_q_scaled(factor: float = 1.1) -> Mutation:
    """Every element of G_Q multiplied by ``factor`` (a 10% error by default).

    Examples
    --------
    >>> grad_q_scaled().broken
    ('q',)
    """
    def backward(trace: Trace, grad_output: np.ndarray) -> Gradients:
        ref = reference_backward(trace, grad_output)
        return _grads(trace, grad_output, grad_q=ref.grad_q * factor)

    return Mutation("grad_q_scaled", f"G_Q multiplied by {factor}", backward, ("q",))


def bias_unreduced(*, keep_shape: bool = False) -> Mutation:
    """The bias gradient not summed over the bias's broadcast axes.

    ``keep_shape=False`` returns G_S at full (B, Hq, Q, K) shape; ``keep_shape=True`` keeps
    the bias's shape but takes the first slice of each broadcast axis instead of the sum.

    Examples
    --------
    >>> bias_unreduced(keep_shape=True).name
    'bias_first_slice'
    """
    def backward(trace: Trace, grad_output: np.ndarray) -> Gradients:
        ref = reference_backward(trace, grad_output)
        gs = _reference_grad_scores(ref)
        shape = cast(np.ndarray, trace.call.bias).shape  # the mutation is for calls with a bias
        if not keep_shape:
            return _grads(trace, grad_output, grad_bias=np.array(gs))  # never reduced
        lead = gs.ndim - len(shape)
        first = gs[(0,) * lead]
        sl = tuple(slice(0, 1) if n == 1 else slice(None) for n in shape)
        return _grads(trace, grad_output, grad_bias=np.ascontiguousarray(first[sl]))

    if keep_shape:
        return Mutation("bias_first_slice",
                        "grad_bias takes the first slice of each broadcast axis, not the sum",
                        backward, ("bias",))
    return Mutation("bias_unreduced", "grad_bias returned unreduced at (B, Hq, Q, K)",
                    backward, ("bias",))
