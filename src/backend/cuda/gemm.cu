/*
 * gemm.cu — the dense GEMMs of the linear layers through cuBLASLt (bf16
 * inputs, fp32 compute), and the deterministic column sums of their bias
 * gradient (whose final kernel also adds up the RMSNorm weight gradient's
 * partial sums, norm.cu).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_common.cuh"

/* ======================================= deterministic column sums */

/*
 * partial[chunk, c] = sum over rows t of the chunk of f(t, c), with
 *   f = dout[t,c]                      (bias gradient)
 *   f = dout[t,c] * x[t,c] * rstd[t]   (rmsnorm weight gradient, large C)
 * block (32, 8) owns 256 columns, 8 per thread: with VEC 8 consecutive ones
 * (one 16-byte load per tensor and row), else columns x, x+32, .. (coalesced
 * 2-byte loads). Rows of the chunk strided by 8 over threadIdx.y, reduced in
 * shared memory in a fixed order. Then colsum_final_kernel:
 * out[c] += sum_chunk partial[chunk, c], in a fixed order. Run to run
 * identical (the chunking depends on T and C only).
 */
#define COLSUM_COLS 256
template <bool VEC>
static __global__ void colsum_partial_kernel(float *partial, const bf16 *dout, const bf16 *x, const float *rstd, int T,
                                             int C, int rows_per_chunk) {
    __shared__ float red[8][COLSUM_COLS];
    const int tx = threadIdx.x, ty = threadIdx.y, base = blockIdx.x * COLSUM_COLS;
    const int t0 = blockIdx.y * rows_per_chunk, t1 = min(T, t0 + rows_per_chunk);
    float s[8]; /* columns base + 8 tx + k (VEC), base + tx + 32 k (scalar) */
    for (int k = 0; k < 8; k++) s[k] = 0.f;
    for (int t = t0 + ty; t < t1; t += 8) {
        const size_t row = (size_t)t * C;
        const float r = rstd ? rstd[t] : 1.f;
        if (VEC) {
            const int c = base + 8 * tx;
            if (c < C) {
                float d[8], xf[8];
                unpack8(*(const pack8 *)(dout + row + c), d);
                if (x) {
                    unpack8(*(const pack8 *)(x + row + c), xf);
                    for (int k = 0; k < 8; k++) d[k] *= xf[k] * r;
                }
                for (int k = 0; k < 8; k++) s[k] += d[k];
            }
        } else {
            for (int k = 0; k < 8; k++) {
                const int c = base + tx + 32 * k;
                if (c < C) {
                    float v = __bfloat162float(dout[row + c]);
                    if (x) v *= __bfloat162float(x[row + c]) * r;
                    s[k] += v;
                }
            }
        }
    }
    for (int k = 0; k < 8; k++) red[ty][VEC ? 8 * tx + k : tx + 32 * k] = s[k];
    __syncthreads();
    const int j = ty * 32 + tx, c = base + j;
    if (c < C) {
        float v = 0.f;
        for (int y = 0; y < 8; y++) v += red[y][j];
        partial[(size_t)blockIdx.y * C + c] = v;
    }
}

/* block (32, 32): 32 columns; thread y sums chunks y, y+32, .. then the 32
 * sums are added in order: out[c] += sum_k partial[k, c] */
static __global__ void colsum_final_kernel(float *out, const float *partial, int nchunks, int C) {
    __shared__ float red[32][33];
    const int c = blockIdx.x * 32 + threadIdx.x;
    float s = 0.f;
    if (c < C) {
#pragma unroll 8
        for (int k = threadIdx.y; k < nchunks; k += 32) s += partial[(size_t)k * C + c];
    }
    red[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        float v = 0.f;
        for (int y = 0; y < 32; y++) v += red[y][threadIdx.x];
        out[c] += v;
    }
}
void cf_cuda_colsum_final(cf_cuda_ctx *ctx, float *out, const float *partial, int nchunks, int C) {
    colsum_final_kernel<<<(C + 31) / 32, dim3(32, 32), 0, ctx->stream>>>(out, partial, nchunks, C);
    CF_CK_LAUNCH(ctx, "colsum_final");
}

void cf_cuda_colsum(cf_cuda_ctx *ctx, float *out, const bf16 *dout, const bf16 *x, const float *rstd, int T, int C) {
    if (T <= 0 || C <= 0) return;
    /* about 512 blocks in all (the q/k/v biases at small T: a few column
     * blocks, so many short chunks), at least 8 rows per chunk (one per
     * threadIdx.y), at most 256 chunks for the final kernel */
    const int cblocks = (C + COLSUM_COLS - 1) / COLSUM_COLS;
    const int want = max(1, min(256, 512 / cblocks));
    const int rows = 8 * ((T + 8 * want - 1) / (8 * want));
    const int nchunks = (T + rows - 1) / rows;
    float *partial = (float *)cf_cuda_scratch(ctx, CF_SCR_COLSUM, (size_t)nchunks * C * sizeof(float));
    if (!partial) return;
    dim3 grid(cblocks, nchunks), block(32, 8);
    if (C % 8 == 0 && cf_aligned16(dout) && (!x || cf_aligned16(x)))
        colsum_partial_kernel<true><<<grid, block, 0, ctx->stream>>>(partial, dout, x, rstd, T, C, rows);
    else
        colsum_partial_kernel<false><<<grid, block, 0, ctx->stream>>>(partial, dout, x, rstd, T, C, rows);
    if (!CF_CK_LAUNCH(ctx, "colsum_partial")) return;
    cf_cuda_colsum_final(ctx, out, partial, nchunks, C);
}

/* ============================================================== matmul */

/*
 * cuBLASLt is column-major; a row-major [R, C] matrix is a column-major
 * [C, R] one. With W [N, K] and x [T, K] row-major:
 *   out^T [N,T] = W [N,K] (= colmajor [K,N], transposed) . x^T [K,T]
 *   dinp^T [K,T] = W^T [K,N] (colmajor as stored) . dout^T [N,T]
 *   dW^T [K,N]  = x^T [K,T] . dout [T,N] (colmajor [N,T], transposed)
 * Plans (descriptors + the chosen algorithm) are cached by shape, dtypes,
 * epilogue, pointer alignment, whether beta is 0 and the SMs targeted
 * (side_sms).
 *
 * Algorithm choice (issue 17: the backward's GEMMs at M = kept rows). The
 * heuristic's first algorithm is the reference. Its next CF_GEMM_CANDIDATES-1
 * results are candidates only if they compute the same function bit for bit:
 * each runs once on random inputs in scratch buffers (never on live data;
 * with beta != 0 the output starts with the same random C for both, since
 * kernels differ in how they round the product plus C), and its output is
 * compared with the reference's bitwise. Among the
 * candidates that match, the fastest by timing (interleaved rounds of
 * launches, median per candidate) is taken if it beats the first by 3%.
 * Since every algorithm that can be chosen gives the first's bits, the
 * result of a training step does not depend on which one timing noise
 * picks: runs stay run-to-run deterministic and identical to the
 * heuristic-first choice. (Residual risk: two algorithms that sum in
 * different orders yet agree bitwise on one random problem of the exact
 * shape; with 10^5..10^7 fp32 outputs of random data this does not happen in
 * practice.) CF_GEMM_TUNE=0 in the environment keeps the heuristic's first;
 * CF_GEMM_TUNE=2 also prints each choice to stderr; CF_GEMM_TUNE=3 also
 * times the results that differ and prints every one with its tile,
 * split-K and time (the choice is the same). Problems whose scratch
 * would exceed CF_GEMM_TUNE_MAX_BYTES (the LM head's [V, C] fp32 gradient)
 * keep the first.
 */
static int align_of(const void *p) {
    uintptr_t a = (uintptr_t)p;
    int al = 256;
    while (al > 1 && (a % al)) al >>= 1;
    return al;
}

#define CF_GEMM_CANDIDATES 16
#define CF_GEMM_TUNE_MAX_BYTES ((size_t)640 << 20)
#define CF_GEMM_TUNE_ROUNDS 5
#define CF_GEMM_TUNE_LAUNCHES 3

static int tune_mode(void) {
    static int mode = -1;
    if (mode < 0) {
        const char *e = getenv("CF_GEMM_TUNE");
        mode = e && *e ? atoi(e) : 1;
    }
    return mode;
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

static __global__ void tune_fill_kernel(uint16_t *p, size_t n, uint32_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed ^ (uint32_t)(i >> 32) * 40503u;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
        /* a bf16 in [-1, 1): sign, exponent 0x70..0x7e, random mantissa */
        p[i] = (uint16_t)((h & 0x8000u) | ((0x70u + (h >> 16) % 15u) << 7) | (h & 0x7fu));
    }
}
static __global__ void tune_diff_kernel(unsigned *diff, const uint16_t *a, const uint16_t *b, size_t n) {
    unsigned d = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        d |= a[i] != b[i];
    if (d) atomicOr(diff, 1u);
}

/* the median of one candidate's CF_GEMM_TUNE_ROUNDS timings */
static float median_ms(const float *t) {
    float v[CF_GEMM_TUNE_ROUNDS];
    for (int r = 0; r < CF_GEMM_TUNE_ROUNDS; r++) v[r] = t[r];
    for (int x = 1; x < CF_GEMM_TUNE_ROUNDS; x++)
        for (int y = x; y > 0 && v[y] < v[y - 1]; y--) { float u = v[y]; v[y] = v[y - 1]; v[y - 1] = u; }
    return v[CF_GEMM_TUNE_ROUNDS / 2];
}

/*
 * Chooses pl->algo among heur[0..nres) as described above. A, B: the
 * operands' stored sizes in elements (bf16); dbytes: D's. Falls back to
 * heur[0] on any failure (clearing the CUDA error it caused).
 */
static void tune_plan(cf_cuda_ctx *ctx, cf_gemm_plan *pl, const cublasLtMatmulHeuristicResult_t *heur, int nres,
                      size_t a_elems, size_t b_elems, size_t dbytes, float beta, bool bias, int bias_elems) {
    pl->algo = heur[0].algo;
    pl->choice = 0;
    pl->candidates = 1;
    if (nres < 2 || tune_mode() == 0) return;
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(ctx->stream, &cap) != cudaSuccess || cap != cudaStreamCaptureStatusNone) {
        cudaGetLastError();
        return;
    }
    const size_t al = 256;
    size_t abytes = (a_elems * 2 + al - 1) / al * al, bbytes = (b_elems * 2 + al - 1) / al * al;
    size_t dpad = (dbytes + al - 1) / al * al, biasb = bias ? ((size_t)bias_elems * 2 + al - 1) / al * al : 0;
    size_t total = abytes + bbytes + 2 * dpad + biasb + al;
    if (total > CF_GEMM_TUNE_MAX_BYTES) return;
    char *buf = NULL;
    cudaEvent_t ev[2 * CF_GEMM_CANDIDATES] = {0};
    /* stream-ordered allocation: no device-wide synchronisation (collectives
     * of other streams in flight are not waited for) */
    bool ok = cudaMallocAsync((void **)&buf, total, ctx->stream) == cudaSuccess &&
              cudaStreamSynchronize(ctx->stream) == cudaSuccess;
    for (int i = 0; ok && i < 2 * nres; i++) ok = cudaEventCreate(&ev[i]) == cudaSuccess;
    float ms[CF_GEMM_CANDIDATES][CF_GEMM_TUNE_ROUNDS];
    bool same[CF_GEMM_CANDIDATES] = {true}, ran[CF_GEMM_CANDIDATES] = {true};
    int nsame = 1;
    /* CF_GEMM_TUNE=3: also time the results that differ from the first and
     * print every one (a survey of what the bitwise rule leaves out) */
    const bool survey = tune_mode() >= 3;
    if (ok) {
        uint16_t *A = (uint16_t *)buf, *B = (uint16_t *)(buf + abytes);
        char *D0 = buf + abytes + bbytes, *D1 = D0 + dpad;
        uint16_t *bias_p = bias ? (uint16_t *)(D1 + dpad) : NULL;
        unsigned *diff = (unsigned *)(D1 + dpad + biasb);
        cudaStream_t s = ctx->stream;
        const float alpha = 1.f;
        tune_fill_kernel<<<256, 256, 0, s>>>(A, a_elems, 0x9e3779b9u);
        tune_fill_kernel<<<256, 256, 0, s>>>(B, b_elems, 0x85ebca6bu);
        if (bias) tune_fill_kernel<<<64, 256, 0, s>>>(bias_p, (size_t)bias_elems, 0xc2b2ae35u);
        ok = cudaGetLastError() == cudaSuccess;
        if (ok && bias) ok = cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_p,
                                                            sizeof bias_p) == CUBLAS_STATUS_SUCCESS;
        auto run = [&](int i, void *D) {
            return cublasLtMatmul(ctx->lt, pl->op, &alpha, A, pl->a, B, pl->b, &beta, D, pl->c, D, pl->d,
                                  &heur[i].algo, ctx->workspace, ctx->workspace_size, s) == CUBLAS_STATUS_SUCCESS;
        };
        /* the reference, then each candidate against it, bitwise. D starts
         * random: with beta != 0 the same values in both (C is read, so the
         * epilogue's arithmetic is compared too: two kernels may add C to
         * the product with different roundings), with beta 0 different ones
         * (so an element a candidate leaves unwritten shows). */
        const uint32_t seed0 = 0x27d4eb2fu, seed1 = beta != 0.f ? seed0 : 0x165667b1u;
        tune_fill_kernel<<<256, 256, 0, s>>>((uint16_t *)D0, dpad / 2, seed0);
        ok = ok && cudaGetLastError() == cudaSuccess && run(0, D0);
        for (int i = 1; ok && i < nres; i++) {
            unsigned h = 1;
            tune_fill_kernel<<<256, 256, 0, s>>>((uint16_t *)D1, dpad / 2, seed1);
            same[i] = cudaGetLastError() == cudaSuccess && cudaMemsetAsync(diff, 0, 4, s) == cudaSuccess &&
                      run(i, D1);
            ran[i] = same[i];
            if (same[i]) {
                tune_diff_kernel<<<256, 256, 0, s>>>(diff, (const uint16_t *)D0, (const uint16_t *)D1, dpad / 2);
                same[i] = cudaGetLastError() == cudaSuccess &&
                          cudaMemcpyAsync(&h, diff, 4, cudaMemcpyDeviceToHost, s) == cudaSuccess &&
                          cudaStreamSynchronize(s) == cudaSuccess && h == 0;
            }
            cudaGetLastError(); /* an algorithm that failed to run is just not a candidate */
            nsame += same[i];
        }
        /* timing: rounds of CF_GEMM_TUNE_LAUNCHES launches per candidate,
         * interleaved (survey: every result that ran, for the report) */
        bool timed[CF_GEMM_CANDIDATES];
        for (int i = 0; i < nres; i++) timed[i] = same[i] || (survey && ran[i]);
        if (ok && (nsame > 1 || survey)) {
            for (int i = 0; ok && i < nres; i++)
                if (timed[i]) ok = run(i, D1) && run(i, D1);
            for (int r = 0; ok && r < CF_GEMM_TUNE_ROUNDS; r++) {
                for (int i = 0; ok && i < nres; i++) {
                    if (!timed[i]) continue;
                    ok = cudaEventRecord(ev[2 * i], s) == cudaSuccess;
                    for (int j = 0; ok && j < CF_GEMM_TUNE_LAUNCHES; j++) ok = run(i, D1);
                    ok = ok && cudaEventRecord(ev[2 * i + 1], s) == cudaSuccess;
                }
                ok = ok && cudaStreamSynchronize(s) == cudaSuccess;
                for (int i = 0; ok && i < nres; i++)
                    if (timed[i]) ok = cudaEventElapsedTime(&ms[i][r], ev[2 * i], ev[2 * i + 1]) == cudaSuccess;
            }
        }
        if (ok && survey) {
            float md[CF_GEMM_CANDIDATES] = {0};
            for (int i = 0; i < nres; i++)
                if (timed[i]) md[i] = median_ms(ms[i]);
            for (int i = 0; i < nres; i++) {
                int tile = -1, splitk = -1, red = -1, stages = -1;
                size_t w = 0;
                cublasLtMatmulAlgoConfigGetAttribute(&heur[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &w);
                cublasLtMatmulAlgoConfigGetAttribute(&heur[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk,
                                                     sizeof splitk, &w);
                cublasLtMatmulAlgoConfigGetAttribute(&heur[i].algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &red,
                                                     sizeof red, &w);
                cublasLtMatmulAlgoConfigGetAttribute(&heur[i].algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages,
                                                     sizeof stages, &w);
                fprintf(stderr, "gemm survey: m=%d n=%d k=%d ta=%d tb=%d beta=%g #%d %s tile %d stages %d splitk %d "
                                "reduction %d: %.4f ms (%.2fx the first)\n",
                        pl->key[2], pl->key[3], pl->key[4], pl->key[0], pl->key[1], beta, i,
                        !ran[i] ? "did not run" : same[i] ? "bit-identical" : "differs", tile, stages, splitk, red,
                        md[i] / CF_GEMM_TUNE_LAUNCHES, md[0] > 0 ? md[i] / md[0] : 0.f);
            }
        }
        ok = cudaStreamSynchronize(s) == cudaSuccess && ok;
    }
    int best = 0;
    float med[CF_GEMM_CANDIDATES] = {0};
    if (ok && nsame > 1) {
        for (int i = 0; i < nres; i++)
            if (same[i]) med[i] = median_ms(ms[i]) / CF_GEMM_TUNE_LAUNCHES;
        for (int i = 1; i < nres; i++)
            if (same[i] && med[i] < med[best]) best = i;
        if (best != 0 && !(med[best] < 0.97f * med[0])) best = 0;
    }
    for (int i = 0; i < 2 * nres; i++)
        if (ev[i]) cudaEventDestroy(ev[i]);
    if (buf) cudaFreeAsync(buf, ctx->stream);
    cudaGetLastError();
    pl->algo = heur[best].algo;
    pl->choice = best;
    pl->candidates = nsame;
    if (tune_mode() >= 2)
        fprintf(stderr, "gemm tune: ta=%d tb=%d m=%d n=%d k=%d dtype=%s beta=%g: %d results, %d bit-identical, "
                        "first %.4f ms, chosen #%d %.4f ms%s\n",
                pl->key[0], pl->key[1], pl->key[2], pl->key[3], pl->key[4],
                pl->key[8] == (int)CUDA_R_32F ? "f32" : "bf16", beta, nres, nsame, med[0], best, med[best],
                ok ? "" : " (tuning failed: first kept)");
}

/* The cached plan for key, or a new one (NULL on failure, recorded). */
static cf_gemm_plan *get_plan(cf_cuda_ctx *ctx, const int key[16], bool transa, bool transb, int m, int n, int k,
                              int lda, int ldb, cudaDataType_t dtype, int ldd, bool bias, float beta) {
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
    if (ok && key[15] > 0) {
        const int32_t sms = key[15];
        ok = CF_LT(ctx, cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &sms, sizeof sms));
    }
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
        cublasLtMatmulHeuristicResult_t heur[CF_GEMM_CANDIDATES];
        int nres = 0;
        cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(ctx->lt, pl->op, pl->a, pl->b, pl->c, pl->d, pref,
                                                          CF_GEMM_CANDIDATES, heur, &nres);
        if (s != CUBLAS_STATUS_SUCCESS || nres == 0) {
            cf_cuda_ctx_fail(ctx, "cublasLtMatmulAlgoGetHeuristic: no algorithm for m=%d n=%d k=%d (%s)", m, n, k,
                             cublasGetStatusString(s));
            ok = false;
        } else {
            size_t a_elems = (size_t)lda * (transa ? m : k), b_elems = (size_t)ldb * (transb ? k : n);
            size_t dbytes = (size_t)ldd * n * (dtype == CUDA_R_32F ? 4 : 2);
            tune_plan(ctx, pl, heur, nres, a_elems, b_elems, dbytes, beta, bias, m);
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

/* SMs that a GEMM in a narrow side section (backend.h: side_begin; the
 * compact backwards') is planned for: cuBLASLt's persistent kernels launch
 * one CTA per SM they target and keep it to the end, so a side GEMM planned
 * for every SM holds them all while the compute stream's next kernel
 * waits, whatever the streams' priorities. Planned for all but
 * CF_SIDE_FREE_SMS (the heuristic and the tuner see that count), it leaves
 * those to the compute stream. Measured on an H100 (132 SMs,
 * docs/BENCHMARKS.md run 20), 100 SMs against all 132: centrifuge backward
 * Qwen2.5-1.5B -3 to -6%, Llama3.2-3B -2 to -2.5%, TinyLlama -0.8%; 66 and
 * 84 were slower, 116 no better. The regular backwards moved by -2%
 * (Qwen), -0.2 to +1.1% (Llama3.2-3B), +1.4% (TinyLlama): their sections
 * are not narrow. CF_SIDE_SMS=n (read once) plans narrow sections' GEMMs
 * for n SMs instead (0: every SM). GPUs of fewer than 2 x CF_SIDE_FREE_SMS
 * SMs use every SM. */
#define CF_SIDE_FREE_SMS 32
static int side_sms(const cf_cuda_ctx *ctx) {
    static int env = -2;
    if (env == -2) {
        const char *e = getenv("CF_SIDE_SMS");
        env = e && *e ? atoi(e) : -1;
    }
    if (env >= 0) return env > 0 && env < ctx->sm_count ? env : 0;
    return ctx->sm_count >= 2 * CF_SIDE_FREE_SMS ? ctx->sm_count - CF_SIDE_FREE_SMS : 0;
}

/* D = op(A) op(B) + beta C (+ bias), C = D when Cin is NULL; C has D's layout */
static void gemm_c(cf_cuda_ctx *ctx, bool transa, bool transb, int m, int n, int k, const void *A, int lda,
                   const void *B, int ldb, void *D, cudaDataType_t dtype, int ldd, float alpha, float beta,
                   const void *bias, const void *Cin) {
    if (ctx->failed || m <= 0 || n <= 0) return;
    const void *C = Cin ? Cin : D;
    /* the C alignment joins D's in the key (both fill the C/D preference) */
    int key[16] = {transa, transb, m, n, k, lda, ldb, ldd, (int)dtype, bias != NULL,
                   align_of(A), align_of(B), min(align_of(D), align_of(C)), bias ? align_of(bias) : 0, beta == 0.f,
                   ctx->side_open && ctx->side_narrow ? side_sms(ctx) : 0};
    cf_gemm_plan *pl = get_plan(ctx, key, transa, transb, m, n, k, lda, ldb, dtype, ldd, bias != NULL, beta);
    if (!pl) return;
    if (bias &&
        !CF_LT(ctx, cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias)))
        return;
    CF_LT(ctx, cublasLtMatmul(ctx->lt, pl->op, &alpha, A, pl->a, B, pl->b, &beta, C, pl->c, D, pl->d, &pl->algo,
                              ctx->workspace, ctx->workspace_size, ctx->stream));
}

void cf_cuda_gemm(cf_cuda_ctx *ctx, bool transa, bool transb, int m, int n, int k, const void *A, int lda,
                  const void *B, int ldb, void *D, cudaDataType_t dtype, int ldd, float beta, const void *bias) {
    gemm_c(ctx, transa, transb, m, n, k, A, lda, B, ldb, D, dtype, ldd, 1.f, beta, bias, NULL);
}

/* out[T,N] = inp[T,K] W[N,K]^T (+ bias) */
void cf_cuda_matmul_fwd(cf_backend *b, void *out, const void *inp, const void *w, const void *bias, int T, int K,
                        int N) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0) return;
    cf_cuda_gemm(ctx, true, false, N, T, K, w, K, inp, K, out, CUDA_R_16BF, N, 0.f, bias);
}

/* out[T,N] = resid[T,N] + inp[T,K] W[N,K]^T (+ bias): the residual add in
 * the GEMM's epilogue (beta 1 with C = resid), so the sum is rounded to
 * bf16 once and the separate add's pass over [T,N] (two reads, one write)
 * goes away. out may alias resid. */
void cf_cuda_matmul_fwd_residual(cf_backend *b, void *out, const void *inp, const void *w, const void *bias,
                                 const void *resid, int T, int K, int N) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0) return;
    gemm_c(ctx, true, false, N, T, K, w, K, inp, K, out, CUDA_R_16BF, N, 1.f, 1.f, bias, resid);
}

/* dinp[T,K] (+)= dout W ; dw[N,K] (+)= dout^T inp ; dbias += colsum(dout).
 * flags: CF_MM_ACC_DINP accumulates dinp, CF_MM_DW_SET overwrites dw
 * (beta 0: the fp32 gradient is written, not read: backend.h). */
void cf_cuda_matmul_bwd(cf_backend *b, void *dinp, float *dw, float *dbias, const void *dout, const void *inp,
                        const void *w, int T, int K, int N, int flags) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx) return;
    /* a side section (backend.h) shares no scratch buffer with the compute
     * stream: only its GEMMs may run there */
    if (ctx->side_open && (dinp || dbias)) {
        cf_cuda_ctx_fail(ctx, "internal: matmul_bwd with an input or bias gradient in a side section");
        return;
    }
    cf_cuda_matmul_bwd_scaled(ctx, dinp, dw, dout, inp, w, T, K, N, flags, 1.f);
    if (dbias && T > 0) cf_cuda_colsum(ctx, dbias, (const bf16 *)dout, NULL, NULL, T, N);
}

/* matmul_bwd's two GEMMs with the products scaled by alpha (fp32, in the
 * GEMM): dinp = alpha dout W ; dw (+)= alpha dout^T inp (flags as there; no
 * bias). For the LM head's saved gradient, whose rows carry the loss weight
 * this way instead of being rounded to bf16 a second time (lmhead.cu). */
void cf_cuda_matmul_bwd_scaled(cf_cuda_ctx *ctx, void *dinp, float *dw, const void *dout, const void *inp,
                               const void *w, int T, int K, int N, int flags, float alpha) {
    if (ctx->failed) return;
    if (T <= 0) {
        /* no rows: dw = is zeros, which its memory may not hold (a STALE
         * gradient, engine/model_internal.h); += and dinp [0, K] are no-ops */
        if (dw && (flags & CF_MM_DW_SET) && K > 0 && N > 0)
            CF_CK(ctx, cudaMemsetAsync(dw, 0, (size_t)N * K * sizeof(float), ctx->stream));
        return;
    }
    if (dinp)
        gemm_c(ctx, false, false, K, T, N, w, K, dout, N, dinp, CUDA_R_16BF, K, alpha,
               (flags & CF_MM_ACC_DINP) ? 1.f : 0.f, NULL, NULL);
    if (dw)
        gemm_c(ctx, false, true, K, N, T, inp, K, dout, N, dw, CUDA_R_32F, K, alpha,
               (flags & CF_MM_DW_SET) ? 0.f : 1.f, NULL, NULL);
}
