"""Brute force on tiny shapes: every summation order of the kernel's fp32 (and fp16) sums,
rounded step by step, lands inside the emulated intervals.

Each simulation below is written from the kernels' documented arithmetic (docs/quant-sources.md)
with numpy float32/float16 scalars, one rounding per operation, for a given permutation of the
products of S, of the keys in l and of the keys in the PV accumulator; the tests run all
permutations (3! each) with and without the online softmax's tiles, and with the exponent
computed fused (one rounding) or not. An order that falls outside is an enclosure bug.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from refattn import AttentionCall
from refattn.masks import causal
from refattn.quant import preset, quantized
from refattn.quant.formats import quantize

f32, f16 = np.float32, np.float16
LOG2E, LN2 = math.log2(math.e), math.log(2.0)
PERMS = list(itertools.permutations(range(3)))


def _exp2(x):
    return f32(np.exp2(np.float64(x)))  # within a fraction of an ulp of 2^x


def _bf16(x):
    return float(quantize(np.array(float(x)), "bf16", "nearest_even"))


def _e4m3(x):
    return float(quantize(np.array(float(x)), "e4m3fn", "nearest_even_satfinite"))


def _tiles(K, tile, descending):
    tiles = [list(range(s, min(s + tile, K))) for s in range(0, K, tile)]
    return tiles[::-1] if descending else tiles


def _fa3_row(q, k, v, vis, *, c, vd, dperm, lperm, aperm, tile, fused, offset=8.0,
             l_rounded=False, multiplier=None):
    """One query row of FA3's FP8 forward (hopper/softmax.h) in float32, given orders; with
    ``multiplier`` FlashInfer SM90's (attention_updater.cuh: no offset, P = cast(p * 448),
    O = acc fl(fl(v_scale / 448) / l))."""
    K = k.shape[0]
    S = np.full(K, -np.inf, dtype=np.float32)
    for j in range(K):
        if vis[j]:
            s = f32(0)
            for d in dperm:
                s = f32(s + f32(q[d] * k[j, d]))  # e4m3 products are exact in fp32
            S[j] = s
    m, rs, acc = f32(-np.inf), f32(0), np.zeros(v.shape[1], np.float32)
    P = np.zeros(K)
    for t in _tiles(K, tile, descending=True):
        m_new = max(m, max(S[j] for j in t))
        if m_new == -np.inf:
            continue
        alpha = f32(1) if m == -np.inf else _exp2(f32(f32(m - m_new) * c))
        ms = f32(f32(m_new * c) - f32(offset))
        p = {}
        for j in t:
            if not vis[j]:
                p[j] = f32(0)
                continue
            arg = f32(np.float64(S[j]) * np.float64(c) - ms) if fused else f32(f32(S[j] * c) - ms)
            p[j] = _exp2(arg)
            P[j] = _e4m3(p[j] if multiplier is None else f32(p[j] * f32(multiplier)))
        rs = f32(rs * alpha)
        for j in (j for j in lperm if j in t):
            rs = f32(rs + (f32(P[j]) if l_rounded else p[j]))
        acc = (acc * alpha).astype(np.float32)
        for j in (j for j in aperm if j in t):
            acc = (acc + (f32(P[j]) * v[j]).astype(np.float32)).astype(np.float32)
        m = m_new
    if multiplier is None:
        scale = f32(f32(f32(1) / rs) * f32(vd))
    else:
        scale = f32(f32(f32(vd) / f32(multiplier)) / rs)
    out = [_bf16(f32(a * scale)) for a in acc]
    lse = f32(f32(m * f32(c * f32(LN2))) + f32(np.log(np.float64(f32(rs / f32(2**offset))))))
    return S, m, P, rs, np.array(out), float(lse)


def _fa3_case(causal_mask):
    rng = np.random.default_rng(5)
    Q, K, D = 2, 3, 3
    q, k, v = (quantize(rng.standard_normal(s) * 1.5, "e4m3fn", "nearest_even_satfinite")
               for s in ((1, 1, Q, D), (1, 1, K, D), (1, 1, K, D)))
    qd, kd, vd = 0.75, 1.5, 0.5
    vis = causal(Q, K, alignment="lower_right") if causal_mask else None
    return q, k, v, (qd, kd, vd), AttentionCall(q, k, v, visible=vis, scale=0.5)


@pytest.mark.parametrize("causal_mask", [False, True])
@pytest.mark.parametrize("tile", [None, 2])
def test_fa3_every_order_inside(causal_mask, tile):
    q, k, v, (qd, kd, vd), call = _fa3_case(causal_mask)
    spec = preset("fa3_fp8", q_descale=np.array([[qd]]), k_descale=np.array([[kd]]),
                  v_descale=vd, kv_tile=tile, mma_bits=24, tile_table="")  # a custom tile
    em = quantized(call, spec).emulated
    c = f32(f32(f32(0.5 * LOG2E)) * f32(f32(qd) * f32(kd)))
    vis = call.visible_full()[0, 0]
    K = k.shape[2]
    for i in range(q.shape[2]):
        for dperm, lperm, aperm in itertools.product(PERMS, PERMS, PERMS[::2]):
            for fused in (True, False):
                S, m, P, rs, out, lse = _fa3_row(
                    q[0, 0, i], k[0, 0], v[0, 0], vis[i], c=c, vd=vd, dperm=dperm,
                    lperm=lperm, aperm=aperm, tile=tile or K, fused=fused)
                at = (0, 0, i)
                assert np.all(em["scores"][at].contains(S)), (i, dperm)
                assert em["row_max"][at].contains(m)
                assert np.all(em["probs_q"][at].contains(P)), (i, dperm, P)
                assert em["row_sum"][at].contains(rs), (i, lperm, rs)
                assert np.all(em["output"][at].contains(out)), (i, aperm, out)
                assert em["lse"][at].contains(lse), (i, lse)


@pytest.mark.parametrize("bug", ["offset", "l_rounded", "v_descale"])
def test_fa3_a_planted_bug_in_the_simulation_falls_outside(bug):
    """Negative control: the same simulation with one documented step changed lands outside
    (so the intervals above are tight enough to mean something)."""
    q, k, v, (qd, kd, vd), call = _fa3_case(False)
    spec = preset("fa3_fp8", q_descale=np.array([[qd]]), k_descale=np.array([[kd]]),
                  v_descale=vd, mma_bits=24)
    em = quantized(call, spec).emulated
    c = f32(f32(f32(0.5 * LOG2E)) * f32(f32(qd) * f32(kd)))
    vis = call.visible_full()[0, 0]
    outside = 0
    for i in range(q.shape[2]):
        _, _, _, rs, out, _ = _fa3_row(
            q[0, 0, i], k[0, 0], v[0, 0], vis[i], c=c, vd=1.0 if bug == "v_descale" else vd,
            dperm=(0, 1, 2), lperm=(0, 1, 2), aperm=(0, 1, 2), tile=3, fused=True,
            offset=0.0 if bug == "offset" else 8.0, l_rounded=bug == "l_rounded")
        at = (0, 0, i)
        outside += int(not (np.all(em["output"][at].contains(out))
                            and em["row_sum"][at].contains(rs)))
    assert outside > 0


@pytest.mark.parametrize("tile", [None, 2])
def test_flashinfer_sm90_every_order_inside(tile):
    q, k, v, (qd, kd, vd), call = _fa3_case(True)
    spec = preset("flashinfer_sm90_fp8", q_scale=np.array([qd]), k_scale=np.array([kd]),
                  v_scale=np.array([vd]), kv_tile=tile, mma_bits=24, tile_table="")
    em = quantized(call, spec).emulated
    c = f32(f32(f32(f32(qd) * f32(kd)) * f32(0.5)) * f32(LOG2E))  # variants.cuh order
    vis = call.visible_full()[0, 0]
    for i in range(q.shape[2]):
        for dperm, lperm, aperm in itertools.product(PERMS, PERMS[::2], PERMS[::2]):
            S, m, P, rs, out, _ = _fa3_row(
                q[0, 0, i], k[0, 0], v[0, 0], vis[i], c=c, vd=vd, dperm=dperm, lperm=lperm,
                aperm=aperm, tile=tile or 3, fused=True, offset=0.0, multiplier=448.0)
            at = (0, 0, i)
            assert np.all(em["scores"][at].contains(S)) and em["row_max"][at].contains(m)
            assert np.all(em["probs_q"][at].contains(P)), (i, P)
            assert em["row_sum"][at].contains(rs), (i, rs)
            assert np.all(em["output"][at].contains(out)), (i, aperm, out)
    assert "lse" not in em  # FlashInfer's lse is base 2: not emulated


def test_flashinfer_fp8_kv_every_order_inside():
    """FA2 prefill with an FP8 KV cache (prefill.cuh): K, V upcast exactly, P rounded to fp16,
    l from the rounded P, O = fp16(acc rcp(l)), then v_scale applied to the fp16 output."""
    rng = np.random.default_rng(8)
    Q, K, D = 2, 3, 3
    q = quantize(rng.standard_normal((1, 1, Q, D)), "fp16", "nearest_even")
    k, v = (quantize(rng.standard_normal((1, 1, K, D)) * 2, "e4m3fn", "nearest_even_satfinite")
            for _ in range(2))
    k_scale, v_scale, scale = 0.75, 0.375, 0.5
    em = quantized(AttentionCall(q, k, v, scale=scale),
                   preset("flashinfer_fp8_kv", k_scale=k_scale, v_scale=v_scale,
                          mma_bits=24, tile_table="")).emulated
    c = f32(f32(scale * k_scale) * f32(LOG2E))  # sm_scale *= k_scale on the host
    for i in range(Q):
        for dperm, lperm, aperm in itertools.product(PERMS, PERMS, PERMS):
            S = np.zeros(K, np.float32)
            for j in range(K):
                for d in dperm:
                    S[j] = f32(S[j] + f32(q[0, 0, i, d] * k[0, 0, j, d]))
            m = S.max()
            P = [f16(_exp2(f32(f32(S[j] * c) - f32(m * c)))) for j in range(K)]
            rs = f32(0)
            for j in lperm:
                rs = f32(rs + f32(P[j]))
            acc = np.zeros(D, np.float32)
            for j in aperm:
                acc = (acc + (f32(P[j]) * v[0, 0, j]).astype(np.float32)).astype(np.float32)
            o16 = (acc * f32(f32(1) / rs)).astype(np.float32).astype(np.float16)
            out = (o16.astype(np.float32) * f32(v_scale)).astype(np.float16).astype(float)
            at = (0, 0, i)
            assert np.all(em["scores"][at].contains(S))
            assert np.all(em["probs_q"][at].contains(np.array(P, dtype=float)))
            assert em["row_sum"][at].contains(rs), (i, rs)
            assert np.all(em["output"][at].contains(out)), (i, out)


def _sage_row_quant(x, scale_mul, block):
    """SageAttention's per-block int8 of one head (quant_per_block_int8_kernel)."""
    xs = (x.astype(np.float32) * f32(scale_mul)).astype(np.float32)
    codes = np.zeros_like(xs)
    scales = np.zeros(xs.shape[0], np.float32)
    for s in range(0, xs.shape[0], block):
        blk = xs[s:s + block]
        sc = f32(f32(np.abs(blk).max()) / f32(127))
        t = (blk / sc).astype(np.float32)
        t = (t + f32(0.5) * np.where(t >= 0, f32(1), f32(-1))).astype(np.float32)
        codes[s:s + block] = np.trunc(t)
        scales[s:s + block] = sc
    return codes, scales


@pytest.mark.parametrize("tile", [2, 3])
def test_sage_every_order_inside(tile):
    rng = np.random.default_rng(9)
    Q, K, D = 2, 3, 3
    q, k, v = (quantize(rng.standard_normal(s) * 2 + 0.5, "fp16", "nearest_even")
               for s in ((1, 1, Q, D), (1, 1, K, D), (1, 1, K, D)))
    scale = 0.5
    em = quantized(AttentionCall(q, k, v, scale=scale),
                   preset("sageattention_int8", kv_tile=tile, tile_table="")).emulated
    # K smoothing in fp16 (the mean accumulated in fp32, then rounded), Q pre-scaled
    km = f16(f32(k[0, 0].astype(np.float32).sum(axis=0) / f32(K)))
    ks = (k[0, 0].astype(np.float16) - km).astype(np.float16)
    qc, qs = _sage_row_quant(q[0, 0], f32(scale * 1.44269504), 128)
    kc, kss = _sage_row_quant(ks, 1.0, 64)
    v16 = v[0, 0].astype(np.float16)
    for i in range(Q):
        for lperm, aperm in itertools.product(PERMS, PERMS):
            S = np.array([f32(f32(float(qc[i] @ kc[j])) * f32(qs[i] * kss[j]))
                          for j in range(K)], dtype=np.float32)
            m, rs, acc = f32(-np.inf), f32(0), np.zeros(D, np.float32)
            P = np.zeros(K)
            for t in _tiles(K, tile, descending=False):
                m_new = max(m, max(S[j] for j in t))
                alpha = f32(1) if m == -np.inf else _exp2(f32(m - m_new))
                p = {j: _exp2(f32(S[j] - m_new)) for j in t}
                rs = f32(rs * alpha)
                for j in (j for j in lperm if j in t):
                    rs = f32(rs + p[j])
                tile_acc = np.zeros(D, np.float16)
                for j in (j for j in aperm if j in t):
                    P[j] = float(f16(p[j]))
                    tile_acc = (tile_acc + (f16(p[j]) * v16[j]).astype(np.float16)).astype(
                        np.float16)
                acc = ((acc * alpha).astype(np.float32) + tile_acc.astype(np.float32)).astype(
                    np.float32)
                m = m_new
            out = (acc / rs).astype(np.float32).astype(np.float16).astype(np.float64)
            at = (0, 0, i)
            assert np.all(em["scores"][at].contains(S)), (i, S)
            assert em["row_max"][at].contains(m)
            assert np.all(em["probs_q"][at].contains(P)), (i, P)
            assert em["row_sum"][at].contains(rs), (i, rs)
            assert np.all(em["output"][at].contains(out)), (i, aperm, out)
