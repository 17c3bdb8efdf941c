/*
 * model_helpers.h — what the model-level CPU tests share: a model with
 * weights large enough that every path carries signal, random tokens, and
 * the gradients of all tensors packed in table order, compared per tensor.
 */
#ifndef CF_MODEL_HELPERS_H
#define CF_MODEL_HELPERS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "base/common.h"
#include "engine/model_internal.h"
#include "test.h"

/* Matrices drawn from N(0, matrix_std^2), vectors (norms, biases) moved by
 * N(0, vector_std^2), from one RNG stream seeded by seed. */
static inline void randomize_weights(cf_model *m, uint64_t seed, float matrix_std, float vector_std) {
    cf_rng r;
    cf_rng_seed(&r, seed);
    for (int i = 0; i < cf_model_num_tensors(m); i++) {
        size_t n = cf_model_tensor_numel(m, i);
        float *w = malloc(n * sizeof(float));
        cf_model_get_param(m, i, w);
        int matrix = m->params[i].ndim == 2;
        for (size_t j = 0; j < n; j++) w[j] = matrix ? matrix_std * cf_rng_normal(&r) : w[j] + vector_std * cf_rng_normal(&r);
        cf_model_set_param(m, i, w);
        free(w);
    }
}

/* A built-in config on the CPU with weights 0.25 / +0.2 (seed ^ 0x5eed). */
static inline cf_model *make_model(const char *name, uint64_t seed) {
    cf_config c;
    if (cf_config_builtin(&c, name) != 0) { printf("    %s\n", cf_last_error()); return NULL; }
    cf_model *m = cf_model_create(&c, CF_BACKEND_CPU, seed);
    if (!m) { printf("    %s\n", cf_last_error()); return NULL; }
    randomize_weights(m, seed ^ 0x5eed, 0.25f, 0.2f);
    return m;
}

static inline void random_tokens(int32_t *tok, int n, int V, uint64_t seed) {
    cf_rng r;
    cf_rng_seed(&r, seed);
    for (int i = 0; i < n; i++) tok[i] = (int32_t)cf_rng_below(&r, (uint32_t)V);
}

/* Random tokens of B rows of S+1 in which token `bos` starts a second
 * document at position 3 of row 0 and 6 of row 1 (and nowhere else). */
static inline void two_document_tokens(int32_t *tok, int B, int S, int V, int bos, uint64_t seed) {
    random_tokens(tok, B * (S + 1), V, seed);
    for (int i = 0; i < B * (S + 1); i++)
        if (tok[i] == bos) tok[i] = bos + 1;
    tok[3] = bos;             /* sequence 0: documents [0,3) and [3,S) */
    tok[(S + 1) + 6] = bos;   /* sequence 1: documents [0,6) and [6,S) */
}

/* Offset of tensor i in the packed host arrays of these tests. */
static inline size_t toff(const cf_model *m, int i) {
    size_t o = 0;
    for (int j = 0; j < i; j++) o += cf_model_tensor_numel(m, j);
    return o;
}

/* Every tensor's gradient, packed; frozen tensors are zeros. A failed read
 * is a failed check: left as zeros it would match a zero reference. */
static inline float *all_grads(cf_model *m) {
    float *g = calloc(cf_model_num_params(m), sizeof(float));
    for (int i = 0; i < cf_model_num_tensors(m); i++)
        if (cf_model_tensor_trainable(m, i))
            CHECK_MSG(cf_model_get_grad(m, i, g + toff(m, i)) == 0, "gradient of %s: %s", cf_model_tensor_name(m, i),
                      cf_last_error());
    return g;
}

/* 1 if every trainable tensor's gradient in g (packed) is non-zero, else 0
 * and *where names the first all-zero one. max_rel passes a tensor that is
 * all zero on both sides, so the tests check their reference with this. */
static inline int every_tensor_nonzero(cf_model *m, const float *g, const char **where) {
    for (int i = 0; i < cf_model_num_tensors(m); i++) {
        if (!cf_model_tensor_trainable(m, i)) continue;
        const float *gi = g + toff(m, i);
        size_t j = 0, n = cf_model_tensor_numel(m, i);
        while (j < n && gi[j] == 0.0f) j++;
        if (j == n) {
            if (where) *where = cf_model_tensor_name(m, i);
            return 0;
        }
    }
    return 1;
}

/* Largest per-tensor relative L2 error of a against b, and where. */
static inline double max_rel(const cf_model *m, const float *a, const float *b, const char **where) {
    double worst = 0;
    for (int i = 0; i < cf_model_num_tensors(m); i++) {
        double e = rel_l2(a + toff(m, i), b + toff(m, i), cf_model_tensor_numel(m, i));
        if (!(e <= worst)) { worst = e; if (where) *where = cf_model_tensor_name(m, i); }
    }
    return worst;
}

/* Largest per-tensor relative L2 error between the weights of a and b. */
static inline double weights_max_rel(cf_model *a, cf_model *b) {
    size_t np = cf_model_num_params(a);
    float *wa = malloc(np * sizeof(float)), *wb = malloc(np * sizeof(float));
    for (int i = 0; i < cf_model_num_tensors(a); i++) {
        cf_model_get_param(a, i, wa + toff(a, i));
        cf_model_get_param(b, i, wb + toff(b, i));
    }
    double e = max_rel(a, wa, wb, NULL);
    free(wa);
    free(wb);
    return e;
}

/* The trainer tests' options: micro-batches of one sequence of seq
 * tokens, self-selection at keep, AdamW lr 1e-2 (betas 0.9, 0.95, eps
 * 1e-3, weight decay 0.1) with gradient clipping at clip. */
static inline cf_train_opts test_train_opts(cf_mode mode, double keep, int seq, int accum, float clip) {
    cf_train_opts o = {0};
    o.mode = mode;
    o.select = (cf_select_opts){CF_SELECT_SELF, keep, 0, 1};
    o.adamw = (cf_adamw_params){1e-2f, 0.9f, 0.95f, 1e-3f, 0.1f, clip};
    o.batch = 1;
    o.seq = seq;
    o.grad_accum = accum;
    return o;
}

/* Mean of losses[0, T) over the positions keep selects (NULL = all). */
static inline double masked_mean(const float *losses, int T, const uint8_t *keep) {
    double s = 0;
    int n = 0;
    for (int t = 0; t < T; t++)
        if (!keep || keep[t]) { s += losses[t]; n++; }
    return s / n;
}

/* |g| of n gradient values, in double. */
static inline double grad_norm(const float *g, size_t n) {
    double s = 0;
    for (size_t j = 0; j < n; j++) s += (double)g[j] * g[j];
    return sqrt(s);
}

/* Central finite difference of loss(ctx) along the unit direction d in the
 * weights of tensor i: (L(w + eps d) - L(w - eps d)) / (2 eps); the tensor
 * is restored. The analytic value to compare with is g . d. */
static inline double fd_directional(cf_model *m, int i, const float *d, double eps, double (*loss)(void *),
                                    void *ctx) {
    size_t n = cf_model_tensor_numel(m, i);
    float *w0 = malloc(n * sizeof(float)), *w = malloc(n * sizeof(float));
    cf_model_get_param(m, i, w0);
    for (size_t j = 0; j < n; j++) w[j] = w0[j] + (float)eps * d[j];
    cf_model_set_param(m, i, w);
    double lp = loss(ctx);
    for (size_t j = 0; j < n; j++) w[j] = w0[j] - (float)eps * d[j];
    cf_model_set_param(m, i, w);
    double lm = loss(ctx);
    cf_model_set_param(m, i, w0);
    free(w0);
    free(w);
    return (lp - lm) / (2 * eps);
}

/* The directional finite difference along tensor i's own gradient (g: the
 * packed gradients of all tensors): *gn = |g_i|, and *fd, which should
 * equal it; *fd = 0 when g_i is all zero (no direction). */
static inline void fd_along_gradient(cf_model *m, int i, const float *g, double eps, double (*loss)(void *), void *ctx,
                                     double *fd, double *gn) {
    size_t n = cf_model_tensor_numel(m, i);
    const float *gi = g + toff(m, i);
    *gn = grad_norm(gi, n);
    *fd = 0;
    if (!(*gn > 0)) return;
    float *d = malloc(n * sizeof(float));
    for (size_t j = 0; j < n; j++) d[j] = (float)(gi[j] / *gn);
    *fd = fd_directional(m, i, d, eps, loss, ctx);
    free(d);
}

/* The backward of the forward just run, in `mode` over the rows keep marks
 * (NULL: every row), or (stopgrad) centrifuge's dense stop-gradient
 * reference over them. 0, or -1 with cf_fail. */
static inline int backward_with_mask(cf_model *m, cf_mode mode, const uint8_t *keep, int stopgrad) {
    cf_kept kept;
    int rc = keep ? cf_kept_from_mask(m, keep, &kept) : 0;
    if (rc == 0)
        rc = stopgrad ? cf_backward_reference_stopgrad(m, &kept, 1.0f, NULL)
                      : cf_backward(m, mode, keep ? &kept : NULL, 1.0f, NULL);
    return rc;
}

/* One forward of a sequence of S tokens, the half of the rows with the
 * highest loss kept, a centrifuge backward over them; more: another
 * micro-batch of the step follows (opt.more_micro: dwpair.c may hold the
 * rows). 0, or -1 with cf_fail. */
static inline int centrifuge_backward_of(cf_model *m, const int32_t *tok, int S, int more) {
    float *l = malloc((size_t)S * sizeof(float));
    uint8_t *keep = malloc((size_t)S);
    int rc = l && keep ? cf_forward(m, tok, 1, S, l) : cf_fail("out of memory");
    if (rc == 0) {
        cf_select(l, NULL, 1, S, 0.5, CF_SELECT_SELF, 0, 3, keep);
        m->opt.more_micro = more;
        rc = backward_with_mask(m, CF_MODE_CENTRIFUGE, keep, 0);
        m->opt.more_micro = 0;
    }
    free(l);
    free(keep);
    return rc;
}

#endif
