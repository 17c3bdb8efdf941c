/*
 * rope.cu — rotate-half rotary position embedding, in place, forward and
 * backward (the transposed rotation), of one tensor or of q and k together;
 * and the split of the fused q/k/v projection's rows with RoPE applied,
 * with its backward (the rows joined again, RoPE undone).
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

/* ======================================================= qkv split + rope */

/*
 * The rows of the fused projection, qkv[T, (Hq + 2 Hk) D] = q | k | v, into
 * q[T, Hq, D] and k[T, Hk, D] rotated as rope_kernel does (the same float
 * arithmetic) and v[T, Hk, D] copied: one read and one write of each
 * element instead of three GEMM outputs and an in-place RoPE pass. JOIN is
 * its backward: q, k, v (the gradients) joined into qkv's rows, q and k
 * rotated back (angle -> -angle). One thread per (t, head, V consecutive
 * i), heads q first, then k, then v; V = 8: 16-byte loads and stores.
 */
template <int V, bool JOIN>
static __global__ void qkv_rope_kernel(bf16 *qkv, bf16 *q, bf16 *k, bf16 *v, const int *pos, int T, int Hq, int Hk,
                                       const float *inv_freq, int D) {
    const int half = D / 2, groups = half / V, nh = Hq + 2 * Hk;
    const size_t n = (size_t)T * nh * groups;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += (size_t)gridDim.x * blockDim.x) {
        const int i0 = (int)(idx % groups) * V;
        const size_t th = idx / groups; /* t * nh + head */
        const size_t t = th / nh;
        const int h = (int)(th % nh);
        bf16 *part = h < Hq        ? q + (t * Hq + h) * D
                     : h < Hq + Hk ? k + (t * Hk + (h - Hq)) * D
                                   : v + (t * Hk + (h - Hq - Hk)) * D;
        bf16 *joined = qkv + th * D;
        const bf16 *x1p = (JOIN ? part : joined) + i0, *x2p = x1p + half;
        bf16 *o1 = (JOIN ? joined : part) + i0, *o2 = o1 + half;
        float x1[V], x2[V];
        if (V == 8) {
            unpack8(*(const pack8 *)x1p, x1);
            unpack8(*(const pack8 *)x2p, x2);
        } else {
            for (int j = 0; j < V; j++) x1[j] = __bfloat162float(x1p[j]), x2[j] = __bfloat162float(x2p[j]);
        }
        if (h < Hq + Hk) {
            const float p = (float)pos[t];
            for (int j = 0; j < V; j++) {
                float s, c;
                sincosf(p * inv_freq[i0 + j], &s, &c);
                if (JOIN) s *= -1.f;
                const float a = x1[j], b = x2[j];
                x1[j] = a * c - b * s;
                x2[j] = b * c + a * s;
            }
        }
        if (V == 8) {
            *(pack8 *)o1 = pack8_from(x1);
            *(pack8 *)o2 = pack8_from(x2);
        } else {
            for (int j = 0; j < V; j++) o1[j] = __float2bfloat16_rn(x1[j]), o2[j] = __float2bfloat16_rn(x2[j]);
        }
    }
}
template <bool JOIN>
static void qkv_rope(cf_backend *b, bf16 *qkv, bf16 *q, bf16 *k, bf16 *v, const int *pos, int T, int Hq, int Hk,
                     const float *inv_freq, int D) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0 || D < 2 || Hq < 0 || Hk < 0 || Hq + 2 * Hk == 0) return;
    const size_t rows = (size_t)T * (Hq + 2 * Hk);
    /* 16-byte path: every head's halves start 16-byte aligned (D/2 % 8 == 0
     * and aligned bases); else scalar */
    if ((D / 2) % 8 == 0 && cf_aligned16(q) && cf_aligned16(k) && cf_aligned16(v) && cf_aligned16(qkv))
        qkv_rope_kernel<8, JOIN><<<cf_grid_for(rows * (D / 16), 256), 256, 0, ctx->stream>>>(qkv, q, k, v, pos, T, Hq,
                                                                                         Hk, inv_freq, D);
    else
        qkv_rope_kernel<1, JOIN><<<cf_grid_for(rows * (D / 2), 256), 256, 0, ctx->stream>>>(qkv, q, k, v, pos, T, Hq,
                                                                                        Hk, inv_freq, D);
    if (JOIN) CF_CK_LAUNCH(ctx, "qkv_join_rope_bwd");
    else CF_CK_LAUNCH(ctx, "qkv_split_rope");
}
void cf_cuda_qkv_split_rope(cf_backend *b, void *q, void *k, void *v, const void *qkv, const int *pos, int T,
                            int Hq, int Hk, const float *inv_freq, int D) {
    qkv_rope<false>(b, (bf16 *)qkv, (bf16 *)q, (bf16 *)k, (bf16 *)v, pos, T, Hq, Hk, inv_freq, D);
}
/* the split's backward (JOIN): the kernel reads q, k, v and writes qkv */
void cf_cuda_qkv_join_rope_bwd(cf_backend *b, void *dqkv, const void *dq, const void *dk, const void *dv,
                               const int *pos, int T, int Hq, int Hk, const float *inv_freq, int D) {
    qkv_rope<true>(b, (bf16 *)dqkv, (bf16 *)dq, (bf16 *)dk, (bf16 *)dv, pos, T, Hq, Hk, inv_freq, D);
}
