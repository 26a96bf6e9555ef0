"""Compile the CUDA sources for the CPU emulator with the system C++ compiler, cached.

Owns :func:`build`: ``cuda_emu.h`` and ``attention.cu`` as one translation unit, compiled by
``g++`` (or ``$CXX``) with ``-std=c++20 -Werror`` into a shared library whose name carries the
sha256 of the sources, the header, the flags and the compiler's version, so an edited kernel is
rebuilt and an unchanged one is reused. ``arch`` selects the code path of ``__CUDA_ARCH__``
(``-DREFATTN_EMU_ARCH``: 900 issues m16n8k4, 800 pairs of m8n8k4). On x86-64 the fibers
switch by a few instructions of assembly (cuda_emu.h), so the library is built with
``-fcf-protection=none``: it is not marked shadow-stack compatible, which that switch is not;
``defines=("REFATTN_EMU_UCONTEXT",)`` selects the portable ucontext fibers. Debug builds add
bounds-checked shared memory and a randomised thread order (``-DREFATTN_EMU_DEBUG``), compiled
unoptimised with symbols (``-O0 -g``): the mutation tests build one library per mutant, and
``-O0`` builds one in 2.5 s where ``-O1`` took 5.4 s (their kernels' calls are small).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from gpu_backend.source import KERNEL_DIR, MAIN, source_hash
from refattn.errors import RefAttnError

__all__ = ["HEADER", "build", "cache_dir", "compiler"]

HEADER = Path(__file__).resolve().parent / "cuda_emu.h"
_FLAGS = ("-std=c++20", "-fPIC", "-shared", "-pthread", "-Wall", "-Wextra", "-Werror",
          *(("-fcf-protection=none",) if platform.machine() in ("x86_64", "AMD64") else ()))
_RELEASE = ("-O2",)
_DEBUG = ("-O0", "-g", "-DREFATTN_EMU_DEBUG")


def compiler() -> str:
    """The C++ compiler to use: ``$CXX``, else g++, else c++."""
    for candidate in (os.environ.get("CXX"), "g++", "c++"):
        if candidate and shutil.which(candidate):
            return candidate
    raise RefAttnError("cuda_emulator: no C++20 compiler found (install g++ or set $CXX)")


@cache
def _version(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout


def cache_dir() -> Path:
    """Where builds are kept: ``$REFATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/refattn``."""
    root = os.environ.get("REFATTN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "refattn")
    path = Path(root) / "cuda_emulator"
    path.mkdir(parents=True, exist_ok=True)
    return path


def build(directory: Path = KERNEL_DIR, *, debug: bool = False, arch: int = 900,
          defines: tuple[str, ...] = ()) -> Path:
    """The emulator library of the kernels in ``directory`` (built once per source hash).

    Parameters
    ----------
    directory : path
        A folder holding ``attention.cu`` and its headers (the package's, or a copy that a
        test has edited).
    debug : bool
        Bounds-checked shared memory, NaN-poisoned at block start, random thread order.
    arch : int
        ``REFATTN_EMU_ARCH``: the ``__CUDA_ARCH__`` whose code path the kernels take (900 or
        800; they differ in the mma shapes they issue).
    defines : tuple of str
        Further preprocessor names to define (``-D``), e.g. ``"REFATTN_EMU_UCONTEXT"``.

    Returns
    -------
    Path
        The shared library.

    Raises
    ------
    RefAttnError
        Without a compiler, or with the compiler's diagnostics when the sources do not build.
    """
    cxx = compiler()
    if arch not in (800, 900):
        raise RefAttnError(f"cuda_emulator: arch must be 800 or 900, got {arch!r}")
    if not all(name.isidentifier() for name in defines):
        raise RefAttnError(f"cuda_emulator: defines must be preprocessor names, got {defines!r}")
    flags = (*_FLAGS, *(_DEBUG if debug else _RELEASE), f"-DREFATTN_EMU_ARCH={arch}",
             *(f"-D{name}" for name in defines))
    key = hashlib.sha256("\0".join([source_hash(directory, HEADER), _version(cxx), *flags])
                         .encode()).hexdigest()[:24]
    out = cache_dir() / f"refattn_emu_{key}{'_debug' if debug else ''}.so"
    if out.is_file():
        return out
    with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
        unit = Path(tmp) / "unit.cpp"
        unit.write_text(f'#include "{HEADER}"\n#include "{Path(directory).resolve() / MAIN}"\n')
        lib = Path(tmp) / out.name
        proc = subprocess.run([cxx, *flags, f"-I{Path(directory).resolve()}", str(unit), "-o",
                               str(lib)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RefAttnError(f"cuda_emulator: the kernels do not build with {cxx}:\n"
                               f"{proc.stderr[-4000:]}")
        os.replace(lib, out)  # atomic: a concurrent builder finds a whole library or none
    return out
