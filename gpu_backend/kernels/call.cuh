// refattn kernels: one call's parameters (RefattnCall, read once from the argument tables) and
// the per-element pieces every kernel shares: the score and its softcap, the bias, the
// dropout multiplier (Philox keep bits or a dense Z), the row and column lines of a tensor.
#pragma once
#include "common.cuh"
#include "philox.cuh"

struct RefattnCall {
    const double *q, *k, *v, *bias, *z, *sink, *g_o, *dvec, *lse;
    const long long* head_map;
    const unsigned char* query_valid;
    long long B, Hq, Hkv, Q, K, Dk, Dv;
    bool has_bias, has_softcap, has_sink;
    int drop_mode;
    unsigned int key0, key1, offset;
    unsigned long long threshold;
    double post, softcap, keep;
    double cap_scale;  // alpha / c, rounded once a call: the softcap's tanh(dot (alpha / c))
};

__device__ __forceinline__ RefattnCall refattn_call(const unsigned long long* x,
                                                    const long long* ip, const double* rp) {
    RefattnCall c;
    c.q = reinterpret_cast<const double*>(x[X_Q]);
    c.k = reinterpret_cast<const double*>(x[X_K]);
    c.v = reinterpret_cast<const double*>(x[X_V]);
    c.bias = reinterpret_cast<const double*>(x[X_BIAS]);
    c.z = reinterpret_cast<const double*>(x[X_Z]);
    c.sink = reinterpret_cast<const double*>(x[X_SINK]);
    c.g_o = reinterpret_cast<const double*>(x[X_G_O]);
    c.dvec = reinterpret_cast<const double*>(x[X_D]);
    c.lse = reinterpret_cast<const double*>(x[X_LSE]);
    c.head_map = reinterpret_cast<const long long*>(x[X_HEAD_MAP]);
    c.query_valid = reinterpret_cast<const unsigned char*>(x[X_QUERY_VALID]);
    c.B = ip[P_B];
    c.Hq = ip[P_HQ];
    c.Hkv = ip[P_HKV];
    c.Q = ip[P_Q];
    c.K = ip[P_K];
    c.Dk = ip[P_DK];
    c.Dv = ip[P_DV];
    c.has_bias = ip[P_HAS_BIAS] != 0;
    c.has_softcap = ip[P_HAS_SOFTCAP] != 0;
    c.has_sink = ip[P_HAS_SINK] != 0;
    c.drop_mode = static_cast<int>(ip[P_DROP_MODE]);
    c.key0 = static_cast<unsigned int>(ip[P_PHILOX_KEY0]);
    c.key1 = static_cast<unsigned int>(ip[P_PHILOX_KEY1]);
    c.offset = static_cast<unsigned int>(ip[P_PHILOX_OFFSET]);
    c.threshold = static_cast<unsigned long long>(ip[P_PHILOX_THRESHOLD]);
    c.post = rp[R_POST];
    c.softcap = rp[R_SOFTCAP];
    c.keep = rp[R_KEEP];
    // (held within the finite range: where alpha / c overflows, dot times the largest double
    // still saturates the tanh for every dot but a subnormal one, and a zero dot stays 0, not
    // 0 * inf = NaN)
    c.cap_scale = c.has_softcap ? fmax(fmin(c.post / c.softcap, 1.7976931348623157e308),
                                       -1.7976931348623157e308)
                                : 1.0;
    return c;
}

// Feature switches (FlashAttention-2's SOFTCAP_SWITCH / BOOL_SWITCH on Is_softcap, Is_dropout,
// Has_alibi): F is a set of REFATTN_F_* bits, and an instance compiled without a bit holds none
// of that feature's code (its per-element work: the softcap's tanh, the bias loads,
// the dropout multipliers). launch.plan runs a call on an instance whose F covers the features
// the call uses (gpu_backend/source.py PLAIN: F = 0, for calls with no softcap, bias or
// dropout); REFATTN_F_ALL is the general instance, which serves every call.
enum : unsigned {
    REFATTN_F_SOFTCAP = 1u,
    REFATTN_F_BIAS = 2u,
    REFATTN_F_DROPOUT = 4u,
    REFATTN_F_ALL = 7u,
};

// the score of one element: alpha dot, or with a softcap c tanh(dot (alpha / c)); *t gets the
// tanh (the softcap's slope d score / d (alpha dot) is 1 - t^2, refattn_cap_slope), 0 without a
// softcap. tanh_of: refattn_tanh_table (from the block's copy of the exp table or the global
// one: the same bits). Every kernel adds the bias to it the same way, after (the backward's
// recomputed scores must be the forward's bits: an fma with the bias rounds once where the
// forward rounds twice, and an ulp of a huge score is a factor of P). ONE_SKIPPED: alpha = 1
// not multiplied (the same bits; the forward: without that select its plain loop at D = 128
// split in two on sm_80; in the plain backward nvcc made it a branch on alpha that duplicated
// the elementwise code). SOFTCAP false (an instance compiled without the softcap: the feature
// sets above) holds no softcap code.
template <bool SOFTCAP = true, bool ONE_SKIPPED = false, typename Tanh>
__device__ __forceinline__ double refattn_score(const RefattnCall& c, double dot, double* t,
                                                Tanh tanh_of) {
    if (SOFTCAP && c.has_softcap) {
        *t = tanh_of(dot * c.cap_scale);
        return c.softcap * *t;
    }
    *t = 0.0;
    if (ONE_SKIPPED && c.post == 1.0) return dot;
    return c.post * dot;  // alpha applied once, after the product
}

// the dropout multiplier Z of (b, h, i, j)
__device__ __forceinline__ double refattn_multiplier(const RefattnCall& c, const long long* ip,
                                                     long long b, long long h, long long i,
                                                     long long j) {
    if (c.drop_mode == 1) return strided_at(c.z, ip, P_Z_S0, b, h, i, j);
    if (c.drop_mode == 2)
        return refattn_dropout_keep(b, h, i, j, c.Hq, c.key0, c.key1, c.offset, c.threshold)
                   ? c.keep
                   : 0.0;
    return 1.0;
}

// d score / d softcap input = 1 - t^2, from refattn_score's tanh t
__device__ __forceinline__ double refattn_cap_slope(double t) { return fma(-t, t, 1.0); }

// -- tiles on the tensor cores ------------------------------------------------------------------
// A block is NW = 4 warps. In the forward and dq kernels warp w owns the 8 MR query rows
// wr = 8 MR w .. of the block's BQ = 32 MR rows and walks the keys in tiles of BK; in the dk/dv
// kernel warp w owns 8 MR keys of the block's BKV = 32 MR and walks the queries in tiles of BQ2.
// Each product is a sequence of refattn_mma_rows<MR> steps (tile.cuh), k = 4 at a time:
//   S = Q K^T, dP = G_O V^T          A "row" reads of Q / G_O, B "row" reads of K / V
//   O += P V, dQ += dS K             the accumulator of S (C layout: lane holds columns 2t,
//                                    2t + 1 of each 8-wide n-tile) is the A fragment directly:
//                                    n-tile nt gives two k-steps, s = 0, 1, whose k index t means
//                                    key 8 nt + 2 t + s; B is read with the same permutation
//                                    ("col" reads of V / K). No shared-memory round trip.
// Element (nt, mr, s) of a lane's tile accumulator is acc[nt * 2 MR + 2 mr + s]: row
// g + 8 mr (+ the warp's first row), column 8 nt + 2 t + s. Row statistics (max, sum) are
// per lane and reduced over the 4 lanes of a quad (same g) with two shfl_xor steps. Tiles are
// classified and double-buffered by tile_loop.cuh (refattn_classify, refattn_tile_loop).
// the keep bits (word >= threshold) of one Philox draw: the 4 words of counter
// (j >> 2, i, b Hq + h, offset), i.e. keys 4 (j >> 2) .. + 3 of query i (philox.cuh)
__device__ __forceinline__ unsigned refattn_keep4(const RefattnCall& c, long long bh, int i,
                                                  int jgroup) {
    RefattnWords w;
    w.w[0] = static_cast<unsigned int>(jgroup);
    w.w[1] = static_cast<unsigned int>(i);
    w.w[2] = static_cast<unsigned int>(bh);
    w.w[3] = c.offset;
    const RefattnWords r = refattn_philox4x32_10(w, c.key0, c.key1);
    unsigned k4 = 0;
    REFATTN_UNROLL
    for (int e = 0; e < 4; ++e) k4 |= (r.w[e] >= c.threshold ? 1u : 0u) << e;
    return k4;
}

// Philox keep bits of a query-row tile (forward, dq), bit (nt MR + mr) 2 + s as
// refattn_tile_bits. The lane pair t, t ^ 1 holds the four keys 8 nt + 4 (t >> 1) .. + 3 of
// its rows: the pair splits the NT MR draws (even lane the even ones) and swaps the 4 keep
// bits with one shuffle, so every word of every draw is used once.
template <int MR, int NT>
__device__ __forceinline__ unsigned refattn_keep_bits_rows(const RefattnCall& c, long long bh,
                                                           int row, int j0, int t) {
    constexpr int ND = NT * MR;  // draws: (nt, mr); an odd last one is drawn by both lanes
    unsigned bits = 0;
    REFATTN_UNROLL
    for (int d2 = 0; d2 < ND; d2 += 2) {
        const int mine = d2 + (t & 1) < ND ? d2 + (t & 1) : d2;
        const int nt_m = mine / MR, mr_m = mine % MR;
        const unsigned k4 = refattn_keep4(c, bh, row + 8 * mr_m, (j0 >> 2) + 2 * nt_m + (t >> 1));
        const unsigned other = __shfl_xor_sync(0xffffffffu, k4, 1);
        REFATTN_UNROLL
        for (int e = 0; e < 2; ++e) {
            const int d = d2 + e, nt = d / MR, mr = d % MR;
            if (d >= ND) break;
            const unsigned draw = (e == (t & 1)) ? k4 : other;
            bits |= ((draw >> (2 * (t & 1))) & 3u) << ((nt * MR + mr) * 2);
        }
    }
    return bits;
}

// Philox keep bits of a key-row tile (dk/dv): element (nt, mr, s) is key row + 8 mr (row =
// j0 + wr + g), query i0 + 8 nt + 2 t + s. The 4 lanes u = g & 3 of equal g >> 2 and t hold the
// 4 keys of one group: they split the 2 NT MR draws (lane u the draws d with d % 4 == u) and
// gather each draw's bit u with four shuffles. With 2 draws (NT = MR = 1) lanes u = 2, 3 repeat
// draw 0, whose result they do not use.
template <int MR, int NT>
__device__ __forceinline__ unsigned refattn_keep_bits_keys(const RefattnCall& c, long long bh,
                                                           int row, int i0, int lane) {
    constexpr int ND = 2 * NT * MR;  // draws: (nt, s, mr)
    const int t = lane & 3, u = (lane >> 2) & 3;
    const int jgroup = (row - u) >> 2;  // the group of key row (mr = 0)
    unsigned bits = 0;
    REFATTN_UNROLL
    for (int d4 = 0; d4 < ND; d4 += 4) {
        const int mine = d4 + u < ND ? d4 + u : d4;
        const int mr_m = mine % MR, s_m = (mine / MR) % 2, nt_m = mine / (2 * MR);
        const unsigned k4 = refattn_keep4(c, bh, i0 + 8 * nt_m + 2 * t + s_m, jgroup + 2 * mr_m);
        REFATTN_UNROLL
        for (int v = 0; v < 4; ++v) {
            const unsigned draw = __shfl_sync(0xffffffffu, k4, (lane & ~12) | (v << 2));
            const int d = d4 + v, mr = d % MR, s = (d / MR) % 2, nt = d / (2 * MR);
            if (d >= ND) break;
            bits |= ((draw >> u) & 1u) << ((nt * MR + mr) * 2 + s);
        }
    }
    return bits;
}

// a strided operand (bias, Z: broadcast to (B, Hq, Q, K)) along one row of a tile: (b, h) and
// the lane's row fixed (a query i, or a key j when ROWS_ARE_KEYS), element `col` (the key j, or
// the query i) at p[col * step]. Made once per row and tile, so an element costs one multiply-add
// of its column instead of strided_at's four 64-bit products. The column strides are 0, 1 or K
// (C-contiguous operands of at most (B, Hq, Q, K) elements), within int.
struct RefattnLine {
    const double* p;
    int step;
    __device__ __forceinline__ double at(int col) const {
        return p[static_cast<long long>(col) * step];
    }
};

// (st: the operand's four strides, ip + P_BIAS_S0 or ip + P_Z_S0, or a copy of them in shared
// memory)
template <bool ROWS_ARE_KEYS>
__device__ __forceinline__ RefattnLine refattn_line(const double* x, const long long* st,
                                                    long long b, long long h, int row) {
    const int rs = ROWS_ARE_KEYS ? 3 : 2, cs = ROWS_ARE_KEYS ? 2 : 3;
    return {x + (b * st[0] + h * st[1] + row * st[rs]), static_cast<int>(st[cs])};
}

// the dropout multiplier of element bit `bit` of a tile: Philox keep bits, a dense Z (its line
// z, column col), or 1
__device__ __forceinline__ double refattn_tile_multiplier(const RefattnCall& c, unsigned keep,
                                                          int bit, const RefattnLine& z,
                                                          int col) {
    if (c.drop_mode == 2) return (keep >> bit) & 1u ? c.keep : 0.0;
    if (c.drop_mode == 1) return z.at(col);
    return 1.0;
}
