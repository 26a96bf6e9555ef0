"""File-system primitives of a bundle: confined reads, durable writes, the writer's lock.

A bundle is untrusted input and its directory belongs to a user, so every file operation of
the bundle package goes through here. Owns :func:`check_relative` (a manifest path is a plain
relative path inside the bundle), :func:`read_confined` (open such a path component by
component from the bundle's directory without following any link, open only regular files,
check the size before reading: a FIFO or device never blocks and is never read),
:func:`read_regular` (the same checks for a path the user named; both read into one buffer of
the file's size, after an optional look at the header), :func:`open_confined` (the confined
descriptor itself, for readers that check a header and hash in pieces before reading),
:func:`list_confined` (a bundle directory's entries, never through a link), :func:`write_new` and
:func:`fsync_dir` (files and directories reach the disk before a rename publishes them;
:func:`sync_filesystem` flushes a whole staging tree at once),
:func:`exchange` (two directories swapped by one ``renameat2(RENAME_EXCHANGE)``) and
:class:`DirectoryLock` (an ``flock`` on the bundle directory itself: the kernel releases it
when the writer dies, and there is no lock file to leave behind or to redirect with a link).
Every ``OSError`` becomes a :class:`~refattn.errors.RefAttnError` naming the path. Knows nothing
of manifests or cases.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from refattn.errors import RefAttnError

__all__ = ["MAX_CASE_BYTES", "MAX_MANIFEST_BYTES", "DirectoryLock", "check_relative",
           "exchange", "fsync_dir", "list_confined", "open_confined", "os_error", "read_confined",
           "read_fd",
           "read_regular",
           "sync_filesystem", "write_new"]

#: the largest manifest.json read (bytes); checked with fstat before reading
MAX_MANIFEST_BYTES = 64 * 2**20
#: the largest case file read (bytes) when its manifest entry gives no tighter bound
MAX_CASE_BYTES = 4 * 2**30

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_NOCTTY = getattr(os, "O_NOCTTY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: the most bytes one ``readv`` asks for (Linux returns at most about 2 GiB a call anyway)
_READ_STEP = 1 << 30


def os_error(path: str | os.PathLike, exc: OSError, doing: str) -> RefAttnError:
    """A one-line :class:`RefAttnError` for an ``OSError`` on ``path``.

    Examples
    --------
    >>> str(os_error("out/manifest.json", OSError(errno.ENOSPC, "No space left on device"),
    ...              "cannot write"))
    'out/manifest.json: cannot write (No space left on device)'
    """
    reason = exc.strerror or str(exc) or type(exc).__name__
    return RefAttnError(f"{path}: {doing} ({reason})")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def check_relative(rel: Any, *, what: str = "file") -> tuple[str, ...]:
    """The components of a manifest path that must stay inside the bundle.

    A plain relative POSIX path: no leading ``/``, no ``..`` or ``.`` component, no empty
    component, no backslash or NUL. Returns its components.

    Raises
    ------
    RefAttnError
        Naming the path and why it is refused.

    Examples
    --------
    >>> check_relative("cases/a.safetensors")
    ('cases', 'a.safetensors')
    >>> check_relative("../etc/passwd")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    refattn.errors.RefAttnError: file: '../etc/passwd' leaves the bundle ('..' component); ...
    """
    hint = "expected a relative path inside the bundle such as 'cases/<case_id>.safetensors'"
    if not isinstance(rel, str) or not rel:
        raise RefAttnError(f"{what}: {rel!r} is not a path; {hint}")
    if "\\" in rel or "\x00" in rel:
        raise RefAttnError(f"{what}: {rel!r} contains a backslash or NUL; {hint}")
    if rel.startswith("/") or PurePosixPath(rel).is_absolute():
        raise RefAttnError(f"{what}: {rel!r} is an absolute path; {hint}")
    parts = tuple(rel.split("/"))
    for part in parts:
        if part == "..":
            raise RefAttnError(f"{what}: {rel!r} leaves the bundle ('..' component); {hint}")
        if part in ("", "."):
            raise RefAttnError(f"{what}: {rel!r} has an empty or '.' component; {hint}")
    return parts


def read_fd(fd: int, shown: str, max_bytes: int,
             inspect: Callable[[int, int], None] | None = None) -> bytearray:
    """Read a regular file's descriptor whole into one buffer of its size, refusing anything
    else or anything too big.

    ``inspect(fd, size)`` runs after the size check and before the buffer is allocated (a
    reader checks a file's header and declared sizes there, with ``os.pread``). The bytes go
    straight into one ``bytearray`` of the file's ``fstat`` size (``readv``, no chunks joined
    afterwards), so the peak is the file's size once.
    """
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise RefAttnError(f"{shown}: is {_kind(st.st_mode)}; only regular files are read")
    size = st.st_size
    if size > max_bytes:
        raise RefAttnError(f"{shown}: {size} bytes exceeds the limit of {max_bytes} "
                           "bytes for this file")
    if inspect is not None:
        inspect(fd, size)
    try:
        buf = bytearray(size)
    except MemoryError:
        raise RefAttnError(f"{shown}: cannot hold its {size} bytes in memory") from None
    view, got = memoryview(buf), 0
    while got < size:
        n = os.readv(fd, [view[got : got + _READ_STEP]])
        if n == 0:
            raise RefAttnError(f"{shown}: shrank from {size} to {got} bytes while read")
        got += n
    view.release()
    if os.read(fd, 1):
        raise RefAttnError(f"{shown}: grew past its {size} bytes while read")
    return buf


def read_regular(path: str | os.PathLike, *, max_bytes: int, what: str = "file",
                 inspect: Callable[[int, int], None] | None = None) -> bytearray:
    """Read a file the user named: a regular file (links followed), at most ``max_bytes``.

    A FIFO, device or directory is refused without blocking (the file is opened
    non-blocking and checked with ``fstat`` before any read). ``inspect(fd, size)`` runs
    before the buffer is allocated (see :func:`read_fd`); the bytes come back in one
    ``bytearray`` of the file's size.

    Examples
    --------
    >>> read_regular("/dev/null", max_bytes=10)
    Traceback (most recent call last):
        ...
    refattn.errors.RefAttnError: /dev/null: is a character device; only regular files are read
    """
    try:
        fd = os.open(path, os.O_RDONLY | _NONBLOCK | _NOCTTY | _CLOEXEC)
    except OSError as exc:
        raise os_error(path, exc, f"cannot read the {what}") from None
    try:
        return read_fd(fd, str(path), max_bytes, inspect)
    except OSError as exc:
        raise os_error(path, exc, f"cannot read the {what}") from None
    finally:
        os.close(fd)


@contextlib.contextmanager
def open_confined(root: str | os.PathLike, rel: Any, *, max_bytes: int,
                  what: str = "file") -> Iterator[tuple[int, int]]:
    """Open ``root/rel`` as :func:`read_confined` does (no link followed below ``root``, a
    regular file of at most ``max_bytes``) and yield ``(fd, size)`` without reading it: a
    reader checks the header and hashes the file in pieces with ``os.pread``.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "a").write_bytes(b"12345")
    >>> with open_confined(d, "a", max_bytes=100) as (fd, size):
    ...     size, os.pread(fd, 2, 3)
    (5, b'45')
    """
    parts = check_relative(rel, what=what)
    shown = "/".join(parts)
    with _confined_fds(root, parts, _NONBLOCK | _NOCTTY, f"cannot read the {what}") as fd:
        try:
            st = os.fstat(fd)
        except OSError as exc:
            raise os_error(shown, exc, f"cannot read the {what}") from None
        if not stat.S_ISREG(st.st_mode):
            raise RefAttnError(f"{shown}: is {_kind(st.st_mode)}; only regular files are read")
        if st.st_size > max_bytes:
            raise RefAttnError(f"{shown}: {st.st_size} bytes exceeds the limit of {max_bytes} "
                               "bytes for this file")
        yield fd, st.st_size


@contextlib.contextmanager
def _confined_fds(root: str | os.PathLike, parts: Sequence[str], last_flags: int,
                  failure: str, *, missing_ok: bool = False) -> Iterator[int]:
    """Open ``root``, then each of ``parts`` relative to its parent with ``O_NOFOLLOW``
    (the last with ``last_flags``, the others as directories); yield the last descriptor and
    close them all. A link anywhere below ``root`` is a :class:`RefAttnError` naming only the
    path inside the bundle; any other failure is one naming that path and ``failure``, a
    missing component included unless ``missing_ok`` (then ``FileNotFoundError`` passes
    through for the caller)."""
    fds: list[int] = []
    try:
        try:
            fds.append(os.open(root, os.O_RDONLY | _DIRECTORY | _CLOEXEC))
        except OSError as exc:
            raise os_error(root, exc, "cannot open the bundle directory") from None
        for i, part in enumerate(parts):
            flags = os.O_RDONLY | _NOFOLLOW | _CLOEXEC | (
                last_flags if i == len(parts) - 1 else _DIRECTORY)
            where = "/".join(parts[: i + 1])
            try:
                fds.append(os.open(part, flags, dir_fd=fds[-1]))
            except OSError as exc:
                if missing_ok and isinstance(exc, FileNotFoundError):
                    raise
                if exc.errno in (errno.ELOOP, errno.EMLINK) or _is_link(fds[-1], part):
                    raise RefAttnError(
                        f"{where}: is a symbolic link; links inside a bundle are not "
                        "followed (a bundle is read only from its own directory)") from None
                raise os_error(where, exc, failure) from None
        yield fds[-1]
    finally:
        for fd in reversed(fds):
            os.close(fd)


def read_confined(root: str | os.PathLike, rel: Any, *, max_bytes: int,
                  what: str = "file",
                  inspect: Callable[[int, int], None] | None = None) -> bytearray:
    """Read ``root/rel`` without leaving ``root``: every component opened relative to its
    parent with ``O_NOFOLLOW`` (a symbolic link anywhere below ``root`` is refused), the
    last one non-blocking and only if it is a regular file of at most ``max_bytes``.

    Parameters
    ----------
    root : path
        The bundle directory (the user's choice: a link to it is followed).
    rel : str
        A manifest path, checked by :func:`check_relative`.
    max_bytes : int
        The largest file read; checked with ``fstat`` before reading.
    inspect : callable, optional
        ``inspect(fd, size)``, run before the buffer is allocated.

    Returns
    -------
    bytearray
        The file's bytes, read into one buffer of its size.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); (d / "cases").mkdir()
    >>> _ = (d / "cases" / "a.safetensors").write_bytes(b"12345")
    >>> bytes(read_confined(d, "cases/a.safetensors", max_bytes=100))
    b'12345'
    >>> (d / "cases" / "l.safetensors").symlink_to("/etc/hostname")
    >>> read_confined(d, "cases/l.safetensors", max_bytes=100)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    refattn.errors.RefAttnError: cases/l.safetensors: is a symbolic link; ...
    """
    with open_confined(root, rel, max_bytes=max_bytes, what=what) as (fd, _):
        shown = "/".join(check_relative(rel, what=what))
        try:
            return read_fd(fd, shown, max_bytes, inspect)
        except OSError as exc:
            raise os_error(shown, exc, f"cannot read the {what}") from None


def list_confined(root: str | os.PathLike, rel: str) -> list[tuple[str, int]] | None:
    """The entries of the directory ``root/rel`` as ``(name, st_mode)`` (links not
    followed), sorted by name; None when it does not exist.

    ``rel`` itself is opened with ``O_NOFOLLOW``: a link there (to a system directory, say)
    is refused, so no name from outside the bundle is ever listed.

    Raises
    ------
    RefAttnError
        When ``rel`` is a symbolic link or not a directory, naming only ``rel``.

    Examples
    --------
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp()); (d / "cases").mkdir()
    >>> _ = (d / "cases" / "a").write_bytes(b"")
    >>> [name for name, _ in list_confined(d, "cases")]
    ['a']
    >>> (d / "other").symlink_to("/etc")
    >>> list_confined(d, "other")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    refattn.errors.RefAttnError: other: is a symbolic link; ...
    """
    parts = check_relative(rel, what="directory")
    try:
        with _confined_fds(root, parts, _DIRECTORY, "cannot list the directory",
                           missing_ok=True) as fd:
            try:
                names = os.listdir(fd)
                return sorted((n, os.lstat(n, dir_fd=fd).st_mode) for n in names)
            except OSError as exc:
                raise os_error("/".join(parts), exc, "cannot list the directory") from None
    except FileNotFoundError:
        return None


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def write_new(path: Path, data: bytes | bytearray, *, mode: int = 0o644, sync: bool = True) -> None:
    """Create ``path`` (which must not exist; links are not followed), write ``data`` and
    fsync it (``sync=False``: leave that to a later :func:`sync_filesystem`). Any failure (a
    full disk, a read-only directory) removes the partial file and raises a
    :class:`RefAttnError` naming the path."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)
    except OSError as exc:
        raise os_error(path, exc, "cannot create") from None
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        if sync:
            os.fsync(fd)
    except OSError as exc:
        os.close(fd)
        Path(path).unlink(missing_ok=True)  # our own partial file
        raise os_error(path, exc, "cannot write") from None
    os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory, so that the names created or renamed in it are on disk."""
    try:
        fd = os.open(path, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    except OSError as exc:
        raise os_error(path, exc, "cannot open the directory to sync it") from None
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):  # some file systems cannot
            raise os_error(path, exc, "cannot sync the directory") from None
    finally:
        os.close(fd)


def sync_filesystem(root: str | os.PathLike) -> None:
    """Flush every file written under ``root`` to disk: one ``syncfs`` of its file system
    (Linux), else an fsync of every regular file and directory below it (links not followed).
    """
    fn = _libc_function("syncfs", [ctypes.c_int])
    try:
        fd = os.open(root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    except OSError as exc:
        raise os_error(root, exc, "cannot open the directory to sync it") from None
    try:
        if fn is not None and fn(fd) == 0:
            return
    finally:
        os.close(fd)
    for here, dirs, files in os.walk(os.fspath(root)):
        for name in files:
            path = os.path.join(here, name)
            if not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            try:
                fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
            except OSError as exc:
                raise os_error(path, exc, "cannot open the file to sync it") from None
            try:
                os.fsync(fd)
            except OSError as exc:
                raise os_error(path, exc, "cannot sync") from None
            finally:
                os.close(fd)
        fsync_dir(here)
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(here, d))]


def _libc_function(name: str, argtypes: list[Any]) -> Any:
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True), name)
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                   ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap two directory entries atomically (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns False where the system or file system cannot (the caller then falls back to
    two renames); raises a :class:`RefAttnError` on any other failure.
    """
    fn = _renameat2()
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise os_error(b, OSError(err, os.strerror(err)), "cannot swap the new bundle in")


class DirectoryLock:
    """An exclusive, non-blocking ``flock`` on a directory (the bundle being written).

    The lock belongs to the directory's inode, not to a lock file: nothing is left behind,
    a link cannot redirect it (the directory is opened with ``O_NOFOLLOW``), and the kernel
    drops it when the holder exits or is killed. A second writer is refused at once.

    Examples
    --------
    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> with DirectoryLock(d):
    ...     try:
    ...         DirectoryLock(d).__enter__()
    ...     except RefAttnError as exc:
    ...         print(str(exc).split(";")[0].endswith("is being written by another process"))
    True
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.fd: int | None = None

    def __enter__(self) -> DirectoryLock:
        import fcntl  # POSIX; refattn's bundles are written on Linux and macOS

        for _ in range(5):  # the directory may be swapped while we open it: re-check
            try:
                fd = os.open(self.path, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
            except OSError as exc:
                raise os_error(self.path, exc, "cannot open the bundle directory to lock "
                               "it") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise RefAttnError(
                        f"{self.path}: is being written by another process; another "
                        "'refattn golden' holds this bundle's lock (wait for it to finish, "
                        "or write to another directory)") from None
                raise os_error(self.path, exc, "cannot lock the bundle directory") from None
            try:
                same = os.fstat(fd).st_ino == os.lstat(self.path).st_ino
            except OSError:
                same = False
            if same:
                self.fd = fd
                return self
            os.close(fd)
        raise RefAttnError(f"{self.path}: keeps changing while it is locked; is another "
                           "program replacing it?")

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor releases the flock
            self.fd = None
