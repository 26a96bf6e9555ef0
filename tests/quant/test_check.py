"""refattn.quant.check and refattn.quant.diagnosis on small FA3-family calls.

The figures of the report are recomputed here by other formulas (max error by a loop over the
flat arrays, SQNR from norms, the bf16 path's error from torch where it is installed); the
candidates are helper simulations (``sims.py``: float32, written from the kernels' documented
arithmetic without refattn.quant) with and without a planted bug; each planted bug must fail
the check and be named by diagnose, and only by its own mutation(s).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import refattn
from refattn.errors import RefAttnError
from refattn.masks import causal as causal_mask
from refattn.quant import preset, quantized
from refattn.quant.check import QuantReport, check_candidate
from refattn.quant.diagnosis import MUTATION_NAMES, diagnose, mutations
from refattn.quant.formats import quantize, round_up

from . import sims

B, HQ, HKV, Q, K, D = 2, 4, 2, 5, 9, 16
DESCALES = [np.array([[0.25, 4.0], [4.0, 0.25]]), np.array([[0.5, 2.0], [1.0, 0.125]]),
            np.array([[2.0, 0.5], [0.25, 4.0]])]


def fa3_case(seed: int = 0, *, causal: bool = False, descales=DESCALES,
             kv_tile: int | None = None):
    rng = np.random.default_rng(seed)
    q = sims.fp8_values(rng, (B, HQ, Q, D))
    k = sims.fp8_values(rng, (B, HKV, K, D))
    v = sims.fp8_values(rng, (B, HKV, K, D))
    vis = causal_mask(Q, K, alignment="lower_right") if causal else None
    call = refattn.AttentionCall(q, k, v, scale=D ** -0.5, visible=vis)
    spec = preset("fa3_fp8", q_descale=descales[0], k_descale=descales[1],
                  v_descale=descales[2], kv_tile=kv_tile, tile_table="")  # a custom tile

    def simulate(bug=None):
        return sims.fa3_fp8(q, k, v, scale=D ** -0.5, q_descale=descales[0],
                            k_descale=descales[1], v_descale=descales[2], causal=causal,
                            bug=bug, block_n=kv_tile)
    return call, spec, simulate


_CACHE: dict = {}


def fa3(seed: int = 0, **kw):
    key = (seed, tuple(sorted(kw.items())))
    if key not in _CACHE:
        call, spec, simulate = fa3_case(seed, **kw)
        _CACHE[key] = (quantized(call, spec), simulate)
    return _CACHE[key]


# -- the report ------------------------------------------------------------------------------

def test_a_correct_candidate_passes_with_its_figures():
    result, simulate = fa3()
    sim = simulate()
    report = check_candidate(result, {"output": sim.output, "lse": sim.lse})
    assert isinstance(report, QuantReport) and report.passed
    assert report.spec_name == "fa3_fp8"
    out = report.tensors["output"]
    assert out.passed and out.outside == 0 and out.shape == (B, HQ, Q, D)
    assert out.off_grid == 0 and report.tensors["lse"].off_grid == 0  # bf16 and fp32 values
    real = np.asarray(result.real.output)
    # max error by a plain loop; SQNR from norms (20 log10 |r| / |c - r|)
    errs = [abs(float(c) - float(r)) for c, r in zip(sim.output.ravel(), real.ravel(),
                                                      strict=True)]
    assert out.max_error == max(errs)
    assert out.max_error_index == np.unravel_index(int(np.argmax(errs)), real.shape)
    sqnr = 20 * math.log10(np.linalg.norm(real) / np.linalg.norm(sim.output - real))
    assert out.sqnr_db == pytest.approx(sqnr, rel=1e-12)
    assert out.emulated_max_error == np.abs(result.emulated["output"].mid - real).max()
    assert 10 < out.sqnr_db < 60  # e4m3 inputs' real result against an FP8 pipeline
    assert out.fa3_ratio == out.max_error / out.bf16_max_error
    # the worst element is the one closest to an end of its interval, and inside it
    assert out.worst_lo <= out.worst_value <= out.worst_hi and out.worst_distance == 0
    lse = report.tensors["lse"]
    assert lse.passed and lse.fa3_ratio is None and lse.max_error is not None
    text = report.summary()
    assert text.startswith("fa3_fp8: PASS") and "output: inside" in text and "SQNR" in text


def test_the_midpoint_passes_and_off_grid_values_are_counted():
    result, _ = fa3(1, causal=True)
    mid = result.emulated["output"].mid
    report = check_candidate(result, {"output": quantize(mid, "bf16", "nearest_even")})
    assert report.passed and report.tensors["output"].off_grid == 0
    ml_dtypes = pytest.importorskip("ml_dtypes")
    off = int(np.count_nonzero(mid.astype(ml_dtypes.bfloat16).astype(np.float64) != mid))
    assert off > 0  # the midpoint of two bf16 values is mostly not one
    with pytest.raises(RefAttnError, match=r"candidate\['output'\]: value .* at index .* is not a "
                       r"bf16 value, the format fa3_fp8 returns output in"):
        check_candidate(result, {"output": mid})  # not what the kernel returns: refused
    report = check_candidate(result, {"output": mid}, require_format=False)
    assert report.passed and report.tensors["output"].off_grid == off
    assert f"{off} value(s) not on the returned format's grid" in report.summary()
    lse = result.emulated["lse"].lo
    with pytest.raises(RefAttnError, match=r"candidate\['lse'\]: .* is not a fp32 value"):
        check_candidate(result, {"output": result.emulated["output"].lo,
                                 "lse": lse + 2.0**-30 * np.abs(lse) + 2.0**-60})


def test_the_online_softmax_over_kv_tiles_passes_and_a_bug_is_named():
    result, simulate = fa3(2, causal=True, kv_tile=4)  # K = 9: tiles of 4, 4, 1 from the last
    sim = simulate()
    assert check_candidate(result, {"output": sim.output, "lse": sim.lse}).passed
    bad = simulate(bug="no_v_descale")
    assert [x.split(":")[0] for x in diagnose(result, {"output": bad.output})] == [
        "missing_v_descale"]


@pytest.mark.torch
def test_fa3_ratio_against_torchs_bf16_path():
    torch = pytest.importorskip("torch")
    result, simulate = fa3()
    report = check_candidate(result, {"output": simulate().output})
    call = result.real.call  # the dequantised call: codes x descales
    qb, kb, vb = (torch.from_numpy(np.array(x)).to(torch.float32).to(torch.bfloat16)
                  for x in (call.q, call.k, call.v))
    kb, vb = kb.repeat_interleave(HQ // HKV, 1), vb.repeat_interleave(HQ // HKV, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", qb, kb * call.scale)
    p = torch.softmax(s, -1).to(torch.bfloat16).to(torch.float8_e4m3fn).to(torch.bfloat16)
    out_pt = torch.einsum("bhqk,bhkd->bhqd", p, vb).double().numpy()
    err_pt = np.abs(out_pt - result.real.output).max()
    out = report.tensors["output"]
    assert out.bf16_max_error == pytest.approx(err_pt, rel=0.02)
    assert out.fa3_ratio == pytest.approx(out.max_error / err_pt, rel=0.02)


def test_one_element_one_ulp_past_the_widened_end_fails_and_is_located():
    result, simulate = fa3()
    sim = simulate().output.copy()
    hi = round_up(result.emulated["output"].hi, "bf16")  # the widened upper end
    at_end = sim.copy()
    at_end[1, 2, 3, 4] = hi[1, 2, 3, 4]
    assert check_candidate(result, {"output": at_end}).passed  # the end itself: inside
    past = sim.copy()
    # the next bf16 value above the end
    past[1, 2, 3, 4] = round_up(np.nextafter(hi[1, 2, 3, 4], np.inf), "bf16")
    report = check_candidate(result, {"output": past})
    out = report.tensors["output"]
    assert not report.passed and out.outside == 1 and out.worst_index == (1, 2, 3, 4)
    assert out.worst_distance == past[1, 2, 3, 4] - hi[1, 2, 3, 4] > 0
    assert "1 element(s) outside" in report.summary()


def test_nan_and_infinite_candidates_fail():
    result, simulate = fa3()
    out = simulate().output.copy()
    out[0, 0, 0, 0] = np.nan
    out[1, 1, 1, 1] = np.inf
    report = check_candidate(result, {"output": out})
    t = report.tensors["output"]
    assert t.outside == 2 and t.worst_distance == np.inf
    assert t.max_error == np.inf and t.sqnr_db == -np.inf


def test_malformed_candidates_are_refused():
    result, simulate = fa3()
    good = simulate().output
    with pytest.raises(RefAttnError, match="candidate: expected a non-empty dict"):
        check_candidate(result, {})
    with pytest.raises(RefAttnError, match="'out' is not a tensor the pipeline emulates"):
        check_candidate(result, {"out": good})
    with pytest.raises(RefAttnError, match=r"candidate\['output'\]: expected dtype float64 "
                                           r"\(the kernel's values converted exactly\), got "
                                           "float32"):
        check_candidate(result, {"output": good.astype(np.float32)})
    with pytest.raises(RefAttnError, match=r"candidate\['output'\]: expected shape "
                                           r"\[2, 4, 5, 16\], got \[2, 4, 5, 15\]"):
        check_candidate(result, {"output": good[..., :15]})
    with pytest.raises(RefAttnError, match="candidate: expected a non-empty dict"):
        diagnose(result, {})


# -- planted bugs ----------------------------------------------------------------------------

def test_the_mutations_of_each_preset():
    names = {p: [m.name for m in mutations(preset(p, **kw))] for p, kw in (
        ("fa3_fp8", {"q_descale": DESCALES[0], "k_descale": DESCALES[1],
                     "v_descale": DESCALES[2]}),
        ("flashinfer_sm90_fp8", {"q_scale": np.array([0.5, 2.0, 1.0, 4.0]),
                                 "k_scale": np.array([0.5, 2.0]), "v_scale": 2.0}),
        ("flashinfer_fp8_kv", {"k_scale": 0.5, "v_scale": 2.0}),
        ("sageattention_int8", {}))}
    assert names["fa3_fp8"] == [
        "missing_q_descale", "missing_k_descale", "missing_v_descale", "wrong_kv_head_descales",
        "wrong_kv_head_q_descale", "wrong_kv_head_k_descale", "wrong_kv_head_v_descale",
        "non_saturating_casts", "l_after_rounding", "missing_p_offset"]
    # q's scale is per query head in FlashInfer (not read through the kv head); v per tensor
    assert names["flashinfer_sm90_fp8"] == [
        "missing_q_descale", "missing_k_descale", "missing_v_descale",
        "wrong_kv_head_k_descale", "non_saturating_casts", "l_after_rounding",
        "missing_p_multiplier"]
    assert names["flashinfer_fp8_kv"][:2] == ["missing_k_descale", "missing_v_descale"]
    assert "l_before_rounding" in names["flashinfer_fp8_kv"]
    assert set().union(*names.values()) <= set(MUTATION_NAMES)


#: planted bug of sims.py -> the mutation(s) diagnose may name for it
EXPECTED = {
    "no_q_descale": {"missing_q_descale"}, "no_k_descale": {"missing_k_descale"},
    "no_v_descale": {"missing_v_descale"}, "wrong_kv_head": {"wrong_kv_head_descales"},
}


@pytest.mark.parametrize("bug", list(EXPECTED))
def test_a_planted_descale_bug_fails_and_only_its_mutation_is_named(bug):
    result, simulate = fa3()
    bad = simulate(bug=bug)
    cand = {"output": bad.output, "lse": bad.lse}
    assert not check_candidate(result, cand).passed
    named = {line.split(":")[0] for line in diagnose(result, cand)}
    assert named == EXPECTED[bug], named


def test_a_missing_offset_and_l_after_rounding_are_named():
    rng = np.random.default_rng(6)
    q, k, v = sims.dominant_key_codes(rng, 1, 2, 1, 3, 9, D)  # p 2^-10..2^-14 below the max
    call = refattn.AttentionCall(q, k, v, scale=D ** -0.5)
    result = quantized(call, preset("fa3_fp8"))
    bad = sims.fa3_fp8(q, k, v, scale=D ** -0.5, bug="no_offset")
    assert not check_candidate(result, {"output": bad.output}).passed
    assert [x.split(":")[0] for x in diagnose(result, {"output": bad.output})] == [
        "missing_p_offset"]
    # l from the rounded P: key 0 at S = 8, seven keys at 0, so every p of the seven rounds
    # the same way in e4m3 and l from P differs from l from p by percents
    q = np.zeros((1, 2, 3, D))
    q[..., 0] = 1.0
    k = np.zeros((1, 1, 8, D))
    k[:, :, 0, 0] = 8.0
    v = sims.fp8_values(rng, (1, 1, 8, D))
    qd = np.full((1, 1), float(np.float32(0.32)))
    call = refattn.AttentionCall(q, k, v, scale=D ** -0.5)
    result = quantized(call, preset("fa3_fp8", q_descale=qd))
    bad = sims.fa3_fp8(q, k, v, scale=D ** -0.5, q_descale=qd, bug="l_after_rounding")
    good = sims.fa3_fp8(q, k, v, scale=D ** -0.5, q_descale=qd)
    assert check_candidate(result, {"output": good.output, "lse": good.lse}).passed
    cand = {"output": bad.output, "lse": bad.lse}
    assert not check_candidate(result, cand).passed
    assert [x.split(":")[0] for x in diagnose(result, cand)] == ["l_after_rounding"]


def test_non_saturating_casts_are_named_from_the_nan_output():
    rng = np.random.default_rng(33)
    Hq, Hkv, Qn, Kn = 2, 1, 3, 6
    q = sims.grid_values(rng, (1, Hq, Qn, D), "bf16")
    k = sims.grid_values(rng, (1, Hkv, Kn, D), "bf16")
    v = sims.grid_values(rng, (1, Hkv, Kn, D), "bf16")
    s = float(np.float32(0.01))
    k[..., 0] = sims.cast(np.sign(k[..., 0]) * 448 * s * 2.5, "bf16", saturate=False)
    call = refattn.AttentionCall(q, k, v, scale=D ** -0.5)
    result = quantized(call, preset("vllm_fp8_kv", q_scale=s, k_scale=s, v_scale=s))
    kw = {"scale": D ** -0.5, "q_scale": s, "k_scale": s, "v_scale": s}
    good = sims.vllm_fp8_kv(q, k, v, **kw)
    assert check_candidate(result, {"output": good.output}).passed
    bad = sims.vllm_fp8_kv(q, k, v, bug="no_saturate", **kw)
    assert np.isnan(bad.output).all()  # a NaN code in every row's keys
    assert not check_candidate(result, {"output": bad.output}).passed
    assert [x.split(":")[0] for x in diagnose(result, {"output": bad.output})] == [
        "non_saturating_casts"]


def test_no_diagnosis_for_a_passing_or_unexplained_candidate():
    result, simulate = fa3()
    assert diagnose(result, {"output": simulate().output}) == []
    # twice the real result: no planted bug of the list gives it
    wrong = quantize(2.0 * np.asarray(result.real.output), "bf16", "nearest_even")
    assert not check_candidate(result, {"output": wrong}).passed
    assert diagnose(result, {"output": wrong}) == []


def test_wrong_kv_head_means_head_j_reads_j_plus_one():
    """With three kv heads the direction of the mix-up matters: sims.py's kernel reads kv head
    (j + 1) mod Hkv's descales, and only that mutation (not j - 1's) may contain it."""
    rng = np.random.default_rng(9)
    Hkv = 3
    q = sims.fp8_values(rng, (1, 2 * Hkv, 4, D))
    k = sims.fp8_values(rng, (1, Hkv, 6, D))
    v = sims.fp8_values(rng, (1, Hkv, 6, D))
    d = [np.array([[0.25, 1.0, 4.0]]), np.array([[2.0, 0.5, 1.0]]), np.array([[4.0, 0.5, 1.0]])]
    call = refattn.AttentionCall(q, k, v, scale=D ** -0.5)
    result = quantized(call, preset("fa3_fp8", q_descale=d[0], k_descale=d[1],
                                    v_descale=d[2], mma_bits=24))
    bad = sims.fa3_fp8(q, k, v, scale=D ** -0.5, q_descale=d[0], k_descale=d[1],
                       v_descale=d[2], bug="wrong_kv_head")
    assert [x.split(":")[0] for x in diagnose(result, {"output": bad.output})] == [
        "wrong_kv_head_descales"]
    # the other direction (kv head j reads j - 1's) is a different candidate: not named
    rolled = [np.roll(x, 1, axis=1) for x in d]
    other = sims.fa3_fp8(q, k, v, scale=D ** -0.5, q_descale=rolled[0], k_descale=rolled[1],
                         v_descale=rolled[2])
    assert not check_candidate(result, {"output": other.output}).passed
    assert diagnose(result, {"output": other.output}) == []
