"""Candidate files: another stack's tensors, read and written under the canonical names.

Owns :func:`as_numpy` (numpy, ``__array__``, DLPack and PyTorch bfloat16 tensors read without a
dtype change), :func:`read_candidate` (a safetensors file, BF16 through ml_dtypes) and
:func:`write_candidate`. The comparison itself is :mod:`refattn.bundle.comparison.harness`'s.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save

from refattn._boundary import public
from refattn._checks import as_array
from refattn.bundle.comparison.tolerances import resolve_dtype
from refattn.bundle.storage.format import atomic_write
from refattn.bundle.storage.fsio import MAX_CASE_BYTES, read_regular
from refattn.bundle.storage.read import layout_inspector
from refattn.errors import RefAttnError

__all__ = ["as_numpy", "read_candidate", "write_candidate"]


def as_numpy(name: str, x: Any) -> np.ndarray:
    """A candidate tensor as a numpy array without changing its dtype.

    Accepts numpy arrays, objects with ``__array__`` or DLPack, and PyTorch bfloat16 tensors
    (viewed as ml_dtypes.bfloat16; numpy has no bfloat16 of its own).

    Examples
    --------
    >>> as_numpy("output", [1.0, 2.0]).dtype
    dtype('float64')
    """
    if isinstance(x, np.ndarray):
        return x
    if str(getattr(x, "dtype", "")) == "torch.bfloat16":
        import ml_dtypes
        import torch

        return x.detach().cpu().contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if hasattr(x, "detach"):  # torch: leave autograd before reading
        x = x.detach().cpu()
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except (TypeError, RuntimeError, BufferError):
            pass
    return as_array(name, x)


_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "BOOL": "bool",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
}


@public
def read_candidate(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Read a candidate safetensors file (canonical names; BF16 as ml_dtypes.bfloat16).

    Raises
    ------
    RefAttnError
        Naming the file (and tensor) when the file is truncated or its header is invalid.
    """
    path = Path(path)
    data = read_regular(path, max_bytes=MAX_CASE_BYTES, what="candidate file",
                        inspect=layout_inspector(str(path), bfloat16=True))  # header first
    if len(data) < 8:
        raise RefAttnError(f"{path}: truncated file ({len(data)} bytes, no header length)")
    n = int.from_bytes(data[:8], "little")
    if 8 + n > len(data):
        raise RefAttnError(f"{path}: truncated file (header needs {8 + n} bytes, has {len(data)})")
    try:
        header = json.loads(data[8 : 8 + n])
        if not isinstance(header, dict):
            raise TypeError(f"the header is a JSON {type(header).__name__}, not an object")
    except (ValueError, TypeError, RecursionError) as exc:
        raise RefAttnError(f"{path}: safetensors header is not a JSON object ({exc})") from None
    body = memoryview(data)[8 + n :]
    out: dict[str, np.ndarray] = {}
    for name, rec in header.items():
        if name == "__metadata__":
            continue
        try:
            out[name] = _tensor(rec, body)
        except RefAttnError as exc:
            raise RefAttnError(f"{path}: tensor {name!r}: {exc}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise RefAttnError(f"{path}: tensor {name!r} has a malformed header entry "
                               f"({type(exc).__name__}: {exc})") from None
    return out


def _tensor(rec: Any, body: memoryview) -> np.ndarray:
    if not isinstance(rec, dict) or rec.get("dtype") not in _ST_DTYPES:
        shown = rec.get("dtype") if isinstance(rec, dict) else rec
        raise RefAttnError(f"unsupported dtype {shown!r}")
    dtype = resolve_dtype("bfloat16") if rec["dtype"] == "BF16" else np.dtype(
        _ST_DTYPES[rec["dtype"]])
    dtype = dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype
    start, stop = (int(x) for x in rec["data_offsets"])
    shape = [int(x) for x in rec["shape"]]
    if not 0 <= start <= stop <= len(body):
        raise RefAttnError("truncated file (the tensor's data ends past the file)")
    if min(shape, default=1) < 0:
        raise RefAttnError(f"negative shape {shape}")
    arr = np.frombuffer(body[start:stop], dtype=dtype).reshape(shape)
    return arr.astype(arr.dtype.newbyteorder("="), copy=True)


@public
def write_candidate(path: str | os.PathLike, tensors: Mapping[str, Any]) -> Path:
    """Write candidate tensors (numpy, torch, ...) to a safetensors file under their names.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "cand.safetensors"
    >>> _ = write_candidate(p, {"output": np.ones((1, 1, 2, 3))})
    >>> read_candidate(p)["output"].shape
    (1, 1, 2, 3)
    """
    arrays = {name: np.ascontiguousarray(as_numpy(name, x)) for name, x in tensors.items()}
    path = Path(path)
    atomic_write(path, save(arrays))
    return path
