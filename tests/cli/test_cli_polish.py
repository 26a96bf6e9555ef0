"""The command line as a new user meets it (issue 26 item 5).

- ``refattn`` with no command prints the help and exits 2;
- every subcommand's ``--help`` has a description and examples, and every example parses;
- Ctrl-C during ``refattn golden`` prints one line, exits 130 and leaves no directory that the
  run created (a real SIGINT sent to a real process);
- gradient-check methods have one spelling (``gradcheck --method`` and ``verify
  --gradcheck-method``); the old verify spellings still work, with a note;
- install hints follow the way refattn was installed (PEP 610 ``direct_url.json``);
- ``compare``'s "not compared" line counts and names outputs only, never the call's inputs,
  on one short line (issue 39);
- the probabilities figure draws masked cells grey, and ``plot --quiet`` prints one line.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from refattn import _install
from refattn.bundle.comparison.harness import INPUT_NAMES, compare
from refattn.bundle.storage.read import load
from refattn.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "data" / "golden"
CAUSAL = GOLDEN / "cases" / "causal_lower_right_q3_k7.safetensors"


def _subparsers():
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    return action.choices


def test_no_command_prints_the_help_and_exits_2(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: refattn")
    for name in _subparsers():
        assert f"    {name}" in err, name


@pytest.mark.parametrize("name", sorted(_subparsers()))
def test_every_subcommand_help_has_a_description_and_examples_that_parse(name, capsys):
    assert main([name, "--help"]) == 0
    text = capsys.readouterr().out
    sub = _subparsers()[name]
    assert sub.description and len(sub.description) > 40
    assert sub.description.split(".")[0].split()[0] in text  # the description is printed
    assert sub.epilog.startswith("examples:\n")
    examples = sub.epilog.splitlines()[1:]
    assert examples
    for line in examples:
        assert line in text  # verbatim: the raw formatter keeps the lines and their alignment
        argv = shlex.split(line.split("  #")[0])
        assert argv[:2] == ["refattn", name], line
        parsed = build_parser().parse_args(argv[1:])  # parses (nothing runs)
        assert parsed.command == name


_SLOW_GOLDEN = """
import sys, time
import refattn.bundle.writing.write as w
from refattn.cli import main
encode = w.encode_case
def slow(*args, **kwargs):  # the real computation, slowed so that Ctrl-C lands inside it
    time.sleep(0.25)
    return encode(*args, **kwargs)
w.encode_case = slow
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_prints_one_line_exits_130_and_leaves_no_directory(tmp_path):
    out = tmp_path / "made" / "D"  # both directories are the run's own
    env = {**os.environ, "REFATTN_QUIET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_GOLDEN, "golden", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not out.exists():  # the transaction created D: the computation has begun
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "refattn golden never created --out"
            time.sleep(0.05)
        time.sleep(0.5)
        assert proc.poll() is None, "finished before the interrupt (79 cases x 0.25 s)"
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, (stdout, stderr)
    assert stderr.splitlines() == ["refattn: interrupted"], stderr
    assert stdout == ""
    assert not (tmp_path / "made").exists()  # D and its parent, both created by the run
    assert os.listdir(tmp_path) == []  # no staging directory either


def test_ctrl_c_keeps_a_directory_that_existed(tmp_path):
    """Only what the run created is removed: an existing (empty) --out stays."""
    from refattn.bundle.storage.transaction import BundleTransaction

    out = tmp_path / "mine"
    out.mkdir()
    with pytest.raises(KeyboardInterrupt), BundleTransaction(out):
        raise KeyboardInterrupt
    assert out.is_dir()
    with pytest.raises(KeyboardInterrupt), BundleTransaction(tmp_path / "new" / "D"):
        raise KeyboardInterrupt
    assert sorted(os.listdir(tmp_path)) == ["mine"]


def test_gradient_check_methods_have_one_spelling(tmp_path, monkeypatch, capsys):
    gradcheck = _subparsers()["gradcheck"]
    verify = _subparsers()["verify"]
    method = next(a for a in gradcheck._actions if a.dest == "method")
    vmethod = next(a for a in verify._actions if a.dest == "gradcheck_method")
    assert tuple(method.choices) == tuple(vmethod.choices) == ("auto", "complex_step", "central")

    # the module object the command line dispatches through (a doctest collected with
    # --import-mode=importlib may have put a second copy in sys.modules)
    from refattn.cli.main import COMMANDS

    cli_verify = next(m for m in COMMANDS if m.__name__ == "refattn.cli.verify")

    seen = []

    class _Report:
        passed = True

        def format(self, legend):
            return "ok"

    def fake_verify(directory, **kwargs):
        seen.append(kwargs["gradcheck_method"])
        return _Report()

    monkeypatch.setattr(cli_verify, "verify", fake_verify)
    for spelling in ("auto", "complex_step", "central"):
        assert main(["verify", str(tmp_path), "--gradcheck-method", spelling]) == 0
        assert capsys.readouterr().err == ""
    for old in ("check_vjp", "central_difference"):
        assert main(["verify", str(tmp_path), "--gradcheck-method", old]) == 0
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "is now spelled" in err, err
    # the verifier's own names: complex step is gradcheck.check_vjp's default method
    assert seen == ["auto", "check_vjp", "central_difference", "check_vjp",
                    "central_difference"]
    assert main(["verify", str(tmp_path), "--gradcheck-method", "bogus"]) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1


class _Dist:
    def __init__(self, text):
        self.text = text

    def read_text(self, name):
        assert name == "direct_url.json"
        return self.text


@pytest.mark.parametrize(("direct_url", "expected"), [
    ({"url": "file:///src/ref%20attn", "dir_info": {"editable": True}},
     'pip install -e "/src/ref attn[plot]"'),
    ({"url": "file:///src/refattn", "dir_info": {}}, 'pip install "/src/refattn[plot]"'),
    ({"url": "file:///tmp/refattn-0.1.0-py3-none-any.whl", "archive_info": {}},
     "pip install 'refattn[plot]'"),
    (None, "pip install 'refattn[plot]'"),  # from an index: pip records no direct_url.json
])
def test_install_hint_follows_the_installation(monkeypatch, direct_url, expected):
    monkeypatch.setattr(_install, "_source_tree", lambda: None)  # as from site-packages
    text = None if direct_url is None else json.dumps(direct_url)
    monkeypatch.setattr(_install.metadata, "distribution", lambda name: _Dist(text))
    assert _install.install_hint("plot") == expected


def test_install_hint_of_a_source_tree(monkeypatch):
    """Imported from a checkout (this one), whatever metadata is found (an egg-info in the
    working directory has no direct_url.json), the hint names the checkout."""
    def absent(name):
        raise _install.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(_install.metadata, "distribution", absent)
    assert _install.install_hint("distributed") == f'pip install -e "{ROOT}[distributed]"'
    monkeypatch.setattr(_install.metadata, "distribution", lambda name: _Dist(None))
    assert _install.install_hint("plot") == f'pip install -e "{ROOT}[plot]"'


def test_install_hint_of_site_packages_is_not_a_source_tree(monkeypatch, tmp_path):
    fake = tmp_path / "lib" / "site-packages" / "refattn" / "_install.py"
    fake.parent.mkdir(parents=True)
    (fake.parents[1] / "pyproject.toml").write_text("")  # even with a stray pyproject.toml
    monkeypatch.setattr(_install, "__file__", str(fake))
    assert _install._source_tree() is None


def test_install_hint_of_this_environment_installs():
    """The hint for the running installation names a path that holds refattn's pyproject."""
    hint = _install.install_hint("plot")
    if '"' in hint:
        path = Path(hint.split('"')[1].removesuffix("[plot]"))
        assert (path / "pyproject.toml").is_file() and (path / "refattn").is_dir()


def test_not_compared_names_outputs_only(tmp_path, capsys):
    gold = load(CAUSAL)
    report = compare({"output": gold.tensors["output"]}, gold)
    assert report.passed
    assert set(report.missing) & INPUT_NAMES == set()
    stored_inputs = set(gold.tensors) & INPUT_NAMES
    assert {"q", "k", "v", "head_map", "visible", "grad_output"} <= stored_inputs
    expected = {n for n in gold.tensors if n not in INPUT_NAMES and n != "output"}
    assert set(report.missing) == expected and "probs" in expected and "grad_q" in expected
    save_file({"output": np.array(gold.tensors["output"])}, str(tmp_path / "c.safetensors"))
    assert main(["compare", str(CAUSAL), str(tmp_path / "c.safetensors")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("not compared"))
    assert line.startswith(f"not compared: {len(expected)} golden tensors") and len(line) < 120
    shown = line.split("(", 1)[1].split(", ...")[0].split(", ")
    assert shown and set(shown) <= expected  # outputs only: never an input's name


def _grey_pixels(path: Path) -> int:
    from matplotlib import colors
    from matplotlib.image import imread

    from refattn.plot import MASKED_COLOR

    rgb = imread(path)[..., :3]  # (H, W, 3) in [0, 1]
    return int((np.abs(rgb - np.array(colors.to_rgb(MASKED_COLOR))).max(axis=-1) < 0.02).sum())


def test_masked_cells_are_drawn_grey(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from refattn import plot

    case = "causal_lower_right_q3_k7"  # 6 of the 21 cells of each head are masked
    assert main(["plot", str(CAUSAL), "--out", str(tmp_path)]) == 0
    masked = _grey_pixels(tmp_path / f"{case}_probs.png")
    full = "self_attention_basic"  # every key visible: no grey cell, no legend
    assert main(["plot", str(GOLDEN / "cases" / f"{full}.safetensors"), "--out",
                 str(tmp_path)]) == 0
    unmasked = _grey_pixels(tmp_path / f"{full}_probs.png")  # anti-aliased text only
    # two panels, each image at least 120 x 100 pixels (of a 580 x 350 figure): 6/21 is grey
    assert plot.figure_pixels(1, 2) == (580, 350)
    assert masked > 2 * (120 * 100) * 6 / 21 > 20 * unmasked, (masked, unmasked)


def test_plot_quiet_prints_one_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    bundle = tmp_path / "b"
    assert main(["golden", "--suite", "contract", "--out", str(bundle), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["plot", str(bundle), "--out", str(tmp_path / "p"), "--quiet"]) == 0
    out = capsys.readouterr().out.splitlines()
    written = sorted((tmp_path / "p").glob("*.png"))
    assert len(written) >= 4
    assert out == [f"wrote {len(written)} file(s) to {tmp_path / 'p'}"]


@pytest.mark.parametrize("existing", [False, True])
def test_ctrl_c_during_plot_removes_only_what_it_drew(tmp_path, monkeypatch, capsys, existing):
    pytest.importorskip("matplotlib")
    from refattn import plot

    bundle = tmp_path / "b"
    assert main(["golden", "--suite", "contract", "--out", str(bundle), "--quiet"]) == 0
    out = tmp_path / "p"
    if existing:  # the user's directory and files: they stay
        out.mkdir()
        (out / "mine.png").write_bytes(b"user's")
        (out / "notes.txt").write_text("user's")
    real, calls = plot.plot_case, []

    def interrupted_after_one(spec, out_dir):
        calls.append(spec.case_id)
        if len(calls) == 2:  # the first case's two files are written by now
            raise KeyboardInterrupt
        return real(spec, out_dir)

    monkeypatch.setattr(plot, "plot_case", interrupted_after_one)
    capsys.readouterr()
    assert main(["plot", str(bundle), "--out", str(out)]) == 130
    captured = capsys.readouterr()
    assert captured.err == "refattn: interrupted\n" and captured.out == ""
    assert len(calls) == 2
    if existing:
        assert sorted(os.listdir(out)) == ["mine.png", "notes.txt"]
        assert (out / "mine.png").read_bytes() == b"user's"
    else:
        assert not out.exists()


def test_python_m_refattn_is_the_command_line():
    import subprocess
    import sys

    import refattn

    done = subprocess.run([sys.executable, "-m", "refattn", "--version"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and refattn.__version__ in done.stdout, done
    bad = subprocess.run([sys.executable, "-m", "refattn", "mask", "--q", "0"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad
