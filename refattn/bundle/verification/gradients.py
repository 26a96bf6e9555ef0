"""Check a golden case's stored gradients against numeric derivatives of the forward.

Owns :func:`gradient_check` (Richardson-extrapolated central differences along one random
direction per input) and :func:`check_stored_gradients`, which checks a file's gradients for
its own ``grad_output`` with gradcheck's ``check_vjp`` (complex step) or with
:func:`gradient_check`. The finite-difference machinery is :mod:`gradcheck`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

import numpy as np

from gradcheck.attention import check_attention
from gradcheck.finite_difference import central_difference
from refattn.bundle.golden.case import GoldenCase
from refattn.bundle.golden.spec import CaseSpec
from refattn.bundle.storage.problems import Problem
from refattn.engine import forward
from refattn.engine.reduce import gather_heads
from refattn.errors import RefAttnError

__all__ = ["GradCheck", "GradcheckMethod", "check_method", "check_stored_gradients",
           "gradient_check"]


_DIFFERENTIABLE = ("q", "k", "v", "bias", "sink")


@dataclass(frozen=True)
class GradCheck:
    """Directional-derivative check of one input's stored gradient."""

    name: str
    analytic: float
    numeric: float
    relative_error: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.relative_error <= self.tolerance


def gradient_check(call: Any, grad_output: np.ndarray, grads: Mapping[str, np.ndarray], *,
                   seed: int = 0, rtol: float = 1e-6) -> list[GradCheck]:
    """Check ``grads`` (grad_q, grad_k, grad_v, grad_bias, grad_sink, grad_score_<param>) of
    ``call`` by finite differences of ``L = sum(output * grad_output)`` along one random
    direction per input.

    The directional derivative ``dL/dt`` of ``L(x + t u)`` is estimated by two central
    differences (:func:`gradcheck.central_difference`, steps h and h/2) combined by Richardson
    extrapolation; the step is chosen so that the scores move by about 1e-3. The analytic value
    is ``sum(grad_x * u)``; the relative error is taken against ``sum|grad_x * u|``, or against
    the rounding noise of the differences when that is larger (``64 eps S / h`` with
    ``S = sum |G_O| (|P~| |V|)``, the magnitudes L is summed from: a loss that cancels to a
    small value keeps the rounding of its large terms).

    Parameters
    ----------
    call : AttentionCall
    grad_output : (B, Hq, Q, Dv) float64 ndarray
    grads : mapping of str to ndarray
        ``grad_<input>`` tensors to check (absent ones are skipped).
    seed : int
        Seeds the random directions.
    rtol : float
        Largest accepted relative error.

    Returns
    -------
    list of GradCheck

    Examples
    --------
    >>> from refattn.bundle.suites.contract import loop7_call
    >>> import refattn
    >>> call = loop7_call(); g_o = np.ones((1, 1, 2, 2))
    >>> grads = refattn.backward(refattn.forward(call), g_o).tensors()
    >>> [(c.name, c.passed) for c in gradient_check(call, g_o, grads)]
    [('q', True), ('k', True), ('v', True), ('bias', True)]
    """
    rng = np.random.default_rng(seed)
    base = forward(call)  # the numpy reference: every tensor materialised
    base_scores = cast(np.ndarray, base.scores)
    # rounding in L is relative to the magnitudes it cancels, not to |L|:
    # |fl(L) - L| <~ eps * sum |G_O| (|P~| |V|) (the two coincide only without cancellation)
    v_eff = gather_heads(np.asarray(call.v), call.head_map)
    consumed = cast(np.ndarray, base.consumed)
    loss_scale = float(np.sum(np.abs(grad_output) * (np.abs(consumed) @ np.abs(v_eff))))
    family = getattr(call, "score", None)
    inputs = [(name, getattr(call, name, None), f"grad_{name}") for name in _DIFFERENTIABLE]
    if family is not None:
        inputs += [(f"score_{n}", a, f"grad_score_{n}") for n, a in family.parameters().items()]

    def perturbed(name: str, x: np.ndarray) -> Any:
        if name.startswith("score_") and family is not None:  # score_* come from a family
            return dataclasses.replace(call, score=family.with_arrays(**{name[6:]: x}))
        return dataclasses.replace(call, **{name: x})

    out: list[GradCheck] = []
    for name, x_in, grad_name in inputs:
        g = grads.get(grad_name)
        if x_in is None or g is None:
            continue
        x0 = np.array(x_in, dtype=np.float64)
        u = rng.standard_normal(x0.shape)

        def loss(t: float, name: str = name, x0: np.ndarray = x0, u: np.ndarray = u) -> float:
            trace = forward(perturbed(name, x0 + t * u))
            return float(np.sum(trace.output * grad_output))

        # step: move the finite scores by about 1e-3, from their local sensitivity (a tiny
        # probe step stays inside any clamp region, e.g. the cosine score's zero-norm floor)
        t0 = 1e-8 * max(1.0, float(np.max(np.abs(x0))))
        probe = cast(np.ndarray, forward(perturbed(name, x0 + t0 * u)).scores)
        fin = np.isfinite(probe) & np.isfinite(base_scores)
        move = float(np.max(np.abs(probe - base_scores)[fin])) / t0 if fin.any() else 0.0
        h = 1e-3 / move if move > 1e-6 else 1e-3 * max(1.0, float(np.max(np.abs(x0))))

        def d(step: float, loss: Any = loss) -> float:
            return float(central_difference(lambda t: loss(float(t[0])), np.zeros(1),
                                            eps=step)[0])

        numeric = (4.0 * d(h / 2) - d(h)) / 3.0  # Richardson: O(h^4)
        contrib = g * u
        analytic = float(np.sum(contrib))
        size = float(np.sum(np.abs(contrib)))
        noise = 64 * np.finfo(np.float64).eps * (loss_scale + size * h) / h
        rel = abs(numeric - analytic) / max(size, noise / rtol, np.finfo(np.float64).tiny)
        out.append(GradCheck(name, analytic, numeric, rel, rtol))
    return out


GradcheckMethod = Literal["auto", "check_vjp", "central_difference"]
_METHODS: tuple[str, ...] = get_args(GradcheckMethod)


def check_method(method: str) -> None:
    """Refuse a gradcheck method that is not one of :data:`GradcheckMethod`."""
    if method not in _METHODS:
        raise RefAttnError(f"gradcheck method: expected one of {list(_METHODS)}, got {method!r}")


def check_stored_gradients(case: GoldenCase, spec: CaseSpec, *, seed: int,
                           method: GradcheckMethod
                           ) -> tuple[float, tuple[str, ...], str, list[Problem]]:
    """Check the file's gradients (for its own grad_output).

    ``check_vjp`` (and ``auto``, its synonym) uses gradcheck's checker: complex step, every
    element when small, else along one random direction; ``central_difference`` uses
    :func:`gradient_check`. Returns the worst error/tolerance, the inputs checked, the method
    used and the problems found.
    """
    check_method(method)
    stored = {n: t for n, t in spec.tensors.items()
              if n.startswith("grad_") and n != "grad_output"}
    if method == "central_difference":
        checks = gradient_check(case.call, case.grad_output, stored, seed=seed)
        found = [
            Problem(spec.case_id, f"grad_{c.name}", "gradcheck",
                    f"directional derivative {c.analytic:.17g} vs finite difference "
                    f"{c.numeric:.17g} (relative error {c.relative_error:.2e} > "
                    f"{c.tolerance:.0e})")
            for c in checks if not c.passed
        ]
        score = max((c.relative_error / c.tolerance for c in checks), default=0.0)
        return score, tuple(c.name for c in checks), "central_difference", found

    def backward(trace: Any, grad_output: np.ndarray) -> Mapping[str, np.ndarray]:
        if not np.array_equal(grad_output, case.grad_output):
            raise RefAttnError("the file's gradients answer only its own grad_output")
        return stored

    # directional mode may use only the one cotangent the file stores
    report = check_attention(case.call, grad_output=case.grad_output, backward=backward,
                             mode="auto", directions=1, seed=seed,
                             progress=False)  # verify draws one bar over the cases
    found = []
    for name, r in report.inputs.items():
        if r.passed:
            continue
        w = r.worst
        where = "" if w is None else (
            f": analytic {w.analytic:.17g} vs numeric {w.numeric:.17g} at "
            f"{w.index if w.index is not None else f'direction {w.direction}'} "
            f"(error/tolerance {w.ratio:.3g})")
        found.append(Problem(spec.case_id, f"grad_{name}", "gradcheck",
                             f"{r.problem or 'gradient disagrees with ' + r.method}{where}"))
    score = max((r.worst.ratio for r in report.inputs.values() if r.worst is not None),
                default=0.0)
    return score, tuple(report.inputs), f"check_vjp {report.mode}", found
