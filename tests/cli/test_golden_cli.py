"""refattn golden says what it replaced: the case files of an earlier bundle that the new
suite does not have are named, never removed silently; a file as --out is one line, exit 2."""

from __future__ import annotations

from refattn.bundle.suites import build_suite
from refattn.bundle.writing.write import write_bundle
from refattn.cli import main


def test_golden_over_a_larger_bundle_lists_what_goes(tmp_path, capsys):
    out = tmp_path / "b"
    contract = build_suite("contract")
    write_bundle(out, contract, suite="contract", progress=False)
    assert main(["golden", "--suite", "contract", "--out", str(out), "--quiet"]) == 0
    assert "removed" not in capsys.readouterr().out  # the same cases: nothing removed
    conformance_ids = {c.case_id for c in build_suite("conformance")}
    extra = sorted({c.case_id for c in contract} - conformance_ids)
    assert main(["golden", "--out", str(out), "--quiet"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert extra  # two of the contract's fixtures are not conformance cases
    assert lines[1] == (f"replaced the earlier bundle: removed {len(extra)} case file(s) that "
                        f"suite 'conformance' does not have ({', '.join(extra)})")
    assert sorted(p.stem for p in (out / "cases").iterdir()) == sorted(conformance_ids)


def test_golden_out_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert main(["golden", "--suite", "contract", "--out", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a directory" in err[0]
