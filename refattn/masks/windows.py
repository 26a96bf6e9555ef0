"""Window bounds and the conversion between the two conventions frameworks use.

Owns :class:`Window` (keys strictly before / after the query: FlashAttention, JAX, ONNX) and
the named conversions from and to the convention that counts the query itself (xFormers,
cuDNN). Defers applying a window to :mod:`refattn.masks.relation`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from refattn._boundary import public
from refattn.errors import RefAttnError
from refattn.masks._inputs import WindowBound, frozen

__all__ = ["Window", "window_from_inclusive", "window_to_inclusive"]


class Window(NamedTuple):
    """A window in the excludes-query convention (FlashAttention, JAX, ONNX).

    ``left`` keys strictly before and ``right`` keys strictly after the query position are
    visible; the diagonal is always inside. None means unbounded on that side.
    """

    left: WindowBound
    right: WindowBound


def _shift(name: str, bound: object, delta: int, minimum: int) -> WindowBound:
    if bound is None:
        return None
    arr = np.asarray(bound)
    if arr.dtype.kind not in "iu" or arr.ndim > 1:
        raise RefAttnError(
            f"window: {name} must be an int, None or an (H,) int array, got {bound!r}"
        )
    bad = arr < minimum
    if bad.any():
        value = int(arr.min())
        raise RefAttnError(
            f"window: {name} is {value}, expected >= {minimum}"
            + (" (a window that counts the query itself holds at least the query)"
               if minimum == 1 else "")
        )
    limit = int(np.iinfo(np.int64).max) - max(delta, 0)  # coordinates are int64
    if (arr > limit).any():
        raise RefAttnError(f"window: {name} is {int(arr.max())}, expected <= {limit} (int64)")
    out = arr.astype(np.int64) + delta
    return int(out) if out.ndim == 0 else frozen(out)


@public
def window_from_inclusive(left: WindowBound, right: WindowBound) -> Window:
    """Convert a window that counts the query itself (xFormers, cuDNN) to ``(left, right)``.

    A window of ``left`` keys ending at the query *including* it is ``left - 1`` keys strictly
    before it; likewise on the right. Each side must be >= 1 (the query itself); None stays
    unbounded, and an (H,) array converts head by head.

    Parameters
    ----------
    left, right : int, (H,) int ndarray or None
        Window sizes that count the query itself.

    Returns
    -------
    Window
        ``(left - 1, right - 1)``: the excludes-query convention used by
        :func:`compile_visibility`.

    Raises
    ------
    RefAttnError
        If a side is below 1 or not an integer.

    Examples
    --------
    >>> window_from_inclusive(4, 1)   # causal sliding window of 4 tokens, query included
    Window(left=3, right=0)
    """
    return Window(_shift("left", left, -1, 1), _shift("right", right, -1, 1))


@public
def window_to_inclusive(window: Window | tuple[WindowBound, WindowBound]) -> Window:
    """Inverse of :func:`window_from_inclusive`: add the query itself back to each side.

    Examples
    --------
    >>> window_to_inclusive(Window(3, 0))
    Window(left=4, right=1)
    """
    left, right = window
    return Window(_shift("left", left, 1, 0), _shift("right", right, 1, 0))
