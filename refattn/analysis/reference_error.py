"""The error of a reference itself: stored float64 tensors against the exact real result.

Owns :func:`reference_error`. The exact real-number result of the whole computation, from the
call's (rounded) inputs with no rounding anywhere after them, is evaluated as arb balls at high
precision (:class:`~refattn.engine.exact.program.Unrounded`); each stored tensor is measured
against it. The stepwise correctly rounded tensors of the exact backend differ from it by the
propagation of their own roundings, so a candidate's error can be set against the reference's.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flint import arb

from refattn.call import AttentionCall
from refattn.engine.exact.balls import balls
from refattn.engine.exact.program import Unrounded, backward_tensors, forward_tensors
from refattn.engine.exact.rounding import precision, round_ball

__all__ = ["ERROR_BITS", "TensorError", "reference_error"]

#: working precision of the unrounded evaluation
ERROR_BITS = 320
#: inputs and stand-ins: stored as given, never computed, so they carry no error of their own
_NOT_COMPUTED = frozenset({"q", "k", "v", "head_map", "visible", "query_valid", "bias",
                           "dropout", "sink", "grad_output", "dropout_multiplier",
                           "sanitized_rows", "masked_scores"})


#: the largest value a three-digit record can hold: a relative error beyond binary64's range
#: (a stored element many orders of magnitude above a real value that underflows) is recorded
#: as this, so the manifest stays JSON (no inf) and still reads as "enormous"
LARGEST_RECORDED = 1.79e308


def _three_digits(x: arb) -> float:
    """A non-negative ball as a binary64 with three significant decimal digits (stable text),
    at most :data:`LARGEST_RECORDED`."""
    value = round_ball(x) if x.rad() == 0 else float(x.mid())
    value = float(f"{value:.2e}") if value is not None else float(x.mid())
    return min(value, LARGEST_RECORDED)


TensorError = dict[str, float | None]


def reference_error(call: AttentionCall, tensors: Mapping[str, np.ndarray], *,
                    bits: int = ERROR_BITS) -> dict[str, TensorError]:
    """Per computed tensor: the largest elementwise relative error and the normwise relative
    error of the stored values against the exact real result of the whole computation.

    Parameters
    ----------
    call : AttentionCall
        The call whose inputs define the real result.
    tensors : mapping of str to ndarray
        Stored canonical tensors (forward and gradients, ``grad_output`` included).
    bits : int
        Working precision of the unrounded evaluation.

    Returns
    -------
    dict
        ``{name: {"max_relative": r, "normwise_relative": n}}``, three significant digits;
        ``max_relative`` is taken over the elements whose real value is not zero (None when a
        stored element is nonzero where the real value is exactly zero); a relative error beyond
        binary64's range is recorded as :data:`LARGEST_RECORDED`.

    Examples
    --------
    >>> import refattn
    >>> x = np.array([[[[0.1, 0.2], [0.3, 0.4]]]])
    >>> call = refattn.AttentionCall(x, x, x)
    >>> t = refattn.forward(call, backend="exact"); g = refattn.backward(t, np.ones_like(x))
    >>> err = reference_error(call, {**t.tensors(), **g.tensors()})
    >>> 0 < err["output"]["max_relative"] < 4e-16, err["scores"]["max_relative"] < 2**-53
    (True, True)
    """
    rounding = Unrounded(bits)
    real = forward_tensors(call, rounding)
    real.update(backward_tensors(call, real, np.asarray(tensors["grad_output"]), rounding))
    for name, value in real.pop("grad_score_params", {}).items():
        real[f"grad_score_{name}"] = value
    out: dict[str, TensorError] = {}
    support = np.isfinite(np.asarray(tensors.get("masked_scores", np.zeros(1))))
    with precision(bits):
        for name in sorted(set(real) & set(tensors) - _NOT_COMPUTED):
            exact = real[name]
            if exact is None or np.asarray(exact).dtype != object:
                continue  # computed from rounded tensors by no new rounding (e.g. no softcap)
            stored = np.asarray(tensors[name], dtype=np.float64)
            mask = np.ones(stored.shape, dtype=bool)
            if name in ("scores", "biased_scores", "softcap_input") and support.shape == mask.shape:
                mask = support  # off the support these are stand-ins
            out[name] = _errors(stored[mask], np.asarray(exact, dtype=object)[mask])
    return out


def _errors(stored: np.ndarray, exact: np.ndarray) -> TensorError:
    # the balls' midpoints: their radii (about 2**-320 relative) do not show in three digits
    exact = np.array([e.mid() for e in exact.ravel()], dtype=object)
    diff = balls(stored.ravel()) - exact
    num = sum((d * d for d in diff.ravel()), arb(0))
    den = sum((e * e for e in exact.ravel()), arb(0))
    worst: arb | None = arb(0)
    for d, e, s in zip(diff.ravel(), exact.ravel(), stored.ravel(), strict=True):
        if e.is_zero():
            if s != 0.0:
                worst = None
            continue
        if worst is not None:
            r = abs(d) / abs(e)
            worst = r if float(r.mid()) > float(worst.mid()) else worst
    normwise = (num / den).sqrt() if not den.is_zero() else arb(0)
    return {"max_relative": None if worst is None else _three_digits(worst),
            "normwise_relative": _three_digits(normwise)}
