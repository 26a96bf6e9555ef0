"""Yardsticks stored in a manifest (issue 44): ``refattn golden --with-yardsticks`` writes the
numbers Python's compare computes, verify recomputes them and fails any that differ (an
inflated one would loosen the C++ header's check), and Python's compare never reads them."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from refattn.bundle.comparison.harness import compare
from refattn.bundle.golden.spec import case_spec
from refattn.bundle.native import DEFAULT_NAMES, bundle_specs, bundle_yardsticks
from refattn.bundle.storage.manifest import check_schema, read_manifest
from refattn.bundle.storage.read import load
from refattn.bundle.verification.verifier import verify
from refattn.cli import main
from refattn.errors import RefAttnError

LOOP7 = "loop7_cross_attention_padded_source"
EPS = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}  # unit roundoff


@pytest.fixture(scope="module")
def with_yardsticks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The contract suite written by the command with float32 and bfloat16 yardsticks."""
    out = tmp_path_factory.mktemp("yard") / "b"
    assert main(["golden", "--suite", "contract", "--out", str(out), "--quiet",
                 "--with-yardsticks", "float32,bfloat16"]) == 0
    return out


def _copy_with(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    edit(manifest["cases"][LOOP7])
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def _value(record: dict) -> float:
    return float.fromhex(record["hex"])


def test_stored_yardsticks_are_the_ones_compare_uses(with_yardsticks: Path) -> None:
    """Each stored reference_error is the ``reference_error`` of Python compare's own report
    (computed by the harness, which never reads the manifest's), and lies within a few unit
    roundoffs of the tensor's natural magnitude (the naive algorithm's error is roundoff)."""
    manifest = check_schema(read_manifest(with_yardsticks / "manifest.json"))
    checked = 0
    for spec in bundle_specs(with_yardsticks):
        stored = manifest["cases"][spec.case_id]["yardsticks"]
        assert sorted(stored) == ["bfloat16", "float32"]
        for dtype, table in stored.items():
            names = [n for n in DEFAULT_NAMES if n in spec.tensors]
            assert sorted(table) == sorted(names)
            candidate = {n: np.asarray(spec.tensors[n]) for n in names}
            report = compare(candidate, spec, dtype=dtype)
            for name in names:
                ref = _value(table[name]["reference_error"])
                assert ref == report[name].reference_error, (spec.case_id, dtype, name)
                natural = _value(table[name]["natural_magnitude"])
                scale = max(natural, float(np.max(np.abs(spec.tensors[name]), initial=0.0)))
                assert 0 <= ref <= 64 * EPS[dtype] * scale, (spec.case_id, dtype, name)
                checked += 1
    assert checked > 20


def test_the_file_and_the_manifest_hold_the_same_numbers(with_yardsticks: Path) -> None:
    manifest = json.loads((with_yardsticks / "manifest.json").read_text())
    doc = bundle_yardsticks(with_yardsticks, ["bfloat16"])
    for case_id, entry in manifest["cases"].items():
        assert doc["cases"][case_id]["bfloat16"] == entry["yardsticks"]["bfloat16"]


def test_a_bundle_with_its_yardsticks_verifies(with_yardsticks: Path) -> None:
    report = verify(with_yardsticks, gradcheck=False)
    assert report.passed, report


def _inflate(entry: dict) -> None:
    rec = entry["yardsticks"]["float32"]["output"]["reference_error"]
    big = _value(rec) * 1000
    rec.update(hex=big.hex(), decimal=repr(big))


def _deflate(entry: dict) -> None:
    entry["yardsticks"]["float32"]["output"]["reference_error"] = {"hex": (0.0).hex()}


def _natural(entry: dict) -> None:
    rec = entry["yardsticks"]["bfloat16"]["grad_q"]["natural_magnitude"]
    rec["hex"] = (_value(rec) * 2).hex()


def _absent_tensor(entry: dict) -> None:
    entry["yardsticks"]["float32"]["grad_nothing"] = entry["yardsticks"]["float32"]["output"]


@pytest.mark.parametrize(("edit", "tensor", "words"), [
    (_inflate, "output", ("float32 reference_error", "loosen the C++ check")),
    (_deflate, "output", ("float32 reference_error 0.0 differs from the recomputed",)),
    (_natural, "grad_q", ("bfloat16 natural_magnitude", "loosen")),
    (_absent_tensor, "grad_nothing", ("the case lacks",)),
])
def test_verify_fails_a_stored_yardstick_that_differs(with_yardsticks: Path, tmp_path: Path,
                                                      edit, tensor: str, words) -> None:
    """Planted: the manifest's yardsticks edited; every sha256 still matches (they cover the
    case files, not the manifest's fields), so only the recomputation can catch it."""
    planted = _copy_with(with_yardsticks, tmp_path / "b", edit)
    report = verify(planted, recompute=False, gradcheck=False)
    assert not report.passed
    found = [p for p in report.all_problems if p.stage == "manifest"]
    assert [(p.case_id, p.tensor) for p in found] == [(LOOP7, tensor)], found
    for word in words:
        assert word in found[0].reason, found[0].reason


def test_a_malformed_yardstick_is_refused_by_the_schema(with_yardsticks: Path,
                                                        tmp_path: Path) -> None:
    planted = _copy_with(with_yardsticks, tmp_path / "b", lambda e: e["yardsticks"].__setitem__(
        "float64", e["yardsticks"]["float32"]))
    with pytest.raises(RefAttnError, match="yardsticks: 'float64' is not one of"):
        check_schema(read_manifest(planted / "manifest.json"))


def test_python_compare_ignores_the_stored_yardstick(with_yardsticks: Path,
                                                     tmp_path: Path) -> None:
    """Planted: an inflated yardstick in the manifest must not pass a candidate that the
    recomputed one fails (compare reads the case's tensors, never the stored numbers)."""
    planted = _copy_with(with_yardsticks, tmp_path / "b", _inflate)
    spec = case_spec(load(planted / "cases" / f"{LOOP7}.safetensors"))
    out = np.asarray(spec.tensors["output"], dtype=np.float64)
    stored = _value(json.loads((planted / "manifest.json").read_text())["cases"][LOOP7][
        "yardsticks"]["float32"]["output"]["reference_error"])
    honest = compare({"output": out.astype(np.float32)}, spec)["output"].reference_error
    assert honest is not None and stored == 1000 * honest
    bad = out.copy()
    bad.reshape(-1)[np.argmax(np.abs(out))] += 50 * honest  # over k * honest, under k * stored
    report = compare({"output": bad.astype(np.float32)}, spec)["output"]
    assert report.reference_error == honest
    assert not report.passed and report.bound < 2 * 50 * honest


def test_bundle_yardsticks_refuse_a_bad_dtype_and_a_tampered_case(with_yardsticks: Path,
                                                                  tmp_path: Path) -> None:
    with pytest.raises(RefAttnError, match="dtype: expected one of"):
        bundle_yardsticks(with_yardsticks, ["float64"])
    with pytest.raises(RefAttnError, match="at least one"):
        bundle_yardsticks(with_yardsticks, [])
    planted = tmp_path / "b"
    shutil.copytree(with_yardsticks, planted)
    path = planted / "cases" / f"{LOOP7}.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # a tensor byte
    path.write_bytes(bytes(data))
    with pytest.raises(RefAttnError, match=f"{LOOP7}.safetensors"):
        bundle_yardsticks(planted, ["float32"])


def test_the_natural_magnitude_of_a_tensor_without_one_is_zero(with_yardsticks: Path) -> None:
    doc = bundle_yardsticks(with_yardsticks, ["float16"], ["output", "lse"])
    values = [_value(t[n]["natural_magnitude"]) for c in doc["cases"].values()
              for t in c.values() for n in t]
    assert values and all(math.isfinite(v) and v >= 0 for v in values)
