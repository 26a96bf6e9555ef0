"""Packing metadata: lengths, cumulative offsets, segment ids, and packed [B,H,L,D] tensors.

Owns the conversions between per-example lengths, ``cu_seqlens``, segment ids with
per-segment positions, and padded versus packed tensors, plus the contract's pair counts.
Empty sequences are legal (a length of 0, a repeated ``cu_seqlens`` offset, as FlashAttention's
varlen API allows); offsets that decrease are refused naming the entries.
Defers the block-diagonal visibility relation built from segment ids to
:mod:`refattn.masks` and its lowering to cu_seqlens to :mod:`refattn.masks.framework`.
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import numpy as np

from refattn._boundary import public
from refattn._checks import INT64_MAX, as_array, bounded_int, check_float64, int_text
from refattn._memory import check_bytes
from refattn.errors import RefAttnError
from refattn.masks._inputs import POSITION_MAX, int_array

__all__ = [
    "Packed",
    "PackedSegments",
    "PairCounts",
    "cu_seqlens_from_lengths",
    "pack",
    "pair_counts",
    "segments_from_cu_seqlens",
    "unpack",
]


class PairCounts(NamedTuple):
    """Logical query-key pair counts for packing the same examples three ways."""

    padded: int
    """``n * max(l)**2``: every example padded to the longest one."""
    independent: int
    """``sum(l**2)``: each example run on its own (or packed with block-diagonal visibility)."""
    unrestricted: int
    """``sum(l)**2``: one unrestricted concatenation (wrong support, extra work)."""


class PackedSegments(NamedTuple):
    """Segment id and position within the segment of every packed token."""

    segment_ids: np.ndarray
    """(T,) int64: which example token t belongs to."""
    positions: np.ndarray
    """(T,) int64: the token's position inside its example (resets at every boundary)."""


class Packed(NamedTuple):
    """A packed tensor with the metadata needed to attend within examples and to unpack."""

    values: np.ndarray
    """(1, H, T, D) float64: the real rows of every example, concatenated along the L axis."""
    cu_seqlens: np.ndarray
    """(B + 1,) int64: example b occupies packed rows ``[cu_seqlens[b], cu_seqlens[b+1])``."""
    segment_ids: np.ndarray
    """(1, T) int64."""
    positions: np.ndarray
    """(1, T) int64."""


def _lengths(x: object) -> np.ndarray:
    arr = int_array("lengths", x)
    if arr.ndim != 1 or arr.size == 0:
        raise RefAttnError(f"lengths: expected a non-empty 1-D array, got shape {list(arr.shape)}")
    bad = np.flatnonzero(arr < 0)
    if bad.size:
        s = int(bad[0])
        raise RefAttnError(
            f"lengths: entry {s} is {int(arr[s])}; a sequence length is >= 0 (0 is an empty "
            "sequence)"
        )
    total = int(arr.sum(dtype=object))  # exact: an int64 sum could wrap
    if total > POSITION_MAX:
        raise RefAttnError(f"lengths: they add up to {int_text(total)} tokens, more than the "
                           f"{int_text(POSITION_MAX)} positions a packed row may have")
    if total == 0:
        raise RefAttnError(
            f"lengths: every one of the {arr.size} sequences is empty; a packed row needs at "
            "least one token"
        )
    return arr


@public
def cu_seqlens_from_lengths(lengths: Any) -> np.ndarray:
    """Cumulative sequence offsets ``[0, l_0, l_0 + l_1, ...]``.

    Parameters
    ----------
    lengths : (n,) integer array_like
        Sequence lengths, each >= 0 (an empty sequence repeats an offset, as in
        FlashAttention's varlen API), at least one token in total.

    Returns
    -------
    (n + 1,) int64 ndarray

    Examples
    --------
    >>> cu_seqlens_from_lengths([3, 4, 5, 4]).tolist()
    [0, 3, 7, 12, 16]
    >>> cu_seqlens_from_lengths([3, 0, 2]).tolist()   # sequence 1 is empty
    [0, 3, 3, 5]
    """
    return np.concatenate([[0], np.cumsum(_lengths(lengths))])  # int64: lengths are int64


def _cu_seqlens(x: object) -> np.ndarray:
    cu = int_array("cu_seqlens", x)
    if cu.ndim != 1 or cu.size < 2:
        raise RefAttnError(
            f"cu_seqlens: expected a 1-D array of at least 2 offsets, got shape {list(cu.shape)}"
        )
    if int(cu[0]) != 0:
        raise RefAttnError(f"cu_seqlens: must start at 0, got {int(cu[0])}")
    steps = np.flatnonzero(np.diff(cu) < 0)
    if steps.size:
        s = int(steps[0])
        raise RefAttnError(
            f"cu_seqlens: must be sorted (non-decreasing), got {int(cu[s])} then "
            f"{int(cu[s + 1])} at entries {s}, {s + 1} (a repeated offset is an empty sequence; "
            "a decreasing one is not a sequence)"
        )
    if int(cu[-1]) > POSITION_MAX:  # sorted: the last offset is the largest position
        raise RefAttnError(f"cu_seqlens: last offset {int_text(int(cu[-1]))} is beyond the "
                           f"{int_text(POSITION_MAX)} positions a packed row may have")
    if int(cu[-1]) == 0:
        raise RefAttnError(
            f"cu_seqlens: every one of the {cu.size - 1} sequences is empty (last offset 0); a "
            "packed row needs at least one token"
        )
    return cu


@public
def segments_from_cu_seqlens(cu_seqlens: Any) -> PackedSegments:
    """Segment ids and per-segment positions of a packed row.

    Parameters
    ----------
    cu_seqlens : (n + 1,) integer array_like
        Starts at 0, non-decreasing (a repeated offset is an empty sequence), last offset > 0.

    Returns
    -------
    PackedSegments
        ``segment_ids`` and ``positions``, both (T,) int64 with ``T = cu_seqlens[-1]``. The
        segment id of a token is the index s of its sequence in ``cu_seqlens``, so an empty
        sequence's id appears on no token.

    Examples
    --------
    >>> seg = segments_from_cu_seqlens([0, 3, 7, 9, 12])
    >>> seg.segment_ids.tolist()
    [0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3]
    >>> seg.positions.tolist()
    [0, 1, 2, 0, 1, 2, 3, 0, 1, 0, 1, 2]
    >>> segments_from_cu_seqlens([0, 2, 2, 3]).segment_ids.tolist()   # sequence 1 is empty
    [0, 0, 2]
    """
    cu = _cu_seqlens(cu_seqlens)
    lengths = np.diff(cu)  # (n,)
    segment_ids = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)  # (T,)
    positions = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1], lengths)  # (T,)
    return PackedSegments(segment_ids, positions)


@public
def pack(x: Any, lengths: Any) -> Packed:
    """Pack the first ``lengths[b]`` rows of each example into one row (right padding dropped).

    Parameters
    ----------
    x : (B, H, L, D) float64 ndarray
        Right-padded examples.
    lengths : (B,) integer array_like
        Real length of each example, ``0 <= lengths[b] <= L`` (0: an empty example, which
        repeats an offset of ``cu_seqlens``), at least one token in total.

    Returns
    -------
    Packed
        ``values`` (1, H, T, D) with ``T = sum(lengths)``, plus cu_seqlens, segment ids and
        per-segment positions.

    Examples
    --------
    >>> x = np.arange(6.0).reshape(2, 1, 3, 1)
    >>> p = pack(x, [2, 3])
    >>> p.values[0, 0, :, 0].tolist(), p.cu_seqlens.tolist()
    ([0.0, 1.0, 3.0, 4.0, 5.0], [0, 2, 5])
    """
    arr = as_array("x", x)
    check_float64("x", arr)
    if arr.ndim != 4:
        raise RefAttnError(f"x: expected shape [B,H,L,D], got {list(arr.shape)}")
    lengths = _lengths(lengths)
    B, _, L, _ = arr.shape
    if lengths.size != B:
        raise RefAttnError(f"lengths: expected {B} entries (one per batch row), got {lengths.size}")
    over = np.flatnonzero(lengths > L)
    if over.size:
        b = int(over[0])
        raise RefAttnError(f"lengths: entry {b} is {int(lengths[b])}, longer than L={L}")
    cu = cu_seqlens_from_lengths(lengths)
    values = np.concatenate([arr[b:b + 1, :, :n] for b, n in enumerate(lengths)], axis=2)
    seg = segments_from_cu_seqlens(cu)
    return Packed(values, cu, seg.segment_ids[None, :], seg.positions[None, :])


@public
def unpack(values: Any, cu_seqlens: Any, *, length: int | None = None) -> np.ndarray:
    """Inverse of :func:`pack`: scatter packed rows back into a zero-padded batch.

    Parameters
    ----------
    values : (1, H, T, D) float64 ndarray
    cu_seqlens : (B + 1,) integer array_like
        With ``cu_seqlens[-1] == T``.
    length : int, optional
        Padded length L (default: the longest example).

    Returns
    -------
    (B, H, L, D) float64 ndarray
        Rows past each example's length are exactly 0 (every row of an empty example).

    Examples
    --------
    >>> x = np.arange(6.0).reshape(2, 1, 3, 1)
    >>> unpack(pack(x, [2, 3]).values, [0, 2, 5])[:, 0, :, 0].tolist()
    [[0.0, 1.0, 0.0], [3.0, 4.0, 5.0]]
    """
    arr = as_array("values", values)
    check_float64("values", arr)
    cu = _cu_seqlens(cu_seqlens)
    if arr.ndim != 4 or arr.shape[0] != 1:
        raise RefAttnError(f"values: expected shape [1,H,T,D], got {list(arr.shape)}")
    _, H, T, D = arr.shape
    if int(cu[-1]) != T:
        raise RefAttnError(f"cu_seqlens: last offset {int(cu[-1])} must equal T={T}")
    lengths = np.diff(cu)
    L = int(lengths.max()) if length is None else bounded_int("length", length, lo=0,
                                                              hi=INT64_MAX)
    if L < int(lengths.max()):
        raise RefAttnError(f"length: {L} is shorter than the longest example ({lengths.max()})")
    check_bytes(8 * lengths.size * H * L * D, f"unpacking into (B, H, L, D) = "
                f"({lengths.size}, {H}, {L}, {D})", "a shorter padded length")
    out = np.zeros((lengths.size, H, L, D))  # (B, H, L, D)
    for b, (start, stop) in enumerate(itertools.pairwise(cu)):
        out[b, :, : stop - start] = arr[0, :, start:stop]
    return out


@public
def pair_counts(lengths: Any) -> PairCounts:
    """Query-key pair counts: padded, independent and unrestricted concatenation.

    Logical counts before any causal saving; not a statement about what a backend stores.
    An empty example (length 0) adds no pair, but still a padded slot row.

    Examples
    --------
    >>> pair_counts([3, 4, 5, 4])
    PairCounts(padded=100, independent=66, unrestricted=256)
    >>> pair_counts([3, 0, 2])
    PairCounts(padded=27, independent=13, unrestricted=25)
    """
    lengths = _lengths(lengths)
    return PairCounts(
        padded=int(lengths.size * lengths.max() ** 2),
        independent=int((lengths**2).sum()),
        unrestricted=int(lengths.sum() ** 2),
    )
