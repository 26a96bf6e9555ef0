"""The contract's "Scale-placement validation gate": does a fused or re-placed scale agree?

Owns :func:`scale_gate` and its :class:`ScaleGateReport`: manifest assertions (dot family,
multiplicative inverse temperature, applied once, width Dk) and an output comparison against the
eager post-scaled reference. Defers the placements themselves to :mod:`refattn.call.placement`
and the reference arithmetic to :mod:`refattn.engine`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from refattn._checks import first_index
from refattn.call import AttentionCall
from refattn.call.placement import PLACEMENT_ATOL, PLACEMENT_RTOL
from refattn.engine import forward
from refattn.errors import RefAttnError

__all__ = ["ScaleGateReport", "scale_gate"]


@dataclass(frozen=True)
class ScaleGateReport:
    """What the scale-placement gate checked and the worst output difference it saw.

    Attributes
    ----------
    checks : tuple of str
        The manifest assertions that held.
    max_abs_error : float
        Largest ``|candidate - eager|`` over the output.
    worst_index : tuple of int
        Where it occurs, (b, h, i, d).
    """

    checks: tuple[str, ...]
    max_abs_error: float
    worst_index: tuple[int, ...]


def _manifest_failures(
    m: dict[str, Any], who: str, *, alpha: float, width: int | None
) -> list[str]:
    scale = m["scale"]
    fails = []
    family = m.get("score", {}).get("family", "dot")
    if family != "dot":
        fails.append(f"{who}: compatibility family is {family!r}, the gate compares 'dot'")
    if scale.get("semantics") != "multiplicative_inverse_temperature":
        fails.append(f"{who}: scale semantics {scale.get('semantics')!r} is not a multiplier")
    got = float(scale["effective_logit_multiplier"]["decimal"])
    if got != alpha:
        fails.append(f"{who}: effective logit multiplier {got!r} != configured alpha {alpha!r}")
    if scale.get("applied_times") != 1:
        fails.append(f"{who}: multiplier applied {scale.get('applied_times')} times, expected 1")
    if width is not None and scale.get("width") != width:
        fails.append(
            f"{who}: scale width is {scale.get('width')!r} (alpha={got!r} is not Dk**-0.5 "
            f"for Dk={width}); expected the query width {width}"
        )
    return fails


def scale_gate(
    call: AttentionCall,
    candidate_output: np.ndarray,
    *,
    configured_alpha: float,
    candidate_manifest: dict[str, Any] | None = None,
    width_override: bool = False,
    atol: float = PLACEMENT_ATOL,
    rtol: float = PLACEMENT_RTOL,
) -> ScaleGateReport:
    """The contract's "Scale-placement validation gate" for one eager/fused comparison.

    Asserts on ``call``'s manifest (and the candidate's, when given) that the family is dot,
    the scale is a multiplicative inverse temperature equal to ``configured_alpha``, applied
    exactly once, of width ``Dk`` (unless ``width_override``); then compares the candidate's
    output with the eager post-scaled reference output of ``call`` under ``atol``/``rtol``.

    Parameters
    ----------
    call : AttentionCall
        The configured (eager) call; its placement may be any of :data:`PLACEMENTS`.
    candidate_output : (B, Hq, Q, Dv) float64 ndarray
        Output of the implementation under test (a fused kernel, another placement...).
    configured_alpha : float
        The multiplier the model contract specifies.
    candidate_manifest : dict, optional
        The candidate's ``attention_call_v1`` manifest, checked like the call's.
    width_override : bool
        A checkpoint overrides the canonical ``Dk ** -0.5`` (skip the width check).
    atol, rtol : float
        Declared tolerance (default :data:`PLACEMENT_ATOL`, :data:`PLACEMENT_RTOL`).

    Returns
    -------
    ScaleGateReport

    Raises
    ------
    RefAttnError
        Listing every failed assertion (double scaling, d_model instead of d_k, a denominator
        read as a multiplier, mismatched configured scales, output outside tolerance).

    Examples
    --------
    >>> from refattn import AttentionCall, forward
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 3, 4)) for _ in range(3))
    >>> fused = forward(AttentionCall(q, k, v, scale_placement="split")).output
    >>> scale_gate(AttentionCall(q, k, v), fused, configured_alpha=0.5).checks[-1]
    'output_within_tolerance'
    """
    width = None if width_override else call.q.shape[-1]
    fails = _manifest_failures(call.manifest(), "call", alpha=configured_alpha, width=width)
    if candidate_manifest is not None:
        fails += _manifest_failures(candidate_manifest, "candidate", alpha=configured_alpha,
                                    width=width)
    if fails:
        raise RefAttnError("scale gate: " + "; ".join(fails))

    eager_call = replace(call, scale_placement="post")  # the contract's eager reference
    eager = forward(eager_call, backend="numpy").output
    cand = np.asarray(candidate_output)
    if cand.dtype != np.float64 or cand.shape != eager.shape:
        raise RefAttnError(
            f"candidate_output: expected float64 {list(eager.shape)}, "
            f"got {cand.dtype} {list(cand.shape)}"
        )
    err = np.abs(cand - eager)
    outside = ~(err <= atol + rtol * np.abs(eager))  # NaN in the candidate fails too
    bad = first_index(outside)
    if bad is not None:
        raise RefAttnError(
            f"scale gate: candidate output differs from the eager reference at {bad}: "
            f"{float(cand[bad])!r} vs {float(eager[bad])!r} (atol={atol}, rtol={rtol}; "
            f"{int(outside.sum())} element(s) outside); a double-applied, mis-sized or "
            "inverted multiplier changes the model"
        )
    worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(err)), err.shape))
    checks: tuple[str, ...] = ("compatibility_family_dot", "multiplicative_inverse_temperature",
              "effective_multiplier_equals_configured", "applied_exactly_once")
    if width is not None:
        checks += ("scale_width_equals_dk",)
    return ScaleGateReport((*checks, "output_within_tolerance"), float(err[worst]), worst)
