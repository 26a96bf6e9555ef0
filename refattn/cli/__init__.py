"""The ``refattn`` command line: one module per subcommand, dispatched by :mod:`refattn.cli.main`.

Owns argument parsing, one-line errors (exit code 2) and printing; every command calls the
library below it (bundle, masks, softmax, gradcheck). Nothing imports this package.
"""

from __future__ import annotations

from refattn.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
