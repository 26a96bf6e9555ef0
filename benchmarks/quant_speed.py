"""Time and peak memory of a quantised check as a user runs it: ``quantized`` then
``check_candidate``, each measurement in a process of its own.

Issue 41's targets: ``quantized`` + ``check_candidate`` of an FA3 FP8 call at (1, 8, 1024, 128)
in under 5 s, and at (1, 8, 4096, 128) in under 60 s with a peak RSS under 4 GB, on 2 cores.
Each run is a fresh ``python`` process (the numba kernels loaded from their on-disk cache, as
a second run of a user's test finds them; a warm-up process fills the cache first) that builds
the same causal call (e4m3 codes of standard normal draws, seed 0, unit descales), times
``quantized`` (the real result from the streaming numba engine and the emulated intervals)
and ``check_candidate`` (the emulated lower ends, bf16 and fp32 values, as the candidate:
every report figure is computed), and reports its own peak RSS (``ru_maxrss``). Side by side
in one run: the ``"auto"`` truncation (exact sums of the truncations up to 2**28 products,
counted above) and, at 1024, the exact sums forced, with the median output radius each gives.
Prints the CPU model and the BLAS kernel with the figures.

Run: ``python benchmarks/quant_speed.py [--lengths 1024 4096] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.timing import environment

CHILD = r"""
import json, resource, sys, time
import numpy as np, refattn
from refattn.masks import causal
from refattn.quant import check_candidate, preset, quantized
from refattn.quant.formats import quantize
L, truncation = int(sys.argv[1]), sys.argv[2]
rng = np.random.default_rng(0)
q, k, v = (quantize(rng.standard_normal((1, 8, L, 128)), "e4m3fn", "nearest_even_satfinite")
           for _ in range(3))
call = refattn.AttentionCall(q, k, v, visible=causal(L, L, alignment="lower_right"))
t0 = time.perf_counter()
res = quantized(call, preset("fa3_fp8"), truncation=truncation)
t1 = time.perf_counter()
check_candidate(res, {"output": res.emulated["output"].lo, "lse": res.emulated["lse"].lo})
t2 = time.perf_counter()
print(json.dumps({"quantized": t1 - t0, "check": t2 - t1,
                  "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  "radius": float(np.median(res.emulated["output"].rad))}))
"""


def run(length: int, truncation: str) -> dict[str, float]:
    """One measurement in a fresh process."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(length), truncation],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{environment()}; FA3 FP8, causal, (1, 8, L, 128), median of {args.repeats} fresh "
          "processes each")
    run(256, "auto")  # fills the numba cache
    print("| L | truncation | quantized s | check s | total s | peak RSS GB | median radius |")
    print("|---|---|---|---|---|---|---|")
    for length in args.lengths:
        sides = ["auto", "exact"] if length <= 1024 else ["auto"]
        results: dict[str, list[dict[str, float]]] = {s: [] for s in sides}
        for _ in range(args.repeats):
            for side in sides:  # interleaved, so that drift hits both alike
                results[side].append(run(length, side))
        for side, rs in results.items():
            med = {key: statistics.median(r[key] for r in rs) for key in rs[0]}
            total = statistics.median(r["quantized"] + r["check"] for r in rs)
            print(f"| {length} | {side} | {med['quantized']:.2f} | {med['check']:.2f} | "
                  f"{total:.2f} | {med['rss_gb']:.2f} | {med['radius']:.4f} |")


if __name__ == "__main__":
    main()
