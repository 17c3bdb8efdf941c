/*
 * bench_attention.c — times the CUDA attention kernels per mode.
 *
 *   build/cuda/tests/bench_attention [S [H Hkv D [B]]]     (make bench-gpu)
 *
 * Each attention code path is timed in turn, in one process: the
 * environment variable BENCH_ATTN_PATHS lists them (default "auto
 * portable"; each is given to a fresh context as CENTRIFUGE_ATTENTION, so
 * "auto" is the Hopper kernels on an H100/H200).
 *
 * Default shapes: TinyLlama (H=32, Hkv=4, D=64) and a D=128 GQA shape
 * (H=32, Hkv=8), S=4096, B=1 (B sequences of S when given). Each figure is the median of 20 runs after 3
 * warm-ups, timed with cudaEvents on the backend's compute stream (its
 * device context, backend/cuda/context.h). BENCH_ATTN_TIMING=queued (the
 * default) enqueues the 20 runs without waiting, an event pair around each,
 * so the GPU runs them back to back and no host launch latency is timed, as
 * in a training step and in triton's do_bench; =sync waits for the device
 * before each run, so the time of each also holds the latency of its first
 * launch (and of any launch the GPU overtakes). tools/bench_pytorch.py
 * --timing times SDPA either way. FLOPs count the causal half only:
 *   forward  = 4 B H D S(S+1)/2      (QK^T and PV)
 *   backward = 2.5 x forward         (QK^T, dO V^T, P^T dO, dS^T Q, dS K)
 * Filtered modes keep exactly half of each sequence's positions, chosen at
 * random; their time is reported against the full backward.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cuda/context.h"
#include "base/common.h"

static cf_backend *gpu;
static int g_sync_each;   /* BENCH_ATTN_TIMING=sync */

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_)); exit(1); } } while (0)

typedef struct {
    void *q, *k, *v, *out, *dout, *dq, *dk, *dv;
    float *lse;
    void *qc, *outc, *doutc, *dqc, *dkc, *dvc; /* compacted kept rows */
    float *lsec;
    cf_attn_shape s;
    cf_rows kept;
} bench_ctx;

static void *rand_act(size_t n, cf_rng *r) {
    float *h = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) h[i] = cf_rng_normal(r);
    void *d = gpu->alloc(gpu, n * 2);
    if (!d) { fprintf(stderr, "%s\n", cf_last_error()); exit(1); }
    gpu->act_from_f32(gpu, d, h, n);
    free(h);
    return d;
}
static void *dalloc(size_t bytes) {
    void *d = gpu->alloc(gpu, bytes);
    if (!d) { fprintf(stderr, "%s\n", cf_last_error()); exit(1); }
    return d;
}

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

enum { OP_FWD, OP_FULL, OP_CENTRIFUGE, OP_STRAWMAN };
static void run_op(bench_ctx *c, int op) {
    switch (op) {
    case OP_FWD: gpu->attention_fwd(gpu, c->out, c->lse, c->q, c->k, c->v, &c->s); break;
    case OP_FULL:
        gpu->attention_bwd(gpu, c->dq, c->dk, c->dv, c->dout, c->q, c->k, c->v, c->out, c->lse, &c->s, NULL,
                           CF_ATTN_BWD_FULL);
        break;
    case OP_CENTRIFUGE:
        gpu->attention_bwd(gpu, c->dqc, c->dkc, c->dvc, c->doutc, c->qc, c->k, c->v, c->outc, c->lsec, &c->s,
                           &c->kept, CF_ATTN_BWD_CENTRIFUGE);
        break;
    case OP_STRAWMAN:
        gpu->attention_bwd(gpu, c->dqc, c->dkc, c->dvc, c->doutc, c->qc, c->k, c->v, c->outc, c->lsec, &c->s,
                           &c->kept, CF_ATTN_BWD_STRAWMAN);
        break;
    }
}

static float time_op(bench_ctx *c, int op) {
    enum { WARM = 3, REPS = 20 };
    cudaStream_t st = ((cf_cuda_ctx *)gpu->device_context(gpu))->stream;
    for (int i = 0; i < WARM; i++) run_op(c, op);
    if (gpu->synchronize(gpu) != 0) {
        fprintf(stderr, "%s\n", cf_last_error());
        exit(1);
    }
    /* an event pair per run; sync: each run waited for before the next one */
    float ms[REPS];
    cudaEvent_t ev[2 * REPS];
    for (int i = 0; i < 2 * REPS; i++) CK(cudaEventCreate(&ev[i]));
    for (int i = 0; i < REPS; i++) {
        CK(cudaEventRecord(ev[2 * i], st));
        run_op(c, op);
        CK(cudaEventRecord(ev[2 * i + 1], st));
        if (g_sync_each) CK(cudaEventSynchronize(ev[2 * i + 1]));
    }
    CK(cudaEventSynchronize(ev[2 * REPS - 1]));
    for (int i = 0; i < REPS; i++) CK(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
    for (int i = 0; i < 2 * REPS; i++) CK(cudaEventDestroy(ev[i]));
    qsort(ms, REPS, sizeof(float), cmp_float);
    return ms[REPS / 2];
}

static void bench(int B, int S, int H, int Hkv, int D) {
    cf_rng r;
    cf_rng_seed(&r, 1234);
    bench_ctx c;
    memset(&c, 0, sizeof c);
    const size_t T = (size_t)B * S;
    c.s = (cf_attn_shape){B, S, H, Hkv, D, 1.0f / sqrtf((float)D), NULL};
    c.q = rand_act(T * H * D, &r);
    c.k = rand_act(T * Hkv * D, &r);
    c.v = rand_act(T * Hkv * D, &r);
    c.dout = rand_act(T * H * D, &r);
    c.out = dalloc(T * H * D * 2);
    c.lse = dalloc(T * H * 4);
    c.dq = dalloc(T * H * D * 2);
    c.dk = dalloc(T * Hkv * D * 2);
    c.dv = dalloc(T * Hkv * D * 2);

    /* keep exactly S/2 positions per sequence, at random */
    int *rows = malloc(T * sizeof(int)), *ss = malloc((B + 1) * sizeof(int)), *perm = malloc(S * sizeof(int));
    int n = 0;
    ss[0] = 0;
    for (int b = 0; b < B; b++) {
        for (int s = 0; s < S; s++) perm[s] = 0;
        int want = S / 2, got = 0;
        while (got < want) {
            int s = (int)cf_rng_below(&r, S);
            if (!perm[s]) { perm[s] = 1; got++; }
        }
        for (int s = 0; s < S; s++)
            if (perm[s]) rows[n++] = b * S + s;
        ss[b + 1] = n;
    }
    int *drows = dalloc((size_t)n * 4), *dss = dalloc((B + 1) * 4);
    gpu->upload(gpu, drows, rows, (size_t)n * 4);
    gpu->upload(gpu, dss, ss, (B + 1) * 4);
    c.kept = (cf_rows){n, S / 2, drows, dss}; /* every sequence keeps S/2 */
    run_op(&c, OP_FWD); /* out and lse for the backward inputs */
    c.qc = dalloc((size_t)n * H * D * 2);
    c.outc = dalloc((size_t)n * H * D * 2);
    c.doutc = dalloc((size_t)n * H * D * 2);
    c.lsec = dalloc((size_t)n * H * 4);
    c.dqc = dalloc((size_t)n * H * D * 2);
    c.dkc = dalloc((size_t)n * Hkv * D * 2);
    c.dvc = dalloc((size_t)n * Hkv * D * 2);
    gpu->gather_rows(gpu, c.qc, c.q, drows, n, (size_t)H * D * 2);
    gpu->gather_rows(gpu, c.outc, c.out, drows, n, (size_t)H * D * 2);
    gpu->gather_rows(gpu, c.doutc, c.dout, drows, n, (size_t)H * D * 2);
    gpu->gather_rows(gpu, c.lsec, c.lse, drows, n, (size_t)H * 4);

    const double fwd_flop = 4.0 * B * H * D * ((double)S * (S + 1) / 2);
    const float t_fwd = time_op(&c, OP_FWD);
    const float t_full = time_op(&c, OP_FULL);
    const float t_cf = time_op(&c, OP_CENTRIFUGE);
    const float t_sm = time_op(&c, OP_STRAWMAN);
    if (gpu->synchronize(gpu) != 0) { /* a failed op would time as a no-op */
        fprintf(stderr, "%s\n", cf_last_error());
        exit(1);
    }
    /* the commit the library was built at, so A/B timings of two builds name both */
    printf("B=%d S=%d H=%d Hkv=%d D=%d (keep %d/%d), build %s, timing %s\n", B, S, H, Hkv, D, n, (int)T,
           cf_build_commit(), g_sync_each ? "sync" : "queued");
    printf("  %-22s %8.3f ms  %6.1f TFLOP/s\n", "forward", t_fwd, fwd_flop / t_fwd / 1e9);
    printf("  %-22s %8.3f ms  %6.1f TFLOP/s\n", "backward full", t_full, 2.5 * fwd_flop / t_full / 1e9);
    printf("  %-22s %8.3f ms  %.3f x full\n", "backward centrifuge", t_cf, t_cf / t_full);
    printf("  %-22s %8.3f ms  %.3f x full\n", "backward strawman", t_sm, t_sm / t_full);
    fflush(stdout);

    void *bufs[] = {c.q, c.k, c.v, c.out, c.dout, c.dq, c.dk, c.dv, c.lse, c.qc, c.outc, c.doutc, c.lsec,
                    c.dqc, c.dkc, c.dvc, drows, dss};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) gpu->free(gpu, bufs[i]);
    free(rows);
    free(ss);
    free(perm);
}

int main(int argc, char **argv) {
    const char *paths_env = getenv("BENCH_ATTN_PATHS"), *timing = getenv("BENCH_ATTN_TIMING");
    if (timing && strcmp(timing, "sync") != 0 && strcmp(timing, "queued") != 0) {
        fprintf(stderr, "bench_attention: BENCH_ATTN_TIMING is queued or sync, got '%s'\n", timing);
        return 2;
    }
    g_sync_each = timing && !strcmp(timing, "sync");
    char paths[256];
    snprintf(paths, sizeof paths, "%s", paths_env ? paths_env : "auto portable");
    int S = argc > 1 ? atoi(argv[1]) : 4096;
    const int B = argc > 5 ? atoi(argv[5]) : 1;
    if (S < 2 || B < 1 || (argc > 4 && (atoi(argv[2]) < 1 || atoi(argv[3]) < 1 || atoi(argv[4]) < 1))) {
        fprintf(stderr, "usage: bench_attention [S [H Hkv D [B]]] (S >= 2, the others >= 1)\n");
        return 2;
    }
    for (char *save = NULL, *path = strtok_r(paths, " ,", &save); path; path = strtok_r(NULL, " ,", &save)) {
        setenv("CENTRIFUGE_ATTENTION", path, 1);
        gpu = cf_backend_cuda_create(0);
        if (!gpu) {
            fprintf(stderr, "%s\n", cf_last_error());
            return 1;
        }
        const cf_cuda_ctx *ctx = gpu->device_context(gpu);
        printf("device: GPU %d, %s (%d SMs); CENTRIFUGE_ATTENTION=%s\n", ctx->device, ctx->device_name,
               ctx->sm_count, path);
        if (argc > 4) {
            bench(B, S, atoi(argv[2]), atoi(argv[3]), atoi(argv[4]));
        } else {
            bench(1, S, 32, 4, 64);
            bench(1, S, 32, 8, 128);
        }
        printf("  (attention path taken: %s)\n", ctx->attn_path == 2 ? "hopper sm_90a" : "portable mma.sync");
        gpu->destroy(gpu);
    }
    return 0;
}
