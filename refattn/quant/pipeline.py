"""A quantised call's two results: the real result and the kernel's pipeline as intervals.

Owns :func:`quantized` (validate with :func:`~refattn.quant.spec.check_quant`, run the
existing engines on the dequantised call, emulate the spec's pipeline) and :class:`QuantResult`.
The emulation follows the spec's stages in the kernel's order; every cast is applied bit-exactly
to both ends of an interval (the casts are monotone), every fp32/fp16 accumulation is enclosed
by the any-order bound of :mod:`refattn.quant.bounds`, exp2 within ``spec.exp2_ulp``; an
emulated value is the interval of every value the documented arithmetic can give in any
summation order. Defers the arithmetic of intervals to :mod:`refattn.quant.bounds`, the casts to
:mod:`refattn.quant.formats`, the real result to :mod:`refattn.engine`.

Stages (``c`` the exponent multiplier, ``off`` the offset, ``mult`` P's multiplier):

1. operands: codes as given, or ``cast(fl32(x / scale))`` (vLLM), or SageAttention's smoothing,
   pre-scale and per-block int8 quantisation with its computed scales;
2. ``S = Q K^T`` (fp32 tensor cores: ``mma_bits``; int8: exact int32 then
   ``fl32(fl32(S) fl32(q_scale k_scale))``), -inf where not visible;
3. per kv tile in the kernel's order: running max ``m``, ``p = exp2(fl32((S - m) c + off))``,
   ``P = cast(fl32(p mult))``, rescale factor ``alpha = exp2((m_prev - m) c)``;
4. ``l = sum_t w_t sum_j (p or P)`` and ``acc = sum_t w_t sum_j P V`` with
   ``w_t = prod_{s after t} alpha_s``, each enclosed with the rounding of every addition and
   rescale a term passes through;
5. ``O = cast_out(acc / l * v_descale / mult)`` (or the post-scale after the kernel's cast) and
   ``lse = m c ln2 + ln(l) - off ln2``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

import refattn.quant.bounds as bd
from refattn._boundary import public
from refattn._checks import INT64_MAX, bounded_int
from refattn.call import AttentionCall
from refattn.engine import forward
from refattn.engine.memory import available_bytes
from refattn.engine.trace import Trace
from refattn.errors import RefAttnError
from refattn.quant import elementary
from refattn.quant.bounds import Interval, point
from refattn.quant.formats import format_max
from refattn.quant.spec import QuantSpec, TensorQuant, check_quant

__all__ = ["QuantResult", "check_emulation_memory", "dequantized_call", "emulate",
           "emulation_bytes", "quantized"]

U32 = 2.0**-24
FP32_MIN_NORMAL = 2.0**-126
LN2 = 0.6931471805599453  # fl(ln 2), 0x3FE62E42FEFA39EF: a literal, not a libm call


@public
@dataclass(frozen=True, eq=False)
class QuantResult:
    """The two results of a quantised call.

    Attributes
    ----------
    call : AttentionCall
        The call as the kernel receives it (codes or the values it casts).
    spec : QuantSpec
        The pipeline.
    real : Trace
        Float64 attention of the dequantised call (output, lse and row_max from the streaming
        numba engine; every canonical tensor from ``"numpy"`` or ``"exact"``).
    emulated : dict of str to Interval
        ``"output"`` (B, Hq, Q, Dv); ``"lse"`` (B, Hq, Q) when the kernel returns it;
        ``"row_max"`` (B, Hq, Q) its final max; ``"row_sum"`` (B, Hq, Q) its l; with
        intermediates, ``"scores"`` (B, Hq, Q, K) the kernel's raw S and ``"probs_q"``
        (B, Hq, Q, K) P as cast. Units in docs/quant.md.
    backend : str
        The engine that computed ``real``.
    """

    call: AttentionCall
    spec: QuantSpec
    real: Trace
    emulated: dict[str, Interval]
    backend: str = "numpy"

    def manifest(self) -> dict[str, Any]:
        """The real (dequantised) call's manifest with ``quant: {"spec": ...}`` added.

        Examples
        --------
        >>> import numpy as np
        >>> from refattn import AttentionCall
        >>> from refattn.quant import preset, quantized
        >>> x = np.full((1, 1, 2, 4), 0.5)
        >>> m = quantized(AttentionCall(x, x, x), preset("fa3_fp8")).manifest()
        >>> m["schema"], m["quant"]["spec"]["name"], m["quant"]["emulated"][:2]
        ('attention_call_v1', 'fa3_fp8', ['lse', 'output'])
        """
        out = self.real.manifest()
        out["quant"] = {"spec": self.spec.to_manifest(), "emulated": sorted(self.emulated),
                        "real_inputs": "codes * scale for 'codes' tensors, 'cast' tensors "
                                       "as given"}
        return out


@public
def quantized(call: AttentionCall, spec: QuantSpec, *, backend: str = "numba",
              intermediates: bool | None = None, truncation: str = "auto",
              **options: Any) -> QuantResult:
    """The real result and the emulated pipeline of a quantised call.

    Parameters
    ----------
    call : AttentionCall
        q (B, Hq, Q, Dk), k (B, Hkv, K, Dk), v (B, Hkv, K, Dv) as the kernel receives them:
        decoded codes for ``source="codes"``, unquantised values for ``source="cast"``.
    spec : QuantSpec
        The pipeline (:func:`refattn.quant.preset`).
    backend : str
        The engine for the real result: ``"numba"`` (the default; streaming unless options
        are given: the real ``output``, ``lse`` and ``row_max`` only, memory O(L D)),
        ``"numpy"`` or ``"exact"`` (every canonical tensor), ...
    intermediates : bool or None
        Also emulate ``scores`` and ``probs_q`` (B, Hq, Q, K); None: only while the four
        arrays fit in 64 MiB (``output``, ``lse``, ``row_max`` and ``row_sum`` always).
    truncation : {"auto", "exact", "counted"}
        How S's k-block truncations are bounded (:func:`emulate`).
    **options
        Passed to the engine.

    Returns
    -------
    QuantResult

    Raises
    ------
    RefAttnError
        A spec that does not fit the call (:func:`~refattn.quant.spec.check_quant`); an
        emulation that needs more memory than is available (:func:`emulation_bytes`).

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import AttentionCall
    >>> from refattn.quant import preset, quantized
    >>> x = np.array([0.5, -1.0, 0.25, 2.0])
    >>> q, k, v = x.reshape(1, 1, 1, 4), np.ones((1, 1, 2, 4)), np.ones((1, 1, 2, 4))
    >>> res = quantized(AttentionCall(q, k, v), preset("fa3_fp8"))
    >>> out = res.emulated["output"]
    >>> bool(out.contains(res.real.output).all()), out.lo[0, 0, 0].tolist()
    (True, [1.0, 1.0, 1.0, 1.0])
    """
    check_quant(call, spec)
    _exact_truncation(call, truncation)  # refuse a bad option before any work
    keep = _keep_intermediates(call, intermediates)
    check_emulation_memory(call, spec=spec, intermediates=keep)
    if backend == "numba" and not options:  # streaming: output, lse, row_max (memory O(L D))
        options = {"materialize": False}
    real = forward(dequantized_call(call, spec), backend=backend, **options)
    em = emulate(call, spec, intermediates=keep, truncation=truncation)
    return QuantResult(call, spec, real, em, backend)


def emulation_bytes(call: AttentionCall, spec: QuantSpec | None = None, *,
                    intermediates: bool = False) -> int:
    """Peak bytes of :func:`emulate`, an upper estimate: 40 float64 arrays of a block of query
    rows by the keys (``R K <= 2**20``), the per-tile sums (2 T R Dv, T the kv tiles of
    ``spec``; without a spec one per key), 16 per operand element, 12 per output element, and
    12 per (B, Hq, Q, K) element with ``intermediates``. 1.8-2.1x the tracemalloc peak
    measured for fa3_fp8 at (1, 4, 1024, 128), (1, 2, 2048, 128) and (1, 2, 256, 64) and for
    sageattention_int8 at (1, 4, 512, 128).

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import AttentionCall
    >>> x = np.zeros((1, 1, 100, 8))
    >>> emulation_bytes(AttentionCall(x, x, x))
    4864000
    """
    B, Hq, Q, K = call.score_shape
    Hkv = call.k.shape[1]
    Dk, Dv = call.q.shape[3], call.v.shape[3]
    R = _rows_per_block(Q, K)
    T = K  # without a spec: at most one tile per key
    if spec is not None:
        from refattn.quant.tiles import effective_kv_tile

        tile = effective_kv_tile(spec, call)
        T = 1 if tile is None else -(-K // max(tile, 1))
    per_block = 40 * R * K + 2 * T * R * Dv
    operands = 16 * B * (Hq * Q * Dk + Hkv * K * (Dk + Dv))
    out = 12 * B * Hq * Q * Dv
    kept = 12 * B * Hq * Q * K if intermediates else 0
    return 8 * (per_block + operands + out + kept)


def check_emulation_memory(call: AttentionCall, max_bytes: int | None = None, *,
                           spec: QuantSpec | None = None, intermediates: bool = False) -> None:
    """Refuse an emulation that needs more than ``max_bytes`` (default: the memory available
    now), before it allocates anything.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import AttentionCall
    >>> x = np.zeros((1, 1, 100, 8))
    >>> try:
    ...     check_emulation_memory(AttentionCall(x, x, x), max_bytes=10**6)
    ... except RefAttnError as exc:
    ...     print(str(exc)[:63])
    memory: emulating this quantised call needs about 4864000 bytes
    """
    need = emulation_bytes(call, spec, intermediates=intermediates)
    limit = available_bytes() if max_bytes is None else bounded_int(
        "max_bytes", max_bytes, lo=0, hi=INT64_MAX)
    if limit is not None and need > limit:
        raise RefAttnError(f"memory: emulating this quantised call needs about {need} bytes "
                           f"((B, Hq, Q, K) = {call.score_shape}), more than {limit} bytes")


# -- scales ------------------------------------------------------------------------------------
def _block(tq: TensorQuant, L: int) -> int:
    """Tokens per scale block along an axis of ``L`` tokens: a block longer than the axis is
    the axis (one block), so nothing is sized from a manifest's block, only from ``L``."""
    return min(int(tq.block or 1), max(L, 1))


def _expand(tq: TensorQuant, scale: np.ndarray, name: str, call: AttentionCall) -> np.ndarray:
    """A declared scale broadcastable to the tensor: q (B, Hq, Q, Dk), k/v (B, Hkv, K, D)."""
    x = getattr(call, name)
    L = x.shape[2]
    match tq.granularity:
        case "tensor":
            return scale.reshape(1, 1, 1, 1)
        case "batch_kv_head":  # (B, Hkv); query heads use their kv head's
            s = scale[:, call.head_map] if name == "q" else scale
            return s[:, :, None, None]
        case "head":
            return scale[None, :, None, None]
        case "token_block":  # token t reads block t // block (sized from L, never the block)
            return scale[:, :, np.arange(L) // _block(tq, L), None]
        case "channel":
            return scale[:, :, None, :]
        case other:  # pragma: no cover - TensorQuant refuses it
            raise RefAttnError(f"granularity: {other!r}")


@public
def dequantized_call(call: AttentionCall, spec: QuantSpec) -> AttentionCall:
    """The call the real result runs: ``codes * scale`` for codes, cast tensors as given.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import AttentionCall
    >>> from refattn.quant import preset
    >>> x = np.full((1, 1, 2, 4), 0.5)
    >>> dq = dequantized_call(AttentionCall(x, x, x), preset("fa3_fp8", v_descale=4.0))
    >>> float(dq.v[0, 0, 0, 0]), float(dq.q[0, 0, 0, 0])
    (2.0, 0.5)
    """
    arrays = {}
    for name in ("q", "k", "v"):
        tq: TensorQuant = getattr(spec, name)
        x = getattr(call, name)
        if tq.source == "codes" and tq.scale is not None:
            x = x * _expand(tq, tq.scale, name, call)  # exact: codes have <= 11 bits
        arrays[name] = np.array(x)
    return AttentionCall(arrays["q"], arrays["k"], arrays["v"], visible=call.visible,
                         scale=call.scale, all_masked_rows=call.all_masked_rows)


def _softmax_scale(call: AttentionCall) -> float:
    """The call's scale (the gate always resolves it)."""
    if call.scale is None:  # pragma: no cover - the gate sets the default
        raise RefAttnError("scale: unresolved")
    return float(call.scale)


def _kv_to_query_heads(x: np.ndarray, call: AttentionCall) -> np.ndarray:
    """A k/v-shaped array (axis 1 of size Hkv, or 1 when broadcast) seen by the query heads."""
    return x if x.shape[1] == 1 else x[:, call.head_map]


# -- stage 1: operands -------------------------------------------------------------------------
def _cast_with_scale(x: np.ndarray, tq: TensorQuant, s: np.ndarray) -> Interval:
    """``cast(fl32(x / s))``: the quotient within 3 fp32 ulps (division or the reciprocal's
    product), exact where ``s`` is a power of two and the quotient a normal fp32 number."""
    t = bd.div(point(x), point(np.broadcast_to(s, x.shape)))
    mant = np.frexp(s)[0]
    with np.errstate(divide="ignore", over="ignore"):
        q = x / s
    exact = (np.abs(mant) == 0.5) & ((q == 0) | ((np.abs(q) >= FP32_MIN_NORMAL)
                                                 & (np.abs(q) <= format_max("fp32"))))
    wide = bd.widen(t, 3 * U32, 2.0**-149)
    t = Interval(np.where(exact, t.lo, wide.lo), np.where(exact, t.hi, wide.hi))
    return bd.cast(bd.cast(t, "fp32"), tq.format, tq.rounding)


def _smooth(k: Interval, fmt: str) -> Interval:
    """SageAttention's ``k - k.mean(seq)`` in the input format: the mean accumulated in fp32
    (any order) and rounded to ``fmt``, the difference rounded to ``fmt``."""
    L = k.shape[2]
    total = np.sum(k.lo, axis=2, keepdims=True)  # fp16/bf16 values: exact in float64 here
    mag = np.sum(np.maximum(np.abs(k.lo), np.abs(k.hi)), axis=2, keepdims=True)
    g = bd.gamma(L + 1, U32)  # L - 1 additions, the division (or 1/L and a product)
    exact_sum = bd.widen(point(total), 0.0, bd.gamma(L + 2, 2.0**-53) * mag)
    mean = bd.div(exact_sum, point(float(L)))
    mean = bd.cast(bd.widen(mean, 0.0, g * mag / L + 2.0**-149), "fp32")
    km = bd.cast(mean, fmt)
    return bd.cast(bd.add(k, bd.neg(km)), fmt)


def _dynamic_int8(x: Interval, tq: TensorQuant, name: str) -> tuple[Interval, Interval]:
    """SageAttention's per-block int8: ``scale = fl32(amax / 127)`` and
    ``code = trunc(fl32(fl32(x / scale) + 0.5 sign))`` (half away from zero), the divisions
    within 2 fp32 ulps (Triton's lowering is not documented)."""
    B, H, L, _ = x.shape
    blk = _block(tq, L)  # at most L: the padding below is under one block of the axis
    nb = -(-L // blk)
    pad = nb * blk - L
    absx = Interval(np.where((x.lo <= 0) & (x.hi >= 0), 0.0, np.minimum(abs(x.lo), abs(x.hi))),
                    np.maximum(np.abs(x.lo), np.abs(x.hi)))
    lo = np.pad(absx.lo, ((0, 0), (0, 0), (0, pad), (0, 0))).reshape(B, H, nb, -1).max(axis=3)
    hi = np.pad(absx.hi, ((0, 0), (0, 0), (0, pad), (0, 0))).reshape(B, H, nb, -1).max(axis=3)
    zero = np.argwhere(lo == 0)
    if zero.size:
        b, h, i = (int(t) for t in zero[0])
        raise RefAttnError(f"{name}: block {i} (tokens {i * blk}..{min((i + 1) * blk, L) - 1}) "
                           f"of batch {b}, head {h} may be all zeros after the kernel's "
                           "preprocessing: its scale is 0 and the kernel divides 0 by 0")
    qmax = format_max(tq.format)
    scale = bd.cast(bd.widen(bd.div(Interval(lo, hi), point(qmax)), 2 * 2.0**-23), "fp32")
    token = np.arange(L) // blk  # (L,): the block of each token
    s_el = Interval(scale.lo[:, :, token, None], scale.hi[:, :, token, None])
    t = bd.widen(bd.div(x, s_el), 2 * 2.0**-23, 2.0**-16)  # the division, then + 0.5's rounding
    return bd.cast(t, tq.format, tq.rounding), s_el


def _operands(call: AttentionCall, spec: QuantSpec) -> dict[str, tuple[Interval, Interval]]:
    """Per tensor: the values the kernel's products read (intervals) and their descale."""
    out: dict[str, tuple[Interval, Interval]] = {}
    for name in ("q", "k", "v"):
        tq: TensorQuant = getattr(spec, name)
        x = getattr(call, name)
        if tq.source == "codes":
            scale = tq.scale if tq.scale is not None else np.ones(())
            out[name] = (point(x), point(_expand(tq, scale, name, call)))
            continue
        if tq.scale is not None:
            s = _expand(tq, tq.scale, name, call)
            out[name] = (_cast_with_scale(x, tq, s), point(s))
            continue
        xi = point(x)
        fmt = tq.input_format or "fp32"
        if name == "k" and spec.k_smoothing:
            xi = _smooth(xi, fmt)
        if name == "q" and spec.q_prescale:
            sq = bd.cast(point(_softmax_scale(call) * spec.log2e), "fp32")  # fl32(scale log2e)
            xi = bd.cast(bd.mul(xi, sq), "fp32")
        out[name] = _dynamic_int8(xi, tq, name)
    return out


def _exponent_multiplier(call: AttentionCall, spec: QuantSpec,
                         ops: dict[str, tuple[Interval, Interval]]) -> Interval:
    """c (B, Hq, 1, 1): ``scale * log2e * q_descale * k_descale`` rounded to fp32 (any order of
    its up to six roundings), or exactly 1 when Q was pre-scaled."""
    B, Hq = call.q.shape[:2]
    if spec.q_prescale:
        return point(np.ones((B, Hq, 1, 1)))
    c64 = np.full((B, Hq, 1, 1), _softmax_scale(call) * spec.log2e)
    if spec.s_descale == "exponent":
        qs = ops["q"][1].lo
        ks = _kv_to_query_heads(ops["k"][1].lo, call)
        c64 = c64 * np.broadcast_to(qs, (B, Hq, 1, 1)) * np.broadcast_to(ks, (B, Hq, 1, 1))
    rel = bd.gamma(6, U32) + 8 * 2.0**-53
    return bd.cast(bd.widen(point(c64), rel, 6 * 2.0**-149), "fp32")


def _mag(iv: Interval) -> np.ndarray:
    m = np.maximum(np.abs(iv.lo), np.abs(iv.hi))
    return np.where(np.isfinite(m), m, 0.0)


# -- stages 2-5 by blocks of query rows -------------------------------------------------------
#: query rows per block: R x K <= 2**20 (the working arrays of refattn.quant.rows are R x K)
ROWS_TIMES_KEYS = 2**20


def _rows_per_block(Q: int, K: int) -> int:
    return max(1, min(Q, ROWS_TIMES_KEYS // max(K, 1)))


#: the products (B Hq Q K Dk) up to which "auto" sums every truncation exactly
EXACT_TRUNCATION_PRODUCTS = 2**28
TRUNCATIONS = ("auto", "exact", "counted")


def _exact_truncation(call: AttentionCall, truncation: str) -> bool:
    if truncation not in TRUNCATIONS:
        raise RefAttnError(f"truncation: expected one of {', '.join(TRUNCATIONS)}, "
                           f"got {truncation!r}")
    if truncation == "auto":
        return math.prod(call.score_shape) * call.q.shape[3] <= EXACT_TRUNCATION_PRODUCTS
    return truncation == "exact"


def _keep_intermediates(call: AttentionCall, intermediates: bool | None) -> bool:
    if intermediates is None:  # kept while they fit in 64 MiB (4 arrays of (B, Hq, Q, K))
        return 32 * math.prod(call.score_shape) <= 2**26
    return bool(intermediates)


def emulate(call: AttentionCall, spec: QuantSpec, *, intermediates: bool | None = None,
            truncation: str = "auto") -> dict[str, Interval]:
    """The emulated pipeline's intervals (no validation: :func:`quantized` checks first).

    Runs stages 2-5 (:mod:`refattn.quant.rows`) per head and per block of query rows, so its
    working memory is proportional to a block, not to (B, Hq, Q, K).

    Parameters
    ----------
    call : AttentionCall
    spec : QuantSpec
    intermediates : bool or None
        Also return ``scores`` and ``probs_q`` (B, Hq, Q, K); None: only when the four arrays
        fit in 64 MiB.
    truncation : {"auto", "exact", "counted"}
        How the k-block model bounds S's truncations (point operands): ``"exact"`` sums every
        product's truncation (O(B Hq Q K Dk) scalar work; about 5x tighter), ``"counted"``
        bounds them by the count of products of each sign (BLAS); ``"auto"``: exact up to
        :data:`EXACT_TRUNCATION_PRODUCTS` products.

    Returns
    -------
    dict of str to Interval
        ``output``, ``row_max``, ``row_sum``, (when the kernel returns it) ``lse``, and
        ``scores``, ``probs_q`` when kept; shapes as in :class:`QuantResult`.

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import AttentionCall
    >>> from refattn.quant import preset
    >>> x = np.full((1, 1, 1, 4), 0.5)
    >>> em = emulate(AttentionCall(x, x, x), preset("fa3_fp8"))
    >>> em["probs_q"].lo.tolist(), em["output"].hi.tolist()
    ([[[[256.0]]]], [[[[0.5, 0.5, 0.5, 0.5]]]])
    """
    from refattn.quant import rows
    from refattn.quant.tiles import effective_kv_tile

    ops = _operands(call, spec)
    c = _exponent_multiplier(call, spec, ops)  # (B, Hq, 1, 1)
    B, Hq, Q, K = call.score_shape
    Dv = call.v.shape[3]
    keep = _keep_intermediates(call, intermediates)
    exact = _exact_truncation(call, truncation)
    starts, ends = rows.kv_tiles(K, effective_kv_tile(spec, call), spec.kv_order)
    vis_all = call.visible_array()
    vis_all = np.broadcast_to(True if vis_all is None else vis_all, call.score_shape)
    qc, qs = ops["q"]
    kc, ks = ops["k"]
    vc = ops["v"][0]
    o_lo, o_hi = np.empty((B, Hq, Q, Dv)), np.empty((B, Hq, Q, Dv))
    l_lo, l_hi = np.empty((B, Hq, Q)), np.empty((B, Hq, Q))
    m_lo, m_hi = np.empty((B, Hq, Q)), np.empty((B, Hq, Q))
    if keep:
        s_lo, s_hi = np.empty((B, Hq, Q, K)), np.empty((B, Hq, Q, K))
        pq_lo, pq_hi = np.empty((B, Hq, Q, K)), np.empty((B, Hq, Q, K))
    n = _rows_per_block(Q, K)
    head_map = np.asarray(call.head_map)  # set by the gate: grouped (check_quant)
    for b in range(B):
        for h in range(Hq):
            hk = int(head_map[h])
            k_rows = Interval(kc.lo[b, hk], kc.hi[b, hk])  # (K, Dk)
            v_rows = Interval(vc.lo[b, hk], vc.hi[b, hk])  # (K, Dv)
            cc = (float(c.lo[b, h, 0, 0]), float(c.hi[b, h, 0, 0]))
            for i0 in range(0, Q, n):
                i1 = min(i0 + n, Q)
                q_rows = Interval(qc.lo[b, h, i0:i1], qc.hi[b, h, i0:i1])  # (R, Dk)
                descale = None
                if spec.s_descale == "after_dot":  # (R, 1) x (1, K)
                    qsr = Interval(np.broadcast_to(qs.lo, (B, Hq, Q, 1))[b, h, i0:i1],
                                   np.broadcast_to(qs.hi, (B, Hq, Q, 1))[b, h, i0:i1])
                    ksr = Interval(np.broadcast_to(ks.lo, (B, kc.shape[1], K, 1))[b, hk, :, 0],
                                   np.broadcast_to(ks.hi, (B, kc.shape[1], K, 1))[b, hk, :, 0])
                    descale = (qsr, Interval(ksr.lo[None, :], ksr.hi[None, :]))
                S = rows.scores(q_rows, k_rows, spec, descale, exact_truncation=exact)  # (R, K)
                vis = vis_all[b, h, i0:i1]
                res = rows.emulate_rows(S, vis, cc, v_rows, spec, starts, ends, keep=keep)
                o_lo[b, h, i0:i1], o_hi[b, h, i0:i1] = res.acc_over_l.lo, res.acc_over_l.hi
                l_lo[b, h, i0:i1], l_hi[b, h, i0:i1] = res.row_sum.lo, res.row_sum.hi
                m_lo[b, h, i0:i1], m_hi[b, h, i0:i1] = res.row_max.lo, res.row_max.hi
                if keep and res.probs_q is not None:
                    s_lo[b, h, i0:i1] = np.where(vis, S.lo, -np.inf)
                    s_hi[b, h, i0:i1] = np.where(vis, S.hi, -np.inf)
                    pq_lo[b, h, i0:i1], pq_hi[b, h, i0:i1] = res.probs_q.lo, res.probs_q.hi
    row_sum = Interval(l_lo, l_hi)
    m_final = Interval(m_lo, m_hi)
    out = {"output": _output(Interval(o_lo, o_hi), spec, ops, call), "row_max": m_final,
           "row_sum": row_sum}
    if keep:
        out["scores"] = Interval(s_lo, s_hi)
        out["probs_q"] = Interval(pq_lo, pq_hi)
    if spec.returns_lse:
        off = spec.p_offset if spec.p_handling == "offset" else 0.0
        out["lse"] = _lse(m_final, c, row_sum, off)
    # a NaN that arose in the emulation (a cast to NaN, inf - inf) says nothing about what the
    # kernel returns (fmaxf ignores NaN, finalize guards l != l): unknown, [-inf, inf]
    return {name: _nan_unknown(iv) for name, iv in out.items()}


def _output(o: Interval, spec: QuantSpec, ops: dict[str, tuple[Interval, Interval]],
            call: AttentionCall) -> Interval:
    """Stage 5: the kernel's output from the exact ``acc / l`` (B, Hq, Q, Dv): divided by P's
    multiplier, times v's descale, within ``output_ulp`` fp32 ulps, cast to the output format
    (or the descale applied after the kernel's cast)."""
    mult = spec.p_multiplier if spec.p_handling == "multiplier" else 1.0
    vd = ops["v"][1]
    vd_eff = Interval(_kv_to_query_heads(vd.lo, call), _kv_to_query_heads(vd.hi, call))
    if mult != 1.0 and spec.l_from == "unrounded":
        o = bd.div(o, point(mult))
    out_rel = spec.output_ulp * 2.0**-23
    if spec.output_post_scale == "in_kernel":
        o = bd.cast(bd.widen(bd.mul(o, vd_eff), out_rel, FP32_MIN_NORMAL), "fp32")
        return bd.cast(o, spec.output_format)
    o = bd.cast(bd.cast(bd.widen(o, out_rel, FP32_MIN_NORMAL), "fp32"), spec.output_format)
    return bd.cast(bd.cast(bd.mul(o, vd_eff), "fp32"), spec.output_format)


def _nan_unknown(iv: Interval) -> Interval:
    nan = np.isnan(iv.lo) | np.isnan(iv.hi)
    if not nan.any():
        return iv
    return Interval(np.where(nan, -np.inf, iv.lo), np.where(nan, np.inf, iv.hi))


def _lse(m: Interval, c: Interval, row_sum: Interval, off: float) -> Interval:
    """``m c ln2 + ln(l) - off ln2`` in fp32 with a fast log (``__logf``: 2**-21.41 absolute
    on [0.5, 2], else 3 ulp) and the products' and the sum's roundings.

    ``ln(l)``'s float64 ends come from :func:`refattn.quant.elementary.log` (the same bits on
    every machine, not numpy's CPU-dependent ``np.log``), widened by its relative error bound
    ``r = LOG_MAX_REL_ERROR`` as ``r / (1 - r)`` of the computed value (``|y - L| <= r |L|``
    gives ``|L| <= |y| / (1 - r)``); ``ln2`` enters as the one-ulp enclosure of ``LN2``."""
    c3 = Interval(c.lo[..., 0], c.hi[..., 0])
    ln2 = Interval(bd._down(LN2), bd._up(LN2))
    t1 = bd.mul(bd.mul(m, c3), ln2)
    r = elementary.LOG_MAX_REL_ERROR
    log_l = bd.widen(Interval(elementary.log(row_sum.lo), elementary.log(row_sum.hi)),
                     float(bd._up(r / (1.0 - r))))
    t2 = bd.add(log_l, bd.neg(bd.mul(point(off), ln2)))
    s = bd.add(t1, t2)
    e = 2.0**-21 + 4 * 2.0**-23 * _mag(t2) + 4 * U32 * (_mag(t1) + _mag(s))
    return bd.cast(bd.widen(s, 0.0, e), "fp32")
