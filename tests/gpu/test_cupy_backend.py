"""The "cupy" backend: a clear error without CuPy or a device; on a GPU, the conformance suite
against the reference (the same checks as the emulator's, same tolerance)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import refattn
from refattn.bundle.suites import build_suite
from tests.gpu.test_emulator import DOT_CASES, assert_matches_reference


def test_without_cupy_the_error_says_what_to_install(monkeypatch):
    from gpu_backend import cupy_backend

    monkeypatch.setitem(sys.modules, "cupy", None)  # import fails
    cupy_backend.device.cache_clear()
    x = np.ones((1, 1, 2, 4))
    with pytest.raises(refattn.RefAttnError, match=r"cupy-cuda13x.*cuda_emulator"):
        refattn.forward(refattn.AttentionCall(x, x, x), backend="cupy")
    cupy_backend.device.cache_clear()


def _gpu() -> None:
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("no CUDA device")
    except Exception as exc:  # no driver
        pytest.skip(f"no CUDA device ({exc})")


@pytest.mark.gpu
@pytest.mark.parametrize("materialize", [True, False], ids=["trace", "streaming"])
def test_the_conformance_suite_on_the_gpu(materialize):
    _gpu()
    for case_id, case in sorted(DOT_CASES.items()):
        t = refattn.forward(case.call, backend="cupy", materialize=materialize)
        g = refattn.backward(t, case.grad_output)
        assert_matches_reference(case.call, case.grad_output, t, g, case_id)
        again = refattn.backward(refattn.forward(case.call, backend="cupy",
                                                 materialize=materialize), case.grad_output)
        assert all(np.array_equal(a, b) for a, b in zip(g.tensors().values(),
                                                        again.tensors().values(), strict=True))


@pytest.mark.gpu
def test_non_dot_families_are_refused_on_the_gpu():
    _gpu()
    case = next(c for c in build_suite("conformance") if c.call.score.name != "dot")
    with pytest.raises(refattn.RefAttnError, match="dot family only"):
        refattn.forward(case.call, backend="cupy")
