"""Strict finite-row softmax: the contract's Loop 5 oracle for one normalised row.

Owns the row map over the legal support (softmax, logsumexp, the deliberately unsafe
``naive_softmax``), the scalar and block online normalizers, the Jacobian and its checks, the
temperature path and per-row diagnostics. Defers the choice of the support (visibility) to
:mod:`refattn.visibility`/:class:`~refattn.AttentionCall` and everything stochastic to
:mod:`refattn.dropout`.

Strict domain (contract, "Loop 5 contract"): the support is non-empty, every legal score is
finite, masked entries are absent from the reduction (their stored value is ignored), and
normalisation runs over the last (key) axis. NaN, +inf and -inf on a legal entry and an empty
support are rejected *before* any reduction, naming the row; -inf is allowed only on an entry
that ``visible`` already excludes. Scores have shape ``(..., K)``; a row is one index of the
leading axes (for attention: ``(b, h, i)``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from refattn._checks import (
    as_array,
    check_bool,
    check_broadcastable,
    check_float64,
    first_index,
)
from refattn.errors import RefAttnError

__all__ = [
    "JacobianCheck",
    "NaiveSoftmax",
    "NormalizerState",
    "RowDiagnostics",
    "block_online_normalizer",
    "check_jacobian",
    "diagnostics",
    "entropy",
    "entropy_slope",
    "jacobian",
    "limiting_distribution",
    "logsumexp",
    "merge_states",
    "naive_softmax",
    "online_normalizer",
    "probabilities_from_state",
    "reconstruct_probs",
    "softmax",
]

_EPS = float(np.finfo(np.float64).eps)


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
    empty = ~vis.any(axis=-1)
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
    >>> float(logsumexp(np.array([0.0, 0.0]))) == math.log(2.0)
    True
    >>> float(logsumexp(np.array([1000.0, 1000.0])))  # the native sum would overflow
    1000.6931471805599
    """
    s, vis = _rows(scores, visible)
    _, row_max, denom = _stable(s, vis)
    return row_max + np.log(denom)


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


# -- online normalisation --------------------------------------------------------------------
class NormalizerState(NamedTuple):
    """Online-softmax state of a row prefix: ``sum_j exp(s_j) = exp(max) * sum``."""

    max: float
    """The running maximum m (a reference point; any common reference is exact in reals)."""
    sum: float
    """The running denominator ell, expressed relative to ``exp(max)``."""


def _legal_row(row: object) -> np.ndarray:
    r = as_array("row", row)
    check_float64("row", r)
    if r.ndim != 1:
        raise RefAttnError(f"row: expected one row of legal scores (K,), got shape {list(r.shape)}")
    return r


def online_normalizer(row: np.ndarray) -> NormalizerState:
    """The contract's scalar online normalizer, one score at a time.

    Keeps an explicit validity branch, so the empty-state update never evaluates
    ``-inf - (-inf)``.

    Parameters
    ----------
    row : (K,) float64 ndarray
        The legal scores of one row (excluded keys already removed).

    Returns
    -------
    NormalizerState
        ``(max, sum)`` with ``sum_j exp(row_j) = exp(max) * sum``.

    Raises
    ------
    RefAttnError
        On a non-finite score (naming its position) or an empty row.

    Examples
    --------
    >>> online_normalizer(np.array([1000.0, 999.0, 998.0]))
    NormalizerState(max=1000.0, sum=1.5032147244080551)
    """
    r = _legal_row(row)
    valid = False
    running_max, running_sum = -math.inf, 0.0
    for j, value in enumerate(r.tolist()):
        if not math.isfinite(value):
            raise RefAttnError(f"row: legal score {value!r} at key {j}; expected a finite score")
        if not valid:  # first legal score: the state starts here, no -inf arithmetic
            running_max, running_sum, valid = value, 1.0, True
            continue
        new_max = max(running_max, value)
        running_sum = running_sum * math.exp(running_max - new_max) + math.exp(value - new_max)
        running_max = new_max
    if not valid:
        raise RefAttnError("row: softmax support is empty (no legal score)")
    return NormalizerState(running_max, running_sum)


def merge_states(a: NormalizerState, b: NormalizerState) -> NormalizerState:
    """Merge the states of two disjoint parts of a row under the common reference max.

    Examples
    --------
    >>> merge_states(NormalizerState(0.0, 1.0), NormalizerState(0.0, 1.0))
    NormalizerState(max=0.0, sum=2.0)
    """
    for name, state in (("a", a), ("b", b)):
        if not (math.isfinite(state.max) and math.isfinite(state.sum) and state.sum > 0.0):
            raise RefAttnError(f"{name}: expected a valid state (finite max, sum > 0), got {state}")
    m = max(a.max, b.max)
    return NormalizerState(m, a.sum * math.exp(a.max - m) + b.sum * math.exp(b.max - m))


def _partition(n: int, block: int | Sequence[int]) -> list[int]:
    if isinstance(block, (int, np.integer)) and not isinstance(block, bool):
        if block < 1:
            raise RefAttnError(f"block: expected a positive tile width, got {block}")
        return [min(int(block), n - start) for start in range(0, n, int(block))]
    sizes = [int(x) for x in block]
    if any(x < 1 for x in sizes) or sum(sizes) != n:
        raise RefAttnError(
            f"block: expected positive tile sizes summing to the row length {n}, got {sizes}"
        )
    return sizes


def block_online_normalizer(row: np.ndarray, block: int | Sequence[int]) -> NormalizerState:
    """Block-online normalizer: reduce each tile, then merge tile states left to right.

    Parameters
    ----------
    row : (K,) float64 ndarray
        The legal scores of one row.
    block : int or sequence of int
        A tile width, or explicit tile sizes (positive, summing to K) for an arbitrary
        partition.

    Returns
    -------
    NormalizerState
        Equal to the safe reference ``(max(row), sum(exp(row - max(row))))``: the max exactly,
        the sum up to rounding (merge order changes rounding, not the real number).

    Examples
    --------
    >>> row = np.array([1000.0, 999.0, 998.0])
    >>> s = block_online_normalizer(row, [2, 1])
    >>> s.max, probabilities_from_state(row, s).round(8).tolist()
    (1000.0, [0.66524096, 0.24472847, 0.09003057])
    """
    r = _legal_row(row)
    bad = np.flatnonzero(~np.isfinite(r))
    if bad.size:
        j = int(bad[0])
        raise RefAttnError(f"row: legal score {float(r[j])!r} at key {j}; expected a finite score")
    if r.size == 0:
        raise RefAttnError("row: softmax support is empty (no legal score)")
    state: NormalizerState | None = None  # validity branch: no state before the first tile
    start = 0
    for size in _partition(r.size, block):
        tile = r[start : start + size]  # (size,)
        start += size
        m_tile = float(tile.max())
        with np.errstate(over="ignore", under="ignore"):  # gaps below -1.8e308 give exp 0
            tile_state = NormalizerState(m_tile, float(np.exp(tile - m_tile).sum()))
        state = tile_state if state is None else merge_states(state, tile_state)
    assert state is not None  # the row is non-empty (checked above)
    return state


def probabilities_from_state(row: np.ndarray, state: NormalizerState) -> np.ndarray:
    """Probabilities ``exp(row - max) / sum`` of a row from its normalizer state.

    Returns
    -------
    (K,) float64 ndarray

    Examples
    --------
    >>> probabilities_from_state(np.array([0.0, 0.0]), NormalizerState(0.0, 2.0)).tolist()
    [0.5, 0.5]
    """
    r = _legal_row(row)
    with np.errstate(over="ignore", under="ignore"):
        return np.exp(r - state.max) / state.sum


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


# -- diagnostics -------------------------------------------------------------------------------
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
