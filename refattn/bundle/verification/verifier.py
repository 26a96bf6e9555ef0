"""Verify a golden bundle, reading straight through: bundle -> call -> engine -> compare -> report.

Owns :func:`verify` (``refattn verify DIR``). For every case, in order and each step owned by
one module: (1) the manifest is read from inside the bundle and validated against its published
JSON Schema (:mod:`refattn.bundle.storage.manifest`); (2) each case file is read from inside the
bundle only (no link followed, regular files only, size bounded), the file's and every tensor's
sha256 are checked and the case is loaded (:mod:`refattn.bundle.storage.read`); (3) the call is
rebuilt from the file (:mod:`refattn.bundle.golden.spec`) and the recorded conventions and flags
are checked against it, and any yardsticks the entry stores are recomputed and must equal the
stored ones (:mod:`refattn.bundle.verification.yardsticks`); (4) the exact generator recomputes
it, whatever the manifest says made it, and every stored tensor is compared with the correctly
rounded result: bit-identical, or within the documented float64 backend bound of it
(:mod:`refattn.bundle.verification.recompute`, :mod:`refattn.bundle.golden.guarantee`); (5) the
stored backward is checked against numeric derivatives
(:mod:`refattn.bundle.verification.gradients`); (6) with ``exact``, every element is confirmed
correctly rounded (:mod:`refattn.analysis.certificate`); (7) the verdicts are collected
(:mod:`refattn.bundle.verification.report`). No step reaches back up.
"""

from __future__ import annotations

import os
import stat
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from gradcheck.errors import GradcheckError
from refattn._boundary import public
from refattn._checks import check_finite
from refattn._progress import progress as progress_bar
from refattn.analysis.certificate import certify
from refattn.bundle.golden.case import numpy_environment
from refattn.bundle.golden.spec import case_spec
from refattn.bundle.storage.fsio import list_confined
from refattn.bundle.storage.manifest import check_schema, read_manifest
from refattn.bundle.storage.problems import Problem
from refattn.bundle.storage.read import check_case_file, load_bytes
from refattn.bundle.verification.gradients import (
    GradcheckMethod,
    check_method,
    check_stored_gradients,
)
from refattn.bundle.verification.recompute import REQUIREMENTS, Unsupported, check_recorded
from refattn.bundle.verification.recompute import recompute as recompute_case
from refattn.bundle.verification.report import CaseResult, VerifyReport
from refattn.bundle.verification.yardsticks import check_stored_yardsticks
from refattn.engine import BACKENDS
from refattn.engine.exact.backend import DEFAULT_MAX_SECONDS
from refattn.errors import RefAttnError

__all__ = ["OpenedBundle", "check_file", "open_bundle", "same_environment", "verify",
           "verify_case_bytes"]


# -- one case --------------------------------------------------------------------------------
def check_file(directory: Path, case_id: str, entry: Mapping[str, Any]
               ) -> tuple[CaseResult | None, int, bytes | bytearray | None]:
    """Step (2)'s reading: the case file's path, bytes and checksums, from inside the bundle.

    Returns ``(verdict, tensors checked, bytes)``: a final :class:`CaseResult` when the file
    fails (then no bytes), else None and the file's bytes for :func:`verify_case_bytes`.
    """
    rel = entry["file"]
    if rel != f"cases/{case_id}.safetensors":
        return CaseResult(case_id, 0, problems=(Problem(
            case_id, None, "file", f"manifest names file {rel!r}; case {case_id!r} must be "
            f"stored as 'cases/{case_id}.safetensors'"),)), 0, None
    checked, problems, data = check_case_file(case_id, directory, entry)
    if problems or data is None:
        return CaseResult(case_id, checked, problems=tuple(problems)), checked, None
    return None, checked, data


def verify_case_bytes(case_id: str, entry: Mapping[str, Any], data: bytes | bytearray,
                      checked: int, *,
                      recompute: bool = True, gradcheck: bool = True,
                      method: GradcheckMethod = "auto", backend: str | None = None,
                      exact: bool = False, bit_identical: bool | None = None,
                      require: str = "float64",
                      exact_max_seconds: float = DEFAULT_MAX_SECONDS,
                      generator: Mapping[str, Any] | None = None) -> CaseResult:
    """Steps (3)-(6) of one case whose bytes :func:`check_file` read (a worker's task in
    ``refattn verify --workers``): the verdict :func:`verify` gives that case (``generator``:
    the bundle manifest's record, checked against the case's own claim)."""
    manifest: dict[str, Any] = {"cases": {case_id: entry}}
    if generator is not None:
        manifest["generator"] = generator
    return _verify_case(Path("."), case_id, entry, manifest,
                        recompute=recompute, gradcheck=gradcheck, method=method,
                        backend=backend, exact=exact, bit_identical=bit_identical,
                        require=require, exact_max_seconds=exact_max_seconds,
                        loaded=(checked, data))


def _verify_case(directory: Path, case_id: str, entry: Mapping[str, Any], manifest: Any, *,
                 recompute: bool, gradcheck: bool, method: GradcheckMethod,
                 backend: str | None, exact: bool, bit_identical: bool | None,
                 require: str = "float64", exact_max_seconds: float = DEFAULT_MAX_SECONDS,
                 loaded: tuple[int, bytes | bytearray] | None = None) -> CaseResult:
    rel = entry["file"]
    if loaded is None:
        verdict, checked, data = check_file(directory, case_id, entry)
        if verdict is not None or data is None:
            return verdict or CaseResult(case_id, checked)
    else:
        checked, data = loaded
    problems: list[Problem] = []
    try:
        case_file = load_bytes(data, rel, manifest=manifest, file_name=Path(rel).name)
        if case_file.case_id != case_id:
            raise RefAttnError(f"{rel}: the file holds case {case_file.case_id!r}, not "
                               f"{case_id!r}")
        spec = case_spec(case_file)
        problems += check_recorded(spec, spec.to_call())
        if "grad_output" in spec.tensors:  # the cotangent is an input too: finite, or the case
            check_finite("grad_output", np.asarray(spec.tensors["grad_output"]))  # fails
        problems += _generator_claims(spec, manifest)
        problems += check_stored_yardsticks(spec, entry)  # recomputed whatever the options
    except RefAttnError as exc:
        return CaseResult(case_id, checked, problems=(Problem(case_id, None, "file", str(exc)),))
    max_err = identical = grad_err = guarantee = backend_error = None
    inputs: tuple[str, ...] = ()
    case = None
    notes: list[str] = []
    if recompute:
        try:
            done = recompute_case(spec, backend, bit_identical=bit_identical, require=require,
                                  exact_max_seconds=exact_max_seconds)
            max_err, identical, guarantee, case = (done.max_abs_error, done.bit_identical,
                                                   done.guarantee, done.case)
            backend_error = done.backend_error
            problems += done.problems
            notes += done.notes
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
        except (RefAttnError, GradcheckError) as exc:
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
                      tuple(problems), tuple(notes), certified, guarantee,
                      backend if backend_error is not None else None, backend_error)


def _generator_claims(spec: Any, manifest: Any) -> list[Problem]:
    """The bundle's generator record against the case's own claim (its call manifest): one
    backend names every case's; ``mixed`` lists each case's."""
    generator = manifest.get("generator") if isinstance(manifest, Mapping) else None
    if not isinstance(generator, Mapping) or "backend" not in generator:
        return []
    named = str(generator.get("backend"))
    allowed = {str(b) for b in generator.get("backends") or ()} if named == "mixed" else {named}
    if spec.generator in allowed:
        return []
    return [Problem(spec.case_id, None, "manifest", f"the bundle's generator record names "
                    f"{sorted(allowed)}, the case's call manifest {spec.generator!r}")]


# -- the bundle -----------------------------------------------------------------------------
@public
def verify(directory: str | os.PathLike, *, recompute: bool = True,
           gradcheck: bool = True, gradcheck_method: GradcheckMethod = "auto",
           backend: str | None = None, exact: bool = False, require: str = "float64",
           exact_max_seconds: float = DEFAULT_MAX_SECONDS,
           progress: bool | None = None) -> VerifyReport:
    """Verify every case of the bundle in ``directory``.

    Parameters
    ----------
    directory : path
        A bundle written by ``refattn golden`` (``manifest.json`` and ``cases/``).
    recompute : bool
        Rebuild each call and recompute it with the ``exact`` generator, whatever the manifest
        says made it. Each case then carries its guarantee (``CaseResult.guarantee``):
        bit-identical to the correctly rounded result, or within the documented float64
        backend bound of it (docs/verify.md); a tensor beyond that bound fails, naming its
        worst element. A case the manifest says the exact generator wrote must be
        bit-identical (the first and worst differing elements are named); a ``numpy`` case
        written on this machine's numpy and BLAS must also be regenerated bit for bit. Where
        the exact generator does not run a case (over ``exact_max_seconds``), the case says
        so and is checked within twice the bound of a float64 (numpy) recomputation.
    backend : str, optional
        Another engine to run on every case too, e.g. ``"numba"``: its tensors must meet the
        float64 rule against the stored ones; cases it cannot run are noted, not failed.
    require : {"float64", "exact"}
        ``"exact"`` fails every case that is not bit-identical to the correctly rounded
        result (it needs ``recompute``).
    exact_max_seconds : float
        The exact generator's limit per case, on its estimate made before any arithmetic.
    exact : bool
        Also run the rounding certificate (:func:`refattn.analysis.certificate.certify`):
        every stored element must be the correctly rounded value of its definition.
    gradcheck : bool
        Check each case's stored gradients against numeric derivatives.
    gradcheck_method : {"auto", "check_vjp", "central_difference"}
        ``check_vjp``: gradcheck's checker (complex step, element by element for small
        cases); ``central_difference``: :func:`gradient_check` along one random direction
        per input; ``auto``: the first when available.
    progress : bool or None
        A progress bar over the cases on standard error: None (default) on a terminal only,
        False never, True always.

    Returns
    -------
    VerifyReport
        ``report.passed``; ``report.format()`` is the table ``refattn verify`` prints.

    Examples
    --------
    >>> import tempfile
    >>> from refattn.bundle.writing.write import write_bundle
    >>> from refattn.bundle.suites import build_suite
    >>> d = tempfile.mkdtemp()
    >>> _ = write_bundle(d, build_suite("contract")[:2], suite="contract")
    >>> r = verify(d)
    >>> r.passed, [c.guarantee.text for c in r.cases]     # doctest: +NORMALIZE_WHITESPACE
    (True, ['bit-identical to the correctly rounded result',
            'bit-identical to the correctly rounded result'])
    """
    bundle = open_bundle(directory, backend=backend, gradcheck_method=gradcheck_method,
                         require=require, recompute=recompute,
                         exact_max_seconds=exact_max_seconds)
    results = [
        _verify_case(bundle.directory, case_id, entry, bundle.manifest, recompute=recompute,
                     gradcheck=gradcheck, method=gradcheck_method, backend=backend,
                     exact=exact, bit_identical=bundle.bit_identical, require=require,
                     exact_max_seconds=exact_max_seconds)
        for case_id, entry in progress_bar(sorted(bundle.manifest["cases"].items()),
                                           desc="verify", enabled=progress)
    ]
    return bundle.report(results)


class OpenedBundle(NamedTuple):
    """A bundle whose manifest has been read and validated (see :func:`open_bundle`)."""

    directory: Path
    raw: Mapping[str, Any]
    manifest: Mapping[str, Any]
    #: True where the bundle's numpy or numba generator ran on this very environment (its
    #: bytes must then come back identical), else None (the float64 rule applies)
    bit_identical: bool | None

    def report(self, results: Sequence[CaseResult]) -> VerifyReport:
        """The report of ``results`` (one per case, in case order), the listing check, and a
        bundle that holds no case (which verifies nothing: it fails)."""
        problems = _listing_problems(self.directory, self.manifest)
        if not self.manifest["cases"]:
            problems.append(Problem(None, None, "bundle", "the bundle holds no case; a bundle "
                                    "verifies something only where it holds cases"))
        return VerifyReport(str(self.directory), self.manifest.get("suite"),
                            str(self.raw.get("schema_version")), tuple(results),
                            tuple(problems))


def open_bundle(directory: str | os.PathLike, *, backend: str | None,
                gradcheck_method: GradcheckMethod, require: str = "float64",
                recompute: bool = True,
                exact_max_seconds: float = DEFAULT_MAX_SECONDS) -> OpenedBundle:
    """Check verify's options, then read and validate the manifest of ``directory``.

    Examples
    --------
    >>> import tempfile
    >>> from refattn.bundle.writing.write import write_bundle
    >>> from refattn.bundle.suites import build_suite
    >>> d = tempfile.mkdtemp()
    >>> _ = write_bundle(d, build_suite("contract")[:1], suite="contract")
    >>> b = open_bundle(d, backend=None, gradcheck_method="auto")
    >>> len(b.manifest["cases"]), b.bit_identical   # an exact bundle: no numpy bytes to match
    (1, None)
    """
    if backend is not None and backend not in BACKENDS:
        raise RefAttnError(f"backend: unknown backend {backend!r}; known: {sorted(BACKENDS)}")
    check_method(gradcheck_method)
    if require not in REQUIREMENTS:
        raise RefAttnError(f"require: expected one of {list(REQUIREMENTS)}, got {require!r}")
    if require == "exact" and not recompute:
        raise RefAttnError("require: 'exact' needs the recomputation (drop --no-recompute)")
    if not (isinstance(exact_max_seconds, (int, float)) and exact_max_seconds >= 0
            and exact_max_seconds == exact_max_seconds):
        raise RefAttnError(f"exact_max_seconds: expected a number >= 0, got "
                           f"{exact_max_seconds!r}")
    directory = Path(directory)
    raw = read_manifest(directory / "manifest.json")
    manifest = check_schema(raw)
    return OpenedBundle(directory, raw, manifest,
                        True if same_environment(manifest.get("generator") or {}) else None)


def same_environment(generator: Mapping[str, Any]) -> bool:
    """Whether a bundle's float64 generator ran on this very environment, so that its bytes
    must come back identical: numpy with the same numpy and BLAS, or numba with the same
    numba, numpy, OpenBLAS (library, version and kernel) and generator layout.

    Examples
    --------
    >>> same_environment({"backend": "exact"}), same_environment({"backend": "numpy"})
    (False, False)
    >>> same_environment({"backend": "numpy", **numpy_environment()})
    True
    """
    match generator.get("backend"):
        case "numpy":
            here = numpy_environment()
        case "numba":
            from refattn.engine.numba.generator import environment  # loads numba

            here = {**environment(), "numpy": numpy_environment()["numpy"]}
        case _:
            return False
    return all(generator.get(k) == v for k, v in here.items())


def _listing_problems(directory: Path, manifest: Mapping[str, Any]) -> list[Problem]:
    """Entries of ``cases/`` the manifest does not list (by relative path, not basename) and
    anything there that is not a regular file (a link, a FIFO, a device, a directory)."""
    listed = {e["file"] for e in manifest["cases"].values()}
    out: list[Problem] = []
    try:  # never through a link: no name from outside the bundle is listed or printed
        entries = list_confined(directory, "cases") or []
    except RefAttnError as exc:
        return [Problem(None, None, "bundle", str(exc))]
    for name, mode in entries:
        rel = f"cases/{name}"
        if not stat.S_ISREG(mode):
            kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
            out.append(Problem(None, None, "bundle", f"{rel} is {kind}; a bundle holds only "
                               "regular files"))
        elif rel not in listed:
            out.append(Problem(None, None, "bundle", f"{rel} is not listed in the manifest"))
    return out

