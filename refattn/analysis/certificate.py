"""A rounding certificate: check, independently, that stored tensors are correctly rounded.

Owns :func:`certify`. For every rounding point of the exact backend (``docs/EXACT_ROUNDING.md``)
it recomputes the defining real value from the *stored* canonical tensors before it, with other
means than the exact backend uses: rational points in exact Python integer arithmetic (every
binary64 is an integer multiple of 2**-1074; CPython's integer true division rounds correctly)
and transcendental points (exp, log, tanh, sqrt) in mpmath's interval arithmetic at a working
precision raised until the interval is narrow enough. A stored element passes when it is the
round-to-nearest-even value of its defining real value. ``refattn verify --exact`` runs it.

Hostile magnitudes stay cheap: an interval bound far outside binary64's range (``exp(s - lse)``
of logits near 1e38 is about ``2**-1e39``) is clamped to ``+-2**-1100`` or ``+-2**1025`` before
it becomes a :class:`~fractions.Fraction`, which leaves every comparison with a rounding
boundary unchanged (no boundary lies strictly inside those clamps) and decides underflow to
``+0.0`` and overflow to ``inf`` from the crude bound. Each element's precision loop is capped
(``_MAX_BITS``) and timed: past ``budget_s`` seconds it ends in a :class:`RefAttnError` naming
the tensor, the element and the budget, never in a pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from functools import partial
from time import monotonic
from typing import Any, cast

import numpy as np
from mpmath import iv

from refattn._checks import format_index
from refattn.call import AttentionCall
from refattn.call.placement import operand_multipliers
from refattn.call.scores import Additive, Bilinear, Cosine, ScoreFamily
from refattn.engine.reduce import gather_heads
from refattn.errors import RefAttnError

__all__ = ["DEFAULT_BUDGET_S", "Certificate", "PointCheck", "certify"]

_SCALE_BITS = 1074  # every finite binary64 is an integer multiple of 2**-1074
_START_BITS = 192  # three times binary64's 64-bit working margin
_MAX_BITS = 1 << 13
_TINY_EXP = -1100  # below every rounding boundary's magnitude (the least is 2**-1075)
_HUGE_EXP = 1025  # above every finite one's (the greatest is 2**1024 - 2**970)
DEFAULT_BUDGET_S = 60.0  # per transcendental element; a valid element takes milliseconds


@dataclass(frozen=True)
class PointCheck:
    """The verdict on one tensor: elements confirmed, and the first one that is not."""

    tensor: str
    checked: int
    failure: str | None = None

    @property
    def passed(self) -> bool:
        return self.failure is None


@dataclass(frozen=True)
class Certificate:
    """Every rounding point of one case checked (see :func:`certify`)."""

    checks: tuple[PointCheck, ...]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failures(self) -> tuple[PointCheck, ...]:
        return tuple(c for c in self.checks if not c.passed)


# -- exact rational arithmetic on python ints ---------------------------------------------------
def _ints(x: Any) -> np.ndarray:
    """binary64 array -> object array of ints ``x * 2**1074`` (exact)."""
    arr = np.asarray(x, dtype=np.float64)
    flat = []
    for v in arr.ravel().tolist():
        n, d = v.as_integer_ratio()
        flat.append(n * ((1 << _SCALE_BITS) // d))
    out = np.empty(len(flat), dtype=object)
    out[:] = flat
    return out.reshape(arr.shape)


def _rn(n: np.ndarray, factors: int) -> np.ndarray:
    """Correctly rounded binary64 of ``n * 2**(-1074 * factors)`` (int true division)."""
    div = 1 << (_SCALE_BITS * factors)
    flat = [v / div for v in np.asarray(n, dtype=object).ravel().tolist()]
    return np.array(flat, dtype=np.float64).reshape(np.shape(n))


def _isum(x: np.ndarray, axis: Any) -> np.ndarray:
    return np.add.reduce(x, axis=axis)  # an empty sum of object ints is 0


# -- interval arithmetic -----------------------------------------------------------------------
def _fraction(mpf_tuple: tuple) -> Fraction | None:
    """An interval bound as a Fraction, its magnitude clamped to [2**-1100, 2**1025].

    The clamp keeps the cost independent of the bound's exponent (``2**-1e39`` would be an
    integer of 1e39 bits) and changes no comparison with a rounding boundary: every boundary
    is 0-free and lies in ``[2**-1075, 2**1024 - 2**970]`` in magnitude. Infinities clamp to
    ``+-2**1025``; NaN gives None (undecidable).
    """
    sign, man, exp, bc = mpf_tuple
    if not man:
        if not bc:  # zero; mpmath's specials have man == 0 and bc != 0
            return Fraction(0)
        if bc == -1:  # nan
            return None
        value = Fraction(2) ** _HUGE_EXP  # +-inf
    else:
        top = int(exp) + int(bc)  # 2**(top-1) <= |value| < 2**top
        if top > _HUGE_EXP:
            value = Fraction(2) ** _HUGE_EXP
        elif top <= _TINY_EXP:
            value = Fraction(2) ** _TINY_EXP
        else:
            value = Fraction(int(man)) * (Fraction(2) ** int(exp))
    return -value if sign else value


def _bounds(x: Any) -> tuple[Fraction, Fraction] | None:
    lo, hi = (_fraction(b) for b in x._mpi_)
    return None if lo is None or hi is None else (lo, hi)


_OVERFLOW = (Fraction(2) ** 1024 + Fraction(2) ** 1024 - Fraction(2) ** 971) / 2  # to inf (tie too)


def _show(bound: Fraction) -> str:
    """A (clamped) bound for a message: a binary64 near it, or which side of the range it is."""
    if abs(bound) >= Fraction(2) ** _HUGE_EXP:
        return f"{'-' if bound < 0 else ''}2**1025 or beyond"
    if bound and abs(bound) <= Fraction(2) ** _TINY_EXP:
        return f"{'-' if bound < 0 else ''}2**-1100 or below"
    try:
        return f"{float(bound):.17g}"
    except OverflowError:  # at or past the overflow midpoint
        return f"{'-' if bound < 0 else ''}2**1024 - 2**970 or beyond"


def _neighbours(x: float) -> tuple[Fraction, Fraction]:
    """The rounding interval of binary64 ``x``: midpoints to its two neighbours.

    ``+-inf`` is the rounding of everything from the overflow midpoint on (a tie rounds to
    infinity: the greatest finite binary64 has an odd significand); its outer end is a value
    past every clamped bound.
    """
    if np.isinf(x):
        far = Fraction(2) ** (_HUGE_EXP + 1)
        return (_OVERFLOW, far) if x > 0 else (-far, -_OVERFLOW)
    with np.errstate(over="ignore"):  # max's neighbour is inf: the overflow midpoint below
        below, above = np.nextafter(x, -np.inf), np.nextafter(x, np.inf)
    fx = Fraction(x)
    a = (fx + Fraction(float(below))) / 2 if np.isfinite(below) else -_OVERFLOW
    b = (fx + Fraction(float(above))) / 2 if np.isfinite(above) else _OVERFLOW
    return a, b


def _rounds_to(x: float, lo: Fraction, hi: Fraction) -> bool | None:
    """True: every value in [lo, hi] rounds to x; False: none does; None: undecided."""
    if np.isnan(x):
        return False
    a, b = _neighbours(x)
    even = bool(np.isinf(x)) or (np.float64(x).view(np.int64) & 1) == 0
    inside_lo = lo > a or (lo == a and even)
    inside_hi = hi < b or (hi == b and even)
    if inside_lo and inside_hi:
        return True
    if hi < a or lo > b:
        return False
    return None


def _tanh(x: Any) -> Any:
    return 1 - 2 / (iv.exp(2 * x) + 1)  # x appears once: the enclosure is tight


# -- checks -----------------------------------------------------------------------------------
def _compare(name: str, stored: np.ndarray, want: np.ndarray, letters: str | None
             ) -> PointCheck:
    stored = np.asarray(stored, dtype=np.float64)
    bad = np.argwhere(~(stored == want))  # the exact value's rounding, element by element
    if bad.size:
        idx = tuple(int(i) for i in bad[0])
        return PointCheck(name, int(stored.size), (
            f"element {format_index(idx, letters)} is {stored[idx]!r}, the correctly rounded "
            f"value is {want[idx]!r} ({len(bad)} element(s) differ)"))
    return PointCheck(name, int(stored.size))


def _interval_check(name: str, stored: np.ndarray, value: Callable[[tuple[int, ...]], Any],
                    where: np.ndarray | None, letters: str | None, budget_s: float
                    ) -> PointCheck:
    """Check ``stored[idx] == RN(value(idx))`` with ``value`` evaluated in mpmath intervals.

    Each element's precision loop doubles from ``_START_BITS`` to at most ``_MAX_BITS`` and
    must end within ``budget_s`` seconds, else :class:`RefAttnError`.
    """
    stored = np.asarray(stored, dtype=np.float64)
    count = 0
    for idx in np.ndindex(*stored.shape):
        if where is not None and not where[idx]:
            continue
        count += 1
        bits, verdict, bounds = _START_BITS, None, None
        start = monotonic()
        while verdict is None and bits <= _MAX_BITS:
            saved, iv.prec = iv.prec, bits
            try:
                bounds = _bounds(value(idx))
            finally:
                iv.prec = saved
            if bounds is not None:
                verdict = _rounds_to(float(stored[idx]), *bounds)
            if verdict is None and monotonic() - start > budget_s:
                raise RefAttnError(
                    f"certificate: {name} element {format_index(idx, letters)} = "
                    f"{float(stored[idx])!r} was not decided within the time budget of "
                    f"{budget_s:g} s (at {bits} bits); it is not certified")
            bits *= 2
        if verdict is not True:
            what = "is not" if verdict is False else "could not be confirmed as"
            shown = "NaN" if bounds is None else (
                f"[{_show(bounds[0])}, {_show(bounds[1])}]")
            return PointCheck(name, count, (
                f"element {format_index(idx, letters)} = {float(stored[idx])!r} {what} the "
                f"correctly rounded value of its definition (interval {shown})"))
    return PointCheck(name, count)


def certify(call: AttentionCall, tensors: Mapping[str, np.ndarray], *,
            budget_s: float = DEFAULT_BUDGET_S) -> Certificate:
    """Check that every rounding point of ``tensors`` is correctly rounded (independently).

    Parameters
    ----------
    call : AttentionCall
        The call the tensors belong to (its inputs, policies and score family).
    tensors : mapping of str to ndarray
        The stored canonical tensors, forward and backward (``grad_output`` included).
    budget_s : float
        The time one transcendental element's precision loop may take. Its cost does not grow
        with the magnitude of the values (bounds outside binary64's range are decided from
        clamped bounds), so a valid element takes milliseconds.

    Returns
    -------
    Certificate
        One :class:`PointCheck` per rounding point present.

    Raises
    ------
    RefAttnError
        An element not decided within ``budget_s`` (naming the tensor, element and budget).

    Examples
    --------
    >>> import refattn
    >>> x = np.array([[[[0.1, 0.2], [0.3, 0.4]]]])
    >>> call = refattn.AttentionCall(x, x, x)
    >>> t = refattn.forward(call, backend="exact"); g = refattn.backward(t, np.ones_like(x))
    >>> cert = certify(call, {**t.tensors(), **g.tensors()})
    >>> cert.passed, len(cert.checks) > 10
    (True, True)
    >>> t2 = refattn.forward(call); g2 = refattn.backward(t2, np.ones_like(x))  # numpy's
    >>> certify(call, {**t2.tensors(), **g2.tensors()}).passed
    False
    """
    t = {n: np.asarray(a) for n, a in tensors.items()}
    icheck = partial(_interval_check, budget_s=float(budget_s))
    checks: list[PointCheck] = []
    hm, Hkv = cast(np.ndarray, call.head_map), call.k.shape[1]  # fields validation sets
    fam = cast(ScoreFamily, call.score)
    mult = operand_multipliers(cast(float, call.scale), call.scale_placement)
    k_eff, v_eff = gather_heads(call.k, hm), gather_heads(call.v, hm)
    q_s = call.q if mult.query == 1.0 else _rn(_ints(call.q) * _ints(mult.query), 2)
    k_s = k_eff if mult.key == 1.0 else _rn(_ints(k_eff) * _ints(mult.key), 2)
    vis = np.broadcast_to(np.isfinite(t["masked_scores"]), call.score_shape)
    qv = call.query_valid_full()

    # -- scores ------------------------------------------------------------------------------
    first = "softcap_input" if call.softcap is not None else "scores"
    post = _ints(mult.post)
    if fam.name in ("dot", "bilinear"):
        qi, ki = _ints(q_s), _ints(k_s)
        if fam.name == "dot":
            u, factors = qi @ ki.swapaxes(-1, -2), 2
        else:
            fW = cast(Bilinear, fam).W
            W = _ints(fW if fW.ndim == 2 else fW[None])
            u, factors = (qi @ W) @ ki.swapaxes(-1, -2), 3
        checks.append(_compare(first, t[first], _rn(u * post, factors + 1), "bhij"))
    else:
        checks.append(icheck(first, t[first], _score_value(fam, q_s, k_s, mult.post),
                                      None, "bhij"))
    if call.softcap is not None:
        c = call.softcap
        s_in = t["softcap_input"]
        checks.append(icheck(
            "scores", t["scores"], lambda i: iv.mpf(c) * _tanh(iv.mpf(float(s_in[i])) / c),
            None, "bhij"))
    if call.bias is not None:
        want = _rn(_ints(t["scores"]) + _ints(np.broadcast_to(call.bias, call.score_shape)), 1)
        checks.append(_compare("biased_scores", t["biased_scores"], want, "bhij"))

    # -- softmax -----------------------------------------------------------------------------
    s, lse = t["masked_scores"], t["lse"]
    sink = call.sink

    def lse_value(i: tuple[int, ...]) -> Any:
        total = iv.mpf(0)
        for j in np.flatnonzero(vis[i]):
            total += iv.exp(iv.mpf(float(s[i][j])))
        if sink is not None:
            total += iv.exp(iv.mpf(float(sink[i[1]])))
        return iv.log(total)

    checks.append(icheck("lse", lse, lse_value, None, "bhi"))
    probs = t["probs"]
    checks.append(icheck(
        "probs", probs, lambda i: iv.exp(iv.mpf(float(s[i])) - iv.mpf(float(lse[i[:3]]))),
        vis, "bhij"))
    if np.any(probs[~vis] != 0.0):
        checks.append(PointCheck("probs", int(probs.size), "nonzero probability off the "
                                 "support"))
    if sink is not None:
        checks.append(icheck(
            "sink_probs", t["sink_probs"],
            lambda i: iv.exp(iv.mpf(float(sink[i[1]])) - iv.mpf(float(lse[i]))), None, "bhi"))

    # -- value mixing and the backward's rational points ---------------------------------------
    z = np.broadcast_to(t["dropout_multiplier"], call.score_shape)
    consumed = t["consumed"]
    if call.dropout is not None:
        checks.append(_compare("consumed", consumed, _rn(_ints(probs) * _ints(z), 2), "bhij"))
    out = _rn(_ints(consumed) @ _ints(v_eff), 2)
    checks.append(_compare("output", t["output"], np.where(qv, out, 0.0), "bhid"))
    if "grad_output" not in t:
        return Certificate(tuple(checks))
    g_o = np.where(qv, t["grad_output"], 0.0)
    checks += _backward_checks(call, t, g_o, v_eff, q_s, k_s, z, mult, Hkv, icheck)
    return Certificate(tuple(checks))


def _score_value(fam: Any, q_s: np.ndarray, k_s: np.ndarray, post: float
                 ) -> Callable[[tuple[int, ...]], Any]:
    """The interval value of ``post * u`` for the additive and cosine families."""
    if fam.name == "additive":
        def additive(i: tuple[int, ...]) -> Any:
            b, h, qi, kj = i
            acc = iv.mpf(0)
            for a in range(fam.b.shape[1]):
                pre = iv.mpf(float(fam.b[h, a]))
                for d in range(q_s.shape[3]):
                    pre += iv.mpf(float(fam.Wq[h, a, d])) * float(q_s[b, h, qi, d])
                for d in range(k_s.shape[3]):
                    pre += iv.mpf(float(fam.Wk[h, a, d])) * float(k_s[b, h, kj, d])
                acc += iv.mpf(float(fam.v[h, a])) * _tanh(pre)
            return acc * post

        return additive

    def cosine(i: tuple[int, ...]) -> Any:
        b, h, qi, kj = i
        x, y = q_s[b, h, qi], k_s[b, h, kj]
        dot = sum((iv.mpf(float(p)) * float(r) for p, r in zip(x, y, strict=True)), iv.mpf(0))
        return dot * post / (_norm(x, fam.eps) * _norm(y, fam.eps))

    return cosine


def _norm(x: np.ndarray, eps: float) -> Any:
    """max(|x|, eps) as an interval, the clamp decided exactly."""
    sq = sum(Fraction(float(v)) ** 2 for v in x)
    if sq < Fraction(eps) ** 2:
        return iv.mpf(eps)
    return iv.sqrt(sum((iv.mpf(float(v)) ** 2 for v in x), iv.mpf(0)))


def _heads_int(x: np.ndarray, hm: np.ndarray, Hkv: int) -> np.ndarray:
    if np.array_equal(hm, np.arange(Hkv)):
        return x
    return np.stack([_isum(x[:, hm == g], axis=1) for g in range(Hkv)], axis=1)


def _backward_checks(call: AttentionCall, t: Mapping[str, np.ndarray], g_o: np.ndarray,
                     v_eff: np.ndarray, q_s: np.ndarray, k_s: np.ndarray, z: np.ndarray,
                     mult: Any, Hkv: int, icheck: Callable[..., PointCheck]
                     ) -> list[PointCheck]:
    hm, fam = cast(np.ndarray, call.head_map), cast(ScoreFamily, call.score)  # validated
    probs, consumed = t["probs"], t["consumed"]
    gi = _ints(g_o)
    checks = [
        _compare("grad_v", t["grad_v"],
                 _rn(_heads_int(_ints(consumed).swapaxes(-1, -2) @ gi, hm, Hkv), 2), "bhjd"),
        _compare("grad_consumed", t["grad_consumed"], _rn(gi @ _ints(v_eff).swapaxes(-1, -2), 2),
                 "bhij"),
    ]
    g_p = t["grad_probs"]
    if call.dropout is not None:
        checks.append(_compare("grad_probs", g_p, _rn(_ints(t["grad_consumed"]) * _ints(z), 2),
                               "bhij"))
    D = t["row_dot"]
    checks += [
        _compare("row_dot", D, _rn(_isum(_ints(probs) * _ints(g_p), -1), 2), "bhi"),
        _compare("row_dot_output", t["row_dot_output"],
                 _rn(_isum(gi * _ints(t["output"]), -1), 2), "bhi"),
        _compare("grad_scores", t["grad_scores"],
                 _rn(_ints(probs) * (_ints(g_p) - _ints(D)[..., None]), 2), "bhij"),
    ]
    g = t["grad_scores"]
    if call.softcap is not None:  # RN(G_S (c^2 - s^2) / c^2): one rational rounding
        c2 = Fraction(call.softcap) ** 2
        want = np.array([float(Fraction(gs) * (c2 - Fraction(sc) ** 2) / c2) for gs, sc in
                         zip(g.ravel().tolist(), t["scores"].ravel().tolist(), strict=True)]
                        ).reshape(g.shape)
        checks.append(_compare("grad_softcap_input", t["grad_softcap_input"], want, "bhij"))
        g = t["grad_softcap_input"]
    f_q, f_k = _ints(mult.query * mult.post), _ints(mult.key * mult.post)
    Gi = _ints(g)
    if fam.name == "dot":
        checks.append(_compare("grad_q", t["grad_q"], _rn((Gi @ _ints(k_s)) * f_q, 3), "bhid"))
        gk = _heads_int(Gi.swapaxes(-1, -2) @ _ints(q_s), hm, Hkv)
        checks.append(_compare("grad_k", t["grad_k"], _rn(gk * f_k, 3), "bhjd"))
    elif fam.name == "bilinear":
        fW = cast(Bilinear, fam).W
        W = _ints(fW if fW.ndim == 2 else fW[None])
        checks.append(_compare("grad_q", t["grad_q"], _rn(
            ((Gi @ _ints(k_s)) @ W.swapaxes(-1, -2)) * f_q, 4), "bhid"))
        gk = _heads_int(Gi.swapaxes(-1, -2) @ (_ints(q_s) @ W), hm, Hkv)
        checks.append(_compare("grad_k", t["grad_k"], _rn(gk * f_k, 4), "bhjd"))
        per = _ints(q_s).swapaxes(-1, -2) @ (Gi @ _ints(k_s))
        gw = _isum(per, (0, 1) if fW.ndim == 2 else 0) * _ints(mult.post)
        checks.append(_compare("grad_score_W", t["grad_score_W"], _rn(gw, 4), None))
    else:
        checks += _composite_family_checks(call, t, g, q_s, k_s, mult.post, icheck)
    if call.sink is not None:
        gs = -_isum(_ints(t["sink_probs"]) * _ints(D), (0, 2))
        checks.append(_compare("grad_sink", t["grad_sink"], _rn(gs, 2), "h"))
    if call.bias is not None:
        gb = _ints(t["grad_scores"])
        shape = call.bias.shape
        lead = gb.ndim - len(shape)
        if lead:
            gb = _isum(gb, tuple(range(lead)))
        axes = tuple(a for a, n in enumerate(shape) if n == 1 and gb.shape[a] != 1)
        if axes:
            gb = np.add.reduce(gb, axis=axes, keepdims=True)
        checks.append(_compare("grad_bias", t["grad_bias"], _rn(gb, 1), None))
    return checks


def _composite_family_checks(call: AttentionCall, t: Mapping[str, np.ndarray], g: np.ndarray,
                             q_s: np.ndarray, k_s: np.ndarray, post: float,
                             icheck: Callable[..., PointCheck]) -> list[PointCheck]:
    """grad_q, grad_k (and parameters) of the additive and cosine families, in intervals."""
    fam, hm = cast(ScoreFamily, call.score), cast(np.ndarray, call.head_map)  # validated
    B, _, Q, K = call.score_shape
    heads = [np.flatnonzero(hm == h_kv) for h_kv in range(call.k.shape[1])]

    if fam.name == "cosine":
        cos = cast(Cosine, fam)

        def unit_grad(x: np.ndarray, others: np.ndarray, grads: np.ndarray) -> list[Any]:
            """d/dx of sum_j g_j (x . y_j) / (n(x) n(y_j)), one interval per component."""
            n = _norm(x, cos.eps)
            clamped = sum(Fraction(float(v)) ** 2 for v in x) < Fraction(cos.eps) ** 2
            x_hat = [iv.mpf(float(v)) / n for v in x]
            g_hat = [iv.mpf(0)] * len(x)
            for y, gj in zip(others, grads, strict=True):
                ny = _norm(y, cos.eps)
                for d in range(len(x)):
                    g_hat[d] += iv.mpf(float(gj)) * float(y[d]) / ny
            if clamped:
                return [gd / n for gd in g_hat]
            radial = sum((gd * xd for gd, xd in zip(g_hat, x_hat, strict=True)), iv.mpf(0))
            return [(gd - xd * radial) / n for gd, xd in zip(g_hat, x_hat, strict=True)]

        def grad_q(i: tuple[int, ...]) -> Any:
            b, h, qi, d = i
            return unit_grad(q_s[b, h, qi], k_s[b, h], g[b, h, qi])[d] * post

        def grad_k(i: tuple[int, ...]) -> Any:
            b, hk, kj, d = i
            return sum((unit_grad(k_s[b, h, kj], q_s[b, h], g[b, h, :, kj])[d] * post
                        for h in heads[hk]), iv.mpf(0))

        return [icheck("grad_q", t["grad_q"], grad_q, None, "bhid"),
                icheck("grad_k", t["grad_k"], grad_k, None, "bhjd")]

    # additive: u = sum_a v_a tanh(pre_a), pre = Wq q_i + Wk k_j + b
    add = cast(Additive, fam)

    def pre(b: int, h: int, i: int, j: int, a: int) -> Any:
        acc = iv.mpf(float(add.b[h, a]))
        for d in range(q_s.shape[3]):
            acc += iv.mpf(float(add.Wq[h, a, d])) * float(q_s[b, h, i, d])
        for d in range(k_s.shape[3]):
            acc += iv.mpf(float(add.Wk[h, a, d])) * float(k_s[b, h, j, d])
        return acc

    def dpre(b: int, h: int, i: int, j: int, a: int) -> Any:  # G v_a (1 - tanh^2)
        th = _tanh(pre(b, h, i, j, a))
        return iv.mpf(float(g[b, h, i, j])) * float(add.v[h, a]) * (1 - th * th)

    Da = add.b.shape[1]

    def grad_q_add(i: tuple[int, ...]) -> Any:
        b, h, qi, d = i
        return sum((dpre(b, h, qi, j, a) * float(add.Wq[h, a, d])
                    for j in range(K) for a in range(Da)), iv.mpf(0)) * post

    def grad_k_add(i: tuple[int, ...]) -> Any:
        b, hk, kj, d = i
        return sum((dpre(b, h, qi, kj, a) * float(add.Wk[h, a, d]) for h in heads[hk].tolist()
                    for qi in range(Q) for a in range(Da)), iv.mpf(0)) * post

    def param(kind: str) -> Callable[[tuple[int, ...]], Any]:
        def value(i: tuple[int, ...]) -> Any:
            h, a = i[0], i[1]
            acc = iv.mpf(0)
            for b in range(B):
                for qi in range(Q):
                    for kj in range(K):
                        match kind:
                            case "v":
                                acc += iv.mpf(float(g[b, h, qi, kj])) * _tanh(
                                    pre(b, h, qi, kj, a))
                            case "b":
                                acc += dpre(b, h, qi, kj, a)
                            case "Wq":
                                acc += dpre(b, h, qi, kj, a) * float(q_s[b, h, qi, i[2]])
                            case "Wk":
                                acc += dpre(b, h, qi, kj, a) * float(k_s[b, h, kj, i[2]])
            return acc * post

        return value

    checks = [icheck("grad_q", t["grad_q"], grad_q_add, None, "bhid"),
              icheck("grad_k", t["grad_k"], grad_k_add, None, "bhjd")]
    for kind in ("Wq", "Wk", "b", "v"):
        name = f"grad_score_{kind}"
        checks.append(icheck(name, t[name], param(kind), None, None))
    return checks
