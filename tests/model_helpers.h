/*
 * model_helpers.h — what the model-level CPU tests share: a model with
 * weights large enough that every path carries signal, random tokens, and
 * the gradients of all tensors packed in table order, compared per tensor.
 */
#ifndef CF_MODEL_HELPERS_H
#define CF_MODEL_HELPERS_H

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

/* Offset of tensor i in the packed host arrays of these tests. */
static inline size_t toff(const cf_model *m, int i) {
    size_t o = 0;
    for (int j = 0; j < i; j++) o += cf_model_tensor_numel(m, j);
    return o;
}

/* Every tensor's gradient, packed; frozen tensors are zeros. */
static inline float *all_grads(cf_model *m) {
    float *g = calloc(cf_model_num_params(m), sizeof(float));
    for (int i = 0; i < cf_model_num_tensors(m); i++)
        if (cf_model_tensor_trainable(m, i)) cf_model_get_grad(m, i, g + toff(m, i));
    return g;
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

#endif
