// refattn kernels: the recomputing backward, dq over key tiles and dk/dv over query tiles.
#pragma once
#include "call.cuh"
#include "products.cuh"
#include "tile_loop.cuh"
#include "visibility.cuh"

// -- pieces of both kernels -----------------------------------------------------------------------
// the sum over the 4 lanes of a quad (t = 0..3: one row's columns), two shfl_xor steps
__device__ __forceinline__ double refattn_quad_sum(double v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// one visible element of the recomputing backward (contract: P = exp(biased - lse), G_P =
// G_Pdrop Z, grad_scores = P (G_P - D), dS = grad_scores times the softcap's slope): dot the
// Q.K product, gpd = G_Pdrop (G_O . v), bias and z the element's bias line and multiplier
// (column col), lse and d the query row's log-sum-exp and row contraction D. F: the feature
// set compiled in (call.cuh's REFATTN_F_*); without a bit the element holds none of that
// feature's code (the plain instances, F = 0: no softcap, bias or dropout)
struct RefattnGradElement {
    double p, z, gp, g_s, ds;
};
template <unsigned F, typename Exp, typename Tanh>
__device__ __forceinline__ RefattnGradElement refattn_grad_element(
    const RefattnCall& c, double dot, double gpd, const RefattnLine& bias, int col, double lse,
    double d, unsigned keep, int bit, const RefattnLine& z_line, Exp exp_of, Tanh tanh_of) {
    constexpr bool SOFTCAP = (F & REFATTN_F_SOFTCAP) != 0, BIAS = (F & REFATTN_F_BIAS) != 0,
                   DROPOUT = (F & REFATTN_F_DROPOUT) != 0;
    RefattnGradElement r;
    double t;
    const double sc = refattn_score<SOFTCAP>(c, dot, &t, tanh_of);
    r.p = exp_of(sc + (BIAS && c.has_bias ? bias.at(col) : 0.0) - lse);  // (+0.0: sc's bits)
    r.z = DROPOUT && c.drop_mode != 0 ? refattn_tile_multiplier(c, keep, bit, z_line, col)
                                      : 1.0;
    r.gp = gpd * r.z;
    r.g_s = r.p * (r.gp - d);
    r.ds = SOFTCAP ? r.g_s * refattn_cap_slope(t) : r.g_s;  // (t = 0: slope 1)
    return r;
}

// the first two products of a tile, acc1 = A1 B1^T and acc2 = A2 B2^T (S and dP in dq; S^T and
// dP^T in dk/dv; accumulators of NT n-tiles, zeroed), over the warp's columns of D, `between()`
// run between them. SPLIT = 2: a warp pair splitting the head width (the even warp k = 0 ..
// D/2 - 1, the odd one the rest): each product's partial sums of the partner's half of the
// tile's columns go out as soon as it is done (x1, x2: the exchange regions, free since the
// tile loop's barrier), and after a barrier the partner's partial sums of the warp's own half
// come in, so the first NT / 2 n-tiles of acc1 and acc2 hold the warp's own columns, whole
template <int D, int MR, int NT, int SPLIT, int UNROLL_K, typename A1, typename A2, typename S1,
          typename S2,
          typename X, typename Between>
__device__ __forceinline__ void refattn_first_products(double* acc1, A1 a1, S1 b1, double* acc2,
                                                       A2 a2, S2 b2, X x1, X x2, int half,
                                                       int warp, int lane, int g, int t,
                                                       Between between) {
    constexpr int KN = D / SPLIT, NTW = NT / SPLIT;
    // the own n-tiles first where the selects cost more (32 a product at NT = 4; at NT = 2 the
    // swapped offsets spilled 76-260 bytes)
    constexpr bool SWAP = SPLIT == 2 && NT >= 4;
    const int swap = SWAP ? half : 0;
    refattn_mma_abt<D, MR, NT, KN, (UNROLL_K >= 1)>(acc1, a1, b1, g, t, half * KN, swap);
    if constexpr (SPLIT == 2) refattn_pair_send<MR, NTW, SWAP>(acc1, x1, half, warp, lane);
    between();
    refattn_mma_abt<D, MR, NT, KN, (UNROLL_K == 2)>(acc2, a2, b2, g, t, half * KN, swap);
    if constexpr (SPLIT == 2) {
        refattn_pair_send<MR, NTW, SWAP>(acc2, x2, half, warp, lane);
        __syncthreads();  // the partner's partial sums of this warp's columns written
        refattn_pair_add<MR, NTW>(acc1, x1, half, warp, lane);
        refattn_pair_add<MR, NTW>(acc2, x2, half, warp, lane);
    }
}

// row `row` (D doubles) of an output from the lane's fragments: columns 8 dt + 2 t + s get
// scale * at(dt, s)
template <int D, typename At>
__device__ __forceinline__ void refattn_store_row(double* row, int t, double scale, At at) {
    REFATTN_UNROLL
    for (int dt = 0; dt < D / 8; ++dt) {
        row[8 * dt + 2 * t] = scale * at(dt, 0);
        row[8 * dt + 2 * t + 1] = scale * at(dt, 1);
    }
}

// -- dq, and the contraction row_dot = sum_j P G_P -----------------------------------------------
// grid (ceil(Q / BQ), B * Hq), 128 threads: dq (B,Hq,Q,D) = fq sum_j dS k, dS = P (G_P - D)
// times the softcap slope, the bias gradient of modes 1 (per element) and 3 (summed over keys),
// and row_dot (B,Hq,Q) = sum_j P G_P as a by-product (the sink's gradient). Products per tile:
// S = Q K^T, dP = G_O V^T, dQ += dS K. F: the feature set compiled in (call.cuh; F = 0, the
// plain instance, has no softcap, bias, bias gradient or dropout code). SPLIT = 2: warp pairs,
// as refattn_dkdv's: the pair's two warps own the same 16 rows (MR = 2 each, m16n8k4 on sm_90);
// for S and dP they split the head width (the even warp k = 0 .. D/2 - 1, the odd one the rest,
// each over the whole tile), swap the partial sums of each other's half of the tile's keys and
// add them, so each computes dS for its own half of the keys; they swap those halves (in the
// tile's V buffer) and each accumulates half of dQ's columns over all the tile's keys,
// ascending, and they add their row sums (row_dot, the bias gradient summed over keys) at the
// end. Every streamed K and V double read feeds 16 rows.
template <int D, int MR, int BK, unsigned F = REFATTN_F_ALL, int SPLIT = 1, int UNROLL_K = 0>
__device__ void refattn_dq(const unsigned long long* x, const long long* ip, const double* rp) {
    static_assert(SPLIT == 1 || (SPLIT == 2 && MR == 1 && BK % 16 == 0 && D % 32 == 0 &&
                                 !REFATTN_A_GLOBAL<D>),
                  "a warp pair splits the head width and the 16-key n-tile pairs of 8-row "
                  "warps' tiles, its Q and G_O rows in shared memory");
    constexpr int BQ = 8 * MR * REFATTN_WARPS, NT = BK / 8, DT = D / 8;
    // per warp: MRW row blocks, NT n-tiles of S and dP (over its half of D when paired), NTW of
    // them its own (dS: from key column cw), DTW n-tiles of dQ
    constexpr int MRW = MR * SPLIT, NTW = NT / SPLIT, DTW = DT / SPLIT, W = 2 * MRW;
    constexpr bool BIAS = (F & REFATTN_F_BIAS) != 0, DROPOUT = (F & REFATTN_F_DROPOUT) != 0;
    REFATTN_DYNAMIC_SHARED(double, smem);
    const RefattnCall c = refattn_call(x, ip, rp);
    const RefattnVisibility vis = refattn_visibility(x, ip);
    const long long gbias_mode = BIAS ? ip[P_GBIAS_MODE] : 0;
    double* dq = reinterpret_cast<double*>(x[X_DQ]);
    double* gbias = reinterpret_cast<double*>(x[X_GBIAS]);
    double* row_dot = reinterpret_cast<double*>(x[X_ROW_DOT]);
    long long* tiles = reinterpret_cast<long long*>(x[X_TILES]);
    const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3, warp = tid >> 5;
    const int half = SPLIT == 1 ? 0 : warp & 1;
    const int wr = (warp / SPLIT) * 8 * MRW, cw = half * 8 * NTW, ow = half * 8 * DTW;
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
    // SPLIT = 2: the pairs' exchange regions of the partial S and dP of the partner's keys
    // (refattn_pair_put's layout, 4 warps' worth of NTW n-tiles each)
    auto sXS = sV + 2 * BK * D, sXD = sXS + REFATTN_WARPS * NTW * 32 * W;
    // the block's copy of the exp table (refattn_exp_table_fill) and the lane's copy in it,
    // with a feature compiled in up to D = 128 (launch.uses_exp_table: the plain instance
    // spilled 8 bytes with it at D = 128 on sm_90; at D = 256 its reads took the loop above 1
    // byte of shared memory per FMA)
    constexpr bool EXP_TABLE = F != 0 && D <= 128;
    auto sE = sXS + (SPLIT == 2 ? 2 * REFATTN_WARPS * NTW * 32 * W : 0);
    const auto exp_tab = sE + 2 * (lane & 7);
    auto p_exp = [&](double v) {
        if constexpr (EXP_TABLE) return refattn_exp_table(v, exp_tab);
        else return exp(v);
    };
    auto p_tanh = [&](double u) {  // (the same bits either way)
        if constexpr (EXP_TABLE) return refattn_tanh_table<REFATTN_EXP_TABLE_SHARED>(u, exp_tab);
        else return refattn_tanh_table<REFATTN_EXP_TABLE_GLOBAL>(u, refattn_exp2_32);
    };
    const auto q_rows = refattn_rows_a<D>(sQ, wr, c.q + bh * c.Q * D, row, Q);
    const auto g_rows = refattn_rows_a<D>(sG, wr, c.g_o + bh * c.Q * D, row, Q);
    const bool evaluate = vis.mode != 0 || vis.has_sanitized;
    auto classify = [&](int kb, unsigned* bits) {
        return refattn_classify<MRW, NTW, false, BQ, BK>(vis, ip, evaluate, b, h, i0, kb * BK,
                                                         row, t, Q, K, tid, bits, cw);
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
    double dqa[DTW * W];
    REFATTN_UNROLL
    for (int e = 0; e < DTW * W; ++e) dqa[e] = 0.0;
    double lse_i[MRW], d_i[MRW], acc_pg[MRW], acc_gb[MRW];
    REFATTN_UNROLL
    for (int mr = 0; mr < MRW; ++mr) {
        const int i = row + 8 * mr;
        lse_i[mr] = i < Q ? c.lse[bh * c.Q + i] : 0.0;
        d_i[mr] = i < Q ? c.dvec[bh * c.Q + i] : 0.0;
        acc_pg[mr] = 0.0;  // row_dot = sum_j P G_P
        acc_gb[mr] = 0.0;  // the bias gradient summed over keys (bias mode 3)
    }
    long long done = 0, skipped = 0;
    const int nkb = (K + BK - 1) / BK;
    auto compute = [&](int kb, int cls, unsigned bits) {  // tile kb (and Q, G_O) landed
        const int j0 = kb * BK + cw, buf = kb & 1;  // j0: the warp's first key
        double s[NT * W], dp[NT * W];
        REFATTN_UNROLL
        for (int e = 0; e < NT * W; ++e) s[e] = dp[e] = 0.0;
        // S = Q K^T, dP = G_O V^T (a pair: each warp's own keys first, whole)
        refattn_first_products<D, MRW, NT, SPLIT, UNROLL_K>(s, q_rows, sK + buf * BK * D, dp,
                                                            g_rows,
                                                  sV + buf * BK * D, sXS, sXD, half, warp,
                                                  lane, g, t, [] {});
        const unsigned keep = DROPOUT && c.drop_mode == 2
                                  ? refattn_keep_bits_rows<MRW, NTW>(c, bh, row, j0, t)
                                  : 0u;
        // SELECT: every element is evaluated and the invisible ones' results discarded by a
        // select (no branch per element: a warp's lanes run the same instructions, and the SASS
        // analysis sees a plain call's elementwise work on its path); the feature lines are read
        // at a clamped row and column, so an element past Q or K reads in range. Otherwise
        // (where the select spilled: 24 bytes on sm_90 with every feature at D = 256, 8 on
        // sm_80 without, 72-80 in the plain instance at D = 128 on sm_90) only the visible
        // elements are evaluated, behind a branch. Same results either way.
        constexpr bool SELECT =
            D == 256 ? F == 0 && REFATTN_MMA_ARCH >= 900 : !(D == 128 && F == 0);
        REFATTN_UNROLL
        for (int mr = 0; mr < MRW; ++mr) {
            const int i = row + 8 * mr, ic = SELECT && i >= Q ? Q - 1 : i;
            const RefattnLine bias_i =
                BIAS ? refattn_line<false>(c.bias, ip + P_BIAS_S0, b, h, ic) : RefattnLine{};
            const RefattnLine z_i =
                DROPOUT ? refattn_line<false>(c.z, ip + P_Z_S0, b, h, ic) : RefattnLine{};
            double* gbias_i = gbias + (bh * c.Q + i) * c.K;  // per element (bias mode 1)
            REFATTN_UNROLL
            for (int nt = 0; nt < NTW; ++nt) {
                REFATTN_UNROLL
                for (int sb = 0; sb < 2; ++sb) {
                    const int e = nt * W + 2 * mr + sb, j = j0 + 8 * nt + 2 * t + sb;
                    const int bit = (nt * MRW + mr) * 2 + sb;
                    if constexpr (SELECT) {
                        // (a column past K is invisible in a PARTIAL tile and never in a FULL
                        // one; a row past Q is never stored)
                        const bool seen = cls == REFATTN_FULL || ((bits >> bit) & 1u);
                        const RefattnGradElement r = refattn_grad_element<F>(
                            c, s[e], dp[e], bias_i, j < K ? j : K - 1, lse_i[mr], d_i[mr], keep,
                            bit, z_i, p_exp, p_tanh);
                        // (+0.0 for an invisible element leaves the sums' bits as they were:
                        // they start at +0.0, so none is ever -0.0)
                        acc_pg[mr] += seen ? r.p * r.gp : 0.0;
                        if (BIAS && gbias_mode == 1 && seen && i < Q) gbias_i[j] = r.g_s;
                        if (BIAS && gbias_mode == 3) acc_gb[mr] += seen ? r.g_s : 0.0;
                        s[e] = seen ? r.ds : 0.0;
                    } else {
                        double ds = 0.0;
                        const bool seen = i < Q && j < K &&
                                          (cls == REFATTN_FULL || ((bits >> bit) & 1u));
                        if (seen) {
                            const RefattnGradElement r = refattn_grad_element<F>(
                                c, s[e], dp[e], bias_i, j, lse_i[mr], d_i[mr], keep, bit, z_i,
                                p_exp, p_tanh);
                            acc_pg[mr] += r.p * r.gp;
                            if (BIAS && gbias_mode == 1) gbias_i[j] = r.g_s;
                            if (BIAS && gbias_mode == 3) acc_gb[mr] += r.g_s;
                            ds = r.ds;
                        }
                        s[e] = ds;
                    }  // (the host zero-fills a per-element bias gradient)
                }
            }
        }
        if constexpr (SPLIT == 1) {
            refattn_mma_pb<D, MRW, NT>(dqa, s, sK + buf * BK * D, g, t);  // dQ += dS K
        } else {
            // dQ's columns ow .. += dS K over both halves of the keys, dS exchanged in the V
            // buffer (free: every warp's G_O V^T was done before the partial sums' barrier)
            refattn_pair_put<MRW, NTW>(sV + buf * BK * D, s, warp, lane);
            __syncthreads();
            refattn_pair_gather<MRW, NTW>(s, sV + buf * BK * D, warp, lane);
            refattn_mma_pb<D, MRW, NT, 0, DTW>(dqa, s, sK + buf * BK * D + ow, g, t);
        }
    };
    if constexpr (EXP_TABLE) refattn_exp_table_fill(sE, tid, 32 * REFATTN_WARPS);
    refattn_set_table_row<BQ, BK, false>(vis, b, h, i0, Q, K, tid);
    refattn_tile_loop(nkb, classify, load, compute, &done, &skipped);
    REFATTN_UNROLL
    for (int mr = 0; mr < MRW; ++mr) {
        acc_pg[mr] = refattn_quad_sum(acc_pg[mr]);
        acc_gb[mr] = refattn_quad_sum(acc_gb[mr]);
    }
    if constexpr (SPLIT == 2) {  // the pair's row sums (each after the slots' last reads)
        __syncthreads();
        refattn_pair_sum<MRW>(acc_pg, warp, g);
        if (BIAS && gbias_mode == 3) {
            __syncthreads();
            refattn_pair_sum<MRW>(acc_gb, warp, g);
        }
    }
    REFATTN_UNROLL
    for (int mr = 0; mr < MRW; ++mr) {
        const int i = row + 8 * mr;
        if (i >= Q) continue;
        if (t == 0 && half == 0) row_dot[bh * c.Q + i] = acc_pg[mr];
        refattn_store_row<D / SPLIT>(dq + (bh * c.Q + i) * D + ow, t, rp[R_FQ],
                                     [&](int dt, int s) { return dqa[dt * W + 2 * mr + s]; });
        if (BIAS && gbias_mode == 3 && t == 0 && half == 0) gbias[bh * c.Q + i] = acc_gb[mr];
    }
    refattn_count_tiles(tiles, bh * gridDim.x + blockIdx.x, done, skipped);
}

// -- dk, dv: one block per BKV keys of one kv head, looping over its query heads in order -------
// grid (ceil(K / BKV), B * Hkv), 128 threads; dk (B,Hkv,K,D) = fk sum_{h ~ g} sum_i dS q,
// dv (B,Hkv,K,D) = sum_{h ~ g} sum_i (P Z) G_O; the bias gradient of mode 2 (summed over
// queries), per query head. Products per tile: S^T = K Q^T, dP^T = V G_O^T, dV += (P Z)^T G_O,
// dK += dS^T Q. F: the feature set compiled in, as refattn_dq's. SPLIT = 2: warp pairs, the
// pair's two warps owning the same 16 keys (MR = 2 each, m16n8k4 on sm_90): for S^T and dP^T
// they split the head width (the even warp k = 0 .. D/2 - 1, the odd one the rest, each over
// the whole tile), swap the partial sums of each other's half of the tile's queries and add
// them (S^T = lower half + upper half), so each computes P and dS for its own half of the
// queries; they swap those halves and each accumulates its half of dV's and dK's columns over
// all the tile's queries, ascending. dV stays in registers (no dV region), dK too but for 6 of
// a warp's 8 n-tiles with every feature compiled in (in its shared region), and every streamed
// Q and G_O double read feeds 16 keys.
template <int D, int MR, int BQ2, unsigned F = REFATTN_F_ALL, int SPLIT = 1, int UNROLL_K = 0>
__device__ void refattn_dkdv(const unsigned long long* x, const long long* ip,
                             const double* rp) {
    static_assert(SPLIT == 1 || (SPLIT == 2 && MR == 1 && BQ2 % 16 == 0 && D % 32 == 0 &&
                                 !REFATTN_A_GLOBAL<D>),
                  "a warp pair splits the head width and the 16-query n-tile pairs of 8-row "
                  "warps' tiles, its K and V rows in shared memory");
    constexpr int BKV = 8 * MR * REFATTN_WARPS, NT = BQ2 / 8, DT = D / 8;
    // per warp: MRW row blocks, NT n-tiles of the first products (over its half of D when
    // paired), NTW of them its own (P, dS: from query column cw), DTW n-tiles of dV and dK
    constexpr int MRW = MR * SPLIT, NTW = NT / SPLIT, DTW = DT / SPLIT, W = 2 * MRW;
    constexpr bool BIAS = (F & REFATTN_F_BIAS) != 0, DROPOUT = (F & REFATTN_F_DROPOUT) != 0;
    REFATTN_DYNAMIC_SHARED(double, smem);
    const RefattnCall c = refattn_call(x, ip, rp);
    const RefattnVisibility vis = refattn_visibility(x, ip);
    const long long gbias_mode = BIAS ? ip[P_GBIAS_MODE] : 0;
    // CUDA's exp and the softcap's tanh from the global exp table (no room for the block's copy
    // at D = 128 on an A100)
    auto p_exp = [](double v) { return exp(v); };
    auto p_tanh = [](double u) {
        return refattn_tanh_table<REFATTN_EXP_TABLE_GLOBAL>(u, refattn_exp2_32);
    };
    // the outputs' addresses, at D = 32 read after the loop (read before it, sm_80's instance
    // kept both in a 16-byte stack frame across the loop; at D = 256 sm_90's spilled 56 bytes
    // when they were read after it)
    constexpr bool LATE_OUTPUTS = D == 32;
    double* dk = LATE_OUTPUTS ? nullptr : reinterpret_cast<double*>(x[X_DK]);
    double* dv = LATE_OUTPUTS ? nullptr : reinterpret_cast<double*>(x[X_DV]);
    double* gbias = reinterpret_cast<double*>(x[X_GBIAS]);
    long long* tiles = reinterpret_cast<long long*>(x[X_TILES]);
    const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3, warp = tid >> 5;
    const int half = SPLIT == 1 ? 0 : warp & 1;  // the warp's half of its pair's work
    const int wr = (warp / SPLIT) * 8 * MRW, cw = half * 8 * NTW, ow = half * 8 * DTW;
    const long long bg = blockIdx.y, b = bg / c.Hkv, hg = bg % c.Hkv;
    const int Q = static_cast<int>(c.Q), K = static_cast<int>(c.K);
    const int j0 = static_cast<int>(blockIdx.x) * BKV, row = j0 + wr + g;
    constexpr bool AG = REFATTN_A_GLOBAL<D>;  // K and V rows read from global memory
    auto sK = smem;                     // BKV x D (none when AG)
    auto sV = sK + (AG ? 0 : BKV * D);  // BKV x D (none when AG)
    auto sQ = sV + (AG ? 0 : BKV * D);  // 2 x BQ2 x D
    auto sG = sQ + 2 * BQ2 * D;   // 2 x BQ2 x D: G_O
    // SPLIT = 1: the warps' dV accumulators (BKV x D); SPLIT = 2: the pairs' two exchange
    // regions, 4 warps' worth each (refattn_pair_put's layout): the partial S^T and dP^T of the
    // partner's queries (NTW n-tiles each), then P Z and dS of the warp's own
    auto sDV = sG + 2 * BQ2 * D + warp * 8 * MR * D;
    auto sXS = sG + 2 * BQ2 * D, sXD = sXS + REFATTN_WARPS * NTW * 32 * W;
    // above D = 128 dK (64 doubles a lane) is kept half in shared memory (BKV x D / 2 after dV):
    // its n-tiles 0 .. DKR - 1 in registers, DKR .. DT - 1 in the warp's own shared region
    // (all 32 in registers spilled 940 / 276 bytes, 24 spilled 168 on sm_80); a paired warp with
    // every feature keeps 2 of its 8 in registers at D = 128, beside dV's 8 (3 to 8 spilled
    // 64-804 bytes, docs/gpu.md), 2 of its 4 at D = 64 (all 4 spilled 40 bytes on sm_90), a
    // plain one (F = 0) all of them
    constexpr int DKR = D > 128 ? DT / 2 : SPLIT == 2 && F != 0 ? DTW / (D == 128 ? 4 : 2) : DTW;
    constexpr bool DK_SHARED = DKR < DTW;
    // refattn_mma_pb_shared's loop over unrolled n-tile pairs, but for the plain instance at
    // D = 64 (it spilled 16 bytes on sm_90 there: single n-tiles, the offsets selected)
    [[maybe_unused]] constexpr bool PB_PAIRS = !(F == 0 && D == 64);
    // the warp's region of dK's n-tiles DKR .. DTW - 1 (DK_SHARED), after the BKV x D of dV
    // (SPLIT = 1) or the two exchange regions (SPLIT = 2)
    auto sDK = sG + 2 * BQ2 * D + (SPLIT == 1 ? BKV * D : 2 * REFATTN_WARPS * NTW * 32 * W) +
               warp * (DTW - DKR) * 32 * W;
    const bool evaluate = vis.mode != 0 || vis.has_sanitized;

    const auto k_rows = refattn_rows_a<D>(sK, wr, c.k + bg * c.K * D, row, K);
    const auto v_rows = refattn_rows_a<D>(sV, wr, c.v + bg * c.K * D, row, K);
    if (!AG) {
        refattn_load_tile_async<BKV, D, REFATTN_THREADS>(sK, c.k + bg * c.K * D, j0, K, tid);
        refattn_load_tile_async<BKV, D, REFATTN_THREADS>(sV, c.v + bg * c.K * D, j0, K, tid);
    }
    double dka[DKR * W], dva[SPLIT == 2 ? DTW * W : 1];
    REFATTN_UNROLL
    for (int e = 0; e < DKR * W; ++e) dka[e] = 0.0;
    if constexpr (SPLIT == 2) {
        REFATTN_UNROLL
        for (int e = 0; e < DTW * W; ++e) dva[e] = 0.0;
    }
    for (int e = 0; e < DTW * W; ++e) {  // the lane's own entries of the warp's regions
        if (SPLIT == 1) sDV[((e / W) * 32 + lane) * W + e % W] = 0.0;
        if (e >= DKR * W) sDK[((e / W - DKR) * 32 + lane) * W + e % W] = 0.0;
    }
    long long done = 0, skipped = 0;
    const int nqb = (Q + BQ2 - 1) / BQ2;
    for (long long h = 0; h < c.Hq; ++h) {  // the query heads of kv head hg, in order
        if (c.head_map[h] != hg) continue;
        const long long bh = b * c.Hq + h;
        const double* qmat = c.q + bh * c.Q * D;
        const double* gmat = c.g_o + bh * c.Q * D;
        auto classify = [&](int qb, unsigned* bits) {
            return refattn_classify<MRW, NTW, true, BKV, BQ2>(vis, ip, evaluate, b, h, j0,
                                                              qb * BQ2, row, t, Q, K, tid, bits,
                                                              cw);
        };
        auto load = [&](int qb) {
            const int buf = qb & 1;
            refattn_load_tile_async<BQ2, D, REFATTN_THREADS>(sQ + buf * BQ2 * D, qmat, qb * BQ2,
                                                             Q, tid);
            refattn_load_tile_async<BQ2, D, REFATTN_THREADS>(sG + buf * BQ2 * D, gmat, qb * BQ2,
                                                             Q, tid);
        };
        double gb[MRW];  // bias gradient of (b, h, j) summed over queries (mode 2)
        REFATTN_UNROLL
        for (int mr = 0; mr < MRW; ++mr) gb[mr] = 0.0;
        auto compute = [&](int qb, int cls, unsigned bits) {  // tile qb (and K, V) landed
            const int i0 = qb * BQ2 + cw, buf = qb & 1;  // i0: the warp's first query
            // the Philox keep bits: up to D = 128 before the products, while only dK is live
            // (MR = 2 at D = 64 spilled 92 bytes on sm_80 with them after the products, 56 after
            // K Q^T); at D = 256 after K Q^T (before it, sm_80's ptxas wraps their shuffles in a
            // convergence CALL in the loop); for a pair after the partial sums' exchange (before
            // the products, sm_90 spilled 112 bytes)
            auto keep_bits = [&] {
                return DROPOUT && c.drop_mode == 2
                           ? refattn_keep_bits_keys<MRW, NTW>(c, bh, row, i0, lane)
                           : 0u;
            };
            unsigned keep = AG || SPLIT == 2 ? 0u : keep_bits();
            double st[NT * W], dpt[NT * W];
            REFATTN_UNROLL
            for (int e = 0; e < NT * W; ++e) st[e] = dpt[e] = 0.0;
            // S^T = K Q^T, dP^T = V G_O^T (a pair: each warp's own queries first, whole)
            refattn_first_products<D, MRW, NT, SPLIT, UNROLL_K>(
                st, k_rows, sQ + buf * BQ2 * D, dpt, v_rows, sG + buf * BQ2 * D, sXS, sXD, half,
                warp, lane, g, t, [&] {
                    if constexpr (AG) keep = keep_bits();
                });
            if constexpr (SPLIT == 2) {
                __syncthreads();  // the regions free for P Z and dS
                keep = keep_bits();
            }
            const double* lse_h = c.lse + bh * c.Q;  // read per element (L1), not kept
            const double* dvec_h = c.dvec + bh * c.Q;
            // SELECT: every element evaluated, the invisible ones discarded by a select (as
            // refattn_dq), the per-query reads and the feature lines at a clamped query and key;
            // otherwise (the select spilled 16 and 24 bytes on sm_90 with every feature at D = 32
            // and 128) only the visible ones, behind a branch: at D = 128 with the results
            // selected after it and the reads clamped (the form below it spilled 44 bytes on
            // sm_80 there), at D = 32 as before issue 43 (the other spilled 16 on sm_80)
            constexpr bool SELECT = !(F != 0 && (D == 32 || D == 128));
            REFATTN_UNROLL
            for (int mr = 0; mr < MRW; ++mr) {
                const int j = row + 8 * mr, jc = (SELECT || D == 128) && j >= K ? K - 1 : j;
                const RefattnLine bias_j =
                    BIAS ? refattn_line<true>(c.bias, ip + P_BIAS_S0, b, h, jc) : RefattnLine{};
                const RefattnLine z_j =
                    DROPOUT ? refattn_line<true>(c.z, ip + P_Z_S0, b, h, jc) : RefattnLine{};
                REFATTN_UNROLL
                for (int nt = 0; nt < NTW; ++nt) {
                    REFATTN_UNROLL
                    for (int sb = 0; sb < 2; ++sb) {
                        const int e = nt * W + 2 * mr + sb, i = i0 + 8 * nt + 2 * t + sb;
                        const int bit = (nt * MRW + mr) * 2 + sb;
                        if constexpr (SELECT) {
                            // (a query past Q is invisible in a PARTIAL tile and never in a
                            // FULL one; a key past K is never stored)
                            const bool seen = cls == REFATTN_FULL || ((bits >> bit) & 1u);
                            const int ic = i < Q ? i : Q - 1;
                            const RefattnGradElement r = refattn_grad_element<F>(
                                c, st[e], dpt[e], bias_j, ic, lse_h[ic], dvec_h[ic], keep, bit,
                                z_j, p_exp, p_tanh);
                            if (BIAS) gb[mr] += seen ? r.g_s : 0.0;  // (+0.0: bits unchanged)
                            st[e] = seen ? r.p * r.z : 0.0;
                            dpt[e] = seen ? r.ds : 0.0;
                        } else if constexpr (D == 128) {
                            const bool seen = cls == REFATTN_FULL || ((bits >> bit) & 1u);
                            const int ic = i < Q ? i : Q - 1;
                            RefattnGradElement r{0.0, 0.0, 0.0, 0.0, 0.0};
                            if (seen)
                                r = refattn_grad_element<F>(c, st[e], dpt[e], bias_j, ic,
                                                            lse_h[ic], dvec_h[ic], keep, bit, z_j,
                                                            p_exp, p_tanh);
                            if (BIAS) gb[mr] += seen ? r.g_s : 0.0;
                            st[e] = seen ? r.p * r.z : 0.0;
                            dpt[e] = seen ? r.ds : 0.0;
                        } else {
                            double pz = 0.0, ds = 0.0;
                            const bool seen = i < Q && j < K &&
                                              (cls == REFATTN_FULL || ((bits >> bit) & 1u));
                            if (seen) {
                                const RefattnGradElement r = refattn_grad_element<F>(
                                    c, st[e], dpt[e], bias_j, i, lse_h[i], dvec_h[i], keep, bit,
                                    z_j, p_exp, p_tanh);
                                if (BIAS) gb[mr] += r.g_s;
                                pz = r.p * r.z;
                                ds = r.ds;
                            }
                            st[e] = pz;
                            dpt[e] = ds;
                        }
                    }
                }
            }
            if constexpr (SPLIT == 1) {
                refattn_mma_pb_shared<D, MR, NT, 0, DT, PB_PAIRS>(sDV, st, sG + buf * BQ2 * D,
                                                                  lane, g, t);  // dV
                // dK += dS^T Q
                refattn_mma_pb<D, MR, NT, 0, DKR>(dka, dpt, sQ + buf * BQ2 * D, g, t);
                if constexpr (DK_SHARED)
                    refattn_mma_pb_shared<D, MR, NT, DKR, DT, PB_PAIRS>(
                        sDK, dpt, sQ + buf * BQ2 * D, lane, g, t);
            } else {
                // dV's and dK's columns ow .. over both halves of the queries, P Z and dS
                // exchanged in the partial sums' regions
                // exchanged in A fragment order (products.cuh), but at D = 64, where it spilled
                // 576 bytes on sm_90
                constexpr bool A_ORDER = D != 64;
                refattn_pair_put<MRW, NTW, A_ORDER>(sXS, st, warp, lane);
                refattn_pair_put<MRW, NTW, A_ORDER>(sXD, dpt, warp, lane);
                __syncthreads();
                refattn_pair_gather<MRW, NTW, A_ORDER>(st, sXS, warp, lane);  // both halves
                refattn_pair_gather<MRW, NTW, A_ORDER>(dpt, sXD, warp, lane);
                refattn_mma_pb<D, MRW, NT, 0, DTW>(dva, st, sG + buf * BQ2 * D + ow, g, t);
                refattn_mma_pb<D, MRW, NT, 0, DKR>(dka, dpt, sQ + buf * BQ2 * D + ow, g, t);
                if constexpr (DK_SHARED)
                    refattn_mma_pb_shared<D, MRW, NT, DKR, DTW>(sDK, dpt, sQ + buf * BQ2 * D + ow,
                                                                lane, g, t);
            }
        };
        refattn_set_table_row<BKV, BQ2, true>(vis, b, h, j0, Q, K, tid);
        refattn_tile_loop(nqb, classify, load, compute, &done, &skipped);
        REFATTN_UNROLL
        for (int mr = 0; mr < MRW; ++mr) gb[mr] = refattn_quad_sum(gb[mr]);
        if constexpr (SPLIT == 2) {  // (after the tile loop's closing barrier)
            if (BIAS && gbias_mode == 2) refattn_pair_sum<MRW>(gb, warp, g);
        }
        REFATTN_UNROLL
        for (int mr = 0; mr < MRW; ++mr) {
            const int j = row + 8 * mr;
            if (BIAS && gbias_mode == 2 && t == 0 && half == 0 && j < K)
                gbias[bh * c.K + j] = gb[mr];
        }
    }
    refattn_cp_async_wait<0>();  // K and V when every head was skipped
    if constexpr (LATE_OUTPUTS) {
        dk = reinterpret_cast<double*>(x[X_DK]);
        dv = reinterpret_cast<double*>(x[X_DV]);
    }
    REFATTN_UNROLL
    for (int mr = 0; mr < MRW; ++mr) {
        const int j = row + 8 * mr;
        if (j >= K) continue;
        // the warps' shared regions in fragment order: value 2 mr + s of n-tile dt of the lane
        auto shared_at = [&](auto region, int dt, int s) {
            return region[(dt * 32 + lane) * W + 2 * mr + s];
        };
        refattn_store_row<D / SPLIT>(dk + (bg * c.K + j) * D + ow, t, rp[R_FK], [&](int dt, int s) {
            return dt < DKR ? dka[(dt < DKR ? dt : 0) * W + 2 * mr + s]
                            : shared_at(sDK, dt - DKR, s);
        });
        refattn_store_row<D / SPLIT>(dv + (bg * c.K + j) * D + ow, t, 1.0, [&](int dt, int s) {
            return SPLIT == 2 ? dva[(SPLIT == 2 ? dt : 0) * W + 2 * mr + s]
                              : shared_at(sDV, dt, s);
        });
    }
    refattn_count_tiles(tiles, bg * gridDim.x + blockIdx.x, done, skipped);
}
