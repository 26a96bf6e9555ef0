"""Side-by-side timing for the benchmarks: interleaved rounds, medians and minima.

Round-robin timing spreads the drift of a shared machine over every variant alike. Each visit
pauses (thread pools left spinning by the previous variant go idle), runs one untimed warm call
(first-touch page faults of memory the machine handed back since the last visit land there),
then one timed call.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["cpu_model", "environment", "interleaved", "timed"]


def timed(fn: Callable[[], Any]) -> float:
    """Wall seconds of one call of ``fn`` (its result is dropped after the clock stops)."""
    t0 = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t0
    del result
    return seconds


def interleaved(fns: dict[str, Callable[[], Any]], *, min_rounds: int, budget: float = 0.0,
                settle: float = 0.2) -> dict[str, dict[str, float]]:
    """Median and minimum seconds of each callable, timed in rounds that visit each in turn.

    Rounds continue past ``min_rounds`` while the time spent is under ``budget`` seconds per
    callable, up to 15. Returns ``{name: {"median", "min", "rounds"}}``.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    start = time.perf_counter()
    rounds = 0
    while rounds < min_rounds or (time.perf_counter() - start < budget * len(fns) and rounds < 15):
        for name, fn in fns.items():
            time.sleep(settle)
            timed(fn)
            times[name].append(timed(fn))
        rounds += 1
    return {name: {"median": statistics.median(ts), "min": min(ts), "rounds": len(ts)}
            for name, ts in times.items()}


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo ("unknown" elsewhere), printed with every figure."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")),
                "unknown")


def environment() -> str:
    """The CPU (model, family, model number), cores, load and the BLAS libraries with their
    kernels (threadpoolctl), printed with every figure."""
    import numpy  # noqa: F401  (BLAS libraries are listed once loaded)
    import scipy.linalg  # noqa: F401
    from threadpoolctl import threadpool_info

    cpu = cpu_model()
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key = line.split(":", 1)[0].strip()
            if key in ("cpu family", "model") and key not in fields:
                fields[key] = line.split(":", 1)[1].strip()
    except OSError:
        pass
    blas = sorted({f"{i.get('internal_api')} {i.get('version')} {i.get('architecture')}"
                   for i in threadpool_info() if i.get("user_api") == "blas"})
    return (f"CPU {cpu} (family {fields.get('cpu family', '?')}, model "
            f"{fields.get('model', '?')}), {os.cpu_count()} cores, load "
            f"{os.getloadavg()[0]:.2f}; BLAS {', '.join(blas)}")
