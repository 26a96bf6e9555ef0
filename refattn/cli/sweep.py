"""``refattn sweep SPEC --out DIR``: a grid of golden cases, in this process or on dask."""

from __future__ import annotations

import argparse

from refattn._install import install_hint
from refattn.bundle.golden.case import GENERATORS
from refattn.distributed.cluster import DEFAULT_TIMEOUT, connect
from refattn.distributed.sweep import describe, run_sweep

__all__ = ["add_cluster_arguments", "add_parser"]


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """``--workers N``, ``--scheduler ADDR`` and ``--timeout S`` (shared with verify)."""
    where = p.add_mutually_exclusive_group()
    where.add_argument("--workers", type=int, default=None, metavar="N",
                       help="start a local dask cluster of N worker processes (at most one "
                       "per CPU core; loopback only; "
                       f"needs {install_hint('distributed')})")
    where.add_argument("--scheduler", default=None, metavar="ADDR",
                       help="use the running dask scheduler at ADDR (e.g. tcp://host:8786, "
                       "or tls://host:8786 with dask's TLS settings for a client, e.g. "
                       "DASK_DISTRIBUTED__COMM__TLS__CA_FILE, ..._CLIENT__CERT, "
                       "..._CLIENT__KEY); the cluster is trusted completely: its scheduler "
                       "and workers can run code in this process (dask moves pickles)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="S",
                   help=f"seconds to wait for the scheduler to answer (default "
                   f"{DEFAULT_TIMEOUT:g}); whatever listens at ADDR, an address that does "
                   "not answer as a dask scheduler is given up within about S + 2 s, and a "
                   "scheduler that stops answering mid-run within about S (a sweep then "
                   "resumes when rerun)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sweep", help="write the golden cases of a sweep SPEC (TOML or YAML) as one bundle, "
        "resumably, in this process or on dask workers",
        description="Write the golden cases of a grid SPEC (TOML or YAML, validated against "
        "refattn/bundle/schema/sweep-v1.json) as one bundle, with the format, manifest and "
        "checksums of refattn golden. Each case is named by a slug and a hash of its "
        "description; an interrupted sweep resumes; the bytes do not depend on the workers.",
        epilog="examples:\n"
        "  refattn sweep sweep.toml --out sweep-bundle\n"
        "  refattn sweep sweep.toml --out sweep-bundle --workers 2   # a local dask cluster\n"
        "  refattn sweep sweep.toml --out sweep-bundle --backend numba   # kernel shapes\n"
        "  refattn sweep sweep.toml --out sweep-bundle --scheduler tcp://host:8786")
    p.add_argument("spec", metavar="SPEC", help="the sweep SPEC (.toml, .yaml or .yml); see "
                   "examples/sweep.toml")
    p.add_argument("--out", required=True, help="bundle directory: absent, empty, or this "
                   "sweep's own bundle (an interrupted run resumes; another bundle or another "
                   "sweep's unfinished work is refused)")
    p.add_argument("--force", action="store_true",
                   help="write beside files refattn did not write (they are left untouched)")
    p.add_argument("--backend", default=None, choices=GENERATORS,
                   help="generator of every case (default: the SPEC's generator, exact where "
                   "it names none): exact (correctly rounded), numpy (the full float64 "
                   "trace) or numba (the fused kernel's saved-state tensors, fast at kernel "
                   "shapes; each tensor's bound recorded); a SPEC naming another is refused")
    add_cluster_arguments(p)
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar (one is drawn only on a terminal anyway)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with connect(workers=args.workers, scheduler=args.scheduler, timeout=args.timeout) as client:
        result = run_sweep(args.spec, args.out, client=client, force=args.force,
                           progress=False if args.quiet else None, timeout=args.timeout,
                           backend=args.backend)
    print(describe(result, args.out))
    return 0
