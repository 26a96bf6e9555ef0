"""From-scratch float32 simulations of issue 28's quantised attention pipelines (tests only).

Each function follows one kernel's documented arithmetic step by step in numpy float32, in one
fixed order (dot products and row sums ascending over the summed index, K blocks in the order
the kernel visits them), from the facts in issue 28 as corrected in ``docs/quant-sources.md``.
Nothing here imports ``refattn.quant``: the casts are written again below (bit level, from the
formats' definitions) and checked against ml_dtypes and numpy in ``test_sims.py``. The emulated
pipeline (``refattn.quant.pipeline``) must contain every output of these simulations
(``test_contains*.py``); the planted-bug variants (``bug=``) must fall outside it.

Shape letters as in :mod:`refattn`: B, Hq, Hkv, Q (queries), K (keys), Dk, Dv. Inputs are
float64 arrays holding the values the kernel receives (codes decoded for FP8 inputs the kernel
reads as codes; unquantised values for tensors the kernel quantises itself); every result is a
float64 array of float32 (or narrower) values.

Deliberate choices where a kernel's arithmetic is not documented (the pipeline must enclose
them, not match them): exp2/log/log2 are computed in float64 and rounded once to float32 (the
kernels' ``ex2.approx``/``__logf`` are within a few ulp of that); subnormal float32 results are
kept (IEEE), where ``--use_fast_math`` builds flush them to zero; a fused multiply-add
(``x * c - m``, ``m * c + log l``) is rounded once (nvcc contracts them by default).

FA3's two products (S = Q K^T over d, O += P V over each kv tile's keys) take an
``accumulate=`` order (``ACCUMULATORS``): float32 adds ascending (the default), pairwise or in a
random order per output element, or the Hopper FP8 WGMMA accumulator model (``wgmma13``,
``wgmma14``: k-blocks of 32, products aligned to the largest exponent and truncated to 13 or 14
significand bits, see :func:`wgmma_block`). The FP8 WGMMA's accumulation is not documented by
NVIDIA; these are orders and precisions a kernel may have, each an honest kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = [
    "ACCUMULATORS",
    "BUGS",
    "FA3_BUGS",
    "FORMATS",
    "SAGE_BUGS",
    "SimResult",
    "cast",
    "fa3_fp8",
    "flashinfer_fp8_kv",
    "flashinfer_sm90_fp8",
    "fma32",
    "int8_half_away",
    "matmul32",
    "sageattention_int8",
    "vllm_fp8_kv",
    "wgmma_block",
]

#: M_LOG2E and M_LN2 as C doubles
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
#: FlashInfer's ``math::log2e`` (a float literal) and SageAttention's literal
LOG2E_F32 = np.float32(1.44269504088896340736)
SAGE_LOG2E = 1.44269504

#: (mantissa bits, minimum normal exponent, largest finite value, what overflow becomes
#: without saturation) from each format's definition
FORMATS = {
    "e4m3fn": (3, -6, 448.0, "nan"),
    "e5m2": (2, -14, 57344.0, "inf"),
    "fp16": (10, -14, 65504.0, "inf"),
    "bf16": (7, -126, float(np.float32(3.3895313892515355e38)), "inf"),
}

#: the planted bugs: a descale left out, the descales of the wrong kv head (kv head
#: ``(hk + 1) % Hkv``), a cast to e4m3 that does not saturate (overflow -> NaN), l summed after
#: the cast where the kernel sums before (and before where it sums after), the FP8 offset of
#: FA3 left out (``Max_offset = 0``: p in [0, 1] and no division of l by 256 for the LSE);
#: FA3 only (issue 41): the log2 e factor left out of c (exp2 kept), the softmax scale applied
#: twice, the kv tile holding the last key never visited, exp in place of exp2, P cast to e5m2;
#: SageAttention only: Q pre-scaled without log2 e, the online softmax without its alpha
#: rescale, every K block dequantised with K block 0's scale
BUGS = ("no_q_descale", "no_k_descale", "no_v_descale", "wrong_kv_head", "no_saturate",
        "l_after_rounding", "l_before_rounding", "no_offset", "no_log2e", "scale_twice",
        "drop_last_tile", "natural_exp", "p_e5m2", "no_log2e_prescale", "no_alpha_rescale",
        "single_k_scale")

#: the bugs :func:`fa3_fp8` models
FA3_BUGS = ("no_q_descale", "no_k_descale", "no_v_descale", "wrong_kv_head", "no_saturate",
            "l_after_rounding", "no_offset", "no_log2e", "scale_twice", "drop_last_tile",
            "natural_exp", "p_e5m2")

#: the bugs :func:`sageattention_int8` models
SAGE_BUGS = ("l_after_rounding", "no_log2e_prescale", "no_alpha_rescale", "single_k_scale")

#: the summation orders of FA3's two products (``accumulate=``)
ACCUMULATORS = ("sequential", "pairwise", "random", "wgmma13", "wgmma14")

#: the Hopper FP8 WGMMA's k extent: products summed per block of 32 consecutive indices
WGMMA_K = 32

F32 = np.float32


def _f32(x: object) -> np.ndarray:
    return np.asarray(x, dtype=np.float64).astype(np.float32)


# -- casts ------------------------------------------------------------------------------------
def cast(x: object, fmt: str, *, saturate: bool) -> np.ndarray:
    """Round float32 values to ``fmt``'s grid (nearest, ties to even), float32 out.

    ``saturate``: a finite overflow and +-inf become +-max (``cvt.rn.satfinite``); otherwise
    overflow becomes NaN for e4m3fn (no infinity) and +-inf for the others. NaN stays NaN.
    Computed from the value's binade (``frexp``) and a power-of-two quantum: exact in float64.
    """
    mbits, emin, fmax, over = FORMATS[fmt]
    xd = _f32(x).astype(np.float64)
    a = np.abs(xd)
    finite = np.isfinite(a)
    af = np.where(finite, a, 0.0)
    _, e = np.frexp(af)  # af = f * 2**e, f in [0.5, 1): the leading bit is 2**(e - 1)
    quantum = np.ldexp(1.0, np.maximum(e - 1, emin) - mbits)
    r = np.round(af / quantum) * quantum  # np.round: half to even; both products exact
    big = (r > fmax) | np.isinf(a)
    if saturate:
        r = np.where(big, fmax, r)
    else:
        r = np.where(big, np.nan if over == "nan" else np.inf, r)
    r = np.where(np.isnan(a), np.nan, r)
    return np.copysign(r, xd).astype(np.float32)


def int8_half_away(x32: np.ndarray) -> np.ndarray:
    """SageAttention's ``x += 0.5 * where(x >= 0, 1, -1); x.to(int8)`` in float32 (the add
    rounds), then truncation toward zero; int64 out."""
    x32 = _f32(x32)
    half = np.where(x32 >= 0, F32(0.5), F32(-0.5)).astype(np.float32)
    return np.trunc((x32 + half).astype(np.float32)).astype(np.int64)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 ``a * b + c`` rounded once (an FFMA), float32 inputs and output.

    The product is exact in float64; the sum is rounded to odd in float64 (TwoSum's error term
    decides), then to nearest float32: one correct rounding (53 >= 24 + 2).
    """
    p = _f32(a).astype(np.float64) * _f32(b).astype(np.float64)
    c = _f32(c).astype(np.float64)
    p, c = np.broadcast_arrays(p, c)
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)
        exact = ~np.isfinite(s) | ~np.isfinite(err) | (err == 0)
        bits = s.view(np.uint64)
        even = (bits & np.uint64(1)) == 0
        toward = np.where(err > 0, np.inf, -np.inf)
        odd = np.where(~exact & even, np.nextafter(s, toward), s)
        return odd.astype(np.float32)


def _exp2(x32: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return np.exp2(_f32(x32).astype(np.float64)).astype(np.float32)


def _fn32(fn: Callable[[np.ndarray], np.ndarray], x32: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return fn(_f32(x32).astype(np.float64)).astype(np.float32)


def _dot32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(..., Q, D) x (..., K, D) -> (..., Q, K): float32 products and sums, d ascending."""
    return matmul32(a, b)


def _rng(rng: np.random.Generator | int | None) -> np.random.Generator:
    return rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng or 0)


def _f32_toward_zero(x: np.ndarray) -> np.ndarray:
    """float64 -> float32 truncated toward zero (a finite overflow gives +-max, inf and NaN
    stay)."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        f = x.astype(np.float32)
        over = np.abs(f.astype(np.float64)) > np.abs(x)
    return np.where(over, np.nextafter(f, np.float32(0)), f).astype(np.float32)


def wgmma_block(c: np.ndarray, products: np.ndarray, bits: int) -> np.ndarray:
    """One k-block of the Hopper FP8 WGMMA accumulator model: ``c`` (...) float32, the
    block's exact ``products`` (..., k) float64 -> the new float32 accumulator (...).

    E = floor(log2(max(|c|, max |product|))); quantum = 2**(E - (bits - 1)); every addend,
    c included, truncated toward zero to a multiple of the quantum; the truncated addends
    summed exactly; the sum stored truncated toward zero to float32. All zero: c unchanged. A
    non-finite addend: the plain float64 sum (inf and NaN propagate) rounded toward zero.
    (Products aligned to the largest exponent and truncated: SageAttention2's "FP22
    accumulator", DeepSeek-V3 technical report sec. 3.3.2, "around 14 bits".)
    """
    cd = _f32(c).astype(np.float64)
    pr = np.asarray(products, dtype=np.float64)
    cd, _ = np.broadcast_arrays(cd, pr[..., 0])
    with np.errstate(invalid="ignore", over="ignore"):
        big = np.maximum(np.abs(cd), np.abs(pr).max(axis=-1))
        finite = np.isfinite(big)
        use = finite & (big > 0)
        _, e = np.frexp(np.where(use, big, 1.0))  # big = f 2**e, f in [0.5, 1): E = e - 1
        quantum = np.ldexp(1.0, np.maximum(e - 1 - (bits - 1), -1074))
        # multiples of the quantum below 2**(bits + 6) quanta: the float64 sum is exact
        trunc = np.trunc(cd / quantum) * quantum + (
            np.trunc(pr / quantum[..., None]) * quantum[..., None]).sum(axis=-1)
        plain = cd + pr.sum(axis=-1)
    return _f32_toward_zero(np.where(use, trunc, np.where(finite, cd, plain)))


def _heads(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    lead = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = np.broadcast_to(a, (*lead, *a.shape[-2:])).reshape(-1, *a.shape[-2:])
    b = np.broadcast_to(b, (*lead, *b.shape[-2:])).reshape(-1, *b.shape[-2:])
    return a, b, lead


def matmul32(a: np.ndarray, b: np.ndarray, accumulate: str = "sequential",
             rng: np.random.Generator | int | None = None,
             init: np.ndarray | None = None) -> np.ndarray:
    """(..., M, n) x (..., N, n) -> (..., M, N): sum over n of float32 products, float32 out.

    ``accumulate`` (``ACCUMULATORS``):

    - ``"sequential"``: float32 adds, n ascending, one rounding per product and per add;
    - ``"pairwise"``: recursive pairwise float32 summation (halves ``[lo, mid)``,
      ``[mid, hi)`` with ``mid = lo + (hi - lo) // 2``), products rounded to float32;
    - ``"random"``: float32 adds in a random permutation of n drawn per output element from
      ``rng`` (a Generator or a seed; None = seed 0);
    - ``"wgmma13"`` / ``"wgmma14"``: :func:`wgmma_block` over consecutive blocks of
      ``WGMMA_K`` = 32 indices (the last one shorter), products exact, the accumulator
      carried from block to block.

    ``init`` (..., M, N) float32: the incoming accumulator. The WGMMA model adds it in its
    first block (the C operand); the other orders sum the products from zero and then add
    ``init`` with one float32 add (FA3 sims' ``acc + P V`` of a tile).
    """
    a, b = _f32(a), _f32(b)
    n = a.shape[-1]
    if n != b.shape[-1]:
        raise ValueError(f"matmul32: summed lengths {n} and {b.shape[-1]} differ")
    out_shape = (*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-2])
    with np.errstate(invalid="ignore", over="ignore"):
        if accumulate in ("wgmma13", "wgmma14"):
            bits = int(accumulate[-2:])
            c = np.zeros(out_shape, np.float32) if init is None else _f32(
                np.broadcast_to(init, out_shape))
            ah, bh, _ = _heads(a, b)
            c = c.reshape(-1, *out_shape[-2:]).copy()
            ad, bd = ah.astype(np.float64), bh.astype(np.float64)
            for h in range(ah.shape[0]):  # one head at a time: (M, N, 32) float64 products
                for lo in range(0, n, WGMMA_K):
                    prods = ad[h, :, None, lo:lo + WGMMA_K] * bd[h, None, :, lo:lo + WGMMA_K]
                    c[h] = wgmma_block(c[h], prods, bits)
            return c.reshape(out_shape)
        if accumulate == "sequential":
            acc = np.zeros(out_shape, np.float32)
            for d in range(n):
                acc = (acc + a[..., :, None, d] * b[..., None, :, d]).astype(np.float32)
        elif accumulate == "pairwise":
            def pw(lo: int, hi: int) -> np.ndarray:
                if hi - lo == 1:
                    return (a[..., :, None, lo] * b[..., None, :, lo]).astype(np.float32)
                mid = lo + (hi - lo) // 2
                return (pw(lo, mid) + pw(mid, hi)).astype(np.float32)
            acc = np.broadcast_to(pw(0, n), out_shape) if n else np.zeros(out_shape,
                                                                          np.float32)
        elif accumulate == "random":
            gen = _rng(rng)
            ah, bh, _ = _heads(a, b)
            M, N = out_shape[-2:]
            acc = np.zeros((ah.shape[0], M, N), np.float32)
            order = np.broadcast_to(np.arange(n, dtype=np.intp), (M, N, n))
            for h in range(ah.shape[0]):
                perm = gen.permuted(order, axis=-1)
                for t in range(n):
                    idx = perm[..., t]  # (M, N): the t-th index each element sums
                    ga = np.take_along_axis(ah[h], idx, axis=-1)
                    gb = np.take_along_axis(bh[h], idx.T, axis=-1).T
                    acc[h] = (acc[h] + ga * gb).astype(np.float32)
            acc = acc.reshape(out_shape)
        else:
            raise ValueError(f"accumulate {accumulate!r}: expected one of {ACCUMULATORS}")
        if init is not None:
            acc = (_f32(init) + acc).astype(np.float32)
    return np.asarray(acc, dtype=np.float32)


def _pv32(p: np.ndarray, v: np.ndarray, acc_fmt: str | None = None) -> np.ndarray:
    """(..., Q, K) x (..., K, Dv) -> (..., Q, Dv), key ascending; accumulator float32, or
    rounded to ``acc_fmt`` (fp16) after every add."""
    acc = np.zeros((*p.shape[:-1], v.shape[-1]), dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for j in range(p.shape[-1]):
            acc = (acc + p[..., :, j, None] * v[..., None, j, :]).astype(np.float32)
            if acc_fmt is not None:
                acc = cast(acc, acc_fmt, saturate=False)
    return acc


def _rowsum32(p: np.ndarray) -> np.ndarray:
    acc = np.zeros(p.shape[:-1], dtype=np.float32)
    for j in range(p.shape[-1]):
        acc = (acc + p[..., j]).astype(np.float32)
    return acc


def _visible(Q: int, K: int, causal: bool, alignment: str) -> np.ndarray:
    """(Q, K) bool: key j visible from query i; causal lower_right (FA3, FlashInfer) keeps
    j <= i + K - Q, upper_left (SageAttention's Triton kernels) j <= i."""
    i = np.arange(Q)[:, None]
    j = np.arange(K)[None, :]
    if not causal:
        return np.ones((Q, K), dtype=bool)
    return j <= i + (K - Q if alignment == "lower_right" else 0)


def _kv_heads(Hq: int, Hkv: int) -> np.ndarray:
    return np.arange(Hq) // (Hq // Hkv)


@dataclass(frozen=True)
class SimResult:
    """What a simulation computed, float64 arrays of float32 (or narrower) values.

    output : (B, Hq, Q, Dv)      in the kernel's output format
    lse : (B, Hq, Q) or None     natural log (FlashInfer's base-2 LSE is converted: x ln 2)
    scores : (B, Hq, Q, K)       raw S as accumulated (before any scale), -inf where masked
    row_max : (B, Hq, Q)         the final row max of the raw S
    probs_q : (B, Hq, Q, K)      P as cast (the values multiplied into V; with K blocks, each
                                 block's P with the running max of its time)
    row_sum : (B, Hq, Q)         l as the kernel divides by it
    """

    output: np.ndarray
    lse: np.ndarray | None
    scores: np.ndarray
    row_max: np.ndarray
    probs_q: np.ndarray
    row_sum: np.ndarray


def _result(output, lse, scores, row_max, probs_q, row_sum) -> SimResult:
    def f64(x):
        return None if x is None else np.asarray(x, dtype=np.float64)
    return SimResult(f64(output), f64(lse), f64(scores), f64(row_max), f64(probs_q),
                     f64(row_sum))


def _check_bug(bug: str | None, allowed: tuple[str, ...]) -> None:
    if bug is not None and bug not in allowed:
        raise ValueError(f"bug {bug!r} not modelled here (expected one of {allowed})")


def _descales(d: np.ndarray | None, B: int, Hkv: int) -> np.ndarray:
    return np.ones((B, Hkv), np.float32) if d is None else _f32(np.broadcast_to(d, (B, Hkv)))


# -- the FA3 family ---------------------------------------------------------------------------
def _online_fp8(S: np.ndarray, vis: np.ndarray, v: np.ndarray, c: np.ndarray, *, offset: float,
                p_mult: float | None, fmt: str, saturate: bool, l_rounded: bool,
                block_n: int | None, accumulate: str = "sequential",
                rng: np.random.Generator | None = None, natural_exp: bool = False,
                drop_last_tile: bool = False) -> tuple[np.ndarray, ...]:
    """The FA3 / FlashInfer SM90 softmax and PV on raw S (B, Hq, Q, K) with c (B, Hq, 1, 1).

    p = exp2(fma(S, c, -(fl(m c) - offset))) [x p_mult], cast to ``fmt``; l from p (or from
    the cast P with ``l_rounded``); O accumulated in float32. With ``block_n`` the keys are
    visited in blocks from the last to the first (FA3's ``n_block`` loop) with the running max
    and the rescale exp2((m_old - m_new) c); without it, one block (the final row max). Each
    block's P V is summed over its keys in the order ``accumulate`` (:func:`matmul32`, the
    running acc as the incoming accumulator). Bugs: ``natural_exp`` (exp for exp2, in p and in
    the rescale), ``drop_last_tile`` (the block holding key K - 1, the first visited, skipped).
    Returns (acc, l, m, P8) with P8 as cast (each block's with the running max of its time).
    """
    K = S.shape[-1]
    Sm = np.where(vis, S, -np.inf).astype(np.float32)
    blocks = [(0, K)] if block_n is None else [
        (s, min(s + block_n, K)) for s in range(0, K, block_n)][::-1]
    if drop_last_tile:
        blocks = blocks[1:]
    expf = (lambda x: _fn32(np.exp, x)) if natural_exp else _exp2
    shape = S.shape[:-1]
    m = np.full(shape, -np.inf, np.float32)
    lsum = np.zeros(shape, np.float32)
    acc = np.zeros((*shape, v.shape[-1]), np.float32)
    P8 = np.zeros(S.shape, np.float32)
    for n, (lo, hi) in enumerate(blocks):
        blk = Sm[..., lo:hi]
        m_new = np.maximum(m, blk.max(axis=-1)).astype(np.float32)
        if n > 0:  # rescale what the earlier blocks accumulated
            with np.errstate(invalid="ignore"):
                alpha = expf(((m - m_new).astype(np.float32) * c[..., 0]).astype(np.float32))
            alpha = np.where(m_new == -np.inf, F32(1), alpha)
            lsum = (lsum * alpha).astype(np.float32)
            acc = (acc * alpha[..., None]).astype(np.float32)
        m = m_new
        with np.errstate(invalid="ignore", over="ignore"):
            ms = (m * c[..., 0]).astype(np.float32)
            ms = np.where(m == -np.inf, F32(0), (ms - F32(offset)).astype(np.float32))
            p = expf(fma32(blk, np.broadcast_to(c, blk.shape), -ms[..., None]))
        p = np.where(np.isneginf(blk), F32(0), p)
        if not l_rounded:
            lsum = (lsum + _rowsum32(p)).astype(np.float32)
        if p_mult is not None:
            p = (p * F32(p_mult)).astype(np.float32)
        p8 = cast(p, fmt, saturate=saturate)
        if l_rounded:
            lsum = (lsum + _rowsum32(p8 / F32(1 if p_mult is None else p_mult))).astype(
                np.float32)
        acc = matmul32(p8, np.swapaxes(v[..., lo:hi, :], -1, -2), accumulate, rng, init=acc)
        P8[..., lo:hi] = p8
    return acc, lsum, m, P8


def fa3_fp8(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, scale: float,
            q_descale: np.ndarray | None = None, k_descale: np.ndarray | None = None,
            v_descale: np.ndarray | None = None, causal: bool = False,
            block_n: int | None = None, bug: str | None = None,
            accumulate: str = "sequential",
            rng: np.random.Generator | int | None = None) -> SimResult:
    """FlashAttention-3's FP8 forward (hopper/): e4m3 codes, (B, Hkv) float32 descales.

    c = fl(fl(scale log2e) fl(q_descale k_descale)); m = row max of raw S; p = exp2(fma(S, c,
    -(fl(m c) - 8))) in [0, 256]; l = sum p (fp32, before the cast); P8 = satfinite e4m3(p);
    O = bf16(fl(acc fl(fl(1/l) v_descale))); LSE = fma(m, fl(c ln2), log(l / 256)).
    Causal is the lower-right triangle. ``block_n``: the online softmax over K blocks (FA3's
    kBlockN). ``accumulate`` (``ACCUMULATORS``): the order and precision of both products,
    S over d and each tile's P V over its keys (:func:`matmul32`); ``rng`` draws the
    ``"random"`` orders (a Generator or a seed; None = seed 0).

    Bugs (``FA3_BUGS``): ``no_q/k/v_descale``, ``wrong_kv_head``, ``no_saturate``,
    ``l_after_rounding``, ``no_offset`` (see ``BUGS``); ``no_log2e``: c = fl(scale) fl(qd kd)
    (exp2 kept); ``scale_twice``: c = fl(fl(scale scale log2e) fl(qd kd)); ``drop_last_tile``:
    the kv block holding key K - 1 is never visited (an off-by-one in the block loop; with one
    block every row is empty: l = 0, O = 0, LSE = -inf); ``natural_exp``: exp for exp2, same
    arguments (p and the rescale); ``p_e5m2``: P cast to satfinite e5m2.

    Parameters
    ----------
    q : (B, Hq, Q, Dk), k : (B, Hkv, K, Dk), v : (B, Hkv, K, Dv)
        e4m3fn values (float64).
    q_descale, k_descale, v_descale : (B, Hkv) or None (1.0)
    """
    _check_bug(bug, FA3_BUGS)
    if accumulate not in ACCUMULATORS:
        raise ValueError(f"accumulate {accumulate!r}: expected one of {ACCUMULATORS}")
    gen = _rng(rng) if accumulate == "random" else None
    q, k, v = _f32(q), _f32(k), _f32(v)
    B, Hq, Q, _ = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    hk = _kv_heads(Hq, Hkv)
    hd = (hk + 1) % Hkv if bug == "wrong_kv_head" else hk  # where the descales are read
    qd = _descales(None if bug == "no_q_descale" else q_descale, B, Hkv)[:, hd]  # (B, Hq)
    kd = _descales(None if bug == "no_k_descale" else k_descale, B, Hkv)[:, hd]
    vd = _descales(None if bug == "no_v_descale" else v_descale, B, Hkv)[:, hd]
    if bug == "no_log2e":
        c0 = F32(scale)
    elif bug == "scale_twice":
        c0 = F32(float(scale) * float(scale) * LOG2E)
    else:
        c0 = F32(float(F32(scale)) * LOG2E)  # float(softmax_scale * M_LOG2E)
    with np.errstate(over="ignore"):
        c = (c0 * (qd * kd).astype(np.float32)).astype(np.float32)[..., None, None]
    S = matmul32(q, k[:, hk], accumulate, gen)  # (B, Hq, Q, K) raw, on the codes
    vis = _visible(Q, K, causal, "lower_right")
    offset = 0.0 if bug == "no_offset" else 8.0
    acc, lsum, m, P8 = _online_fp8(
        S, vis, v[:, hk], c, offset=offset, p_mult=None,
        fmt="e5m2" if bug == "p_e5m2" else "e4m3fn", saturate=bug != "no_saturate",
        l_rounded=bug == "l_after_rounding", block_n=block_n, accumulate=accumulate, rng=gen,
        natural_exp=bug == "natural_exp", drop_last_tile=bug == "drop_last_tile")
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where((lsum == 0) | np.isnan(lsum), F32(0), (F32(1) / lsum).astype(np.float32))
        o32 = (acc * (inv * vd[..., None]).astype(np.float32)[..., None]).astype(np.float32)
        lsum_lse = lsum if offset == 0 else (lsum * F32(1 / 256)).astype(np.float32)
        lse = fma32(m, (c[..., 0, 0, None] * F32(LN2)).astype(np.float32),
                    _fn32(np.log, lsum_lse))
    lse = np.where((lsum == 0) | np.isnan(lsum), -np.inf, lse)
    return _result(cast(o32, "bf16", saturate=False), lse, np.where(vis, S, -np.inf), m, P8,
                   lsum)


def flashinfer_sm90_fp8(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, scale: float,
                        q_scale: np.ndarray | None = None, k_scale: np.ndarray | None = None,
                        v_scale: np.ndarray | None = None, fmt: str = "e4m3fn",
                        out_fmt: str = "bf16", causal: bool = False,
                        block_n: int | None = None, bug: str | None = None) -> SimResult:
    """FlashInfer's SM90 FP8 prefill (``StandardFP8Attention``): no offset, P x max before
    the cast.

    c = fl(fl(fl(q_scale k_scale) sm_scale) log2e_f); p = exp2(fma(S, c, -fl(m c))) in [0, 1];
    l = sum p; P8 = satfinite fmt(fl(p x max)); O = out(fl(acc fl(fl(v_scale / max) / l)));
    LSE (base 2 in the kernel) = fma(m, c, log2 l), returned here x ln 2.

    Parameters
    ----------
    q : (B, Hq, Q, Dk), k : (B, Hkv, K, Dk), v : (B, Hkv, K, Dv)
        values of ``fmt`` (float64).
    q_scale : (B, Hq) or None; k_scale, v_scale : (B, Hkv) or None
        FlashInfer's own scales are per head with no batch axis (q per query head); pass them
        broadcast over B.
    """
    _check_bug(bug, ("no_q_descale", "no_k_descale", "no_v_descale", "wrong_kv_head",
                     "no_saturate", "l_after_rounding"))
    q, k, v = _f32(q), _f32(k), _f32(v)
    B, Hq, Q, _ = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    hk = _kv_heads(Hq, Hkv)
    hd = (hk + 1) % Hkv if bug == "wrong_kv_head" else hk
    qs = (np.ones((B, Hq), np.float32) if q_scale is None or bug == "no_q_descale"
          else _f32(np.broadcast_to(q_scale, (B, Hq))))
    ks = _descales(None if bug == "no_k_descale" else k_scale, B, Hkv)[:, hd]
    vs = _descales(None if bug == "no_v_descale" else v_scale, B, Hkv)[:, hd]
    pmax = F32(FORMATS[fmt][2])
    with np.errstate(over="ignore"):
        c = ((((qs * ks).astype(np.float32) * F32(scale)).astype(np.float32)) * LOG2E_F32
             ).astype(np.float32)[..., None, None]
    S = _dot32(q, k[:, hk])
    vis = _visible(Q, K, causal, "lower_right")
    acc, lsum, m, P8 = _online_fp8(
        S, vis, v[:, hk], c, offset=0.0, p_mult=float(pmax), fmt=fmt,
        saturate=bug != "no_saturate", l_rounded=bug == "l_after_rounding", block_n=block_n)
    pv = (vs / pmax).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(lsum > 0, (pv[..., None] / lsum).astype(np.float32), F32(0))
        o32 = (acc * inv[..., None]).astype(np.float32)
        lse2 = fma32(m, c[..., 0, 0, None], _fn32(np.log2, lsum))
    lse = np.where(lsum > 0, lse2.astype(np.float64) * LN2, -np.inf)
    return _result(cast(o32, out_fmt, saturate=False), lse, np.where(vis, S, -np.inf), m, P8,
                   lsum)


def flashinfer_fp8_kv(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, scale: float,
                      k_scale: float = 1.0, v_scale: float = 1.0, dtype: str = "fp16",
                      causal: bool = False, bug: str | None = None) -> SimResult:
    """FlashInfer's FA2 prefill with an FP8 KV cache: K, V upcast exactly to ``dtype``.

    sm_scale' = fl(scale k_scale) (host, double then float); c = fl(sm_scale' log2e_f);
    p = exp2(fma(S, c, -fl(m c))); P16 = dtype(p); l = sum P16 (the rounded P); O =
    dtype(fl(acc fl(1/l))); then the host's ``out = dtype(fl(out v_scale))``; LSE = fl(log2 l
    + fl(m c)) x ln 2. One K block (FA2's online rescale not modelled: use K <= 64).

    Parameters
    ----------
    q : (B, Hq, Q, Dk) ``dtype`` values; k : (B, Hkv, K, Dk), v : (B, Hkv, K, Dv) FP8 values.
    """
    _check_bug(bug, ("no_k_descale", "no_v_descale", "l_before_rounding"))
    q, k, v = _f32(q), _f32(k), _f32(v)
    _B, Hq, Q, _ = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    hk = _kv_heads(Hq, Hkv)
    ks = 1.0 if bug == "no_k_descale" else k_scale
    vs = F32(1.0 if bug == "no_v_descale" else v_scale)
    c = (F32(scale * ks) * LOG2E_F32).astype(np.float32)
    S = _dot32(q, k[:, hk])
    vis = _visible(Q, K, causal, "lower_right")
    Sm = np.where(vis, S, -np.inf).astype(np.float32)
    m = Sm.max(axis=-1)
    ms = (m * c).astype(np.float32)
    p = _exp2(fma32(Sm, np.broadcast_to(c, Sm.shape), -ms[..., None]))
    p = np.where(vis, p, F32(0))
    p16 = cast(p, dtype, saturate=False)
    lsum = _rowsum32(p if bug == "l_before_rounding" else p16)
    acc = _pv32(p16, v[:, hk])
    with np.errstate(divide="ignore"):
        o = cast((acc * (F32(1) / lsum).astype(np.float32)[..., None]).astype(np.float32),
                 dtype, saturate=False)
    o = cast((o * vs).astype(np.float32), dtype, saturate=False)
    lse2 = (_fn32(np.log2, lsum) + ms).astype(np.float32)
    return _result(o, lse2.astype(np.float64) * LN2, np.where(vis, S, -np.inf), m, p16, lsum)


def vllm_fp8_kv(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, scale: float, q_scale: float,
                k_scale: float, v_scale: float, fmt: str = "e4m3fn", causal: bool = False,
                block_n: int | None = None, bug: str | None = None) -> SimResult:
    """vLLM's FP8 KV cache read by FA3: the cache write and Q's quantisation, then FA3.

    K8 = satfinite fmt(fl(k / k_scale)), V8 likewise (``scaled_vec_conversion``); Q8 =
    satfinite e4m3(clamp(fl(q fl(1 / q_scale)), +-448)) (``scaled_fp8_conversion<true>``);
    then :func:`fa3_fp8` with the per-tensor scales expanded to (B, Hkv).

    Parameters
    ----------
    q : (B, Hq, Q, Dk), k : (B, Hkv, K, Dk), v : (B, Hkv, K, Dv)
        the unquantised values (float32-representable).
    """
    _check_bug(bug, ("no_q_descale", "no_k_descale", "no_v_descale", "no_saturate",
                     "l_after_rounding", "no_offset"))
    q, k, v = _f32(q), _f32(k), _f32(v)
    B, Hkv = k.shape[:2]
    sat = bug != "no_saturate"
    with np.errstate(over="ignore"):
        k8 = cast((k / F32(k_scale)).astype(np.float32), fmt, saturate=sat)
        v8 = cast((v / F32(v_scale)).astype(np.float32), fmt, saturate=sat)
        qx = (q * (F32(1) / F32(q_scale)).astype(np.float32)).astype(np.float32)
    q8 = cast(np.clip(qx, -448, 448) if sat else qx, "e4m3fn", saturate=sat)

    def full(s: float) -> np.ndarray:
        return np.full((B, Hkv), s, np.float32)
    rest = None if bug in ("no_saturate", "no_q_descale", "no_k_descale", "no_v_descale") \
        else bug
    return fa3_fp8(q8, k8, v8, scale=scale,
                   q_descale=None if bug == "no_q_descale" else full(q_scale),
                   k_descale=None if bug == "no_k_descale" else full(k_scale),
                   v_descale=None if bug == "no_v_descale" else full(v_scale),
                   causal=causal, block_n=block_n, bug=rest)


def sageattention_int8(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, scale: float,
                       dtype: str = "fp16", smooth_k: bool = True, causal: bool = False,
                       blkq: int = 128, blkk: int = 64, round_smoothing: bool = True,
                       scale_order: str = "product_first",
                       bug: str | None = None) -> SimResult:
    """SageAttention's Triton kernel (``sageattn_qk_int8_pv_fp16_triton``).

    K smoothed: km = dtype(mean_seq k) (float32 sum, ascending), k' = dtype(k - km) (the
    subtraction rounds in the input dtype; ``round_smoothing=False`` keeps k - km exact, as the
    issue states it); Q x fl(scale x 1.44269504); per block of ``blkq`` queries / ``blkk`` keys
    (B, H): s = fl(max|x| / 127), x8 = int8_half_away(fl(x / s)); S = fl(fl(int32 dot)
    fl(q_s k_s)); online softmax over key blocks in ascending order: p = exp2(fl(S - m)), l in
    float32 from the unrounded p, alpha = exp2(fl(m_old - m_new)); each block's P V with P in
    fp16 accumulated and rounded in fp16 (key ascending), added to the float32 acc; O =
    dtype(fl(acc / l)). V is fp16 (bf16 input converted). Causal: upper-left triangle.
    ``blkq`` / ``blkk``: the kernel's BLOCK_M = 128 (Q's quantisation block) and BLOCK_N = 64
    (K's quantisation block and the key tile of the online softmax).

    ``scale_order``: ``"product_first"`` (the kernel's: S = fl(fl(dot) fl(q_s k_s))) or
    ``"sequential"`` (S = fl(fl(fl(dot) q_s) k_s)), both honest. Bugs (``SAGE_BUGS``):
    ``l_after_rounding`` (l from the fp16 P); ``no_log2e_prescale``: Q x fl(scale) only, exp2
    kept; ``no_alpha_rescale``: acc and l never rescaled when the max changes (the first tile
    still starts them: l from 0); ``single_k_scale``: every K block dequantised with K block
    0's scale (the codes still per block).
    """
    _check_bug(bug, SAGE_BUGS)
    if scale_order not in ("product_first", "sequential"):
        raise ValueError(f"scale_order {scale_order!r}: expected product_first or sequential")
    q, k, v = _f32(q), _f32(k), _f32(v)
    B, Hq, Q, _ = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    hk = _kv_heads(Hq, Hkv)
    if smooth_k:
        km = cast((_rowsum32(np.swapaxes(k, -1, -2)) / F32(K)).astype(np.float32), dtype,
                  saturate=False)[..., None, :]  # (B, Hkv, 1, Dk)
        diff = (k - km).astype(np.float32)
        k = cast(diff, dtype, saturate=False) if round_smoothing else diff
    v = cast(v, "fp16", saturate=False)

    def quant(x: np.ndarray, blk: int, mult: np.float32) -> tuple[np.ndarray, np.ndarray]:
        x = (x * mult).astype(np.float32)
        L = x.shape[2]
        xq = np.zeros(x.shape, np.int64)
        sc = np.zeros((*x.shape[:2], -(-L // blk)), np.float32)
        for n, lo in enumerate(range(0, L, blk)):
            part = x[:, :, lo:lo + blk]
            s = (np.abs(part).max(axis=(-1, -2)) / F32(127)).astype(np.float32)
            with np.errstate(divide="ignore", invalid="ignore"):
                xq[:, :, lo:lo + blk] = int8_half_away(
                    (part / s[..., None, None]).astype(np.float32))
            sc[:, :, n] = s
        return xq, sc

    q8, qsc = quant(q, blkq, F32(scale) if bug == "no_log2e_prescale"
                    else F32(scale * SAGE_LOG2E))
    k8, ksc = quant(k, blkk, F32(1.0))
    if bug == "single_k_scale":
        ksc = np.broadcast_to(ksc[..., :1], ksc.shape)
    dot = np.einsum("bhqd,bhkd->bhqk", q8, k8[:, hk])  # exact in int64 (|dot| < 2**24 here)
    S = dot.astype(np.float32)
    qs_t = np.repeat(qsc, blkq, axis=-1)[..., :Q]  # (B, Hq, Q)
    ks_t = np.repeat(ksc, blkk, axis=-1)[..., :K][:, hk]  # (B, Hq, K)
    if scale_order == "sequential":
        S = (S * qs_t[..., :, None]).astype(np.float32)
        S = (S * ks_t[..., None, :]).astype(np.float32)
    else:
        S = (S * (qs_t[..., :, None] * ks_t[..., None, :]).astype(np.float32)).astype(
            np.float32)
    vis = _visible(Q, K, causal, "upper_left")
    Sm = np.where(vis, S, -np.inf).astype(np.float32)
    vv = v[:, hk]
    m = np.full((B, Hq, Q), -np.inf, np.float32)
    lsum = np.ones((B, Hq, Q), np.float32)  # the kernel starts l at 1.0; alpha = 0 clears it
    acc = np.zeros((B, Hq, Q, v.shape[-1]), np.float32)
    P16 = np.zeros(S.shape, np.float32)
    for lo in range(0, K, blkk):
        blk = Sm[..., lo:lo + blkk]
        m_new = np.maximum(m, blk.max(axis=-1)).astype(np.float32)
        with np.errstate(invalid="ignore"):
            p = _exp2((blk - m_new[..., None]).astype(np.float32))
            alpha = _exp2((m - m_new).astype(np.float32))
        p = np.where(np.isneginf(blk), F32(0), p)
        alpha = np.where(np.isnan(alpha), F32(1), alpha)
        if bug == "no_alpha_rescale":  # only the first tile's alpha = 0 (clearing l = 1)
            alpha = np.where(np.isneginf(m), alpha, F32(1))
        p16 = cast(p, "fp16", saturate=False)
        lsum = (lsum * alpha + _rowsum32(p16 if bug == "l_after_rounding" else p)).astype(
            np.float32)
        acc = (acc * alpha[..., None]).astype(np.float32)
        acc = (acc + _pv32(p16, vv[..., lo:lo + blkk, :], acc_fmt="fp16")).astype(np.float32)
        P16[..., lo:lo + blkk] = p16
        m = m_new
    o = cast((acc / lsum[..., None]).astype(np.float32), dtype, saturate=False)
    lse = (_fn32(np.log2, lsum) + m).astype(np.float64) * LN2  # before core.py's correction
    return _result(o, lse, np.where(vis, S, -np.inf), m, P16, lsum)


# -- inputs -----------------------------------------------------------------------------------
def fp8_values(rng: np.random.Generator, shape: tuple[int, ...], fmt: str = "e4m3fn", *,
               spread: float = 3.0, near_max: bool = False) -> np.ndarray:
    """Random values on ``fmt``'s grid, float64: normal x ``spread`` rounded (saturating), or
    with ``near_max`` drawn from the top binade (e4m3: 256..448) with random signs."""
    if near_max:
        top = FORMATS[fmt][2]
        x = rng.uniform(top / 1.75, top, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    else:
        x = rng.normal(size=shape) * spread
    return cast(x, fmt, saturate=True).astype(np.float64)


def grid_values(rng: np.random.Generator, shape: tuple[int, ...], fmt: str,
                spread: float = 1.0) -> np.ndarray:
    """Random values on the fp16/bf16 grid, float64 (what a model's activations hold)."""
    return cast(rng.normal(size=shape) * spread, fmt, saturate=False).astype(np.float64)


def f32_scales(rng: np.random.Generator, shape: tuple[int, ...], lo: float = 0.1,
               hi: float = 4.0) -> np.ndarray:
    """Positive float32-representable scales, float64, log-uniform in [lo, hi]."""
    return _f32(np.exp(rng.uniform(np.log(lo), np.log(hi), size=shape))).astype(np.float64)


def dominant_key_codes(rng: np.random.Generator, B: int, Hq: int, Hkv: int, Q: int, K: int,
                       D: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """e4m3 q, k, v where key 0 dominates every row and the other keys sit 10-14 binary
    orders of magnitude below it after softmax (p c in [-14, -10]), with scale 1/sqrt(D) and
    unit descales: FA3's +8 offset keeps those p normal in e4m3, without it they round to the
    e4m3 subnormals or to zero."""
    q = np.zeros((B, Hq, Q, D))
    q[..., 0] = 16.0  # S = 16 k[..., 0]
    k = np.zeros((B, Hkv, K, D))
    c = D ** -0.5 * LOG2E * 16.0
    # k[0] large, the others such that (k_j - k_0) * c in [-14, -10]
    k[:, :, 0, 0] = 8.0
    gaps = rng.uniform(10.0, 14.0, size=(B, Hkv, K - 1)) / c
    k[:, :, 1:, 0] = cast(8.0 - gaps, "e4m3fn", saturate=True)
    v = fp8_values(rng, (B, Hkv, K, D))
    v[:, :, 0] = 0.0  # the dominant key carries nothing: O is made of the small p only
    return q, k, v
