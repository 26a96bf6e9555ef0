"""Numerical hazards of a call, named before any arithmetic: float64 overflow.

Owns :func:`score_bound` (an upper bound on every ``|score|`` a call can produce, from the
largest input magnitudes: for the dot family ``max(1, alpha) * Dk * max|q| * max|k|``, the
partial sums of each dot product included), :func:`check_forward_overflow` (the gate refuses a
call whose scores plus bias and sink, or whose value mixing, could exceed :data:`LIMIT`) and
:func:`check_backward_overflow` (the same for the gradients, given ``grad_output``). A refused
call would otherwise produce ``inf - inf = NaN`` silently. The bounds are worst cases: a call
that passes cannot overflow; a call refused might not have, and the message says how to
rescale it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from refattn._checks import compact
from refattn.errors import RefAttnError

__all__ = ["LIMIT", "check_backward_overflow", "check_forward_overflow", "score_bound"]

#: the largest magnitude a bounded quantity may reach: half of float64's maximum, so that one
#: more addition of a bounded term (bias, sink, the row maximum) stays finite
LIMIT = float(np.finfo(np.float64).max) / 2


def _max_abs(x: Any) -> float:
    if x is None:
        return 0.0
    a = compact(np.asarray(x))  # a broadcast bias is read once per stored element
    return float(np.max(np.abs(a))) if a.size else 0.0


def score_bound(call: Any) -> tuple[float, str]:
    """An upper bound on ``|alpha * u|`` (and on ``|u|``) over the call, and how it was formed.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.call import AttentionCall
    >>> q = np.full((1, 1, 2, 4), 3.0); k = np.full((1, 1, 5, 4), -2.0)
    >>> score_bound(AttentionCall(q, k, k))[0]   # max(1, 0.5) * 4 * 3 * 2
    24.0
    """
    alpha = max(1.0, float(call.scale))
    mq, mk = _max_abs(call.q), _max_abs(call.k)
    family = call.score
    match family.name:
        case "dot":
            Dk = call.q.shape[3]
            return alpha * Dk * mq * mk, (
                f"max(1, alpha) * Dk * max|q| * max|k| = {alpha:.3g} * {Dk} * {mq:.3g} * "
                f"{mk:.3g}")
        case "bilinear":
            W = family.parameters()["W"]
            Dq, Dk = W.shape[-2], W.shape[-1]
            mw = _max_abs(W)
            return alpha * Dq * Dk * mq * mw * mk, (
                f"max(1, alpha) * Dq * Dk * max|q| * max|W| * max|k| = {alpha:.3g} * {Dq} * "
                f"{Dk} * {mq:.3g} * {mw:.3g} * {mk:.3g}")
        case "additive":
            p = family.parameters()
            Dq, Dk = call.q.shape[3], call.k.shape[3]
            inner = (Dq * mq * _max_abs(p["Wq"]) + Dk * mk * _max_abs(p["Wk"])
                     + _max_abs(p["b"]))
            outer = alpha * np.asarray(p["v"]).shape[-1] * _max_abs(p["v"])
            if inner > LIMIT:  # tanh's argument itself must be finite
                return inner, (f"the additive score's tanh argument: Dq * max|q| * max|Wq| + "
                               f"Dk * max|k| * max|Wk| + max|b| = {inner:.3g}")
            return outer, f"max(1, alpha) * Da * max|v_score| = {outer:.3g}"
        case "cosine":
            return alpha, f"max(1, alpha) = {alpha:.3g} (a cosine is at most 1)"
        case _:
            return 0.0, "unknown family (not bounded here)"


def check_forward_overflow(call: Any) -> None:
    """Refuse a call whose scores or output could overflow float64 (see module docstring).

    Raises
    ------
    RefAttnError
        Naming the tensors, the bound and :data:`LIMIT`, e.g. ``q, k: the scores could
        overflow float64: ...``.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.call import AttentionCall
    >>> x = np.full((1, 1, 2, 4), 1e200)
    >>> try:
    ...     AttentionCall(x, x, np.ones((1, 1, 2, 4)))
    ... except RefAttnError as exc:
    ...     print(str(exc).split(": ", 1)[1][:44])
    q, k: the scores could overflow float64 (|s|
    """
    bound, how = score_bound(call)
    mb, ms = _max_abs(call.bias), _max_abs(call.sink)
    total = bound + mb + ms
    if not total <= LIMIT:
        extra = "".join(f" + max|{n}| {m:.3g}" for n, m in (("bias", mb), ("sink", ms)) if m)
        raise RefAttnError(
            f"q, k: the scores could overflow float64 (|s| <= {how}{extra} = {total:.3g}, "
            f"above {LIMIT:.3g}); the softmax would meet inf - inf = NaN. Rescale q and k (or "
            "the scale) so that their products stay below 1e300, or subtract a constant from "
            "the bias")
    mv = _max_abs(call.v)
    z = call.dropout
    mz = 1.0 if z is None else (_max_abs(z) if isinstance(z, np.ndarray) else float(
        getattr(z, "keep_multiplier", 1.0)))
    if not max(1.0, mz) * mv <= LIMIT:
        raise RefAttnError(
            f"v: the output could overflow float64 (|output| <= max|Z| * max|v| = {mz:.3g} * "
            f"{mv:.3g}, above {LIMIT:.3g}); rescale v or the dropout multiplier")


def check_backward_overflow(call: Any, grad_output: np.ndarray) -> None:
    """Refuse a backward whose gradients could overflow float64, naming the first tensor.

    With ``g = max|G_O|``: ``|G_P| <= Dv g max|v| max(1, max|Z|)``, ``|G_S| <= 2 |G_P|``,
    ``|grad_v| <= Hq Q max(1, max|Z|) g``, ``|grad_q| <= alpha K |G_S| max|k|``,
    ``|grad_k| <= alpha Hq Q |G_S| max|q|`` (linear families) and
    ``|grad_bias| <= B Hq Q K |G_S|``.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn.call import AttentionCall
    >>> x = np.ones((1, 1, 2, 4))
    >>> check_backward_overflow(AttentionCall(x, x, x), np.ones((1, 1, 2, 4)))  # fine
    >>> try:
    ...     check_backward_overflow(AttentionCall(x, x, x), np.full((1, 1, 2, 4), 1e308))
    ... except RefAttnError as exc:
    ...     print(str(exc).split(" (")[0])
    grad_output: the gradient grad_probs could overflow float64
    """
    B, Hq, Q, K = call.score_shape
    Dv = call.v.shape[3]
    g = _max_abs(grad_output)
    z = call.dropout
    mz = max(1.0, 1.0 if z is None else (_max_abs(z) if isinstance(z, np.ndarray) else float(
        getattr(z, "keep_multiplier", 1.0))))
    alpha = max(1.0, float(call.scale))
    gp = Dv * g * _max_abs(call.v) * mz
    gs = 2.0 * gp
    bounds = [("grad_probs", gp), ("grad_scores", gs), ("grad_v", Hq * Q * mz * g)]
    if call.score.linear_in_operands:
        bounds += [("grad_q", alpha * K * gs * _max_abs(call.k)),
                   ("grad_k", alpha * Hq * Q * gs * _max_abs(call.q))]
    if call.bias is not None:
        bounds.append(("grad_bias", B * Hq * Q * K * gs))
    for name, bound in bounds:
        if not bound <= LIMIT:
            raise RefAttnError(
                f"grad_output: the gradient {name} could overflow float64 (bound {bound:.3g} "
                f"from max|grad_output| = {g:.3g}, above {LIMIT:.3g}); rescale grad_output")
