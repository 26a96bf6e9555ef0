"""A tiled, FlashAttention-2-style attention kernel in plain NumPy, with planted tile bugs.

Owns :func:`attention`: a test vehicle for refattn's golden suites. It computes what
:mod:`refattn.adapters.plain` describes (that module docstring's rules 1-9, the ``dot`` score
family with the scale applied after the product) the way a fused low-precision kernel does:
query tiles of ``tile_q`` rows, key tiles of ``tile_k`` columns (the last one partial), an online
softmax in float32, optional split-KV (FlashDecoding) merging the chunks' (max, sum) pairs, head
dims zero-padded to ``pad_to``, and a FlashAttention-2 backward from the saved ``lse``. ``bug=``
plants one of the boundary mistakes real kernels make (:data:`BUGS`); each one changes the
result only in the situation its name says.

Rounding model (``dtype`` in float32, float16, bfloat16; float64 runs the same algorithm in
float64 to check it): q, k, v, bias and grad_output are rounded once to ``dtype``; the dropout
multiplier Z and the sink logits are held in float32 (as FlashAttention holds its dropout scale
and sink logits); every product accumulates in float32; the online softmax (running max m,
running sum l, exp) is float32; P (times Z) and dS are rounded to ``dtype`` before their
products; output and gradients are rounded to ``dtype`` at the end; lse and grad_sink stay
float32.

Defers the semantics (and the float64 goldens) to refattn; it imports nothing from refattn.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np
from threadpoolctl import threadpool_limits

__all__ = ["BUGS", "DTYPES", "KernelError", "Result", "attention"]

Dtype = Literal["float64", "float32", "float16", "bfloat16"]
Bug = Literal["drop_last_partial_tile", "causal_offset", "pad_garbage", "stale_max_rescale",
              "splitkv_sum_weights"]

#: storage dtypes the kernel runs in
DTYPES: tuple[str, ...] = ("float64", "float32", "float16", "bfloat16")
#: the planted bugs, each with the situation that triggers it
BUGS: dict[str, str] = {
    "drop_last_partial_tile": "K % tile_k != 0: the last (partial) key tile is skipped",
    "causal_offset": "the last key tile is masked with the upper-left causal rule (j <= i) "
                     "instead of visible; wrong where the two differ on that tile",
    "pad_garbage": "pad_to set and Dk % pad_to != 0: the padding columns of q and k hold a "
                   "non-zero pattern instead of zeros",
    "stale_max_rescale": "a row's running max grows after its first visible key tile: the "
                         "running output misses the factor exp(m_old - m_new)",
    "splitkv_sum_weights": "splits > 1 with chunk maxima that differ: partial outputs are "
                           "weighted by l_s / sum(l_s) instead of exp(lse_s - lse)",
}


class KernelError(ValueError):
    """An argument of :func:`attention` that the kernel cannot run with."""


class Result(NamedTuple):
    """What :func:`attention` returns (None where the call has no such tensor).

    Attributes
    ----------
    output : (B, Hq, Q, Dv) ndarray in dtype
    lse : (B, Hq, Q) float32 ndarray (float64 for dtype float64)
        Row log-partition, the sink included; -inf on a row with no visible key and no sink.
    grad_q : (B, Hq, Q, Dk) ndarray in dtype, or None
    grad_k : (B, Hkv, K, Dk) ndarray in dtype, or None
    grad_v : (B, Hkv, K, Dv) ndarray in dtype, or None
    grad_bias : ndarray in dtype with the bias's shape, or None
    grad_sink : (Hq,) float32 ndarray (float64 for dtype float64), or None
    """

    output: np.ndarray
    lse: np.ndarray
    grad_q: np.ndarray | None = None
    grad_k: np.ndarray | None = None
    grad_v: np.ndarray | None = None
    grad_bias: np.ndarray | None = None
    grad_sink: np.ndarray | None = None


@dataclass(frozen=True)
class _Operands:
    """Everything a tile reads, already rounded, gathered to query heads and padded."""

    q: np.ndarray  # (B, Hq, Q, Dk') acc, Dk' = Dk padded to pad_to
    k: np.ndarray  # (B, Hq, K, Dk') acc, k[:, head_map]
    v: np.ndarray  # (B, Hq, K, Dv') acc, v[:, head_map]
    visible: np.ndarray  # (B, Hq, Q, K) bool (maybe a broadcast view)
    bias: np.ndarray | None  # (B, Hq, Q, K) acc broadcast view
    z: np.ndarray | None  # (B, Hq, Q, K) acc broadcast view, the dropout multiplier
    sink: np.ndarray | None  # (Hq,) acc
    scale: np.floating
    softcap: np.floating | None
    storage: np.dtype  # dtype the tensors live in
    acc: np.dtype  # float32, or float64 for dtype float64
    tile_q: int
    tile_k: int
    splits: int
    bug: str | None

    def to_storage(self, x: np.ndarray) -> np.ndarray:
        """Round ``x`` to the storage dtype and widen it back to the accumulator dtype."""
        if self.storage == self.acc:
            return x
        return x.astype(self.storage).astype(self.acc)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, *, head_map: np.ndarray,
              visible: np.ndarray, query_valid: np.ndarray, scale: float,
              softcap: float | None = None, sink: np.ndarray | None = None,
              bias: np.ndarray | None = None, dropout: np.ndarray | None = None,
              grad_output: np.ndarray | None = None, dtype: Dtype = "float32",
              tile_q: int = 64, tile_k: int = 64, splits: int = 1, pad_to: int | None = None,
              bug: Bug | None = None) -> Result:
    """Tiled FlashAttention-2-style forward (and backward) in ``dtype``.

    The arguments are the fields of ``case.plain`` (:class:`refattn.adapters.plain.PlainCall`)
    with that module's rules, for the ``dot`` score family (``scale_placement`` needs no
    argument: alpha is applied once, after the product, the same in real numbers); the rest
    choose the kernel's tiling and rounding.

    Parameters
    ----------
    q : (B, Hq, Q, Dk) float64 ndarray
    k : (B, Hkv, K, Dk) float64 ndarray
    v : (B, Hkv, K, Dv) float64 ndarray
    head_map : (Hq,) int ndarray
        Query head h reads kv head ``head_map[h]``.
    visible : bool ndarray broadcastable to (B, Hq, Q, K)
        True = query i reads key j.
    query_valid : bool ndarray broadcastable to (B, 1, Q, 1)
        Rows where False have output 0 and give no gradient.
    scale : float
        Multiplier of ``q . k``, applied after the product.
    softcap : float, optional
        Scores become ``softcap * tanh(s / softcap)`` before bias and mask.
    sink : (Hq,) float64 ndarray, optional
        Logit that joins every row's softmax denominator with no value row.
    bias : float64 ndarray broadcastable to (B, Hq, Q, K), optional
        Added after the softcap, before the mask.
    dropout : float64 ndarray broadcastable to (B, Hq, Q, K), optional
        The multiplier Z of P before ``P @ V``.
    grad_output : (B, Hq, Q, Dv) float64 ndarray, optional
        Cotangent of the output; without it there is no backward.
    dtype : {"float32", "float16", "bfloat16", "float64"}
        Storage dtype (float64 runs the whole algorithm in float64).
    tile_q, tile_k : int
        Rows of a query tile and columns of a key tile.
    splits : int
        Split-KV: the key tiles are cut into ``splits`` contiguous chunks, each normalised on
        its own, merged by log-sum-exp (chunks past the last tile are empty: weight 0).
    pad_to : int, optional
        Dk and Dv are zero-padded up to a multiple of ``pad_to`` before the products.
    bug : str, optional
        One of :data:`BUGS`: a planted tile-boundary mistake.

    Returns
    -------
    Result
        output, lse and, with ``grad_output``, grad_q, grad_k, grad_v, grad_bias, grad_sink.

    Raises
    ------
    KernelError
        On a shape, dtype or option the kernel does not take, naming it.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 5, 3)) for _ in range(3))
    >>> vis = np.tril(np.ones((5, 5), bool))[None, None].repeat(2, 1)
    >>> args = dict(head_map=np.array([0, 1]), visible=vis, scale=0.5,
    ...             query_valid=np.ones((1, 1, 5, 1), bool))
    >>> res = attention(q, k, v, dtype="float64", tile_q=2, tile_k=2, **args)
    >>> s = np.where(vis, 0.5 * q @ k.swapaxes(-1, -2), -np.inf)
    >>> p = np.exp(s - s.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)
    >>> bool(np.allclose(res.output, p @ v, rtol=1e-13, atol=0))
    True
    >>> bad = attention(q, k, v, tile_q=2, tile_k=2, bug="drop_last_partial_tile", **args)
    >>> bool(np.abs(bad.output - p @ v).max() > 1e-2)
    True
    """
    try:
        op, query_valid, grad_output, bias_shape = _prepare(
            q, k, v, head_map=head_map, visible=visible, query_valid=query_valid, scale=scale,
            softcap=softcap, sink=sink, bias=bias, dropout=dropout, grad_output=grad_output,
            dtype=dtype, tile_q=tile_q, tile_k=tile_k, splits=splits, pad_to=pad_to, bug=bug)
    except KernelError as exc:
        shapes = ", ".join(f"{n}={list(np.shape(x))}" for n, x in (("q", q), ("k", k), ("v", v)))
        raise KernelError(f"attention({shapes}): {exc}") from None
    Dk, Dv, Hkv = np.shape(q)[-1], np.shape(v)[-1], np.shape(k)[1]
    # one BLAS thread: the tile products are small (threads only contend, on a busy machine
    # ~5x slower) and the sums' order stays fixed, as in refattn's low-precision yardstick
    with threadpool_limits(limits=1), np.errstate(over="ignore"):  # overflow: +-inf, as dtype
        out, lse = _forward(op)  # (B, Hq, Q, Dv') acc, (B, Hq, Q) acc
        out = op.to_storage(np.where(query_valid, out, op.acc.type(0)))  # rule 8
        output = out[..., :Dv].astype(op.storage)
        if grad_output is None:
            return Result(output, lse)
        g = _backward(op, out, lse, grad_output, query_valid)
        gk = _sum_heads(g.grad_k, head_map, Hkv)  # (B, Hkv, K, Dk') acc
        gv = _sum_heads(g.grad_v, head_map, Hkv)  # (B, Hkv, K, Dv') acc
        return Result(
            output, lse,
            grad_q=g.grad_q[..., :Dk].astype(op.storage),
            grad_k=gk[..., :Dk].astype(op.storage),
            grad_v=gv[..., :Dv].astype(op.storage),
            grad_bias=None if bias_shape is None else
            _reduce_to(g.grad_bias, bias_shape).astype(op.storage),
            grad_sink=g.grad_sink,
        )


# -- validation and operands ----------------------------------------------------------------
def _storage_dtype(dtype: object) -> np.dtype:
    match dtype:
        case "float64" | "float32" | "float16":
            return np.dtype(dtype)
        case "bfloat16":
            try:
                import ml_dtypes
            except ImportError:
                raise KernelError("dtype='bfloat16' needs the ml_dtypes package "
                                  "(pip install ml-dtypes)") from None
            return np.dtype(ml_dtypes.bfloat16)
        case _:
            raise KernelError(f"dtype: expected one of {list(DTYPES)}, got {dtype!r}")


def _positive_int(name: str, x: object) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or int(x) < 1:
        raise KernelError(f"{name}: expected a positive integer, got {x!r}")
    return int(x)


def _array(name: str, x: object, shape: tuple[int, ...], axes: str) -> np.ndarray:
    """``x`` broadcast to ``shape`` (a read-only view), or a KernelError naming it."""
    a = np.asarray(x)
    try:
        return np.broadcast_to(a, shape)
    except ValueError:
        raise KernelError(f"{name}: shape {list(a.shape)} does not broadcast to "
                          f"[{axes}]={list(shape)}") from None


def _prepare(q: Any, k: Any, v: Any, *, head_map: Any, visible: Any, query_valid: Any,
             scale: Any, softcap: Any, sink: Any, bias: Any, dropout: Any, grad_output: Any,
             dtype: object, tile_q: object, tile_k: object, splits: object, pad_to: object,
             bug: object) -> tuple[_Operands, np.ndarray, np.ndarray | None,
                                   tuple[int, ...] | None]:
    storage = _storage_dtype(dtype)
    acc = np.dtype(np.float64 if storage == np.float64 else np.float32)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if np.ndim(x) != 4:
            raise KernelError(f"{name}: expected 4 axes, got shape {list(np.shape(x))}")
    B, Hq, Q, Dk = np.shape(q)
    Bk, Hkv, K, Dk2 = np.shape(k)
    if (Bk, Dk2) != (B, Dk) or np.shape(v)[:3] != (B, Hkv, K):
        raise KernelError("k, v: expected k (B, Hkv, K, Dk) and v (B, Hkv, K, Dv) matching q")
    hm = np.asarray(head_map)
    if hm.shape != (Hq,) or hm.dtype.kind not in "iu" or ((hm < 0) | (hm >= Hkv)).any():
        raise KernelError(f"head_map: expected {Hq} integers in [0, {Hkv}), got {hm!r}")
    if bug is not None and bug not in BUGS:
        raise KernelError(f"bug: expected None or one of {list(BUGS)}, got {bug!r}")
    tq, tk, nsplit = (_positive_int(n, x) for n, x in
                      (("tile_q", tile_q), ("tile_k", tile_k), ("splits", splits)))
    pad = 1 if pad_to is None else _positive_int("pad_to", pad_to)
    full = (B, Hq, Q, K)
    vis = _array("visible", visible, full, "B, Hq, Q, K")
    if vis.dtype != np.bool_:
        raise KernelError(f"visible: expected a bool array, got {vis.dtype}")
    qv = _array("query_valid", query_valid, (B, 1, Q, 1), "B, 1, Q, 1")
    if qv.dtype != np.bool_:
        raise KernelError(f"query_valid: expected a bool array, got {qv.dtype}")

    def rounded(x: Any) -> np.ndarray:  # an input as the kernel holds it: in dtype, widened
        with np.errstate(over="ignore"):
            return np.asarray(x, dtype=np.float64).astype(storage).astype(acc)

    Dkp, Dvp = -(-Dk // pad) * pad, -(-np.shape(v)[3] // pad) * pad
    qa = _padded(rounded(q), Dkp)  # (B, Hq, Q, Dk')
    ka = _padded(rounded(k), Dkp)[:, hm]  # (B, Hq, K, Dk')
    va = _padded(rounded(v), Dvp)[:, hm]  # (B, Hq, K, Dv')
    if bug == "pad_garbage" and Dkp != Dk:  # the padding columns were never cleared
        qa[..., Dk:] = _garbage(Q, Dkp - Dk, 1.0)
        ka[..., Dk:] = _garbage(K, Dkp - Dk, -0.5)
    bias_shape = None if bias is None else tuple(np.shape(bias))
    ba = None  # (B, Hq, Q, K) view of the bias, rounded in its own (maybe smaller) shape
    if bias is not None:
        _array("bias", bias, full, "B, Hq, Q, K")
        ba = np.broadcast_to(rounded(bias), full)
    za = None if dropout is None else _array("dropout", dropout, full, "B, Hq, Q, K").astype(acc)
    sa = None if sink is None else _array("sink", sink, (Hq,), "Hq").astype(acc)
    g = None
    if grad_output is not None:
        if np.shape(grad_output) != (B, Hq, Q, np.shape(v)[3]):
            raise KernelError(f"grad_output: expected shape [B, Hq, Q, Dv]="
                              f"{[B, Hq, Q, np.shape(v)[3]]}, got {list(np.shape(grad_output))}")
        g = _padded(rounded(grad_output), Dvp)  # (B, Hq, Q, Dv')
    op = _Operands(
        q=qa, k=ka, v=va, visible=vis, bias=ba, z=za, sink=sa,
        scale=acc.type(scale), softcap=None if softcap is None else acc.type(softcap),
        storage=storage, acc=acc, tile_q=tq, tile_k=tk, splits=nsplit,
        bug=None if bug is None else str(bug))
    return op, qv, g, bias_shape


def _padded(x: np.ndarray, width: int) -> np.ndarray:
    """``x`` with its last axis zero-padded to ``width`` (a fresh array either way)."""
    out = np.zeros((*x.shape[:-1], width), dtype=x.dtype)
    out[..., : x.shape[-1]] = x
    return out


def _garbage(rows: int, cols: int, offset: float) -> np.ndarray:
    """A deterministic non-zero pattern (rows, cols) that differs from row to row, so the
    garbage it adds to q . k is not a per-row constant that softmax would forgive."""
    i = np.arange(rows)[:, None]
    c = np.arange(cols)[None, :]
    return offset + 0.25 * ((3 * i + 5 * c) % 7)


# -- tiles ----------------------------------------------------------------------------------
def _key_tiles(op: _Operands, K: int) -> list[list[tuple[int, int]]]:
    """The key tiles (j0, j1) of each split-KV chunk, contiguous, at tile granularity."""
    tiles = [(j0, min(j0 + op.tile_k, K)) for j0 in range(0, K, op.tile_k)]
    bounds = [len(tiles) * s // op.splits for s in range(op.splits + 1)]
    chunks = [tiles[a:b] for a, b in itertools.pairwise(bounds)]
    if op.bug == "drop_last_partial_tile" and K % op.tile_k:  # the partial tile is lost
        chunks = [[t for t in c if t[1] != K] for c in chunks]
    return chunks


def _tile_mask(op: _Operands, i0: int, i1: int, j0: int, j1: int) -> np.ndarray:
    """(B, Hq, tq, tk) bool: which entries of the tile are read."""
    K = op.visible.shape[-1]
    if op.bug == "causal_offset" and j1 == K:  # boundary tile: upper-left causal, not visible
        i = np.arange(i0, i1)[:, None]
        j = np.arange(j0, j1)[None, :]
        return np.broadcast_to(j <= i, (*op.visible.shape[:2], i1 - i0, j1 - j0))
    return op.visible[:, :, i0:i1, j0:j1]


def _tile_scores(op: _Operands, mask: np.ndarray, i0: int, i1: int, j0: int, j1: int
                 ) -> tuple[np.ndarray, np.ndarray | None]:
    """Masked scores of one tile (B, Hq, tq, tk) and tanh(s / softcap) (None without one)."""
    s = op.q[:, :, i0:i1] @ op.k[:, :, j0:j1].swapaxes(-1, -2)  # (B, Hq, tq, tk) q . k
    s *= op.scale  # alpha once, after the product
    th = None
    if op.softcap is not None:  # softcap before bias and mask
        th = np.tanh(s / op.softcap)
        s = op.softcap * th
    if op.bias is not None:  # bias before the mask
        s = s + op.bias[:, :, i0:i1, j0:j1]
    return np.where(mask, s, op.acc.type(-np.inf)), th


# -- forward --------------------------------------------------------------------------------
class _Partial(NamedTuple):
    o: np.ndarray  # (B, Hq, tq, Dv') unnormalised running output
    m: np.ndarray  # (B, Hq, tq) running max, -inf before the first visible key
    lsum: np.ndarray  # (B, Hq, tq) l, the running sum of exp(s - m)


def _forward(op: _Operands) -> tuple[np.ndarray, np.ndarray]:
    """Normalised output (B, Hq, Q, Dv') and lse (B, Hq, Q), query tile by query tile."""
    B, Hq, Q, _ = op.q.shape
    K, Dvp = op.k.shape[2], op.v.shape[-1]
    out = np.zeros((B, Hq, Q, Dvp), dtype=op.acc)
    lse = np.empty((B, Hq, Q), dtype=op.acc)
    chunks = _key_tiles(op, K)
    for i0 in range(0, Q, op.tile_q):
        i1 = min(i0 + op.tile_q, Q)
        parts = [_online_softmax(op, i0, i1, tiles) for tiles in chunks]
        o, r = _finish(op, parts[0]) if len(parts) == 1 else _merge(op, parts)
        out[:, :, i0:i1] = o
        lse[:, :, i0:i1] = r
    return out, lse


def _online_softmax(op: _Operands, i0: int, i1: int, tiles: list[tuple[int, int]]) -> _Partial:
    """One query tile against a run of key tiles (a whole row, or one split-KV chunk)."""
    B, Hq = op.q.shape[:2]
    tq, zero, ninf = i1 - i0, op.acc.type(0), op.acc.type(-np.inf)
    m = np.full((B, Hq, tq), ninf, dtype=op.acc)
    lsum = np.zeros((B, Hq, tq), dtype=op.acc)
    o = np.zeros((B, Hq, tq, op.v.shape[-1]), dtype=op.acc)
    for j0, j1 in tiles:
        mask = _tile_mask(op, i0, i1, j0, j1)
        if not mask.any():  # no visible entry in the tile: skipped
            continue
        s, _ = _tile_scores(op, mask, i0, i1, j0, j1)  # (B, Hq, tq, tk)
        m_new = np.maximum(m, s.max(axis=-1))  # (B, Hq, tq)
        m_use = np.where(m_new == ninf, zero, m_new)  # a row with nothing visible yet
        p = np.exp(s - m_use[..., None])  # (B, Hq, tq, tk), 0 where masked
        alpha = np.exp(m - m_use)  # (B, Hq, tq): exp(m_old - m_new), 0 before any key
        lsum = lsum * alpha + p.sum(axis=-1)
        if op.z is not None:
            p = p * op.z[:, :, i0:i1, j0:j1]  # dropout after the softmax sum
        pv = op.to_storage(p) @ op.v[:, :, j0:j1]  # (B, Hq, tq, Dv'), P in dtype
        if op.bug == "stale_max_rescale":
            o = o + pv  # the rescale of o by exp(m_old - m_new) is forgotten (l has it)
        else:
            o = o * alpha[..., None] + pv
        m = m_new
    return _Partial(o, m, lsum)


def _normalise(o: np.ndarray, m: np.ndarray, lsum: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """o / l and lse = m + log(l); a row with l == 0 gives output 0 and lse -inf."""
    has = lsum > 0
    l_use = np.where(has, lsum, lsum.dtype.type(1))
    lse = np.where(has, m + np.log(l_use), lsum.dtype.type(-np.inf))
    return o / l_use[..., None], lse


def _finish(op: _Operands, part: _Partial) -> tuple[np.ndarray, np.ndarray]:
    """Without split-KV: the sink joins the denominator after the last tile, then o /= l."""
    o, m, lsum = part
    if op.sink is not None:
        sink = np.broadcast_to(op.sink[None, :, None], m.shape)  # (B, Hq, tq)
        m_new = np.maximum(m, sink)
        alpha = np.exp(m - m_new)  # 0 where no key was visible
        o = o * alpha[..., None]
        lsum = lsum * alpha + np.exp(sink - m_new)
        m = m_new
    return _normalise(o, m, lsum)


def _merge(op: _Operands, parts: list[_Partial]) -> tuple[np.ndarray, np.ndarray]:
    """Split-KV merge on each chunk's (m_s, l_s, o_s): M = max_s m_s (and the sink),
    l = sum_s exp(m_s - M) l_s (+ exp(sink - M)), O = sum_s exp(m_s - M) o_s / l,
    lse = M + log(l).

    The same as weighting each normalised O_s by exp(lse_s - lse) (FlashAttention's combine)
    in real numbers, but no weight goes through a rounded lse_s: with lse_s in float32 at
    |lse| ~ 1000 each weight is off by about 3e-5 relative, differently per chunk, which the
    backward's cancelling sums (grad_q) amplify past refattn's float32 rule on the large-logit
    cases (measured: 1.7e-3 against a tolerance of 9e-5).
    """
    ninf = op.acc.type(-np.inf)
    m_s = np.stack([p.m for p in parts])  # (S, B, Hq, tq), -inf for an empty chunk
    l_s = np.stack([p.lsum for p in parts])  # (S, B, Hq, tq), each relative to its own max
    o_s = np.stack([p.o for p in parts])  # (S, B, Hq, tq, Dv'), unnormalised
    big = m_s.max(axis=0)  # (B, Hq, tq)
    if op.sink is not None:  # the sink is one more term of the denominator, with no value
        big = np.maximum(big, np.broadcast_to(op.sink[None, :, None], big.shape))
    big_use = np.where(big == ninf, op.acc.type(0), big)
    scale = np.exp(m_s - big_use)  # (S, B, Hq, tq), 0 for an empty chunk
    lsum = (scale * l_s).sum(axis=0)
    if op.sink is not None:
        lsum = lsum + np.exp(op.sink[None, :, None] - big_use)
    has = lsum > 0
    l_use = np.where(has, lsum, op.acc.type(1))
    lse = np.where(has, big_use + np.log(l_use), ninf)
    if op.bug == "splitkv_sum_weights":  # normalised partials weighted by their own sums
        share = l_s / np.where(l_s.sum(axis=0) > 0, l_s.sum(axis=0), 1)  # each max left in
        o_norm = o_s / np.where(l_s > 0, l_s, 1)[..., None]
        kept = (scale * l_s).sum(axis=0) / l_use  # the sink's share of the mass stays right
        return (share[..., None] * o_norm).sum(axis=0) * kept[..., None], lse
    return (scale[..., None] * o_s).sum(axis=0) / l_use[..., None], lse


# -- backward -------------------------------------------------------------------------------
class _Grads(NamedTuple):
    grad_q: np.ndarray  # (B, Hq, Q, Dk') acc
    grad_k: np.ndarray  # (B, Hq, K, Dk') acc, per query head
    grad_v: np.ndarray  # (B, Hq, K, Dv') acc, per query head
    grad_bias: np.ndarray | None  # (B, Hq, Q, K) acc
    grad_sink: np.ndarray | None  # (Hq,) acc


def _backward(op: _Operands, out: np.ndarray, lse: np.ndarray, grad_output: np.ndarray,
              query_valid: np.ndarray) -> _Grads:
    """FlashAttention-2 backward from the saved lse: key tiles outside, query tiles inside."""
    B, Hq, Q, _ = op.q.shape
    K = op.k.shape[2]
    zero, ninf = op.acc.type(0), op.acc.type(-np.inf)
    d_o = np.where(query_valid, grad_output, zero)  # (B, Hq, Q, Dv') no gradient from rows
    row_dot = (d_o * out).sum(axis=-1)  # (B, Hq, Q) D = rowsum(dO * O), the kernel's own O
    lse_use = np.where(lse == ninf, zero, lse)  # such a row has no visible entry at all
    dq = np.zeros_like(op.q)
    dk = np.zeros_like(op.k)
    dv = np.zeros_like(op.v)
    dbias = None if op.bias is None else np.zeros((B, Hq, Q, K), dtype=op.acc)
    for j0, j1 in (t for c in _key_tiles(op, K) for t in c):
        for i0 in range(0, Q, op.tile_q):
            i1 = min(i0 + op.tile_q, Q)
            mask = _tile_mask(op, i0, i1, j0, j1)
            if not mask.any():
                continue
            s, th = _tile_scores(op, mask, i0, i1, j0, j1)  # (B, Hq, tq, tk)
            p = np.exp(s - lse_use[:, :, i0:i1, None])  # recomputed P, 0 where masked
            d_oi = d_o[:, :, i0:i1]  # (B, Hq, tq, Dv')
            dp = d_oi @ op.v[:, :, j0:j1].swapaxes(-1, -2)  # (B, Hq, tq, tk) dO V^T
            pz = p
            if op.z is not None:
                z = op.z[:, :, i0:i1, j0:j1]
                pz, dp = p * z, dp * z
            dv[:, :, j0:j1] += op.to_storage(pz).swapaxes(-1, -2) @ d_oi  # (B, Hq, tk, Dv')
            ds = p * (dp - row_dot[:, :, i0:i1, None])  # (B, Hq, tq, tk) d biased scores
            if dbias is not None:
                dbias[:, :, i0:i1, j0:j1] = ds
            if th is not None:
                ds = ds * (1 - th * th)  # through the softcap
            ds = op.to_storage(ds)
            dq[:, :, i0:i1] += ds @ op.k[:, :, j0:j1]  # (B, Hq, tq, Dk')
            dk[:, :, j0:j1] += ds.swapaxes(-1, -2) @ op.q[:, :, i0:i1]  # (B, Hq, tk, Dk')
    dq *= op.scale  # alpha, once, at the end
    dk *= op.scale
    dsink = None
    if op.sink is not None:  # -sum_{b,i} exp(sink - lse) * D
        sink_p = np.exp(op.sink[None, :, None] - lse)  # (B, Hq, Q)
        dsink = -(sink_p * row_dot).sum(axis=(0, 2))
    return _Grads(dq, dk, dv, dbias, dsink)


def _sum_heads(x: np.ndarray, head_map: np.ndarray, Hkv: int) -> np.ndarray:
    """(B, Hq, ...) -> (B, Hkv, ...): each kv head sums the query heads that read it."""
    out = np.zeros((x.shape[0], Hkv, *x.shape[2:]), dtype=x.dtype)
    for h, kv in enumerate(np.asarray(head_map)):
        out[:, kv] += x[:, h]
    return out


def _reduce_to(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum (B, Hq, Q, K) ``x`` over the axes a bias of ``shape`` was broadcast along."""
    padded = (1,) * (x.ndim - len(shape)) + shape
    pairs = enumerate(zip(padded, x.shape, strict=True))
    axes = tuple(a for a, (n, m) in pairs if n == 1 and m != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape)
