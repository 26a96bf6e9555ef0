"""Write a golden bundle: compute every case, encode it, and write the bundle as one transaction.

Owns :func:`write_bundle`: the output directory is checked and locked first (a link, a file, a
foreign manifest or a concurrent writer is refused before any arithmetic), every case is
computed before anything is written (a failing case writes nothing), each case file is a
safetensors file whose one metadata key lists its tensor hashes, and the manifest records the
call manifest, conventions and sha256 of every file and tensor. The files reach the directory
through :class:`~refattn.bundle.storage.transaction.BundleTransaction` (staged, fsynced, swapped in
with one rename). Byte-for-byte reproducible: C-contiguous little-endian tensors, sorted JSON keys.

Also owns :func:`write_sweep`, the resumable form that ``refattn sweep`` uses: the cases are
computed by a caller-supplied function (in this process or on workers), each finished case is
staged durably as it arrives (:class:`~refattn.bundle.storage.transaction.BundleTransaction` with
``resume=``), a rerun reuses every staged case whose file matches its recorded sha256, and the
bundle appears in ``DIR`` only when complete. The manifest is a function of the cases alone, so
the bytes do not depend on who computed them, in which order, or over how many runs.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import safetensors
from safetensors.numpy import save

from refattn._boundary import public, shown
from refattn._progress import progress as progress_bar
from refattn._version import __version__
from refattn.analysis.reference_error import reference_error
from refattn.bundle.golden.case import (
    GENERATORS,
    GoldenCase,
    case_conventions,
    case_tensors,
    check_generator,
    compute,
    emulated_tensors,
    numpy_environment,
)
from refattn.bundle.golden.guarantee import (
    RECORD_RULE,
    guarantee_record,
    kappa,
    natural_scales,
    saved_state_scales,
)
from refattn.bundle.storage.format import (
    META_KEY,
    SCHEMA,
    SCHEMA_VERSION,
    dump_json,
    tensor_sha256,
)
from refattn.bundle.storage.fsio import MAX_MANIFEST_BYTES, read_confined
from refattn.bundle.storage.manifest import parse_manifest
from refattn.bundle.storage.transaction import BundleTransaction
from refattn.engine.exact.estimate import estimate_seconds
from refattn.engine.exact.program import ROUNDING_POINTS
from refattn.errors import RefAttnError

__all__ = ["MAX_EXACT_SECONDS", "Encoded", "SweepWrite", "bundle_generator", "encode_case",
           "write_bundle", "write_sweep"]


class Encoded(NamedTuple):
    """One computed case: its id, its file's bytes and its manifest entry."""

    case_id: str
    data: bytes
    entry: dict[str, Any]


class SweepWrite(NamedTuple):
    """What :func:`write_sweep` did."""

    manifest: Path
    computed: int
    reused: int
    up_to_date: bool


def encode_case(case: GoldenCase, backend: str = "exact") -> tuple[bytes, dict[str, Any]]:
    """Compute one case and return its file bytes and its manifest entry.

    The entry records, besides the call manifest and checksums, the error of the stored
    tensors against the exact real result of the whole computation
    (:func:`~refattn.analysis.reference_error.reference_error`; ``exact`` and ``numpy``
    cases, whose real result is evaluated in arbitrary precision), and for a float64 generator
    (``numpy``, ``numba``) the bound each stored tensor is within of the correctly rounded
    result, the ``guarantee`` that ``refattn verify`` applies
    (:func:`~refattn.bundle.golden.guarantee.guarantee_record`).

    Examples
    --------
    >>> from refattn.bundle.suites import build_suite
    >>> data, entry = encode_case(build_suite("contract")[0])
    >>> entry["file"], entry["sha256"] == hashlib.sha256(data).hexdigest()
    ('cases/loop6_two_query_training_trace.safetensors', True)
    """
    trace, grads = compute(case, backend)
    tensors = case_tensors(trace, grads, case.layout)
    if case.quant is not None:  # the codes, scales and emulated intervals beside the real result
        tensors.update(emulated_tensors(case))
    records = {
        name: {"sha256": tensor_sha256(t), "dtype": str(t.dtype), "shape": list(t.shape)}
        for name, t in sorted(tensors.items())
    }
    meta = json.dumps(
        {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "case_id": case.case_id,
         "tensors": {n: r["sha256"] for n, r in records.items()}},
        sort_keys=True, separators=(",", ":"),
    )
    data = save(tensors, metadata={META_KEY: meta})  # one metadata key: stable header order
    entry = {
        "file": f"cases/{case.case_id}.safetensors",
        "sha256": hashlib.sha256(data).hexdigest(),
        "comment": case.comment,
        "flags": sorted(case.flags),
        "conventions": case_conventions(case),
        "call": trace.manifest(),
        "tensors": records,
    }
    if backend != "numba":  # arbitrary precision: affordable at the miniatures' shapes only
        entry["reference_error"] = reference_error(case.call, tensors)
    if backend != "exact":
        kap, scales = (saved_state_scales(case.call, trace, grads) if backend == "numba" else
                       (kappa(trace.scores), natural_scales(case.call, trace, grads)))
        entry["guarantee"] = guarantee_record(backend, tensors, kap, scales)
    if case.quant is not None:
        entry["quant"] = case.quant.manifest()
    return data, entry


def bundle_generator(backends: Sequence[str]) -> dict[str, Any]:
    """The manifest's ``generator`` record of a bundle whose cases use ``backends``.

    One backend: as :func:`write_bundle` records it. Several: ``backend: "mixed"`` and each
    backend's record under ``backends`` (verify then recomputes each case with its own
    generator, as always).

    Examples
    --------
    >>> bundle_generator(["exact"])["arithmetic"]["mode"]
    'stepwise_correctly_rounded'
    >>> sorted(bundle_generator(["numpy", "exact"])["backends"])
    ['exact', 'numpy']
    """
    names = sorted(set(backends))
    for name in names:
        if name not in GENERATORS:
            raise RefAttnError(f"backend: golden bundles are generated by one of "
                               f"{list(GENERATORS)}, got {name!r}")
    if len(names) == 1:
        return _generator(names[0])
    return {"refattn": __version__, "backend": "mixed",
            "backends": {name: _generator(name) for name in names}}


def _generator(backend: str) -> dict[str, Any]:
    """What wrote the bundle. An exact bundle names no numpy or library version: its bytes
    are the same whatever generated them."""
    if backend == "exact":
        return {"refattn": __version__, "backend": backend,
                "arithmetic": {"mode": "stepwise_correctly_rounded",
                               "rounding": "binary64 round to nearest, ties to even",
                               "specification": "docs/EXACT_ROUNDING.md",
                               "rounding_points": dict(ROUNDING_POINTS)}}
    if backend == "numba":
        from refattn.engine.numba.generator import environment  # loads numba: here only

        return {"refattn": __version__, "backend": backend, **environment(),
                "numpy": numpy_environment()["numpy"], "safetensors": safetensors.__version__,
                "arithmetic": {"mode": "ieee754_binary64", "guarantee": RECORD_RULE}}
    return {"refattn": __version__, "backend": backend, **numpy_environment(),
            "safetensors": safetensors.__version__,
            "arithmetic": {"mode": "ieee754_binary64", "guarantee": RECORD_RULE}}


#: the longest ``write_bundle`` may expect the exact generator to take over the whole bundle
#: (its own estimates, summed before any work): ``refattn golden --max-seconds``
MAX_EXACT_SECONDS = 3600.0


@public
def write_bundle(out: str | os.PathLike, cases: Iterable[GoldenCase], *, suite: str,
                 backend: str = "exact", force: bool = False,
                 progress: bool | None = None,
                 max_seconds: float = MAX_EXACT_SECONDS) -> Path:
    """Compute every case and write the bundle ``out`` as one transaction, reproducibly.

    Parameters
    ----------
    out : path
        Bundle directory: absent (created), empty, or an earlier refattn bundle. A symbolic
        link or an existing file is refused.
    cases : iterable of GoldenCase
    suite : str
        Name recorded in the manifest.
    backend : {"exact", "numpy", "numba"}
        Generator: ``exact`` (default) writes the same bytes on every machine; ``numpy`` the
        full float64 trace; ``numba`` the saved-state tensors of the fused kernel, fast at
        kernel shapes (:data:`~refattn.bundle.golden.case.GENERATORS`).
    force : bool
        Write beside files refattn did not write (they are left untouched). A foreign
        ``manifest.json`` or a foreign file inside ``cases/`` is refused even then.
    progress : bool or None
        A progress bar over the cases on standard error: None (default) on a terminal only,
        False never, True always (:func:`refattn._progress.progress`).
    max_seconds : float
        The exact generator's estimated time for the whole bundle may be at most this
        (default :data:`MAX_EXACT_SECONDS`): a longer one is refused before any work, with
        the estimate (the kernel suite's 304 cases would take about 1.3 hours exactly).

    Returns
    -------
    Path
        The path of ``manifest.json``.

    Raises
    ------
    RefAttnError
        On duplicate case ids, an output directory that is not refattn's to write (see
        :mod:`refattn.bundle.storage.transaction`), a concurrent writer, or a write that fails (a
        full disk, a read-only directory): the previous bundle is then left as it was; a
        case the generator cannot write (:func:`check_generator`), before any arithmetic.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> from refattn.bundle.suites import build_suite
    >>> d = pathlib.Path(tempfile.mkdtemp()) / "b"
    >>> write_bundle(d, build_suite("contract")[:1], suite="contract").name
    'manifest.json'
    >>> _ = (d / "notes.txt").write_text("mine")
    >>> try:
    ...     write_bundle(d, build_suite("contract")[:1], suite="contract")
    ... except RefAttnError as exc:
    ...     print("did not write" in str(exc))
    True
    """
    if backend not in GENERATORS:
        raise RefAttnError(f"backend: golden bundles are generated by one of {list(GENERATORS)}, "
                           f"got {backend!r}")
    out = Path(out)
    with BundleTransaction(out, force=force) as tx:  # refuse before any arithmetic
        entries: dict[str, dict[str, Any]] = {}
        try:
            todo = cases if isinstance(cases, Sequence) else list(cases)
        except TypeError:
            raise RefAttnError(f"cases: expected golden cases, got {shown(cases)}") from None
        seconds = 0.0
        for i, case in enumerate(todo):  # every case the generator cannot write, named first
            if not isinstance(case, GoldenCase):
                raise RefAttnError(f"cases[{i}]: expected a GoldenCase, got {shown(case)}")
            check_generator(case, backend)
            seconds += estimate_seconds(case.call) if backend == "exact" else 0.0
        if seconds > max_seconds:
            raise RefAttnError(
                f"--backend exact: the {len(todo)} case(s) of suite {suite!r} would take about "
                f"{seconds / 3600:.2g} h correctly rounded (the exact generator's estimate), "
                f"over --max-seconds {max_seconds:g}; pass a larger --max-seconds to wait for "
                "them, or --backend numba (float64 within the recorded bound of the correctly "
                "rounded result, in seconds)")
        for case in progress_bar(todo, desc=f"golden {suite}", enabled=progress):
            # each file staged as it is computed (one in memory at a time); a failing case
            # discards the staging, so nothing reaches ``out``
            if case.case_id in entries:
                raise RefAttnError(f"case_id: duplicate case {case.case_id!r} in suite "
                                   f"{suite!r}")
            data, entry = encode_case(case, backend)
            tx.add(entry["file"], data)
            entries[case.case_id] = entry
        manifest = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "suite": suite,
                    "generator": _generator(backend), "cases": entries}
        tx.commit({"manifest.json": dump_json(manifest)})
    return tx.out / "manifest.json"


def _note(entry: Mapping[str, Any]) -> bytes:
    """A staged case's note: its manifest entry as compact JSON (the manifest itself is
    written by :func:`dump_json` at the end; the C encoder here costs a tenth of it)."""
    return json.dumps(entry, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _entry_of(data: bytes | bytearray | None, note: bytes | bytearray | None,
              rel: str) -> dict[str, Any] | None:
    """The manifest entry of a staged or bundled case file, if the file matches it."""
    if data is None or note is None:
        return None
    try:
        entry = parse_manifest(note, rel)
    except RefAttnError:
        return None
    if not isinstance(entry, dict) or entry.get("file") != rel:
        return None
    if entry.get("sha256") != hashlib.sha256(data).hexdigest():
        return None
    return entry


def _existing(out: Path) -> tuple[dict[str, Any] | None, bytes | bytearray | None]:
    """The bundle manifest already in ``out`` (parsed, raw), or (None, None)."""
    if not os.path.lexists(out / "manifest.json"):
        return None, None
    raw = read_confined(out, "manifest.json", max_bytes=MAX_MANIFEST_BYTES,
                        what="bundle manifest")
    doc = parse_manifest(raw, str(out / "manifest.json"))
    return (doc if isinstance(doc, dict) else None), raw


def _sweep_manifest(suite: str, generator: Mapping[str, Any], sweep: Mapping[str, Any],
                    entries: Mapping[str, Any]) -> bytes:
    return dump_json({"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "suite": suite,
                      "generator": dict(generator), "sweep": dict(sweep),
                      "cases": {cid: entries[cid] for cid in sorted(entries)}})


def write_sweep(out: str | os.PathLike, case_ids: Sequence[str],
                compute: Callable[[list[str]], Iterable[Encoded]], *, suite: str,
                generator: Mapping[str, Any], sweep: Mapping[str, Any], force: bool = False,
                on_case: Callable[[str, bool], None] | None = None) -> SweepWrite:
    """Write a sweep bundle resumably: stage each case as it is computed, commit when all are.

    Parameters
    ----------
    out : path
        Bundle directory: absent, empty, or this sweep's own bundle (a bundle of another
        sweep or suite is refused, as is another sweep's unfinished staging beside it).
    case_ids : sequence of str
        Every case of the sweep.
    compute : callable
        ``compute(pending_ids)`` yields one :class:`Encoded` per pending id, in any order
        (:func:`encode_case` of each case, here or on workers).
    suite : str
        Recorded as the manifest's suite.
    generator : dict
        The manifest's ``generator`` record (:func:`bundle_generator`).
    sweep : dict
        The manifest's ``sweep`` record; its ``id`` (hex) names the sweep and its staging.
    force : bool
        Write beside files refattn did not write (as for :func:`write_bundle`).
    on_case : callable, optional
        ``on_case(case_id, reused)`` after each case is staged or found staged.

    Returns
    -------
    SweepWrite
        The manifest path, the number of cases computed and reused, and whether ``out``
        already held this exact bundle (then nothing was written).

    Raises
    ------
    RefAttnError
        As :func:`write_bundle`; and when ``out`` holds another bundle, when ``compute``
        returns an id that is not pending, twice, or not at all.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> from refattn.bundle.suites import build_suite
    >>> cases = {c.case_id: c for c in build_suite("contract")[:2]}
    >>> def compute(ids):
    ...     for cid in ids:
    ...         yield Encoded(cid, *encode_case(cases[cid]))
    >>> d = pathlib.Path(tempfile.mkdtemp()) / "b"
    >>> kw = dict(suite="sweep:demo", generator=bundle_generator(["exact"]),
    ...           sweep={"id": "00ff", "name": "demo"})
    >>> write_sweep(d, sorted(cases), compute, **kw)[1:]
    (2, 0, False)
    >>> write_sweep(d, sorted(cases), compute, **kw)[1:]          # nothing left to do
    (0, 2, True)
    """
    sweep_id = str(sweep.get("id", ""))
    ids = list(case_ids)
    if len(set(ids)) != len(ids):
        raise RefAttnError(f"case_id: duplicate case ids in sweep {sweep_id!r}")
    out = Path(out)
    with BundleTransaction(out, force=force, resume=sweep_id) as tx:
        existing, raw = _existing(tx.out)
        if existing is not None:
            got = (existing.get("sweep") or {}).get("id") if isinstance(
                existing.get("sweep"), dict) else None
            if got != sweep_id:
                what = (f"sweep {got!r} ({existing['sweep'].get('name')!r})" if got else
                        f"a bundle of suite {existing.get('suite')!r}")
                raise RefAttnError(
                    f"--out {tx.out}: holds {what}, not sweep {sweep_id!r} "
                    f"({sweep.get('name')!r}); a sweep writes only into an empty directory "
                    "or its own bundle (choose another --out, or move that bundle away)")
        entries: dict[str, dict[str, Any]] = {}
        wanted = set(ids)
        for rel in tx.staged_names():  # staged by an earlier, interrupted run
            cid = rel[len("cases/"):-len(".safetensors")]
            entry = _entry_of(tx.staged(rel), tx.staged(f"{cid}.json", note=True), rel) \
                if cid in wanted else None
            if entry is None:  # not this sweep's, partial or altered: ours to recompute
                tx.unstage(rel)
                tx.unstage(f"{cid}.json", note=True)
            else:
                entries[cid] = entry
        in_dir: dict[str, dict[str, Any]] = {}
        if existing is not None:  # this sweep's own bundle: its verified files count too
            cases = existing.get("cases")
            recorded: dict[str, Any] = cases if isinstance(cases, dict) else {}
            for cid in ids:
                rel = f"cases/{cid}.safetensors"
                if cid in entries or not isinstance(recorded.get(cid), dict):
                    continue
                try:
                    data: bytes | bytearray = read_confined(tx.out, rel, max_bytes=2**34,
                                                            what="case file")
                except RefAttnError:
                    continue
                if _entry_of(data, _note(recorded[cid]), rel) is not None:
                    in_dir[cid] = recorded[cid]
        if len(in_dir) == len(ids) and raw == _sweep_manifest(suite, generator, sweep,
                                                              in_dir):
            tx.discard_resume()  # the directory already holds exactly this bundle
            for cid in sorted(in_dir):
                if on_case is not None:
                    on_case(cid, True)
            return SweepWrite(tx.out / "manifest.json", 0, len(ids), True)
        for cid, entry in sorted(in_dir.items()):  # staged again: the new bundle holds them
            rel = f"cases/{cid}.safetensors"
            tx.stage(rel, read_confined(tx.out, rel, max_bytes=2**34, what="case file"))
            tx.stage(f"{cid}.json", _note(entry), note=True)
            entries[cid] = entry
        for cid in sorted(entries):
            if on_case is not None:
                on_case(cid, True)
        pending = [cid for cid in ids if cid not in entries]
        computed = 0
        for result in compute(pending) if pending else ():
            cid, data, entry = result
            rel = f"cases/{cid}.safetensors"
            if cid not in wanted or cid in entries:
                raise RefAttnError(f"compute: returned case {cid!r}, which is not pending "
                                   f"in sweep {sweep_id!r}")
            if entry.get("file") != rel or entry.get("sha256") != hashlib.sha256(
                    data).hexdigest():
                raise RefAttnError(f"compute: case {cid!r}: the entry does not describe the "
                                   "bytes returned with it")
            tx.stage(rel, data)
            tx.stage(f"{cid}.json", _note(entry), note=True)
            entries[cid] = entry
            computed += 1
            if on_case is not None:
                on_case(cid, False)
        missing = [cid for cid in ids if cid not in entries]
        if missing:
            raise RefAttnError(f"compute: no result for {len(missing)} case(s) of sweep "
                               f"{sweep_id!r} (first {missing[0]!r}); rerun to resume")
        tx.commit({"manifest.json": _sweep_manifest(suite, generator, sweep, entries)})
    return SweepWrite(tx.out / "manifest.json", computed, len(ids) - computed, False)
