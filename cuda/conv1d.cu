// Depthwise causal conv1d (kernel CONV_K = 4) + SiLU over packed segments, each segment starting
// from its window (the last K-1 inputs before it), read where those inputs are: no per-layer
// gather of windows before the launch (launch.py, LaunchPlan.win_src).
//
// x:          [T, C] bf16, row stride x_stride (elements): the qkv part of a wider projection
// weight:     [C, K] bf16
// win_src:    [N * (K-1)] int32: window row m of segment s (the input K-1-m rows before its start)
//             is packed row win_src[s*(K-1)+m] of x when >= 0 (an in-pass ancestor's input),
//             else row -1 - win_src[..] of `windows`
// windows:    [R, C] bf16 contiguous rows (the external parents' windows flattened; the host
//             points zero windows at a zero slot)
// cu_seqlens: [N+1] int32
// out:        [T, C] bf16 contiguous = silu(conv)
// new_window: [N, K-1, C] bf16 = the last K-1 inputs of each segment (window rows when short)
//
// One thread handles 8 channels (16-byte loads) of `rows` output rows. Grid rows past the output
// row groups build the new windows, so one launch does both jobs.
#include "common.cuh"

// CONV_K (taps) comes from the host.
#if !defined(CONV_K)
#error "compile with the definitions of openjev.worker.cuda.traits"
#endif
#define VEC 8

// Segment index of a packed row: N is small (<= a few dozen), a linear scan is cheap.
__device__ __forceinline__ int segment_of(const int* cu_seqlens, int n_seg, int t) {
    int s = 0;
    while (s + 1 < n_seg && cu_seqlens[s + 1] <= t) ++s;
    return s;
}

// Window input `rel` (-(K-1) .. -1, relative to segment s's start) at its source (win_src).
__device__ __forceinline__ void window_row(const __nv_bfloat16* x, long x_stride,
                                           const __nv_bfloat16* windows, const int* win_src, int C,
                                           int s, int rel, int c, float* f) {
    const int src = win_src[s * (CONV_K - 1) + (CONV_K - 1 + rel)];
    load8(src >= 0 ? x + (long)src * x_stride + c : windows + (long)(-1 - src) * C + c, f);
}

// Input row `rel` (relative to the segment start, may be negative) of segment s.
__device__ __forceinline__ void input_row(const __nv_bfloat16* x, long x_stride,
                                          const __nv_bfloat16* windows, const int* win_src, int C,
                                          int s, int start, int rel, int c, float* f) {
    if (rel >= 0) {
        load8(x + (long)(start + rel) * x_stride + c, f);
    } else {
        window_row(x, x_stride, windows, win_src, C, s, rel, c, f);
    }
}

// Grid row r past the output rows: window row m = r % (K-1) of segment s = r / (K-1).
__device__ __forceinline__ void new_window_row(const __nv_bfloat16* x, long x_stride, const __nv_bfloat16* windows,
                                               const int* win_src, const int* cu_seqlens, int n_seg, int C, int r,
                                               int c, __nv_bfloat16* new_window) {
    const int s = r / (CONV_K - 1);
    const int m = r % (CONV_K - 1);
    if (s >= n_seg) return;
    const int start = cu_seqlens[s];
    const int len = cu_seqlens[s + 1] - start;
    float f[VEC];
    input_row(x, x_stride, windows, win_src, C, s, start, len - (CONV_K - 1) + m, c, f);
    store8(new_window + ((long)s * (CONV_K - 1) + m) * C + c, f);
}

// 8 channels x 4 taps = 64 contiguous bytes of weight: four 16-byte loads
__device__ __forceinline__ void load_taps(const __nv_bfloat16* weight, int c, float (&w)[VEC][CONV_K]) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        float f[8];
        load8(weight + (long)c * CONV_K + q * 8, f);
#pragma unroll
        for (int e = 0; e < 8; ++e) w[(q * 8 + e) / CONV_K][(q * 8 + e) % CONV_K] = f[e];
    }
}

// A thread walks `rows` consecutive output rows of its 8 channels with the 3 inputs before the
// current row in registers: each input row is loaded once, and its registers do not grow with
// the rows it walks (an earlier form computed 4 unrolled rows from 7 loaded ones at 128
// registers: 1.3-1.5x slower from 256 tokens; holding 4 rows in flight a thread was slower too,
// docs/cuda-kernels.md). grid.y = ceil(T / rows) + 3N; the taps are summed in the same order
// whatever `rows`, so the bits do not depend on it.
extern "C" __global__ void causal_conv1d_packed(
    const __nv_bfloat16* __restrict__ x, long x_stride, const __nv_bfloat16* __restrict__ weight,
    const int* __restrict__ win_src, const __nv_bfloat16* __restrict__ windows,
    const int* __restrict__ cu_seqlens, int n_seg, int T, int C, int rows,
    __nv_bfloat16* __restrict__ out, __nv_bfloat16* __restrict__ new_window) {
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (c >= C) return;
    const int row_groups = (T + rows - 1) / rows;
    if ((int)blockIdx.y >= row_groups) {
        new_window_row(x, x_stride, windows, win_src, cu_seqlens, n_seg, C, blockIdx.y - row_groups, c, new_window);
        return;
    }
    float w[VEC][CONV_K];
    load_taps(weight, c, w);
    const int r0 = blockIdx.y * rows, r1 = min(r0 + rows, T);
    int s = segment_of(cu_seqlens, n_seg, r0);
    int start = cu_seqlens[s], next = cu_seqlens[s + 1];
    float h[CONV_K - 1][VEC];  // inputs rel - 3, rel - 2, rel - 1 of the current row
#pragma unroll
    for (int m = 0; m < CONV_K - 1; ++m)
        input_row(x, x_stride, windows, win_src, C, s, start, r0 - start - (CONV_K - 1) + m, c, h[m]);
    for (int row = r0; row < r1; ++row) {
        if (row == next) {  // the next non-empty segment starts here, from its window
            do { ++s; } while (cu_seqlens[s + 1] <= row);
            start = row;
            next = cu_seqlens[s + 1];
#pragma unroll
            for (int m = 0; m < CONV_K - 1; ++m) window_row(x, x_stride, windows, win_src, C, s, m - (CONV_K - 1), c, h[m]);
        }
        float cur[VEC], acc[VEC];
        load8(x + (long)row * x_stride + c, cur);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
            acc[i] = 0.f;
#pragma unroll
            for (int k = 0; k < CONV_K - 1; ++k) acc[i] = fmaf(w[i][k], h[k][i], acc[i]);
            acc[i] = fmaf(w[i][CONV_K - 1], cur[i], acc[i]);
            acc[i] = silu(acc[i]);
        }
        store8(out + (long)row * C + c, acc);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
#pragma unroll
            for (int k = 0; k < CONV_K - 2; ++k) h[k][i] = h[k + 1][i];
            h[CONV_K - 2][i] = cur[i];
        }
    }
}

// The GDN layer's conv fused with gdn_prepare (gated_delta.cu): one launch instead of two, and
// q and k never go through memory as bf16. The bits are those of the two kernels: the conv
// output is rounded to bf16 where causal_conv1d_packed stores it, and the norms and q . k add
// their products in gdn_prepare's order (a butterfly over 32 lanes of 4-element partials; here
// 16 lanes of two partials, xor 8, 4, 2, 1, then the pair: the same sums in the same order).
// Channel map: threads t < 32 Hk form warp hk = t / 32, its lanes 0-15 key head hk's q channels
// and 16-31 its k channels, 8 a lane; the threads after them the v channels in order, written
// to out (its q and k columns are left as they are). The last block column computes g and beta
// of its rows. qn, kn [T, Hk, DK] fp32; kq [T, Hk]; g, beta [T, H] fp32 (as gdn_prepare).
#if !defined(GDN_DIM)
#error "compile with the definitions of openjev.worker.cuda.traits"
#endif
static_assert(GDN_DIM == 16 * VEC, "a key head's q or k channels: 16 lanes of 8");
extern "C" __global__ void causal_conv1d_prepare(
    const __nv_bfloat16* __restrict__ x, long x_stride, const __nv_bfloat16* __restrict__ weight,
    const int* __restrict__ win_src, const __nv_bfloat16* __restrict__ windows,
    const int* __restrict__ cu_seqlens, int n_seg, int T, int C, int rows, int Hk,
    const __nv_bfloat16* __restrict__ a, const __nv_bfloat16* __restrict__ b, long ab_stride,
    const float* __restrict__ A_log, const float* __restrict__ dt_bias, int H,
    __nv_bfloat16* __restrict__ out, __nv_bfloat16* __restrict__ new_window, float* __restrict__ qn,
    float* __restrict__ kn, float* __restrict__ g, float* __restrict__ beta, float* __restrict__ kq) {
    const int row_groups = (T + rows - 1) / rows;
    const int r0 = blockIdx.y * rows, r1 = min(r0 + rows, T);
    if ((int)blockIdx.x == (int)gridDim.x - 1) {  // g and beta, as gdn_prepare computes them
        if ((int)blockIdx.y >= row_groups) return;
        for (int t = r0; t < r1; ++t)
            for (int h = threadIdx.x; h < H; h += blockDim.x) {
                float av = __bfloat162float(a[(long)t * ab_stride + h]) + dt_bias[h];
                float bv = __bfloat162float(b[(long)t * ab_stride + h]);
                float sp = av > 20.f ? av : log1pf(__expf(av));  // softplus, torch's threshold 20
                g[(long)t * H + h] = -__expf(A_log[h]) * sp;
                beta[(long)t * H + h] = sigmoid(bv);
            }
        return;
    }
    const int tid = blockIdx.x * blockDim.x + threadIdx.x, lane = threadIdx.x & 31;
    const bool is_qk = tid < 32 * Hk, is_k = lane >= 16;  // warp-uniform is_qk: 32 Hk threads
    const int hk = tid / 32;
    const int c = is_qk ? (is_k ? Hk * GDN_DIM : 0) + hk * GDN_DIM + VEC * (lane & 15) : tid * VEC;
    if (c >= C) return;
    if ((int)blockIdx.y >= row_groups) {
        new_window_row(x, x_stride, windows, win_src, cu_seqlens, n_seg, C, blockIdx.y - row_groups, c, new_window);
        return;
    }
    float w[VEC][CONV_K];
    load_taps(weight, c, w);
    int s = segment_of(cu_seqlens, n_seg, r0);
    int start = cu_seqlens[s], next = cu_seqlens[s + 1];
    float h[CONV_K - 1][VEC];
#pragma unroll
    for (int m = 0; m < CONV_K - 1; ++m)
        input_row(x, x_stride, windows, win_src, C, s, start, r0 - start - (CONV_K - 1) + m, c, h[m]);
    for (int row = r0; row < r1; ++row) {  // the same rows for every thread of the block
        if (row == next) {
            do { ++s; } while (cu_seqlens[s + 1] <= row);
            start = row;
            next = cu_seqlens[s + 1];
#pragma unroll
            for (int m = 0; m < CONV_K - 1; ++m) window_row(x, x_stride, windows, win_src, C, s, m - (CONV_K - 1), c, h[m]);
        }
        float cur[VEC], acc[VEC];
        load8(x + (long)row * x_stride + c, cur);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
            acc[i] = 0.f;
#pragma unroll
            for (int k = 0; k < CONV_K - 1; ++k) acc[i] = fmaf(w[i][k], h[k][i], acc[i]);
            acc[i] = fmaf(w[i][CONV_K - 1], cur[i], acc[i]);
            acc[i] = silu(acc[i]);
        }
        if (!is_qk) {
            store8(out + (long)row * C + c, acc);
        } else {
            float f[VEC], p[VEC];  // this lane's values as bf16 rounds them; the other half's
#pragma unroll
            for (int i = 0; i < VEC; ++i) f[i] = __bfloat162float(__float2bfloat16(acc[i]));
#pragma unroll
            for (int i = 0; i < VEC; ++i) p[i] = __shfl_xor_sync(0xffffffffu, f[i], 16);
            const float* qv = is_k ? p : f;
            const float* kv = is_k ? f : p;
            float ss[2], dt[2];  // gdn_prepare's lanes 2l and 2l + 1: elements 0-3 and 4-7 here
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float2 f0 = make_float2(f[4 * e], f[4 * e + 1]), f1 = make_float2(f[4 * e + 2], f[4 * e + 3]);
                ss[e] = f0.x * f0.x + f0.y * f0.y + f1.x * f1.x + f1.y * f1.y;
                const float* q4 = qv + 4 * e;
                const float* k4 = kv + 4 * e;
                dt[e] = q4[0] * k4[0] + q4[1] * k4[1] + q4[2] * k4[2] + q4[3] * k4[3];
            }
#pragma unroll
            for (int o = 8; o > 0; o >>= 1)  // gdn_prepare's xor 16, 8, 4, 2
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    ss[e] += __shfl_xor_sync(0xffffffffu, ss[e], o);
                    dt[e] += __shfl_xor_sync(0xffffffffu, dt[e], o);
                }
            const float s_own = ss[0] + ss[1], dot = dt[0] + dt[1];  // its xor 1
            const float s_other = __shfl_xor_sync(0xffffffffu, s_own, 16);
            const float sq = rsqrtf((is_k ? s_other : s_own) + 1e-6f) * rsqrtf((float)GDN_DIM);
            const float sk = rsqrtf((is_k ? s_own : s_other) + 1e-6f);
            const float sc = is_k ? sk : sq;
            float* dst = (is_k ? kn : qn) + ((long)row * Hk + hk) * GDN_DIM + VEC * (lane & 15);
            *reinterpret_cast<float4*>(dst) = make_float4(f[0] * sc, f[1] * sc, f[2] * sc, f[3] * sc);
            *reinterpret_cast<float4*>(dst + 4) = make_float4(f[4] * sc, f[5] * sc, f[6] * sc, f[7] * sc);
            if (lane == 0) kq[(long)row * Hk + hk] = dot * sq * sk;
        }
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
#pragma unroll
            for (int k = 0; k < CONV_K - 2; ++k) h[k][i] = h[k + 1][i];
            h[CONV_K - 2][i] = cur[i];
        }
    }
}
