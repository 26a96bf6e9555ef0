"""MLA at FlashMLA's decode shape: forward and backward of the paged latent call, timed in a
fresh process as a user runs it.

The target (issue: "MLA: forward and backward at (B = 4, s_q = 2, h_q = 128, h_kv = 1,
d = 576, dv = 512, cache 4096, page 64) in < 10 s on 2 cores with numba"): each child process
imports refattn, builds FlashMLA's inputs (shuffled pages of 64, as its
tests/test_flash_mla_dense_decoding.py generate_test_data does), builds the canonical call
(refattn.call.mla.paged_mla_call: the gather of 4 x 4096 latent rows), runs forward and
backward on the numba backend (``fused``: value_and_grad's fused kernel; ``stream``: the
streaming forward then backward) and maps the gradient onto the pages (both paths of the
shared 512 columns summed). The figure printed is the child's wall time from its first line
to the page gradient, with each phase; a second, warm repetition in the same process is
printed beside it. The numba backend's one-time BLAS calibration (cached per user) is paid
once before the timed children, so the figure is what a user sees after the first run.

    python benchmarks/mla.py [--variant fused|stream|adapter|all] [--threads 2] [--repeat 2]

``adapter`` times refattn.adapters.flash_mla.flash_mla_with_kvcache (forward only, FlashMLA's
layouts, its default numba backend) at the same shape. ``all`` (default) runs ``fused`` and
``adapter``; ``stream`` is run only when named: the streaming backward keeps per-query-head
key and value gradient partials, (B, h_q, K, d + dv) doubles, about 18 GB at this 128:1
grouping (measured: killed at 21 GB RSS on a 23 GB machine).

Nothing here is asserted; the CPU model and load are printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.timing import environment  # noqa: E402

SHAPE = {"B": 4, "s_q": 2, "h_q": 128, "h_kv": 1, "d": 576, "dv": 512, "cache": 4096,
         "page": 64}


def child(variant: str) -> dict:
    t0 = time.perf_counter()
    import numpy as np

    import refattn
    from refattn.call.mla import paged_mla_call
    from refattn.engine import value_and_grad

    t_import = time.perf_counter() - t0
    s = SHAPE
    rng = np.random.default_rng(0)
    per = s["cache"] // s["page"]
    table = rng.permutation(s["B"] * per).reshape(s["B"], per).astype(np.int32)
    pages = np.clip(rng.standard_normal((s["B"] * per, s["page"], s["h_kv"], s["d"])) / 10, -1, 1)
    q = np.clip(rng.standard_normal((s["B"], s["h_q"], s["s_q"], s["d"])) / 10, -1, 1)
    lens = np.full(s["B"], s["cache"], np.int32)
    g_o = rng.standard_normal((s["B"], s["h_q"], s["s_q"], s["dv"]))
    runs = []
    if variant == "adapter":  # flash_mla_with_kvcache: FlashMLA's layouts, forward only
        from refattn.adapters.flash_mla import flash_mla_with_kvcache

        q_fm = np.ascontiguousarray(q.transpose(0, 2, 1, 3))
        for _ in range(2):
            t1 = time.perf_counter()
            out, _ = flash_mla_with_kvcache(q_fm, pages, table, lens, s["dv"], None,
                                            causal=True)
            t4 = time.perf_counter()
            runs.append({"build": 0.0, "forward_backward": t4 - t1, "page_gradient": 0.0,
                         "call_total": t4 - t1, "since_start": t4 - t0})
            assert out.shape == (s["B"], s["s_q"], s["h_q"], s["dv"])
        return {"variant": variant, "import": t_import, "first": runs[0], "warm": runs[1]}
    for _ in range(2):
        t1 = time.perf_counter()
        made = paged_mla_call(q, pages, table, lens, s["dv"], causal=True)
        t2 = time.perf_counter()
        if variant == "fused":
            out, grads = value_and_grad(made.call, g_o, backend="numba")
        else:
            trace = refattn.forward(made.call, backend="numba", materialize=False)
            grads = refattn.backward(trace, g_o)
            out = trace.output
        t3 = time.perf_counter()
        g_pages = made.layout.page_gradient(grads)
        t4 = time.perf_counter()
        runs.append({"build": t2 - t1, "forward_backward": t3 - t2, "page_gradient": t4 - t3,
                     "call_total": t4 - t1, "since_start": t4 - t0})
        assert out.shape == (s["B"], s["h_q"], s["s_q"], s["dv"])
        assert g_pages.shape == pages.shape and np.isfinite(g_pages).all()
    return {"variant": variant, "import": t_import, "first": runs[0], "warm": runs[1]}


def run_child(variant: str, threads: int) -> dict:
    env = {**os.environ, "NUMBA_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads),
           "OPENBLAS_NUM_THREADS": str(threads)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", variant]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900,
                          check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"child {variant} failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_wall"] = wall
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=["fused", "stream", "adapter", "all"],
                        default="all")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2, help="fresh processes per variant")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    print(environment())
    print(f"shape: {SHAPE}, causal, numba, {args.threads} threads")
    variants = ["fused", "adapter"] if args.variant == "all" else [args.variant]
    for variant in variants:
        # an untimed first child: numba's on-disk compile cache and, on a machine's very first
        # run, the BLAS calibration (cached per user), are paid there
        run_child(variant, args.threads)
        for _ in range(args.repeat):
            r = run_child(variant, args.threads)
            f, w = r["first"], r["warm"]
            work = "forward" if variant == "adapter" else "forward+backward"
            print(f"{variant:7s} fresh process: {f['since_start']:.2f} s from its first line to "
                  f"the result ({r['process_wall']:.2f} s wall with the interpreter's start and "
                  f"a warm repeat; import {r['import']:.2f}, build {f['build']:.2f}, {work} "
                  f"{f['forward_backward']:.2f}, page gradient {f['page_gradient']:.2f}; "
                  f"first call {f['call_total']:.2f} s) | warm repeat {w['call_total']:.2f} s "
                  f"({work} {w['forward_backward']:.2f})")


if __name__ == "__main__":
    main()
