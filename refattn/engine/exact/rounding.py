"""Correct rounding to binary64: exact rationals, square roots and arb balls, nearest-even.

Owns :func:`rn_dyadic` (the round-to-nearest-even binary64 value of ``m * 2**e``, gradual
underflow included, overflow raised), :func:`rn_fraction` and :func:`rn_sqrt` (the same for
an exact rational and for the square root of one, in integer arithmetic), :func:`round_ball`
(the binary64 value of a real number known only as an arb ball, or None while the ball
straddles a rounding boundary, the sign of a zero included) and :func:`decide`, the Ziv loop of
every rounding point of the exact backend: evaluate the step's real value as balls at some
precision, round each ball, and evaluate again at twice the precision while any element is
undecided.

A ball of radius 0 (every sum of products of binary64 numbers once the precision covers the
operands' exponent span) is rounded directly, ties included. A value that may sit exactly on a
rounding boundary (a representable value or a midpoint) although its ball never shrinks to a
point -- a rational quotient, an algebraic value, a sum of transcendental terms that cancel --
is handed, once it is still undecided at :data:`EXACT_PRECISION` bits, to the rounding point's
exact decider: it returns the correctly rounded value found in exact arithmetic, or proves the
value irrational (so no boundary) and lets the loop go on, which then ends.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from fractions import Fraction

import numpy as np
from flint import arb, ctx

from refattn._checks import format_index
from refattn.errors import RefAttnError

__all__ = ["EXACT_PRECISION", "MAX_PRECISION", "START_PRECISION", "Exact", "decide",
           "precision", "rn_dyadic", "rn_fraction", "rn_sqrt", "round_ball", "round_sum",
           "to_balls"]

#: first working precision of a rounding point (bits); doubled until every element is decided
START_PRECISION = 128
#: the precision from which an element still undecided goes to the point's exact decider
EXACT_PRECISION = 512
#: the precision at which an undecided element is reported instead of refined further: far
#: beyond any value that is not on a boundary (a dyadic sum of binary64 products is exact by
#: about 6,500 bits; a transcendental value that close to a boundary has never been seen)
MAX_PRECISION = 1 << 16

#: an exact decider: the flat indices of undecided elements -> for each, its correctly
#: rounded value (found exactly) or None (proved not on a rounding boundary)
Exact = Callable[[list[int]], list["float | None"]]


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


def rn_fraction(x: Fraction) -> float:
    """The binary64 value nearest to the rational ``x``, ties to even (subnormals included).

    Integer division with a sticky bit: the quotient keeps at least 54 bits and one more bit
    records whether the remainder is 0, so a tie is a tie and nothing else looks like one.
    Raises OverflowError beyond the largest finite binary64.

    Examples
    --------
    >>> rn_fraction(Fraction(1, 3)) == 1 / 3, rn_fraction(Fraction(-1, 10)) == -0.1
    (True, True)
    >>> rn_fraction(Fraction(2 ** 53 + 1)) == 2.0 ** 53  # an exact tie: to even
    True
    """
    p, q = x.numerator, x.denominator
    if p == 0:
        return 0.0
    sign = -1 if p < 0 else 1
    p = abs(p)
    s = 55 - (p.bit_length() - q.bit_length())  # p * 2**s / q >= 2**54
    quot, rem = divmod(p << s, q) if s >= 0 else divmod(p, q << -s)
    return rn_dyadic(sign * (2 * quot + (rem != 0)), -s - 1)


def rn_sqrt(x: Fraction) -> float:
    """The binary64 value nearest to ``sqrt(x)`` for a rational ``x >= 0``, ties to even.

    ``isqrt`` of the scaled rational with a sticky bit, as :func:`rn_fraction`.

    Examples
    --------
    >>> rn_sqrt(Fraction(2)) == 2 ** 0.5, rn_sqrt(Fraction(9, 16)), rn_sqrt(Fraction(0))
    (True, 0.75, 0.0)
    """
    p, q = x.numerator, x.denominator
    if p < 0:
        raise ValueError("rn_sqrt: negative argument")
    if p == 0:
        return 0.0
    s = 55 - (p.bit_length() - q.bit_length()) // 2  # sqrt(p * 4**s / q) >= 2**54
    n, d = (p << (2 * s), q) if s >= 0 else (p, q << (-2 * s))
    floor = n // d
    root = math.isqrt(floor)
    exact = root * root * d == n  # sqrt(n/d) = root exactly; else strictly above root
    return rn_dyadic(2 * root + (not exact), -s - 1)


def _dyadic(x: arb) -> tuple[int, int, int, int]:
    """(mid mantissa, mid exponent, rad mantissa, rad exponent) of a finite ball."""
    mm, me = x.mid().man_exp()
    rm, re_ = x.rad().man_exp()
    return int(mm), int(me), int(rm), int(re_)


def round_ball(x: arb) -> float | None:
    """RN(v) for every real v in the ball ``x``, or None if the ball straddles a boundary.

    A ball around 0 is undecided unless it is exactly 0 (+0.0): the sign of a value that rounds
    to a zero is the sign of the value.
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
    if mm == 0 and rm == 0:
        return 0.0  # exactly 0: +0
    if rm != 0 and not (x > 0 or x < 0):
        return None  # contains 0 and is not exactly 0: the sign of a rounded zero is unknown
    sign = -1.0 if x < 0 else 1.0
    # |v| < 2**top for every v in the ball: below 2**-1075 everything rounds to a signed
    # zero (checked first, so that no integer of 2**40 bits is ever built for exp(-1e12))
    top = max(me + abs(mm).bit_length(), re_ + rm.bit_length()) + 1
    if top <= -1075:
        return math.copysign(0.0, sign)
    if rm == 0:
        return rn_dyadic(mm, me)
    # a radius far below the mid's last bit and half an ulp of the result (tanh(1e300) has
    # one of 2**-(3e79)) is widened to 2**(that - 2): a larger ball decides nothing wrongly,
    # and no rounding boundary is that close to a mid that is not on one
    half_ulp = max(me + abs(mm).bit_length() - 54, -1075)
    floor = min(me, half_ulp) - 2
    if re_ + rm.bit_length() < floor:
        rm, re_ = 1, floor
    e = min(me, re_)  # the ball excludes 0, so rad < |mid| and both shifts stay small
    mid, rad = mm << (me - e), rm << (re_ - e)
    lo, hi = rn_dyadic(mid - rad, e), rn_dyadic(mid + rad, e)
    return lo if lo == hi else None


def _pow2_exponent(x: Fraction) -> int:
    """The exponent of the last bit of a nonzero dyadic rational."""
    p, q = abs(x.numerator), x.denominator
    return (p & -p).bit_length() - 1 - (q.bit_length() - 1)


def round_sum(r: Fraction, t: arb) -> float | None:
    """RN(r + v) for every real v in the ball ``t``, r an exact dyadic rational; or None.

    Rounds an exact part plus a small remainder (an additive sum of tanh is its exact signs
    plus tails like ``e**-60000``) without adding them in arb, whose sum would round r's
    bits and never tell on which side of a tie ``r`` the remainder puts the value. When
    ``|t|`` is below a quarter of the spacing of ``r`` and the rounding boundaries around it,
    no boundary lies between ``r + t`` and ``r + sign(t) 2**(m - 2)``: that is rounded.

    Examples
    --------
    >>> tie = 1 + Fraction(1, 2 ** 53)  # RN(tie) = 1.0 (to even); just above it rounds up
    >>> with precision(128):
    ...     round_sum(tie, arb(2) ** -100000 * (1 + arb(1) / 3)) == 1 + 2 ** -52
    True
    """
    if r == 0:
        return round_ball(t)
    if not t.is_finite():
        return None
    tm, te, rm, re_ = _dyadic(t)
    if tm == 0 and rm == 0:
        return rn_fraction(r)
    if rm != 0 and not (t > 0 or t < 0):
        return None
    if r.denominator & (r.denominator - 1):
        raise ValueError("round_sum: r must be dyadic")
    # boundaries (midpoints, representable values: multiples of half an ulp, a quarter at the
    # binade's lower edge) and r itself are all multiples of 2**m
    top_bit = abs(r.numerator).bit_length() - r.denominator.bit_length()  # floor(log2|r|)
    half_ulp = max(top_bit - 53, -1075)
    m = min(_pow2_exponent(r), half_ulp - 1)
    top = max(te + abs(tm).bit_length(), re_ + rm.bit_length()) + 1  # |t| < 2**top
    sign = 1 if t > 0 else -1
    if top <= m - 2:
        return rn_fraction(r + sign * Fraction(2) ** (m - 2))
    floor = min(te, m) - 2  # widen a radius far below every bit that matters (see round_ball)
    if re_ + rm.bit_length() < floor:
        rm, re_ = 1, floor
    mid = Fraction(tm) * Fraction(2) ** te
    rad = Fraction(rm) * Fraction(2) ** re_
    lo, hi = rn_fraction(r + mid - rad), rn_fraction(r + mid + rad)
    return lo if lo == hi and math.copysign(1.0, lo) == math.copysign(1.0, hi) else None


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
           start: int = START_PRECISION, exact: Exact | None = None) -> np.ndarray:
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
    exact : callable, optional
        The point's exact decider (see :data:`Exact`), called once with the flat indices of
        the elements still undecided at :data:`EXACT_PRECISION` bits. A point whose value is
        a dyadic rational needs none: its balls become exact.

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

    A value on a boundary whose ball never shrinks to a point is decided by ``exact``:

    >>> tie = lambda: np.array([(arb(1) / 3) * 3 + arb(2) ** -53], dtype=object)
    >>> decide("tie", tie, exact=lambda idx: [rn_fraction(1 + Fraction(1, 2 ** 53))]).tolist()
    [1.0]
    """
    bits = start
    out: np.ndarray | None = None
    todo: list[int] = []
    asked = exact is None
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
                _overflow(name, i, balls.shape, letters)
            if value is None:
                undecided.append(i)
            else:
                out[i] = value
        if undecided and not asked and bits >= EXACT_PRECISION:
            asked = True  # exact is not None here
            try:
                found = exact(undecided)  # type: ignore[misc]
            except OverflowError:
                _overflow(name, undecided[0], balls.shape, letters)
            left = []
            for i, value in zip(undecided, found, strict=True):
                if value is None:
                    left.append(i)  # proved off every boundary: the loop decides it
                else:
                    out[i] = value
            undecided = left
        if not undecided:
            return out.reshape(balls.shape)
        if bits >= MAX_PRECISION:
            idx = np.unravel_index(undecided[0], balls.shape)
            raise RefAttnError(
                f"{name}: rounding of element {format_index(idx, letters)} is still undecided "
                f"at {bits} bits; its value is not a rounding boundary (that is decided "
                "exactly), only closer to one than this precision resolves, which no "
                "binary64 input is known to produce -- please report the call"
            )
        todo = undecided
        bits *= 2


def _overflow(name: str, i: int, shape: tuple[int, ...], letters: str | None) -> None:
    idx = np.unravel_index(i, shape)
    raise RefAttnError(
        f"{name}: element {format_index(idx, letters)} overflows binary64 (its "
        "exact value exceeds the largest finite double); scale the inputs down"
    ) from None
