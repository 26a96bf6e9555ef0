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


# -- the micro-benchmark pass (issue 43, item 4) ------------------------------------------------
def _micro():
    from benchmarks.gpu_micro import micro

    return micro


@pytest.fixture(scope="module")
def micro_sass(tmp_path_factory):
    """The micro-benchmarks built with nvcc for sm_90 and sm_80, disassembled: arch -> the
    loop counts of each kernel (skipped where nvcc or cuobjdump is missing)."""
    import shutil

    from gpu_backend.sass import disassemble, tool_path

    if shutil.which("nvcc") is None or tool_path("cuobjdump") is None:
        pytest.skip("nvcc or cuobjdump not installed (CUDA 13 toolkit)")
    micro = _micro()
    paths = micro.build(tmp_path_factory.mktemp("micro"))
    return {arch: micro.loop_counts(disassemble(path.read_bytes()))
            for arch, path in paths.items()}


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_the_micro_benchmarks_compile_to_the_instructions_they_time(micro_sass, arch):
    """Each timed loop holds exactly the DMMA, DFMA and LDGSTS (cp.async) instructions its
    constants say (nothing folded, nothing hoisted out), with the DMMA shape of the arch; a
    latency chain is dependent (each DMMA accumulates onto the previous one's result), a
    throughput loop is not."""
    micro = _micro()
    counts = micro_sass[arch]
    for kernel, want in micro.EXPECTED_LOOPS.items():
        if arch == "sm_80" and kernel in micro.M16_KERNELS:
            assert counts[kernel]["opcodes"]["DMMA"] == 0  # no m16n8k4 below sm_90
            continue
        got = counts[kernel]["opcodes"]
        for opcode in ("DMMA", "DFMA", "LDGSTS"):
            assert got[opcode] == want.get(opcode, 0), (arch, kernel, opcode, got)
        assert counts[kernel]["chain"] is kernel.endswith("_latency"), (arch, kernel)


def test_the_micro_benchmarks_issue_the_dmma_shapes_of_each_arch(tmp_path):
    import shutil

    from gpu_backend.sass import disassemble, parse, tool_path

    if shutil.which("nvcc") is None or tool_path("cuobjdump") is None:
        pytest.skip("nvcc or cuobjdump not installed (CUDA 13 toolkit)")
    micro = _micro()
    shapes = {}
    for arch, path in micro.build(tmp_path).items():
        funcs = parse(disassemble(path.read_bytes()))
        shapes[arch] = {name: {i.opcode for i in ins if i.base == "DMMA"}
                        for name, ins in funcs.items()}
    assert shapes["sm_90"]["dmma16_throughput"] == {"DMMA.16x8x4"}
    assert shapes["sm_90"]["dmma8_throughput"] == {"DMMA.8x8x4"}
    assert shapes["sm_80"]["dmma8_throughput"] == {"DMMA.884"}


def test_the_micro_derivation_on_synthetic_counts_that_overlap():
    """DFMA hidden entirely behind DMMA: the mixed loop takes the DMMA loop's cycles, so the
    co-issue is 1; the model's assumed values come from perf_model's HARDWARE (16 cycles per
    DMMA.16x8x4 issue on an H200: 512 FMA at 67 TFLOP/s over 132 SMs x 4 SMSPs x 1.98 GHz)."""
    micro = _micro()
    d = micro.DEFINES
    per_warp = d["ACC"] * d["STEPS"] * 4
    raw = {"arch": "sm_90", "sms": 1, "defines": d, "trips": 4,
           "dmma16_latency": [4 * d["CHAIN"] * 48],
           "dmma16_throughput_w1": [per_warp * 16] * 4,
           "dfma_throughput_w1": [per_warp * 2 * 2] * 4,
           "dmma16_dfma_mixed_w1": [per_warp * 16] * 4}
    out = micro.derive(raw)
    assert out["dmma16_latency_cycles"] == 48.0
    assert out["dmma16_cycles_per_issue_smsp"] == 16.0
    assert out["dfma_cycles_per_warp_instruction_smsp"] == 2.0
    assert out["dmma16_dfma_coissue"] == 1.0
    assert "dmma8_cycles_per_issue_smsp" not in out and "cp_async_l2_gb_per_s" not in out
    model = micro.assumed("sm_90")
    assert model["dmma16_cycles_per_issue_smsp"] == pytest.approx(16.0, rel=0.01)
    assert model["dmma8_cycles_per_issue_smsp"] == pytest.approx(8.0, rel=0.01)
    assert model["dmma16_dfma_coissue"] == 0.0
    rows = {r["constant"]: r for r in micro.table(out, model)}
    assert rows["dmma16_cycles_per_issue_smsp"]["ratio"] == pytest.approx(1.0, rel=0.01)
    assert rows["dmma16_dfma_coissue"]["ratio"] is None  # 1 against an assumed 0
    text = micro.format_table(micro.table(out, model))
    assert "DMMA.16x8x4 cycles per issue per SMSP" in text and len(text.splitlines()) == 1 + 4


def test_the_micro_pass_in_the_report(bench, tmp_path, monkeypatch, capsys):
    """On a GPU the pass runs before the kernels (its cubins from --micro-dir, else built):
    here micro.run is replaced by synthetic counts; the table is printed and recorded. A dry
    run records the pass as skipped, and a failing pass is a result, not a crash."""
    micro = _micro()
    d = micro.DEFINES
    raw = {"arch": "sm_80", "sms": 1, "defines": d, "trips": 1, "name": "fake A100",
           "dmma8_latency": [d["CHAIN"] * 20]}
    seen = {}

    def fake_run(cubin_dir, budget):
        seen["dir"], seen["budget"] = cubin_dir, budget
        return raw

    monkeypatch.setattr(bench.micro, "run", fake_run)
    out = bench.micro_pass(True, tmp_path)
    assert seen == {"dir": tmp_path, "budget": bench.MICRO_BUDGET_S}
    assert out["measured"]["dmma8_latency_cycles"] == 20.0 and "build_s" not in out
    assert [r["constant"] for r in out["rows"]] == ["dmma8_latency_cycles"]
    bench.print_micro(out)
    assert "DMMA.8x8x4 dependent latency" in capsys.readouterr().out
    assert bench.micro_pass(False, None)["skipped"].startswith("dry run")
    assert bench.micro_pass(True, None, skip=True) == {"skipped": "--no-micro"}
    assert bench.main(["--dry-run", "--out", str(tmp_path), "--micro-dir",
                       str(tmp_path / "none")]) == 2
    assert "--micro-dir" in capsys.readouterr().err


def test_the_micro_driver_doctests_pass():
    """benchmarks/ is outside the doctest paths: the driver's examples run here."""
    import doctest

    result = doctest.testmod(_micro(), optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 3 and result.failed == 0


def test_the_micro_build_names_what_is_missing(tmp_path, monkeypatch):
    import refattn

    micro = _micro()
    with pytest.raises(refattn.RefAttnError, match=r"unknown arch \['sm_70'\]"):
        micro.build(tmp_path, ("sm_70",))
    monkeypatch.setattr(micro.shutil, "which", lambda name: None)
    with pytest.raises(refattn.RefAttnError, match="nvcc is not on PATH"):
        micro.build(tmp_path)
