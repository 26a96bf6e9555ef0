// refattn float64 attention kernels: tiled online-softmax forward, recomputing backward, and a
// trace mode for small problems. No kernel writes a [Q, K] array except the trace kernels (and
// the per-element bias gradient when the bias itself is per element). No floating-point
// atomics: every output element has one owner, so results are bit-identical run to run.
//
// Tiles are T x T (T = 32 or 16), 4 T threads per block. In the forward and dq kernels a thread
// owns one query row r = t / 4 of the tile and T / 4 of its keys (column group t % 4); the four
// threads of a row share its running max and sum through warp shuffles. In the dk/dv kernel a
// thread owns one key of the tile and T / 4 query rows. Dynamic shared memory holds the tiles
// and the accumulators; the host sizes it (gpu_backend/launch.py, shared_bytes()).
//
// Arguments of every kernel: x, the table of device addresses (RefattnPtr slots); ip, int64
// parameters (RefattnInt); rp, double parameters (RefattnReal). See common.cuh.
#include "common.cuh"
#include "philox.cuh"
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
    return c;
}

// scores = post * dot, then c * tanh(scores / c) with a softcap; *capped gets the softcap's
// input (the scaled score before the cap)
__device__ __forceinline__ double refattn_score(const RefattnCall& c, double dot,
                                                double* capped_input) {
    double s = c.post == 1.0 ? dot : c.post * dot;  // alpha applied once, after the product
    *capped_input = s;
    if (c.has_softcap) s = c.softcap * tanh(s / c.softcap);
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
    double t = s / c.softcap;
    return 1.0 - t * t;
}

// rows row0 .. row0 + T - 1 of matrix `slice` (rows x D, row-major) of the array a into dst
// (T x D), zeros past its last row; the block's 4 T threads share the elements. Dst is a
// pointer into shared memory (a bounds-checked one in the emulator's debug builds)
template <int T, typename Dst>
__device__ __forceinline__ void refattn_load_tile(Dst dst, const double* a, long long slice,
                                                  long long row0, long long rows, long long D,
                                                  int t) {
    for (long long e = t; e < T * D; e += 4 * T) {
        const long long row = row0 + e / D;
        dst[e] = row < rows ? a[(slice * rows + row) * D + e % D] : 0.0;
    }
}

// which of this thread's T / 4 edges (i + q4 DI, j + q4 DJ) are visible (in range and legal);
// returns whether any is
template <int T, int DI, int DJ>
__device__ __forceinline__ bool refattn_edges_seen(bool* seen, const RefattnCall& c,
                                                   const RefattnVisibility& vis,
                                                   const long long* ip, long long b, long long h,
                                                   long long i, long long j) {
    bool any = false;
    for (int q4 = 0; q4 < T / 4; ++q4) {
        const long long iq = i + q4 * DI, jq = j + q4 * DJ;
        seen[q4] = iq < c.Q && jq < c.K && refattn_visible(vis, ip, b, h, iq, jq);
        any = any || seen[q4];
    }
    return any;
}

// -- forward: tiled online softmax ------------------------------------------------------------
// grid (ceil(Q / T), B * Hq); writes output (B,Hq,Q,Dv), lse and row_max (B,Hq,Q), and per
// block the number of key tiles computed and skipped (fully invisible).
template <int T>
__device__ void refattn_forward(const unsigned long long* x, const long long* ip,
                                const double* rp) {
    REFATTN_DYNAMIC_SHARED(double, smem);
    const RefattnCall c = refattn_call(x, ip, rp);
    const RefattnVisibility vis = refattn_visibility(x, ip);
    double* out = reinterpret_cast<double*>(x[X_OUT]);
    double* lse = reinterpret_cast<double*>(x[X_LSE]);
    double* row_max = reinterpret_cast<double*>(x[X_ROW_MAX]);
    long long* tiles = reinterpret_cast<long long*>(x[X_TILES]);
    const int t = threadIdx.x, r = t >> 2, cg = t & 3;
    const long long bh = blockIdx.y, b = bh / c.Hq, h = bh % c.Hq, hk = c.head_map[h];
    const long long i0 = static_cast<long long>(blockIdx.x) * T, i = i0 + r;
    const long long Dk = c.Dk, Dv = c.Dv;
    auto sQ = smem;              // T x Dk
    auto sK = sQ + T * Dk;       // T x Dk
    auto sV = sK + T * Dk;       // T x Dv
    auto sP = sV + T * Dv;       // T x T: P~ Z of the tile
    auto sO = sP + T * T;        // T x Dv: the output accumulator

    refattn_load_tile<T>(sQ, c.q, bh, i0, c.Q, Dk, t);
    for (long long d = cg; d < Dv; d += 4) sO[r * Dv + d] = 0.0;
    // the running max and sum of the row; the sink logit joins every row's support
    double m = c.has_sink ? c.sink[h] : refattn_neg_inf();
    double l = c.has_sink ? 1.0 : 0.0;
    long long done = 0, skipped = 0;
    const long long nkb = (c.K + T - 1) / T;
    for (long long kb = 0; kb < nkb; ++kb) {
        const long long j0 = kb * T;
        refattn_load_tile<T>(sK, c.k, b * c.Hkv + hk, j0, c.K, Dk, t);
        refattn_load_tile<T>(sV, c.v, b * c.Hkv + hk, j0, c.K, Dv, t);
        bool seen[T / 4];
        const bool any = refattn_edges_seen<T, 0, 1>(seen, c, vis, ip, b, h, i, j0 + cg * (T / 4));
        if (!__syncthreads_or(any)) {  // a fully invisible tile: no arithmetic at all
            ++skipped;
            continue;
        }
        ++done;
        double s[T / 4];
        double tile_max = refattn_neg_inf();
        for (int q4 = 0; q4 < T / 4; ++q4) {
            const int jj = cg * (T / 4) + q4;
            double dot = 0.0;
            for (long long d = 0; d < Dk; ++d) dot += sQ[r * Dk + d] * sK[jj * Dk + d];
            double capped;
            double biased = refattn_biased(c, ip, refattn_score(c, dot, &capped), b, h, i,
                                           j0 + jj);
            s[q4] = seen[q4] ? biased : refattn_neg_inf();  // visibility after the bias
            tile_max = fmax(tile_max, s[q4]);
        }
        tile_max = fmax(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        tile_max = fmax(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
        const double m_new = fmax(m, tile_max);
        const double none = refattn_neg_inf();
        const double corr = m_new == none ? 1.0 : (m == none ? 0.0 : exp(m - m_new));
        double part = 0.0;
        for (int q4 = 0; q4 < T / 4; ++q4) {
            const int jj = cg * (T / 4) + q4;
            double p = s[q4] == none ? 0.0 : exp(s[q4] - m_new);
            part += p;
            if (p != 0.0 && c.drop_mode != 0) p *= refattn_multiplier(c, ip, b, h, i, j0 + jj);
            sP[r * T + jj] = p;
        }
        part += __shfl_xor_sync(0xffffffffu, part, 1);
        part += __shfl_xor_sync(0xffffffffu, part, 2);
        l = l * corr + part;
        m = m_new;
        __syncthreads();  // sP complete
        for (long long d = cg; d < Dv; d += 4) {
            double acc = sO[r * Dv + d] * corr;
            for (int jj = 0; jj < T; ++jj) acc += sP[r * T + jj] * sV[jj * Dv + d];
            sO[r * Dv + d] = acc;
        }
        __syncthreads();  // sK, sV, sP free for the next tile
    }
    if (i < c.Q) {
        const bool used = c.query_valid[b * c.Q + i] != 0;
        for (long long d = cg; d < Dv; d += 4)
            out[(bh * c.Q + i) * Dv + d] = used ? sO[r * Dv + d] / l : 0.0;
        if (cg == 0) {
            lse[bh * c.Q + i] = m + log(l);
            row_max[bh * c.Q + i] = m;
        }
    }
    if (t == 0) {
        const long long block = bh * gridDim.x + blockIdx.x;
        tiles[2 * block] = done;
        tiles[2 * block + 1] = skipped;
    }
}

// -- dq, and the check contraction row_dot = sum_j P G_P ----------------------------------------
// grid (ceil(Q / T), B * Hq). Mode 0 (P_DQ_MODE): dq (B,Hq,Q,Dk) = fq * sum_j dS k, with
// dS = P (G_P - D) times the softcap slope, the bias gradient of modes 1 (per element) and 3
// (summed over keys), and row_dot as a by-product. Mode 1: row_dot (B,Hq,Q) = sum_j P G_P
// only (a trace's D, needed before any dS).
template <int T>
__device__ void refattn_dq(const unsigned long long* x, const long long* ip, const double* rp) {
    REFATTN_DYNAMIC_SHARED(double, smem);
    const RefattnCall c = refattn_call(x, ip, rp);
    const RefattnVisibility vis = refattn_visibility(x, ip);
    const bool check_mode = ip[P_DQ_MODE] == 1;
    const long long gbias_mode = ip[P_GBIAS_MODE];
    double* dq = reinterpret_cast<double*>(x[X_DQ]);
    double* gbias = reinterpret_cast<double*>(x[X_GBIAS]);
    double* row_dot = reinterpret_cast<double*>(x[X_ROW_DOT]);
    long long* tiles = reinterpret_cast<long long*>(x[X_TILES]);
    const int t = threadIdx.x, r = t >> 2, cg = t & 3;
    const long long bh = blockIdx.y, b = bh / c.Hq, h = bh % c.Hq, hk = c.head_map[h];
    const long long i0 = static_cast<long long>(blockIdx.x) * T, i = i0 + r;
    const long long Dk = c.Dk, Dv = c.Dv;
    auto sQ = smem;              // T x Dk
    auto sG = sQ + T * Dk;       // T x Dv: G_O
    auto sK = sG + T * Dv;       // T x Dk
    auto sV = sK + T * Dk;       // T x Dv
    auto sS = sV + T * Dv;       // T x T: dS of the tile
    auto sDQ = sS + T * T;       // T x Dk: the dq accumulator

    refattn_load_tile<T>(sQ, c.q, bh, i0, c.Q, Dk, t);
    refattn_load_tile<T>(sG, c.g_o, bh, i0, c.Q, Dv, t);
    for (long long d = cg; d < Dk; d += 4) sDQ[r * Dk + d] = 0.0;
    const double lse_i = i < c.Q ? c.lse[bh * c.Q + i] : 0.0;
    const double d_i = (i < c.Q && !check_mode) ? c.dvec[bh * c.Q + i] : 0.0;
    double acc_pg = 0.0;  // row_dot = sum_j P G_P
    double acc_gb = 0.0;  // the bias gradient summed over keys (bias mode 3)
    long long done = 0, skipped = 0;
    const long long nkb = (c.K + T - 1) / T;
    for (long long kb = 0; kb < nkb; ++kb) {
        const long long j0 = kb * T;
        refattn_load_tile<T>(sK, c.k, b * c.Hkv + hk, j0, c.K, Dk, t);
        refattn_load_tile<T>(sV, c.v, b * c.Hkv + hk, j0, c.K, Dv, t);
        bool seen[T / 4];
        const bool any = refattn_edges_seen<T, 0, 1>(seen, c, vis, ip, b, h, i, j0 + cg * (T / 4));
        if (!__syncthreads_or(any)) {
            ++skipped;
            continue;
        }
        ++done;
        for (int q4 = 0; q4 < T / 4; ++q4) {
            const int jj = cg * (T / 4) + q4;
            const long long j = j0 + jj;
            double ds = 0.0;
            if (seen[q4]) {
                double dot = 0.0;
                for (long long d = 0; d < Dk; ++d) dot += sQ[r * Dk + d] * sK[jj * Dk + d];
                double capped;
                const double sc = refattn_score(c, dot, &capped);
                const double p = exp(refattn_biased(c, ip, sc, b, h, i, j) - lse_i);
                double gp = 0.0;  // G_Pdrop = G_O . v_j, then G_P = G_Pdrop Z
                for (long long d = 0; d < Dv; ++d) gp += sG[r * Dv + d] * sV[jj * Dv + d];
                if (c.drop_mode != 0) gp *= refattn_multiplier(c, ip, b, h, i, j);
                acc_pg += p * gp;
                if (!check_mode) {
                    const double g_s = p * (gp - d_i);  // grad_scores
                    if (gbias_mode == 1) gbias[(bh * c.Q + i) * c.K + j] = g_s;
                    if (gbias_mode == 3) acc_gb += g_s;
                    ds = g_s * refattn_cap_slope(c, sc);
                }
            }  // (the host zero-fills a per-element bias gradient: invisible edges stay 0)
            sS[r * T + jj] = ds;
        }
        if (!check_mode) {
            __syncthreads();  // sS complete
            for (long long d = cg; d < Dk; d += 4) {
                double acc = sDQ[r * Dk + d];
                for (int jj = 0; jj < T; ++jj) acc += sS[r * T + jj] * sK[jj * Dk + d];
                sDQ[r * Dk + d] = acc;
            }
        }
        __syncthreads();  // tiles free for the next key block
    }
    acc_pg += __shfl_xor_sync(0xffffffffu, acc_pg, 1);
    acc_pg += __shfl_xor_sync(0xffffffffu, acc_pg, 2);
    acc_gb += __shfl_xor_sync(0xffffffffu, acc_gb, 1);
    acc_gb += __shfl_xor_sync(0xffffffffu, acc_gb, 2);
    if (i < c.Q) {
        if (cg == 0) row_dot[bh * c.Q + i] = acc_pg;
        if (!check_mode) {
            for (long long d = cg; d < Dk; d += 4)
                dq[(bh * c.Q + i) * Dk + d] = rp[R_FQ] * sDQ[r * Dk + d];
            if (gbias_mode == 3 && cg == 0) gbias[bh * c.Q + i] = acc_gb;
        }
    }
    if (t == 0) {
        const long long block = bh * gridDim.x + blockIdx.x;
        tiles[2 * block] = done;
        tiles[2 * block + 1] = skipped;
    }
}

// -- dk, dv: one block per key tile of one kv head, looping over its query heads in order -----
// grid (ceil(K / T), B * Hkv); dk (B,Hkv,K,Dk) = fk * sum_{h ~ g} sum_i dS q,
// dv (B,Hkv,K,Dv) = sum_{h ~ g} sum_i (P Z) G_O; the bias gradient of mode 2 (summed over
// queries), per query head.
template <int T>
__device__ void refattn_dkdv(const unsigned long long* x, const long long* ip,
                             const double* rp) {
    REFATTN_DYNAMIC_SHARED(double, smem);
    const RefattnCall c = refattn_call(x, ip, rp);
    const RefattnVisibility vis = refattn_visibility(x, ip);
    const long long gbias_mode = ip[P_GBIAS_MODE];
    double* dk = reinterpret_cast<double*>(x[X_DK]);
    double* dv = reinterpret_cast<double*>(x[X_DV]);
    double* gbias = reinterpret_cast<double*>(x[X_GBIAS]);
    long long* tiles = reinterpret_cast<long long*>(x[X_TILES]);
    const int t = threadIdx.x, jj = t >> 2, qg = t & 3;
    const long long bg = blockIdx.y, b = bg / c.Hkv, g = bg % c.Hkv;
    const long long j0 = static_cast<long long>(blockIdx.x) * T, j = j0 + jj;
    const long long Dk = c.Dk, Dv = c.Dv;
    auto sK = smem;              // T x Dk
    auto sV = sK + T * Dk;       // T x Dv
    auto sQ = sV + T * Dv;       // T x Dk
    auto sG = sQ + T * Dk;       // T x Dv: G_O
    auto sPZ = sG + T * Dv;      // T x T: P Z, [query][key]
    auto sS = sPZ + T * T;       // T x T: dS, [query][key]
    auto sDK = sS + T * T;       // T x Dk
    auto sDV = sDK + T * Dk;     // T x Dv
    auto sL = sDV + T * Dv;      // T: lse of the query tile
    auto sD = sL + T;            // T: D of the query tile

    refattn_load_tile<T>(sK, c.k, b * c.Hkv + g, j0, c.K, Dk, t);
    refattn_load_tile<T>(sV, c.v, b * c.Hkv + g, j0, c.K, Dv, t);
    for (long long d = qg; d < Dk; d += 4) sDK[jj * Dk + d] = 0.0;
    for (long long d = qg; d < Dv; d += 4) sDV[jj * Dv + d] = 0.0;
    long long done = 0, skipped = 0;
    const long long nqb = (c.Q + T - 1) / T;
    for (long long h = 0; h < c.Hq; ++h) {  // the query heads of kv head g, in order
        if (c.head_map[h] != g) continue;
        const long long bh = b * c.Hq + h;
        double gb = 0.0;  // bias gradient of (b, h, j) summed over queries (mode 2)
        for (long long qb = 0; qb < nqb; ++qb) {
            const long long i0 = qb * T;
            __syncthreads();  // the previous tile's readers are done
            refattn_load_tile<T>(sQ, c.q, bh, i0, c.Q, Dk, t);
            refattn_load_tile<T>(sG, c.g_o, bh, i0, c.Q, Dv, t);
            for (long long e = t; e < T; e += 4 * T) {
                long long row = i0 + e;
                sL[e] = row < c.Q ? c.lse[bh * c.Q + row] : 0.0;
                sD[e] = row < c.Q ? c.dvec[bh * c.Q + row] : 0.0;
            }
            bool seen[T / 4];
            const bool any =
                refattn_edges_seen<T, 1, 0>(seen, c, vis, ip, b, h, i0 + qg * (T / 4), j);
            if (!__syncthreads_or(any)) {
                ++skipped;
                continue;
            }
            ++done;
            for (int q4 = 0; q4 < T / 4; ++q4) {
                const int ii = qg * (T / 4) + q4;
                const long long i = i0 + ii;
                double pz = 0.0, ds = 0.0;
                if (seen[q4]) {
                    double dot = 0.0;
                    for (long long d = 0; d < Dk; ++d) dot += sQ[ii * Dk + d] * sK[jj * Dk + d];
                    double capped;
                    const double sc = refattn_score(c, dot, &capped);
                    const double p = exp(refattn_biased(c, ip, sc, b, h, i, j) - sL[ii]);
                    const double z = c.drop_mode != 0 ? refattn_multiplier(c, ip, b, h, i, j)
                                                      : 1.0;
                    double gp = 0.0;
                    for (long long d = 0; d < Dv; ++d) gp += sG[ii * Dv + d] * sV[jj * Dv + d];
                    gp *= z;
                    const double g_s = p * (gp - sD[ii]);
                    gb += g_s;
                    pz = p * z;
                    ds = g_s * refattn_cap_slope(c, sc);
                }
                sPZ[ii * T + jj] = pz;
                sS[ii * T + jj] = ds;
            }
            __syncthreads();  // sPZ, sS complete
            for (long long d = qg; d < Dv; d += 4) {
                double acc = sDV[jj * Dv + d];
                for (int ii = 0; ii < T; ++ii) acc += sPZ[ii * T + jj] * sG[ii * Dv + d];
                sDV[jj * Dv + d] = acc;
            }
            for (long long d = qg; d < Dk; d += 4) {
                double acc = sDK[jj * Dk + d];
                for (int ii = 0; ii < T; ++ii) acc += sS[ii * T + jj] * sQ[ii * Dk + d];
                sDK[jj * Dk + d] = acc;
            }
        }
        gb += __shfl_xor_sync(0xffffffffu, gb, 1);
        gb += __shfl_xor_sync(0xffffffffu, gb, 2);
        if (gbias_mode == 2 && qg == 0 && j < c.K) gbias[bh * c.K + j] = gb;
    }
    if (j < c.K) {
        for (long long d = qg; d < Dk; d += 4)
            dk[((b * c.Hkv + g) * c.K + j) * Dk + d] = rp[R_FK] * sDK[jj * Dk + d];
        for (long long d = qg; d < Dv; d += 4)
            dv[((b * c.Hkv + g) * c.K + j) * Dv + d] = sDV[jj * Dv + d];
    }
    if (t == 0) {
        const long long block = bg * gridDim.x + blockIdx.x;
        tiles[2 * block] = done;
        tiles[2 * block + 1] = skipped;
    }
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
#define REFATTN_ARGS const unsigned long long *x, const long long *ip, const double *rp
extern "C" __global__ void attention_forward_t32(REFATTN_ARGS) { refattn_forward<32>(x, ip, rp); }
extern "C" __global__ void attention_forward_t16(REFATTN_ARGS) { refattn_forward<16>(x, ip, rp); }
extern "C" __global__ void attention_dq_t32(REFATTN_ARGS) { refattn_dq<32>(x, ip, rp); }
extern "C" __global__ void attention_dq_t16(REFATTN_ARGS) { refattn_dq<16>(x, ip, rp); }
extern "C" __global__ void attention_dkdv_t32(REFATTN_ARGS) { refattn_dkdv<32>(x, ip, rp); }
extern "C" __global__ void attention_dkdv_t16(REFATTN_ARGS) { refattn_dkdv<16>(x, ip, rp); }
extern "C" __global__ void attention_row_dot_output(REFATTN_ARGS) {
    refattn_row_dot_output(x, ip, rp);
}
extern "C" __global__ void attention_trace_forward(REFATTN_ARGS) {
    refattn_trace_forward(x, ip, rp);
}
extern "C" __global__ void attention_trace_backward(REFATTN_ARGS) {
    refattn_trace_backward(x, ip, rp);
}

REFATTN_EXPORT(attention_forward_t32)
REFATTN_EXPORT(attention_forward_t16)
REFATTN_EXPORT(attention_dq_t32)
REFATTN_EXPORT(attention_dq_t16)
REFATTN_EXPORT(attention_dkdv_t32)
REFATTN_EXPORT(attention_dkdv_t16)
REFATTN_EXPORT(attention_row_dot_output)
REFATTN_EXPORT(attention_trace_forward)
REFATTN_EXPORT(attention_trace_backward)
