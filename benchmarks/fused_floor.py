"""Where the fused kernel's time goes: its six GEMMs alone, each GEMM alone, the row pass, and a
memory copy of the row pass's bytes.

Owns ``_gemms``, an ``@njit(parallel=True)`` kernel that walks exactly the tasks, query blocks and
visible key ranges of :func:`refattn.engine.numba.fused.fused_value_and_grad` (same provider,
thread layout and block size, from :func:`~refattn.engine.numba.fused_host.task_layout`) and
issues a chosen subset of its six products (``S = Q K^T``, ``O = P V``, ``dV += P^T dO``,
``dP = dO V^T``, ``dQ = dS K``, ``dK += dS^T Q``) with no row work; and ``_copy``, which copies
the same score blocks in the same layout. :func:`breakdown` times, interleaved in rounds:

- ``fused``: the real kernel (``fused_host.value_and_grad``);
- ``gemms``: all six products, no row work -- the floor of this algorithm on this BLAS;
- each product alone (its GFLOP/s at the attention shape, less ``launch``: the same kernel
  issuing no product);
- ``copy``: a plain copy of the bytes the row pass moves. Per visible score element the forward
  row pass reads S and writes P (one copy's worth), the backward reads P and dP and writes dS
  (one and a half): 2.5 copies of the block, which ``_copy`` performs.

``row pass = fused - gemms`` (everything that is not a product: softmax, D, dS, tile
classification). ``--dgemm`` adds square DGEMM to the same rounds (each product's fraction of
it); ``--whole`` adds the fused kernel with every product issued whole, as before the
small-matrix tiles of ``O``, ``dV``, ``dQ`` and ``dK`` (issue 27). Usage::

    python3 benchmarks/fused_floor.py                  # the issue's shapes
    python3 benchmarks/fused_floor.py --shape 1,16,16,2048,2048,128 --causal
    python3 benchmarks/fused_floor.py --dgemm --whole --shape 1,8,8,4096,4096,64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numba
import numpy as np
from numba import njit, prange

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from timing import interleaved  # noqa: E402

from refattn import AttentionCall  # noqa: E402
from refattn._progress import progress  # noqa: E402
from refattn.engine.numba import providers  # noqa: E402
from refattn.engine.numba.blas import gemm, gemm_pair, gemm_split  # noqa: E402
from refattn.engine.numba.calibration import current_provider  # noqa: E402
from refattn.engine.numba.fused_host import (  # noqa: E402
    KEY_CHUNK,
    running,
    score_stride,
    split_tiles,
    task_layout,
    value_and_grad,
)
from refattn.engine.numba.operands import address  # noqa: E402
from refattn.masks import causal as causal_relation  # noqa: E402

__all__ = ["PRODUCTS", "breakdown"]

PRODUCTS = ("S=QK^T", "O=PV", "dV+=P^TdO", "dP=dOV^T", "dQ=dSK", "dK+=dS^TQ")


@njit(cache=True)
def _pair(fptr, which, bq, kn, a, LD, b1, c1, b2, c2, D, split):
    """One pair of the kernel's products on the score block ``a`` (bq x kn, stride LD): bit 0 of
    ``which`` enables ``C1 = A B1`` (O = P V, dQ = dS K; bq x D), bit 1 ``C2 += A^T B2``
    (dV += P^T dO, dK += dS^T Q; kn x D), both together slab by slab (``gemm_pair``) as the
    kernel issues them, in the kernel's tiles ``split`` (cm1, ck1, cm2, ck2)."""
    if which & 3 == 3:
        gemm_pair(fptr, bq, kn, a, LD, 1.0, b1, D, 0.0, c1, 1.0, b2, D, c2, split[0], split[1],
                  split[2], split[3])
    elif which & 1:
        gemm_split(fptr, False, False, bq, D, kn, 1.0, a, LD, b1, D, 0.0, c1, D, split[0],
                   split[1])
    elif which & 2:
        gemm_split(fptr, True, False, kn, D, bq, 1.0, a, LD, b2, D, 1.0, c2, D, split[2],
                   split[3])


@njit(cache=True, parallel=True)
def _gemms(q, k, v, g_o, head_map, BQ, KC, LD, LP, C, causal, which, fptr, split, s_ws, w_ws,
           out, dq, dk, dv):
    """The fused kernel's products (bit p of ``which`` enables ``PRODUCTS[p]``), no row work,
    issued as the kernel issues them: S whole on score rows of stride ``LD``; O, dV, dQ and dK
    in the kernel's tiles (``split``), O with dV and dQ with dK slab by slab (``gemm_pair``)
    where both of a pair run; dP per key chunk of ``KC`` into a slab of stride ``LP``."""
    B, Hq, Q, Dk = q.shape
    Hkv, K = k.shape[1], k.shape[2]
    Dv = v.shape[3]
    nqb = (Q + BQ - 1) // BQ
    for task in prange(B * Hkv * C):
        c = task % C
        bg = task // C
        b = bg // Hkv
        g = bg - b * Hkv
        tid = numba.get_thread_id()
        s, w = s_ws[tid], w_ws[tid]
        for h in range(Hq):
            if head_map[h] != g:
                continue
            for qb in range(c, nqb, C):
                i0 = qb * BQ
                bq = min(BQ, Q - i0)
                kn = min(K, (i0 + bq + KC - 1) // KC * KC) if causal else K  # visible keys
                if which & 1:
                    gemm(fptr, False, True, bq, kn, Dk, 1.0, address(q, b, h, i0), Dk,
                         address(k, b, g, 0), Dk, 0.0, s.ctypes.data, LD)
                _pair(fptr, which >> 1, bq, kn, s.ctypes.data, LD, address(v, b, g, 0),
                      address(out, b, h, i0), address(g_o, b, h, i0), address(dv, c, b, g), Dv,
                      split[0:4])
                if which & 8:
                    for j0 in range(0, kn, KC):
                        gemm(fptr, False, True, bq, min(KC, kn - j0), Dv, 1.0,
                             address(g_o, b, h, i0), Dv, address(v, b, g, j0), Dv, 0.0,
                             w.ctypes.data, LP)
                _pair(fptr, which >> 4, bq, kn, s.ctypes.data, LD, address(k, b, g, 0),
                      address(dq, b, h, i0), address(q, b, h, i0), address(dk, c, b, g), Dk,
                      split[4:8])


@njit(cache=True, parallel=True)
def _copy(B, Hq, Hkv, Q, K, head_map, BQ, KC, C, causal, s_ws, w_ws):
    """2.5 copies of every visible score block, in the fused kernel's task layout."""
    nqb = (Q + BQ - 1) // BQ
    for task in prange(B * Hkv * C):
        c = task % C
        g = (task // C) % Hkv
        tid = numba.get_thread_id()
        s, w = s_ws[tid], w_ws[tid]
        for h in range(Hq):
            if head_map[h] != g:
                continue
            for qb in range(c, nqb, C):
                bq = min(BQ, Q - qb * BQ)
                kn = min(K, (qb * BQ + bq + KC - 1) // KC * KC) if causal else K
                for r in range(bq):  # forward: read S, write P (one copy)
                    w[r, :kn] = s[r, :kn]
                half = kn // 2
                for r in range(bq):  # backward: read P and dP, write dS (one and a half)
                    s[r, :kn] = w[r, :kn]
                    w[r, :half] = s[r, :half]


def _ds_operands(shape: tuple[int, ...], causal: bool) -> tuple[AttentionCall, np.ndarray]:
    B, Hq, Hkv, Q, K, D = shape
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, h, n, D)) for h, n in ((Hq, Q), (Hkv, K), (Hkv, K)))
    visible = causal_relation(Q, K, alignment="upper_left") if causal else None
    return AttentionCall(q, k, v, visible=visible), rng.standard_normal((B, Hq, Q, D))


def visible_elements(shape: tuple[int, ...], causal: bool) -> int:
    """Score elements a causal (upper-left) or full call computes: B * Hq * visible pairs."""
    B, Hq, _, Q, K, _ = shape
    pairs = sum(min(K, i + 1) for i in range(Q)) if causal else Q * K
    return B * Hq * pairs


def breakdown(shape: tuple[int, ...], *, causal: bool = False, rounds: int = 5,
              provider: Any = None, dgemm: bool = False, whole: bool = False) -> dict[str, Any]:
    """Time the fused kernel, its six products together and alone, and the row-pass copy.

    ``shape`` is (B, Hq, Hkv, Q, K, D). Returns medians and minima (seconds), GFLOP/s of each
    product, the row pass (fused - gemms) in ns per visible element and over the copy time.
    ``dgemm``: also time square DGEMM (3072^2, scipy's BLAS on its default threads) as one more
    variant of the same interleaved rounds (``dgemm_gflops``, from its median). ``whole``:
    also time the fused kernel with every product issued whole (no small-matrix tiles, as
    before issue 27) in the same rounds, as ``fused_whole``.
    """
    provider = provider or current_provider()
    call, g_o = _ds_operands(shape, causal)
    B, Hq, Hkv, Q, K, D = shape
    lay = task_layout(call, provider, provider.budget)
    C, nt = lay.chunks, lay.threads
    out, dq = np.zeros((B, Hq, Q, D)), np.zeros((B, Hq, Q, D))
    dk, dv = np.zeros((C, B, Hkv, K, D)), np.zeros((C, B, Hkv, K, D))
    q, k, v = call.q, call.k, call.v
    LD, LP = score_stride(K), score_stride(min(KEY_CHUNK, K))
    s_ws = np.ones((nt, lay.block_q * LD))  # held, as fused's (there 64-byte aligned)
    w_ws = np.ones((nt, lay.block_q * LD))  # _copy's second block; the dP slab is its start
    split = split_tiles(provider, lay, D, D)  # the kernel's tiles of O, dV, dQ, dK

    def products(which: int):
        def run() -> None:
            with running(lay, provider):
                _gemms(q, k, v, g_o, call.head_map, lay.block_q, KEY_CHUNK, LD, LP, C, causal,
                       which, provider.address, split, s_ws, w_ws, out, dq, dk, dv)
        return run

    def copy() -> None:
        with running(lay, provider):
            _copy(B, Hq, Hkv, Q, K, call.head_map, lay.block_q, KEY_CHUNK, C, causal,
                  s_ws.reshape((nt, lay.block_q, LD)), w_ws.reshape((nt, lay.block_q, LD)))

    fns = {"fused": lambda: value_and_grad(call, g_o, provider=provider), "gemms": products(63),
           "copy": copy, "launch": products(0)}
    fns |= {name: products(1 << p) for p, name in enumerate(PRODUCTS)}
    if dgemm:
        fns["dgemm"] = square_dgemm_call()
    if whole:
        fns["fused_whole"] = _whole_products(lambda: value_and_grad(call, g_o, provider=provider))
    t = interleaved(fns, min_rounds=rounds, settle=0.1)
    med = {name: (r["median"], r["min"]) for name, r in t.items()}
    # one product's flops: 2 x visible score elements x D (kn rounds up to KEY_CHUNK: ignored)
    elements = visible_elements(shape, causal)
    flops = 2.0 * elements * D
    row = med["fused"][0] - med["gemms"][0]
    return {
        "shape": list(shape), "causal": causal, "provider": provider.record(),
        "layout": lay._asdict(), "split_tiles": split.tolist(),
        "seconds": {name: {"median": m, "min": n} for name, (m, n) in med.items()},
        "gemm_gflops": {p: flops / (med[p][0] - med["launch"][0]) / 1e9 for p in PRODUCTS},
        "gemms_gflops": 6 * flops / med["gemms"][0] / 1e9,
        "row_pass_s": row, "row_pass_share": row / med["fused"][0],
        "row_pass_ns_per_element": row / elements * 1e9 * nt,
        "row_pass_over_copy": row / med["copy"][0],
        "dgemm_gflops": 2 * 3072**3 / med["dgemm"][0] / 1e9 if dgemm else None,
    }


def format_breakdown(r: dict[str, Any]) -> list[str]:
    """Lines for one :func:`breakdown` record."""
    s = r["seconds"]
    lay = r["layout"]
    lines = [
        f"  fused {s['fused']['median']:.4f} s = six GEMMs {s['gemms']['median']:.4f} s "
        f"({r['gemms_gflops']:.1f} GF/s) + row pass {r['row_pass_s']:.4f} s "
        f"({100 * r['row_pass_share']:.0f}%, {r['row_pass_ns_per_element']:.2f} ns/element "
        f"per thread; {r['row_pass_over_copy']:.2f}x a copy of its bytes, "
        f"copy {s['copy']['median']:.4f} s)  [block {lay['block_q']} rows, "
        f"{lay['chunks']} chunks, {lay['threads']} numba x {lay['blas_threads']} BLAS threads; "
        f"O/dV/dQ/dK tiles {r['split_tiles']}]",
        "  per GEMM alone (GF/s): " + ", ".join(
            f"{p} {g:.1f}" for p, g in r["gemm_gflops"].items()),
    ]
    return lines


ISSUE_SHAPES = [((1, 8, 8, 512, 512, 64), False), ((2, 8, 8, 1024, 1024, 64), False),
                ((1, 16, 16, 2048, 2048, 128), False), ((1, 8, 8, 4096, 4096, 64), False),
                ((1, 16, 16, 2048, 2048, 128), True), ((1, 32, 8, 2048, 2048, 128), False)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", help="B,Hq,Hkv,Q,K,D (default: the issue's shapes)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dgemm", action="store_true",
                   help="also time square DGEMM on the kernels' BLAS (scipy's), in each shape's "
                        "rounds, and print each product's fraction of it")
    p.add_argument("--whole", action="store_true",
                   help="also time the fused kernel with its products whole (no small-matrix "
                        "tiles) in the same rounds")
    args = p.parse_args(argv)
    cases = ISSUE_SHAPES
    if args.shape:
        cases = [(tuple(int(x) for x in args.shape.split(",")), args.causal)]
    provider = current_provider()
    print(f"cpu: {providers.cpu_model()} ({providers.cpu_caches()}); provider {provider.key} "
          f"({provider.version}); numba threads {numba.get_num_threads()}")
    for shape, causal in progress(cases, desc="fused floor", unit="shape"):  # terminal only
        r = breakdown(shape, causal=causal, rounds=args.rounds, provider=provider,
                      dgemm=args.dgemm, whole=args.whole)
        print(f"{shape}{' causal' if causal else ''}:")
        print("\n".join(format_breakdown(r)), flush=True)
        if args.whole:
            sec = r["seconds"]
            print(f"  fused with every product whole: {sec['fused_whole']['median']:.4f} s; "
                  f"with the tiles {sec['fused']['median']:.4f} s "
                  f"(whole / tiles = {sec['fused_whole']['median'] / sec['fused']['median']:.3f})")
        square = r["dgemm_gflops"]
        if square:
            print(f"  square DGEMM 3072^2 on scipy's BLAS (the kernels' dgemm), default threads, "
                  f"in this shape's rounds: {square:.1f} GF/s (median)")
            fused_rate = (12.0 * visible_elements(shape, causal) * shape[5] / 1e9
                          / r["seconds"]["fused"]["median"])
            print("  per GEMM / square DGEMM: " + ", ".join(
                f"{p} {g / square:.2f}" for p, g in r["gemm_gflops"].items())
                + f"; six together {r['gemms_gflops'] / square:.2f}; fused f+b "
                f"{fused_rate:.1f} GF/s = {fused_rate / square:.2f}", flush=True)
    return 0


def _whole_products(fn: Any) -> Any:
    """``fn`` run with fused_host's small-matrix tiles off (every product issued whole)."""
    def run() -> Any:
        saved = providers.SMALL_GEMM_KERNELS
        providers.SMALL_GEMM_KERNELS = frozenset()
        try:
            return fn()
        finally:
            providers.SMALL_GEMM_KERNELS = saved
    return run


def square_dgemm_call(n: int = 3072) -> Any:
    """A call of scipy's ``dgemm`` (the BLAS the kernels call) on n x n operands."""
    from scipy.linalg.blas import dgemm

    rng = np.random.default_rng(1)
    a, b = (np.asfortranarray(rng.standard_normal((n, n))) for _ in range(2))
    return lambda: dgemm(1.0, a, b)


if __name__ == "__main__":
    raise SystemExit(main())
