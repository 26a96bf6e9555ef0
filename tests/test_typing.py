"""The public API type-checks: mypy, with ``[tool.mypy]`` of pyproject.toml (the modules that
define what refattn and gradcheck export), reports no error; and ``py.typed`` ships, so a
user's type checker reads refattn's annotations. mypy comes with the ``test`` extra; without
it the first test skips."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_public_api_type_checks(tmp_path):
    pytest.importorskip("mypy")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"),
                           "--config-file", str(ROOT / "pyproject.toml")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    assert re.search(r"Success: no issues found in \d+ source files", proc.stdout)


def test_py_typed_ships_with_the_packages():
    text = (ROOT / "pyproject.toml").read_text()
    for package in ("refattn", "gradcheck"):
        assert (ROOT / package / "py.typed").is_file()
        entry = re.search(rf'^{package} = \[(.*?)\]', text, flags=re.M)
        assert entry is not None and '"py.typed"' in entry.group(1), package
