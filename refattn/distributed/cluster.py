"""Where the work runs: a local cluster of worker processes, a running scheduler, or here.

Owns :func:`dask_distributed` (the lazy import of ``dask.distributed`` with a clear message
when it is missing) and :func:`connect` (``--workers N``: a ``LocalCluster`` of N
single-threaded worker processes listening on 127.0.0.1 only, no dashboard; ``--scheduler
ADDR``: a client of a running scheduler, refused with a one-line error when nothing answers
within the timeout; neither: no client, the work runs in this process). A ``tls://`` scheduler
is reached with dask's own TLS settings for a client (its config: ``~/.config/dask/*.yaml`` or
the ``DASK_DISTRIBUTED__COMM__TLS__*`` variables), checked before anything connects. The
cluster is trusted completely: dask moves pickles both ways, so whoever runs the scheduler or a
worker runs code in this process (TLS keeps out whoever holds no certificate of its CA).

Every wait on the network is bounded: the address is checked before anything connects (a
scheme dask does not know, a missing port), the scheduler must complete dask's handshake and
answer an ``identity`` request within ``timeout`` (a probe on its own event loop in a daemon
thread, so a listener that accepts and never answers, an HTTP server or a worker cannot hold
the command), and the client itself is built under the same watchdog. The number of local
worker processes is refused above the CPU cores this process may use.

Once the work is submitted, :class:`Watchdog` bounds every wait for it: results are awaited a
tick at a time, the scheduler is asked for its identity in the background every
:data:`HEARTBEAT_SECONDS` (a scheduler that leaves one request unanswered for ``timeout``
seconds, e.g. a paused process, ends the wait), and a task that gives no result within its
bound (its cases' estimated seconds times :data:`SAFETY_FACTOR`, plus
:data:`STARTUP_SECONDS` and ``timeout``) ends it too, in one line naming the scheduler, what
was awaited and for how long.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import numbers
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from refattn._boundary import public
from refattn.errors import RefAttnError

__all__ = ["DEFAULT_TIMEOUT", "SAFETY_FACTOR", "STARTUP_SECONDS", "Watchdog", "connect",
           "dask_distributed", "usable_cores", "worker_threads"]

#: seconds to wait for a scheduler (or a local cluster) to answer
DEFAULT_TIMEOUT = 10.0
#: seconds a connection attempt may run past ``timeout`` before it is abandoned (its thread is
#: a daemon: it never holds the process at exit)
GRACE_SECONDS = 2.0
#: address schemes a scheduler may be reached by (``inproc`` reaches only this process)
_SCHEMES = ("tcp", "tls", "ws", "wss", "ucx")
#: a task's estimated seconds (measured on an idle 2-core machine) times this is the longest
#: its result is awaited (a loaded machine runs several times slower; no result at all is
#: what this catches)
SAFETY_FACTOR = 20.0
#: seconds added to every task's bound: a fresh worker imports refattn and its stack first
STARTUP_SECONDS = 60.0
#: seconds between two background requests for the scheduler's identity while results are
#: awaited (at most; ``timeout / 3`` when that is shorter)
HEARTBEAT_SECONDS = 5.0
#: seconds of one wait for a result before the watchdog looks again
_TICK = 0.1


@public
def dask_distributed() -> ModuleType:
    """``dask.distributed``, imported on first use.

    Raises
    ------
    RefAttnError
        When dask's distributed scheduler is not installed.

    Examples
    --------
    >>> import pytest; _ = pytest.importorskip("distributed")
    >>> dask_distributed().__name__
    'distributed'
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


@public
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
        Address of a running scheduler (``tcp://host:port``, ``tls://host:port``); the
        cluster is left running. Whatever listens there must answer as a dask scheduler
        within ``timeout``. A ``tls://`` (or ``wss://``) address needs dask's TLS settings
        for a client in its config (a CA file and a certificate with its key).
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
        address dask cannot reach a scheduler by, a ``tls://`` address without readable TLS
        settings, or no scheduler answering in time (a silent listener, an HTTP server, a
        worker, a TLS handshake refused: each named in one line).

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
        _check_tls_settings(d, address, shown)
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


#: dask's TLS settings for a client: (config key, the environment variable that sets it)
_TLS_SETTINGS = (
    ("distributed.comm.tls.ca-file", "DASK_DISTRIBUTED__COMM__TLS__CA_FILE"),
    ("distributed.comm.tls.client.cert", "DASK_DISTRIBUTED__COMM__TLS__CLIENT__CERT"),
    ("distributed.comm.tls.client.key", "DASK_DISTRIBUTED__COMM__TLS__CLIENT__KEY"),
)


def _check_tls_settings(d: ModuleType, address: str, shown: str) -> None:
    """For a ``tls://`` or ``wss://`` scheduler: dask's TLS settings for a client (its config,
    e.g. the ``DASK_DISTRIBUTED__COMM__TLS__*`` variables) name a CA file and a certificate
    (the key may follow the certificate in its file), every file named is readable, and they
    load, all before anything connects. Other schemes are left to dask (which refuses them
    when ``distributed.comm.require-encryption`` is set)."""
    from distributed.comm.addressing import parse_address

    scheme = parse_address(address)[0]
    if scheme not in ("tls", "wss"):
        return
    import dask

    where = (f"--scheduler {shown}: a {scheme}:// scheduler needs dask's TLS settings for a "
             "client")
    names = ", ".join(env for _, env in _TLS_SETTINGS)
    missing = [key for key, _ in _TLS_SETTINGS[:2] if not dask.config.get(key, None)]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise RefAttnError(f"{where}, and {' and '.join(missing)} {verb} not set: set {names} "
                           "(or distributed.comm.tls in a dask config file, "
                           "~/.config/dask/*.yaml); see docs/tutorials/dask.md")
    for key, env in _TLS_SETTINGS:
        value = dask.config.get(key, None)
        if not value or not isinstance(value, str) or "\n" in value:  # unset, or PEM text
            continue
        shown_path = value if value.isprintable() and len(value) <= 200 else ascii(value[:200])
        problem = ("no such file" if not os.path.exists(value) else
                   "not a regular file" if not os.path.isfile(value) else
                   "not readable" if not os.access(value, os.R_OK) else None)
        if problem is not None:
            raise RefAttnError(f"{where}: {key} ({env}) is {shown_path}: {problem}")
    try:
        d.Security().get_connection_args("client")
    except (OSError, ValueError, TypeError) as exc:  # ssl.SSLError is an OSError
        raise RefAttnError(f"{where}: they do not load ({_one_line(exc)}); expected PEM "
                           f"files: the cluster's CA, a certificate it signed and that "
                           f"certificate's key ({names})") from None


class _Outcome:
    """What a call run under :func:`_bounded` returned or raised (``done``: it finished)."""

    def __init__(self) -> None:
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None


def _background(what: Callable[[], Any], name: str) -> tuple[_Outcome, threading.Thread]:
    """Start ``what()`` in a daemon thread; its :class:`_Outcome` says when it is done."""
    outcome = _Outcome()

    def run() -> None:
        try:
            outcome.value = what()
        except BaseException as exc:  # handed to the caller, who names it
            outcome.error = exc
        outcome.done = True

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return outcome, thread


def _bounded(what: Callable[[], Any], seconds: float, name: str) -> _Outcome:
    """Run ``what()`` in a daemon thread and wait for it at most ``seconds``: a wait on the
    network that ignores its own timeout cannot hold the caller, nor the process at exit."""
    outcome, thread = _background(what, name)
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


def worker_threads(client: Any, timeout: float = DEFAULT_TIMEOUT, command: str = "dask") -> int:
    """Total worker threads of a client's cluster (1 without a client).

    The scheduler is asked within ``timeout`` seconds (a silent one is a
    :class:`~refattn.errors.RefAttnError` naming it, prefixed with ``command``).

    Examples
    --------
    >>> worker_threads(None)
    1
    """
    if client is None:
        return 1
    counts = Watchdog(client, timeout, command).call(client.nthreads,
                                                     "the number of worker threads")
    return max(1, sum(counts.values()))


def _address(client: Any) -> str:
    try:
        address = str(client.scheduler.address)
    except Exception:  # a client without a scheduler rpc: named as dask names it
        address = "?"
    return address if address.isprintable() and len(address) <= 200 else ascii(address[:200])


class Watchdog:
    """Bounded waits on the futures of a dask client (``refattn sweep``/``verify`` on dask).

    Parameters
    ----------
    client : distributed.Client
    timeout : float
        Seconds the scheduler may leave a request unanswered (``--timeout``).
    command : str
        Names the waiting command in messages (``"sweep"``, ``"verify"``).
    resume : str
        Appended to every message (what the user can do: e.g. rerun to resume).

    Examples
    --------
    >>> Watchdog.task_bound(1.5, timeout=10) == 1.5 * SAFETY_FACTOR + STARTUP_SECONDS + 10
    True
    """

    def __init__(self, client: Any, timeout: float, command: str, resume: str = "") -> None:
        self.client = client
        self.timeout = _timeout(timeout)
        self.command = command
        self.resume = resume
        self.address = _address(client)
        self.interval = min(HEARTBEAT_SECONDS, self.timeout / 3)
        self.silent = False  # set once the scheduler has been found silent
        self._beat: _Outcome | None = None
        self._beat_started = 0.0
        self._last_answer = time.monotonic()

    @staticmethod
    def task_bound(estimated_seconds: float, timeout: float) -> float:
        """Longest wait for a task estimated to take ``estimated_seconds`` (see module doc)."""
        return SAFETY_FACTOR * max(0.0, float(estimated_seconds)) + STARTUP_SECONDS + timeout

    def _fail(self, what: str) -> RefAttnError:
        tail = f"; {self.resume}" if self.resume else ""
        return RefAttnError(f"{self.command}: {what}{tail}")

    def check(self, waiting_for: str, since: float) -> None:
        """Raise when the scheduler has left a request unanswered for ``timeout`` seconds, or
        its connection is lost; start the next background request when one is due."""
        now = time.monotonic()
        beat = self._beat
        status = getattr(self.client, "status", "running")
        if status in ("closing", "closed"):
            self.silent = True
            raise self._fail(f"the connection to the dask scheduler at {self.address} was "
                             f"lost while waiting for {waiting_for} (after "
                             f"{now - since:.1f} s)")
        if beat is not None and beat.done:
            self._beat = None
            if beat.error is not None:
                self.silent = True
                raise self._fail(f"the dask scheduler at {self.address} failed while waiting "
                                 f"for {waiting_for} (after {now - since:.1f} s: "
                                 f"{type(beat.error).__name__}: {_one_line(beat.error)})")
            self._last_answer = now
        elif beat is not None and now - self._beat_started > self.timeout:
            self.silent = True
            raise self._fail(f"the dask scheduler at {self.address} did not answer for "
                             f"{now - self._beat_started:.1f} s (--timeout {self.timeout:g}) "
                             f"while waiting for {waiting_for}, for {now - since:.1f} s")
        if self._beat is None and now - self._last_answer >= self.interval:
            self._beat, _ = _background(self.client.scheduler_info, "refattn-heartbeat")
            self._beat_started = now

    def call(self, what: Callable[[], Any], name: str) -> Any:
        """``what()`` (a request to the scheduler), given up after ``timeout`` seconds."""
        t0 = time.monotonic()
        outcome = _bounded(what, self.timeout, "refattn-request")
        if not outcome.done:
            self.silent = True
            raise self._fail(f"the dask scheduler at {self.address} did not answer for "
                             f"{time.monotonic() - t0:.1f} s (--timeout {self.timeout:g}) "
                             f"while asking for {name}")
        if outcome.error is not None:
            raise outcome.error
        return outcome.value

    def completed(self, bounds: dict[Any, float], what: str) -> Iterator[Any]:
        """The futures of ``bounds`` (future -> its longest wait, s) as they complete.

        Between two completions the wait is bounded by the largest bound among the futures
        not yet returned (the next to finish is running and within its own bound); the
        scheduler is watched all along (:meth:`check`).
        """
        d = dask_distributed()
        pending = dict(bounds)
        ac = d.as_completed(list(pending), loop=self.client.loop)
        since = time.monotonic()
        while not ac.is_empty():
            if ac.has_ready():
                future = next(ac)
                pending.pop(future, None)
                yield future
                since = time.monotonic()
                continue
            time.sleep(_TICK)
            self.check(f"{what} ({len(pending)} pending)", since)
            limit = max(pending.values(), default=0.0)
            waited = time.monotonic() - since
            if waited > limit:
                raise self._fail(f"no result from the workers of the dask scheduler at "
                                 f"{self.address} for {waited:.0f} s while waiting for {what} "
                                 f"({len(pending)} pending; bound {limit:.0f} s: the slowest "
                                 f"pending task's estimate x {SAFETY_FACTOR:g} + "
                                 f"{STARTUP_SECONDS:g} s + --timeout)")

    def result(self, future: Any, bound: float, what: str) -> Any:
        """``future.result()`` of a completed future, fetched in ticks under :meth:`check`."""
        if getattr(future, "status", None) == "error":
            return future.result()  # raises the task's error, held here already
        since = time.monotonic()
        while True:
            try:
                return future.result(timeout=max(_TICK, min(1.0, self.timeout / 3)))
            except (TimeoutError, asyncio.TimeoutError):
                if getattr(future, "status", None) == "error":
                    raise
            self.check(f"the result of {what}", since)
            waited = time.monotonic() - since
            if waited > bound:
                raise self._fail(f"the result of {what} did not arrive from the dask "
                                 f"scheduler at {self.address} within {waited:.0f} s")

    def cancel(self, futures: Iterable[Any]) -> None:
        """Cancel what is left, waiting at most ``timeout`` (nothing once found silent)."""
        left = [f for f in futures if not f.done()]
        if left and not self.silent:
            _bounded(lambda: self.client.cancel(left), self.timeout, "refattn-cancel")
