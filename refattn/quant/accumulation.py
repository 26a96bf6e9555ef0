"""How a kernel's tensor cores accumulate, as rigorous enclosures: the k-block model.

Owns :func:`dot_block_model`, the enclosure of a dot product accumulated the way a preset states
its matrix unit does (``QuantSpec.mma_k`` and ``mma_bits``), :func:`fixed_matmul` (products that
give the same bits on every machine), :func:`blocks` and :func:`grid_quantum`. Defers the
element-wise recurrences to :mod:`refattn.engine.numba.quant_blocks` and the interval type to
:mod:`refattn.quant.bounds`.

The model (``mma_k = n > 0``). The summed index is cut into consecutive k-blocks of ``n`` terms
(one MMA instruction's k: 32 for Hopper's FP8 WGMMA, 16 for ``mma.m16n8k16``); the products are
exact. A block's products and the incoming accumulator ``C`` are added in one of these ways, and
the interval holds the result of each:

* aligned to the block's largest exponent ``E`` (of ``max(|C|, max |x_i|)``), every addend
  truncated toward zero to a multiple of ``q = 2**(E - b + 1)`` (``b = mma_bits``), the
  truncated addends summed exactly (what SageAttention2, section 4, and the DeepSeek-V3 report,
  section 3.3.2, describe for FP8 tensor cores: a 13- or "around 14"-bit accumulation;
  truncation in the alignment is what Fasi, Higham, Mikaitis and Pranesh, PeerJ CS 2021,
  measured on V100, T4 and A100);
* the products aligned among themselves (``q`` from ``max |x_i|`` only), their sum rounded once
  to ``b`` bits and added to ``C``;
* the exact block sum ``C + sum x_i`` rounded once to ``b`` bits (in either direction);

then stored in the accumulator's format (precision 24: fp32; 11: fp16), and, besides the model,
plain fp32 accumulation in any order (``gamma_{D-1}(2**-23) sum |x_i|``, Higham eq. (4.4) with a
truncating unit: sequential, pairwise, random order).

Bounding a block's truncation. ``x - trunc_q(x)`` has the sign of ``x`` and magnitude below
``q``: with ``n+`` positive and ``n-`` negative products the loss lies in ``(-n+ q, n- q)``,
where the counts come from BLAS products of 0/1 sign matrices (``"counted"``). For point
operands the loss of every product is also computed exactly for each candidate ``q`` (one or
two powers of two, as the enclosure of ``C`` decides ``E``), so only ``C``'s own truncation
(below ``q``) is unknown (``"exact"``, :func:`refattn.engine.numba.quant_blocks.dot_exact`):
signed truncations mostly cancel, and the interval is about 5x narrower. ``|C|`` before a block
is bounded by the enclosure carried from block to block (the exact partial sums plus the
errors made so far), ``max |x_i|`` by ``min(max_i |a_i| max_i |b_i|, sum_i |a_i b_i|)``; a
power of two ``2**floor(log2 m)`` is ``m`` with its fraction bits cleared (exact).

Why it is tighter than the any-order bound at ``b`` bits: that bound is
``gamma_{D-1}(2**(1-b)) sum |x_i|``, about ``D 2**(1-b)`` times the sum of magnitudes (3 % of it
at D = 128, b = 13); the block model charges each block a few units of the ``b``-th bit of the
running sum, which for signed terms grows like the square root of the terms.
"""

from __future__ import annotations

import math

import numpy as np

from refattn.engine.numba.quant_blocks import dot_blocks, dot_exact, matmul_fixed
from refattn.quant.bounds import Interval, cast, gamma
from refattn.quant.formats import format_info

__all__ = ["blocks", "dot_block_model", "fixed_matmul", "grid_quantum", "slack"]

U64 = 2.0**-53
#: relative slack for the rounding of the float64 arithmetic that evaluates a bound: every bound
#: below is a sum of at most a few thousand nonnegative float64 terms, each rounded once per
#: operation (relative error below 2**-40 in all); multiplying by (1 + SLACK) covers it
SLACK = 2.0**-30


def slack(x: np.ndarray) -> np.ndarray:
    """A nonnegative float64 bound ``x`` rounded up generously (``x (1 + 2**-30)``)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return x * (1.0 + SLACK)


def _mag(iv: Interval) -> np.ndarray:
    return np.maximum(np.abs(iv.lo), np.abs(iv.hi))


def grid_quantum(fmt: str) -> float:
    """The spacing every value of format ``fmt`` is a multiple of (its smallest subnormal; 1
    for int8).

    Examples
    --------
    >>> grid_quantum("e4m3fn") == 2**-9, grid_quantum("int8")
    (True, 1.0)
    """
    if fmt == "int8":
        return 1.0
    info = format_info(fmt)
    return math.ldexp(1.0, info.emin - info.precision + 1)


def fixed_matmul(x: np.ndarray, y: np.ndarray, qx: float, qy: float) -> np.ndarray:
    """``x @ y`` (2-d or batched 3-d float64), the same bits on every machine and thread count.

    Where ``x`` and ``y`` hold multiples of ``qx`` and ``qy`` and ``k max|x| max|y| <
    2**53 qx qy``, every product and partial sum is a multiple of ``qx qy`` below 2**53 of
    them: exact in float64 in any order, so BLAS's order does not matter (FP8 and INT8 codes,
    FP8 P times FP8 v). Otherwise a fixed-order loop
    (:func:`refattn.engine.numba.quant_blocks.matmul_fixed`) sums each element over ``k`` in
    ascending order; BLAS's blocking and SIMD width differ between CPUs.

    Examples
    --------
    >>> x = np.array([[0.5, 0.25]]); y = np.array([[2.0], [4.0]])
    >>> fixed_matmul(x, y, 0.25, 1.0).tolist(), fixed_matmul(x, y, 2.0**-60, 1.0).tolist()
    ([[2.0]], [[2.0]])
    """
    k = x.shape[-1]
    with np.errstate(over="ignore", invalid="ignore"):
        top = float(np.max(np.abs(x), initial=0.0)) * float(np.max(np.abs(y), initial=0.0))
    if math.isfinite(top) and k * top < math.ldexp(qx * qy, 53):
        return x @ y
    x3, y3 = (x, y) if x.ndim == 3 else (x[None], y[None])
    out = np.empty((x3.shape[0], x3.shape[1], y3.shape[2]))
    matmul_fixed(np.ascontiguousarray(x3), np.ascontiguousarray(y3), out)
    return out if x.ndim == 3 else out[0]


def blocks(x: np.ndarray, k_block: int) -> np.ndarray:
    """(R, D) -> (N, R, k_block): consecutive k-blocks of the last axis, the last one padded
    with zeros (a zero product changes no sum and is counted as no term).

    Examples
    --------
    >>> blocks(np.arange(5.0)[None], 2)[:, 0].tolist()
    [[0.0, 1.0], [2.0, 3.0], [4.0, 0.0]]
    """
    R, D = x.shape
    N = -(-D // k_block)
    out = np.zeros((R, N * k_block), dtype=x.dtype)
    out[:, :D] = x
    return np.ascontiguousarray(out.reshape(R, N, k_block).transpose(1, 0, 2))


def _blocked(a: Interval, b: Interval, k_block: int, bits: int, acc_precision: int,
             sabs: np.ndarray, tiny: float, to_fp32: bool,
             quanta: tuple[float, float]) -> tuple[np.ndarray, np.ndarray]:
    """The block model's enclosure (R, C), joined with plain fp32 in any order, widened by
    ``tiny`` and rounded outward (to fp32 with ``to_fp32``)."""
    am, ar, amag = blocks(a.mid, k_block), blocks(a.rad, k_block), blocks(_mag(a), k_block)
    bm, br, bmag = blocks(b.mid, k_block), blocks(b.rad, k_block), blocks(_mag(b), k_block)
    D = a.shape[1]
    n = np.minimum(k_block, D - k_block * np.arange(am.shape[0])).astype(np.float64)
    bt = lambda x: x.transpose(0, 2, 1)  # noqa: E731 - (N, C, k) -> (N, k, C)
    qa, qb = quanta
    x = fixed_matmul(am, bt(bm), qa / 2, qb / 2)  # (N, R, C): each block's exact sum
    block_abs = fixed_matmul(amag, bt(bmag), qa, qb)
    xr = gamma(k_block + 2, U64) * block_abs  # the float64 products and sums of a block
    f32 = np.float32  # the sign counts: small integers, exact in float32 (half the work)
    a_pos, a_neg = blocks((a.hi > 0).astype(f32), k_block), blocks((a.lo < 0).astype(f32), k_block)
    b_pos, b_neg = blocks((b.hi > 0).astype(f32), k_block), blocks((b.lo < 0).astype(f32), k_block)
    if ar.any() or br.any():  # interval operands: their spread, and signs possibly both
        xr = (xr + fixed_matmul(np.abs(am), bt(br), qa / 2, qb / 2)
              + fixed_matmul(ar, bt(bmag), qa / 2, qb))
        n_pos = a_pos @ bt(b_pos) + a_neg @ bt(b_neg)
        n_neg = a_pos @ bt(b_neg) + a_neg @ bt(b_pos)
        n_sum, n_diff = n_pos + n_neg, n_pos - n_neg
    else:  # a value's sign is known: n+ - n- in one product
        n_sum = (a_pos + a_neg) @ bt(b_pos + b_neg)
        n_diff = (a_pos - a_neg) @ bt(b_pos - b_neg)
    any_order = gamma(max(D - 1, 0), 2.0**-23) * sabs  # plain fp32, any order
    lo, hi = np.empty(sabs.shape), np.empty(sabs.shape)
    dot_blocks(x, xr, block_abs, np.ascontiguousarray(amag.max(axis=2)),
               np.ascontiguousarray(bmag.max(axis=2)), n_sum, n_diff, n,
               math.ldexp(1.0, 1 - bits), math.ldexp(1.0, 1 - acc_precision), any_order, tiny,
               to_fp32, lo, hi)
    return lo, hi


def dot_block_model(a: Interval, b: Interval, *, k_block: int, bits: int,
                    acc_precision: int = 24, tiny: float = 0.0, to_fp32: bool = False,
                    quanta: tuple[float, float] = (0.0, 0.0),
                    exact_truncation: bool = False) -> Interval:
    """Enclosure of ``sum_d a[r, d] b[c, d]`` as the k-block model accumulates it.

    Per block, with ``q`` the unit of the ``bits``-th significant bit of ``M`` (a power of two:
    ``M`` with its fraction bits cleared, times ``2**(1 - bits)``): truncation toward zero moves
    each addend toward zero by less than ``q``,
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
    to_fp32 : bool
        The accumulator's value is an fp32 number: the ends rounded to fp32 (a cast is
        monotone).
    quanta : (float, float)
        The grid spacing of ``a``'s and ``b``'s ends (:func:`grid_quantum`; 0: unknown), so
        that the products are summed by BLAS where that is exact (:func:`fixed_matmul`).
    exact_truncation : bool
        For point operands with k-blocks: sum every product's truncation exactly
        (:func:`refattn.engine.numba.quant_blocks.dot_exact`, O(R C D) scalar work) instead of
        counting the products of each sign (BLAS products of 0/1 matrices): far tighter, as
        the truncations of signed products mostly cancel.

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
    D = a.shape[1]
    qa, qb = quanta
    if exact_truncation and k_block > 0 and not (a.rad.any() or b.rad.any()):
        lo, hi = np.empty((a.shape[0], b.shape[0])), np.empty((a.shape[0], b.shape[0]))
        dot_exact(np.ascontiguousarray(a.lo), np.ascontiguousarray(b.lo.T), k_block, bits,
                  math.ldexp(1.0, 1 - acc_precision), gamma(max(D - 1, 0), 2.0**-23), D * tiny,
                  to_fp32, lo, hi)
        return Interval(lo, hi)
    sabs = fixed_matmul(_mag(a), _mag(b).T, qa, qb)  # (R, C): sum of |a b| over the intervals
    if k_block > 0:
        return Interval(*_blocked(a, b, k_block, bits, acc_precision, sabs, D * tiny, to_fp32,
                                  quanta))
    am, ar, bm, br = a.mid, a.rad, b.mid, b.rad
    with np.errstate(over="ignore", invalid="ignore"):
        spread = (fixed_matmul(np.abs(am), br.T, qa / 2, qb / 2)
                  + fixed_matmul(ar, _mag(b).T, qa / 2, qb)) if (ar.any() or br.any()) else 0.0
        rad = slack(spread + (gamma(max(D - 1, 0), math.ldexp(1.0, 1 - bits))
                              + gamma(D + 2, U64)) * sabs)  # the model's, and float64's own
        total = fixed_matmul(am, bm.T, qa / 2, qb / 2)
        pad = slack(D * tiny + 2.0**-50 * np.abs(total))
        lo = np.nextafter(total - rad - pad, -np.inf)
        hi = np.nextafter(total + rad + pad, np.inf)
    iv = Interval(np.where(np.isnan(lo), -np.inf, lo), np.where(np.isnan(hi), np.inf, hi))
    return cast(iv, "fp32") if to_fp32 else iv
