"""Exact deciders of the cosine and additive rounding points: boundaries found, not chased.

Owns the decision, in exact arithmetic, of the elements Ziv's loop (:func:`~refattn.engine.exact
.rounding.decide`) leaves undecided because their value may sit exactly on a rounding boundary
while its ball never shrinks to a point:

- cosine values are sums ``sum_t c_t / sqrt(r_t)`` with rationals ``c_t`` and ``r_t > 0``
  (``r_t`` a product of squared norms, or ``eps**2`` for a clamped row). Square roots of
  rationals in distinct square classes are linearly independent over the rationals
  (Besicovitch), so the sum is rational exactly when every class but the class of squares
  has coefficient 0; then it is rounded exactly (parallel rows give exactly 1, orthogonal
  ones 0), otherwise it is irrational, no boundary, and the loop decides it;
- additive values are sums ``sum_t c_t f(x_t)`` with ``f = tanh`` or ``sech**2 = 1 - tanh**2``
  and rational ``x_t``. With ``w = exp(2 / N)`` (N a common denominator; w is transcendental)
  every term is a rational function of ``w`` whose poles at the roots of ``w**n = -1`` no
  other ``n`` shares, so the sum is rational exactly when the coefficients of every ``|x|``
  cancel; it is then ``sum_{x_t = 0} c_t`` (sech**2) or 0 (tanh). Otherwise its exact part
  and its (possibly tiny: ``tanh(30000) = 1 - 2e-26058``) remainder are rounded together by
  :func:`~refattn.engine.exact.rounding.round_sum` (:func:`round_tanh_sum`).

Every input is a binary64 array read as exact rationals (:class:`fractions.Fraction`); nothing
here is approximate. The deciders take the flat indices of the undecided elements and return,
per element, the correctly rounded value or None (irrational).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from fractions import Fraction
from typing import Literal

import numpy as np
from flint import arb

from refattn.engine.exact.rounding import (
    EXACT_PRECISION,
    MAX_PRECISION,
    precision,
    rn_fraction,
    round_sum,
)

__all__ = ["AdditiveExact", "CosineExact", "rational_sqrt_sum", "rational_tanh_sum",
           "round_tanh_sum"]

Decider = Callable[[list[int]], list["float | None"]]


def _index(n: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(n, shape))


def _fractions(x: np.ndarray) -> np.ndarray:
    """A binary64 array as an object array of exact Fractions (same shape)."""
    out = np.empty(np.shape(x), dtype=object)
    out.ravel()[:] = [Fraction(v) for v in np.asarray(x, dtype=np.float64).ravel().tolist()]
    return out


def _is_square(x: Fraction) -> bool:
    """Whether the rational ``x >= 0`` is the square of a rational."""
    p, q = x.numerator, x.denominator  # in lowest terms: both must be squares
    return math.isqrt(p) ** 2 == p and math.isqrt(q) ** 2 == q


def _sqrt_square(x: Fraction) -> Fraction:
    """The rational square root of a rational square."""
    return Fraction(math.isqrt(x.numerator), math.isqrt(x.denominator))


def rational_sqrt_sum(terms: Iterable[tuple[Fraction, Fraction]]) -> Fraction | None:
    """``sum_t c_t / sqrt(r_t)`` (r_t > 0) if that real number is rational, else None.

    Examples
    --------
    >>> rational_sqrt_sum([(Fraction(3), Fraction(4)), (Fraction(1), Fraction(2))]) is None
    True
    >>> rational_sqrt_sum([(Fraction(1), Fraction(2)), (Fraction(-2), Fraction(8)),
    ...                    (Fraction(3), Fraction(9, 4))])  # 1/sqrt(2) - 2/sqrt(8) + 3/(3/2)
    Fraction(2, 1)
    """
    rational = Fraction(0)
    classes: list[list[Fraction]] = []  # [representative r0, coefficient of 1/sqrt(r0)]
    for c, r in terms:
        if c == 0:
            continue
        if _is_square(r):
            rational += c / _sqrt_square(r)
            continue
        for cls in classes:
            ratio = r / cls[0]
            if _is_square(ratio):  # c / sqrt(r) = (c / sqrt(ratio)) / sqrt(r0)
                cls[1] += c / _sqrt_square(ratio)
                break
        else:
            classes.append([r, c])
    return rational if all(cls[1] == 0 for cls in classes) else None


def rational_tanh_sum(terms: Iterable[tuple[Fraction, Fraction]],
                      f: Literal["tanh", "sech2"] = "tanh") -> Fraction | None:
    """``sum_t c_t f(x_t)`` for rational ``x_t`` if that real number is rational, else None.

    Examples
    --------
    >>> x = Fraction(1, 3)
    >>> rational_tanh_sum([(Fraction(2), x), (Fraction(2), -x)])  # tanh is odd
    Fraction(0, 1)
    >>> rational_tanh_sum([(Fraction(2), x), (Fraction(5), Fraction(0))], "sech2") is None
    True
    >>> rational_tanh_sum([(Fraction(2), x), (Fraction(-2), -x), (Fraction(5), Fraction(0))],
    ...                   "sech2")  # sech^2 is even; sech^2(0) = 1
    Fraction(5, 1)
    """
    rational = Fraction(0)
    groups: dict[Fraction, Fraction] = {}
    for c, x in terms:
        if x == 0:
            if f == "sech2":
                rational += c  # sech^2(0) = 1; tanh(0) = 0
            continue
        sign = 1 if (f == "sech2" or x > 0) else -1
        groups[abs(x)] = groups.get(abs(x), Fraction(0)) + sign * c
    return rational if all(g == 0 for g in groups.values()) else None


def _arb(x: Fraction) -> arb:
    """A dyadic rational as a ball at the working precision (exact when it fits)."""
    return arb(x.numerator) * arb(2) ** -(x.denominator.bit_length() - 1)


def round_tanh_sum(terms: Iterable[tuple[Fraction, Fraction]],
                   f: Literal["tanh", "sech2"] = "tanh") -> float | None:
    """RN(``sum_t c_t f(x_t)``) for dyadic ``c_t``, ``x_t``; None if 65,536 bits don't tell.

    A rational value (:func:`rational_tanh_sum`) is rounded exactly. Otherwise the value is
    its exact part (``sum c_t sign(x_t)`` for tanh, ``sum_{x_t = 0} c_t`` for sech^2) plus a
    remainder of tails such as ``2 / (exp(2 |x|) + 1)``, each a relative enclosure, and
    :func:`~refattn.engine.exact.rounding.round_sum` rounds the two without adding them in
    arb: an exact part on a tie with a remainder of ``e**-60000`` is decided at once.

    Examples
    --------
    >>> tie = Fraction(2 ** 53 + 1)  # v tanh(x) with x huge: just below the tie v -> down
    >>> round_tanh_sum([(tie, Fraction(30000))]) == 2.0 ** 53
    True
    >>> round_tanh_sum([(tie, Fraction(-30000))]) == -(2.0 ** 53)
    True
    """
    terms = [(c, x) for c, x in terms if c != 0]
    exact = rational_tanh_sum(terms, f)
    if exact is not None:
        return rn_fraction(exact)
    if f == "tanh":
        r = sum((c * (1 if x > 0 else -1) for c, x in terms if x != 0), Fraction(0))
    else:
        r = sum((c for c, x in terms if x == 0), Fraction(0))
    bits = EXACT_PRECISION
    while bits <= MAX_PRECISION:
        with precision(bits):
            tail = arb(0)
            for c, x in terms:
                if x == 0:
                    continue
                xb = _arb(abs(x))
                part = -2 / ((2 * xb).exp() + 1) if f == "tanh" else xb.sech() ** 2
                tail += _arb(c) * (part if (f == "sech2" or x > 0) else -part)
        value = round_sum(r, tail)
        if value is not None:
            return value
        bits *= 2
    return None


def _round(value: Fraction | None) -> float | None:
    return None if value is None else rn_fraction(value)


def _kv_heads(head_map: np.ndarray, g: int) -> list[int]:
    return [int(h) for h in np.flatnonzero(np.asarray(head_map) == g)]


class CosineExact:
    """Exact deciders of the cosine family's scores and grad_q, grad_k.

    Parameters
    ----------
    q_s : (B, Hq, Q, Dk) float64 ndarray
    k_s : (B, Hq, K, Dk) float64 ndarray
        The rounded operands (k gathered to the query heads).
    eps : float
    clamped_q, clamped_k : (B, Hq, Q, 1), (B, Hq, K, 1) bool ndarray
        Rows whose norm is below eps (decided exactly by the caller).
    """

    def __init__(self, q_s: np.ndarray, k_s: np.ndarray, eps: float, clamped_q: np.ndarray,
                 clamped_k: np.ndarray) -> None:
        self.q, self.k = _fractions(q_s), _fractions(k_s)
        e2 = Fraction(eps) ** 2
        self.clamped_q, self.clamped_k = clamped_q[..., 0], clamped_k[..., 0]
        e2_obj = np.asarray(e2, dtype=object)  # the Fraction, as numpy's where takes it
        norms = lambda x, cl: np.where(cl, e2_obj, (x * x).sum(axis=-1))  # noqa: E731
        self.n2q, self.n2k = norms(self.q, self.clamped_q), norms(self.k, self.clamped_k)

    def _dot(self, b: int, h: int, i: int, j: int) -> Fraction:
        return sum((a * c for a, c in zip(self.q[b, h, i], self.k[b, h, j], strict=True)),
                   Fraction(0))

    def scores(self, post: float, shape: tuple[int, ...]) -> Decider:
        """``post * u``, shape (B, Hq, Q, K)."""
        p = Fraction(post)

        def decide(idx: list[int]) -> list[float | None]:
            out = []
            for b, h, i, j in (_index(n, shape) for n in idx):
                term = (p * self._dot(b, h, i, j), self.n2q[b, h, i] * self.n2k[b, h, j])
                out.append(_round(rational_sqrt_sum([term])))
            return out

        return decide

    def _row_terms(self, G: np.ndarray, b: int, h: int, i: int, d: int, *, key_side: bool,
                   f: Fraction) -> list[tuple[Fraction, Fraction]]:
        """Terms of one element of d loss / d x for the row i of x (q, or k when key_side)."""
        x, y = (self.k, self.q) if key_side else (self.q, self.k)
        n2x, n2y = (self.n2k, self.n2q) if key_side else (self.n2q, self.n2k)
        clamped = (self.clamped_k if key_side else self.clamped_q)[b, h, i]
        terms = []
        for j in range(y.shape[2]):
            g = G[b, h, j, i] if key_side else G[b, h, i, j]
            if g == 0:
                continue
            dot = self._dot(b, h, j, i) if key_side else self._dot(b, h, i, j)
            # d/dx of (x . y) / (|x| |y|): (y_d - x_d (x . y) / |x|^2) / (|x| |y|); clamped x:
            # y_d / (eps |y|)
            c = y[b, h, j, d] if clamped else y[b, h, j, d] - x[b, h, i, d] * dot / n2x[b, h, i]
            terms.append((f * Fraction(g) * c, n2x[b, h, i] * n2y[b, h, j]))
        return terms

    def grad_q(self, G: np.ndarray, f_q: float, shape: tuple[int, ...]) -> Decider:
        """``f_q * sum_j G_ij du_ij/dq_s``, shape (B, Hq, Q, Dk)."""
        f = Fraction(f_q)

        def decide(idx: list[int]) -> list[float | None]:
            return [_round(rational_sqrt_sum(self._row_terms(G, b, h, i, d, key_side=False,
                                                             f=f)))
                    for b, h, i, d in (_index(n, shape) for n in idx)]

        return decide

    def grad_k(self, G: np.ndarray, f_k: float, head_map: np.ndarray,
               shape: tuple[int, ...]) -> Decider:
        """``f_k * sum_{h ~ g} sum_i G_ij du_ij/dk_s``, shape (B, Hkv, K, Dk)."""
        f = Fraction(f_k)

        def decide(idx: list[int]) -> list[float | None]:
            out = []
            for b, g, j, d in (_index(n, shape) for n in idx):
                terms = [t for h in _kv_heads(head_map, g)
                         for t in self._row_terms(G, b, h, j, d, key_side=True, f=f)]
                out.append(_round(rational_sqrt_sum(terms)))
            return out

        return decide


class AdditiveExact:
    """Exact deciders of the additive family's scores, grad_q, grad_k and parameter gradients.

    Parameters
    ----------
    q_s : (B, Hq, Q, Dq) float64 ndarray
    k_s : (B, Hq, K, Dk) float64 ndarray
    Wq, Wk, b, v : (Hq, Da, Dq), (Hq, Da, Dk), (Hq, Da), (Hq, Da) float64 ndarray
    """

    def __init__(self, q_s: np.ndarray, k_s: np.ndarray, Wq: np.ndarray, Wk: np.ndarray,
                 b: np.ndarray, v: np.ndarray) -> None:
        self.q, self.k = _fractions(q_s), _fractions(k_s)
        self.Wq, self.Wk, self.b, self.v = (_fractions(a) for a in (Wq, Wk, b, v))
        self._pre: np.ndarray | None = None

    def pre(self) -> np.ndarray:
        """Exact pre-activations ``Wq q_i + Wk k_j + b``, (B, Hq, Q, K, Da) Fractions."""
        if self._pre is None:
            qt = self.q @ np.swapaxes(self.Wq, -1, -2)[None]  # (B, Hq, Q, Da), exact sums
            kt = self.k @ np.swapaxes(self.Wk, -1, -2)[None]  # (B, Hq, K, Da)
            self._pre = qt[:, :, :, None, :] + kt[:, :, None, :, :] + self.b[None, :, None, None]
        return self._pre

    def _decider(self, shape: tuple[int, ...], f: Literal["tanh", "sech2"],
                 terms: Callable[..., Iterable[tuple[Fraction, Fraction]]]) -> Decider:
        def decide(idx: list[int]) -> list[float | None]:
            return [round_tanh_sum(terms(*_index(n, shape)), f) for n in idx]

        return decide

    def scores(self, post: float, shape: tuple[int, ...]) -> Decider:
        """``post * sum_a v_a tanh(pre_a)``, shape (B, Hq, Q, K)."""
        p = Fraction(post)
        return self._decider(shape, "tanh", lambda b, h, i, j: (
            (p * self.v[h, a], self.pre()[b, h, i, j, a]) for a in range(self.v.shape[1])))

    def _sum(self, G: np.ndarray, coef: Callable[[int, int, int, int, int], Fraction],
             where: Iterable[tuple[int, int, int, int]]) -> list[tuple[Fraction, Fraction]]:
        """Terms ``G_bhij coef(b, h, i, j, a)`` at ``pre_bhija`` for every a."""
        pre = self.pre()
        return [(Fraction(G[b, h, i, j]) * coef(b, h, i, j, a), pre[b, h, i, j, a])
                for b, h, i, j in where if G[b, h, i, j] != 0 for a in range(self.v.shape[1])]

    def grad_q(self, G: np.ndarray, f_q: float, shape: tuple[int, ...]) -> Decider:
        """``f_q sum_j sum_a G_ij v_a sech^2(pre) Wq_ad``, shape (B, Hq, Q, Dq)."""
        f, K = Fraction(f_q), G.shape[3]
        return self._decider(shape, "sech2", lambda b, h, i, d: self._sum(
            G, lambda b_, h_, i_, j_, a: f * self.v[h_, a] * self.Wq[h_, a, d],
            ((b, h, i, j) for j in range(K))))

    def grad_k(self, G: np.ndarray, f_k: float, head_map: np.ndarray,
               shape: tuple[int, ...]) -> Decider:
        """``f_k sum_{h ~ g} sum_i sum_a G_ij v_a sech^2(pre) Wk_ad``, (B, Hkv, K, Dk)."""
        f, Q = Fraction(f_k), G.shape[2]
        return self._decider(shape, "sech2", lambda b, g, j, d: self._sum(
            G, lambda b_, h_, i_, j_, a: f * self.v[h_, a] * self.Wk[h_, a, d],
            ((b, h, i, j) for h in _kv_heads(head_map, g) for i in range(Q))))

    def _all(self, G: np.ndarray, h: int) -> Iterable[tuple[int, int, int, int]]:
        B, _, Q, K = G.shape
        return ((b, h, i, j) for b in range(B) for i in range(Q) for j in range(K))

    def grad_param(self, which: Literal["Wq", "Wk", "b", "v"], G: np.ndarray, post: float,
                   shape: tuple[int, ...]) -> Decider:
        """``post * sum_{b, i, j} G du/dparam`` of one parameter, shape that parameter's."""
        p = Fraction(post)
        match which:
            case "Wq":
                return self._decider(shape, "sech2", lambda h, a0, d: [t for t in self._sum(
                    G, lambda b, h_, i, j, a: p * self.v[h, a] * self.q[b, h, i, d],
                    self._all(G, h))[a0::self.v.shape[1]]])
            case "Wk":
                return self._decider(shape, "sech2", lambda h, a0, d: [t for t in self._sum(
                    G, lambda b, h_, i, j, a: p * self.v[h, a] * self.k[b, h, j, d],
                    self._all(G, h))[a0::self.v.shape[1]]])
            case "b":
                return self._decider(shape, "sech2", lambda h, a0: self._sum(
                    G, lambda b, h_, i, j, a: p * self.v[h, a], self._all(G, h))
                    [a0::self.v.shape[1]])
            case "v":
                return self._decider(shape, "tanh", lambda h, a0: self._sum(
                    G, lambda b, h_, i, j, a: p, self._all(G, h))[a0::self.v.shape[1]])
            case _:
                raise ValueError(which)
