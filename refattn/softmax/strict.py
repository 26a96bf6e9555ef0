"""Strict finite-row softmax: the contract's Loop 5 oracle for one normalised row.

Owns the row map over the legal support (softmax, logsumexp, the deliberately unsafe
``naive_softmax``, probabilities rebuilt from a saved log-partition) and the domain checks the
other softmax modules share (``_rows``, ``_support``). Defers the choice of the support
(visibility) to :mod:`refattn.masks`/:class:`~refattn.AttentionCall` and everything stochastic
to :mod:`refattn.dropout`.

Strict domain (contract, "Loop 5 contract"): the support is non-empty, every legal score is
finite, masked entries are absent from the reduction (their stored value is ignored), and
normalisation runs over the last (key) axis. NaN, +inf and -inf on a legal entry and an empty
support are rejected *before* any reduction, naming the row; -inf is allowed only on an entry
that ``visible`` already excludes. Scores have shape ``(..., K)``; a row is one index of the
leading axes (for attention: ``(b, h, i)``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from refattn._boundary import public
from refattn._checks import (
    as_array,
    check_bool,
    check_broadcastable,
    check_float64,
    first_index,
)
from refattn.errors import RefAttnError

__all__ = [
    "NaiveSoftmax",
    "logsumexp",
    "naive_softmax",
    "reconstruct_probs",
    "softmax",
]


# -- domain -------------------------------------------------------------------------------
def _row_text(row: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(int(i)) for i in row) + ")" if row else "() (the only row)"


def _support(visible: object | None, shape: tuple[int, ...]) -> np.ndarray:
    """``visible`` (None: every key legal) validated and broadcast to the scores' ``shape``."""
    if visible is None:
        return np.broadcast_to(np.True_, shape)
    v = as_array("visible", visible)
    check_bool("visible", v)
    letters = ",".join([f"axis{n}" for n in range(len(shape) - 1)] + ["K"])
    check_broadcastable("visible", v, shape, letters)
    return np.broadcast_to(v, shape)


def _rows(scores: object, visible: object | None, name: str = "scores") -> tuple[
    np.ndarray, np.ndarray
]:
    """Validate ``(scores, visible)``; return the float64 scores and a full bool support."""
    s = as_array(name, scores)
    check_float64(name, s)
    if s.ndim == 0:
        raise RefAttnError(f"{name}: expected at least one axis (..., K), got a scalar")
    vis = _support(visible, s.shape)
    # policy before arithmetic: every legal score must be finite
    bad = vis & ~np.isfinite(s)
    idx = first_index(bad)
    if idx is not None:
        value = s[idx]
        kind = "NaN" if np.isnan(value) else ("+inf" if value > 0 else "-inf")
        hint = (" (-inf may only encode an entry that visible excludes)" if kind == "-inf"
                else "")
        raise RefAttnError(
            f"{name}: legal {kind} at row {_row_text(idx[:-1])}, key {int(idx[-1])}; "
            f"expected a finite score on every legal entry{hint} "
            f"({int(bad.sum())} such entr{'y' if bad.sum() == 1 else 'ies'})"
        )
    empty = np.asarray(~vis.any(axis=-1))
    idx = first_index(empty)
    if idx is not None:
        raise RefAttnError(
            f"visible: row {_row_text(idx)} has an empty legal support; softmax over no key "
            f"is undefined ({int(empty.sum())} such row(s))"
        )
    return s, vis


def _stable(s: np.ndarray, vis: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Subtract-max on validated input: (probs, row_max, denominator)."""
    masked = np.where(vis, s, -np.inf)  # (..., K): excluded entries leave the reduction
    row_max = masked.max(axis=-1)  # (...,) finite: the support is non-empty
    with np.errstate(over="ignore", under="ignore"):  # a gap beyond -1.8e308 is exp(-inf) = 0
        e = np.exp(masked - row_max[..., None])  # (..., K) in [0, 1]; exactly 0 where excluded
    denom = e.sum(axis=-1)  # (...,) in [1, K]
    return e / denom[..., None], row_max, denom


@public
def softmax(scores: np.ndarray, visible: np.ndarray | None = None) -> np.ndarray:
    """Softmax over the legal support of each row (subtract-max form).

    Parameters
    ----------
    scores : (..., K) float64 ndarray
        Finite on every legal entry; excluded entries may hold anything (e.g. -inf).
    visible : bool ndarray broadcastable to (..., K), optional
        True where the key is legal. Default: every key is legal.

    Returns
    -------
    (..., K) float64 ndarray
        Probabilities; exactly 0 on excluded entries, each row sums to 1 within rounding.

    Raises
    ------
    RefAttnError
        On a non-float64 input, a legal NaN/+inf/-inf or an empty support, naming the row.

    Examples
    --------
    >>> softmax(np.array([1000.0, 999.0, 998.0])).round(8).tolist()
    [0.66524096, 0.24472847, 0.09003057]
    >>> softmax(np.array([0.0, -np.inf]), np.array([True, False])).tolist()
    [1.0, 0.0]
    """
    s, vis = _rows(scores, visible)
    return _stable(s, vis)[0]


@public
def logsumexp(scores: np.ndarray, visible: np.ndarray | None = None) -> np.ndarray:
    """The row log-partition ``A(s) = log sum_{j legal} exp(s_j)``, computed stably.

    Parameters
    ----------
    scores : (..., K) float64 ndarray
    visible : bool ndarray broadcastable to (..., K), optional

    Returns
    -------
    (...) float64 ndarray
        ``row_max + log(sum exp(s - row_max))``; its gradient is :func:`softmax`.

    Examples
    --------
    >>> import math
    >>> float(logsumexp(np.array([0.0, 0.0]))) == math.log(2.0)
    True
    >>> float(logsumexp(np.array([1000.0, 1000.0])))  # the native sum would overflow
    1000.6931471805599
    """
    s, vis = _rows(scores, visible)
    _, row_max, denom = _stable(s, vis)
    return row_max + np.log(denom)


@public
def reconstruct_probs(
    scores: np.ndarray, lse: np.ndarray, visible: np.ndarray | None = None
) -> np.ndarray:
    """Recompute probabilities from a saved row log-partition: ``exp(s - lse)`` on the support.

    The dense backward's saved-state route (contract, "Training state saved by the local
    operation"): keep ``lse`` (one number per row) instead of P.

    Parameters
    ----------
    scores : (..., K) float64 ndarray
        The same finite legal scores the forward normalised.
    lse : (...) float64 ndarray
        Saved :func:`logsumexp` of each row.
    visible : bool ndarray broadcastable to (..., K), optional

    Returns
    -------
    (..., K) float64 ndarray
        Equal to :func:`softmax` up to rounding; exactly 0 off the support.

    Examples
    --------
    >>> s = np.array([[1.0, 2.0, 3.0]])
    >>> bool(np.allclose(reconstruct_probs(s, logsumexp(s)), softmax(s), rtol=1e-15, atol=0))
    True
    """
    s, vis = _rows(scores, visible)
    saved = as_array("lse", lse)
    check_float64("lse", saved)
    if saved.shape != s.shape[:-1]:
        raise RefAttnError(f"lse: expected shape {list(s.shape[:-1])} (one per row), got "
                           f"{list(saved.shape)}")
    idx = first_index(~np.isfinite(saved))
    if idx is not None:
        raise RefAttnError(f"lse: row {_row_text(idx)} is {float(saved[idx])!r}; expected finite")
    with np.errstate(over="ignore", under="ignore"):
        return np.exp(np.where(vis, s, -np.inf) - saved[..., None])  # exactly 0 where excluded


class NaiveSoftmax(NamedTuple):
    """Result of :func:`naive_softmax`: the direct formula and what went wrong in it."""

    probs: np.ndarray
    """(..., K): ``exp(s) / sum exp(s)``; NaN where the denominator overflowed or vanished."""
    denominator: np.ndarray
    """(...): the native denominator ``sum_{j legal} exp(s_j)`` (may be inf or 0)."""
    overflow: np.ndarray
    """(...) bool: the native denominator overflowed to +inf."""
    underflow: np.ndarray
    """(...) bool: every legal exponential underflowed, so the denominator is 0."""


@public
def naive_softmax(scores: np.ndarray, visible: np.ndarray | None = None) -> NaiveSoftmax:
    """The two-pass direct softmax (no max subtraction), kept to show the overflow.

    Same strict domain as :func:`softmax`; the arithmetic is ``exp(s) / sum exp(s)``, whose
    native denominator overflows for scores above ~709.78 (and vanishes below ~-745).
    Floating-point warnings are suppressed; the failure is reported in the result instead.

    Parameters
    ----------
    scores : (..., K) float64 ndarray
    visible : bool ndarray broadcastable to (..., K), optional

    Returns
    -------
    NaiveSoftmax
        probs (..., K), denominator (...), overflow (...) bool, underflow (...) bool.

    Examples
    --------
    >>> r = naive_softmax(np.array([1000.0, 999.0, 998.0]))
    >>> bool(r.overflow), r.probs.tolist()
    (True, [nan, nan, nan])
    >>> naive_softmax(np.array([1.0, 0.0])).probs.round(6).tolist()
    [0.731059, 0.268941]
    """
    s, vis = _rows(scores, visible)
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        e = np.where(vis, np.exp(np.where(vis, s, 0.0)), 0.0)  # (..., K) native exponentials
        denom = e.sum(axis=-1)  # (...,)
        probs = e / denom[..., None]
    return NaiveSoftmax(probs, denom, np.isinf(denom), denom == 0.0)
