"""The boundary of a public API: every argument's kind checked before any work.

Owns :func:`boundary`, which makes the decorator of refattn's and gradcheck's public functions
and constructors for the package's own error type (``refattn._boundary.public`` raises
``RefAttnError``, ``gradcheck.errors.public`` ``GradcheckError``; this module imports neither
package): the arguments are bound to the signature and each is checked against its annotation (a
bool for ``bool``; an integer below :data:`INT_LIMIT` in magnitude for ``int``; a real number a
float64 can hold for ``float``, finite unless the annotation admits :data:`Infinite`; a string
for ``str``; one of the choices of a ``Literal``; an array of numbers for ``np.ndarray``, never
a ragged list; an instance for a class, a ``Mapping``, a ``Sequence`` (and each element, where
it names a type), a path; each member of a fixed-length ``tuple``; any member of a union). A
mismatch is the package's error naming the function, the parameter, what it expects and what it
got (a 5,000-digit integer or a huge array described, never printed), so a stranger's ``None``,
``2**70``, ``NaN`` or ragged list never reaches the code as a ``TypeError``, an
``AttributeError`` or a wrong answer. Annotations that say nothing (``Any``, ``object``) are not
checked here: the function checks those itself. Ranges (a length below 2**31, a positive step)
are the function's own checks, with :mod:`refattn._checks`'s helpers. Also owns :func:`shown`,
the bounded text of any value for a message. Imports the standard library only (numpy where an
array-like is judged). """

from __future__ import annotations

import collections.abc
import functools
import inspect
import math
import numbers
import os
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["Infinite", "boundary", "int_text", "shown"]

F = TypeVar("F", bound=Callable[..., Any])


#: no integer argument reaches a function at or beyond this magnitude (a 128-bit counter is the
#: widest integer refattn has; a 5,000-digit one cannot even be printed)
INT_LIMIT = 2**128


class Infinite(float):
    """Annotation marker (``float | Infinite``): this float parameter may be +-inf."""


def int_text(n: int) -> str:
    """An integer for a message: as written below 10**20, else as a power of two (``2**70``,
    ``2**63 - 1``) or its size in bits (a 4301-digit integer cannot even be printed).

    Examples
    --------
    >>> int_text(12), int_text(2**70), int_text(-(2**63)), int_text(10**400)
    ('12', '2**70', '-2**63', 'an integer of 1329 bits (about 10**400)')
    """
    sign, m = ("-", -n) if n < 0 else ("", n)
    k = m.bit_length()
    if k > 31 and m == 1 << (k - 1):
        return f"{sign}2**{k - 1}"
    if k > 31 and m == (1 << k) - 1:
        return f"{sign}(2**{k} - 1)" if sign else f"2**{k} - 1"
    if m < 10**20:
        return str(n)
    return f"{sign}an integer of {k} bits (about 10**{int(k * math.log10(2))})"


def shown(value: Any, limit: int = 60) -> str:
    """A short, always computable description of ``value`` for an error message.

    Examples
    --------
    >>> shown(7 * 10**4999)
    'an integer of 16610 bits (about 10**5000)'
    >>> import numpy as np
    >>> shown(np.zeros((2, 3), np.float32)), shown("x" * 100)[-5:], shown(None)
    ('a float32 array of shape (2, 3)', 'xx...', 'None')
    """
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        return int_text(value)
    dtype, shape = getattr(value, "dtype", None), getattr(value, "shape", None)
    if dtype is not None and shape is not None and getattr(value, "ndim", 0) > 0:
        return f"{_article(str(dtype))} array of shape {tuple(shape)}"
    try:
        text = repr(value)
    except Exception:  # a value whose repr fails: named by its type
        text = f"a {type(value).__name__}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _expected(hint: Any) -> str:
    """The annotation in words."""
    origin = typing.get_origin(hint)
    if hint is bool:
        return "True or False"
    if hint is int:
        return "an integer below 2**128 in magnitude"
    if hint is float:
        return "a finite real number"
    if hint is Infinite:
        return "+-inf"
    if hint is str:
        return "a string"
    if hint is type(None):
        return "None"
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_expected(a) for a in typing.get_args(hint))
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a tuple of {_expected(args[0]).removeprefix('a ').removeprefix('an ')}s"
        return f"a tuple of {len(args)}" if len(args) != 2 else "a pair (a tuple or list of 2)"
    if isinstance(hint, type) and hint.__name__ == "ndarray":
        return "an array (of numbers: no ragged nested sequence)"
    if isinstance(origin, type):
        return _article(origin.__name__)
    if isinstance(hint, type):
        return _article(hint.__name__)
    return str(hint)


def _article(name: str) -> str:
    """``a Mapping``, ``an AttentionCall``."""
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _fits(value: Any, hint: Any) -> bool | None:
    """Whether ``value`` is of the annotated kind (None: the annotation says nothing)."""
    if hint is Any or hint is object or isinstance(hint, TypeVar):
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        verdicts = [_fits(value, a) for a in typing.get_args(hint)]
        return None if None in verdicts and not any(verdicts) else any(v for v in verdicts)
    if origin is typing.Literal:  # the type first: an array never meets ``==``
        return any(type(value) is type(a) and value == a for a in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool) or type(value).__name__ == "bool_"
    if hint is int:
        return (isinstance(value, numbers.Integral) and not isinstance(value, bool)
                and -INT_LIMIT < int(value) < INT_LIMIT)
    if hint is Infinite:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and (
            isinstance(value, float) or hasattr(value, "dtype")) and math.isinf(float(value))
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return False
        try:
            return math.isfinite(float(value))
        except OverflowError:  # an integer beyond float64's range
            return False
    if hint is str:
        return isinstance(value, str)
    if origin is tuple:  # a fixed-length tuple: any tuple or list of that length (a pair)
        args = typing.get_args(hint)
        if not isinstance(value, (tuple, list)) or (
                isinstance(value, list) and len(args) == 2 and args[1] is Ellipsis):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(v, args[0]) is not False for v in value)
        return len(value) == len(args) and all(
            _fits(v, a) is not False for v, a in zip(value, args, strict=True))
    if origin is not None:  # Mapping[...], Sequence[...], Callable[...], list[...], ...
        if origin is collections.abc.Callable:
            return callable(value)
        if not isinstance(origin, type):
            return None
        if not isinstance(value, origin):
            return False
        args = typing.get_args(hint)
        if (issubclass(origin, (collections.abc.Sequence, collections.abc.Set))
                and not isinstance(value, str) and len(args) == 1
                and isinstance(value, (list, tuple, set, frozenset))):
            return all(_fits(v, args[0]) is not False for v in value)  # what it holds
        return True
    if hint is os.PathLike:
        return isinstance(value, os.PathLike)
    if isinstance(hint, type):
        if hint.__module__ == "numpy":
            return _array_like(value) if hint.__name__ == "ndarray" else None
        return isinstance(value, hint)
    return None


def _culprit(value: Any, hint: Any) -> tuple[str, Any, Any]:
    """Where a value that does not fit ``hint`` fails: ``("[1]", member, its hint)`` for a
    member of a tuple or sequence that is itself of the right kind, else ``("", value, hint)``.
    """
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # the member whose container type matches
        for arg in typing.get_args(hint):
            container = typing.get_origin(arg)
            if container is tuple:
                variadic = len(typing.get_args(arg)) == 2 and typing.get_args(arg)[1] is Ellipsis
                if isinstance(value, tuple) or (isinstance(value, list) and not variadic):
                    return _culprit(value, arg)
            elif isinstance(container, type) and issubclass(
                    container, collections.abc.Sequence) and isinstance(value, container):
                return _culprit(value, arg)
        return "", value, hint
    args = typing.get_args(hint)
    if origin is tuple and isinstance(value, (tuple, list)):
        if len(args) == 2 and args[1] is Ellipsis:
            members = [(i, v, args[0]) for i, v in enumerate(value)]
        elif len(value) == len(args):
            members = [(i, v, a) for i, (v, a) in enumerate(zip(value, args, strict=True))]
        else:
            return "", value, hint
    elif (isinstance(origin, type) and issubclass(origin, collections.abc.Sequence)
          and len(args) == 1 and isinstance(value, (list, tuple))):
        members = [(i, v, args[0]) for i, v in enumerate(value)]
    else:
        return "", value, hint
    for i, v, a in members:
        if _fits(v, a) is False:
            where, member, member_hint = _culprit(v, a)
            return f"[{i}]{where}", member, member_hint
    return "", value, hint


def _array_like(value: Any) -> bool:
    """An array, a number, or nested lists of numbers of one shape (what ``np.asarray`` turns
    into a numeric array); never a ragged list or an object array."""
    if getattr(value, "dtype", None) is not None and hasattr(value, "shape"):
        return getattr(value.dtype, "kind", "O") != "O"
    if isinstance(value, bool) or isinstance(value, numbers.Number):
        return not (isinstance(value, int) and abs(value) >= 2**64)
    if not isinstance(value, (list, tuple)):
        return False
    import numpy as np  # only here: this module stays importable without it

    try:
        return np.asarray(value).dtype.kind in "biuf"
    except (ValueError, TypeError, OverflowError):
        return False


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """The annotations of ``fn`` resolved; one that cannot be (a name imported only for type
    checkers) is left out, and the function checks that argument itself."""
    try:
        return typing.get_type_hints(fn)
    except Exception:  # resolved one by one below
        pass
    out = {}
    for name, annotation in getattr(fn, "__annotations__", {}).items():
        try:
            out[name] = (eval(annotation, getattr(fn, "__globals__", {}))  # our own source
                         if isinstance(annotation, str) else annotation)
        except Exception:  # a name only a type checker imports
            continue
    return out


def boundary(error: type[Exception]) -> Callable[[F], F]:
    """The decorator that checks every argument of a function (or a class's constructor)
    against its annotation before it runs, raising ``error``.

    A wrong number of arguments, an unknown keyword, or an argument of the wrong kind is an
    ``error`` (``function: parameter: expected ..., got ...``).

    Examples
    --------
    >>> public = boundary(ValueError)
    >>> @public
    ... def scaled(x: float, *, times: int = 2) -> float:
    ...     return x * times
    >>> scaled(1.5)
    3.0
    >>> scaled(float("nan"))
    Traceback (most recent call last):
    ValueError: scaled: x: expected a finite real number, got nan
    >>> scaled(1.0, times=2**70 + 0.5)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: scaled: times: expected an integer below 2**128 in magnitude, got 1.18...e+21
    """

    def public(fn: F) -> F:
        if inspect.isclass(fn):  # a class: its constructor checked, the class kept as it is
            fn.__init__ = public(fn.__init__)  # type: ignore[misc]
            return fn
        signature = inspect.signature(fn)
        name = getattr(fn, "__qualname__", getattr(fn, "__name__", "function"))
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        hints: dict[str, Any] | None = None

        @functools.wraps(fn)
        def checked(*args: Any, **kwargs: Any) -> Any:
            nonlocal hints
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError as exc:
                raise error(f"{name}: {exc}") from None
            if hints is None:
                hints = _hints(fn)
            for param, value in bound.arguments.items():
                hint = hints.get(param)
                kind = signature.parameters[param].kind
                if hint is None or kind in (kind.VAR_POSITIONAL, kind.VAR_KEYWORD):
                    continue
                if _fits(value, hint) is False:
                    where, member, member_hint = _culprit(value, hint)
                    raise error(f"{name}: {param}{where}: expected {_expected(member_hint)}, "
                                f"got {shown(member)}")
            return fn(*args, **kwargs)

        return typing.cast(F, checked)

    return public
