"""Scale placement: the four placements agree within the declared tolerance, the multiplier is
applied exactly once, and the contract's gate catches the shape-preserving failures."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refattn
from refattn import AttentionCall, RefAttnError
from refattn.scale_placement import (
    PLACEMENT_ATOL,
    PLACEMENT_RTOL,
    PLACEMENTS,
    operand_multipliers,
    scale_gate,
)
from refattn.scores import Additive, Bilinear, Cosine
from tests.call_vjp import assert_call_gradients

B, Hq, Hkv, Q, K, Dk, Dv = 2, 4, 2, 5, 7, 12, 3
D_MODEL = 48  # the model width a buggy caller might use instead of Dk
ALPHA = Dk ** -0.5  # not a power of two: moving it changes rounding (Dk=16 would not)


def _qkv(seed=0, dk=Dk):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, Hq, Q, dk)), rng.standard_normal((B, Hkv, K, dk)),
            rng.standard_normal((B, Hkv, K, Dv)))


def _run(placement, seed=0, **kw):
    rng = np.random.default_rng(seed + 100)
    bias = rng.standard_normal((1, Hq, Q, K))
    call = AttentionCall(*_qkv(seed), bias=bias, scale_placement=placement, **kw)
    t = refattn.forward(call)
    return t, refattn.backward(t, rng.standard_normal((B, Hq, Q, Dv)))


def _assert_within_declared(a, b, what):
    np.testing.assert_allclose(a, b, rtol=PLACEMENT_RTOL, atol=PLACEMENT_ATOL, err_msg=what)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), placement=st.sampled_from(PLACEMENTS[1:]))
def test_placements_agree_within_the_declared_tolerance(seed, placement):
    t0, g0 = _run("post", seed)
    t1, g1 = _run(placement, seed)
    for name in ("probs", "output", "lse"):
        _assert_within_declared(getattr(t1, name), getattr(t0, name), name)
    for name in ("grad_q", "grad_k", "grad_v", "grad_bias", "grad_scores"):
        _assert_within_declared(getattr(g1, name), getattr(g0, name), name)


@pytest.mark.parametrize("placement", PLACEMENTS[1:])
def test_placements_agree_for_the_bilinear_family(placement):
    W = np.random.default_rng(7).standard_normal((Hq, Dk, Dk))
    t0, g0 = _run("post", score=Bilinear(W), scale=ALPHA)
    t1, g1 = _run(placement, score=Bilinear(W), scale=ALPHA)
    _assert_within_declared(t1.output, t0.output, "output")
    _assert_within_declared(g1.grad_q, g0.grad_q, "grad_q")
    _assert_within_declared(g1.grad_score_params["W"], g0.grad_score_params["W"], "grad_W")


def test_placements_are_not_bitwise_equal_in_finite_precision():
    # the contract: pre-scaling rounds the operands, post-scaling rounds the accumulator
    post = _run("post")[0].scores
    differs = [p for p in PLACEMENTS[1:] if not np.array_equal(_run(p)[0].scores, post)]
    assert differs
    worst = max(np.abs(_run(p)[0].scores - post).max() for p in PLACEMENTS[1:])
    assert 0 < worst < PLACEMENT_ATOL  # measured well inside the declared tolerance


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_placement_backward_passes_gradcheck(placement):
    bias = np.random.default_rng(5).standard_normal((Q, K))
    assert_call_gradients(AttentionCall(*_qkv(3), bias=bias, scale_placement=placement),
                          ["q", "k", "v", "bias"])


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_manifest_asserts_the_multiplier_is_applied_once(placement):
    m = AttentionCall(*_qkv(), scale_placement=placement).manifest()["scale"]
    assert m["applied_times"] == 1
    assert m["semantics"] == "multiplicative_inverse_temperature"
    assert float(m["effective_logit_multiplier"]["decimal"]) == ALPHA
    assert m["width"] == Dk and m["requested_placement"] == placement
    ops = {n: float(r["decimal"]) for n, r in m["operand_multipliers"].items()}
    assert math.isclose(ops["query"] * ops["key"] * ops["post"], ALPHA, rel_tol=2**-52)
    if placement == "split":  # sqrt(alpha) = Dk**-0.25 on EACH side, not alpha on each side
        assert ops["query"] == ops["key"] == math.sqrt(ALPHA)
        assert math.isclose(ops["query"], Dk ** -0.25, rel_tol=2**-52)


def test_operand_multipliers_put_alpha_in_exactly_one_place():
    for p in PLACEMENTS:
        m = operand_multipliers(ALPHA, p)
        moved = [x for x in m if x != 1.0]
        assert len(moved) == (2 if p == "split" else 1)


def test_placement_gate_rejections():
    with pytest.raises(RefAttnError, match=r"scale_placement: expected one of \['post', 'q', "):
        AttentionCall(*_qkv(), scale_placement="pre")
    rng = np.random.default_rng(0)
    add = Additive(rng.standard_normal((Hq, 2, Dk)), rng.standard_normal((Hq, 2, Dk)),
                   np.zeros((Hq, 2)), np.ones((Hq, 2)))
    for fam in (add, Cosine()):
        with pytest.raises(RefAttnError, match=rf"changes the {fam.name} score"):
            AttentionCall(*_qkv(), score=fam, scale=1.0, scale_placement="q")


# -- the contract's validation gate --------------------------------------------------------------

@pytest.mark.parametrize("placement", PLACEMENTS)
def test_gate_accepts_every_correct_placement(placement):
    q, k, v = _qkv()
    fused = refattn.forward(AttentionCall(q, k, v, scale_placement=placement))
    report = scale_gate(AttentionCall(q, k, v), fused.output, configured_alpha=ALPHA,
                        candidate_manifest=fused.manifest())
    assert "scale_width_equals_dk" in report.checks and report.max_abs_error < PLACEMENT_ATOL


def test_gate_catches_double_scaling():
    # q already carries alpha, then the API default applies alpha again: alpha**2 in effect
    q, k, v = _qkv()
    double = refattn.forward(AttentionCall(q * ALPHA, k, v)).output
    with pytest.raises(RefAttnError, match=r"candidate output differs from the eager reference"):
        scale_gate(AttentionCall(q, k, v), double, configured_alpha=ALPHA)
    # the correct pre-scaled form keeps the model: scale=1.0 after pre-scaling q
    right = refattn.forward(AttentionCall(q * ALPHA, k, v, scale=1.0)).output
    scale_gate(AttentionCall(q, k, v), right, configured_alpha=ALPHA)


def test_gate_catches_alpha_on_each_side_instead_of_sqrt_alpha():
    q, k, v = _qkv()
    wrong = refattn.forward(AttentionCall(q * ALPHA, k * ALPHA, v, scale=1.0)).output
    with pytest.raises(RefAttnError, match=r"candidate output differs"):
        scale_gate(AttentionCall(q, k, v), wrong, configured_alpha=ALPHA)


def test_gate_catches_d_model_instead_of_d_k():
    q, k, v = _qkv()
    bad = AttentionCall(q, k, v, scale=D_MODEL ** -0.5)
    out = refattn.forward(bad).output
    # the call's own manifest disagrees with the configured multiplier
    wrong = re.escape(repr(D_MODEL ** -0.5))
    with pytest.raises(RefAttnError, match=rf"effective logit multiplier {wrong} != configured"):
        scale_gate(bad, out, configured_alpha=ALPHA)
    # configured consistently wrong: the width check still sees d_model, not Dk
    with pytest.raises(RefAttnError, match=r"scale width is None .* expected the query width 12"):
        scale_gate(bad, out, configured_alpha=D_MODEL ** -0.5)
    # and as a fused candidate against the right eager call, the outputs differ
    with pytest.raises(RefAttnError, match=rf"candidate: effective logit multiplier {wrong}"):
        scale_gate(AttentionCall(q, k, v), out, configured_alpha=ALPHA,
                   candidate_manifest=bad.manifest())


def test_gate_catches_a_denominator_read_as_a_multiplier():
    q, k, v = _qkv()
    inverted = AttentionCall(q, k, v, scale=math.sqrt(Dk))  # "divide by sqrt(d_k)" misread
    root = re.escape(repr(math.sqrt(Dk)))
    with pytest.raises(RefAttnError, match=rf"effective logit multiplier {root} != configured"):
        scale_gate(inverted, refattn.forward(inverted).output, configured_alpha=ALPHA)
    with pytest.raises(RefAttnError, match=r"candidate output differs"):
        scale_gate(AttentionCall(q, k, v), refattn.forward(inverted).output,
                   configured_alpha=ALPHA)


def test_gate_width_override_for_checkpoint_scales():
    q, k, v = _qkv()
    call = AttentionCall(q, k, v, scale=0.3)  # a checkpoint's own multiplier
    report = scale_gate(call, refattn.forward(call).output, configured_alpha=0.3,
                        width_override=True)
    assert "scale_width_equals_dk" not in report.checks
    with pytest.raises(RefAttnError, match=r"scale width is None"):
        scale_gate(call, refattn.forward(call).output, configured_alpha=0.3)


def test_gate_rejects_non_dot_families_and_malformed_candidates():
    q, k, v = _qkv()
    call = AttentionCall(q, k, v, score=Cosine(), scale=ALPHA)
    with pytest.raises(RefAttnError, match=r"compatibility family is 'cosine'"):
        scale_gate(call, refattn.forward(call).output, configured_alpha=ALPHA)
    good = AttentionCall(q, k, v)
    with pytest.raises(RefAttnError, match=r"candidate_output: expected float64"):
        scale_gate(good, np.zeros((B, Hq, Q, Dv), np.float32), configured_alpha=ALPHA)
    nan = refattn.forward(good).output.copy()
    nan[0, 0, 0, 0] = np.nan
    with pytest.raises(RefAttnError, match=r"differs .* at \(0, 0, 0, 0\)"):
        scale_gate(good, nan, configured_alpha=ALPHA)


@pytest.mark.torch
def test_gate_against_torch_sdpa():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    q, k, v = (rng for rng in _qkv())
    k_eff, v_eff = np.repeat(k, Hq // Hkv, axis=1), np.repeat(v, Hq // Hkv, axis=1)
    tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(x)) for x in (q, k_eff, v_eff))
    call = AttentionCall(q, k, v)
    explicit = F.scaled_dot_product_attention(tq, tk, tv, scale=ALPHA).numpy()
    scale_gate(call, explicit, configured_alpha=ALPHA)
    prescaled = F.scaled_dot_product_attention(tq * ALPHA, tk, tv, scale=1.0).numpy()
    scale_gate(call, prescaled, configured_alpha=ALPHA)
    double = F.scaled_dot_product_attention(tq * ALPHA, tk, tv).numpy()  # scale=None again
    with pytest.raises(RefAttnError, match=r"candidate output differs"):
        scale_gate(call, double, configured_alpha=ALPHA)
