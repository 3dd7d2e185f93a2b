// Gated DeltaNet prefill in groups of GR tokens at absolute positions, fp32 throughout.
//
// The token recurrence (gated_delta.cu) is one dependent chain a token: two dot products over
// the state, their shuffle reductions, the delta, the update, and only then the next token. A
// 27B layer has too few state columns to hide that chain (1-3 warps a scheduler), so it runs at
// a few hundred cycles a token. Here a group of GR tokens starts from the state S0 at its first
// position: its 2 GR dot products against S0 are independent (one reduction round for all),
// a GR x GR triangular solve per column gives the deltas, and one update adds GR rank-1 terms
// (the per-token recurrence in exact arithmetic; its fp32 rounding differs):
//   a_i = S0^T k_i,  b_i = S0^T q_i,  G_i = g_0 + .. + g_i   (i, j: rows of the group)
//   delta_i = beta_i (v_i - e^{G_i} a_i - sum_{j<i} e^{G_i - G_j} (k_i . k_j) delta_j)
//   o_i     = e^{G_i} b_i + sum_{j<=i} e^{G_i - G_j} (q_i . k_j) delta_j
//   S_end   = e^{G_last} S0 + sum_j k_j (e^{G_last - G_j} delta_j)^T
// The pair products k_i . k_j, q_i . k_j and the decay factors are the same for every column of
// a head: the block computes them once a group (shared memory), each thread only its columns.
//
// Why groups sit at absolute positions (multiples of GR from the sequence start), and tails:
// as for gdn_chunked.cu's chunks. A segment's kept state is the state at its last group
// boundary plus the rows after it (at most GR - 1; k, v, g, beta in gdn_chunked.cu's tail
// layout), and a child's first group is those rows followed by its own, computed exactly as
// the unsplit prompt computes that group. Segment n's virtual rows are its tail (pos[cu[n]] %
// GR rows, from tail_src[GR n + r]: >= 0 a packed row of this launch, < 0 row -1 - src of
// `tails`) then its own rows; tail rows have no query (their outputs are the parent's).
//
// qn, kn:     [T, Hk, DK] fp32 (gdn_prepare); value head h reads key head h / (H / Hk)
// v:          [T, H, DV] bf16, row stride v_stride; g, beta: [T, H] fp32
// cu, pos:    [N + 1] int32 segment bounds; [T] int32 positions
// init_state, init_stride, init_idx, level_off, level, sched: as gdn_recurrent (gated_delta.cu)
// tails:      [*, tail_width] fp32; tail_src: [N * GR] int32
// out:        [T, H, DV] bf16; final_state: [N, H, DK, DV] fp32, the state at each segment's last
//             group boundary; tail_out: [N, GR, tail_width] fp32, the rows after it
// grid (4 x the SMs), block NCOLS / CC * PARTS threads; work by ticket as gdn_recurrent.
#include "common.cuh"
#include "gdn_sched.cuh"

#if !defined(GDN_DIM)
#error "compile with the definitions of openjev.worker.cuda.traits"
#endif
#define DK GDN_DIM
#define DV GDN_DIM

template <int GR>
__device__ __forceinline__ void gdn_grouped(
    const float* __restrict__ qn, const float* __restrict__ kn, const __nv_bfloat16* __restrict__ v, long v_stride,
    const float* __restrict__ g, const float* __restrict__ beta, const int* __restrict__ cu,
    const int* __restrict__ pos, int H, int Hk, const float* __restrict__ init_state, long init_stride,
    const int* __restrict__ init_idx, const int* __restrict__ tail_src, const float* __restrict__ tails,
    long tail_width, const int* __restrict__ level_off, int level, int* __restrict__ sched, int num_sms,
    __nv_bfloat16* __restrict__ out, float* __restrict__ final_state, float* __restrict__ tail_out) {
    constexpr int PARTS = 8, NCOLS = 32, CC = 2;  // threads a column, columns a block, columns a thread
    constexpr int R = DK / PARTS;
    constexpr int RP = R + 4;  // padded: the PARTS row groups start in different banks
    constexpr int NT = NCOLS / CC * PARTS;
    constexpr int CP = 8;       // rows a buffer
    constexpr int NG = CP / GR;  // groups a buffer
    constexpr int CB = DV / NCOLS;
    // per group: e^{G_i} [GR], A [GR][GR], B [GR][GR], e^{G_last - G_j} [GR]
    constexpr int CF = 2 * GR + 2 * GR * GR;
    static_assert(CP % GR == 0 && R % 4 == 0 && DK == 128 && NT == 128, "layout");
    __shared__ __align__(16) float k_s[2][CP][PARTS * RP];
    __shared__ __align__(16) float q_s[2][CP][PARTS * RP];
    __shared__ __align__(16) __nv_bfloat16 v_s[2][CP][NCOLS];
    __shared__ float gb_s[2][2][CP];  // g, beta
    __shared__ float cf_s[NG][CF];

    const int tid = threadIdx.x, c0 = (tid / PARTS) * CC, part = tid % PARTS;
    const int warp = tid >> 5, lane = tid & 31;
    const int first = level_off[level], nseg = level_off[level + 1] - first;
    __shared__ int s_slot[2];
    GdnWorkers workers;
    workers.begin(s_slot, sched, nseg * CB * H, num_sms);
    for (int item; (item = workers.next(sched)) < nseg * CB * H;) {
        const int n = first + item / (CB * H), h = item / CB % H, hk = h / (H / Hk), cb = item % CB;
        const int col0 = cb * NCOLS;
        const int start = cu[n], end = cu[n + 1];
        if (start == end) continue;  // an empty segment has no state anyone reads
        const int tl = pos[start] % GR, V = tl + end - start;  // tail rows; virtual rows
        const int src = init_idx[n];
        const float* init = src >= 0    ? init_state + (long)src * init_stride + (long)h * DK * DV
                            : src < -1 ? final_state + ((long)(-2 - src) * H + h) * DK * DV
                                       : init_state;  // not read

        // Virtual rows vs .. vs + CP - 1 into buffer buf: own rows by cp.async, tail rows (only
        // in a segment's first buffer) by plain loads, rows past the end as zeros (k = q = v = 0,
        // g = 0, beta = 0: no delta, no decay, no output).
        auto stage = [&](int buf, int vs) {
            for (int idx = tid; idx < CP * (DK / 4); idx += NT) {
                const int t = idx / (DK / 4), d = (idx % (DK / 4)) * 4, vr = vs + t;
                const int dst = (d / R) * RP + d % R;
                if (vr < tl) {
                    const int ts = tail_src[n * GR + vr];
                    const float* p = ts >= 0 ? kn + ((long)ts * Hk + hk) * DK : tails + (long)(-1 - ts) * tail_width + hk * DK;
                    *reinterpret_cast<float4*>(&k_s[buf][t][dst]) = *reinterpret_cast<const float4*>(p + d);
                    *reinterpret_cast<float4*>(&q_s[buf][t][dst]) = make_float4(0.f, 0.f, 0.f, 0.f);
                } else {
                    const bool ok = vr < V;
                    const long at = ((long)(ok ? start + vr - tl : start) * Hk + hk) * DK + d;
                    cp_async16(smem_addr(&k_s[buf][t][dst]), kn + at, ok ? 16 : 0);
                    cp_async16(smem_addr(&q_s[buf][t][dst]), qn + at, ok ? 16 : 0);
                }
            }
            for (int idx = tid; idx < CP * (NCOLS / 8); idx += NT) {
                const int t = idx / (NCOLS / 8), ch = idx % (NCOLS / 8), vr = vs + t;
                const int col = h * DV + col0 + ch * 8;
                if (vr < tl) {
                    const int ts = tail_src[n * GR + vr];
                    if (ts >= 0) {
                        *reinterpret_cast<uint4*>(&v_s[buf][t][ch * 8]) =
                            *reinterpret_cast<const uint4*>(v + (long)ts * v_stride + col);
                    } else {  // tails hold v as fp32 copies of bf16 values: the round trip is exact
                        const float* p = tails + (long)(-1 - ts) * tail_width + Hk * DK + col;
                        float f[8];
#pragma unroll
                        for (int e = 0; e < 8; ++e) f[e] = p[e];
                        store8(&v_s[buf][t][ch * 8], f);
                    }
                } else {
                    const bool ok = vr < V;
                    cp_async16(smem_addr(&v_s[buf][t][ch * 8]), v + (long)(ok ? start + vr - tl : start) * v_stride + col,
                               ok ? 16 : 0);
                }
            }
            for (int idx = tid; idx < 2 * CP; idx += NT) {
                const int which = idx / CP, t = idx % CP, vr = vs + t;
                const float* base = which == 0 ? g : beta;
                if (vr < tl) {
                    const int ts = tail_src[n * GR + vr];
                    gb_s[buf][which][t] = ts >= 0 ? base[(long)ts * H + h]
                                                  : tails[(long)(-1 - ts) * tail_width + Hk * DK + H * DV + which * H + h];
                } else {
                    const bool ok = vr < V;
                    cp_async4(smem_addr(&gb_s[buf][which][t]), base + (long)(ok ? start + vr - tl : start) * H + h,
                              ok ? 4 : 0);
                }
            }
            cp_async_commit();
        };

        stage(0, 0);
        float S[R][CC];
#pragma unroll
        for (int i = 0; i < R; ++i)
#pragma unroll
            for (int c = 0; c < CC; ++c) S[i][c] = src != -1 ? init[(long)(part * R + i) * DV + col0 + c0 + c] : 0.f;

        int buf = 0;
        for (int vs = 0; vs < V; vs += CP) {
            if (vs + CP < V) stage(buf ^ 1, vs + CP);
            else cp_async_commit();  // an empty group keeps the wait count below uniform
            cp_async_wait<1>();
            __syncthreads();  // buffer buf landed for every thread

            // The groups' coefficients: pair products (a warp each, 4 floats a lane) and decays.
            {
                const int off = (lane >> 2) * RP + (lane & 3) * 4;  // lane's 4 elements of a row
                int d = 0;
#pragma unroll
                for (int gi = 0; gi < NG; ++gi) {
                    float G[GR];  // cumulative decays, summed in row order
                    float acc = 0.f;
#pragma unroll
                    for (int i = 0; i < GR; ++i) G[i] = acc += gb_s[buf][0][gi * GR + i];
#pragma unroll
                    for (int i = 0; i < GR; ++i)
#pragma unroll
                        for (int j = 0; j <= i; ++j)
#pragma unroll
                            for (int isq = 0; isq < 2; ++isq) {  // A: k_i . k_j (j < i); B: q_i . k_j (j <= i)
                                if (!isq && j == i) continue;
                                if (d++ % (NT / 32) != warp) continue;
                                const float* x = isq ? q_s[buf][gi * GR + i] : k_s[buf][gi * GR + i];
                                const float4 xa = *reinterpret_cast<const float4*>(x + off);
                                const float4 yb = *reinterpret_cast<const float4*>(&k_s[buf][gi * GR + j][off]);
                                const float s = warp_sum(xa.x * yb.x + xa.y * yb.y + xa.z * yb.z + xa.w * yb.w);
                                if (lane == 0) cf_s[gi][2 * GR + isq * GR * GR + i * GR + j] = __expf(G[i] - G[j]) * s;
                            }
#pragma unroll
                    for (int i = 0; i < GR; ++i)
                        if (tid == 32 * (i % (NT / 32)) + 1) {  // lanes not busy storing a product
                            cf_s[gi][i] = __expf(G[i]);
                            cf_s[gi][CF - GR + i] = __expf(G[GR - 1] - G[i]);
                        }
                }
            }
            __syncthreads();

#pragma unroll
            for (int gi = 0; gi < NG; ++gi) {
                const int vg = vs + gi * GR;  // the group's first virtual row
                if (vg >= V) break;
                const int r0 = gi * GR;       // its first row in the buffer
                const float* cf = cf_s[gi];
                float a[GR][CC], b[GR][CC];
#pragma unroll
                for (int t = 0; t < GR; ++t)
#pragma unroll
                    for (int c = 0; c < CC; ++c) a[t][c] = b[t][c] = 0.f;
#pragma unroll
                for (int i = 0; i < R; i += 4) {
#pragma unroll
                    for (int t = 0; t < GR; ++t) {
                        const float4 k4 = *reinterpret_cast<const float4*>(&k_s[buf][r0 + t][part * RP + i]);
                        const float4 q4 = *reinterpret_cast<const float4*>(&q_s[buf][r0 + t][part * RP + i]);
#pragma unroll
                        for (int c = 0; c < CC; ++c) {
                            a[t][c] = fmaf(S[i][c], k4.x, a[t][c]);
                            b[t][c] = fmaf(S[i][c], q4.x, b[t][c]);
                            a[t][c] = fmaf(S[i + 1][c], k4.y, a[t][c]);
                            b[t][c] = fmaf(S[i + 1][c], q4.y, b[t][c]);
                            a[t][c] = fmaf(S[i + 2][c], k4.z, a[t][c]);
                            b[t][c] = fmaf(S[i + 2][c], q4.z, b[t][c]);
                            a[t][c] = fmaf(S[i + 3][c], k4.w, a[t][c]);
                            b[t][c] = fmaf(S[i + 3][c], q4.w, b[t][c]);
                        }
                    }
                }
#pragma unroll
                for (int o = 1; o < PARTS; o <<= 1)
#pragma unroll
                    for (int t = 0; t < GR; ++t)
#pragma unroll
                        for (int c = 0; c < CC; ++c) {
                            a[t][c] += __shfl_xor_sync(0xffffffffu, a[t][c], o);
                            b[t][c] += __shfl_xor_sync(0xffffffffu, b[t][c], o);
                        }
                // deltas and outputs, row after row (every part of the column computes them)
                float dl[GR][CC];
#pragma unroll
                for (int i = 0; i < GR; ++i) {
                    const float bt = gb_s[buf][1][r0 + i];
                    const bool write = part == 0 && vg + i >= tl && vg + i < V;
#pragma unroll
                    for (int c = 0; c < CC; ++c) {
                        float x = fmaf(-cf[i], a[i][c], __bfloat162float(v_s[buf][r0 + i][c0 + c]));
#pragma unroll
                        for (int j = 0; j < i; ++j) x = fmaf(-cf[2 * GR + i * GR + j], dl[j][c], x);
                        dl[i][c] = bt * x;
                        float o = cf[i] * b[i][c];
#pragma unroll
                        for (int j = 0; j <= i; ++j) o = fmaf(cf[2 * GR + GR * GR + i * GR + j], dl[j][c], o);
                        if (write) out[((long)(start + vg + i - tl) * H + h) * DV + col0 + c0 + c] = __float2bfloat16(o);
                    }
                }
                if (vg + GR <= V) {  // a whole group: S moves to its end
                    const float gl = cf[GR - 1];
#pragma unroll
                    for (int j = 0; j < GR; ++j)
#pragma unroll
                        for (int c = 0; c < CC; ++c) dl[j][c] *= cf[CF - GR + j];
#pragma unroll
                    for (int i = 0; i < R; i += 4) {
                        float kr[GR][4];
#pragma unroll
                        for (int t = 0; t < GR; ++t) {
                            const float4 k4 = *reinterpret_cast<const float4*>(&k_s[buf][r0 + t][part * RP + i]);
                            kr[t][0] = k4.x; kr[t][1] = k4.y; kr[t][2] = k4.z; kr[t][3] = k4.w;
                        }
#pragma unroll
                        for (int e = 0; e < 4; ++e)
#pragma unroll
                            for (int c = 0; c < CC; ++c) {
                                float s = S[i + e][c] * gl;
#pragma unroll
                                for (int t = 0; t < GR; ++t) s = fmaf(kr[t][e], dl[t][c], s);
                                S[i + e][c] = s;
                            }
                    }
                } else {  // the segment ends inside this group: S stays at its start, the rows go to the tail
                    float* dst = tail_out + (long)n * GR * tail_width;
                    for (int r = 0; r < V - vg; ++r) {
                        float* row = dst + r * tail_width;
                        if (cb == 0 && h % (H / Hk) == 0) row[hk * DK + tid] = k_s[buf][r0 + r][(tid / R) * RP + tid % R];
                        if (tid < NCOLS) row[Hk * DK + h * DV + col0 + tid] = __bfloat162float(v_s[buf][r0 + r][tid]);
                        if (cb == 0 && tid < 2) row[Hk * DK + H * DV + tid * H + h] = gb_s[buf][tid][r0 + r];
                    }
                }
            }
            __syncthreads();  // every thread is done with buf (and cf_s) before they are refilled
            buf ^= 1;
        }
        const long state_base = ((long)n * H + h) * DK * DV;
#pragma unroll
        for (int i = 0; i < R; ++i)
#pragma unroll
            for (int c = 0; c < CC; ++c) final_state[state_base + (long)(part * R + i) * DV + col0 + c0 + c] = S[i][c];
    }
    workers.end(sched);
}

#define GROUPED_ARGS                                                                                           \
    const float *__restrict__ qn, const float *__restrict__ kn, const __nv_bfloat16 *__restrict__ v, long v_stride, \
        const float *__restrict__ g, const float *__restrict__ beta, const int *__restrict__ cu,                   \
        const int *__restrict__ pos, int H, int Hk, const float *__restrict__ init_state, long init_stride,       \
        const int *__restrict__ init_idx, const int *__restrict__ tail_src, const float *__restrict__ tails,      \
        long tail_width, const int *__restrict__ level_off, int level, int *__restrict__ sched, int num_sms,     \
        __nv_bfloat16 *__restrict__ out, float *__restrict__ final_state, float *__restrict__ tail_out
#define GROUPED_PASS                                                                                         \
    qn, kn, v, v_stride, g, beta, cu, pos, H, Hk, init_state, init_stride, init_idx, tail_src, tails, tail_width, \
        level_off, level, sched, num_sms, out, final_state, tail_out
extern "C" __global__ void __launch_bounds__(128) gdn_grouped_g4(GROUPED_ARGS) { gdn_grouped<4>(GROUPED_PASS); }
extern "C" __global__ void __launch_bounds__(128) gdn_grouped_g8(GROUPED_ARGS) { gdn_grouped<8>(GROUPED_PASS); }
