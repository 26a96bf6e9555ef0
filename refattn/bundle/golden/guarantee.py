"""How far a stored tensor may be from the correctly rounded result: the float64 backend bound.

Owns the documented bound of the float64 backends (numpy, numba) against the ``exact``
generator, which ``refattn verify`` applies to every case that is not bit-identical to the
correctly rounded result, whatever its manifest claims (docs/verify.md; README, "The float64
backends against exact"; tested for both backends in tests/engine/test_exact.py and
tests/bundle/test_verify_guarantees.py):

- ``kappa = max(1, max|scores| / 16)``, the conditioning of ``exp(s - lse)`` in the scores
  (one ulp of a score of 1000 moves a probability by 1e-13);
- forward tensors (:data:`FORWARD_TENSORS`): normwise relative difference at most
  ``FORWARD_BOUND * kappa`` (for ``lse`` relative to ``max(|lse|, its natural magnitude)``
  element by element, or ``max(|lse|, 1)`` without one: ``lse = m + log(l)`` with ``l >= 1``
  rounded, so its error is absolute where the sum cancels to near 0), and every element within
  ``GRADIENT_BOUND * kappa`` of the tensor's natural magnitude (a single element cannot hide
  in a large tensor's norm);
- every other float tensor (gradients): every element within ``GRADIENT_BOUND * kappa`` of its
  natural magnitude, the largest sum of absolute terms behind one element
  (:func:`natural_scales`, dot-family calls), with the structural zeros of the reference kept
  exactly 0; where no natural magnitude is defined (other score families, score parameters,
  sinks, paged gradients) the normwise relative difference is at most ``GRADIENT_BOUND *
  kappa`` and every element within ``GRADIENT_BOUND * kappa * max|reference|``;
- non-finite positions and values, and every integer or boolean tensor, equal.

The recomputation that produces the reference is :mod:`refattn.bundle.verification.recompute`'s; the
record of which guarantee held is :class:`refattn.bundle.verification.report.Guarantee`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from refattn._checks import format_index
from refattn.engine.reduce import gather_heads, reduce_to_shape, sum_heads

__all__ = ["FORWARD_BOUND", "FORWARD_TENSORS", "GRADIENT_BOUND", "STRUCTURAL_ZEROS",
           "TensorBound", "check_bound", "kappa", "natural_scales"]

#: normwise relative bound of the forward tensors, times kappa (README, docs/verify.md)
FORWARD_BOUND = 1e-14
#: bound of every element of a gradient, times kappa and its natural magnitude
GRADIENT_BOUND = 1e-12
#: tensors the forward bound applies to
FORWARD_TENSORS = frozenset(("scores", "biased_scores", "masked_scores", "row_max", "lse",
                             "probs", "consumed", "output", "sink_probs", "softcap_input"))
#: zeros that come from a product with an exact 0 (masked P, dropped Z, an unused row); other
#: tensors are sums that may cancel to 0 by accident (e.g. a bias broadcast over keys)
STRUCTURAL_ZEROS = frozenset(("probs", "dropout_multiplier", "consumed", "output",
                              "grad_consumed", "grad_probs", "grad_scores"))


def kappa(scores: np.ndarray | None) -> float:
    """The conditioning factor of ``exp(s - lse)`` in the scores: ``max(1, max|s| / 16)``.

    Parameters
    ----------
    scores : (B, Hq, Q, K) float64 ndarray or None
        The reference's scores (-inf and NaN ignored).

    Examples
    --------
    >>> kappa(np.array([[-np.inf, 3.0], [40.0, -64.0]]))
    4.0
    >>> kappa(None)
    1.0
    """
    if scores is None:
        return 1.0
    s = np.asarray(scores)
    legal = np.abs(s[np.isfinite(s)])
    return max(1.0, float(legal.max()) / 16 if legal.size else 0.0)


def natural_scales(call: Any, trace: Any, grads: Any) -> dict[str, float]:
    """Largest sum of absolute terms behind one element of each tensor (dot-family calls).

    Computed from a reference trace with every operand replaced by its absolute value.
    Floating-point error is bounded by a few ulp of that sum, so ``max|a - b| <= rtol *
    natural`` stays meaningful where an element cancels to nearly 0. Other score families
    get ``{}`` (the normwise rule applies to them).

    Parameters
    ----------
    call : AttentionCall
    trace : Trace
        The reference's forward trace (probs, consumed, dropout multiplier, output).
    grads : Gradients
        The reference's gradients (grad_output, row_dot).

    Returns
    -------
    dict of str to float
        Tensor name -> natural magnitude (at least the smallest normal float64).

    Examples
    --------
    >>> import refattn
    >>> x = np.array([[[[0.5, -1.0], [2.0, 0.25]]]])          # (B, H, Q, D) = (1, 1, 2, 2)
    >>> call = refattn.AttentionCall(x, x, x)
    >>> t = refattn.forward(call)
    >>> s = natural_scales(call, t, refattn.backward(t, np.ones_like(x)))
    >>> s["probs"], bool(np.isclose(s["scores"], 2 ** -0.5 * (4 + 0.0625)))  # |q_1|.|q_1|
    (1.0, True)
    """
    if call.score.name != "dot" or trace.probs is None or trace.consumed is None:
        return {}
    a = np.abs
    k_eff = gather_heads(call.k, call.head_map)  # (B, Hq, K, Dk)
    v_eff = gather_heads(call.v, call.head_map)  # (B, Hq, K, Dv)
    B, _, Q, _ = call.q.shape
    qv = np.broadcast_to(call.query_valid_full(), (B, 1, Q, 1))
    g_o = np.where(qv, grads.grad_output, 0.0)  # (B, Hq, Q, Dv), invalid queries zeroed
    z = np.broadcast_to(trace.dropout_multiplier, trace.probs.shape)  # (B, Hq, Q, K)
    scores = call.scale * (a(call.q) @ a(k_eff).swapaxes(-1, -2))  # (B, Hq, Q, K)
    biased = scores if call.bias is None else scores + a(call.bias)
    g_probs = (a(g_o) @ a(v_eff).swapaxes(-1, -2)) * a(z)  # (B, Hq, Q, K)
    g_scores = trace.probs * (g_probs + a(grads.row_dot)[..., None])
    out = {
        "scores": scores.max(), "biased_scores": biased.max(), "masked_scores": biased.max(),
        "row_max": biased.max(), "lse": biased.max() + np.log(call.score_shape[3]) + 1.0,
        "probs": 1.0, "dropout_multiplier": a(z).max(), "consumed": a(z).max(),
        "output": (a(trace.consumed) @ a(v_eff)).max(),
        "grad_v": (a(trace.consumed).swapaxes(-1, -2) @ a(g_o)).max(),
        "grad_consumed": (a(g_o) @ a(v_eff).swapaxes(-1, -2)).max(),
        "grad_probs": g_probs.max(), "row_dot": (trace.probs * g_probs).sum(-1).max(),
        "row_dot_output": (a(g_o) * a(trace.output)).sum(-1).max(),
        "grad_scores": g_scores.max(),
        "grad_q": call.scale * (g_scores @ a(k_eff)).max(),
        "grad_k": call.scale * sum_heads(g_scores.swapaxes(-1, -2) @ a(call.q), call.head_map,
                                         call.k.shape[1]).max(),
    }
    if call.bias is not None:
        out["grad_bias"] = reduce_to_shape(g_scores, call.bias.shape).max()
    return {name: max(float(x), float(np.finfo(float).tiny)) for name, x in out.items()}


class TensorBound(NamedTuple):
    """One tensor against the bound: the share of its allowance used, and why it fails."""

    name: str
    #: largest error / allowance over the tensor's rules (inf: a pattern that must be equal
    #: differs); <= 1 passes
    fraction: float
    #: None when within the bound, else a sentence naming the worst element
    reason: str | None


def _ratio(err: float, allowed: float) -> float:
    if err == 0.0:
        return 0.0
    return err / allowed if allowed > 0 else float("inf")


def _at(index: Any, a: np.ndarray, g: np.ndarray, what: str) -> str:
    """``at (i, j): stored x, <what> y`` for one element (plain Python numbers)."""
    idx = tuple(int(i) for i in index)
    return f"at {format_index(idx)}: stored {a[idx].item()!r}, {what} {g[idx].item()!r}"


def _tensor_bound(name: str, a: np.ndarray, g: np.ndarray, kap: float, scale: float | None,
                  factor: float, what: str) -> TensorBound:
    """``a`` (stored) against ``g`` (reference) under the bound of tensor ``name``."""
    if a.shape != g.shape or a.dtype != g.dtype:
        return TensorBound(name, float("inf"), f"stored {a.dtype} {list(a.shape)}, {what} "
                           f"{g.dtype} {list(g.shape)}")
    if g.dtype.kind != "f":
        bad = np.argwhere(a != g)
        if not bad.size:
            return TensorBound(name, 0.0, None)
        return TensorBound(name, float("inf"), f"{g.dtype} values must be equal; "
                           f"{_at(bad[0], a, g, what)}")
    fin = np.isfinite(g)
    with np.errstate(invalid="ignore"):
        same = np.where(fin, np.isfinite(a), (a == g) | (np.isnan(a) & np.isnan(g)))
    if not same.all():
        return TensorBound(name, float("inf"), f"non-finite values must be equal; "
                           f"{_at(np.argwhere(~same)[0], a, g, what)}")
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.where(fin, np.abs(a - g), 0.0)  # same shape as g
    forward = name in FORWARD_TENSORS
    parts: list[tuple[float, str]] = []  # (share of the allowance, how it is exceeded)
    worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(d)), d.shape)) if d.size else ()
    err = float(d[worst]) if d.size else 0.0
    element = f"{_at(worst, a, g, what)} (|d| = {err:.3e}" if d.size else ""
    if scale is not None:
        allowed = factor * GRADIENT_BOUND * kap * scale
        parts.append((_ratio(err, allowed), f"{element} > {allowed:.3e} = "
                      f"{factor * GRADIENT_BOUND:g} x kappa {kap:.3g} x natural magnitude "
                      f"{scale:.3e})"))
        if not forward and name in STRUCTURAL_ZEROS and name != "grad_scores":
            moved = (g == 0.0) & (a != 0.0)
            if moved.any():
                parts.append((float("inf"), f"{_at(np.argwhere(moved)[0], a, g, what)}: an "
                              "exact (structural) 0 must stay 0"))
    else:
        mag = float(np.abs(g[fin]).max()) if fin.any() else 0.0
        allowed = factor * GRADIENT_BOUND * kap * mag
        parts.append((_ratio(err, allowed), f"{element} > {allowed:.3e} = "
                      f"{factor * GRADIENT_BOUND:g} x kappa {kap:.3g} x max|{what}| "
                      f"{mag:.3e})"))
    if forward or scale is None:
        base = factor * (FORWARD_BOUND if forward else GRADIENT_BOUND)
        size = np.abs(g[fin])
        if name == "lse":  # log of a row sum >= 1: its error is absolute near lse = 0
            size = np.maximum(size, scale if scale is not None else 1.0)
        norm = float(np.linalg.norm(size))
        rel = float(np.linalg.norm(d)) / norm if norm else (0.0 if not d.any() else np.inf)
        parts.append((_ratio(rel, base * kap), f"normwise relative difference {rel:.3e} > "
                      f"{base * kap:.3e} = {base:g} x kappa {kap:.3g}"))
    fraction = max(p for p, _ in parts)
    if fraction <= 1.0:
        return TensorBound(name, fraction, None)
    return TensorBound(name, fraction, "; ".join(why for p, why in parts if p > 1.0))


def check_bound(stored: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray], *,
                kappa: float, scales: Mapping[str, float], factor: float = 1.0,
                what: str = "correctly rounded") -> list[TensorBound]:
    """Every tensor of ``reference`` that ``stored`` holds, against the float64 backend bound.

    Parameters
    ----------
    stored, reference : dict of str to ndarray
        Tensors by canonical name; only names in both are checked.
    kappa : float
        :func:`kappa` of the reference's scores.
    scales : dict of str to float
        :func:`natural_scales` of the reference (empty for families other than dot).
    factor : float
        Multiplier of every bound (2 where the reference is itself a float64 recomputation
        within the bound of the correctly rounded result).
    what : str
        The reference's name in the reasons.

    Returns
    -------
    list of TensorBound
        One per checked tensor, in name order.

    Examples
    --------
    >>> g = {"output": np.array([1.0, 2.0]), "grad_q": np.array([0.5, -0.25])}
    >>> near = {"output": np.array([1.0, 2.0 + 2e-16]), "grad_q": np.array([0.5, -0.25])}
    >>> [(t.name, t.reason) for t in check_bound(near, g, kappa=1.0, scales={})]
    [('grad_q', None), ('output', None)]
    >>> far = {"output": np.array([1.0, 2.0 * (1 + 5e-11)])}
    >>> (t,) = check_bound(far, g, kappa=1.0, scales={})
    >>> t.fraction > 1, t.reason.startswith("at (1): stored 2.0000000001")
    (True, True)
    """
    out = []
    for name in sorted(set(stored) & set(reference)):
        scale = scales.get(name)
        out.append(_tensor_bound(name, np.asarray(stored[name]), np.asarray(reference[name]),
                                 kappa, scale, factor, what))
    return out
