/*
 * rope.cu — rotate-half rotary position embedding, in place, forward and
 * backward (the transposed rotation).
 */
#include "backend/cuda/cuda_common.cuh"

/* ================================================================= rope */

/*
 * Rotate-half RoPE, in place on x[T, nh, D]: for i < D/2, angle = pos * inv_freq[i],
 *   x1' = x1 cos - x2 sin,  x2' = x2 cos + x1 sin     (x1 = x[i], x2 = x[i + D/2])
 * bwd applies the transpose (angle -> -angle). One thread per (t, head, V
 * consecutive i): with V = 8 one 16-byte load and store for each half (the
 * x1 and the x2 of 8 frequencies), else scalar. sincosf per (t, i) and head:
 * recomputing it per head is cheaper than the old loop over heads, whose
 * dependent scalar loads left the kernel latency-bound.
 */
template <int V>
static __global__ void rope_kernel(bf16 *x, const int *pos, const float *inv_freq, int T, int nh, int D, float sign) {
    const int half = D / 2, groups = half / V;
    const size_t n = (size_t)T * nh * groups;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += (size_t)gridDim.x * blockDim.x) {
        const int i0 = (int)(idx % groups) * V;
        const size_t th = idx / groups; /* t * nh + head */
        const float p = (float)pos[th / nh];
        bf16 *x1p = x + th * D + i0, *x2p = x1p + half;
        float x1[V], x2[V];
        if (V == 8) {
            unpack8(*(const pack8 *)x1p, x1);
            unpack8(*(const pack8 *)x2p, x2);
        } else {
            for (int k = 0; k < V; k++) x1[k] = __bfloat162float(x1p[k]), x2[k] = __bfloat162float(x2p[k]);
        }
        for (int k = 0; k < V; k++) {
            float s, c;
            sincosf(p * inv_freq[i0 + k], &s, &c);
            s *= sign;
            const float a = x1[k], b = x2[k];
            x1[k] = a * c - b * s;
            x2[k] = b * c + a * s;
        }
        if (V == 8) {
            *(pack8 *)x1p = pack8_from(x1);
            *(pack8 *)x2p = pack8_from(x2);
        } else {
            for (int k = 0; k < V; k++) x1p[k] = __float2bfloat16_rn(x1[k]), x2p[k] = __float2bfloat16_rn(x2[k]);
        }
    }
}
static void rope(cf_backend *b, void *x, const int *pos, const float *inv_freq, int T, int nh, int D, float sign) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0 || nh <= 0 || D < 2) return;
    const size_t rows = (size_t)T * nh;
    if ((D / 2) % 8 == 0 && cf_aligned16(x))
        rope_kernel<8><<<cf_grid_for(rows * (D / 16), 256), 256, 0, ctx->stream>>>((bf16 *)x, pos, inv_freq, T, nh,
                                                                                    D, sign);
    else
        rope_kernel<1><<<cf_grid_for(rows * (D / 2), 256), 256, 0, ctx->stream>>>((bf16 *)x, pos, inv_freq, T, nh, D,
                                                                                   sign);
    CF_CK_LAUNCH(ctx, "rope");
}
void cf_cuda_rope_fwd(cf_backend *b, void *x, const int *pos, const float *inv_freq, int T, int nh, int D) {
    rope(b, x, pos, inv_freq, T, nh, D, 1.f);
}
void cf_cuda_rope_bwd(cf_backend *b, void *dx, const int *pos, const float *inv_freq, int T, int nh, int D) {
    rope(b, dx, pos, inv_freq, T, nh, D, -1.f);
}
