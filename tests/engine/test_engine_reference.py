"""The NumPy reference forward/backward: contract numbers, zero structure, finite differences."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest

import refattn
from gradcheck import central_difference
from refattn import AttentionCall, RefAttnError
from refattn.bundle.suites.contract import LOOP6_GRAD_OUTPUT, loop6_call, loop7_call

HALF_ULP_6 = 0.5e-6  # published to six decimals
HALF_ULP_4 = 0.5e-4  # published to four decimals


def _close_published(actual, published, half_ulp):
    np.testing.assert_allclose(actual, np.asarray(published), rtol=0, atol=half_ulp * 1.0001)


# -- contract fixtures ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def loop6():
    trace = refattn.forward(loop6_call())
    return trace, refattn.backward(trace, LOOP6_GRAD_OUTPUT)


def test_loop6_forward_numbers(loop6):
    t, _ = loop6
    _close_published(t.probs[0, 0], [[0.753474, 0.246526, 0.0],
                                     [0.257122, 0.191056, 0.551822]], HALF_ULP_6)
    _close_published(t.dropout_multiplier[0, 0], [[1.333333, 0, 0], [0, 1.333333, 1.333333]],
                     HALF_ULP_6)
    _close_published(t.consumed[0, 0], [[1.004632, 0, 0], [0, 0.254741, 0.735763]], HALF_ULP_6)
    _close_published(t.consumed[0, 0].sum(-1), [1.004632, 0.990504], HALF_ULP_6)
    _close_published(t.output[0, 0], [[1.004632, -1.004632], [0.141601, 2.334659]], HALF_ULP_6)


def test_loop6_backward_numbers(loop6):
    _, g = loop6
    _close_published(g.row_dot[0, 0], [1.105096, 2.072873], HALF_ULP_6)
    _close_published(g.row_dot_output[0, 0], [1.105096, 2.072873], HALF_ULP_6)
    _close_published(g.grad_scores[0, 0], [[0.272434, -0.272434, 0.0],
                                           [-0.532981, -0.383297, 0.916279]], HALF_ULP_6)
    np.testing.assert_allclose(g.row_dot, g.row_dot_output, rtol=1e-15, atol=0)


def test_loop6_dropped_vs_masked_edges(loop6):
    t, g = loop6
    # legal edge (0, 1) dropped: no direct gradient, but a non-zero score gradient
    assert t.dropout_multiplier[0, 0, 0, 1] == 0.0 and t.probs[0, 0, 0, 1] > 0
    assert g.grad_probs[0, 0, 0, 1] == 0.0
    assert g.grad_scores[0, 0, 0, 1] != 0.0
    # illegal edge (0, 2) masked: zero probability and exactly zero score gradient
    assert t.probs[0, 0, 0, 2] == 0.0
    assert t.masked_scores[0, 0, 0, 2] == -np.inf
    assert g.grad_scores[0, 0, 0, 2] == 0.0
    # the translation identity of one realisation: adding c to V adds R_i * c
    row_sums = t.consumed[0, 0].sum(-1)
    _close_published(np.outer(row_sums, [2.0, -1.5]), [[2.009265, -1.506949],
                                                        [1.981008, -1.485756]], HALF_ULP_6)


def test_loop6_lse_reconstructs_probs(loop6):
    t, _ = loop6
    vis = loop6_call().visible_full()
    rebuilt = np.where(vis, np.exp(t.masked_scores - t.lse[..., None]), 0.0)
    # the contract reports 2.78e-17 for its own evaluation order; ours must stay within one
    # unit in the last place of every probability
    assert (np.abs(rebuilt - t.probs) <= np.spacing(t.probs)).all()


def test_loop6_backward_matches_central_differences_within_contract_bound():
    call = loop6_call()
    analytic = refattn.backward(refattn.forward(call), LOOP6_GRAD_OUTPUT)
    worst = 0.0
    for name in ("q", "k", "v"):
        def loss(x, name=name):
            arrays = {"q": call.q, "k": call.k, "v": call.v, name: x}
            out = refattn.forward(AttentionCall(**arrays, visible=call.visible,
                                                dropout=call.dropout)).output
            return math.fsum((out * LOOP6_GRAD_OUTPUT).ravel())  # correctly rounded loss
        numeric = central_difference(loss, getattr(call, name), eps=1e-6)
        worst = max(worst, np.abs(numeric - getattr(analytic, f"grad_{name}")).max())
    assert worst <= 2.84e-10


def test_all_dropped_row_contributes_exactly_zero():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s) for s in [(1, 1, 3, 4), (1, 1, 5, 4), (1, 1, 5, 2)])
    z = np.full((3, 5), 2.0)
    z[1] = 0.0
    t = refattn.forward(AttentionCall(q, k, v, dropout=z))
    g = refattn.backward(t, rng.standard_normal((1, 1, 3, 2)))
    assert (t.output[0, 0, 1] == 0).all()
    for name in ("grad_probs", "grad_scores", "grad_q"):
        assert (getattr(g, name)[0, 0, 1] == 0).all(), name
    assert g.row_dot[0, 0, 1] == 0.0 and g.row_dot_output[0, 0, 1] == 0.0
    # the row's contribution to grad_k / grad_v is zero: compare with the row removed
    g_without = refattn.backward(
        refattn.forward(AttentionCall(q[:, :, [0, 2]], k, v, dropout=z[[0, 2]])),
        g.grad_output[:, :, [0, 2]],
    )
    np.testing.assert_allclose(g.grad_k, g_without.grad_k, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(g.grad_v, g_without.grad_v, rtol=1e-14, atol=1e-15)


def test_loop7_padded_source_with_bias_plus_7_stays_excluded():
    call = loop7_call()
    t = refattn.forward(call)
    g = refattn.backward(t, np.ones((1, 1, 2, 2)))
    _close_published(t.probs[0, 0, 0], [0.3650, 0.6350, 0.0], HALF_ULP_4)
    _close_published(t.output[0, 0, 0], [1.6350, 0.0951], HALF_ULP_4)
    assert t.scores.shape == (1, 1, 2, 3)  # target-by-source, not square
    np.testing.assert_array_equal(t.biased_scores[..., 2], t.scores[..., 2] + 7.0)
    assert np.isneginf(t.masked_scores[..., 2]).all()
    assert (t.probs[..., 2] == 0).all()
    assert (g.grad_scores[..., 2] == 0).all() and (g.grad_bias[..., 2] == 0).all()
    assert (g.grad_v[0, 0, 2] == 0).all()  # source:2 contributes nothing
    np.testing.assert_allclose(t.probs.sum(-1), 1.0, rtol=0, atol=1e-15)
    np.testing.assert_allclose(t.output, t.consumed @ call.v, rtol=1e-15)


# -- a scalar row-by-row oracle (second implementation) ------------------------------------

def _scalar_reference(call: AttentionCall):
    B, Hq, Q, K = call.score_shape
    Dv = call.v.shape[3]
    vis, qv = call.visible_full(), call.query_valid_full()
    z = call.multiplier_full()
    bias = None if call.bias is None else np.broadcast_to(call.bias, call.score_shape)
    probs = np.zeros(call.score_shape)
    out = np.zeros((B, Hq, Q, Dv))
    for b in range(B):
        for h in range(Hq):
            g = call.head_map[h]
            for i in range(Q):
                legal = [j for j in range(K) if vis[b, h, i, j]] or [0]
                s = {}
                for j in legal:
                    dot = math.fsum(call.q[b, h, i, d] * call.k[b, g, j, d]
                                    for d in range(call.q.shape[3]))
                    s[j] = dot * call.scale + (0.0 if bias is None else bias[b, h, i, j])
                m = max(s.values())
                den = math.fsum(math.exp(x - m) for x in s.values())
                for j in legal:
                    probs[b, h, i, j] = math.exp(s[j] - m) / den
                if qv[b, 0, i, 0]:
                    for d in range(Dv):
                        out[b, h, i, d] = math.fsum(
                            probs[b, h, i, j] * (1.0 if z is None else z[b, h, i, j])
                            * call.v[b, g, j, d] for j in legal)
    return probs, out


def _random_call(rng, *, B=2, Hq=4, Hkv=2, Q=3, K=5, Dk=4, Dv=3, bias_shape=None,
                 dropout=False, mask=True, **kwargs):
    q = rng.standard_normal((B, Hq, Q, Dk))
    k = rng.standard_normal((B, Hkv, K, Dk))
    v = rng.standard_normal((B, Hkv, K, Dv))
    if mask:
        vis = rng.random((B, Hq, Q, K)) < 0.7
        vis[..., 0] = True
        kwargs.setdefault("visible", vis)
    if bias_shape is not None:
        kwargs["bias"] = rng.standard_normal(bias_shape)
    if dropout:
        kwargs["dropout"] = rng.standard_normal((B, Hq, Q, K))  # any finite real multiplier
    return AttentionCall(q, k, v, **kwargs)


CASES = {
    "plain": {"mask": False},
    "masked": {},
    "bias_full": {"bias_shape": (2, 4, 3, 5)},
    "bias_broadcast": {"bias_shape": (4, 1, 5)},
    "gqa_dropout": {"dropout": True, "bias_shape": (3, 1)},
    "mqa": {"Hkv": 1},
    "cross_dk_ne_dv": {"Q": 6, "K": 2, "Dk": 7, "Dv": 2},
    "explicit_head_map": {"Hq": 3, "Hkv": 2, "head_map": np.array([1, 0, 1])},
}


def _seed(case: str) -> int:
    """A seed per case, the same in every process (``hash`` of a str is salted per process)."""
    return zlib.crc32(case.encode())


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_matches_scalar_oracle(case):
    call = _random_call(np.random.default_rng(_seed(case)), **CASES[case])
    t = refattn.forward(call)
    probs, out = _scalar_reference(call)
    np.testing.assert_allclose(t.probs, probs, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(t.output, out, rtol=1e-12, atol=1e-14)
    legal = call.visible_full()
    assert (t.probs[~legal] == 0).all()
    # p_i = fl(e_i / fl(sum e)), then summed: the denominator's K - 1 roundings, the division's
    # one and the sum's K - 1, gamma_n = n u / (1 - n u) with n = 2K - 1 (Higham, ch. 3)
    n, u = 2 * call.score_shape[-1] - 1, 2.0**-53
    np.testing.assert_allclose(t.probs.sum(-1), 1.0, rtol=0, atol=n * u / (1 - n * u))


def _fd_check(call: AttentionCall, grad_output: np.ndarray, names=("q", "k", "v", "bias")):
    grads = refattn.backward(refattn.forward(call), grad_output)
    fields = {"q": call.q, "k": call.k, "v": call.v, "bias": call.bias}
    rest = {"visible": call.visible, "query_valid": call.query_valid, "dropout": call.dropout,
            "head_map": call.head_map, "all_masked_rows": call.all_masked_rows}
    for name in names:
        if fields[name] is None:
            continue

        def loss(x, name=name):
            arrays = {**fields, name: x}
            out = refattn.forward(AttentionCall(**arrays, **rest)).output
            return float((out * grad_output).sum())

        numeric = central_difference(loss, fields[name], eps=1e-6)
        analytic = getattr(grads, f"grad_{name}")
        assert analytic.shape == fields[name].shape
        scale = max(1.0, np.abs(numeric).max())
        assert np.abs(analytic - numeric).max() <= 1e-8 * scale, name
    return grads


@pytest.mark.parametrize("case", sorted(CASES))
def test_backward_matches_central_differences(case):
    rng = np.random.default_rng(_seed(case) + 1)
    call = _random_call(rng, **CASES[case])
    _fd_check(call, rng.standard_normal((*call.score_shape[:3], call.v.shape[3])))


def test_sanitize_policy_zero_rows_forward_and_backward():
    rng = np.random.default_rng(11)
    vis = np.ones((2, 1, 4, 5), bool)
    vis[1, 0, 2] = False  # empty row, unused
    qv = np.ones((2, 1, 4, 1), bool)
    qv[1, 0, 2] = False
    qv[0, 0, 0] = False  # unused row with legal keys
    call = _random_call(rng, Q=4, mask=False, visible=vis, query_valid=qv,
                        bias_shape=(2, 1, 4, 5),
                        all_masked_rows="sanitize_then_zero_invalid_query")
    t = refattn.forward(call)
    assert t.sanitized_rows[1, :, 2].all() and t.sanitized_rows.sum() == 4
    assert (t.output[1, :, 2] == 0).all() and (t.output[0, :, 0] == 0).all()
    g = _fd_check(call, rng.standard_normal((2, 4, 4, 3)))
    for name in ("grad_scores", "grad_probs", "grad_q"):
        assert (getattr(g, name)[1, :, 2] == 0).all() and (getattr(g, name)[0, :, 0] == 0).all()
    assert (g.grad_bias[1, 0, 2] == 0).all() and (g.grad_bias[0, 0, 0] == 0).all()


def test_gqa_gradients_equal_the_expanded_mha_sum():
    rng = np.random.default_rng(5)
    call = _random_call(rng, Hq=6, Hkv=2, bias_shape=(6, 3, 5))
    go = rng.standard_normal((2, 6, 3, 3))
    g = refattn.backward(refattn.forward(call), go)
    expanded = AttentionCall(call.q, call.k[:, call.head_map], call.v[:, call.head_map],
                             visible=call.visible, bias=call.bias)
    ge = refattn.backward(refattn.forward(expanded), go)
    np.testing.assert_array_equal(g.grad_q, ge.grad_q)
    for kv in range(2):
        heads = np.flatnonzero(call.head_map == kv)
        np.testing.assert_allclose(g.grad_k[:, kv], ge.grad_k[:, heads].sum(1), rtol=1e-14)
        np.testing.assert_allclose(g.grad_v[:, kv], ge.grad_v[:, heads].sum(1), rtol=1e-14)


def test_masked_entries_have_exactly_zero_score_gradient_and_rows_sum_to_zero():
    rng = np.random.default_rng(8)
    call = _random_call(rng, dropout=True, bias_shape=(5,))
    g = refattn.backward(refattn.forward(call), rng.standard_normal((2, 4, 3, 3)))
    assert (g.grad_scores[~call.visible_full()] == 0).all()
    np.testing.assert_allclose(g.grad_scores.sum(-1), 0.0, atol=1e-14)
    assert g.grad_bias.shape == (5,)


def test_backward_is_bit_identical_when_repeated():
    rng = np.random.default_rng(9)
    call = _random_call(rng, dropout=True, bias_shape=(4, 3, 5))
    go = rng.standard_normal((2, 4, 3, 3))
    a = refattn.backward(refattn.forward(call), go)
    b = refattn.backward(refattn.forward(call), go)
    for name, value in a.tensors().items():
        np.testing.assert_array_equal(value, getattr(b, name), err_msg=name)


def test_grad_output_rejections():
    t = refattn.forward(_random_call(np.random.default_rng(1)))
    with pytest.raises(RefAttnError, match="grad_output: expected dtype float64, got float32"):
        refattn.backward(t, np.ones((2, 4, 3, 3), np.float32))
    with pytest.raises(RefAttnError, match=r"grad_output: expected shape \[B=2,Hq=4,Q=3,Dv=3\]"):
        refattn.backward(t, np.ones((2, 4, 3, 2)))
    bad = np.ones((2, 4, 3, 3))
    bad[1, 2, 0, 1] = np.nan
    match = r"grad_output: non-finite value nan at index \(1, 2, 0, 1\)"
    with pytest.raises(RefAttnError, match=match):
        refattn.backward(t, bad)


def test_unknown_backend_lists_known_ones():
    with pytest.raises(RefAttnError, match=r"unknown backend 'torch'; known backends: \[.*'numpy'"):
        refattn.forward(_random_call(np.random.default_rng(1)), backend="torch")


def test_reference_backend_rejects_options():
    call = _random_call(np.random.default_rng(1))
    with pytest.raises(RefAttnError, match=r"'numpy' takes only max_bytes, got \['materialize'\]"):
        refattn.forward(call, backend="numpy", materialize=False)


def test_attention_returns_output_and_weights_follow_request():
    rng = np.random.default_rng(2)
    call = _random_call(rng, dropout=True, returned_weights="post_dropout")
    out = refattn.attention(call.q, call.k, call.v, visible=call.visible, dropout=call.dropout)
    t = refattn.forward(call)
    np.testing.assert_array_equal(out, t.output)
    np.testing.assert_array_equal(t.weights, t.consumed)
    assert refattn.forward(_random_call(rng)).weights is None


def test_trace_arrays_are_read_only():
    t = refattn.forward(_random_call(np.random.default_rng(4)))
    with pytest.raises(ValueError, match="read-only"):
        t.probs[0, 0, 0, 0] = 0.5
