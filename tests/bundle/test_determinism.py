"""Golden bytes depend on the inputs alone: not on BLAS or numba thread counts, nor (for the
exact generator) on the numpy version. Each run is a separate process."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

GENERATE = """
import sys, numba, numpy
from threadpoolctl import threadpool_limits
from refattn.bundle.suites import build_suite
from refattn.bundle.writing.write import write_bundle
out, backend, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
if threads:
    numba.set_num_threads(threads)
with threadpool_limits(limits=threads or None):
    write_bundle(out, build_suite("conformance"), suite="conformance", backend=backend)
print(numpy.__version__)
"""


def _generate(python: str, out: Path, backend: str, threads: int,
              path: tuple[Path, ...] = ()) -> str:
    pythonpath = os.pathsep.join(str(p) for p in (*path, ROOT))  # ``path`` shadows the rest
    proc = subprocess.run([python, "-c", GENERATE, str(out), backend, str(threads)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": pythonpath})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def exact_one_thread(tmp_path_factory) -> dict[str, str]:
    """The digests of the exact conformance bundle written by this interpreter on 1 thread
    (both tests below compare with it)."""
    out = tmp_path_factory.mktemp("exact") / "one"
    _generate(sys.executable, out, "exact", threads=1)
    return _digest(out)


@pytest.mark.parametrize("backend", ["exact", "numpy"])
def test_golden_bytes_do_not_depend_on_thread_counts(tmp_path, backend, request):
    one, two = tmp_path / "one", tmp_path / "two"
    if backend == "exact":
        first = request.getfixturevalue("exact_one_thread")
    else:
        _generate(sys.executable, one, backend, threads=1)
        first = _digest(one)
    _generate(sys.executable, two, backend, threads=2)
    assert first == _digest(two)


@pytest.mark.slow
def test_exact_golden_bytes_do_not_depend_on_the_numpy_version(tmp_path, exact_one_thread):
    """Generate with an older numpy minor version; compare with this interpreter's.

    Only numpy is swapped: the older version is installed into a directory of its own
    (``pip install --target``) that goes first on the child's PYTHONPATH, and everything
    else (numba, threadpoolctl, refattn) comes from this interpreter's environment, a venv
    or not (a nested venv with system site packages would see the base interpreter's, not
    an outer venv's).
    """
    import numpy

    major, minor = (int(x) for x in numpy.__version__.split(".")[:2])
    older = f"numpy=={major}.{minor - 1}.*" if minor else "numpy<2"
    target = tmp_path / "older-numpy"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                          "--disable-pip-version-check", "--target", str(target), older],
                         capture_output=True, text=True, timeout=600)
    if pip.returncode != 0:
        pytest.skip(f"cannot install {older} here: {pip.stderr.strip()[-300:]}")
    there = tmp_path / "there"
    version = _generate(sys.executable, there, "exact", threads=1, path=(target,))
    assert version.startswith(f"{major}.{minor - 1}." if minor else f"{major - 1}.")
    assert _digest(there) == exact_one_thread  # this interpreter's numpy, the same bytes
    manifest = json.loads((there / "manifest.json").read_text())
    assert "numpy" not in json.dumps(manifest)  # no numpy version anywhere in an exact bundle


def test_the_numpy_generator_runs_blas_on_one_thread(monkeypatch):
    """What makes numpy golden bytes independent of the BLAS thread count (issue 16): the
    generator pins every BLAS pool to one thread while it computes, whatever the caller set
    (a threaded BLAS may split a product's sum differently with more threads)."""
    from threadpoolctl import threadpool_info, threadpool_limits

    from refattn.bundle.golden import case as cases
    from refattn.bundle.suites import build_suite

    seen: list[int] = []
    real = cases.forward

    def recording(call, **kw):
        seen.extend(i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas")
        return real(call, **kw)

    monkeypatch.setattr(cases, "forward", recording)
    with threadpool_limits(limits=2):
        cases.compute(build_suite("contract")[0], "numpy")
    assert seen and set(seen) == {1}
