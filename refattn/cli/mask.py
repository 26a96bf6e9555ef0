"""``refattn mask``: build a visibility relation from coordinates and print it.

Owns the command-line spelling of :func:`refattn.masks.relation`; defers the predicate to
:mod:`refattn.masks` and the drawing to :func:`refattn.masks.render`.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from refattn.errors import RefAttnError
from refattn.masks import empty_rows, relation, render
from refattn.masks.packing import cu_seqlens_from_lengths, segments_from_cu_seqlens

__all__ = ["add_parser", "run"]


def _int(text: str, *, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    if value > _MAX:
        raise argparse.ArgumentTypeError(f"expected {what} of at most {_MAX}, got {text!r}")
    return value


#: the largest axis size or position accepted (a mask is drawn as text)
_MAX = 2**20


def _positive(text: str) -> int:
    return _int(text, low=1, what="a positive integer")


def _count(text: str) -> int:
    return _int(text, low=0, what="a non-negative integer")


def _bound(text: str) -> int | None:
    if text.lower() == "none":
        return None
    return _int(text, low=0, what="a non-negative integer or 'none'")


def _lengths(text: str) -> list[int]:
    values = [_count(x) for x in text.split(",") if x.strip()]  # empty sequences are allowed
    if not values:
        raise argparse.ArgumentTypeError(f"expected lengths L0,L1,..., got {text!r}")
    return values


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "mask",
        help="print a visibility relation built from coordinates (q\\k matrix)",
        description="Build a visibility relation from coordinates and print the q\\k matrix "
        "(1 = the query reads the key), or its manifest.",
        epilog="examples:\n"
        "  refattn mask --q 2 --k 5 --causal lower_right\n"
        "  refattn mask --lengths 3,2 --causal upper_left    # packed sequences\n"
        "  refattn mask --q 1 --k 8 --q-start 7 --manifest   # one decode step, as JSON",
    )
    p.add_argument("--q", type=_positive, help="query rows Q (default: K, or the packed total)")
    p.add_argument("--k", type=_positive, help="key rows K (default: Q, or the packed total)")
    p.add_argument("--causal", choices=["upper_left", "lower_right"],
                   help="causal relation with this alignment (named, never inferred)")
    p.add_argument("--q-start", type=_count, metavar="POS",
                   help="absolute position of the first query (cache decode; causal by "
                        "positions, keys at 0..K-1)")
    p.add_argument("--key-valid", type=_count, metavar="N",
                   help="only the first N keys are valid (the rest are padding / unused slots)")
    p.add_argument("--lengths", type=_lengths, metavar="L0,L1,...",
                   help="packed examples of these lengths: block-diagonal, positions reset")
    p.add_argument("--prefix", type=_count, metavar="P", help="prefix-LM boundary")
    p.add_argument("--window", nargs=2, type=_bound, metavar=("LEFT", "RIGHT"),
                   help="keys before / after the query ('none' = unbounded)")
    p.add_argument("--window-convention", choices=["excludes_query", "includes_query"],
                   default="excludes_query",
                   help="whether the window bounds count the query itself (xFormers, cuDNN)")
    p.add_argument("--manifest", action="store_true",
                   help="print the relation's JSON manifest instead of the matrix")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.lengths:
        seg = segments_from_cu_seqlens(cu_seqlens_from_lengths(args.lengths))
        total = seg.positions.size
        if args.q not in (None, total) or args.k not in (None, total):
            raise RefAttnError(f"--lengths: packed Q and K are the total length {total}")
        if args.causal == "lower_right" or args.q_start is not None:
            raise RefAttnError("--lengths: packed examples use per-example positions; "
                               "use --causal upper_left or no --causal")
        pos = seg.positions[None, :]
        ids = seg.segment_ids[None, :]
        rel = relation(pos, pos, causal=args.causal is not None, q_segment=ids, k_segment=ids,
                       prefix_length=args.prefix, window=args.window,
                       window_convention=args.window_convention)
    else:
        Q = args.q if args.q is not None else args.k
        K = args.k if args.k is not None else args.q
        if Q is None:
            raise RefAttnError("--q/--k: give at least one of them (or --lengths)")
        if args.q_start is not None and args.causal is not None:
            raise RefAttnError("--q-start: explicit positions replace --causal ALIGNMENT; "
                               "pass one of them")
        key_valid = None
        if args.key_valid is not None:
            key_valid = (np.arange(K) < args.key_valid)[None, :]
        offset = {"upper_left": 0, "lower_right": K - Q}.get(args.causal, 0)
        start = args.q_start if args.q_start is not None else offset
        rel = relation(
            (np.arange(Q) + start)[None, :], np.arange(K)[None, :], key_valid,
            causal=args.causal is not None or args.q_start is not None,
            prefix_length=args.prefix, window=args.window,
            window_convention=args.window_convention,
            layout="cache" if start != 0 else None, alignment=args.causal,
        )

    if args.manifest:
        print(json.dumps(rel.manifest(), indent=2, sort_keys=True))
        return 0
    dense = rel.dense()
    absolute = rel.layout == "cache"
    for h in range(rel.heads):
        if rel.heads > 1:
            print(f"head {h}:")
        print(render(
            dense[0, h],
            q_labels=rel.q_pos[0].tolist() if absolute else None,
            k_labels=rel.k_pos[0].tolist() if absolute else None,
        ))
    rows = empty_rows(dense)
    if rows:
        listed = ", ".join(f"(b={r.b}, h={r.h}, i={r.i})" for r in rows)
        print(f"rows with no legal key: {listed}")
    return 0
