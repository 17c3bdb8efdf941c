/*
 * linear.c — the linear block: every projection of the model (q, k, v, o,
 * gate, up, down) goes through these functions, so what a linear layer
 * does beyond y = x W^T + b is written once:
 *   - a frozen weight or bias gets no gradient (its weight-gradient GEMM is
 *     never run);
 *   - a LoRA adapter adds s (x A^T) B^T (forward and backward, below);
 *   - a row-parallel layer under tensor parallelism (o, down) gives a partial
 *     sum that the caller all-reduces, so only TP rank 0 adds the bias.
 *
 * Shapes: in [T, K], out [T, N], W [N, K] (HF nn.Linear layout); adapter
 * A [r, K], B [N, r], s = alpha / r (alpha / sqrt(r) with rslora).
 *
 * LoRA, with u = s x A^T [T, r] saved (the filter gathers it like every
 * other saved activation, so the centrifuge backward runs on kept rows):
 *   forward   y  = x W^T + u B^T
 *   backward  g  = s dy B             [n, r]   (kept in m->lora_du)
 *             dB += dy^T u,  dA += g^T x,  dx += dy W + g A
 * W itself is frozen: only its input gradient dy W is computed.
 *
 * LoRA dropout (PEFT's lora_dropout, training forwards only): the adapter
 * sees xd = x * mask / (1 - P), mask ~ Bernoulli(1 - P) per element, so
 *   forward   u  = s xd A^T,  y = x W^T + u B^T
 *   backward  dB += dy^T u (unchanged),  dA += g^T xd,
 *             dx += dy W + (g A) * mask / (1 - P)
 * The mask is never stored: it is a hash of (seed, forward counter, the
 * adapter's lora_A index, row, column) (backend/dropout_mask.h), drawn
 * again in the backward at the forward's row indices (m->lora_rows in a
 * compact backward). xd and g A live in m->lora_v, which the adapter's
 * forward only needs after u is made and the backward not at all.
 */
#include "engine/model_internal.h"
#include "backend/dropout_mask.h"

/* The mask key of adapter l in the last forward. */
static uint64_t drop_key(const cf_model *m, const cf_linear *l) {
    return cf_dropout_key(m->drop_seed, m->drop_ctr, (uint64_t)l->la);
}

/* out = in W^T (+ b), plus resid when resid is not NULL (the residual
 * stream's add in the GEMM's epilogue; the adapter's output is added after) */
static void linear_fwd(cf_model *m, const cf_linear *l, void *out, const void *in, const void *resid, int T, int K,
                       int N) {
    cf_backend *b = m->b;
    const void *bias = l->row_tp && m->tp.rank != 0 ? NULL : cf_weight(m, l->b);
    if (resid)
        b->matmul_fwd_residual(b, out, in, cf_weight(m, l->w), bias, resid, T, K, N);
    else
        b->matmul_fwd(b, out, in, cf_weight(m, l->w), bias, T, K, N);
    if (l->la < 0) return;
    int r = m->lora.rank;
    void *u = m->saved[l->su].full;
    if (m->drop_on) {
        /* xd = dropout(x) into lora_v (free until u B^T below) */
        b->dropout(b, m->lora_v, in, drop_key(m, l), m->drop_thr, m->drop_scale, NULL, T, K);
        in = m->lora_v;
    }
    b->matmul_fwd(b, u, in, cf_weight(m, l->la), NULL, T, K, r);
    b->scale(b, u, m->lora_scale, (size_t)T * r);
    b->matmul_fwd(b, m->lora_v, u, cf_weight(m, l->lb), NULL, T, r, N);
    b->add(b, out, out, m->lora_v, (size_t)T * N);
}

void cf_linear_fwd(cf_model *m, const cf_linear *l, void *out, const void *in, int T, int K, int N) {
    linear_fwd(m, l, out, in, NULL, T, K, N);
}

void cf_linear_fwd_residual(cf_model *m, const cf_linear *l, void *out, const void *in, const void *resid, int T,
                            int K, int N) {
    linear_fwd(m, l, out, in, resid, T, K, N);
}

void cf_linear_bwd_input(cf_model *m, const cf_linear *l, void *din, const void *dout, int T, int K, int N,
                         int accumulate) {
    cf_backend *b = m->b;
    if (l->la >= 0) {
        int r = m->lora.rank;
        /* g = s dy B, for dA (bwd_weight) and the adapter's input gradient */
        b->matmul_bwd(b, m->lora_du, NULL, NULL, dout, NULL, cf_weight(m, l->lb), T, r, N, 0);
        b->scale(b, m->lora_du, m->lora_scale, (size_t)T * r);
    }
    if (!din) return;
    b->matmul_bwd(b, din, NULL, NULL, dout, NULL, cf_weight(m, l->w), T, K, N, accumulate ? CF_MM_ACC_DINP : 0);
    if (l->la < 0) return;
    if (!m->drop_on) {
        b->matmul_bwd(b, din, NULL, NULL, m->lora_du, NULL, cf_weight(m, l->la), T, K, m->lora.rank, CF_MM_ACC_DINP);
        return;
    }
    /* dx += (g A) * mask / (1 - P), the forward's mask at the original rows */
    b->matmul_bwd(b, m->lora_v, NULL, NULL, m->lora_du, NULL, cf_weight(m, l->la), T, K, m->lora.rank, 0);
    b->dropout(b, m->lora_v, m->lora_v, drop_key(m, l), m->drop_thr, m->drop_scale, m->lora_rows, T, K);
    b->add(b, din, din, m->lora_v, (size_t)T * K);
}

void cf_linear_bwd_weight(cf_model *m, const cf_linear *l, const void *dout, const void *in, int T, int K, int N) {
    cf_backend *b = m->b;
    float *dw = cf_grad(m, l->w), *db = cf_grad(m, l->b);
    if (dw || db) b->matmul_bwd(b, NULL, dw, db, dout, in, cf_weight(m, l->w), T, K, N, cf_grad_take_zero(m, l->w));
    if (l->la < 0) return;
    int r = m->lora.rank;
    /* dB += dy^T u (u read as the backward sees it: compacted in centrifuge) */
    b->matmul_bwd(b, NULL, cf_grad(m, l->lb), NULL, dout, SAVED(m, l->su), cf_weight(m, l->lb), T, r, N,
                  cf_grad_take_zero(m, l->lb));
    /* dA += g^T xd (xd = x without dropout) */
    if (m->drop_on) {
        b->dropout(b, m->lora_v, in, drop_key(m, l), m->drop_thr, m->drop_scale, m->lora_rows, T, K);
        in = m->lora_v;
    }
    b->matmul_bwd(b, NULL, cf_grad(m, l->la), NULL, m->lora_du, in, cf_weight(m, l->la), T, K, r,
                  cf_grad_take_zero(m, l->la));
}

void cf_linear_bwd(cf_model *m, const cf_linear *l, void *din, const void *dout, const void *in, int T, int K,
                   int N, int accumulate) {
    if (l->la >= 0) {
        cf_linear_bwd_input(m, l, din, dout, T, K, N, accumulate);
        cf_linear_bwd_weight(m, l, dout, in, T, K, N);
        return;
    }
    float *dw = cf_grad(m, l->w), *db = cf_grad(m, l->b);
    cf_backend *b = m->b;
    if (!dw && !db) {
        cf_linear_bwd_input(m, l, din, dout, T, K, N, accumulate);
        return;
    }
    b->matmul_bwd(b, din, dw, db, dout, in, cf_weight(m, l->w), T, K, N,
                  (accumulate ? CF_MM_ACC_DINP : 0) | cf_grad_take_zero(m, l->w));
}
