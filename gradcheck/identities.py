"""Exact structural identities of attention's backward: a second opinion without differencing.

Owns :func:`attention_identities`: each identity holds exactly in real arithmetic, so its
residual is compared with a rounding bound built from the magnitudes of the terms involved
(``ulps * eps * sum |terms|``), or with zero where the arithmetic itself is exact (zero G_O,
masked entries, power-of-two scaling, a repeated run). Defers the backward to the trace's
backend (or a given ``backward``) and the tolerance-free softmax Jacobian to a complex step.

Identities (S = scores = alpha Q K^T without bias, P = probs, Z = multiplier):

- ``row_sum_grad_scores``: sum_j G_S[i, j] = 0 on every row (= D_i * sink_prob_i with a sink).
- ``key_sum_grad_k``: sum_j G_K[j] = 0 (a constant key shift is invisible; with a sink it
  equals alpha sum_i D_i sink_prob_i q_i). Dot scores without softcap only.
- ``euler_q_k_s``: <G_Q, Q> = <G_K, K> = <G_S, S> (scores are bilinear in q and k; with a
  softcap, G_S and S are taken before the cap). Dot scores only.
- ``value_output``: <G_V, V> = <G_O, O> (the output is linear in v).
- ``bias_reduction``: grad_bias has the bias's shape and is G_S summed over its broadcast axes.
- ``linearity``: backward(2 G_O) = 2 backward(G_O) bit for bit; backward(G_O + G) =
  backward(G_O) + backward(G) within rounding.
- ``zero_grad_output``: G_O = 0 gives exact zeros everywhere.
- ``masked_and_unused_zero``: masked entries, unused query rows and all-dropped rows have
  exactly zero P (masked), G_S and output.
- ``repeat_bitwise``: running the backward again reproduces every bit.
- ``softmax_jacobian``: on sampled rows the softmax Jacobian (by complex step) is symmetric,
  positive semi-definite, has J 1 = 0 (= p * sink_prob with a sink), and G_S = J G_P.

An identity that does not hold for the call's configuration (another score family) is
listed as not applicable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np

from gradcheck.attention import _filled, rounding_scales
from gradcheck.directional import stream
from gradcheck.methods import CS_STEP, EPS
from gradcheck.report import error_ratio
from refattn._boundary import public, shown
from refattn._checks import format_index
from refattn.engine import backward as reference_backward
from refattn.engine import forward
from refattn.engine.reduce import gather_heads, reduce_to_shape, sum_heads
from refattn.engine.trace import Gradients, Trace
from refattn.errors import RefAttnError

__all__ = ["IdentityCheck", "IdentityReport", "attention_identities"]

Backward = Callable[[Trace, np.ndarray], Gradients]
GRAD_TENSORS = ("grad_q", "grad_k", "grad_v", "grad_bias", "grad_scores")


@dataclass(frozen=True)
class IdentityCheck:
    """One identity's outcome.

    Attributes
    ----------
    name : str
    passed : bool
    ratio : float
        Worst residual over its tolerance (an exact identity uses tolerance 0 and reports
        ratio 0 when exact, inf otherwise).
    residual, tolerance : float
        At the worst place.
    where : str
        The worst place (index, tensor or row).
    detail : str
        What was checked, in words.
    """

    name: str
    passed: bool
    ratio: float
    residual: float
    tolerance: float
    where: str
    detail: str
    applicable: bool = True


def _not_applicable(name: str, why: str) -> IdentityCheck:
    return IdentityCheck(name, True, 0.0, 0.0, 0.0, "-", f"not applicable: {why}", False)


@dataclass(frozen=True, eq=False)
class IdentityReport:
    """Every identity's :class:`IdentityCheck`; ``str()`` is a table."""

    checks: tuple[IdentityCheck, ...]

    @property
    def passed(self) -> bool:
        """All identities hold."""
        return all(c.passed for c in self.checks)

    @property
    def failed(self) -> list[str]:
        """Names of the identities that do not hold."""
        return [c.name for c in self.checks if not c.passed]

    def __getitem__(self, name: str) -> IdentityCheck:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)

    def __str__(self) -> str:
        head = "PASSED" if self.passed else f"FAILED ({', '.join(self.failed)})"
        rows = [(c.name, ("ok" if c.applicable else "n/a") if c.passed else "FAIL",
                 f"{c.ratio:.3g}", f"{c.residual:.3g}",
                 f"{c.tolerance:.3g}", c.where, c.detail) for c in self.checks]
        cols = ("identity", "", "res/tol", "residual", "tolerance", "worst at", "checks")
        widths = [max(len(cols[i]), *(len(r[i]) for r in rows)) for i in range(len(cols))]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        return "\n".join([f"attention identities {head}", fmt.format(*cols).rstrip()]
                         + [fmt.format(*r).rstrip() for r in rows])


def _worst(name: str, residual: np.ndarray, tol: np.ndarray | float, letters: str | None,
           detail: str) -> IdentityCheck:
    """Compare residual <= tol elementwise (tol 0 demands exact zero)."""
    residual = np.abs(np.asarray(residual, dtype=np.float64))
    tol = np.broadcast_to(np.asarray(tol, dtype=np.float64), residual.shape)
    if residual.size == 0:
        return IdentityCheck(name, True, 0.0, 0.0, 0.0, "-", detail)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = error_ratio(residual, tol)
    k = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    where = format_index(k, letters) if ratio.ndim else "-"
    r = float(ratio[k])
    return IdentityCheck(name, r <= 1.0, r, float(residual[k]), float(tol[k]), where, detail)


def _exact(name: str, arrays: dict[str, np.ndarray], detail: str) -> IdentityCheck:
    """Every listed array must be exactly zero."""
    worst, where = 0.0, "-"
    for label, a in arrays.items():
        bad = np.flatnonzero(a != 0)
        if bad.size and float(np.max(np.abs(a))) > worst:
            worst = float(np.max(np.abs(a)))
            idx = np.unravel_index(int(bad[0]), a.shape)
            where = f"{label}{format_index(idx)} ({bad.size} nonzero)"
    return IdentityCheck(name, worst == 0.0, 0.0 if worst == 0 else np.inf, worst, 0.0,
                         where, detail)


@public
def attention_identities(
    trace: Trace,
    grads: Gradients,
    *,
    backward: Backward | None = None,
    seed: int = 0,
    max_rows: int = 64,
    ulps: float = 64.0,
) -> IdentityReport:
    """Check the exact structure of attention's backward on one trace.

    Parameters
    ----------
    trace : Trace
        A forward trace with materialised probabilities (the reference backend's).
    grads : Gradients
        The backward of ``trace`` to check (from ``backward``).
    backward : callable, optional
        ``backward(trace, grad_output) -> Gradients``, run again for the linearity, zero and
        repeat identities; default :func:`refattn.backward`.
    seed : int
        Draws the second cotangent of the additivity check.
    max_rows : int
        Rows sampled (evenly) for the softmax-Jacobian identity.
    ulps : float
        Rounding allowance in units of ``eps * sum |terms|``.

    Returns
    -------
    IdentityReport

    Examples
    --------
    >>> import refattn
    >>> from refattn.bundle.suites.contract import LOOP6_GRAD_OUTPUT, loop6_call
    >>> t = refattn.forward(loop6_call())
    >>> report = attention_identities(t, refattn.backward(t, LOOP6_GRAD_OUTPUT))
    >>> report.passed, len(report.checks)
    (True, 9)
    """
    if not isinstance(trace, Trace):
        raise RefAttnError(f"trace: expected a Trace, got {type(trace).__name__}")
    if not isinstance(grads, Gradients):
        raise RefAttnError(f"grads: expected Gradients, got {type(grads).__name__}")
    if seed < 0 or not 1 <= max_rows <= 2**20 or not 1.0 <= ulps <= 2.0**40:
        raise RefAttnError(f"seed, max_rows, ulps: expected seed >= 0, max_rows in [1, 2**20] "
                           f"and ulps in [1, 2**40], got {seed}, {shown(max_rows)}, {ulps!r}")
    if trace.probs is None or trace.scores is None:
        trace = forward(trace.call)  # a streaming trace: materialise the reference
    bw = reference_backward if backward is None else backward
    call = trace.call
    B, Hq, Q, _ = call.q.shape
    Hkv, K = call.k.shape[1], call.k.shape[2]
    alpha = cast(float, call.scale)  # validated: never None
    hm = cast(np.ndarray, call.head_map)  # validated: (Hq,) int64
    P, Z = _filled(trace.probs, "probs"), _filled(trace.dropout_multiplier, "dropout_multiplier")
    S, out = _filled(trace.scores, "scores"), trace.output
    consumed = _filled(trace.consumed, "consumed")
    G_O = grads.grad_output
    qv = np.broadcast_to(call.query_valid_full()[..., 0], (B, Hq, Q))  # (B, Hq, Q) consumed
    g_o = np.where(call.query_valid_full(), G_O, 0.0)  # (B, Hq, Q, Dv) what the call consumes
    k_eff = gather_heads(call.k, hm)  # (B, Hq, K, Dk)
    v_eff = gather_heads(call.v, hm)  # (B, Hq, K, Dv)
    G_S = _filled(grads.grad_scores, "grad_scores")
    G_P = grads.grad_probs if grads.grad_probs is not None else (g_o @ v_eff.swapaxes(-1, -2)) * Z
    D = grads.row_dot  # (B, Hq, Q)
    checks: list[IdentityCheck] = []
    rows = "bhi"
    family = getattr(call, "score", None)
    dot = family is None or getattr(family, "name", "dot") == "dot"
    softcap = getattr(call, "softcap", None)
    sink_probs = getattr(trace, "sink_probs", None)
    # with a sink the row's key probabilities sum to 1 - sink_prob: sum_j G_S = D * sink_prob
    expected = np.zeros_like(D) if sink_probs is None else D * sink_probs  # (B, Hq, Q)

    # row magnitude of G_S = P (G_P - D): the rounding scale of its row sum
    m = (P * (np.abs(G_P) + np.abs(D)[..., None])).sum(-1) + np.abs(expected)  # (B, Hq, Q)
    what = "sum_j G_S[i, j] = 0" if sink_probs is None else "sum_j G_S[i, j] = D_i sink_i"
    checks.append(_worst("row_sum_grad_scores", G_S.sum(-1) - expected, ulps * EPS * m, rows,
                         f"{what} on every row"))

    if dot and softcap is None:
        # key sum of G_K: alpha sum_i (row sum of G_S) q_i, plus rounding of the products
        want_h = alpha * (expected[..., None] * call.q).sum(axis=2)  # (B, Hq, Dk)
        want = sum_heads(want_h[:, :, None, :], hm, Hkv)[:, :, 0, :]  # (B, Hkv, Dk)
        per_head = alpha * ((np.abs(G_S).sum(-1) + m)[..., None] * np.abs(call.q)).sum(axis=2)
        bound = sum_heads(per_head[:, :, None, :], hm, Hkv)[:, :, 0, :]
        checks.append(_worst("key_sum_grad_k", grads.grad_k.sum(axis=2) - want,
                             ulps * EPS * bound, "bgd",
                             "sum_j G_K[j] = 0 (a constant key shift does not change the "
                             "output)" if sink_probs is None else
                             "sum_j G_K[j] = alpha sum_i D_i sink_i q_i"))
    else:
        checks.append(_not_applicable("key_sum_grad_k", "a softcap or a non-dot score family"))

    if dot:
        # Euler: every contraction equals sum_ij G_S S (before a softcap); rounding scale
        # alpha sum |G_S| |q||k|
        g_e = G_S if softcap is None else _filled(grads.grad_softcap_input, "grad_softcap_input")
        s_e = S if softcap is None else _filled(trace.softcap_input, "softcap_input")
        scale = alpha * float(
            (np.abs(g_e) * (np.abs(call.q) @ np.abs(k_eff).swapaxes(-1, -2))).sum())
        gs_s = float((g_e * s_e).sum())
        gq_q = float((grads.grad_q * call.q).sum())
        gk_k = float((grads.grad_k * call.k).sum())
        res = np.array([abs(gq_q - gs_s), abs(gk_k - gs_s)])
        c = _worst("euler_q_k_s", res, ulps * EPS * scale, None,
                   f"<G_Q,Q> = <G_K,K> = <G_S,S> (here {gq_q:.10g}, {gk_k:.10g}, {gs_s:.10g})")
        where = "<G_Q,Q>" if res[0] >= res[1] else "<G_K,K>"
        checks.append(IdentityCheck(c.name, c.passed, c.ratio, c.residual, c.tolerance, where,
                                    c.detail))
    else:
        checks.append(_not_applicable("euler_q_k_s",
                                      f"the {getattr(family, 'name', '?')} score family"))

    # <G_V, V> = <G_O, O>
    bound_v = float((np.abs(consumed) * (np.abs(g_o) @ np.abs(v_eff).swapaxes(-1, -2))).sum())
    gv_v = float((grads.grad_v * call.v).sum())
    go_o = float((G_O * out).sum())
    checks.append(_worst("value_output", np.array(abs(gv_v - go_o)), ulps * EPS * bound_v, None,
                         f"<G_V,V> = <G_O,O> (here {gv_v:.10g}, {go_o:.10g})"))

    # bias: shape, and the broadcast reduction of G_S
    if call.bias is not None:
        gb = grads.grad_bias
        if gb is None or np.shape(gb) != call.bias.shape:
            got = None if gb is None else tuple(np.shape(gb))
            checks.append(IdentityCheck(
                "bias_reduction", False, np.inf, np.inf, 0.0, f"shape {got}",
                f"grad_bias must have the bias's shape {call.bias.shape} (got {got}): "
                "G_S summed over the broadcast axes"))
        else:
            want = reduce_to_shape(G_S, call.bias.shape)
            tol = ulps * EPS * reduce_to_shape(np.abs(G_S), call.bias.shape)
            checks.append(_worst("bias_reduction", gb - want, tol, None,
                                 "grad_bias = G_S summed over the bias's broadcast axes"))

    # linearity in G_O: exact for a power of two, within rounding for a sum
    twice = bw(trace, 2.0 * G_O)
    g2 = stream(seed, "identities").standard_normal(G_O.shape)
    other, both = bw(trace, g2), bw(trace, G_O + g2)
    scales = [rounding_scales(trace, g) for g in (G_O, g2, G_O + g2)]
    worst = None
    for name in GRAD_TENSORS:
        a, t2 = getattr(grads, name), getattr(twice, name)
        if a is None or t2 is None:
            continue
        if not np.array_equal(t2, 2.0 * a):
            diff = np.abs(t2 - 2.0 * a)
            idx = np.unravel_index(int(np.argmax(diff)), diff.shape)
            worst = IdentityCheck("linearity", False, np.inf, float(diff[idx]), 0.0,
                                  f"{name}{format_index(idx)}",
                                  "backward(2 G_O) = 2 backward(G_O) bit for bit")
            break
        b, ab = getattr(other, name), getattr(both, name)
        # rounding of each run is bounded by eps times the magnitudes of the terms it sums
        mag = scales[0].get(name, 0.0) + scales[1].get(name, 0.0) + scales[2].get(name, 0.0)
        if np.shape(mag) != np.shape(a):
            mag = float(np.abs(a).max() + np.abs(b).max() + np.abs(ab).max())
        c = _worst("linearity", ab - a - b, ulps * EPS * np.sqrt(max(Q, K)) * mag, None,
                   "backward(2 G_O) = 2 backward(G_O) exactly; backward(G_O + G) = "
                   "backward(G_O) + backward(G)")
        if worst is None or c.ratio > worst.ratio:
            worst = IdentityCheck(c.name, c.passed, c.ratio, c.residual, c.tolerance, name,
                                  c.detail)
    if worst is not None:
        checks.append(worst)

    # zero G_O
    zero = bw(trace, np.zeros_like(G_O))
    checks.append(_exact("zero_grad_output",
                         {n: getattr(zero, n) for n in GRAD_TENSORS
                          if getattr(zero, n) is not None},
                         "G_O = 0 gives exactly zero gradients"))

    # masked entries, unused rows, all-dropped rows
    vis = call.visible_full()
    live = qv & ~trace.sanitized_rows  # (B, Hq, Q) consumed rows with a real support
    masked = ~vis & live[..., None]  # (B, Hq, Q, K)
    dropped_row = live & ~(consumed != 0).any(-1)  # every legal route dropped
    dead = ~qv | dropped_row  # (B, Hq, Q)
    checks.append(_exact(
        "masked_and_unused_zero",
        {"probs[masked]": np.where(masked, P, 0.0), "grad_scores[masked]":
         np.where(masked, G_S, 0.0), "grad_scores[unused or all-dropped row]":
         np.where(dead[..., None], G_S, 0.0), "output[unused or all-dropped row]":
         np.where(dead[..., None], out, 0.0)},
        f"exact zeros: {int(masked.sum())} masked entries, {int((~qv).sum())} unused rows, "
        f"{int(dropped_row.sum())} all-dropped rows"))

    # repeated backward: bit-identical
    again = bw(trace, G_O)
    bad = [n for n in GRAD_TENSORS if getattr(grads, n) is not None and (
        getattr(again, n) is None
        or getattr(again, n).tobytes() != np.ascontiguousarray(getattr(grads, n)).tobytes())]
    checks.append(IdentityCheck(
        "repeat_bitwise", not bad, 0.0 if not bad else np.inf, 0.0, 0.0,
        ", ".join(bad) or "-", "a second backward(G_O) reproduces every bit"))

    checks.append(_softmax_jacobian(trace, G_S, G_P, live, max_rows=max_rows, ulps=ulps,
                                    sink=getattr(call, "sink", None)))
    return IdentityReport(tuple(checks))


def _softmax_jacobian(trace: Trace, G_S: np.ndarray, G_P: np.ndarray, live: np.ndarray, *,
                      max_rows: int, ulps: float, sink: np.ndarray | None) -> IdentityCheck:
    """Sampled rows: J by complex step is symmetric PSD, J 1 = 0, and G_S = J G_P.

    With a sink logit in the denominator (held fixed), ``J 1 = p * sink_prob``.
    """
    flat = np.flatnonzero(live)
    if flat.size == 0:
        return IdentityCheck("softmax_jacobian", True, 0.0, 0.0, 0.0, "-", "no consumed rows")
    pick = flat[np.unique(np.linspace(0, flat.size - 1, min(max_rows, flat.size)).astype(int))]
    worst = IdentityCheck("softmax_jacobian", True, 0.0, 0.0, 0.0, "-", "")
    K = G_S.shape[-1]
    eye = np.eye(K) * (CS_STEP * 1j)  # (K, K) one complex step per key
    for f in pick:
        idx = np.unravel_index(int(f), live.shape)
        s = _filled(trace.masked_scores, "masked_scores")[idx]  # (K,) -inf off the support
        sc = s[None, :] + eye  # (K, K): row j perturbs key j
        top = s.max() if sink is None else max(s.max(), float(sink[idx[1]]))
        e = np.exp(sc - top)
        denom = e.sum(-1, keepdims=True)
        if sink is not None:
            denom = denom + np.exp(float(sink[idx[1]]) - top)  # the sink logit, held fixed
        p = e / denom
        jt = p.imag / CS_STEP  # jt[j, i] = d p_i / d s_j  (J transposed)
        pr = _filled(trace.probs, "probs")[idx]
        j1 = 0.0 if sink is None else pr * (1.0 - pr.sum())  # J 1 = p (1 - sum p)
        pmax = float(pr.max())
        gp, gs = G_P[idx], G_S[idx]
        parts = {
            "symmetric": (np.abs(jt - jt.T).max(), ulps * EPS * pmax),
            "psd": (max(0.0, -float(np.linalg.eigvalsh((jt + jt.T) / 2).min())),
                    ulps * EPS * pmax),
            "J1=0": (np.abs(jt.sum(0) - j1).max(), ulps * EPS * pmax),
            "G_S=J G_P": (np.abs(gs - jt @ gp).max(),
                          ulps * EPS * float((pr * np.abs(gp)).sum() + pmax * np.abs(gp).max())),
        }
        for label, (r, t) in parts.items():
            ratio = r / t if t > 0 else (0.0 if r == 0 else np.inf)
            if ratio > worst.ratio or (worst.where == "-" and label == "G_S=J G_P"):
                worst = IdentityCheck("softmax_jacobian", ratio <= 1.0, float(ratio), float(r),
                                      float(t), f"{label} at {format_index(idx, 'bhi')}", "")
    detail = (f"{len(pick)} sampled rows: complex-step softmax Jacobian symmetric, PSD, "
              "J 1 = 0, and G_S = J G_P")
    return IdentityCheck(worst.name, worst.ratio <= 1.0, worst.ratio, worst.residual,
                         worst.tolerance, worst.where, detail)
