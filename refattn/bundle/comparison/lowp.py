"""The naive attention algorithm in a lower precision: the yardstick of the comparison rule.

Owns :func:`naive_lowp`, which reruns a golden case's forward and backward in float32, float16 or
bfloat16 the way an unfused framework does: inputs rounded to the dtype, every operation evaluated
in float32 and its result rounded to the dtype (PyTorch's convention for low-precision ops), BLAS
pinned to one thread so the yardstick is deterministic. Its distance to the float64 golden is the
error that precision cannot avoid; :mod:`refattn.bundle.comparison.harness` allows a candidate a
fixed multiple of it. Defers the tolerance settings to :mod:`refattn.bundle.comparison.tolerances`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from refattn.bundle.comparison.tolerances import round_to
from refattn.bundle.golden.spec import CaseSpec
from refattn.call.placement import operand_multipliers
from refattn.engine.reduce import gather_heads, reduce_to_shape, sum_heads
from refattn.errors import RefAttnError

__all__ = ["MODELLED", "ROUTES", "naive_lowp"]

#: saved-state routes of the naive backward (the contract's "Training state saved by the local
#: operation"): keep the probabilities, or keep the row log-partition L and recompute
#: P = exp(S - L) with D = sum(G_O * O), as FlashAttention's backward does
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


def naive_lowp(spec: CaseSpec, dtype: np.dtype, *, route: str = "stored_probs"
               ) -> dict[str, np.ndarray]:
    """Forward and backward of ``spec`` in ``dtype`` (each op in float32, rounded to dtype).

    Parameters
    ----------
    spec : CaseSpec
        The golden case (its float64 inputs are rounded to ``dtype`` first).
    dtype : numpy dtype
        float32, float16 or ml_dtypes.bfloat16.
    route : {"stored_probs", "lse_recompute"}
        Saved state of the backward: the forward's probabilities, or the row log-partition
        with ``P = exp(S - L)`` recomputed in ``dtype`` and ``D = sum(G_O * O)`` (the
        FlashAttention backward). The forward tensors are the same for both.

    Returns
    -------
    dict of str to float64 ndarray
        Every name in :data:`MODELLED` that the case has, holding the lower-precision values
        (exactly representable in ``dtype``) widened to float64.

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
    """
    if route not in ROUTES:
        raise RefAttnError(f"route: expected one of {list(ROUTES)}, got {route!r}")
    dtype = np.dtype(dtype)
    with threadpool_limits(limits=1):
        out = _naive(spec, dtype, route)
    return {name: np.asarray(x, dtype=np.float64) for name, x in out.items()}


def _naive(spec: CaseSpec, dtype: np.dtype, route: str) -> dict[str, Any]:
    t = spec.tensors

    def r(x: Any) -> np.ndarray:  # round an op's float32 result to the storage dtype
        return round_to(x, dtype)

    f32 = np.float32
    alpha = spec.scale
    mult = operand_multipliers(alpha, spec.scale_placement)  # alpha applied once in total
    head_map = np.asarray(t["head_map"])
    q, k, v = r(t["q"]), r(t["k"]), r(t["v"])
    k_eff = gather_heads(k, head_map)  # (B, Hq, K, Dk)
    v_eff = gather_heads(v, head_map)  # (B, Hq, K, Dv)
    res: dict[str, Any] = {"q": q, "k": k, "v": v}

    family = spec.score_family()
    params = {n: r(a) for n, a in family.parameters().items()}
    if params:
        family = family.with_arrays(**params)
        res.update({f"score_{n}": a for n, a in params.items()})
    q_s = q if mult.query == 1.0 else r(q * f32(mult.query))  # (B, Hq, Q, Dq) pre-scaled
    k_s = k_eff if mult.key == 1.0 else r(k_eff * f32(mult.key))  # (B, Hq, K, Dk)
    scores = r(family.compatibility(q_s, k_s))  # (B, Hq, Q, K) u
    if mult.post != 1.0:
        scores = r(scores * f32(mult.post))  # post-product scale
    cap = spec.softcap
    if cap is not None:
        res["softcap_input"] = scores
        scores = r(f32(cap) * r(np.tanh(r(scores / f32(cap)))))
    res["scores"] = scores
    biased = scores
    if "bias" in t:
        bias = r(t["bias"])
        res["bias"] = bias
        biased = r(scores + bias)
    res["biased_scores"] = biased
    vis = spec.visible_full(sanitized=True)
    masked = np.where(vis, biased, f32(-np.inf))  # (B, Hq, Q, K)
    res["masked_scores"] = masked
    row_max = masked.max(axis=-1)  # (B, Hq, Q), exact in any dtype
    sink = None
    if "sink" in t:
        sink = np.broadcast_to(r(t["sink"])[None, :, None], row_max.shape)  # (B, Hq, Q)
        res["sink"] = r(t["sink"])
        row_max = np.maximum(row_max, sink)
    e = r(np.exp(r(masked - row_max[..., None])))  # exactly 0 off the support
    denom = r(e.sum(axis=-1, dtype=f32))  # (B, Hq, Q)
    if sink is not None:
        e_sink = r(np.exp(r(sink - row_max)))
        denom = r(denom + e_sink)
        sink_probs = r(e_sink / denom)  # (B, Hq, Q)
        res["sink_probs"] = sink_probs
    probs = r(e / denom[..., None])
    lse = r(row_max + r(np.log(denom)))
    res.update(row_max=row_max, lse=lse, probs=probs)
    z = r(spec.multiplier_full())
    consumed = r(probs * z)
    qv = spec.query_valid_full()  # (B, 1, Q, 1)
    output = np.where(qv, r(consumed @ v_eff), f32(0.0))  # (B, Hq, Q, Dv)
    res.update(dropout_multiplier=z, consumed=consumed, output=output)

    if "grad_output" not in t:
        return res
    g_in = r(t["grad_output"])
    g_o = np.where(qv, g_in, f32(0.0))
    Hkv = k.shape[1]
    row_dot_output = r((r(g_o * output)).sum(axis=-1, dtype=f32))  # (B, Hq, Q)
    if route == "lse_recompute":  # P from the saved log-partition, in dtype
        probs = r(np.exp(r(masked - lse[..., None])))  # exactly 0 off the support
        consumed = r(probs * z)
        if sink is not None:
            sink_probs = r(np.exp(r(sink - lse)))  # (B, Hq, Q)
    grad_consumed = r(g_o @ v_eff.swapaxes(-1, -2))  # (B, Hq, Q, K)
    grad_probs = r(grad_consumed * z)
    if route == "lse_recompute":
        row_dot = row_dot_output  # D = sum(G_O * O)
    else:
        row_dot = r((r(probs * grad_probs)).sum(axis=-1, dtype=f32))  # D = sum(P * G_P)
    grad_scores = r(probs * r(grad_probs - row_dot[..., None]))
    grad_scaled = grad_scores  # gradient w.r.t. alpha * u
    if cap is not None:
        th = r(scores / f32(cap))
        grad_scaled = r(grad_scores * r(f32(1.0) - r(th * th)))
        res["grad_softcap_input"] = grad_scaled
    sg = family.compatibility_backward(grad_scaled, q_s, k_s)
    grad_q = r(r(sg.grad_q) * f32(mult.query * mult.post))
    grad_k_eff = r(r(sg.grad_k) * f32(mult.key * mult.post))
    res.update({f"grad_score_{n}": r(r(g) * f32(mult.post)) for n, g in sg.params.items()})
    if sink is not None:
        res["grad_sink"] = r(-(r(sink_probs * row_dot)).sum(axis=(0, 2), dtype=f32))
    res.update(
        grad_output=g_in,
        grad_v=r(sum_heads(r(consumed.swapaxes(-1, -2) @ g_o), head_map, Hkv)),
        grad_consumed=grad_consumed,
        grad_probs=grad_probs,
        row_dot=row_dot,
        row_dot_output=row_dot_output,
        grad_scores=grad_scores,
        grad_q=grad_q,
        grad_k=r(sum_heads(grad_k_eff, head_map, Hkv)),
    )
    if "bias" in t:
        res["grad_bias"] = r(reduce_to_shape(grad_scores, t["bias"].shape))
    return res
