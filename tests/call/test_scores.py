"""Score families: forward against per-element loops, backward against complex step and
central differences, the gate, the contract's numeric claims, and the additive workspace."""

from __future__ import annotations

import json
import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refattn
from gradcheck import central_difference
from refattn import AttentionCall, RefAttnError
from refattn.call.scores import Additive, Bilinear, Cosine, Dot
from refattn.engine.reference import forward_arrays
from tests.call_vjp import assert_call_gradients

B, Hq, Hkv, Q, K, Dq, Dk, Dv, Da = 2, 4, 2, 3, 5, 3, 4, 2, 6
ALPHA = 0.7


def _rng(seed=0):
    return np.random.default_rng(seed)


def _family(name, rng, *, dq=Dq, dk=Dk):
    match name:
        case "dot":
            return Dot()
        case "bilinear":
            return Bilinear(rng.standard_normal((Hq, dq, dk)))
        case "bilinear_shared":
            return Bilinear(rng.standard_normal((dq, dk)))
        case "additive":
            return Additive(rng.standard_normal((Hq, Da, dq)), rng.standard_normal((Hq, Da, dk)),
                            rng.standard_normal((Hq, Da)), rng.standard_normal((Hq, Da)),
                            max_workspace_elements=40)  # forces several key blocks
        case "cosine":
            return Cosine(eps=1e-3)
    raise AssertionError(name)


FAMILIES = ["dot", "bilinear", "bilinear_shared", "additive", "cosine"]
EQUAL_WIDTH = {"dot", "cosine"}


def _call(name, seed=0, **kw):
    rng = _rng(seed)
    dk = Dq if name in EQUAL_WIDTH else Dk
    q = rng.standard_normal((B, Hq, Q, Dq))
    k = rng.standard_normal((B, Hkv, K, dk))
    v = rng.standard_normal((B, Hkv, K, Dv))
    if name == "cosine":  # exercise the zero-norm policy on one key and one query row
        k[0, 1, 2] = 0.0
        q[1, 0, 1] = 1e-5
    visible = np.ones((Q, K), bool)
    visible[0, 3] = False
    bias = rng.standard_normal((1, Hq, Q, K))
    fam = _family(name, rng, dk=dk)
    return AttentionCall(q, k, v, score=fam, scale=ALPHA, visible=visible, bias=bias, **kw)


# -- per-element oracle ------------------------------------------------------------------------

def _loop_u(call):
    """u[b, h, i, j] from the family's formula, one element at a time."""
    fam, hm = call.score, call.head_map
    out = np.empty(call.score_shape)
    for b, h, i, j in np.ndindex(*call.score_shape):
        qi, kj = call.q[b, h, i], call.k[b, hm[h], j]
        if isinstance(fam, Bilinear):
            W = fam.W if fam.shared else fam.W[h]
            out[b, h, i, j] = sum(qi[d] * W[d, e] * kj[e]
                                  for d in range(len(qi)) for e in range(len(kj)))
        elif isinstance(fam, Additive):
            out[b, h, i, j] = sum(
                fam.v[h, a] * math.tanh(sum(fam.Wq[h, a, d] * qi[d] for d in range(len(qi)))
                                        + sum(fam.Wk[h, a, e] * kj[e] for e in range(len(kj)))
                                        + fam.b[h, a])
                for a in range(fam.b.shape[1]))
        elif isinstance(fam, Cosine):
            nq = max(math.sqrt(sum(x * x for x in qi)), fam.eps)
            nk = max(math.sqrt(sum(x * x for x in kj)), fam.eps)
            out[b, h, i, j] = sum(qi[d] * kj[d] for d in range(len(qi))) / (nq * nk)
        else:
            out[b, h, i, j] = sum(qi[d] * kj[d] for d in range(len(qi)))
    return out


def _loop_attention(call, u):
    probs = np.zeros(call.score_shape)
    out = np.zeros((*call.score_shape[:3], call.v.shape[3]))
    bias = np.broadcast_to(call.bias, call.score_shape)
    vis = call.visible_full()
    for b, h, i in np.ndindex(*call.score_shape[:3]):
        legal = [j for j in range(call.score_shape[3]) if vis[b, h, i, j]]
        s = {j: call.scale * u[b, h, i, j] + bias[b, h, i, j] for j in legal}
        m = max(s.values())
        den = sum(math.exp(x - m) for x in s.values())
        for j in legal:
            probs[b, h, i, j] = math.exp(s[j] - m) / den
            out[b, h, i] += probs[b, h, i, j] * call.v[b, call.head_map[h], j]
    return probs, out


@pytest.mark.parametrize("name", FAMILIES)
def test_family_forward_matches_per_element_formula(name):
    call = _call(name)
    t = refattn.forward(call)
    u = _loop_u(call)
    np.testing.assert_allclose(t.scores, ALPHA * u, rtol=1e-13, atol=1e-14)
    probs, out = _loop_attention(call, u)
    np.testing.assert_allclose(t.probs, probs, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(t.output, out, rtol=1e-12, atol=1e-14)
    assert np.all(t.probs[:, :, 0, 3] == 0.0)  # visibility still authoritative


def test_cosine_zero_norm_policy_is_explicit():
    call = _call("cosine")
    u = refattn.forward(call).scores / ALPHA
    assert np.all(u[0, 2:4, :, 2] == 0.0)  # zero key row (kv head 1 -> query heads 2, 3)
    # a query of norm 1e-5 < eps = 1e-3 is divided by eps, not by its own norm
    qi = call.q[1, 0, 1]
    kj = call.k[1, 0, 0]
    expect = qi @ kj / (1e-3 * np.linalg.norm(kj))
    assert abs(u[1, 0, 1, 0] - expect) < 1e-15
    big = np.abs(u[:, :, [0, 2]])  # rows with norms above eps are true cosines
    assert big.max() <= 1.0 + 1e-15


# -- backward ----------------------------------------------------------------------------------

def _kwargs(call):
    return dict(head_map=call.head_map, scale=call.scale, visible=call.visible_full(),
                query_valid=call.query_valid_full(), bias=call.bias,
                multiplier=call.multiplier_full(), score=call.score,
                scale_placement=call.scale_placement, softcap=call.softcap, sink=call.sink)


def _loss(call, grad_output, **over):
    """sum(O * G_O) with some inputs replaced (complex allowed) -- through forward_arrays."""
    kw = _kwargs(call)
    args = {"q": call.q, "k": call.k, "v": call.v}
    for name in list(over):
        if name in args:
            args[name] = over.pop(name)
    params = {n[len("score_"):]: over.pop(n) for n in list(over) if n.startswith("score_")}
    if params:
        kw["score"] = call.score.with_arrays(**params)
    kw.update(over)
    out = forward_arrays(args["q"], args["k"], args["v"], **kw)["output"]
    return (out * grad_output).sum()


def _inputs(call, grads):
    yield "q", call.q, grads.grad_q
    yield "k", call.k, grads.grad_k
    yield "v", call.v, grads.grad_v
    yield "bias", call.bias, grads.grad_bias
    for name, p in call.score.parameters().items():
        yield f"score_{name}", p, grads.grad_score_params[name]


@pytest.mark.parametrize("name", FAMILIES)
def test_family_backward_passes_gradcheck(name):
    call = _call(name)
    params = [f"score_{n}" for n in call.score.parameters()]
    assert_call_gradients(call, ["q", "k", "v", "bias", *params])
    grads = refattn.backward(refattn.forward(call), np.ones((B, Hq, Q, Dv)))
    assert (grads.grad_score_params is None) == (not params)


@pytest.mark.parametrize("name", ["bilinear", "additive", "cosine"])
def test_family_parameter_gradients_match_central_differences(name):
    # an independent method (real arithmetic only) for the parameter gradients
    call = _call(name, seed=3)
    g_o = _rng(4).standard_normal((B, Hq, Q, Dv))
    grads = refattn.backward(refattn.forward(call), g_o)
    for arg, x, analytic in _inputs(call, grads):
        fd = central_difference(lambda z, arg=arg: float(_loss(call, g_o, **{arg: z})), x)
        np.testing.assert_allclose(analytic, fd, rtol=1e-6, atol=1e-8, err_msg=arg)


def test_shared_bilinear_gradient_is_the_sum_of_per_head_gradients():
    rng = _rng(5)
    W = rng.standard_normal((Dq, Dk))
    q, k, v = (rng.standard_normal(s) for s in [(B, Hq, Q, Dq), (B, Hkv, K, Dk), (B, Hkv, K, Dv)])
    g_o = rng.standard_normal((B, Hq, Q, Dv))
    shared = refattn.forward(AttentionCall(q, k, v, score=Bilinear(W), scale=ALPHA))
    tiled = refattn.forward(AttentionCall(q, k, v, score=Bilinear(np.stack([W] * Hq)),
                                         scale=ALPHA))
    np.testing.assert_array_equal(shared.output, tiled.output)
    gs = refattn.backward(shared, g_o).grad_score_params["W"]
    gt = refattn.backward(tiled, g_o).grad_score_params["W"]
    assert gs.shape == (Dq, Dk) and gt.shape == (Hq, Dq, Dk)
    np.testing.assert_allclose(gs, gt.sum(axis=0), rtol=1e-13, atol=1e-13)


# -- the gate ----------------------------------------------------------------------------------

def _qkv(dk=Dq):
    rng = _rng(1)
    return (rng.standard_normal((B, Hq, Q, Dq)), rng.standard_normal((B, Hkv, K, dk)),
            rng.standard_normal((B, Hkv, K, Dv)))


@pytest.mark.parametrize("name", ["bilinear", "additive", "cosine"])
def test_non_dot_families_require_an_explicit_scale(name):
    dk = Dq if name in EQUAL_WIDTH else Dk
    fam = _family(name, _rng(), dk=dk)
    with pytest.raises(RefAttnError, match=rf"scale: the {name} score has no canonical"):
        AttentionCall(*_qkv(dk), score=fam)


def test_dot_and_cosine_reject_unequal_widths_bilinear_and_additive_allow_them():
    with pytest.raises(RefAttnError, match=r"k: feature axis Dk=4 must equal q's Dk=3"):
        AttentionCall(*_qkv(Dk))
    with pytest.raises(RefAttnError, match=r"k: feature axis Dk=4 must equal q's Dk=3"):
        AttentionCall(*_qkv(Dk), score=Cosine(), scale=1.0)
    for name in ("bilinear", "additive"):
        call = AttentionCall(*_qkv(Dk), score=_family(name, _rng()), scale=1.0)
        assert call.axes["Dq"] == Dq and call.axes["Dk"] == Dk


@pytest.mark.parametrize(
    ("family", "message"),
    [
        (lambda: Bilinear(np.ones((Hq, Dq, Dq))), r"W: expected shape \[Hq,Dq,Dk\] = \[4, 3, 4\]"),
        (lambda: Bilinear(np.ones((Dk, Dq))), r"W: expected shape \[Dq,Dk\] = \[3, 4\]"),
        (lambda: Additive(np.ones((Hq, Da, Dk)), np.ones((Hq, Da, Dk)), np.ones((Hq, Da)),
                          np.ones((Hq, Da))), r"Wq: expected shape \[Hq,Da,Dq\] = \[4, 6, 3\]"),
        (lambda: Additive(np.ones((2, Da, Dq)), np.ones((2, Da, Dk)), np.ones((2, Da)),
                          np.ones((2, Da))), r"Wq: expected shape \[Hq,Da,Dq\] = \[4, 6, 3\]"),
    ],
)
def test_parameters_must_fit_the_call(family, message):
    with pytest.raises(RefAttnError, match=message):
        AttentionCall(*_qkv(Dk), score=family(), scale=1.0)


def test_family_construction_rejects_bad_parameters():
    with pytest.raises(RefAttnError, match=r"W: expected dtype float64, got float32"):
        Bilinear(np.ones((2, 2), np.float32))
    with pytest.raises(RefAttnError, match=r"W: non-finite value nan at index \(0, 1\)"):
        Bilinear(np.array([[1.0, np.nan]]))
    with pytest.raises(RefAttnError, match=r"Wk: leading axes must be \[Hq,Da\] = \[1, 2\]"):
        Additive(np.ones((1, 2, 3)), np.ones((1, 3, 3)), np.ones((1, 2)), np.ones((1, 2)))
    with pytest.raises(RefAttnError, match=r"v: expected shape \[Hq,Da\] = \[1, 2\]"):
        Additive(np.ones((1, 2, 3)), np.ones((1, 2, 3)), np.ones((1, 2)), np.ones((2, 1)))
    with pytest.raises(RefAttnError, match=r"v: expected 2 axes, got 1"):
        Additive(np.ones((1, 2, 3)), np.ones((1, 2, 3)), np.ones((1, 2)), np.ones(2))
    with pytest.raises(RefAttnError, match=r"max_workspace_elements: expected a positive"):
        Additive(np.ones((1, 2, 3)), np.ones((1, 2, 3)), np.ones((1, 2)), np.ones((1, 2)),
                 max_workspace_elements=0)
    for eps in (0.0, -1.0, math.inf, True):
        with pytest.raises(RefAttnError, match=r"eps: expected a positive"):
            Cosine(eps=eps)
    with pytest.raises(RefAttnError, match=r"score: expected a ScoreFamily or None, got 'dot'"):
        AttentionCall(*_qkv(), score="dot")


def test_parameters_are_frozen_copies():
    W = np.ones((Dq, Dk))
    fam = Bilinear(W)
    W[0, 0] = 5.0
    assert fam.W[0, 0] == 1.0 and not fam.W.flags.writeable


@pytest.mark.parametrize("name", FAMILIES)
def test_manifest_records_family_scale_and_parameters(name):
    call = _call(name)
    m = call.manifest()
    json.dumps(m, allow_nan=False)
    fam = m["score"]["family"]
    assert fam == name.replace("_shared", "")
    assert m["scale"]["effective_logit_multiplier"]["decimal"] == repr(ALPHA)
    assert m["scale"]["source"] == "explicit" and m["scale"]["applied_times"] == 1
    if name == "bilinear_shared":
        assert m["score"]["sharing"] == "shared" and m["score"]["parameter_count"] == Dq * Dk
    if name == "additive":
        assert m["score"]["parameter_count"] == Hq * Da * (Dq + Dk) + 2 * Hq * Da
        assert m["score"]["pair_tensor"] == "key_blocks"
    if name == "cosine":
        assert m["score"]["zero_norm_policy"] == "clamp_norm_min_eps"


def test_default_call_is_dot_with_canonical_scale():
    m = AttentionCall(*_qkv()).manifest()
    assert m["score"] == {"family": "dot", "parameters": {}}
    assert m["scale"]["width"] == Dq and m["scale"]["source"] == "default_dk_inverse_sqrt"


# -- the contract's claims ---------------------------------------------------------------------

def test_linear_concat_score_cancels_under_softmax():
    # w^T [q; k] = w_q.q_i + w_k.k_j: the query term is constant along each row, so every
    # query row gets the same distribution -- the one of w_k.k_j alone.
    rng = _rng(11)
    x_q, x_k, v = rng.standard_normal((1, 1, 4, 3)), rng.standard_normal((1, 1, 6, 3)), \
        rng.standard_normal((1, 1, 6, 2))
    w_q, w_k = rng.standard_normal(3), rng.standard_normal(3)
    concat = (x_q @ w_q)[..., :, None] + (x_k @ w_k)[..., None, :]  # (1, 1, Q, K)
    key_only = np.broadcast_to((x_k @ w_k)[..., None, :], concat.shape)
    zeros = np.zeros((1, 1, 4, 3))  # the scores come from the bias alone
    p_concat = refattn.forward(AttentionCall(zeros, x_k, v, bias=concat)).probs[0, 0]
    p_key = refattn.forward(AttentionCall(zeros, x_k, v, bias=key_only)).probs[0, 0]
    np.testing.assert_allclose(p_concat, p_key, rtol=1e-13)
    np.testing.assert_allclose(p_concat, np.broadcast_to(p_concat[0], p_concat.shape), rtol=1e-13)
    assert np.ptp(concat[0, 0, :, 0]) > 0.5  # the query term did vary before softmax


def test_additive_tanh_makes_the_ranking_query_dependent():
    # with the nonlinear hidden layer the log-odds between two keys change with the query
    rng = _rng(12)
    fam = Additive(rng.standard_normal((1, 8, 3)), rng.standard_normal((1, 8, 3)),
                   rng.standard_normal((1, 8)), rng.standard_normal((1, 8)))
    q, k, v = rng.standard_normal((1, 1, 16, 3)), rng.standard_normal((1, 1, 2, 3)), \
        rng.standard_normal((1, 1, 2, 2))
    p = refattn.forward(AttentionCall(q, k, v, score=fam, scale=1.0)).probs[0, 0]
    log_odds = np.log(p[:, 0]) - np.log(p[:, 1])
    assert np.std(log_odds) > 0.1  # the linear concat score would give std exactly 0


def _cosine_cap(K):
    return math.e / (math.e + (K - 1) / math.e)


def test_cosine_with_unit_scale_caps_the_largest_probability():
    K128 = 128
    q = np.zeros((1, 1, 1, 4))
    q[..., 0] = 2.0
    k = np.zeros((1, 1, K128, 4))
    k[..., 0] = -3.0
    k[0, 0, 0, 0] = 5.0  # one key parallel (+1), every other antiparallel (-1)
    t = refattn.forward(AttentionCall(q, k, np.ones((1, 1, K128, 1)), score=Cosine(), scale=1.0))
    assert set(np.round(t.scores.ravel(), 12)) == {1.0, -1.0}
    assert abs(t.probs.max() - _cosine_cap(K128)) < 1e-15
    assert abs(t.probs.max() - 0.055) < 5e-4  # the contract: "only about 0.055"


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_no_cosine_row_beats_the_cap(seed):
    rng = _rng(seed)
    q, k = rng.standard_normal((1, 2, 3, 4)), rng.standard_normal((1, 2, 128, 4))
    p = refattn.forward(AttentionCall(q, k, np.ones((1, 2, 128, 1)), score=Cosine(),
                                      scale=1.0)).probs
    assert p.max() <= _cosine_cap(128) * (1 + 1e-14)


def test_bilinear_identity_with_factorised_projections():
    # x_q (W_Q W_K^T) x_k^T == (x_q W_Q)(x_k W_K)^T: a bilinear metric W_a = W_Q W_K^T on raw
    # states is the dot family on projected states
    rng = _rng(13)
    Dm, Dh = 5, 3
    x_q, x_k = rng.standard_normal((B, 1, Q, Dm)), rng.standard_normal((B, 1, K, Dm))
    v = rng.standard_normal((B, 1, K, Dv))
    w_q, w_k = rng.standard_normal((Dm, Dh)), rng.standard_normal((Dm, Dh))
    alpha = Dh ** -0.5
    bil = refattn.forward(AttentionCall(x_q, x_k, v, score=Bilinear(w_q @ w_k.T), scale=alpha))
    dot = refattn.forward(AttentionCall(x_q @ w_q, x_k @ w_k, v, scale=alpha))
    np.testing.assert_allclose(bil.scores, dot.scores, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(bil.output, dot.output, rtol=1e-12, atol=1e-13)
    # and W_a can be absorbed into one side: (q W_a) k^T, with unequal widths Dq != Dk
    W_a = rng.standard_normal((Dm, Dh))
    k = rng.standard_normal((B, 1, K, Dh))
    one = refattn.forward(AttentionCall(x_q, k, v, score=Bilinear(W_a), scale=alpha))
    side = refattn.forward(AttentionCall(x_q @ W_a, k, v, scale=alpha))
    np.testing.assert_allclose(one.output, side.output, rtol=1e-12, atol=1e-13)


# -- additive workspace ------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 3), q=st.integers(1, 9), k=st.integers(1, 9),
       da=st.integers(1, 5), budget=st.integers(1, 200))
def test_additive_block_plan_covers_each_pair_once_within_budget(b, h, q, k, da, budget):
    z = np.zeros
    fam = Additive(z((h, da, 2)), z((h, da, 2)), z((h, da)), z((h, da)),
                   max_workspace_elements=budget)
    seen = np.zeros((q, k), int)
    for qs, ks in fam.block_plan(b, h, q, k):
        size = b * h * (qs.stop - qs.start) * (ks.stop - ks.start) * da
        assert size <= max(budget, b * h * da)  # a single pair column is the floor
        seen[qs, ks] += 1
    assert np.all(seen == 1)


def test_additive_pair_tensor_is_never_materialised():
    rng = _rng(14)
    b, h, q, k, d, da = 1, 2, 64, 256, 4, 32
    full_bytes = b * h * q * k * da * 8  # 8 MiB: the whole [B,H,Q,K,Da] pair tensor
    args = (rng.standard_normal((h, da, d)), rng.standard_normal((h, da, d)),
            rng.standard_normal((h, da)), rng.standard_normal((h, da)))
    small = Additive(*args, max_workspace_elements=4096)
    whole = Additive(*args, max_workspace_elements=b * h * q * k * da)
    qq, kk = rng.standard_normal((b, h, q, d)), rng.standard_normal((b, h, k, d))
    g_u = rng.standard_normal((b, h, q, k))
    peaks = []
    for fam in (small, whole):
        tracemalloc.start()
        u = fam.compatibility(qq, kk)
        sg = fam.compatibility_backward(g_u, qq, kk)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        if fam is small:
            u_small, sg_small = u, sg
    # bounded: a few score-sized arrays plus a few workspace blocks, never pair-sized
    bound = 4 * (b * h * q * k * 8) + 4 * (4096 * 8)
    assert peaks[0] < bound < full_bytes / 4
    assert peaks[1] > full_bytes  # the unbounded plan really does build the pair tensor
    np.testing.assert_allclose(u_small, u, rtol=1e-14, atol=1e-14)
    for a, c in zip((sg_small.grad_q, sg_small.grad_k, *sg_small.params.values()),
                    (sg.grad_q, sg.grad_k, *sg.params.values()), strict=True):
        np.testing.assert_allclose(a, c, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", FAMILIES)
def test_families_are_deterministic(name):
    call = _call(name)
    g_o = np.ones((B, Hq, Q, Dv))
    a, b = refattn.forward(call), refattn.forward(call)
    np.testing.assert_array_equal(a.output, b.output)
    ga, gb = refattn.backward(a, g_o), refattn.backward(b, g_o)
    np.testing.assert_array_equal(ga.grad_q, gb.grad_q)
    for n in call.score.parameters():
        np.testing.assert_array_equal(ga.grad_score_params[n], gb.grad_score_params[n])
