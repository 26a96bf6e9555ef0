"""``refattn diagnostics``: per-head row diagnostics of the probabilities in a golden case.

Owns the summary of a case file (which rows count, stratification by head, text and JSON
output); defers reading and checksum verification to :func:`refattn.bundle.load` and the per-row
statistics to :func:`refattn.softmax.diagnostics`. The summarised object is P, the pre-dropout
probabilities, over the rows a call consumes: rows that the ``sanitize_then_zero_invalid_query``
policy gave a temporary key, and rows whose ``query_valid`` is False, are counted but left out.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from refattn._checks import INT64_MAX
from refattn.bundle.storage.read import load
from refattn.cli.verify import integer_value
from refattn.errors import RefAttnError
from refattn.softmax import diagnostics

__all__ = ["add_parser", "run", "summarize"]

_STATS = ("entropy", "normalized_entropy", "effective_support", "top_k_mass", "max_probability",
          "logit_gap")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diagnostics",
        help="summarise the attention rows of golden case files (entropy, support, top-k, gap)",
        description="Per-head diagnostics of the pre-dropout probabilities P of golden cases: "
        "entropy, normalised entropy, effective support exp(H), top-k mass, maximum "
        "probability, logit gap and underflowed legal keys.",
        epilog="examples:\n"
        "  refattn diagnostics goldens/cases/loop6_two_query_training_trace.safetensors\n"
        "  refattn diagnostics goldens --k 4 --json",
    )
    p.add_argument("cases", nargs="+", type=Path,
                   help="case files (DIR/cases/<id>.safetensors) or bundle directories")
    p.add_argument("--k", type=integer_value(1, INT64_MAX), default=2,
                   help="k of the top-k mass (default: 2)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead")
    p.set_defaults(func=run)


def _case_files(paths: list[Path]) -> list[Path]:
    out: list[Path] = []
    for path in paths:
        if path.is_dir():
            files = sorted((path / "cases").glob("*.safetensors"))
            if not files:
                raise RefAttnError(f"{path}: no cases/*.safetensors in this bundle directory")
            out.extend(files)
        else:
            out.append(path)
    return out


def _stat_block(values: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, Any]:
    """Summary numbers over the selected rows (JSON-safe: inf becomes None)."""

    def num(x: float) -> float | None:
        return float(x) if math.isfinite(x) else None

    n = int(rows.sum())
    block: dict[str, Any] = {"rows": n}
    if n == 0:
        return block
    for name in _STATS:
        v = values[name][rows]
        finite = v[np.isfinite(v)]
        block[name] = {
            "mean": num(float(finite.mean())) if finite.size else None,
            "min": num(float(v.min())),
            "median": num(float(np.median(v))),
            "max": num(float(v.max())),
        }
    block["logit_gap"]["infinite_rows"] = int((~np.isfinite(values["logit_gap"][rows])).sum())
    block["n_legal"] = {"min": int(values["n_legal"][rows].min()),
                        "max": int(values["n_legal"][rows].max())}
    block["underflowed_legal_keys"] = int(values["n_underflow"][rows].sum())
    return block


def summarize(path: str | Path, *, k: int = 2) -> dict[str, Any]:
    """Diagnostics summary of one golden case file, stratified by query head.

    Parameters
    ----------
    path : path
        ``DIR/cases/<case_id>.safetensors`` written by ``refattn golden``.
    k : int
        k of the top-k mass.

    Returns
    -------
    dict
        ``case_id``, ``k``, row counts (``rows``, ``consumed``, ``sanitized``, ``unused``), an
        ``overall`` block and one block per query head; every statistic has mean (over finite
        values), min, median and max. JSON-serialisable (no NaN or infinity).

    Raises
    ------
    RefAttnError
        If the file fails its checks or holds no probabilities.

    Examples
    --------
    >>> import tempfile
    >>> from refattn.bundle.writing.write import write_bundle
    >>> from refattn.bundle.suites.contract import cases
    >>> with tempfile.TemporaryDirectory() as out:
    ...     _ = write_bundle(out, cases()[:1], suite="contract")
    ...     s = summarize(f"{out}/cases/loop6_two_query_training_trace.safetensors")
    >>> s["consumed"], s["overall"]["n_legal"], round(s["overall"]["max_probability"]["max"], 6)
    (2, {'min': 2, 'max': 3}, 0.753474)
    """
    case = load(path)
    t = case.tensors
    if "probs" not in t:
        raise RefAttnError(f"{path}: case {case.case_id!r} has no 'probs' tensor to summarise")
    probs = t["probs"]  # (B, Hq, Q, K)
    if probs.ndim != 4:
        raise RefAttnError(f"{path}: probs has shape {list(probs.shape)}, expected (B, Hq, Q, K)")
    B, Hq, Q, K = probs.shape
    visible = np.broadcast_to(t.get("visible", np.True_), probs.shape)
    sanitized = np.broadcast_to(t.get("sanitized_rows", np.False_), (B, Hq, Q))
    # the forward gave sanitized rows the temporary key 0: that is their support in P
    support = visible | (sanitized[..., None] & (np.arange(K) == 0))  # (B, Hq, Q, K)
    query_valid = np.broadcast_to(t.get("query_valid", np.True_), (B, 1, Q, 1))
    used = np.broadcast_to(query_valid[..., 0], (B, Hq, Q))
    consumed = used & ~sanitized  # (B, Hq, Q) rows the call actually consumes

    d = diagnostics(probs, support, k=k)
    values = {name: getattr(d, name) for name in (*_STATS, "n_legal", "n_underflow")}
    heads = []
    for h in range(Hq):
        rows = np.zeros((B, Hq, Q), bool)
        rows[:, h] = consumed[:, h]
        heads.append({"head": h, **_stat_block(values, rows)})
    return {
        "case_id": case.case_id,
        "object": "pre_dropout_probabilities",
        "k": int(k),
        "shape": {"B": B, "Hq": Hq, "Q": Q, "K": K},
        "rows": int(B * Hq * Q),
        "consumed": int(consumed.sum()),
        "sanitized": int(sanitized.sum()),
        "unused": int((~used & ~sanitized).sum()),
        "overall": _stat_block(values, consumed),
        "heads": heads,
    }


def _fmt(x: float | None, width: int = 8) -> str:
    return f"{'inf' if x is None else f'{x:.4g}':>{width}}"


def _text(summary: dict[str, Any]) -> str:
    s = summary
    lines = [
        f"case {s['case_id']}: P (pre-dropout) {s['shape']}; {s['consumed']} of {s['rows']} "
        f"rows consumed ({s['sanitized']} sanitized, {s['unused']} unused)",
        f"{'head':>7} {'rows':>5} {'n_legal':>9} {'H':>8} {'H/logn':>8} {'exp(H)':>8} "
        f"{'top' + str(s['k']):>8} {'max p':>8} {'gap med':>8} {'gap inf':>7} {'underfl':>7}",
    ]
    for label, block in [*((f"h={b['head']}", b) for b in s["heads"]), ("all", s["overall"])]:
        if block["rows"] == 0:
            lines.append(f"{label:>7} {0:>5}  (no consumed rows)")
            continue
        nl = block["n_legal"]
        lines.append(
            f"{label:>7} {block['rows']:>5} {str(nl['min']) + '-' + str(nl['max']):>9} "
            f"{_fmt(block['entropy']['mean'])} {_fmt(block['normalized_entropy']['mean'])} "
            f"{_fmt(block['effective_support']['mean'])} {_fmt(block['top_k_mass']['mean'])} "
            f"{_fmt(block['max_probability']['mean'])} {_fmt(block['logit_gap']['median'])} "
            f"{block['logit_gap']['infinite_rows']:>7} {block['underflowed_legal_keys']:>7}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    summaries = [summarize(path, k=args.k) for path in _case_files(args.cases)]
    if args.json:
        print(json.dumps(summaries if len(summaries) > 1 else summaries[0], indent=2,
                         allow_nan=False))
    else:
        print("\n\n".join(_text(s) for s in summaries))
    return 0
