"""Golden cases: a named call with its cotangent and labels, and the tensors it produces.

Owns :class:`GoldenCase` (what a suite defines), :func:`compute` (forward and backward on the
reference backend with BLAS pinned to one thread) and the selection of stored tensors and
recorded conventions of one case. The file format is :mod:`refattn.bundle.format`'s; writing a
bundle is :mod:`refattn.bundle.write`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from threadpoolctl import threadpool_limits

from refattn.call import AttentionCall
from refattn.engine import backward, forward
from refattn.engine.trace import Gradients, Trace
from refattn.errors import RefAttnError
from refattn.records import float_record

__all__ = ["Computed", "GoldenCase", "case_conventions", "case_tensors", "compute"]


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
    """

    case_id: str
    call: AttentionCall
    grad_output: np.ndarray
    comment: str
    flags: tuple[str, ...] = ()
    conventions: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.case_id or not all(c.isalnum() or c in "_-." for c in self.case_id):
            raise RefAttnError(f"case_id: {self.case_id!r} must be non-empty [A-Za-z0-9_.-]")


class Computed(NamedTuple):
    """Forward trace and gradients of one golden case."""

    trace: Trace
    grads: Gradients


def compute(case: GoldenCase) -> Computed:
    """Forward and backward of a case on the reference backend, BLAS pinned to one thread.

    Examples
    --------
    >>> from refattn.bundle.suites.contract import LOOP6_GRAD_OUTPUT, loop6_call
    >>> result = compute(GoldenCase("loop6", loop6_call(), LOOP6_GRAD_OUTPUT, "Loop 6"))
    >>> result.trace.output.shape, result.grads.grad_q.shape
    ((1, 1, 2, 2), (1, 1, 2, 2))
    """
    with threadpool_limits(limits=1):
        trace = forward(case.call, backend="numpy")
        grads = backward(trace, case.grad_output)
    return Computed(trace, grads)


def case_tensors(trace: Trace, grads: Gradients) -> dict[str, np.ndarray]:
    """Every tensor a case file stores, by canonical name, C-contiguous."""
    tensors = {**trace.tensors(), **grads.tensors()}
    if isinstance(trace.call.dropout, np.ndarray):  # explicit Z, not a MultiplierSource
        tensors["dropout"] = trace.call.dropout  # the multiplier as given (pre-broadcast)
    return {name: np.ascontiguousarray(t) for name, t in tensors.items()}


def case_conventions(case: GoldenCase) -> dict[str, Any]:
    """The conventions a manifest entry records: the call's policies plus the case's own."""
    call = case.call
    conv = {
        "polarity": "true_means_legal",
        "gqa_mapping": call.ledger["head_map_mode"],
        "all_masked_rows": call.all_masked_rows,
        "returned_weights": call.returned_weights,
        "scale": float_record(call.scale),
        "scale_placement": call.scale_placement,
        "causal_alignment": "none",
        "window_convention": "none",
    }
    conv.update(case.conventions)
    return conv
