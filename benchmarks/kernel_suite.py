"""The kernel suite's generation (issue 39, item 2): time, memory and size, each as users run it.

Three measurements, printed with the CPU model and the BLAS kernel:

1. ``refattn golden --suite kernels --out DIR`` (the numba generator: the whole suite, its
   recorded bounds, the files) in a process of its own, as a user runs it: wall seconds, the
   child's peak RSS (``getrusage(RUSAGE_CHILDREN)``), cases and bytes on disk. Targets: under
   3 minutes on 2 cores, under 1 GB.
2. Side by side on the same small kernel cases, each generator in a fresh process of its own
   (``refattn golden`` through the same ``write_bundle``, one case per process, interleaved):
   numba against exact, and the ratio. The exact generator's own estimate for the whole
   suite is printed next to it (the command refuses it above ``--max-seconds``).
3. The plugin's path: each case regenerated in this process when its test reads it
   (``load_cases(suite="kernels")``, then one output read per case): the median and the
   largest seconds per case at L <= 2048 and above.

Usage::

    python3 benchmarks/kernel_suite.py             # everything (about 2-4 minutes on 2 cores)
    python3 benchmarks/kernel_suite.py --quick     # 2 and 3 only, a few cases
    python3 benchmarks/kernel_suite.py --skip-suite  # 2 and 3 only
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from timing import environment  # benchmarks/ is the script's directory

ROOT = Path(__file__).resolve().parents[1]

ONE = """
import sys
from refattn.bundle.suites.kernels import SPECS, build
from refattn.bundle.writing.write import write_bundle
out, backend, case_id = sys.argv[1], sys.argv[2], sys.argv[3]
import time
spec = next(s for s in SPECS if s.case_id == case_id)
case = build(spec)
t0 = time.perf_counter()
write_bundle(out, [case], suite="kernels", backend=backend, progress=False)
print(time.perf_counter() - t0)
"""

#: cases the exact generator runs in a second up to about ten (its estimate), one per feature
#: family and the two mid-size shapes of FlashAttention's list ((113, 203), (256, 512))
SIDE_BY_SIDE = ("edge_causal_lr_q1_k65", "window_lr_q1_k147", "alibi_q1_k147",
                "decode_q1_k147", "varlen_q64_k101", "model_gptoss_q257_k129",
                "causal_lr_q113_k203", "shape_q256_k512_d64")


def whole_suite() -> None:
    out = Path(tempfile.mkdtemp()) / "kgoldens"
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "refattn", "golden", "--suite", "kernels",
                           "--out", str(out), "--quiet"], capture_output=True, text=True,
                          cwd=ROOT)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if proc.returncode:
        print(proc.stderr.strip())
        raise SystemExit(proc.returncode)
    files = list((out / "cases").iterdir())
    size = sum(f.stat().st_size for f in files) + (out / "manifest.json").stat().st_size
    print(f"refattn golden --suite kernels (numba): {len(files)} cases in {seconds:.1f} s, "
          f"peak RSS {max(peak, before) / 2**10:.0f} MiB (target: < 180 s, < 1024 MiB), "
          f"{size / 2**30:.2f} GiB on disk")
    shutil.rmtree(out.parent)


def side_by_side(rounds: int) -> None:
    from refattn.bundle.suites.kernels import SPECS, build
    from refattn.engine.exact.backend import estimate_seconds

    ids = [next(s.case_id for s in SPECS if s.case_id.startswith(p)) for p in SIDE_BY_SIDE]
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for cid in ids:
            for backend in ("numba", "exact"):  # interleaved, each in a process of its own
                out = Path(tempfile.mkdtemp()) / "b"
                proc = subprocess.run([sys.executable, "-c", ONE, str(out), backend, cid],
                                      capture_output=True, text=True, cwd=ROOT,
                                      env={**os.environ, "REFATTN_QUIET": "1"})
                if proc.returncode:
                    raise SystemExit(proc.stderr.strip())
                times.setdefault((cid, backend), []).append(float(proc.stdout.split()[-1]))
                shutil.rmtree(out.parent)
    print(f"\nper case, write_bundle in a fresh process per run, median of {rounds}:")
    print(f"{'case':<42} {'numba s':>9} {'exact s':>9} {'exact/numba':>12}")
    for cid in ids:
        n, e = (statistics.median(times[(cid, b)]) for b in ("numba", "exact"))
        print(f"{cid:<42} {n:>9.3f} {e:>9.3f} {e / n:>12.1f}")
    total = sum(estimate_seconds(build(s).call) for s in SPECS)
    print(f"the exact generator's own estimate for all {len(SPECS)} kernel cases: "
          f"{total / 3600:.1f} h (refattn golden refuses it above --max-seconds, 1 h)")


def plugin_path(limit: int | None) -> None:
    from refattn.testing import load_cases

    t0 = time.perf_counter()
    specs = load_cases(suite="kernels")
    collect = time.perf_counter() - t0
    small, large = [], []
    for spec in specs[:limit]:
        t0 = time.perf_counter()
        spec.tensors["output"]
        seconds = time.perf_counter() - t0
        (small if max(spec.axes["Q"], spec.axes["K"]) <= 2048 else large).append(seconds)
    print(f"\nthe plugin's path: {len(specs)} cases collected in {collect:.1f} s; each "
          f"regenerated when read: L <= 2048 median {statistics.median(small):.3f} s, max "
          f"{max(small):.3f} s ({len(small)} cases)"
          + (f"; L > 2048 median {statistics.median(large):.3f} s, max {max(large):.3f} s "
             f"({len(large)} cases)" if large else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="skip the whole suite; few cases")
    p.add_argument("--skip-suite", action="store_true", help="skip the whole suite's run")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    print(environment())
    if not (args.quick or args.skip_suite):
        whole_suite()
    side_by_side(1 if args.quick else args.rounds)
    plugin_path(20 if args.quick else None)


if __name__ == "__main__":
    main()
