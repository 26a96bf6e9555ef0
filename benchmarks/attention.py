"""Attention forward+backward speed and memory, side by side in one run: refattn's numba paths
against PyTorch's float64 CPU ``scaled_dot_product_attention`` (with autograd).

For every case (the issue's shapes, a causal one and a GQA one) it times, in interleaved
rounds (each round runs every variant once after a short idle pause, so drift of a shared
machine hits them alike), forward+backward of:

- ``fused``: ``refattn.value_and_grad(call, g, backend="numba")`` -- the fused kernel with the
  calibrated BLAS provider, layout and block (``refattn calibrate``);
- ``stream``: ``refattn.forward(call, backend="numba", materialize=False)`` then
  ``refattn.backward`` (tiled online softmax, the trace path);
- ``dense``: the numba dense trace path, where its (B, Hq, Q, K) tensors fit in 2 GB;
- ``torch``: ``F.scaled_dot_product_attention`` and ``torch.autograd.grad`` (``is_causal``,
  ``enable_gqa`` as the case needs).

and prints medians and minima, GFLOP/s (forward+backward counted as ``12 B Hq P D`` for the
``P`` visible score pairs), the fraction of the square DGEMM rate measured at the start of the
same run, the speed-up over torch, and each variant's peak RSS above its process baseline
(measured in a fresh process per variant). Beside each case it prints the fused kernel's own
breakdown (``benchmarks/fused_floor.py``): its six GEMMs alone and each alone at the attention
shape (the attention-shaped GEMM rates), and the row pass against a copy of its bytes. A last
section runs L = 16384 forward+backward in fresh processes (time and peak RSS).

Usage::

    python3 benchmarks/attention.py                 # the issue's table (about 10 minutes)
    python3 benchmarks/attention.py --quick         # small shapes, a smoke run
    python3 benchmarks/attention.py --json out.json

Its torch column is torch inside this process, after refattn has loaded its runtimes (the
load order changes the libraries torch binds to): ``benchmarks/attention_processes.py`` times
each side in a process of its own and is the baseline to quote.

The environment is printed, never changed: CPU model, numba threads, the BLAS libraries and
their kernels (threadpoolctl), the calibrated provider, ``OPENBLAS_*`` variables, torch's
version, threads and SDPA backend.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
for path in (ROOT, HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


from timing import interleaved, timed  # noqa: E402  (benchmarks/ is on the path)


class Case(NamedTuple):
    """One benchmark case: (B, Hq, Hkv, Q, K, D) and whether it is causal."""

    B: int
    Hq: int
    Hkv: int
    Q: int
    K: int
    D: int
    causal: bool = False

    @property
    def name(self) -> str:
        heads = f"{self.Hq}" if self.Hq == self.Hkv else f"{self.Hq}->{self.Hkv}"
        return (f"({self.B},{heads},{self.Q},{self.D})" + (" causal" if self.causal else "")
                + (" GQA" if self.Hq != self.Hkv else ""))

    @property
    def pairs(self) -> int:
        """Visible score pairs of one head (upper-left causal: row i sees i + 1 keys)."""
        if self.causal:
            return sum(min(self.K, i + 1) for i in range(self.Q))
        return self.Q * self.K

    @property
    def flops(self) -> float:
        """Forward+backward: six products of 2 D flops per visible pair and head."""
        return 12.0 * self.B * self.Hq * self.pairs * self.D


CASES = [Case(1, 8, 8, 512, 512, 64), Case(2, 8, 8, 1024, 1024, 64),
         Case(1, 16, 16, 2048, 2048, 128), Case(1, 8, 8, 4096, 4096, 64),
         Case(1, 16, 16, 2048, 2048, 128, causal=True), Case(1, 32, 8, 2048, 2048, 128)]
QUICK_CASES = [Case(1, 2, 2, 128, 128, 32), Case(1, 4, 2, 256, 256, 64, causal=True)]
LONG_CASE = Case(1, 8, 8, 16384, 16384, 64)
VARIANTS = ("fused", "stream", "dense", "torch")
DENSE_LIMIT = 2 << 30  # bytes of one (B, Hq, Q, K) float64 tensor times the trace's six


# -- variants ----------------------------------------------------------------------------------
def _inputs(case: Case, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    B, Hq, Hkv, Q, K, D = case[:6]
    return (rng.standard_normal((B, Hq, Q, D)), rng.standard_normal((B, Hkv, K, D)),
            rng.standard_normal((B, Hkv, K, D)), rng.standard_normal((B, Hq, Q, D)))


def applies(variant: str, case: Case) -> bool:
    """Whether ``variant`` runs on ``case`` (torch installed; dense trace within its limit)."""
    if variant == "torch":
        try:
            import torch  # noqa: F401
        except ImportError:
            return False
    if variant == "dense":
        return 6 * 8 * case.B * case.Hq * case.Q * case.K <= DENSE_LIMIT
    return True


def runner(variant: str, case: Case) -> Callable[[], Any]:
    """A forward+backward closure of ``variant`` over fresh inputs of ``case``."""
    q, k, v, g = _inputs(case)
    if variant == "torch":
        import torch
        import torch.nn.functional as F

        tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
        tg = torch.from_numpy(g)
        opts = {"is_causal": case.causal, "enable_gqa": case.Hq != case.Hkv}

        def torch_fb() -> Any:
            out = F.scaled_dot_product_attention(tq, tk, tv, **opts)
            return out, torch.autograd.grad(out, (tq, tk, tv), tg)

        return torch_fb

    import refattn
    from refattn.masks import causal

    visible = causal(case.Q, case.K, alignment="upper_left") if case.causal else None
    call = refattn.AttentionCall(q, k, v, visible=visible)
    if variant == "fused":
        return lambda: refattn.value_and_grad(call, g, backend="numba")
    opts = {"backend": "numba", "materialize": variant == "dense"}

    def trace_fb() -> Any:
        trace = refattn.forward(call, **opts)
        return trace, refattn.backward(trace, g)

    return trace_fb


# -- measurements -----------------------------------------------------------------------------
def dgemm_rate(n: int = 3072, repeats: int = 5) -> float:
    """GFLOP/s of numpy's float64 matmul (its BLAS, default threads) on n x n operands."""
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    out = np.empty((n, n))
    np.matmul(a, b, out=out)
    best = min(timed(lambda: np.matmul(a, b, out=out)) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(variant: str, case: Case) -> dict[str, Any]:
    """In a fresh process: warm up small, reset the RSS high-water mark, run ``case`` once."""
    runner(variant, Case(1, 1, 1, 64, 64, case.D, case.causal))()
    baseline = _status_kb("VmRSS")
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        reset = True
    except OSError:
        reset = False
    fn = runner(variant, case)  # inputs count above the baseline
    seconds = timed(fn)
    peak = _status_kb("VmHWM")
    return {"variant": variant, "case": list(case), "seconds": seconds,
            "peak_mb": peak / 1024, "above_baseline_mb": (peak - baseline) / 1024,
            "hwm_reset": reset}


def run_child(variant: str, case: Case, timeout: float = 1800.0) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", variant, json.dumps(list(case))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        return {"variant": variant, "case": list(case), "error": proc.stderr.strip()[-500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def environment() -> dict[str, Any]:
    """CPU, threads, BLAS libraries and kernels, the calibrated provider, torch's setup."""
    import numba
    from threadpoolctl import threadpool_info

    from refattn.engine.numba.calibration import current_provider
    from refattn.engine.numba.providers import cpu_model

    provider = current_provider()  # loads scipy's BLAS (and calibrates once if needed)
    env: dict[str, Any] = {
        "cpu": cpu_model(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "numpy": np.__version__, "numba": numba.__version__,
        "numba_threads": numba.get_num_threads(), "provider": provider.record(),
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
        "OPENBLAS_L2_SIZE": os.environ.get("OPENBLAS_L2_SIZE"),
        "blas": [{key: info.get(key) for key in ("internal_api", "version", "architecture",
                                                  "num_threads")}
                 | {"library": Path(info["filepath"]).name}
                 for info in threadpool_info() if info.get("user_api") == "blas"],
        # numpy's matmul (the DGEMM rate) runs on the BLAS in numpy.libs/, not scipy's
        "numpy_blas": next((f"{info.get('version')} {info.get('architecture')}"
                            for info in threadpool_info()
                            if Path(info["filepath"]).parent.name == "numpy.libs"), "unknown"),
    }
    if applies("torch", CASES[0]):
        import torch
        from torch.nn.attention import SDPBackend

        x = torch.zeros((1, 1, 8, 8), dtype=torch.float64, requires_grad=True)
        env["torch"] = torch.__version__
        env["torch_threads"] = torch.get_num_threads()
        env["torch_blas"] = ("mkl" if torch.backends.mkl.is_available() else "other")
        env["torch_sdpa_backend"] = SDPBackend(torch._fused_sdp_choice(x, x, x)).name
    return env


def measure(cases: list[Case], *, gemm: float, rss: bool, budget: float,
            rounds: int) -> list[dict[str, Any]]:
    from fused_floor import breakdown, format_breakdown

    from refattn._progress import progress  # a bar on a terminal only

    results = []
    for case in progress(cases, desc="benchmark", unit="shape"):
        variants = [v for v in VARIANTS if applies(v, case)]
        fns = {v: runner(v, case) for v in variants}
        for fn in fns.values():
            fn()  # first touch, compile of a new specialisation
        timing = interleaved(fns, min_rounds=rounds, budget=budget)
        del fns
        shape = (case.B, case.Hq, case.Hkv, case.Q, case.K, case.D)
        r = {"case": list(case), "name": case.name, "timing": timing,
             "breakdown": breakdown(shape, causal=case.causal, rounds=rounds)}
        if rss:
            r["rss"] = {v: run_child(v, case) for v in variants}
        results.append(r)
        print(_rows(r, gemm), flush=True)
        print("\n".join(format_breakdown(r["breakdown"])), flush=True)
    return results


_HEADER = (f"{'case':>26} {'variant':>7} | {'median s':>9} {'min s':>9} {'GF/s':>6} "
           f"{'/DGEMM':>6} | {'x torch':>7} {'(min)':>6} | {'peak RSS MB':>11}")


def _rows(r: dict[str, Any], gemm: float) -> str:
    case = Case(*r["case"])
    t = r["timing"]
    torch_t = t.get("torch")
    lines = []
    for variant, s in t.items():
        rate = case.flops / s["median"] / 1e9
        speed = (f"{torch_t['median'] / s['median']:7.2f} {torch_t['min'] / s['min']:6.2f}"
                 if torch_t else f"{'-':>7} {'-':>6}")
        mem = (r.get("rss") or {}).get(variant, {})
        mem_s = f"{mem['above_baseline_mb']:11.0f}" if "above_baseline_mb" in mem else \
            f"{'-':>11}"
        lines.append(f"{case.name:>26} {variant:>7} | {s['median']:9.4f} {s['min']:9.4f} "
                     f"{rate:6.1f} {rate / gemm:6.2f} | {speed} | {mem_s}")
    return "\n".join(lines)


def summary(results: list[dict[str, Any]], gemm: float) -> list[str]:
    """The targets, case by case: fused vs torch, fraction of DGEMM."""
    lines = ["", "targets: f+b >= 1.25x torch at L >= 1024 (>= 1.0x at 512); "
             ">= 0.65 of DGEMM at the two largest shapes"]
    for r in results:
        case = Case(*r["case"])
        t = r["timing"]
        if "torch" not in t:
            continue
        speed = t["torch"]["median"] / t["fused"]["median"]
        need = 1.0 if case.Q < 1024 else 1.25
        frac = case.flops / t["fused"]["median"] / 1e9 / gemm
        lines.append(f"  {case.name:>26}: fused {speed:5.2f}x torch (need {need:.2f}: "
                     f"{'met' if speed >= need else 'MISSED'}), {frac:.2f} of DGEMM")
    return lines


def long_runs(case: Case) -> list[dict[str, Any]]:
    """L = 16384 forward+backward of the fused and streaming paths, each in a fresh process."""
    return [run_child(v, case) for v in ("fused", "stream")]


def _long_line(r: dict[str, Any]) -> str:
    case = Case(*r["case"])
    if "error" in r:
        return f"  {case.name} {r['variant']}: FAILED {r['error']}"
    rate = case.flops / r["seconds"] / 1e9
    return (f"  {case.name} {r['variant']:>6}: {r['seconds']:.1f} s ({rate:.1f} GF/s), peak RSS "
            f"{r['peak_mb']:.0f} MB ({r['above_baseline_mb']:.0f} MB above the baseline)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small shapes only (smoke run)")
    p.add_argument("--no-rss", action="store_true", help="skip the fresh-process memory runs")
    p.add_argument("--no-long", action="store_true", help=f"skip {LONG_CASE.name}")
    p.add_argument("--rounds", type=int, default=5, help="minimum interleaved rounds (5)")
    p.add_argument("--budget", type=float, default=3.0,
                   help="seconds per variant beyond the minimum rounds (default 3)")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--child", nargs=2, metavar=("VARIANT", "CASE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], Case(*json.loads(args.child[1])))))
        return 0
    env = environment()
    print(json.dumps(env, indent=1))
    gemm = dgemm_rate()
    print(f"square DGEMM (numpy matmul 3072^2, OpenBLAS {env['numpy_blas']}, "
          f"same run): {gemm:.1f} GFLOP/s")
    print(_HEADER)
    cases = QUICK_CASES if args.quick else CASES
    results = measure(cases, gemm=gemm, rss=not args.no_rss, budget=args.budget,
                      rounds=args.rounds)
    out: dict[str, Any] = {"environment": env, "dgemm_gflops": gemm, "cases": results}
    print("\n".join(summary(results, gemm)))
    if not (args.quick or args.no_long):
        out["long"] = long_runs(LONG_CASE)
        print("long sequence, fresh processes:")
        print("\n".join(_long_line(r) for r in out["long"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
