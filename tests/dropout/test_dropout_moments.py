"""Loop 6 dropout moments: analytic formulas, exact standard errors and the Monte Carlo oracle.

The analytic formulas and the standard errors are checked against the exact distribution
(every keep mask enumerated, computed directly from the outcomes); the Monte Carlo oracle,
drawn from the Philox stream, must reproduce the contract's table within 5 exact standard
errors, and must reject wrong formulas.
"""

from __future__ import annotations

import numpy as np
import pytest

from refattn.dropout.moments import (
    DropoutMoments,
    analytic_moments,
    compare_moments,
    monte_carlo_moments,
    standard_errors,
)
from refattn.dropout.variants import enumerate_keep_masks
from refattn.errors import RefAttnError

# contract, "Loop 6 contract": P = [0.1, 0.2, 0.3, 0.4], rho = 0.2, 200,000 fixed-seed draws
P = np.array([0.1, 0.2, 0.3, 0.4])
RHO = 0.2
DRAWS = 200_000
# The contract does not publish V. These value rows are a choice whose analytic E[O] = P @ V is
# the published [0.800000, 0.975000] (checked below), so the table's output rows can be run.
V = np.array([[1.0, 0.75], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
PUBLISHED_ANALYTIC = {"row_sum_mean": 1.0, "row_sum_var": 0.075, "output_mean": [0.8, 0.975],
                      "all_drop": 0.0016}
PUBLISHED_EMPIRICAL = {"row_sum_mean": 1.000564, "row_sum_var": 0.075137}


def exact_distribution(p, rho, v):
    """Outcomes (row sum, output) and probabilities of every keep mask."""
    dist = enumerate_keep_masks(p.size, rho)
    z = dist.masks / (1.0 - rho)  # (2**n, n)
    return (z * p).sum(1), (z * p) @ v, dist.probability, dist.masks


def exact_moments_and_errors(p, rho, v, draws):
    r, o, w, masks = exact_distribution(p, rho, v)
    mean_r = w @ r
    var_r = w @ (r - mean_r) ** 2
    mean_o = w @ o
    c = o - mean_o  # (2**n, Dv)
    cov = np.einsum("m,ma,mb->ab", w, c, c)
    # variance of one product sample (X_a X_b) and of (R - mu)^2
    prod_var = np.einsum("m,ma,mb->ab", w, c**2, c**2) - cov**2
    r4 = w @ (r - mean_r) ** 4
    q = w @ (~masks).all(axis=1)
    moments = DropoutMoments(mean_r, var_r, mean_o, cov, q)
    errors = DropoutMoments(
        np.sqrt(var_r / draws), np.sqrt((r4 - var_r**2) / draws), np.sqrt(np.diag(cov) / draws),
        np.sqrt(prod_var / draws), np.sqrt(q * (1 - q) / draws),
    )
    return moments, errors


def test_analytic_moments_reproduce_the_published_table():
    m = analytic_moments(P, RHO, values=V)
    assert round(m.row_sum_mean, 6) == PUBLISHED_ANALYTIC["row_sum_mean"]
    assert round(m.row_sum_var, 6) == PUBLISHED_ANALYTIC["row_sum_var"]
    assert np.round(m.output_mean, 6).tolist() == PUBLISHED_ANALYTIC["output_mean"]
    assert round(m.all_drop_probability, 6) == PUBLISHED_ANALYTIC["all_drop"]


@pytest.mark.parametrize("case", range(4))
def test_analytic_moments_and_standard_errors_equal_the_enumerated_distribution(case):
    rng = np.random.default_rng(case)
    if case == 0:
        p, rho, v = P, RHO, V
    else:
        n = int(rng.integers(1, 7))
        p = rng.dirichlet(np.ones(n))
        rho = float(rng.uniform(0.05, 0.8))
        v = rng.standard_normal((n, 3))
    exact, exact_se = exact_moments_and_errors(p, rho, v, DRAWS)
    for got, want in ((analytic_moments(p, rho, values=v), exact),
                      (standard_errors(p, rho, values=v, draws=DRAWS), exact_se)):
        np.testing.assert_allclose(got.as_vector(), want.as_vector(), rtol=1e-10, atol=1e-15)


def test_published_empirical_row_sum_figures_are_within_the_declared_tolerance():
    # the contract's own Monte Carlo numbers (another RNG) pass the same 5-sigma test
    a = analytic_moments(P, RHO)
    se = standard_errors(P, RHO, draws=DRAWS)
    assert abs(PUBLISHED_EMPIRICAL["row_sum_mean"] - a.row_sum_mean) <= 5 * se.row_sum_mean
    assert abs(PUBLISHED_EMPIRICAL["row_sum_var"] - a.row_sum_var) <= 5 * se.row_sum_var


def test_monte_carlo_oracle_reproduces_the_loop6_table():
    cmp = compare_moments(P, RHO, values=V, draws=DRAWS, seed=2026)
    assert cmp.ok, dict(zip(cmp.labels, np.round(cmp.z, 2).tolist(), strict=True))
    assert cmp.labels[0] == "row_sum_mean" and cmp.labels[-1] == "all_drop_probability"
    # the declared tolerance is tight: 5 standard errors of the mean is ~0.003 here
    assert cmp.standard_error[0] * 5 < 0.0031


@pytest.mark.parametrize(
    ("wrong", "label"),
    [
        (lambda a: {"row_sum_var": RHO * float((P * P).sum())}, "row_sum_var"),  # no 1/(1-rho)
        (lambda a: {"row_sum_mean": 1.0 - RHO}, "row_sum_mean"),  # unscaled dropout
        (lambda a: {"all_drop_probability": RHO ** (P.size - 1)}, "all_drop_probability"),
        (lambda a: {"output_cov": a.output_cov * 0.9}, "output_cov[0,0]"),
    ],
)
def test_monte_carlo_oracle_rejects_wrong_formulas(wrong, label):
    a = analytic_moments(P, RHO, values=V)
    fields = {f: getattr(a, f) for f in ("row_sum_mean", "row_sum_var", "output_mean",
                                         "output_cov", "all_drop_probability")}
    cmp = compare_moments(P, RHO, values=V, draws=DRAWS, seed=2026,
                          analytic=DropoutMoments(**{**fields, **wrong(a)}))
    assert not cmp.ok
    assert abs(cmp.z[cmp.labels.index(label)]) > 5


def test_monte_carlo_is_replayable_and_seed_dependent():
    a = monte_carlo_moments(P, RHO, values=V, draws=5000, seed=1)
    b = monte_carlo_moments(P, RHO, values=V, draws=5000, seed=1)
    c = monte_carlo_moments(P, RHO, values=V, draws=5000, seed=2)
    assert a.as_vector().tobytes() == b.as_vector().tobytes()
    assert a.as_vector().tobytes() != c.as_vector().tobytes()


def test_rho_zero_has_no_noise():
    m = monte_carlo_moments(P, 0.0, values=V, draws=100, seed=3)
    assert m.row_sum_var == 0.0 and m.all_drop_probability == 0.0
    np.testing.assert_allclose(m.output_mean, P @ V, rtol=100 * 2.0**-52)  # mean of 100 sums
    assert analytic_moments(P, 0.0).row_sum_var == 0.0


def test_inputs_are_validated():
    with pytest.raises(RefAttnError, match=r"rho: expected a dropout probability in \[0, 1\)"):
        analytic_moments(P, 1.0)
    with pytest.raises(RefAttnError, match="probs: expected dtype float64"):
        analytic_moments(np.array([1, 0]), 0.1)
    with pytest.raises(RefAttnError, match=r"values: expected shape \[n=4, Dv\]"):
        analytic_moments(P, 0.1, values=np.ones((3, 2)))
    with pytest.raises(RefAttnError, match="draws: expected an integer >= 2"):
        monte_carlo_moments(P, 0.1, draws=1)
