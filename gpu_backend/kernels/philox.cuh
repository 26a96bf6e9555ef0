// Philox4x32-10 and refattn's dropout coordinate mapping, integer arithmetic only.
//
// One header for the GPU kernels, the CPU emulator and plain host C++ (a test compiles it
// with g++ and compares every word with refattn.dropout): __host__ __device__ functions of
// 32- and 64-bit unsigned integers, no floating point. The mapping is
// refattn-philox-dropout-v1 (docs/ARCHITECTURE.md, "Portable dropout stream"):
//   counter = (j >> 2, i, b * Hq + h, offset); key = (seed & 0xffffffff, seed >> 32);
//   word = philox4x32_10(counter, key)[j & 3]; keep iff word >= threshold.
#pragma once

#ifndef __CUDACC__
#ifndef __host__
#define __host__
#endif
#ifndef __device__
#define __device__
#endif
#ifndef __forceinline__
#define __forceinline__ inline
#endif
#endif

struct RefattnWords {
    unsigned int w[4];
};

__host__ __device__ __forceinline__ void refattn_mulhilo32(unsigned int a, unsigned int b,
                                                           unsigned int* hi, unsigned int* lo) {
    unsigned long long product = static_cast<unsigned long long>(a) * b;  // exact
    *hi = static_cast<unsigned int>(product >> 32);
    *lo = static_cast<unsigned int>(product);
}

// Random123 philox4x32_R with R = 10 (round multipliers M0, M1; Weyl increments W0, W1)
__host__ __device__ __forceinline__ RefattnWords refattn_philox4x32_10(RefattnWords c,
                                                                      unsigned int k0,
                                                                      unsigned int k1) {
    const unsigned int M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
    const unsigned int W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += W0;  // mod 2**32
            k1 += W1;
        }
        unsigned int hi0, lo0, hi1, lo1;
        refattn_mulhilo32(M0, c.w[0], &hi0, &lo0);
        refattn_mulhilo32(M1, c.w[2], &hi1, &lo1);
        RefattnWords next;
        next.w[0] = hi1 ^ c.w[1] ^ k0;
        next.w[1] = lo1;
        next.w[2] = hi0 ^ c.w[3] ^ k1;
        next.w[3] = lo0;
        c = next;
    }
    return c;
}

// the dropout word of element (b, h, i, j) of a (B, Hq, Q, K) call
__host__ __device__ __forceinline__ unsigned int refattn_dropout_word(
    long long b, long long h, long long i, long long j, long long Hq, unsigned int key0,
    unsigned int key1, unsigned int offset) {
    RefattnWords c;
    c.w[0] = static_cast<unsigned int>(j >> 2);
    c.w[1] = static_cast<unsigned int>(i);
    c.w[2] = static_cast<unsigned int>(b * Hq + h);
    c.w[3] = offset;
    return refattn_philox4x32_10(c, key0, key1).w[j & 3];
}

__host__ __device__ __forceinline__ bool refattn_dropout_keep(
    long long b, long long h, long long i, long long j, long long Hq, unsigned int key0,
    unsigned int key1, unsigned int offset, unsigned long long threshold) {
    return refattn_dropout_word(b, h, i, j, Hq, key0, key1, offset) >= threshold;
}
