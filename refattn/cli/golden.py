"""``refattn golden``: generate a golden bundle for a named suite."""

from __future__ import annotations

import argparse

from refattn.bundle.suites import SUITES, build_suite
from refattn.bundle.write import write_bundle

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("golden", help="write golden fixture files (safetensors + manifest)")
    p.add_argument("--out", required=True, help="bundle directory to write")
    p.add_argument("--suite", default="conformance", choices=sorted(SUITES),
                   help="which suite of cases to write (default: conformance)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cases = build_suite(args.suite)
    path = write_bundle(args.out, cases, suite=args.suite)
    print(f"wrote {len(cases)} case(s) of suite {args.suite!r} to {path.parent} ({path.name})")
    return 0
