"""Test-session configuration: hypothesis profiles.

Under CI (``CI`` set in the environment) hypothesis is derandomised, so a CI run explores the
same examples every time and a red build is always reproducible; local runs keep exploring new
examples, and every shrunk failure found that way is pinned as an explicit case in its test.

The numba backend's BLAS calibration (``refattn calibrate``) is cached in a directory of the
test session, never in the user's cache, unless ``REFATTN_CACHE_DIR`` is already set.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

# no per-example deadline: a test never asserts wall-clock time, and hypothesis' default 200 ms
# deadline fails examples that a loaded machine merely runs slowly
settings.register_profile("ci", derandomize=True, print_blob=True, deadline=None)
settings.register_profile("dev", print_blob=True, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(autouse=True, scope="session")
def _calibration_cache(tmp_path_factory):
    if os.environ.get("REFATTN_CACHE_DIR"):
        yield
        return
    os.environ["REFATTN_CACHE_DIR"] = str(tmp_path_factory.mktemp("refattn-cache"))
    yield
    os.environ.pop("REFATTN_CACHE_DIR", None)
