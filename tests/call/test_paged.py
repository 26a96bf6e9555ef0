"""Issue 19 item 4: paged KV caches (FlashAttention block_table / vLLM paged attention).

The canonical call is checked against contiguous caches built independently (one sequence at
a time, from a per-token loop over the block table), the page gradients against complex-step
derivatives taken with respect to the pages themselves, and every bad input is refused
naming the tensor and index."""

from __future__ import annotations

import numpy as np
import pytest

import refattn
from gradcheck import assert_gradients
from refattn import AttentionCall, RefAttnError
from refattn.call.paged import PagedKV, paged_call
from refattn.engine.reference import forward_arrays
from refattn.masks import from_positions

PS, NPAGES, HKV, HQ, DK, DV = 4, 7, 2, 4, 3, 2
TABLE = np.array([[5, 1, 3], [0, 6, -1]])  # sequence 1 reads two pages; -1 is padding
LENS = np.array([10, 6])  # 10 tokens: pages 5, 1 and half of 3; 6 tokens: page 0 and half of 6


def _inputs(Q=2, seed=0):
    rng = np.random.default_rng(seed)
    kp = rng.standard_normal((NPAGES, PS, HKV, DK))
    vp = rng.standard_normal((NPAGES, PS, HKV, DV))
    q = rng.standard_normal((2, HQ, Q, DK))
    g = rng.standard_normal((2, HQ, Q, DV))
    return q, kp, vp, g


def _contiguous(kp, b):
    """Sequence b's cache by a per-token loop: token t is page TABLE[b, t // PS], slot t % PS."""
    return np.stack([kp[TABLE[b, t // PS], t % PS] for t in range(LENS[b])], axis=1)  # (H, n, D)


def test_canonical_call_equals_each_sequence_with_its_contiguous_cache():
    q, kp, vp, g = _inputs()
    pc = paged_call(q, kp, vp, TABLE, LENS, PS)
    t = refattn.forward(pc.call)
    assert pc.call.axes["K"] == TABLE.shape[1] * PS
    assert pc.call.relation.layout == "cache"
    for b in range(2):
        n = int(LENS[b])
        k, v = _contiguous(kp, b)[None], _contiguous(vp, b)[None]  # (1, Hkv, n, D)
        alone = AttentionCall(q[b:b + 1], k, v, visible=from_positions(np.arange(n - 2, n),
                                                                       np.arange(n)))
        ta = refattn.forward(alone)
        np.testing.assert_allclose(t.output[b:b + 1], ta.output, rtol=1e-13, atol=1e-15)
        ga = refattn.backward(ta, g[b:b + 1])
        grads = refattn.backward(t, g)
        np.testing.assert_allclose(grads.grad_k[b:b + 1, :, :n], ga.grad_k, rtol=1e-12,
                                   atol=1e-15)
        assert (grads.grad_k[b, :, n:] == 0.0).all()  # slots past the sequence: no gradient


def test_page_gradients_land_on_the_pages_read():
    q, kp, vp, g = _inputs()
    pc = paged_call(q, kp, vp, TABLE, LENS, PS)
    pg = pc.paged.page_gradients(refattn.backward(refattn.forward(pc.call), g))
    ref = pc.paged.referenced()  # (NPAGES, PS)
    assert ref[[5, 1, 0]].all() and ref[3, :2].all() and not ref[3, 2:].any()
    assert ref[6, :2].all() and not ref[6, 2:].any() and not ref[[2, 4]].any()
    assert (pg.grad_k_pages[~ref] == 0.0).all() and (pg.grad_v_pages[~ref] == 0.0).all()
    assert np.abs(pg.grad_k_pages[ref]).min() >= 0.0 and np.abs(pg.grad_v_pages[ref]).max() > 0


def test_page_gradients_against_complex_step_on_the_pages():
    q, kp, vp, _ = _inputs(Q=3, seed=1)
    pc = paged_call(q, kp, vp, TABLE, LENS, PS, bias=np.full((1, HQ, 3, 12), 0.25),
                    sink=np.linspace(-1, 1, HQ))
    call = pc.call

    def gather(pages):  # an independent per-token gather, complex-safe
        out = np.zeros((2, HKV, 12, pages.shape[3]), dtype=pages.dtype)
        for b in range(2):
            for t in range(int(LENS[b])):
                out[b, :, t] = pages[TABLE[b, t // PS], t % PS]
        return out

    def fn(k_pages, v_pages):
        return forward_arrays(q, gather(k_pages), gather(v_pages), head_map=call.head_map,
                              scale=call.scale, visible=call.visible_full(),
                              query_valid=call.query_valid_full(), bias=call.bias,
                              sink=call.sink)["output"]

    def vjp(grad_output, k_pages, v_pages):
        p = paged_call(q, k_pages, v_pages, TABLE, LENS, PS, bias=call.bias, sink=call.sink)
        pg = p.paged.page_gradients(refattn.backward(refattn.forward(p.call), grad_output))
        return {"k_pages": pg.grad_k_pages, "v_pages": pg.grad_v_pages}

    assert_gradients(fn, vjp, {"k_pages": kp, "v_pages": vp}, mode="full", seed=2)


def test_non_causal_paged_memory_reads_every_valid_key():
    q, kp, vp, _ = _inputs()
    pc = paged_call(q, kp, vp, TABLE, LENS, PS, causal=False)
    vis = pc.call.visible_full()
    assert vis[0, :, :, :10].all() and not vis[0, :, :, 10:].any()
    assert vis[1, :, :, :6].all() and not vis[1, :, :, 6:].any()


@pytest.mark.parametrize(("kw", "message"), [
    ({"block_table": np.array([[5, 1, 7], [0, 6, -1]])},
     r"block_table: entry \(b=0, p=2\) is 7, expected a page in \[0, 7\)"),
    ({"block_table": np.array([[5, 1, 3], [-2, 6, -1]])},
     r"block_table: entry \(b=1, p=0\) is -2"),
    ({"block_table": np.array([[5, 1, 3], [0, 1, -1]])},
     r"block_table: overlapping pages: entries \(b=0, p=1\) and \(b=1, p=1\) both read page 1"),
    ({"block_table": np.array([[5, 5, 3], [0, 6, -1]])},
     r"overlapping pages: entries \(b=0, p=0\) and \(b=0, p=1\)"),
    ({"block_table": np.array([[5.0, 1, 3], [0, 6, -1]])},
     "block_table: expected an integer array, got dtype float64"),
    ({"seqlens": np.array([13, 6])}, r"seqlens: entry b=0 is 13, expected 1 <= seqlens\[b\] <= "
                                     r"max_pages \* page_size = 12"),
    ({"seqlens": np.array([10, 0])}, r"seqlens: entry b=1 is 0"),
    ({"seqlens": np.array([10])}, r"seqlens: expected shape \[B=2\]"),
    ({"page_size": 3}, r"page_size: 3 but k_pages holds 4 slots per page"),
    ({"k_pages": np.zeros((NPAGES, PS, HKV, DK), np.float32)},
     "k_pages: expected dtype float64, got float32"),
    ({"v_pages": np.zeros((NPAGES, PS, 1, DV))}, r"v_pages: shape \[7, 4, 1, 2\] must match"),
    ({"k_pages": np.full((NPAGES, PS, HKV, DK), np.nan)}, r"k_pages: non-finite value nan"),
    ({"visible": np.ones(12, bool)}, "visible: a paged call's visibility comes from"),
])
def test_paged_rejections(kw, message):
    q, kp, vp, _ = _inputs()
    args = {"k_pages": kp, "v_pages": vp, "block_table": TABLE, "seqlens": LENS,
            "page_size": PS, **kw}
    with pytest.raises(RefAttnError, match=message):
        paged_call(q, **args)


def test_scatter_refuses_a_wrong_gradient_shape():
    _, kp, vp, _ = _inputs()
    paged = PagedKV(kp, vp, TABLE, LENS, PS)
    with pytest.raises(RefAttnError, match=r"grad_k: expected shape \[B=2, Hkv=2, K=12, D\]"):
        paged.scatter(np.zeros((2, 2, 11, DK)), "grad_k")
