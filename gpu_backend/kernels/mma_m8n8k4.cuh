// One fp64 tensor-core instruction: mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 (sm_80+).
//
//   D (8 x 8) = A (8 x 4) . B (4 x 8) + C, in place on C, one warp, all 32 lanes.
//
// Fragment layout (PTX ISA, "Matrix fragments for mma.m8n8k4 with .f64 floating point type"),
// g = lane >> 2 (0..7), t = lane & 3 (0..3):
//   A  a0 = A[g][t]                                  (one double)
//   B  b0 = B[t][g]                                  (one double; B column-major, "col")
//   C  c0 = C[g][2t], c1 = C[g][2t + 1]              (two doubles; D the same)
// The emulator (gpu_backend/emulator/cuda_emu.h) assembles the three matrices from the 32
// lanes with this layout and computes each D element as a k-ascending fma chain (or, with the
// exact switch, the exact sum rounded once).
#pragma once

#include "common.cuh"

__device__ __forceinline__ void refattn_mma_m8n8k4(double* c, double a, double b) {
#ifdef REFATTN_EMULATOR
    ::emu::mma_f64(8, 4, &a, &b, c);
#else
    asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, "
                 "{%0, %1};\n"
                 : "+d"(c[0]), "+d"(c[1])
                 : "d"(a), "d"(b));
#endif
}
