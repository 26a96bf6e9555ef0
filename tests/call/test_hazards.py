"""Numerical hazards are named before any arithmetic (issue 16, item 4 and item 7): inputs
whose scores, output or gradients could overflow float64, and a bare-number dropout."""

from __future__ import annotations

import numpy as np
import pytest

import refattn
from refattn import RefAttnError
from refattn.call.hazards import LIMIT, score_bound
from refattn.call.scores import Bilinear, Cosine
from refattn.dropout import Philox


def _ones(*shape):
    return np.ones(shape)


def test_inputs_of_magnitude_1e200_are_refused_instead_of_producing_nan():
    """Before: the gate passed them and every backend returned NaN outputs silently."""
    q = np.full((1, 1, 2, 4), 1e200)
    with np.errstate(all="ignore"):  # what the reference would have computed
        scores = q[0, 0] @ q[0, 0].T
    assert np.isinf(scores).all()
    with pytest.raises(RefAttnError, match=r"q, k: the scores could overflow float64 .* = inf"):
        refattn.AttentionCall(q, q, _ones(1, 1, 2, 4))


def test_the_bound_is_the_dot_products_worst_case_and_passes_just_below_the_limit():
    Dk = 4
    m = float(np.sqrt(LIMIT / Dk)) * 0.999  # alpha = 1/2 <= 1: the bound is Dk * m * m
    q = np.full((1, 1, 2, Dk), m)
    call = refattn.AttentionCall(q, q, _ones(1, 1, 2, 4))
    assert score_bound(call)[0] == pytest.approx(Dk * m * m)
    with pytest.raises(RefAttnError, match="scores could overflow"):
        refattn.AttentionCall(q * 1.01, q * 1.01, _ones(1, 1, 2, 4))


def test_bias_and_sink_count_toward_the_bound():
    x = _ones(1, 1, 2, 4)
    with pytest.raises(RefAttnError, match=r"max\|bias\|"):
        refattn.AttentionCall(x, x, x, bias=np.full((1, 1, 2, 2), 1e308))
    with pytest.raises(RefAttnError, match=r"max\|sink\|"):
        refattn.AttentionCall(x, x, x, sink=np.array([1e308]))


def test_other_families_have_their_own_bounds():
    x = np.full((1, 1, 2, 4), 1e100)
    refattn.AttentionCall(x, x, x * 0 + 1, score=Cosine(), scale=1.0)  # |cos| <= 1: fine
    with pytest.raises(RefAttnError, match=r"max\|W\|"):
        refattn.AttentionCall(x, x, _ones(1, 1, 2, 4), score=Bilinear(np.full((4, 4), 1e150)),
                              scale=1.0)


def test_an_overflowing_value_side_or_gradient_is_refused():
    x = _ones(1, 1, 2, 4)
    with pytest.raises(RefAttnError, match=r"v: the output could overflow"):
        refattn.AttentionCall(x, x, x * 1e300, dropout=np.full((1, 1, 2, 2), 1e10))
    call = refattn.AttentionCall(x, x, x)
    trace = refattn.forward(call)
    with pytest.raises(RefAttnError, match=r"grad_output: the gradient grad_probs could"):
        refattn.backward(trace, np.full((1, 1, 2, 4), 1e308))
    with pytest.raises(RefAttnError, match=r"grad_output: the gradient grad_q could"):
        refattn.value_and_grad(call, np.full((1, 1, 2, 4), 1e307))


@pytest.mark.parametrize("p", [0.1, np.float64(0.1), np.array(0.1), 1])
def test_a_bare_number_as_dropout_is_refused_with_both_spellings(p):
    """Before: dropout=0.1 was read as Z = 0.1 and multiplied every probability by 0.1."""
    x = _ones(1, 1, 2, 4)
    with pytest.raises(RefAttnError) as info:
        refattn.AttentionCall(x, x, x, dropout=p)
    msg = str(info.value)
    assert "not a probability" in msg
    assert "dropout=refattn.dropout.Philox(" in msg and "1 / (1 - " in msg


def test_the_spellings_the_message_suggests_work():
    x = np.random.default_rng(0).standard_normal((1, 1, 3, 4))
    a = refattn.AttentionCall(x, x, x, dropout=Philox(0.1, seed=7))
    z = a.multiplier_full()
    b = refattn.AttentionCall(x, x, x, dropout=z)
    assert set(np.unique(z)) <= {0.0, 1 / 0.9}
    np.testing.assert_array_equal(refattn.forward(a).output, refattn.forward(b).output)
