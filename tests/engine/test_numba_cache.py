"""The numba kernels' on-disk cache is keyed on the whole kernel package: editing a helper
module (not the kernel's own file) makes the next run recompile with the new code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from refattn.engine.numba import _jit

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, numpy as np, refattn
from refattn.engine.numba import kernels
q = np.arange(24.0).reshape(1, 2, 3, 4) / 10
t = refattn.forward(refattn.AttentionCall(q, q, q), backend="numba")
k = kernels.dense_forward_rows
print(json.dumps({"row_max": t.row_max.ravel().tolist(),
                  "hits": sum(k.stats.cache_hits.values()),
                  "misses": sum(k.stats.cache_misses.values())}))
"""

RETURN = "        m = max(m, x[j])\n    return m\n"  # row_max's last lines


def _run(tree: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.pop("NUMBA_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, cwd=tree, timeout=600, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_editing_a_helper_module_recompiles_the_kernels_that_inline_it(tmp_path):
    shutil.copytree(ROOT / "refattn", tmp_path / "refattn",
                    ignore=shutil.ignore_patterns("__pycache__"))
    helper = tmp_path / "refattn" / "engine" / "numba" / "math.py"
    assert helper.read_text().count(RETURN) == 1  # row_max, used by dense_forward_rows

    first = _run(tmp_path)  # compiles and writes the cache
    again = _run(tmp_path)  # loads it
    assert (again["hits"], again["misses"]) == (1, 0)
    assert again["row_max"] == first["row_max"]

    # edit the helper only: kernels.py, the file of the cached kernel, is untouched
    helper.write_text(helper.read_text().replace(RETURN, RETURN.replace("return ",
                                                                        "return 1.0 + ")))
    edited = _run(tmp_path)
    assert edited["misses"] == 1 and edited["hits"] == 0, edited  # recompiled, not loaded
    np.testing.assert_array_equal(np.array(edited["row_max"]), np.array(first["row_max"]) + 1.0)


def test_the_stamp_covers_every_file_of_the_kernel_package():
    files = sorted(p.name for p in (ROOT / "refattn" / "engine" / "numba").glob("*.py"))
    assert {"math.py", "kernels.py", "stream.py", "tiles.py", "blas.py"} <= set(files)
    assert _jit.CACHE_KEYED  # the locator is installed on this numba
    assert len(_jit.source_stamp()) == 64
