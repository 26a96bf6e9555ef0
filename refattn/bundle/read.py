"""Read golden case files back, with every checksum verified.

Owns :class:`LoadedCase`, :func:`load` (a case file the user names) and :func:`load_bytes` (a
case already read), which check the embedded tensor hashes and, when the bundle manifest is
at hand, the file hash, the manifest's file name and tensor list; and
:func:`check_case_file`, the byte-level integrity check of ``refattn verify``: it reads the
file from inside the bundle (no link followed, only a regular file, the size bounded by the
manifest's tensor list before reading) and names the tensor whose bytes changed, a truncated
file or a missing tensor without trusting the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load

from refattn.bundle.format import META_KEY, tensor_sha256
from refattn.bundle.fsio import MAX_CASE_BYTES, read_confined, read_regular
from refattn.bundle.manifest import check_schema, read_manifest
from refattn.bundle.report import Problem, Stage
from refattn.errors import RefAttnError

__all__ = ["LoadedCase", "case_size_limit", "check_case_file", "load", "load_bytes"]

_ITEMSIZE = {"float64": 8, "int64": 8, "bool": 1}
#: room for the safetensors header (names, dtypes, offsets, the metadata's hashes)
_HEADER_SLACK = 2**20


@dataclass(frozen=True)
class LoadedCase:
    """A case read back from disk with every checksum verified."""

    case_id: str
    tensors: dict[str, np.ndarray]
    metadata: dict[str, Any]
    manifest_entry: dict[str, Any] | None


def _find_manifest(path: Path) -> dict[str, Any] | None:
    candidate = path.parent.parent / "manifest.json"
    if not os.path.lexists(candidate):
        return None
    return check_schema(read_manifest(candidate))


def case_size_limit(entry: Mapping[str, Any]) -> int:
    """The most bytes a case file may have: its tensors' bytes as the manifest lists them,
    plus room for the header (never more than :data:`~refattn.bundle.fsio.MAX_CASE_BYTES`).

    Examples
    --------
    >>> case_size_limit({"tensors": {"q": {"dtype": "float64", "shape": [2, 3]}}}) - 2**20
    48
    """
    total = _HEADER_SLACK
    for rec in (entry.get("tensors") or {}).values():
        try:
            total += _ITEMSIZE.get(rec["dtype"], 8) * math.prod(int(n) for n in rec["shape"])
        except (KeyError, TypeError, ValueError):
            return MAX_CASE_BYTES
        if total > MAX_CASE_BYTES:
            return MAX_CASE_BYTES
    return total


def _decode(data: bytes, shown: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Tensors and refattn metadata of a case file's bytes (any defect: RefAttnError)."""
    try:
        tensors = st_load(data)
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + header_len])
        meta = json.loads(header["__metadata__"][META_KEY])
    except Exception as exc:
        raise RefAttnError(f"{shown}: not a readable refattn safetensors file "
                           f"({type(exc).__name__}: {str(exc)[:120]})") from None
    if not (isinstance(meta, dict) and isinstance(meta.get("case_id"), str)
            and isinstance(meta.get("tensors"), dict)
            and all(isinstance(v, str) for v in meta["tensors"].values())):
        raise RefAttnError(f"{shown}: refattn metadata lacks a case_id or its tensor hashes")
    return dict(tensors), meta


def load(path: str | os.PathLike, *, manifest: Mapping[str, Any] | None = None) -> LoadedCase:
    """Read one case file back and verify every checksum.

    The tensor hashes embedded in the file are always checked; when the bundle's
    ``manifest.json`` sits beside ``cases/`` (or is passed), the file hash, the manifest's file
    name and its tensor list are checked too. Only a regular file is read (a FIFO or device is
    refused without blocking), at most :data:`~refattn.bundle.fsio.MAX_CASE_BYTES` bytes.

    Parameters
    ----------
    path : path
        ``DIR/cases/<case_id>.safetensors``.
    manifest : dict, optional
        A parsed and schema-checked bundle manifest (default: read and check
        ``DIR/manifest.json`` if present).

    Returns
    -------
    LoadedCase

    Raises
    ------
    RefAttnError
        Naming the file and tensor on a truncated file, a bad header, a missing tensor or a
        checksum mismatch.
    """
    path = Path(path)
    data = read_regular(path, max_bytes=MAX_CASE_BYTES, what="case file")
    if manifest is None:
        manifest = _find_manifest(path)
    return load_bytes(data, str(path), manifest=manifest, file_name=path.name)


def load_bytes(data: bytes, shown: str, *, manifest: Mapping[str, Any] | None = None,
               file_name: str | None = None) -> LoadedCase:
    """:func:`load` for bytes already read (``shown`` names them in messages)."""
    tensors, meta = _decode(data, shown)
    for name, digest in sorted(meta["tensors"].items()):
        if name not in tensors:
            raise RefAttnError(f"{shown}: tensor {name!r} is missing")
        if tensor_sha256(tensors[name]) != digest:
            raise RefAttnError(f"{shown}: tensor {name!r} fails its sha256 check")
    extra = sorted(set(tensors) - set(meta["tensors"]))
    if extra:
        raise RefAttnError(f"{shown}: tensor {extra[0]!r} is not listed in the file's metadata")

    entry = None
    if manifest is not None:
        cases = manifest.get("cases")
        entry = cases.get(meta["case_id"]) if isinstance(cases, Mapping) else None
        if entry is None:
            raise RefAttnError(f"{shown}: case {meta['case_id']!r} is not in the bundle manifest")
        if file_name is not None and entry.get("file") != f"cases/{file_name}":
            raise RefAttnError(f"{shown}: the manifest's entry for case {meta['case_id']!r} "
                               f"names file {entry.get('file')!r}, not this file")
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise RefAttnError(f"{shown}: file sha256 differs from the bundle manifest")
        for name, rec in sorted(entry["tensors"].items()):
            if name not in tensors:
                raise RefAttnError(f"{shown}: tensor {name!r} listed in the manifest is missing")
            if rec["sha256"] != meta["tensors"].get(name):
                raise RefAttnError(f"{shown}: tensor {name!r} sha256 differs from the manifest")
    return LoadedCase(case_id=meta["case_id"], tensors=tensors, metadata=meta,
                      manifest_entry=entry)


def check_case_file(case_id: str, directory: str | os.PathLike, entry: Mapping[str, Any]
                    ) -> tuple[int, list[Problem], bytes | None]:
    """Check one case file's bytes against its (schema-checked) manifest entry without
    trusting the file.

    The file ``directory/entry["file"]`` is read from inside the bundle only: no link is
    followed, only a regular file is opened (never blocking on a FIFO), and its size is
    checked against :func:`case_size_limit` before it is read.

    Returns the number of tensors whose sha256 was checked, the problems found (a missing,
    truncated or altered tensor, an unlisted tensor, a changed header), each naming the
    tensor, and the file's bytes (None when it could not be read).
    """
    def problem(tensor: str | None, stage: Stage, reason: str) -> Problem:
        return Problem(case_id, tensor, stage, reason)

    try:
        data = read_confined(directory, entry.get("file"), max_bytes=case_size_limit(entry),
                             what="case file")
    except RefAttnError as exc:
        return 0, [problem(None, "file", str(exc))], None
    out: list[Problem] = []
    file_ok = hashlib.sha256(data).hexdigest() == entry.get("sha256")
    if len(data) < 8:
        return 0, [problem(None, "file", f"truncated file: {len(data)} bytes, no header")], data
    n = int.from_bytes(data[:8], "little")
    if 8 + n > len(data):
        return 0, [problem(None, "file", f"truncated file: header needs {8 + n} bytes, "
                           f"file has {len(data)}")], data
    try:
        header = json.loads(data[8 : 8 + n])
        meta = json.loads(header.get("__metadata__", {}).get("refattn", "{}"))
        if not isinstance(meta, dict):
            raise TypeError("the refattn metadata is not an object")
    except (ValueError, AttributeError, TypeError, RecursionError) as exc:
        return 0, [problem(None, "file", f"corrupt safetensors header ({exc})")], data
    base = 8 + n
    checked = 0
    records: Mapping[str, Any] = entry.get("tensors", {})
    for name, rec in sorted(records.items()):
        h = header.get(name)
        if h is None:
            out.append(problem(name, "tensor", "missing tensor (listed in the manifest, absent "
                               "from the file)"))
            continue
        try:
            shape = list(h.get("shape", []))
            start, stop = (int(x) for x in h["data_offsets"])
        except (AttributeError, KeyError, TypeError, ValueError):
            out.append(problem(name, "tensor", "corrupt header entry (shape or data offsets)"))
            continue
        if shape != list(rec.get("shape", [])):
            out.append(problem(name, "tensor", f"shape {shape} differs from the "
                               f"manifest's {rec.get('shape')}"))
            continue
        if not 0 <= start <= stop or base + stop > len(data):
            out.append(problem(name, "tensor", f"truncated file: tensor data ends at byte "
                               f"{base + stop}, file has {len(data)} bytes"))
            continue
        checked += 1
        if hashlib.sha256(data[base + start : base + stop]).hexdigest() != rec.get("sha256"):
            out.append(problem(name, "tensor", "sha256 mismatch: the tensor's bytes differ "
                               "from the manifest (tampered or corrupted data)"))
        elif not isinstance(meta.get("tensors"), dict) or meta["tensors"].get(name) != rec.get(
                "sha256"):
            out.append(problem(name, "tensor", "the file's embedded sha256 differs from the "
                               "manifest"))
    for name in sorted(set(header) - set(records) - {"__metadata__"}):
        out.append(problem(name, "tensor", "tensor present in the file but not listed in the "
                           "manifest"))
    if not file_ok and not out:
        out.append(problem(None, "file", "file sha256 differs from the manifest (header, "
                           "metadata or padding bytes changed)"))
    return checked, out, data
