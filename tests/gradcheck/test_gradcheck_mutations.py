"""The checker bites: each planted backward bug fails, only the inputs it touches fail, and the
report's worst index (or best-fit scale, or structural problem) points at the bug. The
identities and the Taylor test, as second opinions, catch the same bugs."""

from __future__ import annotations

import numpy as np
import pytest

import refattn
from gradcheck import attention_identities, check_attention, taylor_test
from gradcheck import mutations as mut
from gradcheck.attention import attention_problem
from refattn import AttentionCall


def _call(B=2, Hq=6, Hkv=3, Q=3, K=4, Dk=3, Dv=2, seed=0, bias=True):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, Q, Dk))
    k = rng.standard_normal((B, Hkv, K, Dk))
    v = rng.standard_normal((B, Hkv, K, Dv))
    kw = {"bias": rng.standard_normal((1, Hq, 1, K))} if bias else {}
    return AttentionCall(q, k, v, **kw)


SMALL = _call()  # GQA 6 -> 3 heads, bias broadcast over B and Q: full mode, 252 elements
MODERATE = _call(Q=32, K=48, Dk=16, Dv=8, seed=1)  # directional mode

MUTATIONS = {
    "grad_scores_scaled": mut.grad_scores_scaled(),
    "missing_scale": mut.missing_scale(),
    "double_scale": mut.missing_scale(twice=True),
    "gqa_wrong_head": mut.gqa_wrong_head(query_head=5, kv_head=0),
    "one_element": mut.one_element("k", (1, 2, 1, 0)),
    "grad_q_scaled": mut.grad_q_scaled(),
    "bias_unreduced": mut.bias_unreduced(),
    "bias_first_slice": mut.bias_unreduced(keep_shape=True),
}


@pytest.mark.parametrize("mode", ["full", "directional"])
@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_every_mutation_fails_exactly_where_it_was_planted(name, mode):
    m = MUTATIONS[name]
    call = SMALL if mode == "full" else MODERATE
    report = check_attention(call, backward=m.backward, mode=mode)
    assert not report.passed
    assert set(report.failed) == set(m.broken) & set(report.inputs), str(report)
    # the correct backward passes on the same call, so the failure is the planted bug's
    assert check_attention(call, mode=mode).passed


@pytest.mark.parametrize("mode", ["full", "directional"])
def test_score_gradient_off_by_a_tenth_of_a_percent(mode):
    call = SMALL if mode == "full" else MODERATE
    report = check_attention(call, backward=mut.grad_scores_scaled(1.001).backward, mode=mode)
    for name in ("q", "k", "bias"):
        r = report.inputs[name]
        assert r.scale_fit.scale == pytest.approx(1.001, abs=1e-9)
        assert r.scale_fit.residual < 1e-9 and r.worst.ratio > 100
        assert r.worst.rel_error == pytest.approx(0.001 / 1.001, rel=1e-5)
    assert report.inputs["v"].passed


def test_missing_scale_reads_as_the_inverse_scale():
    report = check_attention(SMALL, backward=mut.missing_scale().backward)
    for name in ("q", "k"):
        fit = report.inputs[name].scale_fit
        assert fit.scale == pytest.approx(1.0 / SMALL.scale, rel=1e-12) and fit.residual < 1e-12


def test_scale_applied_twice_reads_as_analytic_0125_x_numeric():
    call = _call(B=1, Hq=1, Hkv=1, Q=2, K=3, Dk=64, Dv=2, bias=False)  # alpha = 1/sqrt(64)
    report = check_attention(call, backward=mut.missing_scale(twice=True).backward)
    assert report.failed == ["q", "k"]
    assert "analytic = 0.125 x numeric" in str(report)


@pytest.mark.parametrize("mode", ["full", "directional"])
def test_gqa_misrouting_points_at_the_two_kv_heads(mode):
    # query head 5 belongs to kv head 2; the bug adds it to kv head 0; kv head 1 is untouched
    call = SMALL if mode == "full" else MODERATE
    report = check_attention(call, backward=mut.gqa_wrong_head(query_head=5, kv_head=0).backward,
                             mode=mode)
    for name in ("k", "v"):
        r = report.inputs[name]
        assert r.worst.index is not None and r.worst.index[1] in (0, 2)
        if mode == "full":
            heads = set(np.argwhere(r.ratio > 1.0)[:, 1].tolist())
            assert heads == {0, 2}
    assert report.inputs["q"].passed


@pytest.mark.parametrize("mode", ["full", "directional"])
def test_one_wrong_element_is_found(mode):
    call = SMALL if mode == "full" else MODERATE
    index = (1, 2, 1, 0)
    report = check_attention(call, backward=mut.one_element("k", index, 1.1).backward, mode=mode)
    r = report.inputs["k"]
    assert report.failed == ["k"] and r.worst.index == index
    assert r.worst.rel_error == pytest.approx(0.1 / 1.1, rel=1e-6)
    if mode == "full":
        assert r.n_over == 1
    else:
        assert r.localized


def test_unreduced_bias_gradient_names_its_broadcast_axes():
    report = check_attention(SMALL, backward=mut.bias_unreduced().backward)
    problem = report.inputs["bias"].problem
    assert report.failed == ["bias"]
    assert "(2, 6, 3, 4)" in problem and "(1, 6, 1, 4)" in problem and "(0, 2)" in problem
    sliced = check_attention(SMALL, backward=mut.bias_unreduced(keep_shape=True).backward)
    assert sliced.failed == ["bias"] and sliced.inputs["bias"].n_over > 0


# -- second opinions --------------------------------------------------------------------------

IDENTITY_FAILURES = {
    "grad_scores_scaled": {"softmax_jacobian"},
    "missing_scale": {"euler_q_k_s"},
    "double_scale": {"euler_q_k_s"},
    "gqa_wrong_head": {"euler_q_k_s", "value_output"},
    "one_element": {"key_sum_grad_k", "euler_q_k_s"},
    "grad_q_scaled": {"euler_q_k_s"},
    "bias_unreduced": {"bias_reduction"},
    "bias_first_slice": {"bias_reduction"},
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_identities_catch_each_mutation(name):
    m = MUTATIONS[name]
    trace = refattn.forward(SMALL)
    g_o = np.random.default_rng(2).standard_normal(trace.output.shape)
    report = attention_identities(trace, m.backward(trace, g_o), backward=m.backward)
    assert set(report.failed) == IDENTITY_FAILURES[name], str(report)


def test_taylor_test_reads_first_order_for_a_wrong_gradient():
    right = attention_problem(SMALL)
    assert taylor_test(right.fn, right.vjp, right.inputs).passed
    wrong = attention_problem(SMALL, backward=mut.grad_scores_scaled().backward)
    report = taylor_test(wrong.fn, wrong.vjp, wrong.inputs)
    assert report.results["q"].verdict == "first_order"
    assert report.results["v"].verdict in ("second_order", "exact")
