"""Verify a golden bundle: checksums, recomputation with the engine, and a gradient check.

Owns :func:`verify` (used by ``refattn verify DIR``), the bundle schema-version check
:func:`check_schema` and the per-case verdicts. For every case: (1) the file's and every
tensor's sha256 against the manifest, naming the tensor whose bytes changed, a truncated file
or a missing tensor; (2) the call rebuilt from the file and recomputed by the engine, compared
under the float64 rule of :mod:`refattn.compare`; (3) the stored backward checked against
finite differences of the forward. Defers file layout to :mod:`refattn.golden`, call
reconstruction to :mod:`refattn.case_spec` and finite differences to :mod:`gradcheck`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

from refattn.errors import RefAttnError
from refattn.golden import SCHEMA, SCHEMA_VERSION

__all__ = [
    "READERS",
    "CaseResult",
    "Problem",
    "VerifyReport",
    "check_schema",
    "gradient_check",
    "read_manifest",
    "verify",
]

Stage = Literal["bundle", "file", "tensor", "recompute", "manifest", "gradcheck"]


def _major(version: str) -> int:
    try:
        major, minor = str(version).split(".")
        return int(major) if int(minor) >= 0 else -1
    except ValueError:
        raise RefAttnError(
            f"manifest: schema_version {version!r} is not of the form MAJOR.MINOR"
        ) from None


def _read_v1(manifest: dict[str, Any]) -> dict[str, Any]:
    """Schema 1.x is the current in-memory form (minor versions only add fields)."""
    return manifest


#: bundle schema major version -> reader returning the current in-memory manifest. A breaking
#: change bumps the major version, adds its reader here and keeps the old ones working.
READERS = {1: _read_v1}


def check_schema(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """Check a bundle manifest's schema and version; return it in the current form.

    Any 1.x manifest is read (a minor version only adds fields); an unknown major version is
    refused with a message naming both versions.

    Examples
    --------
    >>> check_schema({"schema": "refattn_golden", "schema_version": "1.3", "cases": {}})["cases"]
    {}
    >>> try:
    ...     check_schema({"schema": "refattn_golden", "schema_version": "2.0", "cases": {}})
    ... except RefAttnError as exc:
    ...     print(str(exc)[:60])
    manifest: schema_version '2.0' (major 2) is not readable her
    """
    if not isinstance(manifest, Mapping):
        raise RefAttnError(f"manifest: expected a JSON object, got {type(manifest).__name__}")
    if manifest.get("schema") != SCHEMA:
        raise RefAttnError(f"manifest: schema is {manifest.get('schema')!r}, expected {SCHEMA!r}")
    if "schema_version" not in manifest:
        raise RefAttnError("manifest: schema_version is missing")
    version = manifest["schema_version"]
    major = _major(version)
    if major not in READERS:
        raise RefAttnError(
            f"manifest: schema_version {version!r} (major {major}) is not readable here; this "
            f"refattn reads majors {sorted(READERS)} (writes {SCHEMA_VERSION})"
        )
    out = READERS[major](dict(manifest))
    if not isinstance(out.get("cases"), Mapping):
        raise RefAttnError("manifest: 'cases' is missing or not an object")
    return out


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """Parse a bundle's ``manifest.json`` (schema not yet checked: see :func:`check_schema`).

    Raises
    ------
    RefAttnError
        Naming the file when it cannot be read or is not valid JSON.
    """
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise RefAttnError(f"{path}: cannot read the bundle manifest ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise RefAttnError(f"{path}: manifest is not valid JSON ({exc})") from None


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
        ``central_difference`` (the fallback).
    problems : tuple of Problem
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

    @property
    def passed(self) -> bool:
        return not self.problems

    def line(self) -> str:
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
        return (f"{self.case_id:<44} {integrity:<5} {self.tensors_checked:>3}  {recompute:<22} "
                f"{grad:<28} {'ok' if self.passed else 'FAIL'}")


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

    def format(self) -> str:
        """The table, then one line per problem naming case, tensor and reason."""
        lines = [
            f"bundle {self.directory}: suite {self.suite!r}, schema {self.schema_version}, "
            f"{len(self.cases)} case(s)",
            f"{'case':<44} {'files':<5} {'sha':>3}  {'recompute':<22} "
            f"{'gradcheck (err/tol)':<28} result",
        ]
        lines += [c.line() for c in self.cases]
        lines += [f"note case={c.case_id}: {n}" for c in self.cases for n in c.notes]
        lines += [str(p) for p in self.all_problems]
        n_bad = sum(not c.passed for c in self.cases)
        lines.append("PASS" if self.passed else
                     f"FAILED: {n_bad} case(s), {len(self.all_problems)} problem(s)")
        return "\n".join(lines)


# -- integrity -----------------------------------------------------------------------------
def _integrity(case_id: str, path: Path, entry: Mapping[str, Any]) -> tuple[int, list[Problem]]:
    def problem(tensor: str | None, stage: Stage, reason: str) -> Problem:
        return Problem(case_id, tensor, stage, reason)

    try:
        data = path.read_bytes()
    except OSError as exc:
        return 0, [problem(None, "file", f"cannot read {path} ({exc.strerror})")]
    out: list[Problem] = []
    file_ok = hashlib.sha256(data).hexdigest() == entry.get("sha256")
    if len(data) < 8:
        return 0, [problem(None, "file", f"truncated file: {len(data)} bytes, no header")]
    n = int.from_bytes(data[:8], "little")
    if 8 + n > len(data):
        return 0, [problem(None, "file", f"truncated file: header needs {8 + n} bytes, "
                           f"file has {len(data)}")]
    try:
        header = json.loads(data[8 : 8 + n])
        meta = json.loads(header.get("__metadata__", {}).get("refattn", "{}"))
    except (json.JSONDecodeError, AttributeError) as exc:
        return 0, [problem(None, "file", f"corrupt safetensors header ({exc})")]
    base = 8 + n
    checked = 0
    records: Mapping[str, Any] = entry.get("tensors", {})
    for name, rec in sorted(records.items()):
        h = header.get(name)
        if h is None:
            out.append(problem(name, "tensor", "missing tensor (listed in the manifest, absent "
                               "from the file)"))
            continue
        if list(h.get("shape", [])) != list(rec.get("shape", [])):
            out.append(problem(name, "tensor", f"shape {h.get('shape')} differs from the "
                               f"manifest's {rec.get('shape')}"))
            continue
        start, stop = h["data_offsets"]
        if base + stop > len(data):
            out.append(problem(name, "tensor", f"truncated file: tensor data ends at byte "
                               f"{base + stop}, file has {len(data)} bytes"))
            continue
        checked += 1
        if hashlib.sha256(data[base + start : base + stop]).hexdigest() != rec.get("sha256"):
            out.append(problem(name, "tensor", "sha256 mismatch: the tensor's bytes differ "
                               "from the manifest (tampered or corrupted data)"))
        elif meta.get("tensors", {}).get(name) != rec.get("sha256"):
            out.append(problem(name, "tensor", "the file's embedded sha256 differs from the "
                               "manifest"))
    for name in sorted(set(header) - set(records) - {"__metadata__"}):
        out.append(problem(name, "tensor", "tensor present in the file but not listed in the "
                           "manifest"))
    if not file_ok and not out:
        out.append(problem(None, "file", "file sha256 differs from the manifest (header, "
                           "metadata or padding bytes changed)"))
    return checked, out


# -- recomputation -------------------------------------------------------------------------
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


class _Unsupported(Exception):
    """The requested backend cannot run this call (not a defect of the bundle)."""


def _recompute(spec: Any, backend: str) -> tuple[float, bool, list[Problem], Any]:
    from threadpoolctl import threadpool_limits

    from refattn.compare import compare
    from refattn.engine import backward, forward
    from refattn.golden import _case_tensors, compute

    case = spec.to_golden_case()
    if backend == "numpy":
        trace, grads = compute(case)
    else:
        try:
            with threadpool_limits(limits=1):
                trace = forward(case.call, backend=backend)
                grads = backward(trace, case.grad_output)
        except RefAttnError as exc:
            raise _Unsupported(f"backend {backend!r} cannot run this case: {exc}") from None
    fresh = _case_tensors(trace, grads)
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


# -- gradient check ------------------------------------------------------------------------
_DIFFERENTIABLE = ("q", "k", "v", "bias", "sink")


@dataclass(frozen=True)
class GradCheck:
    """Directional-derivative check of one input's stored gradient."""

    name: str
    analytic: float
    numeric: float
    relative_error: float
    tolerance: float

    @property
    def passed(self) -> bool:
        return self.relative_error <= self.tolerance


def gradient_check(call: Any, grad_output: np.ndarray, grads: Mapping[str, np.ndarray], *,
                   seed: int = 0, rtol: float = 1e-6) -> list[GradCheck]:
    """Check ``grads`` (grad_q, grad_k, grad_v, grad_bias, grad_sink, grad_score_<param>) of
    ``call`` by finite differences of ``L = sum(output * grad_output)`` along one random
    direction per input.

    The directional derivative ``dL/dt`` of ``L(x + t u)`` is estimated by two central
    differences (:func:`gradcheck.central_difference`, steps h and h/2) combined by Richardson
    extrapolation; the step is chosen so that the scores move by about 1e-3. The analytic value
    is ``sum(grad_x * u)``; the relative error is taken against ``sum|grad_x * u|``, or against
    the rounding noise of the differences when that is larger (``64 eps S / h`` with
    ``S = sum |G_O| (|P~| |V|)``, the magnitudes L is summed from: a loss that cancels to a
    small value keeps the rounding of its large terms).

    Parameters
    ----------
    call : AttentionCall
    grad_output : (B, Hq, Q, Dv) float64 ndarray
    grads : mapping of str to ndarray
        ``grad_<input>`` tensors to check (absent ones are skipped).
    seed : int
        Seeds the random directions.
    rtol : float
        Largest accepted relative error.

    Returns
    -------
    list of GradCheck

    Examples
    --------
    >>> from refattn.suites.contract import loop7_call
    >>> import refattn
    >>> call = loop7_call(); g_o = np.ones((1, 1, 2, 2))
    >>> grads = refattn.backward(refattn.forward(call), g_o).tensors()
    >>> [(c.name, c.passed) for c in gradient_check(call, g_o, grads)]
    [('q', True), ('k', True), ('v', True), ('bias', True)]
    """
    from gradcheck import central_difference
    from refattn.engine import forward
    from refattn.engine.reduce import gather_heads

    rng = np.random.default_rng(seed)
    base = forward(call)
    base_scores = base.scores
    # rounding in L is relative to the magnitudes it cancels, not to |L|:
    # |fl(L) - L| <~ eps * sum |G_O| (|P~| |V|) (the two coincide only without cancellation)
    v_eff = gather_heads(np.asarray(call.v), call.head_map)
    loss_scale = float(np.sum(np.abs(grad_output) * (np.abs(base.consumed) @ np.abs(v_eff))))
    family = getattr(call, "score", None)
    inputs = [(name, getattr(call, name, None), f"grad_{name}") for name in _DIFFERENTIABLE]
    if family is not None:
        inputs += [(f"score_{n}", a, f"grad_score_{n}") for n, a in family.parameters().items()]

    def perturbed(name: str, x: np.ndarray) -> Any:
        if name.startswith("score_"):
            return dataclasses.replace(call, score=family.with_arrays(**{name[6:]: x}))
        return dataclasses.replace(call, **{name: x})

    out: list[GradCheck] = []
    for name, x_in, grad_name in inputs:
        g = grads.get(grad_name)
        if x_in is None or g is None:
            continue
        x0 = np.array(x_in, dtype=np.float64)
        u = rng.standard_normal(x0.shape)

        def loss(t: float, name: str = name, x0: np.ndarray = x0, u: np.ndarray = u) -> float:
            trace = forward(perturbed(name, x0 + t * u))
            return float(np.sum(trace.output * grad_output))

        # step: move the finite scores by about 1e-3, from their local sensitivity (a tiny
        # probe step stays inside any clamp region, e.g. the cosine score's zero-norm floor)
        t0 = 1e-8 * max(1.0, float(np.max(np.abs(x0))))
        probe = forward(perturbed(name, x0 + t0 * u)).scores
        fin = np.isfinite(probe) & np.isfinite(base_scores)
        move = float(np.max(np.abs(probe - base_scores)[fin])) / t0 if fin.any() else 0.0
        h = 1e-3 / move if move > 1e-6 else 1e-3 * max(1.0, float(np.max(np.abs(x0))))

        def d(step: float, loss: Any = loss) -> float:
            return float(central_difference(lambda t: loss(float(t[0])), np.zeros(1),
                                            eps=step)[0])

        numeric = (4.0 * d(h / 2) - d(h)) / 3.0  # Richardson: O(h^4)
        contrib = g * u
        analytic = float(np.sum(contrib))
        size = float(np.sum(np.abs(contrib)))
        noise = 64 * np.finfo(np.float64).eps * (loss_scale + size * h) / h
        rel = abs(numeric - analytic) / max(size, noise / rtol, np.finfo(np.float64).tiny)
        out.append(GradCheck(name, analytic, numeric, rel, rtol))
    return out


GradcheckMethod = Literal["auto", "check_vjp", "central_difference"]
_METHODS: tuple[str, ...] = get_args(GradcheckMethod)


def _check_method(method: str) -> None:
    if method not in _METHODS:
        raise RefAttnError(f"gradcheck method: expected one of {list(_METHODS)}, got {method!r}")


def _check_stored_gradients(case: Any, spec: Any, *, seed: int, method: GradcheckMethod
                            ) -> tuple[float, tuple[str, ...], str, list[Problem]]:
    """Check the file's gradients (for its own grad_output) with gradcheck's ``check_vjp``
    (complex step; every element when small, else along one random direction), or with
    :func:`gradient_check` (``central_difference``, also the fallback of ``auto`` when
    ``check_vjp`` is not available)."""
    _check_method(method)
    stored = {n: t for n, t in spec.tensors.items()
              if n.startswith("grad_") and n != "grad_output"}
    check_attention = None
    if method != "central_difference":
        try:
            from gradcheck.attention import check_attention
        except ImportError:
            if method == "check_vjp":
                raise RefAttnError("gradcheck method 'check_vjp': gradcheck.attention is not "
                                   "available") from None
    if check_attention is None:
        checks = gradient_check(case.call, case.grad_output, stored, seed=seed)
        found = [
            Problem(spec.case_id, f"grad_{c.name}", "gradcheck",
                    f"directional derivative {c.analytic:.17g} vs finite difference "
                    f"{c.numeric:.17g} (relative error {c.relative_error:.2e} > "
                    f"{c.tolerance:.0e})")
            for c in checks if not c.passed
        ]
        score = max((c.relative_error / c.tolerance for c in checks), default=0.0)
        return score, tuple(c.name for c in checks), "central_difference", found

    def backward(trace: Any, grad_output: np.ndarray) -> Mapping[str, np.ndarray]:
        if not np.array_equal(grad_output, case.grad_output):
            raise RefAttnError("the file's gradients answer only its own grad_output")
        return stored

    # directional mode may use only the one cotangent the file stores
    report = check_attention(case.call, grad_output=case.grad_output, backward=backward,
                             mode="auto", directions=1, seed=seed)
    found = []
    for name, r in report.inputs.items():
        if r.passed:
            continue
        w = r.worst
        where = "" if w is None else (
            f": analytic {w.analytic:.17g} vs numeric {w.numeric:.17g} at "
            f"{w.index if w.index is not None else f'direction {w.direction}'} "
            f"(error/tolerance {w.ratio:.3g})")
        found.append(Problem(spec.case_id, f"grad_{name}", "gradcheck",
                             f"{r.problem or 'gradient disagrees with ' + r.method}{where}"))
    score = max((r.worst.ratio for r in report.inputs.values() if r.worst is not None),
                default=0.0)
    return score, tuple(report.inputs), f"check_vjp {report.mode}", found


# -- the bundle ----------------------------------------------------------------------------
def _verify_case(directory: Path, case_id: str, entry: Mapping[str, Any], manifest: Any, *,
                 recompute: bool, gradcheck: bool, method: GradcheckMethod,
                 backend: str) -> CaseResult:
    from refattn.case_spec import case_spec
    from refattn.golden import load

    rel = entry.get("file", f"cases/{case_id}.safetensors")
    path = directory / rel
    checked, problems = _integrity(case_id, path, entry)
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
            max_err, identical, found, case = _recompute(spec, backend)
            problems += found
        except _Unsupported as exc:
            notes.append(str(exc))
        except RefAttnError as exc:
            problems.append(Problem(case_id, None, "recompute", str(exc)))
    grad_method = ""
    if gradcheck:
        try:
            case = case or spec.to_golden_case()
            grad_err, inputs, grad_method, found = _check_stored_gradients(
                case, spec, seed=zlib.crc32(case_id.encode()), method=method)
            problems += found
        except RefAttnError as exc:
            problems.append(Problem(case_id, None, "gradcheck", str(exc)))
    return CaseResult(case_id, checked, max_err, identical, grad_err, inputs, grad_method,
                      tuple(problems), tuple(notes))


def verify(directory: str | os.PathLike, *, recompute: bool = True,
           gradcheck: bool = True, gradcheck_method: GradcheckMethod = "auto",
           backend: str = "numpy") -> VerifyReport:
    """Verify every case of the bundle in ``directory``.

    Parameters
    ----------
    directory : path
        A bundle written by ``refattn golden`` (``manifest.json`` and ``cases/``).
    recompute : bool
        Rebuild each call, recompute it with the engine and compare (float64 rule).
    backend : str
        Engine backend of the recomputation (``"numpy"``, the generator, must reproduce the
        file bit for bit; another backend, e.g. ``"numba"``, must meet the float64 rule;
        cases it cannot run are noted, not failed).
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
    >>> from refattn.golden import write_bundle
    >>> from refattn.suites import build_suite
    >>> d = tempfile.mkdtemp()
    >>> _ = write_bundle(d, build_suite("contract")[:2], suite="contract")
    >>> r = verify(d)
    >>> r.passed, [c.bit_identical for c in r.cases]
    (True, [True, True])
    """
    from refattn.engine import BACKENDS

    if backend not in BACKENDS:
        raise RefAttnError(f"backend: unknown backend {backend!r}; known: {sorted(BACKENDS)}")
    _check_method(gradcheck_method)
    directory = Path(directory)
    raw = read_manifest(directory / "manifest.json")
    manifest = check_schema(raw)
    results = [
        _verify_case(directory, case_id, entry, manifest, recompute=recompute,
                     gradcheck=gradcheck, method=gradcheck_method, backend=backend)
        for case_id, entry in sorted(manifest["cases"].items())
    ]
    listed = {Path(e.get("file", "")).name for e in manifest["cases"].values()}
    bundle_problems = tuple(
        Problem(None, None, "bundle", f"cases/{p.name} is not listed in the manifest")
        for p in sorted((directory / "cases").glob("*.safetensors")) if p.name not in listed
    )
    return VerifyReport(str(directory), manifest.get("suite"), str(raw.get("schema_version")),
                        tuple(results), bundle_problems)
