"""Issue 28 item 5: a bad scale, a tensor off its format's grid, or a feature the kernel does
not define is a RefAttnError naming it (from check_quant and from quantized)."""

from __future__ import annotations

import numpy as np
import pytest

from refattn import AttentionCall, RefAttnError
from refattn.dropout import Philox
from refattn.masks import causal
from refattn.quant import check_quant, preset, quantized
from refattn.quant.formats import quantize

B, Hq, Hkv, Q, K, D = 2, 4, 2, 3, 5, 8


def _codes(shape, seed):
    rng = np.random.default_rng(seed)
    return quantize(rng.standard_normal(shape), "e4m3fn", "nearest_even_satfinite")


def _qkv():
    return _codes((B, Hq, Q, D), 0), _codes((B, Hkv, K, D), 1), _codes((B, Hkv, K, D), 2)


def _refused(call, spec, *fragments):
    for fn in (check_quant, quantized):
        with pytest.raises(RefAttnError) as info:
            fn(call, spec)
        for fragment in fragments:
            assert fragment in str(info.value), (fragment, str(info.value))


@pytest.mark.parametrize("tensor", ["q", "k", "v"])
@pytest.mark.parametrize(("value", "what"), [
    (0.0, "zero"), (-0.5, "negative"), (np.nan, "NaN"), (np.inf, "infinite"),
    (0.1, "not a float32 value"), (2.0**-130, "smallest normal"),
])
def test_bad_scale_values_name_tensor_and_index(tensor, value, what):
    d = np.ones((B, Hkv))
    d[1, 0] = value
    spec = preset("fa3_fp8", **{f"{tensor}_descale": d})
    _refused(AttentionCall(*_qkv()), spec, f"fa3_fp8: {tensor}.scale", what, "(1, 0)")


@pytest.mark.parametrize("shape", [(B + 1, Hkv), (B, Hq), (1, 1)])
def test_wrong_scale_shape(shape):
    spec = preset("fa3_fp8", k_descale=np.ones(shape))
    _refused(AttentionCall(*_qkv()), spec, "k.scale: expected shape [2, 2]", f"got {list(shape)}")


def test_a_one_dimensional_fa3_descale_is_refused_by_the_preset():
    with pytest.raises(RefAttnError, match="k_descale"):
        preset("fa3_fp8", k_descale=np.ones(B))


def test_flashinfer_scales_are_per_head_without_batch():
    q, k, v = _qkv()
    ok = preset("flashinfer_sm90_fp8", q_scale=np.ones(Hq), k_scale=np.ones(Hkv),
                kv_tile=128)  # the kernel has no head dim D: its tile is asked for
    check_quant(AttentionCall(q, k, v), ok)
    bad = preset("flashinfer_sm90_fp8", q_scale=np.ones(Hkv))
    _refused(AttentionCall(q, k, v), bad, "q.scale: expected shape [4]")


@pytest.mark.parametrize("tensor", ["q", "k", "v"])
def test_a_tensor_off_its_format_grid(tensor):
    arrays = dict(zip("qkv", _qkv(), strict=True))
    arrays[tensor] = arrays[tensor].copy()
    arrays[tensor][1, 1, 2, 3] = 0.3  # between the e4m3fn values 0.28125 and 0.3125
    _refused(AttentionCall(arrays["q"], arrays["k"], arrays["v"]), preset("fa3_fp8"),
             f"{tensor}: value 0.3 at index (1, 1, 2, 3)", "e4m3fn")


def test_a_cast_tensor_off_its_input_format():
    q, k, v = _qkv()
    k = k.copy()
    k[0, 1, 0, 0] = 1 + 2.0**-10  # an fp16 value, not a bf16 one
    _refused(AttentionCall(q, k, v), preset("vllm_fp8_kv"), "k: value", "(0, 1, 0, 0)", "bf16")


@pytest.mark.parametrize(("feature", "kwargs"), [
    ("dropout", {"dropout": Philox(0.1, seed=0)}),
    ("bias", {"bias": np.zeros((B, Hq, Q, K))}),
    ("softcap", {"softcap": 30.0}),
    ("sink", {"sink": np.zeros(Hq)}),
    ("query_valid", {"query_valid": np.ones((B, 1, Q, 1), bool)}),
    ("scale_placement", {"scale_placement": "q"}),
])
@pytest.mark.parametrize("name", ["fa3_fp8", "sageattention_int8"])
def test_a_feature_the_kernel_does_not_define(feature, kwargs, name):
    q, k, v = (quantize(x, "fp16", "nearest_even") for x in _qkv())
    call = AttentionCall(q, k, v, **kwargs)
    _refused(call, preset(name), f"{name}: {feature}")


def test_masks_other_than_the_kernels():
    q, k, v = _qkv()
    window = np.tril(np.ones((Q, K), bool), K - Q) & np.triu(np.ones((Q, K), bool), -1)
    _refused(AttentionCall(q, k, v, visible=window), preset("fa3_fp8"), "visible", "causal")
    upper_left = causal(Q, K, alignment="upper_left")
    _refused(AttentionCall(q, k, v, visible=upper_left), preset("fa3_fp8"), "visible")
    check_quant(AttentionCall(q, k, v, visible=causal(Q, K, alignment="lower_right")),
                preset("fa3_fp8"))
    # SageAttention's causal mask is top-left: emulated only where Q == K
    q16, k16, v16 = (quantize(x, "fp16", "nearest_even") for x in (q, k, v))
    _refused(AttentionCall(q16, k16, v16, visible=causal(Q, K, alignment="lower_right")),
             preset("sageattention_int8"), "top-left", "Q=3, K=5")


def test_a_head_map_other_than_grouped():
    q, k, v = _qkv()
    call = AttentionCall(q, k, v, head_map=np.array([0, 1, 0, 1]))
    _refused(call, preset("fa3_fp8"), "head_map", "[0, 1, 0, 1]")


def test_sage_block_of_zeros_is_refused_by_name():
    q, k, v = (quantize(x, "fp16", "nearest_even") for x in _qkv())
    q = q.copy()
    q[1, 2] = 0.0  # the whole 128-token block of batch 1, head 2
    with pytest.raises(RefAttnError, match=r"q: block 0 .* batch 1, head 2"):
        quantized(AttentionCall(q, k, v), preset("sageattention_int8"))


def test_wrong_types():
    q, k, v = _qkv()
    with pytest.raises(RefAttnError, match="spec: expected a QuantSpec"):
        check_quant(AttentionCall(q, k, v), "fa3_fp8")  # type: ignore[arg-type]
    with pytest.raises(RefAttnError, match="call: expected an AttentionCall"):
        check_quant((q, k, v), preset("fa3_fp8"))  # type: ignore[arg-type]
