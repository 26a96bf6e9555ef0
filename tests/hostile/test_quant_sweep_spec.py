"""Hostile quantised sweep SPECs (issue 28 item 4): every bad value is refused before any work
with one line on stderr and exit code 2, and --out is never created."""

from __future__ import annotations

import pytest

from refattn.cli import main

BASE = 'name = "q"\n[[case]]\nshape = [1, 2, 1, 3, 3, 4, 4]\n'


@pytest.mark.parametrize(("fields", "reason"), [
    ('quant = "fa3_fp8"\nquant_scale = 0.0\n', "quant_scale: 0.0 is less than or equal to"),
    ('quant = "fa3_fp8"\nquant_scale = -1.0\n', "quant_scale: -1.0 is less than or equal to"),
    ('quant = "fa3_fp8"\nquant_scale = nan\n', "quant_scale: expected a finite number"),
    ('quant = "fa3_fp8"\nquant_scale = inf\n', "quant_scale: expected a finite number"),
    ('quant = "fa3_fp8"\nquant_scale = 0.1\n', "is not a float32 value"),
    ('quant = "fa3_fp8"\nquant_scale = 1e39\n', "is not a float32 value"),
    ('quant = "fa3_fp8"\nquant_scale = 7.346839692639297e-40\n', "below float32's smallest normal"),
    ('quant = "fa3_fp8"\nquant_scale = "1"\n', "quant_scale: '1' is not of type 'number'"),
    ('quant = "fa4_fp8"\n', "quant: 'fa4_fp8' is not one of"),
    ('quant = "fa3_fp8"\nquant_values = "huge"\n', "quant_values: 'huge' is not one of"),
    ('quant_scale = 0.5\n', "quant_scale: applies to a quantised case only"),
    ('quant = "fa3_fp8"\ndropout = { p = 0.1, seed = 1 }\n', "the kernel defines no dropout"),
    ('quant = "vllm_fp8_kv"\nbias = "random"\n', "the kernel defines no bias"),
    ('quant = "fa3_fp8"\nscore = "cosine"\n', "dot-product scores"),
    ('quant = "fa3_fp8"\nmask = { kind = "window", left = 1 }\n', "visibility only"),
])
def test_a_bad_quant_field_is_one_line_and_exit_2(tmp_path, capsys, fields, reason):
    spec = tmp_path / "s.toml"
    spec.write_text(BASE + fields)
    out = tmp_path / "b"
    assert main(["sweep", str(spec), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("refattn sweep: error: "), err
    assert reason in err[0], err[0]
    assert not out.exists()
