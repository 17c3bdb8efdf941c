/*
 * gemm.cu — the dense GEMMs of the linear layers through cuBLASLt (bf16
 * inputs, fp32 compute), and the deterministic column sums of their bias
 * gradient (also used by the RMSNorm weight gradient, norm.cu).
 */
#include <string.h>

#include "backend/cuda/cuda_common.cuh"

/* ======================================= deterministic column sums */

/*
 * partial[chunk, c] = sum over rows t of the chunk of f(t, c), with
 *   f = dout[t,c]                      (bias gradient)
 *   f = dout[t,c] * x[t,c] * rstd[t]   (rmsnorm weight gradient)
 * block (32, 8): 64 columns (2 per thread), rows strided by 8, reduced in
 * shared memory in a fixed order. Then out[c] += sum_chunk partial[chunk, c],
 * chunks in order. Run to run identical.
 */
#define COLSUM_ROWS 64
static __global__ void colsum_partial_kernel(float *partial, const bf16 *dout, const bf16 *x, const float *rstd, int T,
                                      int C) {
    __shared__ float red[8][64];
    const int c0 = blockIdx.x * 64 + 2 * threadIdx.x;
    const int t0 = blockIdx.y * COLSUM_ROWS, t1 = min(T, t0 + COLSUM_ROWS);
    float s0 = 0.f, s1 = 0.f;
    for (int t = t0 + threadIdx.y; t < t1; t += 8) {
        const size_t base = (size_t)t * C;
        const float r = rstd ? rstd[t] : 1.f;
        if (c0 < C) {
            float v = __bfloat162float(dout[base + c0]);
            if (x) v *= __bfloat162float(x[base + c0]) * r;
            s0 += v;
        }
        if (c0 + 1 < C) {
            float v = __bfloat162float(dout[base + c0 + 1]);
            if (x) v *= __bfloat162float(x[base + c0 + 1]) * r;
            s1 += v;
        }
    }
    red[threadIdx.y][2 * threadIdx.x] = s0;
    red[threadIdx.y][2 * threadIdx.x + 1] = s1;
    __syncthreads();
    if (threadIdx.y == 0) {
        for (int k = 0; k < 2; k++) {
            int c = c0 + k;
            float s = 0.f;
            for (int y = 0; y < 8; y++) s += red[y][2 * threadIdx.x + k];
            if (c < C) partial[(size_t)blockIdx.y * C + c] = s;
        }
    }
}
static __global__ void colsum_final_kernel(float *out, const float *partial, int nchunks, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float s = 0.f;
    for (int k = 0; k < nchunks; k++) s += partial[(size_t)k * C + c];
    out[c] += s;
}
void cf_cuda_colsum(cf_cuda_ctx *ctx, float *out, const bf16 *dout, const bf16 *x, const float *rstd, int T, int C) {
    if (T <= 0 || C <= 0) return;
    int nchunks = (T + COLSUM_ROWS - 1) / COLSUM_ROWS;
    float *partial = (float *)cf_cuda_scratch(ctx, CF_SCR_COLSUM, (size_t)nchunks * C * sizeof(float));
    if (!partial) return;
    dim3 grid((C + 63) / 64, nchunks), block(32, 8);
    colsum_partial_kernel<<<grid, block, 0, ctx->stream>>>(partial, dout, x, rstd, T, C);
    if (!CF_CK_LAUNCH(ctx, "colsum_partial")) return;
    colsum_final_kernel<<<(C + 255) / 256, 256, 0, ctx->stream>>>(out, partial, nchunks, C);
    CF_CK_LAUNCH(ctx, "colsum_final");
}

/* ============================================================== matmul */

/*
 * cuBLASLt is column-major; a row-major [R, C] matrix is a column-major
 * [C, R] one. With W [N, K] and x [T, K] row-major:
 *   out^T [N,T] = W [N,K] (= colmajor [K,N], transposed) . x^T [K,T]
 *   dinp^T [K,T] = W^T [K,N] (colmajor as stored) . dout^T [N,T]
 *   dW^T [K,N]  = x^T [K,T] . dout [T,N] (colmajor [N,T], transposed)
 * Plans (descriptors + the heuristic's algorithm) are cached by shape,
 * dtypes, epilogue and pointer alignment.
 */
static int align_of(const void *p) {
    uintptr_t a = (uintptr_t)p;
    int al = 256;
    while (al > 1 && (a % al)) al >>= 1;
    return al;
}


void cf_cuda_gemm_release(cf_cuda_ctx *ctx) {
    for (int i = 0; i < ctx->nplans; i++) {
        cf_gemm_plan *p = &ctx->plans[i];
        cublasLtMatmulDescDestroy(p->op);
        cublasLtMatrixLayoutDestroy(p->a);
        cublasLtMatrixLayoutDestroy(p->b);
        cublasLtMatrixLayoutDestroy(p->c);
        cublasLtMatrixLayoutDestroy(p->d);
    }
    ctx->nplans = 0;
}

/* The cached plan for key, or a new one (NULL on failure, recorded). */
static cf_gemm_plan *get_plan(cf_cuda_ctx *ctx, const int key[16], bool transa, bool transb, int m, int n, int k,
                              int lda, int ldb, cudaDataType_t dtype, int ldd, bool bias) {
    for (int i = 0; i < ctx->nplans; i++)
        if (!memcmp(ctx->plans[i].key, key, sizeof ctx->plans[i].key)) return &ctx->plans[i];
    if (ctx->nplans == CF_GEMM_CACHE) cf_cuda_gemm_release(ctx); /* full: drop everything */
    cf_gemm_plan *pl = &ctx->plans[ctx->nplans];
    memset(pl, 0, sizeof *pl);
    memcpy(pl->key, key, sizeof pl->key);
    cublasOperation_t ta = transa ? CUBLAS_OP_T : CUBLAS_OP_N, tb = transb ? CUBLAS_OP_T : CUBLAS_OP_N;
    bool ok = CF_LT(ctx, cublasLtMatmulDescCreate(&pl->op, CUBLAS_COMPUTE_32F, CUDA_R_32F)) &&
              CF_LT(ctx, cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta)) &&
              CF_LT(ctx, cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    if (ok && bias) {
        cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
        cudaDataType_t bt = CUDA_R_16BF;
        ok = CF_LT(ctx, cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi)) &&
             CF_LT(ctx, cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt));
    }
    /* stored shapes: op(A) is m x k, op(B) is k x n */
    ok = ok && CF_LT(ctx, cublasLtMatrixLayoutCreate(&pl->a, CUDA_R_16BF, transa ? k : m, transa ? m : k, lda)) &&
         CF_LT(ctx, cublasLtMatrixLayoutCreate(&pl->b, CUDA_R_16BF, transb ? n : k, transb ? k : n, ldb)) &&
         CF_LT(ctx, cublasLtMatrixLayoutCreate(&pl->c, dtype, m, n, ldd)) &&
         CF_LT(ctx, cublasLtMatrixLayoutCreate(&pl->d, dtype, m, n, ldd));
    cublasLtMatmulPreference_t pref = NULL;
    ok = ok && CF_LT(ctx, cublasLtMatmulPreferenceCreate(&pref));
    if (ok) {
        uint64_t ws = ctx->workspace_size;
        uint32_t al[4] = {(uint32_t)key[10], (uint32_t)key[11], (uint32_t)key[12], (uint32_t)key[12]};
        const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
            CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
        ok = CF_LT(ctx, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                             sizeof ws));
        for (int i = 0; i < 4 && ok; i++)
            ok = CF_LT(ctx, cublasLtMatmulPreferenceSetAttribute(pref, align_attr[i], &al[i], 4));
    }
    if (ok) {
        cublasLtMatmulHeuristicResult_t heur;
        int nres = 0;
        cublasStatus_t s =
            cublasLtMatmulAlgoGetHeuristic(ctx->lt, pl->op, pl->a, pl->b, pl->c, pl->d, pref, 1, &heur, &nres);
        if (s != CUBLAS_STATUS_SUCCESS || nres == 0) {
            cf_cuda_ctx_fail(ctx, "cublasLtMatmulAlgoGetHeuristic: no algorithm for m=%d n=%d k=%d (%s)", m, n, k,
                             cublasGetStatusString(s));
            ok = false;
        } else {
            pl->algo = heur.algo;
        }
    }
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (!ok) {
        /* not cached: release what was created */
        if (pl->op) cublasLtMatmulDescDestroy(pl->op);
        if (pl->a) cublasLtMatrixLayoutDestroy(pl->a);
        if (pl->b) cublasLtMatrixLayoutDestroy(pl->b);
        if (pl->c) cublasLtMatrixLayoutDestroy(pl->c);
        if (pl->d) cublasLtMatrixLayoutDestroy(pl->d);
        return NULL;
    }
    ctx->nplans++;
    return pl;
}

void cf_cuda_gemm(cf_cuda_ctx *ctx, bool transa, bool transb, int m, int n, int k, const void *A, int lda,
                  const void *B, int ldb, void *D, cudaDataType_t dtype, int ldd, float beta, const void *bias) {
    if (ctx->failed || m <= 0 || n <= 0) return;
    int key[16] = {transa, transb, m, n, k, lda, ldb, ldd, (int)dtype, bias != NULL,
                   align_of(A), align_of(B), align_of(D), bias ? align_of(bias) : 0, 0, 0};
    cf_gemm_plan *pl = get_plan(ctx, key, transa, transb, m, n, k, lda, ldb, dtype, ldd, bias != NULL);
    if (!pl) return;
    if (bias &&
        !CF_LT(ctx, cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias)))
        return;
    const float alpha = 1.f;
    CF_LT(ctx, cublasLtMatmul(ctx->lt, pl->op, &alpha, A, pl->a, B, pl->b, &beta, D, pl->c, D, pl->d, &pl->algo,
                              ctx->workspace, ctx->workspace_size, ctx->stream));
}

/* out[T,N] = inp[T,K] W[N,K]^T (+ bias) */
void cf_cuda_matmul_fwd(cf_backend *b, void *out, const void *inp, const void *w, const void *bias, int T, int K,
                        int N) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0) return;
    cf_cuda_gemm(ctx, true, false, N, T, K, w, K, inp, K, out, CUDA_R_16BF, N, 0.f, bias);
}

/* dinp[T,K] (+)= dout W ; dw[N,K] += dout^T inp ; dbias += colsum(dout) */
void cf_cuda_matmul_bwd(cf_backend *b, void *dinp, float *dw, float *dbias, const void *dout, const void *inp,
                        const void *w, int T, int K, int N, int accumulate) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0) return;
    if (dinp)
        cf_cuda_gemm(ctx, false, false, K, T, N, w, K, dout, N, dinp, CUDA_R_16BF, K, accumulate ? 1.f : 0.f, NULL);
    if (dw) cf_cuda_gemm(ctx, false, true, K, N, T, inp, K, dout, N, dw, CUDA_R_32F, K, 1.f, NULL);
    if (dbias) cf_cuda_colsum(ctx, dbias, (const bf16 *)dout, NULL, NULL, T, N);
}
