/*
 * rope.cu — rotate-half rotary position embedding, in place, forward and
 * backward (the transposed rotation).
 */
#include "backend/cuda/cuda_common.cuh"

/* ================================================================= rope */

/*
 * Rotate-half RoPE, in place on x[T, nh, D]: for i < D/2, angle = pos * inv_freq[i],
 *   x1' = x1 cos - x2 sin,  x2' = x2 cos + x1 sin     (x1 = x[i], x2 = x[i + D/2])
 * bwd applies the transpose (angle -> -angle). One thread per (t, head, i).
 */
static __global__ void rope_kernel(bf16 *x, const int *pos, const float *inv_freq, int T, int nh, int D, float sign) {
    const int half = D / 2;
    const size_t n = (size_t)T * half;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += (size_t)gridDim.x * blockDim.x) {
        const int i = (int)(idx % half);
        const size_t t = idx / half;
        float s, c;
        sincosf((float)pos[t] * inv_freq[i], &s, &c);   /* once per (position, frequency), for all heads */
        s *= sign;
        bf16 *row = x + t * (size_t)nh * D;
        for (int h = 0; h < nh; h++) {
            bf16 *p = row + (size_t)h * D;
            float x1 = __bfloat162float(p[i]), x2 = __bfloat162float(p[i + half]);
            p[i] = __float2bfloat16_rn(x1 * c - x2 * s);
            p[i + half] = __float2bfloat16_rn(x2 * c + x1 * s);
        }
    }
}
void cf_cuda_rope_fwd(cf_backend *b, void *x, const int *pos, const float *inv_freq, int T, int nh, int D) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0) return;
    rope_kernel<<<cf_grid_for((size_t)T * (D / 2), 256), 256, 0, ctx->stream>>>(
        (bf16 *)x, pos, inv_freq, T, nh, D, 1.f);
    CF_CK_LAUNCH(ctx, "rope");
}
void cf_cuda_rope_bwd(cf_backend *b, void *dx, const int *pos, const float *inv_freq, int T, int nh, int D) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0) return;
    rope_kernel<<<cf_grid_for((size_t)T * (D / 2), 256), 256, 0, ctx->stream>>>(
        (bf16 *)dx, pos, inv_freq, T, nh, D, -1.f);
    CF_CK_LAUNCH(ctx, "rope");
}
