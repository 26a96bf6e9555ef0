"""Golden bundles: safetensors files plus a manifest with sha256 for every file and tensor.

Layout of a bundle directory ``DIR``::

    DIR/manifest.json                 schema, generator, and one entry per case
    DIR/cases/<case_id>.safetensors   every input, intermediate and gradient of the case

Every write is atomic (temporary file in the same directory, then rename) and byte-for-byte
reproducible: tensors are C-contiguous little-endian, the safetensors header carries exactly one
``__metadata__`` key, JSON is written with sorted keys, and the arithmetic runs with BLAS pinned
to one thread. Owns the file format; defers case definitions to :mod:`refattn.suites`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from refattn.call import AttentionCall, float_record
from refattn.errors import RefAttnError
from refattn.trace import Gradients, Trace

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "Computed",
    "GoldenCase",
    "LoadedCase",
    "atomic_write",
    "compute",
    "load",
    "tensor_sha256",
    "write_bundle",
]

SCHEMA = "refattn_golden"
SCHEMA_VERSION = "1.0"
_META_KEY = "refattn"


@dataclass(frozen=True, eq=False)
class GoldenCase:
    """One named golden case: a call, its output cotangent and its labels.

    Attributes
    ----------
    case_id : str
        File-name-safe identifier, e.g. ``"loop6_two_query_training_trace"``.
    call : AttentionCall
    grad_output : (B, Hq, Q, Dv) float64 ndarray
    comment : str
        One line saying what the case pins down.
    flags : tuple of str
        Wycheproof-style labels, e.g. ``("LowerRightCausal", "AllDroppedRow")``.
    conventions : dict
        Conventions beyond the call manifest (causal alignment, window convention, ...).
    """

    case_id: str
    call: AttentionCall
    grad_output: np.ndarray
    comment: str
    flags: tuple[str, ...] = ()
    conventions: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.case_id or not all(c.isalnum() or c in "_-." for c in self.case_id):
            raise RefAttnError(f"case_id: {self.case_id!r} must be non-empty [A-Za-z0-9_.-]")


@dataclass(frozen=True)
class LoadedCase:
    """A case read back from disk with every checksum verified."""

    case_id: str
    tensors: dict[str, np.ndarray]
    metadata: dict[str, Any]
    manifest_entry: dict[str, Any] | None


def tensor_sha256(x: np.ndarray) -> str:
    """sha256 over the raw little-endian C-order bytes of ``x``.

    Examples
    --------
    >>> tensor_sha256(np.zeros(1)) == hashlib.sha256(bytes(8)).hexdigest()
    True
    """
    arr = np.ascontiguousarray(x)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return hashlib.sha256(arr.tobytes(order="C")).hexdigest()


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same directory and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class Computed(NamedTuple):
    """Forward trace and gradients of one golden case."""

    trace: Trace
    grads: Gradients


def compute(case: GoldenCase) -> Computed:
    """Forward and backward of a case on the reference backend, BLAS pinned to one thread.

    Examples
    --------
    >>> from refattn.suites.contract import LOOP6_GRAD_OUTPUT, loop6_call
    >>> result = compute(GoldenCase("loop6", loop6_call(), LOOP6_GRAD_OUTPUT, "Loop 6"))
    >>> result.trace.output.shape, result.grads.grad_q.shape
    ((1, 1, 2, 2), (1, 1, 2, 2))
    """
    from threadpoolctl import threadpool_limits

    from refattn.engine import backward, forward

    with threadpool_limits(limits=1):
        trace = forward(case.call, backend="numpy")
        grads = backward(trace, case.grad_output)
    return Computed(trace, grads)


def _case_tensors(trace: Trace, grads: Gradients) -> dict[str, np.ndarray]:
    tensors = {**trace.tensors(), **grads.tensors()}
    if isinstance(trace.call.dropout, np.ndarray):  # explicit Z, not a MultiplierSource
        tensors["dropout"] = trace.call.dropout  # the multiplier as given (pre-broadcast)
    return {name: np.ascontiguousarray(t) for name, t in tensors.items()}


def _conventions(case: GoldenCase) -> dict[str, Any]:
    call = case.call
    conv = {
        "polarity": "true_means_legal",
        "gqa_mapping": call.ledger["head_map_mode"],
        "all_masked_rows": call.all_masked_rows,
        "returned_weights": call.returned_weights,
        "scale": float_record(call.scale),
        "scale_placement": call.scale_placement,
        "causal_alignment": "none",
        "window_convention": "none",
    }
    conv.update(case.conventions)
    return conv


def _encode_case(case: GoldenCase) -> tuple[bytes, dict[str, Any]]:
    from safetensors.numpy import save

    trace, grads = compute(case)
    tensors = _case_tensors(trace, grads)
    records = {
        name: {"sha256": tensor_sha256(t), "dtype": str(t.dtype), "shape": list(t.shape)}
        for name, t in sorted(tensors.items())
    }
    meta = json.dumps(
        {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "case_id": case.case_id,
         "tensors": {n: r["sha256"] for n, r in records.items()}},
        sort_keys=True, separators=(",", ":"),
    )
    data = save(tensors, metadata={_META_KEY: meta})  # one metadata key: stable header order
    entry = {
        "file": f"cases/{case.case_id}.safetensors",
        "sha256": hashlib.sha256(data).hexdigest(),
        "comment": case.comment,
        "flags": sorted(case.flags),
        "conventions": _conventions(case),
        "call": trace.manifest(),
        "tensors": records,
    }
    return data, entry


def _generator() -> dict[str, str]:
    import safetensors

    from refattn import __version__

    return {"refattn": __version__, "numpy": np.__version__,
            "safetensors": safetensors.__version__}


def _dump_json(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()


def write_bundle(out: str | os.PathLike, cases: Iterable[GoldenCase], *, suite: str) -> Path:
    """Compute every case and write the bundle ``out`` (atomically, reproducibly).

    Parameters
    ----------
    out : path
        Bundle directory (created if needed).
    cases : iterable of GoldenCase
    suite : str
        Name recorded in the manifest.

    Returns
    -------
    Path
        The path of ``manifest.json``.

    Raises
    ------
    RefAttnError
        On duplicate case ids.
    """
    out = Path(out)
    encoded: dict[str, tuple[bytes, dict[str, Any]]] = {}
    for case in cases:  # compute everything first: a failing case writes nothing
        if case.case_id in encoded:
            raise RefAttnError(f"case_id: duplicate case {case.case_id!r} in suite {suite!r}")
        encoded[case.case_id] = _encode_case(case)
    for data, entry in encoded.values():
        atomic_write(out / entry["file"], data)
    manifest = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "suite": suite,
                "generator": _generator(),
                "cases": {case_id: entry for case_id, (_, entry) in encoded.items()}}
    path = out / "manifest.json"
    atomic_write(path, _dump_json(manifest))
    listed = {out / entry["file"] for _, entry in encoded.values()}
    for stale in (out / "cases").glob("*.safetensors"):  # files of cases no longer in the suite
        if stale not in listed:
            stale.unlink()
    return path


def _find_manifest(path: Path) -> dict[str, Any] | None:
    candidate = path.parent.parent / "manifest.json"
    if not candidate.is_file():
        return None
    try:
        return json.loads(candidate.read_text())
    except json.JSONDecodeError as exc:
        raise RefAttnError(f"{candidate}: manifest is not valid JSON ({exc})") from None


def load(path: str | os.PathLike, *, manifest: Mapping[str, Any] | None = None) -> LoadedCase:
    """Read one case file back and verify every checksum.

    The tensor hashes embedded in the file are always checked; when the bundle's
    ``manifest.json`` sits beside ``cases/`` (or is passed), the file hash and the manifest's
    tensor list are checked too.

    Parameters
    ----------
    path : path
        ``DIR/cases/<case_id>.safetensors``.
    manifest : dict, optional
        A parsed bundle manifest (default: read ``DIR/manifest.json`` if present).

    Returns
    -------
    LoadedCase

    Raises
    ------
    RefAttnError
        Naming the file and tensor on a truncated file, a bad header, a missing tensor or a
        checksum mismatch.
    """
    from safetensors.numpy import load as st_load

    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RefAttnError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        tensors = st_load(data)
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + header_len])
        meta = json.loads(header["__metadata__"][_META_KEY])
    except Exception as exc:
        raise RefAttnError(f"{path}: not a readable refattn safetensors file ({exc})") from None
    for name, digest in sorted(meta["tensors"].items()):
        if name not in tensors:
            raise RefAttnError(f"{path}: tensor {name!r} is missing")
        if tensor_sha256(tensors[name]) != digest:
            raise RefAttnError(f"{path}: tensor {name!r} fails its sha256 check")
    extra = sorted(set(tensors) - set(meta["tensors"]))
    if extra:
        raise RefAttnError(f"{path}: tensor {extra[0]!r} is not listed in the file's metadata")

    manifest = manifest if manifest is not None else _find_manifest(path)
    entry = None
    if manifest is not None:
        entry = manifest.get("cases", {}).get(meta["case_id"])
        if entry is None:
            raise RefAttnError(f"{path}: case {meta['case_id']!r} is not in the bundle manifest")
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise RefAttnError(f"{path}: file sha256 differs from the bundle manifest")
        for name, rec in sorted(entry["tensors"].items()):
            if name not in tensors:
                raise RefAttnError(f"{path}: tensor {name!r} listed in the manifest is missing")
            if rec["sha256"] != meta["tensors"][name]:
                raise RefAttnError(f"{path}: tensor {name!r} sha256 differs from the manifest")
    return LoadedCase(case_id=meta["case_id"], tensors=dict(tensors), metadata=meta,
                      manifest_entry=entry)
