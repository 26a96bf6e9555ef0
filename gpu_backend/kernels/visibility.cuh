// Visibility evaluated in the kernel: every edge, a dense bool tensor, or a relation's
// coordinates (refattn.masks.relation.KernelArguments), plus the temporary key 0 of a row
// sanitised under the sanitize_then_zero_invalid_query policy.
//
// With p = q_pos[b, i] and r = k_pos[b, j] a relation's edge exists iff
//   key_valid[b, j]
//   and (no segments or q_segment[b, i] == k_segment[b, j])
//   and (topology 0, or topology 1 and r <= p,
//        or topology 2 and ((p < P and r < P) or (p >= P and r <= p)))   P = prefix[b, h]
//   and (left[h] < 0 or p - r <= left[h]) and (right[h] < 0 or r - p <= right[h])
// the relation's batch and head axes broadcast (extent 1) when they are shared.
#pragma once

#include "common.cuh"

struct RefattnVisibility {
    int mode;  // P_VIS_MODE
    const unsigned char* dense;
    const long long *q_pos, *k_pos, *q_seg, *k_seg, *prefix, *left, *right;
    const unsigned char *key_valid, *sanitized;
    long long rel_b, rel_h, topology, Q, K, Hq;
    bool segments, has_sanitized;
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
    v.key_valid = reinterpret_cast<const unsigned char*>(x[X_KEY_VALID]);
    v.sanitized = reinterpret_cast<const unsigned char*>(x[X_SANITIZED]);
    v.rel_b = ip[P_REL_B];
    v.rel_h = ip[P_REL_H];
    v.topology = ip[P_TOPOLOGY];
    v.segments = ip[P_HAS_SEGMENTS] != 0;
    v.has_sanitized = ip[P_HAS_SANITIZED] != 0;
    v.Q = ip[P_Q];
    v.K = ip[P_K];
    v.Hq = ip[P_HQ];
    return v;
}

// whether query i of (b, h) reads key j (i < Q, j < K)
__device__ __forceinline__ bool refattn_visible(const RefattnVisibility& v, const long long* ip,
                                                long long b, long long h, long long i,
                                                long long j) {
    bool edge = true;
    if (v.mode == 1) {
        edge = strided_at(v.dense, ip, P_VIS_S0, b, h, i, j) != 0;
    } else if (v.mode == 2) {
        long long rb = v.rel_b == 1 ? 0 : b;
        long long rh = v.rel_h == 1 ? 0 : h;
        long long p = v.q_pos[rb * v.Q + i];
        long long r = v.k_pos[rb * v.K + j];
        edge = v.key_valid[rb * v.K + j] != 0;
        if (edge && v.segments) edge = v.q_seg[rb * v.Q + i] == v.k_seg[rb * v.K + j];
        if (edge && v.topology == 1) edge = r <= p;
        if (edge && v.topology == 2) {
            long long P = v.prefix[rb * v.rel_h + rh];
            edge = (p < P && r < P) || (p >= P && r <= p);
        }
        if (edge && v.left[rh] >= 0) edge = p - r <= v.left[rh];
        if (edge && v.right[rh] >= 0) edge = r - p <= v.right[rh];
    }
    if (!edge && j == 0 && v.has_sanitized) edge = v.sanitized[(b * v.Hq + h) * v.Q + i] != 0;
    return edge;
}
