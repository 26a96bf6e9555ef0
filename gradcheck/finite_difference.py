"""Plain central differences of a scalar function of one array."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["central_difference"]


def central_difference(
    f: Callable[[np.ndarray], float], x: np.ndarray, *, eps: float = 1e-6
) -> np.ndarray:
    """Central-difference gradient of a scalar function, element by element.

    Parameters
    ----------
    f : callable
        ``f(x) -> float``; must not keep a reference to ``x`` (it is perturbed in place).
    x : (...) float64 ndarray
    eps : float
        Absolute step.

    Returns
    -------
    (...) float64 ndarray
        ``(f(x + eps e_i) - f(x - eps e_i)) / (2 eps)`` for every element i.

    Examples
    --------
    >>> g = central_difference(lambda a: float((a ** 2).sum()), np.array([1.0, -2.0]))
    >>> np.round(g, 6).tolist()
    [2.0, -4.0]
    """
    x = np.array(x, dtype=np.float64, copy=True)
    grad = np.empty_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        orig = flat[i]
        flat[i] = orig + eps
        plus = f(x)
        flat[i] = orig - eps
        minus = f(x)
        flat[i] = orig
        gflat[i] = (plus - minus) / (2.0 * eps)
    return grad
