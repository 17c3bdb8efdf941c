/*
 * lmhead.cu — the LM head with its cross-entropy, chunked over rows so that
 * no [T, V] buffer exists: per chunk, logits by cuBLASLt (bf16 out, fp32
 * accumulation, as transformers' bf16 models have them; fp32 with
 * CF_LMHEAD_LOGITS=fp32), then one block per row for the log-sum-exp, the
 * loss and (backward) the bf16 dlogits, then the two GEMMs of the backward.
 * A training forward may instead keep every row's bf16 g = softmax - onehot
 * (issue 17): its backward then scales g by dloss and runs the two GEMMs,
 * without recomputing the logits.
 */
#include <cooperative_groups.h>

#include "backend/cuda/cuda_common.cuh"

/* ============================================================ lm head */

/*
 * One block per row of a logits chunk [rows, V]. Pass 1: per-thread online
 * (max, sum of exp), combined over the block -> lse; loss = lse -
 * logit[target]. For the backward, pass 2 writes the bf16 gradient
 *   dlogits_j = dloss * (exp(logit_j - lse) - [j == target])
 * (all zeros where dloss == 0). As on the CPU backend, a target outside
 * [0, V) gives a NaN loss and a gradient without the one-hot term. In the
 * forward, dlogits with dloss NULL is the unscaled g = softmax - onehot that
 * a following backward reads instead of recomputing the logits (issue 17).
 *
 * bf16 logits (the default) halve the bytes of the pass (the GEMM writes a
 * chunk once and the rows kernel reads it once: 4 bytes a logit fewer, of
 * 10; run 28). Their rounding (2^-9 relative) would reach the loss whole
 * through the target's logit: loss = lse - logit[target]. So the target's
 * logit is taken again in fp32, x[row] . W[target], and replaces the
 * rounded one in the sum of exp, the loss and the gradient's one-hot entry.
 * The other logits enter the loss only through lse, weighted by their
 * probabilities, so their roundings mostly average out: the loss of a row
 * the model is sure of stays as exact as with fp32 logits (test_gpu_ops:
 * confident rows), and any loss is within 2^-9 of the row's largest logit
 * (transformers' own bf16 error).
 */
__device__ __forceinline__ void lse_combine(float &m, float &s, float m2, float s2) {
    float mm = fmaxf(m, m2);
    if (mm == -INFINITY) return;
    s = s * expf(m - mm) + s2 * expf(m2 - mm);
    m = mm;
}
/* (m, s) with the term exp(r - m) of a rounded logit r replaced by the
 * exact logit e's (which may raise the max) */
__device__ __forceinline__ void lse_swap_term(float &m, float &s, float r, float e) {
    s = fmaxf(s - expf(r - m), 0.f);
    lse_combine(m, s, e, 1.f);
}

/* 16 bytes of logits: LN<LT> of them, read as one uint4 */
template <typename LT> struct LN { static constexpr int n = 16 / sizeof(LT); };
__device__ __forceinline__ float lt_f(float x) { return x; }
__device__ __forceinline__ float lt_f(bf16 x) { return __bfloat162float(x); }
template <typename LT> __device__ __forceinline__ void lt_unpack(const uint4 &u, float *f);
template <> __device__ __forceinline__ void lt_unpack<float>(const uint4 &u, float *f) {
    f[0] = __uint_as_float(u.x);
    f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z);
    f[3] = __uint_as_float(u.w);
}
template <> __device__ __forceinline__ void lt_unpack<bf16>(const uint4 &u, float *f) {
    unpack8(reinterpret_cast<const pack8 &>(u), f);
}
/* N bf16 gradients (8 or 16 bytes) from floats */
template <int N> __device__ __forceinline__ void store_bf16(bf16 *out, const float *g);
template <> __device__ __forceinline__ void store_bf16<4>(bf16 *out, const float *g) {
    const __nv_bfloat162 lo = __floats2bfloat162_rn(g[0], g[1]), hi = __floats2bfloat162_rn(g[2], g[3]);
    uint2 u;
    u.x = *reinterpret_cast<const uint32_t *>(&lo);
    u.y = *reinterpret_cast<const uint32_t *>(&hi);
    *reinterpret_cast<uint2 *>(out) = u;
}
template <> __device__ __forceinline__ void store_bf16<8>(bf16 *out, const float *g) {
    *reinterpret_cast<pack8 *>(out) = pack8_from(g);
}

/* N more logits into a thread's online (m, s) */
template <int N> __device__ __forceinline__ void lse_addn(float &m, float &s, const float *x) {
    float mx = x[0];
#pragma unroll
    for (int k = 1; k < N; k++) mx = fmaxf(mx, x[k]);
    if (mx > m) {
        s *= expf(m - mx);
        m = mx;
    }
#pragma unroll
    for (int k = 0; k < N; k++) s += expf(x[k] - m);
}
/* One thread's part of a row's online (max, sum of exp): every blockDim-th
 * element from threadIdx.x, or with VEC every blockDim-th 16 bytes (the row
 * is read from HBM, and one 4-byte load per thread in flight left the
 * kernel latency-bound at 1.5 TB/s) */
template <bool VEC, typename LT> __device__ __forceinline__ void row_stats(const LT *lg, int V, float &m, float &s) {
    if constexpr (VEC) {
        constexpr int N = LN<LT>::n;
        const uint4 *l4 = reinterpret_cast<const uint4 *>(lg);
        for (int j = threadIdx.x; j < V / N; j += blockDim.x) {
            float x[N];
            lt_unpack<LT>(l4[j], x);
            lse_addn<N>(m, s, x);
        }
    } else {
        for (int j = threadIdx.x; j < V; j += blockDim.x) {
            const float x = lt_f(lg[j]);
            if (x > m) {
                s = s * expf(m - x) + 1.f;
                m = x;
            } else {
                s += expf(x - m);
            }
        }
    }
}
/* out[j] = bf16(d (exp(lg[j] - lse) - [j == tgt])), 0 where d == 0, with
 * the target's logit tv (exact) in place of lg[tgt]; VEC: 16 bytes of
 * logits read and N bf16 written per step */
template <bool VEC, typename LT>
__device__ __forceinline__ void row_grad(bf16 *out, const LT *lg, int V, float lse, float d, int tgt, float tv) {
    if constexpr (VEC) {
        constexpr int N = LN<LT>::n;
        const uint4 *l4 = reinterpret_cast<const uint4 *>(lg);
        for (int j = threadIdx.x; j < V / N; j += blockDim.x) {
            const int c = N * j;
            float g[N];
            lt_unpack<LT>(l4[j], g);
#pragma unroll
            for (int k = 0; k < N; k++) {
                const bool t = c + k == tgt;
                g[k] = d == 0.f ? 0.f : d * (expf((t ? tv : g[k]) - lse) - (t ? 1.f : 0.f));
            }
            store_bf16<N>(out + c, g);
        }
    } else {
        for (int j = threadIdx.x; j < V; j += blockDim.x) {
            const bool t = j == tgt;
            const float g = d == 0.f ? 0.f : d * (expf((t ? tv : lt_f(lg[j])) - lse) - (t ? 1.f : 0.f));
            out[j] = __float2bfloat16_rn(g);
        }
    }
}

/* The target's logit in fp32, x . w over C (bf16 rows), by one warp: every
 * lane returns it */
__device__ __forceinline__ float warp_dot_bf16(const bf16 *x, const bf16 *w, int C) {
    const int lane = threadIdx.x & 31;
    float s = 0.f;
    if (C % 8 == 0 && ((uintptr_t)x & 15) == 0 && ((uintptr_t)w & 15) == 0) {
        for (int c = 8 * lane; c < C; c += 256) {
            float a[8], b[8];
            unpack8(*reinterpret_cast<const pack8 *>(x + c), a);
            unpack8(*reinterpret_cast<const pack8 *>(w + c), b);
#pragma unroll
            for (int k = 0; k < 8; k++) s = fmaf(a[k], b[k], s);
        }
    } else {
        for (int c = lane; c < C; c += 32) s = fmaf(__bfloat162float(x[c]), __bfloat162float(w[c]), s);
    }
    return warp_sum(s);
}

/* The block's (m, s) into thread 0: butterflies within each warp, then warp
 * 0 over the warps' partials (sm, ss: 32 floats of shared memory each) */
__device__ __forceinline__ void block_lse(float &m, float &s, float *sm, float *ss) {
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        lse_combine(m, s, m2, s2);
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    if (lane == 0) {
        sm[warp] = m;
        ss[warp] = s;
    }
    __syncthreads();
    if (warp == 0) {
        m = lane < nw ? sm[lane] : -INFINITY;
        s = lane < nw ? ss[lane] : 0.f;
        for (int o = 16; o > 0; o >>= 1) {
            float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
            lse_combine(m, s, m2, s2);
        }
    }
}

/* tl[row] = x[row] . W[target - vstart] in fp32 (0 where the target is
 * outside [vstart, vstart + V)): a chunk's exact target logits, one warp per
 * row, for the rows kernels of bf16 logits (run 28: taken by warp 0 of
 * each rows block, this dot product's loads sat on every row's path) */
static __global__ void lmhead_target_logits_kernel(float *tl, const bf16 *x, const bf16 *w, const int *targets,
                                                   int rows, int C, int V, int vstart) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= rows) return;
    const int tgt = targets[row] - vstart;
    const float e = tgt < 0 || tgt >= V ? 0.f : warp_dot_bf16(x + (size_t)row * C, w + (size_t)tgt * C, C);
    if ((threadIdx.x & 31) == 0) tl[row] = e;
}

template <bool VEC, typename LT>
static __global__ void lmhead_rows_kernel(float *losses, float *stats, bf16 *dlogits, const LT *logits,
                                          const int *targets, const float *dloss, const float *lse_in, int V,
                                          int vstart, const float *tl) {
    __shared__ float sm[32], ss[32], tv_sh;
    const int row = blockIdx.x;
    const LT *lg = logits + (size_t)row * V;
    const int tgt = targets[row] - vstart;
    const bool bad = tgt < 0 || tgt >= V, exact = tl && !bad;
    /* the target's logit: exact (tl, bf16 logits) or the row's own */
    float tv = 0.f;
    if (threadIdx.x == 0 && !bad) tv = exact ? tl[row] : lt_f(lg[tgt]);
    if (lse_in) {
        if (threadIdx.x == 0) tv_sh = tv;
        __syncthreads();
        row_grad<VEC, LT>(dlogits + (size_t)row * V, lg, V, lse_in[row], dloss ? dloss[row] : 0.f, tgt, tv_sh);
        return;
    }
    float m = -INFINITY, s = 0.f;
    row_stats<VEC, LT>(lg, V, m, s);
    block_lse(m, s, sm, ss);
    if (threadIdx.x == 0) {
        if (exact) lse_swap_term(m, s, lt_f(lg[tgt]), tv);
        sm[0] = m + logf(s);
        tv_sh = tv;
        if (stats) {
            stats[(size_t)row * 3] = m;
            stats[(size_t)row * 3 + 1] = s;
            stats[(size_t)row * 3 + 2] = tv;
        }
    }
    __syncthreads();
    if (stats) return;
    const float lse = sm[0];
    if (losses && threadIdx.x == 0) losses[row] = bad ? NAN : lse - tv;
    if (dlogits) row_grad<VEC, LT>(dlogits + (size_t)row * V, lg, V, lse, dloss ? dloss[row] : 1.f, tgt, tv_sh);
}

/*
 * Hopper, whole vocabulary: the row read from HBM once. With V = 151936
 * (Qwen2.5) a row is 304 KB of bf16 (608 KB of fp32), more than a block's
 * shared memory, so lmhead_rows_kernel's pass 2 re-reads it from HBM (run
 * 19's ncu: 2.67 GB of DRAM traffic per 1766-row chunk of fp32, 1.07 GB of
 * it the second read). Here a cluster of CL blocks shares a row: block r
 * holds the slice [r V/CL, (r+1) V/CL) in shared memory, one bulk copy
 * (cp.async.bulk, completing on an mbarrier; run 28: 4% faster than every
 * thread streaming 16-byte loads into it), takes its online (m_r, s_r), the
 * blocks exchange their (m_r, s_r) through distributed shared memory and
 * each combines them in rank order 0..CL-1, so all hold the same
 *   lse = M + log S,  M = max_r m_r,  S = sum_r s_r exp(m_r - M)
 * (with the target's exact logit swapped in for bf16 logits, its rounded
 * one read from its owner's slice), and the loss and the gradient come from
 * the slices on chip. (Run 28 also made the clusters persistent, with two
 * slice buffers so that the next row's copy ran while this one was summed
 * and written: 25-29% slower, at one block per SM instead of three.)
 */
#if CF_SM90_PATH
/* mbarrier and bulk copy of plain sm_90, not attention/sm90.cuh's helpers:
 * those compile only in the sm_90a pass (empty elsewhere), and this kernel
 * also runs from the compute_90 PTX that newer GPUs JIT */
__device__ __forceinline__ uint32_t smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
/* the mbarrier expects `bytes` more, then this thread copies them from
 * global memory into this block's shared memory, completing on it */
__device__ __forceinline__ void bulk_load(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}
/* waits until the mbarrier's phase of this parity has completed */
__device__ __forceinline__ void bar_wait(uint64_t *bar, int parity) {
    asm volatile("{\n.reg .pred done;\nLAB_LMWAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra LAB_LMWAIT;\n}\n" ::"r"(smem_u32(bar)),
                 "r"(parity)
                 : "memory");
}
#endif
template <int CL, typename LT>
static __global__ void __launch_bounds__(512)
    lmhead_rows_cluster_kernel(float *losses, bf16 *dlogits, const LT *logits, const int *targets, const float *dloss,
                               int V, const float *tl) {
#if CF_SM90_PATH
    namespace cg = cooperative_groups;
    extern __shared__ uint4 slice4[]; /* this block's V / CL logits */
    __shared__ float sm[32], ss[32], part[2], lse_sh, tv_sh;
    __shared__ uint64_t full;
    cg::cluster_group cluster = cg::this_cluster();
    const int r = (int)cluster.block_rank(), row = blockIdx.y, n = V / CL, c0 = r * n;
    const LT *slice = reinterpret_cast<const LT *>(slice4);
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(&full)) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        bulk_load(slice4, logits + (size_t)row * V + c0, (uint32_t)(n * sizeof(LT)), &full);
    }
    /* the row's target, loss weight and exact target logit (bf16 logits),
     * loaded while the slice streams in */
    const int tgt = targets[row];
    const bool bad = tgt < 0 || tgt >= V, exact = tl && !bad;
    const float d = dloss ? dloss[row] : 1.f, e = exact ? tl[row] : 0.f;
    __syncthreads(); /* the mbarrier is initialised before anyone waits on it */
    bar_wait(&full, 0);
    float m = -INFINITY, s = 0.f;
    row_stats<true, LT>(slice, n, m, s);
    block_lse(m, s, sm, ss);
    if (threadIdx.x == 0) {
        part[0] = m;
        part[1] = s;
    }
    cluster.sync();
    if (threadIdx.x < 32) {
        /* warp 0: lane q < CL reads rank q's (m, s) and lane CL the
         * target's rounded logit from its owner's slice, all at once (one
         * round trip through distributed shared memory, not CL + 1 in
         * turn); then every lane combines the parts in rank order */
        const int lane = threadIdx.x, owner = bad ? 0 : tgt / n;
        float pm = -INFINITY, ps = 0.f, rt = 0.f;
        if (lane < CL) {
            const float *p = cluster.map_shared_rank(part, lane);
            pm = p[0];
            ps = p[1];
        } else if (lane == CL && !bad) {
            rt = lt_f(cluster.map_shared_rank(slice, owner)[tgt - owner * n]);
        }
        float M = -INFINITY, S = 0.f;
#pragma unroll
        for (int q = 0; q < CL; q++)
            lse_combine(M, S, __shfl_sync(0xffffffffu, pm, q), __shfl_sync(0xffffffffu, ps, q));
        rt = __shfl_sync(0xffffffffu, rt, CL);
        if (lane == 0) {
            if (exact) lse_swap_term(M, S, rt, e);
            lse_sh = M + logf(S);
            tv_sh = exact ? e : rt;
        }
    }
    /* no block leaves (or frees part and its slice) while another still
     * reads them; also makes lse_sh and tv_sh visible to the block */
    cluster.sync();
    const float lse = lse_sh, tv = tv_sh;
    if (losses && threadIdx.x == 0) {
        if (bad && r == 0) losses[row] = NAN;
        else if (!bad && tgt / n == r)
            losses[row] = lse - tv;
    }
    if (dlogits) row_grad<true, LT>(dlogits + (size_t)row * V + c0, slice, n, lse, d, bad ? -1 : tgt - c0, tv);
#endif
}

/* The logits' type: bf16 unless CF_LMHEAD_LOGITS=fp32 (an A/B switch, read
 * at every call); 0 and a failed context for any other value */
static int lm_logit_bytes(cf_cuda_ctx *ctx) {
    const char *e = getenv("CF_LMHEAD_LOGITS");
    if (!e || !*e || strcmp(e, "bf16") == 0) return 2;
    if (strcmp(e, "fp32") == 0) return 4;
    cf_cuda_ctx_fail(ctx, "CF_LMHEAD_LOGITS=%s: expected bf16 or fp32", e);
    return 0;
}

#if !(defined(CF_CUDA_PORTABLE) && CF_CUDA_PORTABLE)
typedef void (*lmhead_cluster_fn)(float *, bf16 *, const void *, const int *, const float *, int, const float *);
static lmhead_cluster_fn lmhead_cluster_kernel_for(int cl, int esz) {
#define LM_CK(C, T) reinterpret_cast<lmhead_cluster_fn>(lmhead_rows_cluster_kernel<C, T>)
    if (esz == 2) return cl == 2 ? LM_CK(2, bf16) : cl == 4 ? LM_CK(4, bf16) : LM_CK(8, bf16);
    return cl == 2 ? LM_CK(2, float) : cl == 4 ? LM_CK(4, float) : LM_CK(8, float);
#undef LM_CK
}

/* A cluster launch of CL blocks of 512 threads per row */
static cudaLaunchConfig_t lmhead_cluster_config(cf_cuda_ctx *ctx, int cl, int rows, size_t bytes,
                                                cudaLaunchAttribute *at) {
    at->id = cudaLaunchAttributeClusterDimension;
    at->val.clusterDim.x = cl;
    at->val.clusterDim.y = 1;
    at->val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(cl, rows);
    cfg.blockDim = dim3(512);
    cfg.dynamicSmemBytes = bytes;
    cfg.stream = ctx->stream;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    return cfg;
}

/* The cluster size for a vocabulary of V logits of esz bytes on this
 * context, or 0 for the one-block kernel: a GPU of cc >= 9, rows over 64
 * KB, CL the smallest of 2, 4, 8 with a slice of at most 100 KB of shared
 * memory (or want, CF_LMHEAD_CLUSTER=2|4|8, at any row size if its slice
 * fits), V a
 * multiple of CL 16-byte vectors, and a GPU that can place such a cluster
 * (not so on a MIG slice or with too few SMs per GPC). Planned once per
 * (V, esz, want) (ctx->lmhead_cluster_*): the shared-memory attribute and
 * the placement query cost microseconds, and the forward asks at every
 * chunk. -1: a CUDA call failed (ctx->failed). */
static int lmhead_cluster_plan(cf_cuda_ctx *ctx, int V, int esz, int want) {
    const int key[3] = {V, esz, want};
    if (memcmp(ctx->lmhead_cluster_key, key, sizeof key) == 0) return ctx->lmhead_cluster_cl;
    int cl = 0;
    if (ctx->cc_major >= 9 && (want || (size_t)V * esz > (64 << 10))) {
        cl = want ? want : 2;
        while (!want && cl < 8 && (size_t)(V / cl) * esz > (100 << 10)) cl *= 2;
        const size_t bytes = (size_t)(V / cl) * esz;
        if ((!want && bytes > (100 << 10)) || bytes > ctx->smem_optin || V % (cl * 16 / esz)) {
            cl = 0;
        } else {
            const lmhead_cluster_fn k = lmhead_cluster_kernel_for(cl, esz);
            if (!CF_CK(ctx, cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes))) return -1;
            cudaLaunchAttribute at;
            const cudaLaunchConfig_t cfg = lmhead_cluster_config(ctx, cl, 1, bytes, &at);
            int clusters = 0;
            if (cudaOccupancyMaxActiveClusters(&clusters, k, &cfg) != cudaSuccess || clusters < 1) {
                (void)cudaGetLastError(); /* not an error of the step */
                cl = 0;
            }
        }
    }
    memcpy(ctx->lmhead_cluster_key, key, sizeof key);
    ctx->lmhead_cluster_cl = cl;
    return cl;
}
#endif

/* The cluster kernel where it applies (false: the caller runs
 * lmhead_rows_kernel): an sm_90 build, a vocabulary lmhead_cluster_plan
 * gives a cluster size, at most 65535 rows, the 16-byte path's alignment,
 * and CF_LMHEAD_CLUSTER not "0" (an A/B switch, read at every call; 2, 4
 * or 8 asks for that cluster size). */
static bool lmhead_rows_cluster(cf_cuda_ctx *ctx, int rows, float *losses, bf16 *dlogits, const void *logits, int esz,
                                const int *targets, const float *dloss, int V, const float *tl) {
#if !(defined(CF_CUDA_PORTABLE) && CF_CUDA_PORTABLE)
    const char *e = getenv("CF_LMHEAD_CLUSTER");
    const int want = e && (!strcmp(e, "2") || !strcmp(e, "4") || !strcmp(e, "8")) ? atoi(e) : 0;
    if ((e && strcmp(e, "0") == 0) || rows > 65535 || !cf_aligned16(logits) ||
        ((uintptr_t)dlogits & (2 * (16 / esz) - 1)))
        return false;
    const int cl = lmhead_cluster_plan(ctx, V, esz, want);
    if (cl <= 0) return false;
    cudaLaunchAttribute at;
    const cudaLaunchConfig_t cfg = lmhead_cluster_config(ctx, cl, rows, (size_t)(V / cl) * esz, &at);
    return CF_CK(ctx, cudaLaunchKernelEx(&cfg, lmhead_cluster_kernel_for(cl, esz), losses, dlogits, logits, targets,
                                         dloss, V, tl));
#else
    return false;
#endif
}

/* one block of 512 threads per row (or, whole vocabulary, the cluster
 * kernel where it applies); the 16-byte path where every row of the logits
 * (and of dlogits) starts aligned */
template <typename LT>
static void lmhead_rows_t(cf_cuda_ctx *ctx, int rows, float *losses, float *stats, bf16 *dlogits, const LT *logits,
                          const int *targets, const float *dloss, const float *lse_in, int V, int vstart,
                          const float *tl) {
    constexpr int N = LN<LT>::n;
    if (V % N == 0 && cf_aligned16(logits) && ((uintptr_t)dlogits & (2 * N - 1)) == 0)
        lmhead_rows_kernel<true, LT>
            <<<rows, 512, 0, ctx->stream>>>(losses, stats, dlogits, logits, targets, dloss, lse_in, V, vstart, tl);
    else
        lmhead_rows_kernel<false, LT>
            <<<rows, 512, 0, ctx->stream>>>(losses, stats, dlogits, logits, targets, dloss, lse_in, V, vstart, tl);
}
static void lmhead_rows(cf_cuda_ctx *ctx, int rows, float *losses, float *stats, bf16 *dlogits, const void *logits,
                        int esz, const int *targets, const float *dloss, const float *lse_in, int V, int vstart,
                        const float *tl) {
    if (!stats && !lse_in && vstart == 0 &&
        (lmhead_rows_cluster(ctx, rows, losses, dlogits, logits, esz, targets, dloss, V, tl) || ctx->failed))
        return;
    if (esz == 2)
        lmhead_rows_t(ctx, rows, losses, stats, dlogits, (const bf16 *)logits, targets, dloss, lse_in, V, vstart, tl);
    else
        lmhead_rows_t(ctx, rows, losses, stats, dlogits, (const float *)logits, targets, dloss, lse_in, V, vstart, tl);
}

/* A chunk's logits [rows, V] = xc W^T (esz bytes each) and, for bf16 logits
 * (tl != NULL), its exact target logits; false: a CUDA error (ctx->failed) */
static bool lmhead_chunk_logits(cf_cuda_ctx *ctx, void *logits, int esz, float *tl, const bf16 *xc, const void *wlm,
                                const int *targets, int rows, int C, int V, int vstart) {
    cf_cuda_gemm(ctx, true, false, V, rows, C, wlm, C, xc, C, logits, esz == 2 ? CUDA_R_16BF : CUDA_R_32F, V, 0.f,
                 NULL);
    if (!tl || ctx->failed) return !ctx->failed;
    lmhead_target_logits_kernel<<<(rows + 7) / 8, 256, 0, ctx->stream>>>(tl, xc, (const bf16 *)wlm, targets, rows, C, V,
                                                                         vstart);
    return CF_CK_LAUNCH(ctx, "lmhead_target_logits");
}

/* rows per chunk: the logits (esz bytes each) + bf16 dlogits of a chunk stay
 * under ~1.5 GiB */
static int lm_chunk(int T, int V, int esz) {
    size_t budget = (size_t)3 << 29;
    size_t rows = budget / ((size_t)V * (esz + 2));
    if (rows < 1) rows = 1;
    return (int)(rows < (size_t)T ? rows : (size_t)T);
}

/* The chunk buffers: logits of esz bytes and, for bf16 logits, the exact
 * target logits (*tl, else NULL); false where one could not be had */
static bool lm_chunk_scratch(cf_cuda_ctx *ctx, int chunk, int V, int esz, void **logits, float **tl) {
    *logits = cf_cuda_scratch(ctx, CF_SCR_LOGITS, (size_t)chunk * V * esz);
    *tl = esz == 2 ? (float *)cf_cuda_scratch(ctx, CF_SCR_LM_TARGET, (size_t)chunk * sizeof(float)) : NULL;
    return *logits && (esz != 2 || *tl);
}

/* The forward in chunks of rows: losses of the whole vocabulary (and, g !=
 * NULL, g = softmax - onehot of every row), or (stats != NULL) a vocabulary
 * slice's statistics. */
static void lmhead_fwd(cf_backend *b, float *losses, float *stats, bf16 *g, const void *x, const void *wlm,
                       const int *targets, int T, int C, int V, int vstart) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0) return;
    const int esz = lm_logit_bytes(ctx);
    if (!esz) return;
    const int chunk = lm_chunk(T, V, esz);
    void *logits;
    float *tl;
    if (!lm_chunk_scratch(ctx, chunk, V, esz, &logits, &tl)) return;
    for (int r0 = 0; r0 < T && !ctx->failed; r0 += chunk) {
        const int rows = CF_MIN(chunk, T - r0);
        const bf16 *xc = (const bf16 *)x + (size_t)r0 * C;
        if (!lmhead_chunk_logits(ctx, logits, esz, tl, xc, wlm, targets + r0, rows, C, V, vstart)) return;
        float *lo = stats ? nullptr : losses + r0;
        float *st = stats ? stats + (size_t)r0 * 3 : nullptr;
        bf16 *gc = g ? g + (size_t)r0 * V : nullptr;
        lmhead_rows(ctx, rows, lo, st, gc, logits, esz, targets + r0, nullptr, nullptr, V, vstart, tl);
        if (!(stats ? CF_CK_LAUNCH(ctx, "lmhead_stats") : CF_CK_LAUNCH(ctx, "lmhead_rows"))) return;
    }
}

void cf_cuda_lmhead_loss_fwd(cf_backend *b, float *losses, const void *x, const void *wlm, const int *targets, int T,
                             int C, int V) {
    lmhead_fwd(b, losses, NULL, NULL, x, wlm, targets, T, C, V, 0);
}

void cf_cuda_lmhead_loss_fwd_grad(cf_backend *b, float *losses, void *g, const void *x, const void *wlm,
                                  const int *targets, int T, int C, int V) {
    lmhead_fwd(b, losses, NULL, (bf16 *)g, x, wlm, targets, T, C, V, 0);
}

void cf_cuda_lmhead_stats_fwd(cf_backend *b, float *stats, const void *x, const void *wlm, const int *targets, int T,
                              int C, int V, int vstart) {
    lmhead_fwd(b, NULL, stats, NULL, x, wlm, targets, T, C, V, vstart);
}

void cf_cuda_lmhead_loss_bwd(cf_backend *b, void *dx, float *dwlm, const void *x, const void *wlm,
                             const int *targets, const float *dloss, const float *lse, int T, int C, int V,
                             int vstart, int flags) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0) return;
    const int esz = lm_logit_bytes(ctx);
    if (!esz) return;
    const int chunk = lm_chunk(T, V, esz);
    void *logits;
    float *tl;
    bf16 *dlogits = (bf16 *)cf_cuda_scratch(ctx, CF_SCR_DLOGITS, (size_t)chunk * V * sizeof(bf16));
    if (!dlogits || !lm_chunk_scratch(ctx, chunk, V, esz, &logits, &tl)) return;
    for (int r0 = 0; r0 < T && !ctx->failed; r0 += chunk) {
        const int rows = CF_MIN(chunk, T - r0);
        const bf16 *xc = (const bf16 *)x + (size_t)r0 * C;
        if (!lmhead_chunk_logits(ctx, logits, esz, tl, xc, wlm, targets + r0, rows, C, V, vstart)) return;
        lmhead_rows(ctx, rows, NULL, NULL, dlogits, logits, esz, targets + r0, dloss + r0, lse ? lse + r0 : NULL, V,
                    vstart, tl);
        if (!CF_CK_LAUNCH(ctx, "lmhead_rows")) return;
        /* dx = dlogits W ; dW += dlogits^T x (the first chunk writes dW when it holds zeros) */
        cf_cuda_matmul_bwd(b, (bf16 *)dx + (size_t)r0 * C, dwlm, NULL, dlogits, xc, wlm, rows, C, V,
                           r0 == 0 ? (flags & CF_MM_DW_SET) : 0);
    }
}

/* g[t,:] = dloss[t] * g[t,:] in place, rounded to bf16 (0 where dloss[t]
 * == 0); one block per row. */
/* g[row] *= dloss[row] / scale: exactly 1 or 0 for a row whose weight is
 * scale or 0, so g keeps its one bf16 rounding there */
static __global__ void lmhead_scale_rows_kernel(bf16 *g, const float *dloss, float scale, int V) {
    const int row = blockIdx.x;
    const float d = dloss[row], r = d / scale;
    bf16 *gr = g + (size_t)row * V;
    if (r == 1.f) return;
    for (int j = threadIdx.x; j < V; j += blockDim.x)
        gr[j] = __float2bfloat16_rn(d == 0.f ? 0.f : r * __bfloat162float(gr[j]));
}

/* The backward from the forward's g: rows reweighted in g (only where dloss
 * is given and differs from scale), then matmul_bwd's two GEMMs over all T
 * rows at once with the products times scale: no logits recompute, no
 * chunking (g already holds every row). */
void cf_cuda_lmhead_loss_bwd_saved(cf_backend *b, void *dx, float *dwlm, void *g, const void *x, const void *wlm,
                                   const float *dloss, float scale, int T, int C, int V, int flags) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0) return;
    if (!(scale != 0.f) || !isfinite(scale)) {
        cf_cuda_ctx_fail(ctx, "lmhead_loss_bwd_saved: scale %g must be finite and nonzero", scale);
        return;
    }
    if (dloss) {
        lmhead_scale_rows_kernel<<<T, 512, 0, ctx->stream>>>((bf16 *)g, dloss, scale, V);
        if (!CF_CK_LAUNCH(ctx, "lmhead_scale_rows")) return;
    }
    cf_cuda_matmul_bwd_scaled(ctx, dx, dwlm, g, x, wlm, T, C, V, flags & CF_MM_DW_SET, scale);
}

/* lse[t] = M + log(sum_p s_p exp(m_p - M)), losses[t] = lse[t] - sum_p tgt_p
 * over the slices' stats parts [nparts, T, 3] (one thread per row). */
static __global__ void xent_combine_kernel(float *losses, float *lse, const float *parts, const int *targets, int T,
                                           int nparts, int V) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    float M = -INFINITY, tgt = 0.f;
    for (int p = 0; p < nparts; p++) M = fmaxf(M, parts[((size_t)p * T + t) * 3]);
    float s = 0.f;
    for (int p = 0; p < nparts; p++) {
        const float *st = parts + ((size_t)p * T + t) * 3;
        if (st[0] > -INFINITY) s += st[1] * expf(st[0] - M);
        tgt += st[2];
    }
    const float l = M + logf(s);
    if (lse) lse[t] = l;
    losses[t] = targets[t] >= 0 && targets[t] < V ? l - tgt : NAN;
}

void cf_cuda_xent_combine(cf_backend *b, float *losses, float *lse, const float *parts, const int *targets, int T,
                          int nparts, int V) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0) return;
    xent_combine_kernel<<<(T + 255) / 256, 256, 0, ctx->stream>>>(losses, lse, parts, targets, T, nparts, V);
    CF_CK_LAUNCH(ctx, "xent_combine");
}
