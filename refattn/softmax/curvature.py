"""Curvature and temperature of the softmax row map: Jacobian, entropy and limits.

Owns the Jacobian ``diag(p) - p p^T`` and its checks, the entropy of a probability row, its
slope along the inverse temperature and the zero-temperature limit. Rows and their legal
support come from :mod:`refattn.softmax.strict`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from refattn._boundary import public
from refattn._checks import (
    as_array,
    check_float64,
    first_index,
)
from refattn.errors import RefAttnError
from refattn.softmax.strict import _rows, _stable

__all__ = [
    "JacobianCheck",
    "check_jacobian",
    "entropy",
    "entropy_slope",
    "jacobian",
    "limiting_distribution",
]

_EPS = float(np.finfo(np.float64).eps)


# -- curvature ---------------------------------------------------------------------------------
def _probability_vector(p: object, *, sum_tol: float = 1e-10) -> np.ndarray:
    arr = as_array("p", p)
    check_float64("p", arr)
    if arr.ndim != 1 or arr.size == 0:
        raise RefAttnError(f"p: expected one non-empty probability row (n,), got {list(arr.shape)}")
    bad = np.flatnonzero(~np.isfinite(arr) | (arr < 0.0))
    if bad.size:
        j = int(bad[0])
        raise RefAttnError(f"p: entry {j} is {float(arr[j])!r}; expected a finite probability >= 0")
    total = float(arr.sum())
    if abs(total - 1.0) > sum_tol:
        raise RefAttnError(f"p: entries sum to {total!r}; expected 1 within {sum_tol}")
    return arr


@public
def jacobian(p: np.ndarray) -> np.ndarray:
    """The softmax Jacobian ``J = diag(p) - p p^T`` (also the Hessian of the log-partition).

    Parameters
    ----------
    p : (n,) float64 ndarray
        A probability row over the legal support (sums to 1 within 1e-10).

    Returns
    -------
    (n, n) float64 ndarray
        ``J[i, j] = d p_i / d s_j``; symmetric positive semidefinite, ``J @ 1 = 0``.

    Examples
    --------
    >>> jacobian(np.array([1.0])).tolist()
    [[0.0]]
    >>> jacobian(np.array([0.5, 0.5])).tolist()
    [[0.25, -0.25], [-0.25, 0.25]]
    """
    arr = _probability_vector(p)
    return np.diag(arr) - np.outer(arr, arr)  # (n, n)


@public
@dataclass(frozen=True)
class JacobianCheck:
    """Report of :func:`check_jacobian` (every field is a measured number or a verdict).

    Attributes
    ----------
    n : int
        Support size.
    tol : float
        Absolute tolerance used for every check.
    reference_error : float
        ``max |J - (diag(p) - p p^T)|`` (0 when J was built here).
    symmetry_error : float
        ``max |J - J^T|``.
    null_residual : float
        ``max(|J @ 1|, |1^T J|)``: the constant direction is null (row-offset invariance).
    min_eigenvalue : float
        Smallest eigenvalue of the symmetric part; PSD within tolerance if ``>= -tol``.
    rank : int
        Number of eigenvalues above ``tol``.
    expected_rank : tuple of int
        Ranks consistent with p: ``n_pos - 1`` where ``n_pos`` counts entries above ``tol``,
        or also ``n_pos`` when some 0 < p_j <= tol (eigenvalues interlace with the sorted p).
    ok : bool
        All of the above hold.
    """

    n: int
    tol: float
    reference_error: float
    symmetry_error: float
    null_residual: float
    min_eigenvalue: float
    rank: int
    expected_rank: tuple[int, ...]
    ok: bool


@public
def check_jacobian(
    p: np.ndarray, jac: np.ndarray | None = None, *, tol: float | None = None
) -> JacobianCheck:
    """Check a softmax Jacobian: reference value, symmetry, null direction, PSD, rank.

    Parameters
    ----------
    p : (n,) float64 ndarray
        The probability row.
    jac : (n, n) float64 ndarray, optional
        A Jacobian computed elsewhere (another stack, finite differences). Default: build
        ``diag(p) - p p^T`` here and check its properties.
    tol : float, optional
        Absolute tolerance; default ``8 * n * eps`` (entries of J are at most 1/4).

    Returns
    -------
    JacobianCheck

    Examples
    --------
    >>> r = check_jacobian(np.array([0.2, 0.3, 0.5]))
    >>> r.ok, r.rank, r.expected_rank
    (True, 2, (2,))
    >>> check_jacobian(np.array([1.0])).rank
    0
    """
    arr = _probability_vector(p)
    n = arr.size
    tol = 8.0 * n * _EPS if tol is None else float(tol)
    ref = np.diag(arr) - np.outer(arr, arr)  # (n, n)
    if jac is None:
        J = ref
    else:
        J = as_array("jac", jac)
        check_float64("jac", J)
        if J.shape != (n, n):
            raise RefAttnError(f"jac: expected shape [n={n}, n={n}], got {list(J.shape)}")
        if not np.isfinite(J).all():
            raise RefAttnError("jac: expected finite entries")
    ones = np.ones(n)
    eig = np.linalg.eigvalsh(0.5 * (J + J.T))  # ascending
    rank = int((eig > tol).sum())
    n_pos = int((arr > tol).sum())
    tiny = bool(((arr > 0.0) & (arr <= tol)).any())
    expected = (n_pos - 1, n_pos) if tiny else (max(n_pos - 1, 0),)
    ref_err = float(np.abs(J - ref).max())
    sym_err = float(np.abs(J - J.T).max())
    null = float(max(np.abs(J @ ones).max(), np.abs(ones @ J).max()))
    min_eig = float(eig[0])
    ok = (ref_err <= tol and sym_err <= tol and null <= tol and min_eig >= -tol
          and rank in expected)
    return JacobianCheck(n, tol, ref_err, sym_err, null, min_eig, rank, expected, ok)


# -- temperature and entropy -------------------------------------------------------------------
def _check_alpha(alpha: object) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, np.integer, np.floating)):
        raise RefAttnError(
            f"alpha: expected a real inverse temperature, got {type(alpha).__name__}"
        )
    a = float(alpha)
    if not (math.isfinite(a) and a >= 0.0):
        raise RefAttnError(f"alpha: expected a finite inverse temperature >= 0, got {a!r}")
    return a


@public
def entropy(p: np.ndarray) -> np.ndarray:
    """Shannon entropy ``-sum p log p`` of each row (with ``0 log 0 = 0``), in nats.

    Parameters
    ----------
    p : (..., K) float64 ndarray
        Probability rows (finite, non-negative).

    Returns
    -------
    (...) float64 ndarray

    Examples
    --------
    >>> bool(np.isclose(entropy(np.full(4, 0.25)), np.log(4)))
    True
    >>> entropy(np.array([1.0, 0.0])).tolist()
    0.0
    """
    arr = as_array("p", p)
    check_float64("p", arr)
    if arr.ndim == 0:
        raise RefAttnError("p: expected at least one axis (..., K), got a scalar")
    idx = first_index(~np.isfinite(arr) | (arr < 0.0))
    if idx is not None:
        raise RefAttnError(f"p: entry {tuple(int(i) for i in idx)} is {float(arr[idx])!r}; "
                           "expected a finite probability >= 0")
    safe = np.where(arr > 0.0, arr, 1.0)  # log(1) = 0 stands in for 0 log 0
    return 0.0 - (arr * np.log(safe)).sum(axis=-1)  # 0.0 - x: no -0.0 for one-hot rows


@public
def entropy_slope(
    scores: np.ndarray, alpha: float, visible: np.ndarray | None = None
) -> np.ndarray:
    """``dH/dalpha`` of ``softmax(alpha * s)``: ``-alpha * Var_p(s)`` over the legal support.

    From ``H = A(alpha s) - alpha E_p[s]``, ``dA/dalpha = E_p[s]`` and
    ``dE_p[s]/dalpha = Var_p(s)``. Non-positive for ``alpha >= 0``: sharpening never increases
    entropy; zero at ``alpha = 0`` or when the legal scores are all equal.

    Parameters
    ----------
    scores : (..., K) float64 ndarray
    alpha : float
        Inverse temperature, finite and ``>= 0``.
    visible : bool ndarray broadcastable to (..., K), optional

    Returns
    -------
    (...) float64 ndarray

    Examples
    --------
    >>> entropy_slope(np.array([1.0, 1.0, 1.0]), 2.0).tolist()
    -0.0
    >>> bool(entropy_slope(np.array([0.0, 1.0]), 1.0) < 0)
    True
    """
    a = _check_alpha(alpha)
    s, vis = _rows(scores, visible)
    with np.errstate(over="ignore"):
        tempered = np.where(vis, a * s, 0.0)  # (..., K)
    if not np.isfinite(tempered).all():
        raise RefAttnError(f"alpha: alpha * scores overflows for alpha = {a!r}")
    p = _stable(tempered, vis)[0]  # (..., K)
    # shift by the row max first (Var is shift-invariant): equal legal scores give exactly 0;
    # keys whose probability underflowed to 0 contribute nothing, as in the float64 P itself
    masked = np.where(vis, s, -np.inf)
    with np.errstate(over="ignore"):
        gap = masked - masked.max(axis=-1, keepdims=True)  # (..., K), <= 0 on the support
    shifted = np.where(vis & (p > 0.0), gap, 0.0)
    mean = (p * shifted).sum(axis=-1)  # E_p[s] - max
    var = (p * (shifted - mean[..., None]) ** 2).sum(axis=-1)  # Var_p(s), two-pass
    return -a * var


@public
def limiting_distribution(scores: np.ndarray, visible: np.ndarray | None = None) -> np.ndarray:
    """The ``alpha -> inf`` limit of ``softmax(alpha * s)``: uniform over the maximal legal set.

    Ties are exact float comparisons; tied maxima share the limiting mass (no one-hot choice).

    Returns
    -------
    (..., K) float64 ndarray

    Examples
    --------
    >>> limiting_distribution(np.array([3.0, 3.0, 1.0])).tolist()
    [0.5, 0.5, 0.0]
    """
    s, vis = _rows(scores, visible)
    masked = np.where(vis, s, -np.inf)
    top = masked == masked.max(axis=-1, keepdims=True)  # (..., K) the maximal set
    return top / top.sum(axis=-1, keepdims=True)
