"""What each feature of the contract costs on the numba fast path, and what its fallback costs.

For one moderate shape it times ``refattn.value_and_grad`` forward+backward on the numba backend
and on the NumPy reference, side by side in interleaved rounds, for the plain dot score and
every feature the contract adds: softcap, a sink, the bilinear and cosine families, the q/k/
split scale placements, a per-element bias (with its gradient), Philox dropout, GQA, causal
visibility -- and the additive family, the one documented fallback (its pair tensor is
(B, Hq, Q, K, Da); the numba backend runs the reference on it). Each line prints the numba time,
its cost over the plain dot call, and the speed-up over the reference.

Usage::

    python3 benchmarks/feature_cost.py               # (1, 4, 512, 512, 64)
    python3 benchmarks/feature_cost.py --shape 1,8,1024,1024,64
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from timing import interleaved  # noqa: E402  (benchmarks/ is the script's directory)

import refattn  # noqa: E402
from refattn.call.scores import Additive, Bilinear, Cosine  # noqa: E402
from refattn.dropout import Philox  # noqa: E402
from refattn.masks import causal  # noqa: E402


def features(B: int, H: int, L: int, D: int) -> dict[str, dict[str, Any]]:
    """Keyword arguments of AttentionCall per feature (q, k, v included)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, L, D)) for _ in range(3))
    base = {"q": q, "k": k, "v": v}
    Da = 16
    return {
        "dot": base,
        "softcap": {**base, "softcap": 5.0},
        "sink": {**base, "sink": rng.standard_normal(H)},
        "bilinear": {**base, "score": Bilinear(rng.standard_normal((H, D, D)) / np.sqrt(D)),
                     "scale": D ** -0.5},
        "cosine": {**base, "score": Cosine(), "scale": 8.0},
        "placement q": {**base, "scale_placement": "q"},
        "placement split": {**base, "scale_placement": "split"},
        "bias (B,H,Q,K)": {**base, "bias": rng.standard_normal((B, H, L, L))},
        "dropout philox": {**base, "dropout": Philox(p=0.1, seed=7)},
        "GQA 4:1": {**base, "k": k[:, : max(1, H // 4)], "v": v[:, : max(1, H // 4)]},
        "causal": {**base, "visible": causal(L, L, alignment="upper_left")},
        "additive (fallback)": {**base, "scale": 1.0, "score": Additive(
            rng.standard_normal((H, Da, D)) / np.sqrt(D), rng.standard_normal((H, Da, D)) /
            np.sqrt(D), rng.standard_normal((H, Da)), rng.standard_normal((H, Da)))},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="1,4,512,64", help="B,H,L,D (default 1,4,512,64)")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    B, H, L, D = (int(x) for x in args.shape.split(","))
    rng = np.random.default_rng(1)
    g = rng.standard_normal((B, H, L, D))
    fns: dict[str, Callable[[], Any]] = {}
    for name, kwargs in features(B, H, L, D).items():
        call = refattn.AttentionCall(**kwargs)
        for backend in ("numba", "numpy"):
            fns[f"{name}|{backend}"] = (
                lambda call=call, backend=backend: refattn.value_and_grad(call, g,
                                                                          backend=backend))
    med = {name: r["median"] for name, r in
           interleaved(fns, min_rounds=args.rounds).items()}
    dot = med["dot|numba"]
    print(f"value_and_grad forward+backward at (B, H, L, D) = {(B, H, L, D)}, medians of "
          f"{args.rounds} interleaved rounds")
    print(f"{'feature':>22} | {'numba s':>9} {'/ dot':>6} | {'numpy s':>9} | {'numpy/numba':>11}")
    for name in features(1, 4, 8, 4):
        n, r = med[f"{name}|numba"], med[f"{name}|numpy"]
        print(f"{name:>22} | {n:9.4f} {n / dot:6.2f} | {r:9.4f} | {r / n:11.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
