"""Compile the kernels for real GPU architectures, without a GPU, and read ptxas's report.

Owns :func:`compile_report`: ``attention.cu`` compiled to a cubin for one architecture with
``nvcc`` (warnings are errors) or, where nvcc is absent, with NVRTC from the
``nvidia-cuda-nvrtc`` wheel (with the flags CuPy adds: ``-ftz=true
--device-as-default-execution-space``); ``-Xptxas -v`` is parsed into registers, spill bytes
and stack per kernel. ``python3 -m gpu_backend.compile_check`` prints the table.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_backend import banks
from gpu_backend.sass import KernelCounts, LoopCounts, disassemble, kernel_counts, parse
from gpu_backend.source import (
    FEATURE_SETS,
    KERNEL_DIR,
    KERNELS,
    MAIN,
    source_hash,
    translation_unit,
)
from refattn.errors import RefAttnError

__all__ = ["ARCH_SHARED_BYTES", "CompileReport", "KernelResources", "compile_report",
           "kernel_features", "kernel_role", "kernel_shared_bytes", "nvrtc_library", "toolchain"]

ARCHES = ("sm_90", "sm_80")
#: the largest per-block opt-in shared memory of a device of each architecture (sm_80: an
#: A100's 163 KiB; sm_90: an H100/H200's 227 KiB). An instance needing more is not built for
#: that architecture (attention.cu's REFATTN_SM90_ONLY: its body traps) and not reported.
ARCH_SHARED_BYTES = {"sm_80": 166912, "sm_90": 232448}
_INSTANCE = re.compile(r"^attention_(forward|dq|dkdv)_(?:([a-z]+)_)?d(\d+)$")
_REPORTS: dict[tuple[str, str, str], CompileReport] = {}  # one compile per source per process


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reported for one kernel."""

    kernel: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    shared_static: int = 0  # static __shared__ bytes (ptxas' "bytes smem")


@dataclass(frozen=True)
class CompileReport:
    """One architecture's compile: the tool, the time, the warnings and every kernel."""

    arch: str
    tool: str
    seconds: float
    kernels: dict[str, KernelResources]
    warnings: tuple[str, ...]
    cubin: bytes = field(default=b"", repr=False)

    @property
    def spills(self) -> int:
        return sum(k.spill_stores + k.spill_loads for k in self.kernels.values())


def nvrtc_library() -> str | None:
    """Path of libnvrtc from the nvidia-cuda-nvrtc wheel (or the toolkit), if any."""
    roots = [sysconfig.get_paths()["purelib"], *sys.path, "/usr/local/cuda/lib64"]
    for root in roots:
        for pattern in ("nvidia/cu13/lib/libnvrtc.so*", "nvidia/cuda_nvrtc/lib/libnvrtc.so*",
                        "libnvrtc.so*"):
            hits = sorted(glob.glob(os.path.join(root, pattern)))
            if hits:
                return hits[0]
    return None


def toolchain() -> str | None:
    """``"nvcc"``, ``"nvrtc"`` or None (then the checks are skipped, saying why)."""
    if shutil.which("nvcc"):
        return "nvcc"
    return "nvrtc" if nvrtc_library() else None


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def _parse(log: str) -> dict[str, KernelResources]:
    out: dict[str, KernelResources] = {}
    current, stack, stores, loads = None, 0, 0, 0
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = m.group(1)
        elif (m := _SPILL.search(line)) and current:
            stack, stores, loads = (int(g) for g in m.groups())
        elif (m := _REGS.search(line)) and current:
            smem = _SMEM.search(line)
            out[current] = KernelResources(current, int(m.group(1)), stores, loads, stack,
                                           int(smem.group(1)) if smem else 0)
            current = None
    return out


def _warnings(log: str) -> tuple[str, ...]:
    return tuple(line for line in log.splitlines() if "warning" in line.lower())


def _nvcc(arch: str, directory: Path) -> tuple[str, int, bytes]:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        proc = subprocess.run(
            ["nvcc", f"-arch={arch}", "-cubin", "-std=c++17", "-ftz=true", "-Werror",
             "all-warnings", "-Xptxas", "-v", f"-I{directory}", "-o",
             str(cubin), str(directory / MAIN)],
            capture_output=True, text=True)
        binary = cubin.read_bytes() if cubin.exists() else b""
    return proc.stdout + proc.stderr, proc.returncode, binary


def _nvrtc(arch: str, directory: Path) -> tuple[str, int, bytes]:
    path = Path(nvrtc_library() or "")
    for builtins in sorted(path.parent.glob("libnvrtc-builtins.so*")):  # NVRTC dlopens it
        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
        break
    lib = ctypes.CDLL(str(path))
    prog = ctypes.c_void_p()
    src = translation_unit(directory).encode()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src, MAIN.encode(), 0, None, None):
        raise RefAttnError("NVRTC: nvrtcCreateProgram failed")
    opts = [f"-arch={arch}", "--std=c++17", "-ftz=true", "--device-as-default-execution-space",
            f"-I{directory}", "--ptxas-options=-v"]
    argv = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
    rc = lib.nvrtcCompileProgram(prog, len(opts), argv)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    buffer = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buffer)
    binary = b""
    if rc == 0:
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        binary = cubin.raw
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return buffer.value.decode(errors="replace"), rc, binary


def compile_report(arch: str = "sm_90", directory: Path = KERNEL_DIR) -> CompileReport:
    """Compile every kernel for ``arch`` and report registers, spills and warnings.

    Raises
    ------
    RefAttnError
        When no toolchain is present, or when the sources do not compile (with the log).
    """
    key = (arch, str(Path(directory).resolve()), source_hash(Path(directory)))
    if key in _REPORTS:
        return _REPORTS[key]
    tool = toolchain()
    if tool is None:
        raise RefAttnError("compile check: neither nvcc nor NVRTC (pip install "
                           "nvidia-cuda-nvrtc==13.0.88) is available")
    start = time.perf_counter()
    log, rc, cubin = (_nvcc if tool == "nvcc" else _nvrtc)(arch, Path(directory).resolve())
    seconds = time.perf_counter() - start
    if rc != 0:
        raise RefAttnError(f"compile check ({tool}, {arch}): the kernels do not compile:\n"
                           f"{log[-4000:]}")
    kernels = _parse(log)
    missing = sorted(set(KERNELS) - set(kernels))
    if missing and Path(directory).resolve() == KERNEL_DIR:  # other sources: what they have
        raise RefAttnError(f"compile check ({tool}, {arch}): no ptxas report for {missing}")
    _REPORTS[key] = CompileReport(arch, tool, seconds, kernels, _warnings(log), cubin)
    return _REPORTS[key]


def write_cubin(arch: str, out_dir: Path, directory: Path = KERNEL_DIR) -> Path:
    """Write the cubin of :func:`compile_report` for ``arch`` to ``out_dir`` as
    ``attention.<arch>.cubin`` with its record ``attention.<arch>.json`` (the sources' sha256,
    the architecture, the tool); the ``"cupy"`` backend loads it instead of compiling when
    ``REFATTN_CUBIN_DIR`` names the directory (:mod:`gpu_backend.cupy_backend`). Each file is
    written to a temporary name and renamed, so neither is ever left half-written. Returns the
    cubin's path.
    """
    report = compile_report(arch, directory)
    if not report.cubin:
        raise RefAttnError(f"compile check ({report.tool}, {arch}): no cubin was produced")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {"source_hash": source_hash(Path(directory)), "arch": arch, "tool": report.tool}
    cubin = out_dir / f"{MAIN.rsplit('.', 1)[0]}.{arch}.cubin"
    for path, data in ((cubin, report.cubin),
                       (cubin.with_suffix(".json"), (json.dumps(record) + "\n").encode())):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    return cubin


#: the hot kernels, recognised by name: role -> how the name says it
ROLES: dict[str, re.Pattern[str]] = {
    "forward": re.compile(r"^(?!.*trace).*forward"),
    "dq": re.compile(r"(?:^|_)dq(?:_|$)"),
    "dkdv": re.compile(r"(?:^|_)dk_?dv(?:_|$)"),
}
#: per hot kernel: at most this many registers, LDS bytes per DMMA multiply-add, local memory
#: (LDL/STL) instructions in the main loop (issue 43)
MAX_REGISTERS = 255
MAX_LDS_BYTES_PER_FMA = 1.0
MAX_MAIN_LOOP_LOCAL = 0
#: the targets are judged at these head widths; wider instances (D = 256: 8-row warps, K and V
#: or dK / dV halves through shared memory) are reported with their figures, not judged
TARGET_MAX_HEAD_DIM = 128
HEAD_DIMS = (32, 64, 128, 256)
_PAD = re.compile(r"(?:constexpr\s+(?:int|unsigned)\s+|#define\s+)(\w*PAD\w*)\s*=?\s*(\d+)")


def kernel_features(name: str) -> str:
    """The feature set of a hot kernel's entry point (``source.kernel_name``): ``"plain"``
    (compiled without softcap, bias and dropout), ``"wide"`` (every feature, larger tiles for
    devices with more shared memory) or ``"general"`` (every feature).

    >>> kernel_features("attention_forward_plain_d64"), kernel_features("attention_dq_d64")
    ('plain', 'general')
    >>> kernel_features("attention_dq_wide_d128")
    'wide'
    """
    return next((f for f in FEATURE_SETS if f != "general" and f"_{f}_" in name), "general")


def kernel_shared_bytes(name: str) -> int | None:
    """The dynamic shared memory per block of an instance's entry point
    (:func:`gpu_backend.launch.shared_bytes`), None for a name that is not an instance.

    >>> kernel_shared_bytes("attention_dq_plain_d128"), kernel_shared_bytes("attention_dq_d64")
    (196608, 102400)
    """
    from gpu_backend.launch import shared_bytes

    m = _INSTANCE.match(name)
    if m is None:
        return None
    kind, features, D = m.group(1), m.group(2) or "general", int(m.group(3))
    try:
        return shared_bytes(kind, D, features)
    except RefAttnError:
        return None


def kernel_role(name: str) -> str | None:
    """``"forward"``, ``"dq"``, ``"dkdv"`` for a hot kernel's name, else None.

    >>> [kernel_role(n) for n in ("attention_forward_t32", "attention_dkdv_d128",
    ...                           "attention_trace_forward", "attention_row_dot_output")]
    ['forward', 'dkdv', None, None]
    """
    return next((role for role, pat in ROLES.items() if pat.search(name)), None)


def smem_layout(directory: Path = KERNEL_DIR) -> tuple[str, str]:
    """The kernels' shared-memory tile layout (a :func:`~gpu_backend.banks.tile_index` layout
    with ``D`` for the head width) and where that comes from.

    ``"swizzle"`` when a kernel source other than tile.cuh (which defines them) uses its
    swizzled tiles (``refattn_swz``, ``refattn_load_tile_async``); else ``"stride=D+n"`` from the
    first ``constexpr int ...PAD... = n`` (or ``#define ...PAD... n``) of the sources; else
    ``"stride=D"`` (unpadded).
    """
    sources = sorted(Path(directory).glob("*.cu*"))
    users = [path.name for path in sources if path.name != "tile.cuh"
             and any(name in path.read_text()
                     for name in ("refattn_swz", "refattn_load_tile_async"))]
    if users:
        return "swizzle", f"{', '.join(users)} use tile.cuh's XOR-swizzled tiles"
    for path in sources:
        if m := _PAD.search(path.read_text()):
            return f"stride=D+{m.group(2)}", f"{path.name}: {m.group(1)} = {m.group(2)}"
    return "stride=D", "no swizzle or *PAD* constant in the kernel sources: rows unpadded"


def layout_for(layout: str, D: int) -> str:
    """A :func:`smem_layout` template at head width D.

    >>> layout_for("stride=D+4", 64), layout_for("swizzle", 64)
    ('stride=68', 'swizzle')
    """
    if layout.startswith("stride=D"):
        return f"stride={D + int(layout.removeprefix('stride=D') or 0)}"
    return layout


def bank_table(kernel_layout: str) -> dict[str, dict[str, int]]:
    """Worst cycles per warp access of every :data:`~gpu_backend.banks.PATTERNS` entry.

    For each head width D in :data:`HEAD_DIMS`: unpadded rows, rows padded by 4 and by 8
    doubles, the swizzle, and the kernels' own layout:
    ``{pattern: {"ideal": cycles, "D=64 stride=68": cycles, ..., "D=64 kernels": cycles}}``.

    >>> bank_table("swizzle")["row_read"]["D=64 stride=68"]
    2
    """
    out: dict[str, dict[str, int]] = {}
    for name, pattern in banks.PATTERNS.items():
        row = {"ideal": banks.ideal_cycles(pattern.width)}
        for d in HEAD_DIMS:
            for lay in (f"stride={d}", f"stride={d + 4}", f"stride={d + 8}", "swizzle"):
                row[f"D={d} {lay}"] = banks.worst_cycles(name, d, lay)
            row[f"D={d} kernels"] = banks.worst_cycles(name, d, layout_for(kernel_layout, d))
        out[name] = row
    return out


def _loop_json(c: LoopCounts | None) -> dict[str, object] | None:
    if c is None:
        return None
    return {"start": hex(c.start), "end": hex(c.end), "instructions": c.instructions,
            "dmma": c.dmma, "dmma_fma": c.dmma_fma, "dfma": c.dfma,
            "fp64_vector": c.fp64_vector, "lds": c.lds, "lds_bytes": c.lds_bytes,
            "sts_bytes": c.sts_bytes, "ldgsts_bytes": c.ldgsts_bytes,
            "call_rel_noinc": c.calls, "inner_loops": c.inner_loops,
            "inner_trips": [[hex(s), hex(e), t] for s, e, t in c.inner_trips],
            "lds_bytes_per_dmma_fma": c.lds_bytes_per_dmma_fma,
            "ldgsts": c.ldgsts, "copy_instructions": c.copy_instructions,
            "barriers": c.barriers, "local_loads": c.local_loads,
            "local_stores": c.local_stores, "local_bytes": c.local_bytes,
            "ldg_bytes": c.ldg_bytes, "dmma_chain": c.dmma_chain}


def head_dim(name: str) -> int | None:
    """The head width of an instance's name (``attention_dq_plain_d128`` -> 128), else None.

    >>> head_dim("attention_dkdv_wide_d256"), head_dim("attention_forward_t32")
    (256, None)
    """
    m = re.search(r"_d(\d+)$", name)
    return int(m.group(1)) if m else None


def judged(name: str) -> bool:
    """Whether the targets are judged for a hot kernel: head width <= TARGET_MAX_HEAD_DIM
    (or none in its name).

    >>> judged("attention_dkdv_d128"), judged("attention_dkdv_d256")
    (True, False)
    """
    d = head_dim(name)
    return d is None or d <= TARGET_MAX_HEAD_DIM


def hot_kernel_json(res: KernelResources, counts: KernelCounts, role: str
                    ) -> dict[str, Any]:
    """One hot kernel's figures and which of issue 24's targets it meets."""
    main = counts.main_loop
    ratio = main.lds_bytes_per_dmma_fma if main else None
    targets = {
        "dmma": counts.total.dmma_fma > 0,
        f"registers<={MAX_REGISTERS}": res.registers <= MAX_REGISTERS,
        "no_spills": res.spill_stores + res.spill_loads == 0,
        f"lds_bytes_per_dmma_fma<={MAX_LDS_BYTES_PER_FMA:g}":
            ratio is not None and ratio <= MAX_LDS_BYTES_PER_FMA,
        "no_call_rel_noinc_in_main_loop": main is not None and main.calls == 0,
        "no_local_memory_in_main_loop": main is not None
        and main.local_loads + main.local_stores <= MAX_MAIN_LOOP_LOCAL,
    }
    need = kernel_shared_bytes(res.kernel)
    return {"role": role, "features": kernel_features(res.kernel),
            "shared_bytes": need, "runs_on": {a: need is not None and need <= limit
                                              for a, limit in ARCH_SHARED_BYTES.items()},
            "registers": res.registers, "shared_static_bytes": res.shared_static,
            "spill_bytes": res.spill_stores + res.spill_loads, "stack_bytes": res.stack_bytes,
            "judged": judged(res.kernel),
            "dmma_instructions": sum(counts.total.dmma.values()), "dmma": counts.total.dmma,
            "dmma_fma": counts.total.dmma_fma, "dfma": counts.total.dfma,
            "call_rel_noinc": counts.total.calls, "main_loop": _loop_json(main),
            "main_loop_heaviest": _loop_json(counts.heavy_loop),
            "lds_bytes_per_dmma_fma": ratio, "notes": list(counts.notes),
            "targets": targets, "targets_met": all(targets.values())}


def sass_report(arch: str, directory: Path = KERNEL_DIR) -> dict[str, Any]:
    """Compile for ``arch``, disassemble, and report every hot kernel (JSON-ready).

    Raises
    ------
    RefAttnError
        No compiler, no cuobjdump/nvdisasm (naming the wheels), or no hot kernel found.
    """
    report = compile_report(arch, directory)
    functions = parse(disassemble(report.cubin))
    kernels, not_built = {}, {}
    for name in sorted(functions):
        role = kernel_role(name)
        if role is None or name not in report.kernels:
            continue
        need = kernel_shared_bytes(name)
        if need is not None and need > ARCH_SHARED_BYTES[arch]:
            not_built[name] = (f"needs {need} bytes of shared memory per block, above every "
                               f"{arch} device's {ARCH_SHARED_BYTES[arch]}: not built")
            continue
        kernels[name] = hot_kernel_json(report.kernels[name],
                                        kernel_counts(name, functions[name]), role)
    if not kernels:
        raise RefAttnError(f"SASS ({arch}): no forward, dq or dk/dv kernel among "
                           f"{sorted(functions)}")
    return {"compiler": report.tool, "compile_seconds": round(report.seconds, 2),
            "warnings": list(report.warnings), "kernels": kernels, "not_built": not_built,
            "targets_met": all(k["targets_met"] for k in kernels.values() if k["judged"])}


def check(arches: tuple[str, ...] = ARCHES, directory: Path = KERNEL_DIR
          ) -> dict[str, Any]:
    """Everything ``python3 -m gpu_backend.compile_check`` reports, as one JSON-ready dict."""
    layout, layout_source = smem_layout(directory)
    per_arch = {arch: sass_report(arch, directory) for arch in arches}
    return {"source_hash": source_hash(Path(directory)), "arches": per_arch,
            "smem_layout": layout, "smem_layout_source": layout_source,
            "bank_model": {"method": banks.__doc__.split("\n\n")[1].replace("\n", " "),
                           "patterns": {n: p.use for n, p in banks.PATTERNS.items()},
                           "cycles": bank_table(layout)},
            "targets": {"registers": MAX_REGISTERS,
                        "lds_bytes_per_dmma_fma": MAX_LDS_BYTES_PER_FMA, "spill_bytes": 0,
                        "main_loop_local_memory_instructions": MAX_MAIN_LOOP_LOCAL,
                        "judged_at_head_dims_up_to": TARGET_MAX_HEAD_DIM},
            "targets_met": all(a["targets_met"] for a in per_arch.values())}


def _fmt(x: object) -> str:
    return "-" if x is None else f"{x:.2f}" if isinstance(x, float) else str(x)


def print_tables(result: dict[str, Any]) -> None:
    """The SASS table per architecture and the bank-model table."""
    for arch, rep in result["arches"].items():
        print(f"{arch} ({rep['compiler']}, {rep['compile_seconds']} s, "
              f"{len(rep['warnings'])} warning(s))")
        print(f"  {'kernel':<28} {'smem B':>6} {'regs':>4} {'spill':>5} {'DMMA':>5} "
              f"{'DMMA FMA':>9} {'DFMA':>5} {'CALL':>4} | main loop: {'instr':>5} {'DMMA':>5} "
              f"{'DFMA':>5} {'LDS B':>6} {'B/FMA':>5} {'CALL':>4} {'inner':>5} {'copy':>4} "
              f"{'LDL':>3} {'STL':>3}  targets")
        for name, k in rep["kernels"].items():
            m = k["main_loop"] or {}
            print(f"  {name:<28} {_fmt(k['shared_bytes']):>6} {k['registers']:>4} "
                  f"{k['spill_bytes']:>5} "
                  f"{k['dmma_instructions']:>5} {k['dmma_fma']:>9} {k['dfma']:>5} "
                  f"{k['call_rel_noinc']:>4} | {'':>10} {_fmt(m.get('instructions')):>5} "
                  f"{_fmt(sum(m.get('dmma', {}).values()) if m else None):>5} "
                  f"{_fmt(m.get('dfma')):>5} {_fmt(m.get('lds_bytes')):>6} "
                  f"{_fmt(k['lds_bytes_per_dmma_fma']):>5} {_fmt(m.get('call_rel_noinc')):>4} "
                  f"{_fmt(m.get('inner_loops')):>5} {_fmt(m.get('ldgsts')):>4} "
                  f"{_fmt(m.get('local_loads')):>3} {_fmt(m.get('local_stores')):>3}  "
                  + ("" if k["judged"] else f"(D > {TARGET_MAX_HEAD_DIM}: reported, not "
                     "judged) ")
                  + ("met" if k["targets_met"] else "NOT met: " + ", ".join(
                      t for t, ok in k["targets"].items() if not ok)))
        for name, why in rep.get("not_built", {}).items():
            print(f"  {name:<28} {why}")
    table = result["bank_model"]["cycles"]
    print(f"bank model: worst shared-memory cycles per warp access; the kernels' layout: "
          f"{result['smem_layout']} ({result['smem_layout_source']})")
    for d in HEAD_DIMS:
        cols = [c for c in next(iter(table.values())) if c.startswith(f"D={d} ")]
        print(f"  {'pattern':<18} {'ideal':>5} " + " ".join(f"{c:>16}" for c in cols))
        for name, row in table.items():
            print(f"  {name:<18} {row['ideal']:>5} " + " ".join(f"{row[c]:>16}" for c in cols))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m gpu_backend.compile_check",
                                description="registers, spills and SASS of the GPU kernels "
                                "for real architectures, without a GPU")
    p.add_argument("--arch", action="append", choices=ARCHES,
                   help="architecture (repeatable; default: all of %(choices)s)")
    p.add_argument("--json", type=Path, help="also write the report as JSON to this file")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 unless every hot kernel meets issue 24's targets")
    p.add_argument("--kernel-dir", type=Path, default=KERNEL_DIR,
                   help="the kernel sources (default: the package's kernels/)")
    p.add_argument("--cubin-dir", type=Path,
                   help="also write each architecture's cubin and its record here (for "
                   "REFATTN_CUBIN_DIR: the cupy backend then loads it instead of compiling)")
    args = p.parse_args(argv)
    try:
        result = check(tuple(args.arch or ARCHES), args.kernel_dir)
    except RefAttnError as exc:
        print(f"compile_check: {exc}", file=sys.stderr)
        return 2
    for arch in result["arches"]:
        r = compile_report(arch, args.kernel_dir)
        print(f"{arch} ptxas ({r.tool})")
        for k in sorted(r.kernels.values(), key=lambda k: k.kernel):
            print(f"  {k.kernel:<28} {k.registers:>4} registers  {k.spill_stores:>3} B spill "
                  f"stores  {k.spill_loads:>3} B spill loads  {k.stack_bytes:>3} B stack")
    print_tables(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    for arch in result["arches"] if args.cubin_dir else ():
        print(f"cubin: {write_cubin(arch, args.cubin_dir, args.kernel_dir)}")
    print(f"targets (judged at D <= {TARGET_MAX_HEAD_DIM}; wider instances reported, not "
          f"judged): registers <= {MAX_REGISTERS}, no spills, LDS <= "
          f"{MAX_LDS_BYTES_PER_FMA:g} B per DMMA FMA, no CALL.REL.NOINC and at most "
          f"{MAX_MAIN_LOOP_LOCAL} local-memory (LDL/STL) instructions in every main loop")
    print(f"targets met: {result['targets_met']}")
    return 1 if args.strict and not result["targets_met"] else 0


if __name__ == "__main__":
    sys.exit(main())
