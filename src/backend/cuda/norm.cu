/*
 * norm.cu — RMSNorm forward (alone, or with the residual add before it), one
 * warp per row, and backward, a block per group of rows at model widths (a
 * warp per row otherwise); the backward also writes the weight gradient's
 * deterministic partial column sums, added up by gemm.cu's final column-sum
 * kernel.
 */
#include <stdlib.h>

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
/*
 * The same two forwards (ADD: with the residual add) with the row held in
 * registers, for widths of at most 256 NP (C % 8 == 0, 16-byte aligned):
 * lane l owns packs l, l + 32, ... of the row, loads them all before the sum
 * of squares and normalises from registers, so the row is read once and
 * every load of a warp is in flight at once. The sums run in the order of
 * the loops above (same results). Why: the two-pass kernels keep one
 * 16-byte load per lane in flight; at TinyLlama's shape (T = 4096, C =
 * 2048) this one took 14.3 us per call against their 16.3, at Qwen2.5-1.5B's
 * 7.4 against 8.2 (ncu, H100, docs/BENCHMARKS.md run 23; the DRAM floor is
 * near 5 us at TinyLlama's shape).
 */
template <bool ADD, int NP>
static __global__ void __launch_bounds__(256, NP <= 8 ? 4 : 2)
    rmsnorm_fwd_regs_kernel(bf16 *sum, bf16 *out, float *rstd, const bf16 *a, const bf16 *c, const bf16 *w, int T,
                            int C, float eps) {
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (row >= T) return;
    const size_t off = (size_t)row * C;
    pack8 xv[NP];
#pragma unroll
    for (int k = 0; k < NP; k++) {
        const int i = lane * 8 + k * 256;
        if (i < C) xv[k] = *(const pack8 *)(a + off + i);
    }
    if (ADD) {
#pragma unroll
        for (int k = 0; k < NP; k++) {
            const int i = lane * 8 + k * 256;
            if (i < C) {
                float fa[8], fc[8];
                unpack8(xv[k], fa);
                unpack8(*(const pack8 *)(c + off + i), fc);
                for (int j = 0; j < 8; j++) fa[j] += fc[j];
                xv[k] = pack8_from(fa);
                *(pack8 *)(sum + off + i) = xv[k];
            }
        }
    }
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < NP; k++)
        if (lane * 8 + k * 256 < C) {
            float f[8];
            unpack8(xv[k], f);
            for (int j = 0; j < 8; j++) ss += f[j] * f[j];
        }
    ss = warp_sum(ss);
    const float r = rsqrtf(ss / C + eps);
    /* Registers decide the waves: 4 blocks of 256 per SM (64 registers)
     * hold T = 4096 rows in one wave at NP = 8. So w is read after the sum,
     * not hoisted above it (the memory clobber), and the row is unpacked
     * again from its packs rather than kept as floats (the packs made opaque). */
#pragma unroll
    for (int k = 0; k < NP; k++) {
        uint32_t *u = reinterpret_cast<uint32_t *>(&xv[k]);
        asm volatile("" : "+r"(u[0]), "+r"(u[1]), "+r"(u[2]), "+r"(u[3])::"memory");
    }
#pragma unroll
    for (int k = 0; k < NP; k++) {
        const int i = lane * 8 + k * 256;
        if (i < C) {
            float f[8], wf[8];
            unpack8(xv[k], f);
            unpack8(*(const pack8 *)(w + i), wf);
            for (int j = 0; j < 8; j++) f[j] = f[j] * r * wf[j];
            *(pack8 *)(out + off + i) = pack8_from(f);
        }
    }
    if (lane == 0) rstd[row] = r;
}
/* packs per lane of the register kernel for width C, 0 where none fits or
 * CF_RMSNORM_FWD_REGS=0 is in the environment (the two-pass kernels, for
 * timing; read once) */
static int rmsnorm_regs_np(int C) {
    static int on = -1;
    if (on < 0) {
        const char *e = getenv("CF_RMSNORM_FWD_REGS");
        on = !(e && e[0] == '0');
    }
    return !on ? 0 : C <= 512 ? 2 : C <= 2048 ? 8 : C <= 4096 ? 16 : 0;
}
template <bool ADD>
static void rmsnorm_fwd_regs(cf_cuda_ctx *ctx, int np, bf16 *sum, bf16 *out, float *rstd, const bf16 *a,
                             const bf16 *c, const bf16 *w, int T, int C, float eps) {
    const int blocks = (T * 32 + 255) / 256;
    if (np == 2) rmsnorm_fwd_regs_kernel<ADD, 2><<<blocks, 256, 0, ctx->stream>>>(sum, out, rstd, a, c, w, T, C, eps);
    else if (np == 8) rmsnorm_fwd_regs_kernel<ADD, 8><<<blocks, 256, 0, ctx->stream>>>(sum, out, rstd, a, c, w, T, C, eps);
    else rmsnorm_fwd_regs_kernel<ADD, 16><<<blocks, 256, 0, ctx->stream>>>(sum, out, rstd, a, c, w, T, C, eps);
}

void cf_cuda_add_rmsnorm_fwd(cf_backend *b, void *sum, void *out, float *rstd, const void *a, const void *c,
                             const void *w, int T, int C, float eps) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0) return;
    int blocks = (T * 32 + 255) / 256;
    const bool vec = C % 8 == 0 && cf_aligned16(sum) && cf_aligned16(out) && cf_aligned16(a) && cf_aligned16(c) &&
                     cf_aligned16(w);
    const int np = vec ? rmsnorm_regs_np(C) : 0;
    if (np)
        rmsnorm_fwd_regs<true>(ctx, np, (bf16 *)sum, (bf16 *)out, rstd, (const bf16 *)a, (const bf16 *)c,
                               (const bf16 *)w, T, C, eps);
    else if (vec)
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
    const bool vec = C % 8 == 0 && cf_aligned16(out) && cf_aligned16(inp) && cf_aligned16(w);
    const int np = vec ? rmsnorm_regs_np(C) : 0;
    if (np)
        rmsnorm_fwd_regs<false>(ctx, np, NULL, (bf16 *)out, rstd, (const bf16 *)inp, NULL, (const bf16 *)w, T, C, eps);
    else if (vec)
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
 * and C only. x and r of row t are the input's row map[t] (map NULL: t):
 * the centrifuge filter does not compact the norms' inputs.
 */
struct __align__(16) float8 { float v[8]; };
template <bool VEC, bool DW>
static __global__ void rmsnorm_bwd_kernel(bf16 *dinp, float *partial, const bf16 *dout, const bf16 *inp,
                                          const bf16 *w, const float *rstd, const int *map, int T, int C, int rows,
                                          int accumulate) {
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
        const int xr = map ? map[row] : row; /* the input's row */
        const bf16 *x = inp + (size_t)xr * C, *g = dout + (size_t)row * C;
        bf16 *dx = dinp + (size_t)row * C;
        const float r = rstd[xr];
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

/*
 * The same math with a block per group of rows, for widths a block covers
 * in one pass (C % 8 == 0, 512 <= C <= 8192, 16-byte aligned): thread i
 * owns columns 8i..8i+7 of every row, so its x and g of a row are loaded
 * once (16 bytes each) and stay in registers for both the dot product and
 * dx; the dot product is a block sum (warps in order, double-buffered so
 * one barrier per row). The next row's x, g (and dx when accumulating) are
 * loaded before this row's sum: one row's loads in flight while the last
 * one finishes. The weight gradient's partial g x r stays in registers
 * and the block writes it as partial row b. Why: the warp-per-row kernel
 * keeps one row per warp in flight and, with its shared dw rows, few
 * warps per SM: at Llama3.2-3B's width (C = 3072, 4 warps per block) and
 * T = 1024 kept rows it took 31 us per call against a floor of about 8
 * (25 MB at 3 TB/s); this one 19.5 (H100, docs/BENCHMARKS.md run 16).
 */
#define RMSNORM_BWD_BLOCKS 256
/* CF_RMSNORM_BWD_BLOCKS=n in the environment replaces the bound (timing
 * only; read once) */
static int rmsnorm_bwd_blocks(void) {
    static int n = -1;
    if (n < 0) {
        const char *e = getenv("CF_RMSNORM_BWD_BLOCKS");
        const int v = e && *e ? atoi(e) : 0;
        n = v >= 1 && v <= 65536 ? v : RMSNORM_BWD_BLOCKS;
    }
    return n;
}
/* MAPPED: x and rstd through map (a template switch, so that the unmapped
 * kernel is run 16's: a runtime test cost it 2-4% in run 34) */
template <bool DW, bool MAPPED>
static __global__ void __launch_bounds__(1024)
    rmsnorm_bwd_rows_kernel(bf16 *dinp, float *partial, const bf16 *dout, const bf16 *inp, const bf16 *w,
                            const float *rstd, const int *map, int T, int C, int rows, int accumulate) {
    __shared__ float red[2][32];
    const int c = 8 * threadIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const bool on = c < C;
    float wf[8], dw[8];
    const float z8[8] = {};
    const pack8 zero = pack8_from(z8);
    unpack8(on ? *(const pack8 *)(w + c) : zero, wf);
    for (int k = 0; k < 8; k++) dw[k] = 0.f;
    const int t0 = blockIdx.x * rows, t1 = min(T, t0 + rows);
    pack8 xn = zero, gn = zero, dn = zero; /* row t's, loaded during row t - 1 */
    const int x0 = t0 < t1 ? (MAPPED ? map[t0] : t0) : 0; /* the input's row */
    float rn = t0 < t1 ? rstd[x0] : 0.f;
    if (on && t0 < t1) {
        xn = *(const pack8 *)(inp + (size_t)x0 * C + c);
        gn = *(const pack8 *)(dout + (size_t)t0 * C + c);
        if (accumulate) dn = *(const pack8 *)(dinp + (size_t)t0 * C + c);
    }
    for (int t = t0; t < t1; t++) {
        float xf[8], gf[8], o[8];
        unpack8(xn, xf);
        unpack8(gn, gf);
        unpack8(dn, o);
        const float r = rn;
        const int xnext = t + 1 < t1 ? (MAPPED ? map[t + 1] : t + 1) : 0;
        if (t + 1 < t1) rn = rstd[xnext];
        if (on && t + 1 < t1) {
            const size_t off = (size_t)(t + 1) * C + c;
            xn = *(const pack8 *)(inp + (size_t)xnext * C + c);
            gn = *(const pack8 *)(dout + off);
            if (accumulate) dn = *(const pack8 *)(dinp + off);
        }
        float dot = 0.f;
        for (int k = 0; k < 8; k++) dot += gf[k] * wf[k] * xf[k];
        dot = warp_sum(dot);
        if (lane == 0) red[t & 1][warp] = dot;
        __syncthreads();
        float sum = 0.f;
        for (int i = 0; i < nw; i++) sum += red[t & 1][i];
        const float coef = r * r * r * sum / C;
        if (on) {
            for (int k = 0; k < 8; k++) {
                const float v = r * wf[k] * gf[k] - coef * xf[k];
                o[k] = accumulate ? o[k] + v : v;
                if (DW) dw[k] += gf[k] * xf[k] * r;
            }
            *(pack8 *)(dinp + (size_t)t * C + c) = pack8_from(o);
        }
    }
    if (DW && on) {
        float4 *p = (float4 *)(partial + (size_t)blockIdx.x * C + c);
        p[0] = make_float4(dw[0], dw[1], dw[2], dw[3]);
        p[1] = make_float4(dw[4], dw[5], dw[6], dw[7]);
    }
}

/* Warps per block: 8, fewer where their dw rows would pass 48 KB of shared
 * memory (the default limit: 4 at C = 3072); none (dx alone, then dw by
 * cf_cuda_colsum) past C = 12288. Rows per warp: 1 up to 4096 warps in all
 * (31 per SM on an H100), more past that: enough loads in flight, while the
 * fp32 partial rows (one per block) stay a small fraction of the input. */
#define RMSNORM_BWD_SMEM (48 << 10)
#define RMSNORM_BWD_WARPS 4096
/* The block-per-rows kernel: at most RMSNORM_BWD_BLOCKS blocks of C / 8
 * threads (rounded up to warps), consecutive rows each; the chunking
 * depends on T alone, so dw is run-to-run identical. */
/* rmsnorm_bwd_rows_kernel<DW, map != NULL> on nblocks x threads (partial:
 * with DW) */
template <bool DW>
static void rmsnorm_bwd_rows_run(cf_cuda_ctx *ctx, int nblocks, int threads, bf16 *dinp, float *partial,
                                 const bf16 *dout, const bf16 *inp, const bf16 *w, const float *rstd, const int *map,
                                 int T, int C, int rows, int accumulate) {
    if (map)
        rmsnorm_bwd_rows_kernel<DW, true><<<nblocks, threads, 0, ctx->stream>>>(dinp, partial, dout, inp, w, rstd, map,
                                                                                T, C, rows, accumulate);
    else
        rmsnorm_bwd_rows_kernel<DW, false><<<nblocks, threads, 0, ctx->stream>>>(dinp, partial, dout, inp, w, rstd,
                                                                                 NULL, T, C, rows, accumulate);
}
static void rmsnorm_bwd_rows_launch(cf_cuda_ctx *ctx, bf16 *dinp, float *dw, const bf16 *dout, const bf16 *inp,
                                    const bf16 *w, const float *rstd, const int *map, int T, int C, int accumulate) {
    const int threads = (C / 8 + 31) / 32 * 32;
    const int bound = rmsnorm_bwd_blocks();
    const int rows = (T + bound - 1) / bound, nblocks = (T + rows - 1) / rows;
    if (!dw) {
        rmsnorm_bwd_rows_run<false>(ctx, nblocks, threads, dinp, NULL, dout, inp, w, rstd, map, T, C, rows, accumulate);
        CF_CK_LAUNCH(ctx, "rmsnorm_bwd");
        return;
    }
    float *partial = (float *)cf_cuda_scratch(ctx, CF_SCR_COLSUM, (size_t)nblocks * C * sizeof(float));
    if (!partial) return;
    rmsnorm_bwd_rows_run<true>(ctx, nblocks, threads, dinp, partial, dout, inp, w, rstd, map, T, C, rows, accumulate);
    if (CF_CK_LAUNCH(ctx, "rmsnorm_bwd")) cf_cuda_colsum_final(ctx, dw, partial, nblocks, C);
}

template <bool VEC>
static void rmsnorm_bwd_launch(cf_backend *b, cf_cuda_ctx *ctx, bf16 *dinp, float *dw, const bf16 *dout,
                               const bf16 *inp, const bf16 *w, const float *rstd, const int *map, int T, int C,
                               int accumulate) {
    if (VEC && C >= 512 && C <= 8192) {
        rmsnorm_bwd_rows_launch(ctx, dinp, dw, dout, inp, w, rstd, map, T, C, accumulate);
        return;
    }
    const int nw = min(8, RMSNORM_BWD_SMEM / (C * (int)sizeof(float)));
    if (!dw || nw < 1) { /* one row per warp; dw NULL: a frozen norm weight */
        rmsnorm_bwd_kernel<VEC, false><<<(T + 7) / 8, 256, 0, ctx->stream>>>(dinp, NULL, dout, inp, w, rstd, map, T,
                                                                              C, 8, accumulate);
        if (!CF_CK_LAUNCH(ctx, "rmsnorm_bwd") || !dw) return;
        /* dw[c] += sum_t dout[t,c] x[t,c] rstd[t], over the input's rows in
         * order: mapped ones gathered first (the filter's gather) */
        if (map) {
            bf16 *x = (bf16 *)cf_cuda_scratch(ctx, CF_SCR_NORM_X, (size_t)T * C * sizeof(bf16));
            float *r = (float *)cf_cuda_scratch(ctx, CF_SCR_NORM_RSTD, (size_t)T * sizeof(float));
            if (!x || !r) return;
            cf_cuda_gather_rows(b, x, inp, map, T, (size_t)C * sizeof(bf16));
            cf_cuda_gather_rows(b, r, rstd, map, T, sizeof(float));
            if (ctx->failed) return;
            inp = x;
            rstd = r;
        }
        cf_cuda_colsum(ctx, dw, dout, inp, rstd, T, C);
        return;
    }
    const int rows = nw * ((T + RMSNORM_BWD_WARPS - 1) / RMSNORM_BWD_WARPS), nblocks = (T + rows - 1) / rows;
    float *partial = (float *)cf_cuda_scratch(ctx, CF_SCR_COLSUM, (size_t)nblocks * C * sizeof(float));
    if (!partial) return;
    rmsnorm_bwd_kernel<VEC, true><<<nblocks, 32 * nw, (size_t)nw * C * sizeof(float), ctx->stream>>>(
        dinp, partial, dout, inp, w, rstd, map, T, C, rows, accumulate);
    if (CF_CK_LAUNCH(ctx, "rmsnorm_bwd")) cf_cuda_colsum_final(ctx, dw, partial, nblocks, C);
}
void cf_cuda_rmsnorm_bwd(cf_backend *b, void *dinp, float *dw, const void *dout, const void *inp, const void *w,
                         const float *rstd, const int *rows, int T, int C, int accumulate) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0 || C <= 0) return;
    if (C % 8 == 0 && cf_aligned16(dinp) && cf_aligned16(dout) && cf_aligned16(inp) && cf_aligned16(w))
        rmsnorm_bwd_launch<true>(b, ctx, (bf16 *)dinp, dw, (const bf16 *)dout, (const bf16 *)inp, (const bf16 *)w, rstd,
                                 rows, T, C, accumulate);
    else
        rmsnorm_bwd_launch<false>(b, ctx, (bf16 *)dinp, dw, (const bf16 *)dout, (const bf16 *)inp, (const bf16 *)w, rstd,
                                  rows, T, C, accumulate);
}
