"""compare and verify reports people read: a legend of the columns, plain numbers (never
``np.float64(...)``), failing rows marked ``FAIL`` first, and ``--json`` for machines."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from refattn.bundle.comparison.harness import LEGEND, compare, plain
from refattn.bundle.golden.spec import case_spec
from refattn.bundle.suites import build_suite
from refattn.bundle.verification.report import LEGEND as VERIFY_LEGEND
from refattn.cli import main

CASE = "loop7_cross_attention_padded_source"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    d = tmp_path_factory.mktemp("reports") / "b"
    assert main(["golden", "--suite", "contract", "--out", str(d), "--quiet"]) == 0
    return d


def _candidate(bundle, tmp_path):
    """output with one element off by 1e-6 and one NaN; grad_q exact; the other input
    gradients absent."""
    gold = load_file(str(bundle / "cases" / f"{CASE}.safetensors"))
    out = gold["output"].copy()  # (1, 1, 2, Dv)
    out[0, 0, 1, 0] += 1e-6
    out[0, 0, 0, 1] = np.nan
    path = tmp_path / "cand.safetensors"
    save_file({"output": out, "grad_q": gold["grad_q"]}, str(path))
    return path, gold


def test_plain_numbers_read_back_exactly():
    for x in (0.1, -2.5e-300, 1.0 / 3.0, 5e-324):
        assert float(plain(np.float64(x))) == x
    assert (plain(np.nan), plain(np.inf), plain(-np.inf)) == ("nan", "inf", "-inf")


def test_compare_text_has_a_legend_plain_numbers_and_marked_rows(bundle, tmp_path, capsys):
    path, gold = _candidate(bundle, tmp_path)
    assert main(["compare", str(bundle / "cases" / f"{CASE}.safetensors"), str(path)]) == 1
    out = capsys.readouterr().out
    assert "np.float64" not in out and "np.float32" not in out
    assert all(line in out for line in LEGEND)
    rules = {"float64", "structure", "exact", "reference_relative"}
    rows = {w[1]: w[0] for w in map(str.split, out.splitlines())
            if len(w) > 2 and w[0] in ("ok", "FAIL") and w[2] in rules}
    assert rows["output"] == "FAIL" and rows["grad_q"] == "ok"
    assert rows["grad_k"] == rows["grad_v"] == rows["grad_bias"] == "FAIL"  # missing
    nan_golden = plain(gold["output"][0, 0, 0, 1])
    assert f"first (0, 0, 0, 1): nan vs {nan_golden}" in out
    assert out.rstrip().endswith("first failing stage output")
    assert main(["compare", str(bundle / "cases" / f"{CASE}.safetensors"), str(path),
                 "--no-legend"]) == 1
    assert LEGEND[0] not in capsys.readouterr().out


def test_compare_json_is_machine_readable(bundle, tmp_path, capsys):
    path, gold = _candidate(bundle, tmp_path)
    assert main(["compare", str(bundle / "cases" / f"{CASE}.safetensors"), str(path),
                 "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)  # strict JSON: no NaN literal anywhere
    assert doc["passed"] is False and doc["first_failure"] == "output"
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == {"output", "grad_q", "grad_k", "grad_v", "grad_bias"}  # a bias case
    o = rows["output"]
    assert o["worst_index"] == [0, 0, 1, 0]  # the element moved by 1e-6
    assert o["worst_golden"] == float(gold["output"][0, 0, 1, 0])
    assert o["worst_candidate"] == float(gold["output"][0, 0, 1, 0] + 1e-6)
    assert math.isclose(o["max_abs_error"], 1e-6, rel_tol=1e-9)
    assert o["nan_mismatches"] == 1
    assert rows["grad_q"]["passed"] is True and rows["grad_q"]["max_abs_error"] == 0.0
    assert "missing" in rows["grad_k"]["reason"]


def test_report_to_dict_encodes_non_finite_numbers_as_strings():
    spec = case_spec(build_suite("contract")[1])
    out = spec.tensors["output"].copy()
    out[...] = np.nan
    d = compare({"output": out}, spec).to_dict()
    row = d["tensors"][0]
    assert row["worst_candidate"] == "nan"  # nothing finite compared: no worst element
    json.dumps(d, allow_nan=False)


def test_verify_marks_failing_cases_and_speaks_json(bundle, tmp_path, capsys):
    assert main(["verify", str(bundle), "--no-gradcheck", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["passed"] is True and len(doc["cases"]) == 5
    assert all(c["bit_identical"] is True for c in doc["cases"])
    assert {c["guarantee"]["text"] for c in doc["cases"]} == {
        "bit-identical to the correctly rounded result"}  # the per-case guarantee
    # flip one stored byte of a tensor: that case (only) fails its sha256
    copy = tmp_path / "b"
    shutil.copytree(bundle, copy)
    f = copy / "cases" / f"{CASE}.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    assert main(["verify", str(copy), "--no-gradcheck"]) == 1
    out = capsys.readouterr().out
    assert all(line in out for line in VERIFY_LEGEND)
    assert "guarantee = the case recomputed by the exact generator" in out
    assert "guarantees: 4 case(s) bit-identical to the correctly rounded result, 1 without" in out
    verdicts = {w[1]: w[0] for w in map(str.split, out.splitlines())
                if len(w) > 2 and w[0] in ("ok", "FAIL") and not w[1].startswith("case=")}
    assert verdicts[CASE] == "FAIL"
    assert [v for c, v in verdicts.items() if c != CASE] == ["ok"] * 4
    assert main(["verify", str(copy), "--no-gradcheck", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    bad = [c for c in doc["cases"] if not c["passed"]]
    assert [c["case_id"] for c in bad] == [CASE]
    assert bad[0]["problems"][0]["stage"] in ("file", "tensor")
