"""Alternative attention-dropout placements as named estimators, and their exact expectations.

Owns the contract's "Alternative dropout placements are different estimators": each variant
maps a pre-dropout row ``p`` and a keep mask ``m`` to the consumed weights ``w``. Enumerating
every keep mask of a row gives each variant's exact expected weights, so a biased variant is
flagged rather than mislabelled as inverted dropout. Defers the stream that draws masks to
:mod:`refattn.dropout` and the moments of inverted dropout to :mod:`refattn.dropout.moments`.

Variants (rho is the drop probability; ``S = sum_j p_j m_j``):

``inverted``
    ``w = p * m / (1 - rho)``: element dropout on P, rescaled; unbiased, row sum random.
``unscaled``
    ``w = p * m``: train-time dropout without rescaling (expects test-time scaling);
    ``E[w] = (1 - rho) p``.
``renormalized_after_softmax``
    ``w = p * m / S``: drop entries of P, then rescale the kept mass to one; an all-dropped row
    (``S = 0``) becomes zero.
``drop_before_softmax``
    DropKey-style: exclude dropped keys *before* normalisation, ``w = softmax(s over kept keys)``
    ``= p * m / S``; an all-dropped row has an empty support, so it falls back to the
    undropped row ``p`` (row sum always one).

The two renormalised variants coincide except for the all-dropped fallback; neither preserves
the expectation of an unequal row.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from refattn._checks import as_array, check_bool, check_float64, first_index
from refattn.errors import RefAttnError

__all__ = [
    "VARIANTS",
    "KeepMaskDistribution",
    "Variant",
    "VariantExpectation",
    "apply_variant",
    "drop_probability",
    "enumerate_keep_masks",
    "expected_weights",
]

Variant = Literal["inverted", "unscaled", "renormalized_after_softmax", "drop_before_softmax"]
VARIANTS: tuple[str, ...] = get_args(Variant)
_MAX_ENUMERATED = 20


def drop_probability(rho: object) -> float:
    """``rho`` as a float dropout probability in [0, 1) (bool, non-real and NaN rejected).

    Examples
    --------
    >>> drop_probability(1)
    Traceback (most recent call last):
        ...
    refattn.errors.RefAttnError: rho: expected a dropout probability in [0, 1), got 1.0
    """
    if isinstance(rho, bool) or not isinstance(rho, (int, float, np.integer, np.floating)):
        raise RefAttnError(f"rho: expected a real dropout probability, got {type(rho).__name__}")
    r = float(rho)
    if not 0.0 <= r < 1.0:
        raise RefAttnError(f"rho: expected a dropout probability in [0, 1), got {r!r}")
    return r


def apply_variant(
    probs: np.ndarray, keep: np.ndarray, rho: float, *, variant: Variant
) -> np.ndarray:
    """Consumed weights of one dropout variant for given rows and keep masks.

    Parameters
    ----------
    probs : (..., n) float64 ndarray
        Pre-dropout probabilities over the legal support.
    keep : (..., n) bool ndarray
        Keep decisions (broadcast against ``probs``).
    rho : float
        Drop probability in [0, 1).
    variant : {"inverted", "unscaled", "renormalized_after_softmax", "drop_before_softmax"}

    Returns
    -------
    (..., n) float64 ndarray

    Examples
    --------
    >>> p, m = np.array([0.1, 0.2, 0.7]), np.array([True, True, False])
    >>> apply_variant(p, m, 0.5, variant="inverted").round(6).tolist()
    [0.2, 0.4, 0.0]
    >>> apply_variant(p, m, 0.5, variant="renormalized_after_softmax").round(6).tolist()
    [0.333333, 0.666667, 0.0]
    """
    p = as_array("probs", probs)
    check_float64("probs", p)
    m = as_array("keep", keep)
    check_bool("keep", m)
    r = drop_probability(rho)
    try:
        p, m = np.broadcast_arrays(p, m)
    except ValueError:
        raise RefAttnError(f"keep: shape {list(m.shape)} does not broadcast against probs "
                           f"{list(p.shape)}") from None
    kept = np.where(m, p, 0.0)  # (..., n)
    match variant:
        case "inverted":
            return kept * (1.0 / (1.0 - r))
        case "unscaled":
            return kept
        case "renormalized_after_softmax" | "drop_before_softmax":
            total = kept.sum(axis=-1, keepdims=True)  # (..., 1)
            w = np.divide(kept, total, out=np.zeros_like(kept), where=total > 0.0)
            if variant == "drop_before_softmax":
                w = np.where(total > 0.0, w, p)  # empty kept support: fall back to p
            return w
        case _:
            raise RefAttnError(f"variant: expected one of {list(VARIANTS)}, got {variant!r}")


@dataclass(frozen=True)
class KeepMaskDistribution:
    """Every keep mask of n independent routes and its probability.

    Attributes
    ----------
    masks : (2**n, n) bool ndarray
    probability : (2**n,) float64 ndarray
        ``(1 - rho)^kept * rho^dropped``; sums to 1.
    """

    masks: np.ndarray
    probability: np.ndarray


def enumerate_keep_masks(n: int, rho: float) -> KeepMaskDistribution:
    """All ``2**n`` keep masks of a row with independent drop probability ``rho``.

    Examples
    --------
    >>> d = enumerate_keep_masks(2, 0.25)
    >>> d.masks.tolist(), d.probability.tolist()
    ([[False, False], [False, True], [True, False], [True, True]], [0.0625, 0.1875, 0.1875, 0.5625])
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= _MAX_ENUMERATED:
        raise RefAttnError(f"n: expected an integer in [1, {_MAX_ENUMERATED}], got {n!r}")
    r = drop_probability(rho)
    masks = np.array(list(itertools.product([False, True], repeat=int(n))), dtype=bool)
    kept = masks.sum(axis=1)
    probability = (1.0 - r) ** kept * r ** (int(n) - kept)
    return KeepMaskDistribution(masks, probability)


@dataclass(frozen=True)
class VariantExpectation:
    """Exact expectation of one variant's weights over every keep mask.

    Attributes
    ----------
    variant : str
    expected : (n,) float64 ndarray
        ``E[w]``.
    bias : (n,) float64 ndarray
        ``E[w] - p``.
    max_abs_bias : float
    expected_row_sum : float
        ``E[sum_j w_j]``.
    row_sum_always_one : bool
        Every mask gives a row sum of 1 (within ``tol``).
    unbiased : bool
        ``max_abs_bias <= tol``: the variant preserves the routing expectation.
    tol : float
    """

    variant: str
    expected: np.ndarray
    bias: np.ndarray
    max_abs_bias: float
    expected_row_sum: float
    row_sum_always_one: bool
    unbiased: bool
    tol: float


def expected_weights(
    probs: np.ndarray, rho: float, *, variant: Variant, tol: float = 1e-12
) -> VariantExpectation:
    """Exact expected weights of a variant, by enumerating every keep mask of the row.

    Parameters
    ----------
    probs : (n,) float64 ndarray
        One row of legal probabilities, n <= 20.
    rho : float
        Drop probability in [0, 1).
    variant : {"inverted", "unscaled", "renormalized_after_softmax", "drop_before_softmax"}
    tol : float
        Absolute tolerance of the unbiasedness and row-sum verdicts.

    Returns
    -------
    VariantExpectation

    Examples
    --------
    >>> p = np.array([0.1, 0.2, 0.7])
    >>> expected_weights(p, 0.5, variant="inverted").unbiased
    True
    >>> r = expected_weights(p, 0.5, variant="drop_before_softmax")
    >>> r.unbiased, r.row_sum_always_one, r.expected.round(6).tolist()
    (False, True, [0.207292, 0.286111, 0.506597])
    """
    p = as_array("probs", probs)
    check_float64("probs", p)
    if p.ndim != 1:
        raise RefAttnError(f"probs: expected one row (n,), got shape {list(p.shape)}")
    idx = first_index(~np.isfinite(p) | (p < 0))
    if idx is not None:
        raise RefAttnError(
            f"probs: entry {idx[0]} is {float(p[idx])!r}; expected a finite probability >= 0"
        )
    dist = enumerate_keep_masks(p.size, rho)
    w = apply_variant(p, dist.masks, rho, variant=variant)  # (2**n, n)
    expected = dist.probability @ w  # (n,)
    bias = expected - p
    sums = w.sum(axis=1)
    max_bias = float(np.abs(bias).max())
    return VariantExpectation(
        variant=variant,
        expected=expected,
        bias=bias,
        max_abs_bias=max_bias,
        expected_row_sum=float(dist.probability @ sums),
        row_sum_always_one=bool((np.abs(sums - 1.0) <= tol).all()),
        unbiased=max_bias <= tol,
        tol=float(tol),
    )
