"""The comparison harness: does a candidate (another stack's tensors) match a golden case?

Owns :func:`compare` and its :class:`Report`: structure (names, shapes, exact booleans and
integers, equal NaN/inf positions), then per tensor either the float64 rule
``|a - g| <= atol + rtol * |g|`` or, for float32/float16/bfloat16 candidates, the
reference-relative rule ``max|a - g| <= k * max|naive_lp - g| + floor`` where ``naive_lp`` is
refattn's own naive algorithm run in the candidate's dtype. Defers candidate files to
:mod:`refattn.bundle.comparison.candidates`, the tolerance settings to
:mod:`refattn.bundle.comparison.tolerances`, the naive reference to
:mod:`refattn.bundle.comparison.lowp` and the reading of golden cases to
:mod:`refattn.bundle.golden.spec`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, SupportsFloat, cast

import numpy as np

from refattn._boundary import public
from refattn._checks import first_index, format_index
from refattn.bundle.comparison.candidates import as_numpy
from refattn.bundle.comparison.diagnosis import Diagnosis, diagnose
from refattn.bundle.comparison.lowp import naive_routes, natural_magnitudes
from refattn.bundle.comparison.tolerances import (
    LOWER_PRECISIONS,
    Tolerances,
    precision_name,
    resolve_dtype,
    rounding_floor,
    ulp,
)
from refattn.bundle.golden.case import GoldenCase
from refattn.bundle.golden.layouts import LAYOUT_INPUTS
from refattn.bundle.golden.spec import CaseSpec, case_spec
from refattn.bundle.storage.read import LoadedCase
from refattn.errors import RefAttnError

__all__ = ["CHECKS", "LEGEND", "TRACE_ORDER", "Report", "TensorReport", "compare", "plain",
           "required_tensors"]

#: canonical names in trace order: inputs, forward stages, backward stages
TRACE_ORDER = (
    "q", "k", "v", "head_map", "visible", "query_valid", "bias", "dropout", "sink",
    "softcap_input", "scores", "biased_scores", "masked_scores", "row_max", "lse", "probs",
    "sink_probs", "dropout_multiplier", "consumed", "output", "sanitized_rows",
    "grad_output", "grad_v", "grad_consumed", "grad_probs", "row_dot", "row_dot_output",
    "grad_scores", "grad_softcap_input", "grad_q", "grad_k", "grad_bias", "grad_sink",
)


#: what a candidate is checked for: its forward output, its output and every input gradient,
#: or only the tensors it lists (at least one)
CHECKS = ("auto", "forward", "gradients", "listed")
#: a call's inputs (and the cotangent): a golden case stores them, a candidate computes none of
#: them, so the "not compared" line of a report never names them
INPUT_NAMES = frozenset({
    "q", "k", "v", "head_map", "visible", "query_valid", "bias", "dropout", "sink",
    "grad_output", "score_W", "score_Wq", "score_Wk", "score_b", "score_v",
}) | LAYOUT_INPUTS
_INPUT_GRADIENTS = ("grad_q", "grad_k", "grad_v", "grad_bias", "grad_sink")


def required_tensors(check: str, golden_names: Any, candidate_names: Any = ()) -> tuple[str, ...]:
    """The tensors a candidate must contain for ``check`` against a golden case.

    ``forward``: ``output``. ``gradients``: ``output`` and every input gradient the golden
    stores (``grad_q``, ``grad_k``, ``grad_v``, and ``grad_bias``, ``grad_sink``,
    ``grad_score_<param>`` where the call has them). ``auto``: ``gradients`` when the candidate
    holds any input gradient, else ``forward``. ``listed``: only the tensors the candidate
    holds (a study of single stages); it must hold at least one.

    Examples
    --------
    >>> required_tensors("auto", ["output", "grad_q", "grad_k", "grad_v"], ["output"])
    ('output',)
    >>> required_tensors("auto", ["output", "grad_q", "grad_k", "grad_v"], ["grad_k"])
    ('output', 'grad_q', 'grad_k', 'grad_v')
    """
    if check not in CHECKS:
        raise RefAttnError(f"check: expected one of {list(CHECKS)}, got {check!r}")
    golden_names = set(golden_names)
    if check == "listed":
        return ()
    if check == "auto":
        grads = any(n in _INPUT_GRADIENTS or n.startswith("grad_score_")
                    for n in candidate_names)
        check = "gradients" if grads else "forward"
    need = ["output"]
    if check == "gradients":
        need += [n for n in _INPUT_GRADIENTS if n in golden_names or n in _INPUT_GRADIENTS[:3]]
        need += sorted(n for n in golden_names if n.startswith("grad_score_"))
    return tuple(need)


def _order_key(name: str) -> tuple[int, str]:
    if name in TRACE_ORDER:
        return (TRACE_ORDER.index(name), name)
    if name.startswith("score_"):
        return (TRACE_ORDER.index("sink"), name)
    return (len(TRACE_ORDER), name)


# -- reports -------------------------------------------------------------------------------
@dataclass(frozen=True)
class RelativeError:
    """One entry of a tensor's top relative errors."""

    index: tuple[int, ...]
    relative: float
    candidate: float
    golden: float


@dataclass(frozen=True)
class TensorReport:
    """The verdict on one tensor.

    Attributes
    ----------
    name : str
    rule : {"exact", "float64", "reference_relative", "structure"}
    passed : bool
    reason : str or None
        Why the tensor failed (shape, non-finite positions, tolerance, ...).
    shape : tuple of int
    compared : int
        Elements compared numerically (finite in both).
    max_abs_error : float
    bound : float
        Allowed error at the worst element (float64 rule) or for the whole tensor.
    margin : float
        ``error - bound`` at the worst element: > 0 is a violation, <= 0 is headroom.
    worst_index : tuple of int or None
    worst_candidate, worst_golden : float
    failing_count : int
    failing_percent : float
    nan_mismatches : int
        Positions where exactly one side is NaN.
    nonfinite_mismatches : int
        Positions whose class (finite, NaN, +inf, -inf) differs.
    reference_error : float or None
        ``max|naive_lp - g|`` over the naive routes (reference-relative rule only).
    ratio : float or None
        ``max_abs_error / reference_error``.
    top_relative : tuple of RelativeError
        The five largest relative errors.
    """

    name: str
    rule: str
    passed: bool
    reason: str | None = None
    shape: tuple[int, ...] = ()
    compared: int = 0
    max_abs_error: float = 0.0
    bound: float = 0.0
    margin: float = 0.0
    worst_index: tuple[int, ...] | None = None
    worst_candidate: float = float("nan")
    worst_golden: float = float("nan")
    failing_count: int = 0
    failing_percent: float = 0.0
    nan_mismatches: int = 0
    nonfinite_mismatches: int = 0
    reference_error: float | None = None
    ratio: float | None = None
    top_relative: tuple[RelativeError, ...] = ()

    def line(self) -> str:
        """One table row: ``FAIL`` or ``ok`` first, then the columns :data:`LEGEND` explains."""
        mark = "ok" if self.passed else "FAIL"
        if self.rule == "structure":  # nothing was compared numerically: say why instead
            return (f"{mark:<4} {self.name:<20} {self.rule:<18} {'-':<10} {'-':<10} {'-':<11} "
                    f"{'-':<7} {'-':>15}  {self.reason or ''}")
        ratio = "-" if self.ratio is None else f"{self.ratio:.3g}"
        worst = "-" if self.worst_index is None else (
            f"{format_index(self.worst_index)} {plain(self.worst_candidate)} vs "
            f"{plain(self.worst_golden)}"
        )
        return (f"{mark:<4} {self.name:<20} {self.rule:<18} {self.max_abs_error:<10.3e} "
                f"{self.bound:<10.3e} {self.margin:<+11.3e} {ratio:<7} "
                f"{self.failing_count:>6} ({self.failing_percent:6.2f}%)  {worst}")

    def to_dict(self) -> dict[str, Any]:
        """The row as JSON-ready values (non-finite floats as ``"nan"``, ``"inf"``,
        ``"-inf"``; indices as lists).

        Examples
        --------
        >>> TensorReport("output", "float64", True, worst_candidate=float("nan")).to_dict()[
        ...     "worst_candidate"]
        'nan'
        """
        out = {f.name: _json_value(getattr(self, f.name)) for f in fields(self)
               if f.name != "top_relative"}
        out["top_relative"] = [{f.name: _json_value(getattr(r, f.name)) for f in fields(r)}
                               for r in self.top_relative]
        return out


#: golden tensors the "not compared" line names before it refers to ``report.missing``
_MISSING_SHOWN = 3


def _missing_line(missing: tuple[str, ...]) -> str:
    """One short line for the golden tensors a candidate does not give: their count and the
    first :data:`_MISSING_SHOWN` in trace order (:attr:`Report.missing` holds them all).

    Examples
    --------
    >>> _missing_line(("lse", "probs"))
    'not compared: 2 golden tensors the candidate does not give (lse, probs)'
    >>> _missing_line(("scores", "masked_scores", "row_max", "lse", "probs"))
    'not compared: 5 golden tensors the candidate does not give (scores, masked_scores, \
row_max, ...)'
    """
    n = len(missing)
    shown = ", ".join(missing[:_MISSING_SHOWN])
    rest = ", ..." if n > _MISSING_SHOWN else ""
    noun = "golden tensor the candidate does not give" if n == 1 else (
        "golden tensors the candidate does not give")
    return f"not compared: {n} {noun} ({shown}{rest})"


def plain(x: SupportsFloat) -> str:
    """A float as plain text that reads back exactly: ``0.1``, ``-2.5e-300``, ``nan``, ``inf``.

    Examples
    --------
    >>> plain(np.float64(0.1)), plain(float("nan")), plain(-np.inf)
    ('0.1', 'nan', '-inf')
    """
    return repr(float(x))


def _json_value(x: Any) -> Any:
    """JSON-ready: numpy scalars as Python ones, non-finite floats as strings, tuples as lists."""
    if isinstance(x, (tuple, list)):
        return [_json_value(v) for v in x]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return float(x) if np.isfinite(x) else plain(x)
    return x


#: what each column of :meth:`Report.format` means (printed above the table)
LEGEND = (
    "columns: FAIL/ok = verdict; max_err = largest |candidate - golden| over the elements",
    "  finite in both; bound = the error allowed at the worst element (float64 rule:",
    "  atol + rtol*|golden|) or for the whole tensor (lower precision: k * the naive",
    "  algorithm's own error + floor); margin = max_err - bound (> 0 fails); ratio = max_err /",
    "  the naive algorithm's error (lower precision only); failing = elements over their bound;",
    "  worst = the worst element's index in the tensor, then candidate vs golden there",
)


@public
@dataclass(frozen=True)
class Report:
    """The verdict on a whole candidate.

    Attributes
    ----------
    case_id : str or None
    precision : str
        The rule's precision: float64, float32, float16 or bfloat16.
    tensors : tuple of TensorReport
        In trace order.
    missing : tuple of str
        Golden outputs (forward stages and gradients; never the call's inputs) the candidate
        does not provide (not compared; not a failure).
    first_failure : str or None
        The first failing tensor in trace order.
    diagnoses : tuple of Diagnosis
        The kinds of error that were recomputed and found to fit the failures
        (:mod:`refattn.bundle.comparison.diagnosis`): a constant ratio, a sign flip, another scale,
        another probability support, GQA heads interleaved instead of grouped, a missing GQA
        sum, dropout not applied, a softmax over the query axis, grad_v with P where P^T
        belongs, a transposed layout, a missing ``query_valid`` zeroing. Empty when the
        candidate passes or nothing fits.
    """

    case_id: str | None
    precision: str
    tensors: tuple[TensorReport, ...]
    missing: tuple[str, ...] = ()
    tolerances: Tolerances = field(default_factory=Tolerances)
    diagnoses: tuple[Diagnosis, ...] = ()

    @property
    def passed(self) -> bool:
        """True when at least one tensor was compared and every row passed (a candidate
        missing a tensor its check needs has a failing row for it)."""
        return bool(self.tensors) and all(t.passed for t in self.tensors)

    @property
    def first_failure(self) -> str | None:
        return next((t.name for t in self.tensors if not t.passed), None)

    def __getitem__(self, name: str) -> TensorReport:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def rule_text(self) -> str:
        """The rule in words, e.g. ``|a-g| <= 1e-12 + 1e-10*|g| per element``."""
        tol = self.tolerances
        if self.precision == "float64":
            return f"|a-g| <= {tol.atol:g} + {tol.rtol:g}*|g| per element"
        return (f"max|a-g| <= k*max|naive_{self.precision}-g| + floor "
                f"(k={tol.k_forward:g} forward, {tol.k_gradient:g} gradients)")

    def format(self, *, legend: bool = True, diagnoses: bool = True) -> str:
        """The report as text: the rule, a legend of the columns, one row per tensor (failing
        rows start with ``FAIL``), one line counting the golden tensors not compared, then
        the details of every failure, the diagnoses (``diagnoses=False`` leaves them to a
        caller that prints them itself) and the verdict."""
        lines = [f"case {self.case_id or '?'}: precision {self.precision}; "
                 f"rule {self.rule_text()}"]
        if legend:
            lines += LEGEND
        lines.append(f"{'':<4} {'tensor':<20} {'rule':<18} {'max_err':<10} {'bound':<10} "
                     f"{'margin':<11} {'ratio':<7} {'failing':>15}  worst: candidate vs golden")
        lines += [t.line() for t in self.tensors]
        if self.missing:
            lines.append(_missing_line(self.missing))
        for t in self.tensors:
            if t.passed:
                continue
            lines.append(f"FAIL {t.name}: {t.reason}")
            if t.nan_mismatches or t.nonfinite_mismatches:
                lines.append(f"  NaN mismatches {t.nan_mismatches}, non-finite class "
                             f"mismatches {t.nonfinite_mismatches}")
            for r in t.top_relative:
                lines.append(f"  rel {r.relative:.3e} at {format_index(r.index)}: "
                             f"{plain(r.candidate)} vs {plain(r.golden)}")
        if diagnoses:
            lines += [d.line() for d in self.diagnoses]
        first = self.first_failure
        failed = sum(not t.passed for t in self.tensors)
        lines.append("PASS" if first is None else
                     f"FAILED: {failed} of {len(self.tensors)} tensor(s); first failing stage "
                     f"{first}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready values (``refattn compare --json``).

        Examples
        --------
        >>> from refattn.bundle.suites import build_suite
        >>> from refattn.bundle.golden.spec import case_spec
        >>> spec = case_spec(build_suite("contract")[1])
        >>> d = compare({"output": spec.tensors["output"]}, spec).to_dict()
        >>> d["passed"], d["tensors"][0]["name"], d["rule"]
        (True, 'output', '|a-g| <= 1e-12 + 1e-10*|g| per element')
        """
        tol = {f.name: _json_value(getattr(self.tolerances, f.name))
               for f in fields(self.tolerances)}
        tol = {n: dict(v) if isinstance(v, Mapping) else v for n, v in tol.items()}
        return {"case_id": self.case_id, "precision": self.precision, "rule": self.rule_text(),
                "passed": self.passed, "first_failure": self.first_failure,
                "missing": list(self.missing), "tolerances": tol,
                "tensors": [t.to_dict() for t in self.tensors],
                "diagnoses": [{"kind": d.kind, "tensors": list(d.tensors), "text": d.text}
                              for d in self.diagnoses]}


# -- the comparison --------------------------------------------------------------------------
def _classes(x: np.ndarray) -> np.ndarray:
    """0 finite, 1 NaN, 2 +inf, 3 -inf."""
    c = np.zeros(x.shape, np.int8)
    c[np.isnan(x)] = 1
    c[np.isposinf(x)] = 2
    c[np.isneginf(x)] = 3
    return c


def _idx(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(flat, shape)) if shape else ()


def _top_relative(err: np.ndarray, c: np.ndarray, g: np.ndarray, both: np.ndarray,
                  n: int = 5) -> tuple[RelativeError, ...]:
    rel = np.where(both, err / np.maximum(np.abs(g), np.finfo(np.float64).tiny), -1.0)
    flat = rel.reshape(-1)
    order = np.argsort(-flat, kind="stable")[:n]
    return tuple(
        RelativeError(_idx(i, g.shape), float(flat[i]), float(c.reshape(-1)[i]),
                      float(g.reshape(-1)[i]))
        for i in order if flat[i] > 0
    )


def _exact(name: str, c: np.ndarray, g: np.ndarray) -> TensorReport:
    if c.dtype.kind != g.dtype.kind:
        return TensorReport(name, "exact", False, f"dtype {c.dtype} where the golden has "
                            f"{g.dtype} (booleans and integers must match exactly)", g.shape)
    diff = c != g
    n = int(diff.sum())
    if n == 0:
        return TensorReport(name, "exact", True, None, g.shape, compared=g.size)
    first = cast(tuple[int, ...], first_index(diff))  # n > 0
    return TensorReport(
        name, "exact", False, f"{n} element(s) differ; first at {format_index(first)}",
        g.shape, compared=g.size, worst_index=first, worst_candidate=float(c[first]),
        worst_golden=float(g[first]), failing_count=n, failing_percent=100.0 * n / g.size,
        max_abs_error=float("inf"), margin=float("inf"),
    )


def _numeric(name: str, c_in: np.ndarray, g: np.ndarray, *, precision: str,
             tol: Tolerances, naive: Mapping[str, Mapping[str, np.ndarray]] | None,
             dtype: np.dtype, natural: Mapping[str, float] | None = None) -> TensorReport:
    c = c_in.astype(np.float64)  # exact widening of every supported float dtype
    # in a lower precision a finite golden value beyond the dtype's range is expected as +-inf
    with np.errstate(over="ignore"):
        expected = g if precision == "float64" else g.astype(dtype).astype(np.float64)
    cls_c, cls_g = _classes(c), _classes(expected)
    class_diff = cls_c != cls_g
    nan_mm = int((np.isnan(c) != np.isnan(g)).sum())
    nonfinite_mm = int(class_diff.sum())
    both = (cls_c == 0) & (cls_g == 0)
    g_both = np.where(both, g, 0.0)  # finite golden values, 0 elsewhere
    with np.errstate(invalid="ignore"):
        err = np.where(both, np.abs(c - g_both), 0.0)
    compared = int(both.sum())
    reasons: list[str] = []
    if nonfinite_mm:
        first = cast(tuple[int, ...], first_index(class_diff))  # nonfinite_mm > 0
        reasons.append(f"non-finite positions differ at {nonfinite_mm} element(s), first "
                       f"{format_index(first)}: {plain(c[first])} vs {plain(g[first])}")
    ref_err = ratio = None
    if precision == "float64":
        atol, rtol = tol.float64_for(name)
        allowed = atol + rtol * np.abs(g_both)
        viol = np.where(both, err - allowed, -np.inf)
        failing = viol > 0
        rule = "float64"
        if compared:
            wflat = int(np.argmax(viol))
            bound = float(allowed.reshape(-1)[wflat])
            margin = float(viol.reshape(-1)[wflat])
        else:
            wflat, bound, margin = None, 0.0, 0.0
    else:
        rule = "reference_relative"
        if not naive or any(name not in lp for lp in naive.values()):
            return TensorReport(name, rule, False, f"no naive {precision} reference for "
                                f"{name!r}; cannot apply the reference-relative rule", g.shape)
        ref_err = 0.0
        for lp in naive.values():  # the yardstick: the worst legitimate naive route
            fin = np.isfinite(lp[name]) & np.isfinite(g)
            if fin.any():
                ref_err = max(ref_err, float(np.max(np.abs(lp[name][fin] - g[fin]))))
        floor = rounding_floor(g, dtype, shift=tol.floor_shift, factor=tol.floor_factor,
                               mode=tol.floor_mode)
        if natural and name in natural:  # a correct kernel's own roundings of its sums
            floor = max(floor, tol.natural_floor * ulp(1.0, dtype) / 2 * natural[name])
        bound = tol.k_for(name) * ref_err + floor
        failing = err > bound
        wflat = int(np.argmax(err)) if compared else None
        margin = float(err.max() - bound) if compared else -bound
    max_err = float(err.max()) if compared else 0.0
    if ref_err is not None:
        ratio = max_err / ref_err if ref_err > 0 else (0.0 if max_err == 0 else float("inf"))
    n_fail = int(failing.sum())
    if n_fail:
        limit = (f"atol {atol:g} + rtol {rtol:g}*|g|" if precision == "float64" else
                 f"{tol.k_for(name):g} * naive {precision} error {ref_err:.3e} + floor")
        reasons.append(f"{n_fail} of {compared} element(s) exceed {limit}; worst error "
                       f"{max_err:.3e} over bound {bound:.3e} by {margin:.3e}")
    worst = None if wflat is None else _idx(wflat, g.shape)
    return TensorReport(
        name, rule, not reasons, "; ".join(reasons) or None, g.shape,
        compared=compared, max_abs_error=max_err, bound=bound, margin=margin,
        worst_index=worst,
        worst_candidate=float("nan") if worst is None else float(c[worst]),
        worst_golden=float("nan") if worst is None else float(g[worst]),
        failing_count=n_fail, failing_percent=100.0 * n_fail / max(compared, 1),
        nan_mismatches=nan_mm, nonfinite_mismatches=nonfinite_mm,
        reference_error=ref_err, ratio=ratio,
        top_relative=_top_relative(err, c, g, both),
    )


def _infer_precision(cand: Mapping[str, np.ndarray]) -> str:
    kinds = {precision_name(a.dtype) for a in cand.values()
             if a.dtype.kind == "f" or a.dtype.name == "bfloat16"}
    if not kinds:
        return "float64"
    if len(kinds) > 1:
        raise RefAttnError(
            f"dtype: the candidate mixes floating dtypes {sorted(kinds)}; pass dtype= to say "
            "in which precision it was computed"
        )
    return kinds.pop()


def _golden_parts(golden: Any) -> tuple[CaseSpec | None, Mapping[str, np.ndarray]]:
    if isinstance(golden, CaseSpec):
        return golden, golden.tensors
    if isinstance(golden, (LoadedCase, GoldenCase, str, os.PathLike)):
        if isinstance(golden, LoadedCase) and golden.manifest_entry is None:
            return None, golden.tensors
        spec = case_spec(golden)
        return spec, spec.tensors
    if isinstance(golden, Mapping):
        return None, golden
    raise RefAttnError(
        f"golden: expected a CaseSpec, LoadedCase, GoldenCase, case file or mapping, got "
        f"{type(golden).__name__}"
    )


@public
def compare(
    candidate: Mapping[str, Any],
    golden: Any,
    *,
    dtype: Any = None,
    tolerances: Tolerances | None = None,
    check: str = "listed",
) -> Report:
    """Compare a candidate's tensors with a golden case under the precision's rule.

    Parameters
    ----------
    candidate : mapping of str to array-like
        Canonical names (``output``, ``lse``, ``grad_q``, ...) to arrays: numpy, anything with
        ``__array__`` or DLPack, or PyTorch tensors (bfloat16 included).
    golden : CaseSpec, LoadedCase, GoldenCase, path or mapping
        The golden case. The reference-relative rule needs the call (scale, policies), so a
        plain mapping of tensors supports the float64 rule only.
    dtype : str or dtype, optional
        The precision the candidate was computed in (default: its floating dtype).
        ``"float64"`` selects the per-element rule; float32, float16 and bfloat16 select the
        reference-relative rule.
    tolerances : Tolerances, optional
    check : {"auto", "forward", "gradients", "listed"}
        What the candidate must contain (:func:`required_tensors`): ``output`` at least, and
        every input gradient of the golden for a gradient comparison (``auto``: when the
        candidate holds any); ``listed`` (the default here; ``refattn compare`` defaults to
        ``auto``) compares only the tensors given. A missing one is a failing row that names
        it; an empty candidate never passes.

    Returns
    -------
    Report
        ``report.passed``, per-tensor :class:`TensorReport` rows, ``report.first_failure``
        and ``report.format()``.

    Raises
    ------
    RefAttnError
        On an unknown dtype or a golden that cannot provide what the rule needs.

    Examples
    --------
    >>> from refattn.bundle.suites import build_suite
    >>> from refattn.bundle.golden.spec import case_spec
    >>> spec = case_spec(build_suite("contract")[1])
    >>> out = spec.tensors["output"]
    >>> compare({"output": out}, spec).passed
    True
    >>> r = compare({"output": out.astype(np.float32)}, spec)
    >>> r.precision, r.passed, r["output"].rule
    ('float32', True, 'reference_relative')
    >>> lse_only = {"lse": spec.tensors["lse"]}
    >>> compare({}, spec).passed, compare(lse_only, spec, check="forward").passed
    (False, False)
    >>> bad = out.copy(); bad[0, 0, 1, 0] += 1e-6
    >>> r = compare({"output": bad}, spec)
    >>> r.passed, r.first_failure, r["output"].worst_index
    (False, 'output', (0, 0, 1, 0))
    """
    tol = tolerances or Tolerances()
    if not isinstance(tol, Tolerances):
        raise RefAttnError(f"tolerances: expected a Tolerances, got {type(tol).__name__}")
    if not isinstance(candidate, Mapping):
        raise RefAttnError(f"candidate: expected a mapping of names to arrays, got "
                           f"{type(candidate).__name__}")
    spec, gold = _golden_parts(golden)
    cand = {str(name): as_numpy(str(name), x) for name, x in candidate.items()}
    required = required_tensors(check, gold, cand)
    precision = precision_name(resolve_dtype(dtype)) if dtype is not None else (
        _infer_precision(cand))
    lp_dtype = resolve_dtype(precision)
    naive: dict[str, dict[str, np.ndarray]] | None = None
    natural: Mapping[str, float] = {}
    if precision in LOWER_PRECISIONS and cand:
        if spec is None:
            raise RefAttnError(
                f"golden: the {precision} rule reruns the call in {precision}, so the golden "
                "must carry its manifest (pass a LoadedCase from a bundle, a case file or a "
                "GoldenCase, not a bare mapping)"
            )
        compared = [n for n in cand if n in gold]  # the yardstick of these tensors only
        naive = naive_routes(spec, lp_dtype, tol.naive_routes, names=compared)
        natural = natural_magnitudes(spec) if tol.natural_floor else {}
    rows: list[TensorReport] = []
    for name in sorted(cand, key=_order_key):
        c = cand[name]
        if name not in gold:
            rows.append(TensorReport(name, "structure", False,
                                     "unexpected tensor: the golden case has no such name",
                                     tuple(c.shape)))
            continue
        g = np.asarray(gold[name])
        if tuple(c.shape) != tuple(g.shape):
            rows.append(TensorReport(name, "structure", False, f"shape {list(c.shape)} where "
                                     f"the golden has {list(g.shape)}", tuple(g.shape)))
            continue
        if g.dtype.kind in "biu":
            rows.append(_exact(name, c, g))
        elif c.dtype.kind not in "f" and c.dtype.name != "bfloat16":
            rows.append(TensorReport(name, "structure", False, f"dtype {c.dtype} where the "
                                     f"golden has {g.dtype}", tuple(g.shape)))
        else:
            rows.append(_numeric(name, c, g, precision=precision, tol=tol, naive=naive,
                                 dtype=lp_dtype, natural=natural))
    for name in required:
        if name not in cand:
            kind = "gradient" if name.startswith("grad_") else "forward"
            rows.append(TensorReport(name, "structure", False, f"missing: the candidate has no "
                                     f"{name!r}, which a {kind} comparison needs"))
    rows.sort(key=lambda r: _order_key(r.name))
    missing = tuple(sorted((n for n in gold if n not in cand and n not in required
                            and n not in INPUT_NAMES), key=_order_key))
    case_id = spec.case_id if spec is not None else None
    diagnoses: tuple[Diagnosis, ...] = ()
    failing = [r.name for r in rows if not r.passed and r.name in cand]
    if failing:
        diagnoses = _diagnoses(cand, gold, spec, rows, failing, precision=precision, tol=tol,
                               naive=naive, dtype=lp_dtype, natural=natural)
    return Report(case_id, precision, tuple(rows), missing, tol, diagnoses)


def _diagnoses(cand: Mapping[str, np.ndarray], gold: Mapping[str, np.ndarray],
               spec: CaseSpec | None, rows: list[TensorReport], failing: list[str], *,
               precision: str, tol: Tolerances,
               naive: Mapping[str, Mapping[str, np.ndarray]] | None,
               dtype: np.dtype, natural: Mapping[str, float]) -> tuple[Diagnosis, ...]:
    """The comparison's rules as the two tests :func:`diagnose` applies to a hypothesis."""
    bounds = {r.name: r.bound for r in rows if r.rule == "reference_relative"}

    def passes(name: str, c: np.ndarray) -> bool:  # the rule itself, on an undone candidate
        g = np.asarray(gold[name])
        return c.shape == g.shape and _numeric(name, c, g, precision=precision, tol=tol,
                                               naive=naive, dtype=dtype,
                                               natural=natural).passed

    def fits(name: str, c: np.ndarray, alt: np.ndarray) -> bool:  # within the tolerance
        alt = np.asarray(alt, dtype=np.float64)
        if c.shape != alt.shape or not np.array_equal(_classes(c), _classes(alt)):
            return False
        both = np.isfinite(alt)
        err = np.abs(c[both] - alt[both])
        if precision == "float64":
            atol, rtol = tol.float64_for(name)
            return bool(np.all(err <= atol + rtol * np.abs(alt[both])))
        bound = bounds.get(name)  # the tensor's own allowance: k * naive error + floor
        return bound is not None and bound > 0 and bool(err.size == 0 or err.max() <= bound)

    return diagnose(cand, gold, spec, failing, passes=passes, fits=fits)
