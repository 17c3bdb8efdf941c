/*
 * norm.cu — RMSNorm forward and backward, one warp per row; the weight
 * gradient is a deterministic column sum (gemm.cu).
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

/* dx_c = r w_c g_c - r^3 x_c / C * sum_j g_j w_j x_j   (g = dout), one warp per row */
template <bool VEC>
static __global__ void rmsnorm_bwd_kernel(bf16 *dinp, const bf16 *dout, const bf16 *inp, const bf16 *w, const float *rstd,
                                   int T, int C, int accumulate) {
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (row >= T) return;
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
        }
    } else {
        for (int c = lane; c < C; c += 32) {
            float v = r * __bfloat162float(w[c]) * __bfloat162float(g[c]) - coef * __bfloat162float(x[c]);
            if (accumulate) v += __bfloat162float(dx[c]);
            dx[c] = __float2bfloat16_rn(v);
        }
    }
}
void cf_cuda_rmsnorm_bwd(cf_backend *b, void *dinp, float *dw, const void *dout, const void *inp, const void *w,
                           const float *rstd, int T, int C, int accumulate) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0) return;
    int blocks = (T * 32 + 255) / 256;
    if (C % 8 == 0 && cf_aligned16(dinp) && cf_aligned16(dout) && cf_aligned16(inp) && cf_aligned16(w))
        rmsnorm_bwd_kernel<true><<<blocks, 256, 0, ctx->stream>>>((bf16 *)dinp, (const bf16 *)dout, (const bf16 *)inp,
                                                  (const bf16 *)w, rstd, T, C, accumulate);
    else
        rmsnorm_bwd_kernel<false><<<blocks, 256, 0, ctx->stream>>>((bf16 *)dinp, (const bf16 *)dout, (const bf16 *)inp,
                                                   (const bf16 *)w, rstd, T, C, accumulate);
    if (!CF_CK_LAUNCH(ctx, "rmsnorm_bwd")) return;
    /* dw[c] += sum_t dout[t,c] * x[t,c] * rstd[t]; dw NULL: a frozen norm weight */
    if (dw) cf_cuda_colsum(ctx, dw, (const bf16 *)dout, (const bf16 *)inp, rstd, T, C);
}
