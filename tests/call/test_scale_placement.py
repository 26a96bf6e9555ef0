"""Scale placement: the four placements agree within the declared tolerance and the multiplier
is applied exactly once (the gate that compares placements: tests/analysis/test_scale_gate.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refattn
from refattn import AttentionCall, RefAttnError
from refattn.call.placement import (
    PLACEMENT_ATOL,
    PLACEMENT_RTOL,
    PLACEMENTS,
    operand_multipliers,
)
from refattn.call.scores import Additive, Bilinear, Cosine
from tests.call_vjp import assert_call_gradients
from tests.scale_inputs import ALPHA, B, Dk, Dv, Hq, K, Q, qkv


def _run(placement, seed=0, **kw):
    rng = np.random.default_rng(seed + 100)
    bias = rng.standard_normal((1, Hq, Q, K))
    call = AttentionCall(*qkv(seed), bias=bias, scale_placement=placement, **kw)
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
    assert_call_gradients(AttentionCall(*qkv(3), bias=bias, scale_placement=placement),
                          ["q", "k", "v", "bias"])


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_manifest_asserts_the_multiplier_is_applied_once(placement):
    m = AttentionCall(*qkv(), scale_placement=placement).manifest()["scale"]
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
    with pytest.raises(RefAttnError, match=r"scale_placement: expected one of 'post', 'q', "):
        AttentionCall(*qkv(), scale_placement="pre")
    rng = np.random.default_rng(0)
    add = Additive(rng.standard_normal((Hq, 2, Dk)), rng.standard_normal((Hq, 2, Dk)),
                   np.zeros((Hq, 2)), np.ones((Hq, 2)))
    for fam in (add, Cosine()):
        with pytest.raises(RefAttnError, match=rf"changes the {fam.name} score"):
            AttentionCall(*qkv(), score=fam, scale=1.0, scale_placement="q")
