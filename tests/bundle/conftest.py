"""Bundles the bundle tests start from: written once, copied per test that edits one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from refattn.bundle.suites import build_suite
from refattn.bundle.writing.write import write_bundle


@pytest.fixture(scope="session")
def pristine(tmp_path_factory) -> Path:
    """The contract suite's first two cases (Loop 6 and Loop 7); a module may override it."""
    out = tmp_path_factory.mktemp("pristine") / "b"
    write_bundle(out, build_suite("contract")[:2], suite="contract")
    return out


@pytest.fixture
def bundle(pristine, tmp_path) -> Path:
    """A private copy of ``pristine`` that a test may damage."""
    out = tmp_path / "b"
    shutil.copytree(pristine, out)
    return out
