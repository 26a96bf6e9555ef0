"""Verdicts of ``refattn verify``: problems, per-case results and the bundle report.

Owns :class:`CaseResult` and :class:`VerifyReport` (and re-exports
:class:`~refattn.bundle.storage.problems.Problem`, which the readers fill too) with the table
``refattn verify`` prints. Holds no logic beyond formatting; the checks that fill them live in
:mod:`refattn.bundle.storage.read`, :mod:`refattn.bundle.verification.recompute`,
:mod:`refattn.bundle.verification.gradients` and :mod:`refattn.bundle.verification.verifier`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from refattn.bundle.storage.problems import Problem, Stage

__all__ = ["LEGEND", "CaseResult", "Guarantee", "GuaranteeKind", "Problem", "Stage",
           "VerifyReport"]

#: what each column of :meth:`VerifyReport.format` means (printed above the table)
LEGEND = (
    "columns: FAIL/ok = the case's verdict; files = the case file and its tensors' sha256 "
    "(ok/FAIL);",
    "  sha = tensors whose sha256 matched the manifest; guarantee = the case recomputed by the "
    "exact generator",
    "  whatever the manifest claims: bit-identical to the correctly rounded result, or within "
    "the documented",
    "  float64 backend bound of it (share of the bound used; see the guarantee lines and "
    "docs/verify.md);",
    "  gradcheck = the stored gradients against numeric derivatives: worst error/tolerance "
    "(<= 1 passes),",
    "  the mode and the inputs checked; rounding cert. (--exact) = elements confirmed "
    "correctly rounded",
)


def _json_float(x: float | None) -> float | str | None:
    """A float for JSON: non-finite as ``"nan"``, ``"inf"``, ``"-inf"``."""
    if x is None or math.isfinite(x):
        return x
    return repr(float(x))


#: which guarantee a verified case met: ``bit_identical`` (every stored tensor equals the
#: correctly rounded result), ``within_bound`` (within the documented float64 backend bound of
#: it), ``within_float64_recomputation`` (the exact generator did not run the case: within
#: twice that bound of an independent float64 recomputation)
GuaranteeKind = Literal["bit_identical", "within_bound", "within_float64_recomputation"]


@dataclass(frozen=True)
class Guarantee:
    """What a verified case's stored tensors are, as established by its recomputation.

    Attributes
    ----------
    kind : {"bit_identical", "within_bound", "within_float64_recomputation"}
    reference : str
        The recomputation they were checked against: ``"exact"`` (the correctly rounded
        result) or ``"numpy"`` (where the exact generator did not run the case).
    kappa : float or None
        The conditioning factor ``max(1, max|scores| / 16)`` of the bound.
    forward_bound : float or None
        Allowed normwise relative difference of the forward tensors (``1e-14 * kappa``, twice
        that against a float64 recomputation).
    gradient_bound : float or None
        Allowed difference of each element, relative to its natural magnitude (``1e-12 *
        kappa``, twice that against a float64 recomputation).
    worst_fraction : float or None
        Largest share of its allowance any tensor used (<= 1).
    worst_tensor : str or None
        The tensor that used it.
    reason : str
        Why the exact generator did not run the case (empty when it did).
    natural : bool
        Whether gradients were measured against their natural magnitude (dot-family calls);
        else normwise and against ``max|reference|`` per element.

    Examples
    --------
    >>> Guarantee("bit_identical", "exact").text
    'bit-identical to the correctly rounded result'
    >>> g = Guarantee("within_bound", "exact", 1.0, 1e-14, 1e-12, 0.09, "output")
    >>> g.short
    'within bound (9.0%)'
    """

    kind: GuaranteeKind
    reference: str
    kappa: float | None = None
    forward_bound: float | None = None
    gradient_bound: float | None = None
    worst_fraction: float | None = None
    worst_tensor: str | None = None
    reason: str = ""
    natural: bool = True

    @property
    def text(self) -> str:
        """The guarantee in one sentence."""
        if self.kind == "bit_identical":
            return "bit-identical to the correctly rounded result"
        scale = ("of their natural magnitude" if self.natural
                 else "normwise and of max|reference| per element")
        bound = (f"forward tensors {self.forward_bound:.1e} normwise, gradients "
                 f"{self.gradient_bound:.1e} {scale} (kappa {self.kappa:.3g}); worst "
                 f"{self.worst_tensor} at {self.worst_fraction:.1%} of its bound")
        if self.kind == "within_bound":
            return f"within the float64 backend bound of the correctly rounded result: {bound}"
        return (f"within twice the float64 backend bound of an independent float64 "
                f"({self.reference}) recomputation: {bound}; the exact generator did not run "
                f"this case: {self.reason}")

    @property
    def short(self) -> str:
        """The guarantee in the report's column."""
        match self.kind:
            case "bit_identical":
                return "bit-identical"
            case "within_bound":
                return f"within bound ({self.worst_fraction:.1%})"
            case _:
                return f"float64 2x bound ({self.worst_fraction:.1%})"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values, ``text`` included."""
        return {**asdict(self), "text": self.text}


@dataclass(frozen=True)
class CaseResult:
    """The verdict on one case.

    Attributes
    ----------
    case_id : str
    tensors_checked : int
        Tensors whose sha256 was checked.
    recompute_error : float or None
        Largest float64 difference between the stored and recomputed tensors (None: skipped).
    bit_identical : bool or None
        Whether the recomputation reproduced every stored tensor bit for bit.
    gradcheck_error : float or None
        Largest error/tolerance of the gradient check (<= 1 passes; None: skipped).
    gradcheck_inputs : tuple of str
        Inputs whose stored gradient was checked.
    gradcheck_method : str
        ``check_vjp full`` / ``check_vjp directional`` (gradcheck's checker) or
        ``central_difference``.
    certified : int or None
        Elements confirmed correctly rounded by the rounding certificate (None: not run).
    problems : tuple of Problem
    notes : tuple of str
    guarantee : Guarantee or None
        Which guarantee the recomputation established (None: not recomputed, or none held).
    backend : str or None
        The other engine ``--backend`` ran on this case (None: none, or it could not).
    backend_error : float or None
        Its max|stored - recomputed| (float64 rule of ``refattn compare``).
    """

    case_id: str
    tensors_checked: int = 0
    recompute_error: float | None = None
    bit_identical: bool | None = None
    gradcheck_error: float | None = None
    gradcheck_inputs: tuple[str, ...] = ()
    gradcheck_method: str = ""
    problems: tuple[Problem, ...] = ()
    notes: tuple[str, ...] = ()
    certified: int | None = None
    guarantee: Guarantee | None = None
    backend: str | None = None
    backend_error: float | None = None

    @property
    def passed(self) -> bool:
        return not self.problems

    def line(self, *, exact: bool = False) -> str:
        integrity = "FAIL" if any(p.stage in ("file", "tensor") for p in self.problems) else "ok"
        if self.recompute_error is None:
            recompute = "skipped"
        elif self.guarantee is not None:
            recompute = self.guarantee.short
        else:
            recompute = f"max|d| {self.recompute_error:.2e}"
        if any(p.stage in ("recompute", "manifest") for p in self.problems):
            recompute = "FAIL " + recompute
        grad = "skipped" if self.gradcheck_error is None else (
            f"{self.gradcheck_error:.1e} {self.gradcheck_method.split()[-1]} "
            f"({','.join(self.gradcheck_inputs)})")
        if any(p.stage == "gradcheck" for p in self.problems):
            grad = "FAIL " + grad
        cert = ""
        if exact:
            cert = "skipped" if self.certified is None else f"{self.certified} ok"
            if any(p.stage == "certificate" for p in self.problems):
                cert = "FAIL"
            cert = f"{cert:<14} "
        return (f"{'ok' if self.passed else 'FAIL':<4} {self.case_id:<44} {integrity:<5} "
                f"{self.tensors_checked:>3}  {recompute:<26} {grad:<28} {cert}".rstrip())

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON-ready values (``refattn verify --json``)."""
        out = asdict(self)
        out["passed"] = self.passed
        out["recompute_error"] = _json_float(self.recompute_error)
        out["backend_error"] = _json_float(self.backend_error)
        out["gradcheck_error"] = _json_float(self.gradcheck_error)
        out["gradcheck_inputs"] = list(self.gradcheck_inputs)
        out["notes"] = list(self.notes)
        out["guarantee"] = None if self.guarantee is None else self.guarantee.to_dict()
        return out


@dataclass(frozen=True)
class VerifyReport:
    """The verdict on a bundle: one :class:`CaseResult` per case plus bundle-level problems."""

    directory: str
    suite: str | None
    schema_version: str | None
    cases: tuple[CaseResult, ...]
    problems: tuple[Problem, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.problems and all(c.passed for c in self.cases)

    @property
    def all_problems(self) -> tuple[Problem, ...]:
        return self.problems + tuple(p for c in self.cases for p in c.problems)

    def format(self, *, legend: bool = True) -> str:
        """A legend, the table (failing cases start with ``FAIL``), then one line per problem
        naming case, tensor and reason, and the verdict."""
        exact = any(c.certified is not None for c in self.cases)
        cert = f"{'rounding cert.':<14}" if exact else ""
        lines = [
            f"bundle {self.directory}: suite {self.suite!r}, schema {self.schema_version}, "
            f"{len(self.cases)} case(s)",
        ]
        if legend:
            lines += LEGEND
        lines.append(f"{'':<4} {'case':<44} {'files':<5} {'sha':>3}  {'guarantee':<26} "
                     f"{'gradcheck (err/tol)':<28} {cert}".rstrip())
        lines += [c.line(exact=exact) for c in self.cases]
        lines += [f"note case={c.case_id}: {n}" for c in self.cases for n in c.notes]
        lines += [f"guarantee case={c.case_id}: {c.guarantee.text}" for c in self.cases
                  if c.guarantee is not None and c.guarantee.kind != "bit_identical"]
        lines += self.guarantee_summary()
        lines += [str(p) for p in self.all_problems]
        n_bad = sum(not c.passed for c in self.cases)
        lines.append("PASS" if self.passed else
                     f"FAILED: {n_bad} of {len(self.cases)} case(s), "
                     f"{len(self.all_problems)} problem(s)")
        return "\n".join(lines)

    def guarantee_summary(self) -> list[str]:
        """One line counting the cases per guarantee (none when nothing was recomputed).

        Examples
        --------
        >>> r = VerifyReport("b", "s", "1", (CaseResult("c", guarantee=Guarantee(
        ...     "bit_identical", "exact")), CaseResult("d")))
        >>> r.guarantee_summary()
        ['guarantees: 1 case(s) bit-identical to the correctly rounded result, 1 without one']
        """
        counts = {"bit_identical": 0, "within_bound": 0, "within_float64_recomputation": 0}
        for c in self.cases:
            if c.guarantee is not None:
                counts[c.guarantee.kind] += 1
        if not any(counts.values()):
            return []
        parts = [f"{n} case(s) {what}" for n, what in (
            (counts["bit_identical"], "bit-identical to the correctly rounded result"),
            (counts["within_bound"], "within the float64 backend bound of it"),
            (counts["within_float64_recomputation"],
             "within twice that bound of a float64 recomputation (exact did not run)"),
        ) if n]
        rest = len(self.cases) - sum(counts.values())
        if rest:
            parts.append(f"{rest} without one")
        out = ["guarantees: " + ", ".join(parts)]
        ran = [c for c in self.cases if c.backend_error is not None]
        for name in sorted({str(c.backend) for c in ran}):
            errs = [float(c.backend_error or 0.0) for c in ran if c.backend == name]
            out.append(f"backend {name!r}: ran {len(errs)} of {len(self.cases)} case(s), "
                       f"max|stored - recomputed| {max(errs):.2e} (float64 rule)")
        return out

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready values (``refattn verify --json``).

        Examples
        --------
        >>> r = VerifyReport("b", "contract", "1", (CaseResult("c", 3, 0.0, True),))
        >>> d = r.to_dict()
        >>> d["passed"], d["cases"][0]["bit_identical"], d["problems"]
        (True, True, [])
        """
        return {"directory": self.directory, "suite": self.suite,
                "schema_version": self.schema_version, "passed": self.passed,
                "cases": [c.to_dict() for c in self.cases],
                "problems": [asdict(p) for p in self.problems]}
