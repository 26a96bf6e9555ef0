"""The comparison harness: structure checks, the float64 rule, the reference-relative rule."""

from __future__ import annotations

import json

import numpy as np
import pytest

import refattn
from refattn import RefAttnError
from refattn.bundle import load, write_bundle
from refattn.bundle.comparison.candidates import read_candidate, write_candidate
from refattn.bundle.comparison.harness import compare
from refattn.bundle.comparison.lowp import naive_lowp
from refattn.bundle.comparison.tolerances import Tolerances, resolve_dtype, rounding_floor
from refattn.bundle.golden.guarantee import natural_scales
from refattn.bundle.golden.spec import case_spec
from refattn.bundle.suites import build_suite
from refattn.cli import main

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def spec():
    """GQA, broadcast bias, Q != K, Dk != Dv: every gradient including grad_bias."""
    return case_spec(next(c for c in build_suite("contract")
                          if c.case_id == "gqa_broadcast_bias_cross"))


@pytest.fixture(scope="module")
def masked_spec():
    """Loop 7: a masked column, so masked_scores carries -inf."""
    return case_spec(build_suite("contract")[1])


def _copy(spec, *names):
    return {n: np.array(spec.tensors[n]) for n in names}


# -- structure ---------------------------------------------------------------------------

def test_identical_candidate_passes_and_lists_missing(spec):
    cand = _copy(spec, "output", "lse", "grad_q", "grad_k", "grad_v", "grad_bias", "head_map")
    r = compare(cand, spec)
    assert r.passed and r.precision == "float64" and r.first_failure is None
    assert "probs" in r.missing and "output" not in r.missing
    assert all(t.max_abs_error == 0 for t in r.tensors)
    assert all(t.margin < 0 for t in r.tensors if t.rule == "float64")
    assert r["head_map"].rule == "exact"
    assert r.format().endswith("PASS")


def test_unexpected_name_and_shape_mismatch_fail(spec):
    r = compare({"outptu": spec.tensors["output"]}, spec)
    assert not r.passed and "unexpected tensor" in r["outptu"].reason
    r = compare({"output": spec.tensors["output"][..., :-1]}, spec)
    assert not r.passed and "shape" in r["output"].reason


def test_boolean_tensors_must_match_exactly(masked_spec):
    vis = np.array(masked_spec.tensors["visible"])
    vis[0, 0, 0, 2] = True
    r = compare({"visible": vis}, masked_spec)
    assert not r.passed and r["visible"].rule == "exact"
    assert r["visible"].worst_index == (0, 0, 0, 2)
    r = compare({"visible": vis.astype(np.float64)}, masked_spec)
    assert not r.passed and "dtype" in r["visible"].reason


def test_nonfinite_positions_must_match(masked_spec):
    ms = np.array(masked_spec.tensors["masked_scores"])
    assert np.isneginf(ms[0, 0, 0, 2])
    moved = ms.copy()
    moved[0, 0, 0, 2] = 0.0  # a masked edge that came back
    r = compare({"masked_scores": moved}, masked_spec)
    assert not r.passed and r["masked_scores"].nonfinite_mismatches == 1
    nan = np.array(masked_spec.tensors["output"])
    nan[0, 0, 1, 1] = np.nan
    r = compare({"output": nan}, masked_spec)
    assert not r.passed and r["output"].nan_mismatches == 1
    assert "(0, 0, 1, 1)" in r["output"].reason
    # the -inf positions themselves are not numeric errors
    assert compare({"masked_scores": ms}, masked_spec).passed


# -- float64 rule ------------------------------------------------------------------------

def test_float64_rule_boundary_per_element(spec):
    tol = Tolerances()
    g = spec.tensors["grad_q"]
    idx = (1, 2, 0, 3)
    allowed = tol.atol + tol.rtol * abs(g[idx])
    inside, outside = np.array(g), np.array(g)
    inside[idx] += 0.5 * allowed
    outside[idx] += 2.0 * allowed
    assert compare({"grad_q": inside}, spec).passed
    r = compare({"grad_q": outside}, spec)
    row = r["grad_q"]
    assert not r.passed and row.failing_count == 1 and row.worst_index == idx
    assert row.worst_candidate == outside[idx] and row.worst_golden == g[idx]
    assert row.margin == pytest.approx(allowed, rel=1e-6)
    assert row.failing_percent == pytest.approx(100.0 / g.size)
    assert row.top_relative[0].index == idx


def test_first_failure_follows_trace_order(spec):
    cand = _copy(spec, "grad_k", "output", "probs")
    cand["grad_k"][0, 0, 0, 0] += 1.0
    cand["output"][0, 0, 0, 0] += 1.0
    r = compare(cand, spec)
    assert [t.name for t in r.tensors] == ["probs", "output", "grad_k"]
    assert r.first_failure == "output"
    assert "first failing stage output" in r.format()


def test_float64_overrides(spec):
    g = np.array(spec.tensors["lse"])
    g[0, 0, 0] += 1e-6
    assert not compare({"lse": g}, spec).passed
    tol = Tolerances(float64_overrides={"lse": (1e-5, 0.0)})
    assert compare({"lse": g}, spec, tolerances=tol).passed


# -- reference-relative rule -------------------------------------------------------------

@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16"])
def test_naive_lowp_is_representable_and_close(spec, name):
    dtype = resolve_dtype(name)
    lp = naive_lowp(spec, dtype)
    eps = float(np.finfo(np.float32).eps) if name == "float32" else (
        float(ml_dtypes.finfo(dtype).eps))
    for tensor in ("output", "lse", "grad_q", "grad_k", "grad_v", "grad_bias", "probs"):
        x = lp[tensor]
        assert np.array_equal(x.astype(dtype).astype(np.float64), x), tensor
        g = spec.tensors[tensor]
        err = np.abs(x - g).max()
        assert 0 < err < 200 * eps * max(1.0, np.abs(g).max()), (tensor, err)


def _ref_error(spec, dtype, name, routes=("stored_probs", "lse_recompute")):
    g = spec.tensors[name]
    return max(np.abs(naive_lowp(spec, dtype, route=r)[name] - g).max() for r in routes)


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
@pytest.mark.parametrize("route", ["stored_probs", "lse_recompute"])
def test_naive_candidate_passes_and_sets_the_yardstick(spec, name, route):
    dtype = resolve_dtype(name)
    lp = naive_lowp(spec, dtype, route=route)
    cand = {n: lp[n].astype(dtype) for n in ("output", "lse", "grad_q", "grad_bias")}
    r = compare(cand, spec)
    assert r.precision == name and r.passed
    for row in r.tensors:
        assert row.rule == "reference_relative" and row.ratio <= 1.0
        assert row.reference_error == _ref_error(spec, dtype, row.name)
    # forward tensors are the same on both routes; restricted to its own route, ratio is 1
    assert r["output"].ratio == 1.0 and r["lse"].ratio == 1.0
    own = compare(cand, spec, tolerances=Tolerances(naive_routes=(route,)))
    assert all(row.ratio == pytest.approx(1.0) for row in own.tensors)


def test_lse_recompute_route_models_a_flash_style_backward(spec):
    f32 = np.dtype(np.float32)
    stored = naive_lowp(spec, f32)
    rec = naive_lowp(spec, f32, route="lse_recompute")
    for name in ("scores", "masked_scores", "row_max", "lse", "probs", "consumed", "output"):
        assert np.array_equal(stored[name], rec[name], equal_nan=True), name
    # D comes from the output contraction on the recompute route
    assert np.array_equal(rec["row_dot"], rec["row_dot_output"])
    assert not np.array_equal(stored["grad_q"], rec["grad_q"])
    with pytest.raises(RefAttnError, match="route"):
        naive_lowp(spec, f32, route="flash")
    with pytest.raises(RefAttnError, match="naive_routes"):
        Tolerances(naive_routes=())


def _floor(spec, name, dtype):
    """The rule's floor from first principles: the rounding floor, or 8 unit roundoffs of
    the natural magnitude, computed here from a dense numpy trace of the call."""
    trace = refattn.forward(spec.to_call(), backend="numpy")
    grads = refattn.backward(trace, spec.tensors["grad_output"])
    natural = natural_scales(spec.to_call(), trace, grads)[name]
    u = float(np.finfo(dtype).eps) / 2
    return max(rounding_floor(spec.tensors[name], dtype), 8 * u * natural)


def test_reference_relative_bound_is_k_times_reference_plus_floor(spec):
    dtype = np.dtype(np.float32)
    g = spec.tensors["output"]
    ref = _ref_error(spec, dtype, "output")
    floor = _floor(spec, "output", dtype)
    bound = 2 * ref + floor
    idx = (0, 1, 2, 0)
    for factor, ok in ((0.9, True), (1.1, False)):
        cand = np.array(g)
        cand[idx] += factor * bound
        r = compare({"output": cand}, spec, dtype="float32")
        assert r.passed is ok
        assert r["output"].bound == pytest.approx(bound, rel=1e-12)
        assert r["output"].reference_error == pytest.approx(ref, rel=1e-12)
    # gradients get k = 3
    gq = spec.tensors["grad_q"]
    bound_q = 3 * _ref_error(spec, dtype, "grad_q") + _floor(spec, "grad_q", dtype)
    r = compare({"grad_q": gq + 0.9 * bound_q}, spec, dtype="float32")
    assert r.passed and r["grad_q"].bound == pytest.approx(bound_q, rel=1e-12)
    r = compare({"grad_q": gq + 0.9 * bound_q}, spec, dtype="float32",
                tolerances=Tolerances(k_gradient=1.0))
    assert not r.passed
    # without the natural floor: the rounding floor alone, as FlashAttention's tests have it
    r = compare({"output": g}, spec, dtype="float32", tolerances=Tolerances(natural_floor=0))
    assert r["output"].bound == pytest.approx(2 * ref + rounding_floor(g, dtype), rel=1e-12)


def test_bfloat16_candidate_that_lost_a_scale_fails(spec):
    # the classic bug: scale applied twice; visible in bfloat16 too
    from refattn import AttentionCall, forward

    call = spec.to_call()
    wrong = forward(AttentionCall(call.q, call.k, call.v, bias=call.bias,
                                  scale=call.scale ** 2)).output
    r = compare({"output": wrong.astype(BF16)}, spec)
    assert r.precision == "bfloat16" and not r.passed
    assert r["output"].ratio > 2


def test_rounding_floor_matches_its_definition():
    g = np.array([0.1, -0.7, 3.0])
    for name in ("float32", "float16", "bfloat16"):
        dtype = resolve_dtype(name)
        x = g.astype(dtype)
        y = (x + dtype.type(0.3)) - dtype.type(0.3)
        realized = np.abs(y.astype(np.float64) - g).max()
        assert rounding_floor(g, dtype, mode="realized") == 2 * realized > 0
        # the default never goes below one ulp of max|g| + 0.3 = 3.3, nor below the literal
        spacing = {"float32": 2.0 ** -22, "float16": 2.0 ** -9, "bfloat16": 2.0 ** -6}[name]
        assert rounding_floor(g, dtype) == 2 * max(realized, spacing)
    assert rounding_floor(np.zeros(4), resolve_dtype("float16"), mode="realized") == 0.0
    assert rounding_floor(np.zeros(4), resolve_dtype("float16")) == 2 * 2.0 ** -12


def test_precision_inference_and_errors(spec):
    out = spec.tensors["output"]
    with pytest.raises(RefAttnError, match="mixes floating dtypes"):
        compare({"output": out.astype(np.float32), "lse": spec.tensors["lse"]}, spec)
    assert compare({"output": out.astype(np.float32), "lse": spec.tensors["lse"]}, spec,
                   dtype="float32").precision == "float32"
    with pytest.raises(RefAttnError, match="must carry its manifest"):
        compare({"output": out.astype(np.float32)}, dict(spec.tensors))
    assert compare({"output": out}, dict(spec.tensors)).passed
    with pytest.raises(RefAttnError, match="dtype"):
        compare({"output": out}, spec, dtype="int8")


# -- files and the command ----------------------------------------------------------------

def test_candidate_files_round_trip_bfloat16(tmp_path):
    x = np.linspace(-2, 2, 12).reshape(3, 4).astype(BF16)
    p = write_candidate(tmp_path / "c.safetensors", {"output": x, "visible": x > 0})
    back = read_candidate(p)
    assert back["output"].dtype == BF16 and np.array_equal(back["output"], x)
    assert back["visible"].dtype == np.bool_
    data = p.read_bytes()
    (tmp_path / "t.safetensors").write_bytes(data[:-3])
    with pytest.raises(RefAttnError, match="truncated"):
        read_candidate(tmp_path / "t.safetensors")


def test_compare_command(tmp_path, capsys):
    write_bundle(tmp_path / "b", build_suite("contract")[:2], suite="contract")
    case = tmp_path / "b" / "cases" / "loop7_cross_attention_padded_source.safetensors"
    gold = load(case).tensors
    grads = ("grad_q", "grad_k", "grad_v", "grad_bias")  # every input gradient of the case
    good = write_candidate(tmp_path / "good.safetensors",
                           {n: gold[n].astype(BF16) for n in ("output", *grads)})
    assert main(["compare", str(case), str(good)]) == 0
    assert "precision bfloat16" in capsys.readouterr().out
    bad_out = np.array(gold["output"])
    bad_out[0, 0, 1, 1] += 1e-6
    bad = write_candidate(tmp_path / "bad.safetensors", {"output": bad_out})
    assert main(["compare", str(tmp_path / "b"), str(bad), "--case",
                 "loop7_cross_attention_padded_source"]) == 1
    out = capsys.readouterr().out
    assert "FAIL output" in out and "(0, 0, 1, 1)" in out
    assert main(["compare", str(case), str(bad), "--atol", "1e-5"]) == 0
    # a bundle written by a future major schema version is refused (exit 2, one line)
    mpath = tmp_path / "b" / "manifest.json"
    manifest = json.loads(mpath.read_text())
    manifest["schema_version"] = "2.0"
    mpath.write_text(json.dumps(manifest))
    assert main(["compare", str(case), str(good)]) == 2
    assert "schema_version '2.0'" in capsys.readouterr().err


def test_candidates_through_dlpack_and_array_protocols(spec):
    class OnlyDLPack:
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    class OnlyArray:
        def __init__(self, a):
            self.a = a

        def __array__(self, dtype=None, copy=None):
            return self.a

    out = spec.tensors["output"]
    assert compare({"output": OnlyDLPack(np.array(out))}, spec).passed
    assert compare({"output": OnlyArray(np.array(out))}, spec).passed
    bad = np.array(out)
    bad[0, 0, 0, 0] += 1.0
    assert not compare({"output": OnlyDLPack(bad)}, spec).passed


def test_core_and_adapters_import_no_optional_stack():
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, refattn, refattn.bundle.comparison.harness, "
        "refattn.bundle.verification.verifier, refattn.bundle.comparison.lowp, "
        "refattn.adapters, refattn.adapters.torch, refattn.adapters.jax, "
        "refattn.bundle.suites.conformance, refattn.cli; refattn.cli.build_parser(); "
        "print(sorted(m for m in ('torch', 'jax', 'ml_dtypes') if m in sys.modules))"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, check=True, env={"PYTHONPATH": str(root), "PATH": ""})
    assert out.stdout.strip() == "[]"
