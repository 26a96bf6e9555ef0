"""The pessimistic bound of the GPU performance model: occupancy, serial phases, barriers,
dependent DMMA chains, copy loops per trip and L2 bandwidth, beside the optimistic bound of
:func:`gpu_backend.perf_model.tile_cycles` (issue 43).

Owns the per-architecture occupancy limits (:data:`LIMITS`, :func:`occupancy`), the constants
the bound rests on with their sources and whether a lent GPU must measure them
(:data:`CONSTANTS`), the assumptions printed beside the table (:data:`ASSUMPTIONS`), the
arithmetic (:func:`pessimistic_cycles`) and the forward+backward composition under either bound
(:func:`composition`). :mod:`gpu_backend.perf_model` feeds it the SASS counts.

The arithmetic, per warp and per iteration of the main loop (cycles of one SM sub-partition,
SMSP), with ``w`` warps resident per SMSP (:func:`occupancy`):

- one warp alone runs its phases one after another (``serial``): the cp.async copies (the
  instructions of the blocks that issue them, one per clock), the tensor phase (S and P V:
  ``max(DMMA pipe cycles, longest accumulator chain x DMMA latency, DMMA + LDS issue)``: the
  fragment loads are issued between the DMMAs), the rest (softmax, masks, loop overhead:
  ``max(its instructions, its vector fp64 pipe cycles)``), ``barriers x`` :data:`CONSTANTS`
  ``barrier_cycles`` and a fixed exposed latency per iteration (the cp.async wait, the first
  fragment loads, the row-max shuffles);
- the resources the SMSP shares (``throughput``): the fp64 pipe (DMMA and vector fp64 add),
  issue (every instruction), shared memory and L2 (the SM's bandwidth shared by its 4 SMSPs);
- cycles = ``max(throughput, serial / w)``: with ``w >= 2`` warps (of different blocks: a block
  has one warp per SMSP) one warp's phase overlaps another's, perfectly (an assumption);
  with ``w = 1`` nothing overlaps and the serial sum is the time.

Fraction of the DMMA peak = DMMA pipe cycles / cycles, as the optimistic bound's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from refattn.errors import RefAttnError

__all__ = ["ASSUMPTIONS", "CONSTANTS", "LIMITS", "Constant", "Limits", "Occupancy",
           "PessimisticInput", "PessimisticModel", "composition", "occupancy",
           "pessimistic_cycles"]


@dataclass(frozen=True)
class Limits:
    """Per-SM resource limits of one architecture (CUDA C++ Programming Guide, "Technical
    Specifications per Compute Capability", compute capability 8.0 and 9.0)."""

    arch: str
    registers_per_sm: int = 65536
    shared_per_sm: int = 233472  # usable by blocks: 228 KiB (sm_90), 164 KiB (sm_80)
    shared_reserved_per_block: int = 1024  # "1 KB of shared memory reserved by the system"
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    register_granularity: int = 8  # registers per thread are allocated in multiples of 8
    schedulers: int = 4  # SM sub-partitions (SMSPs), each holding a quarter of the registers


LIMITS: dict[str, Limits] = {
    "sm_90": Limits("sm_90"),
    "sm_80": Limits("sm_80", shared_per_sm=167936),
}


@dataclass(frozen=True)
class Constant:
    """A figure the bound rests on, where it comes from, and whether a lent GPU must
    measure it (``benchmarks/gpu.py``'s micro-benchmarks)."""

    value: float
    unit: str
    source: str
    measure: bool


#: per architecture where the figure differs: ``{name: {arch: Constant}}``
CONSTANTS: dict[str, dict[str, Constant]] = {
    "barrier_cycles": {a: Constant(50, "cycles per __syncthreads of a 4-warp block",
                                   "issue 43's serial walk (an assumption, not a measurement)",
                                   True) for a in LIMITS},
    "iteration_latency_cycles": {a: Constant(
        150, "cycles per main-loop iteration a lone warp waits (cp.async wait, first "
        "fragment loads, shuffles)", "issue 43's serial walk (an assumption)", True)
        for a in LIMITS},
    "dmma_latency_cycles": {
        "sm_90": Constant(64, "cycles from a DMMA.16x8x4 to the next DMMA on its accumulator",
                          "assumed (4 x its 16-cycle issue interval at the peak); Luo et al., "
                          "'Benchmarking and Dissecting the Nvidia Hopper GPU Architecture' "
                          "(arXiv 2402.13499) measure mma.sync latencies per shape, not read "
                          "for fp64 in this session", True),
        "sm_80": Constant(64, "cycles from a DMMA.884 to the next DMMA on its accumulator",
                          "assumed (4 x its 16-cycle issue interval at the peak); Jia et al., "
                          "'Dissecting the Ampere GPU architecture via microbenchmarking' "
                          "(GTC 2021) is where a figure would come from", True)},
    "l2_bytes_per_clock_sm": {
        "sm_90": Constant(21.0, "L2 -> SM bytes per clock per SM (5.5 TB/s over 132 SMs at "
                          "1.98 GHz)", "assumed; NVIDIA publishes no H100 L2 bandwidth; "
                          "chipsandcheese.com, 'Nvidia's H100: Funny L2, and Tons of "
                          "Bandwidth' (2023-07-02) measured an H100 PCIe", True),
        "sm_80": Constant(47.4, "L2 -> SM bytes per clock per SM (5120 B/clock over 108 SMs)",
                          "NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020): L2 read "
                          "bandwidth 5120 bytes/clock", True)},
    "dgemm_fraction_of_peak": {a: Constant(
        0.85, "cuBLAS DGEMM's fraction of the DMMA peak", "issue 43's composition (0.45 of "
        "DGEMM at 0.57 of the peak over 6 / 9 products); benchmarks/gpu.py measures DGEMM",
        True) for a in LIMITS},
}


def constant(name: str, arch: str) -> float:
    """The value of :data:`CONSTANTS` ``[name][arch]``.

    >>> constant("barrier_cycles", "sm_90")
    50
    """
    try:
        return CONSTANTS[name][arch].value
    except KeyError:
        raise RefAttnError(f"model_bounds: no constant {name!r} for {arch!r} (known: "
                           f"{sorted(CONSTANTS)} x {sorted(LIMITS)})") from None


#: printed beside the table (``python3 -m gpu_backend.perf_model``) and in docs/gpu-model.md
ASSUMPTIONS: list[str] = [
    "optimistic: cycles = max(fp64 pipe, issue, shared memory): every phase of every warp "
    "overlaps every other (enough warps to hide all latency)",
    "pessimistic: warps per SMSP from registers (rounded up to 8 per thread, 64K per SM, "
    "a quarter per SMSP), shared memory per block (+1 KiB reserved; 228 KiB per SM on sm_90, "
    "164 KiB on sm_80) and 4-warp blocks (one warp per SMSP per block)",
    "pessimistic, one warp per SMSP: its phases run one after another: copies (the "
    "instructions of the cp.async blocks, copy loops per trip), tensor (max of DMMA pipe, "
    "accumulator chain x DMMA latency, DMMA + LDS issue), the rest (max of its issue and its "
    "vector fp64 pipe), barriers, a fixed latency per iteration",
    "pessimistic, two or more warps per SMSP: they belong to different blocks and overlap "
    "perfectly: cycles = max(shared resources, serial / warps) (optimistic within the bound)",
    "shared resources: fp64 pipe (DMMA and DFMA/DADD/DMUL add), issue (1 instruction per clock "
    "per SMSP), shared memory (128 B per clock per SM, bank model), L2 (streamed K/V or Q/G_O "
    "tiles and global loads from L2, the SM's share of its bandwidth)",
    "both bounds charge one main-loop iteration along its fp64-heaviest path; a branch on a "
    "floating-point compare diverges (lanes of a warp go both ways), so every block from it "
    "to its reconvergence point (the BSSY target) is charged: both paths of CUDA's tanh",
    "not modelled: DRAM (K/V of a head assumed L2-resident), clock throttling, instruction "
    "cache misses, the tail of a grid (partial waves), local-memory latency (LDL/STL are "
    "counted as instructions and reported); the fp64 pipe is charged DMMA, DFMA, DADD and "
    "DMUL only: DSETP compares and the F2F conversions of CUDA's exp and tanh (16 a clock per "
    "SM on sm_80/sm_90, CUDA C Programming Guide) count as issue only",
    "constants marked 'measure' are assumptions until a lent GPU measures them "
    "(benchmarks/gpu.py micro-benchmarks)",
]


@dataclass(frozen=True)
class Occupancy:
    """Resident blocks per SM and warps per SMSP, and which limit binds."""

    blocks_per_sm: int
    warps_per_smsp: float
    limited_by: str  # "registers", "shared", "warps" or "blocks"


def occupancy(registers: int, shared_bytes: int, threads: int = 128,
              arch: str = "sm_90") -> Occupancy:
    """Blocks per SM and warps per SMSP of a kernel (the CUDA occupancy calculator's rules).

    Parameters
    ----------
    registers : int
        Registers per thread (ptxas), 1 to 255.
    shared_bytes : int
        Shared memory per block (dynamic + static), bytes.
    threads : int
        Threads per block, a multiple of 32.
    arch : {"sm_90", "sm_80"}

    Returns
    -------
    Occupancy

    Raises
    ------
    RefAttnError
        Registers outside 1..255, negative shared memory, a block size not a multiple of 32,
        an unknown architecture, or a block that does not fit an SM.

    Examples
    --------
    254 registers -> 256 per thread, 8192 per warp: 2 warps per SMSP by registers; 160 KiB of
    shared memory (+1 KiB) fits once in 228 KiB: one 4-warp block, one warp per SMSP:

    >>> occupancy(254, 163840)
    Occupancy(blocks_per_sm=1, warps_per_smsp=1.0, limited_by='shared')
    >>> occupancy(254, 98304)
    Occupancy(blocks_per_sm=2, warps_per_smsp=2.0, limited_by='registers')
    """
    if arch not in LIMITS:
        raise RefAttnError(f"occupancy: unknown architecture {arch!r} (known: "
                           f"{sorted(LIMITS)})")
    lim = LIMITS[arch]
    if not 1 <= registers <= 255:
        raise RefAttnError(f"occupancy: registers per thread {registers} outside 1..255")
    if shared_bytes < 0:
        raise RefAttnError(f"occupancy: shared memory per block {shared_bytes} < 0")
    if threads <= 0 or threads % 32 or threads > 1024:
        raise RefAttnError(f"occupancy: threads per block {threads} is not a multiple of 32 "
                           "in 32..1024")
    warps = threads // 32
    per_thread = math.ceil(registers / lim.register_granularity) * lim.register_granularity
    smsp_registers = lim.registers_per_sm // lim.schedulers
    warps_per_smsp_regs = smsp_registers // (per_thread * 32)
    # a block's warps are spread over the SMSPs: ceil(warps / 4) of them on the fullest one
    by = {"registers": warps_per_smsp_regs // math.ceil(warps / lim.schedulers),
          "shared": lim.shared_per_sm // (shared_bytes + lim.shared_reserved_per_block),
          "warps": lim.max_warps_per_sm // warps, "blocks": lim.max_blocks_per_sm}
    limited_by = min(by, key=lambda k: by[k])
    blocks = by[limited_by]
    if blocks < 1:
        raise RefAttnError(f"occupancy ({arch}): a block of {threads} threads, {registers} "
                           f"registers and {shared_bytes} bytes of shared memory does not fit "
                           f"an SM (limited by {limited_by})")
    return Occupancy(blocks, blocks * warps / lim.schedulers, limited_by)


@dataclass(frozen=True)
class PessimisticInput:
    """One warp's counts per main-loop iteration, in cycles of its SMSP where timed."""

    dmma_cycles: float  # DMMA pipe
    vector_fp64_cycles: float  # DFMA/DADD/DMUL pipe cycles
    instructions: int  # every issued instruction
    copy_instructions: int  # of which: the blocks issuing cp.async
    dmma_instructions: int
    lds_instructions: int
    shared_cycles: float  # bank-model cycles x SMSPs (the SM's shared memory, shared)
    barriers: int
    dmma_chain: int  # DMMAs into one accumulator
    l2_bytes: int  # per warp: cp.async and global loads
    warps_per_smsp: float


@dataclass(frozen=True)
class PessimisticModel:
    """The bound's parts (cycles per warp per iteration) and the result."""

    copy: float
    tensor: float
    other: float
    barrier: float
    latency: float
    serial: float
    throughput: float  # max of the shared resources
    l2_cycles: float
    cycles: float
    bound: str  # "serial", "fp64", "issue", "shared" or "l2"
    fraction_of_dmma_peak: float


def pessimistic_cycles(x: PessimisticInput, arch: str = "sm_90") -> PessimisticModel:
    """The pessimistic bound (module docstring) of one warp's iteration.

    Examples
    --------
    One warp per SMSP: 500 copy instructions, 1024 DMMA cycles (chain 16 x 64 = 1024),
    1000 other instructions (300 vector fp64 cycles), 2 barriers (100) and 150 of latency:
    500 + 1024 + 1000 + 100 + 150 = 2774 cycles, 1024 / 2774 of the peak. With two warps per
    SMSP the serial sum halves (1387) below the issue bound (1564 instructions): issue binds.

    >>> x = PessimisticInput(1024.0, 300.0, 1564, 500, 64, 0, 600.0, 2, 16, 0, 1.0)
    >>> m = pessimistic_cycles(x)
    >>> m.serial, m.bound, round(m.fraction_of_dmma_peak, 3)
    (2774.0, 'serial', 0.369)
    >>> m2 = pessimistic_cycles(PessimisticInput(1024.0, 300.0, 1564, 500, 64, 0, 600.0, 2,
    ...                                          16, 0, 2.0))
    >>> m2.cycles, m2.bound
    (1564.0, 'issue')
    """
    if x.warps_per_smsp <= 0:
        raise RefAttnError(f"pessimistic bound: warps per SMSP {x.warps_per_smsp} <= 0")
    copy = float(x.copy_instructions)
    chain = x.dmma_chain * constant("dmma_latency_cycles", arch)
    tensor = max(x.dmma_cycles, chain, float(x.dmma_instructions + x.lds_instructions))
    rest = x.instructions - x.copy_instructions - x.dmma_instructions - x.lds_instructions
    other = max(float(max(rest, 0)), x.vector_fp64_cycles)
    barrier = x.barriers * constant("barrier_cycles", arch)
    latency = constant("iteration_latency_cycles", arch)
    serial = copy + tensor + other + barrier + latency
    schedulers = LIMITS[arch].schedulers
    l2 = x.l2_bytes * schedulers / constant("l2_bytes_per_clock_sm", arch)
    parts = {"fp64": x.dmma_cycles + x.vector_fp64_cycles, "issue": float(x.instructions),
             "shared": x.shared_cycles, "l2": l2}
    resource = max(parts, key=lambda k: parts[k])
    throughput = parts[resource]
    lone = serial / x.warps_per_smsp
    cycles, bound = (lone, "serial") if lone > throughput else (throughput, resource)
    return PessimisticModel(copy, tensor, other, barrier, latency, serial, throughput, l2,
                            cycles, bound, x.dmma_cycles / cycles if cycles else 0.0)


def composition(forward: float, dq: float, dkdv: float, arch: str = "sm_90"
                ) -> dict[str, float]:
    """Forward + backward as run: 2 + 3 + 4 products at the three kernels' fractions of the
    DMMA peak, 6 of them useful (forward 2, backward 4), as a fraction of the DMMA peak and of
    cuBLAS DGEMM (:data:`CONSTANTS` ``dgemm_fraction_of_peak``).

    >>> c = composition(0.57, 0.57, 0.57)
    >>> round(c["fraction_of_peak"], 3), round(c["fraction_of_dgemm"], 3)
    (0.38, 0.447)
    """
    for name, f in (("forward", forward), ("dq", dq), ("dkdv", dkdv)):
        if not 0 < f <= 1:
            raise RefAttnError(f"composition: {name} fraction {f} outside (0, 1]")
    time = 2 / forward + 3 / dq + 4 / dkdv  # in products at the peak
    useful = 6 / time
    return {"time_products": time, "harmonic_mean": 9 / time, "fraction_of_peak": useful,
            "fraction_of_dgemm": useful / constant("dgemm_fraction_of_peak", arch)}
