// Visibility evaluated in the kernel: every edge, a dense bool tensor, or a relation's
// coordinates, plus the temporary key 0 of a row sanitised under the
// sanitize_then_zero_invalid_query policy.
//
// A relation arrives as its leaves (refattn.masks.relation.KernelArguments of each coordinate
// relation, stacked on a leading leaf axis l) and a postfix program over them
// (relation.program(): a leaf index pushes that leaf's truth value, -1 is AND, -2 is OR), so a
// union or intersection of relations (a | b, a & b) is evaluated here without a dense matrix.
// With p = q_pos[l, b, i] and r = k_pos[l, b, j] leaf l's edge exists iff
//   key_valid[l, b, j]
//   and (no segments or q_segment[l, b, i] == k_segment[l, b, j])
//   and (topology 0, or topology 1 and r <= p,
//        or topology 2 and ((p < P and r < P) or (p >= P and r <= p)))   P = prefix[l, b, h]
//   and (left[l, h] < 0 or p - r <= left[l, h]) and (right[l, h] < 0 or r - p <= right[l, h])
// the relation's batch and head axes broadcast (extent 1) when they are shared. The host
// bounds the composition's depth (refattn.masks.algebra.MAX_DEPTH), so a 64-bit stack holds it.
#pragma once

#include "common.cuh"

struct RefattnVisibility {
    int mode;  // P_VIS_MODE
    const unsigned char* dense;
    const long long *q_pos, *k_pos, *q_seg, *k_seg, *prefix, *left, *right, *leaf;
    union {  // one register pair for either (mode 2 reads program, mode 1 tiles)
        const long long* program;    // a relation's postfix program
        const unsigned char* tiles;  // a dense mask's tile classes (tile_loop.cuh)
    };
    const unsigned char *key_valid, *sanitized;
    long long rel_b, rel_h, program_len, Q, K, Hq;
    bool has_sanitized;
};

__device__ __forceinline__ RefattnVisibility refattn_visibility(
    const unsigned long long* x, const long long* ip) {
    RefattnVisibility v;
    v.mode = static_cast<int>(ip[P_VIS_MODE]);
    v.dense = reinterpret_cast<const unsigned char*>(x[X_VIS]);
    v.q_pos = reinterpret_cast<const long long*>(x[X_Q_POS]);
    v.k_pos = reinterpret_cast<const long long*>(x[X_K_POS]);
    v.q_seg = reinterpret_cast<const long long*>(x[X_Q_SEG]);
    v.k_seg = reinterpret_cast<const long long*>(x[X_K_SEG]);
    v.prefix = reinterpret_cast<const long long*>(x[X_PREFIX]);
    v.left = reinterpret_cast<const long long*>(x[X_LEFT]);
    v.right = reinterpret_cast<const long long*>(x[X_RIGHT]);
    v.leaf = reinterpret_cast<const long long*>(x[X_REL_LEAF]);
    if (v.mode == 1)
        v.tiles = reinterpret_cast<const unsigned char*>(x[X_VIS_TILES]);
    else
        v.program = reinterpret_cast<const long long*>(x[X_REL_PROGRAM]);
    v.key_valid = reinterpret_cast<const unsigned char*>(x[X_KEY_VALID]);
    v.sanitized = reinterpret_cast<const unsigned char*>(x[X_SANITIZED]);
    v.rel_b = ip[P_REL_B];
    v.rel_h = ip[P_REL_H];
    v.program_len = ip[P_REL_PROGRAM_LEN];
    v.has_sanitized = ip[P_HAS_SANITIZED] != 0;
    v.Q = ip[P_Q];
    v.K = ip[P_K];
    v.Hq = ip[P_HQ];
    return v;
}

// leaf l's predicate at (rb, rh, i, j): rb, rh already mapped onto the relation's extents
__device__ __forceinline__ bool refattn_leaf_visible(const RefattnVisibility& v, long long l,
                                                     long long rb, long long rh, long long i,
                                                     long long j) {
    const long long qrow = (l * v.rel_b + rb) * v.Q, krow = (l * v.rel_b + rb) * v.K;
    const long long hrow = l * v.rel_h;
    const long long p = v.q_pos[qrow + i];
    const long long r = v.k_pos[krow + j];
    const long long segments = v.leaf[2 * l], topology = v.leaf[2 * l + 1];
    bool edge = v.key_valid[krow + j] != 0;
    if (edge && segments) edge = v.q_seg[qrow + i] == v.k_seg[krow + j];
    if (edge && topology == 1) edge = r <= p;
    if (edge && topology == 2) {
        const long long P = v.prefix[(l * v.rel_b + rb) * v.rel_h + rh];
        edge = (p < P && r < P) || (p >= P && r <= p);
    }
    if (edge && v.left[hrow + rh] >= 0) edge = p - r <= v.left[hrow + rh];
    if (edge && v.right[hrow + rh] >= 0) edge = r - p <= v.right[hrow + rh];
    return edge;
}

// whether query i of (b, h) reads key j (i < Q, j < K)
__device__ __forceinline__ bool refattn_visible(const RefattnVisibility& v, const long long* ip,
                                                long long b, long long h, long long i,
                                                long long j) {
    bool edge = true;
    if (v.mode == 1) {
        edge = strided_at(v.dense, ip, P_VIS_S0, b, h, i, j) != 0;
    } else if (v.mode == 2) {
        const long long rb = v.rel_b == 1 ? 0 : b;
        const long long rh = v.rel_h == 1 ? 0 : h;
        if (v.program_len == 1) {
            edge = refattn_leaf_visible(v, v.program[0], rb, rh, i, j);
        } else {  // the postfix program, one bit per stack entry
            unsigned long long stack = 0;
            for (long long t = 0; t < v.program_len; ++t) {
                const long long op = v.program[t];
                if (op >= 0) {
                    stack = (stack << 1) | (refattn_leaf_visible(v, op, rb, rh, i, j) ? 1ULL : 0ULL);
                } else {
                    const unsigned long long a = stack & 1ULL, c = (stack >> 1) & 1ULL;
                    stack = ((stack >> 2) << 1) | (op == -1 ? (a & c) : (a | c));
                }
            }
            edge = (stack & 1ULL) != 0;
        }
    }
    if (!edge && j == 0 && v.has_sanitized) edge = v.sanitized[(b * v.Hq + h) * v.Q + i] != 0;
    return edge;
}
