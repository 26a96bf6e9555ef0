"""gradcheck.check_vjp / assert_gradients on plain NumPy functions: validation, modes, reports,
replay, tolerance scaling, localisation, null directions, structural problems, Taylor test."""

from __future__ import annotations

import numpy as np
import pytest

from gradcheck import GradcheckError, GradientCheckError, assert_gradients, check_vjp, taylor_test

RNG = np.random.default_rng(20261130)
A = RNG.standard_normal((4, 3))
X = RNG.standard_normal((3, 5))


def matmul_tanh(a, x):
    return np.tanh(a @ x)  # (4, 5)


def matmul_tanh_vjp(g, a, x):
    d = g * (1.0 - np.tanh(a @ x) ** 2)  # (4, 5)
    return {"a": d @ x.T, "x": a.T @ d}


INPUTS = {"a": A, "x": X}


# -- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [A.astype(np.float32), A.astype(np.int64),
                                 A.astype(np.complex128), A.tolist()])
def test_non_float64_inputs_are_an_error(bad):
    if isinstance(bad, list):  # a list of Python floats reads as float64: accepted
        assert check_vjp(matmul_tanh, matmul_tanh_vjp, {"a": bad, "x": X}).passed
        return
    with pytest.raises(GradcheckError, match=r"inputs\['a'\].*float64"):
        check_vjp(matmul_tanh, matmul_tanh_vjp, {"a": bad, "x": X})


def test_other_invalid_arguments_are_errors():
    nan = A.copy()
    nan[1, 2] = np.nan
    with pytest.raises(GradcheckError, match=r"non-finite.*\(1, 2\)"):
        check_vjp(matmul_tanh, matmul_tanh_vjp, {"a": nan, "x": X})
    with pytest.raises(GradcheckError, match=r"grad_output.*float64"):
        check_vjp(matmul_tanh, matmul_tanh_vjp, INPUTS,
                  grad_output=np.ones((4, 5), np.float32))
    with pytest.raises(GradcheckError, match=r"grad_output.*shape"):
        check_vjp(matmul_tanh, matmul_tanh_vjp, INPUTS, grad_output=np.ones((5, 4)))
    with pytest.raises(GradcheckError, match=r"fn output.*float64"):
        check_vjp(lambda a, x: matmul_tanh(a, x).astype(np.float32), matmul_tanh_vjp, INPUTS)
    with pytest.raises(GradcheckError, match="mode"):
        check_vjp(matmul_tanh, matmul_tanh_vjp, INPUTS, mode="fast")
    with pytest.raises(GradcheckError, match="method"):
        check_vjp(matmul_tanh, matmul_tanh_vjp, INPUTS, method="forward")
    with pytest.raises(GradcheckError, match="wrt"):
        check_vjp(matmul_tanh, matmul_tanh_vjp, INPUTS, wrt=["b"])
    with pytest.raises(GradcheckError, match="vjp: expected a mapping"):
        check_vjp(matmul_tanh, lambda g, a, x: [g], INPUTS)


# -- modes and methods ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["full", "directional"])
@pytest.mark.parametrize("method", ["complex_step", "central", "auto"])
def test_right_vjp_passes(mode, method):
    report = check_vjp(matmul_tanh, matmul_tanh_vjp, INPUTS, mode=mode, method=method)
    assert report.passed, str(report)
    assert report.mode == mode
    want = "central" if method == "central" else "complex_step"
    assert {r.method for r in report.inputs.values()} == {want}


def test_auto_mode_switches_on_size():
    small = check_vjp(matmul_tanh, matmul_tanh_vjp, INPUTS)
    large = check_vjp(matmul_tanh, matmul_tanh_vjp, INPUTS, full_limit=10)
    assert (small.mode, large.mode) == ("full", "directional")
    assert small.inputs["a"].n_checked == A.size
    assert large.inputs["a"].n_checked == 3  # default directions


def test_grad_output_is_used_as_given():
    g = RNG.standard_normal((4, 5))
    report = check_vjp(matmul_tanh, matmul_tanh_vjp, INPUTS, grad_output=g)
    assert np.array_equal(report.cotangents[0], g)
    np.testing.assert_array_equal(report.inputs["a"].analytic, matmul_tanh_vjp(g, A, X)["a"])


# -- the report -------------------------------------------------------------------------------


def test_one_wrong_element_is_the_worst_index():
    def vjp(g, a, x):
        out = matmul_tanh_vjp(g, a, x)
        out["x"][2, 1] *= 1.1
        return out

    report = check_vjp(matmul_tanh, vjp, INPUTS, mode="full")
    r = report.inputs["x"]
    assert report.failed == ["x"]
    assert r.worst.index == (2, 1) and r.n_over == 1
    assert r.worst.rel_error == pytest.approx(0.1 / 1.1, rel=1e-6)
    assert r.worst.ratio > 1e6
    text = str(report)
    assert "(2, 1)" in text and "FAILED" in text


def test_missing_scale_reads_as_best_fit_factor():
    def vjp(g, a, x):
        return {"a": 0.125 * matmul_tanh_vjp(g, a, x)["a"], "x": matmul_tanh_vjp(g, a, x)["x"]}

    for mode in ("full", "directional"):
        report = check_vjp(matmul_tanh, vjp, INPUTS, mode=mode)
        fit = report.inputs["a"].scale_fit
        assert fit.scale == pytest.approx(0.125, rel=1e-12) and fit.residual < 1e-12
        assert "analytic = 0.125 x numeric" in str(report)
        assert any("constant-factor" in s for s in report.inputs["a"].explain())


def test_quantiles_and_counts():
    report = check_vjp(matmul_tanh, matmul_tanh_vjp, INPUTS, mode="full")
    q = report.inputs["a"].quantiles
    assert set(q) == {"p50", "p90", "p99", "max"}
    assert q["p50"] <= q["p90"] <= q["p99"] <= q["max"] < 1e-13
    rel = np.abs(report.inputs["a"].analytic - report.inputs["a"].numeric)
    assert q["max"] == pytest.approx(
        np.max(rel / np.maximum(np.abs(report.inputs["a"].analytic),
                                np.abs(report.inputs["a"].numeric))), rel=1e-12)


def test_replay_from_seed():
    one = check_vjp(matmul_tanh, matmul_tanh_vjp, INPUTS, mode="directional", seed=7)
    two = check_vjp(matmul_tanh, matmul_tanh_vjp, INPUTS, mode="directional", seed=7)
    other = check_vjp(matmul_tanh, matmul_tanh_vjp, INPUTS, mode="directional", seed=8)
    for n in INPUTS:
        assert np.array_equal(one.inputs[n].numeric, two.inputs[n].numeric)
        for d1, d2 in zip(one.directions[n], two.directions[n], strict=True):
            assert np.array_equal(d1, d2)
        assert not np.array_equal(one.directions[n][0], other.directions[n][0])
    assert "seed=7" in str(one)
    # one input's directions do not depend on which other inputs are checked
    only_x = check_vjp(matmul_tanh, matmul_tanh_vjp, INPUTS, mode="directional", seed=7,
                       wrt=["x"])
    assert np.array_equal(only_x.directions["x"][1], one.directions["x"][1])


def test_directions_are_signed_gaussian():
    report = check_vjp(matmul_tanh, matmul_tanh_vjp, INPUTS, mode="directional", seed=3)
    w = np.concatenate([d.ravel() for d in report.directions["a"]])
    assert (w < 0).any() and (w > 0).any()


# -- directional mode: tolerance by ||v|| ||J w||, localisation -------------------------------


def test_directional_tolerance_does_not_grow_with_size():
    # one element 10% wrong among 200,000: caught and localised by bisection
    n = 200_000
    x = np.random.default_rng(1).standard_normal(n)
    fn = lambda x: np.sin(x)  # noqa: E731
    bad = 123_457

    def vjp(g, x):
        out = g * np.cos(x)
        out[bad] *= 1.1
        return {"x": out}

    report = check_vjp(fn, vjp, {"x": x})
    r = report.inputs["x"]
    assert report.mode == "directional" and not report.passed
    assert r.localized and r.worst.index == (bad,)
    assert r.worst.numeric == pytest.approx(report.cotangents[r.worst.direction][bad]
                                            * np.cos(x[bad]), rel=1e-12)
    right = check_vjp(fn, lambda g, x: {"x": g * np.cos(x)}, {"x": x})
    assert right.passed and right.inputs["x"].worst.ratio < 0.1


# -- null directions --------------------------------------------------------------------------


def _shift_invariant(x):
    # softmax along the last axis: adding a constant to a row changes nothing
    e = np.exp(x - x.real.max(axis=-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _shift_invariant_vjp(g, x):
    p = _shift_invariant(x)
    return {"x": p * (g - (g * p).sum(-1, keepdims=True))}


def _row_mean(a):
    return a.mean(axis=-1, keepdims=True)


def test_null_directions_are_removed_and_checked_exactly():
    x = RNG.standard_normal((3, 6))
    report = check_vjp(_shift_invariant, _shift_invariant_vjp, {"x": x}, mode="directional",
                       null_space={"x": _row_mean})
    assert report.passed
    assert report.inputs["x"].null_ratio < 1e-2
    for w in report.directions["x"]:
        assert np.abs(w.sum(-1)).max() < 1e-9 * np.abs(w).sum()  # up to exact-step rounding

    def leaky(g, x):  # adds a component along the null direction: invisible to J w
        out = _shift_invariant_vjp(g, x)
        return {"x": out["x"] + 1e-6}

    bad = check_vjp(_shift_invariant, leaky, {"x": x}, mode="directional",
                    null_space={"x": _row_mean})
    assert not bad.passed and bad.inputs["x"].null_ratio > 1e3
    assert "exactly constant" in str(bad)


# -- structural problems ----------------------------------------------------------------------


def test_structural_problems_are_reported():
    missing = check_vjp(matmul_tanh, lambda g, a, x: {"a": matmul_tanh_vjp(g, a, x)["a"]},
                        INPUTS)
    assert missing.failed == ["x"] and "no gradient for 'x'" in str(missing)

    def f32(g, a, x):
        out = matmul_tanh_vjp(g, a, x)
        return {"a": out["a"].astype(np.float32), "x": out["x"]}

    report = check_vjp(matmul_tanh, f32, INPUTS)
    assert report.failed == ["a"] and "dtype float32" in report.inputs["a"].problem

    def wrong_shape(g, a, x):
        return {"a": np.zeros((2, 2)), "x": matmul_tanh_vjp(g, a, x)["x"]}

    report = check_vjp(matmul_tanh, wrong_shape, INPUTS)
    assert report.failed == ["a"] and "no broadcast reduction" in report.inputs["a"].problem


def test_unreduced_broadcast_gradient_names_the_axes():
    b = RNG.standard_normal((1, 5))  # broadcast over the 4 rows

    def fn(a, x, b):
        return np.tanh(a @ x + b)

    def vjp(g, a, x, b):
        d = g * (1.0 - np.tanh(a @ x + b) ** 2)
        return {"a": d @ x.T, "x": a.T @ d, "b": d}  # b's gradient not summed over rows

    report = check_vjp(fn, vjp, {**INPUTS, "b": b})
    r = report.inputs["b"]
    assert report.failed == ["b"] and "broadcast axes (0,)" in r.problem
    assert r.n_over == 0  # after summing the axis the values are right: the report says so


# -- assert_gradients -------------------------------------------------------------------------


def test_assert_gradients_raises_with_the_report():
    assert assert_gradients(matmul_tanh, matmul_tanh_vjp, INPUTS).passed

    def vjp(g, a, x):
        return {"a": matmul_tanh_vjp(g, a, x)["a"], "x": 2.0 * matmul_tanh_vjp(g, a, x)["x"]}

    with pytest.raises(AssertionError) as info:
        assert_gradients(matmul_tanh, vjp, INPUTS)
    assert isinstance(info.value, GradientCheckError)
    assert info.value.report.failed == ["x"]
    assert str(info.value) == str(info.value.report)


# -- Taylor remainder -------------------------------------------------------------------------


def test_taylor_slopes_read_two_for_right_and_one_for_wrong():
    right = taylor_test(matmul_tanh, matmul_tanh_vjp, INPUTS)
    assert right.passed
    for r in right.results.values():
        assert r.verdict == "second_order" and 1.8 <= r.slope <= 2.2

    def wrong(g, a, x):
        out = matmul_tanh_vjp(g, a, x)
        return {"a": out["a"] * 1.001, "x": out["x"]}

    report = taylor_test(matmul_tanh, wrong, INPUTS)
    assert not report.passed
    assert report.results["a"].verdict == "first_order"
    assert 0.8 <= report.results["a"].slope <= 1.2
    assert report.results["x"].verdict == "second_order"
    assert "first_order" in str(report)


def test_taylor_exact_for_a_linear_function():
    fn = lambda a, x: a @ x  # noqa: E731
    report = taylor_test(fn, lambda g, a, x: {"a": g @ x.T, "x": a.T @ g}, INPUTS)
    assert {r.verdict for r in report.results.values()} == {"exact"}
