// mma.sync m16n8k8 on tf32 with fp32 accumulation over fp32 tiles in shared memory (gdn_chunked.cu):
// fragment loads and stores, tf32 rounding, and a 3xTF32 product at about fp32 accuracy.
#pragma once
#include "common.cuh"

// Fragments (PTX ISA, mma.m16n8k8 .tf32), with g = lane / 4 and t = lane % 4:
//   A (16 x 8): a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4)
//   B (8 x 8):  b0 (t, g), b1 (t + 4, g)
//   C (16 x 8): c0 (g, 2t), c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1)
// Operands come from shared memory by plain loads (WMMA's tf32 fragment loads compile to generic
// loads even from shared memory), rounded to tf32 (nearest, ties away) as WMMA did. An operand
// read by several warps or loop steps is rounded once where it is stored (rnd) and then loaded as
// it is (RAW): the same bits, without 3-4 instructions an element at every use.
struct Lane {
    int g, t;
};
__device__ __forceinline__ Lane lane_of() {
    const int lane = threadIdx.x & 31;
    return {lane >> 2, lane & 3};
}

// cvt.rna.tf32.f32 of a finite x: half an ulp of tf32 added to the magnitude's bits, the 13 low
// bits cleared (what the compiler emits for the cvt, less its guard for inf and NaN).
__device__ __forceinline__ u32 tf32(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }
__device__ __forceinline__ float rnd(float x) { return __uint_as_float(tf32(x)); }

template <bool RAW>
__device__ __forceinline__ u32 operand(float x) {
    return RAW ? __float_as_uint(x) : tf32(x);
}

// A tile whose element (r, k) is p[r * rs + k * ks]
template <bool RAW = false>
__device__ __forceinline__ void load_a(u32 (&a)[4], const float* p, int rs, int ks, Lane l) {
    a[0] = operand<RAW>(p[l.g * rs + l.t * ks]);
    a[1] = operand<RAW>(p[(l.g + 8) * rs + l.t * ks]);
    a[2] = operand<RAW>(p[l.g * rs + (l.t + 4) * ks]);
    a[3] = operand<RAW>(p[(l.g + 8) * rs + (l.t + 4) * ks]);
}

// B tile whose element (k, n) is p[k * ks + n * ns]
template <bool RAW = false>
__device__ __forceinline__ void load_b(u32 (&b)[2], const float* p, int ks, int ns, Lane l) {
    b[0] = operand<RAW>(p[l.t * ks + l.g * ns]);
    b[1] = operand<RAW>(p[(l.t + 4) * ks + l.g * ns]);
}

// C tile whose element (r, n) is p[r * rs + n] (p 8-byte aligned, rs even)
__device__ __forceinline__ void load_c(float (&c)[4], const float* p, int rs, Lane l) {
    const float2 lo = *reinterpret_cast<const float2*>(p + l.g * rs + 2 * l.t);
    const float2 hi = *reinterpret_cast<const float2*>(p + (l.g + 8) * rs + 2 * l.t);
    c[0] = lo.x;
    c[1] = lo.y;
    c[2] = hi.x;
    c[3] = hi.y;
}

__device__ __forceinline__ void store_c(float* p, int rs, const float (&c)[4], Lane l) {
    *reinterpret_cast<float2*>(p + l.g * rs + 2 * l.t) = make_float2(c[0], c[1]);
    *reinterpret_cast<float2*>(p + (l.g + 8) * rs + 2 * l.t) = make_float2(c[2], c[3]);
}

// The same fragments as plain floats (for scaling, or for mma3)
__device__ __forceinline__ void load_af(float (&a)[4], const float* p, int rs, int ks, Lane l) {
    a[0] = p[l.g * rs + l.t * ks];
    a[1] = p[(l.g + 8) * rs + l.t * ks];
    a[2] = p[l.g * rs + (l.t + 4) * ks];
    a[3] = p[(l.g + 8) * rs + (l.t + 4) * ks];
}

__device__ __forceinline__ void load_bf(float (&b)[2], const float* p, int ks, int ns, Lane l) {
    b[0] = p[l.t * ks + l.g * ns];
    b[1] = p[(l.t + 4) * ks + l.g * ns];
}

__device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// c += a b at about fp32 accuracy on tf32 tensor cores: x = hi + lo with hi, lo tf32, and
// hi*hi + hi*lo + lo*hi (the small terms first). For the inverse's block products, where plain
// tf32 operands would add a rounding the scalar substitution does not have.
__device__ __forceinline__ void split(float x, u32& hi, u32& lo) {
    hi = tf32(x);
    lo = tf32(x - __uint_as_float(hi));
}

__device__ __forceinline__ void mma3(float (&c)[4], const float (&a)[4], const float (&b)[2]) {
    u32 ah[4], al[4], bh[2], bl[2];
#pragma unroll
    for (int e = 0; e < 4; ++e) split(a[e], ah[e], al[e]);
#pragma unroll
    for (int e = 0; e < 2; ++e) split(b[e], bh[e], bl[e]);
    mma(c, al, bh);
    mma(c, ah, bl);
    mma(c, ah, bh);
}

// Four 8 x 4 tiles of 32-bit elements in one ldmatrix (moved as pairs of b16: the bits as they
// are): lane L gives the address of row L % 8 of tile L / 8 (16-byte aligned), and register m of
// lane (g, t) receives element (g, t) of tile m: an A fragment, or the B fragments of two tiles
// stored n-major, in one instruction instead of four 32-bit loads.
__device__ __forceinline__ void ldsm4(u32 (&r)[4], const float* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row)));
}

// The A fragment of the 16 x 8 tile at p, row-major (row stride ld floats)
__device__ __forceinline__ void ldsm_a(u32 (&a)[4], const float* p, int ld) {
    const int lane = threadIdx.x & 31, m = lane >> 3;
    ldsm4(a, p + ((m & 1) * 8 + (lane & 7)) * ld + (m >> 1) * 4);
}

// Two B fragments from one ldmatrix: tiles 0-1 into b0, tiles 2-3 into b1
__device__ __forceinline__ void ldsm_b_pair(u32 (&b0)[2], u32 (&b1)[2], const float* row) {
    u32 r[4];
    ldsm4(r, row);
    b0[0] = r[0];
    b0[1] = r[1];
    b1[0] = r[2];
    b1[1] = r[3];
}

// The B fragments of two 8 x 8 tiles side by side (columns n0 .. n0 + 15) whose element (k, n)
// is p[n * ld + k] (stored n-major)
__device__ __forceinline__ void ldsm_b2(u32 (&b0)[2], u32 (&b1)[2], const float* p, int ld) {
    const int lane = threadIdx.x & 31, m = lane >> 3;
    ldsm_b_pair(b0, b1, p + ((m >> 1) * 8 + (lane & 7)) * ld + (m & 1) * 4);
}

// The B fragments of one 8 x 8 tile for two k steps (k0 and k0 + 8) of an n-major tile
// (element (k, n) at p[n * ld + k])
__device__ __forceinline__ void ldsm_b_k2(u32 (&b0)[2], u32 (&b1)[2], const float* p, int ld) {
    const int lane = threadIdx.x & 31;
    ldsm_b_pair(b0, b1, p + (lane & 7) * ld + (lane >> 3) * 4);
}

// C tiles into and out of an n-major tile (element (r, n) at p[n * ld + r]), one float at a time
__device__ __forceinline__ void load_c_t(float (&c)[4], const float* p, int ld, Lane l) {
    c[0] = p[2 * l.t * ld + l.g];
    c[1] = p[(2 * l.t + 1) * ld + l.g];
    c[2] = p[2 * l.t * ld + l.g + 8];
    c[3] = p[(2 * l.t + 1) * ld + l.g + 8];
}

__device__ __forceinline__ void store_c_t(float* p, int ld, const float (&c)[4], Lane l) {
    p[2 * l.t * ld + l.g] = c[0];
    p[(2 * l.t + 1) * ld + l.g] = c[1];
    p[2 * l.t * ld + l.g + 8] = c[2];
    p[(2 * l.t + 1) * ld + l.g + 8] = c[3];
}
