"""``refattn sweep``: a SPEC's cases computed here or on dask workers, written as one bundle.

Owns :func:`run_sweep`. The SPEC is expanded and every case validated first
(:mod:`refattn.bundle.sweeps.grid`); then :func:`refattn.bundle.writing.write.write_sweep` takes
over the output directory (locked, checked, resumed from what an interrupted run staged) and asks
for the cases still missing. Without a client they are computed here, one after another; with one
they are dealt into tasks of similar estimated cost (largest first) and each task returns its
cases' file bytes and manifest entries. Only this process writes: a case reaches the staging
directory only once its whole result has arrived, so a worker killed mid-case leaves nothing
behind, and dask runs the lost task again on another worker. Every wait is bounded
(:class:`~refattn.distributed.cluster.Watchdog`): a scheduler silent for ``timeout`` seconds,
or a task without a result within its cases' estimated time times
:data:`~refattn.distributed.cluster.SAFETY_FACTOR` (plus start-up and ``timeout``), ends the
run with one error; what finished stays staged and the bundle is not swapped in, so a rerun
resumes. The bundle's bytes depend only on the cases, never on the worker count, the order of
arrival or the number of runs.
"""

from __future__ import annotations

import heapq
import math
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from refattn._boundary import public
from refattn._progress import progress as progress_bar
from refattn.bundle.sweeps.grid import (
    Sweep,
    SweepCase,
    build_case,
    case_budget,
    check_budget,
    cost,
    load_sweep,
)
from refattn.bundle.writing.write import Encoded, bundle_generator, encode_case, write_sweep
from refattn.distributed.cluster import DEFAULT_TIMEOUT, Watchdog, worker_threads
from refattn.engine.memory import available_bytes
from refattn.errors import RefAttnError

__all__ = ["SweepResult", "deal", "encode_batch", "run_sweep", "worker_memory_limit"]

#: at most this many cases share one task (a lost worker costs at most one task's cases)
MAX_CASES_PER_TASK = 32
#: tasks per worker thread when cases are dealt into tasks
TASKS_PER_THREAD = 8


class SweepResult(NamedTuple):
    """What :func:`run_sweep` did.

    Attributes
    ----------
    manifest : Path
        The bundle's ``manifest.json``.
    cases, computed, reused : int
        Cases in the sweep; computed by this run; found staged or already in the bundle.
    up_to_date : bool
        The directory already held exactly this bundle (nothing was written).
    tasks : int
        Tasks submitted (0 in-process).
    task_seconds : float
        Seconds spent computing cases, summed over tasks (as measured inside each task).
    wall_seconds : float
        Seconds from the first case submitted to the last case staged.
    sweep_id : str
    """

    manifest: Path
    cases: int
    computed: int
    reused: int
    up_to_date: bool
    tasks: int
    task_seconds: float
    wall_seconds: float
    sweep_id: str


def encode_batch(descriptions: Sequence[tuple[str, dict[str, Any]]]
                 ) -> tuple[list[Encoded], float]:
    """Compute a batch of sweep cases (a worker task): their encoded files and the seconds.

    Examples
    --------
    >>> from refattn.bundle.sweeps.grid import normalize, case_id
    >>> d = normalize({"shape": [1, 1, 1, 2, 3, 4, 4]})
    >>> (enc,), seconds = encode_batch([(case_id(d), d)])
    >>> enc.entry["file"] == f"cases/{enc.case_id}.safetensors", seconds > 0
    (True, True)
    """
    t0 = time.perf_counter()
    out = []
    for cid, description in descriptions:
        data, entry = encode_case(build_case(description, cid), description["generator"])
        out.append(Encoded(cid, data, entry))
    return out, time.perf_counter() - t0


def deal(cases: Sequence[SweepCase], tasks: int) -> list[list[SweepCase]]:
    """Deal cases into at most ``tasks`` batches of similar estimated cost, largest first.

    Longest-processing-time first: each case, by decreasing
    :func:`~refattn.bundle.sweeps.grid.cost`, goes to the batch with the least cost so far.
    Deterministic; the batches come back by decreasing total cost (the order they are submitted in).

    Examples
    --------
    >>> from refattn.bundle.sweeps.grid import normalize, case_id
    >>> cs = [SweepCase(case_id(d), d, "") for d in
    ...       (normalize({"shape": [1, 1, 1, q, q, 4, 4]}) for q in (2, 4, 8, 16))]
    >>> [[c.description["shape"]["Q"] for c in b] for b in deal(cs, 2)]
    [[16, 2], [8, 4]]
    """
    tasks = max(1, min(int(tasks), len(cases)))
    heap = [(0.0, n) for n in range(tasks)]
    batches: list[list[SweepCase]] = [[] for _ in range(tasks)]
    totals = [0.0] * tasks
    for case in sorted(cases, key=lambda c: (-cost(c.description), c.case_id)):
        load, n = heapq.heappop(heap)
        batches[n].append(case)
        totals[n] = load + cost(case.description)
        heapq.heappush(heap, (totals[n], n))
    order = sorted(range(tasks), key=lambda n: (-totals[n], n))
    return [batches[n] for n in order if batches[n]]


def _task_count(n: int, threads: int) -> int:
    return min(n, max(TASKS_PER_THREAD * threads, math.ceil(n / MAX_CASES_PER_TASK)))


@public
def run_sweep(spec: str | os.PathLike | Sweep, out: str | os.PathLike, *,
              client: Any = None, force: bool = False, progress: bool | None = None,
              tasks: int | None = None, timeout: float = DEFAULT_TIMEOUT,
              backend: str | None = None) -> SweepResult:
    """Compute every case of a sweep SPEC and write them as one golden bundle.

    Parameters
    ----------
    spec : path or Sweep
        A SPEC file (TOML or YAML) or an expanded :class:`~refattn.bundle.sweeps.grid.Sweep`.
    out : path
        The bundle directory: absent, empty, or this sweep's own (finished or interrupted).
    client : distributed.Client, optional
        Run the cases on its workers (see :func:`~refattn.distributed.cluster.connect`);
        None computes them in this process.
    force : bool
        Write beside files refattn did not write (left untouched).
    progress : bool or None
        A bar of cases done on standard error: None on a terminal only, False never.
    tasks : int, optional
        Number of tasks the pending cases are dealt into (default: 8 per worker thread, at
        most 32 cases per task); 1 case per task when equal to the number of cases.
    timeout : float
        With a client: seconds the scheduler may leave a request unanswered before the run
        is given up (``--timeout``); each task's result is awaited at most its cases'
        estimated seconds (:func:`~refattn.bundle.sweeps.grid.case_budget`) times
        :data:`~refattn.distributed.cluster.SAFETY_FACTOR`, plus
        :data:`~refattn.distributed.cluster.STARTUP_SECONDS` and ``timeout``.
    backend : {"exact", "numpy", "numba"}, optional
        The generator of every case (``--backend``; a SPEC that names another is refused);
        None: the SPEC's own (``exact`` where it names none). Ignored for a ``Sweep``.

    Returns
    -------
    SweepResult

    Raises
    ------
    RefAttnError
        A bad SPEC (named key and place), a case that cannot run (named), a case whose
        estimated time or memory is over the limit (this machine's available memory, or the
        smallest memory limit of the client's workers; nothing is drawn first), an output
        directory holding another bundle or another sweep's unfinished work, a failing task,
        a scheduler silent for ``timeout`` seconds or a task past its bound (the cases
        finished so far stay staged: a rerun resumes).

    Examples
    --------
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "s.toml").write_text('name = "doc"\\n[[grid]]\\n'
    ...                               'shape = [[1, 1, 1, 2, 3, 4, 4]]\\nseed = [0, 1]\\n')
    >>> r = run_sweep(d / "s.toml", d / "bundle", progress=False)
    >>> r.cases, r.computed, r.up_to_date
    (2, 2, False)
    >>> run_sweep(d / "s.toml", d / "bundle", progress=False).up_to_date
    True
    """
    max_bytes = worker_memory_limit(client, timeout)  # None: here, or workers without one
    if isinstance(spec, Sweep):
        sweep = spec
        limit = max_bytes if max_bytes is not None else available_bytes()
        for case in sweep.cases:  # from its shape alone: nothing is allocated
            try:
                check_budget(case.description, case.case_id, max_bytes=limit)
            except RefAttnError as exc:
                raise RefAttnError(f"sweep {sweep.name}: {case.origin}: {exc}") from None
    else:
        sweep = load_sweep(spec, max_bytes=max_bytes, backend=backend)
    by_id = {c.case_id: c for c in sweep.cases}
    stats = {"tasks": 0, "task_seconds": 0.0, "t0": 0.0, "t1": 0.0}

    def compute(pending: list[str]) -> Iterator[Encoded]:
        stats["t0"] = time.perf_counter()
        cases = [by_id[cid] for cid in pending]
        if client is None:
            results: Iterator[Encoded] = _in_process(cases, stats)
        else:
            threads = worker_threads(client, timeout, "sweep") if tasks is None else 1
            n = tasks if tasks is not None else _task_count(len(cases), threads)
            results = _on_workers(client, deal(cases, n), stats, timeout)
        yield from progress_bar(results, desc=f"sweep {sweep.name}", total=len(cases),
                                enabled=progress)
        stats["t1"] = time.perf_counter()

    written = write_sweep(out, [c.case_id for c in sweep.cases], compute, suite=sweep.suite,
                          generator=bundle_generator(sweep.generators), sweep=sweep.record(),
                          force=force)
    return SweepResult(written.manifest, len(sweep.cases), written.computed, written.reused,
                       written.up_to_date, int(stats["tasks"]), float(stats["task_seconds"]),
                       max(0.0, stats["t1"] - stats["t0"]), sweep.sweep_id)


def worker_memory_limit(client: Any, timeout: float = DEFAULT_TIMEOUT) -> int | None:
    """The smallest memory limit among a client's workers, in bytes (None: no client, or
    no worker reports a limit). The scheduler is asked within ``timeout`` seconds.

    Examples
    --------
    >>> worker_memory_limit(None) is None
    True
    """
    if client is None:
        return None
    watch = Watchdog(client, timeout, "sweep")
    try:
        workers = watch.call(client.scheduler_info, "its workers' memory limits").get(
            "workers", {})
    except RefAttnError:
        raise
    except Exception:  # an older dask or a scheduler gone: the driver's own limit then
        return None
    reported = [w.get("memory_limit") for w in workers.values() if isinstance(w, dict)]
    limits = [int(n) for n in reported if isinstance(n, (int, float)) and n > 0]
    return min(limits) if limits else None


def _in_process(cases: list[SweepCase], stats: dict[str, Any]) -> Iterator[Encoded]:
    for case in cases:
        (encoded,), seconds = encode_batch([(case.case_id, case.description)])
        stats["task_seconds"] += seconds
        yield encoded


def _on_workers(client: Any, batches: list[list[SweepCase]], stats: dict[str, Any],
                timeout: float = DEFAULT_TIMEOUT) -> Iterator[Encoded]:
    watch = Watchdog(client, timeout, "sweep", resume="the cases finished so far are staged: "
                     "rerun the same command to resume")
    payloads = [[(c.case_id, c.description) for c in batch] for batch in batches]
    futures = client.map(encode_batch, payloads, pure=False)
    stats["tasks"] = len(futures)
    bounds = {f: Watchdog.task_bound(sum(case_budget(c.description).seconds for c in batch),
                                     timeout) for f, batch in zip(futures, batches, strict=True)}
    try:
        for future in watch.completed(bounds, f"the results of {len(futures)} task(s)"):
            try:
                encoded, seconds = watch.result(future, bounds[future], "a finished task")
            except RefAttnError:
                raise
            except Exception as exc:  # a task that failed on its workers (e.g. KilledWorker)
                reason = " ".join(str(exc).split()) or type(exc).__name__
                raise RefAttnError(f"sweep: a task failed on the workers ({type(exc).__name__}: "
                                   f"{reason}); the cases finished so far are staged: rerun "
                                   "to resume") from None
            stats["task_seconds"] += seconds
            future.release()
            yield from encoded
    finally:
        watch.cancel(futures)


def describe(result: SweepResult, out: str | os.PathLike) -> str:
    """One line saying what a sweep did (the command's output).

    Examples
    --------
    >>> r = SweepResult(Path("b/manifest.json"), 3, 2, 1, False, 0, 0.5, 0.6, "00ff")
    >>> describe(r, "b")
    'sweep 00ff: 3 case(s) in b (computed 2, reused 1)'
    """
    if result.up_to_date:
        return (f"sweep {result.sweep_id}: {result.cases} case(s) in {out} are up to date "
                "(nothing written)")
    return (f"sweep {result.sweep_id}: {result.cases} case(s) in {out} (computed "
            f"{result.computed}, reused {result.reused})")
