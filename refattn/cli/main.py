"""The ``refattn`` command: one subcommand per module in :mod:`refattn.cli`.

Each command module defines ``add_parser(subparsers)`` and sets ``func(args) -> int``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from gradcheck.errors import GradcheckError
from refattn._checks import memory_error
from refattn._version import __version__
from refattn.cli import (
    calibrate,
    compare,
    diagnostics,
    golden,
    gradcheck,
    include_dir,
    mask,
    plot,
    sweep,
    verify,
    yardstick,
)
from refattn.errors import RefAttnError

__all__ = ["main"]

#: subcommand modules, in help order
COMMANDS = (golden, sweep, verify, compare, plot, mask, diagnostics, gradcheck, calibrate,
            include_dir, yardstick)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every registered subcommand.

    Examples
    --------
    >>> build_parser().parse_args(["golden", "--out", "bundle"]).suite
    'conformance'
    """
    parser = _Parser(
        prog="refattn", description="float64 reference engine for scaled-dot-product attention",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  refattn golden --out goldens                      # the conformance suite\n"
        "  refattn verify goldens\n"
        "  refattn COMMAND --help                            # what COMMAND does, examples",
    )
    parser.add_argument("--version", action="version", version=f"refattn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    for name, p in sub.choices.items():  # every subcommand's --help: what it does, an example
        p.formatter_class = argparse.RawDescriptionHelpFormatter
        if p.description is None or p.epilog is None:  # pragma: no cover - a new command
            raise RuntimeError(f"refattn {name}: its parser needs a description and an epilog")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (errors print one line, exit 2).

    A bad argument, a :class:`~refattn.errors.RefAttnError` and an operating-system error
    (a full disk, a read-only directory) each print one line naming what failed and return 2.
    No command prints the help on standard error and returns 2; Ctrl-C prints one line and
    returns 130 (128 + SIGINT), after the command has removed what it had begun to write.

    Examples
    --------
    >>> main(["mask", "--q", "0"])
    2
    """
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("refattn: interrupted", file=sys.stderr)
        return 130


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version (0) or a bad argument (2, one line printed)
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except (RefAttnError, GradcheckError) as exc:
        message = " ".join(str(exc).split())  # one line, whatever the message held
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        message = f"{where}{exc.strerror or exc}"
    except MemoryError as exc:  # what the library did not already turn into a RefAttnError
        message = str(memory_error(exc, f"refattn {args.command}"))
    print(f"refattn {args.command}: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
