"""A performance model of the GPU kernels: modelled cycles per tile and the fraction of the
fp64 tensor-core (DMMA) peak, from the SASS counts, the bank model and stated assumptions.

Owns the hardware figures (:data:`HARDWARE`), the arithmetic of a tile (:func:`tile_cycles`:
cycles = max(fp64 pipe, shared memory, issue)), the model of the compiled kernels
(:func:`sass_model`, fed by :mod:`gpu_backend.compile_check`), an analytic model of the
FlashAttention-2 designs on DMMA (:func:`design_counts`) with the two deterministic backward
designs side by side (:func:`backward_designs`), and ``python3 -m gpu_backend.perf_model``
(table, assumptions, JSON). It is a proxy, not a measurement: ``benchmarks/gpu.py`` measures.

The arithmetic, per warp and per iteration of the kernel's main loop (one key tile of the
forward and dq kernels, one query tile of dk/dv), with every SM sub-partition (SMSP) running
such warps:

- fp64 pipe: ``dmma_fma / dmma_fma_per_clock_smsp + fp64_vector * 32 / fp64_lanes_per_clock``
  (DMMA and DFMA/DADD/DMUL are assumed to share the fp64 datapath: their cycles add);
- shared memory: ``schedulers * sum(bank-model cycles of each LDS/STS/LDGSTS)`` (the SM's
  128 bytes per clock serve all of its sub-partitions, one 128-byte wavefront per clock);
- issue: ``instructions / issue_per_scheduler`` (one instruction per clock per scheduler);
- cycles per tile = the max of the three (perfect overlap, enough warps to hide latency);
  fraction of the DMMA peak = DMMA cycles / cycles per tile.
That is the *optimistic* bound. Beside it, :mod:`gpu_backend.model_bounds` gives each compiled
instance a *pessimistic* bound (issue 43): occupancy (warps per SMSP from registers and shared
memory), the phases of a lone warp summed, barriers, dependent DMMA chains, copy loops per
trip and L2 bandwidth (``pessimistic`` in each entry; its assumptions in
:data:`gpu_backend.model_bounds.ASSUMPTIONS`). The analytic designs carry the optimistic bound
only. A compiled kernel is charged its main loop along
the fp64-heaviest path (every branch that adds vector fp64 work taken: features such as
softcap and dropout included), a lower bound on its fraction; the plain path (branches on
integer conditions skipped) gives ``plain_path``, an upper bound.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpu_backend import banks, model_bounds
from gpu_backend.source import FEATURE_SETS, INSTANCES, PLAIN, WIDE
from refattn.errors import RefAttnError

__all__ = ["ELEMENTWISE", "FEATURES", "HARDWARE", "PESSIMISTIC_TARGETS", "TARGETS", "Hardware",
           "TileCounts", "TileModel", "backward_designs", "compositions", "design_counts",
           "entry_dim", "entry_key", "markdown_bounds", "model", "pessimistic_entry",
           "sass_model", "source_copies", "tile_cycles"]


@dataclass(frozen=True)
class Hardware:
    """Peak figures of one GPU (vendor data sheets; the clock is the boost clock)."""

    name: str
    arch: str
    sms: int
    clock_ghz: float
    fp64_tensor_tflops: float
    fp64_vector_tflops: float
    smem_bytes_per_clock_sm: int = 128
    schedulers: int = 4  # SM sub-partitions, each issues 1 instruction per clock
    issue_per_scheduler: int = 1

    @property
    def dmma_fma_per_clock_smsp(self) -> float:
        """DMMA multiply-adds per clock per sub-partition implied by the tensor peak."""
        return self.fp64_tensor_tflops * 1e12 / 2 / (self.sms * self.clock_ghz * 1e9
                                                      * self.schedulers)

    @property
    def fp64_lanes_per_clock_smsp(self) -> float:
        """Vector fp64 lanes (FMA) per clock per sub-partition implied by the vector peak."""
        return self.fp64_vector_tflops * 1e12 / 2 / (self.sms * self.clock_ghz * 1e9
                                                      * self.schedulers)


#: sm_90: H200 SXM (132 SMs, 1.98 GHz boost, fp64 tensor 67 TFLOP/s, vector 34 TFLOP/s);
#: sm_80: A100 SXM4 (108 SMs, 1.41 GHz boost, 19.5 and 9.7 TFLOP/s)
HARDWARE: dict[str, Hardware] = {
    "sm_90": Hardware("NVIDIA H200 SXM", "sm_90", 132, 1.98, 67.0, 34.0),
    "sm_80": Hardware("NVIDIA A100 SXM4", "sm_80", 108, 1.41, 19.5, 9.7),
}

#: issue 24's targets: fraction of the DMMA peak per kernel, LDS bytes per DMMA FMA, spills
TARGETS = {"forward": 0.5, "dq": 0.4, "dkdv": 0.4, "fused_dkdvdq": 0.4,
           "lds_bytes_per_dmma_fma": 1.0, "spill_bytes": 0}

#: issue 43's targets under the pessimistic bound, sm_90, D = 64 and 128 (every instance)
PESSIMISTIC_TARGETS = {"forward": 0.6, "dq": 0.55, "dkdv": 0.55}

#: per score element, per lane, the analytic designs' elementwise work (fp64-pipe instructions,
#: other instructions). ``exp(x - m)`` compiled by nvcc 13.0 -ftz=true for sm_90 is 14 DFMA,
#: 3 DADD, 1 DMUL and about 12 integer/select/move instructions (constants hoisted).
ELEMENTWISE: dict[str, tuple[int, int]] = {
    # scale (1 DMUL), running max (DSETP + 2 FSEL), exp (18 + 12), row sum (1 DADD)
    "forward": (20, 15),
    # p = exp(scale s - lse) (1 DFMA + 18 + 12), dS = p (dP - delta) (DADD + DMUL), scale
    "backward": (22, 13),
}
LOOP_OVERHEAD = 24  # instructions per main-loop iteration: addresses, barriers, branch, waits
#: head widths of compiled kernels reported beside the targets' (64, 128), without a target
SASS_EXTRA_DIMS = (256,)


@dataclass(frozen=True)
class TileCounts:
    """Per warp, per main-loop iteration."""

    dmma_fma: int
    dmma_instructions: int
    fp64_vector: int  # DFMA, DADD, DMUL
    instructions: int  # all issued instructions, DMMA and loads included
    smem_cycles: float  # bank-model cycles of the warp's shared-memory instructions
    lds_bytes: int  # per warp (bytes per lane x 32)


@dataclass(frozen=True)
class TileModel:
    """Modelled cycles of one tile per warp (each SMSP running such warps)."""

    dmma_cycles: float
    fp64_cycles: float  # DMMA + vector fp64
    shared_cycles: float
    issue_cycles: float
    cycles: float
    bound: str  # "fp64", "shared" or "issue"
    fraction_of_dmma_peak: float
    lds_bytes_per_dmma_fma: float | None


def tile_cycles(counts: TileCounts, hw: Hardware) -> TileModel:
    """Cycles per tile = max(fp64 pipe, shared memory, issue) (module docstring).

    Parameters
    ----------
    counts : TileCounts
        One warp's work in one main-loop iteration.
    hw : Hardware
        The peaks.

    Returns
    -------
    TileModel

    Examples
    --------
    64 m16n8k4 (512 FMA each) on a GPU with 32 DMMA FMA and 16 vector lanes per clock per
    SMSP: 1024 DMMA cycles; 100 vector instructions add 200; 400 shared cycles x 4 SMSPs =
    1600 bound the tile, so the DMMA pipe is busy 1024 / 1600 of the time:

    >>> hw = Hardware("toy", "sm_90", 1, 1.0, 0.256, 0.128)
    >>> m = tile_cycles(TileCounts(64 * 512, 64, 100, 500, 400.0, 8192), hw)
    >>> m.dmma_cycles, m.fp64_cycles, m.shared_cycles, m.bound, m.fraction_of_dmma_peak
    (1024.0, 1224.0, 1600.0, 'shared', 0.64)
    """
    dmma = counts.dmma_fma / hw.dmma_fma_per_clock_smsp
    fp64 = dmma + counts.fp64_vector * 32 / hw.fp64_lanes_per_clock_smsp
    shared = hw.schedulers * counts.smem_cycles
    issue = counts.instructions / hw.issue_per_scheduler
    parts = {"fp64": fp64, "shared": shared, "issue": issue}
    bound = max(parts, key=lambda k: parts[k])
    cycles = parts[bound]
    return TileModel(dmma, fp64, shared, issue, cycles, bound,
                     dmma / cycles if cycles else 0.0,
                     counts.lds_bytes / counts.dmma_fma if counts.dmma_fma else None)


# -- the compiled kernels (SASS) ---------------------------------------------------------------


def _smem_cycles(main: dict[str, Any], layout: str, D: int) -> float:
    """Bank-model cycles of a main loop's shared-memory instructions at head width D.

    LDS.64: the worse of the fragment reads (row_read, col_read) in the kernels' layout;
    LDS.128: accumulator_16B; STS.128 and LDGSTS: cp_async_16B; narrower: conflict-free.
    """
    eight = max(banks.worst_cycles(p, D, layout) for p in ("row_read", "col_read"))
    sixteen_ld = banks.worst_cycles("accumulator_16B", D, layout)
    sixteen_st = banks.worst_cycles("cp_async_16B", D, layout)
    total = 0.0
    for op, n in main["lds"].items():
        width = 16 if op.endswith(".128") else 8 if op.endswith(".64") else 4
        total += n * (eight if width == 8 else sixteen_ld if width == 16 else 1)
    # stores: bytes per warp / 512 per 16-byte instruction, 256 per 8-byte one (upper bound
    # of the count when widths mix: every store charged as 16-byte)
    total += (main["sts_bytes"] + main["ldgsts_bytes"]) / 512 * sixteen_st
    return total


def _head_dim(name: str) -> int | None:
    m = re.search(r"(?:_d|_hd)(\d+)(?:_|$)", name)
    return int(m.group(1)) if m else None


def _tile_size(name: str) -> int:
    m = re.search(r"_t(\d+)(?:_|$)", name)
    return int(m.group(1)) if m else 0


def pick_instance(kernels: dict[str, dict[str, Any]], role: str, D: int,
                  features: str = "general") -> str | None:
    """The compiled kernel that runs ``role`` at head width D with a feature set.

    A name with ``_d{D}`` (a head-width instance) of that feature set (compile_check's
    ``features``, "general" where absent) wins; general kernels without a head width in the
    name take any D (the largest tile first).

    >>> ks = {"attention_forward_d64": {"role": "forward"}, "attention_forward_d128": {
    ...       "role": "forward"}, "attention_forward_plain_d128": {"role": "forward",
    ...       "features": "plain"}, "attention_dq_t32": {"role": "dq"}}
    >>> pick_instance(ks, "forward", 128), pick_instance(ks, "dq", 64)
    ('attention_forward_d128', 'attention_dq_t32')
    >>> pick_instance(ks, "forward", 128, "plain"), pick_instance(ks, "forward", 64, "plain")
    ('attention_forward_plain_d128', None)
    """
    mine = {n: k for n, k in kernels.items()
            if k["role"] == role and k.get("features", "general") == features}
    named = [n for n in mine if _head_dim(n) == D]
    if named:
        return sorted(named)[0]
    if features != "general":
        return None
    generic = [n for n in mine if _head_dim(n) is None]
    return max(generic, key=_tile_size) if generic else None


#: the feature sets of compiled instances, in table order, and the calls each serves
FEATURES: dict[str, str] = {name: serves for name, (_, serves) in FEATURE_SETS.items()}


def entry_key(D: int, features: str = "general") -> str:
    """The key of an instance in :func:`sass_model`'s result: ``"D=64"`` for the general
    instance, ``"D=64 plain"`` for a plain one.

    >>> entry_key(64), entry_key(128, "plain"), entry_dim("D=128 plain")
    ('D=64', 'D=128 plain', 128)
    """
    return f"D={D}" if features == "general" else f"D={D} {features}"


def entry_dim(key: str) -> int:
    """The head width of an :func:`entry_key`."""
    return int(key.split()[0][2:])


#: the (MR, tile) tables of each feature set (gpu_backend.source)
_TABLES: dict[str, dict[str, dict[int, tuple[int, int]]]] = {
    "general": INSTANCES, "plain": PLAIN, "wide": WIDE}
THREADS = 128  # 4 warps per block (gpu_backend.launch, tile_loop.cuh's REFATTN_THREADS)


def source_copies(role: str, D: int, features: str = "general") -> int | None:
    """cp.async copies (16 bytes) per thread per main-loop iteration, from the sources' tile
    sizes: the forward and dq stream a K and a V tile of ``tile`` rows, the dk/dv a Q and a
    G_O tile: ``2 x tile x D / 2 / 128`` (tile.cuh's ``refattn_load_tile_async``: R D / 2
    chunks shared by the block's 128 threads). None for an instance the tables lack.

    >>> source_copies("forward", 64), source_copies("forward", 128), source_copies("dkdv", 64)
    (16, 16, 8)
    """
    table = _TABLES.get(features, {}).get(role, {})
    if D not in table:
        return None
    _, tile = table[D]
    return 2 * tile * D // 2 // THREADS


def pessimistic_entry(k: dict[str, Any], main: dict[str, Any], counts: TileCounts,
                      opt: TileModel, arch: str, role: str, D: int,
                      features: str) -> dict[str, Any]:
    """The pessimistic bound of one compiled instance (:mod:`gpu_backend.model_bounds`), from
    its main loop's counts and its occupancy; with the cp.async count of the sources beside
    the SASS's (``copies_source``, ``copies_sass``)."""
    shared = (k.get("shared_bytes") or 0) + (k.get("shared_static_bytes") or 0)
    occ = model_bounds.occupancy(k["registers"], shared, THREADS, arch)
    x = model_bounds.PessimisticInput(
        dmma_cycles=opt.dmma_cycles, vector_fp64_cycles=opt.fp64_cycles - opt.dmma_cycles,
        instructions=counts.instructions, copy_instructions=main.get("copy_instructions", 0),
        dmma_instructions=counts.dmma_instructions,
        lds_instructions=sum(main["lds"].values()), shared_cycles=opt.shared_cycles,
        barriers=main.get("barriers", 0), dmma_chain=main.get("dmma_chain", 0),
        l2_bytes=main["ldgsts_bytes"] + main.get("ldg_bytes", 0),
        warps_per_smsp=occ.warps_per_smsp)
    m = model_bounds.pessimistic_cycles(x, arch)
    return {**asdict(m), "serial_fraction": opt.dmma_cycles / m.serial if m.serial else 0.0,
            "blocks_per_sm": occ.blocks_per_sm,
            "warps_per_smsp": occ.warps_per_smsp, "occupancy_limited_by": occ.limited_by,
            "copies_sass": main.get("ldgsts", 0),
            "copies_source": source_copies(role, D, features),
            "local_loads": main.get("local_loads", 0),
            "local_stores": main.get("local_stores", 0),
            "dmma_chain": main.get("dmma_chain", 0), "barriers": main.get("barriers", 0),
            "flop_per_l2_byte": (2 * counts.dmma_fma / x.l2_bytes if x.l2_bytes else None)}


def sass_model(check: dict[str, Any], dims: tuple[int, ...] = (64, 128)) -> dict[str, Any]:
    """Modelled fraction of the DMMA peak of each hot kernel, from compile_check's JSON.

    Returns ``{arch: {role: {"D=64": {...}, "D=64 plain": {...}, ...}}}`` (:func:`entry_key`:
    every compiled instance, general and plain, each judged on its own fp64-heaviest path)
    with the kernel's name, its feature set, the counts used, the :class:`TileModel` fields
    and whether the targets are met.
    """
    from gpu_backend.compile_check import layout_for

    out: dict[str, Any] = {}
    for arch, rep in check["arches"].items():
        hw = HARDWARE[arch]
        per_role: dict[str, Any] = {}
        for role in ("forward", "dq", "dkdv"):
            for D, features in ((D, f) for D in dims for f in FEATURES):
                name = pick_instance(rep["kernels"], role, D, features)
                if name is None:
                    continue
                k = rep["kernels"][name]
                # the fp64-heaviest path (features included) is charged; the plain path
                # (integer-condition branches skipped) gives the other bound
                main = k.get("main_loop_heaviest") or k["main_loop"]
                lean = k["main_loop"]
                entry: dict[str, Any] = {
                    "kernel": name, "features": features, "serves": FEATURES[features],
                    "shared_bytes": k.get("shared_bytes"),
                    "spill_bytes": k["spill_bytes"], "registers": k["registers"],
                    "dmma_instructions": k["dmma_instructions"], "dmma": k["dmma"],
                    "dfma": k["dfma"], "call_rel_noinc": k["call_rel_noinc"]}
                if main is None:
                    entry.update(fraction_of_dmma_peak=0.0, note="no main loop found")
                else:
                    layout = layout_for(check["smem_layout"], D)
                    counts = TileCounts(main["dmma_fma"], sum(main["dmma"].values()),
                                        main["fp64_vector"], main["instructions"],
                                        _smem_cycles(main, layout, D), main["lds_bytes"])
                    opt = tile_cycles(counts, hw)
                    entry.update(counts=asdict(counts), layout=layout,
                                 lds64_cycles=max(banks.worst_cycles(p, D, layout)
                                                  for p in ("row_read", "col_read")),
                                 main_loop_calls=main["call_rel_noinc"], **asdict(opt))
                    try:
                        entry["pessimistic"] = pessimistic_entry(k, main, counts, opt, arch,
                                                                 role, D, features)
                        entry["pessimistic_target_met"] = (
                            entry["pessimistic"]["fraction_of_dmma_peak"]
                            >= PESSIMISTIC_TARGETS[role])
                    except RefAttnError as exc:  # e.g. a block that fits no SM
                        entry["pessimistic_note"] = str(exc)
                    if lean is not None and lean is not main:
                        plain = tile_cycles(TileCounts(
                            lean["dmma_fma"], sum(lean["dmma"].values()), lean["fp64_vector"],
                            lean["instructions"], _smem_cycles(lean, layout, D),
                            lean["lds_bytes"]), hw)
                        entry["plain_path"] = {"fraction_of_dmma_peak":
                                               plain.fraction_of_dmma_peak,
                                               "bound": plain.bound, "cycles": plain.cycles}
                    unknown = sum(1 for *_, t in main.get("inner_trips", []) if t is None)
                    if unknown:
                        entry["note"] = (f"{unknown} inner loop(s) without a constant trip "
                                         "count counted once")
                ratio = entry.get("lds_bytes_per_dmma_fma")
                entry["targets_met"] = (
                    entry["fraction_of_dmma_peak"] >= TARGETS[role]
                    and ratio is not None and ratio <= TARGETS["lds_bytes_per_dmma_fma"]
                    and k["spill_bytes"] == 0)
                per_role.setdefault(role, {})[entry_key(D, features)] = entry
        # a general instance whose role and width have a wide one built for this architecture
        # never runs on its devices: launch.plan prefers the wide instance wherever it fits,
        # and it fits every device of the architecture it is built for (compile_check's
        # ARCH_SHARED_BYTES); reported, its pessimistic target not judged there
        for per in per_role.values():
            for key, entry in per.items():
                wide = per.get(entry_key(entry_dim(key), "wide"))
                if entry["features"] == "general" and wide is not None:
                    entry["superseded_by"] = wide["kernel"]
        out[arch] = per_role
    return out


# -- the designs, analytically -----------------------------------------------------------------


def design_counts(kind: str, D: int, hw: Hardware, *, tile: int = 64,
                  warps: int = 4) -> TileCounts:
    """One warp's counts per tile of a FlashAttention-2 design on DMMA (no SASS needed).

    Parameters
    ----------
    kind : {"forward", "dq", "dkdv", "fused_dkdvdq"}
        forward: S = Q K^T, O += P V (2 products); dq: S, dP = G_O V^T, dQ += dS K (3);
        dkdv: S^T, dP^T, dV += P^T G_O, dK += dS^T Q (4); fused_dkdvdq: dkdv plus
        dQ += dS K reduced over the block's warps in shared memory (5).
    D : int
        Head width (Dk = Dv).
    hw : Hardware
        sm_90 runs m16n8k4 (512 FMA per instruction), sm_80 m8n8k4 (256).
    tile : int
        The other side of the tile (keys per tile for forward and dq, queries for dk/dv).
    warps : int
        Warps per block; each owns 16 rows (queries, or keys for dk/dv).

    Returns
    -------
    TileCounts

    Notes
    -----
    Fragments of the warp's own 16 rows stay in registers; each fragment of the streamed
    tile is read once per product from a conflict-free layout (the swizzle: 2 cycles per
    LDS.64); elementwise costs are :data:`ELEMENTWISE` for ``16 * tile / 32`` elements per
    lane; the fused design adds the dS exchange (16 x tile doubles stored and read back)
    and the dQ partials (tile x D stored, and a quarter read back by each of 4 warps) in
    shared memory.

    Examples
    --------
    >>> c = design_counts("forward", 64, HARDWARE["sm_90"])
    >>> c.dmma_fma == 2 * 16 * 64 * 64, c.dmma_instructions, c.lds_bytes / c.dmma_fma
    (True, 256, 0.5)
    """
    products = {"forward": 2, "dq": 3, "dkdv": 4, "fused_dkdvdq": 5}[kind]
    per_instr = 512 if hw.arch == "sm_90" else 256
    fma = products * 16 * tile * D
    dmma_instr = fma // per_instr
    # streamed-tile fragments read from shared memory, doubles per warp: forward K, V;
    # dq K twice, V; dk/dv Q twice, G_O twice; fused also K^T of its own 16 keys for dQ
    doubles = {"forward": 2, "dq": 3, "dkdv": 4, "fused_dkdvdq": 4}[kind] * tile * D
    stores = 0
    if kind == "fused_dkdvdq":
        doubles += 16 * D
        exchange = 16 * tile + tile * D  # dS^T transposed, and the warp's dQ partial
        stores += exchange * 8 // 256  # STS.64
        doubles += exchange  # read back: dS as the A fragment, a quarter of 4 partials
    lds_bytes = doubles * 8
    lds_instr = lds_bytes // 256  # LDS.64, 8 bytes x 32 lanes
    eight = max(banks.worst_cycles(p, D, "swizzle") for p in ("row_read", "col_read"))
    # cp.async: the block's two streamed tiles (K, V or Q, G_O), 16 bytes per lane, shared
    # out among the warps
    copies = 2 * tile * D * 8 // 512 // warps
    smem = (lds_instr + stores) * eight + copies * banks.worst_cycles("cp_async_16B", D,
                                                                      "swizzle")
    elements = 16 * tile // 32
    fp64_el, other_el = ELEMENTWISE["forward" if kind == "forward" else "backward"]
    fp64 = elements * fp64_el
    if kind == "forward":
        fp64 += 16 * D // 32  # the output accumulator's rescale (DMUL)
    if kind == "fused_dkdvdq":
        fp64 += tile * D // 32  # the warp's share of the dQ partial sums (DADD)
    instructions = (dmma_instr + lds_instr + stores + copies + fp64 + elements * other_el
                    + LOOP_OVERHEAD)
    return TileCounts(fma, dmma_instr, fp64, instructions, float(smem), lds_bytes)


def backward_designs(D: int, hw: Hardware, *, L: int = 4096, tile: int = 64) -> dict[str, Any]:
    """The two deterministic backward designs side by side, at head width D.

    - ``seven_products``: a dq kernel (S, dP, dQ) and a dk/dv kernel (S^T, dP^T, dV, dK):
      S and dP computed twice, no cross-block traffic, any launch order.
    - ``five_products``: one kernel per key block (S^T, dP^T, dV, dK, dQ); the block's dQ
      partial (tile x D) is added to dQ in global memory in a fixed key-block order:
      each key block waits for the previous one per query tile. With the key blocks of a
      head running side by side and visiting query tiles in the same order, block j starts
      j steps late: efficiency ``n / (n + m - 1)`` (n query tiles, m = the head's key blocks
      resident at once, here ``min(L / tile, SMs)``, one block per SM).

    Times are in units of one product at the DMMA peak; ``useful_fraction`` = 5 / time (the
    backward's 5 necessary products per element).

    Examples
    --------
    >>> d = backward_designs(128, HARDWARE["sm_90"])
    >>> d["seven_products"]["dmma_products"], d["five_products"]["dmma_products"]
    (7, 5)
    """
    f = {k: tile_cycles(design_counts(k, D, hw, tile=tile), hw).fraction_of_dmma_peak
         for k in ("dq", "dkdv", "fused_dkdvdq")}
    t7 = 3 / f["dq"] + 4 / f["dkdv"]
    n = L // tile
    m = min(n, hw.sms)
    order = n / (n + m - 1)
    t5 = 5 / f["fused_dkdvdq"] / order
    # global dQ read-modify-write per block step: tile x D doubles loaded and stored
    flops_per_byte = 2 * 5 * tile * tile * D / (2 * tile * D * 8)
    return {
        "L": L, "tile": tile,
        "seven_products": {
            "dmma_products": 7, "fraction_of_dmma_peak": {"dq": f["dq"], "dkdv": f["dkdv"]},
            "time_units": t7, "useful_fraction": 5 / t7,
            "global_dq_traffic": "none (dq kernel owns its rows)"},
        "five_products": {
            "dmma_products": 5, "fraction_of_dmma_peak": {"fused_dkdvdq": f["fused_dkdvdq"]},
            "fixed_order_efficiency": order, "time_units": t5, "useful_fraction": 5 / t5,
            "dq_flop_per_global_byte": flops_per_byte,
            "dq_global_bytes_per_s_at_modelled_rate":
                hw.fp64_tensor_tflops * 1e12 * f["fused_dkdvdq"] * order / flops_per_byte},
        "faster": "seven_products" if t7 <= t5 else "five_products",
        "ratio_seven_over_five": t7 / t5,
    }


def model(*, sass: dict[str, Any] | None = None, dims: tuple[int, ...] = (64, 128),
          tile: int = 64) -> dict[str, Any]:
    """The whole model as a JSON-ready dict: assumptions, designs, backward designs, SASS.

    ``sass`` is :func:`gpu_backend.compile_check.check`'s result (None: analytic only).

    >>> m = model()
    >>> sorted(m) == ['assumptions', 'backward_designs', 'design', 'sass', 'targets',
    ...               'targets_met']
    True

    With ``sass``, ``composition`` (:func:`compositions`) joins them.
    """
    design: dict[str, Any] = {}
    back: dict[str, Any] = {}
    for arch, hw in HARDWARE.items():
        for D in dims:
            for kind in ("forward", "dq", "dkdv", "fused_dkdvdq"):
                counts = design_counts(kind, D, hw, tile=tile)
                m = tile_cycles(counts, hw)
                design.setdefault(arch, {}).setdefault(kind, {})[f"D={D}"] = {
                    "counts": asdict(counts), **asdict(m),
                    "target": TARGETS[kind],
                    "targets_met": m.fraction_of_dmma_peak >= TARGETS[kind]
                    and (m.lds_bytes_per_dmma_fma or math.inf)
                    <= TARGETS["lds_bytes_per_dmma_fma"]}
            back.setdefault(arch, {})[f"D={D}"] = {
                f"L={L}": backward_designs(D, hw, L=L, tile=tile) for L in (4096, 131072)}
    # the compiled kernels at the widths of the targets, and at D = 256 (reported, no target)
    sass_part = (sass_model(sass, (*dims, *(d for d in SASS_EXTRA_DIMS if d not in dims)))
                 if sass is not None else None)
    met = {"design": all(e["targets_met"] for a in design.values()
                         for kind, per in a.items() if kind != "fused_dkdvdq"
                         for e in per.values())}
    if sass_part is not None:
        met["sass"] = all(e["targets_met"] for a in sass_part.values() for per in a.values()
                          for d, e in per.items() if entry_dim(d) in dims)
        met["sass_pessimistic"] = all(
            e.get("pessimistic_target_met", False) for per in sass_part.get("sm_90", {}).values()
            for d, e in per.items() if entry_dim(d) in dims and "superseded_by" not in e)
    out = {"assumptions": assumptions(tile), "design": design, "backward_designs": back,
           "sass": sass_part, "targets": TARGETS, "targets_met": met}
    if sass_part is not None:
        out["composition"] = compositions(sass_part, dims)
    return out


def compositions(sass_part: dict[str, Any], dims: tuple[int, ...] = (64, 128)
                 ) -> dict[str, Any]:
    """Forward + backward (:func:`gpu_backend.model_bounds.composition`: 6 useful products
    over the 9 run) under both bounds, per architecture, head width and feature set, with the
    instances a call runs on that architecture's devices (``launch.plan``): the general ones,
    or a role's wide instance where the architecture has one built (only sm_90's devices hold
    them); the plain ones where all three roles have one. ``kernels`` names the three.

    >>> e = lambda n, f: {"kernel": n, "fraction_of_dmma_peak": f,
    ...                   "pessimistic": {"fraction_of_dmma_peak": f}}
    >>> part = {"sm_90": {"forward": {"D=128": e("fw", 0.6)}, "dkdv": {"D=128": e("dkdv", .6)},
    ...         "dq": {"D=128": e("dq", 0.3), "D=128 wide": e("dq_wide", 0.6)}}}
    >>> c = compositions(part, (128,))["sm_90"]["D=128"]
    >>> c["kernels"], round(c["pessimistic"]["fraction_of_peak"], 2)
    (['fw', 'dq_wide', 'dkdv'], 0.4)
    """
    out: dict[str, Any] = {}
    for arch, roles in sass_part.items():
        for D in dims:
            for fs in ("general", "plain"):
                key = entry_key(D, fs)
                es = []
                for r in ("forward", "dq", "dkdv"):
                    mine = roles.get(r, {})
                    wide = mine.get(entry_key(D, "wide")) if fs == "general" else None
                    es.append(wide if wide is not None and "pessimistic" in wide
                              else mine.get(key))
                if any(e is None or "pessimistic" not in e for e in es):
                    continue
                opt = [float(e["fraction_of_dmma_peak"]) for e in es]
                pes = [float(e["pessimistic"]["fraction_of_dmma_peak"]) for e in es]
                out.setdefault(arch, {})[key] = {
                    "kernels": [e["kernel"] for e in es],
                    "optimistic": model_bounds.composition(opt[0], opt[1], opt[2], arch),
                    "pessimistic": model_bounds.composition(pes[0], pes[1], pes[2], arch)}
    return out


def assumptions(tile: int = 64) -> dict[str, Any]:
    """Every figure the model rests on (printed beside the numbers)."""
    hw = {arch: {**asdict(h), "dmma_fma_per_clock_smsp": round(h.dmma_fma_per_clock_smsp, 2),
                 "fp64_lanes_per_clock_smsp": round(h.fp64_lanes_per_clock_smsp, 2)}
          for arch, h in HARDWARE.items()}
    return {
        "hardware": hw,
        "method": " ".join(__doc__.split("\n\n")[1:3]).replace("\n", " "),
        "elementwise_per_score_element": {k: {"fp64_pipe": a, "other": b}
                                          for k, (a, b) in ELEMENTWISE.items()},
        "loop_overhead_instructions": LOOP_OVERHEAD,
        "design_tile": f"a warp owns 16 rows; the streamed tile is {tile} rows; 4 warps per "
                       "block; fragments of the warp's own rows in registers; sm_90 "
                       "m16n8k4, sm_80 m8n8k4; shared tiles swizzled (tile.cuh)",
        "not_modelled": "optimistic bound: global memory and L2 (but the five-product "
                        "design's dQ traffic), latency, barriers, occupancy, clock throttling; "
                        "the pessimistic bound counts them (bounds)",
        "bounds": list(model_bounds.ASSUMPTIONS),
        "constants": {name: {arch: asdict(c) for arch, c in per.items()}
                      for name, per in model_bounds.CONSTANTS.items()},
        "proxy": "a model, not a measurement: benchmarks/gpu.py measures on a GPU",
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def print_model(m: dict[str, Any]) -> None:
    """Assumptions, then the designs, the backward designs and the compiled kernels."""
    a = m["assumptions"]
    print("assumptions (a proxy, not a measurement):")
    for arch, h in a["hardware"].items():
        print(f"  {arch}: {h['name']}: {h['sms']} SMs, {h['clock_ghz']} GHz, fp64 tensor "
              f"{h['fp64_tensor_tflops']} TFLOP/s = {h['dmma_fma_per_clock_smsp']} FMA/clock "
              f"per SMSP, fp64 vector {h['fp64_vector_tflops']} TFLOP/s = "
              f"{h['fp64_lanes_per_clock_smsp']} lanes/clock per SMSP, shared memory "
              f"{h['smem_bytes_per_clock_sm']} B/clock/SM, {h['schedulers']} schedulers x "
              f"{h['issue_per_scheduler']} instruction/clock")
    print(f"  elementwise per score element per lane: {a['elementwise_per_score_element']}; "
          f"loop overhead {a['loop_overhead_instructions']} instructions")
    print(f"  design: {a['design_tile']}")
    print(f"  not modelled: {a['not_modelled']}")
    print("  the two bounds:")
    for line in a["bounds"]:
        print(f"  - {line}")
    for name, per in a["constants"].items():
        for arch, c in per.items():
            print(f"  {name} ({arch}) = {c['value']:g}: {c['unit']}; {c['source']}"
                  + ("; MEASURE on a lent GPU" if c["measure"] else ""))
    head = (f"  {'kernel':<14} {'D':>4} {'DMMA cyc':>9} {'fp64 cyc':>9} {'smem cyc':>9} "
            f"{'issue cyc':>9} {'bound':>6} {'B/FMA':>6} {'of peak':>7} {'target':>6}")
    print("analytic designs (FlashAttention-2 on DMMA), cycles per tile per warp:")
    for arch, kinds in m["design"].items():
        print(f" {arch}")
        print(head)
        for kind, per in kinds.items():
            for dkey, e in per.items():
                print(f"  {kind:<14} {dkey[2:]:>4} {e['dmma_cycles']:>9.0f} "
                      f"{e['fp64_cycles']:>9.0f} {e['shared_cycles']:>9.0f} "
                      f"{e['issue_cycles']:>9.0f} {e['bound']:>6} "
                      f"{_pct(e['lds_bytes_per_dmma_fma']):>6} "
                      f"{e['fraction_of_dmma_peak']:>7.2f} {e['target']:>6}")
    print("backward designs (time in products at the DMMA peak; useful = 5 / time):")
    for arch, per in m["backward_designs"].items():
        for dkey, byl in per.items():
            for lkey, d in byl.items():
                s7, s5 = d["seven_products"], d["five_products"]
                print(f"  {arch} {dkey:<6} {lkey:<9} 7 products: {s7['time_units']:.2f} "
                      f"(useful {s7['useful_fraction']:.2f})  5 products: "
                      f"{s5['time_units']:.2f} (useful {s5['useful_fraction']:.2f}, fixed-"
                      f"order efficiency {s5['fixed_order_efficiency']:.2f})  faster: "
                      f"{d['faster']}")
    if m["sass"] is not None:
        print("compiled kernels (SASS main loop, static counts per iteration):")
        for arch, roles in m["sass"].items():
            print(f" {arch}")
            print(head + f" {'pessim.':>7} {'bound':>6} {'w/SMSP':>6}  kernel")
            for role, per in roles.items():
                for dkey, e in per.items():
                    D, fs = entry_dim(dkey), e.get("features", "general")
                    if "cycles" not in e:
                        print(f"  {role:<14} {D:>4} {e.get('note')}  {e['kernel']} ({fs})")
                        continue
                    pe = e.get("pessimistic") or {"fraction_of_dmma_peak": float("nan"),
                                                  "bound": "-", "warps_per_smsp": 0}
                    print(f"  {role:<14} {D:>4} {e['dmma_cycles']:>9.0f} "
                          f"{e['fp64_cycles']:>9.0f} {e['shared_cycles']:>9.0f} "
                          f"{e['issue_cycles']:>9.0f} {e['bound']:>6} "
                          f"{_pct(e['lds_bytes_per_dmma_fma']):>6} "
                          f"{e['fraction_of_dmma_peak']:>7.2f} "
                          f"{'-' if D in SASS_EXTRA_DIMS else TARGETS[role]:>6} "
                          f"{pe['fraction_of_dmma_peak']:>7.2f} {pe['bound']:>6} "
                          f"{pe['warps_per_smsp']:>6g}  {e['kernel']} ({fs})")
        print("forward + backward (6 useful products over 9 run), optimistic / pessimistic:")
        for arch, per in m.get("composition", {}).items():
            for key, c in per.items():
                o, q = c["optimistic"], c["pessimistic"]
                print(f"  {arch} {key:<12} of DMMA peak {o['fraction_of_peak']:.2f} / "
                      f"{q['fraction_of_peak']:.2f}, of DGEMM {o['fraction_of_dgemm']:.2f} / "
                      f"{q['fraction_of_dgemm']:.2f}  ({', '.join(c['kernels'])})")
    print(f"targets met: {m['targets_met']}")


def markdown_bounds(m: dict[str, Any]) -> str:
    """Both bounds of every compiled instance, the forward+backward composition under each,
    and the assumptions with the constants' sources (docs/gpu-model.md)."""
    lines = ["| arch | kernel | D | features | warps / SMSP (limit) | copies / thread: SASS "
             "(source) | LDL / STL | optimistic: of peak (bound) | pessimistic: copy / tensor "
             "/ other / barrier / latency cycles | serial | pessimistic: of peak (bound) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arch, roles in m["sass"].items():
        for per in roles.values():
            for dkey, e in per.items():
                pe = e.get("pessimistic")
                if pe is None:
                    continue
                lines.append(
                    f"| {arch} | `{e['kernel']}` | {entry_dim(dkey)} | "
                    f"{e.get('features', 'general')} | {pe['warps_per_smsp']:g} "
                    f"({pe['occupancy_limited_by']}) | {pe['copies_sass']} "
                    f"({pe['copies_source'] if pe['copies_source'] is not None else '-'}) | "
                    f"{pe['local_loads']} / {pe['local_stores']} | "
                    f"{e['fraction_of_dmma_peak']:.2f} ({e['bound']}) | {pe['copy']:.0f} / "
                    f"{pe['tensor']:.0f} / {pe['other']:.0f} / {pe['barrier']:.0f} / "
                    f"{pe['latency']:.0f} | {pe['serial']:.0f} | "
                    f"**{pe['fraction_of_dmma_peak']:.2f}** ({pe['bound']})"
                    + (f", not run on {arch}: `{e['superseded_by'].removeprefix('attention_')}` "
                       "is" if "superseded_by" in e else "") + " |")
    lines += ["", "| arch | instances | optimistic: of DMMA peak / of DGEMM | pessimistic: of "
              "DMMA peak / of DGEMM |", "|---|---|---|---|"]
    for arch, per in m.get("composition", {}).items():
        for key, c in per.items():
            o, q = c["optimistic"], c["pessimistic"]
            names = ", ".join(f"`{n.removeprefix('attention_')}`" for n in c["kernels"])
            lines.append(f"| {arch} | {key}: {names} | {o['fraction_of_peak']:.2f} / "
                         f"{o['fraction_of_dgemm']:.2f} | {q['fraction_of_peak']:.2f} / "
                         f"{q['fraction_of_dgemm']:.2f} |")
    lines += ["", "Assumptions:", ""] + [f"- {a}" for a in m["assumptions"]["bounds"]]
    lines += ["", "| constant | arch | value | unit | source | measure on a lent GPU |",
              "|---|---|---|---|---|---|"]
    for name, per in m["assumptions"]["constants"].items():
        for arch, c in per.items():
            lines.append(f"| `{name}` | {arch} | {c['value']:g} | {c['unit']} | "
                         f"{c['source']} | {'yes' if c['measure'] else 'no'} |")
    return "\n".join(lines)


def markdown(m: dict[str, Any]) -> str:
    """The compiled kernels' table (docs/gpu-model.md), both bounds
    (:func:`markdown_bounds`) and the analytic designs' table."""
    lines = []
    if m["sass"] is not None:
        lines += ["| arch | kernel | D | features | shared B | registers | spill B | DMMA (FMA) "
                  "| DFMA | main-loop CALL | LDS B / DMMA FMA | LDS.64 cycles (layout) | DMMA / "
                  "fp64 / smem / issue cycles | bound | of DMMA peak | target |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for arch, roles in m["sass"].items():
            for role, per in roles.items():
                for dkey, e in per.items():
                    D = entry_dim(dkey)
                    lines.append(
                        f"| {arch} | `{e['kernel']}` | {D} | {e.get('features', 'general')} | "
                        f"{e.get('shared_bytes') or '-'} | {e['registers']} | "
                        f"{e['spill_bytes']} | {e['dmma_instructions']} "
                        f"({', '.join(f'{n} {op}' for op, n in e['dmma'].items()) or '-'}) | "
                        f"{e['dfma']} | {e.get('main_loop_calls', '-')} | "
                        f"{_pct(e.get('lds_bytes_per_dmma_fma'))} | "
                        f"{e.get('lds64_cycles', '-')} ({e.get('layout', '-')}) | "
                        f"{e.get('dmma_cycles', 0):.0f} / {e.get('fp64_cycles', 0):.0f} / "
                        f"{e.get('shared_cycles', 0):.0f} / {e.get('issue_cycles', 0):.0f} | "
                        f"{e.get('bound', '-')} | {e['fraction_of_dmma_peak']:.2f} | "
                        f"{'-' if D in SASS_EXTRA_DIMS else TARGETS[role]} |")
        lines += ["", markdown_bounds(m), ""]
    lines += ["| arch | design | D | DMMA / fp64 / smem / issue cycles | bound | LDS B / FMA "
              "| of DMMA peak | target |", "|---|---|---|---|---|---|---|---|"]
    for arch, kinds in m["design"].items():
        for kind, per in kinds.items():
            for dkey, e in per.items():
                lines.append(f"| {arch} | {kind} | {dkey[2:]} | {e['dmma_cycles']:.0f} / "
                             f"{e['fp64_cycles']:.0f} / {e['shared_cycles']:.0f} / "
                             f"{e['issue_cycles']:.0f} | {e['bound']} | "
                             f"{_pct(e['lds_bytes_per_dmma_fma'])} | "
                             f"{e['fraction_of_dmma_peak']:.2f} | {e['target']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m gpu_backend.perf_model",
                                description="modelled fraction of the fp64 tensor-core peak "
                                "of the GPU kernels (a proxy, not a measurement)")
    p.add_argument("--json", type=Path, help="write the model as JSON to this file")
    p.add_argument("--no-sass", action="store_true",
                   help="the analytic designs only (no compiler or disassembler needed)")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 unless the compiled kernels meet issue 24's targets "
                   "(optimistic bound) and issue 43's (pessimistic bound, sm_90)")
    p.add_argument("--markdown", action="store_true",
                   help="print the tables as Markdown (docs/gpu-model.md)")
    p.add_argument("--kernel-dir", type=Path, default=None,
                   help="the kernel sources (default: the package's kernels/)")
    args = p.parse_args(argv)
    check = None
    if not args.no_sass:
        from gpu_backend.compile_check import check as compile_check

        try:
            check = compile_check(**({"directory": args.kernel_dir} if args.kernel_dir
                                     else {}))
        except RefAttnError as exc:
            print(f"perf_model: {exc}", file=sys.stderr)
            return 2
    m = model(sass=check)
    print(markdown(m)) if args.markdown else print_model(m)
    if args.json:
        args.json.write_text(json.dumps(m, indent=2) + "\n")
        print(f"wrote {args.json}")
    met = m["targets_met"]
    return 1 if args.strict and not (met.get("sass") and met.get("sass_pessimistic")) else 0


if __name__ == "__main__":
    sys.exit(main())
