"""``assert_matches``: a function's outputs against a golden case, as one pytest assertion.

Owns the assertion and its message: the same tolerance model as ``refattn compare``
(:func:`refattn.bundle.comparison.harness.compare`: the float64 rule per element, the
reference-relative rule for float32, float16 and bfloat16), failing with the worst element, its
index, the two values and the tolerance of every failing tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from refattn._boundary import public
from refattn._checks import format_index
from refattn.bundle.comparison.harness import Report, TensorReport, compare, plain
from refattn.bundle.golden.spec import CaseSpec
from refattn.testing.case import Case

__all__ = ["assert_matches"]


def _failure(t: TensorReport, precision: str) -> str:
    if t.rule == "structure" or t.worst_index is None:
        return f"  {t.name}: {t.reason}"
    where = ("tolerance there" if t.rule == "float64" else
             f"tolerance of the tensor ({precision} rule)")
    return (f"  {t.name}: worst element {format_index(t.worst_index)}: candidate "
            f"{plain(t.worst_candidate)} vs golden {plain(t.worst_golden)}, |error| "
            f"{t.max_abs_error:.3e} > {where} {t.bound:.3e}; {t.failing_count} element(s) "
            f"fail" + ("" if t.reason is None or "non-finite" not in t.reason else
                       f"; {t.reason.split(';')[0]}"))


@public
def assert_matches(case: Case | CaseSpec | Any, outputs: Mapping[str, Any], *,
                   dtype: Any = None, tolerances: Any = None, check: str = "auto") -> Report:
    """Assert that ``outputs`` match the golden case under ``refattn compare``'s rule.

    Parameters
    ----------
    case : Case, CaseSpec, GoldenCase or case file
        The golden case (a :class:`~refattn.testing.Case` from ``@refattn.testing.cases``).
    outputs : mapping of str to array
        Canonical names (``output``, ``grad_q``, ``grad_k``, ``grad_v``, ``grad_bias``,
        ``lse``, ...) to NumPy arrays, torch tensors (autograd detached) or JAX arrays. A
        ``None`` value counts as absent.
    dtype : str, optional
        The precision of the rule (default: the case's dtype, else the arrays' own):
        float64 is judged per element by ``|a - g| <= 1e-12 + 1e-10 |g|``; float32, float16
        and bfloat16 by ``max|a - g| <= k * max|naive - g| + floor``, where ``naive`` is
        refattn's naive algorithm run in that dtype (k = 2 forward, 3 for gradients).
    tolerances : refattn.bundle.Tolerances, optional
    check : {"auto", "forward", "gradients", "listed"}
        What ``outputs`` must hold: ``auto`` (default) needs ``output``, and every input
        gradient of the case as soon as one gradient is given.

    Returns
    -------
    Report
        The comparison (``report.format()`` prints the table).

    Raises
    ------
    AssertionError
        Naming, for every failing tensor, the worst element's index, candidate and golden
        values and the tolerance, then each diagnosis once (``diagnosis: ...``, a hypothesis
        recomputed and found to fit), followed by the full report.

    Examples
    --------
    >>> from refattn.bundle.golden.spec import case_spec
    >>> from refattn.bundle.suites.conformance import CASES
    >>> case = Case(case_spec(CASES["causal_square"]()))
    >>> out = case.expected["output"].copy()
    >>> assert_matches(case, {"output": out}).passed
    True
    >>> out[0, 1, 2, 3] += 1e-6
    >>> try:
    ...     assert_matches(case, {"output": out})
    ... except AssertionError as exc:
    ...     print(str(exc).splitlines()[1].split(": candidate")[0])
      output: worst element (0, 1, 2, 3)
    """
    __tracebackhide__ = True
    golden = case.spec if isinstance(case, Case) else case
    if dtype is None and isinstance(case, Case):
        dtype = case.dtype
    given = {name: x for name, x in outputs.items() if x is not None}
    report = compare(given, golden, dtype=dtype, tolerances=tolerances, check=check)
    if not report.passed:
        failing = [t for t in report.tensors if not t.passed]
        lines = [f"{report.case_id} ({report.precision}, rule {report.rule_text()}): "
                 f"{len(failing)} of {len(report.tensors)} tensor(s) do not match"]
        lines += [_failure(t, report.precision) for t in failing]
        lines += [f"  {d.line()}" for d in report.diagnoses]  # here only, not in the table
        lines += ["", report.format(legend=False, diagnoses=False)]
        raise AssertionError("\n".join(lines))
    return report
