/*
 * bench_gemm.cu — times every cuBLASLt algorithm the heuristic offers for the
 * GEMMs of a training step's backward (and the forward), at the shapes of a
 * model's linear layers for T rows (the regular backward) and n kept rows
 * (the centrifuge backward), with the descriptors gemm.cu builds. Random
 * bf16 inputs, scratch outputs (never live data).
 *
 *   nvcc -O2 -std=c++17 -o bench_gemm tools/bench_gemm.cu -lcublasLt
 *   ./bench_gemm [NALGO]          (default 16 heuristic results per shape)
 *
 * Per shape: the heuristic's first algorithm, the fastest of the first NALGO
 * and its index, each the median of REPS timed launches (CUDA events around
 * each) after warm-up. Used to choose gemm.cu's algorithm rule (issue 17).
 */
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)
#define LK(x)                                                                                   \
    do {                                                                                        \
        cublasStatus_t s_ = (x);                                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                      \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cublasGetStatusString(s_)); \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)

static __global__ void fill_bf16(__nv_bfloat16 *p, size_t n, uint32_t seed, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
        p[i] = __float2bfloat16(((float)(h & 0xffffff) / 16777216.f - 0.5f) * scale);
    }
}

static cublasLtHandle_t lt;
static void *ws;
static const size_t WS = (size_t)32 << 20;
static void *bufA, *bufB, *bufD;   /* scratch, large enough for every shape */
static const int REPS = 15, WARM = 3;

struct res { float first_ms, best_ms; int best_idx, n; float all[64]; };

static res time_gemm(bool transa, bool transb, int m, int n, int k, int lda, int ldb, bool f32out, int ldd, float beta,
                     int nalgo) {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
    cublasOperation_t ta = transa ? CUBLAS_OP_T : CUBLAS_OP_N, tb = transb ? CUBLAS_OP_T : CUBLAS_OP_N;
    cudaDataType_t dt = f32out ? CUDA_R_32F : CUDA_R_16BF;
    LK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    LK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    LK(cublasLtMatrixLayoutCreate(&a, CUDA_R_16BF, transa ? k : m, transa ? m : k, lda));
    LK(cublasLtMatrixLayoutCreate(&b, CUDA_R_16BF, transb ? n : k, transb ? k : n, ldb));
    LK(cublasLtMatrixLayoutCreate(&c, dt, m, n, ldd));
    cublasLtMatmulPreference_t pref;
    LK(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t wsz = WS;
    LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsz, sizeof wsz));
    uint32_t al = 256;
    LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al, 4));
    LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al, 4));
    LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al, 4));
    LK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al, 4));
    cublasLtMatmulHeuristicResult_t heur[64];
    int nres = 0;
    LK(cublasLtMatmulAlgoGetHeuristic(lt, op, a, b, c, c, pref, nalgo, heur, &nres));
    res r = {};
    r.n = nres;
    r.best_ms = 1e30f;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    const float alpha = 1.f;
    for (int i = 0; i < nres; i++) {
        float t[REPS];
        bool ok = true;
        for (int it = 0; it < WARM + REPS && ok; it++) {
            CK(cudaEventRecord(e0));
            cublasStatus_t s = cublasLtMatmul(lt, op, &alpha, bufA, a, bufB, b, &beta, bufD, c, bufD, c, &heur[i].algo,
                                              ws, WS, 0);
            CK(cudaEventRecord(e1));
            if (s != CUBLAS_STATUS_SUCCESS) ok = false;
            CK(cudaEventSynchronize(e1));
            if (it >= WARM) CK(cudaEventElapsedTime(&t[it - WARM], e0, e1));
        }
        float med = 1e30f;
        if (ok) {
            std::sort(t, t + REPS);
            med = t[REPS / 2];
        }
        r.all[i] = med;
        if (i == 0) r.first_ms = med;
        if (med < r.best_ms) { r.best_ms = med; r.best_idx = i; }
    }
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(a);
    cublasLtMatrixLayoutDestroy(b);
    cublasLtMatrixLayoutDestroy(c);
    cublasLtMatmulDescDestroy(op);
    return r;
}

struct model { const char *name; int C, F, qd, kd, V, L; };

int main(int argc, char **argv) {
    int nalgo = argc > 1 ? atoi(argv[1]) : 16;
    if (nalgo > 64) nalgo = 64;
    LK(cublasLtCreate(&lt));
    CK(cudaMalloc(&ws, WS));
    size_t big = (size_t)1 << 31; /* 2 GiB each */
    CK(cudaMalloc(&bufA, big));
    CK(cudaMalloc(&bufB, big));
    CK(cudaMalloc(&bufD, big));
    fill_bf16<<<1024, 256>>>((__nv_bfloat16 *)bufA, big / 2, 1u, 1.f);
    fill_bf16<<<1024, 256>>>((__nv_bfloat16 *)bufB, big / 2, 2u, 0.02f);
    CK(cudaMemset(bufD, 0, big));
    CK(cudaDeviceSynchronize());
    model models[] = {{"qwen2.5-1.5b", 1536, 8960, 1536, 256, 151936, 28}, {"llama3.2-3b", 3072, 8192, 3072, 1024, 128256, 28}};
    printf("%-13s %-7s %5s %6s %6s %6s %3s | %8s %8s %3s %3s | %7s %7s\n", "model", "gemm", "T", "m", "n", "k", "out",
           "first", "best", "idx", "of", "TF1", "TFbest");
    for (auto &md : models) {
        for (int T : {2048, 1024}) {
            double sum_first = 0, sum_best = 0;
            struct lin { const char *nm; int K, N, count; } lins[] = {
                {"down", md.F, md.C, 1}, {"gate/up", md.C, md.F, 2}, {"o", md.qd, md.C, 1}, {"q", md.C, md.qd, 1},
                {"k/v", md.C, md.kd, 2}};
            for (auto &l : lins) {
                /* dinp [T,K] = dout [T,N] W [N,K]: gemm(N,N, m=K, n=T, k=N) bf16, beta 0 */
                res r1 = time_gemm(false, false, l.K, T, l.N, l.K, l.N, false, l.K, 0.f, nalgo);
                /* dW [N,K] += dout^T inp: gemm(N,T, m=K, n=N, k=T) fp32, beta 1 */
                res r2 = time_gemm(false, true, l.K, l.N, T, l.K, l.N, true, l.K, 1.f, nalgo);
                res r3 = time_gemm(false, true, l.K, l.N, T, l.K, l.N, true, l.K, 0.f, nalgo);
                const char *nm[3] = {"dinp", "dW", "dW b0"};
                res rr[3] = {r1, r2, r3};
                int mm[3] = {l.K, l.K, l.K}, nn[3] = {T, l.N, l.N}, kk[3] = {l.N, T, T};
                for (int j = 0; j < 3; j++) {
                    double fl = 2.0 * l.K * l.N * T;
                    printf("%-13s %-5s%-2s %5d %6d %6d %6d %3s | %8.4f %8.4f %3d %3d | %7.1f %7.1f   %s\n", md.name,
                           l.nm, "", T, mm[j], nn[j], kk[j], j ? "f32" : "b16", rr[j].first_ms, rr[j].best_ms,
                           rr[j].best_idx, rr[j].n, fl / rr[j].first_ms / 1e9, fl / rr[j].best_ms / 1e9, nm[j]);
                    if (j < 2) {
                        sum_first += l.count * rr[j].first_ms;
                        sum_best += l.count * rr[j].best_ms;
                    }
                }
                printf("   all dW:");
                for (int i = 0; i < r2.n; i++) printf(" %.4f", r2.all[i]);
                printf("\n   all dinp:");
                for (int i = 0; i < r1.n; i++) printf(" %.4f", r1.all[i]);
                printf("\n");
            }
            /* LM head, one chunk of T rows: logits (fp32), dinp, dW */
            res a = time_gemm(true, false, md.V, T, md.C, md.C, md.C, true, md.V, 0.f, nalgo);
            res b = time_gemm(false, false, md.C, T, md.V, md.C, md.V, false, md.C, 0.f, nalgo);
            res c = time_gemm(false, true, md.C, md.V, T, md.C, md.V, true, md.C, 1.f, nalgo);
            res d = time_gemm(false, true, md.C, md.V, T, md.C, md.V, true, md.C, 0.f, nalgo);
            double fl = 2.0 * md.C * (double)md.V * T;
            printf("%-13s lm logits %5d | %8.4f %8.4f %3d %3d | %7.1f %7.1f\n", md.name, T, a.first_ms, a.best_ms,
                   a.best_idx, a.n, fl / a.first_ms / 1e9, fl / a.best_ms / 1e9);
            printf("%-13s lm dinp   %5d | %8.4f %8.4f %3d %3d | %7.1f %7.1f\n", md.name, T, b.first_ms, b.best_ms,
                   b.best_idx, b.n, fl / b.first_ms / 1e9, fl / b.best_ms / 1e9);
            printf("%-13s lm dW     %5d | %8.4f %8.4f %3d %3d | %7.1f %7.1f\n", md.name, T, c.first_ms, c.best_ms,
                   c.best_idx, c.n, fl / c.first_ms / 1e9, fl / c.best_ms / 1e9);
            printf("%-13s lm dW b0  %5d | %8.4f %8.4f %3d %3d | %7.1f %7.1f\n", md.name, T, d.first_ms, d.best_ms,
                   d.best_idx, d.n, fl / d.first_ms / 1e9, fl / d.best_ms / 1e9);
            printf("SUM %-13s T=%d per-layer backward GEMMs: heuristic-first %.3f ms, best %.3f ms (x%d layers = "
                   "%.2f / %.2f ms); lm head %.3f / %.3f ms\n",
                   md.name, T, sum_first, sum_best, md.L, sum_first * md.L, sum_best * md.L,
                   a.first_ms + b.first_ms + c.first_ms, a.best_ms + b.best_ms + c.best_ms);
            fflush(stdout);
        }
    }
    return 0;
}
