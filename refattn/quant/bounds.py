"""Rigorous intervals for low-precision arithmetic, evaluated in float64 and rounded outward.

Owns :class:`Interval` (per-element ``[lo, hi]``, float64) and the operations the emulated
pipeline needs: sums, products and quotients of intervals with every float64 bound rounded
outward (an error-free transformation decides when a float64 result is exact, so an exact
operation stays a point), casts through monotone roundings (``fl(x)`` for ``x`` in ``[lo, hi]``
lies in ``[fl(lo), fl(hi)]``), exp2 within a stated ulp bound (its float64 ends from
:func:`refattn.quant.elementary.exp2`, the same bits on every machine), and the classical
any-order bound on a sum or dot product accumulated in a precision with unit roundoff ``u``:

    |fl(sum x_i) - sum x_i| <= gamma_{n-1}(u) sum |x_i|,  gamma_k(u) = k u / (1 - k u)

(Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. (4.4) and lemma 3.1;
it holds for every order and every tree of additions; products that round add one factor each,
and an absolute underflow term covers gradual underflow or flush to zero). Defers the casts'
bit-exact definitions to :mod:`refattn.quant.formats`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from refattn._boundary import public
from refattn.errors import RefAttnError
from refattn.quant import elementary
from refattn.quant.formats import format_info, quantize

__all__ = [
    "Interval",
    "add",
    "cast",
    "div",
    "exp2",
    "gamma",
    "mul",
    "nonneg_weighted_dot",
    "point",
    "signed_dot",
    "unit_roundoff",
    "widen",
]

U64 = 2.0**-53
_EXP2_SLACK = 4 * U64  # >= 2 elementary.EXP2_MAX_REL_ERROR: see exp2


def unit_roundoff(fmt: str) -> float:
    """``2**-precision`` of a float format: half an ulp of 1 (fp32: 2**-24).

    Examples
    --------
    >>> unit_roundoff("fp32") == 2**-24, unit_roundoff("fp16") == 2**-11
    (True, True)
    """
    return math.ldexp(1.0, -format_info(fmt).precision)


def _up(x: np.ndarray | float) -> np.ndarray:
    return np.nextafter(x, np.inf)


def _down(x: np.ndarray | float) -> np.ndarray:
    return np.nextafter(x, -np.inf)


def gamma(k: float, u: float) -> float:
    """An upper bound, rounded up, of ``gamma_k(u) = k u / (1 - k u)`` (inf when ``k u >= 1``).

    Examples
    --------
    >>> gamma(3, 2**-24) > 3 * 2**-24
    True
    >>> gamma(2**24, 2**-24)
    inf
    """
    ku = float(_up(float(k) * u))
    if ku >= 0.5:
        return float("inf") if ku >= 1.0 else float(_up(_up(ku) / _down(1.0 - ku)))
    return float(_up(_up(ku) / _down(1.0 - ku)))


@public
@dataclass(frozen=True, eq=False)
class Interval:
    """Element-wise enclosure ``lo <= x <= hi`` (float64 arrays of one shape).

    NaN in both ends means the value is NaN; an infinite end is an unbounded side, and
    ``[-inf, inf]`` means nothing is known (NaN included).

    Examples
    --------
    >>> iv = Interval(np.array([1.0, -2.0]), np.array([3.0, -2.0]))
    >>> iv.mid.tolist(), iv.rad.round(12).tolist(), iv.contains(np.array([2.5, -2.0])).tolist()
    ([2.0, -2.0], [1.0, 0.0], [True, True])
    """

    lo: np.ndarray
    hi: np.ndarray

    def __post_init__(self) -> None:
        lo = np.asarray(self.lo, dtype=np.float64)
        hi = np.asarray(self.hi, dtype=np.float64)
        try:
            lo, hi = np.broadcast_arrays(lo, hi)
        except ValueError:
            raise RefAttnError(f"Interval: lo of shape {list(lo.shape)} and hi of shape "
                               f"{list(hi.shape)} do not broadcast together") from None
        with np.errstate(invalid="ignore"):
            if np.any(lo > hi):
                raise RefAttnError("Interval: lo > hi (an enclosure bug)")
        object.__setattr__(self, "lo", np.array(lo))
        object.__setattr__(self, "hi", np.array(hi))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.lo.shape

    @property
    def mid(self) -> np.ndarray:
        """Midpoint ``lo/2 + hi/2`` (float64; NaN where an end is infinite and they differ)."""
        with np.errstate(invalid="ignore", over="ignore"):
            m = 0.5 * self.lo + 0.5 * self.hi
        return np.where(self.lo == self.hi, self.lo, m)

    @property
    def rad(self) -> np.ndarray:
        """Radius rounded up: ``[mid - rad, mid + rad]`` holds ``[lo, hi]`` in exact arithmetic."""
        m = self.mid
        with np.errstate(invalid="ignore", over="ignore"):
            r = _up(np.maximum(self.hi - m, m - self.lo))
        r = np.where(self.lo == self.hi, 0.0, r)
        return np.where(np.isnan(m) & ~np.isnan(self.lo), np.inf, r)

    def contains(self, x: np.ndarray) -> np.ndarray:
        """Element-wise ``lo <= x <= hi``; NaN is contained where the value is NaN and where
        the interval is the whole line ``[-inf, inf]`` (nothing is known there).

        Examples
        --------
        >>> Interval(np.array([-np.inf, 0.0]), np.array([np.inf, 1.0])).contains(np.nan).tolist()
        [True, False]
        """
        x = np.asarray(x, dtype=np.float64)
        with np.errstate(invalid="ignore"):
            inside = (self.lo <= x) & (x <= self.hi)
        unknown = (self.lo == -np.inf) & (self.hi == np.inf)
        return inside | (np.isnan(x) & ((np.isnan(self.lo) & np.isnan(self.hi)) | unknown))

    def __getitem__(self, idx: Any) -> Interval:
        return Interval(self.lo[idx], self.hi[idx])


def point(x: np.ndarray | float) -> Interval:
    """The degenerate interval ``[x, x]``.

    Examples
    --------
    >>> point(2.0).rad.tolist()
    0.0
    """
    x = np.asarray(x, dtype=np.float64)
    return Interval(x, x)


def _two_sum(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    s = a + b
    bb = s - a
    err = (a - (s - bb)) + (b - bb)
    return s, err


def _two_prod(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``a * b = p + e`` exactly (:func:`refattn.quant.elementary.two_prod`), quietly: valid
    away from overflow and deep underflow, where the caller does not rely on ``e``."""
    with np.errstate(invalid="ignore", over="ignore"):
        return elementary.two_prod(a, b)


def _directed(s: np.ndarray, err: np.ndarray, small: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bounds of ``s + err`` (the exact value) where ``err`` is the error of ``s`` (trusted only
    where ``small`` is False; there one ulp outward)."""
    with np.errstate(invalid="ignore"):
        exact_ok = np.isfinite(s) & np.isfinite(err) & ~small
        lo = np.where(exact_ok & (err >= 0), s, _down(s))
        hi = np.where(exact_ok & (err <= 0), s, _up(s))
    inf = np.isinf(s)  # an overflowed bound: keep the infinite side, the other one below max
    lo = np.where(inf & (s > 0), np.finfo(np.float64).max, lo)
    hi = np.where(inf & (s < 0), -np.finfo(np.float64).max, hi)
    return np.where(np.isnan(s), np.nan, lo), np.where(np.isnan(s), np.nan, hi)


def _sum_bounds(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(invalid="ignore", over="ignore"):
        s, err = _two_sum(a, b)
    lo, hi = _directed(s, err, np.zeros(s.shape, dtype=bool))
    both_inf = np.isinf(a) | np.isinf(b)  # inf + finite = inf exactly
    return np.where(both_inf, s, lo), np.where(both_inf, s, hi)


def _prod_bounds(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        p, e = _two_prod(a, b)
        small = np.abs(p) < 2.0**-960  # Dekker's split loses exactness near underflow
        big = (np.abs(a) > 2.0**995) | (np.abs(b) > 2.0**995)
    lo, hi = _directed(p, e, small | big)
    inf_in = np.isinf(a) | np.isinf(b)
    zero = (a == 0) | (b == 0)
    lo = np.where(zero & ~inf_in, 0.0, np.where(inf_in, p, lo))
    hi = np.where(zero & ~inf_in, 0.0, np.where(inf_in, p, hi))
    return lo, hi


def add(a: Interval, b: Interval) -> Interval:
    """Enclosure of ``x + y`` (exact real sum).

    Examples
    --------
    >>> r = add(point(1.0), point(2.0**-60))
    >>> bool(r.lo[()] == 1.0 and r.hi[()] > 1.0)
    True
    """
    lo, _ = _sum_bounds(a.lo, b.lo)
    _, hi = _sum_bounds(a.hi, b.hi)
    return Interval(lo, hi)


def neg(a: Interval) -> Interval:
    """Enclosure of ``-x``."""
    return Interval(-a.hi, -a.lo)


def mul(a: Interval, b: Interval) -> Interval:
    """Enclosure of ``x * y`` (exact real product; the four corners).

    Examples
    --------
    >>> r = mul(Interval(np.array(-1.0), np.array(2.0)), point(3.0))
    >>> r.lo.tolist(), r.hi.tolist()
    (-3.0, 6.0)
    """
    los, his = [], []
    a_ends = (a.lo,) if np.array_equal(a.lo, a.hi) else (a.lo, a.hi)  # a point: one corner
    b_ends = (b.lo,) if np.array_equal(b.lo, b.hi) else (b.lo, b.hi)
    for x in a_ends:
        for y in b_ends:
            lo, hi = _prod_bounds(x, y)
            los.append(lo)
            his.append(hi)
    with np.errstate(invalid="ignore"):
        return Interval(np.minimum.reduce(np.broadcast_arrays(*los)),
                        np.maximum.reduce(np.broadcast_arrays(*his)))


def div(a: Interval, b: Interval) -> Interval:
    """Enclosure of ``x / y`` where ``y > 0``; ``[-inf, inf]`` where ``y``'s interval reaches
    0 (a kernel may then give anything: 0 by a guard, inf, NaN).

    Examples
    --------
    >>> r = div(point(1.0), point(3.0))
    >>> bool(r.lo[()] < 1 / 3 < r.hi[()])
    True
    >>> div(point(1.0), Interval(np.array(0.0), np.array(1.0))).hi.tolist()
    inf
    """
    los, his = [], []
    for x in (a.lo, a.hi):
        for y in (b.lo, b.hi):
            with np.errstate(invalid="ignore", over="ignore", under="ignore", divide="ignore"):
                q = x / y
            los.append(_down(q))
            his.append(_up(q))
    with np.errstate(invalid="ignore"):
        lo = np.minimum.reduce(np.broadcast_arrays(*los))
        hi = np.maximum.reduce(np.broadcast_arrays(*his))
        unknown = ~(b.lo > 0)
    lo, hi, unknown = np.broadcast_arrays(lo, hi, unknown)
    return Interval(np.where(unknown, -np.inf, lo), np.where(unknown, np.inf, hi))


def widen(a: Interval, rel: float | np.ndarray, absolute: float | np.ndarray = 0.0) -> Interval:
    """``[lo - rel |lo| - abs, hi + rel |hi| - ...]``: a value within ``rel`` relative and
    ``absolute`` absolute error of a value in ``a`` (bounds rounded outward).

    Examples
    --------
    >>> r = widen(point(1.0), 0.5)
    >>> r.lo.round(12).tolist(), r.hi.round(12).tolist()
    (0.5, 1.5)
    """
    rel = np.asarray(rel, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        lo_mag = _up(_up(np.abs(a.lo) * rel) + absolute)
        hi_mag = _up(_up(np.abs(a.hi) * rel) + absolute)
        lo = np.where(np.isinf(a.lo), a.lo, _down(a.lo - lo_mag))
        hi = np.where(np.isinf(a.hi), a.hi, _up(a.hi + hi_mag))
    zero_lo = (rel == 0) & (np.asarray(absolute) == 0)
    return Interval(np.where(zero_lo, a.lo, lo), np.where(zero_lo, a.hi, hi))


def cast(a: Interval, fmt: str, rounding: str = "nearest_even") -> Interval:
    """Enclosure of ``fl_fmt(x)`` through a monotone rounding: ``[fl(lo), fl(hi)]``.

    Also the tightest bound of a value known to lie on ``fmt``'s grid. Where an end rounds to
    NaN (a cast to NaN on overflow) the side becomes infinite (the value may be NaN).

    Examples
    --------
    >>> r = cast(Interval(np.array(0.30), np.array(0.34)), "e4m3fn", "nearest_even_satfinite")
    >>> r.lo.tolist(), r.hi.tolist()
    (0.3125, 0.34375)
    """
    with np.errstate(invalid="ignore", over="ignore"):
        lo = quantize(a.lo, fmt, rounding)
        hi = quantize(a.hi, fmt, rounding)
    both_nan = np.isnan(lo) & np.isnan(hi) & ~(np.isnan(a.lo) & np.isnan(a.hi))
    lo = np.where(np.isnan(lo) & ~both_nan, -np.inf, lo)
    hi = np.where(np.isnan(hi) & ~both_nan, np.inf, hi)
    lo = np.where(both_nan, np.nan, lo)
    hi = np.where(both_nan, np.nan, hi)
    nan_in = np.isnan(a.lo) | np.isnan(a.hi)
    return Interval(np.where(nan_in, a.lo, lo), np.where(nan_in, a.hi, hi))


def exp2(a: Interval, ulp: float, *, ftz: bool = True) -> Interval:
    """Enclosure of an fp32 ``exp2`` with relative error at most ``ulp * 2**-23``
    (``ex2.approx.f32``), flushing results below 2**-126 to zero when ``ftz``.

    The ends are :func:`refattn.quant.elementary.exp2` of the argument's ends (not numpy's
    ``np.exp2``, whose last bits depend on the CPU), within ``EXP2_MAX_REL_ERROR = 2 u`` relative
    and ``2**-1075`` absolute of ``2**x``: the ``4 u`` relative slack added to the kernel's
    error covers the first (``(1 + 2u)(1 - r - 4u) <= 1 - r`` and
    ``(1 - 2u)(1 + r + 4u) >= 1 + r`` for ``r <= 1/2``), the outward step of at least
    ``2**-1074`` the second.

    Examples
    --------
    >>> r = exp2(point(8.0), 2.0)
    >>> bool(r.lo[()] < 256.0 < r.hi[()]), bool(exp2(point(-200.0), 2.0).lo[()] == 0.0)
    (True, True)
    """
    rel = float(_up(ulp * 2.0**-23 + _EXP2_SLACK))  # the kernel's error and float64 exp2's own
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        lo = _down(elementary.exp2(a.lo) * (1.0 - rel))
        hi = _up(elementary.exp2(a.hi) * (1.0 + rel))
    lo = np.maximum(lo, 0.0)
    if ftz:
        lo = np.where(lo < 2.0**-126, 0.0, lo)
    return cast(Interval(lo, hi), "fp32")


def signed_dot(a: Interval, b: Interval, subscripts: str, *, n: int, u_acc: float,
               tiny: float = 0.0) -> Interval:
    """Enclosure of a dot product of interval operands accumulated with unit ``u_acc`` in any
    order: ``einsum(subscripts, a, b)`` over ``n`` terms, each product exact (or its rounding
    folded into ``u_acc``), plus ``n * tiny`` for underflow.

    Midpoint-radius form: ``x y`` lies within ``|am| br + ar |bm| + ar br`` of ``am bm``; the
    float64 einsums' own errors are bounded by ``gamma_{n+2}(2**-53)`` of the magnitudes.

    Examples
    --------
    >>> a = point(np.array([[1.0, 2.0]])); b = point(np.array([[3.0, 4.0]]))
    >>> r = signed_dot(a, b, "ij,kj->ik", n=2, u_acc=0.0)
    >>> bool(r.lo[0, 0] <= 11.0 <= r.hi[0, 0]), bool(r.hi[0, 0] - r.lo[0, 0] < 1e-13)
    (True, True)
    """
    am, ar = a.mid, a.rad
    bm, br = b.mid, b.rad
    c = np.einsum(subscripts, am, bm)
    mag = np.einsum(subscripts, np.maximum(np.abs(a.lo), np.abs(a.hi)),
                    np.maximum(np.abs(b.lo), np.abs(b.hi)))
    spread = (np.einsum(subscripts, np.abs(am), br) + np.einsum(subscripts, ar, np.abs(bm))
              + np.einsum(subscripts, ar, br))
    g64 = gamma(n + 3, U64)
    g = gamma(max(n - 1, 0), u_acc) if u_acc > 0 else 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        rad = _up(_up(spread * (1.0 + g64)) + _up(mag * _up(g + 2 * g64)) + _up(n * tiny)
                  + n * 2.0**-1074)
        lo = _down(c - rad)
        hi = _up(c + rad)
    return Interval(lo, hi)


def nonneg_weighted_dot(w: Interval, v: Interval, subscripts: str) -> tuple[Interval, np.ndarray]:
    """Enclosure of ``einsum(subscripts, w, v)`` for ``w >= 0`` (exact real), and the bound
    ``einsum(subscripts, w.hi, max|v|)`` of the sum of magnitudes (rounded up).

    Examples
    --------
    >>> w = Interval(np.array([[1.0, 2.0]]), np.array([[1.5, 2.0]]))
    >>> r, mag = nonneg_weighted_dot(w, point(np.array([[1.0], [-1.0]])), "ij,jk->ik")
    >>> r.lo.round(12).tolist(), r.hi.round(12).tolist(), mag.round(12).tolist()
    ([[-1.0]], [[-0.5]], [[3.5]])
    """
    if np.any(w.lo < 0):
        raise RefAttnError("nonneg_weighted_dot: a negative weight (an enclosure bug)")
    n = 1
    for letter in set(subscripts.split("->")[0].split(",")[0]) - set(subscripts.split("->")[1]):
        n *= w.lo.shape[subscripts.split(",")[0].index(letter)]
    g = float(_up(gamma(n + 1, U64)))

    def down_sum(x: np.ndarray, y: np.ndarray) -> np.ndarray:  # sum of same-sign terms
        s = np.einsum(subscripts, x, y)
        return np.where(s >= 0, _down(s * (1 - g)), _down(s * (1 + g)))

    def up_sum(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        s = np.einsum(subscripts, x, y)
        return np.where(s >= 0, _up(s * (1 + g)), _up(s * (1 - g)))

    with np.errstate(invalid="ignore", over="ignore"):
        lo = _down(down_sum(w.lo, np.maximum(v.lo, 0)) + down_sum(w.hi, np.minimum(v.lo, 0)))
        hi = _up(up_sum(w.hi, np.maximum(v.hi, 0)) + up_sum(w.lo, np.minimum(v.hi, 0)))
        mag = up_sum(w.hi, np.maximum(np.abs(v.lo), np.abs(v.hi)))
    return Interval(lo, hi), mag
