"""Progress bars: on a terminal only (after a short delay), never with ``--quiet`` or in a pipe;
the same policy in suite generation, verify and gradcheck."""

from __future__ import annotations

import io
import sys
import time

import numpy as np
import pytest

import gradcheck
from gradcheck import api as gradcheck_api
from refattn import _progress
from refattn.cli import main


class Terminal(io.StringIO):
    """A standard error that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def terminal(monkeypatch) -> Terminal:
    """Replace standard error by a terminal; called inside a test's body (pytest's capture
    resets ``sys.stderr`` between a fixture's setup and the call)."""
    tty = Terminal()
    monkeypatch.setattr(sys, "stderr", tty)
    return tty


def test_forced_bar_is_drawn_and_yields_every_item(capsys):
    assert list(_progress.progress(range(5), desc="demo", enabled=True)) == [0, 1, 2, 3, 4]
    err = capsys.readouterr().err
    assert "demo" in err and "/5" in err  # the total is shown


def test_off_means_the_iterable_itself():
    items = [1, 2]
    assert _progress.progress(items, desc="demo", enabled=False) is items


def test_automatic_mode_needs_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(_progress, "DELAY", 0.0)
    assert sum(_progress.progress(range(4), desc="demo")) == 6  # captured stderr: no TTY
    assert capsys.readouterr().err == ""


def test_automatic_mode_waits_for_the_delay(monkeypatch):
    tty = terminal(monkeypatch)
    list(_progress.progress(range(3), desc="quick"))  # far below DELAY: silent
    assert "quick" not in tty.getvalue()

    def slow():
        for i in range(3):
            time.sleep(_progress.DELAY * 0.6)
            yield i

    assert list(_progress.progress(slow(), desc="slow", total=3)) == [0, 1, 2]
    assert "slow" in tty.getvalue()


@pytest.mark.parametrize("quiet", [False, True])
def test_golden_and_verify_bars_on_a_terminal_unless_quiet(monkeypatch, tmp_path, capsys,
                                                            quiet):
    tty = terminal(monkeypatch)
    monkeypatch.setattr(_progress, "DELAY", 0.0)
    flag = ["--quiet"] if quiet else []
    assert main(["golden", "--suite", "contract", "--out", str(tmp_path / "b"), *flag]) == 0
    assert ("golden contract" in tty.getvalue()) is not quiet
    assert main(["verify", str(tmp_path / "b"), "--no-gradcheck", *flag]) == 0
    assert ("verify" in tty.getvalue()) is not quiet
    assert "PASS" in capsys.readouterr().out  # the report itself goes to stdout
    assert "PASS" not in tty.getvalue()


@pytest.mark.parametrize("quiet", [False, True])
def test_gradcheck_bar_on_a_terminal_unless_quiet(monkeypatch, quiet):
    tty = terminal(monkeypatch)
    monkeypatch.setattr(gradcheck_api, "PROGRESS_DELAY", 0.0)
    flag = ["--quiet"] if quiet else []
    argv = ["gradcheck", "--shape", "1,1,1,2,3,2,2", "--no-identities", *flag]
    assert main(argv) == 0
    assert ("gradcheck" in tty.getvalue()) is not quiet
    assert "jvp" in tty.getvalue() or quiet  # the bar counts numeric derivatives


def test_check_vjp_bar_counts_every_element(capsys):
    fn = lambda x: np.sin(x)  # noqa: E731
    vjp = lambda g, x: {"x": g * np.cos(x)}  # noqa: E731
    report = gradcheck.check_vjp(fn, vjp, {"x": np.linspace(0, 1, 7)}, progress=True)
    assert report.passed
    assert "/7" in capsys.readouterr().err  # one step per element
