"""The per-machine choice of BLAS provider, thread layout and buffer budget.

Owns the one-time calibration that times every provider (:mod:`.providers`) in both thread
layouts and at several budgets on the fused kernel (:mod:`.fused_host`) at attention shapes,
caches the fastest per machine fingerprint (``refattn calibrate`` re-runs it), and
:func:`current_provider`, the choice the numba backend runs with.
"""

from __future__ import annotations

import json
import os
import sys
import time
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from refattn._cachedir import cache_dir
from refattn.call import AttentionCall
from refattn.engine.numba.fused_host import value_and_grad
from refattn.engine.numba.providers import (
    LAYOUTS,
    TILE_KIB,
    Provider,
    available_providers,
    fingerprint,
)
from refattn.errors import RefAttnError

__all__ = ["BUDGETS_MIB", "CALIBRATION_SECONDS", "FULL_SHAPES", "QUICK_SHAPES", "calibrate",
           "calibration_notice", "calibration_path", "candidates", "current_provider"]

#: per-thread score-buffer budgets a calibration tries. 16 MiB since the O/dQ and dV/dK tiles
#: fit L1 (issue 27): at (1,16,2048,128) 16 MiB took 0.90-0.92 of 8 MiB's time and 32 MiB
#: 0.96-0.98, at (1,8,4096,64) the three tied within 5-10% (interleaved, load 4.5)
BUDGETS_MIB = (2, 8, 16, 32)
#: records of other fingerprints kept in the file (another environment or OPENBLAS_CORETYPE on
#: the same machine: each used to overwrite the other's, so switching recalibrated, possibly
#: under load and to another choice)
MAX_OTHERS = 8


def calibration_path() -> Path:
    """``$REFATTN_CACHE_DIR/calibration.json`` (default ``~/.cache/refattn``)."""
    return cache_dir() / "calibration.json"


#: the attention shapes timed by a calibration: (B, Hq, Q, K, D). Rows of 4096 keys, so that
#: every budget gives its own query block (32, 128, 256 and 512 rows at 2, 8, 16 and 32 MiB):
#: at 1024 keys the budgets tie within noise, and a 2 MiB choice cost 5-13% at L = 2048-4096 in
#: benchmarks/attention.py
QUICK_SHAPES = ((1, 2, 1024, 4096, 64),)
FULL_SHAPES = ((1, 2, 1024, 4096, 64), (1, 2, 1024, 2048, 128))

#: what an automatic calibration costs, as the notice states it (seconds, with the compile of a
#: cold kernel cache: measured 45 s on a 2-core Xeon with MKL; see docs/performance.md)
CALIBRATION_SECONDS = 45


def calibration_notice() -> str:
    """The one line printed on standard error when a call calibrates by itself.

    Examples
    --------
    >>> calibration_notice().startswith("refattn: calibrating the CPU path once")
    True
    """
    return (f"refattn: calibrating the CPU path once (about {CALIBRATION_SECONDS} s; cached in "
            f"{calibration_path()}; run 'refattn calibrate' ahead to avoid this)")


def candidates(providers: tuple[Provider, ...]) -> list[Provider]:
    """Every provider in both layouts at every budget of :data:`BUDGETS_MIB`, and, where the
    fused kernel tiles its thin products (:attr:`Provider.small_tiles
    <refattn.engine.numba.providers.Provider.small_tiles>`), at every tile size of
    :data:`~refattn.engine.numba.providers.TILE_KIB`.

    Examples
    --------
    >>> skx = Provider("openblas", "0.3.30 SkylakeX")
    >>> [p.key for p in candidates((skx,)) if p.budget == 16 << 20]
    ['openblas/heads/16/24', 'openblas/heads/16/96', 'openblas/blas/16']
    >>> len(candidates((Provider("openblas", "0.3.30 Haswell"),)))
    8
    """
    out = []
    for base in providers:
        for layout in LAYOUTS:
            for mib in BUDGETS_MIB:
                p = base.with_layout(layout, mib << 20)
                out += [p.with_layout(layout, tile_kib=t) for t in TILE_KIB] if p.small_tiles \
                    else [p]
    return out


def calibrate(*, shapes: tuple[tuple[int, ...], ...] = QUICK_SHAPES, repeats: int = 5,
              write: bool = True) -> dict[str, Any]:
    """Time every provider, layout, buffer budget and tile size (:func:`candidates`) on
    ``value_and_grad`` at ``shapes``.

    Returns the record written to :func:`calibration_path`: the fingerprint, every
    ``provider/layout/budget`` time, and the fastest as the choice.
    """
    rng = np.random.default_rng(0)
    calls = []
    for B, H, Q, K, D in shapes:
        q, k, v = (rng.standard_normal((B, H, n, D)) for n in (Q, K, K))
        calls.append((AttentionCall(q, k, v), rng.standard_normal((B, H, Q, D))))
    tried = candidates(tuple(p for p in available_providers() if _loads(p)))
    timings = {p.key: 0.0 for p in tried}
    for p in tried:  # warm every candidate (compiles on first use)
        for call, g in calls:
            value_and_grad(call, g, provider=p)
    for call, g in calls:
        best = dict.fromkeys(timings, float("inf"))
        for _ in range(repeats):  # interleaved rounds: drift in the machine hits every one
            for p in tried:
                t0 = time.perf_counter()
                value_and_grad(call, g, provider=p)
                best[p.key] = min(best[p.key], time.perf_counter() - t0)
        for key, seconds in best.items():
            timings[key] += seconds
    choice = min(timings, key=timings.__getitem__)
    record = {"fingerprint": fingerprint(), "shapes": [list(s) for s in shapes],
              "seconds": timings, "choice": choice}
    if write:  # this machine's record on top, other fingerprints' records kept under "others"
        path = calibration_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in _records(path) if r.get("fingerprint") != record["fingerprint"]]
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**record, "others": kept[:MAX_OTHERS]}, indent=1) + "\n")
        os.replace(tmp, path)
    current_provider.cache_clear()
    return record


def _records(path: Path) -> list[dict[str, Any]]:
    """The calibration records in ``path``: the latest, then the others kept (none if the file
    is missing or unreadable)."""
    try:
        top = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(top, dict):
        return []
    others = top.pop("others", [])
    if not isinstance(others, list):
        others = []
    return [top, *(r for r in others if isinstance(r, dict))]


def _loads(p: Provider) -> bool:
    """Whether ``p``'s library loads with the symbols the kernels need (loads it)."""
    try:
        return p.address != 0
    except (OSError, AttributeError):  # a library without the expected symbols
        return False


@cache
def current_provider() -> Provider:
    """The calibrated provider and layout of this machine (calibrating once if needed).

    A calibration run from here (no cached one for this machine's fingerprint) first prints
    :func:`calibration_notice` on standard error, once per process (the choice is cached in
    memory and on disk); ``REFATTN_QUIET=1`` silences it.
    ``REFATTN_BLAS_PROVIDER=name[/layout[/budget MiB[/tile KiB]]]`` overrides the calibration
    (the tile where the provider tiles its thin products; :data:`TILE_KIB`'s first by default).
    """
    wanted = os.environ.get("REFATTN_BLAS_PROVIDER")
    if not wanted:
        here = fingerprint()
        for record in _records(calibration_path()):
            if record.get("fingerprint") == here and isinstance(record.get("choice"), str):
                wanted = record["choice"]
                break
    if not wanted:  # inside the user's first call: say why it takes this long
        if os.environ.get("REFATTN_QUIET", "") in ("", "0"):
            print(calibration_notice(), file=sys.stderr, flush=True)
        wanted = calibrate(shapes=QUICK_SHAPES)["choice"]
    name, layout, budget, tile, *rest = [*wanted.split("/"), "", "", ""]
    if any(rest):
        raise RefAttnError(f"REFATTN_BLAS_PROVIDER: {wanted!r} has more than four parts "
                           "(name/layout/budget MiB/tile KiB)")
    for p in available_providers():
        if p.name == name:
            if layout and layout not in LAYOUTS:
                raise RefAttnError(f"REFATTN_BLAS_PROVIDER: layout {layout!r} is not one of "
                                   f"{list(LAYOUTS)}")
            for part, what in ((budget, "budget"), (tile, "tile")):
                if part and not (part.isdigit() and int(part) > 0):
                    unit = "MiB" if what == "budget" else "KiB"
                    raise RefAttnError(f"REFATTN_BLAS_PROVIDER: {what} {part!r} is not a "
                                       f"positive whole number of {unit}")
            return p.with_layout(layout or "heads", int(budget) << 20 if budget else None,
                                 tile_kib=int(tile) if tile else None)
    raise RefAttnError(f"REFATTN_BLAS_PROVIDER: provider {name!r} is not available here; "
                       f"available: {[p.name for p in available_providers()]}")
