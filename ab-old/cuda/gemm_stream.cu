// Products of few rows that stream the weight: out[M, N] = x[M, K] @ w[N, K]^T, bf16 in and out,
// fp32 accumulation, on mma.sync m16n8k16 tensor-core steps fed from XOR-swizzled shared memory
// by a cp.async pipeline STAGES k-tiles deep (16-byte copies, BK columns a tile).
//
// Batch invariance: every output element is one fp32 accumulator to which the mma steps add
// 16 columns of k at a time, in increasing k from 0 to K, whatever the variant's tile shape, the
// row count M or the row's place in its tile (an mma's rows do not interact; rows past M are
// loaded as zeros and never stored), then rounded once to bf16 (nearest even). So every variant
// gives a row the same bits at every M. There is no split of K.
//
// A variant is (WM, WN, MI, NI, BK, STAGES): WM x WN warps, each owning MI m16 tiles x NI n8
// tiles, so a block owns BM = 16 WM MI rows of x and BN = 8 WN NI rows of w, BK columns of k a
// pipeline stage. grid (ceil(M / BM), ceil(N / BN)): the row tiles of one weight tile are
// adjacent block indices, so they run together and the weight tile comes from memory once, from
// L2 after that. Dynamic shared memory: STAGES (BM + BN) BK 2 bytes (GemmVariant.smem_bytes).
// Rows of x past M and of w past N are not loaded: their shared memory holds stale values, which
// reach only outputs of those rows and columns (an mma's rows and columns do not mix), never
// stored.
//
// Requires K % BK == 0 (the host checks K % 256 == 0 or picks a BK that divides K), N % 8 == 0,
// x rows and w 16-byte aligned.
#include "common.cuh"

#if !defined(GS_VARIANTS)
#error "compile with the definitions of openjev.worker.cuda.traits"
#endif

typedef __nv_bfloat16 bf16;

// byte offset of 16-byte chunk c of tile row r (rows of BK bf16): rows a multiple of 128 bytes
// apart would put a ldmatrix's eight rows in one bank group; XOR with the row spreads them over
// all eight.
template <int BK>
__device__ __forceinline__ u32 gs_swz(int r, int c) { return (u32)(r * (BK * 2) + ((c ^ (r & 7)) << 4)); }

__device__ __forceinline__ void gs_ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void gs_ldsm_x2(u32 addr, u32& r0, u32& r1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}
__device__ __forceinline__ void gs_mma(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int WM, int WN, int MI, int NI, int BK, int STAGES>
__device__ __forceinline__ void gemm_stream(const bf16* __restrict__ x, long ldx, const bf16* __restrict__ w,
                                            bf16* __restrict__ out, long ldo, int M, int N, int K) {
    constexpr int BM = 16 * WM * MI, BN = 8 * WN * NI, NT = 32 * WM * WN;
    constexpr int CPR = BK / 8;  // 16-byte chunks a tile row
    constexpr int STAGE_BYTES = (BM + BN) * BK * 2;
    constexpr int CHUNKS = (BM + BN) * CPR;  // 16-byte copies a stage
    static_assert(BK % 64 == 0, "tile rows of whole 128-byte swizzle periods");
    constexpr int LOADS = (CHUNKS + NT - 1) / NT;
    static_assert(NI == 1 || NI % 2 == 0, "B fragments load in pairs of n8 tiles (or one)");
    static_assert(STAGES >= 2, "a pipeline");
    extern __shared__ __align__(128) unsigned char smem[];
    const u32 base = smem_addr(smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp / WN, wn = warp % WN;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const int KT = K / BK;

    // This thread's copies of a stage (source row start, destination offset; the same for every
    // k-tile), and which of them exist: rows past M or N and chunks past the tile are skipped.
    const bf16* src[LOADS];
    u32 dst[LOADS];
    unsigned live = 0;
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
        const int i = tid + j * NT, r = i / CPR, c = i % CPR;
        bool ok;
        if (r < BM) {
            ok = m0 + r < M;
            src[j] = x + (long)(ok ? m0 + r : 0) * ldx + c * 8;
        } else {
            ok = r < BM + BN && n0 + (r - BM) < N;
            src[j] = w + (long)(ok ? n0 + (r - BM) : 0) * K + c * 8;
        }
        dst[j] = gs_swz<BK>(r, c);
        if (ok) live |= 1u << j;
    }
    static_assert(LOADS <= 32, "live copies fit a 32-bit mask");
    auto load = [&](int stage, int kt) {
        const u32 s = base + stage * STAGE_BYTES;
#pragma unroll
        for (int j = 0; j < LOADS; ++j)
            if (live & (1u << j)) cp_async16(s + dst[j], src[j] + kt * BK, 16);
    };

    float acc[MI][NI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < KT) load(s, s);
        cp_async_commit();
    }
    // ldmatrix rows of this lane: A (x) rows 0-15 at k chunk 0 or 1; B (w) rows 0-7 (or 8-15
    // for the second n8 tile of a pair) at k chunk 0 or 1.
    const int a_row = wm * 16 * MI + (lane & 15), a_chunk = lane >> 4;
    const int b_row = BM + wn * 8 * NI + (lane & 7) + ((lane >> 4) << 3), b_chunk = (lane >> 3) & 1;
    int stage = 0;
    for (int kt = 0; kt < KT; ++kt) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile kt landed for all; everyone is done with the stage refilled next
        {
            const int next = kt + STAGES - 1;
            int ns = stage + STAGES - 1;
            if (ns >= STAGES) ns -= STAGES;
            if (next < KT) load(ns, next);
            cp_async_commit();
        }
        const u32 s = base + stage * STAGE_BYTES;
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            u32 a[MI][4], b[NI][2];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
                gs_ldsm_x4(s + gs_swz<BK>(a_row + mi * 16, 2 * kk + a_chunk), a[mi][0], a[mi][1], a[mi][2], a[mi][3]);
            if constexpr (NI == 1) {
                gs_ldsm_x2(s + gs_swz<BK>(b_row, 2 * kk + b_chunk), b[0][0], b[0][1]);
            } else {
#pragma unroll
                for (int ni = 0; ni < NI; ni += 2)
                    gs_ldsm_x4(s + gs_swz<BK>(b_row + ni * 8, 2 * kk + b_chunk), b[ni][0], b[ni][1], b[ni + 1][0],
                               b[ni + 1][1]);
            }
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int ni = 0; ni < NI; ++ni) gs_mma(acc[mi][ni], a[mi], b[ni][0], b[ni][1]);
        }
        if (++stage == STAGES) stage = 0;
    }

    // c0, c1: row lane / 4, columns 2 (lane % 4) + {0, 1}; c2, c3: the row 8 below
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
        const int r = m0 + wm * 16 * MI + mi * 16 + (lane >> 2);
#pragma unroll
        for (int ni = 0; ni < NI; ++ni) {
            const int c = n0 + wn * 8 * NI + ni * 8 + 2 * (lane & 3);
            if (c < N) {
                if (r < M)
                    *reinterpret_cast<__nv_bfloat162*>(out + (long)r * ldo + c) =
                        __floats2bfloat162_rn(acc[mi][ni][0], acc[mi][ni][1]);
                if (r + 8 < M)
                    *reinterpret_cast<__nv_bfloat162*>(out + (long)(r + 8) * ldo + c) =
                        __floats2bfloat162_rn(acc[mi][ni][2], acc[mi][ni][3]);
            }
        }
    }
}

// One extern "C" kernel per variant the host lists (traits.GEMM_STREAM), named by its code: the
// decimal digits WM WN MI NI BK/64, then two of STAGES (nvcc would split a definition at commas).
#define GS(CODE)                                                                                       \
    extern "C" __global__ void __launch_bounds__(32 * ((CODE) / 1000000) * ((CODE) / 100000 % 10))  \
        gemm_stream_##CODE(const bf16* __restrict__ x, long ldx, const bf16* __restrict__ w,          \
                           bf16* __restrict__ out, long ldo, int M, int N, int K) {                   \
        gemm_stream<(CODE) / 1000000, (CODE) / 100000 % 10, (CODE) / 10000 % 10, (CODE) / 1000 % 10,  \
                    64 * ((CODE) / 100 % 10), (CODE) % 100>(x, ldx, w, out, ldo, M, N, K);            \
    }
GS_VARIANTS
