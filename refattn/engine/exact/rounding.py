"""Correct rounding to binary64: exact dyadic values and arb balls rounded to nearest-even.

Owns :func:`rn_dyadic` (the round-to-nearest-even binary64 value of ``m * 2**e``, gradual
underflow included, overflow raised), :func:`round_ball` (the binary64 value of a real number
known only as an arb ball, or None while the ball straddles a rounding boundary) and
:func:`decide`, the Ziv loop of every rounding point of the exact backend: evaluate the step's
real value as balls at some precision, round each ball, and evaluate again at twice the
precision while any element is undecided. A step computed exactly (a ball of radius 0, as every
sum of products of binary64 numbers is at a sufficient precision) is decided at once, ties
included; a transcendental value is never a tie, so raising the precision decides it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
from flint import arb, ctx

from refattn._checks import format_index
from refattn.errors import RefAttnError

__all__ = ["MAX_PRECISION", "START_PRECISION", "decide", "precision", "rn_dyadic",
           "round_ball", "to_balls"]

#: first working precision of a rounding point (bits); doubled until every element is decided
START_PRECISION = 128
#: the precision at which an undecided element is reported instead of refined further
MAX_PRECISION = 1 << 16


def rn_dyadic(m: int, e: int) -> float:
    """The binary64 value nearest to ``m * 2**e``, ties to even (subnormals included).

    Raises OverflowError when the rounded value exceeds the largest finite binary64.

    Examples
    --------
    >>> rn_dyadic(3, -1), rn_dyadic(2**53 + 1, 0) == 2.0**53, rn_dyadic(1, -1075)
    (1.5, True, 0.0)
    >>> rn_dyadic(3, -1076) == 2.0**-1074  # 0.75 ulp of the smallest subnormal rounds up
    True
    """
    if m == 0:
        return 0.0
    sign = -1.0 if m < 0 else 1.0
    m = abs(m)
    shift = max(m.bit_length() - 53, -1074 - e)  # drop bits below 53 or below 2**-1074
    if shift > 0:
        q, r = divmod(m, 1 << shift)
        half = 1 << (shift - 1)
        if r > half or (r == half and q & 1):
            q += 1
        m, e = q, e + shift
    return sign * math.ldexp(float(m), e)  # m < 2**54: exact; ldexp raises on overflow


def _dyadic(x: arb) -> tuple[int, int, int, int]:
    """(mid mantissa, mid exponent, rad mantissa, rad exponent) of a finite ball."""
    mm, me = x.mid().man_exp()
    rm, re_ = x.rad().man_exp()
    return int(mm), int(me), int(rm), int(re_)


def round_ball(x: arb) -> float | None:
    """RN(v) for every real v in the ball ``x``, or None if the ball straddles a boundary.

    Raises OverflowError when the value rounds beyond the largest finite binary64.

    Examples
    --------
    >>> with precision(80):
    ...     round_ball(arb(1) / 3) == 1 / 3, round_ball(arb(2) ** -1) == 0.5
    (True, True)
    """
    if not x.is_finite():
        return None
    mm, me, rm, re_ = _dyadic(x)
    if rm == 0:
        return rn_dyadic(mm, me)
    e = min(me, re_)
    mid, rad = mm << (me - e), rm << (re_ - e)
    lo, hi = rn_dyadic(mid - rad, e), rn_dyadic(mid + rad, e)
    return lo if lo == hi else None


@contextmanager
def precision(bits: int) -> Iterator[None]:
    """Run arb arithmetic at ``bits`` of working precision (restored afterwards)."""
    saved = ctx.prec
    ctx.prec = int(bits)
    try:
        yield
    finally:
        ctx.prec = saved


def to_balls(x: np.ndarray) -> np.ndarray:
    """Finite binary64 array -> object array of exact arb balls (radius 0), same shape.

    Examples
    --------
    >>> to_balls(np.array([0.5, -2.0]))[1].is_exact()
    True
    """
    flat = [arb(v) for v in np.asarray(x, dtype=np.float64).ravel().tolist()]
    out = np.empty(len(flat), dtype=object)
    out[:] = flat
    return out.reshape(np.shape(x))


def decide(name: str, evaluate: Callable[[], np.ndarray], *, letters: str | None = None,
           start: int = START_PRECISION) -> np.ndarray:
    """The correctly rounded binary64 array of a rounding point (Ziv's strategy with balls).

    Parameters
    ----------
    name : str
        The tensor's name (used in errors).
    evaluate : callable
        Returns an object array of arb balls enclosing the exact values, evaluated at the
        current arb precision (it is called again at twice the precision while any element
        is undecided).
    letters : str, optional
        Axis letters for error messages, e.g. ``"bhij"``.
    start : int
        First working precision in bits.

    Returns
    -------
    float64 ndarray
        Same shape as ``evaluate()``'s result.

    Raises
    ------
    RefAttnError
        When an element overflows binary64, or is still undecided at :data:`MAX_PRECISION`
        bits, naming the tensor and the element.

    Examples
    --------
    >>> decide("third", lambda: np.array([arb(1) / 3], dtype=object)).tolist() == [1 / 3]
    True
    """
    bits = start
    out: np.ndarray | None = None
    todo: list[int] = []
    while True:
        with precision(bits):
            balls = evaluate()
        flat = balls.ravel()
        if out is None:
            out = np.zeros(flat.shape, dtype=np.float64)
            todo = list(range(flat.size))
        undecided = []
        for i in todo:
            try:
                value = round_ball(flat[i])
            except OverflowError:
                idx = np.unravel_index(i, balls.shape)
                raise RefAttnError(
                    f"{name}: element {format_index(idx, letters)} overflows binary64 (its "
                    "exact value exceeds the largest finite double); scale the inputs down"
                ) from None
            if value is None:
                undecided.append(i)
            else:
                out[i] = value
        if not undecided:
            return out.reshape(balls.shape)
        if bits >= MAX_PRECISION:
            idx = np.unravel_index(undecided[0], balls.shape)
            raise RefAttnError(
                f"{name}: rounding of element {format_index(idx, letters)} is still undecided "
                f"at {bits} bits (an exact tie of a non-rational value should not occur)"
            )
        todo = undecided
        bits *= 2
