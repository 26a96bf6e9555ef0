"""Records of bundles that passed ``refattn verify``, kept outside them, keyed by their bytes.

Owns :func:`bundle_digest` (sha256 of the bundle's ``manifest.json``, read from inside the
bundle; the manifest holds the sha256 of every case file and tensor, which every reader checks
against the bytes it reads, so the digest names the bundle's whole content), :func:`remember`
(after a verify run that recomputed every case and passed: one small JSON file in
``$REFATTN_CACHE_DIR/verified/``, named by the digest) and :func:`trusted` (what the pytest
plugin asks before it compares a kernel against a bundle: a record for these very bytes and
this refattn version, else a verify run of its own, recorded when it passes).

Nothing inside a bundle can create, name or satisfy a record: the digest is derived here from
the bytes read, the record lives in the user's cache, and a record is a verdict this refattn
reached itself. A bundle that fails verify, or holds no case, is refused with the reasons.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from refattn._cachedir import cache_dir
from refattn._version import __version__
from refattn.bundle.storage.fsio import MAX_MANIFEST_BYTES, read_confined
from refattn.bundle.verification.report import VerifyReport
from refattn.bundle.verification.verifier import verify
from refattn.errors import RefAttnError

__all__ = ["bundle_digest", "record_path", "remember", "trusted"]

#: problems a refusal names (the rest are counted)
_SHOWN = 3


def bundle_digest(directory: str | os.PathLike) -> str:
    """sha256 (hex) of the bundle's ``manifest.json``, read from inside ``directory`` (no link
    followed, size bounded).

    Examples
    --------
    >>> import tempfile
    >>> from refattn.bundle.suites import build_suite
    >>> from refattn.bundle.writing.write import write_bundle
    >>> d = tempfile.mkdtemp()
    >>> _ = write_bundle(d, build_suite("contract")[:1], suite="contract")
    >>> len(bundle_digest(d))
    64
    """
    raw = read_confined(Path(directory), "manifest.json", max_bytes=MAX_MANIFEST_BYTES,
                        what="bundle manifest")
    return hashlib.sha256(raw).hexdigest()


def record_path(digest: str) -> Path:
    """Where the record of the bundle with ``digest`` lives (``$REFATTN_CACHE_DIR/verified``)."""
    return cache_dir() / "verified" / f"{digest}.json"


def remember(digest: str, report: VerifyReport, *, gradcheck: bool) -> Path | None:
    """Record that the bundle with ``digest`` passed a verify run that recomputed every case
    (``report``); nothing is recorded for a failing report. Written atomically (a temporary
    file renamed); a cache that cannot be written records nothing (the next run verifies
    again).

    Returns
    -------
    Path or None
        The record's path, or None when nothing was recorded.
    """
    if not report.passed or not report.cases:
        return None
    path = record_path(digest)
    record = {"digest": digest, "refattn": __version__, "cases": len(report.cases),
              "recomputed": True, "gradcheck": bool(gradcheck)}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        return None
    return path


def _recorded(digest: str) -> bool:
    try:
        record = json.loads(record_path(digest).read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(record, dict) and record.get("digest") == digest
            and record.get("refattn") == __version__ and record.get("recomputed") is True)


def trusted(directory: str | os.PathLike, **options: Any) -> str:
    """Make sure the bundle in ``directory`` passes ``refattn verify`` before anything is
    compared against it; return its digest.

    A record of a passing verify run of these very bytes (:func:`remember`) by this refattn
    version answers at once; otherwise :func:`~refattn.bundle.verification.verifier.verify`
    runs now (every case recomputed; ``options`` are its keywords, e.g. ``gradcheck``), and a
    pass is recorded.

    Raises
    ------
    RefAttnError
        A bundle that fails verify (naming the first problems) or holds no case.

    Examples
    --------
    >>> import tempfile
    >>> from refattn.bundle.suites import build_suite
    >>> from refattn.bundle.writing.write import write_bundle
    >>> d = tempfile.mkdtemp()
    >>> _ = write_bundle(d, build_suite("contract")[:1], suite="contract")
    >>> trusted(d, gradcheck=False) == bundle_digest(d)
    True
    """
    digest = bundle_digest(directory)
    if _recorded(digest):
        return digest
    report = verify(directory, progress=False, **options)
    if bundle_digest(directory) != digest:
        raise RefAttnError(f"{directory}: the bundle changed while it was being verified")
    if not report.passed:
        problems = report.all_problems
        shown = "; ".join(str(p) for p in problems[:_SHOWN])
        more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
        raise RefAttnError(
            f"{directory}: refattn verify fails this bundle, so nothing is compared against "
            f"it: {shown}{more}")
    remember(digest, report, gradcheck=options.get("gradcheck", True))
    return digest
