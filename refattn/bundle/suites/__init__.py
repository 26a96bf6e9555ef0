"""Named golden suites: functions returning lists of :class:`~refattn.bundle.GoldenCase`.

Owns the registry of suite names; each suite module owns its case definitions (``contract``:
the contract's published fixtures; ``conformance``: the 79 named cases of ``data/golden``).
Suites build calls and GoldenCases; they must not import the readers, verify or compare.
"""

from __future__ import annotations

from collections.abc import Callable

from refattn.bundle.golden.case import GoldenCase
from refattn.bundle.suites import conformance, contract
from refattn.errors import RefAttnError

__all__ = ["SUITES", "build_suite"]

#: suite name -> function returning the suite's list of GoldenCase
SUITES: dict[str, Callable[[], list[GoldenCase]]] = {
    "contract": contract.cases,
    "conformance": conformance.cases,
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
    return SUITES[name]()
