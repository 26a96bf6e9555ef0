"""A bank-conflict model of shared-memory accesses: cycles per warp instruction.

Owns :func:`access_cycles` (the shared-memory cycles of one warp-wide load or store, from each
lane's byte address), the tile layouts the kernels may use (:func:`tile_index`: rows padded to
a stride, or ``tile.cuh``'s XOR swizzle) and their access patterns (:data:`PATTERNS`: which lane
reads which row and column of a row-major tile of doubles). :mod:`gpu_backend.compile_check`
reports the cycles per pattern and layout; :mod:`gpu_backend.perf_model` charges the main
loops' LDS instructions with them.

The model (NVIDIA's documented shared memory since Volta: 32 banks of 4 bytes, 128 bytes per
cycle per SM): an access of ``width`` bytes per lane is served in phases of ``128 // width``
lanes (the whole warp for 4 bytes, half-warps for 8, quarter-warps for 16). A phase takes as
many cycles as the largest number of *distinct* 4-byte words that fall in one bank; lanes
reading the same word share it (broadcast). An instruction's cycles are the sum over its
phases; the conflict-free minimum is ``width // 4``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

__all__ = ["BANKS", "PATTERNS", "WORD", "Pattern", "access_cycles", "ideal_cycles",
           "pattern_cycles", "tile_index", "worst_cycles"]

BANKS = 32
WORD = 4  # bytes per bank word

class Pattern(NamedTuple):
    """A warp's access to a row-major tile of doubles, and the corners it is used at."""

    lanes: Callable[[int], tuple[int, int]]  # lane -> (row, column) from the corner
    width: int  # bytes per lane
    rows: tuple[int, ...]  # corner rows that occur, modulo 8
    col_step: int  # corner columns are its multiples
    use: str


#: the access patterns. ``g = lane >> 2``, ``t = lane & 3`` are the PTX ISA's fragment
#: coordinates of ``mma.sync ... .f64`` (m8n8k4, m16n8k4/k8/k16); tile.cuh puts fragment
#: corners at rows that are multiples of 8.
PATTERNS: dict[str, Pattern] = {
    "row_read": Pattern(lambda lane: (lane >> 2, lane & 3), 8, (0,), 4,
                        "fragment (row g, column t): A of Q, G_O, K, V; B of K, V, Q, G_O "
                        "read as B^T; LDS.64"),
    "col_read": Pattern(lambda lane: (2 * (lane & 3), lane >> 2), 8, (0, 1), 8,
                        "fragment (row 2t + s, column g), s = 0 or 1: B of V, K, Q, G_O when "
                        "the C fragment of S or dS is reused as an A fragment; LDS.64"),
    "col_read_t": Pattern(lambda lane: (lane & 3, lane >> 2), 8, (0, 4), 8,
                          "fragment (row t, column g): B[t][g] of a k-major tile; LDS.64"),
    "accumulator_16B": Pattern(lambda lane: (lane >> 2, 2 * (lane & 3)), 16, (0,), 8,
                               "a C fragment stored or reloaded as 16 bytes (row g, columns "
                               "2t, 2t + 1); STS/LDS.128"),
    "cp_async_16B": Pattern(lambda lane: (0, 2 * lane), 16, tuple(range(8)), 64,
                            "cp.async of 16 bytes per lane, 32 consecutive chunks of "
                            "row-major rows (rows of D < 64 doubles wrap); STS.128/LDGSTS.128"),
    "row_per_lane": Pattern(lambda lane: (lane, 0), 8, (0,), 1,
                            "one row per lane, same column (a naive row-wise loop); LDS.64"),
    "row_per_4_lanes": Pattern(lambda lane: (lane >> 2, 0), 8, (0,), 1,
                               "the scalar kernels' sQ[r * D + d]: 4 lanes per row "
                               "(broadcast), 8 rows; LDS.64"),
}


def access_cycles(addresses: Sequence[int | None], width: int) -> int:
    """Shared-memory cycles of one warp instruction.

    Parameters
    ----------
    addresses : (32,) sequence of int or None
        Byte address of each lane's access (None: the lane is inactive). Each must be a
        multiple of ``width``.
    width : {4, 8, 16}
        Bytes per lane.

    Returns
    -------
    int
        Sum over the phases of the most distinct words in one bank (at least 1 per phase
        with an active lane).

    Examples
    --------
    Eight-byte loads, lane ``l`` at row ``l`` of a tile with 64 doubles per row: every lane's
    words sit in banks 0 and 1, 16 distinct words per half-warp, 16 + 16 cycles:

    >>> access_cycles([l * 64 * 8 for l in range(32)], 8)
    32
    >>> access_cycles([l * 8 for l in range(32)], 8)  # consecutive doubles: conflict-free
    2
    >>> access_cycles([0] * 32, 8)  # one word pair for everyone: a broadcast
    2
    """
    if width not in (4, 8, 16) or len(addresses) != 32:
        raise ValueError(f"access_cycles: width {width} of 4/8/16 bytes, 32 lanes; "
                         f"got {len(addresses)} lanes")
    per_phase = 128 // width
    cycles = 0
    for p in range(0, 32, per_phase):
        banks: dict[int, set[int]] = {}
        for a in addresses[p:p + per_phase]:
            if a is None:
                continue
            if a % width:
                raise ValueError(f"access_cycles: address {a} is not {width}-byte aligned")
            for w in range(a // WORD, (a + width) // WORD):
                banks.setdefault(w % BANKS, set()).add(w)
        if banks:
            cycles += max(len(words) for words in banks.values())
    return cycles


def ideal_cycles(width: int) -> int:
    """The conflict-free cycles of a warp access of ``width`` bytes per lane (``width // 4``).

    >>> ideal_cycles(8)
    2
    """
    return width // WORD


def tile_index(layout: str, D: int, row: int, col: int) -> int:
    """Index in doubles of element (row, col) of a tile with D columns.

    Parameters
    ----------
    layout : str
        ``"stride=N"``: row-major rows of N >= D doubles (N - D of padding);
        ``"swizzle"``: ``tile.cuh``'s unpadded rows with the column's bits 2-3 XORed with
        ``f(r) = (r ^ (r >> 1)) & 3`` (16-byte chunks stay together).

    Examples
    --------
    >>> tile_index("stride=68", 64, 1, 2), tile_index("swizzle", 64, 1, 2)
    (70, 70)
    >>> tile_index("swizzle", 64, 2, 1)  # f(2) = 3: column 1 -> 1 ^ 12 = 13
    141
    """
    if layout == "swizzle":
        return row * D + (col ^ (((row ^ (row >> 1)) & 3) << 2))
    if layout.startswith("stride="):
        stride = int(layout.removeprefix("stride="))
        if stride >= D:
            return row * stride + col
    raise ValueError(f"tile_index: layout {layout!r} is neither 'swizzle' nor 'stride=N' "
                     f"with N >= D = {D}")


def pattern_cycles(pattern: str, D: int, layout: str | None = None, *,
                   origin: tuple[int, int] = (0, 0)) -> int:
    """Cycles of :data:`PATTERNS` ``[pattern]`` on a tile of D columns in ``layout``.

    Parameters
    ----------
    pattern : str
        A key of :data:`PATTERNS`.
    D : int
        Doubles of data per row; a lane whose column is past it wraps to the next rows.
    layout : str, optional
        As :func:`tile_index`; default ``"stride=D"`` (unpadded, unswizzled).
    origin : (int, int)
        Row and column of the fragment's corner in the tile.

    Examples
    --------
    The fragment read (row g, column t) on unpadded rows of 64 doubles puts the 4 rows of a
    half-warp in the same two banks (4-way, 8 cycles); 4 doubles of padding, or the swizzle,
    spread them over all 32 (2 cycles, the minimum):

    >>> [pattern_cycles("row_read", 64, lay) for lay in ("stride=64", "stride=68", "swizzle")]
    [8, 2, 2]
    """
    lane_map, width = PATTERNS[pattern][:2]
    layout = layout or f"stride={D}"
    addresses = []
    for lane in range(32):
        row, col = lane_map(lane)
        row, col = row + origin[0], col + origin[1]
        addresses.append(tile_index(layout, D, row + col // D, col % D) * 8)
    return access_cycles(addresses, width)


def worst_cycles(pattern: str, D: int, layout: str | None = None) -> int:
    """The most cycles of ``pattern`` over the corners it is used at.

    Corner rows: the pattern's ``rows`` plus multiples of 8 (the swizzle depends on a row's
    low 3 bits only; padding on row x stride, and 8 rows of any stride cover every case
    modulo 32 banks as well); corner columns: multiples of ``col_step`` below D.

    >>> worst_cycles("col_read", 64, "swizzle"), worst_cycles("col_read", 64, "stride=68")
    (2, 4)
    """
    p = PATTERNS[pattern]
    return max(pattern_cycles(pattern, D, layout, origin=(r + 8 * k, c))
               for r in p.rows for k in range(4) for c in range(0, D, p.col_step))
