"""gradcheck.methods: complex step, Richardson central differences, error estimates, kinks,
and the automatic complex-safety test, on plain NumPy functions with known derivatives."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradcheck import check_vjp
from gradcheck.methods import (
    CD_STEP,
    EPS,
    central_jvp,
    complex_safety,
    complex_step_jvp,
    exact_direction,
    noise_weights,
    richardson_weights,
)

# -- Richardson weights -----------------------------------------------------------------------


@pytest.mark.parametrize("levels", [1, 2, 3, 4])
def test_richardson_weights_cancel_even_powers(levels):
    # D(h) = f' + a h^2 + b h^4 + c h^6 at steps h 2^k: the extrapolation removes levels-1 terms
    c = richardson_weights(levels)
    h = np.array([2.0**k for k in range(levels)])
    assert math.isclose(c.sum(), 1.0, rel_tol=0, abs_tol=1e-14)
    for power in range(1, levels):
        assert abs(c @ h ** (2 * power)) < 1e-12 * (2.0 ** (2 * power * levels))


# -- complex step -----------------------------------------------------------------------------


def test_complex_step_is_exact_for_analytic_functions():
    x = np.array([0.3, -1.7, 2.5])
    w = np.array([1.0, -0.5, 2.0])
    inputs = {"x": x}
    for fn, df in [(lambda x: np.sin(x) * np.exp(x), lambda x: (np.cos(x) + np.sin(x)) * np.exp(x)),
                   (lambda x: x**5, lambda x: 5 * x**4),
                   (lambda x: np.log1p(x * x), lambda x: 2 * x / (1 + x * x))]:
        j = complex_step_jvp(fn, inputs, "x", w)
        np.testing.assert_allclose(j.value, df(x) * w, rtol=4 * EPS, atol=0)
        assert j.method == "complex_step" and not j.error.any()


# -- central differences with Richardson extrapolation ----------------------------------------


def test_central_levels_make_a_large_step_accurate():
    # exp with a big step: plain central difference is off by ~h^2/6; Richardson removes it
    x, w = {"x": np.array([1.0])}, np.array([1.0])
    plain = central_jvp(lambda x: np.exp(x), x, "x", w, step=1e-2, levels=1)
    rich = central_jvp(lambda x: np.exp(x), x, "x", w, step=1e-2, levels=3)
    exact = math.e
    assert abs(plain.value[0] - exact) > 1e-5
    assert abs(rich.value[0] - exact) < 1e-11
    assert abs(rich.value[0] - exact) <= rich.error[0]


@settings(max_examples=40, deadline=None)
@given(a=st.floats(-3, 3), b=st.floats(-2, 2), x0=st.floats(-2, 2), scalar=st.booleans(),
       seed=st.integers(0, 1000))
def test_central_error_estimate_covers_the_true_error(a, b, x0, scalar, seed):
    # smooth functions whose terms cancel (|f| << |terms|): the a-priori eps |f| / h noise is
    # too small there, the pooled empirical level is not; the exact vjp must pass
    def fn(x):
        return np.sin(a * x) * np.exp(b * x) + x**3

    def df(x):
        return (a * np.cos(a * x) + b * np.sin(a * x)) * np.exp(b * x) + 3 * x**2

    x = np.array([x0, x0 + 0.5, -x0])
    if scalar:
        report = check_vjp(lambda x: np.array([fn(x).sum()]),
                           lambda g, x: {"x": g[0] * df(x)}, {"x": x}, method="central",
                           seed=seed)
    else:
        report = check_vjp(fn, lambda g, x: {"x": g * df(x)}, {"x": x}, method="central",
                           seed=seed)
    r = report.inputs["x"]
    assert report.passed, str(report)
    assert r.worst.abs_error <= r.worst.tolerance


def test_noise_weights_leave_pure_noise():
    # a polynomial of degree 5 in h (f', h^2, h^4 terms) is annihilated by four levels
    a = noise_weights(4)
    h = 2.0 ** np.arange(4)
    assert abs(a @ (3.0 + 2.0 * h**2 - 5.0 * h**4)) < 1e-9
    assert noise_weights(2) is None


def test_exact_direction_makes_perturbations_exact():
    rng = np.random.default_rng(0)
    x = rng.uniform(1.0, 1.5, 1000) * rng.choice([-1.0, 1.0], 1000)  # away from binade tops
    w = exact_direction(x, rng.standard_normal(1000), levels=3)
    for k in range(3):
        p = CD_STEP * 2.0**k * w
        assert np.all((x + p) - x == p) and np.all(x - (x - p) == p)
    zero = exact_direction(np.zeros(4), np.array([1.0, -2.0, 0.5, 3.0]))
    assert np.all((CD_STEP * zero) * 1 == CD_STEP * zero)


# -- kinks ------------------------------------------------------------------------------------


def test_kink_inside_the_step_is_flagged_and_explained():
    relu = lambda x: np.where(x > 0, x, 0.0)  # noqa: E731
    x = np.array([1e-6, 0.7, -0.4])  # element 0 sits 1e-6 from the kink, inside the steps
    vjp = lambda g, x: {"x": g * (x > 0)}  # noqa: E731  the right derivative
    report = check_vjp(relu, vjp, {"x": x}, method="central", mode="full")
    r = report.inputs["x"]
    assert r.kinks == ((0,),)  # only the element next to the kink
    assert "non-smooth" in str(report)
    # the central difference there straddles the kink: far from the true derivative 1
    assert abs(r.numeric[0] - 1.0) > 0.1


def test_auto_method_uses_complex_step_across_a_kink():
    # where() on the real part is complex-safe; the central difference is not smooth here,
    # so the safety test is inconclusive and complex step (one-sided, exact) is used
    relu = lambda x: np.where(x.real > 0, x, 0.0)  # noqa: E731
    x = np.array([1e-6, 0.7, -0.4])
    report = check_vjp(relu, lambda g, x: {"x": g * (x > 0)}, {"x": x})
    assert report.passed and report.inputs["x"].method == "complex_step"
    assert "inconclusive" in report.inputs["x"].method_note


def test_smooth_function_has_no_kink_flags():
    x = np.linspace(-2, 2, 9)
    report = check_vjp(lambda x: np.tanh(3 * x), lambda g, x: {"x": 3 * g / np.cosh(3 * x) ** 2},
                       {"x": x}, method="central")
    assert report.passed and report.inputs["x"].kinks == ()


# -- complex-safety detection -----------------------------------------------------------------


def _into_float_buffer(x):
    out = np.empty(x.shape)  # float64 buffer: assigning complex drops the imaginary part
    out[...] = x  # numpy warns (ComplexWarning); the checker turns that into "unsafe"
    return out * x


UNSAFE = {
    "abs": (lambda x: np.abs(x) * x, "disagrees"),
    "real_cast": (lambda x: np.real(x) ** 2, "returns real"),
    "raises": (lambda x: np.array([math.fsum(x.tolist())]) * x, "raises on complex input"),
    "buffer": (_into_float_buffer, "discards an imaginary part"),
}


@pytest.mark.parametrize("name", sorted(UNSAFE))
def test_complex_unsafe_functions_fall_back_to_central_and_say_why(name):
    fn, why = UNSAFE[name]
    x = np.array([0.4, -1.3, 0.9])
    verdict = complex_safety(fn, {"x": x}, "x", np.array([1.0, 0.3, -0.6]))
    assert not verdict.safe and why in verdict.reason


def test_auto_method_reports_the_fallback_and_still_checks():
    x = np.array([0.4, -1.3, 0.9])
    fn = lambda x: np.abs(x) * x  # noqa: E731  (complex step would differentiate x^2)
    vjp = lambda g, x: {"x": g * 2 * np.abs(x)}  # noqa: E731
    report = check_vjp(fn, vjp, {"x": x})
    r = report.inputs["x"]
    assert report.passed and r.method == "central"
    assert "complex step not used" in r.method_note
    assert "complex step not used" in str(report)


def test_complex_safe_function_gets_complex_step_with_agreement():
    x = np.array([0.4, -1.3, 0.9])
    verdict = complex_safety(lambda x: np.tanh(x) * x, {"x": x}, "x", np.ones(3))
    assert verdict.safe and verdict.agreement < 1.0
