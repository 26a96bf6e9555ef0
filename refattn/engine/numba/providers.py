"""BLAS providers for the numba kernels.

Owns :class:`Provider` (a Fortran-ABI ``dgemm`` address the kernels call, its thread layout and
buffer budget, and how to set its thread count), the providers found in this process --
scipy's OpenBLAS always; Intel oneMKL from the ``mkl`` wheel (``pip install 'refattn[fast]'``)
and BLIS where their libraries are installed -- and the machine fingerprint a calibration
(:mod:`.calibration`) is keyed on.

MKL and BLIS are found by their files and loaded only when a provider of theirs runs (a
calibration, or the calibrated choice). Loading ``mkl_rt`` puts its ``dgemm_`` and the Intel
OpenMP runtime it brings into the process's global symbol scope (it opens its own libraries
that way, whatever mode ``mkl_rt`` itself is opened in): torch imported *after* it binds its
``dgemm_``, ``GOMP_parallel`` and ``omp_get_max_threads`` to them instead of its own (seen with
``LD_DEBUG=bindings``). Loading it only where it is used keeps every other process's
libraries as they were.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import glob
import os
import platform
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from refattn.engine.numba.blas import dgemm_address, single_thread_blas

__all__ = ["LAYOUTS", "Library", "Provider", "available_providers", "cpu_model", "fingerprint"]

LAYOUTS = ("heads", "blas")  # heads on numba threads, one BLAS thread each; or threaded BLAS


@dataclass(frozen=True)
class Provider:
    """One BLAS library as the kernels see it.

    Attributes
    ----------
    name : str
        ``openblas``, ``mkl`` or ``blis``.
    version : str
    layout : str
        ``heads`` (tasks on numba threads, BLAS on one thread each) or ``blas`` (one task at
        a time on the library's own threads).
    budget : int
        Per-thread bytes of the fused kernel's score buffers (sets the query block).
    """

    name: str
    version: str
    layout: str = "heads"
    budget: int = 8 << 20
    load: Callable[[], Library] = field(default=lambda: Library(0), repr=False, compare=False)

    @property
    def address(self) -> int:
        """Address of its Fortran-ABI ``dgemm`` (loads the library on first use)."""
        return self.load().address

    @property
    def set_threads(self) -> Callable[[int], None] | None:
        return self.load().set_threads

    @property
    def get_threads(self) -> Callable[[], int] | None:
        return self.load().get_threads

    @contextlib.contextmanager
    def threads(self, n: int) -> Iterator[None]:
        """Run with the library on ``n`` threads (restored afterwards)."""
        if self.set_threads is None:  # openblas: threadpoolctl knows it
            if n == 1:
                with single_thread_blas():
                    yield
            else:
                yield
            return
        saved = self.get_threads() if self.get_threads else None
        self.set_threads(n)
        try:
            yield
        finally:
            if saved is not None:
                self.set_threads(saved)

    def with_layout(self, layout: str, budget: int | None = None) -> Provider:
        return Provider(self.name, self.version, layout,
                        self.budget if budget is None else budget, self.load)

    @property
    def key(self) -> str:
        """``name/layout/budget`` (budget in MiB), as calibrations record the choice."""
        return f"{self.name}/{self.layout}/{self.budget >> 20}"

    def record(self) -> dict[str, Any]:
        return {"provider": self.name, "version": self.version, "layout": self.layout,
                "budget_bytes": self.budget}


@dataclass(frozen=True)
class Library:
    """A loaded BLAS: its ``dgemm`` address and thread setters (None: threadpoolctl's)."""

    address: int
    set_threads: Callable[[int], None] | None = None
    get_threads: Callable[[], int] | None = None


def _openblas() -> Provider:
    from threadpoolctl import threadpool_info

    address = dgemm_address()
    # scipy's wheel keeps its OpenBLAS in scipy.libs/; numpy's ILP64 copy (numpy.libs/,
    # also named libscipy_openblas64_) is another library, loaded first or not
    info = [i for i in threadpool_info() if i.get("internal_api") == "openblas"
            and os.path.basename(os.path.dirname(i.get("filepath", ""))) == "scipy.libs"]
    version = (f"{info[0].get('version')} {info[0].get('architecture')}" if info
               else "scipy's OpenBLAS")
    return Provider("openblas", version, load=cache(lambda: Library(address)))


def _find(names: tuple[str, ...]) -> str | None:
    for name in names:
        for root in (os.path.join(sys.prefix, "lib"), "/usr/lib/x86_64-linux-gnu", "/usr/lib"):
            hits = sorted(glob.glob(os.path.join(root, f"lib{name}.so*")))
            if hits:
                return hits[0]
        found = ctypes.util.find_library(name)
        if found:
            return found
    return None


def _version(distribution: str, path: str) -> str:
    """The installed wheel's version, else the library's file name (nothing is loaded)."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return os.path.basename(path)


def _load_mkl(path: str) -> Library:
    # RTLD_LOCAL for mkl_rt itself; the libraries it opens (mkl_intel_lp64, libiomp5) still
    # land in the global scope, hence the lazy load (the module docstring)
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    lib.MKL_Set_Interface_Layer(ctypes.c_int(0))  # LP64: 32-bit integers, as OpenBLAS's dgemm
    lib.MKL_Get_Max_Threads.restype = ctypes.c_int
    address = ctypes.cast(lib.dgemm_, ctypes.c_void_p).value
    return Library(int(address), lambda n: lib.MKL_Set_Num_Threads(ctypes.c_int(n)),
                   lib.MKL_Get_Max_Threads)


def _load_blis(path: str) -> Library:
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    lib.bli_thread_get_num_threads.restype = ctypes.c_long
    return Library(int(ctypes.cast(lib.dgemm_, ctypes.c_void_p).value),
                   lambda n: lib.bli_thread_set_num_threads(ctypes.c_long(n)),
                   lib.bli_thread_get_num_threads)


def _mkl() -> Provider | None:
    path = _find(("mkl_rt",))
    if path is None:
        return None
    return Provider("mkl", _version("mkl", path), load=cache(lambda: _load_mkl(path)))


def _blis() -> Provider | None:
    path = _find(("blis", "blis-mt"))
    if path is None:
        return None
    return Provider("blis", os.path.basename(path), load=cache(lambda: _load_blis(path)))


@cache
def available_providers() -> tuple[Provider, ...]:
    """The providers this process can call (OpenBLAS first, always present)."""
    found = [_openblas()]
    for make in (_mkl, _blis):
        try:
            p = make()
        except (OSError, AttributeError):  # a library without the expected symbols
            p = None
        if p is not None:
            found.append(p)
    return tuple(found)


def cpu_model() -> str:
    """The CPU model name (from /proc/cpuinfo where available)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fingerprint() -> dict[str, Any]:
    """What a calibration depends on: the CPU, the core and thread counts, the providers."""
    import numba

    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "numba_threads": numba.get_num_threads(),
            "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
            "providers": [f"{p.name} {p.version}" for p in available_providers()]}
