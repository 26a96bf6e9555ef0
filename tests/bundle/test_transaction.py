"""``refattn golden --out DIR`` never destroys a user's files and writes the bundle as one
transaction (issue 16, "golden deletes and overwrites user files" and "writes are atomic per
file, not per bundle"). Each test reproduces one finding."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from refattn import RefAttnError
from refattn.bundle import write_bundle
from refattn.bundle.storage import fsio, transaction
from refattn.bundle.suites import build_suite
from refattn.bundle.verification.verifier import verify
from refattn.cli import main

ROOT = Path(__file__).resolve().parents[2]


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def _contract(out: Path, n: int = 2, **kw) -> Path:
    return write_bundle(out, build_suite("contract")[:n], suite="contract", **kw)


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


# -- user files -----------------------------------------------------------------------------

def test_files_in_cases_that_refattn_did_not_write_are_never_deleted(tmp_path, capsys):
    out = tmp_path / "b"
    _contract(out)
    mine = out / "cases" / "notes.txt"
    mine.write_text("my notes")
    assert main(["golden", "--out", str(out), "--suite", "contract"]) == 2
    assert "cases/notes.txt was not written by refattn" in _one_line_error(capsys)
    assert main(["golden", "--out", str(out), "--suite", "contract", "--force"]) == 2
    assert mine.read_text() == "my notes"


def test_a_foreign_manifest_is_never_overwritten(tmp_path, capsys):
    out = tmp_path / "b"
    out.mkdir()
    (out / "manifest.json").write_text('{"name": "my web app"}')
    for extra in ([], ["--force"]):
        assert main(["golden", "--out", str(out), "--suite", "contract", *extra]) == 2
        assert "manifest.json is not a refattn manifest" in _one_line_error(capsys)
    assert json.loads((out / "manifest.json").read_text()) == {"name": "my web app"}


def test_foreign_files_beside_the_bundle_need_force_and_are_left_untouched(tmp_path, capsys):
    out = tmp_path / "b"
    out.mkdir()
    (out / "README.md").write_text("mine")
    assert main(["golden", "--out", str(out), "--suite", "contract"]) == 2
    err = _one_line_error(capsys)
    assert "README.md" in err and "--force" in err
    assert not (out / "cases").exists()
    assert main(["golden", "--out", str(out), "--suite", "contract", "--force"]) == 0
    assert (out / "README.md").read_text() == "mine"
    assert verify(out, gradcheck=False).passed
    # a second forced run replaces refattn's own files only, stale cases included
    _contract(out, n=1, force=True)
    assert (out / "README.md").read_text() == "mine"
    assert sorted(p.name for p in (out / "cases").iterdir()) == [
        "loop6_two_query_training_trace.safetensors"]
    assert verify(out, gradcheck=False).passed


def test_a_symlinked_cases_directory_is_not_followed(tmp_path, capsys):
    out, other = tmp_path / "b", tmp_path / "other"
    other.mkdir()
    (other / "precious.safetensors").write_bytes(b"not a bundle")
    out.mkdir()
    (out / "cases").symlink_to(other)
    assert main(["golden", "--out", str(out), "--suite", "contract", "--force"]) == 2
    assert "cases is a symbolic link" in _one_line_error(capsys)
    assert sorted(p.name for p in other.iterdir()) == ["precious.safetensors"]


def test_out_as_a_link_or_a_file_is_refused(tmp_path, capsys):
    target = tmp_path / "target"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    assert main(["golden", "--out", str(link), "--suite", "contract"]) == 2
    assert "is a symbolic link" in _one_line_error(capsys)
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    assert main(["golden", "--out", str(a_file), "--suite", "contract"]) == 2
    assert "exists and is not a directory" in _one_line_error(capsys)
    assert a_file.read_text() == "x" and list(target.iterdir()) == []


# -- one transaction ------------------------------------------------------------------------

def test_a_rewrite_replaces_the_whole_bundle_and_leaves_no_staging(tmp_path):
    out = tmp_path / "b"
    _contract(out, n=2)
    _contract(out, n=1)  # a smaller suite: the stale case goes with the old bundle
    assert sorted(_tree(out)) == ["cases/loop6_two_query_training_trace.safetensors",
                                  "manifest.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["b"]  # no staging, no lock file left
    assert verify(out, gradcheck=False).passed


def test_without_renameat2_the_swap_is_two_renames_and_a_failure_puts_the_old_back(
        tmp_path, monkeypatch):
    # systems without RENAME_EXCHANGE: the old bundle is moved aside, then the new one renamed
    monkeypatch.setattr(transaction, "exchange", lambda a, b: False)
    out = tmp_path / "b"
    _contract(out, n=2)
    _contract(out, n=1)
    assert sorted(_tree(out)) == ["cases/loop6_two_query_training_trace.safetensors",
                                  "manifest.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["b"]
    before = _tree(out)
    real, into_out = os.rename, []

    def refuse_the_new_one(src, dst):
        if Path(dst) == out:
            into_out.append(Path(src).name)
            if len(into_out) == 1:  # the staged bundle's rename in fails; putting back works
                raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real(src, dst)

    monkeypatch.setattr(transaction.os, "rename", refuse_the_new_one)
    with pytest.raises(RefAttnError, match="cannot rename the new bundle in"):
        _contract(out, n=2)
    assert len(into_out) == 2 and into_out[0] != into_out[1]  # the new one, then the old back
    assert _tree(out) == before  # the previous bundle is back, whole
    assert [p.name for p in tmp_path.iterdir()] == ["b"]


def test_files_and_directories_are_fsynced_before_the_swap(tmp_path, monkeypatch):
    synced: list[str] = []
    real = transaction.fsync_dir
    monkeypatch.setattr(transaction, "fsync_dir",
                        lambda p: (synced.append(Path(p).name), real(p))[1])
    _contract(tmp_path / "b", n=1)
    assert "cases" in synced and tmp_path.name in synced  # staging's cases/, then the parent
    assert any(name.startswith(".b.refattn-staging-") for name in synced)


KILL_AFTER_TWO_FILES = """
import os, signal, sys
from refattn.bundle.storage import transaction
from refattn.bundle.suites import build_suite
from refattn.bundle.writing.write import write_bundle
real, count = transaction.write_new, [0]
def dying(path, data, **kw):
    count[0] += 1
    if count[0] == 3:
        os.kill(os.getpid(), signal.SIGKILL)  # killed mid-write, like the OOM killer
    return real(path, data, **kw)
transaction.write_new = dying
write_bundle(sys.argv[1], build_suite("contract"), suite="contract")
"""


def test_a_killed_run_leaves_the_previous_bundle_intact(tmp_path):
    out = tmp_path / "b"
    _contract(out, n=1)
    before = _tree(out)
    proc = subprocess.run([sys.executable, "-c", KILL_AFTER_TWO_FILES, str(out)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
    assert proc.returncode == -signal.SIGKILL
    assert _tree(out) == before and verify(out, gradcheck=False).passed
    assert not list(out.rglob("*.tmp"))
    staged = [p for p in tmp_path.iterdir() if ".refattn-staging-" in p.name]
    assert staged  # the killed run's half-written staging directory, beside the bundle
    _contract(out, n=2)  # the next run removes it
    assert [p.name for p in tmp_path.iterdir()] == ["b"]


def test_a_concurrent_writer_is_refused_with_a_clear_message(tmp_path, capsys):
    out = tmp_path / "b"
    _contract(out, n=1)
    with fsio.DirectoryLock(out):  # another refattn golden holds the bundle
        assert main(["golden", "--out", str(out), "--suite", "conformance"]) == 2
        assert "is being written by another process" in _one_line_error(capsys)
    assert verify(out, gradcheck=False).passed


def test_two_concurrent_runs_never_leave_a_broken_bundle(tmp_path):
    out = tmp_path / "b"
    cmd = [sys.executable, "-m", "refattn.cli.main", "golden", "--out", str(out), "--suite"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([*cmd, suite], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
             for suite in ("contract", "conformance")]
    codes = [p.wait(timeout=600) for p in procs]
    errs = [p.stderr.read() for p in procs]
    assert set(codes) <= {0, 2} and 0 in codes, errs
    for code, err in zip(codes, errs, strict=True):
        if code == 2:
            assert "is being written by another process" in err
    assert verify(out, recompute=False, gradcheck=False).passed


# -- a full disk, a read-only directory -----------------------------------------------------

def test_a_full_disk_is_a_one_line_error_and_keeps_the_previous_bundle(tmp_path, monkeypatch,
                                                                      capsys):
    out = tmp_path / "b"
    _contract(out, n=1)
    before = _tree(out)

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    assert main(["golden", "--out", str(out), "--suite", "contract"]) == 2
    monkeypatch.undo()
    assert "No space left on device" in _one_line_error(capsys)
    assert _tree(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["b"]  # the staging directory is removed


def test_a_read_only_directory_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    def read_only(self, *a, **kw):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert main(["golden", "--out", str(tmp_path / "new"), "--suite", "contract"]) == 2
    assert "Read-only file system" in _one_line_error(capsys)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a mode-0555 directory anyway")
def test_a_mode_0555_directory_is_a_one_line_error(tmp_path, capsys):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        assert main(["golden", "--out", str(parent / "b"), "--suite", "contract"]) == 2
        assert "Permission denied" in _one_line_error(capsys)
    finally:
        parent.chmod(0o755)


def test_the_cli_turns_a_stray_oserror_into_one_line(monkeypatch, capsys, tmp_path):
    from refattn.cli import golden

    def boom(args):
        raise OSError(errno.EIO, os.strerror(errno.EIO), "somewhere")

    monkeypatch.setattr(golden, "run", boom)  # the parser reads golden.run when built
    assert main(["golden", "--out", str(tmp_path)]) == 2
    assert "somewhere: Input/output error" in _one_line_error(capsys)


def test_writing_a_candidate_file_reports_os_errors_by_name(tmp_path):
    from refattn.bundle.storage.format import atomic_write

    (tmp_path / "a_file").write_text("x")
    with pytest.raises(RefAttnError, match="cannot write"):
        atomic_write(tmp_path / "a_file" / "cand.safetensors", b"x")  # parent is a file
