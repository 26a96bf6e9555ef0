"""The Philox4x32-10 counter-based generator (Salmon et al., SC'11; Random123), in NumPy.

Owns the integer bijection only: 4 x 32-bit counter words and 2 x 32-bit key words in, 4 x 32-bit
words out, vectorised over any leading shape, pure integer arithmetic (no floating point
anywhere). Defers the mapping of attention coordinates onto counters, keys and words (and the
keep decision) to :mod:`refattn.dropout`.

The algorithm, exactly as Random123's ``philox4x32_R`` (``philox.h``) with R = 10::

    M0 = 0xD2511F53, M1 = 0xCD9E8D57          round multipliers
    W0 = 0x9E3779B9, W1 = 0xBB67AE85          Weyl key increments
    round(c, k):
        (hi0, lo0) = mulhilo32(M0, c0)        full 64-bit product of two uint32
        (hi1, lo1) = mulhilo32(M1, c2)
        c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0)
    c = round(c, k)                           round 1 with the original key
    repeat 9 times: k = (k0 + W0 mod 2**32, k1 + W1 mod 2**32); c = round(c, k)

The 64-bit products are formed in ``uint64`` (both factors are below 2**32, so the product is
exact); ``hi`` is the product shifted right by 32 and ``lo`` its low 32 bits. A C, CUDA or numba
port computes the same words bit for bit; the Random123 known-answer vectors pin it in the
tests (``tests/test_philox.py``).
"""

from __future__ import annotations

import numpy as np

from refattn._boundary import public
from refattn._checks import as_array
from refattn.errors import RefAttnError

__all__ = ["PHILOX_M", "PHILOX_W", "philox4x32_10"]

#: round multipliers (Random123 PHILOX_M4x32_0, PHILOX_M4x32_1)
PHILOX_M = (0xD2511F53, 0xCD9E8D57)
#: Weyl key-schedule increments (Random123 PHILOX_W32_0, PHILOX_W32_1)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)

_MASK32 = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)
_M0, _M1 = (np.uint64(m) for m in PHILOX_M)
_W0, _W1 = (np.uint64(w) for w in PHILOX_W)


def _uint32_words(name: str, x: object, width: int) -> np.ndarray:
    arr = as_array(name, x)
    if arr.dtype != np.uint32:
        raise RefAttnError(
            f"{name}: expected dtype uint32, got {arr.dtype} (refattn never casts generator state)"
        )
    if arr.ndim == 0 or arr.shape[-1] != width:
        raise RefAttnError(
            f"{name}: expected shape (..., {width}) of 32-bit words, got {list(arr.shape)}"
        )
    return arr


def _philox4x32(counter: np.ndarray, key: np.ndarray, rounds: int) -> np.ndarray:
    """Philox4x32-``rounds`` on validated uint32 arrays (the arithmetic, no checks)."""
    # every word is held in uint64 so that mulhilo32 is one exact 64-bit product
    c0, c1, c2, c3 = (counter[..., n].astype(np.uint64) for n in range(4))  # (...)
    k0, k1 = (key[..., n].astype(np.uint64) for n in range(2))  # (...)
    for r in range(rounds):
        if r:  # the key is bumped *between* rounds: round 1 uses the key as given
            k0 = (k0 + _W0) & _MASK32
            k1 = (k1 + _W1) & _MASK32
        prod0 = _M0 * c0  # < 2**64: exact
        prod1 = _M1 * c2
        c0, c1, c2, c3 = (
            (prod1 >> _SHIFT) ^ c1 ^ k0,
            prod1 & _MASK32,
            (prod0 >> _SHIFT) ^ c3 ^ k1,
            prod0 & _MASK32,
        )
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


@public
def philox4x32_10(counter: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Philox4x32-10: map counters and keys to four pseudo-random 32-bit words each.

    Parameters
    ----------
    counter : (..., 4) uint32 ndarray
        Counter words ``(c0, c1, c2, c3)``.
    key : (..., 2) uint32 ndarray
        Key words ``(k0, k1)``; leading axes broadcast against ``counter``'s.

    Returns
    -------
    (..., 4) uint32 ndarray
        The output words, leading shape broadcast from both inputs.

    Raises
    ------
    RefAttnError
        If an input is not uint32 (no silent cast), has a wrong last axis, or the leading
        shapes do not broadcast.

    Examples
    --------
    Random123 known-answer vector (all-zero counter and key):

    >>> out = philox4x32_10(np.zeros(4, np.uint32), np.zeros(2, np.uint32))
    >>> [f"{w:08x}" for w in out]
    ['6627e8d5', 'e169c58d', 'bc57ac4c', '9b00dbd8']
    """
    c = _uint32_words("counter", counter, 4)
    k = _uint32_words("key", key, 2)
    try:
        lead = np.broadcast_shapes(c.shape[:-1], k.shape[:-1])
    except ValueError:
        raise RefAttnError(
            f"counter/key: leading shapes {list(c.shape[:-1])} and {list(k.shape[:-1])} "
            "do not broadcast"
        ) from None
    c = np.broadcast_to(c, (*lead, 4))
    k = np.broadcast_to(k, (*lead, 2))
    return _philox4x32(c, k, 10)
