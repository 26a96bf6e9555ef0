"""Golden bundles: write, read, verify and compare against the reference's fixture files.

Owns the bundle file format (:mod:`~refattn.bundle.format`), golden cases and what they store
(:mod:`~refattn.bundle.cases`), writing (:mod:`~refattn.bundle.write`), manifests and reading
(:mod:`~refattn.bundle.manifest`, :mod:`~refattn.bundle.read`), the call rebuilt from a file
(:mod:`~refattn.bundle.spec`), the named suites (:mod:`~refattn.bundle.suites`), ``refattn
verify`` (:mod:`~refattn.bundle.verify` and the steps it calls) and the comparison harness for
other stacks' tensors (:mod:`~refattn.bundle.compare`, tolerances, the low-precision naive
model, candidate files). It runs the engine and gradcheck; it must not import adapters or cli.

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

from refattn.bundle.candidates import read_candidate, write_candidate
from refattn.bundle.cases import Computed, GoldenCase, compute
from refattn.bundle.compare import Report, compare
from refattn.bundle.format import SCHEMA, SCHEMA_VERSION, atomic_write, tensor_sha256
from refattn.bundle.read import LoadedCase, load
from refattn.bundle.spec import CaseSpec, case_spec
from refattn.bundle.suites import SUITES, build_suite
from refattn.bundle.tolerances import Tolerances
from refattn.bundle.verify import verify
from refattn.bundle.write import write_bundle

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "SUITES",
    "CaseSpec",
    "Computed",
    "GoldenCase",
    "LoadedCase",
    "Report",
    "Tolerances",
    "atomic_write",
    "build_suite",
    "case_spec",
    "compare",
    "compute",
    "load",
    "read_candidate",
    "tensor_sha256",
    "verify",
    "write_bundle",
    "write_candidate",
]
