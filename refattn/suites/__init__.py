"""Named golden suites: functions returning lists of :class:`~refattn.golden.GoldenCase`.

Owns the registry of suite names; each suite module owns its case definitions.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from refattn.errors import RefAttnError
from refattn.golden import GoldenCase

__all__ = ["SUITES", "build_suite"]

#: suite name -> "module:function" returning list[GoldenCase]
SUITES: dict[str, str] = {
    "contract": "refattn.suites.contract:cases",
    "conformance": "refattn.suites.conformance:cases",
}


def build_suite(name: str) -> list[GoldenCase]:
    """Build the cases of a named suite.

    Examples
    --------
    >>> [c.case_id for c in build_suite("contract")][:2]
    ['loop6_two_query_training_trace', 'loop7_cross_attention_padded_source']
    """
    if name not in SUITES:
        raise RefAttnError(f"suite: unknown suite {name!r}; known suites: {sorted(SUITES)}")
    module, func = SUITES[name].split(":")
    factory: Callable[[], list[GoldenCase]] = getattr(importlib.import_module(module), func)
    return factory()
