"""Projection gradients: weights and input states by central differences, for self-attention
and for cross-attention with unequal lengths; the Q / K+V stream split; nn.Linear orientation."""

from __future__ import annotations

import numpy as np
import pytest

from gradcheck import central_difference
from refattn import RefAttnError
from refattn.analysis.projection import (
    linear_weight_to_equation,
    project_attention,
    projection_backward,
)

B, Q, K, D_MODEL, D_MEM = 2, 3, 5, 6, 4
HQ, HKV, DK, DV = 2, 1, 3, 2


def _weights(rng, d_src):
    return {
        "w_q": rng.standard_normal((D_MODEL, HQ * DK)) * 0.6,
        "w_k": rng.standard_normal((d_src, HKV * DK)) * 0.6,
        "w_v": rng.standard_normal((d_src, HKV * DV)),
        "b_q": rng.standard_normal(HQ * DK) * 0.3,
        "b_k": rng.standard_normal(HKV * DK) * 0.3,
        "b_v": rng.standard_normal(HKV * DV),
    }


def _setup(cross, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, Q, D_MODEL))
    memory = rng.standard_normal((B, K, D_MEM)) if cross else None
    w = _weights(rng, D_MEM if cross else D_MODEL)
    length = K if cross else Q
    visible = np.ones((Q, length), bool)
    visible[0, -1] = False  # one illegal edge: its gradient path must be closed
    g_o = rng.standard_normal((B, HQ, Q, DV))
    return x, memory, w, visible, g_o


def _forward(x, memory, w, visible, **kw):
    return project_attention(x, w["w_q"], w["w_k"], w["w_v"], memory=memory, b_q=w["b_q"],
                             b_k=w["b_k"], b_v=w["b_v"], num_heads=HQ, num_kv_heads=HKV,
                             visible=visible, **kw)


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_projection_gradients_match_central_differences(cross):
    x, memory, w, visible, g_o = _setup(cross)
    r = _forward(x, memory, w, visible)
    assert r.call.axes["Q"] == Q and r.call.axes["K"] == (K if cross else Q)
    g = projection_backward(r, g_o)

    def loss(**over):
        ww = {**w, **{n: a for n, a in over.items() if n in w}}
        xx = over.get("x", x)
        mm = over.get("memory", memory)
        return float((_forward(xx, mm, ww, visible).trace.output * g_o).sum())

    checks = {name: getattr(g, f"grad_{name}") for name in w}
    checks["x"] = g.grad_x
    if cross:
        checks["memory"] = g.grad_memory
    for name, analytic in checks.items():
        point = {"x": x, "memory": memory, **w}[name]
        fd = central_difference(lambda a, name=name: loss(**{name: a}), point)
        assert analytic.shape == point.shape
        np.testing.assert_allclose(analytic, fd, rtol=1e-7, atol=1e-9, err_msg=name)


def test_self_attention_accumulates_q_k_and_v_into_one_stream():
    x, _, w, visible, g_o = _setup(False)
    g = projection_backward(_forward(x, None, w, visible), g_o)
    assert g.grad_memory is None
    np.testing.assert_array_equal(g.grad_x, g.branches["q"] + g.branches["k"]
                                  + g.branches["v"])
    for role in "qkv":  # every role really contributes
        assert np.abs(g.branches[role]).max() > 1e-3


def test_cross_attention_sends_q_to_the_target_and_k_v_to_the_memory():
    x, memory, w, visible, g_o = _setup(True)
    g = projection_backward(_forward(x, memory, w, visible), g_o)
    np.testing.assert_array_equal(g.grad_x, g.branches["q"])
    np.testing.assert_array_equal(g.grad_memory, g.branches["k"] + g.branches["v"])
    assert g.grad_x.shape == (B, Q, D_MODEL) and g.grad_memory.shape == (B, K, D_MEM)


def test_self_attention_is_cross_attention_reading_its_own_stream():
    # passing memory=x splits the same total gradient across the two stream slots
    x, _, w, visible, g_o = _setup(False, seed=2)
    selfg = projection_backward(_forward(x, None, w, visible), g_o)
    cross = projection_backward(_forward(x, x, w, visible), g_o)
    np.testing.assert_allclose(cross.grad_x + cross.grad_memory, selfg.grad_x, rtol=1e-14,
                               atol=1e-15)
    np.testing.assert_array_equal(cross.grad_w_k, selfg.grad_w_k)


def test_projection_without_biases_and_with_a_parametrised_call():
    x, memory, w, _, g_o = _setup(True, seed=3)
    r = project_attention(x, w["w_q"], w["w_k"], w["w_v"], memory=memory, num_heads=HQ,
                          num_kv_heads=HKV, softcap=2.0, scale=0.5)
    g = projection_backward(r, g_o)
    assert g.grad_b_q is None and g.grad_b_k is None and g.grad_b_v is None

    def loss(a):
        out = project_attention(x, a, w["w_k"], w["w_v"], memory=memory, num_heads=HQ,
                                num_kv_heads=HKV, softcap=2.0, scale=0.5).trace.output
        return float((out * g_o).sum())

    np.testing.assert_allclose(g.grad_w_q, central_difference(loss, w["w_q"]), rtol=1e-7,
                               atol=1e-9)


def test_projection_rejects_bad_orientation_and_widths():
    x, memory, w, _, _ = _setup(True)
    # nn.Linear orientation [Dout, Din] passed where [Din, Dout] is expected
    with pytest.raises(RefAttnError, match=r"w_k: input axis 3 must equal memory's width 4 .*"
                                           r"linear_weight_to_equation"):
        project_attention(x, w["w_q"], w["w_k"].T, w["w_v"], memory=memory, num_heads=HQ,
                          num_kv_heads=HKV)
    with pytest.raises(RefAttnError, match=r"w_k: input axis 6 must equal memory's width 4 "
                                           r"\(equation orientation"):
        project_attention(x, w["w_q"], np.ones((D_MODEL, DK)), w["w_v"], memory=memory,
                          num_heads=HQ, num_kv_heads=HKV)
    with pytest.raises(RefAttnError, match=r"w_q: output width 6 is not divisible by 4 heads"):
        project_attention(x, w["w_q"], w["w_k"], w["w_v"], memory=memory, num_heads=4,
                          num_kv_heads=HKV)
    with pytest.raises(RefAttnError, match=r"x: expected dtype float64, got float32"):
        project_attention(x.astype(np.float32), w["w_q"], w["w_k"], w["w_v"], num_heads=HQ)
    with pytest.raises(RefAttnError, match=r"b_q: expected shape \[6\], got \[5\]"):
        project_attention(x, w["w_q"], w["w_k"], w["w_v"], memory=memory, num_heads=HQ,
                          num_kv_heads=HKV, b_q=np.zeros(5))
    with pytest.raises(RefAttnError, match=r"memory: batch B=1 must equal x's B=2"):
        project_attention(x, w["w_q"], w["w_k"], w["w_v"], memory=memory[:1], num_heads=HQ,
                          num_kv_heads=HKV)


def test_linear_weight_conversion():
    w = np.arange(12.0).reshape(3, 4)  # nn.Linear(in=4, out=3).weight
    eq = linear_weight_to_equation(w)
    x = np.arange(4.0)
    np.testing.assert_array_equal(x @ eq, w @ x)  # x W == (W_linear x)
    with pytest.raises(RefAttnError, match=r"weight: expected 2 axes"):
        linear_weight_to_equation(np.ones(3))


@pytest.mark.torch
def test_projection_gradients_match_torch_autograd_with_linear_layers():
    torch = pytest.importorskip("torch")
    x, memory, _, visible, g_o = _setup(True, seed=5)
    torch.manual_seed(0)
    lin = {n: torch.nn.Linear(d_in, d_out, dtype=torch.float64) for n, d_in, d_out in
           (("q", D_MODEL, HQ * DK), ("k", D_MEM, HKV * DK), ("v", D_MEM, HKV * DV))}
    tx = torch.from_numpy(x).requires_grad_()
    tm = torch.from_numpy(memory).requires_grad_()

    def heads(t, h):
        return t.reshape(B, t.shape[1], h, -1).transpose(1, 2)

    tq, tk, tv = heads(lin["q"](tx), HQ), heads(lin["k"](tm), HKV), heads(lin["v"](tm), HKV)
    tk, tv = tk.repeat_interleave(HQ // HKV, 1), tv.repeat_interleave(HQ // HKV, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=torch.from_numpy(visible))
    (out * torch.from_numpy(g_o)).sum().backward()

    def eq(name):
        return linear_weight_to_equation(lin[name].weight.detach().numpy())

    r = project_attention(x, eq("q"), eq("k"), eq("v"), memory=memory, num_heads=HQ,
                          num_kv_heads=HKV, visible=visible,
                          **{f"b_{n}": lin[n].bias.detach().numpy() for n in "qkv"})
    np.testing.assert_allclose(r.trace.output, out.detach().numpy(), rtol=1e-12, atol=1e-13)
    g = projection_backward(r, g_o)
    for n in "qkv":
        np.testing.assert_allclose(getattr(g, f"grad_w_{n}"),
                                   linear_weight_to_equation(lin[n].weight.grad.numpy()),
                                   rtol=1e-11, atol=1e-12, err_msg=n)
        np.testing.assert_allclose(getattr(g, f"grad_b_{n}"), lin[n].bias.grad.numpy(),
                                   rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(g.grad_x, tx.grad.numpy(), rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(g.grad_memory, tm.grad.numpy(), rtol=1e-11, atol=1e-12)
