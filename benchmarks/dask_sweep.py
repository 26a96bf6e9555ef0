"""Scaling of refattn.distributed on local dask workers: sweeps, per-task overhead, one long call.

    python3 benchmarks/dask_sweep.py            # about 3 minutes on 2 cores
    python3 benchmarks/dask_sweep.py --quick    # smaller sizes, a smoke test

What it measures, in one run, side by side (the machine is shared: absolute times move between
runs, the ratios measured together are what counts; the load average is printed before and
after every section):

1. Sweep throughput (cases per second) of ``refattn sweep`` in this process and on a
   ``LocalCluster`` of 1 and of 2 worker processes, alternating 1, 2, 1, 2 workers, for two
   SPECs of at least 200 cases: ``bench`` (cases of 50-80 ms each with the exact generator)
   and ``examples/sweep.toml`` (204 cases of 2-30 ms). Every bundle written is compared byte
   for byte with the in-process one.
2. Per-task overhead: the round trip of an empty task, and for one ``bench`` case per task on
   one worker, (wall time - time inside the tasks) / tasks, as a fraction of the mean task.
3. One long call, ``refattn.distributed.value_and_grad`` (forward + backward, streaming
   tiles) at 1 and 2 workers, whole (batch, kv-head) units and split into query/key shards,
   against the single-process streaming run with 1 and 2 numba threads; bit identity checked.
4. The README's projection to a 64-node cluster, from these measurements.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import refattn  # noqa: E402
from refattn.bundle.sweeps.grid import check_spec, expand, load_sweep  # noqa: E402
from refattn.distributed import connect, run_sweep, value_and_grad  # noqa: E402
from refattn.distributed.shard import plan_shards  # noqa: E402
from refattn.masks import causal  # noqa: E402

BENCH_SPEC = {
    "name": "bench",
    "grid": [{
        "shape": [[1, 2, 2, 24, 24, 16, 16], [1, 2, 1, 32, 32, 16, 16],
                  [1, 4, 2, 16, 32, 16, 16], [2, 2, 2, 24, 24, 8, 8]],
        "mask": ["none", "causal_upper_left", "causal_lower_right",
                 {"kind": "window", "left": 4}, {"kind": "key_padding", "pad": 3}],
        "dropout": ["none", {"p": 0.1, "seed": 7}],
        "seed": [0, 1, 2, 3, 4],
    }],
}


def load() -> str:
    a, b, c = os.getloadavg()
    return f"load average {a:.2f} {b:.2f} {c:.2f}"


class Others:
    """CPU time used by processes outside this benchmark's tree while a section runs: the
    machine is shared, and this says how much of it other work took (cores on average)."""

    def __enter__(self) -> Others:
        self.start = self._sample()
        return self

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        import psutil

        total = psutil.cpu_times()
        me = psutil.Process()
        ours = 0.0
        for proc in [me, *me.children(recursive=True)]:
            try:
                t = proc.cpu_times()
                ours += t.user + t.system + t.children_user + t.children_system
            except psutil.Error:
                pass
        return time.perf_counter(), total.user + total.system + total.nice, ours

    def __exit__(self, *exc: object) -> None:
        t1, all1, ours1 = self._sample()
        t0, all0, ours0 = self.start
        other = max(0.0, (all1 - all0) - (ours1 - ours0))
        print(f"  (other processes on the machine used {other / (t1 - t0):.2f} cores on average "
              f"during this section; {load()})")


def digest(directory: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(directory.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(directory)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:16]


def warm(client) -> None:
    """Import what a task needs on every worker (not part of any timing)."""
    client.run(lambda: __import__("refattn.distributed.sweep"))


def sweep_section(clients: dict[int, object], rounds: int, tmp: Path, quick: bool) -> dict:
    print(f"\n== 1. sweep throughput ({load()})")
    specs = {"bench": expand(check_spec(BENCH_SPEC)),
             "example": load_sweep(ROOT / "examples" / "sweep.toml")}
    if quick:
        specs = {k: type(v)(v.name, v.sweep_id, v.cases[:40]) for k, v in specs.items()}
    out: dict = {}
    for name, sweep in specs.items():
        n = len(sweep.cases)
        ref = tmp / f"{name}-here"
        t0 = time.perf_counter()
        r = run_sweep(sweep, ref, progress=False)
        here = time.perf_counter() - t0
        reference = digest(ref)
        mean_case = r.task_seconds / n
        times: dict[int, list[float]] = {1: [], 2: []}
        driver_cpu: dict[int, list[float]] = {1: [], 2: []}
        for k in range(rounds):
            for w in (1, 2):
                dest = tmp / f"{name}-w{w}-{k}"
                cpu0, t0 = time.process_time(), time.perf_counter()
                r = run_sweep(sweep, dest, client=clients[w], progress=False)
                times[w].append(time.perf_counter() - t0)
                driver_cpu[w].append(time.process_time() - cpu0)
                assert digest(dest) == reference, f"{name}: {w} worker(s) wrote other bytes"
        best = {w: min(t) for w, t in times.items()}
        ratio = best[1] / best[2]
        print(f"{name}: {n} cases, mean {1e3 * mean_case:.1f} ms per case in this process")
        print(f"  in-process  {here:7.2f} s  {n / here:7.1f} cases/s")
        for w in (1, 2):
            ts = ", ".join(f"{t:.2f}" for t in times[w])
            print(f"  {w} worker(s) {best[w]:7.2f} s  {n / best[w]:7.1f} cases/s   (runs: {ts} s;"
                  f" driver+scheduler CPU {statistics.median(driver_cpu[w]):.2f} s)")
        print(f"  2 workers / 1 worker throughput: {ratio:.2f}x   (target >= 1.8x; "
              f"bytes identical in all {1 + 2 * rounds} bundles)")
        out[name] = {"cases": n, "mean_case": mean_case, "ratio": ratio, "best": best,
                     "driver_per_case": statistics.median(driver_cpu[1]) / n}
    return out


def _noop(_: object) -> None:
    return None


def _timed(batch):
    """A sweep task that also returns when it started and ended (wall clock, this machine)."""
    from refattn.distributed.sweep import encode_batch

    t0 = time.time()
    encode_batch(batch)
    return t0, time.time()


def overhead_section(client, tmp: Path, quick: bool) -> None:
    print(f"\n== 2. per-task overhead on 1 worker ({load()})")
    n = 100 if quick else 400
    client.gather(client.map(_noop, range(20), pure=False))
    t0 = time.perf_counter()
    client.gather(client.map(_noop, range(n), pure=False))
    empty = (time.perf_counter() - t0) / n
    print(f"empty task: {1e3 * empty:.2f} ms per task ({n} tasks submitted together)")
    sweep = expand(check_spec(BENCH_SPEC))
    cases = sweep.cases[: 30 if quick else 100]
    stamps = sorted(client.gather(client.map(
        _timed, [[(c.case_id, c.description)] for c in cases], pure=False)))
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(stamps)]
    spans = [b - a for a, b in stamps]
    gap = statistics.median(gaps)
    median = statistics.median(spans)
    print(f"one bench case per task, {len(cases)} tasks: median task {1e3 * median:.1f}"
          f" ms (shortest {1e3 * min(spans):.1f}), the worker idle between two tasks "
          f"{1e3 * gap:.2f} ms (median) = {100 * gap / min(spans):.1f}% of the shortest task")
    sub = type(sweep)(sweep.name, sweep.sweep_id, cases)
    t0 = time.perf_counter()
    r = run_sweep(sub, tmp / "overhead", client=client, progress=False, tasks=len(cases))
    wall = time.perf_counter() - t0
    mean_task = r.task_seconds / r.tasks
    per_task = (wall - r.task_seconds) / r.tasks
    print(f"the same as refattn sweep: mean task {1e3 * mean_task:.1f} ms, overhead "
          f"{1e3 * per_task:.2f} ms per task = {100 * per_task / mean_task:.1f}% of the task "
          "(target < 5% for tasks >= 50 ms)")
    print("  (wall - time inside the tasks, per task: scheduling, moving the result, staging "
          "it, and the manifest, flush and final swap spread over the tasks)")


def _local(call, g, bq, bk):
    trace = refattn.forward(call, backend="numba", materialize=False, block_q=bq, block_k=bk)
    return trace.output, refattn.backward(trace, g)


def _warm_kernels() -> None:
    """Load the numba kernels in a worker (from the on-disk cache; not part of any timing)."""
    x = np.zeros((1, 1, 4, 4))
    trace = refattn.forward(refattn.AttentionCall(x, x, x), backend="numba", materialize=False)
    refattn.backward(trace, x)


def long_call_section(clients: dict[int, object], quick: bool) -> dict:
    import numba

    L = 2048 if quick else 8192
    B, Hq, Hkv, D = 1, 4, 4, 64
    print(f"\n== 3. one long call: (B, Hq, Hkv, Q=K, D) = ({B}, {Hq}, {Hkv}, {L}, {D}), causal, "
          f"forward + backward, tiles 256 x 256 ({load()})")
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, Hq, L, D))
    k = rng.standard_normal((B, Hkv, L, D))
    v = rng.standard_normal((B, Hkv, L, D))
    g = rng.standard_normal((B, Hq, L, D))
    call = refattn.AttentionCall(q, k, v, visible=causal(L, L, alignment="upper_left"))
    _local(call, g, 256, 256)  # compile / load the kernels
    threads = numba.get_num_threads()
    times: dict[str, float] = {}
    results = {}
    for t in sorted({1, threads}):
        numba.set_num_threads(t)
        t0 = time.perf_counter()
        results[f"local {t} thread(s)"] = _local(call, g, 256, 256)
        times[f"local {t} thread(s)"] = time.perf_counter() - t0
    numba.set_num_threads(threads)
    reference = results[f"local {threads} thread(s)"]
    for rows in (None, L // 4):
        plan = plan_shards(call, rows_per_shard=rows)
        for w in (1, 2):
            clients[w].run(_warm_kernels)
            label = f"{w} worker(s), {plan.tasks} tasks" + (
                "" if rows is None else f" (rows_per_shard={rows})")
            t0 = time.perf_counter()
            out, grads = value_and_grad(call, g, client=clients[w], rows_per_shard=rows)
            times[label] = time.perf_counter() - t0
            same = out.tobytes() == reference[0].tobytes() and all(
                getattr(grads, n).tobytes() == getattr(reference[1], n).tobytes()
                for n in ("grad_q", "grad_k", "grad_v", "row_dot"))
            assert same, f"{label}: not bit-identical to the local run"
    base = times["local 1 thread(s)"]
    for label, t in times.items():
        print(f"  {label:42s} {t:7.2f} s   {base / t:5.2f}x the 1-thread local run")
    print("  every distributed result bit-identical to the local run "
          f"({threads} numba threads)")
    pairs = B * Hq * L * (L + 1) / 2  # visible (query, key) pairs of the causal call
    per_pair = base / pairs
    print(f"  cost: {1e9 * per_pair:.2f} ns per visible pair, forward + backward, one thread")
    return {"per_pair": per_pair, "times": times}


def projection(sweeps: dict, long: dict) -> None:
    print("\n== 4. projection to 64 nodes x 32 cores (README, 'Past one machine')")
    workers = 64 * 32
    mean = sweeps["bench"]["mean_case"]
    serial = sweeps["bench"]["driver_per_case"]
    n = 10_000
    print(f"10,000 cases of {1e3 * mean:.0f} ms: {n * mean:.0f} core-seconds, "
          f"{n * mean / workers:.1f} s on {workers} cores; the calling process and scheduler "
          f"used {1e3 * serial:.1f} ms of CPU per case here (1 worker), {n * serial:.0f} s "
          f"serial for 10,000 cases; driver-bound until cases take {workers * serial:.1f} s")
    L = 131072
    pairs = 1 * 8 * L * (L + 1) / 2
    t1 = long["per_pair"] * pairs
    times = long["times"]
    whole = next(t for k, t in times.items() if k.startswith("1 worker") and "rows" not in k)
    split = next(t for k, t in times.items() if k.startswith("1 worker") and "rows" in k)
    tasks = 8 * 2 * (L // 512)
    print(f"L = {L}, (B, Hq, Hkv, D) = (1, 8, 8, 64), causal: {t1:.0f} s = {t1 / 60:.0f} min "
          f"on one core; shards cost {split / whole:.2f}x the work of whole units here, so "
          f"rows_per_shard=512 ({tasks} tasks of {t1 * split / whole / tasks:.2f} s) gives "
          f"{t1 * split / whole / workers:.1f} s of compute on {workers} cores; inputs 2.1 GB "
          "per worker process")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke test)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of 1 and 2 "
                        "workers per SPEC (default 2)")
    args = parser.parse_args()
    print(f"refattn benchmarks/dask_sweep.py on {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, python {platform.python_version()}")
    import distributed

    print(f"dask.distributed {distributed.__version__}; {load()}")
    with tempfile.TemporaryDirectory() as d, connect(workers=1) as c1, \
            connect(workers=2) as c2:
        tmp = Path(d)
        clients = {1: c1, 2: c2}
        for c in clients.values():
            warm(c)
        with Others():
            sweeps = sweep_section(clients, 1 if args.quick else args.rounds, tmp, args.quick)
        with Others():
            overhead_section(c1, tmp, args.quick)
        with Others():
            long = long_call_section(clients, args.quick)
    projection(sweeps, long)


if __name__ == "__main__":
    main()
