"""The ``refattn`` command: one subcommand per module in :mod:`refattn.cli`.

Each command module defines ``add_parser(subparsers)`` and sets ``func(args) -> int``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from refattn._version import __version__
from refattn.cli import calibrate, compare, diagnostics, golden, gradcheck, mask, verify
from refattn.errors import RefAttnError

__all__ = ["main"]

#: subcommand modules, in help order
COMMANDS = (golden, verify, compare, mask, diagnostics, gradcheck, calibrate)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every registered subcommand.

    Examples
    --------
    >>> build_parser().parse_args(["golden", "--out", "bundle"]).suite
    'conformance'
    """
    parser = argparse.ArgumentParser(
        prog="refattn", description="float64 reference engine for scaled-dot-product attention"
    )
    parser.add_argument("--version", action="version", version=f"refattn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (errors print one line, exit 2).

    Examples
    --------
    >>> main(["--version"])  # doctest: +SKIP
    """
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except RefAttnError as exc:
        print(f"refattn {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
