"""The named kernels' kv tile tables (refattn.quant.tiles) against the values in their sources.

Every expected number below was read from the file named beside it (docs/quant-sources.md,
"Kernel tiles"); a change of the table is a change of this file with its new source.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from refattn import AttentionCall, RefAttnError
from refattn.quant import QuantSpec, check_quant, preset
from refattn.quant.spec import SCHEMA, SCHEMA_V1
from refattn.quant.tiles import (
    TILE_TABLES,
    effective_kv_tile,
    kernel_tiles,
    resolve_kv_tile,
    tile_table,
)


def _call(d: int, dv: int | None = None, *, k: int = 5) -> AttentionCall:
    """q (1, 2, 3, d), k (1, 2, k, d), v (1, 2, k, dv): 0.5 everywhere (on every grid)."""
    q = np.full((1, 2, 3, d), 0.5)
    kk = np.full((1, 2, k, d), 0.5)
    v = np.full((1, 2, k, d if dv is None else dv), 0.5)
    return AttentionCall(q, kk, v)


# -- the rows, as read ------------------------------------------------------------------------
# Dao-AILab/flash-attention@0251105a2fb1 hopper/tile_size.h tile_size_fwd_sm90, element_size 1:
#   hdim <= 64: 160; <= 96: 128; <= 128: paged_kv_non_TMA ? 160 : (v_colmajor || (softcap &&
#   is_local) ? 192 : 224); <= 192: (paged_kv_non_TMA || softcap) && is_local ? 128 : 160;
#   else is_local ? 64 : 128. mha_fwd's dense call: v_colmajor false (VCOLMAJOR_SWITCH is off
#   without FLASHATTENTION_ENABLE_VCOLMAJOR), paged_kv_non_TMA false, is_local and softcap
#   refused by the preset. Head dims: run_mha_fwd_constexpr (e4m3: 64, 96, 128, 192 (with
#   dv <= 128: <192, 128>), 256).
FA3 = [(1, 160), (32, 160), (64, 160), (65, 128), (96, 128), (97, 224), (128, 224),
       (129, 160), (192, 160), (193, 128), (256, 128)]


@pytest.mark.parametrize(("d", "tile"), FA3)
def test_fa3_fp8_kblockn_by_head_dim(d, tile):
    rule = kernel_tiles("fa3_fp8", d)
    assert rule.tiles == (tile,) and rule.tile == tile and not rule.ambiguous
    assert rule.order == "descending"
    assert "hopper/tile_size.h tile_size_fwd_sm90" in rule.source and "0251105a2fb1" in rule.source
    colmajor = kernel_tiles("fa3_fp8_v_colmajor", d).tile  # v_colmajor: 192 at hdim <= 128 only
    assert colmajor == (192 if 97 <= d <= 128 else tile)


def test_fa3_head_dim_v_rows():
    # flash_api.cpp mha_fwd: dv != d only for d in (128, 192] with dv in (96, 128] (FP8 too:
    # run_mha_fwd_constexpr's <192, 128> instantiation), or d <= 64 (but e4m3 instantiates
    # <64, 64> only); the FP8 branch of tile_size_fwd_sm90 does not read headdim_v
    assert kernel_tiles("fa3_fp8", 192, 128).tiles == (160,)
    assert kernel_tiles("fa3_fp8", 160, 97).tiles == (160,)
    for d, dv in ((192, 96), (128, 64), (64, 128), (256, 128)):
        assert kernel_tiles("fa3_fp8", d, dv).tiles == ()
    assert kernel_tiles("fa3_fp8", 257).tiles == ()  # FA3 has no head dim above 256


# vllm-project/flash-attention@2adfc8c2177c (vllm-project/vllm@3a7b2806
# cmake/external_projects/vllm_flash_attn.cmake GIT_TAG) hopper/tile_size.h, element_size 1:
#   hdim <= 64: use_one_mma_wg ? 128 : 160; <= 96: 128; <= 128: use_one_mma_wg ? 96 :
#   (paged_kv_non_TMA ? 160 : (v_colmajor || (softcap && is_local) ? 192 : 224)); <= 192: 160;
#   else 128. hopper/heuristics.h use_one_mma_wg: d == 128 || d == 64, !is_local, seqlen_q *
#   (h / h_k) <= 64. vLLM always reads a paged cache: get_pagedkv_tma decides 160 / 224.
VLLM = [(32, (160,)), (63, (160,)), (64, (128, 160)), (80, (128,)), (96, (128,)),
        (112, (160, 224)), (127, (160, 224)), (128, (96, 160, 224)), (160, (160,)),
        (192, (160,)), (256, (128,))]


@pytest.mark.parametrize(("d", "tiles"), VLLM)
def test_vllm_fork_tiles_by_head_dim(d, tiles):
    rule = kernel_tiles("vllm_fa3_fp8", d)
    assert rule.tiles == tiles and rule.order == "descending"
    assert rule.ambiguous == (len(tiles) > 1)
    if rule.ambiguous:
        assert "seqlen_q" in rule.when or "page_size" in rule.when


# flashinfer-ai/flashinfer@fb28d7242b35 include/flashinfer/attention/hopper/quantization/
# prefill_sm90.cuh: SingleFP8PrefillWithKVCacheDispatched CTA_KV_ 128 (hdim 64), 192 (128),
# 128 (256); BatchFP8PrefillWithPagedKVCacheDispatched 128, 128, 64; static_assert(HEAD_DIM ==
# 64 || 128 || 256); kv tiles walked from kv_tile_idx_count - 1 down (mainloop_mma.cuh).
@pytest.mark.parametrize(("d", "single", "paged"), [(64, 128, 128), (128, 192, 128),
                                                    (256, 128, 64)])
def test_flashinfer_sm90_ctakv(d, single, paged):
    assert kernel_tiles("flashinfer_sm90_fp8", d).tiles == (single,)
    assert kernel_tiles("flashinfer_sm90_fp8_paged", d).tiles == (paged,)
    assert kernel_tiles("flashinfer_sm90_fp8", d).order == "descending"


@pytest.mark.parametrize("d", [8, 32, 96, 192, 512])
def test_flashinfer_sm90_has_no_other_head_dim(d):
    rule = kernel_tiles("flashinfer_sm90_fp8", d)
    assert rule.tiles == () and rule.ambiguous and rule.tile is None
    assert "64, 128 and 256" in rule.when
    assert kernel_tiles("flashinfer_sm90_fp8", 128, 64).tiles == ()  # v's head dim equal


# flashinfer-ai/flashinfer@fb28d7242b35 include/flashinfer/attention/prefill.cuh
# SinglePrefillWithKVCacheDispatched: CTA_TILE_KV = NUM_MMA_KV * NUM_WARPS_KV * 16 with
# NUM_MMA_KV from DISPATCH_NUM_MMA_KV(min(shared-memory bound, 8 / NUM_MMA_Q)) in {8, 4, 2, 1},
# even for an FP8 cache with NUM_WARPS_Q = 4 (KernelTraits::IsInvalid), NUM_WARPS_KV = 1 for
# CTA_TILE_Q 64 / 128 (FA2DetermineCtaTileQ, from the packed query rows): 32, 64 or 128.
@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_flashinfer_fa2_is_ambiguous(d):
    rule = kernel_tiles("flashinfer_fa2", d)
    assert rule.tiles == (32, 64, 128) and rule.ambiguous and rule.order == "ascending"
    assert "shared memory" in rule.when and "query rows" in rule.when


# thu-ml/SageAttention@d1a57a546c3d sageattention/triton/attn_qk_int8_per_block.py forward:
# BLOCK_M = 128, BLOCK_N = 64; _attn_fwd_inner: for start_n in range(lo, hi, BLOCK_N);
# sageattention/core.py sageattn_qk_int8_pv_fp16_triton pads head dims to 64 or 128, raises
# above 128.
@pytest.mark.parametrize("d", [8, 64, 100, 128])
def test_sageattention_triton_block_n(d):
    rule = kernel_tiles("sageattention_triton", d)
    assert rule.tiles == (64,) and rule.order == "ascending"
    assert kernel_tiles("sageattention_triton", 129).tiles == ()


def test_every_table_is_named_and_cited():
    assert set(TILE_TABLES) == {"fa3_fp8", "fa3_fp8_v_colmajor", "vllm_fa3_fp8",
                                "flashinfer_sm90_fp8", "flashinfer_sm90_fp8_paged",
                                "flashinfer_fa2", "sageattention_triton"}
    for name in TILE_TABLES:
        t = tile_table(name)
        assert t.name == name and t.order in ("ascending", "descending")
        assert "@" in t.source and "/" in t.source  # repository@commit and a file
        for row in t.rows:
            assert row.lo <= row.hi and row.tiles and all(x >= 1 for x in row.tiles)
            assert (len(row.tiles) > 1) == bool(row.when)


def test_kernel_tiles_refuses_bad_input():
    with pytest.raises(RefAttnError, match="tile_table: 'fa4' is not one of"):
        kernel_tiles("fa4", 64)
    with pytest.raises(RefAttnError, match="head_dim: 0 is outside"):
        kernel_tiles("fa3_fp8", 0)
    with pytest.raises(RefAttnError, match="head_dim"):
        kernel_tiles("fa3_fp8", True)
    with pytest.raises(RefAttnError, match="head_dim_v: -1 is outside"):
        kernel_tiles("fa3_fp8", 64, -1)


# -- the presets default to their kernel's tile -----------------------------------------------
def test_presets_name_their_tables():
    assert [preset(n).tile_table for n in ("fa3_fp8", "flashinfer_sm90_fp8",
                                           "flashinfer_fp8_kv", "vllm_fp8_kv",
                                           "sageattention_int8")] == [
        "fa3_fp8", "flashinfer_sm90_fp8", "flashinfer_fa2", "vllm_fa3_fp8",
        "sageattention_triton"]
    assert preset("fa3_fp8", v_colmajor=True).tile_table == "fa3_fp8_v_colmajor"
    assert all(preset(n).kv_tile is None for n in ("fa3_fp8", "sageattention_int8"))
    with pytest.raises(RefAttnError, match="v_colmajor: expected a bool, got 1"):
        preset("fa3_fp8", v_colmajor=1)
    with pytest.raises(RefAttnError, match="tile_table: 'fa4' is not one of"):
        preset("vllm_fp8_kv", tile_table="fa4")


@pytest.mark.parametrize(("spec", "d", "tile"), [
    (preset("fa3_fp8"), 64, 160), (preset("fa3_fp8"), 128, 224),
    (preset("fa3_fp8", v_colmajor=True), 128, 192), (preset("fa3_fp8"), 256, 128),
    (preset("vllm_fp8_kv"), 96, 128), (preset("vllm_fp8_kv"), 192, 160),
    (preset("flashinfer_sm90_fp8"), 128, 192), (preset("sageattention_int8"), 64, 64),
    (preset("sageattention_int8", kv_tile=64), 8, 64), (preset("flashinfer_fp8_kv", kv_tile=64),
                                                       128, 64),
    (preset("fa3_fp8", kv_tile=8).replace(tile_table=""), 128, 8),
    (preset("fa3_fp8", kv_tile=8, tile_table=""), 64, 8),
    (preset("sageattention_int8", kv_tile=3, tile_table=""), 64, 3),
    (preset("flashinfer_sm90_fp8", tile_table="flashinfer_sm90_fp8_paged"), 256, 64),
    (preset("fa3_fp8").replace(tile_table=""), 128, None),
])
def test_the_effective_tile_follows_the_table(spec, d, tile):
    call = _call(d)
    check_quant(call, spec)
    assert effective_kv_tile(spec, call) == tile


def test_an_ambiguous_tile_is_asked_for_with_the_candidates_and_the_source():
    with pytest.raises(RefAttnError) as info:
        check_quant(_call(128), preset("flashinfer_fp8_kv"))
    text = str(info.value)
    assert text.startswith("flashinfer_fp8_kv: kv_tile: None is ambiguous in FlashInfer's FA2")
    assert "kv tiles 32, 64, 128" in text and "pass kv_tile=one of 32, 64, 128" in text
    assert "prefill.cuh SinglePrefillWithKVCacheDispatched" in text
    with pytest.raises(RefAttnError, match=r"vllm_fp8_kv: kv_tile: None is ambiguous .* kv tiles "
                                           r"96, 160, 224 \(96 when max_seqlen_q"):
        check_quant(_call(128), preset("vllm_fp8_kv"))
    with pytest.raises(RefAttnError, match=r"flashinfer_sm90_fp8: kv_tile: None, but FlashInfer's "
                                           r"SM90 FP8 prefill .* has no row for head dim 8"):
        check_quant(_call(8), preset("flashinfer_sm90_fp8"))
    with pytest.raises(RefAttnError, match="ambiguous"):
        effective_kv_tile(preset("flashinfer_fp8_kv"), _call(64))
    with pytest.raises(RefAttnError, match="spec: expected a QuantSpec, got dict"):
        effective_kv_tile({}, _call(64))
    with pytest.raises(RefAttnError, match="call: expected an AttentionCall, got str"):
        effective_kv_tile(preset("fa3_fp8"), "call")


def test_a_tile_that_contradicts_the_table_is_refused_by_name():
    with pytest.raises(RefAttnError) as info:
        check_quant(_call(128), preset("fa3_fp8", kv_tile=128))
    text = str(info.value)
    assert text.startswith("fa3_fp8: kv_tile: 128 contradicts FlashAttention-3's FP8 forward's "
                           "table (kv tile 224 at head dim 128; Dao-AILab/flash-attention@")
    assert text.endswith("pass tile_table='' for a custom tile")
    with pytest.raises(RefAttnError, match=r"kv_tile: 48 contradicts .*\(kv tiles 32, 64, 128"):
        check_quant(_call(64), preset("flashinfer_fp8_kv", kv_tile=48))
    with pytest.raises(RefAttnError, match=r"kv_tile: 224 contradicts .*kv tile 192 at head dim "
                                           r"128"):
        check_quant(_call(128), preset("fa3_fp8", kv_tile=224, v_colmajor=True))
    with pytest.raises(RefAttnError, match=r"sageattention_int8: kv_tile: 128 contradicts"):
        check_quant(_call(64), preset("sageattention_int8", kv_tile=128))
    with pytest.raises(RefAttnError, match=r"kv_tile: 128 contradicts .*\(kv tile 160 at head "
                                           r"dim 192, head_dim_v 128;"):
        check_quant(_call(192, 128), preset("fa3_fp8", kv_tile=128))
    check_quant(_call(192, 128), preset("fa3_fp8", kv_tile=160))
    # a head dim the kernel lacks has nothing to contradict: the tile given is the tile used
    check_quant(_call(8), preset("flashinfer_sm90_fp8", kv_tile=96))


def test_an_order_that_contradicts_the_table_is_refused():
    spec = preset("fa3_fp8").replace(kv_order="ascending")
    with pytest.raises(RefAttnError, match=r"fa3_fp8: kv_order: 'ascending' contradicts "
                                           r"FlashAttention-3's FP8 forward's table \(tiles "
                                           r"visited descending;"):
        check_quant(_call(64), spec)
    check_quant(_call(64), spec.replace(tile_table=""))


def test_resolve_kv_tile_without_a_table_is_the_spec_as_given():
    assert resolve_kv_tile("", None, "descending", 128, 128) is None
    assert resolve_kv_tile("", 7, "ascending", 128, 128) == 7


# -- the manifest --------------------------------------------------------------------------------
@pytest.mark.parametrize("table", ["", *TILE_TABLES])
def test_tile_table_round_trips_through_the_manifest(table):
    spec = preset("fa3_fp8").replace(tile_table=table)
    m = json.loads(json.dumps(spec.to_manifest()))
    assert m["schema"] == SCHEMA == "refattn_quant_spec_v2" and m["tile_table"] == table
    back = QuantSpec.from_manifest(m)
    assert back == spec and back.tile_table == table


def test_a_bad_tile_table_is_refused():
    with pytest.raises(RefAttnError, match="tile_table: 'fa4' is not one of fa3_fp8"):
        preset("fa3_fp8").replace(tile_table="fa4")
    with pytest.raises(RefAttnError, match="tile_table: expected a string, got None"):
        preset("fa3_fp8").replace(tile_table=None)
    m = preset("fa3_fp8").to_manifest()
    for bad in ("fa4", None, 3, ["fa3_fp8"]):
        with pytest.raises(RefAttnError, match=r"quant\.tile_table: .* is not one of"):
            QuantSpec.from_manifest({**m, "tile_table": bad})
    with pytest.raises(RefAttnError, match="quant: expected schema 'refattn_quant_spec_v2'"):
        QuantSpec.from_manifest({k: v for k, v in m.items() if k != "tile_table"})


def test_a_v1_manifest_is_read_without_a_table():
    m = preset("fa3_fp8", kv_tile=4).to_manifest()
    v2_only = ("tile_table", "mma_k")  # the fields v2 added
    v1 = {**{k: v for k, v in m.items() if k not in v2_only}, "schema": SCHEMA_V1}
    spec = QuantSpec.from_manifest(v1)  # v1's kv_tile (None: one tile) is a custom tile
    assert spec.tile_table == "" and spec.kv_tile == 4
    assert spec.to_manifest()["schema"] == SCHEMA  # written back as v2, with tile_table ""
    with pytest.raises(RefAttnError, match="quant: expected schema"):
        QuantSpec.from_manifest({**v1, "tile_table": "fa3_fp8"})  # v1 has no tile_table
