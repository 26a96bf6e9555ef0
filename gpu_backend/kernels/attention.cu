// refattn float64 attention kernels on the fp64 tensor cores: a FlashAttention-2 style
// forward (online softmax), a recomputing backward in two kernels (dq over key tiles; dk/dv over
// query tiles: 3 + 4 = 7 products, no floating-point atomics, every output element has one
// owner, so results are bit-identical run to run), and a trace mode for small problems. No
// kernel writes a [Q, K] array except the trace kernels (and the per-element bias gradient when
// the bias itself is per element).
//
// The head width D is a template parameter with instances 32, 64 and 128; the host zero-pads q, k, v, G_O to the instance (gpu_backend/launch.py INSTANCES,
// which mirrors the entry points at the end of this file, and sizes the dynamic shared memory).
// 128 threads per block; products through refattn_mma_rows (tile.cuh: mma.sync m16n8k4 on
// sm_90, m8n8k4 on sm_80), tiles loaded with cp.async into XOR-swizzled shared memory.
//
// Arguments of every kernel: x, the table of device addresses (RefattnPtr slots); ip, int64
// parameters (RefattnInt); rp, double parameters (RefattnReal). See common.cuh.
#include "common.cuh"
#include "philox.cuh"
#include "tile.cuh"
#include "tile_loop.cuh"
#include "visibility.cuh"

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
    double inv_softcap;  // 1 / softcap, computed once: the loops divide by refattn_div
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
    c.inv_softcap = c.has_softcap ? 1.0 / c.softcap : 1.0;
    return c;
}

// scores = post * dot, then c * tanh(scores / c) with a softcap; *capped gets the softcap's
// input (the scaled score before the cap)
__device__ __forceinline__ double refattn_score(const RefattnCall& c, double dot,
                                                double* capped_input) {
    double s = c.post == 1.0 ? dot : c.post * dot;  // alpha applied once, after the product
    *capped_input = s;
    if (c.has_softcap) s = c.softcap * tanh(refattn_div(s, c.softcap, c.inv_softcap));
    return s;
}

// the finite preference added after the softcap, before visibility
__device__ __forceinline__ double refattn_biased(const RefattnCall& c, const long long* ip,
                                                 double s, long long b, long long h,
                                                 long long i, long long j) {
    return c.has_bias ? s + strided_at(c.bias, ip, P_BIAS_S0, b, h, i, j) : s;
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

// d scores / d softcap_input = 1 - tanh^2, from the capped score s
__device__ __forceinline__ double refattn_cap_slope(const RefattnCall& c, double s) {
    if (!c.has_softcap) return 1.0;
    const double t = refattn_div(s, c.softcap, c.inv_softcap);
    return 1.0 - t * t;
}

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

template <bool ROWS_ARE_KEYS>
__device__ __forceinline__ RefattnLine refattn_line(const double* x, const long long* ip, int s0,
                                                    long long b, long long h, int row) {
    const int rs = ROWS_ARE_KEYS ? 3 : 2, cs = ROWS_ARE_KEYS ? 2 : 3;
    return {x + (b * ip[s0] + h * ip[s0 + 1] + row * ip[s0 + rs]),
            static_cast<int>(ip[s0 + cs])};
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

// The A operand of the first products (S = Q K^T, dP = G_O V^T; K Q^T, V G_O^T in dk/dv): the
// warp's own rows, element (mr, k) of the lane = row `row` + 8 mr, column k of the matrix. Up to
// D = 128 from the block's swizzled shared tile (`first` = the warp's first row in it); at wider
// heads (A_GLOBAL, where the tiles would not fit in shared memory) straight from the row-major
// matrix in global memory, a row at or past `rows` clamped to the last one (such a row of A
// feeds only its own row of the product, which the kernels never use).
template <int D>
constexpr bool REFATTN_A_GLOBAL = D > 128;

//
// a_at(mr, sw, k) returns that element for column k, given sw = the swizzled index of (row g,
// column k) in an 8-row block of a tile (refattn_mma_abt). The swizzle of (r, c) only moves bits
// 2-3 of c by f(r & 7) (tile.cuh), so refattn_swz<D>(r, c) = refattn_swz<D>(r & 7, c & 15) +
// (r & ~7) D + (c & ~15): a lane computes the swizzled indices of its few (r & 7, c & 15) once
// and every other shared read of the products is that index plus a constant.
template <int D, typename S1>
__device__ __forceinline__ auto refattn_rows_a(S1 tile, int first, const double* matrix,
                                               int row, int rows) {
    if constexpr (REFATTN_A_GLOBAL<D>) {
        return [=](int mr, int, int k) {
            const int r = row + 8 * mr < rows ? row + 8 * mr : rows - 1;
            return matrix[static_cast<long long>(r) * D + k];
        };
    } else {  // first: the warp's first row of the tile, a multiple of 8
        return [=](int mr, int sw, int) { return tile[(first + 8 * mr) * D + sw]; };
    }
}

// C (8 MR x 8 NT per lane-set) += A . B^T over k = 0 .. D - 1 (k ascending): A element (mr, k)
// from a_at (refattn_rows_a), B rows 8 nt + g of tile sb ("row" reads)
template <int D, int MR, int NT, typename A, typename S2>
__device__ __forceinline__ void refattn_mma_abt(double* acc, A a_at, S2 sb, int g, int t) {
    int lo[4];  // the swizzled index of (row g, column 4 n + t)
    REFATTN_UNROLL
    for (int n = 0; n < 4; ++n) lo[n] = refattn_swz<D>(g, 4 * n + t);
    for (int k16 = 0; k16 < D; k16 += 16) {
        REFATTN_UNROLL
        for (int n = 0; n < 4; ++n) {
            double a[MR];
            REFATTN_UNROLL
            for (int mr = 0; mr < MR; ++mr) a[mr] = a_at(mr, lo[n] + k16, k16 + 4 * n + t);
            REFATTN_UNROLL
            for (int nt = 0; nt < NT; ++nt)
                refattn_mma_rows<MR>(acc + nt * 2 * MR, a, sb[8 * nt * D + lo[n] + k16]);
        }
    }
}

// the swizzled indices of a lane's "col" reads (row 2 t + s, column 8 q + g), s, q in {0, 1}:
// element (8 nt + 2 t + s, 16 p + 8 q + g) of a tile is at 8 nt D + 16 p + lo[2 s + q]
template <int D>
__device__ __forceinline__ void refattn_col_offsets(int* lo, int g, int t) {
    REFATTN_UNROLL
    for (int s = 0; s < 2; ++s) {
        REFATTN_UNROLL
        for (int q = 0; q < 2; ++q) lo[2 * s + q] = refattn_swz<D>(2 * t + s, 8 * q + g);
    }
}

// O (8 MR x D per warp) += P . B: P the lane's accumulator tile (NT n-tiles) reused as the A
// fragment, B rows 8 nt + 2 t + s of tile sb ("col" reads)
template <int D, int MR, int NT, typename S2>
__device__ __forceinline__ void refattn_mma_pb(double* out, const double* p, S2 sb, int g,
                                               int t) {
    int lo[4];
    refattn_col_offsets<D>(lo, g, t);
    REFATTN_UNROLL
    for (int nt = 0; nt < NT; ++nt) {
        REFATTN_UNROLL
        for (int s = 0; s < 2; ++s) {
            double a[MR];
            REFATTN_UNROLL
            for (int mr = 0; mr < MR; ++mr) a[mr] = p[nt * 2 * MR + 2 * mr + s];
            REFATTN_UNROLL
            for (int dt = 0; dt < D / 8; ++dt)  // B (8 nt + 2 t + s, 8 dt + g)
                refattn_mma_rows<MR>(out + dt * 2 * MR, a,
                                     sb[8 * nt * D + 16 * (dt >> 1) + lo[2 * s + (dt & 1)]]);
        }
    }
}

// the same product into an accumulator kept in shared memory (the warp's own region, in fragment
// order: value e of lane l of n-tile dt at (dt 32 + l) 2 MR + e, 16-byte accesses), one n-tile
// of D at a time; for the dk/dv kernel, whose two accumulators would not fit the registers
template <int D, int MR, int NT, typename S1, typename S2>
__device__ __forceinline__ void refattn_mma_pb_shared(S1 acc, const double* p, S2 sb, int lane,
                                                      int g, int t) {
    constexpr int W = 2 * MR;
    int lo[4];
    refattn_col_offsets<D>(lo, g, t);
    REFATTN_NO_UNROLL
    for (int dt = 0; dt < D / 8; ++dt) {
        double c[W];
        REFATTN_UNROLL
        for (int e = 0; e < W; ++e) c[e] = acc[(dt * 32 + lane) * W + e];
        REFATTN_UNROLL
        for (int nt = 0; nt < NT; ++nt) {
            REFATTN_UNROLL
            for (int s = 0; s < 2; ++s) {
                double a[MR];
                REFATTN_UNROLL
                for (int mr = 0; mr < MR; ++mr) a[mr] = p[nt * 2 * MR + 2 * mr + s];
                refattn_mma_rows<MR>(c, a, sb[8 * nt * D + 16 * (dt >> 1) + lo[2 * s + (dt & 1)]]);
            }
        }
        REFATTN_UNROLL
        for (int e = 0; e < W; ++e) acc[(dt * 32 + lane) * W + e] = c[e];
    }
}

// -- forward: online softmax, FlashAttention-2 style ----------------------------------------------
// grid (ceil(Q / BQ), B * Hq), 128 threads; q (B,Hq,Q,D), k, v (B,Hkv,K,D) zero-padded by the
// host to the instance width D; writes output (B,Hq,Q,D), lse and row_max (B,Hq,Q), and per
// block the number of key tiles computed and skipped.
template <int D, int MR, int BK>
__device__ void refattn_forward(const unsigned long long* x, const long long* ip,
                                const double* rp) {
    constexpr int BQ = 8 * MR * REFATTN_WARPS, NT = BK / 8, DT = D / 8, W = 2 * MR;
    REFATTN_DYNAMIC_SHARED(double, smem);
    const RefattnCall c = refattn_call(x, ip, rp);
    const RefattnVisibility vis = refattn_visibility(x, ip);
    double* out = reinterpret_cast<double*>(x[X_OUT]);
    double* lse = reinterpret_cast<double*>(x[X_LSE]);
    double* row_max = reinterpret_cast<double*>(x[X_ROW_MAX]);
    long long* tiles = reinterpret_cast<long long*>(x[X_TILES]);
    const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wr = (tid >> 5) * 8 * MR;
    const long long bh = blockIdx.y, b = bh / c.Hq, h = bh % c.Hq, hk = c.head_map[h];
    const int Q = static_cast<int>(c.Q), K = static_cast<int>(c.K);
    const int i0 = static_cast<int>(blockIdx.x) * BQ, row = i0 + wr + g;
    const double* kmat = c.k + (b * c.Hkv + hk) * c.K * D;
    const double* vmat = c.v + (b * c.Hkv + hk) * c.K * D;
    constexpr bool AG = REFATTN_A_GLOBAL<D>;  // Q rows read from global memory
    auto sQ = smem;                     // BQ x D (none when AG)
    auto sK = sQ + (AG ? 0 : BQ * D);   // 2 x BK x D
    auto sV = sK + 2 * BK * D;          // 2 x BK x D
    const auto q_rows = refattn_rows_a<D>(sQ, wr, c.q + bh * c.Q * D, row, Q);
    const bool evaluate = vis.mode != 0 || vis.has_sanitized;
    auto classify = [&](int kb, unsigned* bits) {
        return refattn_classify<MR, NT, false>(vis, ip, evaluate, b, h, i0, kb * BK, row, t, Q,
                                               K, tid, bits);
    };
    auto load = [&](int kb) {
        const int buf = kb & 1;
        refattn_load_tile_async<BK, D, REFATTN_THREADS>(sK + buf * BK * D, kmat, kb * BK, K, tid);
        refattn_load_tile_async<BK, D, REFATTN_THREADS>(sV + buf * BK * D, vmat, kb * BK, K, tid);
    };

    if (!AG) refattn_load_tile_async<BQ, D, REFATTN_THREADS>(sQ, c.q + bh * c.Q * D, i0, Q, tid);
    double o[DT * W];
    REFATTN_UNROLL
    for (int e = 0; e < DT * W; ++e) o[e] = 0.0;
    // the running max and sum of the lane's rows; the sink logit joins every row's support
    double m[MR], l[MR];
    REFATTN_UNROLL
    for (int mr = 0; mr < MR; ++mr) {
        m[mr] = c.has_sink ? c.sink[h] : refattn_neg_inf();
        l[mr] = c.has_sink ? 1.0 : 0.0;
    }
    const double none = refattn_neg_inf();
    long long done = 0, skipped = 0;
    const int nkb = (K + BK - 1) / BK;
    // tile kb (and Q, copied before the loop) landed; cls FULL or PARTIAL
    auto compute = [&](int kb, int cls, unsigned bits) {
        const int j0 = kb * BK, buf = kb & 1;
        double s[NT * W];
        REFATTN_UNROLL
        for (int e = 0; e < NT * W; ++e) s[e] = 0.0;
        refattn_mma_abt<D, MR, NT>(s, q_rows, sK + buf * BK * D, g, t);  // S = Q K^T
        const unsigned keep = c.drop_mode == 2
                                  ? refattn_keep_bits_rows<MR, NT>(c, bh, row, j0, t)
                                  : 0u;
        REFATTN_UNROLL
        for (int mr = 0; mr < MR; ++mr) {
            const int i = row + 8 * mr;
            const RefattnLine bias_i = refattn_line<false>(c.bias, ip, P_BIAS_S0, b, h, i);
            const RefattnLine z_i = refattn_line<false>(c.z, ip, P_Z_S0, b, h, i);
            double tile_max = none;
            REFATTN_UNROLL
            for (int nt = 0; nt < NT; ++nt) {
                REFATTN_UNROLL
                for (int sb = 0; sb < 2; ++sb) {
                    const int e = nt * W + 2 * mr + sb, j = j0 + 8 * nt + 2 * t + sb;
                    double capped;
                    double v = refattn_score(c, s[e], &capped);
                    if (c.has_bias && i < Q && j < K) v += bias_i.at(j);
                    const int bit = (nt * MR + mr) * 2 + sb;
                    if (cls == REFATTN_PARTIAL && !((bits >> bit) & 1u)) v = none;
                    s[e] = v;  // visibility after the bias
                    tile_max = fmax(tile_max, v);
                }
            }
            tile_max = fmax(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
            tile_max = fmax(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
            const double m_new = fmax(m[mr], tile_max);
            const double corr = m_new == none ? 1.0 : (m[mr] == none ? 0.0 : exp(m[mr] - m_new));
            double part = 0.0;
            REFATTN_UNROLL
            for (int nt = 0; nt < NT; ++nt) {
                REFATTN_UNROLL
                for (int sb = 0; sb < 2; ++sb) {
                    const int e = nt * W + 2 * mr + sb;
                    double p = s[e] == none ? 0.0 : exp(s[e] - m_new);
                    part += p;
                    if (p != 0.0 && c.drop_mode != 0)
                        p *= refattn_tile_multiplier(c, keep, (nt * MR + mr) * 2 + sb, z_i,
                                                     j0 + 8 * nt + 2 * t + sb);
                    s[e] = p;  // P~ Z
                }
            }
            part += __shfl_xor_sync(0xffffffffu, part, 1);
            part += __shfl_xor_sync(0xffffffffu, part, 2);
            l[mr] = l[mr] * corr + part;
            m[mr] = m_new;
            REFATTN_UNROLL
            for (int dt = 0; dt < DT; ++dt) {
                o[dt * W + 2 * mr] *= corr;
                o[dt * W + 2 * mr + 1] *= corr;
            }
        }
        refattn_mma_pb<D, MR, NT>(o, s, sV + buf * BK * D, g, t);  // O += P~ Z V
    };
    refattn_tile_loop(nkb, classify, load, compute, &done, &skipped);
    REFATTN_UNROLL
    for (int mr = 0; mr < MR; ++mr) {
        const int i = row + 8 * mr;
        if (i >= Q) continue;
        const bool used = c.query_valid[b * c.Q + i] != 0;
        const double inv_l = 1.0 / l[mr];  // O / l as refattn_div: one division per row
        double* orow = out + (bh * c.Q + i) * D;
        REFATTN_UNROLL
        for (int dt = 0; dt < DT; ++dt) {
            orow[8 * dt + 2 * t] = used ? refattn_div(o[dt * W + 2 * mr], l[mr], inv_l) : 0.0;
            orow[8 * dt + 2 * t + 1] =
                used ? refattn_div(o[dt * W + 2 * mr + 1], l[mr], inv_l) : 0.0;
        }
        if (t == 0) {
            lse[bh * c.Q + i] = m[mr] + log(l[mr]);
            row_max[bh * c.Q + i] = m[mr];
        }
    }
    refattn_count_tiles(tiles, bh * gridDim.x + blockIdx.x, done, skipped);
}

// -- dq, and the contraction row_dot = sum_j P G_P -----------------------------------------------
// grid (ceil(Q / BQ), B * Hq), 128 threads: dq (B,Hq,Q,D) = fq sum_j dS k, dS = P (G_P - D)
// times the softcap slope, the bias gradient of modes 1 (per element) and 3 (summed over keys),
// and row_dot (B,Hq,Q) = sum_j P G_P as a by-product (the sink's gradient). Products per tile:
// S = Q K^T, dP = G_O V^T, dQ += dS K.
template <int D, int MR, int BK>
__device__ void refattn_dq(const unsigned long long* x, const long long* ip, const double* rp) {
    constexpr int BQ = 8 * MR * REFATTN_WARPS, NT = BK / 8, DT = D / 8, W = 2 * MR;
    REFATTN_DYNAMIC_SHARED(double, smem);
    const RefattnCall c = refattn_call(x, ip, rp);
    const RefattnVisibility vis = refattn_visibility(x, ip);
    const long long gbias_mode = ip[P_GBIAS_MODE];
    double* dq = reinterpret_cast<double*>(x[X_DQ]);
    double* gbias = reinterpret_cast<double*>(x[X_GBIAS]);
    double* row_dot = reinterpret_cast<double*>(x[X_ROW_DOT]);
    long long* tiles = reinterpret_cast<long long*>(x[X_TILES]);
    const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wr = (tid >> 5) * 8 * MR;
    const long long bh = blockIdx.y, b = bh / c.Hq, h = bh % c.Hq, hk = c.head_map[h];
    const int Q = static_cast<int>(c.Q), K = static_cast<int>(c.K);
    const int i0 = static_cast<int>(blockIdx.x) * BQ, row = i0 + wr + g;
    const double* kmat = c.k + (b * c.Hkv + hk) * c.K * D;
    const double* vmat = c.v + (b * c.Hkv + hk) * c.K * D;
    constexpr bool AG = REFATTN_A_GLOBAL<D>;  // Q and G_O rows read from global memory
    auto sQ = smem;                     // BQ x D (none when AG)
    auto sG = sQ + (AG ? 0 : BQ * D);   // BQ x D: G_O (none when AG)
    auto sK = sG + (AG ? 0 : BQ * D);   // 2 x BK x D
    auto sV = sK + 2 * BK * D;          // 2 x BK x D
    const auto q_rows = refattn_rows_a<D>(sQ, wr, c.q + bh * c.Q * D, row, Q);
    const auto g_rows = refattn_rows_a<D>(sG, wr, c.g_o + bh * c.Q * D, row, Q);
    const bool evaluate = vis.mode != 0 || vis.has_sanitized;
    auto classify = [&](int kb, unsigned* bits) {
        return refattn_classify<MR, NT, false>(vis, ip, evaluate, b, h, i0, kb * BK, row, t, Q,
                                               K, tid, bits);
    };
    auto load = [&](int kb) {
        const int buf = kb & 1;
        refattn_load_tile_async<BK, D, REFATTN_THREADS>(sK + buf * BK * D, kmat, kb * BK, K, tid);
        refattn_load_tile_async<BK, D, REFATTN_THREADS>(sV + buf * BK * D, vmat, kb * BK, K, tid);
    };

    if (!AG) {
        refattn_load_tile_async<BQ, D, REFATTN_THREADS>(sQ, c.q + bh * c.Q * D, i0, Q, tid);
        refattn_load_tile_async<BQ, D, REFATTN_THREADS>(sG, c.g_o + bh * c.Q * D, i0, Q, tid);
    }
    double dqa[DT * W];
    REFATTN_UNROLL
    for (int e = 0; e < DT * W; ++e) dqa[e] = 0.0;
    double lse_i[MR], d_i[MR], acc_pg[MR], acc_gb[MR];
    REFATTN_UNROLL
    for (int mr = 0; mr < MR; ++mr) {
        const int i = row + 8 * mr;
        lse_i[mr] = i < Q ? c.lse[bh * c.Q + i] : 0.0;
        d_i[mr] = i < Q ? c.dvec[bh * c.Q + i] : 0.0;
        acc_pg[mr] = 0.0;  // row_dot = sum_j P G_P
        acc_gb[mr] = 0.0;  // the bias gradient summed over keys (bias mode 3)
    }
    long long done = 0, skipped = 0;
    const int nkb = (K + BK - 1) / BK;
    auto compute = [&](int kb, int cls, unsigned bits) {  // tile kb (and Q, G_O) landed
        const int j0 = kb * BK, buf = kb & 1;
        double s[NT * W], dp[NT * W];
        REFATTN_UNROLL
        for (int e = 0; e < NT * W; ++e) s[e] = dp[e] = 0.0;
        refattn_mma_abt<D, MR, NT>(s, q_rows, sK + buf * BK * D, g, t);   // S = Q K^T
        refattn_mma_abt<D, MR, NT>(dp, g_rows, sV + buf * BK * D, g, t);  // dP = G_O V^T
        const unsigned keep = c.drop_mode == 2
                                  ? refattn_keep_bits_rows<MR, NT>(c, bh, row, j0, t)
                                  : 0u;
        REFATTN_UNROLL
        for (int mr = 0; mr < MR; ++mr) {
            const int i = row + 8 * mr;
            const RefattnLine bias_i = refattn_line<false>(c.bias, ip, P_BIAS_S0, b, h, i);
            const RefattnLine z_i = refattn_line<false>(c.z, ip, P_Z_S0, b, h, i);
            double* gbias_i = gbias + (bh * c.Q + i) * c.K;  // per element (bias mode 1)
            REFATTN_UNROLL
            for (int nt = 0; nt < NT; ++nt) {
                REFATTN_UNROLL
                for (int sb = 0; sb < 2; ++sb) {
                    const int e = nt * W + 2 * mr + sb, j = j0 + 8 * nt + 2 * t + sb;
                    const int bit = (nt * MR + mr) * 2 + sb;
                    double ds = 0.0;
                    const bool seen = i < Q && j < K &&
                                      (cls == REFATTN_FULL || ((bits >> bit) & 1u));
                    if (seen) {
                        double capped;
                        const double sc = refattn_score(c, s[e], &capped);
                        const double p = exp((c.has_bias ? sc + bias_i.at(j) : sc) - lse_i[mr]);
                        double gp = dp[e];  // G_Pdrop = G_O . v_j, then G_P = G_Pdrop Z
                        if (c.drop_mode != 0) gp *= refattn_tile_multiplier(c, keep, bit, z_i, j);
                        acc_pg[mr] += p * gp;
                        const double g_s = p * (gp - d_i[mr]);  // grad_scores
                        if (gbias_mode == 1) gbias_i[j] = g_s;
                        if (gbias_mode == 3) acc_gb[mr] += g_s;
                        ds = g_s * refattn_cap_slope(c, sc);
                    }  // (the host zero-fills a per-element bias gradient)
                    s[e] = ds;
                }
            }
        }
        refattn_mma_pb<D, MR, NT>(dqa, s, sK + buf * BK * D, g, t);  // dQ += dS K
    };
    refattn_tile_loop(nkb, classify, load, compute, &done, &skipped);
    REFATTN_UNROLL
    for (int mr = 0; mr < MR; ++mr) {
        acc_pg[mr] += __shfl_xor_sync(0xffffffffu, acc_pg[mr], 1);
        acc_pg[mr] += __shfl_xor_sync(0xffffffffu, acc_pg[mr], 2);
        acc_gb[mr] += __shfl_xor_sync(0xffffffffu, acc_gb[mr], 1);
        acc_gb[mr] += __shfl_xor_sync(0xffffffffu, acc_gb[mr], 2);
        const int i = row + 8 * mr;
        if (i >= Q) continue;
        if (t == 0) row_dot[bh * c.Q + i] = acc_pg[mr];
        double* drow = dq + (bh * c.Q + i) * D;
        REFATTN_UNROLL
        for (int dt = 0; dt < DT; ++dt) {
            drow[8 * dt + 2 * t] = rp[R_FQ] * dqa[dt * W + 2 * mr];
            drow[8 * dt + 2 * t + 1] = rp[R_FQ] * dqa[dt * W + 2 * mr + 1];
        }
        if (gbias_mode == 3 && t == 0) gbias[bh * c.Q + i] = acc_gb[mr];
    }
    refattn_count_tiles(tiles, bh * gridDim.x + blockIdx.x, done, skipped);
}

// -- dk, dv: one block per BKV keys of one kv head, looping over its query heads in order -------
// grid (ceil(K / BKV), B * Hkv), 128 threads; dk (B,Hkv,K,D) = fk sum_{h ~ g} sum_i dS q,
// dv (B,Hkv,K,D) = sum_{h ~ g} sum_i (P Z) G_O; the bias gradient of mode 2 (summed over
// queries), per query head. Products per tile: S^T = K Q^T, dP^T = V G_O^T, dV += (P Z)^T G_O,
// dK += dS^T Q.
template <int D, int MR, int BQ2>
__device__ void refattn_dkdv(const unsigned long long* x, const long long* ip,
                             const double* rp) {
    constexpr int BKV = 8 * MR * REFATTN_WARPS, NT = BQ2 / 8, DT = D / 8, W = 2 * MR;
    REFATTN_DYNAMIC_SHARED(double, smem);
    const RefattnCall c = refattn_call(x, ip, rp);
    const RefattnVisibility vis = refattn_visibility(x, ip);
    const long long gbias_mode = ip[P_GBIAS_MODE];
    double* dk = reinterpret_cast<double*>(x[X_DK]);
    double* dv = reinterpret_cast<double*>(x[X_DV]);
    double* gbias = reinterpret_cast<double*>(x[X_GBIAS]);
    long long* tiles = reinterpret_cast<long long*>(x[X_TILES]);
    const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wr = (tid >> 5) * 8 * MR;
    const long long bg = blockIdx.y, b = bg / c.Hkv, hg = bg % c.Hkv;
    const int Q = static_cast<int>(c.Q), K = static_cast<int>(c.K);
    const int j0 = static_cast<int>(blockIdx.x) * BKV, row = j0 + wr + g;
    constexpr bool AG = REFATTN_A_GLOBAL<D>;  // K and V rows read from global memory
    auto sK = smem;                     // BKV x D (none when AG)
    auto sV = sK + (AG ? 0 : BKV * D);  // BKV x D (none when AG)
    auto sQ = sV + (AG ? 0 : BKV * D);  // 2 x BQ2 x D
    auto sG = sQ + 2 * BQ2 * D;   // 2 x BQ2 x D: G_O
    auto sDV = sG + 2 * BQ2 * D + (tid >> 5) * 8 * MR * D;  // the warp's dV accumulator
    // above D = 128 dK (64 doubles a lane) is kept in shared memory too (BKV x D after dV)
    constexpr bool DK_SHARED = D > 128;
    auto sDK = sDV + BKV * D;  // the warp's dK accumulator (DK_SHARED)
    const bool evaluate = vis.mode != 0 || vis.has_sanitized;

    const auto k_rows = refattn_rows_a<D>(sK, wr, c.k + bg * c.K * D, row, K);
    const auto v_rows = refattn_rows_a<D>(sV, wr, c.v + bg * c.K * D, row, K);
    if (!AG) {
        refattn_load_tile_async<BKV, D, REFATTN_THREADS>(sK, c.k + bg * c.K * D, j0, K, tid);
        refattn_load_tile_async<BKV, D, REFATTN_THREADS>(sV, c.v + bg * c.K * D, j0, K, tid);
    }
    double dka[DK_SHARED ? 1 : DT * W];
    REFATTN_UNROLL
    for (int e = 0; e < (DK_SHARED ? 1 : DT * W); ++e) dka[e] = 0.0;
    for (int e = 0; e < DT * W; ++e) {  // the lane's own entries of the warp's regions
        sDV[((e / W) * 32 + lane) * W + e % W] = 0.0;
        if (DK_SHARED) sDK[((e / W) * 32 + lane) * W + e % W] = 0.0;
    }
    long long done = 0, skipped = 0;
    const int nqb = (Q + BQ2 - 1) / BQ2;
    for (long long h = 0; h < c.Hq; ++h) {  // the query heads of kv head hg, in order
        if (c.head_map[h] != hg) continue;
        const long long bh = b * c.Hq + h;
        const double* qmat = c.q + bh * c.Q * D;
        const double* gmat = c.g_o + bh * c.Q * D;
        auto classify = [&](int qb, unsigned* bits) {
            return refattn_classify<MR, NT, true>(vis, ip, evaluate, b, h, j0, qb * BQ2, row, t,
                                                  Q, K, tid, bits);
        };
        auto load = [&](int qb) {
            const int buf = qb & 1;
            refattn_load_tile_async<BQ2, D, REFATTN_THREADS>(sQ + buf * BQ2 * D, qmat, qb * BQ2,
                                                             Q, tid);
            refattn_load_tile_async<BQ2, D, REFATTN_THREADS>(sG + buf * BQ2 * D, gmat, qb * BQ2,
                                                             Q, tid);
        };
        double gb[MR];  // bias gradient of (b, h, j) summed over queries (mode 2)
        REFATTN_UNROLL
        for (int mr = 0; mr < MR; ++mr) gb[mr] = 0.0;
        auto compute = [&](int qb, int cls, unsigned bits) {  // tile qb (and K, V) landed
            const int i0 = qb * BQ2, buf = qb & 1;
            double st[NT * W], dpt[NT * W];
            REFATTN_UNROLL
            for (int e = 0; e < NT * W; ++e) st[e] = dpt[e] = 0.0;
            refattn_mma_abt<D, MR, NT>(st, k_rows, sQ + buf * BQ2 * D, g, t);   // K Q^T
            refattn_mma_abt<D, MR, NT>(dpt, v_rows, sG + buf * BQ2 * D, g, t);  // V G_O^T
            const unsigned keep = c.drop_mode == 2
                                      ? refattn_keep_bits_keys<MR, NT>(c, bh, row, i0, lane)
                                      : 0u;
            double lse_i[2 * NT], d_i[2 * NT];
            REFATTN_UNROLL
            for (int e = 0; e < 2 * NT; ++e) {
                const int i = i0 + 8 * (e >> 1) + 2 * t + (e & 1);
                lse_i[e] = i < Q ? c.lse[bh * c.Q + i] : 0.0;
                d_i[e] = i < Q ? c.dvec[bh * c.Q + i] : 0.0;
            }
            REFATTN_UNROLL
            for (int mr = 0; mr < MR; ++mr) {
                const int j = row + 8 * mr;
                const RefattnLine bias_j = refattn_line<true>(c.bias, ip, P_BIAS_S0, b, h, j);
                const RefattnLine z_j = refattn_line<true>(c.z, ip, P_Z_S0, b, h, j);
                REFATTN_UNROLL
                for (int nt = 0; nt < NT; ++nt) {
                    REFATTN_UNROLL
                    for (int sb = 0; sb < 2; ++sb) {
                        const int e = nt * W + 2 * mr + sb, i = i0 + 8 * nt + 2 * t + sb;
                        const int bit = (nt * MR + mr) * 2 + sb;
                        double pz = 0.0, ds = 0.0;
                        const bool seen = i < Q && j < K &&
                                          (cls == REFATTN_FULL || ((bits >> bit) & 1u));
                        if (seen) {
                            double capped;
                            const double sc = refattn_score(c, st[e], &capped);
                            const double p = exp((c.has_bias ? sc + bias_j.at(i) : sc) -
                                                 lse_i[2 * nt + sb]);
                            const double z = c.drop_mode != 0
                                                 ? refattn_tile_multiplier(c, keep, bit, z_j, i)
                                                 : 1.0;
                            const double gp = dpt[e] * z;
                            const double g_s = p * (gp - d_i[2 * nt + sb]);
                            gb[mr] += g_s;
                            pz = p * z;
                            ds = g_s * refattn_cap_slope(c, sc);
                        }
                        st[e] = pz;
                        dpt[e] = ds;
                    }
                }
            }
            refattn_mma_pb_shared<D, MR, NT>(sDV, st, sG + buf * BQ2 * D, lane, g, t);  // dV
            if constexpr (DK_SHARED)  // dK += dS^T Q
                refattn_mma_pb_shared<D, MR, NT>(sDK, dpt, sQ + buf * BQ2 * D, lane, g, t);
            else
                refattn_mma_pb<D, MR, NT>(dka, dpt, sQ + buf * BQ2 * D, g, t);
        };
        refattn_tile_loop(nqb, classify, load, compute, &done, &skipped);
        REFATTN_UNROLL
        for (int mr = 0; mr < MR; ++mr) {
            gb[mr] += __shfl_xor_sync(0xffffffffu, gb[mr], 1);
            gb[mr] += __shfl_xor_sync(0xffffffffu, gb[mr], 2);
            const int j = row + 8 * mr;
            if (gbias_mode == 2 && t == 0 && j < K) gbias[bh * c.K + j] = gb[mr];
        }
    }
    refattn_cp_async_wait<0>();  // K and V when every head was skipped
    REFATTN_UNROLL
    for (int mr = 0; mr < MR; ++mr) {
        const int j = row + 8 * mr;
        if (j >= K) continue;
        double* krow = dk + (bg * c.K + j) * D;
        double* vrow = dv + (bg * c.K + j) * D;
        REFATTN_UNROLL
        for (int dt = 0; dt < DT; ++dt) {
            const int e = (dt * 32 + lane) * W + 2 * mr;  // (DK_SHARED)
            krow[8 * dt + 2 * t] = rp[R_FK] * (DK_SHARED ? sDK[e] : dka[dt * W + 2 * mr]);
            krow[8 * dt + 2 * t + 1] =
                rp[R_FK] * (DK_SHARED ? sDK[e + 1] : dka[dt * W + 2 * mr + 1]);
            vrow[8 * dt + 2 * t] = sDV[(dt * 32 + lane) * W + 2 * mr];
            vrow[8 * dt + 2 * t + 1] = sDV[(dt * 32 + lane) * W + 2 * mr + 1];
        }
    }
    refattn_count_tiles(tiles, bg * gridDim.x + blockIdx.x, done, skipped);
}

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
        double capped;
        const double s = refattn_score(c, dot, &capped);
        const double biased = refattn_biased(c, ip, s, b, h, i, j);
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
// instances <D, MR, BK or BQ2>: 8 MR rows per warp; source.py INSTANCES holds the same table
// (a test compares). The tiles are chosen for 0 spills (ptxas, sm_80 and sm_90) and every block
// within an A100's 163 KiB: dq keeps S and dP (2 x BK / 8 x 2 MR doubles per lane) beside its
// dQ accumulator; dk/dv has MR = 1 and keeps dV in shared memory (refattn_mma_pb_shared).
// No instance at D = 256: the forward's O (64 doubles per lane at MR = 1) and the dk/dv
// kernel's dK beside the tile work spill on sm_80.
#define REFATTN_ARGS const unsigned long long *x, const long long *ip, const double *rp
extern "C" __global__ void attention_forward_d32(REFATTN_ARGS) { refattn_forward<32, 2, 32>(x, ip, rp); }
extern "C" __global__ void attention_forward_d64(REFATTN_ARGS) { refattn_forward<64, 2, 32>(x, ip, rp); }
extern "C" __global__ void attention_forward_d128(REFATTN_ARGS) { refattn_forward<128, 1, 32>(x, ip, rp); }
extern "C" __global__ void attention_forward_d256(REFATTN_ARGS) { refattn_forward<256, 1, 8>(x, ip, rp); }
extern "C" __global__ void attention_dq_d32(REFATTN_ARGS) { refattn_dq<32, 2, 16>(x, ip, rp); }
extern "C" __global__ void attention_dq_d64(REFATTN_ARGS) { refattn_dq<64, 2, 16>(x, ip, rp); }
extern "C" __global__ void attention_dq_d128(REFATTN_ARGS) { refattn_dq<128, 1, 16>(x, ip, rp); }
extern "C" __global__ void attention_dq_d256(REFATTN_ARGS) { refattn_dq<256, 1, 8>(x, ip, rp); }
extern "C" __global__ void attention_dkdv_d32(REFATTN_ARGS) { refattn_dkdv<32, 1, 16>(x, ip, rp); }
extern "C" __global__ void attention_dkdv_d64(REFATTN_ARGS) { refattn_dkdv<64, 1, 32>(x, ip, rp); }
extern "C" __global__ void attention_dkdv_d128(REFATTN_ARGS) { refattn_dkdv<128, 1, 16>(x, ip, rp); }
extern "C" __global__ void attention_dkdv_d256(REFATTN_ARGS) { refattn_dkdv<256, 1, 8>(x, ip, rp); }
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
REFATTN_EXPORT(attention_dq_d32)
REFATTN_EXPORT(attention_dq_d64)
REFATTN_EXPORT(attention_dq_d128)
REFATTN_EXPORT(attention_dq_d256)
REFATTN_EXPORT(attention_dkdv_d32)
REFATTN_EXPORT(attention_dkdv_d64)
REFATTN_EXPORT(attention_dkdv_d128)
REFATTN_EXPORT(attention_dkdv_d256)
REFATTN_EXPORT(attention_row_dot_output)
REFATTN_EXPORT(attention_trace_forward)
REFATTN_EXPORT(attention_trace_backward)
