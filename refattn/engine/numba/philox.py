"""Philox4x32-10 and the attention-dropout mapping inside numba kernels.

Owns an ``@njit`` port of :func:`refattn.dropout.philox.philox4x32_10` (pure uint64-held 32-bit
integer arithmetic, no floating point) and of the ``refattn-philox-dropout-v1`` mapping of
:mod:`refattn.dropout`, so the streaming backward regenerates the exact multiplier of any tile from
its coordinates. Defers the definition of the mapping (and its validation of p, seed and offset) to
:class:`refattn.dropout.Philox`; tests pin this port to it bit for bit and to the Random123
known-answer vectors.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import prange

from refattn.engine.numba._jit import kernel

__all__ = ["PhiloxParams", "philox4x32_10", "philox_fill", "philox_params", "philox_row"]

_M0 = np.uint64(0xD2511F53)
_M1 = np.uint64(0xCD9E8D57)
_W0 = np.uint64(0x9E3779B9)
_W1 = np.uint64(0xBB67AE85)
_MASK = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


class PhiloxParams(NamedTuple):
    """The integers and the float a kernel needs to regenerate Z by coordinates."""

    key0: np.uint64
    key1: np.uint64
    offset: np.uint64
    threshold: np.uint64
    keep_multiplier: float


def philox_params(stream: object) -> PhiloxParams:
    """Kernel parameters of a :class:`refattn.dropout.Philox` stream.

    Examples
    --------
    >>> from refattn.dropout import Philox
    >>> philox_params(Philox(0.25, seed=2**32 + 7, offset=3))[:4]
    (np.uint64(7), np.uint64(1), np.uint64(3), np.uint64(1073741824))
    """
    seed = int(stream.seed)
    return PhiloxParams(
        np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32), np.uint64(stream.offset),
        np.uint64(stream.threshold), float(stream.keep_multiplier),
    )


@kernel(inline="always")
def _block(c0, c1, c2, c3, k0, k1):
    """One Philox4x32-10 block; words held in uint64, each < 2**32."""
    for r in range(10):
        if r > 0:  # the key is bumped between rounds (round 1 uses the key as given)
            k0 = (k0 + _W0) & _MASK
            k1 = (k1 + _W1) & _MASK
        p0 = _M0 * c0  # < 2**64: exact
        p1 = _M1 * c2
        c0, c1, c2, c3 = ((p1 >> _S32) ^ c1 ^ k0, p1 & _MASK, (p0 >> _S32) ^ c3 ^ k1,
                          p0 & _MASK)
    return c0, c1, c2, c3


@kernel
def philox4x32_10(counter, key):
    """Philox4x32-10 of one (4,) uint32 counter and (2,) uint32 key (numba port).

    Examples
    --------
    >>> out = philox4x32_10(np.zeros(4, np.uint32), np.zeros(2, np.uint32))
    >>> [f"{w:08x}" for w in out]
    ['6627e8d5', 'e169c58d', 'bc57ac4c', '9b00dbd8']
    """
    c = _block(np.uint64(counter[0]), np.uint64(counter[1]), np.uint64(counter[2]),
               np.uint64(counter[3]), np.uint64(key[0]), np.uint64(key[1]))
    out = np.empty(4, np.uint32)
    out[0] = np.uint32(c[0])
    out[1] = np.uint32(c[1])
    out[2] = np.uint32(c[2])
    out[3] = np.uint32(c[3])
    return out


@kernel
def philox_row(z, bh, i, j0, n, k0, k1, offset, threshold, keep):
    """``z[:n]`` = Z of keys ``[j0, j0 + n)`` of query row ``i`` in flat head ``bh = b*Hq + h``.

    Z is ``keep`` where the word is ``>= threshold`` and ``0.0`` elsewhere (integer compare).
    """
    ci = np.uint64(i)
    cbh = np.uint64(bh)
    g0 = j0 >> 2
    g1 = (j0 + n + 3) >> 2
    for g in range(g0, g1):
        w0, w1, w2, w3 = _block(np.uint64(g), ci, cbh, offset, k0, k1)
        base = 4 * g - j0
        for w in range(4):
            t = base + w
            if 0 <= t < n:
                word = w0 if w == 0 else (w1 if w == 1 else (w2 if w == 2 else w3))
                z[t] = keep if word >= threshold else 0.0


@kernel(parallel=True)
def philox_fill(z, k0, k1, offset, threshold, keep):
    """Fill a (B, Hq, Q, K) float64 array with the whole call's multiplier, rows in parallel.

    Examples
    --------
    >>> from refattn.dropout import Philox
    >>> s = Philox(0.5, seed=11)
    >>> z = np.empty((1, 2, 3, 9))
    >>> philox_fill(z, *philox_params(s))
    >>> bool((z == s.multiplier(1, 2, 3, 9)).all())
    True
    """
    B, H, Q, K = z.shape
    for row in prange(B * H * Q):
        bh = row // Q
        i = row - bh * Q
        philox_row(z[bh // H, bh % H, i], bh, i, 0, K, k0, k1, offset, threshold, keep)
