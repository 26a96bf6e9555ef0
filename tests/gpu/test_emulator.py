"""The GPU kernels on the CPU emulator: the conformance suite, generated calls, every tensor
against the NumPy reference, and the emulator's own bug detectors on mutated kernel copies.

Tolerance (README, "GPU path"), kappa = max(1, max|scores| / 16) the conditioning of
exp(s - lse) in the scores: forward tensors within a normwise relative error of 1e-13 * kappa
and every element within 1e-12 * kappa * max|reference|; gradients, which are sums that may
cancel, within 1e-12 * kappa of their natural magnitude (tests/engine_compare.py); dropout
multipliers, sanitised rows and other integer or boolean outputs bit-equal.
"""

from __future__ import annotations

import dataclasses
import platform
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import refattn
from gpu_backend import launch
from gpu_backend.emulator.module import EmulatedModule
from gpu_backend.emulator_backend import EmulatorDevice
from gpu_backend.source import KERNEL_DIR
from refattn.bundle.suites import build_suite
from refattn.bundle.verification.verifier import verify
from refattn.bundle.writing.write import write_bundle
from refattn.dropout import Philox
from refattn.masks import causal
from tests.engine_compare import assert_close, natural_scales
from tests.strategies import engine_calls

NORMWISE = 1e-13
ELEMENTWISE = 1e-12
DOT_CASES = {c.case_id: c for c in build_suite("conformance") if c.call.score.name == "dot"}


def _kappa(scores) -> float:
    s = np.abs(np.asarray(scores)[np.isfinite(scores)])
    return max(1.0, (s.max() if s.size else 0.0) / 16)


def assert_matches_reference(call, g_o, trace, grads, what=""):
    ref = refattn.forward(call)
    rg = refattn.backward(ref, g_o)
    kappa = _kappa(ref.scores)
    want = {**ref.tensors(), **rg.tensors()}
    got = {**trace.tensors(), **grads.tensors()}
    natural = natural_scales(call, ref, rg)
    if "grad_scores" in natural:  # G_S (1 - tanh^2): the same sum times a slope in (0, 1]
        natural.setdefault("grad_softcap_input", natural["grad_scores"])
    for name, value in got.items():
        w = np.broadcast_to(want[name], np.shape(value))
        if value.dtype.kind != "f" or name == "dropout_multiplier":
            np.testing.assert_array_equal(value, w, err_msg=f"{what} {name}")
            continue
        fin = np.isfinite(w)
        np.testing.assert_array_equal(np.isfinite(value), fin, err_msg=f"{what} {name}")
        if name.startswith("grad_") and name in natural:
            assert_close(f"{what} {name}", value, w, natural[name], ELEMENTWISE * kappa,
                         zeros=False)
            continue
        diff = np.abs(value[fin] - w[fin])
        scale = np.abs(w[fin]).max(initial=0.0)
        norm = np.linalg.norm(w[fin])
        assert np.linalg.norm(diff) <= NORMWISE * kappa * norm + 1e-300, f"{what} {name}"
        assert diff.max(initial=0.0) <= ELEMENTWISE * kappa * scale + 1e-300, f"{what} {name}"


def _run(call, g_o, **options):
    t = refattn.forward(call, backend="cuda_emulator", **options)
    return t, refattn.backward(t, g_o)


# -- the conformance suite ----------------------------------------------------------------------
@pytest.mark.parametrize("materialize", [True, False], ids=["trace", "streaming"])
@pytest.mark.parametrize("case_id", sorted(DOT_CASES))
def test_conformance_case_through_the_emulator(case_id, materialize):
    case = DOT_CASES[case_id]
    t, g = _run(case.call, case.grad_output, materialize=materialize)
    assert t.backend == "cuda_emulator" and t.materialized["mode"] in ("trace", "streaming")
    assert_matches_reference(case.call, case.grad_output, t, g, case_id)


def test_verify_recomputes_a_bundle_through_the_emulator(tmp_path):
    # the float64 rule of verify (1e-12 + 1e-10 |g|) is not conditioning-aware, so the bundle
    # leaves out the cases whose scores reach past 64 (kappa > 4: logits near 1000, fp8
    # descales near 1e19; covered above with kappa)
    chosen = [c for c in build_suite("conformance")
              if c.call.score.name != "dot" or _kappa(refattn.forward(c.call).scores) <= 4]
    assert {"large_logits_positive", "quant_fa3_fp8_huge_descales"}.isdisjoint(
        c.case_id for c in chosen)
    write_bundle(tmp_path, chosen, suite="conformance")
    report = verify(tmp_path, gradcheck=False, backend="cuda_emulator")
    assert report.passed, report.format()
    noted = {c.case_id for c in report.cases if c.notes}  # the families the GPU path lacks
    assert noted == {c.case_id for c in chosen if c.call.score.name != "dot"}


# -- generated calls ------------------------------------------------------------------------------
@st.composite
def gpu_calls(draw):
    """engine_calls (masks, GQA, bias, dropout, query validity) plus softcap, sink and the
    lengths that straddle the 32-wide tiles."""
    call = draw(engine_calls(max_len=40, max_width=6))
    extra = {}
    if draw(st.booleans()):
        extra["softcap"] = draw(st.sampled_from([0.5, 3.0, 30.0]))
    if draw(st.booleans()):
        extra["sink"] = np.linspace(-1.0, 2.0, call.q.shape[1])
    return dataclasses.replace(call, **extra) if extra else call


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=gpu_calls(), materialize=st.booleans())
def test_generated_calls_match_the_reference(call, materialize):
    g_o = np.random.default_rng(1).standard_normal((*call.q.shape[:3], call.v.shape[3]))
    t, g = _run(call, g_o, materialize=materialize)
    assert_matches_reference(call, g_o, t, g)


# -- properties of the path ------------------------------------------------------------------------
def _call(shape=(2, 3, 45, 37, 8), **kw):
    B, H, Q, K, D = shape
    rng = np.random.default_rng(3)
    return refattn.AttentionCall(rng.standard_normal((B, H, Q, D)),
                                 rng.standard_normal((B, H, K, D)),
                                 rng.standard_normal((B, H, K, D)), **kw)


def test_bit_identical_run_to_run_and_dropout_multipliers_bit_equal_to_the_cpu():
    call = _call(dropout=Philox(0.3, 2**40 + 9, offset=5),
                 visible=causal(45, 37, alignment="upper_left"))
    g_o = np.ones((2, 3, 45, 8))
    a, b = _run(call, g_o), _run(call, g_o)
    for x, y in ((a[0].tensors(), b[0].tensors()), (a[1].tensors(), b[1].tensors())):
        assert all(np.array_equal(x[n], y[n], equal_nan=True) for n in x)
    np.testing.assert_array_equal(a[0].dropout_multiplier, call.multiplier_full())


@pytest.mark.parametrize("materialize", [False, True], ids=["streaming", "trace"])
def test_head_widths_above_128_run_on_the_d256_instance(materialize):
    """Dk = 200, Dv = 256 run on the D = 256 kernels (the warps' own rows of Q, G_O, K and V
    read from global memory), with lengths that end inside a tile (19 queries, 13 keys: rows
    past the end are clamped), GQA, a causal mask, softcap, bias and Philox dropout."""
    rng = np.random.default_rng(256)
    call = refattn.AttentionCall(rng.standard_normal((1, 2, 19, 200)),
                                 rng.standard_normal((1, 1, 13, 200)),
                                 rng.standard_normal((1, 1, 13, 256)),
                                 bias=rng.standard_normal((1, 2, 19, 13)), softcap=3.0,
                                 visible=causal(19, 13, alignment="upper_left"),
                                 dropout=Philox(0.2, 11))
    g_o = rng.standard_normal((1, 2, 19, 256))
    t, g = _run(call, g_o, materialize=materialize)
    assert t.materialized["head_width"] == 256
    assert_matches_reference(call, g_o, t, g, "D=256")


@pytest.mark.parametrize("bias_shape", [(1, 2, 37, 70), (1, 1, 1, 70)],
                         ids=["per-element", "per-key"])
@pytest.mark.parametrize(("Dk", "Dv"), [(40, 64), (100, 128)], ids=["D=64", "D=128"])
def test_the_backward_instances_at_64_and_128_with_every_feature(Dk, Dv, bias_shape):
    """The dq and dk/dv kernels at D = 64 (16-row warps in both) and 128 with GQA, a causal
    mask, softcap, Philox dropout and a bias whose gradient is per element (dq writes it) or
    summed over queries (dk/dv); 37 queries and 70 keys end inside the tiles and the blocks
    (dk/dv at D = 64: 64 keys per block, 16-query tiles)."""
    rng = np.random.default_rng(Dk)
    call = refattn.AttentionCall(rng.standard_normal((1, 2, 37, Dk)),
                                 rng.standard_normal((1, 1, 70, Dk)),
                                 rng.standard_normal((1, 1, 70, Dv)),
                                 bias=rng.standard_normal(bias_shape), softcap=3.0,
                                 visible=causal(37, 70, alignment="lower_right"),
                                 dropout=Philox(0.2, 7))
    g_o = rng.standard_normal((1, 2, 37, Dv))
    t, g = _run(call, g_o, materialize=False)
    assert t.materialized["head_width"] == Dv
    assert g.grad_bias.shape == bias_shape
    assert_matches_reference(call, g_o, t, g, f"D={Dv}")


def test_a_kv_head_without_query_heads_gets_zero_gradients():
    # pinned from the generated calls: dk/dv's shared dV accumulator was zeroed by other lanes
    # than the ones that read it, so a kv head that no query head maps to read stale values
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 3, n, 1)) for n in (1, 2, 2))
    call = refattn.AttentionCall(q, k, v, head_map=np.array([2, 0, 0]))
    g_o = rng.standard_normal((1, 3, 1, 1))
    t, g = _run(call, g_o, materialize=False)
    assert not g.grad_v[0, 1].any() and not g.grad_k[0, 1].any()
    assert_matches_reference(call, g_o, t, g)


@pytest.mark.parametrize("shape", [(1, 3, 1, 37), (2, 1, 1, 37), (45, 37), (1, 1, 1, 1),
                                   (2, 3, 45, 1), (2, 3, 45, 37)],
                         ids=["keys", "batch-keys", "qk", "scalar", "rows", "full"])
def test_every_bias_broadcast_gets_its_gradient(shape):
    bias = np.random.default_rng(4).standard_normal(shape)
    call = _call(bias=bias)
    g_o = np.random.default_rng(5).standard_normal((2, 3, 45, 8))
    t, g = _run(call, g_o, materialize=False)
    assert g.grad_bias.shape == bias.shape
    assert_matches_reference(call, g_o, t, g)


def test_fully_invisible_tiles_are_skipped():
    mask = causal(96, 96, alignment="upper_left")
    call = _call((1, 2, 96, 96, 8), visible=mask)
    t = refattn.forward(call, backend="cuda_emulator", materialize=False)
    bq, bk = t.materialized["block_q"], t.materialized["block_k"]
    dense = np.broadcast_to(np.asarray(call.visible_full()), (1, 2, 96, 96))
    seen = [dense[0, h, i:i + bq, j:j + bk].any() for h in range(2)
            for i in range(0, 96, bq) for j in range(0, 96, bk)]
    assert (t.materialized["tiles_computed"], t.materialized["tiles_skipped"]) == (
        sum(seen), len(seen) - sum(seen))
    assert t.materialized["tiles_skipped"] > 0


def test_unsupported_inputs_are_named_errors_before_any_launch():
    from refattn.call.scores import Cosine

    x = np.ones((1, 1, 2, 4))
    with pytest.raises(refattn.RefAttnError, match="dot family only"):
        refattn.forward(refattn.AttentionCall(x, x, x, score=Cosine(), scale=1.0),
                        backend="cuda_emulator")
    wide = np.ones((1, 1, 2, 600))
    with pytest.raises(refattn.RefAttnError, match=r"Dk=600, Dv=600 have no forward kernel "
                                                   r"instance.*\[32, 64, 128, 256\]"):
        refattn.forward(refattn.AttentionCall(wide, wide, wide), backend="cuda_emulator")
    with pytest.raises(refattn.RefAttnError, match="materialize"):
        refattn.forward(refattn.AttentionCall(x, x, x), backend="cuda_emulator",
                        materialize="yes")


# -- the emulator catches kernel bugs --------------------------------------------------------------
def _mutated(tmp_path: Path, old: str, new: str, name: str = "attention.cu") -> Path:
    d = tmp_path / "kernels"
    shutil.copytree(KERNEL_DIR, d)
    src = (d / name).read_text()
    assert old in src, old
    (d / name).write_text(src.replace(old, new, 1))
    return d


def _outputs(directory: Path, seeds=(0, 1, 2)) -> list[np.ndarray]:
    call = _call((1, 2, 70, 70, 8))
    return [launch.forward(EmulatorDevice(directory, debug=True, seed=s), call,
                           materialize=False).output for s in seeds]


def test_the_debug_emulator_is_quiet_on_correct_kernels():
    outs = _outputs(KERNEL_DIR)
    ref = refattn.forward(_call((1, 2, 70, 70, 8))).output
    assert all(np.array_equal(o, outs[0]) for o in outs)
    np.testing.assert_allclose(outs[0], ref, rtol=1e-13, atol=1e-14)


def test_the_assembly_and_the_ucontext_fibers_give_the_same_bits():
    """The fibers switch by a few instructions of assembly on x86-64 and by ucontext elsewhere
    (``REFATTN_EMU_UCONTEXT``): a forward and backward whose kernels meet barriers, warp
    shuffles and mma.sync (GQA, causal, Philox dropout, a sink) give the same bits both ways,
    in a debug build's random thread order, and a define that is not a name is refused."""
    rng = np.random.default_rng(21)
    call = refattn.AttentionCall(
        rng.standard_normal((1, 4, 40, 16)), rng.standard_normal((1, 2, 40, 16)),
        rng.standard_normal((1, 2, 40, 16)), visible=causal(40, 40, alignment="upper_left"),
        sink=np.zeros(4), dropout=Philox(0.25, 5))
    g_o = rng.standard_normal(call.q.shape)
    runs, libraries = [], []
    for defines in ((), ("REFATTN_EMU_UCONTEXT",)):
        dev = EmulatorDevice(debug=True, seed=3)
        dev.module = EmulatedModule(KERNEL_DIR, debug=True, seed=3, defines=defines)
        libraries.append(dev.module.path.read_bytes())
        t = launch.forward(dev, call, materialize=False)
        runs.append((t, launch.backward(dev, t, g_o)))
    assert b"swapcontext" in libraries[1]
    if platform.machine() in ("x86_64", "AMD64"):  # the default build: no system call per switch
        assert b"refattn_emu_switch" in libraries[0] and b"swapcontext" not in libraries[0]
    for name in ("output", "lse"):
        np.testing.assert_array_equal(getattr(runs[1][0], name), getattr(runs[0][0], name))
    for name in ("grad_q", "grad_k", "grad_v", "grad_sink"):
        np.testing.assert_array_equal(getattr(runs[1][1], name), getattr(runs[0][1], name))
    want = refattn.backward(refattn.forward(call), g_o).grad_q
    np.testing.assert_allclose(runs[0][1].grad_q, want, rtol=0, atol=1e-12 * np.abs(want).max())
    with pytest.raises(refattn.RefAttnError, match="defines must be preprocessor names"):
        EmulatedModule(KERNEL_DIR, defines=("X=1 -o /tmp/x",))


def test_a_removed_syncthreads_is_caught(tmp_path):
    # the barrier between each thread's cp.async wait and the reads of the whole tile
    d = _mutated(tmp_path, "        refattn_cp_async_wait<1>();  // tile `step` landed\n"
                           "        __syncthreads();\n",
                 "        refattn_cp_async_wait<1>();  // tile `step` landed\n", "tile_loop.cuh")
    outs = _outputs(d)
    ref = refattn.forward(_call((1, 2, 70, 70, 8))).output
    for out in outs:  # every thread order reads tiles before other threads' copies landed
        assert not np.allclose(out, ref, equal_nan=False)
        assert np.isnan(out).any()  # the NaN poison of the debug build


def test_an_out_of_bounds_shared_memory_index_is_caught(tmp_path):
    d = _mutated(tmp_path, "return tile[(first + 8 * mr) * D + sw];",
                 "return tile[(first + 8 * mr) * D + sw + 16 * 64 * D];", "products.cuh")
    with pytest.raises(refattn.RefAttnError, match=r"shared memory index \d+ out of bounds.*"
                                                   r"block \(\d+, \d+, 0\), thread \(\d+, 0, 0\)"):
        _outputs(d, seeds=(0,))


def test_a_result_that_depends_on_thread_order_is_caught(tmp_path):
    # lanes t = 0, 1 of a quad write the same output element: the last writer wins
    d = _mutated(tmp_path, "orow[8 * dt + 2 * t] = used", "orow[8 * dt + 2 * (t & 2)] = used",
                 "forward.cuh")
    outs = _outputs(d, seeds=(0, 1, 2, 3))
    assert len({o.tobytes() for o in outs}) > 1


def test_a_divergent_barrier_is_caught(tmp_path):
    d = _mutated(tmp_path, "        refattn_cp_async_wait<1>();  // tile `step` landed\n",
                 "        refattn_cp_async_wait<1>();  // tile `step` landed\n"
                 "        if (threadIdx.x == 5) return;\n", "tile_loop.cuh")
    with pytest.raises(refattn.RefAttnError, match="__syncthreads divergence"):
        _outputs(d, seeds=(0,))
