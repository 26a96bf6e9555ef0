// refattn kernels: the forward (online softmax over key tiles, FlashAttention-2 structure).
#pragma once
#include "call.cuh"
#include "products.cuh"
#include "tile_loop.cuh"
#include "visibility.cuh"

template <int D, int MR, int BK, unsigned F = REFATTN_F_ALL>
__device__ void refattn_forward(const unsigned long long* x, const long long* ip,
                                const double* rp) {
    constexpr int BQ = 8 * MR * REFATTN_WARPS, NT = BK / 8, DT = D / 8, W = 2 * MR;
    constexpr bool SOFTCAP = (F & REFATTN_F_SOFTCAP) != 0, BIAS = (F & REFATTN_F_BIAS) != 0,
                   DROPOUT = (F & REFATTN_F_DROPOUT) != 0;
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
        const unsigned keep = DROPOUT && c.drop_mode == 2
                                  ? refattn_keep_bits_rows<MR, NT>(c, bh, row, j0, t)
                                  : 0u;
        const bool bias = BIAS && c.has_bias;
        REFATTN_UNROLL
        for (int mr = 0; mr < MR; ++mr) {
            // the bias and Z lines of row i (the last row for a row past Q, whose results are
            // never stored); a column past K (a tail tile's) reads column K - 1 and is masked
            // below (a tail tile is PARTIAL, its column bits 0), so no load is predicated
            const int i = row + 8 * mr < Q ? row + 8 * mr : Q - 1;
            const RefattnLine bias_i =
                BIAS ? refattn_line<false>(c.bias, ip, P_BIAS_S0, b, h, i) : RefattnLine{};
            const RefattnLine z_i =
                DROPOUT ? refattn_line<false>(c.z, ip, P_Z_S0, b, h, i) : RefattnLine{};
            double tile_max = none;
            REFATTN_UNROLL
            for (int nt = 0; nt < NT; ++nt) {
                REFATTN_UNROLL
                for (int sb = 0; sb < 2; ++sb) {
                    const int e = nt * W + 2 * mr + sb, j = j0 + 8 * nt + 2 * t + sb;
                    double capped;  // alpha, a softcap c tanh(v / c); then the bias
                    double v = refattn_score<SOFTCAP>(c, s[e], &capped);
                    if (bias) v += bias_i.at(j < K ? j : K - 1);
                    const int bit = (nt * MR + mr) * 2 + sb;
                    if (cls == REFATTN_PARTIAL && !((bits >> bit) & 1u)) v = none;
                    s[e] = v;  // visibility after the bias
                    tile_max = fmax(tile_max, v);
                }
            }
            tile_max = fmax(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
            tile_max = fmax(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
            const double m_new = fmax(m[mr], tile_max);
            const double corr =
                m_new == none ? 1.0 : (m[mr] == none ? 0.0 : refattn_exp(m[mr] - m_new));
            // exp(-inf - m) = 0 for a masked score; a row with nothing visible yet subtracts 0
            // (FlashAttention-2's Check_inf), so no element tests for -inf
            const double m_use = m_new == none ? 0.0 : m_new;
            double part = 0.0;
            REFATTN_UNROLL
            for (int nt = 0; nt < NT; ++nt) {
                REFATTN_UNROLL
                for (int sb = 0; sb < 2; ++sb) {
                    const int e = nt * W + 2 * mr + sb, j = j0 + 8 * nt + 2 * t + sb;
                    double p = refattn_exp(s[e] - m_use);
                    part += p;
                    if (DROPOUT && c.drop_mode != 0)  // Z: a Philox keep bit, or dense Z
                        p *= c.drop_mode == 2
                                 ? ((keep >> ((nt * MR + mr) * 2 + sb)) & 1u ? c.keep : 0.0)
                                 : z_i.at(j < K ? j : K - 1);
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
    refattn_set_table_row<BQ, BK, false>(vis, b, h, i0, Q, K, tid);
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
