"""The host side of the GPU path: one program that drives the kernels on a GPU or the emulator.

Owns turning a validated :class:`~refattn.AttentionCall` into the kernels' argument tables
(``abi.py``), choosing the tile size from the shared memory it needs, launching the forward,
backward and trace kernels through a :class:`Device` (CuPy on a GPU, or the CPU emulator: the
same ``kernel(grid, block, args, shared_mem=...)`` calls) and assembling refattn's
:class:`~refattn.Trace` and :class:`~refattn.Gradients` from the results, with numpy arrays
out. Bad input is refused before any launch: an unsupported score family, shapes beyond the
kernels' index ranges, heads wider than the shared memory holds, and (on a GPU) a call whose
buffers exceed the free device memory, each with a RefAttnError naming the tensor or the bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from gpu_backend.abi import INT_PARAMS, POINTERS, REAL_PARAMS
from gpu_backend.source import TILES
from refattn.call import AttentionCall
from refattn.call.gate import check_head_map
from refattn.call.placement import operand_multipliers
from refattn.dropout import Philox
from refattn.engine.reduce import reduce_to_shape
from refattn.engine.trace import FORWARD_NAMES, Gradients, Trace
from refattn.errors import RefAttnError

__all__ = ["Device", "backward", "forward", "shared_bytes"]

_STREAM_SAVED = ("output", "row_max", "lse")
_GRID_Y_MAX = 65535  # CUDA's limit on gridDim.y (blocks over B * Hq or B * Hkv)
_INT32_MAX = 2**31 - 1
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


def shared_bytes(kernel: str, T: int, Dk: int, Dv: int) -> int:
    """Dynamic shared memory of one block of ``kernel`` with T x T tiles.

    Examples
    --------
    >>> shared_bytes("forward", 32, 64, 64)
    73728
    """
    match kernel:
        case "forward":
            n = 2 * T * Dk + 2 * T * Dv + T * T
        case "dq":
            n = 3 * T * Dk + 2 * T * Dv + T * T
        case "dkdv":
            n = 3 * T * Dk + 3 * T * Dv + 2 * T * T + 2 * T
        case _:
            raise RefAttnError(f"shared_bytes: unknown kernel {kernel!r}")
    return 8 * n


def _tile(device: Device, Dk: int, Dv: int) -> int:
    need = {T: max(shared_bytes(k, T, Dk, Dv) for k in ("forward", "dq", "dkdv"))
            for T in TILES}
    for T in TILES:  # the largest tile that fits
        if need[T] <= device.max_shared_bytes:
            return T
    raise RefAttnError(
        f"q/v: head widths Dk={Dk}, Dv={Dv} need {need[TILES[-1]]} bytes of shared memory per "
        f"block even with {TILES[-1]} x {TILES[-1]} tiles; {device.name} offers "
        f"{device.max_shared_bytes}")


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
        table = np.array([self.device.address(self.slots.get(n, dummy)) for n in POINTERS],
                         dtype=np.uint64)
        fn = self.device.get_function(kernel)
        if smem > 48 * 1024 and hasattr(fn, "max_dynamic_shared_size_bytes"):
            fn.max_dynamic_shared_size_bytes = smem  # CUDA: opt in above 48 KiB
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
        if n > _INT32_MAX:
            raise RefAttnError(f"q/k: {name} = {n} exceeds the kernels' int32 grid range")


def _prepare(call: AttentionCall, device: Device) -> _Launch:
    _check_shapes(call, device)
    a = call.axes
    B, Hq, Hkv, Q, K, Dk, Dv = (a[n] for n in ("B", "Hq", "Hkv", "Q", "K", "Dk", "Dv"))
    full = call.score_shape
    L = _Launch(device)
    for name, value in zip(("B", "HQ", "HKV", "Q", "K", "DK", "DV"),
                           (B, Hq, Hkv, Q, K, Dk, Dv), strict=True):
        L.set(name, value)
    mult = operand_multipliers(call.scale, call.scale_placement)
    # the placement's rounded operands, one IEEE product per element as the reference
    L.put("Q", call.q if mult.query == 1.0 else call.q * mult.query)
    L.put("K", call.k if mult.key == 1.0 else call.k * mult.key)
    L.put("V", call.v)
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


def _memory_check(device: Device, call: AttentionCall, trace: bool) -> None:
    free = device.free_bytes()
    if free is None:
        return
    a = call.axes
    rows = a["B"] * a["Hq"] * a["Q"]
    need = 8 * (a["B"] * a["Hq"] * a["Q"] * (2 * a["Dk"] + 3 * a["Dv"])
                + 2 * a["B"] * a["Hkv"] * a["K"] * (a["Dk"] + a["Dv"]) + 6 * rows)
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
    _memory_check(device, call, materialize)
    Dk, Dv = call.q.shape[3], call.v.shape[3]
    T = _tile(device, Dk, Dv)
    L = _prepare(call, device)
    xp = device.xp
    L.slots["OUT"] = xp.zeros((B, Hq, Q, Dv))
    L.slots["LSE"] = xp.zeros((B, Hq, Q))
    L.slots["ROW_MAX"] = xp.zeros((B, Hq, Q))
    nqb = -(-Q // T)
    L.slots["TILES"] = xp.zeros((nqb * B * Hq, 2), dtype=np.int64)
    L.run(f"attention_forward_t{T}", (nqb, B * Hq), 4 * T, shared_bytes("forward", T, Dk, Dv))
    host = device.to_host
    done, skipped = (int(x) for x in host(L.slots["TILES"]).sum(axis=0))
    lse, row_max = host(L.slots["LSE"]), host(L.slots["ROW_MAX"])
    materialized: dict[str, Any] = {
        "mode": "trace" if materialize else "streaming", "block_q": T, "block_k": T,
        "tiles_computed": done, "tiles_skipped": skipped, "device": device.describe(),
        "compile_options": list(device.compile_options),
    }
    extra: dict[str, Any] = {}
    if call.sink is not None:
        extra["sink_probs"] = np.exp(call.sink[None, :, None] - lse)  # (B, Hq, Q)
    if not materialize:
        materialized |= {"scores": False, "probabilities": False, "saved": list(_STREAM_SAVED),
                         "not_materialized": [n for n in FORWARD_NAMES
                                              if n not in _STREAM_SAVED]}
        return Trace(call=call, scores=None, biased_scores=None, masked_scores=None,
                     row_max=row_max, lse=lse, probs=None, dropout_multiplier=None,
                     consumed=None, output=host(L.slots["OUT"]), sanitized_rows=L.sanitized,
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
                 output=host(L.slots["OUT"]), sanitized_rows=L.sanitized, backend=device.name,
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
    T = int(trace.materialized["block_q"])
    L = _prepare(call, device)
    xp, host = device.xp, device.to_host
    g_o = np.where(call.query_valid_full(), grad_output, 0.0)  # unused rows consume nothing
    L.put("G_O", g_o)
    L.put("OUT", trace.output)
    L.put("LSE", trace.lse)
    L.slots["D"] = xp.zeros((B, Hq, Q))
    L.run("attention_row_dot_output", _grid_stride(B * Hq * Q), 256)
    row_dot_output = host(L.slots["D"])
    nqb, nkb = -(-Q // T), -(-K // T)
    traced = trace.probs is not None
    extra: dict[str, Any] = {}
    L.slots["TILES"] = xp.zeros((max(nqb * B * Hq, nkb * B * Hkv), 2), dtype=np.int64)
    if traced:  # the reference's D: sum_j P G_P, before any dS
        L.slots["ROW_DOT"] = xp.zeros((B, Hq, Q))
        L.set("DQ_MODE", 1)
        L.run(f"attention_dq_t{T}", (nqb, B * Hq), 4 * T, shared_bytes("dq", T, Dk, Dv))
        L.set("DQ_MODE", 0)
        L.slots["D"] = L.slots.pop("ROW_DOT")
        L.put("T_PROBS", trace.probs)
        L.put("T_Z", trace.dropout_multiplier)
        names = ("T_GRAD_CONSUMED", "T_GRAD_PROBS", "T_GRAD_SCORES")
        for name in names:
            L.slots[name] = xp.zeros((B, Hq, Q, K))
        L.run("attention_trace_backward", _grid_stride(B * Hq * Q * K), 256)
        grad_consumed, grad_probs, grad_scores = (host(L.slots[n]) for n in names)
        if call.softcap is not None:  # G_S (1 - tanh^2) from the capped scores
            extra["grad_softcap_input"] = grad_scores * (1.0 - (trace.scores / call.softcap)
                                                         ** 2)
    else:
        grad_consumed = grad_probs = grad_scores = None
    mode, gshape = _bias_gradient_mode(call)
    L.set("GBIAS_MODE", mode)
    L.slots["GBIAS"] = xp.zeros(gshape)
    L.slots["DQ"] = xp.zeros((B, Hq, Q, Dk))
    L.slots["ROW_DOT"] = xp.zeros((B, Hq, Q))  # the dq kernel's by-product
    L.run(f"attention_dq_t{T}", (nqb, B * Hq), 4 * T, shared_bytes("dq", T, Dk, Dv))
    row_dot = host(L.slots["ROW_DOT"])
    L.slots["DK"] = xp.zeros((B, Hkv, K, Dk))
    L.slots["DV"] = xp.zeros((B, Hkv, K, Dv))
    L.run(f"attention_dkdv_t{T}", (nkb, B * Hkv), 4 * T, shared_bytes("dkdv", T, Dk, Dv))
    if call.sink is not None:  # d lse / d sink = sink_probs; the sink carries no value row
        sink_probs = np.exp(call.sink[None, :, None] - trace.lse)
        extra["grad_sink"] = -(sink_probs * row_dot).sum(axis=(0, 2))
    grad_bias = None
    if call.bias is not None:
        grad_bias = reduce_to_shape(host(L.slots["GBIAS"]), call.bias.shape)
    return Gradients(grad_output=grad_output, grad_v=host(L.slots["DV"]),
                     grad_consumed=grad_consumed, grad_probs=grad_probs, row_dot=row_dot,
                     row_dot_output=row_dot_output, grad_scores=grad_scores,
                     grad_q=host(L.slots["DQ"]), grad_k=host(L.slots["DK"]),
                     grad_bias=grad_bias, **extra)
