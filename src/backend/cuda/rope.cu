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
 * A block per `tpb` consecutive tokens: the sin and cos of their D/2 angles
 * are taken once, into shared memory (rope_angles), then every head of the
 * tokens is rotated from that table, each thread taking up to ROPE_U items
 * (head, V consecutive i) with all their loads issued before the
 * arithmetic. Why: with a thread per (token, head) the kernel took sincosf
 * per element and head (23.6 us for TinyLlama's q/k/v split, ncu, H100,
 * docs/BENCHMARKS.md run 23); with a block per token and an item per
 * thread, 17-22 us against a DRAM floor near 7; with a few tokens a block
 * about 10% less (rope_tokens_per_block). The table holds the same sincosf
 * of the same product, so the results are unchanged bit for bit.
 */
#define ROPE_THREADS 256
#define ROPE_U 4
__device__ __forceinline__ void rope_angles(float *sn, float *cs, const int *pos, int nt, const float *inv_freq,
                                            int half, float sign) {
    for (int e = threadIdx.x; e < nt * half; e += blockDim.x) {
        const int j = e / half, i = e - j * half;
        float s, c;
        sincosf((float)pos[j] * inv_freq[i], &s, &c);
        sn[e] = s * sign;
        cs[e] = c;
    }
    __syncthreads();
}
/* V pairs at x1p[0..V), x2p[0..V) (= x1p + D/2), loaded (as bf16: V = 8
 * is one 16-byte access each, kept packed until the arithmetic), then
 * rotated by the angles sn[0..V), cs[0..V) (or copied) and stored at o1, o2 */
template <int V>
struct rope_load {
    pack8 p1, p2;         /* V == 8 */
    bf16 h1[V], h2[V];    /* V < 8 */
    __device__ __forceinline__ void load(const bf16 *x1p, const bf16 *x2p) {
        if (V == 8) {
            p1 = *(const pack8 *)x1p;
            p2 = *(const pack8 *)x2p;
        } else {
            for (int k = 0; k < V; k++) h1[k] = x1p[k], h2[k] = x2p[k];
        }
    }
    __device__ __forceinline__ void store(bf16 *o1, bf16 *o2, const float *sn, const float *cs, bool rotate) {
        float x1[V], x2[V];
        if (V == 8) {
            unpack8(p1, x1);
            unpack8(p2, x2);
        } else {
            for (int k = 0; k < V; k++) x1[k] = __bfloat162float(h1[k]), x2[k] = __bfloat162float(h2[k]);
        }
        if (rotate)
            for (int k = 0; k < V; k++) {
                const float s = sn[k], c = cs[k], a = x1[k], b = x2[k];
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
};
/* The block's items, ROPE_U per thread per round: item = (token j, head h,
 * pairs i0..i0+V-1), per_tok = heads x D/(2V) items per token. at(j, h, i0,
 * &src, &dst) gives the first element of the item's x1 to read and to write
 * and whether to rotate it (else it is copied). */
template <int V, class At>
__device__ __forceinline__ void rope_items(int nt, int per_tok, int groups, const float *sn, const float *cs, int half,
                                           At at) {
    const int total = nt * per_tok;
    for (int base = 0; base < total; base += ROPE_U * blockDim.x) {
        rope_load<V> ld[ROPE_U];
        bf16 *dst[ROPE_U];
        int tab[ROPE_U];
        bool rot[ROPE_U];
#pragma unroll
        for (int u = 0; u < ROPE_U; u++) {
            const int it = base + u * (int)blockDim.x + (int)threadIdx.x;
            dst[u] = NULL;
            if (it >= total) continue;
            const int j = it / per_tok, r = it - j * per_tok, h = r / groups, i0 = (r - h * groups) * V;
            const bf16 *src;
            rot[u] = at(j, h, i0, &src, &dst[u]);
            tab[u] = j * half + i0;
            ld[u].load(src, src + half);
        }
#pragma unroll
        for (int u = 0; u < ROPE_U; u++)
            if (dst[u]) ld[u].store(dst[u], dst[u] + half, sn + tab[u], cs + tab[u], rot[u]);
    }
}
/* Tokens per block for T tokens of per_tok items: about 2 x ROPE_THREADS
 * items a block, then doubled while the grid is between one and two waves
 * of the 3 blocks an SM holds (launch bounds): a second wave that is mostly
 * empty costs more than longer blocks. ncu, H100 (docs/BENCHMARKS.md run
 * 25), TinyLlama's q/k/v split (T = 4096, 160 items a token): 19.0 us at 3
 * tokens, 21.0-22.1 at 1, 2 and 6; Qwen2.5-1.5B's (T = 2048, 128 items):
 * 9.3 at 8, 9.8 at 1, 10.5 at 4. At most 64 tokens and a table of 32 KB
 * (D floats a token). CF_ROPE_TOKENS=n forces n (1: a block per token, as
 * before; for timing; read once). */
static int rope_tokens_per_block(int T, int per_tok, int D, int sm_count) {
    static const int forced = [] {
        const char *e = getenv("CF_ROPE_TOKENS");
        const int n = e ? atoi(e) : 0;
        return n > 0 && n <= 64 ? n : 0;
    }();
    int t = forced ? forced : ROPE_THREADS * 2 / (per_tok > 0 ? per_tok : 1);
    if (t < 1) t = 1;
    const long wave = 3L * sm_count;
    auto blocks = [&] { return ((long)T + t - 1) / t; };
    while (!forced && t < 64 && blocks() > wave && blocks() < 2 * wave) t *= 2;
    if (t > 64) t = 64;
    while (t > 1 && (size_t)t * D * sizeof(float) > 32768) t /= 2;
    return t;
}
/* A launch's shape for T tokens of nh heads: V pairs an item (8: the
 * 16-byte path), tpb tokens a block, whole warps up to ROPE_THREADS, and
 * the table's shared memory (sin and cos of D/2 angles a token). */
struct rope_shape {
    int tpb, threads;
    size_t smem;
};
static rope_shape rope_shape_for(const cf_cuda_ctx *ctx, int T, int nh, int D, int V) {
    const int per_tok = nh * (D / 2 / V), tpb = rope_tokens_per_block(T, per_tok, D, ctx->sm_count);
    const int items = tpb * per_tok, threads = (items + 31) / 32 * 32;
    return {tpb, threads < 32 ? 32 : threads > ROPE_THREADS ? ROPE_THREADS : threads, sizeof(float) * (size_t)D * tpb};
}

/* In place on part a's tokens (blocks [0, ba)) then part b's (q and k of a
 * layer: one launch), tpb tokens a block. Dynamic shared memory: tpb x D
 * floats (sin, cos). */
template <int V>
static __global__ void __launch_bounds__(ROPE_THREADS, 3)
    rope_kernel(rope_part pa, rope_part pb, const float *inv_freq, int D, float sign, int tpb) {
    extern __shared__ float rope_tab[];
    const int half = D / 2, groups = half / V, ba = (pa.T + tpb - 1) / tpb;
    const bool in_b = (int)blockIdx.x >= ba;
    const rope_part pt = in_b ? pb : pa;
    const int t0 = ((int)blockIdx.x - (in_b ? ba : 0)) * tpb, nt = min(tpb, pt.T - t0);
    float *sn = rope_tab, *cs = rope_tab + tpb * half;
    rope_angles(sn, cs, pt.pos + t0, nt, inv_freq, half, sign);
    bf16 *rows = pt.x + (size_t)t0 * pt.nh * D;
    rope_items<V>(nt, pt.nh * groups, groups, sn, cs, half, [&](int j, int h, int i0, const bf16 **src, bf16 **dst) {
        bf16 *x = rows + ((size_t)j * pt.nh + h) * D + i0;
        *src = x;
        *dst = x;
        return true;
    });
}
static void rope(cf_backend *b, rope_part pa, rope_part pb, const float *inv_freq, int D, float sign) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || D < 2) return;
    if (pa.T < 0 || pa.nh <= 0) pa.T = 0;
    if (pb.T < 0 || pb.nh <= 0) pb.T = 0;
    const size_t rows = (size_t)pa.T * pa.nh + (size_t)pb.T * pb.nh;
    if (rows == 0) return;
    const int nh = pa.nh > pb.nh ? pa.nh : pb.nh;
    /* the 16-byte path where both parts' rows are 16-byte aligned */
    const int V = (D / 2) % 8 == 0 && (!pa.T || cf_aligned16(pa.x)) && (!pb.T || cf_aligned16(pb.x)) ? 8 : 1;
    const rope_shape sh = rope_shape_for(ctx, pa.T + pb.T, nh, D, V);
    const int blocks = (pa.T + sh.tpb - 1) / sh.tpb + (pb.T + sh.tpb - 1) / sh.tpb;
    if (V == 8) rope_kernel<8><<<blocks, sh.threads, sh.smem, ctx->stream>>>(pa, pb, inv_freq, D, sign, sh.tpb);
    else rope_kernel<1><<<blocks, sh.threads, sh.smem, ctx->stream>>>(pa, pb, inv_freq, D, sign, sh.tpb);
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
static __global__ void __launch_bounds__(ROPE_THREADS, 3)
    qkv_rope_kernel(bf16 *qkv, bf16 *q, bf16 *k, bf16 *v, const int *pos, int T, int Hq, int Hk, const float *inv_freq,
                    int D, int tpb) {
    extern __shared__ float rope_tab[];
    const int half = D / 2, groups = half / V, nh = Hq + 2 * Hk;
    const int t0 = (int)blockIdx.x * tpb, nt = min(tpb, T - t0);
    float *sn = rope_tab, *cs = rope_tab + tpb * half;
    rope_angles(sn, cs, pos + t0, nt, inv_freq, half, JOIN ? -1.f : 1.f);
    rope_items<V>(nt, nh * groups, groups, sn, cs, half, [&](int j, int h, int i0, const bf16 **src, bf16 **dst) {
        const size_t t = (size_t)t0 + j;
        bf16 *part = h < Hq        ? q + (t * Hq + h) * D
                     : h < Hq + Hk ? k + (t * Hk + (h - Hq)) * D
                                   : v + (t * Hk + (h - Hq - Hk)) * D;
        bf16 *joined = qkv + (t * nh + h) * D;
        *src = (JOIN ? part : joined) + i0;
        *dst = (JOIN ? joined : part) + i0;
        return h < Hq + Hk;
    });
}
template <bool JOIN>
static void qkv_rope(cf_backend *b, bf16 *qkv, bf16 *q, bf16 *k, bf16 *v, const int *pos, int T, int Hq, int Hk,
                     const float *inv_freq, int D) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0 || D < 2 || Hq < 0 || Hk < 0 || Hq + 2 * Hk == 0) return;
    const int nh = Hq + 2 * Hk;
    /* 16-byte path: every head's halves start 16-byte aligned (D/2 % 8 == 0
     * and aligned bases); else scalar */
    const bool a16 = cf_aligned16(q) && cf_aligned16(k) && cf_aligned16(v) && cf_aligned16(qkv);
    const int V = (D / 2) % 8 == 0 && a16 ? 8 : 1;
    const rope_shape sh = rope_shape_for(ctx, T, nh, D, V);
    const int blocks = (T + sh.tpb - 1) / sh.tpb;
    if (V == 8)
        qkv_rope_kernel<8, JOIN><<<blocks, sh.threads, sh.smem, ctx->stream>>>(qkv, q, k, v, pos, T, Hq, Hk, inv_freq,
                                                                              D, sh.tpb);
    else
        qkv_rope_kernel<1, JOIN><<<blocks, sh.threads, sh.smem, ctx->stream>>>(qkv, q, k, v, pos, T, Hq, Hk, inv_freq,
                                                                              D, sh.tpb);
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
