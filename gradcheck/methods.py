"""Numeric directional derivatives ``J w`` of any NumPy function: complex step and Richardson.

Owns the two numeric methods, their step rules, their error estimates (including the kink
flag) and the automatic complex-safety test. Defers what is compared with what, and how the
tolerance is built from these estimates, to :mod:`gradcheck.api`.

- Complex step: ``J w = Im fn(x + i h w) / h`` with ``h = 2**-66``. No subtraction, so no
  cancellation: exact to rounding when ``fn`` is complex-safe (analytic operations only).
- Central differences with Richardson extrapolation over the ascending steps
  ``h_k = step * 2**k`` (``step`` about ``eps**(1/3)``; the per-element scale
  ``max(|x|, 1)`` lives in the direction ``w``). The error estimate is the spread between the
  two highest Richardson orders plus the rounding noise carried through the extrapolation
  weights: the larger of an a-priori ``eps * |f| / h`` and an empirical level, pooled over
  many columns or directions (:func:`pooled_errors`), from the combination of the levels that
  annihilates the derivative and every truncation term (pure noise; three levels or more). A
  *kink* is flagged where the central difference moves more between
  the two smallest steps than between the two largest, i.e. the error grows as the step
  shrinks, which no smooth function does (a kink, a ``where`` edge, a clamp) once the change
  is above the rounding noise.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

from gradcheck.errors import GradcheckError

__all__ = [
    "CD_STEP",
    "CS_STEP",
    "EPS",
    "ComplexSafety",
    "Jvp",
    "Projection",
    "central_jvp",
    "complex_safety",
    "complex_step_jvp",
    "exact_direction",
    "noise_weights",
    "pooled_errors",
    "richardson_weights",
]

Method = Literal["complex_step", "central"]
Fn = Callable[..., np.ndarray]

EPS = float(np.finfo(np.float64).eps)
#: base central-difference step, a power of two near eps**(1/3) = 6.06e-6
CD_STEP = 2.0**-17
#: complex step, a power of two near 1e-20 (its truncation error h**2 is far below rounding)
CS_STEP = 2.0**-66
#: assumed evaluation error of ``fn`` in ulps of its output (the a-priori noise term)
NOISE_ULPS = 4.0
#: a kink needs the smallest-step change to exceed this many noise estimates
KINK_NOISE = 16.0


def richardson_weights(levels: int) -> np.ndarray:
    """Weights ``c_k`` with extrapolated value ``sum_k c_k D(step * 2**k)``.

    ``D(h) = f' + a h**2 + b h**4 + ...``; each Richardson order removes one even power.

    Examples
    --------
    >>> richardson_weights(2).tolist()  # (4 D(h) - D(2h)) / 3
    [1.3333333333333333, -0.3333333333333333]
    >>> round(float(richardson_weights(3).sum()), 12)  # an extrapolation's weights sum to 1
    1.0
    """
    table = [np.eye(levels)[k] for k in range(levels)]
    for m in range(1, levels):
        f = 4.0**m
        table = [(f * table[k] - table[k + 1]) / (f - 1.0) for k in range(len(table) - 1)]
    return table[0]


def noise_weights(levels: int) -> np.ndarray | None:
    """Weights ``a_k`` with ``sum_k a_k D(step * 2**k)`` free of f' and every truncation term.

    What is left is rounding noise; the weights are scaled so that its standard deviation is
    that of ``D(step)``'s own noise (noise of ``D(h)`` grows like ``1/h``). None below three
    levels (two levels cannot separate noise from the ``h**2`` term).

    Examples
    --------
    >>> a = noise_weights(3)
    >>> h2 = np.array([1.0, 4.0, 16.0])
    >>> round(float(a.sum()), 12), round(float(a @ h2), 12)
    (0.0, 0.0)
    """
    if levels < 3:
        return None
    h2 = 4.0 ** np.arange(levels)
    vander = np.vstack([h2**m for m in range(levels - 1)])  # (levels - 1, levels)
    a = np.linalg.svd(vander)[2][-1]  # null vector: kills 1, h^2, ..., h^(2(levels-2))
    return a / np.sqrt(np.sum(a**2 * 4.0 ** -np.arange(levels)))


def exact_direction(
    x: np.ndarray, w: np.ndarray, *, step: float = CD_STEP, levels: int = 3
) -> np.ndarray:
    """Round direction ``w`` so that ``x +- step * 2**k * w`` is exact for every level k.

    The perturbation of element i is rounded to a multiple of the spacing of the floats at
    ``|x_i| + |largest perturbation|``; then the sums and differences are representable and
    every Richardson level differentiates along exactly the same direction. (Elements whose
    perturbation crosses a binade boundary, or whose ``x_i`` is far below the step, still
    round, at the level of the noise the error estimate already carries.)

    Parameters
    ----------
    x : (...) float64 ndarray
        The point.
    w : (...) float64 ndarray
        The raw direction.
    step : float
        Base step (a power of two keeps ``w`` exact after the division).
    levels : int
        Number of Richardson levels (largest step ``step * 2**(levels - 1)``).

    Returns
    -------
    (...) float64 ndarray
        The direction actually used; ``step * w`` is the exact level-0 perturbation.

    Examples
    --------
    >>> x = np.array([1.3, 0.0, -7.1]); w = exact_direction(x, np.array([0.3, -1.1, 2.0]))
    >>> p = CD_STEP * w
    >>> bool(np.all((x + p) - (x - p) == 2 * p))
    True
    """
    p0 = step * w
    mag = np.abs(x) + np.abs(p0) * 2.0 ** (levels - 1)
    _, e = np.frexp(mag)  # mag < 2**e; floats below 2**e on this grid are representable
    grid = np.ldexp(1.0, np.maximum(e - 53, -1074))  # never below the smallest subnormal
    return (np.round(p0 / grid) * grid) / step


@dataclass(frozen=True)
class Projection:
    """A numeric directional derivative contracted with a cotangent: ``<v, J w>``.

    Attributes
    ----------
    value : float
        ``<v, J w>``.
    error : float
        Error estimate ``sum_j |v_j| e_j`` from the elementwise estimate ``e``
        (``spread + noise``, before pooling).
    spread : float
        The Richardson spread part of ``error``.
    noise : float
        The a-priori rounding part of ``error`` (through the extrapolation weights).
    noise_sample : float
        One empirical sample of the same rounding term (0 when unavailable), for pooling.
    norm : float
        ``||J w||_2`` (the tolerance scale, with ``||v||``).
    kink : bool
        The central-difference change grows as the step shrinks (never for complex step).
    """

    value: float
    error: float
    norm: float
    kink: bool
    spread: float = 0.0
    noise: float = 0.0
    noise_sample: float = 0.0


def pooled_errors(projections: list[Projection]) -> np.ndarray:
    """Error estimates with the rounding term pooled over comparisons of one input.

    The rounding noise of ``fn`` near x does not depend on the perturbed element, so the
    root-mean-square of the empirical noise samples of every column (or direction) is a
    robust level; each comparison gets ``spread + max(a-priori noise, pooled level)``.

    Examples
    --------
    >>> ps = [Projection(1.0, 0.2, 1.0, False, 0.1, 0.1, s) for s in (0.3, 0.0)]
    >>> pooled_errors(ps).round(4).tolist()
    [0.3121, 0.3121]
    """
    if not projections:
        return np.zeros(0)
    samples = np.array([p.noise_sample for p in projections])
    level = float(np.sqrt(np.mean(samples**2)))
    return np.array([p.spread + max(p.noise, level) for p in projections])


@dataclass(frozen=True, eq=False)
class Jvp:
    """A numeric Jacobian-vector product ``J w`` (output-shaped) with its error estimate.

    Attributes
    ----------
    value : (out) float64 ndarray
        ``J w``.
    error : (out) float64 ndarray
        Elementwise error estimate (>= 0). Zero for complex step, whose rounding error is
        accounted for in the comparison's rounding term.
    method : {"complex_step", "central"}
    steps : tuple of float
        The steps used (one for complex step, ascending for central differences).
    levels : tuple of (out) ndarray
        The plain central differences ``D(h_k)`` (empty for complex step).
    noise : (out) ndarray or None
        The a-priori rounding noise of ``D(h_0)`` (central only).
    amplification : float
        How the extrapolation weights amplify the noise of ``D(h_0)``.
    noise_sample : (out) ndarray or None
        An empirical sample of the extrapolated value's rounding error (three levels or more).
    """

    value: np.ndarray
    error: np.ndarray
    method: Method
    steps: tuple[float, ...]
    levels: tuple[np.ndarray, ...] = ()
    noise: np.ndarray | None = None
    amplification: float = 1.0
    noise_sample: np.ndarray | None = None

    def project(self, v: np.ndarray) -> Projection:
        """Contract with cotangent ``v`` (same shape as the output); flags kinks.

        Examples
        --------
        >>> j = complex_step_jvp(lambda x: x**2, {"x": np.array([3.0])}, "x", np.array([1.0]))
        >>> j.project(np.array([1.0])).value
        6.0
        """
        av = np.abs(v).ravel()
        value = float(v.ravel() @ self.value.ravel())
        error = float(av @ self.error.ravel())
        kink, noise, sample = False, 0.0, 0.0
        if self.noise is not None:
            noise = self.amplification * float(av @ self.noise.ravel())
        if self.noise_sample is not None:
            sample = abs(float(v.ravel() @ self.noise_sample.ravel()))
        if len(self.levels) >= 3 and self.noise is not None:
            s = [float(v.ravel() @ d.ravel()) for d in self.levels[:3]]
            d_small, d_large = s[1] - s[0], s[2] - s[1]
            # a-priori noise only: the empirical sample is itself inflated by a kink
            level = noise / self.amplification
            kink = abs(d_small) > 0.5 * abs(d_large) and abs(d_small) > KINK_NOISE * level
        return Projection(value, error, float(np.linalg.norm(self.value)), bool(kink),
                          max(error - noise, 0.0), noise, sample)


def _with(inputs: Mapping[str, np.ndarray], name: str, x: np.ndarray) -> dict[str, np.ndarray]:
    out = dict(inputs)
    out[name] = x
    return out


def central_jvp(
    fn: Fn,
    inputs: Mapping[str, np.ndarray],
    name: str,
    w: np.ndarray,
    *,
    step: float = CD_STEP,
    levels: int = 3,
) -> Jvp:
    """``J w`` by central differences at steps ``step * 2**k``, Richardson-extrapolated.

    Parameters
    ----------
    fn : callable
        ``fn(**inputs) -> (out) float64 ndarray``.
    inputs : mapping of str to ndarray
    name : str
        The input perturbed.
    w : (...) float64 ndarray
        Direction, shaped like ``inputs[name]`` (see :func:`exact_direction`).
    step : float
        Base step ``h_0``.
    levels : int
        Number of steps (1: plain central difference, no truncation estimate).

    Returns
    -------
    Jvp
        ``2 * levels`` calls of ``fn``.

    Examples
    --------
    >>> j = central_jvp(lambda x: np.exp(x), {"x": np.array([0.5])}, "x", np.array([1.0]))
    >>> bool(abs(j.value[0] - np.exp(0.5)) < 1e-10), bool(j.error[0] < 1e-9)
    (True, True)
    """
    if levels < 1:
        raise GradcheckError(f"levels: expected >= 1, got {levels}")
    x = inputs[name]
    diffs, steps, noises = [], [], []
    for k in range(levels):
        h = step * 2.0**k
        p = h * w  # exact perturbation when w came from exact_direction
        f_plus = np.asarray(fn(**_with(inputs, name, x + p)))
        f_minus = np.asarray(fn(**_with(inputs, name, x - p)))
        diffs.append((f_plus - f_minus) / (2.0 * h))
        steps.append(h)
        noises.append(NOISE_ULPS * EPS * (np.abs(f_plus) + np.abs(f_minus)) / (2.0 * h))
    noise = noises[0]  # the smallest step carries the largest rounding noise
    c = richardson_weights(levels)
    value = sum(ck * d for ck, d in zip(c, diffs, strict=True))
    amplification = float(sum(abs(ck) * 2.0**-k for k, ck in enumerate(c)))
    if levels >= 2:
        prev = richardson_weights(levels - 1)
        lower = sum(ck * d for ck, d in zip(prev, diffs, strict=False))
        spread = np.abs(value - lower)
    else:
        spread = np.zeros_like(value)
    error = spread + amplification * noise
    a = noise_weights(levels)
    sample = None
    if a is not None:  # pure rounding noise, scaled like the extrapolated value's
        sample = amplification * sum(ak * d for ak, d in zip(a, diffs, strict=True))
    return Jvp(np.asarray(value, dtype=np.float64), error, "central", tuple(steps),
               tuple(diffs), noise, amplification, sample)


class NotComplexSafe(Exception):
    """``fn`` cannot carry a complex perturbation (raised, returned real, or warned)."""


def complex_step_jvp(
    fn: Fn,
    inputs: Mapping[str, np.ndarray],
    name: str,
    w: np.ndarray,
    *,
    h: float = CS_STEP,
) -> Jvp:
    """``J w = Im fn(x + i h w) / h`` (one complex call of ``fn``).

    Raises
    ------
    NotComplexSafe
        When ``fn`` raises on complex input, returns a real array, or emits numpy's
        ``ComplexWarning`` (it discarded an imaginary part).

    Examples
    --------
    >>> j = complex_step_jvp(lambda x: np.sin(x), {"x": np.array([1.0])}, "x", np.array([2.0]))
    >>> bool(j.value[0] == 2 * np.cos(1.0))
    True
    """
    x = inputs[name]
    xc = x + (h * w) * 1j  # (...) complex128: the perturbation rides in the imaginary part
    with warnings.catch_warnings():
        warnings.simplefilter("error", np.exceptions.ComplexWarning)
        try:
            out = fn(**_with(inputs, name, xc))
        except np.exceptions.ComplexWarning as exc:
            raise NotComplexSafe(f"discards an imaginary part (ComplexWarning: {exc})") from None
        except Exception as exc:
            raise NotComplexSafe(
                f"raises on complex input ({type(exc).__name__}: {exc})"
            ) from None
    out = np.asarray(out)
    if not np.iscomplexobj(out):
        raise NotComplexSafe(
            f"returns real {out.dtype} for complex input (a cast or .real drops the "
            "imaginary part)"
        )
    value = np.ascontiguousarray(out.imag / h, dtype=np.float64)
    return Jvp(value, np.zeros_like(value), "complex_step", (h,))


@dataclass(frozen=True)
class ComplexSafety:
    """Outcome of the complex-safety test of one input.

    Attributes
    ----------
    safe : bool
        Complex step is used for this input.
    reason : str
        Why (shown in the report).
    agreement : float or None
        ``||cs - cd|| / (||error_cd|| + rounding)``: the complex step against the central
        difference (a second opinion; below ~1 means they agree within the estimate).
    central : Jvp or None
        The central difference that was computed (reused as the first direction's check).
    complex : Jvp or None
    """

    safe: bool
    reason: str
    agreement: float | None
    central: Jvp | None
    complex: Jvp | None


def complex_safety(
    fn: Fn,
    inputs: Mapping[str, np.ndarray],
    name: str,
    w: np.ndarray,
    *,
    step: float = CD_STEP,
    levels: int = 2,
    rounding_ulps: float = 64.0,
    safety: float = 8.0,
) -> ComplexSafety:
    """Decide whether complex step is exact for ``fn`` along ``w`` in input ``name``.

    Safe means: ``fn`` accepts the complex input, returns a complex array whose imaginary
    part is non-zero wherever the derivative is (an identically zero imaginary part next to a
    non-zero central difference means abs, ``.real`` or a cast ate it), and ``Im f / h``
    agrees with a Richardson central difference within its error estimate (``abs``, ``where``
    on values and ``conj`` break this). The comparison uses ``levels`` Richardson levels
    (two suffice to tell 1e-9 from O(1)); a disagreement is re-examined with three levels,
    which can tell a kink inside the steps (inconclusive: complex step kept) from an unsafe
    function. Costs one complex and ``2 * levels`` real calls of ``fn`` when safe.

    Examples
    --------
    >>> x = {"x": np.array([0.3, -0.7])}; w = np.array([1.0, 0.5])
    >>> complex_safety(lambda x: np.tanh(x), x, "x", w).safe
    True
    >>> s = complex_safety(lambda x: np.abs(x), x, "x", w)
    >>> s.safe, s.reason.split(" (")[0]
    (False, 'complex step not used: fn returns real float64 for complex input')
    """
    try:
        cs = complex_step_jvp(fn, inputs, name, w)
    except NotComplexSafe as exc:
        return ComplexSafety(False, f"complex step not used: fn {exc}", None, None, None)

    def judge(cd: Jvp) -> tuple[float, bool, float]:
        diff = float(np.linalg.norm(cs.value - cd.value))
        cd_norm = float(np.linalg.norm(cd.value))
        budget = float(np.linalg.norm(cd.error)) + rounding_ulps * EPS * (
            cd_norm + float(np.linalg.norm(cs.value))
        )
        agreement = diff / budget if budget > 0 else (0.0 if diff == 0 else np.inf)
        vanished = not np.any(cs.value) and cd_norm > safety * float(np.linalg.norm(cd.error))
        return agreement, vanished, diff

    cd = central_jvp(fn, inputs, name, w, step=step, levels=levels)
    agreement, vanished, diff = judge(cd)
    if (agreement > safety or vanished) and levels < 3:  # look closer before refusing
        cd = central_jvp(fn, inputs, name, w, step=step, levels=3)
        agreement, vanished, diff = judge(cd)
    kinked = cd.project(np.ones_like(cd.value)).kink
    if vanished:
        return ComplexSafety(
            False,
            "complex step not used: the imaginary part vanished while the central difference "
            "is non-zero (abs, .real, a cast, or a value-dependent where)",
            agreement, cd, cs,
        )
    if agreement > safety and kinked:
        return ComplexSafety(
            True,
            "complex step (the agreement test was inconclusive: central differences are "
            "non-smooth along the test direction, a kink or a where-edge inside the steps)",
            agreement, cd, cs,
        )
    if agreement > safety:
        return ComplexSafety(
            False,
            f"complex step not used: it disagrees with the central difference "
            f"(||cs - cd|| = {diff:.3g}, {agreement:.3g} x the estimate; abs, where on values "
            "or conj in fn)",
            agreement, cd, cs,
        )
    return ComplexSafety(
        True, f"complex step (agrees with central differences: {agreement:.2g} x estimate)",
        agreement, cd, cs,
    )
