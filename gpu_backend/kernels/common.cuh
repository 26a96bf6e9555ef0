// refattn GPU kernels: platform macros and the kernel ABI (argument slots).
//
// The kernels compile three ways: with nvcc or NVRTC for a GPU (CuPy adds -ftz=true and
// --device-as-default-execution-space), and with g++ for the CPU emulator, which includes
// gpu_backend/emulator/cuda_emu.h first and so defines REFATTN_EMULATOR. Every kernel takes
// the same three arguments: a table of device addresses (slot names below), a table of int64
// parameters and a table of double parameters. gpu_backend/abi.py lists the same names in the
// same order (a test compares them).
#pragma once

#ifndef REFATTN_EMULATOR
// -- CUDA (nvcc / NVRTC) ----------------------------------------------------------------------
#define REFATTN_EXPORT(name)
#define REFATTN_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#define REFATTN_CHECK_INDEX(i, n)
#define REFATTN_UNROLL _Pragma("unroll")
#define REFATTN_NO_UNROLL _Pragma("unroll 1")
#endif

// NVRTC has no math.h: IEEE constants from their bit patterns
__device__ __forceinline__ double refattn_neg_inf() {
    return __longlong_as_double(static_cast<long long>(0xfff0000000000000ULL));
}

// a / b given rb = 1 / b (one IEEE division, hoisted out of the loops by the caller): q = a rb,
// then one correction with the residual a - q b (exact by fma), q + (a - q b) rb, which is the
// correctly rounded a / b (Markstein's theorem: rb within half an ulp of 1 / b, q within an ulp
// of a / b) unless an intermediate underflows; unlike `/` it has no slow-path subroutine call
// (CALL.REL.NOINC) in the loop. A zero, infinite or NaN q is returned as it is (the signed zero
// of a / b, the overflow of a / b).
__device__ __forceinline__ double refattn_div(double a, double b, double rb) {
    const double q = a * rb;
    const double e = fma(fma(-q, b, a), rb, q);
    return q != 0.0 && fabs(q) <= 1.7976931348623157e308 ? e : q;
}

// e^x for x <= 709 (the softmax's x = s - m <= 0, or -inf), without a branch: CUDA's exp (x = k ln2
// + r, |r| <= ln2 / 2, k = rint(x log2 e) by the 1.5 2^52 shift; e^r by its degree-11 polynomial,
// the coefficients read from the SASS of nvcc 13.0's exp; 2^k added to the exponent), with the
// subnormal range (x < -708.396) scaled in two exact steps, (e^r 2^(k + 600)) 2^-600, so the one
// rounding is the final product's, e^x = 0 below -1000 (and for -inf), NaN for NaN. CUDA's exp
// instead branches to a slow path for |x| >= 708.396 on every element.
__device__ __forceinline__ double refattn_exp(double x) {
    const double shift = 6755399441055744.0;  // 1.5 2^52: t's low word is k
    const double t = fma(x, 1.4426950408889634, shift);
    const double k = t - shift;
    double r = fma(k, -0.6931471805599453, x);    // ln 2, high part (0x3fe62e42fefa39ef)
    r = fma(k, -2.3190468138462996e-17, r);        // ln 2, low part (0x3c7abc9e3b39803f)
    double p = fma(r, 2.502232253650299e-08, 2.763090348817311e-07);
    p = fma(r, p, 2.755751454588244e-06);
    p = fma(r, p, 2.4801491039099165e-05);
    p = fma(r, p, 0.00019841269589115497);
    p = fma(r, p, 0.001388888894591638);
    p = fma(r, p, 0.008333333333455043);
    p = fma(r, p, 0.041666666666519754);
    p = fma(r, p, 0.16666666666666477);
    p = fma(r, p, 0.5000000000000012);
    p = fma(r, p, 1.0);
    p = fma(r, p, 1.0);
    const bool tiny = x < -708.39599609375;  // CUDA's fast-path bound: 2^k may be subnormal
    const int kk = static_cast<int>(__double_as_longlong(t)) + (tiny ? 600 : 0);
    const double e = __longlong_as_double(static_cast<long long>(
        static_cast<unsigned long long>(__double_as_longlong(p)) +
        (static_cast<unsigned long long>(static_cast<long long>(kk)) << 52)));
    const double scaled = tiny ? e * 2.409919865102884e-181 : e;  // 2^-600
    return x < -1000.0 ? 0.0 : (x == x ? scaled : x);  // a NaN stays NaN
}

// 2^(j/32), j = 0 .. 31, as pairs hi, lo: hi the nearest double, lo the nearest double to the
// rest (hi + lo within 2^-106 of 2^(j/32); tests/gpu/test_kernel_sources.py checks them exactly),
// in global memory: the blocks copy it to shared memory (refattn_exp_table_fill), and a kernel
// without room for the copy reads it here (REFATTN_EXP_TABLE_GLOBAL: L1-resident 512 bytes)
__device__ alignas(16) const double refattn_exp2_32[64] = {
    0x1.0000000000000p+0, 0x0.0p+0,
    0x1.059b0d3158574p+0, 0x1.d73e2a475b465p-55,
    0x1.0b5586cf9890fp+0, 0x1.8a62e4adc610bp-54,
    0x1.11301d0125b51p+0, -0x1.6c51039449b3ap-54,
    0x1.172b83c7d517bp+0, -0x1.19041b9d78a76p-55,
    0x1.1d4873168b9aap+0, 0x1.e016e00a2643cp-54,
    0x1.2387a6e756238p+0, 0x1.9b07eb6c70573p-54,
    0x1.29e9df51fdee1p+0, 0x1.612e8afad1255p-55,
    0x1.306fe0a31b715p+0, 0x1.6f46ad23182e4p-55,
    0x1.371a7373aa9cbp+0, -0x1.63aeabf42eae2p-54,
    0x1.3dea64c123422p+0, 0x1.ada0911f09ebcp-55,
    0x1.44e086061892dp+0, 0x1.89b7a04ef80d0p-59,
    0x1.4bfdad5362a27p+0, 0x1.d4397afec42e2p-56,
    0x1.5342b569d4f82p+0, -0x1.07abe1db13cadp-55,
    0x1.5ab07dd485429p+0, 0x1.6324c054647adp-54,
    0x1.6247eb03a5585p+0, -0x1.383c17e40b497p-54,
    0x1.6a09e667f3bcdp+0, -0x1.bdd3413b26456p-54,
    0x1.71f75e8ec5f74p+0, -0x1.16e4786887a99p-55,
    0x1.7a11473eb0187p+0, -0x1.41577ee04992fp-55,
    0x1.82589994cce13p+0, -0x1.d4c1dd41532d8p-54,
    0x1.8ace5422aa0dbp+0, 0x1.6e9f156864b27p-54,
    0x1.93737b0cdc5e5p+0, -0x1.75fc781b57ebcp-57,
    0x1.9c49182a3f090p+0, 0x1.c7c46b071f2bep-56,
    0x1.a5503b23e255dp+0, -0x1.d2f6edb8d41e1p-54,
    0x1.ae89f995ad3adp+0, 0x1.7a1cd345dcc81p-54,
    0x1.b7f76f2fb5e47p+0, -0x1.5584f7e54ac3bp-56,
    0x1.c199bdd85529cp+0, 0x1.11065895048ddp-55,
    0x1.cb720dcef9069p+0, 0x1.503cbd1e949dbp-56,
    0x1.d5818dcfba487p+0, 0x1.2ed02d75b3707p-55,
    0x1.dfc97337b9b5fp+0, -0x1.1a5cd4f184b5cp-54,
    0x1.ea4afa2a490dap+0, -0x1.e9c23179c2893p-54,
    0x1.f50765b6e4540p+0, 0x1.9d3e12dd8a18bp-54,
};
// a block's copy of the table (refattn_exp_table_fill): 32 pairs, 8 copies each
constexpr int REFATTN_EXP_TABLE_DOUBLES = 512;
// the doubles from one pair of the table to the next: in a block's copy (a lane reads its copy,
// the table plus 2 (lane % 8)), and in refattn_exp2_32 itself
constexpr int REFATTN_EXP_TABLE_SHARED = 16, REFATTN_EXP_TABLE_GLOBAL = 2;

// fills a block's copy of refattn_exp2_32 (REFATTN_EXP_TABLE_DOUBLES, 16-byte aligned): pair j
// 8 times, copy l at doubles 16 j + 2 l. Lane l reads copy l % 8 (the tab of refattn_exp_table
// and refattn_tanh_table), so the 8 lanes of a quarter warp (one 16-byte shared access's phase)
// read 8 different 16-byte bank groups whatever their j: no bank conflict.
template <typename S>
__device__ __forceinline__ void refattn_exp_table_fill(S tab, int tid, int threads) {
    for (int k = tid; k < REFATTN_EXP_TABLE_DOUBLES / 2; k += threads) {
        tab[2 * k] = refattn_exp2_32[2 * (k >> 3)];
        tab[2 * k + 1] = refattn_exp2_32[2 * (k >> 3) + 1];
    }
}

// an approximate reciprocal of x (about 20 bits: MUFU.RCP64H, the high word of 1 / x; the
// callers refine it): on the CPU emulator 1 / x with the significand cut to its top 20 bits
__device__ __forceinline__ double refattn_rcp_approx(double x) {
#ifndef REFATTN_EMULATOR
    double r;
    asm("rcp.approx.ftz.f64 %0, %1;" : "=d"(r) : "d"(x));
    return r;
#else
    return __longlong_as_double(__double_as_longlong(1.0 / x) &
                                static_cast<long long>(0xffffffff00000000ULL));
#endif
}

// tanh(u) without a branch (CUDA's tanh branches on |u| >= 0.6536 between two paths, and a warp
// whose lanes take both runs both: 33 fp64 operations), from the exp table (tab: a lane's copy
// in the block's, STRIDE = REFATTN_EXP_TABLE_SHARED, or refattn_exp2_32 itself,
// REFATTN_EXP_TABLE_GLOBAL: the same values, so every kernel computes the same bits and the
// backward's recomputed scores are the forward's even where a softcap of 1e300 would turn an
// ulp into exp(1e284)): tanh |u| = E / (E + 2) with E = e^(2a) - 1, a = |u| held at 20 (tanh
// rounds to 1 above 19.1), 2a = k ln2/32 + 2r (k = 32 m + j = rint(64 a / ln2), |r| <= ln2/128,
// ln2/64 in one part: its error moves E by k 7e-19 relative, below an ulp of tanh), e^(2r) - 1 =
// q by Taylor's degree-7 polynomial in r (4e-19 relative), E = 2^m (hi + hi q + lo) - 1 (hi 2^m
// - 1 exact for m <= 52), the quotient by the reciprocal of E + 2 refined from
// refattn_rcp_approx (cubic: e = 1 - d r0, r0 (1 + e + e^2)), u's sign copied: 18 fp64
// operations, within 3 ulp of tanh (tests/gpu/test_kernel_sources.py).
template <int STRIDE, typename S>
__device__ __forceinline__ double refattn_tanh_table(double u, S tab) {
    const double shift = 6755399441055744.0;  // 1.5 2^52: t's low word is k
    const long long sign = __double_as_longlong(u) & static_cast<long long>(0x8000000000000000ULL);
    double a = __longlong_as_double(__double_as_longlong(u) ^ sign);
    a = a > 20.0 ? 20.0 : a;  // (NaN stays NaN)
    const double t = fma(a, 92.33248261689366, shift);  // 64 / ln2
    const double k = t - shift;
    const double r = fma(k, -0.010830424696249145, a);  // ln2 / 64
    double h = fma(r, 8.0 / 315.0, 4.0 / 45.0);
    h = fma(r, h, 4.0 / 15.0);
    h = fma(r, h, 2.0 / 3.0);
    h = fma(r, h, 4.0 / 3.0);
    h = fma(r, h, 2.0);
    h = fma(r, h, 2.0);
    const double q = r * h;  // e^(2r) - 1
    const int ki = static_cast<int>(__double_as_longlong(t));
    const int j = STRIDE * (ki & 31);
    const double hi = tab[j], lo = tab[j + 1];
    const double two_m = __longlong_as_double(static_cast<long long>((ki >> 5) + 1023) << 52);
    const double e = fma(fma(hi, q, lo), two_m, fma(hi, two_m, -1.0));  // e^(2a) - 1
    const double d = e + 2.0;
    const double r0 = refattn_rcp_approx(d);
    double err = fma(-d, r0, 1.0);
    err = fma(err, err, err);
    const double th = e * fma(r0, err, r0);
    return __longlong_as_double(__double_as_longlong(th) | sign);
}

// refattn_exp's e^x from a table of 2^(j/32) (Tang's method): x = (32 m + j) ln2/32 + r with
// k = 32 m + j = rint(32 x / ln2) by the 1.5 2^52 shift, |r| <= ln2/64 (ln2/32 in two parts),
// e^r - 1 = q = r + r^2 P(r) with P Taylor's to r^4/6! (the first term left out, r^7/7!, is
// 3.5e-18 of e^r), and
// e^x = 2^m (hi + (hi q + lo)) with hi + lo = 2^(j/32) (tab: the block's refattn_exp_table_fill
// copy plus 2 (lane % 8) doubles, one conflict-free 16-byte read): 13 fp64 operations where
// refattn_exp takes 16, for 16 bytes of shared memory. Below x = -707 (where 2^m e^r may be
// subnormal) it is scaled as refattn_exp, in two exact steps; 0 below -1000, NaN for NaN.
template <typename S>
__device__ __forceinline__ double refattn_exp_table(double x, S tab) {
    const double shift = 6755399441055744.0;  // 1.5 2^52: t's low word is k
    const double t = fma(x, 46.16624130844683, shift);  // 32 / ln2
    const double k = t - shift;
    double r = fma(k, -0.02166084939249829, x);   // ln2 / 32, high part (ln 2's, / 32)
    r = fma(k, -7.247021293269686e-19, r);        // low part
    double p = fma(r, 1.0 / 720.0, 1.0 / 120.0);
    p = fma(r, p, 1.0 / 24.0);
    p = fma(r, p, 1.0 / 6.0);
    p = fma(r, p, 0.5);
    const double q = fma(r * r, p, r);
    const int ki = static_cast<int>(__double_as_longlong(t));
    const int j = REFATTN_EXP_TABLE_SHARED * (ki & 31);
    const double hi = tab[j], lo = tab[j + 1];
    const double e0 = hi + fma(hi, q, lo);
    const bool tiny = x < -707.0;  // 2^m may be subnormal (m < -1021)
    const int m = (ki >> 5) + (tiny ? 600 : 0);
    const double e = __longlong_as_double(static_cast<long long>(
        static_cast<unsigned long long>(__double_as_longlong(e0)) +
        (static_cast<unsigned long long>(static_cast<long long>(m)) << 52)));
    const double scaled = tiny ? e * 2.409919865102884e-181 : e;  // 2^-600
    return x < -1000.0 ? 0.0 : (x == x ? scaled : x);  // a NaN stays NaN
}

// -- pointer slots (the first kernel argument: an array of device addresses) ---------------------
enum RefattnPtr {
    X_Q, X_K, X_V, X_HEAD_MAP,                       // (B,Hq,Q,Dk) (B,Hkv,K,Dk) (B,Hkv,K,Dv) (Hq)
    X_BIAS, X_Z, X_VIS,                              // strided operands, broadcast to (B,Hq,Q,K)
    X_Q_POS, X_K_POS, X_KEY_VALID, X_Q_SEG, X_K_SEG, // leaves: (L,Br,Q) (L,Br,K) (L,Br,K) (L,Br,Q) (L,Br,K)
    X_PREFIX, X_LEFT, X_RIGHT,                       // leaves: (L,Br,Hr) (L,Hr) (L,Hr)
    X_REL_LEAF, X_REL_PROGRAM,                       // (L,2) has_segments, topology; (n) postfix
    X_SANITIZED, X_QUERY_VALID, X_SINK,              // (B,Hq,Q) u8, (B,Q) u8, (Hq)
    X_OUT, X_LSE, X_ROW_MAX,                         // forward outputs
    X_G_O, X_D,                                      // backward inputs: G_O (B,Hq,Q,Dv), D (B,Hq,Q)
    X_DQ, X_DK, X_DV, X_GBIAS, X_ROW_DOT,            // backward outputs
    X_TILES,                                         // (blocks, 2) int64: tiles computed, skipped
    X_T_SOFTCAP_INPUT, X_T_SCORES, X_T_BIASED, X_T_MASKED,  // trace mode (B,Hq,Q,K)
    X_T_PROBS, X_T_Z, X_T_CONSUMED,
    X_T_GRAD_CONSUMED, X_T_GRAD_PROBS, X_T_GRAD_SCORES,
    X_VIS_TILES,                                     // (B,Hq,row tiles,col tiles) u8: dense mask classes
    X_COUNT
};

// -- int64 parameters -------------------------------------------------------------------------
enum RefattnInt {
    P_B, P_HQ, P_HKV, P_Q, P_K, P_DK, P_DV,
    P_VIS_MODE,          // 0 every edge, 1 dense bool tensor, 2 relation
    P_REL_B, P_REL_H,    // the relation's batch and head extents (1 = shared)
    P_REL_PROGRAM_LEN,   // length of the postfix program over the leaves (1: one leaf)
    P_HAS_BIAS, P_HAS_SOFTCAP, P_HAS_SINK, P_HAS_SANITIZED,
    P_DROP_MODE,         // 0 none, 1 dense multiplier tensor, 2 Philox stream
    P_PHILOX_KEY0, P_PHILOX_KEY1, P_PHILOX_OFFSET, P_PHILOX_THRESHOLD,
    P_GBIAS_MODE,        // 0 none, 1 per element (B,Hq,Q,K), 2 summed over q (B,Hq,K),
                         // 3 summed over k (B,Hq,Q)
    P_BIAS_S0, P_BIAS_S1, P_BIAS_S2, P_BIAS_S3,   // element strides, 0 on broadcast axes
    P_Z_S0, P_Z_S1, P_Z_S2, P_Z_S3,
    P_VIS_S0, P_VIS_S1, P_VIS_S2, P_VIS_S3,
    P_COUNT
};

// -- double parameters ------------------------------------------------------------------------
enum RefattnReal {
    R_POST,        // the multiplier applied to q_s . k_s (alpha for the post placement, else 1)
    R_SOFTCAP,     // c
    R_KEEP,        // 1 / (1 - p), the Philox stream's kept multiplier
    R_FQ, R_FK,    // grad_q and grad_k factors (operand multiplier times post)
    R_COUNT
};

// a strided operand read at (b, h, i, j) of (B, Hq, Q, K)
template <typename T>
__device__ __forceinline__ T strided_at(const T* x, const long long* ip, int s0, long long b,
                                        long long h, long long i, long long j) {
    return x[b * ip[s0] + h * ip[s0 + 1] + i * ip[s0 + 2] + j * ip[s0 + 3]];
}
