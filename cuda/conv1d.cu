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
// One thread handles 8 channels (16-byte loads) of ROWS output rows. Grid rows past the output
// row groups build the new windows, so one launch does both jobs.
#include "common.cuh"

// CONV_K (taps) and CONV_ROWS (output rows a thread) come from the host: the grid depends on them.
#if !defined(CONV_K) || !defined(CONV_ROWS)
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

#define ROWS CONV_ROWS  // the ROWS + CONV_K - 1 input rows they need are loaded once

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

extern "C" __global__ void causal_conv1d_packed(
    const __nv_bfloat16* __restrict__ x, long x_stride, const __nv_bfloat16* __restrict__ weight,
    const int* __restrict__ win_src, const __nv_bfloat16* __restrict__ windows,
    const int* __restrict__ cu_seqlens, int n_seg,
    int T, int C, __nv_bfloat16* __restrict__ out, __nv_bfloat16* __restrict__ new_window) {
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (c >= C) return;
    const int row_groups = (T + ROWS - 1) / ROWS;
    if ((int)blockIdx.y < row_groups) {
        const int r0 = blockIdx.y * ROWS;
        float w[VEC][CONV_K];
        load_taps(weight, c, w);
        // packed input rows r0-3 .. r0+ROWS-1 (clamped reads; rows of other segments are
        // replaced by window rows below)
        float in[ROWS + CONV_K - 1][VEC];
#pragma unroll
        for (int j = 0; j < ROWS + CONV_K - 1; ++j) {
            const int p = r0 - (CONV_K - 1) + j;
            if (p >= 0 && p < T) load8(x + (long)p * x_stride + c, in[j]);
        }
#pragma unroll
        for (int u = 0; u < ROWS; ++u) {
            const int row = r0 + u;
            if (row >= T) break;
            const int s = segment_of(cu_seqlens, n_seg, row);
            const int rel = row - cu_seqlens[s];
            float acc[VEC];
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[i] = 0.f;
#pragma unroll
            for (int k = 0; k < CONV_K; ++k) {
                // tap k multiplies input row rel - (K-1) + k
                const int tap_rel = rel - (CONV_K - 1) + k;
                float f[VEC];
                if (tap_rel >= 0) {
#pragma unroll
                    for (int i = 0; i < VEC; ++i) f[i] = in[u + k][i];
                } else {
                    window_row(x, x_stride, windows, win_src, C, s, tap_rel, c, f);
                }
#pragma unroll
                for (int i = 0; i < VEC; ++i) acc[i] = fmaf(w[i][k], f[i], acc[i]);
            }
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[i] = acc[i] / (1.f + __expf(-acc[i]));
            store8(out + (long)row * C + c, acc);
        }
    } else {
        new_window_row(x, x_stride, windows, win_src, cu_seqlens, n_seg, C, blockIdx.y - row_groups, c, new_window);
    }
}

// The same outputs, bit for bit (the same taps in the same order), by a thread walking `rows`
// consecutive rows with the 3 inputs before the current one in registers: each input row is
// loaded once (the form above loads ROWS + 3 rows for ROWS outputs), ROLL_AHEAD of them in flight
// at a time, and a thread's registers do not grow with the rows it walks. grid.y = ceil(T / rows) + 3N.
#define ROLL_AHEAD 4
extern "C" __global__ void causal_conv1d_roll(
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
    for (int row0 = r0; row0 < r1; row0 += ROLL_AHEAD) {
        // the next ROLL_AHEAD input rows in flight at once, then their outputs one by one
        float in[ROLL_AHEAD][VEC];
#pragma unroll
        for (int u = 0; u < ROLL_AHEAD; ++u)
            if (row0 + u < r1) load8(x + (long)(row0 + u) * x_stride + c, in[u]);
#pragma unroll
        for (int u = 0; u < ROLL_AHEAD; ++u) {
            const int row = row0 + u;
            if (row >= r1) break;
            if (row == next) {  // the next non-empty segment starts here, from its window
                do { ++s; } while (cu_seqlens[s + 1] <= row);
                start = row;
                next = cu_seqlens[s + 1];
#pragma unroll
                for (int m = 0; m < CONV_K - 1; ++m)
                    window_row(x, x_stride, windows, win_src, C, s, m - (CONV_K - 1), c, h[m]);
            }
            float acc[VEC];
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
                acc[i] = 0.f;
#pragma unroll
                for (int k = 0; k < CONV_K - 1; ++k) acc[i] = fmaf(w[i][k], h[k][i], acc[i]);
                acc[i] = fmaf(w[i][CONV_K - 1], in[u][i], acc[i]);
                acc[i] = acc[i] / (1.f + __expf(-acc[i]));
            }
            store8(out + (long)row * C + c, acc);
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
#pragma unroll
                for (int k = 0; k < CONV_K - 2; ++k) h[k][i] = h[k + 1][i];
                h[CONV_K - 2][i] = in[u][i];
            }
        }
    }
}
