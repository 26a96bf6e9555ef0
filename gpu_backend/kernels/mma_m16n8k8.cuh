// One fp64 tensor-core instruction: mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64
// (sm_90+, PTX ISA 7.8). Not used by attention.cu today (its k-steps are m16n8k4); kept with
// its emulator branch and NumPy test so that a kernel can switch to it.
//
//   D (16 x 8) = A (16 x 8) . B (8 x 8) + C, in place on C, one warp, all 32 lanes.
//
// Fragment layout (PTX ISA; CuTe SM90_16x8x8_F64F64F64F64_TN), g = lane >> 2, t = lane & 3:
//   A  a0 = A[g][t], a1 = A[g + 8][t], a2 = A[g][t + 4], a3 = A[g + 8][t + 4]
//   B  b0 = B[t][g], b1 = B[t + 4][g]
//   C  c0 = C[g][2t], c1 = C[g][2t + 1], c2 = C[g + 8][2t], c3 = C[g + 8][2t + 1]
#pragma once

#include "common.cuh"

__device__ __forceinline__ void refattn_mma_m16n8k8(double* c, const double* a,
                                                    const double* b) {
#ifdef REFATTN_EMULATOR
    ::emu::mma_f64(16, 8, a, b, c);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    __trap();
#else
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
                 : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));
#endif
}
