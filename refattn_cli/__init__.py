"""The ``refattn`` console script's entry point, outside the :mod:`refattn` package.

Ctrl-C must be caught from the script's first line, and importing anything inside
``refattn`` first runs ``refattn/__init__.py`` (numpy, the engines) and then every command
module. This package imports only the standard library, so the whole import of refattn
happens inside :func:`main`'s guard: an interrupt during it (or during the command, which
removes what it had begun to write) prints one line, ``refattn: interrupted``, and exits
130 (128 + SIGINT), never a traceback. Nothing imports this package; ``[project.scripts]``
names it.

A KeyboardInterrupt raised inside a C extension's module initialisation (numpy's
``_multiarray_umath``) does not reach the guard as itself: numpy turns it into an ImportError
with a 40-line "IMPORTANT: PLEASE READ THIS" message. So where the platform has
``signal.pthread_sigmask`` (POSIX), SIGINT is blocked while refattn is imported: a Ctrl-C in
that time stays pending and is delivered when the mask is restored, in Python code inside
the guard, before the command starts (the command itself receives Ctrl-C as usual). Without
it (Windows), an interrupt during that import may show the extension's own error.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Sequence

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
        run = _import_command_line()
        return run(argv)
    except KeyboardInterrupt:
        print("refattn: interrupted", file=sys.stderr)
        return 130


def _import_command_line() -> Callable[[Sequence[str] | None], int]:
    """:func:`refattn.cli.main.main`, imported with SIGINT blocked where that is possible.

    A SIGINT that arrives meanwhile stays pending; restoring the mask delivers it, and
    ``signal.pthread_sigmask`` then raises KeyboardInterrupt from Python code.
    """
    block = getattr(signal, "pthread_sigmask", None)
    if block is None:  # Windows: no signal masks
        from refattn.cli.main import main as run  # numpy, the engines, every command

        return run
    previous = block(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        from refattn.cli.main import main as run  # numpy, the engines, every command
    finally:
        block(signal.SIG_SETMASK, previous)  # a pending SIGINT is delivered here
    return run
