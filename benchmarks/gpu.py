"""The GPU path on one GPU, side by side with PyTorch: correctness, determinism, speed, memory.

One prepared run for a lent GPU machine (about four minutes on an H200), needing only what its
image has (Python, numpy, CuPy for CUDA 13, torch with CUDA; no python-flint, no numba):

1. the GPU, the kernels' compile time, and the cuBLAS DGEMM rate measured in this run
   (CUDA events around ``a @ b``, n = 8192);
2. the conformance suite (dot-family cases) through backend ``"cupy"``, trace and streaming,
   against the NumPy reference under the GPU tolerance (forward normwise <= 1e-13 kappa,
   elementwise <= 1e-12 kappa max|ref|; gradients within 1e-12 kappa of their natural
   magnitude); run-to-run bit identity of a causal Philox-dropout call (forward and
   gradients, streaming), and its dropout multipliers bit for bit against the CPU's; at
   every timed shape, the output and gradients of every run bit-identical to the first's;
3. forward+backward of refattn's streaming kernels and of torch's float64
   ``scaled_dot_product_attention``, timed the same way: **device time** by CUDA events
   with the inputs already on the device (refattn: an event pair around each kernel launch,
   summed; torch: one pair around forward+backward, whose kernels are queued back to back)
   and **end to end** (wall clock from host arrays to host results, copies included); peak
   device memory (CuPy pool high-water mark; torch's max_memory_allocated); torch's
   out-of-memory is a result, not a crash. Shapes: (8,16,4096,128), (4,32,8192,64),
   (1,8,32768,128) and (1,8,131072,128), each with as many repetitions as the time left
   allows (a shape predicted not to fit is skipped, saying so).

Useful FLOPs: 12 B H L^2 D (forward 2 products, backward 4: the math path's count; refattn's
recomputation of S is not counted). Prints the table with the GPU, the DGEMM rate and the
ratios; writes ``gpu_bench.json`` into ``--out`` (default ``$OUT``, else the current
directory). ``--dry-run`` runs the same program on the CPU emulator with tiny shapes and
torch on the CPU, to check the script without a GPU.

    python3 benchmarks/gpu.py [--dry-run] [--out DIR] [--budget SECONDS] [--cubin-dir DIR]
                              [--micro-dir DIR] [--no-micro]

``--cubin-dir DIR`` loads the kernels from the cubin built ahead on a machine without a GPU
(``python3 -m gpu_backend.compile_check --arch sm_90 --cubin-dir DIR``: nvcc, about 90 s
saved on the lent machine, no NVRTC needed there) instead of compiling them with NVRTC; the
cubin's record must name these kernel sources (``REFATTN_CUBIN_DIR``,
:mod:`gpu_backend.cupy_backend`).

First of all, before the kernels (issue 43, item 4), a **micro-benchmark pass** (budget 30 s;
a few seconds expected, not yet measured on a GPU) measures the constants the performance
model assumes and prints them beside the model's values (:mod:`benchmarks.gpu_micro.micro`):
DMMA.16x8x4 (sm_90) and DMMA.8x8x4 cycles per issue per SMSP (many independent accumulators)
and latency (a dependent chain), DFMA cycles and whether DFMA beside DMMA adds cycles or hides
(co-issue), the issue cycles of a 16-byte cp.async and its L2 and DRAM -> shared bandwidth.
Its cubins come from ``--micro-dir DIR`` (built ahead: ``python3 benchmarks/gpu_micro/micro.py
--build DIR``), else they are built with nvcc at the start of the run (a few seconds, outside
the pass's 30 s; the lent machine has CUDA 13.0's nvcc); ``--no-micro`` skips the pass. A dry
run records it as skipped.

How to run it on the lent machine: build both sets of cubins here (no GPU needed; ``build/``
is git-ignored, so the ``run`` tool must carry it)::

    python3 -m gpu_backend.compile_check --arch sm_90 --cubin-dir build/cubins
    python3 benchmarks/gpu_micro/micro.py --build build/micro

then one ``run`` call with ``carry=["build"]``::

    python3 benchmarks/gpu.py --cubin-dir build/cubins --micro-dir build/micro --out $OUT

Without ``--micro-dir`` the micro cubins are built with the device's nvcc at the start (a few
seconds, recorded as ``micro.build_s`` and kept out of the pass's 30 s); without
``--cubin-dir`` the kernels are compiled by NVRTC there (about 90 s of device time).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import refattn
from benchmarks.gpu_micro import micro
from gpu_backend import launch
from refattn.bundle.suites import build_suite
from refattn.dropout import Philox
from refattn.masks import causal

SHAPES = [(8, 16, 4096, 128), (4, 32, 8192, 64), (1, 8, 32768, 128), (1, 8, 131072, 128)]
DRY_SHAPES = [(1, 2, 64, 16), (1, 2, 96, 8)]
BUDGET_S = 225.0  # the whole run, start-up and compile included, under four minutes
MICRO_BUDGET_S = 30.0  # the micro-benchmark pass, its cubins' build excluded
MAX_REPEATS = 5
WEIGHT_FLOOR = 2e13  # FLOPs' worth of fixed cost per shape when sharing out the budget
#: useful multiply-adds x 2 per (B, H, L, L, D) element: forward 2 products, backward 4
FLOPS_PER_ELEMENT = 12


# -- timing -------------------------------------------------------------------------------------


class TimedDevice:
    """A :class:`gpu_backend.launch.Device` that brackets every kernel launch with CUDA events.

    ``kernel_seconds()`` synchronises and returns the summed kernel time since ``reset()``:
    host work (validation, numpy) and host-device copies fall outside the brackets. On the
    emulator the brackets are wall clock around each launch.
    """

    def __init__(self, inner: Any, gpu: bool) -> None:
        self.inner, self.gpu = inner, gpu
        self.name, self.xp = inner.name, inner.xp
        self.max_shared_bytes = inner.max_shared_bytes
        self.compile_options = inner.compile_options
        self._pairs: list[Any] = []

    def __getattr__(self, name: str) -> Any:  # anything else the launcher asks of a device
        return getattr(self.inner, name)

    def reset(self) -> None:
        self._pairs = []

    def kernel_seconds(self) -> float:
        if not self.gpu:
            return float(sum(self._pairs))
        import cupy

        total = 0.0
        for start, stop in self._pairs:
            stop.synchronize()
            total += cupy.cuda.get_elapsed_time(start, stop) / 1e3
        return total

    def get_function(self, name: str) -> Any:
        return _TimedKernel(self, self.inner.get_function(name))

    def address(self, array: Any) -> int:
        return self.inner.address(array)

    def to_device(self, array: Any) -> Any:
        return self.inner.to_device(array)

    def to_host(self, array: Any) -> Any:
        return self.inner.to_host(array)

    def free_bytes(self) -> int | None:
        return self.inner.free_bytes()

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()


class _TimedKernel:
    def __init__(self, owner: TimedDevice, fn: Any) -> None:
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_fn", fn)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._fn, name, value)  # e.g. max_dynamic_shared_size_bytes

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._owner.gpu:
            t0 = time.perf_counter()
            out = self._fn(*args, **kwargs)
            self._owner._pairs.append(time.perf_counter() - t0)
            return out
        import cupy

        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        out = self._fn(*args, **kwargs)
        stop.record()
        self._owner._pairs.append((start, stop))
        return out


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _sync(gpu: bool) -> None:
    if gpu:
        import cupy

        cupy.cuda.Device().synchronize()


def dgemm_rate(gpu: bool) -> dict[str, Any]:
    """cuBLAS DGEMM (CuPy's matmul) by CUDA events, n = 8192; numpy's BLAS on a dry run."""
    n = 8192 if gpu else 256
    if gpu:
        import cupy

        a, b = cupy.random.rand(n, n), cupy.random.rand(n, n)
        a @ b
        times = []
        for _ in range(5):
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            a @ b
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
        del a, b
        cupy.get_default_memory_pool().free_all_blocks()
    else:
        rng = np.random.default_rng(0)
        a, b = rng.random((n, n)), rng.random((n, n))
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
    s = _median(times)
    return {"n": n, "seconds": s, "flops": 2.0 * n**3 / s}


def _inputs(shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(1)
    return tuple(rng.standard_normal(shape) for _ in range(4))  # q, k, v, g: (B, H, L, D)


def refattn_timing(shape: tuple[int, ...], device: TimedDevice, gpu: bool,
                   deadline: float) -> dict[str, Any]:
    """Device time (kernels only), end to end (host in, host out) and peak memory."""
    q, k, v, g = _inputs(shape)
    call = refattn.AttentionCall(q, k, v)
    pool = None
    if gpu:
        import cupy

        pool = cupy.get_default_memory_pool()
        pool.free_all_blocks()

    results: list[dict[str, np.ndarray]] = []

    def run() -> tuple[float, float]:
        device.reset()
        _sync(gpu)
        t0 = time.perf_counter()
        trace = launch.forward(device, call, materialize=False)
        grads = launch.backward(device, trace, g)  # numpy results: synchronised by the copies
        wall = time.perf_counter() - t0
        got = {"output": trace.output, **{n: x for n, x in grads.tensors().items()
                                          if n in ("grad_q", "grad_k", "grad_v")}}
        if not results:
            results.append(got)
        elif not all(np.array_equal(got[n], results[0][n], equal_nan=True) for n in got):
            out["bit_identical_across_runs"] = False
        return device.kernel_seconds(), wall

    out: dict[str, Any] = {}
    first_kernels, first_wall = run()  # warm (the first shape also loads the kernels)
    out.update(warm_kernel_s=first_kernels, warm_end_to_end_s=first_wall)
    if pool is not None:
        out["peak_bytes"] = int(pool.total_bytes())
    repeats = _repeats(first_wall, deadline)
    runs = [run() for _ in range(repeats)]
    if repeats:
        out.setdefault("bit_identical_across_runs", True)  # output and gradients, every run
    results.clear()
    if runs:
        out["device_s"] = _median([r[0] for r in runs])
        out["end_to_end_s"] = _median([r[1] for r in runs])
    else:  # no time for a second run: the warm run's figures stand
        out["device_s"], out["end_to_end_s"] = first_kernels, first_wall
    out["repeats"] = max(1, repeats)
    if pool is not None:
        pool.free_all_blocks()
    return out


def _repeats(one_run_s: float, deadline: float) -> int:
    left = deadline - time.perf_counter()
    return max(0, min(MAX_REPEATS, int(left * 0.5 / max(one_run_s, 1e-9))))


def torch_timing(shape: tuple[int, ...], gpu: bool, deadline: float) -> dict[str, Any]:
    """torch's float64 SDPA forward+backward, timed like refattn's; OOM is a result."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return {"error": "torch is not installed"}
    dev = "cuda" if gpu else "cpu"
    host = [torch.from_numpy(x) for x in _inputs(shape)]
    state: dict[str, Any] = {}

    def device_run() -> float:
        q, k, v = (x.requires_grad_(True) for x in state["dev"][:3])
        for x in (q, k, v):
            x.grad = None
        if gpu:
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            start.record()
            F.scaled_dot_product_attention(q, k, v).backward(state["dev"][3])
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop) / 1e3
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(q, k, v).backward(state["dev"][3])
        return time.perf_counter() - t0

    def end_to_end() -> float:
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        q, k, v, g = (x.to(dev) for x in host)
        q, k, v = (x.requires_grad_(True) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)
        out.backward(g)
        _ = [x.cpu() for x in (out.detach(), q.grad, k.grad, v.grad)]
        return time.perf_counter() - t0

    result: dict[str, Any] = {}
    try:
        if gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        state["dev"] = [x.to(dev) for x in host]
        first = device_run()
        repeats = _repeats(first, deadline)
        times = [device_run() for _ in range(repeats)] or [first]
        result["device_s"], result["repeats"] = _median(times), len(times)
        if gpu:
            result["peak_bytes"] = int(torch.cuda.max_memory_allocated())
        state.clear()
        result["end_to_end_s"] = end_to_end() if time.perf_counter() < deadline else None
    except Exception as exc:  # torch.OutOfMemoryError above all: a result
        oom = "out of memory" in str(exc).lower() or type(exc).__name__ == "OutOfMemoryError"
        result.update(oom=oom, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    finally:
        state.clear()
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
    return result


# -- correctness --------------------------------------------------------------------------------


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


# -- the run ------------------------------------------------------------------------------------


def _guarded(what: str, fn: Any, *args: Any) -> dict[str, Any]:
    """``fn(*args)``, or ``{"error": ...}`` when it raises: one failing stage (a CUDA error, a
    launch refused) is a result in the report, and the stages after it still run and the JSON
    is still written (the GPU run happens once)."""
    try:
        return fn(*args)
    except Exception as exc:
        traceback.print_exc()
        first = str(exc).splitlines()[0][:300] if str(exc) else ""
        print(f"gpu.py: {what} failed; recorded in the report", file=sys.stderr)
        return {"error": f"{type(exc).__name__}: {first}"}


def micro_pass(gpu: bool, cubin_dir: Path | None, skip: bool = False) -> dict[str, Any]:
    """The micro-benchmarks (:mod:`benchmarks.gpu_micro.micro`): their cubins built with nvcc
    unless ``cubin_dir`` holds them (``build_s``, outside the pass's budget), run, and set
    beside the model's values (``rows``); ``{"skipped": why}`` on a dry run or with
    ``--no-micro``."""
    if skip:
        return {"skipped": "--no-micro"}
    if not gpu:
        return {"skipped": "dry run: the micro-benchmarks need a GPU (their compile is "
                           "tested without one: tests/gpu/test_benchmark_script.py)"}
    out: dict[str, Any] = {}
    if cubin_dir is None:
        import tempfile

        t0 = time.perf_counter()
        cubin_dir = Path(tempfile.mkdtemp(prefix="refattn-micro-"))
        micro.build(cubin_dir)
        out["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    raw = micro.run(cubin_dir, MICRO_BUDGET_S)
    measured = micro.derive(raw)
    out.update(device=raw.get("name"), arch=raw["arch"], raw=raw, measured=measured,
               rows=micro.table(measured, micro.assumed(raw["arch"])),
               seconds=time.perf_counter() - t0)
    return out


def _device(gpu: bool) -> tuple[Any, float]:
    """The backend's device with its kernels loaded, and the seconds that took."""
    t0 = time.perf_counter()
    if gpu:
        from gpu_backend.cupy_backend import device
    else:
        from gpu_backend.emulator_backend import device
    dev = device()
    q, k, v, g = _inputs((1, 1, 8, 8))  # one tiny call: the first launches load the kernels
    trace = launch.forward(dev, refattn.AttentionCall(q, k, v), materialize=False)
    launch.backward(dev, trace, g)
    return dev, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true",
                   help="the CPU emulator, tiny shapes and torch on the CPU (no GPU needed)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")),
                   help="directory for gpu_bench.json (default: $OUT, else .)")
    p.add_argument("--budget", type=float, default=BUDGET_S,
                   help="seconds for the whole run (default %(default)s)")
    p.add_argument("--cubin-dir", type=Path,
                   help="load the kernels from the cubin built ahead in DIR (compile_check "
                   "--cubin-dir) instead of compiling them with NVRTC")
    p.add_argument("--micro-dir", type=Path,
                   help="the micro-benchmarks' cubins built ahead (benchmarks/gpu_micro/"
                   "micro.py --build DIR); default: built with nvcc at the start")
    p.add_argument("--no-micro", action="store_true", help="skip the micro-benchmark pass")
    args = p.parse_args(argv)
    if not args.out.is_dir():
        print(f"gpu.py: --out {args.out}: not a directory", file=sys.stderr)
        return 2
    if args.cubin_dir is not None:
        if not args.cubin_dir.is_dir():
            print(f"gpu.py: --cubin-dir {args.cubin_dir}: not a directory", file=sys.stderr)
            return 2
        from gpu_backend.cupy_backend import CUBIN_DIR_ENV

        os.environ[CUBIN_DIR_ENV] = str(args.cubin_dir.resolve())
    if args.micro_dir is not None and not args.micro_dir.is_dir():
        print(f"gpu.py: --micro-dir {args.micro_dir}: not a directory", file=sys.stderr)
        return 2
    start = time.perf_counter()
    deadline = start + args.budget
    gpu = not args.dry_run
    backend = "cupy" if gpu else "cuda_emulator"
    # before the kernels: the model's constants, measured (a failure is a result)
    micro_report = _guarded("micro-benchmarks", micro_pass, gpu, args.micro_dir, args.no_micro)
    try:
        inner, compile_s = _device(gpu)
    except refattn.RefAttnError as exc:
        print(f"gpu.py: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # CuPy's own (a compile or driver error): still a result
        traceback.print_exc()
        error = {"error": f"loading the kernels: {type(exc).__name__}: {exc}"[:2000]}
        (args.out / "gpu_bench.json").write_text(json.dumps(error, indent=2) + "\n")
        print(f"gpu.py: loading the kernels failed; written to {args.out / 'gpu_bench.json'}",
              file=sys.stderr)
        return 1
    device = TimedDevice(inner, gpu)
    report: dict[str, Any] = {
        "backend": backend, "device": inner.describe(), "python": platform.python_version(),
        "numpy": np.__version__, "compile_options": list(inner.compile_options),
        "micro": micro_report, "kernel_load_s": compile_s, "budget_s": args.budget,
        "flops_per_element": FLOPS_PER_ELEMENT,
        "method": {"device_s": "CUDA events: refattn an event pair around each kernel launch "
                               "(summed), torch one pair around forward+backward; inputs on "
                               "the device; median of the repeats",
                   "end_to_end_s": "wall clock from host arrays to host results, copies "
                                   "included (refattn: launch.forward/backward; torch: .to, "
                                   "SDPA forward+backward, .cpu)",
                   "peak_bytes": "refattn: CuPy pool high-water mark; torch: "
                                 "max_memory_allocated"}}
    try:
        import torch

        report["torch"] = torch.__version__
    except ImportError:
        report["torch"] = None
    report["dgemm"] = _guarded("DGEMM", dgemm_rate, gpu)
    report["conformance"] = _guarded("conformance", conformance, backend)
    report["determinism"] = _guarded("determinism", determinism, backend)
    rows = []
    shapes = SHAPES if gpu else DRY_SHAPES
    for i, shape in enumerate(shapes):
        B, H, L, D = shape
        flops = float(FLOPS_PER_ELEMENT * B * H * L * L * D)
        row: dict[str, Any] = {"shape": list(shape), "flops": flops}
        if rows and "end_to_end_s" in rows[-1].get("refattn", {}):
            prev = rows[-1]
            predicted = prev["refattn"]["end_to_end_s"] * flops / prev["flops"]
            left = deadline - time.perf_counter()
            if predicted * 1.3 > left:
                row["skipped"] = (f"refattn predicted {predicted:.1f} s from "
                                  f"{tuple(prev['shape'])}; {left:.0f} s left of the budget")
                rows.append(row)
                continue
        # this shape's share of the time left: in proportion to its FLOPs (plus a constant
        # for the fixed costs) among the shapes still to run
        weights = [12.0 * np.prod(s_) + WEIGHT_FLOOR for s_ in shapes[i:]]
        now = time.perf_counter()
        shape_deadline = now + (deadline - now) * weights[0] / sum(weights)
        row["refattn"] = _guarded(f"refattn at {shape}", refattn_timing, shape, device, gpu,
                                  shape_deadline)
        row["torch"] = _guarded(f"torch at {shape}", torch_timing, shape, gpu, shape_deadline)
        r, t = row["refattn"], row["torch"]
        if "error" in r:
            rows.append(row)
            continue
        row["refattn_tflops"] = flops / r["device_s"] / 1e12
        if report["dgemm"].get("flops"):
            row["fraction_of_dgemm"] = flops / r["device_s"] / report["dgemm"]["flops"]
        if t.get("device_s"):
            row["torch_tflops"] = flops / t["device_s"] / 1e12
            row["speedup_vs_torch_device"] = t["device_s"] / r["device_s"]
            if t.get("end_to_end_s"):
                row["speedup_vs_torch_end_to_end"] = t["end_to_end_s"] / r["end_to_end_s"]
        rows.append(row)
    report["timing"] = rows
    report["seconds"] = time.perf_counter() - start
    path = args.out / "gpu_bench.json"
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")  # before any printing
    print_report(report)
    print(f"wrote {path}")
    errors = [k for k in ("dgemm", "conformance", "determinism") if "error" in report[k]]
    ok = (not errors and not report["conformance"]["failures"]
          and all(report["determinism"].values())
          and all("error" not in row["refattn"]
                  and row["refattn"].get("bit_identical_across_runs", True) for row in rows
                  if "refattn" in row))
    return 0 if ok else 1


def _gb(x: Any) -> str:
    return f"{x / 1e9:.2f}" if isinstance(x, (int, float)) else "-"


def _s(x: Any) -> str:
    return f"{x:.3f}" if isinstance(x, float) else "-"


def print_micro(m: dict[str, Any]) -> None:
    """The micro-benchmark pass: the model's constants, measured beside assumed."""
    if "rows" in m:
        build = f", cubins built in {m['build_s']:.1f} s" if "build_s" in m else ""
        print(f"micro-benchmarks on {m.get('device')} ({m['arch']}, {m['seconds']:.1f} s"
              f"{build}):")
        print(micro.format_table(m["rows"]))
    else:
        print(f"micro-benchmarks: {m.get('skipped') or m.get('error')}")


def print_report(r: dict[str, Any]) -> None:
    c = r["conformance"]
    d = r["dgemm"]
    print(f"backend {r['backend']}; device {r['device']}; torch {r['torch']}; kernels loaded "
          f"in {r['kernel_load_s']:.1f} s")
    print_micro(r.get("micro", {}))
    if "error" in d:
        print(f"DGEMM: {d['error']}")
    else:
        print(f"DGEMM (n = {d['n']}, measured in this run): {d['flops'] / 1e12:.2f} TFLOP/s")
    if "error" in c:
        print(f"conformance: {c['error']}")
    else:
        print(f"conformance: {c['cases']} dot cases x (trace, streaming): "
              f"{len(c['failures'])} failure(s) {c['failures'][:5]}")
        worst = sorted(c["worst"].items(), key=lambda x: -x[1])[:6]
        print(f"worst error / bound: { {k: f'{v:.1e}' for k, v in worst} }")
    print(f"determinism: {r['determinism']}")
    print(f"useful FLOPs {r['flops_per_element']} B H L^2 D; device time: "
          f"{r['method']['device_s']}")
    print(f"{'B,H,L,D':<18} {'refattn dev s':>13} {'e2e s':>8} {'TFLOP/s':>8} {'/DGEMM':>7} "
          f"{'peak GB':>8} | {'torch dev s':>11} {'e2e s':>8} {'peak GB':>8} | "
          f"{'x torch dev':>11} {'x e2e':>6}")
    for row in r["timing"]:
        shape = ",".join(map(str, row["shape"]))
        if "refattn" not in row:
            print(f"{shape:<18} skipped: {row['skipped']}")
            continue
        a, t = row["refattn"], row["torch"]
        if "error" in a:
            print(f"{shape:<18} refattn: {a['error']}")
            continue
        torch_dev = _s(t.get("device_s")) if "device_s" in t else (
            "OOM" if t.get("oom") else "error")
        print(f"{shape:<18} {a['device_s']:>13.3f} {a['end_to_end_s']:>8.3f} "
              f"{row['refattn_tflops']:>8.2f} {row.get('fraction_of_dgemm', float('nan')):>7.3f} "
              f"{_gb(a.get('peak_bytes')):>8} | {torch_dev:>11} {_s(t.get('end_to_end_s')):>8} "
              f"{_gb(t.get('peak_bytes')):>8} | "
              f"{row.get('speedup_vs_torch_device', float('nan')):>11.2f} "
              f"{row.get('speedup_vs_torch_end_to_end', float('nan')):>6.2f}")
        if "error" in t:
            print(f"{'':<18} torch: {t['error']}")
        if a.get("bit_identical_across_runs") is False:
            print(f"{'':<18} refattn: output or gradients NOT bit-identical across runs")
    print(f"total {r['seconds']:.0f} s of a {r['budget_s']:.0f} s budget")


if __name__ == "__main__":
    sys.exit(main())
