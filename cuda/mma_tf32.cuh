// mma.sync m16n8k8 on tf32 (and m16n8k16 on fp16) with fp32 accumulation (gdn_chunked.cu):
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

// mma.sync m16n8k16 on fp16 with fp32 accumulation (the output pass). Fragments (PTX ISA,
// .f16), two halves a register, the lower one first:
//   A (16 x 16): {(g, 2t), (g, 2t + 1)}, {(g + 8, 2t), ...}, {(g, 2t + 8), ...}, {(g + 8, 2t + 8), ...}
//   B (16 x 8):  {(2t, g), (2t + 1, g)}, {(2t + 8, g), (2t + 9, g)}
//   C as for m16n8k8 above.
// A tf32 value (10 explicit mantissa bits, as fp16's) is held exactly in fp16 wherever it lies in
// fp16's normal range, so the tiles are stored with power-of-two scales that put them there.
typedef unsigned short f16_t;

__device__ __forceinline__ void mma16(float (&c)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ f16_t to_f16(float x) {
    f16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

// two values as one register: lo in the lower half
__device__ __forceinline__ u32 pack_f16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// 2^k for k in [-126, 127]
__device__ __forceinline__ float exp2i(int k) { return __int_as_float((k + 127) << 23); }

// A row-major 16 x 16 A tile of fp16 at p (row stride ld halves, even)
__device__ __forceinline__ void load_a16(u32 (&a)[4], const f16_t* p, int ld, Lane l) {
    a[0] = *reinterpret_cast<const u32*>(p + l.g * ld + 2 * l.t);
    a[1] = *reinterpret_cast<const u32*>(p + (l.g + 8) * ld + 2 * l.t);
    a[2] = *reinterpret_cast<const u32*>(p + l.g * ld + 2 * l.t + 8);
    a[3] = *reinterpret_cast<const u32*>(p + (l.g + 8) * ld + 2 * l.t + 8);
}

// A 16 x 8 B tile whose element (k, n) is p[n * ld + k] (B stored transposed: n-major)
__device__ __forceinline__ void load_b16(u32 (&b)[2], const f16_t* p, int ld, Lane l) {
    b[0] = *reinterpret_cast<const u32*>(p + l.g * ld + 2 * l.t);
    b[1] = *reinterpret_cast<const u32*>(p + l.g * ld + 2 * l.t + 8);
}

// The exponent e of a (16-row tile, column)'s scale 2^e: the largest magnitude m lands in
// [2^14, 2^15) once divided by it (fp16 reaches 65504), so every tf32 value of the column within
// 2^-28 of m keeps its bits; e in [-116, 114], so that 2^(e - 10) is a normal float too.
__device__ __forceinline__ int tile_exponent(float m) {
    const int biased = (__float_as_uint(m) >> 23) & 0xff;
    return m == 0.f ? 0 : max(biased - 127 - 14, -116);
}

// One C tile (rows r0 .. r0 + 15, columns n0 .. n0 + 7; values already tf32-rounded) into an fp16
// matrix stored transposed (element (r, n) at dst[n * ld + r]), each (16-row tile, column) divided
// by its scale 2^e, e at exps[(r0 / 16) * ecols + n] (int8). A scale depends on the tile's values
// only, so the stored bits do not depend on the launch.
__device__ __forceinline__ void store_scaled_t(f16_t* dst, int ld, signed char* exps, int ecols, int r0, int n0,
                                               const float (&c)[4], Lane l) {
    float m0 = fmaxf(fabsf(c[0]), fabsf(c[2])), m1 = fmaxf(fabsf(c[1]), fabsf(c[3]));
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {  // over the 8 lanes of the same t: all 16 rows
        m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, o));
        m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, o));
    }
    const int e0 = tile_exponent(m0), e1 = tile_exponent(m1);
    const float s0 = exp2i(-e0), s1 = exp2i(-e1);
    const int n = n0 + 2 * l.t, r = r0 + l.g;
    dst[n * ld + r] = to_f16(c[0] * s0);
    dst[(n + 1) * ld + r] = to_f16(c[1] * s1);
    dst[n * ld + r + 8] = to_f16(c[2] * s0);
    dst[(n + 1) * ld + r + 8] = to_f16(c[3] * s1);
    if (l.g == 0) {
        exps[(r0 / 16) * ecols + n] = (signed char)e0;
        exps[(r0 / 16) * ecols + n + 1] = (signed char)e1;
    }
}
