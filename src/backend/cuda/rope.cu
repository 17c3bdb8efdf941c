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
 * Rotate-half RoPE: for i < D/2, angle = pos * inv_freq[i],
 *   x1' = x1 cos - x2 sin,  x2' = x2 cos + x1 sin     (x1 = x[i], x2 = x[i + D/2])
 * and its transpose (sign = -1: angle -> -angle) for the backward.
 *
 * A block per token: its sin and cos of the D/2 angles are taken once, into
 * shared memory (rope_angles), then every head of the token is rotated from
 * that table. Why: with a thread per (token, head) the kernel took sincosf
 * per element and head and 64-bit index divisions per item; the q/k/v
 * split went from 23.6 to 17.0 us at TinyLlama's shape (the DRAM floor is
 * near 7) and from 10.6 to 8.8 at Qwen2.5-1.5B's (ncu, H100,
 * docs/BENCHMARKS.md run 23). Issuing each thread's loads before making the
 * table measured slower (21-23 us). The table holds the same sincosf of the
 * same product, so the results are unchanged bit for bit.
 */
__device__ __forceinline__ void rope_angles(float *sn, float *cs, float p, const float *inv_freq, int half, float sign) {
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        sincosf(p * inv_freq[i], &s, &c);
        sn[i] = s * sign;
        cs[i] = c;
    }
    __syncthreads();
}
/* the V pairs at x1p[0..V), x2p[0..V) (= x1p + D/2) rotated by the table's
 * angles i0..i0+V-1 and stored at o1, o2; V = 8: one 16-byte access each */
template <int V>
__device__ __forceinline__ void rope_pairs(bf16 *o1, bf16 *o2, const bf16 *x1p, const bf16 *x2p, const float *sn,
                                           const float *cs, int i0, bool rotate) {
    float x1[V], x2[V];
    if (V == 8) {
        unpack8(*(const pack8 *)x1p, x1);
        unpack8(*(const pack8 *)x2p, x2);
    } else {
        for (int k = 0; k < V; k++) x1[k] = __bfloat162float(x1p[k]), x2[k] = __bfloat162float(x2p[k]);
    }
    if (rotate)
        for (int k = 0; k < V; k++) {
            const float s = sn[i0 + k], c = cs[i0 + k], a = x1[k], b = x2[k];
            x1[k] = a * c - b * s;
            x2[k] = b * c + a * s;
        }
    if (V == 8) {
        *(pack8 *)o1 = pack8_from(x1);
        *(pack8 *)o2 = pack8_from(x2);
    } else {
        for (int k = 0; k < V; k++) o1[k] = __float2bfloat16_rn(x1[k]), o2[k] = __float2bfloat16_rn(x2[k]);
    }
}
/* threads for a block that rotates `items` groups: whole warps, 32..256 */
static int rope_threads(int items) {
    const int t = (items + 31) / 32 * 32;
    return t < 32 ? 32 : t > 256 ? 256 : t;
}

/* In place on part a's tokens (blocks [0, Ta)) then part b's (q and k of a
 * layer: one launch); thread item = (head, V consecutive i). Dynamic shared
 * memory: 2 D/2 floats. */
template <int V>
static __global__ void rope_kernel(rope_part pa, rope_part pb, const float *inv_freq, int D, float sign) {
    extern __shared__ float rope_tab[];
    const int half = D / 2, groups = half / V;
    const bool in_b = (int)blockIdx.x >= pa.T;
    const int t = in_b ? (int)blockIdx.x - pa.T : (int)blockIdx.x, nh = in_b ? pb.nh : pa.nh;
    float *sn = rope_tab, *cs = rope_tab + half;
    rope_angles(sn, cs, (float)(in_b ? pb.pos : pa.pos)[t], inv_freq, half, sign);
    bf16 *row = (in_b ? pb.x : pa.x) + (size_t)t * nh * D;
    for (int it = threadIdx.x; it < nh * groups; it += blockDim.x) {
        const int h = it / groups, i0 = (it - h * groups) * V;
        bf16 *x1p = row + (size_t)h * D + i0;
        rope_pairs<V>(x1p, x1p + half, x1p, x1p + half, sn, cs, i0, true);
    }
}
static void rope(cf_backend *b, rope_part pa, rope_part pb, const float *inv_freq, int D, float sign) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || D < 2) return;
    if (pa.T < 0 || pa.nh <= 0) pa.T = 0;
    if (pb.T < 0 || pb.nh <= 0) pb.T = 0;
    const size_t rows = (size_t)pa.T * pa.nh + (size_t)pb.T * pb.nh;
    if (rows == 0) return;
    const int nh = pa.nh > pb.nh ? pa.nh : pb.nh, blocks = pa.T + pb.T;
    const size_t smem = sizeof(float) * (size_t)D; /* sin and cos of D/2 angles */
    /* the 16-byte path where both parts' rows are 16-byte aligned */
    if ((D / 2) % 8 == 0 && (!pa.T || cf_aligned16(pa.x)) && (!pb.T || cf_aligned16(pb.x)))
        rope_kernel<8><<<blocks, rope_threads(nh * (D / 16)), smem, ctx->stream>>>(pa, pb, inv_freq, D, sign);
    else
        rope_kernel<1><<<blocks, rope_threads(nh * (D / 2)), smem, ctx->stream>>>(pa, pb, inv_freq, D, sign);
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
 * q[T, Hq, D] and k[T, Hk, D] rotated as rope_kernel does (the same table of
 * angles, the same float arithmetic) and v[T, Hk, D] copied: one read and
 * one write of each element instead of three GEMM outputs and an in-place
 * RoPE pass. JOIN is its backward: q, k, v (the gradients) joined into
 * qkv's rows, q and k rotated back (angle -> -angle). A block per token, a
 * thread item per (head, V consecutive i), heads q first, then k, then v;
 * V = 8: 16-byte loads and stores.
 */
template <int V, bool JOIN>
static __global__ void qkv_rope_kernel(bf16 *qkv, bf16 *q, bf16 *k, bf16 *v, const int *pos, int Hq, int Hk,
                                       const float *inv_freq, int D) {
    extern __shared__ float rope_tab[];
    const int half = D / 2, groups = half / V, nh = Hq + 2 * Hk;
    const size_t t = blockIdx.x;
    float *sn = rope_tab, *cs = rope_tab + half;
    rope_angles(sn, cs, (float)pos[t], inv_freq, half, JOIN ? -1.f : 1.f);
    for (int it = threadIdx.x; it < nh * groups; it += blockDim.x) {
        const int h = it / groups, i0 = (it - h * groups) * V;
        bf16 *part = h < Hq        ? q + (t * Hq + h) * D
                     : h < Hq + Hk ? k + (t * Hk + (h - Hq)) * D
                                   : v + (t * Hk + (h - Hq - Hk)) * D;
        bf16 *joined = qkv + (t * nh + h) * D;
        const bf16 *x1p = (JOIN ? part : joined) + i0;
        bf16 *o1 = (JOIN ? joined : part) + i0;
        rope_pairs<V>(o1, o1 + half, x1p, x1p + half, sn, cs, i0, h < Hq + Hk);
    }
}
template <bool JOIN>
static void qkv_rope(cf_backend *b, bf16 *qkv, bf16 *q, bf16 *k, bf16 *v, const int *pos, int T, int Hq, int Hk,
                     const float *inv_freq, int D) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0 || D < 2 || Hq < 0 || Hk < 0 || Hq + 2 * Hk == 0) return;
    const int nh = Hq + 2 * Hk;
    const size_t smem = sizeof(float) * (size_t)D; /* sin and cos of D/2 angles */
    /* 16-byte path: every head's halves start 16-byte aligned (D/2 % 8 == 0
     * and aligned bases); else scalar */
    if ((D / 2) % 8 == 0 && cf_aligned16(q) && cf_aligned16(k) && cf_aligned16(v) && cf_aligned16(qkv))
        qkv_rope_kernel<8, JOIN><<<T, rope_threads(nh * (D / 16)), smem, ctx->stream>>>(qkv, q, k, v, pos, Hq, Hk,
                                                                                       inv_freq, D);
    else
        qkv_rope_kernel<1, JOIN><<<T, rope_threads(nh * (D / 2)), smem, ctx->stream>>>(qkv, q, k, v, pos, Hq, Hk,
                                                                                      inv_freq, D);
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
