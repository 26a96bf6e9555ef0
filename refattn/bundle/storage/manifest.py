"""Bundle manifests: read ``manifest.json`` and validate it against the published schema.

Owns :func:`read_manifest` (bytes read from inside the bundle with a size limit, strict UTF-8,
strict JSON: no NaN, no duplicate keys, bounded nesting), :func:`check_schema` (the schema
name, then the version, then the JSON Schema ``schema/manifest-v1.json`` shipped with the
package, validated with ``jsonschema`` before any field is used) and :data:`READERS` (one
reader per schema major version, returning the current in-memory form). Used by verify and
the compare command.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

from refattn.bundle.storage.format import SCHEMA, SCHEMA_VERSION
from refattn.bundle.storage.fsio import MAX_MANIFEST_BYTES, read_confined
from refattn.errors import RefAttnError

__all__ = ["READERS", "SCHEMA_FILES", "check_schema", "parse_manifest", "read_manifest",
           "schema_document"]

#: schema major version -> the JSON Schema file (package data of refattn.bundle)
SCHEMA_FILES = {1: "schema/manifest-v1.json"}


def _major(version: Any) -> int:
    if not isinstance(version, str):
        raise RefAttnError(
            f"manifest: schema_version {version!r} is not of the form MAJOR.MINOR (a string)")
    try:
        major, minor = version.split(".")
        if not (major.isdigit() and minor.isdigit()):
            raise ValueError
        return int(major)
    except ValueError:
        raise RefAttnError(
            f"manifest: schema_version {version!r} is not of the form MAJOR.MINOR"
        ) from None


def _read_v1(manifest: dict[str, Any]) -> dict[str, Any]:
    """Schema 1.x is the current in-memory form (minor versions only add fields)."""
    return manifest


#: bundle schema major version -> reader returning the current in-memory manifest. A breaking
#: change bumps the major version, adds its reader and schema file here and keeps the old ones.
READERS = {1: _read_v1}


@functools.cache
def schema_document(major: int = 1) -> dict[str, Any]:
    """The published JSON Schema of a manifest major version (``refattn/bundle/schema/``).

    Examples
    --------
    >>> schema_document(1)["properties"]["schema"]
    {'const': 'refattn_golden'}
    """
    text = resources.files("refattn.bundle").joinpath(SCHEMA_FILES[major]).read_text("utf-8")
    return json.loads(text)


@functools.cache
def _validator(major: int) -> jsonschema.protocols.Validator:
    document = schema_document(major)
    cls = jsonschema.validators.validator_for(document)
    cls.check_schema(document)
    return cls(document)


def _shorten(text: str, n: int = 160) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def check_schema(manifest: Any) -> dict[str, Any]:
    """Check a bundle manifest's schema name, version and structure; return the current form.

    The version is read first: any 1.x manifest is validated against ``manifest-v1.json``
    (a minor version only adds fields); an unknown major version is refused with the version
    named. Then the whole document is validated with ``jsonschema``: the first violation is
    reported with its JSON path.

    Examples
    --------
    >>> check_schema({"schema": "refattn_golden", "schema_version": "1.3", "cases": {}})["cases"]
    {}
    >>> try:
    ...     check_schema({"schema": "refattn_golden", "schema_version": "2.0", "cases": {}})
    ... except RefAttnError as exc:
    ...     print(str(exc)[:60])
    manifest: schema_version '2.0' (major 2) is not readable her
    >>> try:
    ...     check_schema({"schema": "refattn_golden", "schema_version": "1.0", "cases": {
    ...         "a": {"file": "/etc/passwd"}}})
    ... except RefAttnError as exc:
    ...     print(str(exc).split(" (schema")[0])
    manifest: cases/a: 'sha256' is a required property
    """
    if not isinstance(manifest, Mapping):
        raise RefAttnError(f"manifest: expected a JSON object, got {type(manifest).__name__}")
    if manifest.get("schema") != SCHEMA:
        raise RefAttnError(
            f"manifest: schema is {_shorten(repr(manifest.get('schema')))}, expected {SCHEMA!r}")
    if "schema_version" not in manifest:
        raise RefAttnError("manifest: schema_version is missing")
    version = manifest["schema_version"]
    major = _major(version)
    if major not in READERS:
        raise RefAttnError(
            f"manifest: schema_version {version!r} (major {major}) is not readable here; this "
            f"refattn reads majors {sorted(READERS)} (writes {SCHEMA_VERSION})"
        )
    error = jsonschema.exceptions.best_match(_validator(major).iter_errors(manifest))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        raise RefAttnError(f"manifest: {where}: {_shorten(error.message)} (schema "
                           f"{SCHEMA_FILES[major]})")
    return READERS[major](dict(manifest))


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise RefAttnError(f"manifest: duplicate key {_shorten(repr(key), 60)} in one "
                               "object")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise RefAttnError(f"manifest: {name} is not valid JSON (refattn writes no NaN or infinity)")


#: the longest integer literal a manifest may hold: Python's default limit on converting
#: text to int (past it ``int()`` raises ``ValueError``); a shorter huge integer reaches the
#: field's own bound, which names it (``an integer of 1329 bits``)
MAX_INT_DIGITS = 4300


def _int_literal(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise RefAttnError(f"manifest: an integer literal of {digits} digits, more than the "
                           f"{MAX_INT_DIGITS} any field could use")
    return int(text)


def parse_manifest(data: bytes | bytearray, shown: str = "manifest.json") -> Any:
    """Parse manifest bytes strictly: UTF-8, JSON without NaN/Infinity, duplicate keys or an
    integer literal of more than :data:`MAX_INT_DIGITS` digits.

    Examples
    --------
    >>> parse_manifest(b'{"a": 1}')
    {'a': 1}
    >>> parse_manifest(bytes([255]))
    Traceback (most recent call last):
        ...
    refattn.errors.RefAttnError: manifest.json: is not UTF-8 text (byte 0xff at offset 0)
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RefAttnError(f"{shown}: is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                           f"{exc.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant,
                          parse_int=_int_literal)
    except json.JSONDecodeError as exc:
        raise RefAttnError(f"{shown}: manifest is not valid JSON ({exc})") from None
    except RecursionError:
        raise RefAttnError(f"{shown}: manifest is nested too deeply to be a refattn "
                           "manifest") from None
    except RefAttnError as exc:
        raise RefAttnError(f"{shown}: {exc}") from None


def read_manifest(path: str | os.PathLike) -> Any:
    """Read and parse a bundle's ``manifest.json`` (schema not yet checked: see
    :func:`check_schema`).

    The file is opened from its directory without following a link, only if it is a regular
    file of at most :data:`~refattn.bundle.storage.fsio.MAX_MANIFEST_BYTES` bytes.

    Raises
    ------
    RefAttnError
        Naming the file when it cannot be read, is too large, is not a regular file, is not
        UTF-8 or is not valid JSON.
    """
    path = Path(path)
    data = read_confined(path.parent, path.name, max_bytes=MAX_MANIFEST_BYTES,
                         what="bundle manifest")
    return parse_manifest(data, str(path))
