"""A fuzzer of the public surface (issue 40, item 3): every entry point, every parameter, every
boundary value; a RefAttnError or an honest answer, never a traceback, a hang, a silent wrong
answer or memory past twice the honest call's. See :mod:`tests.hostile.surface`.

The fuzz runs in a process of its own, under an address-space cap (6 GiB above its start) and
a timeout (against a hang only; the per-call limit is surface.CALL_SECONDS), in a scratch
directory (a relative path a fuzzed call writes lands there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: entry points with no honest example in their module's doctests, and why
UNCOVERED: dict[str, str] = {
    "refattn.distributed.shard.value_and_grad": "every call runs on a live dask cluster (its "
    "client is an argument, closed when the example ends); its numbers are those of "
    "plan_shards and AttentionCall, both fuzzed, and tests/distributed/test_dask.py runs it",
}

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and /proc: Linux")


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("fuzz-cwd")
    out = work / "figures.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "REFATTN_QUIET": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.hostile.surface", str(out)], cwd=work,
                          env={**env, "PYTHONPATH": os.pathsep.join([str(ROOT), str(work)])},
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_every_public_entry_point_has_an_honest_example(fuzzed):
    missing = sorted(set(fuzzed["entries"]) - set(fuzzed["captured"]) - set(UNCOVERED))
    assert not missing, f"no doctest calls these public entry points: {missing}"
    assert len(fuzzed["entries"]) >= 100  # the enumeration itself found the surface


def test_boundary_values_get_a_refattn_error_or_an_honest_answer(fuzzed):
    counts, findings = fuzzed["counts"], fuzzed["findings"]
    print(counts, len(findings))
    assert counts["entry points"] == len(fuzzed["captured"])
    assert counts["refused"] > 0 and counts["answered"] > 0
    assert not findings, f"{len(findings)} findings:\n" + "\n".join(findings)
