"""A fuzzer of refattn's command-line surface generated from the parser and the schemas
(issue 40, deliverable 3): every option and positional of every subcommand, every field of a
sweep SPEC and every field of a bundle manifest gets boundary values; the contract is exit 0,
1 or 2, exactly one line on stderr for exit 2, never an uncaught exception, a hang, a file
left half-written or memory above twice an honest input's.

Nothing about the surface is hand-listed but an honest argument list per subcommand (on tiny
fixtures), an honest SPEC and the few manifest fields whose change is harmless by design
(:data:`HARMLESS_MANIFEST_FIELDS`). A new option, SPEC property or manifest field is fuzzed
without editing this module: the options come from :func:`refattn.cli.main.build_parser`,
the SPEC properties from ``sweep-v1.json``, the manifest fields from a written bundle.

The value set of an option follows its kind, read from the parser: flags appear and
disappear, choices get each choice and two outside, numbers (an option whose ``type`` turns
``"1"`` into a number) get :data:`NUMBERS` and :data:`TEXTS`, text options get those and
:data:`PATH_VALUES` as well. Everything runs in this process through
:func:`refattn.cli.main.main`, each call under ``SIGALRM`` (:data:`TIMEOUT_S`) and
``tracemalloc``, in a scratch directory of its own that is also the working directory (a
relative path lands there). The run order is fixed; nothing here is random.

This module holds no tests: tests/hostile/test_fuzz_cli.py runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import tracemalloc
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "EXCLUDED_OPTIONS",
    "EXCLUDED_VALUES",
    "HARMLESS_MANIFEST_FIELDS",
    "HONEST_ARGV",
    "HONEST_SPEC",
    "MULTI_LINE_BY_DESIGN",
    "NUMBERS",
    "PATH_VALUES",
    "TEXTS",
    "Finding",
    "Fixtures",
    "Outcome",
    "cli_actions",
    "fixtures",
    "fuzz_cli",
    "fuzz_manifest",
    "fuzz_spec",
    "manifest_leaves",
    "run_argv",
    "schema_properties",
    "spec_paths",
]

#: seconds one call may take before it counts as a hang
TIMEOUT_S = 60
#: memory a fuzzed call may use beyond twice its honest argument list's peak
SLACK_BYTES = 64 * 2**20

#: a 5,000-digit integer (more than Python's 4,300-digit str-to-int limit)
BIG_DIGITS = "9" * 5000
#: the numeric boundary values, as the command line spells them
NUMBERS: tuple[str, ...] = (
    "0", "-1", "2147483648", "9223372036854775807", "18446744073709551616",
    "1180591620717411303424", "1" + "0" * 400, BIG_DIGITS, "nan", "inf", "-inf", "1e300",
    "5e-324", "1e-310")
#: values no numeric option may accept: not a number, unbounded, or beyond float64
NEVER_A_NUMBER = frozenset({"nan", "inf", "-inf", "1" + "0" * 400, BIG_DIGITS})
#: the numbers a text option (a path, a name) gets: a few stand for all of them
TEXT_NUMBERS: tuple[str, ...] = ("0", "-1", "18446744073709551616", "nan", "1e300", BIG_DIGITS)
#: text boundary values (argv cannot hold NUL, so no "\\x00")
TEXTS: tuple[str, ...] = ("", "x" * 10_000)
#: path boundary values, resolved in each call's scratch directory
PATH_VALUES: tuple[str, ...] = ("@missing", "@file", "@empty_dir", "/dev/null")

#: an honest argument list per subcommand on the tiny fixtures: (positionals, options);
#: ``@name`` is a fixture (:class:`Fixtures`), ``@out`` a fresh path in the scratch directory
HONEST_ARGV: dict[str, tuple[list[str], list[str]]] = {
    "golden": ([], ["--suite", "contract", "--out", "@out", "--quiet"]),
    "sweep": (["@spec"], ["--out", "@out", "--quiet"]),
    "verify": (["@bundle"], ["--no-gradcheck", "--quiet"]),
    "compare": (["@case", "@candidate"], []),
    "plot": (["@case"], ["--out", "@out", "--quiet"]),
    "mask": ([], ["--q", "2", "--k", "3"]),
    "diagnostics": (["@case"], []),
    "gradcheck": ([], ["--shape", "1,1,1,2,2,2,2", "--mode", "directional", "--directions",
                       "1", "--quiet"]),
    "calibrate": ([], ["--show", "--repeats", "1"]),
    "yardstick": (["@bundle"], ["--dtype", "float32", "--out", "@out"]),
    "include-dir": ([], []),
}

#: options of the parser that get no boundary value, each with its reason
EXCLUDED_OPTIONS: dict[tuple[str, str], str] = {}

#: values of an option that are honest and slow, each with its reason (never run here)
EXCLUDED_VALUES: dict[tuple[str, str, str], str] = {
    ("golden", "--suite", "kernels"): "304 cases at kernel shapes, minutes of honest work "
    "(tests/bundle writes the kernels suite)",
}
#: argument lists whose exit 2 prints more than one line by design, with the reason
MULTI_LINE_BY_DESIGN: dict[tuple[str, ...], str] = {
    (): "refattn with no command prints the help on stderr and exits 2, like git "
    "(tests/cli/test_cli_polish.py pins it)",
}

#: manifest fields (dotted, ``*`` for any case id or tensor name) whose change verify may
#: accept (exit 0): provenance and free text that nothing is computed from
HARMLESS_MANIFEST_FIELDS: dict[str, str] = {
    "suite": "a label: verify checks cases, never which suite they came from",
    "generator": "provenance (refattn, numpy and BLAS versions, arithmetic notes): verify "
    "recomputes every case with the exact generator whatever the manifest claims",
    "cases.*.comment": "free text",
    "cases.*.flags": "free text, except the flags of FLAG_CHECKS, which only claim features "
    "(a removed or emptied flag claims less; a claim the call lacks is refused)",
    "cases.*.reference_error": "the generator's own error measurement, for reading: verify "
    "measures the error itself and never reads it",
    "cases.*.call.backend.framework_revision": "provenance: verify leaves it out of the "
    "rebuilt call's comparison",
}

#: the honest SPEC: a few tiny cases that between them hold every kind of mask, score,
#: dropout and the quantised fields, so a mutated SPEC that is valid stays cheap to run
HONEST_SPEC: dict[str, Any] = {
    "name": "fuzz",
    "version": 1,
    "description": "the generated fuzzer's honest SPEC",
    "defaults": {"generator": "exact", "seed": 0, "bias": "none", "scale": "default"},
    "grid": [{
        "shape": [[1, 1, 1, 2, 2, 2, 2]],
        "mask": ["none", {"kind": "causal", "alignment": "upper_left"},
                 {"kind": "key_padding", "pad": 1}, {"kind": "prefix", "length": 1},
                 {"kind": "segments", "count": 1, "causal": True}],
        "score": ["dot"], "scale": ["default"], "bias": ["none"], "dropout": ["none"],
        "seed": [0], "generator": ["exact"],
    }],
    "case": [
        {"shape": {"B": 1, "Hq": 1, "Hkv": 1, "Q": 2, "K": 2, "Dk": 2, "Dv": 2},
         "score": {"family": "cosine", "eps": 0.001},
         "scale": 0.5, "mask": {"kind": "window", "left": 1, "right": 0, "causal": True},
         "dropout": {"p": 0.25, "seed": 3, "offset": 1}, "bias": "random", "seed": 1,
         "generator": "exact"},
        {"shape": [1, 1, 1, 2, 2, 2, 2], "score": {"family": "bilinear", "shared": False}},
        {"shape": [1, 1, 1, 2, 2, 2, 2], "score": {"family": "additive", "da": 2}},
        {"shape": [1, 1, 1, 2, 2, 2, 2], "quant": "fa3_fp8", "quant_scale": 0.5,
         "quant_values": "random"},
    ],
}


class _Big:
    """A 5,000-digit integer literal for a SPEC or manifest (Python cannot print one)."""

    text = BIG_DIGITS

    def __repr__(self) -> str:
        return "a 5000-digit integer"


BIG = _Big()
#: boundary values of every JSON kind for SPEC and manifest fields, per kind of field (nan
#: and +/-inf: the TOML SPEC spells them, the manifest's JSON as NaN / Infinity, which a
#: strict reader refuses); a few values of other kinds stand for a type change
JSON_VALUES: dict[str, tuple[Any, ...]] = {
    "int": (0, -1, 2**31, 2**63 - 1, 2**64, 2**70, 10**400, BIG, 1e300, 5e-324, math.nan,
            math.inf, "", None, True),
    "float": (0, -1, 2**64, 2**70, 10**400, BIG, 1e300, 5e-324, 1e-310, math.nan, math.inf,
              -math.inf, "", None),
    "str": ("", "x" * 10_000, 0, 2**70, BIG, None, []),
    "bool": (0, 1, None, "true", 2**70),
    "null": (0, "", {}, True, BIG),
    "container": (0, -1, 2**70, BIG, math.nan, "", [], [1, [2]], {}, {"x": 1}, None, True),
}
#: values for a property added where the honest document leaves it out
ADDED_VALUES: tuple[Any, ...] = (0, -1, 2**70, BIG, math.inf, "", [], None)


def _json_kind(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "str"
    return "null" if v is None else "container"


def _same(a: Any, b: Any) -> bool:
    """Whether a substitution changes nothing (``0`` for ``0.0``, ``{}`` for ``{}``)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a is not BIG:
        return a == b
    return a is not BIG and b is not BIG and json.dumps(a) == json.dumps(b)


@dataclass(frozen=True)
class Finding:
    """One broken promise: where (an argv, a SPEC or manifest field), the value, what
    happened."""

    surface: str
    where: str
    value: str
    what: str

    def __str__(self) -> str:
        return f"[{self.surface}] {self.where} = {self.value}: {self.what}"


@dataclass
class Outcome:
    """What one in-process call did."""

    code: int | None
    out: str
    err: str
    error: str | None  # an uncaught exception or a hang
    peak: int  # bytes, tracemalloc


@dataclass
class Fixtures:
    """The tiny inputs every honest argument list reads, and the scratch root."""

    root: Path
    bundle: Path
    case: Path
    candidate: Path
    spec: Path
    cache: Path
    counter: int = 0
    peaks: dict[str, int] = field(default_factory=dict)

    def scratch(self) -> Path:
        """A fresh scratch directory holding the path values' targets."""
        self.counter += 1
        d = self.root / "runs" / f"{self.counter:05d}"
        d.mkdir(parents=True)
        (d / "file.txt").write_text("not what was asked for\n")
        (d / "empty").mkdir()
        return d

    def resolve(self, token: str, scratch: Path) -> str:
        """A token with ``@name`` placeholders replaced by paths."""
        named = {"@missing": scratch / "missing", "@file": scratch / "file.txt",
                 "@empty_dir": scratch / "empty", "@out": scratch / "out",
                 "@bundle": self.bundle, "@case": self.case, "@candidate": self.candidate,
                 "@spec": self.spec, "@bundlecopy": scratch / "bundle",
                 "@casecopy": scratch / "bundle" / "cases" / self.case.name,
                 "@specfile": next(scratch.glob("spec.*"), scratch / "spec.toml")}
        for key, path in named.items():
            if token == key:
                return str(path)
            if token.endswith("=" + key):
                return token[: -len(key)] + str(path)
        return token


def fixtures(root: Path) -> Fixtures:
    """Write the fixtures under ``root``: a one-case bundle, its case file, a candidate
    holding its forward tensors and a tiny SPEC.

    Parameters
    ----------
    root : Path
        An empty directory that the fuzz owns.

    Returns
    -------
    Fixtures
        The fixture paths.
    """
    from refattn.bundle import write_bundle
    from refattn.bundle.comparison.candidates import write_candidate
    from refattn.bundle.storage.read import load
    from refattn.bundle.suites import build_suite

    root.mkdir(parents=True, exist_ok=True)
    bundle = root / "bundle"
    write_bundle(bundle, build_suite("contract")[1:2], suite="contract", progress=False)
    case = next((bundle / "cases").glob("*.safetensors"))
    tensors = load(case).tensors
    candidate = root / "candidate.safetensors"
    write_candidate(candidate, {k: tensors[k] for k in ("output", "lse") if k in tensors})
    spec = root / "spec.toml"
    spec.write_text('name = "fuzz"\n[[grid]]\nshape = [[1, 1, 1, 2, 2, 2, 2]]\n')
    cache = root / "cache"
    cache.mkdir()
    return Fixtures(root, bundle, case, candidate, spec, cache)


# -- running one call ---------------------------------------------------------------------------
class _Hang(BaseException):
    """Raised by SIGALRM: the call ran past :data:`TIMEOUT_S`."""


@contextlib.contextmanager
def _environment(fx: Fixtures, cwd: Path) -> Iterator[None]:
    """The calibration cache in the fixtures, ``cwd`` the working directory."""
    old_cwd, old_cache = os.getcwd(), os.environ.get("REFATTN_CACHE_DIR")
    os.environ["REFATTN_CACHE_DIR"] = str(fx.cache)
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(old_cwd)
        if old_cache is None:
            os.environ.pop("REFATTN_CACHE_DIR", None)
        else:
            os.environ["REFATTN_CACHE_DIR"] = old_cache


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {key}")


class _PeakMeter:
    """The peak memory of one call: the resident set's high-water mark above its size at the
    start (Linux, after resetting the mark through /proc/self/clear_refs), else
    ``tracemalloc``'s peak (slower: it traces every allocation)."""

    def __init__(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current resident set
            self.start = _status("VmRSS")
            self.traced = False
        except OSError:
            tracemalloc.start()
            self.traced = True

    def peak(self) -> int:
        if self.traced:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            return peak
        return max(0, _status("VmHWM") - self.start)


def run_argv(argv: Sequence[str], *, timeout: float = TIMEOUT_S) -> Outcome:
    """Run ``refattn ARGV`` in this process under a timeout, capturing its output and the
    peak of the memory it allocated.

    Parameters
    ----------
    argv : sequence of str
        The arguments after ``refattn``.
    timeout : float
        Seconds before the call is interrupted and reported as a hang.

    Returns
    -------
    Outcome
        Exit code (a ``SystemExit`` counts as its code), stdout, stderr, an uncaught
        exception (or ``"hang"``) and the call's peak memory in bytes (:class:`_PeakMeter`).
    """
    from refattn.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    code: int | None = None
    error: str | None = None

    def alarm(signum: int, frame: Any) -> None:
        raise _Hang

    old = signal.signal(signal.SIGALRM, alarm)
    meter = _PeakMeter()
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a warning is not the contract's business
            try:
                code = main(list(argv))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except _Hang:
        error = f"hang: still running after {timeout:g} s"
    except BaseException as exc:  # every escape is a finding
        text = " ".join(str(exc).split())
        error = f"uncaught {type(exc).__name__}: {text[:200]}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        peak = meter.peak()
    return Outcome(code, out.getvalue(), err.getvalue(), error, peak)


def _listing(d: Path) -> dict[str, tuple[str, int]]:
    """Every entry under ``d``: its kind and size."""
    seen: dict[str, tuple[str, int]] = {}
    for base, dirs, files in os.walk(d):
        for name in dirs + files:
            p = os.path.join(base, name)
            st = os.lstat(p)
            kind = "d" if os.path.isdir(p) and not os.path.islink(p) else "f"
            seen[os.path.relpath(p, d)] = (kind, st.st_size if kind == "f" else 0)
    return seen


def _leftovers(listing: dict[str, tuple[str, int]]) -> list[str]:
    """Staging, resume and temporary entries of a bundle writer."""
    return sorted(p for p in listing if ".refattn-staging-" in p or ".refattn-resume-" in p
                  or (os.path.basename(p).startswith(".") and p.endswith(".tmp")))


def _judge(o: Outcome, before: dict[str, tuple[str, int]], after: dict[str, tuple[str, int]],
           baseline: int | None, *, allowed: tuple[int, ...] = (0, 1, 2)) -> list[str]:
    """The contract's verdicts on one call (empty: kept)."""
    problems: list[str] = []
    if o.error is not None:
        problems.append(o.error)
    elif o.code not in allowed:
        problems.append(f"exit {o.code} (expected one of {allowed}); stderr: "
                        f"{o.err.strip()[-200:]!r}")
    elif o.code == 2:
        lines = o.err.strip().splitlines()
        if len(lines) != 1 or not lines[0].strip():
            problems.append(f"exit 2 with {len(lines)} stderr lines: {o.err.strip()[:300]!r}")
    if "Traceback" in o.err:
        problems.append(f"a traceback on stderr: {o.err.strip()[-300:]!r}")
    if o.code not in (None, 0) or o.error is not None:  # nothing left half-written
        changed = sorted(set(before.items()) ^ set(after.items()))
        if changed:
            problems.append(f"exit {o.code} left the scratch directory changed: "
                            f"{sorted({p for p, _ in changed})[:5]}")
    else:
        rest = _leftovers(after)
        if rest:
            problems.append(f"exit 0 left {rest[:5]}")
    if baseline is not None and o.peak > 2 * baseline + SLACK_BYTES:
        problems.append(f"peak memory {o.peak / 2**20:.1f} MiB, above twice the honest "
                        f"{baseline / 2**20:.1f} MiB + {SLACK_BYTES // 2**20} MiB")
    return problems


def _call(fx: Fixtures, tokens: Sequence[str], baseline: int | None, *,
          allowed: tuple[int, ...] = (0, 1, 2),
          prepare: Callable[[Path], None] | None = None) -> tuple[Outcome, list[str]]:
    """One call in a fresh scratch directory; its outcome and broken promises."""
    scratch = fx.scratch()
    if prepare is not None:
        prepare(scratch)
    argv = [fx.resolve(t, scratch) for t in tokens]
    before = _listing(scratch)
    with _environment(fx, scratch):
        o = run_argv(argv)
    after = _listing(scratch)
    problems = _judge(o, before, after, baseline, allowed=allowed)
    if not problems:
        shutil.rmtree(scratch, ignore_errors=True)
    return o, problems


def _shown(value: str) -> str:
    if len(value) > 40:
        return f"{value[:12]!r}... ({len(value)} characters)"
    return repr(value)


# -- the command line ---------------------------------------------------------------------------
def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _name(action: argparse.Action) -> str:
    """An action's name: its long option string, or its dest for a positional."""
    if not action.option_strings:
        return action.dest
    longs = [s for s in action.option_strings if s.startswith("--")]
    return (longs or action.option_strings)[-1]


def _kind(action: argparse.Action) -> str:
    """``flag``, ``choice``, ``number`` or ``text``, read from the action itself."""
    if action.nargs == 0:
        return "flag"
    if action.choices is not None:
        return "choice"
    kind = "text"
    if action.type is not None:
        for probe in ("1", "1,1,1,1,1,1,1"):
            try:
                value = action.type(probe)
            except (argparse.ArgumentTypeError, ValueError, TypeError):
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                kind = "number"
            break
    return kind


def cli_actions() -> dict[str, list[argparse.Action]]:
    """Every subcommand's actions (options and positionals), read from the parser.

    Returns
    -------
    dict
        Subcommand name to its parser's actions, in the parser's order.
    """
    from refattn.cli.main import build_parser

    return {name: list(p._actions) for name, p in _subparsers(build_parser()).choices.items()}


def _values(action: argparse.Action) -> list[str]:
    kind = _kind(action)
    if kind == "choice":
        return [str(c) for c in action.choices] + ["not-a-choice", ""]  # type: ignore[union-attr]
    if kind == "number":
        return [*NUMBERS, *TEXTS]
    return [*TEXT_NUMBERS, *TEXTS, *PATH_VALUES]


def _variants(command: str, action: argparse.Action) -> Iterator[tuple[str, list[str]]]:
    """(value shown, argv tokens) for each boundary value of one action."""
    positionals, options = HONEST_ARGV[command]
    pos_actions = [a for a in cli_actions()[command] if not a.option_strings]
    strings = set(action.option_strings)

    def without(opts: list[str], n: int) -> tuple[list[str], bool]:
        """``opts`` without the action's occurrences (and their ``n`` values)."""
        kept, i, found = [], 0, False
        while i < len(opts):
            head = opts[i].split("=", 1)[0]
            if head in strings:
                found = True
                i += 1 if "=" in opts[i] else 1 + n
                continue
            kept.append(opts[i])
            i += 1
        return kept, found

    def argv(opts: list[str], pos: list[str]) -> list[str]:
        return [command, *opts, "--", *pos] if pos else [command, *opts]

    if not action.option_strings:  # a positional: replace it (a nargs="+" one: all of it)
        j = [a.dest for a in pos_actions].index(action.dest)
        for v in _values(action):
            pos = list(positionals)
            if action.nargs in ("+", "*"):
                pos[j:] = [v]
            else:
                pos[j] = v
            yield v, argv(list(options), pos)
        return
    long = _name(action)
    if action.nargs == 0:  # a flag appears, or disappears
        rest, found = without(list(options), 0)
        yield ("absent" if found else "present"), argv(
            rest if found else [*options, long], list(positionals))
        return
    n = action.nargs if isinstance(action.nargs, int) else 1
    for v in _values(action):
        rest, _ = without(list(options), n)
        if isinstance(action, argparse._AppendAction):
            rest = list(options)
        tail = [f"{long}={v}"] if n == 1 else [long, *([v] * n)]
        yield v, argv([*rest, *tail], list(positionals))


def _honest(command: str) -> list[str]:
    positionals, options = HONEST_ARGV[command]
    return [command, *options, "--", *positionals] if positionals else [command, *options]


def fuzz_cli(fx: Fixtures, *, commands: Sequence[str] | None = None
             ) -> tuple[dict[str, Any], list[Finding]]:
    """Give every option and positional of every subcommand each boundary value of its kind.

    Parameters
    ----------
    fx : Fixtures
        From :func:`fixtures`.
    commands : sequence of str, optional
        Only these subcommands (default: every one the parser has).

    Returns
    -------
    counts : dict
        ``runs`` (calls made), ``reached`` (the set of ``"command option"`` given at least
        one value), ``actions`` (every ``"command option"`` of the parser) and ``exits``
        (calls per exit code).
    findings : list of Finding
        Every broken promise, in run order.
    """
    findings: list[Finding] = []
    reached: set[str] = set()
    every: set[str] = set()
    exits: dict[str, int] = {}
    runs = 0
    actions = cli_actions()
    for tokens in ([], ["--version"], ["-h"], ["not-a-command"]):  # the top-level parser
        o, problems = _call(fx, tokens, None)
        runs += 1
        if tuple(tokens) in MULTI_LINE_BY_DESIGN and o.code == 2:
            problems = [p for p in problems if not p.startswith("exit 2 with")]
        findings += [Finding("cli", f"refattn {' '.join(tokens)}", "-", p) for p in problems]
    for command in commands or list(actions):
        started = len(findings), runs, time.perf_counter()
        if command not in HONEST_ARGV:
            findings.append(Finding("cli", command, "-", "no honest argv for this subcommand "
                                    "(add one to HONEST_ARGV)"))
            continue
        if command == "calibrate" and not (fx.cache / "calibration.json").exists():
            _call(fx, ["calibrate", "--repeats", "1"], None)
        o, problems = _call(fx, _honest(command), None)
        runs += 1
        if o.code != 0 or problems:
            findings.append(Finding("cli", " ".join(_honest(command)), "honest",
                                    f"exit {o.code}: {problems or o.err.strip()[-200:]}"))
        fx.peaks[command] = o.peak
        for action in actions[command]:
            key = (command, _name(action))
            every.add(" ".join(key))
            if key in EXCLUDED_OPTIONS:
                continue
            kind = _kind(action)
            for shown, tokens in _variants(command, action):
                if (command, _name(action), shown) in EXCLUDED_VALUES:
                    continue
                # a flag toggled and a listed choice are honest argument lists themselves
                # (another backend, the real calibration): they set their own memory
                honest = kind == "flag" or (kind == "choice" and shown in map(
                    str, action.choices or ()))
                o, problems = _call(fx, tokens, None if honest else fx.peaks[command])
                runs += 1
                reached.add(" ".join(key))
                exits[str(o.code)] = exits.get(str(o.code), 0) + 1
                if kind == "number" and shown in NEVER_A_NUMBER and o.code != 2 and not problems:
                    problems = [f"exit {o.code}: accepted as a number"]
                findings += [Finding("cli", f"refattn {command} {_name(action)}", _shown(shown),
                                     p) for p in problems]
        if os.environ.get("REFATTN_FUZZ_VERBOSE"):
            print(f"{command}: {runs - started[1]} runs, {len(findings) - started[0]} "
                  f"finding(s), {time.perf_counter() - started[2]:.1f} s", file=sys.__stderr__)
    return {"runs": runs, "reached": reached, "actions": every, "exits": exits}, findings


# -- the sweep SPEC -----------------------------------------------------------------------------
def _resolve(schema: dict[str, Any], node: Any) -> Any:
    if isinstance(node, dict) and "$ref" in node:
        return _resolve(schema, schema["$defs"][node["$ref"].rsplit("/", 1)[1]])
    return node


def schema_properties(schema: dict[str, Any], node: Any) -> set[str]:
    """Every property name a schema node allows at an object, through ``$ref``, ``allOf``,
    ``anyOf``, ``oneOf`` and both branches of ``if``/``then``/``else``.

    Parameters
    ----------
    schema : dict
        The whole schema (its ``$defs`` resolve references).
    node : object
        A schema node.

    Returns
    -------
    set of str
        The property names (an over-approximation: a name one branch allows).
    """
    node = _resolve(schema, node)
    if not isinstance(node, dict):
        return set()
    names = set(node.get("properties", {}))
    for key in ("allOf", "anyOf", "oneOf"):
        for sub in node.get(key, []):
            names |= schema_properties(schema, sub)
    for key in ("then", "else"):
        if key in node:
            names |= schema_properties(schema, node[key])
    return names


def _all_property_names(schema: dict[str, Any]) -> set[str]:
    """Every property name anywhere in the schema."""
    names: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            names.update(node.get("properties", {}))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(schema)
    return names


def _child_schema(schema: dict[str, Any], node: Any, key: str | int) -> Any:
    """The schema nodes (a list of alternatives) of ``node``'s child ``key``."""
    node = _resolve(schema, node)
    found: list[Any] = []
    if not isinstance(node, dict):
        return found
    if isinstance(key, str) and key in node.get("properties", {}):
        found.append(node["properties"][key])
    if isinstance(key, int) and "items" in node:
        found.append(node["items"])
    for k in ("allOf", "anyOf", "oneOf"):
        for sub in node.get(k, []):
            found += _child_schema(schema, sub, key)
    for k in ("then", "else"):
        if k in node:
            found += _child_schema(schema, node[k], key)
    return found


def spec_paths(doc: Any, schema: dict[str, Any]
               ) -> tuple[list[tuple[Any, ...]], list[tuple[tuple[Any, ...], str]]]:
    """Every path of the honest SPEC (containers and leaves), and every ``(object path,
    property)`` the schema allows there but the SPEC leaves out.

    Parameters
    ----------
    doc : object
        The honest SPEC.
    schema : dict
        ``sweep-v1.json``.

    Returns
    -------
    paths : list of tuple
        Paths (keys and list indices) in document order, the root left out.
    absent : list of tuple
        ``(path of an object, property name)`` pairs.
    """
    paths: list[tuple[Any, ...]] = []
    absent: list[tuple[tuple[Any, ...], str]] = []

    def walk(value: Any, path: tuple[Any, ...], nodes: list[Any]) -> None:
        if path:
            paths.append(path)
        if isinstance(value, dict):
            allowed: set[str] = set()
            for n in nodes:
                allowed |= schema_properties(schema, n)
            absent.extend((path, name) for name in sorted(allowed - set(value)))
            for k, v in value.items():
                walk(v, (*path, k), [c for n in nodes for c in _child_schema(schema, n, k)])
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, (*path, i), [c for n in nodes for c in _child_schema(schema, n, i)])
    walk(doc, (), [schema])
    return paths, absent


def _toml_value(v: Any) -> str:
    if v is BIG:
        return BIG_DIGITS
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) \
            else repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"no TOML for {v!r}")


def _has(v: Any, what: Callable[[Any], bool]) -> bool:
    if what(v):
        return True
    if isinstance(v, dict):
        return any(_has(x, what) for x in v.values())
    if isinstance(v, list):
        return any(_has(x, what) for x in v)
    return False


def _write_spec(doc: dict[str, Any], d: Path) -> Path:
    """The SPEC as TOML (every key inline at the top), or as YAML where it holds a null
    (TOML has none; JSON is YAML, and a 5,000-digit integer is written as its digits)."""
    if not _has(doc, lambda x: x is None):
        path = d / "spec.toml"
        path.write_text("".join(f"{json.dumps(k)} = {_toml_value(v)}\n" for k, v in doc.items()))
        return path
    text = json.dumps(doc, default=lambda o: "@BIG@")
    path = d / "spec.yaml"
    path.write_text(text.replace('"@BIG@"', BIG_DIGITS))
    return path


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    doc = copy.deepcopy(doc)
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return doc


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        doc = doc[k]
    return doc


def _spec_schema() -> dict[str, Any]:
    from refattn.bundle.sweeps.grid import spec_schema

    return spec_schema()


def fuzz_spec(fx: Fixtures) -> tuple[dict[str, Any], list[Finding]]:
    """Give every path of :data:`HONEST_SPEC` (and every property the schema allows where it
    is absent) boundary values of every JSON kind, and run ``refattn sweep SPEC --out D``.

    Parameters
    ----------
    fx : Fixtures
        From :func:`fixtures`.

    Returns
    -------
    counts : dict
        ``runs``, ``mutated`` (property names given a value), ``properties`` (every property
        name of the schema) and ``exits``.
    findings : list of Finding
    """
    schema = _spec_schema()
    paths, absent = spec_paths(HONEST_SPEC, schema)
    findings: list[Finding] = []
    exits: dict[str, int] = {}
    mutated: set[str] = set()
    runs = 0

    def sweep(doc: dict[str, Any], baseline: int | None) -> tuple[Outcome, list[str]]:
        return _call(fx, ["sweep", "@specfile", "--out", "@out", "--quiet"], baseline,
                     prepare=lambda scratch: _write_spec(doc, scratch) and None)

    honest, problems = sweep(HONEST_SPEC, None)
    runs += 1
    if honest.code != 0 or problems:
        findings.append(Finding("spec", "honest SPEC", "-",
                                f"exit {honest.code}: {problems or honest.err.strip()[-300:]}"))
    fx.peaks["spec"] = honest.peak

    def record(where: str, value: Any, o: Outcome, problems: list[str]) -> None:
        exits[str(o.code)] = exits.get(str(o.code), 0) + 1
        if o.code == 0 and not problems and _has(value, lambda x: x is BIG or (
                isinstance(x, float) and not math.isfinite(x)) or (
                isinstance(x, int) and not isinstance(x, bool) and abs(x) > 2**1024)):
            problems = ["exit 0: a SPEC with this value was accepted"]
        for p in problems:
            findings.append(Finding("spec", where, _shown(repr(value)), p))

    seen: set[str] = set()
    turn = 0
    for path in paths:
        original = _get(HONEST_SPEC, path)
        names = [k for k in path if isinstance(k, str)]
        if names:
            mutated.add(names[-1])
        values = [v for v in JSON_VALUES[_json_kind(original)] if not _same(v, original)]
        pattern = _pattern(path)
        if pattern in seen:  # a sibling of a path already given every value: one value
            values = [values[turn % len(values)]]
            turn += 1
        seen.add(pattern)
        for value in values:
            o, problems = sweep(_set(HONEST_SPEC, path, value), fx.peaks["spec"])
            runs += 1
            record(".".join(map(str, path)), value, o, problems)
    for path, name in absent:
        mutated.add(name)
        for value in ADDED_VALUES:
            o, problems = sweep(_set(HONEST_SPEC, (*path, name), value), fx.peaks["spec"])
            runs += 1
            record(".".join(map(str, (*path, name))) + " (added)", value, o, problems)
    return ({"runs": runs, "mutated": mutated, "properties": _all_property_names(schema),
             "exits": exits}, findings)


# -- the bundle manifest ------------------------------------------------------------------------
#: the keys whose children are named by data (case ids, tensor names), not by a schema
_NAMED_BY_DATA = ("cases", "tensors", "reference_error", "rounding_points")


def _pattern(path: tuple[Any, ...]) -> str:
    """A path with list indices as ``#`` and the children of :data:`_NAMED_BY_DATA` as
    ``*``: the paths one value set stands for."""
    out: list[str] = []
    for i, k in enumerate(path):
        parent = path[i - 1] if i else None
        out.append("#" if isinstance(k, int) else "*" if parent in _NAMED_BY_DATA else str(k))
    return ".".join(out)


def manifest_leaves(manifest: Any) -> list[tuple[Any, ...]]:
    """Every path of a manifest (containers and leaves) in document order.

    Parameters
    ----------
    manifest : object
        A parsed manifest.json.

    Returns
    -------
    list of tuple
    """
    paths: list[tuple[Any, ...]] = []

    def walk(v: Any, path: tuple[Any, ...]) -> None:
        if path:
            paths.append(path)
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, (*path, k))
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(x, (*path, i))
    walk(manifest, ())
    return paths


def _harmless(pattern: str, path: tuple[Any, ...], manifest: Any) -> bool:
    """Whether verify may accept this change (exit 0): a listed field, or the stride of an
    axis of length 1 (no element is ever read through it)."""
    if any(pattern == f or pattern.startswith(f + ".") for f in HARMLESS_MANIFEST_FIELDS):
        return True
    if len(path) >= 2 and path[-2] == "stride" and isinstance(path[-1], int):
        shape = _get(manifest, (*path[:-2], "shape"))
        return isinstance(shape, list) and path[-1] < len(shape) and shape[path[-1]] == 1
    return False


def fuzz_manifest(fx: Fixtures) -> tuple[dict[str, Any], list[Finding]]:
    """Give every path of the one-case bundle's manifest boundary values and run
    ``refattn verify DIR --no-gradcheck`` on a copy of the bundle holding it, and once per
    path ``refattn compare DIR/cases/CASE CANDIDATE``.

    The first path of each pattern (:func:`_pattern`: one tensor record stands for all)
    gets every value of its kind; the others one value each, in turn. Exit 0 is kept only
    for :data:`HARMLESS_MANIFEST_FIELDS`.

    Parameters
    ----------
    fx : Fixtures
        From :func:`fixtures`.

    Returns
    -------
    counts : dict
        ``runs``, ``compared`` (the compare runs among them), ``mutated`` (paths given a
        value), ``paths`` (every path) and ``exits`` (of verify).
    findings : list of Finding
    """
    manifest = json.loads((fx.bundle / "manifest.json").read_text())
    paths = manifest_leaves(manifest)
    findings: list[Finding] = []
    exits: dict[str, int] = {}
    mutated: set[tuple[Any, ...]] = set()
    seen: set[str] = set()
    runs = compared = 0
    turn = 0

    def verify(doc: Any, baseline: int | None, allowed: tuple[int, ...], *,
               command: str = "verify") -> tuple[Outcome, list[str]]:
        text = json.dumps(doc, default=lambda o: "@BIG@").replace('"@BIG@"', BIG_DIGITS)

        def prepare(scratch: Path) -> None:
            shutil.copytree(fx.bundle, scratch / "bundle")
            (scratch / "bundle" / "manifest.json").write_text(text)
        # a failing command writes nothing: the scratch directory must stay as prepared
        tokens = (["verify", "@bundlecopy", "--no-gradcheck", "--quiet"] if command == "verify"
                  else ["compare", "@casecopy", "@candidate"])
        return _call(fx, tokens, baseline, allowed=allowed, prepare=prepare)

    for command in ("verify", "compare"):
        honest, problems = verify(manifest, None, (0,), command=command)
        runs += 1
        if problems:
            findings.append(Finding("manifest", f"honest manifest ({command})", "-",
                                    "; ".join(problems)))
        fx.peaks[f"manifest {command}"] = honest.peak
    for path in paths:
        pattern = _pattern(path)
        original = _get(manifest, path)
        values = [v for v in JSON_VALUES[_json_kind(original)] if not _same(v, original)]
        if pattern in seen:  # a sibling of a path already given every value: one value
            values = [values[turn % len(values)]]
            turn += 1
        seen.add(pattern)
        allowed = (0, 1, 2) if _harmless(pattern, path, manifest) else (1, 2)
        mutated.add(path)
        for value in values:
            o, problems = verify(_set(manifest, path, value), fx.peaks["manifest verify"],
                                 allowed)
            runs += 1
            exits[str(o.code)] = exits.get(str(o.code), 0) + 1
            findings += [Finding("manifest", pattern, _shown(repr(value)), p)
                         for p in problems]
        # compare reads the same manifest (schema, checksums, the case's entry) without
        # recomputing: any exit, but one line and nothing else; one value per path
        o, problems = verify(_set(manifest, path, values[0]), fx.peaks["manifest compare"],
                             (0, 1, 2), command="compare")
        runs += 1
        compared += 1
        findings += [Finding("manifest", f"{pattern} (compare)", _shown(repr(values[0])), p)
                     for p in problems]
    return ({"runs": runs, "compared": compared, "mutated": mutated, "paths": set(paths),
             "exits": exits}, findings)


def _plain(counts: dict[str, Any]) -> dict[str, Any]:
    """Counts as JSON: sets as sorted lists of strings."""
    return {k: sorted(map(str, v)) if isinstance(v, set) else v for k, v in counts.items()}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the fuzzes named in ``argv`` (``cli``, ``spec``, ``manifest``; default all) and
    print their counts and findings, or with ``--json`` one JSON document
    ``{name: {"counts": ..., "findings": [...]}}``; exit 1 when there is a finding.

    Parameters
    ----------
    argv : sequence of str, optional
        Default ``sys.argv[1:]``.

    Returns
    -------
    int
        The exit status.
    """
    args = list(argv if argv is not None else sys.argv[1:])
    as_json = "--json" in args
    which = [a for a in args if a != "--json"] or ["cli", "spec", "manifest"]
    fuzzes = {"cli": fuzz_cli, "spec": fuzz_spec, "manifest": fuzz_manifest}
    doc: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        fx = fixtures(Path(d))
        for name in which:
            counts, findings = fuzzes[name](fx)
            doc[name] = {"counts": _plain(counts), "findings": [str(f) for f in findings]}
    if as_json:
        print(json.dumps(doc))
    else:
        for name, r in doc.items():
            c = r["counts"]
            print(f"{name}: {c['runs']} runs, exits {c['exits']}, {len(r['findings'])} "
                  "finding(s)")
            for f in r["findings"]:
                print(f"  {f}")
    return 1 if any(r["findings"] for r in doc.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
