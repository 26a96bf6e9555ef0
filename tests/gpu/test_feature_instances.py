"""The kernels' feature instances (FlashAttention-2's compile-time switches): a call without
softcap, bias and dropout runs the plain forward, dq and dk/dv instances, compiled without
their code; any other call the general ones. Each is checked against the NumPy reference
through the emulator at the widths that have a plain instance (the conformance suite's calls
are all D <= 32), a mutation (the plain instance picked for a softcap call) is shown to be
caught, and the choice follows the device's shared memory (an A100's 163 KiB runs the general
backward at D = 128, an H100's 227 KiB the plain one)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import refattn
from gpu_backend import emulator_backend, launch
from gpu_backend.abi import INT_PARAMS
from gpu_backend.emulator_backend import EmulatorDevice
from gpu_backend.source import FEATURE_SETS, KERNEL_DIR, PLAIN, kernel_name
from refattn.dropout import Philox
from refattn.masks import relation

H100_SHARED = 232448
A100_SHARED = 166912
SM89_SHARED = 101376


class _Device:
    """The emulator with another device's shared-memory limit, recording the kernels run."""

    def __init__(self, max_shared_bytes: int, *, debug: bool = False, seed: int = 0) -> None:
        self._emulator = emulator_backend.device(debug, seed)
        self.max_shared_bytes = max_shared_bytes
        self.name = f"an emulated device with {max_shared_bytes} bytes"
        self.kernels: list[str] = []

    def __getattr__(self, name: str):
        return getattr(self._emulator, name)

    def get_function(self, name: str):
        self.kernels.append(name)
        return self._emulator.get_function(name)


def _call(D: int, seed: int = 0, *, heads: tuple[int, int] = (4, 2), Q: int = 70, K: int = 75,
          **features) -> refattn.AttentionCall:
    """B = 2, (Hq, Hkv) = ``heads`` (GQA), Q queries and K keys (70 and 75: tiles straddle the
    ends), a causal sliding-window relation with the last fifth of batch 1's keys padding
    (SKIP, FULL and PARTIAL tiles), a sink, unused queries; D wide."""
    rng = np.random.default_rng(seed)
    B, (Hq, Hkv) = 2, heads
    key_valid = np.ones((B, K), dtype=bool)
    key_valid[1, K - K // 5:] = False
    rel = relation(np.broadcast_to(np.arange(Q) + 5, (B, Q)),
                   np.broadcast_to(np.arange(K), (B, K)), key_valid, causal=True,
                   window=(40, None))
    query_valid = np.ones((B, Q), dtype=bool)
    query_valid[0, 3] = False
    return refattn.AttentionCall(
        rng.standard_normal((B, Hq, Q, D)), rng.standard_normal((B, Hkv, K, D)),
        rng.standard_normal((B, Hkv, K, D)), visible=rel, sink=np.linspace(-1, 1, Hq),
        query_valid=query_valid[:, None, :, None], **features)


def _features(D: int) -> dict[str, dict]:
    rng = np.random.default_rng(7)
    return {"plain": {}, "softcap": {"softcap": 2.5},
            "bias": {"bias": rng.standard_normal((70, 75))},
            "philox": {"dropout": Philox(0.2, 11)},
            "dense_dropout": {"dropout": np.where(rng.random((2, 4, 70, 75)) < 0.2, 0.0, 1.25)}}


def _check(call: refattn.AttentionCall, trace: refattn.Trace) -> None:
    ref = refattn.forward(call)
    for name in ("output", "lse", "row_max"):
        got, want = getattr(trace, name), getattr(ref, name)
        fin = np.isfinite(want)
        np.testing.assert_array_equal(np.isfinite(got), fin, err_msg=name)
        scale = np.abs(want[fin]).max(initial=1.0)
        np.testing.assert_allclose(got[fin], want[fin], rtol=0, atol=1e-12 * scale,
                                   err_msg=name)


#: the instance width of the head widths the tests use
WIDTH = {64: 64, 100: 128, 200: 256}


@pytest.mark.parametrize("D", [64, 100, 200])
@pytest.mark.parametrize("feature", ["plain", "softcap", "bias", "philox", "dense_dropout"])
def test_each_call_runs_the_instance_of_its_features_and_matches_the_reference(D, feature):
    call = _call(D, **_features(D)[feature])
    trace = refattn.forward(call, backend="cuda_emulator", materialize=False)
    want = kernel_name("forward", WIDTH[D], "plain" if feature == "plain" else "general")
    assert trace.materialized["kernel"] == want
    assert trace.materialized["kernel_features"] == ("plain" if feature == "plain"
                                                     else "general")
    assert trace.materialized["tiles_skipped"] > 0  # the window skips tiles
    _check(call, trace)


def test_the_trace_mode_and_the_backward_follow_a_plain_forward():
    call = _call(64, seed=2)
    g_o = np.random.default_rng(3).standard_normal(call.q.shape)
    trace = refattn.forward(call, backend="cuda_emulator")
    assert trace.materialized["kernel"] == "attention_forward_plain_d64"
    _check(call, trace)
    grads = refattn.backward(trace, g_o)
    ref = refattn.backward(refattn.forward(call), g_o)
    for name in ("grad_q", "grad_k", "grad_v"):
        want = getattr(ref, name)
        np.testing.assert_allclose(getattr(grads, name), want, rtol=0,
                                   atol=1e-12 * np.abs(want).max(), err_msg=name)


def test_the_plain_instance_picked_for_a_softcap_call_is_caught(monkeypatch):
    """The mutation: the launcher's choice forced to the plain instance. The softcap call's
    output then differs from the reference far beyond the tolerance, and it is the output of
    the same call without a softcap: the plain instance holds no softcap code at all."""
    call = _call(64, seed=4, softcap=1.5)
    monkeypatch.setattr(launch, "call_features", lambda ip: "plain")
    trace = refattn.forward(call, backend="cuda_emulator", materialize=False)
    assert trace.materialized["kernel"] == "attention_forward_plain_d64"
    with pytest.raises(AssertionError):
        _check(call, trace)
    uncapped = _call(64, seed=4)
    np.testing.assert_allclose(trace.output, refattn.forward(uncapped).output, rtol=0,
                               atol=1e-12)


@pytest.mark.parametrize(("name", "features"), [
    ("HAS_SOFTCAP", {"softcap": 2.0}), ("HAS_BIAS", {"bias": np.zeros((70, 75))}),
    ("DROP_MODE", {"dropout": Philox(0.5, 1)}),
    ("DROP_MODE", {"dropout": np.ones((2, 4, 70, 75))})])
def test_the_features_are_read_from_the_kernel_parameters(name, features):
    L = launch._prepare(_call(64, **features), EmulatorDevice(), 64)
    assert L.ip[INT_PARAMS.index(name)] != 0
    assert launch.call_features(L.ip) == "general"
    assert launch.call_features(launch._prepare(_call(64), EmulatorDevice(), 64).ip) == "plain"


def test_the_plain_table_matches_the_entry_points_and_the_devices_they_fit():
    """attention.cu's plain entry points instantiate refattn_<kind><D, MR, tile, 0> (no
    feature bit; then SPLIT and UNROLL_K where given) as source.PLAIN says; each fits an
    H100's shared memory, and those that do not fit an A100's are the ones not built for sm_8x
    (REFATTN_SM90_ONLY)."""
    src = (KERNEL_DIR / "attention.cu").read_text()
    entries = re.findall(r"void attention_(\w+)_plain_d(\d+)\(REFATTN_ARGS\) \{\s*"
                         r"(REFATTN_SM90_ONLY\()?refattn_\1<(\d+), (\d+), (\d+), 0"
                         r"(?:, [12])?(?:, [012])?>",
                         src)
    table = {(k, int(d)): (int(mr), int(tile)) for k, d, _, dd, mr, tile in entries
             if int(d) == int(dd)}
    sm90_only = {(k, int(d)) for k, d, only, *_ in entries if only}
    assert len(table) == len(entries) > 0
    assert table == {(k, D): v for k, dims in PLAIN.items() for D, v in dims.items()}
    assert set(PLAIN) == {"forward", "dq", "dkdv"}
    assert FEATURE_SETS["plain"][0] is PLAIN
    assert sm90_only == {(k, D) for k, D in table
                         if launch.shared_bytes(k, D, "plain") > A100_SHARED}
    assert sm90_only == {("dq", 128)}
    for (kind, D), (MR, tile) in table.items():
        limit = H100_SHARED if (kind, D) in sm90_only else A100_SHARED
        assert launch.shared_bytes(kind, D, "plain") <= limit
        p = launch.plan(kind, D, D, limit, features="plain")
        assert (p.kernel, p.rows, p.tile) == (kernel_name(kind, D, "plain"), 32 * MR, tile)
        # too little shared memory for the plain instance: the general one, or a refusal
        small = launch.shared_bytes(kind, D, "plain") - 8
        if launch.shared_bytes(kind, D) <= small:
            assert launch.plan(kind, D, D, small, features="plain").features == "general"
        else:
            with pytest.raises(refattn.RefAttnError, match="shared memory per block"):
                launch.plan(kind, D, D, small, features="plain")


def _check_gradients(grads, ref) -> None:
    """The gradients of Q, K, V and (where the call has one) the bias against the reference."""
    names = ("grad_q", "grad_k", "grad_v") + (("grad_bias",) if ref.grad_bias is not None else ())
    for name in names:
        want = getattr(ref, name)
        np.testing.assert_allclose(getattr(grads, name), want, rtol=0,
                                   atol=1e-12 * np.abs(want).max(), err_msg=name)


BACKWARD = ("attention_dq", "attention_dkdv")  # the backward kernels' name prefixes


def _backward_kernels(dev: _Device) -> tuple[str, ...]:
    return tuple(k for k in dev.kernels if k.startswith(BACKWARD))


def _backward_twice(limit: int, call, g_o, prefix, *, debug: bool = False):
    """Two forward and backward runs on the emulator with a device's shared-memory limit (with
    ``debug``: the debug build in two warp orders, seeds 0 and 1): the last trace, both runs'
    gradients, and the kernels whose names start with ``prefix`` that each run launched."""
    grads, kernels = [], []
    for seed in (0, 1):
        dev = _Device(limit, debug=debug, seed=seed if debug else 0)
        t = launch.forward(dev, call, materialize=False)
        grads.append(launch.backward(dev, t, g_o))
        kernels.append([k for k in dev.kernels if k.startswith(prefix)])
    return t, grads, kernels


def _assert_bit_identical(grads, names) -> None:
    for name in names:
        np.testing.assert_array_equal(getattr(grads[1], name), getattr(grads[0], name),
                                      err_msg=name)


@pytest.mark.parametrize(("D", "limit", "features"), [
    (64, H100_SHARED, ("plain", "plain")), (100, H100_SHARED, ("plain", "plain")),
    (100, A100_SHARED, ("general", "plain")), (200, H100_SHARED, ("plain", "wide")),
    (200, A100_SHARED, ("plain", "general"))])
def test_a_plain_backward_runs_the_instances_the_device_fits_and_matches_the_reference(
        D, limit, features):
    """GQA, a causal window with key padding (SKIP, FULL and PARTIAL tiles), a sink and unused
    queries, no softcap, bias or dropout: on an H100's shared memory the plain dq and dk/dv
    instances run (at D = 256 the wide dk/dv: no plain one there); on an A100's the general dq
    at D = 128 (the plain one needs 192 KiB) and the plain dk/dv (warp pairs, 136 KiB), the
    plain dq and the general dk/dv at D = 256; all give the reference's gradients."""
    call = _call(D, seed=5)
    g_o = np.random.default_rng(6).standard_normal(call.q.shape)
    dev = _Device(limit)
    trace = launch.forward(dev, call, materialize=False)
    grads = launch.backward(dev, trace, g_o)
    assert [k for k in dev.kernels if k.startswith("attention_forward")] == [
        kernel_name("forward", WIDTH[D], "plain")]
    assert _backward_kernels(dev) == (kernel_name("dq", WIDTH[D], features[0]),
                                      kernel_name("dkdv", WIDTH[D], features[1]))
    _check_gradients(grads, refattn.backward(refattn.forward(call), g_o))


def _d256_features(rng, which: str) -> dict:
    if which == "plain":
        return {}
    if which == "key-bias-philox":  # the bias gradient summed over queries by dk/dv
        return {"bias": rng.standard_normal((1, 1, 1, 40)), "dropout": Philox(0.2, 3)}
    return {"softcap": 3.0, "bias": rng.standard_normal((2, 2, 40, 40)),
            "dropout": np.where(rng.random((2, 2, 40, 40)) < 0.2, 0.0, 1.25)}


@pytest.mark.parametrize("features", ["plain", "key-bias-philox", "softcap-bias-dense-dropout"])
@pytest.mark.parametrize(("limit", "dkdv"), [(H100_SHARED, "attention_dkdv_wide_d256"),
                                           (A100_SHARED, "attention_dkdv_d256")],
                         ids=["H100", "A100"])
def test_the_d256_backward_where_the_device_holds_it(limit, dkdv, features):
    """At D = 256 the wide dk/dv (16-query tiles, 224 KiB) on an H100's shared memory, the
    general one (8-query tiles, 160 KiB) on an A100's, beside the plain dq (16-key tiles) for a
    call without features and the general dq otherwise: GQA, a causal window with key padding,
    a sink, and no feature, a per-key bias with Philox dropout (drawn per tile), or a softcap,
    a per-element bias and dense dropout multipliers, on the debug emulator (every shared
    access checked against the plan's bytes) in two warp orders, both the reference's
    gradients and bit-identical to each other."""
    rng = np.random.default_rng(14)
    call = _call(200, seed=14, heads=(2, 1), Q=40, K=40, **_d256_features(rng, features))
    g_o = rng.standard_normal(call.q.shape)
    _, runs, kernels = _backward_twice(limit, call, g_o, BACKWARD, debug=True)
    dq = kernel_name("dq", 256, "plain" if features == "plain" else "general")
    assert kernels == [[dq, dkdv]] * 2
    _check_gradients(runs[0], refattn.backward(refattn.forward(call), g_o))
    _assert_bit_identical(runs, ("grad_q", "grad_k", "grad_v", "grad_bias"))


@pytest.mark.parametrize("feature", ["softcap", "bias", "philox", "dense_dropout"])
def test_a_backward_with_a_feature_never_runs_the_plain_instances(feature):
    call = _call(64, seed=8, **_features(64)[feature])
    g_o = np.random.default_rng(9).standard_normal(call.q.shape)
    dev = _Device(H100_SHARED)
    grads = launch.backward(dev, launch.forward(dev, call, materialize=False), g_o)
    assert _backward_kernels(dev) == ("attention_dq_d64", "attention_dkdv_d64")
    _check_gradients(grads, refattn.backward(refattn.forward(call), g_o))


def test_the_plain_backward_forced_onto_a_softcap_call_is_caught(monkeypatch):
    """The mutation: the launcher's choice forced to the plain instances. The softcap call's
    gradients then differ from the reference, and they are the gradients of the same call
    without a softcap: the plain dq and dk/dv instances hold no softcap code."""
    call = _call(64, seed=10, softcap=1.5)
    g_o = np.random.default_rng(11).standard_normal(call.q.shape)
    monkeypatch.setattr(launch, "call_features", lambda ip: "plain")
    dev = _Device(H100_SHARED)
    grads = launch.backward(dev, launch.forward(dev, call, materialize=False), g_o)
    assert _backward_kernels(dev) == ("attention_dq_plain_d64", "attention_dkdv_plain_d64")
    with pytest.raises(AssertionError):
        _check_gradients(grads, refattn.backward(refattn.forward(call), g_o))
    uncapped = _call(64, seed=10)
    _check_gradients(grads, refattn.backward(refattn.forward(uncapped), g_o))


@pytest.mark.parametrize("kind", ["dq", "dkdv"])
def test_the_backward_plan_follows_the_device_limit(kind):
    """At D = 128 the plain dq where an H100's 227 KiB holds it, the general one on an A100's
    163 KiB; the plain dk/dv (warp pairs, 136 KiB) on both; a RefAttnError naming the general
    instance's bytes and the limit where nothing fits (99 KiB). A call with a feature runs the
    general instance, or the wide one (dq: warp pairs, 32-key tiles, 208 KiB) where the device
    holds it."""
    plain, general = launch.shared_bytes(kind, 128, "plain"), launch.shared_bytes(kind, 128)
    if kind == "dq":
        assert general <= A100_SHARED < plain <= H100_SHARED
    else:
        assert SM89_SHARED < plain < general <= A100_SHARED
    assert launch.plan(kind, 128, 128, H100_SHARED, features="plain").features == "plain"
    on_a100 = "general" if kind == "dq" else "plain"
    assert launch.plan(kind, 128, 128, A100_SHARED, features="plain").features == on_a100
    wide = "wide" if kind == "dq" else "general"
    assert launch.plan(kind, 128, 128, H100_SHARED).features == wide  # a feature used
    assert launch.plan(kind, 128, 128, A100_SHARED).features == "general"
    with pytest.raises(refattn.RefAttnError, match=f"{general} bytes.*allows {SM89_SHARED}"):
        launch.plan(kind, 128, 128, SM89_SHARED, features="plain")


def test_a_device_that_fits_no_backward_instance_is_refused_before_any_launch():
    call = _call(100, seed=12)
    g_o = np.random.default_rng(13).standard_normal(call.q.shape)
    trace = launch.forward(_Device(H100_SHARED), call, materialize=False)
    dev = _Device(SM89_SHARED)
    with pytest.raises(refattn.RefAttnError, match="shared memory per block"):
        launch.backward(dev, trace, g_o)
    assert dev.kernels == []
