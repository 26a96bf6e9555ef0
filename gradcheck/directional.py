"""Seeded cotangents and directions for directional checks, and bisection localisation.

Owns the random streams (one per purpose, input name and round, so a check replays from its
seed and adding an input does not change another input's directions), the direction rule
(signed Gaussian, per-element scale ``max(|x|, 1)``, known null directions projected out,
rounded so central differences perturb exactly) and the bisection that turns a failing
direction into one element index. Defers the comparison itself to :mod:`gradcheck.api`.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np

from gradcheck.methods import CD_STEP, exact_direction

__all__ = ["bisect", "cotangent", "direction", "stream"]

Projector = Callable[[np.ndarray], np.ndarray]


def stream(seed: int, purpose: str, name: str = "", round_: int = 0) -> np.random.Generator:
    """The generator for one purpose ("cotangent", "direction", ...), input and round.

    Examples
    --------
    >>> a = stream(0, "direction", "q", 1).standard_normal(2)
    >>> bool((a == stream(0, "direction", "q", 1).standard_normal(2)).all())
    True
    """
    key = [int(seed), zlib.crc32(purpose.encode()), zlib.crc32(name.encode()), int(round_)]
    return np.random.default_rng(key)


def cotangent(shape: tuple[int, ...], *, seed: int, round_: int) -> np.ndarray:
    """A standard Gaussian cotangent ``v`` of the output's shape.

    Examples
    --------
    >>> cotangent((2, 3), seed=0, round_=0).shape
    (2, 3)
    """
    return stream(seed, "cotangent", "", round_).standard_normal(shape)


def direction(
    x: np.ndarray,
    *,
    seed: int,
    name: str,
    round_: int,
    null_projector: Projector | None = None,
    step: float = CD_STEP,
    levels: int = 3,
    exact: bool = True,
) -> np.ndarray:
    """A signed Gaussian direction for input ``x``, free of its known null directions.

    ``w = u * max(|x|, 1)`` with ``u`` standard normal (signed: never concentrated on the
    all-ones direction the way non-negative uniform directions are), minus its projection on
    the declared null space, then (``exact=True``, needed by central differences only)
    rounded by :func:`~gradcheck.methods.exact_direction`.

    Parameters
    ----------
    x : (...) float64 ndarray
    seed, name, round_
        Select the stream.
    null_projector : callable, optional
        ``P(w)``: the component of ``w`` along directions in which the function is constant.
    step, levels
        Central-difference settings the direction must be exact for.
    exact : bool
        Round for exact central-difference steps (complex step does not need it).

    Returns
    -------
    (...) float64 ndarray

    Examples
    --------
    >>> x = np.zeros((2, 3))
    >>> w = direction(x, seed=0, name="k", round_=0,
    ...               null_projector=lambda a: a.mean(axis=0, keepdims=True) + 0 * a)
    >>> bool(np.abs(w.sum(axis=0)).max() < 1e-12)
    True
    """
    u = stream(seed, "direction", name, round_).standard_normal(x.shape)
    raw = u * np.maximum(np.abs(x), 1.0)
    if null_projector is not None:
        raw = raw - np.broadcast_to(null_projector(raw), raw.shape)
    return exact_direction(x, raw, step=step, levels=levels) if exact else raw


def bisect(
    g: np.ndarray,
    w: np.ndarray,
    discrepancy: float,
    numeric: Callable[[np.ndarray], float],
) -> tuple[tuple[int, ...], int]:
    """Localise a directional discrepancy to one element by bisection over ``w``'s support.

    The discrepancy ``d(S) = <g, w_S> - <v, J w_S>`` is linear in the restricted direction
    ``w_S``; each step evaluates one half and keeps the half with the larger ``|d|``.

    Parameters
    ----------
    g : (...) ndarray
        Analytic gradient.
    w : (...) ndarray
        The failing direction.
    discrepancy : float
        ``d`` over the whole direction.
    numeric : callable
        ``numeric(w_S) -> <v, J w_S>`` (one numeric directional derivative).

    Returns
    -------
    (index, evaluations) : tuple
        The element's full index and the number of ``numeric`` calls.

    Examples
    --------
    >>> g = np.array([1.0, 2.0, 3.0, 4.5]); w = np.ones(4)
    >>> bisect(g, w, 0.5, lambda ws: float(np.array([1.0, 2.0, 3.0, 4.0]) @ ws))
    ((3,), 2)
    """
    gf, wf = g.ravel(), w.ravel()
    lo, hi, d, calls = 0, wf.size, float(discrepancy), 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        sub = np.zeros_like(wf)
        sub[lo:mid] = wf[lo:mid]
        d1 = float(gf[lo:mid] @ wf[lo:mid]) - numeric(sub.reshape(w.shape))
        calls += 1
        d2 = d - d1
        if abs(d1) >= abs(d2):
            hi, d = mid, d1
        else:
            lo, d = mid, d2
    index = tuple(int(i) for i in np.unravel_index(lo, w.shape))
    return index, calls
