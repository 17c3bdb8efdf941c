/*
 * norm.cu — RMSNorm forward (alone, or with the residual add before it) and
 * backward, one warp per row; the backward
 * also writes the weight gradient's deterministic partial column sums, added
 * up by gemm.cu's final column-sum kernel.
 */
#include "backend/cuda/cuda_common.cuh"

/* ============================================================== rmsnorm */

/* One warp per row. out = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps). */
template <bool VEC>
static __global__ void rmsnorm_fwd_kernel(bf16 *out, float *rstd, const bf16 *inp, const bf16 *w, int T, int C, float eps) {
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (row >= T) return;
    const bf16 *x = inp + (size_t)row * C;
    bf16 *y = out + (size_t)row * C;
    float ss = 0.f;
    if (VEC) {
        for (int c = lane * 8; c < C; c += 256) {
            float f[8];
            unpack8(*(const pack8 *)(x + c), f);
            for (int k = 0; k < 8; k++) ss += f[k] * f[k];
        }
    } else {
        for (int c = lane; c < C; c += 32) {
            float f = __bfloat162float(x[c]);
            ss += f * f;
        }
    }
    ss = warp_sum(ss);
    const float r = rsqrtf(ss / C + eps);
    if (VEC) {
        for (int c = lane * 8; c < C; c += 256) {
            float f[8], wf[8];
            unpack8(*(const pack8 *)(x + c), f);
            unpack8(*(const pack8 *)(w + c), wf);
            for (int k = 0; k < 8; k++) f[k] = f[k] * r * wf[k];
            *(pack8 *)(y + c) = pack8_from(f);
        }
    } else {
        for (int c = lane; c < C; c += 32)
            y[c] = __float2bfloat16_rn(__bfloat162float(x[c]) * r * __bfloat162float(w[c]));
    }
    if (lane == 0) rstd[row] = r;
}
/* One warp per row: s = bf16(a + c) is written, and its sum of squares
 * taken from the rounded values (what rmsnorm_fwd would read back); the
 * second pass reads s back (the warp's own writes, from L1/L2) for
 * out = s * rstd * w. One launch and one read of s from memory fewer than
 * add + rmsnorm_fwd. */
template <bool VEC>
static __global__ void add_rmsnorm_fwd_kernel(bf16 *sum, bf16 *out, float *rstd, const bf16 *a, const bf16 *c,
                                              const bf16 *w, int T, int C, float eps) {
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (row >= T) return;
    const size_t off = (size_t)row * C;
    float ss = 0.f;
    if (VEC) {
        for (int i = lane * 8; i < C; i += 256) {
            float fa[8], fc[8];
            unpack8(*(const pack8 *)(a + off + i), fa);
            unpack8(*(const pack8 *)(c + off + i), fc);
            for (int k = 0; k < 8; k++) fa[k] += fc[k];
            pack8 p = pack8_from(fa);
            *(pack8 *)(sum + off + i) = p;
            unpack8(p, fa);
            for (int k = 0; k < 8; k++) ss += fa[k] * fa[k];
        }
    } else {
        for (int i = lane; i < C; i += 32) {
            bf16 s = __float2bfloat16_rn(__bfloat162float(a[off + i]) + __bfloat162float(c[off + i]));
            sum[off + i] = s;
            float f = __bfloat162float(s);
            ss += f * f;
        }
    }
    ss = warp_sum(ss);
    const float r = rsqrtf(ss / C + eps);
    if (VEC) {
        for (int i = lane * 8; i < C; i += 256) {
            float f[8], wf[8];
            unpack8(*(const pack8 *)(sum + off + i), f);
            unpack8(*(const pack8 *)(w + i), wf);
            for (int k = 0; k < 8; k++) f[k] = f[k] * r * wf[k];
            *(pack8 *)(out + off + i) = pack8_from(f);
        }
    } else {
        for (int i = lane; i < C; i += 32)
            out[off + i] = __float2bfloat16_rn(__bfloat162float(sum[off + i]) * r * __bfloat162float(w[i]));
    }
    if (lane == 0) rstd[row] = r;
}
void cf_cuda_add_rmsnorm_fwd(cf_backend *b, void *sum, void *out, float *rstd, const void *a, const void *c,
                             const void *w, int T, int C, float eps) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0) return;
    int blocks = (T * 32 + 255) / 256;
    if (C % 8 == 0 && cf_aligned16(sum) && cf_aligned16(out) && cf_aligned16(a) && cf_aligned16(c) &&
        cf_aligned16(w))
        add_rmsnorm_fwd_kernel<true><<<blocks, 256, 0, ctx->stream>>>(
            (bf16 *)sum, (bf16 *)out, rstd, (const bf16 *)a, (const bf16 *)c, (const bf16 *)w, T, C, eps);
    else
        add_rmsnorm_fwd_kernel<false><<<blocks, 256, 0, ctx->stream>>>(
            (bf16 *)sum, (bf16 *)out, rstd, (const bf16 *)a, (const bf16 *)c, (const bf16 *)w, T, C, eps);
    CF_CK_LAUNCH(ctx, "add_rmsnorm_fwd");
}

void cf_cuda_rmsnorm_fwd(cf_backend *b, void *out, float *rstd, const void *inp, const void *w, int T, int C,
                           float eps) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0) return;
    int blocks = (T * 32 + 255) / 256;
    if (C % 8 == 0 && cf_aligned16(out) && cf_aligned16(inp) && cf_aligned16(w))
        rmsnorm_fwd_kernel<true><<<blocks, 256, 0, ctx->stream>>>(
            (bf16 *)out, rstd, (const bf16 *)inp, (const bf16 *)w, T, C, eps);
    else
        rmsnorm_fwd_kernel<false><<<blocks, 256, 0, ctx->stream>>>(
            (bf16 *)out, rstd, (const bf16 *)inp, (const bf16 *)w, T, C, eps);
    CF_CK_LAUNCH(ctx, "rmsnorm_fwd");
}

/*
 * dx_c = r w_c g_c - r^3 x_c / C * sum_j g_j w_j x_j   (g = dout), one warp per row;
 * with DW also the weight gradient's partial sums, dw_c = sum_t g_c x_c r_t:
 * block b owns rows [b*rows, (b+1)*rows), its warps take them in turn and
 * add g x r into a shared-memory row of their own (each lane always the
 * same columns: no races), and the block writes the sum of its warps' rows,
 * in warp order, as partial row b (cf_cuda_colsum_final adds the partial rows
 * to dw in order). Deterministic: no atomics, a chunking that depends on T
 * and C only.
 */
struct __align__(16) float8 { float v[8]; };
template <bool VEC, bool DW>
static __global__ void rmsnorm_bwd_kernel(bf16 *dinp, float *partial, const bf16 *dout, const bf16 *inp,
                                          const bf16 *w, const float *rstd, int T, int C, int rows, int accumulate) {
    extern __shared__ float4 dw_smem[]; /* [warps][C] floats with DW, 16-byte aligned */
    float *dw_s = (float *)dw_smem;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    float *acc = dw_s + (size_t)warp * C;
    if (DW) {
        if (VEC) {
            for (int c = lane * 8; c < C; c += 256) *(float8 *)(acc + c) = float8{};
        } else {
            for (int c = lane; c < C; c += 32) acc[c] = 0.f;
        }
    }
    const int t0 = blockIdx.x * rows, t1 = min(T, t0 + rows);
    for (int row = t0 + warp; row < t1; row += nw) {
        const bf16 *x = inp + (size_t)row * C, *g = dout + (size_t)row * C;
        bf16 *dx = dinp + (size_t)row * C;
        const float r = rstd[row];
        float dot = 0.f;
        if (VEC) {
            for (int c = lane * 8; c < C; c += 256) {
                float xf[8], gf[8], wf[8];
                unpack8(*(const pack8 *)(x + c), xf);
                unpack8(*(const pack8 *)(g + c), gf);
                unpack8(*(const pack8 *)(w + c), wf);
                for (int k = 0; k < 8; k++) dot += gf[k] * wf[k] * xf[k];
            }
        } else {
            for (int c = lane; c < C; c += 32)
                dot += __bfloat162float(g[c]) * __bfloat162float(w[c]) * __bfloat162float(x[c]);
        }
        dot = warp_sum(dot);
        const float coef = r * r * r * dot / C;
        if (VEC) {
            for (int c = lane * 8; c < C; c += 256) {
                float xf[8], gf[8], wf[8], o[8];
                unpack8(*(const pack8 *)(x + c), xf);
                unpack8(*(const pack8 *)(g + c), gf);
                unpack8(*(const pack8 *)(w + c), wf);
                if (accumulate) unpack8(*(const pack8 *)(dx + c), o);
                for (int k = 0; k < 8; k++) {
                    float v = r * wf[k] * gf[k] - coef * xf[k];
                    o[k] = accumulate ? o[k] + v : v;
                }
                *(pack8 *)(dx + c) = pack8_from(o);
                if (DW) { /* two 16-byte shared accesses: 2-way bank conflicts, not 8 */
                    float8 a = *(float8 *)(acc + c);
                    for (int k = 0; k < 8; k++) a.v[k] += gf[k] * xf[k] * r;
                    *(float8 *)(acc + c) = a;
                }
            }
        } else {
            for (int c = lane; c < C; c += 32) {
                const float xf = __bfloat162float(x[c]), gf = __bfloat162float(g[c]);
                float v = r * __bfloat162float(w[c]) * gf - coef * xf;
                if (accumulate) v += __bfloat162float(dx[c]);
                dx[c] = __float2bfloat16_rn(v);
                if (DW) acc[c] += gf * xf * r;
            }
        }
    }
    if (DW) {
        __syncthreads();
        for (int c = threadIdx.x; c < C; c += blockDim.x) {
            float s = 0.f;
            for (int k = 0; k < nw; k++) s += dw_s[(size_t)k * C + c];
            partial[(size_t)blockIdx.x * C + c] = s;
        }
    }
}

/* Warps per block: 8, fewer where their dw rows would pass 48 KB of shared
 * memory (the default limit: 4 at C = 3072); none (dx alone, then dw by
 * cf_cuda_colsum) past C = 12288. Rows per warp: 1 up to 4096 warps in all
 * (31 per SM on an H100), more past that: enough loads in flight, while the
 * fp32 partial rows (one per block) stay a small fraction of the input. */
#define RMSNORM_BWD_SMEM (48 << 10)
#define RMSNORM_BWD_WARPS 4096
template <bool VEC>
static void rmsnorm_bwd_launch(cf_cuda_ctx *ctx, bf16 *dinp, float *dw, const bf16 *dout, const bf16 *inp,
                               const bf16 *w, const float *rstd, int T, int C, int accumulate) {
    const int nw = min(8, RMSNORM_BWD_SMEM / (C * (int)sizeof(float)));
    if (!dw || nw < 1) { /* one row per warp; dw NULL: a frozen norm weight */
        rmsnorm_bwd_kernel<VEC, false><<<(T + 7) / 8, 256, 0, ctx->stream>>>(dinp, NULL, dout, inp, w, rstd, T, C, 8,
                                                                              accumulate);
        /* dw[c] += sum_t dout[t,c] x[t,c] rstd[t] */
        if (CF_CK_LAUNCH(ctx, "rmsnorm_bwd") && dw) cf_cuda_colsum(ctx, dw, dout, inp, rstd, T, C);
        return;
    }
    const int rows = nw * ((T + RMSNORM_BWD_WARPS - 1) / RMSNORM_BWD_WARPS), nblocks = (T + rows - 1) / rows;
    float *partial = (float *)cf_cuda_scratch(ctx, CF_SCR_COLSUM, (size_t)nblocks * C * sizeof(float));
    if (!partial) return;
    rmsnorm_bwd_kernel<VEC, true><<<nblocks, 32 * nw, (size_t)nw * C * sizeof(float), ctx->stream>>>(
        dinp, partial, dout, inp, w, rstd, T, C, rows, accumulate);
    if (CF_CK_LAUNCH(ctx, "rmsnorm_bwd")) cf_cuda_colsum_final(ctx, dw, partial, nblocks, C);
}
void cf_cuda_rmsnorm_bwd(cf_backend *b, void *dinp, float *dw, const void *dout, const void *inp, const void *w,
                         const float *rstd, int T, int C, int accumulate) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0 || C <= 0) return;
    if (C % 8 == 0 && cf_aligned16(dinp) && cf_aligned16(dout) && cf_aligned16(inp) && cf_aligned16(w))
        rmsnorm_bwd_launch<true>(ctx, (bf16 *)dinp, dw, (const bf16 *)dout, (const bf16 *)inp, (const bf16 *)w, rstd,
                                 T, C, accumulate);
    else
        rmsnorm_bwd_launch<false>(ctx, (bf16 *)dinp, dw, (const bf16 *)dout, (const bf16 *)inp, (const bf16 *)w, rstd,
                                  T, C, accumulate);
}
