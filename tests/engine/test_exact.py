"""The exact backend: correct rounding of every step, checked independently.

Expected values come from other arithmetic than the backend's: CPython's correctly rounded
integer division (Fractions), the mpmath-interval certificate, and the NumPy reference within
documented, conditioning-scaled bounds.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from flint import arb
from hypothesis import given, settings
from hypothesis import strategies as st

import refattn
from refattn.analysis.certificate import certify
from refattn.analysis.reference_error import reference_error
from refattn.bundle.suites import build_suite
from refattn.engine.exact.backend import estimate_seconds
from refattn.engine.exact.program import ROUNDING_POINTS
from refattn.engine.exact.rounding import decide, precision, rn_dyadic, round_ball
from tests.engine_compare import STRUCTURAL_ZEROS, assert_close, natural_scales
from tests.strategies import engine_calls

ROOT = Path(__file__).resolve().parents[2]
CASES = {c.case_id: c for c in build_suite("conformance")}

#: documented bounds of the float64 backends against "exact" (docs/EXACT_ROUNDING.md, README):
#: forward tensors' normwise relative difference <= FORWARD_BOUND * kappa, gradients within
#: BACKWARD_BOUND * kappa of their natural magnitude, kappa = max(1, max|scores| / 16) the
#: conditioning of exp(s - lse) in the scores (1 ulp of s = 1000 moves P by 1e-13)
FORWARD_BOUND = 1e-14
BACKWARD_BOUND = 1e-12
FORWARD = ("scores", "biased_scores", "masked_scores", "row_max", "lse", "probs", "consumed",
           "output", "sink_probs", "softcap_input")


def _all(trace, grads) -> dict[str, np.ndarray]:
    return {**trace.tensors(), **grads.tensors()}


def _run(call, g_o, backend):
    t = refattn.forward(call, backend=backend)
    return t, refattn.backward(t, g_o)


# -- rounding primitives ---------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(m=st.integers(-(2**80), 2**80), e=st.integers(-1200, 900))
def test_rn_dyadic_is_cpython_correct_rounding(m, e):
    exact = Fraction(m) * Fraction(2) ** e
    try:
        want = float(exact)  # CPython: correctly rounded, ties to even, subnormals included
    except OverflowError:
        with pytest.raises(OverflowError):
            rn_dyadic(m, e)
        return
    assert rn_dyadic(m, e) == want
    assert math.copysign(1.0, rn_dyadic(m, e)) == math.copysign(1.0, want) or want == 0.0


@pytest.mark.parametrize(("m", "e", "want"), [
    (2**53 + 1, 0, 2.0**53),  # tie: to even (down)
    (2**53 + 3, 0, 2.0**53 + 4),  # tie: to even (up)
    (1, -1075, 0.0),  # half the smallest subnormal: tie to even 0
    (3, -1076, 2.0**-1074),  # 0.75 of it: up
    (-(2**53) - 1, 0, -(2.0**53)),
])
def test_rn_dyadic_ties_and_subnormals(m, e, want):
    assert rn_dyadic(m, e) == want


def test_a_ball_straddling_a_midpoint_is_undecided_until_exact():
    with precision(128):
        mid = arb(1) + arb(2) ** -53  # exactly halfway between 1 and its successor
    assert mid.is_exact() and round_ball(mid) == 1.0  # exact (radius 0): ties to even
    with precision(60):
        fuzzy = (arb(1) + arb(2) ** -53) + (arb(1) / 3 - arb(1) / 3)  # same value, radius > 0
    assert not fuzzy.is_exact() and round_ball(fuzzy) is None


def test_decide_raises_precision_until_decided_and_names_overflow():
    # exp(1) is decided; a value beyond the largest double is reported by element
    assert decide("e", lambda: np.array([arb(1).exp()], dtype=object))[0] == math.e
    with pytest.raises(refattn.RefAttnError, match=r"huge: element \(1\) overflows binary64"):
        decide("huge", lambda: np.array([arb(1), arb(2) ** 1024], dtype=object))


def test_an_overflowing_score_is_refused_by_the_gate_before_any_backend_runs():
    q = np.full((1, 1, 2, 2), 1e200)  # q k^T = 2e400: no backend may see this call
    with pytest.raises(refattn.RefAttnError, match=r"q, k: the scores could overflow float64"):
        refattn.AttentionCall(q, q, q, scale=1.0)


def test_a_call_too_large_is_refused_up_front_with_an_estimate():
    x = np.zeros((1, 2, 256, 16))
    call = refattn.AttentionCall(x, x, x)
    assert estimate_seconds(call) > 1.0
    with pytest.raises(refattn.RefAttnError, match=r"about \d+ s .* backend='numpy'"):
        refattn.forward(call, backend="exact", max_seconds=1.0)


# -- the backend against the certificate and the float64 reference ----------------------------
@pytest.mark.parametrize("case_id", sorted(CASES))
def test_every_conformance_case_is_certified_correctly_rounded(case_id):
    case = CASES[case_id]
    t, g = _run(case.call, case.grad_output, "exact")
    cert = certify(case.call, _all(t, g))
    assert cert.passed, [(c.tensor, c.failure) for c in cert.failures]
    assert {c.tensor for c in cert.checks} >= {"scores", "lse", "probs", "output", "grad_v",
                                               "grad_scores", "grad_q", "grad_k"}


def _kappa(scores: np.ndarray) -> float:
    """The conditioning factor of exp(s - lse) in the scores: max(1, max|s| / 16)."""
    legal = np.abs(scores[np.isfinite(scores)])
    return max(1.0, (legal.max() if legal.size else 0.0) / 16)


def _assert_close_to_exact(call, exact, other, what):
    """Forward tensors: normwise relative <= FORWARD_BOUND * kappa. Gradients: within
    BACKWARD_BOUND * kappa of their natural magnitude (a cancelling sum, such as the gradient
    of a bias broadcast over keys, is measured against the terms it sums)."""
    (t, g), (o_t, o_g) = exact, other
    want_all, got_all = _all(t, g), _all(o_t, o_g)
    kappa = _kappa(t.scores)
    scales = natural_scales(call, t, g) if call.score.name == "dot" else {}
    for name, want in want_all.items():
        got = got_all[name]
        if want.dtype.kind != "f":
            np.testing.assert_array_equal(got, want, err_msg=f"{what}: {name}")
            continue
        fin = np.isfinite(want)
        np.testing.assert_array_equal(np.isfinite(got), fin, err_msg=f"{what}: {name}")
        if name in FORWARD or name not in scales:
            denom = np.linalg.norm(want[fin])
            err = np.linalg.norm(got[fin] - want[fin]) / denom if denom else 0.0
            base = FORWARD_BOUND if name in FORWARD else BACKWARD_BOUND
            assert err <= base * kappa, f"{what}: {name} differs by {err:.2e} (normwise)"
        else:
            assert_close(f"{what}: {name}", got, want, scales[name], BACKWARD_BOUND * kappa,
                         zeros=name in STRUCTURAL_ZEROS and name != "grad_scores")


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_float64_backends_stay_within_the_documented_bounds(backend):
    for case in CASES.values():
        t, g = _run(case.call, case.grad_output, "exact")
        try:
            o_t, o_g = _run(case.call, case.grad_output, backend)
        except refattn.RefAttnError:
            continue  # a family the numba backend does not run
        _assert_close_to_exact(case.call, (t, g), (o_t, o_g), f"{backend} {case.case_id}")


@settings(max_examples=25, deadline=None)
@given(call=engine_calls(max_len=6, max_width=4))
def test_hypothesis_calls_are_certified_and_close_to_the_float64_backends(call):
    rng = np.random.default_rng(0)
    g_o = rng.standard_normal((*call.q.shape[:3], call.v.shape[3]))
    t, g = _run(call, g_o, "exact")
    cert = certify(call, _all(t, g))
    assert cert.passed, [(c.tensor, c.failure) for c in cert.failures]
    for backend in ("numpy", "numba"):
        _assert_close_to_exact(call, (t, g), _run(call, g_o, backend), backend)


@pytest.mark.parametrize("case_id", ["sink_softcap_gqa_causal", "dropout_philox",
                                     "score_bilinear_per_head", "score_additive"])
def test_the_certificate_rejects_any_one_ulp_change(case_id):
    case = CASES[case_id]
    t, g = _run(case.call, case.grad_output, "exact")
    tensors = _all(t, g)
    for cert_check in certify(case.call, tensors).checks:
        name = cert_check.tensor
        x = np.array(tensors[name], dtype=np.float64)
        idx = np.unravel_index(int(np.argmax(np.abs(np.where(np.isfinite(x), x, 0)))), x.shape)
        x[idx] = np.nextafter(x[idx], np.inf)
        bad = certify(case.call, {**tensors, name: x})
        assert name in {c.tensor for c in bad.failures}, f"{case_id}: {name} not caught"


def test_bit_identical_run_to_run_and_numpy_reference_is_not_correctly_rounded():
    case = CASES["self_attention_basic"]
    a, b = _all(*_run(case.call, case.grad_output, "exact")), _all(
        *_run(case.call, case.grad_output, "exact"))
    assert all(np.array_equal(a[n], b[n]) for n in a)
    numpy_tensors = _all(*_run(case.call, case.grad_output, "numpy"))
    assert not certify(case.call, numpy_tensors).passed  # the certificate is not vacuous


# -- the reference's own error -----------------------------------------------------------------
def test_reference_error_of_a_single_rounding_is_at_most_half_an_ulp():
    case = CASES["longer_sequence_causal_64"]
    t, g = _run(case.call, case.grad_output, "exact")
    err = reference_error(case.call, _all(t, g))
    unit = 2.0**-53
    for name in ("scores", "biased_scores", "grad_consumed"):  # one rounding of exact inputs
        assert err[name]["max_relative"] <= unit * 1.01, (name, err[name])
    for name in ("probs", "output", "grad_q", "grad_k", "grad_v"):  # propagated, still tiny
        assert 0 < err[name]["normwise_relative"] < 1e-14, (name, err[name])


def test_reference_error_sees_the_numpy_references_larger_error():
    case = CASES["large_logits_positive"]
    exact = reference_error(case.call, _all(*_run(case.call, case.grad_output, "exact")))
    other = reference_error(case.call, _all(*_run(case.call, case.grad_output, "numpy")))
    assert other["scores"]["max_relative"] > exact["scores"]["max_relative"]


# -- the specification ----------------------------------------------------------------------------
def test_every_rounding_point_is_documented():
    doc = (ROOT / "docs" / "EXACT_ROUNDING.md").read_text()
    rows = set(re.findall(r"^\| ([a-z_, ]+?) \|", doc, flags=re.M))
    for name in ROUNDING_POINTS:
        if name == "grad_score_<param>":
            assert "grad_score_W, _Wq, _Wk, _b, _v" in doc
        else:
            assert name in rows, f"{name} has no row in docs/EXACT_ROUNDING.md"
