/*
 * adamw.cu — the optimizer pass (AdamW, compute-weight refresh and gradient
 * zeroing, where asked, in one read of each buffer) and the squared
 * gradient norm.
 */
#include <limits.h>
#include "backend/cuda/cuda_common.cuh"

/* Block i: partial[i] = the sum of g^2 over its chunk [i chunk, (i+1)
 * chunk) of [0, n), in double, float4 loads where the chunk starts
 * aligned (chunk a multiple of 4). A fixed grid and fixed trees:
 * deterministic. */
static __global__ void sumsq_chunk_kernel(double *partial, const float *g, size_t n, size_t chunk) {
    __shared__ double red[32];
    const size_t c0 = (size_t)blockIdx.x * chunk, c1 = c0 + chunk < n ? c0 + chunk : n;
    double acc = 0.0;
    size_t i0 = c0;
    if (((uintptr_t)(g + c0) & 15) == 0) {
        const size_t n4 = (c1 - c0) / 4;
        const float4 *g4 = (const float4 *)(g + c0);
        for (size_t i = threadIdx.x; i < n4; i += blockDim.x) {
            const float4 f = g4[i];
            acc += (double)f.x * f.x + (double)f.y * f.y + (double)f.z * f.z + (double)f.w * f.w;
        }
        i0 += 4 * n4;
    }
    for (size_t i = i0 + threadIdx.x; i < c1; i += blockDim.x) acc += (double)g[i] * g[i];
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        double s = 0.0;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) s += red[w];
        partial[blockIdx.x] = s;
    }
}
/* acc[0] += the partials' sum: 256 threads, strided, then a fixed tree */
static __global__ void sumsq_final_kernel(double *acc, const double *partial, int n) {
    __shared__ double red[256];
    double s = 0.0;
    for (int i = threadIdx.x; i < n; i += 256) s += partial[i];
    red[threadIdx.x] = s;
    __syncthreads();
    for (int w = 128; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) red[threadIdx.x] += red[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) *acc += red[0];
}

/* acc[0] += sum of g^2, no host round trip (the norm of a sharded gradient
 * can be reduced across GPUs first). Chunks: 4 blocks per SM, each a
 * contiguous 1/(4 SMs) of g; in a side section (backend.h: side_begin)
 * chunks of SUMSQ_CHUNK elements instead, so that a side block holds its
 * SM for a microsecond or two and the backward's next kernel (one large
 * block per SM) is not kept waiting behind blocks that last the whole pass. */
#define SUMSQ_CHUNK 16384
void cf_cuda_sumsq(cf_backend *b, double *acc, const float *g, size_t n) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || !n) return;
    const size_t blocks = (size_t)ctx->sm_count * 4;
    const size_t chunk = ctx->side_open ? SUMSQ_CHUNK : ((n + blocks - 1) / blocks + 3) / 4 * 4;
    const size_t nb = (n + chunk - 1) / chunk;
    if (nb > (size_t)INT_MAX) {
        cf_cuda_ctx_fail(ctx, "sumsq: %zu elements are too many for one call", n);
        return;
    }
    double *partial = (double *)cf_cuda_scratch(ctx, CF_SCR_SUMSQ, nb * sizeof(double));
    if (!partial) return;
    sumsq_chunk_kernel<<<(unsigned)nb, 256, 0, ctx->stream>>>(partial, g, n, chunk);
    if (!CF_CK_LAUNCH(ctx, "sumsq_chunk")) return;
    sumsq_final_kernel<<<1, 256, 0, ctx->stream>>>(acc, partial, (int)nb);
    CF_CK_LAUNCH(ctx, "sumsq_final");
}

/* g' = g s; m = b1 m + (1-b1) g'; v = b2 v + (1-b2) g'^2;
 * p -= lr (m/bc1 / (sqrt(v/bc2) + eps) + wd p) */
__device__ __forceinline__ void adamw_one(float &p, float g, float &m, float &v, float lr, float b1, float b2,
                                          float eps, float wd, float gs, float bc1, float bc2) {
    g *= gs;
    m = b1 * m + (1.f - b1) * g;
    v = b2 * v + (1.f - b2) * g * g;
    p = p - lr * ((m / bc1) / (sqrtf(v / bc2) + eps) + wd * p);
}
/* CLEAR: zero g after reading it (else g is left as it is: its next writer
 * overwrites it, and the pass stores 4 bytes per element fewer) */
template <bool CLEAR>
static __global__ void adamw_kernel(float *p, bf16 *w, float *g, float *m, float *v, size_t n, float lr, float b1,
                                    float b2, float eps, float wd, float gs, float bc1, float bc2) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float pi = p[i], mi = m[i], vi = v[i];
        adamw_one(pi, g[i], mi, vi, lr, b1, b2, eps, wd, gs, bc1, bc2);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        if (CLEAR) g[i] = 0.f;
        if (w) w[i] = __float2bfloat16_rn(pi);
    }
}
/* the same, four elements per 16-byte access */
template <bool CLEAR>
static __global__ void adamw_vec_kernel(float4 *p, __nv_bfloat162 *w, float4 *g, float4 *m, float4 *v, size_t n4, float lr,
                                        float b1, float b2, float eps, float wd, float gs, float bc1, float bc2) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (size_t)gridDim.x * blockDim.x) {
        float4 pi = p[i], gi = g[i], mi = m[i], vi = v[i];
        adamw_one(pi.x, gi.x, mi.x, vi.x, lr, b1, b2, eps, wd, gs, bc1, bc2);
        adamw_one(pi.y, gi.y, mi.y, vi.y, lr, b1, b2, eps, wd, gs, bc1, bc2);
        adamw_one(pi.z, gi.z, mi.z, vi.z, lr, b1, b2, eps, wd, gs, bc1, bc2);
        adamw_one(pi.w, gi.w, mi.w, vi.w, lr, b1, b2, eps, wd, gs, bc1, bc2);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        if (CLEAR) g[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (w) {
            w[2 * i] = __floats2bfloat162_rn(pi.x, pi.y);
            w[2 * i + 1] = __floats2bfloat162_rn(pi.z, pi.w);
        }
    }
}
template <bool CLEAR>
static void adamw_launch(cf_cuda_ctx *ctx, float *p, bf16 *w, float *g, float *m, float *v, size_t n, float lr,
                         float beta1, float beta2, float eps, float wd, float grad_scale, float bc1, float bc2) {
    if (n % 4 == 0 && cf_aligned16(p) && cf_aligned16(g) && cf_aligned16(m) && cf_aligned16(v) &&
        ((uintptr_t)w % 8) == 0)
        adamw_vec_kernel<CLEAR><<<cf_stream_grid(ctx, n / 4), 256, 0, ctx->stream>>>(
            (float4 *)p, (__nv_bfloat162 *)w, (float4 *)g, (float4 *)m, (float4 *)v, n / 4, lr, beta1, beta2, eps, wd,
            grad_scale, bc1, bc2);
    else
        adamw_kernel<CLEAR><<<cf_grid_for(n, 256), 256, 0, ctx->stream>>>(
            p, w, g, m, v, n, lr, beta1, beta2, eps, wd, grad_scale, bc1, bc2);
}

/* One pass: update p, m, v; refresh the bf16 compute copy w; zero g unless
 * flags & CF_ADAMW_KEEP_GRAD. */
void cf_cuda_adamw(cf_backend *b, float *p, void *w_, float *g, float *m, float *v, size_t n, float lr, float beta1,
                     float beta2, float eps, float wd, float grad_scale, int t, int flags) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || !n) return;
    bf16 *w = (bf16 *)w_;
    float bc1 = (float)(1.0 - pow((double)beta1, (double)t));
    float bc2 = (float)(1.0 - pow((double)beta2, (double)t));
    if (flags & CF_ADAMW_KEEP_GRAD)
        adamw_launch<false>(ctx, p, w, g, m, v, n, lr, beta1, beta2, eps, wd, grad_scale, bc1, bc2);
    else
        adamw_launch<true>(ctx, p, w, g, m, v, n, lr, beta1, beta2, eps, wd, grad_scale, bc1, bc2);
    CF_CK_LAUNCH(ctx, "adamw");
}
