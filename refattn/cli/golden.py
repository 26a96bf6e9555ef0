"""``refattn golden``: generate a golden bundle for a named suite.

Owns the command's parser and body. With ``--with-yardsticks DTYPES`` each case's manifest
entry also stores the lower-precision rule's yardsticks
(:func:`refattn.bundle.native.yardstick_table`, what the C++ header's ``refattn::compare``
multiplies by k): the bundle is written into a temporary directory, read back with every
checksum, and committed to ``--out`` in one transaction holding the yardsticks (the lock on
``--out`` is taken first, so a directory refattn may not write is refused before any work).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from refattn.bundle.comparison.tolerances import LOWER_PRECISIONS
from refattn.bundle.golden.case import GENERATORS
from refattn.bundle.golden.spec import case_spec
from refattn.bundle.native import DEFAULT_NAMES, yardstick_table
from refattn.bundle.storage.format import dump_json
from refattn.bundle.storage.fsio import MAX_CASE_BYTES, MAX_MANIFEST_BYTES, read_confined
from refattn.bundle.storage.manifest import check_schema, parse_manifest, read_manifest
from refattn.bundle.storage.read import load_bytes
from refattn.bundle.storage.transaction import BundleTransaction
from refattn.bundle.suites import SUITES, build_suite, default_generator
from refattn.bundle.writing.write import MAX_EXACT_SECONDS, write_bundle
from refattn.cli.verify import seconds_value
from refattn.errors import RefAttnError

__all__ = ["add_parser", "dtype_list", "run"]


def dtype_list(text: str) -> tuple[str, ...]:
    """``--with-yardsticks``'s value: comma-separated lower precisions, each once.

    Examples
    --------
    >>> dtype_list("float32,bfloat16")
    ('float32', 'bfloat16')
    >>> dtype_list("float64")
    Traceback (most recent call last):
        ...
    argparse.ArgumentTypeError: 'float64' is not float32, float16 or bfloat16
    """
    names = [t.strip() for t in text.split(",")]
    for name in names:
        if name not in LOWER_PRECISIONS:
            raise argparse.ArgumentTypeError(f"{name[:40]!r} is not float32, float16 or bfloat16")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text[:80]!r} names a dtype twice")
    return tuple(names)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "golden", help="write golden fixture files (safetensors + manifest)",
        description="Write a suite of golden cases as a bundle: DIR/cases/<case>.safetensors "
        "(inputs, intermediates, gradients) and DIR/manifest.json (conventions, sha256 of every "
        "file and tensor). The exact generator's bytes are the same on every machine. The "
        "bundle is written as one transaction: Ctrl-C or an error leaves DIR as it was.",
        epilog="examples:\n"
        "  refattn golden --out goldens                      # the 79 conformance cases\n"
        "  refattn golden --suite kernels --out kgoldens     # 304 cases at kernel shapes\n"
        "  refattn golden --suite contract --out contract    # the contract's fixtures only\n"
        "  refattn golden --out goldens --backend numpy      # machine-dependent float64\n"
        "  refattn golden --out goldens --with-yardsticks float32,bfloat16  # for C++ tests",
    )
    p.add_argument("--out", required=True, help="bundle directory to write: absent, empty or "
                   "an earlier bundle (written as one transaction; a link, a file, a foreign "
                   "manifest or a concurrent writer is refused)")
    p.add_argument("--force", action="store_true",
                   help="write beside files refattn did not write (they are left untouched; "
                   "a foreign manifest.json or a foreign file in cases/ is refused even so)")
    p.add_argument("--suite", default="conformance", choices=sorted(SUITES),
                   help="which suite of cases to write (default: conformance)")
    p.add_argument("--backend", default=None, choices=GENERATORS,
                   help="generator (default: the suite's own, exact for contract and "
                   "conformance, numba for kernels): exact (every tensor correctly rounded, "
                   "the same bytes on every machine), numpy (the full trace in float64, "
                   "BLAS order) or numba (the fused kernel's saved-state tensors, fast at "
                   "kernel shapes); numpy and numba record each tensor's bound against the "
                   "correctly rounded result, which verify applies")
    p.add_argument("--max-seconds", type=seconds_value, default=MAX_EXACT_SECONDS,
                   metavar="S", help="refuse, before any work, a bundle whose exact generation "
                   f"is estimated above S seconds in all (default {MAX_EXACT_SECONDS:g})")
    p.add_argument("--with-yardsticks", type=dtype_list, default=(), metavar="DTYPES",
                   help="also store in each case's manifest entry the yardsticks of the "
                   "float32/float16/bfloat16 rule for " + ", ".join(DEFAULT_NAMES) + " (the "
                   "naive algorithm's error in each of the comma-separated DTYPES, e.g. "
                   "float32,bfloat16), which the C++ header's refattn::compare reads; refattn "
                   "verify recomputes them and fails a bundle whose stored ones differ")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar (one is drawn only on a terminal anyway)")
    p.set_defaults(func=run)


def _earlier_cases(out: Path) -> set[str]:
    """The case ids of the refattn bundle already in ``out`` (none when there is none)."""
    if not os.path.lexists(out / "manifest.json"):
        return set()
    try:
        return set(check_schema(read_manifest(out / "manifest.json"))["cases"])
    except RefAttnError:
        return set()  # not refattn's: write_bundle refuses it with the reason


def run(args: argparse.Namespace) -> int:
    earlier = _earlier_cases(Path(args.out))
    cases = build_suite(args.suite)
    backend = args.backend or default_generator(args.suite)
    progress = False if args.quiet else None
    dtypes = tuple(getattr(args, "with_yardsticks", ()) or ())
    if dtypes:
        path = _write_with_yardsticks(Path(args.out), cases, dtypes, suite=args.suite,
                                      backend=backend, force=args.force, progress=progress,
                                      max_seconds=args.max_seconds)
    else:
        path = write_bundle(args.out, cases, suite=args.suite, backend=backend,
                            force=args.force, progress=progress, max_seconds=args.max_seconds)
    with_what = f", yardsticks {','.join(dtypes)}" if dtypes else ""
    print(f"wrote {len(cases)} case(s) of suite {args.suite!r} ({backend}{with_what}) to "
          f"{path.parent} ({path.name})")
    removed = sorted(earlier - _earlier_cases(path.parent))  # the new bundle's ids
    if removed:  # the earlier bundle's own files, replaced: say which ones are gone
        shown = ", ".join(removed[:5]) + (", ..." if len(removed) > 5 else "")
        print(f"replaced the earlier bundle: removed {len(removed)} case file(s) that suite "
              f"{args.suite!r} does not have ({shown})")
    return 0


def _write_with_yardsticks(out: Path, cases: Sequence[Any], dtypes: Sequence[str], *,
                           suite: str, backend: str, force: bool, progress: bool | None,
                           max_seconds: float) -> Path:
    """:func:`write_bundle` with each entry's ``yardsticks``: one transaction on ``out``,
    whose lock is held from before the arithmetic to the commit."""
    with BundleTransaction(out, force=force) as tx, tempfile.TemporaryDirectory(
            prefix="refattn-golden-") as scratch:
        staged = write_bundle(Path(scratch) / "bundle", cases, suite=suite, backend=backend,
                              progress=progress, max_seconds=max_seconds).parent
        shown = str(staged / "manifest.json")
        manifest = check_schema(parse_manifest(read_confined(
            staged, "manifest.json", max_bytes=MAX_MANIFEST_BYTES, what="bundle manifest"),
            shown))
        for entry in manifest["cases"].values():
            data = read_confined(staged, entry["file"], max_bytes=MAX_CASE_BYTES,
                                 what="case file")
            spec = case_spec(load_bytes(data, entry["file"], manifest=manifest,
                                        file_name=Path(entry["file"]).name))
            entry["yardsticks"] = {d: yardstick_table(spec, d, DEFAULT_NAMES) for d in dtypes}
            tx.add(entry["file"], data)
            del data, spec  # one case in memory at a time
        tx.commit({"manifest.json": dump_json(manifest)})
    return tx.out / "manifest.json"
