"""The naive attention algorithm in a lower precision: the yardstick of the comparison rule.

Owns :func:`naive_lowp`, which reruns a golden case's forward and backward in float32, float16 or
bfloat16 the way an unfused framework does: inputs rounded to the dtype, every operation evaluated
in float32 and its result rounded to the dtype (PyTorch's convention for low-precision ops), BLAS
pinned to one thread so the yardstick is deterministic. Its distance to the float64 golden is the
error that precision cannot avoid; :mod:`refattn.bundle.comparison.harness` allows a candidate a
fixed multiple of it. Defers the tolerance settings to :mod:`refattn.bundle.comparison.tolerances`.
"""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from refattn.bundle.comparison.tolerances import round_to
from refattn.bundle.golden.guarantee import saved_state_scales
from refattn.bundle.golden.spec import CaseSpec
from refattn.call.placement import operand_multipliers
from refattn.engine.reduce import gather_heads, reduce_to_shape, sum_heads
from refattn.errors import RefAttnError

__all__ = ["MODELLED", "ROUTES", "naive_lowp", "naive_routes", "natural_magnitudes"]

#: saved-state routes of the naive backward (the contract's "Training state saved by the local
#: operation"): keep the probabilities, or keep the row log-partition L and recompute
#: P = exp(S - L) with D = sum(G_O * O), as FlashAttention's backward does (its products
#: accumulated in float32, dS rounded to the dtype once)
ROUTES = ("stored_probs", "lse_recompute")

#: canonical tensors the naive lower-precision reference produces (when the case has them),
#: besides the score family's ``score_<name>`` parameters and ``grad_score_<name>`` gradients
MODELLED = (
    "q", "k", "v", "bias", "sink", "softcap_input", "scores", "biased_scores",
    "masked_scores", "row_max", "lse", "probs", "sink_probs", "dropout_multiplier", "consumed",
    "output", "grad_output", "grad_v", "grad_consumed", "grad_probs", "row_dot",
    "row_dot_output", "grad_scores", "grad_softcap_input", "grad_q", "grad_k", "grad_bias",
    "grad_sink",
)


#: (B, Hq, Q, K) elements one block of the naive algorithm holds per array: a call within it
#: runs whole; a larger one (the kernel suite's) runs per batch row and block of query rows,
#: so the yardstick of a kernel-shaped case stays within a few hundred MiB
BLOCK_SCORES = 1 << 22
#: tensors of shape (B, Hq, Q, K): computed per block, kept only when asked for
_SCORE_SHAPED = frozenset(("softcap_input", "scores", "biased_scores", "masked_scores", "probs",
                           "dropout_multiplier", "consumed", "grad_consumed", "grad_probs",
                           "grad_scores", "grad_softcap_input"))


def naive_lowp(spec: CaseSpec, dtype: np.dtype, *, route: str = "stored_probs",
               names: Any = None) -> dict[str, np.ndarray]:
    """Forward and backward of ``spec`` in ``dtype`` (each op in float32, rounded to dtype).

    Parameters
    ----------
    spec : CaseSpec
        The golden case (its float64 inputs are rounded to ``dtype`` first).
    dtype : numpy dtype
        float32, float16 or ml_dtypes.bfloat16.
    route : {"stored_probs", "lse_recompute"}
        Saved state of the backward: the forward's probabilities (every op rounded to
        ``dtype``), or the row log-partition as FlashAttention's backward does: ``P = exp(S -
        L)``, ``dP = G_O V^T``, ``D = sum(G_O * O)`` (of the rounded output) and ``dS`` in
        float32, dS rounded to ``dtype`` once before its products (P Z once before dV's). In
        float32 the two routes round the same ops. The forward tensors are the same for both.
    names : iterable of str, optional
        The tensors wanted (default: every name of :data:`MODELLED`). A call of more than
        :data:`BLOCK_SCORES` score elements runs per batch row and block of query rows, its
        sums over query rows (the kv and bias gradients) accumulated in float32 across
        blocks before the one rounding to ``dtype``; a (B, Hq, Q, K) tensor is assembled only
        when named.

    Returns
    -------
    dict of str to float64 ndarray
        Every wanted name in :data:`MODELLED` that the case has, holding the lower-precision
        values (exactly representable in ``dtype``) widened to float64.

    Examples
    --------
    >>> from refattn.bundle.suites import build_suite
    >>> from refattn.bundle.golden.spec import case_spec
    >>> spec = case_spec(build_suite("contract")[1])
    >>> lp = naive_lowp(spec, np.dtype(np.float32))
    >>> err = np.abs(lp["output"] - spec.tensors["output"]).max()
    >>> bool(0 < err < 1e-6)
    True
    >>> rec = naive_lowp(spec, np.dtype(np.float32), route="lse_recompute")
    >>> bool(np.array_equal(rec["output"], lp["output"])), bool(0 < np.abs(rec["grad_q"]
    ...     - spec.tensors["grad_q"]).max() < 1e-6)
    (True, True)
    >>> sorted(naive_lowp(spec, np.dtype(np.float32), names=["output", "lse"]))
    ['lse', 'output']
    """
    return naive_routes(spec, dtype, (route,), names=names)[route]


def naive_routes(spec: CaseSpec, dtype: np.dtype, routes: Any = ROUTES, *,
                 names: Any = None) -> dict[str, dict[str, np.ndarray]]:
    """:func:`naive_lowp` of several routes at once: the forward (shared) runs once.

    Returns
    -------
    dict of str to dict of str to float64 ndarray
        route -> what :func:`naive_lowp` returns for it (the same values).

    Examples
    --------
    >>> from refattn.bundle.suites import build_suite
    >>> from refattn.bundle.golden.spec import case_spec
    >>> spec = case_spec(build_suite("contract")[1])
    >>> both = naive_routes(spec, np.dtype(np.float16), names=["output", "grad_q"])
    >>> alone = naive_lowp(spec, np.dtype(np.float16), route="lse_recompute",
    ...                    names=["output", "grad_q"])
    >>> bool(np.array_equal(both["lse_recompute"]["grad_q"], alone["grad_q"]))
    True
    """
    routes = tuple(routes)
    for route in routes:
        if route not in ROUTES:
            raise RefAttnError(f"route: expected one of {list(ROUTES)}, got {route!r}")
    dtype = np.dtype(dtype)
    wanted = None if names is None else frozenset(names)
    with threadpool_limits(limits=1):
        out = _Naive(spec, dtype, routes, wanted).run()
    return {route: {name: np.asarray(x, dtype=np.float64) for name, x in res.items()
                    if wanted is None or name in wanted} for route, res in out.items()}


class _Naive:
    """The naive algorithm over blocks (one block: the whole call, op for op as unfused
    frameworks run it): the forward once, the backward once per route."""

    def __init__(self, spec: CaseSpec, dtype: np.dtype, routes: tuple[str, ...],
                 wanted: frozenset[str] | None) -> None:
        self.spec, self.dtype, self.routes, self.wanted = spec, dtype, routes, wanted
        self.res: dict[str, Any] = {}  # the inputs and the forward, shared by the routes
        self.back: dict[str, dict[str, Any]] = {r: {} for r in routes}  # each route's
        self.acc: dict[str, dict[str, Any]] = {r: {} for r in routes}  # float32 sums over
        # blocks, rounded once at the end

    def r(self, x: Any) -> np.ndarray:  # round an op's float32 result to the storage dtype
        return round_to(x, self.dtype)

    def keep(self, name: str, value: Any, where: tuple[Any, ...], shape: tuple[int, ...],
             into: dict[str, Any] | None = None) -> None:
        """Place one block's ``value`` of tensor ``name`` (full ``shape``) at ``where``, in
        the shared results or a route's (``into``)."""
        if self.wanted is not None and name not in self.wanted:
            return
        out = self.res if into is None else into
        if where == ():
            out[name] = value
            return
        if name not in out:
            out[name] = np.empty(shape, dtype=np.float32)
        out[name][where] = value

    @staticmethod
    def add(acc: dict[str, Any], name: str, value: Any) -> None:
        """Add one block's float32 partial sum of ``name``."""
        acc[name] = value if name not in acc else acc[name] + value

    def run(self) -> dict[str, Any]:
        spec = self.spec
        t = spec.tensors
        r = self.r
        B, Hq, Q, K = spec.score_shape
        self.head_map = np.asarray(t["head_map"])
        self.mult = operand_multipliers(spec.scale, spec.scale_placement)
        self.q, self.k, self.v = r(t["q"]), r(t["k"]), r(t["v"])
        self.res.update(q=self.q, k=self.k, v=self.v)
        self.family = spec.score_family()
        params = {n: r(a) for n, a in self.family.parameters().items()}
        if params:
            self.family = self.family.with_arrays(**params)
            self.res.update({f"score_{n}": a for n, a in params.items()})
        self.bias = r(t["bias"]) if "bias" in t else None
        if self.bias is not None:
            self.res["bias"] = self.bias
        self.sink = r(t["sink"]) if "sink" in t else None
        if self.sink is not None:
            self.res["sink"] = self.sink
        self.backward = "grad_output" in t
        if self.backward:
            self.res["grad_output"] = r(t["grad_output"])
        if B * Hq * Q * K <= BLOCK_SCORES:
            self._block(slice(None), slice(None), ())
        else:
            rows = max(1, BLOCK_SCORES // max(1, Hq * K))
            for b in range(B):
                for i0 in range(0, Q, rows):
                    self._block(slice(b, b + 1), slice(i0, min(Q, i0 + rows)),
                                (slice(b, b + 1), slice(None), slice(i0, min(Q, i0 + rows))))
        for route in self.routes:
            self._finish(route)
        return {route: {**self.res, **self.back[route]} for route in self.routes}

    def _block(self, bs: slice, rs: slice, where: tuple[Any, ...]) -> None:
        """Batch rows ``bs`` and query rows ``rs`` (every head, every key)."""
        spec, r, f32 = self.spec, self.r, np.float32
        B, Hq, Q, K = spec.score_shape
        full4 = (B, Hq, Q, K)
        mult, family = self.mult, self.family
        k_eff = gather_heads(self.k[bs], self.head_map)  # (b, Hq, K, Dk)
        v_eff = gather_heads(self.v[bs], self.head_map)  # (b, Hq, K, Dv)
        q = self.q[bs][:, :, rs]  # (b, Hq, r, Dk)
        q_s = q if mult.query == 1.0 else r(q * f32(mult.query))  # pre-scaled
        k_s = k_eff if mult.key == 1.0 else r(k_eff * f32(mult.key))  # (b, Hq, K, Dk)
        scores = r(family.compatibility(q_s, k_s))  # (b, Hq, r, K) u
        if mult.post != 1.0:
            scores = r(scores * f32(mult.post))  # post-product scale
        cap = spec.softcap
        if cap is not None:
            self.keep("softcap_input", scores, where, full4)
            scores = r(f32(cap) * r(np.tanh(r(scores / f32(cap)))))
        self.keep("scores", scores, where, full4)
        biased = scores
        if self.bias is not None:
            bias = np.broadcast_to(self.bias, full4)[bs][:, :, rs]
            biased = r(scores + bias)
        self.keep("biased_scores", biased, where, full4)
        vis = spec.visible_full(sanitized=True)[bs][:, :, rs]
        masked = np.where(vis, biased, f32(-np.inf))  # (b, Hq, r, K)
        self.keep("masked_scores", masked, where, full4)
        row_max = masked.max(axis=-1)  # (b, Hq, r), exact in any dtype
        sink = None
        if self.sink is not None:
            sink = np.broadcast_to(self.sink[None, :, None], row_max.shape)  # (b, Hq, r)
            row_max = np.maximum(row_max, sink)
        e = r(np.exp(r(masked - row_max[..., None])))  # exactly 0 off the support
        denom = r(e.sum(axis=-1, dtype=f32))  # (b, Hq, r)
        sink_probs = None
        if sink is not None:
            e_sink = r(np.exp(r(sink - row_max)))
            denom = r(denom + e_sink)
            sink_probs = r(e_sink / denom)  # (b, Hq, r)
            self.keep("sink_probs", sink_probs, where, full4[:3])
        probs = r(e / denom[..., None])
        lse = r(row_max + r(np.log(denom)))
        self.keep("row_max", row_max, where, full4[:3])
        self.keep("lse", lse, where, full4[:3])
        self.keep("probs", probs, where, full4)
        z = r(spec.multiplier_full()[bs][:, :, rs])
        consumed = r(probs * z)
        qv = spec.query_valid_full()[bs][:, :, rs]  # (b, 1, r, 1)
        output = np.where(qv, r(consumed @ v_eff), f32(0.0))  # (b, Hq, r, Dv)
        self.keep("dropout_multiplier", z, where, full4)
        self.keep("consumed", consumed, where, full4)
        self.keep("output", output, where, (B, Hq, Q, output.shape[-1]))
        if not self.backward:
            return
        g_o = np.where(qv, self.res["grad_output"][bs][:, :, rs], f32(0.0))
        row_dot_output = r((r(g_o * output)).sum(axis=-1, dtype=f32))  # (b, Hq, r)
        forward = SimpleNamespace(
            bs=bs, rs=rs, where=where, k_eff=k_eff, v_eff=v_eff, q_s=q_s, k_s=k_s,
            scores=scores, masked=masked, lse=lse, sink=sink, sink_probs=sink_probs,
            probs=probs, z=z, consumed=consumed, output=output, g_o=g_o,
            row_dot_output=row_dot_output)
        for route in self.routes:
            self._backward(route, forward)

    def _backward(self, route: str, fw: SimpleNamespace) -> None:
        """One route's backward of one block, from the block's forward ``fw``."""
        spec, r, f32 = self.spec, self.r, np.float32
        B, Hq, Q, K = spec.score_shape
        full4 = (B, Hq, Q, K)
        mult, family, cap = self.mult, self.family, spec.softcap
        out, acc = self.back[route], self.acc[route]
        bs, rs, where, v_eff, q_s, k_s = fw.bs, fw.rs, fw.where, fw.v_eff, fw.q_s, fw.k_s
        scores, masked, lse, sink, z, output, g_o = (fw.scores, fw.masked, fw.lse, fw.sink,
                                                     fw.z, fw.output, fw.g_o)
        probs, consumed, sink_probs, row_dot_output = (fw.probs, fw.consumed, fw.sink_probs,
                                                       fw.row_dot_output)
        if route == "lse_recompute":
            # FlashAttention's backward: P from the saved log-partition and D = sum(G_O * O)
            # from the rounded output, with P, dP, D and dS held in float32 and dS rounded
            # once, before its products (in float32 the same numbers as rounding each op)
            p32 = np.exp(masked - lse[..., None])  # (b, Hq, r, K), exactly 0 off the support
            probs, consumed = r(p32), r(p32 * z)  # P Z rounded for dV
            if sink is not None:
                sink_probs = r(np.exp(r(sink - lse)))  # (b, Hq, r)
            gc32 = g_o @ v_eff.swapaxes(-1, -2)  # (b, Hq, r, K) dP before Z
            gp32 = gc32 * z
            d32 = (g_o * output).sum(axis=-1, dtype=f32)  # (b, Hq, r)
            grad_consumed, grad_probs, row_dot = r(gc32), r(gp32), r(d32)
            ds32 = p32 * (gp32 - d32[..., None])
            grad_scores = r(ds32)
            if cap is not None:
                th = scores / f32(cap)  # tanh of the capped scores
                ds32 = ds32 * (f32(1.0) - th * th)
            grad_scaled = r(ds32)  # gradient w.r.t. alpha * u
        else:
            grad_consumed = r(g_o @ v_eff.swapaxes(-1, -2))  # (b, Hq, r, K)
            grad_probs = r(grad_consumed * z)
            row_dot = r((r(probs * grad_probs)).sum(axis=-1, dtype=f32))  # D = sum(P * G_P)
            grad_scores = r(probs * r(grad_probs - row_dot[..., None]))
            grad_scaled = grad_scores  # gradient w.r.t. alpha * u
            if cap is not None:
                th = r(scores / f32(cap))
                grad_scaled = r(grad_scores * r(f32(1.0) - r(th * th)))
        if cap is not None:
            self.keep("grad_softcap_input", grad_scaled, where, full4, out)
        sg = family.compatibility_backward(grad_scaled, q_s, k_s)
        grad_q = r(r(sg.grad_q) * f32(mult.query * mult.post))
        self.keep("grad_q", grad_q, where, (B, Hq, Q, grad_q.shape[-1]), out)
        for n, g in sg.params.items():
            self.add(acc, f"grad_score_{n}", g)
        if sink_probs is not None:
            self.add(acc, "grad_sink", (r(sink_probs * row_dot)).sum(axis=(0, 2), dtype=f32))
        for name, value in (("grad_consumed", grad_consumed), ("grad_probs", grad_probs),
                            ("grad_scores", grad_scores)):
            self.keep(name, value, where, full4, out)
        for name, value in (("row_dot", row_dot), ("row_dot_output", row_dot_output)):
            self.keep(name, value, where, full4[:3], out)
        # sums over query rows: float32 across blocks, rounded once (_finish)
        self._place_acc(acc, "grad_v", consumed.swapaxes(-1, -2) @ g_o, bs)  # (b,Hq,K,Dv)
        self._place_acc(acc, "grad_k", sg.grad_k, bs)  # (b, Hq, K, Dk)
        if self.bias is not None:
            self._bias_acc(acc, grad_scores, bs, rs)

    def _place_acc(self, acc: dict[str, Any], name: str, part: np.ndarray, bs: slice) -> None:
        B = self.spec.score_shape[0]
        if name not in acc:
            acc[name] = np.zeros((B, *part.shape[1:]), dtype=np.float32)
        acc[name][bs] += part

    def _bias_acc(self, acc: dict[str, Any], grad_scores: np.ndarray, bs: slice,
                  rs: slice) -> None:
        shape = np.shape(self.spec.tensors["bias"])
        if bs == slice(None) and rs == slice(None):  # one block: the whole call
            acc["grad_bias"] = reduce_to_shape(grad_scores, shape)
            return
        b4 = (1,) * (4 - len(shape)) + tuple(shape)
        # this block's (b, Hq, r, K) summed over the axes the bias broadcasts along
        rows = grad_scores.shape[2] if b4[2] > 1 else 1
        part = reduce_to_shape(grad_scores, (1 if b4[0] == 1 else grad_scores.shape[0], b4[1],
                                             rows, b4[3]))
        if "grad_bias" not in acc:
            acc["grad_bias"] = np.zeros(b4, dtype=np.float32)
        acc["grad_bias"][bs if b4[0] > 1 else slice(None), :,
                         rs if b4[2] > 1 else slice(None)] += part

    def _finish(self, route: str) -> None:
        if not self.backward:
            return
        r, f32 = self.r, np.float32
        mult = self.mult
        Hkv = self.k.shape[1]
        acc, out = self.acc[route], self.back[route]
        out["grad_v"] = r(sum_heads(r(acc["grad_v"]), self.head_map, Hkv))
        grad_k_eff = r(r(acc["grad_k"]) * f32(mult.key * mult.post))
        out["grad_k"] = r(sum_heads(grad_k_eff, self.head_map, Hkv))
        out.update({name: r(r(g) * f32(mult.post)) for name, g in acc.items()
                    if name.startswith("grad_score_")})
        if "grad_sink" in acc:
            out["grad_sink"] = r(-acc["grad_sink"])
        if "grad_bias" in acc:
            shape = np.shape(self.spec.tensors["bias"])
            out["grad_bias"] = r(np.reshape(acc["grad_bias"], shape))


@lru_cache(maxsize=8)
def natural_magnitudes(spec: CaseSpec) -> dict[str, float]:
    """The natural magnitude of each tensor of a golden case (the largest sum of absolute
    terms behind one element), from its stored output, lse, row dot and cotangent: the
    scale of the rule's natural floor. Dot-family cases with a backward; ``{}`` otherwise.
    Computed in blocks of query rows (no (B, Hq, Q, K) tensor), kept for the last few cases.

    Examples
    --------
    >>> from refattn.bundle.suites import build_suite
    >>> from refattn.bundle.golden.spec import case_spec
    >>> n = natural_magnitudes(case_spec(build_suite("contract")[1]))
    >>> sorted(n)[:4], n["row_max"] > 0
    (['grad_bias', 'grad_k', 'grad_q', 'grad_v'], True)
    """
    t = spec.tensors
    if spec.score_family_name != "dot" or any(
            n not in t for n in ("output", "lse", "row_dot", "grad_output")):
        return {}
    trace = SimpleNamespace(output=t["output"], lse=t["lse"])
    grads = SimpleNamespace(grad_output=t["grad_output"], row_dot=t["row_dot"])
    try:
        return saved_state_scales(spec.to_call(), trace, grads)[1]
    except RefAttnError:  # a call this reader cannot rebuild: no natural floor
        return {}
