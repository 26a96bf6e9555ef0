"""The public surface, enumerated and fuzzed: generated from the signatures and the examples.

The entry points are every callable in the ``__all__`` of refattn's public modules (and
gradcheck's); honest arguments for each come from its own documentation: the doctests of the
module that defines it run once with a profiler that records the arguments of every call into
an entry point (``sys.setprofile``: the frame's locals at entry are the bound arguments). A new
public function with a doctest is covered without editing this file; one without an honest
example is listed as uncovered.

Each entry point is then called with its honest arguments, and again with one parameter at a
time replaced by each boundary value of the issue (0, -1, 2**31, 2**63 - 1, 2**64, 2**70,
10**400, a 5,000-digit integer, NaN, +-inf, 1e300, a subnormal, a ragged list, 0-d and empty
arrays, float32 and integer arrays, None). The contract (:func:`outcome`): a ``RefAttnError``
(``GradcheckError`` for gradcheck's generic checker), or a normal return with no NaN or +inf
in the result and peak memory at most twice the honest call's (plus 64 MiB of slack for the
interpreter); never another exception, never longer than :data:`CALL_SECONDS`.
"""

from __future__ import annotations

import collections
import dataclasses
import doctest
import importlib
import inspect
import signal
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

#: the public modules whose ``__all__`` is the surface
MODULES = ("refattn", "refattn.masks", "refattn.dropout", "refattn.softmax", "refattn.rope",
           "refattn.states", "refattn.call", "refattn.engine", "refattn.analysis",
           "refattn.quant", "refattn.sparse", "refattn.bundle", "refattn.testing",
           "refattn.adapters", "refattn.adapters.flash_attn", "refattn.adapters.flash_mla",
           "refattn.adapters.sparse", "refattn.adapters.rope_diagnosis", "refattn.adapters.flex",
           "refattn.adapters.jax", "refattn.adapters.onnx", "refattn.adapters.plain",
           "refattn.adapters.torch", "refattn.distributed", "gradcheck")
#: seconds one fuzzed call may take (a hang is reported past it)
CALL_SECONDS = 20.0
#: memory a fuzzed call may use beyond twice its honest call's peak (the interpreter's own)
SLACK_BYTES = 64 << 20
#: honest calls kept per entry point
KEEP = 2
#: entry points that move values without computing with them: NaN in, NaN out in its place
MOVES_VALUES = frozenset({"refattn.masks.packing.pack", "refattn.masks.packing.unpack"})


class Entry(NamedTuple):
    """One public entry point: its dotted name, the object and its signature."""

    key: str
    obj: Callable[..., Any]
    signature: inspect.Signature


def entries() -> dict[str, Entry]:
    """Every callable named in the ``__all__`` of :data:`MODULES` (classes by their
    constructor), keyed by the dotted name of its definition."""
    out: dict[str, Entry] = {}
    for name in MODULES:
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", ()):
            obj = getattr(module, attr)
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue  # a type alias, a constant
            if inspect.isclass(obj) and (issubclass(obj, (tuple, BaseException))
                                         or inspect.isabstract(obj)
                                         or obj.__init__ is object.__init__):
                continue  # a result record (named tuple), an exception or an interface
            key = f"{getattr(obj, '__module__', name)}.{getattr(obj, '__qualname__', attr)}"
            try:
                sig = inspect.signature(obj)
            except (TypeError, ValueError):
                continue
            out.setdefault(key, Entry(key, obj, sig))
    return out


def _code(obj: Any) -> Any:
    fn = obj.__init__ if inspect.isclass(obj) else obj
    return getattr(inspect.unwrap(fn), "__code__", None)


def capture(found: dict[str, Entry]) -> dict[str, list[dict[str, Any]]]:
    """Honest arguments of each entry point, recorded while the doctests of the modules that
    define them run (the first :data:`KEEP` calls each)."""
    codes = {c: key for key, e in found.items() if (c := _code(e.obj)) is not None}
    files = {c.co_filename for c in codes}
    calls: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            key = codes.get(frame.f_code)
            if key is not None and len(calls[key]) < KEEP:
                calls[key].append(dict(frame.f_locals))

    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    modules = sorted(n for n, m in list(sys.modules.items())
                     if getattr(m, "__file__", None) in files)
    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        for name in modules:
            for test in finder.find(sys.modules[name]):
                runner.run(test, out=lambda s: None, clear_globs=False)  # its lambdas live on
    finally:
        sys.setprofile(previous)
    return dict(calls)


def _ints() -> list[tuple[str, Any]]:
    return [("0", 0), ("-1", -1), ("2**31", 2**31), ("2**63-1", 2**63 - 1), ("2**64", 2**64),
            ("2**70", 2**70), ("10**400", 10**400), ("5000 digits", 7 * 10**4999)]


def boundary_values(honest: Any) -> Iterator[tuple[str, Any]]:
    """The boundary values put in place of an honest argument (fresh objects each time)."""
    yield from _ints()
    yield from [("nan", float("nan")), ("inf", float("inf")), ("-inf", float("-inf")),
                ("1e300", 1e300), ("subnormal", 5e-324), ("None", None)]
    yield ("ragged", [[1.0, 2.0], [3.0]])
    yield ("0-d", np.array(1.0))
    yield ("empty", np.zeros((0,)))
    if isinstance(honest, np.ndarray) and honest.dtype.kind == "f" and honest.size:
        yield ("float32", honest.astype(np.float32))
        yield ("int64", np.ones(honest.shape, dtype=np.int64))
        bad = np.array(honest, dtype=np.float64)
        bad.reshape(-1)[0] = np.nan
        yield ("nan in array", bad)
    else:
        yield ("float32 array", np.ones((1, 2, 3, 4), dtype=np.float32))


class Hang(Exception):
    """A fuzzed call ran past its time limit."""


def _alarm(signum: int, frame: Any) -> None:
    raise Hang()


def call(entry: Entry, arguments: dict[str, Any], seconds: float = CALL_SECONDS
         ) -> tuple[Any, BaseException | None, int, float]:
    """``entry`` called with ``arguments`` (bound by name; ``*args``/``**kwargs`` unpacked):
    (result, exception or None, peak traced bytes, seconds)."""
    params = list(entry.signature.parameters.values())
    star = any(p.kind is p.VAR_POSITIONAL for p in params)
    pos: list[Any] = []
    kw: dict[str, Any] = {}
    for p in params:
        if p.name not in arguments:
            continue
        value = arguments[p.name]
        if p.kind is p.VAR_POSITIONAL:
            pos.extend(value)
        elif p.kind is p.VAR_KEYWORD:
            kw.update(value)
        elif p.kind is p.POSITIONAL_ONLY or (star and p.kind is p.POSITIONAL_OR_KEYWORD):
            pos.append(value)  # before *args, by position
        else:
            kw[p.name] = value
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    tracemalloc.start()
    tracemalloc.reset_peak()
    t0 = time.perf_counter()
    result, error = None, None
    try:
        result = entry.obj(*pos, **kw)
    except Hang as exc:
        error = exc
    except BaseException as exc:  # every outcome is classified by the caller
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        error = exc
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return result, error, peak, elapsed


def arrays(x: Any, depth: int = 0) -> Iterator[np.ndarray]:
    """The float arrays inside a result (tuples, named tuples, dataclasses, dicts)."""
    if depth > 4:
        return
    if isinstance(x, np.ndarray):
        if x.dtype.kind == "f":
            yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from arrays(v, depth + 1)
    elif isinstance(x, (tuple, list)):
        for v in x[:64]:
            yield from arrays(v, depth + 1)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            yield from arrays(getattr(x, f.name, None), depth + 1)


def nonfinite(result: Any) -> tuple[bool, bool]:
    """Whether the float arrays of a result hold a NaN, and a +inf."""
    found = [(bool(np.isnan(a).any()), bool(np.isposinf(a).any())) for a in arrays(result)]
    return any(n for n, _ in found), any(p for _, p in found)


def outcome(result: Any, error: BaseException | None, peak: int, honest_peak: int,
            allowed: tuple[type[BaseException], ...], *,
            honest_nonfinite: tuple[bool, bool] | None = (False, False)) -> str | None:
    """None where the call kept the contract, else what broke it. ``honest_nonfinite``: whether
    the honest call's answer held a NaN and a +inf (its documented form: the logit gap of a
    one-key row, a naive softmax's empty row); a kind it did not hold is a silent wrong answer.
    None: the result is not an answer (a constructed record holds what it was given)."""
    if isinstance(error, Hang):
        return f"no answer within {CALL_SECONDS:g} s"
    if error is not None:
        if isinstance(error, allowed):
            return None
        return f"{type(error).__name__}: {str(error)[:160]}"
    if honest_nonfinite is not None:
        nan, inf = nonfinite(result)
        if (nan and not honest_nonfinite[0]) or (inf and not honest_nonfinite[1]):
            return "a NaN or +inf in the result (a silent wrong answer)"
    if peak > 2 * honest_peak + SLACK_BYTES:
        return f"peak memory {peak >> 20} MiB, the honest call's {honest_peak >> 20} MiB"
    return None


def allowed(entry: Entry) -> tuple[type[BaseException], ...]:
    """The exceptions that keep the contract: the package's own error, and for an ``assert_*``
    function the ``AssertionError`` that is its answer."""
    from gradcheck.errors import GradcheckError
    from refattn.errors import RefAttnError

    name = entry.key.rsplit(".", 1)[-1]
    return (RefAttnError, GradcheckError) + ((AssertionError,) if name.startswith("assert_")
                                              else ())


def fuzz(found: dict[str, Entry], calls: dict[str, list[dict[str, Any]]]
         ) -> tuple[dict[str, int], list[str]]:
    """Every captured entry point called with each boundary value in place of each parameter:
    the counts (entry points, parameters, calls, refused, answered) and the findings."""
    findings: list[str] = []
    counts = dict.fromkeys(("entry points", "parameters", "calls", "refused", "answered"), 0)
    for key in sorted(calls):
        entry = found[key]
        honest = None
        for arguments in calls[key]:
            result, error, peak, _ = call(entry, arguments)
            if error is None:
                honest = (arguments, peak, nonfinite(result))
                break
        if honest is None:  # documented only failing: every mutation must still be refused
            honest = (calls[key][0], 0, (False, False))
        arguments, honest_peak, flags = honest
        answer = not inspect.isclass(entry.obj) and key not in MOVES_VALUES
        counts["entry points"] += 1
        for name, p in entry.signature.parameters.items():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or name not in arguments:
                continue
            counts["parameters"] += 1
            for label, value in boundary_values(arguments[name]):
                result, error, peak, seconds = call(entry, {**arguments, name: value})
                counts["calls"] += 1
                counts["refused" if error is not None else "answered"] += 1
                broke = outcome(result, error, peak, honest_peak, allowed(entry),
                                honest_nonfinite=flags if answer else None)
                if broke:
                    findings.append(f"{key}({name}={label}): {broke} [{seconds:.2f} s]")
    return counts, findings


def main(out: str) -> int:
    """Enumerate, capture and fuzz in this process (under an address-space cap: the virtual
    memory at start plus 6 GiB) and write the figures as JSON to ``out``: the entry points,
    those with an honest example, the counts and the findings."""
    import json
    import resource

    found = entries()
    calls = capture(found)
    with open("/proc/self/statm") as fh:  # the first field: virtual pages
        vms = int(fh.read().split()[0]) * resource.getpagesize()
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    cap = vms + (6 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY
                                            else min(cap, hard), hard))
    counts, findings = fuzz(found, calls)
    with open(out, "w") as fh:
        json.dump({"entries": sorted(found), "captured": sorted(calls), "counts": counts,
                   "findings": findings}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
