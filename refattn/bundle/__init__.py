"""Golden bundles: write, read, verify and compare against the reference's fixture files.

Each job is a room (a sub-package), listed from the bottom up; a room imports only the rooms
below it (import-linter checks it):

- :mod:`~refattn.bundle.storage`: format and I/O (the file format, confined reads, the output
  directory's transaction, manifests, case files);
- :mod:`~refattn.bundle.golden`: what a golden case is (the call, its tensors, the call rebuilt
  from a file, the generator's float64 guarantee);
- :mod:`~refattn.bundle.writing`, :mod:`~refattn.bundle.sweeps`, :mod:`~refattn.bundle.suites`:
  writing bundles, sweep SPECs, the named suites;
- :mod:`~refattn.bundle.comparison`: another stack's tensors against a golden (the rules, the
  naive lower-precision yardstick, candidate files, diagnoses);
- :mod:`~refattn.bundle.verification`: ``refattn verify``.

It runs the engine and gradcheck; it must not import adapters or cli. The names below are
imported on first use.

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
    "read_candidate": "comparison.candidates", "write_candidate": "comparison.candidates",
    "Computed": "golden.case", "GoldenCase": "golden.case", "compute": "golden.case",
    "Report": "comparison.harness", "compare": "comparison.harness",
    "SCHEMA": "storage.format", "SCHEMA_VERSION": "storage.format",
    "atomic_write": "storage.format", "tensor_sha256": "storage.format",
    "LoadedCase": "storage.read", "load": "storage.read",
    "CaseSpec": "golden.spec", "case_spec": "golden.spec",
    "SUITES": "suites", "build_suite": "suites",
    "Tolerances": "comparison.tolerances",
    "verify": "verification.verifier",
    "write_bundle": "writing.write",
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
