"""What the miniatures miss (issue 39, item 4): planted tile bugs against both suites.

The tiled NumPy kernel of ``tests/kernels/tiled.py`` (64 x 64 tiles, float32) runs every dot
case of the conformance suite (79 miniatures, Dk <= 16, K <= 128) and of the kernel suite
(304 cases at kernel shapes) once correct and once per planted bug, forward and backward,
under refattn's float32 rule (``compare(..., check="gradients")``). Printed: per bug, how many
cases of each suite fail (and the correct kernel's, which must be 0), and which diagnosis
lines the failures carried. The bugs' trigger options (``pad_to`` for the padding bug,
``splits`` for the split-KV merge) apply to every case of both suites alike.

Usage::

    python3 benchmarks/kernel_bugs.py            # both suites (about 5-10 minutes on 2 cores)
    python3 benchmarks/kernel_bugs.py --limit 40 # the first 40 cases of each suite
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: bug -> the tile options that give it its trigger (as tests/kernels/test_tiled_suites.py)
OPTIONS = {None: {}, "drop_last_partial_tile": {}, "causal_offset": {},
           "pad_garbage": {"pad_to": 16}, "stale_max_rescale": {},
           "splitkv_sum_weights": {"splits": 3}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=None, help="cases per suite")
    args = p.parse_args()

    from benchmarks.kernel_suite import environment
    from refattn.bundle.comparison.harness import compare
    from refattn.testing import Case, Supports, load_cases
    from refattn.testing.supports import ineligibility
    from tests.kernels.test_tiled_suites import SUPPORTS, run

    print(environment())
    supports = Supports(dtypes=("float32",), **SUPPORTS)
    table: dict[tuple[str, str | None], int] = collections.Counter()
    ran: dict[str, int] = collections.Counter()
    diagnosed: dict[str | None, collections.Counter] = collections.defaultdict(
        collections.Counter)
    t0 = time.perf_counter()
    for suite in ("conformance", "kernels"):
        for spec in load_cases(suite=suite)[:args.limit]:
            if ineligibility(spec, supports, "float32") or "Quantized" in spec.flags:
                continue
            case = Case(spec, "float32")
            ran[suite] += 1
            for bug, options in OPTIONS.items():
                out = run(case, "float32", tile_q=64, tile_k=64, bug=bug, **options)
                report = compare(out, spec, dtype="float32", check="gradients")
                if not report.passed:
                    table[(suite, bug)] += 1
                    for d in report.diagnoses:
                        diagnosed[bug][d.kind] += 1
    print(f"\ncases run: conformance {ran['conformance']}, kernels {ran['kernels']} "
          f"({time.perf_counter() - t0:.0f} s)")
    print(f"{'kernel':<24} {'conformance fails':>18} {'kernel fails':>13}  diagnoses")
    for bug in OPTIONS:
        kinds = ", ".join(f"{k} {n}" for k, n in diagnosed[bug].most_common(3)) or "-"
        print(f"{bug or 'correct':<24} {table[('conformance', bug)]:>18} "
              f"{table[('kernels', bug)]:>13}  {kinds}")


if __name__ == "__main__":
    main()
