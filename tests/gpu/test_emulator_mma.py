"""The emulator's fp64 tensor-core instructions and cp.async, checked against independent
oracles on probe kernels that call the same wrappers as attention.cu (kernels/mma_*.cuh,
cp_async.cuh), and the hazards they add caught on mutated copies of the real kernels.

Oracles: exact rationals (fractions.Fraction, whose float() is correctly rounded): an fma is
round(a b + c), the "chain" rounding of an element is the k-ascending sequence of them, the
"exact" rounding is round(c + sum_k a_k b_k). Fragment layouts are those of the PTX ISA as
the headers state them; the probes read A, B, C from row-major arrays with that layout and
write D back the same way, so a layout error in the emulator shows up as a wrong D.
"""

from __future__ import annotations

import shutil
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

import refattn
from gpu_backend import launch
from gpu_backend.emulator.module import EmulatedModule
from gpu_backend.emulator_backend import EmulatorDevice
from gpu_backend.source import KERNEL_DIR

PROBE = r"""
#include "common.cuh"
#include "cp_async.cuh"
#include "mma_m16n8k4.cuh"
#include "mma_m16n8k8.cuh"
#include "mma_m8n8k4.cuh"

// A (M x K), B (K x 8), C and D (M x 8), row-major; one warp; lane `skip` skips the mma
extern "C" __global__ void probe_m8n8k4(const double* A, const double* B, const double* C,
                                        double* D, int skip) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    double c[2] = {C[g * 8 + 2 * t], C[g * 8 + 2 * t + 1]};
    if (lane != skip) refattn_mma_m8n8k4(c, A[g * 4 + t], B[t * 8 + g]);
    D[g * 8 + 2 * t] = c[0];
    D[g * 8 + 2 * t + 1] = c[1];
}

extern "C" __global__ void probe_m16n8k4(const double* A, const double* B, const double* C,
                                         double* D, int skip) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    double a[2] = {A[g * 4 + t], A[(g + 8) * 4 + t]};
    double c[4] = {C[g * 8 + 2 * t], C[g * 8 + 2 * t + 1], C[(g + 8) * 8 + 2 * t],
                   C[(g + 8) * 8 + 2 * t + 1]};
    if (lane != skip) {
        refattn_mma_m16n8k4(c, a, B[t * 8 + g]);
    }
    D[g * 8 + 2 * t] = c[0];
    D[g * 8 + 2 * t + 1] = c[1];
    D[(g + 8) * 8 + 2 * t] = c[2];
    D[(g + 8) * 8 + 2 * t + 1] = c[3];
}

extern "C" __global__ void probe_m16n8k8(const double* A, const double* B, const double* C,
                                         double* D, int skip) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    double a[4] = {A[g * 8 + t], A[(g + 8) * 8 + t], A[g * 8 + t + 4], A[(g + 8) * 8 + t + 4]};
    double b[2] = {B[t * 8 + g], B[(t + 4) * 8 + g]};
    double c[4] = {C[g * 8 + 2 * t], C[g * 8 + 2 * t + 1], C[(g + 8) * 8 + 2 * t],
                   C[(g + 8) * 8 + 2 * t + 1]};
    if (lane != skip) refattn_mma_m16n8k8(c, a, b);
    D[g * 8 + 2 * t] = c[0];
    D[g * 8 + 2 * t + 1] = c[1];
    D[(g + 8) * 8 + 2 * t] = c[2];
    D[(g + 8) * 8 + 2 * t + 1] = c[3];
}

// lanes below `split` issue m8n8k4, the others m16n8k4: shapes disagree
extern "C" __global__ void probe_mixed(const double* A, const double* B, const double* C,
                                       double* D, int split) {
    const int lane = threadIdx.x & 31;
    double a[2] = {A[0], A[1]};
    double c[4] = {C[0], C[1], C[2], C[3]};
    if (lane < split) refattn_mma_m8n8k4(c, a[0], B[0]);
    else refattn_mma_m16n8k4(c, a, B[0]);
    D[lane] = c[0];
}

// 64 threads copy n doubles (n even, <= 256) into shared memory with cp.async, rows past
// `valid` doubles zero-filled, then wait (or not) and copy shared memory back out
extern "C" __global__ void probe_cp_async(const double* src, double* out, int n, int valid,
                                          int wait) {
    REFATTN_DYNAMIC_SHARED(double, smem);
    for (int e = 2 * threadIdx.x; e < n; e += 2 * blockDim.x)
        refattn_cp_async16(smem + e, src + e, e < valid);
    refattn_cp_async_commit();
    if (wait) refattn_cp_async_wait<0>();
    __syncthreads();
    for (int e = threadIdx.x; e < n; e += blockDim.x) out[e] = smem[e];
}

REFATTN_EXPORT(probe_m8n8k4)
REFATTN_EXPORT(probe_m16n8k4)
REFATTN_EXPORT(probe_m16n8k8)
REFATTN_EXPORT(probe_mixed)
REFATTN_EXPORT(probe_cp_async)
"""

SHAPES = {"m8n8k4": (8, 4), "m16n8k4": (16, 4), "m16n8k8": (16, 8)}


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("probe")
    for header in KERNEL_DIR.glob("*.cuh"):
        shutil.copy(header, d)
    (d / "attention.cu").write_text(PROBE)
    return d


@pytest.fixture(scope="module")
def modules(probe_dir):
    return {mma: EmulatedModule(probe_dir, debug=True, mma=mma, threads=1)
            for mma in ("chain", "exact")}


def _chain(a_row, b_col, c) -> float:
    acc = float(c)
    for x, y in zip(a_row, b_col, strict=True):
        acc = float(Fraction(x) * Fraction(y) + Fraction(acc))  # one fma
    return acc


def _exact(a_row, b_col, c) -> float:
    return float(Fraction(c) + sum((Fraction(x) * Fraction(y)
                                    for x, y in zip(a_row, b_col, strict=True)), Fraction(0)))


def _run(module, shape, A, B, C, skip=-1):
    M, _ = SHAPES[shape]
    D = np.full((M, 8), np.nan)
    module.get_function(f"probe_{shape}")(1, 32, (A, B, C, D, np.int32(skip)))
    return D


def _oracle(A, B, C, rounding):
    f = _chain if rounding == "chain" else _exact
    return np.array([[f(A[m], B[:, n], C[m, n]) for n in range(8)] for m in range(A.shape[0])])


@pytest.mark.parametrize("rounding", ["chain", "exact"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_shape_against_rationals_on_random_fragments(modules, shape, rounding):
    M, K = SHAPES[shape]
    rng = np.random.default_rng(M * 100 + K)
    for trial in range(3):
        # wide exponents make the rounding order matter
        A = rng.standard_normal((M, K)) * 2.0 ** rng.integers(-30, 30, (M, K))
        B = rng.standard_normal((K, 8)) * 2.0 ** rng.integers(-30, 30, (K, 8))
        C = rng.standard_normal((M, 8)) * 2.0 ** rng.integers(-30, 30, (M, 8))
        got = _run(modules[rounding], shape, A, B, C)
        np.testing.assert_array_equal(got, _oracle(A, B, C, rounding), err_msg=f"trial {trial}")


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_each_element_of_the_layout_lands_where_the_ptx_isa_says(modules, shape):
    # one-hot operands: D[m][n] = A[m][k] B[k][n] picks out single entries, so a lane or
    # register exchanged in the emulator's assembly moves a value to another (m, n)
    M, K = SHAPES[shape]
    A = np.arange(1.0, M * K + 1).reshape(M, K)
    for k in range(K):
        for n in range(8):
            B = np.zeros((K, 8))
            B[k, n] = 1.0
            C = np.full((M, 8), 0.5)
            want = C.copy()
            want[:, n] += A[:, k]
            np.testing.assert_array_equal(_run(modules["chain"], shape, A, B, C), want)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_fma_chain_and_the_exact_sum_differ_on_the_crafted_case(modules, shape):
    # (1, 2^-53, 2^-53) . (1, 1, 1): the chain rounds 1 + 2^-53 to 1 twice (ties to even), the
    # exact sum is 1 + 2^-52
    M, K = SHAPES[shape]
    A = np.zeros((M, K))
    A[:, :3] = [1.0, 2.0**-53, 2.0**-53]
    B = np.zeros((K, 8))
    B[:3, :] = 1.0
    C = np.zeros((M, 8))
    chain = _run(modules["chain"], shape, A, B, C)
    exact = _run(modules["exact"], shape, A, B, C)
    assert (chain == 1.0).all()
    assert (exact == 1.0 + 2.0**-52).all()
    np.testing.assert_array_equal(chain, _oracle(A, B, C, "chain"))
    np.testing.assert_array_equal(exact, _oracle(A, B, C, "exact"))


def test_a_lane_that_skips_the_mma_is_named(modules):
    A, B, C = np.ones((16, 4)), np.ones((4, 8)), np.zeros((16, 8))
    with pytest.raises(refattn.RefAttnError,
                       match=r"mma.sync divergence \(block \(0, 0, 0\), warp 0\): "
                             r"mma.sync.m16n8k4 needs all 32 lanes.*lane\(s\) 13 did not "
                             r"arrive"):
        _run(modules["chain"], "m16n8k4", A, B, C, skip=13)


def test_lanes_issuing_different_shapes_are_named(modules):
    z = np.zeros(64)
    with pytest.raises(refattn.RefAttnError, match=r"lane\(s\) (\d+, )*31 issued another shape"):
        modules["chain"].get_function("probe_mixed")(1, 32, (z, z, z, np.zeros(32),
                                                             np.int32(8)))


def test_cp_async_copies_zero_fills_and_completes_at_the_wait(modules):
    src = np.arange(1.0, 129.0)
    out = np.full(128, -1.0)
    k = modules["chain"].get_function("probe_cp_async")
    k(1, 64, (src, out, np.int32(128), np.int32(100), np.int32(1)), shared_mem=128 * 8)
    np.testing.assert_array_equal(out, np.where(np.arange(128) < 100, src, 0.0))
    # without the wait the copies never land: the reads see the NaN-poisoned shared memory
    k(1, 64, (src, out, np.int32(128), np.int32(128), np.int32(0)), shared_mem=128 * 8)
    assert np.isnan(out).all()


def test_a_misaligned_cp_async_source_is_caught(modules):
    src = np.arange(1.0, 131.0)[1:]  # 8 bytes past a 16-byte boundary (numpy aligns to 16)
    assert src.ctypes.data % 16 == 8
    k = modules["chain"].get_function("probe_cp_async")
    with pytest.raises(refattn.RefAttnError, match=r"cp\.async: a 16-byte copy needs 16-byte "
                                                   r"aligned addresses"):
        k(1, 64, (src, np.zeros(128), np.int32(128), np.int32(128), np.int32(1)),
          shared_mem=128 * 8)


def test_the_exact_switch_is_read_from_the_environment(probe_dir, monkeypatch):
    monkeypatch.setenv("REFATTN_EMU_MMA", "exact")
    assert EmulatedModule(probe_dir, debug=True).mma == "exact"
    monkeypatch.setenv("REFATTN_EMU_MMA", "sloppy")
    with pytest.raises(refattn.RefAttnError, match="REFATTN_EMU_MMA"):
        EmulatedModule(probe_dir, debug=True)


# -- the attention kernels on the sm_80 code path and with the exact mma rounding -------------
def _call(shape=(1, 2, 70, 70, 8), **kw):
    B, H, Q, K, D = shape
    rng = np.random.default_rng(3)
    return refattn.AttentionCall(rng.standard_normal((B, H, Q, D)),
                                 rng.standard_normal((B, H, K, D)),
                                 rng.standard_normal((B, H, K, D)), **kw)


class _Device(EmulatorDevice):
    def __init__(self, directory=KERNEL_DIR, *, arch=900, mma=None, seed=0, debug=True):
        self.module = EmulatedModule(directory, debug=debug, seed=seed, arch=arch, mma=mma)
        self.name = "cuda_emulator"
        self.debug, self.seed = debug, seed
        self.compile_options = (self.module.path.name,)


@pytest.mark.parametrize(("arch", "mma"), [(800, "chain"), (900, "exact")])
def test_forward_and_backward_on_the_sm80_path_and_with_exact_rounding(arch, mma):
    from refattn.masks import causal

    call = _call((1, 2, 50, 41, 40), visible=causal(50, 41, alignment="upper_left"))
    dev = _Device(arch=arch, mma=mma, debug=False)
    t = launch.forward(dev, call, materialize=False)
    g_o = np.random.default_rng(2).standard_normal(t.output.shape)
    g = launch.backward(dev, t, g_o)
    ref = refattn.forward(call)
    rg = refattn.backward(ref, g_o)
    assert t.materialized["head_width"] == 64
    np.testing.assert_allclose(t.output, ref.output, rtol=1e-13, atol=1e-14)
    for name in ("grad_q", "grad_k", "grad_v"):
        np.testing.assert_allclose(getattr(g, name), getattr(rg, name), rtol=1e-12, atol=1e-13)


# -- the hazards the tensor-core kernels add, caught on mutated copies -------------------------
def _mutated(tmp_path: Path, name: str, old: str, new: str) -> Path:
    d = tmp_path / "kernels"
    shutil.copytree(KERNEL_DIR, d)
    src = (d / name).read_text()
    assert src.count(old) >= 1, old
    (d / name).write_text(src.replace(old, new, 1))
    return d


def _forward(directory: Path, seeds=(0,)):
    call = _call()
    return [launch.forward(_Device(directory, seed=s), call, materialize=False).output
            for s in seeds]


def test_a_missing_cp_async_wait_is_caught(tmp_path):
    d = _mutated(tmp_path, "tile_loop.cuh",
                 "        refattn_cp_async_wait<1>();  // tile `step` landed\n", "")
    out = _forward(d)[0]
    assert np.isnan(out).any()  # the tiles were read before their copies landed


def test_a_lane_skipping_mma_sync_is_caught(tmp_path):
    d = _mutated(tmp_path, "tile.cuh", "        refattn_mma_m16n8k4(c, a, b);",
                 "        if ((threadIdx.x & 31) != 6) refattn_mma_m16n8k4(c, a, b);")
    with pytest.raises(refattn.RefAttnError,
                       match=r"mma.sync divergence \(block \(\d+, \d+, 0\), warp \d\): "
                             r"mma.sync.m16n8k4 .*lane\(s\) 6 did not arrive"):
        _forward(d)


def test_a_wrong_fragment_index_is_caught(tmp_path):
    # B of P V read with the k permutation of the other half-step (2 t + 1 - s for 2 t + s)
    d = _mutated(tmp_path, "products.cuh",
                 "lo[2 * s + q] = refattn_swz<D>(2 * t + s, 8 * q + g);",
                 "lo[2 * s + q] = refattn_swz<D>(2 * t + 1 - s, 8 * q + g);")
    out = _forward(d)[0]
    ref = refattn.forward(_call()).output
    assert np.isfinite(out).all()
    assert not np.allclose(out, ref, rtol=1e-6)
