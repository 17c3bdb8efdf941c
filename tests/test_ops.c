/*
 * test_ops.c — the CPU backend's ops against tiny double-precision
 * reference implementations written here from the math in backend.h and
 * DESIGN §1-2.
 *
 * Method: forwards are compared with the double reference; backwards are
 * compared with central finite differences of the double reference (eps
 * 1e-5 in double, so the FD error is ~1e-9) of a random projection loss
 * L = sum(out * R). The only error left is the backend's fp32 arithmetic,
 * so the tolerances are tight: max|a - ref| / max|ref| < 1e-4 unless noted.
 *
 * The CPU backend's memory is host memory, so host arrays are passed to the
 * ops directly.
 */
#include <omp.h>
#include <stdint.h>

#include "backend/backend.h"
#include "base/common.h"
#include "test.h"

/* Lets the allocation-failure test see NULL instead of an ASan abort. */
const char *__asan_default_options(void);
const char *__asan_default_options(void) { return "allocator_may_return_null=1"; }

static cf_backend *be;

#define GRAD_TOL 1e-4 /* fp32 analytic vs double FD, relative to max |ref| */
#define FWD_TOL 1e-5  /* fp32 forward vs double reference                  */

/* ---------------------------------------------------------------- helpers */

static float *fnew(size_t n) {
    float *p = calloc(n ? n : 1, sizeof(float));
    if (!p) abort();
    return p;
}

static double *dnew(size_t n) {
    double *p = calloc(n ? n : 1, sizeof(double));
    if (!p) abort();
    return p;
}

static void fill_normal(float *x, size_t n, cf_rng *r, float sd) {
    for (size_t i = 0; i < n; i++) x[i] = sd * cf_rng_normal(r);
}

static double *to_double(const float *f, size_t n) {
    double *d = dnew(n);
    for (size_t i = 0; i < n; i++) d[i] = f[i];
    return d;
}

/* max |a - b| / max |b| */
static double rel_err_d(const float *a, const double *b, size_t n) {
    double num = 0, den = 1e-30;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i]) || isnan(b[i])) return INFINITY;
        num = fmax(num, fabs(a[i] - b[i]));
        den = fmax(den, fabs(b[i]));
    }
    return num / den;
}

static double max_abs(const float *a, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = fmax(m, fabs(a[i]));
    return m;
}

/* Central differences of f with respect to every element of x. */
typedef double (*loss_fn)(void *ctx);
static void fd_grad(double *grad, double *x, size_t n, loss_fn f, void *ctx) {
    const double eps = 1e-5;
    for (size_t i = 0; i < n; i++) {
        double save = x[i];
        x[i] = save + eps;
        double lp = f(ctx);
        x[i] = save - eps;
        double lm = f(ctx);
        x[i] = save;
        grad[i] = (lp - lm) / (2 * eps);
    }
}

static double dot_d(const double *a, const double *b, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* ----------------------------------------------------------------- memory */

TEST(memory_alloc_is_aligned_and_transfers_roundtrip) {
    float *a = be->alloc(be, 100 * sizeof(float));
    float *c = be->alloc(be, 100 * sizeof(float));
    void *z = be->alloc(be, 0);
    CHECK(a && c && z);
    CHECK(((uintptr_t)a & 63) == 0 && ((uintptr_t)c & 63) == 0);
    CHECK(be->act_size == sizeof(float));
    float h[100], back[100];
    for (int i = 0; i < 100; i++) h[i] = (float)i - 50.5f;
    CHECK(be->upload(be, a, h, sizeof h) == 0);
    be->copy(be, c, a, sizeof h);
    CHECK(be->download(be, back, c, sizeof h) == 0);
    CHECK(memcmp(h, back, sizeof h) == 0);
    be->memzero(be, c, 10 * sizeof(float));
    CHECK(be->download(be, back, c, sizeof h) == 0);
    CHECK(back[0] == 0 && back[9] == 0 && back[10] == h[10]);
    be->act_from_f32(be, c, h, 100);
    be->act_to_f32(be, back, c, 100);
    CHECK(memcmp(h, back, sizeof h) == 0);
    /* weights_from_master copies when the pointers differ, no-op when equal */
    be->memzero(be, c, sizeof h);
    be->weights_from_master(be, c, a, 100);
    CHECK(memcmp(c, h, sizeof h) == 0);
    be->weights_from_master(be, a, a, 100);
    CHECK(memcmp(a, h, sizeof h) == 0);
    CHECK(be->synchronize(be) == 0);
    CHECK(be->check(be) == 0);
    be->free(be, a);
    be->free(be, c);
    be->free(be, z);
}

TEST(memory_alloc_failure_returns_null_with_error) {
    cf_fail("%s", "");
    void *p = be->alloc(be, SIZE_MAX / 2);
    CHECK(p == NULL);
    CHECK(strstr(cf_last_error(), "out of memory") != NULL);
}

/* ----------------------------------------------------------------- matmul */

typedef struct { int T, K, N; double *inp, *w, *bias, *R; } mm_ctx;

static double mm_loss(void *c_) {
    mm_ctx *c = c_;
    double L = 0;
    for (int t = 0; t < c->T; t++)
        for (int n = 0; n < c->N; n++) {
            double y = dot_d(c->inp + (size_t)t * c->K, c->w + (size_t)n * c->K, c->K);
            if (c->bias) y += c->bias[n];
            L += c->R[(size_t)t * c->N + n] * y;
        }
    return L;
}

TEST(matmul_fwd_matches_double_reference_with_and_without_bias) {
    cf_rng r;
    cf_rng_seed(&r, 101);
    const int T = 5, K = 7, N = 6;
    float *inp = fnew(T * K), *w = fnew(N * K), *bias = fnew(N), *out = fnew(T * N);
    fill_normal(inp, T * K, &r, 1);
    fill_normal(w, N * K, &r, 1);
    fill_normal(bias, N, &r, 1);
    for (int with_bias = 0; with_bias < 2; with_bias++) {
        for (int i = 0; i < T * N; i++) out[i] = 1234.0f; /* must be overwritten */
        be->matmul_fwd(be, out, inp, w, with_bias ? bias : NULL, T, K, N);
        double err = 0;
        for (int t = 0; t < T; t++)
            for (int n = 0; n < N; n++) {
                double y = with_bias ? bias[n] : 0;
                for (int k = 0; k < K; k++) y += (double)inp[t * K + k] * w[n * K + k];
                err = fmax(err, fabs(out[t * N + n] - y));
            }
        CHECK_MSG(err < FWD_TOL, "bias=%d max err %g", with_bias, err);
    }
    free(inp); free(w); free(bias); free(out);
}

TEST(matmul_fwd_residual_adds_the_residual_to_the_product_in_place_or_not) {
    cf_rng r;
    cf_rng_seed(&r, 109);
    const int T = 5, K = 7, N = 6;
    float *inp = fnew(T * K), *w = fnew(N * K), *bias = fnew(N), *res = fnew(T * N), *out = fnew(T * N);
    fill_normal(inp, T * K, &r, 1);
    fill_normal(w, N * K, &r, 1);
    fill_normal(bias, N, &r, 1);
    fill_normal(res, T * N, &r, 1);
    for (int v = 0; v < 4; v++) {
        const int with_bias = v & 1, in_place = v >> 1;
        float *dst = out;
        if (in_place) { memcpy(out, res, (size_t)T * N * sizeof(float)); }
        else for (int i = 0; i < T * N; i++) out[i] = 1234.0f; /* must be overwritten */
        be->matmul_fwd_residual(be, dst, inp, w, with_bias ? bias : NULL, in_place ? out : res, T, K, N);
        double err = 0;
        for (int t = 0; t < T; t++)
            for (int n = 0; n < N; n++) {
                double y = res[t * N + n] + (with_bias ? bias[n] : 0);
                for (int k = 0; k < K; k++) y += (double)inp[t * K + k] * w[n * K + k];
                err = fmax(err, fabs(out[t * N + n] - y));
            }
        CHECK_MSG(err < FWD_TOL, "bias=%d in place=%d max err %g", with_bias, in_place, err);
    }
    free(inp); free(w); free(bias); free(res); free(out);
}

TEST(matmul_bwd_matches_finite_differences_and_accumulates_dw_dbias) {
    cf_rng r;
    cf_rng_seed(&r, 102);
    const int T = 5, K = 7, N = 6;
    float *inp = fnew(T * K), *w = fnew(N * K), *bias = fnew(N), *R = fnew(T * N);
    float *dinp = fnew(T * K), *dw = fnew(N * K), *dw0 = fnew(N * K), *db = fnew(N), *db0 = fnew(N);
    fill_normal(inp, T * K, &r, 1);
    fill_normal(w, N * K, &r, 1);
    fill_normal(bias, N, &r, 1);
    fill_normal(R, T * N, &r, 1);
    fill_normal(dw0, N * K, &r, 0.5f);
    fill_normal(db0, N, &r, 0.5f);
    memcpy(dw, dw0, N * K * sizeof(float));
    memcpy(db, db0, N * sizeof(float));
    for (int i = 0; i < T * K; i++) dinp[i] = 777.0f; /* overwritten when accumulate = 0 */
    be->matmul_bwd(be, dinp, dw, db, R, inp, w, T, K, N, 0);
    for (int i = 0; i < N * K; i++) dw[i] -= dw0[i];
    for (int i = 0; i < N; i++) db[i] -= db0[i];

    mm_ctx c = {T, K, N, to_double(inp, T * K), to_double(w, N * K), to_double(bias, N),
                to_double(R, T * N)};
    double *g_inp = dnew(T * K), *g_w = dnew(N * K), *g_b = dnew(N);
    fd_grad(g_inp, c.inp, T * K, mm_loss, &c);
    fd_grad(g_w, c.w, N * K, mm_loss, &c);
    fd_grad(g_b, c.bias, N, mm_loss, &c);
    CHECK_MSG(rel_err_d(dinp, g_inp, T * K) < GRAD_TOL, "dinp %g", rel_err_d(dinp, g_inp, T * K));
    CHECK_MSG(rel_err_d(dw, g_w, N * K) < GRAD_TOL, "dw %g", rel_err_d(dw, g_w, N * K));
    CHECK_MSG(rel_err_d(db, g_b, N) < GRAD_TOL, "dbias %g", rel_err_d(db, g_b, N));
    free(inp); free(w); free(bias); free(R); free(dinp); free(dw); free(dw0); free(db); free(db0);
    free(c.inp); free(c.w); free(c.bias); free(c.R); free(g_inp); free(g_w); free(g_b);
}

TEST(matmul_bwd_accumulate_adds_to_dinp_and_null_dinp_dbias_are_skipped) {
    cf_rng r;
    cf_rng_seed(&r, 103);
    const int T = 9, K = 4, N = 11;
    float *inp = fnew(T * K), *w = fnew(N * K), *dout = fnew(T * N);
    float *d1 = fnew(T * K), *d2 = fnew(T * K), *base = fnew(T * K);
    float *dwa = fnew(N * K), *dwb = fnew(N * K);
    fill_normal(inp, T * K, &r, 1);
    fill_normal(w, N * K, &r, 1);
    fill_normal(dout, T * N, &r, 1);
    fill_normal(base, T * K, &r, 1);
    be->matmul_bwd(be, d1, dwa, NULL, dout, inp, w, T, K, N, 0);
    memcpy(d2, base, T * K * sizeof(float));
    be->matmul_bwd(be, d2, dwb, NULL, dout, inp, w, T, K, N, 1);
    double err = 0;
    for (int i = 0; i < T * K; i++) err = fmax(err, fabs(d2[i] - (base[i] + d1[i])));
    CHECK_MSG(err < 1e-5, "accumulate err %g", err);
    CHECK(memcmp(dwa, dwb, N * K * sizeof(float)) == 0);
    /* dinp NULL: only dw is produced, and it matches */
    memset(dwb, 0, N * K * sizeof(float));
    be->matmul_bwd(be, NULL, dwb, NULL, dout, inp, w, T, K, N, 0);
    CHECK(memcmp(dwa, dwb, N * K * sizeof(float)) == 0);
    /* CF_MM_DW_SET: dw is written without being read (NaN before), the same
     * bits as accumulating onto zeros; flags combine with CF_MM_ACC_DINP */
    for (int i = 0; i < N * K; i++) dwb[i] = NAN;
    memcpy(d2, base, T * K * sizeof(float));
    be->matmul_bwd(be, d2, dwb, NULL, dout, inp, w, T, K, N, CF_MM_DW_SET | CF_MM_ACC_DINP);
    CHECK(memcmp(dwa, dwb, N * K * sizeof(float)) == 0);
    err = 0;
    for (int i = 0; i < T * K; i++) err = fmax(err, fabs(d2[i] - (base[i] + d1[i])));
    CHECK_MSG(err < 1e-5, "accumulate with DW_SET err %g", err);
    free(inp); free(w); free(dout); free(d1); free(d2); free(base); free(dwa); free(dwb);
}

/* A STALE gradient's first writer must overwrite it even over no rows
 * (backend.h, matmul_bwd): with CF_MM_DW_SET and T = 0, dw (NaN before)
 * becomes zeros; without it, dw and dbias are left as they are (+= over no
 * rows), and dinp [0, K] is not touched. */
TEST(matmul_bwd_dw_set_over_no_rows_writes_zeros_and_accumulate_leaves_dw) {
    const int K = 5, N = 7;
    float *w = fnew(N * K), *dw = fnew(N * K), *db = fnew(N), guard = 3.0f;
    for (int i = 0; i < N * K; i++) { w[i] = 1.0f; dw[i] = NAN; }
    for (int i = 0; i < N; i++) db[i] = 2.0f;
    be->matmul_bwd(be, &guard, dw, db, &guard, &guard, w, 0, K, N, CF_MM_DW_SET);
    int zeros = 1, kept = 1;
    for (int i = 0; i < N * K; i++) zeros &= dw[i] == 0.0f && !signbit(dw[i]);
    for (int i = 0; i < N; i++) kept &= db[i] == 2.0f;
    CHECK_MSG(zeros, "dw = over no rows is not zeros");
    CHECK_MSG(kept, "dbias changed over no rows");
    CHECK(guard == 3.0f && be->check(be) == 0);
    for (int i = 0; i < N * K; i++) dw[i] = (float)i;
    be->matmul_bwd(be, NULL, dw, NULL, &guard, &guard, w, 0, K, N, 0);
    int same = 1;
    for (int i = 0; i < N * K; i++) same &= dw[i] == (float)i;
    CHECK_MSG(same, "dw += over no rows changed dw");
    /* negative T as no rows; an empty dw (K = 0 or N = 0) is never touched */
    for (int i = 0; i < N * K; i++) dw[i] = NAN;
    be->matmul_bwd(be, NULL, dw, NULL, &guard, &guard, w, -1, K, N, CF_MM_DW_SET);
    CHECK(dw[0] == 0.0f && dw[N * K - 1] == 0.0f);
    dw[0] = NAN;
    be->matmul_bwd(be, NULL, dw, NULL, &guard, &guard, w, 0, 0, N, CF_MM_DW_SET);
    be->matmul_bwd(be, NULL, dw, NULL, &guard, &guard, w, 0, K, 0, CF_MM_DW_SET);
    CHECK(isnan(dw[0]) && be->check(be) == 0);
    free(w); free(dw); free(db);
}

/* ---------------------------------------------------------------- rmsnorm */

typedef struct { int T, C; double eps; double *x, *w, *R; } rms_ctx;

static double rms_loss(void *c_) {
    rms_ctx *c = c_;
    double L = 0;
    for (int t = 0; t < c->T; t++) {
        const double *x = c->x + (size_t)t * c->C;
        double rstd = 1.0 / sqrt(dot_d(x, x, c->C) / c->C + c->eps);
        for (int i = 0; i < c->C; i++) L += c->R[(size_t)t * c->C + i] * x[i] * rstd * c->w[i];
    }
    return L;
}

TEST(rmsnorm_fwd_matches_double_reference_and_saves_rstd) {
    cf_rng r;
    cf_rng_seed(&r, 201);
    const int T = 6, C = 100;
    const float eps = 1e-5f;
    float *x = fnew(T * C), *w = fnew(C), *out = fnew(T * C), *rstd = fnew(T);
    fill_normal(x, T * C, &r, 2);
    fill_normal(w, C, &r, 1);
    be->rmsnorm_fwd(be, out, rstd, x, w, T, C, eps);
    for (int t = 0; t < T; t++) {
        double ss = 0;
        for (int i = 0; i < C; i++) ss += (double)x[t * C + i] * x[t * C + i];
        double rs = 1.0 / sqrt(ss / C + (double)eps);
        CHECK_CLOSE(rstd[t], rs, FWD_TOL);
        for (int i = 0; i < C; i++) CHECK_CLOSE(out[t * C + i], x[t * C + i] * rs * w[i], FWD_TOL);
    }
    free(x); free(w); free(out); free(rstd);
}

TEST(add_rmsnorm_fwd_writes_the_sum_and_its_norm_also_in_place) {
    cf_rng r;
    cf_rng_seed(&r, 203);
    const int T = 6, C = 100;
    const float eps = 1e-5f;
    float *a = fnew(T * C), *c = fnew(T * C), *w = fnew(C), *sum = fnew(T * C), *out = fnew(T * C), *rstd = fnew(T);
    fill_normal(a, T * C, &r, 2);
    fill_normal(c, T * C, &r, 1);
    fill_normal(w, C, &r, 1);
    for (int in_place = 0; in_place < 2; in_place++) {
        float *s = in_place ? fnew(T * C) : sum;
        if (in_place) memcpy(s, a, (size_t)T * C * sizeof(float));
        be->add_rmsnorm_fwd(be, s, out, rstd, in_place ? s : a, c, w, T, C, eps);
        for (int t = 0; t < T; t++) {
            double ss = 0;
            for (int i = 0; i < C; i++) {
                double v = (double)a[t * C + i] + c[t * C + i];
                CHECK_CLOSE(s[t * C + i], v, FWD_TOL);
                ss += v * v;
            }
            double rs = 1.0 / sqrt(ss / C + (double)eps);
            CHECK_CLOSE(rstd[t], rs, FWD_TOL);
            for (int i = 0; i < C; i++)
                CHECK_CLOSE(out[t * C + i], ((double)a[t * C + i] + c[t * C + i]) * rs * w[i], FWD_TOL);
        }
        if (in_place) free(s);
    }
    free(a); free(c); free(w); free(sum); free(out); free(rstd);
}

TEST(rmsnorm_bwd_matches_finite_differences_and_accumulates) {
    cf_rng r;
    cf_rng_seed(&r, 202);
    const int T = 6, C = 100; /* C crosses the 64-column block of dw */
    const float eps = 1e-5f;
    float *x = fnew(T * C), *w = fnew(C), *out = fnew(T * C), *rstd = fnew(T), *R = fnew(T * C);
    float *dx = fnew(T * C), *dx2 = fnew(T * C), *dw = fnew(C), *dw0 = fnew(C);
    fill_normal(x, T * C, &r, 2);
    fill_normal(w, C, &r, 1);
    fill_normal(R, T * C, &r, 1);
    fill_normal(dw0, C, &r, 1);
    memcpy(dw, dw0, C * sizeof(float));
    be->rmsnorm_fwd(be, out, rstd, x, w, T, C, eps);
    for (int i = 0; i < T * C; i++) dx[i] = 99.0f;
    be->rmsnorm_bwd(be, dx, dw, R, x, w, rstd, NULL, T, C, 0);
    for (int i = 0; i < C; i++) dw[i] -= dw0[i];

    rms_ctx c = {T, C, eps, to_double(x, T * C), to_double(w, C), to_double(R, T * C)};
    double *gx = dnew(T * C), *gw = dnew(C);
    fd_grad(gx, c.x, T * C, rms_loss, &c);
    fd_grad(gw, c.w, C, rms_loss, &c);
    CHECK_MSG(rel_err_d(dx, gx, T * C) < GRAD_TOL, "dx %g", rel_err_d(dx, gx, T * C));
    CHECK_MSG(rel_err_d(dw, gw, C) < GRAD_TOL, "dw %g", rel_err_d(dw, gw, C));

    /* accumulate: dx2 = 1 + dx */
    for (int i = 0; i < T * C; i++) dx2[i] = 1.0f;
    be->rmsnorm_bwd(be, dx2, dw, R, x, w, rstd, NULL, T, C, 1);
    double err = 0;
    for (int i = 0; i < T * C; i++) err = fmax(err, fabs(dx2[i] - (1.0 + dx[i])));
    CHECK_MSG(err < 1e-5, "accumulate err %g", err);
    free(x); free(w); free(out); free(rstd); free(R); free(dx); free(dx2); free(dw); free(dw0);
    free(c.x); free(c.w); free(c.R); free(gx); free(gw);
}

/* Through a row map (the centrifuge filter leaves the norms' inputs and
 * rstd uncompacted): row t reads input row map[t]. Bitwise the backward of
 * the rows gathered first, written and accumulated, dw included. */
TEST(rmsnorm_bwd_through_a_row_map_is_the_gathered_rows_backward) {
    cf_rng r;
    cf_rng_seed(&r, 203);
    const int Tx = 11, T = 5, C = 100;
    const int map[5] = {0, 3, 4, 7, 10};
    float *x = fnew(Tx * C), *w = fnew(C), *out = fnew(Tx * C), *rstd = fnew(Tx), *R = fnew(T * C);
    float *xg = fnew(T * C), *rg = fnew(T), *dx[2], *dw[2];
    fill_normal(x, Tx * C, &r, 2);
    fill_normal(w, C, &r, 1);
    fill_normal(R, T * C, &r, 1);
    be->rmsnorm_fwd(be, out, rstd, x, w, Tx, C, 1e-5f);
    for (int t = 0; t < T; t++) {
        memcpy(xg + (size_t)t * C, x + (size_t)map[t] * C, C * sizeof(float));
        rg[t] = rstd[map[t]];
    }
    for (int acc = 0; acc < 2; acc++) {
        for (int k = 0; k < 2; k++) {
            dx[k] = fnew(T * C);
            dw[k] = fnew(C);
            for (int i = 0; i < T * C; i++) dx[k][i] = 0.5f;
            for (int i = 0; i < C; i++) dw[k][i] = 0.25f;
        }
        be->rmsnorm_bwd(be, dx[0], dw[0], R, x, w, rstd, map, T, C, acc);
        be->rmsnorm_bwd(be, dx[1], dw[1], R, xg, w, rg, NULL, T, C, acc);
        CHECK_MSG(!memcmp(dx[0], dx[1], (size_t)T * C * sizeof(float)), "dx through the map differs (acc %d)", acc);
        CHECK_MSG(!memcmp(dw[0], dw[1], (size_t)C * sizeof(float)), "dw through the map differs (acc %d)", acc);
        for (int k = 0; k < 2; k++) { free(dx[k]); free(dw[k]); }
    }
    free(x); free(w); free(out); free(rstd); free(R); free(xg); free(rg);
}

/* ------------------------------------------------------------------- rope */

/* HF rotate-half with the angle formed in fp32 (pos * inv_freq), as HF does. */
static void rope_ref(double *y, const double *x, const int *pos, const float *inv_freq, int T,
                     int nh, int D) {
    const int half = D / 2;
    for (int t = 0; t < T; t++)
        for (int h = 0; h < nh; h++) {
            const double *xr = x + ((size_t)t * nh + h) * D;
            double *yr = y + ((size_t)t * nh + h) * D;
            for (int i = 0; i < half; i++) {
                double th = (double)((float)pos[t] * inv_freq[i]);
                yr[i] = xr[i] * cos(th) - xr[i + half] * sin(th);
                yr[i + half] = xr[i + half] * cos(th) + xr[i] * sin(th);
            }
        }
}

typedef struct { int T, nh, D; const int *pos; const float *inv_freq; double *x, *R, *y; } rope_ctx;

static double rope_loss(void *c_) {
    rope_ctx *c = c_;
    size_t n = (size_t)c->T * c->nh * c->D;
    rope_ref(c->y, c->x, c->pos, c->inv_freq, c->T, c->nh, c->D);
    return dot_d(c->y, c->R, n);
}

enum { ROPE_T = 5, ROPE_NH = 3, ROPE_D = 8 };
static const int rope_pos[ROPE_T] = {0, 1, 7, 100, 2047};

static void rope_freqs(float *inv_freq, int D) {
    for (int i = 0; i < D / 2; i++) inv_freq[i] = (float)pow(10000.0, -2.0 * i / D);
}

TEST(rope_fwd_matches_hf_rotate_half_reference) {
    cf_rng r;
    cf_rng_seed(&r, 301);
    const int n = ROPE_T * ROPE_NH * ROPE_D;
    float inv_freq[ROPE_D / 2], x[ROPE_T * ROPE_NH * ROPE_D];
    rope_freqs(inv_freq, ROPE_D);
    fill_normal(x, n, &r, 1);
    double *xd = to_double(x, n), *yd = dnew(n);
    rope_ref(yd, xd, rope_pos, inv_freq, ROPE_T, ROPE_NH, ROPE_D);
    be->rope_fwd(be, x, rope_pos, inv_freq, ROPE_T, ROPE_NH, ROPE_D);
    CHECK_MSG(rel_err_d(x, yd, n) < FWD_TOL, "rope fwd %g", rel_err_d(x, yd, n));
    /* position 0 is the identity */
    for (int i = 0; i < ROPE_NH * ROPE_D; i++) CHECK(x[i] == (float)xd[i]);
    free(xd); free(yd);
}

TEST(rope_bwd_inverts_rope_fwd) {
    cf_rng r;
    cf_rng_seed(&r, 302);
    const int n = ROPE_T * ROPE_NH * ROPE_D;
    float inv_freq[ROPE_D / 2], x[ROPE_T * ROPE_NH * ROPE_D], x0[ROPE_T * ROPE_NH * ROPE_D];
    rope_freqs(inv_freq, ROPE_D);
    fill_normal(x0, n, &r, 1);
    memcpy(x, x0, sizeof x);
    be->rope_fwd(be, x, rope_pos, inv_freq, ROPE_T, ROPE_NH, ROPE_D);
    CHECK(rel_err(x, x0, n) > 1e-2); /* it did rotate */
    be->rope_bwd(be, x, rope_pos, inv_freq, ROPE_T, ROPE_NH, ROPE_D);
    CHECK_MSG(rel_err(x, x0, n) < 1e-6, "bwd(fwd(x)) vs x %g", rel_err(x, x0, n));
}

TEST(rope_bwd_matches_finite_differences) {
    cf_rng r;
    cf_rng_seed(&r, 303);
    const int n = ROPE_T * ROPE_NH * ROPE_D;
    float inv_freq[ROPE_D / 2], x[ROPE_T * ROPE_NH * ROPE_D], R[ROPE_T * ROPE_NH * ROPE_D];
    rope_freqs(inv_freq, ROPE_D);
    fill_normal(x, n, &r, 1);
    fill_normal(R, n, &r, 1);
    rope_ctx c = {ROPE_T, ROPE_NH, ROPE_D, rope_pos, inv_freq, to_double(x, n), to_double(R, n),
                  dnew(n)};
    double *g = dnew(n);
    fd_grad(g, c.x, n, rope_loss, &c);
    be->rope_bwd(be, R, rope_pos, inv_freq, ROPE_T, ROPE_NH, ROPE_D); /* dx = rope^T R */
    CHECK_MSG(rel_err_d(R, g, n) < GRAD_TOL, "rope dx %g", rel_err_d(R, g, n));
    free(c.x); free(c.R); free(c.y); free(g);
}

/* rope_qk: q (ROPE_NH heads at rope_pos) and k (2 heads at other
 * positions, another row count) in one call: exactly rope_fwd / rope_bwd of
 * each. */
TEST(rope_qk_is_rope_of_q_and_of_k) {
    cf_rng r;
    cf_rng_seed(&r, 304);
    enum { TK = 4, HK = 2 };
    static const int kpos[TK] = {3, 0, 513, 9};
    const int nq = ROPE_T * ROPE_NH * ROPE_D, nk = TK * HK * ROPE_D;
    float inv_freq[ROPE_D / 2], q[ROPE_T * ROPE_NH * ROPE_D], k[TK * HK * ROPE_D];
    float q1[ROPE_T * ROPE_NH * ROPE_D], k1[TK * HK * ROPE_D];
    rope_freqs(inv_freq, ROPE_D);
    for (int bwd = 0; bwd < 2; bwd++) {
        fill_normal(q, nq, &r, 1);
        fill_normal(k, nk, &r, 1);
        memcpy(q1, q, sizeof q);
        memcpy(k1, k, sizeof k);
        (bwd ? be->rope_bwd : be->rope_fwd)(be, q, rope_pos, inv_freq, ROPE_T, ROPE_NH, ROPE_D);
        (bwd ? be->rope_bwd : be->rope_fwd)(be, k, kpos, inv_freq, TK, HK, ROPE_D);
        be->rope_qk(be, q1, rope_pos, ROPE_T, ROPE_NH, k1, kpos, TK, HK, inv_freq, ROPE_D, bwd);
        CHECK(memcmp(q, q1, sizeof q) == 0);
        CHECK(memcmp(k, k1, sizeof k) == 0);
    }
}

/* qkv_split_rope: the rows of a fused [T, (Hq + 2 Hk) D] projection (q |
 * k | v) split into q, k, v with q and k rotated: exactly the copies of
 * each part followed by rope_qk (the unfused forward). */
TEST(qkv_split_rope_is_the_split_then_rope_qk) {
    cf_rng r;
    cf_rng_seed(&r, 305);
    enum { HQ = ROPE_NH, HK = 2, W = (HQ + 2 * HK) * ROPE_D };
    float inv_freq[ROPE_D / 2], qkv[ROPE_T * W];
    float q[ROPE_T * HQ * ROPE_D], k[ROPE_T * HK * ROPE_D], v[ROPE_T * HK * ROPE_D];
    float q1[ROPE_T * HQ * ROPE_D], k1[ROPE_T * HK * ROPE_D], v1[ROPE_T * HK * ROPE_D];
    rope_freqs(inv_freq, ROPE_D);
    fill_normal(qkv, ROPE_T * W, &r, 1);
    for (int t = 0; t < ROPE_T; t++) {
        memcpy(q + t * HQ * ROPE_D, qkv + t * W, HQ * ROPE_D * sizeof(float));
        memcpy(k + t * HK * ROPE_D, qkv + t * W + HQ * ROPE_D, HK * ROPE_D * sizeof(float));
        memcpy(v + t * HK * ROPE_D, qkv + t * W + (HQ + HK) * ROPE_D, HK * ROPE_D * sizeof(float));
    }
    be->rope_qk(be, q, rope_pos, ROPE_T, HQ, k, rope_pos, ROPE_T, HK, inv_freq, ROPE_D, 0);
    be->qkv_split_rope(be, q1, k1, v1, qkv, rope_pos, ROPE_T, HQ, HK, inv_freq, ROPE_D);
    CHECK(memcmp(q, q1, sizeof q) == 0);
    CHECK(memcmp(k, k1, sizeof k) == 0);
    CHECK(memcmp(v, v1, sizeof v) == 0);
    /* k of row 2 (position 7) was rotated, v of it copied */
    CHECK(k1[2 * HK * ROPE_D] != qkv[2 * W + HQ * ROPE_D]);
    CHECK(v1[2 * HK * ROPE_D] == qkv[2 * W + (HQ + HK) * ROPE_D]);
}

/* qkv_join_rope_bwd: dq, dk, dv joined into [T, (Hq + 2 Hk) D] rows with
 * RoPE undone on dq and dk: exactly rope_qk's backward of each part
 * followed by the copies into the joined rows (the unfused backward's
 * inputs of the three GEMMs, side by side). */
TEST(qkv_join_rope_bwd_is_rope_qk_bwd_then_the_join) {
    cf_rng r;
    cf_rng_seed(&r, 306);
    enum { HQ = ROPE_NH, HK = 2, W = (HQ + 2 * HK) * ROPE_D };
    float inv_freq[ROPE_D / 2], joined[ROPE_T * W], want[ROPE_T * W];
    float dq[ROPE_T * HQ * ROPE_D], dk[ROPE_T * HK * ROPE_D], dv[ROPE_T * HK * ROPE_D];
    rope_freqs(inv_freq, ROPE_D);
    fill_normal(dq, ROPE_T * HQ * ROPE_D, &r, 1);
    fill_normal(dk, ROPE_T * HK * ROPE_D, &r, 1);
    fill_normal(dv, ROPE_T * HK * ROPE_D, &r, 1);
    for (int i = 0; i < ROPE_T * W; i++) joined[i] = NAN;
    be->qkv_join_rope_bwd(be, joined, dq, dk, dv, rope_pos, ROPE_T, HQ, HK, inv_freq, ROPE_D);
    float q[sizeof dq / sizeof dq[0]], k[sizeof dk / sizeof dk[0]];
    memcpy(q, dq, sizeof q);
    memcpy(k, dk, sizeof k);
    be->rope_qk(be, q, rope_pos, ROPE_T, HQ, k, rope_pos, ROPE_T, HK, inv_freq, ROPE_D, 1);
    for (int t = 0; t < ROPE_T; t++) {
        memcpy(want + t * W, q + t * HQ * ROPE_D, HQ * ROPE_D * sizeof(float));
        memcpy(want + t * W + HQ * ROPE_D, k + t * HK * ROPE_D, HK * ROPE_D * sizeof(float));
        memcpy(want + t * W + (HQ + HK) * ROPE_D, dv + t * HK * ROPE_D, HK * ROPE_D * sizeof(float));
    }
    CHECK(memcmp(joined, want, sizeof want) == 0);
    /* row 2 (position 7): dk rotated back, dv copied */
    CHECK(joined[2 * W + HQ * ROPE_D] != dk[2 * HK * ROPE_D]);
    CHECK(joined[2 * W + (HQ + HK) * ROPE_D] == dv[2 * HK * ROPE_D]);
}

/* ----------------------------------------------------------------- swiglu */

typedef struct { int n; double *g, *u, *R; } swi_ctx;

static double silu_d(double g) { return g / (1 + exp(-g)); }

static double swi_loss(void *c_) {
    swi_ctx *c = c_;
    double L = 0;
    for (int i = 0; i < c->n; i++) L += c->R[i] * silu_d(c->g[i]) * c->u[i];
    return L;
}

TEST(swiglu_fwd_and_bwd_match_reference_and_finite_differences) {
    cf_rng r;
    cf_rng_seed(&r, 401);
    enum { n = 64 };
    float g[n], u[n], h[n], h2[n], R[n], dg[n], du[n];
    fill_normal(g, n, &r, 3);
    g[0] = -90.0f; /* exp(-g) overflows: h must be -0, not NaN */
    g[1] = 90.0f;
    fill_normal(u, n, &r, 1);
    fill_normal(R, n, &r, 1);
    be->swiglu_fwd(be, h, g, u, 1, n, n);
    for (int i = 0; i < n; i++) CHECK_CLOSE(h[i], silu_d(g[i]) * u[i], FWD_TOL);
    be->swiglu_bwd_rows(be, h2, dg, du, R, g, u, NULL, 1, n, n, n);   /* one row of n columns */
    swi_ctx c = {n, to_double(g, n), to_double(u, n), to_double(R, n)};
    double gg[n], gu[n];
    fd_grad(gg, c.g, n, swi_loss, &c);
    fd_grad(gu, c.u, n, swi_loss, &c);
    CHECK_MSG(rel_err_d(dg, gg, n) < GRAD_TOL, "dgate %g", rel_err_d(dg, gg, n));
    CHECK_MSG(rel_err_d(du, gu, n) < GRAD_TOL, "dup %g", rel_err_d(du, gu, n));
    free(c.g); free(c.u); free(c.R);
}

TEST(add_works_out_of_place_and_in_place) {
    float a[5] = {1, 2, 3, 4, 5}, c[5] = {10, 20, 30, 40, 50}, o[5];
    be->add(be, o, a, c, 5);
    for (int i = 0; i < 5; i++) CHECK(o[i] == a[i] + c[i]);
    be->add(be, a, a, c, 5);
    for (int i = 0; i < 5; i++) CHECK(a[i] == o[i]);
}

/* -------------------------------------------------------------- embedding */

enum { EMB_V = 10, EMB_C = 70, EMB_T = 12 }; /* C crosses the 64-column block */
static const int emb_tokens[EMB_T] = {3, 1, 3, 3, 7, 0, 1, 3, 9, 7, 3, 2};

TEST(embedding_fwd_copies_token_rows) {
    cf_rng r;
    cf_rng_seed(&r, 501);
    float *wte = fnew(EMB_V * EMB_C), *out = fnew(EMB_T * EMB_C);
    fill_normal(wte, EMB_V * EMB_C, &r, 1);
    be->embedding_fwd(be, out, emb_tokens, wte, EMB_T, EMB_C, 0, EMB_V);
    for (int t = 0; t < EMB_T; t++)
        CHECK(memcmp(out + t * EMB_C, wte + emb_tokens[t] * EMB_C, EMB_C * sizeof(float)) == 0);
    free(wte); free(out);
}

TEST(embedding_bwd_sums_repeated_tokens_in_row_order_bitwise) {
    cf_rng r;
    cf_rng_seed(&r, 502);
    float *dwte = fnew(EMB_V * EMB_C), *expect = fnew(EMB_V * EMB_C), *dout = fnew(EMB_T * EMB_C);
    fill_normal(dwte, EMB_V * EMB_C, &r, 1);
    fill_normal(dout, EMB_T * EMB_C, &r, 1);
    memcpy(expect, dwte, EMB_V * EMB_C * sizeof(float));
    double *exact = to_double(dwte, EMB_V * EMB_C);
    for (int t = 0; t < EMB_T; t++)          /* serial fp32, row order */
        for (int c = 0; c < EMB_C; c++) {
            expect[emb_tokens[t] * EMB_C + c] += dout[t * EMB_C + c];
            exact[emb_tokens[t] * EMB_C + c] += dout[t * EMB_C + c];
        }
    be->embedding_bwd(be, dwte, dout, emb_tokens, EMB_T, EMB_C, 0, EMB_V);
    CHECK(memcmp(dwte, expect, EMB_V * EMB_C * sizeof(float)) == 0);
    CHECK(rel_err_d(dwte, exact, EMB_V * EMB_C) < 1e-6);
    free(dwte); free(expect); free(dout); free(exact);
}

/* ---------------------------------------------------------- LM head + loss */

enum { LM_T = 400, LM_C = 8, LM_V = 50 }; /* > 256 rows: several chunks */

static double lm_row_loss(const double *x, const double *W, int tg, int C, int V) {
    double z[256], m = -INFINITY, sum = 0;
    for (int j = 0; j < V; j++) {
        z[j] = dot_d(x, W + (size_t)j * C, C);
        m = fmax(m, z[j]);
    }
    for (int j = 0; j < V; j++) sum += exp(z[j] - m);
    return m + log(sum) - z[tg];
}

typedef struct { int T, C, V; const int *tg; double *x, *W, *dloss; } lm_ctx;

static double lm_loss(void *c_) {
    lm_ctx *c = c_;
    double L = 0;
    for (int t = 0; t < c->T; t++)
        if (c->dloss[t] != 0)
            L += c->dloss[t] * lm_row_loss(c->x + (size_t)t * c->C, c->W, c->tg[t], c->C, c->V);
    return L;
}

static void lm_inputs(cf_rng *r, float *x, float *W, int *tg, float xs) {
    fill_normal(x, LM_T * LM_C, r, xs);
    fill_normal(W, LM_V * LM_C, r, 0.7f);
    for (int t = 0; t < LM_T; t++) tg[t] = (int)cf_rng_below(r, LM_V);
}

TEST(lmhead_loss_fwd_matches_full_softmax_reference_across_chunks) {
    cf_rng r;
    cf_rng_seed(&r, 601);
    float *x = fnew(LM_T * LM_C), *W = fnew(LM_V * LM_C), *loss = fnew(LM_T);
    int tg[LM_T];
    lm_inputs(&r, x, W, tg, 1);
    be->lmhead_loss_fwd(be, loss, x, W, tg, LM_T, LM_C, LM_V);
    double *xd = to_double(x, LM_T * LM_C), *Wd = to_double(W, LM_V * LM_C);
    double err = 0;
    for (int t = 0; t < LM_T; t++)
        err = fmax(err, fabs(loss[t] - lm_row_loss(xd + t * LM_C, Wd, tg[t], LM_C, LM_V)));
    CHECK_MSG(err < FWD_TOL * 4, "max loss err %g", err);
    free(x); free(W); free(loss); free(xd); free(Wd);
}

TEST(lmhead_loss_fwd_and_bwd_are_stable_for_large_logits) {
    cf_rng r;
    cf_rng_seed(&r, 602);
    float *x = fnew(LM_T * LM_C), *W = fnew(LM_V * LM_C), *loss = fnew(LM_T);
    float *dl = fnew(LM_T), *dx = fnew(LM_T * LM_C), *dW = fnew(LM_V * LM_C);
    int tg[LM_T];
    lm_inputs(&r, x, W, tg, 60); /* logits of several hundred */
    be->lmhead_loss_fwd(be, loss, x, W, tg, LM_T, LM_C, LM_V);
    double *xd = to_double(x, LM_T * LM_C), *Wd = to_double(W, LM_V * LM_C);
    int finite = 1;
    /* fp32 logits carry an absolute error ~ |z| * 2^-24 * sqrt(C), which the
     * loss inherits: compare relative to the row's largest logit. */
    double worst = 0, zmax = 0;
    for (int t = 0; t < LM_T; t++) {
        finite &= isfinite(loss[t]) && loss[t] >= 0;
        double zm = 0;
        for (int j = 0; j < LM_V; j++) zm = fmax(zm, fabs(dot_d(xd + t * LM_C, Wd + j * LM_C, LM_C)));
        double e = fabs(loss[t] - lm_row_loss(xd + t * LM_C, Wd, tg[t], LM_C, LM_V)) / zm;
        worst = fmax(worst, e);
        zmax = fmax(zmax, zm);
        dl[t] = 1.0f;
    }
    CHECK(finite);
    CHECK(zmax > 200); /* the logits are large indeed */
    CHECK_MSG(worst < 1e-6, "loss error / max|logit| = %g", worst);
    be->lmhead_loss_bwd(be, dx, dW, x, W, tg, dl, NULL, LM_T, LM_C, LM_V, 0, 0);
    finite = 1;
    for (int i = 0; i < LM_T * LM_C; i++) finite &= isfinite(dx[i]);
    for (int i = 0; i < LM_V * LM_C; i++) finite &= isfinite(dW[i]);
    CHECK(finite);
    free(x); free(W); free(loss); free(dl); free(dx); free(dW); free(xd); free(Wd);
}

TEST(lmhead_loss_bwd_matches_finite_differences) {
    cf_rng r;
    cf_rng_seed(&r, 603);
    float *x = fnew(LM_T * LM_C), *W = fnew(LM_V * LM_C), *dl = fnew(LM_T);
    float *dx = fnew(LM_T * LM_C), *dW = fnew(LM_V * LM_C), *dW0 = fnew(LM_V * LM_C);
    int tg[LM_T];
    lm_inputs(&r, x, W, tg, 1);
    int nonzero = 0;
    for (int t = 0; t < LM_T; t++) {
        dl[t] = cf_rng_uniform(&r) < 0.25f ? 0.0f : cf_rng_normal(&r);
        nonzero += dl[t] != 0;
    }
    CHECK(nonzero > 256); /* the gathered nonzero rows span two chunks */
    fill_normal(dW0, LM_V * LM_C, &r, 1);
    memcpy(dW, dW0, LM_V * LM_C * sizeof(float));
    be->lmhead_loss_bwd(be, dx, dW, x, W, tg, dl, NULL, LM_T, LM_C, LM_V, 0, 0);
    for (int i = 0; i < LM_V * LM_C; i++) dW[i] -= dW0[i];

    lm_ctx c = {LM_T, LM_C, LM_V, tg, to_double(x, LM_T * LM_C), to_double(W, LM_V * LM_C),
                to_double(dl, LM_T)};
    double *gW = dnew(LM_V * LM_C), *gx = dnew(LM_T * LM_C);
    fd_grad(gW, c.W, LM_V * LM_C, lm_loss, &c);
    /* dx by per-row differences (row t's loss depends on x_t only) */
    const double eps = 1e-5;
    for (int t = 0; t < LM_T; t++)
        for (int i = 0; i < LM_C; i++) {
            double *xi = c.x + t * LM_C + i, save = *xi;
            *xi = save + eps;
            double lp = lm_row_loss(c.x + t * LM_C, c.W, tg[t], LM_C, LM_V);
            *xi = save - eps;
            double lm = lm_row_loss(c.x + t * LM_C, c.W, tg[t], LM_C, LM_V);
            *xi = save;
            gx[t * LM_C + i] = c.dloss[t] * (lp - lm) / (2 * eps);
        }
    CHECK_MSG(rel_err_d(dx, gx, LM_T * LM_C) < GRAD_TOL, "dx %g", rel_err_d(dx, gx, LM_T * LM_C));
    CHECK_MSG(rel_err_d(dW, gW, LM_V * LM_C) < GRAD_TOL, "dwlm %g", rel_err_d(dW, gW, LM_V * LM_C));
    free(x); free(W); free(dl); free(dx); free(dW); free(dW0); free(c.x); free(c.W); free(c.dloss);
    free(gW); free(gx);
}

/* Tensor parallelism splits the vocabulary: three slices' statistics,
 * combined, give the whole vocabulary's losses; each slice's backward with
 * the combined log-sum-exp gives its rows of dW exactly as the whole
 * backward does, and the slices' dx sum to the whole dx. The embedding of
 * a slice gives zero rows for the other slices' tokens. */
TEST(vocab_parallel_slices_reproduce_whole_vocabulary_loss_and_gradients) {
    cf_rng r;
    cf_rng_seed(&r, 605);
    enum { P = 3 };
    const int Vp = (LM_V + P - 1) / P;   /* the last slice is shorter */
    float *x = fnew(LM_T * LM_C), *W = fnew(LM_V * LM_C), *dl = fnew(LM_T), *loss = fnew(LM_T);
    float *dx = fnew(LM_T * LM_C), *dW = fnew(LM_V * LM_C), *lse = fnew(LM_T), *ploss = fnew(LM_T);
    float *parts = fnew(P * LM_T * 3), *pdx = fnew(LM_T * LM_C), *sdx = fnew(LM_T * LM_C), *pdW = fnew(LM_V * LM_C);
    int tg[LM_T];
    lm_inputs(&r, x, W, tg, 1);
    for (int t = 0; t < LM_T; t++) dl[t] = t % 5 == 2 ? 0.0f : cf_rng_normal(&r);
    be->lmhead_loss_fwd(be, loss, x, W, tg, LM_T, LM_C, LM_V);
    be->lmhead_loss_bwd(be, dx, dW, x, W, tg, dl, NULL, LM_T, LM_C, LM_V, 0, 0);
    for (int p = 0; p < P; p++) {
        int v0 = p * Vp, vl = CF_MIN(Vp, LM_V - v0);
        be->lmhead_stats_fwd(be, parts + (size_t)p * LM_T * 3, x, W + (size_t)v0 * LM_C, tg, LM_T, LM_C, vl, v0);
    }
    be->xent_combine(be, ploss, lse, parts, tg, LM_T, P, LM_V);
    double lerr = 0;
    for (int t = 0; t < LM_T; t++) lerr = fmax(lerr, fabs(ploss[t] - loss[t]));
    CHECK_MSG(lerr < 1e-5, "combined loss err %g", lerr);
    for (int p = 0; p < P; p++) {
        int v0 = p * Vp, vl = CF_MIN(Vp, LM_V - v0);
        be->lmhead_loss_bwd(be, pdx, pdW + (size_t)v0 * LM_C, x, W + (size_t)v0 * LM_C, tg, dl, lse, LM_T, LM_C, vl,
                            v0, 0);
        for (int i = 0; i < LM_T * LM_C; i++) sdx[i] += pdx[i];
    }
    CHECK_MSG(rel_err(sdx, dx, LM_T * LM_C) < 1e-5, "dx %g", rel_err(sdx, dx, LM_T * LM_C));
    CHECK_MSG(rel_err(pdW, dW, LM_V * LM_C) < 1e-5, "dW %g", rel_err(pdW, dW, LM_V * LM_C));
    CHECK(max_abs(dx, LM_T * LM_C) > 0);
    /* the embedding of slice 1: its tokens' rows, zeros elsewhere */
    float *emb = fnew(LM_T * LM_C);
    be->embedding_fwd(be, emb, tg, W + (size_t)Vp * LM_C, LM_T, LM_C, Vp, Vp);
    int ok = 1;
    for (int t = 0; t < LM_T; t++) {
        int in = tg[t] >= Vp && tg[t] < 2 * Vp;
        for (int c = 0; c < LM_C; c++)
            ok &= emb[t * LM_C + c] == (in ? W[(size_t)tg[t] * LM_C + c] : 0.0f);
    }
    CHECK(ok);
    free(x); free(W); free(dl); free(loss); free(dx); free(dW); free(lse); free(ploss); free(parts); free(pdx);
    free(sdx); free(pdW); free(emb);
}

TEST(lmhead_loss_bwd_zero_dloss_rows_give_zero_dx_and_no_dwlm) {
    cf_rng r;
    cf_rng_seed(&r, 604);
    float *x = fnew(LM_T * LM_C), *W = fnew(LM_V * LM_C), *dl = fnew(LM_T);
    float *dx = fnew(LM_T * LM_C), *dW = fnew(LM_V * LM_C), *dW0 = fnew(LM_V * LM_C);
    int tg[LM_T];
    lm_inputs(&r, x, W, tg, 1);
    fill_normal(dW0, LM_V * LM_C, &r, 1);
    /* all zero: dx is overwritten with zeros, dwlm untouched */
    memcpy(dW, dW0, LM_V * LM_C * sizeof(float));
    for (int i = 0; i < LM_T * LM_C; i++) dx[i] = 5.0f;
    be->lmhead_loss_bwd(be, dx, dW, x, W, tg, dl, NULL, LM_T, LM_C, LM_V, 0, 0);
    CHECK(max_abs(dx, LM_T * LM_C) == 0.0);
    CHECK(memcmp(dW, dW0, LM_V * LM_C * sizeof(float)) == 0);
    /* some zero: exactly those dx rows are zero, the others are not */
    for (int t = 0; t < LM_T; t++) dl[t] = (t % 3 == 1) ? 0.0f : 1.0f / LM_T;
    for (int i = 0; i < LM_T * LM_C; i++) dx[i] = 5.0f;
    be->lmhead_loss_bwd(be, dx, dW, x, W, tg, dl, NULL, LM_T, LM_C, LM_V, 0, 0);
    int ok = 1;
    for (int t = 0; t < LM_T; t++) {
        double m = max_abs(dx + t * LM_C, LM_C);
        ok &= (t % 3 == 1) ? m == 0.0 : m > 0.0;
    }
    CHECK(ok);
    free(x); free(W); free(dl); free(dx); free(dW); free(dW0);
}

/* CF_MM_DW_SET over several row chunks (the CPU backend's chunk is at most
 * 256 rows): the first chunk writes dwlm, the next ones add; the same bits
 * as accumulating onto zeros, whatever dwlm held before. */
TEST(lmhead_loss_bwd_dw_set_overwrites_over_several_chunks) {
    cf_rng r;
    cf_rng_seed(&r, 605);
    const int T = 300, C = 8, V = 40;
    float *x = fnew(T * C), *W = fnew(V * C), *dl = fnew(T), *dx = fnew(T * C), *dx2 = fnew(T * C);
    float *dWa = fnew(V * C), *dWb = fnew(V * C);
    int *tg = malloc(T * sizeof(int));
    fill_normal(x, T * C, &r, 1);
    fill_normal(W, V * C, &r, 0.3f);
    for (int t = 0; t < T; t++) {
        tg[t] = (int)cf_rng_below(&r, V);
        dl[t] = 1.0f / T;
    }
    be->lmhead_loss_bwd(be, dx, dWa, x, W, tg, dl, NULL, T, C, V, 0, 0);
    for (int i = 0; i < V * C; i++) dWb[i] = NAN;
    be->lmhead_loss_bwd(be, dx2, dWb, x, W, tg, dl, NULL, T, C, V, 0, CF_MM_DW_SET);
    CHECK(memcmp(dWa, dWb, V * C * sizeof(float)) == 0);
    CHECK(memcmp(dx, dx2, T * C * sizeof(float)) == 0);
    CHECK(max_abs(dWa, V * C) > 0.0);
    free(x); free(W); free(dl); free(dx); free(dx2); free(dWa); free(dWb); free(tg);
}

/* Issue 17: the forward that keeps g = softmax - onehot gives the same
 * losses bit for bit, g matches a double softmax, and the backward from g
 * gives the recompute path's dx and dwlm (fp32: the summation order of
 * dloss (p - 1) against dloss p - dloss differs, ~1e-7), with dloss-zero
 * rows exactly zero in dx and in the consumed g, over several chunks of the
 * recompute path (and zero where g holds a NaN); CF_MM_DW_SET overwrites
 * dwlm; a NULL dwlm (frozen head) still gives dx. One target outside [0, V): a NaN loss, no one-hot term. */
TEST(lmhead_saved_grad_backward_matches_the_recompute_path) {
    cf_rng r;
    cf_rng_seed(&r, 606);
    const size_t nx = LM_T * LM_C, nw = LM_V * LM_C, ng = LM_T * LM_V;
    float *x = fnew(nx), *W = fnew(nw), *la = fnew(LM_T), *lb = fnew(LM_T), *g = fnew(ng), *dl = fnew(LM_T);
    float *dxa = fnew(nx), *dxb = fnew(nx), *dWa = fnew(nw), *dWb = fnew(nw), *dW0 = fnew(nw);
    int tg[LM_T];
    lm_inputs(&r, x, W, tg, 1);
    tg[7] = LM_V;
    be->lmhead_loss_fwd(be, la, x, W, tg, LM_T, LM_C, LM_V);
    be->lmhead_loss_fwd_grad(be, lb, g, x, W, tg, LM_T, LM_C, LM_V);
    CHECK(memcmp(la, lb, LM_T * sizeof(float)) == 0 && isnan(lb[7]));
    double *xd = to_double(x, nx), *Wd = to_double(W, nw), gerr = 0;
    for (int t = 0; t < LM_T; t++) {
        double z[LM_V], m = -INFINITY, s = 0;
        for (int j = 0; j < LM_V; j++) m = fmax(m, z[j] = dot_d(xd + t * LM_C, Wd + j * LM_C, LM_C));
        for (int j = 0; j < LM_V; j++) s += exp(z[j] - m);
        for (int j = 0; j < LM_V; j++)
            gerr = fmax(gerr, fabs(g[(size_t)t * LM_V + j] - (exp(z[j] - m) / s - (j == tg[t]))));
    }
    CHECK_MSG(gerr < FWD_TOL, "g vs double softmax - onehot: max err %g", gerr);
    int zero = 0;
    for (int t = 0; t < LM_T; t++) {
        dl[t] = cf_rng_uniform(&r) < 0.25f ? 0.0f : cf_rng_normal(&r);
        zero += dl[t] == 0;
    }
    CHECK(zero > 0 && dl[7] != 0);
    /* accumulate onto a nonzero dwlm */
    fill_normal(dW0, nw, &r, 1);
    memcpy(dWa, dW0, nw * sizeof(float));
    memcpy(dWb, dW0, nw * sizeof(float));
    for (size_t i = 0; i < nx; i++) dxb[i] = 5.0f;
    be->lmhead_loss_bwd(be, dxa, dWa, x, W, tg, dl, NULL, LM_T, LM_C, LM_V, 0, 0);
    be->lmhead_loss_bwd_saved(be, dxb, dWb, g, x, W, dl, 1.0f, LM_T, LM_C, LM_V, 0);
    CHECK_MSG(rel_err(dxb, dxa, nx) < 1e-6, "dx %g", rel_err(dxb, dxa, nx));
    CHECK_MSG(rel_err(dWb, dWa, nw) < 1e-6, "dwlm += %g", rel_err(dWb, dWa, nw));
    int ok = 1;
    for (int t = 0; t < LM_T; t++)
        if (dl[t] == 0) ok &= max_abs(dxb + (size_t)t * LM_C, LM_C) == 0 && max_abs(g + (size_t)t * LM_V, LM_V) == 0;
    CHECK_MSG(ok, "a dloss-zero row has a nonzero dx or dlogits");
    /* CF_MM_DW_SET: dwlm is written, whatever it held */
    be->lmhead_loss_fwd_grad(be, lb, g, x, W, tg, LM_T, LM_C, LM_V);
    be->memzero(be, dWa, nw * sizeof(float));
    be->lmhead_loss_bwd(be, dxa, dWa, x, W, tg, dl, NULL, LM_T, LM_C, LM_V, 0, CF_MM_DW_SET);
    for (size_t i = 0; i < nw; i++) dWb[i] = NAN;
    be->lmhead_loss_bwd_saved(be, dxb, dWb, g, x, W, dl, 1.0f, LM_T, LM_C, LM_V, CF_MM_DW_SET);
    CHECK_MSG(rel_err(dWb, dWa, nw) < 1e-6, "dwlm = %g", rel_err(dWb, dWa, nw));
    /* a frozen head: dx only; a dloss-zero row gives 0 whatever g holds */
    be->lmhead_loss_fwd_grad(be, lb, g, x, W, tg, LM_T, LM_C, LM_V);
    for (int t = 0; t < LM_T; t++)
        if (dl[t] == 0) g[(size_t)t * LM_V] = NAN;
    for (size_t i = 0; i < nx; i++) dxb[i] = 5.0f;
    be->lmhead_loss_bwd_saved(be, dxb, NULL, g, x, W, dl, 1.0f, LM_T, LM_C, LM_V, 0);
    CHECK_MSG(rel_err(dxb, dxa, nx) < 1e-6, "dx (no dwlm) %g", rel_err(dxb, dxa, nx));
    /* dloss NULL: every row weighs scale, as a dloss of scale everywhere */
    for (int t = 0; t < LM_T; t++) dl[t] = 0.125f;
    be->lmhead_loss_fwd_grad(be, lb, g, x, W, tg, LM_T, LM_C, LM_V);
    be->lmhead_loss_bwd(be, dxa, dWa, x, W, tg, dl, NULL, LM_T, LM_C, LM_V, 0, CF_MM_DW_SET);
    be->lmhead_loss_bwd_saved(be, dxb, dWb, g, x, W, NULL, 0.125f, LM_T, LM_C, LM_V, CF_MM_DW_SET);
    CHECK_MSG(rel_err(dxb, dxa, nx) < 1e-6, "dx (dloss NULL) %g", rel_err(dxb, dxa, nx));
    CHECK_MSG(rel_err(dWb, dWa, nw) < 1e-6, "dwlm (dloss NULL) %g", rel_err(dWb, dWa, nw));
    /* a zero scale is refused with a message, not divided by (its own
     * backend: the failure is sticky) */
    cf_backend *e = cf_backend_cpu_create();
    CHECK(e != NULL);
    if (e) {
        e->lmhead_loss_bwd_saved(e, dxb, dWb, g, x, W, NULL, 0.0f, LM_T, LM_C, LM_V, 0);
        CHECK(e->check(e) != 0 && strstr(cf_last_error(), "scale") != NULL);
        e->destroy(e);
    }
    free(x); free(W); free(la); free(lb); free(g); free(dl); free(dxa); free(dxb); free(dWa); free(dWb); free(dW0);
    free(xd); free(Wd);
}

/* -------------------------------------------------------------- attention */

/* Naive attention in double over n rows that attend among themselves: row j
 * is visible to row i iff seq[j] == seq[i], pos[j] <= pos[i] and
 * doc[j] == doc[i]. Builds the full n x n score matrix. */
static void attn_ref(double *out, double *lse, const double *q, const double *k, const double *v,
                     int n, const int *seq, const int *pos, const int *doc, int H, int Hkv, int D,
                     double scale) {
    double *sc = dnew((size_t)n * n);
    const int group = H / Hkv;
    for (int h = 0; h < H; h++) {
        const int g = h / group;
        for (int i = 0; i < n; i++)
            for (int j = 0; j < n; j++) {
                int vis = seq[j] == seq[i] && pos[j] <= pos[i] && doc[j] == doc[i];
                sc[(size_t)i * n + j] =
                    vis ? scale * dot_d(q + ((size_t)i * H + h) * D, k + ((size_t)j * Hkv + g) * D, D)
                        : -INFINITY;
            }
        for (int i = 0; i < n; i++) {
            double *s = sc + (size_t)i * n, m = -INFINITY, sum = 0;
            for (int j = 0; j < n; j++) m = fmax(m, s[j]);
            for (int j = 0; j < n; j++) sum += exp(s[j] - m);
            lse[(size_t)i * H + h] = m + log(sum);
            double *o = out + ((size_t)i * H + h) * D;
            for (int d = 0; d < D; d++) o[d] = 0;
            for (int j = 0; j < n; j++) {
                double p = exp(s[j] - lse[(size_t)i * H + h]);
                for (int d = 0; d < D; d++) o[d] += p * v[((size_t)j * Hkv + g) * D + d];
            }
        }
    }
    free(sc);
}

/* L = sum over rows i with in_loss[i] (all if NULL) of R_i . out_i */
typedef struct {
    int n, H, Hkv, D;
    double scale;
    const int *seq, *pos, *doc;
    const unsigned char *in_loss;
    double *q, *k, *v, *R, *out, *lse;
} attn_ctx;

static double attn_loss(void *c_) {
    attn_ctx *c = c_;
    attn_ref(c->out, c->lse, c->q, c->k, c->v, c->n, c->seq, c->pos, c->doc, c->H, c->Hkv, c->D,
             c->scale);
    double L = 0;
    const size_t w = (size_t)c->H * c->D;
    for (int i = 0; i < c->n; i++)
        if (!c->in_loss || c->in_loss[i]) L += dot_d(c->R + i * w, c->out + i * w, w);
    return L;
}

/* The standard test problem: B=2, S=7, H=4, Hkv=2, D=8. */
enum { AB = 2, AS = 7, AH = 4, AHKV = 2, AD = 8, AT = AB * AS };
static const int attn_docs[AT] = {0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3, 4, 4};

typedef struct { int n; int rows[AT]; int seq_start[AB + 1]; } kept_set;

/* the most kept rows of any sequence (cf_rows.max_len) */
static int kept_max_len(const int *seq_start, int B) {
    int m = 0;
    for (int b = 0; b < B; b++) m = CF_MAX(m, seq_start[b + 1] - seq_start[b]);
    return m;
}
/* different counts per sequence, a single kept token, an empty sequence */
static const kept_set kept_sets[] = {
    {5, {1, 3, 4, 6, 12}, {0, 4, 5}},
    {6, {0, 7, 9, 10, 12, 13}, {0, 1, 6}},
    {3, {2, 5, 6}, {0, 3, 3}},
};
enum { N_KEPT_SETS = sizeof kept_sets / sizeof kept_sets[0] };

typedef struct {
    cf_attn_shape s;
    int T, n;             /* all rows, kept rows                         */
    float *q, *k, *v, *R; /* full [T, ...]; R is dL/dout                 */
    float *out, *lse;     /* backend forward                             */
    /* compacted to the kept rows */
    cf_rows kept;
    int seq_c[AT], pos_c[AT], doc_c[AT];
    float *qc, *outc, *lsec, *Rc;
    float *dq, *dk, *dv;  /* backward outputs (sized for T rows)         */
    int seq[AT], pos[AT], doc[AT];
} attn_prob;

static void attn_prob_init(attn_prob *p, uint64_t seed, int use_doc, const kept_set *ks) {
    memset(p, 0, sizeof *p);
    cf_rng r;
    cf_rng_seed(&r, seed);
    p->s = (cf_attn_shape){AB, AS, AH, AHKV, AD, 1.0f / sqrtf((float)AD), use_doc ? attn_docs : NULL};
    p->T = AT;
    const size_t nq = (size_t)AT * AH * AD, nkv = (size_t)AT * AHKV * AD;
    p->q = fnew(nq); p->k = fnew(nkv); p->v = fnew(nkv); p->R = fnew(nq);
    p->out = fnew(nq); p->lse = fnew(AT * AH);
    fill_normal(p->q, nq, &r, 1.5f);
    fill_normal(p->k, nkv, &r, 1);
    fill_normal(p->v, nkv, &r, 1);
    fill_normal(p->R, nq, &r, 1);
    for (int i = 0; i < AT; i++) {
        p->seq[i] = i / AS;
        p->pos[i] = i % AS;
        p->doc[i] = use_doc ? attn_docs[i] : p->seq[i];
    }
    be->attention_fwd(be, p->out, p->lse, p->q, p->k, p->v, &p->s);
    p->dq = fnew(nq); p->dk = fnew(nkv); p->dv = fnew(nkv);
    p->qc = fnew(nq); p->outc = fnew(nq); p->lsec = fnew(AT * AH); p->Rc = fnew(nq);
    if (ks) {
        p->n = ks->n;
        p->kept = (cf_rows){ks->n, kept_max_len(ks->seq_start, AB), ks->rows, ks->seq_start};
        const size_t w = (size_t)AH * AD;
        be->gather_rows(be, p->qc, p->q, ks->rows, ks->n, w * sizeof(float));
        be->gather_rows(be, p->outc, p->out, ks->rows, ks->n, w * sizeof(float));
        be->gather_rows(be, p->Rc, p->R, ks->rows, ks->n, w * sizeof(float));
        be->gather_rows(be, p->lsec, p->lse, ks->rows, ks->n, AH * sizeof(float));
        for (int a = 0; a < ks->n; a++) {
            int row = ks->rows[a];
            p->seq_c[a] = p->seq[row];
            p->pos_c[a] = p->pos[row];
            p->doc_c[a] = p->doc[row];
        }
    }
}

static void attn_prob_free(attn_prob *p) {
    free(p->q); free(p->k); free(p->v); free(p->R); free(p->out); free(p->lse);
    free(p->dq); free(p->dk); free(p->dv); free(p->qc); free(p->outc); free(p->lsec); free(p->Rc);
}

static void attn_bwd(attn_prob *p, cf_attn_bwd_mode mode) {
    if (mode == CF_ATTN_BWD_FULL)
        be->attention_bwd(be, p->dq, p->dk, p->dv, p->R, p->q, p->k, p->v, p->out, p->lse, &p->s,
                          NULL, mode);
    else
        be->attention_bwd(be, p->dq, p->dk, p->dv, p->Rc, p->qc, p->k, p->v, p->outc, p->lsec,
                          &p->s, &p->kept, mode);
}

/* d[a, :] = s[rows[a], :] */
static double *gather_d(const double *s, const int *rows, int n, size_t w) {
    double *d = dnew((size_t)n * w);
    for (int a = 0; a < n; a++) memcpy(d + a * w, s + (size_t)rows[a] * w, w * sizeof(double));
    return d;
}

TEST(attention_fwd_matches_naive_reference_causal_gqa_with_and_without_doc_ids) {
    for (int use_doc = 0; use_doc < 2; use_doc++) {
        attn_prob p;
        attn_prob_init(&p, 701 + use_doc, use_doc, NULL);
        const size_t nq = (size_t)AT * AH * AD, nkv = (size_t)AT * AHKV * AD;
        double *qd = to_double(p.q, nq), *kd = to_double(p.k, nkv), *vd = to_double(p.v, nkv);
        double *od = dnew(nq), *ld = dnew(AT * AH);
        attn_ref(od, ld, qd, kd, vd, AT, p.seq, p.pos, p.doc, AH, AHKV, AD, p.s.scale);
        CHECK_MSG(rel_err_d(p.out, od, nq) < FWD_TOL, "doc=%d out %g", use_doc, rel_err_d(p.out, od, nq));
        double lerr = 0;
        for (int i = 0; i < AT * AH; i++) lerr = fmax(lerr, fabs(p.lse[i] - ld[i]));
        CHECK_MSG(lerr < FWD_TOL, "doc=%d lse %g", use_doc, lerr);
        /* row 0 (and, with docs, the first row of each doc) sees only itself */
        CHECK(rel_err(p.out, p.v, AD) < 1e-6);
        free(qd); free(kd); free(vd); free(od); free(ld);
        attn_prob_free(&p);
    }
}

TEST(attention_full_bwd_matches_finite_differences_with_and_without_doc_ids) {
    for (int use_doc = 0; use_doc < 2; use_doc++) {
        attn_prob p;
        attn_prob_init(&p, 711 + use_doc, use_doc, NULL);
        attn_bwd(&p, CF_ATTN_BWD_FULL);
        const size_t nq = (size_t)AT * AH * AD, nkv = (size_t)AT * AHKV * AD;
        attn_ctx c = {AT, AH, AHKV, AD, p.s.scale, p.seq, p.pos, p.doc, NULL,
                      to_double(p.q, nq), to_double(p.k, nkv), to_double(p.v, nkv),
                      to_double(p.R, nq), dnew(nq), dnew(AT * AH)};
        double *gq = dnew(nq), *gk = dnew(nkv), *gv = dnew(nkv);
        fd_grad(gq, c.q, nq, attn_loss, &c);
        fd_grad(gk, c.k, nkv, attn_loss, &c);
        fd_grad(gv, c.v, nkv, attn_loss, &c);
        CHECK_MSG(rel_err_d(p.dq, gq, nq) < GRAD_TOL, "doc=%d dq %g", use_doc, rel_err_d(p.dq, gq, nq));
        CHECK_MSG(rel_err_d(p.dk, gk, nkv) < GRAD_TOL, "doc=%d dk %g", use_doc, rel_err_d(p.dk, gk, nkv));
        CHECK_MSG(rel_err_d(p.dv, gv, nkv) < GRAD_TOL, "doc=%d dv %g", use_doc, rel_err_d(p.dv, gv, nkv));
        free(c.q); free(c.k); free(c.v); free(c.R); free(c.out); free(c.lse);
        free(gq); free(gk); free(gv);
        attn_prob_free(&p);
    }
}

/* The centrifuge reference, straight from the definition: the loss is
 * sum over kept rows i of R_i . out_i of the full (dense, naive) attention;
 * differentiate it w.r.t. q of kept rows and k, v of kept rows only (the
 * filtered K/V rows are held constant). which: 0 = dq, 1 = dk and dv. */
static void check_centrifuge_vs_definition(int which) {
    for (int use_doc = 0; use_doc < 2; use_doc++)
        for (int ks = 0; ks < N_KEPT_SETS; ks++) {
            const kept_set *K = &kept_sets[ks];
            attn_prob p;
            attn_prob_init(&p, 721 + 10 * use_doc + ks, use_doc, K);
            attn_bwd(&p, CF_ATTN_BWD_CENTRIFUGE);
            const size_t wq = (size_t)AH * AD, wkv = (size_t)AHKV * AD;
            const size_t nq = AT * wq, nkv = AT * wkv;
            unsigned char in_loss[AT] = {0};
            for (int a = 0; a < K->n; a++) in_loss[K->rows[a]] = 1;
            attn_ctx c = {AT, AH, AHKV, AD, p.s.scale, p.seq, p.pos, p.doc, in_loss,
                          to_double(p.q, nq), to_double(p.k, nkv), to_double(p.v, nkv),
                          to_double(p.R, nq), dnew(nq), dnew(AT * AH)};
            double *gq = dnew(nq), *gk = dnew(nkv), *gv = dnew(nkv);
            if (which == 0) {
                fd_grad(gq, c.q, nq, attn_loss, &c);
                double *rq = gather_d(gq, K->rows, K->n, wq);
                double e = rel_err_d(p.dq, rq, K->n * wq);
                CHECK_MSG(e < GRAD_TOL, "doc=%d set=%d dq %g", use_doc, ks, e);
                free(rq);
            } else {
                fd_grad(gk, c.k, nkv, attn_loss, &c);
                fd_grad(gv, c.v, nkv, attn_loss, &c);
                double *rk = gather_d(gk, K->rows, K->n, wkv), *rv = gather_d(gv, K->rows, K->n, wkv);
                double ek = rel_err_d(p.dk, rk, K->n * wkv), ev = rel_err_d(p.dv, rv, K->n * wkv);
                CHECK_MSG(ek < GRAD_TOL, "doc=%d set=%d dk %g", use_doc, ks, ek);
                CHECK_MSG(ev < GRAD_TOL, "doc=%d set=%d dv %g", use_doc, ks, ev);
                free(rk); free(rv);
            }
            free(c.q); free(c.k); free(c.v); free(c.R); free(c.out); free(c.lse);
            free(gq); free(gk); free(gv);
            attn_prob_free(&p);
        }
}

TEST(attention_centrifuge_dq_is_exact_over_all_keys) { check_centrifuge_vs_definition(0); }

TEST(attention_centrifuge_dk_dv_of_kept_keys_come_from_kept_queries_only) {
    check_centrifuge_vs_definition(1);
}

/* Loss-only (full backward with dout zero on filtered rows) and centrifuge
 * agree on every kept row: filtered queries contribute nothing to either. */
static void check_centrifuge_vs_masked_full(attn_prob *p) {
    const size_t wq = (size_t)AH * AD, wkv = (size_t)AHKV * AD;
    const int n = p->kept.n;
    float *cq = fnew(n * wq), *ck = fnew(n * wkv), *cv = fnew(n * wkv);
    attn_bwd(p, CF_ATTN_BWD_CENTRIFUGE);
    memcpy(cq, p->dq, n * wq * sizeof(float));
    memcpy(ck, p->dk, n * wkv * sizeof(float));
    memcpy(cv, p->dv, n * wkv * sizeof(float));
    /* full backward with dout masked to the kept rows */
    float *Rfull = p->R;
    float *Rm = fnew(AT * wq);
    for (int a = 0; a < n; a++)
        memcpy(Rm + p->kept.rows[a] * wq, Rfull + p->kept.rows[a] * wq, wq * sizeof(float));
    p->R = Rm;
    attn_bwd(p, CF_ATTN_BWD_FULL);
    p->R = Rfull;
    double eq = 0, ek = 0, ev = 0;
    double *fq = dnew(n * wq), *fk = dnew(n * wkv), *fv = dnew(n * wkv);
    for (int a = 0; a < n; a++) {
        int row = p->kept.rows[a];
        for (size_t i = 0; i < wq; i++) fq[a * wq + i] = p->dq[row * wq + i];
        for (size_t i = 0; i < wkv; i++) fk[a * wkv + i] = p->dk[row * wkv + i];
        for (size_t i = 0; i < wkv; i++) fv[a * wkv + i] = p->dv[row * wkv + i];
    }
    eq = rel_err_d(cq, fq, n * wq);
    ek = rel_err_d(ck, fk, n * wkv);
    ev = rel_err_d(cv, fv, n * wkv);
    CHECK_MSG(eq < 1e-5 && ek < 1e-5 && ev < 1e-5, "dq %g dk %g dv %g", eq, ek, ev);
    free(cq); free(ck); free(cv); free(Rm); free(fq); free(fk); free(fv);
}

TEST(attention_centrifuge_equals_full_backward_with_dout_masked_on_kept_rows) {
    for (int use_doc = 0; use_doc < 2; use_doc++)
        for (int ks = 0; ks < N_KEPT_SETS; ks++) {
            attn_prob p;
            attn_prob_init(&p, 741 + 10 * use_doc + ks, use_doc, &kept_sets[ks]);
            check_centrifuge_vs_masked_full(&p);
            attn_prob_free(&p);
        }
}

TEST(attention_centrifuge_with_all_rows_kept_equals_full) {
    kept_set all = {AT, {0}, {0, AS, AT}};
    for (int i = 0; i < AT; i++) all.rows[i] = i;
    for (int use_doc = 0; use_doc < 2; use_doc++) {
        attn_prob p;
        attn_prob_init(&p, 751 + use_doc, use_doc, &all);
        const size_t nq = (size_t)AT * AH * AD, nkv = (size_t)AT * AHKV * AD;
        attn_bwd(&p, CF_ATTN_BWD_FULL);
        float *fq = fnew(nq), *fk = fnew(nkv), *fv = fnew(nkv);
        memcpy(fq, p.dq, nq * sizeof(float));
        memcpy(fk, p.dk, nkv * sizeof(float));
        memcpy(fv, p.dv, nkv * sizeof(float));
        attn_bwd(&p, CF_ATTN_BWD_CENTRIFUGE);
        CHECK(rel_err(p.dq, fq, nq) < 1e-6);
        CHECK(rel_err(p.dk, fk, nkv) < 1e-6);
        CHECK(rel_err(p.dv, fv, nkv) < 1e-6);
        /* and strawman too: nothing to renormalise away */
        attn_bwd(&p, CF_ATTN_BWD_STRAWMAN);
        CHECK(rel_err(p.dq, fq, nq) < 1e-5);
        CHECK(rel_err(p.dk, fk, nkv) < 1e-5);
        CHECK(rel_err(p.dv, fv, nkv) < 1e-5);
        free(fq); free(fk); free(fv);
        attn_prob_free(&p);
    }
}

TEST(attention_strawman_is_exact_backward_of_attention_on_compacted_sequence) {
    for (int use_doc = 0; use_doc < 2; use_doc++)
        for (int ks = 0; ks < N_KEPT_SETS; ks++) {
            const kept_set *K = &kept_sets[ks];
            attn_prob p;
            attn_prob_init(&p, 761 + 10 * use_doc + ks, use_doc, K);
            attn_bwd(&p, CF_ATTN_BWD_STRAWMAN);
            const size_t wq = (size_t)AH * AD, wkv = (size_t)AHKV * AD;
            const int n = K->n;
            double *qd = to_double(p.q, AT * wq), *kd = to_double(p.k, AT * wkv);
            double *vd = to_double(p.v, AT * wkv);
            /* the compacted problem: kept rows only, original positions/docs */
            attn_ctx c = {n, AH, AHKV, AD, p.s.scale, p.seq_c, p.pos_c, p.doc_c, NULL,
                          gather_d(qd, K->rows, n, wq), gather_d(kd, K->rows, n, wkv),
                          gather_d(vd, K->rows, n, wkv), to_double(p.Rc, n * wq), dnew(n * wq),
                          dnew(n * AH)};
            double *gq = dnew(n * wq), *gk = dnew(n * wkv), *gv = dnew(n * wkv);
            fd_grad(gq, c.q, n * wq, attn_loss, &c);
            fd_grad(gk, c.k, n * wkv, attn_loss, &c);
            fd_grad(gv, c.v, n * wkv, attn_loss, &c);
            double eq = rel_err_d(p.dq, gq, n * wq), ek = rel_err_d(p.dk, gk, n * wkv);
            double ev = rel_err_d(p.dv, gv, n * wkv);
            CHECK_MSG(eq < GRAD_TOL && ek < GRAD_TOL && ev < GRAD_TOL,
                      "doc=%d set=%d dq %g dk %g dv %g", use_doc, ks, eq, ek, ev);
            free(qd); free(kd); free(vd);
            free(c.q); free(c.k); free(c.v); free(c.R); free(c.out); free(c.lse);
            free(gq); free(gk); free(gv);
            attn_prob_free(&p);
        }
}

TEST(attention_strawman_differs_from_centrifuge_when_rows_are_filtered) {
    for (int ks = 0; ks < N_KEPT_SETS; ks++) {
        attn_prob p;
        attn_prob_init(&p, 781 + ks, 0, &kept_sets[ks]);
        const size_t wq = (size_t)AH * AD;
        const int n = kept_sets[ks].n;
        attn_bwd(&p, CF_ATTN_BWD_CENTRIFUGE);
        float *cq = fnew(n * wq);
        memcpy(cq, p.dq, n * wq * sizeof(float));
        attn_bwd(&p, CF_ATTN_BWD_STRAWMAN);
        CHECK_MSG(rel_err(p.dq, cq, n * wq) > 1e-2, "set=%d dq differs by only %g", ks,
                  rel_err(p.dq, cq, n * wq));
        free(cq);
        attn_prob_free(&p);
    }
}

/* A larger random problem for the compact modes: B=3, S=33, H=4, Hkv=1,
 * D=16, random documents, about half the rows kept, dout R zero on filtered
 * rows; the full backward (dq, dk, dv) and the kept rows' gathered q, out,
 * R, lse. */
enum { LB = 3, LS = 33, LH = 4, LHKV = 1, LD = 16, LT = LB * LS };
typedef struct {
    int doc[LT], rows[LT], seq_start[LB + 1], n;
    cf_attn_shape sh;
    cf_rows kept;
    float *q, *k, *v, *R, *out, *lse, *dq, *dk, *dv;   /* [T, ...] */
    float *qc, *oc, *Rc, *lc;                           /* [n, ...] */
} large_prob;

static const size_t LWQ = LH * LD, LWKV = LHKV * LD;

static void large_prob_make(large_prob *p, uint64_t seed) {
    cf_rng r;
    cf_rng_seed(&r, seed);
    int n = 0, d = 0;
    for (int b = 0; b < LB; b++) {
        p->seq_start[b] = n;
        for (int s = 0; s < LS; s++) {
            if (s == 0 || cf_rng_uniform(&r) < 0.15f) d++;
            p->doc[b * LS + s] = d;
            if (cf_rng_uniform(&r) < 0.5f) p->rows[n++] = b * LS + s;
        }
    }
    p->seq_start[LB] = n;
    p->n = n;
    cf_attn_shape sh = {LB, LS, LH, LHKV, LD, 0.25f, p->doc};
    p->sh = sh;
    p->q = fnew(LT * LWQ); p->k = fnew(LT * LWKV); p->v = fnew(LT * LWKV); p->R = fnew(LT * LWQ);
    p->out = fnew(LT * LWQ); p->lse = fnew(LT * LH);
    fill_normal(p->q, LT * LWQ, &r, 1.5f);
    fill_normal(p->k, LT * LWKV, &r, 1);
    fill_normal(p->v, LT * LWKV, &r, 1);
    for (int a = 0; a < n; a++) fill_normal(p->R + p->rows[a] * LWQ, LWQ, &r, 1); /* zero on filtered */
    be->attention_fwd(be, p->out, p->lse, p->q, p->k, p->v, &p->sh);
    p->dq = fnew(LT * LWQ); p->dk = fnew(LT * LWKV); p->dv = fnew(LT * LWKV);
    be->attention_bwd(be, p->dq, p->dk, p->dv, p->R, p->q, p->k, p->v, p->out, p->lse, &p->sh, NULL,
                      CF_ATTN_BWD_FULL);
    p->qc = fnew(n * LWQ); p->oc = fnew(n * LWQ); p->Rc = fnew(n * LWQ); p->lc = fnew(n * LH);
    be->gather_rows(be, p->qc, p->q, p->rows, n, LWQ * sizeof(float));
    be->gather_rows(be, p->oc, p->out, p->rows, n, LWQ * sizeof(float));
    be->gather_rows(be, p->Rc, p->R, p->rows, n, LWQ * sizeof(float));
    be->gather_rows(be, p->lc, p->lse, p->rows, n, LH * sizeof(float));
    cf_rows kept = {n, kept_max_len(p->seq_start, LB), p->rows, p->seq_start};
    p->kept = kept;
}

static void large_prob_free(large_prob *p) {
    float *all[] = {p->q, p->k, p->v, p->R, p->out, p->lse, p->dq, p->dk, p->dv, p->qc, p->oc, p->Rc, p->lc};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++) free(all[i]);
}

/* Centrifuge on the larger problem equals the masked full backward on the
 * kept rows, and is bitwise the same with one thread. */
TEST(attention_centrifuge_equals_masked_full_on_random_larger_problem) {
    static large_prob P;
    large_prob_make(&P, 791);
    const int n = P.n;
    float *cq = fnew(n * LWQ), *ck = fnew(n * LWKV), *cv = fnew(n * LWKV);
    float *fq = fnew(n * LWQ), *fk = fnew(n * LWKV), *fv = fnew(n * LWKV);
    be->attention_bwd(be, cq, ck, cv, P.Rc, P.qc, P.k, P.v, P.oc, P.lc, &P.sh, &P.kept, CF_ATTN_BWD_CENTRIFUGE);
    be->gather_rows(be, fq, P.dq, P.rows, n, LWQ * sizeof(float));
    be->gather_rows(be, fk, P.dk, P.rows, n, LWKV * sizeof(float));
    be->gather_rows(be, fv, P.dv, P.rows, n, LWKV * sizeof(float));
    CHECK(rel_err(cq, fq, n * LWQ) < 1e-5);
    CHECK(rel_err(ck, fk, n * LWKV) < 1e-5);
    CHECK(rel_err(cv, fv, n * LWKV) < 1e-5);
    /* loss-only gives filtered keys gradient, centrifuge does not produce it */
    double filtered_dk = 0;
    for (int i = 0, a = 0; i < LT; i++) {
        if (a < n && P.rows[a] == i) { a++; continue; }
        filtered_dk = fmax(filtered_dk, max_abs(P.dk + i * LWKV, LWKV));
    }
    CHECK(filtered_dk > 0);
    /* bitwise identical with one thread */
    int nt = omp_get_max_threads();
    omp_set_num_threads(1);
    float *cq1 = fnew(n * LWQ), *ck1 = fnew(n * LWKV), *cv1 = fnew(n * LWKV);
    be->attention_bwd(be, cq1, ck1, cv1, P.Rc, P.qc, P.k, P.v, P.oc, P.lc, &P.sh, &P.kept, CF_ATTN_BWD_CENTRIFUGE);
    omp_set_num_threads(nt);
    CHECK(memcmp(cq, cq1, n * LWQ * sizeof(float)) == 0);
    CHECK(memcmp(ck, ck1, n * LWKV * sizeof(float)) == 0);
    CHECK(memcmp(cv, cv1, n * LWKV * sizeof(float)) == 0);
    large_prob_free(&P);
    free(cq); free(ck); free(cv); free(fq); free(fk); free(fv); free(cq1); free(ck1); free(cv1);
}

/* centrifuge-kv from its formula, in double: for each kept query i (row
 * rows[a]) and head h, the softmax of the full forward over all visible keys,
 *   P_ij = exp(s_ij - lse_i), dP_ij = R_i . v_j, D_i = sum_j P_ij dP_ij,
 *   dS_ij = P_ij (dP_ij - D_i);
 *   dq[a] = scale sum_j dS_ij k_j;  for EVERY key j (kept or filtered):
 *   dk[j] += scale dS_ij q_i,  dv[j] += P_ij R_i.
 * dq is [n, H, D], dk and dv are [T, Hkv, D]. */
static void attn_kv_formula(double *dq, double *dk, double *dv, const attn_prob *p, const kept_set *K) {
    const int group = AH / AHKV;
    const double scale = p->s.scale;
    double *sc = dnew(AT), *dp = dnew(AT);
    for (int a = 0; a < K->n; a++) {
        const int i = K->rows[a];
        for (int h = 0; h < AH; h++) {
            const int g = h / group;
            const float *qi = p->q + ((size_t)i * AH + h) * AD, *Ri = p->R + ((size_t)i * AH + h) * AD;
            double m = -INFINITY, sum = 0;
            for (int j = 0; j < AT; j++) {
                int vis = p->seq[j] == p->seq[i] && p->pos[j] <= p->pos[i] && p->doc[j] == p->doc[i];
                double s = 0;
                for (int d = 0; d < AD; d++) s += (double)qi[d] * p->k[((size_t)j * AHKV + g) * AD + d];
                sc[j] = vis ? scale * s : -INFINITY;
                m = fmax(m, sc[j]);
            }
            for (int j = 0; j < AT; j++) sum += exp(sc[j] - m);
            const double lse = m + log(sum);
            double Di = 0;
            for (int j = 0; j < AT; j++) {
                sc[j] = exp(sc[j] - lse); /* P_ij, 0 when invisible */
                double s = 0;
                for (int d = 0; d < AD; d++) s += (double)Ri[d] * p->v[((size_t)j * AHKV + g) * AD + d];
                dp[j] = s;
                Di += sc[j] * dp[j];
            }
            for (int j = 0; j < AT; j++) {
                const double dS = sc[j] * (dp[j] - Di);
                for (int d = 0; d < AD; d++) {
                    dq[((size_t)a * AH + h) * AD + d] += scale * dS * p->k[((size_t)j * AHKV + g) * AD + d];
                    dk[((size_t)j * AHKV + g) * AD + d] += scale * dS * qi[d];
                    dv[((size_t)j * AHKV + g) * AD + d] += sc[j] * Ri[d];
                }
            }
        }
    }
    free(sc); free(dp);
}

/* CENTRIFUGE_KV: dq of the kept queries and dk, dv of EVERY key, against
 * the brute-force formula above and against the definition (finite
 * differences of L = sum over kept i of R_i . out_i with respect to q of
 * kept rows and k, v of all rows). */
TEST(attention_centrifuge_kv_matches_brute_force_formula_and_definition) {
    for (int use_doc = 0; use_doc < 2; use_doc++)
        for (int ks = 0; ks < N_KEPT_SETS; ks++) {
            const kept_set *K = &kept_sets[ks];
            attn_prob p;
            attn_prob_init(&p, 801 + 10 * use_doc + ks, use_doc, K);
            attn_bwd(&p, CF_ATTN_BWD_CENTRIFUGE_KV);
            const size_t wq = (size_t)AH * AD, wkv = (size_t)AHKV * AD;
            const size_t nq = AT * wq, nkv = AT * wkv;
            double *bq = dnew(K->n * wq), *bk = dnew(nkv), *bv = dnew(nkv);
            attn_kv_formula(bq, bk, bv, &p, K);
            double eq = rel_err_d(p.dq, bq, K->n * wq), ek = rel_err_d(p.dk, bk, nkv), ev = rel_err_d(p.dv, bv, nkv);
            CHECK_MSG(eq < FWD_TOL && ek < FWD_TOL && ev < FWD_TOL, "doc=%d set=%d formula: dq %g dk %g dv %g",
                      use_doc, ks, eq, ek, ev);
            unsigned char in_loss[AT] = {0};
            for (int a = 0; a < K->n; a++) in_loss[K->rows[a]] = 1;
            attn_ctx c = {AT, AH, AHKV, AD, p.s.scale, p.seq, p.pos, p.doc, in_loss,
                          to_double(p.q, nq), to_double(p.k, nkv), to_double(p.v, nkv),
                          to_double(p.R, nq), dnew(nq), dnew(AT * AH)};
            double *gq = dnew(nq), *gk = dnew(nkv), *gv = dnew(nkv);
            fd_grad(gq, c.q, nq, attn_loss, &c);
            fd_grad(gk, c.k, nkv, attn_loss, &c);
            fd_grad(gv, c.v, nkv, attn_loss, &c);
            double *rq = gather_d(gq, K->rows, K->n, wq);
            eq = rel_err_d(p.dq, rq, K->n * wq);
            ek = rel_err_d(p.dk, gk, nkv);
            ev = rel_err_d(p.dv, gv, nkv);
            CHECK_MSG(eq < GRAD_TOL && ek < GRAD_TOL && ev < GRAD_TOL, "doc=%d set=%d definition: dq %g dk %g dv %g",
                      use_doc, ks, eq, ek, ev);
            /* a filtered key that a kept query sees gets gradient (what
             * centrifuge drops); one that none sees gets exactly zero */
            for (int j = 0; j < AT; j++) {
                if (in_loss[j]) continue;
                int seen = 0;
                for (int i = 0; i < AT; i++)
                    seen |= in_loss[i] && p.seq[j] == p.seq[i] && p.pos[j] <= p.pos[i] && p.doc[j] == p.doc[i];
                double mk = max_abs(p.dk + j * wkv, wkv), mv = max_abs(p.dv + j * wkv, wkv);
                CHECK_MSG(seen ? mk > 0 && mv > 0 : mk == 0 && mv == 0,
                          "doc=%d set=%d: filtered key %d (seen %d) dk %g dv %g", use_doc, ks, j, seen, mk, mv);
            }
            free(bq); free(bk); free(bv); free(rq);
            free(c.q); free(c.k); free(c.v); free(c.R); free(c.out); free(c.lse);
            free(gq); free(gk); free(gv);
            attn_prob_free(&p);
        }
}

/* CENTRIFUGE_KV and CENTRIFUGE agree bitwise on dq and on the kept keys'
 * dk, dv (same loops, same order); with every row kept both equal FULL. */
TEST(attention_centrifuge_kv_agrees_with_centrifuge_on_kept_rows_and_with_full_when_all_kept) {
    const size_t wq = (size_t)AH * AD, wkv = (size_t)AHKV * AD;
    for (int use_doc = 0; use_doc < 2; use_doc++)
        for (int ks = 0; ks < N_KEPT_SETS; ks++) {
            const kept_set *K = &kept_sets[ks];
            attn_prob p;
            attn_prob_init(&p, 831 + 10 * use_doc + ks, use_doc, K);
            attn_bwd(&p, CF_ATTN_BWD_CENTRIFUGE);
            float *cq = fnew(K->n * wq), *ck = fnew(K->n * wkv), *cv = fnew(K->n * wkv);
            memcpy(cq, p.dq, K->n * wq * sizeof(float));
            memcpy(ck, p.dk, K->n * wkv * sizeof(float));
            memcpy(cv, p.dv, K->n * wkv * sizeof(float));
            attn_bwd(&p, CF_ATTN_BWD_CENTRIFUGE_KV);
            float *kk = fnew(K->n * wkv), *kv = fnew(K->n * wkv);
            be->gather_rows(be, kk, p.dk, K->rows, K->n, wkv * sizeof(float));
            be->gather_rows(be, kv, p.dv, K->rows, K->n, wkv * sizeof(float));
            CHECK(memcmp(p.dq, cq, K->n * wq * sizeof(float)) == 0);
            CHECK(memcmp(kk, ck, K->n * wkv * sizeof(float)) == 0);
            CHECK(memcmp(kv, cv, K->n * wkv * sizeof(float)) == 0);
            free(cq); free(ck); free(cv); free(kk); free(kv);
            attn_prob_free(&p);
        }
    kept_set all = {AT, {0}, {0, AS, AT}};
    for (int i = 0; i < AT; i++) all.rows[i] = i;
    attn_prob p;
    attn_prob_init(&p, 851, 1, &all);
    const size_t nq = AT * wq, nkv = AT * wkv;
    attn_bwd(&p, CF_ATTN_BWD_FULL);
    float *fq = fnew(nq), *fk = fnew(nkv), *fv = fnew(nkv);
    memcpy(fq, p.dq, nq * sizeof(float));
    memcpy(fk, p.dk, nkv * sizeof(float));
    memcpy(fv, p.dv, nkv * sizeof(float));
    attn_bwd(&p, CF_ATTN_BWD_CENTRIFUGE_KV);
    CHECK(rel_err(p.dq, fq, nq) < 1e-6);
    CHECK(rel_err(p.dk, fk, nkv) < 1e-6);
    CHECK(rel_err(p.dv, fv, nkv) < 1e-6);
    free(fq); free(fk); free(fv);
    attn_prob_free(&p);
}

/* CENTRIFUGE_KV on the larger problem equals the full backward with dout
 * zero on filtered rows (dq on kept rows, dk and dv on all rows), and is
 * bitwise the same with one thread. */
TEST(attention_centrifuge_kv_equals_masked_full_on_random_larger_problem) {
    static large_prob P;
    large_prob_make(&P, 861);
    const int n = P.n;
    float *cq = fnew(n * LWQ), *ck = fnew(LT * LWKV), *cv = fnew(LT * LWKV), *fq = fnew(n * LWQ);
    /* NaN-filled outputs: every row must be written */
    for (size_t i = 0; i < LT * LWKV; i++) ck[i] = cv[i] = NAN;
    be->attention_bwd(be, cq, ck, cv, P.Rc, P.qc, P.k, P.v, P.oc, P.lc, &P.sh, &P.kept, CF_ATTN_BWD_CENTRIFUGE_KV);
    be->gather_rows(be, fq, P.dq, P.rows, n, LWQ * sizeof(float));
    CHECK(rel_err(cq, fq, n * LWQ) < 1e-5);
    CHECK(rel_err(ck, P.dk, LT * LWKV) < 1e-5);
    CHECK(rel_err(cv, P.dv, LT * LWKV) < 1e-5);
    int nt = omp_get_max_threads();
    omp_set_num_threads(1);
    float *cq1 = fnew(n * LWQ), *ck1 = fnew(LT * LWKV), *cv1 = fnew(LT * LWKV);
    be->attention_bwd(be, cq1, ck1, cv1, P.Rc, P.qc, P.k, P.v, P.oc, P.lc, &P.sh, &P.kept,
                      CF_ATTN_BWD_CENTRIFUGE_KV);
    omp_set_num_threads(nt);
    CHECK(memcmp(cq, cq1, n * LWQ * sizeof(float)) == 0);
    CHECK(memcmp(ck, ck1, LT * LWKV * sizeof(float)) == 0);
    CHECK(memcmp(cv, cv1, LT * LWKV * sizeof(float)) == 0);
    large_prob_free(&P);
    free(cq); free(ck); free(cv); free(fq); free(cq1); free(ck1); free(cv1);
}

/* ------------------------------------------------------ gather/sumsq/adamw */

TEST(gather_rows_copies_selected_rows_of_any_width) {
    int src[6][3], dst[5][3];
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < 3; j++) src[i][j] = 10 * i + j;
    const int rows[5] = {5, 0, 5, 2, 3};
    be->gather_rows(be, dst, src, rows, 5, 3 * sizeof(int));
    for (int i = 0; i < 5; i++) CHECK(memcmp(dst[i], src[rows[i]], sizeof dst[i]) == 0);
}

TEST(sumsq_accumulates_into_the_double_and_is_thread_count_independent) {
    float five[5] = {1, 2, 3, 4, 5};
    double acc = 0.5;
    be->sumsq(be, &acc, five, 5);
    CHECK(acc == 55.5);
    be->sumsq(be, &acc, five, 0);
    CHECK(acc == 55.5);
    be->sumsq(be, &acc, five + 1, 2); /* += 4 + 9 */
    CHECK(acc == 68.5);
    const size_t n = 1000003;
    float *g = fnew(n);
    cf_rng r;
    cf_rng_seed(&r, 901);
    fill_normal(g, n, &r, 1);
    double ref = 0;
    for (size_t i = 0; i < n; i++) ref += (double)g[i] * g[i];
    double s = 0;
    be->sumsq(be, &s, g, n);
    CHECK_CLOSE(s, ref, 1e-12);
    int nt = omp_get_max_threads();
    omp_set_num_threads(1);
    double s1 = 0;
    be->sumsq(be, &s1, g, n);
    omp_set_num_threads(nt);
    CHECK(s == s1);
    free(g);
}

/* ------------------------------------------- selection bookkeeping ops */

TEST(keep_to_rows_lists_kept_rows_ascending_with_sequence_starts) {
    enum { B = 4, S = 9 };
    /* uneven: 4 kept, none, all, one (the last position) */
    const uint8_t keep[B * S] = {1, 0, 0, 1, 1, 0, 0, 0, 1,
                                 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                 0, 0, 0, 0, 0, 0, 0, 0, 2}; /* any nonzero byte is kept */
    const int want_rows[] = {0, 3, 4, 8, 18, 19, 20, 21, 22, 23, 24, 25, 26, 35};
    const int want_ss[B + 1] = {0, 4, 4, 13, 14};
    int rows[B * S], ss[B + 1];
    for (int i = 0; i < B * S; i++) rows[i] = -7;
    for (int i = 0; i <= B; i++) ss[i] = -7;
    be->keep_to_rows(be, rows, ss, keep, B, S);
    CHECK(memcmp(ss, want_ss, sizeof ss) == 0);
    CHECK(memcmp(rows, want_rows, sizeof want_rows) == 0);
    CHECK(rows[14] == -7); /* nothing written past n */
    /* nothing kept at all */
    const uint8_t none[2 * 3] = {0};
    int ss0[3] = {9, 9, 9};
    be->keep_to_rows(be, rows, ss0, none, 2, 3);
    CHECK(ss0[0] == 0 && ss0[1] == 0 && ss0[2] == 0);
    CHECK(be->check(be) == 0);
}

TEST(fill_dloss_puts_the_value_on_kept_rows_and_zero_elsewhere) {
    const uint8_t keep[6] = {1, 0, 1, 1, 0, 0};
    float d[6];
    for (int i = 0; i < 6; i++) d[i] = NAN;
    be->fill_dloss(be, d, keep, 0.125f, 6);
    const float want[6] = {0.125f, 0, 0.125f, 0.125f, 0, 0};
    CHECK(memcmp(d, want, sizeof d) == 0);
    for (int i = 0; i < 6; i++) d[i] = NAN;
    be->fill_dloss(be, d, NULL, -2.0f, 5); /* no mask: every row; n bounds the write */
    for (int i = 0; i < 5; i++) CHECK(d[i] == -2.0f);
    CHECK(isnan(d[5]));
}

TEST(loss_sum_adds_the_kept_losses_in_double_to_the_accumulator) {
    const float losses[6] = {1.5f, NAN, 2.25f, 1e-8f, INFINITY, 3.0f};
    const uint8_t keep[6] = {1, 0, 1, 1, 0, 1}; /* filtered NaN / inf rows are not read into the sum */
    float acc = 10.0f;
    be->loss_sum(be, &acc, losses, keep, 6);
    CHECK(acc == (float)(10.0 + (1.5 + 2.25 + (double)1e-8f + 3.0)));
    be->loss_sum(be, &acc, losses, keep, 0);
    CHECK(acc == (float)(10.0 + (1.5 + 2.25 + (double)1e-8f + 3.0)));
    /* no mask: all rows; a long sum is the double sum rounded once */
    const int n = 10007;
    float *l = fnew(n);
    cf_rng r;
    cf_rng_seed(&r, 933);
    double ref = 0;
    for (int i = 0; i < n; i++) {
        l[i] = 3.0f * cf_rng_uniform(&r);
        ref += l[i];
    }
    float a2 = 0;
    be->loss_sum(be, &a2, l, NULL, n);
    CHECK(a2 == (float)ref);
    free(l);
}

/* ---------------------------------------------------------------- errors */

TEST(a_failed_op_is_sticky_reported_by_check_synchronize_download_and_later_ops_are_no_ops) {
    cf_backend *e = cf_backend_cpu_create();
    CHECK(e != NULL);
    if (!e) return;
    CHECK(e->check(e) == 0 && e->synchronize(e) == 0);
    float q[3 * 4], k[2 * 4], v[2 * 4], out[3 * 4], lse[3];
    memset(q, 0, sizeof q); memset(k, 0, sizeof k); memset(v, 0, sizeof v);
    cf_attn_shape bad = {1, 1, 3, 2, 4, 0.5f, NULL}; /* H not a multiple of Hkv */
    e->attention_fwd(e, out, lse, q, k, v, &bad);
    cf_fail("%s", "");
    CHECK(e->check(e) == -1);
    CHECK_MSG(strstr(cf_last_error(), "H=3 is not a multiple of Hkv=2") != NULL, "check: %s", cf_last_error());
    /* a second failure does not replace the first message */
    cf_attn_shape bad2 = {1, 1, 4, 2, -1, 0.5f, NULL};
    e->attention_fwd(e, out, lse, q, k, v, &bad2);
    cf_fail("%s", "");
    CHECK(e->synchronize(e) == -1);
    CHECK_MSG(strstr(cf_last_error(), "H=3 is not a multiple of Hkv=2") != NULL, "synchronize: %s",
              cf_last_error());
    float x[4] = {1, 2, 3, 4}, y[4] = {10, 20, 30, 40}, z[4] = {-1, -1, -1, -1};
    cf_fail("%s", "");
    CHECK(e->download(e, z, x, sizeof x) == -1);
    CHECK(strstr(cf_last_error(), "H=3") != NULL);
    CHECK(e->upload(e, z, x, sizeof x) == -1);
    /* later ops do nothing */
    e->add(e, z, x, y, 4);
    e->copy(e, z, x, sizeof x);
    e->memzero(e, z, sizeof z);
    double acc = 1.0;
    e->sumsq(e, &acc, x, 4);
    CHECK(z[0] == -1 && z[1] == -1 && z[2] == -1 && z[3] == -1);
    CHECK(acc == 1.0);
    CHECK(e->alloc(e, 16) == NULL);
    CHECK(e->check(e) == -1);
    e->destroy(e);
    /* the shared backend of the other tests is untouched */
    CHECK(be->check(be) == 0);
}

TEST(attention_bwd_rejects_kept_rows_that_break_the_contract) {
    attn_prob p;
    attn_prob_init(&p, 799, 0, &kept_sets[0]); /* counts 4 and 1 */
    struct { int max_len; int rows[5]; const char *msg; } cases[] = {
        {3, {1, 3, 4, 6, 12}, "more than kept->max_len"},   /* max_len below a sequence's count */
        {4, {1, 4, 3, 6, 12}, "not ascending"},
        {4, {1, 3, 4, 6, 2}, "outside its sequence"},
    };
    for (int c = 0; c < 6; c++) {
        cf_backend *e = cf_backend_cpu_create();
        if (!e) { CHECK(0); break; }
        cf_rows kept = {5, cases[c % 3].max_len, cases[c % 3].rows, kept_sets[0].seq_start};
        e->attention_bwd(e, p.dq, p.dk, p.dv, p.Rc, p.qc, p.k, p.v, p.outc, p.lsec, &p.s, &kept,
                         c < 3 ? CF_ATTN_BWD_CENTRIFUGE : CF_ATTN_BWD_CENTRIFUGE_KV);
        CHECK(e->check(e) == -1);
        CHECK_MSG(strstr(cf_last_error(), cases[c % 3].msg) != NULL, "case %d: %s", c, cf_last_error());
        e->destroy(e);
    }
    /* a loose max_len (an upper bound) is fine */
    cf_rows loose = {5, AS, kept_sets[0].rows, kept_sets[0].seq_start};
    cf_backend *e = cf_backend_cpu_create();
    if (e) {
        e->attention_bwd(e, p.dq, p.dk, p.dv, p.Rc, p.qc, p.k, p.v, p.outc, p.lsec, &p.s, &loose,
                         CF_ATTN_BWD_CENTRIFUGE);
        CHECK(e->check(e) == 0);
        e->destroy(e);
    }
    attn_prob_free(&p);
}

TEST(adamw_matches_hand_computed_two_steps) {
    /* lr 0.1, betas (0.9, 0.999), eps 1e-8, wd 0.01.
     * p0 = 1, g = 0.5 then -0.25, grad_scale 2 (g' = 1, -0.5):
     *   t=1: m = 0.1, v = 0.001, mhat = 1, vhat = 1,
     *        p = 1 - 0.1 (1/(1+1e-8) + 0.01) = 0.899000001
     *   t=2: m = 0.04, v = 0.001249, mhat = 0.04/0.19, vhat = 0.001249/0.001999,
     *        p = 0.899000001 - 0.1 (mhat/(sqrt(vhat)+eps) + 0.01 p) = 0.87146729737
     * p0 = -2, g = -3 then 1, grad_scale 0.5 (g' = -1.5, 0.5):
     *   t=1: m = -0.15, v = 0.00225, p = -1.89800000067
     *   t=2: m = -0.085, v = 0.00249775, p = -1.85608014383 */
    float p[2] = {1.0f, -2.0f}, m[2] = {0, 0}, v[2] = {0, 0};
    float g1[2] = {0.5f, -3.0f}, g2[2] = {-0.25f, 1.0f};
    const float lr = 0.1f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.01f;
    /* two elements with different grad scales: run them as separate calls */
    be->adamw(be, &p[0], NULL, &g1[0], &m[0], &v[0], 1, lr, b1, b2, eps, wd, 2.0f, 1, 0);
    be->adamw(be, &p[1], NULL, &g1[1], &m[1], &v[1], 1, lr, b1, b2, eps, wd, 0.5f, 1, 0);
    CHECK_CLOSE(m[0], 0.1, 1e-6);
    CHECK_CLOSE(v[0], 0.001, 1e-6);
    CHECK_CLOSE(p[0], 0.899000001, 1e-6);
    CHECK_CLOSE(m[1], -0.15, 1e-6);
    CHECK_CLOSE(v[1], 0.00225, 1e-6);
    CHECK_CLOSE(p[1], -1.89800000067, 1e-6);
    be->adamw(be, &p[0], NULL, &g2[0], &m[0], &v[0], 1, lr, b1, b2, eps, wd, 2.0f, 2, 0);
    be->adamw(be, &p[1], NULL, &g2[1], &m[1], &v[1], 1, lr, b1, b2, eps, wd, 0.5f, 2, 0);
    CHECK_CLOSE(m[0], 0.04, 1e-6);
    CHECK_CLOSE(v[0], 0.001249, 1e-6);
    CHECK_CLOSE(p[0], 0.87146729737, 1e-6);
    CHECK_CLOSE(m[1], -0.085, 1e-6);
    CHECK_CLOSE(v[1], 0.00249775, 1e-6);
    CHECK_CLOSE(p[1], -1.85608014383, 1e-6);
    CHECK(g1[0] == 0.0f && g1[1] == 0.0f && g2[0] == 0.0f && g2[1] == 0.0f); /* zeroed for the next accumulation */
}

/* CF_ADAMW_KEEP_GRAD: the same p, m, v bits as the clearing pass, and g
 * read but left as it was (engine/optim.c leaves set-only tensors' gradients
 * STALE this way) */
TEST(adamw_keep_grad_updates_the_same_bits_and_leaves_the_gradient) {
    enum { N = 1003 };
    cf_rng r;
    cf_rng_seed(&r, 1659);
    float *p[2], *m[2], *v[2], *g[2];
    for (int k = 0; k < 2; k++) { p[k] = fnew(N); m[k] = fnew(N); v[k] = fnew(N); g[k] = fnew(N); }
    fill_normal(p[0], N, &r, 1);
    fill_normal(g[0], N, &r, 1);
    memcpy(p[1], p[0], N * sizeof(float));
    memcpy(g[1], g[0], N * sizeof(float));
    float *g_before = fnew(N);
    memcpy(g_before, g[0], N * sizeof(float));
    for (int t = 1; t <= 2; t++) {
        be->adamw(be, p[0], NULL, g[0], m[0], v[0], N, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, t, 0);
        be->adamw(be, p[1], NULL, g[1], m[1], v[1], N, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f, t, CF_ADAMW_KEEP_GRAD);
        int zeroed = 1;
        for (int i = 0; i < N; i++) zeroed &= g[0][i] == 0.0f;
        CHECK_MSG(zeroed, "step %d: the clearing pass left a gradient", t);
        CHECK_MSG(memcmp(g[1], g_before, N * sizeof(float)) == 0, "step %d: KEEP_GRAD changed the gradient", t);
        memcpy(g[0], g_before, N * sizeof(float)); /* the same gradient again */
    }
    CHECK(memcmp(p[0], p[1], N * sizeof(float)) == 0);
    CHECK(memcmp(m[0], m[1], N * sizeof(float)) == 0);
    CHECK(memcmp(v[0], v[1], N * sizeof(float)) == 0);
    for (int k = 0; k < 2; k++) { free(p[k]); free(m[k]); free(v[k]); free(g[k]); }
    free(g_before);
}

TEST(reductions_are_bitwise_identical_for_one_and_many_threads) {
    cf_rng r;
    cf_rng_seed(&r, 951);
    const int T = 50, C = 200;
    float *x = fnew(T * C), *w = fnew(C), *dout = fnew(T * C), *rstd = fnew(T), *y = fnew(T * C);
    float *dx[2], *dw[2], *dwte[2];
    int tok[50];
    fill_normal(x, T * C, &r, 1);
    fill_normal(w, C, &r, 1);
    fill_normal(dout, T * C, &r, 1);
    for (int t = 0; t < T; t++) tok[t] = (int)cf_rng_below(&r, 7);
    be->rmsnorm_fwd(be, y, rstd, x, w, T, C, 1e-6f);
    int nt = omp_get_max_threads();
    for (int pass = 0; pass < 2; pass++) {
        omp_set_num_threads(pass == 0 ? 1 : (nt > 1 ? nt : 4));
        dx[pass] = fnew(T * C); dw[pass] = fnew(C); dwte[pass] = fnew(7 * C);
        be->rmsnorm_bwd(be, dx[pass], dw[pass], dout, x, w, rstd, NULL, T, C, 0);
        be->embedding_bwd(be, dwte[pass], dout, tok, T, C, 0, 7);
    }
    omp_set_num_threads(nt);
    CHECK(memcmp(dx[0], dx[1], T * C * sizeof(float)) == 0);
    CHECK(memcmp(dw[0], dw[1], C * sizeof(float)) == 0);
    CHECK(memcmp(dwte[0], dwte[1], 7 * C * sizeof(float)) == 0);
    for (int i = 0; i < 2; i++) { free(dx[i]); free(dw[i]); free(dwte[i]); }
    free(x); free(w); free(dout); free(rstd); free(y);
}


TEST(swiglu_bwd_rows_through_the_index_equals_explicit_gather_and_recomputes_h) {
    enum { T = 9, F = 12, N = 4 };
    const int rows[N] = {0, 3, 4, 8};
    float gate[T * F], up[T * F], dh[N * F];
    cf_rng r;
    cf_rng_seed(&r, 77);
    for (int i = 0; i < T * F; i++) { gate[i] = 3.0f * cf_rng_normal(&r); up[i] = cf_rng_normal(&r); }
    for (int i = 0; i < N * F; i++) dh[i] = cf_rng_normal(&r);
    float g2[N * F], u2[N * F], h_ref[N * F], dg_ref[N * F], du_ref[N * F], h[N * F], dg[N * F], du[N * F];
    be->gather_rows(be, g2, gate, rows, N, F * sizeof(float));
    be->gather_rows(be, u2, up, rows, N, F * sizeof(float));
    be->swiglu_fwd(be, h_ref, g2, u2, N, F, F);
    be->swiglu_bwd_rows(be, h_ref, dg_ref, du_ref, dh, g2, u2, NULL, N, F, F, F);   /* explicit gather, then no index */
    be->swiglu_fwd(be, h_ref, g2, u2, N, F, F);
    be->swiglu_bwd_rows(be, h, dg, du, dh, gate, up, rows, N, F, F, F);
    CHECK(rel_err(h, h_ref, N * F) < 1e-6);   /* silu(g)*u, rounding may differ in the last bit */
    CHECK(memcmp(dg, dg_ref, sizeof dg) == 0);
    CHECK(memcmp(du, du_ref, sizeof du) == 0);
    /* rows == NULL reads rows 0..n-1 */
    be->swiglu_bwd_rows(be, h, dg, du, dh, gate, up, NULL, N, F, F, F);
    be->swiglu_fwd(be, h_ref, gate, up, N, F, F);
    CHECK(rel_err(h, h_ref, N * F) < 1e-6);
    /* ld = 2F: dgate and dup as the two halves of one [N, 2F] matrix */
    float packed[N * 2 * F], h2[N * F];
    be->swiglu_bwd_rows(be, h, dg, du, dh, gate, up, rows, N, F, F, F);
    be->swiglu_bwd_rows(be, h2, packed, packed + F, dh, gate, up, rows, N, F, F, 2 * F);
    int same = memcmp(h, h2, sizeof h) == 0;
    for (int i = 0; i < N; i++)
        same &= memcmp(packed + i * 2 * F, dg + i * F, F * sizeof(float)) == 0 &&
                memcmp(packed + i * 2 * F + F, du + i * F, F * sizeof(float)) == 0;
    CHECK(same);
}

/* ld_in = 2F: gate and up as the two halves of one [T, 2F] matrix (the
 * fused gate/up GEMM's output), forward and backward (through the row
 * index): the same bits as from two [T, F] matrices. */
TEST(swiglu_with_gate_up_rows_2F_apart_equals_separate_matrices) {
    enum { T = 9, F = 12, N = 4 };
    const int rows[N] = {0, 3, 4, 8};
    float gate[T * F], up[T * F], gu[T * 2 * F], dh[N * F];
    cf_rng r;
    cf_rng_seed(&r, 78);
    for (int i = 0; i < T * F; i++) { gate[i] = 3.0f * cf_rng_normal(&r); up[i] = cf_rng_normal(&r); }
    for (int i = 0; i < N * F; i++) dh[i] = cf_rng_normal(&r);
    for (int t = 0; t < T; t++) {
        memcpy(gu + t * 2 * F, gate + t * F, F * sizeof(float));
        memcpy(gu + t * 2 * F + F, up + t * F, F * sizeof(float));
    }
    float h[T * F], h2[T * F];
    be->swiglu_fwd(be, h, gate, up, T, F, F);
    be->swiglu_fwd(be, h2, gu, gu + F, T, F, 2 * F);
    CHECK(memcmp(h, h2, sizeof h) == 0);
    float hb[N * F], dg[N * F], du[N * F], hb2[N * F], dg2[N * F], du2[N * F];
    be->swiglu_bwd_rows(be, hb, dg, du, dh, gate, up, rows, N, F, F, F);
    be->swiglu_bwd_rows(be, hb2, dg2, du2, dh, gu, gu + F, rows, N, F, 2 * F, F);
    CHECK(memcmp(hb, hb2, sizeof hb) == 0);
    CHECK(memcmp(dg, dg2, sizeof dg) == 0);
    CHECK(memcmp(du, du2, sizeof du) == 0);
}

int main(void) {
    be = cf_backend_cpu_create();
    if (!be) {
        printf("cannot create cpu backend: %s\n", cf_last_error());
        return 1;
    }
    RUN(memory_alloc_is_aligned_and_transfers_roundtrip);
    RUN(memory_alloc_failure_returns_null_with_error);
    RUN(matmul_fwd_matches_double_reference_with_and_without_bias);
    RUN(matmul_fwd_residual_adds_the_residual_to_the_product_in_place_or_not);
    RUN(matmul_bwd_matches_finite_differences_and_accumulates_dw_dbias);
    RUN(matmul_bwd_accumulate_adds_to_dinp_and_null_dinp_dbias_are_skipped);
    RUN(matmul_bwd_dw_set_over_no_rows_writes_zeros_and_accumulate_leaves_dw);
    RUN(rmsnorm_fwd_matches_double_reference_and_saves_rstd);
    RUN(add_rmsnorm_fwd_writes_the_sum_and_its_norm_also_in_place);
    RUN(rmsnorm_bwd_matches_finite_differences_and_accumulates);
    RUN(rmsnorm_bwd_through_a_row_map_is_the_gathered_rows_backward);
    RUN(rope_fwd_matches_hf_rotate_half_reference);
    RUN(rope_bwd_inverts_rope_fwd);
    RUN(rope_bwd_matches_finite_differences);
    RUN(rope_qk_is_rope_of_q_and_of_k);
    RUN(qkv_split_rope_is_the_split_then_rope_qk);
    RUN(qkv_join_rope_bwd_is_rope_qk_bwd_then_the_join);
    RUN(swiglu_fwd_and_bwd_match_reference_and_finite_differences);
    RUN(swiglu_bwd_rows_through_the_index_equals_explicit_gather_and_recomputes_h);
    RUN(swiglu_with_gate_up_rows_2F_apart_equals_separate_matrices);
    RUN(add_works_out_of_place_and_in_place);
    RUN(embedding_fwd_copies_token_rows);
    RUN(embedding_bwd_sums_repeated_tokens_in_row_order_bitwise);
    RUN(lmhead_loss_fwd_matches_full_softmax_reference_across_chunks);
    RUN(lmhead_loss_fwd_and_bwd_are_stable_for_large_logits);
    RUN(lmhead_loss_bwd_matches_finite_differences);
    RUN(lmhead_loss_bwd_zero_dloss_rows_give_zero_dx_and_no_dwlm);
    RUN(lmhead_loss_bwd_dw_set_overwrites_over_several_chunks);
    RUN(lmhead_saved_grad_backward_matches_the_recompute_path);
    RUN(vocab_parallel_slices_reproduce_whole_vocabulary_loss_and_gradients);
    RUN(attention_fwd_matches_naive_reference_causal_gqa_with_and_without_doc_ids);
    RUN(attention_full_bwd_matches_finite_differences_with_and_without_doc_ids);
    RUN(attention_centrifuge_dq_is_exact_over_all_keys);
    RUN(attention_centrifuge_dk_dv_of_kept_keys_come_from_kept_queries_only);
    RUN(attention_centrifuge_equals_full_backward_with_dout_masked_on_kept_rows);
    RUN(attention_centrifuge_with_all_rows_kept_equals_full);
    RUN(attention_strawman_is_exact_backward_of_attention_on_compacted_sequence);
    RUN(attention_strawman_differs_from_centrifuge_when_rows_are_filtered);
    RUN(attention_centrifuge_equals_masked_full_on_random_larger_problem);
    RUN(attention_centrifuge_kv_matches_brute_force_formula_and_definition);
    RUN(attention_centrifuge_kv_agrees_with_centrifuge_on_kept_rows_and_with_full_when_all_kept);
    RUN(attention_centrifuge_kv_equals_masked_full_on_random_larger_problem);
    RUN(gather_rows_copies_selected_rows_of_any_width);
    RUN(sumsq_accumulates_into_the_double_and_is_thread_count_independent);
    RUN(keep_to_rows_lists_kept_rows_ascending_with_sequence_starts);
    RUN(fill_dloss_puts_the_value_on_kept_rows_and_zero_elsewhere);
    RUN(loss_sum_adds_the_kept_losses_in_double_to_the_accumulator);
    RUN(a_failed_op_is_sticky_reported_by_check_synchronize_download_and_later_ops_are_no_ops);
    RUN(attention_bwd_rejects_kept_rows_that_break_the_contract);
    RUN(adamw_matches_hand_computed_two_steps);
    RUN(adamw_keep_grad_updates_the_same_bits_and_leaves_the_gradient);
    RUN(reductions_are_bitwise_identical_for_one_and_many_threads);
    be->destroy(be);
    return test_summary();
}
