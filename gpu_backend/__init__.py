"""gpu_backend: the place of refattn's GPU mirror; today only :func:`available`.

Says whether CuPy and a CUDA device can be used in this process. CuPy is imported lazily, inside
the function; importing this package never needs it. gpu_backend may import refattn, never the
reverse (refattn's backend registry loads a backend module by name).
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
