"""``refattn golden``: generate a golden bundle for a named suite."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from refattn.bundle.golden.case import GENERATORS
from refattn.bundle.storage.manifest import check_schema, read_manifest
from refattn.bundle.suites import SUITES, build_suite, default_generator
from refattn.bundle.writing.write import MAX_EXACT_SECONDS, write_bundle
from refattn.cli.verify import seconds_value
from refattn.errors import RefAttnError

__all__ = ["add_parser"]


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
        "  refattn golden --out goldens --backend numpy      # machine-dependent float64",
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
    path = write_bundle(args.out, cases, suite=args.suite, backend=backend,
                        force=args.force, progress=False if args.quiet else None,
                        max_seconds=args.max_seconds)
    print(f"wrote {len(cases)} case(s) of suite {args.suite!r} ({backend}) to "
          f"{path.parent} ({path.name})")
    removed = sorted(earlier - _earlier_cases(path.parent))  # the new bundle's ids
    if removed:  # the earlier bundle's own files, replaced: say which ones are gone
        shown = ", ".join(removed[:5]) + (", ..." if len(removed) > 5 else "")
        print(f"replaced the earlier bundle: removed {len(removed)} case file(s) that suite "
              f"{args.suite!r} does not have ({shown})")
    return 0
