"""``refattn compare GOLDEN CANDIDATE``: judge a candidate file against a golden case."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from refattn.bundle.comparison.candidates import read_candidate
from refattn.bundle.comparison.harness import compare
from refattn.bundle.comparison.tolerances import Tolerances
from refattn.bundle.storage.manifest import check_schema, read_manifest
from refattn.bundle.storage.read import load
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
    p.add_argument("--natural-floor", type=float, help="lower precision: the floor never "
                   "falls below this many unit roundoffs of the dtype times the tensor's "
                   "natural magnitude (default 8; 0 turns it off)")
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
                         ("floor_factor", args.floor_factor),
                         ("natural_floor", args.natural_floor)):
        if value is not None:
            tol = replace(tol, **{field: value})
    manifest = None
    mpath = golden.parent.parent / "manifest.json"
    if mpath.is_file():  # the bundle's schema version must be one this refattn reads
        manifest = check_schema(read_manifest(mpath))
    loaded = load(golden, manifest=manifest)
    if loaded.manifest_entry is not None and loaded.manifest_entry.get("quant") is not None:
        return _compare_quantized(args, loaded)
    report = compare(read_candidate(args.candidate), loaded,
                     dtype=args.dtype, tolerances=tol, check=args.check)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(report.format(legend=not args.no_legend))
    return 0 if report.passed else 1


def _plain_json(x: Any) -> Any:
    """JSON-able: tuples as lists, non-finite floats as the strings nan, inf, -inf."""
    if isinstance(x, dict):
        return {str(k): _plain_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain_json(v) for v in x]
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return x if math.isfinite(x) else str(x)
    if isinstance(x, np.integer):
        return int(x)
    return x


def _compare_quantized(args: argparse.Namespace, loaded: Any) -> int:
    """A quantised golden case: the candidate's tensors (output, lse, or an emulated
    intermediate; converted exactly to float64) must lie in the emulated pipeline's intervals
    (:func:`refattn.quant.check.check_candidate`), recomputed from the case's codes and spec
    (verify checks them against the stored ones bit for bit)."""
    from dataclasses import asdict

    from refattn.bundle.golden.spec import case_spec
    from refattn.quant.check import check_candidate
    from refattn.quant.pipeline import quantized

    for option in ("dtype", "atol", "rtol", "k_forward", "k_gradient", "floor_factor",
                   "natural_floor"):
        if getattr(args, option) is not None:
            raise RefAttnError(f"--{option.replace('_', '-')}: does not apply to a quantised "
                               "case (its tolerance is the emulated pipeline's interval)")
    qc = case_spec(loaded).quant_case()
    if qc is None:  # the entry has a quant record, so quant_case() built one or raised
        raise RefAttnError(f"{loaded.case_id}: not a quantised case")
    candidate = {}
    for name, x in read_candidate(args.candidate).items():
        if x.dtype.kind != "f" and str(x.dtype) != "bfloat16":
            raise RefAttnError(f"{args.candidate}: tensor {name!r}: expected a float tensor, "
                               f"got {x.dtype}")
        candidate[name] = np.asarray(x, dtype=np.float64)  # exact: every float is a float64
    report = check_candidate(quantized(qc.call, qc.spec), candidate)
    if args.json:
        doc = {"case": loaded.case_id, "passed": report.passed, "spec": report.spec_name,
               "widening": report.widening,
               "tensors": {n: asdict(t) for n, t in report.tensors.items()}}
        print(json.dumps(_plain_json(doc), indent=1, allow_nan=False))
    else:
        print(f"case {loaded.case_id} (quantised): {report.summary()}")
    return 0 if report.passed else 1
