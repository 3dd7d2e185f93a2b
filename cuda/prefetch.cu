// Weights pulled into L2 ahead of the product that reads them, while the device runs kernels
// that leave memory idle (the GDN recurrence, attention, norms): that product then reads part of
// its weight from L2 instead of HBM. A hint only: no value anywhere changes.
//
// bytes [p, p + n): grid-stride over `chunk`-byte pieces (16-byte multiples; p 16-byte aligned),
// one bulk prefetch (sm_90, the copy engine of the SM, no registers or shared memory) a piece.
// evict_last: the prefetched lines are kept over others until read (variant _last).
// l2_touch: the same by plain 16-byte loads (ld.global.cg: L2 only) from many warps, a sum no
// one reads kept alive by a store that never happens (n < 0 is never passed).
#include "common.cuh"

__device__ __forceinline__ void bulk_prefetch(const char* p, u32 size) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(size) : "memory");
}
__device__ __forceinline__ void bulk_prefetch_last(const char* p, u32 size, unsigned long long policy) {
    asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;\n" ::"l"(p), "r"(size), "l"(policy)
                 : "memory");
}

extern "C" __global__ void l2_prefetch(const char* __restrict__ p, long n, int chunk) {
    const long stride = (long)gridDim.x * blockDim.x * chunk;
    for (long i = ((long)blockIdx.x * blockDim.x + threadIdx.x) * chunk; i < n; i += stride)
        bulk_prefetch(p + i, (u32)min((long)chunk, n - i));
}

extern "C" __global__ void l2_prefetch_last(const char* __restrict__ p, long n, int chunk) {
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
    const long stride = (long)gridDim.x * blockDim.x * chunk;
    for (long i = ((long)blockIdx.x * blockDim.x + threadIdx.x) * chunk; i < n; i += stride)
        bulk_prefetch_last(p + i, (u32)min((long)chunk, n - i), policy);
}

extern "C" __global__ void l2_touch(const int4* __restrict__ p, long n16, int* __restrict__ sink) {
    constexpr int U = 8;  // loads in flight a thread
    int acc = 0;
    const long stride = (long)gridDim.x * blockDim.x;
    for (long i0 = (long)blockIdx.x * blockDim.x + threadIdx.x; i0 < n16; i0 += U * stride) {
        int x[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const long i = i0 + u * stride;
            x[u] = 0;
            if (i < n16) asm volatile("ld.global.cg.s32 %0, [%1];\n" : "=r"(x[u]) : "l"(p + i));
        }
#pragma unroll
        for (int u = 0; u < U; ++u) acc ^= x[u];
    }
    if (n16 < 0) sink[0] = acc;
}
