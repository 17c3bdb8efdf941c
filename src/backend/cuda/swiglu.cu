/*
 * swiglu.cu — the MLP's elementwise ops: SwiGLU forward, the SwiGLU backward
 * that reads gate and up through the kept-row index (and recomputes the
 * product for the down projection), and the residual add.
 */
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
/* The 16-byte forward: a thread owns one pack (8 columns) of R consecutive
 * rows and issues both loads of each row before it computes; consecutive
 * threads take consecutive packs of a row group (coalesced); a 32-bit index
 * (the launcher checks that it fits). Against one pack a thread and a 64-bit
 * division: 29.2 -> 27.4 us per call at Qwen2.5-1.5B's shape, 36.4 -> 33.9
 * at TinyLlama's, with R = 2 or 4 alike (ncu, H200, BENCHMARKS.md run 36).
 * The backward stays one pack a thread: rows per thread made it slower
 * (54.0 -> 57.5 us at R = 2, 65.1 at R = 4), it already moved 3.6-3.7 TB/s.
 * Same math as the one-element kernel (same bits). */
#define SWIGLU_FWD_ROWS 2
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
static __global__ void swiglu_bwd_rows_vec_kernel(pack8 *h, pack8 *dgate, pack8 *dup, const pack8 *dh, const pack8 *gate,
                                                  const pack8 *up, const int *rows, int n, int F8, int ldi8, int ld8) {
    const size_t total = (size_t)n * F8;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (size_t)gridDim.x * blockDim.x) {
        const size_t i = idx / F8, c = idx % F8;
        const size_t src = (size_t)(rows ? rows[i] : (int)i) * ldi8 + c, dst = i * ld8 + c;
        float g[8], u[8], d[8], o[8], dg[8], du[8];
        unpack8(gate[src], g);
        unpack8(up[src], u);
        unpack8(dh[idx], d);
        for (int q = 0; q < 8; q++) {
            swiglu_grad(g[q], u[q], d[q], &dg[q], &du[q]);
            o[q] = g[q] / (1.f + __expf(-g[q])) * u[q];
        }
        h[idx] = pack8_from(o);
        dgate[dst] = pack8_from(dg);
        dup[dst] = pack8_from(du);
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
/* the forward's 32-bit index: rows x packs (at least its row groups x packs), plus a grid's stride
 * (cf_grid_for's largest grid of 256 threads), below 2^32 (else the
 * one-element kernel, whose index is 64-bit) */
static bool swiglu_index_fits(int rows, int F) {
    return (size_t)rows * (size_t)(F / 8) + (size_t)CF_GRID_MAX_BLOCKS * 256 < ((size_t)1 << 32);
}
void cf_cuda_swiglu_bwd_rows(cf_backend *b, void *h, void *dgate, void *dup, const void *dh, const void *gate,
                               const void *up, const int *rows, int n, int F, int ld_in, int ld) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || n <= 0 || F <= 0) return;
    if (F % 8 == 0 && ld_in % 8 == 0 && ld % 8 == 0 && cf_aligned16(h) && cf_aligned16(dgate) && cf_aligned16(dup) &&
        cf_aligned16(dh) && cf_aligned16(gate) && cf_aligned16(up))
        swiglu_bwd_rows_vec_kernel<<<cf_grid_for((size_t)n * (F / 8), 256), 256, 0, ctx->stream>>>(
            (pack8 *)h, (pack8 *)dgate, (pack8 *)dup, (const pack8 *)dh, (const pack8 *)gate, (const pack8 *)up, rows,
            n, F / 8, ld_in / 8, ld / 8);
    else
        swiglu_bwd_rows_kernel<<<cf_grid_for((size_t)n * F, 256), 256, 0, ctx->stream>>>(
            (bf16 *)h, (bf16 *)dgate, (bf16 *)dup, (const bf16 *)dh, (const bf16 *)gate, (const bf16 *)up, rows, n,
            F, ld_in, ld);
    CF_CK_LAUNCH(ctx, "swiglu_bwd_rows");
}
void cf_cuda_swiglu_fwd(cf_backend *b, void *h, const void *gate, const void *up, int T, int F, int ld_in) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0 || F <= 0) return;
    constexpr int R = SWIGLU_FWD_ROWS;
    if (F % 8 == 0 && ld_in % 8 == 0 && swiglu_index_fits(T, F) && cf_aligned16(h) && cf_aligned16(gate) &&
        cf_aligned16(up)) {
        swiglu_fwd_vec_kernel<R><<<cf_grid_for((size_t)((T + R - 1) / R) * (F / 8), 256), 256, 0, ctx->stream>>>(
            (pack8 *)h, (const pack8 *)gate, (const pack8 *)up, T, F / 8, ld_in / 8);
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
