// Helpers shared by the kernels in this folder. NVRTC finds this header through the -I the host
// passes (the installed openjev.kernels directory).
#pragma once
#include <cuda_bf16.h>

// NVRTC has no <stdint.h>
typedef unsigned int u32;

// Eight bf16 values: one 16-byte load or store, converted to and from fp32. Through uint4: a
// struct of four __nv_bfloat162 is copied member by member (four 4-byte loads a thread, a
// 16-byte stride across a warp: 4x the memory instructions; seen in the SASS, 2026-12-01).
union bf16x8 {
    uint4 u;
    __nv_bfloat162 h[4];
};

__device__ __forceinline__ void load8(const __nv_bfloat16* p, float* f) {
    bf16x8 v;
    v.u = *reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 t = __bfloat1622float2(v.h[i]);
        f[2 * i] = t.x;
        f[2 * i + 1] = t.y;
    }
}

// Four bf16 values from one 8-byte load, as fp32
__device__ __forceinline__ float4 bf16x4_float4(uint2 raw) {
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
    return make_float4(lo.x, lo.y, hi.x, hi.y);
}

__device__ __forceinline__ void store8(__nv_bfloat16* p, const float* f) {
    bf16x8 v;
#pragma unroll
    for (int i = 0; i < 4; ++i) v.h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = v.u;
}

// silu(x) = x / (1 + e^-x) with the fast division (a reciprocal and a product): the IEEE division
// is a refinement, a range check and a branch to a slow path per element, which held the conv
// kernel at 4.5x its memory floor (docs/cuda-kernels.md). Finite x: 1 + e^-x is at least 1, and
// an infinite one (x < -88) gives -0, silu's limit. sigmoid likewise (0 for x < -88).
__device__ __forceinline__ float silu(float x) { return __fdividef(x, 1.f + __expf(-x)); }
__device__ __forceinline__ float sigmoid(float x) { return __fdividef(1.f, 1.f + __expf(-x)); }

// Sum over the 32 lanes of a warp (butterfly: every lane gets the total, in the same order).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Asynchronous 16-byte global -> shared copies (sm_80+): no register round trip. src_bytes = 0
// writes zeros and reads nothing.
__device__ __forceinline__ u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
// 4-byte form (cp.async allows .cg for 16 bytes only)
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
