// refattn kernels: the forward (online softmax over key tiles, FlashAttention-2 structure).
#pragma once
#include "call.cuh"
#include "products.cuh"
#include "tile_loop.cuh"
#include "visibility.cuh"

// SPLIT = 2 pairs the warps (FlashAttention-2's 8-row warps would read the streamed K and V
// for only 8 rows each, 1 byte per FMA at least): warps 2 p and 2 p + 1 own the same 16 rows
// (MR = 2 each; the block's BQ = 32 MR rows are unchanged). For S they split the head width (the
// even warp columns 0 .. D/2 - 1 of Q and K, the odd one the rest, each over the whole tile),
// swap the partial sums of each other's half of the tile's keys through a small exchange region
// and add them (refattn_pair_send / refattn_pair_add, as the dq pairs do), so each holds S whole
// for its own half of the keys; they swap their tile row maxima (refattn_pair_rows), their P~ Z
// halves through the tile's K buffer (free once every S is computed) and each computes half of
// O's columns over all the tile's keys (refattn_pair_pb); their row sums are added at the end.
// Each lane keeps no more than an 8-row warp's accumulators while every K and V double it reads
// feeds 16 rows, and the 16-key tiles at D = 128 fit two blocks in an H100/H200's shared memory
// (100 KiB each: two warps per scheduler) where a key split of S needed 32-key tiles (160 KiB)
// to stay within 1 byte of shared memory per FMA.
template <int D, int MR, int BK, unsigned F = REFATTN_F_ALL, int SPLIT = 1>
__device__ void refattn_forward(const unsigned long long* x, const long long* ip,
                                const double* rp) {
    static_assert(SPLIT == 1 || (SPLIT == 2 && MR == 1 && BK % 16 == 0 && D % 32 == 0 &&
                                 !REFATTN_A_GLOBAL<D>),
                  "a warp pair splits the head width, 16-key n-tile pairs and 8-column n-tiles of "
                  "8-row warps' tiles, its Q rows in shared memory");
    constexpr int BQ = 8 * MR * REFATTN_WARPS, NT = BK / 8, DT = D / 8;
    // per warp: MRW row blocks, NT n-tiles of S (over its half of D when paired), NTW of them
    // its own (the pair's half of the keys, from column cw), DTW n-tiles of O (its half of the
    // columns)
    constexpr int MRW = MR * SPLIT, NTW = NT / SPLIT, DTW = DT / SPLIT, W = 2 * MRW;
    constexpr bool SOFTCAP = (F & REFATTN_F_SOFTCAP) != 0, BIAS = (F & REFATTN_F_BIAS) != 0,
                   DROPOUT = (F & REFATTN_F_DROPOUT) != 0;
    REFATTN_DYNAMIC_SHARED(double, smem);
    const RefattnCall c = refattn_call(x, ip, rp);
    const RefattnVisibility vis = refattn_visibility(x, ip);
    double* out = reinterpret_cast<double*>(x[X_OUT]);
    double* lse = reinterpret_cast<double*>(x[X_LSE]);
    double* row_max = reinterpret_cast<double*>(x[X_ROW_MAX]);
    long long* tiles = reinterpret_cast<long long*>(x[X_TILES]);
    const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2, t = lane & 3, warp = tid >> 5;
    const int half = SPLIT == 1 ? 0 : warp & 1;  // the warp's half of its pair's tile
    const int wr = (warp / SPLIT) * 8 * MRW, cw = half * 8 * NTW, ow = half * 8 * DTW;
    const long long bh = blockIdx.y, b = bh / c.Hq, h = bh % c.Hq, hk = c.head_map[h];
    const int Q = static_cast<int>(c.Q), K = static_cast<int>(c.K);
    const int i0 = static_cast<int>(blockIdx.x) * BQ, row = i0 + wr + g;
    const double* kmat = c.k + (b * c.Hkv + hk) * c.K * D;
    const double* vmat = c.v + (b * c.Hkv + hk) * c.K * D;
    constexpr bool AG = REFATTN_A_GLOBAL<D>;  // Q rows read from global memory
    auto sQ = smem;                     // BQ x D (none when AG)
    auto sK = sQ + (AG ? 0 : BQ * D);   // 2 x BK x D
    auto sV = sK + 2 * BK * D;          // 2 x BK x D
    // SPLIT = 2: the pairs' exchange region of the partial S of the partner's keys
    // (refattn_pair_put's layout, 4 warps' worth of NTW n-tiles each)
    auto sXS = sV + 2 * BK * D;
    // the block's copy of the exp table (refattn_exp_table_fill), and the lane's copy in it,
    // where its 16-byte reads keep the loop within 1 byte of shared memory per FMA (up to
    // D = 64, and the warp pairs; launch.shared_bytes counts it for the same instances)
    constexpr bool EXP_TABLE = D <= 64 || SPLIT == 2;
    auto sE = sXS + (SPLIT == 2 ? BQ * BK : 0);
    const auto exp_tab = sE + 2 * (lane & 7);
    // the softmax's exp from the table up to D = 64 (on the D = 128 pairs the reads of both
    // took the loop to 1.03 bytes of shared memory per FMA: refattn_exp there); the softcap's
    // tanh from the table always (the block's copy, or the global one: the same bits)
    auto softmax_exp = [&](double x) {
        if constexpr (EXP_TABLE && D <= 64) return refattn_exp_table(x, exp_tab);
        else return refattn_exp(x);
    };
    auto softcap_tanh = [&](double u) {
        if constexpr (EXP_TABLE) return refattn_tanh_table<REFATTN_EXP_TABLE_SHARED>(u, exp_tab);
        else return refattn_tanh_table<REFATTN_EXP_TABLE_GLOBAL>(u, refattn_exp2_32);
    };
    // the bias and Z strides (ip[P_BIAS_S0 ..], ip[P_Z_S0 ..]) for the lines made per row and
    // tile: broadcast shared loads (copied before refattn_set_table_row's barrier) instead of
    // four global loads of the same addresses per line (the model charges a global load 32
    // lanes' bytes of L2 bandwidth, and the loop has no register to keep them in); above
    // D = 128 (AG: 8-row warps at 1 byte of shared memory per FMA already) the global loads
    __shared__ long long strides[8];
    const long long* bias_st = AG ? ip + P_BIAS_S0 : strides;
    const long long* z_st = AG ? ip + P_Z_S0 : strides + 4;
    const auto q_rows = refattn_rows_a<D>(sQ, wr, c.q + bh * c.Q * D, row, Q);
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
    if (!AG) refattn_load_tile_async<BQ, D, REFATTN_THREADS>(sQ, c.q + bh * c.Q * D, i0, Q, tid);
    double o[DTW * W];
    REFATTN_UNROLL
    for (int e = 0; e < DTW * W; ++e) o[e] = 0.0;
    // the running max and sum of the lane's rows; the sink logit joins every row's support (its
    // exp(0) = 1 counted once: by the pair's first warp)
    double m[MRW], l[MRW];
    REFATTN_UNROLL
    for (int mr = 0; mr < MRW; ++mr) {
        m[mr] = c.has_sink ? c.sink[h] : refattn_neg_inf();
        l[mr] = c.has_sink && half == 0 ? 1.0 : 0.0;
    }
    const double none = refattn_neg_inf();
    long long done = 0, skipped = 0;
    const int nkb = (K + BK - 1) / BK;
    // tile kb (and Q, copied before the loop) landed; cls FULL or PARTIAL
    auto compute = [&](int kb, int cls, unsigned bits) {
        const int j0 = kb * BK + cw, buf = kb & 1;  // j0: the warp's first key
        double s[NT * W];
        REFATTN_UNROLL
        for (int e = 0; e < NT * W; ++e) s[e] = 0.0;
        if constexpr (SPLIT == 1) {
            refattn_mma_abt<D, MRW, NT>(s, q_rows, sK + buf * BK * D, g, t);  // S = Q K^T
        } else {  // the warp's half of the head width, then the partner's partial sums added
            refattn_mma_abt<D, MRW, NT, D / 2>(s, q_rows, sK + buf * BK * D, g, t, half * D / 2);
            refattn_pair_send<MRW, NTW>(s, sXS, half, warp, lane);
            __syncthreads();  // the partner's partial sums of this warp's keys written
            refattn_pair_add<MRW, NTW>(s, sXS, half, warp, lane);
        }
        const bool bias = BIAS && c.has_bias;
        unsigned keep = 0;  // the Philox keep bits (drop mode 2)
        auto draw = [&] {
            if (DROPOUT && c.drop_mode == 2)
                keep = refattn_keep_bits_rows<MRW, NTW>(c, bh, row, j0, t);
        };
        // row block mr's scores (softcap, bias, visibility) in place; returns its tile max
        auto scores = [&](int mr) {
            // the bias line of row i (the last row for a row past Q, whose results are never
            // stored); a column past K (a tail tile's) reads column K - 1 and is masked below (a
            // tail tile is PARTIAL, its column bits 0), so no load is predicated
            const int i = row + 8 * mr < Q ? row + 8 * mr : Q - 1;
            const RefattnLine bias_i =
                BIAS ? refattn_line<false>(c.bias, bias_st, b, h, i) : RefattnLine{};
            double tile_max = none;
            REFATTN_UNROLL
            for (int nt = 0; nt < NTW; ++nt) {
                REFATTN_UNROLL
                for (int sb = 0; sb < 2; ++sb) {
                    const int e = nt * W + 2 * mr + sb, j = j0 + 8 * nt + 2 * t + sb;
                    double th;  // alpha, a softcap c tanh(dot alpha / c) (th: the tanh)
                    double v = refattn_score<SOFTCAP, true>(c, s[e], &th, softcap_tanh);
                    if (bias) v += bias_i.at(j < K ? j : K - 1);
                    const int bit = (nt * MRW + mr) * 2 + sb;
                    if (cls == REFATTN_PARTIAL && !((bits >> bit) & 1u)) v = none;
                    s[e] = v;  // visibility after the bias
                    tile_max = fmax(tile_max, v);
                }
            }
            tile_max = fmax(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
            return fmax(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
        };
        // the row blocks' new maxima and O's rescale factors exp(m - m_new), one exp a lane:
        // lane t of a quad computes row block t % MRW's, and the quad's lanes share them (each
        // lane computed all MRW before)
        auto rescale = [&](const double* tile_max, double* m_new, double* corr) {
            double mo = m[0], mn = fmax(m[0], tile_max[0]);
            REFATTN_UNROLL
            for (int mr = 0; mr < MRW; ++mr) {
                m_new[mr] = fmax(m[mr], tile_max[mr]);
                if (mr > 0 && t % MRW == mr) {
                    mo = m[mr];
                    mn = m_new[mr];
                }
            }
            const double e = mn == none ? 1.0 : (mo == none ? 0.0 : softmax_exp(mo - mn));
            REFATTN_UNROLL
            for (int mr = 0; mr < MRW; ++mr)
                corr[mr] = MRW == 1 ? e : __shfl_sync(0xffffffffu, e, (lane & ~3) | mr);
        };
        // row block mr's P~ Z in place, its running max and sum, and O rescaled
        auto softmax = [&](int mr, double m_new, double corr) {
            const int i = row + 8 * mr < Q ? row + 8 * mr : Q - 1;
            const RefattnLine z_i =
                DROPOUT ? refattn_line<false>(c.z, z_st, b, h, i) : RefattnLine{};
            // exp(-inf - m) = 0 for a masked score; a row with nothing visible yet subtracts 0
            // (FlashAttention-2's Check_inf), so no element tests for -inf
            const double m_use = m_new == none ? 0.0 : m_new;
            double part = 0.0;
            REFATTN_UNROLL
            for (int nt = 0; nt < NTW; ++nt) {
                REFATTN_UNROLL
                for (int sb = 0; sb < 2; ++sb) {
                    const int e = nt * W + 2 * mr + sb, j = j0 + 8 * nt + 2 * t + sb;
                    double p = softmax_exp(s[e] - m_use);
                    part += p;
                    if (DROPOUT && c.drop_mode != 0)  // Z: a Philox keep bit, or dense Z
                        p *= c.drop_mode == 2
                                 ? ((keep >> ((nt * MRW + mr) * 2 + sb)) & 1u ? c.keep : 0.0)
                                 : z_i.at(j < K ? j : K - 1);
                    s[e] = p;  // P~ Z
                }
            }
            part += __shfl_xor_sync(0xffffffffu, part, 1);
            part += __shfl_xor_sync(0xffffffffu, part, 2);
            l[mr] = l[mr] * corr + part;  // (with SPLIT, over the warp's keys only)
            m[mr] = m_new;
            REFATTN_UNROLL
            for (int dt = 0; dt < DTW; ++dt) {
                o[dt * W + 2 * mr] *= corr;
                o[dt * W + 2 * mr + 1] *= corr;
            }
        };
        double tile_max[MRW], m_new[MRW], corr[MRW];
        if constexpr (SPLIT == 1) {
            draw();
            REFATTN_UNROLL
            for (int mr = 0; mr < MRW; ++mr) tile_max[mr] = scores(mr);
        } else {  // the pair's maximum over the whole tile row
            double other[MRW];
            REFATTN_UNROLL
            for (int mr = 0; mr < MRW; ++mr) other[mr] = tile_max[mr] = scores(mr);
            // (after the partial sums' barrier: every S is computed, the K buffer is free)
            refattn_pair_rows<MRW>(other, warp, g);
            draw();  // (drawn before S, sm_90 spilled 4-8 bytes)
            REFATTN_UNROLL
            for (int mr = 0; mr < MRW; ++mr) tile_max[mr] = fmax(tile_max[mr], other[mr]);
        }
        rescale(tile_max, m_new, corr);
        REFATTN_UNROLL
        for (int mr = 0; mr < MRW; ++mr) softmax(mr, m_new[mr], corr[mr]);
        if constexpr (SPLIT == 1) {
            refattn_mma_pb<D, MRW, NTW>(o, s, sV + buf * BK * D, g, t);  // O += P~ Z V
        } else {
            // O's columns ow .. += P~ Z V over both halves, exchanged in the K buffer (free: every
            // S was computed before the partial sums' barrier)
            refattn_pair_pb<D, MRW, NTW, DTW>(o, s, sK + buf * BK * D, sV + buf * BK * D, ow,
                                              warp, lane, g, t);
        }
    };
    if constexpr (EXP_TABLE) refattn_exp_table_fill(sE, tid, 32 * REFATTN_WARPS);
    if (!AG && tid < 8) strides[tid] = ip[(tid < 4 ? P_BIAS_S0 : P_Z_S0 - 4) + tid];
    refattn_set_table_row<BQ, BK, false>(vis, b, h, i0, Q, K, tid);
    refattn_tile_loop(nkb, classify, load, compute, &done, &skipped);
    // the row sums over both halves of the keys (after the tile loop's closing barrier)
    if constexpr (SPLIT == 2) refattn_pair_sum<MRW>(l, warp, g);
    REFATTN_UNROLL
    for (int mr = 0; mr < MRW; ++mr) {
        const int i = row + 8 * mr;
        if (i >= Q) continue;
        const bool used = c.query_valid[b * c.Q + i] != 0;
        const double inv_l = 1.0 / l[mr];  // O / l as refattn_div: one division per row
        double* orow = out + (bh * c.Q + i) * D + ow;
        REFATTN_UNROLL
        for (int dt = 0; dt < DTW; ++dt) {
            orow[8 * dt + 2 * t] = used ? refattn_div(o[dt * W + 2 * mr], l[mr], inv_l) : 0.0;
            orow[8 * dt + 2 * t + 1] =
                used ? refattn_div(o[dt * W + 2 * mr + 1], l[mr], inv_l) : 0.0;
        }
        if (t == 0 && half == 0) {
            lse[bh * c.Q + i] = m[mr] + log(l[mr]);
            row_max[bh * c.Q + i] = m[mr];
        }
    }
    refattn_count_tiles(tiles, bh * gridDim.x + blockIdx.x, done, skipped);
}
