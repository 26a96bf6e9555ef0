"""Which merge produced a merged state: the honest one, or a known bug, recomputed and tested.

Owns :func:`diagnose_merge` and :data:`HYPOTHESES`. Given the partials and a candidate merged
``(out, lse)``, each hypothesis recomputes the merge it names from the partials and tests the
candidate against it within a tolerance; the verdict is the first hypothesis that fits:

``"correct"``
    :func:`~refattn.states.merge.merge_states` in the stated base.
``"wrong_base"``
    a merge that read the lse in the other base (base-2 lse merged with exp/log, or natural
    lse with exp2/log2): weights ``b'^(s_i - m)`` and lse ``m + log_b'(sum)``, ``b'`` the other
    base. The signature: the weights are too flat (exp on base-2 numbers) or too sharp.
``"not_renormalised"``
    a merge that scaled each partial by ``b^(s_i - m)`` (relative to the largest partial) and
    never divided by their sum: the output too large by ``sum_k b^(s_k - m)``; lse honest.
``"swapped_lse"``
    the lses paired with the wrong partials: partial ``i`` merged with the lse of partial
    ``S - 1 - i`` (two partials: swapped).

A candidate fits a hypothesis when every element satisfies
``|x - x_h| <= rtol * (|x_h| + 1)`` (output and lse, -inf lse equal to -inf). Equal lses make
every hypothesis but "not_renormalised" coincide: such partials cannot tell them apart, and the
report lists every hypothesis that fits. (layer: states; imports only the foundation)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refattn._boundary import public
from refattn._checks import as_array, check_float64
from refattn.errors import RefAttnError
from refattn.states.layouts import Layout, read_partials, read_state
from refattn.states.merge import Base, _merge, _merged_weights

__all__ = ["HYPOTHESES", "MergeDiagnosis", "diagnose_merge"]

HYPOTHESES = ("correct", "wrong_base", "not_renormalised", "swapped_lse")


@public
@dataclass(frozen=True)
class MergeDiagnosis:
    """What :func:`diagnose_merge` found.

    Attributes
    ----------
    verdict : str
        The first hypothesis of :data:`HYPOTHESES` that fits, or "unexplained".
    fits : tuple of str
        Every hypothesis that fits.
    residuals : dict of str to float
        Per hypothesis, the largest ``|x - x_h| / (|x_h| + 1)`` over output and lse.
    """

    verdict: str
    fits: tuple[str, ...]
    residuals: dict[str, float]


def _hypothesis(name: str, o: np.ndarray, s: np.ndarray, base: Base
                ) -> tuple[np.ndarray, np.ndarray]:
    other: Base = 2 if base == "e" else "e"
    if name == "correct":
        out, lse, _ = _merge(o, s, base)
    elif name == "wrong_base":
        out, lse, _ = _merge(o, s, other)
    elif name == "not_renormalised":
        _, lse = _merged_weights(s, base)
        m = s.max(axis=0)
        m0 = np.where(m == -np.inf, 0.0, m)
        with np.errstate(under="ignore"):
            e = np.exp2(s - m0) if base == 2 else np.exp(s - m0)
        out = np.zeros(o.shape[1:])
        for i in range(o.shape[0]):
            out += e[i][..., None] * o[i]
    elif name == "swapped_lse":
        out, lse, _ = _merge(o, s[::-1], base)
    else:  # pragma: no cover - HYPOTHESES is closed
        raise RefAttnError(f"hypothesis: unknown {name!r}")
    return out, lse


def _residual(x: np.ndarray, ref: np.ndarray) -> float:
    both_inf = (x == -np.inf) & (ref == -np.inf)
    with np.errstate(invalid="ignore"):
        r = np.where(both_inf, 0.0, np.abs(x - ref) / (np.abs(ref) + 1.0))
    r = np.where(np.isnan(r), np.inf, r)
    return float(r.max()) if r.size else 0.0


@public
def diagnose_merge(outs: np.ndarray, lses: np.ndarray, out: np.ndarray, lse: np.ndarray, *,
                   base: Base = "e", layout: Layout = "refattn", rtol: float = 1e-9
                   ) -> MergeDiagnosis:
    """Decide which merge of ``outs``/``lses`` the candidate ``(out, lse)`` is.

    Parameters
    ----------
    outs, lses : float64 ndarray
        The partials, stacked as for :func:`~refattn.states.merge.merge_states`.
    out, lse : float64 ndarray
        The candidate merged state, in ``layout``.
    base : {"e", 2}
        The base the partials' lses are in.
    layout : {"refattn", "flashinfer", "flash_attn"}
    rtol : float
        Tolerance of a fit (see the module docstring); default 1e-9 suits a float64
        candidate, about 1e-5 a float32 kernel's.

    Returns
    -------
    MergeDiagnosis

    Examples
    --------
    >>> from refattn.states import merge_states
    >>> outs = np.array([[[[[1.0]]]], [[[[3.0]]]]]); lses = np.array([[[[0.0]]], [[[2.0]]]])
    >>> bad = merge_states(outs, lses, base="e")       # natural merge of base-2 lses
    >>> diagnose_merge(outs, lses, *bad, base=2).verdict
    'wrong_base'
    >>> diagnose_merge(outs, lses, *merge_states(outs, lses, base=2), base=2).verdict
    'correct'
    """
    if not 0.0 < rtol < 1.0:
        raise RefAttnError(f"rtol: expected a number in (0, 1), got {rtol!r}")
    o, s = read_partials(outs, lses, layout)
    for name, x in (("out", out), ("lse", lse)):
        check_float64(name, as_array(name, x))
    c_out, c_lse = read_state(out, lse, layout)
    if c_out.shape != o.shape[1:]:
        raise RefAttnError(f"out: shape {as_array('out', out).shape} does not match the "
                           "partials' (one partial's shape expected)")
    residuals: dict[str, float] = {}
    for name in HYPOTHESES:
        h_out, h_lse = _hypothesis(name, o, s, base)
        residuals[name] = max(_residual(c_out, h_out), _residual(c_lse, h_lse))
    fits = tuple(n for n in HYPOTHESES if residuals[n] <= rtol)
    return MergeDiagnosis(fits[0] if fits else "unexplained", fits, residuals)
