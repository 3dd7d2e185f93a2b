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
