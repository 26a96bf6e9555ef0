// refattn float64 attention kernels on the fp64 tensor cores: a FlashAttention-2 style
// forward (online softmax), a recomputing backward in two kernels (dq over key tiles; dk/dv over
// query tiles: 3 + 4 = 7 products, no floating-point atomics, every output element has one
// owner, so results are bit-identical run to run), and a trace mode for small problems. No
// kernel writes a [Q, K] array except the trace kernels (and the per-element bias gradient when
// the bias itself is per element).
//
// The head width D is a template parameter with instances 32, 64, 128 and 256; the host zero-pads
// q, k, v, G_O to the instance (gpu_backend/source.py INSTANCES, which mirrors the entry points at
// the end of this file; launch.py sizes the dynamic shared memory). 128 threads per block;
// products through products.cuh (tile.cuh: mma.sync m16n8k4 on sm_90, m8n8k4 on sm_80), tiles
// loaded with cp.async into XOR-swizzled shared memory. This file holds the entry points, the
// row contraction and the trace mode; call.cuh the call's parameters and per-element pieces,
// forward.cuh and backward.cuh the tiled kernels.
//
// Arguments of every kernel: x, the table of device addresses (RefattnPtr slots); ip, int64
// parameters (RefattnInt); rp, double parameters (RefattnReal). See common.cuh.
#include "call.cuh"
#include "forward.cuh"
#include "backward.cuh"
#include "visibility.cuh"

// -- row contraction D = sum_d G_O O, one thread per row ------------------------------------------
__device__ void refattn_row_dot_output(const unsigned long long* x, const long long* ip,
                                       const double* rp) {
    const RefattnCall c = refattn_call(x, ip, rp);
    const double* out = reinterpret_cast<const double*>(x[X_OUT]);
    double* dvec = reinterpret_cast<double*>(x[X_D]);
    const long long rows = c.B * c.Hq * c.Q;
    for (long long row = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
         row < rows; row += static_cast<long long>(gridDim.x) * blockDim.x) {
        double acc = 0.0;
        for (long long d = 0; d < c.Dv; ++d) acc += c.g_o[row * c.Dv + d] * out[row * c.Dv + d];
        dvec[row] = acc;
    }
}

// -- trace mode: every per-element tensor of the canonical trace (small problems) --------------
// one thread per element (b, h, i, j); forward needs lse, backward needs the trace's probs and
// D (the P contraction, as the reference's grad_scores uses it).
__device__ void refattn_trace_forward(const unsigned long long* x, const long long* ip,
                                      const double* rp) {
    const RefattnCall c = refattn_call(x, ip, rp);
    const RefattnVisibility vis = refattn_visibility(x, ip);
    double* t_cap = reinterpret_cast<double*>(x[X_T_SOFTCAP_INPUT]);
    double* t_scores = reinterpret_cast<double*>(x[X_T_SCORES]);
    double* t_biased = reinterpret_cast<double*>(x[X_T_BIASED]);
    double* t_masked = reinterpret_cast<double*>(x[X_T_MASKED]);
    double* t_probs = reinterpret_cast<double*>(x[X_T_PROBS]);
    double* t_z = reinterpret_cast<double*>(x[X_T_Z]);
    double* t_consumed = reinterpret_cast<double*>(x[X_T_CONSUMED]);
    const long long n = c.B * c.Hq * c.Q * c.K;
    for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
         e += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long j = e % c.K, i = (e / c.K) % c.Q, bh = e / (c.K * c.Q);
        const long long b = bh / c.Hq, h = bh % c.Hq, hk = c.head_map[h];
        double dot = 0.0;
        for (long long d = 0; d < c.Dk; ++d)
            dot += c.q[(bh * c.Q + i) * c.Dk + d] * c.k[((b * c.Hkv + hk) * c.K + j) * c.Dk + d];
        double t;
        const double s = refattn_score(c, dot, &t, [](double u) {
            return refattn_tanh_table<REFATTN_EXP_TABLE_GLOBAL>(u, refattn_exp2_32);
        });
        const double capped = c.post * dot;
        const double biased = c.has_bias ? s + strided_at(c.bias, ip, P_BIAS_S0, b, h, i, j) : s;
        const bool seen = refattn_visible(vis, ip, b, h, i, j);
        const double p = seen ? exp(biased - c.lse[bh * c.Q + i]) : 0.0;
        const double z = refattn_multiplier(c, ip, b, h, i, j);
        if (c.has_softcap) t_cap[e] = capped;
        t_scores[e] = s;
        t_biased[e] = biased;
        t_masked[e] = seen ? biased : refattn_neg_inf();
        t_probs[e] = p;
        t_z[e] = z;
        t_consumed[e] = p * z;
    }
}

__device__ void refattn_trace_backward(const unsigned long long* x, const long long* ip,
                                       const double* rp) {
    const RefattnCall c = refattn_call(x, ip, rp);
    const double* t_probs = reinterpret_cast<const double*>(x[X_T_PROBS]);
    const double* t_z = reinterpret_cast<const double*>(x[X_T_Z]);
    double* t_gc = reinterpret_cast<double*>(x[X_T_GRAD_CONSUMED]);
    double* t_gp = reinterpret_cast<double*>(x[X_T_GRAD_PROBS]);
    double* t_gs = reinterpret_cast<double*>(x[X_T_GRAD_SCORES]);
    const long long n = c.B * c.Hq * c.Q * c.K;
    for (long long e = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
         e += static_cast<long long>(gridDim.x) * blockDim.x) {
        const long long j = e % c.K, i = (e / c.K) % c.Q, bh = e / (c.K * c.Q);
        const long long b = bh / c.Hq, hk = c.head_map[bh % c.Hq];
        double gc = 0.0;
        for (long long d = 0; d < c.Dv; ++d)
            gc += c.g_o[(bh * c.Q + i) * c.Dv + d] * c.v[((b * c.Hkv + hk) * c.K + j) * c.Dv + d];
        const double gp = gc * t_z[e];
        t_gc[e] = gc;
        t_gp[e] = gp;
        t_gs[e] = t_probs[e] * (gp - c.dvec[bh * c.Q + i]);
    }
}

// -- entry points ---------------------------------------------------------------------------------
// instances <D, MR, BK or BQ2>: 8 MR rows per warp (the general kernels at D = 128: warp pairs,
// SPLIT = 2 in forward.cuh and backward.cuh); source.py INSTANCES holds the same table (a test
// compares). The tiles are chosen for 0 spills (ptxas, sm_80 and sm_90) and every block up to
// D = 128 within an A100's 163 KiB: dq keeps S and dP (2 x BK / 8 x 2 MR doubles per lane) beside its
// dQ accumulator, its pairs at D = 128 (16-key tiles, 140 KiB) half of dQ's columns; dk/dv keeps dV
// in shared memory (refattn_mma_pb_shared), MR = 2 at D = 32; its pairs at D = 64 and 128 keep dV
// in registers and 2 of each warp's 4 dK n-tiles (D = 64: 80 KiB, two blocks per SM on an
// H100/H200, two warps per scheduler) or 6 of its 8 (D = 128: 160 KiB) in shared memory.
// At D = 256 (REFATTN_A_GLOBAL) the warps read their A rows from global memory and the tiles are
// 8 wide; the dk/dv instance needs 160 KiB of shared memory (half of dK in registers), within an
// A100's 163 KiB; launch.plan refuses a device with less, naming the limit. The forward's pairs
// at D = 128 split the head width for S with 16-key tiles (104 KiB: two blocks per SM on an
// H100/H200). The sixth template argument of refattn_dq and refattn_dkdv, UNROLL_K, unrolls the
// k-steps of the first products (2: both, 1: the first only, 0: none), where it does not spill
// (products.cuh refattn_mma_abt; docs/gpu.md "Unrolled k-steps").
#define REFATTN_ARGS const unsigned long long *x, const long long *ip, const double *rp
extern "C" __global__ void attention_forward_d32(REFATTN_ARGS) { refattn_forward<32, 2, 24>(x, ip, rp); }
extern "C" __global__ void attention_forward_d64(REFATTN_ARGS) { refattn_forward<64, 2, 32>(x, ip, rp); }
extern "C" __global__ void attention_forward_d128(REFATTN_ARGS) { refattn_forward<128, 1, 16, REFATTN_F_ALL, 2>(x, ip, rp); }
extern "C" __global__ void attention_forward_d256(REFATTN_ARGS) { refattn_forward<256, 1, 8>(x, ip, rp); }
// the plain forward instances (feature set F = 0: no softcap, bias or dropout code, call.cuh),
// run for calls without those features; 16-row warps at D = 128 too (the general instance spills
// there) with 8-key tiles (96 KiB: two blocks per SM on an H100/H200, so two warps per
// scheduler overlap one's softmax and copies with the other's products; 16-key tiles, 128 KiB,
// allowed one), 16-key tiles at D = 256 (128 KiB; with every feature they spill 100 bytes on
// sm_90).
// The general instance at D = 32 has 24-key tiles (32 keys spill 32 bytes on sm_90).
extern "C" __global__ void attention_forward_plain_d64(REFATTN_ARGS) {
    refattn_forward<64, 2, 32, 0>(x, ip, rp);
}
extern "C" __global__ void attention_forward_plain_d128(REFATTN_ARGS) {
    refattn_forward<128, 2, 8, 0>(x, ip, rp);
}
extern "C" __global__ void attention_forward_plain_d256(REFATTN_ARGS) {
    refattn_forward<256, 1, 16, 0>(x, ip, rp);
}
extern "C" __global__ void attention_dq_d32(REFATTN_ARGS) { refattn_dq<32, 2, 16>(x, ip, rp); }
extern "C" __global__ void attention_dq_d64(REFATTN_ARGS) { refattn_dq<64, 2, 16, REFATTN_F_ALL, 1, 2>(x, ip, rp); }
extern "C" __global__ void attention_dq_d128(REFATTN_ARGS) { refattn_dq<128, 1, 16, REFATTN_F_ALL, 2, 2>(x, ip, rp); }
extern "C" __global__ void attention_dq_d256(REFATTN_ARGS) { refattn_dq<256, 1, 8, REFATTN_F_ALL, 1, 2>(x, ip, rp); }
extern "C" __global__ void attention_dkdv_d32(REFATTN_ARGS) { refattn_dkdv<32, 2, 32>(x, ip, rp); }
extern "C" __global__ void attention_dkdv_d64(REFATTN_ARGS) { refattn_dkdv<64, 1, 16, REFATTN_F_ALL, 2>(x, ip, rp); }
extern "C" __global__ void attention_dkdv_d128(REFATTN_ARGS) { refattn_dkdv<128, 1, 16, REFATTN_F_ALL, 2, 2>(x, ip, rp); }
extern "C" __global__ void attention_dkdv_d256(REFATTN_ARGS) { refattn_dkdv<256, 1, 8, REFATTN_F_ALL, 1, 1>(x, ip, rp); }
// The plain backward instances (F = 0: no softcap, bias, bias gradient or dropout code), run for
// calls without those features. At D = 128 the dq (16-row warps, 192 KiB) needs more shared
// memory than an A100's 163 KiB, within an H100/H200's 227 KiB; launch.plan runs the general
// instance on a device with less. No sm_8x device has that much, so for those architectures
// it is not built (REFATTN_SM90_ONLY: its body traps; it would spill 112 bytes on sm_80). The
// dk/dv at D = 128 is on warp pairs, as the general one, with all of dK in registers (136 KiB).
// The dq at D = 256 has 16-key tiles (128 KiB; with every feature they spill 112 bytes on sm_90).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define REFATTN_SM90_ONLY(...) __trap()
#else
#define REFATTN_SM90_ONLY(...) __VA_ARGS__
#endif
extern "C" __global__ void attention_dq_plain_d64(REFATTN_ARGS) {
    refattn_dq<64, 2, 32, 0, 1, 2>(x, ip, rp);
}
extern "C" __global__ void attention_dq_plain_d128(REFATTN_ARGS) {
    REFATTN_SM90_ONLY(refattn_dq<128, 2, 16, 0, 1, 2>(x, ip, rp));
}
extern "C" __global__ void attention_dq_plain_d256(REFATTN_ARGS) {
    refattn_dq<256, 1, 16, 0, 1, 2>(x, ip, rp);
}
extern "C" __global__ void attention_dkdv_plain_d64(REFATTN_ARGS) {
    refattn_dkdv<64, 2, 32, 0>(x, ip, rp);
}
extern "C" __global__ void attention_dkdv_plain_d128(REFATTN_ARGS) {
    refattn_dkdv<128, 1, 16, 0, 2>(x, ip, rp);
}
// the wide instances: every feature, for devices whose shared memory holds them (launch.plan
// prefers them there, after a plain instance): the dq at D = 128 on warp pairs with 32-key tiles
// (212 KiB: a streamed K or V double feeds 32 FMAs where the general instance's feeds 16, and
// half the barriers per key), H100/H200 only
extern "C" __global__ void attention_dq_wide_d128(REFATTN_ARGS) {
    REFATTN_SM90_ONLY(refattn_dq<128, 1, 32, REFATTN_F_ALL, 2, 1>(x, ip, rp));
}
// and the dk/dv at D = 256 with 16-query tiles (224 KiB: the dV and half-dK accumulators in
// shared memory are read and written once per 16 queries instead of 8), H100/H200 only
extern "C" __global__ void attention_dkdv_wide_d256(REFATTN_ARGS) {
    REFATTN_SM90_ONLY(refattn_dkdv<256, 1, 16, REFATTN_F_ALL, 1, 2>(x, ip, rp));
}
extern "C" __global__ void attention_row_dot_output(REFATTN_ARGS) {
    refattn_row_dot_output(x, ip, rp);
}
extern "C" __global__ void attention_trace_forward(REFATTN_ARGS) {
    refattn_trace_forward(x, ip, rp);
}
extern "C" __global__ void attention_trace_backward(REFATTN_ARGS) {
    refattn_trace_backward(x, ip, rp);
}

REFATTN_EXPORT(attention_forward_d32)
REFATTN_EXPORT(attention_forward_d64)
REFATTN_EXPORT(attention_forward_d128)
REFATTN_EXPORT(attention_forward_d256)
REFATTN_EXPORT(attention_forward_plain_d64)
REFATTN_EXPORT(attention_forward_plain_d128)
REFATTN_EXPORT(attention_forward_plain_d256)
REFATTN_EXPORT(attention_dq_d32)
REFATTN_EXPORT(attention_dq_d64)
REFATTN_EXPORT(attention_dq_d128)
REFATTN_EXPORT(attention_dq_d256)
REFATTN_EXPORT(attention_dkdv_d32)
REFATTN_EXPORT(attention_dkdv_d64)
REFATTN_EXPORT(attention_dkdv_d128)
REFATTN_EXPORT(attention_dkdv_d256)
REFATTN_EXPORT(attention_dq_plain_d64)
REFATTN_EXPORT(attention_dq_plain_d128)
REFATTN_EXPORT(attention_dq_plain_d256)
REFATTN_EXPORT(attention_dkdv_plain_d64)
REFATTN_EXPORT(attention_dkdv_plain_d128)
REFATTN_EXPORT(attention_dq_wide_d128)
REFATTN_EXPORT(attention_dkdv_wide_d256)
REFATTN_EXPORT(attention_row_dot_output)
REFATTN_EXPORT(attention_trace_forward)
REFATTN_EXPORT(attention_trace_backward)
