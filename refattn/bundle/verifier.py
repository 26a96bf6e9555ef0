"""Verify a golden bundle, reading straight through: bundle -> call -> engine -> compare -> report.

Owns :func:`verify` (``refattn verify DIR``). For every case, in order and each step owned by
one module: (1) the manifest is read and its schema checked (:mod:`refattn.bundle.manifest`);
(2) the file's and every tensor's sha256 are checked against it and the case is loaded
(:mod:`refattn.bundle.read`); (3) the call is rebuilt from the file (:mod:`refattn.bundle.spec`);
(4) the engine recomputes it and every stored tensor is compared
(:mod:`refattn.bundle.recompute`); (5) the stored backward is checked against numeric
derivatives (:mod:`refattn.bundle.gradients`); (6) with ``exact``, every element is confirmed
correctly rounded (:mod:`refattn.analysis.certificate`); (7) the verdicts are collected
(:mod:`refattn.bundle.report`). No step reaches back up.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from refattn.analysis.certificate import certify
from refattn.bundle.gradients import GradcheckMethod, check_method, check_stored_gradients
from refattn.bundle.manifest import check_schema, read_manifest
from refattn.bundle.read import check_case_file, load
from refattn.bundle.recompute import Unsupported
from refattn.bundle.recompute import recompute as recompute_case
from refattn.bundle.report import CaseResult, Problem, VerifyReport
from refattn.bundle.spec import case_spec
from refattn.engine import BACKENDS
from refattn.errors import RefAttnError

__all__ = ["verify"]


# -- one case --------------------------------------------------------------------------------
def _verify_case(directory: Path, case_id: str, entry: Mapping[str, Any], manifest: Any, *,
                 recompute: bool, gradcheck: bool, method: GradcheckMethod,
                 backend: str | None, exact: bool) -> CaseResult:
    rel = entry.get("file", f"cases/{case_id}.safetensors")
    path = directory / rel
    checked, problems = check_case_file(case_id, path, entry)
    if problems:
        return CaseResult(case_id, checked, problems=tuple(problems))
    try:
        spec = case_spec(load(path, manifest=manifest))
    except RefAttnError as exc:
        return CaseResult(case_id, checked, problems=(Problem(case_id, None, "file", str(exc)),))
    max_err = identical = grad_err = None
    inputs: tuple[str, ...] = ()
    case = None
    notes: list[str] = []
    if recompute:
        try:
            max_err, identical, found, case = recompute_case(spec, backend)
            problems += found
        except Unsupported as exc:
            notes.append(str(exc))
        except RefAttnError as exc:
            problems.append(Problem(case_id, None, "recompute", str(exc)))
    grad_method = ""
    if gradcheck:
        try:
            case = case or spec.to_golden_case()
            grad_err, inputs, grad_method, found = check_stored_gradients(
                case, spec, seed=zlib.crc32(case_id.encode()), method=method)
            problems += found
        except RefAttnError as exc:
            problems.append(Problem(case_id, None, "gradcheck", str(exc)))
    certified = None
    if exact:
        try:
            case = case or spec.to_golden_case()
            cert = certify(case.call, spec.tensors)
            certified = sum(c.checked for c in cert.checks)
            problems += [Problem(case_id, c.tensor, "certificate", c.failure or "")
                         for c in cert.failures]
        except RefAttnError as exc:
            problems.append(Problem(case_id, None, "certificate", str(exc)))
    return CaseResult(case_id, checked, max_err, identical, grad_err, inputs, grad_method,
                      tuple(problems), tuple(notes), certified)


# -- the bundle -----------------------------------------------------------------------------
def verify(directory: str | os.PathLike, *, recompute: bool = True,
           gradcheck: bool = True, gradcheck_method: GradcheckMethod = "auto",
           backend: str | None = None, exact: bool = False) -> VerifyReport:
    """Verify every case of the bundle in ``directory``.

    Parameters
    ----------
    directory : path
        A bundle written by ``refattn golden`` (``manifest.json`` and ``cases/``).
    recompute : bool
        Rebuild each call, recompute it with the engine and compare (float64 rule).
    backend : str, optional
        Engine of the recomputation (default: each case's generator). The ``exact``
        generator must reproduce its file bit for bit (the first differing element is named);
        another backend, e.g. ``"numba"``, or the machine-dependent ``numpy`` generator must
        meet the float64 rule; cases a backend cannot run are noted, not failed.
    exact : bool
        Also run the rounding certificate (:func:`refattn.analysis.certificate.certify`):
        every stored element must be the correctly rounded value of its definition.
    gradcheck : bool
        Check each case's stored gradients against numeric derivatives.
    gradcheck_method : {"auto", "check_vjp", "central_difference"}
        ``check_vjp``: gradcheck's checker (complex step, element by element for small
        cases); ``central_difference``: :func:`gradient_check` along one random direction
        per input; ``auto``: the first when available.

    Returns
    -------
    VerifyReport
        ``report.passed``; ``report.format()`` is the table ``refattn verify`` prints.

    Examples
    --------
    >>> import tempfile
    >>> from refattn.bundle.write import write_bundle
    >>> from refattn.bundle.suites import build_suite
    >>> d = tempfile.mkdtemp()
    >>> _ = write_bundle(d, build_suite("contract")[:2], suite="contract")
    >>> r = verify(d)
    >>> r.passed, [c.bit_identical for c in r.cases]
    (True, [True, True])
    """
    if backend is not None and backend not in BACKENDS:
        raise RefAttnError(f"backend: unknown backend {backend!r}; known: {sorted(BACKENDS)}")
    check_method(gradcheck_method)
    directory = Path(directory)
    raw = read_manifest(directory / "manifest.json")
    manifest = check_schema(raw)
    results = [
        _verify_case(directory, case_id, entry, manifest, recompute=recompute,
                     gradcheck=gradcheck, method=gradcheck_method, backend=backend,
                     exact=exact)
        for case_id, entry in sorted(manifest["cases"].items())
    ]
    listed = {Path(e.get("file", "")).name for e in manifest["cases"].values()}
    bundle_problems = tuple(
        Problem(None, None, "bundle", f"cases/{p.name} is not listed in the manifest")
        for p in sorted((directory / "cases").glob("*.safetensors")) if p.name not in listed
    )
    return VerifyReport(str(directory), manifest.get("suite"), str(raw.get("schema_version")),
                        tuple(results), bundle_problems)
