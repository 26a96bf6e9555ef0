"""The numba backend's value_and_grad (the fused kernel) against the NumPy reference.

Dot-family tensors are compared by their natural magnitude (tests/engine_compare.py) with
rtol 1e-12; the bilinear and cosine families, which run the same kernel on transformed
operands, per tensor with a normwise relative tolerance of 1e-12 (floored by the largest
magnitude of the tensor's terms).
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import refattn
from refattn.bundle.suites import build_suite
from refattn.engine.numba import calibration, fused_host, providers
from refattn.masks import causal
from tests.engine_compare import assert_close, natural_scales
from tests.strategies import engine_calls

RTOL = 1e-12
CASES = {c.case_id: c for c in build_suite("conformance")}
#: every provider of this process in both thread layouts
PROVIDERS = [p.with_layout(layout) for p in providers.available_providers()
             for layout in providers.LAYOUTS]
PROVIDER = PROVIDERS[0]


def assert_matches_reference(call, g_o, out, grads, what=""):
    ref = refattn.forward(call)
    rg = refattn.backward(ref, g_o)
    if call.score.name == "dot":
        scales = natural_scales(call, ref, rg)
        assert_close(f"{what} output", out, ref.output, scales["output"], RTOL)
    else:
        np.testing.assert_allclose(out, ref.output, rtol=RTOL, atol=RTOL * np.abs(
            ref.output).max(), err_msg=what)
    for name, value in grads.tensors().items():
        want = rg.tensors()[name]
        assert value.shape == want.shape, (what, name)
        if call.score.name == "dot" and name in scales:
            assert_close(f"{what} {name}", value, want, scales[name], RTOL, zeros=False)
        else:
            floor = RTOL * max(np.abs(want).max(), np.abs(value).max(), 1e-300)
            assert np.linalg.norm(value - want) <= RTOL * np.linalg.norm(want) + floor * \
                np.sqrt(want.size), (what, name)


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_conformance_case(case_id):
    case = CASES[case_id]
    out, grads = refattn.value_and_grad(case.call, case.grad_output, backend="numba")
    assert_matches_reference(case.call, case.grad_output, out, grads, case_id)


@st.composite
def fused_calls(draw):
    call = draw(engine_calls(max_len=40, max_width=6))
    extra = {}
    if draw(st.booleans()):
        extra["softcap"] = draw(st.sampled_from([0.7, 4.0]))
    if draw(st.booleans()):
        extra["sink"] = np.linspace(-0.5, 1.5, call.q.shape[1])
    placement = draw(st.sampled_from(["post", "q", "k", "split"]))
    if placement != "post":
        extra["scale_placement"] = placement
    return dataclasses.replace(call, **extra) if extra else call


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=fused_calls(), budget=st.sampled_from([None, 1 << 10]),
       provider=st.sampled_from(PROVIDERS))
def test_generated_calls(call, budget, provider):
    g_o = np.random.default_rng(2).standard_normal((*call.q.shape[:3], call.v.shape[3]))
    out, grads, info = fused_host.value_and_grad(call, g_o, provider=provider, budget=budget)
    assert_matches_reference(call, g_o, out, grads)
    if budget is not None:  # the whole head where it fits the budget, else 32 rows (Q <= 40)
        Q, K = call.q.shape[2], call.k.shape[2]
        fits = 8 * (3 if call.softcap is not None else 2) * K * Q <= budget
        want = Q if fits else min(32, Q)
        groups = call.q.shape[0] * call.k.shape[1]
        if fits and provider.layout == "heads" and groups < info["threads"]:
            # fewer (batch, kv head) groups than threads: the head is cut into query chunks,
            # blocks of ceil(Q / chunks) rows rounded up to a multiple of 32 (Q = 33 on 2
            # threads: 32 rows, as hypothesis found)
            chunks = math.ceil(info["threads"] / groups)
            want = min(Q, max(32, math.ceil(math.ceil(Q / chunks) / 32) * 32))
        assert info["block_q"] == want


def test_small_blocks_and_chunks_are_bit_identical_run_to_run():
    rng = np.random.default_rng(3)
    q, k, v, g = (rng.standard_normal((1, 2, 100, 8)) for _ in range(4))
    call = refattn.AttentionCall(q, k, v, bias=rng.standard_normal((1, 2, 1, 100)))
    runs = [fused_host.value_and_grad(call, g, provider=PROVIDER, budget=1 << 10) for _ in range(2)]
    assert runs[0][2]["block_q"] == 32 and runs[0][2]["chunks"] >= 1
    assert np.array_equal(runs[0][0], runs[1][0])
    for name, value in runs[0][1].tensors().items():
        assert np.array_equal(value, runs[1][1].tensors()[name]), name
    assert_matches_reference(call, g, runs[0][0], runs[0][1])


@pytest.mark.parametrize("feature", ["plain", "causal", "bias", "dropout", "softcap_sink"])
def test_thin_products_in_small_tiles_match_the_reference(monkeypatch, feature):
    """O, dV, dQ and dK issued in tiles smaller than the block and the key range (as OpenBLAS's
    small-matrix kernels get them at attention shapes) keep parity with the reference."""
    monkeypatch.setattr(fused_host, "SMALL_GEMM", 3072)
    monkeypatch.setattr(fused_host, "NN_ROWS", 16)
    monkeypatch.setattr(fused_host, "TN_INNER", 8)
    rng = np.random.default_rng(7)
    q, g = (rng.standard_normal((1, 2, 70, 8)) for _ in range(2))
    k, v = (rng.standard_normal((1, 2, 90, 8)) for _ in range(2))
    extra = {"plain": {}, "causal": {"visible": causal(70, 90, alignment="upper_left")},
             "bias": {"bias": rng.standard_normal((70, 90))},
             "dropout": {"dropout": refattn.dropout.Philox(0.25, seed=5)},
             "softcap_sink": {"softcap": 3.0, "sink": np.array([0.3, -0.2])}}[feature]
    call = refattn.AttentionCall(q, k, v, **extra)
    openblas = providers.available_providers()[0]  # as if on an AVX-512 kernel
    # 1 KiB of V or K rows: 16 rows of D = 8 per O/dQ tile
    provider = providers.Provider("openblas", "0.3 SkylakeX", "heads", tile_kib=1,
                                  load=openblas.load)
    out, grads, info = fused_host.value_and_grad(call, g, provider=provider,
                                                 budget=32 * 90 * 8 * 3)
    # 3072 // (16 x 8) = 24 keys would fit an O/dQ tile of 16 rows, tile_kib allows 16;
    # 3072 // (8 x 8) = 48 keys per dV/dK tile of 8 inner rows (a multiple of 16); blocks of
    # 32 query rows
    assert info["split_tiles"] == [16, 16, 48, 8] * 2 and info["block_q"] == 32
    assert_matches_reference(call, g, out, grads, feature)


def test_invisible_key_chunks_are_skipped():
    rng = np.random.default_rng(4)
    q, k, v, g = (rng.standard_normal((1, 1, 1024, 8)) for _ in range(4))
    call = refattn.AttentionCall(q, k, v, visible=causal(1024, 1024, alignment="upper_left"))
    out, grads, info = fused_host.value_and_grad(call, g, provider=PROVIDER,
                                                 budget=256 * 1024 * 2 * 8)
    # 4 query blocks of 256 rows x 4 key chunks of 256: the 6 above the diagonal are skipped
    assert (info["key_chunks_computed"], info["key_chunks_skipped"]) == (10, 6)
    assert_matches_reference(call, g, out, grads)


def test_the_additive_family_falls_back_to_the_reference():
    case = CASES["score_additive"]
    out, grads = refattn.value_and_grad(case.call, case.grad_output, backend="numba")
    trace = refattn.forward(case.call)
    ref = refattn.backward(trace, case.grad_output)
    np.testing.assert_array_equal(out, trace.output)  # the reference itself
    for name, value in ref.tensors().items():
        np.testing.assert_array_equal(grads.tensors()[name], value)


def test_calibration_records_every_candidate_and_is_used(tmp_path, monkeypatch):
    monkeypatch.setenv("REFATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("REFATTN_BLAS_PROVIDER", raising=False)
    record = calibration.calibrate(shapes=((1, 2, 64, 64, 8),), repeats=1)
    names = {p.name for p in providers.available_providers()}
    assert "openblas" in names
    tiled = sum(p.with_layout("heads").small_tiles for p in providers.available_providers())
    assert len(record["seconds"]) == len(calibration.BUDGETS_MIB) * (
        len(names) * len(providers.LAYOUTS) + tiled * (len(providers.TILE_KIB) - 1))
    saved = json.loads(calibration.calibration_path().read_text())
    assert saved["choice"] == record["choice"] and saved["fingerprint"] == providers.fingerprint()
    assert calibration.current_provider().key == record["choice"]
    calibration.current_provider.cache_clear()


def test_calibration_keeps_the_records_of_other_fingerprints(tmp_path, monkeypatch):
    """Another environment on the same machine (another provider list, OPENBLAS_CORETYPE)
    calibrates under its own fingerprint without discarding this one's."""
    monkeypatch.setenv("REFATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("REFATTN_BLAS_PROVIDER", raising=False)
    first = calibration.calibrate(shapes=((1, 2, 64, 64, 8),), repeats=1)
    other = {**providers.fingerprint(), "openblas_coretype": "SomeOtherCore"}
    monkeypatch.setattr(calibration, "fingerprint", lambda: other)
    second = calibration.calibrate(shapes=((1, 2, 64, 64, 8),), repeats=1)
    saved = json.loads(calibration.calibration_path().read_text())
    assert saved["fingerprint"] == other and saved["choice"] == second["choice"]
    assert [r["fingerprint"] for r in saved["others"]] == [first["fingerprint"]]
    monkeypatch.setattr(calibration, "fingerprint", providers.fingerprint)
    calibration.current_provider.cache_clear()
    assert calibration.current_provider().key == first["choice"]  # no recalibration
    assert json.loads(calibration.calibration_path().read_text()) == saved
    calibration.current_provider.cache_clear()


def test_the_provider_override_and_its_errors(monkeypatch):
    monkeypatch.setenv("REFATTN_BLAS_PROVIDER", "openblas/blas/4")
    calibration.current_provider.cache_clear()
    p = calibration.current_provider()
    assert (p.name, p.layout, p.budget) == ("openblas", "blas", 4 << 20)
    monkeypatch.setenv("REFATTN_BLAS_PROVIDER", "openblas/heads/16/96")
    calibration.current_provider.cache_clear()
    p = calibration.current_provider()
    assert (p.layout, p.budget, p.tile_kib) == ("heads", 16 << 20, 96)
    for bad, message in (("nope", "not available"), ("openblas/sideways", "layout"),
                         ("openblas/heads/x", "budget"), ("openblas/heads/0", "budget"),
                         ("openblas/heads/8/-4", "tile"), ("openblas/heads/8/24/1", "four")):
        monkeypatch.setenv("REFATTN_BLAS_PROVIDER", bad)
        calibration.current_provider.cache_clear()
        with pytest.raises(refattn.RefAttnError, match=message):
            calibration.current_provider()
    calibration.current_provider.cache_clear()


@pytest.mark.parametrize("layout", providers.LAYOUTS)
def test_one_layer_of_threads_at_a_time(layout):
    """heads: numba's threads, each BLAS on one thread; blas: one numba thread, BLAS threaded."""
    import numba
    from threadpoolctl import threadpool_info

    x = np.zeros((1, 2, 256, 8))
    provider = PROVIDER.with_layout(layout)
    lay = fused_host.task_layout(refattn.AttentionCall(x, x, x), provider, provider.budget)
    outside = numba.get_num_threads()
    with fused_host.running(lay, provider):
        blas = {i["filepath"]: i["num_threads"] for i in threadpool_info()
                if i["user_api"] == "blas"}
        inside = numba.get_num_threads()
    assert numba.get_num_threads() == outside  # restored
    if layout == "heads":
        assert inside == outside and set(blas.values()) == {1}
    else:
        assert inside == 1 and lay.blas_threads == outside


def test_long_key_rows_stream_and_match_the_reference(monkeypatch):
    from refattn.engine.numba import backend

    monkeypatch.setattr(backend, "STREAM_KEYS_AT_D64", 64)  # K = 48 at D = 4 is "long"

    def not_fused(*args, **kwargs):
        raise AssertionError("the fused kernel ran")

    monkeypatch.setattr(fused_host, "value_and_grad", not_fused)
    rng = np.random.default_rng(8)
    q, k, v, g = (rng.standard_normal((1, 2, 48, 4)) for _ in range(4))
    call = refattn.AttentionCall(q, k, v, bias=rng.standard_normal((1, 2, 48, 48)),
                                 visible=causal(48, 48, alignment="lower_right"))
    out, grads = refattn.value_and_grad(call, g, backend="numba")
    assert_matches_reference(call, g, out, grads)
    assert grads.grad_bias is not None
    # a call the streaming kernels do not run stays on the fused kernel
    capped = dataclasses.replace(call, softcap=3.0)
    with pytest.raises(AssertionError, match="the fused kernel ran"):
        refattn.value_and_grad(capped, g, backend="numba")
