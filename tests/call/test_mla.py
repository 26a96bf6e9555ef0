"""MLA calls (refattn/call/mla.py): V is the first Dv columns of the latent.

Expected values come from a plain loop written here from FlashMLA's test reference
(deepseek-ai/FlashMLA tests/test_flash_mla_dense_decoding.py, ``reference_torch`` and its
``scaled_dot_product_attention``, commit 9241ae3: ``mask.tril(diagonal=s_k - s_q)``,
``kv[..., :dv]`` as V, output 0 and lse +inf on a query without a key), its backward by hand
from the softmax's definition, and finite differences (the project's gradcheck) on the latent
as ONE input: the only check that the two paths through the shared columns are summed.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gradcheck
import refattn
from refattn.call.mla import (
    AbsorbedLatent,
    LatentKV,
    PagedLatentKV,
    absorbed_call,
    latent_gradient,
    mla_call,
    paged_mla_call,
)
from refattn.errors import RefAttnError

RNG = np.random.default_rng(20260501)


# -- the plain loop (FlashMLA's reference, in float64, with its backward) --------------------
def ref_mla(q, pages, table, lens, dv, causal, scale, g_o):
    """q (B, Hq, Q, D) head-major; pages (N, P, Hkv, D). Returns out (B, Hq, Q, dv), lse
    (B, Hq, Q) and the page gradient (N, P, Hkv, D) of <g_o, out>."""
    B, Hq, Q, D = q.shape
    _, P, Hkv, _ = pages.shape
    out = np.zeros((B, Hq, Q, dv))
    lse = np.full((B, Hq, Q), np.inf)
    g_pages = np.zeros_like(pages)
    for b in range(B):
        n = int(lens[b])
        rows = [(int(table[b, t // P]), t % P) for t in range(n)]
        for h in range(Hq):
            kvh = h // (Hq // Hkv)
            kv = np.array([pages[p, s, kvh] for p, s in rows]).reshape(n, D)  # (n, D)
            for i in range(Q):
                seen = [j for j in range(n) if not causal or j <= i + n - Q]
                if not seen:
                    continue  # "Correct for q tokens which has no attendable k"
                s = np.array([q[b, h, i] @ kv[j] * scale for j in seen])
                m = s.max()
                lse[b, h, i] = m + np.log(np.exp(s - m).sum())
                p = np.exp(s - lse[b, h, i])
                out[b, h, i] = sum(p[c] * kv[j, :dv] for c, j in enumerate(seen))
                # backward of <g, out>: dP = g . v_j, dS = P (dP - sum P dP)
                g = g_o[b, h, i]
                dp = np.array([g @ kv[j, :dv] for j in seen])
                ds = p * (dp - (p * dp).sum())
                for c, j in enumerate(seen):
                    page, slot = rows[j]
                    g_pages[page, slot, kvh] += scale * ds[c] * q[b, h, i]  # key path
                    g_pages[page, slot, kvh, :dv] += p[c] * g  # value path
    return out, lse, g_pages


def _paged_inputs(B=3, Hq=4, Hkv=1, Q=2, D=6, P=4, lens=(7, 0, 3), pad=-1):
    per = max(1, -(-max(lens) // P))
    n_pages = B * per + 1
    table = RNG.permutation(n_pages)[:B * per].reshape(B, per)
    for b, n in enumerate(lens):
        table[b, -(-n // P):] = pad
    pages = RNG.standard_normal((n_pages, P, Hkv, D))
    q = RNG.standard_normal((B, Hq, Q, D))
    return q, pages, table, np.array(lens)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_paged_forward_and_page_gradient_match_the_plain_loop(causal, backend):
    q, pages, table, lens = _paged_inputs(B=3, Hq=4, Q=3, lens=(7, 0, 2))
    dv = 4
    m = paged_mla_call(q, pages, table, lens, dv, causal=causal)
    g_o = RNG.standard_normal((3, 4, 3, dv))
    out, lse, g_pages = ref_mla(q, pages, table, lens, dv, causal, 6 ** -0.5, g_o)
    # forward then backward on the backend (numba's value_and_grad would first calibrate
    # the machine's BLAS: half a minute in a fresh test session)
    trace = refattn.forward(m.call, backend=backend)
    grads = refattn.backward(trace, g_o)
    np.testing.assert_allclose(trace.output, out, rtol=1e-12, atol=1e-13)
    _, got_lse = m.outputs(trace)
    np.testing.assert_allclose(got_lse, lse, rtol=1e-13)
    assert np.isinf(got_lse[1]).all()  # the zero-length cache
    np.testing.assert_allclose(m.layout.page_gradient(grads), g_pages, rtol=1e-11, atol=1e-12)


def test_paged_row_has_key_is_flashmla_bottom_right():
    q, pages, table, lens = _paged_inputs(B=2, Q=3, lens=(2, 0))
    m = paged_mla_call(q, pages, table, lens, 4, causal=True)
    # s_k = 2, s_q = 3: query 0 reads j <= 0 + 2 - 3 = -1: nothing; the empty cache nothing
    assert m.row_has_key.tolist() == [[False, True, True], [False, False, False]]
    assert not paged_mla_call(q, pages, table, lens, 4).row_has_key[1].any()


def test_dense_latent_matches_the_plain_loop_and_sums_both_paths():
    q, kv = RNG.standard_normal((2, 4, 3, 6)), RNG.standard_normal((2, 2, 5, 6))
    m = mla_call(q, kv, 4)
    g_o = RNG.standard_normal((2, 4, 3, 4))
    grads = refattn.backward(refattn.forward(m.call), g_o)
    # the same cache as pages of one sequence each, read by the loop
    pages = kv.transpose(0, 2, 1, 3)  # (B, K, Hkv, D): one page of 5 slots per sequence
    out, _, g_pages = ref_mla(q, pages, np.arange(2)[:, None], [5, 5], 4, False, 6 ** -0.5, g_o)
    np.testing.assert_allclose(refattn.forward(m.call).output, out, rtol=1e-12)
    np.testing.assert_allclose(m.layout.latent_gradient(grads), g_pages.transpose(0, 2, 1, 3),
                               rtol=1e-11, atol=1e-12)


# -- finite differences on the latent as one input -------------------------------------------
def _latent_problem(bug=None):
    q = RNG.standard_normal((1, 2, 2, 5))
    kv = RNG.standard_normal((1, 1, 4, 5))

    def fn(kv):
        return refattn.forward(mla_call(q, kv, 3).call).output

    def vjp(g, kv):
        m = mla_call(q, kv, 3)
        grads = refattn.backward(refattn.forward(m.call), g)
        if bug == "dropped":  # the value path forgotten
            return {"kv": np.array(grads.grad_k)}
        if bug == "twice":  # the value path counted twice
            return {"kv": latent_gradient(grads.grad_k, 2 * grads.grad_v)}
        return {"kv": m.layout.latent_gradient(grads)}

    return fn, vjp, {"kv": kv}


def test_gradcheck_latent_one_input_passes():
    fn, vjp, inputs = _latent_problem()
    report = gradcheck.check_vjp(fn, vjp, inputs, method="central", mode="full")
    assert report.passed, report


@pytest.mark.parametrize("bug", ["dropped", "twice"])
def test_gradcheck_catches_a_planted_value_path_bug(bug):
    fn, vjp, inputs = _latent_problem(bug)
    report = gradcheck.check_vjp(fn, vjp, inputs, method="central", mode="full")
    assert not report.passed
    assert report.failed == ["kv"]


def test_gradcheck_paged_latent_pages_as_one_input():
    q, pages, table, lens = _paged_inputs(B=2, Hq=2, Q=2, D=5, P=2, lens=(3, 0))

    def fn(kv_pages):
        return refattn.forward(paged_mla_call(q, kv_pages, table, lens, 3, causal=True).call
                               ).output

    def vjp(g, kv_pages):
        m = paged_mla_call(q, kv_pages, table, lens, 3, causal=True)
        return {"kv_pages": m.layout.page_gradient(refattn.backward(refattn.forward(m.call), g))}

    report = gradcheck.check_vjp(fn, vjp, {"kv_pages": pages}, method="central", mode="full")
    assert report.passed, report


def test_gradcheck_absorbed_four_inputs():
    qn, qp = RNG.standard_normal((1, 2, 2, 3)), RNG.standard_normal((1, 2, 2, 2))
    kc, kp = RNG.standard_normal((1, 1, 3, 3)), RNG.standard_normal((1, 1, 3, 2))

    def fn(q_nope, q_pe, kv_c, k_pe):
        return refattn.forward(absorbed_call(q_nope, q_pe, kv_c, k_pe, scale=0.4).call).output

    def vjp(g, q_nope, q_pe, kv_c, k_pe):
        m = absorbed_call(q_nope, q_pe, kv_c, k_pe, scale=0.4)
        s = m.layout.split(refattn.backward(refattn.forward(m.call), g))
        return {"q_nope": s.grad_q_nope, "q_pe": s.grad_q_pe, "kv_c": s.grad_kv_c,
                "k_pe": s.grad_k_pe}

    report = gradcheck.check_vjp(fn, vjp, {"q_nope": qn, "q_pe": qp, "kv_c": kc, "k_pe": kp},
                                 method="central", mode="full")
    assert report.passed, report


# -- the absorbed form is the concatenated form ----------------------------------------------
def test_absorbed_form_equals_the_concatenated_form():
    qn, qp = RNG.standard_normal((2, 4, 2, 8)), RNG.standard_normal((2, 4, 2, 3))
    kc, kp = RNG.standard_normal((2, 1, 6, 8)), RNG.standard_normal((2, 1, 6, 3))
    a = absorbed_call(qn, qp, kc, kp, scale=0.3)
    c = mla_call(np.concatenate([qn, qp], -1), np.concatenate([kc, kp], -1), 8, scale=0.3)
    g_o = RNG.standard_normal((2, 4, 2, 8))
    ta, tc = refattn.forward(a.call), refattn.forward(c.call)
    assert np.array_equal(ta.output, tc.output) and np.array_equal(ta.lse, tc.lse)
    ga, gc = refattn.backward(ta, g_o), refattn.backward(tc, g_o)
    split, latent = a.layout.split(ga), c.layout.latent_gradient(gc)
    assert np.array_equal(split.grad_kv_c, latent[..., :8])
    assert np.array_equal(split.grad_k_pe, latent[..., 8:])
    assert np.array_equal(split.grad_q_nope, gc.grad_q[..., :8])
    assert np.array_equal(split.grad_q_pe, gc.grad_q[..., 8:])
    assert set(a.layout.gradient_tensors(ga)) == {"grad_q_nope", "grad_q_pe", "grad_kv_c",
                                                  "grad_k_pe"}


@settings(deadline=None, max_examples=25)
@given(lens=st.lists(st.integers(0, 9), min_size=1, max_size=3), Q=st.integers(1, 3),
       causal=st.booleans(), page=st.sampled_from([1, 2, 4]), dv=st.integers(1, 5))
def test_paged_forward_matches_the_loop_on_random_caches(lens, Q, causal, page, dv):
    rng = np.random.default_rng(len(lens) * 100 + Q * 10 + page)
    B = len(lens)
    per = max(1, -(-max(lens) // page))
    table = rng.permutation(B * per).reshape(B, per)
    pages = rng.standard_normal((B * per, page, 1, 5))
    q = rng.standard_normal((B, 2, Q, 5))
    m = paged_mla_call(q, pages, table, np.array(lens), dv, causal=causal)
    g_o = rng.standard_normal((B, 2, Q, dv))
    out, lse, g_pages = ref_mla(q, pages, table, lens, dv, causal, 5 ** -0.5, g_o)
    trace = refattn.forward(m.call)
    got_out, got_lse = m.outputs(trace)
    np.testing.assert_allclose(got_out.transpose(0, 2, 1, 3), out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(got_lse, lse, rtol=1e-13)
    g = m.layout.page_gradient(refattn.backward(trace, g_o))
    np.testing.assert_allclose(g, g_pages, rtol=1e-11, atol=1e-12)


# -- layouts ---------------------------------------------------------------------------------
def test_layout_protocol_and_reader_round_trip():
    from refattn.bundle.golden.layouts import read_layout

    q, pages, table, lens = _paged_inputs(lens=(5, 0, 3), pad=2147480000)
    m = paged_mla_call(q, pages, table.astype(np.int32), lens, 4, causal=True)
    conv = m.layout.conventions()
    assert conv["kv_layout"] == "mla_latent" and conv["head_dim_v"] == 4
    back = read_layout(m.layout.tensors(), conv, "c")
    assert isinstance(back, PagedLatentKV)
    grads = refattn.backward(refattn.forward(m.call), np.ones((3, 4, 2, 4)))
    assert np.array_equal(back.page_gradient(grads), m.layout.page_gradient(grads))
    assert m.layout.tensors()["block_table"].dtype == np.int64
    dense = LatentKV(RNG.standard_normal((1, 1, 3, 4)), 2)
    assert isinstance(read_layout(dense.tensors(), dense.conventions(), "c"), LatentKV)
    ab = AbsorbedLatent(*(RNG.standard_normal(s) for s in
                          ((1, 2, 1, 3), (1, 2, 1, 1), (1, 1, 2, 3), (1, 1, 2, 1))))
    assert isinstance(read_layout(ab.tensors(), ab.conventions(), "c"), AbsorbedLatent)
    with pytest.raises(RefAttnError, match="mla_form 'tiled' is not one of"):
        read_layout({}, {"kv_layout": "mla_latent", "mla_form": "tiled"}, "c")
    with pytest.raises(RefAttnError, match="needs tensor 'kv_latent'"):
        read_layout({}, {"kv_layout": "mla_latent", "mla_form": "dense", "head_dim_v": 2}, "c")


def test_the_callers_arrays_are_not_modified():
    q, pages, table, lens = _paged_inputs(lens=(5, 0, 3))
    before = [x.copy() for x in (q, pages, table, lens)]
    m = paged_mla_call(q, pages, table, lens, 4)
    m.layout.page_gradient(refattn.backward(refattn.forward(m.call), np.ones((3, 4, 2, 4))))
    for x, y in zip((q, pages, table, lens), before, strict=True):
        assert np.array_equal(x, y)


# -- bad input -------------------------------------------------------------------------------
def test_dv_beyond_dk_names_the_tensor_the_axis_and_the_limit():
    with pytest.raises(RefAttnError) as exc:
        mla_call(np.ones((1, 1, 1, 6)), np.ones((1, 1, 2, 6)), 7)
    msg = str(exc.value)
    assert msg.startswith("head_dim_v: 7") and "kv" in msg and "axis 3" in msg
    assert "Dk = 6" in msg
    with pytest.raises(RefAttnError, match=r"head_dim_v: 9 .*kv_pages.*axis 3.*Dk = 6"):
        paged_mla_call(np.ones((1, 1, 1, 6)), np.ones((1, 2, 1, 6)), [[0]], [1], 9)
    with pytest.raises(RefAttnError, match=r"grad_v: 5 columns \(axis 1\) exceed grad_k's Dk = 4"):
        latent_gradient(np.ones((2, 4)), np.ones((2, 5)))


@pytest.mark.parametrize("dv, match", [(0, "outside"), (True, "integer"), (2.0, "integer")])
def test_head_dim_v_must_be_a_positive_integer(dv, match):
    with pytest.raises(RefAttnError, match=f"head_dim_v: .*{match}"):
        mla_call(np.ones((1, 1, 1, 4)), np.ones((1, 1, 2, 4)), dv)


def test_non_float64_and_non_finite_are_refused():
    with pytest.raises(RefAttnError, match=r"kv: .*float64"):
        mla_call(np.ones((1, 1, 1, 4)), np.ones((1, 1, 2, 4), np.float32), 2)
    with pytest.raises(RefAttnError, match=r"q: .*float64"):
        mla_call(np.ones((1, 1, 1, 4), np.float32), np.ones((1, 1, 2, 4)), 2)
    bad = np.ones((1, 1, 2, 4))
    bad[0, 0, 1, 2] = np.nan
    with pytest.raises(RefAttnError, match="kv"):
        mla_call(np.ones((1, 1, 1, 4)), bad, 2)
    with pytest.raises(RefAttnError, match=r"kv: expected shape \[B, Hkv, K, Dk\]"):
        mla_call(np.ones((1, 1, 1, 4)), np.ones((2, 4)), 2)
    with pytest.raises(RefAttnError, match=r"q_pe: .*float64"):
        absorbed_call(np.ones((1, 1, 1, 3)), np.ones((1, 1, 1, 1), np.float16),
                      np.ones((1, 1, 2, 3)), np.ones((1, 1, 2, 1)))


@pytest.mark.parametrize("shapes, match", [
    (((1, 1, 2, 3), (1, 1, 1, 1), (1, 1, 2, 3), (1, 1, 2, 1)), "q_pe: shape .* on \\(B, Hq, Q\\)"),
    (((1, 1, 1, 3), (1, 1, 1, 1), (1, 1, 2, 4), (1, 1, 2, 1)), "kv_c: latent width Dc = 4"),
    (((1, 1, 1, 3), (1, 1, 1, 2), (1, 1, 2, 3), (1, 1, 2, 1)), "k_pe: rope width Dr = 1"),
    (((1, 1, 1, 3), (1, 1, 1, 1), (1, 1, 2, 3), (1, 1, 3, 1)), "k_pe: shape .* on \\(B, Hkv, K\\)"),
    (((1, 1, 1, 3), (1, 1, 1, 1), (2, 1, 2, 3), (2, 1, 2, 1)), "kv_c: batch 2"),
])
def test_absorbed_shape_mismatches(shapes, match):
    with pytest.raises(RefAttnError, match=match):
        absorbed_call(*(np.ones(s) for s in shapes))


def test_paged_bad_inputs_name_the_entry():
    q, pages, table, lens = _paged_inputs(lens=(5, 0, 3))
    with pytest.raises(RefAttnError, match=r"seqlens: entry b=0 is 99, expected 0 <= seqlens"):
        paged_mla_call(q, pages, table, [99, 0, 3], 4)
    with pytest.raises(RefAttnError, match=r"seqlens: entry b=1 is -1"):
        paged_mla_call(q, pages, table, [5, -1, 3], 4)
    t2 = table.copy()
    t2[2, 0] = 50
    with pytest.raises(RefAttnError, match=r"block_table: entry \(b=2, p=0\) is 50"):
        paged_mla_call(q, pages, t2, lens, 4)
    t3 = table.copy()
    t3[2, 0] = t3[0, 0]
    with pytest.raises(RefAttnError, match="overlapping pages"):
        paged_mla_call(q, pages, t3, lens, 4)
    paged_mla_call(q, pages, t3, lens, 4, shared_pages=True)  # allowed when asked
    with pytest.raises(RefAttnError, match="visible: a paged MLA call's visibility"):
        paged_mla_call(q, pages, table, lens, 4, visible=np.ones((1, 1, 1, 1), bool))
    with pytest.raises(RefAttnError, match="query_valid"):
        paged_mla_call(q, pages, table, lens, 4, query_valid=np.ones((3, 1, 2, 1), bool))
    with pytest.raises(RefAttnError, match=r"q: expected shape \[B=3"):
        paged_mla_call(q[:2], pages, table, lens, 4)
    with pytest.raises(RefAttnError, match="page_size: 3 but kv_pages holds 4"):
        paged_mla_call(q, pages, table, lens, 4, 3)
    with pytest.raises(RefAttnError, match="causal: expected True or False"):
        paged_mla_call(q, pages, table, lens, 4, causal=1)
    with pytest.raises(RefAttnError, match="block_table: expected a non-empty integer"):
        paged_mla_call(q, pages, table.astype(float), lens, 4)
    with pytest.raises(RefAttnError, match="kv_pages: expected at least one page"):
        paged_mla_call(q, pages[:0], table, np.zeros(3, int), 4)
