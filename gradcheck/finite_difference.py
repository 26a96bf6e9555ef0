"""Plain central differences of a scalar function of one array."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from gradcheck.errors import GradcheckError, float64_array, public

__all__ = ["central_difference"]


@public
def central_difference(
    f: Callable[[np.ndarray], float], x: np.ndarray, *, eps: float = 1e-6
) -> np.ndarray:
    """Central-difference gradient of a scalar function, element by element.

    Parameters
    ----------
    f : callable
        ``f(x) -> float``; must not keep a reference to ``x`` (it is perturbed in place).
    x : (...) float64 ndarray
        Finite; anything else is a :class:`GradcheckError` (never cast).
    eps : float
        Absolute step, positive, and small enough that ``x +- eps`` is finite.

    Returns
    -------
    (...) float64 ndarray
        ``(f(x + eps e_i) - f(x - eps e_i)) / (2 eps)`` for every element i.

    Raises
    ------
    GradcheckError
        A non-float64 or non-finite ``x``, a step that is not positive or leaves float64's
        range, or a non-finite ``f`` at a perturbed point (named by its index).

    Examples
    --------
    >>> g = central_difference(lambda a: float((a ** 2).sum()), np.array([1.0, -2.0]))
    >>> np.round(g, 6).tolist()
    [2.0, -4.0]
    """
    x = np.array(float64_array("x", x), copy=True)
    if not eps > 0.0 or (x.size and not np.isfinite(np.abs(x).max() + eps)):
        raise GradcheckError(f"eps: expected a positive step with x +- eps finite, got {eps!r}")
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
        if not np.isfinite(gflat[i]):
            index = tuple(int(j) for j in np.unravel_index(i, x.shape))
            raise GradcheckError(f"f: non-finite difference at index {index} (f(x + eps e_i) = "
                                 f"{plus!r}, f(x - eps e_i) = {minus!r}); expected finite values")
    return grad
