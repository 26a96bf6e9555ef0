"""Memory the system can give this process, and the refusal of work that needs more.

Owns :func:`available_bytes` (``MemAvailable`` from ``/proc/meminfo``, else ``sysconf``; None
where neither exists) and :func:`check_bytes` (refuse a piece of work whose estimated bytes
exceed it, before anything is allocated), used wherever a size comes from outside: a paged
cache's gather, a mask of claimed lengths, an unpacked batch. The dense engine's own estimate
(:func:`refattn.engine.memory.dense_bytes`) and its refusal build on the same reading.
"""

from __future__ import annotations

import os

from refattn.errors import RefAttnError

__all__ = ["available_bytes", "check_bytes"]


def available_bytes() -> int | None:
    """Memory the system can give this process now, in bytes (None: unknown).

    Linux's ``MemAvailable`` (free memory plus what the kernel can reclaim); elsewhere
    ``sysconf`` available pages; None where neither can be read.

    Examples
    --------
    >>> n = available_bytes()
    >>> n is None or n > 0
    True
    """
    try:
        with open("/proc/meminfo", "rb") as fh:
            for line in fh:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the value is in kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def check_bytes(need: int, doing: str, way_out: str = "") -> None:
    """Refuse ``doing`` when its estimated ``need`` (bytes) exceeds the memory available now
    (:func:`available_bytes`; not checked where that is unknown), before anything is
    allocated.

    Parameters
    ----------
    need : int
        The estimate, in bytes (an upper one).
    doing : str
        What would need it, for the message.
    way_out : str
        How to ask for less, appended to the message.

    Raises
    ------
    RefAttnError
        ``memory: {doing} needs about N bytes (G GiB), more than the M bytes of memory
        available; {way_out}``.

    Examples
    --------
    >>> try:
    ...     check_bytes(2**80, "gathering the keys", "read fewer tokens")
    ... except RefAttnError as exc:
    ...     print(str(exc)[:64])
    memory: gathering the keys needs about 1208925819614629174706176
    """
    limit = available_bytes()
    if limit is not None and need > limit:
        raise RefAttnError(f"memory: {doing} needs about {need} bytes ({need / 2**30:.2f} "
                           f"GiB), more than the {limit} bytes of memory available"
                           + (f"; {way_out}" if way_out else ""))
