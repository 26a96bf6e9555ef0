"""Comparison: does another stack's result match a golden case, and if not, why?

Owns the harness (:mod:`.harness`: :func:`~.harness.compare` and its report), the tolerance
settings and precision names (:mod:`.tolerances`), refattn's naive algorithm in a lower
precision (:mod:`.lowp`, the yardstick of the float32/float16/bfloat16 rule), candidate files
(:mod:`.candidates`) and the diagnoses of a failure (:mod:`.diagnosis`). Reads golden cases
through :mod:`refattn.bundle.golden`; never verifies or writes a bundle.
"""

from __future__ import annotations

import importlib
from typing import Any

#: the harness's names, the room's public face (``refattn.bundle.comparison.compare``, as
#: before the rooms, when the harness was this module); imported on first use
_HARNESS = ("CHECKS", "LEGEND", "TRACE_ORDER", "Report", "TensorReport", "compare", "plain",
            "required_tensors")

__all__ = list(_HARNESS)


def __getattr__(name: str) -> Any:
    if name not in _HARNESS:
        raise AttributeError(f"module 'refattn.bundle.comparison' has no attribute {name!r}")
    return getattr(importlib.import_module("refattn.bundle.comparison.harness"), name)
