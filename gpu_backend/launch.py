"""The host side of the GPU path: one program that drives the kernels on a GPU or the emulator.

Owns turning a validated :class:`~refattn.AttentionCall` into the kernels' argument tables
(``abi.py``), choosing the kernel instance (head width D, zero-padding q, k, v and G_O up to
it) and checking its shared memory against the device, launching the forward,
backward and trace kernels through a :class:`Device` (CuPy on a GPU, or the CPU emulator: the
same ``kernel(grid, block, args, shared_mem=...)`` calls) and assembling refattn's
:class:`~refattn.Trace` and :class:`~refattn.Gradients` from the results, with numpy arrays
out. Bad input is refused before any launch: an unsupported score family, shapes beyond the
kernels' 32-bit index ranges, head widths without an instance, an instance whose shared memory
exceeds the device's per-block limit, a kernel argument that is not a C-contiguous array, and
(on a GPU) a call whose buffers exceed the free device memory, each with a RefAttnError naming
the tensor and the limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from gpu_backend.abi import INT_PARAMS, POINTERS, REAL_PARAMS
from gpu_backend.source import (
    A_GLOBAL_ABOVE,
    EXP_TABLE_DOUBLES,
    FEATURE_SETS,
    INSTANCES,
    PAIRED,
    kernel_name,
)
from refattn.call import AttentionCall
from refattn.call.gate import check_head_map
from refattn.call.placement import operand_multipliers
from refattn.dropout import Philox
from refattn.engine.reduce import reduce_to_shape
from refattn.engine.trace import FORWARD_NAMES, Gradients, Trace
from refattn.errors import RefAttnError

__all__ = ["Device", "Plan", "backward", "call_features", "dense_tile_bytes",
           "dense_tile_classes", "dense_tile_counts", "forward", "plan", "shared_bytes",
           "uses_exp_table"]

_STREAM_SAVED = ("output", "row_max", "lse")
_GRID_Y_MAX = 65535  # CUDA's limit on gridDim.y (blocks over B * Hq or B * Hkv)
_INT32_MAX = 2**31 - 1
_WARPS = 4  # warps per block of every tensor-core kernel
#: the kernels' tile-local indices are int32: row0 + r stays below Q (or K) plus one block
_INDEX_MAX = _INT32_MAX - 256
#: a trace-mode call materialises nine (B, Hq, Q, K) tensors; above this many elements it is
#: refused in favour of materialize=False
TRACE_ELEMENT_LIMIT = 1 << 26


class Device(Protocol):
    """What the host program needs of a GPU or of the emulator."""

    name: str
    xp: Any  # numpy or cupy
    max_shared_bytes: int
    compile_options: tuple[str, ...]

    def get_function(self, name: str) -> Any: ...
    def address(self, array: Any) -> int: ...
    def to_device(self, array: np.ndarray) -> Any: ...
    def to_host(self, array: Any) -> np.ndarray: ...
    def free_bytes(self) -> int | None: ...
    def describe(self) -> dict[str, Any]: ...


def shared_bytes(kernel: str, D: int, features: str = "general") -> int:
    """Dynamic shared memory of one block of ``kernel``'s instance at head width ``D``.

    forward: Q (BQ x D) and two buffers of K and V (BK x D); dq: Q and G_O (BQ x D each) and
    two buffers of K and V; dkdv: K and V (BKV x D each), two buffers of Q and G_O (BQ2 x D)
    and the dV accumulators (BKV x D); doubles, unpadded (the tiles are swizzled,
    kernels/tile.cuh). A forward on warp pairs (source.PAIRED: D = 128) adds the pairs'
    exchange region of partial S (BQ x BK), a dq on warp pairs the regions of partial S and dP
    (2 x BQ x BK); a dkdv on warp pairs (D = 64 and 128) keeps dV in
    registers and holds instead those regions (2 x BKV x BQ2) and, with every feature compiled
    in, 6 of each warp's 8 dK n-tiles at D = 128 (3/4 x BKV x D), 2 of its 4 at D = 64
    (1/2 x BKV x D); the debug emulator checks every shared access against these
    bytes (tests/gpu/test_warp_pairs.py). Above D = 128 the
    Q, G_O (forward, dq) and K, V (dkdv) tiles are not in shared memory (the warps read their
    own rows from global memory) and dkdv keeps half of its dK accumulators there instead
    (BKV x D / 2: n-tiles 16 to 31; 0 to 15 in registers). A block of an instance that
    :func:`uses_exp_table` also holds its copy of the exp table (source.EXP_TABLE_DOUBLES,
    4 KiB).

    Examples
    --------
    >>> shared_bytes("forward", 64), shared_bytes("dq", 128), shared_bytes("dkdv", 128)
    (102400, 143360, 163840)
    >>> shared_bytes("forward", 128)  # warp pairs, 16-key tiles: two blocks on an H100/H200
    106496
    >>> shared_bytes("dq", 128, "wide")  # warp pairs, 32-key tiles
    217088
    >>> shared_bytes("dkdv", 256, "wide")  # 16-query tiles
    229376
    >>> shared_bytes("forward", 256), shared_bytes("dq", 256), shared_bytes("dkdv", 256)
    (65536, 65536, 163840)
    >>> shared_bytes("forward", 128, "plain")  # 16-row warps: 64 rows of Q, 8-key tiles
    98304
    >>> shared_bytes("dkdv", 64)  # warp pairs: K, V, Q and G_O, the regions, half of dK
    81920
    >>> shared_bytes("dkdv", 128, "plain")  # warp pairs, dK in registers
    139264
    >>> shared_bytes("forward", 256, "plain"), shared_bytes("dq", 256, "plain")  # 16-key tiles
    (131072, 131072)
    """
    table = FEATURE_SETS[features][0] if features in FEATURE_SETS else {}
    if kernel not in table or D not in table[kernel]:
        raise RefAttnError(f"shared_bytes: no {features} instance of {kernel!r} at D={D}")
    MR, tile = table[kernel][D]
    rows = 8 * MR * _WARPS  # BQ or BKV
    own = 0 if D > A_GLOBAL_ABOVE else 1  # the A tiles: in shared memory up to D = 128
    if kernel == "forward" and D in PAIRED.get(features, {}).get(kernel, ()):
        # Q, two buffers of K and V, the exchange region of partial S (BQ x BK)
        n = rows * D + 4 * tile * D + rows * tile
    elif D in PAIRED.get(features, {}).get(kernel, ()):
        # the A tiles, two buffers of the streamed ones, the exchange regions, (a dkdv with
        # every feature) three quarters of dK
        n = 2 * rows * D + 4 * tile * D + 2 * rows * tile + (
            (3 * rows * D // 4 if D == 128 else rows * D // 2)
            if kernel == "dkdv" and features != "plain" else 0)
    else:
        n = {"forward": own * rows * D + 4 * tile * D,
             "dq": own * 2 * rows * D + 4 * tile * D,
             # dkdv: K and V, the dV accumulators; above D = 128 half of dK instead of K, V
             "dkdv": (3 * rows * D if own else rows * D + rows * D // 2) + 4 * tile * D}[kernel]
    if uses_exp_table(kernel, D, features):
        n += EXP_TABLE_DOUBLES  # the block's copy of the exp table
    return 8 * n


def uses_exp_table(kernel: str, D: int, features: str = "general") -> bool:
    """Whether ``kernel``'s instance at head width D holds a copy of the exp table
    (kernels/common.cuh's refattn_exp_table; forward.cuh's and backward.cuh's EXP_TABLE): the
    forward up to D = 64 and on warp pairs (elsewhere its 16-byte reads would take the loop
    above 1 byte of shared memory per FMA), the dq with its features up to D = 128 (general
    and wide; the plain one spilled with it at D = 128, and at D = 256 its reads took the
    loop above 1 byte per FMA), no dk/dv (the general one at D = 128 would not fit an A100).

    >>> uses_exp_table("forward", 64), uses_exp_table("forward", 128, "plain")
    (True, False)
    >>> uses_exp_table("dq", 128), uses_exp_table("dq", 64, "plain"), uses_exp_table("dkdv", 64)
    (True, False, False)
    """
    if kernel == "forward":
        return D <= 64 or D in PAIRED.get(features, {}).get(kernel, ())
    return kernel == "dq" and features != "plain" and D <= 128


@dataclass(frozen=True)
class Plan:
    """One kernel's instance for a call: its name, head width, rows per block, tile, bytes,
    and its feature set (source.FEATURE_SETS)."""

    kernel: str  # the entry point, e.g. "attention_forward_d64"
    D: int  # the instance's head width (q, k, v, G_O zero-padded to it)
    rows: int  # query rows (forward, dq) or keys (dkdv) per block
    tile: int  # keys (forward, dq) or queries (dkdv) per step
    shared_bytes: int
    features: str = "general"  # "general" or "wide" (every feature compiled in), or "plain"


#: the kernel parameters (abi.INT_PARAMS) of the features that a plain instance has no code for
PLAIN_EXCLUDES = ("HAS_SOFTCAP", "HAS_BIAS", "DROP_MODE")


def call_features(ip: np.ndarray) -> str:
    """The feature set a call's int64 parameter table needs: ``"plain"`` when it sets none of
    :data:`PLAIN_EXCLUDES` (no softcap, bias or dropout), else ``"general"``.

    Decided from the table the kernel reads, so an instance is never run on a parameter it
    has no code for.

    >>> ip = np.zeros(len(INT_PARAMS), np.int64)
    >>> call_features(ip)
    'plain'
    >>> ip[INT_PARAMS.index("HAS_SOFTCAP")] = 1
    >>> call_features(ip)
    'general'
    """
    used = any(int(ip[INT_PARAMS.index(name)]) != 0 for name in PLAIN_EXCLUDES)
    return "general" if used else "plain"


def plan(kind: str, Dk: int, Dv: int, max_shared_bytes: int, device_name: str = "the device",
         features: str = "general") -> Plan:
    """The instance of ``kind`` ("forward", "dq", "dkdv") for head widths Dk, Dv.

    Both widths are zero-padded to the smallest instance width that holds max(Dk, Dv). With
    ``features="plain"`` (a call without softcap, bias and dropout: :func:`call_features`)
    the plain instance at that width is chosen where there is one and it fits the device's
    shared memory; otherwise the wide instance (every feature, larger tiles:
    ``source.WIDE``) where there is one and it fits, else the general instance, which serves
    every call.

    Raises
    ------
    RefAttnError
        A width above every instance, or an instance whose shared memory exceeds
        ``max_shared_bytes`` (the device's per-block opt-in limit).

    Examples
    --------
    >>> plan("forward", 40, 24, 232448)
    Plan(kernel='attention_forward_d64', D=64, rows=64, tile=32, shared_bytes=102400, \
features='general')
    >>> plan("forward", 100, 128, 232448, features="plain").kernel
    'attention_forward_plain_d128'
    >>> plan("forward", 8, 8, 232448, features="plain").kernel  # no plain instance at D = 32
    'attention_forward_d32'
    >>> plan("dq", 128, 128, 232448).kernel, plan("dq", 128, 128, 166912).kernel  # H100, A100
    ('attention_dq_wide_d128', 'attention_dq_d128')
    >>> plan("dkdv", 256, 256, 232448).kernel, plan("dkdv", 200, 256, 166912).kernel
    ('attention_dkdv_wide_d256', 'attention_dkdv_d256')
    """
    D = _width(kind, Dk, Dv)
    for fs in (("plain", "wide") if features == "plain" else ("wide",)):
        table = FEATURE_SETS[fs][0].get(kind, {})
        if D in table and shared_bytes(kind, D, fs) <= max_shared_bytes:
            MR, tile = table[D]
            return Plan(kernel_name(kind, D, fs), D, 8 * MR * _WARPS, tile,
                        shared_bytes(kind, D, fs), fs)
    need = shared_bytes(kind, D)
    if need > max_shared_bytes:
        raise RefAttnError(
            f"q/v: the {kind} kernel at head width D={D} (Dk={Dk}, Dv={Dv}) needs {need} bytes "
            f"of shared memory per block; {device_name} allows {max_shared_bytes} "
            "(its per-block opt-in limit)")
    MR, tile = INSTANCES[kind][D]
    return Plan(kernel_name(kind, D), D, 8 * MR * _WARPS, tile, need)


def _width(kind: str, Dk: int, Dv: int) -> int:
    """The instance width of ``kind`` for head widths Dk, Dv (a RefAttnError if none)."""
    widths = sorted(INSTANCES[kind])
    wide = max(Dk, Dv)
    D = next((w for w in widths if w >= wide), None)
    if D is None:
        what = "backward" if kind != "forward" else "forward"  # (the forward is planned first)
        raise RefAttnError(
            f"q/v: head widths Dk={Dk}, Dv={Dv} have no {what} kernel instance: the {kind} "
            f"kernel is instantiated for D in {widths} (narrower heads are zero-padded up to "
            "the next one)")
    return D


def _padded(array: np.ndarray, D: int) -> np.ndarray:
    """``array`` (..., d) with zero columns appended up to D (a copy only when d < D)."""
    d = array.shape[-1]
    if d == D:
        return array
    out = np.zeros((*array.shape[:-1], D))
    out[..., :d] = array
    return out


#: tile classes (kernels/tile_loop.cuh RefattnTileClass)
SKIP, FULL, PARTIAL = 0, 1, 2


def _tile_grid(shape: tuple[int, ...], Q: int, K: int, block_rows: int, block_cols: int,
               rows_are_keys: bool) -> tuple[int, int, int, int, int, int]:
    """(rows, cols, row tiles, column tiles, mask rows, mask columns) of a kernel's tiles."""
    Qm, Km = shape[-2:]
    rows, cols, Rm, Cm = (K, Q, Km, Qm) if rows_are_keys else (Q, K, Qm, Km)
    return rows, cols, -(-rows // block_rows), -(-cols // block_cols), Rm, Cm


def dense_tile_bytes(shape: tuple[int, ...], Q: int, K: int, block_rows: int, block_cols: int,
                     rows_are_keys: bool = False) -> tuple[int, int]:
    """Bytes of a dense mask's class table and the most its reduction holds at once.

    ``shape`` is the mask's own 4-d shape (Bm, Hm, Qm, Km), extents 1 on broadcast axes. The
    table is one byte per (Bm, Hm, row tile, column tile); the reduction
    (:func:`dense_tile_classes`) holds the mask as bool, two padded copies of it (for *any*
    and *all*) and the two column-reduced arrays, one byte per element each.

    Examples
    --------
    >>> dense_tile_bytes((1, 1, 4096, 4096), 4096, 4096, 64, 32)  # 64 x 128 tiles
    (8192, 51380224)
    >>> dense_tile_bytes((2, 1, 1, 4096), 4096, 4096, 64, 32)  # key padding: no Q axis stored
    (16384, 25088)
    """
    Bm, Hm = shape[:2]
    _, _, nr, nc, Rm, Cm = _tile_grid(shape, Q, K, block_rows, block_cols, rows_are_keys)
    Rp = nr * block_rows if Rm > 1 else 1
    Cp = nc * block_cols if Cm > 1 else 1
    ncm = nc if Cm > 1 else 1
    table = Bm * Hm * nr * nc
    work = Bm * Hm * (Rm * Cm + 2 * Rp * Cp + 2 * Rp * ncm)
    return table, work


def dense_tile_classes(xp: Any, visible: Any, Q: int, K: int, block_rows: int, block_cols: int,
                       rows_are_keys: bool = False) -> Any:
    """The class (SKIP 0, FULL 1, PARTIAL 2) of every tile of a dense mask, as the kernels'
    per-element block vote gives it (``refattn_tile_bits`` + ``refattn_tile_class``).

    Rows are queries (forward, dq; ``block_rows`` = BQ, ``block_cols`` = BK) or keys (dk/dv,
    ``rows_are_keys``; BKV and BQ2). A tile is SKIP when none of its in-range elements is
    visible, FULL when all are and it has no column past the end (a column tail is never FULL),
    else PARTIAL; rows past the end count for neither. Computed on the device's array module
    ``xp`` (numpy or cupy) by padding, reshaping and any / all reductions over the mask's own
    extents: a broadcast axis (extent 1) stays extent 1 and is not materialised. The sanitised
    key 0 is not in the table (the launch marks a SKIP tile holding key 0 PARTIAL).

    Parameters
    ----------
    xp : module
        numpy or cupy.
    visible : array (Bm, Hm, Qm, Km)
        The dense mask (nonzero = visible), broadcastable to (B, Hq, Q, K).
    Q, K, block_rows, block_cols : int
    rows_are_keys : bool

    Returns
    -------
    array (Bm, Hm, ceil(rows / block_rows), ceil(cols / block_cols)), uint8, C-contiguous

    Examples
    --------
    >>> m = np.tril(np.ones((1, 1, 6, 6), dtype=np.uint8))
    >>> dense_tile_classes(np, m, 6, 6, 2, 4)[0, 0]  # causal, 2-row x 4-column tiles
    array([[2, 0],
           [2, 0],
           [1, 2]], dtype=uint8)
    """
    m = visible != 0
    if rows_are_keys:
        m = xp.swapaxes(m, 2, 3)
    rows, cols, nr, nc, Rm, Cm = _tile_grid(visible.shape, Q, K, block_rows, block_cols,
                                            rows_are_keys)
    if Cm > 1:  # reduce the columns of each tile: (Bm, Hm, Rm, nc)
        pad = ((0, 0), (0, 0), (0, 0), (0, nc * block_cols - cols))
        shape = (*m.shape[:3], nc, block_cols)
        any_ = xp.pad(m, pad, constant_values=False).reshape(shape).any(axis=-1)
        all_ = xp.pad(m, pad, constant_values=True).reshape(shape).all(axis=-1)
    else:  # a key (or query) broadcast: each in-range column holds the same value
        any_ = all_ = m
    if Rm > 1:  # then the rows: (Bm, Hm, nr, nc or 1)
        pad = ((0, 0), (0, 0), (0, nr * block_rows - rows), (0, 0))
        shape = (*m.shape[:2], nr, block_rows, any_.shape[-1])
        any_ = xp.pad(any_, pad, constant_values=False).reshape(shape).any(axis=3)
        all_ = xp.pad(all_, pad, constant_values=True).reshape(shape).all(axis=3)
    full = (*m.shape[:2], nr, nc)
    any_, all_ = xp.broadcast_to(any_, full), xp.broadcast_to(all_, full)
    tail = (xp.arange(nc) + 1) * block_cols > cols  # a column past the end: never FULL
    cls = xp.where(any_, xp.where(all_ & ~tail, FULL, PARTIAL), SKIP)
    return xp.ascontiguousarray(cls.astype(xp.uint8))


def dense_tile_counts(table: np.ndarray, B: int, Hq: int, Q: int, K: int, block_rows: int,
                      block_cols: int, rows_are_keys: bool = False) -> dict[str, int]:
    """What a class table saves in one kernel's launch over (B, Hq): tiles per class (the
    table broadcast over the batch and head axes it shares) and per-element mask loads.

    Without the table the block vote reads one mask element per in-range (row, column) of
    every tile; with it only PARTIAL tiles do. ``mask_loads`` counts the vote's loads without
    the table, ``mask_loads_avoided`` those the table saves.

    Examples
    --------
    >>> m = np.tril(np.ones((1, 1, 6, 6), dtype=np.uint8))
    >>> t = dense_tile_classes(np, m, 6, 6, 2, 4)
    >>> dense_tile_counts(t, 1, 1, 6, 6, 2, 4)
    {'skip': 2, 'full': 1, 'partial': 3, 'mask_loads': 36, 'mask_loads_avoided': 16}
    """
    table = np.broadcast_to(np.asarray(table), (B, Hq, *np.shape(table)[2:]))
    rows, cols = (K, Q) if rows_are_keys else (Q, K)
    nr, nc = table.shape[2:]
    rn = np.minimum(block_rows, rows - block_rows * np.arange(nr))  # in-range rows per tile
    cn = np.minimum(block_cols, cols - block_cols * np.arange(nc))
    loads = rn[:, None] * cn[None, :]  # (nr, nc): the vote's mask loads of a tile
    final = table != PARTIAL
    return {"skip": int((table == SKIP).sum()), "full": int((table == FULL).sum()),
            "partial": int((table == PARTIAL).sum()),
            "mask_loads": int(loads.sum()) * B * Hq,
            "mask_loads_avoided": int((final * loads).sum())}


def _dense_tiles(L: _Launch, P: Plan, kind: str) -> Any:
    """For a dense mask (VIS_MODE 1): its class table for ``P``'s tiles into slot VIS_TILES,
    returned (a device array; the forward reports what it saves, :func:`dense_tile_counts`).

    Computed over the mask's own extents, then expanded to (B, Hq, row tiles, column tiles)
    bytes, which the kernel indexes without strides (memory estimated first). With sanitised
    rows a SKIP tile holding key 0 is marked PARTIAL, so the kernel votes it. None without a
    dense mask.
    """
    if int(L.ip[INT_PARAMS.index("VIS_MODE")]) != 1:
        return None
    mask = L.slots["VIS"]
    m4 = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    B, Hq, Q, K = (int(L.ip[INT_PARAMS.index(n)]) for n in ("B", "HQ", "Q", "K"))
    keys = kind == "dkdv"
    table_bytes, work = dense_tile_bytes(m4.shape, Q, K, P.rows, P.tile, keys)
    expanded = B * Hq * table_bytes // (m4.shape[0] * m4.shape[1])
    free = L.device.free_bytes()
    if free is not None and expanded + work > free:
        raise RefAttnError(f"visible: the {kind} kernel's tile classes of the dense mask need "
                           f"about {expanded + work} bytes ({expanded} kept) on "
                           f"{L.device.name}, {free} are free; not launched")
    xp = L.device.xp
    table = dense_tile_classes(xp, m4, Q, K, P.rows, P.tile, keys)
    # a writable C-contiguous copy (broadcast_to is a read-only view, kept as it is by
    # ascontiguousarray when the mask already has the full (B, Hq) extents)
    table = xp.broadcast_to(table, (B, Hq, *table.shape[2:])).copy()
    sanitized = bool(L.ip[INT_PARAMS.index("HAS_SANITIZED")])
    if sanitized:  # the temporary key 0: voted per element
        key0 = table[:, :, 0, :] if keys else table[:, :, :, 0]
        key0[key0 == SKIP] = PARTIAL
    L.slots["VIS_TILES"] = table
    return table


@dataclass
class _Launch:
    """The argument tables of one call on one device (device arrays by slot name)."""

    device: Device
    slots: dict[str, Any] = field(default_factory=dict)
    ip: np.ndarray = field(default_factory=lambda: np.zeros(len(INT_PARAMS), np.int64))
    rp: np.ndarray = field(default_factory=lambda: np.zeros(len(REAL_PARAMS), np.float64))

    def set(self, name: str, value: Any) -> None:
        self.ip[INT_PARAMS.index(name)] = int(value)

    def real(self, name: str, value: float) -> None:
        self.rp[REAL_PARAMS.index(name)] = float(value)

    def put(self, name: str, array: np.ndarray) -> None:
        self.slots[name] = self.device.to_device(np.ascontiguousarray(array))

    def strided(self, prefix: str, name: str, array: np.ndarray, full: tuple[int, ...]) -> None:
        """A broadcastable operand: its own elements, strides 0 on broadcast axes."""
        arr = np.ascontiguousarray(array)
        shape = (1,) * (4 - arr.ndim) + arr.shape
        view = arr.reshape(shape)
        for axis in range(4):
            step = 0 if shape[axis] == 1 and full[axis] != 1 else view.strides[axis] // arr.itemsize
            self.set(f"{prefix}_S{axis}", step)
        self.put(name, arr)

    def run(self, kernel: str, grid: tuple[int, ...], block: int, smem: int = 0) -> None:
        dummy = self.slots.setdefault("_DUMMY", self.device.to_device(np.zeros(1)))
        for name, array in self.slots.items():  # the kernels index every array densely
            flags = getattr(array, "flags", None)
            if flags is None or not flags.c_contiguous:
                raise RefAttnError(f"kernel argument {name}: not a C-contiguous array (the "
                                   f"kernels index rows densely); {kernel} was not launched")
        fn = self.device.get_function(kernel)
        # the kernel's own __shared__ variables count against the same per-block limit
        # (CuPy: RawKernel.shared_size_bytes; the emulator's functions have none)
        static = int(getattr(fn, "shared_size_bytes", 0) or 0)
        if smem + static > self.device.max_shared_bytes:
            raise RefAttnError(f"{kernel}: {smem} bytes of dynamic and {static} of static shared "
                               f"memory per block exceed {self.device.name}'s limit of "
                               f"{self.device.max_shared_bytes}; not launched")
        table = np.array([self.device.address(self.slots.get(n, dummy)) for n in POINTERS],
                         dtype=np.uint64)
        if smem > 48 * 1024 and hasattr(fn, "max_dynamic_shared_size_bytes"):
            fn.max_dynamic_shared_size_bytes = smem  # CUDA: opt in above 48 KiB
            if hasattr(fn, "preferred_shared_memory_carveout"):
                # the largest shared-memory carveout (CUDA: cudaSharedmemCarveoutMaxShared, a
                # percentage), so that two blocks of the 80-96 KiB instances (issue 43: two
                # warps per scheduler) fit one SM, not the smallest carveout holding one block
                fn.preferred_shared_memory_carveout = 100
        args = (self.device.to_device(table), self.device.to_device(self.ip),
                self.device.to_device(self.rp))
        fn((*grid, 1, 1)[:3], (block, 1, 1), args, shared_mem=smem)


def _check_shapes(call: AttentionCall, device: Device) -> None:
    if call.score.name != "dot":
        raise RefAttnError(f"score: backend {device.name!r} runs the dot family only, got "
                           f"{call.score.name!r}; use backend='numpy' or 'exact'")
    a = call.axes
    B, Hq, Hkv, Q, K = a["B"], a["Hq"], a["Hkv"], a["Q"], a["K"]
    for name, blocks in (("B * Hq", B * Hq), ("B * Hkv", B * Hkv)):
        if blocks > _GRID_Y_MAX:
            raise RefAttnError(f"q/k: {name} = {blocks} exceeds the kernels' grid range "
                               f"({_GRID_Y_MAX} blocks on the y axis)")
    for name, n in (("Q", Q), ("K", K)):
        if n > _INDEX_MAX:
            raise RefAttnError(f"q/k: {name} = {n} exceeds the kernels' 32-bit tile-local index "
                               f"range (at most {_INDEX_MAX}: 2**31 - 1 less one block of rows)")


def _prepare(call: AttentionCall, device: Device, D: int | None = None) -> _Launch:
    _check_shapes(call, device)
    if D is None:  # the forward instance's width
        D = _width("forward", call.q.shape[3], call.v.shape[3])
    a = call.axes
    B, Hq, Hkv, Q, K = (a[n] for n in ("B", "Hq", "Hkv", "Q", "K"))
    full = call.score_shape
    L = _Launch(device)
    # every device row is D wide (zero-padded): the trace kernels read DK = DV = D
    for name, value in zip(("B", "HQ", "HKV", "Q", "K", "DK", "DV"),
                           (B, Hq, Hkv, Q, K, D, D), strict=True):
        L.set(name, value)
    mult = operand_multipliers(call.scale, call.scale_placement)
    # the placement's rounded operands, one IEEE product per element as the reference
    L.put("Q", _padded(call.q if mult.query == 1.0 else call.q * mult.query, D))  # (B,Hq,Q,D)
    L.put("K", _padded(call.k if mult.key == 1.0 else call.k * mult.key, D))  # (B,Hkv,K,D)
    L.put("V", _padded(call.v, D))  # (B,Hkv,K,D)
    L.put("HEAD_MAP", check_head_map(call))  # re-checked: the kernels index k, v with it
    L.real("POST", mult.post)
    L.real("FQ", mult.query * mult.post)
    L.real("FK", mult.key * mult.post)
    if call.bias is not None:
        L.set("HAS_BIAS", 1)
        L.strided("BIAS", "BIAS", call.bias, full)
    if call.softcap is not None:
        L.set("HAS_SOFTCAP", 1)
        L.real("SOFTCAP", call.softcap)
    if call.sink is not None:
        L.set("HAS_SINK", 1)
        L.put("SINK", call.sink)
    if isinstance(call.dropout, Philox):
        s = call.dropout
        L.set("DROP_MODE", 2)
        L.set("PHILOX_KEY0", s.seed & 0xFFFFFFFF)
        L.set("PHILOX_KEY1", s.seed >> 32)
        L.set("PHILOX_OFFSET", s.offset)
        L.set("PHILOX_THRESHOLD", s.threshold)
        L.real("KEEP", s.keep_multiplier)
    elif call.dropout is not None:  # an explicit multiplier, or another stream materialised
        z = call.dropout if isinstance(call.dropout, np.ndarray) else call.multiplier_full()
        L.set("DROP_MODE", 1)
        L.strided("Z", "Z", z, full)
    if call.relation is not None:  # a relation or a union / intersection: leaves + program
        rel = call.relation
        Br, Hr, Qr, Kr = rel.shape
        leaves = [leaf.kernel_arguments() for leaf in rel.leaves()]

        def stack(get: Any, dtype: Any, width: tuple[int, ...]) -> np.ndarray:
            return np.stack([np.broadcast_to(np.asarray(get(a), dtype=dtype), width)
                             for a in leaves])  # (L, ...) each leaf broadcast to the relation

        L.set("VIS_MODE", 2)
        L.set("REL_B", Br)
        L.set("REL_H", Hr)
        program = np.asarray(rel.program(), dtype=np.int64)
        L.set("REL_PROGRAM_LEN", program.size)
        L.put("REL_PROGRAM", program)
        L.put("REL_LEAF", np.array([[int(a.has_segments), int(a.topology)] for a in leaves],
                                   dtype=np.int64))
        for name, get, width in (
                ("Q_POS", lambda a: a.q_pos, (Br, Qr)), ("K_POS", lambda a: a.k_pos, (Br, Kr)),
                ("Q_SEG", lambda a: a.q_segment, (Br, Qr)),
                ("K_SEG", lambda a: a.k_segment, (Br, Kr)),
                ("PREFIX", lambda a: a.prefix_length, (Br, Hr)),
                ("LEFT", lambda a: a.left, (Hr,)), ("RIGHT", lambda a: a.right, (Hr,))):
            L.put(name, stack(get, np.int64, width))
        L.put("KEY_VALID", stack(lambda a: a.key_valid, np.uint8, (Br, Kr)))
    elif call.visible is not None:
        L.set("VIS_MODE", 1)
        L.strided("VIS", "VIS", np.asarray(call.visible, dtype=np.uint8), full)
    sanitized = call.sanitized_rows()  # (B, Hq, Q): rows given the temporary key 0
    if sanitized.any():
        L.set("HAS_SANITIZED", 1)
        L.put("SANITIZED", sanitized.astype(np.uint8))
    L.put("QUERY_VALID", call.query_valid_full()[:, 0, :, 0].astype(np.uint8))
    L.sanitized = sanitized  # type: ignore[attr-defined]
    return L


def _memory_check(device: Device, call: AttentionCall, trace: bool, D: int) -> None:
    free = device.free_bytes()
    if free is None:
        return
    a = call.axes
    rows = a["B"] * a["Hq"] * a["Q"]
    need = 8 * (a["B"] * a["Hq"] * a["Q"] * 5 * D  # q, G_O, output, dq (padded to D)
                + 4 * a["B"] * a["Hkv"] * a["K"] * D + 6 * rows)  # k, v, dk, dv
    if trace:
        need += 8 * 10 * rows * a["K"]
    if call.bias is not None:
        need += 8 * a["B"] * a["Hq"] * (a["Q"] * a["K"] if call.bias.ndim >= 2 else a["K"])
    if need > free:
        raise RefAttnError(f"device memory: this call needs about {need} bytes on "
                           f"{device.name}, {free} are free; use materialize=False or a "
                           "smaller call")


def _grid_stride(n: int) -> tuple[int, ...]:
    return (max(1, min(math.ceil(n / 256), 65535 * 8)),)


def forward(device: Device, call: AttentionCall, *, materialize: bool = True) -> Trace:
    """Forward pass of ``call`` on ``device``: streaming, or the full trace (small calls).

    Parameters
    ----------
    device : Device
    call : AttentionCall
    materialize : bool
        True: the full canonical trace (trace kernels write every (B, Hq, Q, K) tensor);
        False: output, row_max and lse only, no [Q, K] array anywhere.
    """
    if not isinstance(materialize, (bool, np.bool_)):
        raise RefAttnError(f"materialize: expected True or False, got {materialize!r}")
    B, Hq, Q, K = call.score_shape
    if materialize and B * Hq * Q * K > TRACE_ELEMENT_LIMIT:
        raise RefAttnError(f"materialize: the full trace of this call has {B * Hq * Q * K} "
                           f"elements per tensor (limit {TRACE_ELEMENT_LIMIT}); pass "
                           "materialize=False to stream")
    Dk, Dv = call.q.shape[3], call.v.shape[3]
    # refused before any upload when no instance at the width fits the device
    D = plan("forward", Dk, Dv, device.max_shared_bytes, device.name, "plain").D
    _memory_check(device, call, materialize, D)
    L = _prepare(call, device, D)
    # the instance whose compiled features cover the ones the call's parameters use
    P = plan("forward", Dk, Dv, device.max_shared_bytes, device.name, call_features(L.ip))
    xp = device.xp
    L.slots["OUT"] = xp.zeros((B, Hq, Q, P.D))
    L.slots["LSE"] = xp.zeros((B, Hq, Q))
    L.slots["ROW_MAX"] = xp.zeros((B, Hq, Q))
    nqb = -(-Q // P.rows)
    L.slots["TILES"] = xp.zeros((nqb * B * Hq, 2), dtype=np.int64)
    dense_tiles = _dense_tiles(L, P, "forward")
    L.run(P.kernel, (nqb, B * Hq), 32 * _WARPS, P.shared_bytes)
    host = device.to_host
    done, skipped = (int(x) for x in host(L.slots["TILES"]).sum(axis=0))
    lse, row_max = host(L.slots["LSE"]), host(L.slots["ROW_MAX"])
    output = np.ascontiguousarray(host(L.slots["OUT"])[..., :Dv])  # (B, Hq, Q, Dv)
    materialized: dict[str, Any] = {
        "mode": "trace" if materialize else "streaming", "kernel": P.kernel, "head_width": P.D,
        "kernel_features": P.features, "block_q": P.rows, "block_k": P.tile,
        "tiles_computed": done, "tiles_skipped": skipped, "device": device.describe(),
        "compile_options": list(device.compile_options),
    }
    if dense_tiles is not None:  # a dense mask's tile classes (per-element loads saved)
        materialized["dense_tiles"] = dense_tile_counts(host(dense_tiles), B, Hq, Q, K, P.rows,
                                                        P.tile)
    extra: dict[str, Any] = {}
    if call.sink is not None:
        extra["sink_probs"] = np.exp(call.sink[None, :, None] - lse)  # (B, Hq, Q)
    if not materialize:
        materialized |= {"scores": False, "probabilities": False, "saved": list(_STREAM_SAVED),
                         "not_materialized": [n for n in FORWARD_NAMES
                                              if n not in _STREAM_SAVED]}
        return Trace(call=call, scores=None, biased_scores=None, masked_scores=None,
                     row_max=row_max, lse=lse, probs=None, dropout_multiplier=None,
                     consumed=None, output=output, sanitized_rows=L.sanitized,
                     backend=device.name, materialized=materialized, **extra)
    names = ("T_SOFTCAP_INPUT", "T_SCORES", "T_BIASED", "T_MASKED", "T_PROBS", "T_Z",
             "T_CONSUMED")
    for name in names:
        L.slots[name] = xp.zeros((B, Hq, Q, K))
    L.run("attention_trace_forward", _grid_stride(B * Hq * Q * K), 256)
    t = {name: host(L.slots[name]) for name in names}
    if call.softcap is not None:
        extra["softcap_input"] = t["T_SOFTCAP_INPUT"]
    materialized |= {"scores": True, "probabilities": True}
    return Trace(call=call, scores=t["T_SCORES"], biased_scores=t["T_BIASED"],
                 masked_scores=t["T_MASKED"], row_max=row_max, lse=lse, probs=t["T_PROBS"],
                 dropout_multiplier=t["T_Z"], consumed=t["T_CONSUMED"],
                 output=output, sanitized_rows=L.sanitized, backend=device.name,
                 materialized=materialized, **extra)


def _bias_gradient_mode(call: AttentionCall) -> tuple[int, tuple[int, ...]]:
    """(P_GBIAS_MODE, shape of the partial) for the call's bias (mode 0: no bias)."""
    B, Hq, Q, K = call.score_shape
    if call.bias is None:
        return 0, (1,)
    _, _, Qb, Kb = (1,) * (4 - call.bias.ndim) + call.bias.shape
    if (Kb == 1 and K > 1) or K == 1:
        return 3, (B, Hq, Q, 1)  # summed over keys in the dq kernel
    if Qb == 1 and Q > 1:
        return 2, (B, Hq, 1, K)  # summed over queries in the dk/dv kernel
    return 1, (B, Hq, Q, K)  # per element


def backward(device: Device, trace: Trace, grad_output: np.ndarray) -> Gradients:
    """Backward pass of a trace made on ``device`` (recomputes P from lse, Z by coordinates).

    D = sum(G_O * O) drives dS; the other contraction ``row_dot = sum_j P G_P`` comes out of
    the dq kernel as a by-product. A trace-mode trace gets the per-element backward tensors
    too (grad_consumed, grad_probs, grad_scores), with D = row_dot as the reference uses it.
    """
    call = trace.call
    B, Hq, Q, K = call.score_shape
    Hkv, Dk, Dv = call.k.shape[1], call.q.shape[3], call.v.shape[3]
    # the general instances first: a device that fits neither is refused before any upload
    # (a plain instance needs at least the general one's shared memory)
    D = plan("dq", Dk, Dv, device.max_shared_bytes, device.name).D
    plan("dkdv", Dk, Dv, device.max_shared_bytes, device.name)
    L = _prepare(call, device, D)
    # then the instances whose compiled features cover the call's parameters, per device: a
    # plain instance where the call has no softcap, bias or dropout and its shared memory fits
    features = call_features(L.ip)
    PQ = plan("dq", Dk, Dv, device.max_shared_bytes, device.name, features)
    PKV = plan("dkdv", Dk, Dv, device.max_shared_bytes, device.name, features)
    xp, host = device.xp, device.to_host
    g_o = np.where(call.query_valid_full(), grad_output, 0.0)  # unused rows consume nothing
    L.put("G_O", _padded(g_o, D))  # (B, Hq, Q, D)
    L.put("OUT", _padded(trace.output, D))
    L.put("LSE", trace.lse)
    L.slots["D"] = xp.zeros((B, Hq, Q))
    L.run("attention_row_dot_output", _grid_stride(B * Hq * Q), 256)
    row_dot_output = host(L.slots["D"])
    nqb, nkb = -(-Q // PQ.rows), -(-K // PKV.rows)
    traced = trace.probs is not None
    extra: dict[str, Any] = {}
    L.slots["TILES"] = xp.zeros((max(nqb * B * Hq, nkb * B * Hkv), 2), dtype=np.int64)
    if traced:  # the reference's D = sum_j P G_P, from the trace's own G_P, before any dS
        L.put("T_PROBS", trace.probs)
        L.put("T_Z", trace.dropout_multiplier)
        names = ("T_GRAD_CONSUMED", "T_GRAD_PROBS", "T_GRAD_SCORES")
        for name in names:
            L.slots[name] = xp.zeros((B, Hq, Q, K))
        L.slots["D"] = xp.zeros((B, Hq, Q))  # (T_GRAD_SCORES is recomputed below)
        L.run("attention_trace_backward", _grid_stride(B * Hq * Q * K), 256)
        grad_consumed, grad_probs = (host(L.slots[n]) for n in names[:2])
        # D and G_S = P (G_P - D) from the same G_P values, as the reference forms them, so a
        # row whose G_S vanishes exactly (one key) vanishes here too: the tensor-core dq
        # kernel's G_P (DMMA rounding) would differ from the trace kernel's in the last bit
        trace_d = (trace.probs * grad_probs).sum(axis=-1)  # (B, Hq, Q)
        grad_scores = trace.probs * (grad_probs - trace_d[..., None])  # (B, Hq, Q, K)
        L.put("D", trace_d)
        if call.softcap is not None:  # G_S (1 - tanh^2) from the capped scores
            extra["grad_softcap_input"] = grad_scores * (1.0 - (trace.scores / call.softcap)
                                                         ** 2)
    else:
        grad_consumed = grad_probs = grad_scores = None
    mode, gshape = _bias_gradient_mode(call)
    L.set("GBIAS_MODE", mode)
    L.slots["GBIAS"] = xp.zeros(gshape)
    L.slots["DQ"] = xp.zeros((B, Hq, Q, D))
    L.slots["ROW_DOT"] = xp.zeros((B, Hq, Q))  # the dq kernel's by-product
    _dense_tiles(L, PQ, "dq")
    L.run(PQ.kernel, (nqb, B * Hq), 32 * _WARPS, PQ.shared_bytes)
    row_dot = host(L.slots["ROW_DOT"])
    L.slots["DK"] = xp.zeros((B, Hkv, K, D))
    L.slots["DV"] = xp.zeros((B, Hkv, K, D))
    _dense_tiles(L, PKV, "dkdv")
    L.run(PKV.kernel, (nkb, B * Hkv), 32 * _WARPS, PKV.shared_bytes)
    if call.sink is not None:  # d lse / d sink = sink_probs; the sink carries no value row
        sink_probs = np.exp(call.sink[None, :, None] - trace.lse)
        extra["grad_sink"] = -(sink_probs * row_dot).sum(axis=(0, 2))
    grad_bias = None
    if call.bias is not None:
        grad_bias = reduce_to_shape(host(L.slots["GBIAS"]), call.bias.shape)
    return Gradients(grad_output=grad_output,
                     grad_v=np.ascontiguousarray(host(L.slots["DV"])[..., :Dv]),
                     grad_consumed=grad_consumed, grad_probs=grad_probs, row_dot=row_dot,
                     row_dot_output=row_dot_output, grad_scores=grad_scores,
                     grad_q=np.ascontiguousarray(host(L.slots["DQ"])[..., :Dk]),
                     grad_k=np.ascontiguousarray(host(L.slots["DK"])[..., :Dk]),
                     grad_bias=grad_bias, **extra)
