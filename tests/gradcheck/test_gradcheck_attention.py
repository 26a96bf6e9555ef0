"""refattn.backward verified by gradcheck (full mode, complex step) and by the attention
identities, over the configurations the contract distinguishes; the Loop 6 executable-gate
numbers; directional mode at a moderate size; generated calls."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import refattn
from gradcheck import attention_identities, central_difference, check_attention, check_vjp
from gradcheck.attention import attention_problem
from refattn import AttentionCall
from refattn.bundle.suites.contract import LOOP6_GRAD_OUTPUT, loop6_call
from tests.strategies import attention_calls

CONTRACT_CD_ERROR = 2.84e-10  # "Fixed-mask backward trace": central differences, epsilon 1e-6
CONTRACT_CS_ERROR = 1e-14  # issue 5: complex step on the same fixture


def _qkv(B, Hq, Hkv, Q, K, Dk, Dv, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, Hq, Q, Dk)), rng.standard_normal((B, Hkv, K, Dk)),
            rng.standard_normal((B, Hkv, K, Dv)), rng)


def _config(name: str) -> AttentionCall:
    match name:
        case "plain":
            q, k, v, _ = _qkv(1, 2, 2, 3, 4, 3, 2, 1)
            return AttentionCall(q, k, v)
        case "bias_full":
            q, k, v, rng = _qkv(2, 2, 2, 3, 4, 3, 2, 2)
            return AttentionCall(q, k, v, bias=rng.standard_normal((2, 2, 3, 4)))
        case "bias_broadcast":
            q, k, v, rng = _qkv(2, 2, 2, 3, 4, 3, 2, 3)
            return AttentionCall(q, k, v, bias=rng.standard_normal((1, 2, 1, 4)))
        case "gqa":
            q, k, v, _ = _qkv(1, 4, 2, 3, 4, 3, 2, 4)
            return AttentionCall(q, k, v)
        case "mqa":
            q, k, v, _ = _qkv(1, 3, 1, 3, 4, 3, 2, 5)
            return AttentionCall(q, k, v)
        case "explicit_z":
            q, k, v, rng = _qkv(1, 2, 1, 3, 4, 3, 2, 6)
            z = (rng.random((1, 2, 3, 4)) >= 0.4) / 0.6
            return AttentionCall(q, k, v, dropout=z)
        case "philox_stream":
            from refattn.dropout import Philox

            q, k, v, _ = _qkv(1, 2, 1, 3, 5, 3, 2, 7)
            return AttentionCall(q, k, v, dropout=Philox(0.3, seed=11))
        case "all_dropped_row":
            q, k, v, _ = _qkv(1, 1, 1, 3, 4, 3, 2, 8)
            z = np.full((3, 4), 2.0)
            z[1] = 0.0  # every legal route of query 1 drops
            z[0, 2] = 0.0  # one dropped legal edge
            vis = np.ones((3, 4), bool)
            vis[2, 3] = False  # one masked edge
            return AttentionCall(q, k, v, visible=vis, dropout=z)
        case "masked_causal":
            q, k, v, _ = _qkv(1, 2, 1, 3, 5, 3, 2, 9)
            vis = np.tril(np.ones((3, 5), bool), 5 - 3)  # lower-right causal
            return AttentionCall(q, k, v, visible=vis)
        case "query_valid_policy":
            q, k, v, _ = _qkv(2, 2, 1, 4, 3, 3, 2, 10)
            vis = np.ones((2, 1, 4, 3), bool)
            vis[1, 0, 3] = False  # an empty row ...
            qv = np.ones((2, 1, 4, 1), bool)
            qv[1, 0, 3] = False  # ... that is unused
            qv[0, 0, 1] = False  # and an unused row with keys
            return AttentionCall(q, k, v, visible=vis, query_valid=qv,
                                 all_masked_rows="sanitize_then_zero_invalid_query")
        case "cross_q_ne_k":
            q, k, v, _ = _qkv(1, 2, 2, 2, 6, 3, 3, 11)
            return AttentionCall(q, k, v)
        case "dk_ne_dv":
            q, k, v, _ = _qkv(1, 2, 1, 3, 4, 5, 2, 12)
            return AttentionCall(q, k, v)
        case _:
            raise KeyError(name)


CONFIGS = ["plain", "bias_full", "bias_broadcast", "gqa", "mqa", "explicit_z", "philox_stream",
           "all_dropped_row", "masked_causal", "query_valid_policy", "cross_q_ne_k", "dk_ne_dv"]


@pytest.mark.parametrize("name", CONFIGS)
def test_refattn_backward_passes_gradcheck(name):
    call = _config(name)
    report = check_attention(call, mode="full", seed=1)
    assert report.passed, str(report)
    for r in report.inputs.values():
        assert r.method == "complex_step", r.method_note  # the forward stays complex-safe
        assert r.n_checked == int(np.prod(r.shape))
    assert set(report.inputs) == {"q", "k", "v"} | ({"bias"} if call.bias is not None else set())


@pytest.mark.parametrize("name", CONFIGS)
def test_refattn_backward_satisfies_the_identities(name):
    call = _config(name)
    trace = refattn.forward(call)
    g_o = np.random.default_rng(3).standard_normal(trace.output.shape)
    report = attention_identities(trace, refattn.backward(trace, g_o))
    assert report.passed, str(report)
    assert all(c.applicable for c in report.checks)


def test_identities_see_the_special_rows():
    trace = refattn.forward(_config("all_dropped_row"))
    g_o = np.random.default_rng(0).standard_normal(trace.output.shape)
    check = attention_identities(trace, refattn.backward(trace, g_o))["masked_and_unused_zero"]
    assert "1 masked entries" in check.detail and "1 all-dropped rows" in check.detail
    trace = refattn.forward(_config("query_valid_policy"))
    g_o = np.ones(trace.output.shape)
    check = attention_identities(trace, refattn.backward(trace, g_o))["masked_and_unused_zero"]
    assert "4 unused rows" in check.detail  # 2 rows x 2 heads


def test_the_stream_is_replayed_once():
    call = _config("philox_stream")
    problem = attention_problem(call)
    z = call.dropout.multiplier(*call.score_shape)
    assert (z == 0).any()
    np.testing.assert_array_equal(problem.fn(**problem.inputs), refattn.forward(call).output)


@pytest.mark.parametrize("extra", ["sink", "softcap", "bilinear"])
def test_adapter_follows_the_newer_call_options(extra):
    q, k, v, rng = _qkv(1, 2, 1, 3, 4, 3, 2, 13)
    match extra:
        case "sink":
            call = AttentionCall(q, k, v, sink=rng.standard_normal(2))
        case "softcap":
            call = AttentionCall(q, k, v, softcap=1.5)
        case "bilinear":
            from refattn.call.scores import Bilinear

            call = AttentionCall(q, k, v, score=Bilinear(rng.standard_normal((2, 3, 3))),
                                 scale=0.5)
    report = check_attention(call, mode="full")
    assert report.passed, str(report)
    assert all(r.method == "complex_step" for r in report.inputs.values())
    expected = {"sink": {"sink"}, "softcap": set(), "bilinear": {"score_W"}}[extra]
    assert set(report.inputs) == {"q", "k", "v"} | expected
    trace = refattn.forward(call)
    ids = attention_identities(trace, refattn.backward(trace, np.ones(trace.output.shape)))
    assert ids.passed, str(ids)


# -- the Loop 6 executable gate ---------------------------------------------------------------


def _loop6_max_error(report):
    return max(float(np.abs(r.analytic - r.numeric).max()) for r in report.inputs.values())


def test_loop6_plain_central_difference_matches_the_contract():
    call = loop6_call()
    grads = refattn.backward(refattn.forward(call), LOOP6_GRAD_OUTPUT)
    problem = attention_problem(call)
    worst = 0.0
    for name, x in problem.inputs.items():
        def loss(a, name=name):  # correctly rounded, as the contract's oracle sums
            out = problem.fn(**{**problem.inputs, name: a})
            return math.fsum((LOOP6_GRAD_OUTPUT * out).ravel())

        numeric = central_difference(loss, x, eps=1e-6)
        worst = max(worst, float(np.abs(numeric - getattr(grads, f"grad_{name}")).max()))
    assert worst <= CONTRACT_CD_ERROR


@pytest.mark.parametrize("kw", [{"step": 1e-6, "levels": 1}, {"step": 1e-6}, {}],
                         ids=["plain_1e-6", "richardson_1e-6", "richardson_default"])
def test_loop6_central_differences_within_the_contract(kw):
    report = check_attention(loop6_call(), grad_output=LOOP6_GRAD_OUTPUT, mode="full",
                             method="central", **kw)
    assert report.passed, str(report)
    assert _loop6_max_error(report) <= CONTRACT_CD_ERROR


def test_loop6_complex_step_within_1e14():
    report = check_attention(loop6_call(), grad_output=LOOP6_GRAD_OUTPUT, mode="full")
    assert report.passed
    assert {r.method for r in report.inputs.values()} == {"complex_step"}
    assert _loop6_max_error(report) <= CONTRACT_CS_ERROR
    # the dropped legal edge (0, 1) still moves the score gradient; the masked one does not
    trace = refattn.forward(loop6_call())
    ids = attention_identities(trace, refattn.backward(trace, LOOP6_GRAD_OUTPUT))
    assert ids.passed, str(ids)


# -- directional mode at a moderate size ------------------------------------------------------


@pytest.mark.parametrize("method", ["auto", "central"])
def test_directional_mode_moderate_shape(method):
    q, k, v, rng = _qkv(2, 4, 2, 24, 40, 16, 8, 14)
    vis = np.tril(np.ones((24, 40), bool), 40 - 24)
    call = AttentionCall(q, k, v, visible=vis, bias=rng.standard_normal((1, 4, 1, 40)))
    report = check_attention(call, mode="directional", method=method, directions=2)
    assert report.passed, str(report)
    assert all(r.n_checked == 2 for r in report.inputs.values())
    assert report.inputs["k"].null_ratio < 1.0 and report.inputs["bias"].null_ratio < 1.0


# -- generated calls --------------------------------------------------------------------------


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=attention_calls())
def test_generated_calls_pass_gradcheck(call):
    report = check_attention(call, mode="full", seed=0)
    assert report.passed, str(report)
    trace = refattn.forward(call)
    ids = attention_identities(trace, refattn.backward(trace, np.ones(trace.output.shape)))
    assert ids.passed, str(ids)


def test_saturated_softmax_below_the_rounding_floor_is_not_called_wrong():
    # shrunk by hypothesis: a 55-nat score gap puts the exact q/k gradients near 1e-24, far
    # below the rounding of G_S = P (G_P - D) (terms of size 1); no float64 backward
    # resolves them, so only the term-magnitude bound (rounding_scales) judges them fairly
    call = AttentionCall(np.array([[[[6.12275736]]]]),
                         np.array([[[[-7.66699509], [1.25429654]]]]),
                         np.array([[[[-0.56776961], [-0.45264929]]]]))
    report = check_attention(call, mode="full")
    assert report.passed, str(report)
    assert abs(report.inputs["q"].numeric).max() < 1e-20
    problem = attention_problem(call)
    blind = check_vjp(problem.fn, problem.vjp, problem.inputs, mode="full")
    assert "q" in blind.failed  # without the term magnitudes the tiny gradient looks wrong
