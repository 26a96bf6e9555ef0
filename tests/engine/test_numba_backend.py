"""The numba backend against the NumPy reference: golden suites and generated calls.

Exactness is measured against each tensor's natural magnitude (tests/engine_compare.py):
``max|numba - reference| <= rtol * natural`` with rtol = 1e-13 (dense) and 1e-12 (streaming).
Streaming uses ``D = sum(G_O * O)``, known before any tile (the reference uses ``sum(P * G_P)``),
so a gradient that is exactly 0 in the reference because of that identity (a row with one legal
key) is 0 in streaming only to rounding, inside the tolerance.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import refattn
from refattn.bundle.suites import SUITES, build_suite, default_generator
from refattn.engine.numba import backend as numba_backend
from tests.engine_compare import (
    DENSE_RTOL,
    STREAM_RTOL,
    STRUCTURAL_ZEROS,
    assert_close,
    natural_scales,
)
from tests.strategies import engine_calls


def compare(call, grad_output, *, materialize: bool, **options) -> None:
    ref = refattn.forward(call)
    rgrad = refattn.backward(ref, grad_output)
    got = refattn.forward(call, backend="numba", materialize=materialize, **options)
    ggrad = refattn.backward(got, grad_output)
    scales = natural_scales(call, ref, rgrad)
    rtol = DENSE_RTOL if materialize else STREAM_RTOL
    assert got.backend == "numba"
    np.testing.assert_array_equal(got.sanitized_rows, ref.sanitized_rows)
    for name in ("scores", "biased_scores", "masked_scores", "row_max", "lse", "probs",
                 "dropout_multiplier", "consumed", "output"):
        value = getattr(got, name)
        if materialize or name in ("row_max", "lse", "output"):
            assert_close(name, value, getattr(ref, name), scales[name], rtol,
                         zeros=name in STRUCTURAL_ZEROS)
        else:
            assert value is None, name
    for name in ("grad_v", "grad_consumed", "grad_probs", "row_dot", "row_dot_output",
                 "grad_scores", "grad_q", "grad_k", "grad_bias"):
        value, want = getattr(ggrad, name), getattr(rgrad, name)
        if want is None or (not materialize and name in ("grad_consumed", "grad_probs",
                                                           "grad_scores")):
            assert value is None, name
            continue
        assert value.shape == want.shape, name
        zeros = name in STRUCTURAL_ZEROS
        if name == "grad_scores":  # p (G_P - D) is 0 wherever p is; a zero elsewhere is a
            zeros = ref.probs == 0.0  # cancellation that the summation order decides
        assert_close(name, value, want, scales[name], rtol, zeros=zeros)


def _cases():
    """Every case of the miniature suites (the kernel suite's 304 run on the numba generator,
    tests/bundle/test_numba_generator.py, and against SDPA and a tiled kernel)."""
    out = []
    for suite in sorted(s for s in SUITES if default_generator(s) == "exact"):
        out += [pytest.param(case, id=f"{suite}/{case.case_id}") for case in build_suite(suite)]
    return out


def _supported(call) -> bool:
    return (getattr(call.score, "name", "dot") == "dot" and call.scale_placement == "post"
            and call.softcap is None and call.sink is None)


@pytest.mark.parametrize("case", _cases())
def test_golden_case_dense_and_streaming(case):
    if not _supported(case.call):
        with pytest.raises(refattn.RefAttnError, match="numba backend"):
            refattn.forward(case.call, backend="numba")
        with pytest.raises(refattn.RefAttnError, match="numba backend"):
            refattn.forward(case.call, backend="numba", materialize=False)
        return
    compare(case.call, case.grad_output, materialize=True)
    if case.call.returned_weights != "none":  # weights exist only in the dense trace
        with pytest.raises(refattn.RefAttnError, match=r"returned_weights.*materialize=True"):
            refattn.forward(case.call, backend="numba", materialize=False)
        return
    K = case.call.score_shape[3]
    Q = case.call.score_shape[2]
    # tiles smaller than the call so that online rescaling and tile skipping are exercised
    compare(case.call, case.grad_output, materialize=False, block_q=max(1, Q // 3),
            block_k=max(1, K // 3))
    compare(case.call, case.grad_output, materialize=False)


_SETTINGS = settings(max_examples=60, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(call=engine_calls(), seed=st.integers(0, 2**32 - 1))
def test_generated_calls_dense(call, seed):
    g = np.random.default_rng(seed).standard_normal((*call.q.shape[:3], call.v.shape[3]))
    compare(call, g, materialize=True)


@_SETTINGS
@given(call=engine_calls(), seed=st.integers(0, 2**32 - 1), block_q=st.integers(1, 7),
       block_k=st.integers(1, 9), sub=st.sampled_from([1, 2, 3, 1000]))
def test_generated_calls_streaming(call, seed, block_q, block_k, sub):
    g = np.random.default_rng(seed).standard_normal((*call.q.shape[:3], call.v.shape[3]))
    # sub < tile: the (tile x D) products run as several sub-GEMMs, as at full size
    with mock.patch.object(numba_backend, "_sub_block", lambda call: sub):
        compare(call, g, materialize=False, block_q=block_q, block_k=block_k)
