"""Online and block normalisers: the running (max, sum) state of a softmax row.

Owns :class:`NormalizerState`, the scalar and block online normalisers, the merge of two
states and the probabilities recovered from a state (contract, "Loop 5"). The strict row map
they are checked against is :mod:`refattn.softmax.strict`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from refattn._boundary import public
from refattn._checks import (
    as_array,
    check_float64,
)
from refattn.errors import RefAttnError

__all__ = [
    "NormalizerState",
    "block_online_normalizer",
    "merge_states",
    "online_normalizer",
    "probabilities_from_state",
]


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
    bad = np.isnan(r) | np.isposinf(r)
    if bad.any():
        i = int(np.argmax(bad))
        raise RefAttnError(f"row: legal score {float(r[i])!r} at key {i}; expected a finite "
                           "score (or -inf)")
    return r


@public
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


@public
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
    sizes = [int(x) for x in block]  # type: ignore[union-attr]  # a sequence here
    if any(x < 1 for x in sizes) or sum(sizes) != n:
        raise RefAttnError(
            f"block: expected positive tile sizes summing to the row length {n}, got {sizes}"
        )
    return sizes


@public
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


@public
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
