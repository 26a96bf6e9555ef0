"""The ``refattn`` console script's entry point, outside the :mod:`refattn` package.

Ctrl-C must be caught from the script's first line, and importing anything inside
``refattn`` first runs ``refattn/__init__.py`` (numpy, the engines) and then every command
module. This package imports only the standard library, so the whole import of refattn
happens inside :func:`main`'s guard: an interrupt during it (or during the command, which
removes what it had begun to write) prints one line, ``refattn: interrupted``, and exits
130 (128 + SIGINT), never a traceback. Nothing imports this package; ``[project.scripts]``
names it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Import the command line and run it; Ctrl-C anywhere prints one line and returns 130.

    Parameters
    ----------
    argv : sequence of str, optional
        The arguments after ``refattn``; default ``sys.argv[1:]``.

    Returns
    -------
    int
        The exit status of :func:`refattn.cli.main.main` (0, 2 on an error), or 130.

    Examples
    --------
    >>> main(["mask", "--q", "0"])  # a bad argument: one line on stderr, exit status 2
    2
    """
    try:
        from refattn.cli.main import main as run  # numpy, the engines, every command

        return run(argv)
    except KeyboardInterrupt:
        print("refattn: interrupted", file=sys.stderr)
        return 130
