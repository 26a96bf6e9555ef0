"""Native (C/C++) readers of golden bundles: where the header lives, and the yardsticks it reads.

Owns :func:`include_dir` (the folder of ``refattn.hpp`` and ``refattn.h``, package data of
``refattn``; ``refattn include-dir`` prints it), :func:`yardstick_table` and :func:`yardsticks`
(the lower-precision rule's yardstick of a case, the naive algorithm's error in a dtype and
each tensor's natural magnitude, as the JSON document ``refattn::Bundle::load_yardsticks``
reads) and :func:`bundle_yardsticks` (the same document for every case of a bundle read back
with every checksum: ``refattn yardstick``). The rule itself is
:mod:`refattn.bundle.comparison.harness`'s; the header applies it with these numbers. Python's
``compare`` never reads a stored yardstick (it recomputes its own); ``refattn verify``
recomputes the ones a manifest stores (:mod:`refattn.bundle.verification.yardsticks`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from refattn._boundary import public
from refattn.bundle.comparison.lowp import naive_routes, natural_magnitudes
from refattn.bundle.comparison.tolerances import LOWER_PRECISIONS, Tolerances, resolve_dtype
from refattn.bundle.golden.spec import CaseSpec, case_spec
from refattn.bundle.storage.fsio import MAX_MANIFEST_BYTES, check_relative, read_confined
from refattn.bundle.storage.manifest import check_schema, parse_manifest, read_manifest
from refattn.bundle.storage.read import load
from refattn.errors import RefAttnError

__all__ = ["DEFAULT_NAMES", "YARDSTICK_SCHEMA", "bundle_specs", "bundle_yardsticks",
           "include_dir", "yardstick_table", "yardsticks"]

#: the ``schema`` of a yardstick document (docs/reference/cpp.md)
YARDSTICK_SCHEMA = "refattn_yardsticks"
#: the tensors a kernel under test returns: the ones given yardsticks unless told otherwise
#: (``refattn yardstick``, ``refattn golden --with-yardsticks``); a case lacking one skips it
DEFAULT_NAMES = ("output", "lse", "grad_q", "grad_k", "grad_v", "grad_bias", "grad_sink")


@public
def include_dir() -> Path:
    """The folder holding ``refattn.hpp`` and ``refattn.h`` (pass it to ``-I``).

    Returns
    -------
    pathlib.Path

    Examples
    --------
    >>> sorted(p.name for p in include_dir().glob("refattn.h*"))
    ['refattn.h', 'refattn.hpp']
    """
    path = Path(str(resources.files("refattn").joinpath("include")))
    if not (path / "refattn.hpp").is_file():
        raise RefAttnError(f"{path}: refattn.hpp is missing (the package was installed without "
                           "its include folder: package data refattn/include/*)")
    return path


def _record(x: float) -> dict[str, str]:
    return {"hex": float(x).hex(), "decimal": repr(float(x))}


@public
def yardsticks(specs: Sequence[CaseSpec], dtype: str, names: Sequence[str] = ("output",)
               ) -> dict[str, Any]:
    """The yardsticks of ``names`` in ``dtype`` for each case, as a JSON-ready document.

    For each tensor: ``reference_error``, the largest ``max|naive - g|`` over the naive
    algorithm's saved-state routes run in ``dtype`` (finite elements of both), and
    ``natural_magnitude`` (0 where the case has none), exactly the numbers
    :func:`refattn.bundle.comparison.compare` uses, as hex floats.

    Parameters
    ----------
    specs : sequence of CaseSpec
    dtype : {"float32", "float16", "bfloat16"}
    names : sequence of str
        Canonical tensor names (each case's missing ones are left out).

    Returns
    -------
    dict
        ``{"schema": "refattn_yardsticks", "schema_version": "1.0", "cases": {case:
        {dtype: {name: {"reference_error": {"hex", "decimal"}, "natural_magnitude": ...}}}}}``

    Examples
    --------
    >>> from refattn.bundle.suites import build_suite
    >>> from refattn.bundle.golden.spec import case_spec
    >>> spec = case_spec(build_suite("contract")[1])
    >>> doc = yardsticks([spec], "float32")
    >>> rec = doc["cases"][spec.case_id]["float32"]["output"]
    >>> 0 < float.fromhex(rec["reference_error"]["hex"]) < 1e-5
    True
    """
    cases = {spec.case_id: {dtype: yardstick_table(spec, dtype, names)} for spec in specs}
    return {"schema": YARDSTICK_SCHEMA, "schema_version": "1.0", "cases": cases}


def _check_dtype(dtype: str) -> None:
    if dtype not in LOWER_PRECISIONS:
        raise RefAttnError(f"dtype: expected one of {list(LOWER_PRECISIONS)}, got {dtype!r}")


@public
def yardstick_table(spec: CaseSpec, dtype: str, names: Sequence[str] = DEFAULT_NAMES
                    ) -> dict[str, Any]:
    """One case's yardsticks in one dtype: ``{name: {"reference_error": record,
    "natural_magnitude": record}}`` (records ``{"hex", "decimal"}``).

    Names the case lacks, or that the naive algorithm does not produce (integer and boolean
    tensors), are left out.

    Examples
    --------
    >>> from refattn.bundle.suites import build_suite
    >>> from refattn.bundle.golden.spec import case_spec
    >>> spec = case_spec(build_suite("contract")[1])
    >>> sorted(yardstick_table(spec, "float16", ["output", "grad_q", "visible", "nope"]))
    ['grad_q', 'output']
    """
    _check_dtype(dtype)
    if isinstance(names, str):
        raise RefAttnError(f"names: expected a sequence of tensor names, got the string {names!r}")
    lp = resolve_dtype(dtype)
    present = [n for n in dict.fromkeys(names) if n in spec.tensors]
    naive = naive_routes(spec, lp, Tolerances().naive_routes, names=present)
    natural = natural_magnitudes(spec)
    table: dict[str, Any] = {}
    for name in present:
        if not all(name in res for res in naive.values()):
            continue  # not a tensor the naive algorithm computes
        g = np.asarray(spec.tensors[name], dtype=np.float64)
        ref = 0.0
        for res in naive.values():
            fin = np.isfinite(res[name]) & np.isfinite(g)
            if fin.any():
                ref = max(ref, float(np.max(np.abs(res[name][fin] - g[fin]))))
        table[name] = {"reference_error": _record(ref),
                       "natural_magnitude": _record(natural.get(name, 0.0))}
    return table


@public
def bundle_specs(directory: str | os.PathLike) -> Iterator[CaseSpec]:
    """Every case of the bundle ``directory``, read back with every checksum (the file's and
    each tensor's sha256, the manifest's records), in manifest order.

    Examples
    --------
    >>> import tempfile
    >>> from refattn.bundle import write_bundle
    >>> from refattn.bundle.suites import build_suite
    >>> d = tempfile.mkdtemp()
    >>> _ = write_bundle(d, build_suite("contract")[:2], suite="contract")
    >>> [spec.case_id for spec in bundle_specs(d)]
    ['loop6_two_query_training_trace', 'loop7_cross_attention_padded_source']
    """
    root = Path(directory)
    yield from _specs(root, check_schema(read_manifest(root / "manifest.json")))


def _specs(root: Path, manifest: Mapping[str, Any]) -> Iterator[CaseSpec]:
    for case_id, entry in manifest["cases"].items():
        check_relative(entry["file"])
        loaded = load(root / entry["file"], manifest=manifest)
        if loaded.case_id != case_id:
            raise RefAttnError(f"{entry['file']}: the file holds case {loaded.case_id!r}, not "
                               f"{case_id!r}")
        yield case_spec(loaded)


@public
def bundle_yardsticks(directory: str | os.PathLike, dtypes: Sequence[str],
                      names: Sequence[str] = DEFAULT_NAMES) -> dict[str, Any]:
    """The yardstick document of every case of a bundle (``refattn yardstick``'s file).

    Parameters
    ----------
    directory : path
        A bundle (its cases read back with every checksum, :func:`bundle_specs`).
    dtypes : sequence of {"float32", "float16", "bfloat16"}
    names : sequence of str

    Returns
    -------
    dict
        As :func:`yardsticks`, each case holding every dtype asked for, plus ``"bundle":
        {"manifest_sha256": ...}`` (the manifest the numbers were computed from).

    Examples
    --------
    >>> import tempfile
    >>> from refattn.bundle import write_bundle
    >>> from refattn.bundle.suites import build_suite
    >>> d = tempfile.mkdtemp()
    >>> _ = write_bundle(d, build_suite("contract")[1:2], suite="contract")
    >>> doc = bundle_yardsticks(d, ["float32", "bfloat16"], ["output"])
    >>> sorted(doc["cases"]["loop7_cross_attention_padded_source"])
    ['bfloat16', 'float32']
    """
    wanted = list(dict.fromkeys(dtypes))
    if not wanted:
        raise RefAttnError("dtypes: expected at least one of float32, float16, bfloat16")
    for dtype in wanted:
        _check_dtype(dtype)
    root = Path(directory)
    raw = read_confined(root, "manifest.json", max_bytes=MAX_MANIFEST_BYTES,
                        what="bundle manifest")  # read once: hashed and parsed
    manifest = check_schema(parse_manifest(raw, str(root / "manifest.json")))
    cases = {spec.case_id: {d: yardstick_table(spec, d, names) for d in wanted}
             for spec in _specs(root, manifest)}
    return {"schema": YARDSTICK_SCHEMA, "schema_version": "1.0",
            "bundle": {"manifest_sha256": hashlib.sha256(raw).hexdigest()}, "cases": cases}
