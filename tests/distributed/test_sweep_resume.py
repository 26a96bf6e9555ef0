"""Sweep bundles: same format as golden, resumable, byte-identical, never over another bundle."""

from __future__ import annotations

from pathlib import Path

import pytest

from refattn.bundle.storage.manifest import check_schema, read_manifest
from refattn.bundle.storage.transaction import RESUME_MARK
from refattn.bundle.sweeps.grid import check_spec, expand
from refattn.bundle.verification.verifier import verify
from refattn.bundle.writing.write import write_bundle
from refattn.cli import main
from refattn.distributed.sweep import run_sweep
from refattn.errors import RefAttnError

SPEC = {
    "name": "resume",
    "grid": [{"shape": [[1, 2, 1, 3, 5, 4, 4], [2, 2, 2, 4, 4, 4, 6]],
              "mask": ["none", "causal_lower_right"],
              "dropout": ["none", {"p": 0.25, "seed": 9}]}],
    "case": [{"shape": [1, 1, 1, 2, 2, 4, 4], "score": "cosine", "generator": "numpy"}],
}


def tree(d: Path) -> dict[str, bytes]:
    """Every file under ``d`` by relative path, with its bytes."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def sweep():
    return expand(check_spec(SPEC))


@pytest.fixture(scope="module")
def reference(sweep, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "bundle"
    run_sweep(sweep, out, progress=False)
    return tree(out)


def test_sweep_bundle_is_a_golden_bundle_that_verifies(sweep, reference, tmp_path):
    out = tmp_path / "b"
    result = run_sweep(sweep, out, progress=False)
    assert (result.cases, result.computed, result.reused) == (9, 9, 0)
    manifest = check_schema(read_manifest(out / "manifest.json"))
    assert manifest["suite"] == "sweep:resume"
    assert manifest["sweep"]["id"] == sweep.sweep_id
    assert manifest["generator"]["backend"] == "mixed"
    assert sorted(manifest["cases"]) == [c.case_id for c in sweep.cases]
    report = verify(out, gradcheck=False)
    assert report.passed, report.format()
    assert tree(out) == reference  # the same bytes on every run
    assert not [p for p in out.parent.iterdir() if RESUME_MARK in p.name]


class Interrupt(Exception):
    pass


def test_interrupted_sweep_resumes_and_gives_the_same_bytes(sweep, reference, tmp_path,
                                                           monkeypatch):
    from refattn.distributed import sweep as runner

    calls = {"n": 0}
    real = runner.encode_batch

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 5:
            raise Interrupt("killed")
        return real(batch)

    monkeypatch.setattr(runner, "encode_batch", flaky)
    out = tmp_path / "b"
    with pytest.raises(Interrupt):
        run_sweep(sweep, out, progress=False)
    assert not (out / "manifest.json").exists()  # nothing half-way in the bundle directory
    staged = [p for p in tmp_path.iterdir() if RESUME_MARK in p.name]
    assert len(staged) == 1
    assert len(list((staged[0] / "bundle" / "cases").iterdir())) == 4
    monkeypatch.setattr(runner, "encode_batch", real)
    result = run_sweep(sweep, out, progress=False)
    assert (result.computed, result.reused) == (5, 4)
    assert tree(out) == reference
    assert not [p for p in tmp_path.iterdir() if RESUME_MARK in p.name]


def test_altered_staged_case_is_recomputed(sweep, reference, tmp_path, monkeypatch):
    from refattn.distributed import sweep as runner

    real = runner.encode_batch
    seen = []

    def stop_after_three(batch):
        if len(seen) == 3:
            raise Interrupt("killed")
        seen.append(batch[0][0])
        return real(batch)

    monkeypatch.setattr(runner, "encode_batch", stop_after_three)
    out = tmp_path / "b"
    with pytest.raises(Interrupt):
        run_sweep(sweep, out, progress=False)
    staged = next(p for p in tmp_path.iterdir() if RESUME_MARK in p.name)
    victim = staged / "bundle" / "cases" / f"{seen[0]}.safetensors"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1  # one bit of the last tensor
    victim.write_bytes(bytes(data))
    (staged / "bundle" / "cases" / f".{seen[1]}.safetensors.0badc0de.tmp").write_bytes(b"part")
    monkeypatch.setattr(runner, "encode_batch", real)
    result = run_sweep(sweep, out, progress=False)
    assert (result.computed, result.reused) == (7, 2)
    assert tree(out) == reference


def test_up_to_date_bundle_is_not_rewritten(sweep, tmp_path):
    out = tmp_path / "b"
    run_sweep(sweep, out, progress=False)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    result = run_sweep(sweep, out, progress=False)
    assert result.up_to_date and result.computed == 0
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_damaged_case_in_the_bundle_is_recomputed(sweep, reference, tmp_path):
    out = tmp_path / "b"
    run_sweep(sweep, out, progress=False)
    victim = sorted((out / "cases").iterdir())[2]
    victim.write_bytes(victim.read_bytes()[:-8])
    result = run_sweep(sweep, out, progress=False)
    assert (result.computed, result.reused, result.up_to_date) == (1, 8, False)
    assert tree(out) == reference


def test_directory_holding_another_sweep_is_refused(sweep, tmp_path):
    out = tmp_path / "b"
    run_sweep(sweep, out, progress=False)
    before = tree(out)
    other = expand(check_spec({**SPEC, "name": "other"}))
    with pytest.raises(RefAttnError) as err:
        run_sweep(other, out, progress=False)
    assert f"holds sweep {sweep.sweep_id!r}" in str(err.value)
    assert tree(out) == before


def test_directory_holding_a_golden_bundle_is_refused(sweep, tmp_path):
    from refattn.bundle.suites import build_suite

    out = tmp_path / "b"
    write_bundle(out, build_suite("contract")[:1], suite="contract")
    before = tree(out)
    with pytest.raises(RefAttnError) as err:
        run_sweep(sweep, out, progress=False)
    assert "holds a bundle of suite 'contract'" in str(err.value)
    assert tree(out) == before


def test_another_sweeps_unfinished_work_is_refused_and_kept(sweep, tmp_path, monkeypatch):
    from refattn.distributed import sweep as runner

    real = runner.encode_batch
    monkeypatch.setattr(runner, "encode_batch",
                        lambda batch: (_ for _ in ()).throw(Interrupt("killed")))
    other = expand(check_spec({**SPEC, "name": "other"}))
    out = tmp_path / "b"
    with pytest.raises(Interrupt):
        run_sweep(other, out, progress=False)
    monkeypatch.setattr(runner, "encode_batch", real)
    staged = [p for p in tmp_path.iterdir() if RESUME_MARK in p.name]
    with pytest.raises(RefAttnError) as err:
        run_sweep(sweep, out, progress=False)
    assert "unfinished work of another run" in str(err.value)
    assert [p for p in tmp_path.iterdir() if RESUME_MARK in p.name] == staged


def test_force_writes_beside_foreign_files_and_leaves_them(sweep, reference, tmp_path):
    out = tmp_path / "b"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(RefAttnError) as err:
        run_sweep(sweep, out, progress=False)
    assert "refattn did not write" in str(err.value)
    run_sweep(sweep, out, progress=False, force=True)
    assert (out / "notes.txt").read_text() == "mine"
    got = tree(out)
    del got["notes.txt"]
    assert got == reference


def test_cli_sweep_in_process(tmp_path, capsys):
    spec = tmp_path / "s.toml"
    spec.write_text('name = "cli"\n[[grid]]\nshape = [[1, 1, 1, 2, 3, 4, 4]]\n'
                    'mask = ["none", "causal_upper_left"]\n')
    out = tmp_path / "b"
    assert main(["sweep", str(spec), "--out", str(out), "--quiet"]) == 0
    assert "2 case(s)" in capsys.readouterr().out
    assert main(["verify", str(out), "--no-gradcheck", "--quiet"]) == 0
    assert main(["sweep", str(spec), "--out", str(out), "--quiet"]) == 0
    assert "up to date" in capsys.readouterr().out


def test_progress_bar_counts_cases_on_stderr(sweep, tmp_path, capsys):
    run_sweep(sweep, tmp_path / "b", progress=True)
    err = capsys.readouterr().err
    assert f"sweep {sweep.name}" in err and f"/{len(sweep.cases)}" in err
    run_sweep(sweep, tmp_path / "c", progress=False)
    assert capsys.readouterr().err == ""
