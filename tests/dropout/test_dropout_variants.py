"""Alternative dropout placements: exact expectations by enumeration, biased ones flagged.

Expected weights are recomputed here with exact rational arithmetic (fractions.Fraction over
every keep mask), independently of the float enumeration in refattn.dropout.variants.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import numpy as np
import pytest

from refattn.dropout import Philox
from refattn.dropout.variants import (
    VARIANTS,
    apply_variant,
    enumerate_keep_masks,
    expected_weights,
)
from refattn.errors import RefAttnError

# contract, "Alternative dropout placements are different estimators"
P = np.array([0.1, 0.2, 0.7])
P_EXACT = [Fraction(1, 10), Fraction(2, 10), Fraction(7, 10)]
RHO = 0.5


def exact_expectation(p, rho, variant):
    n = len(p)
    total = [Fraction(0)] * n
    for mask in itertools.product([0, 1], repeat=n):
        prob = Fraction(1)
        for m in mask:
            prob *= (1 - rho) if m else rho
        kept = [pj * m for pj, m in zip(p, mask, strict=True)]
        s = sum(kept)
        if variant == "inverted":
            w = [x / (1 - rho) for x in kept]
        elif variant == "unscaled":
            w = kept
        elif s == 0:
            w = [Fraction(0)] * n if variant == "renormalized_after_softmax" else list(p)
        else:
            w = [x / s for x in kept]
        total = [t + prob * x for t, x in zip(total, w, strict=True)]
    return total


@pytest.mark.parametrize("variant", VARIANTS)
def test_expected_weights_equal_exact_rational_enumeration(variant):
    got = expected_weights(P, RHO, variant=variant)
    want = np.array([float(x) for x in exact_expectation(P_EXACT, Fraction(1, 2), variant)])
    np.testing.assert_allclose(got.expected, want, rtol=0, atol=4e-16)
    np.testing.assert_allclose(got.bias, want - P, rtol=0, atol=4e-16)


def test_only_inverted_dropout_is_unbiased_on_the_contract_row():
    verdicts = {v: expected_weights(P, RHO, variant=v) for v in VARIANTS}
    assert verdicts["inverted"].unbiased
    assert verdicts["inverted"].max_abs_bias <= 1e-16
    for v in ("unscaled", "renormalized_after_softmax", "drop_before_softmax"):
        assert not verdicts[v].unbiased, v
        assert verdicts[v].max_abs_bias > 0.05, v
    # both renormalised variants move mass from the large weight to the small ones
    for v in ("renormalized_after_softmax", "drop_before_softmax"):
        assert verdicts[v].bias[0] > 0 and verdicts[v].bias[1] > 0 and verdicts[v].bias[2] < 0


def test_row_sum_one_and_unbiasedness_are_different_contracts():
    inv = expected_weights(P, RHO, variant="inverted")
    drop_first = expected_weights(P, RHO, variant="drop_before_softmax")
    renorm = expected_weights(P, RHO, variant="renormalized_after_softmax")
    assert inv.unbiased and not inv.row_sum_always_one
    assert drop_first.row_sum_always_one and not drop_first.unbiased
    # renormalising after softmax loses the all-dropped mass: E[row sum] = 1 - rho**n
    assert not renorm.row_sum_always_one
    assert renorm.expected_row_sum == pytest.approx(1 - RHO**3, abs=1e-15)
    assert inv.expected_row_sum == pytest.approx(1.0, abs=1e-15)


def test_a_uniform_row_hides_the_bias_of_drop_before_softmax():
    # by symmetry the renormalised row is unbiased when every weight is equal: the bias is a
    # property of unequal rows, which is why the contract row is unequal
    uniform = np.full(4, 0.25)
    assert expected_weights(uniform, RHO, variant="drop_before_softmax").unbiased
    assert not expected_weights(uniform, RHO, variant="renormalized_after_softmax").unbiased


def test_expectations_agree_with_philox_monte_carlo():
    draws = 200_000
    keep = Philox(RHO, 77).keep_mask(draws, 1, 1, 3)[:, 0, 0, :]  # (N, 3)
    for variant in VARIANTS:
        w = apply_variant(P, keep, RHO, variant=variant)  # (N, 3)
        exact = expected_weights(P, RHO, variant=variant).expected
        se = w.std(axis=0, ddof=1) / np.sqrt(draws)
        assert (np.abs(w.mean(axis=0) - exact) <= 5 * se + 1e-15).all(), variant


def test_apply_variant_on_single_masks():
    keep_all_dropped = np.zeros(3, bool)
    assert apply_variant(P, keep_all_dropped, RHO, variant="renormalized_after_softmax").tolist() \
        == [0.0, 0.0, 0.0]
    np.testing.assert_array_equal(
        apply_variant(P, keep_all_dropped, RHO, variant="drop_before_softmax"), P)
    keep = np.array([True, False, True])
    np.testing.assert_allclose(apply_variant(P, keep, RHO, variant="drop_before_softmax"),
                               [0.1 / 0.8, 0.0, 0.7 / 0.8], rtol=1e-15)
    np.testing.assert_array_equal(apply_variant(P, keep, RHO, variant="inverted"),
                                  [0.2, 0.0, 1.4])


def test_enumerated_masks_are_a_distribution():
    d = enumerate_keep_masks(5, 0.3)
    assert d.masks.shape == (32, 5) and len({m.tobytes() for m in d.masks}) == 32
    assert d.probability.sum() == pytest.approx(1.0, abs=1e-15)


def test_variants_are_validated():
    with pytest.raises(RefAttnError, match="variant: expected one of"):
        apply_variant(P, np.ones(3, bool), RHO, variant="dropconnect")  # type: ignore[arg-type]
    with pytest.raises(RefAttnError, match="keep: expected dtype bool"):
        apply_variant(P, np.ones(3), RHO, variant="inverted")
    with pytest.raises(RefAttnError, match=r"n: expected an integer in \[1, 20\]"):
        enumerate_keep_masks(21, 0.5)
    with pytest.raises(RefAttnError, match="rho"):
        expected_weights(P, 1.0, variant="inverted")
