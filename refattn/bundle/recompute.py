"""Recompute a golden case with the engine and compare it with what the file stores.

Owns :func:`recompute`: the call rebuilt from the file (:mod:`refattn.bundle.spec`) runs
forward and backward (on the generator's reference path, or another backend), every stored
tensor is compared under the float64 rule of :mod:`refattn.bundle.compare`, and the rebuilt
call's manifest is compared field by field with the stored one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from refattn.bundle.cases import case_tensors, compute
from refattn.bundle.compare import compare
from refattn.bundle.report import Problem
from refattn.bundle.spec import CaseSpec
from refattn.engine import backward, forward
from refattn.errors import RefAttnError

__all__ = ["Unsupported", "recompute"]


def _first_difference(a: Any, b: Any, path: str = "") -> str | None:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{path}{key} (present on one side only)"
            diff = _first_difference(a[key], b[key], f"{path}{key}.")
            if diff:
                return diff
        return None
    return None if a == b else f"{path.rstrip('.')}: stored {b!r}, recomputed {a!r}"


class Unsupported(Exception):
    """The requested backend cannot run this call (not a defect of the bundle)."""


def recompute(spec: CaseSpec, backend: str) -> tuple[float, bool, list[Problem], Any]:
    case = spec.to_golden_case()
    if backend == "numpy":
        trace, grads = compute(case)
    else:
        try:
            with threadpool_limits(limits=1):
                trace = forward(case.call, backend=backend)
                grads = backward(trace, case.grad_output)
        except RefAttnError as exc:
            raise Unsupported(f"backend {backend!r} cannot run this case: {exc}") from None
    fresh = case_tensors(trace, grads)
    problems: list[Problem] = []
    for name in sorted(set(spec.tensors) - set(fresh)) if backend == "numpy" else ():
        problems.append(Problem(spec.case_id, name, "recompute",
                                "stored tensor is not produced by the recomputation"))
    for name in sorted(set(fresh) - set(spec.tensors)):
        problems.append(Problem(spec.case_id, name, "recompute",
                                "recomputation produces a tensor the file does not store"))
    common = {n: fresh[n] for n in fresh if n in spec.tensors}
    report = compare(common, spec, dtype="float64")
    for row in report.tensors:
        if not row.passed:
            problems.append(Problem(spec.case_id, row.name, "recompute", row.reason or "differs"))
    identical = not problems and all(
        np.array_equal(common[n], spec.tensors[n], equal_nan=common[n].dtype.kind == "f")
        for n in common
    )
    max_err = max((row.max_abs_error for row in report.tensors if row.rule == "float64"),
                  default=0.0)
    stored = dict(spec.call_manifest)
    rebuilt = trace.manifest()
    for m in (stored, rebuilt):
        m["backend"] = {k: v for k, v in m.get("backend", {}).items()
                        if k != "framework_revision" and backend == "numpy"}
        if backend != "numpy":  # another engine materialises what it chooses
            m.pop("materialization", None)
    diff = _first_difference(rebuilt, stored)
    if diff:
        problems.append(Problem(spec.case_id, None, "manifest",
                                f"rebuilt call manifest differs at {diff}"))
    return max_err, identical, problems, case
