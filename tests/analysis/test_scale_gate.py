"""The contract's scale-placement validation gate catches the shape-preserving failures: double
scaling, alpha on each side, d_model for d_k, a denominator read as a multiplier."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import refattn
from refattn import AttentionCall, RefAttnError
from refattn.analysis.scale_gate import scale_gate
from refattn.call.placement import PLACEMENT_ATOL, PLACEMENTS
from refattn.call.scores import Cosine
from tests.scale_inputs import ALPHA, D_MODEL, B, Dk, Dv, Hkv, Hq, Q, qkv


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_gate_accepts_every_correct_placement(placement):
    q, k, v = qkv()
    fused = refattn.forward(AttentionCall(q, k, v, scale_placement=placement))
    report = scale_gate(AttentionCall(q, k, v), fused.output, configured_alpha=ALPHA,
                        candidate_manifest=fused.manifest())
    assert "scale_width_equals_dk" in report.checks and report.max_abs_error < PLACEMENT_ATOL


def test_gate_catches_double_scaling():
    # q already carries alpha, then the API default applies alpha again: alpha**2 in effect
    q, k, v = qkv()
    double = refattn.forward(AttentionCall(q * ALPHA, k, v)).output
    with pytest.raises(RefAttnError, match=r"candidate output differs from the eager reference"):
        scale_gate(AttentionCall(q, k, v), double, configured_alpha=ALPHA)
    # the correct pre-scaled form keeps the model: scale=1.0 after pre-scaling q
    right = refattn.forward(AttentionCall(q * ALPHA, k, v, scale=1.0)).output
    scale_gate(AttentionCall(q, k, v), right, configured_alpha=ALPHA)


def test_gate_catches_alpha_on_each_side_instead_of_sqrt_alpha():
    q, k, v = qkv()
    wrong = refattn.forward(AttentionCall(q * ALPHA, k * ALPHA, v, scale=1.0)).output
    with pytest.raises(RefAttnError, match=r"candidate output differs"):
        scale_gate(AttentionCall(q, k, v), wrong, configured_alpha=ALPHA)


def test_gate_catches_d_model_instead_of_d_k():
    q, k, v = qkv()
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
    q, k, v = qkv()
    inverted = AttentionCall(q, k, v, scale=math.sqrt(Dk))  # "divide by sqrt(d_k)" misread
    root = re.escape(repr(math.sqrt(Dk)))
    with pytest.raises(RefAttnError, match=rf"effective logit multiplier {root} != configured"):
        scale_gate(inverted, refattn.forward(inverted).output, configured_alpha=ALPHA)
    with pytest.raises(RefAttnError, match=r"candidate output differs"):
        scale_gate(AttentionCall(q, k, v), refattn.forward(inverted).output,
                   configured_alpha=ALPHA)


def test_gate_width_override_for_checkpoint_scales():
    q, k, v = qkv()
    call = AttentionCall(q, k, v, scale=0.3)  # a checkpoint's own multiplier
    report = scale_gate(call, refattn.forward(call).output, configured_alpha=0.3,
                        width_override=True)
    assert "scale_width_equals_dk" not in report.checks
    with pytest.raises(RefAttnError, match=r"scale width is None"):
        scale_gate(call, refattn.forward(call).output, configured_alpha=0.3)


def test_gate_rejects_non_dot_families_and_malformed_candidates():
    q, k, v = qkv()
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
    q, k, v = (rng for rng in qkv())
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
