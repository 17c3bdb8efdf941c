/*
 * comm_check.c — a multi-GPU check of src/dist/comm.c, one process per GPU,
 * started by a launcher (torchrun, srun, mpirun, or by hand with RANK /
 * WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE). Not part of the library build
 * (the Makefile compiles only the .c files directly in src/dist); build by hand:
 *
 *   gcc -std=c11 -D_GNU_SOURCE -O2 -DCF_WITH_CUDA -Iinclude -Isrc -I$CUDA/include \
 *       tests/gpu/dist/comm_check.c src/dist/launch.c src/dist/plan.c src/dist/comm.c \
 *       src/base/common.c -L$CUDA/lib64 -lnccl -lcudart -lm -o comm_check
 *
 *   comm_check ok      collectives, in-place ZeRO bucket reduce-scatter / all-gather, split
 *   comm_check dead    rank 1 exits after init; the others must fail within the timeout
 *   comm_check hang    rank 1 sleeps; the others must fail within the timeout
 *   comm_check init    (start rank 1 alone) init must fail within its timeout
 *   comm_check port    (rank 0 alone) a taken rendezvous port is reported
 * Exit status 0 = the expected outcome.
 */
#include <arpa/inet.h>
#include <cuda_runtime.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/common.h"
#include "dist/comm.h"
#include "dist/launch.h"
#include "dist/plan.h"

static int g_rank;
#define FAIL(...) do { fprintf(stderr, "rank %d: FAIL: ", g_rank); fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); return 1; } while (0)
#define CK(call) do { if ((call) != 0) FAIL("%s: %s", #call, cf_last_error()); } while (0)
#define CU(call) do { cudaError_t e_ = (call); if (e_ != cudaSuccess) FAIL("%s: %s", #call, cudaGetErrorString(e_)); } while (0)

static int check_ok(cf_comm *c, void *stream) {
    const int W = cf_comm_size(c), R = cf_comm_rank(c);
    const size_t n = 1000;
    /* all_reduce: f32 / f64 / i64 sum, i32 / u8 max, f32 min, in place and not */
    float *hf = malloc(n * sizeof(float)), *df;
    double hd[3], *dd;
    int32_t hi[2], *di;
    uint8_t hu[3], *du;
    int64_t hl[2], *dl;
    CU(cudaMalloc((void **)&df, 2 * n * sizeof(float)));
    CU(cudaMalloc((void **)&dd, sizeof hd));
    CU(cudaMalloc((void **)&di, sizeof hi));
    CU(cudaMalloc((void **)&du, sizeof hu));
    CU(cudaMalloc((void **)&dl, sizeof hl));
    for (size_t i = 0; i < n; i++) hf[i] = (float)(R + 1) + (float)i;
    for (int k = 0; k < 3; k++) hd[k] = 0.25 * (R + 1) + k;
    hi[0] = 10 * R; hi[1] = -R;
    hu[0] = (uint8_t)(R * 3); hu[1] = 7; hu[2] = (uint8_t)(R == W - 1 ? 200 : 1);
    hl[0] = ((int64_t)1 << 40) * (R + 1); hl[1] = R;
    CU(cudaMemcpy(df, hf, n * sizeof(float), cudaMemcpyHostToDevice));
    CU(cudaMemcpy(dd, hd, sizeof hd, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(di, hi, sizeof hi, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(du, hu, sizeof hu, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(dl, hl, sizeof hl, cudaMemcpyHostToDevice));
    CK(cf_comm_all_reduce(c, df, df + n, n, CF_COMM_F32, CF_COMM_SUM, stream));
    CK(cf_comm_all_reduce(c, df, df, n, CF_COMM_F32, CF_COMM_MIN, stream));
    CK(cf_comm_all_reduce(c, dd, dd, 3, CF_COMM_F64, CF_COMM_SUM, stream));
    CK(cf_comm_all_reduce(c, di, di, 2, CF_COMM_I32, CF_COMM_MAX, stream));
    CK(cf_comm_all_reduce(c, du, du, 3, CF_COMM_U8, CF_COMM_MAX, stream));
    CK(cf_comm_all_reduce(c, dl, dl, 2, CF_COMM_I64, CF_COMM_SUM, stream));
    CK(cf_comm_wait(c, stream, 60));
    float *sum = malloc(n * sizeof(float));
    CU(cudaMemcpy(sum, df + n, n * sizeof(float), cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(hf, df, n * sizeof(float), cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(hd, dd, sizeof hd, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(hi, di, sizeof hi, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(hu, du, sizeof hu, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(hl, dl, sizeof hl, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++) {
        if (sum[i] != (float)(W * (W + 1) / 2) + (float)(W * i)) FAIL("f32 sum [%zu] = %g", i, sum[i]);
        if (hf[i] != 1.0f + (float)i) FAIL("f32 min [%zu] = %g", i, hf[i]);
    }
    for (int k = 0; k < 3; k++)
        if (hd[k] != 0.25 * W * (W + 1) / 2 + (double)k * W) FAIL("f64 sum [%d] = %g", k, hd[k]);
    if (hi[0] != 10 * (W - 1) || hi[1] != 0) FAIL("i32 max = %d %d", hi[0], hi[1]);
    if (hu[0] != 3 * (W - 1) || hu[1] != 7 || hu[2] != 200) FAIL("u8 max = %d %d %d", hu[0], hu[1], hu[2]);
    if (hl[0] != ((int64_t)1 << 40) * W * (W + 1) / 2 || hl[1] != (int64_t)W * (W - 1) / 2) FAIL("i64 sum");
    printf("rank %d: all_reduce f32/f64/i32/u8/i64 sum/max/min ok\n", R);

    /* ZeRO buckets: reduce-scatter in place in one group, then all-gather in place */
    int64_t numel[6] = {1000, 37, 4096, 5, 777, 64};
    int key[6] = {-1, 0, 0, 1, 2, 2};
    cf_zero_plan p;
    CK(cf_zero_plan_build(&p, numel, key, 6, W, 8));
    float *g = malloc((size_t)p.total * sizeof(float)), *dg;
    CU(cudaMalloc((void **)&dg, (size_t)p.total * sizeof(float)));
    for (int64_t i = 0; i < p.total; i++) g[i] = (float)(R + 1) * (float)(i % 13);
    CU(cudaMemcpy(dg, g, (size_t)p.total * sizeof(float), cudaMemcpyHostToDevice));
    CK(cf_comm_group_begin(c));
    for (int b = 0; b < p.num_buckets; b++) {
        int64_t fs, ls, len;
        cf_zero_plan_slice(&p, R, b, &fs, &ls, &len);
        CK(cf_comm_reduce_scatter_f32(c, dg + p.buckets[b].start, dg + fs, (size_t)len, stream));
    }
    CK(cf_comm_group_end(c));
    CK(cf_comm_wait(c, stream, 60));
    CU(cudaMemcpy(g, dg, (size_t)p.total * sizeof(float), cudaMemcpyDeviceToHost));
    for (int b = 0; b < p.num_buckets; b++) {
        int64_t fs, ls, len;
        cf_zero_plan_slice(&p, R, b, &fs, &ls, &len);
        for (int64_t i = fs; i < fs + len; i++)
            if (g[i] != (float)(W * (W + 1) / 2) * (float)(i % 13)) FAIL("reduce_scatter [%lld] = %g", (long long)i, g[i]);
    }
    /* own slices := owner * 100000 + i; gather f32 and bf16 (as raw 16-bit words) */
    uint16_t *h16 = malloc((size_t)p.total * 2), *d16;
    CU(cudaMalloc((void **)&d16, (size_t)p.total * 2));
    for (int64_t i = 0; i < p.total; i++) { g[i] = -1; h16[i] = 0xffff; }
    for (int b = 0; b < p.num_buckets; b++) {
        int64_t fs, ls, len;
        cf_zero_plan_slice(&p, R, b, &fs, &ls, &len);
        for (int64_t i = fs; i < fs + len; i++) { g[i] = (float)(R * 100000 + i); h16[i] = (uint16_t)(R * 1000 + i % 1000); }
    }
    CU(cudaMemcpy(dg, g, (size_t)p.total * sizeof(float), cudaMemcpyHostToDevice));
    CU(cudaMemcpy(d16, h16, (size_t)p.total * 2, cudaMemcpyHostToDevice));
    for (int b = 0; b < p.num_buckets; b++) {
        CK(cf_comm_all_gather(c, dg + p.buckets[b].start, (size_t)p.buckets[b].shard_len, CF_COMM_F32, stream));
        CK(cf_comm_all_gather(c, d16 + p.buckets[b].start, (size_t)p.buckets[b].shard_len, CF_COMM_BF16, stream));
    }
    CK(cf_comm_wait(c, stream, 60));
    CU(cudaMemcpy(g, dg, (size_t)p.total * sizeof(float), cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(h16, d16, (size_t)p.total * 2, cudaMemcpyDeviceToHost));
    for (int b = 0; b < p.num_buckets; b++)
        for (int r = 0; r < W; r++) {
            int64_t fs, ls, len;
            cf_zero_plan_slice(&p, r, b, &fs, &ls, &len);
            for (int64_t i = fs; i < fs + len; i++) {
                if (g[i] != (float)(r * 100000 + i)) FAIL("all_gather f32 [%lld] = %g", (long long)i, g[i]);
                if (h16[i] != (uint16_t)(r * 1000 + i % 1000)) FAIL("all_gather bf16 [%lld] = %u", (long long)i, h16[i]);
            }
        }
    printf("rank %d: ZeRO plan (%d buckets, %lld elements): grouped in-place reduce_scatter and f32/bf16 all_gather ok\n",
           R, p.num_buckets, (long long)p.total);

    /* broadcast from the last rank */
    for (size_t i = 0; i < n; i++) hf[i] = R == W - 1 ? 42.0f + (float)i : 0.0f;
    CU(cudaMemcpy(df, hf, n * sizeof(float), cudaMemcpyHostToDevice));
    CK(cf_comm_broadcast(c, df, df, n, CF_COMM_F32, W - 1, stream));
    CK(cf_comm_wait(c, stream, 60));
    CU(cudaMemcpy(hf, df, n * sizeof(float), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++)
        if (hf[i] != 42.0f + (float)i) FAIL("broadcast [%zu] = %g", i, hf[i]);
    printf("rank %d: broadcast ok\n", R);

    /* split: one group per rank parity; then rank 0 alone with the others NOCOLOR */
    cf_comm *sub = NULL, *solo = NULL;
    CK(cf_comm_split(c, R % 2, R, &sub, 60));
    if (!sub || cf_comm_size(sub) != (W - R % 2 + 1) / 2 || cf_comm_rank(sub) != R / 2)
        FAIL("split gave %d of %d", sub ? cf_comm_rank(sub) : -1, sub ? cf_comm_size(sub) : -1);
    hd[0] = 1.0;
    CU(cudaMemcpy(dd, hd, sizeof(double), cudaMemcpyHostToDevice));
    CK(cf_comm_all_reduce(sub, dd, dd, 1, CF_COMM_F64, CF_COMM_SUM, stream));
    CK(cf_comm_wait(sub, stream, 60));
    CU(cudaMemcpy(hd, dd, sizeof(double), cudaMemcpyDeviceToHost));
    if (hd[0] != (double)cf_comm_size(sub)) FAIL("sub all_reduce = %g", hd[0]);
    CK(cf_comm_split(c, R == 0 ? 0 : -1, 0, &solo, 60));
    if ((R == 0) != (solo != NULL)) FAIL("NOCOLOR split");
    if (solo && cf_comm_size(solo) != 1) FAIL("solo size %d", cf_comm_size(solo));
    cf_comm_destroy(solo);
    cf_comm_destroy(sub);
    printf("rank %d: split (color, NOCOLOR) ok\n", R);

    /* bandwidth of a 1 GiB f32 all_reduce, for the record */
    size_t big = (size_t)1 << 28;
    float *db;
    CU(cudaMalloc((void **)&db, big * sizeof(float)));
    CU(cudaMemset(db, 0, big * sizeof(float)));
    CK(cf_comm_all_reduce(c, db, db, big, CF_COMM_F32, CF_COMM_SUM, stream));
    CK(cf_comm_wait(c, stream, 60));
    double t0 = cf_now();
    for (int it = 0; it < 5; it++) CK(cf_comm_all_reduce(c, db, db, big, CF_COMM_F32, CF_COMM_SUM, stream));
    CK(cf_comm_wait(c, stream, 60));
    double dt = (cf_now() - t0) / 5;
    if (R == 0)
        printf("rank 0: all_reduce 1 GiB f32: %.2f ms, bus bandwidth %.0f GB/s\n", dt * 1e3,
               2.0 * (W - 1) / W * big * 4 / dt / 1e9);
    cudaFree(db);
    cudaFree(dg); cudaFree(d16); cudaFree(df); cudaFree(dd); cudaFree(di); cudaFree(du); cudaFree(dl);
    free(g); free(h16); free(hf); free(sum);
    cf_zero_plan_free(&p);
    return 0;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "ok";
    double timeout = argc > 2 ? atof(argv[2]) : 20;
    cf_dist_env env;
    if (cf_dist_env_parse(&env, NULL) != 0) { fprintf(stderr, "env: %s\n", cf_last_error()); return 1; }
    g_rank = env.rank;
    char desc[512];
    printf("%s\n", cf_dist_env_describe(&env, desc, sizeof desc));
    int ngpu = 0, dev = -1;
    if (cudaGetDeviceCount(&ngpu) != cudaSuccess) ngpu = 0;
    if (cf_dist_pick_device(&env, ngpu, &dev) != 0) { fprintf(stderr, "%s\n", cf_last_error()); return 1; }

    if (strcmp(mode, "port") == 0) {   /* hold the rendezvous port, then init as rank 0 */
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {0};
        a.sin_family = AF_INET;
        a.sin_port = htons((uint16_t)(env.master_port + 1));
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 || listen(fd, 1) != 0) { perror("bind"); return 1; }
        cf_comm *c = NULL;
        double t0 = cf_now();
        int rc = cf_comm_init(&c, &env, dev, timeout);
        printf("rank 0: init with the port taken: rc %d after %.2f s: %s\n", rc, cf_now() - t0, cf_last_error());
        close(fd);
        return rc == -1 && strstr(cf_last_error(), "in use") ? 0 : 1;
    }

    cf_comm *c = NULL;
    double t0 = cf_now();
    int rc = cf_comm_init(&c, &env, dev, timeout);
    if (strcmp(mode, "init") == 0) {
        printf("rank %d: init without rank 0: rc %d after %.2f s: %s\n", env.rank, rc, cf_now() - t0, cf_last_error());
        return rc == -1 ? 0 : 1;
    }
    if (rc != 0) { fprintf(stderr, "init: %s\n", cf_last_error()); return 1; }
    printf("rank %d: communicator of %d ready in %.2f s on GPU %d (NCCL_COMM_ID=%s)\n", env.rank, cf_comm_size(c),
           cf_now() - t0, dev, getenv("NCCL_COMM_ID"));
    cudaStream_t s;
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) return 1;

    if (strcmp(mode, "ok") == 0) {
        if (check_ok(c, s) != 0) return 1;
        cf_comm_destroy(c);
        printf("rank %d: ALL OK\n", env.rank);
        return 0;
    }
    /* dead / hang: one all_reduce that everyone finishes, then rank 1 leaves */
    float *d;
    if (cudaMalloc((void **)&d, 1 << 20) != cudaSuccess) return 1;
    if (cf_comm_all_reduce(c, d, d, 1 << 18, CF_COMM_F32, CF_COMM_SUM, s) != 0 || cf_comm_wait(c, s, 60) != 0) {
        fprintf(stderr, "warm-up: %s\n", cf_last_error());
        return 1;
    }
    if (env.rank == 1) {
        if (strcmp(mode, "dead") == 0) { printf("rank 1: exiting without a word\n"); fflush(stdout); _exit(3); }
        printf("rank 1: hanging for 45 s\n");
        fflush(stdout);
        sleep(45);
        return 0;
    }
    t0 = cf_now();
    rc = cf_comm_all_reduce(c, d, d, 1 << 18, CF_COMM_F32, CF_COMM_SUM, s);
    if (rc == 0) rc = cf_comm_wait(c, s, timeout);
    double waited = cf_now() - t0;
    printf("rank %d: collective with a %s peer: rc %d after %.2f s: %s\n", env.rank, mode, rc, waited, cf_last_error());
    fflush(stdout);
    int aborted = cf_comm_aborted(c);
    t0 = cf_now();
    cf_comm_destroy(c);
    printf("rank %d: communicator aborted: %d; destroy took %.2f s\n", env.rank, aborted, cf_now() - t0);
    return rc == -1 && waited < timeout + 10 ? 0 : 1;
}
