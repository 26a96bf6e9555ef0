"""``refattn calibrate``: times the candidates, caches the choice, shows it, rejects bad input."""

from __future__ import annotations

import json

from refattn.cli import main
from refattn.engine.numba import calibration


def test_calibrate_writes_the_choice_and_show_reads_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("REFATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "QUICK_SHAPES", ((1, 2, 64, 64, 8),))
    assert main(["calibrate", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    record = json.loads((tmp_path / "calibration.json").read_text())
    assert f"choice: {record['choice']}" in out
    assert out.count(" ms ") == len(record["seconds"])
    assert main(["calibrate", "--show"]) == 0
    shown = capsys.readouterr().out
    assert f"choice: {record['choice']}" in shown and "stale" not in shown
    calibration.current_provider.cache_clear()


def test_calibrate_errors_are_one_line_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("REFATTN_CACHE_DIR", str(tmp_path))
    assert main(["calibrate", "--show"]) == 2
    assert "no readable calibration" in capsys.readouterr().err
    assert main(["calibrate", "--repeats", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--repeats: 0 is outside the allowed range [1, 100]" in err
