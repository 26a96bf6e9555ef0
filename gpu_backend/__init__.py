"""gpu_backend: refattn's float64 attention on a CUDA GPU (CuPy) and on a CPU emulator of CUDA.

Owns the CUDA C kernels (``kernels/*.cu``, ``*.cuh``: tiled online-softmax forward, recomputing
backward, trace mode, in-kernel visibility and Philox dropout), the host program that drives
them (:mod:`~gpu_backend.launch`), the two backends refattn's registry loads by name
(``"cupy"``: :mod:`~gpu_backend.cupy_backend`; ``"cuda_emulator"``:
:mod:`~gpu_backend.emulator_backend`), the emulator itself (:mod:`gpu_backend.emulator`) and
the compile checks for real architectures (:mod:`~gpu_backend.compile_check`). gpu_backend
imports refattn; refattn never imports gpu_backend. CuPy is imported lazily, only by the cupy
backend, so importing this package never needs it.
"""

from __future__ import annotations

__all__ = ["available"]


def available() -> bool:
    """Whether CuPy and a CUDA device can be used in this process.

    Examples
    --------
    >>> isinstance(available(), bool)
    True
    """
    try:
        import cupy
    except ImportError:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False
