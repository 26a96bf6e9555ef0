"""Sweep SPECs: schema errors named, stable ids independent of order, TOML == YAML, cases built."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from refattn.bundle.sweeps.grid import (
    build_case,
    case_id,
    check_spec,
    expand,
    load_sweep,
    normalize,
    read_spec,
)
from refattn.cli import main
from refattn.errors import RefAttnError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sweep.toml"

SPEC = {
    "name": "t",
    "grid": [{"shape": [[1, 2, 1, 3, 5, 4, 4], [2, 2, 2, 4, 4, 4, 6]],
              "mask": ["none", "causal_lower_right", {"kind": "window", "left": 1}],
              "dropout": ["none", {"p": 0.25, "seed": 9}]}],
    "case": [{"shape": [1, 1, 1, 2, 2, 4, 4], "score": "cosine"}],
}


def test_example_spec_expands_to_about_200_valid_cases():
    sweep = load_sweep(EXAMPLE)
    assert 190 <= len(sweep.cases) <= 260
    assert sweep.duplicates == 0
    assert len({c.case_id for c in sweep.cases}) == len(sweep.cases)
    assert [c.case_id for c in sweep.cases] == sorted(c.case_id for c in sweep.cases)
    families = {c.description["score"]["family"] for c in sweep.cases}
    assert families == {"dot", "bilinear", "cosine", "additive"}


def test_ids_do_not_depend_on_the_order_of_grids_lists_or_keys():
    a = expand(check_spec(SPEC))
    shuffled = {
        "case": SPEC["case"],
        "grid": [{"dropout": SPEC["grid"][0]["dropout"][::-1],
                  "mask": SPEC["grid"][0]["mask"][::-1],
                  "shape": SPEC["grid"][0]["shape"][::-1]}],
        "name": "t",
    }
    b = expand(check_spec(shuffled))
    assert [c.case_id for c in a.cases] == [c.case_id for c in b.cases]
    assert a.sweep_id == b.sweep_id
    renamed = expand(check_spec({**SPEC, "name": "u"}))
    assert renamed.sweep_id != a.sweep_id  # the suite name is part of the bundle's bytes


def test_every_field_changes_the_id():
    base = normalize({"shape": [1, 2, 1, 3, 5, 4, 4]})
    variants = [{"seed": 1}, {"generator": "numpy"}, {"bias": "random"}, {"scale": 0.5},
                {"mask": "causal_upper_left"}, {"score": "bilinear"},
                {"dropout": {"p": 0.1, "seed": 1}}, {"shape": [1, 2, 1, 3, 5, 4, 8]}]
    ids = {case_id(base)} | {case_id(normalize({"shape": [1, 2, 1, 3, 5, 4, 4], **v}))
                             for v in variants}
    assert len(ids) == len(variants) + 1


def test_a_case_is_the_same_bytes_every_time_and_differs_by_seed():
    d = normalize({"shape": [2, 4, 2, 3, 5, 8, 6], "mask": "causal_lower_right",
                   "bias": "alibi", "dropout": {"p": 0.25, "seed": 7}})
    a, b = build_case(d), build_case(d)
    assert a.call.q.tobytes() == b.call.q.tobytes()
    assert a.grad_output.tobytes() == b.grad_output.tobytes()
    c = build_case({**d, "seed": 1})
    assert not np.array_equal(a.call.q, c.call.q)
    assert {"ALiBi", "GQA", "LowerRightCausal", "PhiloxDropout"} <= set(a.flags)


def test_duplicates_are_kept_once():
    spec = {"name": "d", "grid": [{"shape": [[1, 1, 1, 2, 2, 4, 4]], "seed": [0, 0, 1]}],
            "case": [{"shape": [1, 1, 1, 2, 2, 4, 4]}]}
    sweep = expand(check_spec(spec))
    assert len(sweep.cases) == 2 and sweep.duplicates == 2


@pytest.mark.parametrize("spec, expected", [
    ({"name": "s", "grid": [{"shapes": [[1, 1, 1, 2, 2, 4, 4]]}]},
     "grid/0: Additional properties are not allowed ('shapes' was unexpected)"),
    ({"name": "s", "grid": [{"shape": []}]}, "grid/0/shape: [] should be non-empty"),
    ({"name": "s", "grid": []}, "grid: [] should be non-empty"),
    ({"name": "s", "grid": [{}]}, "grid/0: {} should be non-empty"),
    ({"name": "s"}, "(top level): no cases"),
    ({"name": "s", "colour": 1, "case": [{"shape": [1, 1, 1, 1, 1, 1, 1]}]},
     "('colour' was unexpected)"),
    ({"name": "s", "case": [{"shape": [1, 1, 1, 2, 2, 4, 4],
                             "mask": {"kind": "window", "left": 1, "rigth": 0}}]},
     "case/0/mask: Additional properties are not allowed ('rigth' was unexpected)"),
    ({"name": "s", "case": [{"shape": [1, 1, 1, 2, 2, 4, 4], "mask": {"kind": "windw"}}]},
     "case/0/mask/kind: 'windw' is not one of"),
    ({"name": "s", "case": [{"shape": [1, 1, 1, 2, 2, 4]}]}, "case/0/shape: [1, 1, 1, 2, 2, 4] "
     "is too short"),
    ({"name": "s", "case": [{"shape": [1, 1, 1, 2, 2, 4, 4], "dropout": {"p": 1.0, "seed": 1}}]},
     "case/0/dropout/p: 1.0 is greater than or equal to the maximum of 1"),
    ({"name": "bad name", "case": [{"shape": [1, 1, 1, 2, 2, 4, 4]}]}, "name: 'bad name' does "
     "not match"),
])
def test_schema_errors_name_the_key_and_place(spec, expected):
    with pytest.raises(RefAttnError) as err:
        check_spec(spec)
    assert expected in str(err.value)


@pytest.mark.parametrize("fields, expected", [
    ({"shape": [1, 3, 2, 2, 2, 4, 4]}, "Hq=3 must be a multiple of Hkv=2"),
    ({"shape": [1, 1, 1, 2, 4, 4, 4], "mask": {"kind": "key_padding", "pad": 4}},
     "pad=4 leaves no key"),
    ({"shape": [1, 1, 1, 5, 3, 4, 4], "mask": "causal_lower_right"}, "has no legal key"),
    ({"shape": [1, 1, 1, 2, 2, 4, 4], "score": {"family": "cosine", "da": 3}},
     "['da'] do not apply to the cosine family"),
    ({"score": "dot"}, "shape: required"),
])
def test_cases_that_cannot_run_are_named_before_anything_runs(fields, expected):
    with pytest.raises(RefAttnError) as err:
        expand(check_spec({"name": "s", "case": [{"shape": [1, 1, 1, 1, 1, 1, 1]}, fields]}))
    assert "case/1" in str(err.value) and expected in str(err.value)


def test_yaml_and_toml_give_the_same_sweep(tmp_path):
    pytest.importorskip("yaml")
    import yaml

    toml = read_spec(EXAMPLE)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(toml))
    assert load_sweep(tmp_path / "s.yaml").sweep_id == load_sweep(EXAMPLE).sweep_id


@pytest.mark.parametrize("name, text, expected", [
    ("s.toml", "name = \n", "not valid TOML"),
    ("s.yaml", "name: [1\n", "not valid YAML"),
    ("s.json", "{}", "expected a .toml, .yaml or .yml file"),
    ("s.toml", "", "'name' is a required property"),
    ("s.yaml", "- 1\n", "expected a table (mapping) at the top level"),
])
def test_unreadable_specs_are_named(tmp_path, name, text, expected):
    if name.endswith(".yaml"):
        pytest.importorskip("yaml")
    (tmp_path / name).write_text(text)
    with pytest.raises(RefAttnError) as err:
        load_sweep(tmp_path / name)
    assert str(tmp_path / name) in str(err.value) and expected in str(err.value)


def test_cli_bad_spec_is_one_line_and_exit_2(tmp_path, capsys):
    spec = tmp_path / "s.toml"
    spec.write_text('name = "s"\n[[grid]]\nshape = [[1, 1, 1, 2, 2, 4, 4]]\nscores = ["dot"]\n')
    assert main(["sweep", str(spec), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'scores' was unexpected" in err
    assert not (tmp_path / "b").exists()  # refused before the output directory is touched


def test_schema_is_valid_json_schema():
    from refattn.bundle.sweeps.grid import spec_schema

    doc = spec_schema()
    assert doc["$schema"].endswith("2020-12/schema")
    json.dumps(doc)
