"""Time and peak memory of sparse attention by index lists, forward + backward on numba.

Issue target: (1, 8, 32768, 128) with k = 2048 indices per query, forward + backward under
60 s with a peak RSS under 4 GB on 2 cores; the same call through a dense mask refused as too
large, not attempted.

Each measurement is a fresh ``python`` process (a warm-up process fills numba's on-disk cache
first, so compilation is not timed) that builds q, k, v and grad_output (standard normal,
seed 0; q, k, v (1, 8, L, 128): MHA, every query head with its own kv head), the index lists
and the :class:`~refattn.sparse.SparseCall` (the caller's copies dropped, as a user who hands
them over would), times :func:`~refattn.sparse.sparse_value_and_grad` (the fused numba path)
and reports its own peak RSS (``ru_maxrss``). The lists are DSA-like
(:func:`refattn.bundle.suites.sparse.causal_topk_indices`): causal, sorted, half of each row's
``min(i + 1, 2048)`` entries the most recent tokens and half scattered over the earlier ones,
one list per token shared by the 8 heads (``H_idx = 1``, as DeepSeek's indexer gives one
top-k list per token) -- a stand-in, not the lightning indexer's output. Also: per-head lists
(``H_idx = 8``) at a smaller L, and the dense-mask refusal of the target call. Prints the CPU
model and the BLAS kernels with the figures.

Run: ``python benchmarks/sparse.py [--length 32768] [--per-head-length 8192]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.timing import environment

CHILD = r"""
import json, resource, sys, time
import numpy as np
from refattn.bundle.suites.sparse import causal_topk_indices
from refattn.errors import RefAttnError
from refattn.sparse import SparseCall, index_visibility, sparse_value_and_grad, to_dense_call
L, k, heads = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
t0 = time.perf_counter()
idx = causal_topk_indices(L, k, 1, heads=heads)
vis = index_visibility(idx, L, require_sorted=True)
del idx
rng = np.random.default_rng(0)
q, kk, v = (rng.standard_normal((1, 8, L, 128)) for _ in range(3))
call = SparseCall(q, kk, v, vis)
del q, kk, v
go = rng.standard_normal((1, 8, L, 128))
t1 = time.perf_counter()
trace, grads = sparse_value_and_grad(call, go, backend="numba")
t2 = time.perf_counter()
try:
    to_dense_call(call)
    refused = None
except RefAttnError as exc:
    refused = str(exc)
print(json.dumps({"setup": t1 - t0, "value_and_grad": t2 - t1, "nnz": vis.nnz,
                  "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  "refused": refused,
                  "finite": bool(np.isfinite(grads.grad_k).all())}))
"""


def run(L: int, k: int, heads: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(L), str(k), str(heads)],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--per-head-length", type=int, default=8192)
    ap.add_argument("--k", type=int, default=2048)
    args = ap.parse_args()
    print(environment())
    run(256, 64, 1)  # warm-up: numba's on-disk cache filled, not timed
    for L, heads in ((args.length, 1), (args.per_head_length, 8)):
        r = run(L, args.k, heads)
        print(f"(1, 8, {L}, 128), k = {args.k}, H_idx = {heads}: value_and_grad "
              f"{r['value_and_grad']:.1f} s (setup: lists, checks, copies {r['setup']:.1f} s), "
              f"{r['nnz']} listed keys per head set, peak RSS {r['rss_gb']:.2f} GB, "
              f"gradients finite: {r['finite']}")
        if r["refused"]:
            print(f"  dense equivalent refused: {r['refused'][:160]}...")


if __name__ == "__main__":
    main()
