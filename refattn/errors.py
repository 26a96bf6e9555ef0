"""The one exception type of refattn (and its warning category).

Helpers raise short facts; public entry points add the call's context.
"""

from __future__ import annotations

__all__ = ["RefAttnError", "RefAttnWarning"]


class RefAttnError(ValueError):
    """Invalid input or state for a refattn operation.

    Messages name the tensor, the offending index or axis and what was expected, e.g.
    ``visible: row (b=0, h=1, i=3) has no legal key under policy 'reject'``.

    Examples
    --------
    >>> issubclass(RefAttnError, ValueError)
    True
    """


class RefAttnWarning(UserWarning):
    """A warning issued by refattn itself (turned into an error in refattn's tests)."""
