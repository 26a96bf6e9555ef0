"""The SASS of a cubin, read without a GPU: instructions, loops and the counts of a main loop.

Owns finding ``cuobjdump`` and ``nvdisasm`` (the ``nvidia-cuda-cuobjdump`` and
``nvidia-cuda-nvdisasm`` wheels' ``nvidia/cu*/bin``, else ``PATH``), disassembling a cubin
(:func:`disassemble`), parsing ``cuobjdump -sass`` text into instructions per function
(:func:`parse`), and :func:`kernel_counts`: the tensor-core (DMMA) and vector (DFMA)
instructions of a kernel, its ``CALL.REL.NOINC`` sites, and the same counts inside its main loop.
What the counts mean for speed is :mod:`gpu_backend.perf_model`'s business.

Loops come from the branch structure: a branch to an address at or before its own (a back edge)
closes a loop whose body is the address range [target, branch]. The *main loop* is the
innermost such range that holds at least :data:`MAIN_LOOP_SHARE` of the kernel's hot
multiply-adds (DMMA multiply-adds where the kernel has DMMA, else DFMA instructions): the loop
over key (or query) tiles. Counts inside it are static, per iteration; a loop nested inside it
(``inner_loops`` > 0) is counted once, so its trip count is not in the figures.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from refattn.errors import RefAttnError

__all__ = ["MAIN_LOOP_SHARE", "Instruction", "KernelCounts", "LoopCounts", "disassemble",
           "dmma_fma", "kernel_counts", "parse", "tool_path"]

#: share of a kernel's hot multiply-adds a loop must hold to be its main loop
MAIN_LOOP_SHARE = 0.8

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)\s*([^;]*);")
_FUNC = re.compile(r"Function : (\S+)")
_BRANCH_TARGET = re.compile(r"(?:^|[\s,])(0x[0-9a-f]+)\s*$")
_DMMA_SHAPE = re.compile(r"^DMMA\.(?:(\d+)x(\d+)x(\d+)|(\d)(\d)(\d))")
_LOAD_WIDTH = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


@dataclass(frozen=True)
class Instruction:
    """One SASS instruction: byte offset in its function, guard predicate, opcode, operands."""

    address: int
    predicate: str
    opcode: str  # mnemonic with modifiers, e.g. "DMMA.16x8x4", "LDS.64", "CALL.REL.NOINC"
    operands: str

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    def branch_target(self) -> int | None:
        """The target of a BRA (an absolute offset in cuobjdump's output), else None."""
        if self.base != "BRA":
            return None
        m = _BRANCH_TARGET.search(self.operands)
        return int(m.group(1), 16) if m else None


def dmma_fma(opcode: str) -> int:
    """Multiply-adds per warp of one DMMA instruction: M x N x K of its shape.

    sm_80's ``DMMA.884`` and sm_90's ``DMMA.8x8x4`` are ``mma.sync.m8n8k4`` (256);
    ``DMMA.16x8x4`` / ``16x8x8`` / ``16x8x16`` are m16n8k4/k8/k16 (512, 1024, 2048).

    Examples
    --------
    >>> dmma_fma("DMMA.884"), dmma_fma("DMMA.16x8x4"), dmma_fma("DMMA.16x8x16")
    (256, 512, 2048)
    """
    m = _DMMA_SHAPE.match(opcode)
    if not m:
        raise RefAttnError(f"SASS: unknown DMMA shape {opcode!r}")
    a, b, c = (int(x) for x in (m.group(1, 2, 3) if m.group(1) else m.group(4, 5, 6)))
    return a * b * c


def lds_bytes(opcode: str) -> int:
    """Bytes per lane of a shared-memory load or store (``LDS``, ``LDS.64``, ``STS.128``...).

    >>> lds_bytes("LDS.64"), lds_bytes("LDS"), lds_bytes("STS.U8")
    (8, 4, 1)
    """
    for mod in opcode.split(".")[1:]:
        if mod in _LOAD_WIDTH:
            return _LOAD_WIDTH[mod]
    return 4


def parse(text: str) -> dict[str, list[Instruction]]:
    """``cuobjdump -sass`` text -> the instructions of each function, in address order.

    Examples
    --------
    >>> text = '''Function : k
    ...         /*0000*/                   DMMA.884 R4, R4, R6, RZ ;   /* 0x0 */
    ...         /*0010*/               @P0 BRA 0x0 ;                    /* 0x0 */'''
    >>> [(i.address, i.opcode, i.branch_target()) for i in parse(text)["k"]]
    [(0, 'DMMA.884', None), (16, 'BRA', 0)]
    """
    out: dict[str, list[Instruction]] = {}
    current: list[Instruction] | None = None
    for line in text.splitlines():
        if m := _FUNC.search(line):
            current = out.setdefault(m.group(1), [])
        elif current is not None and (m := _INSTR.search(line)):
            current.append(Instruction(int(m.group(1), 16), (m.group(2) or "").strip(),
                                       m.group(3), m.group(4).strip()))
    return out


@dataclass(frozen=True)
class LoopCounts:
    """Static counts over an address range (one iteration of a loop, inner loops once)."""

    start: int
    end: int
    instructions: int  # NOPs excluded
    dmma: dict[str, int]
    dmma_fma: int
    dfma: int
    fp64_vector: int  # DFMA, DADD, DMUL: the vector fp64 pipe's instructions
    lds: dict[str, int]
    lds_bytes: int  # per warp: bytes per lane x 32
    sts_bytes: int
    ldgsts_bytes: int  # cp.async into shared memory
    calls: int  # CALL.REL.NOINC sites
    inner_loops: int

    @property
    def lds_bytes_per_dmma_fma(self) -> float | None:
        return self.lds_bytes / self.dmma_fma if self.dmma_fma else None


@dataclass(frozen=True)
class KernelCounts:
    """A kernel's whole-body counts, its loops and its main loop (None if it has none)."""

    name: str
    total: LoopCounts
    loops: tuple[tuple[int, int], ...]
    main_loop: LoopCounts | None
    notes: tuple[str, ...] = field(default=())


def _range_counts(instrs: list[Instruction], start: int, end: int,
                  loops: list[tuple[int, int]]) -> LoopCounts:
    body = [i for i in instrs if start <= i.address <= end and i.base != "NOP"]
    dmma = Counter(i.opcode for i in body if i.base == "DMMA")
    lds = Counter(i.opcode for i in body if i.base == "LDS")
    inner = sum(1 for s, e in loops if start <= s and e <= end and (s, e) != (start, end))
    return LoopCounts(
        start, end, len(body), dict(dmma), sum(n * dmma_fma(op) for op, n in dmma.items()),
        sum(1 for i in body if i.base == "DFMA"),
        sum(1 for i in body if i.base in ("DFMA", "DADD", "DMUL")), dict(lds),
        32 * sum(n * lds_bytes(op) for op, n in lds.items()),
        32 * sum(lds_bytes(i.opcode) for i in body if i.base == "STS"),
        32 * sum(lds_bytes(i.opcode) for i in body if i.base == "LDGSTS"),
        sum(1 for i in body if i.opcode.startswith("CALL.REL.NOINC")), inner)


def kernel_counts(name: str, instrs: list[Instruction]) -> KernelCounts:
    """Counts of one function, and its main loop found from the back edges (module docstring).

    Examples
    --------
    >>> text = '''Function : k
    ...   /*0000*/   MOV R1, R2 ;
    ...   /*0010*/   LDS.64 R4, [R0] ;
    ...   /*0020*/   DMMA.884 R4, R4, R6, RZ ;
    ...   /*0030*/   @P0 BRA 0x10 ;
    ...   /*0040*/   EXIT ;'''
    >>> k = kernel_counts("k", parse(text)["k"])
    >>> k.main_loop.dmma_fma, k.main_loop.lds_bytes, k.main_loop.lds_bytes_per_dmma_fma
    (256, 256, 1.0)
    """
    loops = sorted({(t, i.address) for i in instrs
                    if (t := i.branch_target()) is not None and t <= i.address})
    end = instrs[-1].address if instrs else 0
    total = _range_counts(instrs, 0, end, loops)
    hot_total, weight = ((total.dmma_fma, "dmma_fma") if total.dmma_fma
                         else (total.dfma, "dfma"))
    main = None
    notes: list[str] = []
    if hot_total:
        candidates = [(e - s, s, e) for s, e in loops
                      if getattr(_range_counts(instrs, s, e, loops), weight)
                      >= MAIN_LOOP_SHARE * hot_total]
        if candidates:
            _, s, e = min(candidates)
            main = _range_counts(instrs, s, e, loops)
        else:
            notes.append(f"no loop holds {MAIN_LOOP_SHARE:.0%} of the {weight}")
    if main is not None and main.inner_loops:
        notes.append(f"{main.inner_loops} loop(s) nested in the main loop are counted once")
    return KernelCounts(name, total, tuple(loops), main, tuple(notes))


def _wheel_bins() -> list[str]:
    roots = [sysconfig.get_paths()["purelib"], *sys.path]
    return [d for r in roots if r for d in sorted(glob.glob(os.path.join(r, "nvidia", "cu*",
                                                                         "bin")))]


def tool_path(name: str) -> str | None:
    """``cuobjdump`` or ``nvdisasm``: from the nvidia-cuda-* wheels, else PATH, else None.

    >>> tool_path("no-such-tool") is None
    True
    """
    for d in _wheel_bins():
        if os.access(os.path.join(d, name), os.X_OK):
            return os.path.join(d, name)
    return shutil.which(name)


def disassemble(cubin: bytes) -> str:
    """``cuobjdump -sass`` of a cubin (cuobjdump runs nvdisasm, found the same way).

    Raises
    ------
    RefAttnError
        When a tool is missing (saying which wheel to install) or fails.
    """
    tools = {t: tool_path(t) for t in ("cuobjdump", "nvdisasm")}
    missing = [t for t, p in tools.items() if p is None]
    if missing:
        raise RefAttnError(
            f"SASS: {' and '.join(missing)} not found; pip install "
            + " ".join(f"nvidia-cuda-{t}" for t in missing)
            + " (or put the CUDA toolkit's bin on PATH)")
    env = {**os.environ, "NVDISASM_PATH": str(Path(tools["nvdisasm"]).parent)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        proc = subprocess.run([tools["cuobjdump"], "-sass", str(path)], capture_output=True,
                              text=True, env=env, timeout=300)
    if proc.returncode != 0:
        raise RefAttnError(f"SASS: cuobjdump failed: {proc.stderr.strip()[-2000:]}")
    return proc.stdout
