"""Moments of inverted attention dropout on one row: analytic values and a Monte Carlo oracle.

Owns the contract's Loop 6 statistics for one query row with legal probabilities ``p`` (n keys)
and independent inverted dropout ``Z_j = M_j / (1 - rho)``, ``M_j ~ Bernoulli(1 - rho)``:

- row sum ``R = sum_j p_j Z_j``: ``E[R] = sum_j p_j``, ``Var(R) = rho/(1-rho) sum_j p_j^2``;
- output ``O = sum_j p_j Z_j v_j``: ``E[O] = p @ V``,
  ``Cov(O) = rho/(1-rho) sum_j p_j^2 v_j v_j^T``;
- probability that all n legal routes drop: ``rho^n``;

the exact standard errors of their Monte Carlo estimates (closed-form fourth moments), and the
Monte Carlo oracle itself, whose draws come from the portable :class:`~refattn.dropout.Philox`
stream (one attention row per batch index), so the oracle is replayable on any stack. Defers the
stream to :mod:`refattn.dropout` and alternative placements to :mod:`refattn.dropout.variants`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from refattn._checks import as_array, check_finite, check_float64, first_index
from refattn.dropout.stream import Philox
from refattn.dropout.variants import drop_probability
from refattn.errors import RefAttnError

__all__ = [
    "DropoutMoments",
    "MomentComparison",
    "analytic_moments",
    "compare_moments",
    "monte_carlo_moments",
    "standard_errors",
]


@dataclass(frozen=True)
class DropoutMoments:
    """Moments of one dropout row (analytic values, estimates, or their standard errors).

    Attributes
    ----------
    row_sum_mean : float
        ``E[R]``.
    row_sum_var : float
        ``Var(R)``.
    output_mean : (Dv,) float64 ndarray
        ``E[O]``.
    output_cov : (Dv, Dv) float64 ndarray
        ``Cov(O)``.
    all_drop_probability : float
        ``Pr(every legal route drops)``.
    """

    row_sum_mean: float
    row_sum_var: float
    output_mean: np.ndarray
    output_cov: np.ndarray
    all_drop_probability: float

    def as_vector(self) -> np.ndarray:
        """Every moment in one flat float64 vector (fixed order, for comparisons)."""
        return np.concatenate([
            [self.row_sum_mean, self.row_sum_var],
            self.output_mean,
            self.output_cov[np.triu_indices(self.output_mean.size)],
            [self.all_drop_probability],
        ])

    @staticmethod
    def labels(dv: int) -> list[str]:
        """Names of the entries of :meth:`as_vector` for ``Dv = dv``."""
        rows, cols = np.triu_indices(dv)
        return (["row_sum_mean", "row_sum_var"]
                + [f"output_mean[{d}]" for d in range(dv)]
                + [f"output_cov[{a},{b}]" for a, b in zip(rows, cols, strict=True)]
                + ["all_drop_probability"])


def _row_inputs(probs: object, rho: object, values: object | None) -> tuple[
    np.ndarray, float, np.ndarray
]:
    p = as_array("probs", probs)
    check_float64("probs", p)
    if p.ndim != 1 or p.size == 0:
        raise RefAttnError(f"probs: expected one row of legal probabilities (n,), got "
                           f"{list(p.shape)}")
    check_finite("probs", p)
    idx = first_index(p < 0)
    if idx is not None:
        raise RefAttnError(f"probs: entry {idx[0]} is {float(p[idx])!r}; expected >= 0")
    r = drop_probability(rho)
    if values is None:
        v = np.ones((p.size, 1))
    else:
        v = as_array("values", values)
        check_float64("values", v)
        if v.ndim != 2 or v.shape[0] != p.size:
            raise RefAttnError(f"values: expected shape [n={p.size}, Dv], got {list(v.shape)}")
        check_finite("values", v)
    return p, r, v


def _draws(draws: object) -> int:
    if isinstance(draws, bool) or not isinstance(draws, (int, np.integer)) or draws < 2:
        raise RefAttnError(f"draws: expected an integer >= 2, got {draws!r}")
    return int(draws)


def analytic_moments(
    probs: np.ndarray, rho: float, *, values: np.ndarray | None = None
) -> DropoutMoments:
    """Exact moments of inverted element dropout on one row (independent draws).

    Parameters
    ----------
    probs : (n,) float64 ndarray
        The legal pre-dropout probabilities of the row.
    rho : float
        Dropout probability in [0, 1).
    values : (n, Dv) float64 ndarray, optional
        Value rows; default a single column of ones (then O is the row sum).

    Returns
    -------
    DropoutMoments

    Examples
    --------
    The contract's Loop 6 table (P = [0.1, 0.2, 0.3, 0.4], rho = 0.2):

    >>> m = analytic_moments(np.array([0.1, 0.2, 0.3, 0.4]), 0.2)
    >>> round(m.row_sum_mean, 6), round(m.row_sum_var, 6), round(m.all_drop_probability, 6)
    (1.0, 0.075, 0.0016)
    """
    p, r, v = _row_inputs(probs, rho, values)
    ratio = r / (1.0 - r)  # Var(Z_j) for inverted dropout
    a = p[:, None] * v  # (n, Dv): a_j = p_j v_j
    return DropoutMoments(
        row_sum_mean=float(p.sum()),
        row_sum_var=ratio * float((p * p).sum()),
        output_mean=p @ v,  # (Dv,)
        output_cov=ratio * (a.T @ a),  # (Dv, Dv)
        all_drop_probability=r ** p.size,
    )


def standard_errors(
    probs: np.ndarray, rho: float, *, values: np.ndarray | None = None, draws: int
) -> DropoutMoments:
    """Exact standard errors of the Monte Carlo estimates made by :func:`monte_carlo_moments`.

    For centred ``X = sum_j a_j e_j`` with independent ``e_j = Z_j - 1`` (variance ``s``,
    fourth moment ``k4 = rho + rho^4/(1-rho)^3``), the sample mean of X_a has variance
    ``Cov_aa / N`` and a sample (co)variance has variance
    ``(E[X_a^2 X_b^2] - Cov_ab^2) / N``, with
    ``E[X_a^2 X_b^2] = k4 sum_j a_ja^2 a_jb^2
    + s^2 sum_{j != k} (a_ja^2 a_kb^2 + 2 a_ja a_jb a_ka a_kb)``.
    The all-drop fraction is binomial: ``sqrt(q (1 - q) / N)`` with ``q = rho^n``.

    Parameters
    ----------
    probs, rho, values
        As for :func:`analytic_moments`.
    draws : int
        Number of independent rows N.

    Returns
    -------
    DropoutMoments
        Each field holds the standard error of the matching estimate (to first order in 1/N).

    Examples
    --------
    >>> se = standard_errors(np.array([0.1, 0.2, 0.3, 0.4]), 0.2, draws=200_000)
    >>> round(se.row_sum_mean, 6)
    0.000612
    """
    n_draws = _draws(draws)
    p, r, v = _row_inputs(probs, rho, values)
    s = r / (1.0 - r)
    k4 = r + r**4 / (1.0 - r) ** 3  # E[(Z - 1)^4]
    a = p[:, None] * v  # (n, Dv)
    cov = s * (a.T @ a)  # (Dv, Dv)
    a2 = a * a  # (n, Dv)
    # E[X_a^2 X_b^2]: the j == k terms carry k4, the j != k terms s^2 (Isserlis-like pairing)
    diag_terms = a2.T @ a2  # (Dv, Dv): sum_j a_ja^2 a_jb^2
    cross = np.outer(a2.sum(0), a2.sum(0)) - diag_terms  # sum_{j != k} a_ja^2 a_kb^2
    ab = a.T @ a  # sum_j a_ja a_jb
    cross_pair = ab * ab - diag_terms  # sum_{j != k} a_ja a_jb a_ka a_kb
    fourth = k4 * diag_terms + s * s * (cross + 2.0 * cross_pair)
    var_cov = np.maximum(fourth - cov * cov, 0.0)  # Var of one product sample
    # row sum: the same formulas with v = 1
    p2 = p * p
    var_r = s * float(p2.sum())
    fourth_r = k4 * float((p2 * p2).sum()) + 3.0 * s * s * (float(p2.sum()) ** 2
                                                            - float((p2 * p2).sum()))
    q = r ** p.size
    n = float(n_draws)
    return DropoutMoments(
        row_sum_mean=math.sqrt(var_r / n),
        row_sum_var=math.sqrt(max(fourth_r - var_r * var_r, 0.0) / n),
        output_mean=np.sqrt(np.diag(cov) / n),
        output_cov=np.sqrt(var_cov / n),
        all_drop_probability=math.sqrt(q * (1.0 - q) / n),
    )


def monte_carlo_moments(
    probs: np.ndarray,
    rho: float,
    *,
    values: np.ndarray | None = None,
    draws: int = 200_000,
    seed: int = 0,
    offset: int = 0,
) -> DropoutMoments:
    """Monte Carlo estimates of the moments, from the portable Philox dropout stream.

    Draw ``d`` is row ``b = d`` of the ``(draws, 1, 1, n)`` call ``Philox(rho, seed, offset)``,
    so the estimate is bit-reproducible on any stack that implements the stream. Variances and
    covariances use ``ddof = 1``. (The stream's drop probability is ``threshold / 2**32``,
    within ``2**-33`` of ``rho``.)

    Parameters
    ----------
    probs, rho, values
        As for :func:`analytic_moments`.
    draws : int
        Number of independent rows (default 200,000, the contract's Loop 6 oracle).
    seed, offset : int
        Philox stream parameters.

    Returns
    -------
    DropoutMoments

    Examples
    --------
    >>> m = monte_carlo_moments(np.array([0.5, 0.5]), 0.5, draws=1000, seed=1)
    >>> bool(abs(m.row_sum_mean - 1.0) < 0.1)
    True
    """
    n_draws = _draws(draws)
    p, r, v = _row_inputs(probs, rho, values)
    z = Philox(r, seed, offset).multiplier(n_draws, 1, 1, p.size)[:, 0, 0, :]  # (N, n)
    pz = z * p  # (N, n): consumed weights of each draw
    row_sum = pz.sum(axis=1)  # (N,)
    out = pz @ v  # (N, Dv)
    return DropoutMoments(
        row_sum_mean=float(row_sum.mean()),
        row_sum_var=float(row_sum.var(ddof=1)),
        output_mean=out.mean(axis=0),
        output_cov=np.atleast_2d(np.cov(out, rowvar=False, ddof=1)),
        all_drop_probability=float((z == 0.0).all(axis=1).mean()),
    )


@dataclass(frozen=True)
class MomentComparison:
    """Monte Carlo against analytic moments under a declared z-score tolerance.

    Attributes
    ----------
    labels : list of str
        Name of each compared moment.
    analytic, empirical, standard_error, z : (m,) float64 ndarray
        Values, estimates, exact standard errors and ``(empirical - analytic) / standard_error``
        (0 where the standard error is 0 and the two agree exactly).
    z_tolerance : float
        Declared bound on ``|z|``.
    ok : bool
        Every ``|z| <= z_tolerance``.
    """

    labels: list[str]
    analytic: np.ndarray
    empirical: np.ndarray
    standard_error: np.ndarray
    z: np.ndarray
    z_tolerance: float
    ok: bool


def compare_moments(
    probs: np.ndarray,
    rho: float,
    *,
    values: np.ndarray | None = None,
    draws: int = 200_000,
    seed: int = 0,
    z_tolerance: float = 5.0,
    analytic: DropoutMoments | None = None,
) -> MomentComparison:
    """Run the Monte Carlo oracle and compare it with the analytic moments.

    Parameters
    ----------
    probs, rho, values, draws, seed
        As for :func:`monte_carlo_moments`.
    z_tolerance : float
        Declared tolerance in exact standard errors (default 5: a two-sided normal tail of
        5.7e-7 per moment).
    analytic : DropoutMoments, optional
        Moments to test (default :func:`analytic_moments`); pass a wrong formula to see the
        oracle reject it.

    Returns
    -------
    MomentComparison

    Examples
    --------
    >>> c = compare_moments(np.array([0.25, 0.75]), 0.5, draws=20_000, seed=3)
    >>> c.ok, c.labels[:2]
    (True, ['row_sum_mean', 'row_sum_var'])
    """
    mc = monte_carlo_moments(probs, rho, values=values, draws=draws, seed=seed)
    ref = analytic_moments(probs, rho, values=values) if analytic is None else analytic
    se = standard_errors(probs, rho, values=values, draws=draws)
    a, e, s = ref.as_vector(), mc.as_vector(), se.as_vector()
    diff = e - a
    z = np.divide(diff, s, out=np.where(diff == 0.0, 0.0, np.inf), where=s > 0.0)
    return MomentComparison(
        labels=DropoutMoments.labels(ref.output_mean.size),
        analytic=a, empirical=e, standard_error=s, z=z,
        z_tolerance=float(z_tolerance), ok=bool((np.abs(z) <= z_tolerance).all()),
    )
