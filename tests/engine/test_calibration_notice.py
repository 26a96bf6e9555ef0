"""The automatic calibration says so: one line on standard error in the call that runs it, none
on the next call or in the next process (the choice is cached on disk), none with
``REFATTN_QUIET=1`` or with ``REFATTN_BLAS_PROVIDER`` set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from refattn.engine.numba import calibration

ROOT = Path(__file__).resolve().parents[2]

# the calibration timed at one small shape (the notice is what is tested, not the choice);
# the first value_and_grad calibrates, the second must not
SCRIPT = """
import json, sys
import numpy as np
import refattn
from refattn.engine.numba import calibration
calibration.QUICK_SHAPES = ((1, 1, 64, 64, 16),)
x = np.random.default_rng(0).standard_normal((1, 1, 32, 16))
call = refattn.AttentionCall(x, x, x)
for _ in range(2):
    refattn.value_and_grad(call, x, backend="numba")
    print("-- call done", file=sys.stderr, flush=True)
print(json.dumps({"cached": calibration.calibration_path().exists()}))
"""


def _run(cache: Path, **env: str) -> tuple[dict, list[str]]:
    environ = {**os.environ, "REFATTN_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT), **env}
    for name in ("REFATTN_QUIET", "REFATTN_BLAS_PROVIDER"):
        if name not in env:
            environ.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=environ, cwd=ROOT, timeout=900, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr.splitlines()


def _notices(lines: list[str]) -> list[int]:
    """Indices of the calls (0, 1) whose stderr holds the calibration notice."""
    call, found = 0, []
    for line in lines:
        if line == "-- call done":
            call += 1
        elif line.startswith("refattn: calibrating the CPU path once"):
            found.append(call)
    return found


def test_notice_in_the_first_call_only_and_not_in_the_next_process(tmp_path):
    cache = tmp_path / "cache"
    first, err = _run(cache)
    assert first["cached"]
    assert _notices(err) == [0], err  # once, inside the first call, not the second
    notice = next(line for line in err if line.startswith("refattn: calibrating"))
    assert str(cache / "calibration.json") in notice and "refattn calibrate" in notice
    assert f"about {calibration.CALIBRATION_SECONDS} s" in notice
    second, err = _run(cache)
    assert second["cached"] and _notices(err) == [], err  # read from the cache: no notice


def test_quiet_and_an_explicit_provider_print_nothing(tmp_path):
    _, err = _run(tmp_path / "quiet", REFATTN_QUIET="1")
    assert _notices(err) == [], err
    chosen, err = _run(tmp_path / "chosen", REFATTN_BLAS_PROVIDER="openblas/heads/8")
    assert _notices(err) == [] and not chosen["cached"], err  # no calibration ran at all
