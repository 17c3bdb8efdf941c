/*
 * rope.cu — rotate-half rotary position embedding, in place, forward and
 * backward (the transposed rotation), of one tensor or of q and k together.
 */
#include "backend/cuda/cuda_common.cuh"

/* ================================================================= rope */

/* one tensor x[T, nh, D] at positions pos[T] (T = 0: none) */
struct rope_part {
    bf16 *x;
    const int *pos;
    int T, nh;
};

/*
 * Rotate-half RoPE, in place on x[T, nh, D]: for i < D/2, angle = pos * inv_freq[i],
 *   x1' = x1 cos - x2 sin,  x2' = x2 cos + x1 sin     (x1 = x[i], x2 = x[i + D/2])
 * bwd applies the transpose (angle -> -angle). One thread per (t, head, V
 * consecutive i): with V = 8 one 16-byte load and store for each half (the
 * x1 and the x2 of 8 frequencies), else scalar. sincosf per (t, i) and head:
 * recomputing it per head is cheaper than the old loop over heads, whose
 * dependent scalar loads left the kernel latency-bound. The items of part a
 * come first, then those of part b (q and k of a layer: one launch).
 */
template <int V>
static __global__ void rope_kernel(rope_part pa, rope_part pb, const float *inv_freq, int D, float sign) {
    const int half = D / 2, groups = half / V;
    const size_t na = (size_t)pa.T * pa.nh * groups, n = na + (size_t)pb.T * pb.nh * groups;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += (size_t)gridDim.x * blockDim.x) {
        const bool in_b = idx >= na;
        const size_t j = in_b ? idx - na : idx;
        bf16 *x = in_b ? pb.x : pa.x;
        const int *pos = in_b ? pb.pos : pa.pos;
        const int nh = in_b ? pb.nh : pa.nh;
        const int i0 = (int)(j % groups) * V;
        const size_t th = j / groups; /* t * nh + head */
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
static void rope(cf_backend *b, rope_part pa, rope_part pb, const float *inv_freq, int D, float sign) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || D < 2) return;
    if (pa.T < 0 || pa.nh < 0) pa.T = 0;
    if (pb.T < 0 || pb.nh < 0) pb.T = 0;
    const size_t rows = (size_t)pa.T * pa.nh + (size_t)pb.T * pb.nh;
    if (rows == 0) return;
    /* the 16-byte path where both parts' rows are 16-byte aligned */
    if ((D / 2) % 8 == 0 && (!pa.T || cf_aligned16(pa.x)) && (!pb.T || cf_aligned16(pb.x)))
        rope_kernel<8><<<cf_grid_for(rows * (D / 16), 256), 256, 0, ctx->stream>>>(pa, pb, inv_freq, D, sign);
    else
        rope_kernel<1><<<cf_grid_for(rows * (D / 2), 256), 256, 0, ctx->stream>>>(pa, pb, inv_freq, D, sign);
    CF_CK_LAUNCH(ctx, "rope");
}
void cf_cuda_rope_fwd(cf_backend *b, void *x, const int *pos, const float *inv_freq, int T, int nh, int D) {
    rope(b, rope_part{(bf16 *)x, pos, T, nh}, rope_part{NULL, NULL, 0, 0}, inv_freq, D, 1.f);
}
void cf_cuda_rope_bwd(cf_backend *b, void *dx, const int *pos, const float *inv_freq, int T, int nh, int D) {
    rope(b, rope_part{(bf16 *)dx, pos, T, nh}, rope_part{NULL, NULL, 0, 0}, inv_freq, D, -1.f);
}
void cf_cuda_rope_qk(cf_backend *b, void *q, const int *qpos, int Tq, int Hq, void *k, const int *kpos, int Tk,
                     int Hk, const float *inv_freq, int D, int bwd) {
    rope(b, rope_part{(bf16 *)q, qpos, Tq, Hq}, rope_part{(bf16 *)k, kpos, Tk, Hk}, inv_freq, D, bwd ? -1.f : 1.f);
}
