"""The naive attention algorithm in a lower precision: the yardstick of the comparison rule.

Owns :func:`naive_lowp`, which reruns a golden case's forward and backward in float32,
float16 or bfloat16 the way an unfused framework does: inputs rounded to the dtype, every
operation evaluated in float32 and its result rounded to the dtype (PyTorch's convention for
low-precision ops), BLAS pinned to one thread so the yardstick is deterministic. Its distance
to the float64 golden is the error that precision cannot avoid; :mod:`refattn.compare` allows
a candidate a fixed multiple of it. Defers the tolerance settings to :mod:`refattn.tolerances`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from refattn.case_spec import CaseSpec
from refattn.engine.reduce import gather_heads, reduce_to_shape, sum_heads
from refattn.errors import RefAttnError
from refattn.tolerances import round_to

__all__ = ["MODELLED", "naive_lowp"]

#: canonical tensors the naive lower-precision reference produces
MODELLED = (
    "q", "k", "v", "bias", "scores", "biased_scores", "masked_scores", "row_max", "lse",
    "probs", "dropout_multiplier", "consumed", "output", "grad_output", "grad_v",
    "grad_consumed", "grad_probs", "row_dot", "row_dot_output", "grad_scores", "grad_q",
    "grad_k", "grad_bias",
)


def _check_supported(spec: CaseSpec) -> None:
    m = spec.call_manifest
    placement = m["scale"].get("placement", "post_qk_product")
    family = (m.get("score") or {}).get("family", "dot")
    modifiers = m.get("score_modifiers") or {}
    unmodelled = [
        f"{what}={value!r}" for what, value, ok in (
            ("scale placement", placement, placement == "post_qk_product"),
            ("score family", family, family == "dot"),
            ("softcap", modifiers.get("softcap"), modifiers.get("softcap") is None),
            ("sink", modifiers.get("sink"), modifiers.get("sink") is None),
        ) if not ok
    ]
    if unmodelled:
        raise RefAttnError(
            f"{spec.case_id}: the naive lower-precision reference does not model "
            + ", ".join(unmodelled)
        )


def naive_lowp(spec: CaseSpec, dtype: np.dtype) -> dict[str, np.ndarray]:
    """Forward and backward of ``spec`` in ``dtype`` (each op in float32, rounded to dtype).

    Parameters
    ----------
    spec : CaseSpec
        The golden case (its float64 inputs are rounded to ``dtype`` first).
    dtype : numpy dtype
        float32, float16 or ml_dtypes.bfloat16.

    Returns
    -------
    dict of str to float64 ndarray
        Every name in :data:`MODELLED` that the case has, holding the lower-precision values
        (exactly representable in ``dtype``) widened to float64.

    Examples
    --------
    >>> from refattn.suites import build_suite
    >>> from refattn.case_spec import case_spec
    >>> spec = case_spec(build_suite("contract")[1])
    >>> lp = naive_lowp(spec, np.dtype(np.float32))
    >>> err = np.abs(lp["output"] - spec.tensors["output"]).max()
    >>> bool(0 < err < 1e-6)
    True
    """
    from threadpoolctl import threadpool_limits

    _check_supported(spec)
    dtype = np.dtype(dtype)
    with threadpool_limits(limits=1):
        out = _naive(spec, dtype)
    return {name: np.asarray(x, dtype=np.float64) for name, x in out.items()}


def _naive(spec: CaseSpec, dtype: np.dtype) -> dict[str, Any]:
    t = spec.tensors

    def r(x: np.ndarray) -> np.ndarray:  # round an op's float32 result to the storage dtype
        return round_to(x, dtype)

    f32 = np.float32
    scale = f32(spec.scale)
    head_map = np.asarray(t["head_map"])
    q, k, v = r(t["q"]), r(t["k"]), r(t["v"])
    k_eff = gather_heads(k, head_map)  # (B, Hq, K, Dk)
    v_eff = gather_heads(v, head_map)  # (B, Hq, K, Dv)
    res: dict[str, Any] = {"q": q, "k": k, "v": v}

    scores = r(r(q @ k_eff.swapaxes(-1, -2)) * scale)  # (B, Hq, Q, K), post-product scale
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
    e = r(np.exp(r(masked - row_max[..., None])))  # exactly 0 off the support
    denom = r(e.sum(axis=-1, dtype=f32))  # (B, Hq, Q)
    probs = r(e / denom[..., None])
    res.update(row_max=row_max, lse=r(row_max + r(np.log(denom))), probs=probs)
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
    grad_consumed = r(g_o @ v_eff.swapaxes(-1, -2))  # (B, Hq, Q, K)
    grad_probs = r(grad_consumed * z)
    row_dot = r((r(probs * grad_probs)).sum(axis=-1, dtype=f32))  # (B, Hq, Q)
    grad_scores = r(probs * r(grad_probs - row_dot[..., None]))
    res.update(
        grad_output=g_in,
        grad_v=r(sum_heads(r(consumed.swapaxes(-1, -2) @ g_o), head_map, Hkv)),
        grad_consumed=grad_consumed,
        grad_probs=grad_probs,
        row_dot=row_dot,
        row_dot_output=r((r(g_o * output)).sum(axis=-1, dtype=f32)),
        grad_scores=grad_scores,
        grad_q=r(r(grad_scores @ k_eff) * scale),
        grad_k=r(sum_heads(r(r(grad_scores.swapaxes(-1, -2) @ q) * scale), head_map, Hkv)),
    )
    if "bias" in t:
        res["grad_bias"] = r(reduce_to_shape(grad_scores, t["bias"].shape))
    return res
