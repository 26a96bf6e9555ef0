"""diagnose_merge: each planted merge bug diagnosed as itself, the honest merge as correct.
The buggy merges are written here as plain loops, independently of the module."""

from __future__ import annotations

import math

import numpy as np
import pytest

from refattn.errors import RefAttnError
from refattn.states import diagnose_merge, merge_states

rng = np.random.default_rng(3)


def loop_merge(v, s, exp, log, normalise=True):
    """A FlashAttention-style combine as a loop: v (S, R, D), s (S, R)."""
    S, R, D = v.shape
    out, lse = np.zeros((R, D)), np.zeros(R)
    for r in range(R):
        m = max(s[:, r])
        e = [exp(s[i, r] - m) for i in range(S)]
        total = sum(e)
        for i in range(S):
            out[r] += (e[i] / total if normalise else e[i]) * v[i, r]
        lse[r] = m + log(total)
    return out, lse


def case(S=3):
    v = rng.standard_normal((S, 1, 2, 4, 3))  # refattn layout, stacked
    s = 2.0 * rng.standard_normal((S, 1, 2, 4))
    return v, s


def flat(v, s):
    return v.reshape(v.shape[0], -1, v.shape[-1]), s.reshape(s.shape[0], -1)


def shaped(out, lse, s):
    return out.reshape(*s.shape[1:], -1), lse.reshape(s.shape[1:])


exp2, log2 = (lambda x: 2.0**x), math.log2


@pytest.mark.parametrize("base", ["e", 2])
def test_planted_bugs_diagnosed_as_themselves(base):
    v, s = case()
    exp, log = (math.exp, math.log) if base == "e" else (exp2, log2)
    other = (exp2, log2) if base == "e" else (math.exp, math.log)
    fv, fs = flat(v, s)
    planted = {
        "correct": loop_merge(fv, fs, exp, log),
        "wrong_base": loop_merge(fv, fs, *other),
        "not_renormalised": (loop_merge(fv, fs, exp, log, normalise=False)[0],
                             loop_merge(fv, fs, exp, log)[1]),
        "swapped_lse": loop_merge(fv, fs[::-1], exp, log),
    }
    for name, (out, lse) in planted.items():
        d = diagnose_merge(v, s, *shaped(out, lse, s), base=base)
        assert d.verdict == name, (name, d)
        assert d.fits == (name,), (name, d)


def test_unexplained_and_float32_tolerance():
    v, s = case()
    out, lse = merge_states(v, s)
    d = diagnose_merge(v, s, out + 1e-3, lse)
    assert d.verdict == "unexplained" and d.residuals["correct"] > 1e-4
    noisy = out * (1 + 1e-7 * rng.standard_normal(out.shape))  # a float32 kernel's rounding
    assert diagnose_merge(v, s, noisy, lse).verdict == "unexplained"
    assert diagnose_merge(v, s, noisy, lse, rtol=1e-5).verdict == "correct"


def test_layouts_and_refusals():
    v, s = case(S=2)
    fa_v = v.transpose(0, 1, 3, 2, 4)  # (S, B, L, H, D)
    out, lse = merge_states(fa_v, s, layout="flash_attn", base=2)
    assert diagnose_merge(fa_v, s, out, lse, layout="flash_attn", base=2).verdict == "correct"
    with pytest.raises(RefAttnError, match="lse"):
        diagnose_merge(v, s, merge_states(v, s)[0], np.full((1, 2, 4), np.inf))
    with pytest.raises(RefAttnError, match="rtol"):
        diagnose_merge(v, s, *merge_states(v, s), rtol=2.0)
