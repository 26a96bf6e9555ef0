"""``refattn compare GOLDEN CANDIDATE``: judge a candidate file against a golden case."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from refattn.bundle.candidates import read_candidate
from refattn.bundle.comparison import compare
from refattn.bundle.manifest import check_schema, read_manifest
from refattn.bundle.read import load
from refattn.bundle.tolerances import Tolerances
from refattn.errors import RefAttnError

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare", help="compare a candidate safetensors file with a golden case (exit 1 on "
        "failure)",
        description="Judge a candidate (a safetensors file of canonical tensor names: output, "
        "lse, grad_q, ...) against a golden case. float64 candidates meet |a-g| <= atol + rtol "
        "|g| per element; float32, float16 and bfloat16 ones stay within k times the error of "
        "refattn's naive algorithm run in their dtype, plus a floor. Each row names the worst "
        "element, its index and both values; a diagnosis line names a recognisable bug. Exit 0 "
        "when every tensor passes, 1 when one fails, 2 on an error.",
        epilog="examples:\n"
        "  refattn compare goldens/cases/causal_square.safetensors mine.safetensors\n"
        "  refattn compare goldens mine.safetensors --case causal_square --json\n"
        "  refattn compare CASE mine.safetensors --dtype float32 --check forward",
    )
    p.add_argument("golden", help="golden case file DIR/cases/<case>.safetensors, or a bundle "
                   "DIR together with --case")
    p.add_argument("candidate", help="safetensors file holding canonical tensor names")
    p.add_argument("--case", help="case id when GOLDEN is a bundle directory")
    p.add_argument("--dtype", choices=("float64", "float32", "float16", "bfloat16"),
                   help="precision the candidate was computed in (default: its dtype)")
    p.add_argument("--atol", type=float, help="float64 rule: absolute tolerance")
    p.add_argument("--rtol", type=float, help="float64 rule: relative tolerance")
    p.add_argument("--k-forward", type=float, help="lower precision: multiplier for forward "
                   "tensors (default 2)")
    p.add_argument("--k-gradient", type=float, help="lower precision: multiplier for "
                   "gradients (default 3)")
    p.add_argument("--check", choices=("auto", "forward", "gradients", "listed"),
                   default="auto", help="what the candidate must contain: forward (output), "
                   "gradients (output and every input gradient of the case), listed (only what "
                   "it holds, at least one tensor); default auto: gradients when the candidate "
                   "holds any input gradient, else forward")
    p.add_argument("--floor-factor", type=float, help="lower precision: floor multiplier "
                   "(default 2)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON document "
                   "(non-finite numbers as the strings nan, inf, -inf)")
    p.add_argument("--no-legend", action="store_true",
                   help="leave out the lines that explain the columns")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    golden = Path(args.golden)
    if golden.is_dir():
        if not args.case:
            raise RefAttnError(f"{golden}: is a bundle directory; name the case with --case")
        golden = golden / "cases" / f"{args.case}.safetensors"
    tol = Tolerances()
    for field, value in (("atol", args.atol), ("rtol", args.rtol),
                         ("k_forward", args.k_forward), ("k_gradient", args.k_gradient),
                         ("floor_factor", args.floor_factor)):
        if value is not None:
            tol = replace(tol, **{field: value})
    manifest = None
    mpath = golden.parent.parent / "manifest.json"
    if mpath.is_file():  # the bundle's schema version must be one this refattn reads
        manifest = check_schema(read_manifest(mpath))
    report = compare(read_candidate(args.candidate), load(golden, manifest=manifest),
                     dtype=args.dtype, tolerances=tol, check=args.check)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(report.format(legend=not args.no_legend))
    return 0 if report.passed else 1
