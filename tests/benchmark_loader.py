"""Load a script of ``benchmarks/`` as a module without leaving its folder on ``sys.path``.

The scripts put ``benchmarks/`` (and the repository root) on the path so that they find each
other when run as ``python3 benchmarks/NAME.py``. Inside the test session that change would
outlive the test, and processes spawned later (dask's workers, multiprocessing) inherit the
path, so the path is restored once the script is loaded.
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
    saved = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module
