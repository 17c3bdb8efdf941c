/*
 * test_mode_kv.c — the centrifuge-kv mode (DESIGN §1, "centrifuge-kv") on
 * the CPU backend, for every model_type, per-sequence and per-batch
 * selection, keep 1 / 0.5 / 0.1, one token per sequence and uneven masks
 * (one with a sequence that keeps nothing). A stop-gradient mode has no
 * finite-difference check of its own; it is held to its equivalences:
 *   (a) keep = 1: centrifuge-kv = regular (= centrifuge);
 *   (b) centrifuge-kv = the dense backward with a stop-gradient on the
 *       input of the K/V projections at filtered rows
 *       (cf_backward_reference_stopgrad_kv), every tensor;
 *   (c) every tensor outside the K/V path (k_proj, v_proj weight and bias,
 *       k_norm) has exactly centrifuge's gradient; the K/V-path tensors of
 *       every layer differ from centrifuge's whenever a kept query sees a
 *       filtered key;
 *   (d) in the last layer the K/V-path tensors have loss-only's gradient
 *       (the dense masked-loss gradient, itself checked by finite
 *       differences in test_model.c): centrifuge-kv recovers exactly the
 *       gradient that centrifuge drops there;
 *   (e) embedding rows of tokens seen only at filtered positions get zero
 *       gradient (the filtered rows' residual stream gets nothing).
 * Gradients are compared per tensor (relative L2; an all-zero reference
 * passes only against an all-zero result).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/common.h"
#include "engine/model_internal.h"
#include "model_helpers.h"
#include "test.h"

static const char *TYPES[] = {"tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"};
#define NTYPES 4
enum { B = 2, S = 9, T = B * S };
#define REF_CF ((cf_mode)-1) /* centrifuge's stop-gradient reference */
#define REF_KV ((cf_mode)-2) /* centrifuge-kv's stop-gradient reference */

static double trel(const cf_model *m, int i, const float *a, const float *b) {
    return rel_l2(a + toff(m, i), b + toff(m, i), cf_model_tensor_numel(m, i));
}

/* The tensors that centrifuge-kv's extra gradient reaches: the K and V
 * projections (weight, bias) and the qwen3 k-norm weight of a layer. */
static int is_kv_path(const char *name) {
    return strstr(name, "self_attn.k_proj") || strstr(name, "self_attn.v_proj") || strstr(name, "self_attn.k_norm");
}

static int layer_of(const char *name) {
    const char *p = strstr(name, "layers.");
    return p ? atoi(p + 7) : -1;
}

/* One backward of `mode` (or a reference) on fresh gradients; host grads. */
static float *grads_of(cf_model *m, const int32_t *tok, cf_mode mode, const uint8_t *keep, float *loss) {
    cf_forward(m, tok, B, S, NULL);
    cf_zero_grad(m);
    int rc = 0;
    if (mode == CF_MODE_REGULAR) {
        rc = cf_backward(m, mode, NULL, 1.0f, loss);
    } else {
        cf_kept kept;
        rc = cf_kept_from_mask(m, keep, &kept);
        if (rc == 0) {
            if (mode == REF_CF) rc = cf_backward_reference_stopgrad(m, &kept, 1.0f, loss);
            else if (mode == REF_KV) rc = cf_backward_reference_stopgrad_kv(m, &kept, 1.0f, loss);
            else rc = cf_backward(m, mode, &kept, 1.0f, loss);
        }
    }
    CHECK_MSG(rc == 0, "backward failed: %s", cf_last_error());
    return all_grads(m);
}

/* The masks under test: per sequence and per batch at 1.0, 0.5, 0.1; one
 * token per sequence; uneven 6 and 1; sequence 0 keeps nothing; a single
 * kept token at position 0 (no kept query sees a filtered key). */
static int make_masks(const float *losses, uint8_t masks[][T], char names[][48]) {
    int n = 0;
    const float keeps[] = {1.0f, 0.5f, 0.1f};
    for (int pb = 0; pb < 2; pb++)
        for (int k = 0; k < 3; k++) {
            cf_select(losses, NULL, B, S, keeps[k], CF_SELECT_SELF, pb, 3, masks[n]);
            snprintf(names[n++], 48, "keep %.1f %s", keeps[k], pb ? "per-batch" : "per-seq");
        }
    cf_select(losses, NULL, B, S, 1.0f / S, CF_SELECT_SELF, 0, 3, masks[n]);
    snprintf(names[n++], 48, "one token per sequence");
    memset(masks[n], 0, T);
    for (int s = 0; s < S; s++) masks[n][s] = s % 3 != 1;     /* 6 of 9 kept */
    masks[n][S + 4] = 1;                                       /* 1 of 9 kept */
    snprintf(names[n++], 48, "uneven 6 and 1");
    memset(masks[n], 0, T);
    for (int s = 0; s < S; s++) masks[n][S + s] = s % 2 == 0;  /* sequence 0 keeps nothing */
    snprintf(names[n++], 48, "sequence 0 keeps 0");
    memset(masks[n], 0, T);
    masks[n][0] = 1;                                           /* only row 0: sees itself */
    snprintf(names[n++], 48, "row 0 only");
    return n;
}

/* Does some kept query see a filtered key (same sequence, earlier)? */
static int kept_sees_filtered(const uint8_t *keep) {
    for (int b = 0; b < B; b++) {
        int filtered_before = 0;
        for (int s = 0; s < S; s++) {
            if (keep[b * S + s] && filtered_before) return 1;
            if (!keep[b * S + s]) filtered_before = 1;
        }
    }
    return 0;
}

TEST(centrifuge_kv_equivalences_hold_for_every_model_type_and_mask) {
    for (int ti = 0; ti < NTYPES; ti++) {
        cf_model *m = make_model(TYPES[ti], 131 + ti);
        if (!m) { CHECK(0); continue; }
        const int L = cf_model_config(m)->num_hidden_layers;
        int32_t tok[B * (S + 1)];
        random_tokens(tok, B * (S + 1), cf_model_config(m)->vocab_size, 400 + ti);
        float losses[T];
        cf_forward(m, tok, B, S, losses);
        uint8_t masks[12][T];
        char names[12][48];
        int nm = make_masks(losses, masks, names);
        float *reg = grads_of(m, tok, CF_MODE_REGULAR, NULL, NULL);
        int zero_rows_checked = 0;   /* (e) must not pass by checking no row */
        for (int k = 0; k < nm; k++) {
            const uint8_t *keep = masks[k];
            int nkept = 0;
            for (int t = 0; t < T; t++) nkept += keep[t];
            const char *lbl = names[k], *ty = TYPES[ti], *where = "";
            float l_kv, l_lo, l_cf, l_ref;
            float *kv = grads_of(m, tok, CF_MODE_CENTRIFUGE_KV, keep, &l_kv);
            float *ref = grads_of(m, tok, REF_KV, keep, &l_ref);
            float *cf = grads_of(m, tok, CF_MODE_CENTRIFUGE, keep, &l_cf);
            float *lo = grads_of(m, tok, CF_MODE_LOSS_ONLY, keep, &l_lo);
            float *rcf = grads_of(m, tok, REF_CF, keep, NULL);
            /* (b)-(d) compare per tensor, where zero against zero passes:
             * the references must carry gradient in every tensor. Not with
             * row 0 alone kept: its query sees only its own key, so q, k and
             * the q/k norms get nothing */
            const char *zero = "";
            if (kept_sees_filtered(keep) || nkept == T) {
                CHECK_MSG(every_tensor_nonzero(m, ref, &zero), "%s %s: reference gradient of %s is all zero", ty, lbl,
                          zero);
                CHECK_MSG(every_tensor_nonzero(m, lo, &zero), "%s %s: loss-only gradient of %s is all zero", ty, lbl,
                          zero);
            }
            /* the differentiated loss is the kept mean in every mode */
            CHECK_CLOSE(l_kv, l_lo, 1e-6);
            CHECK_CLOSE(l_kv, l_cf, 1e-6);
            CHECK_CLOSE(l_ref, l_lo, 1e-6);
            /* (a) keep = 1: centrifuge-kv = regular */
            if (nkept == T) {
                double e = max_rel(m, kv, reg, &where);
                CHECK_MSG(e < 1e-5, "%s %s: centrifuge-kv vs regular %.3g (%s)", ty, lbl, e, where);
            }
            /* (b) centrifuge-kv = the dense stop-gradient-at-the-K/V-input reference */
            double eb = max_rel(m, kv, ref, &where);
            CHECK_MSG(eb < 1e-5, "%s %s: centrifuge-kv vs its stop-grad reference %.3g (%s)", ty, lbl, eb, where);
            /* the two references differ exactly where the modes do */
            int sees = kept_sees_filtered(keep);
            for (int i = 0; i < cf_model_num_tensors(m); i++) {
                const char *name = cf_model_tensor_name(m, i);
                int kvp = is_kv_path(name);
                double d = trel(m, i, kv, cf);
                if (!kvp) {
                    /* (c) outside the K/V path: centrifuge's gradient exactly */
                    CHECK_MSG(d <= 1e-6, "%s %s: %s differs from centrifuge by %.3g", ty, lbl, name, d);
                } else if (sees) {
                    /* (c) the K/V path gets the filtered keys' terms */
                    CHECK_MSG(d > 1e-4, "%s %s: %s equals centrifuge's (%.3g)", ty, lbl, name, d);
                    double dr = trel(m, i, ref, rcf);
                    CHECK_MSG(dr > 1e-4, "%s %s: %s: the two references agree (%.3g)", ty, lbl, name, dr);
                } else {
                    /* no kept query sees a filtered key: nothing to add. 1e-5,
                     * not 1e-6: centrifuge runs q/k/v as one GEMM with one bias
                     * column sum (backward.c, qkv_fused_bwd), centrifuge-kv
                     * apart (dk, dv of every row), so fp32 sums differ in order
                     * (seen: 1.2e-6 on qwen2's k bias); a missed term is > 1e-4 */
                    CHECK_MSG(d <= 1e-5, "%s %s: %s differs from centrifuge by %.3g with no filtered key seen", ty,
                              lbl, name, d);
                }
                /* (d) last layer: the K/V path has loss-only's (dense) gradient */
                if (kvp && layer_of(name) == L - 1) {
                    double e = trel(m, i, kv, lo);
                    CHECK_MSG(e < 1e-5, "%s %s: last-layer %s vs loss-only %.3g", ty, lbl, name, e);
                }
            }
            /* (e) filtered-only tokens: zero embedding gradient (untied) */
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
                        for (int c = 0; c < C; c++) allzero &= kv[toff(m, 0) + (size_t)v * C + c] == 0.0f;
                        CHECK_MSG(allzero, "%s %s: embedding row %d (filtered only) has gradient", ty, lbl, v);
                    }
                }
            }
            free(kv); free(ref); free(cf); free(lo); free(rcf);
        }
        if (!cf_model_config(m)->tie_word_embeddings)
            CHECK_MSG(zero_rows_checked > 0, "%s: no embedding row of a filtered-only token was checked", TYPES[ti]);
        free(reg);
        cf_model_free(m);
    }
}

/* On the CPU the tensors outside the K/V path are not only close to
 * centrifuge's: the same ops run on the same rows, so they are bitwise equal. */
TEST(centrifuge_kv_leaves_every_other_gradient_bitwise_equal_to_centrifuge) {
    cf_model *m = make_model("tiny-qwen3", 151);
    if (!m) { CHECK(0); return; }
    int32_t tok[B * (S + 1)];
    random_tokens(tok, B * (S + 1), cf_model_config(m)->vocab_size, 151);
    float losses[T];
    uint8_t keep[T];
    cf_forward(m, tok, B, S, losses);
    cf_select(losses, NULL, B, S, 0.5, CF_SELECT_SELF, 1, 1, keep);
    float *kv = grads_of(m, tok, CF_MODE_CENTRIFUGE_KV, keep, NULL);
    float *cf = grads_of(m, tok, CF_MODE_CENTRIFUGE, keep, NULL);
    for (int i = 0; i < cf_model_num_tensors(m); i++) {
        const char *name = cf_model_tensor_name(m, i);
        if (is_kv_path(name)) continue;
        CHECK_MSG(memcmp(kv + toff(m, i), cf + toff(m, i), cf_model_tensor_numel(m, i) * sizeof(float)) == 0,
                  "%s: not bitwise equal to centrifuge", name);
    }
    free(kv); free(cf);
    cf_model_free(m);
}

TEST(centrifuge_kv_equals_its_reference_with_a_document_mask) {
    const char *types[] = {"tiny-llama", "tiny-qwen3"};
    for (int ti = 0; ti < 2; ti++) {
        cf_model *m = make_model(types[ti], 161 + ti);
        if (!m) { CHECK(0); continue; }
        cf_model_set_doc_mask(m, 5);
        int32_t tok[B * (S + 1)];
        two_document_tokens(tok, B, S, cf_model_config(m)->vocab_size, 5, 660 + ti);
        float losses[T];
        uint8_t keep[T];
        CHECK(cf_forward(m, tok, B, S, losses) == 0);
        cf_select(losses, NULL, B, S, 0.5, CF_SELECT_SELF, 0, 1, keep);
        float *kv = grads_of(m, tok, CF_MODE_CENTRIFUGE_KV, keep, NULL);
        float *ref = grads_of(m, tok, REF_KV, keep, NULL);
        const char *where = "";
        double e = max_rel(m, kv, ref, &where);
        CHECK_MSG(e < 1e-5, "%s: centrifuge-kv vs reference with doc mask %.3g (%s)", types[ti], e, where);
        free(kv); free(ref);
        cf_model_free(m);
    }
}

/* The trainer's step in centrifuge-kv over two micro-batches of one
 * sequence equals one micro-batch of both (the loss is normalised over the
 * whole step), and a few steps on a repeated batch lower the loss. */
TEST(centrifuge_kv_trains_through_the_trainer_with_gradient_accumulation) {
    cf_model *a = make_model("tiny-qwen2", 171), *b = make_model("tiny-qwen2", 171);
    if (!a || !b) { CHECK(0); cf_model_free(a); cf_model_free(b); return; }
    int32_t tok[B * (S + 1)];
    random_tokens(tok, B * (S + 1), cf_model_config(a)->vocab_size, 172);
    cf_train_opts o = {0};
    o.mode = CF_MODE_CENTRIFUGE_KV;
    o.select = (cf_select_opts){CF_SELECT_SELF, 0.5, 0, 1};
    o.adamw = (cf_adamw_params){1e-2f, 0.9f, 0.95f, 1e-3f, 0.1f, 1.0f};
    o.batch = B; o.seq = S; o.grad_accum = 1;
    cf_trainer *ta = cf_trainer_create(a, &o);
    o.batch = 1; o.grad_accum = B;
    cf_trainer *tb = cf_trainer_create(b, &o);
    CHECK(ta && tb);
    if (!ta || !tb) { cf_trainer_free(ta); cf_trainer_free(tb); cf_model_free(a); cf_model_free(b); return; }
    cf_micro_batch whole = {tok, NULL}, parts[B];
    for (int i = 0; i < B; i++) { parts[i].tokens = tok + i * (S + 1); parts[i].ref = NULL; }
    cf_step_stats sa, sb;
    CHECK(cf_trainer_step(ta, &whole, 1e-2f, &sa) == 0);
    CHECK(cf_trainer_step(tb, parts, 1e-2f, &sb) == 0);
    CHECK_CLOSE(sa.loss, sb.loss, 1e-6);
    CHECK_CLOSE(sa.grad_norm, sb.grad_norm, 1e-5);
    CHECK(sa.kept == sb.kept && sa.tokens == sb.tokens && !sa.skipped);
    float first = sa.loss, last = sa.loss;
    for (int step = 0; step < 30; step++) {
        CHECK(cf_trainer_step(ta, &whole, 3e-3f, &sa) == 0);
        last = sa.loss;
    }
    CHECK_MSG(last < 0.7f * first, "centrifuge-kv training: loss %g -> %g", first, last);
    cf_trainer_free(ta); cf_trainer_free(tb);
    cf_model_free(a); cf_model_free(b);
}

/* With the K projection frozen, centrifuge-kv still adds the filtered
 * keys' terms to V (and nothing else changes). */
TEST(centrifuge_kv_with_a_frozen_k_projection_updates_v_only) {
    cf_model_opts o = {0};
    o.config = "tiny-llama";
    o.backend = CF_BACKEND_CPU;
    o.seed = 181;
    o.freeze = "self_attn.k_proj";
    cf_model *m = cf_model_open(&o);
    CHECK_MSG(m != NULL, "%s", cf_last_error());
    if (!m) return;
    int32_t tok[B * (S + 1)];
    random_tokens(tok, B * (S + 1), cf_model_config(m)->vocab_size, 181);
    float losses[T];
    uint8_t keep[T];
    cf_forward(m, tok, B, S, losses);
    cf_select(losses, NULL, B, S, 0.5, CF_SELECT_SELF, 0, 1, keep);
    float *kv = grads_of(m, tok, CF_MODE_CENTRIFUGE_KV, keep, NULL);
    float *ref = grads_of(m, tok, REF_KV, keep, NULL);
    float *cf = grads_of(m, tok, CF_MODE_CENTRIFUGE, keep, NULL);
    for (int i = 0; i < cf_model_num_tensors(m); i++) {
        const char *name = cf_model_tensor_name(m, i);
        if (!cf_model_tensor_trainable(m, i)) { CHECK(strstr(name, "k_proj") != NULL); continue; }
        CHECK_MSG(trel(m, i, kv, ref) < 1e-5, "%s: vs reference %.3g", name, trel(m, i, kv, ref));
        if (strstr(name, "v_proj")) CHECK_MSG(trel(m, i, kv, cf) > 1e-4, "%s: equals centrifuge's", name);
        else CHECK_MSG(trel(m, i, kv, cf) <= 1e-6, "%s: differs from centrifuge", name);
    }
    free(kv); free(ref); free(cf);
    cf_model_free(m);
}

/* LoRA: adapters on k_proj/v_proj are refused (their filtered-row gradient
 * would need the adapter's input of every row); with adapters elsewhere the
 * frozen K/V projections take no gradient, so centrifuge-kv is centrifuge. */
TEST(centrifuge_kv_refuses_lora_on_k_or_v_and_equals_centrifuge_with_lora_elsewhere) {
    const unsigned targets[] = {CF_LORA_K, CF_LORA_V | CF_LORA_O, CF_LORA_Q | CF_LORA_O | CF_LORA_UP};
    for (int c = 0; c < 3; c++) {
        cf_model_opts o = {0};
        o.config = "tiny-qwen2";
        o.backend = CF_BACKEND_CPU;
        o.seed = 201 + c;
        o.lora = (cf_lora_opts){4, 8.0f, targets[c], 0.0f, 0};
        cf_model *m = cf_model_open(&o);
        CHECK_MSG(m != NULL, "%s", cf_last_error());
        if (!m) continue;
        /* non-zero B, so the adapters carry gradient */
        cf_rng r;
        cf_rng_seed(&r, 201 + c);
        for (int i = 0; i < cf_model_num_tensors(m); i++) {
            size_t n = cf_model_tensor_numel(m, i);
            float *w = malloc(n * sizeof(float));
            cf_model_get_param(m, i, w);
            for (size_t j = 0; j < n; j++) w[j] += 0.1f * cf_rng_normal(&r);
            cf_model_set_param(m, i, w);
            free(w);
        }
        int32_t tok[B * (S + 1)];
        random_tokens(tok, B * (S + 1), cf_model_config(m)->vocab_size, 201 + c);
        float losses[T];
        uint8_t keep[T];
        cf_forward(m, tok, B, S, losses);
        cf_select(losses, NULL, B, S, 0.5, CF_SELECT_SELF, 0, 1, keep);
        cf_kept kept;
        CHECK(cf_kept_from_mask(m, keep, &kept) == 0);
        cf_zero_grad(m);
        int rc = cf_backward(m, CF_MODE_CENTRIFUGE_KV, &kept, 1.0f, NULL);
        if (c < 2) {
            CHECK(rc != 0);
            CHECK_MSG(strstr(cf_last_error(), "LoRA") != NULL, "%s", cf_last_error());
        } else {
            CHECK_MSG(rc == 0, "%s", cf_last_error());
            float *kv = grads_of(m, tok, CF_MODE_CENTRIFUGE_KV, keep, NULL);
            float *cf = grads_of(m, tok, CF_MODE_CENTRIFUGE, keep, NULL);
            const char *where = "";
            double e = max_rel(m, kv, cf, &where);
            CHECK_MSG(e == 0, "LoRA q,o,up: centrifuge-kv differs from centrifuge by %.3g (%s)", e, where);
            /* equal as zeros would prove nothing: every adapter has gradient */
            CHECK_MSG(every_tensor_nonzero(m, cf, &where), "LoRA q,o,up: centrifuge gradient of %s is all zero", where);
            free(kv); free(cf);
        }
        cf_model_free(m);
    }
}

TEST(centrifuge_kv_is_a_compact_mode_with_a_name) {
    cf_mode md;
    CHECK(cf_mode_parse("centrifuge-kv", &md) == 0 && md == CF_MODE_CENTRIFUGE_KV);
    CHECK(strcmp(cf_mode_name(CF_MODE_CENTRIFUGE_KV), "centrifuge-kv") == 0);
    CHECK(cf_mode_is_compact(CF_MODE_CENTRIFUGE_KV));
    CHECK(cf_mode_parse("centrifuge-kvx", &md) != 0);
    CHECK(strstr(cf_last_error(), "centrifuge-kv") != NULL);
    /* it needs kept rows, like centrifuge */
    cf_model *m = make_model("tiny-llama", 191);
    if (!m) { CHECK(0); return; }
    int32_t tok[B * (S + 1)];
    random_tokens(tok, B * (S + 1), cf_model_config(m)->vocab_size, 191);
    CHECK(cf_forward(m, tok, B, S, NULL) == 0);
    CHECK(cf_backward(m, CF_MODE_CENTRIFUGE_KV, NULL, 1.0f, NULL) != 0);
    cf_model_free(m);
}

int main(void) {
    RUN(centrifuge_kv_is_a_compact_mode_with_a_name);
    RUN(centrifuge_kv_equivalences_hold_for_every_model_type_and_mask);
    RUN(centrifuge_kv_leaves_every_other_gradient_bitwise_equal_to_centrifuge);
    RUN(centrifuge_kv_equals_its_reference_with_a_document_mask);
    RUN(centrifuge_kv_trains_through_the_trainer_with_gradient_accumulation);
    RUN(centrifuge_kv_with_a_frozen_k_projection_updates_v_only);
    RUN(centrifuge_kv_refuses_lora_on_k_or_v_and_equals_centrifuge_with_lora_elsewhere);
    return test_summary();
}
