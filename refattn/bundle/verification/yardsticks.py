"""Recompute the yardsticks a manifest stores and refuse any that differ (``refattn verify``).

Owns :func:`check_stored_yardsticks`. A case entry's ``yardsticks`` (written by ``refattn
golden --with-yardsticks``) is what the C++ header's ``refattn::compare`` multiplies by k to
bound a float32/float16/bfloat16 candidate. The manifest's sha256s cover the case files, not
the manifest's own fields, so a stored yardstick is only as trusted as the manifest: an
inflated one would loosen every C++ check of that tensor. Verify therefore recomputes each
stored yardstick from the case's verified tensors (:func:`refattn.bundle.native.yardstick_table`,
the numbers Python's ``compare`` computes for itself) and fails the case when any stored
number differs from the recomputed one, when a stored tensor is one the case lacks, or when a
stored record is malformed. Python's ``compare`` never reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from refattn.bundle.comparison.tolerances import LOWER_PRECISIONS
from refattn.bundle.golden.spec import CaseSpec
from refattn.bundle.native import yardstick_table
from refattn.bundle.storage.problems import Problem
from refattn.errors import RefAttnError

__all__ = ["check_stored_yardsticks"]

_FIELDS = ("reference_error", "natural_magnitude")


def _stored(record: Any) -> float | None:
    """The value of a ``{"hex", "decimal"}`` record (None: malformed)."""
    if not isinstance(record, Mapping) or not isinstance(record.get("hex"), str):
        return None
    try:
        return float.fromhex(record["hex"][:40])
    except (ValueError, OverflowError):
        return None


def check_stored_yardsticks(spec: CaseSpec, entry: Mapping[str, Any]) -> list[Problem]:
    """The problems of the yardsticks ``entry`` stores for ``spec`` (none stored: none).

    Parameters
    ----------
    spec : CaseSpec
        The case, read back with every checksum verified.
    entry : mapping
        Its (schema-checked) manifest entry.

    Returns
    -------
    list of Problem
        Stage ``manifest``, one per differing or malformed number, naming the dtype, the
        tensor, the stored and the recomputed value.

    Examples
    --------
    >>> from refattn.bundle.suites import build_suite
    >>> from refattn.bundle.golden.spec import case_spec
    >>> spec = case_spec(build_suite("contract")[1])
    >>> table = yardstick_table(spec, "float32", ["output"])
    >>> check_stored_yardsticks(spec, {"yardsticks": {"float32": table}})
    []
    >>> table["output"]["reference_error"]["hex"] = "0x1.0p+0"  # inflated
    >>> found = check_stored_yardsticks(spec, {"yardsticks": {"float32": table}})
    >>> [(p.tensor, p.reason[:47], p.reason.endswith("loosen the C++ check)")) for p in found]
    [('output', 'stored float32 reference_error 1.0 differs from', True)]
    """
    stored = entry.get("yardsticks")
    if stored is None:
        return []
    case = spec.case_id

    def problem(tensor: str | None, reason: str) -> Problem:
        return Problem(case, tensor, "manifest", reason)

    if not isinstance(stored, Mapping):
        return [problem(None, "yardsticks: expected an object {dtype: {tensor: record}}")]
    out: list[Problem] = []
    for dtype, table in stored.items():
        if dtype not in LOWER_PRECISIONS or not isinstance(table, Mapping):
            out.append(problem(None, f"yardsticks: {str(dtype)[:40]!r} is not one of "
                               f"{list(LOWER_PRECISIONS)} with an object of tensors"))
            continue
        names = [str(n) for n in table]
        try:
            fresh = yardstick_table(spec, dtype, names)
        except RefAttnError as exc:
            out.append(problem(None, f"yardsticks {dtype}: cannot recompute them ({exc})"))
            continue
        for name in names:
            if name not in fresh:
                out.append(problem(name[:80], f"a {dtype} yardstick is stored for a tensor "
                                   "the case lacks or the naive algorithm does not compute"))
                continue
            for field in _FIELDS:
                record = table[name].get(field) if isinstance(table[name], Mapping) else None
                have = _stored(record)
                want = float.fromhex(fresh[name][field]["hex"])
                if have is None:
                    out.append(problem(name, f"stored {dtype} {field} is not a hex-float "
                                       f"record: {str(record)[:80]}"))
                elif have != want:
                    looser = " (larger: it would loosen the C++ check)" if have > want else ""
                    out.append(problem(name, f"stored {dtype} {field} {have!r} differs from "
                                       f"the recomputed {want!r}{looser}"))
    return out
