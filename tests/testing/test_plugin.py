"""The pytest plugin: golden cases as test parameters with ids equal to case names, skipped
with the reason when the declared support excludes them, from the installed suite or a bundle
(``--refattn-bundle``, the ini option); registered through the pytest11 entry point and light
to import."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from refattn.bundle.suites import build_suite
from refattn.bundle.writing.write import write_bundle

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
#: the contract suite's cases that use dropout (the contract's Loop 6 training trace and its
#: all-dropped row); the other three use none
CONTRACT_DROPOUT = {"loop6_two_query_training_trace", "all_dropped_row"}
CONTRACT = ("loop6_two_query_training_trace", "loop7_cross_attention_padded_source",
            "gqa_broadcast_bias_cross", "sanitize_unused_query_rows", "all_dropped_row")

IDS_TEST = """
from refattn.testing import Supports, cases

@cases(Supports(dtypes={dtypes!r}), suite="contract")
def test_ids(case, request):
    assert request.node.callspec.id in (case.name, case.name + "-" + case.dtype)
"""


def _ran(result) -> list[str]:
    """The ids of the tests that passed, from ``-v`` output."""
    return sorted(line.split("[", 1)[1].split("]")[0] for line in result.outlines
                  if "::test_ids[" in line and " PASSED" in line)


def test_the_entry_point_names_the_plugin():
    eps = {e.name: e.value for e in entry_points(group="pytest11")}
    assert eps.get("refattn") == "refattn.testing.plugin", (
        "pip install -e . registers refattn's pytest11 entry point")


def test_ids_are_case_names_and_skips_say_why(pytester):
    pytester.makepyfile(IDS_TEST.format(dtypes=("float64",)))
    result = pytester.runpytest("-rs", "-v")
    result.assert_outcomes(passed=3, skipped=2)
    assert _ran(result) == sorted(set(CONTRACT) - CONTRACT_DROPOUT)
    skipped = [line for line in result.outlines if line.startswith("SKIPPED")]
    assert len(skipped) == 2
    for case in CONTRACT_DROPOUT:
        assert any(f"{case}: needs dropout" in line for line in skipped), skipped
    collected = [line.split("::", 1)[1] for line in
                 pytester.runpytest("--collect-only", "-q").outlines if "::" in line]
    assert sorted(collected) == sorted(f"test_ids[{c}]" for c in CONTRACT)


def test_one_run_per_case_and_dtype(pytester):
    pytester.makepyfile(IDS_TEST.format(dtypes=("float64", "float32")))
    result = pytester.runpytest("-v")
    result.assert_outcomes(passed=6, skipped=4)
    expected = [f"{c}-{d}" for c in set(CONTRACT) - CONTRACT_DROPOUT
                for d in ("float32", "float64")]
    assert _ran(result) == sorted(expected)


def test_cases_come_from_a_bundle_directory(pytester, tmp_path):
    two = [c for c in build_suite("contract") if c.case_id not in CONTRACT_DROPOUT][:2]
    write_bundle(tmp_path / "b", two, suite="contract", progress=False)
    pytester.makepyfile(IDS_TEST.format(dtypes=("float64",)))
    result = pytester.runpytest("-v", f"--refattn-bundle={tmp_path / 'b'}")
    result.assert_outcomes(passed=2)
    assert _ran(result) == sorted(c.case_id for c in two)
    pytester.makeini(f"[pytest]\nrefattn_bundle = {tmp_path / 'b'}\n")
    result = pytester.runpytest("-v")
    assert _ran(result) == sorted(c.case_id for c in two)


def test_a_bad_bundle_is_a_usage_error(pytester, tmp_path):
    pytester.makepyfile(IDS_TEST.format(dtypes=("float64",)))
    result = pytester.runpytest(f"--refattn-bundle={tmp_path / 'absent'}")
    assert result.ret != pytest.ExitCode.OK  # collection stops with the reason
    assert "not a bundle directory" in "\n".join(result.errlines + result.outlines)


def test_the_plain_argument_takes_the_whole_conformance_suite(pytester):
    pytester.makepyfile("""
        def test_any(refattn_case):
            assert refattn_case.dtype == "float64"
    """)
    result = pytester.runpytest()
    result.assert_outcomes(passed=63, skipped=16)  # 16 of 79 need more than SDPA offers


def test_a_missing_argument_is_a_usage_error(pytester):
    pytester.makepyfile("""
        from refattn.testing import cases

        @cases()
        def test_no_arg(other):
            pass
    """)
    result = pytester.runpytest()
    assert "does not take" in "\n".join(result.errlines + result.outlines)
    assert result.ret != pytest.ExitCode.OK


def test_importing_the_plugin_and_the_package_is_light():
    code = ("import sys, refattn.testing, refattn.testing.plugin; "
            "import json; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'jax', 'numba', 'matplotlib', 'scipy', 'tqdm', 'safetensors'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert json.loads(out) == []
