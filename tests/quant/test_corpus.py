"""Issue 41, item 5: the corpus of honest and buggy kernel simulations against the emulator.

Honest simulations (FA3: five summation orders of both products; SageAttention: with and
without K smoothing, both scale orders) must pass ``check_candidate`` against their preset; each
planted bug must fail on at least 95% of the calls where it changes the output by more than the
honest kernels' own error (``corpus.evaluate``; the rate is not asserted below
``MIN_AFFECTED`` such calls). Small shapes: FA3 with Q <= 32 and K <= 384 at FA3's own kBlockN
(160 at D = 64, 224 at D = 128: about half the calls have two kv tiles, so the online softmax
and the dropped last tile are exercised; K goes past the issue's 256 for that, Q stays short
to keep the cost down), SageAttention with Q, K <= 192 (two Q blocks of 128, up to three
64-key tiles). ``benchmarks/quant_corpus.py`` runs the issue's shapes (Q, K <= 256).

EXPENSIVE: the two module fixtures (``fa3_verdicts``, ``sage_verdicts``) emulate every call
and check every variant (about 15 s each on 2 cores); only the tests named ``test_corpus_*``
take them. The rest of the file is cheap (the generator and the bookkeeping, no emulator).
The ``test_corpus_*`` tests judge the emulator, not the simulations: with the any-order
intervals of commit 8c5024f four FA3 bugs failed them (v_descale 8 of 30, the dropped tile
37 of 40, e5m2 1 of 34, l after the cast 0 of 7).
"""

from __future__ import annotations

import numpy as np
import pytest

from . import corpus, sims

FA3_CALLS, FA3_MAX_Q, FA3_MAX_LEN = 40, 32, 384
SAGE_CALLS, SAGE_MAX_LEN = 16, 192
MIN_AFFECTED, RATE = 5, 0.95
#: l summed after the cast is not among issue 41's targets: its change, the common factor
#: sum p / sum P of P's average rounding, is near the interval's own width at amplitude 4
#: (measured: 5 of 7 affected CI calls, 5 of 5 at the issue's shapes); asserted at this rate
RATES = {"l_after_rounding": 0.6}


# -- cheap: the generator and the bookkeeping ----------------------------------------------
def test_the_corpus_is_deterministic_from_the_seed():
    a, b = corpus.fa3_calls(4, seed=7, max_len=40), corpus.fa3_calls(4, seed=7, max_len=40)
    for x, y in zip(a, b, strict=True):
        assert x.info == y.info
        np.testing.assert_array_equal(x.call.q, y.call.q)
        np.testing.assert_array_equal(x.preset_kwargs["v_descale"], y.preset_kwargs["v_descale"])
        np.testing.assert_array_equal(x.honest["random"]().output, y.honest["random"]().output)
    c = corpus.fa3_calls(4, seed=8, max_len=40)
    assert not all(np.array_equal(x.call.q, z.call.q) for x, z in zip(a, c, strict=True))
    s1, s2 = corpus.sage_calls(2, seed=3, max_len=40), corpus.sage_calls(2, seed=3, max_len=40)
    np.testing.assert_array_equal(s1[1].call.k, s2[1].call.k)


def test_fa3_calls_follow_the_issue():
    calls = corpus.fa3_calls(60, seed=1, max_len=64)
    for cc in calls:
        i = cc.info
        B, Hq, Hkv, Q, K, D = (i[x] for x in ("B", "Hq", "Hkv", "Q", "K", "D"))
        assert cc.call.q.shape == (B, Hq, Q, D) and cc.call.k.shape == (B, Hkv, K, D)
        assert B in (1, 2) and Hq in (2, 4, 8) and Hq % Hkv == 0 and D in (64, 128)
        assert 1 <= Q <= 64 and 1 <= K <= 64 and (Q <= K or not i["causal"])
        assert 1 <= i["amplitude"] <= 4
        assert np.array_equal(sims.cast(cc.call.q, "e4m3fn", saturate=True), cc.call.q)
        for name in ("q_descale", "k_descale", "v_descale"):
            d = cc.preset_kwargs[name]
            assert d.shape == (B, Hkv) and (d >= 0.25).all() and (d <= 4).all()
            assert np.array_equal(d.astype(np.float32), d)
        assert cc.preset_kwargs["kv_tile"] == corpus.fa3_kblock_n(D) == {64: 160, 128: 224}[D]
        assert (cc.call.visible is not None) == i["causal"]
        assert cc.call.scale == D ** -0.5
    assert 0.5 < np.mean([cc.info["causal"] for cc in calls]) < 0.8
    assert any(cc.info["Hkv"] == 1 for cc in calls) and any(cc.info["unit_descales"]
                                                            for cc in calls)
    fixed = corpus.fa3_calls(3, seed=1, max_len=16, amplitude=1.0, block_n=8)
    assert all(cc.info["amplitude"] == 1.0 and cc.preset_kwargs["kv_tile"] == 8 for cc in fixed)
    assert fixed[0].honest.keys() == set(sims.ACCUMULATORS)
    assert fixed[0].bugs.keys() == set(corpus.FA3_CORPUS_BUGS)


def test_sage_calls_follow_the_kernel():
    for cc in corpus.sage_calls(20, seed=2, max_len=48):
        i = cc.info
        assert cc.call.q.shape[-1] in (64, 128) and (i["Q"] == i["K"] or not i["causal"])
        assert np.array_equal(sims.cast(cc.call.v, "fp16", saturate=False), cc.call.v)
        assert cc.target("plain_sequential").changes == {"k_smoothing": False}
        assert cc.target("smooth_sequential").changes == {} == cc.target().changes


def test_max_abs_diff_counts_nan_and_inf():
    d = corpus.max_abs_diff
    assert d(np.array([1.0, np.nan]), np.array([1.5, np.nan])) == 0.5
    assert d(np.array([1.0, np.nan]), np.array([1.0, 2.0])) == np.inf
    assert d(np.array([np.inf]), np.array([np.inf])) == 0 and d(np.array([np.inf]),
                                                                np.array([1.0])) == np.inf


def test_evaluate_and_summarize_with_a_fake_check():
    """A check that fails every output whose largest value is above 4: the bookkeeping of
    affected, caught and false alarms, without the emulator."""
    calls = corpus.fa3_calls(3, seed=4, max_len=24, block_n=8)
    seen = []

    def check(call, target, candidate):
        seen.append((target.preset, sorted(candidate)))
        return bool(np.nanmax(np.abs(candidate["output"])) <= 4), {"median": 1.0, "max": 2.0}
    vs = corpus.evaluate(calls, check, bugs=["no_v_descale", "drop_last_tile"])
    assert seen[0] == ("fa3_fp8", ["lse", "output"])
    assert len(seen) == 3 * (5 + 2)
    s = corpus.summarize(vs)
    assert set(s["bugs"]) == {"no_v_descale", "drop_last_tile"}
    for v in vs:
        assert v.honest_diff["sequential"] == 0 and v.honest_error == max(v.honest_diff.values())
        for b in v.bugs:
            assert v.affected[b] == (v.bug_diff[b] > v.honest_error)
    row = s["bugs"]["drop_last_tile"]
    assert row["calls"] == 3 and row["affected"] == sum(v.affected["drop_last_tile"] for v in vs)
    assert s["radius_median"] == 1.0 and s["radius_max"] == 2.0


# -- EXPENSIVE: the corpus against refattn.quant (may fail while the emulator is too loose) ---
@pytest.fixture(scope="module")
def fa3_verdicts():
    calls = corpus.fa3_calls(FA3_CALLS, seed=41, max_len=FA3_MAX_LEN, max_q=FA3_MAX_Q)
    return corpus.evaluate(calls, corpus.quant_check())


@pytest.fixture(scope="module")
def sage_verdicts():
    calls = corpus.sage_calls(SAGE_CALLS, seed=41, max_len=SAGE_MAX_LEN)
    return corpus.evaluate(calls, corpus.quant_check())


def _honest_failures(verdicts, variant):
    return [f"{v.name} {v.info}" for v in verdicts if not v.honest[variant]]


def _rate(verdicts, bug):
    hit = [v for v in verdicts if v.affected[bug]]
    missed = [f"{v.name} (change {v.bug_diff[bug]:.3g} > honest {v.honest_error:.3g})"
              for v in hit if v.bugs[bug]]
    return len(hit), missed


@pytest.mark.parametrize("variant", corpus.FA3_HONEST)
def test_corpus_fa3_honest_variant_passes(fa3_verdicts, variant):
    assert not _honest_failures(fa3_verdicts, variant)


def _assert_caught(verdicts: list, bug: str, calls: int) -> None:
    affected, missed = _rate(verdicts, bug)
    if affected < MIN_AFFECTED:
        pytest.skip(f"{bug}: {affected} of {calls} calls changed beyond the honest error")
    assert 1 - len(missed) / affected >= RATES.get(bug, RATE), (
        f"{bug}: missed on {len(missed)} of {affected}: {missed[:5]}")


@pytest.mark.parametrize("bug", corpus.FA3_CORPUS_BUGS)
def test_corpus_fa3_bug_is_caught(fa3_verdicts, bug):
    _assert_caught(fa3_verdicts, bug, FA3_CALLS)


def test_corpus_fa3_missing_offset_fails_most_calls(fa3_verdicts):
    """The +8 offset left out never moves the output past the honest spread here (no call is
    affected), yet it turns the p between 2**-14 and 2**-6 into e4m3 subnormals, which the
    tight interval sees: measured 36 of these 40 calls fail (48 of 48 at the issue's shapes);
    asserted at 85 %."""
    caught = sum(v.bugs["no_offset"] is False for v in fa3_verdicts)
    assert caught >= 0.85 * len(fa3_verdicts), f"{caught} of {len(fa3_verdicts)}"


@pytest.mark.parametrize("variant", list(corpus.SAGE_HONEST))
def test_corpus_sage_honest_variant_passes(sage_verdicts, variant):
    assert not _honest_failures(sage_verdicts, variant)


@pytest.mark.parametrize("bug", corpus.SAGE_CORPUS_BUGS)
def test_corpus_sage_bug_is_caught(sage_verdicts, bug):
    _assert_caught(sage_verdicts, bug, SAGE_CALLS)
