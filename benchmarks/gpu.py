"""The GPU path on one GPU, side by side with PyTorch: correctness, determinism, speed, memory.

Needs only what the GPU machine's image has (Python 3.12, numpy, CuPy for CUDA 13, torch with
CUDA): no python-flint, no numba. In one run, and in under four minutes on an H200:

1. the conformance suite (dot-family cases) through ``"cupy"``, trace and streaming, against
   the NumPy reference under the GPU tolerance (forward normwise <= 1e-13 kappa, elementwise
   <= 1e-12 kappa max|ref|; gradients within 1e-12 kappa of their natural magnitude);
2. run-to-run bit identity of a causal, Philox-dropout call, and its dropout multipliers bit
   for bit against the CPU's;
3. forward+backward time (CUDA events, median of the timed runs) of refattn's streaming kernels
   and of ``torch.nn.functional.scaled_dot_product_attention`` in float64, with the cuBLAS DGEMM
   rate measured in the same run and peak device memory, at (8,16,4096,128), (4,32,8192,64),
   (1,8,32768,128), and (1,8,131072,128) where the time left allows.

Prints a table and writes JSON (to ``$OUT/gpu_bench.json`` where ``$OUT`` is set).
``--dry-run`` runs the same program on the CPU emulator with tiny shapes (and torch on the
CPU), to check the script without a GPU.

    python3 benchmarks/gpu.py [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import refattn
from refattn.bundle.suites import build_suite
from refattn.dropout import Philox
from refattn.masks import causal

SHAPES = [(8, 16, 4096, 128), (4, 32, 8192, 64), (1, 8, 32768, 128)]
LONG = (1, 8, 131072, 128)
DRY_SHAPES = [(1, 2, 64, 16), (1, 2, 96, 8)]
BUDGET_S = 225.0  # stay under four minutes with the start-up included


class Clock:
    """CUDA events on a GPU; wall time on the emulator."""

    def __init__(self, gpu: bool) -> None:
        self.gpu = gpu
        if gpu:
            import cupy

            self.cupy = cupy

    def time(self, fn: Any, repeats: int) -> list[float]:
        out = []
        for _ in range(repeats):
            if self.gpu:
                start, stop = self.cupy.cuda.Event(), self.cupy.cuda.Event()
                start.record()
                fn()
                stop.record()
                stop.synchronize()
                out.append(self.cupy.cuda.get_elapsed_time(start, stop) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        return out


def kappa(scores: np.ndarray) -> float:
    s = np.abs(scores[np.isfinite(scores)])
    return max(1.0, (s.max() if s.size else 0.0) / 16)


def natural(call: refattn.AttentionCall, ref: Any, grads: Any) -> dict[str, float]:
    """Largest sum of absolute terms behind one element of each gradient (dot family)."""
    a = np.abs
    from refattn.engine.reduce import gather_heads, sum_heads

    k_eff, v_eff = gather_heads(call.k, call.head_map), gather_heads(call.v, call.head_map)
    g_o = np.where(call.query_valid_full(), grads.grad_output, 0.0)
    z = np.broadcast_to(ref.dropout_multiplier, ref.probs.shape)
    g_p = (a(g_o) @ a(v_eff).swapaxes(-1, -2)) * a(z)
    g_s = ref.probs * (g_p + a(grads.row_dot)[..., None])
    out = {"grad_v": (a(ref.consumed).swapaxes(-1, -2) @ a(g_o)).max(),
           "grad_q": call.scale * (g_s @ a(k_eff)).max(),
           "grad_k": call.scale * sum_heads(g_s.swapaxes(-1, -2) @ a(call.q), call.head_map,
                                            call.k.shape[1]).max(),
           "grad_consumed": (a(g_o) @ a(v_eff).swapaxes(-1, -2)).max(), "grad_probs": g_p.max(),
           "grad_scores": g_s.max(), "grad_bias": g_s.max() * np.prod(call.score_shape),
           "row_dot": (ref.probs * g_p).sum(-1).max(),
           "row_dot_output": (a(g_o) * a(ref.output)).sum(-1).max()}
    return {n: max(float(x), 1e-300) for n, x in out.items()}


def _ratio(name: str, got: np.ndarray, want: np.ndarray, nat: dict[str, float],
           k: float) -> float:
    """A tensor's error over its bound (<= 1 passes; 0 or inf for exact comparisons)."""
    if got.dtype.kind != "f" or name == "dropout_multiplier":
        return 0.0 if np.array_equal(got, want) else float("inf")
    fin = np.isfinite(want)
    if not np.array_equal(np.isfinite(got), fin):
        return float("inf")
    d = np.abs(got[fin] - want[fin])
    if name.startswith("grad_") and name in nat:
        return float(d.max(initial=0.0)) / (1e-12 * k * nat[name])
    norm = np.linalg.norm(want[fin]) or 1.0
    scale = np.abs(want[fin]).max(initial=0.0) or 1.0
    return max(np.linalg.norm(d) / (1e-13 * k * norm), d.max(initial=0.0) / (1e-12 * k * scale))


def conformance(backend: str) -> dict[str, Any]:
    worst: dict[str, float] = {}
    failures = []
    cases = [c for c in build_suite("conformance") if c.call.score.name == "dot"]
    for case in cases:
        ref = refattn.forward(case.call)
        rg = refattn.backward(ref, case.grad_output)
        want = {**ref.tensors(), **rg.tensors()}
        nat = natural(case.call, ref, rg)
        k = kappa(ref.scores)
        for materialize in (True, False):
            t = refattn.forward(case.call, backend=backend, materialize=materialize)
            g = refattn.backward(t, case.grad_output)
            for name, got in {**t.tensors(), **g.tensors()}.items():
                ratio = _ratio(name, got, np.broadcast_to(want[name], np.shape(got)), nat, k)
                worst[name] = max(worst.get(name, 0.0), ratio)
                if not ratio <= 1.0:
                    failures.append(f"{case.case_id} {'trace' if materialize else 'stream'} "
                                    f"{name}")
    return {"cases": len(cases), "failures": failures, "worst": worst}


def determinism(backend: str) -> dict[str, bool]:
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((2, 4, 100, 32)) for _ in range(4))
    call = refattn.AttentionCall(q, k, v, visible=causal(100, 100, alignment="upper_left"),
                                 dropout=Philox(0.2, 2**40 + 3, offset=7))
    runs = []
    for _ in range(2):
        t = refattn.forward(call, backend=backend, materialize=False)
        runs.append({**t.tensors(), **refattn.backward(t, g).tensors()})
    same = all(np.array_equal(runs[0][n], runs[1][n], equal_nan=True) for n in runs[0])
    traced = refattn.forward(call, backend=backend, materialize=True)
    z_equal = bool(np.array_equal(traced.dropout_multiplier, call.multiplier_full()))
    return {"run_to_run_bit_identical": bool(same), "dropout_multiplier_bit_equal_cpu": z_equal}


def timing(shape: tuple[int, ...], backend: str, clock: Clock, torch_device: str,
           repeats: int) -> dict[str, Any]:
    B, H, L, D = shape
    rng = np.random.default_rng(1)
    q, k, v, g = (rng.standard_normal((B, H, L, D)) for _ in range(4))
    call = refattn.AttentionCall(q, k, v)
    flops = 12.0 * B * H * L * L * D  # forward 4 B H Q K D, backward 8 B H Q K D
    row: dict[str, Any] = {"shape": list(shape), "flops": flops}

    def ours() -> None:
        t = refattn.forward(call, backend=backend, materialize=False)
        refattn.backward(t, g)

    pool = None
    if clock.gpu:
        pool = clock.cupy.get_default_memory_pool()
        pool.free_all_blocks()
    ours()  # warm-up (and the kernels' compile on the first shape)
    times = clock.time(ours, repeats)
    row["refattn_s"] = float(np.median(times))
    row["refattn_tflops"] = flops / row["refattn_s"] / 1e12
    if pool is not None:
        row["refattn_peak_bytes"] = int(pool.total_bytes())
        pool.free_all_blocks()
    row["torch"] = torch_sdpa(shape, torch_device, repeats)
    if isinstance(row["torch"].get("seconds"), float):
        row["speedup_vs_torch"] = row["torch"]["seconds"] / row["refattn_s"]
    return row


def torch_sdpa(shape: tuple[int, ...], device: str, repeats: int) -> dict[str, Any]:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return {"error": "torch is not installed"}
    B, H, L, D = shape
    try:
        gen = torch.Generator(device=device).manual_seed(1)
        q, k, v = (torch.randn(B, H, L, D, dtype=torch.float64, device=device, generator=gen,
                               requires_grad=True) for _ in range(3))
        g = torch.randn(B, H, L, D, dtype=torch.float64, device=device, generator=gen)

        def run() -> None:
            out = F.scaled_dot_product_attention(q, k, v)
            out.backward(g)

        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        run()
        times = []
        for _ in range(repeats):
            if device == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                stop = torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                stop.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(stop) / 1e3)
            else:
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
        out = {"seconds": float(np.median(times))}
        if device == "cuda":
            out["peak_bytes"] = int(torch.cuda.max_memory_allocated())
        return out
    except Exception as exc:  # out of memory above all
        if device == "cuda":
            torch.cuda.empty_cache()
        return {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}


def dgemm_rate(gpu: bool, clock: Clock) -> float:
    n = 8192 if gpu else 256
    if gpu:
        xp = clock.cupy
        a, b = xp.random.rand(n, n), xp.random.rand(n, n)
    else:
        rng = np.random.default_rng(0)
        a, b = rng.random((n, n)), rng.random((n, n))
    a @ b
    times = clock.time(lambda: a @ b, 5)
    return 2.0 * n**3 / float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true",
                   help="the CPU emulator, tiny shapes and torch on the CPU (no GPU needed)")
    args = p.parse_args(argv)
    start = time.perf_counter()
    gpu = not args.dry_run
    backend = "cupy" if gpu else "cuda_emulator"
    clock = Clock(gpu)
    report: dict[str, Any] = {"backend": backend, "python": platform.python_version(),
                              "numpy": np.__version__}
    if gpu:
        from gpu_backend.cupy_backend import device

        report["device"] = device().describe()
        report["compile_options"] = list(device().compile_options)
    report["conformance"] = conformance(backend)
    report["determinism"] = determinism(backend)
    report["dgemm_flops"] = dgemm_rate(gpu, clock)
    rows = []
    for shape in SHAPES if gpu else DRY_SHAPES:
        rows.append(timing(shape, backend, clock, "cuda" if gpu else "cpu",
                           repeats=3 if gpu else 1))
    if gpu:  # the long call, if the 32768 timing says it fits in the time left
        last = rows[-1]
        predicted = last["refattn_s"] * (LONG[2] / last["shape"][2]) ** 2
        left = BUDGET_S - (time.perf_counter() - start)
        if predicted * 2.2 < left:
            rows.append(timing(LONG, backend, clock, "cuda", repeats=1))
        else:
            rows.append({"shape": list(LONG), "skipped": f"predicted {predicted:.0f} s (x2 with "
                         f"the warm-up) exceeds the {left:.0f} s left"})
    for row in rows:
        if "refattn_s" in row:
            row["fraction_of_dgemm"] = row["refattn_tflops"] * 1e12 / report["dgemm_flops"]
    report["timing"] = rows
    report["seconds"] = time.perf_counter() - start
    print_report(report)
    out = Path(os.environ.get("OUT", "."))
    (out / "gpu_bench.json").write_text(json.dumps(report, indent=2, default=str))
    ok = not report["conformance"]["failures"] and all(report["determinism"].values())
    return 0 if ok else 1


def print_report(r: dict[str, Any]) -> None:
    c = r["conformance"]
    print(f"backend {r['backend']}; device {r.get('device')}")
    print(f"conformance: {c['cases']} dot cases x (trace, streaming): "
          f"{len(c['failures'])} failure(s) {c['failures'][:5]}")
    print(f"worst error / bound: "
          f"{ {k: f'{v:.1e}' for k, v in sorted(c['worst'].items(), key=lambda x: -x[1])[:6]} }")
    print(f"determinism: {r['determinism']}")
    print(f"DGEMM: {r['dgemm_flops'] / 1e12:.2f} TFLOP/s")
    print(f"{'B,H,L,D':<20} {'refattn s':>10} {'TFLOP/s':>8} {'/DGEMM':>7} {'peak GB':>8} "
          f"{'torch s':>9} {'torch GB':>9} {'speed-up':>9}")
    for row in r["timing"]:
        shape = ",".join(map(str, row["shape"]))
        if "refattn_s" not in row:
            print(f"{shape:<20} {row.get('skipped', '')}")
            continue
        t = row["torch"]
        torch_s = f"{t['seconds']:.3f}" if "seconds" in t else "OOM" if "memory" in str(
            t.get("error", "")).lower() else "n/a"
        print(f"{shape:<20} {row['refattn_s']:>10.3f} {row['refattn_tflops']:>8.2f} "
              f"{row['fraction_of_dgemm']:>7.3f} "
              f"{row.get('refattn_peak_bytes', 0) / 1e9:>8.2f} {torch_s:>9} "
              f"{t.get('peak_bytes', 0) / 1e9:>9.2f} {row.get('speedup_vs_torch', 0):>8.2f}x")
    print(f"total {r['seconds']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
