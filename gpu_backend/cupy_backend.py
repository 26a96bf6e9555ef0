"""Backend ``"cupy"``: the float64 kernels of ``kernels/attention.cu`` on a CUDA GPU via CuPy.

``refattn.forward(call, backend="cupy")`` compiles the kernels once per process with
``cupy.RawModule`` (NVRTC; the compile options are recorded in ``Trace.materialized``) and runs
the host program of :mod:`gpu_backend.launch`: the same source and launches as the
``"cuda_emulator"`` backend. With ``REFATTN_CUBIN_DIR`` set it loads a cubin built ahead
(``python3 -m gpu_backend.compile_check --arch sm_90 --cubin-dir DIR``: nvcc, the binary whose
SASS the compile check and the model read) instead of compiling, after checking that its
record names these kernel sources and the device's architecture. Arrays go in and come out
as numpy arrays (the call is validated on the host). Without CuPy or without a device, a
RefAttnError says what to install. Loaded lazily by refattn's backend registry; CuPy is
imported only here, inside functions.
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from gpu_backend import launch
from gpu_backend.source import KERNEL_DIR, source_hash, translation_unit
from refattn.call import AttentionCall
from refattn.engine.trace import Gradients, Trace
from refattn.errors import RefAttnError

__all__ = ["COMPILE_OPTIONS", "CUBIN_DIR_ENV", "CupyDevice", "backward", "forward",
           "module_source", "prebuilt_cubin", "value_and_grad"]

#: NVRTC options (CuPy adds -ftz=true and --device-as-default-execution-space itself)
COMPILE_OPTIONS: tuple[str, ...] = ("--std=c++17", f"-I{KERNEL_DIR}")
#: a directory of cubins built ahead (compile_check --cubin-dir), loaded instead of NVRTC
CUBIN_DIR_ENV = "REFATTN_CUBIN_DIR"


def prebuilt_cubin(directory: str | os.PathLike[str], arch: str) -> Path:
    """The cubin for ``arch`` (``"sm_90"``) in ``directory``, checked against its record.

    Raises
    ------
    RefAttnError
        When the cubin or its record is missing or unreadable, or the record names other
        kernel sources or another architecture (the command that rebuilds it is named).

    Examples
    --------
    >>> prebuilt_cubin("/nonexistent", "sm_90")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    refattn.errors.RefAttnError: REFATTN_CUBIN_DIR=/nonexistent: no attention.sm_90.cubin ...
    """
    cubin = Path(directory) / f"attention.{arch}.cubin"
    rebuild = (f"'python3 -m gpu_backend.compile_check --arch {arch} --cubin-dir "
               f"{directory}'")
    where = f"{CUBIN_DIR_ENV}={directory}"
    try:
        record = json.loads(cubin.with_suffix(".json").read_text())
        if not cubin.is_file():
            raise FileNotFoundError(cubin)
    except FileNotFoundError:
        raise RefAttnError(f"{where}: no {cubin.name} with its record for this {arch} device; "
                           f"build them with {rebuild}") from None
    except (OSError, ValueError) as exc:
        raise RefAttnError(f"{where}: {cubin.with_suffix('.json').name} is unreadable "
                           f"({exc}); rebuild with {rebuild}") from None
    want = source_hash(KERNEL_DIR)
    if not isinstance(record, dict) or record.get("source_hash") != want:
        got = record.get("source_hash") if isinstance(record, dict) else None
        raise RefAttnError(f"{where}: {cubin.name} was built from other kernel sources "
                           f"(sha256 {got}; these are {want}); rebuild with {rebuild}")
    if record.get("arch") != arch:
        raise RefAttnError(f"{where}: {cubin.name}'s record says arch {record.get('arch')!r}, "
                           f"expected {arch!r}; rebuild with {rebuild}")
    return cubin


def module_source() -> str:
    """The text given to ``cupy.RawModule``: attention.cu, led by the sha256 of every kernel
    source file.

    CuPy's on-disk kernel cache (``~/.cupy/kernel_cache``) keys a build on this text and the
    options only, never on the headers it includes (``cupy.cuda.compiler``
    ``_compile_with_cache_cuda``: ``key_src`` is the environment, the options, the source and
    CuPy's own headers), so an edited ``.cuh`` would load the stale binary without the hash.
    """
    return f"// refattn kernel sources sha256 {source_hash(KERNEL_DIR)}\n" + translation_unit()


def _cupy() -> Any:
    try:
        import cupy
    except ImportError:
        from refattn._install import install_hint

        raise RefAttnError(
            "backend 'cupy': CuPy is not installed; install the gpu extra for CUDA 13 "
            f"({install_hint('gpu')}, which brings cupy-cuda13x), or use "
            "backend='cuda_emulator' to run the same kernels on the CPU") from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, or no device visible
        raise RefAttnError(f"backend 'cupy': no CUDA device is usable here ({exc})") from None
    if count == 0:
        raise RefAttnError("backend 'cupy': no CUDA device is visible")
    return cupy


class CupyDevice:
    """The current CUDA device as a :class:`gpu_backend.launch.Device`."""

    name = "cupy"

    def __init__(self) -> None:
        cupy = _cupy()
        self.xp = cupy
        device = cupy.cuda.Device()
        self._props = cupy.cuda.runtime.getDeviceProperties(device.id)
        prebuilt = os.environ.get(CUBIN_DIR_ENV)
        if prebuilt:
            arch = f"sm_{self._props.get('major')}{self._props.get('minor')}"
            cubin = prebuilt_cubin(prebuilt, arch)
            self.module = cupy.RawModule(path=str(cubin))
            self.compile_options: tuple[str, ...] = ("prebuilt cubin", str(cubin))
        else:
            self.module = cupy.RawModule(code=module_source(), options=COMPILE_OPTIONS)
            self.compile_options = COMPILE_OPTIONS
        self.max_shared_bytes = int(self._props.get("sharedMemPerBlockOptin",
                                                    self._props.get("sharedMemPerBlock")))

    def get_function(self, name: str) -> Any:
        return self.module.get_function(name)

    def address(self, array: Any) -> int:
        return int(array.data.ptr)

    def to_device(self, array: Any) -> Any:
        if isinstance(array, np.ndarray):
            return self.xp.asarray(np.ascontiguousarray(array))
        if not array.flags.c_contiguous:
            raise RefAttnError("device array: expected a C-contiguous array with positive "
                               f"strides, got strides {array.strides}")
        return array

    def to_host(self, array: Any) -> np.ndarray:
        return self.xp.asnumpy(array)

    def free_bytes(self) -> int:
        """Bytes an allocation can get: the device's free memory and the blocks CuPy's pool
        holds unused (memGetInfo counts those as taken; the pool frees them and retries
        before it reports out of memory)."""
        return (int(self.xp.cuda.runtime.memGetInfo()[0])
                + int(self.xp.get_default_memory_pool().free_bytes()))

    def describe(self) -> dict[str, Any]:
        name = self._props.get("name", b"")
        return {"kind": "cupy", "name": name.decode() if isinstance(name, bytes) else name,
                "compute_capability": f"{self._props.get('major')}.{self._props.get('minor')}"}


@cache
def device() -> CupyDevice:
    """The CuPy device, with the kernels compiled once per process."""
    return CupyDevice()


def forward(call: AttentionCall, *, materialize: bool = True) -> Trace:
    """Forward pass on the GPU (see :func:`gpu_backend.launch.forward`)."""
    return launch.forward(device(), call, materialize=materialize)


def backward(trace: Trace, grad_output: np.ndarray) -> Gradients:
    """Backward pass on the GPU of a trace it made."""
    return launch.backward(device(), trace, grad_output)


def value_and_grad(call: AttentionCall, grad_output: np.ndarray) -> tuple[np.ndarray, Gradients]:
    """Output and gradients by the streaming kernels (no trace kept)."""
    trace = forward(call, materialize=False)
    return trace.output, backward(trace, grad_output)
