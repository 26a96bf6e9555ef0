"""Visibility of one (query block x key block) tile, for the streaming numba kernels.

Owns :class:`TileVisibility` (the kernel-ready form of a call's visibility: everything visible,
a dense ``visible`` array read per tile, or a :class:`refattn.masks.VisibilityRelation`
evaluated from coordinates) and the ``@njit`` functions that classify a tile as invisible,
partial or fully visible from block bounds alone (so invisible tiles cost no arithmetic) and
fill a partial tile's mask element by element. The predicate is the relation's own (see its
docstring); tests pin :func:`tile_mask` to ``VisibilityRelation.dense()``. Defers the
relation's construction and validation to :mod:`refattn.masks`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from refattn.engine.numba._jit import kernel
from refattn.engine.numba.operands import at, ro, strided

__all__ = ["FULL", "INVISIBLE", "PARTIAL", "TileVisibility", "classify", "tile_mask",
           "tile_visibility"]

INVISIBLE, PARTIAL, FULL = 0, 1, 2
# flags[...] slots
_MODE, _HAS_SEG, _TOPO, _HAS_LEFT, _HAS_RIGHT = range(5)
MODE_ALL, MODE_DENSE, MODE_COORDS = 0, 1, 2
TOPO_NONE, TOPO_CAUSAL, TOPO_PREFIX = 0, 1, 2
_I64_MAX = np.iinfo(np.int64).max


def _ints(x: Any, ndim: int) -> np.ndarray:
    arr = np.asarray(x, dtype=np.int64)
    return ro(arr.reshape((1,) * (ndim - arr.ndim) + arr.shape) if arr.ndim < ndim else arr)


class TileVisibility(NamedTuple):
    """Kernel arguments describing visibility (fixed dtypes and ranks in every mode).

    Attributes
    ----------
    flags : (5,) int64
        mode (0 all, 1 dense, 2 coordinates), has_segments, topology (0 none, 1 causal,
        2 prefix), has_left, has_right.
    dense, dense_strides : (n,) bool, (4,) int64
        The dense relation (mode 1) as a :class:`~refattn.engine.numba.operands.Strided`
        operand, or a dummy.
    q_pos, k_pos : (B, Q), (B, K) int64
    key_valid : (B, K) bool
    q_seg, k_seg : (B, Q), (B, K) int64 (dummies without segments)
    prefix : (B, Hp) int64, Hp in {1, Hq}
    left, right : (Hw,) int64, Hw in {1, Hq}; a negative bound means unbounded

    The coordinate fields are the relation's
    :meth:`~refattn.masks.VisibilityRelation.kernel_arguments`, broadcast to the call's B.
    """

    flags: np.ndarray
    dense: np.ndarray
    dense_strides: np.ndarray
    q_pos: np.ndarray
    k_pos: np.ndarray
    key_valid: np.ndarray
    q_seg: np.ndarray
    k_seg: np.ndarray
    prefix: np.ndarray
    left: np.ndarray
    right: np.ndarray

    @property
    def mode(self) -> str:
        """"all", "dense_per_tile" or "coordinates"."""
        return ("all", "dense_per_tile", "coordinates")[int(self.flags[_MODE])]


def tile_visibility(
    shape: tuple[int, int, int, int], *, visible: np.ndarray | None = None,
    relation: Any = None,
) -> TileVisibility:
    """Kernel form of a call's visibility: a relation, else a dense array, else all visible.

    Parameters
    ----------
    shape : (B, Hq, Q, K)
    visible : bool ndarray broadcastable to (B, Hq, Q, K), optional
    relation : VisibilityRelation, optional
        Evaluated from coordinates; takes precedence over ``visible``.

    Examples
    --------
    >>> tile_visibility((1, 1, 2, 2)).mode
    'all'
    >>> tile_visibility((1, 1, 2, 2), visible=np.eye(2, dtype=bool)).mode
    'dense_per_tile'
    """
    B = shape[0]
    flags = np.zeros(5, dtype=np.int64)
    dummy_b = strided(None, shape, np.bool_)
    dummy_i = _ints(np.zeros((1, 1)), 2)
    dummy_w = _ints(np.zeros(1), 1)
    if relation is None:
        dense = dummy_b
        if visible is not None:
            flags[_MODE] = MODE_DENSE
            dense = strided(visible, shape, np.bool_)
        return TileVisibility(ro(flags), *dense, dummy_i, dummy_i,
                              ro(np.ones((1, 1), dtype=bool)), dummy_i, dummy_i,
                              dummy_i, dummy_w, dummy_w)
    flags[_MODE] = MODE_COORDS
    args = relation.kernel_arguments()  # the relation's own fixed-shape form of its fields

    def batch(x: Any, dtype: Any) -> np.ndarray:  # a B=1 relation broadcasts over the call's B
        arr = np.asarray(x, dtype=dtype)
        return ro(np.broadcast_to(arr, (B, arr.shape[1])))

    flags[_HAS_SEG] = int(args.has_segments)
    flags[_TOPO] = int(args.topology)
    flags[_HAS_LEFT] = int((np.asarray(args.left) >= 0).any())  # -1 = unbounded
    flags[_HAS_RIGHT] = int((np.asarray(args.right) >= 0).any())
    return TileVisibility(
        ro(flags), *dummy_b, batch(args.q_pos, np.int64), batch(args.k_pos, np.int64),
        batch(args.key_valid, np.bool_), batch(args.q_segment, np.int64),
        batch(args.k_segment, np.int64), batch(args.prefix_length, np.int64),
        _ints(args.left, 1), _ints(args.right, 1),
    )


@kernel(inline="always")
def _per_head(a, h):
    return a[h] if a.shape[0] > 1 else a[0]


@kernel(inline="always")
def _visible(tv, b, h, i, j):
    """The relation's predicate at one element (coordinates mode)."""
    flags, _, _, q_pos, k_pos, key_valid, q_seg, k_seg, prefix, left, right = tv
    if not key_valid[b, j]:
        return False
    if flags[_HAS_SEG] and q_seg[b, i] != k_seg[b, j]:
        return False
    p = q_pos[b, i]
    r = k_pos[b, j]
    topo = flags[_TOPO]
    if topo == TOPO_CAUSAL:
        if r > p:
            return False
    elif topo == TOPO_PREFIX:
        P = prefix[b, h] if prefix.shape[1] > 1 else prefix[b, 0]
        if not ((p < P and r < P) or (p >= P and r <= p)):
            return False
    if flags[_HAS_LEFT]:
        lw = _per_head(left, h)
        if lw >= 0 and p - r > lw:
            return False
    if flags[_HAS_RIGHT]:
        rw = _per_head(right, h)
        if rw >= 0 and r - p > rw:
            return False
    return True


@kernel
def classify(tv, b, h, i0, i1, j0, j1):
    """INVISIBLE, PARTIAL or FULL for the tile ``[i0, i1) x [j0, j1)`` of head (b, h).

    Coordinates mode decides from block bounds (O(i1 - i0 + j1 - j0)); dense mode reads the
    tile. A PARTIAL answer is always safe: the caller then evaluates every element.
    """
    flags = tv[0]
    mode = flags[_MODE]
    if mode == MODE_ALL:
        return FULL
    if mode == MODE_DENSE:
        n = 0
        for i in range(i0, i1):
            for j in range(j0, j1):
                n += at(tv[1], tv[2], b, h, i, j)
        if n == 0:
            return INVISIBLE
        return FULL if n == (i1 - i0) * (j1 - j0) else PARTIAL
    _, _, _, q_pos, k_pos, key_valid, q_seg, k_seg, prefix, left, right = tv
    pmin = rmin = qsmin = ksmin = _I64_MAX
    pmax = rmax = qsmax = ksmax = -_I64_MAX
    n_valid = 0
    for j in range(j0, j1):
        r = k_pos[b, j]
        rmin = min(rmin, r)
        rmax = max(rmax, r)
        n_valid += key_valid[b, j]
        if flags[_HAS_SEG]:
            ksmin = min(ksmin, k_seg[b, j])
            ksmax = max(ksmax, k_seg[b, j])
    for i in range(i0, i1):
        p = q_pos[b, i]
        pmin = min(pmin, p)
        pmax = max(pmax, p)
        if flags[_HAS_SEG]:
            qsmin = min(qsmin, q_seg[b, i])
            qsmax = max(qsmax, q_seg[b, i])
    if n_valid == 0:
        return INVISIBLE
    full = n_valid == j1 - j0
    if flags[_HAS_SEG]:
        if qsmax < ksmin or ksmax < qsmin:
            return INVISIBLE
        full = full and qsmin == qsmax and ksmin == ksmax and qsmin == ksmin
    topo = flags[_TOPO]
    if topo == TOPO_CAUSAL:
        if rmin > pmax:
            return INVISIBLE
        full = full and rmax <= pmin
    elif topo == TOPO_PREFIX:
        P = prefix[b, h] if prefix.shape[1] > 1 else prefix[b, 0]
        inside = pmin < P and rmin < P  # some (p, r) may satisfy the prefix clause
        after = pmax >= P and rmin <= pmax  # some may satisfy the causal clause
        if not inside and not after:
            return INVISIBLE
        full = full and ((pmax < P and rmax < P) or (pmin >= P and rmax <= pmin))
    if flags[_HAS_LEFT]:
        lw = _per_head(left, h)
        if lw >= 0:
            if pmin - rmax > lw:
                return INVISIBLE
            full = full and pmax - rmin <= lw
    if flags[_HAS_RIGHT]:
        rw = _per_head(right, h)
        if rw >= 0:
            if rmin - pmax > rw:
                return INVISIBLE
            full = full and rmax - pmin <= rw
    return FULL if full else PARTIAL


@kernel
def tile_mask(out, tv, b, h, i0, i1, j0, j1):
    """``out[:i1-i0, :j1-j0]`` = visibility of the tile; returns the number of visible edges.

    Examples
    --------
    >>> from refattn.masks import relation
    >>> rel = relation([[0, 1, 2]], [[0, 1, 2]], causal=True)
    >>> tv = tile_visibility((1, 1, 3, 3), relation=rel)
    >>> out = np.zeros((3, 3), dtype=np.bool_)
    >>> int(tile_mask(out, tv, 0, 0, 0, 3, 0, 3)), bool((out == rel.dense()[0, 0]).all())
    (6, True)
    """
    mode = tv[0][_MODE]
    n = 0
    for i in range(i0, i1):
        for j in range(j0, j1):
            if mode == MODE_ALL:
                vis = True
            elif mode == MODE_DENSE:
                vis = at(tv[1], tv[2], b, h, i, j)
            else:
                vis = _visible(tv, b, h, i, j)
            out[i - i0, j - j0] = vis
            n += vis
    return n
