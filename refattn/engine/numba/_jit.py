"""The one ``njit`` of refattn's kernels, with an on-disk cache keyed on the whole kernel source.

numba's own cache key is the source of the file that defines the jitted function. refattn's
kernels inline helpers from sibling modules (row primitives, operand readers, Philox, BLAS
intrinsics), so an edit to a helper would leave a stale compiled kernel in use. Here every
kernel of this package is cached under a stamp that hashes *every* ``.py`` file of
:mod:`refattn.engine.numba` together with the numba version: any edit to any of them makes the
next run recompile. The stamp is installed as a numba cache locator that answers only for
functions defined in this package; where numba's cache internals are not as expected, the
kernels are compiled without an on-disk cache instead (correct, only slower to start).

The first compilation in a process of any function of this package (a cache miss: numba
reports it as a ``numba:compile`` event, which a load from the on-disk cache never raises)
prints one line on standard error, :data:`COMPILE_NOTICE`, so that a user knows why the
first call takes seconds; ``REFATTN_QUIET=1`` silences it.

Kernel modules of this package import nothing else from refattn (an import contract in
``pyproject.toml`` enforces it), so these files are the whole of what a kernel depends on.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numba

__all__ = ["CACHE_KEYED", "COMPILE_NOTICE", "kernel", "source_stamp"]

_PACKAGE_DIR = Path(__file__).resolve().parent


@cache
def source_stamp() -> str:
    """sha256 over numba's version and every ``.py`` file of this package (name and bytes).

    Examples
    --------
    >>> len(source_stamp())
    64
    """
    h = hashlib.sha256(f"numba {numba.__version__}\n".encode())
    for path in sorted(_PACKAGE_DIR.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _install_locator() -> bool:
    """Put a locator for this package's functions first in numba's list; False if impossible."""
    try:
        from numba.core import caching
    except ImportError:  # pragma: no cover - numba without a caching module
        return False
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
    in_tree = (getattr(caching, "InTreeCacheLocator", None)
               or getattr(caching, "_InTreeCacheLocator", None))
    user_dir = (getattr(caching, "UserProvidedCacheLocator", None)
                or getattr(caching, "_UserProvidedCacheLocator", None))
    locators = getattr(impl, "_locator_classes", None)
    if not isinstance(locators, list) or in_tree is None or user_dir is None:
        return False

    def ours(py_file: str) -> bool:
        return Path(py_file).resolve().parent == _PACKAGE_DIR

    class _Keyed:
        """Mixin: a source stamp covering the whole package, for this package's files only."""

        def get_source_stamp(self) -> Any:
            return source_stamp()

        @classmethod
        def from_function(cls, py_func: Callable[..., Any], py_file: str) -> Any:
            if not ours(py_file):
                return None
            return super().from_function(py_func, py_file)  # type: ignore[misc]

    class KeyedUserDirLocator(_Keyed, user_dir):  # NUMBA_CACHE_DIR, when the user set one
        pass

    class KeyedInTreeLocator(_Keyed, in_tree):  # __pycache__ beside the kernels
        pass

    if not any(getattr(c, "__name__", "") == "KeyedInTreeLocator" for c in locators):
        locators[:0] = [KeyedUserDirLocator, KeyedInTreeLocator]
    return True


#: whether kernels use the keyed on-disk cache (False: compiled afresh in every process)
CACHE_KEYED: bool = os.environ.get("REFATTN_NUMBA_CACHE", "1") != "0" and _install_locator()

#: printed once per process, on standard error, when this package's first kernel compiles
COMPILE_NOTICE = ("refattn: compiling CPU kernels, about 20 s once; cached after"
                  if CACHE_KEYED else
                  "refattn: compiling CPU kernels, about 20 s (on-disk cache off: every process)")


def _install_notice() -> None:
    """Print :data:`COMPILE_NOTICE` when numba starts compiling one of this package's
    functions for the first time in this process (never for a load from the disk cache)."""
    from numba.core import event

    class _FirstCompile(event.Listener):
        printed = False

        def on_start(self, ev: Any) -> None:
            if self.printed or os.environ.get("REFATTN_QUIET", "") not in ("", "0"):
                return
            func = getattr((ev.data or {}).get("dispatcher"), "py_func", None)
            code = getattr(func, "__code__", None)
            if code is not None and Path(code.co_filename).resolve().parent == _PACKAGE_DIR:
                self.printed = True
                print(COMPILE_NOTICE, file=sys.stderr, flush=True)

        def on_end(self, ev: Any) -> None:
            return None

    event.register("numba:compile", _FirstCompile())


_install_notice()


def kernel(func: Callable[..., Any] | None = None, **options: Any) -> Any:
    """``numba.njit`` with the keyed on-disk cache for this package's functions.

    Used bare (``@kernel``) or with njit's options (``@kernel(parallel=True)``). A function
    defined elsewhere (a doctest, a user's module) is compiled without a cache.

    Examples
    --------
    >>> @kernel
    ... def twice(x):
    ...     return 2 * x
    >>> twice(21)
    42
    """
    def wrap(f: Callable[..., Any]) -> Any:
        ours = Path(f.__code__.co_filename).resolve().parent == _PACKAGE_DIR
        return numba.njit(cache=CACHE_KEYED and ours, **options)(f)

    return wrap if func is None else wrap(func)
