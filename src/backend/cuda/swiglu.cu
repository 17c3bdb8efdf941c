/*
 * swiglu.cu — the MLP's elementwise ops: SwiGLU forward, the SwiGLU backward
 * that reads gate and up through the kept-row index (and recomputes the
 * product for the down projection), and the residual add.
 */
#include <stdlib.h>

#include "backend/cuda/cuda_common.cuh"


/* h = silu(g) * u, silu(g) = g * sigmoid(g); h has rows of F, gate and up
 * rows of ld (2F: the two halves of the fused gate/up GEMM's output) */
static __global__ void swiglu_fwd_kernel(bf16 *h, const bf16 *gate, const bf16 *up, int T, int F, int ld) {
    const size_t n = (size_t)T * F;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += (size_t)gridDim.x * blockDim.x) {
        const size_t src = idx / F * ld + idx % F;
        float g = __bfloat162float(gate[src]), u = __bfloat162float(up[src]);
        h[idx] = __float2bfloat16_rn(g / (1.f + expf(-g)) * u);
    }
}
/* The 16-byte kernels: a thread owns one pack (8 columns) of R consecutive
 * rows and issues every load of its rows before it computes, so it has 2R
 * (forward) or 3R (backward) 16-byte loads in flight; consecutive threads
 * take consecutive packs of a row group (coalesced). The index is 32-bit
 * (the launcher checks that it fits). Why: with one pack per thread and a
 * 64-bit division before its loads, the forward and backward ran at 3.2 and
 * 3.6 TB/s at Qwen2.5-1.5B's shape (ncu, H200, BENCHMARKS.md run 31), 67%
 * and 74% of the DRAM peak. The math is the one-element kernels' (same
 * bits). */
template <int R>
static __global__ void swiglu_fwd_vec_kernel(pack8 *h, const pack8 *gate, const pack8 *up, int T, int F8, int ld8) {
    const unsigned total = (unsigned)((T + R - 1) / R) * (unsigned)F8;
    for (unsigned idx = blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += gridDim.x * blockDim.x) {
        const unsigned grp = idx / F8, c = idx - grp * F8;
        const int r0 = (int)grp * R;
        pack8 gv[R], uv[R];
#pragma unroll
        for (int r = 0; r < R; r++)
            if (r0 + r < T) {
                gv[r] = gate[(size_t)(r0 + r) * ld8 + c];
                uv[r] = up[(size_t)(r0 + r) * ld8 + c];
            }
#pragma unroll
        for (int r = 0; r < R; r++)
            if (r0 + r < T) {
                float g[8], u[8], o[8];
                unpack8(gv[r], g);
                unpack8(uv[r], u);
                for (int k = 0; k < 8; k++) o[k] = g[k] / (1.f + expf(-g[k])) * u[k];
                h[(size_t)(r0 + r) * F8 + c] = pack8_from(o);
            }
    }
}
/* dg = dh * u * sig * (1 + g (1 - sig)),  du = dh * silu(g) */
__device__ __forceinline__ void swiglu_grad(float g, float u, float dh, float *dg, float *du) {
    float sig = 1.f / (1.f + expf(-g));
    *dg = dh * u * sig * (1.f + g * (1.f - sig));
    *du = dh * g * sig;
}

/* SwiGLU backward with gate/up read through the row index; also writes the
 * recomputed product h (the down projection's input) for the kept rows.
 * gate and up rows are ldi elements apart (ldi8 packs of 8: F, or 2F for
 * the halves of the fused gate/up forward GEMM's output); dgate and dup rows
 * ld apart (F when they are separate matrices, 2F when they are the two
 * halves of one [n, 2F] matrix for the fused gate/up backward GEMM). */
template <int R>
static __global__ void swiglu_bwd_rows_vec_kernel(pack8 *h, pack8 *dgate, pack8 *dup, const pack8 *dh, const pack8 *gate,
                                                  const pack8 *up, const int *rows, int n, int F8, int ldi8, int ld8) {
    const unsigned total = (unsigned)((n + R - 1) / R) * (unsigned)F8;
    for (unsigned idx = blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += gridDim.x * blockDim.x) {
        const unsigned grp = idx / F8, c = idx - grp * F8;
        const int i0 = (int)grp * R;
        pack8 gv[R], uv[R], dv[R];
#pragma unroll
        for (int r = 0; r < R; r++)
            if (i0 + r < n) {
                const size_t src = (size_t)(rows ? rows[i0 + r] : i0 + r) * ldi8 + c;
                gv[r] = gate[src];
                uv[r] = up[src];
                dv[r] = dh[(size_t)(i0 + r) * F8 + c];
            }
#pragma unroll
        for (int r = 0; r < R; r++)
            if (i0 + r < n) {
                float g[8], u[8], d[8], o[8], dg[8], du[8];
                unpack8(gv[r], g);
                unpack8(uv[r], u);
                unpack8(dv[r], d);
                for (int q = 0; q < 8; q++) {
                    swiglu_grad(g[q], u[q], d[q], &dg[q], &du[q]);
                    o[q] = g[q] / (1.f + __expf(-g[q])) * u[q];
                }
                const size_t i = (size_t)(i0 + r);
                h[i * F8 + c] = pack8_from(o);
                dgate[i * ld8 + c] = pack8_from(dg);
                dup[i * ld8 + c] = pack8_from(du);
            }
    }
}
static __global__ void swiglu_bwd_rows_kernel(bf16 *h, bf16 *dgate, bf16 *dup, const bf16 *dh, const bf16 *gate,
                                              const bf16 *up, const int *rows, int n, int F, int ldi, int ld) {
    const size_t total = (size_t)n * F;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (size_t)gridDim.x * blockDim.x) {
        const size_t i = idx / F, c = idx % F;
        const size_t src = (size_t)(rows ? rows[i] : (int)i) * ldi + c, dst = i * ld + c;
        const float g = __bfloat162float(gate[src]), u = __bfloat162float(up[src]);
        float dg, du;
        swiglu_grad(g, u, __bfloat162float(dh[idx]), &dg, &du);
        h[idx] = __float2bfloat16_rn(g / (1.f + __expf(-g)) * u);
        dgate[dst] = __float2bfloat16_rn(dg);
        dup[dst] = __float2bfloat16_rn(du);
    }
}
/* Rows per thread of the 16-byte kernels: 4, or CF_SWIGLU_ROWS=1|2|4 from
 * the environment (timing only; read once). */
static int swiglu_rows(void) {
    static int r = -1;
    if (r < 0) {
        const char *e = getenv("CF_SWIGLU_ROWS");
        const int v = e && *e ? atoi(e) : 4;
        r = v == 1 || v == 2 || v == 4 ? v : 4;
    }
    return r;
}
/* the 16-byte kernels' 32-bit index: row groups x packs, plus a grid's
 * stride, below 2^32 (else the one-element kernels, whose index is 64-bit) */
static bool swiglu_index_fits(int rows, int F) {
    return (size_t)rows * (size_t)(F / 8) + (size_t)65536 * 4 * 256 < ((size_t)1 << 32);
}
void cf_cuda_swiglu_bwd_rows(cf_backend *b, void *h, void *dgate, void *dup, const void *dh, const void *gate,
                               const void *up, const int *rows, int n, int F, int ld_in, int ld) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || n <= 0 || F <= 0) return;
    const int R = swiglu_rows();
    if (F % 8 == 0 && ld_in % 8 == 0 && ld % 8 == 0 && swiglu_index_fits(n, F) && cf_aligned16(h) &&
        cf_aligned16(dgate) && cf_aligned16(dup) && cf_aligned16(dh) && cf_aligned16(gate) && cf_aligned16(up)) {
        const int grid = cf_grid_for((size_t)((n + R - 1) / R) * (F / 8), 256);
        const pack8 *a[3] = {(const pack8 *)dh, (const pack8 *)gate, (const pack8 *)up};
        if (R == 4)
            swiglu_bwd_rows_vec_kernel<4><<<grid, 256, 0, ctx->stream>>>((pack8 *)h, (pack8 *)dgate, (pack8 *)dup, a[0],
                                                                         a[1], a[2], rows, n, F / 8, ld_in / 8, ld / 8);
        else if (R == 2)
            swiglu_bwd_rows_vec_kernel<2><<<grid, 256, 0, ctx->stream>>>((pack8 *)h, (pack8 *)dgate, (pack8 *)dup, a[0],
                                                                         a[1], a[2], rows, n, F / 8, ld_in / 8, ld / 8);
        else
            swiglu_bwd_rows_vec_kernel<1><<<grid, 256, 0, ctx->stream>>>((pack8 *)h, (pack8 *)dgate, (pack8 *)dup, a[0],
                                                                         a[1], a[2], rows, n, F / 8, ld_in / 8, ld / 8);
    } else
        swiglu_bwd_rows_kernel<<<cf_grid_for((size_t)n * F, 256), 256, 0, ctx->stream>>>(
            (bf16 *)h, (bf16 *)dgate, (bf16 *)dup, (const bf16 *)dh, (const bf16 *)gate, (const bf16 *)up, rows, n,
            F, ld_in, ld);
    CF_CK_LAUNCH(ctx, "swiglu_bwd_rows");
}
void cf_cuda_swiglu_fwd(cf_backend *b, void *h, const void *gate, const void *up, int T, int F, int ld_in) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0 || F <= 0) return;
    const int R = swiglu_rows();
    if (F % 8 == 0 && ld_in % 8 == 0 && swiglu_index_fits(T, F) && cf_aligned16(h) && cf_aligned16(gate) &&
        cf_aligned16(up)) {
        const int grid = cf_grid_for((size_t)((T + R - 1) / R) * (F / 8), 256);
        if (R == 4)
            swiglu_fwd_vec_kernel<4><<<grid, 256, 0, ctx->stream>>>((pack8 *)h, (const pack8 *)gate, (const pack8 *)up,
                                                                    T, F / 8, ld_in / 8);
        else if (R == 2)
            swiglu_fwd_vec_kernel<2><<<grid, 256, 0, ctx->stream>>>((pack8 *)h, (const pack8 *)gate, (const pack8 *)up,
                                                                    T, F / 8, ld_in / 8);
        else
            swiglu_fwd_vec_kernel<1><<<grid, 256, 0, ctx->stream>>>((pack8 *)h, (const pack8 *)gate, (const pack8 *)up,
                                                                    T, F / 8, ld_in / 8);
    } else
        swiglu_fwd_kernel<<<cf_grid_for((size_t)T * F, 256), 256, 0, ctx->stream>>>(
            (bf16 *)h, (const bf16 *)gate, (const bf16 *)up, T, F, ld_in);
    CF_CK_LAUNCH(ctx, "swiglu_fwd");
}

/* out = a + c */
static __global__ void add_kernel(bf16 *out, const bf16 *a, const bf16 *c, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16_rn(__bfloat162float(a[i]) + __bfloat162float(c[i]));
}
static __global__ void add_vec_kernel(pack8 *out, const pack8 *a, const pack8 *c, size_t n8) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
        float x[8], y[8];
        unpack8(a[i], x);
        unpack8(c[i], y);
        for (int k = 0; k < 8; k++) x[k] += y[k];
        out[i] = pack8_from(x);
    }
}
void cf_cuda_add(cf_backend *b, void *out, const void *a, const void *c, size_t n) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || !n) return;
    if (n % 8 == 0 && cf_aligned16(out) && cf_aligned16(a) && cf_aligned16(c))
        add_vec_kernel<<<cf_grid_for(n / 8, 256), 256, 0, ctx->stream>>>(
            (pack8 *)out, (const pack8 *)a, (const pack8 *)c, n / 8);
    else
        add_kernel<<<cf_grid_for(n, 256), 256, 0, ctx->stream>>>((bf16 *)out, (const bf16 *)a, (const bf16 *)c, n);
    CF_CK_LAUNCH(ctx, "add");
}

/* x = s * x (bf16, in place) */
static __global__ void scale_kernel(bf16 *x, float s, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] = __float2bfloat16_rn(s * __bfloat162float(x[i]));
}
void cf_cuda_scale(cf_backend *b, void *x, float s, size_t n) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || !n) return;
    scale_kernel<<<cf_grid_for(n, 256), 256, 0, ctx->stream>>>((bf16 *)x, s, n);
    CF_CK_LAUNCH(ctx, "scale");
}
