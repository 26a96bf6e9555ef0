"""Test your own attention function against refattn's golden cases, in pytest.

Owns the user-facing testing kit: :class:`Supports` (what the function under test computes),
:func:`cases` (a decorator that runs a test once per eligible golden case and dtype, the others
skipped with the reason; test ids are the case names), :class:`Case` (one case in one dtype:
``case.inputs``, ``case.visible``, ``case.query_valid``, ``case.to_torch_sdpa()``,
``case.to_jax()``), :func:`assert_matches` (``refattn compare``'s rule as an assertion that
names the worst element, its index and the tolerance) and :func:`load_cases`. The pytest
plugin (:mod:`refattn.testing.plugin`) is registered through the ``pytest11`` entry point, so
installing refattn is all it takes; it adds ``--refattn-bundle DIR``. Sits above the adapters
and the bundle; nothing in refattn imports it. Names are imported on first use, so the plugin
costs a pytest session nothing until a test asks for cases.

Examples
--------
>>> from refattn.testing import Supports, load_cases
>>> from refattn.testing.supports import ineligibility
>>> specs = load_cases()
>>> sum(ineligibility(s, Supports()) is None for s in specs), len(specs)
(63, 79)
"""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> the module of this package that owns it (imported on first use)
_OWNERS: dict[str, str] = {
    "Case": "case", "load_cases": "case",
    "Supports": "supports", "ineligibility": "supports",
    "assert_matches": "matching",
    "cases": "plugin",
}

__all__ = sorted(_OWNERS)


def __getattr__(name: str) -> Any:
    if name not in _OWNERS:
        raise AttributeError(f"module 'refattn.testing' has no attribute {name!r}")
    # looked up in sys.modules every time (not cached here): the module that owns a name is
    # the one whose classes the plugin checks against, also after pytester drops modules
    return getattr(importlib.import_module(f"refattn.testing.{_OWNERS[name]}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_OWNERS))
