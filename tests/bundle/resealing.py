"""Rewrite a bundle's case file with changed tensors and every in-file checksum re-sealed, so
that only recomputation can tell (the verify tests' attacker)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from refattn.bundle.storage.format import META_KEY, tensor_sha256


def reseal_case_file(bundle: Path, case: str,
                     change: Callable[[dict[str, np.ndarray]], None]) -> tuple[bytes, dict]:
    """Apply ``change`` to case ``case``'s tensors, rewrite its file with the file's own
    tensor checksums re-sealed; return the new bytes and the changed tensors."""
    path = bundle / "cases" / f"{case}.safetensors"
    data = path.read_bytes()
    tensors = {k: np.array(v) for k, v in st_load(data).items()}
    change(tensors)
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    meta = json.loads(header["__metadata__"][META_KEY])
    meta["tensors"] = {n: tensor_sha256(t) for n, t in tensors.items()}
    new = st_save(tensors, metadata={META_KEY: json.dumps(meta, sort_keys=True,
                                                          separators=(",", ":"))})
    path.write_bytes(new)
    return new, tensors


def reseal_case(bundle: Path, case: str,
                change: Callable[[dict[str, np.ndarray]], None]) -> dict[str, np.ndarray]:
    """:func:`reseal_case_file`, then the manifest entry's file and tensor sha256 re-sealed too
    (an attacker with an editor and sha256sum: every checksum passes); returns the changed
    tensors."""
    new, tensors = reseal_case_file(bundle, case, change)
    path = bundle / "manifest.json"
    manifest = json.loads(path.read_text())
    entry = manifest["cases"][case]
    entry["sha256"] = hashlib.sha256(new).hexdigest()
    for name, t in tensors.items():
        entry["tensors"][name]["sha256"] = tensor_sha256(t)
    path.write_text(json.dumps(manifest))
    return tensors
