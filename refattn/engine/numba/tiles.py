"""Visibility of one (query block x key block) tile, for the streaming numba kernels.

Owns :class:`TileVisibility` (the kernel-ready form of a call's visibility: everything visible,
a dense ``visible`` array read per tile, or a relation evaluated from coordinates) and the
``@njit`` functions that classify a tile as invisible, partial or fully visible from block
bounds alone (so invisible tiles cost no arithmetic) and fill a partial tile's mask element by
element. A relation arrives as its leaves (coordinate relations, stacked on a leading leaf
axis) and a postfix program over them (``relation.program()``: a leaf index pushes that leaf,
-1 is AND, -2 is OR), so a union or intersection of relations runs here without a dense
matrix: an element is the program evaluated on the leaves' truth values, and a tile's class
combines the leaves' classes (a union is FULL if a term is FULL, INVISIBLE only if every term
is; an intersection dually; anything else is PARTIAL, which is always safe). The predicate is
the relation's own (see its docstring); tests pin :func:`tile_mask` to its ``dense()``.
Defers the relation's construction and validation to :mod:`refattn.masks`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from refattn.engine.numba._jit import kernel
from refattn.engine.numba.operands import at, ro, strided

__all__ = ["FULL", "INVISIBLE", "PARTIAL", "TileVisibility", "classify", "tile_mask",
           "tile_visibility"]

INVISIBLE, PARTIAL, FULL = 0, 1, 2
# leaf_flags[leaf, ...] slots
_HAS_SEG, _TOPO, _HAS_LEFT, _HAS_RIGHT = range(4)
MODE_ALL, MODE_DENSE, MODE_COORDS = 0, 1, 2
TOPO_NONE, TOPO_CAUSAL, TOPO_PREFIX = 0, 1, 2
OP_AND, OP_OR = -1, -2  # postfix program codes (refattn.masks.algebra.AND / OR)
_I64_MAX = np.iinfo(np.int64).max


def _ints(x: Any, ndim: int) -> np.ndarray:
    arr = np.asarray(x, dtype=np.int64)
    return ro(arr.reshape((1,) * (ndim - arr.ndim) + arr.shape) if arr.ndim < ndim else arr)


class TileVisibility(NamedTuple):
    """Kernel arguments describing visibility (fixed dtypes and ranks in every mode).

    Attributes
    ----------
    mode : (1,) int64
        0 all, 1 dense, 2 coordinates.
    dense, dense_strides : (n,) bool, (4,) int64
        The dense relation (mode 1) as a :class:`~refattn.engine.numba.operands.Strided`
        operand, or a dummy.
    program : (P,) int64
        Postfix program over the leaves (a leaf index, -1 AND, -2 OR); ``[0]`` for one leaf.
    leaf_flags : (L, 4) int64
        Per leaf: has_segments, topology (0 none, 1 causal, 2 prefix), has_left, has_right.
    q_pos, k_pos : (L, B, Q), (L, B, K) int64
    key_valid : (L, B, K) bool
    q_seg, k_seg : (L, B, Q), (L, B, K) int64 (zeros without segments)
    prefix : (L, B, Hp) int64, Hp in {1, Hq}
    left, right : (L, Hw) int64, Hw in {1, Hq}; a negative bound means unbounded

    The coordinate fields are each leaf's
    :meth:`~refattn.masks.VisibilityRelation.kernel_arguments`, broadcast to the call's B
    and to a common head extent.
    """

    flags: np.ndarray
    dense: np.ndarray
    dense_strides: np.ndarray
    program: np.ndarray
    leaf_flags: np.ndarray
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
        return ("all", "dense_per_tile", "coordinates")[int(self.flags[0])]


def tile_visibility(
    shape: tuple[int, int, int, int], *, visible: np.ndarray | None = None,
    relation: Any = None,
) -> TileVisibility:
    """Kernel form of a call's visibility: a relation, else a dense array, else all visible.

    Parameters
    ----------
    shape : (B, Hq, Q, K)
    visible : bool ndarray broadcastable to (B, Hq, Q, K), optional
    relation : VisibilityRelation or ComposedRelation, optional
        Evaluated from coordinates (its ``leaves()`` and ``program()``); takes precedence
        over ``visible``.

    Examples
    --------
    >>> tile_visibility((1, 1, 2, 2)).mode
    'all'
    >>> tile_visibility((1, 1, 2, 2), visible=np.eye(2, dtype=bool)).mode
    'dense_per_tile'
    """
    B = shape[0]
    flags = np.zeros(1, dtype=np.int64)
    if relation is None:
        dense = strided(None, shape, np.bool_)
        if visible is not None:
            flags[0] = MODE_DENSE
            dense = strided(visible, shape, np.bool_)
        z3 = _ints(np.zeros((1, 1, 1)), 3)
        return TileVisibility(ro(flags), *dense, _ints(np.zeros(1), 1),
                              _ints(np.zeros((1, 4)), 2), z3, z3,
                              ro(np.ones((1, 1, 1), dtype=bool)), z3, z3, z3,
                              _ints(np.zeros((1, 1)), 2), _ints(np.zeros((1, 1)), 2))
    flags[0] = MODE_COORDS
    leaves = [leaf.kernel_arguments() for leaf in relation.leaves()]
    H = max(max(a.left.shape[0], a.right.shape[0], a.prefix_length.shape[1]) for a in leaves)

    def stack(get: Any, dtype: Any, width: Any) -> np.ndarray:
        """Leaf arrays broadcast to (B, width) (or (width,)) and stacked: (L, ...)."""
        rows = [np.broadcast_to(np.asarray(get(a), dtype=dtype), width) for a in leaves]
        return ro(np.stack(rows))

    Q, K = shape[2], shape[3]
    leaf_flags = np.array([[int(a.has_segments), int(a.topology),
                            int((np.asarray(a.left) >= 0).any()),  # -1 = unbounded
                            int((np.asarray(a.right) >= 0).any())] for a in leaves],
                          dtype=np.int64)
    dummy = strided(None, shape, np.bool_)
    return TileVisibility(
        ro(flags), *dummy, _ints(relation.program(), 1), ro(leaf_flags),
        stack(lambda a: a.q_pos, np.int64, (B, Q)), stack(lambda a: a.k_pos, np.int64, (B, K)),
        stack(lambda a: a.key_valid, np.bool_, (B, K)),
        stack(lambda a: a.q_segment, np.int64, (B, Q)),
        stack(lambda a: a.k_segment, np.int64, (B, K)),
        stack(lambda a: a.prefix_length, np.int64, (B, H)),
        stack(lambda a: a.left, np.int64, (H,)), stack(lambda a: a.right, np.int64, (H,)),
    )


@kernel(inline="always")
def _per_head(a, h):
    return a[h] if a.shape[0] > 1 else a[0]


@kernel(inline="always")
def _leaf_predicate(has_seg, topo, has_left, has_right, key_ok, q_seg, k_seg, p, r, P, lw,
                    rw):
    """One leaf's predicate on scalars (coordinates already read).

    Scalars only: numba passes arrays to a helper with reference-count updates that cost
    more than the predicate itself when paid per element.
    """
    if not key_ok:
        return False
    if has_seg != 0 and q_seg != k_seg:
        return False
    if topo == TOPO_CAUSAL:
        if r > p:
            return False
    elif topo == TOPO_PREFIX:
        if not ((p < P and r < P) or (p >= P and r <= p)):
            return False
    if has_left != 0 and lw >= 0 and p - r > lw:
        return False
    if has_right != 0 and rw >= 0 and r - p > rw:
        return False
    return True


@kernel(inline="always")
def _leaf_classify(tv, n, b, h, i0, i1, j0, j1):
    """INVISIBLE, PARTIAL or FULL of leaf n on the tile, from block bounds."""
    lf = tv[4][n]
    q_pos, k_pos, key_valid, q_seg, k_seg = tv[5][n], tv[6][n], tv[7][n], tv[8][n], tv[9][n]
    prefix, left, right = tv[10][n], tv[11][n], tv[12][n]
    pmin = rmin = qsmin = ksmin = _I64_MAX
    pmax = rmax = qsmax = ksmax = -_I64_MAX
    n_valid = 0
    for j in range(j0, j1):
        r = k_pos[b, j]
        rmin = min(rmin, r)
        rmax = max(rmax, r)
        n_valid += key_valid[b, j]
        if lf[_HAS_SEG]:
            ksmin = min(ksmin, k_seg[b, j])
            ksmax = max(ksmax, k_seg[b, j])
    for i in range(i0, i1):
        p = q_pos[b, i]
        pmin = min(pmin, p)
        pmax = max(pmax, p)
        if lf[_HAS_SEG]:
            qsmin = min(qsmin, q_seg[b, i])
            qsmax = max(qsmax, q_seg[b, i])
    if n_valid == 0:
        return INVISIBLE
    full = n_valid == j1 - j0
    if lf[_HAS_SEG]:
        if qsmax < ksmin or ksmax < qsmin:
            return INVISIBLE
        full = full and qsmin == qsmax and ksmin == ksmax and qsmin == ksmin
    topo = lf[_TOPO]
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
    if lf[_HAS_LEFT]:
        lw = _per_head(left, h)
        if lw >= 0:
            if pmin - rmax > lw:
                return INVISIBLE
            full = full and pmax - rmin <= lw
    if lf[_HAS_RIGHT]:
        rw = _per_head(right, h)
        if rw >= 0:
            if rmin - pmax > rw:
                return INVISIBLE
            full = full and rmax - pmin <= rw
    return FULL if full else PARTIAL


@kernel
def classify(tv, b, h, i0, i1, j0, j1):
    """INVISIBLE, PARTIAL or FULL for the tile ``[i0, i1) x [j0, j1)`` of head (b, h).

    Coordinates mode decides from block bounds (O(i1 - i0 + j1 - j0) per leaf) and combines
    the leaves' classes by the program: a union is FULL if a term is FULL and INVISIBLE only
    if every term is; an intersection is INVISIBLE if a term is and FULL only if every term
    is; otherwise PARTIAL. Dense mode reads the tile. A PARTIAL answer is always safe: the
    caller then evaluates every element.
    """
    mode = tv[0][0]
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
    prog = tv[3]
    if prog.shape[0] == 1:
        return _leaf_classify(tv, prog[0], b, h, i0, i1, j0, j1)
    stack = 0  # two bits per entry: INVISIBLE 0, PARTIAL 1, FULL 2
    for t in range(prog.shape[0]):
        op = prog[t]
        if op >= 0:
            stack = (stack << 2) | _leaf_classify(tv, op, b, h, i0, i1, j0, j1)
        else:
            x = stack & 3
            y = (stack >> 2) & 3
            if op == OP_OR:
                c = FULL if (x == FULL or y == FULL) else (
                    INVISIBLE if (x == INVISIBLE and y == INVISIBLE) else PARTIAL)
            else:
                c = INVISIBLE if (x == INVISIBLE or y == INVISIBLE) else (
                    FULL if (x == FULL and y == FULL) else PARTIAL)
            stack = ((stack >> 4) << 2) | c
    return stack & 3


@kernel
def tile_mask(out, tv, b, h, i0, i1, j0, j1):
    """``out[:i1-i0, :j1-j0]`` = visibility of the tile; returns the number of visible edges.

    Coordinates mode evaluates the program over the leaves' predicates per element; the
    arrays are read in this loop (never handed to a helper per element).

    Examples
    --------
    >>> from refattn.masks import relation
    >>> rel = relation([[0, 1, 2]], [[0, 1, 2]], causal=True)
    >>> tv = tile_visibility((1, 1, 3, 3), relation=rel)
    >>> out = np.zeros((3, 3), dtype=np.bool_)
    >>> int(tile_mask(out, tv, 0, 0, 0, 3, 0, 3)), bool((out == rel.dense()[0, 0]).all())
    (6, True)
    """
    mode = tv[0][0]
    n = 0
    if mode != MODE_COORDS:
        for i in range(i0, i1):
            for j in range(j0, j1):
                vis = True if mode == MODE_ALL else at(tv[1], tv[2], b, h, i, j)
                out[i - i0, j - j0] = vis
                n += vis
        return n
    prog, flags, q_pos, k_pos, key_valid = tv[3], tv[4], tv[5], tv[6], tv[7]
    q_seg, k_seg, prefix, left, right = tv[8], tv[9], tv[10], tv[11], tv[12]
    hp = h if prefix.shape[2] > 1 else 0
    hw = h if left.shape[1] > 1 else 0
    for i in range(i0, i1):
        for j in range(j0, j1):
            stack = 0
            for t in range(prog.shape[0]):
                op = prog[t]
                if op >= 0:
                    bit = _leaf_predicate(
                        flags[op, _HAS_SEG], flags[op, _TOPO], flags[op, _HAS_LEFT],
                        flags[op, _HAS_RIGHT], key_valid[op, b, j], q_seg[op, b, i],
                        k_seg[op, b, j], q_pos[op, b, i], k_pos[op, b, j], prefix[op, b, hp],
                        left[op, hw], right[op, hw])
                    stack = (stack << 1) | (1 if bit else 0)
                else:
                    x = stack & 1
                    y = (stack >> 1) & 1
                    stack = ((stack >> 2) << 1) | ((x & y) if op == OP_AND else (x | y))
            vis = (stack & 1) == 1
            out[i - i0, j - j0] = vis
            n += vis
    return n
