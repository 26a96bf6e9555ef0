"""benchmarks/gpu.py runs end to end without a GPU (--dry-run: the emulator, tiny shapes), times
only kernels in its device column, and reports torch's out-of-memory as a result."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.benchmark_loader import load_benchmark

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("gpu", "gpu_bench")


def test_the_gpu_benchmark_dry_run_checks_and_reports(bench, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path / "unused"))  # --out wins over $OUT
    assert bench.main(["--dry-run", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert report["backend"] == "cuda_emulator" and not report["conformance"]["failures"]
    assert report["conformance"]["cases"] > 50
    assert all(report["determinism"].values())
    assert report["dgemm"]["flops"] > 0 and {"device_s", "end_to_end_s"} <= set(
        report["method"])
    assert [row["shape"] for row in report["timing"]] == [list(s) for s in bench.DRY_SHAPES]
    for row in report["timing"]:
        r = row["refattn"]
        # the kernels run inside the end-to-end interval: their sum cannot exceed it
        assert 0 < r["device_s"] <= r["end_to_end_s"]
        assert r.get("bit_identical_across_runs", True) is True
        assert row["flops"] == 12.0 * np.prod(row["shape"][:3]) * row["shape"][2] * row[
            "shape"][3]
        assert row["refattn_tflops"] == pytest.approx(row["flops"] / r["device_s"] / 1e12)
        assert "device_s" in row["torch"] or "error" in row["torch"]
    out = capsys.readouterr().out
    assert "conformance:" in out and "DGEMM" in out and "x torch dev" in out


def test_a_failing_stage_is_a_result_and_the_report_is_still_written(bench, tmp_path,
                                                                   monkeypatch, capsys):
    """One GPU run: an error in one stage (a CUDA error, a refused launch) must not lose the
    others' results nor the JSON."""
    def boom(*args, **kwargs):
        raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access\nmore")

    real = bench.refattn_timing

    def first_shape_fails(shape, *args):
        return boom() if shape == bench.DRY_SHAPES[0] else real(shape, *args)

    monkeypatch.setattr(bench, "conformance", boom)
    monkeypatch.setattr(bench, "determinism", boom)
    monkeypatch.setattr(bench, "refattn_timing", first_shape_fails)
    assert bench.main(["--dry-run", "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    error = "RuntimeError: cudaErrorIllegalAddress: an illegal memory access"
    assert report["conformance"] == {"error": error} == report["determinism"]
    assert report["dgemm"]["flops"] > 0
    first, second = report["timing"]
    assert first["refattn"] == {"error": error} and "refattn_tflops" not in first
    assert second["refattn"]["device_s"] > 0 and second["refattn_tflops"] > 0
    out = capsys.readouterr().out
    assert out.count(error) == 3 and "wrote" in out


def test_the_out_directory_must_exist(bench, tmp_path, capsys):
    assert bench.main(["--dry-run", "--out", str(tmp_path / "missing")]) == 2
    assert "not a directory" in capsys.readouterr().err


class _Fn:
    def __init__(self, log):
        self.log = log
        self.max_dynamic_shared_size_bytes = 0

    def __call__(self, grid, block, args, shared_mem=0):
        self.log.append(("launch", grid))


class _Inner:
    name, xp, max_shared_bytes, compile_options = "fake", np, 1 << 16, ()

    def __init__(self):
        self.log = []
        self.fn = _Fn(self.log)

    def get_function(self, name):
        return self.fn

    def to_device(self, array):
        self.log.append(("copy", None))
        return array


def test_a_kernel_load_failure_is_written_as_the_result(bench, tmp_path, monkeypatch, capsys):
    """CuPy's own exception while loading the kernels (an NVRTC or driver error, not a
    RefAttnError) still leaves gpu_bench.json, saying what failed, and exit status 1."""
    def boom(gpu):
        raise RuntimeError("nvrtc: error: cannot open source file cuda_runtime.h")

    monkeypatch.setattr(bench, "_device", boom)
    assert bench.main(["--dry-run", "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert report == {"error": "loading the kernels: RuntimeError: nvrtc: error: cannot open "
                      "source file cuda_runtime.h"}
    assert "loading the kernels failed" in capsys.readouterr().err


def test_the_cubin_dir_must_exist_and_is_passed_to_the_backend(bench, tmp_path, monkeypatch,
                                                               capsys):
    from gpu_backend.cupy_backend import CUBIN_DIR_ENV

    monkeypatch.setenv(CUBIN_DIR_ENV, "")  # recorded first, so the end restores it unset
    monkeypatch.delenv(CUBIN_DIR_ENV)      # (main sets it below)
    assert bench.main(["--dry-run", "--out", str(tmp_path), "--cubin-dir",
                       str(tmp_path / "none")]) == 2
    assert "--cubin-dir" in capsys.readouterr().err and CUBIN_DIR_ENV not in bench.os.environ
    seen = {}

    def device(gpu):
        seen["env"] = bench.os.environ.get(CUBIN_DIR_ENV)
        raise RuntimeError("stop here")

    monkeypatch.setattr(bench, "_device", device)
    assert bench.main(["--dry-run", "--out", str(tmp_path), "--cubin-dir", str(tmp_path)]) == 1
    assert seen["env"] == str(tmp_path.resolve())


def test_the_timed_device_brackets_each_launch_and_nothing_else(bench):
    inner = _Inner()
    dev = bench.TimedDevice(inner, gpu=False)
    fn = dev.get_function("k")
    fn.max_dynamic_shared_size_bytes = 99000  # forwarded to the real function
    assert inner.fn.max_dynamic_shared_size_bytes == 99000
    dev.to_device(np.zeros(3))
    fn((1,), (32,), ())
    fn((2,), (32,), ())
    assert len(dev._pairs) == 2  # two launches, two brackets; the copy is outside
    assert [e[0] for e in inner.log] == ["copy", "launch", "launch"]
    dev.reset()
    assert dev.kernel_seconds() == 0.0


def test_torch_running_out_of_memory_is_a_result(bench, monkeypatch):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 GiB")

    monkeypatch.setattr(F, "scaled_dot_product_attention", oom)
    out = bench.torch_timing((1, 1, 8, 4), gpu=False, deadline=float("inf"))
    assert out["oom"] is True and "512.00 GiB" in out["error"] and "device_s" not in out


def test_the_gpu_path_imports_nothing_the_gpu_image_lacks():
    """The GPU machine's image has no python-flint: the benchmark's imports must not need it."""
    root = BENCH.parents[1]
    code = ("import sys, refattn, refattn.bundle.suites, gpu_backend.launch, "
            "gpu_backend.cupy_backend, gpu_backend.emulator_backend; "
            "print(sorted(m for m in ('flint', 'numba') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, check=True, env={"PYTHONPATH": str(root), "PATH": ""})
    assert out.stdout.strip() == "[]"
