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
from refattn.bundle.golden.layouts import LAYOUT_INPUTS
from refattn.call.placement import operand_multipliers
from refattn.engine.reduce import gather_heads, reduce_to_shape, sum_heads

__all__ = ["BLOCK_ELEMENTS", "FORWARD_BOUND", "FORWARD_TENSORS", "GRADIENT_BOUND",
           "RECORD_RULE", "STRUCTURAL_ZEROS", "TensorBound", "audit_record", "check_bound",
           "guarantee_record", "kappa", "natural_scales", "saved_state_scales"]

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
        "grad_v": sum_heads(a(trace.consumed).swapaxes(-1, -2) @ a(g_o), call.head_map,
                            call.v.shape[1]).max(),
        "grad_consumed": (a(g_o) @ a(v_eff).swapaxes(-1, -2)).max(),
        "grad_probs": g_probs.max(), "row_dot": (trace.probs * g_probs).sum(-1).max(),
        # O at its natural magnitude |consumed| |v|: an output that cancels to ~0 still
        # carries an error of the order of |consumed| |v| eps
        "row_dot_output": (a(g_o) * (a(trace.consumed) @ a(v_eff))).sum(-1).max(),
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


#: (B, Hq, Q, K) elements per block of :func:`saved_state_scales` (about 16 MiB per array)
BLOCK_ELEMENTS = 1 << 21


def _z_block(call: Any, b: int, i0: int, i1: int) -> np.ndarray | float:
    """|Z| of batch row ``b``, every head, query rows ``[i0, i1)``: (Hq, r, K), or 1.0."""
    source = call.dropout
    if source is None:
        return 1.0
    _, Hq, _, K = call.score_shape
    if isinstance(source, np.ndarray):
        full = np.broadcast_to(source, call.score_shape)
        return np.abs(full[b, :, i0:i1])
    return np.abs(np.stack([source.multiplier_block(b, h, i0, i1, 0, K, Hq=Hq)
                            for h in range(Hq)]))


def _visible_block(call: Any, b: int, i0: int, i1: int) -> np.ndarray:
    """(Hq, r, K) bool: the support of the probabilities (sanitised rows read key 0)."""
    _, Hq, _, K = call.score_shape
    rel = call.relation
    if rel is not None:  # evaluated on this block only, at its broadcast batch and head
        rb = b if rel.shape[0] > 1 else 0
        if rel.shape[1] > 1:
            vis = np.stack([rel.tile(rb, i0, i1, 0, K, h=h) for h in range(Hq)])
        else:
            vis = np.broadcast_to(rel.tile(rb, i0, i1, 0, K), (Hq, i1 - i0, K))
    else:
        vis = call.visible_full()[b, :, i0:i1]
    sanitized = call.sanitized_rows()[b, :, i0:i1]  # (Hq, r)
    if sanitized.any():
        vis = vis.copy()
        vis[..., 0] |= sanitized
    return vis


def saved_state_scales(call: Any, trace: Any, grads: Any) -> tuple[float, dict[str, float]]:
    """:func:`kappa` of the call's scores and :func:`natural_scales` of a saved-state trace.

    The same quantities as the dense functions, computed in blocks of query rows (at most
    :data:`BLOCK_ELEMENTS` scores each) from the inputs, the trace's ``lse`` and ``output`` and
    the gradients' ``row_dot``: a generator that stores no ``(B, Hq, Q, K)`` tensor records its
    bound without ever holding one. Natural magnitudes are those of the tensors a saved-state
    case stores (row_max, lse, output, grad_v, row_dot, row_dot_output, grad_q, grad_k,
    grad_bias), dot-family calls only (``{}`` otherwise, as :func:`natural_scales`).

    Parameters
    ----------
    call : AttentionCall
    trace : Trace
        With ``lse`` (B, Hq, Q) and ``output`` (B, Hq, Q, Dv).
    grads : Gradients
        With ``grad_output`` and ``row_dot`` (B, Hq, Q).

    Returns
    -------
    (float, dict of str to float)

    Examples
    --------
    >>> import refattn
    >>> rng = np.random.default_rng(3)
    >>> q, k, v = (rng.standard_normal((2, 2, 5, 4)) for _ in range(3))
    >>> call = refattn.AttentionCall(q, k, v, bias=rng.standard_normal((5, 5)))
    >>> t = refattn.forward(call)
    >>> g = refattn.backward(t, rng.standard_normal((2, 2, 5, 4)))
    >>> kap, scales = saved_state_scales(call, t, g)
    >>> dense = natural_scales(call, t, g)
    >>> kap == kappa(t.scores), all(np.isclose(scales[n], dense[n], rtol=1e-13) for n in scales)
    (True, True)
    """
    B, Hq, Q, K = call.score_shape
    Hkv, Dk, Dv = call.k.shape[1], call.q.shape[3], call.v.shape[3]
    head_map = call.head_map
    mult = operand_multipliers(call.scale, call.scale_placement)
    family = call.score
    dot = family.name == "dot"
    q_s = call.q if mult.query == 1.0 else call.q * mult.query  # the placement's operands
    k_s = gather_heads(call.k if mult.key == 1.0 else call.k * mult.key, head_map)
    a = np.abs
    k_eff, v_eff = a(gather_heads(call.k, head_map)), a(gather_heads(call.v, head_map))
    qv = np.broadcast_to(call.query_valid_full(), (B, 1, Q, 1))
    bias4 = None if call.bias is None else call.bias.reshape((1,) * (4 - call.bias.ndim)
                                                             + call.bias.shape)
    rows = max(1, min(Q, BLOCK_ELEMENTS // max(1, Hq * K)))
    big = {"kappa": 0.0, "scores": 0.0, "biased": 0.0, "output": 0.0, "row_dot": 0.0,
           "row_dot_output": 0.0, "grad_q": 0.0, "grad_v": 0.0, "grad_k": 0.0}
    g_bias = None if bias4 is None else np.zeros(bias4.shape)
    for b in range(B):
        dv_acc, dk_acc = np.zeros((Hkv, K, Dv)), np.zeros((Hkv, K, Dk))
        for i0 in range(0, Q, rows):
            i1 = min(Q, i0 + rows)
            s = family.compatibility(q_s[b:b + 1, :, i0:i1], k_s[b:b + 1])[0]  # (Hq, r, K)
            if mult.post != 1.0:
                s = s * mult.post
            if call.softcap is not None:
                s = call.softcap * np.tanh(s / call.softcap)
            fin = a(s[np.isfinite(s)])
            big["kappa"] = max(big["kappa"], float(fin.max()) if fin.size else 0.0)
            if not dot:
                continue
            bias_blk = 0.0 if bias4 is None else np.broadcast_to(
                bias4, (B, Hq, Q, K))[b, :, i0:i1]  # (Hq, r, K)
            s_nat = call.scale * (a(call.q[b, :, i0:i1]) @ k_eff[b].swapaxes(-1, -2))
            big["scores"] = max(big["scores"], float(s_nat.max()))
            big["biased"] = max(big["biased"], float((s_nat + a(bias_blk)).max()))
            vis = _visible_block(call, b, i0, i1)
            with np.errstate(under="ignore", over="ignore"):
                p = np.where(vis, np.exp(np.where(vis, s + bias_blk, 0.0)
                                         - trace.lse[b, :, i0:i1, None]), 0.0)  # (Hq, r, K)
            z = _z_block(call, b, i0, i1)
            pz = p * z
            g_o = a(np.where(qv[b, :, i0:i1], grads.grad_output[b, :, i0:i1], 0.0))  # (Hq,r,Dv)
            o_nat = pz @ v_eff[b]  # (Hq, r, Dv): the output's natural magnitude (v_eff is |v|)
            big["output"] = max(big["output"], float(o_nat.max()))
            big["row_dot_output"] = max(big["row_dot_output"], float((g_o * o_nat).sum(-1).max()))
            g_probs = (g_o @ v_eff[b].swapaxes(-1, -2)) * z  # (Hq, r, K)
            big["row_dot"] = max(big["row_dot"], float((p * g_probs).sum(-1).max()))
            g_scores = p * (g_probs + a(grads.row_dot[b, :, i0:i1])[..., None])
            big["grad_q"] = max(big["grad_q"], float((g_scores @ k_eff[b]).max()))
            for h in range(Hq):  # kv gradients summed over the heads that share a kv head
                dv_acc[head_map[h]] += pz[h].T @ g_o[h]
                dk_acc[head_map[h]] += g_scores[h].T @ a(call.q[b, h, i0:i1])
            if g_bias is not None:  # summed over the axes the bias broadcasts along
                _, Hb, Qb, Kb = g_bias.shape
                part = reduce_to_shape(g_scores[None], (1, Hb, i1 - i0 if Qb > 1 else 1, Kb))
                rows_at = slice(i0, i1) if Qb > 1 else slice(0, 1)
                g_bias[b if g_bias.shape[0] > 1 else 0, :, rows_at] += part[0]
        big["grad_v"] = max(big["grad_v"], float(dv_acc.max(initial=0.0)))
        big["grad_k"] = max(big["grad_k"], float(dk_acc.max(initial=0.0)))
    kap = max(1.0, big["kappa"] / 16)
    if not dot:
        return kap, {}
    out = {"row_max": big["biased"], "lse": big["biased"] + np.log(K) + 1.0,
           "output": big["output"], "grad_v": big["grad_v"], "row_dot": big["row_dot"],
           "row_dot_output": big["row_dot_output"], "grad_q": call.scale * big["grad_q"],
           "grad_k": call.scale * big["grad_k"]}
    if g_bias is not None:
        out["grad_bias"] = float(g_bias.max())
    return kap, {name: max(float(x), float(np.finfo(float).tiny)) for name, x in out.items()}


#: the rule a recorded guarantee names (docs/verify.md, "The float64 backends against exact")
RECORD_RULE = "float64_backend_bound"
#: tensors a record never lists: the call's inputs, stored as given
_INPUTS = frozenset({"q", "k", "v", "head_map", "visible", "query_valid", "bias", "dropout",
                     "sink", "grad_output"}) | LAYOUT_INPUTS


def _allowance(name: str, t: np.ndarray, kap: float, scale: float | None) -> dict[str, float]:
    """The bound of one tensor as :func:`check_bound` applies it (factor 1)."""
    forward = name in FORWARD_TENSORS
    if scale is not None:
        rec = {"elementwise": GRADIENT_BOUND * kap * scale}
    else:
        fin = t[np.isfinite(t)]
        rec = {"elementwise": GRADIENT_BOUND * kap * (float(np.abs(fin).max()) if fin.size
                                                        else 0.0)}
    if forward or scale is None:
        rec["normwise_relative"] = (FORWARD_BOUND if forward else GRADIENT_BOUND) * kap
    return rec


def guarantee_record(backend: str, tensors: Mapping[str, np.ndarray], kap: float,
                     scales: Mapping[str, float]) -> dict[str, Any]:
    """The manifest's ``guarantee`` record of a float64-generated case: per computed tensor,
    the bound verify applies against the correctly rounded result.

    ``elementwise``: the largest ``|stored - correctly rounded|`` allowed at any element
    (``GRADIENT_BOUND x kappa x`` the tensor's natural magnitude, or its largest value where
    none is defined); ``normwise_relative``: the allowed ``||stored - ref|| / ||ref||`` (forward
    tensors: ``FORWARD_BOUND x kappa``). Integer and boolean tensors must be equal.

    Examples
    --------
    >>> rec = guarantee_record("numba", {"output": np.ones(3), "q": np.ones(3)}, 2.0,
    ...                        {"output": 4.0})
    >>> rec["tensors"], rec["kappa"]
    ({'output': {'elementwise': 8e-12, 'normwise_relative': 2e-14}}, 2.0)
    """
    listed: dict[str, Any] = {}
    for name in sorted(tensors):
        t = np.asarray(tensors[name])
        if name in _INPUTS or name.startswith(("score_", "quant_")):
            continue
        if t.dtype.kind != "f":
            listed[name] = {"equal": True}
            continue
        listed[name] = _allowance(name, t, kap, scales.get(name))
    return {"generator": backend, "rule": RECORD_RULE, "reference": "correctly rounded",
            "forward_bound": FORWARD_BOUND, "gradient_bound": GRADIENT_BOUND, "kappa": kap,
            "tensors": listed}


def audit_record(record: Any, claimed: str, reference: Mapping[str, np.ndarray], kap: float,
                 scales: Mapping[str, float], stored: Any) -> list[str]:
    """What is wrong with a case's recorded guarantee, against verify's own bound.

    The record must name the claimed generator and the float64 backend rule with its
    constants, list exactly the computed tensors the case stores, and allow no tensor more
    than verify's own allowance, computed from ``reference`` (the correctly rounded or float64
    recomputation), its ``kap`` and ``scales`` (a relative slack of 1e-6 for the two runs'
    roundings). Verify applies its own bound whatever the record says; a looser record is a
    false claim about the file.

    Returns
    -------
    list of str
        One reason per problem (empty: the record is honest).

    Examples
    --------
    >>> ref = {"output": np.ones(3)}
    >>> rec = guarantee_record("numba", ref, 1.0, {"output": 1.0})
    >>> audit_record(rec, "numba", ref, 1.0, {"output": 1.0}, ref)
    []
    >>> rec["tensors"]["output"]["elementwise"] = 1e-9
    >>> audit_record(rec, "numba", ref, 1.0, {"output": 1.0}, ref)[0][:58]
    'output: the record allows elementwise 1e-09, looser than t'
    """
    if not isinstance(record, Mapping):
        return ["the guarantee record is not an object"]
    problems = []
    for key, want in (("generator", claimed), ("rule", RECORD_RULE),
                      ("forward_bound", FORWARD_BOUND), ("gradient_bound", GRADIENT_BOUND)):
        if record.get(key) != want:
            problems.append(f"the guarantee record's {key} is {record.get(key)!r}, expected "
                            f"{want!r} (the {claimed} generator's float64 backend bound)")
    listed = record.get("tensors")
    if not isinstance(listed, Mapping):
        return [*problems, "the guarantee record lists no tensors"]
    computed = {n for n in stored if n not in _INPUTS and not n.startswith(("score_", "quant_"))}
    for name in sorted(computed ^ set(listed)):
        where = "stored but not listed" if name in computed else "listed but not stored"
        problems.append(f"{name}: {where} in the guarantee record")
    for name in sorted(computed & set(listed) & set(reference)):
        got, ref = listed[name], np.asarray(reference[name])
        if not isinstance(got, Mapping):
            problems.append(f"{name}: the guarantee record's entry is not an object")
            continue
        if ref.dtype.kind != "f":
            if got != {"equal": True}:
                problems.append(f"{name}: {ref.dtype} values must be recorded as equal")
            continue
        own = _allowance(name, ref, kap, scales.get(name))
        for key in sorted(set(got) | set(own)):
            value = got.get(key)
            if key not in own or not isinstance(value, (int, float)) or isinstance(
                    value, bool) or not np.isfinite(value):
                problems.append(f"{name}: the guarantee record's {key!r} is {value!r}; "
                                f"verify's bound has {sorted(own)}")
            elif value > own[key] * (1 + 1e-6):
                problems.append(f"{name}: the record allows {key} {value:.3g}, looser than the "
                                f"{claimed} guarantee verify applies ({own[key]:.3g})")
    return problems
