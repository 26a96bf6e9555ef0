"""refattn.distributed.keyshard: a call cut into 2-8 key shards and merged equals the unsharded
call for every engine feature (forward and every gradient), within the documented float64
bound; Philox masks identical; the sink counted once; planted bugs caught."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refattn
from refattn.call.scores import Additive, Bilinear, Cosine, Dot
from refattn.distributed import keyshard
from refattn.distributed.keyshard import key_sharded
from refattn.distributed.shard import _philox_multiplier
from refattn.dropout import Philox
from refattn.engine.reduce import gather_heads, reduce_to_shape, sum_heads
from refattn.errors import RefAttnError
from refattn.masks import relation
from tests.strategies import visibility_inputs

EPS = 2.0**-53


# -- cases -----------------------------------------------------------------------------------
@st.composite
def cases(draw, *, features=None):
    """(call, grad_output, shards) with every feature drawn."""
    seed = draw(st.integers(0, 2**32 - 1))
    r = np.random.default_rng(seed)
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
    Hq, Q, K = Hkv * G, draw(st.integers(1, 4)), draw(st.integers(2, 9))
    D, Dv = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    family = draw(st.sampled_from(["dot", "bilinear", "additive", "cosine"]))
    Dk = draw(st.integers(1, 3)) if family in ("bilinear", "additive") else D
    q = r.standard_normal((B, Hq, Q, D))
    k = r.standard_normal((B, Hkv, K, Dk))
    v = r.standard_normal((B, Hkv, K, Dv))
    score = {"dot": lambda: Dot(), "cosine": lambda: Cosine(),
             "bilinear": lambda: Bilinear(r.standard_normal((Hq, D, Dk)) / 2),
             "additive": lambda: Additive(r.standard_normal((Hq, 2, D)),
                                          r.standard_normal((Hq, 2, Dk)),
                                          r.standard_normal((Hq, 2)),
                                          r.standard_normal((Hq, 2)))}[family]()
    kw = {"score": score, "scale": draw(st.sampled_from([0.4, 1.0, 1.7])),
          "scale_placement": draw(st.sampled_from(["post", "q", "k", "split"]))
          if score.linear_in_operands else "post",
          "head_map": np.repeat(np.arange(Hkv), G) if draw(st.booleans())
          else np.tile(np.arange(Hkv), G)}
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([1.5, 4.0]))
    if draw(st.booleans()):
        kw["sink"] = r.standard_normal(Hq)
    bias = draw(st.sampled_from(["none", "full", "keys", "rows", "scalar"]))
    if bias != "none":
        shape = {"full": (B, Hq, Q, K), "keys": (1, Hq, 1, K), "rows": (B, 1, Q, 1),
                 "scalar": (1, 1, 1, 1)}[bias]
        kw["bias"] = r.standard_normal(shape)
    vis = draw(st.sampled_from(["none", "array", "relation"]))
    if vis == "array":
        kw["visible"] = r.random((draw(st.sampled_from([1, B])), Hq, Q, K)) < 0.6
    elif vis == "relation":
        kw["visible"] = relation(**draw(visibility_inputs(sizes=(B, Hq, Q, K))))
    drop = draw(st.sampled_from(["none", "philox", "array"]))
    if drop == "philox":
        kw["dropout"] = Philox(0.3, seed=int(r.integers(0, 2**63)))
    elif drop == "array":
        kw["dropout"] = np.where(r.random((B, Hq, Q, K)) < 0.3, 0.0, 1 / 0.7)
    if vis == "array":
        has = np.broadcast_to(kw["visible"], (B, Hq, Q, K)).any(axis=-1)
    elif vis == "relation":
        has = np.broadcast_to(kw["visible"].row_any(), (B, Hq, Q))
    else:
        has = np.ones((B, Hq, Q), dtype=bool)
    empty = ~has  # (B, Hq, Q)
    if empty.any() and "sink" not in kw:
        kw["all_masked_rows"] = "sanitize_then_zero_invalid_query"
        kw["query_valid"] = ~empty.any(axis=1)[:, None, :, None]
    call = refattn.AttentionCall(q, k, v, **kw)
    shards = draw(st.integers(2, min(8, K)))
    return call, r.standard_normal((B, Hq, Q, Dv)), shards


# -- the documented bound --------------------------------------------------------------------
def bound_terms(call, trace, grads, shards):
    """gamma and the term magnitudes of keyshard's module docstring, from the reference."""
    masked = trace.masked_scores
    legal = np.isfinite(masked)
    lse = trace.lse[np.isfinite(trace.lse)]
    R = (np.abs(masked[legal]).max() if legal.any() else 0.0) + (
        np.abs(lse).max() if lse.size else 0.0)
    K, D = call.score_shape[3], max(call.q.shape[3], call.v.shape[3])
    gamma = 8 * (K + shards + D + R + 2) * EPS
    head_map = call.head_map
    pz = np.abs(trace.consumed)  # |P Z| (B, Hq, Q, K)
    v_eff = np.abs(gather_heads(call.v, head_map))
    terms = {"output": pz @ v_eff}
    if grads is not None:
        g_o = np.abs(np.where(call.query_valid_full(), grads.grad_output, 0.0))
        terms["grad_v"] = sum_heads(pz.swapaxes(-1, -2) @ g_o, head_map, call.k.shape[1])
        t_ds = trace.probs * (np.abs(grads.grad_probs) + np.abs(grads.row_dot)[..., None])
        terms["dS"] = t_ds
    return gamma, R, terms


def failures(call, res, trace, grads, shards):
    """Every comparison of ``res`` with the unsharded reference outside the bound."""
    gamma, R, terms = bound_terms(call, trace, grads, shards)
    bad = []
    err = np.abs(res.output - trace.output)
    if not (err <= gamma * terms["output"] + 1e-300).all():
        bad.append(f"output {err.max():.3g}")
    keep = ~call.sanitized_rows()
    lse_err = np.abs(res.lse - trace.lse)[keep]
    if not (lse_err <= gamma * (1 + np.abs(trace.lse[keep]))).all():
        bad.append(f"lse {lse_err.max():.3g}")
    if not (res.lse[~keep] == -np.inf).all():
        bad.append("sanitized rows' lse")
    if grads is None:
        return bad
    g = res.gradients
    err = np.abs(g.grad_v - grads.grad_v)
    if not (err <= gamma * terms["grad_v"] + 1e-300).all():
        bad.append(f"grad_v {err.max():.3g}")
    # normwise: gamma (1 + R) (max |G| + Omega * max_i sum_j P (|G_P| + |D|))
    t_ds = terms["dS"]
    ops = [np.abs(call.q).max(), np.abs(call.k).max(), 1.0]
    fam = call.score
    if fam.name == "bilinear":
        ops.append(np.abs(fam.W).max() * fam.W.shape[-1])
    if fam.name == "additive":
        ops.append(np.abs(fam.v).max() * max(np.abs(fam.Wq).max(), np.abs(fam.Wk).max()) * 4)
    if fam.name == "cosine":
        norms = [np.linalg.norm(x, axis=-1).min() for x in (call.q, call.k)]
        ops.append(1.0 / max(min(norms), fam.eps))
    omega = max(abs(call.scale), 1.0) * float(np.prod(sorted(ops)[-2:])) * (1 + call.q.shape[3])
    row_sum = t_ds.sum(axis=-1).max() if t_ds.size else 0.0
    for name in ("grad_q", "grad_k", "grad_sink"):
        ref, got = getattr(grads, name), getattr(g, name)
        if ref is None:
            assert got is None, name
            continue
        tol = gamma * (1 + R) * (np.abs(ref).max() + omega * row_sum * K_of(call))
        if not (np.abs(got - ref) <= tol + 1e-300).all():
            bad.append(f"{name} {np.abs(got - ref).max():.3g} > {tol:.3g}")
    if grads.grad_bias is not None:
        tb = reduce_to_shape(t_ds, call.bias.shape)
        err = np.abs(g.grad_bias - grads.grad_bias)
        if not (err <= gamma * (1 + R) * (tb + np.abs(grads.grad_bias)) + 1e-300).all():
            bad.append(f"grad_bias {err.max():.3g}")
    for name, ref in (grads.grad_score_params or {}).items():
        got = g.grad_score_params[name]
        tol = gamma * (1 + R) * (np.abs(ref).max() + omega * t_ds.sum())
        if not (np.abs(got - ref) <= tol + 1e-300).all():
            bad.append(f"{name} {np.abs(got - ref).max():.3g}")
    return bad


def K_of(call):
    return call.score_shape[3]


def reference(call, g):
    trace = refattn.forward(call)
    return trace, refattn.backward(trace, g)


# -- every feature, 2-8 shards ---------------------------------------------------------------
@settings(max_examples=120, deadline=None)
@given(cases())
def test_sharded_equals_unsharded(case):
    call, g, shards = case
    trace, grads = reference(call, g)
    res = key_sharded(call, g, shards=shards)
    assert failures(call, res, trace, grads, shards) == []
    assert len(res.ranges) == shards and res.ranges[-1][1] == call.score_shape[3]
    if call.dropout is not None:  # the mask, bit for bit
        z = np.concatenate([np.broadcast_to(m, (*call.score_shape[:3], j1 - j0))
                            for m, (j0, j1) in zip(res.multipliers, res.ranges, strict=True)],
                           axis=-1)
        assert np.array_equal(z, call.multiplier_full())
    n_partials = shards + (call.sink is not None)  # the sink once, as its own partial
    assert res.partial_lses.shape[0] == n_partials


@settings(max_examples=15, deadline=None)
@given(cases())
def test_one_shard_forward_is_byte_identical(case):
    call, _, _ = case
    trace = refattn.forward(call)
    res = key_sharded(call, shards=1)
    if call.sink is None:
        assert np.array_equal(res.output, trace.output)
        keep = ~call.sanitized_rows()
        assert np.array_equal(res.lse[keep], trace.lse[keep])
    assert res.gradients is None


def feature_call(feature):
    """One feature at a time on a GQA call (Hq=4 over Hkv=2), B=2, Q=5, K=11."""
    r = np.random.default_rng(FEATURES.index(feature))
    B, Hq, Hkv, Q, K, D = 2, 4, 2, 5, 11, 3
    q, k, v = (r.standard_normal((B, Hq, Q, D)), r.standard_normal((B, Hkv, K, D)),
               r.standard_normal((B, Hkv, K, 2)))
    kw = {}
    if feature == "softcap":
        kw["softcap"] = 1.5
    elif feature == "sink":
        kw["sink"] = r.standard_normal(Hq)
    elif feature.startswith("bias"):
        shape = {"bias_full": (B, Hq, Q, K), "bias_keys": (K,), "bias_rows": (Q, 1)}[feature]
        kw["bias"] = r.standard_normal(shape)
    elif feature in ("bilinear", "additive", "cosine"):
        kw["score"] = {"bilinear": lambda: Bilinear(r.standard_normal((D, D))),
                       "cosine": lambda: Cosine(),
                       "additive": lambda: Additive(*(r.standard_normal(s) for s in (
                           (Hq, 3, D), (Hq, 3, D), (Hq, 3), (Hq, 3))))}[feature]()
    elif feature in ("q", "k", "split"):
        kw["scale_placement"] = feature
    elif feature == "philox":
        kw["dropout"] = Philox(0.25, seed=1234)
    elif feature == "varlen":  # packed sequences 3 + 2 (queries) against 6 + 5 (keys)
        kw["visible"] = relation([[0, 1, 2, 0, 1]] * B, [list(range(6)) + list(range(5))] * B,
                                 q_segment=[[0, 0, 0, 1, 1]] * B,
                                 k_segment=[[0] * 6 + [1] * 5] * B)
    elif feature == "window":  # per-head sliding windows: some shards see no key of a row
        kw["visible"] = relation([[8, 9, 10, 3, 4]] * B, [list(range(K))] * B, causal=True,
                                 window=(np.array([0, 1, 2, 3]), 0))
    elif feature == "empty_rows":  # rows with no key at all: sanitized, query_valid False
        vis = r.random((B, 1, Q, K)) < 0.3
        vis[:, :, 1] = False
        kw.update(visible=vis, all_masked_rows="sanitize_then_zero_invalid_query",
                  query_valid=vis.any(axis=-1)[..., None])
    return refattn.AttentionCall(q, k, v, scale=0.7, head_map=np.array([0, 1, 0, 1]), **kw)


FEATURES = ["softcap", "sink", "bias_full", "bias_keys", "bias_rows", "bilinear", "additive",
            "cosine", "q", "k", "split", "philox", "varlen", "window", "empty_rows"]


@pytest.mark.parametrize("feature", FEATURES)
def test_each_feature(feature):
    call = feature_call(feature)
    g = np.random.default_rng(1).standard_normal((2, 4, 5, 2))
    trace, grads = reference(call, g)
    for shards in (2, 5, 8):
        res = key_sharded(call, g, shards=shards)
        assert failures(call, res, trace, grads, shards) == [], (feature, shards)


def test_against_the_numba_fused_call():
    """The unsharded numba call (value_and_grad's fused kernel) as the baseline."""
    r = np.random.default_rng(11)
    q, k, v = r.standard_normal((2, 4, 5, 3)), r.standard_normal((2, 2, 7, 3)), \
        r.standard_normal((2, 2, 7, 2))
    call = refattn.AttentionCall(q, k, v, softcap=3.0, sink=r.standard_normal(4),
                                 bias=r.standard_normal((1, 4, 5, 7)), scale_placement="split",
                                 dropout=Philox(0.2, seed=5), scale=0.6,
                                 visible=relation(np.arange(5)[None] + 2, np.arange(7)[None],
                                                  causal=True))
    g = r.standard_normal((2, 4, 5, 2))
    out, grads = refattn.value_and_grad(call, g, backend="numba")
    trace, ref = reference(call, g)
    res = key_sharded(call, g, shards=3)
    gamma, _, terms = bound_terms(call, trace, ref, 3)
    assert (np.abs(res.output - out) <= 2 * gamma * terms["output"]).all()
    for name in ("grad_q", "grad_k", "grad_v", "grad_bias", "grad_sink"):
        a, b = getattr(res.gradients, name), getattr(grads, name)
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-13 * np.abs(b).max())


# -- planted bugs: each must fail the comparison ---------------------------------------------
def planted_case(**extra):
    r = np.random.default_rng(5)
    q, k, v = r.standard_normal((1, 2, 4, 3)), r.standard_normal((1, 2, 8, 3)), \
        r.standard_normal((1, 2, 8, 3))
    call = refattn.AttentionCall(q, k, v, **extra)
    return call, r.standard_normal((1, 2, 4, 3))


def check(call, g, shards=4):
    trace, grads = reference(call, g)
    return failures(call, key_sharded(call, g, shards=shards), trace, grads, shards)


def test_honest_planted_cases_pass():
    assert check(*planted_case(sink=np.array([0.5, -1.0]))) == []
    assert check(*planted_case(dropout=Philox(0.4, seed=9))) == []
    assert check(*planted_case(softcap=2.0)) == []


def test_planted_sink_in_every_shard(monkeypatch):
    honest = keyshard._shard_kwargs

    def every_shard(call, j):
        kw, empty = honest(call, j)
        return {**kw, "sink": call.sink}, empty

    monkeypatch.setattr(keyshard, "_shard_kwargs", every_shard)
    bad = check(*planted_case(sink=np.array([0.5, -1.0])))
    assert any(b.startswith("output") for b in bad) and any(b.startswith("lse") for b in bad)


def test_planted_dropout_at_relative_coordinates(monkeypatch):
    def relative(call, j):
        B, Hq, Q, _ = call.score_shape
        return _philox_multiplier(call.dropout, Hq, range(B), range(Hq), (0, Q),
                                  (0, j[1] - j[0]))

    monkeypatch.setattr(keyshard, "_shard_multiplier", relative)
    bad = check(*planted_case(dropout=Philox(0.4, seed=9)))
    assert any(b.startswith("output") for b in bad)


def test_planted_backward_with_local_lse(monkeypatch):
    monkeypatch.setattr(keyshard, "_backward_lse", lambda part, merged: part.lse)
    bad = check(*planted_case(softcap=2.0))
    assert {b.split()[0] for b in bad} >= {"grad_q", "grad_k", "grad_v"}


# -- bad input -------------------------------------------------------------------------------
def test_refusals():
    call, g = planted_case()
    with pytest.raises(RefAttnError, match=r"shards: expected an int in \[1, 8\]"):
        key_sharded(call, shards=9)
    with pytest.raises(RefAttnError, match="grad_output"):
        key_sharded(call, g.astype(np.float32))
    with pytest.raises(RefAttnError, match="returned_weights"):
        key_sharded(refattn.AttentionCall(call.q, call.k, call.v, returned_weights="probs"))
