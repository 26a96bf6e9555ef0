"""Write a bundle as one transaction into a directory that belongs to a user.

Owns :class:`BundleTransaction`, the write side of ``refattn golden --out DIR``:

1. ``DIR`` must be a real directory (or absent): a symbolic link or an existing file is
   refused, never followed or replaced.
2. The writer takes an exclusive lock on ``DIR``
(:class:`~refattn.bundle.storage.fsio.DirectoryLock`);
   a second writer is refused with a clear message.
3. ``DIR`` is surveyed. refattn's own files are a ``manifest.json`` whose schema is
   ``refattn_golden``, the case files in ``cases/`` that carry refattn's metadata, and the
   temporary files an interrupted refattn left. Anything else is the user's: a foreign
   ``manifest.json``, a link, or any file inside ``cases/`` that refattn did not write is always
   refused (refattn would have to overwrite or delete it); other files beside the bundle are
   refused unless ``force``, and then left untouched.
4. The whole bundle is written into a temporary sibling directory ``.DIR.refattn-staging-*``,
   every file and directory fsynced, and swapped in with one ``renameat2(RENAME_EXCHANGE)``
   (or one rename when ``DIR`` was empty); the parent directory is fsynced; then the previous
   bundle, now in the staging directory, is removed file by file (refattn's files only). A run
   killed at any point leaves the previous bundle in ``DIR`` intact and, at worst, a staging
   directory that the next run removes. With ``force`` beside foreign files, those files must
   stay where they are, so the bundle's files are replaced one by one instead (each atomically,
   case files first, ``manifest.json`` last, stale refattn cases removed at the end).
5. A resumable transaction (``resume=KEY``, the mode of ``refattn sweep``) stages into a
   persistent sibling ``.DIR.refattn-resume-KEY/`` instead: ``bundle/`` is the bundle being
   built and ``notes/`` holds one small file per staged case (its manifest entry). Files
   arrive one at a time (:meth:`BundleTransaction.stage`: a temporary file renamed into
   place, so a staged file is whole or absent), survive a killed run, and are read back by
   the next run with the same key (which checks them: the caller's job);
   :meth:`~BundleTransaction.commit` writes the manifest into ``bundle/``, flushes the
   staging tree to disk and swaps it in exactly as above, then removes the resume
   directory. A resume directory of another key beside ``DIR`` is another run's unfinished
   work: it is refused, never removed.

Defers the primitives to :mod:`refattn.bundle.storage.fsio`; knows nothing of cases or engines.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
from collections import ChainMap
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from refattn.bundle.storage.format import META_KEY, SCHEMA
from refattn.bundle.storage.fsio import (
    MAX_MANIFEST_BYTES,
    DirectoryLock,
    exchange,
    fsync_dir,
    os_error,
    read_confined,
    sync_filesystem,
    write_new,
)
from refattn.errors import RefAttnError

__all__ = ["RESUME_MARK", "STAGING_MARK", "BundleTransaction", "Survey", "survey"]

#: the infix of the temporary sibling directories a writer stages a bundle in
STAGING_MARK = ".refattn-staging-"
#: the infix of the persistent sibling directory a resumable writer stages a bundle in
RESUME_MARK = ".refattn-resume-"
_RESUME_KEY = re.compile(r"^[0-9a-f]{1,64}$")
_NOTE_NAME = re.compile(r"^[A-Za-z0-9_.-]+\.json$")
_TMP_NAME = re.compile(r"^\.[A-Za-z0-9_.-]+\.[0-9a-f]+\.tmp$")
_CASE_NAME = re.compile(r"^[A-Za-z0-9_.-]+\.safetensors$")
#: temporary files earlier refattn versions' atomic writes left when killed
_OLD_TMP = re.compile(r"^\.(manifest\.json|[A-Za-z0-9_.-]+\.safetensors)\.[A-Za-z0-9_]+\.tmp$")
_HEADER_LIMIT = 100 * 2**20


@dataclass
class Survey:
    """What an existing bundle directory holds (paths relative to it)."""

    own: list[str] = field(default_factory=list)
    foreign: list[str] = field(default_factory=list)
    blockers: list[str] = field(default_factory=list)


def _open_nofollow(path: Path) -> int:
    return os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
                   | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))


def _is_refattn_case(path: Path) -> bool:
    """A regular file whose safetensors header carries refattn's metadata key."""
    try:
        fd = _open_nofollow(path)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = os.read(fd, 8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= _HEADER_LIMIT:
            return False
        raw = os.read(fd, n)
        header = json.loads(raw)
        meta = json.loads(header["__metadata__"][META_KEY])
        return isinstance(meta, dict) and meta.get("schema") == SCHEMA
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return False
    finally:
        os.close(fd)


def _is_refattn_manifest(path: Path) -> tuple[bool, str]:
    try:
        fd = _open_nofollow(path)
    except OSError as exc:
        return False, exc.strerror or "cannot open"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False, "not a regular file"
        if st.st_size > MAX_MANIFEST_BYTES:
            return False, f"{st.st_size} bytes, larger than any refattn manifest"
        data = os.read(fd, st.st_size + 1)
        doc = json.loads(data.decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        return False, f"not refattn JSON ({type(exc).__name__})"
    finally:
        os.close(fd)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        shown = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        return False, f"its schema is {shown!r}, not {SCHEMA!r}"
    return True, ""


def survey(out: Path) -> Survey:
    """Classify every entry of an existing bundle directory (links are never followed).

    Examples
    --------
    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp()); _ = (d / "notes.txt").write_text("mine")
    >>> s = survey(d); s.own, s.foreign, s.blockers
    ([], ['notes.txt'], [])
    """
    s = Survey()
    try:
        entries = sorted(os.scandir(out), key=lambda e: e.name)
    except OSError as exc:
        raise os_error(out, exc, "cannot list the output directory") from None
    for entry in entries:
        name = entry.name
        if name == "manifest.json":
            ok, why = (False, "a symbolic link") if entry.is_symlink() else (
                _is_refattn_manifest(Path(entry.path)))
            if ok:
                s.own.append(name)
            else:
                s.blockers.append(f"manifest.json is not a refattn manifest ({why}); refattn "
                                  "never overwrites a file it did not write")
        elif name == "cases":
            if entry.is_symlink() or not entry.is_dir(follow_symlinks=False):
                what = "a symbolic link" if entry.is_symlink() else "not a directory"
                s.blockers.append(f"cases is {what}; refattn writes its case files only "
                                  "into a real cases/ directory and never follows a link")
                continue
            _survey_cases(Path(entry.path), s)
        elif _OLD_TMP.match(name) and entry.is_file(follow_symlinks=False):
            s.own.append(name)
        else:
            s.foreign.append(name)
    return s


def _survey_cases(cases: Path, s: Survey) -> None:
    try:
        entries = sorted(os.scandir(cases), key=lambda e: e.name)
    except OSError as exc:
        raise os_error(cases, exc, "cannot list the cases directory") from None
    for entry in entries:
        rel = f"cases/{entry.name}"
        if entry.is_symlink():
            s.blockers.append(f"{rel} is a symbolic link; refattn does not follow or replace "
                              "links inside a bundle")
        elif _CASE_NAME.match(entry.name) and _is_refattn_case(Path(entry.path)):
            s.own.append(rel)
        elif _OLD_TMP.match(entry.name) and entry.is_file(follow_symlinks=False):
            s.own.append(rel)
        else:
            s.blockers.append(f"{rel} was not written by refattn; cases/ holds only refattn's "
                              "case files (move it out of cases/)")


def _remove_own(root: Path, rels: list[str]) -> None:
    """Remove refattn's own files (never a link, never a directory's foreign content)."""
    for rel in sorted(rels, key=lambda r: -r.count("/")):
        path = root / rel
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise os_error(path, exc, "cannot remove refattn's previous file") from None


def _rmdir_quiet(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass  # not empty (something that is not ours) or gone: leave it


def _discard_staging(staging: Path) -> None:
    """Remove a staging directory of ours: its refattn files, then the directories."""
    try:
        s = survey(staging)
    except RefAttnError:
        return
    _remove_own(staging, s.own)
    _rmdir_quiet(staging / "cases")
    _rmdir_quiet(staging)


class _Staged(Mapping[str, bytes]):
    """The files :meth:`BundleTransaction.add` staged, read back when asked for (one at a
    time: the in-place commit replaces them one by one)."""

    def __init__(self, staging: Path, rels: list[str]) -> None:
        self.staging, self.rels = staging, list(rels)

    def __getitem__(self, rel: str) -> bytes:
        if rel not in self.rels:
            raise KeyError(rel)
        return bytes(read_confined(self.staging, rel, max_bytes=2**40, what="staged file"))

    def __iter__(self) -> Iterator[str]:
        return iter(self.rels)

    def __len__(self) -> int:
        return len(self.rels)


class BundleTransaction:
    """Lock, check and (on :meth:`commit`) replace a bundle directory in one step.

    Parameters
    ----------
    out : path
        The bundle directory (created with its parents when absent).
    force : bool
        Write beside files refattn did not write (they are left untouched).

    Examples
    --------
    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp()) / "bundle"
    >>> with BundleTransaction(d) as tx:
    ...     tx.commit({"cases/a.safetensors": b"x", "manifest.json": b"{}"})
    >>> sorted(str(p.relative_to(d)) for p in d.rglob("*"))
    ['cases', 'cases/a.safetensors', 'manifest.json']
    """

    def __init__(self, out: str | os.PathLike, *, force: bool = False,
                 resume: str | None = None) -> None:
        self.out = Path(os.path.abspath(os.fspath(out)))
        self.force = bool(force)
        self.lock = DirectoryLock(self.out)
        if resume is not None and not (isinstance(resume, str) and _RESUME_KEY.match(resume)):
            raise RefAttnError(f"resume: expected 1-64 lowercase hex digits, got {resume!r}")
        self.resume = resume
        self.resume_dir: Path | None = None
        self.created: list[Path] = []  # directories __enter__ made (removed again on failure)
        self.staging: Path | None = None  # add()'s staging directory (until commit)
        self.added: list[str] = []  # the bundle paths add() staged, in order

    # -- entry: refuse early, before any arithmetic -----------------------------------------
    def __enter__(self) -> BundleTransaction:
        out = self.out
        try:
            st = os.lstat(out)
        except FileNotFoundError:
            st = None
        except OSError as exc:
            raise os_error(out, exc, "cannot inspect the output directory") from None
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise RefAttnError(f"--out {out}: is a symbolic link; refattn does not follow it "
                               "(pass the directory it points to)")
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise RefAttnError(f"--out {out}: exists and is not a directory; expected a "
                               "bundle directory (absent, empty, or an earlier bundle)")
        if st is None:
            self.created = [d for d in (out, *out.parents) if not os.path.lexists(d)]
            try:
                out.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise os_error(out, exc, "cannot create the output directory") from None
        try:
            self.lock.__enter__()
        except BaseException:
            self._remove_created()
            raise
        try:
            self._check(survey(out))
            self._clean_stale_staging()
            if self.resume is not None:
                self._open_resume()
        except BaseException:
            self.lock.__exit__()
            self._remove_created()
            raise
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            if self.staging is not None:  # added but never committed: nothing reaches DIR
                _discard_staging(self.staging)
                self.staging = None
        finally:
            self.lock.__exit__()
            if exc_type is not None:  # failed or interrupted (Ctrl-C) before the swap
                self._remove_created()

    def _remove_created(self) -> None:
        """Remove the directories this transaction created, deepest first, if still empty."""
        if os.path.lexists(self.out / "manifest.json"):
            return  # the swap happened: the bundle is in place
        for d in self.created:
            _rmdir_quiet(d)
        self.created = []

    def _check(self, s: Survey) -> None:
        if s.blockers:
            raise RefAttnError(f"--out {self.out}: {s.blockers[0]}"
                               + (f" (and {len(s.blockers) - 1} more)" if len(s.blockers) > 1
                                  else ""))
        if s.foreign and not self.force:
            shown = ", ".join(s.foreign[:3]) + (" ..." if len(s.foreign) > 3 else "")
            raise RefAttnError(
                f"--out {self.out}: holds {len(s.foreign)} file(s) refattn did not write "
                f"({shown}); choose an empty or bundle directory, or pass --force to write "
                "beside them (they are left untouched)")

    def _stagings(self) -> list[Path]:
        prefix = f".{self.out.name}{STAGING_MARK}"
        try:
            return [Path(e.path) for e in os.scandir(self.out.parent)
                    if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)]
        except OSError:
            return []

    def _clean_stale_staging(self) -> None:
        """Staging directories of killed runs (we hold the lock: none is in use)."""
        for staging in self._stagings():
            _discard_staging(staging)

    # -- the resumable staging directory ------------------------------------------------------
    def _resume_dirs(self) -> list[Path]:
        prefix = f".{self.out.name}{RESUME_MARK}"
        try:
            return sorted(Path(e.path) for e in os.scandir(self.out.parent)
                          if e.name.startswith(prefix))
        except OSError:
            return []

    def _open_resume(self) -> None:
        """Create or reuse ``.DIR.refattn-resume-KEY/``; refuse another key's directory."""
        own = self.out.parent / f".{self.out.name}{RESUME_MARK}{self.resume}"
        others = [d for d in self._resume_dirs() if d != own]
        if others:
            raise RefAttnError(
                f"--out {self.out}: {others[0]} holds the unfinished work of another run "
                f"(key {others[0].name.rsplit(RESUME_MARK, 1)[-1]!r}, not {self.resume!r}); "
                "finish it by rerunning that SPEC, or remove that directory")
        try:
            st = os.lstat(own)
        except FileNotFoundError:
            st = None
        except OSError as exc:
            raise os_error(own, exc, "cannot inspect the resume directory") from None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise RefAttnError(f"{own}: is not a directory; refattn stages a resumable bundle "
                               "there (move it away)")
        try:
            for d in (own, own / "bundle", own / "bundle" / "cases", own / "notes"):
                d.mkdir(exist_ok=True)
        except OSError as exc:
            raise os_error(own, exc, "cannot create the resume directory") from None
        for sub in (own / "bundle", own / "bundle" / "cases", own / "notes"):
            st = os.lstat(sub)
            if not stat.S_ISDIR(st.st_mode):
                raise RefAttnError(f"{sub}: is not a directory (refattn never follows a link "
                                   "inside its resume directory)")
            for entry in os.scandir(sub):  # temporary files of a killed run: ours, partial
                if _TMP_NAME.match(entry.name) and entry.is_file(follow_symlinks=False):
                    Path(entry.path).unlink(missing_ok=True)
        fsync_dir(self.out.parent)
        self.resume_dir = own

    def _resume_path(self, rel: str, *, note: bool = False) -> Path:
        if self.resume_dir is None or self.lock.fd is None:
            raise RefAttnError("bundle transaction: staging needs resume= and the with block")
        if note:
            if not _NOTE_NAME.match(rel):
                raise RefAttnError(f"note: {rel!r} is not a note name (<name>.json)")
            return self.resume_dir / "notes" / rel
        if rel != "manifest.json" and not (rel.startswith("cases/")
                                           and _CASE_NAME.match(rel[len("cases/"):])):
            raise RefAttnError(f"stage: {rel!r} is not a bundle file (cases/<case_id>"
                               ".safetensors or manifest.json)")
        return self.resume_dir / "bundle" / rel

    def stage(self, rel: str, data: bytes | bytearray, *, note: bool = False) -> None:
        """Add one file to the resumable staging directory, whole or not at all.

        ``rel`` is a bundle path (``cases/<case_id>.safetensors``), or with ``note=True`` the
        name of a note (``<name>.json``). Written to a temporary file and renamed over any
        earlier version: a killed run leaves it whole or absent. It is not fsynced here
        (after a machine crash a staged file may be empty, and the next run, which checks
        every staged file against its recorded sha256, computes it again); :meth:`commit`
        flushes the whole staging tree before the bundle is swapped in.
        """
        target = self._resume_path(rel, note=note)
        tmp = target.parent / f".{target.name}.{secrets.token_hex(4)}.tmp"
        write_new(tmp, data, sync=False)
        try:
            os.replace(tmp, target)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise os_error(target, exc, "cannot rename into place") from None

    def staged(self, rel: str, *, note: bool = False,
               max_bytes: int = 2**34) -> bytes | bytearray | None:
        """The bytes of a staged file or note (no link followed), or None when absent."""
        target = self._resume_path(rel, note=note)
        root = target.parent
        try:
            return read_confined(root, target.name, max_bytes=max_bytes, what="staged file")
        except RefAttnError:
            if not os.path.lexists(target):
                return None
            raise

    def staged_names(self, *, note: bool = False) -> list[str]:
        """Staged case files (``cases/...``) or notes, sorted."""
        if self.resume_dir is None:
            return []
        where = self.resume_dir / ("notes" if note else "bundle/cases")
        pattern = _NOTE_NAME if note else _CASE_NAME
        names = sorted(e.name for e in os.scandir(where)
                       if pattern.match(e.name) and e.is_file(follow_symlinks=False))
        return names if note else [f"cases/{n}" for n in names]

    def unstage(self, rel: str, *, note: bool = False) -> None:
        """Remove one staged file or note (refattn's own; absent is fine)."""
        target = self._resume_path(rel, note=note)
        _remove_own(target.parent, [target.name])

    def discard_resume(self) -> None:
        """Remove the resume directory: its refattn files, then the directories."""
        own = self.resume_dir
        if own is None:
            return
        _remove_own(own / "notes", self.staged_names(note=True))
        _discard_staging(own / "bundle")
        _rmdir_quiet(own / "notes")
        _rmdir_quiet(own)
        fsync_dir(self.out.parent)
        self.resume_dir = None

    # -- files one at a time, then the commit ---------------------------------------------------
    def add(self, rel: str, data: bytes | bytearray) -> None:
        """Write one file of the new bundle now, into the staging directory (nothing reaches
        ``DIR`` before :meth:`commit`; a failure or Ctrl-C removes the staging directory).

        A bundle of any size is then written holding one file in memory at a time.
        ``rel`` is a bundle path (``cases/<case_id>.safetensors``); added once.

        Examples
        --------
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp()) / "bundle"
        >>> with BundleTransaction(d) as tx:
        ...     tx.add("cases/a.safetensors", b"x")
        ...     tx.commit({"manifest.json": b"{}"})
        >>> sorted(str(p.relative_to(d)) for p in d.rglob("*"))
        ['cases', 'cases/a.safetensors', 'manifest.json']
        """
        if self.lock.fd is None:
            raise RefAttnError("bundle transaction: add() outside its with block")
        if self.resume_dir is not None:
            self.stage(rel, data)
            return
        if not (rel.startswith("cases/") and _CASE_NAME.match(rel[len("cases/"):])):
            raise RefAttnError(f"add: {rel!r} is not a case file (cases/<case_id>.safetensors)")
        if rel in self.added:
            raise RefAttnError(f"add: {rel!r} was added already")
        if self.staging is None:
            self.staging = self._new_staging()
            try:
                (self.staging / "cases").mkdir()
            except OSError as exc:
                raise os_error(self.staging, exc, "cannot create") from None
        write_new(self.staging / rel, data)
        self.added.append(rel)

    def commit(self, files: Mapping[str, bytes]) -> None:
        """Write ``files`` (relative path -> bytes; ``manifest.json`` among them) as the
        bundle, replacing refattn's previous files and nothing else.

        The bundle is the files :meth:`add` staged (or, resumable, :meth:`stage`) plus
        ``files``."""
        if self.lock.fd is None:
            raise RefAttnError("bundle transaction: commit() outside its with block")
        s = survey(self.out)  # again, under the lock: the user may have added files
        self._check(s)
        if self.resume_dir is not None:
            self._commit_resume(files, s)
        elif s.foreign:
            staged = self.staging
            if staged is not None:  # read back one at a time as they are replaced
                files = ChainMap(dict(files), cast("dict[str, bytes]", _Staged(staged,
                                                                               self.added)))
            self._commit_in_place(files, s)
            if staged is not None:
                _discard_staging(staged)
                self.staging = None
        else:
            self._commit_swap(files, s)

    def _new_staging(self) -> Path:
        staging = self.out.parent / f".{self.out.name}{STAGING_MARK}{secrets.token_hex(6)}"
        try:
            staging.mkdir()
        except OSError as exc:
            raise os_error(staging, exc, "cannot create the staging directory") from None
        return staging

    def _stage(self, files: Mapping[str, bytes]) -> Path:
        staging = self.staging or self._new_staging()
        self.staging = None  # from here on this method owns (and on failure removes) it
        try:
            dirs = {staging, *({staging / "cases"} if self.added else ())}
            for rel, data in sorted(files.items(), key=lambda kv: kv[0] == "manifest.json"):
                path = staging / rel
                if path.parent not in dirs:
                    try:
                        path.parent.mkdir(parents=True)
                    except OSError as exc:
                        raise os_error(path.parent, exc, "cannot create") from None
                    dirs.add(path.parent)
                write_new(path, data)
            for d in sorted(dirs, key=lambda p: -len(p.parts)):
                fsync_dir(d)
            try:
                os.chmod(staging, stat.S_IMODE(os.stat(self.out).st_mode))
            except OSError as exc:
                raise os_error(staging, exc, "cannot set the directory's mode") from None
        except BaseException:
            _discard_staging(staging)
            raise
        return staging

    def _commit_swap(self, files: Mapping[str, bytes], s: Survey) -> None:
        staging = self._stage(files)
        try:
            old = self._swap_in(staging)
        except BaseException:
            _discard_staging(staging)
            raise
        self._retire(old, s)
        fsync_dir(self.out.parent)

    def _swap_in(self, new: Path) -> Path:
        """Put the directory ``new`` where the bundle is; return where the previous one went."""
        if exchange(new, self.out):
            return new  # the previous bundle now lives where the new one was staged
        # no RENAME_EXCHANGE here: move the old bundle aside, then one rename
        old = self.out.parent / f".{self.out.name}{STAGING_MARK}{secrets.token_hex(6)}"
        try:
            os.rename(self.out, old)
        except OSError as exc:
            raise os_error(self.out, exc, "cannot move the previous bundle aside") from None
        try:
            os.rename(new, self.out)
        except OSError as exc:
            os.rename(old, self.out)  # put the previous bundle back
            raise os_error(self.out, exc, "cannot rename the new bundle in") from None
        return old

    def _retire(self, old: Path, s: Survey) -> None:
        """Remove the previous bundle's own files from ``old`` (nothing else), once swapped."""
        fsync_dir(self.out.parent)
        _remove_own(old, s.own)
        _rmdir_quiet(old / "cases")
        _rmdir_quiet(old)

    def _commit_resume(self, files: Mapping[str, bytes], s: Survey) -> None:
        own = self.resume_dir
        if own is None:
            raise RefAttnError("bundle transaction: no resume directory to commit")
        for rel, data in files.items():
            self.stage(rel, data)
        bundle = own / "bundle"
        sync_filesystem(bundle)  # every staged file and directory on disk before the swap
        if s.foreign:  # beside the user's files: replaced one by one, manifest last
            staged = {rel: self.staged(rel) or b"" for rel in self.staged_names()}
            staged["manifest.json"] = self.staged("manifest.json") or b""
            self._commit_in_place(staged, s)
            self.discard_resume()
            return
        try:
            os.chmod(bundle, stat.S_IMODE(os.stat(self.out).st_mode))
        except OSError as exc:
            raise os_error(bundle, exc, "cannot set the directory's mode") from None
        self._retire(self._swap_in(bundle), s)
        self.discard_resume()

    def _commit_in_place(self, files: Mapping[str, bytes | bytearray], s: Survey) -> None:
        """Beside foreign files (``force``): each file replaced atomically, manifest last."""
        out = self.out
        cases = out / "cases"
        if not cases.exists():
            try:
                cases.mkdir()
            except OSError as exc:
                raise os_error(cases, exc, "cannot create") from None
        order = sorted(files, key=lambda rel: rel == "manifest.json")
        for rel in order:
            target = out / rel
            tmp = target.parent / f".{target.name}.{secrets.token_hex(4)}.tmp"
            write_new(tmp, files[rel])
            try:
                os.replace(tmp, target)
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                raise os_error(target, exc, "cannot rename into place") from None
            fsync_dir(target.parent)
        stale = [rel for rel in s.own if rel not in files]
        _remove_own(out, stale)
        fsync_dir(cases)
        fsync_dir(out)
