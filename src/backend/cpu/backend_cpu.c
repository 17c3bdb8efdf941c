/*
 * backend_cpu.c — the fp32 CPU backend: plain C loops with OpenMP, GEMMs
 * through OpenBLAS. It is the reference every GPU kernel is tested against,
 * so each op is written for clarity first; the math is in the comment above
 * each function (and in backend.h).
 *
 * Memory is ordinary host memory (64-byte aligned); act dtype is float.
 * Every reduction runs in a fixed order, so results do not depend on the
 * number of OpenMP threads (OpenBLAS GEMMs aside).
 *
 * Errors (backend.h): an op that fails (bad attention shape or kept rows,
 * out of memory for a scratch buffer) records its message once, sticky; every
 * later op is a no-op and check, synchronize and download return -1 with it.
 * Nothing here exits or aborts.
 */
#include "backend/backend.h"

#include <cblas.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/cpu/attention_cpu.h"
#include "backend/dropout_mask.h"
#include "base/common.h"

/* ------------------------------------------------------------------ errors */

typedef struct {
    int failed;
    char error[1024];
} cpu_state;

static cpu_state *ST(cf_backend *b) { return (cpu_state *)b->state; }

/* Records the first failure (sticky) and sets cf_fail with it. */
__attribute__((format(printf, 2, 3))) static void cpu_fail(cf_backend *b, const char *fmt, ...) {
    cpu_state *st = ST(b);
    if (!st->failed) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(st->error, sizeof st->error, fmt, ap);
        va_end(ap);
        st->failed = 1;
    }
    cf_fail("%s", st->error);
}

/* An op after a failure is a no-op. */
static int cpu_failed(cf_backend *b) { return ST(b)->failed; }

/* 0, or -1 with the recorded error in cf_fail */
static int cpu_check(cf_backend *b) {
    if (!ST(b)->failed) return 0;
    return cf_fail("%s", ST(b)->error);
}

/* ------------------------------------------------------------------ memory */

static void *cpu_alloc(cf_backend *b, size_t bytes) {
    if (cpu_failed(b)) {
        cpu_check(b);
        return NULL;
    }
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes ? bytes : 64) != 0) {
        cf_fail("out of memory allocating %zu bytes (cpu backend)", bytes);
        return NULL;
    }
    return p;
}

static void cpu_free(cf_backend *b, void *p) { free(p); }

static void cpu_memzero(cf_backend *b, void *p, size_t bytes) {
    if (cpu_failed(b)) return;
    if (bytes) memset(p, 0, bytes);
}

static int cpu_upload(cf_backend *b, void *dst, const void *host_src, size_t bytes) {
    if (cpu_failed(b)) return cpu_check(b);
    if (bytes && dst != host_src) memcpy(dst, host_src, bytes);
    return 0;
}

static int cpu_download(cf_backend *b, void *host_dst, const void *src, size_t bytes) {
    if (cpu_failed(b)) return cpu_check(b);
    if (bytes && host_dst != src) memcpy(host_dst, src, bytes);
    return 0;
}

static void cpu_copy(cf_backend *b, void *dst, const void *src, size_t bytes) {
    if (cpu_failed(b)) return;
    if (bytes && dst != src) memmove(dst, src, bytes);
}

static void cpu_act_from_f32(cf_backend *b, void *dst, const float *host_src, size_t n) {
    cpu_copy(b, dst, host_src, n * sizeof(float));
}

static void cpu_act_to_f32(cf_backend *b, float *host_dst, const void *src, size_t n) {
    cpu_copy(b, host_dst, src, n * sizeof(float));
}

/* The compute weights are fp32 too: usually the master itself (no-op). */
static void cpu_weights_from_master(cf_backend *b, void *w, const float *master, size_t n) {
    cpu_copy(b, w, master, n * sizeof(float));
}

static int cpu_synchronize(cf_backend *b) { return cpu_check(b); }

static void cpu_destroy(cf_backend *b) {
    if (!b) return;
    free(b->state);
    free(b);
}

/* Free and total host memory: MemAvailable and MemTotal of /proc/meminfo,
 * else the page counts of sysconf. */
static int cpu_memory_info(cf_backend *b, size_t *free_bytes, size_t *total_bytes) {
    unsigned long long avail_kb = 0, total_kb = 0;
    FILE *f = fopen("/proc/meminfo", "r");
    if (f) {
        char line[256];
        while (fgets(line, sizeof line, f)) {
            unsigned long long v;
            if (sscanf(line, "MemTotal: %llu kB", &v) == 1) total_kb = v;
            else if (sscanf(line, "MemAvailable: %llu kB", &v) == 1) avail_kb = v;
        }
        fclose(f);
    }
    if (!total_kb || !avail_kb) {
        long page = sysconf(_SC_PAGESIZE), phys = sysconf(_SC_PHYS_PAGES), av = sysconf(_SC_AVPHYS_PAGES);
        if (page <= 0 || phys <= 0 || av < 0) return cf_fail("cannot read the host memory size");
        total_kb = (unsigned long long)phys * (unsigned long long)page / 1024;
        avail_kb = (unsigned long long)av * (unsigned long long)page / 1024;
    }
    if (free_bytes) *free_bytes = (size_t)(avail_kb * 1024);
    if (total_bytes) *total_bytes = (size_t)(total_kb * 1024);
    return 0;
}

static void *cpu_device_context(cf_backend *b) { return NULL; }

/* --------------------------------------------------------------- embedding */

/* out[t,:] = wte[tokens[t] - vstart,:] for tokens in the slice, else 0 */
static void cpu_embedding_fwd(cf_backend *b, void *out_, const int *tokens, const void *wte_,
                              int T, int C, int vstart, int vlen) {
    if (cpu_failed(b)) return;
    float *out = out_;
    const float *wte = wte_;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) {
        int r = tokens[t] - vstart;
        if (r >= 0 && r < vlen)
            memcpy(out + (size_t)t * C, wte + (size_t)r * C, (size_t)C * sizeof(float));
        else
            memset(out + (size_t)t * C, 0, (size_t)C * sizeof(float));
    }
}

/* dwte[tokens[t]-vstart,:] += dout[t,:] for tokens in the slice. Parallel
 * over column blocks; inside a block the rows are added in row order, so
 * repeated tokens sum deterministically and no two threads touch the same
 * element. */
static void cpu_embedding_bwd(cf_backend *b, float *dwte, const void *dout_, const int *tokens,
                              int T, int C, int vstart, int vlen) {
    if (cpu_failed(b)) return;
    const float *dout = dout_;
    const int CB = 64;
#pragma omp parallel for schedule(static)
    for (int c0 = 0; c0 < C; c0 += CB) {
        const int c1 = CF_MIN(C, c0 + CB);
        for (int t = 0; t < T; t++) {
            int r = tokens[t] - vstart;
            if (r < 0 || r >= vlen) continue;
            float *dst = dwte + (size_t)r * C;
            const float *src = dout + (size_t)t * C;
            for (int c = c0; c < c1; c++) dst[c] += src[c];
        }
    }
}

/* ------------------------------------------------------------------ matmul */

/* out[T,N] = inp[T,K] W[N,K]^T (+ bias[N]) */
static void cpu_matmul_fwd(cf_backend *b, void *out_, const void *inp_, const void *w_,
                           const void *bias_, int T, int K, int N) {
    if (cpu_failed(b)) return;
    float *out = out_;
    const float *inp = inp_, *w = w_, *bias = bias_;
    if (T <= 0 || N <= 0) return;
    float beta = 0.0f;
    if (bias) {
        for (int t = 0; t < T; t++) memcpy(out + (size_t)t * N, bias, (size_t)N * sizeof(float));
        beta = 1.0f;
    }
    if (K <= 0) {
        if (!bias) memset(out, 0, (size_t)T * N * sizeof(float));
        return;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, N, K, 1.0f, inp, K, w, K, beta, out, N);
}

/* out[T,N] = resid[T,N] + inp[T,K] W[N,K]^T (+ bias[N]); out may alias resid */
static void cpu_matmul_fwd_residual(cf_backend *b, void *out_, const void *inp_, const void *w_,
                                    const void *bias_, const void *resid_, int T, int K, int N) {
    if (cpu_failed(b)) return;
    float *out = out_;
    const float *inp = inp_, *w = w_, *bias = bias_, *resid = resid_;
    if (T <= 0 || N <= 0) return;
    if (out != resid) memcpy(out, resid, (size_t)T * N * sizeof(float));
    if (bias)
        for (int t = 0; t < T; t++)
            for (int n = 0; n < N; n++) out[(size_t)t * N + n] += bias[n];
    if (K > 0) cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, N, K, 1.0f, inp, K, w, K, 1.0f, out, N);
}

/* dinp[T,K] (=, or += if flags & CF_MM_ACC_DINP) alpha dout[T,N] W[N,K]
 * dw[N,K]   += alpha dout^T inp   (= if flags & CF_MM_DW_SET, zeros when T <= 0) */
static void matmul_bwd_scaled(cf_backend *b, float *dinp, float *dw, const float *dout, const float *inp,
                              const float *w, int T, int K, int N, int flags, float alpha) {
    const int accumulate = flags & CF_MM_ACC_DINP;
    if (T <= 0 && dw && (flags & CF_MM_DW_SET) && N > 0 && K > 0)
        memset(dw, 0, (size_t)N * K * sizeof(float)); /* the product over no rows */
    if (T <= 0 || K <= 0) return;
    if (dinp) {
        if (N > 0)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, K, N, alpha, dout, N, w, K,
                        accumulate ? 1.0f : 0.0f, dinp, K);
        else if (!accumulate)
            memset(dinp, 0, (size_t)T * K * sizeof(float));
    }
    if (N > 0 && dw)
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, N, K, T, alpha, dout, N, inp, K,
                    (flags & CF_MM_DW_SET) ? 0.0f : 1.0f, dw, K);
}

/* matmul_bwd_scaled at alpha 1, and
 * dbias[N]  += sum_t dout[t,:]   (if dbias; parallel over columns, rows in order) */
static void cpu_matmul_bwd(cf_backend *b, void *dinp, float *dw, float *dbias, const void *dout_,
                           const void *inp, const void *w, int T, int K, int N, int flags) {
    if (cpu_failed(b)) return;
    const float *dout = dout_;
    matmul_bwd_scaled(b, dinp, dw, dout, inp, w, T, K, N, flags, 1.0f);
    if (dbias && T > 0 && K > 0) {
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) {
            float acc = 0.0f;
            for (int t = 0; t < T; t++) acc += dout[(size_t)t * N + n];
            dbias[n] += acc;
        }
    }
}

/* ----------------------------------------------------------------- rmsnorm */

/* rstd[t] = 1 / sqrt(mean_c(x[t,c]^2) + eps)   (sum of squares in double)
 * out[t,c] = (x[t,c] * rstd[t]) * w[c]         (HF order) */
static void cpu_rmsnorm_fwd(cf_backend *b, void *out_, float *rstd, const void *inp_,
                            const void *w_, int T, int C, float eps) {
    if (cpu_failed(b)) return;
    float *out = out_;
    const float *inp = inp_, *w = w_;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) {
        const float *x = inp + (size_t)t * C;
        float *y = out + (size_t)t * C;
        double ss = 0.0;
        for (int c = 0; c < C; c++) ss += (double)x[c] * x[c];
        float r = 1.0f / sqrtf((float)(ss / C) + eps);
        for (int c = 0; c < C; c++) y[c] = (x[c] * r) * w[c];
        rstd[t] = r;
    }
}

/* sum = a + c, then the RMSNorm of sum (fp32: nothing to round) */
static void cpu_add_rmsnorm_fwd(cf_backend *b, void *sum_, void *out, float *rstd, const void *a_,
                                const void *c_, const void *w, int T, int C, float eps) {
    if (cpu_failed(b)) return;
    float *sum = sum_;
    const float *a = a_, *c = c_;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < (size_t)T * C; i++) sum[i] = a[i] + c[i];
    cpu_rmsnorm_fwd(b, out, rstd, sum, w, T, C, eps);
}

/* With xhat = x * rstd and y = xhat * w:
 *   dx[c] = rstd * (w[c] dy[c] - xhat[c] * mean_c'(w[c'] dy[c'] xhat[c']))
 *   dw[c] += sum_t dy[t,c] xhat[t,c]
 * dx rows are independent (parallel over rows); dw is parallel over column
 * blocks with the rows summed in order. */
static void cpu_rmsnorm_bwd(cf_backend *b, void *dinp_, float *dw, const void *dout_,
                            const void *inp_, const void *w_, const float *rstd, const int *rows, int T,
                            int C, int accumulate) {
    if (cpu_failed(b)) return;
    float *dinp = dinp_;
    const float *dout = dout_, *inp = inp_, *w = w_;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) {
        const int xt = rows ? rows[t] : t;
        const float *x = inp + (size_t)xt * C, *dy = dout + (size_t)t * C;
        float *dx = dinp + (size_t)t * C;
        const float r = rstd[xt];
        double dot = 0.0;
        for (int c = 0; c < C; c++) dot += (double)w[c] * dy[c] * (x[c] * r);
        const float mean = (float)(dot / C);
        for (int c = 0; c < C; c++) {
            float g = r * (w[c] * dy[c] - (x[c] * r) * mean);
            dx[c] = accumulate ? dx[c] + g : g;
        }
    }
    if (!dw) return;   /* a frozen norm weight */
    const int CB = 64;
#pragma omp parallel for schedule(static)
    for (int c0 = 0; c0 < C; c0 += CB) {
        const int c1 = CF_MIN(C, c0 + CB);
        float acc[64];
        for (int c = c0; c < c1; c++) acc[c - c0] = 0.0f;
        for (int t = 0; t < T; t++) {
            const int xt = rows ? rows[t] : t;
            const float *x = inp + (size_t)xt * C, *dy = dout + (size_t)t * C;
            const float r = rstd[xt];
            for (int c = c0; c < c1; c++) acc[c - c0] += dy[c] * (x[c] * r);
        }
        for (int c = c0; c < c1; c++) dw[c] += acc[c - c0];
    }
}

/* -------------------------------------------------------------------- rope */

/* Rotate-half RoPE on x[T, nh, D] in place, with sign = +1 (forward) or -1
 * (backward: the transposed rotation). For i < D/2:
 *   theta = pos[t] * inv_freq[i]      (fp32 product, as HF)
 *   x1 = x[i], x2 = x[i + D/2]
 *   x[i]       = x1 cos(theta) - x2 sin(sign*theta)
 *   x[i + D/2] = x2 cos(theta) + x1 sin(sign*theta) */
static void rope_apply(float *x, const int *pos, const float *inv_freq, int T, int nh, int D,
                       float sign) {
    const int half = D / 2;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) {
        for (int i = 0; i < half; i++) {
            const float theta = (float)pos[t] * inv_freq[i];
            const float c = cosf(theta), s = sign * sinf(theta);
            for (int h = 0; h < nh; h++) {
                float *xh = x + ((size_t)t * nh + h) * D;
                const float x1 = xh[i], x2 = xh[i + half];
                xh[i] = x1 * c - x2 * s;
                xh[i + half] = x2 * c + x1 * s;
            }
        }
    }
}

static void cpu_rope_fwd(cf_backend *b, void *x, const int *pos, const float *inv_freq, int T,
                         int nh, int D) {
    if (cpu_failed(b)) return;
    rope_apply(x, pos, inv_freq, T, nh, D, 1.0f);
}

static void cpu_rope_bwd(cf_backend *b, void *dx, const int *pos, const float *inv_freq, int T,
                         int nh, int D) {
    if (cpu_failed(b)) return;
    rope_apply(dx, pos, inv_freq, T, nh, D, -1.0f);
}

static void cpu_rope_qk(cf_backend *b, void *q, const int *qpos, int Tq, int Hq, void *k,
                        const int *kpos, int Tk, int Hk, const float *inv_freq, int D, int bwd) {
    if (cpu_failed(b)) return;
    rope_apply(q, qpos, inv_freq, Tq, Hq, D, bwd ? -1.0f : 1.0f);
    rope_apply(k, kpos, inv_freq, Tk, Hk, D, bwd ? -1.0f : 1.0f);
}

/* The fused q/k/v rows qkv[T, (Hq + 2 Hk) D] and the parts q, k, v: split
 * (join = 0: the rows copied into the parts, q and k rotated) or joined
 * (join = 1, the split's backward: the parts copied into the rows, q and k
 * rotated back). The rotation is rope_apply's, with the same theta, cos,
 * sin and products, so the same bits. */
static void qkv_rows(float *qkv, float *q, float *k, float *v, const int *pos, int T, int Hq, int Hk,
                     const float *inv_freq, int D, int join) {
    const int half = D / 2, nh = Hq + 2 * Hk;
    const size_t qw = (size_t)Hq * D * sizeof(float), kw = (size_t)Hk * D * sizeof(float);
    const float sign = join ? -1.0f : 1.0f;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++) {
        float *row = qkv + (size_t)t * nh * D;
        float *qt = q + (size_t)t * Hq * D, *kt = k + (size_t)t * Hk * D, *vt = v + (size_t)t * Hk * D;
        if (join) {
            memcpy(row, qt, qw);
            memcpy(row + (size_t)Hq * D, kt, kw);
            memcpy(row + (size_t)(Hq + Hk) * D, vt, kw);
        } else {
            memcpy(qt, row, qw);
            memcpy(kt, row + (size_t)Hq * D, kw);
            memcpy(vt, row + (size_t)(Hq + Hk) * D, kw);
        }
        for (int i = 0; i < half; i++) {
            const float theta = (float)pos[t] * inv_freq[i];
            const float c = cosf(theta), s = sign * sinf(theta);
            for (int h = 0; h < Hq + Hk; h++) {
                float *xh = join ? row + (size_t)h * D : h < Hq ? qt + (size_t)h * D : kt + (size_t)(h - Hq) * D;
                const float x1 = xh[i], x2 = xh[i + half];
                xh[i] = x1 * c - x2 * s;
                xh[i + half] = x2 * c + x1 * s;
            }
        }
    }
}

static void cpu_qkv_split_rope(cf_backend *b, void *q, void *k, void *v, const void *qkv, const int *pos, int T,
                               int Hq, int Hk, const float *inv_freq, int D) {
    if (cpu_failed(b)) return;
    qkv_rows((float *)qkv, q, k, v, pos, T, Hq, Hk, inv_freq, D, 0);
}

static void cpu_qkv_join_rope_bwd(cf_backend *b, void *dqkv, const void *dq, const void *dk, const void *dv,
                                  const int *pos, int T, int Hq, int Hk, const float *inv_freq, int D) {
    if (cpu_failed(b)) return;
    qkv_rows(dqkv, (float *)dq, (float *)dk, (float *)dv, pos, T, Hq, Hk, inv_freq, D, 1);
}

/* ------------------------------------------------------------------ swiglu */

/* h = silu(g) * u, silu(g) = g / (1 + exp(-g)); gate/up rows ld_in apart */
static void cpu_swiglu_fwd(cf_backend *b, void *h_, const void *gate_, const void *up_, int T, int F,
                           int ld_in) {
    if (cpu_failed(b)) return;
    float *h = h_;
    const float *gate = gate_, *up = up_;
#pragma omp parallel for schedule(static)
    for (int t = 0; t < T; t++)
        for (int c = 0; c < F; c++) {
            const float g = gate[(size_t)t * ld_in + c];
            h[(size_t)t * F + c] = g / (1.0f + expf(-g)) * up[(size_t)t * ld_in + c];
        }
}

/* SwiGLU backward on rows gathered through `rows` (see backend.h; gate and
 * up rows ld_in apart, dgate and dup rows ld apart). With
 * sig = 1/(1+exp(-g)): silu = g sig, silu' = sig (1 + g (1 - sig));
 * dgate = dh * u * silu'(g), dup = dh * silu(g). */
static void cpu_swiglu_bwd_rows(cf_backend *b, void *h_, void *dgate_, void *dup_, const void *dh_,
                                const void *gate_, const void *up_, const int *rows, int n, int F, int ld_in,
                                int ld) {
    if (cpu_failed(b)) return;
    float *h = h_, *dgate = dgate_, *dup = dup_;
    const float *dh = dh_, *gate = gate_, *up = up_;
#pragma omp parallel for schedule(static)
    for (int i = 0; i < n; i++) {
        const size_t src = (size_t)(rows ? rows[i] : i) * ld_in, dst = (size_t)i * F, dd = (size_t)i * ld;
        for (int c = 0; c < F; c++) {
            const float g = gate[src + c], u = up[src + c], d = dh[dst + c];
            const float sig = 1.0f / (1.0f + expf(-g));
            const float silu = g * sig;
            h[dst + c] = silu * u;
            dgate[dd + c] = d * u * sig * (1.0f + g * (1.0f - sig));
            dup[dd + c] = d * silu;
        }
    }
}

/* out = a + c (out may alias a or c) */
static void cpu_add(cf_backend *b, void *out_, const void *a_, const void *c_, size_t n) {
    if (cpu_failed(b)) return;
    float *out = out_;
    const float *a = a_, *c = c_;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) out[i] = a[i] + c[i];
}

/* x = s * x */
static void cpu_scale(cf_backend *b, void *x_, float s, size_t n) {
    if (cpu_failed(b)) return;
    float *x = x_;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) x[i] *= s;
}

/* out[i,c] = keep(key, r, c) ? x[i,c] * scale : 0, r = rows ? rows[i] : i
 * (the counter-based mask of dropout_mask.h; out may alias x) */
static void cpu_dropout(cf_backend *b, void *out_, const void *x_, uint64_t key, uint32_t threshold, float scale,
                        const int *rows, int n, int C) {
    if (cpu_failed(b)) return;
    float *out = out_;
    const float *x = x_;
#pragma omp parallel for schedule(static)
    for (int i = 0; i < n; i++) {
        const uint32_t r = (uint32_t)(rows ? rows[i] : i);
        const size_t o = (size_t)i * C;
        for (int c = 0; c < C; c++)
            out[o + c] = cf_dropout_keep(key, threshold, r, (uint32_t)c) ? x[o + c] * scale : 0.0f;
    }
}

/* --------------------------------------------------------------- attention */

static void cpu_attention_fwd(cf_backend *b, void *out, float *lse, const void *q, const void *k,
                              const void *v, const cf_attn_shape *s) {
    if (cpu_failed(b)) return;
    if (cf_cpu_attention_fwd(out, lse, q, k, v, s) != 0) cpu_fail(b, "%s", cf_last_error());
}

static void cpu_attention_bwd(cf_backend *b, void *dq, void *dk, void *dv, const void *dout,
                              const void *q, const void *k, const void *v, const void *out,
                              const float *lse, const cf_attn_shape *s, const cf_rows *kept,
                              cf_attn_bwd_mode mode) {
    if (cpu_failed(b)) return;
    if (cf_cpu_attention_bwd(dq, dk, dv, dout, q, k, v, out, lse, s, kept, mode) != 0)
        cpu_fail(b, "%s", cf_last_error());
}

/* ----------------------------------------------------------- LM head + loss */

/* Rows per chunk of logits: at most 256, and about 32 MiB of fp32 logits. */
static int lmhead_chunk_rows(int V) {
    long r = (8L << 20) / (V > 0 ? V : 1);
    return (int)CF_MAX(1, CF_MIN(256, r));
}

/* For each row of logits[n,V]: lse = m + log(sum exp(z - m)), m = max z
 * (sum in double). */
static float row_logsumexp(const float *z, int V) {
    float m = -INFINITY;
    for (int j = 0; j < V; j++) m = z[j] > m ? z[j] : m;
    double sum = 0.0;
    for (int j = 0; j < V; j++) sum += expf(z[j] - m);
    return m + (float)log(sum);
}

/* The LM head's forward in chunks of rows, so only one [chunk, V] block of
 * logits z = x W^T exists at a time. Whole vocabulary (stats NULL):
 * losses[t] = logsumexp_v(z[t,v]) - z[t,targets[t]], NaN for a target
 * outside [0, V). A vocabulary slice (vocab-parallel cross-entropy, first
 * half; ids vstart..vstart+V-1): stats[t] = {max, sum of exp relative to
 * it, the target's logit when the slice holds it, else 0}. g != NULL (whole
 * vocabulary): also g[t,:] = exp(z[t,:] - lse) - onehot(targets[t]). */
static void cpu_lmhead_fwd(cf_backend *b, float *losses, float *stats, float *g, const float *x,
                           const float *wlm, const int *targets, int T, int C, int V, int vstart) {
    if (cpu_failed(b) || T <= 0) return;
    const int R = lmhead_chunk_rows(V);
    float *logits = malloc((size_t)CF_MIN(R, T) * V * sizeof(float));
    if (!logits) {
        cpu_fail(b, "out of memory for an LM-head logits chunk (%d x %d floats)", CF_MIN(R, T), V);
        return;
    }
    for (int t0 = 0; t0 < T; t0 += R) {
        const int n = CF_MIN(R, T - t0);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, V, C, 1.0f, x + (size_t)t0 * C, C,
                    wlm, C, 0.0f, logits, V);
#pragma omp parallel for schedule(static)
        for (int r = 0; r < n; r++) {
            const float *z = logits + (size_t)r * V;
            const int tg = targets[t0 + r] - vstart;
            const int have = tg >= 0 && tg < V;
            if (!stats) {
                const float lse = row_logsumexp(z, V);
                losses[t0 + r] = have ? lse - z[tg] : NAN;
                if (g) {
                    float *gr = g + (size_t)(t0 + r) * V;
                    for (int j = 0; j < V; j++) gr[j] = expf(z[j] - lse);
                    if (have) gr[tg] -= 1.0f;
                }
                continue;
            }
            float m = -INFINITY;
            for (int j = 0; j < V; j++) m = z[j] > m ? z[j] : m;
            double sum = 0.0;
            for (int j = 0; j < V; j++) sum += expf(z[j] - m);
            float *st = stats + (size_t)(t0 + r) * 3;
            st[0] = m;
            st[1] = (float)sum;
            st[2] = have ? z[tg] : 0.0f;
        }
    }
    free(logits);
}

static void cpu_lmhead_loss_fwd(cf_backend *b, float *losses, const void *x, const void *wlm,
                                const int *targets, int T, int C, int V) {
    cpu_lmhead_fwd(b, losses, NULL, NULL, x, wlm, targets, T, C, V, 0);
}

static void cpu_lmhead_loss_fwd_grad(cf_backend *b, float *losses, void *g, const void *x, const void *wlm,
                                     const int *targets, int T, int C, int V) {
    cpu_lmhead_fwd(b, losses, NULL, g, x, wlm, targets, T, C, V, 0);
}

static void cpu_lmhead_stats_fwd(cf_backend *b, float *stats, const void *x, const void *wlm,
                                 const int *targets, int T, int C, int V, int vstart) {
    cpu_lmhead_fwd(b, NULL, stats, NULL, x, wlm, targets, T, C, V, vstart);
}

/* For every row, in chunks of rows:
 *   dz[t,:] = dloss[t] * (softmax(z[t,:]) - onehot(targets[t]))
 *   dx[t,:] = dz[t,:] W          (overwrite; rows with dloss 0 get 0)
 *   dwlm   += dz^T x
 * Rows of weight 0 are computed too, as a dense framework does: loss-only
 * mode (RHO-1 as published) must cost what the full backward costs. The
 * centrifuge path passes the kept rows only. */
static void cpu_lmhead_loss_bwd(cf_backend *b, void *dx_, float *dwlm, const void *x_,
                                const void *wlm_, const int *targets, const float *dloss,
                                const float *lse_in, int T, int C, int V, int vstart, int flags) {
    if (cpu_failed(b)) return;
    float *dx = dx_;
    const float *x = x_, *wlm = wlm_;
    if (T <= 0) return;
    memset(dx, 0, (size_t)T * C * sizeof(float));
    const int R = lmhead_chunk_rows(V);
    const int cap = CF_MIN(R, T);
    float *logits = malloc((size_t)cap * V * sizeof(float));
    float *xs = malloc((size_t)cap * C * sizeof(float));
    float *dxs = malloc((size_t)cap * C * sizeof(float));
    int *idx = malloc((size_t)cap * sizeof(int));
    if (!logits || !xs || !dxs || !idx) {
        free(logits); free(xs); free(dxs); free(idx);
        cpu_fail(b, "out of memory for an LM-head logits chunk (%d x %d floats)", cap, V);
        return;
    }

    int t = 0;
    for (;;) {
        /* the next chunk of rows */
        int n = 0;
        for (; t < T && n < cap; t++) idx[n++] = t;
        if (n == 0) break;
        for (int r = 0; r < n; r++)
            memcpy(xs + (size_t)r * C, x + (size_t)idx[r] * C, (size_t)C * sizeof(float));
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, V, C, 1.0f, xs, C, wlm, C, 0.0f,
                    logits, V);
#pragma omp parallel for schedule(static)
        for (int r = 0; r < n; r++) {
            float *z = logits + (size_t)r * V;
            const float lse = lse_in ? lse_in[idx[r]] : row_logsumexp(z, V);
            const float dl = dloss[idx[r]];
            for (int j = 0; j < V; j++) z[j] = dl * expf(z[j] - lse);
            const int tg = targets[idx[r]] - vstart;
            if (tg >= 0 && tg < V) z[tg] -= dl;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, C, V, 1.0f, logits, V, wlm, C,
                    0.0f, dxs, C);
        if (dwlm)   /* NULL: a frozen LM head; the first chunk writes it when it holds zeros */
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, V, C, n, 1.0f, logits, V, xs, C,
                        t == n && (flags & CF_MM_DW_SET) ? 0.0f : 1.0f, dwlm, C);
        for (int r = 0; r < n; r++)
            memcpy(dx + (size_t)idx[r] * C, dxs + (size_t)r * C, (size_t)C * sizeof(float));
    }
    free(logits); free(xs); free(dxs); free(idx);
}

/* The backward from the forward's g = softmax - onehot (no recompute):
 *   g[t,:] *= dloss[t]   (0 where dloss[t] == 0, whatever g holds)
 *   dx = g W ; dwlm += g^T x   (matmul_bwd's two GEMMs over all T rows)
 * or, without a dloss, the two products times scale and g unchanged */
static void cpu_lmhead_loss_bwd_saved(cf_backend *b, void *dx, float *dwlm, void *g_, const void *x,
                                      const void *wlm, const float *dloss, float scale, int T, int C, int V,
                                      int flags) {
    if (cpu_failed(b) || T <= 0) return;
    if (!(scale != 0.0f) || !isfinite(scale)) {
        cpu_fail(b, "lmhead_loss_bwd_saved: scale %g must be finite and nonzero", scale);
        return;
    }
    /* fp32. With a dloss: g's rows weighted in place (the GPU's split into a
     * row factor and a GEMM scale only saves it a rounding); without one the
     * scale rides on the GEMMs, as on the GPU, and g stays as it is
     * (backend.h) */
    float *g = g_;
    if (dloss) {
#pragma omp parallel for schedule(static)
        for (int t = 0; t < T; t++) {
            float *gr = g + (size_t)t * V;
            const float d = dloss[t];
            for (int j = 0; j < V; j++) gr[j] = d == 0.0f ? 0.0f : d * gr[j];
        }
    }
    matmul_bwd_scaled(b, dx, dwlm, g, x, wlm, T, C, V, flags & CF_MM_DW_SET, dloss ? 1.0f : scale);
}

/* Second half: the slices' (max, sum, target logit) -> lse and loss. */
static void cpu_xent_combine(cf_backend *b, float *losses, float *lse, const float *parts, const int *targets,
                             int T, int nparts, int V) {
    if (cpu_failed(b)) return;
    for (int t = 0; t < T; t++) {
        float M = -INFINITY, tgt = 0.0f;
        for (int p = 0; p < nparts; p++) M = CF_MAX(M, parts[((size_t)p * T + t) * 3]);
        double s = 0.0;
        for (int p = 0; p < nparts; p++) {
            const float *st = parts + ((size_t)p * T + t) * 3;
            if (st[0] > -INFINITY) s += (double)st[1] * exp((double)st[0] - M);
            tgt += st[2];
        }
        float l = M + (float)log(s);
        if (lse) lse[t] = l;
        losses[t] = targets[t] >= 0 && targets[t] < V ? l - tgt : NAN;
    }
}

/* ------------------------------------------------------------ misc + adamw */

/* dst[i,:] = src[rows[i],:] */
static void cpu_gather_rows(cf_backend *b, void *dst_, const void *src_, const int *rows, int n,
                            size_t row_bytes) {
    if (cpu_failed(b)) return;
    char *dst = dst_;
    const char *src = src_;
#pragma omp parallel for schedule(static)
    for (int i = 0; i < n; i++) memcpy(dst + (size_t)i * row_bytes, src + (size_t)rows[i] * row_bytes, row_bytes);
}

/* acc[0] += sum_i g[i]^2 in double, as a fixed set of block partials added
 * in order (the same result for any thread count). */
static void cpu_sumsq(cf_backend *b, double *acc, const float *g, size_t n) {
    if (cpu_failed(b)) return;
    enum { NB = 256 };
    double part[NB];
    const size_t per = (n + NB - 1) / NB;
#pragma omp parallel for schedule(static)
    for (int k = 0; k < NB; k++) {
        const size_t i0 = (size_t)k * per, i1 = CF_MIN(n, i0 + per);
        double acc = 0.0;
        for (size_t i = i0; i < i1; i++) acc += (double)g[i] * g[i];
        part[k] = acc;
    }
    double sum = 0.0;
    for (int k = 0; k < NB; k++) sum += part[k];
    acc[0] += sum;
}

/* AdamW, step t (1-based), on n elements:
 *   g' = g * grad_scale
 *   m  = beta1 m + (1 - beta1) g'
 *   v  = beta2 v + (1 - beta2) g'^2
 *   mhat = m / (1 - beta1^t), vhat = v / (1 - beta2^t)
 *   p -= lr * (mhat / (sqrt(vhat) + eps) + wd * p)
 * g is zeroed after, unless flags & CF_ADAMW_KEEP_GRAD. */
static void cpu_adamw(cf_backend *b, float *p, void *w_, float *g, float *m, float *v, size_t n, float lr,
                      float beta1, float beta2, float eps, float wd, float grad_scale, int t, int flags) {
    if (cpu_failed(b)) return;
    const int clear = !(flags & CF_ADAMW_KEEP_GRAD);
    const float bc1 = (float)(1.0 - pow((double)beta1, (double)t));
    const float bc2 = (float)(1.0 - pow((double)beta2, (double)t));
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        const float gi = g[i] * grad_scale;
        const float mi = beta1 * m[i] + (1.0f - beta1) * gi;
        const float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        const float mhat = mi / bc1, vhat = vi / bc2;
        p[i] -= lr * (mhat / (sqrtf(vhat) + eps) + wd * p[i]);
        if (clear) g[i] = 0.0f;
        if (w_ && w_ != (void *)p) ((float *)w_)[i] = p[i];
    }
}

/* adamw on each segment in turn (the CPU has no launches to save) */
static void cpu_adamw_segments(cf_backend *b, float *p, void *w_, float *g, float *m, float *v, const cf_adamw_seg *segs,
                               int nseg, float lr, float beta1, float beta2, float eps, float grad_scale, int t) {
    float *w = w_;
    for (int s = 0; s < nseg; s++) {
        const cf_adamw_seg *q = &segs[s];
        cpu_adamw(b, p + q->poff, w && w != p ? w + q->woff : p + q->poff, g + q->goff, m + q->poff, v + q->poff, q->n,
                  lr, beta1, beta2, eps, q->wd, grad_scale, t, q->flags);
    }
}

/* --------------------------------------------------- selection bookkeeping */

/* rows[] = the kept rows (keep[t] != 0) ascending; seq_start[b] = number of
 * kept rows before sequence b (B+1 entries). */
static void cpu_keep_to_rows(cf_backend *b, int *rows, int *seq_start, const uint8_t *keep, int B,
                             int S) {
    if (cpu_failed(b)) return;
    int n = 0;
    for (int bi = 0; bi < B; bi++) {
        seq_start[bi] = n;
        for (int s = 0; s < S; s++)
            if (keep[(size_t)bi * S + s]) rows[n++] = bi * S + s;
    }
    if (B >= 0) seq_start[B] = n;
}

/* dloss[t] = keep == NULL || keep[t] ? value : 0 */
static void cpu_fill_dloss(cf_backend *b, float *dloss, const uint8_t *keep, float value, int n) {
    if (cpu_failed(b)) return;
    for (int t = 0; t < n; t++) dloss[t] = (!keep || keep[t]) ? value : 0.0f;
}

/* acc[0] += sum of the kept losses, in row order in double, rounded once */
static void cpu_loss_sum(cf_backend *b, float *acc, const float *losses, const uint8_t *keep, int n) {
    if (cpu_failed(b)) return;
    double s = 0.0;
    for (int t = 0; t < n; t++)
        if (!keep || keep[t]) s += (double)losses[t];
    acc[0] = (float)((double)acc[0] + s);
}

/* ----------------------------------------------------------------- create */

cf_backend *cf_backend_cpu_create(void) {
    cf_backend *b = cf_calloc(1, sizeof *b);
    cpu_state *st = cf_calloc(1, sizeof *st);
    if (!b || !st) {
        free(b);
        free(st);
        return NULL;
    }
    b->name = "cpu";
    b->device_name = "cpu";
    b->act_size = sizeof(float);
    b->state = st;

    b->alloc = cpu_alloc;
    b->free = cpu_free;
    b->memzero = cpu_memzero;
    b->upload = cpu_upload;
    b->download = cpu_download;
    b->copy = cpu_copy;
    b->act_from_f32 = cpu_act_from_f32;
    b->act_to_f32 = cpu_act_to_f32;
    b->weights_from_master = cpu_weights_from_master;
    b->synchronize = cpu_synchronize;
    b->check = cpu_check;
    b->destroy = cpu_destroy;

    b->embedding_fwd = cpu_embedding_fwd;
    b->embedding_bwd = cpu_embedding_bwd;
    b->matmul_fwd = cpu_matmul_fwd;
    b->matmul_fwd_residual = cpu_matmul_fwd_residual;
    b->matmul_bwd = cpu_matmul_bwd;
    b->rmsnorm_fwd = cpu_rmsnorm_fwd;
    b->add_rmsnorm_fwd = cpu_add_rmsnorm_fwd;
    b->rmsnorm_bwd = cpu_rmsnorm_bwd;
    b->rope_fwd = cpu_rope_fwd;
    b->rope_bwd = cpu_rope_bwd;
    b->rope_qk = cpu_rope_qk;
    b->qkv_split_rope = cpu_qkv_split_rope;
    b->qkv_join_rope_bwd = cpu_qkv_join_rope_bwd;
    b->swiglu_fwd = cpu_swiglu_fwd;
    b->swiglu_bwd_rows = cpu_swiglu_bwd_rows;
    b->add = cpu_add;
    b->scale = cpu_scale;
    b->dropout = cpu_dropout;
    b->attention_fwd = cpu_attention_fwd;
    b->attention_bwd = cpu_attention_bwd;
    b->lmhead_loss_fwd = cpu_lmhead_loss_fwd;
    b->lmhead_loss_bwd = cpu_lmhead_loss_bwd;
    b->lmhead_loss_fwd_grad = cpu_lmhead_loss_fwd_grad;
    b->lmhead_loss_bwd_saved = cpu_lmhead_loss_bwd_saved;
    b->lmhead_stats_fwd = cpu_lmhead_stats_fwd;
    b->xent_combine = cpu_xent_combine;
    b->gather_rows = cpu_gather_rows;
    b->sumsq = cpu_sumsq;
    b->adamw = cpu_adamw;
    b->adamw_segments = cpu_adamw_segments;

    b->keep_to_rows = cpu_keep_to_rows;
    b->fill_dloss = cpu_fill_dloss;
    b->loss_sum = cpu_loss_sum;

    b->memory_info = cpu_memory_info;
    b->device_context = cpu_device_context;
    return b;
}
