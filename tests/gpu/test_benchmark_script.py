"""benchmarks/gpu.py runs end to end without a GPU (--dry-run: the emulator, tiny shapes)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"


def test_the_gpu_benchmark_dry_run_checks_and_reports(tmp_path, monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("gpu_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("OUT", str(tmp_path))
    assert module.main(["--dry-run"]) == 0
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert report["backend"] == "cuda_emulator" and not report["conformance"]["failures"]
    assert report["conformance"]["cases"] > 50
    assert all(report["determinism"].values())
    assert all("refattn_s" in row for row in report["timing"])
    assert "conformance:" in capsys.readouterr().out


def test_the_gpu_path_imports_nothing_the_gpu_image_lacks():
    """The GPU machine's image has no python-flint: the benchmark's imports must not need it."""
    import subprocess
    import sys

    root = BENCH.parents[1]
    code = ("import sys, refattn, refattn.bundle.suites, gpu_backend.launch, "
            "gpu_backend.cupy_backend, gpu_backend.emulator_backend; "
            "print(sorted(m for m in ('flint', 'numba') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, check=True, env={"PYTHONPATH": str(root), "PATH": ""})
    assert out.stdout.strip() == "[]"
