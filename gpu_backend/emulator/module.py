"""A ctypes launcher with CuPy's RawModule/RawKernel call shape, over the emulator library.

``EmulatedModule(...).get_function(name)`` returns a kernel called as
``kernel(grid, block, args, shared_mem=n)``, exactly like ``cupy.RawKernel``: ``args`` is a
tuple of numpy arrays (passed as pointers to their data) and numpy scalars (passed by value
with their C type). A failed launch (a barrier divergence, an out-of-bounds shared-memory index
in a debug build) is a RefAttnError carrying the emulator's message.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import numpy as np

from gpu_backend.emulator.build import build
from gpu_backend.source import KERNEL_DIR
from refattn.errors import RefAttnError

__all__ = ["MMA_ROUNDINGS", "EmuOptions", "EmulatedKernel", "EmulatedModule"]


class EmuOptions(ctypes.Structure):
    """The C struct EmuOptions of cuda_emu.h."""

    _fields_ = [("threads", ctypes.c_uint), ("seed", ctypes.c_uint),
                ("stack_bytes", ctypes.c_ulonglong), ("mma_exact", ctypes.c_uint)]


#: how the emulator rounds an mma.sync f64 element: "chain" (a k-ascending fused multiply-add
#: chain, the default) or "exact" (the exact sum c + sum_k a_k b_k rounded once); the
#: environment variable REFATTN_EMU_MMA sets the default of every EmulatedModule
MMA_ROUNDINGS = ("chain", "exact")


_SCALARS = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
            np.dtype(np.uint32): ctypes.c_uint32, np.dtype(np.uint64): ctypes.c_uint64,
            np.dtype(np.float64): ctypes.c_double, np.dtype(np.float32): ctypes.c_float}


def _dim3(value: Any) -> Any:
    dims = (value,) if isinstance(value, int) else tuple(value)
    return (ctypes.c_uint * 3)(*(int(d) for d in (*dims, 1, 1, 1)[:3]))


class EmulatedKernel:
    """One kernel of an :class:`EmulatedModule` (call it like ``cupy.RawKernel``)."""

    def __init__(self, lib: ctypes.CDLL, name: str, options: EmuOptions) -> None:
        try:
            self._launch = getattr(lib, f"emu_launch_{name}")
        except AttributeError:
            raise RefAttnError(f"cuda_emulator: no kernel named {name!r}") from None
        self._launch.restype = ctypes.c_int
        self._lib, self.name, self._options = lib, name, options

    def __call__(self, grid: Any, block: Any, args: tuple[Any, ...], *,
                 shared_mem: int = 0) -> None:
        holders, argv = [], (ctypes.c_void_p * len(args))()
        for n, arg in enumerate(args):
            if isinstance(arg, np.ndarray):
                holder: Any = ctypes.c_void_p(arg.ctypes.data)
            elif isinstance(arg, np.generic) and arg.dtype in _SCALARS:
                holder = _SCALARS[arg.dtype](arg.item())
            else:
                raise RefAttnError(f"kernel {self.name}: argument {n} must be a numpy array or "
                                   f"a numpy scalar, got {type(arg).__name__}")
            holders.append(holder)
            argv[n] = ctypes.cast(ctypes.pointer(holder), ctypes.c_void_p)
        rc = self._launch(_dim3(grid), _dim3(block), ctypes.c_size_t(shared_mem), argv,
                          ctypes.byref(self._options))
        if rc != 0:
            message = ctypes.c_char_p(self._lib.emu_last_error()).value or b""
            raise RefAttnError(f"kernel {self.name} (cuda_emulator): {message.decode()}")


class EmulatedModule:
    """The kernels of ``directory`` built for the CPU (the counterpart of ``cupy.RawModule``).

    Parameters
    ----------
    directory : path
        Folder of ``attention.cu`` and its headers.
    debug : bool
        A debug build (bounds-checked shared memory, random thread order).
    threads : int
        OS threads that run blocks (0: one per core).
    seed : int
        Seed of the thread order in a debug build.
    mma : {"chain", "exact"} or None
        Rounding of the emulated mma.sync f64 (see :data:`MMA_ROUNDINGS`); None reads
        ``$REFATTN_EMU_MMA`` (default "chain").
    arch : int
        The architecture whose code path the kernels take (900: m16n8k4 tiles, 800: pairs of
        m8n8k4), as ``__CUDA_ARCH__`` on a GPU.
    defines : tuple of str
        Further preprocessor names for the build (:func:`gpu_backend.emulator.build.build`).
    """

    def __init__(self, directory: Path = KERNEL_DIR, *, debug: bool = False, threads: int = 0,
                 seed: int = 0, mma: str | None = None, arch: int = 900,
                 defines: tuple[str, ...] = ()) -> None:
        mma = mma if mma is not None else os.environ.get("REFATTN_EMU_MMA", "chain")
        if mma not in MMA_ROUNDINGS:
            raise RefAttnError(f"cuda_emulator: mma rounding must be one of {MMA_ROUNDINGS}, "
                               f"got {mma!r} (REFATTN_EMU_MMA)")
        self.path = build(directory, debug=debug, arch=arch, defines=defines)
        self.debug, self.mma, self.arch = debug, mma, arch
        self._lib = ctypes.CDLL(str(self.path))
        self._lib.emu_last_error.restype = ctypes.c_void_p
        self._options = EmuOptions(threads, seed, 0, int(mma == "exact"))

    def get_function(self, name: str) -> EmulatedKernel:
        return EmulatedKernel(self._lib, name, self._options)
