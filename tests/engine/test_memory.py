"""A dense call that needs more memory than there is is refused at once with the bytes it
would need, pointing at the streaming backend (issue 16, item 4)."""

from __future__ import annotations

import numpy as np
import pytest

import refattn
from refattn import RefAttnError
from refattn.engine import memory


def _call(Q=512, K=512, D=8, **kw):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, Q, D))
    k = rng.standard_normal((1, 2, K, D))
    return refattn.AttentionCall(q, k, k, **kw)


def test_the_estimate_counts_the_dense_arrays_it_will_hold():
    call = _call(Q=100, K=300)
    n = 1 * 2 * 100 * 300
    rows = 1 * 2 * (300 * 16 + 100 * 16)
    assert memory.dense_bytes(call, "forward") == 8 * (3 * n + rows)  # scores, probs, temp
    with_bias = _call(Q=100, K=300, bias=np.zeros((100, 300)))
    assert memory.dense_bytes(with_bias, "forward") == 8 * (4 * n + rows)
    assert memory.dense_bytes(call, "backward") == 8 * (3 * n + 2 * rows)


def test_max_bytes_refuses_before_allocating_and_names_the_bytes(monkeypatch):
    call = _call()
    need = memory.dense_bytes(call, "forward")
    allocated = []
    monkeypatch.setattr("refattn.engine.reference.forward_arrays",
                        lambda *a, **k: allocated.append(1))
    with pytest.raises(RefAttnError) as info:
        refattn.forward(call, max_bytes=need - 1)
    msg = str(info.value)
    assert f"needs about {need} bytes" in msg and f"max_bytes={need - 1}" in msg
    assert 'backend="numba", materialize=False' in msg
    assert not allocated


def test_available_memory_is_the_default_limit(monkeypatch):
    call = _call()
    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)
    with pytest.raises(RefAttnError, match="more than the 1000 bytes of memory available"):
        refattn.forward(call)
    monkeypatch.setattr(memory, "available_bytes", lambda: None)  # unknown: no refusal
    assert refattn.forward(call).output.shape == (1, 2, 512, 8)


def test_the_backward_is_checked_too(monkeypatch):
    call = _call(Q=64, K=64)
    trace = refattn.forward(call)
    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)
    with pytest.raises(RefAttnError, match="dense numpy backward"):
        refattn.backward(trace, np.ones((1, 2, 64, 8)))


def test_numba_dense_is_checked_and_streaming_is_the_way_out(monkeypatch):
    pytest.importorskip("numba")
    call = _call(Q=64, K=64)
    with pytest.raises(RefAttnError, match="dense numba forward"):
        refattn.forward(call, backend="numba", max_bytes=1000)
    monkeypatch.setattr(memory, "available_bytes", lambda: 1000)
    t = refattn.forward(call, backend="numba", materialize=False)  # holds no (Q, K) tensor
    monkeypatch.undo()
    np.testing.assert_allclose(t.output, refattn.forward(call).output, rtol=1e-12, atol=1e-14)
    assert t.probs is None


def test_available_bytes_reads_meminfo_or_falls_back(monkeypatch, tmp_path):
    import builtins

    real_open = builtins.open

    def no_proc(path, *a, **k):
        if str(path) == "/proc/meminfo":
            raise OSError("no /proc here")
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", no_proc)
    n = memory.available_bytes()
    assert n is None or n > 0


def test_max_bytes_must_be_a_non_negative_int():
    with pytest.raises(RefAttnError, match="max_bytes: expected a non-negative int"):
        refattn.forward(_call(Q=4, K=4), max_bytes=-1)


def test_the_numba_streaming_backward_is_checked_before_it_allocates(monkeypatch):
    """Its per-query-head dK/dV partials are Hq / Hkv times the keys' size: a 128:1 MLA call
    once ran out of memory instead of being refused; the estimate names the fused way out."""
    pytest.importorskip("numba")
    import refattn._memory as shared

    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 8, 4, 16))
    k = rng.standard_normal((1, 1, 96, 16))
    call = refattn.AttentionCall(q, k, k[..., :8].copy())
    trace = refattn.forward(call, backend="numba", materialize=False)
    g = rng.standard_normal((1, 8, 4, 8))
    partials = 8 * 8 * 96 * (16 + 8)  # the (B, Hq, K, Dk + Dv) partials alone
    monkeypatch.setattr(shared, "available_bytes", lambda: partials)
    with pytest.raises(RefAttnError, match=r"streaming backward's per-query-head dK/dV "
                                           r"partials over \(B, Hq, K\) = \(1, 8, 96\).*"
                                           r"value_and_grad"):
        refattn.backward(trace, g)
    monkeypatch.setattr(shared, "available_bytes", lambda: 100 * partials)  # honest: it fits
    grads = refattn.backward(trace, g)
    ref = refattn.backward(refattn.forward(call), g)
    np.testing.assert_allclose(grads.grad_k, ref.grad_k, rtol=1e-10, atol=1e-12)
