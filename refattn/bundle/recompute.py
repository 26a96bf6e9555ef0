"""Recompute a golden case with the engine and compare it with what the file stores.

Owns :func:`recompute`: the call rebuilt from the file (:mod:`refattn.bundle.spec`) runs
forward and backward again (on the case's generator, or another backend). A case regenerated
by its own generator must match bit for bit (the first and the worst differing element are
named): always for the correctly rounded ``exact`` generator, and for the ``numpy`` generator
where numpy and its BLAS are the ones that wrote it (the generator runs BLAS on one thread, so
its bytes are deterministic there). Another backend, or a numpy bundle from another
environment, is compared under the float64 rule of :mod:`refattn.bundle.comparison`. The
rebuilt call's manifest is compared field by field with the stored one, and so are the
recorded conventions and the flags that name a feature of the call
(:func:`check_recorded`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from refattn._checks import format_index
from refattn.bundle.cases import (
    GENERATORS,
    GoldenCase,
    case_conventions,
    case_tensors,
    compute,
)
from refattn.bundle.comparison import compare
from refattn.bundle.report import Problem
from refattn.bundle.spec import CaseSpec
from refattn.call import AttentionCall
from refattn.engine import backward, forward
from refattn.errors import RefAttnError

__all__ = ["FLAG_CHECKS", "Unsupported", "check_recorded", "generator_of", "recompute"]


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


def generator_of(spec: CaseSpec) -> str:
    """The backend that generated a case (``exact`` or ``numpy``), from its call manifest."""
    return str(spec.call_manifest.get("backend", {}).get("selected_backend", "numpy"))


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
    sv, fv = stored[idx], fresh[idx]
    hexed = (f" ({float(sv).hex()} vs {float(fv).hex()})" if stored.dtype.kind == "f" else "")
    worst = ""
    if stored.dtype.kind == "f":
        with np.errstate(invalid="ignore", over="ignore"):
            gap = np.where(differs, np.abs(stored - fresh), 0.0)
        gap = np.where(np.isnan(gap), np.inf, gap)  # a NaN on one side is the worst
        w = np.unravel_index(int(np.argmax(gap)), gap.shape) if gap.ndim else ()
        w = tuple(int(i) for i in w)
        worst = (f"; worst at {format_index(w)}: stored {stored[w]!r}, recomputed "
                 f"{fresh[w]!r} (|d| = {float(gap[w]):.3e})")
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
    policy, returned weights, scale record, scale placement; with a visibility relation its
    causal alignment and window convention) must be recorded and equal; every flag of
    :data:`FLAG_CHECKS` must name a feature the call has.

    Examples
    --------
    >>> from refattn.bundle.suites import build_suite
    >>> from refattn.bundle.spec import case_spec
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
    if call.relation is not None:
        rel = call.relation.manifest()
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
    return problems


def recompute(spec: CaseSpec, backend: str | None = None, *,
              bit_identical: bool | None = None
              ) -> tuple[float, bool, list[Problem], GoldenCase]:
    """Rebuild the case's call, run it again and compare with the stored tensors.

    Parameters
    ----------
    spec : CaseSpec
    backend : str, optional
        The engine to run (default: the case's generator). The generator of a correctly
        rounded (``exact``) case must reproduce every tensor bit for bit; another backend, or
        the ``numpy`` generator (whose bytes depend on the machine's BLAS), must meet the
        float64 rule of :mod:`refattn.bundle.comparison`.
    bit_identical : bool, optional
        Whether the regenerated tensors must equal the stored ones bit for bit (default: for
        the ``exact`` generator; the verifier also asks it of a ``numpy`` bundle written with
        this machine's numpy and BLAS).

    Returns
    -------
    (max_abs_error, bit_identical, problems, case)
    """
    case = spec.to_golden_case()
    generator = generator_of(spec)
    backend = generator if backend is None else backend
    if backend in GENERATORS:
        trace, grads = compute(case, backend)
    else:
        try:
            with threadpool_limits(limits=1):
                trace = forward(case.call, backend=backend)
                grads = backward(trace, case.grad_output)
        except RefAttnError as exc:
            raise Unsupported(f"backend {backend!r} cannot run this case: {exc}") from None
    regenerated = backend == generator
    fresh = case_tensors(trace, grads, case.layout)
    problems: list[Problem] = []
    for name in sorted(set(spec.tensors) - set(fresh)) if regenerated else ():
        problems.append(Problem(spec.case_id, name, "recompute",
                                "stored tensor is not produced by the recomputation"))
    for name in sorted(set(fresh) - set(spec.tensors)):
        problems.append(Problem(spec.case_id, name, "recompute",
                                "recomputation produces a tensor the file does not store"))
    common = {n: fresh[n] for n in fresh if n in spec.tensors}
    report = compare(common, spec, dtype="float64")
    if bit_identical is None:
        bit_identical = trace.arithmetic == "stepwise_correctly_rounded"
    if regenerated and bit_identical:
        for name in sorted(common):  # machine-independent by construction: bit for bit
            diff = _first_bit_difference(np.asarray(spec.tensors[name]), common[name])
            if diff:
                problems.append(Problem(spec.case_id, name, "recompute", diff))
    else:
        for row in report.tensors:
            if not row.passed:
                problems.append(Problem(spec.case_id, row.name, "recompute",
                                        row.reason or "differs"))
    identical = all(_first_bit_difference(np.asarray(spec.tensors[n]), common[n]) is None
                    for n in common) and not problems
    max_err = max((row.max_abs_error for row in report.tensors if row.rule == "float64"),
                  default=0.0)
    stored = dict(spec.call_manifest)
    rebuilt = trace.manifest()
    for m in (stored, rebuilt):
        m["backend"] = {k: v for k, v in m.get("backend", {}).items()
                        if k != "framework_revision" and regenerated}
        if not regenerated:  # another engine materialises what it chooses
            m.pop("materialization", None)
    diff = _first_difference(rebuilt, stored)
    if diff:
        problems.append(Problem(spec.case_id, None, "manifest",
                                f"rebuilt call manifest differs at {diff}"))
    return max_err, identical, problems, case
