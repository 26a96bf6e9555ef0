"""The documentation site builds with every warning an error (``mkdocs build --strict``).

MkDocs Material and mkdocstrings come with the ``test`` and ``docs`` extras, so CI builds the
site; without them the test skips. The build runs in a fresh process into a temporary
directory and generates the API pages, the figures and the command-line help (docs/hooks.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings_handlers.python")
    pytest.importorskip("material")
    pytest.importorskip("matplotlib")  # the figures of refattn plot
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "REFATTN_QUIET": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site"), "--config-file", str(ROOT / "mkdocs.yml")],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    site = tmp_path / "site"
    # what the hooks generate is there: API pages with the docstrings, figures, --help text
    api = (site / "api" / "testing" / "index.html").read_text()
    assert "assert_matches" in api and "Supports" in api
    assert 'href="../refattn/#refattn.RefAttnError"' in api  # a docstring's role, linked
    assert "AttentionCall" in (site / "api" / "refattn" / "index.html").read_text()
    for page in (site / "api").glob("*/index.html"):  # Sphinx roles render as code names
        assert ":class:<code>" not in page.read_text() and ":func:<code>" not in \
            page.read_text(), page
    assert (site / "figures" / "causal_lower_right_q3_k7_probs.png").read_bytes()[:4] == \
        b"\x89PNG"
    cli = (site / "how-to" / "cli" / "index.html").read_text()
    assert "--gradcheck-method" in cli and "examples:" in cli
    schema = (site / "how-to" / "bundle-format" / "index.html").read_text()
    assert "refattn_golden" in schema
