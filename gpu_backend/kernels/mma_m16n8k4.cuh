// One fp64 tensor-core instruction: mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64
// (sm_90+, PTX ISA 7.8).
//
//   D (16 x 8) = A (16 x 4) . B (4 x 8) + C, in place on C, one warp, all 32 lanes.
//
// Fragment layout (PTX ISA, "Matrix fragments for mma.m16n8k4 with .f64"; CuTe
// SM90_16x8x4_F64F64F64F64_TN), g = lane >> 2, t = lane & 3:
//   A  a0 = A[g][t], a1 = A[g + 8][t]                              (two doubles)
//   B  b0 = B[t][g]                                                (one double)
//   C  c0 = C[g][2t], c1 = C[g][2t + 1], c2 = C[g + 8][2t], c3 = C[g + 8][2t + 1]
// i.e. two m8n8k4 fragments stacked: rows g and g + 8 share the B fragment.
#pragma once

#include "common.cuh"

__device__ __forceinline__ void refattn_mma_m16n8k4(double* c, const double* a, double b) {
#ifdef REFATTN_EMULATOR
    ::emu::mma_f64(16, 4, a, &b, c);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    __trap();  // not an sm_80 instruction: refattn_mma_rows never calls it there
#else
    asm volatile("mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, "
                 "{%4, %5}, {%6}, {%0, %1, %2, %3};\n"
                 : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
                 : "d"(a[0]), "d"(a[1]), "d"(b));
#endif
}
