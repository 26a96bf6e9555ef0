"""The pessimistic bound (gpu_backend.model_bounds) on planted inputs whose figures are worked
out by hand here: occupancy from registers and shared memory, a lone warp's phases summed, two
warps overlapping, a dependent DMMA chain, the L2 bound, and the forward+backward composition.
The bound on every compiled instance is checked in test_compile_check.py (it needs nvcc)."""

from __future__ import annotations

import random

import pytest

from gpu_backend import model_bounds, perf_model
from gpu_backend.model_bounds import PessimisticInput, occupancy, pessimistic_cycles
from gpu_backend.perf_model import HARDWARE, TileCounts, tile_cycles
from refattn.errors import RefAttnError

# -- occupancy ---------------------------------------------------------------------------------


def test_the_kernels_shapes_of_occupancy_on_sm_90():
    """254 registers round up to 256: 256 x 32 = 8192 of an SMSP's 16384: 2 warps per SMSP.
    160 KiB + 1 KiB of shared memory fits once in 228 KiB (233472 B): 1 block of 4 warps,
    1 warp per SMSP; 96 KiB + 1 KiB fits twice (198656 <= 233472 < 297984)."""
    o = occupancy(254, 163840, 128, "sm_90")
    assert (o.blocks_per_sm, o.warps_per_smsp, o.limited_by) == (1, 1.0, "shared")
    o = occupancy(254, 98304, 128, "sm_90")
    assert (o.blocks_per_sm, o.warps_per_smsp) == (2, 2.0)
    # the same block on sm_80 (164 KiB = 167936 B): 99328 fits once
    o = occupancy(254, 98304, 128, "sm_80")
    assert (o.blocks_per_sm, o.warps_per_smsp, o.limited_by) == (1, 1.0, "shared")


def test_registers_are_allocated_in_eights():
    """168 registers: 168 x 32 = 5376 per warp, 16384 // 5376 = 3 warps per SMSP; 169 rounds
    to 176: 5632 per warp, 2 warps. 64 registers: 2048 per warp, 8 warps per SMSP, so 8
    blocks of 4 warps (the 64-warp limit would allow 16): registers bind."""
    assert occupancy(168, 0).warps_per_smsp == 3.0
    assert occupancy(169, 0).warps_per_smsp == 2.0
    o = occupancy(64, 0)
    assert (o.blocks_per_sm, o.limited_by) == (8, "registers")
    # 32 registers: 16 warps per SMSP by registers; 64 warps per SM / 4 = 16 blocks by warps
    o = occupancy(32, 0)
    assert o.blocks_per_sm == 16 and o.warps_per_smsp == 16.0
    # a block of 256 threads (8 warps, 2 per SMSP) at 254 registers: 2 // 2 = 1 block
    assert occupancy(254, 0, 256).blocks_per_sm == 1


@pytest.mark.parametrize(("args", "match"), [
    ((256, 0), "registers per thread 256"), ((0, 0), "registers per thread 0"),
    ((64, -1), "shared memory per block -1"), ((64, 0, 100), "threads per block 100"),
    ((64, 0, 128, "sm_70"), "unknown architecture 'sm_70'"),
    ((64, 240000), "does not fit an SM")])
def test_bad_occupancy_inputs_are_refused(args, match):
    with pytest.raises(RefAttnError, match=match):
        occupancy(*args)


# -- the bound on planted inputs ---------------------------------------------------------------

# one warp's iteration: 1024 DMMA cycles (64 DMMA), 256 vector fp64 cycles, 2100 instructions
# of which 500 copy and 128 LDS, 1200 shared cycles, 2 barriers, chains of 16, no L2 traffic
PLANT = dict(dmma_cycles=1024.0, vector_fp64_cycles=256.0, instructions=2100,
             copy_instructions=500, dmma_instructions=64, lds_instructions=128,
             shared_cycles=1200.0, barriers=2, dmma_chain=16, l2_bytes=0)


def test_one_warp_per_smsp_serializes_its_phases():
    """copy 500 + tensor max(1024, 16 x 64, 64 + 128) = 1024 + other max(2100 - 500 - 64 -
    128 = 1408, 256) = 1408 + barriers 2 x 50 + latency 150 = 3182 > every shared resource
    (issue 2100, fp64 1280, shared 1200): serial, 1024 / 3182."""
    m = pessimistic_cycles(PessimisticInput(**PLANT, warps_per_smsp=1.0), "sm_90")
    assert (m.copy, m.tensor, m.other, m.barrier, m.latency) == (500, 1024, 1408, 100, 150)
    assert m.serial == 3182 and m.cycles == 3182 and m.bound == "serial"
    assert m.throughput == 2100
    assert m.fraction_of_dmma_peak == pytest.approx(1024 / 3182)


def test_two_warps_per_smsp_overlap():
    """The same warp twice per SMSP: serial / 2 = 1591 < issue 2100: issue binds, 1024 / 2100;
    four warps: still issue. The optimistic bound (tile_cycles) of the same counts is 2100 as
    well: with enough warps the two bounds meet."""
    m = pessimistic_cycles(PessimisticInput(**PLANT, warps_per_smsp=2.0), "sm_90")
    assert m.cycles == 2100 and m.bound == "issue"
    assert m.fraction_of_dmma_peak == pytest.approx(1024 / 2100)
    assert pessimistic_cycles(PessimisticInput(**PLANT, warps_per_smsp=4.0)).cycles == 2100
    # a serial sum twice the throughput and two warps: exactly at the edge, serial / 2
    edge = dict(PLANT, instructions=1600, copy_instructions=0)
    m = pessimistic_cycles(PessimisticInput(**edge, warps_per_smsp=2.0), "sm_90")
    # serial = 0 + 1024 + (1600 - 64 - 128 = 1408) + 100 + 150 = 2682 -> 1341 < 1600 issue
    assert m.serial == 2682 and m.cycles == 1600


def test_a_dependent_dmma_chain_bounds_the_tensor_phase():
    """40 DMMAs into one accumulator at 64 cycles each: 2560 cycles, above the pipe's 1024:
    the tensor phase is the chain; serial = 500 + 2560 + 1408 + 100 + 150 = 4718."""
    m = pessimistic_cycles(PessimisticInput(**dict(PLANT, dmma_chain=40), warps_per_smsp=1.0))
    assert m.tensor == 40 * model_bounds.constant("dmma_latency_cycles", "sm_90") == 2560
    assert m.serial == 4718 and m.fraction_of_dmma_peak == pytest.approx(1024 / 4718)
    # a planted latency twice as long doubles the chain
    lat = model_bounds.CONSTANTS["dmma_latency_cycles"]["sm_90"]
    try:
        model_bounds.CONSTANTS["dmma_latency_cycles"]["sm_90"] = model_bounds.Constant(
            128, lat.unit, "planted", True)
        assert pessimistic_cycles(PessimisticInput(**dict(PLANT, dmma_chain=40),
                                                   warps_per_smsp=1.0)).tensor == 5120
    finally:
        model_bounds.CONSTANTS["dmma_latency_cycles"]["sm_90"] = lat


def test_l2_bandwidth_bounds_a_tile_that_streams_too_many_bytes():
    """16384 bytes per warp-iteration, 4 SMSPs sharing the SM's 21 B/clock: 16384 x 4 / 21 =
    3120.8 cycles > issue 2100 with two warps (serial / 2 = 1591): L2 binds."""
    m = pessimistic_cycles(PessimisticInput(**dict(PLANT, l2_bytes=16384), warps_per_smsp=2.0))
    assert m.bound == "l2" and m.l2_cycles == pytest.approx(16384 * 4 / 21.0)
    assert m.cycles == pytest.approx(16384 * 4 / 21.0)


def test_the_pessimistic_bound_never_exceeds_the_optimistic_one():
    """For random counts the pessimistic cycles are >= the optimistic ones (tile_cycles) on
    both architectures: its throughput part holds every resource the optimistic bound has."""
    rng = random.Random(43)
    for _ in range(300):
        arch = rng.choice(("sm_90", "sm_80"))
        hw = HARDWARE[arch]
        n_dmma = rng.randint(1, 300)
        fma = n_dmma * (512 if arch == "sm_90" else 256)
        vec = rng.randint(0, 800)
        instr = n_dmma + rng.randint(0, 4000)
        smem = rng.uniform(0, 1500)
        opt = tile_cycles(TileCounts(fma, n_dmma, vec, instr, smem, 8 * fma), hw)
        x = PessimisticInput(opt.dmma_cycles, opt.fp64_cycles - opt.dmma_cycles, instr,
                             rng.randint(0, instr - n_dmma), n_dmma, 0, opt.shared_cycles,
                             rng.randint(0, 6), rng.randint(0, 64), rng.randint(0, 40000),
                             float(rng.choice((1, 2, 3, 4))))
        pes = pessimistic_cycles(x, arch)
        assert pes.cycles >= opt.cycles - 1e-9
        assert pes.fraction_of_dmma_peak <= opt.fraction_of_dmma_peak + 1e-12


def test_bad_bound_inputs_are_refused():
    with pytest.raises(RefAttnError, match="warps per SMSP 0"):
        pessimistic_cycles(PessimisticInput(**PLANT, warps_per_smsp=0.0))
    with pytest.raises(RefAttnError, match="no constant 'nope'"):
        model_bounds.constant("nope", "sm_90")
    with pytest.raises(RefAttnError, match=r"dq fraction 1\.5"):
        model_bounds.composition(0.5, 1.5, 0.5)


# -- the composition ---------------------------------------------------------------------------


def test_forward_plus_backward_composition():
    """2 / 0.6 + 3 / 0.5 + 4 / 0.4 = 19.333 products at the peak; 6 useful: 0.3103 of the
    peak, / 0.85 = 0.3651 of DGEMM; equal fractions f give 6 / 9 f."""
    c = model_bounds.composition(0.6, 0.5, 0.4)
    assert c["time_products"] == pytest.approx(2 / 0.6 + 3 / 0.5 + 4 / 0.4)
    assert c["fraction_of_peak"] == pytest.approx(6 / 19.3333333, rel=1e-6)
    assert c["fraction_of_dgemm"] == pytest.approx(6 / 19.3333333 / 0.85, rel=1e-6)
    assert model_bounds.composition(0.57, 0.57, 0.57)["fraction_of_peak"] == pytest.approx(
        6 / 9 * 0.57)


def test_every_constant_names_its_source_and_whether_to_measure_it():
    for name, per in model_bounds.CONSTANTS.items():
        assert set(per) == set(model_bounds.LIMITS), name
        for arch, c in per.items():
            assert c.source and c.unit and c.value > 0, (name, arch)
    assert any("one warp per SMSP" in a for a in model_bounds.ASSUMPTIONS)
    assert any("two or more warps" in a for a in model_bounds.ASSUMPTIONS)


# -- the bounds in the SASS model --------------------------------------------------------------


def _check(main: dict, registers: int = 254, shared: int = 163840) -> dict:
    k = {"role": "forward", "registers": registers, "spill_bytes": 0, "shared_bytes": shared,
         "dmma_instructions": 64, "dmma": main["dmma"], "dfma": 40, "call_rel_noinc": 0,
         "main_loop": main}
    return {"smem_layout": "swizzle",
            "arches": {"sm_90": {"kernels": {"attention_forward_d128": k}}}}


MAIN = {"dmma": {"DMMA.16x8x4": 64}, "dmma_fma": 32768, "fp64_vector": 40, "dfma": 40,
        "instructions": 1600, "lds": {"LDS.64": 128}, "lds_bytes": 128 * 256, "sts_bytes": 0,
        "ldgsts_bytes": 16 * 512, "inner_loops": 0, "call_rel_noinc": 0, "ldgsts": 16,
        "copy_instructions": 528, "barriers": 2, "local_loads": 0, "local_stores": 0,
        "ldg_bytes": 0, "dmma_chain": 16}


def test_the_sass_model_gives_both_bounds_and_the_occupancy():
    """A made-up forward at D = 128 on sm_90 with 160 KiB of shared memory (1 warp per SMSP):
    DMMA 32768 / 32.04 = 1022.7 cycles; optimistic = max(fp64 1022.7 + 40 x 32 / 16.26 =
    1101.4, issue 1600, shared 4 x (128 LDS.64 x 2 + 8192 / 512 cp.async x 4) = 1280) =
    issue 1600; pessimistic =
    copy 528 + tensor 1024 (chain 16 x 64) + other max(1600 - 528 - 64 - 128 = 880, 78.7) +
    100 + 150 = 2682."""
    e = perf_model.sass_model(_check(MAIN), dims=(128,))["sm_90"]["forward"]["D=128"]
    assert e["bound"] == "issue" and e["cycles"] == 1600
    p = e["pessimistic"]
    assert p["warps_per_smsp"] == 1.0 and p["occupancy_limited_by"] == "shared"
    assert (p["copy"], p["tensor"], p["other"]) == (528, 1024, 880)
    assert p["serial"] == pytest.approx(2682) and p["bound"] == "serial"
    assert p["fraction_of_dmma_peak"] == pytest.approx(e["dmma_cycles"] / 2682)
    assert p["copies_sass"] == 16 and p["copies_source"] == perf_model.source_copies(
        "forward", 128) == 16
    assert not e["pessimistic_target_met"]
    # the same loop with half the shared memory: 2 blocks, 2 warps per SMSP: the serial sum
    # halves (1341) under issue (1600): both bounds 1600
    two = perf_model.sass_model(_check(MAIN, shared=98304), dims=(128,))["sm_90"]
    p2 = two["forward"]["D=128"]["pessimistic"]
    assert p2["warps_per_smsp"] == 2.0 and p2["cycles"] == 1600 and p2["bound"] == "issue"
