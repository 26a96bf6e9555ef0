"""Reductions shared by backends: GQA head sums and bias broadcast sums."""

from __future__ import annotations

import numpy as np

__all__ = ["gather_heads", "reduce_to_shape", "sum_heads"]


def gather_heads(x: np.ndarray, head_map: np.ndarray) -> np.ndarray:
    """Effective per-query-head view of kv tensors: (B, Hkv, K, D) -> (B, Hq, K, D).

    Examples
    --------
    >>> gather_heads(np.arange(2.0).reshape(1, 2, 1, 1), np.array([0, 0, 1])).ravel().tolist()
    [0.0, 0.0, 1.0]
    """
    if np.array_equal(head_map, np.arange(x.shape[1])):
        return x
    return x[:, head_map]


def sum_heads(x_eff: np.ndarray, head_map: np.ndarray, Hkv: int) -> np.ndarray:
    """Sum per-query-head gradients into their kv heads: (B, Hq, K, D) -> (B, Hkv, K, D).

    Query heads are added in increasing h, so the result is deterministic.

    Examples
    --------
    >>> x = np.ones((1, 4, 1, 1))
    >>> sum_heads(x, np.array([0, 0, 1, 1]), 2).ravel().tolist()
    [2.0, 2.0]
    """
    if np.array_equal(head_map, np.arange(Hkv)):
        return x_eff.copy()
    out = np.zeros((x_eff.shape[0], Hkv, *x_eff.shape[2:]), dtype=x_eff.dtype)
    for h, g in enumerate(head_map):
        out[:, g] += x_eff[:, h]
    return out


def reduce_to_shape(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum ``x`` over the axes along which an array of ``shape`` was broadcast to ``x.shape``.

    Examples
    --------
    >>> reduce_to_shape(np.ones((2, 3, 4)), (3, 1)).tolist()
    [[8.0], [8.0], [8.0]]
    """
    lead = x.ndim - len(shape)
    out = x.sum(axis=tuple(range(lead))) if lead else x
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and out.shape[a] != 1)
    if axes:
        out = out.sum(axis=axes, keepdims=True)
    return np.ascontiguousarray(out)
