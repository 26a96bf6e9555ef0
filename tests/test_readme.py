"""The README's Python tour runs as written (in order, in a scratch directory)."""

from __future__ import annotations

import re
from pathlib import Path

from refattn.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 5
    monkeypatch.chdir(tmp_path)
    assert main(["golden", "--out", "goldens", "--suite", "contract"]) == 0
    namespace: dict = {}
    for block in blocks:
        if "gradcheck.check_attention(call, backward=my_backward)" in block:
            block = block.replace("my_backward", "refattn.backward")
        exec(compile(block, str(README), "exec"), namespace)
