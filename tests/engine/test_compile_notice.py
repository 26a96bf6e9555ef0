"""The one-line notice when refattn's numba kernels compile: printed once per process on a
cache miss, never when the on-disk cache is warm, never with ``REFATTN_QUIET=1``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from refattn.engine.numba import _jit

ROOT = Path(__file__).resolve().parents[2]

# two kernels of the package (philox4x32_10 and philox_row): two compilations, one notice
SCRIPT = """
import json, numpy as np
from refattn.engine.numba import philox
word = philox.philox4x32_10(np.zeros(4, np.uint32), np.ones(2, np.uint32))
z = np.zeros(8)
u = np.uint64
philox.philox_row(z, 0, 1, 0, 8, u(7), u(0), u(0), u(2**31), 2.0)
kernels = (philox.philox4x32_10, philox.philox_row)
print(json.dumps({"word": [int(w) for w in word], "z": z.tolist(),
                  "hits": sum(sum(k.stats.cache_hits.values()) for k in kernels),
                  "misses": sum(sum(k.stats.cache_misses.values()) for k in kernels)}))
"""


def _run(cache: Path, **env: str) -> tuple[dict, str]:
    environ = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT), **env}
    environ.pop("REFATTN_NUMBA_CACHE", None)
    if "REFATTN_QUIET" not in env:
        environ.pop("REFATTN_QUIET", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=environ, cwd=ROOT, timeout=600, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_notice_once_on_a_cold_cache_and_never_on_a_warm_one(tmp_path):
    cold, err = _run(tmp_path / "cache")
    assert cold["misses"] == 2 and cold["hits"] == 0  # really compiled: the cache was empty
    assert err.count(_jit.COMPILE_NOTICE) == 1, err  # two kernels compiled, one line
    assert "about 20 s once; cached after" in err
    warm, err = _run(tmp_path / "cache")
    assert warm["hits"] == 2 and warm["misses"] == 0  # loaded from disk
    assert _jit.COMPILE_NOTICE not in err and "compiling" not in err, err
    assert warm["word"] == cold["word"] and warm["z"] == cold["z"]


def test_quiet_silences_the_notice(tmp_path):
    cold, err = _run(tmp_path / "cache", REFATTN_QUIET="1")
    assert cold["misses"] == 2
    assert "compiling" not in err, err
