"""The gradient-check report: named results, summary statistics and the readable table.

Owns how one comparison of analytic and numeric derivatives is summarised (error/tolerance
ratio, worst element, relative-error quantiles, count over tolerance, best-fit scale) and
printed. Defers computing
the numbers to :mod:`gradcheck.api`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["InputReport", "Report", "ScaleFit", "Worst", "error_ratio", "quantiles", "scale_fit"]

QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99, "max": 1.0}


@dataclass(frozen=True)
class Worst:
    """The comparison with the largest error/tolerance of one input.

    Attributes
    ----------
    index : tuple of int or None
        Full index of the element in the input (None: a direction that was not localised).
    direction : int or None
        Which random direction (directional mode), else None.
    analytic, numeric : float
        The vjp's value and the numeric method's value.
    abs_error, rel_error : float
        ``|analytic - numeric|`` and that over ``max(|analytic|, |numeric|)``.
    error_estimate : float
        The numeric method's own error estimate.
    tolerance : float
        The tolerance applied (built from the error estimate and the rounding term).
    ratio : float
        ``abs_error / tolerance`` (over 1 fails).
    """

    index: tuple[int, ...] | None
    direction: int | None
    analytic: float
    numeric: float
    abs_error: float
    rel_error: float
    error_estimate: float
    tolerance: float
    ratio: float

    @property
    def where(self) -> str:
        """The index as text (``(0, 1, 2)``, or ``direction 1``)."""
        if self.index is not None:
            return "(" + ", ".join(str(i) for i in self.index) + ")"
        return f"direction {self.direction}"


@dataclass(frozen=True)
class ScaleFit:
    """Least-squares ``analytic = scale * numeric`` and its relative residual.

    A residual near zero with a scale far from 1 is a constant-factor bug (a missing or
    doubled ``1/sqrt(d)``, a factor 2).
    """

    scale: float
    residual: float

    def describe(self) -> str:
        """``analytic = 0.125 x numeric (fit residual 2.1e-16)``.

        Examples
        --------
        >>> ScaleFit(0.125, 2.1e-16).describe()
        'analytic = 0.125 x numeric (fit residual 2.1e-16)'
        """
        return f"analytic = {self.scale:.6g} x numeric (fit residual {self.residual:.2g})"


def scale_fit(analytic: np.ndarray, numeric: np.ndarray) -> ScaleFit | None:
    """Best-fit scale ``<a, n> / <n, n>`` (None when the numeric values are all zero).

    Examples
    --------
    >>> scale_fit(np.array([1.0, 2.0]), np.array([8.0, 16.0])).scale
    0.125
    """
    a, n = np.ravel(analytic), np.ravel(numeric)
    nn = float(n @ n)
    if nn == 0.0 or not np.isfinite(nn):
        return None
    s = float(a @ n) / nn
    denom = max(float(np.linalg.norm(a)), float(np.linalg.norm(n)))
    res = float(np.linalg.norm(a - s * n)) / denom if denom > 0 else 0.0
    return ScaleFit(s, res)


def error_ratio(abs_err: np.ndarray, tol: np.ndarray) -> np.ndarray:
    """Elementwise error / tolerance, with 0/0 = 0 and x/0 = inf (a zero tolerance demands
    an exact zero).

    Examples
    --------
    >>> error_ratio(np.array([1.0, 0.0, 2.0]), np.array([2.0, 0.0, 0.0])).tolist()
    [0.5, 0.0, inf]
    """
    return np.where(tol > 0, abs_err / np.where(tol > 0, tol, 1.0),
                    np.where(abs_err == 0, 0.0, np.inf))


def quantiles(rel: np.ndarray) -> dict[str, float]:
    """p50, p90, p99 and max of the relative errors (zeros when there are none).

    Examples
    --------
    >>> quantiles(np.array([0.0, 1.0]))["p50"]
    0.5
    """
    rel = np.ravel(rel)
    if rel.size == 0:
        return dict.fromkeys(QUANTILES, 0.0)
    return {k: float(np.quantile(rel, q)) for k, q in QUANTILES.items()}


@dataclass(frozen=True, eq=False)
class InputReport:
    """The check of one input.

    Attributes
    ----------
    name : str
    shape : tuple of int
    mode : {"full", "directional"}
    method : {"complex_step", "central"}
    method_note : str
        Why this method (the complex-safety verdict).
    n_checked, n_over : int
        Comparisons made (elements or directions) and how many exceeded the tolerance.
    worst : Worst or None
    quantiles : dict
        Relative-error quantiles p50, p90, p99, max.
    scale_fit : ScaleFit or None
    kinks : tuple
        Element indices (full) or direction numbers (directional) flagged as non-smooth.
    null_ratio : float or None
        ``||P g|| / tolerance`` for the declared null directions (the exact derivative there
        is zero), or None when none are declared.
    problem : str or None
        A structural failure (missing gradient, wrong shape or dtype) in words.
    localized : bool
        Directional mode: the worst index was found by bisection over the direction.
    analytic, numeric, ratio : ndarray
        Per comparison (full mode: input-shaped; directional: one per direction).
    """

    name: str
    shape: tuple[int, ...]
    mode: str
    method: str
    method_note: str
    n_checked: int
    n_over: int
    worst: Worst | None
    quantiles: dict[str, float]
    scale_fit: ScaleFit | None
    kinks: tuple[Any, ...] = ()
    null_ratio: float | None = None
    problem: str | None = None
    localized: bool = False
    analytic: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    numeric: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)
    ratio: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False)

    @property
    def passed(self) -> bool:
        """No structural problem, nothing over tolerance, null directions clean."""
        null_ok = self.null_ratio is None or self.null_ratio <= 1.0
        return self.problem is None and self.n_over == 0 and null_ok

    def explain(self) -> list[str]:
        """Sentences that explain a failure (empty when the input passed)."""
        out: list[str] = []
        if self.problem:
            out.append(f"{self.name}: {self.problem}")
        if self.n_over and self.worst is not None:
            w = self.worst
            loc = f"at {w.where}" + (" (localised by bisection)" if self.localized else "")
            out.append(
                f"{self.name}: {self.n_over} of {self.n_checked} over tolerance; worst {loc}: "
                f"analytic {w.analytic:.10g} vs numeric {w.numeric:.10g} "
                f"(abs {w.abs_error:.3g}, rel {w.rel_error:.3g}, {w.ratio:.3g} x tolerance)"
            )
            fit = self.scale_fit
            if fit is not None and fit.residual < 1e-6 and abs(fit.scale - 1.0) > 1e-9:
                out.append(f"{self.name}: {fit.describe()}: a constant-factor error")
        if self.null_ratio is not None and self.null_ratio > 1.0:
            out.append(
                f"{self.name}: the analytic gradient has a component along a direction in "
                f"which the function is exactly constant ({self.null_ratio:.3g} x tolerance)"
            )
        return out


def _fmt(x: float) -> str:
    return f"{x:.4g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.3e}"


@dataclass(frozen=True, eq=False)
class Report:
    """The result of :func:`gradcheck.check_vjp`; ``str(report)`` is a readable table.

    Attributes
    ----------
    inputs : dict of str to InputReport
    mode : {"full", "directional"}
        The mode that ran (``"auto"`` resolved).
    method : str
        The method requested (each input records the one used).
    seed : int
        Replays the check: the same seed draws the same cotangents and directions.
    cotangents : tuple of ndarray
        The cotangents ``v`` used (one per round).
    directions : dict of str to tuple of ndarray
        The directions ``w`` used per input (directional mode and the complex-safety test).
    notes : tuple of str
    n_fn_calls, n_vjp_calls : int
        Cost of the check.
    settings : dict
        Tolerance and step settings (safety, rounding_ulps, step, levels, n_directions).
    """

    inputs: dict[str, InputReport]
    mode: str
    method: str
    seed: int
    cotangents: tuple[np.ndarray, ...] = field(repr=False)
    directions: dict[str, tuple[np.ndarray, ...]] = field(repr=False)
    notes: tuple[str, ...] = ()
    n_fn_calls: int = 0
    n_vjp_calls: int = 0
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """Every input passed."""
        return all(r.passed for r in self.inputs.values())

    @property
    def failed(self) -> list[str]:
        """Names of the inputs that failed."""
        return [n for n, r in self.inputs.items() if not r.passed]

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        head = "PASSED" if self.passed else (
            f"FAILED ({len(self.failed)} of {len(self.inputs)} inputs: {', '.join(self.failed)})"
        )
        lines = [f"gradcheck {head}; mode {self.mode}, seed {self.seed}, "
                 f"{self.n_fn_calls} fn calls, {self.n_vjp_calls} vjp calls"]
        cols = ("input", "shape", "method", "checked", "over", "err/tol", "worst at",
                "analytic", "numeric", "abs err", "rel err", "estimate")
        rows = []
        for r in self.inputs.values():
            w = r.worst
            rows.append((
                r.name, "x".join(str(n) for n in r.shape) or "()", r.method, str(r.n_checked),
                str(r.n_over), _fmt(w.ratio) if w else "-", w.where if w else "-",
                _fmt(w.analytic) if w else "-", _fmt(w.numeric) if w else "-",
                _fmt(w.abs_error) if w else "-", _fmt(w.rel_error) if w else "-",
                _fmt(w.error_estimate) if w else "-",
            ))
        lines += _table(cols, rows)
        lines.append("")
        qcols = ("input", "rel p50", "rel p90", "rel p99", "rel max", "best-fit scale")
        qrows = []
        for r in self.inputs.values():
            q = r.quantiles
            fit = r.scale_fit.describe() if r.scale_fit else "-"
            qrows.append((r.name, _fmt(q["p50"]), _fmt(q["p90"]), _fmt(q["p99"]),
                          _fmt(q["max"]), fit))
        lines += _table(qcols, qrows)
        extra = [s for r in self.inputs.values() for s in r.explain()]
        for r in self.inputs.values():
            lines_note = f"{r.name}: {r.method_note}"
            if r.kinks:
                lines_note += f"; non-smooth (error grows as the step shrinks) at {r.kinks[:5]}"
            if r.null_ratio is not None:
                lines_note += f"; null directions {r.null_ratio:.2g} x tolerance"
            extra.append(lines_note)
        extra += list(self.notes)
        if extra:
            lines.append("")
            lines += [f"- {s}" for s in extra]
        s = self.settings
        lines.append(
            f"replay: check_vjp(..., mode={self.mode!r}, method={self.method!r}, "
            f"seed={self.seed}, directions={s.get('directions')}, safety={s.get('safety')}, "
            f"rounding_ulps={s.get('rounding_ulps')}, step={s.get('step')!r}, "
            f"levels={s.get('levels')})"
        )
        return "\n".join(lines)


def _table(cols: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c)
              for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*cols).rstrip()] + [fmt.format(*r).rstrip() for r in rows]
