"""Recompute a golden case and say which guarantee its stored tensors meet.

Owns :func:`recompute`: the call rebuilt from the file (:mod:`refattn.bundle.golden.spec`) runs
forward and backward again on the ``exact`` generator, whatever the manifest says made it, and
every stored tensor is compared with that correctly rounded result: bit-identical, or within
the documented float64 backend bound of it (:mod:`refattn.bundle.golden.guarantee`); where the exact
generator does not run the call, within twice that bound of an independent float64
recomputation, and the case says so. The manifest's claims can only add checks: a case that
claims the exact generator must be bit-identical, a ``numpy`` case written on this machine's
numpy and BLAS must be regenerated bit for bit by numpy (the first and the worst differing
element are named). The rebuilt call's manifest is compared field by field with the stored
one, and so are the recorded conventions and the flags that name a feature of the call
(:func:`check_recorded`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
from threadpoolctl import threadpool_limits

from refattn._checks import format_index
from refattn.bundle.comparison.harness import compare
from refattn.bundle.golden.case import (
    GENERATORS,
    GoldenCase,
    case_conventions,
    case_tensors,
    compute,
    emulated_tensors,
    stored_by,
)
from refattn.bundle.golden.guarantee import (
    FORWARD_BOUND,
    GRADIENT_BOUND,
    audit_record,
    check_bound,
    kappa,
    natural_scales,
)
from refattn.bundle.golden.quantized import quant_tensor_names
from refattn.bundle.golden.spec import CaseSpec
from refattn.bundle.storage.problems import Problem
from refattn.bundle.verification.report import Guarantee
from refattn.call import AttentionCall
from refattn.engine import backward, forward
from refattn.engine.exact.backend import DEFAULT_MAX_SECONDS
from refattn.engine.trace import Gradients, Trace
from refattn.errors import RefAttnError

__all__ = ["FLAG_CHECKS", "REQUIREMENTS", "Recomputed", "Unsupported", "check_recorded",
           "generator_of", "recompute"]


def _first_difference(a: Any, b: Any, path: str = "") -> str | None:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{path}{key} (present on one side only)"
            diff = _first_difference(a[key], b[key], f"{path}{key}.")
            if diff:
                return diff
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            diff = _first_difference(x, y, f"{path}{i}.")
            if diff:
                return diff
        return None
    same = a == b and isinstance(a, (bool, np.bool_)) == isinstance(b, (bool, np.bool_))
    return None if same else f"{path.rstrip('.')}: stored {b!r}, recomputed {a!r}"


class Unsupported(Exception):
    """The requested backend cannot run this call (not a defect of the bundle)."""


def generator_of(spec: CaseSpec) -> str:
    """The backend that generated a case (``exact``, ``numpy`` or ``numba``), from its call
    manifest (:attr:`CaseSpec.generator <refattn.bundle.golden.spec.CaseSpec.generator>`)."""
    return spec.generator


def _first_bit_difference(stored: np.ndarray, fresh: np.ndarray) -> str | None:
    """Where two arrays of the same shape first differ bit for bit, and where they differ
    most (None: identical)."""
    if stored.shape != fresh.shape or stored.dtype != fresh.dtype:
        return (f"recomputed {fresh.dtype} {list(fresh.shape)}, stored {stored.dtype} "
                f"{list(stored.shape)}")
    a = np.ascontiguousarray(stored).view(np.uint8).reshape(*stored.shape, -1)
    b = np.ascontiguousarray(fresh).view(np.uint8).reshape(*fresh.shape, -1)
    differs = (a != b).any(axis=-1) if stored.ndim else np.asarray((a != b).any())
    bad = np.argwhere(differs)
    if not bad.size:
        return None
    idx = tuple(int(i) for i in bad[0])
    sv, fv = stored[idx].item(), fresh[idx].item()
    hexed = (f" ({float(sv).hex()} vs {float(fv).hex()})" if stored.dtype.kind == "f" else "")
    worst = ""
    if stored.dtype.kind == "f":
        with np.errstate(invalid="ignore", over="ignore"):
            gap = np.where(differs, np.abs(stored - fresh), 0.0)
        gap = np.where(np.isnan(gap), np.inf, gap)  # a NaN on one side is the worst
        w = tuple(int(i) for i in np.unravel_index(int(np.argmax(gap)), gap.shape))
        worst = (f"; worst at {format_index(w)}: stored {stored[w].item()!r}, recomputed "
                 f"{fresh[w].item()!r} (|d| = {float(gap[w]):.3e})")
    return (f"not bit-identical: first difference at {format_index(idx)}: stored {sv!r}, "
            f"recomputed {fv!r}{hexed}; {int(differs.sum())} element(s) differ{worst}")


#: flag -> (what it claims, predicate on the rebuilt call). A flag that names a feature the
#: rebuilt call does not have is a mislabelled case; flags not listed here are free text.
FLAG_CHECKS: dict[str, tuple[str, Any]] = {
    "PhiloxDropout": ("a Philox dropout stream",
                      lambda c: c.dropout is not None and not isinstance(c.dropout, np.ndarray)),
    "ExplicitMultiplier": ("an explicit dropout multiplier array",
                           lambda c: isinstance(c.dropout, np.ndarray)),
    "Sink": ("an attention sink", lambda c: c.sink is not None),
    "Softcap": ("a softcap", lambda c: c.softcap is not None),
    "ScoreBilinear": ("the bilinear score", lambda c: c.score.name == "bilinear"),
    "ScoreAdditive": ("the additive score", lambda c: c.score.name == "additive"),
    "ScoreCosine": ("the cosine score", lambda c: c.score.name == "cosine"),
    "ExplicitScale": ("an explicit scale",
                      lambda c: c.ledger["scale_source"] == "explicit"),
    "DefaultScale": ("the default scale Dk ** -0.5",
                     lambda c: c.ledger["scale_source"] == "default_dk_inverse_sqrt"),
    "GQA": ("fewer kv heads than query heads", lambda c: c.k.shape[1] < c.q.shape[1]),
    "MQA": ("one kv head shared by several query heads",
            lambda c: c.k.shape[1] == 1 < c.q.shape[1]),
    "ExplicitHeadMap": ("an explicit head_map",
                        lambda c: c.ledger["head_map_mode"] == "explicit"),
    "QueryValid": ("a query_valid mask", lambda c: c.query_valid is not None),
    "SanitizedRow": ("the sanitize_then_zero_invalid_query policy",
                     lambda c: c.all_masked_rows == "sanitize_then_zero_invalid_query"),
    "BiasBroadcast": ("a bias", lambda c: c.bias is not None),
    "BiasFull": ("a bias", lambda c: c.bias is not None),
    "ALiBi": ("a bias", lambda c: c.bias is not None),
    "ReturnedWeights": ("returned weights", lambda c: c.returned_weights != "none"),
    "CrossAttention": ("Q != K", lambda c: c.q.shape[2] != c.k.shape[2]),
}


def check_recorded(spec: CaseSpec, call: AttentionCall) -> list[Problem]:
    """The manifest entry's conventions and flags against the call rebuilt from the file.

    Every convention that follows from the call (polarity, GQA mapping, all-masked-row
    policy, returned weights, scale record, scale placement, the causal alignment and the
    window convention, ``none`` without a visibility relation) must be recorded and equal;
    every flag of :data:`FLAG_CHECKS` must name a feature the call has.

    Examples
    --------
    >>> from refattn.bundle.suites import build_suite
    >>> from refattn.bundle.golden.spec import case_spec
    >>> spec = case_spec(build_suite("contract")[0])
    >>> check_recorded(spec, spec.to_call())
    []
    """
    problems: list[Problem] = []

    def bad(reason: str) -> None:
        problems.append(Problem(spec.case_id, None, "manifest", reason))

    derived = case_conventions(GoldenCase(spec.case_id, call, np.zeros(0), ""))
    expected = {k: v for k, v in derived.items()
                if k not in ("causal_alignment", "window_convention")}
    rel = call.relation.manifest() if call.relation is not None else {}
    expected["causal_alignment"] = rel.get("alignment") or "none"
    expected["window_convention"] = rel.get("window_convention") or "none"
    recorded = spec.conventions
    for key, value in sorted(expected.items()):
        if key not in recorded:
            bad(f"convention {key!r} is not recorded; the rebuilt call has {value!r}")
        elif recorded[key] != value:
            bad(f"convention {key!r}: recorded {recorded[key]!r}, the rebuilt call has "
                f"{value!r}")
    for flag in spec.flags:
        if flag in FLAG_CHECKS:
            claim, holds = FLAG_CHECKS[flag]
            if not holds(call):
                bad(f"flag {flag!r} claims {claim}, which the rebuilt call does not have")
    if "Quantized" in spec.flags and spec.quant is None:
        bad("flag 'Quantized' claims a quantised case, whose manifest entry has no quant record")
    return problems


#: what ``refattn verify --require`` accepts: ``float64`` (default) passes a case within the
#: documented float64 backend bound of the correctly rounded result; ``exact`` only a case
#: bit-identical to it
REQUIREMENTS = ("float64", "exact")


class Recomputed(NamedTuple):
    """The verdict of :func:`recompute` on one case."""

    #: max|stored - reference| over the float tensors (reference: the exact recomputation, or
    #: the float64 one where exact did not run)
    max_abs_error: float
    #: whether every stored tensor equals the reference bit for bit
    bit_identical: bool
    #: which guarantee held (None: none did; the problems say why)
    guarantee: Guarantee | None
    problems: list[Problem]
    notes: list[str]
    case: GoldenCase
    #: max|stored - recomputed| of the ``backend`` asked for (None: none asked, or it could
    #: not run the case)
    backend_error: float | None = None


def _run(case: GoldenCase, backend: str, **options: Any) -> tuple[Trace, Gradients]:
    """Forward and backward of ``case`` on ``backend`` (BLAS on one thread but for exact)."""
    if backend == "exact":
        trace = forward(case.call, backend="exact", **options)
        return trace, backward(trace, case.grad_output)
    with threadpool_limits(limits=1):
        trace = forward(case.call, backend=backend)
        return trace, backward(trace, case.grad_output)


def recompute(spec: CaseSpec, backend: str | None = None, *,
              bit_identical: bool | None = None, require: str = "float64",
              exact_max_seconds: float = DEFAULT_MAX_SECONDS) -> Recomputed:
    """Rebuild the case's call, recompute it correctly rounded and say which guarantee holds.

    Whatever the manifest claims about the case's generator, the ``exact`` generator
    recomputes it (where its time estimate is within ``exact_max_seconds`` and it runs the
    call) and every stored tensor is compared with that correctly rounded result: bit-identical
    is the ``bit_identical`` guarantee; otherwise each tensor must be within the documented
    float64 backend bound of it (:mod:`refattn.bundle.golden.guarantee`), the ``within_bound``
    guarantee. A case the manifest says the exact generator wrote must be bit-identical. Where
    the exact generator does not run the case, the reason is noted and the tensors must be
    within twice that bound of an independent float64 (numpy) recomputation (both are within
    the bound of the correctly rounded result), the ``within_float64_recomputation``
    guarantee. A claim can only add checks: a ``numpy`` case written with this machine's numpy
    and BLAS (``bit_identical=True``) must also be regenerated bit for bit by numpy, and the
    rebuilt call manifest is compared with the claimed generator's where it ran.

    Parameters
    ----------
    spec : CaseSpec
    backend : str, optional
        Another engine to run too (e.g. ``"numba"``): its tensors must meet the float64 rule
        of :mod:`refattn.bundle.comparison.harness` against the stored ones; a call it cannot run is
        noted, not failed. ``"exact"`` adds nothing.
    bit_identical : bool, optional
        Whether the case's claimed ``numpy`` or ``numba`` generator must regenerate it bit
        for bit (the verifier passes True for a bundle written with this machine's libraries:
        numpy and its BLAS; numba, scipy's OpenBLAS and the generator's layout).
    require : {"float64", "exact"}
        ``exact`` fails every case that is not bit-identical to the correctly rounded result.
    exact_max_seconds : float
        The exact generator's time limit per case (its estimate, before any arithmetic).

    Returns
    -------
    Recomputed

    Examples
    --------
    >>> from refattn.bundle.suites import build_suite
    >>> from refattn.bundle.golden.spec import case_spec
    >>> r = recompute(case_spec(build_suite("contract")[0]))
    >>> r.guarantee.text, r.problems
    ('bit-identical to the correctly rounded result', [])
    """
    if require not in REQUIREMENTS:
        raise RefAttnError(f"require: expected one of {list(REQUIREMENTS)}, got {require!r}")
    case = spec.to_golden_case()
    cid = spec.case_id
    claimed = generator_of(spec)
    problems: list[Problem] = []
    notes: list[str] = []
    if claimed not in GENERATORS:
        problems.append(Problem(cid, None, "manifest", f"the call manifest names generator "
                                f"{claimed!r}; golden cases are generated by one of "
                                f"{list(GENERATORS)}"))
    # 1. the reference: the correctly rounded result, or a float64 recomputation where exact
    #    does not run the call
    reference, why_not = "exact", ""
    try:
        trace, grads = _run(case, "exact", max_seconds=exact_max_seconds)
    except RefAttnError as exc:
        reference, why_not = "numpy", str(exc)
        notes.append(f"the exact generator did not run this case ({why_not}); its tensors "
                     "were checked against a float64 (numpy) recomputation instead")
        trace, grads = _run(case, "numpy")
    # what the claimed generator stores, derived from the claim (a saved-state numba case:
    # no (B, Hq, Q, K) tensor), never from the file's own list
    fresh = stored_by(claimed, case_tensors(trace, grads, case.layout))
    unchecked: set[str] = set()  # quant_* tensors whose recomputation failed (said once)
    if case.quant is not None:  # the emulated pipeline again, from the stored codes and spec
        try:
            fresh.update(emulated_tensors(case))
        except RefAttnError as exc:
            problems.append(Problem(cid, None, "recompute", f"quantised pipeline: {exc}"))
            unchecked = set(quant_tensor_names(spec.tensors))
    for name in sorted(set(spec.tensors) - set(fresh) - unchecked):
        problems.append(Problem(cid, name, "recompute",
                                "stored tensor is not produced by the recomputation"))
    for name in sorted(set(fresh) - set(spec.tensors)):
        problems.append(Problem(cid, name, "recompute",
                                "recomputation produces a tensor the file does not store"))
    common = sorted(n for n in fresh if n in spec.tensors)
    stored = {n: np.asarray(spec.tensors[n]) for n in common}
    diffs = {n: d for n in common if (d := _first_bit_difference(stored[n], fresh[n]))}
    # the emulated pipeline is deterministic whatever generated the case: bit for bit always
    quant_bad = bool(unchecked)
    for name in quant_tensor_names(common):
        stored.pop(name)
        if name in diffs:
            quant_bad = True
            problems.append(Problem(cid, name, "recompute", "the quantised pipeline's tensors "
                                    f"are recomputed bit for bit; {diffs.pop(name)}"))
    # else: no guarantee about the case
    same_set = set(spec.tensors) == set(fresh) and not quant_bad
    identical = not diffs and same_set
    max_err = _max_abs_error(stored, fresh)
    # 2. the guarantee (and the one a float64 generator recorded, audited against it)
    guarantee: Guarantee | None = None
    kap = kappa(trace.scores)
    problems += _audit(spec, claimed, case, trace, grads, fresh, kap)
    if reference == "exact" and not diffs:
        guarantee = Guarantee("bit_identical", "exact", kap) if same_set else None
    elif reference == "exact" and claimed == "exact":
        for name, diff in diffs.items():
            problems.append(Problem(cid, name, "recompute", "the case claims the exact "
                                    "generator, so every tensor must be the correctly "
                                    f"rounded result; {diff}"))
    else:
        factor = 1.0 if reference == "exact" else 2.0
        what = "correctly rounded" if reference == "exact" else "float64 recomputation"
        scales = natural_scales(case.call, trace, grads)
        checked = check_bound(stored, fresh, kappa=kap, factor=factor, what=what,
                              scales=scales)
        failed = [t for t in checked if t.reason]
        for t in failed:
            problems.append(Problem(cid, t.name, "recompute", f"beyond the float64 backend "
                                    f"bound{'' if factor == 1 else ' (x2)'} of the {what} "
                                    f"result: {t.reason}"))
        if not failed and same_set:
            worst = max(checked, key=lambda t: t.fraction, default=None)
            guarantee = Guarantee(
                "within_bound" if reference == "exact" else "within_float64_recomputation",
                reference, kap, factor * FORWARD_BOUND * kap, factor * GRADIENT_BOUND * kap,
                worst.fraction if worst else 0.0, worst.name if worst else None, why_not,
                natural=bool(scales))
    if require == "exact" and (reference != "exact" or diffs):
        first: str | None = next(iter(diffs), None)
        reason = (diffs[first].replace("not bit-identical", "not bit-identical to the "
                                       "correctly rounded result", 1)
                  if reference == "exact" and first is not None
                  else f"the exact generator did not run this case ({why_not})")
        problems.append(Problem(cid, first, "recompute", f"--require exact: {reason}"))
    # 3. what the claim adds: the claimed generator's own run (bit for bit where it must be)
    claimed_trace = trace if claimed == reference else None
    if claimed == "numpy" or (claimed == "numba" and bit_identical):
        regenerated = fresh
        if reference != claimed:  # the generator itself (numba: its fixed layout)
            claimed_trace, claimed_grads = compute(case, claimed)
            regenerated = case_tensors(claimed_trace, claimed_grads, case.layout)
        # their bytes are deterministic on the libraries that wrote them (numpy and its BLAS;
        # numba, its OpenBLAS and the generator's layout), whatever the thread count
        for name in sorted(stored) if bit_identical else ():
            bits = _first_bit_difference(stored[name], regenerated[name])
            if bits:
                problems.append(Problem(cid, name, "recompute", f"regenerated by {claimed} on "
                                        f"the libraries that wrote it: {bits}"))
    # 4. another engine, when asked for
    backend_error = None
    if backend not in (None, "exact", reference):
        try:
            other_trace, other_grads = _run(case, backend)
        except RefAttnError as exc:
            notes.append(f"backend {backend!r} cannot run this case: {exc}")
        else:
            other = case_tensors(other_trace, other_grads, case.layout)
            report = compare({n: other[n] for n in common if n in other}, spec, dtype="float64")
            for row in report.tensors:
                if not row.passed:
                    problems.append(Problem(cid, row.name, "recompute",
                                            f"backend {backend!r}: {row.reason or 'differs'}"))
            backend_error = max((r.max_abs_error for r in report.tensors
                                 if r.rule == "float64"), default=0.0)
    elif backend == "numpy" and reference == "numpy":
        backend_error = max_err
    # 5. the rebuilt call manifest, field by field (backend fields where the claimed
    #    generator ran)
    rebuilt = (claimed_trace or trace).manifest()
    stored_manifest = dict(spec.call_manifest)
    for m in (stored_manifest, rebuilt):
        m["backend"] = {k: v for k, v in m.get("backend", {}).items()
                        if k != "framework_revision" and claimed_trace is not None}
        if claimed_trace is None:  # another engine materialises what it chooses
            m.pop("materialization", None)
    where = _first_difference(rebuilt, stored_manifest)
    if where:
        problems.append(Problem(cid, None, "manifest",
                                f"rebuilt call manifest differs at {where}"))
    return Recomputed(max_err, identical and not problems, guarantee, problems, notes, case,
                      backend_error)


def _audit(spec: CaseSpec, claimed: str, case: GoldenCase, trace: Trace, grads: Gradients,
           fresh: Mapping[str, np.ndarray], kap: float) -> list[Problem]:
    """The recorded guarantee of a float64-generated case against verify's own bound (from
    the reference ``trace``): required of a numba case, optional for numpy (older bundles),
    refused on an exact one (whose guarantee is bit identity)."""
    record = spec.guarantee
    cid = spec.case_id
    if claimed not in ("numpy", "numba"):
        return [] if record is None else [Problem(
            cid, None, "manifest", f"a case of the {claimed} generator records a float64 "
            "guarantee; its own is bit identity to the correctly rounded result")]
    if record is None:
        return [] if claimed == "numpy" else [Problem(
            cid, None, "manifest", "a numba case must record its guarantee (the bound of each "
            "stored tensor, manifest entry 'guarantee'); it records none")]
    scales = natural_scales(case.call, trace, grads)
    return [Problem(cid, None, "manifest", why)
            for why in audit_record(record, claimed, fresh, kap, scales, spec.tensors)]


def _max_abs_error(stored: Mapping[str, np.ndarray], fresh: Mapping[str, np.ndarray]) -> float:
    """max|stored - fresh| over the finite elements of float tensors of equal shapes."""
    worst = 0.0
    for name, a in stored.items():
        g = fresh[name]
        if a.dtype.kind == "f" and a.shape == g.shape and a.size:
            with np.errstate(invalid="ignore", over="ignore"):
                d = np.abs(a - g)
            d = d[np.isfinite(d)]
            worst = max(worst, float(d.max(initial=0.0)))
    return worst
