"""The CUDA C sources of the kernels, as one translation unit per compiler.

Owns reading ``kernels/*.cu`` and ``*.cuh`` (shipped as package data), their content hash (the
key of every compiled build) and the kernel names. The ``.cu`` file includes its headers by
name; a compiler is pointed at :data:`KERNEL_DIR` with ``-I``. The text a compiler sees starts
with ``#line 1 "<path>"`` so that diagnostics name the real file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["A_GLOBAL_ABOVE", "EXP_TABLE_DOUBLES", "FEATURE_SETS", "INSTANCES", "KERNELS",
           "KERNEL_DIR", "PAIRED", "PLAIN", "WIDE", "kernel_name", "source_hash",
           "translation_unit"]

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
MAIN = "attention.cu"
#: the doubles of a block's copy of the exp table (kernels/common.cuh's
#: REFATTN_EXP_TABLE_DOUBLES: 32 pairs 2^(j/32) = hi + lo, 8 copies of each;
#: :func:`gpu_backend.launch.uses_exp_table` says which instances hold one)
EXP_TABLE_DOUBLES = 512
#: the tensor-core kernels' instances, as attention.cu's entry points instantiate them:
#: kind -> head width D -> (MR, tile). A block is 4 warps of 8 MR rows: BQ = 32 MR query rows
#: (forward, dq: the tile is BK keys) or BKV = 32 MR keys (dkdv: the tile is BQ2 queries);
#: the general kernels at D = 128 (and the dk/dv at D = 64) pair their 8-row warps into 16-row
#: ones that split the tile or the head width (forward.cuh, backward.cuh: SPLIT;
#: :data:`PAIRED`), with the same BQ or BKV (:func:`gpu_backend.launch.shared_bytes`).
#: Above D = 128 (:data:`A_GLOBAL_ABOVE`) the warps read their own rows (the A operand: Q, G_O;
#: K, V in dkdv) from global memory instead of a shared tile.
INSTANCES: dict[str, dict[int, tuple[int, int]]] = {
    "forward": {32: (2, 24), 64: (2, 32), 128: (1, 16), 256: (1, 8)},
    "dq": {32: (2, 16), 64: (2, 16), 128: (1, 16), 256: (1, 8)},
    "dkdv": {32: (2, 32), 64: (1, 16), 128: (1, 16), 256: (1, 8)},
}
#: the plain instances (call.cuh's feature switches, F = 0): compiled without the softcap,
#: bias and dropout code, kind -> D -> (MR, tile) as INSTANCES; a call that uses none of those
#: features runs them (launch.plan), any other call the INSTANCES one ("general"). Only where
#: the model shows a gain, to bound compile time; at D = 128 the plain forward and dq have
#: 16-row warps (the general ones would spill), the forward with 8-key tiles (96 KiB: two
#: blocks, two warps per scheduler on an H100/H200), the plain dk/dv warp pairs as the general
#: one's, with dK in registers (:data:`PAIRED`); at D = 256 the forward and dq have 16-key
#: tiles (the dk/dv's gain is the wide instance's, :data:`WIDE`).
PLAIN: dict[str, dict[int, tuple[int, int]]] = {
    "forward": {64: (2, 32), 128: (2, 8), 256: (1, 16)},
    "dq": {64: (2, 32), 128: (2, 16), 256: (1, 16)},
    "dkdv": {64: (2, 32), 128: (1, 16)},
}
#: the wide instances: every feature compiled in, as INSTANCES, with larger tiles that only a
#: device with more shared memory holds (launch.plan prefers them there, after a plain
#: instance): the dq at D = 128 on warp pairs with 32-key tiles (212 KiB) and the dk/dv at
#: D = 256 with 16-query tiles (224 KiB), both H100/H200 only
WIDE: dict[str, dict[int, tuple[int, int]]] = {
    "dq": {128: (1, 32)},
    "dkdv": {256: (1, 16)},
}
#: the instances on warp pairs (SPLIT = 2 in forward.cuh, backward.cuh): feature set -> kind ->
#: head widths. A paired dq or dk/dv block holds the pairs' exchange regions of partial sums
#: (2 BQ BK or 2 BKV BQ2 doubles); a dk/dv one keeps dV in registers and holds them in place of
#: the dV accumulators, with every feature compiled in beside 6 of each warp's 8 dK n-tiles
#: (launch.shared_bytes)
PAIRED: dict[str, dict[str, tuple[int, ...]]] = {
    "general": {"forward": (128,), "dq": (128,), "dkdv": (64, 128)},
    "plain": {"dkdv": (128,)},
    "wide": {"dq": (128,)},
}
#: the feature sets of the instances: name -> (instance table, the call features it serves)
FEATURE_SETS: dict[str, tuple[dict[str, dict[int, tuple[int, int]]], str]] = {
    "general": (INSTANCES, "every call"),
    "plain": (PLAIN, "calls without softcap, bias and dropout"),
    "wide": (WIDE, "every call, where the device's shared memory holds it"),
}
#: attention.cu's REFATTN_A_GLOBAL: head widths above this read the A rows from global memory
A_GLOBAL_ABOVE = 128


def kernel_name(kind: str, D: int, features: str = "general") -> str:
    """The entry point of ``kind``'s instance at head width D with a feature set.

    >>> kernel_name("forward", 64), kernel_name("forward", 128, "plain")
    ('attention_forward_d64', 'attention_forward_plain_d128')
    """
    infix = "" if features == "general" else f"{features}_"
    return f"attention_{kind}_{infix}d{D}"


#: every extern "C" kernel of attention.cu
KERNELS: tuple[str, ...] = (
    *(kernel_name(kind, D, fs) for fs, (table, _) in FEATURE_SETS.items()
      for kind, dims in table.items() for D in dims),
    "attention_row_dot_output", "attention_trace_forward", "attention_trace_backward",
)


def translation_unit(directory: Path = KERNEL_DIR) -> str:
    """attention.cu with a ``#line`` directive naming its path."""
    path = directory / MAIN
    return f'#line 1 "{path}"\n' + path.read_text()


def source_hash(directory: Path = KERNEL_DIR, *extra: Path) -> str:
    """sha256 of every kernel source file (names and bytes), and of ``extra`` files.

    Examples
    --------
    >>> len(source_hash())
    64
    """
    h = hashlib.sha256()
    for path in [*sorted(Path(directory).glob("*.cu*")), *extra]:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()
