"""How a kernel's tensor cores accumulate, as rigorous error bounds: the k-block model.

Owns :func:`block_error_factor` and :func:`dot_block_model`, the enclosure of a dot product
accumulated the way the presets state their matrix units do (``QuantSpec.mma_k`` and
``mma_bits``). Defers the interval type to :mod:`refattn.quant.bounds`.

The model (``mma_k = n > 0``): the summed index is cut into consecutive k-blocks of ``n`` terms
(one MMA instruction's k: 32 for Hopper's FP8 WGMMA, 16 for ``mma.m16n8k16``); the products are
exact; a block's products and the incoming accumulator ``C`` are added with every addend's error
below one unit in the ``b``-th significant bit (``b = mma_bits``) of the block's largest
magnitude ``M = max(|C|, max_i |x_i|)``, and the sum is stored in the accumulator's format
(precision ``p``: 24 for fp32, 11 for fp16) with one more rounding. This covers the alignment
of every addend to the largest exponent with truncation to ``b`` bits (what SageAttention2 and
DeepSeek-V3 measured on FP8 tensor cores: 13 and "around 14" bits), an exact block sum rounded
once to ``b`` bits, and products aligned among themselves then added to ``C``. So one block errs
by at most

    e = (n + 1) (2**(1 - b) + 2**(1 - p)) M

(each of the ``n + 1`` truncated addends by less than ``2**(1 - b) M``; the stored result, at most
``(n + 1) M`` in magnitude, by ``2**(1 - p)`` of it). ``|C|`` before a block is bounded by the
exact partial sum (float64 BLAS over the blocks so far) plus the errors already made, and
``max_i |x_i|`` by ``max_i |a_i| max_i |b_i|`` over the block (a rank-one bound). The bound is
then joined with the any-order bound of an fp32 accumulator, ``gamma_{n-1}(2**-23) sum |x_i|``
(Higham, eq. (4.4), with a truncating unit): a kernel that accumulates in plain fp32, in any
order (sequential, pairwise, random), also lies inside.

Why it is tighter than the any-order bound at ``b`` bits: that bound is
``gamma_{D-1}(2**(1-b)) sum |x_i|``, about ``D 2**(1-b)`` times the sum of magnitudes (3 % of it
at D = 128, b = 13); the block bound is ``(n + 1) 2**(1-b)`` times ``D / n`` block maxima of
``|partial sum|``, which for signed terms grows like the square root of the terms.
"""

from __future__ import annotations

import math

import numpy as np

from refattn.quant.bounds import Interval, gamma

__all__ = ["block_error_factor", "dot_block_model", "quantum", "slack"]

U64 = 2.0**-53
#: relative slack for the rounding of the float64 arithmetic that evaluates a bound: every bound
#: below is a sum of at most a few thousand nonnegative float64 terms, each rounded once per
#: operation (relative error below 2**-40 in all); multiplying by (1 + SLACK) covers it
SLACK = 2.0**-30


def slack(x: np.ndarray) -> np.ndarray:
    """A nonnegative float64 bound ``x`` rounded up generously (``x (1 + 2**-30)``)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return x * (1.0 + SLACK)


def block_error_factor(n: int, bits: int, acc_precision: int) -> float:
    """``(n + 1) (2**(1 - bits) + 2**(1 - acc_precision))``: one k-block's error over ``M``.

    Examples
    --------
    >>> block_error_factor(32, 13, 24) == 33 * (2**-12 + 2**-23)
    True
    """
    return (n + 1) * (math.ldexp(1.0, 1 - bits) + math.ldexp(1.0, 1 - acc_precision))


def _mag(iv: Interval) -> np.ndarray:
    return np.maximum(np.abs(iv.lo), np.abs(iv.hi))


def quantum(m: np.ndarray, bits: int) -> np.ndarray:
    """``2**(floor(log2 m) - bits + 1)``: one unit in the ``bits``-th significant bit of a
    number of magnitude at most ``m`` (whose exponent is at most ``floor(log2 m)``); 0 for 0.

    Examples
    --------
    >>> quantum(np.array([1.0, 1.5, 2.0, 0.0]), 3).tolist()
    [0.25, 0.25, 0.5, 0.0]
    """
    _, e = np.frexp(m)  # m = mant 2**e, mant in [1/2, 1): floor(log2 m) = e - 1
    with np.errstate(over="ignore"):
        q = np.ldexp(1.0, (e - bits).astype(np.int64))
    return np.where(m > 0, np.where(np.isfinite(m), q, np.inf), 0.0)


def _signs(x: Interval) -> tuple[np.ndarray, np.ndarray]:
    """(pos, neg) float 0/1 indicators: may the value be > 0, may it be < 0."""
    return (x.hi > 0).astype(np.float64), (x.lo < 0).astype(np.float64)


def dot_block_model(a: Interval, b: Interval, *, k_block: int, bits: int,
                    acc_precision: int = 24, tiny: float = 0.0) -> Interval:
    """Enclosure of ``sum_d a[r, d] b[c, d]`` as the k-block model accumulates it.

    Per block, with ``q`` the unit of the ``bits``-th significant bit of ``M`` (a power of two,
    :func:`quantum`): truncation toward zero moves each addend toward zero by less than ``q``,
    so the ``n+`` positive addends (the incoming accumulator included) lose less than ``n+ q``
    and the ``n-`` negative ones gain less than ``n- q``: the block's error lies in
    ``(-n+ q, n- q)``, where ``n+`` and ``n-`` are counted exactly by two products of 0/1 sign
    matrices. Joined with rounding to nearest (``(n + 1) q / 2`` either way), with one rounding
    of the exact block sum to ``bits`` bits (a unit of the new accumulator's ``bits``-th bit),
    and plus the store to the accumulator's format (its ``acc_precision``-th bit).

    Parameters
    ----------
    a : Interval of (R, D)
        One operand's rows (the kernel reads some value inside each interval).
    b : Interval of (C, D)
    k_block : int
        Terms per block (``mma_k``); 0 for no block structure: the any-order bound with unit
        ``2**(1 - bits)`` per addition (a ``bits``-bit accumulator that truncates every sum).
    bits : int
        The block sum's significant bits (``mma_bits``).
    acc_precision : int
        The accumulator's precision between blocks (24: fp32).
    tiny : float
        An absolute error per term for underflow (flush to zero of a partial sum).

    Returns
    -------
    Interval of (R, C)
        Every value the model's accumulator can hold after the last block, for every value of
        the operands inside their intervals.

    Examples
    --------
    >>> from refattn.quant.bounds import point
    >>> a = point(np.array([[1.0, 2.0, 3.0, 4.0]])); b = point(np.array([[1.0, 1.0, -1.0, 1.0]]))
    >>> r = dot_block_model(a, b, k_block=2, bits=13)
    >>> bool(r.lo[0, 0] <= 4.0 <= r.hi[0, 0]), bool(r.hi[0, 0] - r.lo[0, 0] < 0.01)
    (True, True)
    """
    am, ar = a.mid, a.rad
    bm, br = b.mid, b.rad
    amag, bmag = _mag(a), _mag(b)
    D = am.shape[1]
    exact_operands = not (ar.any() or br.any())
    sabs = amag @ bmag.T  # (R, C): sum of |a b| over every value in the intervals
    f64 = gamma(D + 2, U64) * sabs  # every float64 product and addition below
    with np.errstate(over="ignore", invalid="ignore"):
        if k_block <= 0:
            total = am @ bm.T
            spread = 0.0 if exact_operands else np.abs(am) @ br.T + ar @ bmag.T
            rad = spread + gamma(max(D - 1, 0), math.ldexp(1.0, 1 - bits)) * sabs
            e_lo, e_hi = -rad, rad
        else:
            a_pos, a_neg = _signs(a)
            b_pos, b_neg = _signs(b)
            total = np.zeros((am.shape[0], bm.shape[0]))
            spread = np.zeros_like(total)  # the operands' uncertainty, in exact arithmetic
            e_lo, e_hi = np.zeros_like(total), np.zeros_like(total)  # the accumulator's errors
            for start in range(0, D, k_block):
                sl = slice(start, min(start + k_block, D))
                n = sl.stop - sl.start
                unc = spread + f64
                c_lo, c_hi = total + e_lo - unc, total + e_hi + unc  # C before the block
                c_mag = np.maximum(np.abs(c_lo), np.abs(c_hi))
                top = np.minimum(  # max |a b| in the block: rank one, or the block's sum
                    amag[:, sl].max(axis=1)[:, None] * bmag[:, sl].max(axis=1)[None, :],
                    amag[:, sl] @ bmag[:, sl].T)
                q = quantum(np.maximum(c_mag, top), bits)
                n_pos = a_pos[:, sl] @ b_pos[:, sl].T + a_neg[:, sl] @ b_neg[:, sl].T
                n_neg = a_pos[:, sl] @ b_neg[:, sl].T + a_neg[:, sl] @ b_pos[:, sl].T
                half = 0.5 * (np.minimum(n_pos + n_neg, n) + 1)  # rounding to nearest
                lose = q * np.maximum(n_pos + (c_hi > 0), half)  # truncation of positives
                gain = q * np.maximum(n_neg + (c_lo < 0), half)
                x = am[:, sl] @ bm[:, sl].T
                if not exact_operands:
                    spread = spread + np.abs(am[:, sl]) @ br[:, sl].T + ar[:, sl] @ bmag[:, sl].T
                new_mag = c_mag + np.abs(x) + spread + f64  # |C| after the block
                once = quantum(new_mag, bits)  # the exact block sum rounded once
                store = quantum(new_mag, acc_precision)  # stored in the accumulator
                e_lo = e_lo - np.maximum(lose, once) - store
                e_hi = e_hi + np.maximum(gain, once) + store
                total = total + x
            any_order = gamma(max(D - 1, 0), 2.0**-23) * sabs  # plain fp32, any order
            e_lo, e_hi = np.minimum(e_lo, -any_order), np.maximum(e_hi, any_order)
        pad = slack(spread + f64 + D * tiny)
        lo = np.nextafter(total + slack(e_lo) - pad, -np.inf)
        hi = np.nextafter(total + slack(e_hi) + pad, np.inf)
    lo = np.where(np.isnan(lo), -np.inf, lo)
    hi = np.where(np.isnan(hi), np.inf, hi)
    return Interval(lo, hi)
