"""Fuzzing the bundle reader (issue 16, item 3): whatever a manifest or case file holds,
the only exception that escapes verify, load and compare is RefAttnError.

Fixed example budgets (``max_examples``); CI runs them derandomised (tests/conftest.py)."""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refattn import RefAttnError
from refattn.bundle import write_bundle
from refattn.bundle.comparison.candidates import read_candidate
from refattn.bundle.storage.read import load
from refattn.bundle.suites import build_suite
from refattn.bundle.verification.verifier import verify

LOOP7 = "loop7_cross_attention_padded_source"
FUZZ = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False,
                                                                       allow_infinity=False)
    | st.text(max_size=12) | st.sampled_from(["cases/x.safetensors", "/etc/passwd", "../x",
                                              "1.0", "2.0", "0x1.0p+0", "stream", "explicit"]),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fuzz") / "b"
    write_bundle(out, build_suite("contract")[1:2], suite="contract")
    return out


def _paths(node, prefix=()):
    """Every path (tuple of keys/indices) into a JSON document."""
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


def _verify_copy(pristine: Path, manifest_bytes: bytes | None = None,
                 case_bytes: bytes | None = None, **kw) -> None:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "b"
        shutil.copytree(pristine, out)
        if manifest_bytes is not None:
            (out / "manifest.json").write_bytes(manifest_bytes)
        if case_bytes is not None:
            (out / "cases" / f"{LOOP7}.safetensors").write_bytes(case_bytes)
        try:
            verify(out, **kw)
        except RefAttnError:
            pass  # the one allowed exception type


@FUZZ
@given(data=st.data())
def test_mutated_manifests_only_raise_refattn_error(pristine, data):
    manifest = json.loads((pristine / "manifest.json").read_text())
    paths = sorted(_paths(manifest), key=repr)
    path = data.draw(st.sampled_from(paths), label="path")
    mutated = copy.deepcopy(manifest)
    action = data.draw(st.sampled_from(["replace", "delete"]), label="action")
    if not path:
        mutated = data.draw(json_values, label="document")
    else:
        node = mutated
        for key in path[:-1]:
            node = node[key]
        if action == "delete":
            del node[path[-1]]
        else:
            node[path[-1]] = data.draw(json_values, label="value")
    _verify_copy(pristine, json.dumps(mutated).encode(), gradcheck=False)


@FUZZ
@given(raw=st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
def test_arbitrary_manifest_bytes_only_raise_refattn_error(pristine, raw):
    _verify_copy(pristine, raw, recompute=False, gradcheck=False)


@FUZZ
@given(data=st.data())
def test_mutated_case_files_only_raise_refattn_error(pristine, data, tmp_path):
    original = (pristine / "cases" / f"{LOOP7}.safetensors").read_bytes()
    kind = data.draw(st.sampled_from(["flip", "truncate", "splice", "random"]))
    b = bytearray(original)
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(b) - 1))
            b[i] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        b = b[: data.draw(st.integers(0, len(b) - 1))]
    elif kind == "splice":
        i = data.draw(st.integers(0, len(b)))
        b[i:i] = data.draw(st.binary(max_size=64))
    else:
        b = bytearray(data.draw(st.binary(max_size=200)))
    _verify_copy(pristine, case_bytes=bytes(b), recompute=False, gradcheck=False)
    path = tmp_path / f"{LOOP7}.safetensors"
    path.write_bytes(bytes(b))
    for reader in (load, read_candidate):
        try:
            reader(path)
        except RefAttnError:
            pass


# -- the manifest's tensor records against the file (issue 44: the header refused these) -------
def _edited_manifest(pristine: Path, tmp_path: Path, edit) -> Path:
    out = tmp_path / "b"
    shutil.copytree(pristine, out)
    manifest = json.loads((out / "manifest.json").read_text())
    edit(manifest["cases"][LOOP7])
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out / "cases" / f"{LOOP7}.safetensors"


@pytest.mark.parametrize(("label", "edit", "words"), [
    ("shape changed", lambda e: e["tensors"]["q"]["shape"].__setitem__(-1, 99),
     ("tensor 'q'", ", 99]")),
    ("shape of another rank", lambda e: e["tensors"]["q"].__setitem__(
        "shape", [int(__import__("math").prod(e["tensors"]["q"]["shape"]))]), ("tensor 'q'",)),
    ("dtype changed", lambda e: e["tensors"]["output"].__setitem__("dtype", "int64"),
     ("tensor 'output'", "float64", "lists int64")),
    ("a file tensor not listed", lambda e: e["tensors"].pop("output"),
     ("'output'", "not listed in the bundle manifest")),
])
def test_load_refuses_a_manifest_record_the_file_contradicts(pristine, tmp_path, label, edit,
                                                             words):
    """Planted: the file's bytes and every sha256 are intact; only the manifest's record of a
    tensor's shape or dtype (or its presence) changed, which the sha256s do not cover."""
    path = _edited_manifest(pristine, tmp_path, edit)
    with pytest.raises(RefAttnError) as caught:
        load(path)
    message = str(caught.value)
    for word in (f"{LOOP7}.safetensors", *words):
        assert word in message, (label, message)


def test_load_accepts_the_records_as_written(pristine):
    case = load(pristine / "cases" / f"{LOOP7}.safetensors")
    entry = json.loads((pristine / "manifest.json").read_text())["cases"][LOOP7]
    assert {n: list(t.shape) for n, t in case.tensors.items()} == {
        n: r["shape"] for n, r in entry["tensors"].items()}
