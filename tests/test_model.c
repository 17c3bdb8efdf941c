/*
 * test_model.c — model-level tests on the CPU backend:
 *   - finite-difference gradient checks of the whole 2-layer model, every
 *     model_type, in regular and loss-only mode;
 *   - the five equivalences of DESIGN §1 with per-sequence and per-batch
 *     selection and keep in {1.0, 0.5, 0.1, one token};
 *   - save/load round trip and a short training run whose loss falls;
 *   - the kept-rows object, gradient clipping, frozen parameters and the
 *     trainer's gradient accumulation.
 * Gradients are compared per tensor (relative L2 error of each tensor).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/common.h"
#include "engine/model_internal.h"
#include "model_helpers.h"
#include "test.h"

static const char *TYPES[] = {"tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"};
#define NTYPES 4
enum { B = 2, S = 9 };

/* Backward of the last forward with kept rows given as a host mask. */
static int backward_mask(cf_model *m, cf_mode mode, const uint8_t *keep, float *loss) {
    if (mode == CF_MODE_REGULAR) return cf_backward(m, mode, NULL, 1.0f, loss);
    cf_kept kept;
    if (cf_kept_from_mask(m, keep, &kept) != 0) return -1;
    return cf_backward(m, mode, &kept, 1.0f, loss);
}

/* Mean loss over positions selected by keep (NULL = all) at the current weights. */
static double masked_loss(cf_model *m, const int32_t *tok, const uint8_t *keep) {
    float losses[B * S];
    cf_forward(m, tok, B, S, losses);
    return masked_mean(losses, B * S, keep);
}

typedef struct { cf_model *m; const int32_t *tok; const uint8_t *keep; } loss_ctx;
static double loss_of(void *p) {
    loss_ctx *c = p;
    return masked_loss(c->m, c->tok, c->keep);
}

/* Directional finite-difference check, per tensor: d = g/|g| + noise, so the
 * check fails if g points the wrong way or has the wrong length. */
static void fd_check(cf_model *m, const int32_t *tok, const uint8_t *keep, const float *g, const char *label) {
    cf_rng r;
    cf_rng_seed(&r, 99);
    loss_ctx lc = {m, tok, keep};
    for (int i = 0; i < cf_model_num_tensors(m); i++) {
        size_t n = cf_model_tensor_numel(m, i);
        const float *gi = g + toff(m, i);
        double gn = grad_norm(gi, n);
        /* every tensor carries gradient here: an all-zero one is a bug */
        CHECK_MSG(gn > 0, "%s %s: all-zero gradient", label, cf_model_tensor_name(m, i));
        float *d = malloc(n * sizeof(float));
        double dn = 0;
        for (size_t j = 0; j < n; j++) {
            d[j] = (float)((gn > 0 ? gi[j] / gn : 0.0) + cf_rng_normal(&r) / sqrt((double)n));
            dn += (double)d[j] * d[j];
        }
        dn = sqrt(dn);
        double analytic = 0;
        for (size_t j = 0; j < n; j++) { d[j] /= (float)dn; analytic += (double)gi[j] * d[j]; }
        double fd = fd_directional(m, i, d, 2e-3, loss_of, &lc);
        double err = fabs(fd - analytic);
        /* fp32 forward: loss rounding ~1e-6 / eps ~ 1e-3 absolute, plus O(eps^2) */
        CHECK_MSG(err <= 2e-3 + 3e-2 * fabs(fd), "%s %s: fd %.6g analytic %.6g", label, cf_model_tensor_name(m, i), fd, analytic);
        free(d);
    }
}

TEST(model_gradients_match_finite_differences_for_every_model_type) {
    for (int ti = 0; ti < NTYPES; ti++) {
        cf_model *m = make_model(TYPES[ti], 7 + ti);
        CHECK(m != NULL);
        if (!m) continue;
        int32_t tok[B * (S + 1)];
        random_tokens(tok, B * (S + 1), cf_model_config(m)->vocab_size, 100 + ti);
        CHECK(cf_forward(m, tok, B, S, NULL) == 0);
        cf_zero_grad(m);
        CHECK(cf_backward(m, CF_MODE_REGULAR, NULL, 1.0f, NULL) == 0);
        float *g = all_grads(m);
        fd_check(m, tok, NULL, g, TYPES[ti]);
        free(g);
        cf_model_free(m);
    }
}

TEST(loss_only_gradients_are_the_dense_gradient_of_the_masked_loss) {
    for (int ti = 0; ti < NTYPES; ti++) {
        cf_model *m = make_model(TYPES[ti], 17 + ti);
        if (!m) { CHECK(0); continue; }
        int32_t tok[B * (S + 1)];
        random_tokens(tok, B * (S + 1), cf_model_config(m)->vocab_size, 200 + ti);
        float losses[B * S];
        uint8_t keep[B * S];
        cf_forward(m, tok, B, S, losses);
        cf_select(losses, NULL, B, S, 0.5f, CF_SELECT_SELF, 0, 1, keep);
        cf_zero_grad(m);
        CHECK(backward_mask(m, CF_MODE_LOSS_ONLY, keep, NULL) == 0);
        float *g = all_grads(m);
        fd_check(m, tok, keep, g, TYPES[ti]);
        free(g);
        cf_model_free(m);
    }
}

/* Runs one backward of `mode` on fresh gradients; returns host grads. */
static float *grads_of(cf_model *m, const int32_t *tok, cf_mode mode, const uint8_t *keep, float *loss) {
    cf_forward(m, tok, B, S, NULL);
    cf_zero_grad(m);
    int rc;
    if (mode == (cf_mode)-1) {
        cf_kept kept;
        rc = cf_kept_from_mask(m, keep, &kept);
        if (rc == 0) rc = cf_backward_reference_stopgrad(m, &kept, 1.0f, loss);
    } else {
        rc = backward_mask(m, mode, keep, loss);
    }
    CHECK_MSG(rc == 0, "backward failed: %s", cf_last_error());
    return all_grads(m);
}

/* The keep masks under test: per sequence and per batch at 1.0, 0.5, 0.1,
 * and a single kept token per sequence; plus a hand-made uneven mask. */
static int make_masks(const float *losses, uint8_t masks[][B * S], char names[][48]) {
    int n = 0;
    const float keeps[] = {1.0f, 0.5f, 0.1f};
    for (int pb = 0; pb < 2; pb++)
        for (int k = 0; k < 3; k++) {
            cf_select(losses, NULL, B, S, keeps[k], CF_SELECT_SELF, pb, 3, masks[n]);
            snprintf(names[n++], 48, "keep %.1f %s", keeps[k], pb ? "per-batch" : "per-seq");
        }
    cf_select(losses, NULL, B, S, 1.0f / S, CF_SELECT_SELF, 0, 3, masks[n]);
    snprintf(names[n++], 48, "one token per sequence");
    memset(masks[n], 0, B * S);
    for (int s = 0; s < S; s++) masks[n][s] = s % 3 != 1;     /* 6 of 9 kept */
    masks[n][S + 4] = 1;                                       /* 1 of 9 kept */
    snprintf(names[n++], 48, "uneven 6 and 1");
    memset(masks[n], 0, B * S);
    for (int s = 0; s < S; s++) masks[n][S + s] = s % 2 == 0;  /* sequence 0 keeps nothing */
    snprintf(names[n++], 48, "sequence 0 keeps 0");
    return n;
}

TEST(equivalences_of_design_section_1_hold_for_every_model_type) {
    for (int ti = 0; ti < NTYPES; ti++) {
        cf_model *m = make_model(TYPES[ti], 31 + ti);
        if (!m) { CHECK(0); continue; }
        int32_t tok[B * (S + 1)];
        random_tokens(tok, B * (S + 1), cf_model_config(m)->vocab_size, 300 + ti);
        float losses[B * S];
        cf_forward(m, tok, B, S, losses);
        uint8_t masks[10][B * S];
        char names[10][48];
        int nm = make_masks(losses, masks, names);
        float *reg = grads_of(m, tok, CF_MODE_REGULAR, NULL, NULL);
        int zero_rows_checked = 0;   /* equivalence 4 must not pass by checking no row */
        const char *zero = "";
        CHECK_MSG(every_tensor_nonzero(m, reg, &zero), "%s: regular gradient of %s is all zero", TYPES[ti], zero);
        for (int k = 0; k < nm; k++) {
            const uint8_t *keep = masks[k];
            int nkept = 0;
            for (int t = 0; t < B * S; t++) nkept += keep[t];
            float l_lo, l_cf, l_sw;
            float *lo = grads_of(m, tok, CF_MODE_LOSS_ONLY, keep, &l_lo);
            float *cf = grads_of(m, tok, CF_MODE_CENTRIFUGE, keep, &l_cf);
            float *sg = grads_of(m, tok, (cf_mode)-1, keep, NULL);
            float *sw = grads_of(m, tok, CF_MODE_STRAWMAN, keep, &l_sw);
            /* the references carry gradient in every tensor, so no tensor can
             * pass as zero against zero */
            CHECK_MSG(every_tensor_nonzero(m, sg, &zero), "%s %s: stop-grad reference of %s is all zero", TYPES[ti],
                      names[k], zero);
            CHECK_MSG(every_tensor_nonzero(m, lo, &zero), "%s %s: loss-only gradient of %s is all zero", TYPES[ti],
                      names[k], zero);
            /* the differentiated loss is the same kept mean in all three */
            CHECK_CLOSE(l_cf, l_lo, 1e-6);
            CHECK_CLOSE(l_sw, l_lo, 1e-6);
            if (nkept == B * S) {
                /* 1. keep = 1: loss-only = centrifuge = regular */
                CHECK_MSG(max_rel(m, lo, reg, NULL) < 1e-5, "%s %s: loss-only vs regular %.3g", TYPES[ti], names[k], max_rel(m, lo, reg, NULL));
                CHECK_MSG(max_rel(m, cf, reg, NULL) < 1e-5, "%s %s: centrifuge vs regular %.3g", TYPES[ti], names[k], max_rel(m, cf, reg, NULL));
            }
            /* 2. centrifuge = dense backward with stop-gradient on filtered K/V */
            CHECK_MSG(max_rel(m, cf, sg, NULL) < 1e-5, "%s %s: centrifuge vs stop-grad reference %.3g", TYPES[ti], names[k], max_rel(m, cf, sg, NULL));
            /* 4. embedding rows of tokens seen only at filtered positions get
             * exactly zero gradient (untied: the tied LM head touches all rows) */
            if (!cf_model_config(m)->tie_word_embeddings) {
                int C = cf_model_config(m)->hidden_size, V = cf_model_config(m)->vocab_size;
                for (int v = 0; v < V; v++) {
                    int at_kept = 0, at_filtered = 0;
                    for (int b = 0; b < B; b++)
                        for (int s = 0; s < S; s++)
                            if (tok[b * (S + 1) + s] == v) { if (keep[b * S + s]) at_kept = 1; else at_filtered = 1; }
                    if (at_filtered && !at_kept) {
                        zero_rows_checked++;
                        int allzero = 1;
                        for (int c = 0; c < C; c++) allzero &= cf[toff(m, 0) + (size_t)v * C + c] == 0.0f;
                        CHECK_MSG(allzero, "%s %s: embedding row %d (filtered only) has gradient", TYPES[ti], names[k], v);
                    }
                }
            }
            /* 5. strawman differs from centrifuge when something is filtered */
            if (nkept < B * S && nkept > B)
                CHECK_MSG(max_rel(m, sw, cf, NULL) > 1e-3, "%s %s: strawman equals centrifuge (%.3g)", TYPES[ti], names[k], max_rel(m, sw, cf, NULL));
            /* and loss-only (dense) differs from centrifuge when filtering */
            if (nkept < B * S)
                CHECK_MSG(max_rel(m, lo, cf, NULL) > 1e-4, "%s %s: loss-only equals centrifuge", TYPES[ti], names[k]);
            free(lo); free(cf); free(sg); free(sw);
        }
        if (!cf_model_config(m)->tie_word_embeddings)
            CHECK_MSG(zero_rows_checked > 0, "%s: no embedding row of a filtered-only token was checked", TYPES[ti]);
        free(reg);
        cf_model_free(m);
    }
}

TEST(selection_keeps_top_excess_loss_with_deterministic_ties) {
    float losses[B * S], ref[B * S];
    for (int t = 0; t < B * S; t++) { losses[t] = (float)(t % 4); ref[t] = 0.0f; }
    uint8_t keep[B * S];
    int k = cf_select(losses, ref, B, S, 0.5f, CF_SELECT_REF, 0, 1, keep);
    CHECK(k == 2 * 5);   /* round(0.5 * 9) = 5 per sequence (round half away) */
    /* sequence 0 losses 0 1 2 3 0 1 2 3 0: keeps the 3s (pos 3, 7), the 2s (2, 6) and the lower-positioned 1 (1) */
    uint8_t want0[S] = {0, 1, 1, 1, 0, 0, 1, 1, 0};
    CHECK(memcmp(keep, want0, S) == 0);
    /* excess loss, not raw loss, decides */
    for (int t = 0; t < B * S; t++) { losses[t] = 5.0f; ref[t] = (float)t; }
    k = cf_select(losses, ref, B, S, 1.0f / S, CF_SELECT_REF, 0, 1, keep);
    CHECK(k == 2 && keep[0] == 1 && keep[S] == 1);
    /* per-batch: one pool, counts may differ between sequences */
    for (int t = 0; t < B * S; t++) { losses[t] = t < S ? 1.0f : 0.0f; ref[t] = 0; }
    k = cf_select(losses, ref, B, S, 0.5f, CF_SELECT_SELF, 1, 1, keep);
    int k0 = 0;
    for (int s = 0; s < S; s++) k0 += keep[s];
    CHECK(k == 9 && k0 == 9);
    /* random selection is deterministic in the seed */
    uint8_t k1[B * S], k2[B * S];
    cf_select(losses, NULL, B, S, 0.5f, CF_SELECT_RANDOM, 0, 42, k1);
    cf_select(losses, NULL, B, S, 0.5f, CF_SELECT_RANDOM, 0, 42, k2);
    CHECK(memcmp(k1, k2, sizeof k1) == 0);
    /* bad keep fractions are refused */
    CHECK(cf_select(losses, NULL, B, S, 0.0f, CF_SELECT_SELF, 0, 1, keep) < 0);
    CHECK(cf_select(losses, NULL, B, S, 1.5f, CF_SELECT_SELF, 0, 1, keep) < 0);
    CHECK(cf_select(losses, NULL, B, S, 0.5f, CF_SELECT_REF, 0, 1, keep) < 0);
}

TEST(saved_model_loads_back_with_identical_losses) {
    for (int ti = 0; ti < NTYPES; ti++) {
        cf_model *m = make_model(TYPES[ti], 41 + ti);
        if (!m) { CHECK(0); continue; }
        char dir[] = "/tmp/cf_test_model_XXXXXX";
        CHECK(mkdtemp(dir) != NULL);
        CHECK_MSG(cf_model_save(m, dir, "float32", 0) == 0, "%s", cf_last_error());
        cf_model *m2 = cf_model_load(dir, CF_BACKEND_CPU);
        CHECK_MSG(m2 != NULL, "%s", cf_last_error());
        if (m2) {
            int32_t tok[B * (S + 1)];
            random_tokens(tok, B * (S + 1), cf_model_config(m)->vocab_size, 5);
            float l1[B * S], l2[B * S];
            cf_forward(m, tok, B, S, l1);
            cf_forward(m2, tok, B, S, l2);
            CHECK(memcmp(l1, l2, sizeof l1) == 0);
            cf_model_free(m2);
        }
        char cmd[256];
        snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
        CHECK(system(cmd) == 0);
        cf_model_free(m);
    }
}

/* The parameter table puts q/k/v biases behind the three weights (so the
 * projections fuse); state.bin files of the older order (each bias right
 * after its weight: magic CFSTATE2, or CFSTATE1) still resume with every
 * tensor's own AdamW moments. Each model type: a checkpoint with distinct
 * moments per element, written as version 3, loaded back; then rewritten
 * by hand as a version-2 file in the older order and loaded again. Only
 * qwen2 (biases) has an older order that differs. */
static int moments_equal(cf_model *m, const float *am, const float *av, size_t n) {
    float *bm = malloc(2 * n * sizeof(float) + 1);
    int ok = bm && cf_model_get_adam(m, bm, bm + n) == 0 && memcmp(bm, am, n * sizeof(float)) == 0 &&
             memcmp(bm + n, av, n * sizeof(float)) == 0;
    free(bm);
    return ok;
}

TEST(state_bin_of_the_older_table_order_resumes_with_each_tensors_moments) {
    for (int ti = 0; ti < NTYPES; ti++) {
        cf_model *m = make_model(TYPES[ti], 61 + ti);
        if (!m) { CHECK(0); continue; }
        int *order = malloc((size_t)m->ntensors * sizeof(int));
        CHECK(order != NULL);
        if (!order) { cf_model_free(m); continue; }
        const int differs = cf_param_order_v2(m, order);
        CHECK_MSG(differs == !strcmp(TYPES[ti], "tiny-qwen2"), "%s: older order differs %d", TYPES[ti], differs);
        const size_t n = m->opt.lay.nlocal;
        float *am = malloc(2 * n * sizeof(float) + 1), *av = am + n;
        for (size_t k = 0; k < n; k++) {
            am[k] = (float)k + 0.25f;
            av[k] = 2.0f * (float)k + 1.0f;
        }
        CHECK(cf_model_set_adam(m, am, av, 7) == 0);
        char dir[] = "/tmp/cf_test_state_XXXXXX";
        CHECK(mkdtemp(dir) != NULL);
        CHECK_MSG(cf_checkpoint_save(m, dir, 3, 11, 1) == 0, "%s", cf_last_error());
        cf_model_opts o = {0};
        o.backend = CF_BACKEND_CPU;
        int64_t step = 0, pos = 0;
        cf_model *r = cf_checkpoint_load(dir, &o, &step, &pos);
        CHECK_MSG(r && step == 3 && pos == 11 && moments_equal(r, am, av, n), "%s: version 3: %s", TYPES[ti],
                  r ? "moments differ" : cf_last_error());
        cf_model_free(r);
        /* the same state as an older version wrote it */
        char path[128];
        snprintf(path, sizeof path, "%s/step_00000003/state.bin", dir);
        size_t len = 0;
        char *buf = cf_read_file(path, &len, 1 << 28);
        cf_optim_layout old;
        CHECK(buf && cf_optim_layout_order(m, order, &old) == 0 && old.nlocal == n);
        const size_t hb = len - 2 * n * sizeof(float);
        CHECK(buf && memcmp(buf, "CFSTATE3", 8) == 0 && hb == 40);
        if (buf && old.goff) {
            memcpy(buf, "CFSTATE2", 8);
            float *fm = (float *)(buf + hb), *fv = fm + n;
            for (int i = 0; i < m->ntensors; i++) {
                if (!m->params[i].trainable) continue;
                for (size_t j = 0; j < m->params[i].numel; j++) {
                    fm[old.goff[i] + j] = am[m->opt.lay.goff[i] + j];
                    fv[old.goff[i] + j] = av[m->opt.lay.goff[i] + j];
                }
            }
            FILE *f = fopen(path, "wb");
            CHECK(f && fwrite(buf, 1, len, f) == len);
            if (f) fclose(f);
            r = cf_checkpoint_load(dir, &o, &step, &pos);
            CHECK_MSG(r && step == 3 && moments_equal(r, am, av, n), "%s: version 2: %s", TYPES[ti],
                      r ? "moments differ" : cf_last_error());
            CHECK(r && cf_optimizer_steps(r) == 7);
            cf_model_free(r);
        }
        cf_optim_layout_free(&old);
        free(buf);
        char cmd[256];
        snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
        CHECK(system(cmd) == 0);
        free(am);
        free(order);
        cf_model_free(m);
    }
}

TEST(training_steps_reduce_the_loss_on_a_repeated_batch) {
    cf_model *m = make_model("tiny-qwen3", 51);
    if (!m) { CHECK(0); return; }
    int32_t tok[B * (S + 1)];
    random_tokens(tok, B * (S + 1), cf_model_config(m)->vocab_size, 9);
    cf_adamw_params hp = {3e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, 1.0f};
    float first = 0, last = 0;
    for (int step = 0; step < 30; step++) {
        CHECK(cf_forward(m, tok, B, S, NULL) == 0);
        float l;
        CHECK(cf_backward(m, CF_MODE_REGULAR, NULL, 1.0f, &l) == 0);
        float norm;
        CHECK(cf_step(m, &hp, &norm) == 0);
        if (step == 0) first = l;
        last = l;
    }
    CHECK_MSG(last < 0.5f * first, "loss %g -> %g", first, last);
    cf_model_free(m);
}

TEST(doc_mask_gradients_match_finite_differences_and_centrifuge_equals_stopgrad_reference) {
    /* token 5 starts a document: positions restart and no attention crosses it */
    const char *types[] = {"tiny-llama", "tiny-qwen3"};
    for (int ti = 0; ti < 2; ti++) {
        cf_model *m = make_model(types[ti], 61 + ti);
        if (!m) { CHECK(0); continue; }
        cf_model_set_doc_mask(m, 5);
        int32_t tok[B * (S + 1)];
        two_document_tokens(tok, B, S, cf_model_config(m)->vocab_size, 5, 600 + ti);
        float losses[B * S];
        CHECK(cf_forward(m, tok, B, S, losses) == 0);
        /* the doc mask changes the result: attention no longer sees the earlier document */
        cf_model_set_doc_mask(m, -1);
        float plain[B * S];
        cf_forward(m, tok, B, S, plain);
        cf_model_set_doc_mask(m, 5);
        CHECK_MSG(fabsf(plain[S - 1] - losses[S - 1]) > 1e-4, "%s: doc mask has no effect", types[ti]);
        CHECK_MSG(plain[1] == losses[1], "%s: rows before the second document must not change", types[ti]);
        cf_forward(m, tok, B, S, losses);
        cf_zero_grad(m);
        CHECK(cf_backward(m, CF_MODE_REGULAR, NULL, 1.0f, NULL) == 0);
        float *g = all_grads(m);
        fd_check(m, tok, NULL, g, types[ti]);
        free(g);
        uint8_t keep[B * S];
        cf_select(losses, NULL, B, S, 0.5f, CF_SELECT_SELF, 0, 1, keep);
        float *cf = grads_of(m, tok, CF_MODE_CENTRIFUGE, keep, NULL);
        float *sg = grads_of(m, tok, (cf_mode)-1, keep, NULL);
        CHECK_MSG(max_rel(m, cf, sg, NULL) < 1e-5, "%s: centrifuge vs stop-grad with doc mask", types[ti]);
        free(cf); free(sg);
        cf_model_free(m);
    }
}

TEST(kept_rows_are_refused_after_the_next_forward_or_selection) {
    cf_model *m = make_model("tiny-llama", 71);
    if (!m) { CHECK(0); return; }
    int32_t tok[B * (S + 1)];
    random_tokens(tok, B * (S + 1), cf_model_config(m)->vocab_size, 71);
    cf_select_opts so = {CF_SELECT_SELF, 0.5, 0, 1};
    cf_kept k1, k2;
    CHECK(cf_forward(m, tok, B, S, NULL) == 0);
    CHECK(cf_select_kept(m, NULL, &so, &k1) == 0);
    CHECK(k1.n == B * cf_select_kept_count(0.5, S));
    /* a second selection of the same forward replaces the first */
    CHECK(cf_select_kept(m, NULL, &so, &k2) == 0);
    CHECK(k2.id != k1.id);
    cf_zero_grad(m);
    CHECK(cf_backward(m, CF_MODE_CENTRIFUGE, &k1, 1.0f, NULL) != 0);
    CHECK(strstr(cf_last_error(), "current selection") != NULL);
    CHECK(cf_backward(m, CF_MODE_CENTRIFUGE, &k2, 1.0f, NULL) == 0);
    /* the next forward invalidates every earlier selection */
    CHECK(cf_forward(m, tok, B, S, NULL) == 0);
    CHECK(cf_filter(m, &k2) != 0);
    CHECK(cf_backward(m, CF_MODE_LOSS_ONLY, &k2, 1.0f, NULL) != 0);
    CHECK(strstr(cf_last_error(), "earlier forward") != NULL);
    /* a tampered count is refused too */
    CHECK(cf_select_kept(m, NULL, &so, &k1) == 0);
    k1.n += 1;
    CHECK(cf_backward(m, CF_MODE_CENTRIFUGE, &k1, 1.0f, NULL) != 0);
    /* compact modes need kept rows */
    CHECK(cf_backward(m, CF_MODE_CENTRIFUGE, NULL, 1.0f, NULL) != 0);
    cf_model_free(m);
}

TEST(kept_count_is_round_of_the_decimal_keep_fraction) {
    CHECK(cf_select_kept_count(0.35, 10) == 4);   /* 3.5 rounds up, not 3 */
    CHECK(cf_select_kept_count(0.25, 10) == 3);
    CHECK(cf_select_kept_count(0.5, 9) == 5);
    CHECK(cf_select_kept_count(0.1, 9) == 1);
    CHECK(cf_select_kept_count(0.01, 9) == 1);    /* at least one */
    CHECK(cf_select_kept_count(1.0, 4096) == 4096);
    CHECK(cf_select_kept_count(0.3, 4096) == 1229);
    float losses[10];
    uint8_t keep[10];
    for (int i = 0; i < 10; i++) losses[i] = (float)i;
    CHECK(cf_select(losses, NULL, 1, 10, 0.35, CF_SELECT_SELF, 0, 1, keep) == 4);
}

TEST(gradient_clipping_scales_the_step_by_clip_over_norm) {
    cf_model *m = make_model("tiny-qwen2", 81);
    if (!m) { CHECK(0); return; }
    int32_t tok[B * (S + 1)];
    random_tokens(tok, B * (S + 1), cf_model_config(m)->vocab_size, 81);
    size_t np = cf_model_num_params(m);
    CHECK(cf_forward(m, tok, B, S, NULL) == 0);
    cf_zero_grad(m);
    CHECK(cf_backward(m, CF_MODE_REGULAR, NULL, 1.0f, NULL) == 0);
    float *g = all_grads(m), *w0 = malloc(np * sizeof(float)), *w1 = malloc(np * sizeof(float));
    for (int i = 0; i < cf_model_num_tensors(m); i++) cf_model_get_param(m, i, w0 + toff(m, i));
    double norm = 0;
    for (size_t j = 0; j < np; j++) norm += (double)g[j] * g[j];
    norm = sqrt(norm);
    /* eps = 1 keeps the first Adam update proportional to the clipped
     * gradient, so a wrong clip scale shows: p -= lr * g' / (|g'| + 1) */
    const float clip = 0.25f, lr = 0.1f;
    CHECK(norm > 4 * clip);
    cf_adamw_params hp = {lr, 0.9f, 0.95f, 1.0f, 0.0f, clip};
    float rep;
    CHECK(cf_step(m, &hp, &rep) == 0);
    CHECK_CLOSE(rep, norm, 1e-5);
    for (int i = 0; i < cf_model_num_tensors(m); i++) cf_model_get_param(m, i, w1 + toff(m, i));
    float *want = malloc(np * sizeof(float));
    for (size_t j = 0; j < np; j++) {
        double gc = g[j] * (clip / norm);
        want[j] = (float)(w0[j] - lr * gc / (fabs(gc) + 1.0));
    }
    double e = rel_l2(w1, want, np);
    CHECK_MSG(e < 1e-6, "weights after a clipped step: relative error %.3g", e);
    free(g); free(w0); free(w1); free(want);
    cf_model_free(m);
}

TEST(frozen_parameters_get_no_gradient_and_do_not_change) {
    cf_config c;
    CHECK(cf_config_builtin(&c, "tiny-llama") == 0);
    cf_model_opts o = {0};
    o.config = "tiny-llama";
    o.backend = CF_BACKEND_CPU;
    o.seed = 5;
    o.freeze = "embed_tokens,layers.0.mlp";
    cf_model *fz = cf_model_open(&o);
    o.freeze = NULL;
    cf_model *full = cf_model_open(&o);
    CHECK_MSG(fz && full, "%s", cf_last_error());
    if (!fz || !full) { cf_model_free(fz); cf_model_free(full); return; }
    CHECK(cf_model_num_trainable(fz) < cf_model_num_trainable(full));
    int32_t tok[B * (S + 1)];
    random_tokens(tok, B * (S + 1), c.vocab_size, 91);
    float *gz = grads_of(fz, tok, CF_MODE_REGULAR, NULL, NULL);
    float *gf = grads_of(full, tok, CF_MODE_REGULAR, NULL, NULL);
    for (int i = 0; i < cf_model_num_tensors(fz); i++) {
        const char *name = cf_model_tensor_name(fz, i);
        int frozen = strstr(name, "embed_tokens") || strstr(name, "layers.0.mlp");
        CHECK_MSG(cf_model_tensor_trainable(fz, i) == !frozen, "%s trainable flag", name);
        float dummy[1];
        if (frozen) CHECK(cf_model_get_grad(fz, i, dummy) != 0 || cf_model_tensor_numel(fz, i) == 0);
        else CHECK_MSG(rel_l2(gz + toff(fz, i), gf + toff(full, i), cf_model_tensor_numel(fz, i)) < 1e-6,
                       "%s: gradient differs from the unfrozen model's", name);
    }
    /* a step leaves the frozen tensors exactly as they were */
    size_t ne = cf_model_tensor_numel(fz, 0);
    float *e0 = malloc(ne * sizeof(float)), *e1 = malloc(ne * sizeof(float));
    cf_model_get_param(fz, 0, e0);
    cf_adamw_params hp = {1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f};
    float norm;
    CHECK(cf_step(fz, &hp, &norm) == 0);
    cf_model_get_param(fz, 0, e1);
    CHECK(memcmp(e0, e1, ne * sizeof(float)) == 0);
    /* a pattern that matches nothing is an error */
    o.freeze = "no_such_tensor";
    cf_model *bad = cf_model_open(&o);
    CHECK(bad == NULL && strstr(cf_last_error(), "matches no parameter") != NULL);
    /* so is an empty item, which would otherwise be skipped without a word */
    o.freeze = "embed_tokens,,lm_head";
    bad = cf_model_open(&o);
    CHECK(bad == NULL && strstr(cf_last_error(), "empty item") != NULL);
    free(e0); free(e1); free(gz); free(gf);
    cf_model_free(fz);
    cf_model_free(full);
}

/* The trainer's step over two micro-batches of one sequence equals one
 * micro-batch of both sequences (same loss, same gradient norm, same
 * update), in every mode: the loss is normalised over the whole step. */
TEST(trainer_gradient_accumulation_equals_the_whole_batch) {
    const cf_mode modes[] = {CF_MODE_REGULAR, CF_MODE_LOSS_ONLY, CF_MODE_CENTRIFUGE, CF_MODE_STRAWMAN};
    for (int mi = 0; mi < 4; mi++) {
        cf_model *a = make_model("tiny-qwen3", 101), *b = make_model("tiny-qwen3", 101);
        if (!a || !b) { CHECK(0); cf_model_free(a); cf_model_free(b); return; }
        int32_t tok[B * (S + 1)];
        random_tokens(tok, B * (S + 1), cf_model_config(a)->vocab_size, 102);
        cf_train_opts o = {0};
        o.mode = modes[mi];
        o.select = (cf_select_opts){CF_SELECT_SELF, 0.5, 0, 1};
        /* eps 1e-3: the first Adam update is smooth in the gradient */
        o.adamw = (cf_adamw_params){1e-2f, 0.9f, 0.95f, 1e-3f, 0.1f, 1.0f};
        o.batch = B; o.seq = S; o.grad_accum = 1;
        cf_trainer *ta = cf_trainer_create(a, &o);
        o.batch = 1; o.grad_accum = B;
        cf_trainer *tb = cf_trainer_create(b, &o);
        CHECK(ta && tb);
        cf_micro_batch whole = {tok, NULL}, parts[B];
        for (int i = 0; i < B; i++) { parts[i].tokens = tok + i * (S + 1); parts[i].ref = NULL; }
        cf_step_stats sa, sb;
        CHECK(cf_trainer_step(ta, &whole, 1e-2f, &sa) == 0);
        CHECK(cf_trainer_step(tb, parts, 1e-2f, &sb) == 0);
        CHECK_CLOSE(sa.loss, sb.loss, 1e-6);
        CHECK_CLOSE(sa.grad_norm, sb.grad_norm, 1e-5);
        CHECK(sa.kept == sb.kept && sa.tokens == sb.tokens && !sa.skipped);
        size_t np = cf_model_num_params(a);
        float *wa = malloc(np * sizeof(float)), *wb = malloc(np * sizeof(float));
        for (int i = 0; i < cf_model_num_tensors(a); i++) {
            cf_model_get_param(a, i, wa + toff(a, i));
            cf_model_get_param(b, i, wb + toff(b, i));
        }
        CHECK_MSG(max_rel(a, wb, wa, NULL) < 1e-5, "%s: weights after one step differ (%.3g)", cf_mode_name(modes[mi]),
                  max_rel(a, wb, wa, NULL));
        free(wa); free(wb);
        cf_trainer_free(ta); cf_trainer_free(tb);
        cf_model_free(a); cf_model_free(b);
    }
}

/* A model of config `name` (LoRA on `lora` targets, none if 0; tensors
 * matching `freeze` frozen) with the
 * forward's projections fused where the layout allows (fused = 1) or never
 * (CF_FUSED_PROJ=0), weights as make_model's. */
static cf_model *fused_model(const char *name, unsigned lora, const char *freeze, int fused, uint64_t seed) {
    cf_model_opts o = {0};
    o.config = name;
    o.backend = CF_BACKEND_CPU;
    o.seed = seed;
    o.freeze = freeze;
    if (lora) o.lora = (cf_lora_opts){4, 8.0f, lora, 0.0f, 0};
    if (!fused) setenv("CF_FUSED_PROJ", "0", 1);
    cf_model *m = cf_model_open(&o);
    unsetenv("CF_FUSED_PROJ");
    if (!m) { printf("    %s\n", cf_last_error()); return NULL; }
    randomize_weights(m, seed ^ 0x5eed, 0.25f, 0.2f);
    return m;
}

/* Issue 17: the fused projections (forward: one q/k/v GEMM split with
 * RoPE, one gate/up GEMM into a [T, 2F] slot; backward: dq, dk, dv joined
 * with RoPE undone into one input and one weight-gradient GEMM, and one
 * gate/up pair) give the unfused losses and gradients, regular and
 * centrifuge, and the same weights after a step:
 * llama (both fused), qwen2 (q/k/v biases, back to back: both fused; its
 * weights frozen and biases trained: both fused; k's bias frozen: the
 * biases apart, q/k/v not fused), qwen3 (q/k norm:
 * gate/up only), LoRA on q and up (an adapted projection keeps its group
 * apart: neither fused), LoRA on o and down only (both fused), q frozen or
 * v and up frozen (their weights live apart from the trainable ones: that
 * group not fused) and q, k, v frozen (back to back among the frozen
 * tensors: both fused). fp32: only the GEMMs' summation order over other
 * widths may differ, so ~1e-6. */
TEST(fused_projections_give_the_unfused_losses_gradients_and_step) {
    static const struct { const char *name; unsigned lora; const char *freeze; int qkv, gu; } cs[] = {
        {"tiny-llama", 0, NULL, 1, 1},
        {"tiny-qwen2", 0, NULL, 1, 1},
        {"tiny-qwen2", 0, "proj.weight", 1, 1},   /* frozen weights, trained biases */
        {"tiny-qwen2", 0, "k_proj.bias", 0, 1},   /* biases apart: trained bq, bv; frozen bk */
        {"tiny-qwen3", 0, NULL, 0, 1},
        {"tiny-llama", CF_LORA_Q | CF_LORA_UP, NULL, 0, 0},
        {"tiny-mistral", CF_LORA_O | CF_LORA_DOWN, NULL, 1, 1},
        {"tiny-llama", 0, "q_proj", 0, 1},
        {"tiny-llama", 0, "v_proj,up_proj", 0, 0},
        {"tiny-llama", 0, "q_proj,k_proj,v_proj", 1, 1},
    };
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        cf_model *f = fused_model(cs[ci].name, cs[ci].lora, cs[ci].freeze, 1, 41 + ci);
        cf_model *u = fused_model(cs[ci].name, cs[ci].lora, cs[ci].freeze, 0, 41 + ci);
        if (!f || !u) { CHECK(0); cf_model_free(f); cf_model_free(u); continue; }
        const int L = cf_model_config(f)->num_hidden_layers;
        for (int l = 0; l < L; l++) {
            CHECK_MSG(f->lp[l].fused_qkv == cs[ci].qkv && f->lp[l].fused_gate_up == cs[ci].gu,
                      "%s layer %d: fused q/k/v %d gate/up %d, want %d %d", cs[ci].name, l, f->lp[l].fused_qkv,
                      f->lp[l].fused_gate_up, cs[ci].qkv, cs[ci].gu);
            CHECK(!u->lp[l].fused_qkv && !u->lp[l].fused_gate_up);
        }
        int32_t tok[B * (S + 1)];
        random_tokens(tok, B * (S + 1), cf_model_config(f)->vocab_size, 500 + ci);
        float lf[B * S], lu[B * S];
        CHECK(cf_forward(f, tok, B, S, lf) == 0 && cf_forward(u, tok, B, S, lu) == 0);
        CHECK_MSG(rel_l2(lf, lu, B * S) < 1e-6, "%s: losses differ by %.3g", cs[ci].name, rel_l2(lf, lu, B * S));
        uint8_t keep[B * S];
        cf_select(lf, NULL, B, S, 0.5f, CF_SELECT_SELF, 0, 3, keep);
        for (int mi = 0; mi < 2; mi++) {
            const cf_mode mode = mi ? CF_MODE_CENTRIFUGE : CF_MODE_REGULAR;
            float *gf = grads_of(f, tok, mode, keep, NULL), *gu = grads_of(u, tok, mode, keep, NULL);
            const char *where = "?";
            double e = max_rel(f, gf, gu, &where);
            CHECK_MSG(e < 1e-5, "%s %s: gradients differ by %.3g at %s", cs[ci].name, cf_mode_name(mode), e, where);
            free(gf);
            free(gu);
        }
        /* the centrifuge gradients of the last backward: one step each */
        cf_adamw_params hp = {1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.0f};
        CHECK(cf_step(f, &hp, NULL) == 0 && cf_step(u, &hp, NULL) == 0);
        CHECK(cf_forward(f, tok, B, S, lf) == 0 && cf_forward(u, tok, B, S, lu) == 0);
        CHECK_MSG(rel_l2(lf, lu, B * S) < 1e-5, "%s: losses after a step differ by %.3g", cs[ci].name,
                  rel_l2(lf, lu, B * S));
        cf_model_free(f);
        cf_model_free(u);
    }
}

/* A model of config `name` (LoRA on q and v if lora) whose training
 * forwards keep the LM head's g (save = 1) or not (CF_HEAD_SAVE=0 at open),
 * weights as make_model's. */
static cf_model *head_model(const char *name, int lora, int save, uint64_t seed) {
    cf_model_opts o = {0};
    o.config = name;
    o.backend = CF_BACKEND_CPU;
    o.seed = seed;
    if (lora) o.lora = (cf_lora_opts){4, 8.0f, CF_LORA_Q | CF_LORA_V, 0.0f, 0};
    if (!save) setenv("CF_HEAD_SAVE", "0", 1);
    cf_model *m = cf_model_open(&o);
    unsetenv("CF_HEAD_SAVE");
    if (!m) { printf("    %s\n", cf_last_error()); return NULL; }
    randomize_weights(m, seed ^ 0x5eed, 0.25f, 0.2f);
    return m;
}

/* Two micro-batches of B x S (tok: 2 B rows of S + 1) accumulated on fresh
 * gradients as the trainer runs them: each forward marked as followed by
 * its backward, the kept rows the top half by loss per sequence. losses
 * gets both forwards' losses; *kept counts the forwards that kept g. */
static float *head_accum_grads(cf_model *m, const int32_t *tok, cf_mode mode, float *losses, int *kept) {
    cf_zero_grad(m);
    for (int mb = 0; mb < 2; mb++) {
        float *l = losses + mb * B * S;
        m->bwd_follows = 1;
        CHECK(cf_forward(m, tok + mb * B * (S + 1), B, S, l) == 0);
        m->bwd_follows = 0;
        *kept += m->head_g_fwd == m->fwd_id;
        uint8_t keep[B * S];
        cf_select(l, NULL, B, S, 0.5f, CF_SELECT_SELF, 0, 3, keep);
        int rc = backward_with_mask(m, mode, mode == CF_MODE_REGULAR ? NULL : keep, 0);
        CHECK_MSG(rc == 0, "backward failed: %s", cf_last_error());
        CHECK(m->head_g_fwd == 0);   /* used up, or never kept */
    }
    return all_grads(m);
}

/* Issue 17: a training forward keeps g = softmax - onehot and its backward
 * skips the logits recompute; against CF_HEAD_SAVE=0 (the recompute path):
 * the same losses bit for bit and the same gradients (fp32: ~1e-7, the
 * order of dloss (p - 1) against dloss p - dloss) in regular, loss-only and
 * centrifuge modes over two accumulated micro-batches (the first writes
 * the LM head's gradient: CF_MM_DW_SET), untied (tiny-llama), tied (tiny:
 * the LM head's gradient is the embedding's) and with LoRA (frozen head).
 * An inference forward keeps nothing and allocates nothing; a backward
 * after it recomputes; the trainer's step after it keeps g and matches. */
TEST(lm_head_saved_grad_gives_the_recompute_paths_losses_and_gradients) {
    static const struct { const char *name; int lora; } cs[] = {{"tiny-llama", 0}, {"tiny", 0}, {"tiny-qwen2", 1}};
    const cf_mode modes[] = {CF_MODE_REGULAR, CF_MODE_LOSS_ONLY, CF_MODE_CENTRIFUGE};
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        cf_model *on = head_model(cs[ci].name, cs[ci].lora, 1, 61 + ci);
        cf_model *off = head_model(cs[ci].name, cs[ci].lora, 0, 61 + ci);
        if (!on || !off) { CHECK(0); cf_model_free(on); cf_model_free(off); continue; }
        CHECK(on->head_save && !off->head_save);
        int32_t tok[2 * B * (S + 1)];
        random_tokens(tok, 2 * B * (S + 1), cf_model_config(on)->vocab_size, 600 + ci);
        for (int mi = 0; mi < 3; mi++) {
            float lon[2 * B * S], loff[2 * B * S];
            int kon = 0, koff = 0;
            float *gon = head_accum_grads(on, tok, modes[mi], lon, &kon);
            float *goff = head_accum_grads(off, tok, modes[mi], loff, &koff);
            CHECK_MSG(kon == 2 && koff == 0, "%s: forwards keeping g: %d with, %d without", cs[ci].name, kon, koff);
            CHECK_MSG(memcmp(lon, loff, sizeof lon) == 0, "%s %s: losses differ", cs[ci].name,
                      cf_mode_name(modes[mi]));
            const char *where = "?";
            double e = max_rel(on, gon, goff, &where);
            CHECK_MSG(e < 1e-5, "%s %s: gradients differ by %.3g at %s", cs[ci].name, cf_mode_name(modes[mi]), e,
                      where);
            CHECK(grad_norm(gon, cf_model_num_params(on)) > 0);
            free(gon);
            free(goff);
        }
        cf_model_free(on);
        cf_model_free(off);
    }

    /* inference, then a backward of it (recompute), then the trainer */
    cf_model *on = head_model("tiny-llama", 0, 1, 71), *off = head_model("tiny-llama", 0, 0, 71);
    if (!on || !off) { CHECK(0); cf_model_free(on); cf_model_free(off); return; }
    int32_t tok[2 * B * (S + 1)];
    random_tokens(tok, 2 * B * (S + 1), cf_model_config(on)->vocab_size, 700);
    float lon[B * S], loff[B * S];
    CHECK(cf_forward(on, tok, B, S, lon) == 0 && cf_forward(off, tok, B, S, loff) == 0);
    CHECK(on->s_head < 0 && on->head_g_fwd == 0 && memcmp(lon, loff, sizeof lon) == 0);
    cf_zero_grad(on);
    cf_zero_grad(off);
    CHECK(cf_backward(on, CF_MODE_REGULAR, NULL, 1.0f, NULL) == 0);
    CHECK(cf_backward(off, CF_MODE_REGULAR, NULL, 1.0f, NULL) == 0);
    float *gon = all_grads(on), *goff = all_grads(off);
    CHECK_MSG(max_rel(on, gon, goff, NULL) == 0, "a backward after inference: gradients differ");
    free(gon);
    free(goff);
    cf_adamw_params hp = {1e-2f, 0.9f, 0.95f, 1e-3f, 0.1f, 1.0f};
    CHECK(cf_step(on, &hp, NULL) == 0 && cf_step(off, &hp, NULL) == 0);
    CHECK(cf_forward(on, tok, B, S, lon) == 0);   /* inference before the step, nothing after it */
    cf_train_opts o = {0};
    o.mode = CF_MODE_CENTRIFUGE;
    o.select = (cf_select_opts){CF_SELECT_SELF, 0.5, 0, 1};
    o.adamw = hp;
    o.batch = B; o.seq = S; o.grad_accum = 2;
    cf_trainer *tr_on = cf_trainer_create(on, &o), *tr_off = cf_trainer_create(off, &o);
    CHECK(tr_on && tr_off);
    cf_micro_batch mbs[2] = {{tok, NULL}, {tok + B * (S + 1), NULL}};
    cf_step_stats son, soff;
    CHECK(cf_trainer_step(tr_on, mbs, 1e-2f, &son) == 0 && cf_trainer_step(tr_off, mbs, 1e-2f, &soff) == 0);
    CHECK(on->s_head >= 0 && off->s_head < 0 && !on->bwd_follows);
    CHECK(son.loss == soff.loss);
    CHECK_CLOSE(son.grad_norm, soff.grad_norm, 1e-5);
    size_t np = cf_model_num_params(on);
    float *wa = malloc(np * sizeof(float)), *wb = malloc(np * sizeof(float));
    for (int i = 0; i < cf_model_num_tensors(on); i++) {
        cf_model_get_param(on, i, wa + toff(on, i));
        cf_model_get_param(off, i, wb + toff(off, i));
    }
    CHECK_MSG(max_rel(on, wa, wb, NULL) < 1e-5, "weights after the trainer's step differ (%.3g)",
              max_rel(on, wa, wb, NULL));
    free(wa); free(wb);
    cf_trainer_free(tr_on); cf_trainer_free(tr_off);
    cf_model_free(on);
    cf_model_free(off);
}

int main(void) {
    RUN(kept_count_is_round_of_the_decimal_keep_fraction);
    RUN(kept_rows_are_refused_after_the_next_forward_or_selection);
    RUN(gradient_clipping_scales_the_step_by_clip_over_norm);
    RUN(frozen_parameters_get_no_gradient_and_do_not_change);
    RUN(trainer_gradient_accumulation_equals_the_whole_batch);
    RUN(selection_keeps_top_excess_loss_with_deterministic_ties);
    RUN(model_gradients_match_finite_differences_for_every_model_type);
    RUN(loss_only_gradients_are_the_dense_gradient_of_the_masked_loss);
    RUN(equivalences_of_design_section_1_hold_for_every_model_type);
    RUN(doc_mask_gradients_match_finite_differences_and_centrifuge_equals_stopgrad_reference);
    RUN(saved_model_loads_back_with_identical_losses);
    RUN(state_bin_of_the_older_table_order_resumes_with_each_tensors_moments);
    RUN(fused_projections_give_the_unfused_losses_gradients_and_step);
    RUN(lm_head_saved_grad_gives_the_recompute_paths_losses_and_gradients);
    RUN(training_steps_reduce_the_loss_on_a_repeated_batch);
    return test_summary();
}
