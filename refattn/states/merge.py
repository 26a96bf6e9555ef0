"""Merging attention states (partial output, lse) over disjoint key sets, and its backward.

Owns :func:`merge_state`, :func:`merge_states` and their backward
(:func:`merge_state_backward`, :func:`merge_states_backward`), in float64, in the layouts of
:mod:`refattn.states.layouts` and in either lse base.

A partial state ``(o_i, s_i)`` is the attention output and log-sum-exp of one row over a key
set ``K_i``: ``s_i = log_b sum_{j in K_i} b^{x_j}``, ``o_i = sum_{j in K_i} b^{x_j - s_i} v_j``
(``b`` = e for natural lse, 2 for base-2 lse; an empty ``K_i`` has ``s_i = -inf``). Over the
union of disjoint sets, with ``m = max_i s_i``::

    e_i = b^(s_i - m)            (subtract the max: every e_i in [0, 1], the largest 1)
    w_i = e_i / sum_k e_k        (the partial's share of the merged denominator)
    o   = sum_i w_i o_i          (summed in partial order)
    s   = m + log_b(sum_k e_k)

An empty partial (``s_i = -inf``) has weight 0; when every partial is empty the merged output
is 0 and the merged lse is -inf, as FlashInfer's MergeStatesKernel writes for a row with no
index set (``v = 0``, ``s = -inf``; flashinfer-ai/flashinfer
``include/flashinfer/attention/cascade.cuh``, commit 00b57feb). FlashAttention's split-KV
combine (Dao-AILab/flash-attention ``csrc/flash_attn/src/flash_fwd_kernel.h``
``combine_attn_seqk_parallel``, commit 0142ff05) writes output 0 there too but lse = +inf
("For the case where all local lse == -INFINITY, we want to set lse_logsum to INFINITY");
refattn keeps -inf, the log of an empty sum, and refuses +inf as an input lse.

Bases: FlashInfer's states are base 2 (``cascade.cuh``: "Both s_a and s_b are logsumexp values
with base 2"; its state_t, ``include/flashinfer/attention/state.cuh`` commit 20031b15, computes
``m + ptx_log2(d)`` with ``ptx_exp2``); FlashAttention's ``softmax_lse`` (its combine uses
``expf``/``logf``) and ring-flash-attention's ``update_out_and_lse``
(zhuzilin/ring-flash-attention ``ring_flash_attn/utils.py`` commit 0b90df9b: ``torch.exp`` /
``torch.log``) are natural. A base-2 lse is the
natural one divided by ln 2.

Backward (``dO`` the gradient of the merged output, ``dS`` that of the merged lse)::

    d o_i = w_i dO
    d s_i = w_i (<dO, o_i - o> + dS)            natural lse
    d s_i = w_i (ln 2 <dO, o_i - o> + dS)       base-2 lse

(base 2: ``d w_k / d s_i = ln 2 w_k (delta_ik - w_i)``, while ``d s / d s_i = w_i`` in either
base.)

An empty partial gets zero gradients. (layer: masks | dropout | softmax | states; imports only
the foundation)
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

from refattn._boundary import public
from refattn._checks import as_array, check_finite, check_float64, first_index, format_index
from refattn._memory import check_bytes
from refattn.errors import RefAttnError
from refattn.states.layouts import Layout, read_partials, read_state, to_layout

__all__ = ["Base", "merge_state", "merge_state_backward", "merge_states",
           "merge_states_backward"]

Base = Literal["e", 2]
LN2 = math.log(2.0)


def _base(base: object) -> str:
    if isinstance(base, bool) or base not in ("e", 2):
        raise RefAttnError(f"base: expected 'e' (natural lse) or 2 (base-2 lse), got {base!r}")
    return "e" if base == "e" else "2"


def _merged_weights(lses: np.ndarray, base: Base = "e") -> tuple[np.ndarray, np.ndarray]:
    """The normalised weights ``w_i`` (S, ...) and the merged lse (...) of canonical lses
    (S, ...): the max subtracted, -inf partials weight 0, all -inf: weights 0, lse -inf.

    Examples
    --------
    >>> w, s = _merged_weights(np.array([[0.0], [-np.inf]]))
    >>> w.ravel().tolist(), s.tolist()
    ([1.0, 0.0], [0.0])
    """
    b = _base(base)
    m = lses.max(axis=0)  # (...)
    empty = m == -np.inf
    m0 = np.where(empty, 0.0, m)
    with np.errstate(under="ignore"):
        e = np.exp2(lses - m0) if b == "2" else np.exp(lses - m0)  # (S, ...) in [0, 1]
    total = np.zeros_like(m0)
    for i in range(lses.shape[0]):  # in partial order
        total += e[i]
    safe = np.where(empty, 1.0, total)
    w = np.where(empty, 0.0, e / safe)
    lse = np.where(empty, -np.inf, m0 + (np.log2(safe) if b == "2" else np.log(safe)))
    return w, lse


def _merge(o: np.ndarray, s: np.ndarray, base: Base) -> tuple[np.ndarray, np.ndarray,
                                                              np.ndarray]:
    check_bytes(3 * o[0].nbytes + 3 * s.nbytes, "merging attention states")
    w, lse = _merged_weights(s, base)
    out = np.zeros(o.shape[1:])
    for i in range(o.shape[0]):
        out += w[i][..., None] * o[i]
    _check_overflow("out", out)
    return out, lse, w


@public
def merge_states(outs: np.ndarray, lses: np.ndarray, *, base: Base = "e",
                 layout: Layout = "refattn") -> tuple[np.ndarray, np.ndarray]:
    """Merge S partial attention states over disjoint key sets into one.

    Parameters
    ----------
    outs : float64 ndarray
        Stacked partial outputs: (S, B, H, L, D) for ``layout="refattn"``, (N, S, H, D) for
        ``"flashinfer"`` (``flashinfer.merge_states``'s ``v``), (S, B, L, H, D) for
        ``"flash_attn"`` (its split-KV ``out_accum``).
    lses : float64 ndarray
        Their log-sum-exps: (S, B, H, L), (N, S, H) or (S, B, H, L); finite or -inf (an empty
        partial), never +inf or NaN.
    base : {"e", 2}
        The lse's base: natural (refattn, FlashAttention) or 2 (FlashInfer).
    layout : {"refattn", "flashinfer", "flash_attn"}

    Returns
    -------
    out, lse : float64 ndarray
        The merged state in ``layout``: (B, H, L, D) and (B, H, L); (N, H, D) and (N, H);
        (B, L, H, D) and (B, H, L). See the module docstring for the formula.

    Raises
    ------
    RefAttnError
        Non-float64 arrays, shapes that disagree, a non-finite output, a +inf or NaN lse
        (naming the tensor and the index).

    Examples
    --------
    >>> outs = np.array([[[[[1.0]]]], [[[[3.0]]]]])         # S=2, (B, H, L, D) = (1,1,1,1)
    >>> lses = np.log(np.array([[[[1.0]]], [[[3.0]]]]))     # key mass 1 and 3
    >>> out, lse = merge_states(outs, lses)
    >>> round(float(out[0, 0, 0, 0]), 12), round(float(np.exp(lse[0, 0, 0])), 12)
    (2.5, 4.0)
    """
    b = _base(base)
    o, s = read_partials(outs, lses, layout)
    out, lse, _ = _merge(o, s, "e" if b == "e" else 2)
    return to_layout(out, lse, layout)


@public
def merge_state(out_a: np.ndarray, lse_a: np.ndarray, out_b: np.ndarray, lse_b: np.ndarray,
                *, base: Base = "e", layout: Layout = "refattn"
                ) -> tuple[np.ndarray, np.ndarray]:
    """Merge two partial states (FlashInfer's ``merge_state(v_a, s_a, v_b, s_b)``).

    Parameters
    ----------
    out_a, out_b : float64 ndarray
        (B, H, L, D) for ``"refattn"``, (N, H, D) for ``"flashinfer"``, (B, L, H, D) for
        ``"flash_attn"``.
    lse_a, lse_b : float64 ndarray
        (B, H, L), (N, H) or (B, H, L); finite or -inf.
    base, layout
        As for :func:`merge_states`.

    Returns
    -------
    out, lse : float64 ndarray
        The merged state, in ``layout``.

    Examples
    --------
    >>> a, b = np.ones((1, 1, 2)), np.zeros((1, 1, 2))
    >>> out, lse = merge_state(a, np.zeros((1, 1)), b, np.zeros((1, 1)), base=2,
    ...                        layout="flashinfer")
    >>> out.tolist(), lse.tolist()
    ([[[0.5, 0.5]]], [[1.0]])
    """
    o, s = _stack(out_a, lse_a, out_b, lse_b, layout)
    out, lse, _ = _merge(o, s, base)
    return to_layout(out, lse, layout)


def _stack(out_a: object, lse_a: object, out_b: object, lse_b: object, layout: str
           ) -> tuple[np.ndarray, np.ndarray]:
    oa, sa = read_state(out_a, lse_a, layout, ("out_a", "lse_a"))
    ob, sb = read_state(out_b, lse_b, layout, ("out_b", "lse_b"))
    if ob.shape != oa.shape:
        for axis, (got, want) in enumerate(zip(ob.shape, oa.shape, strict=True)):
            if got != want:
                raise RefAttnError(f"out_b: axis {axis} has length {got}, expected {want} "
                                   "(out_a's)")
    return np.stack([oa, ob]), np.stack([sa, sb])


def _grads(o: np.ndarray, s: np.ndarray, base: Base, grad_out: object, grad_lse: object,
           layout: str) -> tuple[np.ndarray, np.ndarray]:
    out, lse, w = _merge(o, s, base)
    want = to_layout(out, lse, layout)
    g = as_array("grad_out", grad_out)
    check_float64("grad_out", g)
    if g.shape != want[0].shape:
        raise RefAttnError(f"grad_out: expected shape {want[0].shape} (the merged output's), "
                           f"got {g.shape}")
    check_finite("grad_out", g)
    if grad_lse is not None:
        gl = as_array("grad_lse", grad_lse)
        check_float64("grad_lse", gl)
        if gl.shape != want[1].shape:
            raise RefAttnError(f"grad_lse: expected shape {want[1].shape} (the merged lse's), "
                               f"got {gl.shape}")
        check_finite("grad_lse", gl)
    g_o, g_s = read_state(g, np.zeros_like(want[1]) if grad_lse is None else grad_lse, layout,
                          ("grad_out", "grad_lse"))
    check_bytes(2 * o.nbytes + 2 * s.nbytes, "the backward of merging attention states")
    factor = LN2 if _base(base) == "2" else 1.0
    grad_outs = w[..., None] * g_o  # (S, ..., D)
    dots = np.einsum("s...d,...d->s...", o - out, g_o)  # (S, ...): <dO, o_i - o>
    grad_lses = w * (factor * dots + g_s)  # (S, ...)
    _check_overflow("grad_outs", grad_outs)
    _check_overflow("grad_lses", grad_lses)
    return grad_outs, grad_lses


def _check_overflow(name: str, x: np.ndarray) -> None:
    """A result past float64's range is refused, never returned as inf or NaN."""
    idx = first_index(~np.isfinite(x))
    if idx is not None:
        raise RefAttnError(f"{name}: overflow at (canonical) index {format_index(idx)}: the "
                           "inputs' magnitudes exceed float64's range (about 1.8e308)")


@public
def merge_states_backward(outs: np.ndarray, lses: np.ndarray, grad_out: np.ndarray,
                          grad_lse: np.ndarray | None = None, *, base: Base = "e",
                          layout: Layout = "refattn") -> tuple[np.ndarray, np.ndarray]:
    """Gradients of each partial's output and lse from those of the merged state.

    Parameters
    ----------
    outs, lses : float64 ndarray
        The partials, as for :func:`merge_states`.
    grad_out : float64 ndarray
        The merged output's gradient, in the merged output's layout and shape.
    grad_lse : float64 ndarray, optional
        The merged lse's gradient (default 0), in the merged lse's layout and shape.
    base, layout
        As for :func:`merge_states`.

    Returns
    -------
    grad_outs, grad_lses : float64 ndarray
        Shaped like ``outs`` and ``lses``: ``w_i dO`` and ``w_i (<dO, o_i - o> + dS)``
        (base 2: ``w_i (ln 2 <dO, o_i - o> + dS)``); 0 for an empty partial.

    Examples
    --------
    >>> outs = np.array([[[[[1.0]]]], [[[[3.0]]]]]); lses = np.zeros((2, 1, 1, 1))
    >>> g_o, g_s = merge_states_backward(outs, lses, np.ones((1, 1, 1, 1)))
    >>> g_o.ravel().tolist(), g_s.ravel().tolist()
    ([0.5, 0.5], [-0.5, 0.5])
    """
    o, s = read_partials(outs, lses, layout)
    grad_outs, grad_lses = _grads(o, s, base, grad_out, grad_lse, layout)
    return to_layout(grad_outs, grad_lses, layout, stacked=True)


@public
def merge_state_backward(out_a: np.ndarray, lse_a: np.ndarray, out_b: np.ndarray,
                         lse_b: np.ndarray, grad_out: np.ndarray,
                         grad_lse: np.ndarray | None = None, *, base: Base = "e",
                         layout: Layout = "refattn"
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:func:`merge_states_backward` for two states: ``(d out_a, d lse_a, d out_b, d lse_b)``.

    Parameters
    ----------
    out_a, lse_a, out_b, lse_b
        As for :func:`merge_state`.
    grad_out, grad_lse, base, layout
        As for :func:`merge_states_backward`.

    Returns
    -------
    tuple of float64 ndarray
        Shaped like ``out_a``, ``lse_a``, ``out_b``, ``lse_b``.

    Examples
    --------
    >>> z = np.zeros((1, 1)); o = np.ones((1, 1, 1))
    >>> g = merge_state_backward(o, z, o, z, np.ones((1, 1, 1)), np.ones((1, 1)),
    ...                          base=2, layout="flashinfer")
    >>> [x.ravel().tolist() for x in g]
    [[0.5], [0.5], [0.5], [0.5]]
    """
    o, s = _stack(out_a, lse_a, out_b, lse_b, layout)
    grad_outs, grad_lses = _grads(o, s, base, grad_out, grad_lse, layout)
    ga, sa = to_layout(grad_outs[0], grad_lses[0], layout)
    gb, sb = to_layout(grad_outs[1], grad_lses[1], layout)
    return ga, sa, gb, sb
