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

__all__ = ["LAYOUTS", "SMALL_GEMM_KERNELS", "TILE_KIB", "Library", "Provider",
           "available_providers", "cpu_caches", "cpu_model", "fingerprint"]

LAYOUTS = ("heads", "blas")  # heads on numba threads, one BLAS thread each; or threaded BLAS
#: OpenBLAS kernels (threadpoolctl's ``architecture``) with small-matrix dgemm kernels, on which
#: the fused kernel issues its thin products in tiles (``fused_host.split_tiles``): the AVX-512
#: ones. With the Haswell kernel the tiles measured 4% slower, so they are not used there
SMALL_GEMM_KERNELS = frozenset({"skylakex", "cooperlake", "sapphirerapids"})
#: KiB of ``V`` or ``K`` rows that one small-matrix ``O``/``dQ`` tile reads (the small-matrix
#: kernel does not pack that operand, every row of the tile reads all of it), as calibrations
#: try them; the first is the default. Which wins depends on the core, so it is timed, not
#: derived: on an AMD EPYC Zen 5 (48 KiB L1d) 24 KiB (in L1) took 0.91 of the fused time of
#: 120 KiB tiles at (1,8,4096,64); on a Zen 4 (32 KiB L1d) 96 KiB took 0.92 of 24 KiB's time at
#: (1,16,2048,128) and 0.95 at (1,8,4096,64), interleaved in one process (issue 27)
TILE_KIB = (24, 96)


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
    tile_kib : int
        KiB of ``V`` or ``K`` rows per small-matrix ``O``/``dQ`` tile, where the fused kernel
        issues its thin products in tiles (:attr:`small_tiles`); ignored elsewhere.

    Examples
    --------
    >>> p = Provider("openblas", "0.3.30 SkylakeX")
    >>> p.key, p.with_layout("heads", 16 << 20, tile_kib=96).key, p.with_layout("blas").key
    ('openblas/heads/8/24', 'openblas/heads/16/96', 'openblas/blas/8')
    >>> Provider("openblas", "0.3.30 Haswell").key, Provider("mkl", "2026.2").small_tiles
    ('openblas/heads/8', False)
    """

    name: str
    version: str
    layout: str = "heads"
    budget: int = 8 << 20
    tile_kib: int = TILE_KIB[0]
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

    def with_layout(self, layout: str, budget: int | None = None, *,
                    tile_kib: int | None = None) -> Provider:
        return Provider(self.name, self.version, layout,
                        self.budget if budget is None else budget,
                        self.tile_kib if tile_kib is None else tile_kib, self.load)

    @property
    def small_tiles(self) -> bool:
        """Whether the fused kernel issues its thin products in small-matrix tiles here:
        OpenBLAS on an AVX-512 kernel (:data:`SMALL_GEMM_KERNELS`, the last word of its
        version string) on one thread per task (the ``heads`` layout)."""
        kernel = self.version.split()[-1].lower() if self.version else ""
        return self.name == "openblas" and kernel in SMALL_GEMM_KERNELS and self.layout == "heads"

    @property
    def key(self) -> str:
        """``name/layout/budget[/tile]`` (budget in MiB, tile in KiB where :attr:`small_tiles`),
        as calibrations record the choice."""
        tile = f"/{self.tile_kib}" if self.small_tiles else ""
        return f"{self.name}/{self.layout}/{self.budget >> 20}{tile}"

    def record(self) -> dict[str, Any]:
        return {"provider": self.name, "version": self.version, "layout": self.layout,
                "budget_bytes": self.budget,
                "tile_kib": self.tile_kib if self.small_tiles else None}


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


def cpu_model(cpuinfo: str | None = None) -> str:
    r"""The CPU model name with its family and model numbers, from ``cpuinfo`` (the text of
    /proc/cpuinfo, read where None and available): a virtual machine may name an AMD Zen 4 and
    a Zen 5 both ``AMD EPYC``.

    Examples
    --------
    >>> cpu_model("processor\t: 0\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n")
    'AMD EPYC (family 25, model 17)'
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    first = cpuinfo.split("\n\n", 1)[0]  # the first processor's block
    info = {k.strip(): v.strip() for k, v in
            (line.split(":", 1) for line in first.splitlines() if ":" in line)}
    if "model name" not in info:
        return platform.processor() or platform.machine()
    numbers = [f"{label} {info[k]}" for k, label in (("cpu family", "family"), ("model", "model"))
               if k in info]
    return f"{info['model name']} ({', '.join(numbers)})" if numbers else info["model name"]


def cpu_caches(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> str:
    """The data and unified caches under ``root`` (CPU 0's, as Linux lists them), e.g. ``L1d
    32K, L2 1024K, L3 32768K``; empty where it does not say."""
    found = []
    for index in sorted(root.glob("index*")):
        try:
            level, kind, size = ((index / n).read_text().strip() for n in ("level", "type",
                                                                            "size"))
        except OSError:
            continue
        if kind != "Instruction":
            found.append(f"L{level}{'d' if kind == 'Data' else ''} {size}")
    return ", ".join(found)


def fingerprint() -> dict[str, Any]:
    """What a calibration depends on: the CPU and its caches, the core and thread counts, the
    providers, and the tile sizes a calibration tries."""
    import numba

    return {"cpu": cpu_model(), "caches": cpu_caches(), "cpus": os.cpu_count(),
            "numba_threads": numba.get_num_threads(),
            "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
            "providers": [f"{p.name} {p.version}" for p in available_providers()],
            "tile_kib": list(TILE_KIB)}
