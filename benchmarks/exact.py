"""Cost of correct rounding, and a fuzz run showing the exact backend decides every call.

Default: prints, measured in one run on this machine, the time to write the whole conformance
suite with ``refattn golden --backend exact`` and ``--backend numpy``, the rounding certificate
of the exact bundle (``refattn verify --exact``), and forward+backward of one
(1, 2, 128, 128, 64) call through ``"exact"`` and ``"numpy"`` with the backend's own estimate.

``--fuzz SECONDS``: random calls over every feature (score families with random parameters,
softcap, scale and its placements, ALiBi slopes, biases, dropout multipliers and Philox with
random p, sinks, cosine eps with clamped rows, GQA and head maps, Q != K, masks and unused
rows; continuous values, and dyadic or repeated values that land on rounding boundaries) for
that long. Each call's exact forward+backward must complete (the comparison with the NumPy
reference is tests/engine/test_exact_decides.py's). Prints the calls tried, the failures (the
first few described in full) and the slowest call. Exit status 1 if any exact call failed.

    python3 benchmarks/exact.py
    python3 benchmarks/exact.py --fuzz 600 [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
from timing import cpu_model  # benchmarks/ is the script's directory

import refattn
from refattn.engine.exact.backend import estimate_seconds


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- fuzz -------------------------------------------------------------------------------------
def _values(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """Continuous normals, dyadic values (multiples of 1/4: exact sums, ties), a few repeated
    values (equal scores, parallel rows), values of widely spread exponents, tiny values
    (subnormal products) or huge ones."""
    match kind:
        case "normal":
            return rng.standard_normal(shape) * rng.choice([0.3, 1.0, 3.0])
        case "dyadic":
            return rng.integers(-6, 7, shape) / 4.0
        case "repeated":
            return rng.choice(rng.standard_normal(2), shape)
        case "wide":  # exponents over 2**-300 .. 2**20: exact sums need thousands of bits
            return rng.standard_normal(shape) * 2.0 ** rng.integers(-300, 21, shape)
        case "tiny":  # products in the subnormal range and below
            return rng.standard_normal(shape) * 2.0 ** rng.integers(-1074, -400, shape)
        case "huge":  # scores near the largest binary64 the gate allows
            return rng.standard_normal(shape) * 2.0 ** rng.integers(100, 500, shape)
        case _:
            raise ValueError(kind)


def random_call(rng: np.random.Generator) -> tuple[refattn.AttentionCall, np.ndarray, str]:
    """One random valid call over every feature, its grad_output and a description."""
    from refattn.call.bias import alibi
    from refattn.call.scores import Additive, Bilinear, Cosine
    from refattn.dropout import Philox
    from refattn.masks import relation

    B, Hkv, group = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.integers(1, 3))
    Hq = Hkv * group
    Q, K = int(rng.integers(1, 5)), int(rng.integers(1, 6))
    Dk, Dv = int(rng.integers(1, 5)), int(rng.integers(1, 4))
    kind = str(rng.choice(["normal", "normal", "dyadic", "repeated", "wide", "tiny", "huge"]))
    q = _values(rng, (B, Hq, Q, Dk), kind)
    k = _values(rng, (B, Hkv, K, Dk), kind)
    v = _values(rng, (B, Hkv, K, Dv), kind)
    desc = [f"B={B} Hq={Hq} Hkv={Hkv} Q={Q} K={K} Dk={Dk} Dv={Dv} values={kind}"]
    if Q <= K and Hq == Hkv and rng.random() < 0.2:  # self attention: q rows equal k rows
        q = np.array(k[:, :, :Q], copy=True)
        desc.append("q=k rows")
    kw: dict[str, Any] = {}
    family = str(rng.choice(["dot", "dot", "bilinear", "additive", "cosine"]))
    if family == "bilinear":
        shape = (Dk, Dk) if rng.random() < 0.5 else (Hq, Dk, Dk)
        kw["score"] = Bilinear(_values(rng, shape, kind))
    elif family == "additive":
        Da = int(rng.integers(1, 4))
        kw["score"] = Additive(_values(rng, (Hq, Da, Dk), kind), _values(rng, (Hq, Da, Dk), kind),
                               _values(rng, (Hq, Da), kind), _values(rng, (Hq, Da), kind))
    elif family == "cosine":
        eps = float(math.exp(rng.uniform(math.log(1e-8), math.log(2.0))))
        kw["score"] = Cosine(eps)
        if rng.random() < 0.3:  # a row below eps: the clamped (linear) branch
            q[..., 0, :] *= eps * rng.uniform(0.0, 0.9) / max(np.abs(q[..., 0, :]).max(), 1e-300)
        desc.append(f"eps={eps:.6g}")
    desc.append(f"score={family}")
    if family != "dot" or rng.random() < 0.5:  # the other families need an explicit scale
        kw["scale"] = float(rng.choice([rng.uniform(0.05, 3.0), 0.5, 0.25]))
        desc.append(f"scale={kw['scale']!r}")
    # the cosine and additive scores are not bilinear: alpha stays after them
    kw["scale_placement"] = str(rng.choice(["post", "q", "k", "split"])) if family in (
        "dot", "bilinear") else "post"
    desc.append(f"placement={kw['scale_placement']}")
    if rng.random() < 0.5:
        kw["softcap"] = float(rng.choice([rng.uniform(0.3, 10.0), rng.uniform(10.0, 60.0), 2.0]))
        desc.append(f"softcap={kw['softcap']!r}")
    bias = str(rng.choice(["none", "full", "broadcast", "alibi", "alibi_batch"]))
    if bias == "full":
        kw["bias"] = _values(rng, (B, Hq, Q, K), kind)
    elif bias == "broadcast":
        kw["bias"] = _values(rng, (1, Hq, 1, K), kind)
    elif bias.startswith("alibi"):
        slopes = rng.uniform(0.0, 1.0, (B, Hq) if bias == "alibi_batch" else (Hq,))
        kw["bias"] = alibi(slopes, np.arange(Q) + (K - Q), np.arange(K))
    desc.append(f"bias={bias}")
    if rng.random() < 0.4:
        kw["sink"] = rng.uniform(-3.0, 3.0, Hq)
        desc.append("sink")
    full = (B, Hq, Q, K)
    mask = str(rng.choice(["none", "dense", "causal", "window"]))
    if mask == "dense":
        kw["visible"] = rng.random(full) < 0.6
    elif mask == "causal":
        kw["visible"] = relation(np.tile(np.arange(Q) + (K - Q), (B, 1)),
                                 np.tile(np.arange(K), (B, 1)), causal=True)
    elif mask == "window":
        kw["visible"] = relation(np.tile(np.arange(Q), (B, 1)), np.tile(np.arange(K), (B, 1)),
                                 window=(1, 1))
    desc.append(f"mask={mask}")
    used = np.ones((B, 1, Q, 1), dtype=bool)
    if rng.random() < 0.3:
        used = rng.random((B, 1, Q, 1)) < 0.7
        desc.append("query_valid")
    if mask != "none" and "sink" not in kw:  # a row with no legal key must be unused
        legal = np.broadcast_to(np.asarray(kw["visible"].dense() if mask != "dense"
                                           else kw["visible"]), full)
        used &= legal.any(axis=-1).all(axis=1)[:, None, :, None]
    if not used.all():
        kw["query_valid"] = used
        kw["all_masked_rows"] = "sanitize_then_zero_invalid_query"
    dropout = str(rng.choice(["none", "none", "explicit", "philox", "real"]))
    p = float(rng.uniform(0.0, 0.9))
    if dropout == "explicit":
        kw["dropout"] = (rng.random(full) >= p) / (1.0 - p)
    elif dropout == "philox":
        kw["dropout"] = Philox(p, int(rng.integers(0, 2**63)))
    elif dropout == "real":
        kw["dropout"] = rng.uniform(-1.0, 2.0, (1, 1, Q, K))
    desc.append(f"dropout={dropout}" + (f" p={p:.4g}" if dropout in ("explicit", "philox") else ""))
    if group > 1 and rng.random() < 0.3:
        kw["head_map"] = rng.integers(0, Hkv, Hq)
        desc.append("head_map")
    g_o = _values(rng, (B, Hq, Q, Dv), "normal" if kind == "huge" else kind)
    return refattn.AttentionCall(q, k, v, **kw), g_o, ", ".join(desc)


def fuzz(seconds: float, seed: int) -> int:
    """Random calls for ``seconds``; returns the number of exact failures."""
    from refattn.call.hazards import check_backward_overflow

    rng = np.random.default_rng(seed)
    tried, failed, invalid, overflow = 0, [], 0, 0
    slowest = (0.0, "")
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        try:
            call, g_o, desc = random_call(rng)
            check_backward_overflow(call, g_o)  # refattn.backward's own up-front check
        except refattn.RefAttnError:
            invalid += 1  # a combination the gate refuses (e.g. an overflowing score bound)
            continue
        tried += 1
        t0 = time.perf_counter()
        try:
            t = refattn.forward(call, backend="exact")
            refattn.backward(t, g_o)
        except refattn.RefAttnError as exc:
            if "overflows binary64 (its exact value exceeds" in str(exc):
                overflow += 1  # the documented refusal of a value beyond binary64, by name
                continue
            failed.append(f"{desc}\n    {type(exc).__name__}: {exc}")
            continue
        except Exception as exc:  # every failure is counted and described
            failed.append(f"{desc}\n    {type(exc).__name__}: {exc}\n" +
                          "".join(traceback.format_exception(exc)[-3:]))
            continue
        dt = time.perf_counter() - t0
        if dt > slowest[0]:
            slowest = (dt, desc)
    elapsed = time.perf_counter() - start
    print(f"exact fuzz: {elapsed:.0f} s, seed {seed}, on {cpu_model()}")
    print(f"  calls tried: {tried} (and {invalid} random combinations the gate refused)")
    print(f"  exact values beyond binary64, refused by tensor and element: {overflow}")
    print(f"  exact failures (undecided or any error): {len(failed)}")
    for f in failed[:5]:
        print(f"    {f}")
    print(f"  slowest call: {slowest[0]:.3f} s: {slowest[1]}")
    return len(failed)


# -- cost ---------------------------------------------------------------------------------------
def cost() -> None:
    from threadpoolctl import threadpool_info

    from refattn.bundle.suites import build_suite
    from refattn.bundle.verification.verifier import verify
    from refattn.bundle.writing.write import write_bundle

    blas = [f"{i.get('internal_api')} {i.get('version')} {i.get('architecture')}"
            for i in threadpool_info() if i.get("user_api") == "blas"]
    print(f"CPU: {cpu_model()}; BLAS: {', '.join(blas)}; numpy {np.__version__}")
    cases = build_suite("conformance")
    with tempfile.TemporaryDirectory() as tmp:
        suite = {b: timed(lambda b=b: write_bundle(Path(tmp) / b, cases, suite="conformance",
                                                   backend=b)) for b in ("numpy", "exact")}
        cert = timed(lambda: verify(Path(tmp) / "exact", gradcheck=False, exact=True))
    print(f"\nrefattn golden, conformance suite ({len(cases)} cases), reference errors included")
    print(f"  {'numpy':<8} {suite['numpy']:8.2f} s")
    print(f"  {'exact':<8} {suite['exact']:8.2f} s   ({suite['exact'] / suite['numpy']:.1f}x)")
    print(f"  rounding certificate of the exact bundle (verify --exact, no gradcheck): "
          f"{cert:.2f} s")

    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((1, 2, 128, 64)) for _ in range(4))
    call = refattn.AttentionCall(q, k, v)
    print("\nforward+backward of one (B, Hq, Q, K, D) = (1, 2, 128, 128, 64) call")
    for backend in ("numpy", "exact"):
        seconds = timed(lambda b=backend: refattn.backward(refattn.forward(call, backend=b), g))
        print(f"  {backend:<8} {seconds:8.3f} s")
    print(f"  exact backend's own estimate: {estimate_seconds(call):.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fuzz", type=float, metavar="SECONDS",
                        help="random calls over every feature for SECONDS instead of the cost")
    parser.add_argument("--seed", type=int, default=0, help="fuzz seed (default 0)")
    args = parser.parse_args()
    if args.fuzz is None:
        cost()
    else:
        sys.exit(1 if fuzz(args.fuzz, args.seed) else 0)


if __name__ == "__main__":
    main()
