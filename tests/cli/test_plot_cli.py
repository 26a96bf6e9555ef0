"""refattn plot: the PNG files are written, are valid PNGs of the documented size, and the
error heatmap boxes the worst element in red; without matplotlib the command says so in one
line."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from refattn.cli import main

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "data" / "golden"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, which must come first after the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    width, height = struct.unpack(">II", data[16:24])
    assert data[-8:-4] == b"IEND"  # the file is complete
    return width, height


def expected_size(rows: int, cols: int) -> tuple[int, int]:
    """The documented geometry: 2.2 in per panel, 1.4 x 1.3 in of margins, 100 dpi, at most 8
    panels a side."""
    rows, cols = min(rows, 8), min(cols, 8)
    return round(100 * (2.2 * cols + 1.4)), round(100 * (2.2 * rows + 1.3))


def test_expected_size_is_the_modules_rule():
    mpl = pytest.importorskip("matplotlib")  # noqa: F841
    from refattn import plot

    for rows, cols in ((1, 1), (2, 8), (3, 20)):
        assert plot.figure_pixels(rows, cols) == expected_size(rows, cols)


@pytest.mark.parametrize(("case", "B", "Hq"), [("gqa_hq8_hkv2_causal", 2, 8),
                                                ("causal_lower_right_q6_k4_sanitized", 1, 2)])
def test_case_pictures_are_valid_pngs_of_the_expected_size(tmp_path, capsys, case, B, Hq):
    pytest.importorskip("matplotlib")
    assert main(["plot", str(GOLDEN / "cases" / f"{case}.safetensors"), "--out",
                 str(tmp_path)]) == 0
    printed = capsys.readouterr().out.split()
    names = sorted(Path(p).name for p in printed)
    assert names == [f"{case}_probs.png", f"{case}_visible.png"]
    for p in printed:
        assert png_size(Path(p)) == expected_size(B, Hq)  # one panel per (batch, head)


def _red_pixels(path: Path) -> np.ndarray:
    from matplotlib.image import imread

    rgb = imread(path)[..., :3]  # (H, W, 3) floats in [0, 1]
    return np.argwhere((rgb[..., 0] > 0.9) & (rgb[..., 1] < 0.1) & (rgb[..., 2] < 0.1))


def test_error_heatmap_marks_the_worst_element(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    case = "causal_square"  # output (B, Hq, Q, Dv) = (2, 2, 6, 4): a 2 x 2 grid of panels
    gold = load_file(str(GOLDEN / "cases" / f"{case}.safetensors"))
    bad = gold["output"].copy()
    bad[1, 1, 4, 3] += 1e-6  # the worst element: bottom-right panel
    bad[0, 0, 0, 0] += 1e-9
    save_file({"output": bad}, str(tmp_path / "bad.safetensors"))
    save_file({"output": gold["output"].copy()}, str(tmp_path / "good.safetensors"))
    golden = str(GOLDEN / "cases" / f"{case}.safetensors")
    for name in ("bad", "good"):
        assert main(["plot", golden, "--candidate", str(tmp_path / f"{name}.safetensors"),
                     "--tensor", "output", "--out", str(tmp_path / name)]) == 0
    printed = capsys.readouterr().out.split()
    assert sum(p.endswith("_error_output.png") for p in printed) == 2
    heat = tmp_path / "bad" / f"{case}_error_output.png"
    assert png_size(heat) == expected_size(2, 2)
    red = _red_pixels(heat)
    assert len(red) > 20  # the box around the worst element, and its panel title
    w, h = png_size(heat)
    box = red[red[:, 0] > h * 0.55]  # the lower row of panels holds b=1
    assert len(box) > 10 and (box[:, 1] > w * 0.45).all()  # ... and the right column h=1
    assert len(_red_pixels(tmp_path / "good" / f"{case}_error_output.png")) == 0


def test_plot_errors_are_one_line(tmp_path, capsys, monkeypatch):
    assert main(["plot", str(tmp_path / "absent")]) == 2
    assert main(["plot", str(GOLDEN), "--tensor", "output"]) == 2
    assert main(["plot", str(GOLDEN), "--candidate", str(tmp_path / "x.safetensors")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("refattn plot: error: ") for line in err)
    assert "holds 79 cases; name one with --case" in err[2]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["plot", str(GOLDEN), "--case", "causal_square", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    from refattn._install import install_hint  # the checkout's path here, or the index name

    assert err == [f"refattn plot: error: refattn plot needs matplotlib ({install_hint('plot')})"]
