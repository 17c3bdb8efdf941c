/*
 * test_lora.c — LoRA adapters on the CPU backend:
 *   - adapter gradients match finite differences (regular, loss-only), and
 *     no base tensor has a gradient;
 *   - with adapters, centrifuge equals the dense stop-gradient reference
 *     and equals regular at keep = 1 (DESIGN §1, per tensor);
 *   - fresh adapters (B = 0) leave the base model's losses unchanged;
 *   - PEFT files round trip; merging gives the adapted model's losses;
 *   - bad adapter files are refused with a clear message;
 *   - adapter gradients equal the merged model's weight gradient through
 *     the adapter (chain rule), per tensor (regular, loss-only, centrifuge).
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

enum { B = 2, S = 9 };

static cf_model *lora_model(const char *config, uint64_t seed, unsigned targets, int rslora) {
    cf_model_opts o = {0};
    o.config = config;
    o.backend = CF_BACKEND_CPU;
    o.seed = seed;
    o.lora = (cf_lora_opts){4, 8.0f, targets, 0.0f, rslora};
    cf_model *m = cf_model_open(&o);
    if (!m) { printf("    %s\n", cf_last_error()); return NULL; }
    return m;
}

static double masked_loss(cf_model *m, const int32_t *tok, const uint8_t *keep) {
    float l[B * S];
    cf_forward(m, tok, B, S, l);
    return masked_mean(l, B * S, keep);
}

typedef struct { cf_model *m; const int32_t *tok; const uint8_t *keep; } loss_ctx;
static double loss_of(void *p) {
    loss_ctx *c = p;
    return masked_loss(c->m, c->tok, c->keep);
}

static float *run(cf_model *m, const int32_t *tok, cf_mode mode, const uint8_t *keep, int stopgrad) {
    cf_forward(m, tok, B, S, NULL);
    cf_zero_grad(m);
    int rc = backward_with_mask(m, mode, keep, stopgrad);
    CHECK_MSG(rc == 0, "backward: %s", cf_last_error());
    return all_grads(m);
}

TEST(lora_adapter_gradients_match_finite_differences_and_base_has_none) {
    const char *types[] = {"tiny-llama", "tiny-qwen2", "tiny-qwen3"};
    for (int ti = 0; ti < 3; ti++) {
        cf_model *m = lora_model(types[ti], 3 + ti, 0x7f, ti == 2);
        if (!m) { CHECK(0); continue; }
        randomize_weights(m, 11 + ti, 0.3f, 0.2f);
        int32_t tok[B * (S + 1)];
        random_tokens(tok, B * (S + 1), cf_model_config(m)->vocab_size, 20 + ti);
        uint8_t keep[B * S];
        for (int t = 0; t < B * S; t++) keep[t] = (t % 3) != 0;
        for (int lo = 0; lo < 2; lo++) {
            float *g = run(m, tok, lo ? CF_MODE_LOSS_ONLY : CF_MODE_REGULAR, lo ? keep : NULL, 0);
            int adapters = 0;
            for (int i = 0; i < cf_model_num_tensors(m); i++) {
                const char *name = cf_model_tensor_name(m, i);
                int is_adapter = strstr(name, "lora_") != NULL;
                CHECK_MSG(cf_model_tensor_trainable(m, i) == is_adapter, "%s: trainable flag", name);
                float dummy[1];
                if (!is_adapter) { CHECK(cf_model_get_grad(m, i, dummy) != 0); continue; }
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
            CHECK_MSG(adapters == L * 7 * 2, "%s: %d adapter tensors, want %d", types[ti], adapters, L * 14);
            free(g);
        }
        cf_model_free(m);
    }
}

TEST(lora_centrifuge_equals_stopgrad_reference_and_regular_at_keep_1) {
    cf_model *m = lora_model("tiny-qwen2", 7, CF_LORA_Q | CF_LORA_K | CF_LORA_V | CF_LORA_O | CF_LORA_DOWN, 0);
    if (!m) { CHECK(0); return; }
    randomize_weights(m, 8, 0.3f, 0.2f);
    int32_t tok[B * (S + 1)];
    random_tokens(tok, B * (S + 1), cf_model_config(m)->vocab_size, 9);
    uint8_t all[B * S], half[B * S], uneven[B * S];
    memset(all, 1, sizeof all);
    for (int t = 0; t < B * S; t++) { half[t] = t % 2; uneven[t] = t < S ? 0 : (t % 3 == 0); }
    float *reg = run(m, tok, CF_MODE_REGULAR, NULL, 0);
    float *cf1 = run(m, tok, CF_MODE_CENTRIFUGE, all, 0);
    CHECK_MSG(max_rel(m, cf1, reg, NULL) < 1e-5, "keep 1: centrifuge vs regular %.3g", max_rel(m, cf1, reg, NULL));
    const uint8_t *masks[2] = {half, uneven};
    for (int k = 0; k < 2; k++) {
        float *cf = run(m, tok, CF_MODE_CENTRIFUGE, masks[k], 0);
        float *sg = run(m, tok, CF_MODE_LOSS_ONLY, masks[k], 1);
        float *lo = run(m, tok, CF_MODE_LOSS_ONLY, masks[k], 0);
        const char *zero = "";
        CHECK_MSG(every_tensor_nonzero(m, sg, &zero), "mask %d: stop-grad reference of %s is all zero", k, zero);
        CHECK_MSG(max_rel(m, cf, sg, NULL) < 1e-5, "mask %d: centrifuge vs stop-grad reference %.3g", k, max_rel(m, cf, sg, NULL));
        CHECK_MSG(max_rel(m, lo, cf, NULL) > 1e-4, "mask %d: loss-only equals centrifuge", k);
        free(cf); free(sg); free(lo);
    }
    free(reg); free(cf1);
    cf_model_free(m);
}

TEST(fresh_adapters_leave_the_base_losses_unchanged) {
    cf_model_opts o = {0};
    o.config = "tiny-llama";
    o.backend = CF_BACKEND_CPU;
    o.seed = 5;
    cf_model *base = cf_model_open(&o);
    cf_model *m = lora_model("tiny-llama", 5, 0x7f, 0);
    if (!base || !m) { CHECK(0); cf_model_free(base); cf_model_free(m); return; }
    int32_t tok[B * (S + 1)];
    random_tokens(tok, B * (S + 1), cf_model_config(m)->vocab_size, 2);
    float l0[B * S], l1[B * S];
    cf_forward(base, tok, B, S, l0);
    cf_forward(m, tok, B, S, l1);
    CHECK(memcmp(l0, l1, sizeof l0) == 0);
    cf_model_free(base);
    cf_model_free(m);
}

TEST(peft_files_round_trip_and_merge_gives_the_adapted_losses) {
    cf_model *m = lora_model("tiny-qwen3", 13, CF_LORA_Q | CF_LORA_V | CF_LORA_GATE | CF_LORA_UP, 1);
    if (!m) { CHECK(0); return; }
    randomize_weights(m, 14, 0.3f, 0.2f);
    char dir[] = "/tmp/cf_test_lora_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char base_dir[256], ad_dir[256];
    snprintf(base_dir, sizeof base_dir, "%s/base", dir);
    snprintf(ad_dir, sizeof ad_dir, "%s/adapter", dir);
    CHECK_MSG(cf_model_save(m, base_dir, "float32", 0) == 0, "%s", cf_last_error());
    CHECK_MSG(cf_lora_save(m, ad_dir, "base") == 0, "%s", cf_last_error());
    /* the base directory holds no adapter tensors */
    cf_model_opts ob = {0};
    ob.model_dir = base_dir;
    ob.backend = CF_BACKEND_CPU;
    cf_model *plain = cf_model_open(&ob);
    CHECK(plain && cf_model_num_trainable(plain) == cf_model_num_params(plain));
    cf_lora_opts rd;
    CHECK(cf_lora_read_config(ad_dir, &rd) == 0);
    CHECK(rd.rank == 4 && rd.alpha == 8.0f && rd.rslora == 1 &&
          rd.targets == (CF_LORA_Q | CF_LORA_V | CF_LORA_GATE | CF_LORA_UP));
    ob.adapter_dir = ad_dir;
    cf_model *back = cf_model_open(&ob);
    CHECK_MSG(back != NULL, "%s", cf_last_error());
    int32_t tok[B * (S + 1)];
    random_tokens(tok, B * (S + 1), cf_model_config(m)->vocab_size, 15);
    float l0[B * S], l1[B * S], l2[B * S];
    cf_forward(m, tok, B, S, l0);
    if (back) {
        cf_forward(back, tok, B, S, l1);
        CHECK(memcmp(l0, l1, sizeof l0) == 0);
        /* merged: the plain model with W += s B A gives the same losses */
        CHECK_MSG(cf_model_merge_lora(back) == 0, "%s", cf_last_error());
        char merged[256];
        snprintf(merged, sizeof merged, "%s/merged", dir);
        CHECK(cf_model_save(back, merged, "float32", 0) == 0);
        cf_model_opts om = {0};
        om.model_dir = merged;
        om.backend = CF_BACKEND_CPU;
        cf_model *mm = cf_model_open(&om);
        CHECK(mm != NULL);
        if (mm) {
            cf_forward(mm, tok, B, S, l2);
            double worst = 0;
            for (int t = 0; t < B * S; t++) worst = fmax(worst, fabs(l2[t] - l0[t]));
            CHECK_MSG(worst < 1e-5, "merged model losses differ by %.3g", worst);
            float diff = 0;
            float lp[B * S];
            cf_forward(plain, tok, B, S, lp);
            for (int t = 0; t < B * S; t++) diff = fmaxf(diff, fabsf(lp[t] - l0[t]));
            CHECK_MSG(diff > 1e-3, "the adapters change nothing (%.3g): the test proves nothing", diff);
            cf_model_free(mm);
        }
        cf_model_free(back);
    }
    /* bad adapter directories */
    char cfgp[300];
    snprintf(cfgp, sizeof cfgp, "%s/adapter_config.json", ad_dir);
    FILE *f = fopen(cfgp, "w");
    fputs("{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"use_dora\": true, \"target_modules\": [\"q_proj\"]}", f);
    fclose(f);
    CHECK(cf_model_open(&ob) == NULL && strstr(cf_last_error(), "DoRA"));
    f = fopen(cfgp, "w");
    fputs("{\"peft_type\": \"LORA\", \"r\": 2, \"lora_alpha\": 8, \"target_modules\": [\"q_proj\", \"v_proj\", \"gate_proj\", \"up_proj\"]}", f);
    fclose(f);
    CHECK(cf_model_open(&ob) == NULL && strstr(cf_last_error(), "shape"));
    f = fopen(cfgp, "w");
    fputs("{\"peft_type\": \"PREFIX_TUNING\"}", f);
    fclose(f);
    CHECK(cf_model_open(&ob) == NULL && strstr(cf_last_error(), "LORA"));
    unsigned bits;
    CHECK(cf_lora_parse_targets("q,k_proj,all", &bits) == 0 && bits == 0x7f);
    CHECK(cf_lora_parse_targets("q,wq", &bits) != 0 && strstr(cf_last_error(), "wq"));
    cf_model_free(plain);
    cf_model_free(m);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
}

/* The adapter's gradients by the chain rule through the merged weight:
 * with W' = W + s B A (s = alpha/r, or alpha/sqrt(r) with rsLoRA),
 * dL/dA = s B^T dL/dW' and dL/dB = s dL/dW' A^T, where dL/dW' is what the
 * plain model holding the merged weights gives its base weight. An
 * elementwise check, independent of the adapter code's backward, in the
 * modes that take adapters on every projection (centrifuge's backward is
 * linear in the weight gradient as well; centrifuge-kv refuses k/v adapters). */
static int tensor_index(cf_model *m, const char *name) {
    for (int i = 0; i < cf_model_num_tensors(m); i++)
        if (strcmp(cf_model_tensor_name(m, i), name) == 0) return i;
    return -1;
}

TEST(lora_adapter_gradients_equal_the_merged_weight_gradient_through_the_adapter) {
    const char *types[] = {"tiny-llama", "tiny-qwen2", "tiny-qwen3"};
    const cf_mode modes[] = {CF_MODE_REGULAR, CF_MODE_LOSS_ONLY, CF_MODE_CENTRIFUGE};
    char dir[] = "/tmp/cf_test_lora_chain_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    for (int ti = 0; ti < 3; ti++) {
        cf_model *m = lora_model(types[ti], 31 + ti, 0x7f, ti == 1);
        if (!m) { CHECK(0); continue; }
        randomize_weights(m, 41 + ti, 0.3f, 0.2f);
        const cf_lora_opts *lo = cf_model_lora(m);
        double s = lo->rslora ? lo->alpha / sqrt((double)lo->rank) : lo->alpha / (double)lo->rank;
        int32_t tok[B * (S + 1)];
        random_tokens(tok, B * (S + 1), cf_model_config(m)->vocab_size, 51 + ti);
        uint8_t keep[B * S];
        for (int t = 0; t < B * S; t++) keep[t] = (t % 3) != 1;
        float *g[3];
        for (int mi = 0; mi < 3; mi++) g[mi] = run(m, tok, modes[mi], mi ? keep : NULL, 0);
        /* the plain model with W + s B A, through a saved directory as a user would merge */
        char merged[300];
        snprintf(merged, sizeof merged, "%s/%s", dir, types[ti]);
        float *w = malloc(cf_model_num_params(m) * sizeof(float));
        for (int i = 0; i < cf_model_num_tensors(m); i++) cf_model_get_param(m, i, w + toff(m, i));
        CHECK_MSG(cf_model_merge_lora(m) == 0 && cf_model_save(m, merged, "float32", 0) == 0, "%s", cf_last_error());
        cf_model_opts om = {0};
        om.model_dir = merged;
        om.backend = CF_BACKEND_CPU;
        cf_model *mm = cf_model_open(&om);
        CHECK_MSG(mm != NULL, "%s", cf_last_error());
        for (int mi = 0; mi < 3 && mm; mi++) {
            float *dw = run(mm, tok, modes[mi], mi ? keep : NULL, 0);
            int pairs = 0;
            double worst = 0;
            const char *where = "";
            for (int ia = 0; ia < cf_model_num_tensors(m); ia++) {
                const char *an = cf_model_tensor_name(m, ia);
                const char *tail = strstr(an, ".lora_A.weight");
                if (!tail) continue;
                char module[256], bn[300], wn[300];
                snprintf(module, sizeof module, "%.*s", (int)(tail - an), an);
                snprintf(bn, sizeof bn, "%s.lora_B.weight", module);
                snprintf(wn, sizeof wn, "%s.weight", module);
                int ib = tensor_index(m, bn), iw = tensor_index(mm, wn);
                CHECK_MSG(ib >= 0 && iw >= 0, "%s: no %s or %s", an, bn, wn);
                if (ib < 0 || iw < 0) continue;
                size_t r = (size_t)lo->rank, in = cf_model_tensor_numel(m, ia) / r, out = cf_model_tensor_numel(m, ib) / r;
                CHECK_MSG(cf_model_tensor_numel(mm, iw) == out * in, "%s: shape", wn);
                if (cf_model_tensor_numel(mm, iw) != out * in) continue;
                const float *A = w + toff(m, ia), *Bm = w + toff(m, ib), *G = dw + toff(mm, iw);
                float *ea = calloc(r * in, sizeof(float)), *eb = calloc(out * r, sizeof(float));
                for (size_t k = 0; k < r; k++)
                    for (size_t j = 0; j < in; j++) {
                        double acc = 0;   /* dA[k][j] = s sum_o B[o][k] G[o][j] */
                        for (size_t o = 0; o < out; o++) acc += (double)Bm[o * r + k] * G[o * in + j];
                        ea[k * in + j] = (float)(s * acc);
                    }
                for (size_t o = 0; o < out; o++)
                    for (size_t k = 0; k < r; k++) {
                        double acc = 0;   /* dB[o][k] = s sum_j G[o][j] A[k][j] */
                        for (size_t j = 0; j < in; j++) acc += (double)G[o * in + j] * A[k * in + j];
                        eb[o * r + k] = (float)(s * acc);
                    }
                CHECK_MSG(grad_norm(ea, r * in) > 0 && grad_norm(eb, out * r) > 0, "%s: zero expected gradient", module);
                double e = fmax(rel_l2(g[mi] + toff(m, ia), ea, r * in), rel_l2(g[mi] + toff(m, ib), eb, out * r));
                if (!(e <= worst)) { worst = e; where = an; }
                pairs++;
                free(ea);
                free(eb);
            }
            int L = cf_model_config(m)->num_hidden_layers;
            CHECK_MSG(pairs == L * 7, "%s %s: %d adapted modules, want %d", types[ti], cf_mode_name(modes[mi]), pairs, L * 7);
            CHECK_MSG(worst <= 1e-4, "%s %s: %s differs from the chain rule by %.3g", types[ti], cf_mode_name(modes[mi]),
                      where, worst);
            free(dw);
        }
        if (mm) cf_model_free(mm);
        for (int mi = 0; mi < 3; mi++) free(g[mi]);
        free(w);
        cf_model_free(m);
    }
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
}

/* adapter_config.json fields that change what the adapter computes and that
 * this engine does not apply are refused, naming the file and the field:
 * ignored, they would load another model than the adapter describes (a
 * "use_rslora": "true" read as false scales by alpha/r, not alpha/sqrt(r)) */
TEST(adapter_configs_with_features_the_engine_ignores_are_refused_naming_the_field) {
    char dir[] = "/tmp/cf_test_lora_cfg_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char cfgp[300];
    snprintf(cfgp, sizeof cfgp, "%s/adapter_config.json", dir);
    static const struct { const char *extra, *want; } CASES[] = {
        {"", NULL},   /* the plain config reads */
        {", \"modules_to_save\": null, \"rank_pattern\": {}, \"alpha_pattern\": {}, \"layers_to_transform\": null", NULL},
        {", \"use_rslora\": \"true\"", "\"use_rslora\" must be true or false, got a string"},
        {", \"use_dora\": 1", "\"use_dora\" must be true or false, got a number"},
        {", \"modules_to_save\": [\"lm_head\"]", "modules_to_save is not supported"},
        {", \"rank_pattern\": {\"q_proj\": 8}", "rank_pattern is not supported"},
        {", \"alpha_pattern\": {\"q_proj\": 16}", "alpha_pattern is not supported"},
        {", \"layers_to_transform\": [0]", "layers_to_transform is not supported"},
        {", \"lora_bias\": false, \"layer_replication\": null, \"trainable_token_indices\": null, "
         "\"target_parameters\": []", NULL},
        {", \"lora_bias\": true", "lora_bias is not supported"},
        {", \"layer_replication\": [[0, 2]]", "layer_replication is not supported"},
        {", \"trainable_token_indices\": [5, 7]", "trainable_token_indices is not supported"},
        {", \"target_parameters\": [\"mlp.experts.down_proj\"]", "target_parameters is not supported"},
    };
    for (size_t i = 0; i < sizeof CASES / sizeof *CASES; i++) {
        FILE *f = fopen(cfgp, "w");
        if (!f) { CHECK(0); break; }
        fprintf(f, "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"target_modules\": [\"q_proj\"]%s}",
                CASES[i].extra);
        fclose(f);
        cf_lora_opts lo;
        int rc = cf_lora_read_config(dir, &lo);
        if (!CASES[i].want) {
            CHECK_MSG(rc == 0 && lo.rank == 4, "case %zu: %s", i, cf_last_error());
        } else {
            CHECK_MSG(rc != 0 && strstr(cf_last_error(), CASES[i].want) && strstr(cf_last_error(), cfgp),
                      "case %zu: rc %d, '%s'", i, rc, rc ? cf_last_error() : "");
        }
    }
    unlink(cfgp);
    CHECK(rmdir(dir) == 0);
}

int main(void) {
    RUN(lora_adapter_gradients_match_finite_differences_and_base_has_none);
    RUN(lora_centrifuge_equals_stopgrad_reference_and_regular_at_keep_1);
    RUN(fresh_adapters_leave_the_base_losses_unchanged);
    RUN(peft_files_round_trip_and_merge_gives_the_adapted_losses);
    RUN(lora_adapter_gradients_equal_the_merged_weight_gradient_through_the_adapter);
    RUN(adapter_configs_with_features_the_engine_ignores_are_refused_naming_the_field);
    return test_summary();
}
