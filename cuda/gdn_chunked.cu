// Chunked Gated DeltaNet prefill over packed segments, with chunks at absolute positions.
//
// The delta rule over a chunk of C = 64 tokens in matrix (WY) form, on TF32 tensor cores with
// fp32 accumulation and an fp32 state (the math: worker/model/ops.py, delta_rule_chunk):
//   G = cumsum(g);  A[i][j] = beta_i e^{G_i - G_j} (k_i . k_j) for j < i;  T = (I + A)^-1
//   W = T (beta e^G K);  U~ = T (beta V)                      (gdn_chunk_solve, all chunks at once)
//   U = U~ - W S_c;  S_{c+1} = e^{G_C} S_c + K^T (e^{G_C - G_j} U)   (gdn_chunk_state: chunk after chunk)
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
// A segment n starts at position pos[cu[n]]; its virtual rows are tail (pos mod 64 rows) then its
// own cu[n+1] - cu[n] tokens. Tail row r comes from tail_src[64 n + r]: >= 0 a packed row of
// this launch (an in-pass ancestor's token), < 0 row -1 - src of `tails`, the flattened tail
// buffers of kept states (row layout in 4-byte words: [k: Hk*128 fp32 | v: H*128 bf16, two a
// word | g: H fp32 | beta: H fp32], tail_width words a row, 64 rows a state; v is kept in its
// input's own precision, so exactly, in 37% less room on the 27B shape). So a pass may hold parents and
// children: the solve and output kernels run once over all of them, the state pass once per
// level (level_off ranges), a child starting from its in-pass parent's final state (the state at
// that parent's last boundary, where the child's first chunk starts).

#include "common.cuh"
#include "mma_tf32.cuh"  // tf32 mma fragments

// Sizes and padded row strides come from the host (traits.GdnChunkTraits), which launches the
// kernels with GDN_SOLVE_SMEM, GDN_STATE_SMEM and GDN_OUT_SMEM bytes of dynamic shared memory.
#if !defined(GDN_CHUNK) || !defined(GDN_DIM) || !defined(GDN_CHUNK_THREADS) || !defined(GDN_STATE_COLS) || \
    !defined(GDN_PLAN_THREADS) || !defined(GDN_PLAN_DESC) || \
    !defined(GDN_LK) || !defined(GDN_LC) || !defined(GDN_LB) || !defined(GDN_LX) || !defined(GDN_LS) ||            \
    !defined(GDN_LKS) || !defined(GDN_SOLVE_SMEM) || \
    !defined(GDN_STATE_SMEM) || !defined(GDN_OUT_SMEM) || !defined(GDN_OUT_THREADS)
#error "compile with the definitions of openjev.worker.cuda.traits"
#endif
#define CH GDN_CHUNK          // chunk length
#define D GDN_DIM             // key and value head dims
#define NT GDN_CHUNK_THREADS  // threads a block of the solve and output kernels (8 warps)
#define NCOL GDN_STATE_COLS   // value columns a gdn_chunk_state block owns
#define NTO GDN_OUT_THREADS   // threads a gdn_chunk_out block (a warp a strip of OJ 8-column tiles of all D)
#define OJ (D / 8 / (NTO / 32))  // gdn_chunk_out: 8-column tiles a warp
#define LK GDN_LK             // padded row strides (floats): rows start in different banks
#define LC GDN_LC
#define LB GDN_LB
#define LX GDN_LX             // rows of the solve's 16 x 16 block products
#define LS GDN_LS             // gdn_chunk_state: rows of U~ (its NCOL columns)
#define LKS GDN_LKS           // gdn_chunk_state: rows of k (read transposed)

// The buffers each kernel carves from its dynamic shared memory, as laid out below.
static_assert(4 * (CH * LB + 2 * CH * LC + 3 * 16 * LX + 2 * CH) == GDN_SOLVE_SMEM, "gdn_chunk_solve layout");
// gdn_chunk_state: the state columns (n-major), then two buffers of one chunk's W, K, U and G
static_assert(4 * (NCOL * LK + 2 * (CH * LK + CH * LKS + CH * LS + CH)) == GDN_STATE_SMEM, "gdn_chunk_state layout");
static_assert(NCOL * LC <= CH * LS, "the decayed U (n-major) fits where U~ was");
static_assert((LK * 4) % 128 == 16 && (LC * 4) % 128 == 16, "ldmatrix: 8 rows in 8 different 16-byte bank groups");
// gdn_chunk_out: two q buffers, k, P, two G buffers, then the S_c and U of the item taken next
static_assert(4 * (3 * CH * LK + CH * LC + 2 * CH + (D + CH) * LKS) == GDN_OUT_SMEM, "gdn_chunk_out layout");
static_assert(NCOL == CH && 2 * NCOL == D, "U~'s rows and the decayed U's (n-major) share a buffer; two column halves");
// Shared-memory banks (float index mod 32): an A fragment reads rows g (8) x columns t (4), a B
// fragment rows t x columns g. The 32 lanes hit 32 banks when a tile read as A has a stride of 4
// mod 8 (LK, LC) and one read as B a stride of 8 mod 16 (LS, LKS). The state pass reads every
// tile one way only; the solve's [k | v] and T are read both ways (2-way conflicts on one of them:
// a swizzle that removed them cost more in index arithmetic than it saved, measured 2026-12-01).
static_assert(LK % 8 == 4 && LC % 8 == 4 && LS % 16 == 8 && LKS % 16 == 8, "conflict-free fragment strides");
static_assert(NTO / 32 * OJ * 8 == D, "gdn_chunk_out: a warp a strip of whole 8-column tiles");
static_assert(LK >= D && LC >= CH && LB >= 2 * D && LX >= 16 && LK % 2 == 0 && LC % 2 == 0 && LB % 4 == 0 &&
                  LK % 4 == 0 && LC % 4 == 0,
              "rows hold a tile row; 16-byte copies, 8-byte fragment pairs");

// The 10 16 x 16 tiles at or below the diagonal of a 64 x 64 product, numbered row by row.
__device__ __forceinline__ void lower_tile(int t, int& ti, int& tj) {
    ti = t < 1 ? 0 : t < 3 ? 1 : t < 6 ? 2 : 3;
    tj = t - ti * (ti + 1) / 2;
}

// Segment n's row count (tail + own), chunk count (capped), and first scratch chunk (the chunk
// list's prefix sum: summing the segments before n here cost every item O(n) loads).
struct Seg {
    int start, own, tail, rows, chunks, first;
};

__device__ __forceinline__ Seg segment(const int* cu, const int* pos, const int* __restrict__ list, int n,
                                       int max_chunks) {
    Seg s;
    s.start = cu[n];
    s.own = cu[n + 1] - s.start;
    s.tail = s.own > 0 ? (pos[s.start] & (CH - 1)) : 0;
    s.rows = s.tail + s.own;
    s.chunks = s.own > 0 ? min((s.rows + CH - 1) / CH, max_chunks) : 0;
    s.first = list[1 + n];
    return s;
}

// Work by ticket: the grids are a few blocks an SM and every block takes (chunk, head) or (state
// columns, head, segment) items until none is left, so a pass's padded segments cost no empty
// blocks (tens of thousands of them at 4,096 tokens, each holding an SM's shared memory while it
// exits). counters: [ticket, done], zeros between launches; the last block out resets them
// (launches on one stream never overlap). All threads call next_item; slot: a shared int.
__device__ __forceinline__ int next_item(int* counters, int* slot) {
    __syncthreads();  // the previous item is done with shared memory (and with *slot)
    if (threadIdx.x == 0) *slot = atomicAdd(&counters[0], 1);
    __syncthreads();
    return *slot;
}

__device__ __forceinline__ void finish_items(int* counters) {
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(&counters[1], 1) == (int)(gridDim.x * gridDim.y * gridDim.z) - 1) {
            counters[0] = 0;
            counters[1] = 0;
            __threadfence();
        }
    }
}

// A (chunk, head) item of the solve or the output pass: its scratch slot, head, segment n, chunk
// c of it, and the segment (from the chunk's descriptor: chunks is not set, first is slot - c).
struct ChunkItem {
    int slot, h, n, c;
    Seg s;
};

__device__ __forceinline__ ChunkItem chunk_item(int ticket, int4 d, int H) {
    ChunkItem it;
    it.slot = ticket / H;
    it.h = ticket % H;
    it.n = d.x >> 16;
    it.c = d.x & 0xffff;
    it.s.start = d.y;
    it.s.rows = d.z;
    it.s.tail = d.w;
    it.s.own = d.z - d.w;
    it.s.chunks = 0;
    it.s.first = it.slot - it.c;
    return it;
}

// The (chunk, head) items by ticket, one ahead: thread 0 takes the next item's ticket when an
// item starts and reads that chunk's descriptor (gdn_chunk_plan) at prefetch(), midway through
// the item, so the next item starts with both in shared memory (the ticket, the chunk list, the
// segment's bounds and its first position were four dependent global round trips before an
// item's loads could issue). A block takes one ticket past the last item, as next_item does.
struct ChunkTickets {
    int* counters;
    const int4* desc;
    int total, H;
    int next;    // thread 0: the ticket of the next item
    int4 ahead;  // thread 0: its descriptor, once prefetched
    int* ticket_s;
    int4* desc_s;

    __device__ ChunkTickets(const int* list, int* counters_, int H_, int* ticket_shared, int4* desc_shared)
        : counters(counters_), desc(reinterpret_cast<const int4*>(list + GDN_PLAN_DESC)), total(list[0] * H_),
          H(H_), next(0), ahead(make_int4(0, 0, 0, 0)), ticket_s(ticket_shared), desc_s(desc_shared) {
        if (threadIdx.x == 0) {
            next = atomicAdd(&counters[0], 1);
            if (next < total) ahead = desc[next / H];
        }
    }

    // the next item into it; false when none is left. All threads call it.
    __device__ bool take(ChunkItem& it) {
        __syncthreads();  // the previous item is done with shared memory (and with the two slots)
        if (threadIdx.x == 0) {
            *ticket_s = next < total ? next : -1;
            *desc_s = ahead;
            if (next < total) next = atomicAdd(&counters[0], 1);
        }
        __syncthreads();
        const int item = *ticket_s;
        if (item < 0) return false;
        it = chunk_item(item, *desc_s, H);
        return true;
    }

    // once an item, after its loads are issued: the next item's descriptor (its ticket is back)
    __device__ void prefetch() {
        if (threadIdx.x == 0 && next < total) ahead = desc[next / H];
    }

    // thread 0: the ticket the next take() returns, -1 if none, and (after prefetch) its descriptor
    __device__ int upcoming() const { return next < total ? next : -1; }
    __device__ int4 upcoming_desc() const { return ahead; }
};

// The launch's chunks in segment order: list[0] = their count, list[1 + n] = segment n's first
// scratch slot, and from GDN_PLAN_DESC an int4 a scratch slot (the chunk's slot =
// segment(...).first + c): {(n << 16) | c, the segment's first packed row, its rows (tail and
// own), its tail}. Only the segments of the levels' ranges (level_off[0] .. level_off[levels] - 1)
// are listed: a graph pass's pad segment after them is neither solved nor output (its rows are
// never read, as with the recurrence), nor are the recurrence's segments before them (a split
// pass), and segment(...).first counts the same chunks for every listed segment. One block of
// GDN_PLAN_THREADS threads, a segment a thread (N <= GDN_PLAN_THREADS).
extern "C" __global__ void __launch_bounds__(GDN_PLAN_THREADS)
    gdn_chunk_plan(const int* __restrict__ cu, const int* __restrict__ pos, int max_chunks,
                   const int* __restrict__ level_off, int levels, int* __restrict__ list) {
    static_assert(GDN_PLAN_DESC % 4 == 0 && GDN_PLAN_DESC >= 1 + GDN_PLAN_THREADS, "int4 descriptors after the slots");
    __shared__ int first[GDN_PLAN_THREADS];
    const int n = threadIdx.x;
    int chunks = 0, a = 0, own = 0, tail = 0;
    if (n >= level_off[0] && n < level_off[levels]) {  // level_off[levels] <= N
        a = cu[n];
        own = cu[n + 1] - a;
        tail = own > 0 ? (pos[a] & (CH - 1)) : 0;
        chunks = own > 0 ? min((tail + own + CH - 1) / CH, max_chunks) : 0;
    }
    first[n] = chunks;
    __syncthreads();
    for (int step = 1; step < GDN_PLAN_THREADS; step <<= 1) {  // inclusive prefix sum
        const int add = n >= step ? first[n - step] : 0;
        __syncthreads();
        first[n] += add;
        __syncthreads();
    }
    const int at = first[n] - chunks;
    list[1 + n] = at;
    int4* desc = reinterpret_cast<int4*>(list + GDN_PLAN_DESC);
    for (int c = 0; c < chunks; ++c) desc[at + c] = make_int4((n << 16) | c, a, tail + own, tail);
    if (n == GDN_PLAN_THREADS - 1) list[0] = first[n];
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

// A tail row's v (bf16, after k's Hk * D words) and its g, beta (fp32, after v's H * D / 2 words).
__device__ __forceinline__ const __nv_bfloat16* tail_v(const float* row, int Hk) {
    return reinterpret_cast<const __nv_bfloat16*>(row + Hk * D);
}
__device__ __forceinline__ __nv_bfloat16* tail_v(float* row, int Hk) {
    return reinterpret_cast<__nv_bfloat16*>(row + Hk * D);
}
__device__ __forceinline__ const float* tail_gb(const float* row, int H, int Hk) { return row + Hk * D + H * (D / 2); }
__device__ __forceinline__ float* tail_gb(float* row, int H, int Hk) { return row + Hk * D + H * (D / 2); }

// One chunk's k rows [64][LB] of key head hk from the tail or the packed rows (zeros past the
// end), as asynchronous copies by the solve's NT threads: the caller waits and syncs.
// Where virtual row vr of segment n comes from: a packed row (>= 0) or -1 - e, row e of the tails.
__device__ __forceinline__ int row_source(const int* __restrict__ tail_src, const Seg& s, int n, int vr) {
    return vr < s.tail ? tail_src[n * CH + vr] : s.start + vr - s.tail;
}

__device__ __forceinline__ void load_k(float* Ks, const float* __restrict__ kn, const int* __restrict__ tail_src,
                                       const float* __restrict__ tails, long tail_width, const Seg& s, int r0, int n,
                                       int hk, int Hk) {
    static_assert(NT % (D / 4) == 0, "a thread copies the same 4 columns of every row it copies");
    if (r0 >= s.tail && r0 + CH <= s.rows) {
        // a whole chunk of packed rows (every chunk of a segment but its first and last, and those
        // too without a tail or a short end): consecutive rows, no per-row source (its lookup and
        // branches were a third of the state pass's instructions a chunk, in the SASS)
        const float* from = kn + ((long)(s.start + r0 - s.tail) * Hk + hk) * D + (threadIdx.x % (D / 4)) * 4;
        const int r = threadIdx.x / (D / 4);
#pragma unroll
        for (int it = 0; it < CH * (D / 4) / NT; ++it) {
            const int row = r + it * (NT / (D / 4));
            cp_async16(Ks + row * LB + (threadIdx.x % (D / 4)) * 4, from + (long)row * Hk * D, true);
        }
        return;
    }
#pragma unroll
    for (int it = 0; it < CH * (D / 4) / NT; ++it) {
        const int idx = threadIdx.x + it * NT;
        const int r = idx / (D / 4), d = (idx % (D / 4)) * 4, vr = r0 + r;
        const bool ok = vr < s.rows;
        const int src = ok ? row_source(tail_src, s, n, vr) : 0;
        const float* from = src >= 0 ? kn + ((long)src * Hk + hk) * D + d : tails + (long)(-1 - src) * tail_width + hk * D + d;
        cp_async16(Ks + r * LB + d, from, ok);
    }
}

// One 16-row tile ti of W (IS_W: -W, rounded, the state pass's operand as it uses it) or U~, 64
// columns: T's row tile with its columns scaled by beta e^G (W) or beta (U~) times 8 column tiles
// of kv (k or v rows, stride LB), to dst (stride D). T is lower block-triangular, so the sum runs
// over its first 16 (ti + 1) columns only (the steps after them added exact zeros). kv is loaded
// as it is: k was rounded to tf32 where stored, and v's values came from bf16, whose bits tf32
// rounding leaves as they are.
template <bool IS_W>
__device__ __forceinline__ void wu_tile(const float* Ts, const float* kv, const float* gs, const float* bs,
                                        float* __restrict__ dst, int ti, Lane l) {
    float acc[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll 2
    for (int k0 = 0; k0 < (ti + 1) * 16; k0 += 8) {
        float t[4];
        load_af(t, Ts + ti * 16 * LC + k0, LC, 1, l);
        const int k_lo = k0 + l.t, k_hi = k_lo + 4;
        const float s_lo = IS_W ? bs[k_lo] * __expf(gs[k_lo]) : bs[k_lo];
        const float s_hi = IS_W ? bs[k_hi] * __expf(gs[k_hi]) : bs[k_hi];
        const u32 a[4] = {tf32(t[0] * s_lo), tf32(t[1] * s_lo), tf32(t[2] * s_hi), tf32(t[3] * s_hi)};
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            u32 b[2];
            load_b<true>(b, kv + k0 * LB + j * 8, LB, 1, l);
            mma(acc[j], a, b);
        }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        if (IS_W)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][e] = -rnd(acc[j][e]);
        store_c(dst + ti * 16 * D + j * 8, D, acc[j], l);
    }
}

// The first NTILE of a warp's k k^T tiles (rows row[m], columns col[m] of [k | v]'s k, rounded
// to tf32 where stored), summed over the D key dims, fully unrolled: every fragment address a
// constant offset from one pointer a tile (a loop guarded per tile recomputed them each step: a
// third of its instructions).
template <int NTILE, int KT>
__device__ __forceinline__ void kkt(float (&acc)[KT][4], const float* Bs, const int (&row)[KT], const int (&col)[KT],
                                    Lane l) {
    const float* pa[NTILE];
    const float* pb[NTILE];
#pragma unroll
    for (int m = 0; m < NTILE; ++m) {
        pa[m] = Bs + (row[m] + l.g) * LB + l.t;  // A (i, k) = k_i[k]
        pb[m] = Bs + (col[m] + l.g) * LB + l.t;  // B (k, n) = k_n[k]
    }
#pragma unroll
    for (int k0 = 0; k0 < D; k0 += 8) {
#pragma unroll
        for (int m = 0; m < NTILE; ++m) {
            const u32 a[4] = {__float_as_uint(pa[m][k0]), __float_as_uint(pa[m][8 * LB + k0]),
                              __float_as_uint(pa[m][k0 + 4]), __float_as_uint(pa[m][8 * LB + k0 + 4])};
            const u32 b[2] = {__float_as_uint(pb[m][k0]), __float_as_uint(pb[m][k0 + 4])};
            mma(acc[m], a, b);
        }
    }
}

// Blocks of NT threads, two an SM, taking the (chunk, head) items of the chunk list by ticket;
// dynamic shared memory GDN_SOLVE_SMEM.
// W, U: [chunks, H, 64, 128] fp32 scratch (W holds -W rounded to tf32); gcum: [chunks, H, 64] fp32.
// Kt: [chunks, Hk, 64, 128] fp32, each chunk's k rows rounded to tf32 (zeros past the end): the
// state pass's K, whatever the rows' sources. tail_out[n]: the rows of segment n's unfinished
// last chunk (written where there is one).
extern "C" __global__ void __launch_bounds__(NT, 2) gdn_chunk_solve(
    const float* __restrict__ kn, const __nv_bfloat16* __restrict__ v, long v_stride,
    const float* __restrict__ g, const float* __restrict__ beta, int H, int Hk, const int* __restrict__ tail_src,
    const float* __restrict__ tails, float* __restrict__ tail_out, long tail_width, float* __restrict__ W,
    float* __restrict__ U, float* __restrict__ gcum, float* __restrict__ Kt, const int* __restrict__ list,
    int* __restrict__ counters) {
    extern __shared__ __align__(128) float smem[];
    float* Bs = smem;              // [64][LB]   k | v
    float* As = Bs + CH * LB;      // [64][LC]   k k^T, then A
    float* Ts = As + CH * LC;      // [64][LC]   (I + A)^-1
    float* Xs = Ts + CH * LC;      // [3][16][LX] block products of one distance of the inverse
    float* gs = Xs + 3 * 16 * LX;  // [64] g, then G
    float* bs = gs + CH;           // [64] beta

    __shared__ int ticket;
    __shared__ int4 chunk_desc;
    ChunkTickets tickets(list, counters, H, &ticket, &chunk_desc);
    ChunkItem job;
    while (tickets.take(job)) {
        const int h = job.h, n = job.n, c = job.c;
        const int hk = h / (H / Hk);
        const Seg& s = job.s;
        const int r0 = c * CH, valid = min(CH, s.rows - r0);
        const bool unfinished = valid < CH;  // only a segment's last chunk can be
        const int tid = threadIdx.x, warp = tid >> 5;
        const Lane l = lane_of();

        load_k(Bs, kn, tail_src, tails, tail_width, s, r0, n, hk, Hk);
        constexpr int VSTEPS = CH * (D / 4) / NT;  // v rows: 4 values a thread per step
        if (r0 >= s.tail && r0 + CH <= s.rows) {
            // a whole chunk of packed rows (as in load_k): every load issued before the first
            // is used, none behind a branch
            uint2 raw[VSTEPS];
            const __nv_bfloat16* from = v + (long)(s.start + r0 - s.tail) * v_stride + h * D + (tid % (D / 4)) * 4;
#pragma unroll
            for (int it = 0; it < VSTEPS; ++it)
                raw[it] = *reinterpret_cast<const uint2*>(from + (long)(tid / (D / 4) + it * (NT / (D / 4))) * v_stride);
#pragma unroll
            for (int it = 0; it < VSTEPS; ++it) {
                const int r = tid / (D / 4) + it * (NT / (D / 4)), d = (tid % (D / 4)) * 4;
                *reinterpret_cast<float4*>(Bs + r * LB + D + d) = bf16x4_float4(raw[it]);
            }
        } else {
#pragma unroll
            for (int it = 0; it < VSTEPS; ++it) {
                const int idx = tid + it * NT;
                const int r = idx / (D / 4), d = (idx % (D / 4)) * 4, vr = r0 + r;
                float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
                if (vr < s.rows) {
                    const int src = row_source(tail_src, s, n, vr);
                    if (src < 0) {
                        const __nv_bfloat16* tv = tail_v(tails + (long)(-1 - src) * tail_width, Hk);
                        x = bf16x4_float4(*reinterpret_cast<const uint2*>(tv + h * D + d));
                    } else {
                        x = bf16x4_float4(*reinterpret_cast<const uint2*>(v + (long)src * v_stride + h * D + d));
                    }
                }
                *reinterpret_cast<float4*>(Bs + r * LB + D + d) = x;
            }
        }
        if (tid < CH) {
            const int vr = r0 + tid;
            float gv = 0.f, bv = 0.f;
            if (vr < s.rows) {
                const int src = row_source(tail_src, s, n, vr);
                if (src < 0) {
                    const float* row = tail_gb(tails + (long)(-1 - src) * tail_width, H, Hk);
                    gv = row[h];
                    bv = row[H + h];
                } else {
                    gv = g[(long)src * H + h];
                    bv = beta[(long)src * H + h];
                }
            }
            gs[tid] = gv;
            bs[tid] = bv;
        }
        cp_async_wait_all();
        // k rounded to tf32 in place, each thread the 16-byte pieces it copied (its own copies are
        // complete for it: no barrier before), so that k k^T and W load their operands as they
        // are; an unfinished chunk's k rows go to its tail first, as they came (tails hold inputs),
        // and the rounded rows to the state pass's K tile (one value head a key head writes both)
        static_assert(NT % (D / 4) == 0, "load_k: rows tid / (D / 4) + i NT / (D / 4), columns 4 (tid % (D / 4))");
        const bool writes_k = h % (H / Hk) == 0;
        float* k_tile = Kt + ((long)job.slot * Hk + hk) * CH * D;
#pragma unroll
        for (int it = 0; it < CH * (D / 4) / NT; ++it) {
            const int r = tid / (D / 4) + it * (NT / (D / 4)), d = (tid % (D / 4)) * 4;
            float4* x = reinterpret_cast<float4*>(Bs + r * LB + d);
            const float4 y = *x;
            if (writes_k && unfinished && r < valid) {
                float* to = tail_out + ((long)n * CH + r) * tail_width + hk * D + d;
                to[0] = y.x;
                to[1] = y.y;
                to[2] = y.z;
                to[3] = y.w;
            }
            const float4 z = make_float4(rnd(y.x), rnd(y.y), rnd(y.z), rnd(y.w));
            *x = z;
            if (writes_k) *reinterpret_cast<float4*>(k_tile + r * D + d) = z;
        }
        tickets.prefetch();
        __syncthreads();

        if (unfinished) {  // keep the unfinished chunk's v, g and beta rows for the children (k: above)
            float* out = tail_out + (long)n * CH * tail_width;
            for (int idx = tid; idx < valid * D; idx += NT) {
                const int r = idx / D, d = idx % D;
                tail_v(out + r * tail_width, Hk)[h * D + d] = __float2bfloat16(Bs[r * LB + D + d]);  // bf16-exact
            }
            if (tid < valid) {
                tail_gb(out + tid * tail_width, H, Hk)[h] = gs[tid];
                tail_gb(out + tid * tail_width, H, Hk)[H + h] = bs[tid];
            }
        }
        __syncthreads();  // the tail rows above read g before it becomes G
        // G: a prefix sum in row order, so row i's value never depends on later rows; by a lane of
        // the last warp, which has one k k^T tile fewer than the first four
        if (tid == NT - 32) {
            float acc = 0.f;
#pragma unroll
            for (int r = 0; r < CH; ++r) {
                acc += gs[r];
                gs[r] = acc;
            }
        }
        // A = k k^T decayed, on the 10 16 x 16 tiles at or below the diagonal: 20 16 x 8 tiles over
        // the warps, a warp's tiles (KT or KT - 1) in one loop so that their products' latencies
        // overlap (kkt), decayed in registers once G is in (no pass over A in shared memory).
        // Tiles above the diagonal are never read.
        {
            constexpr int KT = (20 + NT / 32 - 1) / (NT / 32);
            static_assert(20 - (KT - 1) * (NT / 32) > 0, "every warp has KT - 1 tiles at least");
            int row[KT], col[KT];
            float acc[KT][4];
#pragma unroll
            for (int m = 0; m < KT; ++m) {
                const int q = warp + m * (NT / 32);
                int ti = 0, tj = 0;
                if (q < 20) lower_tile(q >> 1, ti, tj);
                row[m] = ti * 16;
                col[m] = tj * 16 + (q & 1) * 8;
                acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.f;
            }
            if (warp + (KT - 1) * (NT / 32) < 20)
                kkt<KT>(acc, Bs, row, col, l);
            else
                kkt<KT - 1>(acc, Bs, row, col, l);
            __syncthreads();  // G
#pragma unroll
            for (int m = 0; m < KT; ++m) {
                if (warp + m * (NT / 32) >= 20) continue;
#pragma unroll
                for (int e = 0; e < 4; ++e) {  // c_e is element (g + 8 (e / 2), 2 t + e % 2)
                    const int i = row[m] + l.g + 8 * (e >> 1), j = col[m] + 2 * l.t + (e & 1);
                    acc[m][e] = j < i ? bs[i] * __expf(gs[i] - gs[j]) * acc[m][e] : 0.f;
                }
                store_c(As + row[m] * LC + col[m], LC, acc[m], l);
            }
        }
        __syncthreads();

        // T = (I + A)^-1 by 16x16 blocks. Diagonal blocks by forward substitution in registers:
        // warps 0 and 1, a half-warp a block, a lane a column c, holding T[.][c] of its block;
        // T[i][c] = [i == c] - (E + O), E and O the sums of A[i][j] T[j][c] over even and odd
        // j < i, each in ascending j. T[j][c] = +0 for j < c, so those terms leave a sum at +0 and
        // each sum starts where a lane of the earlier two-lanes-a-column form started its own
        // (j = c or c + 1): the same operations on the same values, with no shared-memory round
        // trip a row.
        if (warp < 2) {
            const int lane = tid & 31, b0 = (2 * warp + (lane >> 4)) * 16, c = lane & 15;
            const float* Ab = As + b0 * LC + b0;
            float t[16];
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                float ar[16];
#pragma unroll
                for (int j4 = 0; j4 < i; j4 += 4) {  // the row's first i values (16-byte loads)
                    const float4 x = *reinterpret_cast<const float4*>(Ab + i * LC + j4);
                    ar[j4] = x.x;
                    ar[j4 + 1] = x.y;
                    ar[j4 + 2] = x.z;
                    ar[j4 + 3] = x.w;
                }
                float e = 0.f, o = 0.f;
#pragma unroll
                for (int j = 0; j < i; ++j) {
                    if (j & 1)
                        o = fmaf(ar[j], t[j], o);
                    else
                        e = fmaf(ar[j], t[j], e);
                }
                t[i] = (c == i ? 1.f : 0.f) - (e + o);
            }
#pragma unroll
            for (int i = 0; i < 16; ++i) Ts[(b0 + i) * LC + b0 + c] = t[i];
        }
        __syncthreads();
        // off-diagonal blocks, one distance at a time: T_ij = -T_ii sum_{k=j}^{i-1} A_ik T_kj, each
        // (block pair, 8-column half) a warp, on tensor cores at fp32 accuracy (mma3); the pair's
        // sum X lands in Xs[pair] for its second product. Blocks above the diagonal are never read.
        for (int dist = 1; dist < 4; ++dist) {
            const int p = warp >> 1, half = warp & 1;
            if (p < 4 - dist) {
                const int bi = dist + p, bj = p, n0 = bj * 16 + half * 8;
                float x[4] = {0.f, 0.f, 0.f, 0.f};
                for (int k0 = bj * 16; k0 < bi * 16; k0 += 8) {
                    float a[4], b[2];
                    load_af(a, As + bi * 16 * LC + k0, LC, 1, l);
                    load_bf(b, Ts + k0 * LC + n0, LC, 1, l);
                    mma3(x, a, b);
                }
                float* X = Xs + p * 16 * LX + half * 8;
                store_c(X, LX, x, l);
                __syncwarp();
                float y[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int k0 = 0; k0 < 16; k0 += 8) {
                    float a[4], b[2];
                    load_af(a, Ts + bi * 16 * LC + bi * 16 + k0, LC, 1, l);
                    load_bf(b, X + k0 * LX, LX, 1, l);
                    mma3(y, a, b);
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) y[e] = -y[e];
                store_c(Ts + bi * 16 * LC + n0, LC, y, l);
            }
            __syncthreads();
        }

        // [W | U~] = (T diag(beta e^G)) K | (T diag(beta)) V, straight to the scratch (scaling T's
        // columns, not K's and V's rows: no pass over [k | v]); warp w takes W (even w) or U~, 64
        // columns ((w >> 1) & 1), and the row tiles {0, 3} or {1, 2} (w >> 2): 10 k steps of 8
        // column tiles each (wu_tile), the same for every warp.
        const long slot = (long)job.slot * H + h;
        {
            const int cols = ((warp >> 1) & 1) * (D / 2), pair = warp >> 2;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int ti = half == 0 ? pair : 3 - pair;
                if ((warp & 1) == 0)
                    wu_tile<true>(Ts, Bs + cols, gs, bs, W + slot * CH * D + cols, ti, l);
                else
                    wu_tile<false>(Ts, Bs + D + cols, gs, bs, U + slot * CH * D + cols, ti, l);
            }
        }
        if (tid < CH) gcum[slot * CH + tid] = gs[tid];
    }
    finish_items(counters);
}

// A chunk's tile of 64 rows of COLS floats (rows D floats apart from src) into shared memory (rows
// ld floats apart), as 16-byte asynchronous copies by NTH threads: a thread's rows at constant
// offsets from one address (each row's address from a 64-bit index took 4 instructions a copy).
template <int NTH, int COLS>
__device__ __forceinline__ void copy_tile(float* dst, int ld, const float* __restrict__ src) {
    constexpr int STEP = NTH / (COLS / 4);  // rows between a thread's copies
    static_assert(NTH % (COLS / 4) == 0 && CH % STEP == 0, "whole rows a step");
    const int r = threadIdx.x / (COLS / 4), d = (threadIdx.x % (COLS / 4)) * 4;
    const float* from = src + (long)r * D + d;
#pragma unroll
    for (int it = 0; it < CH / STEP; ++it) cp_async16(dst + (r + it * STEP) * ld + d, from + it * STEP * D, true);
}

// The sequential pass, grid (D / NCOL, H, N), block NTH, dynamic shared memory GDN_STATE_SMEM.
// Per chunk only U = U~ - W S and, for a finished chunk, S <- e^{G_C} S + K^T (e^{G_C - G} U); the next
// chunk's W, K (the solve's K tile Kt), U~ and G are copied in while this one computes (two
// buffers). It stores S_c (the state at the chunk's start, [slots, H, 128, 128]) and U (over U~, in place) for
// gdn_chunk_out. One launch runs the segments of one level, level_off[level] ..
// level_off[level + 1] - 1; segment n starts from init_idx[n]: > 0 state slot init_slots[idx]
// ([1 + S, H, 128, 128] fp32), -1 zeros, -2 - p the final state of in-pass parent p (which an
// earlier level's launch wrote). final_state: [N, H, 128, 128] fp32, the state at each segment's
// last chunk boundary.
template <int NTH>
__device__ __forceinline__ void chunk_state(const float* __restrict__ Kt, const float* __restrict__ W,
                                            float* __restrict__ U, const float* __restrict__ gcum,
                                            const int* __restrict__ cu, const int* __restrict__ pos, int H, int Hk,
                                            int max_chunks, const float* __restrict__ init_slots,
                                            const int* __restrict__ init_idx, const int* __restrict__ level_off,
                                            int level, float* __restrict__ Sc,
                                            float* __restrict__ final_state, const int* __restrict__ list,
                                            int* __restrict__ counters) {
    extern __shared__ __align__(128) float state_smem[];
    constexpr int BUF = CH * LK + CH * LKS + CH * LS + CH;  // one chunk: W [64][LK], K [64][LKS], U [64][LS], G [64]
    constexpr int TN = NCOL / 8;                      // 8-column tiles of the state a block owns
    // [NCOL][LK] the state columns col0 .. col0 + NCOL - 1, n-major (element (i, j) at j * LK + i),
    // rounded to tf32: U's product reads them as B fragments by ldmatrix, as they are. The state
    // itself (fp32) stays in the update's registers from chunk to chunk.
    float* Ss = state_smem;
    // the update's tiles of the state: a warp TPB 8-column tiles of one 16-row tile
    constexpr int TPB = (D / 16) * TN / (NTH / 32);
    static_assert(TPB >= 2 && TPB % 2 == 0 && TN % TPB == 0, "whole column groups a warp, in pairs");

    __shared__ int ticket;
    const int seg0 = level_off[level], items = (level_off[level + 1] - seg0) * H * (D / NCOL);
    for (;;) {
        const int item = next_item(counters, &ticket);
        if (item >= items) break;
        const int n = seg0 + item / (H * (D / NCOL)), h = item / (D / NCOL) % H, col0 = item % (D / NCOL) * NCOL;
        const int hk = h / (H / Hk);
        const int tid = threadIdx.x, warp = tid >> 5;
        const Lane l = lane_of();
        const Seg s = segment(cu, pos, list, n, max_chunks);
        const long state_base = ((long)n * H + h) * D * D;
        const int from = init_idx[n];
        const float* init = from > 0 ? init_slots + ((long)from * H + h) * D * D
                                     : from <= -2 ? final_state + ((long)(-2 - from) * H + h) * D * D : nullptr;

        // chunk c's copies into buffer c & 1, one cp.async group
        auto issue = [&](int c) {
            float* Wb = Ss + NCOL * LK + (c & 1) * BUF;
            float* Kb = Wb + CH * LK;
            float* Ub = Kb + CH * LKS;
            float* gb = Ub + CH * LS;
            const long slot = (long)(s.first + c) * H + h;
            copy_tile<NTH, D>(Kb, LKS, Kt + ((long)(s.first + c) * Hk + hk) * CH * D);  // the solve's K tile
            copy_tile<NTH, D>(Wb, LK, W + slot * CH * D);
            copy_tile<NTH, NCOL>(Ub, LS, U + slot * CH * D + col0);
            if (tid < CH / 4) cp_async16(gb + tid * 4, gcum + slot * CH + tid * 4, true);
            cp_async_commit();
        };

        // S_0, into shared memory and (the first chunk's start state) into Sc; later chunks' start
        // states are stored from the registers of the update that makes them
        for (int idx = tid; idx < D * NCOL; idx += NTH) {
            const int i = idx / NCOL, j = idx % NCOL;
            const float x = init != nullptr ? init[(long)i * D + col0 + j] : 0.f;
            Ss[j * LK + i] = x;
            if (s.chunks > 0) Sc[((long)s.first * H + h) * D * D + (long)i * D + col0 + j] = rnd(x);
        }
        __syncthreads();
        // each warp takes its tiles of S_0 into registers and leaves them rounded in shared memory
        // (a lane rewrites the elements it read: no barrier between)
        const int t0 = warp * TPB, ti = t0 / TN, n0 = (t0 % TN) * 8;
        float st[TPB][4];
#pragma unroll
        for (int j = 0; j < TPB; ++j) {
            load_c_t(st[j], Ss + (n0 + j * 8) * LK + ti * 16, LK, l);
            const float rs[4] = {rnd(st[j][0]), rnd(st[j][1]), rnd(st[j][2]), rnd(st[j][3])};
            store_c_t(Ss + (n0 + j * 8) * LK + ti * 16, LK, rs, l);
        }
        if (s.chunks > 0) issue(0);
        for (int c = 0; c < s.chunks; ++c) {
            // the other buffer was last read by chunk c - 1, which ended with a barrier
            if (c + 1 < s.chunks) issue(c + 1);
            else cp_async_commit();  // an empty group keeps "all but the newest" meaning chunk c
            cp_async_wait<1>();
            __syncthreads();
            float* Wb = Ss + NCOL * LK + (c & 1) * BUF;
            float* Kb = Wb + CH * LK;
            float* Ub = Kb + CH * LKS;  // U~ [64][LS], then the decayed U n-major [NCOL][LC]
            const float* gb = Ub + CH * LS;
            const long slot = (long)(s.first + c) * H + h;
            const float g_end = gb[CH - 1];
            // U = U~ - W S: a warp one 16-row tile by TPW 8-column tiles (its W fragments shared)
            constexpr int TPW = (CH / 16) * TN / (NTH / 32);
            static_assert(TPW >= 2 && TPW % 2 == 0 && TN % TPW == 0, "whole column groups a warp, in pairs");
            const int ut0 = warp * TPW, uti = ut0 / TN, un0 = (ut0 % TN) * 8;
            float u[TPW][4];
#pragma unroll
            for (int j = 0; j < TPW; ++j) load_c(u[j], Ub + uti * 16 * LS + un0 + j * 8, LS, l);
#pragma unroll 4
            for (int k0 = 0; k0 < D; k0 += 8) {
                u32 w[4];
                ldsm_a(w, Wb + uti * 16 * LK + k0, LK);  // -W, rounded by the solve
#pragma unroll
                for (int j = 0; j < TPW; j += 2) {
                    u32 b[2][2];
                    ldsm_b2(b[0], b[1], Ss + (un0 + j * 8) * LK + k0, LK);  // S, rounded
                    mma(u[j], w, b[0]);
                    mma(u[j + 1], w, b[1]);
                }
            }
            {
                // U to global for the output pass; e^{G_C - G_r} U to shared memory for the update
                // below (the decay of K~ = e^{G_C - G} K moved onto U's rows: one pass over K fewer);
                // both are only ever tf32 operands: stored rounded
                const float dlo = __expf(g_end - gb[uti * 16 + l.g]), dhi = __expf(g_end - gb[uti * 16 + l.g + 8]);
#pragma unroll
                for (int j = 0; j < TPW; ++j) {
                    const float ru[4] = {rnd(u[j][0]), rnd(u[j][1]), rnd(u[j][2]), rnd(u[j][3])};
                    store_c(U + (slot * CH + uti * 16) * D + col0 + un0 + j * 8, D, ru, l);
                }
                __syncthreads();  // every warp has read its U~: the decayed U goes over it, n-major
#pragma unroll
                for (int j = 0; j < TPW; ++j) {
                    const float su[4] = {rnd(u[j][0] * dlo), rnd(u[j][1] * dlo), rnd(u[j][2] * dhi), rnd(u[j][3] * dhi)};
                    store_c_t(Ub + (un0 + j * 8) * LC + uti * 16, LC, su, l);
                }
            }
            __syncthreads();
            if (s.rows - c * CH >= CH) {  // a finished chunk: S <- e^{G_C} S + K^T (e^{G_C - G} U)
                const float decay = __expf(g_end);
#pragma unroll
                for (int j = 0; j < TPB; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) st[j][e] *= decay;
#pragma unroll
                for (int k0 = 0; k0 < CH; k0 += 8) {
                    u32 a[4];
                    load_a<true>(a, Kb + k0 * LKS + ti * 16, 1, LKS, l);  // (i, k) = K[k][i], rounded by the solve
#pragma unroll
                    for (int j = 0; j < TPB; j += 2) {
                        u32 b[2][2];  // the decayed U, stored rounded
                        ldsm_b2(b[0], b[1], Ub + (n0 + j * 8) * LC + k0, LC);
                        mma(st[j], a, b[0]);
                        mma(st[j + 1], a, b[1]);
                    }
                }
                // S_{c+1}, rounded (an operand only, as S_{c+1} here): to shared memory for the next
                // chunk's U, and as that chunk's start state to Sc for the output pass
                const bool next = c + 1 < s.chunks;
                float* sc_next = Sc + (slot + H) * D * D + (long)(ti * 16) * D + col0 + n0;
#pragma unroll
                for (int j = 0; j < TPB; ++j) {
                    const float rs[4] = {rnd(st[j][0]), rnd(st[j][1]), rnd(st[j][2]), rnd(st[j][3])};
                    store_c_t(Ss + (n0 + j * 8) * LK + ti * 16, LK, rs, l);
                    if (next) store_c(sc_next + j * 8, D, rs, l);
                }
            }
            __syncthreads();  // this buffer and the state are done before the next chunk's copies and products
        }
#pragma unroll
        for (int j = 0; j < TPB; ++j)
            store_c(final_state + state_base + (long)(ti * 16) * D + col0 + n0 + j * 8, D, st[j], l);
    }
    finish_items(counters);
}

#define GDN_CHUNK_STATE(NAME, NTH)                                                                                   \
    extern "C" __global__ void __launch_bounds__(NTH) NAME(                                                          \
        const float* __restrict__ Kt, const float* __restrict__ W, float* __restrict__ U,                            \
        const float* __restrict__ gcum, const int* __restrict__ cu, const int* __restrict__ pos, int H, int Hk,      \
        int max_chunks, const float* __restrict__ init_slots, const int* __restrict__ init_idx,                      \
        const int* __restrict__ level_off, int level, float* __restrict__ Sc, float* __restrict__ final_state,       \
        const int* __restrict__ list, int* __restrict__ counters) {                                                  \
        chunk_state<NTH>(Kt, W, U, gcum, cu, pos, H, Hk, max_chunks, init_slots, init_idx, level_off, level, Sc,     \
                         final_state, list, counters);                                                               \
    }
GDN_CHUNK_STATE(gdn_chunk_state_w8, 256)
GDN_CHUNK_STATE(gdn_chunk_state_w16, 512)

// S_c ([D][D]) and U ([CH][D]) of item `ticket` (slot * H + h) into shared memory rows of LKS
__device__ __forceinline__ void copy_out_states(float* Ss, float* Us, const float* __restrict__ Sc,
                                                const float* __restrict__ U, long ticket) {
    copy_tile<NTO, D>(Ss, LKS, Sc + ticket * D * D);
    copy_tile<NTO, D>(Ss + CH * LKS, LKS, Sc + ticket * D * D + CH * D);
    copy_tile<NTO, D>(Us, LKS, U + ticket * CH * D);
}

// an output item's q rows (zeros where a row has no query) and G
__device__ __forceinline__ void copy_out_rows(float* Qs, float* gs, const float* __restrict__ qn,
                                              const float* __restrict__ gcum, const ChunkItem& it, int H, int Hk) {
    const int hk = it.h / (H / Hk), r0 = it.c * CH;
#pragma unroll
    for (int k = 0; k < CH * (D / 4) / NTO; ++k) {
        const int idx = threadIdx.x + k * NTO;
        const int r = idx / (D / 4), d = (idx % (D / 4)) * 4, vr = r0 + r;
        const bool own = vr >= it.s.tail && vr < it.s.rows;
        cp_async16(Qs + r * LK + d, own ? qn + ((long)(it.s.start + vr - it.s.tail) * Hk + hk) * D + d : qn, own);
    }
    if (threadIdx.x < CH / 4)
        cp_async16(gs + threadIdx.x * 4, gcum + ((long)it.slot * H + it.h) * CH + threadIdx.x * 4, true);
}

// The output pass, a block of NTO threads an SM taking (chunk, head) items by ticket, dynamic
// shared memory GDN_OUT_SMEM: every chunk of every head, from S_c and U of gdn_chunk_state. Warp w
// owns the 8 OJ value columns from 8 OJ w of all 64 rows, so each A fragment of q and P it loads
// feeds OJ products (the pass is bound by shared memory; OJ = 2 with 8 warps: 16 warps of one
// column tile each loaded all of q twice as often). Every input of the next item is copied in
// while an item computes, so that an item waits for no copy: its S_c and U (96 KB, the pass's
// largest read) once this item's warps hold their fragments of them in registers, its q rows and
// G into the other of two buffers, and its K tile once P is formed. P forms once a chunk (one
// block holds all columns). out: [T, H, 128] bf16, own rows only (tail rows have no query: their
// outputs belong to the parent).
extern "C" __global__ void __launch_bounds__(NTO, 1) gdn_chunk_out(
    const float* __restrict__ qn, const float* __restrict__ Kt, const float* __restrict__ U,
    const float* __restrict__ Sc, const float* __restrict__ gcum, int H, int Hk, __nv_bfloat16* __restrict__ out,
    const int* __restrict__ list, int* __restrict__ counters) {
    extern __shared__ __align__(128) float out_smem[];
    float* Qb = out_smem;          // [2][64][LK] q (two buffers)
    float* Ks = Qb + 2 * CH * LK;  // [64][LK]    k
    float* Ps = Ks + CH * LK;      // [64][LC]    P
    float* gb = Ps + CH * LC;      // [2][64]     G
    float* Ss = gb + 2 * CH;       // [128][LKS]  S_c of the item taken next
    float* Us = Ss + D * LKS;      // [64][LKS]   its U

    __shared__ int ticket, upcoming;
    __shared__ int4 chunk_desc, upcoming_desc;
    ChunkTickets tickets(list, counters, H, &ticket, &chunk_desc);
    if (threadIdx.x == 0) {
        upcoming = tickets.upcoming();
        upcoming_desc = tickets.upcoming_desc();
    }
    auto copy_k = [&](const ChunkItem& it) {  // the solve's K tile of an item
        copy_tile<NTO, D>(Ks, LK, Kt + ((long)it.slot * Hk + it.h / (H / Hk)) * CH * D);
    };
    // the upcoming item's S_c and U, and its q rows and G into buffer b
    auto copy_states_rows = [&](const ChunkItem& it, int b) {
        copy_out_states(Ss, Us, Sc, U, upcoming);
        copy_out_rows(Qb + b * CH * LK, gb + b * CH, qn, gcum, it, H, Hk);
    };
    __syncthreads();
    if (upcoming >= 0) {
        const ChunkItem nx = chunk_item(upcoming, upcoming_desc, H);
        copy_states_rows(nx, 0);
        copy_k(nx);
    }
    cp_async_commit();
    ChunkItem job;
    for (int taken = 0; tickets.take(job); ++taken) {
        const int h = job.h, c = job.c;
        const int col = (threadIdx.x >> 5) * 8 * OJ;  // this warp's value columns
        const int tid = threadIdx.x, warp = tid >> 5;
        const Lane l = lane_of();
        const Seg& s = job.s;
        const int r0 = c * CH;
        const int b = taken & 1;
        float* Qs = Qb + b * CH * LK;
        const float* gs = gb + b * CH;

        tickets.prefetch();
        cp_async_wait<0>();
        __syncthreads();
        // B fragments of S_c (k = key row, n = column) and of U (k = chunk row) for this warp's strip
        float sf[OJ][D / 8][2], uf[OJ][CH / 8][2];
#pragma unroll
        for (int j = 0; j < OJ; ++j) {
#pragma unroll
            for (int k = 0; k < D / 8; ++k) {
                sf[j][k][0] = Ss[(k * 8 + l.t) * LKS + col + 8 * j + l.g];
                sf[j][k][1] = Ss[(k * 8 + l.t + 4) * LKS + col + 8 * j + l.g];
            }
#pragma unroll
            for (int k = 0; k < CH / 8; ++k) {
                uf[j][k][0] = Us[(k * 8 + l.t) * LKS + col + 8 * j + l.g];
                uf[j][k][1] = Us[(k * 8 + l.t + 4) * LKS + col + 8 * j + l.g];
            }
        }
        for (int idx = tid; idx < CH * D / 4; idx += NTO) {  // q is only a tf32 operand here (k came rounded)
            float4* x = reinterpret_cast<float4*>(Qs + (idx / (D / 4)) * LK + (idx % (D / 4)) * 4);
            const float4 y = *x;
            *x = make_float4(rnd(y.x), rnd(y.y), rnd(y.z), rnd(y.w));
        }
        if (tid == 0) {
            upcoming = tickets.upcoming();
            upcoming_desc = tickets.upcoming_desc();
        }
        __syncthreads();  // S_c and U are in registers: the next item's copy in while this one computes
        ChunkItem nx;
        if (upcoming >= 0) {
            nx = chunk_item(upcoming, upcoming_desc, H);
            copy_states_rows(nx, b ^ 1);
        }
        cp_async_commit();

        // P = (q k^T) e^{G_i - G_j}, j <= i: the 10 16 x 16 tiles at or below the diagonal (up to
        // PT a warp), each as two 16 x 8 halves that share its q fragments, masked and decayed in
        // registers
        constexpr int PT = (10 + NTO / 32 - 1) / (NTO / 32);
#pragma unroll
        for (int q = 0; q < PT; ++q) {
            const int t = warp + q * (NTO / 32);
            if (t < 10) {
                int ti, tj;
                lower_tile(t, ti, tj);
                float p[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll 2
                for (int k0 = 0; k0 < D; k0 += 16) {
                    u32 a0[4], a1[4];
                    ldsm_a(a0, Qs + ti * 16 * LK + k0, LK);
                    ldsm_a(a1, Qs + ti * 16 * LK + k0 + 8, LK);
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        u32 b0[2], b1[2];
                        ldsm_b_k2(b0, b1, Ks + (tj * 16 + half * 8) * LK + k0, LK);  // (k, n) = k_n[k]
                        mma(p[half], a0, b0);
                        mma(p[half], a1, b1);
                    }
                }
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int n0 = tj * 16 + half * 8;
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int i = ti * 16 + l.g + (e >> 1) * 8, j = n0 + 2 * l.t + (e & 1);
                        p[half][e] = j <= i ? __expf(gs[i] - gs[j]) * p[half][e] : 0.f;
                    }
                    // a tf32 operand
                    const float rp[4] = {rnd(p[half][0]), rnd(p[half][1]), rnd(p[half][2]), rnd(p[half][3])};
                    store_c(Ps + ti * 16 * LC + n0, LC, rp, l);
                }
            }
        }
        __syncthreads();  // P is whole and every warp is done with k
        if (upcoming >= 0) copy_k(nx);
        cp_async_commit();

        // O = e^G (Q S_c) + P U on the warp's 64 x 8 OJ strip (P is zero above its diagonal tiles);
        // every column tile's products in the same order as at OJ = 1, so the same bits
        float o[4][OJ][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < OJ; ++j) o[i][j][0] = o[i][j][1] = o[i][j][2] = o[i][j][3] = 0.f;
#pragma unroll
        for (int k = 0; k < D / 8; ++k) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                u32 a[4];
                ldsm_a(a, Qs + i * 16 * LK + k * 8, LK);
#pragma unroll
                for (int j = 0; j < OJ; ++j) {  // S_c: stored rounded
                    const u32 b[2] = {__float_as_uint(sf[j][k][0]), __float_as_uint(sf[j][k][1])};
                    mma(o[i][j], a, b);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float lo = __expf(gs[i * 16 + l.g]), hi = __expf(gs[i * 16 + l.g + 8]);
#pragma unroll
            for (int j = 0; j < OJ; ++j) {
                o[i][j][0] *= lo;
                o[i][j][1] *= lo;
                o[i][j][2] *= hi;
                o[i][j][3] *= hi;
            }
        }
#pragma unroll
        for (int k = 0; k < CH / 8; ++k) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                if (k * 8 >= (i + 1) * 16) continue;
                u32 a[4];
                ldsm_a(a, Ps + i * 16 * LC + k * 8, LC);
#pragma unroll
                for (int j = 0; j < OJ; ++j) {  // U: stored rounded
                    const u32 b[2] = {__float_as_uint(uf[j][k][0]), __float_as_uint(uf[j][k][1])};
                    mma(o[i][j], a, b);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int vr = r0 + i * 16 + l.g + e * 8;
                if (vr >= s.tail && vr < s.rows)
#pragma unroll
                    for (int j = 0; j < OJ; ++j)
                        *reinterpret_cast<__nv_bfloat162*>(out + ((long)(s.start + vr - s.tail) * H + h) * D + col +
                                                           8 * j + 2 * l.t) =
                            __floats2bfloat162_rn(o[i][j][2 * e], o[i][j][2 * e + 1]);
            }
        }
    }
    finish_items(counters);
}
