"""``refattn include-dir``: print the folder of refattn's C++ header and C API.

Owns the command's parser and body; the folder itself is
:func:`refattn.bundle.native.include_dir` (as ``pybind11 --includes`` prints pybind11's).
"""

from __future__ import annotations

import argparse

from refattn.bundle.native import include_dir

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "include-dir", help="print the folder of refattn.hpp and refattn.h (for -I)",
        description="Print the folder holding refattn.hpp (the C++17 reader of golden bundles "
        "and the tolerance rule) and refattn.h (its C API), for a compiler's -I or CMake's "
        "include_directories: g++ -std=c++17 -I\"$(refattn include-dir)\" test.cpp, or "
        "cmake -DREFATTN_INCLUDE=\"$(refattn include-dir)\" ..",
        epilog="examples:\n"
        "  refattn include-dir                               # /path/to/refattn/include\n"
        "  refattn include-dir --flag                        # -I/path/to/refattn/include",
    )
    p.add_argument("--flag", action="store_true", help="print it as a -I flag")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the include folder (``-I`` prefixed with ``--flag``).

    Examples
    --------
    >>> import contextlib, io
    >>> out = io.StringIO()
    >>> with contextlib.redirect_stdout(out):
    ...     code = run(argparse.Namespace(flag=True))
    >>> code
    0
    >>> out.getvalue().startswith("-I") and out.getvalue().rstrip().endswith("include")
    True
    """
    path = include_dir()
    print(f"-I{path}" if args.flag else str(path))
    return 0
