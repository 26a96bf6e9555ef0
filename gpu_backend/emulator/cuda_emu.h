// The CUDA execution model on CPU threads, for running refattn's .cu kernels without a GPU.
//
// Include this header before a .cu file and compile with a C++20 compiler. One OS thread runs
// one block at a time (blocks in parallel OS threads); inside a block every CUDA thread is a
// cooperative fiber (its own stack) that runs until it reaches a synchronisation point:
// __syncthreads (a real barrier: a fiber that exits while others wait is a divergence error),
// __syncthreads_or/_and/_count, and the warp shuffles and votes (exchanged among the 32 lanes
// of a warp). Dynamic shared memory is one buffer per block (REFATTN_DYNAMIC_SHARED); __shared__
// variables are per-OS-thread statics. Atomics are GCC __atomic builtins.
//
// The fp64 tensor-core instruction (mma.sync.aligned.m8n8k4 / m16n8k4 / m16n8k8 / m16n8k16
// .row.col.f64, kernels/mma_*.cuh) is a warp operation too: all 32 lanes of the warp must arrive
// at an mma of the same shape (else an error naming block, warp and the missing lanes, as for a
// divergent barrier); the scheduler assembles A, B and C from the lanes' fragments with the PTX
// layouts and computes every element of D as a k-ascending chain of fused multiply-adds
// (std::fma), or, with EmuOptions::mma_exact (REFATTN_EMU_MMA=exact for the Python launcher),
// as the exact sum c + sum_k a_k b_k rounded once (the two differ, e.g. on
// (1, 2^-53, 2^-53) . (1, 1, 1)). cp.async (kernels/cp_async.cuh) records each copy in the
// issuing thread's open group and performs it at the cp.async.wait that retires the group, so a
// kernel that reads shared memory without waiting sees stale (in debug builds NaN) data; debug
// builds also check that both addresses of every cp.async are 16-byte aligned, as the GPU does.
//
// With REFATTN_EMU_DEBUG defined: dynamic shared memory is bounds-checked (an index outside the
// allocation is an error naming block, thread and index), filled with NaN at block start, the
// fibers of a block run in a seeded random order each round, so a result that depends on
// thread order changes with the seed, and one warp operation is resolved per round (a seeded
// random warp), so warps drift apart between barriers and a missing barrier between warps
// shows.
//
// Entry point (REFATTN_EXPORT(kernel) generates it): extern "C" int emu_launch_<kernel>(
//     const unsigned* grid, const unsigned* block, size_t shared_bytes, void** args,
//     const EmuOptions* options) -- args as cuLaunchKernel's kernelParams; returns 0, or 1
// with the message in emu_last_error().
#pragma once
#define REFATTN_EMULATOR 1

#if defined(__x86_64__) && !defined(REFATTN_EMU_UCONTEXT)
#define REFATTN_EMU_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __constant__
#define __host__
#define __forceinline__ inline
#define __shared__ static thread_local

struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};
using uint3 = dim3;

struct EmuOptions {  // laid out as gpu_backend.emulator.module.EmuOptions (ctypes)
    unsigned int threads;     // OS threads running blocks (0: hardware concurrency)
    unsigned int seed;        // debug builds: seed of the fibers' random order
    unsigned long long stack_bytes;  // per fiber (0: 256 KiB)
    unsigned int mma_exact;   // 0: mma.sync as a k-ascending fma chain; 1: exact sum rounded once
};

namespace emu {

enum State { READY, AT_BARRIER, AT_WARP, DONE };
enum WarpOp { SHFL, SHFL_XOR, SHFL_DOWN, SHFL_UP, BALLOT, MMA };

// one lane's operands of a pending mma.sync (on the lane's own stack while it waits)
struct MmaArgs {
    int m, k;
    const double *a, *b;
    double* c;
};

struct AsyncCopy {  // one 16-byte cp.async: done at the wait that retires its group
    double* dst;
    const double* src;
    bool valid;
};
enum BarrierOp { PLAIN, OR, AND, COUNT };

// a fiber's stack: uninitialised (new char[]), so a page that the fiber never touches is never
// faulted in (zeroing 128 x 256 KiB for every launch thread was the emulator's largest system
// time after the context switches)
struct Stack {
    std::unique_ptr<char[]> base;
    size_t size = 0;
};

// -- switching between fibers ------------------------------------------------------------------
// On x86-64 a fiber switch saves the callee-saved registers, MXCSR and the x87 control word on
// the old stack and loads them from the new one (refattn_emu_switch below): what the SysV ABI
// requires a call to preserve. glibc's swapcontext also saves and restores the signal mask, a
// system call on every switch, which took most of the emulator's time. Elsewhere (or with
// -DREFATTN_EMU_UCONTEXT) the fibers are ucontexts.
#ifdef REFATTN_EMU_ASM_SWITCH
struct Context {
    void* sp = nullptr;  // the saved stack pointer: the registers sit above it
};
extern "C" void refattn_emu_switch(void** save_sp, void* load_sp);
extern "C" void refattn_emu_start();
// refattn_emu_start: a fresh fiber's first "return" lands here with its entry function in r13
// and its argument in r12 (prepare_context); the entry function never returns
asm(R"(
    .text
    .p2align 4
    .globl refattn_emu_switch
    .hidden refattn_emu_switch
    .type refattn_emu_switch, @function
refattn_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size refattn_emu_switch, .-refattn_emu_switch
    .p2align 4
    .globl refattn_emu_start
    .hidden refattn_emu_start
    .type refattn_emu_start, @function
refattn_emu_start:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size refattn_emu_start, .-refattn_emu_start
)");
inline void switch_context(Context& from, Context& to) { refattn_emu_switch(&from.sp, to.sp); }
// a context that starts entry(arg) on `stack`: the frame refattn_emu_switch pops, with the
// return address refattn_emu_start and the stack pointer 16-byte aligned after the return
inline void prepare_context(Context& c, Stack& stack, void (*entry)(int), int arg) {
    const auto end = reinterpret_cast<std::uintptr_t>(stack.base.get() + stack.size);
    void** sp = reinterpret_cast<void**>(end & ~std::uintptr_t(15));
    *--sp = reinterpret_cast<void*>(&refattn_emu_start);  // the return address
    *--sp = nullptr;                                      // rbp
    *--sp = nullptr;                                      // rbx
    *--sp = reinterpret_cast<void*>(static_cast<std::intptr_t>(arg));  // r12
    *--sp = reinterpret_cast<void*>(entry);               // r13
    *--sp = nullptr;                                      // r14
    *--sp = nullptr;                                      // r15
    *--sp = nullptr;                                      // MXCSR, x87 control word: this thread's
    unsigned mxcsr;
    unsigned short fpu;
    asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(mxcsr), "=m"(fpu));
    std::memcpy(sp, &mxcsr, 4);
    std::memcpy(reinterpret_cast<char*>(sp) + 4, &fpu, 2);
    c.sp = sp;
}
#else
struct Context {
    ucontext_t uc;
};
inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
// out of line, so that no caller's variable lives across getcontext
[[gnu::noinline]] inline void prepare_context(Context& c, Stack& stack, void (*entry)(int),
                                              int arg) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack.base.get();
    c.uc.uc_stack.ss_size = stack.size;
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, reinterpret_cast<void (*)()>(entry), 1, arg);
}
#endif

struct Fiber {
    Context ctx;
    State state = READY;
    dim3 idx;
    unsigned linear = 0;
    // a pending warp operation: this lane's value and parameter; the result after exchange
    WarpOp op = SHFL;
    unsigned long long value = 0, result = 0;
    int param = 0;
    unsigned mask = 0;
    // a pending barrier with a predicate
    BarrierOp bop = PLAIN;
    int predicate = 0, bresult = 0;
    // cp.async: the open group, then the committed groups oldest first
    std::vector<AsyncCopy> open_copies;
    std::vector<std::vector<AsyncCopy>> committed;
};

struct Block;
struct Launch {
    dim3 grid, block;
    size_t shared_bytes = 0;
    const EmuOptions* options = nullptr;
    void (*body)(void*) = nullptr;  // runs one CUDA thread
    void* payload = nullptr;
    std::atomic<bool> failed{false};
    std::mutex lock;
    std::string error;
};

struct Block {
    Launch* launch = nullptr;
    dim3 idx;
    std::vector<Fiber> fibers;
    std::vector<char> shared;  // dynamic shared memory (8-byte aligned: vector<char> of new)
    size_t shared_bytes = 0;   // the launch's request (the vector may hold a little more)
    Context scheduler;
    Fiber* current = nullptr;
    std::mt19937 order_rng;
};

inline thread_local Block* tl_block = nullptr;
// the fibers' stacks (Stack), kept by each OS thread between blocks
inline thread_local std::vector<Stack> tl_stacks;
inline std::string last_error;

inline void record_error(Launch* l, const std::string& message) {
    std::lock_guard<std::mutex> guard(l->lock);
    if (!l->failed.exchange(true)) l->error = message;
}

[[noreturn]] inline void fail(const char* format, ...) {
    char buffer[512];
    va_list args;
    va_start(args, format);
    std::vsnprintf(buffer, sizeof(buffer), format, args);
    va_end(args);
    Block* b = tl_block;
    char where[160];
    std::snprintf(where, sizeof(where), " (block (%u, %u, %u), thread (%u, %u, %u))", b->idx.x,
                  b->idx.y, b->idx.z, b->current->idx.x, b->current->idx.y, b->current->idx.z);
    record_error(b->launch, std::string(buffer) + where);
    b->current->state = DONE;
    switch_context(b->current->ctx, b->scheduler);
    __builtin_unreachable();
}

inline void yield(State state) {
    Block* b = tl_block;
    b->current->state = state;
    switch_context(b->current->ctx, b->scheduler);
}

inline Fiber& self() { return *tl_block->current; }

// -- dynamic shared memory ----------------------------------------------------------------------
#ifdef REFATTN_EMU_DEBUG
template <typename T>
struct SharedPtr {  // a pointer into the block's dynamic shared memory, checked on every access
    T* base;
    long long count, offset;
    T& operator[](long long i) const {
        long long at = offset + i;
        if (at < 0 || at >= count)
            fail("shared memory index %lld out of bounds: the dynamic allocation holds %lld "
                 "elements", at, count);
        return base[at];
    }
    SharedPtr operator+(long long n) const { return {base, count, offset + n}; }
};
template <typename T>
inline SharedPtr<T> dynamic_shared() {
    Block* b = tl_block;
    return {reinterpret_cast<T*>(b->shared.data()),
            static_cast<long long>(b->shared_bytes / sizeof(T)), 0};
}
#else
template <typename T>
inline T* dynamic_shared() {
    return reinterpret_cast<T*>(tl_block->shared.data());
}
#endif

// -- warp operations: every lane in the mask deposits, the scheduler exchanges -----------------------
inline unsigned long long warp_op(WarpOp op, unsigned mask, unsigned long long value, int param) {
    Fiber& f = self();
    f.op = op;
    f.mask = mask;
    f.value = value;
    f.param = param;
    yield(AT_WARP);
    return f.result;
}

template <typename T>
inline unsigned long long to_bits(T v) {
    static_assert(sizeof(T) <= 8);
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    return bits;
}

template <typename T>
inline T from_bits(unsigned long long bits) {
    T v;
    std::memcpy(&v, &bits, sizeof(T));
    return v;
}

inline int barrier(BarrierOp op, int predicate) {
    Fiber& f = self();
    f.bop = op;
    f.predicate = predicate;
    yield(AT_BARRIER);
    return f.bresult;
}

// -- mma.sync and cp.async, called by the wrappers of kernels/mma_*.cuh and cp_async.cuh ------
inline void mma_f64(int m, int k, const double* a, const double* b, double* c) {
    MmaArgs args{m, k, a, b, c};
    Fiber& f = self();
    f.op = MMA;
    f.mask = 0xffffffffu;
    f.value = reinterpret_cast<unsigned long long>(&args);
    f.param = 0;
    yield(AT_WARP);
}

#ifdef REFATTN_EMU_DEBUG
inline void cp_async16(double& d0, double& d1, const double* src, bool valid) {
    if (&d1 != &d0 + 1) fail("cp.async: the destination is not two adjacent doubles");
    if (reinterpret_cast<uintptr_t>(&d0) % 16 != 0 ||
        (valid && reinterpret_cast<uintptr_t>(src) % 16 != 0))
        fail("cp.async: a 16-byte copy needs 16-byte aligned addresses (shared %p, global %p)",
             static_cast<void*>(&d0), static_cast<const void*>(src));
    self().open_copies.push_back({&d0, src, valid});
}
#else
inline void cp_async16(double& d0, double&, const double* src, bool valid) {
    self().open_copies.push_back({&d0, src, valid});
}
#endif

inline void cp_async_commit() {
    Fiber& f = self();
    f.committed.push_back(std::move(f.open_copies));
    f.open_copies.clear();
}

inline void cp_async_wait(int n) {  // retire all but the newest n committed groups
    Fiber& f = self();
    size_t keep = static_cast<size_t>(n < 0 ? 0 : n);
    size_t retire = f.committed.size() > keep ? f.committed.size() - keep : 0;
    for (size_t g = 0; g < retire; ++g)
        for (const AsyncCopy& c : f.committed[g]) {
            c.dst[0] = c.valid ? c.src[0] : 0.0;
            c.dst[1] = c.valid ? c.src[1] : 0.0;
        }
    f.committed.erase(f.committed.begin(), f.committed.begin() + static_cast<long>(retire));
}

// -- the scheduler of one block -----------------------------------------------------------------
inline void fiber_entry(int index) {
    Block* b = tl_block;
    b->launch->body(b->launch->payload);
    b->fibers[index].state = DONE;
    switch_context(b->fibers[index].ctx, b->scheduler);
}

// -- mma.sync f64: fragments per the PTX layouts, g = lane >> 2, t = lane & 3 -----------------
// A (m x k): value v of a lane is row g + 8 (v % (m / 8)), column t + 4 (v / (m / 8));
// B (k x 8): value v is row t + 4 v, column g; C/D (m x 8): value v is row g + 8 (v / 2),
// column 2 t + v % 2. (m8n8k4: one A, one B, two C values; m16n8kK: K / 2, K / 4, four.)

// the exact sum of n doubles rounded once to nearest-even (Shewchuk's partials, as Python's
// math.fsum); finite inputs whose partial sums stay finite
inline double exact_sum(const double* x, int n) {
    double p[96];
    int np = 0;
    for (int e = 0; e < n; ++e) {
        double v = x[e];
        int i = 0;
        for (int j = 0; j < np; ++j) {
            double y = p[j];
            if (std::fabs(v) < std::fabs(y)) std::swap(v, y);
            const double hi = v + y, lo = y - (hi - v);
            if (lo != 0.0) p[i++] = lo;
            v = hi;
        }
        np = i;
        p[np++] = v;
    }
    double hi = 0.0;
    if (np > 0) {
        hi = p[--np];
        double lo = 0.0;
        while (np > 0) {
            const double v = hi, y = p[--np];
            hi = v + y;
            lo = y - (hi - v);
            if (lo != 0.0) break;
        }
        if (np > 0 && ((lo < 0.0 && p[np - 1] < 0.0) || (lo > 0.0 && p[np - 1] > 0.0))) {
            const double y = lo * 2.0, v = hi + y;
            if (y == v - hi) hi = v;  // the half-way case: round away from the partial
        }
    }
    return hi;
}

inline double mma_element(const double* a_row, const double* b_col, double c, int k,
                          bool exact) {
    double acc = c;
    for (int kk = 0; kk < k; ++kk) acc = std::fma(a_row[kk], b_col[kk], acc);  // k ascending
    if (!exact || !std::isfinite(acc)) return acc;
    double terms[1 + 2 * 16];
    terms[0] = c;
    for (int kk = 0; kk < k; ++kk) {
        const double hi = a_row[kk] * b_col[kk];
        if (!std::isfinite(hi)) return acc;
        terms[1 + 2 * kk] = hi;
        terms[2 + 2 * kk] = std::fma(a_row[kk], b_col[kk], -hi);  // exact unless subnormal
    }
    return exact_sum(terms, 1 + 2 * k);
}

inline std::string lane_list(const std::vector<int>& lanes) {
    std::string out;
    for (int lane : lanes) out += (out.empty() ? "" : ", ") + std::to_string(lane);
    return out;
}

// every lane of warp [w0, w1) at an mma of one shape: compute D into the lanes' c; else an error
inline bool resolve_mma(Block& b, size_t w0, size_t w1) {
    const int warp = static_cast<int>(w0 / 32);
    char where[96];
    std::snprintf(where, sizeof(where), "block (%u, %u, %u), warp %d", b.idx.x, b.idx.y,
                  b.idx.z, warp);
    int m = 0, k = 0;
    for (size_t i = w0; i < w1; ++i) {
        const Fiber& f = b.fibers[i];
        if (f.state == AT_WARP && f.op == MMA) {
            const MmaArgs* args = reinterpret_cast<const MmaArgs*>(f.value);
            m = args->m;
            k = args->k;
            break;
        }
    }
    std::vector<int> missing, other_shape;
    for (size_t lane = 0; lane < 32; ++lane) {
        const size_t i = w0 + lane;
        if (i >= w1) {
            missing.push_back(static_cast<int>(lane));
            continue;
        }
        const Fiber& f = b.fibers[i];
        if (f.state != AT_WARP || f.op != MMA) {
            missing.push_back(static_cast<int>(lane));
        } else {
            const MmaArgs* args = reinterpret_cast<const MmaArgs*>(f.value);
            if (args->m != m || args->k != k) other_shape.push_back(static_cast<int>(lane));
        }
    }
    if (!missing.empty() || !other_shape.empty()) {
        std::string message = std::string("mma.sync divergence (") + where + "): mma.sync.m" +
                              std::to_string(m) + "n8k" + std::to_string(k) +
                              " needs all 32 lanes of the warp";
        if (!missing.empty())
            message += "; lane(s) " + lane_list(missing) +
                       " did not arrive (exited, at a barrier or at another warp operation)";
        if (!other_shape.empty())
            message += "; lane(s) " + lane_list(other_shape) + " issued another shape";
        record_error(b.launch, message);
        return false;
    }
    const int rows = m / 8;  // 1 or 2 row groups
    double A[16][16], B[16][8], C[16][8];
    for (int lane = 0; lane < 32; ++lane) {
        const MmaArgs* args = reinterpret_cast<const MmaArgs*>(b.fibers[w0 + lane].value);
        const int g = lane >> 2, t = lane & 3;
        for (int v = 0; v < m * k / 32; ++v) A[g + 8 * (v % rows)][t + 4 * (v / rows)] = args->a[v];
        for (int v = 0; v < k / 4; ++v) B[t + 4 * v][g] = args->b[v];
        for (int v = 0; v < m / 4; ++v) C[g + 8 * (v / 2)][2 * t + v % 2] = args->c[v];
    }
    const bool exact = b.launch->options && b.launch->options->mma_exact;
    double Bt[8][16];
    for (int kk = 0; kk < k; ++kk)
        for (int n = 0; n < 8; ++n) Bt[n][kk] = B[kk][n];
    for (int lane = 0; lane < 32; ++lane) {
        Fiber& f = b.fibers[w0 + lane];
        const MmaArgs* args = reinterpret_cast<const MmaArgs*>(f.value);
        const int g = lane >> 2, t = lane & 3;
        for (int v = 0; v < m / 4; ++v) {
            const int row = g + 8 * (v / 2), col = 2 * t + v % 2;
            args->c[v] = mma_element(A[row], Bt[col], C[row][col], k, exact);
        }
        f.state = READY;
    }
    return true;
}

// the warp operations whose lanes have all arrived. Debug builds resolve one warp per round,
// from a random warp on: the warps of a block then drift apart between barriers (one may run
// many warp operations ahead of another), so a missing barrier between one warp's shared-memory
// reads and another warp's writes of the same words shows, as it can on the GPU.
inline bool resolve_warps(Block& b) {
    bool resolved = false;
    const size_t n = b.fibers.size(), warps = (n + 31) / 32;
#ifdef REFATTN_EMU_DEBUG
    constexpr bool one = true;
    const size_t first = std::uniform_int_distribution<size_t>(0, warps - 1)(b.order_rng);
#else
    constexpr bool one = false;
    const size_t first = 0;
#endif
    for (size_t k = 0; k < warps; ++k) {
        const size_t w0 = (first + k) % warps * 32;
        const size_t w1 = std::min(n, w0 + 32);
        bool pending = false;
        for (size_t i = w0; i < w1; ++i) pending = pending || b.fibers[i].state == AT_WARP;
        if (!pending) continue;
        bool mma = false;
        for (size_t i = w0; i < w1; ++i)
            mma = mma || (b.fibers[i].state == AT_WARP && b.fibers[i].op == MMA);
        if (mma) {
            if (!resolve_mma(b, w0, w1)) return false;
            resolved = true;
            if (one) return true;
            continue;
        }
        const unsigned mask = [&] {
            for (size_t i = w0; i < w1; ++i)
                if (b.fibers[i].state == AT_WARP) return b.fibers[i].mask;
            return 0u;
        }();
        bool all_here = true;
        for (size_t i = w0; i < w1; ++i) {
            if (!(mask >> (i - w0) & 1u)) continue;
            const Fiber& f = b.fibers[i];
            if (f.state == READY) return resolved;  // still running towards it
            if (f.state != AT_WARP) all_here = false;
        }
        if (!all_here) {
            record_error(b.launch, "warp operation divergence: a lane in the mask reached a "
                                   "barrier or exited instead of the warp operation");
            return false;
        }
        unsigned long long ballot = 0;
        for (size_t i = w0; i < w1; ++i)
            if ((mask >> (i - w0) & 1u) && b.fibers[i].value) ballot |= 1ull << (i - w0);
        for (size_t i = w0; i < w1; ++i) {
            Fiber& f = b.fibers[i];
            if (!(mask >> (i - w0) & 1u)) continue;
            const int lane = static_cast<int>(i - w0);
            int src = lane;
            switch (f.op) {
                case SHFL: src = f.param & 31; break;
                case SHFL_XOR: src = lane ^ f.param; break;
                case SHFL_DOWN: src = lane + f.param < 32 ? lane + f.param : lane; break;
                case SHFL_UP: src = lane - f.param >= 0 ? lane - f.param : lane; break;
                case BALLOT: break;
                case MMA: break;  // resolved by resolve_mma
            }
            if (f.op == BALLOT) {
                f.result = ballot;
            } else {
                const size_t s = w0 + static_cast<size_t>(src);
                f.result = (s < w1 && (mask >> src & 1u)) ? b.fibers[s].value : f.value;
            }
            f.state = READY;
        }
        resolved = true;
        if (one) return true;
    }
    return resolved;
}

inline void run_block(Block& b) {
    const Launch& l = *b.launch;
    const size_t n = b.fibers.size();
    std::vector<size_t> order(n);
    for (size_t i = 0; i < n; ++i) order[i] = i;
    while (!b.launch->failed.load()) {
#ifdef REFATTN_EMU_DEBUG
        std::shuffle(order.begin(), order.end(), b.order_rng);
#endif
        for (size_t k = 0; k < n && !b.launch->failed.load(); ++k) {
            Fiber& f = b.fibers[order[k]];
            if (f.state != READY) continue;
            b.current = &f;
            switch_context(b.scheduler, f.ctx);
        }
        if (b.launch->failed.load()) return;
        size_t done = 0, waiting = 0;
        for (const Fiber& f : b.fibers) {
            done += f.state == DONE;
            waiting += f.state == AT_BARRIER;
        }
        if (done == n) return;
        if (resolve_warps(b)) continue;
        if (b.launch->failed.load()) return;
        if (waiting + done == n && waiting > 0) {
            if (done > 0) {
                record_error(b.launch, "__syncthreads divergence: " + std::to_string(done) +
                                           " thread(s) exited while " +
                                           std::to_string(waiting) + " wait at a barrier");
                return;
            }
            int any = 0, all = 1, count = 0;
            for (const Fiber& f : b.fibers) {
                any |= f.predicate != 0;
                all &= f.predicate != 0;
                count += f.predicate != 0;
            }
            for (Fiber& f : b.fibers) {
                f.bresult = f.bop == OR ? any : f.bop == AND ? all : f.bop == COUNT ? count : 0;
                f.state = READY;
            }
            continue;
        }
        record_error(b.launch, "deadlock: threads wait at different synchronisation points "
                               "(a barrier and a warp operation)");
        return;
    }
    (void)l;
}

inline void run_blocks(Launch& l, std::atomic<unsigned long long>& next) {
    const unsigned long long per_block = 1ull * l.block.x * l.block.y * l.block.z;
    const unsigned long long total = 1ull * l.grid.x * l.grid.y * l.grid.z;
    const size_t stack_bytes = l.options && l.options->stack_bytes ? l.options->stack_bytes
                                                                   : (256u << 10);
    if (tl_stacks.size() < per_block || (!tl_stacks.empty() && tl_stacks[0].size != stack_bytes)) {
        tl_stacks.clear();
        tl_stacks.resize(per_block);
        for (Stack& stack : tl_stacks) {
            stack.base.reset(new char[stack_bytes]);
            stack.size = stack_bytes;
        }
    }
    Block b;
    b.launch = &l;
    b.fibers.resize(per_block);
    b.shared.resize(l.shared_bytes + 8);
    b.shared_bytes = l.shared_bytes;
    tl_block = &b;
    for (unsigned long long id = next++; id < total && !l.failed.load(); id = next++) {
        b.idx.x = static_cast<unsigned>(id % l.grid.x);
        b.idx.y = static_cast<unsigned>(id / l.grid.x % l.grid.y);
        b.idx.z = static_cast<unsigned>(id / (1ull * l.grid.x * l.grid.y));
        b.order_rng.seed(static_cast<unsigned>((l.options ? l.options->seed : 0) * 2654435761u +
                                               id));
#ifdef REFATTN_EMU_DEBUG
        const unsigned long long nan_bits = 0x7ff8deadbeef0000ull;  // a quiet NaN: poison
        for (size_t off = 0; off + 8 <= b.shared.size(); off += 8)
            std::memcpy(b.shared.data() + off, &nan_bits, 8);
#endif
        for (unsigned long long t = 0; t < per_block; ++t) {
            Fiber& f = b.fibers[t];
            f = Fiber();
            f.linear = static_cast<unsigned>(t);
            f.idx.x = static_cast<unsigned>(t % l.block.x);
            f.idx.y = static_cast<unsigned>(t / l.block.x % l.block.y);
            f.idx.z = static_cast<unsigned>(t / (1ull * l.block.x * l.block.y));
            prepare_context(f.ctx, tl_stacks[t], &fiber_entry, static_cast<int>(t));
        }
        run_block(b);
    }
    tl_block = nullptr;
}

inline int launch(const unsigned* grid, const unsigned* block, size_t shared_bytes,
                  const EmuOptions* options, void (*body)(void*), void* payload) {
    Launch l;
    l.grid = {grid[0], grid[1], grid[2]};
    l.block = {block[0], block[1], block[2]};
    l.shared_bytes = shared_bytes;
    l.options = options;
    l.body = body;
    l.payload = payload;
    std::atomic<unsigned long long> next{0};
    unsigned workers = options && options->threads ? options->threads
                                                   : std::thread::hardware_concurrency();
    const unsigned long long total = 1ull * grid[0] * grid[1] * grid[2];
    if (workers == 0) workers = 1;
    if (workers > total) workers = static_cast<unsigned>(total ? total : 1);
    std::vector<std::thread> pool;
    for (unsigned w = 1; w < workers; ++w) pool.emplace_back([&] { run_blocks(l, next); });
    run_blocks(l, next);
    for (std::thread& t : pool) t.join();
    if (l.failed.load()) {
        last_error = l.error;
        return 1;
    }
    return 0;
}

template <typename... A, size_t... I>
inline void call_kernel(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}

template <typename... A>
inline int launch_kernel(void (*kernel)(A...), const unsigned* grid, const unsigned* block,
                         size_t shared_bytes, void** args, const EmuOptions* options) {
    struct Payload {
        void (*kernel)(A...);
        void** args;
    } payload{kernel, args};
    return launch(grid, block, shared_bytes, options,
                  [](void* p) {
                      auto* pl = static_cast<Payload*>(p);
                      call_kernel(pl->kernel, pl->args, std::index_sequence_for<A...>{});
                  },
                  &payload);
}

}  // namespace emu

extern "C" const char* emu_last_error() { return emu::last_error.c_str(); }  // one TU per build

// -- the CUDA built-ins -------------------------------------------------------------------------
#define threadIdx (::emu::self().idx)
#define blockIdx (::emu::tl_block->idx)
#define blockDim (::emu::tl_block->launch->block)
#define gridDim (::emu::tl_block->launch->grid)

#define REFATTN_DYNAMIC_SHARED(type, name) auto name = ::emu::dynamic_shared<type>()
#define REFATTN_UNROLL
#define REFATTN_NO_UNROLL
#ifdef REFATTN_EMU_DEBUG
#define REFATTN_CHECK_INDEX(i, n)                                                     \
    do {                                                                              \
        if ((i) < 0 || (i) >= (n)) ::emu::fail("index %lld out of [0, %lld)",        \
                                               (long long)(i), (long long)(n));       \
    } while (0)
#else
#define REFATTN_CHECK_INDEX(i, n)
#endif

#define REFATTN_EXPORT(name)                                                             \
    extern "C" int emu_launch_##name(const unsigned* grid, const unsigned* block,         \
                                     size_t shared_bytes, void** args,                    \
                                     const EmuOptions* options) {                         \
        return ::emu::launch_kernel(name, grid, block, shared_bytes, args, options);       \
    }

inline void __syncthreads() { ::emu::barrier(::emu::PLAIN, 0); }
inline int __syncthreads_or(int p) { return ::emu::barrier(::emu::OR, p); }
inline int __syncthreads_and(int p) { return ::emu::barrier(::emu::AND, p); }
inline int __syncthreads_count(int p) { return ::emu::barrier(::emu::COUNT, p); }

template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src, int = 32) {
    return ::emu::from_bits<T>(::emu::warp_op(::emu::SHFL, mask, ::emu::to_bits(v), src));
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int = 32) {
    return ::emu::from_bits<T>(::emu::warp_op(::emu::SHFL_XOR, mask, ::emu::to_bits(v),
                                              lane_mask));
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int = 32) {
    return ::emu::from_bits<T>(::emu::warp_op(::emu::SHFL_DOWN, mask, ::emu::to_bits(v),
                                              static_cast<int>(delta)));
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int = 32) {
    return ::emu::from_bits<T>(::emu::warp_op(::emu::SHFL_UP, mask, ::emu::to_bits(v),
                                              static_cast<int>(delta)));
}
inline unsigned __ballot_sync(unsigned mask, int p) {
    return static_cast<unsigned>(::emu::warp_op(::emu::BALLOT, mask, p != 0, 0));
}
inline int __any_sync(unsigned mask, int p) { return __ballot_sync(mask, p) != 0; }
inline int __all_sync(unsigned mask, int p) { return __ballot_sync(mask, p) == mask; }

template <typename T>
inline T atomicAdd(T* address, T value) {
    return __atomic_fetch_add(address, value, __ATOMIC_SEQ_CST);
}
inline double atomicAdd(double* address, double value) {
    double old, desired;
    __atomic_load(address, &old, __ATOMIC_SEQ_CST);
    do {
        desired = old + value;
    } while (!__atomic_compare_exchange(address, &old, &desired, false, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST));
    return old;
}

inline double __longlong_as_double(long long x) { return ::emu::from_bits<double>(x); }
inline long long __double_as_longlong(double x) {
    return static_cast<long long>(::emu::to_bits(x));
}
