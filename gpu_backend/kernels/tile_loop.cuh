// Tiles of the attention kernels: their classes (SKIP / FULL / PARTIAL) from a relation's
// coordinates, a dense mask's class table or per element, and the double-buffered loop over a
// kernel's streamed tiles that the forward, dq and dk/dv kernels share (refattn_tile_loop).
//
// K / V (forward, dq) and Q / G_O (dk/dv) tiles are double-buffered: tile n + 1's cp.async
// copies are issued before tile n is computed. Tiles are classified before they are loaded:
// SKIP (no visible element: not loaded, not computed), FULL (every element of an in-range row
// visible: no per-element masking) or PARTIAL (masked by the lane's visibility bits).
#pragma once

#include "common.cuh"
#include "cp_async.cuh"
#include "visibility.cuh"

enum RefattnTileClass { REFATTN_SKIP = 0, REFATTN_FULL = 1, REFATTN_PARTIAL = 2 };

constexpr int REFATTN_WARPS = 4;
constexpr int REFATTN_THREADS = 32 * REFATTN_WARPS;

// this lane's visibility bits of one tile: bit (nt MR + mr) 2 + s for the element in row
// row + 8 mr, column col + 8 nt + s (rows are queries, or keys when ROWS_ARE_KEYS; col includes
// the lane's 2 t). A column out of range is invisible; a row out of range is "don't care" (it
// counts neither for *any nor against *all). With evaluate false every in-range edge is visible
// and nothing is loaded.
template <int MR, int NT, bool ROWS_ARE_KEYS>
__device__ __forceinline__ unsigned refattn_tile_bits(const RefattnVisibility& vis,
                                                      const long long* ip, bool evaluate,
                                                      long long b, long long h, int row, int col,
                                                      int Q, int K, int* any, int* all) {
    const int rows = ROWS_ARE_KEYS ? K : Q, cols = ROWS_ARE_KEYS ? Q : K;
    unsigned bits = 0;
    int a = 0, l = 1;
    REFATTN_NO_UNROLL  // one copy of the (large) visibility code
    for (int mr = 0; mr < MR; ++mr) {
        const int r = row + 8 * mr;
        const bool row_in = r < rows;
        REFATTN_NO_UNROLL
        for (int nt = 0; nt < NT; ++nt) {
            REFATTN_NO_UNROLL
            for (int s = 0; s < 2; ++s) {
                const int cc = col + 8 * nt + s;
                bool v = cc < cols;
                if (v && evaluate) {
                    v = row_in && refattn_visible(vis, ip, b, h, ROWS_ARE_KEYS ? cc : r,
                                                  ROWS_ARE_KEYS ? r : cc);
                }
                if (row_in) {
                    a |= v ? 1 : 0;
                    l &= v ? 1 : 0;
                }
                bits |= (v ? 1u : 0u) << ((nt * MR + mr) * 2 + s);
            }
        }
    }
    *any = a;
    *all = l;
    return bits;
}

// -- a relation's tile bounded from its coordinates ---------------------------------------------
// For a tile of queries [qa, qa + qn) and keys [ka, ka + kn) (both clipped to Q, K), the block
// reduces each leaf's coordinates over the tile (position and segment ranges of its queries and
// keys, whether all / any of its keys are valid: one load per query and per key instead of one
// predicate per element) and bounds the leaf's predicate: REFATTN_SKIP (no edge), REFATTN_FULL
// (every edge) or REFATTN_PARTIAL (either may hold). The postfix program combines the leaves in
// three-valued logic. Every thread of the block calls it (two barriers per leaf).
constexpr int REFATTN_REDUCED = 10;  // pmin pmax qsmin qsmax rmin rmax ksmin ksmax kv_all kv_any

__device__ __forceinline__ int refattn_imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ long long refattn_llmin(long long a, long long b) { return a < b ? a : b; }
__device__ __forceinline__ long long refattn_llmax(long long a, long long b) { return a > b ? a : b; }

__device__ __forceinline__ int refattn_leaf_bound(const RefattnVisibility& v, long long l,
                                                  long long rb, long long rh, int qa, int qn,
                                                  int ka, int kn, int tid) {
    __shared__ long long red[REFATTN_WARPS][REFATTN_REDUCED];
    const long long big = 0x7fffffffffffffffLL, small = -big - 1;
    const long long qrow = (l * v.rel_b + rb) * v.Q, krow = (l * v.rel_b + rb) * v.K;
    const bool segments = v.leaf[2 * l] != 0;
    long long x[REFATTN_REDUCED] = {big, small, big, small, big, small, big, small, 1, 0};
    if (tid < qn) {
        const long long p = v.q_pos[qrow + qa + tid];
        x[0] = x[1] = p;
        if (segments) x[2] = x[3] = v.q_seg[qrow + qa + tid];
    }
    if (tid < kn) {
        const long long r = v.k_pos[krow + ka + tid];
        x[4] = x[5] = r;
        if (segments) x[6] = x[7] = v.k_seg[krow + ka + tid];
        x[8] = x[9] = v.key_valid[krow + ka + tid] != 0 ? 1 : 0;
    }
    REFATTN_UNROLL
    for (int step = 1; step < 32; step <<= 1) {
        REFATTN_UNROLL
        for (int e = 0; e < REFATTN_REDUCED; ++e) {
            const long long o = __shfl_xor_sync(0xffffffffu, x[e], step);
            x[e] = e % 2 == 0 ? refattn_llmin(x[e], o) : refattn_llmax(x[e], o);
        }
    }
    if ((tid & 31) == 0)
        for (int e = 0; e < REFATTN_REDUCED; ++e) red[tid >> 5][e] = x[e];
    __syncthreads();
    for (int w = 0; w < REFATTN_WARPS; ++w)
        for (int e = 0; e < REFATTN_REDUCED; ++e)
            x[e] = e % 2 == 0 ? refattn_llmin(x[e], red[w][e])
                              : refattn_llmax(x[e], red[w][e]);
    __syncthreads();  // red free for the next leaf
    const long long pmin = x[0], pmax = x[1], rmin = x[4], rmax = x[5];
    bool all = x[8] != 0, none = x[9] == 0;  // key validity
    if (segments) {
        all = all && x[2] == x[3] && x[6] == x[7] && x[2] == x[6];
        none = none || x[3] < x[6] || x[7] < x[2];  // disjoint segment ranges
    }
    const long long topology = v.leaf[2 * l + 1];
    if (topology == 1) {  // r <= p
        all = all && rmax <= pmin;
        none = none || rmin > pmax;
    } else if (topology == 2) {  // (p < P and r < P) or (p >= P and r <= p)
        const long long P = v.prefix[(l * v.rel_b + rb) * v.rel_h + rh];
        all = all && (rmax < P || (pmin >= P && rmax <= pmin));
        none = none || (rmin >= P && (pmax < P || rmin > pmax));
    }
    const long long left = v.left[l * v.rel_h + rh], right = v.right[l * v.rel_h + rh];
    if (left >= 0) {  // p - r <= left
        all = all && pmax - rmin <= left;
        none = none || pmin - rmax > left;
    }
    if (right >= 0) {  // r - p <= right
        all = all && rmax - pmin <= right;
        none = none || rmin - pmax > right;
    }
    return none ? REFATTN_SKIP : all ? REFATTN_FULL : REFATTN_PARTIAL;
}

// the class of the relation over a tile (queries [qa, qa + qn), keys [ka, ka + kn), clipped)
__device__ __forceinline__ int refattn_tile_relation(const RefattnVisibility& v, long long b,
                                                     long long h, int qa, int qn, int ka, int kn,
                                                     int tid) {
    const long long rb = v.rel_b == 1 ? 0 : b, rh = v.rel_h == 1 ? 0 : h;
    unsigned long long stack = 0;  // 2 bits per entry: SKIP 0, FULL 1, PARTIAL 2
    for (long long t = 0; t < v.program_len; ++t) {
        const long long op = v.program[t];
        if (op >= 0) {
            stack = (stack << 2) |
                    static_cast<unsigned long long>(refattn_leaf_bound(v, op, rb, rh, qa, qn, ka,
                                                                       kn, tid));
        } else {
            const unsigned long long a = stack & 3ULL, c = (stack >> 2) & 3ULL;
            unsigned long long r;
            if (op == -1)  // AND
                r = (a == REFATTN_SKIP || c == REFATTN_SKIP) ? REFATTN_SKIP
                    : (a == REFATTN_FULL && c == REFATTN_FULL) ? REFATTN_FULL : REFATTN_PARTIAL;
            else  // OR
                r = (a == REFATTN_FULL || c == REFATTN_FULL) ? REFATTN_FULL
                    : (a == REFATTN_SKIP && c == REFATTN_SKIP) ? REFATTN_SKIP : REFATTN_PARTIAL;
            stack = ((stack >> 4) << 2) | r;
        }
    }
    int cls = static_cast<int>(stack & 3ULL);
    if (cls == REFATTN_SKIP && v.has_sanitized && ka == 0) cls = REFATTN_PARTIAL;  // key 0
    return cls;
}

// -- a dense mask's tile classes, read from a table ----------------------------------------------
// The host reduces the dense mask over each kernel's tiles (gpu_backend/launch.py
// dense_tile_classes): a (B, Hq, ceil(rows / BR), ceil(cols / BC)) uint8 table of the classes the
// block vote below would give (rows are queries, or keys when ROWS_ARE_KEYS; a column tail never
// FULL), computed over the mask's own batch and head extents and then expanded to (B, Hq). A
// block's rows are fixed, so it reads one row of the table, one byte per streamed tile (one
// broadcast load): SKIP and FULL are final, so only a PARTIAL tile reads mask elements. When rows
// were sanitised the host marks a SKIP tile holding key 0 PARTIAL (voted here: the temporary key
// 0 only adds visible elements, so a FULL tile stays FULL).
//
// The row's address lives in shared memory, written by thread 0 before the tile loop
// (refattn_set_table_row) and read at every lookup, so no register holds it across the loop: the
// forward and dq at D = 256 sit at 254-255 registers, and every register form of the lookup
// (strides, extents, 32-bit or blockIdx-based indices, a precomputed row) spilled 8 to 20 bytes
// there. The tile loop's barriers order the write before the reads and the reads of one head
// before the next head's write (dk/dv).
__device__ __forceinline__ const unsigned char*& refattn_table_row() {
    __shared__ const unsigned char* row;
    return row;
}

// the block's row of the class table (rows r0 .. r0 + BR - 1) into refattn_table_row, then a
// barrier; every thread of the block calls it (a no-op but the barrier without a dense mask)
template <int BR, int BC, bool ROWS_ARE_KEYS>
__device__ __forceinline__ void refattn_set_table_row(const RefattnVisibility& vis, long long b,
                                                      long long h, int r0, int Q, int K,
                                                      int tid) {
    if (tid == 0 && vis.mode == 1) {
        const int rows = ROWS_ARE_KEYS ? K : Q, cols = ROWS_ARE_KEYS ? Q : K;
        const long long nr = (rows + BR - 1) / BR, nc = (cols + BC - 1) / BC;
        refattn_table_row() = vis.tiles + ((b * vis.Hq + h) * nr + r0 / BR) * nc;
    }
    __syncthreads();
}

// the class of a tile from every lane's any / all (a block-wide vote when visibility is
// evaluated; otherwise only a column tail makes a tile PARTIAL)
__device__ __forceinline__ int refattn_tile_class(bool evaluate, int any, int all,
                                                  bool column_tail) {
    if (!evaluate) return column_tail ? REFATTN_PARTIAL : REFATTN_FULL;
    const int some = __syncthreads_or(any);
    const int every = __syncthreads_and(all);
    return !some ? REFATTN_SKIP : every ? REFATTN_FULL : REFATTN_PARTIAL;
}

// the class of a streamed tile, and the lane's visibility bits when it is PARTIAL: the block's
// BR rows r0 .. r0 + BR - 1 (queries, or keys when ROWS_ARE_KEYS) against the tile's BC columns
// c0 .. c0 + BC - 1; the lane's MR row blocks start at `row`, its NT n-tiles at column
// c0 + cw + 2 t (cw: the warp's first column of the tile, 0 unless a warp pair splits the
// tile's columns, forward.cuh). With a relation
// the tile is first bounded from its coordinates (SKIP and FULL are final, but a column tail is
// never FULL); with a dense mask its class is read from the host's table (the block's row set
// by refattn_set_table_row; SKIP and FULL final); otherwise, or when that class is PARTIAL, it
// is evaluated per element and voted. Every thread of the block calls it.
template <int MR, int NT, bool ROWS_ARE_KEYS, int BR = 8 * MR * REFATTN_WARPS, int BC = 8 * NT>
__device__ __forceinline__ int refattn_classify(const RefattnVisibility& vis, const long long* ip,
                                                bool evaluate, long long b, long long h, int r0,
                                                int c0, int row, int t, int Q, int K, int tid,
                                                unsigned* bits, int cw = 0) {
    const int cols = ROWS_ARE_KEYS ? Q : K;
    const bool tail = c0 + BC > cols;
    if (!evaluate && !tail) return REFATTN_FULL;  // no mask, every column in range
    if (vis.mode != 0) {
        int cls;
        if (vis.mode == 2) {  // bounded from the relation's coordinates
            const int qa = ROWS_ARE_KEYS ? c0 : r0, ka = ROWS_ARE_KEYS ? r0 : c0;
            const int qn = refattn_imin(ROWS_ARE_KEYS ? BC : BR, Q - qa);
            const int kn = refattn_imin(ROWS_ARE_KEYS ? BR : BC, K - ka);
            cls = refattn_tile_relation(vis, b, h, qa, qn, ka, kn, tid);
        } else {  // a dense mask's class table (a column tail is never FULL in it)
            cls = refattn_table_row()[c0 / BC];
        }
        if (cls == REFATTN_FULL && tail) cls = REFATTN_PARTIAL;
        if (cls != REFATTN_PARTIAL) return cls;
    }
    int any, all;
    *bits = refattn_tile_bits<MR, NT, ROWS_ARE_KEYS>(vis, ip, evaluate, b, h, row,
                                                     c0 + cw + 2 * t, Q, K, &any, &all);
    return refattn_tile_class(evaluate, any, all, tail);
}

// the loop over n streamed tiles, double-buffered: classify(n, &bits) -> class (every thread),
// load(n) issues tile n's cp.async copies into buffer n & 1 (not called for a SKIP tile), and
// compute(n, class, bits) runs on a landed tile that is not SKIP. Tile n + 1 is classified and
// its copies issued before tile n is computed; one commit group per step, so wait_group 1
// retires tile n (and the copies issued before the loop with it). Counts the tiles computed
// and skipped.
template <typename Classify, typename Load, typename Compute>
__device__ __forceinline__ void refattn_tile_loop(int n, Classify classify, Load load,
                                                  Compute compute, long long* done,
                                                  long long* skipped) {
    unsigned bits = 0;
    int cls = classify(0, &bits);
    if (cls != REFATTN_SKIP) load(0);
    refattn_cp_async_commit();
    for (int step = 0; step < n; ++step) {
        unsigned bits_next = 0;
        int cls_next = REFATTN_SKIP;
        if (step + 1 < n) {
            cls_next = classify(step + 1, &bits_next);
            if (cls_next != REFATTN_SKIP) load(step + 1);
        }
        refattn_cp_async_commit();
        refattn_cp_async_wait<1>();  // tile `step` landed
        __syncthreads();
        if (cls == REFATTN_SKIP) {
            ++*skipped;
        } else {
            ++*done;
            compute(step, cls, bits);
        }
        __syncthreads();  // buffer step & 1 free for tile step + 2
        cls = cls_next;
        bits = bits_next;
    }
}

// block `block`'s tile counts into the (blocks, 2) int64 table: computed, skipped
__device__ __forceinline__ void refattn_count_tiles(long long* tiles, long long block,
                                                    long long done, long long skipped) {
    if (threadIdx.x == 0) {
        tiles[2 * block] = done;
        tiles[2 * block + 1] = skipped;
    }
}
