"""Where the work runs: a local cluster of worker processes, a running scheduler, or here.

Owns :func:`dask_distributed` (the lazy import of ``dask.distributed`` with a clear message
when it is missing) and :func:`connect` (``--workers N``: a ``LocalCluster`` of N
single-threaded worker processes listening on 127.0.0.1 only, no dashboard; ``--scheduler
ADDR``: a client of a running scheduler, refused with a one-line error when nothing answers
within the timeout; neither: no client, the work runs in this process).
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from refattn.errors import RefAttnError

__all__ = ["DEFAULT_TIMEOUT", "connect", "dask_distributed", "worker_threads"]

#: seconds to wait for a scheduler (or a local cluster) to answer
DEFAULT_TIMEOUT = 10.0


def dask_distributed() -> ModuleType:
    """``dask.distributed``, imported on first use.

    Raises
    ------
    RefAttnError
        When dask's distributed scheduler is not installed.
    """
    try:
        import distributed
    except ImportError:
        from refattn._install import install_hint

        raise RefAttnError("dask: refattn's distributed features need dask.distributed; "
                           f"install it with {install_hint('distributed')}") from None
    return distributed


def _timeout(timeout: object) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not (
            0 < float(timeout) < 1e6):
        raise RefAttnError(f"timeout: expected a positive number of seconds, got {timeout!r}")
    return float(timeout)


@contextmanager
def connect(*, workers: int | None = None, scheduler: str | None = None,
            timeout: float = DEFAULT_TIMEOUT, memory_limit: str | int = "4GiB",
            ) -> Iterator[Any]:
    """A dask client for ``workers`` local processes or the scheduler at ``scheduler``.

    Parameters
    ----------
    workers : int, optional
        Start a ``LocalCluster`` of this many worker processes (one thread each, loopback
        only, the scheduler's HTTP status page on a free loopback port); it is shut down on exit.
    scheduler : str, optional
        Address of a running scheduler (``tcp://host:port``); the cluster is left running.
    timeout : float
        Seconds to wait for the scheduler (or the local cluster) to answer.
    memory_limit : str or int
        Per-worker memory limit of a local cluster (dask's spelling, e.g. ``"1GiB"``).

    Yields
    ------
    distributed.Client or None
        None when neither ``workers`` nor ``scheduler`` is given (run in this process).

    Raises
    ------
    RefAttnError
        Both given, a bad worker count, dask missing, or no scheduler answering in time.

    Examples
    --------
    >>> with connect() as client:
    ...     client is None
    True
    """
    timeout = _timeout(timeout)
    if workers is not None and scheduler is not None:
        raise RefAttnError("--workers and --scheduler: give one or the other (a local "
                           "cluster, or a running scheduler)")
    if workers is None and scheduler is None:
        yield None
        return
    d = dask_distributed()
    if scheduler is not None:
        if not isinstance(scheduler, str) or not scheduler.strip():
            raise RefAttnError(f"--scheduler: expected an address such as "
                               f"tcp://127.0.0.1:8786, got {scheduler!r}")
        try:
            client = d.Client(scheduler, timeout=timeout, set_as_default=False)
        except (OSError, TimeoutError, ValueError) as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise RefAttnError(f"--scheduler {scheduler}: no dask scheduler answered within "
                               f"{timeout:g} s ({reason})") from None
        try:
            yield client
        finally:
            client.close()
        return
    if isinstance(workers, bool) or not isinstance(workers, numbers.Integral) or not (
            1 <= workers <= 1024):
        raise RefAttnError(f"--workers: expected a number of worker processes in [1, 1024], "
                           f"got {workers!r}")
    try:
        cluster = d.LocalCluster(n_workers=int(workers), threads_per_worker=1, processes=True,
                                 host="127.0.0.1", dashboard_address="127.0.0.1:0",
                                 memory_limit=memory_limit, silence_logs=logging.CRITICAL)
    except (RuntimeError, OSError, TimeoutError, ValueError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise RefAttnError(f"--workers {workers}: the local dask cluster did not start "
                           f"({reason})") from None
    try:
        client = d.Client(cluster, timeout=timeout, set_as_default=False)
        try:
            client.wait_for_workers(int(workers), timeout=timeout * 6)
            yield client
        finally:
            client.close()
    finally:
        cluster.close()


def worker_threads(client: Any) -> int:
    """Total worker threads of a client's cluster (1 without a client).

    Examples
    --------
    >>> worker_threads(None)
    1
    """
    if client is None:
        return 1
    return max(1, sum(client.nthreads().values()))
