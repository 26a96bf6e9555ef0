"""The attention program over arb balls, with a rounding policy at every canonical tensor.

Owns the definitions of the exact backend's rounding points, once: each canonical tensor is a
real-number expression of the canonical tensors before it (``docs/EXACT_ROUNDING.md`` lists
them). A :class:`Rounding` policy decides what happens at each point:

- :class:`Stepwise` rounds it to the nearest binary64 (Ziv's loop, :func:`decide`): the exact
  backend's tensors, each the correctly rounded value of its step;
- :class:`Unrounded` keeps it as balls at a fixed high precision and feeds them on: the exact
  real-number result of the whole computation from the rounded inputs, against which the
  stepwise tensors' own error is measured.

Single IEEE operations of two binary64 numbers (``q * mq``, ``scores + bias``, ``P * Z``,
``G_Pdrop * Z``) are rounding points too; stepwise, numpy's IEEE arithmetic rounds them
correctly by itself.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import Any, Literal, cast

import numpy as np
from flint import arb, ctx

from refattn.call import AttentionCall
from refattn.call.placement import operand_multipliers
from refattn.call.scores import Additive, Bilinear, Cosine, ScoreFamily
from refattn.engine.exact import balls as B_
from refattn.engine.exact.algebraic import AdditiveExact, CosineExact
from refattn.engine.exact.balls import ZERO, balls, matmul, total
from refattn.engine.exact.rounding import Exact, decide, precision, rn_fraction
from refattn.engine.reduce import gather_heads
from refattn.errors import RefAttnError

__all__ = ["ROUNDING_POINTS", "Rounding", "Stepwise", "Unrounded", "backward_tensors",
           "forward_tensors"]

#: every rounding point: tensor -> its defining real value (RN = round to nearest, ties to
#: even, once). Notation: q_s = RN(mq q), k_s = RN(mk k_eff) with (mq, mk, post) the call's
#: operand multipliers (post = alpha for the "post" placement, else 1); G = grad_softcap_input
#: with a softcap, else grad_scores; f_q = mq post, f_k = mk post; h ~ g: the query heads of
#: kv head g. Sums are exact. docs/EXACT_ROUNDING.md explains each.
ROUNDING_POINTS: dict[str, str] = {
    "q_s, k_s": "RN(mq * q), RN(mk * k_eff) (operand shares of alpha; unchanged when 1)",
    "softcap_input": "RN(post * u) with a softcap (u the family's compatibility, exact)",
    "scores": "RN(post * u) without a softcap; RN(c * tanh(softcap_input / c)) with one",
    "biased_scores": "RN(scores + bias)",
    "masked_scores": "biased_scores on the support, -inf off it (no rounding)",
    "row_max": "max over the support of masked_scores (and the sink logit; no rounding)",
    "lse": "RN(log(sum_{j in support} exp(masked_scores_j) + exp(sink)))",
    "probs": "RN(exp(masked_scores_j - lse)) on the support, exactly 0 off it",
    "sink_probs": "RN(exp(sink - lse))",
    "consumed": "RN(probs * Z)",
    "output": "RN(sum_j consumed_j v_eff_j); exactly 0 where query_valid is False",
    "grad_v": "RN(sum_{h ~ g} sum_i consumed_i G_O_i), G_O zeroed where query_valid is False",
    "grad_consumed": "RN(sum_d G_O_d v_eff_d)",
    "grad_probs": "RN(grad_consumed * Z)",
    "row_dot": "RN(sum_j probs_j grad_probs_j)",
    "row_dot_output": "RN(sum_d G_O_d output_d)",
    "grad_scores": "RN(probs * (grad_probs - row_dot))",
    "grad_softcap_input": "RN(grad_scores * (c^2 - scores^2) / c^2)",
    "grad_q": "RN(f_q * sum_j G_j dU/dq_s) (dot: RN(f_q * sum_j G_j k_s_j))",
    "grad_k": "RN(f_k * sum_{h ~ g} sum_i G_i dU/dk_s) (dot: RN(f_k * sum G_i q_s_i))",
    "grad_bias": "RN(sum of grad_scores over the bias's broadcast axes)",
    "grad_sink": "RN(-sum_{b,i} sink_probs * row_dot)",
    "grad_score_<param>": "RN(post * sum over b, heads, i, j of G du/dparam)",
}

#: start precision (bits) of rounding points that are sums of products: exact for operands
#: whose exponents span less than about 100 binades; wider spans are refined by decide()
SUM_BITS = 256


class Rounding:
    """What happens at a rounding point (see :class:`Stepwise` and :class:`Unrounded`)."""

    zero: Any

    def point(self, name: str, evaluate: Callable[[], np.ndarray], *, letters: str | None = None,
              start: int = 128, exact: Exact | None = None) -> np.ndarray:
        raise NotImplementedError

    def ieee(self, op: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
        raise NotImplementedError


class Stepwise(Rounding):
    """Round every point to the nearest binary64: the exact backend's canonical tensors."""

    zero = 0.0

    def point(self, name: str, evaluate: Callable[[], np.ndarray], *, letters: str | None = None,
              start: int = 128, exact: Exact | None = None) -> np.ndarray:
        return decide(name, evaluate, letters=letters, start=start, exact=exact)

    def ieee(self, op: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
        return op(a, b)  # one IEEE operation of two binary64 arrays: correctly rounded


class Unrounded(Rounding):
    """Keep every point as balls at ``bits`` of precision: the whole computation, unrounded."""

    zero = ZERO

    def __init__(self, bits: int = 320) -> None:
        self.bits = bits

    def point(self, name: str, evaluate: Callable[[], np.ndarray], *, letters: str | None = None,
              start: int = 128, exact: Exact | None = None) -> np.ndarray:
        with precision(self.bits):
            return evaluate()

    def ieee(self, op: Callable[[Any, Any], Any], a: Any, b: Any) -> Any:
        with precision(self.bits):
            return op(balls(a), balls(b))


def _t(x: np.ndarray) -> np.ndarray:
    return x.swapaxes(-1, -2)


def _heads(x: np.ndarray, head_map: np.ndarray, Hkv: int) -> np.ndarray:
    """Sum balls (B, Hq, ...) over the query heads of each kv head -> (B, Hkv, ...), exactly."""
    if np.array_equal(head_map, np.arange(Hkv)):
        return x
    out = np.empty((x.shape[0], Hkv, *x.shape[2:]), dtype=object)
    for g in range(Hkv):
        out[:, g] = total(x[:, head_map == g], axis=1)
    return out


def _reduce_to(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Balls summed over the axes along which an array of ``shape`` broadcast to ``x``."""
    lead = x.ndim - len(shape)
    if lead:
        x = total(x, axis=tuple(range(lead)))
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and x.shape[a] != 1)
    return total(x, axis=axes, keepdims=True) if axes else x


def _norm_below(x: np.ndarray, eps: float) -> np.ndarray:
    """Exact ``|x_row| < eps`` for every row of ``x`` (..., D) -> bool (..., 1).

    Decided in rational arithmetic (``sum(x**2) < eps**2`` with nothing rounded), so the
    cosine family's zero-norm policy never depends on a working precision.
    """
    eps2 = Fraction(eps) ** 2
    rows = np.asarray(x, dtype=np.float64).reshape(-1, x.shape[-1]).tolist()
    below = [sum(Fraction(v) ** 2 for v in row) < eps2 for row in rows]
    return np.array(below, dtype=bool).reshape(*x.shape[:-1], 1)


class _Operands:
    """q, k and v of a call as the rounding points read them (operand shares of alpha applied)."""

    def __init__(self, call: AttentionCall, rounding: Rounding) -> None:
        self.call = call
        self.family = cast(ScoreFamily, call.score)  # validated: never None
        hm = cast(np.ndarray, call.head_map)  # validated: (Hq,) int64
        self.mult = operand_multipliers(cast(float, call.scale), call.scale_placement)
        k_eff = gather_heads(call.k, hm)  # (B, Hq, K, Dk)
        self.v_eff = gather_heads(call.v, hm)  # (B, Hq, K, Dv)
        # the placement's operand share: one rounded product per element, as the contract's
        # pre-scaled operands are binary64 tensors
        self.q_s = call.q if self.mult.query == 1.0 else rounding.ieee(np.multiply, call.q,
                                                                        self.mult.query)
        self.k_s = k_eff if self.mult.key == 1.0 else rounding.ieee(np.multiply, k_eff,
                                                                     self.mult.key)
        self._cache: dict[tuple[str, int], Any] = {}
        self._exact: dict[str, Any] = {}

    def exact(self) -> CosineExact | AdditiveExact | None:
        """The family's exact deciders (stepwise rounding only: the operands are binary64)."""
        if self.q_s.dtype == object or self.family.name not in ("cosine", "additive"):
            return None
        if "exact" not in self._exact:
            if self.family.name == "cosine":
                eps = cast(Cosine, self.family).eps
                self._exact["exact"] = CosineExact(
                    self.q_s, self.k_s, eps, _norm_below(self.q_s, eps),
                    _norm_below(self.k_s, eps))
            else:
                fam = cast(Additive, self.family)
                self._exact["exact"] = AdditiveExact(self.q_s, self.k_s, fam.Wq, fam.Wk, fam.b,
                                                     fam.v)
        return self._exact["exact"]

    def cached(self, key: str, build: Callable[[], Any]) -> Any:
        """``build()`` once per working precision (a Ziv round re-evaluates at a new one)."""
        slot = (key, ctx.prec)
        if slot not in self._cache:
            self._cache[slot] = build()
        return self._cache[slot]

    def scaled_compatibility(self) -> np.ndarray:
        """Balls of ``post * u`` (B, Hq, Q, K) for the call's score family."""
        match self.family.name:
            case "dot":
                u = matmul(self.q_s, _t(balls(self.k_s)))
            case "bilinear":
                u = matmul(matmul(self.q_s, self.metric()), _t(balls(self.k_s)))
            case "additive":
                v = cast(Additive, self.family).v
                u = self.tanh_sum(balls(v)[None, :, None, None, :], axis=-1)
            case "cosine":
                q_hat, _, _ = self.unit(self.q_s, "q")
                k_hat, _, _ = self.unit(self.k_s, "k")
                u = matmul(q_hat, _t(k_hat))
            case other:
                raise RefAttnError(f"score: the exact backend has no {other!r} family")
        return u if self.mult.post == 1.0 else u * arb(self.mult.post)

    def metric(self) -> np.ndarray:
        W = cast(Bilinear, self.family).W  # (Hq, Dq, Dk) or shared (Dq, Dk)
        return balls(W if W.ndim == 2 else W[None])

    def pre(self) -> np.ndarray:
        """Wq q_i + Wk k_j + b of the additive family, (B, Hq, Q, K, Da) (exact sums)."""
        def build() -> np.ndarray:
            fam = cast(Additive, self.family)  # Wq, Wk (Hq, Da, D)
            qt = matmul(self.q_s, _t(balls(fam.Wq))[None])  # (B, Hq, Q, Da)
            kt = matmul(self.k_s, _t(balls(fam.Wk))[None])  # (B, Hq, K, Da)
            pre = qt[:, :, :, None, :] + kt[:, :, None, :, :]
            return pre + balls(fam.b)[None, :, None, None, :]

        return self.cached("pre", build)

    def pair(self) -> tuple[np.ndarray, np.ndarray]:
        """tanh(pre) of the additive family as (base, rest), (B, Hq, Q, K, Da) each.

        ``base`` is the exact sign of pre (1, -1, or 0 where the ball holds 0) and ``rest``
        ``tanh(pre) - base`` (``-2 / (exp(2 pre) + 1)`` for pre > 0), a relative enclosure
        however large ``|pre|`` is: sums of tanh that cancel to a tiny value are then
        decided, where tanh(pre) = 1 - tiny would bury it under the ball's radius.
        """
        def build() -> tuple[np.ndarray, np.ndarray]:
            pre = self.pre()
            base = np.empty(pre.shape, dtype=object)
            rest = np.empty(pre.shape, dtype=object)
            for i, x in np.ndenumerate(pre):
                if x > 0:
                    base[i], rest[i] = arb(1), -2 / ((2 * x).exp() + 1)
                elif x < 0:
                    base[i], rest[i] = arb(-1), 2 / ((-2 * x).exp() + 1)
                else:
                    base[i], rest[i] = ZERO, x.tanh()
            return base, rest

        return self.cached("pair", build)

    def tanh_sum(self, coef: np.ndarray, axis: int | tuple[int, ...]) -> np.ndarray:
        """``sum coef * tanh(pre)`` over ``axis``: the exact part first, then the rest."""
        base, rest = self.pair()
        return total(coef * base, axis=axis) + total(coef * rest, axis=axis)

    def pair_slope(self) -> np.ndarray:
        """1 - tanh(pre)**2 as sech(pre)**2 (an enclosure as tight for large |pre| as for
        small: 1 - t * t would cancel every bit), (B, Hq, Q, K, Da)."""
        return self.cached("pair_slope", lambda: B_.sech2(self.pre()))

    def unit(self, x: np.ndarray, which: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(x / n, n, clamped) with n = max(|x|, eps) per row, n of shape (..., 1)."""
        eps = cast(Cosine, self.family).eps

        def build() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            clamped = _norm_below(np.asarray(x, dtype=np.float64) if x.dtype != object
                                  else np.vectorize(lambda b: float(b.mid()))(x), eps)
            xb = balls(x)
            n = np.where(clamped, _obj(arb(eps)), B_.sqrt(total(xb * xb, axis=-1,
                                                                 keepdims=True)))
            return xb / n, n, clamped

        return self.cached(f"unit_{which}", build)


# -- forward ----------------------------------------------------------------------------------
def forward_tensors(call: AttentionCall, rounding: Rounding) -> dict[str, Any]:
    """Every forward tensor of ``call`` under ``rounding`` (Trace field names).

    Examples
    --------
    >>> import numpy as np, refattn
    >>> x = np.array([[[[0.5, -1.0], [2.0, 0.25]]]])
    >>> t = forward_tensors(refattn.AttentionCall(x, x, x), Stepwise())
    >>> t["probs"].sum(-1).round(15).tolist()
    [[[1.0, 1.0]]]
    """
    ops = _Operands(call, rounding)
    Bn, Hq, Q, K = call.score_shape
    full = (Bn, Hq, Q, K)
    first = "softcap_input" if call.softcap is not None else "scores"
    family_exact = ops.exact()  # cosine and additive values can sit on a boundary; dot and
    # bilinear ones are dyadic sums, exact balls at a sufficient precision
    scores = rounding.point(first, ops.scaled_compatibility, letters="bhij", start=SUM_BITS,
                            exact=None if family_exact is None
                            else family_exact.scores(ops.mult.post, full))
    out: dict[str, Any] = {}
    if call.softcap is not None:  # scores = c * tanh(softcap_input / c)
        out["softcap_input"] = softcap_input = scores
        c = arb(call.softcap)
        scores = rounding.point("scores", lambda: c * B_.tanh(balls(softcap_input) / c),
                                letters="bhij")
    biased = scores if call.bias is None else rounding.ieee(np.add, scores, call.bias)

    vis = call.visible_full()
    sanitized = call.sanitized_rows()  # (B, Hq, Q) rows given key 0 (never with a sink)
    if sanitized.any():
        vis = vis.copy()
        vis[..., 0] |= sanitized  # temporary legal key 0 for unused rows (the policy's rule)
    legal = np.where(vis, biased, rounding.zero)  # the support's scores, stand-ins off it
    if isinstance(rounding, Stepwise):
        masked = np.where(vis, biased, -np.inf)  # (B, Hq, Q, K)
        row_max = masked.max(axis=-1)  # (B, Hq, Q): exact
    else:
        masked = legal
        row_max = np.vectorize(lambda b: float(b.mid()), otypes=[float])(legal).max(axis=-1)
    sink_row = None
    if call.sink is not None:
        sink_row = np.broadcast_to(call.sink[None, :, None], (Bn, Hq, Q))
        row_max = np.maximum(row_max, sink_row)

    def lse_balls() -> np.ndarray:  # log(sum_legal exp(s_j) [+ exp(sink)]), shifted by m
        m = balls(row_max)
        if not isinstance(rounding, Stepwise):
            e = np.where(vis, B_.exp(balls(legal) - m[..., None]), _obj(ZERO))
            denom = total(e, axis=-1)
            if sink_row is not None:
                denom = denom + B_.exp(balls(sink_row) - m)
            return m + B_.log(denom)
        # m + log1p(sum of the terms but one maximal term): each term exp(s - m) < 1 keeps a
        # relative enclosure, so lse = 0 + (a tiny positive) is decided (+0 or its value)
        # where log(1 + tiny) would straddle 0 at every precision
        top = vis & (legal == row_max[..., None])  # terms exactly 1
        ones = top.sum(axis=-1) - 1  # (B, Hq, Q): the terms exactly 1 but one, an integer
        if sink_row is not None:
            ones = ones + (sink_row == row_max)
        # the integer first, exactly; then the terms below 1 (their sum keeps its relative
        # enclosure when the integer is 0: adding -1 and +1 around them would not)
        e = np.where(vis & ~top, B_.exp(balls(legal) - m[..., None]), _obj(ZERO))
        rest = balls(ones.astype(np.float64)) + total(e, axis=-1)
        if sink_row is not None:
            rest = rest + np.where(sink_row == row_max, _obj(ZERO), B_.exp(balls(sink_row) - m))
        return m + B_.log1p(rest)

    lse = rounding.point("lse", lse_balls, letters="bhi")
    probs = rounding.point(
        "probs", lambda: np.where(vis, B_.exp(balls(legal) - balls(lse)[..., None]), _obj(ZERO)),
        letters="bhij")
    if sink_row is not None:
        out["sink_probs"] = rounding.point(
            "sink_probs", lambda: B_.exp(balls(sink_row) - balls(lse)), letters="bhi")
    z_in = call.multiplier_full()
    if z_in is None:
        z = np.broadcast_to(np.float64(1.0), full)
        consumed = probs
    else:
        z = np.ascontiguousarray(z_in)
        consumed = rounding.ieee(np.multiply, probs, z)
    output = rounding.point("output", lambda: matmul(consumed, balls(ops.v_eff)),
                            letters="bhid", start=SUM_BITS)
    output = np.where(call.query_valid_full(), output, rounding.zero)  # unused rows: zero
    return {**out, "scores": scores, "biased_scores": biased, "masked_scores": masked,
            "row_max": row_max, "lse": lse, "probs": probs, "dropout_multiplier": z,
            "consumed": consumed, "output": output, "sanitized_rows": sanitized}


# -- backward ---------------------------------------------------------------------------------
def backward_tensors(call: AttentionCall, fwd: dict[str, Any], grad_output: np.ndarray,
                     rounding: Rounding) -> dict[str, Any]:
    """Every gradient tensor (Gradients field names) from the forward tensors ``fwd``.

    Examples
    --------
    >>> import numpy as np, refattn
    >>> x = np.array([[[[0.5, -1.0], [2.0, 0.25]]]])
    >>> call = refattn.AttentionCall(x, x, x)
    >>> f = forward_tensors(call, Stepwise())
    >>> g = backward_tensors(call, f, np.ones_like(x), Stepwise())
    >>> bool(np.allclose(g["row_dot"], g["row_dot_output"], rtol=1e-15))
    True
    """
    ops = _Operands(call, rounding)
    Hkv = call.k.shape[1]
    hm = cast(np.ndarray, call.head_map)  # validated: (Hq,) int64
    g_o = np.where(call.query_valid_full(), grad_output, 0.0)  # unused rows consume nothing
    probs, z, consumed = fwd["probs"], fwd["dropout_multiplier"], fwd["consumed"]
    point = rounding.point

    grad_v = point("grad_v", lambda: _heads(matmul(_t(balls(consumed)), balls(g_o)), hm, Hkv),
                   letters="bhjd", start=SUM_BITS)
    grad_consumed = point("grad_consumed", lambda: matmul(g_o, _t(balls(ops.v_eff))),
                          letters="bhij", start=SUM_BITS)
    grad_probs = (grad_consumed if call.dropout is None
                  else rounding.ieee(np.multiply, grad_consumed, z))
    row_dot = point("row_dot", lambda: total(balls(probs) * balls(grad_probs), axis=-1),
                    letters="bhi", start=SUM_BITS)
    row_dot_output = point("row_dot_output",
                           lambda: total(balls(g_o) * balls(fwd["output"]), axis=-1),
                           letters="bhi", start=SUM_BITS)
    grad_scores = point("grad_scores",
                        lambda: balls(probs) * (balls(grad_probs) - balls(row_dot)[..., None]),
                        letters="bhij", start=SUM_BITS)
    out: dict[str, Any] = {}
    grad_scaled = grad_scores  # d loss / d (post * u)
    if call.softcap is not None:  # G_S (c^2 - s^2) / c^2 = G_S (1 - tanh^2), s the scores
        cap = call.softcap

        def softcap_grad() -> np.ndarray:  # c^2 at the working precision: exact from 106 bits
            c2 = arb(cap) ** 2
            return balls(grad_scores) * (c2 - balls(fwd["scores"]) ** 2) / c2

        def softcap_grad_exact(idx: list[int]) -> list[float | None]:  # a rational quotient
            c2 = Fraction(cap) ** 2
            g_s, s = np.ravel(grad_scores), np.ravel(fwd["scores"])
            return [rn_fraction(Fraction(g_s[i]) * (c2 - Fraction(s[i]) ** 2) / c2) for i in idx]

        grad_scaled = point("grad_softcap_input", softcap_grad, letters="bhij", start=SUM_BITS,
                            exact=softcap_grad_exact)
        out["grad_softcap_input"] = grad_scaled
    out.update(_family_backward(ops, balls(grad_scaled), Hkv, point))
    if call.sink is not None:  # -sum_{b,i} sink_probs * D, per head
        out["grad_sink"] = point(
            "grad_sink", lambda: -total(balls(fwd["sink_probs"]) * balls(row_dot), axis=(0, 2)),
            letters="h", start=SUM_BITS)
    grad_bias = None
    if call.bias is not None:
        bias_shape = call.bias.shape
        grad_bias = point("grad_bias", lambda: _reduce_to(balls(grad_scores), bias_shape),
                          start=SUM_BITS)
    return {**out, "grad_output": grad_output, "grad_v": grad_v, "grad_consumed": grad_consumed,
            "grad_probs": grad_probs, "row_dot": row_dot, "row_dot_output": row_dot_output,
            "grad_scores": grad_scores, "grad_bias": grad_bias}


def _obj(x: Any) -> np.ndarray:
    """A ball (or any object) as the 0-d object array numpy's ``where`` makes of it."""
    return np.asarray(x, dtype=object)


def _family_backward(ops: _Operands, gb: np.ndarray, Hkv: int,
                     point: Callable[..., np.ndarray]) -> dict[str, Any]:
    """grad_q, grad_k and the family's parameter gradients from G = d loss / d (post * u)."""
    fam, mult, hm = ops.family, ops.mult, cast(np.ndarray, ops.call.head_map)
    f_q, f_k = arb(mult.query * mult.post), arb(mult.key * mult.post)  # one factor is 1: exact
    post = arb(mult.post)
    q_b, k_b = balls(ops.q_s), balls(ops.k_s)
    out: dict[str, Any] = {}
    fx = ops.exact()  # exact deciders of the cosine and additive points (stepwise only)
    G = gb if fx is None else np.vectorize(lambda x: float(x.mid()), otypes=[float])(gb)
    Bn, Hq, Q, K = G.shape
    shape_q = (Bn, Hq, Q, ops.call.q.shape[3])
    shape_k = (Bn, Hkv, K, ops.call.k.shape[3])
    match fam.name:
        case "dot":
            g_q = lambda: matmul(gb, k_b)  # noqa: E731  (B, Hq, Q, Dk)
            g_k = lambda: _heads(matmul(_t(gb), q_b), hm, Hkv)  # noqa: E731
        case "bilinear":
            W = ops.metric()
            g_q = lambda: matmul(matmul(gb, k_b), _t(W))  # noqa: E731
            g_k = lambda: _heads(matmul(_t(gb), matmul(q_b, W)), hm, Hkv)  # noqa: E731
            axes = (0, 1) if cast(Bilinear, fam).W.ndim == 2 else 0  # over b (and shared heads)
            out["grad_score_params"] = {"W": point(
                "grad_score_W", lambda: total(matmul(_t(q_b), matmul(gb, k_b)), axis=axes) * post,
                start=SUM_BITS)}
        case "additive":
            add = cast(Additive, fam)

            def pre_grad() -> np.ndarray:  # G (1 - t^2) v, (B, Hq, Q, K, Da)
                def build() -> np.ndarray:
                    return gb[..., None] * ops.pair_slope() * balls(add.v)[None, :, None, None]

                return ops.cached("pre_grad", build)

            g_q = lambda: matmul(total(pre_grad(), axis=3), balls(add.Wq)[None])  # noqa: E731
            g_k = lambda: _heads(matmul(total(pre_grad(), axis=2), balls(add.Wk)[None]),  # noqa: E731
                                 hm, Hkv)
            def param(which: Literal["Wq", "Wk", "b", "v"]) -> Exact | None:
                if not isinstance(fx, AdditiveExact):
                    return None
                return fx.grad_param(which, G, mult.post, getattr(fam, which).shape)

            out["grad_score_params"] = {
                "Wq": point("grad_score_Wq", lambda: total(
                    matmul(_t(total(pre_grad(), axis=3)), q_b), axis=0) * post, start=SUM_BITS,
                    exact=param("Wq")),
                "Wk": point("grad_score_Wk", lambda: total(
                    matmul(_t(total(pre_grad(), axis=2)), k_b), axis=0) * post, start=SUM_BITS,
                    exact=param("Wk")),
                "b": point("grad_score_b", lambda: total(pre_grad(), axis=(0, 2, 3)) * post,
                           start=SUM_BITS, exact=param("b")),
                "v": point("grad_score_v", lambda: ops.tanh_sum(gb[..., None], axis=(0, 2, 3))
                           * post, start=SUM_BITS,
                           exact=param("v")),
            }
        case "cosine":
            def unit_backward(g_hat: np.ndarray, which: str, x: np.ndarray) -> np.ndarray:
                x_hat, n, clamped = ops.unit(x, which)  # clamped rows are linear: x / eps
                radial = total(g_hat * x_hat, axis=-1, keepdims=True)
                return np.where(clamped, g_hat, g_hat - x_hat * radial) / n

            g_q = lambda: unit_backward(matmul(gb, ops.unit(ops.k_s, "k")[0]), "q",  # noqa: E731
                                        ops.q_s)
            g_k = lambda: _heads(unit_backward(  # noqa: E731
                matmul(_t(gb), ops.unit(ops.q_s, "q")[0]), "k", ops.k_s), hm, Hkv)
        case other:
            raise RefAttnError(f"score: the exact backend has no {other!r} family")
    out["grad_q"] = point("grad_q", lambda: g_q() * f_q, letters="bhid", start=SUM_BITS,
                          exact=None if fx is None
                          else fx.grad_q(G, mult.query * mult.post, shape_q))
    out["grad_k"] = point("grad_k", lambda: g_k() * f_k, letters="bhjd", start=SUM_BITS,
                          exact=None if fx is None
                          else fx.grad_k(G, mult.key * mult.post, hm, shape_k))
    return out
