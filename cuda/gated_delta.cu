// Gated DeltaNet prefill over packed segments (fp32 state), for Qwen3.5's linear layers.
//
// Two kernels:
//   gdn_prepare: conv output -> L2-normalized q (times Dk^-0.5) and k in fp32, g and beta in fp32.
//   gdn_recurrent_s*: the exact per-token recurrence (s8c32x2 the default)
//       S <- e^g S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
//     with each segment starting from its parent's state and writing its final state.
//
// Why a recurrence and not the chunked (WY) form: the state lives in registers, so a launch
// costs one pass over q/k/v/o and two over the state, with no per-call setup; at the prefill
// sizes of a request (tens to a few thousand tokens per segment) it is latency-bound at a few
// hundred cycles a token. Column j of the state only ever needs column j, so the 128 value
// columns are independent; each is split over PARTS threads (adjacent lanes) that each hold
// 128/PARTS rows of it, so S^T k and S^T q are PARTS-way shuffle reductions.
#include "common.cuh"

#if !defined(GDN_DIM)
#error "compile with the definitions of openjev.worker.cuda.traits"
#endif
#define DK GDN_DIM
#define DV GDN_DIM

// Timing probe only (benchmarks/gdn_stamps.py compiles this file with GDN_STAMPS defined; the
// worker never does): thread 0 of each of the first GDN_STAMP_BLOCKS blocks records
// %globaltimer (ns) at the points STAMP names (those inside the work loop for its first item
// only) and how many items it took.
#if defined(GDN_STAMPS)
#define GDN_STAMP_BLOCKS 1024
enum { ST_START, ST_ROLE, ST_TICKET, ST_PARENT, ST_BUFFER, ST_TOKENS, ST_FLAG, ST_LOOP, ST_EXIT, ST_ITEMS, ST_N };
__device__ unsigned long long gdn_stamps[GDN_STAMP_BLOCKS][ST_N];
__device__ __forceinline__ unsigned long long gdn_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#define STAMP(k, first) \
    if (tid == 0 && (first) && blockIdx.x < GDN_STAMP_BLOCKS) gdn_stamps[blockIdx.x][k] = gdn_now()
#define STAMP_ITEMS(n) \
    if (tid == 0 && blockIdx.x < GDN_STAMP_BLOCKS) gdn_stamps[blockIdx.x][ST_ITEMS] = (n)
#else
#define STAMP(k, first)
#define STAMP_ITEMS(n)
#endif

// conv_out: [T, conv_stride] bf16 whose first 2*Hk*DK columns are q then k.
// a, b:     [T, H] bf16 with row stride ab_stride (views into the fused projection)
// A_log, dt_bias: [H] fp32
// qn, kn:   [T, Hk, DK] fp32 out; g, beta: [T, H] fp32 out; kq: [T, Hk] fp32 out = qn . kn
// Block per token: warps take the Hk key heads in turn (q and k rows, 4 elements a lane each),
// then threads take the H gates.
static_assert(DK == 32 * 4, "gdn_prepare: a warp holds a q or k head row, 4 elements a lane");
extern "C" __global__ void gdn_prepare(const __nv_bfloat16* __restrict__ conv_out, long conv_stride,
                                       const __nv_bfloat16* __restrict__ a,
                                       const __nv_bfloat16* __restrict__ b, long ab_stride,
                                       const float* __restrict__ A_log,
                                       const float* __restrict__ dt_bias, int H, int Hk,
                                       float* __restrict__ qn, float* __restrict__ kn,
                                       float* __restrict__ g, float* __restrict__ beta,
                                       float* __restrict__ kq) {
    const int t = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int nwarps = blockDim.x >> 5;
    const __nv_bfloat16* row = conv_out + (long)t * conv_stride;
    for (int hk = warp; hk < Hk; hk += nwarps) {
        float f[2][4], ss[2];
#pragma unroll
        for (int is_k = 0; is_k < 2; ++is_k) {
            const __nv_bfloat16* src = row + (long)is_k * Hk * DK + hk * DK + lane * 4;
            float2 f0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(src));
            float2 f1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(src + 2));
            f[is_k][0] = f0.x; f[is_k][1] = f0.y; f[is_k][2] = f1.x; f[is_k][3] = f1.y;
            ss[is_k] = f0.x * f0.x + f0.y * f0.y + f1.x * f1.x + f1.y * f1.y;
        }
        float dot = f[0][0] * f[1][0] + f[0][1] * f[1][1] + f[0][2] * f[1][2] + f[0][3] * f[1][3];
        // three butterflies interleaved (not warp_sum thrice): their shuffles overlap
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            ss[0] += __shfl_xor_sync(0xffffffffu, ss[0], o);
            ss[1] += __shfl_xor_sync(0xffffffffu, ss[1], o);
            dot += __shfl_xor_sync(0xffffffffu, dot, o);
        }
        // l2norm(x) = x / sqrt(sum x^2 + 1e-6), as fla and transformers do
        const float sq = rsqrtf(ss[0] + 1e-6f) * rsqrtf((float)DK), sk = rsqrtf(ss[1] + 1e-6f);
        const long o = ((long)t * Hk + hk) * DK + lane * 4;
        *reinterpret_cast<float4*>(qn + o) = make_float4(f[0][0] * sq, f[0][1] * sq, f[0][2] * sq, f[0][3] * sq);
        *reinterpret_cast<float4*>(kn + o) = make_float4(f[1][0] * sk, f[1][1] * sk, f[1][2] * sk, f[1][3] * sk);
        // q.k of the normalized rows: lets the recurrence form o without a second pass over S
        if (lane == 0) kq[(long)t * Hk + hk] = dot * sq * sk;
    }
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
        float av = __bfloat162float(a[(long)t * ab_stride + h]) + dt_bias[h];
        float bv = __bfloat162float(b[(long)t * ab_stride + h]);
        // softplus with torch's threshold 20 (linear above it)
        float sp = av > 20.f ? av : log1pf(__expf(av));
        g[(long)t * H + h] = -__expf(A_log[h]) * sp;
        beta[(long)t * H + h] = sigmoid(bv);
    }
}

// qn, kn:     [T, Hk, DK] fp32 (from gdn_prepare); value head h reads key head h / (H / Hk)
// kq:         [T, Hk] fp32 = qn . kn
// v:          [T, H, DV] bf16 with row stride v_stride (a view into the conv output)
// g, beta:    [T, H] fp32
// cu_seqlens: [N+1] int32
// init_state: [*, H, DK, DV] fp32 (rows init_stride floats apart)
// init_idx:   [N] int32, where segment n starts: >= 0 row init_idx[n] of init_state; -1 zeros;
//             <= -2 row -2 - init_idx[n] of final_state (its parent in the same pass, finished
//             by an earlier launch of this pass)
// level_off:  [levels + 1] int32; this launch runs segments level_off[level] .. level_off[level_end] - 1
//             (a forest pass orders its segments by level, and launches once for all its levels
//             on a fixed grid, so graphs can hold it). Segments outside the range (a graph's pad
//             segment) never run and their out and final_state rows are left as they are; so are
//             empty segments'.
// sched:      [2 + GDN_SCHED_SMS] int32, zeros before the launch and again after it (the last block resets
//             them): a ticket counter, a count of finished blocks, workers per SM. Launches that
//             share it must not overlap (one stream).
// deps:       [1 + N * H * (DV / NCOLS)] uint64: [0] counts the launches that used it (the last block
//             adds one); then a flag per item (segment, head, column block), set to that count + 1
//             when the item's final state is written (an empty segment's at once). Same stream rule.
// out:        [T, H, DV] bf16
// final_state:[N, H, DK, DV] fp32
// grid (G) for any G (4 x the SMs: every resident slot), block NCOLS / CC * PARTS threads.
//
// Work items are (segment, column block, head) of the levels, taken in order by atomic tickets
// by "workers": blocks that found fewer than L workers on their SM (L = a level's items / SMs
// rounded up, 1 to 4, the largest of the levels); the other blocks exit at once. A worker of rank
// r on its SM takes the next ticket only when r < L of that ticket's level, so a level of few
// items (one long parent) never has more than L of them on an SM, as when each level had a
// launch of its own (without it, requests with a long parent ran 7% slower: docs/cuda-kernels.md).
// Why not one block an item on a grid sized for the pass's padded segment count: blocks of absent segments exit at once, and then the block
// scheduler stacked up to 4 live blocks on some SMs while others had none, so one 676-token
// segment took 0.32 ms in a pass's grid against 0.24 alone (docs/cuda-kernels.md). An item is
// computed the same way whichever block takes it, so the bits do not depend on the schedule.
// Segments are ordered by level, so a child's tickets come after its parent's: a block that takes
// a child whose parent is in this launch waits for the parent item of its head and columns (its
// flag in deps) and reads that state from L2. Every item it can wait for was taken earlier by a
// running block, which waits only for items taken earlier still, so no block waits forever, and
// one launch runs a whole forest (one launch a level cost a launch, a ramp and a tail each:
// docs/cuda-kernels.md).
//
// Per token, with S the state before it: kv = S^T k and sq = S^T q are independent sums over
// the same registers (interleaved chains, reduced together: with two columns a thread, as lane
// shares, 7 shuffles instead of the butterfly's 12, measured 1.3-3.9% faster); then
//   delta = beta (v - e^g kv),  o = e^g sq + (q.k) delta,  S <- e^g S + k delta^T,
// so o needs no second pass over the updated state. Each thread holds R = DK / PARTS rows of CC
// columns; a column's PARTS threads are adjacent lanes, so its sums are shuffle reductions.
//
// Pipelined: the next CP tokens' k, q, v, g, beta, q.k are copied (cp.async) into the other of two
// shared-memory buffers while this CP run, so no global load's latency is exposed (an earlier
// form that loaded 16 tokens and then waited for them was 1.25x slower at 1,024-4,096 tokens).
// Every k and q value a thread reads from shared memory feeds its CC columns (with one column a
// thread, shared memory was 71% busy on the H200; two columns gained 8%: docs/cuda-kernels.md).
// Whole buffers of 8 tokens run unrolled; a segment's last, partial buffer runs only its own
// tokens (zero-filled past the segment's end, which would be an exact no-op on S).
template <int PARTS, int NCOLS, int CC, bool SCATTER = false>
__device__ __forceinline__ void gdn_recurrent(
    const float* __restrict__ qn, const float* __restrict__ kn, const float* __restrict__ kq,
    const __nv_bfloat16* __restrict__ v, long v_stride, const float* __restrict__ g,
    const float* __restrict__ beta, const int* __restrict__ cu_seqlens, int H, int Hk,
    const float* __restrict__ init_state, long init_stride, const int* __restrict__ init_idx,
    const int* __restrict__ level_off, int level, int level_end, int* __restrict__ sched, int num_sms,
    unsigned long long* __restrict__ deps, __nv_bfloat16* __restrict__ out, float* __restrict__ final_state) {
    constexpr int R = DK / PARTS;
    constexpr int RP = R + 4;  // padded: the PARTS row groups start in different banks
    constexpr int NT = NCOLS / CC * PARTS;
    constexpr int CP = 8;  // tokens a buffer
    constexpr int KQ_COPIES = CP * (DK / 4) / NT;  // 16-byte k (and q) copies a thread a buffer
    static_assert(CP * (DK / 4) % NT == 0 && NT % (DK / 4) == 0 && CP * (NCOLS / 8) <= NT && 3 * CP <= NT,
                  "each thread's copies of a buffer are fixed (stage, below)");
    static_assert(R % 4 == 0 && NCOLS % 8 == 0 && PARTS <= 32, "16-byte copies; a column within a warp");
    __shared__ __align__(16) float k_s[2][CP][PARTS * RP];
    __shared__ __align__(16) float q_s[2][CP][PARTS * RP];
    __shared__ __align__(16) __nv_bfloat16 v_s[2][CP][NCOLS];
    __shared__ float gbk_s[2][3][CP];  // g, beta, q.k as given

    const int tid = threadIdx.x, c0 = (tid / PARTS) * CC, part = tid % PARTS;
    STAMP(ST_START, true);
    [[maybe_unused]] int taken = 0;  // items this block ran (read by the stamps only)
    const int first = level_off[level], nseg = level_off[level_end] - first;
    constexpr int CB = DV / NCOLS;  // column blocks a head
    const int items = nseg * CB * H;
    __shared__ int s_item, s_worker, s_rank;
    __shared__ unsigned long long s_done;  // what a flag of this launch's finished item holds
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    smid &= GDN_SCHED_SMS - 1;  // %smid may exceed the SM count (disabled SMs keep their numbers)
    volatile unsigned long long* flags = deps + 1;
    // workers an SM for level l, and the first ticket of level l
    auto limit = [&](int l) { return min(4, max(1, ((level_off[l + 1] - level_off[l]) * CB * H + num_sms - 1) / num_sms)); };
    auto ticket0 = [&](int l) { return (level_off[l] - first) * CB * H; };
    if (tid == 0) {
        s_done = *(volatile unsigned long long*)deps + 1;  // the last block adds one only after every block began
        int most = 1;
        for (int l = level; l < level_end; ++l) most = max(most, limit(l));
        s_rank = atomicAdd(&sched[2 + smid], 1);
        s_worker = s_rank < most;
        if (!s_worker) atomicSub(&sched[2 + smid], 1);
    }
    __syncthreads();
    STAMP(ST_ROLE, true);
    while (s_worker) {
        if (tid == 0) {
            // rank 0 always takes one, so the tickets run out; a worker leaves only then
            for (int next, l = level;; __nanosleep(200)) {
                next = *(volatile int*)&sched[0];
                while (l + 1 < level_end && next >= ticket0(l + 1)) ++l;
                if (next >= items || s_rank < limit(l)) break;
            }
            s_item = atomicAdd(&sched[0], 1);
        }
        __syncthreads();
        const int item = s_item;
        __syncthreads();  // every thread read s_item before thread 0 takes the next ticket
        if (item >= items) break;
        STAMP(ST_TICKET, taken == 0);
        const int n = first + item / (CB * H), h = item / CB % H, hk = h / (H / Hk);
        const int col0 = item % CB * NCOLS;
        const int start = cu_seqlens[n], end = cu_seqlens[n + 1];
        if (start == end) {  // whole block: an empty segment has no state anyone reads
            if (tid == 0) flags[((long)n * H + h) * CB + col0 / NCOLS] = s_done;
            continue;
        }
        const int src = init_idx[n];
        if (src < -1) {
            const int p = -2 - src;
            // a parent after its child, or empty, would hang this launch or give a state nobody
            // wrote: the plan never makes one (launch.py), so fail loudly if it ever does
            if (p >= n || cu_seqlens[p] == cu_seqlens[p + 1]) __trap();
            if (p >= first) {  // the parent runs in this launch: wait for its item
                if (tid == 0) {
                    while (flags[((long)p * H + h) * CB + col0 / NCOLS] != s_done) __nanosleep(100);
                    __threadfence();
                }
                __syncthreads();
            }
        }
        STAMP(ST_PARENT, taken == 0);
        const float* init = src >= 0    ? init_state + (long)src * init_stride + (long)h * DK * DV
                            : src < -1 ? final_state + ((long)(-2 - src) * H + h) * DK * DV
                                       : init_state;  // not read

        // what this thread copies is fixed for the item: its k/q column and first row, its v chunk.
        // (a loop over copy indices was ~30% of the loop's instructions: docs/cuda-kernels.md)
        const int kq_t0 = tid / (DK / 4), kq_d = (tid % (DK / 4)) * 4;
        const long kq_off = (long)hk * DK + kq_d;
        const u32 k_dst = smem_addr(&k_s[0][0][(kq_d / R) * RP + kq_d % R]);
        const u32 q_dst = smem_addr(&q_s[0][0][(kq_d / R) * RP + kq_d % R]);
        const u32 v_dst = smem_addr(&v_s[0][tid / (NCOLS / 8) % CP][tid % (NCOLS / 8) * 8]);
        const long v_off = (long)h * DV + col0 + tid % (NCOLS / 8) * 8;
        __nv_bfloat16* const out_row = out + (long)h * DV + col0 + c0;  // + token * H * DV
        auto stage = [&](int buf, int cs) {
            const int cnt = min(CP, end - cs);
#pragma unroll
            for (int j = 0; j < KQ_COPIES; ++j) {
                const int t = kq_t0 + j * (NT / (DK / 4));
                const bool ok = t < cnt;
                const long at = (long)(ok ? cs + t : cs) * Hk * DK + kq_off;
                const u32 bo = buf * (u32)sizeof(k_s[0]) + t * (u32)sizeof(k_s[0][0]);
                cp_async16(k_dst + bo, kn + at, ok ? 16 : 0);
                cp_async16(q_dst + bo, qn + at, ok ? 16 : 0);
            }
            if (tid < CP * (NCOLS / 8)) {
                const int t = tid / (NCOLS / 8);
                const bool ok = t < cnt;
                cp_async16(v_dst + buf * (u32)sizeof(v_s[0]), v + (long)(ok ? cs + t : cs) * v_stride + v_off, ok ? 16 : 0);
            }
            if (tid < 3 * CP) {
                const int which = tid / CP, t = tid % CP;
                const long at = t < cnt ? cs + t : cs;
                const float* p = which == 0 ? g + at * H + h : which == 1 ? beta + at * H + h : kq + at * Hk + hk;
                cp_async4(smem_addr(&gbk_s[buf][which][t]), p, t < cnt ? 4 : 0);
            }
            cp_async_commit();
        };

        stage(0, start);
        float S[R][CC];
    #pragma unroll
        for (int i = 0; i < R; ++i)
    #pragma unroll
            for (int c = 0; c < CC; ++c) S[i][c] = src != -1 ? __ldcg(init + (long)(part * R + i) * DV + col0 + c0 + c) : 0.f;

        int buf = 0, cs = start;
        // token t of buffer buf: token cs + t of the sequence
        auto token = [&](int t) {
            const float eg = __expf(gbk_s[buf][0][t]);
            float kr[R];
            float a[CC][2], b[CC][2];
#pragma unroll
            for (int c = 0; c < CC; ++c) a[c][0] = a[c][1] = b[c][0] = b[c][1] = 0.f;
#pragma unroll
            for (int i = 0; i < R; i += 4) {
                const float4 k4 = *reinterpret_cast<const float4*>(&k_s[buf][t][part * RP + i]);
                const float4 q4 = *reinterpret_cast<const float4*>(&q_s[buf][t][part * RP + i]);
                kr[i] = k4.x; kr[i + 1] = k4.y; kr[i + 2] = k4.z; kr[i + 3] = k4.w;
#pragma unroll
                for (int c = 0; c < CC; ++c) {
                    a[c][0] = fmaf(S[i][c], k4.x, a[c][0]); a[c][1] = fmaf(S[i + 1][c], k4.y, a[c][1]);
                    b[c][0] = fmaf(S[i][c], q4.x, b[c][0]); b[c][1] = fmaf(S[i + 1][c], q4.y, b[c][1]);
                    a[c][0] = fmaf(S[i + 2][c], k4.z, a[c][0]); a[c][1] = fmaf(S[i + 3][c], k4.w, a[c][1]);
                    b[c][0] = fmaf(S[i + 2][c], q4.z, b[c][0]); b[c][1] = fmaf(S[i + 3][c], q4.w, b[c][1]);
                }
            }
            float kv[CC], sq[CC];
#pragma unroll
            for (int c = 0; c < CC; ++c) { kv[c] = a[c][0] + a[c][1]; sq[c] = b[c][0] + b[c][1]; }
            if constexpr (SCATTER) {
                // The four sums reduced over the 8 lanes as each lane's share: 4 shuffles, then 3
                // to hand kv to every lane and sq to the writer, where the butterfly below takes
                // 12. The pairs added are the butterfly's (lanes 1, 2, 4 apart), and a + b is b + a
                // bit for bit, so every sum has the butterfly's bits.
                static_assert(!SCATTER || (CC == 2 && PARTS == 8), "scatter: two columns over 8 lanes");
                const bool odd = part & 1, hi = part & 2;
                // lanes 1 apart: even lanes keep the S^T k sums, odd ones the S^T q sums
                const float w0 = (odd ? sq[0] : kv[0]) + __shfl_xor_sync(0xffffffffu, odd ? kv[0] : sq[0], 1);
                const float w1 = (odd ? sq[1] : kv[1]) + __shfl_xor_sync(0xffffffffu, odd ? kv[1] : sq[1], 1);
                // lanes 2 apart: column 0 stays where bit 1 is clear, column 1 where it is set
                float x = (hi ? w1 : w0) + __shfl_xor_sync(0xffffffffu, hi ? w0 : w1, 2);
                x += __shfl_xor_sync(0xffffffffu, x, 4);
                // part p holds (p & 1 ? sq : kv) of column (p >> 1) & 1
                kv[0] = __shfl_sync(0xffffffffu, x, 0, PARTS);
                kv[1] = __shfl_sync(0xffffffffu, x, 2, PARTS);
                sq[1] = __shfl_sync(0xffffffffu, x, 3, PARTS);
                sq[0] = x;  // part 1's (the writer's); the other parts' sq is not read
            } else {
#pragma unroll
                for (int o = 1; o < PARTS; o <<= 1)
#pragma unroll
                    for (int c = 0; c < CC; ++c) {
                        kv[c] += __shfl_xor_sync(0xffffffffu, kv[c], o);
                        sq[c] += __shfl_xor_sync(0xffffffffu, sq[c], o);
                    }
            }
            constexpr int WRITER = SCATTER ? 1 : 0;  // the part that holds the sums of S^T q
            const float bt = gbk_s[buf][1][t], kqt = gbk_s[buf][2][t];
            float delta[CC];
            if constexpr (CC == 2) {  // one 4-byte load of v and one store of o
                const float2 vv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v_s[buf][t][c0]));
                delta[0] = bt * (vv.x - eg * kv[0]);
                delta[1] = bt * (vv.y - eg * kv[1]);
                if (part == WRITER)
                    *reinterpret_cast<__nv_bfloat162*>(out_row + (long)(cs + t) * H * DV) =
                        __floats2bfloat162_rn(fmaf(eg, sq[0], kqt * delta[0]), fmaf(eg, sq[1], kqt * delta[1]));
            } else {
#pragma unroll
                for (int c = 0; c < CC; ++c) {
                    delta[c] = bt * (__bfloat162float(v_s[buf][t][c0 + c]) - eg * kv[c]);
                    if (part == 0)
                        out[((long)(cs + t) * H + h) * DV + col0 + c0 + c] = __float2bfloat16(fmaf(eg, sq[c], kqt * delta[c]));
                }
            }
#pragma unroll
            for (int i = 0; i < R; ++i)
#pragma unroll
                for (int c = 0; c < CC; ++c) S[i][c] = fmaf(S[i][c], eg, kr[i] * delta[c]);
        };
        // whole buffers of CP tokens, unrolled; then a segment's last, partial buffer, only its own
        // tokens (its rest is zero-filled, an exact no-op on S: skipped, 7 of 32 token slots of a
        // 25-token candidate, where a level of many children is bound by instructions)
        for (; cs + CP <= end; cs += CP) {
            if (cs + CP < end) stage(buf ^ 1, cs + CP);
            else cp_async_commit();  // an empty group keeps the wait count below uniform
            cp_async_wait<1>();
            __syncthreads();  // buffer buf landed for every thread
            STAMP(ST_BUFFER, taken == 0 && cs == start);
    #pragma unroll
            for (int t = 0; t < CP; ++t) token(t);
            __syncthreads();  // every thread is done with buf before the next round refills it
            buf ^= 1;
        }
        if (cs < end) {  // staged by the loop's last round (or before it, for a segment under CP tokens)
            cp_async_wait<0>();
            __syncthreads();
            STAMP(ST_BUFFER, taken == 0 && cs == start);
    #pragma unroll 1
            for (int t = 0; t < end - cs; ++t) token(t);
            __syncthreads();  // done with buf before the next item's first copies
        }
        STAMP(ST_TOKENS, taken == 0);
        const long state_base = ((long)n * H + h) * DK * DV;
    #pragma unroll
        for (int i = 0; i < R; ++i)
    #pragma unroll
            for (int c = 0; c < CC; ++c) final_state[state_base + (long)(part * R + i) * DV + col0 + c0 + c] = S[i][c];
        __threadfence();  // the state is in L2 before the flag says so
        __syncthreads();
        if (tid == 0) flags[((long)n * H + h) * CB + col0 / NCOLS] = s_done;
        STAMP(ST_FLAG, taken == 0);
        ++taken;
    }
    STAMP(ST_LOOP, true);
    if (tid == 0) {
        if (s_worker) atomicSub(&sched[2 + smid], 1);
        __threadfence();
        if (atomicAdd(&sched[1], 1) == (int)gridDim.x - 1) {  // the last block
            sched[0] = sched[1] = 0;
            *deps = s_done;
        }
    }
    STAMP(ST_EXIT, true);
    STAMP_ITEMS(taken);
}

#define GDN_ARGS                                                                               \
    const float *__restrict__ qn, const float *__restrict__ kn, const float *__restrict__ kq,  \
        const __nv_bfloat16 *__restrict__ v, long v_stride, const float *__restrict__ g,       \
        const float *__restrict__ beta, const int *__restrict__ cu_seqlens, int H, int Hk,     \
        const float *__restrict__ init_state, long init_stride, const int *__restrict__ init_idx, \
        const int *__restrict__ level_off, int level, int level_end, int *__restrict__ sched,  \
        int num_sms, unsigned long long *__restrict__ deps, __nv_bfloat16 *__restrict__ out,   \
        float *__restrict__ final_state
#define GDN_PASS                                                                                \
    qn, kn, kq, v, v_stride, g, beta, cu_seqlens, H, Hk, init_state, init_stride, init_idx,   \
        level_off, level, level_end, sched, num_sms, deps, out, final_state
#define GDN_VARIANT(name, P, NC, CC, SCATTER)                                           \
    extern "C" __global__ void __launch_bounds__(NC / CC * P, 4) name(GDN_ARGS) {           \
        gdn_recurrent<P, NC, CC, SCATTER>(GDN_PASS);                                    \
    }
// s{threads per column group}c{columns per block}x{columns per thread}; the other shapes timed
// (and the earlier unpipelined kernel's p* variants) were slower at 64-4,096 tokens
// (docs/cuda-kernels.md)
GDN_VARIANT(gdn_recurrent_s8c16x1, 8, 16, 1, false)
GDN_VARIANT(gdn_recurrent_s8c32x2, 8, 32, 2, true)  // the sums reduced as shares (above)
