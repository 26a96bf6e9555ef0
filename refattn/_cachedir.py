"""Where refattn keeps what it learns about this machine and user: one directory.

Owns :func:`cache_dir`: ``$REFATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/refattn``, else
``~/.cache/refattn``. The calibration of the CPU path and the records of verified bundles live
there; nothing in it comes from a bundle or any other input. (foundation)
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """The directory of refattn's per-user cache (not created here).

    Examples
    --------
    >>> import os
    >>> from unittest import mock
    >>> with mock.patch.dict(os.environ, {"REFATTN_CACHE_DIR": "/tmp/refattn-example-cache"}):
    ...     str(cache_dir())
    '/tmp/refattn-example-cache'
    """
    root = os.environ.get("REFATTN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "refattn")
    return Path(root)
