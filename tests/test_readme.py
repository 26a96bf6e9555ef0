"""Every example in README.md and in every page of the documentation site runs as written, each
page in a scratch directory of its own. Nothing assumes the repository root (``data/``,
``examples/`` are not shipped by ``pip install .``): the scratch directory holds only
``goldens/``, the bundle that the getting-started command ``refattn golden --out goldens``
writes, which every page may assume; a page that needs anything else (a SPEC, a candidate)
makes it.

- ``python`` blocks run in order, in one namespace per page, interleaved with the ``bash``
  blocks, as a reader would paste them; a block whose first line is ``# not run: <reason>`` is
  skipped (and must give the reason);
- a ``python`` block whose first line is ``# test_<name>.py`` is a pytest file: it is written
  out and run by pytest in a fresh process, and the counts the page prints after it (``N
  passed, M skipped``) must be the counts of that run (skipped cleanly when its framework is
  not installed);
- every command of a ``bash`` block runs through ``refattn``'s entry point and must exit 0, or
  the code its comment names (``# exit 1``); the few lines that cannot run here are listed in
  :data:`NOT_RUN` with the reason, and the README's test command must be ``.ci/run``'s;
- ``toml`` blocks parse, and one whose first line is ``# <name>.toml`` is written to that file
  (the page's later commands read it).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from refattn.cli import main

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the toml blocks are not parsed
    tomllib = None

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: README and every page of the site, as paths relative to the repository root
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md"))]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", flags=re.S | re.M)

#: commands the pages show that this test does not run, and why (matched as a prefix)
NOT_RUN = {
    "pip install": "installs into the running environment",
    "python3 -m pip install -e": "the CI command itself (checked equal to .ci/run's)",
    "python3 -m pytest": "the test suite itself",
    "python3 benchmarks/": "a benchmark (long, machine-dependent)",
    "python3 -m gpu_backend": "needs the CUDA toolkit (tests/gpu runs what a CPU can)",
    "mkdocs": "builds this site (tests/test_docs_site.py does)",
    "g++": "compiles a user's C++ test (tests/cpp/test_cpp.py builds the header's own)",
    "cmake": "configures a user's C++ project (tests/cpp/test_cpp.py builds the header's own)",
    "refattn golden --suite kernels": "writes 2 GB in about 35 s (benchmarks/"
                                      "kernel_suite.py; tests/bundle/test_numba_generator.py "
                                      "writes and verifies a selection)",
}
#: options whose lines are not run: they start or need a dask cluster (tests/distributed)
CLUSTER = ("--workers", "--scheduler")


def blocks(page: str = "README.md") -> list[tuple[str, str]]:
    return [(lang, body) for lang, body in FENCE.findall((ROOT / page).read_text())]


def pytest_files(page: str = "README.md") -> list[tuple[str, str, str | None]]:
    """(file name, source, the text block after it) of every pytest-file example."""
    out = []
    items = blocks(page)
    for n, (lang, body) in enumerate(items):
        first = body.splitlines()[0] if body.strip() else ""
        if lang == "python" and re.fullmatch(r"# test_\w+\.py", first):
            after = items[n + 1][1] if n + 1 < len(items) and items[n + 1][0] == "text" else None
            out.append((first[2:], body, after))
    return out


def commands(body: str) -> list[tuple[list[str], int, str]]:
    """(argv, expected exit code, the command's text) of every command in a bash block."""
    out = []
    for line in body.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        code, _, comment = line.partition("  #")
        expected = int(m.group(1)) if (m := re.search(r"exit (\d+)", comment)) else 0
        for part in code.split("&&"):
            out.append((shlex.split(part), expected, part.strip()))
    return out


def _skip_reason(text: str) -> str | None:
    for prefix, why in NOT_RUN.items():
        if text.startswith(prefix):
            return why
    if any(option in text.split() for option in CLUSTER):
        return "starts or needs a dask cluster (tests/distributed runs one)"
    if text.startswith("refattn plot") and importlib.util.find_spec("matplotlib") is None:
        return "needs matplotlib"
    return None


def run_page(page: str, capsys) -> int:
    """Run every example of ``page`` in the current directory; returns how many ran."""
    namespace: dict = {"__name__": "__docs__"}
    ran = 0
    for lang, body in blocks(page):
        first = body.splitlines()[0] if body.strip() else ""
        if lang == "python" and first.startswith("# not run:"):
            assert len(first) > len("# not run: ") + 3, f"{page}: say why the block is not run"
        elif lang == "python" and not first.startswith("# test_"):
            exec(compile(body, str(ROOT / page), "exec"), namespace)
            ran += 1
        elif lang == "bash":
            for argv, expected, text in commands(body):
                if _skip_reason(text) is not None:
                    continue
                assert argv[0] == "refattn", f"{page} runs {text!r}: list it in NOT_RUN"
                code = main(argv[1:])
                out = capsys.readouterr()
                assert code == expected, f"{page}: {text}: exit {code}\n{out.out[-2000:]}{out.err}"
                ran += 1
        elif lang == "toml" and tomllib is not None:
            tomllib.loads(body)
            if re.fullmatch(r"# [\w.-]+\.toml", first):
                Path(first[2:]).write_text(body.split("\n", 1)[1])
    return ran


def test_readme_test_command_is_the_ci_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"```bash\n{ci}\n```" in README.read_text()
    assert f"```bash\n{ci}\n```" in (DOCS / "getting-started.md").read_text()


def test_readme_is_a_landing_page_that_links_every_tutorial():
    text = README.read_text()
    assert len(text.splitlines()) < 200
    for page in ("getting-started.md", "tutorials/pytest.md", "tutorials/goldens.md",
                 "how-to/cli.md", "how-to/tolerances.md", "how-to/bundle-format.md"):
        assert f"](docs/{page})" in text, page
    for link in re.findall(r"\]\((docs/[^)#]+)", text):  # every link resolves
        assert (ROOT / link).is_file(), link


@pytest.fixture(scope="session")
def goldens(tmp_path_factory) -> Path:
    """The bundle of the getting-started command, written once per session."""
    out = tmp_path_factory.mktemp("docs") / "goldens"
    assert main(["golden", "--out", str(out), "--quiet"]) == 0
    return out


@pytest.mark.parametrize("page", PAGES)
def test_page_examples_run_in_order(page, tmp_path, monkeypatch, capsys, goldens):
    shutil.copytree(goldens, tmp_path / "goldens")  # what the reader's first command wrote
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)  # a scratch directory: no data/ or examples/ of the checkout
    ran = run_page(page, capsys)
    runnable = [b for lang, b in blocks(page) if lang == "python"
                and not b.startswith(("# test_", "# not run:"))]
    runnable += [text for lang, b in blocks(page) if lang == "bash"
                 for _, _, text in commands(b) if _skip_reason(text) is None]
    if not runnable:
        pytest.skip(f"{page} has no example to run")
    assert ran >= 1
    if page == "docs/tutorials/goldens.md" and importlib.util.find_spec("matplotlib"):
        plots = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
        assert plots == ["causal_lower_right_q3_k7_error_output.png",
                         "causal_lower_right_q3_k7_probs.png",
                         "causal_lower_right_q3_k7_visible.png"]


def test_the_dask_tutorial_shows_the_shipped_example_spec():
    spec = next(body for lang, body in blocks("docs/tutorials/dask.md")
                if lang == "toml" and body.startswith("# sweep.toml\n"))
    assert spec.split("\n", 1)[1] == (ROOT / "examples" / "sweep.toml").read_text()


def test_goldens_tutorial_shows_the_compare_output_it_gets(tmp_path, monkeypatch, capsys):
    """The compare report quoted in the tutorial is the one the command prints (its rows)."""
    page = "docs/tutorials/goldens.md"
    monkeypatch.chdir(tmp_path)
    quoted = next(body for lang, body in blocks(page) if lang == "text"
                  and body.startswith("case causal_lower_right_q3_k7"))
    setup = next(body for lang, body in blocks(page) if lang == "python"
                 and "my_outputs.safetensors" in body)
    import numpy as np

    from refattn import bundle

    assert main(["golden", "--out", "goldens", "--quiet"]) == 0
    exec(compile(setup, page, "exec"), {"np": np, "bundle": bundle})
    capsys.readouterr()
    assert main(["compare", "goldens/cases/causal_lower_right_q3_k7.safetensors",
                 "my_outputs.safetensors"]) == 1
    printed = capsys.readouterr().out.splitlines()
    for line in quoted.splitlines():
        if line.strip() != "...":
            assert line in printed, line


def _eligible(name: str) -> int | None:
    """How many runs should pass, from the adapters' own verdicts (not refattn.testing's);
    None for an example whose count this test does not derive independently."""
    from refattn.adapters import jax as jax_adapter
    from refattn.adapters import torch as torch_adapter
    from refattn.bundle.golden.spec import case_spec
    from refattn.bundle.suites import build_suite

    specs = [case_spec(c) for c in build_suite("conformance")]
    sdpa = [s for s in specs if torch_adapter.ineligible(s, "sdpa") is None]
    return {"test_torch_sdpa.py": 2 * len(sdpa),  # float64 and float32
            "test_jax_attention.py": sum(jax_adapter.ineligible(s) is None for s in specs),
            "test_my_attention.py": sum("bias" not in s.tensors for s in sdpa)}.get(name)


def _framework(source: str) -> str | None:
    for name in ("torch", "jax"):
        if re.search(rf"^import {name}\b|^from {name}\b", source, flags=re.M):
            return name
    return None


EXAMPLES = [(page, *f) for page in PAGES for f in pytest_files(page)]


@pytest.mark.parametrize(("page", "name", "source", "quoted"), EXAMPLES,
                         ids=[f"{e[0]}:{e[1]}" for e in EXAMPLES])
def test_pytest_examples_pass_on_every_eligible_case(tmp_path, page, name, source, quoted):
    framework = _framework(source)
    if framework is not None:
        pytest.importorskip(framework)
    (tmp_path / name).write_text(source)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "REFATTN_QUIET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           name], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|skipped|failed)", summary))
    assert counts.get("failed", 0) == 0 and counts.get("passed", 0) >= 1, summary
    if (eligible := _eligible(name)) is not None:
        assert counts["passed"] == eligible, "the adapters' own count of expressible cases"
    assert quoted is not None, f"{page} shows no output after {name}"
    shown = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|skipped)", quoted))
    assert shown == {k: counts.get(k, 0) for k in shown}, (summary, quoted)
    for line in quoted.splitlines():  # the skip reasons quoted are among those printed
        if line.startswith("SKIPPED") and not line.endswith("(...)"):
            assert line in proc.stdout, line
        elif line.startswith("SKIPPED"):
            assert line[:-len("(...)")] in proc.stdout, line
