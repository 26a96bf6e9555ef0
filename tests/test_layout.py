"""The layout's rules hold: import contracts pass, planted violations fail them, and every name
of the old flat layout still imports (with a DeprecationWarning naming the new home)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("refattn", "gradcheck", "gpu_backend")
FLAT_NAMES = json.loads((ROOT / "tests" / "data" / "flat_layout_public_names.json").read_text())


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    """Run import-linter on the tree at ``root`` (its pyproject.toml, its packages first)."""
    code = "import sys; from importlinter.cli import lint_imports as li; sys.exit(li())"
    env = {"PYTHONPATH": str(root), "PATH": "", "COLUMNS": "1000"}  # one contract per line
    return subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, env=env, timeout=120)


def test_import_contracts_hold():
    pytest.importorskip("importlinter")
    proc = _lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


#: (module to edit, line appended, contract that must break)
PLANTED = [
    ("refattn/call/gate.py", "from refattn.bundle.verification import verifier",
     "refattn layers"),
    ("refattn/masks/relation.py", "from refattn.call import AttentionCall",
     "refattn layers"),
    ("refattn/masks/relation.py", "from refattn.masks import constructors",
     "no import cycles"),
    ("refattn/bundle/storage/read.py", "from refattn.bundle.comparison import harness",
     "bundle rooms, bottom up"),
    ("refattn/bundle/verification/report.py",
     "from refattn.bundle.verification import recompute", "inside the verification room"),
    ("refattn/bundle/comparison/tolerances.py",
     "from refattn.bundle.comparison import lowp", "inside the comparison room"),
    ("gradcheck/api.py", "from refattn.errors import RefAttnError",
     "gradcheck's generic checker imports nothing from refattn"),
    ("refattn/engine/numba/math.py", "from refattn._checks import first_index",
     "numba kernels depend only on their own package"),
    ("refattn/engine/reference.py", "import refattn",
     "no module inside refattn imports the refattn package itself"),
    ("refattn/engine/__init__.py", "import gpu_backend",
     "refattn never imports gpu_backend"),
]


@pytest.mark.parametrize(("module", "line", "contract"), PLANTED,
                         ids=[f"{m.split('/')[-1]}:{c.split()[0]}" for m, _, c in PLANTED])
def test_a_planted_forbidden_import_breaks_its_contract(tmp_path, module, line, contract):
    pytest.importorskip("importlinter")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / module, "a") as fh:
        fh.write(f"\n{line}  # planted\n")
    proc = _lint_imports(tmp_path)
    assert proc.returncode != 0, proc.stdout
    broken = [ln for ln in proc.stdout.splitlines() if ln.endswith(" BROKEN")]
    assert any(ln.startswith(contract) for ln in broken), (contract, broken)


@pytest.mark.parametrize("old", sorted(FLAT_NAMES))
def test_every_name_of_the_flat_layout_still_imports(old):
    if type(sys.modules.get(old)).__name__ == "_Shim":
        del sys.modules[old]  # imported earlier in this session: import it afresh
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    for name in FLAT_NAMES[old]:
        assert getattr(module, name) is not None, f"{old}.{name}"
    moved = [w for w in caught if issubclass(w.category, DeprecationWarning)
             and str(w.message).startswith(f"{old} moved to ")]
    if type(module).__name__ == "_Shim":  # an old path: one warning, naming the new home
        assert moved, f"importing {old} gave no DeprecationWarning"
    else:  # a path that is still a real module or package
        assert not moved


def test_an_old_path_resolves_to_the_same_objects():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from refattn.golden import write_bundle
        from refattn.scores import Bilinear
        from refattn.visibility import VisibilityRelation, causal
    from refattn.bundle.writing.write import write_bundle as new_write
    from refattn.call.scores import Bilinear as NewBilinear
    from refattn.masks import VisibilityRelation as NewRelation
    from refattn.masks import causal as new_causal

    assert write_bundle is new_write and Bilinear is NewBilinear
    assert VisibilityRelation is NewRelation and causal is new_causal


def test_no_reference_to_a_design_document_outside_the_repository():
    proc = subprocess.run(["git", "grep", "-n", "-I", "-e", "DESIGN.md", "-e", "shared/",
                           "--", ":!tests/test_layout.py"], cwd=ROOT, capture_output=True,
                          text=True)
    if proc.returncode not in (0, 1):
        pytest.skip("not a git checkout")
    assert proc.stdout == "", proc.stdout
    assert (ROOT / "docs" / "ARCHITECTURE.md").is_file()
    assert "docs/ARCHITECTURE.md" in (ROOT / "README.md").read_text()


def test_every_package_init_says_what_it_owns():
    for init in sorted((ROOT / "refattn").rglob("__init__.py")):
        doc = importlib.import_module(
            ".".join(init.relative_to(ROOT).parent.parts)).__doc__ or ""
        assert len(doc.split()) >= 15, f"{init} needs a docstring saying what it owns"


def test_no_benchmark_script_shadows_an_importable_module():
    # benchmarks/ is sys.path[0] when a script runs, and processes it spawns inherit the path:
    # a script named like a package (dask's "distributed" once) replaces it in every worker.
    # Asked in a fresh interpreter: this session's sys.modules may hold a loaded benchmark.
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    names = sorted(script.stem for script in bench.glob("*.py"))
    probe = ("import importlib.util, json, sys; names = json.loads(sys.argv[1]); "
             "print(json.dumps({n: n in sys.stdlib_module_names or "
             "importlib.util.find_spec(n) is not None for n in names}))")
    out = subprocess.run([sys.executable, "-c", probe, json.dumps(names)], cwd=bench.parent,
                         capture_output=True, text=True, check=True, timeout=120)
    found = json.loads(out.stdout)
    assert len(found) == len(names) > 0
    assert not any(found.values()), {n for n, hit in found.items() if hit}
