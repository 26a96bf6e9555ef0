"""Bundle manifests: read ``manifest.json`` and check its schema and version.

Owns :func:`read_manifest`, :func:`check_schema` and :data:`READERS` (one reader per schema
major version, returning the current in-memory form). Used by verify and the compare command
before any field of a manifest is used.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from refattn.bundle.format import SCHEMA, SCHEMA_VERSION
from refattn.errors import RefAttnError

__all__ = ["READERS", "check_schema", "read_manifest"]


def _major(version: str) -> int:
    try:
        major, minor = str(version).split(".")
        return int(major) if int(minor) >= 0 else -1
    except ValueError:
        raise RefAttnError(
            f"manifest: schema_version {version!r} is not of the form MAJOR.MINOR"
        ) from None


def _read_v1(manifest: dict[str, Any]) -> dict[str, Any]:
    """Schema 1.x is the current in-memory form (minor versions only add fields)."""
    return manifest


#: bundle schema major version -> reader returning the current in-memory manifest. A breaking
#: change bumps the major version, adds its reader here and keeps the old ones working.
READERS = {1: _read_v1}


def check_schema(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """Check a bundle manifest's schema and version; return it in the current form.

    Any 1.x manifest is read (a minor version only adds fields); an unknown major version is
    refused with a message naming both versions.

    Examples
    --------
    >>> check_schema({"schema": "refattn_golden", "schema_version": "1.3", "cases": {}})["cases"]
    {}
    >>> try:
    ...     check_schema({"schema": "refattn_golden", "schema_version": "2.0", "cases": {}})
    ... except RefAttnError as exc:
    ...     print(str(exc)[:60])
    manifest: schema_version '2.0' (major 2) is not readable her
    """
    if not isinstance(manifest, Mapping):
        raise RefAttnError(f"manifest: expected a JSON object, got {type(manifest).__name__}")
    if manifest.get("schema") != SCHEMA:
        raise RefAttnError(f"manifest: schema is {manifest.get('schema')!r}, expected {SCHEMA!r}")
    if "schema_version" not in manifest:
        raise RefAttnError("manifest: schema_version is missing")
    version = manifest["schema_version"]
    major = _major(version)
    if major not in READERS:
        raise RefAttnError(
            f"manifest: schema_version {version!r} (major {major}) is not readable here; this "
            f"refattn reads majors {sorted(READERS)} (writes {SCHEMA_VERSION})"
        )
    out = READERS[major](dict(manifest))
    if not isinstance(out.get("cases"), Mapping):
        raise RefAttnError("manifest: 'cases' is missing or not an object")
    return out


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """Parse a bundle's ``manifest.json`` (schema not yet checked: see :func:`check_schema`).

    Raises
    ------
    RefAttnError
        Naming the file when it cannot be read or is not valid JSON.
    """
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise RefAttnError(f"{path}: cannot read the bundle manifest ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise RefAttnError(f"{path}: manifest is not valid JSON ({exc})") from None
