"""The performance model's arithmetic on hand-computed examples, the bank model on known
access patterns, and the JSON the command writes."""

from __future__ import annotations

import json

import pytest

from gpu_backend import banks, perf_model
from gpu_backend.perf_model import HARDWARE, Hardware, TileCounts, tile_cycles

# -- the bank model ----------------------------------------------------------------------------


def test_stride_64_doubles_puts_every_lane_in_one_bank_pair():
    """Row per lane, 64 doubles a row: 512 bytes apart = 128 words, bank 0 (and 1) for all;
    a half-warp phase holds 16 distinct words there: 16-way, twice."""
    addresses = [lane * 64 * 8 for lane in range(32)]
    assert banks.access_cycles(addresses, 8) == 2 * 16
    assert banks.pattern_cycles("row_per_lane", 64) == 32


def test_padding_by_four_doubles_makes_the_fragment_reads_conflict_free():
    # (row g, column t), stride 68: word 2 (68 g + t) -> bank 8 g + 2 t (+1), g, t < 4:
    # 16 distinct even banks per half-warp, each lane's pair distinct: one cycle per phase
    assert banks.pattern_cycles("row_read", 64, "stride=68") == 2
    assert banks.pattern_cycles("row_read", 64, "stride=64") == 8  # bank 2t: 4-way
    # the C-fragment-as-A read (row 2t, column g) at stride 68: bank 16 t + 2 g mod 32 repeats
    # for t and t + 2: 2-way, 4 cycles; tile.cuh's swizzle makes it 2
    assert banks.worst_cycles("col_read", 64, "stride=68") == 4
    assert banks.worst_cycles("col_read", 64, "swizzle") == 2


@pytest.mark.parametrize("D", [32, 64, 128, 256])
@pytest.mark.parametrize("pattern", ["row_read", "col_read", "col_read_t", "cp_async_16B"])
def test_the_swizzle_is_conflict_free_for_the_kernels_accesses(D, pattern):
    assert banks.worst_cycles(pattern, D, "swizzle") == banks.ideal_cycles(
        banks.PATTERNS[pattern].width)


def test_four_byte_and_sixteen_byte_accesses():
    assert banks.access_cycles([4 * lane for lane in range(32)], 4) == 1
    assert banks.access_cycles([16 * lane for lane in range(32)], 16) == 4
    # two lanes of a 32-lane phase on bank 0, different words: 2-way
    addresses = [4 * lane for lane in range(32)]
    addresses[1] = 128
    assert banks.access_cycles(addresses, 4) == 2
    # the same word read by every lane: a broadcast, one cycle
    assert banks.access_cycles([0] * 32, 4) == 1
    assert banks.access_cycles([None] * 31 + [0], 8) == 1  # one active lane, one phase


def test_bad_accesses_are_refused():
    with pytest.raises(ValueError, match="aligned"):
        banks.access_cycles([4] * 32, 8)
    with pytest.raises(ValueError, match="32 lanes"):
        banks.access_cycles([0] * 16, 8)
    with pytest.raises(ValueError, match="layout"):
        banks.tile_index("stride=32", 64, 0, 0)


def test_the_swizzle_matches_tile_cuh():
    """refattn_swz<D>(r, c) = r D + (c ^ (((r ^ (r >> 1)) & 3) << 2)), written out."""
    f = {0: 0, 1: 1, 2: 3, 3: 2, 4: 2, 5: 3, 6: 1, 7: 0}
    for r in range(16):
        for c in range(64):
            assert banks.tile_index("swizzle", 64, r, c) == r * 64 + (c ^ (4 * f[r % 8]))


# -- the tile arithmetic -----------------------------------------------------------------------


def test_the_hardware_rates_follow_from_the_peaks():
    h = HARDWARE["sm_90"]
    # 67e12 / 2 FLOP per FMA / (132 SMs x 1.98e9 clocks x 4 SMSPs) = 32.04
    assert h.dmma_fma_per_clock_smsp == pytest.approx(67e12 / 2 / (132 * 1.98e9 * 4))
    assert round(h.dmma_fma_per_clock_smsp, 2) == 32.04
    assert round(h.fp64_lanes_per_clock_smsp, 2) == 16.26


def test_a_hand_computed_tile():
    """A made-up GPU: 1 SM at 1 GHz, 64 GFLOP/s tensor = 8 FMA/clock/SMSP, 32 GFLOP/s vector
    = 4 lanes/clock/SMSP. 10 DMMA of 256 FMA: 2560 / 8 = 320 cycles; 5 vector instructions x
    32 lanes / 4 = 40; fp64 = 360. Shared: 30 cycles x 4 SMSPs = 120. Issue: 100. Bound fp64;
    DMMA busy 320 / 360 of the time; 1280 LDS bytes / 2560 FMA = 0.5."""
    hw = Hardware("made-up", "sm_80", sms=1, clock_ghz=1.0, fp64_tensor_tflops=0.064,
                  fp64_vector_tflops=0.032)
    m = tile_cycles(TileCounts(2560, 10, 5, 100, 30.0, 1280), hw)
    assert m.dmma_cycles == pytest.approx(320)
    assert m.fp64_cycles == pytest.approx(360)
    assert m.shared_cycles == pytest.approx(120)
    assert m.issue_cycles == pytest.approx(100)
    assert m.bound == "fp64" and m.cycles == pytest.approx(360)
    assert m.fraction_of_dmma_peak == pytest.approx(320 / 360)
    assert m.lds_bytes_per_dmma_fma == pytest.approx(0.5)
    # the same tile with 200 cycles of shared memory: 800 bound it
    s = tile_cycles(TileCounts(2560, 10, 5, 100, 200.0, 1280), hw)
    assert s.bound == "shared" and s.fraction_of_dmma_peak == pytest.approx(320 / 800)
    # and with 1000 instructions: issue-bound
    i = tile_cycles(TileCounts(2560, 10, 5, 1000, 30.0, 1280), hw)
    assert i.bound == "issue" and i.fraction_of_dmma_peak == pytest.approx(0.32)


def test_a_tile_without_dmma_has_no_fraction_and_no_bytes_per_fma():
    m = tile_cycles(TileCounts(0, 0, 100, 300, 50.0, 4096), HARDWARE["sm_90"])
    assert m.fraction_of_dmma_peak == 0.0 and m.lds_bytes_per_dmma_fma is None


def test_the_forward_design_counts():
    """Warp of 16 queries, 64 keys, D = 64 on sm_90: S and P.V are 2 x 16 x 64 x 64 FMA =
    131072, 256 m16n8k4; K and V fragments 2 x 64 x 64 doubles = 65536 bytes (0.5 per
    FMA); on sm_80 m8n8k4: twice the instructions."""
    c = perf_model.design_counts("forward", 64, HARDWARE["sm_90"])
    assert c.dmma_fma == 131072 and c.dmma_instructions == 256
    assert c.lds_bytes == 65536
    assert perf_model.design_counts("forward", 64, HARDWARE["sm_80"]).dmma_instructions == 512
    assert perf_model.design_counts("dkdv", 128, HARDWARE["sm_90"]).dmma_fma == 4 * 16 * 64 * 128


def test_the_sass_model_on_a_made_up_report():
    """A compile_check report by hand: a forward kernel whose main loop holds 64 m16n8k4
    (32768 FMA), 40 vector fp64, 600 instructions and 128 LDS.64 in the swizzled layout
    (2 cycles each = 256, x 4 SMSPs = 1024). sm_90: DMMA 32768 / 32.04 = 1022.7 cycles, fp64
    1022.7 + 40 x 32 / 16.26 = 1101.4 > 1024 shared > 600 issue: fp64-bound, 0.93."""
    main = {"dmma": {"DMMA.16x8x4": 64}, "dmma_fma": 32768, "fp64_vector": 40, "dfma": 40,
            "instructions": 600, "lds": {"LDS.64": 128}, "lds_bytes": 128 * 256,
            "sts_bytes": 0, "ldgsts_bytes": 0, "inner_loops": 0, "call_rel_noinc": 0}
    check = {"smem_layout": "swizzle", "arches": {"sm_90": {"kernels": {
        "attention_forward_d64": {"role": "forward", "registers": 200, "spill_bytes": 0,
                                  "dmma_instructions": 64, "dmma": main["dmma"], "dfma": 40,
                                  "call_rel_noinc": 0, "main_loop": main}}}}}
    m = perf_model.sass_model(check, dims=(64,))["sm_90"]["forward"]["D=64"]
    h = HARDWARE["sm_90"]
    dmma = 32768 / h.dmma_fma_per_clock_smsp
    fp64 = dmma + 40 * 32 / h.fp64_lanes_per_clock_smsp
    assert m["shared_cycles"] == 1024 and m["bound"] == "fp64"
    assert m["fraction_of_dmma_peak"] == pytest.approx(dmma / fp64)
    assert m["lds_bytes_per_dmma_fma"] == 1.0 and m["targets_met"]
    assert m["lds64_cycles"] == 2 and m["layout"] == "swizzle"
    # the same kernel with shared memory unswizzled (stride 64): 8 cycles per LDS.64,
    # 128 x 8 x 4 = 4096 shared cycles bound the tile: 1022.7 / 4096 < 0.5
    check["smem_layout"] = "stride=D"
    u = perf_model.sass_model(check, dims=(64,))["sm_90"]["forward"]["D=64"]
    assert u["shared_cycles"] == 4096 and u["bound"] == "shared"
    assert u["fraction_of_dmma_peak"] == pytest.approx(dmma / 4096) and not u["targets_met"]


def test_the_model_json_has_its_fields(tmp_path, capsys):
    out = tmp_path / "model.json"
    assert perf_model.main(["--no-sass", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "assumptions" in printed and "132 SMs" in printed and "1.98 GHz" in printed
    m = json.loads(out.read_text())
    assert set(m) == {"assumptions", "design", "backward_designs", "sass", "targets",
                      "targets_met"}
    assert m["sass"] is None
    for arch in ("sm_90", "sm_80"):
        for kind in ("forward", "dq", "dkdv", "fused_dkdvdq"):
            for D in (64, 128):
                e = m["design"][arch][kind][f"D={D}"]
                assert {"dmma_cycles", "shared_cycles", "issue_cycles", "cycles", "bound",
                        "fraction_of_dmma_peak", "lds_bytes_per_dmma_fma", "counts"} <= set(e)
                assert e["cycles"] == max(e["fp64_cycles"], e["shared_cycles"],
                                          e["issue_cycles"])
        for D in (64, 128):
            for L in (4096, 131072):
                d = m["backward_designs"][arch][f"D={D}"][f"L={L}"]
                s7, s5 = d["seven_products"], d["five_products"]
                f7 = s7["fraction_of_dmma_peak"]
                assert s7["time_units"] == pytest.approx(3 / f7["dq"] + 4 / f7["dkdv"])
                n = L // 64
                m_res = min(n, HARDWARE[arch].sms)
                assert s5["fixed_order_efficiency"] == pytest.approx(n / (n + m_res - 1))
    a = m["assumptions"]["hardware"]["sm_90"]
    assert (a["sms"], a["clock_ghz"], a["fp64_tensor_tflops"], a["fp64_vector_tflops"],
            a["smem_bytes_per_clock_sm"], a["schedulers"]) == (132, 1.98, 67.0, 34.0, 128, 4)
