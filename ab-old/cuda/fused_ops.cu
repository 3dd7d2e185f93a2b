// Small fused element-wise / row ops of the Qwen3.5 layer stack. All math in fp32, bf16 I/O.
#include "common.cuh"

// GDN_DIM: the gated norm's head dim; ATTN_HEAD_DIM: q/k head dim of the norm + rotary kernel.
#if !defined(GDN_DIM) || !defined(ATTN_HEAD_DIM)
#error "compile with the definitions of openjev.worker.cuda.traits"
#endif

__device__ __forceinline__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();  // red may still be read from a previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = 0.f;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) s += red[w];
    return s;
}

#define RMS_MAXV 4  // 8-element vectors per thread: D <= 256 threads * 8 * 4 = 8192

// Residual add + RMSNorm with (1 + w), optionally gathering rows (the head's rows).
// Output row i reads source row src = row_idx[i] (has_idx) or i:
//   r = residual_in[src] (+ x_add[src] if has_add), rounded to bf16 like the model's residual
//   residual_out[i] = r;  out[i] = r * rsqrt(mean(r^2) + eps) * (1 + w)
// x_add, residual_in: [T, D] bf16; row_idx: [R] int32; w: [D] bf16
// residual_out, out: [R, D] bf16 (residual_out may alias residual_in when has_idx == 0)
// grid R, block 256; D % 8 == 0.
extern "C" __global__ void __launch_bounds__(256) add_rms_norm(
    const __nv_bfloat16* __restrict__ x_add, int has_add, const __nv_bfloat16* residual_in,
    const int* __restrict__ row_idx, int has_idx, const __nv_bfloat16* __restrict__ w, float eps,
    int D, __nv_bfloat16* residual_out, __nv_bfloat16* __restrict__ out) {
    __shared__ float red[32];
    const int i = blockIdx.x;
    const long src = has_idx ? row_idx[i] : i;
    float v[RMS_MAXV][8];
    float ss = 0.f;
#pragma unroll
    for (int u = 0; u < RMS_MAXV; ++u) {
        const int c = (threadIdx.x + u * blockDim.x) * 8;
        if (c < D) {
            load8(residual_in + src * D + c, v[u]);
            if (has_add) {
                float a[8];
                load8(x_add + src * D + c, a);
#pragma unroll
                for (int e = 0; e < 8; ++e) v[u][e] = __bfloat162float(__float2bfloat16(v[u][e] + a[e]));
            }
#pragma unroll
            for (int e = 0; e < 8; ++e) ss += v[u][e] * v[u][e];
        }
    }
    const float rinv = rsqrtf(block_sum(ss, red) / D + eps);
#pragma unroll
    for (int u = 0; u < RMS_MAXV; ++u) {
        const int c = (threadIdx.x + u * blockDim.x) * 8;
        if (c < D) {
            if (has_add || has_idx) store8(residual_out + (long)i * D + c, v[u]);
            float wf[8], y[8];
            load8(w + c, wf);
#pragma unroll
            for (int e = 0; e < 8; ++e) y[e] = v[u][e] * rinv * (1.f + wf[e]);
            store8(out + (long)i * D + c, y);
        }
    }
}

// Gated RMSNorm of the GDN output: out = bf16(x * rsqrt(mean_Dv(x^2) + eps)) * w * silu(z).
// x: [T, H, 128] bf16; z: [T, H*128] bf16 view with row stride z_stride; w: [128] bf16
// out: [T, H*128] bf16.  One warp per (token, head), 4 elements a lane.
static_assert(GDN_DIM == 32 * 4, "gated_rms_norm: a warp holds a head, 4 elements a lane");
extern "C" __global__ void gated_rms_norm(const __nv_bfloat16* __restrict__ x,
                                          const __nv_bfloat16* __restrict__ z, long z_stride,
                                          const __nv_bfloat16* __restrict__ w, float eps, int T, int H,
                                          __nv_bfloat16* __restrict__ out) {
    const long job = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (job >= (long)T * H) return;
    const long t = job / H;
    const int h = job % H;
    const int d = lane * 4;
    const __nv_bfloat162* xp = reinterpret_cast<const __nv_bfloat162*>(x + job * GDN_DIM + d);
    const __nv_bfloat162* zp = reinterpret_cast<const __nv_bfloat162*>(z + t * z_stride + h * GDN_DIM + d);
    const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(w + d);
    float2 x0 = __bfloat1622float2(xp[0]), x1 = __bfloat1622float2(xp[1]);
    float ss = x0.x * x0.x + x0.y * x0.y + x1.x * x1.x + x1.y * x1.y;
    ss = warp_sum(ss);
    const float rinv = rsqrtf(ss / (float)GDN_DIM + eps);
    float2 z0 = __bfloat1622float2(zp[0]), z1 = __bfloat1622float2(zp[1]);
    float2 w0 = __bfloat1622float2(wp[0]), w1 = __bfloat1622float2(wp[1]);
    // the normed value is rounded to bf16 before the weight, as the model's norm returns x.dtype
    auto nr = [rinv](float a) { return __bfloat162float(__float2bfloat16(a * rinv)); };
    __nv_bfloat162* op = reinterpret_cast<__nv_bfloat162*>(out + job * GDN_DIM + d);
    op[0] = __floats2bfloat162_rn(nr(x0.x) * w0.x * silu(z0.x), nr(x0.y) * w0.y * silu(z0.y));
    op[1] = __floats2bfloat162_rn(nr(x1.x) * w1.x * silu(z1.x), nr(x1.y) * w1.y * silu(z1.y));
}

// Per-head RMSNorm (1 + w) then HF rotate-half rotary on the first rotary_dim dims, head dim 256.
// src: [T, H, 256] bf16 view (strides src_st, src_sh elements): q from q_proj's [query|gate]
// w: [256] bf16; cos_t, sin_t: [T, rotary_dim/2] fp32 (one table per launch, shared by every
// layer's q and k: built once by torch exactly as transformers builds it)
// dst: rows dst_row0 + t of a [*, H, 256] bf16 buffer (a K pool, or a contiguous q)
// One warp per (token, head): lane holds dims 8*lane .. 8*lane+7, so rotary partners
// (d, d + rotary_dim/2) sit rotary_dim/16 lanes apart. Needs rotary_dim % 16 == 0, <= 256.
static_assert(ATTN_HEAD_DIM == 32 * 8, "qk_norm_rope: a warp holds a head, 8 elements a lane");
extern "C" __global__ void qk_norm_rope(const __nv_bfloat16* __restrict__ src, long src_st,
                                        long src_sh, const __nv_bfloat16* __restrict__ w,
                                        const float* __restrict__ cos_t,
                                        const float* __restrict__ sin_t, int rotary_dim,
                                        float eps, int T, int H,
                                        __nv_bfloat16* __restrict__ dst, long dst_row0) {
    const long job = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (job >= (long)T * H) return;
    const long t = job / H;
    const int h = job % H;
    float x[8], wf[8];
    load8(src + t * src_st + h * src_sh + lane * 8, x);
    load8(w + lane * 8, wf);
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) ss += x[e] * x[e];
    ss = warp_sum(ss);
    const float rinv = rsqrtf(ss / (float)ATTN_HEAD_DIM + eps);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = x[e] * rinv * (1.f + wf[e]);
    // rounded to bf16 before rotation, as the model's normed q/k are bf16 tensors
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = __bfloat162float(__float2bfloat16(x[e]));
    const int half = rotary_dim >> 1;
    const int lane_off = half >> 3;
    const bool lower = lane < lane_off;
    const bool rot = lane < 2 * lane_off;
    const int partner = lower ? lane + lane_off : (rot ? lane - lane_off : lane);
    float y[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const float other = __shfl_sync(0xffffffffu, x[e], partner);
        if (rot) {
            const int j = (lane * 8 + e) % half;
            const float cs = cos_t[t * half + j], sn = sin_t[t * half + j];
            y[e] = lower ? x[e] * cs - other * sn : x[e] * cs + other * sn;
        } else {
            y[e] = x[e];
        }
    }
    store8(dst + ((dst_row0 + t) * H + h) * ATTN_HEAD_DIM + lane * 8, y);
}

// MLP gating: out[t, i] = silu(gu[t, i]) * gu[t, I + i].  gu: [T, 2I] bf16; out: [T, I] bf16.
extern "C" __global__ void silu_mul(const __nv_bfloat16* __restrict__ gu, int T, int I,
                                    __nv_bfloat16* __restrict__ out) {
    const long v = (long)blockIdx.x * blockDim.x + threadIdx.x;  // one 8-vector
    const long per_row = I / 8;
    if (v >= (long)T * per_row) return;
    const long t = v / per_row, c = (v % per_row) * 8;
    float gf[8], uf[8], y[8];
    load8(gu + t * 2 * I + c, gf);
    load8(gu + t * 2 * I + I + c, uf);
#pragma unroll
    for (int e = 0; e < 8; ++e) y[e] = silu(gf[e]) * uf[e];
    store8(out + t * I + c, y);
}

// Row gather: dst[i] = src[idx[i]].  src: [*, D] bf16; idx: [R] int32; dst: [R, D] bf16.
extern "C" __global__ void gather_rows(const __nv_bfloat16* __restrict__ src,
                                       const int* __restrict__ idx, int R, int D,
                                       __nv_bfloat16* __restrict__ dst) {
    const int i = blockIdx.y;
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (i >= R || c >= D) return;
    *reinterpret_cast<uint4*>(dst + (long)i * D + c) = *reinterpret_cast<const uint4*>(src + (long)idx[i] * D + c);
}
