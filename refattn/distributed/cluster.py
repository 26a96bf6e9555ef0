"""Where the work runs: a local cluster of worker processes, a running scheduler, or here.

Owns :func:`dask_distributed` (the lazy import of ``dask.distributed`` with a clear message
when it is missing) and :func:`connect` (``--workers N``: a ``LocalCluster`` of N
single-threaded worker processes listening on 127.0.0.1 only, no dashboard; ``--scheduler
ADDR``: a client of a running scheduler, refused with a one-line error when nothing answers
within the timeout; neither: no client, the work runs in this process).

Every wait on the network is bounded: the address is checked before anything connects (a
scheme dask does not know, a missing port), the scheduler must complete dask's handshake and
answer an ``identity`` request within ``timeout`` (a probe on its own event loop in a daemon
thread, so a listener that accepts and never answers, an HTTP server or a worker cannot hold
the command), and the client itself is built under the same watchdog. The number of local
worker processes is refused above the CPU cores this process may use.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import numbers
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from refattn.errors import RefAttnError

__all__ = ["DEFAULT_TIMEOUT", "connect", "dask_distributed", "usable_cores", "worker_threads"]

#: seconds to wait for a scheduler (or a local cluster) to answer
DEFAULT_TIMEOUT = 10.0
#: seconds a connection attempt may run past ``timeout`` before it is abandoned (its thread is
#: a daemon: it never holds the process at exit)
GRACE_SECONDS = 2.0
#: address schemes a scheduler may be reached by (``inproc`` reaches only this process)
_SCHEMES = ("tcp", "tls", "ws", "wss", "ucx")


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
        At most :func:`usable_cores`.
    scheduler : str, optional
        Address of a running scheduler (``tcp://host:port``); the cluster is left running.
        Whatever listens there must answer as a dask scheduler within ``timeout``.
    timeout : float
        Seconds to wait for the scheduler (or the local cluster) to answer; a scheduler
        address is given up within about ``timeout + 2`` seconds for the probe and as much
        again for building the client.
    memory_limit : str or int
        Per-worker memory limit of a local cluster (dask's spelling, e.g. ``"1GiB"``).

    Yields
    ------
    distributed.Client or None
        None when neither ``workers`` nor ``scheduler`` is given (run in this process).

    Raises
    ------
    RefAttnError
        Both given, a bad worker count or more workers than usable cores, dask missing, an
        address dask cannot reach a scheduler by, or no scheduler answering in time (a silent
        listener, an HTTP server, a worker: each named in one line).

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
    if scheduler is not None:
        address, shown = _check_address(scheduler)
        d = dask_distributed()
        client = _scheduler_client(d, address, shown, timeout)
        try:
            yield client
        finally:
            _close_quietly(client, timeout)
        return
    if isinstance(workers, bool) or not isinstance(workers, numbers.Integral) or not (
            1 <= workers <= 1024):
        raise RefAttnError(f"--workers: expected a number of worker processes in [1, 1024], "
                           f"got {workers!r}")
    cores = usable_cores()
    if workers > cores:
        raise RefAttnError(f"--workers {workers}: this machine lets refattn use {cores} CPU "
                           f"core(s); expected at most {cores} worker processes (each computes "
                           "one case at a time on one core)")
    d = dask_distributed()
    try:
        cluster = d.LocalCluster(n_workers=int(workers), threads_per_worker=1, processes=True,
                                 host="127.0.0.1", dashboard_address="127.0.0.1:0",
                                 memory_limit=memory_limit, silence_logs=logging.CRITICAL)
    except (RuntimeError, OSError, TimeoutError, ValueError) as exc:
        raise RefAttnError(f"--workers {workers}: the local dask cluster did not start "
                           f"({_one_line(exc)})") from None
    try:
        client = d.Client(cluster, timeout=timeout, set_as_default=False)
        try:
            client.wait_for_workers(int(workers), timeout=timeout * 6)
            yield client
        finally:
            client.close()
    finally:
        cluster.close()


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity mask where the system has one.

    Examples
    --------
    >>> 1 <= usable_cores() <= (os.cpu_count() or 1)
    True
    """
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity masks (macOS, Windows)
        return max(1, os.cpu_count() or 1)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def _check_address(scheduler: object) -> tuple[str, str]:
    """(address, its printable form) of a ``--scheduler`` value, checked before any connection:
    a scheme dask can reach a scheduler by, a host and a port in [1, 65535]."""
    example = "expected an address such as tcp://127.0.0.1:8786"
    if not isinstance(scheduler, str) or not scheduler.strip():
        raise RefAttnError(f"--scheduler: {example}, got {scheduler!r}")
    address = scheduler.strip()
    shown = address if address.isprintable() and len(address) <= 200 else ascii(address[:200])
    try:
        from distributed.comm.addressing import parse_address
        from distributed.comm.registry import get_backend

        scheme, location = parse_address(address)  # no scheme: dask's default, tcp
        if scheme not in _SCHEMES:
            raise ValueError(f"unknown address scheme {scheme!r}")
        host, port = get_backend(scheme).get_address_host_port(location)
        if not host or not 1 <= int(port) <= 65535:
            raise ValueError(f"host {host!r} and port {port!r}: expected a host name and a "
                             "port in [1, 65535]")
    except ImportError:
        dask_distributed()  # raises the install hint
        raise
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as exc:
        raise RefAttnError(f"--scheduler {shown}: not a dask scheduler address "
                           f"({_one_line(exc)}); {example}") from None
    return address, shown


class _Outcome:
    """What a call run under :func:`_bounded` returned or raised (``done``: it finished)."""

    def __init__(self) -> None:
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None


def _bounded(what: Callable[[], Any], seconds: float, name: str) -> _Outcome:
    """Run ``what()`` in a daemon thread and wait for it at most ``seconds``: a wait on the
    network that ignores its own timeout cannot hold the caller, nor the process at exit."""
    outcome = _Outcome()

    def run() -> None:
        try:
            outcome.value = what()
        except BaseException as exc:  # handed to the caller, who names it
            outcome.error = exc
        outcome.done = True

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(seconds)
    return outcome


async def _identity(d: ModuleType, address: str, timeout: float) -> Any:
    """dask's handshake with ``address``, then its answer to ``{"op": "identity"}``."""
    comm = await d.comm.connect(address, timeout=timeout,
                                **d.Security().get_connection_args("client"))
    try:
        await comm.write({"op": "identity", "reply": True})
        return await comm.read()
    finally:
        comm.abort()


def _probe(d: ModuleType, address: str, timeout: float) -> Any:
    """The identity of whatever answers at ``address``, within ``timeout`` seconds (on an
    event loop of its own: dask's connect reads the handshake without a time limit)."""
    loop = asyncio.new_event_loop()
    try:
        # dask's own connect gives up at `timeout` with its reason (refused, unreachable);
        # the handshake and the identity it does not bound are cut off just after
        return loop.run_until_complete(asyncio.wait_for(_identity(d, address, timeout),
                                                        timeout + GRACE_SECONDS / 4))
    finally:
        loop.close()  # does not wait for a name lookup still running in its executor


def _scheduler_client(d: ModuleType, address: str, shown: str, timeout: float) -> Any:
    """A client of the scheduler at ``address`` once it has answered as one, within
    ``timeout`` (+ :data:`GRACE_SECONDS` for each of the probe and the client)."""
    late = f"--scheduler {shown}: no dask scheduler answered within {timeout:g} s"
    probe = _bounded(lambda: _probe(d, address, timeout), timeout + GRACE_SECONDS,
                     "refattn-scheduler-probe")
    if not probe.done or isinstance(probe.error, (TimeoutError, asyncio.TimeoutError)):
        raise RefAttnError(f"{late} (the connection was not answered)")
    if probe.error is not None:
        raise RefAttnError(f"{late} ({_one_line(probe.error)})")
    identity = probe.value
    kind = identity.get("type") if isinstance(identity, dict) else None
    if kind != "Scheduler":
        what = f"a dask {kind}" if kind in ("Worker", "Nanny") else "something else"
        raise RefAttnError(f"--scheduler {shown}: {what} answered, not a dask scheduler; "
                           "expected the scheduler's address (its log names it)")
    made = _bounded(lambda: d.Client(address, timeout=timeout, set_as_default=False),
                    timeout + GRACE_SECONDS, "refattn-scheduler-client")
    if made.done and made.error is None:
        return made.value
    reason = _one_line(made.error) if made.error is not None else "the client did not start"
    _forget_quietly(made)
    raise RefAttnError(f"{late} as a client ({reason})")


def _forget_quietly(outcome: _Outcome) -> None:
    """Drop a failed client construction: dask's ``Client.__del__`` of the half-built client
    would print a traceback on the way out, and its comms a warning each ("Closing dangling
    stream"), now or at exit; dask's comm logging stays at ERROR from here on."""
    logging.getLogger("distributed.comm").setLevel(logging.ERROR)
    hook = sys.unraisablehook
    sys.unraisablehook = lambda _: None
    try:
        outcome.error = outcome.value = None
        gc.collect()
    finally:
        sys.unraisablehook = hook


def _close_quietly(client: Any, timeout: float) -> None:
    """Close a scheduler's client, waiting at most about ``timeout`` (the work is done or
    already failed: a scheduler gone silent must not hold the command at its end)."""
    closing = _bounded(lambda: client.close(timeout=timeout), timeout + GRACE_SECONDS,
                       "refattn-scheduler-close")
    if closing.error is not None:
        _forget_quietly(closing)


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
