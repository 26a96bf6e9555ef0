"""BLAS providers for the numba kernels, and the per-machine choice among them.

Owns :class:`Provider` (a Fortran-ABI ``dgemm`` address the kernels call, and how to set its
thread count), the providers found in this process -- scipy's OpenBLAS always; Intel oneMKL
from the ``mkl`` wheel (``pip install 'refattn[fast]'``) and BLIS where their libraries are
installed -- and the one-time calibration that times them, in both thread layouts, at attention
shapes and caches the winner per machine (``refattn calibrate`` re-runs it). The provider, its
layout and the fingerprint of the machine are recorded with every benchmark figure.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import glob
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from refattn.engine.numba.blas import dgemm_address, single_thread_blas
from refattn.errors import RefAttnError

__all__ = ["Provider", "available_providers", "calibrate", "calibration_path",
           "current_provider", "fingerprint"]

LAYOUTS = ("heads", "blas")  # heads on numba threads, one BLAS thread each; or threaded BLAS
BUDGETS_MIB = (2, 8, 32)  # per-thread score-buffer budgets a calibration tries


@dataclass(frozen=True)
class Provider:
    """One BLAS library as the kernels see it.

    Attributes
    ----------
    name : str
        ``openblas``, ``mkl`` or ``blis``.
    address : int
        Address of its Fortran-ABI ``dgemm``.
    version : str
    layout : str
        ``heads`` (tasks on numba threads, BLAS on one thread each) or ``blas`` (one task at
        a time on the library's own threads).
    budget : int
        Per-thread bytes of the fused kernel's score buffers (sets the query block).
    """

    name: str
    address: int
    version: str
    layout: str = "heads"
    budget: int = 8 << 20
    set_threads: Callable[[int], None] | None = field(default=None, repr=False, compare=False)
    get_threads: Callable[[], int] | None = field(default=None, repr=False, compare=False)

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
        return Provider(self.name, self.address, self.version, layout,
                        self.budget if budget is None else budget, self.set_threads,
                        self.get_threads)

    @property
    def key(self) -> str:
        """``name/layout/budget`` (budget in MiB), as calibrations record the choice."""
        return f"{self.name}/{self.layout}/{self.budget >> 20}"

    def record(self) -> dict[str, Any]:
        return {"provider": self.name, "version": self.version, "layout": self.layout,
                "budget_bytes": self.budget}


def _openblas() -> Provider:
    from threadpoolctl import threadpool_info

    address = dgemm_address()
    info = [i for i in threadpool_info() if i.get("internal_api") == "openblas"
            and "scipy" in os.path.basename(i.get("filepath", ""))]
    version = (f"{info[0].get('version')} {info[0].get('architecture')}" if info
               else "scipy's OpenBLAS")
    return Provider("openblas", address, version)


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


def _mkl() -> Provider | None:
    path = _find(("mkl_rt",))
    if path is None:
        return None
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    lib.MKL_Set_Interface_Layer(ctypes.c_int(0))  # LP64: 32-bit integers, as OpenBLAS's dgemm
    lib.MKL_Get_Max_Threads.restype = ctypes.c_int
    buffer = ctypes.create_string_buffer(256)
    lib.MKL_Get_Version_String(buffer, ctypes.c_int(256))
    address = ctypes.cast(lib.dgemm_, ctypes.c_void_p).value
    return Provider("mkl", int(address), buffer.value.decode(errors="replace").strip(),
                    set_threads=lambda n: lib.MKL_Set_Num_Threads(ctypes.c_int(n)),
                    get_threads=lib.MKL_Get_Max_Threads)


def _blis() -> Provider | None:
    path = _find(("blis", "blis-mt"))
    if path is None:
        return None
    lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    if not hasattr(lib, "dgemm_"):
        return None
    lib.bli_thread_get_num_threads.restype = ctypes.c_long
    return Provider("blis", int(ctypes.cast(lib.dgemm_, ctypes.c_void_p).value),
                    os.path.basename(path),
                    set_threads=lambda n: lib.bli_thread_set_num_threads(ctypes.c_long(n)),
                    get_threads=lib.bli_thread_get_num_threads)


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


def calibration_path() -> Path:
    """``$REFATTN_CACHE_DIR/calibration.json`` (default ``~/.cache/refattn``)."""
    root = os.environ.get("REFATTN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "refattn")
    return Path(root) / "calibration.json"


#: the attention shapes timed by a calibration: (B, Hq, Q, K, D)
QUICK_SHAPES = ((1, 4, 1024, 1024, 64),)
FULL_SHAPES = ((1, 4, 1024, 1024, 64), (1, 2, 1024, 1024, 128))


def calibrate(*, shapes: tuple[tuple[int, ...], ...] = QUICK_SHAPES, repeats: int = 5,
              write: bool = True) -> dict[str, Any]:
    """Time every provider, layout and buffer budget on ``value_and_grad`` at ``shapes``.

    Returns the record written to :func:`calibration_path`: the fingerprint, every
    ``provider/layout/budget`` time, and the fastest as the choice.
    """
    import numpy as np

    from refattn.call import AttentionCall
    from refattn.engine.numba.fused_host import value_and_grad

    rng = np.random.default_rng(0)
    calls = []
    for B, H, Q, K, D in shapes:
        q, k, v = (rng.standard_normal((B, H, n, D)) for n in (Q, K, K))
        calls.append((AttentionCall(q, k, v), rng.standard_normal((B, H, Q, D))))
    candidates = [base.with_layout(layout, mib << 20) for base in available_providers()
                  for layout in LAYOUTS for mib in BUDGETS_MIB]
    timings = {p.key: 0.0 for p in candidates}
    for p in candidates:  # warm every candidate (compiles on first use)
        for call, g in calls:
            value_and_grad(call, g, provider=p)
    for call, g in calls:
        best = dict.fromkeys(timings, float("inf"))
        for _ in range(repeats):  # interleaved rounds: drift in the machine hits every one
            for p in candidates:
                t0 = time.perf_counter()
                value_and_grad(call, g, provider=p)
                best[p.key] = min(best[p.key], time.perf_counter() - t0)
        for key, seconds in best.items():
            timings[key] += seconds
    choice = min(timings, key=timings.__getitem__)
    record = {"fingerprint": fingerprint(), "shapes": [list(s) for s in shapes],
              "seconds": timings, "choice": choice}
    if write:
        path = calibration_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)
    current_provider.cache_clear()
    return record


@cache
def current_provider() -> Provider:
    """The calibrated provider and layout of this machine (calibrating once if needed).

    ``REFATTN_BLAS_PROVIDER=name[/layout[/budget MiB]]`` overrides the calibration.
    """
    wanted = os.environ.get("REFATTN_BLAS_PROVIDER")
    if not wanted:
        try:
            record = json.loads(calibration_path().read_text())
            if record.get("fingerprint") == fingerprint():
                wanted = record["choice"]
        except (OSError, ValueError, KeyError):
            pass
    if not wanted:
        wanted = calibrate()["choice"]
    name, layout, budget = [*wanted.split("/"), "", ""][:3]
    for p in available_providers():
        if p.name == name:
            if layout and layout not in LAYOUTS:
                raise RefAttnError(f"REFATTN_BLAS_PROVIDER: layout {layout!r} is not one of "
                                   f"{list(LAYOUTS)}")
            if budget and not budget.isdigit():
                raise RefAttnError(f"REFATTN_BLAS_PROVIDER: budget {budget!r} is not a whole "
                                   "number of MiB")
            return p.with_layout(layout or "heads", int(budget) << 20 if budget else None)
    raise RefAttnError(f"REFATTN_BLAS_PROVIDER: provider {name!r} is not available here; "
                       f"available: {[p.name for p in available_providers()]}")
