"""``refattn yardstick`` and ``refattn golden --with-yardsticks`` as users run them (issue 44):
the file is the document the C++ header reads, written whole or not at all, never over a
user's file without --force; bad command lines are one line on stderr, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from refattn.bundle.native import YARDSTICK_SCHEMA, bundle_yardsticks
from refattn.bundle.suites import build_suite
from refattn.bundle.writing.write import write_bundle
from refattn.cli import main

LOOP7 = "loop7_cross_attention_padded_source"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ycli") / "b"
    write_bundle(out, build_suite("contract")[:2], suite="contract", progress=False)
    return out


def _one_line_error(capsys: pytest.CaptureFixture[str], *words: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0], err
    for word in words:
        assert word in err[0], err[0]
    return err[0]


def test_help_runs_as_users_see_it() -> None:
    for command in ("yardstick", "golden"):
        done = subprocess.run([sys.executable, "-m", "refattn", command, "--help"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "examples:" in done.stdout, done.stderr
    assert "--with-yardsticks DTYPES" in done.stdout


def test_the_file_is_the_document_the_header_reads(bundle: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "y.json"
    assert main(["yardstick", str(bundle), "--dtype", "float32", "--names", "output,grad_q",
                 "--out", str(out)]) == 0
    assert "2 case(s)" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["schema"] == YARDSTICK_SCHEMA and doc["schema_version"] == "1.0"
    assert doc == json.loads(json.dumps(bundle_yardsticks(bundle, ["float32"],
                                                          ["output", "grad_q"])))
    table = doc["cases"][LOOP7]["float32"]
    assert sorted(table) == ["grad_q", "output"]
    for rec in table.values():  # refattn.hpp's float_record: hex exact, decimal for people
        for field in ("reference_error", "natural_magnitude"):
            assert float.fromhex(rec[field]["hex"]) == float(rec[field]["decimal"])
    assert [p.name for p in tmp_path.iterdir()] == ["y.json"]  # no temporary file left


def test_an_existing_file_needs_force(bundle: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mine.json"
    out.write_text("the user's")
    argv = ["yardstick", str(bundle), "--dtype", "bfloat16", "--names", "output",
            "--out", str(out)]
    assert main(argv) == 2
    _one_line_error(capsys, "exists; pass --force")
    assert out.read_text() == "the user's"
    assert main([*argv, "--force"]) == 0
    assert "bfloat16" in json.loads(out.read_text())["cases"][LOOP7]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.json"]


@pytest.mark.parametrize("kind", ["link", "directory", "fifo"])
def test_a_link_or_a_directory_is_never_replaced(bundle: Path, tmp_path: Path, kind: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "target.json"
    target.write_text("kept")
    out = tmp_path / "out.json"
    if kind == "link":
        out.symlink_to(target)
    elif kind == "directory":
        out.mkdir()
    else:
        os.mkfifo(out)
    assert main(["yardstick", str(bundle), "--dtype", "float32", "--names", "output",
                 "--out", str(out), "--force"]) == 2
    _one_line_error(capsys, str(out))
    assert target.read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "target.json"]


@pytest.mark.parametrize(("argv", "words"), [
    (["--dtype", "float64"], ("invalid choice: 'float64'",)),
    (["--dtype", "float32", "--names", "output,output"], ("names a tensor twice",)),
    (["--dtype", "float32", "--names", "../x"], ("is not a tensor name",)),
    (["--dtype", "float32"], ("--out",)),
])
def test_bad_command_lines_are_one_line(bundle: Path, tmp_path: Path, argv: list[str],
                                        words: tuple[str, ...],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    out = [] if "--out" in words else ["--out", str(tmp_path / "y.json")]
    assert main(["yardstick", str(bundle), *argv, *out]) == 2
    _one_line_error(capsys, *words)
    assert not (tmp_path / "y.json").exists()


def test_a_bundle_that_fails_its_checks_writes_nothing(bundle: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    import shutil
    planted = tmp_path / "b"
    shutil.copytree(bundle, planted)
    path = planted / "cases" / f"{LOOP7}.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    out = tmp_path / "y.json"
    assert main(["yardstick", str(planted), "--dtype", "float32", "--out", str(out)]) == 2
    _one_line_error(capsys, f"{LOOP7}.safetensors")
    assert not out.exists()
    assert main(["yardstick", str(tmp_path / "nope"), "--dtype", "float32", "--out",
                 str(out)]) == 2
    _one_line_error(capsys, "nope")
    assert not out.exists()


def test_golden_with_yardsticks_stores_the_files_numbers(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    out = tmp_path / "g"
    assert main(["golden", "--suite", "contract", "--out", str(out), "--quiet",
                 "--with-yardsticks", "float16"]) == 0
    assert "yardsticks float16" in capsys.readouterr().out
    manifest = json.loads((out / "manifest.json").read_text())
    doc = bundle_yardsticks(out, ["float16"])
    for case_id, entry in manifest["cases"].items():
        assert entry["yardsticks"] == doc["cases"][case_id], case_id
    # the case files are the ones plain `refattn golden` writes, byte for byte
    plain = tmp_path / "plain"
    assert main(["golden", "--suite", "contract", "--out", str(plain), "--quiet"]) == 0
    for case in (plain / "cases").iterdir():
        assert (out / "cases" / case.name).read_bytes() == case.read_bytes()
    plain_manifest = json.loads((plain / "manifest.json").read_text())
    for entry in manifest["cases"].values():
        entry.pop("yardsticks")
    assert manifest == plain_manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g", "plain"]  # no scratch left


@pytest.mark.parametrize(("value", "words"), [
    ("float64", ("'float64' is not float32, float16 or bfloat16",)),
    ("float32,float32", ("names a dtype twice",)),
    ("", ("'' is not",)),
])
def test_golden_with_yardsticks_bad_values_are_one_line(tmp_path: Path, value: str,
                                                        words: tuple[str, ...],
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    assert main(["golden", "--suite", "contract", "--out", str(tmp_path / "g"),
                 "--with-yardsticks", value]) == 2
    _one_line_error(capsys, "--with-yardsticks", *words)
    assert not (tmp_path / "g").exists()


def test_golden_with_yardsticks_refuses_a_foreign_file_before_any_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "g"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["golden", "--suite", "contract", "--out", str(out), "--quiet",
                 "--with-yardsticks", "float32"]) == 2
    _one_line_error(capsys, "notes.txt")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g"]


def test_golden_with_yardsticks_and_force_leaves_the_users_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "g"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["golden", "--suite", "contract", "--out", str(out), "--quiet", "--force",
                 "--with-yardsticks", "bfloat16"]) == 0
    assert (out / "notes.txt").read_text() == "mine"
    manifest = json.loads((out / "manifest.json").read_text())
    assert all("bfloat16" in e["yardsticks"] for e in manifest["cases"].values())
