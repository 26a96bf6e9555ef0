// Asynchronous global -> shared copies (sm_80+): cp.async.cg.shared.global, 16 bytes, and its
// group commit / wait.
//
// refattn_cp_async16(dst, src, valid) copies the two doubles src[0..1] to dst[0..1] (dst in
// shared memory, both 16-byte aligned), or writes two zeros when !valid (src-size 0: nothing
// is read). The copy is complete only after refattn_cp_async_wait<N>() has returned in the
// issuing thread with fewer than N + 1 groups pending, and visible to the other threads of the
// block after a barrier that follows that wait. The emulator performs the copies at the wait,
// so a missing wait leaves the destination stale (NaN-poisoned in a debug build).
#pragma once

#include "common.cuh"

template <typename Dst>
__device__ __forceinline__ void refattn_cp_async16(Dst dst, const double* src, bool valid) {
#ifdef REFATTN_EMULATOR
    ::emu::cp_async16(dst[0], dst[1], src, valid);
#else
    unsigned address;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }\n"
                 : "=r"(address)
                 : "l"(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
#endif
}

// A tile's base for refattn_cp_async16_at: on the GPU its 32-bit shared-window address (one
// conversion per tile, not per copy), in the emulator the checked pointer itself.
template <typename Dst>
__device__ __forceinline__ auto refattn_shared_base(Dst dst) {
#ifdef REFATTN_EMULATOR
    return dst;
#else
    unsigned address;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }\n"
        : "=r"(address)
        : "l"(dst));
    return address;
#endif
}

// src[0..1] into doubles offset, offset + 1 of the tile whose base is `base`
// (refattn_shared_base), or two zeros when !valid: on the GPU a 32-bit add to the shared address
// (a constant part of offset becomes the instruction's immediate) and cp.async with the
// ignore-src predicate (PTX ISA 7.5+: "the data from the source location src [is] ignored
// completely" and zeros copied), so src may lie outside any allocation when !valid; the emulator
// does not read it either.
template <typename Base>
__device__ __forceinline__ void refattn_cp_async16_at(Base base, int offset, const double* src,
                                                      bool valid) {
#ifdef REFATTN_EMULATOR
    ::emu::cp_async16(base[offset], base[offset + 1], src, valid);
#else
    asm volatile("{ .reg .pred p; setp.eq.u32 p, %2, 0;\n"
                 "  cp.async.cg.shared.global [%0], [%1], 16, p; }\n" ::"r"(
                     base + 8u * static_cast<unsigned>(offset)),
                 "l"(src), "r"(valid ? 1u : 0u)
                 : "memory");
#endif
}

__device__ __forceinline__ void refattn_cp_async_commit() {
#ifdef REFATTN_EMULATOR
    ::emu::cp_async_commit();
#else
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// wait until at most N of this thread's committed groups are still pending
template <int N>
__device__ __forceinline__ void refattn_cp_async_wait() {
#ifdef REFATTN_EMULATOR
    ::emu::cp_async_wait(N);
#else
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}
