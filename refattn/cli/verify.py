"""``refattn verify DIR``: checksums, recomputation and gradient check of a golden bundle."""

from __future__ import annotations

import argparse
import json

from refattn.cli.sweep import add_cluster_arguments
from refattn.distributed.cluster import connect
from refattn.distributed.verification import verify

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify", help="check a golden bundle: sha256 of files and tensors, recomputation, "
        "gradient check (exit 1 on failure)",
    )
    p.add_argument("directory", help="bundle directory (manifest.json and cases/)")
    p.add_argument("--no-recompute", action="store_true",
                   help="skip recomputing each case with the engine")
    p.add_argument("--no-gradcheck", action="store_true",
                   help="skip the finite-difference check of each case's backward")
    p.add_argument("--gradcheck-method", default="auto",
                   choices=("auto", "check_vjp", "central_difference"),
                   help="gradient checker (default auto: gradcheck.check_vjp)")
    p.add_argument("--backend", default=None,
                   help="engine of the recomputation (default: each case's generator; the "
                   "exact generator must reproduce its files bit for bit)")
    p.add_argument("--exact", action="store_true",
                   help="also run the rounding certificate: every stored element must be the "
                   "correctly rounded value of its definition (independent interval check)")
    p.add_argument("--json", action="store_true",
                   help="print the report as one JSON document")
    p.add_argument("--no-legend", action="store_true",
                   help="leave out the lines that explain the columns")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar (one is drawn only on a terminal anyway)")
    add_cluster_arguments(p)  # --workers N / --scheduler ADDR: the cases checked in parallel
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with connect(workers=args.workers, scheduler=args.scheduler, timeout=args.timeout) as client:
        report = verify(args.directory, client=client, recompute=not args.no_recompute,
                        gradcheck=not args.no_gradcheck, gradcheck_method=args.gradcheck_method,
                        backend=args.backend, exact=args.exact,
                        progress=False if args.quiet else None)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(report.format(legend=not args.no_legend))
    return 0 if report.passed else 1
