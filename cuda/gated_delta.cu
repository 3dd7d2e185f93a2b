// Gated DeltaNet prefill over packed segments (fp32 state), for Qwen3.5's linear layers.
//
// Two kernels:
//   gdn_prepare: conv output -> L2-normalized q (times Dk^-0.5) and k in fp32, g and beta in fp32.
//   gdn_recurrent_p{4,8}: the exact per-token recurrence
//       S <- e^g S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q
//     with each segment starting from its parent's state and writing its final state.
//
// Why a recurrence and not the chunked (WY) form: the state lives in registers, so a launch
// costs one pass over q/k/v/o and two over the state, with no per-call setup; at the prefill
// sizes of a request (tens to a few thousand tokens per segment) it is latency-bound at a few
// hundred cycles a token. Column j of the state only ever needs column j, so the 128 value
// columns are independent; each is split over PARTS threads (adjacent lanes) that each hold
// 128/PARTS rows of it, so S^T k and S^T q are PARTS-way shuffle reductions.
#include <cuda_bf16.h>
#include <stdint.h>

#define DK 128
#define DV 128
#define COLS 32   // value columns per block
#define CT 16     // tokens staged in shared memory at a time

// conv_out: [T, conv_stride] bf16 whose first 2*Hk*DK columns are q then k.
// a, b:     [T, H] bf16 with row stride ab_stride (views into the fused projection)
// A_log, dt_bias: [H] fp32
// qn, kn:   [T, Hk, DK] fp32 out; g, beta: [T, H] fp32 out
// Block per token: warps take the 2*Hk q/k rows in turn (4 elements a lane), then threads
// take the H gates.
extern "C" __global__ void gdn_prepare(const __nv_bfloat16* __restrict__ conv_out, long conv_stride,
                                       const __nv_bfloat16* __restrict__ a,
                                       const __nv_bfloat16* __restrict__ b, long ab_stride,
                                       const float* __restrict__ A_log,
                                       const float* __restrict__ dt_bias, int H, int Hk,
                                       float* __restrict__ qn, float* __restrict__ kn,
                                       float* __restrict__ g, float* __restrict__ beta) {
    const int t = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int nwarps = blockDim.x >> 5;
    const __nv_bfloat16* row = conv_out + (long)t * conv_stride;
    for (int job = warp; job < 2 * Hk; job += nwarps) {
        const int is_k = job >= Hk;
        const int hk = is_k ? job - Hk : job;
        const __nv_bfloat16* src = row + (long)is_k * Hk * DK + hk * DK + lane * 4;
        __nv_bfloat162 p0 = *reinterpret_cast<const __nv_bfloat162*>(src);
        __nv_bfloat162 p1 = *reinterpret_cast<const __nv_bfloat162*>(src + 2);
        float2 f0 = __bfloat1622float2(p0), f1 = __bfloat1622float2(p1);
        float ss = f0.x * f0.x + f0.y * f0.y + f1.x * f1.x + f1.y * f1.y;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        // l2norm(x) = x / sqrt(sum x^2 + 1e-6), as fla and transformers do
        float scale = rsqrtf(ss + 1e-6f);
        if (!is_k) scale *= rsqrtf((float)DK);
        float4 r = make_float4(f0.x * scale, f0.y * scale, f1.x * scale, f1.y * scale);
        float* dst = (is_k ? kn : qn) + ((long)t * Hk + hk) * DK + lane * 4;
        *reinterpret_cast<float4*>(dst) = r;
    }
    for (int h = threadIdx.x; h < H; h += blockDim.x) {
        float av = __bfloat162float(a[(long)t * ab_stride + h]) + dt_bias[h];
        float bv = __bfloat162float(b[(long)t * ab_stride + h]);
        // softplus with torch's threshold 20 (linear above it)
        float sp = av > 20.f ? av : log1pf(__expf(av));
        g[(long)t * H + h] = -__expf(A_log[h]) * sp;
        beta[(long)t * H + h] = 1.f / (1.f + __expf(-bv));
    }
}

// qn, kn:     [T, Hk, DK] fp32 (from gdn_prepare); value head h reads key head h / (H / Hk)
// v:          [T, H, DV] bf16 with row stride v_stride (a view into the conv output)
// g, beta:    [T, H] fp32
// cu_seqlens: [N+1] int32
// init_state: [N, H, DK, DV] fp32 (ignored when has_init == 0)
// out:        [T, H, DV] bf16
// final_state:[N, H, DK, DV] fp32
// grid (DV / COLS, H, N), block COLS * PARTS threads.
template <int PARTS>
__device__ __forceinline__ void gdn_recurrent(
    const float* __restrict__ qn, const float* __restrict__ kn, const __nv_bfloat16* __restrict__ v,
    long v_stride, const float* __restrict__ g, const float* __restrict__ beta,
    const int* __restrict__ cu_seqlens, int H, int Hk, const float* __restrict__ init_state,
    int has_init, __nv_bfloat16* __restrict__ out, float* __restrict__ final_state) {
    constexpr int R = DK / PARTS;       // state rows per thread
    constexpr int RP = R + 4;           // padded: the PARTS row groups start in different banks
    constexpr int NT = COLS * PARTS;
    __shared__ __align__(16) float k_s[CT][PARTS * RP];
    __shared__ __align__(16) float q_s[CT][PARTS * RP];
    __shared__ float v_s[CT][COLS];
    __shared__ float o_s[CT][COLS];
    __shared__ float g_s[CT], b_s[CT];

    const int tid = threadIdx.x;
    const int col = tid / PARTS, part = tid % PARTS;
    const int col0 = blockIdx.x * COLS;
    const int h = blockIdx.y, n = blockIdx.z;
    const int hk = h / (H / Hk);
    const int start = cu_seqlens[n], end = cu_seqlens[n + 1];
    const long state_base = ((long)n * H + h) * DK * DV;

    float S[R];
#pragma unroll
    for (int i = 0; i < R; ++i)
        S[i] = has_init ? init_state[state_base + (long)(part * R + i) * DV + col0 + col] : 0.f;

    for (int cs = start; cs < end; cs += CT) {
        const int cnt = min(CT, end - cs);
        __syncthreads();  // the previous chunk's o_s has been written out
        for (int idx = tid; idx < cnt * (DK / 4); idx += NT) {
            const int t = idx / (DK / 4), d = (idx % (DK / 4)) * 4;
            const long src = ((long)(cs + t) * Hk + hk) * DK + d;
            const int dst = (d / R) * RP + d % R;
            *reinterpret_cast<float4*>(&k_s[t][dst]) = *reinterpret_cast<const float4*>(kn + src);
            *reinterpret_cast<float4*>(&q_s[t][dst]) = *reinterpret_cast<const float4*>(qn + src);
        }
        for (int idx = tid; idx < cnt * COLS; idx += NT) {
            const int t = idx / COLS, c = idx % COLS;
            v_s[t][c] = __bfloat162float(v[(long)(cs + t) * v_stride + h * DV + col0 + c]);
        }
        if (tid < cnt) {
            g_s[tid] = __expf(g[(long)(cs + tid) * H + h]);
            b_s[tid] = beta[(long)(cs + tid) * H + h];
        }
        __syncthreads();
        for (int t = 0; t < cnt; ++t) {
            const float eg = g_s[t];
            float kr[R];
            float kv0 = 0.f, kv1 = 0.f;
#pragma unroll
            for (int i = 0; i < R; i += 4) {
                float4 k4 = *reinterpret_cast<const float4*>(&k_s[t][part * RP + i]);
                kr[i] = k4.x; kr[i + 1] = k4.y; kr[i + 2] = k4.z; kr[i + 3] = k4.w;
                kv0 = fmaf(S[i], k4.x, kv0);
                kv1 = fmaf(S[i + 1], k4.y, kv1);
                kv0 = fmaf(S[i + 2], k4.z, kv0);
                kv1 = fmaf(S[i + 3], k4.w, kv1);
            }
            float kv = kv0 + kv1;
#pragma unroll
            for (int o = 1; o < PARTS; o <<= 1) kv += __shfl_xor_sync(0xffffffffu, kv, o);
            // (e^g S)^T k = e^g (S^T k): decay folded into the scalar
            const float delta = b_s[t] * (v_s[t][col] - eg * kv);
            float o0 = 0.f, o1 = 0.f;
#pragma unroll
            for (int i = 0; i < R; i += 4) {
                float4 q4 = *reinterpret_cast<const float4*>(&q_s[t][part * RP + i]);
                S[i] = fmaf(S[i], eg, kr[i] * delta);
                S[i + 1] = fmaf(S[i + 1], eg, kr[i + 1] * delta);
                S[i + 2] = fmaf(S[i + 2], eg, kr[i + 2] * delta);
                S[i + 3] = fmaf(S[i + 3], eg, kr[i + 3] * delta);
                o0 = fmaf(S[i], q4.x, o0);
                o1 = fmaf(S[i + 1], q4.y, o1);
                o0 = fmaf(S[i + 2], q4.z, o0);
                o1 = fmaf(S[i + 3], q4.w, o1);
            }
            float o = o0 + o1;
#pragma unroll
            for (int s = 1; s < PARTS; s <<= 1) o += __shfl_xor_sync(0xffffffffu, o, s);
            if (part == 0) o_s[t][col] = o;
        }
        __syncthreads();
        for (int idx = tid; idx < cnt * COLS; idx += NT) {
            const int t = idx / COLS, c = idx % COLS;
            out[((long)(cs + t) * H + h) * DV + col0 + c] = __float2bfloat16(o_s[t][c]);
        }
    }
#pragma unroll
    for (int i = 0; i < R; ++i)
        final_state[state_base + (long)(part * R + i) * DV + col0 + col] = S[i];
}

#define GDN_ARGS                                                                              \
    const float *__restrict__ qn, const float *__restrict__ kn,                               \
        const __nv_bfloat16 *__restrict__ v, long v_stride, const float *__restrict__ g,      \
        const float *__restrict__ beta, const int *__restrict__ cu_seqlens, int H, int Hk,    \
        const float *__restrict__ init_state, int has_init, __nv_bfloat16 *__restrict__ out, \
        float *__restrict__ final_state
#define GDN_PASS qn, kn, v, v_stride, g, beta, cu_seqlens, H, Hk, init_state, has_init, out, final_state

extern "C" __global__ void __launch_bounds__(COLS * 4) gdn_recurrent_p4(GDN_ARGS) {
    gdn_recurrent<4>(GDN_PASS);
}
extern "C" __global__ void __launch_bounds__(COLS * 8) gdn_recurrent_p8(GDN_ARGS) {
    gdn_recurrent<8>(GDN_PASS);
}
