// Chunked Gated DeltaNet prefill over packed segments, with chunks at absolute positions.
//
// The delta rule over a chunk of C = 64 tokens in matrix (WY) form, on TF32 tensor cores with
// fp32 accumulation and an fp32 state (the math: worker/model/ops.py, _delta_rule_chunk):
//   G = cumsum(g);  A[i][j] = beta_i e^{G_i - G_j} (k_i . k_j) for j < i;  T = (I + A)^-1
//   W = T (beta e^G K);  U~ = T (beta V)                      (gdn_chunk_solve, all chunks at once)
//   U = U~ - W S_c;  S_{c+1} = e^{G_C} S_c + (e^{G_C - G_j} K)^T U   (gdn_chunk_state: chunk after chunk)
//   O = (e^G Q) S_c + (Q K^T . e^{G_i - G_j}, j <= i) U        (gdn_chunk_out, all chunks at once)
// Only the state recurrence is sequential: its pass does the two products that chain S from
// chunk to chunk, splitting the value columns over blocks, and stores each chunk's start state
// S_c and U for the output pass, which spreads every (chunk, head) over the GPU.
//
// Why chunks sit at absolute positions (multiples of 64 from the sequence start): a chunk sums
// its tokens in another order than the token recurrence, so a prefix that ended inside a chunk
// would give its children other bits than the unsplit prompt (policy `off`) gets, and the exact
// policy gates would fail. So a segment's kept state is the state at its last chunk boundary plus
// the rows of its unfinished chunk (k, v, g, beta: the "tail", at most 63 rows); a child's first
// chunk is that tail followed by its own tokens, computed exactly as under `off`: every value of
// a row depends only on rows at or before it, and the missing rows are zeros that only ever meet
// exact zeros (T and the causal masks are zero above the diagonal).
//
// A segment n starts at position pos[cu[n]]; its virtual rows are tail (pos mod 64 rows, from
// tail_in[n]) then its own cu[n+1] - cu[n] tokens. Row layout of a tail buffer (fp32):
//   [k: Hk*128 | v: H*128 | g: H | beta: H]  (tail_width floats a row, 64 rows a segment).
#include <mma.h>

#include "common.cuh"

using namespace nvcuda;

// Sizes and padded row strides come from the host (traits.GdnChunkTraits), which launches the
// kernels with GDN_SOLVE_SMEM, GDN_STATE_SMEM and GDN_OUT_SMEM bytes of dynamic shared memory.
#if !defined(GDN_CHUNK) || !defined(GDN_DIM) || !defined(GDN_CHUNK_THREADS) || !defined(GDN_STATE_COLS) || \
    !defined(GDN_LK) || !defined(GDN_LC) || !defined(GDN_LB) || !defined(GDN_SOLVE_SMEM) || !defined(GDN_STATE_SMEM) || \
    !defined(GDN_OUT_SMEM)
#error "compile with the definitions of openjev.worker.cuda.traits"
#endif
#define CH GDN_CHUNK          // chunk length
#define D GDN_DIM             // key and value head dims
#define NT GDN_CHUNK_THREADS  // threads a block of the solve and output kernels (8 warps)
#define NCOL GDN_STATE_COLS   // value columns a gdn_chunk_state block owns
#define LK GDN_LK             // padded row strides (floats): rows start in different banks, 32-byte aligned tiles
#define LC GDN_LC
#define LB GDN_LB

// The buffers each kernel carves from its dynamic shared memory, as laid out below.
static_assert(4 * (CH * LK + CH * LB + 3 * CH * LC + 2 * CH) == GDN_SOLVE_SMEM, "gdn_chunk_solve layout");
// gdn_chunk_state: the state columns, then two buffers of one chunk's W, K, U and G
static_assert(4 * (D * LC + 2 * (2 * CH * LK + CH * LC + CH)) == GDN_STATE_SMEM, "gdn_chunk_state layout");
static_assert(4 * (2 * CH * LK + CH) == GDN_OUT_SMEM, "gdn_chunk_out layout");
static_assert(NCOL == CH, "the state pass stores its state columns with the chunk stride LC");
static_assert(NT == 32 * (D / 16), "gdn_chunk_out: one warp a 16-column strip of the output");
static_assert(LK >= D && LC >= CH && LB >= 2 * D && LK % 4 == 0 && LC % 4 == 0 && LB % 4 == 0,
              "rows hold a tile row and keep 16-byte alignment");

typedef wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> FragA;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::col_major> FragAT;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major> FragB;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major> FragBT;
typedef wmma::fragment<wmma::accumulator, 16, 16, 8, float> Acc;

template <typename F>
__device__ __forceinline__ void to_tf32(F& f) {
#pragma unroll
    for (int t = 0; t < f.num_elements; ++t) f.x[t] = wmma::__float_to_tf32(f.x[t]);
}

// acc += A B over K (a multiple of 8) in tf32. a, b point at the tiles' k = 0 corners; a_step,
// b_step: how far one step of k moves in memory (1 along a row, the leading dimension across).
template <typename FA, typename FB>
__device__ __forceinline__ void mma_k(Acc& acc, const float* a, int lda, int a_step, const float* b, int ldb,
                                      int b_step, int K) {
    for (int k0 = 0; k0 < K; k0 += 8) {
        FA fa;
        FB fb;
        wmma::load_matrix_sync(fa, a + k0 * a_step, lda);
        wmma::load_matrix_sync(fb, b + k0 * b_step, ldb);
        to_tf32(fa);
        to_tf32(fb);
        wmma::mma_sync(acc, fa, fb, acc);
    }
}

// Segment n's row count (tail + own), chunk count (capped), and first scratch chunk.
struct Seg {
    int start, own, tail, rows, chunks, first;
};

__device__ __forceinline__ Seg segment(const int* cu, const int* pos, int n, int max_chunks) {
    Seg s;
    int first = 0;
    for (int m = 0; m <= n; ++m) {
        const int a = cu[m], own = cu[m + 1] - a;
        const int tail = own > 0 ? (pos[a] & (CH - 1)) : 0;
        const int chunks = own > 0 ? min((tail + own + CH - 1) / CH, max_chunks) : 0;
        if (m == n) {
            s.start = a; s.own = own; s.tail = tail; s.rows = tail + own; s.chunks = chunks; s.first = first;
        }
        first += chunks;
    }
    return s;
}

// 16 bytes global -> shared without a register round trip; zeros where !valid (src then unread).
// Every thread issues all of a chunk's copies before waiting: a block per SM (the shared memory
// these kernels take) cannot hide one load's latency at a time, which is what plain loads did.
__device__ __forceinline__ void cp_async16(float* dst, const float* src, bool valid) {
    cp_async16(smem_addr(dst), src, valid ? 16 : 0);
}

__device__ __forceinline__ void cp_async_wait_all() {
    cp_async_commit();
    cp_async_wait<0>();
}

// One chunk's k rows [64][LK] of key head hk from the tail or the packed rows (zeros past the
// end), as asynchronous copies by NTH threads: the caller waits and syncs.
template <int NTH = NT>
__device__ __forceinline__ void load_k(float* Ks, const float* __restrict__ kn, const float* __restrict__ tail_in,
                                       long tail_width, const Seg& s, int r0, int n, int hk, int Hk) {
#pragma unroll
    for (int it = 0; it < CH * (D / 4) / NTH; ++it) {
        const int idx = threadIdx.x + it * NTH;
        const int r = idx / (D / 4), d = (idx % (D / 4)) * 4, vr = r0 + r;
        const bool ok = vr < s.rows;
        const float* src = !ok ? kn
                           : vr < s.tail ? tail_in + ((long)n * CH + vr) * tail_width + hk * D + d
                                         : kn + ((long)(s.start + vr - s.tail) * Hk + hk) * D + d;
        cp_async16(Ks + r * LK + d, src, ok);
    }
}

// grid (max_chunks, H, N), block NT, dynamic shared memory GDN_SOLVE_SMEM.
// W, U: [chunks, H, 64, 128] fp32 scratch; gcum: [chunks, H, 64] fp32.
// tail_out[n]: the rows of segment n's unfinished last chunk (written where there is one).
extern "C" __global__ void __launch_bounds__(NT) gdn_chunk_solve(
    const float* __restrict__ kn, const __nv_bfloat16* __restrict__ v, long v_stride,
    const float* __restrict__ g, const float* __restrict__ beta, const int* __restrict__ cu,
    const int* __restrict__ pos, int H, int Hk, int max_chunks, const float* __restrict__ tail_in,
    float* __restrict__ tail_out, long tail_width, float* __restrict__ W, float* __restrict__ U,
    float* __restrict__ gcum) {
    extern __shared__ __align__(128) float smem[];
    float* Ks = smem;             // [64][LK]   k rows
    float* Bs = Ks + CH * LK;     // [64][LB]   beta e^G k | beta v (first raw v)
    float* As = Bs + CH * LB;     // [64][LC]   k k^T, then A
    float* Ts = As + CH * LC;     // [64][LC]   (I + A)^-1
    float* Xs = Ts + CH * LC;     // [64][LC]   block products of the inverse
    float* gs = Xs + CH * LC;     // [64] g, then G
    float* bs = gs + CH;          // [64] beta

    const int c = blockIdx.x, h = blockIdx.y, n = blockIdx.z, hk = h / (H / Hk);
    const Seg s = segment(cu, pos, n, max_chunks);
    if (c >= s.chunks) return;
    const int r0 = c * CH, valid = min(CH, s.rows - r0);
    const bool unfinished = valid < CH;  // only a segment's last chunk can be
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

    load_k(Ks, kn, tail_in, tail_width, s, r0, n, hk, Hk);
#pragma unroll
    for (int it = 0; it < CH * (D / 4) / NT; ++it) {  // v rows: 4 values a thread per step
        const int idx = tid + it * NT;
        const int r = idx / (D / 4), d = (idx % (D / 4)) * 4, vr = r0 + r;
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (vr < s.rows) {
            if (vr < s.tail) {
                x = *reinterpret_cast<const float4*>(tail_in + ((long)n * CH + vr) * tail_width + Hk * D + h * D + d);
            } else {
                const uint2 raw = *reinterpret_cast<const uint2*>(v + (long)(s.start + vr - s.tail) * v_stride + h * D + d);
                const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
                const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
                x = make_float4(lo.x, lo.y, hi.x, hi.y);
            }
        }
        *reinterpret_cast<float4*>(Bs + r * LB + D + d) = x;
    }
    if (tid < CH) {
        const int vr = r0 + tid;
        float gv = 0.f, bv = 0.f;
        if (vr < s.rows) {
            if (vr < s.tail) {
                const float* row = tail_in + ((long)n * CH + vr) * tail_width + Hk * D + H * D;
                gv = row[h];
                bv = row[H + h];
            } else {
                gv = g[(long)(s.start + vr - s.tail) * H + h];
                bv = beta[(long)(s.start + vr - s.tail) * H + h];
            }
        }
        gs[tid] = gv;
        bs[tid] = bv;
    }
    cp_async_wait_all();
    __syncthreads();

    if (unfinished) {  // keep the unfinished chunk's rows for the children (before any scaling)
        float* out = tail_out + (long)n * CH * tail_width;
        for (int idx = tid; idx < valid * D; idx += NT) {
            const int r = idx / D, d = idx % D;
            if (h % (H / Hk) == 0) out[r * tail_width + hk * D + d] = Ks[r * LK + d];
            out[r * tail_width + Hk * D + h * D + d] = Bs[r * LB + D + d];
        }
        if (tid < valid) {
            out[tid * tail_width + Hk * D + H * D + h] = gs[tid];
            out[tid * tail_width + Hk * D + H * D + H + h] = bs[tid];
        }
    }
    __syncthreads();  // the tail rows above read g before it becomes G
    if (tid == 0) {  // G: a prefix sum in row order, so row i's value never depends on later rows
        float acc = 0.f;
        for (int r = 0; r < CH; ++r) {
            acc += gs[r];
            gs[r] = acc;
        }
    }
    // k k^T, lower 16x16 tiles only (10 of 16)
    for (int tile = warp; tile < 16; tile += NT / 32) {
        const int ti = tile >> 2, tj = tile & 3;
        if (tj > ti) continue;
        Acc acc;
        wmma::fill_fragment(acc, 0.f);
        mma_k<FragA, FragBT>(acc, Ks + ti * 16 * LK, LK, 1, Ks + tj * 16 * LK, LK, 1, D);
        wmma::store_matrix_sync(As + ti * 16 * LC + tj * 16, acc, LC, wmma::mem_row_major);
    }
    __syncthreads();
    for (int idx = tid; idx < CH * CH; idx += NT) {
        const int i = idx / CH, j = idx % CH;
        As[i * LC + j] = j < i ? bs[i] * __expf(gs[i] - gs[j]) * As[i * LC + j] : 0.f;
    }
    for (int idx = tid; idx < CH * D; idx += NT) {
        const int r = idx / D, d = idx % D;
        Bs[r * LB + d] = bs[r] * __expf(gs[r]) * Ks[r * LK + d];
        Bs[r * LB + D + d] *= bs[r];
    }
    __syncthreads();

    // T = (I + A)^-1 by 16x16 blocks. Diagonal blocks by forward substitution, a warp each
    // (lane: column c = lane & 15, half of the sum = lane >> 4); fixed summation orders.
    if (warp < 4) {
        const int b0 = warp * 16, col = lane & 15, half = lane >> 4;
        for (int i = 0; i < 16; ++i) {
            float acc = 0.f;
            for (int j = col + half; j < i; j += 2) acc = fmaf(As[(b0 + i) * LC + b0 + j], Ts[(b0 + j) * LC + b0 + col], acc);
            acc += __shfl_xor_sync(0xffffffffu, acc, 16);
            if (half == 0) Ts[(b0 + i) * LC + b0 + col] = (col == i ? 1.f : 0.f) - acc;
            __syncwarp();
        }
    }
    // zero the blocks above the diagonal
    for (int idx = tid; idx < CH * CH; idx += NT) {
        const int i = idx / CH, j = idx % CH;
        if ((j >> 4) > (i >> 4)) Ts[i * LC + j] = 0.f;
    }
    __syncthreads();
    // off-diagonal blocks, one distance at a time: T_ij = -T_ii sum_{k=j}^{i-1} A_ik T_kj
    for (int dist = 1; dist < 4; ++dist) {
        const int pairs = 4 - dist;
        for (int idx = tid; idx < pairs * 256; idx += NT) {
            const int bi = dist + idx / 256, bj = bi - dist, r = (idx % 256) >> 4, col = idx & 15;
            float acc = 0.f;
            for (int kk = bj * 16; kk < bi * 16; ++kk)
                acc = fmaf(As[(bi * 16 + r) * LC + kk], Ts[kk * LC + bj * 16 + col], acc);
            Xs[(bi * 16 + r) * LC + bj * 16 + col] = acc;
        }
        __syncthreads();
        for (int idx = tid; idx < pairs * 256; idx += NT) {
            const int bi = dist + idx / 256, bj = bi - dist, r = (idx % 256) >> 4, col = idx & 15;
            float acc = 0.f;
            for (int m = 0; m <= r; ++m)
                acc = fmaf(Ts[(bi * 16 + r) * LC + bi * 16 + m], Xs[(bi * 16 + m) * LC + bj * 16 + col], acc);
            Ts[(bi * 16 + r) * LC + bj * 16 + col] = -acc;
        }
        __syncthreads();
    }

    // [W | U~] = T [beta e^G K | beta V]: 4 x 16 output tiles, 8 a warp, straight to the scratch
    const long slot = (long)(s.first + c) * H + h;
    for (int tile = warp; tile < 64; tile += NT / 32) {
        const int ti = tile >> 4, tj = tile & 15;
        Acc acc;
        wmma::fill_fragment(acc, 0.f);
        // written out rather than through mma_k, which orders this product's address arithmetic
        // differently: this form is the machine code the GPU tests cover
        for (int k0 = 0; k0 < CH; k0 += 8) {
            FragA a;
            FragB b;
            wmma::load_matrix_sync(a, Ts + ti * 16 * LC + k0, LC);
            wmma::load_matrix_sync(b, Bs + k0 * LB + tj * 16, LB);
            to_tf32(a);
            to_tf32(b);
            wmma::mma_sync(acc, a, b, acc);
        }
        float* dst = (tj < 8 ? W : U) + slot * CH * D + ti * 16 * D + (tj & 7) * 16;
        wmma::store_matrix_sync(dst, acc, D, wmma::mem_row_major);
    }
    if (tid < CH) gcum[slot * CH + tid] = gs[tid];
}

// The sequential pass, grid (D / NCOL, H, N), block NTH, dynamic shared memory GDN_STATE_SMEM.
// Per chunk only U = U~ - W S and, for a finished chunk, S <- e^{G_C} S + K~^T U; the next
// chunk's W, K, U~ and G are copied in while this one computes (two buffers). It stores S_c
// (the state at the chunk's start, [slots, H, 128, 128]) and U (over U~, in place) for
// gdn_chunk_out. init_state, final_state: [N, H, 128, 128] fp32; final = the state at the
// segment's last chunk boundary.
template <int NTH>
__device__ __forceinline__ void chunk_state(const float* __restrict__ kn, const float* __restrict__ W,
                                            float* __restrict__ U, const float* __restrict__ gcum,
                                            const int* __restrict__ cu, const int* __restrict__ pos, int H, int Hk,
                                            int max_chunks, const float* __restrict__ tail_in, long tail_width,
                                            const float* __restrict__ init_state, int has_init,
                                            float* __restrict__ Sc, float* __restrict__ final_state) {
    extern __shared__ __align__(128) float state_smem[];
    constexpr int BUF = 2 * CH * LK + CH * LC + CH;  // one chunk: W [64][LK], K [64][LK], U [64][LC], G [64]
    constexpr int TJ = NCOL / 16;                     // 16-column tiles of the state a block owns
    float* Ss = state_smem;                           // [128][LC] state columns col0 .. col0 + NCOL - 1

    const int col0 = blockIdx.x * NCOL, h = blockIdx.y, n = blockIdx.z, hk = h / (H / Hk);
    const int tid = threadIdx.x, warp = tid >> 5;
    const Seg s = segment(cu, pos, n, max_chunks);
    const long state_base = ((long)n * H + h) * D * D;

    // chunk c's copies into buffer c & 1, one cp.async group
    auto issue = [&](int c) {
        float* Wb = Ss + D * LC + (c & 1) * BUF;
        float* Kb = Wb + CH * LK;
        float* Ub = Kb + CH * LK;
        float* gb = Ub + CH * LC;
        const long slot = (long)(s.first + c) * H + h;
        load_k<NTH>(Kb, kn, tail_in, tail_width, s, c * CH, n, hk, Hk);
#pragma unroll
        for (int it = 0; it < CH * (D / 4) / NTH; ++it) {
            const int idx = tid + it * NTH;
            const int r = idx / (D / 4), d = (idx % (D / 4)) * 4;
            cp_async16(Wb + r * LK + d, W + (slot * CH + r) * D + d, true);
        }
#pragma unroll
        for (int it = 0; it < CH * (NCOL / 4) / NTH; ++it) {
            const int idx = tid + it * NTH;
            const int r = idx / (NCOL / 4), d = (idx % (NCOL / 4)) * 4;
            cp_async16(Ub + r * LC + d, U + (slot * CH + r) * D + col0 + d, true);
        }
        if (tid < CH / 4) cp_async16(gb + tid * 4, gcum + slot * CH + tid * 4, true);
        cp_async_commit();
    };

    for (int idx = tid; idx < D * NCOL; idx += NTH) {
        const int i = idx / NCOL, j = idx % NCOL;
        Ss[i * LC + j] = has_init ? init_state[state_base + (long)i * D + col0 + j] : 0.f;
    }
    if (s.chunks > 0) issue(0);
    for (int c = 0; c < s.chunks; ++c) {
        // the other buffer was last read by chunk c - 1, which ended with a barrier
        if (c + 1 < s.chunks) issue(c + 1);
        else cp_async_commit();  // an empty group keeps "all but the newest" meaning chunk c
        cp_async_wait<1>();
        __syncthreads();
        float* Wb = Ss + D * LC + (c & 1) * BUF;
        float* Kb = Wb + CH * LK;
        float* Ub = Kb + CH * LK;
        const float* gb = Ub + CH * LC;
        const long slot = (long)(s.first + c) * H + h;
        const float g_end = gb[CH - 1];
        // S_c for the output pass
        for (int idx = tid; idx < D * (NCOL / 4); idx += NTH) {
            const int i = idx / (NCOL / 4), j = (idx % (NCOL / 4)) * 4;
            *reinterpret_cast<float4*>(Sc + (slot * D + i) * D + col0 + j) = *reinterpret_cast<const float4*>(Ss + i * LC + j);
        }
        // K~ = e^{G_C - G} K in place: only the update below reads it
        for (int idx = tid; idx < CH * (D / 4); idx += NTH) {
            const int r = idx / (D / 4), d = (idx % (D / 4)) * 4;
            const float e = __expf(g_end - gb[r]);
            float4* p = reinterpret_cast<float4*>(Kb + r * LK + d);
            float4 x = *p;
            x.x *= e;
            x.y *= e;
            x.z *= e;
            x.w *= e;
            *p = x;
        }
        {  // U = U~ - W S: a warp one 16-row tile by TPW column tiles (W fragments shared)
            constexpr int TPW = (CH / 16) * TJ / (NTH / 32);
            static_assert(TPW >= 1 && TJ % TPW == 0, "whole column groups a warp");
            const int t0 = warp * TPW, ti = t0 / TJ, tj0 = t0 % TJ;
            Acc u[TPW];
#pragma unroll
            for (int t = 0; t < TPW; ++t)
                wmma::load_matrix_sync(u[t], Ub + ti * 16 * LC + (tj0 + t) * 16, LC, wmma::mem_row_major);
#pragma unroll 4
            for (int k0 = 0; k0 < D; k0 += 8) {
                FragA w;
                wmma::load_matrix_sync(w, Wb + ti * 16 * LK + k0, LK);
#pragma unroll
                for (int e = 0; e < w.num_elements; ++e) w.x[e] = -wmma::__float_to_tf32(w.x[e]);
#pragma unroll
                for (int t = 0; t < TPW; ++t) {
                    FragB st;
                    wmma::load_matrix_sync(st, Ss + k0 * LC + (tj0 + t) * 16, LC);
                    to_tf32(st);
                    wmma::mma_sync(u[t], w, st, u[t]);
                }
            }
#pragma unroll
            for (int t = 0; t < TPW; ++t) {
                wmma::store_matrix_sync(Ub + ti * 16 * LC + (tj0 + t) * 16, u[t], LC, wmma::mem_row_major);
                wmma::store_matrix_sync(U + (slot * CH + ti * 16) * D + col0 + (tj0 + t) * 16, u[t], D,
                                        wmma::mem_row_major);
            }
        }
        __syncthreads();
        if (s.rows - c * CH >= CH) {  // a finished chunk: S <- e^{G_C} S + K~^T U
            constexpr int TPB = (D / 16) * TJ / (NTH / 32);
            static_assert(TPB >= 1 && TJ % TPB == 0, "whole column groups a warp");
            const int t0 = warp * TPB, ti = t0 / TJ, tj0 = t0 % TJ;
            const float decay = __expf(g_end);
            Acc st[TPB];
#pragma unroll
            for (int t = 0; t < TPB; ++t) {
                wmma::load_matrix_sync(st[t], Ss + ti * 16 * LC + (tj0 + t) * 16, LC, wmma::mem_row_major);
#pragma unroll
                for (int e = 0; e < st[t].num_elements; ++e) st[t].x[e] *= decay;
            }
#pragma unroll 2
            for (int k0 = 0; k0 < CH; k0 += 8) {
                FragAT a;
                wmma::load_matrix_sync(a, Kb + k0 * LK + ti * 16, LK);
                to_tf32(a);
#pragma unroll
                for (int t = 0; t < TPB; ++t) {
                    FragB b;
                    wmma::load_matrix_sync(b, Ub + k0 * LC + (tj0 + t) * 16, LC);
                    to_tf32(b);
                    wmma::mma_sync(st[t], a, b, st[t]);
                }
            }
#pragma unroll
            for (int t = 0; t < TPB; ++t)
                wmma::store_matrix_sync(Ss + ti * 16 * LC + (tj0 + t) * 16, st[t], LC, wmma::mem_row_major);
        }
        __syncthreads();  // this buffer and the state are done before the next chunk's copies and products
    }
    __syncthreads();
    for (int idx = tid; idx < D * NCOL; idx += NTH) {
        const int i = idx / NCOL, j = idx % NCOL;
        final_state[state_base + (long)i * D + col0 + j] = Ss[i * LC + j];
    }
}

#define GDN_CHUNK_STATE(NAME, NTH)                                                                                   \
    extern "C" __global__ void __launch_bounds__(NTH) NAME(                                                          \
        const float* __restrict__ kn, const float* __restrict__ W, float* __restrict__ U,                           \
        const float* __restrict__ gcum, const int* __restrict__ cu, const int* __restrict__ pos, int H, int Hk,     \
        int max_chunks, const float* __restrict__ tail_in, long tail_width, const float* __restrict__ init_state,   \
        int has_init, float* __restrict__ Sc, float* __restrict__ final_state) {                                    \
        chunk_state<NTH>(kn, W, U, gcum, cu, pos, H, Hk, max_chunks, tail_in, tail_width, init_state, has_init, Sc, \
                         final_state);                                                                              \
    }
GDN_CHUNK_STATE(gdn_chunk_state_w8, 256)
GDN_CHUNK_STATE(gdn_chunk_state_w16, 512)

// The output pass, grid (max_chunks, H, N), block NT, dynamic shared memory GDN_OUT_SMEM: every
// chunk of every head at once, from S_c and U of gdn_chunk_state. out: [T, H, 128] bf16, own
// rows only (tail rows have no query here: their outputs belong to the parent).
extern "C" __global__ void __launch_bounds__(NT, 2) gdn_chunk_out(
    const float* __restrict__ qn, const float* __restrict__ kn, const float* __restrict__ U,
    const float* __restrict__ Sc, const float* __restrict__ gcum, const int* __restrict__ cu,
    const int* __restrict__ pos, int H, int Hk, int max_chunks, const float* __restrict__ tail_in, long tail_width,
    __nv_bfloat16* __restrict__ out) {
    extern __shared__ __align__(128) float smem[];
    float* Qs = smem;           // [64][LK]  q, then e^G q, then O
    float* Ks = Qs + CH * LK;   // [64][LK]  k, then P [64][LC]
    float* gs = Ks + CH * LK;   // [64]      G
    float* Ps = Ks;

    const int c = blockIdx.x, h = blockIdx.y, n = blockIdx.z, hk = h / (H / Hk);
    const int tid = threadIdx.x, warp = tid >> 5;
    const Seg s = segment(cu, pos, n, max_chunks);
    if (c >= s.chunks) return;
    const int r0 = c * CH;
    const long slot = (long)(s.first + c) * H + h;

    load_k(Ks, kn, tail_in, tail_width, s, r0, n, hk, Hk);
#pragma unroll
    for (int it = 0; it < CH * (D / 4) / NT; ++it) {
        const int idx = tid + it * NT;
        const int r = idx / (D / 4), d = (idx % (D / 4)) * 4, vr = r0 + r;
        const bool own = vr >= s.tail && vr < s.rows;
        cp_async16(Qs + r * LK + d, own ? qn + ((long)(s.start + vr - s.tail) * Hk + hk) * D + d : qn, own);
    }
    if (tid < CH / 4) cp_async16(gs + tid * 4, gcum + slot * CH + tid * 4, true);
    cp_async_wait_all();
    __syncthreads();

    // Q K^T on the 10 tiles at or below the diagonal: warp w takes tiles w and w + 8
    Acc p[2];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        const int t = warp + 8 * q;
        if (t < 10) {
            const int ti = t < 1 ? 0 : t < 3 ? 1 : t < 6 ? 2 : 3, tj = t - ti * (ti + 1) / 2;
            wmma::fill_fragment(p[q], 0.f);
            mma_k<FragA, FragBT>(p[q], Qs + ti * 16 * LK, LK, 1, Ks + tj * 16 * LK, LK, 1, D);
        }
    }
    __syncthreads();  // every warp is done with k: P takes its place
#pragma unroll
    for (int q = 0; q < 2; ++q) {
        const int t = warp + 8 * q;
        if (t < 10) {
            const int ti = t < 1 ? 0 : t < 3 ? 1 : t < 6 ? 2 : 3, tj = t - ti * (ti + 1) / 2;
            wmma::store_matrix_sync(Ps + ti * 16 * LC + tj * 16, p[q], LC, wmma::mem_row_major);
        }
    }
    __syncthreads();
    // P[i][j] = e^{G_i - G_j} (q_i . k_j) for j <= i (0 above, inside the diagonal tiles); q <- e^G q
    for (int idx = tid; idx < CH * CH; idx += NT) {
        const int i = idx / CH, j = idx % CH;
        if ((j >> 4) <= (i >> 4)) Ps[i * LC + j] = j <= i ? __expf(gs[i] - gs[j]) * Ps[i * LC + j] : 0.f;
    }
    for (int idx = tid; idx < CH * (D / 4); idx += NT) {
        const int r = idx / (D / 4), d = (idx % (D / 4)) * 4;
        const float e = __expf(gs[r]);
        float4* ptr = reinterpret_cast<float4*>(Qs + r * LK + d);
        float4 x = *ptr;
        x.x *= e;
        x.y *= e;
        x.z *= e;
        x.w *= e;
        *ptr = x;
    }
    __syncthreads();

    // O = (e^G Q) S_c + P U: warp w owns value columns 16w .. 16w + 15 of all 64 rows, reading
    // its strips of S_c and U from global memory once (each element by one warp)
    Acc o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) wmma::fill_fragment(o[i], 0.f);
    const float* Sg = Sc + slot * D * D + warp * 16;
#pragma unroll 4
    for (int k0 = 0; k0 < D; k0 += 8) {
        FragB b;
        wmma::load_matrix_sync(b, Sg + k0 * D, D);
        to_tf32(b);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            FragA a;
            wmma::load_matrix_sync(a, Qs + i * 16 * LK + k0, LK);
            to_tf32(a);
            wmma::mma_sync(o[i], a, b, o[i]);
        }
    }
    const float* Ug = U + slot * CH * D + warp * 16;
#pragma unroll
    for (int k0 = 0; k0 < CH; k0 += 8) {
        FragB b;
        wmma::load_matrix_sync(b, Ug + k0 * D, D);
        to_tf32(b);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (k0 >= (i + 1) * 16) continue;  // P is zero above the diagonal tiles
            FragA a;
            wmma::load_matrix_sync(a, Ps + i * 16 * LC + k0, LC);
            to_tf32(a);
            wmma::mma_sync(o[i], a, b, o[i]);
        }
    }
    __syncthreads();  // every warp is done with e^G q and P: O takes q's place
#pragma unroll
    for (int i = 0; i < 4; ++i) wmma::store_matrix_sync(Qs + i * 16 * LK + warp * 16, o[i], LK, wmma::mem_row_major);
    __syncthreads();
    for (int idx = tid; idx < CH * (D / 8); idx += NT) {
        const int r = idx / (D / 8), d = (idx % (D / 8)) * 8, vr = r0 + r;
        if (vr >= s.tail && vr < s.rows) store8(out + ((long)(s.start + vr - s.tail) * H + h) * D + d, Qs + r * LK + d);
    }
}
