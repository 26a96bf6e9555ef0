"""Read golden case files back, with every checksum verified.

Owns :class:`LoadedCase` and :func:`load` (a case file through safetensors, the embedded tensor
hashes and, when the bundle manifest is at hand, the file hash and tensor list), and
:func:`check_case_file`, the byte-level integrity check of ``refattn verify`` that names the
tensor whose bytes changed, a truncated file or a missing tensor without trusting the file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load

from refattn.bundle.format import META_KEY, tensor_sha256
from refattn.bundle.report import Problem, Stage
from refattn.errors import RefAttnError

__all__ = ["LoadedCase", "check_case_file", "load"]


@dataclass(frozen=True)
class LoadedCase:
    """A case read back from disk with every checksum verified."""

    case_id: str
    tensors: dict[str, np.ndarray]
    metadata: dict[str, Any]
    manifest_entry: dict[str, Any] | None


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
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RefAttnError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        tensors = st_load(data)
        header_len = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + header_len])
        meta = json.loads(header["__metadata__"][META_KEY])
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


def check_case_file(case_id: str, path: Path, entry: Mapping[str, Any]
                    ) -> tuple[int, list[Problem]]:
    """Check one case file's bytes against its manifest entry without trusting the file.

    Returns the number of tensors whose sha256 was checked and the problems found (a missing,
    truncated or altered tensor, an unlisted tensor, a changed header), each naming the tensor.
    """
    def problem(tensor: str | None, stage: Stage, reason: str) -> Problem:
        return Problem(case_id, tensor, stage, reason)

    try:
        data = path.read_bytes()
    except OSError as exc:
        return 0, [problem(None, "file", f"cannot read {path} ({exc.strerror})")]
    out: list[Problem] = []
    file_ok = hashlib.sha256(data).hexdigest() == entry.get("sha256")
    if len(data) < 8:
        return 0, [problem(None, "file", f"truncated file: {len(data)} bytes, no header")]
    n = int.from_bytes(data[:8], "little")
    if 8 + n > len(data):
        return 0, [problem(None, "file", f"truncated file: header needs {8 + n} bytes, "
                           f"file has {len(data)}")]
    try:
        header = json.loads(data[8 : 8 + n])
        meta = json.loads(header.get("__metadata__", {}).get("refattn", "{}"))
    except (json.JSONDecodeError, AttributeError) as exc:
        return 0, [problem(None, "file", f"corrupt safetensors header ({exc})")]
    base = 8 + n
    checked = 0
    records: Mapping[str, Any] = entry.get("tensors", {})
    for name, rec in sorted(records.items()):
        h = header.get(name)
        if h is None:
            out.append(problem(name, "tensor", "missing tensor (listed in the manifest, absent "
                               "from the file)"))
            continue
        if list(h.get("shape", [])) != list(rec.get("shape", [])):
            out.append(problem(name, "tensor", f"shape {h.get('shape')} differs from the "
                               f"manifest's {rec.get('shape')}"))
            continue
        start, stop = h["data_offsets"]
        if base + stop > len(data):
            out.append(problem(name, "tensor", f"truncated file: tensor data ends at byte "
                               f"{base + stop}, file has {len(data)} bytes"))
            continue
        checked += 1
        if hashlib.sha256(data[base + start : base + stop]).hexdigest() != rec.get("sha256"):
            out.append(problem(name, "tensor", "sha256 mismatch: the tensor's bytes differ "
                               "from the manifest (tampered or corrupted data)"))
        elif meta.get("tensors", {}).get(name) != rec.get("sha256"):
            out.append(problem(name, "tensor", "the file's embedded sha256 differs from the "
                               "manifest"))
    for name in sorted(set(header) - set(records) - {"__metadata__"}):
        out.append(problem(name, "tensor", "tensor present in the file but not listed in the "
                           "manifest"))
    if not file_ok and not out:
        out.append(problem(None, "file", "file sha256 differs from the manifest (header, "
                           "metadata or padding bytes changed)"))
    return checked, out
