/*
 * test_gpu_ops.c — every op of the CUDA backend against the CPU backend
 * (the fp32 reference), through the backend interface.
 *
 * Method. Inputs are fresh random numbers rounded to bf16 on the host, so
 * both backends see the same values; the CPU backend gets them as fp32, the
 * CUDA backend as bf16 (act) or fp32 (statistics, gradients, master
 * weights). Every output of the CUDA op is poisoned with NaN first, so an
 * element it does not write fails the comparison. Errors are per tensor,
 *   rel = max |gpu - cpu| / max |cpu|        (rel_err in test.h)
 * with no floor: a reference that is all zero fails the test (it would
 * accept an all-zero result), and each op states its tolerance:
 *   - bf16 outputs of fp32 math: one bf16 rounding (2^-9 = 2e-3 relative),
 *     plus bf16 intermediates where the kernel has them  -> 1e-2
 *   - fp32 gradients accumulated over bf16 products     -> 2e-2
 *   - pure copies and fp32-only ops                      -> exact or 1e-6
 * Attention gradients go through bf16 P and dS tiles inside the kernel:
 * 2e-2 against the fp32 reference.
 *
 * Needs a CUDA device: `make test-gpu`.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cuda/context.h"
#include "backend/dropout_mask.h"
#include "base/common.h"
#include "test.h"

static cf_backend *cpu, *gpu;
/* A second context on the same GPU created with CENTRIFUGE_ATTENTION=portable:
 * the mma.sync attention kernels, to cross-check the Hopper ones (NULL where
 * gpu itself runs the portable kernels). */
static cf_backend *gpu_port;
static cf_rng rng;

#define TOL_BF16 1e-2   /* bf16 output of fp32 math                    */
#define TOL_GRAD 2e-2   /* fp32 gradient accumulated from bf16 inputs  */

/* ------------------------------------------------------------ host helpers */

static float bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return f;
    u += 0x7fffu + ((u >> 16) & 1u);
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

static float *hnew(size_t n) {
    float *p = calloc(n ? n : 1, sizeof(float));
    if (!p) abort();
    return p;
}
static int *inew(size_t n) {
    int *p = calloc(n ? n : 1, sizeof(int));
    if (!p) abort();
    return p;
}
/* normal(0, sd), rounded to bf16 */
static float *hrand(size_t n, float sd) {
    float *p = hnew(n);
    for (size_t i = 0; i < n; i++) p[i] = bf16_round(sd * cf_rng_normal(&rng));
    return p;
}
static float *hcopy(const float *a, size_t n) {
    float *p = hnew(n);
    memcpy(p, a, n * sizeof(float));
    return p;
}
static void hround(float *a, size_t n) {
    for (size_t i = 0; i < n; i++) a[i] = bf16_round(a[i]);
}

/* Host arrays of one test, freed together. */
#define MAXH 256
static void *hlist[MAXH];
static int nh;
static void *hkeep(void *p) {
    if (nh < MAXH) hlist[nh++] = p;
    return p;
}
#define HOLD(x) hkeep(x)

/* --------------------------------------------------------- device helpers */

#define MAXG 256
static void *glist[MAXG];
static int ng;
static void *galloc(size_t bytes) {
    void *p = gpu->alloc(gpu, bytes);
    if (!p) {
        printf("    gpu alloc of %zu bytes failed: %s\n", bytes, cf_last_error());
        exit(1);
    }
    if (ng < MAXG) glist[ng++] = p;
    return p;
}
static void free_all(void) {
    for (int i = 0; i < ng; i++) gpu->free(gpu, glist[i]);
    ng = 0;
    for (int i = 0; i < nh; i++) free(hlist[i]);
    nh = 0;
}
/* bf16 activation copy of host fp32 */
static void *gact(const float *h, size_t n) {
    void *p = galloc(n * 2 + 16);
    gpu->act_from_f32(gpu, p, h, n);
    return p;
}
static void *gf32(const float *h, size_t n) {
    void *p = galloc(n * 4 + 16);
    gpu->upload(gpu, p, h, n * 4);
    return p;
}
static void *gi32(const int *h, size_t n) {
    void *p = galloc(n * 4 + 16);
    gpu->upload(gpu, p, h, n * 4);
    return p;
}
/* NaN-poisoned outputs */
static void *gact_nan(size_t n) {
    float *h = hnew(n);
    for (size_t i = 0; i < n; i++) h[i] = NAN;
    void *p = gact(h, n);
    free(h);
    return p;
}
static void *gf32_nan(size_t n) {
    float *h = hnew(n);
    for (size_t i = 0; i < n; i++) h[i] = NAN;
    void *p = gf32(h, n);
    free(h);
    return p;
}
static float *get_act(const void *p, size_t n) {
    float *h = HOLD(hnew(n));
    gpu->act_to_f32(gpu, h, p, n);
    return h;
}
static float *get_f32(const void *p, size_t n) {
    float *h = HOLD(hnew(n));
    gpu->download(gpu, h, p, n * 4);
    return h;
}

static double max_abs(const float *a, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = fmax(m, fabs(a[i]));
    return m;
}

/* compare one tensor and report; returns the error */
static double cmp(const char *what, const float *g, const float *c, size_t n, double tol) {
    double e = rel_err(g, c, n);
    printf("    %-60s rel err %.2e (tol %.0e)\n", what, e, tol);
    CHECK_MSG(e <= tol, "%s: rel err %.3e > %.1e", what, e, tol);
    CHECK_MSG(max_abs(c, n) > 0, "%s: the reference is all zero", what);
    return e;
}
static int bitwise_equal(const float *a, const float *b, size_t n) { return memcmp(a, b, n * sizeof(float)) == 0; }

/* =================================================================== ops */

/* embedding fwd is a copy of bf16 values: exact. */
TEST(embedding_fwd_copies_rows_exactly) {
    const int V = 97, T = 131;
    const int Cs[2] = {264, 30}; /* 16-byte path, scalar path */
    for (int ci = 0; ci < 2; ci++) {
        const int C = Cs[ci];
        float *wte = HOLD(hrand((size_t)V * C, 1.f));
        int *tok = HOLD(inew(T));
        for (int t = 0; t < T; t++) tok[t] = (int)cf_rng_below(&rng, V);
        float *ref = HOLD(hnew((size_t)T * C));
        cpu->embedding_fwd(cpu, ref, tok, wte, T, C, 0, V);
        void *out = gact_nan((size_t)T * C);
        gpu->embedding_fwd(gpu, out, gi32(tok, T), gact(wte, (size_t)V * C), T, C, 0, V);
        cmp(ci ? "embedding_fwd C=30" : "embedding_fwd C=264", get_act(out, (size_t)T * C), ref, (size_t)T * C, 0);
    }
    free_all();
}

/* embedding bwd adds bf16 values into fp32 in row order on both backends:
 * bitwise identical to the CPU, and run to run. */
TEST(embedding_bwd_sums_repeated_tokens_in_row_order_bitwise) {
    const int V = 17, T = 300, C = 72;
    float *dout = HOLD(hrand((size_t)T * C, 1.f));
    float *dw0 = HOLD(hrand((size_t)V * C, 1.f));
    int *tok = HOLD(inew(T));
    for (int t = 0; t < T; t++) tok[t] = (int)cf_rng_below(&rng, V - 2); /* two rows untouched */
    float *ref = HOLD(hcopy(dw0, (size_t)V * C));
    cpu->embedding_bwd(cpu, ref, dout, tok, T, C, 0, V);
    void *gd = gact(dout, (size_t)T * C);
    void *gt = gi32(tok, T);
    void *gw = gf32(dw0, (size_t)V * C);
    gpu->embedding_bwd(gpu, gw, gd, gt, T, C, 0, V);
    float *r1 = get_f32(gw, (size_t)V * C);
    cmp("embedding_bwd dwte", r1, ref, (size_t)V * C, 0);
    CHECK(bitwise_equal(r1, ref, (size_t)V * C));
    gpu->upload(gpu, gw, dw0, (size_t)V * C * 4);
    gpu->embedding_bwd(gpu, gw, gd, gt, T, C, 0, V);
    CHECK(bitwise_equal(get_f32(gw, (size_t)V * C), r1, (size_t)V * C));
    free_all();
}

/* The residual add in the GEMM's epilogue: out = resid + x W^T (+ bias),
 * into a separate buffer and in place over the residual, against the CPU. */
TEST(matmul_fwd_residual_matches_cpu_in_place_and_not) {
    const int T = 77, K = 96, N = 136;
    float *x = HOLD(hrand((size_t)T * K, 1.f)), *w = HOLD(hrand((size_t)N * K, 0.1f)), *bias = HOLD(hrand(N, 1.f));
    float *res = HOLD(hrand((size_t)T * N, 2.f));
    for (int v = 0; v < 4; v++) {
        const int wb = v & 1, in_place = v >> 1;
        float *ref = HOLD(hnew((size_t)T * N));
        cpu->matmul_fwd_residual(cpu, ref, x, w, wb ? bias : NULL, res, T, K, N);
        void *gres = gact(res, (size_t)T * N), *out = in_place ? gres : gact_nan((size_t)T * N);
        gpu->matmul_fwd_residual(gpu, out, gact(x, (size_t)T * K), gact(w, (size_t)N * K), wb ? gact(bias, N) : NULL,
                                 gres, T, K, N);
        cmp(in_place ? (wb ? "matmul_fwd_residual in place +bias" : "matmul_fwd_residual in place")
                     : (wb ? "matmul_fwd_residual +bias" : "matmul_fwd_residual"),
            get_act(out, (size_t)T * N), ref, (size_t)T * N, TOL_BF16);
    }
    free_all();
}

/* matmul fwd: bf16 output of an fp32-accumulated product: 1e-2. */
TEST(matmul_fwd_matches_cpu_with_and_without_bias) {
    const int T = 77, K = 96, N = 136;
    float *x = HOLD(hrand((size_t)T * K, 1.f)), *w = HOLD(hrand((size_t)N * K, 0.1f)), *bias = HOLD(hrand(N, 1.f));
    for (int wb = 0; wb < 2; wb++) {
        float *ref = HOLD(hnew((size_t)T * N));
        cpu->matmul_fwd(cpu, ref, x, w, wb ? bias : NULL, T, K, N);
        void *out = gact_nan((size_t)T * N);
        gpu->matmul_fwd(gpu, out, gact(x, (size_t)T * K), gact(w, (size_t)N * K), wb ? gact(bias, N) : NULL, T, K, N);
        cmp(wb ? "matmul_fwd +bias" : "matmul_fwd", get_act(out, (size_t)T * N), ref, (size_t)T * N, TOL_BF16);
    }
    free_all();
}

/* matmul bwd: dinp bf16 (1e-2; accumulate adds a second bf16 rounding),
 * dW and dbias fp32 accumulated onto random initial values (2e-2). */
TEST(matmul_bwd_matches_cpu_dinp_dw_dbias_and_accumulate) {
    const int T = 77, K = 96, N = 136;
    float *x = HOLD(hrand((size_t)T * K, 1.f)), *w = HOLD(hrand((size_t)N * K, 0.1f)), *dy = HOLD(hrand((size_t)T * N, 1.f));
    float *dx0 = HOLD(hrand((size_t)T * K, 1.f)), *dw0 = HOLD(hrand((size_t)N * K, 1.f)), *db0 = HOLD(hrand(N, 1.f));
    void *gx = gact(x, (size_t)T * K), *gw = gact(w, (size_t)N * K), *gdy = gact(dy, (size_t)T * N);
    for (int acc = 0; acc < 2; acc++) {
        float *rdx = HOLD(hcopy(dx0, (size_t)T * K)), *rdw = HOLD(hcopy(dw0, (size_t)N * K)), *rdb = HOLD(hcopy(db0, N));
        cpu->matmul_bwd(cpu, rdx, rdw, rdb, dy, x, w, T, K, N, acc);
        void *gdx = acc ? gact(dx0, (size_t)T * K) : gact_nan((size_t)T * K);
        void *gdw = gf32(dw0, (size_t)N * K), *gdb = gf32(db0, N);
        gpu->matmul_bwd(gpu, gdx, gdw, gdb, gdy, gx, gw, T, K, N, acc);
        cmp(acc ? "matmul_bwd dinp (accumulate)" : "matmul_bwd dinp", get_act(gdx, (size_t)T * K), rdx,
            (size_t)T * K, TOL_BF16);
        cmp("matmul_bwd dW += (fp32)", get_f32(gdw, (size_t)N * K), rdw, (size_t)N * K, TOL_GRAD);
        cmp("matmul_bwd dbias += (fp32)", get_f32(gdb, N), rdb, N, TOL_GRAD);
    }
    /* NULL dinp and dbias are skipped */
    float *rdw = HOLD(hcopy(dw0, (size_t)N * K));
    cpu->matmul_bwd(cpu, NULL, rdw, NULL, dy, x, w, T, K, N, 0);
    void *gdw = gf32(dw0, (size_t)N * K);
    gpu->matmul_bwd(gpu, NULL, gdw, NULL, gdy, gx, gw, T, K, N, 0);
    cmp("matmul_bwd dW only", get_f32(gdw, (size_t)N * K), rdw, (size_t)N * K, TOL_GRAD);
    /* CF_MM_DW_SET: dW written without being read (NaN before) = the CPU's
     * dW accumulated onto zeros */
    float *rdz = HOLD(hnew((size_t)N * K));
    cpu->matmul_bwd(cpu, NULL, rdz, NULL, dy, x, w, T, K, N, 0);
    void *gdn = gf32_nan((size_t)N * K);
    gpu->matmul_bwd(gpu, NULL, gdn, NULL, gdy, gx, gw, T, K, N, CF_MM_DW_SET);
    cmp("matmul_bwd dW = (CF_MM_DW_SET)", get_f32(gdn, (size_t)N * K), rdz, (size_t)N * K, TOL_GRAD);
    /* no rows: CF_MM_DW_SET writes zeros over NaN (a STALE gradient's first
     * writer must overwrite it, backend.h), += leaves dW and dbias as they were */
    void *gdz = gf32_nan((size_t)N * K), *gd0 = gf32(dw0, (size_t)N * K), *gb0 = gf32(db0, N);
    gpu->matmul_bwd(gpu, NULL, gdz, NULL, gdy, gx, gw, 0, K, N, CF_MM_DW_SET);
    gpu->matmul_bwd(gpu, NULL, gd0, gb0, gdy, gx, gw, 0, K, N, 0);
    const float *z = get_f32(gdz, (size_t)N * K);
    int zeros = 1;
    for (size_t i = 0; i < (size_t)N * K; i++) zeros &= z[i] == 0.0f;
    CHECK_MSG(zeros, "matmul_bwd dW = over no rows is not zeros");
    CHECK_MSG(bitwise_equal(get_f32(gd0, (size_t)N * K), dw0, (size_t)N * K) && bitwise_equal(get_f32(gb0, N), db0, N),
              "matmul_bwd += over no rows changed dW or dbias");
    free_all();
}

/* rmsnorm: out bf16 (1e-2); rstd fp32 from identical inputs (1e-5);
 * dinp bf16 (1e-2), dw fp32 accumulated (2e-2). The widths reach every
 * forward kernel: rows in registers at 2, 8 and 16 packs per lane (256;
 * 1000 and 1536, partial packs; 3072), the two-pass 16-byte kernel (5120)
 * and the scalar one (36). */
static const int norm_widths[] = {256, 36, 1000, 1536, 3072, 5120};
#define NORM_WIDTHS ((int)(sizeof norm_widths / sizeof norm_widths[0]))
/* The TP path's residual add fused with the norm after it: the sum (bf16
 * rounded) and the norm of the rounded sum, against the CPU's add then
 * norm, on the 16-byte and scalar paths, and with the sum over a in place. */
TEST(add_rmsnorm_fwd_matches_cpu_vector_scalar_and_in_place) {
    const int T = 67;
    for (int ci = 0; ci < NORM_WIDTHS; ci++) {
        const int C = norm_widths[ci];
        float *x = HOLD(hrand((size_t)T * C, 2.f)), *y = HOLD(hrand((size_t)T * C, 1.f)), *w = HOLD(hrand(C, 1.f));
        float *rs = HOLD(hnew((size_t)T * C)), *ro = HOLD(hnew((size_t)T * C)), *rr = HOLD(hnew(T));
        cpu->add_rmsnorm_fwd(cpu, rs, ro, rr, x, y, w, T, C, 1e-5f);
        for (int in_place = 0; in_place < 2; in_place++) {
            void *ga = gact(x, (size_t)T * C), *gc = gact(y, (size_t)T * C), *gw = gact(w, C);
            void *gs = in_place ? ga : gact_nan((size_t)T * C), *go = gact_nan((size_t)T * C), *gr = gf32_nan(T);
            gpu->add_rmsnorm_fwd(gpu, gs, go, gr, ga, gc, gw, T, C, 1e-5f);
            printf("    C=%d%s\n", C, in_place ? ", sum over a" : "");
            cmp("add_rmsnorm_fwd sum", get_act(gs, (size_t)T * C), rs, (size_t)T * C, TOL_BF16);
            cmp("add_rmsnorm_fwd out", get_act(go, (size_t)T * C), ro, (size_t)T * C, TOL_BF16);
            cmp("add_rmsnorm_fwd rstd", get_f32(gr, T), rr, T, 2e-3); /* the sum is rounded on the GPU */
        }
    }
    free_all();
}

TEST(rmsnorm_fwd_bwd_match_cpu_vector_and_scalar_paths) {
    const int T = 67;
    for (int ci = 0; ci < NORM_WIDTHS; ci++) {
        const int C = norm_widths[ci];
        float *x = HOLD(hrand((size_t)T * C, 2.f)), *w = HOLD(hrand(C, 1.f)), *dy = HOLD(hrand((size_t)T * C, 1.f));
        float *dx0 = HOLD(hrand((size_t)T * C, 1.f)), *dw0 = HOLD(hrand(C, 1.f));
        float *ry = HOLD(hnew((size_t)T * C)), *rr = HOLD(hnew(T));
        cpu->rmsnorm_fwd(cpu, ry, rr, x, w, T, C, 1e-5f);
        void *gx = gact(x, (size_t)T * C), *gw = gact(w, C), *gdy = gact(dy, (size_t)T * C);
        void *gy = gact_nan((size_t)T * C), *gr = gf32_nan(T);
        gpu->rmsnorm_fwd(gpu, gy, gr, gx, gw, T, C, 1e-5f);
        printf("    C=%d\n", C);
        cmp("rmsnorm_fwd out", get_act(gy, (size_t)T * C), ry, (size_t)T * C, TOL_BF16);
        cmp("rmsnorm_fwd rstd", get_f32(gr, T), rr, T, 1e-5);
        for (int acc = 0; acc < 2; acc++) {
            float *rdx = HOLD(hcopy(dx0, (size_t)T * C)), *rdw = HOLD(hcopy(dw0, C));
            cpu->rmsnorm_bwd(cpu, rdx, rdw, dy, x, w, rr, NULL, T, C, acc);
            void *gdx = acc ? gact(dx0, (size_t)T * C) : gact_nan((size_t)T * C);
            void *gdw = gf32(dw0, C);
            gpu->rmsnorm_bwd(gpu, gdx, gdw, gdy, gx, gw, gf32(rr, T), NULL, T, C, acc);
            cmp(acc ? "rmsnorm_bwd dinp (accumulate)" : "rmsnorm_bwd dinp", get_act(gdx, (size_t)T * C), rdx,
                (size_t)T * C, TOL_BF16);
            cmp("rmsnorm_bwd dw +=", get_f32(gdw, C), rdw, C, TOL_GRAD);
        }
    }
    free_all();
}

/* a bf16 copy of h that starts 2 bytes past a 16-byte boundary: the kernels'
 * scalar fallback for a tensor whose shape would take the 16-byte path */
static void *gact_misaligned(const float *h, size_t n) {
    float *h1 = hnew(n + 1);
    memcpy(h1 + 1, h, n * sizeof(float));
    char *p = gact(h1, n + 1);
    free(h1);
    return p + 2;
}

/* The column sum of the bias gradient (matmul_bwd with dbias only) over
 * shapes that take the 16-byte path (N % 8 == 0, aligned), the scalar one
 * (N % 8 != 0, or dout misaligned), a partial last column block, one row
 * chunk (T = 1, 7) and many (T up to 5000: up to 256 chunks of rows). Both
 * backends add the same bf16 values in fp32, in different orders: 1e-4
 * relative (a lost or doubled row of ~1 against sums of ~sqrt(T) shows).
 * Twice from the same start: bitwise the same. */
TEST(colsum_dbias_matches_cpu_vector_scalar_and_row_chunks) {
    static const struct { int T, N, misalign; } cs[] = {
        {1, 256, 0}, {7, 100, 0}, {1000, 1536, 0}, {1000, 256, 0}, {1000, 100, 0},
        {333, 264, 1}, {4096, 40, 0}, {5000, 8, 0}, {2048, 1537, 0},
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        const int T = cs[i].T, N = cs[i].N;
        float *dy = HOLD(hrand((size_t)T * N, 1.f)), *db0 = HOLD(hrand(N, 1.f));
        float *ref = HOLD(hcopy(db0, N));
        cpu->matmul_bwd(cpu, NULL, NULL, ref, dy, NULL, NULL, T, 1, N, 0);
        void *gdy = cs[i].misalign ? gact_misaligned(dy, (size_t)T * N) : gact(dy, (size_t)T * N);
        float *got[2];
        for (int rep = 0; rep < 2; rep++) {
            void *gdb = gf32(db0, N);
            gpu->matmul_bwd(gpu, NULL, NULL, gdb, gdy, NULL, NULL, T, 1, N, 0);
            got[rep] = get_f32(gdb, N);
        }
        char what[96];
        snprintf(what, sizeof what, "colsum dbias += T=%d N=%d%s", T, N, cs[i].misalign ? " misaligned" : "");
        cmp(what, got[0], ref, N, 1e-4);
        CHECK_MSG(bitwise_equal(got[0], got[1], N), "%s: not run-to-run identical", what);
        free_all();
    }
}

/* rmsnorm backward with the weight gradient's partial sums fused in: the
 * model widths (C = 1536, 3072, and 1000: a last warp with idle threads;
 * the block-per-rows kernel, one to 18 rows per block; C = 6144: blocks of
 * 768 threads), C < 512 and
 * C % 256 != 0 (the warp-per-row kernel, lanes with fewer columns),
 * C % 8 != 0 and a misaligned dout (scalar path), C past the shared-memory
 * limit (dw by the separate column sum), T = 1, 7, T not a multiple of the
 * rows per block, T > 4096; dinp written and accumulated; dw NULL (a
 * frozen weight: dinp alone). dinp bf16: 1e-2. dw: the same fp32 products
 * summed in another order: 1e-4, and bitwise the same on a second run.
 * Each also with the input and rstd read through a row map (the filter
 * leaves them uncompacted): T scattered rows of 2T + 1, against the CPU
 * with the same map (every kernel path, the column-sum fallback's gather
 * included). */
TEST(rmsnorm_bwd_fused_dw_matches_cpu_shapes_chunks_null_dw_and_row_map) {
    static const struct { int T, C, misalign; } cs[] = {
        {1, 1536, 0}, {7, 3072, 0}, {1000, 1536, 0}, {1000, 3072, 0}, {1023, 1000, 0},
        {333, 1001, 0}, {1025, 264, 1}, {65, 13000, 0}, {4099, 128, 0}, {4500, 3072, 0}, {301, 6144, 0},
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        const int T = cs[i].T, C = cs[i].C, Tx = 2 * T + 1; /* rows of the input (and rstd) */
        float *x = HOLD(hrand((size_t)Tx * C, 2.f)), *w = HOLD(hrand(C, 1.f)), *dy = HOLD(hrand((size_t)T * C, 1.f));
        float *dx0 = HOLD(hrand((size_t)T * C, 1.f)), *dw0 = HOLD(hrand(C, 1.f));
        float *ry = HOLD(hnew((size_t)Tx * C)), *rr = HOLD(hnew(Tx));
        int *map = (int *)HOLD(malloc((size_t)T * sizeof(int)));
        for (int t = 0; t < T; t++) map[t] = 2 * t + (t % 3 == 0); /* ascending, as kept rows */
        cpu->rmsnorm_fwd(cpu, ry, rr, x, w, Tx, C, 1e-5f);
        void *gx = gact(x, (size_t)Tx * C), *gw = gact(w, C), *gr = gf32(rr, Tx), *gmap = gi32(map, T);
        void *gdy = cs[i].misalign ? gact_misaligned(dy, (size_t)T * C) : gact(dy, (size_t)T * C);
        printf("    T=%d C=%d%s\n", T, C, cs[i].misalign ? " (dout misaligned)" : "");
        for (int mapped = 0; mapped < 2; mapped++)
        for (int acc = 0; acc < 2; acc++)
            for (int with_dw = 0; with_dw < 2; with_dw++) {
                float *rdx = HOLD(hcopy(dx0, (size_t)T * C)), *rdw = HOLD(hcopy(dw0, C));
                cpu->rmsnorm_bwd(cpu, rdx, with_dw ? rdw : NULL, dy, x, w, rr, mapped ? map : NULL, T, C, acc);
                float *gdw1 = NULL;
                for (int rep = 0; rep < 1 + with_dw; rep++) {
                    void *gdx = acc ? gact(dx0, (size_t)T * C) : gact_nan((size_t)T * C);
                    void *gdw = with_dw ? gf32(dw0, C) : NULL;
                    gpu->rmsnorm_bwd(gpu, gdx, gdw, gdy, gx, gw, gr, mapped ? (const int *)gmap : NULL, T, C, acc);
                    if (rep) {
                        CHECK_MSG(bitwise_equal(get_f32(gdw, C), gdw1, C), "rmsnorm_bwd dw: not run-to-run identical");
                        continue;
                    }
                    char what[96];
                    snprintf(what, sizeof what, "rmsnorm_bwd dinp%s%s%s", acc ? " (accumulate)" : "",
                             with_dw ? "" : " (dw NULL)", mapped ? " (row map)" : "");
                    cmp(what, get_act(gdx, (size_t)T * C), rdx, (size_t)T * C, TOL_BF16);
                    if (with_dw) cmp("rmsnorm_bwd dw +=", gdw1 = get_f32(gdw, C), rdw, C, 1e-4);
                }
            }
        free_all();
    }
}

/* rope: in place, bf16 in and out, fp32 angles: 1e-2. Head dims 64 and
 * 128 (16-byte path), 36 (D/2 = 18: scalar) and a misaligned x (scalar);
 * one or many heads (Qwen's 12, Llama's 24); T = 1 and larger. */
TEST(rope_fwd_bwd_match_cpu) {
    static const struct { int T, nh, D, misalign; } cs[] = {
        {50, 3, 64, 0}, {37, 12, 128, 0}, {1, 24, 128, 0}, {300, 2, 128, 0}, {7, 2, 128, 1}, {9, 4, 36, 0}, {11, 5, 64, 1},
    };
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        const int T = cs[ci].T, nh = cs[ci].nh, D = cs[ci].D;
        const size_t n = (size_t)T * nh * D;
        float *x = HOLD(hrand(n, 1.f)), *invf = HOLD(hnew(D / 2));
        int *pos = HOLD(inew(T));
        for (int i = 0; i < D / 2; i++) invf[i] = powf(10000.f, -2.f * i / D);
        for (int t = 0; t < T; t++) pos[t] = (int)cf_rng_below(&rng, 4096);
        void *gp = gi32(pos, T), *gf = gf32(invf, D / 2);
        for (int dir = 0; dir < 2; dir++) {
            float *ref = HOLD(hcopy(x, n));
            if (dir) cpu->rope_bwd(cpu, ref, pos, invf, T, nh, D);
            else cpu->rope_fwd(cpu, ref, pos, invf, T, nh, D);
            void *gx = cs[ci].misalign ? gact_misaligned(x, n) : gact(x, n);
            if (dir) gpu->rope_bwd(gpu, gx, gp, gf, T, nh, D);
            else gpu->rope_fwd(gpu, gx, gp, gf, T, nh, D);
            char what[96];
            snprintf(what, sizeof what, "%s T=%d nh=%d D=%d%s", dir ? "rope_bwd" : "rope_fwd", T, nh, D,
                     cs[ci].misalign ? " misaligned" : "");
            cmp(what, get_act(gx, n), ref, n, TOL_BF16);
        }
        free_all();
    }
}

/* rope_qk: q and k (own rows, heads and positions) in one launch, against
 * the CPU's rope_fwd / rope_bwd of each: 1e-2. Either part empty; a
 * misaligned k (both parts take the scalar path); D/2 % 8 != 0. */
TEST(rope_qk_matches_cpu_rope_of_each_part) {
    static const struct { int Tq, Hq, Tk, Hk, D, misalign; } cs[] = {
        {50, 12, 80, 2, 128, 0}, {1, 24, 7, 8, 128, 0}, {33, 4, 0, 2, 64, 0},
        {0, 4, 9, 2, 64, 0}, {20, 3, 25, 1, 64, 1}, {9, 4, 5, 2, 36, 0},
    };
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        const int Tq = cs[ci].Tq, Hq = cs[ci].Hq, Tk = cs[ci].Tk, Hk = cs[ci].Hk, D = cs[ci].D;
        const size_t nq = (size_t)Tq * Hq * D, nk = (size_t)Tk * Hk * D;
        float *q = HOLD(hrand(nq, 1.f)), *k = HOLD(hrand(nk, 1.f)), *invf = HOLD(hnew(D / 2));
        int *qpos = HOLD(inew(Tq)), *kpos = HOLD(inew(Tk));
        for (int i = 0; i < D / 2; i++) invf[i] = powf(10000.f, -2.f * i / D);
        for (int t = 0; t < Tq; t++) qpos[t] = (int)cf_rng_below(&rng, 4096);
        for (int t = 0; t < Tk; t++) kpos[t] = (int)cf_rng_below(&rng, 4096);
        void *gqp = gi32(qpos, Tq), *gkp = gi32(kpos, Tk), *gf = gf32(invf, D / 2);
        for (int dir = 0; dir < 2; dir++) {
            float *rq = HOLD(hcopy(q, nq)), *rk = HOLD(hcopy(k, nk));
            if (dir) {
                cpu->rope_bwd(cpu, rq, qpos, invf, Tq, Hq, D);
                cpu->rope_bwd(cpu, rk, kpos, invf, Tk, Hk, D);
            } else {
                cpu->rope_fwd(cpu, rq, qpos, invf, Tq, Hq, D);
                cpu->rope_fwd(cpu, rk, kpos, invf, Tk, Hk, D);
            }
            void *gq = gact(q, nq), *gk = cs[ci].misalign ? gact_misaligned(k, nk) : gact(k, nk);
            gpu->rope_qk(gpu, gq, gqp, Tq, Hq, gk, gkp, Tk, Hk, gf, D, dir);
            char what[96];
            snprintf(what, sizeof what, "rope_qk %s q Tq=%d Hq=%d D=%d", dir ? "bwd" : "fwd", Tq, Hq, D);
            if (nq) cmp(what, get_act(gq, nq), rq, nq, TOL_BF16);
            snprintf(what, sizeof what, "rope_qk %s k Tk=%d Hk=%d%s", dir ? "bwd" : "fwd", Tk, Hk,
                     cs[ci].misalign ? " misaligned" : "");
            if (nk) cmp(what, get_act(gk, nk), rk, nk, TOL_BF16);
        }
        free_all();
    }
}

/* qkv_split_rope: the fused projection's [T, (Hq + 2 Hk) D] rows into q
 * and k rotated (1e-2, as rope) and v copied (exact), against the CPU op
 * (which test_ops checks against the split then rope_qk). The 16-byte path,
 * D/2 % 8 != 0 and a misaligned input (scalar paths); outputs NaN-poisoned. */
TEST(qkv_split_rope_matches_cpu) {
    static const struct { int T, Hq, Hk, D, misalign; } cs[] = {
        {50, 12, 2, 128, 0}, {7, 4, 4, 64, 0}, {9, 4, 2, 36, 0}, {20, 3, 1, 64, 1},
    };
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        const int T = cs[ci].T, Hq = cs[ci].Hq, Hk = cs[ci].Hk, D = cs[ci].D;
        const size_t n = (size_t)T * (Hq + 2 * Hk) * D, nq = (size_t)T * Hq * D, nk = (size_t)T * Hk * D;
        float *qkv = HOLD(hrand(n, 1.f)), *invf = HOLD(hnew(D / 2));
        float *rq = HOLD(hnew(nq)), *rk = HOLD(hnew(nk)), *rv = HOLD(hnew(nk));
        int *pos = HOLD(inew(T));
        for (int i = 0; i < D / 2; i++) invf[i] = powf(10000.f, -2.f * i / D);
        for (int t = 0; t < T; t++) pos[t] = (int)cf_rng_below(&rng, 4096);
        cpu->qkv_split_rope(cpu, rq, rk, rv, qkv, pos, T, Hq, Hk, invf, D);
        void *gx = cs[ci].misalign ? gact_misaligned(qkv, n) : gact(qkv, n);
        void *gq = gact_nan(nq), *gk = gact_nan(nk), *gv = gact_nan(nk);
        gpu->qkv_split_rope(gpu, gq, gk, gv, gx, gi32(pos, T), T, Hq, Hk, gf32(invf, D / 2), D);
        char what[96];
        snprintf(what, sizeof what, "qkv_split_rope q T=%d Hq=%d Hk=%d D=%d%s", T, Hq, Hk, D,
                 cs[ci].misalign ? " misaligned" : "");
        cmp(what, get_act(gq, nq), rq, nq, TOL_BF16);
        cmp("qkv_split_rope k", get_act(gk, nk), rk, nk, TOL_BF16);
        CHECK_MSG(bitwise_equal(get_act(gv, nk), rv, nk), "qkv_split_rope v: not an exact copy");
        free_all();
    }
}

/* qkv_join_rope_bwd: dq, dk (rotated back, 1e-2 as rope) and dv (an exact
 * copy) joined into the fused projection's [T, (Hq + 2 Hk) D] rows, against
 * the CPU op (which test_ops checks against rope_qk's backward then the
 * join). The 16-byte path, D/2 % 8 != 0 and a misaligned input (scalar
 * paths); the output NaN-poisoned. */
TEST(qkv_join_rope_bwd_matches_cpu) {
    static const struct { int T, Hq, Hk, D, misalign; } cs[] = {
        {50, 12, 2, 128, 0}, {7, 4, 4, 64, 0}, {9, 4, 2, 36, 0}, {20, 3, 1, 64, 1},
    };
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        const int T = cs[ci].T, Hq = cs[ci].Hq, Hk = cs[ci].Hk, D = cs[ci].D, W = (Hq + 2 * Hk) * D;
        const size_t n = (size_t)T * W, nq = (size_t)T * Hq * D, nk = (size_t)T * Hk * D;
        float *dq = HOLD(hrand(nq, 1.f)), *dk = HOLD(hrand(nk, 1.f)), *dv = HOLD(hrand(nk, 1.f));
        float *invf = HOLD(hnew(D / 2)), *want = HOLD(hnew(n));
        int *pos = HOLD(inew(T));
        for (int i = 0; i < D / 2; i++) invf[i] = powf(10000.f, -2.f * i / D);
        for (int t = 0; t < T; t++) pos[t] = (int)cf_rng_below(&rng, 4096);
        cpu->qkv_join_rope_bwd(cpu, want, dq, dk, dv, pos, T, Hq, Hk, invf, D);
        void *gq = cs[ci].misalign ? gact_misaligned(dq, nq) : gact(dq, nq), *gk = gact(dk, nk), *gv = gact(dv, nk);
        void *gx = gact_nan(n);
        gpu->qkv_join_rope_bwd(gpu, gx, gq, gk, gv, gi32(pos, T), T, Hq, Hk, gf32(invf, D / 2), D);
        float *got = get_act(gx, n);
        char what[96];
        snprintf(what, sizeof what, "qkv_join_rope_bwd T=%d Hq=%d Hk=%d D=%d%s", T, Hq, Hk, D,
                 cs[ci].misalign ? " misaligned" : "");
        cmp(what, got, want, n, TOL_BF16);
        int exact_v = 1; /* the dv columns of every row: copies */
        for (int t = 0; t < T; t++)
            exact_v &= bitwise_equal(got + (size_t)t * W + (size_t)(Hq + Hk) * D, want + (size_t)t * W + (size_t)(Hq + Hk) * D,
                                     (size_t)Hk * D);
        CHECK_MSG(exact_v, "qkv_join_rope_bwd dv: not an exact copy");
        free_all();
    }
}

/* swiglu_fwd and swiglu_bwd_rows with gate and up the halves of one
 * [T, 2F] matrix (ld_in = 2F, the fused gate/up GEMM's output): against
 * the CPU (1e-2), and bitwise what the GPU gives for two [T, F] matrices
 * on the same kernel path. 16-byte path (F = 1000; T = 37 and 301, not
 * multiples of the kernels' rows per thread), odd F and a misaligned
 * matrix (scalar paths). */
TEST(swiglu_with_gate_up_rows_2F_apart_matches_cpu_and_separate_matrices) {
    static const struct { int T, F, misalign; } cs[] = {{37, 1000, 0}, {37, 1001, 0}, {37, 1000, 1}, {301, 1536, 0}};
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        const int T = cs[ci].T, F = cs[ci].F;
        const size_t nf = (size_t)T * F, n2 = 2 * nf;
        float *gu = HOLD(hrand(n2, 2.f)), *dh = HOLD(hrand(nf, 1.f));
        float *g = HOLD(hnew(nf)), *u = HOLD(hnew(nf));
        for (int t = 0; t < T; t++) {
            memcpy(g + (size_t)t * F, gu + (size_t)t * 2 * F, F * sizeof(float));
            memcpy(u + (size_t)t * F, gu + (size_t)t * 2 * F + F, F * sizeof(float));
        }
        int *rows = (int *)HOLD(malloc((size_t)T * sizeof(int))), nr = 0;
        for (int t = 0; t < T; t++) if (t % 3) rows[nr++] = t;
        float *rh = HOLD(hnew(nf)), *rbh = HOLD(hnew(nf)), *rdg = HOLD(hnew(nf)), *rdu = HOLD(hnew(nf));
        cpu->swiglu_fwd(cpu, rh, gu, gu + F, T, F, 2 * F);
        cpu->swiglu_bwd_rows(cpu, rbh, rdg, rdu, dh, gu, gu + F, rows, nr, F, 2 * F, F);
        char *ggu = cs[ci].misalign ? gact_misaligned(gu, n2) : gact(gu, n2);
        void *gg = gact(g, nf), *gup = gact(u, nf), *gdh = gact(dh, nf), *grows = gi32(rows, nr);
        const size_t half = (size_t)F * 2;   /* bytes to the up half */
        void *gh = gact_nan(nf), *gh1 = gact_nan(nf);
        gpu->swiglu_fwd(gpu, gh, ggu, ggu + half, T, F, 2 * F);
        gpu->swiglu_fwd(gpu, gh1, gg, gup, T, F, F);
        void *gbh = gact_nan(nf), *gdg = gact_nan(nf), *gdu = gact_nan(nf);
        void *gbh1 = gact_nan(nf), *gdg1 = gact_nan(nf), *gdu1 = gact_nan(nf);
        gpu->swiglu_bwd_rows(gpu, gbh, gdg, gdu, gdh, ggu, ggu + half, grows, nr, F, 2 * F, F);
        gpu->swiglu_bwd_rows(gpu, gbh1, gdg1, gdu1, gdh, gg, gup, grows, nr, F, F, F);
        const size_t nb = (size_t)nr * F;
        printf("    T=%d F=%d%s\n", T, F, cs[ci].misalign ? " misaligned" : "");
        cmp("swiglu_fwd ld_in 2F", get_act(gh, nf), rh, nf, TOL_BF16);
        cmp("swiglu_bwd_rows ld_in 2F h", get_act(gbh, nb), rbh, nb, TOL_BF16);
        cmp("swiglu_bwd_rows ld_in 2F dgate", get_act(gdg, nb), rdg, nb, TOL_BF16);
        cmp("swiglu_bwd_rows ld_in 2F dup", get_act(gdu, nb), rdu, nb, TOL_BF16);
        /* the same kernel path (misaligned: scalar against 16-byte) */
        if (!cs[ci].misalign)
            CHECK_MSG(bitwise_equal(get_act(gh, nf), get_act(gh1, nf), nf) &&
                          bitwise_equal(get_act(gbh, nb), get_act(gbh1, nb), nb) &&
                          bitwise_equal(get_act(gdg, nb), get_act(gdg1, nb), nb) &&
                          bitwise_equal(get_act(gdu, nb), get_act(gdu1, nb), nb),
                      "F=%d: ld_in = 2F differs from separate matrices", F);
        free_all();
    }
}

/* swiglu: bf16 outputs of fp32 math: 1e-2. */
TEST(swiglu_fwd_bwd_match_cpu_vector_and_scalar_paths) {
    const size_t ns[2] = {1000, 1001};
    for (int k = 0; k < 2; k++) {
        const size_t n = ns[k];
        float *g = HOLD(hrand(n, 2.f)), *u = HOLD(hrand(n, 1.f)), *dh = HOLD(hrand(n, 1.f));
        float *rh = HOLD(hnew(n)), *rdg = HOLD(hnew(n)), *rdu = HOLD(hnew(n));
        cpu->swiglu_fwd(cpu, rh, g, u, 1, (int)n, (int)n);
        float *rh2 = HOLD(hnew(n));
        cpu->swiglu_bwd_rows(cpu, rh2, rdg, rdu, dh, g, u, NULL, 1, (int)n, (int)n, (int)n);
        void *gg = gact(g, n), *gu = gact(u, n), *gdh = gact(dh, n);
        void *gh = gact_nan(n), *gdg = gact_nan(n), *gdu = gact_nan(n);
        gpu->swiglu_fwd(gpu, gh, gg, gu, 1, (int)n, (int)n);
        void *gh2 = gact_nan(n);
        gpu->swiglu_bwd_rows(gpu, gh2, gdg, gdu, gdh, gg, gu, NULL, 1, (int)n, (int)n, (int)n);
        printf("    n=%zu\n", n);
        cmp("swiglu_fwd", get_act(gh, n), rh, n, TOL_BF16);
        cmp("swiglu_bwd dgate", get_act(gdg, n), rdg, n, TOL_BF16);
        cmp("swiglu_bwd dup", get_act(gdu, n), rdu, n, TOL_BF16);
    }
    free_all();
}

/* add: one bf16 rounding of an exact fp32 sum: 1e-2; in place too. */
TEST(add_matches_cpu_out_of_place_and_in_place) {
    const size_t n = 1003;
    float *a = HOLD(hrand(n, 1.f)), *c = HOLD(hrand(n, 1.f)), *ref = HOLD(hnew(n));
    cpu->add(cpu, ref, a, c, n);
    void *ga = gact(a, n), *gc = gact(c, n), *go = gact_nan(n);
    gpu->add(gpu, go, ga, gc, n);
    cmp("add", get_act(go, n), ref, n, TOL_BF16);
    gpu->add(gpu, ga, ga, gc, n);
    cmp("add in place", get_act(ga, n), ref, n, TOL_BF16);
    const size_t n8 = 4096;
    float *a8 = HOLD(hrand(n8, 1.f)), *c8 = HOLD(hrand(n8, 1.f)), *r8 = HOLD(hnew(n8));
    cpu->add(cpu, r8, a8, c8, n8);
    void *g8 = gact(a8, n8);
    gpu->add(gpu, g8, g8, gact(c8, n8), n8);
    cmp("add in place (16-byte path)", get_act(g8, n8), r8, n8, TOL_BF16);
    free_all();
}

/* dropout (LoRA): the mask is the same integer hash on both backends, so
 * the dropped elements agree bit for bit, and a kept element is the fp32
 * product x / (1 - P) rounded once to bf16: exactly bf16_round(cpu). For
 * the 16-byte and odd-width paths, through the row index (the mask of the
 * original rows), and in place. */
TEST(dropout_mask_matches_cpu_bitwise_vector_scalar_row_index_and_in_place) {
    const int R = 300, nr = 64;
    const int widths[2] = {1024, 1001};
    const float ps[2] = {0.3f, 0.05f};
    for (int k = 0; k < 2; k++) {
        const int C = widths[k];
        const size_t n = (size_t)R * C;
        const uint32_t thr = cf_dropout_threshold(ps[k]);
        const float scale = 1.0f / (1.0f - ps[k]);
        const uint64_t key = cf_dropout_key(1234, 56 + k, 7);
        float *x = HOLD(hrand(n, 1.f)), *ref = HOLD(hnew(n));
        for (size_t i = 0; i < n; i++) x[i] = bf16_round(fabsf(x[i]) + 0.25f);   /* never 0 */
        cpu->dropout(cpu, ref, x, key, thr, scale, NULL, R, C);
        void *gx = gact(x, n), *go = gact_nan(n);
        gpu->dropout(gpu, go, gx, key, thr, scale, NULL, R, C);
        float *got = get_act(go, n);
        size_t mask_diff = 0, val_diff = 0, kept = 0;
        for (size_t i = 0; i < n; i++) {
            kept += ref[i] != 0;
            mask_diff += (got[i] != 0) != (ref[i] != 0);
            val_diff += !(got[i] == bf16_round(ref[i]));
        }
        printf("    C=%d P=%g: kept %.4f (want %.4f), %zu mask and %zu value differences\n", C, ps[k],
               (double)kept / n, 1.0 - ps[k], mask_diff, val_diff);
        CHECK_MSG(mask_diff == 0 && val_diff == 0, "dropout C=%d: %zu mask, %zu value differences", C, mask_diff,
                  val_diff);
        CHECK_MSG(kept > 0 && kept < n, "dropout C=%d: kept %zu of %zu", C, kept, n);
        /* compacted rows read through the index: the original rows' mask */
        int *rows = HOLD(inew(nr));
        for (int i = 0; i < nr; i++) rows[i] = (int)cf_rng_below(&rng, R);
        float *xr = HOLD(hnew((size_t)nr * C)), *refr = HOLD(hnew((size_t)nr * C));
        for (int i = 0; i < nr; i++) memcpy(xr + (size_t)i * C, x + (size_t)rows[i] * C, C * sizeof(float));
        cpu->dropout(cpu, refr, xr, key, thr, scale, rows, nr, C);
        void *gxr = gact(xr, (size_t)nr * C), *gor = gact_nan((size_t)nr * C);
        gpu->dropout(gpu, gor, gxr, key, thr, scale, gi32(rows, nr), nr, C);
        float *gotr = get_act(gor, (size_t)nr * C);
        size_t row_diff = 0;
        for (int i = 0; i < nr; i++)
            for (int c = 0; c < C; c++) {
                float g = gotr[(size_t)i * C + c], full = got[(size_t)rows[i] * C + c];
                row_diff += !(g == full) || !(g == bf16_round(refr[(size_t)i * C + c]));
            }
        CHECK_MSG(row_diff == 0, "dropout C=%d through the row index: %zu differences", C, row_diff);
        /* in place gives the out-of-place result */
        gpu->dropout(gpu, gx, gx, key, thr, scale, NULL, R, C);
        CHECK_MSG(bitwise_equal(get_act(gx, n), got, n), "dropout C=%d in place differs", C);
    }
    free_all();
}

/* gather_rows: a copy, exact, for 16-byte and odd row widths. */
TEST(gather_rows_copies_rows_exactly) {
    const int R = 40, n = 17;
    const size_t widths[2] = {48, 6};
    for (int k = 0; k < 2; k++) {
        const size_t rb = widths[k];
        unsigned char *src = HOLD(malloc(R * rb)), *ref = HOLD(malloc(n * rb)), *got = HOLD(malloc(n * rb));
        for (size_t i = 0; i < R * rb; i++) src[i] = (unsigned char)cf_rng_below(&rng, 256);
        int *rows = HOLD(inew(n));
        for (int i = 0; i < n; i++) rows[i] = (int)cf_rng_below(&rng, R);
        cpu->gather_rows(cpu, ref, src, rows, n, rb);
        void *gs = galloc(R * rb), *gd = galloc(n * rb);
        gpu->upload(gpu, gs, src, R * rb);
        gpu->memzero(gpu, gd, n * rb);
        gpu->gather_rows(gpu, gd, gs, gi32(rows, n), n, rb);
        gpu->download(gpu, got, gd, n * rb);
        CHECK_MSG(memcmp(got, ref, n * rb) == 0, "gather_rows row_bytes=%zu differs", rb);
    }
    free_all();
}

/* sumsq: double accumulation of fp32 squares on both, added to a device
 * double: 1e-9 relative; the same bits every run; also in a side section. */
TEST(sumsq_accumulates_on_the_device_and_matches_cpu) {
    const size_t n = 1000003;
    float *g = HOLD(hnew(n));
    for (size_t i = 0; i < n; i++) g[i] = cf_rng_normal(&rng);
    double r = 0.25;
    cpu->sumsq(cpu, &r, g, n);
    cpu->sumsq(cpu, &r, g + 1, n - 1);
    void *gg = gf32(g, n);
    double init = 0.25, s = 0, s2 = 0;
    double *acc = galloc(sizeof(double));
    gpu->upload(gpu, acc, &init, sizeof init);
    gpu->sumsq(gpu, acc, gg, n);
    gpu->sumsq(gpu, acc, (float *)gg + 1, n - 1); /* unaligned start: the scalar path */
    CHECK(gpu->download(gpu, &s, acc, sizeof s) == 0);
    printf("    sumsq gpu %.12g cpu %.12g\n", s, r);
    CHECK(fabs(s - r) <= 1e-9 * fabs(r));
    gpu->upload(gpu, acc, &init, sizeof init);
    gpu->sumsq(gpu, acc, gg, n);
    gpu->sumsq(gpu, acc, (float *)gg + 1, n - 1);
    CHECK(gpu->download(gpu, &s2, acc, sizeof s2) == 0);
    CHECK(s2 == s); /* deterministic */
    /* in a side section (backend.h: side_begin): the short-block variant
     * on the side stream, joined before the download; twice: the same bits */
    double s3[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        gpu->upload(gpu, acc, &init, sizeof init);
        gpu->side_begin(gpu, 0);
        gpu->sumsq(gpu, acc, gg, n);
        gpu->sumsq(gpu, acc, (float *)gg + 1, n - 1);
        gpu->side_end(gpu);
        gpu->side_join(gpu);
        CHECK(gpu->download(gpu, &s3[k], acc, sizeof s3[k]) == 0);
    }
    printf("    sumsq side %.12g\n", s3[0]);
    CHECK(fabs(s3[0] - r) <= 1e-9 * fabs(r) && s3[1] == s3[0]);
    free_all();
}

/* ------------------------------------------- selection bookkeeping */

/* keep_to_rows: integer bookkeeping, exact. Uneven sequences: random at
 * several densities, all kept, none kept, one kept; S above and below the
 * 1024 positions of one scan pass, and not a multiple of it. */
TEST(keep_to_rows_matches_cpu_exactly) {
    const int shapes[3][2] = {{7, 300}, {3, 2500}, {1, 1}};
    for (int k = 0; k < 3; k++) {
        const int B = shapes[k][0], S = shapes[k][1], T = B * S;
        uint8_t *keep = HOLD(malloc((size_t)T));
        for (int b = 0; b < B; b++)
            for (int s = 0; s < S; s++) {
                uint8_t v;
                switch (b % 5) {
                case 0: v = cf_rng_uniform(&rng) < 0.5f; break;
                case 1: v = 1; break;
                case 2: v = 0; break;
                case 3: v = s == S - 1; break;
                default: v = cf_rng_uniform(&rng) < 0.1f ? 3 : 0; break; /* any nonzero byte keeps */
                }
                keep[(size_t)b * S + s] = v;
            }
        int *rr = HOLD(inew(T)), *rs = HOLD(inew(B + 1));
        cpu->keep_to_rows(cpu, rr, rs, keep, B, S);
        const int n = rs[B];
        void *gk = galloc((size_t)T + 16);
        gpu->upload(gpu, gk, keep, (size_t)T);
        int *minus = HOLD(inew(T + B + 1));
        for (int i = 0; i < T + B + 1; i++) minus[i] = -1;
        int *grows = gi32(minus, T), *gss = gi32(minus, B + 1);
        gpu->keep_to_rows(gpu, grows, gss, gk, B, S);
        int *hr = HOLD(inew(T)), *hs = HOLD(inew(B + 1));
        CHECK(gpu->download(gpu, hr, grows, (size_t)T * 4) == 0);
        CHECK(gpu->download(gpu, hs, gss, (size_t)(B + 1) * 4) == 0);
        printf("    keep_to_rows B=%d S=%d: %d kept\n", B, S, n);
        CHECK_MSG(memcmp(hs, rs, (size_t)(B + 1) * 4) == 0, "seq_start differs (B=%d S=%d)", B, S);
        CHECK_MSG(memcmp(hr, rr, (size_t)n * 4) == 0, "rows differ (B=%d S=%d)", B, S);
        int untouched = 1;
        for (int i = n; i < T; i++) untouched &= hr[i] == -1;
        CHECK(untouched);
        free_all();
    }
}

/* fill_dloss: exact; loss_sum: double sums in different orders rounded to
 * fp32 (1e-6), the same bits every run. */
TEST(fill_dloss_and_loss_sum_match_cpu) {
    const int n = 5000;
    float *losses = HOLD(hnew(n));
    uint8_t *keep = HOLD(malloc(n));
    for (int t = 0; t < n; t++) {
        keep[t] = cf_rng_uniform(&rng) < 0.4f;
        losses[t] = keep[t] ? 5.0f * cf_rng_uniform(&rng) : NAN; /* filtered rows are never read */
    }
    void *gk = galloc(n + 16);
    gpu->upload(gpu, gk, keep, n);
    void *gl = gf32(losses, n);
    for (int masked = 0; masked < 2; masked++) {
        float *rd = HOLD(hnew(n));
        cpu->fill_dloss(cpu, rd, masked ? keep : NULL, 0.001f, n);
        void *gd = gf32_nan(n);
        gpu->fill_dloss(gpu, gd, masked ? gk : NULL, 0.001f, n);
        cmp(masked ? "fill_dloss (masked)" : "fill_dloss (no mask)", get_f32(gd, n), rd, n, 0);
    }
    float racc = 2.0f, init = 2.0f, g1 = 0, g2 = 0;
    cpu->loss_sum(cpu, &racc, losses, keep, n);
    float *gacc = galloc(16);
    gpu->upload(gpu, gacc, &init, 4);
    gpu->loss_sum(gpu, gacc, gl, gk, n);
    CHECK(gpu->download(gpu, &g1, gacc, 4) == 0);
    gpu->upload(gpu, gacc, &init, 4);
    gpu->loss_sum(gpu, gacc, gl, gk, n);
    CHECK(gpu->download(gpu, &g2, gacc, 4) == 0);
    cmp("loss_sum (masked, += 2)", &g1, &racc, 1, 1e-6);
    CHECK(g1 == g2);
    /* no mask on a NaN-free vector */
    float *l2 = HOLD(hnew(n));
    for (int t = 0; t < n; t++) l2[t] = cf_rng_uniform(&rng);
    float r2 = 0, z = 0, g3 = 0;
    cpu->loss_sum(cpu, &r2, l2, NULL, n);
    gpu->upload(gpu, gacc, &z, 4);
    gpu->loss_sum(gpu, gacc, gf32(l2, n), NULL, n);
    CHECK(gpu->download(gpu, &g3, gacc, 4) == 0);
    cmp("loss_sum (no mask)", &g3, &r2, 1, 1e-6);
    free_all();
}

/* adamw and weights_from_master: fp32 on both sides (1e-6); bf16 weights
 * are the round-to-nearest-even of the master (exact). */
TEST(adamw_two_steps_and_weights_from_master_match_cpu_and_keep_grad_leaves_g) {
    const size_t ns[2] = {1004, 1005}; /* 16-byte path, scalar path */
    for (int k = 0; k < 2; k++) {
        const size_t n = ns[k];
        float *p = HOLD(hrand(n, 1.f)), *g1 = HOLD(hrand(n, 1.f)), *g2 = HOLD(hrand(n, 1.f));
        float *m = HOLD(hnew(n)), *v = HOLD(hnew(n));
        void *gp = gf32(p, n), *gm = gf32(m, n), *gv = gf32(v, n), *gg1 = gf32(g1, n), *gg2 = gf32(g2, n);
        cpu->adamw(cpu, p, NULL, g1, m, v, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, 1, 0);
        cpu->adamw(cpu, p, NULL, g2, m, v, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, 2, 0);
        gpu->adamw(gpu, gp, NULL, gg1, gm, gv, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, 1, 0);
        gpu->adamw(gpu, gp, NULL, gg2, gm, gv, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, 2, 0);
        printf("    n=%zu\n", n);
        cmp("adamw p", get_f32(gp, n), p, n, 1e-6);
        cmp("adamw m", get_f32(gm, n), m, n, 1e-6);
        cmp("adamw v", get_f32(gv, n), v, n, 1e-6);
        /* CF_ADAMW_KEEP_GRAD: the same bits of p, m, v; g left as it was */
        float *p0 = HOLD(hrand(n, 1.f)), *gk = HOLD(hrand(n, 1.f)), *z = HOLD(hnew(n));
        void *kp[2], *km[2], *kv[2], *kg[2];
        for (int keep = 0; keep < 2; keep++) {
            kp[keep] = gf32(p0, n);
            km[keep] = gf32(z, n);
            kv[keep] = gf32(z, n);
            kg[keep] = gf32(gk, n);
            gpu->adamw(gpu, kp[keep], NULL, kg[keep], km[keep], kv[keep], n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, 1,
                       keep ? CF_ADAMW_KEEP_GRAD : 0);
        }
        CHECK_MSG(bitwise_equal(get_f32(kp[0], n), get_f32(kp[1], n), n) &&
                      bitwise_equal(get_f32(km[0], n), get_f32(km[1], n), n) &&
                      bitwise_equal(get_f32(kv[0], n), get_f32(kv[1], n), n),
                  "adamw with KEEP_GRAD updates differently");
        CHECK_MSG(bitwise_equal(get_f32(kg[1], n), gk, n), "adamw with KEEP_GRAD changed g");
        CHECK_MSG(bitwise_equal(get_f32(kg[0], n), z, n), "adamw did not zero g");
        void *gw = gact_nan(n);
        gpu->weights_from_master(gpu, gw, gp, n);
        float *w = get_act(gw, n), *want = HOLD(hcopy(get_f32(gp, n), n));
        hround(want, n);
        cmp("weights_from_master", w, want, n, 0);
    }
    free_all();
}

/* adamw_segments: one launch over a table of segments gives the bits of a
 * per-segment adamw each (p, m, v, g, the bf16 compute copy), and the CPU's
 * per-segment passes within 1e-6. The table mixes what the kernel must
 * tell apart: a segment of several chunks (20000 elements, its last chunk
 * partial), lengths that are not multiples of 4, offsets that are not
 * (its scalar path), an empty segment, weight decay 0 and not, kept and
 * zeroed gradients, and the order of the buffers' pieces (g and w in
 * another order than p, m, v; gaps between segments left untouched). */
TEST(adamw_segments_in_one_launch_give_the_per_segment_bits_and_match_cpu) {
    const cf_adamw_seg segs[] = {
        {0, 30016, 12, 20000, 0.1f, CF_ADAMW_KEEP_GRAD},  /* several chunks; w elsewhere */
        {20008, 0, 20032, 1005, 0.f, 0},                  /* a tail of 1 after the float4s */
        {21016, 1008, 21048, 0, 0.1f, 0},                 /* empty */
        {21016, 1008, 21048, 3, 0.1f, 0},                 /* shorter than a float4 */
        {21021, 1013, 21053, 777, 0.1f, CF_ADAMW_KEEP_GRAD}, /* odd offsets: scalar */
        {21800, 1792, 21832, 4096, 0.f, 0},               /* exactly one chunk */
    };
    const int ns = (int)(sizeof segs / sizeof segs[0]);
    const size_t N = 60000; /* covers every offset + n above */
    float *p = HOLD(hrand(N, 1.f)), *g = HOLD(hrand(N, 1.f)), *m = HOLD(hrand(N, 0.1f)), *v = HOLD(hnew(N));
    for (size_t i = 0; i < N; i++) v[i] = 0.01f * fabsf(m[i]) + 1e-4f;
    /* the same buffers three times: one launch, per segment (GPU), per segment (CPU) */
    void *op = gf32(p, N), *og = gf32(g, N), *om = gf32(m, N), *ov = gf32(v, N), *ow = gact_nan(N);
    void *sp = gf32(p, N), *sg = gf32(g, N), *sm = gf32(m, N), *sv = gf32(v, N), *sw = gact_nan(N);
    float *cp = HOLD(hcopy(p, N)), *cg = HOLD(hcopy(g, N)), *cm = HOLD(hcopy(m, N)), *cv = HOLD(hcopy(v, N));
    for (int t = 1; t <= 2; t++) {
        gpu->adamw_segments(gpu, op, ow, og, om, ov, segs, ns, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.5f, t);
        for (int k = 0; k < ns; k++) {
            const cf_adamw_seg *q = &segs[k];
            gpu->adamw(gpu, (float *)sp + q->poff, (char *)sw + q->woff * gpu->act_size, (float *)sg + q->goff,
                       (float *)sm + q->poff, (float *)sv + q->poff, q->n, 1e-3f, 0.9f, 0.95f, 1e-8f, q->wd, 0.5f, t,
                       q->flags);
        }
        cpu->adamw_segments(cpu, cp, NULL, cg, cm, cv, segs, ns, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.5f, t);
    }
    CHECK_MSG(bitwise_equal(get_f32(op, N), get_f32(sp, N), N), "adamw_segments: p differs from per-segment adamw");
    CHECK_MSG(bitwise_equal(get_f32(om, N), get_f32(sm, N), N), "adamw_segments: m differs");
    CHECK_MSG(bitwise_equal(get_f32(ov, N), get_f32(sv, N), N), "adamw_segments: v differs");
    CHECK_MSG(bitwise_equal(get_f32(og, N), get_f32(sg, N), N), "adamw_segments: g differs (zeroed or kept)");
    float *wo = get_act(ow, N), *ws = get_act(sw, N);
    int wsame = 1;
    for (size_t i = 0; i < N; i++) wsame &= (isnan(wo[i]) && isnan(ws[i])) || wo[i] == ws[i];
    CHECK_MSG(wsame, "adamw_segments: the compute copy differs (or a gap was written)");
    cmp("adamw_segments p vs cpu", get_f32(op, N), cp, N, 1e-6);
    cmp("adamw_segments m vs cpu", get_f32(om, N), cm, N, 1e-6);
    cmp("adamw_segments v vs cpu", get_f32(ov, N), cv, N, 1e-6);
    cmp("adamw_segments g vs cpu", get_f32(og, N), cg, N, 0);
    /* the update did something: p moved where a segment is, not elsewhere */
    float *po = get_f32(op, N);
    CHECK_MSG(po[5] != p[5] && po[20010] != p[20010] && po[30000] == p[30000], "adamw_segments: p not updated where expected");
    free_all();
}

/* LM head: logits from bf16 x, W (same inputs on both). fp32 logits
 * (CF_LMHEAD_LOGITS=fp32) give losses that differ by accumulation order
 * only: 1e-3 of max |loss|. bf16 logits (the default, as transformers' bf16
 * models have them) with the target's logit exact: each other logit is off
 * by up to 2^-9 of itself, so lse by up to 2^-9 max |logit|, which here (logits
 * of sd 2.4, largest about 11, losses up to about 12) is under 2e-3 of the
 * largest loss: 3e-3. dx is bf16 through a bf16 dlogits: 2e-2; dW fp32
 * accumulated from bf16 dlogits: 2e-2. Rows with dloss 0 must give dx
 * exactly 0. */
static double lm_loss_tol(void) {
    const char *e = getenv("CF_LMHEAD_LOGITS");
    return e && strcmp(e, "fp32") == 0 ? 1e-3 : 3e-3;
}
static void lmhead_fwd_bwd_case(int V) {
    const int T = 37, C = 64;
    float *x = HOLD(hrand((size_t)T * C, 1.f)), *w = HOLD(hrand((size_t)V * C, 0.3f));
    int *tg = HOLD(inew(T));
    float *dl = HOLD(hnew(T)), *dw0 = HOLD(hrand((size_t)V * C, 0.01f));
    for (int t = 0; t < T; t++) {
        tg[t] = (int)cf_rng_below(&rng, V);
        dl[t] = (t % 3 == 1) ? 0.f : 1.f / T;
    }
    float *rl = HOLD(hnew(T)), *rdx = HOLD(hnew((size_t)T * C)), *rdw = HOLD(hcopy(dw0, (size_t)V * C));
    cpu->lmhead_loss_fwd(cpu, rl, x, w, tg, T, C, V);
    cpu->lmhead_loss_bwd(cpu, rdx, rdw, x, w, tg, dl, NULL, T, C, V, 0, 0);
    void *gx = gact(x, (size_t)T * C), *gw = gact(w, (size_t)V * C), *gt = gi32(tg, T);
    void *gl = gf32_nan(T), *gdx = gact_nan((size_t)T * C), *gdw = gf32(dw0, (size_t)V * C);
    gpu->lmhead_loss_fwd(gpu, gl, gx, gw, gt, T, C, V);
    gpu->lmhead_loss_bwd(gpu, gdx, gdw, gx, gw, gt, gf32(dl, T), NULL, T, C, V, 0, 0);
    cmp("lmhead losses", get_f32(gl, T), rl, T, lm_loss_tol());
    float *dx = get_act(gdx, (size_t)T * C);
    cmp("lmhead dx", dx, rdx, (size_t)T * C, TOL_GRAD);
    cmp("lmhead dW +=", get_f32(gdw, (size_t)V * C), rdw, (size_t)V * C, TOL_GRAD);
    int zero_ok = 1;
    for (int t = 1; t < T; t += 3)
        for (int c = 0; c < C; c++) zero_ok &= dx[(size_t)t * C + c] == 0.f;
    CHECK(zero_ok);
    /* CF_MM_DW_SET: dW written without being read (NaN before) */
    float *rdz = HOLD(hnew((size_t)V * C));
    cpu->lmhead_loss_bwd(cpu, rdx, rdz, x, w, tg, dl, NULL, T, C, V, 0, 0);
    void *gdn = gf32_nan((size_t)V * C);
    gpu->lmhead_loss_bwd(gpu, gdx, gdn, gx, gw, gt, gf32(dl, T), NULL, T, C, V, 0, CF_MM_DW_SET);
    cmp("lmhead dW = (CF_MM_DW_SET)", get_f32(gdn, (size_t)V * C), rdz, (size_t)V * C, TOL_GRAD);
    free_all();
}
/* V = 1000: the rows kernel's 16-byte path; 1001: its scalar path */
TEST(lmhead_loss_fwd_bwd_match_cpu_with_zero_dloss_rows) {
    lmhead_fwd_bwd_case(1000);
    lmhead_fwd_bwd_case(1001);
}

/* Issue 17: the forward that keeps g = softmax - onehot (bf16) and the
 * backward from it, against the CPU backend's same ops: losses as the plain
 * forward's (bit for bit on the GPU too: the same kernel pass), g within
 * bf16 rounding, dx and dW as the recompute path's tolerances (the common
 * weight rides on the GEMMs, so g is rounded once), rows with dloss 0 exactly 0 in dx;
 * CF_MM_DW_SET writes a NaN-filled dW; a NULL dW (frozen head) gives dx;
 * without a dloss, g is left bit for bit as it was. */
static void lmhead_saved_grad_case(int V) {
    const int T = 37, C = 64;
    const size_t nx = (size_t)T * C, nw = (size_t)V * C, ng = (size_t)T * V;
    float *x = HOLD(hrand(nx, 1.f)), *w = HOLD(hrand(nw, 0.3f));
    int *tg = HOLD(inew(T));
    float *dl = HOLD(hnew(T)), *dw0 = HOLD(hrand(nw, 0.01f));
    for (int t = 0; t < T; t++) {
        tg[t] = (int)cf_rng_below(&rng, V);
        dl[t] = (t % 3 == 1) ? 0.f : 1.f / T;
    }
    float *rl = HOLD(hnew(T)), *rg = HOLD(hnew(ng)), *rdx = HOLD(hnew(nx)), *rdw = HOLD(hcopy(dw0, nw));
    cpu->lmhead_loss_fwd_grad(cpu, rl, rg, x, w, tg, T, C, V);
    float *rg0 = HOLD(hcopy(rg, ng));
    cpu->lmhead_loss_bwd_saved(cpu, rdx, rdw, rg, x, w, dl, 1.f / T, T, C, V, 0);
    void *gx = gact(x, nx), *gw = gact(w, nw), *gt = gi32(tg, T), *gdl = gf32(dl, T);
    void *gl = gf32_nan(T), *gl0 = gf32_nan(T), *gg = gact_nan(ng), *gdx = gact_nan(nx), *gdw = gf32(dw0, nw);
    gpu->lmhead_loss_fwd(gpu, gl0, gx, gw, gt, T, C, V);
    gpu->lmhead_loss_fwd_grad(gpu, gl, gg, gx, gw, gt, T, C, V);
    float *l = get_f32(gl, T);
    CHECK_MSG(bitwise_equal(l, get_f32(gl0, T), T), "losses differ from lmhead_loss_fwd's");
    cmp("lmhead saved: losses", l, rl, T, lm_loss_tol());
    cmp("lmhead saved: g = softmax - onehot", get_act(gg, ng), rg0, ng, 1e-2);
    gpu->lmhead_loss_bwd_saved(gpu, gdx, gdw, gg, gx, gw, gdl, 1.f / T, T, C, V, 0);
    float *dx = get_act(gdx, nx);
    cmp("lmhead saved: dx", dx, rdx, nx, TOL_GRAD);
    cmp("lmhead saved: dW +=", get_f32(gdw, nw), rdw, nw, TOL_GRAD);
    int zero_ok = 1;
    for (int t = 1; t < T; t += 3)
        for (int c = 0; c < C; c++) zero_ok &= dx[(size_t)t * C + c] == 0.f;
    CHECK(zero_ok);
    /* CF_MM_DW_SET: dW written without being read (NaN before) */
    float *rdz = HOLD(hnew(nw));
    cpu->lmhead_loss_fwd_grad(cpu, rl, rg, x, w, tg, T, C, V);
    cpu->lmhead_loss_bwd_saved(cpu, rdx, rdz, rg, x, w, dl, 1.f / T, T, C, V, 0);
    void *gdn = gf32_nan(nw);
    gpu->lmhead_loss_fwd_grad(gpu, gl, gg, gx, gw, gt, T, C, V);
    gpu->lmhead_loss_bwd_saved(gpu, gdx, gdn, gg, gx, gw, gdl, 1.f / T, T, C, V, CF_MM_DW_SET);
    cmp("lmhead saved: dW = (CF_MM_DW_SET)", get_f32(gdn, nw), rdz, nw, TOL_GRAD);
    /* a frozen head */
    void *gdx2 = gact_nan(nx);
    gpu->lmhead_loss_fwd_grad(gpu, gl, gg, gx, gw, gt, T, C, V);
    gpu->lmhead_loss_bwd_saved(gpu, gdx2, NULL, gg, gx, gw, gdl, 1.f / T, T, C, V, 0);
    cmp("lmhead saved: dx (no dW)", get_act(gdx2, nx), rdx, nx, TOL_GRAD);
    /* dloss NULL: every row weighs the scale (regular and compact modes: no
     * reweighting pass over g) */
    float *ones = HOLD(hnew(T)), *rdx3 = HOLD(hnew(nx)), *rdw3 = HOLD(hnew(nw));
    for (int t = 0; t < T; t++) ones[t] = 1.f / T;
    cpu->lmhead_loss_fwd_grad(cpu, rl, rg, x, w, tg, T, C, V);
    cpu->lmhead_loss_bwd_saved(cpu, rdx3, rdw3, rg, x, w, ones, 1.f / T, T, C, V, CF_MM_DW_SET);
    void *gdx3 = gact_nan(nx), *gdw3 = gf32_nan(nw);
    gpu->lmhead_loss_fwd_grad(gpu, gl, gg, gx, gw, gt, T, C, V);
    float *g0 = get_act(gg, ng);
    gpu->lmhead_loss_bwd_saved(gpu, gdx3, gdw3, gg, gx, gw, NULL, 1.f / T, T, C, V, CF_MM_DW_SET);
    CHECK_MSG(bitwise_equal(get_act(gg, ng), g0, ng), "lmhead_loss_bwd_saved without dloss changed g");
    cmp("lmhead saved: dx (dloss NULL)", get_act(gdx3, nx), rdx3, nx, TOL_GRAD);
    cmp("lmhead saved: dW (dloss NULL)", get_f32(gdw3, nw), rdw3, nw, TOL_GRAD);
    free_all();
}
/* V = 1000: the rows kernel's 16-byte path; 1001: its scalar path */
TEST(lmhead_saved_grad_fwd_bwd_match_cpu_with_zero_dloss_rows) {
    lmhead_saved_grad_case(1000);
    lmhead_saved_grad_case(1001);
}

/* Targets V and -1 (outside [0, V)): NaN losses on both backends (the
 * losses start at 0, so an unwritten row fails), the other rows' losses as
 * the CPU's, and g there without the one-hot term. */
static void lmhead_bad_target_case(int V) {
    const int T = 9, C = 64;
    const size_t ng = (size_t)T * V;
    float *x = HOLD(hrand((size_t)T * C, 1.f)), *w = HOLD(hrand((size_t)V * C, 0.3f));
    int *tg = HOLD(inew(T));
    for (int t = 0; t < T; t++) tg[t] = (int)cf_rng_below(&rng, V);
    tg[2] = V;
    tg[5] = -1;
    float *rl = HOLD(hnew(T)), *rg = HOLD(hnew(ng));
    cpu->lmhead_loss_fwd_grad(cpu, rl, rg, x, w, tg, T, C, V);
    void *gl = gf32(HOLD(hnew(T)), T), *gg = gact_nan(ng);
    gpu->lmhead_loss_fwd_grad(gpu, gl, gg, gact(x, (size_t)T * C), gact(w, (size_t)V * C), gi32(tg, T), T, C, V);
    float *l = get_f32(gl, T);
    CHECK_MSG(isnan(l[2]) && isnan(l[5]) && isnan(rl[2]) && isnan(rl[5]), "a target outside [0, V) gave a loss");
    l[2] = rl[2] = l[5] = rl[5] = 0.f;
    cmp("lmhead bad targets: the other rows' losses", l, rl, T, lm_loss_tol());
    cmp("lmhead bad targets: g", get_act(gg, ng), rg, ng, 1e-2);
    free_all();
}
/* Many rows per launch: at 300 rows the Hopper cluster kernel runs in
 * several waves of clusters (about 33 to 66 fit at once on an H100/H200),
 * the one-block kernel in several of blocks. Losses and g = softmax -
 * onehot against the CPU, every row written. */
static void lmhead_many_rows_case(int V, int T) {
    const int C = 64;
    const size_t ng = (size_t)T * V;
    float *x = HOLD(hrand((size_t)T * C, 1.f)), *w = HOLD(hrand((size_t)V * C, 0.3f));
    int *tg = HOLD(inew(T));
    for (int t = 0; t < T; t++) tg[t] = (int)cf_rng_below(&rng, V);
    float *rl = HOLD(hnew(T)), *rg = HOLD(hnew(ng));
    cpu->lmhead_loss_fwd_grad(cpu, rl, rg, x, w, tg, T, C, V);
    void *gl = gf32_nan(T), *gg = gact_nan(ng);
    gpu->lmhead_loss_fwd_grad(gpu, gl, gg, gact(x, (size_t)T * C), gact(w, (size_t)V * C), gi32(tg, T), T, C, V);
    cmp("lmhead many rows: losses", get_f32(gl, T), rl, T, lm_loss_tol());
    cmp("lmhead many rows: g", get_act(gg, ng), rg, ng, TOL_BF16);
    free_all();
}

/* Rows of over 64 KB take the Hopper kernel where a cluster of blocks
 * shares a row (lmhead.cu). bf16 logits (the default): V = 32000 (64000
 * bytes: the one-block kernel), 128256 (Llama 3) and 151936 (Qwen2.5), 4
 * blocks each; with CF_LMHEAD_CLUSTER=0 (and on other GPUs) the one-block
 * kernel at the same V; CF_LMHEAD_CLUSTER=8 asks for 8 blocks, =2 for 2
 * at V = 32000 (where it would not be chosen). fp32 logits
 * at the large vocabularies: 8 blocks. */
TEST(lmhead_one_pass_cluster_rows_match_cpu_at_large_vocabularies) {
    const int Vs[3] = {32000, 128256, 151936};
    for (int i = 0; i < 3; i++) {
        lmhead_fwd_bwd_case(Vs[i]);
        lmhead_saved_grad_case(Vs[i]);
        lmhead_bad_target_case(Vs[i]);
    }
    setenv("CF_LMHEAD_CLUSTER", "0", 1);
    lmhead_fwd_bwd_case(151936);
    lmhead_bad_target_case(151936);
    setenv("CF_LMHEAD_CLUSTER", "8", 1);
    lmhead_fwd_bwd_case(151936);
    lmhead_saved_grad_case(128256);
    setenv("CF_LMHEAD_CLUSTER", "2", 1); /* asked for, also at rows of 64 KB or less */
    lmhead_saved_grad_case(32000);
    lmhead_many_rows_case(32000, 300);
    unsetenv("CF_LMHEAD_CLUSTER");
    setenv("CF_LMHEAD_LOGITS", "fp32", 1);
    lmhead_fwd_bwd_case(151936);
    lmhead_bad_target_case(128256);
    lmhead_many_rows_case(151936, 300);
    unsetenv("CF_LMHEAD_LOGITS");
    lmhead_many_rows_case(151936, 300);
    lmhead_many_rows_case(65536, 301);
}

/* bf16 logits (the default) with the target's logit taken again in fp32
 * (lmhead.cu): rows where the model is confident (the target's logit about
 * 12.3, where bf16 steps by 1/16; the rest about 0.4) have losses of 0.005
 * (V = 1000) to 0.56 (V = 151936; checked: under 1, the target holds over
 * a third of the probability). With the target's rounded logit in the
 * loss they would be off by 1.5e-2 to 2.5e-2 relative to the largest (a
 * numpy model of the case; with the exact target, under 1e-4: x's rows are
 * orthogonal, so no other row's target leaks a large logit into a row
 * whose loss is small); here they must be as exact as fp32
 * logits give them (1e-3 of the largest, as the other LM head tests), at
 * both row kernels (V = 1000, 1001: one block; 151936: the cluster), and
 * g = softmax - onehot within bf16 rounding. The fp32 logits
 * (CF_LMHEAD_LOGITS=fp32) pass the same checks, and the two give different
 * bits of g (the switch takes effect). An unknown value fails the context
 * with one line naming the variable. */
static void lmhead_confident_case(int V) {
    const int T = 16, C = 64;
    const size_t ng = (size_t)T * V;
    float *x = HOLD(hnew((size_t)T * C)), *w = HOLD(hrand((size_t)V * C, 0.05f));
    int *tg = HOLD(inew(T));
    /* x's rows orthogonal (Gram-Schmidt in double, norm 8, then rounded),
     * so that row t's target row of W gives the other rows logits near 0 */
    double *xd = HOLD(calloc((size_t)T * C, sizeof(double)));
    for (int t = 0; t < T; t++) {
        double *r = xd + (size_t)t * C;
        for (int c = 0; c < C; c++) r[c] = cf_rng_normal(&rng);
        for (int u = 0; u < t; u++) {
            double d = 0.0;
            for (int c = 0; c < C; c++) d += r[c] * xd[(size_t)u * C + c];
            for (int c = 0; c < C; c++) r[c] -= d * xd[(size_t)u * C + c];
        }
        double n = 0.0;
        for (int c = 0; c < C; c++) n += r[c] * r[c];
        for (int c = 0; c < C; c++) r[c] /= sqrt(n);
        for (int c = 0; c < C; c++) x[(size_t)t * C + c] = bf16_round((float)(8.0 * r[c]));
    }
    for (int t = 0; t < T; t++) {
        tg[t] = (int)(((size_t)t * 7919 + 13) % (size_t)V); /* distinct rows of W */
        float n2 = 0.f;
        for (int c = 0; c < C; c++) n2 += x[(size_t)t * C + c] * x[(size_t)t * C + c];
        for (int c = 0; c < C; c++) w[(size_t)tg[t] * C + c] = bf16_round(12.3f * x[(size_t)t * C + c] / n2);
    }
    float *rl = HOLD(hnew(T)), *rg = HOLD(hnew(ng));
    cpu->lmhead_loss_fwd_grad(cpu, rl, rg, x, w, tg, T, C, V);
    float lmin = INFINITY;
    for (int t = 0; t < T; t++) lmin = fminf(lmin, rl[t]);
    CHECK_MSG(lmin < 1.f, "the case has no confident row (smallest loss %g)", lmin);
    void *gx = gact(x, (size_t)T * C), *gw = gact(w, (size_t)V * C), *gt = gi32(tg, T);
    float *g2 = NULL;
    for (int mode = 0; mode < 2; mode++) {
        if (mode) setenv("CF_LMHEAD_LOGITS", "fp32", 1);
        void *gl = gf32_nan(T), *gg = gact_nan(ng);
        gpu->lmhead_loss_fwd_grad(gpu, gl, gg, gx, gw, gt, T, C, V);
        cmp(mode ? "lmhead confident rows, fp32 logits: losses" : "lmhead confident rows, bf16 logits: losses",
            get_f32(gl, T), rl, T, 1e-3);
        float *g = get_act(gg, ng);
        cmp(mode ? "lmhead confident rows, fp32 logits: g" : "lmhead confident rows, bf16 logits: g", g, rg, ng,
            TOL_BF16);
        if (mode) CHECK_MSG(!bitwise_equal(g, g2, ng), "V=%d: bf16 and fp32 logits gave the same g", V);
        g2 = g;
    }
    unsetenv("CF_LMHEAD_LOGITS");
    free_all();
}
TEST(lmhead_bf16_logits_keep_confident_rows_losses_fp32_exact) {
    const int Vs[3] = {1000, 1001, 151936};
    for (int i = 0; i < 3; i++) lmhead_confident_case(Vs[i]);
    /* the other tests' cases on the fp32 logits as well */
    setenv("CF_LMHEAD_LOGITS", "fp32", 1);
    lmhead_fwd_bwd_case(1000);
    lmhead_saved_grad_case(128256);
    unsetenv("CF_LMHEAD_LOGITS");
    cf_backend *e = cf_backend_cuda_create(0);
    CHECK_MSG(e != NULL, "second context: %s", cf_last_error());
    if (!e) return;
    const int T = 2, C = 64, V = 100;
    void *x = e->alloc(e, (size_t)T * C * 2), *w = e->alloc(e, (size_t)V * C * 2), *tg = e->alloc(e, T * 4);
    float *l = e->alloc(e, T * 4);
    CHECK(x && w && tg && l);
    setenv("CF_LMHEAD_LOGITS", "fp16", 1);
    e->lmhead_loss_fwd(e, l, x, w, tg, T, C, V);
    unsetenv("CF_LMHEAD_LOGITS");
    cf_fail("%s", "");
    CHECK(e->check(e) == -1);
    CHECK_MSG(strstr(cf_last_error(), "CF_LMHEAD_LOGITS=fp16") != NULL, "check: %s", cf_last_error());
    e->free(e, x);
    e->free(e, w);
    e->free(e, tg);
    e->free(e, l);
    e->destroy(e);
    CHECK(gpu->check(gpu) == 0);
}

/* The cluster kernel's smaller clusters at small sizes (also what
 * gpu_session.sh sanitize-lmhead runs under racecheck). fp32 logits:
 * V = 20000 (rows of 80 KB: 2 blocks of 40 KB) and 65536 (4 blocks of
 * 64 KB); bf16 logits: 65536 (2 blocks of 64 KB). */
TEST(lmhead_cluster_rows_of_two_and_four_blocks_match_cpu) {
    setenv("CF_LMHEAD_LOGITS", "fp32", 1);
    const int Vs[2] = {20000, 65536};
    for (int i = 0; i < 2; i++) {
        lmhead_fwd_bwd_case(Vs[i]);
        lmhead_saved_grad_case(Vs[i]);
        lmhead_bad_target_case(Vs[i]);
    }
    unsetenv("CF_LMHEAD_LOGITS");
    lmhead_fwd_bwd_case(65536);
    lmhead_saved_grad_case(65536);
    lmhead_bad_target_case(65536);
}

/* Vocab-parallel pieces (tensor parallelism): the embedding of a slice of
 * the table, and the LM head over three slices (stats, combine, backward
 * with the combined lse) against the CPU backend's same ops. */
TEST(vocab_parallel_embedding_and_lmhead_slices_match_cpu) {
    const int T = 45, C = 64, V = 900, P = 3, Vl = V / P;
    float *x = HOLD(hrand((size_t)T * C, 1.f)), *w = HOLD(hrand((size_t)V * C, 0.3f));
    int *tg = HOLD(inew(T));
    float *dl = HOLD(hnew(T));
    for (int t = 0; t < T; t++) {
        tg[t] = (int)cf_rng_below(&rng, V);
        dl[t] = (t % 4 == 1) ? 0.f : 1.f / T;
    }
    void *gx = gact(x, (size_t)T * C), *gt = gi32(tg, T);
    float *rparts = HOLD(hnew((size_t)P * T * 3));
    void *gparts = gf32_nan((size_t)P * T * 3);
    for (int p = 0; p < P; p++) {
        const float *wp = w + (size_t)p * Vl * C;
        cpu->lmhead_stats_fwd(cpu, rparts + (size_t)p * T * 3, x, wp, tg, T, C, Vl, p * Vl);
        gpu->lmhead_stats_fwd(gpu, (float *)gparts + (size_t)p * T * 3, gx, gact(wp, (size_t)Vl * C), gt, T, C, Vl,
                              p * Vl);
        /* embedding of the slice: rows outside it are zero */
        float *ref = HOLD(hnew((size_t)T * C));
        cpu->embedding_fwd(cpu, ref, tg, wp, T, C, p * Vl, Vl);
        void *out = gact_nan((size_t)T * C);
        gpu->embedding_fwd(gpu, out, gt, gact(wp, (size_t)Vl * C), T, C, p * Vl, Vl);
        cmp("embedding slice", get_act(out, (size_t)T * C), ref, (size_t)T * C, 0);
    }
    float *rl = HOLD(hnew(T)), *rlse = HOLD(hnew(T)), *full = HOLD(hnew(T));
    cpu->xent_combine(cpu, rl, rlse, rparts, tg, T, P, V);
    cpu->lmhead_loss_fwd(cpu, full, x, w, tg, T, C, V);
    cmp("combined loss vs whole vocabulary (cpu)", rl, full, T, 1e-5);
    void *gl = gf32_nan(T), *glse = gf32_nan(T);
    gpu->xent_combine(gpu, gl, glse, gparts, gt, T, P, V);
    cmp("combined losses", get_f32(gl, T), rl, T, lm_loss_tol());
    for (int p = 0; p < P; p++) {
        const float *wp = w + (size_t)p * Vl * C;
        float *rdx = HOLD(hnew((size_t)T * C)), *rdw = HOLD(hnew((size_t)Vl * C));
        cpu->lmhead_loss_bwd(cpu, rdx, rdw, x, wp, tg, dl, rlse, T, C, Vl, p * Vl, 0);
        void *gdx = gact_nan((size_t)T * C), *gdw = gf32(HOLD(hnew((size_t)Vl * C)), (size_t)Vl * C);
        gpu->lmhead_loss_bwd(gpu, gdx, gdw, gx, gact(wp, (size_t)Vl * C), gt, gf32(dl, T), glse, T, C, Vl, p * Vl, 0);
        cmp("lmhead slice dx", get_act(gdx, (size_t)T * C), rdx, (size_t)T * C, TOL_GRAD);
        cmp("lmhead slice dW", get_f32(gdw, (size_t)Vl * C), rdw, (size_t)Vl * C, TOL_GRAD);
    }
    free_all();
}

/* ============================================================= attention */

typedef struct {
    int B, S, H, Hkv, D, docs; /* docs > 1: document mask with that many docs per sequence */
} attn_case;

typedef struct {
    attn_case c;
    size_t T, nq, nk;  /* rows of q-side and k-side arrays */
    float *q, *k, *v, *out, *lse, *dout; /* full [T, ...], bf16-rounded */
    int *doc;
    cf_attn_shape cs, gs; /* cpu and gpu shapes (doc pointers differ) */
} attn_problem;

static void attn_setup(attn_problem *p, attn_case c) {
    memset(p, 0, sizeof *p);
    p->c = c;
    p->T = (size_t)c.B * c.S;
    p->q = HOLD(hrand(p->T * c.H * c.D, 1.f));
    p->k = HOLD(hrand(p->T * c.Hkv * c.D, 1.f));
    p->v = HOLD(hrand(p->T * c.Hkv * c.D, 1.f));
    p->dout = HOLD(hrand(p->T * c.H * c.D, 1.f));
    p->doc = NULL;
    if (c.docs > 1) {
        p->doc = HOLD(inew(p->T));
        for (int b = 0; b < c.B; b++) {
            /* random document boundaries, ids increasing along the sequence */
            int id = b * 1000;
            for (int s = 0; s < c.S; s++) {
                if (s > 0 && cf_rng_below(&rng, c.S) < (uint32_t)(c.docs - 1)) id++;
                p->doc[(size_t)b * c.S + s] = id;
            }
        }
    }
    cf_attn_shape s = {c.B, c.S, c.H, c.Hkv, c.D, 1.0f / sqrtf((float)c.D), p->doc};
    p->cs = s;
    p->gs = s;
    p->gs.doc = p->doc ? gi32(p->doc, p->T) : NULL;
    /* the reference forward gives out and lse used as backward inputs on
     * both backends (out rounded to bf16, as the GPU would store it) */
    p->out = HOLD(hnew(p->T * c.H * c.D));
    p->lse = HOLD(hnew(p->T * c.H));
    cpu->attention_fwd(cpu, p->out, p->lse, p->q, p->k, p->v, &p->cs);
    hround(p->out, p->T * c.H * c.D);
}

static const char *case_name(attn_case c, char *buf, size_t n) {
    snprintf(buf, n, "B=%d S=%d H=%d Hkv=%d D=%d%s", c.B, c.S, c.H, c.Hkv, c.D, c.docs > 1 ? " doc" : "");
    return buf;
}

static const attn_case cases[] = {
    {2, 100, 4, 2, 64, 0},   /* S not a multiple of 64, GQA          */
    {1, 200, 4, 1, 128, 4},  /* D=128, all heads share one kv head, docs */
    {1, 64, 2, 2, 32, 0},    /* exactly one tile, no GQA, D=32        */
    {1, 70, 4, 2, 8, 3},     /* D=8: zero-padded path, docs           */
    {1, 300, 8, 2, 64, 0},   /* several tiles                         */
    {2, 391, 4, 2, 128, 3},  /* Hopper tiles (128 rows): several, ragged, docs */
    {1, 520, 4, 4, 64, 5},   /* no GQA, several 128-row tiles, docs    */
};
#define NCASES (int)(sizeof cases / sizeof cases[0])

/* out: bf16 from fp32 math with a bf16 P tile in P.V: 1e-2. lse: fp32,
 * same inputs, different summation order and exp2: 1e-4 of max |lse|. */
TEST(attention_fwd_matches_cpu_causal_gqa_doc_mask_and_tails) {
    char nm[128], what[200];
    for (int ci = 0; ci < NCASES; ci++) {
        attn_problem p;
        attn_setup(&p, cases[ci]);
        const attn_case c = p.c;
        void *go = gact_nan(p.T * c.H * c.D), *gl = gf32_nan(p.T * c.H);
        gpu->attention_fwd(gpu, go, gl, gact(p.q, p.T * c.H * c.D), gact(p.k, p.T * c.Hkv * c.D),
                           gact(p.v, p.T * c.Hkv * c.D), &p.gs);
        case_name(c, nm, sizeof nm);
        snprintf(what, sizeof what, "attn fwd out  %s", nm);
        cmp(what, get_act(go, p.T * c.H * c.D), p.out, p.T * c.H * c.D, TOL_BF16);
        snprintf(what, sizeof what, "attn fwd lse  %s", nm);
        cmp(what, get_f32(gl, p.T * c.H), p.lse, p.T * c.H, 1e-4);
        free_all();
    }
}

/* the most kept rows of any sequence (cf_rows.max_len) */
static int kept_max_len(const int *seq_start, int B) {
    int m = 0;
    for (int b = 0; b < B; b++) m = CF_MAX(m, seq_start[b + 1] - seq_start[b]);
    return m;
}

/* Kept rows per sequence b of a case: a pattern with uneven counts:
 * b%4 == 0: ~half at random, 1: a single token, 2: ~20%, 3: none. */
static void make_kept(const attn_case c, int **rows_out, int *seq_start, int *n_out, double keep) {
    int *rows = HOLD(inew((size_t)c.B * c.S));
    int n = 0;
    seq_start[0] = 0;
    for (int b = 0; b < c.B; b++) {
        int kind = b % 4;
        for (int s = 0; s < c.S; s++) {
            int take;
            if (keep >= 1.0) take = 1;
            else if (kind == 0) take = cf_rng_uniform(&rng) < keep;
            else if (kind == 1) take = s == c.S / 2 + 3;
            else if (kind == 2) take = cf_rng_uniform(&rng) < 0.2;
            else take = 0;
            if (take) rows[n++] = b * c.S + s;
        }
        seq_start[b + 1] = n;
    }
    *rows_out = rows;
    *n_out = n;
}

/* gathers rows of a [T, w] array */
static float *hgather(const float *a, const int *rows, int n, size_t w) {
    float *o = HOLD(hnew((size_t)n * w));
    for (int i = 0; i < n; i++) memcpy(o + (size_t)i * w, a + (size_t)rows[i] * w, w * sizeof(float));
    return o;
}

/* Runs one backward mode on both backends; returns the GPU gradients. The
 * GPU's kept->max_len is the exact maximum, or S when loose_max_len (an
 * upper bound: tiles past a sequence's count must do nothing). */
typedef struct { float *dq, *dk, *dv; } grads;
static int loose_max_len;
static cf_backend *attn_gpu; /* the GPU backend attn_bwd_both runs (NULL: gpu) */
static grads attn_bwd_both(attn_problem *p, cf_attn_bwd_mode mode, int *rows, int *seq_start, int n,
                           const char *label, double tol, int compare) {
    const attn_case c = p->c;
    const int full = mode == CF_ATTN_BWD_FULL;
    const size_t nq = full ? p->T : (size_t)n;
    /* rows of dk, dv: the q side's, or every row (CENTRIFUGE_KV) */
    const size_t nkr = mode == CF_ATTN_BWD_CENTRIFUGE_KV ? p->T : nq;
    const size_t wq = (size_t)c.H * c.D, wk = (size_t)c.Hkv * c.D;
    const float *q = full ? p->q : hgather(p->q, rows, n, wq);
    const float *out = full ? p->out : hgather(p->out, rows, n, wq);
    const float *dout = full ? p->dout : hgather(p->dout, rows, n, wq);
    const float *lse = full ? p->lse : hgather(p->lse, rows, n, c.H);
    cf_rows ck = {n, full ? 0 : kept_max_len(seq_start, c.B), rows, seq_start};
    cf_rows gk = ck;
    if (!full) {
        gk.rows = gi32(rows, n);
        gk.seq_start = gi32(seq_start, c.B + 1);
        if (loose_max_len) gk.max_len = c.S;
    }
    float *rdq = HOLD(hnew(nq * wq)), *rdk = HOLD(hnew(nkr * wk)), *rdv = HOLD(hnew(nkr * wk));
    cpu->attention_bwd(cpu, rdq, rdk, rdv, dout, q, p->k, p->v, out, lse, &p->cs, full ? NULL : &ck, mode);
    void *gdq = gact_nan(nq * wq), *gdk = gact_nan(nkr * wk), *gdv = gact_nan(nkr * wk);
    cf_backend *ag = attn_gpu ? attn_gpu : gpu;
    /* another context computes on its own stream: the uploads on gpu's
     * stream must be done before, and its results before the downloads */
    if (ag != gpu) CHECK(gpu->synchronize(gpu) == 0);
    ag->attention_bwd(ag, gdq, gdk, gdv, gact(dout, nq * wq), gact(q, nq * wq), gact(p->k, p->T * wk),
                       gact(p->v, p->T * wk), gact(out, nq * wq), gf32(lse, nq * c.H), &p->gs,
                       full ? NULL : &gk, mode);
    if (ag != gpu) CHECK(ag->synchronize(ag) == 0);
    grads g = {get_act(gdq, nq * wq), get_act(gdk, nkr * wk), get_act(gdv, nkr * wk)};
    if (compare) {
        char what[256];
        snprintf(what, sizeof what, "%s dq", label);
        cmp(what, g.dq, rdq, nq * wq, tol);
        snprintf(what, sizeof what, "%s dk", label);
        cmp(what, g.dk, rdk, nkr * wk, tol);
        snprintf(what, sizeof what, "%s dv", label);
        cmp(what, g.dv, rdv, nkr * wk, tol);
        if (mode == CF_ATTN_BWD_CENTRIFUGE_KV && (size_t)n < p->T) {
            /* the filtered keys' rows (what centrifuge drops), on their own scale */
            int *filt = HOLD(inew(p->T - n));
            int nf = 0;
            for (int t = 0, a = 0; t < (int)p->T; t++) {
                if (a < n && rows[a] == t) a++;
                else filt[nf++] = t;
            }
            snprintf(what, sizeof what, "%s dk filtered rows", label);
            cmp(what, hgather(g.dk, filt, nf, wk), hgather(rdk, filt, nf, wk), (size_t)nf * wk, tol);
            snprintf(what, sizeof what, "%s dv filtered rows", label);
            cmp(what, hgather(g.dv, filt, nf, wk), hgather(rdv, filt, nf, wk), (size_t)nf * wk, tol);
        }
    }
    return g;
}

TEST(attention_full_bwd_matches_cpu) {
    char nm[128], label[200];
    for (int ci = 0; ci < NCASES; ci++) {
        attn_problem p;
        attn_setup(&p, cases[ci]);
        snprintf(label, sizeof label, "FULL %s", case_name(p.c, nm, sizeof nm));
        attn_bwd_both(&p, CF_ATTN_BWD_FULL, NULL, NULL, 0, label, TOL_GRAD, 1);
        free_all();
    }
}

/* Centrifuge and strawman on uneven kept sets: a half-kept sequence, a
 * sequence with a single kept token, a 20% one and (B=4) one with none. */
TEST(attention_centrifuge_and_strawman_bwd_match_cpu_uneven_kept) {
    const attn_case cc[] = {
        {4, 150, 4, 2, 64, 0},
        {3, 130, 4, 1, 128, 3},
        {2, 70, 4, 2, 8, 0},
        {1, 300, 8, 2, 64, 0},
    };
    char nm[128], label[200];
    for (int ci = 0; ci < (int)(sizeof cc / sizeof cc[0]); ci++) {
        attn_problem p;
        attn_setup(&p, cc[ci]);
        int *rows, n, *ss = HOLD(inew(cc[ci].B + 1));
        make_kept(cc[ci], &rows, ss, &n, 0.5);
        case_name(p.c, nm, sizeof nm);
        snprintf(label, sizeof label, "CENTRIFUGE n=%d %s", n, nm);
        grads gc = attn_bwd_both(&p, CF_ATTN_BWD_CENTRIFUGE, rows, ss, n, label, TOL_GRAD, 1);
        snprintf(label, sizeof label, "STRAWMAN   n=%d %s", n, nm);
        grads gs = attn_bwd_both(&p, CF_ATTN_BWD_STRAWMAN, rows, ss, n, label, TOL_GRAD, 1);
        /* the strawman's dq misses the filtered keys: it must differ */
        double d = rel_err(gs.dq, gc.dq, (size_t)n * p.c.H * p.c.D);
        printf("    strawman vs centrifuge dq differ by %.2e\n", d);
        CHECK(d > 0.05);
        free_all();
    }
}

/* keep = 1: centrifuge and strawman equal the full backward (GPU vs GPU; dq
 * atomics make the order of fp32 additions differ, so 1e-2). */
TEST(attention_all_rows_kept_equals_full_on_gpu) {
    const attn_case c = {2, 130, 4, 2, 64, 2};
    attn_problem p;
    attn_setup(&p, c);
    int *rows, n, *ss = HOLD(inew(c.B + 1));
    make_kept(c, &rows, ss, &n, 1.0);
    grads gf = attn_bwd_both(&p, CF_ATTN_BWD_FULL, NULL, NULL, 0, "", 0, 0);
    grads gc = attn_bwd_both(&p, CF_ATTN_BWD_CENTRIFUGE, rows, ss, n, "", 0, 0);
    grads gs = attn_bwd_both(&p, CF_ATTN_BWD_STRAWMAN, rows, ss, n, "", 0, 0);
    const size_t nq = p.T * c.H * c.D, nk = p.T * c.Hkv * c.D;
    cmp("keep=1 centrifuge dq vs full", gc.dq, gf.dq, nq, TOL_BF16);
    cmp("keep=1 centrifuge dk vs full", gc.dk, gf.dk, nk, 0);
    cmp("keep=1 centrifuge dv vs full", gc.dv, gf.dv, nk, 0);
    cmp("keep=1 strawman dq vs full", gs.dq, gf.dq, nq, TOL_BF16);
    cmp("keep=1 strawman dk vs full", gs.dk, gf.dk, nk, TOL_BF16);
    free_all();
}

/* Centrifuge on sequences of several tiles (S >= 200) with uneven kept
 * counts per sequence (about half, one token, about 20%, none, and about
 * half again), per tensor against the CPU; once with the exact max_len and
 * once with max_len = S. */
TEST(attention_centrifuge_bwd_matches_cpu_several_tiles_uneven_kept) {
    const attn_case cc[] = {
        {5, 260, 4, 2, 64, 0},
        {4, 333, 8, 2, 128, 3},
        {4, 200, 4, 4, 32, 0},
    };
    char nm[128], label[200];
    for (int ci = 0; ci < (int)(sizeof cc / sizeof cc[0]); ci++) {
        for (int loose = 0; loose < 2; loose++) {
            attn_problem p;
            attn_setup(&p, cc[ci]);
            int *rows, n, *ss = HOLD(inew(cc[ci].B + 1));
            make_kept(cc[ci], &rows, ss, &n, 0.5);
            char counts[64] = "";
            for (int b = 0; b < cc[ci].B; b++)
                snprintf(counts + strlen(counts), sizeof counts - strlen(counts), "%s%d", b ? "/" : "",
                         ss[b + 1] - ss[b]);
            case_name(p.c, nm, sizeof nm);
            snprintf(label, sizeof label, "CENTRIFUGE %s kept %s%s", nm, counts, loose ? " max_len=S" : "");
            loose_max_len = loose;
            attn_bwd_both(&p, CF_ATTN_BWD_CENTRIFUGE, rows, ss, n, label, TOL_GRAD, 1);
            loose_max_len = 0;
            free_all();
        }
    }
}

/* CENTRIFUGE_KV (dq of kept queries as centrifuge; dk, dv of EVERY key
 * from the kept queries, [T, Hkv, D]) against the CPU on sequences of
 * several tiles (S >= 200) with uneven kept counts per sequence (about
 * half, one token, about 20%, none, ...), D = 64 and 128, with and without
 * GQA, a document mask, the zero-padded head dim, exact and loose max_len.
 * On the GPU its dq and kept-row dk, dv must also agree with CENTRIFUGE's
 * (different kernels: dq by atomics here), and with every row kept it must
 * equal FULL. */
TEST(attention_centrifuge_kv_bwd_matches_cpu_several_tiles_uneven_kept) {
    const attn_case cc[] = {
        {5, 260, 4, 2, 64, 0},
        {4, 333, 8, 2, 128, 3},
        {3, 256, 8, 8, 64, 0},
        {2, 300, 4, 1, 128, 0},
        {4, 200, 4, 2, 8, 2},
    };
    char nm[128], label[200];
    for (int ci = 0; ci < (int)(sizeof cc / sizeof cc[0]); ci++) {
        for (int loose = 0; loose < 2; loose++) {
            attn_problem p;
            attn_setup(&p, cc[ci]);
            int *rows, n, *ss = HOLD(inew(cc[ci].B + 1));
            make_kept(cc[ci], &rows, ss, &n, 0.5);
            char counts[64] = "";
            for (int b = 0; b < cc[ci].B; b++)
                snprintf(counts + strlen(counts), sizeof counts - strlen(counts), "%s%d", b ? "/" : "",
                         ss[b + 1] - ss[b]);
            case_name(p.c, nm, sizeof nm);
            snprintf(label, sizeof label, "CENTRIFUGE_KV %s kept %s%s", nm, counts, loose ? " max_len=S" : "");
            loose_max_len = loose;
            grads gk = attn_bwd_both(&p, CF_ATTN_BWD_CENTRIFUGE_KV, rows, ss, n, label, TOL_GRAD, 1);
            grads gc = attn_bwd_both(&p, CF_ATTN_BWD_CENTRIFUGE, rows, ss, n, "", 0, 0);
            loose_max_len = 0;
            const size_t wq = (size_t)p.c.H * p.c.D, wk = (size_t)p.c.Hkv * p.c.D;
            if (!loose) {
                cmp("  kv vs centrifuge dq (GPU)", gk.dq, gc.dq, (size_t)n * wq, TOL_GRAD);
                cmp("  kv vs centrifuge kept-row dk (GPU)", hgather(gk.dk, rows, n, wk), gc.dk, (size_t)n * wk,
                    TOL_GRAD);
                cmp("  kv vs centrifuge kept-row dv (GPU)", hgather(gk.dv, rows, n, wk), gc.dv, (size_t)n * wk,
                    TOL_GRAD);
            }
            free_all();
        }
    }
    const attn_case c = {2, 260, 8, 2, 64, 2};
    attn_problem p;
    attn_setup(&p, c);
    int *rows, n, *ss = HOLD(inew(c.B + 1));
    make_kept(c, &rows, ss, &n, 1.0);
    grads gf = attn_bwd_both(&p, CF_ATTN_BWD_FULL, NULL, NULL, 0, "", 0, 0);
    grads gk = attn_bwd_both(&p, CF_ATTN_BWD_CENTRIFUGE_KV, rows, ss, n, "", 0, 0);
    const size_t nq = p.T * c.H * c.D, nk = p.T * c.Hkv * c.D;
    cmp("keep=1 centrifuge-kv dq vs full", gk.dq, gf.dq, nq, TOL_BF16);
    cmp("keep=1 centrifuge-kv dk vs full", gk.dk, gf.dk, nk, 0);
    cmp("keep=1 centrifuge-kv dv vs full", gk.dv, gf.dv, nk, 0);
    free_all();
}

/* A larger problem: 16 tiles, keep 0.5 at random. */
TEST(attention_centrifuge_matches_cpu_on_larger_problem) {
    const attn_case c = {1, 1024, 8, 2, 64, 0};
    attn_problem p;
    attn_setup(&p, c);
    int *rows, n, *ss = HOLD(inew(c.B + 1));
    make_kept(c, &rows, ss, &n, 0.5);
    char label[64];
    snprintf(label, sizeof label, "CENTRIFUGE S=1024 n=%d", n);
    attn_bwd_both(&p, CF_ATTN_BWD_CENTRIFUGE, rows, ss, n, label, TOL_GRAD, 1);
    attn_bwd_both(&p, CF_ATTN_BWD_FULL, NULL, NULL, 0, "FULL S=1024", TOL_GRAD, 1);
    free_all();
}

/* ============================================= Hopper vs portable kernels */

static int attn_path_of(cf_backend *b) { return ((const cf_cuda_ctx *)b->device_context(b))->attn_path; }

/* A forward on a tiny problem, so that the context picks its attention path
 * (attention/launch_sm90.cu reads CENTRIFUGE_ATTENTION at the first call). */
static void pick_attn_path(cf_backend *b) {
    cf_attn_shape s = {1, 8, 2, 2, 64, 0.125f, NULL};
    void *x = b->alloc(b, 8 * 2 * 64 * 2), *o = b->alloc(b, 8 * 2 * 64 * 2);
    float *l = b->alloc(b, 8 * 2 * 4);
    if (x && o && l) {
        b->memzero(b, x, 8 * 2 * 64 * 2);
        b->attention_fwd(b, o, l, x, x, x, &s);
        b->synchronize(b);
    }
    b->free(b, x);
    b->free(b, o);
    b->free(b, l);
}

/* On a compute capability 9.0 GPU (unless CENTRIFUGE_ATTENTION=portable)
 * the shared context must run the Hopper kernels, or the attention tests
 * above would only test the portable ones. */
TEST(attention_path_is_hopper_on_sm90) {
    const cf_cuda_ctx *ctx = gpu->device_context(gpu);
    const char *env = getenv("CENTRIFUGE_ATTENTION");
    const int want_hopper = ctx->cc_major == 9 && ctx->cc_minor == 0 && !(env && strcmp(env, "portable") == 0);
    printf("    cc %d.%d, attention path %s, portable context %s\n", ctx->cc_major, ctx->cc_minor,
           attn_path_of(gpu) == 2 ? "hopper (sm_90a)" : "portable (mma.sync)",
           gpu_port ? "created" : "not created");
    CHECK(attn_path_of(gpu) == (want_hopper ? 2 : 1));
    if (gpu_port) CHECK(attn_path_of(gpu_port) == 1);
}

/* The Hopper kernels against the portable ones on the same inputs (both
 * also against the CPU): forward out and lse, and the FULL and CENTRIFUGE
 * gradients, on ragged multi-tile sequences with GQA and document masks. */
/* The shared context's device context where it runs the Hopper kernels;
 * else NULL, with the test's skip printed */
static cf_cuda_ctx *hopper_ctx_or_skip(void) {
    if (attn_path_of(gpu) == 2) return gpu->device_context(gpu);
    printf("    skipped: the shared context runs the portable kernels\n");
    return NULL;
}

/* The Hopper forward at head dim 64 with three consumer warpgroups (192
 * queries per block, end-aligned tiles) against two: each row walks the
 * same key tiles in the same order either way (a tile past a row's own key
 * adds exact zeros), so out and lse must agree bit for bit; and both
 * against the CPU. Tails of every kind: S not a multiple of 64, 128 or 192,
 * documents, GQA, several sequences. */
TEST(attention_hopper_fwd_three_warpgroups_give_the_two_warpgroup_bits) {
    cf_cuda_ctx *ctx = hopper_ctx_or_skip();
    if (!ctx) return;
    const attn_case cc[] = {{2, 300, 8, 2, 64, 3}, {1, 1000, 4, 2, 64, 0}, {3, 200, 8, 1, 64, 2},
                            {1, 450, 4, 4, 64, 0}, {1, 192, 2, 1, 64, 0},  {2, 70, 4, 2, 64, 0}};
    char nm[128], what[256];
    for (int ci = 0; ci < (int)(sizeof cc / sizeof cc[0]); ci++) {
        attn_problem p;
        attn_setup(&p, cc[ci]);
        const attn_case c = p.c;
        case_name(c, nm, sizeof nm);
        const size_t nq = p.T * c.H * c.D, nl = p.T * c.H;
        void *q = gact(p.q, nq), *k = gact(p.k, p.T * c.Hkv * c.D), *v = gact(p.v, p.T * c.Hkv * c.D);
        float *out[2], *lse[2];
        for (int w = 0; w < 2; w++) {
            void *o = gact_nan(nq), *l = gf32_nan(nl);
            ctx->attn_fwd_wg = 2 + w;
            gpu->attention_fwd(gpu, o, l, q, k, v, &p.gs);
            ctx->attn_fwd_wg = 0;
            CHECK(gpu->synchronize(gpu) == 0);
            out[w] = get_act(o, nq);
            lse[w] = get_f32(l, nl);
            snprintf(what, sizeof what, "fwd out, %d warpgroups, vs cpu %s", 2 + w, nm);
            cmp(what, out[w], p.out, nq, TOL_BF16);
            snprintf(what, sizeof what, "fwd lse, %d warpgroups, vs cpu %s", 2 + w, nm);
            cmp(what, lse[w], p.lse, nl, 1e-4);
        }
        CHECK_MSG(bitwise_equal(out[0], out[1], nq) && bitwise_equal(lse[0], lse[1], nl),
                  "three warpgroups differ from two: %s", nm);
        free_all();
    }
}

TEST(attention_hopper_matches_portable_kernels) {
    if (!gpu_port) {
        printf("    skipped: the shared context runs the portable kernels\n");
        return;
    }
    const attn_case cc[] = {
        {2, 300, 8, 2, 64, 3},
        {1, 333, 4, 4, 128, 0},
        {3, 200, 8, 1, 128, 2},
        {1, 1000, 4, 2, 64, 0},
    };
    char nm[128], what[256];
    for (int ci = 0; ci < (int)(sizeof cc / sizeof cc[0]); ci++) {
        attn_problem p;
        attn_setup(&p, cc[ci]);
        const attn_case c = p.c;
        case_name(c, nm, sizeof nm);
        const size_t nq = p.T * c.H * c.D, nkv = p.T * c.Hkv * c.D;
        void *q = gact(p.q, nq), *k = gact(p.k, nkv), *v = gact(p.v, nkv);
        void *oh = gact_nan(nq), *op = gact_nan(nq), *lh = gf32_nan(p.T * c.H), *lp = gf32_nan(p.T * c.H);
        gpu->attention_fwd(gpu, oh, lh, q, k, v, &p.gs);
        CHECK(gpu->synchronize(gpu) == 0); /* inputs uploaded on gpu's stream */
        gpu_port->attention_fwd(gpu_port, op, lp, q, k, v, &p.gs);
        CHECK(gpu_port->synchronize(gpu_port) == 0);
        float *foh = get_act(oh, nq), *fop = get_act(op, nq);
        snprintf(what, sizeof what, "fwd out hopper vs cpu      %s", nm);
        cmp(what, foh, p.out, nq, TOL_BF16);
        snprintf(what, sizeof what, "fwd out hopper vs portable %s", nm);
        cmp(what, foh, fop, nq, TOL_BF16);
        snprintf(what, sizeof what, "fwd lse hopper vs portable %s", nm);
        cmp(what, get_f32(lh, p.T * c.H), get_f32(lp, p.T * c.H), p.T * c.H, 1e-4);

        grads gh = attn_bwd_both(&p, CF_ATTN_BWD_FULL, NULL, NULL, 0, "", 0, 0);
        attn_gpu = gpu_port;
        grads gp = attn_bwd_both(&p, CF_ATTN_BWD_FULL, NULL, NULL, 0, "", 0, 0);
        attn_gpu = NULL;
        const size_t nk = p.T * c.Hkv * c.D;
        snprintf(what, sizeof what, "FULL dq hopper vs portable %s", nm);
        cmp(what, gh.dq, gp.dq, nq, TOL_GRAD);
        snprintf(what, sizeof what, "FULL dk hopper vs portable %s", nm);
        cmp(what, gh.dk, gp.dk, nk, TOL_GRAD);
        snprintf(what, sizeof what, "FULL dv hopper vs portable %s", nm);
        cmp(what, gh.dv, gp.dv, nk, TOL_GRAD);

        int *rows, n, *ss = HOLD(inew(c.B + 1));
        make_kept(c, &rows, ss, &n, 0.5);
        snprintf(what, sizeof what, "CENTRIFUGE hopper vs cpu %s", nm);
        gh = attn_bwd_both(&p, CF_ATTN_BWD_CENTRIFUGE, rows, ss, n, what, TOL_GRAD, 1);
        attn_gpu = gpu_port;
        gp = attn_bwd_both(&p, CF_ATTN_BWD_CENTRIFUGE, rows, ss, n, "", 0, 0);
        attn_gpu = NULL;
        snprintf(what, sizeof what, "CENTRIFUGE dq hopper vs portable %s", nm);
        cmp(what, gh.dq, gp.dq, (size_t)n * c.H * c.D, TOL_GRAD);
        snprintf(what, sizeof what, "CENTRIFUGE dk hopper vs portable %s", nm);
        cmp(what, gh.dk, gp.dk, (size_t)n * c.Hkv * c.D, TOL_GRAD);
        snprintf(what, sizeof what, "CENTRIFUGE dv hopper vs portable %s", nm);
        cmp(what, gh.dv, gp.dv, (size_t)n * c.Hkv * c.D, TOL_GRAD);
        free_all();
    }
}

/* The backward modes the Hopper plan tests below run in turn, and their names */
static const cf_attn_bwd_mode bwd_modes[3] = {CF_ATTN_BWD_FULL, CF_ATTN_BWD_CENTRIFUGE, CF_ATTN_BWD_CENTRIFUGE_KV};
static const char *const bwd_mode_names[3] = {"FULL", "CENTRIFUGE", "CENTRIFUGE_KV"};

/* case c set up (attn_setup), its name into nm[128], and half of each
 * sequence's rows kept (make_kept: *rows, *n, sequence starts *ss) */
static void attn_setup_kept_half(attn_problem *p, attn_case c, char *nm, int **rows, int **ss, int *n) {
    attn_setup(p, c);
    case_name(p->c, nm, 128);
    *ss = HOLD(inew(p->c.B + 1));
    make_kept(p->c, rows, *ss, n, 0.5);
}

/* The Hopper backward with 1, 2, 4 and 8 query heads per block and 1 and
 * 2 parts of each key tile's query range (the grid-size rules pick them by
 * shape; all eight forced here through the context; a count that does not
 * divide the group falls to the next lower divisor: 4 gives 3 in groups
 * of 3 and 6, 8 gives the group itself in groups of 3 and 4): each against
 * the CPU, and against hpb = 1 with one part (dk, dv partials of 1 to 8
 * heads and 1 or 2 parts, reduced over H/hpb x ns of them; a block with a
 * kv head's whole group in one part writes dk, dv itself: a layout error
 * or a lost part shows as O(1)), FULL, CENTRIFUGE and CENTRIFUGE_KV, GQA
 * groups of 3, 4, 6 and 8, and no GQA (parts need the partials there
 * too). */
TEST(attention_hopper_bwd_heads_per_block_and_query_parts_match) {
    cf_cuda_ctx *ctx = hopper_ctx_or_skip();
    if (!ctx) return;
    const attn_case cc[] = {{2, 300, 8, 2, 64, 3},  {3, 200, 8, 1, 128, 2}, {1, 333, 4, 4, 128, 0},
                            {2, 260, 6, 2, 128, 3}, {1, 300, 12, 2, 64, 0}};
    const int ncc = (int)(sizeof cc / sizeof cc[0]);
    static const int cfg[][2] = {{1, 1}, {2, 1}, {1, 2}, {2, 2}, {4, 1}, {4, 2}, {8, 1}, {8, 2}}; /* hpb, parts */
    const int ncfg = (int)(sizeof cfg / sizeof cfg[0]);
    char nm[128], what[256];
    for (int ci = 0; ci < ncc; ci++) {
        attn_problem p;
        int *rows, n, *ss;
        attn_setup_kept_half(&p, cc[ci], nm, &rows, &ss, &n);
        const attn_case c = p.c;
        for (int m = 0; m < 3; m++) {
            grads g[sizeof cfg / sizeof cfg[0]];
            for (int k = 0; k < ncfg; k++) {
                ctx->attn_bwd_hpb = cfg[k][0];
                ctx->attn_bwd_split = cfg[k][1];
                snprintf(what, sizeof what, "%s hpb=%d parts=%d %s", bwd_mode_names[m], cfg[k][0], cfg[k][1], nm);
                g[k] = attn_bwd_both(&p, bwd_modes[m], rows, ss, n, what, TOL_GRAD, 1);
            }
            ctx->attn_bwd_hpb = ctx->attn_bwd_split = 0;
            const size_t nq = m == 0 ? p.T : (size_t)n, nkr = m == 1 ? (size_t)n : p.T;
            for (int k = 1; k < ncfg; k++) {
                snprintf(what, sizeof what, "%s dq hpb=%d parts=%d vs 1/1 %s", bwd_mode_names[m], cfg[k][0], cfg[k][1], nm);
                cmp(what, g[0].dq, g[k].dq, nq * c.H * c.D, TOL_BF16);
                snprintf(what, sizeof what, "%s dk hpb=%d parts=%d vs 1/1 %s", bwd_mode_names[m], cfg[k][0], cfg[k][1], nm);
                cmp(what, g[0].dk, g[k].dk, nkr * c.Hkv * c.D, TOL_BF16);
                snprintf(what, sizeof what, "%s dv hpb=%d parts=%d vs 1/1 %s", bwd_mode_names[m], cfg[k][0], cfg[k][1], nm);
                cmp(what, g[0].dv, g[k].dv, nkr * c.Hkv * c.D, TOL_BF16);
            }
        }
        free_all();
    }
}

/* Where a kv head's dk, dv have exactly two partials (two groups of query
 * heads, or one group in two parts), pairs of blocks (clusters of two) sum
 * them between themselves instead of writing fp32 partials for the finish
 * launch (bwd_sm90.cu). The sum of two terms does not depend on their
 * order, so the bits must be the partials path's, in every mode; dq is the
 * same computation in both (up to the order of its fp32 additions). */
TEST(attention_hopper_bwd_pairs_give_the_partials_bits) {
    cf_cuda_ctx *ctx = hopper_ctx_or_skip();
    if (!ctx) return;
    /* hpb, parts: two groups of heads (G = 4 and 8), or two parts (G = 1 and 2) */
    const struct { attn_case c; int hpb, ns; } cc[] = {
        {{2, 300, 8, 2, 64, 3}, 2, 1}, {{3, 200, 8, 1, 128, 2}, 4, 1}, {{1, 333, 4, 4, 128, 0}, 1, 2},
        {{2, 260, 4, 2, 64, 0}, 2, 2}, {{1, 520, 4, 2, 128, 0}, 1, 1}};
    char nm[128], what[256];
    for (int ci = 0; ci < (int)(sizeof cc / sizeof cc[0]); ci++) {
        attn_problem p;
        int *rows, n, *ss;
        attn_setup_kept_half(&p, cc[ci].c, nm, &rows, &ss, &n);
        const attn_case c = p.c;
        for (int m = 0; m < 3; m++) {
            grads g[2];
            for (int k = 0; k < 2; k++) {
                ctx->attn_bwd_hpb = cc[ci].hpb;
                ctx->attn_bwd_split = cc[ci].ns;
                ctx->attn_bwd_nopair = k == 0;
                snprintf(what, sizeof what, "%s hpb=%d parts=%d %s %s", bwd_mode_names[m], cc[ci].hpb, cc[ci].ns,
                         k ? "pairs" : "partials", nm);
                g[k] = attn_bwd_both(&p, bwd_modes[m], rows, ss, n, what, TOL_GRAD, 1);
            }
            ctx->attn_bwd_hpb = ctx->attn_bwd_split = ctx->attn_bwd_nopair = 0;
            const size_t nq = m == 0 ? p.T : (size_t)n, nkr = m == 1 ? (size_t)n : p.T;
            snprintf(what, sizeof what, "%s pairs vs partials dk, dv bitwise %s", bwd_mode_names[m], nm);
            CHECK_MSG(bitwise_equal(g[0].dk, g[1].dk, nkr * c.Hkv * c.D) &&
                          bitwise_equal(g[0].dv, g[1].dv, nkr * c.Hkv * c.D),
                      "%s: differ", what);
            snprintf(what, sizeof what, "%s pairs vs partials dq %s", bwd_mode_names[m], nm);
            cmp(what, g[0].dq, g[1].dq, nq * c.H * c.D, TOL_BF16);
        }
        free_all();
    }
    /* the pairs ran: their clusters fit on this GPU */
    CHECK_MSG(ctx->attn_pair_ok != 0, "no Hopper backward kernel ran in clusters of two");
}

/* Centrifuge part 2 on Hopper (dq of the kept queries over the filtered
 * keys) with and without its consumers' ping-pong turns (off by default;
 * forced through the context): each against the CPU, and dq of the two
 * against each other (the same products; only the order of the fp32
 * additions into the accumulator differs). Kept-query tiles (128 per
 * tile) of 1 to 5 per sequence, sequences with one kept row or none,
 * documents, GQA, both head dims. */
/* Part 2's variants: turns off and on; a block per SM (persistent, taking
 * work items from the queue), a block per item, and four blocks (each
 * takes many items: the two item slots' phases turn many times). Each
 * against the CPU, and each one's dq against the first's. */
TEST(attention_hopper_centrifuge_part2_turns_and_grids_match_cpu) {
    cf_cuda_ctx *ctx = hopper_ctx_or_skip();
    if (!ctx) return;
    const attn_case cc[] = {{1, 700, 4, 2, 64, 0},  {3, 1000, 4, 1, 128, 2}, {2, 1100, 4, 2, 64, 0},
                            {1, 900, 4, 4, 128, 0}, {4, 600, 2, 1, 64, 3},   {2, 650, 3, 1, 128, 2},
                            {1, 1300, 6, 2, 64, 0}};
    char nm[128], what[256];
    for (int ci = 0; ci < (int)(sizeof cc / sizeof cc[0]); ci++) {
        attn_problem p;
        int *rows, n, *ss;
        attn_setup_kept_half(&p, cc[ci], nm, &rows, &ss, &n);
        static const struct {
            int pingpong, grid;
            const char *name;
        } var[] = {{1, 2, "turns off, a block per SM"},
                   {2, 2, "turns on, a block per SM"},
                   {1, 1, "turns off, a block per item"},
                   {2, 3, "turns on, four blocks"},
                   {1, 3, "turns off, four blocks"}};
        enum { NV = sizeof var / sizeof var[0] };
        grads g[NV];
        for (int k = 0; k < NV; k++) {
            ctx->attn_cf_pingpong = var[k].pingpong;
            ctx->attn_cf_grid = var[k].grid;
            snprintf(what, sizeof what, "CENTRIFUGE part 2 %s %s", var[k].name, nm);
            g[k] = attn_bwd_both(&p, CF_ATTN_BWD_CENTRIFUGE, rows, ss, n, what, TOL_GRAD, 1);
        }
        ctx->attn_cf_pingpong = ctx->attn_cf_grid = 0;
        for (int k = 1; k < NV; k++) {
            snprintf(what, sizeof what, "CENTRIFUGE dq, %s vs %s %s", var[k].name, var[0].name, nm);
            cmp(what, g[0].dq, g[k].dq, (size_t)n * p.c.H * p.c.D, TOL_BF16);
        }
        free_all();
    }
}

/* Centrifuge's two Hopper parts chained (part 2 the programmatic dependent
 * of part 1 on one stream, the finish part 2's: the default), beside (part
 * 2 on the second stream) and after one another, forced through the
 * context: each against the CPU, dq of each against the chained one's (the
 * same products; the order of the fp32 additions into the accumulator may
 * differ), dk and dv bitwise where the launch plan is the same (beside:
 * part 2 does not touch them; after, part 1's plan may differ: against the
 * CPU only). Kept-query tiles of 1 to 5 per sequence, sequences with one
 * kept row or none, documents, GQA with and without partials, both head
 * dims; chained twice, since a missing wait between the launches would
 * show as a difference that comes and goes. */
TEST(attention_hopper_centrifuge_parts_after_beside_and_chained_match_cpu) {
    cf_cuda_ctx *ctx = hopper_ctx_or_skip();
    if (!ctx) return;
    const attn_case cc[] = {{1, 700, 4, 2, 64, 0}, {3, 1000, 4, 1, 128, 2}, {2, 1100, 8, 2, 64, 0},
                            {1, 2048, 12, 2, 128, 0}, {2, 650, 3, 1, 128, 2}};
    static const struct {
        int parts;
        const char *name;
        int same_plan; /* as the chained one's */
    } var[] = {{3, "chained", 1}, {2, "beside", 1}, {3, "chained again", 1}, {1, "after", 0}};
    enum { NV = sizeof var / sizeof var[0] };
    char nm[128], what[256];
    for (int ci = 0; ci < (int)(sizeof cc / sizeof cc[0]); ci++) {
        attn_problem p;
        int *rows, n, *ss;
        attn_setup_kept_half(&p, cc[ci], nm, &rows, &ss, &n);
        grads g[NV];
        for (int k = 0; k < NV; k++) {
            ctx->attn_cf_parts = var[k].parts;
            snprintf(what, sizeof what, "CENTRIFUGE parts %s %s", var[k].name, nm);
            g[k] = attn_bwd_both(&p, CF_ATTN_BWD_CENTRIFUGE, rows, ss, n, what, TOL_GRAD, 1);
        }
        ctx->attn_cf_parts = 0;
        const size_t nkv = (size_t)n * p.c.Hkv * p.c.D; /* dk, dv: the kept rows */
        for (int k = 1; k < NV; k++) {
            snprintf(what, sizeof what, "CENTRIFUGE dq, parts %s vs %s %s", var[k].name, var[0].name, nm);
            cmp(what, g[0].dq, g[k].dq, (size_t)n * p.c.H * p.c.D, TOL_BF16);
            if (var[k].same_plan)
                CHECK_MSG(bitwise_equal(g[0].dk, g[k].dk, nkv) && bitwise_equal(g[0].dv, g[k].dv, nkv),
                          "CENTRIFUGE dk, dv: parts %s differ from %s %s", var[k].name, var[0].name, nm);
        }
        free_all();
    }
}

/* attention_bwd_leaves_idle (dwside.c runs weight gradients beside full
 * backwards it says yes to: grids under 1.5 waves): a small shape is, four
 * sequences of TinyLlama's are not; on a 132-SM GPU with the Hopper path,
 * TinyLlama @4096 (256 blocks) and Llama3.2-3B @2048 (256) are not,
 * Qwen2.5-1.5B @2048 (192) is (the plans of bwd_plan, run 24). */
TEST(attention_bwd_leaves_idle_where_the_plan_is_under_one_and_a_half_waves) {
    const cf_cuda_ctx *ctx = gpu->device_context(gpu);
    CHECK(gpu->attention_bwd_leaves_idle != NULL);
    if (!gpu->attention_bwd_leaves_idle) return;
    const cf_attn_shape small = {1, 64, 4, 2, 64, 0.125f, NULL}, many = {4, 4096, 32, 4, 64, 0.125f, NULL};
    const cf_attn_shape tiny_llama = {1, 4096, 32, 4, 64, 0.125f, NULL}, llama3b = {1, 2048, 24, 8, 128, 0.0884f, NULL};
    const cf_attn_shape qwen = {1, 2048, 12, 2, 128, 0.0884f, NULL};
    CHECK(gpu->attention_bwd_leaves_idle(gpu, &small) == 1);
    CHECK(gpu->attention_bwd_leaves_idle(gpu, &many) == 0);
    const int t = gpu->attention_bwd_leaves_idle(gpu, &tiny_llama), l = gpu->attention_bwd_leaves_idle(gpu, &llama3b),
              q = gpu->attention_bwd_leaves_idle(gpu, &qwen);
    printf("    %d SMs, %s path: leaves SMs idle at TinyLlama %d, Llama3.2-3B %d, Qwen2.5-1.5B %d\n", ctx->sm_count,
           attn_path_of(gpu) == 2 ? "hopper" : "portable", t, l, q);
    if (ctx->sm_count == 132 && attn_path_of(gpu) == 2) CHECK(t == 0 && l == 0 && q == 1);
    CHECK(gpu->check(gpu) == 0);
}

/* ================================================= contexts and errors */

/* An op that fails leaves its context failed: check, synchronize, upload and
 * download return -1 with the first message, later ops do nothing, alloc
 * returns NULL. Another context on the same GPU is not affected, and out of
 * memory in alloc is reported (not sticky). */
TEST(errors_are_sticky_and_a_second_context_is_independent) {
    cf_backend *e = cf_backend_cuda_create(0);
    CHECK_MSG(e != NULL, "second context: %s", cf_last_error());
    if (!e) return;
    CHECK(e->check(e) == 0 && e->synchronize(e) == 0);
    void *q = e->alloc(e, 1 << 16), *out = e->alloc(e, 1 << 16);
    float *lse = e->alloc(e, 1 << 12);
    CHECK(q && out && lse);
    cf_attn_shape bad = {1, 4, 2, 2, 256, 0.0625f, NULL}; /* head_dim 256 has no kernel */
    e->attention_fwd(e, out, lse, q, q, q, &bad);
    cf_fail("%s", "");
    CHECK(e->check(e) == -1);
    CHECK_MSG(strstr(cf_last_error(), "head_dim") != NULL, "check: %s", cf_last_error());
    cf_attn_shape ok = {1, 4, 2, 2, 64, 0.125f, NULL};
    e->attention_bwd(e, out, out, out, q, q, q, q, q, lse, &ok, NULL, CF_ATTN_BWD_CENTRIFUGE); /* no kept rows */
    cf_fail("%s", "");
    CHECK(e->synchronize(e) == -1);
    CHECK_MSG(strstr(cf_last_error(), "head_dim") != NULL, "synchronize keeps the first error: %s", cf_last_error());
    float h[4] = {1, 2, 3, 4}, back[4] = {-1, -1, -1, -1};
    CHECK(e->upload(e, q, h, sizeof h) == -1);
    CHECK(e->download(e, back, q, sizeof back) == -1);
    CHECK(back[0] == -1 && back[3] == -1);
    CHECK(e->alloc(e, 16) == NULL);
    e->free(e, q);
    e->free(e, out);
    e->free(e, lse);
    e->destroy(e);
    CHECK(gpu->check(gpu) == 0);

    cf_fail("%s", "");
    void *huge = gpu->alloc(gpu, (size_t)1 << 50);
    CHECK(huge == NULL);
    printf("    %s\n", cf_last_error());
    CHECK(strstr(cf_last_error(), "cudaMalloc of") != NULL && strstr(cf_last_error(), "free") != NULL &&
          strstr(cf_last_error(), "--batch") != NULL);
    CHECK(gpu->check(gpu) == 0); /* out of memory in alloc is not sticky */
}

/* Two contexts (GPU 1 if there is one, else a second one on GPU 0) driven
 * from one thread, ops interleaved: each runs on its own device and stream
 * and sets its own kernel attributes (head_dim 128 needs more than 48 KiB of
 * shared memory). Attention forward is deterministic: bitwise equal. */
TEST(two_contexts_interleaved_give_the_same_results) {
    cf_backend *b2 = cf_backend_cuda_create(1);
    const int dev2 = b2 ? 1 : 0;
    if (!b2) b2 = cf_backend_cuda_create(0);
    CHECK_MSG(b2 != NULL, "second context: %s", cf_last_error());
    if (!b2) return;
    printf("    second context on GPU %d\n", dev2);
    const attn_case c = {2, 150, 4, 2, 128, 0};
    const size_t T = (size_t)c.B * c.S, nq = T * c.H * c.D, nk = T * c.Hkv * c.D;
    float *q = HOLD(hrand(nq, 1.f)), *k = HOLD(hrand(nk, 1.f)), *v = HOLD(hrand(nk, 1.f));
    const int K = 128, N = 96;
    float *x = HOLD(hrand(T * K, 1.f)), *w = HOLD(hrand((size_t)N * K, 0.1f));
    cf_backend *bs[2] = {gpu, b2};
    void *dq[2], *dk[2], *dv[2], *dout[2], *dx[2], *dw[2], *dy[2];
    float *dlse[2];
    for (int i = 0; i < 2; i++) {
        cf_backend *b = bs[i];
        dq[i] = b->alloc(b, nq * 2);
        dk[i] = b->alloc(b, nk * 2);
        dv[i] = b->alloc(b, nk * 2);
        dout[i] = b->alloc(b, nq * 2);
        dlse[i] = b->alloc(b, T * c.H * 4);
        dx[i] = b->alloc(b, T * K * 2);
        dw[i] = b->alloc(b, (size_t)N * K * 2);
        dy[i] = b->alloc(b, T * N * 2);
        CHECK(dq[i] && dk[i] && dv[i] && dout[i] && dlse[i] && dx[i] && dw[i] && dy[i]);
    }
    if (!dy[0] || !dy[1]) return;
    cf_attn_shape s = {c.B, c.S, c.H, c.Hkv, c.D, 1.0f / sqrtf((float)c.D), NULL};
    for (int i = 0; i < 2; i++) {
        bs[i]->act_from_f32(bs[i], dq[i], q, nq);
        bs[i]->act_from_f32(bs[i], dk[i], k, nk);
        bs[i]->act_from_f32(bs[i], dv[i], v, nk);
        bs[i]->act_from_f32(bs[i], dx[i], x, T * K);
        bs[i]->act_from_f32(bs[i], dw[i], w, (size_t)N * K);
    }
    for (int rep = 0; rep < 2; rep++)
        for (int i = 0; i < 2; i++) {
            bs[i]->attention_fwd(bs[i], dout[i], dlse[i], dq[i], dk[i], dv[i], &s);
            bs[i]->matmul_fwd(bs[i], dy[i], dx[i], dw[i], NULL, (int)T, K, N);
        }
    float *o[2], *l[2], *y[2];
    for (int i = 0; i < 2; i++) {
        CHECK(bs[i]->synchronize(bs[i]) == 0);
        o[i] = HOLD(hnew(nq));
        l[i] = HOLD(hnew(T * c.H));
        y[i] = HOLD(hnew(T * N));
        bs[i]->act_to_f32(bs[i], o[i], dout[i], nq);
        CHECK(bs[i]->download(bs[i], l[i], dlse[i], T * c.H * 4) == 0);
        bs[i]->act_to_f32(bs[i], y[i], dy[i], T * N);
    }
    float *ref = HOLD(hnew(nq)), *rl = HOLD(hnew(T * c.H));
    cpu->attention_fwd(cpu, ref, rl, q, k, v, &s);
    cmp("context 1 attention out vs cpu", o[0], ref, nq, TOL_BF16);
    cmp("context 2 attention out vs cpu", o[1], ref, nq, TOL_BF16);
    CHECK(bitwise_equal(o[0], o[1], nq));
    CHECK(bitwise_equal(l[0], l[1], T * c.H));
    cmp("context 2 vs context 1 matmul", y[1], y[0], T * N, TOL_BF16);
    for (int i = 0; i < 2; i++) {
        void *bufs[] = {dq[i], dk[i], dv[i], dout[i], dlse[i], dx[i], dw[i], dy[i]};
        for (int j = 0; j < 8; j++) bs[i]->free(bs[i], bufs[j]);
    }
    CHECK(b2->check(b2) == 0);
    b2->destroy(b2);
    free_all();
}

/* CF_TEST_SEED=n draws other inputs; CF_TEST_ONLY=word runs the tests whose
 * name contains word (e.g. under compute-sanitizer). */
static const char *only;
#define RUN_IF(name) do { if (!only || strstr(#name, only)) RUN(name); } while (0)

int main(void) {
    const char *seed = getenv("CF_TEST_SEED");
    only = getenv("CF_TEST_ONLY");
    cf_rng_seed(&rng, seed ? strtoull(seed, NULL, 10) : 20251121);
    cpu = cf_backend_cpu_create();
    gpu = cf_backend_cuda_create(0);
    if (!cpu || !gpu) {
        printf("cannot create backends: %s\n", cf_last_error());
        return 1;
    }
    /* the shared context picks its attention path with the environment as
     * given; where that is the Hopper path, a second context forced to the
     * portable kernels cross-checks it */
    pick_attn_path(gpu);
    if (attn_path_of(gpu) == 2) {
        const char *env = getenv("CENTRIFUGE_ATTENTION");
        char *saved = env ? strdup(env) : NULL;
        setenv("CENTRIFUGE_ATTENTION", "portable", 1);
        gpu_port = cf_backend_cuda_create(0);
        if (gpu_port) pick_attn_path(gpu_port);
        if (saved) setenv("CENTRIFUGE_ATTENTION", saved, 1);
        else unsetenv("CENTRIFUGE_ATTENTION");
        free(saved);
        if (!gpu_port) printf("cannot create the portable context: %s\n", cf_last_error());
    }
    RUN_IF(embedding_fwd_copies_rows_exactly);
    RUN_IF(embedding_bwd_sums_repeated_tokens_in_row_order_bitwise);
    RUN_IF(matmul_fwd_matches_cpu_with_and_without_bias);
    RUN_IF(matmul_fwd_residual_matches_cpu_in_place_and_not);
    RUN_IF(matmul_bwd_matches_cpu_dinp_dw_dbias_and_accumulate);
    RUN_IF(rmsnorm_fwd_bwd_match_cpu_vector_and_scalar_paths);
    RUN_IF(add_rmsnorm_fwd_matches_cpu_vector_scalar_and_in_place);
    RUN_IF(colsum_dbias_matches_cpu_vector_scalar_and_row_chunks);
    RUN_IF(rmsnorm_bwd_fused_dw_matches_cpu_shapes_chunks_null_dw_and_row_map);
    RUN_IF(rope_fwd_bwd_match_cpu);
    RUN_IF(rope_qk_matches_cpu_rope_of_each_part);
    RUN_IF(swiglu_fwd_bwd_match_cpu_vector_and_scalar_paths);
    RUN_IF(qkv_split_rope_matches_cpu);
    RUN_IF(qkv_join_rope_bwd_matches_cpu);
    RUN_IF(swiglu_with_gate_up_rows_2F_apart_matches_cpu_and_separate_matrices);
    RUN_IF(add_matches_cpu_out_of_place_and_in_place);
    RUN_IF(dropout_mask_matches_cpu_bitwise_vector_scalar_row_index_and_in_place);
    RUN_IF(gather_rows_copies_rows_exactly);
    RUN_IF(sumsq_accumulates_on_the_device_and_matches_cpu);
    RUN_IF(keep_to_rows_matches_cpu_exactly);
    RUN_IF(fill_dloss_and_loss_sum_match_cpu);
    RUN_IF(adamw_two_steps_and_weights_from_master_match_cpu_and_keep_grad_leaves_g);
    RUN_IF(adamw_segments_in_one_launch_give_the_per_segment_bits_and_match_cpu);
    RUN_IF(lmhead_loss_fwd_bwd_match_cpu_with_zero_dloss_rows);
    RUN_IF(lmhead_saved_grad_fwd_bwd_match_cpu_with_zero_dloss_rows);
    RUN_IF(lmhead_cluster_rows_of_two_and_four_blocks_match_cpu);
    RUN_IF(lmhead_one_pass_cluster_rows_match_cpu_at_large_vocabularies);
    RUN_IF(lmhead_bf16_logits_keep_confident_rows_losses_fp32_exact);
    RUN_IF(vocab_parallel_embedding_and_lmhead_slices_match_cpu);
    RUN_IF(attention_fwd_matches_cpu_causal_gqa_doc_mask_and_tails);
    RUN_IF(attention_full_bwd_matches_cpu);
    RUN_IF(attention_centrifuge_and_strawman_bwd_match_cpu_uneven_kept);
    RUN_IF(attention_all_rows_kept_equals_full_on_gpu);
    RUN_IF(attention_centrifuge_bwd_matches_cpu_several_tiles_uneven_kept);
    RUN_IF(attention_centrifuge_matches_cpu_on_larger_problem);
    RUN_IF(attention_centrifuge_kv_bwd_matches_cpu_several_tiles_uneven_kept);
    RUN_IF(attention_path_is_hopper_on_sm90);
    RUN_IF(attention_hopper_matches_portable_kernels);
    RUN_IF(attention_hopper_fwd_three_warpgroups_give_the_two_warpgroup_bits);
    RUN_IF(attention_hopper_bwd_heads_per_block_and_query_parts_match);
    RUN_IF(attention_hopper_bwd_pairs_give_the_partials_bits);
    RUN_IF(attention_hopper_centrifuge_part2_turns_and_grids_match_cpu);
    RUN_IF(attention_hopper_centrifuge_parts_after_beside_and_chained_match_cpu);
    RUN_IF(attention_bwd_leaves_idle_where_the_plan_is_under_one_and_a_half_waves);
    RUN_IF(errors_are_sticky_and_a_second_context_is_independent);
    RUN_IF(two_contexts_interleaved_give_the_same_results);
    CHECK_MSG(gpu->check(gpu) == 0, "the shared GPU backend failed: %s", cf_last_error());
    if (gpu_port) {
        CHECK_MSG(gpu_port->check(gpu_port) == 0, "the portable GPU backend failed: %s", cf_last_error());
        gpu_port->destroy(gpu_port);
    }
    gpu->destroy(gpu);
    cpu->destroy(cpu);
    return test_summary();
}
