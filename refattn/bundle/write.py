"""Write a golden bundle: compute every case, encode it, and write the bundle as one transaction.

Owns :func:`write_bundle`: the output directory is checked and locked first (a link, a file, a
foreign manifest or a concurrent writer is refused before any arithmetic), every case is
computed before anything is written (a failing case writes nothing), each case file is a
safetensors file whose one metadata key lists its tensor hashes, and the manifest records the
call manifest, conventions and sha256 of every file and tensor. The files reach the directory
through :class:`~refattn.bundle.transaction.BundleTransaction` (staged, fsynced, swapped in with
one rename). Byte-for-byte reproducible: C-contiguous little-endian tensors, sorted JSON keys.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import safetensors
from safetensors.numpy import save

from refattn._progress import progress as progress_bar
from refattn._version import __version__
from refattn.analysis.reference_error import reference_error
from refattn.bundle.cases import (
    GENERATORS,
    GoldenCase,
    case_conventions,
    case_tensors,
    compute,
    numpy_environment,
)
from refattn.bundle.format import (
    META_KEY,
    SCHEMA,
    SCHEMA_VERSION,
    dump_json,
    tensor_sha256,
)
from refattn.bundle.transaction import BundleTransaction
from refattn.engine.exact.program import ROUNDING_POINTS
from refattn.errors import RefAttnError

__all__ = ["encode_case", "write_bundle"]


def encode_case(case: GoldenCase, backend: str = "exact") -> tuple[bytes, dict[str, Any]]:
    """Compute one case and return its file bytes and its manifest entry.

    The entry records, besides the call manifest and checksums, the error of the stored
    tensors against the exact real result of the whole computation
    (:func:`~refattn.analysis.reference_error.reference_error`).

    Examples
    --------
    >>> from refattn.bundle.suites import build_suite
    >>> data, entry = encode_case(build_suite("contract")[0])
    >>> entry["file"], entry["sha256"] == hashlib.sha256(data).hexdigest()
    ('cases/loop6_two_query_training_trace.safetensors', True)
    """
    trace, grads = compute(case, backend)
    tensors = case_tensors(trace, grads, case.layout)
    records = {
        name: {"sha256": tensor_sha256(t), "dtype": str(t.dtype), "shape": list(t.shape)}
        for name, t in sorted(tensors.items())
    }
    meta = json.dumps(
        {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "case_id": case.case_id,
         "tensors": {n: r["sha256"] for n, r in records.items()}},
        sort_keys=True, separators=(",", ":"),
    )
    data = save(tensors, metadata={META_KEY: meta})  # one metadata key: stable header order
    entry = {
        "file": f"cases/{case.case_id}.safetensors",
        "sha256": hashlib.sha256(data).hexdigest(),
        "comment": case.comment,
        "flags": sorted(case.flags),
        "conventions": case_conventions(case),
        "call": trace.manifest(),
        "tensors": records,
        "reference_error": reference_error(case.call, tensors),
    }
    return data, entry


def _generator(backend: str) -> dict[str, Any]:
    """What wrote the bundle. An exact bundle names no numpy or library version: its bytes
    are the same whatever generated them."""
    if backend == "exact":
        return {"refattn": __version__, "backend": backend,
                "arithmetic": {"mode": "stepwise_correctly_rounded",
                               "rounding": "binary64 round to nearest, ties to even",
                               "specification": "docs/EXACT_ROUNDING.md",
                               "rounding_points": dict(ROUNDING_POINTS)}}
    return {"refattn": __version__, "backend": backend, **numpy_environment(),
            "safetensors": safetensors.__version__,
            "arithmetic": {"mode": "ieee754_binary64"}}


def write_bundle(out: str | os.PathLike, cases: Iterable[GoldenCase], *, suite: str,
                 backend: str = "exact", force: bool = False,
                 progress: bool | None = None) -> Path:
    """Compute every case and write the bundle ``out`` as one transaction, reproducibly.

    Parameters
    ----------
    out : path
        Bundle directory: absent (created), empty, or an earlier refattn bundle. A symbolic
        link or an existing file is refused.
    cases : iterable of GoldenCase
    suite : str
        Name recorded in the manifest.
    backend : {"exact", "numpy"}
        Generator: ``exact`` (default) writes the same bytes on every machine.
    force : bool
        Write beside files refattn did not write (they are left untouched). A foreign
        ``manifest.json`` or a foreign file inside ``cases/`` is refused even then.
    progress : bool or None
        A progress bar over the cases on standard error: None (default) on a terminal only,
        False never, True always (:func:`refattn._progress.progress`).

    Returns
    -------
    Path
        The path of ``manifest.json``.

    Raises
    ------
    RefAttnError
        On duplicate case ids, an output directory that is not refattn's to write (see
        :mod:`refattn.bundle.transaction`), a concurrent writer, or a write that fails (a full
        disk, a read-only directory): the previous bundle is then left as it was.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> from refattn.bundle.suites import build_suite
    >>> d = pathlib.Path(tempfile.mkdtemp()) / "b"
    >>> write_bundle(d, build_suite("contract")[:1], suite="contract").name
    'manifest.json'
    >>> _ = (d / "notes.txt").write_text("mine")
    >>> try:
    ...     write_bundle(d, build_suite("contract")[:1], suite="contract")
    ... except RefAttnError as exc:
    ...     print("did not write" in str(exc))
    True
    """
    if backend not in GENERATORS:
        raise RefAttnError(f"backend: golden bundles are generated by one of {list(GENERATORS)}, "
                           f"got {backend!r}")
    out = Path(out)
    with BundleTransaction(out, force=force) as tx:  # refuse before any arithmetic
        encoded: dict[str, tuple[bytes, dict[str, Any]]] = {}
        cases = list(cases)
        for case in progress_bar(cases, desc=f"golden {suite}", enabled=progress):
            # compute everything first: a failing case writes nothing
            if case.case_id in encoded:
                raise RefAttnError(f"case_id: duplicate case {case.case_id!r} in suite "
                                   f"{suite!r}")
            encoded[case.case_id] = encode_case(case, backend)
        manifest = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "suite": suite,
                    "generator": _generator(backend),
                    "cases": {case_id: entry for case_id, (_, entry) in encoded.items()}}
        files = {entry["file"]: data for data, entry in encoded.values()}
        files["manifest.json"] = dump_json(manifest)
        tx.commit(files)
    return tx.out / "manifest.json"
