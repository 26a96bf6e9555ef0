"""Per-row diagnostics of attention probabilities (entropy, peak mass, support size).

Owns :class:`RowDiagnostics` and :func:`diagnostics`, used by ``refattn diagnostics``. The
support and row naming come from :mod:`refattn.softmax.strict`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refattn._boundary import public
from refattn._checks import (
    as_array,
    check_float64,
    first_index,
)
from refattn.errors import RefAttnError
from refattn.softmax.curvature import entropy
from refattn.softmax.strict import _row_text, _support

__all__ = [
    "RowDiagnostics",
    "diagnostics",
]


# -- diagnostics -------------------------------------------------------------------------------
@public
@dataclass(frozen=True)
class RowDiagnostics:
    """Per-row descriptive statistics of pre-dropout attention probabilities (shape ``(...)``).

    Attributes
    ----------
    n_legal : (...) int64 ndarray
        Legal support size n.
    entropy : (...) float64 ndarray
        ``H(p)`` in nats; depends on n.
    normalized_entropy : (...) float64 ndarray
        ``H(p) / log(n)``; 0 for a singleton support (structural certainty).
    effective_support : (...) float64 ndarray
        ``exp(H(p))``: the number of equally weighted keys with the same entropy.
    top_k_mass : (...) float64 ndarray
        Mass of the ``k`` largest probabilities.
    max_probability : (...) float64 ndarray
    logit_gap : (...) float64 ndarray
        ``log(p_(1) / p_(2))``, the score gap between the two largest legal entries (row
        offsets cancel); +inf for a singleton support or when ``p_(2)`` underflowed to 0.
    n_underflow : (...) int64 ndarray
        Legal keys whose probability is exactly 0 (finite-precision underflow, not support).
    k : int
        The k of ``top_k_mass``.
    """

    n_legal: np.ndarray
    entropy: np.ndarray
    normalized_entropy: np.ndarray
    effective_support: np.ndarray
    top_k_mass: np.ndarray
    max_probability: np.ndarray
    logit_gap: np.ndarray
    n_underflow: np.ndarray
    k: int


@public
def diagnostics(
    probs: np.ndarray,
    visible: np.ndarray | None = None,
    *,
    k: int = 2,
    sum_tol: float = 1e-9,
) -> RowDiagnostics:
    """Row diagnostics of a pre-dropout probability tensor (contract, "Better diagnostics").

    Parameters
    ----------
    probs : (..., K) float64 ndarray
        Pre-dropout probabilities P: finite, non-negative, exactly 0 off the support, rows
        summing to 1 within ``sum_tol``.
    visible : bool ndarray broadcastable to (..., K), optional
        The legal support. Default: every key is legal.
    k : int
        How many of the largest probabilities ``top_k_mass`` adds up (default 2).
    sum_tol : float
        Tolerance on each row sum.

    Returns
    -------
    RowDiagnostics

    Raises
    ------
    RefAttnError
        On an invalid probability, mass on an excluded entry, an empty support or a row sum
        off 1, naming the row.

    Examples
    --------
    >>> d = diagnostics(np.array([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]]),
    ...                 np.array([[True, True, False], [True, False, False]]))
    >>> d.n_legal.tolist(), d.effective_support.tolist(), d.normalized_entropy.tolist()
    ([2, 1], [2.0, 1.0], [1.0, 0.0])
    >>> d.logit_gap.tolist(), d.top_k_mass.tolist()
    ([0.0, inf], [1.0, 1.0])
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise RefAttnError(f"k: expected a positive integer, got {k!r}")
    p = as_array("probs", probs)
    check_float64("probs", p)
    if p.ndim == 0:
        raise RefAttnError("probs: expected at least one axis (..., K), got a scalar")
    idx = first_index(~np.isfinite(p) | (p < 0.0))
    if idx is not None:
        raise RefAttnError(f"probs: row {_row_text(idx[:-1])}, key {int(idx[-1])} is "
                           f"{float(p[idx])!r}; expected a finite probability >= 0")
    vis = _support(visible, p.shape)
    idx = first_index(~vis & (p != 0.0))
    if idx is not None:
        raise RefAttnError(f"probs: row {_row_text(idx[:-1])} puts {float(p[idx])!r} on "
                           f"excluded key {int(idx[-1])}; P must be exactly 0 off the support")
    n_legal = vis.sum(axis=-1)  # (...)
    idx = first_index(n_legal == 0)
    if idx is not None:
        raise RefAttnError(f"visible: row {_row_text(idx)} has an empty legal support")
    idx = first_index(np.abs(p.sum(axis=-1) - 1.0) > sum_tol)
    if idx is not None:
        raise RefAttnError(f"probs: row {_row_text(idx)} sums to {float(p[idx].sum())!r}; "
                           f"expected 1 within {sum_tol} (pre-dropout probabilities)")

    H = entropy(p)  # (...)
    log_n = np.log(n_legal.astype(np.float64))
    normalized = np.divide(H, log_n, out=np.zeros_like(H), where=n_legal > 1)
    ranked = -np.sort(-p, axis=-1)  # (..., K) descending; excluded entries are 0
    top1 = ranked[..., 0]
    top2 = ranked[..., 1] if p.shape[-1] > 1 else np.zeros_like(top1)
    with np.errstate(divide="ignore"):
        gap = np.where(top2 > 0.0, np.log(top1) - np.log(np.where(top2 > 0.0, top2, 1.0)),
                       np.inf)
    return RowDiagnostics(
        n_legal=n_legal.astype(np.int64),
        entropy=H,
        normalized_entropy=normalized,
        effective_support=np.exp(H),
        top_k_mass=ranked[..., : int(k)].sum(axis=-1),
        max_probability=top1,
        logit_gap=gap,
        n_underflow=(vis & (p == 0.0)).sum(axis=-1).astype(np.int64),
        k=int(k),
    )
