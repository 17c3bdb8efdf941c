/*
 * adamw.cu — the optimizer pass (AdamW, compute-weight refresh and gradient
 * zeroing, where asked, in one read of each buffer), per tensor or over
 * every tensor in one launch, and the squared gradient norm.
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

/* ============================================================ one launch */

/*
 * Every tensor's AdamW in one launch (issue 17: the optimizer as one pass
 * over contiguous memory). Per-tensor launches cost the step a launch gap
 * and a partial last wave per tensor: 9 to 12 tensors a layer, many of them
 * norms and biases of a few thousand elements. Here the tensors are cut
 * into chunks of ADAMW_CHUNK elements, numbered one after the other (a
 * segment's first chunk is chunk0); a block takes chunks grid-stride and
 * finds each chunk's segment by a binary search of the table. A thread
 * loads all of its chunk's elements before the arithmetic (adamw_one, the
 * same as adamw_vec_kernel's: the same bits), and the loads and stores are
 * streaming ones (evict first): nothing of the pass is read again soon.
 */
#define ADAMW_THREADS 256
#define ADAMW_PER 4 /* float4 per thread per chunk */
#define ADAMW_CHUNK (ADAMW_THREADS * ADAMW_PER * 4)
struct adamw_seg_dev {
    size_t poff, goff, woff, n, chunk0;
    float wd;
    int clear;
};
template <bool HAS_W>
static __global__ void __launch_bounds__(ADAMW_THREADS)
    adamw_segments_kernel(float *p, bf16 *w, float *g, float *m, float *v, const adamw_seg_dev *seg, int nseg,
                          size_t nchunks, float lr, float b1, float b2, float eps, float gs, float bc1, float bc2) {
    for (size_t c = blockIdx.x; c < nchunks; c += gridDim.x) {
        int lo = 0, hi = nseg - 1; /* the last segment whose chunk0 <= c */
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (seg[mid].chunk0 <= c) lo = mid;
            else hi = mid - 1;
        }
        const adamw_seg_dev sd = seg[lo];
        const size_t e0 = (c - sd.chunk0) * ADAMW_CHUNK, e1 = e0 + ADAMW_CHUNK < sd.n ? e0 + ADAMW_CHUNK : sd.n;
        float *ps = p + sd.poff, *gp = g + sd.goff, *ms = m + sd.poff, *vs = v + sd.poff;
        bf16 *ws = HAS_W ? w + sd.woff : NULL;
        /* 16-byte accesses where every buffer's piece starts 16-byte aligned
         * (the bases are, checked by the host; w then 8-byte); the scalar
         * loop takes what is left: the segment's last 1 to 3 elements, or
         * all of a misaligned piece */
        size_t s0 = e0;
        if (((sd.poff | sd.goff | sd.woff) & 3) == 0) {
            const size_t i0 = e0 / 4, i1 = e1 / 4; /* whole float4s; e0 is a multiple of 4 */
            float4 pv[ADAMW_PER], gv[ADAMW_PER], mv[ADAMW_PER], vv[ADAMW_PER];
#pragma unroll
            for (int k = 0; k < ADAMW_PER; k++) {
                const size_t i = i0 + threadIdx.x + (size_t)k * ADAMW_THREADS;
                if (i < i1) {
                    pv[k] = __ldcs((const float4 *)ps + i);
                    gv[k] = __ldcs((const float4 *)gp + i);
                    mv[k] = __ldcs((const float4 *)ms + i);
                    vv[k] = __ldcs((const float4 *)vs + i);
                }
            }
#pragma unroll
            for (int k = 0; k < ADAMW_PER; k++) {
                const size_t i = i0 + threadIdx.x + (size_t)k * ADAMW_THREADS;
                if (i >= i1) continue;
                float4 pi = pv[k], gi = gv[k], mi = mv[k], vi = vv[k];
                adamw_one(pi.x, gi.x, mi.x, vi.x, lr, b1, b2, eps, sd.wd, gs, bc1, bc2);
                adamw_one(pi.y, gi.y, mi.y, vi.y, lr, b1, b2, eps, sd.wd, gs, bc1, bc2);
                adamw_one(pi.z, gi.z, mi.z, vi.z, lr, b1, b2, eps, sd.wd, gs, bc1, bc2);
                adamw_one(pi.w, gi.w, mi.w, vi.w, lr, b1, b2, eps, sd.wd, gs, bc1, bc2);
                __stcs((float4 *)ps + i, pi);
                __stcs((float4 *)ms + i, mi);
                __stcs((float4 *)vs + i, vi);
                if (sd.clear) __stcs((float4 *)gp + i, make_float4(0.f, 0.f, 0.f, 0.f));
                if (HAS_W) {
                    const __nv_bfloat162 lo2 = __floats2bfloat162_rn(pi.x, pi.y);
                    const __nv_bfloat162 hi2 = __floats2bfloat162_rn(pi.z, pi.w);
                    uint2 u;
                    u.x = *reinterpret_cast<const uint32_t *>(&lo2);
                    u.y = *reinterpret_cast<const uint32_t *>(&hi2);
                    __stcs((uint2 *)(ws + 4 * i), u);
                }
            }
            s0 = 4 * i1;
        }
        for (size_t e = s0 + threadIdx.x; e < e1; e += ADAMW_THREADS) {
            float pi = ps[e], mi = ms[e], vi = vs[e];
            adamw_one(pi, gp[e], mi, vi, lr, b1, b2, eps, sd.wd, gs, bc1, bc2);
            ps[e] = pi;
            ms[e] = mi;
            vs[e] = vi;
            if (sd.clear) gp[e] = 0.f;
            if (HAS_W) ws[e] = __float2bfloat16_rn(pi);
        }
    }
}

void cf_cuda_adamw_segments(cf_backend *b, float *p, void *w_, float *g, float *m, float *v, const cf_adamw_seg *segs,
                            int nseg, float lr, float beta1, float beta2, float eps, float grad_scale, int t) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || nseg <= 0) return;
    bf16 *w = (void *)w_ == (void *)p ? NULL : (bf16 *)w_;
    if (!cf_aligned16(p) || !cf_aligned16(g) || !cf_aligned16(m) || !cf_aligned16(v) || ((uintptr_t)w % 8) != 0) {
        /* the kernel's 16-byte path assumes aligned bases: per segment instead */
        for (int s = 0; s < nseg; s++) {
            const cf_adamw_seg *q = &segs[s];
            cf_cuda_adamw(b, p + q->poff, w ? (void *)(w + q->woff) : NULL, g + q->goff, m + q->poff, v + q->poff, q->n,
                          lr, beta1, beta2, eps, q->wd, grad_scale, t, q->flags);
        }
        return;
    }
    /* the table, with each segment's first chunk: host -> pinned staging ->
     * device, in stream order (empty segments take no chunk) */
    const size_t bytes = (size_t)nseg * sizeof(adamw_seg_dev);
    adamw_seg_dev *host = (adamw_seg_dev *)cf_cuda_staging(ctx, bytes);
    adamw_seg_dev *dev = (adamw_seg_dev *)cf_cuda_scratch(ctx, CF_SCR_ADAMW_SEGS, bytes);
    if (!host || !dev) return;
    size_t chunks = 0;
    for (int s = 0; s < nseg; s++) {
        const cf_adamw_seg *q = &segs[s];
        host[s] = adamw_seg_dev{q->poff, q->goff, q->woff, q->n, chunks, q->wd, !(q->flags & CF_ADAMW_KEEP_GRAD)};
        chunks += (q->n + ADAMW_CHUNK - 1) / ADAMW_CHUNK;
    }
    if (chunks == 0) return;
    if (!CF_CK(ctx, cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, ctx->stream)) ||
        cf_cuda_staging_issued(ctx) != 0)
        return;
    const float bc1 = (float)(1.0 - pow((double)beta1, (double)t));
    const float bc2 = (float)(1.0 - pow((double)beta2, (double)t));
    /* the blocks that fit at once (registers decide: two at 256 threads), so
     * the grid-stride chunks are dealt out evenly, not in queued waves */
    static int per_sm = 0;
    if (!per_sm && (!CF_CK(ctx, cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                                    &per_sm, adamw_segments_kernel<true>, ADAMW_THREADS, 0)) ||
                    per_sm < 1))
        per_sm = 1;
    const size_t cap = (size_t)ctx->sm_count * per_sm;
    const unsigned grid = (unsigned)(chunks < cap ? chunks : cap);
    if (w)
        adamw_segments_kernel<true><<<grid, ADAMW_THREADS, 0, ctx->stream>>>(p, w, g, m, v, dev, nseg, chunks, lr,
                                                                            beta1, beta2, eps, grad_scale, bc1, bc2);
    else
        adamw_segments_kernel<false><<<grid, ADAMW_THREADS, 0, ctx->stream>>>(p, NULL, g, m, v, dev, nseg, chunks, lr,
                                                                             beta1, beta2, eps, grad_scale, bc1, bc2);
    CF_CK_LAUNCH(ctx, "adamw_segments");
}
