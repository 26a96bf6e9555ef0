"""Verdicts of ``refattn verify``: problems, per-case results and the bundle report.

Owns :class:`Problem` (which case, which tensor, which stage, why), :class:`CaseResult` and
:class:`VerifyReport` with the table ``refattn verify`` prints. Holds no logic beyond
formatting; the checks that fill them live in :mod:`refattn.bundle.read`,
:mod:`refattn.bundle.recompute`, :mod:`refattn.bundle.gradients` and :mod:`refattn.bundle.verifier`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

__all__ = ["LEGEND", "CaseResult", "Problem", "Stage", "VerifyReport"]

#: what each column of :meth:`VerifyReport.format` means (printed above the table)
LEGEND = (
    "columns: FAIL/ok = the case's verdict; files = the case file and its tensors' sha256 "
    "(ok/FAIL);",
    "  sha = tensors whose sha256 matched the manifest; recompute = the case recomputed by "
    "its generator:",
    "  bit-identical, or max|stored - recomputed| under the float64 rule; gradcheck = the "
    "stored gradients",
    "  against numeric derivatives: worst error/tolerance (<= 1 passes), the mode and the "
    "inputs checked;",
    "  rounding cert. (--exact) = elements confirmed correctly rounded",
)


def _json_float(x: float | None) -> float | str | None:
    """A float for JSON: non-finite as ``"nan"``, ``"inf"``, ``"-inf"``."""
    if x is None or math.isfinite(x):
        return x
    return repr(float(x))

Stage = Literal["bundle", "file", "tensor", "recompute", "manifest", "gradcheck", "certificate"]


@dataclass(frozen=True)
class Problem:
    """One failure: which case, which tensor (if any), at which stage, and why."""

    case_id: str | None
    tensor: str | None
    stage: Stage
    reason: str

    def __str__(self) -> str:
        where = f"case={self.case_id or '-'} tensor={self.tensor or '-'}"
        return f"FAIL {where} [{self.stage}]: {self.reason}"


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

    @property
    def passed(self) -> bool:
        return not self.problems

    def line(self, *, exact: bool = False) -> str:
        integrity = "FAIL" if any(p.stage in ("file", "tensor") for p in self.problems) else "ok"
        if self.recompute_error is None:
            recompute = "skipped"
        elif self.bit_identical:
            recompute = "bit-identical"
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
                f"{self.tensors_checked:>3}  {recompute:<22} {grad:<28} {cert}".rstrip())

    def to_dict(self) -> dict[str, Any]:
        """The result as JSON-ready values (``refattn verify --json``)."""
        out = asdict(self)
        out["passed"] = self.passed
        out["recompute_error"] = _json_float(self.recompute_error)
        out["gradcheck_error"] = _json_float(self.gradcheck_error)
        out["gradcheck_inputs"] = list(self.gradcheck_inputs)
        out["notes"] = list(self.notes)
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
        lines.append(f"{'':<4} {'case':<44} {'files':<5} {'sha':>3}  {'recompute':<22} "
                     f"{'gradcheck (err/tol)':<28} {cert}".rstrip())
        lines += [c.line(exact=exact) for c in self.cases]
        lines += [f"note case={c.case_id}: {n}" for c in self.cases for n in c.notes]
        lines += [str(p) for p in self.all_problems]
        n_bad = sum(not c.passed for c in self.cases)
        lines.append("PASS" if self.passed else
                     f"FAILED: {n_bad} of {len(self.cases)} case(s), "
                     f"{len(self.all_problems)} problem(s)")
        return "\n".join(lines)

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
