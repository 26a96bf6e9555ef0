"""Progress bars for refattn's long loops (suite generation, verify): tqdm on standard error.

Owns the one policy every loop shares, so that a bar never reaches a log file or a pipe: with
``enabled=None`` (the default of every public function that takes ``progress=``) a bar is
drawn only when standard error is a terminal and only once the loop has run for
:data:`DELAY` seconds (short work stays silent); ``False`` (the command line's ``--quiet``)
never draws one; ``True`` always does (tests, notebooks). tqdm is imported on first use.
gradcheck's generic checker, which imports nothing from refattn, applies the same policy with
tqdm directly (:func:`gradcheck.api.check_vjp`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

__all__ = ["DELAY", "progress"]

T = TypeVar("T")

#: seconds a loop must run before its bar appears (in the automatic mode)
DELAY = 0.5


def progress(iterable: Iterable[T], *, desc: str, total: int | None = None,
             unit: str = "case", enabled: bool | None = None) -> Iterator[T] | Iterable[T]:
    """``iterable``, drawn as a progress bar on standard error when ``enabled`` allows.

    Parameters
    ----------
    iterable : iterable
    desc : str
        What the loop does, e.g. ``"golden"``; shown before the bar.
    total : int, optional
        Number of items (default ``len(iterable)`` where it has one).
    unit : str
    enabled : bool or None
        None: only on a terminal and after :data:`DELAY` seconds; False: never (the iterable
        is returned unchanged); True: always, from the first item.

    Returns
    -------
    iterable
        Yields the same items in the same order.

    Examples
    --------
    >>> list(progress(range(3), desc="demo", enabled=False))
    [0, 1, 2]
    >>> sum(progress(range(4), desc="demo"))  # not a terminal here: no bar
    6
    """
    if enabled is False:
        return iterable
    from tqdm import tqdm

    kwargs: dict[str, Any] = {"desc": desc, "total": total, "unit": unit, "file": sys.stderr,
                              "leave": False, "dynamic_ncols": True}
    if enabled is None:
        kwargs.update(disable=None, delay=DELAY)  # tqdm: disable=None -> off unless a TTY
    return tqdm(iterable, **kwargs)
