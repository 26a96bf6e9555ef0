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
