"""``refattn calibrate``: choose this machine's BLAS provider, thread layout and block budget."""

from __future__ import annotations

import argparse
import json

from refattn.cli.verify import integer_value
from refattn.errors import RefAttnError

__all__ = ["add_parser"]

#: the most interleaved rounds per candidate (a round times every candidate once)
MAX_REPEATS = 100


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate", help="time every BLAS provider, thread layout and buffer budget of the "
        "numba value_and_grad at attention shapes and cache the fastest for this machine",
        description="Time every GEMM provider (OpenBLAS through scipy; oneMKL and BLIS where "
        "installed), two thread layouts, four score-buffer budgets and, where OpenBLAS runs "
        "the thin products in small-matrix tiles, two tile sizes of the numba "
        "value_and_grad, and cache the fastest in $REFATTN_CACHE_DIR/calibration.json "
        "(default ~/.cache/refattn). It runs by itself on first use; "
        "REFATTN_BLAS_PROVIDER=openblas/heads/8[/24] (name/layout/MiB[/tile KiB]) overrides it.",
        epilog="examples:\n"
        "  refattn calibrate                                 # about 10 s, plus a cold compile\n"
        "  refattn calibrate --full                          # head dims 64 and 128\n"
        "  refattn calibrate --show                          # the cached choice",
    )
    p.add_argument("--full", action="store_true",
                   help="time two shapes (head dims 64 and 128) instead of one")
    p.add_argument("--repeats", type=integer_value(1, MAX_REPEATS), default=5,
                   help="interleaved rounds per candidate, 1 to "
                   f"{MAX_REPEATS}; the minimum counts (default 5)")
    p.add_argument("--show", action="store_true",
                   help="print the cached calibration without re-running it")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from refattn.engine.numba import calibration, providers

    path = calibration.calibration_path()
    if args.show:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise RefAttnError(f"no readable calibration at {path}: {exc}") from None
        stale = record.get("fingerprint") != providers.fingerprint()
        _print(record, path, note=" (stale: another machine or thread count)" if stale else "")
        return 0
    shapes = calibration.FULL_SHAPES if args.full else calibration.QUICK_SHAPES
    _print(calibration.calibrate(shapes=shapes, repeats=args.repeats), path, note="")
    return 0


def _print(record: dict, path, note: str) -> None:
    fp = record["fingerprint"]
    print(f"cpu: {fp['cpu']} ({fp['cpus']} cpus, {fp['numba_threads']} numba threads)")
    print("providers: " + "; ".join(fp["providers"]))
    print("shapes (B, H, Q, K, D): " + ", ".join(str(tuple(s)) for s in record["shapes"]))
    best = record["seconds"][record["choice"]]
    for key, seconds in sorted(record["seconds"].items(), key=lambda kv: kv[1]):
        print(f"  {key:<20} {seconds * 1e3:9.2f} ms  {seconds / best:5.2f}x")
    print(f"choice: {record['choice']}  -> {path}{note}")
