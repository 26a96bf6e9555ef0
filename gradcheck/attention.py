"""refattn's attention as ``fn``/``vjp`` over named inputs, for gradcheck.

Owns the adapter: ``fn`` runs :func:`refattn.engine.reference.forward_arrays` (complex-safe,
so the exact complex-step method applies) with everything but the checked inputs frozen from
the call, including the realised dropout multiplier Z (a stream is replayed once), the score
family, scale placement and softcap; ``vjp`` rebuilds the call, runs the forward and then the
backward under test (``refattn.backward`` by default, or any ``backward(trace,
grad_output)``). Differentiable inputs: ``q``, ``k``, ``v``, ``bias``, ``sink`` and
``score_<name>`` for a score family's parameters. Also declares attention's known null
directions (a constant shift of every key when the score is linear in k and there is no
softcap or sink; a constant shift of a bias row along the key axis when there is no sink) and
the magnitudes of the terms the backward sums (:func:`rounding_scales`), which bound its own
rounding. Defers the checking itself to :func:`gradcheck.check_vjp`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from gradcheck.api import check_vjp
from gradcheck.report import Report
from refattn._boundary import public
from refattn.call import AttentionCall
from refattn.engine import backward as reference_backward
from refattn.engine import forward
from refattn.engine.reduce import gather_heads, reduce_to_shape, sum_heads
from refattn.engine.reference import forward_arrays
from refattn.engine.trace import Gradients, Trace
from refattn.errors import RefAttnError

__all__ = ["AttentionProblem", "attention_problem", "check_attention", "rounding_scales"]

Backward = Callable[[Trace, np.ndarray], Gradients | Mapping[str, np.ndarray]]
Projector = Callable[[np.ndarray], np.ndarray]
INPUTS = ("q", "k", "v", "bias", "sink")


def _key_shift(a: np.ndarray) -> np.ndarray:
    # (B, Hkv, K, Dk): adding one vector c to every key adds q_i . c to a whole score row
    return a.mean(axis=2, keepdims=True)


def _bias_row_shift(a: np.ndarray) -> np.ndarray:
    # (..., K): a constant added along the key axis shifts a whole score row
    return a.mean(axis=-1, keepdims=True)


def _all_null(a: np.ndarray) -> np.ndarray:
    # (..., 1): a bias broadcast over keys shifts whole rows only; softmax ignores it
    return a


def _filled(x: np.ndarray | None, name: str) -> np.ndarray:
    """A tensor the reference forward/backward always fills (None only in a streaming
    trace, or from a backward that left it out)."""
    if x is None:
        raise RefAttnError(f"{name}: missing; this check needs the reference forward's "
                           "materialised tensors and a backward that returns it")
    return x


def rounding_scales(trace: Trace, grad_output: np.ndarray) -> dict[str, np.ndarray]:
    """Magnitudes of the terms each backward tensor sums: ``eps`` times them bounds rounding.

    ``G_S = P (G_P - D)`` cancels when one key dominates a row (``G_P_j ~ D``), so its
    rounding is set by ``P (|G_P| + |D|)``, not by ``|G_S|``; G_Q, G_K and the bias gradient
    inherit that through their sums. In a saturated softmax the exact gradients can lie far
    below this floor, where no float64 backward resolves them.

    Parameters
    ----------
    trace : Trace
        A forward trace with probabilities (the reference backend's).
    grad_output : (B, Hq, Q, Dv) ndarray

    Returns
    -------
    dict
        ``grad_probs``, ``grad_scores`` (B, Hq, Q, K); ``grad_v`` like v; ``grad_q``,
        ``grad_k`` like q, k (dot scores only); ``grad_bias`` like the bias (when present).

    Examples
    --------
    >>> import refattn
    >>> from refattn.bundle.suites.contract import LOOP6_GRAD_OUTPUT, loop6_call
    >>> s = rounding_scales(refattn.forward(loop6_call()), LOOP6_GRAD_OUTPUT)
    >>> sorted(s), s["grad_q"].shape
    (['grad_k', 'grad_probs', 'grad_q', 'grad_scores', 'grad_v'], (1, 1, 2, 2))
    """
    call = trace.call
    hm, Hkv = cast(np.ndarray, call.head_map), call.k.shape[1]  # validated: (Hq,) int64
    probs, multiplier = _filled(trace.probs, "probs"), _filled(trace.dropout_multiplier,
                                                               "dropout_multiplier")
    consumed = _filled(trace.consumed, "consumed")
    g_o = np.abs(np.where(call.query_valid_full(), grad_output, 0.0))  # (B, Hq, Q, Dv)
    v_eff = np.abs(gather_heads(call.v, hm))  # (B, Hq, K, Dv)
    P = np.abs(probs)  # (B, Hq, Q, K)
    g_p = (g_o @ v_eff.swapaxes(-1, -2)) * np.abs(multiplier)  # |G_P| terms
    d = (P * g_p).sum(-1)  # (B, Hq, Q) |D| terms
    g_s = P * (g_p + d[..., None])  # (B, Hq, Q, K)
    out = {"grad_probs": g_p, "grad_scores": g_s,
           "grad_v": sum_heads(np.abs(consumed).swapaxes(-1, -2) @ g_o, hm, Hkv)}
    score = getattr(call, "score", None)
    if score is None or getattr(score, "name", "dot") == "dot":
        alpha = cast(float, call.scale)  # the whole multiplier, wherever it is placed
        out["grad_q"] = alpha * (g_s @ np.abs(gather_heads(call.k, hm)))
        out["grad_k"] = sum_heads(alpha * (g_s.swapaxes(-1, -2) @ np.abs(call.q)), hm, Hkv)
    if call.bias is not None:
        out["grad_bias"] = reduce_to_shape(g_s, call.bias.shape)
    return out


@dataclass(frozen=True, eq=False)
class AttentionProblem:
    """One attention call exposed as ``fn``/``vjp`` for :func:`gradcheck.check_vjp`.

    Attributes
    ----------
    call : AttentionCall
        The frozen call (visibility, query validity, scale, head map, Z, policy).
    fn : callable
        ``fn(q, k, v[, bias]) -> (B, Hq, Q, Dv) ndarray`` (accepts complex arrays).
    vjp : callable
        ``vjp(grad_output, q, k, v[, bias]) -> {"q", "k", "v"[, "bias"]}`` from the backward
        under test.
    inputs : dict of str to ndarray
        The call's q, k, v (and bias when it has one).
    null_space : dict of str to callable
        Projectors on the known null directions (k: key shift; bias: row shift).
    term_scale : callable
        ``term_scale(grad_output, **inputs) -> {name: magnitudes}`` from
        :func:`rounding_scales` (the vjp's own rounding bound).
    """

    call: AttentionCall
    fn: Callable[..., np.ndarray]
    vjp: Callable[..., dict[str, np.ndarray]]
    inputs: dict[str, np.ndarray]
    null_space: dict[str, Projector]
    term_scale: Callable[..., dict[str, np.ndarray]] | None = None

    def check(self, **options: Any) -> Report:
        """:func:`gradcheck.check_vjp` on this problem (options passed through)."""
        return check_vjp(self.fn, self.vjp, self.inputs, null_space=self.null_space,
                         term_scale=self.term_scale, **options)


def _as_dict(grads: Gradients | Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    if isinstance(grads, Gradients):
        grads = grads.tensors()
    if not isinstance(grads, Mapping):
        raise RefAttnError(
            f"backward: expected Gradients or a mapping, got {type(grads).__name__}"
        )
    out = {n: grads[f"grad_{n}"] for n in INPUTS if grads.get(f"grad_{n}") is not None}
    for name, value in grads.items():  # grad_score_<param> (Gradients.tensors() spelling)
        if name.startswith("grad_score_") and value is not None:
            out[name[len("grad_"):]] = value
    return out


def _differentiable(call: AttentionCall) -> dict[str, np.ndarray]:
    out = {n: getattr(call, n) for n in INPUTS if getattr(call, n, None) is not None}
    score = getattr(call, "score", None)
    if score is not None:
        out.update({f"score_{n}": np.asarray(a) for n, a in score.parameters().items()})
    return out


@public
def attention_problem(
    call: AttentionCall,
    *,
    backward: Backward | None = None,
    wrt: Sequence[str] | None = None,
) -> AttentionProblem:
    """Expose ``call``'s forward and a backward as ``fn``/``vjp`` over its inputs.

    Parameters
    ----------
    call : AttentionCall
    backward : callable, optional
        ``backward(trace, grad_output) -> Gradients`` (or a mapping with ``grad_q``,
        ``grad_k``, ``grad_v``, ``grad_bias``, ...). Default :func:`refattn.backward`.
    wrt : sequence of str, optional
        Subset of the differentiable inputs (``q``, ``k``, ``v``, ``bias``, ``sink``,
        ``score_<name>``) to expose (default: all present).

    Returns
    -------
    AttentionProblem

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal(s) for s in [(1, 2, 3, 4), (1, 1, 5, 4), (1, 1, 5, 2)])
    >>> problem = attention_problem(AttentionCall(q, k, v))
    >>> sorted(problem.inputs), problem.check().passed
    (['k', 'q', 'v'], True)
    """
    if not isinstance(call, AttentionCall):
        raise RefAttnError(f"call: expected an AttentionCall, got {type(call).__name__}")
    available = _differentiable(call)
    names = list(available)
    if wrt is not None:
        unknown = [n for n in wrt if n not in available]
        if unknown:
            raise RefAttnError(f"wrt: {unknown} not among the call's inputs {names}")
        names = [n for n in names if n in wrt]
    score = getattr(call, "score", None)
    frozen: dict[str, Any] = {
        "head_map": call.head_map,
        "scale": call.scale,
        "visible": call.visible_full(),
        "query_valid": call.query_valid_full(),
        "multiplier": call.multiplier_full(),  # the realised Z: a stream is replayed once
    }
    for opt in ("scale_placement", "softcap"):
        if hasattr(call, opt):
            frozen[opt] = getattr(call, opt)
    run_backward = reference_backward if backward is None else backward

    def split(kw: Mapping[str, np.ndarray]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        direct = {n: kw.get(n, getattr(call, n, None)) for n in INPUTS}
        params = {n[len("score_"):]: x for n, x in kw.items() if n.startswith("score_")}
        return direct, params

    def fn(**kw: np.ndarray) -> np.ndarray:
        a, params = split(kw)
        extra: dict[str, Any] = {}
        if score is not None:
            extra["score"] = score.with_arrays(**params) if params else score
        if a["sink"] is not None:
            extra["sink"] = a["sink"]
        return forward_arrays(a["q"], a["k"], a["v"], bias=a["bias"], **frozen,
                              **extra)["output"]

    def rebuilt(kw: Mapping[str, np.ndarray]) -> AttentionCall:
        _, params = split(kw)
        changed: dict[str, Any] = {n: kw[n] for n in INPUTS
                                   if n in kw and kw[n] is not getattr(call, n)}
        if params and score is not None:  # score_* inputs exist only for a score family
            changed["score"] = dataclasses.replace(score, **params)  # validated copy
        return dataclasses.replace(call, **changed) if changed else call

    def vjp(grad_output: np.ndarray, **kw: np.ndarray) -> dict[str, np.ndarray]:
        grads = _as_dict(run_backward(forward(rebuilt(kw)), grad_output))
        return {n: grads[n] for n in names if n in grads}

    def term_scale(grad_output: np.ndarray, **kw: np.ndarray) -> dict[str, np.ndarray]:
        scales = rounding_scales(forward(rebuilt(kw)), grad_output)
        return {n: scales[f"grad_{n}"] for n in names if f"grad_{n}" in scales}

    linear_score = score is None or bool(getattr(score, "linear_in_operands", False))
    no_sink = getattr(call, "sink", None) is None
    null: dict[str, Projector] = {}
    if "k" in names and linear_score and no_sink and getattr(call, "softcap", None) is None:
        null["k"] = _key_shift
    if "bias" in names and no_sink and call.bias is not None:  # "bias" listed: a bias
        null["bias"] = _all_null if call.bias.shape[-1] == 1 else _bias_row_shift
    inputs = {n: available[n] for n in names}
    return AttentionProblem(call, fn, vjp, inputs, null, term_scale)


@public
def check_attention(
    call: AttentionCall,
    *,
    grad_output: np.ndarray | None = None,
    backward: Backward | None = None,
    wrt: Sequence[str] | None = None,
    **options: Any,
) -> Report:
    """Check a backward (default :func:`refattn.backward`) of ``call`` with gradcheck.

    Parameters
    ----------
    call : AttentionCall
    grad_output : (B, Hq, Q, Dv) float64 ndarray, optional
        G_O (default: Gaussian from the seed).
    backward : callable, optional
        The backward under test (see :func:`attention_problem`).
    wrt : sequence of str, optional
    **options
        Passed to :func:`gradcheck.check_vjp` (mode, method, seed, directions, ...).

    Returns
    -------
    Report

    Examples
    --------
    >>> from refattn.bundle.suites.contract import LOOP6_GRAD_OUTPUT, loop6_call
    >>> r = check_attention(loop6_call(), grad_output=LOOP6_GRAD_OUTPUT)
    >>> r.passed, r.inputs["q"].method
    (True, 'complex_step')
    """
    problem = attention_problem(call, backward=backward, wrt=wrt)
    return problem.check(grad_output=grad_output, **options)
