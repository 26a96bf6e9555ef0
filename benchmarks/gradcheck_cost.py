"""Cost of gradcheck's directional mode as a multiple of one forward+backward.

At (B, Hq, Hkv, Q, K, Dk, Dv) = (2, 4, 4, 256, 256, 64, 64) the script times, interleaved in
one run, refattn.forward + refattn.backward and ``gradcheck.check_attention(call,
mode="directional")`` (method auto, i.e. the complex-safety test plus complex step, with the
default 3 and with 2 directions per input; and method central), and prints the ratios with
the number of fn and vjp calls. Issue 5 asks for about 30 or fewer. Both process CPU time
(all threads; robust when other jobs share the machine) and wall time are measured, as ratios
of medians over interleaved runs (three forward+backward runs before every check, so a load
change hits both sides alike). Set OMP_NUM_THREADS=1 to compare without
BLAS threading (the matmul-heavy forward+backward gains more from threads than the complex
elementwise work of complex step does).

Run: ``python3 benchmarks/gradcheck_cost.py [--repeats N]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

import refattn
from gradcheck import check_attention
from refattn import AttentionCall

SHAPE = (2, 4, 4, 256, 256, 64, 64)  # B, Hq, Hkv, Q, K, Dk, Dv


def _timed(f):
    w, c = time.perf_counter(), time.process_time()
    out = f()
    return time.perf_counter() - w, time.process_time() - c, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    B, Hq, Hkv, Q, K, Dk, Dv = SHAPE
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, Hq, Q, Dk))
    k = rng.standard_normal((B, Hkv, K, Dk))
    v = rng.standard_normal((B, Hkv, K, Dv))
    call = AttentionCall(q, k, v)
    g_o = rng.standard_normal((B, Hq, Q, Dv))

    def forward_backward():
        return refattn.backward(refattn.forward(call), g_o)

    forward_backward()  # warm up (imports, allocator)
    fb_wall, fb_cpu = [], []
    variants = {"auto": {"method": "auto"}, "central": {"method": "central"},
                "auto, 2 dirs": {"method": "auto", "directions": 2}}
    runs = {m: ([], []) for m in variants}
    reports = {}
    for _ in range(args.repeats):  # interleaved: load changes hit every measurement alike
        for method, (wall, cpu) in runs.items():
            for _ in range(3):
                w, c, _ = _timed(forward_backward)
                fb_wall.append(w)
                fb_cpu.append(c)
            w, c, reports[method] = _timed(
                lambda method=method: check_attention(call, mode="directional",
                                                      **variants[method]))
            wall.append(w)
            cpu.append(c)
    base_w, base_c = statistics.median(fb_wall), statistics.median(fb_cpu)
    print(f"shape (B, Hq, Hkv, Q, K, Dk, Dv) = {SHAPE}; {args.repeats} interleaved repeats")
    print(f"forward+backward: median CPU {base_c * 1e3:.1f} ms, wall {base_w * 1e3:.1f} ms "
          f"({len(fb_wall)} runs)")
    for method, (wall, cpu) in runs.items():
        r = reports[method]
        methods = sorted({x.method for x in r.inputs.values()})
        print(f"directional check, {method:<12} ({', '.join(methods)}; "
              f"{r.settings['directions']} directions per input, {r.n_fn_calls} fn calls, "
              f"{r.n_vjp_calls} vjp calls, passed={r.passed}): "
              f"{statistics.median(cpu) / base_c:.1f} x forward+backward in CPU time, "
              f"{statistics.median(wall) / base_w:.1f} x in wall time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
