"""Test-session configuration: hypothesis profiles.

Under CI (``CI`` set in the environment) hypothesis is derandomised, so a CI run explores the
same examples every time and a red build is always reproducible; local runs keep exploring new
examples, and every shrunk failure found that way is pinned as an explicit case in its test.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))
