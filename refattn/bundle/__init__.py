"""Golden bundles: write, read, verify and compare against the reference's fixture files.

Owns the bundle file format (:mod:`~refattn.bundle.format`), golden cases and what they store
(:mod:`~refattn.bundle.cases`), writing (:mod:`~refattn.bundle.write`), manifests and reading
(:mod:`~refattn.bundle.manifest`, :mod:`~refattn.bundle.read`), the call rebuilt from a file
(:mod:`~refattn.bundle.spec`), the named suites (:mod:`~refattn.bundle.suites`), ``refattn
verify`` (:mod:`~refattn.bundle.verifier` and the steps it calls) and the comparison harness for
other stacks' tensors (:mod:`~refattn.bundle.comparison`, tolerances, the low-precision naive
model, candidate files). It runs the engine and gradcheck; it must not import adapters or cli.
The names below are imported on first use.

Examples
--------
>>> import tempfile
>>> from refattn import bundle
>>> d = tempfile.mkdtemp()
>>> _ = bundle.write_bundle(d, bundle.build_suite("contract"), suite="contract")
>>> bundle.verify(d).passed
True
"""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> the module of this package that owns it (imported on first use, so that
#: reading a suite or a case file does not load the writer, the certificate or gradcheck)
_OWNERS: dict[str, str] = {
    "read_candidate": "candidates", "write_candidate": "candidates",
    "Computed": "cases", "GoldenCase": "cases", "compute": "cases",
    "Report": "comparison", "compare": "comparison",
    "SCHEMA": "format", "SCHEMA_VERSION": "format", "atomic_write": "format",
    "tensor_sha256": "format",
    "LoadedCase": "read", "load": "read",
    "CaseSpec": "spec", "case_spec": "spec",
    "SUITES": "suites", "build_suite": "suites",
    "Tolerances": "tolerances",
    "verify": "verifier",
    "write_bundle": "write",
}

__all__ = sorted(_OWNERS)


def __getattr__(name: str) -> Any:
    if name not in _OWNERS:
        raise AttributeError(f"module 'refattn.bundle' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"refattn.bundle.{_OWNERS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_OWNERS))
