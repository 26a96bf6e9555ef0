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
        Float64 attention of the dequantised call (every canonical tensor).
    emulated : dict of str to Interval
        ``"output"`` (B, Hq, Q, Dv); ``"lse"`` (B, Hq, Q) when the kernel returns it;
        ``"scores"`` (B, Hq, Q, K) the kernel's raw S; ``"row_max"`` (B, Hq, Q) its final
        max; ``"probs_q"`` (B, Hq, Q, K) P as cast; ``"row_sum"`` (B, Hq, Q) its l. Units in
        docs/quant.md.
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
def quantized(call: AttentionCall, spec: QuantSpec, *, backend: str = "numpy",
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
        The engine for the real result (``"numpy"``, ``"numba"``, ``"exact"``, ...).
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
    check_emulation_memory(call)
    real = forward(dequantized_call(call, spec), backend=backend, **options)
    return QuantResult(call, spec, real, emulate(call, spec), backend)


def emulation_bytes(call: AttentionCall) -> int:
    """Peak bytes of :func:`emulate` (an upper estimate: 56 (B, Hq, Q, K) float64 arrays, 44
    measured with tracemalloc at (1, 4, 256, 256), and 16 per operand row).

    Examples
    --------
    >>> import numpy as np
    >>> from refattn import AttentionCall
    >>> x = np.zeros((1, 1, 100, 8))
    >>> emulation_bytes(AttentionCall(x, x, x))
    4684800
    """
    B, Hq, Q, K = call.score_shape
    D = max(call.q.shape[3], call.v.shape[3])
    return 8 * (56 * B * Hq * Q * K + 16 * B * Hq * (Q + K) * D)


def check_emulation_memory(call: AttentionCall, max_bytes: int | None = None) -> None:
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
    memory: emulating this quantised call needs about 4684800 bytes
    """
    need = emulation_bytes(call)
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


# -- stage 2: S --------------------------------------------------------------------------------
def _scores(call: AttentionCall, spec: QuantSpec,
            ops: dict[str, tuple[Interval, Interval]]) -> Interval:
    """The kernel's S (B, Hq, Q, K), -inf where not visible."""
    hm = call.head_map
    qc, qs = ops["q"]
    kc, ks = ops["k"]
    kc_eff = kc[:, hm]
    Dk = call.q.shape[3]
    match spec.s_accumulation:
        case "fp32":
            u = math.ldexp(1.0, 1 - spec.mma_bits)
            s = bd.cast(bd.signed_dot(qc, kc_eff, "bhqd,bhkd->bhqk", n=Dk, u_acc=u,
                                      tiny=FP32_MIN_NORMAL), "fp32")
        case "int32":  # exact in int32, then converted to float
            s = bd.cast(bd.signed_dot(qc, kc_eff, "bhqd,bhkd->bhqk", n=Dk, u_acc=0.0), "fp32")
        case _:  # "exact"
            s = bd.signed_dot(qc, kc_eff, "bhqd,bhkd->bhqk", n=Dk, u_acc=0.0)
    if spec.s_descale == "after_dot":  # S = fl32(S fl32(q_scale k_scale)) (SageAttention)
        ks_eff = Interval(_kv_to_query_heads(ks.lo, call),
                          _kv_to_query_heads(ks.hi, call))  # (B, Hq, K, 1) or broadcast
        qks = bd.cast(bd.mul(qs, Interval(np.swapaxes(ks_eff.lo, 2, 3),
                                          np.swapaxes(ks_eff.hi, 2, 3))), "fp32")
        s = bd.mul(s, qks)
        if spec.s_accumulation != "exact":
            s = bd.cast(s, "fp32")
    vis = call.visible_full()
    return Interval(np.where(vis, s.lo, -np.inf), np.where(vis, s.hi, -np.inf))


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


# -- stages 3-5 --------------------------------------------------------------------------------
def _mag(iv: Interval) -> np.ndarray:
    m = np.maximum(np.abs(iv.lo), np.abs(iv.hi))
    return np.where(np.isfinite(m), m, 0.0)


def _tiles(K: int, spec: QuantSpec) -> list[np.ndarray]:
    size = K if spec.kv_tile is None else spec.kv_tile
    tiles = [np.arange(start, min(start + size, K)) for start in range(0, K, size)]
    return tiles[::-1] if spec.kv_order == "descending" else tiles


def _bounded_arg(d: Interval, c: Interval, m: Interval, smag: np.ndarray, off: float) -> Interval:
    """fp32 enclosure of the kernel's exponent ``(S - m) c + off`` for ``d = S - m <= 0``,
    whatever order and fusion the kernel uses (fma(S, c, -fl(fl(m c) - off)), or the
    products rounded separately): each of its <= 4 roundings errs by u of its operand."""
    a = bd.add(bd.mul(d, c), point(off))
    with np.errstate(invalid="ignore", over="ignore"):
        x = smag * c.hi  # |S c|
        y = _mag(m) * c.hi  # |m c|
        amag = np.maximum(np.abs(a.lo), np.abs(a.hi))
        e1 = U32 * (x + 2.0 * y * (1 + U32) + off)
        err = (1 + 1e-6) * (e1 + U32 * (np.where(np.isfinite(amag), amag, 0.0) + e1))
        # |S c| or |m c| may pass fp32's maximum: the kernel's exponent is then anything
        overflow = np.maximum(x, y) * (1 + 4 * U32) >= format_max("fp32")
    arg = bd.cast(bd.widen(a, 0.0, err), "fp32")
    return Interval(np.where(overflow, -np.inf, arg.lo), np.where(overflow, np.inf, arg.hi))


def emulate(call: AttentionCall, spec: QuantSpec) -> dict[str, Interval]:
    """The emulated pipeline's intervals (no validation: :func:`quantized` checks first).

    Returns
    -------
    dict of str to Interval
        ``output``, ``scores``, ``row_max``, ``probs_q``, ``row_sum`` and (when the kernel
        returns it) ``lse``; shapes as in :class:`QuantResult`.

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
    ops = _operands(call, spec)
    S = _scores(call, spec, ops)  # (B, Hq, Q, K)
    c = _exponent_multiplier(call, spec, ops)  # (B, Hq, 1, 1)
    B, Hq, Q, K = S.shape
    vis = call.visible_full()
    off = spec.p_offset if spec.p_handling == "offset" else 0.0
    mult = spec.p_multiplier if spec.p_handling == "multiplier" else 1.0
    tiles = _tiles(K, spec)
    T = len(tiles)
    smag = _mag(S)

    m_lo = np.full((B, Hq, Q, 1), -np.inf)
    m_hi = np.full((B, Hq, Q, 1), -np.inf)
    p_lo, p_hi = np.zeros((B, Hq, Q, K)), np.zeros((B, Hq, Q, K))
    P_lo, P_hi = np.zeros((B, Hq, Q, K)), np.zeros((B, Hq, Q, K))
    alphas: list[Interval] = []
    for idx in tiles:
        St = S[..., idx]
        tmax_lo = St.lo.max(axis=-1, keepdims=True)
        tmax_hi = St.hi.max(axis=-1, keepdims=True)
        new = Interval(np.maximum(m_lo, tmax_lo), np.maximum(m_hi, tmax_hi))
        # the rescale of what came before: exp2((m_prev - m_new) c), m_new >= m_prev exactly
        unchanged = (tmax_hi < m_lo) | (tmax_hi == -np.inf)  # this tile cannot raise the max
        first = m_hi == -np.inf  # nothing before: acc = l = 0, the factor multiplies zeros
        with np.errstate(invalid="ignore"):
            d = Interval(np.where(unchanged | first, 0.0, m_lo - new.hi),
                         np.where(unchanged | first, 0.0, np.minimum(m_hi - new.lo, 0.0)))
            d = Interval(bd._down(d.lo), np.where(d.hi == 0, 0.0, bd._up(d.hi)))
            prev_mag = np.where(np.isfinite(m_hi), np.maximum(abs(m_lo), abs(m_hi)), 0.0)
            dmag = bd._up(3 * U32 * (prev_mag + _mag(new)) * c.hi)
            darg = bd.cast(bd.widen(bd.mul(d, c), 0.0, np.where(unchanged | first, 0.0, dmag)),
                           "fp32")
            wild = ((prev_mag + _mag(new)) * c.hi * (1 + 4 * U32) >= format_max("fp32")) & ~first
        darg = Interval(np.where(wild, -np.inf, darg.lo), np.where(wild, np.inf, darg.hi))
        alpha = bd.exp2(darg, spec.exp2_ulp)
        alphas.append(Interval(np.where(first, 1.0, alpha.lo), np.where(first, 1.0, alpha.hi)))
        # p = exp2((S - m) c + off) with S <= m exactly in the kernel
        with np.errstate(invalid="ignore"):
            ds = Interval(St.lo - new.hi, np.minimum(St.hi - new.lo, 0.0))
        vt = vis[..., idx]
        ds = Interval(np.where(vt, ds.lo, -np.inf), np.where(vt, ds.hi, -np.inf))
        arg = _bounded_arg(ds, c, new, smag[..., idx], off)
        p = bd.exp2(arg, spec.exp2_ulp)
        p = Interval(np.where(vt, p.lo, 0.0), np.where(vt, p.hi, 0.0))
        scaled = p if mult == 1.0 else bd.cast(bd.mul(p, point(mult)), "fp32")
        P = bd.cast(scaled, spec.p_format, spec.p_rounding)
        p_lo[..., idx], p_hi[..., idx] = p.lo, p.hi
        P_lo[..., idx], P_hi[..., idx] = P.lo, P.hi
        m_lo, m_hi = new.lo, new.hi

    # w_t = product of the factors of the tiles visited after t (nonnegative intervals)
    w_lo = np.ones((B, Hq, Q, K))
    w_hi = np.ones((B, Hq, Q, K))
    acc_lo, acc_hi = np.ones((B, Hq, Q, 1)), np.ones((B, Hq, Q, 1))
    for idx, alpha in zip(reversed(tiles), reversed(alphas), strict=True):
        w_lo[..., idx] = acc_lo
        w_hi[..., idx] = acc_hi
        acc_lo = np.maximum(bd._down(acc_lo * alpha.lo), 0.0)
        acc_hi = bd._up(acc_hi * alpha.hi)
    W = Interval(w_lo, w_hi)

    # l
    terms = Interval(p_lo, p_hi) if spec.l_from == "unrounded" else Interval(P_lo, P_hi)
    wt = bd.mul(W, terms)
    wt = Interval(np.maximum(wt.lo, 0.0), wt.hi)
    g64 = bd.gamma(K + 1, 2.0**-53)
    u_l = U32 if spec.l_from == "unrounded" else max(U32, math.ldexp(1.0, 1 - spec.mma_bits))
    gl = bd.gamma((K - 1) * 1.0 + T * U32 / u_l, u_l)
    l_lo = bd._down(wt.lo.sum(-1) * (1 - g64) * (1 - gl))
    l_hi = bd._up(bd._up(wt.hi.sum(-1) * (1 + g64)) * (1 + gl))
    row_sum = bd.cast(Interval(np.maximum(l_lo, 0.0), l_hi), "fp32")  # (B, Hq, Q)

    # acc
    vc = ops["v"][0][:, call.head_map]  # (B, Hq, K, Dv)
    a = bd.mul(W, Interval(P_lo, P_hi))
    a = Interval(np.maximum(a.lo, 0.0), a.hi)
    acc, mag = bd.nonneg_weighted_dot(a, vc, "bhqk,bhkd->bhqd")
    fmax = format_max("fp32")
    overflow = np.zeros(acc.shape, dtype=bool)
    match spec.pv_accumulation:
        case "fp32":
            u = math.ldexp(1.0, 1 - spec.mma_bits)
            g_acc = bd.gamma(1.0, (K - 1 + T) * u + T * U32)
            tiny = K * FP32_MIN_NORMAL
        case "fp16_per_tile":
            u16 = math.ldexp(1.0, 1 - spec.mma_bits)
            n_tile = max(len(t) for t in tiles)
            g_acc = bd.gamma(1.0, n_tile * u16 + 2 * T * U32)
            tiny = K * 2.0**-23
            for idx in tiles:  # a tile's fp16 sum may overflow
                _, tmag = bd.nonneg_weighted_dot(Interval(P_lo[..., idx], P_hi[..., idx]),
                                                 vc[:, :, idx], "bhqk,bhkd->bhqd")
                overflow |= tmag * (1 + g_acc) >= format_max("fp16")
        case _:  # "exact"
            g_acc, tiny = 0.0, 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        err = bd._up(mag * bd._up(g_acc) + tiny)
        overflow |= mag * (1 + g_acc) >= fmax
    acc = bd.widen(acc, 0.0, err)
    acc = Interval(np.where(overflow, -np.inf, acc.lo), np.where(overflow, np.inf, acc.hi))
    acc = bd.cast(acc, "fp32")

    # output
    vd = ops["v"][1]
    vd_eff = Interval(_kv_to_query_heads(vd.lo, call), _kv_to_query_heads(vd.hi, call))
    denom = mult if spec.l_from == "unrounded" else 1.0
    l4 = Interval(row_sum.lo[..., None], row_sum.hi[..., None])
    o = bd.div(acc, l4)
    if denom != 1.0:
        o = bd.div(o, point(denom))
    out_rel = spec.output_ulp * 2.0**-23
    if spec.output_post_scale == "in_kernel":
        o = bd.mul(o, vd_eff)
        o = bd.cast(bd.widen(o, out_rel, FP32_MIN_NORMAL), "fp32")
        output = bd.cast(o, spec.output_format)
    else:
        o = bd.cast(bd.widen(o, out_rel, FP32_MIN_NORMAL), "fp32")
        o = bd.cast(o, spec.output_format)
        output = bd.cast(bd.cast(bd.mul(o, vd_eff), "fp32"), spec.output_format)

    m_final = Interval(m_lo[..., 0], m_hi[..., 0])
    out = {"output": output, "scores": S, "row_max": m_final,
           "probs_q": Interval(P_lo, P_hi), "row_sum": row_sum}
    if spec.returns_lse:
        out["lse"] = _lse(m_final, c, row_sum, off)
    # a NaN that arose in the emulation (a cast to NaN, inf - inf) says nothing about what the
    # kernel returns (fmaxf ignores NaN, finalize guards l != l): unknown, [-inf, inf]
    return {name: _nan_unknown(iv) for name, iv in out.items()}


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
