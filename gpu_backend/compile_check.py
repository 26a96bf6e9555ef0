"""Compile the kernels for real GPU architectures, without a GPU, and read ptxas's report.

Owns :func:`compile_report`: ``attention.cu`` compiled to a cubin for one architecture with
``nvcc`` (warnings are errors) or, where nvcc is absent, with NVRTC from the
``nvidia-cuda-nvrtc`` wheel (with the flags CuPy adds: ``-ftz=true
--device-as-default-execution-space``); ``-Xptxas -v`` is parsed into registers, spill bytes
and stack per kernel. ``python3 -m gpu_backend.compile_check`` prints the table.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gpu_backend.source import KERNEL_DIR, KERNELS, MAIN, translation_unit
from refattn.errors import RefAttnError

__all__ = ["CompileReport", "KernelResources", "compile_report", "nvrtc_library", "toolchain"]

ARCHES = ("sm_90", "sm_80")


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reported for one kernel."""

    kernel: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int


@dataclass(frozen=True)
class CompileReport:
    """One architecture's compile: the tool, the time, the warnings and every kernel."""

    arch: str
    tool: str
    seconds: float
    kernels: dict[str, KernelResources]
    warnings: tuple[str, ...]

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


def _parse(log: str) -> dict[str, KernelResources]:
    out: dict[str, KernelResources] = {}
    current, stack, stores, loads = None, 0, 0, 0
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = m.group(1)
        elif (m := _SPILL.search(line)) and current:
            stack, stores, loads = (int(g) for g in m.groups())
        elif (m := _REGS.search(line)) and current:
            out[current] = KernelResources(current, int(m.group(1)), stores, loads, stack)
            current = None
    return out


def _warnings(log: str) -> tuple[str, ...]:
    return tuple(line for line in log.splitlines() if "warning" in line.lower())


def _nvcc(arch: str, directory: Path) -> tuple[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            ["nvcc", f"-arch={arch}", "-cubin", "-std=c++17", "-ftz=true", "-Werror",
             "all-warnings", "-Xptxas", "-v", f"-I{directory}", "-o",
             str(Path(tmp) / "k.cubin"), str(directory / MAIN)],
            capture_output=True, text=True)
    return proc.stdout + proc.stderr, proc.returncode


def _nvrtc(arch: str, directory: Path) -> tuple[str, int]:
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
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return buffer.value.decode(errors="replace"), rc


def compile_report(arch: str = "sm_90", directory: Path = KERNEL_DIR) -> CompileReport:
    """Compile every kernel for ``arch`` and report registers, spills and warnings.

    Raises
    ------
    RefAttnError
        When no toolchain is present, or when the sources do not compile (with the log).
    """
    tool = toolchain()
    if tool is None:
        raise RefAttnError("compile check: neither nvcc nor NVRTC (pip install "
                           "nvidia-cuda-nvrtc==13.0.88) is available")
    start = time.perf_counter()
    log, rc = (_nvcc if tool == "nvcc" else _nvrtc)(arch, Path(directory).resolve())
    seconds = time.perf_counter() - start
    if rc != 0:
        raise RefAttnError(f"compile check ({tool}, {arch}): the kernels do not compile:\n"
                           f"{log[-4000:]}")
    kernels = _parse(log)
    missing = sorted(set(KERNELS) - set(kernels))
    if missing:
        raise RefAttnError(f"compile check ({tool}, {arch}): no ptxas report for {missing}")
    return CompileReport(arch, tool, seconds, kernels, _warnings(log))


def main() -> int:
    for arch in ARCHES:
        r = compile_report(arch)
        print(f"{arch} ({r.tool}, {r.seconds:.1f} s, {len(r.warnings)} warning(s))")
        for k in sorted(r.kernels.values(), key=lambda k: k.kernel):
            print(f"  {k.kernel:<28} {k.registers:>4} registers  {k.spill_stores:>3} B spill "
                  f"stores  {k.spill_loads:>3} B spill loads  {k.stack_bytes:>3} B stack")
    return 0


if __name__ == "__main__":
    sys.exit(main())
