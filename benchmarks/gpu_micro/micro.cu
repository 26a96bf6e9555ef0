// Micro-benchmarks of the fp64 pipes that gpu_backend/perf_model.py assumes (issue 43, item 4):
// DMMA m16n8k4 (sm_90) and m8n8k4 (sm_80+) latency and throughput, DFMA beside DMMA (do the
// two share the fp64 datapath?), and the cost of a 16-byte cp.async (issue cycles per copy;
// bandwidth from global to shared memory). Compiled ahead by benchmarks/gpu_micro/micro.py
// (nvcc -cubin, sm_90 and sm_80) and launched from the cubin through CuPy's RawModule.
//
// Every timed loop is bracketed by clock64 in each warp (the SM's cycle counter, read by the
// warp itself), and the kernels write their results to memory so nothing is dead code. The
// instruction counts per loop body are compile-time constants (CHAIN, ACC x STEPS, DFMA_PER,
// COPIES, BW_COPIES) that tests/gpu/test_benchmark_script.py checks in the SASS: a chain of
// CHAIN dependent mma compiles to CHAIN DMMA instructions, not folded.
//
// The mma wrappers are the PTX of gpu_backend/kernels/mma_m16n8k4.cuh and mma_m8n8k4.cuh
// (PTX ISA, "Matrix fragments for mma.m16n8k4 / mma.m8n8k4 with .f64"), written out here so
// that the micro-benchmarks do not change when the kernels' headers do.

#ifndef CHAIN
#define CHAIN 64  // dependent mma per latency loop trip
#endif
#ifndef ACC
#define ACC 8  // independent accumulators of the throughput loops
#endif
#ifndef STEPS
#define STEPS 8  // unrolled steps of ACC mma per throughput loop trip
#endif
#ifndef DFMA_PER
#define DFMA_PER 2  // DFMA per DMMA in the mixed loop (independent chains)
#endif
#ifndef COPIES
#define COPIES 16  // 16-byte cp.async per thread per issue-cost trip
#endif
#ifndef BW_COPIES
#define BW_COPIES 4  // 16-byte cp.async per thread per bandwidth trip (two buffers)
#endif

__device__ __forceinline__ void mma16(double* c, const double* a, double b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mma.sync.aligned.m16n8k4.row.col.f64.f64.f64.f64 {%0, %1, %2, %3}, "
                 "{%4, %5}, {%6}, {%0, %1, %2, %3};\n"
                 : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
                 : "d"(a[0]), "d"(a[1]), "d"(b));
#else
    __trap();  // no m16n8k4 below sm_90: the driver runs the m16 kernels on sm_90+ only
#endif
}

__device__ __forceinline__ void mma8(double* c, double a, double b) {
    asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, "
                 "{%0, %1};\n"
                 : "+d"(c[0]), "+d"(c[1])
                 : "d"(a), "d"(b));
}

__device__ __forceinline__ void dfma(double& x, double a, double b) {
    asm volatile("fma.rn.f64 %0, %1, %2, %0;\n" : "+d"(x) : "d"(a), "d"(b));
}

__device__ __forceinline__ long long now() {
    long long t;
    asm volatile("mov.u64 %0, %%clock64;\n" : "=l"(t)::"memory");
    return t;
}

// cycles[global warp index] = t1 - t0 (lane 0 writes)
__device__ __forceinline__ void record(long long* cycles, long long t0, long long t1) {
    if ((threadIdx.x & 31) == 0)
        cycles[blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)] = t1 - t0;
}

__device__ __forceinline__ void keep(double* out, double value) {
    out[blockIdx.x * blockDim.x + threadIdx.x] = value;
}

// -- latency: CHAIN dependent mma per trip (each reads the C that the previous one wrote) -------
extern "C" __global__ void dmma16_latency(long long* cycles, double* out, int trips) {
    double a[2] = {1.0 + threadIdx.x * 1e-9, 0.5}, c[4] = {0.0, 0.0, 0.0, 0.0};
    const double b = 0.25;
    const long long t0 = now();
#pragma unroll 1
    for (int i = 0; i < trips; ++i) {
#pragma unroll
        for (int j = 0; j < CHAIN; ++j) mma16(c, a, b);
    }
    const long long t1 = now();
    record(cycles, t0, t1);
    keep(out, c[0] + c[1] + c[2] + c[3]);
}

extern "C" __global__ void dmma8_latency(long long* cycles, double* out, int trips) {
    const double a = 1.0 + threadIdx.x * 1e-9, b = 0.25;
    double c[2] = {0.0, 0.0};
    const long long t0 = now();
#pragma unroll 1
    for (int i = 0; i < trips; ++i) {
#pragma unroll
        for (int j = 0; j < CHAIN; ++j) mma8(c, a, b);
    }
    const long long t1 = now();
    record(cycles, t0, t1);
    keep(out, c[0] + c[1]);
}

// -- throughput: ACC independent accumulators, STEPS x ACC mma per trip ---------------------------
extern "C" __global__ void dmma16_throughput(long long* cycles, double* out, int trips) {
    double a[2] = {1.0 + threadIdx.x * 1e-9, 0.5}, c[ACC][4] = {};
    const double b = 0.25;
    const long long t0 = now();
#pragma unroll 1
    for (int i = 0; i < trips; ++i) {
#pragma unroll
        for (int s = 0; s < STEPS; ++s) {
#pragma unroll
            for (int k = 0; k < ACC; ++k) mma16(c[k], a, b);
        }
    }
    const long long t1 = now();
    record(cycles, t0, t1);
    double sum = 0.0;
#pragma unroll
    for (int k = 0; k < ACC; ++k) sum += c[k][0] + c[k][1] + c[k][2] + c[k][3];
    keep(out, sum);
}

extern "C" __global__ void dmma8_throughput(long long* cycles, double* out, int trips) {
    const double a = 1.0 + threadIdx.x * 1e-9, b = 0.25;
    double c[ACC][2] = {};
    const long long t0 = now();
#pragma unroll 1
    for (int i = 0; i < trips; ++i) {
#pragma unroll
        for (int s = 0; s < STEPS; ++s) {
#pragma unroll
            for (int k = 0; k < ACC; ++k) mma8(c[k], a, b);
        }
    }
    const long long t1 = now();
    record(cycles, t0, t1);
    double sum = 0.0;
#pragma unroll
    for (int k = 0; k < ACC; ++k) sum += c[k][0] + c[k][1];
    keep(out, sum);
}

// -- DFMA alone (ACC x DFMA_PER independent chains), and interleaved with the DMMA loop -------------
extern "C" __global__ void dfma_throughput(long long* cycles, double* out, int trips) {
    const double a = 1.0 + threadIdx.x * 1e-9, b = 0.999;
    double f[ACC * DFMA_PER] = {};
    const long long t0 = now();
#pragma unroll 1
    for (int i = 0; i < trips; ++i) {
#pragma unroll
        for (int s = 0; s < STEPS; ++s) {
#pragma unroll
            for (int k = 0; k < ACC * DFMA_PER; ++k) dfma(f[k], a, b);
        }
    }
    const long long t1 = now();
    record(cycles, t0, t1);
    double sum = 0.0;
#pragma unroll
    for (int k = 0; k < ACC * DFMA_PER; ++k) sum += f[k];
    keep(out, sum);
}

template <bool M16>
__device__ __forceinline__ void mixed(long long* cycles, double* out, int trips) {
    double a[2] = {1.0 + threadIdx.x * 1e-9, 0.5}, c[ACC][4] = {}, f[ACC * DFMA_PER] = {};
    const double b = 0.25, fb = 0.999;
    const long long t0 = now();
#pragma unroll 1
    for (int i = 0; i < trips; ++i) {
#pragma unroll
        for (int s = 0; s < STEPS; ++s) {
#pragma unroll
            for (int k = 0; k < ACC; ++k) {
                if constexpr (M16) mma16(c[k], a, b);
                else mma8(c[k], a[0], b);
#pragma unroll
                for (int q = 0; q < DFMA_PER; ++q) dfma(f[k * DFMA_PER + q], a[1], fb);
            }
        }
    }
    const long long t1 = now();
    record(cycles, t0, t1);
    double sum = 0.0;
#pragma unroll
    for (int k = 0; k < ACC; ++k) sum += c[k][0] + c[k][1] + c[k][2] + c[k][3];
#pragma unroll
    for (int k = 0; k < ACC * DFMA_PER; ++k) sum += f[k];
    keep(out, sum);
}

extern "C" __global__ void dmma16_dfma_mixed(long long* cycles, double* out, int trips) {
    mixed<true>(cycles, out, trips);
}

extern "C" __global__ void dmma8_dfma_mixed(long long* cycles, double* out, int trips) {
    mixed<false>(cycles, out, trips);
}

// -- cp.async ---------------------------------------------------------------------------------------
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ unsigned shared_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// issue cost: clock64 around COPIES 16-byte copies per thread (the issue only, before the
// wait), from a source of COPIES x 2 x blockDim.x doubles that stays in L2; summed over trips
extern "C" __global__ void cp_async_issue(long long* cycles, double* out, const double* src,
                                          int trips) {
    extern __shared__ __align__(16) double smem[];
    const unsigned base = shared_address(smem) + 16u * threadIdx.x, stride = 16u * blockDim.x;
    const double* from = src + 2 * threadIdx.x;
    long long total = 0;
#pragma unroll 1
    for (int i = 0; i < trips; ++i) {
        const long long t0 = now();
#pragma unroll
        for (int j = 0; j < COPIES; ++j) cp_async16(base + j * stride, from + j * 2 * blockDim.x);
        const long long t1 = now();
        asm volatile("cp.async.commit_group;\n" ::: "memory");
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        total += t1 - t0;
    }
    __syncthreads();
    record(cycles, 0, total);
    keep(out, smem[2 * threadIdx.x]);
}

// bandwidth: the blocks stream `n` doubles `reps` times (whole block trips of 2 blockDim.x
// BW_COPIES doubles; a buffer that fits in L2 measures L2, a larger one DRAM) through two
// shared buffers per block: trip i's copies in flight while trip i - 1's land (wait_group 1)
extern "C" __global__ void cp_async_bandwidth(long long* cycles, double* out, const double* src,
                                              long long n, int reps) {
    extern __shared__ __align__(16) double smem[];
    const unsigned stride = 16u * blockDim.x, buffer = BW_COPIES * stride;
    const unsigned base = shared_address(smem) + 16u * threadIdx.x;
    const long long chunk = 2LL * blockDim.x * BW_COPIES;  // doubles per block trip
    const long long t0 = now();
    unsigned parity = 0;
    const long long trips = n / chunk;  // whole block trips over the buffer, `reps` times
    for (long long i = blockIdx.x; i < trips * reps; i += gridDim.x) {
        const double* from = src + (i % trips) * chunk + 2 * threadIdx.x;
#pragma unroll
        for (int j = 0; j < BW_COPIES; ++j)
            cp_async16(base + parity * buffer + j * stride, from + j * 2 * blockDim.x);
        asm volatile("cp.async.commit_group;\n" ::: "memory");
        asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        parity ^= 1u;
    }
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    const long long t1 = now();
    __syncthreads();
    record(cycles, t0, t1);
    keep(out, smem[2 * threadIdx.x]);
}
