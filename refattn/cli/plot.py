"""``refattn plot CASE_OR_BUNDLE``: PNG pictures of golden cases and of a candidate's error.

Owns the command-line spelling of :mod:`refattn.plot` (matplotlib, the optional extra
``plot``, imported only when this command runs): the visibility mask and the probability matrix
per head of each case, and with ``--candidate`` an error heatmap per compared tensor with the
worst element marked. Prints one line per file written.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

from refattn._install import install_hint
from refattn._progress import progress
from refattn.bundle.comparison.candidates import read_candidate
from refattn.errors import RefAttnError

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plot", help="draw golden cases as PNGs: visibility mask, probabilities per head, and "
        f"a candidate's error heatmap (needs matplotlib: {install_hint('plot')})",
        description="Writes <case>_visible.png and <case>_probs.png for each case, and with "
        "--candidate <case>_error_<tensor>.png for every tensor compared (|candidate - golden| "
        "on a log scale, the worst element boxed in red; masked cells of the probabilities "
        "are drawn grey). Prints one line per file written (--quiet: one summary line).",
        epilog="examples:\n"
        "  refattn plot goldens/cases/causal_square.safetensors\n"
        "  refattn plot goldens --case causal_square --candidate mine.safetensors --out plots\n"
        "  refattn plot goldens --quiet                      # every case of a bundle",
    )
    p.add_argument("source", metavar="CASE_OR_BUNDLE",
                   help="a case file DIR/cases/<case>.safetensors or a bundle directory")
    p.add_argument("--case", help="only this case of a bundle directory")
    p.add_argument("--out", default="plots", type=Path,
                   help="directory for the PNG files (default: plots)")
    p.add_argument("--candidate", help="a candidate safetensors file (canonical names): also "
                   "draw its error against the golden case (one case only)")
    p.add_argument("--dtype", choices=("float64", "float32", "float16", "bfloat16"),
                   help="precision the candidate was computed in (default: its dtype)")
    p.add_argument("--tensor", action="append", default=None, metavar="NAME",
                   help="draw only this tensor's error (repeatable; default: every tensor)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar, and one summary line instead of one line per file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from refattn.plot import load_specs, plot_case, plot_error

    specs = load_specs(args.source, case=args.case)
    candidate = None
    if args.candidate is not None:
        if len(specs) != 1:
            raise RefAttnError(f"--candidate: {args.source} holds {len(specs)} cases; name one "
                               "with --case")
        candidate = read_candidate(args.candidate)
    elif args.tensor:
        raise RefAttnError("--tensor: only with --candidate")
    written: list[Path] = []
    before = _pngs(args.out)  # None: the directory is this run's to create
    try:
        for spec in progress(specs, desc="plot", enabled=False if args.quiet else None):
            written += plot_case(spec, args.out)
            if candidate is not None:
                written += plot_error(spec, candidate, args.out, dtype=args.dtype,
                                      tensors=args.tensor)
    except BaseException:  # Ctrl-C or an error: remove what this run added, nothing else
        _remove_new(args.out, before)
        raise
    if args.quiet:  # one line, however many files
        print(f"wrote {len(written)} file(s) to {args.out}")
    else:
        for path in written:
            print(path)
    return 0


def _pngs(out: Path) -> set[str] | None:
    """The PNG files already in ``out`` (None when ``out`` does not exist)."""
    try:
        return {e.name for e in os.scandir(out) if e.name.endswith(".png")}
    except FileNotFoundError:
        return None
    except OSError:
        return set()  # not readable: nothing will be removed


def _remove_new(out: Path, before: set[str] | None) -> None:
    """Remove the PNG files this run added to ``out``, and ``out`` itself if the run made it
    and it is empty again; files that were there before stay, whatever happened to them."""
    now = _pngs(out) or set()
    for name in now - (before or set()):
        with contextlib.suppress(OSError):
            os.unlink(out / name)
    if before is None:
        with contextlib.suppress(OSError):
            out.rmdir()
