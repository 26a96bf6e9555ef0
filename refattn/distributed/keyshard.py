"""One call split into key shards, every engine feature kept, merged with refattn.states.

Owns :func:`key_sharded` and :class:`KeySharded`. A call is cut into ``n`` contiguous key
ranges; each range is a real :class:`~refattn.AttentionCall` on its keys (run in this process
on the NumPy reference backend, the one that runs every feature) and the partial states
``(output, lse)`` are merged with :func:`refattn.states.merge_states` (natural lse, refattn's
layout). What each shard keeps:

- keys ``k``, ``v`` and the bias sliced to the range (a bias broadcast over keys kept whole);
  the queries, the head map (GQA), the scale, its placement (post, q, k, split), the score
  family (dot, bilinear, additive, cosine, with their parameters) and the softcap unchanged:
  each is a per-(query, key) function, so a shard computes the same scores as the whole call;
- visibility sliced by coordinates (a :class:`~refattn.masks.VisibilityRelation` or a
  composition of them: positions, segments of packed/varlen sequences, windows, prefixes;
  :func:`refattn.distributed.shard._slice_relation`), or an array sliced;
- dropout: a :class:`~refattn.dropout.Philox` stream expanded at the shard's *absolute* key
  coordinates (:func:`refattn.distributed.shard._philox_multiplier`), so every shard's mask
  is the unsharded mask's slice, bit for bit; a multiplier array is sliced;
- the sink in no shard: it is a partial of its own, output 0 and lse the sink logit, merged
  once (a sink in every shard would count its mass ``n`` times);
- a query row with no visible key in a shard: the shard's call gives that row key 0 (the
  reference's own sanitising, done before the gate, so the gate sees a legal row), and its
  partial is then replaced by the empty state (output 0, lse -inf: weight 0 in the merge).

The backward is ring attention's (zhuzilin/ring-flash-attention ``ring_flash_attn.py``,
``ring_flash_attn_backward``, commit 0fc25b46: every step's ``_flash_attn_backward`` receives
the *global* ``out`` and ``softmax_lse``, and ``dq`` is summed over steps): a shard
recomputes ``P = exp(S_shard - lse)`` with the merged lse, so ``P`` is the whole call's
probabilities restricted to the shard, and ``D_i = <dO_i, O_i>`` with the merged output (equal
to ``sum_j P_ij G_P,ij`` over all keys, dropout included); then ``dS = P (G_P - D)``, the
softcap's ``1 - tanh^2``, and the score family's own backward
(:meth:`~refattn.call.scores.ScoreFamily.compatibility_backward`) at the scale placement, as
:func:`refattn.engine.reference.backward_arrays` does for the whole call. ``grad_q`` and the
family parameters' gradients are summed over shards in shard order, ``grad_k``/``grad_v`` and a
key-indexed ``grad_bias`` placed at the shard's keys (a bias broadcast over keys: summed), and
``grad_sink`` is the sink partial's lse gradient from
:func:`refattn.states.merge_states_backward` (``-w_sink D``), summed over batch and queries.

Exactness. Against the unsharded call on the NumPy reference: one shard (``shards=1``, no
sink) gives the same bits forward (a single partial merges to itself: weight exactly 1);
every shard's dropout multiplier is bit-identical to the unsharded one's slice; rows with no
legal key anywhere get output exactly 0 (lse -inf where the unsharded call, sanitising, reports
key 0's score). Nothing else can be byte-identical to the unsharded numba call (or the
reference): the merge sums the keys' terms in another order (per shard, then across shards)
and normalises by ``exp(lse_i - lse)`` instead of dividing by the whole row's sum. The float64
bound, for a row ``i`` whose scores and lse satisfy ``|S_ij| + |lse_i| <= R`` over its legal
keys, with ``gamma = 8 (K + n + D + R + 2) eps`` (eps = 2**-53, D the head width)::

    |O_sharded - O_unsharded|_id     <= gamma * sum_j |P_ij Z_ij| |V_jd|
    |lse_sharded - lse_unsharded|_i  <= gamma * (1 + |lse_i|)

and for each gradient a normwise bound of the same ``gamma`` times the magnitudes of the terms
it sums (``tests/distributed/test_keyshard.py`` checks both). (layer: distributed; imports
engine, call, masks, dropout, states; never dask)
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from refattn._boundary import public
from refattn._checks import as_array, check_finite, check_float64, check_shape
from refattn._memory import check_bytes
from refattn.call import AttentionCall
from refattn.call.hazards import check_backward_overflow
from refattn.call.placement import operand_multipliers
from refattn.call.scores import ScoreFamily
from refattn.distributed.shard import _philox_multiplier, _slice_relation, _take4
from refattn.dropout import Philox
from refattn.engine import forward
from refattn.engine.reduce import gather_heads, reduce_to_shape, sum_heads
from refattn.engine.trace import Gradients, Trace
from refattn.errors import RefAttnError
from refattn.masks import ComposedRelation, VisibilityRelation
from refattn.states import merge_states, merge_states_backward

__all__ = ["KeySharded", "key_sharded"]


@public
@dataclass(frozen=True, eq=False)
class KeySharded:
    """The result of :func:`key_sharded`.

    Attributes
    ----------
    output : (B, Hq, Q, Dv) ndarray
        The merged output.
    lse : (B, Hq, Q) ndarray
        The merged natural log-sum-exp (the sink included); -inf for a row with no legal
        key and no sink.
    ranges : tuple of (int, int)
        The shards' half-open key ranges, in order.
    partial_outputs : (S, B, Hq, Q, Dv) ndarray
        Each shard's partial output, then (with a sink) the sink's zeros.
    partial_lses : (S, B, Hq, Q) ndarray
        Their lses (-inf where a shard has no legal key for the row), then the sink logits.
    multipliers : tuple of ndarray or None
        Each shard's dropout multiplier (B, Hq, Q, K_shard) as its call received it (None
        without dropout).
    gradients : Gradients or None
        With ``grad_output``: grad_q, grad_k, grad_v, grad_bias, grad_sink,
        grad_score_params, row_dot and row_dot_output (both ``<dO, O>``); the (B, Hq, Q, K)
        intermediates None.
    """

    output: np.ndarray
    lse: np.ndarray
    ranges: tuple[tuple[int, int], ...]
    partial_outputs: np.ndarray
    partial_lses: np.ndarray
    multipliers: tuple[np.ndarray | None, ...]
    gradients: Gradients | None


@dataclass(frozen=True, eq=False)
class _Part:
    """One key shard's forward: its trace, the rows it has no key for, its partial state."""

    keys: tuple[int, int]
    trace: Trace
    empty: np.ndarray  # (B, Hq, Q) bool
    output: np.ndarray  # (B, Hq, Q, Dv)
    lse: np.ndarray  # (B, Hq, Q)


# -- one shard's call -------------------------------------------------------------------------
def _ranges(K: int, shards: int) -> tuple[tuple[int, int], ...]:
    edges = [(K * s) // shards for s in range(shards + 1)]
    return tuple((edges[s], edges[s + 1]) for s in range(shards))


def _shard_multiplier(call: AttentionCall, j: tuple[int, int]) -> np.ndarray | None:
    """The dropout multiplier on keys ``j`` (B|1, Hq|1, Q|1, K') at absolute coordinates."""
    drop = call.dropout
    if drop is None:
        return None
    B, Hq, Q, _ = call.score_shape
    if isinstance(drop, Philox):
        return _philox_multiplier(drop, Hq, range(B), range(Hq), (0, Q), j)
    if isinstance(drop, np.ndarray):
        return _take4(drop, None, None, None, slice(*j))
    return np.ascontiguousarray(cast(np.ndarray, call.multiplier_full())[..., j[0]:j[1]])


def _shard_visibility(call: AttentionCall, j: tuple[int, int]) -> tuple[Any, np.ndarray]:
    """Keys ``j``'s visibility (a relation sliced by coordinates, or an array) and the
    (B, Hq, Q) rows that have no legal key there; such rows are given key 0 (dense)."""
    B, Hq, Q, _ = call.score_shape
    shape = (B, Hq, Q, j[1] - j[0])
    rel = call.relation
    vis: Any = None
    if rel is not None and isinstance(rel, (VisibilityRelation, ComposedRelation)):
        vis = _slice_relation(rel, slice(None), slice(None), slice(None), slice(*j))
        has = np.broadcast_to(vis.row_any(), shape[:3])
    elif rel is not None:  # another relation type: its dense form, sliced
        vis = np.ascontiguousarray(call.visible_full()[..., j[0]:j[1]])
        has = np.asarray(vis.any(axis=-1))
    elif call.visible is not None:
        vis = _take4(cast(np.ndarray, call.visible), None, None, None, slice(*j))
        has = np.asarray(np.broadcast_to(vis, shape).any(axis=-1))
    else:
        has = np.ones(shape[:3], dtype=bool)
    empty = ~np.asarray(has)
    if empty.any():
        check_bytes(int(np.prod(shape)), "a key shard's dense visibility (rows with no key there)")
        dense = vis.dense() if isinstance(vis, (VisibilityRelation, ComposedRelation)) else vis
        dense = np.array(np.broadcast_to(dense, shape))
        dense[..., 0] |= empty  # the reference's temporary key, before the gate
        vis = dense
    return vis, empty


def _shard_kwargs(call: AttentionCall, j: tuple[int, int]) -> tuple[dict[str, Any], np.ndarray]:
    """The keyword arguments of keys ``j``'s AttentionCall (no sink) and its empty rows."""
    sl = slice(*j)
    vis, empty = _shard_visibility(call, j)
    kw: dict[str, Any] = {
        "q": call.q, "k": call.k[:, :, sl], "v": call.v[:, :, sl], "scale": call.scale,
        "head_map": call.head_map, "query_valid": call.query_valid, "score": call.score,
        "scale_placement": call.scale_placement, "softcap": call.softcap,
        "all_masked_rows": "reject", "visible": vis,
        "bias": None if call.bias is None else _take4(call.bias, None, None, None, sl),
        "dropout": _shard_multiplier(call, j),
    }
    return kw, empty


def _shard_forward(call: AttentionCall, j: tuple[int, int]) -> _Part:
    kw, empty = _shard_kwargs(call, j)
    trace = forward(AttentionCall(**kw), backend="numpy")
    out = np.where(empty[..., None], 0.0, trace.output)  # (B, Hq, Q, Dv)
    lse = np.where(empty, -np.inf, trace.lse)  # (B, Hq, Q)
    return _Part(j, trace, empty, out, lse)


# -- one shard's backward ---------------------------------------------------------------------
def _backward_lse(part: _Part, merged_lse: np.ndarray) -> np.ndarray:
    """The lse a shard's backward recomputes P with: the merged one (ring attention)."""
    return merged_lse


def _shard_backward(part: _Part, lse: np.ndarray, g_o: np.ndarray, row_dot: np.ndarray
                    ) -> dict[str, Any]:
    """Gradients of one shard's keys from the global lse and ``D = <dO, O>`` (B, Hq, Q)."""
    trace = part.trace
    call = trace.call
    check_bytes(6 * 8 * int(np.prod(call.score_shape)), "a key shard's backward")
    live = ~part.empty & np.isfinite(lse)  # (B, Hq, Q): rows with legal keys in this shard
    with np.errstate(invalid="ignore", over="ignore"):
        arg = np.where(live[..., None], cast(np.ndarray, trace.masked_scores) - np.where(
            live, lse, 0.0)[..., None], -np.inf)
    p = np.exp(arg)  # (B, Hq, Q, K') the whole call's P restricted to the shard
    z = np.broadcast_to(cast(np.ndarray, trace.dropout_multiplier), p.shape)
    head_map = cast(np.ndarray, call.head_map)
    Hkv = call.k.shape[1]
    k_eff = gather_heads(call.k, head_map)  # (B, Hq, K', Dk)
    v_eff = gather_heads(call.v, head_map)  # (B, Hq, K', Dv)
    grad_v = sum_heads((p * z).swapaxes(-1, -2) @ g_o, head_map, Hkv)  # (B, Hkv, K', Dv)
    grad_probs = (g_o @ v_eff.swapaxes(-1, -2)) * z  # (B, Hq, Q, K')
    grad_scores = p * (grad_probs - row_dot[..., None])  # (B, Hq, Q, K')
    grad_scaled = grad_scores
    if call.softcap is not None:
        t = cast(np.ndarray, trace.scores) / call.softcap  # tanh(alpha u / c)
        grad_scaled = grad_scores * (1.0 - t * t)
    family = cast(ScoreFamily, call.score)
    scale = cast(float, call.scale)
    mult = operand_multipliers(scale, call.scale_placement)
    q_s = call.q if mult.query == 1.0 else call.q * mult.query
    k_s = k_eff if mult.key == 1.0 else k_eff * mult.key
    sg = family.compatibility_backward(grad_scaled, q_s, k_s)
    return {
        "grad_q": sg.grad_q * (mult.query * mult.post),
        "grad_k": sum_heads(sg.grad_k * (mult.key * mult.post), head_map, Hkv),
        "grad_v": grad_v,
        "grad_bias": None if call.bias is None else reduce_to_shape(grad_scores,
                                                                    call.bias.shape),
        "params": {n: g * mult.post for n, g in sg.params.items()},
    }


# -- the driver -------------------------------------------------------------------------------
def _check_grad_output(call: AttentionCall, grad_output: object) -> np.ndarray:
    g = as_array("grad_output", grad_output)
    check_float64("grad_output", g)
    B, Hq, Q, _ = call.q.shape
    check_shape("grad_output", g, (B, Hq, Q, call.v.shape[3]), "B,Hq,Q,Dv")
    check_finite("grad_output", g)
    check_backward_overflow(call, g)
    return g


def _shards(call: AttentionCall, shards: object) -> int:
    K = call.score_shape[3]
    if isinstance(shards, bool) or not isinstance(shards, numbers.Integral) or not (
            1 <= int(shards) <= K):
        raise RefAttnError(f"shards: expected an int in [1, {K}] (K, the keys), got {shards!r}")
    return int(shards)


@public
def key_sharded(call: AttentionCall, grad_output: np.ndarray | None = None, *,
                shards: int = 2) -> KeySharded:
    """Forward (and backward) of ``call`` split into ``shards`` key ranges and merged.

    Parameters
    ----------
    call : AttentionCall
        Any call the NumPy reference runs (every score family and scale placement, softcap,
        sink, bias, visibility arrays or relations, dropout arrays or Philox streams, GQA);
        ``returned_weights="none"``.
    grad_output : (B, Hq, Q, Dv) float64 ndarray, optional
        ``dO``; given, the gradients are computed as ring attention does.
    shards : int
        Number of contiguous key ranges, 1 to K (as equal as K allows).

    Returns
    -------
    KeySharded

    Raises
    ------
    RefAttnError
        A call that asks for weights, a shard count outside [1, K], a bad ``grad_output``.

    Examples
    --------
    >>> import numpy as np, refattn
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 4, 3)) for _ in range(3))
    >>> call = refattn.AttentionCall(q, k, v, softcap=5.0, sink=np.zeros(2))
    >>> res = key_sharded(call, np.ones((1, 2, 4, 3)), shards=3)
    >>> ref = refattn.forward(call)
    >>> res.ranges, bool(np.allclose(res.output, ref.output, rtol=1e-13, atol=1e-15))
    (((0, 1), (1, 2), (2, 4)), True)
    >>> g = refattn.backward(ref, np.ones((1, 2, 4, 3)))
    >>> bool(np.allclose(res.gradients.grad_sink, g.grad_sink, rtol=1e-12, atol=1e-15))
    True
    """
    if not isinstance(call, AttentionCall):
        raise RefAttnError(f"call: expected an AttentionCall, got {type(call).__name__}")
    if call.returned_weights != "none":
        raise RefAttnError(f"returned_weights: {call.returned_weights!r} asks for the whole "
                           "call's weights, which key shards never assemble; use 'none'")
    n = _shards(call, shards)
    g = None if grad_output is None else _check_grad_output(call, grad_output)
    B, Hq, Q, K = call.score_shape
    ranges = _ranges(K, n)
    parts = [_shard_forward(call, j) for j in ranges]
    outs = [p.output for p in parts]
    lses = [p.lse for p in parts]
    if call.sink is not None:  # the sink, once: its own partial (no value row)
        outs.append(np.zeros_like(outs[0]))
        lses.append(np.array(np.broadcast_to(call.sink[None, :, None], (B, Hq, Q))))
    partial_outputs, partial_lses = np.stack(outs), np.stack(lses)
    out, lse = merge_states(partial_outputs, partial_lses)
    multipliers = tuple(None if call.dropout is None else
                        np.asarray(p.trace.call.dropout) for p in parts)
    grads = None
    if g is not None:
        grads = _backward(call, parts, partial_outputs, partial_lses, out, lse, g)
    return KeySharded(out, lse, ranges, partial_outputs, partial_lses, multipliers, grads)


def _backward(call: AttentionCall, parts: Sequence[_Part], partial_outputs: np.ndarray,
              partial_lses: np.ndarray, out: np.ndarray, lse: np.ndarray, g: np.ndarray
              ) -> Gradients:
    g_o = np.where(call.query_valid_full(), g, 0.0)  # unused rows consume nothing
    row_dot = (g_o * out).sum(axis=-1)  # (B, Hq, Q): D = <dO, O> = sum_j P G_P, all keys
    dq = np.zeros(call.q.shape)
    dk, dv = np.zeros(call.k.shape), np.zeros(call.v.shape)
    b4 = None if call.bias is None else (1,) * (4 - call.bias.ndim) + call.bias.shape
    dbias = None if b4 is None else np.zeros(b4)
    params: dict[str, np.ndarray] = {}
    for part in parts:
        r = _shard_backward(part, _backward_lse(part, lse), g_o, row_dot)
        j0, j1 = part.keys
        dq += r["grad_q"]
        dk[:, :, j0:j1] = r["grad_k"]
        dv[:, :, j0:j1] = r["grad_v"]
        if dbias is not None:
            gb = r["grad_bias"].reshape((1,) * (4 - r["grad_bias"].ndim) + r["grad_bias"].shape)
            if dbias.shape[3] == 1:
                dbias += gb
            else:
                dbias[..., j0:j1] = gb
        for name, value in r["params"].items():
            params[name] = params[name] + value if name in params else value
    grad_sink = None
    if call.sink is not None:
        _, g_lses = merge_states_backward(partial_outputs, partial_lses, g_o)
        grad_sink = g_lses[-1].sum(axis=(0, 2))  # (Hq,): d lse_sink = -w_sink D
    return Gradients(
        grad_output=g, grad_v=dv, grad_consumed=None, grad_probs=None, row_dot=row_dot,
        row_dot_output=row_dot, grad_scores=None, grad_q=dq, grad_k=dk,
        grad_bias=None if dbias is None or call.bias is None
        else dbias.reshape(call.bias.shape),
        grad_sink=grad_sink, grad_score_params=params or None,
    )
