"""Presets: the quantised pipelines of named kernels, built only from their documented behaviour.

Owns :data:`PRESETS` and :func:`preset`. Each builder's docstring names the source files and
functions it follows; ``docs/quant-sources.md`` holds the checked facts with file/function
citations and the corrections to issue 28's summary (FA3's online softmax, FlashInfer's
per-head scales, vLLM's reciprocal Q scale, SageAttention's fp16 smoothing). Where a kernel's
arithmetic is undocumented (FP8 tensor-core accumulation, ``ex2.approx``, fast-math division)
the preset widens the bound (``mma_bits``, ``exp2_ulp``, ``output_ulp``) instead of guessing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from refattn._boundary import public
from refattn._checks import bounded_float
from refattn.errors import RefAttnError
from refattn.quant.formats import format_max
from refattn.quant.spec import QuantSpec, TensorQuant

__all__ = ["PRESETS", "preset"]

PRESETS = ("fa3_fp8", "flashinfer_sm90_fp8", "flashinfer_fp8_kv", "vllm_fp8_kv",
           "sageattention_int8")

SAT = "nearest_even_satfinite"
FP8_MMA_BITS = 13  # FP8 MMA accumulation: undocumented; measured 14 significand bits, widened
HALF_MMA_BITS = 22  # fp16/bf16 MMA into fp32: undocumented order/truncation, widened from 24
#: keys or features per MMA k-block: Hopper's FP8 WGMMA (wgmma.mma_async.*.e4m3, k = 32) and
#: mma.sync.m16n8k16 for fp16/bf16 (k = 16); PTX ISA, "Matrix shape" tables
FP8_MMA_K = 32
HALF_MMA_K = 16
SAGE_LOG2E = 1.44269504  # SageAttention's literal (per_block_int8: sm_scale * 1.44269504)


def _arr(x: object, name: str = "scale") -> np.ndarray:
    """A scale as given (an array) or a number as a 0-d float64 array (TensorQuant checks; an
    integer beyond float64's range is refused here, by ``name``)."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return np.array(bounded_float(name, x, lo=0.0, lo_open=True, hi=2.0**128))
    if isinstance(x, (float, np.floating)):
        return np.array(float(x))  # NaN, inf, 0 and negatives: check_quant names them
    return x  # type: ignore[return-value]  # TensorQuant refuses it by name


def _descale(name: str, x: object, head_gran: str) -> tuple[np.ndarray, str]:
    """A descale and its granularity from its shape: a number is per tensor, an array of
    ndim 2 ``(B, Hkv)`` (FA3) or ndim 1 ``(H,)`` (FlashInfer), as ``head_gran`` says."""
    if x is None:
        return np.array(1.0), "tensor"
    if isinstance(x, np.ndarray) and x.ndim > 0:
        want = 2 if head_gran == "batch_kv_head" else 1
        if x.ndim != want:
            raise RefAttnError(f"{name}: expected a number or a {want}-d array "
                               f"({'(B, Hkv)' if want == 2 else '(H,)'}), got shape "
                               f"{list(x.shape)}")
        return x, head_gran
    return _arr(x, name), "tensor"


def _table(tile_table: str | None, own: str) -> str:
    """The kv tile table a builder sets: its kernel's own (``None``), none (``""``: a custom
    ``kv_tile``) or another table by name (QuantSpec checks the name)."""
    return own if tile_table is None else tile_table


def _choice(name: str, x: str, allowed: tuple[str, ...]) -> str:
    if x not in allowed:
        raise RefAttnError(f"{name}: expected one of {', '.join(allowed)}, got {x!r}")
    return x


def fa3_fp8(*, q_descale: Any = None, k_descale: Any = None, v_descale: Any = None,
            kv_tile: int | None = None, mma_bits: int = FP8_MMA_BITS,
            v_colmajor: bool = False, tile_table: str | None = None) -> QuantSpec:
    """FlashAttention-3's FP8 forward (hopper/), also behind PyTorch's
    ``_scaled_dot_product_attention_quantized``.

    Follows Dao-AILab/flash-attention ``hopper/flash_api.cpp`` ``mha_fwd`` (e4m3fn inputs,
    bf16 output, descales float32 ``(B, Hkv)``, absent = 1),
    ``hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp`` ``mma`` / ``to_underlying_arguments`` (S on
    raw FP8 codes; ``c = fl(fl(scale log2e) fl(q_descale k_descale))``; kv blocks visited
    from the last), ``hopper/softmax.h``
    ``scale_apply_exp2`` / ``online_softmax`` / ``finalize`` (max on raw S;
    ``p = exp2f(S c - fl(fl(m c) - 8))``; l from the fp32 p; O = ``acc fl(fl(1/l) v_descale)``;
    LSE = ``m c ln2 + log(l / 256)``), ``hopper/utils.h`` ``convert_type_out``
    (``cvt.rn.satfinite`` to e4m3). See docs/quant-sources.md, "FlashAttention-3 FP8 forward".

    Widened: the FP8 WGMMA accumulator (undocumented) is modelled per k-block of
    ``mma_k`` = 32 products (one ``wgmma ... k32 ... e4m3`` instruction) summed to ``mma_bits``
    = 13 significant bits with truncation, one bit below what was measured (SageAttention2,
    Zhang et al. 2024: 13 mantissa bits, "FP22", on Ada and Hopper; DeepSeek-V3 technical
    report section 3.3.2: "around 14 bits" on H800; the model and its alternatives:
    :mod:`refattn.quant.accumulation`); ``ex2.approx.ftz`` as 2 ulp with flush to zero;
    fast-math ``1/l`` and the two products as 4 ulp.

    kv tiles (``tile_table="fa3_fp8"``, :mod:`refattn.quant.tiles`): ``kv_tile=None`` is the
    kernel's kBlockN for the call's head dim, from ``hopper/tile_size.h``
    ``tile_size_fwd_sm90`` with element_size 1 (Dao-AILab/flash-attention commit 0251105a2fb1)
    as ``hopper/flash_fwd_launch_template.h`` ``run_mha_fwd_`` calls it for a dense KV cache
    without a local window or softcap (which the preset refuses): 160 (head dim <= 64), 128
    (<= 96), 224 (<= 128), 160 (<= 192), 128 (<= 256); the kernel ignores ``is_causal`` for
    FP8. The blocks start at key 0 and are visited from the last
    (``mainloop_fwd_sm90_tma_gmma_ws.hpp`` ``mma``: ``n_block = n_block_max - 1``, then
    ``--n_block``). ``v_colmajor=True`` (``tile_table="fa3_fp8_v_colmajor"``): a V with
    ``stride(-1) != 1`` in a build with ``FLASH_ATTENTION_ENABLE_VCOLMAJOR``, kBlockN 192 at
    head dim <= 128 (``mha_fwd`` at that commit refuses such a V; the table is kept for
    builds that take it). A ``kv_tile`` other than the table's is refused by
    :func:`~refattn.quant.spec.check_quant`; ``tile_table=""`` takes a custom one (every
    preset takes ``tile_table``: None, its kernel's table; ``""``, none; or a table's name).
    Not emulated: split-KV (``num_splits`` > 1, chosen by ``get_num_splits`` where
    ``flash_attn_with_kvcache`` passes ``num_splits=0``; ``flash_attn_func`` passes 1).

    Examples
    --------
    >>> spec = fa3_fp8(q_descale=np.full((2, 1), 0.5))
    >>> spec.q.granularity, spec.k.granularity, spec.p_offset, spec.kv_order
    ('batch_kv_head', 'tensor', 8.0, 'descending')
    >>> spec.kv_tile, spec.tile_table, fa3_fp8(v_colmajor=True).tile_table
    (None, 'fa3_fp8', 'fa3_fp8_v_colmajor')
    """
    if not isinstance(v_colmajor, bool):
        raise RefAttnError(f"v_colmajor: expected a bool, got {v_colmajor!r}")
    q, k, v = (TensorQuant("e4m3fn", *_descale(f"{name}_descale", x, "batch_kv_head"), SAT,
                           "codes")
               for name, x in (("q", q_descale), ("k", k_descale), ("v", v_descale)))
    return QuantSpec(q, k, v, s_accumulation="fp32", p_format="e4m3fn", p_rounding=SAT,
                     p_handling="offset", p_offset=8.0, l_from="unrounded",
                     pv_accumulation="fp32", output_format="bf16", output_post_scale="in_kernel",
                     exp2_ulp=2.0, name="fa3_fp8", s_descale="exponent", kv_tile=kv_tile,
                     kv_order="descending", mma_bits=mma_bits, mma_k=FP8_MMA_K, output_ulp=4.0,
                     returns_lse=True, masks=("none", "causal"), gqa=True,
                     tile_table=_table(tile_table, "fa3_fp8_v_colmajor" if v_colmajor
                                       else "fa3_fp8"))


def flashinfer_sm90_fp8(*, q_scale: Any = None, k_scale: Any = None, v_scale: Any = None,
                        kv_format: str = "e4m3fn", kv_tile: int | None = None,
                        mma_bits: int = FP8_MMA_BITS, tile_table: str | None = None) -> QuantSpec:
    """FlashInfer's SM90 (FA3-derived) FP8 prefill.

    Follows flashinfer-ai/flashinfer ``include/flashinfer/attention/hopper/variants.cuh``
    ``StandardFP8Attention`` (``p_scale`` = the KV format's max, 448 or 57344; scales per head
    without a batch axis: q per query head ``(Hq,)``, k and v per kv head ``(Hkv,)``),
    ``hopper/attention_updater.cuh`` ``scale_apply_exp2`` (no offset: p in [0, 1]) and
    ``OnlineSoftmax::finalize`` (O = ``acc fl(fl(v_scale / p_scale) / l)``),
    ``hopper/quantization/mainloop_mma.cuh`` (l from the unscaled fp32 p, before the cast),
    ``hopper/utils.cuh`` ``convert_type`` (round to nearest, satfinite). See
    docs/quant-sources.md, "FlashInfer SM90 FP8".

    kv tiles (``tile_table="flashinfer_sm90_fp8"``): ``kv_tile=None`` is ``CTA_KV`` of
    ``include/flashinfer/attention/hopper/quantization/prefill_sm90.cuh``
    ``SingleFP8PrefillWithKVCacheDispatched`` (commit fb28d7242b35): 128 at head dim 64, 192
    at 128, 128 at 256 (the only head dims it instantiates, v's equal to q's; another asks for
    ``kv_tile``), visited from the last (``quantization/mainloop_mma.cuh``: ``kv_tile_idx =
    kv_tile_idx_count - 1``, then ``--kv_tile_idx``). The paged batch kernel
    (``BatchFP8PrefillWithPagedKVCacheDispatched``) uses 128, 128, 64:
    ``tile_table="flashinfer_sm90_fp8_paged"``.

    Not emulated: the LSE (FlashInfer returns it in base 2; not part of this preset's
    result). Widened as :func:`fa3_fp8`.

    Examples
    --------
    >>> spec = flashinfer_sm90_fp8(k_scale=np.ones(2))
    >>> spec.p_handling, spec.p_multiplier, spec.k.granularity
    ('multiplier', 448.0, 'head')
    """
    fmt = _choice("kv_format", kv_format, ("e4m3fn", "e5m2"))
    q, k, v = (TensorQuant(fmt, *_descale(f"{name}_scale", x, "head"), SAT, "codes")
               for name, x in (("q", q_scale), ("k", k_scale), ("v", v_scale)))
    return QuantSpec(q, k, v, s_accumulation="fp32", p_format=fmt, p_rounding=SAT,
                     p_handling="multiplier", p_multiplier=format_max(fmt),
                     l_from="unrounded", pv_accumulation="fp32", output_format="bf16",
                     output_post_scale="in_kernel", exp2_ulp=2.0, name="flashinfer_sm90_fp8",
                     s_descale="exponent", kv_tile=kv_tile, kv_order="descending",
                     mma_bits=mma_bits, mma_k=FP8_MMA_K, output_ulp=4.0, returns_lse=False,
                     masks=("none", "causal"), gqa=True,
                     tile_table=_table(tile_table, "flashinfer_sm90_fp8"))


def flashinfer_fp8_kv(*, k_scale: float = 1.0, v_scale: float = 1.0, q_dtype: str = "fp16",
                      kv_format: str = "e4m3fn", kv_tile: int | None = None,
                      mma_bits: int = HALF_MMA_BITS, tile_table: str | None = None) -> QuantSpec:
    """FlashInfer's FA2 prefill with an FP8 KV cache (q in fp16/bf16).

    Follows flashinfer-ai/flashinfer ``include/flashinfer/attention/prefill.cuh``
    ``compute_qk`` / ``compute_sfm_v`` (K, V codes upcast exactly to q's dtype by
    ``vec_cast``; P cast to q's dtype; l = row sum of the *rounded* P with fp32 accumulation)
    and ``normalize_d`` (O = ``o rcp(l)``, output in q's dtype); ``flashinfer/prefill.py``
    ``single_prefill_with_kv_cache`` (``k_scale`` folded into ``sm_scale`` on the host,
    ``v_scale`` applied to the kernel's output after it returns: a second rounding in the
    output dtype). See docs/quant-sources.md, "FlashInfer FA2 with an FP8 KV cache".

    Assumed: fp32 QK accumulation (the default; ``use_fp16_qk_reduction`` is not emulated).
    Widened: fp16/bf16 MMA accumulation modelled as ``mma_bits`` = 22 bits with truncation.

    kv tiles (``tile_table="flashinfer_fa2"``): the kernel's ``CTA_TILE_KV = NUM_MMA_KV *
    NUM_WARPS_KV * 16`` is chosen at dispatch from the packed query rows and the device's
    shared memory (``prefill.cuh`` ``SinglePrefillWithKVCacheDispatched``,
    ``utils.cuh`` ``FA2DetermineCtaTileQ``, commit fb28d7242b35): 32, 64 or 128 for an FP8
    cache, so ``kv_tile`` must be given (the tile the dispatch picks on the device); tiles
    visited from the first. Not emulated: the 4-kv-warp layout of 16 packed query rows or
    fewer, and split-KV (``partition_kv``).

    Examples
    --------
    >>> spec = flashinfer_fp8_kv(v_scale=0.25, q_dtype="bf16")
    >>> spec.l_from, spec.p_format, spec.output_post_scale
    ('rounded', 'bf16', 'after_kernel')
    """
    dtype = _choice("q_dtype", q_dtype, ("fp16", "bf16"))
    fmt = _choice("kv_format", kv_format, ("e4m3fn", "e5m2"))
    return QuantSpec(q=TensorQuant(dtype, _arr(1.0), "tensor", "nearest_even", "codes"),
                     k=TensorQuant(fmt, _arr(k_scale, "k_scale"), "tensor", SAT, "codes"),
                     v=TensorQuant(fmt, _arr(v_scale, "v_scale"), "tensor", SAT, "codes"),
                     s_accumulation="fp32", p_format=dtype, p_rounding="nearest_even",
                     p_handling="offset", p_offset=0.0, l_from="rounded",
                     pv_accumulation="fp32", output_format=dtype,
                     output_post_scale="after_kernel", exp2_ulp=2.0, name="flashinfer_fp8_kv",
                     s_descale="exponent", kv_tile=kv_tile, kv_order="ascending",
                     mma_bits=mma_bits, mma_k=HALF_MMA_K, output_ulp=4.0, returns_lse=False,
                     masks=("none", "causal"), gqa=True,
                     tile_table=_table(tile_table, "flashinfer_fa2"))


def vllm_fp8_kv(*, q_scale: float = 1.0, k_scale: float = 1.0, v_scale: float = 1.0,
                dtype: str = "bf16", kv_tile: int | None = None,
                mma_bits: int = FP8_MMA_BITS, tile_table: str | None = None) -> QuantSpec:
    """vLLM's FP8 KV cache read by FA3 (the call holds the model's unquantised q, k, v).

    Follows vllm-project/vllm ``csrc/quantization/fp8/nvidia/quant_utils.cuh``
    ``scaled_vec_conversion`` via ``csrc/cache_kernels.cu`` ``reshape_and_cache_flash_kernel``
    (cache write: ``cvt.satfinite(fl(x / scale))``), ``csrc/quantization/w8a8/fp8/common.cuh``
    ``scaled_fp8_conversion`` (Q: ``fl(x fl(1 / scale))`` clamped to +-448, then the cast) and
    ``vllm/v1/attention/backends/flash_attn.py`` ``FlashAttentionImpl.forward`` (per-tensor
    scales expanded to FA3's ``(B, Hkv)`` descales); then :func:`fa3_fp8`. See
    docs/quant-sources.md, "vLLM FP8 KV cache with FA3".

    Widened: the quotient before the cast is taken within 3 fp32 ulps of ``x / scale`` (true
    division or the reciprocal product; fast math unknown), so a value next to an e4m3
    rounding boundary gets both codes. Assumed: vLLM's FA3 fork does what Dao-AILab's does.

    kv tiles (``tile_table="vllm_fa3_fp8"``): vLLM builds its fork
    vllm-project/flash-attention at the commit ``cmake/external_projects/vllm_flash_attn.cmake``
    pins (2adfc8c2177c at vllm-project/vllm 3a7b2806) and reads a paged KV cache. Its
    ``hopper/tile_size.h`` ``tile_size_fwd_sm90`` adds a one-MMA-warpgroup decode tile
    (``hopper/heuristics.h`` ``use_one_mma_wg``: head dim exactly 64 or 128 and
    ``max_seqlen_q * Hq / Hkv <= 64``) to FA3's: 160 (head dim < 64), 128 or 160 (64), 128
    (<= 96), 160 or 224 (<= 127: 224 only for pages read by TMA, ``get_pagedkv_tma``), 96, 160
    or 224 (128), 160 (<= 192), 128 (<= 256). Where the row has several, ``kv_tile`` must be
    given. Not emulated: split-KV (``num_splits``), which vLLM's decode uses.

    Examples
    --------
    >>> spec = vllm_fp8_kv(k_scale=0.5)
    >>> spec.k.source, spec.k.input_format, float(spec.k.scale)
    ('cast', 'bf16', 0.5)
    """
    fmt = _choice("dtype", dtype, ("bf16", "fp16"))
    q, k, v = (TensorQuant("e4m3fn", _arr(s, n), "tensor", SAT, "cast", input_format=fmt)
               for s, n in ((q_scale, "q_scale"), (k_scale, "k_scale"), (v_scale, "v_scale")))
    return fa3_fp8(kv_tile=kv_tile, mma_bits=mma_bits).replace(q=q, k=k, v=v,
                                                                name="vllm_fp8_kv",
                                                                tile_table=_table(
                                                                    tile_table, "vllm_fa3_fp8"))


def sageattention_int8(*, dtype: str = "fp16", kv_tile: int | None = None,
                       mma_bits: int = 11, tile_table: str | None = None) -> QuantSpec:
    """SageAttention's Triton INT8-QK / FP16-PV kernel (``sageattn_qk_int8_pv_fp16_triton``).

    Follows thu-ml/SageAttention ``sageattention/core.py`` (K smoothed by its per-head mean
    over the sequence, the mean and the difference rounded in the input dtype; V converted to
    fp16), ``sageattention/triton/quant_per_block.py`` ``per_block_int8`` /
    ``quant_per_block_int8_kernel`` (Q times ``fl(sm_scale 1.44269504)`` in fp32; per 128-token
    Q block and 64-token K block ``scale = fl(amax / 127)``, ``x / scale`` rounded half away from
    zero), ``sageattention/triton/attn_qk_int8_per_block.py`` ``_attn_fwd_inner`` (S =
    ``fl(float(int32 dot) fl(q_scale k_scale))``; ``p = exp2(S - m)`` with a running max per
    64-key tile; l in fp32 from the unrounded p; P to fp16; each tile's PV accumulated in fp16,
    then added to the fp32 accumulator) and ``_attn_fwd`` (O = ``fl(acc / l)`` in the input
    dtype). See docs/quant-sources.md, "SageAttention, Triton".

    Widened: the quantisation's fp32 division within 2 ulps (Triton's lowering is open); the
    fp16-accumulating MMA modelled as ``mma_bits`` = 11 with truncation; ``tl.math.exp2`` as
    2 ulp with flush to zero. Assumed: the fp16 MMA keeps subnormal products and sums (gradual
    underflow, as Fasi, Higham, Mikaitis and Pranesh, "Numerical behavior of NVIDIA tensor
    cores", PeerJ CS 2021, measured on V100, T4 and A100; not measured on Ada or Hopper).
    Causal is top-left aligned in SageAttention: emulated only for
    Q == K (where it equals the lower-right mask). A block of zeros (scale 0, 0/0 in the kernel)
    is refused.

    kv tiles (``tile_table="sageattention_triton"``): ``kv_tile=None`` is ``BLOCK_N = 64`` of
    ``sageattention/triton/attn_qk_int8_per_block.py`` ``forward`` (commit d1a57a546c3d) at
    every head dim the Triton path takes (``core.py`` pads to 64 or 128, refuses > 128),
    visited from the first (``_attn_fwd_inner``: ``range(lo, hi, BLOCK_N)``). The CUDA
    kernels (``csrc/qattn``, ``CTA_K = 64``) are not emulated.

    Examples
    --------
    >>> spec = sageattention_int8()
    >>> spec.q.block, spec.k.block, spec.pv_accumulation, spec.kv_tile, spec.tile_table
    (128, 64, 'fp16_per_tile', None, 'sageattention_triton')
    """
    fmt = _choice("dtype", dtype, ("fp16", "bf16"))
    q = TensorQuant("int8", None, "token_block", "half_away_from_zero", "cast", block=128,
                    input_format=fmt)
    k = TensorQuant("int8", None, "token_block", "half_away_from_zero", "cast", block=64,
                    input_format=fmt)
    v = TensorQuant("fp16", _arr(1.0), "tensor", "nearest_even", "cast", input_format=fmt)
    return QuantSpec(q=q, k=k, v=v, s_accumulation="int32", p_format="fp16",
                     p_rounding="nearest_even", p_handling="offset", p_offset=0.0,
                     l_from="unrounded", pv_accumulation="fp16_per_tile", output_format=fmt,
                     output_post_scale="in_kernel", k_smoothing=True, q_prescale=True,
                     exp2_ulp=2.0, name="sageattention_int8", s_descale="after_dot",
                     log2e=SAGE_LOG2E, kv_tile=kv_tile, kv_order="ascending",
                     mma_bits=mma_bits, mma_k=HALF_MMA_K, output_ulp=2.0, returns_lse=False,
                     masks=("none", "causal_equal_lengths"), gqa=True,
                     tile_table=_table(tile_table, "sageattention_triton"))


_BUILDERS: dict[str, Callable[..., QuantSpec]] = {
    "fa3_fp8": fa3_fp8,
    "flashinfer_sm90_fp8": flashinfer_sm90_fp8,
    "flashinfer_fp8_kv": flashinfer_fp8_kv,
    "vllm_fp8_kv": vllm_fp8_kv,
    "sageattention_int8": sageattention_int8,
}


@public
def preset(name: str, **scales_and_options: Any) -> QuantSpec:
    """The :class:`~refattn.quant.spec.QuantSpec` of a named kernel.

    Parameters
    ----------
    name : str
        One of :data:`PRESETS`.
    **scales_and_options
        The builder's keywords: ``fa3_fp8(q_descale, k_descale, v_descale, kv_tile,
        mma_bits, v_colmajor)``, ``flashinfer_sm90_fp8(q_scale, k_scale, v_scale, kv_format,
        kv_tile, mma_bits)``, ``flashinfer_fp8_kv(k_scale, v_scale, q_dtype, kv_format, kv_tile,
        mma_bits)``, ``vllm_fp8_kv(q_scale, k_scale, v_scale, dtype, kv_tile, mma_bits)``,
        ``sageattention_int8(dtype, kv_tile, mma_bits)``; each also takes ``tile_table``
        (None: the kernel's kv tile table, :mod:`refattn.quant.tiles`; ``""``: none, for a
        custom ``kv_tile``; or another table's name).

    Returns
    -------
    QuantSpec

    Raises
    ------
    RefAttnError
        An unknown preset or keyword.

    Examples
    --------
    >>> preset("fa3_fp8", v_descale=2.0).name
    'fa3_fp8'
    >>> preset("fa3_fp8", kv_tile=4, tile_table="").tile_table  # a custom tile: no table
    ''
    >>> preset("fa3_fp8", softcap=30.0)
    Traceback (most recent call last):
    ...
    refattn.errors.RefAttnError: preset 'fa3_fp8': unknown option 'softcap'
    """
    if name not in _BUILDERS:
        raise RefAttnError(f"preset: {name!r} is not one of {', '.join(PRESETS)}")
    builder = _BUILDERS[name]
    known = builder.__kwdefaults__ or {}
    for key in scales_and_options:
        if key not in known:
            raise RefAttnError(f"preset {name!r}: unknown option {key!r}")
    return builder(**scales_and_options)
