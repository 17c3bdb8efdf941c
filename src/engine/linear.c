/*
 * linear.c — the linear block: every projection of the model (q, k, v, o,
 * gate, up, down) goes through these three functions, so what a linear
 * layer does beyond y = x W^T + b is written once:
 *   - a frozen weight or bias gets no gradient (its weight-gradient GEMM is
 *     never run);
 *   - a low-rank adapter adds its term here (forward and backward);
 *   - a tensor-parallel layer adds its collective here.
 *
 * Shapes: in [T, K], out [T, N], W [N, K] (HF nn.Linear layout).
 */
#include "engine/model_internal.h"

void cf_linear_fwd(cf_model *m, const cf_linear *l, void *out, const void *in, int T, int K, int N) {
    cf_backend *b = m->b;
    b->matmul_fwd(b, out, in, cf_weight(m, l->w), cf_weight(m, l->b), T, K, N);
}

void cf_linear_bwd_input(cf_model *m, const cf_linear *l, void *din, const void *dout, int T, int K, int N,
                         int accumulate) {
    if (!din) return;
    cf_backend *b = m->b;
    b->matmul_bwd(b, din, NULL, NULL, dout, NULL, cf_weight(m, l->w), T, K, N, accumulate);
}

void cf_linear_bwd_weight(cf_model *m, const cf_linear *l, const void *dout, const void *in, int T, int K, int N) {
    float *dw = cf_grad(m, l->w), *db = cf_grad(m, l->b);
    if (!dw && !db) return;   /* frozen: no weight-gradient GEMM at all */
    cf_backend *b = m->b;
    b->matmul_bwd(b, NULL, dw, db, dout, in, cf_weight(m, l->w), T, K, N, 0);
}

void cf_linear_bwd(cf_model *m, const cf_linear *l, void *din, const void *dout, const void *in, int T, int K,
                   int N, int accumulate) {
    float *dw = cf_grad(m, l->w), *db = cf_grad(m, l->b);
    cf_backend *b = m->b;
    if (!dw && !db) {
        cf_linear_bwd_input(m, l, din, dout, T, K, N, accumulate);
        return;
    }
    b->matmul_bwd(b, din, dw, db, dout, in, cf_weight(m, l->w), T, K, N, accumulate);
}
