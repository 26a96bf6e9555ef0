"""The host side of the numba backend's ``value_and_grad``: one fused kernel per call.

Owns turning a call into the arguments of :func:`~refattn.engine.numba.fused.fused_value_and_grad`
(the placement's rounded operands, the bias, visibility, dropout and sink operands, the query
block that fits the memory budget, the task layout), the score families that reduce to the dot
kernel on rounded operands (bilinear: ``q W``; cosine: unit rows), and the reductions that
finish on the host in a fixed order (kv-head partials, the bias gradient's broadcast axes, the
sink gradient). The additive family has no fast path: it runs on the NumPy reference (its pair
tensor is ``(B, Hq, Q, K, Da)``), which ``refattn.value_and_grad`` documents.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

import numba
import numpy as np

from refattn.call import AttentionCall
from refattn.call.placement import operand_multipliers
from refattn.dropout import Philox
from refattn.engine.alloc import zeros_block
from refattn.engine.numba.blas import single_thread_blas
from refattn.engine.numba.fused import (
    GBIAS_NONE,
    GBIAS_OVER_K,
    GBIAS_OVER_Q,
    GBIAS_PER_ELEMENT,
    fused_value_and_grad,
)
from refattn.engine.numba.operands import ro, strided
from refattn.engine.numba.philox import philox_params
from refattn.engine.numba.providers import Provider
from refattn.engine.numba.tiles import tile_visibility
from refattn.engine.reduce import reduce_to_shape
from refattn.engine.trace import Gradients
from refattn.errors import RefAttnError

__all__ = ["MASKED_BLOCK_ROWS", "Layout", "block_rows", "fused", "running", "score_stride",
           "split_tiles", "task_layout", "value_and_grad"]

#: key chunk: the granularity at which invisible key ranges are skipped
KEY_CHUNK = 256
#: per-thread bytes of the score and probability buffers (BQ x K each) by default: blocks
#: that stay in the caches beat whole heads (measured: 8 MiB gave 0.64-0.75 of DGEMM on an AMD
#: EPYC against 0.53-0.65 for whole heads); the calibration picks it per machine. The block
#: rows still count two such buffers (three with softcap), but without dropout the kernel holds
#: one (the scores) and a (BQ x KEY_CHUNK) dP slab: 128-row blocks at K = 4096 measured faster
#: than 256-row ones with it (issue 27)
BUFFER_BYTES = 8 << 20
#: query rows per block at most where a call's visibility can skip key chunks (a ``visible``
#: mask or relation): a block computes whole key chunks wherever any of its rows sees one, so
#: along a causal diagonal a block of BQ rows computes about BQ / 2 x BQ scores that no row
#: uses, and a budget chosen on dense calls may give blocks of 512-1024 rows. Causal
#: (1,16,2048,128), AMD EPYC Zen 4, interleaved in one process: 256 rows took 0.71 of the time
#: of 1024-row blocks, 128 rows 0.69, 512 rows 0.75 (issue 27)
MASKED_BLOCK_ROWS = KEY_CHUNK


#: OpenBLAS runs a product with ``m n k <= SMALL_GEMM`` on its unpacked small-matrix kernels
#: (``gemm_split``); for the thin products of the fused kernel that measured 0.8-0.99 of square
#: DGEMM against 0.63-0.76 packed (AMD EPYC, SkylakeX kernel, one thread; issue 27)
SMALL_GEMM = 100**3
#: rows of C per tile of ``O`` and ``dQ`` (the inner axis, keys, takes what the bound leaves)
#: and inner rows per tile of ``dV`` and ``dK`` (their C rows, keys, take the rest). 64 inner
#: rows (240 keys at D = 64) measured 1.17-1.19 of square DGEMM against 0.85-0.97 for 32 (480
#: keys) with the padded score stride, one thread, AMD EPYC; in the fused kernel 0.93-0.97 of
#: the time at (1,8,4096,64) and 0.93 at (1,16,2048,128) (issue 27)
NN_ROWS, TN_INNER = 64, 64
_WHOLE = np.iinfo(np.int32).max  # a tile no product reaches: issued whole


def score_stride(K: int) -> int:
    """Row stride, in elements, of the fused kernel's (BQ x K) score buffers: K rounded up to
    a multiple of 8 (rows start on 64-byte lines) with an odd number of 64-byte lines, so
    that the rows of a tile fall in different cache sets.

    With the stride K = 2048 or 4096 (16 or 32 KiB) every row of a tile maps to the same L1
    sets, and the thin products' small-matrix tiles, which read the score block in place
    (64 rows for ``O``/``dQ`` and for ``dV``/``dK``), evict each other.

    Examples
    --------
    >>> score_stride(4096), score_stride(2048), score_stride(1000), score_stride(1001)
    (4104, 2056, 1000, 1016)
    """
    ld = -(-K // 8) * 8
    return ld + 8 if (ld // 8) % 2 == 0 else ld


class Layout(NamedTuple):
    """How the work is laid out: query block rows, chunks per (b, kv head), threads."""

    block_q: int
    chunks: int
    threads: int
    blas_threads: int


def block_rows(Q: int, K: int, buffers: int, budget: int = BUFFER_BYTES) -> int:
    """Query rows per block: all of Q when ``buffers`` (BQ x K) doubles fit the budget, else
    the largest multiple of 32 that does (at least 32, at most Q).

    Examples
    --------
    >>> block_rows(2048, 2048, 2), block_rows(16384, 16384, 2, 64 << 20)
    (256, 256)
    >>> block_rows(300, 300, 2), block_rows(4, 40, 2, 1024)
    (300, 4)
    """
    fit = budget // (8 * buffers * max(K, 1))
    if fit >= Q:
        return Q
    return min(Q, max(32, fit // 32 * 32))


def task_layout(call: AttentionCall, provider: Provider, budget: int, *,
                nominal_threads: int | None = None) -> Layout:
    """The query block and thread layout of ``call`` under ``provider`` and ``budget`` bytes.

    ``nominal_threads`` (``heads`` layout): size the query chunks for that many threads
    instead of numba's current count, so that the blocks, the chunks and with them every bit
    of the result are the same whatever the number of threads that runs them (the golden
    generator's layout, :mod:`refattn.engine.numba.generator`).

    Blocks are as large as the budget allows (:func:`block_rows`), but at most
    :data:`MASKED_BLOCK_ROWS` rows where a ``visible`` mask or relation can skip key chunks.

    ``heads`` layout: tasks (batch, kv head, chunk of query blocks) on numba's threads with
    one BLAS thread each, in enough chunks to occupy every thread; ``blas`` layout: one task
    at a time on the library's threads.

    Examples
    --------
    >>> import numpy as np, refattn
    >>> from refattn.engine.numba.providers import available_providers
    >>> x = np.zeros((1, 2, 1024, 64))
    >>> blas = available_providers()[0].with_layout("blas")
    >>> lay = task_layout(refattn.AttentionCall(x, x, x), blas, 4 << 20)
    >>> lay.block_q, lay.chunks, lay.threads
    (256, 1, 1)

    A causal relation caps a 512-row block:

    >>> from refattn.masks import causal
    >>> y = np.zeros((1, 2, 4096, 64))
    >>> task_layout(refattn.AttentionCall(y, y, y), blas, 32 << 20).block_q
    512
    >>> tri = causal(4096, 4096, alignment="upper_left")
    >>> task_layout(refattn.AttentionCall(y, y, y, visible=tri), blas, 32 << 20).block_q
    256

    In the ``heads`` layout a call with fewer (batch, kv head) groups than threads is cut into
    query chunks, with smaller blocks where one block would hold every row:

    >>> import numba
    >>> lay = task_layout(refattn.AttentionCall(x[:, :1, :512], x[:, :1, :512], x[:, :1, :512]),
    ...                   blas.with_layout("heads"), 4 << 20)
    >>> lay.chunks == min(numba.get_num_threads(), 512 // lay.block_q)
    True
    """
    a = call.axes
    buffers = 3 if call.softcap is not None else 2
    BQ = block_rows(a["Q"], a["K"], buffers, budget)
    if call.visible is not None:  # key chunks may be skipped: blocks that waste little
        BQ = min(BQ, MASKED_BLOCK_ROWS)
    nqb = -(-a["Q"] // BQ)
    threads = numba.get_num_threads()
    groups = a["B"] * a["Hkv"]
    if provider.layout == "blas":
        return Layout(BQ, 1, 1, threads)  # one task at a time on threaded BLAS
    sized_for = threads if nominal_threads is None else nominal_threads
    if groups >= sized_for:
        return Layout(BQ, 1, threads, 1)
    want = math.ceil(sized_for / groups)  # query chunks per group to occupy every thread
    if nqb < want:  # smaller blocks, so that there are chunks to share out
        BQ = min(BQ, max(32, -(-math.ceil(a["Q"] / want) // 32) * 32))
        nqb = -(-a["Q"] // BQ)
    return Layout(BQ, min(nqb, want), threads, 1)


def split_tiles(provider: Provider, lay: Layout, Dk: int, Dv: int) -> np.ndarray:
    """Tiles of the fused kernel's thin products ``O``, ``dV``, ``dQ``, ``dK``: (8,) int64.

    Pairs of (rows of C, inner rows) for :func:`~refattn.engine.numba.blas.gemm_split`. Where
    the provider has small-matrix kernels (:attr:`Provider.small_tiles
    <refattn.engine.numba.providers.Provider.small_tiles>`: OpenBLAS on an AVX-512 kernel, on
    one thread per task), each tile stays within :data:`SMALL_GEMM`, so OpenBLAS runs it
    unpacked: ``O`` and ``dQ`` in :data:`NN_ROWS` query rows by as many keys as fit both the
    bound and the provider's ``tile_kib`` KiB of ``V`` or ``K`` rows (the operand every row
    of the tile reads, unpacked); ``dV`` and ``dK`` in :data:`TN_INNER` query rows (their inner
    axis) by as many keys as fit. Otherwise (another library or kernel, or the library's own
    threads, which its small-matrix path would not use) every product is issued whole.

    Examples
    --------
    >>> from refattn.engine.numba.providers import Provider
    >>> skx = Provider("openblas", "0.3.30 SkylakeX")
    >>> split_tiles(skx, Layout(128, 1, 2, 1), 64, 64).tolist()
    [64, 48, 240, 64, 64, 48, 240, 64]
    >>> split_tiles(skx, Layout(256, 1, 2, 1), 128, 128).tolist()
    [64, 24, 120, 64, 64, 24, 120, 64]
    >>> split_tiles(skx.with_layout("heads", tile_kib=96), Layout(256, 1, 2, 1), 128, 128).tolist()
    [64, 96, 96, 64, 64, 96, 96, 64]
    >>> whole = int(np.iinfo(np.int32).max)
    >>> int(split_tiles(skx.with_layout("blas"), Layout(128, 1, 1, 2), 64, 64).min()) == whole
    True
    >>> int(split_tiles(Provider("openblas", "0.3.30 Haswell"), Layout(128, 1, 2, 1), 64,
    ...                 64).min()) == whole
    True
    """
    if not provider.small_tiles or lay.blas_threads != 1:
        return np.full(8, _WHOLE, dtype=np.int64)

    def fit(other: int, d: int) -> int:  # the other side of a tile within the bound, >= 8
        return max(8, SMALL_GEMM // (other * d) // 8 * 8)

    def inner(d: int) -> int:  # keys of an O/dQ tile: within the bound and tile_kib of V or K
        return min(fit(NN_ROWS, d), max(8, (provider.tile_kib << 10) // (8 * d) // 8 * 8))

    o, dq = inner(Dv), inner(Dk)  # their key chunks divide dV's, dK's slabs
    return np.array([NN_ROWS, o, max(o, fit(TN_INNER, Dv) // o * o), TN_INNER,
                     NN_ROWS, dq, max(dq, fit(TN_INNER, Dk) // dq * dq), TN_INNER],
                    dtype=np.int64)


@contextlib.contextmanager
def running(lay: Layout, provider: Provider) -> Iterator[None]:
    """Run with numba and ``provider`` on the threads ``lay`` gives them (restored after)."""
    saved = numba.get_num_threads()
    with provider.threads(lay.blas_threads):
        numba.set_num_threads(lay.threads)
        try:
            yield
        finally:
            numba.set_num_threads(saved)


_SCRATCH = threading.local()


def _aligned(rows: int, cols: int) -> np.ndarray:
    """An uninitialised (rows, cols) float64 array whose data starts on a 64-byte line (numpy
    gives 16 bytes): with ``cols`` a multiple of 8 and :func:`score_stride` every score row
    starts on a line, so no 512-bit load of a product or a row pass straddles two lines."""
    flat = np.empty(rows * cols + 8)
    first = (-flat.ctypes.data % 64) // 8
    return flat[first:first + rows * cols].reshape(rows, cols)


def _scratch(lay: Layout, K: int, LD: int, LP: int, Dv: int, cap: bool,
             dropping: bool) -> tuple[np.ndarray, ...]:
    """The kernel's per-thread scratch buffers, kept between calls of this Python thread.

    Fresh ``(BQ x K)`` buffers cost a page fault per 4 KiB on every call (about 4 ms for the
    default 8 MiB a thread, 8% of a (1, 4, 1024, 1024, 64) call); reusing them is free. The
    buffers grow to the largest call seen and are released with the thread.
    """
    n = lay.block_q * LD
    need = {"s": n, "w": n if dropping else 1, "p": lay.block_q * LP, "t": n if cap else 1,
            "z": K if dropping else 1, "u": lay.block_q * (Dv + 1)}
    held = getattr(_SCRATCH, "buffers", {})
    for name, size in need.items():
        have = held.get(name)
        if have is None or have.shape[0] < lay.threads or have.shape[1] < size:
            rows = max(lay.threads, 0 if have is None else have.shape[0])
            cols = max(-(-size // 8) * 8, 0 if have is None else have.shape[1])
            held[name] = _aligned(rows, cols)
    _SCRATCH.buffers = held
    return held["s"], held["w"], held["p"], held["t"], held["z"], held["u"]


def _dropout(call: AttentionCall) -> tuple[tuple, Any]:
    full = call.score_shape
    source = call.dropout
    none = (np.uint64(0), np.uint64(0), np.uint64(0), np.uint64(0), 1.0)
    if source is None:
        return (np.int64(0), *none), strided(None, full, np.float64)
    if isinstance(source, Philox):
        return (np.int64(2), *philox_params(source)), strided(None, full, np.float64)
    z = source if isinstance(source, np.ndarray) else call.multiplier_full()
    return (np.int64(1), *none), strided(z, full, np.float64)


def _gbias(call: AttentionCall, C: int) -> tuple[int, tuple[int, ...]]:
    B, Hq, Q, K = call.score_shape
    if call.bias is None:
        return GBIAS_NONE, (1, 1, 1, 1)
    _, _, Qb, Kb = (1,) * (4 - call.bias.ndim) + call.bias.shape
    if Kb == 1 and K > 1:
        return GBIAS_OVER_K, (B, Hq, Q, 1)
    if Qb == 1 and Q > 1:
        return GBIAS_OVER_Q, (C, B, Hq, K)
    return GBIAS_PER_ELEMENT, (B, Hq, Q, K)


def fused(call: AttentionCall, grad_output: np.ndarray, q_s: np.ndarray, k_s: np.ndarray,
          *, post: float, fq: float, fk: float, provider: Provider,
          budget: int | None = None, nominal_threads: int | None = None
          ) -> tuple[np.ndarray, dict[str, Any]]:
    """Run the fused kernel on dot-score operands; return the output and raw gradients.

    ``q_s`` (B, Hq, Q, D) and ``k_s`` (B, Hkv, K, D) are the operands whose dot product,
    times ``post``, is the score; ``fq``, ``fk`` scale dq and dk. Returns ``out`` and a dict
    with dq (of ``q_s``), dk, dv (kv heads), row_dot, row_dot_output, lse, grad_bias and
    the layout and tile counts.
    """
    B, Hq, Q, K = call.score_shape
    Hkv, Dk, Dv = call.k.shape[1], q_s.shape[3], call.v.shape[3]
    lay = task_layout(call, provider, provider.budget if budget is None else budget,
                      nominal_threads=nominal_threads)
    drop, zop = _dropout(call)
    mode, gshape = _gbias(call, lay.chunks)
    full = call.score_shape
    g_o = np.array(grad_output, dtype=np.float64, order="C")
    if call.query_valid is not None:
        np.copyto(g_o, 0.0, where=~call.query_valid_full())  # unused rows consume nothing
    out, lse, row_max, dq, rowdot, dvec = zeros_block(
        (B, Hq, Q, Dv), (B, Hq, Q), (B, Hq, Q), (B, Hq, Q, Dk), (B, Hq, Q), (B, Hq, Q))
    C = lay.chunks
    dk, dv, gbias = zeros_block((C, B, Hkv, K, Dk), (C, B, Hkv, K, Dv), gshape)
    tasks = B * Hkv * C
    tiles = np.zeros((tasks, 2), dtype=np.int64)
    tv = tile_visibility(full, relation=call.relation) if call.relation is not None else \
        tile_visibility(full, visible=call.visible)
    sink = ro(call.sink) if call.sink is not None else np.zeros(0)
    sanitized = call.sanitized_rows()  # never with a sink: the sink fills an empty row
    LD, LP = score_stride(K), score_stride(min(KEY_CHUNK, K))
    with running(lay, provider):
        fused_value_and_grad(
            ro(q_s), ro(k_s), ro(call.v), ro(call.head_map), post, fq, fk, tv,
            call.bias is not None, strided(call.bias, full, np.float64), drop, zop,
            float(call.softcap or 0.0), sink, ro(call.query_valid_full()[:, 0, :, 0]),
            ro(np.ascontiguousarray(sanitized)), ro(g_o), lay.block_q, KEY_CHUNK, LD, LP, C,
            provider.address, split_tiles(provider, lay, Dk, Dv), lay.threads,
            *_scratch(lay, K, LD, LP, Dv, call.softcap is not None, drop[0] != 0),
            out, lse, row_max, dq, dk, dv, rowdot, dvec, gbias, mode, tiles)
    grad_bias = None
    if call.bias is not None:
        partial = gbias.sum(axis=0)[:, :, None, :] if mode == GBIAS_OVER_Q else gbias
        grad_bias = reduce_to_shape(partial, call.bias.shape)
    done, skipped = (int(x) for x in tiles.sum(axis=0))
    return out, {
        "dq": dq, "dk": dk.sum(axis=0) if C > 1 else dk[0],
        "dv": dv.sum(axis=0) if C > 1 else dv[0], "row_dot": rowdot, "row_dot_output": dvec,
        "lse": lse, "row_max": row_max, "grad_bias": grad_bias, "sanitized": sanitized,
        "info": {"block_q": lay.block_q, "chunks": C, "threads": lay.threads,
                 "blas_threads": lay.blas_threads, **provider.record(),
                 "split_tiles": split_tiles(provider, lay, Dk, Dv).tolist(),
                 "key_chunks_computed": done, "key_chunks_skipped": skipped},
    }


def _unit(x: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    norm = np.sqrt((x * x).sum(axis=-1, keepdims=True))
    clamped = norm < eps
    n = np.where(clamped, eps, norm)
    return x / n, n, clamped


def _unit_backward(g_hat: np.ndarray, x_hat: np.ndarray, n: np.ndarray,
                   clamped: np.ndarray) -> np.ndarray:
    radial = (g_hat * x_hat).sum(axis=-1, keepdims=True)
    return np.where(clamped, g_hat, g_hat - x_hat * radial) / n


def value_and_grad(call: AttentionCall, grad_output: np.ndarray, *, provider: Provider,
                   budget: int | None = None, nominal_threads: int | None = None
                   ) -> tuple[np.ndarray, Gradients, dict[str, Any]]:
    """Output, Gradients and the run's record of ``call`` on the fused kernel.

    The record holds the layout and tile counts, and the forward's saved rows ``lse`` and
    ``row_max`` (B, Hq, Q) and ``sanitized`` (B, Hq, Q) bool. ``nominal_threads``: as
    :func:`task_layout`'s.

    Raises
    ------
    RefAttnError
        For the additive score family (no fast path; the caller falls back).
    """
    # the host's own products (q W, dq W^T, ...) run on this thread: a threaded BLAS call
    # here leaves the library's workers spinning against numba's threads for about 0.1 s
    with single_thread_blas():
        return _value_and_grad(call, grad_output, provider, budget, nominal_threads)


def _value_and_grad(call: AttentionCall, grad_output: np.ndarray, provider: Provider,
                    budget: int | None, nominal_threads: int | None
                    ) -> tuple[np.ndarray, Gradients, dict[str, Any]]:
    fam = call.score
    mult = operand_multipliers(call.scale, call.scale_placement)
    q_s = call.q if mult.query == 1.0 else call.q * mult.query
    k_s = call.k if mult.key == 1.0 else call.k * mult.key
    extra: dict[str, Any] = {}
    match fam.name:
        case "dot":
            out, r = fused(call, grad_output, q_s, k_s, post=mult.post,
                           fq=mult.query * mult.post, fk=mult.key * mult.post,
                           provider=provider, budget=budget, nominal_threads=nominal_threads)
            grad_q = r["dq"]
        case "bilinear":  # u = (q_s W) . k_s: the dot kernel on q' = q_s W
            W = fam.W if fam.W.ndim == 2 else fam.W[None]
            q_m = q_s @ W  # (B, Hq, Q, Dk)
            out, r = fused(call, grad_output, q_m, k_s, post=mult.post, fq=mult.post,
                           fk=mult.key * mult.post, provider=provider, budget=budget,
                           nominal_threads=nominal_threads)
            grad_q = (r["dq"] @ W.swapaxes(-1, -2)) * mult.query  # (B, Hq, Q, Dq)
            per_head = (q_s.swapaxes(-1, -2) @ r["dq"]).sum(axis=0)  # (Hq, Dq, Dk) on BLAS
            extra["grad_score_params"] = {"W": per_head.sum(axis=0) if fam.W.ndim == 2
                                          else per_head}
        case "cosine":  # u = q_hat . k_hat: the dot kernel on unit rows
            q_hat, nq, cq = _unit(q_s, fam.eps)
            k_hat, nk, ck = _unit(k_s, fam.eps)
            out, r = fused(call, grad_output, q_hat, k_hat, post=mult.post, fq=mult.post,
                           fk=mult.post, provider=provider, budget=budget,
                           nominal_threads=nominal_threads)
            grad_q = _unit_backward(r["dq"], q_hat, nq, cq)
            r["dk"] = _unit_backward(r["dk"], k_hat, nk, ck)
        case other:
            raise RefAttnError(f"score: the fused numba path has no {other!r} family")
    if call.sink is not None:  # d lse / d sink = sink_probs; the sink carries no value row
        sink_probs = np.exp(call.sink[None, :, None] - r["lse"])
        extra["grad_sink"] = -(sink_probs * r["row_dot"]).sum(axis=(0, 2))
    grads = Gradients(grad_output=grad_output, grad_v=r["dv"], grad_consumed=None,
                      grad_probs=None, row_dot=r["row_dot"], row_dot_output=r["row_dot_output"],
                      grad_scores=None, grad_q=grad_q, grad_k=r["dk"], grad_bias=r["grad_bias"],
                      **extra)
    return out, grads, {**r["info"], "lse": r["lse"], "row_max": r["row_max"],
                        "sanitized": r["sanitized"]}
