"""Golden bundles: round trip, byte reproducibility, checksums, atomic writes, the CLI."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

import refattn
from refattn import RefAttnError
from refattn import bundle as golden
from refattn.bundle.suites import build_suite
from refattn.bundle.suites.contract import LOOP6_GRAD_OUTPUT
from refattn.cli import main

LOOP6 = "loop6_two_query_training_trace"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("golden")
    assert main(["golden", "--out", str(out), "--suite", "contract"]) == 0
    return out


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_two_runs_are_byte_identical(bundle, tmp_path):
    assert main(["golden", "--out", str(tmp_path), "--suite", "contract"]) == 0
    assert _tree_digest(tmp_path) == _tree_digest(bundle)


def test_bundle_layout_and_manifest(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["schema"] == golden.SCHEMA
    assert manifest["schema_version"] == golden.SCHEMA_VERSION
    assert manifest["generator"]["refattn"] == refattn.__version__
    # the exact generator's bytes do not depend on numpy: no numpy version is recorded
    assert manifest["generator"]["backend"] == "exact" and "numpy" not in manifest["generator"]
    assert manifest["generator"]["arithmetic"]["mode"] == "stepwise_correctly_rounded"
    assert "numpy" not in json.dumps(manifest["cases"][LOOP6]["call"]["backend"])
    ids = [c.case_id for c in build_suite("contract")]
    assert sorted(manifest["cases"]) == sorted(ids)
    entry = manifest["cases"][LOOP6]
    assert entry["file"] == f"cases/{LOOP6}.safetensors"
    assert entry["call"]["schema"] == "attention_call_v1"
    assert entry["conventions"]["scale"] == {"decimal": repr(2 ** -0.5), "hex": (2 ** -0.5).hex()}
    data = (bundle / entry["file"]).read_bytes()
    assert hashlib.sha256(data).hexdigest() == entry["sha256"]
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    assert list(header["__metadata__"]) == ["refattn"]  # exactly one metadata key
    # no temporary files are left behind by the atomic writer
    assert not [p for p in bundle.rglob("*.tmp")]


def test_round_trip_every_canonical_tensor(bundle):
    case = golden.load(bundle / "cases" / f"{LOOP6}.safetensors")
    trace = refattn.forward(build_suite("contract")[0].call, backend="exact")  # the generator
    grads = refattn.backward(trace, LOOP6_GRAD_OUTPUT)
    expected = {**trace.tensors(), **grads.tensors()}
    for name, value in expected.items():
        np.testing.assert_array_equal(case.tensors[name], value, err_msg=name)
        assert case.tensors[name].dtype == value.dtype, name
    for name in ("q", "k", "v", "scores", "biased_scores", "masked_scores", "row_max", "lse",
                 "probs", "dropout_multiplier", "consumed", "output", "grad_output", "grad_v",
                 "grad_consumed", "grad_probs", "row_dot", "row_dot_output", "grad_scores",
                 "grad_q", "grad_k", "visible", "dropout", "head_map"):
        assert name in case.tensors, name
    assert case.tensors["visible"].dtype == np.bool_
    assert case.tensors["head_map"].dtype == np.int64
    for name, rec in case.manifest_entry["tensors"].items():
        assert rec["sha256"] == golden.tensor_sha256(case.tensors[name])


def _copy_bundle(src: Path, dst: Path) -> Path:
    for p in src.rglob("*"):
        if p.is_file():
            target = dst / p.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(p.read_bytes())
    return dst / "cases" / f"{LOOP6}.safetensors"


def test_tampered_tensor_byte_is_named(bundle, tmp_path):
    path = _copy_bundle(bundle, tmp_path)
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    start, _ = header["probs"]["data_offsets"]
    data[8 + header_len + start + 3] ^= 0x01
    path.write_bytes(bytes(data))
    match = rf"{LOOP6}\.safetensors: tensor 'probs' fails its sha256"
    with pytest.raises(RefAttnError, match=match):
        golden.load(path)


def test_truncated_file_is_named(bundle, tmp_path):
    path = _copy_bundle(bundle, tmp_path)
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(RefAttnError, match=rf"{LOOP6}.safetensors: not a readable refattn"):
        golden.load(path)


def test_file_hash_checked_against_bundle_manifest(bundle, tmp_path):
    path = _copy_bundle(bundle, tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["cases"][LOOP6]["sha256"] = "0" * 64
    with pytest.raises(RefAttnError, match="file sha256 differs from the bundle manifest"):
        golden.load(path, manifest=manifest)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["cases"][LOOP6]["tensors"]["extra_tensor"] = {"sha256": "0" * 64}
    match = "tensor 'extra_tensor' listed in the manifest is missing"
    with pytest.raises(RefAttnError, match=match):
        golden.load(path, manifest=manifest)


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(RefAttnError, match="cannot read"):
        golden.load(tmp_path / "cases" / "nope.safetensors")


def test_duplicate_case_ids_rejected_before_the_manifest_is_replaced(bundle, tmp_path):
    _copy_bundle(bundle, tmp_path)
    before = (tmp_path / "manifest.json").read_bytes()
    case = build_suite("contract")[0]
    with pytest.raises(RefAttnError, match=f"duplicate case '{LOOP6}'"):
        golden.write_bundle(tmp_path, [case, case], suite="contract")
    assert (tmp_path / "manifest.json").read_bytes() == before


def test_case_id_must_be_file_name_safe():
    case = build_suite("contract")[0]
    with pytest.raises(RefAttnError, match=r"case_id: '\.\./evil' must be"):
        golden.GoldenCase("../evil", case.call, case.grad_output, "x")


def test_unknown_suite_is_a_clean_cli_error(tmp_path, capsys):
    assert main(["golden", "--out", str(tmp_path), "--suite", "nope"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice" in err and len(err.strip().splitlines()) == 1


def test_default_suite_is_the_conformance_suite_with_the_contract_fixtures(tmp_path):
    assert main(["golden", "--out", str(tmp_path)]) == 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["suite"] == "conformance"
    assert {LOOP6, "loop7_cross_attention_padded_source"} <= set(manifest["cases"])
