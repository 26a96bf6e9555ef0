"""A bundle is untrusted input: verify reads only regular files inside it, and every malformed
manifest is a named RefAttnError (issue 16, "verify reads outside the bundle" and the
tracebacks). Each test reproduces one finding."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from refattn import RefAttnError
from refattn.bundle.storage.fsio import read_confined
from refattn.bundle.storage.manifest import check_schema, read_manifest
from refattn.bundle.verification.verifier import verify
from refattn.cli import main

LOOP6 = "loop6_two_query_training_trace"
LOOP7 = "loop7_cross_attention_padded_source"




def _edit_manifest(bundle: Path, edit) -> None:
    path = bundle / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _point_case_at(bundle: Path, target: str) -> None:
    def edit(m):
        m["cases"][LOOP6]["file"] = target
    _edit_manifest(bundle, edit)


# -- paths in the manifest stay inside the bundle ----------------------------------------------

@pytest.mark.parametrize("target", ["/etc/passwd", "../outside.safetensors", "/dev/zero",
                                    "cases/../../x.safetensors", "cases//a.safetensors"])
def test_a_manifest_path_outside_the_bundle_is_refused_before_reading(bundle, target, capsys):
    _point_case_at(bundle, target)
    with pytest.raises(RefAttnError, match=r"manifest: cases/loop6_two_query_training_trace/"
                                           r"file: .* does not match"):
        verify(bundle)
    assert main(["verify", str(bundle)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "file" in err


def test_the_confined_reader_refuses_each_escape_on_its_own(bundle, tmp_path):
    """Defence in depth below the schema: absolute paths, '..', devices, links, FIFOs."""
    for rel, match in (("/etc/passwd", "absolute"), ("../b/manifest.json", r"'\.\.'"),
                       ("cases/./x", r"'\.' component")):
        with pytest.raises(RefAttnError, match=match):
            read_confined(bundle, rel, max_bytes=10**6)
    (bundle / "cases" / "dev.safetensors").symlink_to("/dev/zero")
    with pytest.raises(RefAttnError, match="symbolic link"):
        read_confined(bundle, "cases/dev.safetensors", max_bytes=10**6)
    with pytest.raises(RefAttnError, match="exceeds the limit of 10 bytes"):
        read_confined(bundle, "manifest.json", max_bytes=10)


def test_a_case_file_that_links_to_a_valid_case_elsewhere_fails(bundle, tmp_path):
    """Before: the listing compared basenames and the link was followed, so a bundle whose
    case file was somebody else's passed as its own."""
    elsewhere = tmp_path / "elsewhere.safetensors"
    case = bundle / "cases" / f"{LOOP6}.safetensors"
    shutil.move(case, elsewhere)
    case.symlink_to(elsewhere)
    r = verify(bundle, gradcheck=False)
    assert not r.passed
    reasons = " ".join(p.reason for p in r.all_problems)
    assert "symbolic link" in reasons


def test_a_symlinked_cases_directory_is_not_followed(bundle, tmp_path):
    real = tmp_path / "real_cases"
    shutil.move(bundle / "cases", real)
    (bundle / "cases").symlink_to(real)
    r = verify(bundle, gradcheck=False)
    assert not r.passed and all(c.problems for c in r.cases)


def test_a_fifo_as_case_file_never_hangs_verify(bundle):
    case = bundle / "cases" / f"{LOOP6}.safetensors"
    case.unlink()
    os.mkfifo(case)
    result: list = []
    worker = threading.Thread(target=lambda: result.append(verify(bundle, gradcheck=False)),
                              daemon=True)
    worker.start()
    worker.join(timeout=60)  # a hang is the bug: the old reader blocked in open() forever
    assert not worker.is_alive(), "verify blocked on a FIFO"
    (report,) = result
    (problem,) = [p for p in report.all_problems if p.case_id == LOOP6]
    assert "FIFO" in problem.reason and "only regular files" in problem.reason


def test_a_manifest_that_is_a_fifo_or_link_is_refused(bundle, tmp_path):
    m = bundle / "manifest.json"
    shutil.move(m, tmp_path / "m.json")
    os.mkfifo(m)
    with pytest.raises(RefAttnError, match="FIFO"):
        verify(bundle)
    m.unlink()
    m.symlink_to(tmp_path / "m.json")
    with pytest.raises(RefAttnError, match="symbolic link"):
        verify(bundle)


def test_listing_compares_relative_paths_not_basenames(bundle):
    """Unlisted files, and anything in cases/ that is not a regular file, are problems."""
    (bundle / "cases" / "stray.safetensors").write_bytes(b"x")
    (bundle / "cases" / "sub").mkdir()
    r = verify(bundle, recompute=False, gradcheck=False)
    reasons = [p.reason for p in r.problems]
    assert any("cases/stray.safetensors is not listed" in x for x in reasons)
    assert any("cases/sub is not a regular file" in x for x in reasons)


def test_a_case_stored_under_another_case_name_is_refused(bundle):
    def swap(m):
        m["cases"][LOOP6]["file"] = f"cases/{LOOP7}.safetensors"
    _edit_manifest(bundle, swap)
    r = verify(bundle, recompute=False, gradcheck=False)
    (problem,) = [p for p in r.all_problems if p.case_id == LOOP6]
    assert "must be stored as 'cases/loop6_two_query_training_trace.safetensors'" in \
        problem.reason


def test_a_case_file_larger_than_its_manifest_allows_is_not_read(bundle):
    case = bundle / "cases" / f"{LOOP6}.safetensors"
    with open(case, "ab") as fh:
        fh.truncate(case.stat().st_size + 2 * 2**20)  # sparse: 2 MiB of zeros appended
    r = verify(bundle, recompute=False, gradcheck=False)
    (problem,) = [p for p in r.all_problems if p.case_id == LOOP6]
    assert "exceeds the limit" in problem.reason


# -- malformed manifests: each a named error, never a traceback --------------------------------

def _write_raw(bundle: Path, data: bytes) -> None:
    (bundle / "manifest.json").write_bytes(data)


@pytest.mark.parametrize(("data", "match"), [
    (b"\xff\xfe{}", r"is not UTF-8 text \(byte 0xff at offset 0\)"),  # UnicodeDecodeError
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),  # RecursionError
    (b'{"schema": NaN}', "NaN is not valid JSON"),
    (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
    (b"[1, 2]", "expected a JSON object, got list"),  # AttributeError before
    (b'{"schema": "refattn_golden", "schema_version": 1.0, "cases": {}}', "MAJOR.MINOR"),
    (b'{"schema": "refattn_golden", "schema_version": "7.2", "cases": {}}',
     r"schema_version '7.2' \(major 7\) is not readable"),
    (b'{"schema": "refattn_golden", "schema_version": "1.0", "cases": []}',
     r"manifest: cases: \[\] is not of type 'object'"),
])
def test_malformed_manifest_bytes_are_named_errors(bundle, data, match, capsys):
    _write_raw(bundle, data)
    with pytest.raises(RefAttnError, match=match):
        verify(bundle)
    assert main(["verify", str(bundle)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def _del(path: list[str]):
    def edit(m):
        node = m["cases"][LOOP6]
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return edit


def _set(path: list[str], value):
    def edit(m):
        node = m["cases"][LOOP6]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return edit


@pytest.mark.parametrize(("edit", "where"), [
    (_del(["call", "scale"]), "call: 'scale' is a required property"),  # KeyError before
    (_del(["call", "scale", "value", "hex"]), "call/scale/value: 'hex' is a required"),
    (_set(["call", "scale", "value", "hex"], "0.5"), "call/scale/value/hex"),
    (_set(["call", "axes"], [1, 2]), "call/axes"),  # AttributeError before
    (_set(["tensors"], {"q": {"sha256": 5, "dtype": "float64", "shape": [1]}}),
     "tensors/q/sha256"),
    (_set(["call", "dropout", "mode"], "coin_flip"), "call/dropout/mode"),
    (_set(["call", "tensors", "query", "stride"], "wide"), "call/tensors/query/stride"),
    (_set(["flags"], "GQA"), "flags"),
])
def test_manifest_fields_of_the_wrong_type_fail_the_schema_naming_the_path(bundle, edit, where):
    _edit_manifest(bundle, edit)
    with pytest.raises(RefAttnError) as info:
        verify(bundle)
    assert f"manifest: cases/{LOOP6}/{where}" in str(info.value)
    assert "schema/manifest-v1.json" in str(info.value)


def test_the_published_schema_ships_with_the_package_and_accepts_the_checked_in_bundle():
    from importlib import resources

    text = resources.files("refattn.bundle").joinpath("schema/manifest-v1.json").read_text()
    assert json.loads(text)["properties"]["schema"] == {"const": "refattn_golden"}
    root = Path(__file__).resolve().parents[2] / "data" / "golden"
    assert len(check_schema(read_manifest(root / "manifest.json"))["cases"]) >= 60


def test_a_hostile_stride_does_not_allocate_its_span(bundle):
    """A recorded stride of 2**50 would have asked numpy for petabytes; it is rebuilt
    contiguously and the manifest comparison reports the difference."""
    _edit_manifest(bundle, _set(["call", "tensors", "query", "stride"], [2**50, 1, 1, 1]))
    # keep the integrity checks consistent: only the manifest changed
    r = verify(bundle, gradcheck=False)
    (problem,) = [p for p in r.all_problems if p.case_id == LOOP6]
    assert problem.stage == "manifest" and "stride" in problem.reason
