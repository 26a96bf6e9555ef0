"""QuantSpec / TensorQuant: the manifest round trip is exact, and a malformed spec is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from refattn import RefAttnError
from refattn.quant import PRESETS, QuantSpec, TensorQuant, preset
from refattn.quant.spec import SCHEMA

SAT = "nearest_even_satfinite"


def _presets_with_scales():
    f32 = float(np.float32(0.1))  # not a short decimal: the round trip must keep every bit
    return [
        preset("fa3_fp8"),
        preset("fa3_fp8", q_descale=np.array([[f32, 2.0**-20]]), k_descale=3.0, kv_tile=128),
        preset("flashinfer_sm90_fp8", q_scale=np.array([f32, 1.5]), kv_format="e5m2"),
        preset("flashinfer_fp8_kv", k_scale=f32, v_scale=0.25, q_dtype="bf16"),
        preset("vllm_fp8_kv", q_scale=f32, dtype="fp16"),
        preset("sageattention_int8", dtype="bf16", kv_tile=None),
    ]


@pytest.mark.parametrize("spec", _presets_with_scales(), ids=lambda s: s.name)
def test_manifest_round_trip_is_exact_through_json(spec):
    text = json.dumps(spec.to_manifest(), allow_nan=False)
    back = QuantSpec.from_manifest(json.loads(text))
    assert back == spec
    assert back.to_manifest() == spec.to_manifest()
    for name in ("q", "k", "v"):
        a, b = getattr(spec, name).scale, getattr(back, name).scale
        if a is None:
            assert b is None
        else:  # bit for bit, shape included
            assert a.shape == b.shape and a.tobytes() == b.tobytes()


def test_every_preset_is_named_and_differs():
    specs = [preset(name) for name in PRESETS]
    assert [s.name for s in specs] == list(PRESETS)
    manifests = [json.dumps(s.to_manifest(), sort_keys=True) for s in specs]
    assert len(set(manifests)) == len(PRESETS)


def test_preset_facts_from_the_sources():
    fa3 = preset("fa3_fp8")
    assert (fa3.p_handling, fa3.p_offset, fa3.l_from, fa3.output_format) == (
        "offset", 8.0, "unrounded", "bf16")
    assert fa3.kv_order == "descending" and fa3.returns_lse
    fi = preset("flashinfer_sm90_fp8", kv_format="e5m2")
    assert (fi.p_handling, fi.p_multiplier, fi.p_offset) == ("multiplier", 57344.0, 0.0)
    kv = preset("flashinfer_fp8_kv")
    assert (kv.l_from, kv.output_post_scale, kv.p_format) == ("rounded", "after_kernel", "fp16")
    sage = preset("sageattention_int8")
    assert (sage.q.block, sage.k.block, sage.q.scale, sage.k.rounding) == (
        128, 64, None, "half_away_from_zero")
    assert sage.k_smoothing and sage.q_prescale and sage.log2e == 1.44269504
    vllm = preset("vllm_fp8_kv", k_scale=0.5)
    assert (vllm.k.source, vllm.k.rounding, float(vllm.k.scale)) == ("cast", SAT, 0.5)


def test_replace_validates_again():
    spec = preset("fa3_fp8")
    assert spec.replace(p_offset=0.0).p_offset == 0.0
    assert spec.replace(p_offset=0.0) != spec
    with pytest.raises(RefAttnError, match="p_handling"):
        spec.replace(p_handling="shift")


@pytest.mark.parametrize(("args", "match"), [
    (("e4m3", 1.0, "tensor", SAT, "codes"), "format"),
    (("e4m3fn", 1.0, "per_row", SAT, "codes"), "granularity"),
    (("e4m3fn", 1.0, "tensor", "nearest_even", "codes"), "rounding"),  # e4m3fn has no inf
    (("int8", 1.0, "tensor", "nearest_even_nan", "codes"), "rounding"),
    (("e4m3fn", 1.0, "tensor", SAT, "bytes"), "source"),
    (("e4m3fn", 1.0, "token_block", SAT, "codes"), "block"),
    (("e4m3fn", None, "tensor", SAT, "codes"), "scale: None"),
    (("e4m3fn", np.float32(1.0) * np.ones(2, np.float32), "tensor", SAT, "codes"), "float64"),
    (("e4m3fn", True, "tensor", SAT, "codes"), "scale"),
    (("e4m3fn", "1.0", "tensor", SAT, "codes"), "scale"),
])
def test_tensor_quant_refuses(args, match):
    with pytest.raises(RefAttnError, match=match):
        TensorQuant(*args)


def test_tensor_quant_refuses_input_format_on_codes_and_bad_blocks():
    with pytest.raises(RefAttnError, match="input_format"):
        TensorQuant("e4m3fn", 1.0, "tensor", SAT, "codes", input_format="bf16")
    with pytest.raises(RefAttnError, match="block"):
        TensorQuant("int8", None, "token_block", "half_away_from_zero", "cast", block=0)


def test_quant_spec_refuses_inconsistent_fields():
    tq = TensorQuant("e4m3fn", 1.0, "tensor", SAT, "codes")
    i8 = TensorQuant("int8", 1.0, "tensor", "half_away_from_zero", "codes")
    with pytest.raises(RefAttnError, match="int32"):
        QuantSpec(tq, tq, tq, s_accumulation="int32")
    with pytest.raises(RefAttnError, match="int32"):
        QuantSpec(i8, i8, tq, s_accumulation="fp32")
    with pytest.raises(RefAttnError, match="output"):
        QuantSpec(tq, tq, tq, output_format="e4m3fn")
    with pytest.raises(RefAttnError, match="kv_tile"):
        QuantSpec(tq, tq, tq, kv_tile=0)
    with pytest.raises(RefAttnError, match="mma_bits"):
        QuantSpec(tq, tq, tq, mma_bits=1)
    with pytest.raises(RefAttnError, match="masks"):
        QuantSpec(tq, tq, tq, masks=("sliding",))
    with pytest.raises(RefAttnError, match="exp2_ulp"):
        QuantSpec(tq, tq, tq, exp2_ulp=float("nan"))
    with pytest.raises(RefAttnError, match="q:"):
        QuantSpec("q", tq, tq)  # type: ignore[arg-type]


def test_from_manifest_refuses_tampered_records():
    m = preset("fa3_fp8").to_manifest()
    with pytest.raises(RefAttnError, match="schema"):
        QuantSpec.from_manifest({**m, "schema": "other"})
    with pytest.raises(RefAttnError, match="keys"):
        QuantSpec.from_manifest({**m, "extra": 1})
    with pytest.raises(RefAttnError, match=r"float\.hex"):
        QuantSpec.from_manifest({**m, "p_offset": 8.0})
    bad_scale = json.loads(json.dumps(m))
    bad_scale["q"]["scale"] = {"shape": [2], "values": ["0x1p0"]}
    with pytest.raises(RefAttnError, match="values"):
        QuantSpec.from_manifest(bad_scale)
    assert m["schema"] == SCHEMA


def test_preset_refuses_unknown_names_options_and_shapes():
    with pytest.raises(RefAttnError, match="not one of"):
        preset("fa4_fp8")
    with pytest.raises(RefAttnError, match="unknown option 'dropout'"):
        preset("sageattention_int8", dropout=0.1)
    with pytest.raises(RefAttnError, match="q_descale"):
        preset("fa3_fp8", q_descale=np.ones(3))  # FA3's descales are (B, Hkv)
    with pytest.raises(RefAttnError, match="kv_format"):
        preset("flashinfer_sm90_fp8", kv_format="int8")
