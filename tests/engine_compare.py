"""Comparing two backends' tensors by each tensor's natural magnitude (shared by engine tests).

The natural magnitude of a tensor is the largest sum of absolute terms that forms one of its
elements (computed from a reference trace with every operand replaced by its absolute value).
Floating-point error is bounded by a few ulp of that sum, so ``max|a - b| <= rtol * natural``
stays meaningful when an element cancels to nearly 0, where an element-wise relative error
would only measure the noise of the cancellation. Supports, -inf positions and structural
zeros (products with an exact 0) are compared exactly. Dot-family calls only.

:func:`refattn.bundle.golden.guarantee.natural_scales` is the same formula, but it answers ``{}``
for every other score family (``refattn verify`` then applies its normwise rule), and that is
part of what verify checks. tests/engine/test_exact_decides.py applies this copy to bilinear,
additive and cosine calls too (the family-independent magnitudes: probs, output, grad_v,
grad_scores, ...) and adds each family's own gradient magnitudes on top
(``_family_scales``); with guarantee's version it fails with a KeyError on the first
bilinear call. So the tests keep this copy; for dot calls the two agree entry for entry.
"""

from __future__ import annotations

import numpy as np

from refattn.engine.reduce import gather_heads, reduce_to_shape, sum_heads

DENSE_RTOL = 1e-13
STREAM_RTOL = 1e-12
# zeros that come from a product with an exact 0 (masked P, dropped Z, an unused row); other
# tensors are sums that may cancel to 0 by accident (e.g. a bias broadcast over keys)
STRUCTURAL_ZEROS = ("probs", "dropout_multiplier", "consumed", "output", "grad_consumed",
                    "grad_probs", "grad_scores")


def natural_scales(call, ref, grads) -> dict[str, float]:
    """Largest sum of absolute terms behind one element of every compared tensor."""
    a = np.abs
    k_eff = gather_heads(call.k, call.head_map)
    v_eff = gather_heads(call.v, call.head_map)
    B, _, Q, _ = call.q.shape
    qv = np.broadcast_to(call.query_valid_full(), (B, 1, Q, 1))
    g_o = np.where(qv, grads.grad_output, 0.0)
    z = np.broadcast_to(ref.dropout_multiplier, ref.probs.shape)
    scores = call.scale * (a(call.q) @ a(k_eff).swapaxes(-1, -2))
    biased = scores if call.bias is None else scores + a(call.bias)
    g_probs = (a(g_o) @ a(v_eff).swapaxes(-1, -2)) * a(z)
    g_scores = ref.probs * (g_probs + a(grads.row_dot)[..., None])
    out = {
        "scores": scores.max(), "biased_scores": biased.max(), "masked_scores": biased.max(),
        "row_max": biased.max(), "lse": biased.max() + np.log(call.score_shape[3]) + 1.0,
        "probs": 1.0, "dropout_multiplier": a(z).max(), "consumed": a(z).max(),
        "output": (a(ref.consumed) @ a(v_eff)).max(),
        "grad_v": sum_heads(a(ref.consumed).swapaxes(-1, -2) @ a(g_o), call.head_map,
                            call.k.shape[1]).max(),  # summed over a kv head's query heads
        "grad_consumed": (a(g_o) @ a(v_eff).swapaxes(-1, -2)).max(),
        "grad_probs": g_probs.max(), "row_dot": (ref.probs * g_probs).sum(-1).max(),
        # sum_d |g_o| |O| with O at its natural magnitude |consumed| |v|: an output that
        # cancels to ~0 still carries an error of the order of |consumed| |v| eps
        "row_dot_output": (a(g_o) * (a(ref.consumed) @ a(v_eff))).sum(-1).max(),
        "grad_scores": g_scores.max(),
        "grad_q": call.scale * (g_scores @ a(k_eff)).max(),
        "grad_k": call.scale * sum_heads(g_scores.swapaxes(-1, -2) @ a(call.q), call.head_map,
                                         call.k.shape[1]).max(),
    }
    if call.bias is not None:
        out["grad_bias"] = reduce_to_shape(g_scores, call.bias.shape).max()
    return {name: max(float(x), np.finfo(float).tiny) for name, x in out.items()}


def assert_close(name: str, got, want, scale: float, rtol: float, *,
                 zeros: bool | np.ndarray = True) -> None:
    """``got`` within ``rtol * scale`` of ``want`` elementwise, with the same infinities, and 0
    wherever ``want`` has a structural zero: every exact zero of ``want`` (``zeros`` True),
    none (False), or where the mask ``zeros`` is set (a zero that rounding may or may not
    produce, such as ``p (g - D)`` at p = 1 where D = g in one summation order, is not one)."""
    got = np.broadcast_to(got, np.shape(want))
    assert got.shape == want.shape, name
    inf = np.isinf(want)
    np.testing.assert_array_equal(np.isinf(got), inf, err_msg=f"{name}: -inf support differs")
    if zeros is not False:
        where = want == 0.0 if zeros is True else np.broadcast_to(zeros, want.shape)
        np.testing.assert_array_equal(got[where] == 0.0, True,
                                      err_msg=f"{name}: a structural zero of the reference is "
                                      "not 0")
    err = float(np.max(np.abs(got[~inf] - want[~inf]), initial=0.0))
    assert err <= rtol * scale, f"{name}: error {err:.3e} > {rtol:g} * natural scale {scale:.3e}"
