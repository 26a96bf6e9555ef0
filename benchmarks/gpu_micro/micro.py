"""Micro-benchmarks of the performance model's assumptions: build (nvcc), check (SASS), run (CuPy).

Owns the micro-benchmark pass of ``benchmarks/gpu.py`` (issue 43, item 4): ``micro.cu`` beside
this file holds the kernels (DMMA.16x8x4 and DMMA.8x8x4 latency and throughput, DFMA alone and
interleaved with DMMA, 16-byte cp.async issue cost and bandwidth), each timed by ``clock64`` in
every warp. :func:`build` compiles them with nvcc into one cubin per architecture (sm_90,
sm_80) ahead of the run; :func:`loop_counts` reads the SASS of a cubin (no GPU) so a test can
check that each timed loop holds the instructions it claims; :func:`run` launches them from the
cubin through ``cupy.RawModule`` on a GPU (a few seconds expected; not yet run on one);
:func:`derive` turns the raw cycle counts into the constants the model assumes and
:func:`assumed` reads those from :mod:`gpu_backend.perf_model` (``HARDWARE``) and
:mod:`gpu_backend.model_bounds` (``CONSTANTS``) where they exist; :func:`table` sets them side
by side.

Methods (each figure is the median over blocks of the slowest warp of a block):

- latency: one warp, ``CHAIN`` mma each reading the previous one's accumulator: cycles / mma;
- throughput: one block per SM of 4 W warps (W = 1, 2 per SMSP), ``ACC`` independent
  accumulators, ``STEPS x ACC`` mma per trip: cycles per mma per SMSP = cycles / (W x mma per
  warp), the lower of W = 1, 2 (warps spread over the 4 SMSPs by warp index);
- DFMA: the same with ``ACC x DFMA_PER`` independent fma chains; mixed: the DMMA loop with
  ``DFMA_PER`` DFMA after each DMMA. Co-issue = (t_dmma + t_dfma - t_mixed) / min(t_dmma,
  t_dfma): 0 where the cycles add (one shared fp64 datapath: the model's assumption), 1 where
  the smaller one hides entirely;
- cp.async issue: one warp, ``COPIES`` 16-byte copies per thread between two clock64 reads,
  before the wait: cycles per LDGSTS per warp;
- cp.async bandwidth: 4 blocks of 256 threads per SM stream a buffer global -> shared with two
  buffers per block; an 8 MiB buffer read 64 times (L2-resident on A100/H100/H200) and a
  1 GiB one read once (DRAM); bytes per clock per SM from clock64 and GB/s from CUDA events.

Sources: PTX ISA 8.x (``mma.sync.aligned.m16n8k4/m8n8k4 .f64``, ``cp.async.cg``, ``%clock64``);
the kernels' own wrappers gpu_backend/kernels/mma_m16n8k4.cuh, mma_m8n8k4.cuh, cp_async.cuh.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repo root

from refattn.errors import RefAttnError

__all__ = ["ARCHS", "DEFINES", "SOURCE", "assumed", "build", "derive", "loop_counts", "run",
           "table"]

SOURCE = Path(__file__).resolve().with_name("micro.cu")
#: the compile-time shape of every timed loop, passed to nvcc (-D) so that Python and CUDA agree
DEFINES: dict[str, int] = {"CHAIN": 64, "ACC": 8, "STEPS": 8, "DFMA_PER": 2, "COPIES": 16,
                           "BW_COPIES": 4}
#: the architectures compiled ahead: nvcc -arch, cubin file name
ARCHS: dict[str, str] = {"sm_90": "micro_sm90.cubin", "sm_80": "micro_sm80.cubin"}
#: the timed-loop contents each kernel must have in its SASS (per trip of its loop)
EXPECTED_LOOPS: dict[str, dict[str, int]] = {
    "dmma16_latency": {"DMMA": DEFINES["CHAIN"]},
    "dmma8_latency": {"DMMA": DEFINES["CHAIN"]},
    "dmma16_throughput": {"DMMA": DEFINES["ACC"] * DEFINES["STEPS"]},
    "dmma8_throughput": {"DMMA": DEFINES["ACC"] * DEFINES["STEPS"]},
    "dfma_throughput": {"DFMA": DEFINES["ACC"] * DEFINES["STEPS"] * DEFINES["DFMA_PER"]},
    "dmma16_dfma_mixed": {"DMMA": DEFINES["ACC"] * DEFINES["STEPS"],
                          "DFMA": DEFINES["ACC"] * DEFINES["STEPS"] * DEFINES["DFMA_PER"]},
    "dmma8_dfma_mixed": {"DMMA": DEFINES["ACC"] * DEFINES["STEPS"],
                         "DFMA": DEFINES["ACC"] * DEFINES["STEPS"] * DEFINES["DFMA_PER"]},
    "cp_async_issue": {"LDGSTS": DEFINES["COPIES"]},
    "cp_async_bandwidth": {"LDGSTS": DEFINES["BW_COPIES"]},
}
M16_KERNELS = ("dmma16_latency", "dmma16_throughput", "dmma16_dfma_mixed")  # sm_90+ only


def build(out_dir: Path, archs: tuple[str, ...] = tuple(ARCHS)) -> dict[str, Path]:
    """Compile ``micro.cu`` with nvcc into ``out_dir``, one cubin per architecture.

    Parameters
    ----------
    out_dir : path
        An existing directory; the cubins are written as :data:`ARCHS` names them.
    archs : tuple of str
        Keys of :data:`ARCHS`.

    Returns
    -------
    dict
        arch -> the cubin's path.

    Raises
    ------
    RefAttnError
        Without nvcc, for an unknown arch, or with nvcc's diagnostics when it fails.
    """
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        raise RefAttnError(f"gpu_micro: unknown arch {unknown} (known: {sorted(ARCHS)})")
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise RefAttnError("gpu_micro: nvcc is not on PATH (CUDA 13 toolkit needed to build "
                           f"{SOURCE.name})")
    out = {}
    for arch in archs:
        path = Path(out_dir) / ARCHS[arch]
        cmd = [nvcc, f"-arch={arch}", "-cubin", "-O3", "-std=c++17", "-Werror", "all-warnings",
               *(f"-D{k}={v}" for k, v in DEFINES.items()), "-o", str(path), str(SOURCE)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RefAttnError(f"gpu_micro: nvcc failed for {arch}:\n{proc.stderr[-3000:]}")
        out[arch] = path
    return out


def loop_counts(sass_text: str) -> dict[str, dict[str, Any]]:
    """Per kernel, the opcodes (base names) inside its innermost timed loop, from
    ``cuobjdump -sass`` text: the body is the address range from the target of the last
    backward branch to that branch. ``chain`` says whether every DMMA of the body reads as its
    accumulator (last operand) the destination (first operand) of the DMMA before it.

    Examples
    --------
    >>> text = '''Function : k
    ...         /*0000*/                   MOV R2, RZ ;
    ...         /*0010*/                   DMMA.8x8x4 R4, R8, R10, R4 ;
    ...         /*0020*/                   DMMA.8x8x4 R6, R8, R10, R4 ;
    ...         /*0030*/                   DFMA R12, R12, R14, R12 ;
    ...         /*0040*/              @P0 BRA 0x10 ;
    ...         /*0050*/                   EXIT ;'''
    >>> c = loop_counts(text)["k"]
    >>> c["opcodes"]["DMMA"], c["opcodes"]["DFMA"], c["chain"]
    (2, 1, True)
    """
    from gpu_backend.sass import parse

    out: dict[str, dict[str, Any]] = {}
    for name, instrs in parse(sass_text).items():
        back = [(i.address, int(t, 16)) for i in instrs if i.base == "BRA"
                for t in [i.operands.split()[-1]] if t.startswith("0x") and int(t, 16) < i.address]
        if not back:
            out[name] = {"opcodes": Counter(), "chain": False, "loop": None}
            continue
        end, start = max(back)
        body = [i for i in instrs if start <= i.address <= end]
        dmma = [i.operands.replace(" ", "").split(",") for i in body if i.base == "DMMA"]
        chain = len(dmma) > 1 and all(b[-1] == a[0] for a, b in pairwise(dmma))
        out[name] = {"opcodes": Counter(i.base for i in body), "chain": chain,
                     "loop": (start, end)}
    return out


# -- running on a GPU ---------------------------------------------------------------------------
def _launch(module: Any, name: str, grid: int, block: int, args: tuple[Any, ...],
            shared: int = 0) -> tuple[list[int], float]:
    """One launch: each warp's clock64 cycles and the kernel's CUDA-event seconds."""
    import cupy

    warps = grid * block // 32
    cycles = cupy.zeros(warps, dtype=cupy.int64)
    out = cupy.zeros(grid * block, dtype=cupy.float64)
    fn = module.get_function(name)
    if shared > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = shared
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    fn((grid,), (block,), (cycles, out, *args), shared_mem=shared)
    stop.record()
    stop.synchronize()
    return [int(c) for c in cycles.get()], cupy.cuda.get_elapsed_time(start, stop) / 1e3


def _block_cycles(cycles: list[int], warps_per_block: int) -> float:
    """Median over blocks of the slowest warp of each block."""
    blocks = [max(cycles[b:b + warps_per_block]) for b in range(0, len(cycles), warps_per_block)]
    return float(statistics.median(blocks))


def run(cubin_dir: Path, budget_s: float = 30.0) -> dict[str, Any]:
    """Run the micro-benchmarks on the current CUDA device from the cubin in ``cubin_dir``
    (sm_90's on compute capability 9.0 and above, else sm_80's); raw counts, see
    :func:`derive`. Stops adding measurements once ``budget_s`` has passed."""
    import cupy

    dev = cupy.cuda.Device()
    cc = int(dev.compute_capability)
    arch = "sm_90" if cc >= 90 else "sm_80"
    path = Path(cubin_dir) / ARCHS[arch]
    if not path.is_file():
        raise RefAttnError(f"gpu_micro: {path} is missing (build it: python3 "
                           f"benchmarks/gpu_micro/micro.py --build {cubin_dir})")
    props = cupy.cuda.runtime.getDeviceProperties(dev.id)
    sms = int(props["multiProcessorCount"])
    t0 = time.perf_counter()
    module = cupy.RawModule(path=str(path))
    raw: dict[str, Any] = {"arch": arch, "compute_capability": cc, "sms": sms,
                           "clock_khz": int(props.get("clockRate", 0)),
                           "name": props["name"].decode() if isinstance(props["name"], bytes)
                           else str(props["name"]), "defines": dict(DEFINES), "trips": 256}
    trips = raw["trips"]
    kinds = ("dmma16", "dmma8") if arch == "sm_90" else ("dmma8",)
    for kind in kinds:
        _launch(module, f"{kind}_latency", 1, 32, (cupy.int32(4),))  # warm-up
        raw[f"{kind}_latency"] = _launch(module, f"{kind}_latency", 1, 32,
                                         (cupy.int32(trips),))[0]
        for w in (1, 2):
            for k in ("throughput", "dfma_mixed"):
                raw[f"{kind}_{k}_w{w}"] = _launch(module, f"{kind}_{k}", sms, 128 * w,
                                                  (cupy.int32(trips),))[0]
    for w in (1, 2):
        raw[f"dfma_throughput_w{w}"] = _launch(module, "dfma_throughput", sms, 128 * w,
                                               (cupy.int32(trips),))[0]
    src = cupy.ones(DEFINES["COPIES"] * 2 * 128, dtype=cupy.float64)
    shared = DEFINES["COPIES"] * 16 * 128
    raw["cp_async_issue_w1"] = _launch(module, "cp_async_issue", 1, 32,
                                       (src, cupy.int32(trips)), shared)[0]
    raw["cp_async_issue_w4"] = _launch(module, "cp_async_issue", sms, 128,
                                       (src, cupy.int32(trips)), shared)[0]
    bw_shared = 2 * DEFINES["BW_COPIES"] * 16 * 256
    for label, n_bytes, reps in (("l2", 8 << 20, 64), ("dram", 1 << 30, 1)):
        if time.perf_counter() - t0 > budget_s:
            raw[f"cp_async_bandwidth_{label}"] = None
            continue
        buf = cupy.ones(n_bytes // 8, dtype=cupy.float64)
        args = (buf, cupy.int64(buf.size), cupy.int32(reps))
        _launch(module, "cp_async_bandwidth", 4 * sms, 256, args, bw_shared)  # warm-up
        cycles, seconds = _launch(module, "cp_async_bandwidth", 4 * sms, 256, args, bw_shared)
        chunk = 2 * 256 * DEFINES["BW_COPIES"] * 8
        raw[f"cp_async_bandwidth_{label}"] = {
            "bytes": (n_bytes // chunk) * chunk * reps, "cycles": cycles, "seconds": seconds}
        del buf
    cupy.get_default_memory_pool().free_all_blocks()  # the 1 GiB buffer: not for the kernels
    raw["seconds"] = time.perf_counter() - t0
    return raw


def derive(raw: dict[str, Any]) -> dict[str, Any]:
    """The model's constants from :func:`run`'s raw counts (pure arithmetic: no GPU).

    Examples
    --------
    >>> d = DEFINES
    >>> loop = d["ACC"] * d["STEPS"] * 10                 # mma per warp over 10 trips
    >>> raw = {"arch": "sm_80", "sms": 2, "defines": d, "trips": 10,
    ...        "dmma8_latency": [10 * d["CHAIN"] * 30],    # 30 cycles per dependent mma
    ...        "dmma8_throughput_w1": [loop * 8] * 8,      # 8 cycles per mma, 1 warp per SMSP
    ...        "dmma8_throughput_w2": [loop * 16] * 16,    # the same rate with 2 warps
    ...        "dfma_throughput_w1": [loop * 2 * 4] * 8,   # 4 cycles per DFMA
    ...        "dfma_throughput_w2": [loop * 2 * 8] * 16,
    ...        "dmma8_dfma_mixed_w1": [loop * 16] * 8,     # 8 + 2 x 4: the cycles add
    ...        "dmma8_dfma_mixed_w2": [loop * 32] * 16,
    ...        "cp_async_issue_w1": [10 * d["COPIES"] * 2], "cp_async_issue_w4": [0],
    ...        "cp_async_bandwidth_l2": {"bytes": 2 * 10**9, "cycles": [10**6] * 16,
    ...                                  "seconds": 1e-3}}
    >>> out = derive(raw)
    >>> out["dmma8_latency_cycles"], out["dmma8_cycles_per_issue_smsp"]
    (30.0, 8.0)
    >>> out["dfma_cycles_per_warp_instruction_smsp"], out["dmma8_dfma_coissue"]
    (4.0, 0.0)
    >>> out["cp_async_issue_cycles_per_warp_instruction"], out["cp_async_l2_bytes_per_clock_sm"]
    (2.0, 1000.0)
    """
    d = raw["defines"]
    per_warp = d["ACC"] * d["STEPS"]
    out: dict[str, Any] = {"arch": raw["arch"]}

    def rate(key: str, per_trip: int, warps_per_smsp: int) -> float | None:
        cycles = raw.get(key)
        if not cycles:
            return None
        return _block_cycles(cycles, 4 * warps_per_smsp) / (warps_per_smsp * per_trip
                                                             * raw["trips"])

    for kind in ("dmma16", "dmma8"):
        lat = raw.get(f"{kind}_latency")
        if lat:
            out[f"{kind}_latency_cycles"] = max(lat) / (raw["trips"] * d["CHAIN"])
        best = [r for w in (1, 2) if (r := rate(f"{kind}_throughput_w{w}", per_warp, w))]
        if best:
            out[f"{kind}_cycles_per_issue_smsp"] = min(best)
    dfma = [r for w in (1, 2) if (r := rate(f"dfma_throughput_w{w}", per_warp * d["DFMA_PER"],
                                            w))]
    if dfma:
        out["dfma_cycles_per_warp_instruction_smsp"] = min(dfma)
    for kind in ("dmma16", "dmma8"):
        shares = []
        for w in (1, 2):
            t_mma = rate(f"{kind}_throughput_w{w}", 1, w)
            t_fma = rate(f"dfma_throughput_w{w}", 1, w)
            t_mix = rate(f"{kind}_dfma_mixed_w{w}", 1, w)
            if t_mma and t_fma and t_mix:
                shares.append((t_mma + t_fma - t_mix) / min(t_mma, t_fma))
        if shares:
            out[f"{kind}_dfma_coissue"] = max(0.0, min(1.0, max(shares)))
    issue = raw.get("cp_async_issue_w1")
    if issue:
        out["cp_async_issue_cycles_per_warp_instruction"] = max(issue) / (raw["trips"]
                                                                          * d["COPIES"])
    for label in ("l2", "dram"):
        bw = raw.get(f"cp_async_bandwidth_{label}")
        if bw:
            cycles = float(statistics.median(bw["cycles"]))
            out[f"cp_async_{label}_bytes_per_clock_sm"] = bw["bytes"] / cycles / raw["sms"]
            out[f"cp_async_{label}_gb_per_s"] = bw["bytes"] / bw["seconds"] / 1e9
    return out


def assumed(arch: str) -> dict[str, Any]:
    """The model's values of the same constants: :mod:`gpu_backend.perf_model`'s ``HARDWARE``
    (DMMA and DFMA rates) and :mod:`gpu_backend.model_bounds`' ``CONSTANTS`` (latency, L2),
    None where the model has no such figure. The fixed ones are the model's stated rules:
    DMMA and DFMA cycles add (co-issue 0), one instruction per clock per SMSP (a cp.async
    costs its issue slot: 1 cycle)."""
    out: dict[str, Any] = {"dmma8_dfma_coissue": 0.0, "dmma16_dfma_coissue": 0.0,
                           "cp_async_issue_cycles_per_warp_instruction": 1.0}
    try:
        from gpu_backend.perf_model import HARDWARE

        hw = HARDWARE[arch]
        fma = hw.dmma_fma_per_clock_smsp
        out["dmma16_cycles_per_issue_smsp"] = 16 * 8 * 4 / fma if arch == "sm_90" else None
        out["dmma8_cycles_per_issue_smsp"] = 8 * 8 * 4 / fma  # the same rate per FMA
        out["dfma_cycles_per_warp_instruction_smsp"] = 32 / hw.fp64_lanes_per_clock_smsp
    except (ImportError, KeyError, AttributeError):
        pass
    try:
        from gpu_backend.model_bounds import CONSTANTS

        lat = CONSTANTS["dmma_latency_cycles"][arch].value
        out["dmma16_latency_cycles" if arch == "sm_90" else "dmma8_latency_cycles"] = lat
        out["cp_async_l2_bytes_per_clock_sm"] = CONSTANTS["l2_bytes_per_clock_sm"][arch].value
    except (ImportError, KeyError, AttributeError):
        pass
    return out


#: the printed rows: key, what it is
ROWS: tuple[tuple[str, str], ...] = (
    ("dmma16_cycles_per_issue_smsp", "DMMA.16x8x4 cycles per issue per SMSP"),
    ("dmma8_cycles_per_issue_smsp", "DMMA.8x8x4 cycles per issue per SMSP"),
    ("dmma16_latency_cycles", "DMMA.16x8x4 dependent latency (cycles)"),
    ("dmma8_latency_cycles", "DMMA.8x8x4 dependent latency (cycles)"),
    ("dfma_cycles_per_warp_instruction_smsp", "DFMA cycles per warp instruction per SMSP"),
    ("dmma16_dfma_coissue", "DFMA co-issue beside DMMA.16x8x4 (0 add, 1 hidden)"),
    ("dmma8_dfma_coissue", "DFMA co-issue beside DMMA.8x8x4 (0 add, 1 hidden)"),
    ("cp_async_issue_cycles_per_warp_instruction", "cp.async 16 B issue cycles per warp"),
    ("cp_async_l2_bytes_per_clock_sm", "cp.async L2 -> shared bytes per clock per SM"),
    ("cp_async_l2_gb_per_s", "cp.async L2 -> shared GB/s (whole GPU)"),
    ("cp_async_dram_bytes_per_clock_sm", "cp.async DRAM -> shared bytes per clock per SM"),
    ("cp_async_dram_gb_per_s", "cp.async DRAM -> shared GB/s (whole GPU)"),
)


def table(measured: dict[str, Any], model: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of (constant, measured, assumed, measured / assumed) for every measured figure.

    >>> table({"dmma8_latency_cycles": 32.0}, {"dmma8_latency_cycles": 64})[0]["ratio"]
    0.5
    """
    rows = []
    for key, label in ROWS:
        if measured.get(key) is None:
            continue
        m, a = measured[key], model.get(key)
        ratio = m / a if isinstance(a, (int, float)) and a else None
        rows.append({"constant": key, "label": label, "measured": m, "assumed": a,
                     "ratio": ratio})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as text, one constant a line."""
    lines = [f"{'model constant':<52} {'measured':>10} {'assumed':>10} {'ratio':>7}"]
    for r in rows:
        a = "-" if r["assumed"] is None else f"{r['assumed']:.3g}"
        q = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"{r['label']:<52} {r['measured']:>10.3g} {a:>10} {q:>7}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", type=Path, metavar="DIR", help="compile the cubins into DIR")
    p.add_argument("--run", type=Path, metavar="DIR", help="run from the cubins in DIR (GPU)")
    args = p.parse_args(argv)
    if args.build:
        args.build.mkdir(parents=True, exist_ok=True)
        for arch, path in build(args.build).items():
            print(f"{arch}: {path}")
    if args.run:
        raw = run(args.run)
        measured = derive(raw)
        print(format_table(table(measured, assumed(raw["arch"]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
