// Warp tiles on the fp64 tensor cores: a warp's 8 MR rows times 8 columns, k = 4 per step, and
// the swizzled shared-memory tiles that feed them.
//
// refattn_mma_rows<MR>(c, a, b): C (8 MR x 8) += A (8 MR x 4) . B (4 x 8) with the fragments of
// mma_m16n8k4.cuh (MR = 2) or mma_m8n8k4.cuh (MR = 1): a[mr] = A[g + 8 mr][t], b = B[t][g],
// c[2 mr + s] = C[g + 8 mr][2 t + s]. On sm_90 (REFATTN_MMA_ARCH >= 900) MR = 2 is one
// m16n8k4; on sm_80 it is two m8n8k4 sharing b.
//
// Shared tiles are R x D row-major without padding, D a multiple of 16; element (r, c) lives at
// r D + (c ^ 4 f(r)), f(r) = (r ^ (r >> 1)) & 3, an XOR swizzle of bits 2-3 of the column that
// keeps 16-byte chunks (c even, c + 1) together for cp.async. The two fragment reads of the
// kernels are then free of bank conflicts (a half-warp's 16 doubles in 16 distinct double
// banks, g, t in 0..3 within a half-warp):
//   "row" reads  (r0 + g, k0 + t)      A of Q, G_O, K, V; B of K, V, Q, G_O read as B^T
//   "col" reads  (k0 + 2 t + s, d0 + g) B of V, K, Q, G_O when the C fragment of S or dS is
//                                       reused as an A fragment (see refattn_c_as_a)
// since f(g) for g = 0..3 and f(2 t + s) for t = 0..3 (either s) are both permutations of 0..3
// (rows r0, k0 multiples of 8). gpu_backend.perf_model models the same addresses.
#pragma once

#include "common.cuh"
#include "cp_async.cuh"
#include "mma_m16n8k4.cuh"
#include "mma_m8n8k4.cuh"

#if defined(REFATTN_EMULATOR)
#ifndef REFATTN_EMU_ARCH
#define REFATTN_EMU_ARCH 900
#endif
#define REFATTN_MMA_ARCH REFATTN_EMU_ARCH
#elif defined(__CUDA_ARCH__)
#define REFATTN_MMA_ARCH __CUDA_ARCH__
#else
#define REFATTN_MMA_ARCH 0
#endif

template <int MR>
__device__ __forceinline__ void refattn_mma_rows(double* c, const double* a, double b) {
    if constexpr (MR == 2 && REFATTN_MMA_ARCH >= 900) {
        refattn_mma_m16n8k4(c, a, b);
    } else {
        for (int mr = 0; mr < MR; ++mr) refattn_mma_m8n8k4(c + 2 * mr, a[mr], b);
    }
}

// the swizzled index of element (r, c) of a tile with D columns
template <int D>
__device__ __forceinline__ int refattn_swz(int r, int c) {
    return r * D + (c ^ (((r ^ (r >> 1)) & 3) << 2));
}

// rows row0 .. row0 + R - 1 of a (rows x D) row-major matrix starting at src (src already
// offset to the matrix) into the swizzled tile dst with 16-byte cp.async, zeros past `rows`;
// the NT threads of the block (tid < NT) share the R D / 2 chunks, thread tid taking chunks
// tid + NT k, k = 0 .. R D / (2 NT) - 1: row r0 + RS k, columns c0, c0 + 1 (RS = NT / (D / 2)
// rows per step). Only issues the copies: the caller commits and waits.
//
// The address arithmetic is hoisted out of the copies: r0, c0, the global row pointer and the
// shared base are computed once per tile, and since the swizzle of row r depends on r & 7 only,
// the P = 8 / gcd(RS, 8) distinct swizzled columns of the thread's rows are too (1 at D <= 32,
// 2 at D = 64, 4 at D = 128, 8 at D = 256); each copy then costs its row test and the
// cp.async, both addresses a register plus a compile-time immediate (the loop unrolled). A row
// past `rows` is copied with the ignore-src predicate set (refattn_cp_async16_at): 16 zero bytes
// written and its (out-of-range) source address ignored completely (PTX ISA, cp.async); a
// select of an in-range address instead cost about 4 more instructions per copy. Before, a
// rolled loop with a signed division and 64-bit index arithmetic per chunk cost about 33
// instructions per 16-byte copy.
template <int R, int D, int NT, typename Dst>
__device__ __forceinline__ void refattn_load_tile_async(Dst dst, const double* src, int row0,
                                                        int rows, int tid) {
    constexpr int PER_ROW = D / 2, CHUNKS = R * D / 2, STEPS = CHUNKS / NT, RS = NT / PER_ROW;
    static_assert(CHUNKS % NT == 0 && NT % PER_ROW == 0,
                  "every thread copies the same number of whole 16-byte chunks");
    constexpr int P = RS % 8 == 0 ? 1 : RS % 4 == 0 ? 2 : RS % 2 == 0 ? 4 : 8;
    const unsigned u = static_cast<unsigned>(tid);  // unsigned: shifts, not signed division
    const int r0 = static_cast<int>(u / PER_ROW), c0 = static_cast<int>(2 * (u % PER_ROW));
    const int left = rows - row0 - r0;  // step k's row is in range iff RS k < left
    const double* from = src + (static_cast<long long>(row0 + r0) * D + c0);
    const auto base = refattn_shared_base(dst);
    int sw[P];  // the swizzled offset of (r0 + RS k, c0) for k mod P, less RS k D
    REFATTN_UNROLL
    for (int k = 0; k < P; ++k) sw[k] = refattn_swz<D>(r0 + RS * k, c0) - RS * k * D;
    REFATTN_UNROLL
    for (int k = 0; k < STEPS; ++k)
        refattn_cp_async16_at(base, sw[k % P] + RS * k * D, from + RS * k * D, RS * k < left);
}
