"""One large call on many workers: shards of the numba streaming backend, assembled exactly.

Owns :func:`value_and_grad` and its plan (:func:`plan_shards`). The single-process streaming
backend (``refattn.forward(call, backend="numba", materialize=False)`` then
``refattn.backward``) runs its forward as independent tasks per (b, h, query block), and its
backward, with one key chunk per task (``B * Hq`` at least numba's thread count, or one
thread), as independent tasks per (b, h) that walk the key blocks in order and, inside each,
the query blocks in order. What each output element depends on, and in which order its sums
run, follows:

- ``output``, ``lse``, ``row_max``: one (b, h, query block) each: any split by batch, head and
  query block gives the same bits.
- ``grad_q``, ``row_dot``: a sum over key blocks in order, per query row: a shard holding
  some query rows and every key reproduces it.
- ``grad_k``, ``grad_v``: per query head, a sum over query blocks in order, per key row (BLAS
  accumulates each block's product into the running sum): a shard holding some key rows and
  every query reproduces it; splitting one key row's query blocks across shards cannot (the
  partial sums would round differently), so that is never done. The query heads sharing a kv
  head are then summed in increasing order, as the backend does.
- ``grad_bias``: summed over the axes the bias broadcasts along. A bias broadcast over the
  batch (or the heads) keeps the whole batch (or all heads) in one shard, as the backend keeps
  them in one task; a bias broadcast over queries takes its gradient from the key shards, one
  broadcast over keys from the query shards, one broadcast over both is never split by blocks.

So a *unit* is one batch row (or all) and one kv head with its query heads (or all heads); with
``rows_per_shard`` a unit's work is split into query shards (forward, then the backward for
``grad_q`` and ``row_dot``) and key shards (the backward again for ``grad_k`` and ``grad_v``,
from the query shards' ``lse`` and ``output``): every score tile is recomputed once more in
the backward, the price of splitting both ways without changing a bit. Each shard is a real
:class:`~refattn.AttentionCall` on the rows and keys it holds, with the same tiles as the whole
call (shard boundaries are multiples of the tile), visibility sliced by coordinates, and a
Philox dropout stream expanded to the shard's multiplier at its absolute coordinates (the
same values the kernel regenerates). A key shard whose rows could be left with no legal key
gets one more key block in front, with a single always-visible zero key, so that the gate
accepts it; that block's contributions land only on its own rows, which are discarded.

This module reproduces the streaming backend's bits, so it takes only what that backend runs
(dot score, post scale, no softcap or sink). Every other feature (softcap, sinks, every score
family and scale placement, with bias, dropout, GQA and varlen relations) is split by keys in
:mod:`refattn.distributed.keyshard`: shards merged with :mod:`refattn.states`, the same
mask and the sink counted once, within a documented float64 bound rather than bit for bit.
The slicing helpers here (:func:`_slice_relation`, :func:`_philox_multiplier`,
:func:`_take4`) serve both.

The call and ``grad_output`` are scattered to every worker once (``broadcast=True``); tasks
name them by future, and each worker slices its shard locally. Workers run one numba thread
per task, so each shard's backward has one key chunk, as the single-process backend has when
``B * Hq`` is at least its thread count.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

import numpy as np

from refattn._boundary import public
from refattn._checks import as_array, check_finite, check_float64, check_shape
from refattn.call import AttentionCall
from refattn.call.hazards import check_backward_overflow
from refattn.call.scores import ScoreFamily
from refattn.dropout import Philox
from refattn.engine import ValueAndGrad, backward, forward
from refattn.engine.trace import Gradients, Trace
from refattn.errors import RefAttnError
from refattn.masks import ComposedRelation, VisibilityRelation

__all__ = ["ShardPlan", "Unit", "plan_shards", "value_and_grad"]

#: the streaming backend's default tile (query rows x key rows), as in refattn.engine.numba
DEFAULT_BLOCK = 256
#: the largest dense dropout multiplier one shard may expand from a Philox stream (bytes)
MAX_SHARD_MULTIPLIER_BYTES = 2**31


@dataclass(frozen=True)
class Unit:
    """The batch rows and heads of one unit of work (never split further by head or batch).

    Attributes
    ----------
    batch : tuple of int
        Batch rows (one, or all when a bias broadcasts over the batch).
    heads : tuple of int
        Query heads, increasing.
    kv : tuple of int
        The kv heads they read (one, or all when a bias broadcasts over the heads).
    """

    batch: tuple[int, ...]
    heads: tuple[int, ...]
    kv: tuple[int, ...]


@public
@dataclass(frozen=True)
class ShardPlan:
    """How :func:`value_and_grad` splits a call.

    Attributes
    ----------
    units : tuple of Unit
    block_q, block_k : int
        The streaming tile (the single-process run to compare with must use the same).
    query_ranges, key_ranges : tuple of (int, int)
        Half-open row ranges, multiples of the tile; one range each without
        ``rows_per_shard``.
    split_backward : bool
        Whether key shards compute ``grad_k``/``grad_v`` (else the query shards, which then
        hold every query row, compute everything).
    bias_gradient : {"none", "query", "key"}
        Which shards' ``grad_bias`` is kept.
    threads : int
        numba's thread count in the single-process run being reproduced.
    key_chunks : int
        Key chunks per backward task in that run (1 when its task groups, ``B * Hq`` or fewer
        with a broadcast bias, are at least ``threads``).
    split_b, split_h : bool
        Whether units split the batch / the heads (no, along an axis a bias broadcasts over).
    reason : str
        Why the backward is not split (empty when it is, or when nothing asked for it).
    """

    units: tuple[Unit, ...]
    block_q: int
    block_k: int
    query_ranges: tuple[tuple[int, int], ...]
    key_ranges: tuple[tuple[int, int], ...]
    split_backward: bool
    bias_gradient: Literal["none", "query", "key"]
    threads: int = 1
    key_chunks: int = 1
    split_b: bool = True
    split_h: bool = True
    reason: str = ""

    def unit_threads(self, unit: Unit) -> int:
        """numba threads a unit's shards run with: 1, or as many as give its backward the
        single-process run's key chunks (chunks x the unit's task groups)."""
        if self.key_chunks == 1:
            return 1
        groups = (len(unit.batch) if self.split_b else 1) * (
            len(unit.heads) if self.split_h else 1)
        return self.key_chunks * groups

    @property
    def tasks(self) -> int:
        """Tasks submitted: query shards, plus key shards when the backward is split."""
        n = len(self.units) * len(self.query_ranges)
        return n + (len(self.units) * len(self.key_ranges) if self.split_backward else 0)


# -- checks and plan --------------------------------------------------------------------------
_KEYSHARD_HINT = ("refattn.distributed.keyshard.key_sharded splits any call by keys (merged "
                  "within a float64 bound)")


def _check_streamable(call: AttentionCall) -> None:
    """What the numba streaming backend runs (the same refusals, before anything is sent)."""
    score = cast(ScoreFamily, call.score)  # validated: never None
    if score.name != "dot":
        raise RefAttnError(f"score: the numba streaming backend runs the dot score only, got "
                           f"{score.name!r}; {_KEYSHARD_HINT}")
    for attr, default in (("scale_placement", "post"), ("softcap", None), ("sink", None)):
        value = getattr(call, attr)
        if not (value is None if default is None else value == default):
            raise RefAttnError(f"{attr}: the numba streaming backend supports only "
                               f"{default!r}; this call cannot be sharded bit for bit "
                               f"here; {_KEYSHARD_HINT}")
    if call.returned_weights != "none":
        raise RefAttnError(f"returned_weights: {call.returned_weights!r} asks for weights, "
                           "which streaming shards never materialise")
    drop = call.dropout
    if drop is not None and not isinstance(drop, (np.ndarray, Philox)):
        raise RefAttnError(f"dropout: shards take a refattn.dropout.Philox stream or an "
                           f"explicit multiplier array, got {type(drop).__name__}")


def _block(name: str, value: Any, n: int) -> int:
    if value is None:
        value = DEFAULT_BLOCK
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise RefAttnError(f"{name}: expected a positive int, got {value!r}")
    return int(min(int(value), n))


def _ranges(n: int, block: int, per_shard: int | None) -> tuple[tuple[int, int], ...]:
    if per_shard is None:
        return ((0, n),)
    step = max(1, math.ceil(per_shard / block)) * block  # shard edges on tile edges
    return tuple((i, min(i + step, n)) for i in range(0, n, step))


def _bias4(call: AttentionCall) -> tuple[int, int, int, int] | None:
    if call.bias is None:
        return None
    shape = call.bias.shape
    return (1,) * (4 - len(shape)) + tuple(shape)


@public
def plan_shards(call: AttentionCall, *, block_q: int | None = None, block_k: int | None = None,
                rows_per_shard: int | None = None, threads: int | None = None) -> ShardPlan:
    """The units, shard ranges and reductions :func:`value_and_grad` uses for ``call``.

    Parameters
    ----------
    call : AttentionCall
    block_q, block_k : int, optional
        The streaming tile (default 256 x 256, capped at Q and K).
    rows_per_shard : int, optional
        Query rows per query shard and key rows per key shard (rounded up to whole tiles);
        None keeps every unit whole (one task per unit, no recomputation).
    threads : int, optional
        numba's thread count in the single-process run to reproduce (default: this
        process's, ``numba.get_num_threads()``). With fewer backward task groups than
        threads, that run deals each group's key blocks to several chunks; the shards then
        run with as many threads as give them the same chunks.

    Examples
    --------
    >>> import numpy as np
    >>> q = np.zeros((2, 4, 64, 8)); kv = np.zeros((2, 2, 64, 8))
    >>> plan = plan_shards(AttentionCall(q, kv, kv), block_q=16, block_k=16, rows_per_shard=32)
    >>> len(plan.units), plan.units[0].heads, plan.query_ranges, plan.tasks
    (4, (0, 1), ((0, 32), (32, 64)), 16)
    >>> bias = np.zeros((1, 1, 64, 1))          # shared by every batch row and head
    >>> plan = plan_shards(AttentionCall(q, kv, kv, bias=bias), block_q=16, block_k=16,
    ...                    rows_per_shard=32)
    >>> len(plan.units), plan.bias_gradient, plan.split_backward
    (1, 'query', True)
    """
    if not isinstance(call, AttentionCall):
        raise RefAttnError(f"call: expected an AttentionCall, got {type(call).__name__}")
    if rows_per_shard is not None and (isinstance(rows_per_shard, bool) or not isinstance(
            rows_per_shard, numbers.Integral) or rows_per_shard < 1):
        raise RefAttnError(f"rows_per_shard: expected a positive int or None, got "
                           f"{rows_per_shard!r}")
    if threads is None:
        import numba

        threads = numba.get_num_threads()
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral) or threads < 1:
        raise RefAttnError(f"threads: expected a positive int, got {threads!r}")
    B, Hq, Q, K = call.score_shape
    Hkv = call.k.shape[1]
    BQ, BK = _block("block_q", block_q, Q), _block("block_k", block_k, K)
    b4 = _bias4(call)
    split_b = b4 is None or b4[0] == B or B == 1  # the backend's task layout (its _partition)
    split_h = b4 is None or b4[1] == Hq or Hq == 1
    groups = (B if split_b else 1) * (Hq if split_h else 1)
    chunks = 1 if groups >= threads else min(-(-K // BK), math.ceil(threads / groups))
    batches = [(b,) for b in range(B)] if split_b else [tuple(range(B))]
    head_map = np.asarray(call.head_map)
    if split_h:
        groups = [(tuple(int(h) for h in np.flatnonzero(head_map == g)), (g,))
                  for g in range(Hkv)]
        groups = [(hs, kv) for hs, kv in groups if hs]  # a kv head no query head reads: 0
    else:
        groups = [(tuple(range(Hq)), tuple(range(Hkv)))]
    units = tuple(Unit(bs, hs, kv) for bs in batches for hs, kv in groups)
    q_ranges = _ranges(Q, BQ, rows_per_shard)
    k_ranges = _ranges(K, BK, rows_per_shard)
    bias_gradient: Literal["none", "query", "key"] = "none"
    split, reason = rows_per_shard is not None, ""
    if b4 is not None:
        if b4[2] == Q or len(q_ranges) == 1:
            bias_gradient = "query"
        elif b4[3] == K:
            bias_gradient = "key"
        else:
            split, reason = False, ("the bias broadcasts over both queries and keys, so its "
                                    "gradient sums every tile of a unit in one order")
            bias_gradient = "query"
    if not split:
        q_ranges = ((0, Q),)
    if split and len(q_ranges) == 1 and len(k_ranges) == 1:
        split = False  # one tile range each way: the whole unit is one shard
    return ShardPlan(units, BQ, BK, q_ranges, k_ranges if split else ((0, K),), split,
                     bias_gradient, int(threads), chunks, split_b, split_h, reason)


# -- sub-calls --------------------------------------------------------------------------------
def _axis_take(x: np.ndarray, axis: int, index: Any) -> np.ndarray:
    """``x`` restricted along ``axis`` (left alone where it is broadcast: size 1)."""
    if x.shape[axis] == 1 or index is None:
        return x
    if isinstance(index, slice):
        return x[(slice(None),) * axis + (index,)]
    return np.take(x, np.asarray(index, dtype=np.int64), axis=axis)


def _take4(x: np.ndarray, b: Any, h: Any, i: Any, j: Any) -> np.ndarray:
    """A (B|1, H|1, Q|1, K|1)-broadcastable array restricted to a shard (4-D result)."""
    x4 = x.reshape((1,) * (4 - x.ndim) + x.shape)
    for axis, index in enumerate((b, h, i, j)):
        x4 = _axis_take(x4, axis, index)
    return np.ascontiguousarray(x4)


def _slice_leaf(rel: VisibilityRelation, b: Any, h: Any, i: slice, j: slice
                ) -> VisibilityRelation:
    """A coordinate relation on a shard's batch rows, heads, query and key rows."""
    def take(x: np.ndarray, cols: slice | None) -> np.ndarray:
        x = _axis_take(x, 0, b)
        return x if cols is None else x[:, cols]

    def rows(x: np.ndarray | None, cols: slice | None) -> np.ndarray | None:
        return None if x is None else take(x, cols)

    prefix = cast("np.ndarray | None", rel.prefix_length)  # validated: (B,) or (B, H)
    if prefix is not None:
        prefix = _axis_take(prefix, 0, b)
        if prefix.ndim == 2:
            prefix = _axis_take(prefix, 1, h)
    window = rel.window
    if window is not None:
        left, right = (_axis_take(np.asarray(w), 0, h) if isinstance(w, np.ndarray) else w
                       for w in window)
        window = (left, right)
    positional = rel.causal or rel.prefix_length is not None or rel.window is not None
    return replace(rel, q_pos=take(rel.q_pos, i), k_pos=take(rel.k_pos, j),
                   key_valid=rows(rel.key_valid, j), q_segment=rows(rel.q_segment, i),
                   k_segment=rows(rel.k_segment, j), prefix_length=prefix, window=window,
                   alignment="explicit_positions" if positional else "none")


def _slice_relation(rel: Any, b: Any, h: Any, i: slice, j: slice) -> Any:
    if isinstance(rel, ComposedRelation):
        return ComposedRelation(rel.op, [_slice_relation(t, b, h, i, j) for t in rel.terms])
    return _slice_leaf(rel, b, h, i, j)


def _prepend_leaf(rel: VisibilityRelation, n: int) -> VisibilityRelation:
    """``rel`` with ``n`` invisible keys in front (coordinates 0, invalid)."""
    B = rel.k_pos.shape[0]

    def front(x: np.ndarray, fill: Any) -> np.ndarray:
        return np.concatenate([np.full((B, n), fill, dtype=x.dtype), x], axis=1)

    def front_or_none(x: np.ndarray | None, fill: Any) -> np.ndarray | None:
        return None if x is None else front(x, fill)

    return replace(rel, k_pos=front(rel.k_pos, 0), key_valid=front_or_none(rel.key_valid, False),
                   k_segment=front_or_none(rel.k_segment, -1))


def _prepend_relation(rel: Any, n: int) -> Any:
    if isinstance(rel, ComposedRelation):
        return ComposedRelation(rel.op, [_prepend_relation(t, n) for t in rel.terms])
    return _prepend_leaf(rel, n)


def _philox_multiplier(source: Philox, Hq: int, batch: Sequence[int], heads: Sequence[int],
                       i: tuple[int, int], j: tuple[int, int]) -> np.ndarray:
    """The stream's Z on a shard, at absolute coordinates: (B', H', Q', K') float64."""
    from refattn.engine.numba.philox import philox_params, philox_row

    params = philox_params(source)
    (i0, i1), (j0, j1) = i, j
    nbytes = 8 * len(batch) * len(heads) * (i1 - i0) * (j1 - j0)
    if nbytes > MAX_SHARD_MULTIPLIER_BYTES:
        raise RefAttnError(f"dropout: one shard would expand the Philox stream to "
                           f"{nbytes / 2**30:.1f} GiB of multipliers (limit "
                           f"{MAX_SHARD_MULTIPLIER_BYTES / 2**30:.0f} GiB); pass a smaller "
                           "rows_per_shard")
    z = np.empty((len(batch), len(heads), i1 - i0, j1 - j0))  # (B', H', Q', K')
    for bi, b in enumerate(batch):
        for hi, h in enumerate(heads):
            for r in range(i1 - i0):
                philox_row(z[bi, hi, r], b * Hq + h, i0 + r, j0, j1 - j0, *params)
    return z


def _shard_call(call: AttentionCall, unit: Unit, i: tuple[int, int], j: tuple[int, int], *,
                front: int = 0) -> AttentionCall:
    """The call restricted to a unit's rows (queries ``i``, keys ``j``); with ``front`` > 0,
    a block of that many keys in front whose first key is zero and visible to every row."""
    B, Hq = call.score_shape[:2]
    bsel: Any = slice(None) if len(unit.batch) == B else list(unit.batch)
    hsel: Any = slice(None) if len(unit.heads) == Hq else list(unit.heads)
    kvsel: Any = slice(None) if len(unit.kv) == call.k.shape[1] else list(unit.kv)
    isl, jsl = slice(*i), slice(*j)
    q = _take4(call.q, bsel, hsel, isl, None)  # (B', H', Q', Dk)
    k = _take4(call.k, bsel, kvsel, jsl, None)  # (B', Hkv', K', Dk)
    v = _take4(call.v, bsel, kvsel, jsl, None)  # (B', Hkv', K', Dv)
    position = {g: n for n, g in enumerate(unit.kv)}
    call_map = cast(np.ndarray, call.head_map)  # validated: (Hq,) int64
    head_map = np.array([position[int(call_map[h])] for h in unit.heads], dtype=np.int64)
    kw: dict[str, Any] = {"scale": call.scale, "head_map": head_map,
                          "all_masked_rows": call.all_masked_rows}
    visible: Any = None
    if call.relation is not None:
        visible = _slice_relation(call.relation, bsel, hsel, isl, jsl)
    elif call.visible is not None:  # no relation: an array
        visible = _take4(cast(np.ndarray, call.visible), bsel, hsel, isl, jsl)
    if call.query_valid is not None:
        kw["query_valid"] = _take4(call.query_valid, bsel, None, isl, None)
    bias = None if call.bias is None else _take4(call.bias, bsel, hsel, isl, jsl)
    drop: Any = call.dropout
    if isinstance(drop, Philox):
        drop = _philox_multiplier(drop, Hq, unit.batch, unit.heads, i, j)
    elif isinstance(drop, np.ndarray):
        drop = _take4(drop, bsel, hsel, isl, jsl)
    if front:
        def pad(x: np.ndarray, value: float) -> np.ndarray:  # n keys in front along axis 2
            block = np.full((*x.shape[:2], front, x.shape[3]), value, dtype=x.dtype)
            return np.concatenate([block, x], axis=2)

        k, v = pad(k, 0.0), pad(v, 0.0)

        def pad_keys(x: np.ndarray | None, value: Any) -> np.ndarray | None:
            if x is None or x.shape[3] == 1:
                return x
            block = np.full((*x.shape[:3], front), value, dtype=x.dtype)
            return np.concatenate([block, x], axis=3)

        bias = pad_keys(bias, 0.0)
        drop = pad_keys(drop, 1.0) if isinstance(drop, np.ndarray) else drop
        if isinstance(visible, np.ndarray):
            visible = np.broadcast_to(visible, (*visible.shape[:3], j[1] - j[0]))
            block = np.zeros((*visible.shape[:3], front), dtype=bool)
            block[..., 0] = True  # the zero key: visible to every row
            visible = np.concatenate([block, visible], axis=3)
        elif visible is not None:
            rel = _prepend_relation(visible, front)
            Bq = rel.shape[0]
            q_pos = np.zeros((Bq, i[1] - i[0]), dtype=np.int64)
            k_pos = np.zeros((Bq, front + j[1] - j[0]), dtype=np.int64)
            valid = np.zeros((Bq, front + j[1] - j[0]), dtype=bool)
            valid[:, 0] = True
            visible = rel | VisibilityRelation(q_pos, k_pos, valid)
    if visible is not None:
        kw["visible"] = visible
    if bias is not None:
        kw["bias"] = bias
    if drop is not None:
        kw["dropout"] = drop
    return AttentionCall(q, k, v, **kw)


# -- tasks (run on the workers) ---------------------------------------------------------------
class _Threads:
    """numba's thread count set for one task (the backward's key chunks follow it)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __enter__(self) -> None:
        import numba

        limit = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]  # set at import
        if self.n > limit:
            raise RefAttnError(
                f"threads: reproducing the single-process key chunks needs {self.n} numba "
                f"threads in a task, and this worker has {limit}; "
                "pass threads= (the local run's numba thread count) no larger than that")
        self.previous = numba.get_num_threads()
        numba.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        import numba

        numba.set_num_threads(self.previous)


def _shard_grad_output(call: AttentionCall, g: np.ndarray, unit: Unit, i: tuple[int, int]
                       ) -> np.ndarray:
    B, Hq = call.score_shape[:2]
    bsel: Any = slice(None) if len(unit.batch) == B else list(unit.batch)
    hsel: Any = slice(None) if len(unit.heads) == Hq else list(unit.heads)
    return _take4(g, bsel, hsel, slice(*i), None)  # (B', H', Q', Dv)


def query_shard(call: AttentionCall, g: np.ndarray, unit: Unit, i: tuple[int, int],
                block_q: int, block_k: int, keep_kv: bool = True, threads: int = 1
                ) -> dict[str, Any]:
    """Forward and backward of a unit's query rows ``i`` against every key (a worker task);
    ``keep_kv=False`` leaves out ``grad_k``/``grad_v`` (the key shards compute them)."""
    t0 = time.perf_counter()
    with _Threads(threads):
        sub = _shard_call(call, unit, i, (0, call.score_shape[3]))
        trace = forward(sub, backend="numba", materialize=False, block_q=block_q,
                        block_k=block_k)
        grads = backward(trace, _shard_grad_output(call, g, unit, i))
    return {"output": trace.output, "lse": trace.lse, "row_max": trace.row_max,
            "sanitized_rows": trace.sanitized_rows, "grad_q": grads.grad_q,
            "row_dot": grads.row_dot, "row_dot_output": grads.row_dot_output,
            "grad_k": grads.grad_k if keep_kv else None,
            "grad_v": grads.grad_v if keep_kv else None, "grad_bias": grads.grad_bias,
            "seconds": time.perf_counter() - t0}


#: what a key shard needs from a query shard (the rest stays where it was computed)
SAVED = ("output", "lse", "row_max", "sanitized_rows")


def saved_rows(result: dict[str, Any]) -> dict[str, np.ndarray]:
    """The forward rows a key shard reads, from a query shard's result (a worker task that
    runs where the result is, so only these rows travel to the key shards)."""
    return {name: result[name] for name in SAVED}


def key_shard(call: AttentionCall, g: np.ndarray, unit: Unit, j: tuple[int, int],
              block_q: int, block_k: int, forwards: Sequence[dict[str, Any]],
              threads: int = 1) -> dict[str, Any]:
    """``grad_k``, ``grad_v`` (and a bias gradient) of a unit's keys ``j`` from every query
    row, given the query shards' forward results in query order (a worker task).

    With a visibility, a row may have no legal key among ``j``: a block of ``block_k`` keys
    goes in front (a zero key every row sees, then invisible ones), so the gate accepts the
    shard; the real keys keep the tiles they have in the whole call."""
    t0 = time.perf_counter()
    Q = call.score_shape[2]
    n = block_k if call.relation is not None or call.visible is not None else 0
    with _Threads(threads):
        sub = _shard_call(call, unit, (0, Q), j, front=n)
        saved = {name: np.concatenate([f[name] for f in forwards], axis=2) for name in SAVED}
        trace = Trace(call=sub, scores=None, biased_scores=None, masked_scores=None,
                      row_max=saved["row_max"], lse=saved["lse"], probs=None,
                      dropout_multiplier=None, consumed=None, output=saved["output"],
                      sanitized_rows=saved["sanitized_rows"], backend="numba",
                      materialized={"scores": False, "probabilities": False,
                                    "mode": "streaming", "block_q": block_q,
                                    "block_k": block_k})
        grads = backward(trace, _shard_grad_output(call, g, unit, (0, Q)))
    bias = grads.grad_bias
    if bias is not None and n and bias.shape[-1] > 1:
        bias = bias[..., n:]
    return {"grad_k": grads.grad_k[:, :, n:], "grad_v": grads.grad_v[:, :, n:],
            "grad_bias": bias, "seconds": time.perf_counter() - t0}


# -- the driver -------------------------------------------------------------------------------
def _check_grad_output(call: AttentionCall, grad_output: object) -> np.ndarray:
    g = as_array("grad_output", grad_output)
    check_float64("grad_output", g)
    B, Hq, Q, _ = call.q.shape
    check_shape("grad_output", g, (B, Hq, Q, call.v.shape[3]), "B,Hq,Q,Dv")
    check_finite("grad_output", g)
    check_backward_overflow(call, g)
    return np.ascontiguousarray(g)


@public
def value_and_grad(call: AttentionCall, grad_output: np.ndarray, *, client: Any,
                   block_q: int | None = None, block_k: int | None = None,
                   rows_per_shard: int | None = None, threads: int | None = None
                   ) -> ValueAndGrad:
    """Output and gradients of one call, computed in shards on a dask cluster's workers.

    Bit-identical to ``refattn.backward(refattn.forward(call, backend="numba",
    materialize=False, block_q=..., block_k=...), grad_output)`` run in one process with
    ``threads`` numba threads (by default this process's count, so: a local run here). See
    the module docstring for how the work is split.

    Parameters
    ----------
    call : AttentionCall
        A call the numba streaming backend runs: dot score, post scale placement, no
        softcap or sink, no returned weights; dropout None, an array or a Philox stream.
    grad_output : (B, Hq, Q, Dv) float64 ndarray
    client : distributed.Client
        The cluster (:func:`~refattn.distributed.cluster.connect`).
    block_q, block_k : int, optional
        The streaming tile (default 256 x 256, capped at Q and K).
    rows_per_shard : int, optional
        Split each (batch row, kv-head group) unit into query shards and key shards of about
        this many rows (whole tiles); None keeps units whole (no recomputation). See
        :func:`plan_shards`.
    threads : int, optional
        numba's thread count in the single-process run to reproduce (default: this
        process's). It matters only when the backward has fewer task groups than threads
        (see :func:`plan_shards`); the workers then need that many numba threads.

    Returns
    -------
    ValueAndGrad
        ``output`` (B, Hq, Q, Dv) and ``gradients``: grad_q (B, Hq, Q, Dk), grad_k
        (B, Hkv, K, Dk), grad_v (B, Hkv, K, Dv), grad_bias (the bias's shape), row_dot and
        row_dot_output (B, Hq, Q); the (B, Hq, Q, K) intermediates are None, as from the
        streaming backend.

    Raises
    ------
    RefAttnError
        A call the streaming backend cannot run, a bad ``grad_output``, a shard whose
        dropout multiplier would exceed 2 GiB, or a task that failed on the workers.

    Examples
    --------
    >>> import numpy as np, refattn
    >>> from refattn.distributed import connect
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 8, 4)) for _ in range(3))
    >>> call, g = refattn.AttentionCall(q, k, v), np.ones((1, 2, 8, 4))
    >>> with connect(workers=1) as client:  # doctest: +SKIP
    ...     out, grads = value_and_grad(call, g, client=client, block_q=4, block_k=4,
    ...                                 rows_per_shard=4)
    >>> grads.grad_k.shape  # doctest: +SKIP
    (1, 2, 8, 4)
    """
    if client is None:
        raise RefAttnError("client: value_and_grad shards a call over a dask cluster; pass "
                           "client= (refattn.distributed.connect), or use "
                           "refattn.value_and_grad in this process")
    plan = plan_shards(call, block_q=block_q, block_k=block_k, rows_per_shard=rows_per_shard,
                       threads=threads)
    _check_streamable(call)
    g = _check_grad_output(call, grad_output)
    if isinstance(call.dropout, Philox):  # refuse oversized multipliers before submitting
        Q, K = call.score_shape[2:]
        rows = max(b - a for a, b in plan.query_ranges)
        keys = max(b - a for a, b in plan.key_ranges)
        worst = max(len(u.batch) * len(u.heads) for u in plan.units) * max(rows * K, Q * keys)
        if 8 * worst > MAX_SHARD_MULTIPLIER_BYTES:
            raise RefAttnError(f"dropout: one shard would expand the Philox stream to "
                               f"{8 * worst / 2**30:.1f} GiB of multipliers (limit "
                               f"{MAX_SHARD_MULTIPLIER_BYTES / 2**30:.0f} GiB); pass a "
                               "smaller rows_per_shard")
    from refattn.distributed.cluster import dask_distributed

    d = dask_distributed()
    call_f = client.scatter(call, broadcast=True, hash=False)  # once per worker
    g_f = client.scatter(g, broadcast=True, hash=False)
    BQ, BK = plan.block_q, plan.block_k
    keep_kv = not plan.split_backward
    fwd = {(u, r): client.submit(query_shard, call_f, g_f, plan.units[u], rng, BQ, BK, keep_kv,
                                 plan.unit_threads(plan.units[u]), pure=False)
           for u in range(len(plan.units)) for r, rng in enumerate(plan.query_ranges)}
    back = {}
    if plan.split_backward:
        for u, unit in enumerate(plan.units):
            deps = [client.submit(saved_rows, fwd[(u, r)], pure=False)
                    for r in range(len(plan.query_ranges))]
            for r, rng in enumerate(plan.key_ranges):
                back[(u, r)] = client.submit(key_shard, call_f, g_f, unit, rng, BQ, BK, deps,
                                             plan.unit_threads(unit), pure=False)
    futures = {**{f: ("q", key) for key, f in fwd.items()},
               **{f: ("k", key) for key, f in back.items()}}
    try:
        results = {}
        for future in d.as_completed(list(futures), loop=client.loop):
            try:
                results[futures[future]] = future.result()
            except RefAttnError:
                raise
            except Exception as exc:
                reason = " ".join(str(exc).split()) or type(exc).__name__
                raise RefAttnError(f"value_and_grad: a shard failed on the workers "
                                   f"({type(exc).__name__}: {reason})") from None
    finally:
        client.cancel([f for f in futures if not f.done()])
        for f in (call_f, g_f):
            f.release()
    return _assemble(call, g, plan, results)


def _assemble(call: AttentionCall, g: np.ndarray, plan: ShardPlan,
              results: dict[tuple[str, tuple[int, int]], dict[str, Any]]) -> ValueAndGrad:
    B, Hq, Q, K = call.score_shape
    Hkv, Dk, Dv = call.k.shape[1], call.q.shape[3], call.v.shape[3]
    out = np.zeros((B, Hq, Q, Dv))  # (B, Hq, Q, Dv)
    dq = np.zeros((B, Hq, Q, Dk))  # (B, Hq, Q, Dk)
    rowdot, dvec = np.zeros((B, Hq, Q)), np.zeros((B, Hq, Q))
    dk, dv = np.zeros((B, Hkv, K, Dk)), np.zeros((B, Hkv, K, Dv))
    b4 = _bias4(call)
    gbias = None if b4 is None else np.zeros(b4)
    identity = np.array_equal(cast(np.ndarray, call.head_map), np.arange(Hkv))
    for u, unit in enumerate(plan.units):
        hsel = np.ix_(unit.batch, unit.heads)
        for r, (i0, i1) in enumerate(plan.query_ranges):
            res = results[("q", (u, r))]
            out[hsel[0], hsel[1], i0:i1] = res["output"]
            dq[hsel[0], hsel[1], i0:i1] = res["grad_q"]
            rowdot[hsel[0], hsel[1], i0:i1] = res["row_dot"]
            dvec[hsel[0], hsel[1], i0:i1] = res["row_dot_output"]
            if gbias is not None and plan.bias_gradient == "query":
                _place_bias(gbias, res["grad_bias"], unit, (i0, i1), (0, K))
        key_results = ([(j, results[("k", (u, r))]) for r, j in enumerate(plan.key_ranges)]
                       if plan.split_backward else [((0, K), results[("q", (u, 0))])])
        kvsel = np.ix_(unit.batch, unit.kv)
        for (j0, j1), res in key_results:
            gk, gv = res["grad_k"], res["grad_v"]
            if not identity and len(unit.heads) == len(unit.kv):
                gk, gv = gk + 0.0, gv + 0.0  # the backend sums into zeros: 0 + (-0.0) = +0.0
            dk[kvsel[0], kvsel[1], j0:j1] = gk
            dv[kvsel[0], kvsel[1], j0:j1] = gv
            if gbias is not None and plan.bias_gradient == "key":
                _place_bias(gbias, res["grad_bias"], unit, (0, Q), (j0, j1))
    grads = Gradients(
        grad_output=g, grad_v=dv, grad_consumed=None, grad_probs=None, row_dot=rowdot,
        row_dot_output=dvec, grad_scores=None, grad_q=dq, grad_k=dk,
        grad_bias=None if gbias is None or call.bias is None else gbias.reshape(call.bias.shape),
    )
    return ValueAndGrad(out, grads)


def _place_bias(gbias: np.ndarray, part: np.ndarray, unit: Unit, i: tuple[int, int],
                j: tuple[int, int]) -> None:
    """Write a shard's bias gradient into the (padded 4-D) whole, along non-broadcast axes."""
    index = [[0] if size == 1 else sel for size, sel in zip(
        gbias.shape, (list(unit.batch), list(unit.heads), list(range(*i)), list(range(*j))),
        strict=True)]
    part4 = part.reshape((1,) * (4 - part.ndim) + part.shape)
    gbias[np.ix_(*index)] = part4
