"""Named results of the engine: the forward :class:`Trace` and the backward :class:`Gradients`.

Field names are the canonical tensor names (docs/ARCHITECTURE.md); golden files use the same names.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from refattn._boundary import public
from refattn.call import AttentionCall

if TYPE_CHECKING:
    from refattn.call.scores import ScoreFamily

__all__ = [
    "FORWARD_NAMES",
    "GRADIENT_NAMES",
    "OPTIONAL_FORWARD_NAMES",
    "OPTIONAL_GRADIENT_NAMES",
    "SAVED_STATE_NAMES",
    "SAVED_STATE_OMITS",
    "Gradients",
    "Trace",
]

FORWARD_NAMES = (
    "scores", "biased_scores", "masked_scores", "row_max", "lse", "probs",
    "dropout_multiplier", "consumed", "output",
)
GRADIENT_NAMES = (
    "grad_output", "grad_v", "grad_consumed", "grad_probs", "row_dot", "row_dot_output",
    "grad_scores", "grad_q", "grad_k", "grad_bias",
)
#: what a saved-state trace keeps of the forward (a kernel's saved state: the numba golden
#: generator, :mod:`refattn.engine.numba.generator`): no (B, Hq, Q, K) tensor
SAVED_STATE_NAMES = ("row_max", "lse", "output", "sanitized_rows")
#: the trace and gradient tensors a saved-state case does not store: every (B, Hq, Q, K) stage
SAVED_STATE_OMITS = frozenset(
    [n for n in FORWARD_NAMES if n not in SAVED_STATE_NAMES]
    + ["softcap_input", "sink_probs", "grad_consumed", "grad_probs", "grad_scores",
       "grad_softcap_input"])
#: tensors that exist only when a score modifier is on (softcap, sink); None otherwise
OPTIONAL_FORWARD_NAMES = ("softcap_input", "sink_probs")
OPTIONAL_GRADIENT_NAMES = ("grad_softcap_input", "grad_sink")


def _freeze(obj: Any) -> None:
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, np.ndarray):
            value.flags.writeable = False
        elif isinstance(value, dict):  # e.g. grad_score_params
            for item in value.values():
                if isinstance(item, np.ndarray):
                    item.flags.writeable = False


@public
@dataclass(frozen=True, eq=False)
class Trace:
    """Every forward intermediate of one call, in float64, under its canonical name.

    Attributes
    ----------
    call : AttentionCall
        The validated call this trace executes.
    scores : (B, Hq, Q, K) ndarray
        ``alpha * u`` with ``u`` the call's compatibility (``q @ k_eff^T`` for dot; alpha
        applied exactly once, at the call's placement), then ``c * tanh(. / c)`` when a
        softcap ``c`` is set.
    biased_scores : (B, Hq, Q, K) ndarray
        ``scores + bias``.
    masked_scores : (B, Hq, Q, K) ndarray
        ``biased_scores`` with -inf where not visible.
    row_max, lse : (B, Hq, Q) ndarray
        Maximum and log-sum-exp over the legal support (and the sink logit, when set).
    probs : (B, Hq, Q, K) ndarray
        Pre-dropout probabilities P; exactly 0 off the support.
    dropout_multiplier : (B, Hq, Q, K) ndarray
        Z (all ones when dropout is off).
    consumed : (B, Hq, Q, K) ndarray
        ``P * Z``.
    output : (B, Hq, Q, Dv) ndarray
        ``consumed @ v_eff``, exactly 0 where ``query_valid`` is False.
    sanitized_rows : (B, Hq, Q) bool ndarray
        Rows given a temporary legal key 0 under ``sanitize_then_zero_invalid_query``.
    backend : str
        The backend that produced the trace.
    materialized : dict
        Which logical objects received storage.
    softcap_input : (B, Hq, Q, K) ndarray or None
        The scaled scores before the softcap (None without a softcap).
    sink_probs : (B, Hq, Q) ndarray or None
        Probability mass taken by the sink logit (None without a sink); with a sink,
        ``probs.sum(-1) + sink_probs == 1``.
    arithmetic : str
        ``"ieee754_binary64"`` (float64 arithmetic in some order: numpy, numba) or
        ``"stepwise_correctly_rounded"`` (the exact backend: every tensor correctly rounded).
    """

    call: AttentionCall
    scores: np.ndarray | None
    biased_scores: np.ndarray | None
    masked_scores: np.ndarray | None
    row_max: np.ndarray
    lse: np.ndarray
    probs: np.ndarray | None
    dropout_multiplier: np.ndarray | None
    consumed: np.ndarray | None
    output: np.ndarray
    sanitized_rows: np.ndarray
    backend: str = "numpy"
    materialized: dict[str, Any] = field(
        default_factory=lambda: {"scores": True, "probabilities": True}
    )
    softcap_input: np.ndarray | None = None
    sink_probs: np.ndarray | None = None
    arithmetic: str = "ieee754_binary64"

    def __post_init__(self) -> None:
        _freeze(self)

    @property
    def weights(self) -> np.ndarray | None:
        """The weights the call asked for: P, P*Z, or None (``returned_weights``)."""
        match self.call.returned_weights:
            case "none":
                return None
            case "pre_dropout":
                return self.probs
            case "post_dropout":
                return self.consumed
            case other:  # pragma: no cover - the gate rejects other values
                raise AssertionError(other)

    def tensors(self) -> dict[str, np.ndarray]:
        """The materialised canonical forward tensors by name (inputs included)."""
        call = self.call
        out: dict[str, np.ndarray] = {"q": call.q, "k": call.k, "v": call.v,
                                      "head_map": cast(np.ndarray, call.head_map)}  # resolved
        for name, value in (("visible", call.visible_array()), ("query_valid", call.query_valid),
                            ("bias", call.bias)):
            if value is not None:
                out[name] = value
        for name in FORWARD_NAMES:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        out["sanitized_rows"] = self.sanitized_rows
        # score family parameters and modifiers appear only when the call uses them
        for name, value in cast("ScoreFamily", call.score).parameters().items():  # resolved
            out[f"score_{name}"] = value
        if call.sink is not None:
            out["sink"] = call.sink
        for name in OPTIONAL_FORWARD_NAMES:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    def manifest(self, requested_backend: str | None = None) -> dict[str, Any]:
        """The call manifest with this trace's backend and materialisation filled in."""
        return self.call.manifest(
            requested_backend=requested_backend or self.backend,
            selected_backend=self.backend,
            materialization=dict(self.materialized),
            arithmetic_mode=self.arithmetic,
        )


@public
@dataclass(frozen=True, eq=False)
class Gradients:
    """Every backward quantity of one call (the contract's hand-written equations).

    Attributes
    ----------
    grad_output : (B, Hq, Q, Dv) ndarray
        G_O as given.
    grad_v : (B, Hkv, K, Dv) ndarray
        ``consumed^T @ G_O``, summed over the query heads that share a kv head.
    grad_consumed : (B, Hq, Q, K) ndarray
        ``G_O @ v_eff^T`` (G_Pdrop).
    grad_probs : (B, Hq, Q, K) ndarray
        ``grad_consumed * Z`` (G_P).
    row_dot : (B, Hq, Q) ndarray
        ``D = sum_j P * G_P``.
    row_dot_output : (B, Hq, Q) ndarray
        ``D = sum_d G_O * O`` (the second contraction; agrees with ``row_dot``).
    grad_scores : (B, Hq, Q, K) ndarray
        ``G_S = P * (G_P - D)``; exactly 0 on masked entries.
    grad_q : (B, Hq, Q, Dk) ndarray
    grad_k : (B, Hkv, K, Dk) ndarray
    grad_bias : ndarray or None
        ``G_S`` summed to the bias's own broadcast shape.
    grad_softcap_input : (B, Hq, Q, K) ndarray or None
        Gradient with respect to the scaled scores before the softcap:
        ``G_S * (1 - tanh(s / c) ** 2)`` (None without a softcap).
    grad_sink : (Hq,) ndarray or None
        ``-sum_{b,i} sink_probs * D`` (None without a sink).
    grad_score_params : dict of str to ndarray or None
        Gradients of the score family's own parameters (None for dot and cosine).
    """

    grad_output: np.ndarray
    grad_v: np.ndarray
    grad_consumed: np.ndarray | None
    grad_probs: np.ndarray | None
    row_dot: np.ndarray
    row_dot_output: np.ndarray
    grad_scores: np.ndarray | None
    grad_q: np.ndarray
    grad_k: np.ndarray
    grad_bias: np.ndarray | None
    grad_softcap_input: np.ndarray | None = None
    grad_sink: np.ndarray | None = None
    grad_score_params: dict[str, np.ndarray] | None = None

    def __post_init__(self) -> None:
        _freeze(self)

    def tensors(self) -> dict[str, np.ndarray]:
        """The materialised gradient tensors by canonical name."""
        out = {
            name: getattr(self, name) for name in GRADIENT_NAMES if getattr(self, name) is not None
        }
        for name in OPTIONAL_GRADIENT_NAMES:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        for name, value in (self.grad_score_params or {}).items():
            out[f"grad_score_{name}"] = value
        return out
