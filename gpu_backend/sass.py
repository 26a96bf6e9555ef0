"""The SASS of a cubin, read without a GPU: instructions, loops and the counts of a main loop.

Owns finding ``cuobjdump`` and ``nvdisasm`` (the ``nvidia-cuda-cuobjdump`` and
``nvidia-cuda-nvdisasm`` wheels' ``nvidia/cu*/bin``, else ``PATH``), disassembling a cubin
(:func:`disassemble`), parsing ``cuobjdump -sass`` text into instructions per function
(:func:`parse`), and :func:`kernel_counts`: the tensor-core (DMMA) and vector (DFMA)
instructions of a kernel, its ``CALL.REL.NOINC`` sites, and the same counts inside its main loop.
What the counts mean for speed is :mod:`gpu_backend.perf_model`'s business.

Loops come from the branch structure: a branch to an address at or before its own (a back edge)
closes a loop whose body is the address range [target, the last such branch]. The *main loop*
is the smallest such loop whose natural loop (:func:`natural_loops`: its own blocks, wherever
nvcc placed them) holds at least :data:`MAIN_LOOP_SHARE` of the kernel's hot
multiply-adds (DMMA multiply-adds where the kernel has DMMA, else DFMA instructions) and whose
trip count is not a compile-time constant: the loop over key (or query) tiles, not a loop over
the head width. Its counts are those of one iteration along the *plain path*: of
the paths through the body's branches, the one doing the most DMMA work and, among those,
issuing the fewest instructions (the feature branches a plain call skips: bias, masks on
partial tiles, dropout, softcap); a loop nested inside is weighted by its trip count where
:func:`trip_count` recognises a constant counted loop, and counted once otherwise
(``inner_trips`` says which); a loop of cp.async copies (tile.cuh's ``for (e = tid; e <
CHUNKS; e += NT)``, unrolled) is counted per trip, its start taken as thread 0's (issue 43).
Such a loop that nvcc unrolls by u behind a remainder is counted right when u divides the
thread's copy count; below u copies (CHUNKS < u NT: D = 32 tiles) it reads u where thread 0
runs the remainder alone (a fully unrolled copy, as tile.cuh's hoisted one, is exact).
Beside the work, an iteration's cp.async copies and the instructions that issue them,
barriers, local-memory loads and stores (LDL/STL), global loads and the longest dependent
DMMA chain are counted: the inputs of :mod:`gpu_backend.model_bounds`. ``CALL.REL.NOINC``
sites are counted over the whole body: calls of a subroutine (the slow path of a double
division, of a math function), not the ``@P CALL.REL.NOINC <after the next>; BRA <x>``
pair with which sm_80 code leaves a loop through a reconvergence point (a call to the
instruction after its own unconditional branch: control flow, no subroutine).
"""

from __future__ import annotations

import bisect
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
           "dmma_fma", "kernel_counts", "natural_loops", "parse", "subroutine_calls",
           "tool_path", "trip_count"]

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

    @property
    def never(self) -> bool:
        """Guarded by ``@!PT`` (never true): issued, but it does nothing (nvcc pads with
        ``@!PT LDS RZ, [RZ]``), so it counts as an instruction and not as work."""
        return self.predicate == "@!PT"

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
    inner_trips: tuple[tuple[int, int, int | None], ...] = ()  # (start, end, trips or None)
    ldgsts: int = 0  # cp.async (LDGSTS) instructions executed (per lane: 16 bytes each)
    copy_instructions: int = 0  # instructions of the blocks that issue cp.async (no DMMA)
    barriers: int = 0  # BAR.* (block barriers: __syncthreads, its _or / _and votes)
    local_loads: int = 0  # LDL: local memory (the stack frame), per lane
    local_stores: int = 0  # STL
    local_bytes: int = 0  # per warp: bytes per lane x 32, loads and stores
    ldg_bytes: int = 0  # global loads (LDG) per warp
    dmma_chain: int = 0  # the most DMMAs accumulating into one register (a dependent chain)

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
    #: the main loop along the fp64-heaviest path (every branch adding vector fp64 work taken:
    #: features included), a bound on the plain path's figures from the other side
    heavy_loop: LoopCounts | None = None


_INT = re.compile(r"^-?(?:0x[0-9a-f]+|\d+)$")
_MOVES = {"MOV": 1, "UMOV": 1, "MOV32I": 1, "IMAD.MOV.U32": 3, "IMAD.MOV": 3}
_ADDS = ("VIADD", "IADD3", "UIADD3", "IADD", "IMAD.IADD")
_COMPARE = {"EQ": lambda v, n: v == n, "NE": lambda v, n: v != n, "LT": lambda v, n: v < n,
            "LE": lambda v, n: v <= n, "GT": lambda v, n: v > n, "GE": lambda v, n: v >= n}


def _constant(token: str) -> int | None:
    token = token.strip()
    if token in ("RZ", "URZ"):
        return 0
    return int(token, 0) if _INT.match(token) else None


def _ops(i: Instruction) -> list[str]:
    """The operands of ``i``, stripped of the ``.reuse`` (operand cache) flag."""
    return [o.strip().removesuffix(".reuse") for o in i.operands.split(",")]


def _dest(i: Instruction) -> str:
    return i.operands.split(",")[0].strip()


_REG = re.compile(r"^R(\d+)$")


def _writes(i: Instruction, reg: str) -> bool:
    """Whether ``i`` writes register ``reg`` (``R<n>``): its destination, or a register of a
    wide destination (a ``.64`` or fp64 result, ``CS2R``, ``IMAD.WIDE``: a pair; ``.128``: four;
    a DMMA's accumulator: four or eight)."""
    dest = _dest(i)
    if dest == reg:
        return True
    d, r = _REG.match(dest), _REG.match(reg)
    if d is None or r is None:
        return False
    width = 1
    if ".128" in i.opcode:
        width = 4
    elif i.base == "DMMA":
        width = 4 if "8x8x4" in i.opcode or i.opcode.endswith(".884") else 8
    elif (".64" in i.opcode or i.base in ("CS2R", "DADD", "DMUL", "DFMA", "MUFA")
          or i.opcode.startswith("IMAD.WIDE")):
        width = 2
    return 0 <= int(r.group(1)) - int(d.group(1)) < width


def trip_count(instrs: list[Instruction], start: int, end: int) -> int | None:
    """Iterations of the loop [start, end] when it is a plain counted loop, else None.

    The idiom nvcc emits for ``for (i = c; i < n; i += s)`` with constants: before the loop
    ``MOV``/``IMAD.MOV.U32``/``UMOV R, c`` (or ``CS2R R, SRZ``, which zeroes a register pair: c
    = 0 for either of the two); in the body ``VIADD``/``IADD3``/``UIADD3 R, R, s``
    and then ``ISETP``/``UISETP.<cmp> P, PT, R, n``; the back edge ``@P`` or ``@!P BRA``
    (possibly through ``PLOP3.LUT P, PT, PT, PT, UP, 0x80, 0x0``, a copy of a uniform
    predicate). The loop is simulated from c; anything else gives None.

    Examples
    --------
    >>> text = '''Function : k
    ...   /*0000*/   IMAD.MOV.U32 R39, RZ, RZ, RZ ;
    ...   /*0010*/   VIADD R39, R39, 0x8 ;
    ...   /*0020*/   ISETP.GE.U32.AND P1, PT, R39, 0x40, PT ;
    ...   /*0030*/   DMMA.16x8x4 R8, R2, R4, R8 ;
    ...   /*0040*/   @!P1 BRA 0x10 ;'''
    >>> trip_count(parse(text)["k"], 0x10, 0x40)
    8
    """
    branch = next((i for i in instrs if i.address == end), None)
    if branch is None or not branch.predicate:
        return None
    negated = "!" in branch.predicate
    pred = branch.predicate.lstrip("@!")
    body = [i for i in instrs if start <= i.address < end]
    setter = next((i for i in reversed(body) if _dest(i) == pred), None)
    if setter is not None and setter.opcode == "PLOP3.LUT":
        ops = _ops(setter)
        if ops[1:4] != ["PT", "PT", "PT"] or ops[5:7] != ["0x80", "0x0"]:
            return None
        pred = ops[4]
        setter = next((i for i in reversed(body)
                       if i.address < setter.address and _dest(i) == pred), None)
    if setter is None or setter.base not in ("ISETP", "UISETP"):
        return None
    parts = setter.opcode.split(".")
    ops = _ops(setter)
    if len(parts) < 2 or parts[1] not in _COMPARE or len(ops) < 4:
        return None
    reg, limit = ops[2], _constant(ops[3])
    adds = [i for i in body if i.opcode in _ADDS
            and _ops(i)[:2] == [reg, reg]]
    if limit is None or len(adds) != 1:
        return None
    after = adds[0].address > setter.address  # the compare reads the value before the add
    step = _constant(_ops(adds[0])[2])
    copy_loop = any(i.base == "LDGSTS" for i in body)
    init = _start_value(instrs, reg, start, thread0=copy_loop)
    if init is None or not step:
        return None
    compare = _COMPARE[parts[1]]
    v, trips = init, 0
    while trips < 1 << 16:
        trips += 1
        if after:
            ends = compare(v, limit) == negated
            v += step
        else:
            v += step
            ends = compare(v, limit) == negated
        if ends:  # the branch falls through: the loop ends
            return trips
    return None


def _start_value(instrs: list[Instruction], reg: str, before: int, *, thread0: bool = False,
                 depth: int = 0) -> int | None:
    """The value of ``reg`` on entry to the code at ``before``: its last unpredicated write
    in address order (a constant move, or ``CS2R R, SRZ``); with ``thread0`` (a cp.async
    loop's counter, ``e = tid; e < CHUNKS; e += NT``) also through register moves and
    constant adds (``VIADD``/``IADD3 R, Rx, c``) down to a register whose value is not a
    constant, taken as 0: the block's thread 0, whose copy count is the largest."""
    for i in reversed([i for i in instrs if i.address < before]):
        if not _writes(i, reg):
            continue
        ops_i = _ops(i)
        if i.predicate:
            return 0 if thread0 else None
        if i.opcode in _MOVES and len(ops_i) > _MOVES[i.opcode]:
            value = _constant(ops_i[_MOVES[i.opcode]])
            if value is None and thread0 and depth < 8 and _REG.match(ops_i[_MOVES[i.opcode]]):
                return _start_value(instrs, ops_i[_MOVES[i.opcode]], i.address,
                                    thread0=True, depth=depth + 1)
            return value if value is not None else (0 if thread0 else None)
        if i.opcode == "CS2R" and ops_i[1:] == ["SRZ"]:
            return 0
        if thread0 and i.opcode in _ADDS and depth < 8:
            regs = [o for o in ops_i[1:] if _REG.match(o)]
            consts = [_constant(o) for o in ops_i[1:] if not _REG.match(o)]
            if len(regs) == 1 and consts and all(c is not None for c in consts):
                base = _start_value(instrs, regs[0], i.address, thread0=True, depth=depth + 1)
                return None if base is None else base + sum(c for c in consts if c)
        return 0 if thread0 else None
    return 0 if thread0 else None


def _data_dependent(body: list[Instruction], position: int) -> bool:
    """Whether the predicate of the branch at ``body[position]`` comes from a floating-point
    compare (DSETP/FSETP)."""
    pred = body[position].predicate.lstrip("@!")
    for i in reversed(body[:position]):
        if _dest(i) == pred:
            return i.base in ("DSETP", "FSETP")
    return False


def _blocks(body: list[Instruction], start: int, end: int) -> list[list[Instruction]]:
    """The basic blocks of ``body`` (the instructions of [start, end]): a block starts at
    the range's start, after a branch or exit, and at a forward branch's target."""
    leaders = {body[0].address} if body else set()
    for n, i in enumerate(body):
        t = i.branch_target()
        if i.base in ("BRA", "BRX", "EXIT", "RET") and n + 1 < len(body):
            leaders.add(body[n + 1].address)
        if t is not None and start < t <= end and t > i.address:
            leaders.add(t)
    blocks: list[list[Instruction]] = []
    for i in body:
        if i.address in leaders:
            blocks.append([])
        blocks[-1].append(i)
    return blocks


def _plain_path(instrs: list[Instruction], start: int, end: int,
                weight: dict[int, int], hot: str = "dmma_fma", heavy: bool = False,
                copy_loops: tuple[tuple[int, int], ...] = ()) -> set[int]:
    """Addresses on one iteration's path through [start, end] that does the most ``hot`` work
    (DMMA multiply-adds, or DFMA instructions in a kernel without DMMA),
    then the most cp.async copies (the next tile's prefetch: where the range holds a loop of
    copies, ``copy_loops``, only that loop's copies count, not the remainder copies an
    unrolled loop issues before it); among those, it skips what a
    branch on an integer condition can skip (features a plain call does not use) but not
    what a branch on a floating-point compare (DSETP/FSETP: data, such as a masked score's
    skipped exp) would skip.

    The body's basic blocks form a DAG over forward branches and fall-throughs (back edges
    of inner loops are not followed: their bodies count ``weight`` times; a branch out of
    the range or to the loop head ends the path). A predicated branch has both successors.
    A branch on a floating-point compare diverges: lanes of one warp take both ways, and the
    warp runs both, so every block from it to its reconvergence point (the target of the
    ``BSSY`` before it) is on the path, not the heavier way alone (CUDA's ``tanh``: 20 and 13
    fp64 instructions, 33 when its lanes diverge).

    >>> text = '''Function : k
    ...   /*0000*/   BSSY B0, 0x50 ;
    ...   /*0010*/   DSETP.GE.AND P0, PT, R2, R4, PT ;
    ...   /*0020*/   @!P0 BRA 0x40 ;
    ...   /*0030*/   BRA 0x50 ;
    ...   /*0040*/   DFMA R2, R2, R4, R6 ;
    ...   /*0050*/   BSYNC B0 ;'''
    >>> sorted(_plain_path(parse(text)["k"], 0, 0x50, {}, "dfma", True))
    [0, 16, 32, 48, 64, 80]
    """
    body = [i for i in instrs if start <= i.address <= end]
    if not body:
        return set()
    blocks = _blocks(body, start, end)
    index = {b[0].address: n for n, b in enumerate(blocks)}
    # per block ending in a diverging branch: the blocks up to its reconvergence point
    diverged: dict[int, range] = {}
    in_copy_loop = {i.address for s, e in copy_loops for i in body if s <= i.address <= e}
    position = {i.address: n for n, i in enumerate(body)}
    best: list[tuple[int, int, int, int | None]] = [(0, 0, 0, None)] * len(blocks)
    totals: list[tuple[int, int, int]] = [(0, 0, 0)] * len(blocks)  # each block's own
    for n in range(len(blocks) - 1, -1, -1):
        block = blocks[n]
        if hot == "dmma_fma":
            fma = sum(weight.get(i.address, 1) * dmma_fma(i.opcode) for i in block
                      if i.base == "DMMA")
        else:  # a kernel without DMMA: its DFMA work
            fma = sum(weight.get(i.address, 1) for i in block if i.base == "DFMA")
        cost = sum(weight.get(i.address, 1) for i in block if i.base != "NOP")
        # copies outside a copy loop in a range that has one: the remainder an unrolled
        # copy loop runs first (none for thread 0 when the unroll divides its count)
        copies = sum(weight.get(i.address, 1) for i in block if i.base == "LDGSTS"
                     and (not copy_loops or i.address in in_copy_loop))
        if heavy:  # the fp64-heaviest path: every branch that adds vector fp64 work taken
            copies = copies * 10**9 + sum(weight.get(i.address, 1) for i in block
                                          if i.base in ("DFMA", "DADD", "DMUL"))
        last = block[-1]
        t = last.branch_target()
        succ: list[int | None] = []
        falls = n + 1 < len(blocks)
        if last.base in ("EXIT", "RET", "BRX"):
            falls = falls and bool(last.predicate)
        elif t is not None and t > last.address:  # forward: taken, and untaken if guarded
            succ.append(index.get(t))  # None: out of the range, the path ends
            falls = falls and bool(last.predicate)
        elif t is not None and (t == start or t > end or last.address == end):
            falls = falls and bool(last.predicate)  # the main loop's own back edge
        if falls:
            succ.append(n + 1)
        options = [(0, 0, 0, None) if s is None else (*best[s][:3], s) for s in succ]
        data = len(succ) == 2 and _data_dependent(body, position[last.address])
        sign = 1 if data else -1
        join = _reconvergence(body, position[last.address]) if data else None
        # the block holding the reconvergence point (both ways end there)
        jb = (max(k for k, b in enumerate(blocks) if b[0].address <= join)
              if join is not None and join <= end else None)
        if jb is not None and jb > n and all(s is not None and s <= jb for s in succ):
            region = range(n + 1, jb)
            f3, g3, c3 = (sum(parts) for parts in zip(*(totals[k] for k in region),
                                                       best[jb][:3], strict=True))
            options = [(f3, g3, c3, jb)]
            diverged[n] = region
        f, g, c, s = (max(options, key=lambda o: (o[0], o[1], sign * o[2])) if options
                      else (0, 0, 0, None))
        totals[n] = (fma, copies, cost)
        best[n] = (fma + f, copies + g, cost + c, s)
    path: set[int] = set()
    cur: int | None = 0
    while cur is not None:
        path.update(i.address for i in blocks[cur])
        for k in diverged.get(cur, ()):
            path.update(i.address for i in blocks[k])
        cur = best[cur][3]
    return path


def _reconvergence(body: list[Instruction], position: int) -> int | None:
    """The reconvergence point of the branch at ``body[position]``: the target of the last
    ``BSSY`` before it whose target lies after it, or None."""
    for i in reversed(body[:position]):
        if i.base == "BSSY":
            m = _BRANCH_TARGET.search(i.operands)
            if m is not None and int(m.group(1), 16) > body[position].address:
                return int(m.group(1), 16)
    return None


def subroutine_calls(instrs: list[Instruction], start: int, end: int) -> int:
    """``CALL.REL.NOINC`` sites in [start, end] that call a subroutine: not sm_80's
    call-to-the-instruction-after-the-next-unconditional-``BRA`` (a loop exit's reconvergence
    point, see the module docstring).

    >>> text = '''Function : k
    ...   /*0000*/   @P6 CALL.REL.NOINC 0x20 ;
    ...   /*0010*/   BRA 0x40 ;
    ...   /*0020*/   NOP ;
    ...   /*0030*/   CALL.REL.NOINC 0x50 ;
    ...   /*0040*/   EXIT ;
    ...   /*0050*/   RET.REL.NODEC R4 0x0 ;'''
    >>> subroutine_calls(parse(text)["k"], 0, 0x50)
    1
    """
    n = 0
    for k, i in enumerate(instrs):
        if not (start <= i.address <= end and i.opcode.startswith("CALL.REL.NOINC")):
            continue
        after = instrs[k + 1] if k + 1 < len(instrs) else None
        target = _BRANCH_TARGET.search(i.operands)
        if (after is not None and after.base == "BRA" and not after.predicate
                and target is not None
                and int(target.group(1), 16) == 2 * after.address - i.address):
            continue  # reconvergence idiom
        n += 1
    return n


_TOKEN = re.compile(r"(?<![\w.])(U?R\d+|U?P\d)(\.64)?")


def _registers(text: str) -> set[str]:
    """The registers and predicates named in operand text (a ``.64`` operand names a pair).

    >>> sorted(_registers("[R25+0x800], desc[UR8][R20.64], !P3"))
    ['P3', 'R20', 'R21', 'R25', 'UR8']
    """
    out: set[str] = set()
    for m in _TOKEN.finditer(text):
        out.add(m.group(1))
        if m.group(2) and m.group(1).lstrip("U").startswith("R"):
            prefix = "UR" if m.group(1).startswith("U") else "R"
            out.add(f"{prefix}{int(m.group(1).lstrip('U')[1:]) + 1}")
    return out


def _copy_slice(path: list[Instruction]) -> set[int]:
    """The cp.async instructions of ``path`` (in address order) and, going backwards, every
    instruction that writes a register or predicate one of them (or an instruction already
    taken) reads: the copies' address and predicate arithmetic, plus the ``@!PT LDS`` pads
    nvcc puts right before an LDGSTS.

    >>> text = '''Function : k
    ...   /*0000*/   IMAD.SHL.U32 R4, R0, 0x10, RZ ;
    ...   /*0010*/   DMMA.884 R8, R20, R22, R8 ;
    ...   /*0020*/   IADD3 R6, P0, R4, R2, RZ ;
    ...   /*0030*/   @!PT LDS RZ, [RZ] ;
    ...   /*0040*/   LDGSTS.E.BYPASS.128 [R5], desc[UR8][R6.64] ;'''
    >>> sorted(_copy_slice(parse(text)["k"]))
    [0, 32, 48, 64]
    """
    live: set[str] = set()
    out: set[int] = set()
    pad_ok = False
    for i in reversed(path):
        if i.base == "LDGSTS" and not i.never:
            out.add(i.address)
            live |= _registers(i.operands) | _registers(i.predicate)
            pad_ok = True
            continue
        if i.never and pad_ok:
            out.add(i.address)
            continue
        pad_ok = False
        ops = _ops(i)
        dests = _registers(ops[0]) if ops and ops[0] else set()
        if len(ops) > 1 and re.fullmatch(r"U?P\d", ops[1]):  # a carry or second predicate
            dests.add(ops[1])
        if i.base == "DMMA" or not dests:
            continue
        for d in [d for d in dests if re.fullmatch(r"R\d+", d)]:
            for k in range(1, 8):  # the rest of a wide destination (a pair, a quad)
                if _writes(i, f"R{int(d[1:]) + k}"):
                    dests.add(f"R{int(d[1:]) + k}")
        if dests & live:
            out.add(i.address)
            live -= dests
            live |= _registers(",".join(ops[1:])) | _registers(i.predicate)
    return out


def _dmma_chain(work: list[tuple[Instruction, int]]) -> int:
    """The longest run of dependent DMMAs (``DMMA Rd, Ra, Rb, Rc``: Rd extends Rc's chain,
    ``RZ`` or a register no DMMA wrote starts one) along ``work`` (instruction, weight) in
    address order, a register move carrying a chain on and any other write to its register
    ending it (a load, a zeroing). A run of instructions of weight t > 1 (an inner loop of t
    trips) is followed t times, so a chain crosses the trips through whatever registers the
    compiler rotates the accumulators in.

    >>> text = '''Function : k
    ...   /*0000*/   DMMA.884 R8, R20, R22, R8 ;
    ...   /*0010*/   DMMA.884 R8, R20, R22, R8 ;
    ...   /*0020*/   LDS.64 R8, [R0] ;
    ...   /*0030*/   DMMA.884 R8, R20, R22, R8 ;'''
    >>> ins = parse(text)["k"]
    >>> _dmma_chain([(i, 1) for i in ins]), _dmma_chain([(i, 3) for i in ins])
    (2, 3)
    >>> _dmma_chain([(i, 3) for i in ins if i.base == "DMMA"])
    9
    >>> two = '''Function : k
    ...   /*0000*/   DMMA.884 R8, R20, R22, RZ ;
    ...   /*0010*/   DMMA.884 R12, R20, R22, R8 ;
    ...   /*0020*/   LDS.64 R8, [R0] ;
    ...   /*0030*/   DMMA.884 R8, R20, R22, R12 ;'''
    >>> _dmma_chain([(i, 1) for i in parse(two)["k"]])
    3
    """
    segments: list[tuple[list[Instruction], int]] = []
    for i, w in work:
        if segments and segments[-1][1] == w:
            segments[-1][0].append(i)
        else:
            segments.append(([i], w))
    current: Counter[str] = Counter()
    best = 0
    for seg, w in segments:
        for _ in range(min(w, 4096) if any(i.base == "DMMA" for i in seg) else 1):
            for i in seg:
                ops = _ops(i)
                if i.base == "DMMA" and len(ops) == 4:
                    current[ops[0]] = current[ops[3]] + 1  # Rc may be another register
                    best = max(best, current[ops[0]])
                    continue
                for r in [r for r in current if current[r] and _writes(i, r)]:
                    current[r] = 0
                if i.opcode in _MOVES and len(ops) > _MOVES[i.opcode] and not i.predicate:
                    current[ops[0]] = current[ops[_MOVES[i.opcode]]]  # a move carries it
    return best


def _range_counts(instrs: list[Instruction], start: int, end: int,
                  loops: list[tuple[int, int]], *, expand: bool = False,
                  hot: str = "dmma_fma", heavy: bool = False) -> LoopCounts:
    """Counts over [start, end]; ``expand``: along :func:`_plain_path` only, inner loops
    weighted by their trip counts where :func:`trip_count` finds them (else once). Calls are
    counted over the whole range."""
    inner = [(s, e) for s, e in loops if start <= s and e <= end and (s, e) != (start, end)]
    found = {(s, e): trip_count(instrs, s, e) if expand else None for s, e in inner}
    weight: dict[int, int] = {}
    for i in instrs:
        if start <= i.address <= end:
            w = 1
            for (s, e), t in found.items():
                if t and s <= i.address <= e:
                    w *= t
            weight[i.address] = w
    copy_loops = tuple((s, e) for s, e in inner if any(
        i.base == "LDGSTS" for i in instrs if s <= i.address <= e))
    path = (_plain_path(instrs, start, end, weight, hot, heavy, copy_loops) if expand
            else set(weight))
    calls = subroutine_calls(instrs, start, end)
    body = [(i, weight[i.address]) for i in instrs
            if i.address in path and i.base != "NOP"]
    work = [(i, w) for i, w in body if not i.never]  # what executes (issue: all of body)
    ranged = [i for i in instrs if start <= i.address <= end]
    copy_blocks = {i.address for b in _blocks(ranged, start, end)
                   if any(i.base == "LDGSTS" and not i.never for i in b)
                   and not any(i.base == "DMMA" for i in b) for i in b}
    # in blocks that also compute: the copies and what computes their operands
    copy_blocks |= _copy_slice([i for i, _ in body if i.address not in copy_blocks])
    local = [(i, w) for i, w in work if i.base in ("LDL", "STL")]
    dmma: Counter[str] = Counter()
    lds: Counter[str] = Counter()
    for i, w in work:
        if i.base == "DMMA":
            dmma[i.opcode] += w
        elif i.base == "LDS":
            lds[i.opcode] += w
    return LoopCounts(
        start, end, sum(w for _, w in body), dict(dmma),
        sum(n * dmma_fma(op) for op, n in dmma.items()),
        sum(w for i, w in work if i.base == "DFMA"),
        sum(w for i, w in work if i.base in ("DFMA", "DADD", "DMUL")), dict(lds),
        32 * sum(n * lds_bytes(op) for op, n in lds.items()),
        32 * sum(w * lds_bytes(i.opcode) for i, w in work if i.base == "STS"),
        32 * sum(w * lds_bytes(i.opcode) for i, w in work if i.base == "LDGSTS"),
        calls, len(inner),
        tuple((s, e, found[(s, e)]) for s, e in inner) if expand else (),
        ldgsts=sum(w for i, w in work if i.base == "LDGSTS"),
        copy_instructions=sum(w for i, w in body if i.address in copy_blocks),
        barriers=sum(w for i, w in work if i.base == "BAR"),
        local_loads=sum(w for i, w in local if i.base == "LDL"),
        local_stores=sum(w for i, w in local if i.base == "STL"),
        local_bytes=32 * sum(w * lds_bytes(i.opcode) for i, w in local),
        ldg_bytes=32 * sum(w * lds_bytes(i.opcode) for i, w in work if i.base == "LDG"),
        dmma_chain=_dmma_chain(work))


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
    ends: dict[int, int] = {}  # loop head -> its last back edge (continue edges merge)
    for i in instrs:
        if (t := i.branch_target()) is not None and t <= i.address:
            ends[t] = max(ends.get(t, i.address), i.address)
    loops = sorted(ends.items())
    end = instrs[-1].address if instrs else 0
    total = _range_counts(instrs, 0, end, loops)
    hot_total, weight = ((total.dmma_fma, "dmma_fma") if total.dmma_fma
                         else (total.dfma, "dfma"))
    main = heavy = None
    notes: list[str] = []
    if hot_total:
        # hot work before each instruction (prefix sums): a loop's share in O(log n)
        addresses = [i.address for i in instrs]
        prefix = [0]
        for i in instrs:
            hot = (dmma_fma(i.opcode) if i.base == "DMMA" else 0) if weight == "dmma_fma" \
                else int(i.base == "DFMA")
            prefix.append(prefix[-1] + hot)

        def share(s: int, e: int) -> int:
            return prefix[bisect.bisect_right(addresses, e)] - prefix[
                bisect.bisect_left(addresses, s)]

        hot_of = {i.address: ((dmma_fma(i.opcode) if i.base == "DMMA" else 0)
                              if weight == "dmma_fma" else int(i.base == "DFMA"))
                  for i in instrs}
        bodies = natural_loops(instrs)
        candidates = []
        for s, e in loops:
            if share(s, e) < MAIN_LOOP_SHARE * hot_total or trip_count(instrs, s, e) is not None:
                continue
            body = bodies.get(s, set())  # the loop's own code, wherever nvcc placed it
            if sum(hot_of[a] for a in body) >= MAIN_LOOP_SHARE * hot_total:
                candidates.append((len(body), e - s, s, e))
        if candidates:
            *_, s, e = min(candidates)
            main = _range_counts(instrs, s, e, loops, expand=True, hot=weight)
            heavy = _range_counts(instrs, s, e, loops, expand=True, hot=weight, heavy=True)
        else:
            notes.append(f"no loop holds {MAIN_LOOP_SHARE:.0%} of the {weight}")
    if main is not None and main.inner_loops:
        unknown = sum(1 for *_, t in main.inner_trips if t is None)
        notes.append(f"{main.inner_loops} loop(s) nested in the main loop: "
                     f"{main.inner_loops - unknown} weighted by their trip counts, "
                     f"{unknown} counted once (trip count not a constant)")
    return KernelCounts(name, total, tuple(loops), main, tuple(notes), heavy)


def natural_loops(instrs: list[Instruction]) -> dict[int, set[int]]:
    """The instructions (addresses) of each loop, by its head: the head and every instruction
    of a basic block from which a back edge (a branch to an address at or before its own) is
    reached without passing the head: the natural loop of the control-flow graph, which holds
    a loop's own code wherever the compiler laid it out, and not the unrelated code that lies
    between a head and a far latch in address order. A head that the function's entry can
    get around to reach its latch does not dominate it: no natural loop, not listed.

    >>> text = '''Function : k
    ...   /*0000*/   MOV R1, R2 ;
    ...   /*0010*/   @P0 BRA 0x40 ;
    ...   /*0020*/   DMMA.884 R4, R4, R6, R4 ;
    ...   /*0030*/   EXIT ;
    ...   /*0040*/   DADD R8, R8, R8 ;
    ...   /*0050*/   BRA 0x0 ;'''
    >>> sorted(natural_loops(parse(text)["k"])[0])
    [0, 16, 64, 80]
    """
    if not instrs:
        return {}
    leaders = {instrs[0].address}
    for n, i in enumerate(instrs):
        t = i.branch_target()
        if t is not None:
            leaders.add(t)
        if i.base in ("BRA", "BRX", "EXIT", "RET") and n + 1 < len(instrs):
            leaders.add(instrs[n + 1].address)
    blocks: list[list[Instruction]] = []
    for i in instrs:
        if i.address in leaders or not blocks:
            blocks.append([])
        blocks[-1].append(i)
    index = {b[0].address: n for n, b in enumerate(blocks)}
    preds: list[list[int]] = [[] for _ in blocks]
    latches: dict[int, list[int]] = {}
    for n, b in enumerate(blocks):
        last = b[-1]
        t = last.branch_target()
        succ = []
        if t is not None and t in index:
            succ.append(index[t])
            if t <= last.address:
                latches.setdefault(index[t], []).append(n)
        ends = last.base in ("EXIT", "RET", "BRX") or (last.base == "BRA")
        if (not ends or last.predicate) and n + 1 < len(blocks):
            succ.append(n + 1)
        for m in succ:
            preds[m].append(n)
    out: dict[int, set[int]] = {}
    for head, tails in latches.items():
        seen = {head}
        stack = [t for t in tails if t != head]
        seen.update(stack)
        while stack:
            for m in preds[stack.pop()]:
                if m not in seen:
                    seen.add(m)
                    stack.append(m)
        if head != 0 and 0 in seen:  # the entry reaches a latch around the head: the head
            continue  # does not dominate it, no natural loop (a jump into a loop's middle)
        out[blocks[head][0].address] = {i.address for n in seen for i in blocks[n]}
    return out


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
    cuobjdump, nvdisasm = str(tools["cuobjdump"]), str(tools["nvdisasm"])
    env = {**os.environ, "NVDISASM_PATH": str(Path(nvdisasm).parent)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        proc = subprocess.run([cuobjdump, "-sass", str(path)], capture_output=True,
                              text=True, env=env, timeout=300)
    if proc.returncode != 0:
        raise RefAttnError(f"SASS: cuobjdump failed: {proc.stderr.strip()[-2000:]}")
    return proc.stdout
