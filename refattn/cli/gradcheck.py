"""``refattn gradcheck``: run the autograd-free gradient checker on refattn's own backward.

Builds a seeded random call of the requested shape (optionally causal, with a bias, with the
Philox dropout stream), checks ``refattn.backward`` with :func:`gradcheck.check_vjp` and the
attention identities, and prints both reports. Exit status 0 when everything passes, 1 when
a check fails. Defers all checking to :mod:`gradcheck`.
"""

from __future__ import annotations

import argparse
from typing import Literal

import numpy as np

from gradcheck.attention import check_attention
from gradcheck.identities import attention_identities
from refattn.call import AttentionCall
from refattn.cli.verify import integer_value
from refattn.dropout import Philox
from refattn.engine import backward, forward
from refattn.engine.memory import available_bytes
from refattn.errors import RefAttnError
from refattn.masks import causal as causal_relation

__all__ = ["add_parser", "build_call", "run"]

AXES = ("B", "Hq", "Hkv", "Q", "K", "Dk", "Dv")
#: the most random directions per input (each costs a numeric derivative)
MAX_DIRECTIONS = 10_000


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected seven integers B,Hq,Hkv,Q,K,Dk,Dv, got {text!r}") from None
    if len(dims) != len(AXES) or min(dims) < 1:
        raise argparse.ArgumentTypeError(
            f"expected seven positive integers B,Hq,Hkv,Q,K,Dk,Dv, got {text!r}")
    return dims


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**64), got {text!r}") \
            from None
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**64), got {text!r}")
    return value


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a dropout probability in [0, 1), got "
                                         f"{text!r}")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gradcheck", help="check refattn's backward with the gradient checker",
        description="Build a seeded random call of the given shape and check refattn's "
        "hand-written backward against numeric derivatives (complex step or Richardson central "
        "differences; every element or random directions) and the attention identities. Exit "
        "0 when everything passes, 1 when a check fails.",
        epilog="examples:\n"
        "  refattn gradcheck --shape 1,2,1,3,4,8,8\n"
        "  refattn gradcheck --shape 1,2,1,3,4,8,8 --causal upper_left --dropout 0.1 --seed 7\n"
        "  refattn gradcheck --shape 2,4,2,16,16,8,8 --mode directional --method central",
    )
    p.add_argument("--shape", required=True, type=_shape, metavar="B,Hq,Hkv,Q,K,Dk,Dv",
                   help="axis sizes of the random call")
    p.add_argument("--causal", choices=("upper_left", "lower_right"), default=None,
                   metavar="ALIGN", help="causal visibility with this alignment "
                   "(upper_left or lower_right)")
    p.add_argument("--dropout", type=_probability, default=0.0, metavar="P",
                   help="dropout probability of the Philox stream (default 0: off)")
    p.add_argument("--seed", type=_seed, default=0, metavar="S", help="dropout stream seed")
    p.add_argument("--bias", choices=("none", "full", "broadcast"), default="none",
                   help="add a (B,Hq,Q,K) bias or a (1,Hq,1,K) broadcast bias")
    p.add_argument("--data-seed", type=_seed, default=0, help="seed of the random q, k, v, bias")
    p.add_argument("--mode", choices=("auto", "full", "directional"), default="auto",
                   help="every element (full), signed random directions (directional), or "
                   "auto: full when small")
    p.add_argument("--method", choices=("auto", "complex_step", "central"), default="auto",
                   help="numeric derivative: complex_step, central (Richardson central "
                   "differences), or auto: complex step where the function is complex-safe")
    p.add_argument("--directions", type=integer_value(1, MAX_DIRECTIONS), default=3,
                   help="random directions per input in directional mode (1 to "
                   f"{MAX_DIRECTIONS})")
    p.add_argument("--check-seed", type=_seed, default=0,
                   help="seed of the checker's cotangents and directions")
    p.add_argument("--no-identities", action="store_true",
                   help="skip the attention identities")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar (one is drawn only on a terminal anyway)")
    p.set_defaults(func=run)


def build_call(
    shape: tuple[int, ...],
    *,
    causal: Literal["upper_left", "lower_right"] | None = None,
    dropout: float = 0.0,
    seed: int = 0,
    bias: str = "none",
    data_seed: int = 0,
):
    """The seeded random :class:`~refattn.AttentionCall` the command checks.

    Rows left without a legal key (lower-right causal with Q > K) become unused query rows
    under the ``sanitize_then_zero_invalid_query`` policy.

    Examples
    --------
    >>> call = build_call((1, 2, 1, 3, 4, 5, 6), causal="upper_left", dropout=0.25, seed=7)
    >>> call.axes["Dv"], call.visible.shape, call.dropout.p
    (6, (1, 1, 3, 4), 0.25)
    """
    B, Hq, Hkv, Q, K, Dk, Dv = shape
    # refuse before drawing the inputs: the checker holds about 16 (B, Hq, Q, K) arrays
    need = 8 * (16 * B * Hq * Q * K + B * (Hq * Q + 2 * Hkv * K) * (Dk + Dv))
    have = available_bytes()
    if have is not None and need > have:
        raise RefAttnError(f"--shape: {','.join(map(str, shape))} needs about {need} bytes, "
                           f"more than the {have} bytes of memory available")
    rng = np.random.default_rng(data_seed)
    q = rng.standard_normal((B, Hq, Q, Dk))  # (B, Hq, Q, Dk)
    k = rng.standard_normal((B, Hkv, K, Dk))  # (B, Hkv, K, Dk)
    v = rng.standard_normal((B, Hkv, K, Dv))  # (B, Hkv, K, Dv)
    kw: dict = {}
    if causal is not None:
        vis = np.asarray(causal_relation(Q, K, alignment=causal).dense())  # (1, 1, Q, K)
        kw["visible"] = vis
        empty = ~vis.any(axis=-1, keepdims=True)  # (1, 1, Q, 1)
        if empty.any():
            kw["query_valid"] = ~empty
            kw["all_masked_rows"] = "sanitize_then_zero_invalid_query"
    match bias:
        case "none":
            pass
        case "full":
            kw["bias"] = rng.standard_normal((B, Hq, Q, K))
        case "broadcast":
            kw["bias"] = rng.standard_normal((1, Hq, 1, K))
        case _:
            raise RefAttnError(f"bias: expected none, full or broadcast, got {bias!r}")
    if dropout:
        kw["dropout"] = Philox(dropout, seed=seed)
    return AttentionCall(q, k, v, **kw)


def run(args: argparse.Namespace) -> int:
    call = build_call(args.shape, causal=args.causal, dropout=args.dropout, seed=args.seed,
                      bias=args.bias, data_seed=args.data_seed)
    axes = ", ".join(f"{a}={n}" for a, n in call.axes.items())
    extras = [f"causal {args.causal}" if args.causal else None,
              f"dropout p={args.dropout} seed={args.seed}" if args.dropout else None,
              f"bias {args.bias}" if args.bias != "none" else None]
    print(f"refattn gradcheck: {axes}" + "".join(f"; {e}" for e in extras if e))
    report = check_attention(call, mode=args.mode, method=args.method,
                             directions=args.directions, seed=args.check_seed,
                             progress=False if args.quiet else None)
    print(report)
    ok = report.passed
    if not args.no_identities:
        trace = forward(call)
        g_o = np.random.default_rng([args.check_seed, 1]).standard_normal(trace.output.shape)
        ids = attention_identities(trace, backward(trace, g_o), seed=args.check_seed)
        print()
        print(ids)
        ok = ok and ids.passed
    return 0 if ok else 1
