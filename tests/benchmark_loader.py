"""Load a script of ``benchmarks/`` as a module without leaving its folder on ``sys.path``.

The scripts put ``benchmarks/`` (and the repository root) on the path so that they find each
other when run as ``python3 benchmarks/NAME.py``. Inside the test session that change would
outlive the test, and processes spawned later (dask's workers, multiprocessing) inherit the
path, so the path is restored once the script is loaded, and the scripts it imported from
``benchmarks/`` (``attention``, ``timing``) leave ``sys.modules`` again.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str, module_name: str | None = None) -> ModuleType:
    """Execute ``benchmarks/<name>.py`` and return it, with ``sys.path`` as it was before."""
    spec = importlib.util.spec_from_file_location(module_name or name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    saved, before = list(sys.path), set(sys.modules)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
        for name in set(sys.modules) - before:  # the scripts it imported from benchmarks/
            if Path(getattr(sys.modules[name], "__file__", None) or "/").parent == BENCHMARKS:
                del sys.modules[name]
    return module
