"""The fused kernel's thin products, whole and in small-matrix tiles, on one thread.

``O = E V`` (and ``dQ = dS K``: the same shapes) and ``dV += E^T dO`` (and ``dK += dS^T Q``) at
the fused kernel's block shape (``BQ`` query rows of ``K`` keys, the kernel's padded row
stride ``fused_host.score_stride``; ``D`` columns out), each issued whole (one ``dgemm``:
OpenBLAS packs the score block) or in tiles (:func:`refattn.engine.numba.blas.gemm_split`)
of a few sizes: the kernel's own (``fused_host.split_tiles``), others within OpenBLAS's
small-matrix bound (``m n k <= 100**3``) and one twice past it. Every figure is GFLOP/s of
process CPU time on one thread (BLAS pinned to one thread, one numba thread: on a shared
machine CPU time is less disturbed by other jobs than wall time), over square DGEMM on the
same thread timed in the same rounds. Usage::

    python3 benchmarks/gemm_tiles.py                      # (128, 4096, 64) and (256, 2048, 128)
    python3 benchmarks/gemm_tiles.py --shape 128,4096,64 --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from refattn.engine.numba.blas import (  # noqa: E402
    dgemm_address,
    gemm_split,
    single_thread_blas,
)
from refattn.engine.numba.fused_host import (  # noqa: E402
    SMALL_GEMM,
    Layout,
    score_stride,
    split_tiles,
)
from refattn.engine.numba.providers import (  # noqa: E402
    TILE_KIB,
    Provider,
    cpu_caches,
    cpu_model,
)

__all__ = ["configs", "rate"]

WHOLE = np.iinfo(np.int32).max


@njit(cache=True)
def _products(transposed, fptr, e, LD, v, g, o, dv, bq, K, D, cm, ck, reps):
    """``reps`` times: O = E V (``transposed`` False) or dV += E^T G, in (cm x ck) tiles."""
    for _ in range(reps):
        if transposed:  # dV (K x D) += E^T (K x bq) G (bq x D)
            gemm_split(fptr, True, False, K, D, bq, 1.0, e.ctypes.data, LD, g.ctypes.data, D,
                       1.0, dv.ctypes.data, D, cm, ck)
        else:  # O (bq x D) = E (bq x K) V (K x D)
            gemm_split(fptr, False, False, bq, D, K, 1.0, e.ctypes.data, LD, v.ctypes.data, D,
                       0.0, o.ctypes.data, D, cm, ck)


def configs(bq: int, D: int) -> list[tuple[str, bool, int, int]]:
    """(label, transposed, rows of C per tile, inner per tile): whole, and tiles that fit."""
    def fit(other: int) -> int:
        return max(8, SMALL_GEMM // (other * D) // 8 * 8)

    out = []
    for kib in TILE_KIB:  # the tiles of each size a calibration tries
        kern = split_tiles(Provider("openblas", "0 SkylakeX", tile_kib=kib), Layout(bq, 1, 1, 1),
                           D, D).tolist()
        out += [(f"O = E V kernel tiles {kern[0]} x {kern[1]} ({kib} KiB)", False, kern[0],
                 kern[1]),
                (f"dV += E^T G kernel tiles {kern[2]} x {kern[3]} ({kib} KiB)", True, kern[2],
                 kern[3])]
    out += [("O = E V whole", False, WHOLE, WHOLE)]
    out += [(f"O = E V tiles {cm} x {fit(cm)}", False, cm, fit(cm)) for cm in (bq, 64, 32)
            if cm <= bq]
    out += [(f"O = E V tiles {bq} x {2 * fit(bq)} (past the bound)", False, bq, 2 * fit(bq))]
    out += [("dV += E^T G whole", True, WHOLE, WHOLE)]
    out += [(f"dV += E^T G tiles {fit(ck)} x {ck}", True, fit(ck), ck) for ck in (64, 32, 16)
            if ck <= bq]
    out += [(f"dV += E^T G tiles {2 * fit(64)} x 64 (past the bound)", True, 2 * fit(64), 64)]
    return out


def rate(transposed: bool, bq: int, K: int, D: int, cm: int, ck: int) -> float:
    """GFLOP/s of CPU time of one product configuration (about 2 GFLOP of work)."""
    rng = np.random.default_rng(0)
    LD = score_stride(K)
    e = rng.standard_normal(bq * LD)
    v, g = rng.standard_normal((K, D)), rng.standard_normal((bq, D))
    o, dv = np.zeros((bq, D)), np.zeros((K, D))
    fptr = dgemm_address()
    reps = max(1, int(2e9 / (2 * bq * K * D)))
    _products(transposed, fptr, e, LD, v, g, o, dv, bq, K, D, cm, ck, 1)
    c0 = time.process_time()
    _products(transposed, fptr, e, LD, v, g, o, dv, bq, K, D, cm, ck, reps)
    return 2.0 * bq * K * D * reps / (time.process_time() - c0) / 1e9


def square(n: int = 2048) -> float:
    """GFLOP/s of CPU time of square DGEMM on scipy's BLAS (the kernels' dgemm)."""
    from scipy.linalg.blas import dgemm

    rng = np.random.default_rng(1)
    a, b = (np.asfortranarray(rng.standard_normal((n, n))) for _ in range(2))
    dgemm(1.0, a, b)
    c0 = time.process_time()
    dgemm(1.0, a, b)
    dgemm(1.0, a, b)
    return 4 * n**3 / (time.process_time() - c0) / 1e9


def run(bq: int, K: int, D: int, rounds: int) -> dict[str, Any]:
    """Medians over interleaved rounds: square DGEMM, then every configuration."""
    cfg = configs(bq, D)
    got: dict[str, list[float]] = {label: [] for label, *_ in cfg}
    ref: list[float] = []
    with single_thread_blas():
        for _ in range(rounds):
            ref.append(square())
            for label, transposed, cm, ck in cfg:
                got[label].append(rate(transposed, bq, K, D, cm, ck))
    return {"dgemm": statistics.median(ref),
            "gflops": {label: statistics.median(x) for label, x in got.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", help="BQ,K,D (default: 128,4096,64 and 256,2048,128)")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    shapes = [(128, 4096, 64), (256, 2048, 128)]
    if args.shape:
        shapes = [tuple(int(x) for x in args.shape.split(","))]
    from threadpoolctl import threadpool_info

    kernels = {i.get("architecture") for i in threadpool_info() if i.get("user_api") == "blas"}
    print(f"cpu: {cpu_model()} ({cpu_caches()})")
    print(f"one thread, CPU time; OpenBLAS kernels {sorted(map(str, kernels))}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for bq, K, D in shapes:
        r = run(bq, K, D, args.rounds)
        print(f"BQ={bq} K={K} D={D}: square DGEMM {r['dgemm']:.1f} GF/s (one thread)")
        for label, g in r["gflops"].items():
            print(f"  {label:<44} {g:6.1f} GF/s = {g / r['dgemm']:.2f} of DGEMM")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
