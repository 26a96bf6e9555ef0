"""Issue 41, item 5: honest and buggy kernel simulations against refattn.quant's emulator.

Runs the corpus of ``tests/quant/corpus.py`` at the issue's shapes: random FA3-style calls (D in
{64, 128}, Q, K <= 256, about 2/3 causal lower-right, GQA and MQA, e4m3(randn x a) inputs with a
in [1, 4], float32 (B, Hkv) descales log-uniform in [0.25, 4], FA3's FP8 kBlockN as the kv tile)
and SageAttention-style calls (fp16, Q == K when causal). Each call's honest simulations (FA3:
sequential, pairwise, random-order, 13- and 14-bit WGMMA accumulators; SageAttention: with and
without K smoothing, both scale orders) and planted bugs are checked with
``check_candidate(quantized(call, preset(...)), ...)``. Printed: per bug, the calls, the calls it
changes by more than the honest kernels' own error ("affected"), how many of those the check
catches and the rate; the honest variants' false alarms; and the median (of per-call medians)
and max output radius of a second corpus at input amplitude 1. The figures regenerate the bug
table of docs/quant.md.

Usage::

    python3 benchmarks/quant_corpus.py                 # 24 FA3 and 24 SageAttention calls
    python3 benchmarks/quant_corpus.py --calls 8 --max-len 128
    python3 benchmarks/quant_corpus.py --kernel fa3 --mma-bits 24
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _cpu_model() -> str:
    try:
        from benchmarks.timing import cpu_model
        return cpu_model()
    except Exception:  # a broken import: read /proc/cpuinfo here
        try:
            lines = Path("/proc/cpuinfo").read_text().splitlines()
        except OSError:
            return "unknown"
        return next((ln.split(":", 1)[1].strip() for ln in lines
                     if ln.startswith("model name")), "unknown")


def _fmt(x: float) -> str:
    return f"{x:.3g}" if x == x else "n/a"


def _report(title: str, verdicts: list, radius: dict | None, seconds: float) -> None:
    from tests.quant import corpus
    s = corpus.summarize(verdicts)
    print(f"\n## {title}: {len(verdicts)} calls, {seconds:.0f} s "
          f"(simulations {sum(v.seconds['sims'] for v in verdicts):.0f} s, emulation and "
          f"checks {sum(v.seconds['check'] for v in verdicts):.0f} s)\n")
    print("| bug | calls | affected | caught among affected | rate | caught, unaffected |")
    print("|---|---|---|---|---|---|")
    for bug, row in s["bugs"].items():
        rate = "n/a" if row["rate"] is None else f"{row['rate']:.2f}"
        print(f"| {bug} | {row['calls']} | {row['affected']} | {row['caught']} | {rate} | "
              f"{row['caught_unaffected']} |")
    print("\n| honest variant | calls | false alarms |")
    print("|---|---|---|")
    for name, row in s["honest"].items():
        print(f"| {name} | {row['calls']} | {row['false_alarms']} |")
    print(f"\noutput radius (amplitude as drawn): median of per-call medians "
          f"{_fmt(s['radius_median'])}, max {_fmt(s['radius_max'])}")
    if radius is not None:
        print(f"output radius at amplitude 1 ({radius['calls']} calls): median of per-call "
              f"medians {_fmt(radius['radius_median'])}, max {_fmt(radius['radius_max'])}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=24, help="calls per kernel (default 24)")
    p.add_argument("--radius-calls", type=int, default=None,
                   help="calls of the amplitude-1 corpus (default: --calls)")
    p.add_argument("--max-len", type=int, default=256, help="largest Q and K (default 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernel", choices=("fa3", "sage", "both"), default="both")
    p.add_argument("--mma-bits", type=int, default=None,
                   help="override the presets' mma_bits (default: the presets')")
    p.add_argument("--block-n", type=int, default=None,
                   help="FA3 kv tile (default: FA3's FP8 kBlockN of the head dim)")
    p.add_argument("--verbose", action="store_true", help="one line per call")
    args = p.parse_args()

    import numpy as np

    from tests.quant import corpus

    overrides = {} if args.mma_bits is None else {"mma_bits": args.mma_bits}
    print(f"quant corpus: seed {args.seed}, {args.calls} calls per kernel, Q, K <= "
          f"{args.max_len}, mma_bits {args.mma_bits or 'preset default'}; CPU: {_cpu_model()}; "
          f"numpy {np.__version__}")

    def progress(v) -> None:
        if args.verbose:
            missed = [b for b, passed in v.bugs.items() if passed and v.affected[b]]
            alarms = [h for h, passed in v.honest.items() if not passed]
            print(f"  {v.name} {v.info} honest error {v.honest_error:.3g} radius "
                  f"{v.radius} missed {missed} false alarms {alarms} "
                  f"({v.seconds['sims'] + v.seconds['check']:.1f} s)", flush=True)

    kernels = {"fa3": ("FA3 FP8 forward (fa3_fp8)", corpus.fa3_calls, {"block_n": args.block_n}),
               "sage": ("SageAttention INT8 (sageattention_int8)", corpus.sage_calls, {})}
    for key, (title, make, extra) in kernels.items():
        if args.kernel not in (key, "both"):
            continue
        t0 = time.perf_counter()
        calls = make(args.calls, args.seed, max_len=args.max_len, **extra)
        verdicts = corpus.evaluate(calls, corpus.quant_check(**overrides), progress=progress)
        seconds = time.perf_counter() - t0
        n_rad = args.calls if args.radius_calls is None else args.radius_calls
        radius = None
        if n_rad > 0:  # the reference only: its check carries the radius
            ones = make(n_rad, args.seed + 1, max_len=args.max_len, amplitude=1.0, **extra)
            rv = corpus.evaluate(ones, corpus.quant_check(**overrides), honest=[], bugs=[])
            radius = {**corpus.summarize(rv), "calls": n_rad}
        _report(title, verdicts, radius, seconds)


if __name__ == "__main__":
    main()
