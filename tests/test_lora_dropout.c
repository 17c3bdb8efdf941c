/*
 * test_lora_dropout.c — LoRA dropout (PEFT's lora_dropout) on the CPU
 * backend:
 *   - the mask op: keep fraction within 5 sigma of 1 - P, kept elements
 *     scaled by exactly 1/(1-P), a function of (key, row, column) only (a
 *     row-index call gives the rows of the full call);
 *   - with the mask held fixed (same forward counter), the adapter
 *     gradients match finite differences in the whole model (llama and
 *     qwen3, every projection adapted), and the linear block's dA, dB and
 *     input gradient match them for every projection, also on a subset of
 *     rows given through the row index;
 *   - centrifuge with dropout equals the dense stop-gradient reference and
 *     regular at keep 1 (DESIGN §1);
 *   - forwards without the training switch (eval, cf_evaluate) give the
 *     losses of P = 0; the trainer drops in its step only;
 *   - PEFT files record lora_dropout; bad values are refused in one line.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/dropout_mask.h"
#include "base/common.h"
#include "engine/model_internal.h"
#include "model_helpers.h"
#include "test.h"

enum { B = 2, S = 9 };
static const float P = 0.3f;
static const uint64_t CTR = 12345;   /* the forward counter the fixed-mask tests reuse */

static cf_model *lora_model(const char *config, uint64_t seed, unsigned targets, float dropout) {
    cf_model_opts o = {0};
    o.config = config;
    o.backend = CF_BACKEND_CPU;
    o.seed = seed;
    o.lora = (cf_lora_opts){4, 8.0f, targets, dropout, 0};
    cf_model *m = cf_model_open(&o);
    if (!m) printf("    %s\n", cf_last_error());
    return m;
}

/* A training forward with the masks of counter CTR (the same masks every call). */
static int fwd_fixed(cf_model *m, const int32_t *tok, float *losses) {
    cf_model_set_train(m, 1);
    m->drop_next = CTR;
    int rc = cf_forward(m, tok, B, S, losses);
    cf_model_set_train(m, 0);
    return rc;
}

static double masked_loss(cf_model *m, const int32_t *tok, const uint8_t *keep) {
    float l[B * S];
    CHECK(fwd_fixed(m, tok, l) == 0);
    return masked_mean(l, B * S, keep);
}

typedef struct { cf_model *m; const int32_t *tok; const uint8_t *keep; } loss_ctx;
static double loss_of(void *p) {
    loss_ctx *c = p;
    return masked_loss(c->m, c->tok, c->keep);
}

static float *run(cf_model *m, const int32_t *tok, cf_mode mode, const uint8_t *keep, int stopgrad) {
    CHECK(fwd_fixed(m, tok, NULL) == 0);
    CHECK(m->drop_on && m->drop_ctr == CTR);
    cf_zero_grad(m);
    int rc = backward_with_mask(m, mode, keep, stopgrad);
    CHECK_MSG(rc == 0, "backward: %s", cf_last_error());
    return all_grads(m);
}

/* ------------------------------------------------------------- the mask */

TEST(mask_keeps_one_minus_p_scales_by_its_inverse_and_depends_on_key_row_column_only) {
    cf_backend *b = cf_backend_cpu_create();
    const int R = 1000, C = 1000;
    const size_t n = (size_t)R * C;
    float *x = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float)), *y2 = malloc(n * sizeof(float));
    cf_rng r;
    cf_rng_seed(&r, 3);
    for (size_t i = 0; i < n; i++) x[i] = cf_rng_normal(&r) + 3.0f;   /* never 0 */
    const float ps[3] = {0.1f, 0.3f, 0.9f};
    for (int k = 0; k < 3; k++) {
        uint32_t thr = cf_dropout_threshold(ps[k]);
        float scale = 1.0f / (1.0f - ps[k]);
        uint64_t key = cf_dropout_key(7, 100 + k, 5);
        b->dropout(b, y, x, key, thr, scale, NULL, R, C);
        size_t kept = 0, bad = 0;
        for (size_t i = 0; i < n; i++) {
            if (y[i] != 0) { kept++; bad += y[i] != x[i] * scale; }
        }
        double q = 1.0 - ps[k], frac = (double)kept / n, sigma = sqrt(q * (1 - q) / n);
        CHECK_MSG(fabs(frac - q) < 5 * sigma, "P %g: kept %.5f, want %.5f +- 5 x %.2g", ps[k], frac, q, sigma);
        CHECK_MSG(bad == 0, "P %g: %zu kept elements are not x / (1 - P)", ps[k], bad);
        /* the same key gives the same mask; in place too */
        memcpy(y2, x, n * sizeof(float));
        b->dropout(b, y2, y2, key, thr, scale, NULL, R, C);
        CHECK(memcmp(y, y2, n * sizeof(float)) == 0);
        /* another key: an independent mask, both kept with probability q^2 */
        b->dropout(b, y2, x, cf_dropout_key(7, 101 + k, 5), thr, scale, NULL, R, C);
        size_t both = 0;
        for (size_t i = 0; i < n; i++) both += y[i] != 0 && y2[i] != 0;
        double q2 = q * q, s2 = sqrt(q2 * (1 - q2) / n);
        CHECK_MSG(fabs((double)both / n - q2) < 5 * s2, "P %g: two keys keep %.5f together, want %.5f", ps[k],
                  (double)both / n, q2);
        /* rows through the index: row i of the output is row rows[i] of the full call */
        int rows[4] = {999, 0, 500, 3};
        float xr[4 * 1000], yr[4 * 1000];
        for (int i = 0; i < 4; i++) memcpy(xr + (size_t)i * C, x + (size_t)rows[i] * C, C * sizeof(float));
        b->dropout(b, yr, xr, key, thr, scale, rows, 4, C);
        for (int i = 0; i < 4; i++)
            CHECK_MSG(memcmp(yr + (size_t)i * C, y + (size_t)rows[i] * C, C * sizeof(float)) == 0,
                      "row index: row %d differs", rows[i]);
    }
    /* the keys of neighbouring counters and tensors all differ */
    CHECK(cf_dropout_key(1, 2, 3) != cf_dropout_key(1, 3, 2) && cf_dropout_key(1, 2, 3) != cf_dropout_key(2, 2, 3));
    CHECK(cf_dropout_threshold(0) == 0 && cf_dropout_threshold(0.5) == 0x80000000u);
    free(x); free(y); free(y2);
    CHECK(b->check(b) == 0);
    b->destroy(b);
}

/* ------------------------------------------------- finite differences */

TEST(adapter_gradients_with_dropout_match_finite_differences_with_the_mask_fixed) {
    const char *types[] = {"tiny-llama", "tiny-qwen3"};
    for (int ti = 0; ti < 2; ti++) {
        cf_model *m = lora_model(types[ti], 3 + ti, 0x7f, P);
        if (!m) { CHECK(0); continue; }
        randomize_weights(m, 11 + ti, 0.3f, 0.2f);
        int32_t tok[B * (S + 1)];
        random_tokens(tok, B * (S + 1), cf_model_config(m)->vocab_size, 20 + ti);
        uint8_t keep[B * S];
        for (int t = 0; t < B * S; t++) keep[t] = (t % 3) != 0;
        /* the mask matters: another counter gives other losses */
        float l0[B * S], l1[B * S];
        CHECK(fwd_fixed(m, tok, l0) == 0);
        cf_model_set_train(m, 1);
        m->drop_next = CTR + 1;
        CHECK(cf_forward(m, tok, B, S, l1) == 0);
        cf_model_set_train(m, 0);
        CHECK_MSG(memcmp(l0, l1, sizeof l0) != 0, "%s: the dropout mask changes nothing", types[ti]);
        for (int lo = 0; lo < 2; lo++) {
            float *g = run(m, tok, lo ? CF_MODE_LOSS_ONLY : CF_MODE_REGULAR, lo ? keep : NULL, 0);
            int adapters = 0;
            for (int i = 0; i < cf_model_num_tensors(m); i++) {
                const char *name = cf_model_tensor_name(m, i);
                if (!strstr(name, "lora_")) continue;
                adapters++;
                /* along the gradient: the derivative is |g| */
                loss_ctx lc = {m, tok, lo ? keep : NULL};
                double fd, gn;
                fd_along_gradient(m, i, g, 1e-3, loss_of, &lc, &fd, &gn);
                CHECK_MSG(gn > 0, "%s: all-zero adapter gradient", name);
                CHECK_MSG(fabs(fd - gn) <= 2e-3 + 2e-2 * gn, "%s %s %s: fd %.6g analytic %.6g", types[ti],
                          lo ? "loss-only" : "regular", name, fd, gn);
            }
            int L = cf_model_config(m)->num_hidden_layers;
            CHECK_MSG(adapters == L * 14, "%s: %d adapter tensors, want %d", types[ti], adapters, L * 14);
            free(g);
        }
        cf_model_free(m);
    }
}

/* loss = sum(y * R) of the linear block y = lin(x): dy = R. */
static double block_loss(cf_model *m, const cf_linear *l, const float *x, const float *R, int T, int K, int N) {
    float *y = malloc((size_t)T * N * sizeof(float));
    cf_linear_fwd(m, l, y, x, T, K, N);
    double s = 0;
    for (size_t i = 0; i < (size_t)T * N; i++) s += (double)y[i] * R[i];
    free(y);
    return s;
}

/* Directional finite difference of block_loss along d in *v (x, or a weight
 * tensor p when p >= 0), against <grad, d>. */
static void check_dir(cf_model *m, const cf_linear *l, float *x, const float *R, int T, int K, int N, int p,
                      const float *grad, const char *what, const char *type, const char *proj) {
    size_t n = p >= 0 ? m->params[p].numel : (size_t)T * K;
    float *v0 = malloc(n * sizeof(float)), *v = malloc(n * sizeof(float)), *d = malloc(n * sizeof(float));
    if (p >= 0) cf_model_get_param(m, p, v0); else memcpy(v0, x, n * sizeof(float));
    cf_rng r;
    cf_rng_seed(&r, n);
    double an = 0;
    for (size_t i = 0; i < n; i++) { d[i] = cf_rng_normal(&r); an += (double)d[i] * grad[i]; }
    const float eps = 0.1f;   /* the loss is linear in each of x, A, B: no truncation error */
    double lp, lm;
    for (size_t i = 0; i < n; i++) v[i] = v0[i] + eps * d[i];
    if (p >= 0) cf_model_set_param(m, p, v); else memcpy(x, v, n * sizeof(float));
    lp = block_loss(m, l, x, R, T, K, N);
    for (size_t i = 0; i < n; i++) v[i] = v0[i] - eps * d[i];
    if (p >= 0) cf_model_set_param(m, p, v); else memcpy(x, v, n * sizeof(float));
    lm = block_loss(m, l, x, R, T, K, N);
    if (p >= 0) cf_model_set_param(m, p, v0); else memcpy(x, v0, n * sizeof(float));
    double fd = (lp - lm) / (2 * eps);
    CHECK_MSG(fabs(fd - an) <= 1e-3 * (1 + fabs(an)), "%s %s %s: fd %.7g analytic %.7g", type, proj, what, fd, an);
    free(v0); free(v); free(d);
}

TEST(linear_block_dA_dB_and_input_gradient_with_dropout_match_finite_differences_for_every_projection) {
    const char *types[] = {"tiny-llama", "tiny-qwen3"};
    static const char *projs[7] = {"q", "k", "v", "o", "gate", "up", "down"};
    for (int ti = 0; ti < 2; ti++) {
        cf_model *m = lora_model(types[ti], 30 + ti, 0x7f, P);
        if (!m) { CHECK(0); continue; }
        randomize_weights(m, 31 + ti, 0.3f, 0.2f);
        int32_t tok[B * (S + 1)];
        random_tokens(tok, B * (S + 1), cf_model_config(m)->vocab_size, 32);
        CHECK(fwd_fixed(m, tok, NULL) == 0);   /* sizes the activations; drop_on with counter CTR */
        const int T = B * S;
        cf_layer_params *lp = &m->lp[1];
        cf_linear *lins[7] = {&lp->q, &lp->k, &lp->v, &lp->o, &lp->gate, &lp->up, &lp->down};
        for (int k = 0; k < 7; k++) {
            const cf_linear *l = lins[k];
            int N = (int)m->params[l->w].shape[0], K = (int)m->params[l->w].shape[1];
            cf_rng r;
            cf_rng_seed(&r, 40 + k);
            float *x = malloc((size_t)T * K * sizeof(float)), *R = malloc((size_t)T * N * sizeof(float));
            float *dx = malloc((size_t)T * K * sizeof(float));
            for (int i = 0; i < T * K; i++) x[i] = cf_rng_normal(&r);
            for (int i = 0; i < T * N; i++) R[i] = cf_rng_normal(&r);
            m->drop_on = 1;
            m->drop_ctr = CTR;
            m->lora_rows = NULL;
            block_loss(m, l, x, R, T, K, N);   /* saves u */
            cf_zero_grad(m);
            cf_linear_bwd(m, l, dx, R, x, T, K, N, 0);
            size_t na = m->params[l->la].numel, nb = m->params[l->lb].numel;
            float *dA = malloc(na * sizeof(float)), *dB = malloc(nb * sizeof(float));
            cf_model_get_grad(m, l->la, dA);
            cf_model_get_grad(m, l->lb, dB);
            check_dir(m, l, x, R, T, K, N, -1, dx, "dx", types[ti], projs[k]);
            check_dir(m, l, x, R, T, K, N, l->la, dA, "dA", types[ti], projs[k]);
            check_dir(m, l, x, R, T, K, N, l->lb, dB, "dB", types[ti], projs[k]);
            /* the input gradient drops what the forward dropped: the adapter's
             * part of dx is 0 wherever the mask is 0 */
            float *dxw = malloc((size_t)T * K * sizeof(float));
            m->b->matmul_bwd(m->b, dxw, NULL, NULL, R, NULL, cf_weight(m, l->w), T, K, N, 0);
            uint64_t key = cf_dropout_key(m->drop_seed, CTR, (uint64_t)l->la);
            int dropped = 0, wrong = 0;
            for (int t = 0; t < T; t++)
                for (int c = 0; c < K; c++)
                    if (!cf_dropout_keep(key, m->drop_thr, (uint32_t)t, (uint32_t)c)) {
                        dropped++;
                        wrong += dx[(size_t)t * K + c] != dxw[(size_t)t * K + c];
                    }
            CHECK_MSG(dropped > 0 && wrong == 0, "%s %s: %d of %d dropped elements get an adapter gradient",
                      types[ti], projs[k], wrong, dropped);
            /* a compact backward of rows {odd} through the row index: the
             * rows' dx, and dA of their loss alone */
            int n = 0, *rows = malloc((size_t)T * sizeof(int));
            for (int t = 1; t < T; t += 2) rows[n++] = t;
            float *xc = malloc((size_t)n * K * sizeof(float)), *Rc = malloc((size_t)n * N * sizeof(float));
            float *Rm = calloc((size_t)T * N, sizeof(float)), *dxc = malloc((size_t)n * K * sizeof(float));
            for (int i = 0; i < n; i++) {
                memcpy(xc + (size_t)i * K, x + (size_t)rows[i] * K, K * sizeof(float));
                memcpy(Rc + (size_t)i * N, R + (size_t)rows[i] * N, N * sizeof(float));
                memcpy(Rm + (size_t)rows[i] * N, R + (size_t)rows[i] * N, N * sizeof(float));
            }
            /* dense reference: all rows, dy zero outside the subset */
            block_loss(m, l, x, Rm, T, K, N);
            cf_zero_grad(m);
            cf_linear_bwd(m, l, dx, Rm, x, T, K, N, 0);
            cf_model_get_grad(m, l->la, dA);
            /* compact: u of the subset rows (as the filter gathers it), the rows' original indices */
            const int rk = m->lora.rank;
            float *u = m->saved[l->su].full, *uc = malloc((size_t)n * rk * sizeof(float));
            for (int i = 0; i < n; i++) memcpy(uc + (size_t)i * rk, u + (size_t)rows[i] * rk, rk * sizeof(float));
            void *ufull = m->saved[l->su].cur;
            m->saved[l->su].cur = uc;
            m->lora_rows = rows;
            cf_zero_grad(m);
            cf_linear_bwd(m, l, dxc, Rc, xc, n, K, N, 0);
            m->lora_rows = NULL;
            m->saved[l->su].cur = ufull;
            float *dAc = malloc(na * sizeof(float)), *dxr = malloc((size_t)n * K * sizeof(float));
            cf_model_get_grad(m, l->la, dAc);
            for (int i = 0; i < n; i++) memcpy(dxr + (size_t)i * K, dx + (size_t)rows[i] * K, K * sizeof(float));
            CHECK_MSG(rel_l2(dAc, dA, na) < 1e-5, "%s %s compact rows: dA rel %.3g", types[ti], projs[k],
                      rel_l2(dAc, dA, na));
            CHECK_MSG(rel_l2(dxc, dxr, (size_t)n * K) < 1e-5, "%s %s compact rows: dx rel %.3g", types[ti],
                      projs[k], rel_l2(dxc, dxr, (size_t)n * K));
            free(xc); free(Rc); free(Rm); free(dxc); free(uc); free(dAc); free(dxr); free(rows);
            free(x); free(R); free(dx); free(dxw); free(dA); free(dB);
        }
        m->drop_on = 0;
        CHECK(m->b->check(m->b) == 0);
        cf_model_free(m);
    }
}

/* --------------------------------------------------- token filtering */

TEST(centrifuge_with_dropout_equals_the_stopgrad_reference_and_regular_at_keep_1) {
    const char *types[] = {"tiny-qwen2", "tiny-llama"};
    for (int ti = 0; ti < 2; ti++) {
        cf_model *m = lora_model(types[ti], 7, 0x7f, P);
        if (!m) { CHECK(0); continue; }
        randomize_weights(m, 8, 0.3f, 0.2f);
        int32_t tok[B * (S + 1)];
        random_tokens(tok, B * (S + 1), cf_model_config(m)->vocab_size, 9);
        uint8_t all[B * S], half[B * S], uneven[B * S];
        memset(all, 1, sizeof all);
        for (int t = 0; t < B * S; t++) { half[t] = t % 2; uneven[t] = t < S ? 0 : (t % 3 == 0); }
        float *reg = run(m, tok, CF_MODE_REGULAR, NULL, 0);
        float *cf1 = run(m, tok, CF_MODE_CENTRIFUGE, all, 0);
        CHECK_MSG(max_rel(m, cf1, reg, NULL) < 1e-5, "%s keep 1: centrifuge vs regular %.3g", types[ti],
                  max_rel(m, cf1, reg, NULL));
        /* the test is not vacuous: without the switch (no dropout) the gradient differs */
        cf_forward(m, tok, B, S, NULL);
        CHECK(!m->drop_on);
        cf_zero_grad(m);
        CHECK(cf_backward(m, CF_MODE_REGULAR, NULL, 1.0f, NULL) == 0);
        float *nodrop = all_grads(m);
        CHECK_MSG(max_rel(m, nodrop, reg, NULL) > 1e-2, "%s: dropout does not change the gradient", types[ti]);
        free(nodrop);
        const uint8_t *masks[2] = {half, uneven};
        for (int k = 0; k < 2; k++) {
            float *cf = run(m, tok, CF_MODE_CENTRIFUGE, masks[k], 0);
            float *sg = run(m, tok, CF_MODE_LOSS_ONLY, masks[k], 1);
            float *lo = run(m, tok, CF_MODE_LOSS_ONLY, masks[k], 0);
            const char *where = "?";
            CHECK_MSG(every_tensor_nonzero(m, sg, &where), "%s mask %d: stop-grad reference of %s is all zero",
                      types[ti], k, where);
            double e = max_rel(m, cf, sg, &where);
            CHECK_MSG(e < 1e-5, "%s mask %d: centrifuge vs stop-grad reference %.3g at %s", types[ti], k, e, where);
            CHECK_MSG(max_rel(m, lo, cf, NULL) > 1e-4, "%s mask %d: loss-only equals centrifuge", types[ti], k);
            free(cf); free(sg); free(lo);
        }
        free(reg); free(cf1);
        cf_model_free(m);
    }
}

/* ------------------------------------------------ evaluation and trainer */

TEST(forwards_without_the_training_switch_give_the_losses_of_p_0) {
    cf_model *m = lora_model("tiny-qwen3", 5, 0x7f, P);
    cf_model *z = lora_model("tiny-qwen3", 5, 0x7f, 0.0f);
    if (!m || !z) { CHECK(0); cf_model_free(m); cf_model_free(z); return; }
    randomize_weights(m, 6, 0.3f, 0.2f);
    randomize_weights(z, 6, 0.3f, 0.2f);
    int32_t tok[B * (S + 1)];
    random_tokens(tok, B * (S + 1), cf_model_config(m)->vocab_size, 2);
    float lm[B * S], lz[B * S], ld[B * S];
    CHECK(cf_forward(m, tok, B, S, lm) == 0 && !m->drop_on);
    CHECK(cf_forward(z, tok, B, S, lz) == 0);
    CHECK_MSG(memcmp(lm, lz, sizeof lm) == 0, "eval forward with P = %g differs from P = 0", P);
    /* cf_evaluate (the eval command's loop) */
    int32_t buf[3 * B * S + 1];
    random_tokens(buf, 3 * B * S + 1, cf_model_config(m)->vocab_size, 3);
    cf_tokens tk = {0};
    tk.n = 3 * B * S + 1;
    tk.width = 4;
    tk.data = buf;
    double em = 0, ez = 0;
    CHECK_MSG(cf_evaluate(m, &tk, B, S, 0, &em, NULL, NULL) == 0, "%s", cf_last_error());
    CHECK(cf_evaluate(z, &tk, B, S, 0, &ez, NULL, NULL) == 0);
    CHECK_MSG(em == ez, "cf_evaluate: %.9g with P = %g, %.9g with P = 0", em, P, ez);
    /* the switch on: the losses change */
    cf_model_set_train(m, 1);
    CHECK(cf_forward(m, tok, B, S, ld) == 0 && m->drop_on);
    cf_model_set_train(m, 0);
    CHECK_MSG(memcmp(ld, lz, sizeof ld) != 0, "the training forward does not drop");
    /* the trainer drops in its step (its loss differs from P = 0 at equal
     * weights) and leaves the switch off */
    cf_train_opts to = {0};
    to.mode = CF_MODE_REGULAR;
    to.batch = B;
    to.seq = S;
    to.grad_accum = 2;
    to.select.seed = 1;
    to.adamw = (cf_adamw_params){1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, 1.0f};
    cf_trainer *tm = cf_trainer_create(m, &to), *tz = cf_trainer_create(z, &to);
    CHECK(tm && tz);
    cf_micro_batch mb[2] = {{tok, NULL}, {buf, NULL}};
    cf_step_stats sm, sz;
    CHECK(cf_trainer_step(tm, mb, 1e-3f, &sm) == 0 && cf_trainer_step(tz, mb, 1e-3f, &sz) == 0);
    CHECK_MSG(sm.loss != sz.loss, "trainer step: the same loss with and without dropout (%.9g)", sm.loss);
    CHECK(!m->train);
    float a1[B * S], a2[B * S];
    CHECK(cf_forward(m, tok, B, S, a1) == 0 && cf_forward(m, tok, B, S, a2) == 0);
    CHECK_MSG(memcmp(a1, a2, sizeof a1) == 0 && !m->drop_on, "a forward after the trainer step drops");
    /* the step is a function of (seed, step, micro-batch): the same from the same state */
    cf_model *m2 = lora_model("tiny-qwen3", 5, 0x7f, P);
    randomize_weights(m2, 6, 0.3f, 0.2f);
    cf_trainer *t2 = cf_trainer_create(m2, &to);
    cf_step_stats s2;
    CHECK(t2 && cf_trainer_step(t2, mb, 1e-3f, &s2) == 0);
    CHECK_MSG(s2.loss == sm.loss, "trainer step not reproducible: %.9g vs %.9g", s2.loss, sm.loss);
    cf_trainer_free(tm); cf_trainer_free(tz); cf_trainer_free(t2);
    cf_model_free(m); cf_model_free(z); cf_model_free(m2);
}

/* ------------------------------------------------------- files, errors */

TEST(peft_config_records_lora_dropout_and_an_adapter_loaded_for_eval_does_not_drop) {
    cf_model *m = lora_model("tiny-llama", 13, CF_LORA_Q | CF_LORA_V | CF_LORA_DOWN, 0.1f);
    if (!m) { CHECK(0); return; }
    randomize_weights(m, 14, 0.3f, 0.2f);
    char dir[] = "/tmp/cf_test_lora_dropout_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char base_dir[256], ad_dir[256], cfgp[300];
    snprintf(base_dir, sizeof base_dir, "%s/base", dir);
    snprintf(ad_dir, sizeof ad_dir, "%s/adapter", dir);
    snprintf(cfgp, sizeof cfgp, "%s/adapter_config.json", ad_dir);
    CHECK_MSG(cf_model_save(m, base_dir, "float32", 0) == 0, "%s", cf_last_error());
    CHECK_MSG(cf_lora_save(m, ad_dir, "base") == 0, "%s", cf_last_error());
    char *text = cf_read_file(cfgp, NULL, 1 << 20);
    CHECK(text && strstr(text, "\"lora_dropout\": 0.1"));
    free(text);
    cf_lora_opts rd;
    CHECK(cf_lora_read_config(ad_dir, &rd) == 0 && rd.dropout == 0.1f);
    cf_model_opts ob = {0};
    ob.model_dir = base_dir;
    ob.backend = CF_BACKEND_CPU;
    ob.adapter_dir = ad_dir;
    cf_model *back = cf_model_open(&ob);
    CHECK_MSG(back != NULL, "%s", cf_last_error());
    if (back) {
        int32_t tok[B * (S + 1)];
        random_tokens(tok, B * (S + 1), cf_model_config(m)->vocab_size, 15);
        float l0[B * S], l1[B * S];
        CHECK(cf_forward(m, tok, B, S, l0) == 0 && cf_forward(back, tok, B, S, l1) == 0);
        CHECK(cf_model_lora(back)->dropout == 0.1f && !back->drop_on);
        CHECK_MSG(memcmp(l0, l1, sizeof l0) == 0, "the loaded adapter's eval losses differ");
        cf_model_free(back);
    }
    FILE *f = fopen(cfgp, "w");
    fputs("{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"lora_dropout\": 1.5, \"target_modules\": [\"q_proj\"]}", f);
    fclose(f);
    CHECK(cf_lora_read_config(ad_dir, &rd) != 0 && strstr(cf_last_error(), "lora_dropout"));
    cf_model_free(m);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
}

TEST(bad_dropout_values_are_refused_with_one_clear_line) {
    const float bad[4] = {-0.1f, 1.0f, 1.5f, NAN};
    for (int k = 0; k < 4; k++) {
        cf_model_opts o = {0};
        o.config = "tiny-llama";
        o.backend = CF_BACKEND_CPU;
        o.lora = (cf_lora_opts){4, 8.0f, CF_LORA_Q, bad[k], 0};
        cf_model *m = cf_model_open(&o);
        const char *e = cf_last_error();
        CHECK_MSG(!m && strstr(e, "--lora-dropout") && strstr(e, "[0, 1)") && !strchr(e, '\n'),
                  "dropout %g: %s", bad[k], m ? "accepted" : e);
        cf_model_free(m);
    }
    cf_model *ok = lora_model("tiny-llama", 1, CF_LORA_Q, 0.999f);
    CHECK_MSG(ok != NULL, "0.999 refused");
    cf_model_free(ok);
}

int main(void) {
    RUN(mask_keeps_one_minus_p_scales_by_its_inverse_and_depends_on_key_row_column_only);
    RUN(adapter_gradients_with_dropout_match_finite_differences_with_the_mask_fixed);
    RUN(linear_block_dA_dB_and_input_gradient_with_dropout_match_finite_differences_for_every_projection);
    RUN(centrifuge_with_dropout_equals_the_stopgrad_reference_and_regular_at_keep_1);
    RUN(forwards_without_the_training_switch_give_the_losses_of_p_0);
    RUN(peft_config_records_lora_dropout_and_an_adapter_loaded_for_eval_does_not_drop);
    RUN(bad_dropout_values_are_refused_with_one_clear_line);
    return test_summary();
}
