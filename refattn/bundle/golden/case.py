"""Golden cases: a named call with its cotangent and labels, and the tensors it produces.

Owns :class:`GoldenCase` (what a suite defines), :func:`compute` (forward and backward on the
reference backend with BLAS pinned to one thread) and the selection of stored tensors and
recorded conventions of one case. The file format is :mod:`refattn.bundle.storage.format`'s; writing
a bundle is :mod:`refattn.bundle.writing.write`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

from refattn._boundary import public
from refattn._checks import format_index
from refattn.bundle.golden.layouts import LAYOUT_INPUTS
from refattn.bundle.golden.quantized import INPUTS, PREFIX, quant_tensors
from refattn.call import AttentionCall
from refattn.engine import backward, forward
from refattn.engine.exact.estimate import DEFAULT_MAX_SECONDS, estimate_seconds
from refattn.engine.memory import available_bytes, dense_bytes
from refattn.engine.trace import SAVED_STATE_OMITS, Gradients, Trace
from refattn.errors import RefAttnError
from refattn.quant.pipeline import dequantized_call, emulate
from refattn.quant.spec import check_quant
from refattn.records import float_record

__all__ = ["GENERATORS", "INPUT_TENSORS", "Computed", "GoldenCase", "case_conventions",
           "case_inputs", "case_tensors", "check_generator", "compute", "emulated_tensors",
           "numpy_environment", "stored_by"]

#: backends that may generate a golden bundle: ``exact`` (correctly rounded, the same bytes on
#: every machine), ``numpy`` (IEEE float64 in BLAS order: the full trace) and ``numba`` (the
#: fused kernel on a fixed layout: the saved-state tensors, fast at kernel shapes); the float64
#: ones within the documented bound of exact (:mod:`refattn.bundle.golden.guarantee`), their
#: bytes the same on every run and thread count of one machine's BLAS
GENERATORS: tuple[str, ...] = ("exact", "numpy", "numba")


@public
@dataclass(frozen=True, eq=False)
class GoldenCase:
    """One named golden case: a call, its output cotangent and its labels.

    Attributes
    ----------
    case_id : str
        File-name-safe identifier, e.g. ``"loop6_two_query_training_trace"``.
    call : AttentionCall
    grad_output : (B, Hq, Q, Dv) float64 ndarray
    comment : str
        One line saying what the case pins down.
    flags : tuple of str
        Wycheproof-style labels, e.g. ``("LowerRightCausal", "AllDroppedRow")``.
    conventions : dict
        Conventions beyond the call manifest (causal alignment, window convention, ...).
    layout : optional
        The physical inputs the call was built from (:mod:`refattn.bundle.golden.layouts`:
        e.g. :class:`refattn.call.paged.PagedKV`, a paged KV cache): they are stored as given
        beside the canonical tensors, with their gradients (``grad_k_pages``, ...).
    quant : QuantCase, optional
        A quantised case (:class:`refattn.bundle.golden.quantized.QuantCase`: the
        :class:`~refattn.quant.spec.QuantSpec` and the call as the kernel receives it);
        ``call`` is then its real call (the dequantised inputs), whose canonical tensors are
        stored as for any case, beside the codes, scales and emulated intervals.
    """

    case_id: str
    call: AttentionCall
    grad_output: np.ndarray
    comment: str
    flags: tuple[str, ...] = ()
    conventions: Mapping[str, Any] = field(default_factory=dict)
    layout: Any = None
    quant: Any = None

    def __post_init__(self) -> None:
        if not self.case_id or not all(c.isalnum() or c in "_-." for c in self.case_id):
            raise RefAttnError(f"case_id: {self.case_id!r} must be non-empty [A-Za-z0-9_.-]")


class Computed(NamedTuple):
    """Forward trace and gradients of one golden case."""

    trace: Trace
    grads: Gradients


@public
def compute(case: GoldenCase, backend: str = "exact") -> Computed:
    """Forward and backward of a case on a generator backend (numpy's BLAS on one thread).

    Parameters
    ----------
    case : GoldenCase
    backend : {"exact", "numpy", "numba"}
        ``exact`` (correctly rounded, machine-independent), ``numpy`` (the full trace in
        IEEE float64) or ``numba`` (:func:`refattn.engine.numba.generator.generate`: no
        ``(B, Hq, Q, K)`` tensor, the same bits on every thread count).

    Raises
    ------
    RefAttnError
        An unknown backend, or a call the backend does not generate (naming the field).

    Examples
    --------
    >>> from refattn.bundle.suites.contract import LOOP6_GRAD_OUTPUT, loop6_call
    >>> result = compute(GoldenCase("loop6", loop6_call(), LOOP6_GRAD_OUTPUT, "Loop 6"))
    >>> result.trace.backend, result.grads.grad_q.shape
    ('exact', (1, 1, 2, 2))
    """
    if backend not in GENERATORS:
        raise RefAttnError(f"backend: golden bundles are generated by one of {list(GENERATORS)}, "
                           f"got {backend!r}")
    if backend == "numba":  # imported here: the other generators never load numba
        from refattn.engine.numba.generator import generate

        return Computed(*generate(case.call, case.grad_output))
    # numpy's bytes depend on the BLAS thread count; exact ones cannot (and threadpoolctl's
    # scan of the loaded libraries costs about 1.5 ms a case)
    with threadpool_limits(limits=1) if backend == "numpy" else contextlib.nullcontext():
        trace = forward(case.call, backend=backend)
        grads = backward(trace, case.grad_output)
    return Computed(trace, grads)


def check_generator(case: GoldenCase, backend: str) -> None:
    """Refuse, before any arithmetic, a case that generator ``backend`` cannot write here:
    ``exact`` over its time limit (its own estimate), ``numpy`` over the memory available
    (its full trace), ``numba`` for a call its fused kernel does not run. The message names
    the case, the estimate and the generator that would write it.

    Examples
    --------
    >>> from refattn.call import AttentionCall
    >>> x = np.zeros((1, 4, 4096, 128))
    >>> try:
    ...     check_generator(GoldenCase("long", AttentionCall(x, x, x), x, ""), "exact")
    ... except RefAttnError as exc:
    ...     print(str(exc)[:73])
    --backend exact: case 'long' would take about 1.1e+03 s correctly rounded
    """
    call = case.call
    match backend:
        case "exact":
            seconds = estimate_seconds(call)
            if seconds > DEFAULT_MAX_SECONDS:
                raise RefAttnError(
                    f"--backend exact: case {case.case_id!r} would take about {seconds:.2g} s "
                    f"correctly rounded, over the exact generator's limit of "
                    f"{DEFAULT_MAX_SECONDS:g} s per case; generate it with --backend numba "
                    "(float64 within the bound of the correctly rounded result that the "
                    "manifest records and verify applies)")
        case "numpy":
            need = max(dense_bytes(call, "forward"), dense_bytes(call, "backward"))
            have = available_bytes()
            if have is not None and need > have:
                raise RefAttnError(
                    f"--backend numpy: case {case.case_id!r} needs about {need / 2**30:.1f} "
                    f"GiB for its full (B, Hq, Q, K) trace, more than the {have / 2**30:.1f} "
                    "GiB available; generate it with --backend numba (no (B, Hq, Q, K) "
                    "tensor)")
        case "numba":
            from refattn.engine.numba.generator import refusal  # loads numba: here only

            why = refusal(call)
            if why is not None:
                raise RefAttnError(f"--backend numba: case {case.case_id!r}: {why}")
        case _:
            raise RefAttnError(f"backend: golden bundles are generated by one of "
                               f"{list(GENERATORS)}, got {backend!r}")


def emulated_tensors(case: GoldenCase) -> dict[str, np.ndarray]:
    """The ``quant_*`` tensors of a quantised case: its codes, scales and the emulated
    pipeline's intervals (:mod:`refattn.bundle.golden.quantized`), computed from the kernel's call.

    The case's real call must hold exactly the dequantised kernel inputs
    (:func:`~refattn.quant.pipeline.dequantized_call`): a case whose q, k or v is not
    ``codes * scale`` (or the cast input as given) is refused, naming the tensor and the
    first differing index. The intervals are pure float64 arithmetic on the kernel's inputs,
    the same on every machine and thread count.

    Parameters
    ----------
    case : GoldenCase
        With ``case.quant`` set.

    Raises
    ------
    RefAttnError
        A case without ``quant``, a spec that does not fit the kernel's call, or real inputs
        that are not the dequantised kernel inputs.
    """
    qc = case.quant
    if qc is None:
        raise RefAttnError(f"{case.case_id}: not a quantised case")
    check_quant(qc.call, qc.spec)
    real = dequantized_call(qc.call, qc.spec)
    for name in INPUTS:
        given = np.ascontiguousarray(getattr(case.call, name))
        want = np.ascontiguousarray(getattr(real, name))
        if given.shape != want.shape:
            raise RefAttnError(f"{case.case_id}: {name}: shape {list(given.shape)}, the kernel "
                               f"input dequantises to {list(want.shape)}")
        differs = given.view(np.uint64) != want.view(np.uint64)
        if differs.any():
            idx = tuple(int(i) for i in np.argwhere(differs)[0])
            source = (f"{PREFIX}{name}_codes x {PREFIX}{name}_scale"
                      if getattr(qc.spec, name).source == "codes" else "the cast input")
            raise RefAttnError(
                f"{case.case_id}: {name} at index {format_index(idx)}: {float(given[idx])!r} is "
                f"not the dequantised kernel input {float(want[idx])!r} ({source})")
    return quant_tensors(qc, emulate(qc.call, qc.spec))


def numpy_environment() -> dict[str, Any]:
    """What the bytes of a ``numpy``-generated case depend on: numpy's version and the BLAS
    libraries it calls (name, version, architecture). A numpy bundle records it; verify
    requires bit identity only where it matches (on the same BLAS the one-thread generator
    is deterministic).

    Examples
    --------
    >>> sorted(numpy_environment())
    ['blas', 'numpy']
    """
    blas = sorted(
        {(str(i.get("internal_api")), str(i.get("version")), str(i.get("architecture")))
         for i in threadpool_info() if i.get("user_api") == "blas"
         and "numpy" in str(i.get("filepath", "")).lower()})  # numpy's own, not scipy's
    return {"numpy": np.__version__,
            "blas": [{"library": a, "version": v, "architecture": c} for a, v, c in blas]}


def stored_by(backend: str, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tensors of a full trace that a case of generator ``backend`` stores: all of them,
    or for ``numba`` (a saved-state case) all but the (B, Hq, Q, K) stages
    (:data:`~refattn.engine.trace.SAVED_STATE_OMITS`). Verify derives a case's expected set
    this way from the generator it claims, never from the file's list.

    Examples
    --------
    >>> sorted(stored_by("numba", {"probs": np.ones(1), "output": np.ones(1)}))
    ['output']
    """
    return {n: t for n, t in tensors.items()
            if backend != "numba" or n not in SAVED_STATE_OMITS}


#: the tensors :func:`case_inputs` gives (with ``score_<param>``): a case's call and cotangent
#: as stored, known without any arithmetic
INPUT_TENSORS = frozenset({"q", "k", "v", "head_map", "visible", "query_valid", "bias", "sink",
                           "dropout", "sanitized_rows", "grad_output"}) | LAYOUT_INPUTS


def case_inputs(case: GoldenCase) -> dict[str, np.ndarray]:
    """The tensors of a case file that the call and its cotangent give without arithmetic:
    q, k, v, head_map, visible, query_valid, bias, the score family's parameters, sink, an
    explicit dropout multiplier, the sanitised rows, grad_output and a paged case's pages
    (each as :func:`case_tensors` stores it, C-contiguous; :data:`INPUT_TENSORS`).

    Examples
    --------
    >>> from refattn.bundle.suites.contract import LOOP6_GRAD_OUTPUT, loop6_call
    >>> sorted(case_inputs(GoldenCase("loop6", loop6_call(), LOOP6_GRAD_OUTPUT, "")))
    ['dropout', 'grad_output', 'head_map', 'k', 'q', 'sanitized_rows', 'v', 'visible']
    """
    call = case.call
    out: dict[str, Any] = {"q": call.q, "k": call.k, "v": call.v, "head_map": call.head_map,
                           "sanitized_rows": call.sanitized_rows(),
                           "grad_output": case.grad_output}
    for name, value in (("visible", call.visible_array()), ("query_valid", call.query_valid),
                        ("bias", call.bias), ("sink", call.sink)):
        if value is not None:
            out[name] = value
    out.update({f"score_{n}": x for n, x in cast(Any, call.score).parameters().items()})
    if isinstance(call.dropout, np.ndarray):  # explicit Z, not a MultiplierSource
        out["dropout"] = call.dropout
    if case.layout is not None:
        out.update(case.layout.tensors())
    return {name: np.ascontiguousarray(t) for name, t in out.items()}


def case_tensors(trace: Trace, grads: Gradients, layout: Any = None) -> dict[str, np.ndarray]:
    """Every tensor a case file stores, by canonical name, C-contiguous.

    With a ``layout`` (:mod:`refattn.bundle.golden.layouts`: a paged KV cache, ...) its inputs
    as given and the gradients mapped back onto them (``grad_k_pages``, ``grad_v_pages``, ...)
    too.
    """
    tensors = {**trace.tensors(), **grads.tensors()}
    if isinstance(trace.call.dropout, np.ndarray):  # explicit Z, not a MultiplierSource
        tensors["dropout"] = trace.call.dropout  # the multiplier as given (pre-broadcast)
    if layout is not None:
        tensors.update({**layout.tensors(), **layout.gradient_tensors(grads)})
    return {name: np.ascontiguousarray(t) for name, t in tensors.items()}


def case_conventions(case: GoldenCase) -> dict[str, Any]:
    """The conventions a manifest entry records: the call's policies, its relation's causal
    alignment and window convention, and the case's own (which must agree: verify checks)."""
    call = case.call
    conv = {
        "polarity": "true_means_legal",
        "gqa_mapping": call.ledger["head_map_mode"],
        "all_masked_rows": call.all_masked_rows,
        "returned_weights": call.returned_weights,
        "scale": float_record(cast(float, call.scale)),  # resolved by the gate
        "scale_placement": call.scale_placement,
        "causal_alignment": "none",
        "window_convention": "none",
    }
    if call.relation is not None:  # a relation names its own alignment and window convention
        rel = call.relation.manifest()
        conv["causal_alignment"] = rel.get("alignment") or "none"
        conv["window_convention"] = rel.get("window_convention") or "none"
    conv.update(case.conventions)
    return conv
