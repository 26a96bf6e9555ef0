"""Attention forward+backward, each side timed in a fresh process of its own: torch as users run
it against refattn's fused numba ``value_and_grad``.

Why processes. ``benchmarks/attention.py`` times every variant inside one process. There torch
ran up to 2x slower than in a process of its own (issue 27), so its ratios flattered refattn.
Here every variant runs in a fresh Python process (interleaved: A B A B ..., ``--rounds``
processes per variant), loads the same inputs from ``.npy`` files written once, sets the same
thread count (``torch.set_num_threads(T)``, ``NUMBA_NUM_THREADS=T``, the BLAS libraries limited
to T threads with threadpoolctl), makes one warm call (compile, first-touch page faults) and
then ``--calls`` timed calls; a variant's figure is the median over its processes of each
process's median. A last process per case times the variants in one process (round robin, no
pauses, as a user's script would call them) only as a cross-check.

Variants: ``torch`` (``F.scaled_dot_product_attention`` + ``torch.autograd.grad``, float64,
``is_causal`` / ``enable_gqa`` as the case needs), ``refattn`` (``refattn.value_and_grad(call,
g, backend="numba")`` with the calibrated provider) and, where the ``mkl`` wheel is importable
(``pip install "refattn[fast]"``), ``refattn-mkl`` (the same with
``REFATTN_BLAS_PROVIDER=mkl/heads/8``).

What changes torch inside one process (``--probe`` times each hypothesis in fresh processes;
the figures are in ``docs/performance.md``):

- Load order decides which libraries torch's own symbols bind to. ``import torch`` loads its
  ``libgomp.so.1`` and exports ``dgemm_`` from ``libtorch_cpu.so``; whatever was loaded into
  the global scope before wins (``LD_DEBUG=bindings``). A refattn call made before torch is
  imported has loaded numba's OpenMP layer, whose system ``libgomp.so.1`` has the same soname,
  so torch then runs its parallel regions on the system's libgomp. With the ``mkl`` wheel
  (``refattn[fast]``) it was worse: refattn loaded ``mkl_rt`` whenever it listed the providers,
  and ``mkl_rt`` opens ``libmkl_intel_lp64`` and ``libiomp5`` into the global scope, so torch
  imported afterwards ran its float64 GEMMs on the mkl wheel's ``dgemm_`` and its OpenMP on
  Intel's runtime (``GOMP_parallel`` bound to ``libiomp5``, whose workers spin 200 ms after
  each region): torch measured in that process is not torch as users run it.
  ``benchmarks/attention.py`` lists the providers (``environment()``) before importing torch.
  refattn now loads MKL only where an MKL provider runs (calibration, or the calibrated
  choice).
- Worker threads left spinning after a call (OpenBLAS's about 0.1 s; libgomp's spin count;
  libiomp5's ``KMP_BLOCKTIME``) compete with the next call on 2 cores: the probe times torch
  right after a refattn call and 0.5 s after one, alternately in one process.

Usage::

    python3 benchmarks/attention_processes.py                # the issue's shapes
    python3 benchmarks/attention_processes.py --quick        # two small shapes
    python3 benchmarks/attention_processes.py --dry-run      # a tiny shape, one call: format only
    python3 benchmarks/attention_processes.py --probe        # the slowdown hypotheses
    python3 benchmarks/attention_processes.py --json out.json

The environment is printed: CPU model, load average, thread count, the BLAS libraries and
kernels (threadpoolctl), the install kind (``default``: scipy's OpenBLAS only; ``fast``: the
``mkl`` wheel importable) and the calibrated provider, ``OPENBLAS_*`` variables (left as they
are unless ``--unset-openblas-env``, which removes them from the children's environment and
says so).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
for path in (ROOT, HERE):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

# the shapes and their flop count are attention.py's (it imports numpy, never refattn, at the
# top: loading it here changes no library that torch binds to)
from attention import CASES, Case  # noqa: E402

QUICK_CASES = [Case(1, 8, 8, 512, 512, 64), Case(2, 8, 8, 1024, 1024, 64)]
DRY_CASES = [Case(1, 2, 1, 32, 32, 16, causal=True)]
MKL_PROVIDER = "mkl/heads/8"


# -- the children -------------------------------------------------------------------------------
def _load(case: Case, data: Path) -> tuple[Any, ...]:
    import numpy as np

    return tuple(np.load(data / f"{name}.npy") for name in ("q", "k", "v", "g"))


def make_runner(variant: str, case: Case, data: Path) -> Any:
    """A forward+backward closure of ``variant`` on the inputs saved in ``data``."""
    q, k, v, g = _load(case, data)
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
    return lambda: refattn.value_and_grad(call, g, backend="numba")


def _set_threads(threads: int) -> None:
    """torch and the BLAS libraries on ``threads`` (numba reads NUMBA_NUM_THREADS itself)."""
    from threadpoolctl import threadpool_limits

    try:
        import torch

        torch.set_num_threads(threads)
    except ImportError:
        pass
    threadpool_limits(limits=threads, user_api="blas")


def _times(fn: Any, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        result = fn()
        out.append(time.perf_counter() - t0)
        del result
    return out


def child_one(variant: str, case: Case, data: Path, threads: int, calls: int) -> dict[str, Any]:
    """In a fresh process: one warm call, then ``calls`` timed calls of one variant."""
    _set_threads(threads)
    if variant != "torch":
        from refattn.engine.numba.calibration import current_provider

        current_provider()  # read the cached choice (the parent calibrated beforehand)
    fn = make_runner(variant, case, data)
    fn()
    ts = _times(fn, calls)
    return {"variant": variant, "times": ts, "median": statistics.median(ts), "min": min(ts)}


def child_inprocess(variants: list[str], case: Case, data: Path, threads: int,
                    calls: int) -> dict[str, Any]:
    """All variants in one process, round robin without pauses (the cross-check)."""
    _set_threads(threads)
    fns = {v: make_runner(v.split(":")[0], case, data) for v in variants}
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {v: [] for v in fns}
    for _ in range(calls):
        for v, fn in fns.items():
            times[v] += _times(fn, 1)
    return {v: {"times": ts, "median": statistics.median(ts), "min": min(ts)}
            for v, ts in times.items()}


def child_env(threads: int) -> dict[str, Any]:
    """The environment as a refattn child sees it (calibrating here, once, if needed)."""
    import numba
    from threadpoolctl import threadpool_info

    from refattn.engine.numba import providers
    from refattn.engine.numba.calibration import calibration_path, current_provider

    _set_threads(threads)
    t0 = time.perf_counter()
    provider = current_provider()
    chosen_s = time.perf_counter() - t0
    names = [p.name for p in providers.available_providers()]
    env: dict[str, Any] = {
        "cpu": providers.cpu_model(), "caches": providers.cpu_caches(),
        "cpu_count": os.cpu_count(),
        "numba_threads": numba.get_num_threads(),
        "numba_threading_layer": _threading_layer(),
        "provider": provider.key, "provider_version": provider.version,
        "provider_source": ("REFATTN_BLAS_PROVIDER" if os.environ.get("REFATTN_BLAS_PROVIDER")
                            else "calibration"),
        "provider_seconds": round(chosen_s, 2), "calibration": str(calibration_path()),
        "install": "fast (mkl wheel importable)" if "mkl" in names else
                   "default (no mkl wheel: scipy's OpenBLAS)",
        "providers": names,
        "blas": [f"{Path(i['filepath']).parent.name}/{Path(i['filepath']).name} "
                 f"{i.get('internal_api')} {i.get('version')} {i.get('architecture')} "
                 f"threads={i.get('num_threads')}"
                 for i in threadpool_info() if i.get("user_api") == "blas"],
        "openblas_env": {k: v for k, v in os.environ.items() if k.startswith("OPENBLAS_")},
    }
    try:
        import torch
        from torch.nn.attention import SDPBackend

        x = torch.zeros((1, 1, 8, 8), dtype=torch.float64, requires_grad=True)
        env["torch"] = (f"{torch.__version__}, threads {torch.get_num_threads()}, "
                        f"{'MKL' if torch.backends.mkl.is_available() else 'no MKL'}, SDPA "
                        f"{SDPBackend(torch._fused_sdp_choice(x, x, x)).name}")
    except ImportError:
        env["torch"] = None
    return env


def _threading_layer() -> str:
    import numba
    import numpy as np

    @numba.njit(parallel=True)
    def touch(x):  # pragma: no cover - compiled
        for i in numba.prange(x.shape[0]):
            x[i] += 1.0

    touch(np.zeros(4))
    return str(numba.threading_layer())


def child_dgemm(threads: int, n: int) -> dict[str, Any]:
    """Square DGEMM GFLOP/s of numpy's matmul on ``threads`` threads (best of five)."""
    import numpy as np

    _set_threads(threads)
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((n, n)), rng.standard_normal((n, n))
    out = np.empty((n, n))
    np.matmul(a, b, out=out)
    best = min(_times(lambda: np.matmul(a, b, out=out), 5))
    return {"n": n, "gflops": 2 * n**3 / best / 1e9}


# -- the parent ---------------------------------------------------------------------------------
def _spawn(args: list[str], env: dict[str, str], timeout: float = 3600.0) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                          check=False, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"child {args[0]} failed:\n{proc.stderr.strip()[-2000:]}")
    if proc.stderr.strip():
        sys.stderr.write(proc.stderr)  # a compile or calibration notice, once
    return json.loads(proc.stdout.strip().splitlines()[-1])


def child_environ(threads: int, unset_openblas: bool, variant: str = "") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not (unset_openblas and k.startswith("OPENBLAS_"))}
    env["NUMBA_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if variant == "refattn-mkl":
        env["REFATTN_BLAS_PROVIDER"] = MKL_PROVIDER
    return env


def write_inputs(case: Case, folder: Path) -> Path:
    """``q``, ``k``, ``v``, ``g`` of ``case`` as ``.npy`` files (seed 0), written once."""
    import numpy as np

    rng = np.random.default_rng(0)
    B, Hq, Hkv, Q, K, D = case[:6]
    data = folder / "_".join(map(str, case))
    data.mkdir(parents=True, exist_ok=True)
    for name, shape in (("q", (B, Hq, Q, D)), ("k", (B, Hkv, K, D)), ("v", (B, Hkv, K, D)),
                        ("g", (B, Hq, Q, D))):
        np.save(data / f"{name}.npy", rng.standard_normal(shape))
    return data


def measure(case: Case, variants: list[str], data: Path, *, threads: int, calls: int,
            rounds: int, unset_openblas: bool, dgemm_n: int = 3072) -> dict[str, Any]:
    """Per variant: ``rounds`` fresh processes, interleaved; then one in-process cross-check.

    Each round also times square DGEMM in a process of its own, between the variants' processes,
    so that the case's fraction of DGEMM divides by a rate measured in the same minutes (on a
    shared machine the rate at the start of a run can be far from the rate an hour later)."""
    per: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    dgemm: list[float] = []
    for _ in range(rounds):
        dgemm.append(_spawn(["dgemm", threads, dgemm_n],
                            child_environ(threads, unset_openblas))["gflops"])
        for v in variants:
            env = child_environ(threads, unset_openblas, v)
            per[v].append(_spawn(["one", v.replace("-mkl", ""), list(case), str(data),
                                  threads, calls], env))
    one = [v for v in variants if v != "refattn-mkl"]
    together = _spawn(["inprocess", one, list(case), str(data), threads, calls],
                      child_environ(threads, unset_openblas))
    result: dict[str, Any] = {"case": list(case), "name": case.name, "variants": {},
                              "dgemm_gflops": statistics.median(dgemm), "dgemm_rounds": dgemm}
    for v, runs in per.items():
        result["variants"][v] = {
            "median": statistics.median(r["median"] for r in runs),
            "min": min(r["min"] for r in runs),
            "process_medians": [r["median"] for r in runs],
            "inprocess_median": together.get(v, {}).get("median")}
    return result


HEADER = ("| case | variant | median s (processes) | min s | GF/s | / DGEMM | x torch (processes) "
          "| median s (one process) | x torch (one process) | DGEMM GF/s (this case) |")


def rows(r: dict[str, Any], dgemm: float) -> list[str]:
    """The markdown rows of one case (``/ DGEMM`` over the case's own DGEMM where measured)."""
    case = Case(*r["case"])
    dgemm = r.get("dgemm_gflops", dgemm)
    vs = r["variants"]
    torch_s = vs.get("torch", {}).get("median")
    torch_in = vs.get("torch", {}).get("inprocess_median")
    out = []
    for v, s in vs.items():
        rate = case.flops / s["median"] / 1e9
        ratio = f"{torch_s / s['median']:.2f}x" if torch_s else "-"
        ins = s["inprocess_median"]
        ratio_in = f"{torch_in / ins:.2f}x" if (torch_in and ins) else "-"
        out.append(f"| {case.name} | {v} | {s['median']:.4f} | {s['min']:.4f} | {rate:.1f} | "
                   f"{rate / dgemm:.2f} | {ratio} | "
                   f"{'-' if ins is None else f'{ins:.4f}'} | {ratio_in} | {dgemm:.1f} |")
    return out


def summary(results: list[dict[str, Any]], dgemm: float, install: str, cpu: str) -> list[str]:
    """The issue's targets, case by case (processes only): Intel default install >= 1.25x torch
    at L >= 1024 and >= 1.0x at L = 512; Intel with the ``fast`` extra, and AMD, >= 1.5x at
    L >= 1024 and >= 0.7 of the square DGEMM rate at the two largest shapes."""
    amd = "AMD" in cpu
    largest = sorted(results, key=lambda r: Case(*r["case"]).flops)[-2:]
    lines = ["", f"targets ({'AMD' if amd else 'not AMD'}, {install.split(' ')[0]} install; "
             "each side in its own process):"]
    for r in results:
        case = Case(*r["case"])
        vs = r["variants"]
        if "torch" not in vs:
            continue
        for v in (x for x in vs if x != "torch"):
            strict = amd or not install.startswith("default") or v.endswith("mkl")
            speed = vs["torch"]["median"] / vs[v]["median"]
            frac = case.flops / vs[v]["median"] / 1e9 / r.get("dgemm_gflops", dgemm)
            need = (1.5 if case.Q >= 1024 else None) if strict else \
                (1.25 if case.Q >= 1024 else 1.0)
            verdict = ("no target" if need is None else
                       f"need {need:.2f}: {'met' if speed >= need else 'MISSED'}")
            frac_s = f"{frac:.2f} of DGEMM"
            if strict and r in largest:
                frac_s += f" (need 0.70: {'met' if frac >= 0.7 else 'MISSED'})"
            lines.append(f"  {case.name:>24} {v:>11}: {speed:5.2f}x torch ({verdict}), {frac_s}")
    return lines


PROBES = [  # (label, process kind, extra environment of that child)
    ("torch only (refattn never imported)", "torch_only", {}),
    ("torch imported first, then refattn", "torch_first", {}),
    ("a refattn call before torch is imported", "refattn_first", {}),
    ("refattn first, OMP_WAIT_POLICY=passive", "refattn_first", {"OMP_WAIT_POLICY": "passive"}),
    ("refattn first, numba workqueue layer", "refattn_first",
     {"NUMBA_THREADING_LAYER": "workqueue"}),
]
PROBE_SLOTS = ("alone", "right after refattn", "after refattn + 0.5 s")


def probe(case: Case, data: Path, *, threads: int, calls: int, rounds: int,
          unset_openblas: bool = False) -> dict[str, Any]:
    """Torch's time in one process under each hypothesis (:data:`PROBES`), in fresh processes
    interleaved over ``rounds``. Within a process torch is timed alone (0.5 s after anything
    else), right after a refattn call, and 0.5 s after one, alternately, so that drift of a
    shared machine hits the three alike. Changes only the children's environment."""
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in PROBES}
    for _ in range(rounds):
        for label, kind, extra in PROBES:
            env = {**child_environ(threads, unset_openblas), **extra}
            runs[label].append(_spawn(["probe", kind, list(case), str(data), threads, calls],
                                      env))
    out: dict[str, Any] = {}
    for label, rs in runs.items():
        out[label] = {slot: statistics.median(t for r in rs for t in r[slot])
                      for slot in rs[0] if slot in PROBE_SLOTS}
        out[label]["bindings"] = rs[0]["bindings"]
    return out


def _torch_bindings() -> str:
    """Which library torch's ``GOMP_parallel`` and ``dgemm_`` resolve to in this process."""
    import ctypes
    import glob

    import torch

    lib = Path(torch.__file__).parent / "lib"
    own = {"GOMP_parallel": glob.glob(str(lib / "libgomp*")),
           "dgemm_": [str(lib / "libtorch_cpu.so")]}
    found = []
    for symbol, owners in own.items():
        try:  # the process-wide first definition: what torch's undefined symbol binds to
            addr = ctypes.cast(getattr(ctypes.CDLL(None), symbol), ctypes.c_void_p).value
        except AttributeError:
            found.append(f"{symbol}: torch's")  # not in the global scope: torch's own
            continue
        info = Path(_owner(addr))
        found.append(f"{symbol}: {'torch' if str(info) in owners else info.name}")
    return ", ".join(found)


def _owner(addr: int) -> str:
    import ctypes

    class DlInfo(ctypes.Structure):
        _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                    ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]

    info = DlInfo()
    ctypes.CDLL(None).dladdr(ctypes.c_void_p(addr), ctypes.byref(info))
    return (info.fname or b"?").decode()


def child_probe(kind: str, case: Case, data: Path, threads: int, calls: int) -> dict[str, Any]:
    """One probe process: torch's call times in each slot of :data:`PROBE_SLOTS`."""
    ref_fn = None
    if kind == "refattn_first":  # refattn's kernels (numba threads, BLAS) run before torch loads
        ref_fn = make_runner("refattn", case, data)
        ref_fn()
    _set_threads(threads)
    torch_fn = make_runner("torch", case, data)
    if kind == "torch_first":
        ref_fn = make_runner("refattn", case, data)
        ref_fn()
    torch_fn()
    slots: dict[str, list[float]] = {"alone": []}
    if ref_fn is not None:
        slots.update({"right after refattn": [], "after refattn + 0.5 s": []})
    for _ in range(calls):
        time.sleep(0.5)
        slots["alone"] += _times(torch_fn, 1)
        if ref_fn is not None:
            ref_fn()
            slots["right after refattn"] += _times(torch_fn, 1)
            ref_fn()
            time.sleep(0.5)
            slots["after refattn + 0.5 s"] += _times(torch_fn, 1)
    return {**slots, "bindings": _torch_bindings()}


def child_main(spec: list[Any]) -> dict[str, Any]:
    kind = spec[0]
    if kind == "env":
        return child_env(int(spec[1]))
    if kind == "dgemm":
        return child_dgemm(int(spec[1]), int(spec[2]))
    if kind == "one":
        return child_one(spec[1], Case(*spec[2]), Path(spec[3]), int(spec[4]), int(spec[5]))
    if kind == "inprocess":
        return child_inprocess(spec[1], Case(*spec[2]), Path(spec[3]), int(spec[4]),
                               int(spec[5]))
    if kind == "probe":
        return child_probe(spec[1], Case(*spec[2]), Path(spec[3]), int(spec[4]), int(spec[5]))
    raise SystemExit(f"unknown child {kind!r}")


def header_lines(env: dict[str, Any], threads: int, unset: bool, dgemm: dict[str, Any]
                 ) -> list[str]:
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return [
        f"cpu: {env['cpu']} ({env['cpu_count']} cpus; {env.get('caches') or 'caches unknown'}); "
        f"load average {load}",
        f"threads: {threads} (torch.set_num_threads, NUMBA_NUM_THREADS, BLAS limit); numba "
        f"threading layer {env['numba_threading_layer']}",
        f"install: {env['install']}; refattn provider {env['provider']} "
        f"({env['provider_version']}, from {env['provider_source']}: {env['calibration']})",
        "blas: " + "; ".join(env["blas"]),
        f"torch: {env['torch']}",
        "OPENBLAS_* " + ("removed from the children's environment by --unset-openblas-env "
                         f"(was {_openblas_env() or 'none'})" if unset else
                         f"as set: {env['openblas_env'] or 'none'}"),
        f"square DGEMM (numpy matmul {dgemm['n']}^2, {threads} threads, own process): "
        f"{dgemm['gflops']:.1f} GFLOP/s",
    ]


def _openblas_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith("OPENBLAS_")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="two small shapes")
    mode.add_argument("--dry-run", action="store_true",
                      help="a tiny shape, one call, one round: checks the pipeline and format")
    mode.add_argument("--probe", action="store_true",
                      help="time torch after refattn calls under each slowdown hypothesis")
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                   help="threads of every side (default 2)")
    p.add_argument("--calls", type=int, default=7, help="timed calls per process (7)")
    p.add_argument("--rounds", type=int, default=3, help="processes per variant (3)")
    p.add_argument("--shape", help="B,Hq,Hkv,Q,K,D[,causal] instead of the default cases")
    p.add_argument("--no-mkl", action="store_true", help="skip refattn-mkl even where possible")
    p.add_argument("--unset-openblas-env", action="store_true",
                   help="remove OPENBLAS_* variables from the children's environment")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child_main(json.loads(args.child))))
        return 0
    if args.dry_run:
        args.calls, args.rounds = 1, 1
    threads = args.threads
    base_env = child_environ(threads, args.unset_openblas_env)
    env = _spawn(["env", threads], base_env)  # calibrates here, before any timed call
    dgemm = _spawn(["dgemm", threads, 256 if args.dry_run else 3072], base_env)
    print("\n".join(header_lines(env, threads, args.unset_openblas_env, dgemm)), flush=True)
    if args.shape:
        parts = args.shape.split(",")
        cases = [Case(*map(int, parts[:6]), causal=parts[6:] == ["causal"])]
    else:
        cases = DRY_CASES if args.dry_run else QUICK_CASES if args.quick else CASES
    variants = ["torch", "refattn"] if env["torch"] else ["refattn"]
    if "mkl" in env["providers"] and not args.no_mkl and env["provider"] != MKL_PROVIDER:
        variants.append("refattn-mkl")
    out: dict[str, Any] = {"environment": env, "dgemm": dgemm, "threads": threads,
                           "calls": args.calls, "rounds": args.rounds, "cases": []}
    with tempfile.TemporaryDirectory(prefix="refattn-bench-") as tmp:
        if args.probe:
            case = cases[0] if args.shape else Case(2, 8, 8, 1024, 1024, 64)
            data = write_inputs(case, Path(tmp))
            out["probe"] = probe(case, data, threads=threads, calls=args.calls,
                                 rounds=args.rounds, unset_openblas=args.unset_openblas_env)
            print(f"probe at {case.name}: torch f+b median s; {args.rounds} fresh processes "
                  f"per scenario (interleaved) x {args.calls} calls per slot\n")
            print("| scenario | " + " | ".join(PROBE_SLOTS) + " | torch's symbols bound to |")
            print("| --- | ---: | ---: | ---: | --- |")
            for label, r in out["probe"].items():
                cells = [f"{r[slot]:.4f}" if slot in r else "-" for slot in PROBE_SLOTS]
                print(f"| {label} | " + " | ".join(cells) + f" | {r['bindings']} |")
        else:
            print(f"each variant: {args.rounds} fresh processes x (1 warm + {args.calls} timed "
                  "calls), interleaved; figure = median of the process medians; one process "
                  "with every variant round robin as a cross-check\n")
            print(HEADER)
            print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
                  flush=True)
            for case in cases:
                data = write_inputs(case, Path(tmp))
                r = measure(case, variants, data, threads=threads, calls=args.calls,
                            rounds=args.rounds, unset_openblas=args.unset_openblas_env,
                            dgemm_n=256 if args.dry_run else 3072)
                out["cases"].append(r)
                print("\n".join(rows(r, dgemm["gflops"])), flush=True)
            print("\n".join(summary(out["cases"], dgemm["gflops"], env["install"], env["cpu"])))
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
