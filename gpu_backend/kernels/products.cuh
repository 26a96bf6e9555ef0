// refattn kernels: the warp-level products of a tile on the fp64 tensor cores (A rows, S = A B^T,
// O += P B, and the shared-memory accumulating form), from swizzled shared tiles.
#pragma once
#include "common.cuh"
#include "tile.cuh"
#include "tile_loop.cuh"  // REFATTN_WARPS

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

// C (8 MR x 8 NT per lane-set) += A . B^T over k = k0 .. k0 + KN - 1 (k ascending; k0 a
// multiple of 16, every column by default): A element (mr, k) from a_at (refattn_rows_a), B rows
// 8 nt + g of tile sb ("row" reads). UNROLL_K unrolls the k-steps, so every shared read is a
// register plus a compile-time offset (k0 is folded into the lane's column offsets: the swizzle
// moves only bits 2-3 of a column); without it nvcc keeps a loop whose reads each compute
// their address (two or three integer instructions), which the instances that spill when
// unrolled keep (attention.cu).
//
// swap (NT even; a warp pair's odd warp): the two halves of the n-tiles exchanged, n-tile nt of
// acc from B rows 8 ((nt + NT / 2) mod NT) + g, so that acc's first NT / 2 n-tiles hold the
// warp's own keys and its last NT / 2 its partner's (refattn_pair_send then needs no select)
template <int D, int MR, int NT, int KN = D, bool UNROLL_K = false, typename A, typename S2>
__device__ __forceinline__ void refattn_mma_abt(double* acc, A a_at, S2 sb, int g, int t,
                                                int k0 = 0, int swap = 0) {
    constexpr int HALF_ROWS = 8 * (NT / 2) * D;
    const int off_lo = swap ? HALF_ROWS : 0, off_hi = swap ? -HALF_ROWS : 0;
    int lo[4];  // the swizzled index of (row g, column k0 + 4 n + t)
    REFATTN_UNROLL
    for (int n = 0; n < 4; ++n) lo[n] = refattn_swz<D>(g, 4 * n + t) + k0;
    auto step = [&](int kk) {
        REFATTN_UNROLL
        for (int n = 0; n < 4; ++n) {
            double a[MR];
            REFATTN_UNROLL
            for (int mr = 0; mr < MR; ++mr) a[mr] = a_at(mr, lo[n] + kk, k0 + kk + 4 * n + t);
            REFATTN_UNROLL
            for (int nt = 0; nt < NT; ++nt)
                refattn_mma_rows<MR>(acc + nt * 2 * MR, a,
                                     sb[8 * nt * D + (nt < NT / 2 ? off_lo : off_hi) + lo[n] +
                                        kk]);
        }
    };
    if constexpr (UNROLL_K) {
        REFATTN_UNROLL
        for (int kk = 0; kk < KN; kk += 16) step(kk);
    } else {
        for (int kk = 0; kk < KN; kk += 16) step(kk);
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

// the A fragment of P (or dS) for the k-step (nt, s) of a P B product: element s of the lane's
// pair in n-tile nt of the accumulator layout, for each of its MR row blocks
template <int MR>
__device__ __forceinline__ void refattn_p_fragment(double* a, const double* p, int nt, int s) {
    REFATTN_UNROLL
    for (int mr = 0; mr < MR; ++mr) a[mr] = p[nt * 2 * MR + 2 * mr + s];
}

// O (8 MR x D per warp) += P . B: P the lane's accumulator tile (NT n-tiles) reused as the A
// fragment, B rows 8 nt + 2 t + s of tile sb ("col" reads); only the output n-tiles DT0 ..
// DT1 - 1 (8 columns each) when given, out holding those
template <int D, int MR, int NT, int DT0 = 0, int DT1 = D / 8, typename S2>
__device__ __forceinline__ void refattn_mma_pb(double* out, const double* p, S2 sb, int g,
                                               int t) {
    int lo[4];
    refattn_col_offsets<D>(lo, g, t);
    REFATTN_UNROLL
    for (int nt = 0; nt < NT; ++nt) {
        REFATTN_UNROLL
        for (int s = 0; s < 2; ++s) {
            double a[MR];
            refattn_p_fragment<MR>(a, p, nt, s);
            REFATTN_UNROLL
            for (int dt = DT0; dt < DT1; ++dt)  // B (8 nt + 2 t + s, 8 dt + g)
                refattn_mma_rows<MR>(out + (dt - DT0) * 2 * MR, a,
                                     sb[8 * nt * D + 16 * (dt >> 1) + lo[2 * s + (dt & 1)]]);
        }
    }
}

// a warp pair's exchange of row statistics (SPLIT = 2): every lane writes v for its MR row
// blocks into its warp's slots, and after a barrier v holds the partner warp's (warp ^ 1)
// values of the same rows. The caller has passed a barrier after which no warp reads the slots.
template <int MR>
__device__ __forceinline__ void refattn_pair_rows(double* v, int warp, int g) {
    __shared__ double slots[REFATTN_WARPS][8 * MR];
    REFATTN_UNROLL
    for (int mr = 0; mr < MR; ++mr) slots[warp][8 * mr + g] = v[mr];
    __syncthreads();
    REFATTN_UNROLL
    for (int mr = 0; mr < MR; ++mr) v[mr] = slots[warp ^ 1][8 * mr + g];
}

// v + the partner warp's v for each of the lane's MR row blocks (refattn_pair_rows: the caller
// has passed a barrier after which no warp reads the slots); both warps get the same sums
template <int MR>
__device__ __forceinline__ void refattn_pair_sum(double* v, int warp, int g) {
    double other[MR];
    REFATTN_UNROLL
    for (int mr = 0; mr < MR; ++mr) other[mr] = v[mr];
    refattn_pair_rows<MR>(other, warp, g);
    REFATTN_UNROLL
    for (int mr = 0; mr < MR; ++mr) v[mr] += other[mr];
}

// a warp pair's exchange region `ex` (SPLIT = 2, forward.cuh and backward.cuh): 4 warps' worth
// of NT n-tiles each, warp w's n-tile nt at (w NT + nt) 32 W, a lane's W = 2 MR values in A
// fragment order (refattn_a_order: 16-byte accesses). refattn_pair_put writes the warp's NT
// n-tiles of p there.
//
// A fragment order: the lane's element e = 2 mr + s of an n-tile (C layout) at s MR + mr, so
// the A fragment of k-step s (refattn_p_fragment: e = s, 2 + s at MR = 2) is two adjacent
// doubles, which one 16-byte read puts in the register quad an m16n8k4 reads. In C order
// they are not adjacent, and ptxas copied the pair into a fresh quad for every DMMA that used
// it (four moves a DMMA: 216 a tile in the dk/dv at D = 128)
template <int MR>
__device__ __forceinline__ constexpr int refattn_a_order(int e) {
    return (e % 2) * MR + e / 2;
}

template <int MR, int NT, bool A_ORDER = true, typename S1>
__device__ __forceinline__ void refattn_pair_put(S1 ex, const double* p, int warp, int lane) {
    constexpr int W = 2 * MR;
    REFATTN_UNROLL
    for (int nt = 0; nt < NT; ++nt) {
        REFATTN_UNROLL
        for (int e = 0; e < W; ++e)
            ex[((warp * NT + nt) * 32 + lane) * W + (A_ORDER ? refattn_a_order<MR>(e) : e)] =
                p[nt * W + e];
    }
}

// half k of the pair's exchanged n-tiles (warp (warp & ~1) + k's NT n-tiles) into p
template <int MR, int NT, bool A_ORDER = true, typename S1>
__device__ __forceinline__ void refattn_pair_get(double* p, S1 ex, int k, int warp, int lane) {
    constexpr int W = 2 * MR;
    const int w = (warp & ~1) + k;
    REFATTN_UNROLL
    for (int nt = 0; nt < NT; ++nt) {
        REFATTN_UNROLL
        for (int e = 0; e < W; ++e)
            p[nt * W + e] =
                ex[((w * NT + nt) * 32 + lane) * W + (A_ORDER ? refattn_a_order<MR>(e) : e)];
    }
}

// the sums over the head width of a pair that splits it (SPLIT = 2 in backward.cuh and
// forward.cuh): acc holds the warp's partial sums over its half of the head width for the whole
// tile (2 NT n-tiles: the even warp's queries or keys, then the odd one's; with SWAPPED, the
// warp's own first: refattn_mma_abt's swap). refattn_pair_send writes the partner's NT n-tiles
// to `ex` (refattn_pair_put's layout, the accumulators' order: they are added, not multiplied)
// and moves the warp's own to acc's first NT (by a select per value unless SWAPPED); after a
// barrier, refattn_pair_add adds the partner's partial sums of them (ex read back: half =
// warp & 1, the warp's half).
template <int MR, int NT, bool SWAPPED = false, typename S1>
__device__ __forceinline__ void refattn_pair_send(double* acc, S1 ex, int half, int warp,
                                                  int lane) {
    constexpr int W = 2 * MR;
    if constexpr (SWAPPED) {
        refattn_pair_put<MR, NT, false>(ex, acc + NT * W, warp, lane);
    } else {
        double part[NT * W];
        REFATTN_UNROLL
        for (int e = 0; e < NT * W; ++e) {
            part[e] = half ? acc[e] : acc[NT * W + e];
            acc[e] = half ? acc[NT * W + e] : acc[e];
        }
        refattn_pair_put<MR, NT, false>(ex, part, warp, lane);
    }
}

template <int MR, int NT, typename S1>
__device__ __forceinline__ void refattn_pair_add(double* acc, S1 ex, int half, int warp,
                                                 int lane) {
    constexpr int W = 2 * MR;
    double part[NT * W];
    refattn_pair_get<MR, NT, false>(part, ex, half ^ 1, warp, lane);
    REFATTN_UNROLL
    for (int e = 0; e < NT * W; ++e) acc[e] += part[e];
}

// both halves of the pair's exchanged n-tiles in ex, in order (the even warp's NT, then the
// odd one's), into p (2 NT n-tiles)
template <int MR, int NT, bool A_ORDER = true, typename S1>
__device__ __forceinline__ void refattn_pair_gather(double* p, S1 ex, int warp, int lane) {
    REFATTN_UNROLL
    for (int k = 0; k < 2; ++k)
        refattn_pair_get<MR, NT, A_ORDER>(p + k * NT * 2 * MR, ex, k, warp, lane);
}

// a warp pair's O += P . B over the whole tile (forward): each warp of the pair holds P for
// its half of the tile's 8 NT keys (NT n-tiles) and computes its DTW n-tiles of O (B's columns
// from `cols` on). Both halves go through `ex` (free until the tile loop's closing barrier: the
// caller has passed a barrier after which no warp reads it), then, after a barrier, the products
// run over the keys in ascending order; p is overwritten.
template <int D, int MR, int NT, int DTW, typename S1, typename S2>
__device__ __forceinline__ void refattn_pair_pb(double* out, double* p, S1 ex, S2 sb, int cols,
                                                int warp, int lane, int g, int t) {
    refattn_pair_put<MR, NT>(ex, p, warp, lane);
    __syncthreads();
    REFATTN_UNROLL
    for (int k = 0; k < 2; ++k) {
        refattn_pair_get<MR, NT>(p, ex, k, warp, lane);
        refattn_mma_pb<D, MR, NT, 0, DTW>(out, p, sb + k * 8 * NT * D + cols, g, t);
    }
}

// the same product into an accumulator kept in shared memory (the warp's own region, in fragment
// order: value e of lane l of n-tile dt at ((dt - DT0) 32 + l) 2 MR + e, 16-byte accesses), one
// n-tile of D at a time (n-tiles DT0 .. DT1 - 1, both even, the region holding those); for the
// dk/dv kernel, whose two accumulators would not fit the registers. The loop over the n-tiles
// stays rolled (code size, registers) and every index into the lane's column offsets lo[] is
// a compile-time constant, so lo stays in registers (lo[2 s + (dt & 1)] indexed at run time
// kept it in a 16-byte stack frame: one STL.128 per tile and two LDL per n-tile in the main
// loop). PAIRS: the loop steps over n-tile pairs with the pair unrolled (fewest instructions);
// otherwise it steps over single n-tiles and selects the pair member's offsets by the parity
// of dt (two SEL per n-tile: for the plain dk/dv at D = 64, where the unrolled pair spilled 16
// bytes on sm_90).
template <int D, int MR, int NT, int DT0 = 0, int DT1 = D / 8, bool PAIRS = true, typename S1,
          typename S2>
__device__ __forceinline__ void refattn_mma_pb_shared(S1 acc, const double* p, S2 sb, int lane,
                                                      int g, int t) {
    static_assert(DT0 % 2 == 0 && DT1 % 2 == 0, "n-tile pairs: 16 columns of D at a time");
    constexpr int W = 2 * MR, STEP = PAIRS ? 2 : 1;
    int lo[4];
    refattn_col_offsets<D>(lo, g, t);
    REFATTN_NO_UNROLL
    for (int dp = DT0; dp < DT1; dp += STEP) {
        REFATTN_UNROLL
        for (int q = 0; q < STEP; ++q) {
            const int dt = dp + q;  // columns 16 (dt / 2) + 8 (dt & 1) + g
            const bool odd = PAIRS ? q == 1 : (dt & 1) != 0;
            const int col[2] = {odd ? lo[1] : lo[0], odd ? lo[3] : lo[2]};  // s = 0, 1
            double c[W];
            REFATTN_UNROLL
            for (int e = 0; e < W; ++e) c[e] = acc[((dt - DT0) * 32 + lane) * W + e];
            REFATTN_UNROLL
            for (int nt = 0; nt < NT; ++nt) {
                REFATTN_UNROLL
                for (int s = 0; s < 2; ++s) {
                    double a[MR];
                    refattn_p_fragment<MR>(a, p, nt, s);
                    refattn_mma_rows<MR>(c, a, sb[8 * nt * D + 16 * (dt >> 1) + col[s]]);
                }
            }
            REFATTN_UNROLL
            for (int e = 0; e < W; ++e) acc[((dt - DT0) * 32 + lane) * W + e] = c[e];
        }
    }
}

// -- forward: online softmax, FlashAttention-2 style ----------------------------------------------
// grid (ceil(Q / BQ), B * Hq), 128 threads; q (B,Hq,Q,D), k, v (B,Hkv,K,D) zero-padded by the
// host to the instance width D; writes output (B,Hq,Q,D), lse and row_max (B,Hq,Q), and per
// block the number of key tiles computed and skipped.
