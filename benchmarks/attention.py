"""Attention speed and memory, side by side in one run: refattn numpy / numba dense / numba
streaming and PyTorch's float64 CPU ``scaled_dot_product_attention`` (with autograd).

For every shape (B, Hq, Q, K, D) it prints the median seconds and GFLOP/s of the forward and of
forward+backward, each variant's fraction of the DGEMM rate measured at the start of the same
run, its speed relative to PyTorch, and its peak resident memory above the process baseline,
measured in a fresh process per variant (baseline = RSS after imports and a warm-up call; the
peak is the kernel's high-water mark, reset after the warm-up). FLOPs: forward
``4 B Hq Q K D``, backward ``8 B Hq Q K D`` (the streaming backward really does 10: it
recomputes ``Q K^T``). The variant ``stream_floor`` (``benchmarks/stream_floor.py``) runs only
the streaming kernels' matrix products, at the same tiles, with no softmax work: its time bounds
any implementation of that algorithm on this BLAS, and each shape's summary line gives PyTorch's
time over it (the largest speed-up those GEMMs allow) beside the real streaming kernels'. A last
line runs the long-sequence streaming case in a fresh process.

Usage::

    python3 benchmarks/attention.py                 # the issue's table (takes minutes)
    python3 benchmarks/attention.py --quick         # small shapes, a smoke run
    python3 benchmarks/attention.py --json out.json

Environment (printed, never changed here): numba's thread count, BLAS library and kernel
(threadpoolctl), ``OPENBLAS_CORETYPE`` / ``OPENBLAS_L2_SIZE``. Times are wall-clock on a
machine that may be shared; compare the ratios measured in one run. The variants of a shape are
timed in interleaved rounds (each round runs every variant once, after a short idle pause so
that no thread pool left spinning by the previous one competes, and one untimed warm call),
and each reports its median.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHAPES = [(1, 8, 512, 512, 64), (2, 8, 1024, 1024, 64), (1, 16, 2048, 2048, 128),
          (1, 4, 4096, 4096, 64)]
QUICK_SHAPES = [(1, 2, 128, 128, 32), (1, 4, 256, 256, 64)]
LONG_SHAPE = (1, 8, 16384, 16384, 64)
VARIANTS = ("numpy", "numba_dense", "numba_stream", "stream_floor", "torch_sdpa")
NO_RSS = ("stream_floor",)  # a timing bound, not an implementation
SETTLE_S = 0.2  # idle time before each timed call (see interleaved_medians)


# -- variants ----------------------------------------------------------------------------------
def _inputs(shape: tuple[int, ...], seed: int = 0) -> tuple[np.ndarray, ...]:
    B, H, Q, K, D = shape
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, H, Q, D)), rng.standard_normal((B, H, K, D)),
            rng.standard_normal((B, H, K, D)), rng.standard_normal((B, H, Q, D)))


def runner(variant: str, shape: tuple[int, ...]) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(forward, forward_backward) closures over fresh inputs of ``shape``."""
    q, k, v, g = _inputs(shape)
    if variant == "stream_floor":
        from stream_floor import floor_runner  # benchmarks/ is this script's directory

        return floor_runner(q, k, v, g)
    if variant == "torch_sdpa":
        import torch
        import torch.nn.functional as F

        tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
        tg = torch.from_numpy(g)

        def fwd() -> Any:
            return F.scaled_dot_product_attention(tq, tk, tv)  # autograd records for backward

        def fwd_bwd() -> Any:
            out = F.scaled_dot_product_attention(tq, tk, tv)
            grads = torch.autograd.grad(out, (tq, tk, tv), tg)
            return out, grads

        return fwd, fwd_bwd

    import refattn

    call = refattn.AttentionCall(q, k, v)
    opts = {"numpy": {"backend": "numpy"}, "numba_dense": {"backend": "numba"},
            "numba_stream": {"backend": "numba", "materialize": False}}[variant]

    def fwd() -> Any:
        return refattn.forward(call, **opts)

    def fwd_bwd() -> Any:
        trace = refattn.forward(call, **opts)
        return trace, refattn.backward(trace, g)

    return fwd, fwd_bwd


def available(variant: str) -> bool:
    if variant != "torch_sdpa":
        return True
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


# -- measurements -----------------------------------------------------------------------------
def median_seconds(fn: Callable[[], Any], *, min_repeats: int, budget: float) -> float:
    """Median wall time of ``fn`` over at least ``min_repeats`` runs (more while in budget)."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_repeats or (time.perf_counter() - start < budget and len(times) < 15):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
        del result
    return statistics.median(times)


def dgemm_rate(n: int = 3072, repeats: int = 3) -> float:
    """GFLOP/s of numpy's float64 matmul (BLAS, default threads) on n x n operands."""
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    out = np.empty((n, n))
    np.matmul(a, b, out=out)
    t = median_seconds(lambda: np.matmul(a, b, out=out), min_repeats=repeats, budget=0.0)
    return 2 * n**3 / t / 1e9


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(variant: str, shape: tuple[int, ...], timed: bool) -> dict[str, Any]:
    """In a fresh process: warm up, reset the RSS high-water mark, run forward+backward once."""
    _, warm = runner(variant, (1, 1, 64, 64, shape[4]))
    warm()
    baseline = _status_kb("VmRSS")
    reset = True
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    except OSError:
        reset = False
    _, fwd_bwd = runner(variant, shape)  # inputs (and their copies) count above baseline
    t0 = time.perf_counter()
    result = fwd_bwd()
    seconds = time.perf_counter() - t0
    peak = _status_kb("VmHWM")
    del result
    return {"variant": variant, "shape": list(shape), "baseline_mb": baseline / 1024,
            "peak_mb": peak / 1024, "above_baseline_mb": (peak - baseline) / 1024,
            "hwm_reset": reset, "seconds": seconds if timed else None}


def run_child(variant: str, shape: tuple[int, ...], *, timed: bool = False,
              timeout: float = 1800.0) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", variant, *map(str, shape)]
    if timed:
        cmd.append("--timed")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        return {"variant": variant, "shape": list(shape), "error": proc.stderr.strip()[-500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def environment() -> dict[str, Any]:
    import numba
    import scipy.linalg.cython_blas  # noqa: F401  (load the BLAS numba's kernels call)
    from threadpoolctl import threadpool_info

    env: dict[str, Any] = {
        "python": platform.python_version(), "numpy": np.__version__,
        "numba": numba.__version__, "numba_threads": numba.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
        "OPENBLAS_L2_SIZE": os.environ.get("OPENBLAS_L2_SIZE"),
        "blas": [{key: info.get(key) for key in ("internal_api", "version", "architecture",
                                                  "num_threads", "threading_layer")}
                 | {"library": Path(info["filepath"]).name}
                 for info in threadpool_info() if info.get("user_api") == "blas"],
    }
    if available("torch_sdpa"):
        import torch
        from torch.nn.attention import SDPBackend

        x = torch.zeros((1, 1, 8, 8), dtype=torch.float64, requires_grad=True)
        env["torch"] = torch.__version__
        env["torch_threads"] = torch.get_num_threads()
        env["torch_sdpa_backend"] = SDPBackend(torch._fused_sdp_choice(x, x, x)).name
    return env


# -- report ------------------------------------------------------------------------------------
def _flops(shape: tuple[int, ...]) -> float:
    B, H, Q, K, D = shape
    return 4.0 * B * H * Q * K * D


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t0
    del result
    return seconds


def interleaved_medians(fns: dict[str, Callable[[], Any]], *, min_rounds: int, budget: float,
                        settle: float = SETTLE_S, per_round: int = 2) -> dict[str, float]:
    """Median seconds of each callable, timed in rounds that visit every callable in turn.

    Round-robin timing spreads the drift of a shared machine over all variants alike. In each
    round every callable gets a pause of ``settle`` seconds (so that thread pools left spinning
    by the previous variant, such as OpenBLAS and OpenMP workers that busy-wait after a parallel
    call, have gone idle), one untimed warm call, then ``per_round`` timed calls back to back.
    Rounds continue past ``min_rounds`` while the time spent is under ``budget`` seconds per
    callable, up to 15.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    start = time.perf_counter()
    rounds = 0
    while rounds < min_rounds or (time.perf_counter() - start < budget * len(fns) and rounds < 15):
        for name, fn in fns.items():
            time.sleep(settle)
            _timed(fn)
            times[name] += [_timed(fn) for _ in range(per_round)]
        rounds += 1
    return {name: statistics.median(ts) for name, ts in times.items()}


def measure(shapes: list[tuple[int, ...]], *, rss: bool, budget: float) -> dict[str, Any]:
    import numba

    for variant in ("numba_dense", "numba_stream"):  # compile/load the kernels up front
        runner(variant, (1, 1, 64, 64, 32))[1]()
    gemm = dgemm_rate()
    rows = []
    for shape in shapes:
        variants = [v for v in VARIANTS if available(v)]
        fns: dict[str, Callable[[], Any]] = {}
        for variant in variants:
            fwd, fwd_bwd = runner(variant, shape)
            fwd_bwd()  # warm-up (first touch, compile of a new specialisation)
            fns[f"{variant} fwd"], fns[f"{variant} fwd_bwd"] = fwd, fwd_bwd
        med = interleaved_medians(fns, min_rounds=3, budget=budget)
        del fns
        for variant in variants:
            t_f, t_fb = med[f"{variant} fwd"], med[f"{variant} fwd_bwd"]
            row = {"shape": list(shape), "variant": variant, "fwd_s": t_f, "fwd_bwd_s": t_fb,
                   "fwd_gflops": _flops(shape) / t_f / 1e9,
                   "fwd_bwd_gflops": 3 * _flops(shape) / t_fb / 1e9}
            row["fwd_frac"] = row["fwd_gflops"] / gemm
            row["fwd_bwd_frac"] = row["fwd_bwd_gflops"] / gemm
            if rss and variant not in NO_RSS:
                row["rss"] = run_child(variant, shape)
            rows.append(row)
            print(_line(row), flush=True)
    return {"dgemm_gflops": gemm, "numba_threads": numba.get_num_threads(),
            "numba_threading_layer": numba.threading_layer(), "rows": rows}


_HEADER = (f"{'B,Hq,Q,K,D':>22} {'variant':>13} | {'fwd s':>8} {'GF/s':>6} {'/gemm':>5} | "
           f"{'f+b s':>8} {'GF/s':>6} {'/gemm':>5} | {'x torch':>7} | {'peak RSS MB':>11}")


def _line(row: dict[str, Any], torch_fb: float | None = None) -> str:
    shape = ",".join(map(str, row["shape"]))
    rss = row.get("rss") or {}
    mem = f"{rss['above_baseline_mb']:11.0f}" if "above_baseline_mb" in rss else f"{'-':>11}"
    speed = f"{torch_fb / row['fwd_bwd_s']:7.2f}" if torch_fb else f"{'-':>7}"
    return (f"{shape:>22} {row['variant']:>13} | {row['fwd_s']:8.4f} {row['fwd_gflops']:6.1f} "
            f"{row['fwd_frac']:5.2f} | {row['fwd_bwd_s']:8.4f} {row['fwd_bwd_gflops']:6.1f} "
            f"{row['fwd_bwd_frac']:5.2f} | {speed} | {mem}")


def _floor_summary(rows: list[dict[str, Any]], shape: tuple[int, ...]) -> str:
    """One line: streaming f+b over its GEMM floor, and PyTorch's f+b over both."""
    fb = {r["variant"]: r["fwd_bwd_s"] for r in rows if tuple(r["shape"]) == shape}
    if "stream_floor" not in fb or "numba_stream" not in fb:
        return ""
    floor, stream, torch_s = fb["stream_floor"], fb["numba_stream"], fb["torch_sdpa"]
    return (f"{'':>22} streaming f+b = {stream / floor:.2f} x its GEMM floor; torch / streaming "
            f"{torch_s / stream:.2f}x, torch / floor {torch_s / floor:.2f}x (the most these GEMMs "
            "allow)")


def table(result: dict[str, Any]) -> str:
    lines = [f"DGEMM (numpy matmul 3072^2, same run): {result['dgemm_gflops']:.1f} GFLOP/s; "
             f"numba threads {result['numba_threads']}", _HEADER, "-" * len(_HEADER)]
    torch_fb = {tuple(r["shape"]): r["fwd_bwd_s"] for r in result["rows"]
                if r["variant"] == "torch_sdpa"}
    for row in result["rows"]:
        lines.append(_line(row, torch_fb.get(tuple(row["shape"]))))
        if row["variant"] == "torch_sdpa":
            lines.append(_floor_summary(result["rows"], tuple(row["shape"])))
    long = result.get("long")
    if long:
        if "error" in long:
            lines.append(f"long {long['shape']} numba_stream: FAILED {long['error']}")
        else:
            rate = 3 * _flops(tuple(long["shape"])) / long["seconds"] / 1e9
            lines.append(
                f"long {tuple(long['shape'])} numba_stream forward+backward in a fresh process: "
                f"{long['seconds']:.1f} s ({rate:.1f} GFLOP/s), peak RSS {long['peak_mb']:.0f} MB "
                f"({long['above_baseline_mb']:.0f} MB above baseline)"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes only (smoke run)")
    p.add_argument("--no-rss", action="store_true", help="skip the fresh-process memory runs")
    p.add_argument("--no-long", action="store_true", help=f"skip the {LONG_SHAPE} case")
    p.add_argument("--budget", type=float, default=4.0,
                   help="seconds per timed callable beyond the 3 minimum rounds (default 4)")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--child", nargs=6, metavar=("VARIANT", "B", "HQ", "Q", "K", "D"),
                   help=argparse.SUPPRESS)
    p.add_argument("--timed", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        variant, *dims = args.child
        print(json.dumps(child(variant, tuple(int(x) for x in dims), args.timed)))
        return 0
    env = environment()
    print(json.dumps(env, indent=1))
    shapes = QUICK_SHAPES if args.quick else SHAPES
    print(_HEADER)
    result = measure(shapes, rss=not args.no_rss, budget=args.budget)
    result["environment"] = env
    if not (args.quick or args.no_long):
        result["long"] = run_child("numba_stream", LONG_SHAPE, timed=True)
    print()
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
