"""The boundary of refattn's public API: every argument's kind checked before any work.

Owns :func:`public`, the decorator of refattn's public functions and constructors
(:func:`gradcheck._boundary.boundary` bound to :class:`RefAttnError`): the arguments are bound
to the signature and each is checked against its annotation (a bool for ``bool``; an integer
below 2**128 for ``int``; a real number a float64 can hold for ``float``, finite unless the
annotation admits :data:`Infinite`; a string for ``str``; one of the choices of a ``Literal``;
an array of numbers for ``np.ndarray``, never a ragged list; an instance for a class, a
``Mapping``, a ``Sequence`` (and each element, where it names a type), a path; each member of a
fixed-length ``tuple``; any member of a union). A mismatch is a :class:`RefAttnError` naming the
function, the parameter, what it expects and what it got (a 5,000-digit integer or a huge array
described, never printed). Annotations that say nothing (``Any``, ``object``) are not checked
here: the function checks those itself. (foundation: imports refattn.errors and gradcheck's
boundary, which imports the standard library only)

Examples
--------
>>> @public
... def twice(x: float) -> float:
...     return 2 * x
>>> twice(2**2000)
Traceback (most recent call last):
refattn.errors.RefAttnError: twice: x: expected a finite real number, got 2**2000
"""

from __future__ import annotations

from gradcheck._boundary import Infinite, boundary, shown
from refattn.errors import RefAttnError

__all__ = ["Infinite", "public", "shown"]

#: the decorator of refattn's public functions and constructors
public = boundary(RefAttnError)
