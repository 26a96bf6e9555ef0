"""benchmarks/attention_processes.py runs end to end (--dry-run: a tiny shape, one call per
process): the environment lines, the table with a row per variant, the ratios computed from
the figures it reports. It checks the format, never the timing."""

from __future__ import annotations

import json
import re

import pytest

from tests.benchmark_loader import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("attention_processes", "attention_processes")


def test_dry_run_reports_each_side_from_its_own_processes(bench, tmp_path, monkeypatch, capsys):
    # a fixed provider: no calibration in the children (the cache of this machine is unknown)
    monkeypatch.setenv("REFATTN_BLAS_PROVIDER", "openblas/heads/8")
    out_json = tmp_path / "r.json"
    assert bench.main(["--dry-run", "--no-mkl", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    for prefix in ("cpu: ", "threads: 2", "install: ", "blas: ", "torch: ", "OPENBLAS_* ",
                   "square DGEMM", "load average at the end: "):
        assert re.search("^" + re.escape(prefix), text, re.M), (prefix, text)
    assert "load average" in text.splitlines()[0]
    assert "openblas/heads/8" in text and "from REFATTN_BLAS_PROVIDER" in text
    report = json.loads(out_json.read_text())
    (case,) = report["cases"]
    names = list(case["variants"])
    torch_present = report["environment"]["torch"] is not None
    assert names == (["torch", "refattn"] if torch_present else ["refattn"])
    table = [line for line in text.splitlines() if line.startswith("| (")]
    assert len(table) == len(names)
    for line, name in zip(table, names, strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == bench.DRY_CASES[0].name and cells[1] == name
        v = case["variants"][name]
        assert len(v["process_medians"]) == 1 and v["median"] == v["process_medians"][0] > 0
        assert float(cells[2]) == pytest.approx(v["median"], abs=1e-4)
        assert v["inprocess_median"] > 0  # the cross-check ran every variant in one process
        # / DGEMM divides by the DGEMM timed between this case's processes, printed last
        assert len(case["dgemm_rounds"]) == 1 and cells[9] == f"{case['dgemm_gflops']:.1f}"
        rate = bench.DRY_CASES[0].flops / v["median"] / 1e9
        assert cells[5] == f"{rate / case['dgemm_gflops']:.2f}"
        if torch_present:
            torch_v = case["variants"]["torch"]
            assert cells[6] == f"{torch_v['median'] / v['median']:.2f}x"
            assert cells[8] == f"{torch_v['inprocess_median'] / v['inprocess_median']:.2f}x"


def test_flops_count_visible_pairs(bench):
    # (1, 1, 1, 4, 4, 2): 16 pairs dense, 1 + 2 + 3 + 4 = 10 causal; 12 D flops per pair
    dense = bench.Case(1, 1, 1, 4, 4, 2)
    assert dense.flops == 12 * 16 * 2
    assert bench.Case(1, 1, 1, 4, 4, 2, causal=True).flops == 12 * 10 * 2
    assert bench.Case(2, 8, 2, 4, 4, 2).name == "(2,8->2,4,2) GQA"


def test_targets_follow_the_issue_per_machine_and_install(bench):
    small, big = bench.Case(1, 8, 8, 512, 512, 64), bench.Case(2, 8, 8, 1024, 1024, 64)

    def result(case, torch_s, ref_s):
        return {"case": list(case), "variants": {"torch": {"median": torch_s},
                                                 "refattn": {"median": ref_s}}}

    # 1.4x at L = 1024: met on an Intel default install (1.25), missed on AMD (1.5)
    results = [result(small, 1.0, 1.0), result(big, 1.4, 1.0)]
    dgemm = big.flops / 1.0 / 1e9 / 0.8  # refattn at 0.8 of DGEMM on the big case
    intel = "\n".join(bench.summary(results, dgemm, "default (no mkl)", "Intel Xeon"))
    amd = "\n".join(bench.summary(results, dgemm, "default (no mkl)", "AMD EPYC"))
    assert "1.40x torch (need 1.25: met)" in intel and "need 1.00: met" in intel
    assert "1.40x torch (need 1.50: MISSED)" in amd and "no target" in amd
    assert "0.80 of DGEMM (need 0.70: met)" in amd and "need 0.70" not in intel
