"""Issue 19 on the GPU kernels (CPU emulator): unions and intersections of relations evaluated
in the kernel from the leaves' coordinates and a postfix program, and sinks over rows with no
legal key. Every tensor against the NumPy reference with the tolerances of test_emulator."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import refattn
from gpu_backend import launch
from gpu_backend.emulator_backend import EmulatorDevice
from refattn import AttentionCall
from refattn.masks import causal, relation
from tests.engine.test_composed_relations import RELATIONS
from tests.gpu.test_emulator import assert_matches_reference
from tests.strategies import composed_relations


def _run(call, g_o, **options):
    t = refattn.forward(call, backend="cuda_emulator", **options)
    return t, refattn.backward(t, g_o)


def _inputs(shape, seed=0, Hq=2, Hkv=1, D=4):
    B, _, Q, K = shape
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, Hq, Q, D)), rng.standard_normal((B, Hkv, K, D)),
            rng.standard_normal((B, Hkv, K, D)), rng.standard_normal((B, Hq, Q, D)))


@pytest.mark.parametrize("materialize", [True, False], ids=["trace", "streaming"])
@pytest.mark.parametrize("name", sorted(RELATIONS))
def test_compositions_in_the_kernel(name, materialize):
    rel = RELATIONS[name]
    q, k, v, g = _inputs(rel.shape)
    call = AttentionCall(q, k, v, visible=rel)
    t, grads = _run(call, g, materialize=materialize)
    assert_matches_reference(call, g, t, grads, name)
    # fully invisible 32 x 32 tiles are skipped exactly as with the dense mask
    dense = AttentionCall(q, k, v, visible=rel.dense())
    assert t.materialized["tiles_skipped"] == refattn.forward(
        dense, backend="cuda_emulator", materialize=False).materialized["tiles_skipped"]


def test_the_launcher_sends_leaves_and_program():
    rel = RELATIONS["document_causal"]
    q, k, v, _ = _inputs(rel.shape)
    L = launch._prepare(AttentionCall(q, k, v, visible=rel), EmulatorDevice())
    got = {n: L.device.to_host(L.slots[n]) for n in ("REL_PROGRAM", "REL_LEAF", "Q_POS")}
    assert got["REL_PROGRAM"].tolist() == rel.program().tolist() == [0, 1, 2, -2, -1]
    assert got["REL_LEAF"].tolist() == [[0, 1], [1, 0], [0, 0]]  # (segments, topology)
    assert got["Q_POS"].shape == (3, 1, rel.shape[2])  # (L, Br, Q)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rel=composed_relations(), materialize=st.booleans())
def test_generated_compositions_match_the_reference(rel, materialize):
    if not rel.dense().any(axis=-1).all():
        return  # every row needs a key under the reject policy (sinks cover the rest below)
    q, k, v, g = _inputs(rel.shape, 3, Hq=max(2, rel.shape[1]))
    call = AttentionCall(q, k, v, visible=rel)
    t, grads = _run(call, g, materialize=materialize)
    assert_matches_reference(call, g, t, grads)


@pytest.mark.parametrize("materialize", [True, False], ids=["trace", "streaming"])
def test_sinks_over_empty_rows(materialize):
    # lower-right causal with Q > K: the first 3 rows read no key; a union with a relation
    # that is empty on those rows too keeps them empty
    rel = causal(40, 37, alignment="lower_right") | relation(
        [np.arange(40) - 3], [np.arange(37)], causal=True, window=(1, 0))
    q, k, v, g = _inputs(rel.shape, 5, Hq=3, Hkv=1)
    call = AttentionCall(q, k, v, visible=rel, sink=np.array([0.5, -2.0, 1.5]))
    assert call.empty_rows_with_sink().shape == (9, 3)
    t, grads = _run(call, g, materialize=materialize)
    assert_matches_reference(call, g, t, grads)
    np.testing.assert_array_equal(t.lse[0, :, :3], np.repeat(call.sink[:, None], 3, 1))
    assert (t.output[0, :, :3] == 0.0).all() and not t.sanitized_rows.any()
