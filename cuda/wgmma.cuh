// Hopper warpgroup products (wgmma, sm_90a) on bf16 tiles of 64 rows x 256 columns in shared memory.
//
// A tile is laid out the way wgmma's 128-byte swizzle reads it: four blocks of 64 columns (8 KB
// each), a row of a block is 128 bytes, and its 16-byte chunk c sits at chunk c ^ (row & 7). The
// hardware applies that XOR to address bits 4-6 from bits 7-9, so a block must start on a
// 1024-byte boundary. Read along its rows (Q, K: "K-major") a tile is an operand whose summed
// index runs along the row; read along its columns (V in P V: "MN-major") its rows are the summed
// index. Either way 8 rows (1,024 bytes) form one swizzle atom.
#pragma once
#include "common.cuh"

// byte offset of 16-byte chunk c (0-31) of row r in a 64-row tile
__device__ __forceinline__ u32 wg_off(int r, int c) {
    return (u32)((c >> 3) * (64 * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4));
}

// Matrix descriptor (PTX ISA, "matrix descriptor format"): start address, leading and stride
// byte offsets (all >> 4), swizzle mode 1 (128 bytes) in bits 62-63. Operand read along its rows:
// the 16 summed columns of a step lie inside one 128-byte row, so only the stride between 8-row
// groups (1,024 bytes) is used. Operand read along its columns with 64 of them a product: one
// swizzle atom wide, and its 16 summed rows are two 8-row groups 1,024 bytes apart; both offsets
// are set to that, whichever of the two the hardware takes for that direction.
__host__ __device__ __forceinline__ unsigned long long wg_desc(u32 addr, u32 leading) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(leading >> 4) << 16) |
           ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}
__host__ __device__ __forceinline__ unsigned long long wg_desc_rows(u32 addr) { return wg_desc(addr, 16); }
__host__ __device__ __forceinline__ unsigned long long wg_desc_cols(u32 addr) { return wg_desc(addr, 1024); }
// The descriptor of addr + offset from addr's: the start address is the low field (addr >> 4,
// 14 bits), and a shared-memory address plus offset stays below 2^18 bytes, so the sum cannot
// carry out of it. With a constant offset that is one add, where building the descriptor anew is
// ~10 instructions an operand (the mask, the shift, the or).
__host__ __device__ __forceinline__ unsigned long long wg_desc_add(unsigned long long desc, u32 offset) {
    return desc + (offset >> 4);
}

// Accumulators of a m64n64 product: per warp of the warpgroup 16 rows, per thread 32 floats, d[4j + e]
// at row 16 warp + lane / 4 + 8 (e >> 1), column 8j + 2 (lane % 4) + (e & 1) (the mma.sync C layout,
// one n8 tile after another).
#define WG_ACC32(d)                                                                                          \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),    \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),   \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WG_D32                                                                                               \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31}"

// d (64 x 64) = A (64 x 16, rows of a K-major tile) B^T (B: 64 x 16, rows of a K-major tile), plus
// d where `accumulate` (else d is only written)
__device__ __forceinline__ void wgmma_ss(float (&d)[32], unsigned long long a, unsigned long long b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_D32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
        : WG_ACC32(d)
        : "l"(a), "l"(b), "r"(accumulate));
}

// d (64 x 64) += A (64 x 16 in registers: per warp the mma.sync m16n8k16 A fragment) B (16 x 64:
// 16 rows of an MN-major tile)
__device__ __forceinline__ void wgmma_rs(float (&d)[32], u32 a0, u32 a1, u32 a2, u32 a3, unsigned long long b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_D32 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : WG_ACC32(d)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(b), "r"(1));
}

// Before the first wgmma that reads registers the warp wrote (accumulators, A fragments)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler's reads and writes of these registers on their side of a wait or a fence (it
// does not know the products are asynchronous)
__device__ __forceinline__ void wg_pin(float (&d)[32]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Shared memory written through the generic proxy (stores, cp.async) made visible to wgmma's reads;
// each writing thread runs it after its writes landed, before the barrier that publishes them.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
