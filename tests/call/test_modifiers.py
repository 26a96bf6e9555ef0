"""Finite score modifiers: softcap, ALiBi and attention sinks -- forward against per-element
loops, backward against complex step / central differences, and none revives an illegal edge."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import refattn
from gradcheck import assert_gradients, central_difference
from refattn import AttentionCall, RefAttnError
from refattn.call.bias import alibi, alibi_slope_gradient, alibi_slopes
from refattn.call.scores import Additive
from refattn.engine.reference import forward_arrays
from tests.call_vjp import assert_call_gradients

B, Hq, Hkv, Q, K, Dk, Dv = 2, 4, 2, 3, 6, 4, 2
CAP = 1.5


def _rng(seed=0):
    return np.random.default_rng(seed)


def _call(seed=0, *, softcap=None, sink=None, bias=None, dropout=None, query_valid=None,
          **kw):
    rng = _rng(seed)
    q = 2.0 * rng.standard_normal((B, Hq, Q, Dk))  # large enough that the cap is active
    k = rng.standard_normal((B, Hkv, K, Dk))
    v = rng.standard_normal((B, Hkv, K, Dv))
    visible = np.tril(np.ones((Q, K), bool), k=K - Q)  # lower-right causal
    visible[2, 1] = False
    return AttentionCall(q, k, v, visible=visible, softcap=softcap, sink=sink, bias=bias,
                         dropout=dropout, query_valid=query_valid, **kw)


def _loop(call):
    """Per-element oracle: s = alpha q.k; c tanh(s/c); + bias; visible; softmax with sink."""
    shape = call.score_shape
    bias = np.zeros(shape) if call.bias is None else np.broadcast_to(call.bias, shape)
    vis, z = call.visible_full(), call.multiplier_full()
    qv = call.query_valid_full()
    probs = np.zeros(shape)
    out = np.zeros((*shape[:3], call.v.shape[3]))
    sink_p = np.zeros(shape[:3])
    for b, h, i in np.ndindex(*shape[:3]):
        kv = call.head_map[h]
        s = {}
        for j in range(shape[3]):
            if not vis[b, h, i, j]:
                continue
            x = call.scale * float(call.q[b, h, i] @ call.k[b, kv, j])
            if call.softcap is not None:
                x = call.softcap * math.tanh(x / call.softcap)
            s[j] = x + bias[b, h, i, j]
        logits = list(s.values()) + ([] if call.sink is None else [call.sink[h]])
        m = max(logits)
        den = sum(math.exp(x - m) for x in logits)
        for j, x in s.items():
            probs[b, h, i, j] = math.exp(x - m) / den
            zz = 1.0 if z is None else z[b, h, i, j]
            if qv[b, 0, i, 0]:
                out[b, h, i] += probs[b, h, i, j] * zz * call.v[b, kv, j]
        if call.sink is not None:
            sink_p[b, h, i] = math.exp(call.sink[h] - m) / den
    return probs, out, sink_p


def _kwargs(call):
    return dict(head_map=call.head_map, scale=call.scale, visible=call.visible_full(),
                query_valid=call.query_valid_full(), bias=call.bias,
                multiplier=call.multiplier_full(), score=call.score,
                scale_placement=call.scale_placement, softcap=call.softcap, sink=call.sink)


def _loss(call, g_o, **over):
    args = {"q": call.q, "k": call.k, "v": call.v}
    kw = _kwargs(call)
    for name, x in over.items():
        if name in args:
            args[name] = x
        elif name.startswith("score_"):
            kw["score"] = call.score.with_arrays(**{name[6:]: x})
        else:
            kw[name] = x
    return (forward_arrays(args["q"], args["k"], args["v"], **kw)["output"] * g_o).sum()


def _check_grads(call, names, *, seed=9):
    assert_call_gradients(call, names)
    return refattn.backward(refattn.forward(call), _rng(seed).standard_normal((B, Hq, Q, Dv)))


# -- softcap -----------------------------------------------------------------------------------

def test_softcap_forward_matches_per_element_formula():
    call = _call(softcap=CAP, bias=_rng(1).standard_normal((Q, K)))
    t = refattn.forward(call)
    probs, out, _ = _loop(call)
    np.testing.assert_allclose(t.probs, probs, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(t.output, out, rtol=1e-13, atol=1e-15)
    raw = refattn.forward(_call(bias=call.bias)).scores  # the same scaled scores, uncapped
    np.testing.assert_array_equal(t.softcap_input, raw)
    assert np.abs(raw).max() > 2 * CAP  # the cap is really active
    assert np.abs(t.scores).max() < CAP
    # order: cap the scaled scores, then add the finite bias (the bias itself is not capped)
    np.testing.assert_array_equal(t.biased_scores, t.scores + call.bias)


def test_softcap_backward_matches_complex_step():
    call = _call(softcap=CAP, bias=_rng(1).standard_normal((1, Hq, Q, K)))
    grads = _check_grads(call, ["q", "k", "v", "bias"])
    t = refattn.forward(call)
    expect = grads.grad_scores * (1.0 - np.tanh(t.softcap_input / CAP) ** 2)
    np.testing.assert_allclose(grads.grad_softcap_input, expect, rtol=1e-14, atol=1e-16)


def test_softcap_tends_to_the_uncapped_model_for_a_large_cap():
    t = refattn.forward(_call(softcap=1e6)).output
    np.testing.assert_allclose(t, refattn.forward(_call()).output, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan, True, "1"])
def test_softcap_gate(bad):
    with pytest.raises(RefAttnError, match=r"softcap: expected a"):
        _call(softcap=bad)


# -- ALiBi -------------------------------------------------------------------------------------

def test_alibi_standard_slopes():
    # Press et al.: 8 heads -> 1/2, 1/4, ..., 1/256
    np.testing.assert_array_equal(alibi_slopes(8), 2.0 ** -np.arange(1, 9))
    # 12 heads: the 8 slopes above, then every other slope of the 16-head sequence 2**(-k/2)
    expect = np.concatenate([2.0 ** -np.arange(1, 9), 2.0 ** -np.array([0.5, 1.5, 2.5, 3.5])])
    np.testing.assert_allclose(alibi_slopes(12), expect, rtol=1e-15)
    assert alibi_slopes(1).tolist() == [2.0 ** -8]
    for bad in (0, -2, 2.0, True):
        with pytest.raises(RefAttnError, match=r"num_heads"):
            alibi_slopes(bad)


def test_alibi_bias_matches_per_element_formula():
    slopes = alibi_slopes(Hq)
    q_pos = np.arange(Q) + K - Q  # bottom-right aligned queries
    k_pos = np.arange(K)
    bias = alibi(slopes, q_pos, k_pos)
    assert bias.shape == (1, Hq, Q, K)
    for h, i, j in np.ndindex(Hq, Q, K):
        assert bias[0, h, i, j] == -slopes[h] * abs(int(q_pos[i]) - int(k_pos[j]))
    # on every causal edge it is the original ALiBi m * (j - i)
    for h, i, j in np.ndindex(Hq, Q, K):
        if k_pos[j] <= q_pos[i]:
            assert bias[0, h, i, j] == slopes[h] * (k_pos[j] - q_pos[i])
    batched = alibi(slopes, np.stack([q_pos, q_pos + 1]), k_pos)
    assert batched.shape == (2, Hq, Q, K)
    np.testing.assert_array_equal(batched[0], bias[0])


def test_alibi_gradient_flows_to_grad_bias_and_the_slopes():
    slopes = alibi_slopes(Hq) * 4.0
    q_pos, k_pos = np.arange(Q) + K - Q, np.arange(K)
    call = _call(bias=alibi(slopes, q_pos, k_pos))
    g_o = _rng(9).standard_normal((B, Hq, Q, Dv))
    grads = _check_grads(call, ["bias"])
    assert grads.grad_bias.shape == (1, Hq, Q, K)
    analytic = alibi_slope_gradient(grads.grad_bias, q_pos, k_pos)

    def loss(m):
        return float(_loss(call, g_o, bias=alibi(m, q_pos, k_pos)))

    np.testing.assert_allclose(analytic, central_difference(loss, slopes), rtol=1e-7, atol=1e-10)


def test_alibi_rejects_bad_inputs():
    with pytest.raises(RefAttnError, match=r"slopes: expected dtype float64"):
        alibi(np.ones(2, np.float32), np.arange(2), np.arange(2))
    with pytest.raises(RefAttnError, match=r"slopes: expected shape \[H\] .* or \[B,H\]"):
        alibi(np.ones((2, 1, 1)), np.arange(2), np.arange(2))
    with pytest.raises(RefAttnError, match=r"slopes: non-finite value nan at index \(1, 0\)"):
        alibi(np.array([[1.0], [np.nan]]), np.arange(2), np.arange(2))
    with pytest.raises(RefAttnError, match=r"slopes: batch axis B=3 does not broadcast"):
        alibi(np.ones((3, 2)), np.zeros((2, 3), int), np.zeros((2, 3), int))
    with pytest.raises(RefAttnError, match=r"q_pos: expected dtype float64"):
        alibi(np.ones(2), np.arange(2, dtype=np.float32), np.arange(2))
    with pytest.raises(RefAttnError, match=r"k_pos: non-finite"):
        alibi(np.ones(2), np.arange(2), np.array([0.0, np.inf]))
    with pytest.raises(RefAttnError, match=r"do not broadcast"):
        alibi(np.ones(2), np.zeros((2, 3), int), np.zeros((3, 3), int))
    with pytest.raises(RefAttnError, match=r"grad_bias: expected the alibi bias shape"):
        alibi_slope_gradient(np.ones((1, 2, 3, 3)), np.arange(2), np.arange(3))
    with pytest.raises(RefAttnError, match=r"grad_bias: expected the alibi bias shape"):
        alibi_slope_gradient(np.ones((2, 2, 2, 3)), np.zeros((3, 2)), np.zeros((3, 3)),
                             per_batch=True)


def test_alibi_per_batch_slopes_match_per_element_formula():
    slopes = _rng(4).uniform(0.05, 1.0, (B, Hq))  # (B, Hq), FlashAttention's (batch, nheads)
    q_pos, k_pos = np.arange(Q) + K - Q, np.arange(K)
    bias = alibi(slopes, q_pos, k_pos)
    assert bias.shape == (B, Hq, Q, K)
    for b, h, i, j in np.ndindex(B, Hq, Q, K):
        assert bias[b, h, i, j] == -slopes[b, h] * abs(int(q_pos[i]) - int(k_pos[j]))
    # one row of (B, Hq) slopes equal to the (Hq,) slopes gives the same bias row
    shared = alibi(slopes[1], q_pos, k_pos)
    np.testing.assert_array_equal(bias[1], shared[0])


def test_alibi_per_batch_slope_gradient_against_finite_differences():
    slopes = _rng(5).uniform(0.2, 1.0, (B, Hq))  # (B, Hq)
    q_pos, k_pos = np.arange(Q) + K - Q, np.arange(K)
    call = _call(bias=alibi(slopes, q_pos, k_pos))
    g_o = _rng(9).standard_normal((B, Hq, Q, Dv))
    grads = _check_grads(call, ["bias"])  # the engine's grad_bias, checked numerically
    assert grads.grad_bias.shape == (B, Hq, Q, K)
    analytic = alibi_slope_gradient(grads.grad_bias, q_pos, k_pos, per_batch=True)  # (B, Hq)
    assert analytic.shape == (B, Hq)

    def loss(m):
        return float(_loss(call, g_o, bias=alibi(m.reshape(B, Hq), q_pos, k_pos)))

    numeric = central_difference(loss, slopes.ravel()).reshape(B, Hq)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-7, atol=1e-10)
    # and the autograd-free checker on the slopes themselves: complex step through the bias
    dist = np.abs(q_pos[:, None] - k_pos[None, :]).astype(np.float64)  # (Q, K), independent

    def fn(m):
        kw = {**_kwargs(call), "bias": -m[:, :, None, None] * dist}  # complex-safe
        return forward_arrays(call.q, call.k, call.v, **kw)["output"]

    def vjp(g, m):
        gb = refattn.backward(refattn.forward(AttentionCall(
            call.q, call.k, call.v, visible=call.visible, bias=alibi(m, q_pos, k_pos))), g)
        return {"m": alibi_slope_gradient(gb.grad_bias, q_pos, k_pos, per_batch=True)}

    assert_gradients(fn, vjp, {"m": slopes}, mode="full", seed=3)


# -- sinks -------------------------------------------------------------------------------------

SINK = np.array([0.5, -1.0, 2.0, 0.0])


def test_sink_forward_matches_per_element_formula():
    call = _call(sink=SINK, bias=_rng(2).standard_normal((Q, K)))
    t = refattn.forward(call)
    probs, out, sink_p = _loop(call)
    np.testing.assert_allclose(t.probs, probs, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(t.sink_probs, sink_p, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(t.output, out, rtol=1e-13, atol=1e-15)
    # the sink takes mass but has no value row: rows sum to 1 - sink mass, O = P V exactly
    np.testing.assert_allclose(t.probs.sum(-1) + t.sink_probs, 1.0, rtol=0, atol=4e-16)
    assert np.all(t.sink_probs > 0) and np.all(t.probs.sum(-1) < 1.0)
    np.testing.assert_allclose(t.lse, np.log(np.exp(t.masked_scores).sum(-1)
                                             + np.exp(SINK)[None, :, None]), rtol=1e-14)


def test_a_very_negative_sink_is_no_sink():
    t = refattn.forward(_call(sink=np.full(Hq, -800.0)))
    np.testing.assert_array_equal(t.output, refattn.forward(_call()).output)
    assert np.all(t.sink_probs == 0.0)


def test_a_dominant_sink_drains_the_row_but_never_overflows():
    t = refattn.forward(_call(sink=np.full(Hq, 800.0)))
    assert np.all(np.isfinite(t.lse)) and np.abs(t.output).max() < 1e-300
    np.testing.assert_allclose(t.sink_probs, 1.0)


def test_sink_backward_matches_complex_step():
    call = _call(sink=SINK, bias=_rng(2).standard_normal((1, Hq, 1, K)))
    grads = _check_grads(call, ["q", "k", "v", "bias", "sink"])
    assert grads.grad_sink.shape == (Hq,)
    # and the closed form: d lse / d sink = sink_probs, times -D per row
    t = refattn.forward(call)
    expect = -(t.sink_probs * grads.row_dot).sum(axis=(0, 2))
    np.testing.assert_allclose(grads.grad_sink, expect, rtol=1e-14)


def test_sink_with_dropout_gqa_and_unused_query_rows():
    rng = _rng(4)
    keep = rng.random((B, Hq, Q, K)) > 0.3
    qv = np.array([True, False, True]).reshape(1, 1, Q, 1)
    call = _call(sink=SINK, dropout=keep / 0.7, query_valid=qv, softcap=CAP,
                 head_map=np.array([1, 0, 0, 1]))
    probs, out, _ = _loop(call)
    t = refattn.forward(call)
    np.testing.assert_allclose(t.probs, probs, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(t.output, out, rtol=1e-13, atol=1e-15)
    grads = _check_grads(call, ["q", "k", "v", "sink"])
    assert np.all(grads.row_dot[:, :, 1] == 0.0)  # unused rows send nothing to the sink


def _empty_row_call(*, policy="reject", query_valid=None, **kw):
    """A call whose rows (b=0, i=0) have no legal key: row 0 of batch 0 sees nothing."""
    rng = _rng(11)
    q = rng.standard_normal((B, Hq, Q, Dk))
    k = rng.standard_normal((B, Hkv, K, Dk))
    v = rng.standard_normal((B, Hkv, K, Dv))
    vis = np.ones((B, 1, Q, K), bool)
    vis[0, 0, 0] = False  # (b=0, i=0): an empty legal support on every head
    vis[1, 0, 2, :4] = False
    return AttentionCall(q, k, v, visible=vis, sink=SINK, all_masked_rows=policy,
                         query_valid=query_valid, **kw)


@pytest.mark.parametrize("policy", ["reject", "sanitize_then_zero_invalid_query"])
def test_sink_over_an_empty_row_takes_all_the_mass(policy):
    call = _empty_row_call(policy=policy)  # accepted under either policy: the row is defined
    t = refattn.forward(call)
    # contract numbers: no legal key, so P = 0, the sink's mass is 1, O = 0 and lse = sink
    assert np.all(t.probs[0, :, 0] == 0.0) and np.all(t.output[0, :, 0] == 0.0)
    np.testing.assert_array_equal(t.sink_probs[0, :, 0], 1.0)
    np.testing.assert_array_equal(t.lse[0, :, 0], SINK)
    np.testing.assert_array_equal(t.row_max[0, :, 0], SINK)
    assert not t.sanitized_rows.any()  # never given the temporary key 0
    probs, out, sink_p = _loop(call)  # the per-element oracle, empty rows included
    np.testing.assert_allclose(t.probs, probs, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(t.output, out, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(t.sink_probs, sink_p, rtol=1e-13, atol=1e-15)
    rows = call.manifest()["visibility"]["empty_rows_with_sink"]
    assert rows["count"] == Hq and rows["rows_bhi"] == [[0, h, 0] for h in range(Hq)]
    assert call.manifest()["visibility"]["sanitized_rows"] == 0


def test_sink_over_an_empty_row_backward_matches_complex_step():
    call = _empty_row_call(bias=_rng(3).standard_normal((B, Hq, Q, K)))
    grads = _check_grads(call, ["q", "k", "v", "bias", "sink"])  # complex step, every element
    # the empty row's output is 0 whatever the sink: it sends nothing to q, bias or the sink
    assert np.all(grads.grad_q[0, :, 0] == 0.0) and np.all(grads.row_dot[0, :, 0] == 0.0)
    assert np.all(grads.grad_bias[0, :, 0] == 0.0)
    t = refattn.forward(call)
    np.testing.assert_allclose(grads.grad_sink, -(t.sink_probs * grads.row_dot).sum(axis=(0, 2)),
                               rtol=1e-14)


@pytest.mark.parametrize("backend", ["exact", "numba"])
def test_sink_over_an_empty_row_on_other_backends(backend):
    call = _empty_row_call(softcap=CAP)
    g_o = _rng(12).standard_normal((B, Hq, Q, Dv))
    ref_t = refattn.forward(call)
    ref_g = refattn.backward(ref_t, g_o)
    if backend == "numba":  # the fused value_and_grad runs sinks
        out, g = refattn.value_and_grad(call, g_o, backend="numba")
        lse = None
    else:
        t = refattn.forward(call, backend=backend)
        out, g, lse = t.output, refattn.backward(t, g_o), t.lse
        np.testing.assert_array_equal(t.lse[0, :, 0], SINK)
        assert not t.sanitized_rows.any()
    assert np.all(out[0, :, 0] == 0.0)
    np.testing.assert_allclose(out, ref_t.output, rtol=1e-12, atol=1e-14)
    if lse is not None:
        np.testing.assert_allclose(lse, ref_t.lse, rtol=1e-14)
    for name in ("grad_q", "grad_k", "grad_v", "grad_sink"):
        np.testing.assert_allclose(getattr(g, name), getattr(ref_g, name), rtol=1e-11,
                                   atol=1e-13, err_msg=name)


def test_without_a_sink_the_all_masked_row_policies_are_unchanged():
    q = np.zeros((1, 1, 2, 2))
    vis = np.array([[False, False], [True, True]])
    with pytest.raises(RefAttnError, match=r"row \(b=0, h=0, i=0\) has no legal key under "
                                           r"policy 'reject'"):
        AttentionCall(q, q, q, visible=vis)
    call = AttentionCall(q, q, q, visible=vis, all_masked_rows="sanitize_then_zero_invalid_query",
                         query_valid=np.array([False, True]).reshape(1, 1, 2, 1))
    assert refattn.forward(call).sanitized_rows.tolist() == [[[True, False]]]
    assert "empty_rows_with_sink" not in call.manifest()["visibility"]


@pytest.mark.parametrize(
    ("sink", "message"),
    [
        (np.zeros(3), r"sink: expected shape \[Hq=4\], got \[3\]"),
        (np.zeros((4, 1)), r"sink: expected 1 axes, got 2"),
        (np.zeros(4, np.float32), r"sink: expected dtype float64, got float32"),
        (np.array([0.0, np.inf, 0.0, 0.0]), r"sink: non-finite value inf at index \(1\)"),
    ],
)
def test_sink_gate(sink, message):
    with pytest.raises(RefAttnError, match=message):
        _call(sink=sink)


# -- together ----------------------------------------------------------------------------------

def test_no_modifier_revives_an_illegal_edge():
    bias = np.full((Q, K), 50.0)  # a huge finite preference on every edge, legal or not
    call = _call(softcap=CAP, sink=SINK, bias=bias)
    t = refattn.forward(call)
    g = refattn.backward(t, np.ones((B, Hq, Q, Dv)))
    illegal = ~call.visible_full()
    assert illegal.any()
    assert np.all(t.probs[illegal] == 0.0) and np.all(t.masked_scores[illegal] == -np.inf)
    assert np.all(g.grad_scores[illegal] == 0.0) and np.all(g.grad_softcap_input[illegal] == 0.0)


def test_modifiers_with_a_parametrised_family():
    rng = _rng(6)
    fam = Additive(rng.standard_normal((Hq, 3, Dk)), rng.standard_normal((Hq, 3, Dk)),
                   rng.standard_normal((Hq, 3)), rng.standard_normal((Hq, 3)),
                   max_workspace_elements=30)
    call = _call(softcap=CAP, sink=SINK, bias=alibi(alibi_slopes(Hq), np.arange(Q) + 3,
                                                    np.arange(K)), score=fam, scale=0.8)
    _check_grads(call, ["q", "k", "v", "bias", "sink", "score_Wq", "score_Wk", "score_b",
                        "score_v"])


def test_manifest_records_the_modifiers():
    m = _call(softcap=CAP, sink=SINK).manifest()
    json.dumps(m, allow_nan=False)
    mods = m["score_modifiers"]
    assert mods["softcap"]["decimal"] == "1.5"
    assert mods["sink"]["has_value_row"] is False
    assert [float(x["decimal"]) for x in mods["sink"]["values"]] == SINK.tolist()
    assert mods["order"].index("softcap") < mods["order"].index("finite_bias") \
        < mods["order"].index("visibility")
    plain = _call().manifest()["score_modifiers"]
    assert plain["softcap"] is None and plain["sink"] is None


def test_modifier_tensors_are_named_for_golden_files():
    call = _call(softcap=CAP, sink=SINK)
    t = refattn.forward(call)
    g = refattn.backward(t, np.ones((B, Hq, Q, Dv)))
    assert {"softcap_input", "sink_probs", "sink"} <= set(t.tensors())
    assert {"grad_softcap_input", "grad_sink"} <= set(g.tensors())
    assert not set(refattn.forward(_call()).tensors()) & {"softcap_input", "sink_probs", "sink"}
