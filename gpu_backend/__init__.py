"""gpu_backend: the CuPy mirror of refattn's engine (raw CUDA kernels in ``kernels/*.cu``).

CuPy is imported lazily, only when the backend is used; importing this package never needs it.
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
