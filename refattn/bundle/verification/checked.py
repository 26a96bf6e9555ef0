"""A bundle's cases for use outside ``verify`` (the pytest plugin, ``load_cases``), read with
verify's own checks.

Owns :func:`checked_cases`: the manifest is read from inside the bundle and validated against
its schema (:mod:`refattn.bundle.storage.manifest`); each case file goes through verify's reading
(:func:`refattn.bundle.verification.verifier.check_file`: the path the manifest must give, no link
followed, a regular file whose size the manifest bounds, its header and every hash checked in pieces
before it is read into memory); the case is loaded, its call rebuilt through the gate
(:class:`~refattn.AttentionCall`: float64, shapes, finite inputs, head map) and its recorded
conventions checked against it (:func:`refattn.bundle.verification.recompute.check_recorded`); its
``grad_output`` must be finite float64 of the output's shape. A case that fails any step is
returned with the reason, never dropped: a test parametrised with it FAILS (a NaN in ``q``
must never turn into a skipped test and a green CI). Defers the arithmetic to verify itself;
nothing is recomputed here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from refattn._checks import check_finite, check_float64, check_shape
from refattn.bundle.golden.spec import CaseSpec, case_spec
from refattn.bundle.storage.manifest import check_schema, read_manifest
from refattn.bundle.storage.read import load_bytes
from refattn.bundle.verification.recompute import check_recorded
from refattn.bundle.verification.verifier import check_file
from refattn.errors import RefAttnError

__all__ = ["CheckedCase", "checked_cases"]


class CheckedCase(NamedTuple):
    """One case of a bundle: its spec when every check passed, else the reason it failed."""

    case_id: str
    spec: CaseSpec | None
    failure: str | None


def _check_case(directory: Path, case_id: str, entry: Mapping[str, Any],
                manifest: Mapping[str, Any]) -> CheckedCase:
    verdict, _, data = check_file(directory, case_id, entry)
    if verdict is not None or data is None:
        reasons = "; ".join(str(p.reason) for p in (verdict.problems if verdict else ()))
        return CheckedCase(case_id, None, reasons or "the case file could not be read")
    rel = entry["file"]
    try:
        loaded = load_bytes(data, rel, manifest=manifest, file_name=Path(rel).name)
        if loaded.case_id != case_id:
            raise RefAttnError(f"{rel}: the file holds case {loaded.case_id!r}, not {case_id!r}")
        spec = case_spec(loaded)
        call = spec.to_call()  # the gate: dtype, shapes, finite inputs, head map
        problems = check_recorded(spec, call)
        if problems:
            raise RefAttnError("; ".join(p.reason for p in problems))
        g = spec.tensors.get("grad_output")
        if g is None:
            raise RefAttnError(f"{case_id}: tensor 'grad_output' is missing")
        check_float64("grad_output", g)
        B, Hq, Q, _ = call.q.shape
        check_shape("grad_output", g, (B, Hq, Q, call.v.shape[3]), "B,Hq,Q,Dv")
        check_finite("grad_output", g)
    except RefAttnError as exc:
        return CheckedCase(case_id, None, str(exc))
    return CheckedCase(case_id, spec, None)


def checked_cases(directory: str | os.PathLike) -> list[CheckedCase]:
    """Every case of the bundle in ``directory``, in case-id order, each checked as ``verify``
    reads it (see the module docstring).

    Parameters
    ----------
    directory : path
        A bundle written by ``refattn golden`` (``manifest.json`` and ``cases/``).

    Returns
    -------
    list of CheckedCase
        ``spec`` set and ``failure`` None for a case that passed, the reverse for one that
        did not.

    Raises
    ------
    RefAttnError
        When the manifest itself cannot be read or fails its schema (no case can be named).

    Examples
    --------
    >>> import tempfile
    >>> from refattn.bundle.writing.write import write_bundle
    >>> from refattn.bundle.suites import build_suite
    >>> d = tempfile.mkdtemp()
    >>> _ = write_bundle(d, build_suite("contract")[:1], suite="contract")
    >>> [(c.case_id, c.failure) for c in checked_cases(d)]
    [('loop6_two_query_training_trace', None)]
    """
    directory = Path(directory)
    manifest = check_schema(read_manifest(directory / "manifest.json"))
    out = []
    for case_id, entry in sorted(manifest["cases"].items()):
        try:
            out.append(_check_case(directory, case_id, entry, manifest))
        except MemoryError:
            out.append(CheckedCase(case_id, None, "out of memory while reading the case"))
        except (ValueError, TypeError, KeyError, IndexError, OverflowError) as exc:
            out.append(CheckedCase(case_id, None, f"{type(exc).__name__}: {str(exc)[:160]}"))
    return out
