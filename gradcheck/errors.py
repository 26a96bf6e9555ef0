"""The checker's input errors, and the one array reader that raises them.

gradcheck's generic checker stands alone (it imports nothing from refattn), so it has its own
error type. :class:`GradcheckError` is a ``ValueError``; refattn's own wrappers (``refattn
verify``, ``refattn gradcheck``) report it with the call's context.
"""

from __future__ import annotations

import numpy as np

from gradcheck._boundary import boundary

__all__ = ["GradcheckError", "float64_array", "public"]


class GradcheckError(ValueError):
    """Invalid input to the gradient checker: names the input, the index and the expectation.

    Examples
    --------
    >>> issubclass(GradcheckError, ValueError)
    True
    """


def float64_array(name: str, x: object, *, finite: bool = True) -> np.ndarray:
    """``x`` as a float64 ndarray, never cast; with ``finite``, NaN and inf are refused too.

    Examples
    --------
    >>> float64_array("x", np.ones(2)).dtype
    dtype('float64')
    >>> float64_array("x", np.array([1.0, np.inf]))
    Traceback (most recent call last):
        ...
    gradcheck.errors.GradcheckError: x: non-finite value inf at index (1,); expected finite float64
    """
    try:
        arr = x if isinstance(x, np.ndarray) else np.asarray(x)
    except Exception as exc:  # pragma: no cover - exotic objects
        raise GradcheckError(f"{name}: cannot be read as an array ({exc})") from None
    if arr.dtype != np.float64:
        raise GradcheckError(f"{name}: expected dtype float64, got {arr.dtype} (never cast)")
    if finite:
        bad = np.argwhere(~np.isfinite(arr))
        if bad.size:
            index = tuple(int(i) for i in bad[0])
            raise GradcheckError(f"{name}: non-finite value {arr[index].item()!r} at index "
                                 f"{index}; expected finite float64")
    return arr


#: the decorator of gradcheck's public functions: each argument checked against its
#: annotation before any work (:func:`gradcheck._boundary.boundary`)
public = boundary(GradcheckError)
