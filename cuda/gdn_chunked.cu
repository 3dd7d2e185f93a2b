// Chunked Gated DeltaNet prefill over packed segments, with chunks at absolute positions.
//
// The delta rule over a chunk of C = 64 tokens in matrix (WY) form, on TF32 tensor cores with
// fp32 accumulation and an fp32 state (the math: worker/model/ops.py, delta_rule_chunk):
//   G = cumsum(g);  A[i][j] = beta_i e^{G_i - G_j} (k_i . k_j) for j < i;  T = (I + A)^-1
//   W = T (beta e^G K);  U~ = T (beta V)                      (gdn_chunk_solve, all chunks at once)
//   U = U~ - W S_c;  S_{c+1} = e^{G_C} S_c + (e^{G_C - G_j} K)^T U   (gdn_chunk_state: chunk after chunk)
//   O = (e^G Q) S_c + (Q K^T . e^{G_i - G_j}, j <= i) U        (gdn_chunk_out, all chunks at once)
// Products are mma.sync m16n8k8 on tf32 (fragments below). Only the state recurrence is
// sequential: its pass does the two products that chain S from chunk to chunk, splitting the
// value columns over blocks, and stores each chunk's start state S_c and U for the output
// pass, which spreads every (chunk, head) over the GPU.
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
#include "common.cuh"

// Sizes and padded row strides come from the host (traits.GdnChunkTraits), which launches the
// kernels with GDN_SOLVE_SMEM, GDN_STATE_SMEM and GDN_OUT_SMEM bytes of dynamic shared memory.
#if !defined(GDN_CHUNK) || !defined(GDN_DIM) || !defined(GDN_CHUNK_THREADS) || !defined(GDN_STATE_COLS) || \
    !defined(GDN_LK) || !defined(GDN_LC) || !defined(GDN_LB) || !defined(GDN_LX) || !defined(GDN_SOLVE_SMEM) || \
    !defined(GDN_STATE_SMEM) || !defined(GDN_OUT_SMEM)
#error "compile with the definitions of openjev.worker.cuda.traits"
#endif
#define CH GDN_CHUNK          // chunk length
#define D GDN_DIM             // key and value head dims
#define NT GDN_CHUNK_THREADS  // threads a block of the solve and output kernels (8 warps)
#define NCOL GDN_STATE_COLS   // value columns a gdn_chunk_state or gdn_chunk_out block owns
#define LK GDN_LK             // padded row strides (floats): rows start in different banks
#define LC GDN_LC
#define LB GDN_LB
#define LX GDN_LX             // rows of the solve's 16 x 16 block products

// The buffers each kernel carves from its dynamic shared memory, as laid out below.
static_assert(4 * (CH * LB + 2 * CH * LC + 3 * 16 * LX + 2 * CH) == GDN_SOLVE_SMEM, "gdn_chunk_solve layout");
// gdn_chunk_state: the state columns, then two buffers of one chunk's W, K, U and G
static_assert(4 * (D * LC + 2 * (2 * CH * LK + CH * LC + CH)) == GDN_STATE_SMEM, "gdn_chunk_state layout");
static_assert(4 * (2 * CH * LK + CH) == GDN_OUT_SMEM, "gdn_chunk_out layout");
static_assert(NCOL == CH && 2 * NCOL == D, "state columns use the chunk stride LC; two column halves");
static_assert(NT == 32 * (NCOL / 8), "gdn_chunk_out: one warp an 8-column strip of its half");
static_assert(LK >= D && LC >= CH && LB >= 2 * D && LX >= 16 && LK % 2 == 0 && LC % 2 == 0 && LB % 4 == 0 &&
                  LK % 4 == 0 && LC % 4 == 0,
              "rows hold a tile row; 16-byte copies, 8-byte fragment pairs");

// mma.sync m16n8k8 on tf32 with fp32 accumulation. Fragments (PTX ISA, mma.m16n8k8 .tf32), with
// g = lane / 4 and t = lane % 4:
//   A (16 x 8): a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4)
//   B (8 x 8):  b0 (t, g), b1 (t + 4, g)
//   C (16 x 8): c0 (g, 2t), c1 (g, 2t + 1), c2 (g + 8, 2t), c3 (g + 8, 2t + 1)
// Operands come from shared memory by plain loads (WMMA's tf32 fragment loads compile to generic
// loads even from shared memory), rounded to tf32 (nearest, ties away) as WMMA did.
struct Lane {
    int g, t;
};
__device__ __forceinline__ Lane lane_of() {
    const int lane = threadIdx.x & 31;
    return {lane >> 2, lane & 3};
}

__device__ __forceinline__ u32 tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}

// A tile whose element (r, k) is p[r * rs + k * ks]
__device__ __forceinline__ void load_a(u32 (&a)[4], const float* p, int rs, int ks, Lane l) {
    a[0] = tf32(p[l.g * rs + l.t * ks]);
    a[1] = tf32(p[(l.g + 8) * rs + l.t * ks]);
    a[2] = tf32(p[l.g * rs + (l.t + 4) * ks]);
    a[3] = tf32(p[(l.g + 8) * rs + (l.t + 4) * ks]);
}

// B tile whose element (k, n) is p[k * ks + n * ns]
__device__ __forceinline__ void load_b(u32 (&b)[2], const float* p, int ks, int ns, Lane l) {
    b[0] = tf32(p[l.t * ks + l.g * ns]);
    b[1] = tf32(p[(l.t + 4) * ks + l.g * ns]);
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

__device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The 10 16 x 16 tiles at or below the diagonal of a 64 x 64 product, numbered row by row.
__device__ __forceinline__ void lower_tile(int t, int& ti, int& tj) {
    ti = t < 1 ? 0 : t < 3 ? 1 : t < 6 ? 2 : 3;
    tj = t - ti * (ti + 1) / 2;
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

// One chunk's k rows [64][LD] of key head hk from the tail or the packed rows (zeros past the
// end), as asynchronous copies by NTH threads: the caller waits and syncs.
template <int NTH = NT, int LD = LK>
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
        cp_async16(Ks + r * LD + d, src, ok);
    }
}

// grid (max_chunks, H, N), block NT, dynamic shared memory GDN_SOLVE_SMEM (two blocks an SM).
// W, U: [chunks, H, 64, 128] fp32 scratch; gcum: [chunks, H, 64] fp32.
// tail_out[n]: the rows of segment n's unfinished last chunk (written where there is one).
extern "C" __global__ void __launch_bounds__(NT, 2) gdn_chunk_solve(
    const float* __restrict__ kn, const __nv_bfloat16* __restrict__ v, long v_stride,
    const float* __restrict__ g, const float* __restrict__ beta, const int* __restrict__ cu,
    const int* __restrict__ pos, int H, int Hk, int max_chunks, const float* __restrict__ tail_in,
    float* __restrict__ tail_out, long tail_width, float* __restrict__ W, float* __restrict__ U,
    float* __restrict__ gcum) {
    extern __shared__ __align__(128) float smem[];
    float* Bs = smem;              // [64][LB]   k | v, then beta e^G k | beta v
    float* As = Bs + CH * LB;      // [64][LC]   k k^T, then A
    float* Ts = As + CH * LC;      // [64][LC]   (I + A)^-1
    float* Xs = Ts + CH * LC;      // [3][16][LX] block products of one distance of the inverse
    float* gs = Xs + 3 * 16 * LX;  // [64] g, then G
    float* bs = gs + CH;           // [64] beta

    const int c = blockIdx.x, h = blockIdx.y, n = blockIdx.z, hk = h / (H / Hk);
    const Seg s = segment(cu, pos, n, max_chunks);
    if (c >= s.chunks) return;
    const int r0 = c * CH, valid = min(CH, s.rows - r0);
    const bool unfinished = valid < CH;  // only a segment's last chunk can be
    const int tid = threadIdx.x, warp = tid >> 5;
    const Lane l = lane_of();

    load_k<NT, LB>(Bs, kn, tail_in, tail_width, s, r0, n, hk, Hk);
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
            if (h % (H / Hk) == 0) out[r * tail_width + hk * D + d] = Bs[r * LB + d];
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
    // k k^T on the 10 16 x 16 tiles at or below the diagonal: 20 16 x 8 tiles over the warps
    for (int q = warp; q < 20; q += NT / 32) {
        int ti, tj;
        lower_tile(q >> 1, ti, tj);
        const int n0 = tj * 16 + (q & 1) * 8;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
        for (int k0 = 0; k0 < D; k0 += 8) {
            u32 a[4], b[2];
            load_a(a, Bs + ti * 16 * LB + k0, LB, 1, l);
            load_b(b, Bs + n0 * LB + k0, 1, LB, l);  // (k, n) = k_n[k]
            mma(acc, a, b);
        }
        store_c(As + ti * 16 * LC + n0, LC, acc, l);
    }
    __syncthreads();
    for (int idx = tid; idx < CH * CH; idx += NT) {
        const int i = idx / CH, j = idx % CH;
        As[i * LC + j] = j < i ? bs[i] * __expf(gs[i] - gs[j]) * As[i * LC + j] : 0.f;
    }
    for (int idx = tid; idx < CH * D; idx += NT) {
        const int r = idx / D, d = idx % D;
        Bs[r * LB + d] = bs[r] * __expf(gs[r]) * Bs[r * LB + d];
        Bs[r * LB + D + d] *= bs[r];
    }
    __syncthreads();

    // T = (I + A)^-1 by 16x16 blocks. Diagonal blocks by forward substitution, a warp each
    // (lane: column c = lane & 15, half of the sum = lane >> 4); fixed summation orders.
    if (warp < 4) {
        const int b0 = warp * 16, col = (tid & 31) & 15, half = (tid & 31) >> 4;
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
    // (pair p = bj of a distance keeps its block product in Xs[p])
    for (int dist = 1; dist < 4; ++dist) {
        const int pairs = 4 - dist;
        for (int idx = tid; idx < pairs * 256; idx += NT) {
            const int p = idx / 256, bi = dist + p, bj = p, r = (idx % 256) >> 4, col = idx & 15;
            float acc = 0.f;
            for (int kk = bj * 16; kk < bi * 16; ++kk)
                acc = fmaf(As[(bi * 16 + r) * LC + kk], Ts[kk * LC + bj * 16 + col], acc);
            Xs[(p * 16 + r) * LX + col] = acc;
        }
        __syncthreads();
        for (int idx = tid; idx < pairs * 256; idx += NT) {
            const int p = idx / 256, bi = dist + p, bj = p, r = (idx % 256) >> 4, col = idx & 15;
            float acc = 0.f;
            for (int m = 0; m <= r; ++m)
                acc = fmaf(Ts[(bi * 16 + r) * LC + bi * 16 + m], Xs[(p * 16 + m) * LX + col], acc);
            Ts[(bi * 16 + r) * LC + bj * 16 + col] = -acc;
        }
        __syncthreads();
    }

    // [W | U~] = T [beta e^G K | beta V]: warp w one 16-row tile by 16 8-column tiles (W for even
    // warps, U~ for odd ones), its T fragment shared by the 16, straight to the scratch
    const long slot = (long)(s.first + c) * H + h;
    {
        const int ti = warp >> 1, j0 = (warp & 1) * 16;
        float acc[16][4];
#pragma unroll
        for (int j = 0; j < 16; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll 2
        for (int k0 = 0; k0 < CH; k0 += 8) {
            u32 a[4];
            load_a(a, Ts + ti * 16 * LC + k0, LC, 1, l);
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                u32 b[2];
                load_b(b, Bs + k0 * LB + (j0 + j) * 8, LB, 1, l);
                mma(acc[j], a, b);
            }
        }
        float* dst = ((warp & 1) ? U : W) + slot * CH * D + ti * 16 * D;
#pragma unroll
        for (int j = 0; j < 16; ++j) store_c(dst + j * 8, D, acc[j], l);
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
    constexpr int TN = NCOL / 8;                      // 8-column tiles of the state a block owns
    float* Ss = state_smem;                           // [128][LC] state columns col0 .. col0 + NCOL - 1

    const int col0 = blockIdx.x * NCOL, h = blockIdx.y, n = blockIdx.z, hk = h / (H / Hk);
    const int tid = threadIdx.x, warp = tid >> 5;
    const Lane l = lane_of();
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
        {  // U = U~ - W S: a warp one 16-row tile by TPW 8-column tiles (its W fragments shared)
            constexpr int TPW = (CH / 16) * TN / (NTH / 32);
            static_assert(TPW >= 1 && TN % TPW == 0, "whole column groups a warp");
            const int t0 = warp * TPW, ti = t0 / TN, n0 = (t0 % TN) * 8;
            float u[TPW][4];
#pragma unroll
            for (int j = 0; j < TPW; ++j) load_c(u[j], Ub + ti * 16 * LC + n0 + j * 8, LC, l);
#pragma unroll 4
            for (int k0 = 0; k0 < D; k0 += 8) {
                u32 w[4];
                load_a(w, Wb + ti * 16 * LK + k0, LK, 1, l);
#pragma unroll
                for (int e = 0; e < 4; ++e) w[e] ^= 0x80000000u;  // -W: the sign bit, exactly
#pragma unroll
                for (int j = 0; j < TPW; ++j) {
                    u32 b[2];
                    load_b(b, Ss + k0 * LC + n0 + j * 8, LC, 1, l);
                    mma(u[j], w, b);
                }
            }
#pragma unroll
            for (int j = 0; j < TPW; ++j) {
                store_c(Ub + ti * 16 * LC + n0 + j * 8, LC, u[j], l);
                store_c(U + (slot * CH + ti * 16) * D + col0 + n0 + j * 8, D, u[j], l);
            }
        }
        __syncthreads();
        if (s.rows - c * CH >= CH) {  // a finished chunk: S <- e^{G_C} S + K~^T U
            constexpr int TPB = (D / 16) * TN / (NTH / 32);
            static_assert(TPB >= 1 && TN % TPB == 0, "whole column groups a warp");
            const int t0 = warp * TPB, ti = t0 / TN, n0 = (t0 % TN) * 8;
            const float decay = __expf(g_end);
            float st[TPB][4];
#pragma unroll
            for (int j = 0; j < TPB; ++j) {
                load_c(st[j], Ss + ti * 16 * LC + n0 + j * 8, LC, l);
#pragma unroll
                for (int e = 0; e < 4; ++e) st[j][e] *= decay;
            }
#pragma unroll 2
            for (int k0 = 0; k0 < CH; k0 += 8) {
                u32 a[4];
                load_a(a, Kb + k0 * LK + ti * 16, 1, LK, l);  // (i, k) = K~[k][i]
#pragma unroll
                for (int j = 0; j < TPB; ++j) {
                    u32 b[2];
                    load_b(b, Ub + k0 * LC + n0 + j * 8, LC, 1, l);
                    mma(st[j], a, b);
                }
            }
#pragma unroll
            for (int j = 0; j < TPB; ++j) store_c(Ss + ti * 16 * LC + n0 + j * 8, LC, st[j], l);
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

// The output pass, grid (2 max_chunks, H, N) (chunk and value-column half), block NT, dynamic
// shared memory GDN_OUT_SMEM: every chunk of every head at once, from S_c and U of
// gdn_chunk_state. Warp w owns the 8 value columns col0 + 8w of all 64 rows; its S_c and U
// fragments are loaded from global memory first, while the q and k rows copy in and P forms.
// out: [T, H, 128] bf16, own rows only (tail rows have no query: their outputs belong to the parent).
extern "C" __global__ void __launch_bounds__(NT, 2) gdn_chunk_out(
    const float* __restrict__ qn, const float* __restrict__ kn, const float* __restrict__ U,
    const float* __restrict__ Sc, const float* __restrict__ gcum, const int* __restrict__ cu,
    const int* __restrict__ pos, int H, int Hk, int max_chunks, const float* __restrict__ tail_in, long tail_width,
    __nv_bfloat16* __restrict__ out) {
    extern __shared__ __align__(128) float smem[];
    float* Qs = smem;           // [64][LK]  q
    float* Ks = Qs + CH * LK;   // [64][LK]  k, then P [64][LC]
    float* gs = Ks + CH * LK;   // [64]      G
    float* Ps = Ks;

    const int c = blockIdx.x >> 1, h = blockIdx.y, n = blockIdx.z, hk = h / (H / Hk);
    const int col = (blockIdx.x & 1) * NCOL + (threadIdx.x >> 5) * 8;  // this warp's value columns
    const int tid = threadIdx.x, warp = tid >> 5;
    const Lane l = lane_of();
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
    cp_async_commit();
    // B fragments of S_c (k = key row, n = column) and of U (k = chunk row) for this warp's strip
    float sf[D / 8][2], uf[CH / 8][2];
    const float* Sg = Sc + slot * D * D + col;
    const float* Ug = U + slot * CH * D + col;
#pragma unroll
    for (int k = 0; k < D / 8; ++k) {
        sf[k][0] = Sg[(k * 8 + l.t) * D + l.g];
        sf[k][1] = Sg[(k * 8 + l.t + 4) * D + l.g];
    }
#pragma unroll
    for (int k = 0; k < CH / 8; ++k) {
        uf[k][0] = Ug[(k * 8 + l.t) * D + l.g];
        uf[k][1] = Ug[(k * 8 + l.t + 4) * D + l.g];
    }
    cp_async_wait<0>();
    __syncthreads();

    // P = (q k^T) e^{G_i - G_j}, j <= i: the 10 16 x 16 tiles at or below the diagonal as 20
    // 16 x 8 tiles (up to 3 a warp), masked and decayed in registers
    float p[3][4];
#pragma unroll
    for (int q = 0; q < 3; ++q) {
        const int t = warp + q * (NT / 32);
        if (t < 20) {
            int ti, tj;
            lower_tile(t >> 1, ti, tj);
            const int n0 = tj * 16 + (t & 1) * 8;
            p[q][0] = p[q][1] = p[q][2] = p[q][3] = 0.f;
#pragma unroll 4
            for (int k0 = 0; k0 < D; k0 += 8) {
                u32 a[4], b[2];
                load_a(a, Qs + ti * 16 * LK + k0, LK, 1, l);
                load_b(b, Ks + n0 * LK + k0, 1, LK, l);  // (k, n) = k_n[k]
                mma(p[q], a, b);
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = ti * 16 + l.g + (e >> 1) * 8, j = n0 + 2 * l.t + (e & 1);
                p[q][e] = j <= i ? __expf(gs[i] - gs[j]) * p[q][e] : 0.f;
            }
        }
    }
    __syncthreads();  // every warp is done with k: P takes its place
#pragma unroll
    for (int q = 0; q < 3; ++q) {
        const int t = warp + q * (NT / 32);
        if (t < 20) {
            int ti, tj;
            lower_tile(t >> 1, ti, tj);
            store_c(Ps + ti * 16 * LC + tj * 16 + (t & 1) * 8, LC, p[q], l);
        }
    }
    __syncthreads();

    // O = e^G (Q S_c) + P U on the warp's 64 x 8 strip (P is zero above its diagonal tiles)
    float o[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
#pragma unroll
    for (int k = 0; k < D / 8; ++k) {
        const u32 b[2] = {tf32(sf[k][0]), tf32(sf[k][1])};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            u32 a[4];
            load_a(a, Qs + i * 16 * LK + k * 8, LK, 1, l);
            mma(o[i], a, b);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float lo = __expf(gs[i * 16 + l.g]), hi = __expf(gs[i * 16 + l.g + 8]);
        o[i][0] *= lo;
        o[i][1] *= lo;
        o[i][2] *= hi;
        o[i][3] *= hi;
    }
#pragma unroll
    for (int k = 0; k < CH / 8; ++k) {
        const u32 b[2] = {tf32(uf[k][0]), tf32(uf[k][1])};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (k * 8 >= (i + 1) * 16) continue;
            u32 a[4];
            load_a(a, Ps + i * 16 * LC + k * 8, LC, 1, l);
            mma(o[i], a, b);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int vr = r0 + i * 16 + l.g + e * 8;
            if (vr >= s.tail && vr < s.rows)
                *reinterpret_cast<__nv_bfloat162*>(out + ((long)(s.start + vr - s.tail) * H + h) * D + col + 2 * l.t) =
                    __floats2bfloat162_rn(o[i][2 * e], o[i][2 * e + 1]);
        }
    }
}
