"""examples/fp8_torch_kernel.py: an FP8 kernel emulated with torch's float8 dtypes passes
refattn's check, its planted bug is caught and named, and the file runs through the pytest
plugin (``Supports(quantized=("fa3_fp8",))``: the quantised golden cases run, the float cases
are skipped with the reason). Skipped without torch."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytest_plugins = ["pytester"]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fp8_torch_kernel.py"


@pytest.fixture(scope="module")
def example():
    """The example loaded from its file (nothing added to sys.path or sys.modules)."""
    spec = importlib.util.spec_from_file_location("refattn_fp8_torch_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_clamp_makes_torch_cast_like_satfinite(example):
    x = torch.tensor([464.0, 465.0, 480.0, 1e30, float("inf"), -1e30, float("nan")])
    got = example.to_e4m3(x).to(torch.float32)
    assert got[:6].tolist() == [448.0, 448.0, 448.0, 448.0, 448.0, -448.0]
    assert torch.isnan(got[6])


def test_the_kernel_passes_and_its_bug_is_named(example):
    example.test_fa3_fp8_kernel_on_a_random_call()
    example.test_a_missing_v_descale_is_caught_and_named()


def test_the_example_runs_through_the_plugin(pytester):
    path = pytester.makepyfile(fp8_torch_kernel=EXAMPLE.read_text())
    result = pytester.runpytest(str(path), "-rs", "-q", "-p", "no:cacheprovider")
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= 2 and not outcomes.get("failed"), result.outlines
    # every golden case that is not a quantised fa3_fp8 case is skipped, saying why
    skipped = [line for line in result.outlines if line.startswith("SKIPPED")]
    assert skipped and all("Supports.quantized" in line or "causal" in line
                           for line in skipped), skipped
