"""The generated fuzz of the command line, the sweep SPEC and the manifest (issue 40,
deliverable 3): tests/hostile/cli_surface.py gives every CLI option and positional, every
SPEC property and every manifest field boundary values; here its findings must be none and
its coverage complete.

The three fuzzes run in two child processes side by side (the command line in one, SPEC and
manifest in the other), each call in-process there under SIGALRM and a peak-memory meter, in
a run order fixed in the module, nothing random. A Hypothesis test combines two options."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
import cli_surface as cs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    script = str(Path(cs.__file__))
    runs = [subprocess.Popen([sys.executable, script, "--json", *names], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for names in (["cli"], ["spec", "manifest"])]
    doc: dict = {}
    for p in runs:
        out, err = p.communicate(timeout=1800)
        assert out.strip(), f"the fuzz printed nothing (exit {p.returncode}): {err[-2000:]}"
        doc.update(json.loads(out.strip().splitlines()[-1]))
    return doc


def _no_findings(result: dict) -> None:
    findings = result["findings"]
    assert not findings, f"{len(findings)} finding(s):\n" + "\n".join(findings)


def test_every_cli_option_keeps_the_contract(results):
    r = results["cli"]
    _no_findings(r)
    counts = r["counts"]
    excluded = {" ".join(k) for k in cs.EXCLUDED_OPTIONS}
    missing = set(counts["actions"]) - set(counts["reached"]) - excluded
    assert not missing, f"options never given a boundary value: {sorted(missing)}"
    commands = {a.split(" ", 1)[0] for a in counts["reached"]}
    assert commands == set(cs.cli_actions()) == set(cs.HONEST_ARGV)
    assert counts["runs"] > 500


def test_every_spec_property_keeps_the_contract(results):
    r = results["spec"]
    _no_findings(r)
    counts = r["counts"]
    assert set(counts["properties"]) <= set(counts["mutated"]), sorted(
        set(counts["properties"]) - set(counts["mutated"]))
    paths, _ = cs.spec_paths(cs.HONEST_SPEC, cs._spec_schema())
    assert counts["runs"] > len(paths)
    assert counts["exits"].get("0", 0) > 0  # valid mutations ran cases


def test_every_manifest_field_keeps_the_contract(results):
    r = results["manifest"]
    _no_findings(r)
    counts = r["counts"]
    assert set(counts["paths"]) == set(counts["mutated"])
    assert counts["compared"] == len(counts["paths"])  # compare read each mutated manifest
    assert counts["runs"] > 2 * len(counts["paths"])


def test_the_surface_is_read_from_the_parser_and_the_schema():
    """Nothing hand-listed: a new option would be fuzzed; every property of the schema is a
    mutated or added one; the honest argument lists name only existing commands."""
    actions = cs.cli_actions()
    assert set(actions) == set(cs.HONEST_ARGV)
    kinds = {(c, cs._name(a)): cs._kind(a) for c, acts in actions.items() for a in acts}
    assert kinds[("gradcheck", "--directions")] == "number"
    assert kinds[("sweep", "--timeout")] == "number"
    assert kinds[("verify", "--no-gradcheck")] == "flag"
    assert kinds[("golden", "--suite")] == "choice"
    assert kinds[("sweep", "--scheduler")] == "text"
    schema = cs._spec_schema()
    paths, absent = cs.spec_paths(cs.HONEST_SPEC, schema)
    names = {k for p in paths for k in p if isinstance(k, str)} | {n for _, n in absent}
    assert cs._all_property_names(schema) <= names


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> cs.Fixtures:
    return cs.fixtures(tmp_path_factory.mktemp("fuzz-pairs"))


@st.composite
def two_options(draw) -> list[str]:
    """A subcommand's honest argv with two of its options given boundary values."""
    actions = cs.cli_actions()
    valued = {c: [a for a in acts if a.option_strings and a.nargs != 0
                  and (c, cs._name(a)) not in cs.EXCLUDED_OPTIONS]
              for c, acts in actions.items()}
    command = draw(st.sampled_from(sorted(c for c, o in valued.items() if len(o) >= 2)))
    options = valued[command]
    picked = draw(st.lists(st.sampled_from(options), min_size=2, max_size=2,
                           unique_by=lambda a: a.dest))
    argv = cs._honest(command)
    cut = argv.index("--") if "--" in argv else len(argv)
    head, tail = argv[:cut], argv[cut:]
    for action in picked:
        value = draw(st.sampled_from([v for v in cs._values(action)
                                      if (command, cs._name(action), v)
                                      not in cs.EXCLUDED_VALUES]))
        head.append(f"{cs._name(action)}={value}")
    return head + tail


@settings(max_examples=25, deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(argv=two_options())
def test_two_options_at_once_keep_the_contract(fx, argv):
    _, problems = cs._call(fx, argv, None)
    assert not problems, (argv, problems)
