"""First-call time of the numba backend: compile (no on-disk cache) versus a warm cache.

Each measurement runs in a fresh process: ``REFATTN_NUMBA_CACHE=0`` compiles every kernel
afresh; the default loads the keyed on-disk cache (filled by the first cached run).

    python3 benchmarks/numba_compile.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from timing import cpu_model  # benchmarks/ is the script's directory

SCRIPT = """
import json, time, numpy as np, refattn
rng = np.random.default_rng(0)
q, k, v, g = (rng.standard_normal((1, 2, 64, 16)) for _ in range(4))
call = refattn.AttentionCall(q, k, v)
t0 = time.perf_counter()
refattn.backward(refattn.forward(call, backend="numba"), g)
t1 = time.perf_counter()
refattn.backward(refattn.forward(call, backend="numba", materialize=False), g)
t2 = time.perf_counter()
print(json.dumps({"dense": t1 - t0, "streaming": t2 - t1}))
"""


def run(cache: bool) -> dict[str, float]:
    env = {**os.environ, "REFATTN_NUMBA_CACHE": "1" if cache else "0"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    import numba

    print(f"CPU: {cpu_model()}; numba {numba.__version__}")
    run(cache=True)  # fill the cache if it is empty or stale
    rows = {"no cache (compile)": run(cache=False), "keyed cache (load)": run(cache=True)}
    print(f"{'first call in a fresh process':<32} {'dense f+b s':>12} {'streaming f+b s':>16}")
    for name, r in rows.items():
        print(f"{name:<32} {r['dense']:>12.2f} {r['streaming']:>16.2f}")


if __name__ == "__main__":
    main()
