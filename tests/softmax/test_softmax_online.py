"""Scalar and block online normalizers reconcile with the safe reference (contract Loop 5)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refattn.errors import RefAttnError
from refattn.softmax import (
    NormalizerState,
    block_online_normalizer,
    merge_states,
    online_normalizer,
    probabilities_from_state,
    softmax,
)
from tests.strategies import rows_and_partitions

EPS = np.finfo(np.float64).eps


def safe_reference(row: np.ndarray) -> NormalizerState:
    m = float(row.max())
    return NormalizerState(m, float(np.exp(row - m).sum()))


def test_contract_row_online_and_block_match_the_published_probabilities():
    row = np.array([1000.0, 999.0, 998.0])
    expected = [0.66524096, 0.24472847, 0.09003057]
    for state in (online_normalizer(row), block_online_normalizer(row, 1),
                  block_online_normalizer(row, 2), block_online_normalizer(row, [1, 2])):
        assert state.max == 1000.0
        assert np.round(probabilities_from_state(row, state), 8).tolist() == expected
    # closed form of the denominator relative to exp(1000): 1 + e^-1 + e^-2
    assert online_normalizer(row).sum == pytest.approx(1 + math.exp(-1) + math.exp(-2),
                                                       rel=4 * EPS)


@settings(max_examples=80, deadline=None)
@given(case=rows_and_partitions())
def test_scalar_and_block_states_equal_the_safe_reference(case):
    row, sizes = case
    ref = safe_reference(row)
    n = row.size
    for state in (online_normalizer(row), block_online_normalizer(row, sizes)):
        assert state.max == ref.max  # the max is exact in every merge order
        # each rescale/merge adds a few roundings: relative error O((n + tiles) eps)
        assert state.sum == pytest.approx(ref.sum, rel=(4 * n + 8) * EPS)
        np.testing.assert_allclose(probabilities_from_state(row, state), softmax(row),
                                   rtol=(4 * n + 8) * EPS, atol=0)


@settings(max_examples=40, deadline=None)
@given(case=rows_and_partitions(), width=st.integers(1, 30))
def test_fixed_width_tiles_equal_explicit_partitions(case, width):
    row, _ = case
    sizes = [min(width, row.size - s) for s in range(0, row.size, width)]
    a = block_online_normalizer(row, width)
    b = block_online_normalizer(row, sizes)
    assert a == b  # same tiles, same merge order: bitwise


def test_merge_is_order_independent_in_real_arithmetic():
    row = np.array([3.0, -1.0, 7.5, 0.25, 7.5, -20.0])
    left = block_online_normalizer(row[:2], 2)
    mid = block_online_normalizer(row[2:4], 2)
    right = block_online_normalizer(row[4:], 2)
    a = merge_states(merge_states(left, mid), right)
    b = merge_states(left, merge_states(mid, right))
    c = merge_states(right, merge_states(left, mid))
    for s in (a, b, c):
        assert s.max == 7.5
        assert s.sum == pytest.approx(safe_reference(row).sum, rel=8 * EPS)


def test_validity_branch_never_evaluates_inf_minus_inf():
    # a single legal score: the first update initialises the state, no -inf arithmetic
    with np.errstate(all="raise"):
        assert online_normalizer(np.array([-1e308])) == NormalizerState(-1e308, 1.0)
        assert block_online_normalizer(np.array([-1e308]), 1) == NormalizerState(-1e308, 1.0)


@pytest.mark.parametrize("func", [online_normalizer,
                                  lambda r: block_online_normalizer(r, 2)])
def test_online_normalizers_reject_non_finite_and_empty_rows(func):
    with pytest.raises(RefAttnError, match="legal score nan at key 1"):
        func(np.array([0.0, np.nan, 1.0]))
    with pytest.raises(RefAttnError, match="legal score inf at key 2"):
        func(np.array([0.0, 1.0, np.inf]))
    with pytest.raises(RefAttnError, match="support is empty"):
        func(np.array([]))
    with pytest.raises(RefAttnError, match="expected dtype float64"):
        func(np.array([1, 2]))


def test_block_partition_is_validated():
    row = np.zeros(5)
    with pytest.raises(RefAttnError, match="summing to the row length 5"):
        block_online_normalizer(row, [2, 2])
    with pytest.raises(RefAttnError, match="positive tile width"):
        block_online_normalizer(row, 0)
    with pytest.raises(RefAttnError, match="expected a valid state"):
        merge_states(NormalizerState(-math.inf, 0.0), NormalizerState(0.0, 1.0))
