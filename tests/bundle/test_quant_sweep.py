"""``refattn sweep`` grids over quantised presets and scales (issue 28 item 4): the SPEC fields,
their normalisation, ids that do not move, and a quantised sweep bundle that verifies."""

from __future__ import annotations

import json

import numpy as np
import pytest

from refattn.bundle.sweeps.grid import build_case, case_id, check_spec, expand, normalize
from refattn.bundle.verification.verifier import verify
from refattn.cli import main
from refattn.quant.presets import PRESETS

SPEC = """
name = "quant"
[[grid]]
shape = [[1, 2, 1, 4, 4, 8, 8]]
mask = ["none", "causal_lower_right"]
quant = ["fa3_fp8", "flashinfer_sm90_fp8", "flashinfer_fp8_kv", "vllm_fp8_kv",
         "sageattention_int8"]
quant_scale = [1.0, 8.470329472543003e-22]  # 2**-70: real scores below float32's range
quant_values = ["random", "near_limit"]
"""


def test_a_grid_over_presets_and_scales_expands_and_keeps_old_ids(tmp_path):
    doc = check_spec({"name": "q", "grid": [{
        "shape": [[1, 2, 1, 4, 4, 8, 8]], "mask": ["none", "causal_lower_right"],
        "quant": list(PRESETS), "quant_scale": [1.0, 2.0**-70],
        "quant_values": ["random", "near_limit"]}]})
    sweep = expand(doc, validate=False)
    # 2 masks x 2 value kinds x (4 presets x 2 scales + sageattention's one case)
    assert len(sweep.cases) == 2 * 2 * (4 * 2 + 1) and sweep.duplicates == 4
    assert {c.description["quant"]["preset"] for c in sweep.cases} == set(PRESETS)
    assert all(c.case_id.split("-")[3] == c.description["quant"]["preset"]
               for c in sweep.cases)
    # a case without quant keeps the description (and id) it had before these fields existed
    plain = normalize({"shape": [1, 2, 1, 4, 4, 8, 8]})
    assert "quant" not in plain and "quant" not in normalize({
        "shape": [1, 2, 1, 4, 4, 8, 8], "quant": "none"})
    assert case_id(plain) == "dot-none-1x2x1x4x4x8x8-" + case_id(plain).rsplit("-", 1)[1]


def test_near_limit_values_reach_the_format_s_largest_value():
    d = normalize({"shape": [1, 2, 2, 4, 4, 8, 8], "quant": "fa3_fp8",
                   "quant_values": "near_limit", "quant_scale": 0.5})
    case = build_case(d)
    assert np.abs(case.quant.call.q).max() == 448.0  # saturated codes
    assert float(case.quant.spec.q.scale) == 0.5
    assert np.array_equal(case.call.q, case.quant.call.q * 0.5)  # real = codes x descale
    assert "Quantized" in case.flags
    vllm = build_case(normalize({"shape": [1, 2, 2, 4, 4, 8, 8], "quant": "vllm_fp8_kv",
                                 "quant_values": "near_limit", "quant_scale": 0.25}))
    assert (np.abs(vllm.call.k) / 0.25 > 448).any()  # the kernel's cast saturates some


def test_a_quantised_sweep_writes_a_bundle_that_verifies(tmp_path, capsys):
    spec = tmp_path / "s.toml"
    spec.write_text('name = "q2"\n[[grid]]\nshape = [[1, 2, 1, 3, 5, 4, 4]]\n'
                    'mask = ["causal_lower_right"]\nquant = ["fa3_fp8", "vllm_fp8_kv"]\n'
                    'quant_scale = [0.25]\n')
    out = tmp_path / "b"
    assert main(["sweep", str(spec), "--out", str(out), "--quiet"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(e["quant"]["spec"]["name"] for e in manifest["cases"].values()) == [
        "fa3_fp8", "vllm_fp8_kv"]
    report = verify(out, gradcheck=False)
    assert report.passed, report.format()
    assert all(c.bit_identical for c in report.cases)


@pytest.mark.parametrize("values", ["random", "near_limit"])
def test_every_preset_builds_at_both_scale_extremes(values):
    for name in PRESETS:
        for scale in (1.0, 2.0**-70, 2.0**60):
            case = build_case(normalize({"shape": [1, 2, 1, 3, 3, 4, 4], "quant": name,
                                         "quant_scale": scale, "quant_values": values,
                                         "mask": "causal_lower_right"}))
            assert case.quant.spec.name == name


def test_the_example_spec_in_this_file_is_valid(tmp_path):
    (tmp_path / "s.toml").write_text(SPEC)
    from refattn.bundle.sweeps.grid import load_sweep

    sweep = load_sweep(tmp_path / "s.toml", validate=False)
    assert len(sweep.cases) == 36 and sweep.name == "quant"



def test_a_quantised_case_s_budget_counts_the_emulation():
    from refattn.bundle.sweeps.grid import case_budget

    shape = [1, 2, 1, 256, 256, 64, 64]
    plain = case_budget(normalize({"shape": shape}))
    quant = case_budget(normalize({"shape": shape, "quant": "fa3_fp8"}))
    n = 2 * 256 * 256  # score elements
    assert quant.seconds - plain.seconds == pytest.approx(1.2e-5 * n)
    assert quant.bytes - plain.bytes == 512 * n
