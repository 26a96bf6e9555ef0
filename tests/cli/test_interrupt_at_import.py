"""Ctrl-C while the ``refattn`` command is still importing refattn (issue 26, item 5).

The console script that pip generates is ``from MODULE import ATTR; sys.exit(ATTR())`` with
MODULE:ATTR from ``[project.scripts]``; its import line runs outside any handler. MODULE is
therefore one that imports only the standard library (``refattn_cli``), and refattn itself
(numpy, the engines, every command) is imported inside ``main``'s guard. A real SIGINT sent
to a real process while refattn is importing gives one line and exit status 130.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _entry_point() -> tuple[str, str]:
    """``[project.scripts] refattn = "MODULE:ATTR"`` of pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text()
    scripts = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    found = re.search(r'^refattn = "([\w.]+):(\w+)"', scripts, flags=re.M)
    assert found is not None, scripts
    return found.group(1), found.group(2)


def test_the_entry_module_imports_neither_refattn_nor_numpy():
    module, attr = _entry_point()
    assert module.split(".")[0] != "refattn"  # importing refattn.* runs refattn/__init__.py
    code = (f"import sys; from {module} import {attr}; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'numpy', 'refattn'}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# The console script's two lines, behind a finder that slows each refattn module's import
# (so that the signal lands inside the import) and marks the first one (so that the test
# sends it no earlier). The finder finds nothing itself: the real modules are imported.
_SCRIPT = """
import sys, time
marker = sys.argv.pop(1)
class _Slow:
    started = False
    def find_spec(self, name, path=None, target=None):
        if name == "refattn" or name.startswith("refattn."):
            if not _Slow.started:
                _Slow.started = True
                open(marker, "w").close()
            time.sleep(0.05)
        return None
sys.meta_path.insert(0, _Slow())
from {module} import {attr}
sys.exit({attr}())
"""


@pytest.mark.skipif(os.name != "posix", reason="SIGINT to a child process needs POSIX")
def test_ctrl_c_while_refattn_imports_prints_one_line_and_exits_130(tmp_path):
    module, attr = _entry_point()
    marker, out = tmp_path / "importing", tmp_path / "made" / "D"
    env = {**os.environ, "REFATTN_QUIET": "1", "PYTHONPATH": str(ROOT)}
    script = _SCRIPT.format(module=module, attr=attr)
    proc = subprocess.Popen([sys.executable, "-c", script, str(marker), "golden", "--out",
                             str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120  # against a hang only; nothing asserts a duration
        while not marker.exists():  # the first refattn module is being imported
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the refattn import never began"
            time.sleep(0.01)
        while proc.poll() is None:  # again only if a signal was lost
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                assert time.monotonic() < deadline, "SIGINT never ended the process"
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert stderr.splitlines() == ["refattn: interrupted"], stderr
    assert "Traceback" not in stderr and stdout == ""
    assert proc.returncode == 130
    assert sorted(os.listdir(tmp_path)) == ["importing"]  # nothing written, no --out
