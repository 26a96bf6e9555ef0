"""``refattn yardstick``: write the lower-precision rule's yardsticks of a bundle as a JSON file.

Owns the command's parser, its ``--names`` parser and the file's no-clobber atomic write. The
numbers are :func:`refattn.bundle.native.bundle_yardsticks` (every case read back with every
checksum); the C++ header reads the file with ``refattn::Bundle::load_yardsticks`` (as
``refattn_case_load_yardsticks`` in the C API) for bundles written without
``refattn golden --with-yardsticks``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
from pathlib import Path

from refattn.bundle.comparison.tolerances import LOWER_PRECISIONS
from refattn.bundle.native import DEFAULT_NAMES, bundle_yardsticks
from refattn.bundle.storage.format import atomic_write
from refattn.errors import RefAttnError

__all__ = ["add_parser", "name_list", "run", "write_file"]

_NAME = re.compile(r"[A-Za-z0-9_]{1,100}")


def name_list(text: str) -> tuple[str, ...]:
    """``--names``'s value: comma-separated canonical tensor names, each once.

    Examples
    --------
    >>> name_list("output,grad_q")
    ('output', 'grad_q')
    >>> name_list("output,,lse")
    Traceback (most recent call last):
        ...
    argparse.ArgumentTypeError: '' is not a tensor name (letters, digits, _; 1 to 100)
    """
    names = [t.strip() for t in text.split(",")]
    for name in names:
        if not _NAME.fullmatch(name):
            raise argparse.ArgumentTypeError(f"{name[:40]!r} is not a tensor name (letters, "
                                             "digits, _; 1 to 100)")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text[:80]!r} names a tensor twice")
    return tuple(names)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "yardstick", help="write a bundle's float32/float16/bfloat16 yardsticks (for C++)",
        description="Compute, for every case of BUNDLE (read back with every checksum), the "
        "yardstick of the lower-precision rule of refattn compare: the naive algorithm's "
        "error in DTYPE (the largest over its saved-state routes) and each tensor's natural "
        "magnitude, and write them as a JSON file that the C++ header's "
        "refattn::Bundle::load_yardsticks reads (docs/reference/cpp.md). The file is written "
        "whole or not at all; an existing FILE is replaced only with --force. refattn golden "
        "--with-yardsticks stores the same numbers in the bundle's manifest instead.",
        epilog="examples:\n"
        "  refattn yardstick goldens --dtype float32 --out goldens.f32.json\n"
        "  refattn yardstick goldens --dtype bfloat16 --names output,grad_q --out y.json\n"
        "  refattn yardstick goldens --dtype float16 --out y16.json --force  # replace it",
    )
    p.add_argument("bundle", metavar="BUNDLE", help="a golden bundle directory")
    p.add_argument("--dtype", required=True, choices=LOWER_PRECISIONS,
                   help="the precision the kernel under test computes in")
    p.add_argument("--names", type=name_list, default=DEFAULT_NAMES, metavar="NAMES",
                   help="comma-separated tensors (default: " + ",".join(DEFAULT_NAMES) + "; "
                   "a case lacking one skips it)")
    p.add_argument("--out", required=True, type=Path, metavar="FILE",
                   help="the JSON file to write (refused if it exists, unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing regular FILE")
    p.set_defaults(func=run)


def write_file(path: Path, data: bytes, *, force: bool) -> None:
    """Write ``data`` to ``path`` whole or not at all: a fsynced temporary file in the same
    directory, then a hard link (no ``force``: an existing name is refused atomically, never
    replaced) or a rename over a regular file (``force``). A link, a directory or another
    non-regular file at ``path`` is always refused.

    Examples
    --------
    >>> import tempfile
    >>> p = Path(tempfile.mkdtemp()) / "y.json"
    >>> write_file(p, b"{}", force=False)
    >>> write_file(p, b"[]", force=False)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    refattn.errors.RefAttnError: --out .../y.json: exists; pass --force to replace it
    >>> write_file(p, b"[]", force=True); p.read_bytes()
    b'[]'
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise RefAttnError(f"--out {path}: cannot inspect it ({exc.strerror})") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise RefAttnError(f"--out {path}: is {kind}; refattn writes only a regular file")
    if st is not None and not force:
        raise RefAttnError(f"--out {path}: exists; pass --force to replace it")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise RefAttnError(f"--out {path}: the directory {parent} does not exist")
    try:
        atomic_write(path, data, replace=force)
    except FileExistsError:  # the name appeared after the check above
        raise RefAttnError(f"--out {path}: exists; pass --force to replace it") from None
    except RefAttnError as exc:
        raise RefAttnError(f"--out {exc}") from None


def run(args: argparse.Namespace) -> int:
    """Compute the yardsticks and write ``--out``; prints one line.

    Examples
    --------
    >>> import tempfile, contextlib, io
    >>> from refattn.bundle import write_bundle
    >>> from refattn.bundle.suites import build_suite
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = write_bundle(d / "b", build_suite("contract")[1:2], suite="contract")
    >>> ns = argparse.Namespace(bundle=d / "b", dtype="float16", names=("output",),
    ...                         out=d / "y.json", force=False)
    >>> with contextlib.redirect_stdout(io.StringIO()):
    ...     code = run(ns)
    >>> code
    0
    >>> sorted(json.loads((d / "y.json").read_text())["cases"])
    ['loop7_cross_attention_padded_source']
    """
    doc = bundle_yardsticks(args.bundle, [args.dtype], args.names)
    text = json.dumps(doc, indent=2, sort_keys=True, allow_nan=False) + "\n"
    write_file(Path(args.out), text.encode(), force=args.force)
    print(f"wrote the {args.dtype} yardsticks of {len(doc['cases'])} case(s) to {args.out}")
    return 0
