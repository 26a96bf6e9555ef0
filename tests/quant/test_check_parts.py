"""refattn.quant.check's parts that need no pipeline: containment and the bf16 path."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from refattn import AttentionCall, forward
from refattn.masks import causal
from refattn.quant.check import bf16_path, contains
from refattn.quant.formats import quantize


def test_contains_ends_nan_and_infinities():
    lo = np.array([0.0, 0.0, 0.0, 0.0, np.nan, -np.inf, 1.0, -np.inf, 0.0, -np.inf, 0.0])
    hi = np.array([1.0, 1.0, 1.0, 1.0, np.nan, -np.inf, 2.0, np.inf, 1.0, np.inf, np.inf])
    x = np.array([0.0, 1.0, -0.25, 1.5, np.nan, -np.inf, np.nan, 5.0, np.inf, np.nan, np.nan])
    inside, dist = contains(lo, hi, x)
    # NaN: inside a NaN interval or the unbounded "no claim" [-inf, inf], nowhere else
    assert inside.tolist() == [True, True, False, False, True, True, False, True, False, True,
                               False]
    assert dist.tolist() == [0.0, 0.0, 0.25, 0.5, 0.0, 0.0, np.inf, 0.0, np.inf, 0.0, np.inf]
    # a finite value where the emulation is NaN is outside (the pipeline says NaN there)
    inside, dist = contains(np.array([np.nan]), np.array([np.nan]), np.array([1.0]))
    assert inside.tolist() == [False] and dist.tolist() == [np.inf]
    # the smallest distances are exact (a subnormal difference)
    tiny = np.nextafter(1.0, 2.0)
    inside, dist = contains(np.array([0.0]), np.array([1.0]), np.array([tiny]))
    assert not inside[0] and dist[0] == tiny - 1.0


def _result_for(call: AttentionCall, p_format: str) -> SimpleNamespace:
    # what bf16_path reads of a QuantResult: the real trace's call and the spec's P format
    return SimpleNamespace(real=forward(call), spec=SimpleNamespace(p_format=p_format))


def _bf16_torch(torch, q, k, v, scale, causal_mask, p8):
    """FA3's attention_ref(upcast=False, reorder_ops=True) in torch bf16 on the CPU."""
    t = [torch.from_numpy(x).to(torch.float32).to(torch.bfloat16) for x in (q, k, v)]
    qb, kb, vb = t
    group = qb.shape[1] // kb.shape[1]
    kb = kb.repeat_interleave(group, dim=1)
    vb = vb.repeat_interleave(group, dim=1)
    s = torch.einsum("bhqd,bhkd->bhqk", qb, kb * scale)
    if causal_mask is not None:
        s = s.masked_fill(~torch.from_numpy(causal_mask), float("-inf"))
    p = torch.softmax(s, dim=-1).to(torch.bfloat16)
    if p8:
        p = p.to(torch.float8_e4m3fn).to(torch.bfloat16)
    return torch.einsum("bhqk,bhkd->bhqd", p, vb).to(torch.float64).numpy()


@pytest.mark.parametrize("is_causal", [False, True])
def test_bf16_path_is_on_the_grid_and_close_to_torch(is_causal):
    rng = np.random.default_rng(0)
    B, Hq, Hkv, Q, K, D = 2, 4, 2, 5, 7, 16
    q = quantize(rng.standard_normal((B, Hq, Q, D)) * 2, "e4m3fn", "nearest_even_satfinite")
    k = quantize(rng.standard_normal((B, Hkv, K, D)) * 2, "e4m3fn", "nearest_even_satfinite")
    v = quantize(rng.standard_normal((B, Hkv, K, D)), "e4m3fn", "nearest_even_satfinite")
    vis = causal(Q, K, alignment="lower_right") if is_causal else None
    call = AttentionCall(q, k, v, visible=vis)
    res = _result_for(call, "e4m3fn")
    out = bf16_path(res)
    assert out.shape == (B, Hq, Q, D)
    assert np.array_equal(quantize(out, "bf16", "nearest_even"), out)  # bf16 values
    real = res.real.output
    err = np.abs(out - real).max()
    # the bf16 path errs (by the bf16 and e4m3 roundings of P) but not by more than P's
    # e4m3 rounding (relative 2**-4) and bf16 steps allow: a loose sanity bound
    assert 0 < err < 0.2 * np.abs(real).max()
    torch = pytest.importorskip("torch")
    mask = np.tril(np.ones((Q, K), dtype=bool), K - Q) if is_causal else None
    ref = _bf16_torch(torch, q, k, v, float(call.scale), mask, True)
    # torch rounds its fp32 sums to bf16 where the path rounds the exact sum once, and its
    # softmax differs in the last fp32 bits: at most a bf16 ulp apart where a rounding of the
    # two falls differently (none at these seeds: measured bit-identical)
    ulp = 2.0 ** (np.floor(np.log2(np.abs(real).max())) - 7)
    assert np.abs(out - ref).max() <= ulp
    assert np.mean(out != ref) <= 0.01


def test_bf16_path_without_fp8_p_is_closer():
    rng = np.random.default_rng(1)
    q, k, v = (quantize(rng.standard_normal((1, 2, 6, 8)), "e4m3fn", "nearest_even_satfinite")
               for _ in range(3))
    call = AttentionCall(q, k, v)
    real = forward(call).output
    e8 = np.abs(bf16_path(_result_for(call, "e4m3fn")) - real).max()
    e16 = np.abs(bf16_path(_result_for(call, "fp16")) - real).max()
    assert e16 < e8  # P's e4m3 cast (3 bits) is the path's largest rounding
