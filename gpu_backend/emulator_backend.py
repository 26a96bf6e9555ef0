"""Backend ``"cuda_emulator"``: the GPU kernels, compiled for the CPU, run on CPU fibers.

``refattn.forward(call, backend="cuda_emulator")`` runs the same ``.cu`` source and the same
host program (:mod:`gpu_backend.launch`) as the ``"cupy"`` backend, with the emulator of
:mod:`gpu_backend.emulator` in place of a GPU: numpy arrays in host memory stand for device
arrays. Options: ``materialize`` (as for the GPU), ``debug`` (bounds-checked shared memory,
NaN-poisoned, random thread order) and ``seed`` (of that order). Loaded lazily by refattn's
backend registry.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from gpu_backend import launch
from gpu_backend.emulator.module import EmulatedModule
from gpu_backend.source import KERNEL_DIR
from refattn.call import AttentionCall
from refattn.engine.trace import Gradients, Trace
from refattn.errors import RefAttnError

__all__ = ["EmulatorDevice", "backward", "forward", "value_and_grad"]

#: the opt-in shared memory limit of an H100/H200 block, so the emulator runs the GPU's tiles
MAX_SHARED_BYTES = 227 * 1024


class EmulatorDevice:
    """The CPU emulator as a :class:`gpu_backend.launch.Device`."""

    xp = np
    max_shared_bytes = MAX_SHARED_BYTES

    def __init__(self, directory: Path = KERNEL_DIR, *, debug: bool = False,
                 seed: int = 0) -> None:
        self.module = EmulatedModule(directory, debug=debug, seed=seed)
        self.name = "cuda_emulator"
        self.debug, self.seed = debug, seed
        self.compile_options = (f"emulator build {self.module.path.name}",)

    def get_function(self, name: str) -> Any:
        return self.module.get_function(name)

    def address(self, array: np.ndarray) -> int:
        return int(array.ctypes.data)

    def to_device(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array)

    def to_host(self, array: np.ndarray) -> np.ndarray:
        return np.asarray(array)

    def free_bytes(self) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"kind": "cuda_emulator", "debug": self.debug, "seed": self.seed}


@cache
def device(debug: bool = False, seed: int = 0) -> EmulatorDevice:
    """One emulator device per (debug, seed), built once per process."""
    return EmulatorDevice(debug=debug, seed=seed)


def forward(call: AttentionCall, *, materialize: bool = True, debug: bool = False,
            seed: int = 0) -> Trace:
    """Forward pass on the emulator (see :func:`gpu_backend.launch.forward`).

    Examples
    --------
    >>> import refattn
    >>> x = np.array([[[[0.5, -1.0], [2.0, 0.25]]]])
    >>> t = refattn.forward(refattn.AttentionCall(x, x, x), backend="cuda_emulator")
    >>> bool(np.allclose(t.output, refattn.forward(refattn.AttentionCall(x, x, x)).output))
    True
    """
    if not isinstance(debug, bool) or not isinstance(seed, int):
        raise RefAttnError(f"cuda_emulator: debug must be a bool and seed an int, got "
                           f"{debug!r}, {seed!r}")
    return launch.forward(device(debug, seed), call, materialize=materialize)


def backward(trace: Trace, grad_output: np.ndarray) -> Gradients:
    """Backward pass on the emulator of a trace it made."""
    info = trace.materialized.get("device", {})
    return launch.backward(device(bool(info.get("debug", False)), int(info.get("seed", 0))),
                           trace, grad_output)


def value_and_grad(call: AttentionCall, grad_output: np.ndarray, *, debug: bool = False,
                   seed: int = 0) -> tuple[np.ndarray, Gradients]:
    """Output and gradients by the streaming kernels (no trace kept)."""
    trace = forward(call, materialize=False, debug=debug, seed=seed)
    return trace.output, backward(trace, grad_output)
