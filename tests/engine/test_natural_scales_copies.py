"""The engine tests' natural magnitudes (tests/engine_compare.py) and verify's
(refattn.bundle.golden.guarantee.natural_scales) are one formula on dot calls, entry for entry; on
other score families only the tests' copy answers (why the tests keep it: its docstring)."""

from __future__ import annotations

import numpy as np
import pytest

import refattn
from refattn.bundle.golden.guarantee import natural_scales as verify_scales
from refattn.call.scores import Bilinear
from tests.engine_compare import natural_scales as copied_scales


def _dot_calls():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s) for s in [(2, 4, 3, 5), (2, 2, 6, 5), (2, 2, 6, 3)])
    yield refattn.AttentionCall(q, k, v)
    keep = rng.random((2, 4, 3, 6)) < 0.8
    yield refattn.AttentionCall(  # bias, visibility, unused rows, a dropout multiplier
        q, k, v, bias=rng.standard_normal((1, 4, 3, 6)),
        visible=np.tril(np.ones((3, 6), bool), 3),
        query_valid=np.array([True, False, True])[None, None, :, None],
        all_masked_rows="sanitize_then_zero_invalid_query",
        dropout=np.where(keep, 1.25, 0.0), scale=0.3)


@pytest.mark.parametrize("n", [0, 1])
def test_the_two_copies_agree_on_dot_calls(n):
    call = list(_dot_calls())[n]
    t = refattn.forward(call)
    g = refattn.backward(t, np.random.default_rng(n).standard_normal(t.output.shape))
    ours, verifys = copied_scales(call, t, g), verify_scales(call, t, g)
    assert ours == verifys and len(ours) >= 17


def test_only_the_tests_copy_answers_for_other_families():
    rng = np.random.default_rng(4)
    q, k = rng.standard_normal((1, 1, 2, 3)), rng.standard_normal((1, 1, 4, 3))
    call = refattn.AttentionCall(q, k, k, score=Bilinear(rng.standard_normal((1, 3, 3))),
                                 scale=1.0)
    t = refattn.forward(call)
    g = refattn.backward(t, np.ones(t.output.shape))
    assert verify_scales(call, t, g) == {}
    assert "grad_scores" in copied_scales(call, t, g)
