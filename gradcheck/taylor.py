"""Taylor remainder test: a second opinion on a gradient that needs no error model.

Owns the test: for ``phi(x) = <v, fn(x)>`` and a direction ``w``, the remainder
``r(t) = |phi(x + t w) - phi(x) - t <g, w>|`` falls like ``t**2`` when ``g`` is the gradient
and only like ``t`` when it is not, so the log-log slope reads about 2 or about 1 whatever
the size of the error. Defers directions to :mod:`gradcheck.directional`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from gradcheck._boundary import shown
from gradcheck.api import _analytic, _validate_inputs
from gradcheck.directional import cotangent, direction
from gradcheck.errors import GradcheckError, float64_array, public
from gradcheck.methods import EPS

__all__ = ["TaylorReport", "TaylorResult", "taylor_test"]

Verdict = Literal["second_order", "exact", "first_order", "inconclusive"]


@dataclass(frozen=True, eq=False)
class TaylorResult:
    """The remainder sequence of one input.

    Attributes
    ----------
    name : str
    steps : (n,) ndarray
        ``t``, decreasing by 4 each time.
    residuals : (n,) ndarray
        ``r(t)``.
    noise : (n,) ndarray
        Rounding level of each residual; residuals below ``100 * noise`` are not used.
    slope : float
        Least-squares log-log slope over the three smallest usable steps (nan if none).
    verdict : {"second_order", "exact", "first_order", "inconclusive"}
        ``second_order``: slope >= 1.8 (gradient right); ``exact``: every residual is at
        rounding level (``phi`` linear along ``w`` and gradient right); ``first_order``:
        slope <= 1.2 (gradient wrong); otherwise inconclusive.
    """

    name: str
    steps: np.ndarray
    residuals: np.ndarray
    noise: np.ndarray
    slope: float
    verdict: Verdict

    @property
    def passed(self) -> bool:
        """The remainder is second order (or at rounding level)."""
        return self.verdict in ("second_order", "exact")


@dataclass(frozen=True, eq=False)
class TaylorReport:
    """Per-input :class:`TaylorResult`; ``str()`` prints slopes and verdicts."""

    results: dict[str, TaylorResult]
    seed: int

    @property
    def passed(self) -> bool:
        """Every input's remainder is second order."""
        return all(r.passed for r in self.results.values())

    def __str__(self) -> str:
        lines = [f"Taylor remainder test (seed {self.seed}): "
                 + ("PASSED" if self.passed else "FAILED")]
        for r in self.results.values():
            used = r.residuals > 100 * r.noise
            seq = " ".join(f"{x:.2e}" for x in r.residuals[used][-4:])
            lines.append(f"  {r.name}: slope {r.slope:.3f} -> {r.verdict}  (last r(t): {seq})")
        return "\n".join(lines)


def _slope(t: np.ndarray, r: np.ndarray) -> float:
    if t.size < 2:
        return float("nan")
    lt, lr = np.log(t), np.log(r)
    return float(np.polyfit(lt, lr, 1)[0])


@public
def taylor_test(
    fn: Callable[..., np.ndarray],
    vjp: Callable[..., Mapping[str, np.ndarray]],
    inputs: Mapping[str, np.ndarray],
    *,
    grad_output: np.ndarray | None = None,
    wrt: Sequence[str] | None = None,
    seed: int = 0,
    steps: int = 10,
    t0: float = 0.1,
) -> TaylorReport:
    """Slope of the first-order Taylor remainder for each input (second opinion).

    Parameters
    ----------
    fn, vjp, inputs, grad_output, wrt, seed
        As for :func:`gradcheck.check_vjp`.
    steps : int
        Number of step sizes ``t0 * 4**-k``.
    t0 : float
        Largest step, relative to the direction (scaled by ``max(|x|, 1)``).

    Returns
    -------
    TaylorReport
        ``steps + 1`` calls of ``fn`` per input and one ``vjp`` call.

    Examples
    --------
    >>> fn = lambda x: np.exp(x)
    >>> taylor_test(fn, lambda g, x: {"x": g * np.exp(x)}, {"x": np.array([0.2, -1.0])}).passed
    True
    >>> r = taylor_test(fn, lambda g, x: {"x": 1.001 * g * np.exp(x)}, {"x": np.array([0.2])})
    >>> r.results["x"].verdict
    'first_order'
    """
    inputs = _validate_inputs(inputs)
    names = list(inputs) if wrt is None else list(wrt)
    for n in names:
        if n not in inputs:
            raise GradcheckError(f"wrt: {n!r} is not an input (inputs: {sorted(inputs)})")
    if seed < 0:
        raise GradcheckError(f"seed: expected a non-negative integer, got {seed}")
    if not 2 <= steps <= 32 or not 0.0 < t0 <= 1.0:
        raise GradcheckError(f"steps, t0: expected steps in [2, 32] and t0 in (0, 1], got "
                             f"{shown(steps)}, {t0!r}")
    f0 = float64_array("fn output", fn(**inputs), finite=False)
    if grad_output is None:
        v = cotangent(f0.shape, seed=seed, round_=0)
    else:
        v = float64_array("grad_output", grad_output)
        if v.shape != f0.shape:
            raise GradcheckError(f"grad_output: expected the output's shape {list(f0.shape)}, "
                                 f"got {list(v.shape)}")
    phi0 = float(v.ravel() @ f0.ravel())
    mag0 = float(np.abs(v).ravel() @ np.abs(f0).ravel())
    grads = vjp(v.copy(), **inputs)
    results = {}
    for n in names:
        x = inputs[n]
        g, problem = _analytic(n, grads, x)
        if g is None:
            raise GradcheckError(f"vjp: {problem}")
        w = direction(x, seed=seed, name=n, round_=0)
        w = w / max(float(np.max(np.abs(w) / np.maximum(np.abs(x), 1.0))), EPS)
        gw = float(g.ravel() @ w.ravel())
        ts = t0 * 4.0 ** -np.arange(steps)
        gw_mag = float(np.abs(g.ravel() * w.ravel()).sum())
        res, noise = np.empty(steps), np.empty(steps)
        for i, t in enumerate(ts):
            ft = np.asarray(fn(**{**inputs, n: x + t * w}))
            res[i] = abs(float(v.ravel() @ ft.ravel()) - phi0 - t * gw)
            # rounding of the two contractions and of t <g, w>
            noise[i] = EPS * (float(np.abs(v).ravel() @ np.abs(ft).ravel()) + mag0 + t * gw_mag)
        used = res > 100 * noise
        verdict: Verdict
        if not used.any():
            slope, verdict = float("nan"), "exact"
        else:
            tt, rr = ts[used][-3:], res[used][-3:]
            slope = _slope(tt, rr)
            if np.isnan(slope):
                verdict = "inconclusive"
            elif slope >= 1.8:
                verdict = "second_order"
            elif slope <= 1.2:
                verdict = "first_order"
            else:
                verdict = "inconclusive"
        results[n] = TaylorResult(n, ts, res, noise, slope, verdict)
    return TaylorReport(results, int(seed))
