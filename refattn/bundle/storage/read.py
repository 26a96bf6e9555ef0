"""Read golden case files back, with every checksum verified.

Owns :class:`LoadedCase`, :func:`load` (a case file the user names) and :func:`load_bytes` (a
case already read), which check the embedded tensor hashes and, when the bundle manifest is
at hand, the file hash, the manifest's file name and tensor list; and
:func:`check_case_file`, the byte-level integrity check of ``refattn verify``: it opens the
file from inside the bundle (no link followed, only a regular file, the size bounded by the
manifest's tensor list), reads its header alone, hashes its tensors in pieces and names the
tensor whose bytes changed, a truncated file or a missing tensor without trusting the file;
only a file that matches is read into memory. The safetensors format itself is parsed here
(:func:`parse_header`, :func:`decode_safetensors`): duplicated header keys, holes, overlaps
and trailing bytes are refused, and the tensors are read-only views into the one buffer the
file was read into (the safetensors library copies every tensor and accepts duplicated keys).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from refattn._boundary import public
from refattn.bundle.storage.format import META_KEY, tensor_sha256
from refattn.bundle.storage.fsio import (
    MAX_CASE_BYTES,
    check_relative,
    open_confined,
    read_fd,
    read_regular,
)
from refattn.bundle.storage.manifest import check_schema, read_manifest
from refattn.bundle.storage.problems import Problem, Stage
from refattn.errors import RefAttnError

__all__ = ["LoadedCase", "SafetensorsHeader", "case_size_limit", "check_case_file",
           "decode_safetensors", "layout_inspector", "load", "load_bytes", "parse_header"]

_ITEMSIZE = {"float64": 8, "int64": 8, "bool": 1, "uint8": 1, "uint16": 2, "uint32": 4}
#: room for the safetensors header (names, dtypes, offsets, the metadata's hashes)
_HEADER_SLACK = 2**20
#: the largest safetensors JSON header read (the safetensors library's own limit)
MAX_HEADER_BYTES = 100 * 2**20
#: safetensors dtype codes refattn reads, as little-endian numpy dtypes
_ST_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4",
              "I16": "<i2", "I8": "i1", "U8": "u1", "U16": "<u2", "U32": "<u4", "BOOL": "?"}
#: bytes hashed per ``pread`` when a file is checked in pieces
_HASH_STEP = 1 << 24


@public
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
    plus room for the header (never more than :data:`~refattn.bundle.storage.fsio.MAX_CASE_BYTES`).

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


@dataclass(frozen=True)
class SafetensorsHeader:
    """A safetensors header as read, before any tensor byte is.

    ``entries`` maps each tensor name to its raw record (not yet checked: see
    :func:`decode_safetensors`); ``metadata`` is ``__metadata__`` (a dict, maybe empty);
    ``length`` is the JSON header's byte count ``n`` (tensor data starts at ``8 + n``).
    """

    length: int
    entries: dict[str, Any]
    metadata: dict[str, Any]


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:  # readers keeping the first and the last would see different data
            raise ValueError(f"duplicate key {key[:60]!r} in one object")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_header(head: bytes | bytearray | memoryview, size: int, shown: str
                 ) -> SafetensorsHeader:
    """Parse the header at the start of a safetensors file of ``size`` bytes.

    ``head`` holds at least the file's first ``8 + n`` bytes (``n``, the little-endian
    uint64 in the first 8, is the JSON header's length). The JSON must be one object with no
    duplicated key (a reader keeping the first key and one keeping the last would see
    different tensors) and no NaN or infinity.

    Raises
    ------
    RefAttnError
        "truncated file" when the file ends before its header does, "corrupt safetensors
        header" for anything else, naming ``shown``.

    Examples
    --------
    >>> raw = b'{"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]},'
    >>> dup = raw + b'"a":{"dtype":"F64","shape":[1],"data_offsets":[8,16]}}'
    >>> parse_header(len(dup).to_bytes(8, "little") + dup, 8 + len(dup) + 16, "x")
    Traceback (most recent call last):
        ...
    refattn.errors.RefAttnError: x: corrupt safetensors header (duplicate key 'a' in one object)
    """
    if size < 8 or len(head) < 8:
        raise RefAttnError(f"{shown}: truncated file: {size} bytes, no header")
    n = int.from_bytes(head[:8], "little")
    if n > MAX_HEADER_BYTES:
        raise RefAttnError(f"{shown}: corrupt safetensors header (it claims {n} bytes, more "
                           f"than the {MAX_HEADER_BYTES} a header may have)")
    if 8 + n > size or 8 + n > len(head):
        raise RefAttnError(f"{shown}: truncated file: header needs {8 + n} bytes, file has "
                           f"{size}")
    try:
        header = json.loads(bytes(head[8 : 8 + n]).decode("utf-8"),
                            object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant)
        if not isinstance(header, dict):
            raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise ValueError("__metadata__ is not an object")
    except (ValueError, RecursionError) as exc:
        raise RefAttnError(f"{shown}: corrupt safetensors header ({str(exc)[:160]})") from None
    return SafetensorsHeader(n, header, metadata)


def read_header(fd: int, size: int, shown: str) -> SafetensorsHeader:
    """:func:`parse_header` of an open file, read with ``os.pread`` (the file is not read)."""
    first = os.pread(fd, 8, 0)
    n = int.from_bytes(first, "little") if len(first) == 8 else 0
    if len(first) < 8 or n > MAX_HEADER_BYTES or 8 + n > size:
        return parse_header(first, size, shown)  # raises the right message
    return parse_header(first + os.pread(fd, n, 8), size, shown)


def _layout(header: SafetensorsHeader, size: int, shown: str,
            dtypes: Mapping[str, str] = _ST_DTYPES
            ) -> dict[str, tuple[np.dtype, tuple[int, ...], int, int]]:
    """Every tensor's (dtype, shape, start, stop) in file offsets, checked against the
    safetensors rules: known dtype, non-negative integer shape, data size equal to the shape's,
    the data regions covering the rest of the file exactly once (no hole, no overlap, nothing
    past the end or after the last tensor)."""
    out: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
    base = 8 + header.length
    for name, rec in header.entries.items():
        where = f"{shown}: tensor {name[:60]!r}"
        if not (isinstance(rec, dict) and rec.get("dtype") in dtypes):
            shown_dtype = rec.get("dtype") if isinstance(rec, dict) else rec
            raise RefAttnError(f"{where}: unsupported dtype {str(shown_dtype)[:40]!r}")
        dtype = np.dtype(dtypes[rec["dtype"]])
        shape, offsets = rec.get("shape"), rec.get("data_offsets")
        if not (isinstance(shape, list) and all(
                type(x) is int and x >= 0 for x in shape) and len(shape) <= 32):
            raise RefAttnError(f"{where}: malformed shape {str(shape)[:60]}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(
                type(x) is int for x in offsets) and 0 <= offsets[0] <= offsets[1]):
            raise RefAttnError(f"{where}: malformed data offsets {str(offsets)[:60]}")
        start, stop = offsets
        if stop - start != dtype.itemsize * math.prod(shape):
            raise RefAttnError(f"{where}: data offsets hold {stop - start} bytes, its shape "
                               f"{shape} {rec['dtype']} needs {dtype.itemsize * math.prod(shape)}")
        out[name] = (dtype, tuple(shape), base + start, base + stop)
    end = base
    for name, (_, _, start, stop) in sorted(out.items(), key=lambda kv: kv[1][2:]):
        if start != end:
            raise RefAttnError(f"{shown}: tensor {name[:60]!r} starts at byte {start}, expected "
                               f"{end} (tensor data must follow the header without gaps or "
                               "overlaps)")
        end = stop
    if end != size:
        what = "truncated file" if end > size else "corrupt file"
        raise RefAttnError(f"{shown}: {what}: its tensors end at byte {end}, the file has "
                           f"{size} bytes")
    return out


def decode_safetensors(data: bytes | bytearray, shown: str
                       ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The tensors and ``__metadata__`` of a safetensors file's bytes, checked strictly
    (:func:`parse_header` and the layout rules: known dtypes, sizes that match the shapes,
    data covering the file exactly once).

    The tensors are read-only views into ``data``: nothing is copied, so decoding a file costs
    no memory beyond its bytes.

    Examples
    --------
    >>> from safetensors.numpy import save
    >>> t, meta = decode_safetensors(save({"x": np.arange(3.0)}, metadata={"k": "v"}), "f")
    >>> t["x"].tolist(), t["x"].flags.writeable, meta
    ([0.0, 1.0, 2.0], False, {'k': 'v'})
    """
    header = parse_header(data, len(data), shown)
    tensors: dict[str, np.ndarray] = {}
    for name, (dtype, shape, start, stop) in _layout(header, len(data), shown).items():
        arr = np.frombuffer(data, dtype=dtype, count=(stop - start) // dtype.itemsize,
                            offset=start).reshape(shape)
        if arr.dtype.byteorder not in ("=", "|"):
            arr = arr.astype(arr.dtype.newbyteorder("="))  # a big-endian host: one copy
        arr.flags.writeable = False
        tensors[name] = arr
    return tensors, header.metadata


def _refattn_meta(metadata: Mapping[str, Any], shown: str) -> dict[str, Any]:
    try:
        meta = json.loads(metadata[META_KEY], object_pairs_hook=_no_duplicate_keys,
                          parse_constant=_no_constant)
    except (KeyError, TypeError, ValueError, RecursionError) as exc:
        raise RefAttnError(f"{shown}: not a readable refattn safetensors file "
                           f"({type(exc).__name__}: {str(exc)[:120]})") from None
    if not (isinstance(meta, dict) and isinstance(meta.get("case_id"), str)
            and isinstance(meta.get("tensors"), dict)
            and all(isinstance(v, str) for v in meta["tensors"].values())):
        raise RefAttnError(f"{shown}: refattn metadata lacks a case_id or its tensor hashes")
    return meta


def _decode(data: bytes | bytearray, shown: str
            ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Tensors and refattn metadata of a case file's bytes (any defect: RefAttnError)."""
    try:
        tensors, metadata = decode_safetensors(data, shown)
    except RefAttnError as exc:
        raise RefAttnError(f"{shown}: not a readable refattn safetensors file "
                           f"({str(exc).removeprefix(shown + ': ')})") from None
    return tensors, _refattn_meta(metadata, shown)


def _hash_range(fd: int, start: int, stop: int) -> str:
    """sha256 of the file's bytes ``[start, stop)``, read in pieces (bounded memory)."""
    h = hashlib.sha256()
    pos = start
    while pos < stop:
        chunk = os.pread(fd, min(_HASH_STEP, stop - pos), pos)
        if not chunk:
            break  # the file shrank: the digest cannot match
        h.update(chunk)
        pos += len(chunk)
    return h.hexdigest()


def layout_inspector(shown: str, *, bfloat16: bool = False) -> Callable[[int, int], None]:
    """``inspect(fd, size)`` for :func:`~refattn.bundle.storage.fsio.read_regular` that checks a
    safetensors file's header and tensor layout (no duplicated key; sizes that match the
    shapes; data covering the file exactly once) before the file is read: a file whose
    header describes less than its size, or more, is refused unread. ``bfloat16``: accept
    ``BF16`` tensors too (candidate files).

    Examples
    --------
    >>> import tempfile, pathlib
    >>> from safetensors.numpy import save
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "c.safetensors"
    >>> _ = p.write_bytes(save({"output": np.zeros(2)}) + bytes(2**20))
    >>> read_regular(p, max_bytes=2**21, inspect=layout_inspector("c"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    refattn.errors.RefAttnError: c: corrupt file: its tensors end at byte ..., the file has ...
    """
    dtypes = {**_ST_DTYPES, "BF16": "<u2"} if bfloat16 else _ST_DTYPES

    def inspect(fd: int, size: int) -> None:
        _layout(read_header(fd, size, shown), size, shown, dtypes)
    return inspect


def _manifest_inspector(entry: Mapping[str, Any] | None, shown: str):
    """``inspect(fd, size)`` for :func:`~refattn.bundle.storage.fsio.read_regular`: the header, the
    tensor layout and every embedded tensor hash, and with a manifest entry the file's size
    and sha256, all checked (hashed in pieces) before the file is read into memory."""
    def inspect(fd: int, size: int) -> None:
        try:
            header = read_header(fd, size, shown)
            layout = _layout(header, size, shown)
        except RefAttnError as exc:
            raise RefAttnError(f"{shown}: not a readable refattn safetensors file "
                               f"({str(exc).removeprefix(shown + ': ')})") from None
        meta = _refattn_meta(header.metadata, shown)
        for name, digest in sorted(meta["tensors"].items()):  # as load_bytes, in pieces
            if name not in layout:
                raise RefAttnError(f"{shown}: tensor {name!r} is missing")
            if _hash_range(fd, *layout[name][2:]) != digest:
                raise RefAttnError(f"{shown}: tensor {name!r} fails its sha256 check")
        if entry is None:
            return
        limit = case_size_limit(entry)
        if size > limit:
            raise RefAttnError(f"{shown}: {size} bytes exceeds the {limit} bytes its manifest "
                               "entry's tensors allow")
        if _hash_range(fd, 0, size) != entry.get("sha256"):
            raise RefAttnError(f"{shown}: file sha256 differs from the bundle manifest")
    return inspect


def _entry_for(path: Path, manifest: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The manifest entry whose file is ``cases/<path's name>`` (None: none or no manifest)."""
    cases = manifest.get("cases") if isinstance(manifest, Mapping) else None
    if not isinstance(cases, Mapping):
        return None
    for entry in cases.values():
        if isinstance(entry, Mapping) and entry.get("file") == f"cases/{path.name}":
            return entry
    return None


@public
def load(path: str | os.PathLike, *, manifest: Mapping[str, Any] | None = None) -> LoadedCase:
    """Read one case file back and verify every checksum.

    The tensor hashes embedded in the file are always checked; when the bundle's
    ``manifest.json`` sits beside ``cases/`` (or is passed), the file hash, the manifest's file
    name and its tensor list are checked too. Only a regular file is read (a FIFO or device is
    refused without blocking), at most :data:`~refattn.bundle.storage.fsio.MAX_CASE_BYTES` bytes.

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
        checksum mismatch. The header, the tensor layout and (with a manifest) the file's size
        and sha256 are checked before the file is read, into one buffer of its size.

    Examples
    --------
    >>> import tempfile
    >>> from refattn.bundle import write_bundle
    >>> from refattn.bundle.suites import build_suite
    >>> d = tempfile.mkdtemp()
    >>> _ = write_bundle(d, build_suite("contract")[:1], suite="contract")
    >>> case = load(next(Path(d, "cases").iterdir()))
    >>> case.case_id, case.tensors["q"].shape
    ('loop6_two_query_training_trace', (1, 1, 2, 2))
    """
    path = Path(path)
    if manifest is None:
        manifest = _find_manifest(path)
    data = read_regular(path, max_bytes=MAX_CASE_BYTES, what="case file",
                        inspect=_manifest_inspector(_entry_for(path, manifest), str(path)))
    return load_bytes(data, str(path), manifest=manifest, file_name=path.name)


def _same_record(arr: np.ndarray, rec: Mapping[str, Any], where: str) -> None:
    """Refuse a tensor whose dtype or shape is not its manifest record's (the sha256 covers
    the bytes, not how they are read: a record of another shape would be read differently by
    a reader that trusts the manifest, as the C++ header does).

    Examples
    --------
    >>> _same_record(np.zeros((2, 3)), {"dtype": "float64", "shape": [3, 2]}, "f: tensor 'q'")
    Traceback (most recent call last):
        ...
    refattn.errors.RefAttnError: f: tensor 'q' is float64 [2, 3], the manifest lists float64 [3, 2]
    """
    shape, dtype = list(arr.shape), arr.dtype.name
    if rec.get("dtype") != dtype or list(rec.get("shape", ())) != shape:
        raise RefAttnError(f"{where} is {dtype} {shape}, the manifest lists "
                           f"{str(rec.get('dtype'))[:20]} {str(rec.get('shape'))[:80]}")


def load_bytes(data: bytes | bytearray, shown: str, *, manifest: Mapping[str, Any] | None = None,
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
            _same_record(tensors[name], rec, f"{shown}: tensor {name!r}")
        unlisted = sorted(set(tensors) - set(entry["tensors"]))
        if unlisted:
            raise RefAttnError(f"{shown}: tensor {unlisted[0][:60]!r} is not listed in the "
                               "bundle manifest")
    return LoadedCase(case_id=meta["case_id"], tensors=tensors, metadata=meta,
                      manifest_entry=entry)


def check_case_file(case_id: str, directory: str | os.PathLike, entry: Mapping[str, Any]
                    ) -> tuple[int, list[Problem], bytearray | None]:
    """Check one case file's bytes against its (schema-checked) manifest entry without
    trusting the file.

    The file ``directory/entry["file"]`` is read from inside the bundle only: no link is
    followed, only a regular file is opened (never blocking on a FIFO), and its size is
    checked against :func:`case_size_limit` before anything is read. Then its header alone
    is read and checked (no duplicated key; each listed tensor's shape and data range), each
    tensor's bytes and the whole file are hashed in pieces with ``os.pread``; only a file
    whose every hash matches the manifest is read into memory, into one buffer of its size.
    A hostile file therefore costs a few MiB however large it claims to be.

    Returns the number of tensors whose sha256 was checked, the problems found (a missing,
    truncated or altered tensor, an unlisted tensor, a changed header), each naming the
    tensor, and the file's bytes (None when it was not read).
    """
    def problem(tensor: str | None, stage: Stage, reason: str) -> Problem:
        return Problem(case_id, tensor, stage, reason)

    try:
        with open_confined(directory, entry.get("file"), max_bytes=case_size_limit(entry),
                           what="case file") as (fd, size):
            checked, out = _check_open_case(fd, size, entry, problem)
            if out:
                return checked, out, None
            data = read_fd(fd, "/".join(check_relative(entry.get("file"))), size)
    except RefAttnError as exc:
        return 0, [problem(None, "file", str(exc))], None
    except OSError as exc:
        return 0, [problem(None, "file", f"cannot read the case file ({exc.strerror})")], None
    if hashlib.sha256(data).hexdigest() != entry.get("sha256"):  # changed since it was hashed
        return checked, [problem(None, "file", "file changed while it was read (sha256 "
                                 "differs from the manifest)")], None
    return checked, [], data


def _check_open_case(fd: int, size: int, entry: Mapping[str, Any], problem: Any
                     ) -> tuple[int, list[Problem]]:
    """:func:`check_case_file`'s checks on an open file, reading only its header and hashing
    its tensors' byte ranges in pieces."""
    try:
        header = read_header(fd, size, "case file")
    except RefAttnError as exc:
        return 0, [problem(None, "file", str(exc).removeprefix("case file: "))]
    try:
        meta = json.loads(header.metadata.get(META_KEY, "{}"),
                          object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant)
        if not isinstance(meta, dict):
            raise TypeError("the refattn metadata is not an object")
    except (ValueError, TypeError, RecursionError) as exc:
        return 0, [problem(None, "file", f"corrupt safetensors header ({str(exc)[:160]})")]
    base = 8 + header.length
    checked = 0
    out: list[Problem] = []
    ranges: list[tuple[str, Any, int, int]] = []
    records: Mapping[str, Any] = entry.get("tensors", {})
    for name, rec in sorted(records.items()):
        h = header.entries.get(name)
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
            out.append(problem(name, "tensor", f"shape {str(shape)[:80]} differs from the "
                               f"manifest's {rec.get('shape')}"))
            continue
        if not 0 <= start <= stop or base + stop > size:
            out.append(problem(name, "tensor", f"truncated file: tensor data ends at byte "
                               f"{base + stop}, file has {size} bytes"))
            continue
        ranges.append((name, rec, base + start, base + stop))
    for name in sorted(set(header.entries) - set(records)):
        out.append(problem(name[:80], "tensor", "tensor present in the file but not listed in "
                           "the manifest"))
    if out:  # a file whose layout differs from its manifest entry is not hashed at all
        return checked, out
    for name, rec, start, stop in ranges:
        checked += 1
        if _hash_range(fd, start, stop) != rec.get("sha256"):
            out.append(problem(name, "tensor", "sha256 mismatch: the tensor's bytes differ "
                               "from the manifest (tampered or corrupted data)"))
        elif not isinstance(meta.get("tensors"), dict) or meta["tensors"].get(name) != rec.get(
                "sha256"):
            out.append(problem(name, "tensor", "the file's embedded sha256 differs from the "
                               "manifest"))
    if not out and _hash_range(fd, 0, size) != entry.get("sha256"):
        out.append(problem(None, "file", "file sha256 differs from the manifest (header, "
                           "metadata or padding bytes changed)"))
    return checked, out
