"""The golden bundle's file format: schema identity, checksums and atomic, reproducible writes.

A bundle directory ``DIR`` holds::

    DIR/manifest.json                 schema, generator, and one entry per case
    DIR/cases/<case_id>.safetensors   every input, intermediate and gradient of the case

Owns the schema name and version, the tensor checksum (sha256 of the little-endian C-order
bytes), the one metadata key of a case file, canonical JSON and the atomic file write. Knows
nothing of calls or engines; every other bundle module builds on it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from refattn._boundary import public
from refattn.errors import RefAttnError

__all__ = ["META_KEY", "SCHEMA", "SCHEMA_VERSION", "atomic_write", "dump_json", "tensor_sha256"]

SCHEMA = "refattn_golden"
SCHEMA_VERSION = "1.0"
#: the one ``__metadata__`` key of a case file (one key keeps the header order stable)
META_KEY = "refattn"


@public
def tensor_sha256(x: np.ndarray) -> str:
    """sha256 over the raw little-endian C-order bytes of ``x``.

    Examples
    --------
    >>> tensor_sha256(np.zeros(1)) == hashlib.sha256(bytes(8)).hexdigest()
    True
    """
    arr = np.ascontiguousarray(x)  # no copy when x is C-contiguous already
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and sys.byteorder == "big"):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return hashlib.sha256(arr.reshape(-1).view(np.uint8).data).hexdigest()  # the bytes, uncopied


@public
def atomic_write(path: Path, data: bytes, *, replace: bool = True) -> None:
    """Write ``data`` to ``path`` via a fsynced temporary file in the same directory, a
    rename (``replace=False``: a hard link, so an existing name is refused atomically, never
    replaced: ``FileExistsError``) and a fsync of the directory. Any other ``OSError`` (a full
    disk, a read-only directory) removes the temporary file and becomes a
    :class:`~refattn.errors.RefAttnError` naming ``path``."""
    path = Path(path)
    tmp = None
    exists = False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:100]}.", suffix=".tmp",
                                   dir=path.parent)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                exists = True
                raise
            Path(tmp).unlink()
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if exists:
            raise
        raise RefAttnError(f"{path}: cannot write ({exc.strerror or exc})") from None
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise


def dump_json(obj: Any) -> bytes:
    """Canonical JSON: sorted keys, two-space indent, no NaN or infinity, newline-terminated.

    Examples
    --------
    >>> dump_json({"b": 1, "a": [1.5]})
    b'{\\n  "a": [\\n    1.5\\n  ],\\n  "b": 1\\n}\\n'
    """
    return (json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n").encode()
