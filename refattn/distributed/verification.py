"""``refattn verify DIR --workers N``: the same verdicts as ``refattn verify``, cases in parallel.

Owns :func:`verify`. This process reads and checks everything that touches the directory (the
manifest and its schema, each case file from inside the bundle with its checksums, the listing
of ``cases/``), exactly as :func:`refattn.bundle.verification.verifier.verify` does; each case whose
file passes is sent to a worker as bytes (workers need no access to the directory) and checked
there by :func:`~refattn.bundle.verification.verifier.verify_case_bytes`, the function the serial
verify runs for it. The report lists the cases in the same order with the same verdicts. Every wait
is bounded (:class:`~refattn.distributed.cluster.Watchdog`): a scheduler silent for
``timeout`` seconds, or a case without a verdict within its estimated time (the exact
generator's estimate from the manifest's axes, at most ``exact_max_seconds``) times
:data:`~refattn.distributed.cluster.SAFETY_FACTOR` plus start-up and ``timeout``, is one error.
"""

from __future__ import annotations

import os
from typing import Any

from refattn._boundary import public, shown
from refattn._progress import progress as progress_bar
from refattn.bundle.verification.gradients import GradcheckMethod
from refattn.bundle.verification.report import CaseResult, VerifyReport
from refattn.bundle.verification.verifier import check_file, open_bundle, verify_case_bytes
from refattn.bundle.verification.verifier import verify as verify_serial
from refattn.distributed.cluster import DEFAULT_TIMEOUT, Watchdog
from refattn.engine.exact.backend import DEFAULT_MAX_SECONDS, SECONDS_PER_ELEMENT
from refattn.errors import RefAttnError

__all__ = ["verify"]


@public
def verify(directory: str | os.PathLike, *, client: Any = None, recompute: bool = True,
           gradcheck: bool = True, gradcheck_method: GradcheckMethod = "auto",
           backend: str | None = None, exact: bool = False, require: str = "float64",
           exact_max_seconds: float = DEFAULT_MAX_SECONDS,
           progress: bool | None = None, timeout: float = DEFAULT_TIMEOUT) -> VerifyReport:
    """Verify every case of a bundle, the cases checked on a dask cluster's workers.

    Parameters
    ----------
    directory : path
        A bundle (``manifest.json`` and ``cases/``).
    client : distributed.Client, optional
        Where the cases run; None runs :func:`refattn.bundle.verification.verifier.verify` here.
    recompute, gradcheck, gradcheck_method, backend, exact, require, exact_max_seconds
        As for :func:`refattn.bundle.verification.verifier.verify`.
    progress : bool or None
        A bar of cases verified on standard error: None on a terminal only, False never.
    timeout : float
        With a client: seconds the scheduler may leave a request unanswered (``--timeout``).

    Returns
    -------
    VerifyReport
        The report the serial verify gives: the same cases, order and verdicts.

    Examples
    --------
    >>> import tempfile
    >>> from refattn.bundle.writing.write import write_bundle
    >>> from refattn.bundle.suites import build_suite
    >>> d = tempfile.mkdtemp()
    >>> _ = write_bundle(d, build_suite("contract")[:1], suite="contract")
    >>> verify(d, client=None).passed          # no client: the serial verify
    True
    """
    options: dict[str, Any] = {"recompute": recompute, "gradcheck": gradcheck, "backend": backend,
               "exact": exact, "require": require, "exact_max_seconds": exact_max_seconds}
    if client is None:
        return verify_serial(directory, gradcheck_method=gradcheck_method, progress=progress,
                             **options)
    if not callable(getattr(client, "submit", None)):
        raise RefAttnError(f"client: expected a dask.distributed Client (or None), got "
                           f"{shown(client)}")
    bundle = open_bundle(directory, backend=backend, gradcheck_method=gradcheck_method,
                         require=require, recompute=recompute,
                         exact_max_seconds=exact_max_seconds)
    directory, manifest = bundle.directory, bundle.manifest
    options.update(method=gradcheck_method, bit_identical=bundle.bit_identical,
                   generator=manifest.get("generator"))
    watch = Watchdog(client, timeout, "verify")
    results: dict[str, CaseResult] = {}
    futures = {}
    bounds = {}
    for case_id, entry in sorted(manifest["cases"].items()):  # files read here, in order
        verdict, checked, data = check_file(directory, case_id, entry)
        if verdict is not None or data is None:
            results[case_id] = verdict or CaseResult(case_id, checked)
            continue
        future = client.submit(verify_case_bytes, case_id, entry, data, checked, pure=False,
                               **options)
        futures[future] = case_id
        bounds[future] = Watchdog.task_bound(_estimate(entry, exact_max_seconds), timeout)
    done = progress_bar(watch.completed(bounds, f"the verdicts of {len(futures)} case(s)"),
                        desc="verify", total=len(futures), enabled=progress)
    try:
        for future in done:
            try:
                results[futures[future]] = watch.result(future, bounds[future],
                                                        f"case {futures[future]!r}")
            except RefAttnError:
                raise
            except Exception as exc:  # a task that failed on its workers (e.g. KilledWorker)
                reason = " ".join(str(exc).split()) or type(exc).__name__
                raise RefAttnError(f"verify: case {futures[future]!r} failed on the workers "
                                   f"({type(exc).__name__}: {reason})") from None
            future.release()
    finally:
        watch.cancel(futures)
    return bundle.report([results[c] for c in sorted(results)])


def _estimate(entry: Any, max_seconds: float) -> float:
    """Seconds a case's verification is expected to take: twice the exact generator's
    estimate from the manifest's axes (recomputation and reference check), the exact part at
    most ``max_seconds`` (a case over it is recomputed in float64); ``max_seconds`` when the
    axes are unreadable (the manifest passed its schema, but stay safe)."""
    try:
        a = {k: int(v) for k, v in entry["call"]["axes"].items()}
        n = a["B"] * a["Hq"] * a["Q"] * a["K"]
        rows = a["B"] * a["Hq"] * (a["Q"] + a["K"]) * (a["Dk"] + a["Dv"])
        width = 1
        score = entry["call"].get("score") if isinstance(entry["call"], dict) else None
        if isinstance(score, dict) and isinstance(score.get("da"), int):
            width = max(1, score["da"])
        seconds = SECONDS_PER_ELEMENT * (4 * n * width + rows)
    except (KeyError, TypeError, ValueError, AttributeError):
        return 2 * max_seconds
    return 2 * min(max(seconds, 0.0), max_seconds)
