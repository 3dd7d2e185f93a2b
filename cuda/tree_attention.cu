// Tree-aware causal attention prefill (GQA, head dim 256), bf16 in, fp32 accumulate, with the
// sigmoid output gate of Qwen3.5's full-attention layers fused into the epilogue.
//
// Each packed segment n has T_n queries and S_n = q_offset_n + T_n logical keys: its ancestors'
// keys first, then its own. Logical key j of segment n lives in row kv_rows[cu_k[n] + j] of the
// K/V pools, so ancestors' keys are read where they already are (no per-segment copies); query i
// sees keys 0 .. q_offset_n + i.
//
// q:       [Tq, Hq, 256] bf16 (normed and rotated)
// k_pool:  [P, Hkv, 256] bf16;  v_pool: [P, Hkv, 256] bf16
// kv_rows: [cu_k[N]] int32;  cu_q, cu_k: [N+1] int32
// gate:    [Tq, Hq, 256] bf16 view (strides gate_st, gate_sh in elements), used if has_gate
// out:     [Tq, Hq, 256] bf16
// tiles:   [slots] int32, attention_tile_plan's: block x computes tile tiles[x] & 0xffff of segment
//          tiles[x] >> 16, or nothing where tiles[x] < 0
// grid (slots, Hkv), block NT (one warpgroup: 4 warps x 16 query rows),
// ATTN_SMEM + 1 KiB (97 KiB) of dynamic shared memory, G = Hq / Hkv.
//
// Why a list of tiles rather than a grid of (max T_n tiles, Hkv, N) blocks: a graph's pass is
// padded to fixed token and segment counts, so most of those blocks had no rows (a 256-token pass
// of 64 segments: 6,240 blocks a layer, of which a few dozen worked), and at one or two blocks an
// SM their launches alone took a good part of a short pass's attention time.
//
// A block's BM query rows are (token, head) pairs of one segment and one KV head: row r of the
// segment is token r / G, query head hkv * G + r % G. The G heads that read one KV head share its
// tiles, so a segment of few tokens (a candidate under a long cached context) loads each K/V tile
// once rather than G times, and fills a tile with G times as many real rows. Every row's
// arithmetic is what it would be in any other block: the key tiles sit at fixed logical
// positions, and a tile past a row's causal limit leaves its running max, sum and output as they
// were (alpha 1, p 0), so results do not depend on how rows are grouped into blocks.
//
// Flash-attention-2 structure on Hopper's warpgroup products (wgmma, sm_90a; cuda/wgmma.cuh):
// S = Q K^T with both operands read from shared memory, O += P V with P from registers, the
// tiles in wgmma's 128-byte swizzled layout. It replaced mma.sync m16n8k16 products fed by
// ldmatrix (1.37-1.59x slower on whole prompts of 512-16,384 tokens; docs/cuda-kernels.md).
//
// Two forms with the same arithmetic (the same bits): tree_attention_fwd loads each K/V tile and
// then computes it, two blocks an SM hiding each other's loads; tree_attention_fwd_pipelined
// keeps two K/V buffers, the next tile's copies in flight while this one computes, one block an
// SM. The pipelined form is faster where few query rows walk many keys (a question under a cached
// context: few blocks, each a long chain of tiles) and slower on whole prompts from 512 tokens
// (docs/cuda-kernels.md): the host picks it for short passes.
#include "common.cuh"
#include "wgmma.cuh"

// Tile sizes come from the host (traits.AttentionTraits), which launches the single-buffered form
// with ATTN_SMEM bytes and the pipelined one with ATTN_SMEM + 2 BN HD (two more K/V tiles), each
// plus the 1,024 bytes that align the tiles to wgmma's swizzle atoms.
#if !defined(ATTN_HEAD_DIM) || !defined(ATTN_BLOCK_Q) || !defined(ATTN_BLOCK_K) || !defined(ATTN_THREADS) || \
    !defined(ATTN_SMEM) || !defined(ATTN_PLAN_THREADS)
#error "compile with the definitions of openjev.worker.cuda.traits"
#endif
#define HD ATTN_HEAD_DIM
#define BM ATTN_BLOCK_Q
#define BN ATTN_BLOCK_K
#define NT ATTN_THREADS
#define CHUNKS (HD * 2 / 16)  // 16-byte chunks per row
static_assert(NT == 32 * BM / 16, "a warp owns 16 query rows");
static_assert((BM + 2 * BN) * HD * 2 == ATTN_SMEM, "shared memory: a Q tile, a K tile and a V tile (bf16)");

// NVRTC has no INFINITY from <math.h>
#define NEG_INF __int_as_float(0xff800000)

// 2^x on the special-function unit alone: results below 2^-126 flush to zero. exp2f adds a range
// test and two multiplies around it to keep such results subnormal (3 of the softmax's ~10
// instructions an element); a weight below 2^-126 of the row's largest (which is 1) is far below
// the resolution of the row's sum, so the output moves by nothing a bf16 result can show.
__device__ __forceinline__ float exp2_ftz(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&v);
}

template <int BUFFERS>
__device__ __forceinline__ void tree_attention(
    const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_pool,
    const __nv_bfloat16* __restrict__ v_pool, const int* __restrict__ kv_rows,
    const int* __restrict__ cu_q, const int* __restrict__ cu_k, int Hq, int Hkv, float scale,
    const __nv_bfloat16* __restrict__ gate, long gate_st, long gate_sh, int has_gate,
    const int* __restrict__ tiles, __nv_bfloat16* __restrict__ out) {
    static_assert(BM == 64 && BN == 64 && NT == 128 && HD % 64 == 0, "one warpgroup, m64 x n64 products");
    constexpr u32 TILE = 64 * HD * 2;
    extern __shared__ __align__(128) unsigned char smem[];
    const u32 sQ = (smem_addr(smem) + 1023u) & ~1023u;  // swizzle atoms on 1,024-byte boundaries
    const u32 sK0 = sQ + TILE;  // BUFFERS K tiles, then BUFFERS V tiles
    const u32 sV0 = sK0 + BUFFERS * TILE;

    const int entry = tiles[blockIdx.x];
    if (entry < 0) return;
    const int n = entry >> 16, hkv = blockIdx.y;
    const int G = Hq / Hkv;
    const int q0 = cu_q[n], Tn = cu_q[n + 1] - q0, Rn = Tn * G;
    const int k0 = cu_k[n], Sn = cu_k[n + 1] - k0;
    const int q_offset = Sn - Tn;
    const int r0 = (entry & 0xffff) * BM;
    if (r0 >= Rn) return;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

    // A thread copies one 16-byte column chunk c of every 4th row, from row `lane_row` on: the
    // copies of a tile cost instructions the products wait for (a K and a V pass over the rows
    // instead of one was 1.2x slower on the whole kernel, 2026-12-01), so the loops are unrolled
    // with the chunk's place fixed per thread.
    static_assert(NT == 128 && CHUNKS == 32, "a warp's lanes are one row's 32 chunks");
    const int chunk = tid & 31, lane_row = tid >> 5;
#pragma unroll
    for (int it = 0; it < BM / 4; ++it) {
        const int r = lane_row + 4 * it;
        const bool ok = r0 + r < Rn;
        const int row = ok ? r0 + r : 0;
        const __nv_bfloat16* src = q + ((long)(q0 + row / G) * Hq + hkv * G + row % G) * HD + chunk * 8;
        cp_async16(sQ + wg_off(r, chunk), src, ok ? 16 : 0);
    }

    const float sl2 = scale * 1.4426950408889634f;
    float o[HD / 64][32];
#pragma unroll
    for (int b = 0; b < HD / 64; ++b)
#pragma unroll
        for (int i = 0; i < 32; ++i) o[b][i] = 0.f;
    float m_r[2] = {NEG_INF, NEG_INF}, l_r[2] = {0.f, 0.f};
    const int g = lane >> 2, t4 = lane & 3;
    const int row_a = r0 + warp * 16 + g;
    const int tok[2] = {row_a / G, (row_a + 8) / G};

    const int last_key = q_offset + (min(r0 + BM, Rn) - 1) / G;
    const int n_tiles = last_key / BN + 1;
    // K and V of key tile kt into buffer b; rows past the segment's keys load zeros. This thread's
    // chunk of pool row p is at base + p * row_stride (the per-copy address arithmetic is what
    // the copies cost in instructions).
    const __nv_bfloat16* k_base = k_pool + hkv * HD + chunk * 8;
    const __nv_bfloat16* v_base = v_pool + hkv * HD + chunk * 8;
    const long row_stride = (long)Hkv * HD;
    auto load_kv = [&](int b, int kt) {
        const int j0 = kt * BN;
        const int* rows = kv_rows + k0 + j0;
#pragma unroll
        for (int it = 0; it < BN / 4; ++it) {
            const int r = lane_row + 4 * it;
            const bool ok = j0 + r < Sn;
            const long off = (ok ? rows[r] : 0) * row_stride;
            const u32 at = b * TILE + wg_off(r, chunk);
            cp_async16(sK0 + at, k_base + off, ok ? 16 : 0);
            cp_async16(sV0 + at, v_base + off, ok ? 16 : 0);
        }
    };
    // BUFFERS 1: load the tile, wait, compute. BUFFERS 2: the next tile copied while this one computes.
    if (BUFFERS == 2) {
        load_kv(0, 0);
        cp_async_commit();
    }
    for (int kt = 0; kt < n_tiles; ++kt) {
        const int j0 = kt * BN, b = BUFFERS == 2 ? kt & 1 : 0;
        const u32 sK = sK0 + b * TILE, sV = sV0 + b * TILE;
        __syncthreads();  // every warp is done with the buffer loaded next
        if (BUFFERS == 2) {
            if (kt + 1 < n_tiles) load_kv(b ^ 1, kt + 1);
            cp_async_commit();  // (empty at the last tile: keeps the wait count uniform)
            cp_async_wait<1>();
        } else {
            load_kv(0, kt);
            cp_async_commit();
            cp_async_wait<0>();
        }
        fence_async_shared();
        __syncthreads();

        // S = Q K^T: 16 steps of 16 columns, both operands K-major (the first step writes S)
        float s[32];
        const unsigned long long dq = wg_desc_rows(sQ), dk = wg_desc_rows(sK);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < HD / 16; ++ks) {
            const u32 at = (ks >> 2) * (64 * 128) + (ks & 3) * 32;
            wgmma_ss(s, wg_desc_add(dq, at), wg_desc_add(dk, at), ks > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wg_pin(s);

        // masks, then the online softmax in base 2: the row maximum is taken before the scale (a
        // positive factor keeps the order; the scale is 1 / sqrt(head dim) > 0, so a masked -inf
        // stays -inf), and each exponent is one fused multiply-add
        const bool need_mask = j0 + BN - 1 > q_offset + r0 / G || j0 + BN > Sn;
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if (need_mask) {
                    const int j = j0 + nt * 8 + 2 * t4 + (e & 1);
                    if (j > q_offset + tok[e >> 1] || j >= Sn) s[4 * nt + e] = NEG_INF;
                }
                mx[e >> 1] = fmaxf(mx[e >> 1], s[4 * nt + e]);
            }
        }
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            const float m_new = fmaxf(m_r[r], mx[r] * sl2);  // finite: key 0 is visible to every row
            alpha[r] = exp2_ftz(m_r[r] - m_new);
            m_r[r] = m_new;
        }
        float rs[2] = {0.f, 0.f};
#pragma unroll
        for (int i = 0; i < 32; ++i) {
            const float p = exp2_ftz(fmaf(s[i], sl2, -m_r[(i >> 1) & 1]));
            s[i] = p;
            rs[(i >> 1) & 1] += p;
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) l_r[r] = l_r[r] * alpha[r] + rs[r];
        // (a product by 1 changes no bit: skipped where no row of the warp has a new maximum)
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
            for (int db = 0; db < HD / 64; ++db)
#pragma unroll
                for (int i = 0; i < 32; ++i) o[db][i] *= alpha[(i >> 1) & 1];
        }

        // O += P V: P's accumulator layout is the A fragment's, 16 keys a step; V MN-major
        u32 pa[BN / 16][4];
#pragma unroll
        for (int ks = 0; ks < BN / 16; ++ks) {
            pa[ks][0] = pack_bf16(s[8 * ks + 0], s[8 * ks + 1]);
            pa[ks][1] = pack_bf16(s[8 * ks + 2], s[8 * ks + 3]);
            pa[ks][2] = pack_bf16(s[8 * ks + 4], s[8 * ks + 5]);
            pa[ks][3] = pack_bf16(s[8 * ks + 6], s[8 * ks + 7]);
        }
        const unsigned long long dv = wg_desc_cols(sV);
#pragma unroll
        for (int db = 0; db < HD / 64; ++db) wg_pin(o[db]);  // the rescale done before the fence
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < BN / 16; ++ks)
#pragma unroll
            for (int db = 0; db < HD / 64; ++db)
                wgmma_rs(o[db], pa[ks][0], pa[ks][1], pa[ks][2], pa[ks][3],
                         wg_desc_add(dv, db * (64 * 128) + ks * 2048));
        wgmma_commit();
        wgmma_wait<0>();
#pragma unroll
        for (int db = 0; db < HD / 64; ++db) wg_pin(o[db]);
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 1);
        l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 2);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row_a + r * 8;
        if (row >= Rn) continue;
        const float inv = 1.f / l_r[r];
        const long t = q0 + tok[r];
        const int h = hkv * G + row % G;
        __nv_bfloat16* dst = out + (t * Hq + h) * HD;
#pragma unroll
        for (int nt = 0; nt < HD / 8; ++nt) {
            const int d = nt * 8 + 2 * t4;
            float x0 = o[nt >> 3][4 * (nt & 7) + 2 * r] * inv, x1 = o[nt >> 3][4 * (nt & 7) + 2 * r + 1] * inv;
            if (has_gate) {
                const float2 gv = __bfloat1622float2(
                    *reinterpret_cast<const __nv_bfloat162*>(gate + t * gate_st + h * gate_sh + d));
                x0 *= sigmoid(gv.x);
                x1 *= sigmoid(gv.y);
            }
            *reinterpret_cast<__nv_bfloat162*>(dst + d) = __floats2bfloat162_rn(x0, x1);
        }
    }
}

#define ATTN_ARGS                                                                                  \
    const __nv_bfloat16 *__restrict__ q, const __nv_bfloat16 *__restrict__ k_pool,                 \
        const __nv_bfloat16 *__restrict__ v_pool, const int *__restrict__ kv_rows,                 \
        const int *__restrict__ cu_q, const int *__restrict__ cu_k, int Hq, int Hkv, float scale,  \
        const __nv_bfloat16 *__restrict__ gate, long gate_st, long gate_sh, int has_gate,          \
        const int *__restrict__ tiles, __nv_bfloat16 *__restrict__ out
#define ATTN_PASS q, k_pool, v_pool, kv_rows, cu_q, cu_k, Hq, Hkv, scale, gate, gate_st, gate_sh, has_gate, tiles, out
extern "C" __global__ void __launch_bounds__(NT, 2) tree_attention_fwd(ATTN_ARGS) { tree_attention<1>(ATTN_PASS); }
extern "C" __global__ void __launch_bounds__(NT, 1) tree_attention_fwd_pipelined(ATTN_ARGS) {
    tree_attention<2>(ATTN_PASS);
}

// The attention blocks' work list for a pass (tree_attention's `tiles`): segment n's
// ceil(T_n G / BM) query tiles, the last (the most keys, under the causal mask) first, segments
// in order, then -1 up to `slots` (at least the tiles' count: Tq G / BM + N). One block of
// ATTN_PLAN_THREADS threads, a segment a thread, ATTN_PLAN_THREADS segments a round.
extern "C" __global__ void __launch_bounds__(ATTN_PLAN_THREADS)
    attention_tile_plan(const int* __restrict__ cu_q, int N, int G, int slots, int* __restrict__ tiles) {
    __shared__ int sums[ATTN_PLAN_THREADS];
    int base = 0;  // tiles of the rounds before
    for (int round = 0; round < N; round += ATTN_PLAN_THREADS) {
        const int n = round + threadIdx.x;
        const int count = n < N ? ((cu_q[n + 1] - cu_q[n]) * G + BM - 1) / BM : 0;
        sums[threadIdx.x] = count;
        __syncthreads();
        for (int step = 1; step < ATTN_PLAN_THREADS; step <<= 1) {  // inclusive prefix sum
            const int add = threadIdx.x >= step ? sums[threadIdx.x - step] : 0;
            __syncthreads();
            sums[threadIdx.x] += add;
            __syncthreads();
        }
        const int at = base + sums[threadIdx.x] - count;
        for (int t = 0; t < count; ++t) tiles[at + t] = (n << 16) | (count - 1 - t);
        base += sums[ATTN_PLAN_THREADS - 1];
        __syncthreads();  // sums is rewritten next round
    }
    for (int i = base + threadIdx.x; i < slots; i += ATTN_PLAN_THREADS) tiles[i] = -1;
}
