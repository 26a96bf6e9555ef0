"""Cost of correct rounding: the exact backend against the NumPy reference, side by side.

Prints, measured in one run on this machine: the time to write the whole conformance suite
with ``refattn golden --backend exact`` and ``--backend numpy``, the rounding certificate of the
exact bundle (``refattn verify --exact``), and forward+backward of one (1, 2, 128, 128, 64)
call through ``"exact"`` and ``"numpy"`` with the backend's own estimate.

    python3 benchmarks/exact.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_info

import refattn
from refattn.bundle.suites import build_suite
from refattn.bundle.verifier import verify
from refattn.bundle.write import write_bundle
from refattn.engine.exact.backend import estimate_seconds


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo ("unknown" elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")),
                "unknown")


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
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


if __name__ == "__main__":
    main()
