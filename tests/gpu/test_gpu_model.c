/*
 * test_gpu_model.c — the whole model on the CUDA backend against the CPU
 * backend (fp32 reference), and DESIGN §1's equivalences on the GPU.
 *
 * Tolerances (bf16 activations and weights, fp32 accumulation):
 *   per-token losses: |gpu - cpu| <= 3e-2 + 1e-2 |cpu|
 *   gradients, per tensor: ||gpu - cpu|| / ||cpu|| <= 5e-2 (biases 1e-1)
 *   GPU-vs-GPU equivalences: same bound 3e-2 (the paths differ only in
 *   summation order and bf16 rounding of intermediates)
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cuda/context.h"
#include "base/common.h"
#include "engine/model_internal.h"
#include "model_helpers.h"
#include "test.h"

static const char *TYPES[] = {"tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny"};
#define NTYPES 5
/* S = 256: several attention tiles per sequence (64-row tiles), so the
 * centrifuge backward's tile walk over kept rows is exercised. The first
 * test also runs at S0 = 40 with the tolerances it has always had. */
enum { B = 2, S = 256, S0 = 40 };


static void copy_weights(cf_model *dst, cf_model *src) {
    for (int i = 0; i < cf_model_num_tensors(src); i++) {
        size_t n = cf_model_tensor_numel(src, i);
        float *w = malloc(n * sizeof(float));
        cf_model_get_param(src, i, w);
        cf_model_set_param(dst, i, w);
        free(w);
    }
}

static cf_model *cpu_model(const char *name, uint64_t seed) {
    cf_config c;
    if (cf_config_builtin(&c, name) != 0) return NULL;
    cf_model *m = cf_model_create(&c, CF_BACKEND_CPU, seed);
    if (!m) return NULL;
    /* weights larger than the init, so gradients carry signal */
    cf_rng r;
    cf_rng_seed(&r, seed + 5);
    for (int i = 0; i < cf_model_num_tensors(m); i++) {
        size_t n = cf_model_tensor_numel(m, i);
        float *w = malloc(n * sizeof(float));
        cf_model_get_param(m, i, w);
        /* std 0.85/sqrt(fan_in): the same per-layer gain at every width
         * (0.15 at the tiny-* width 32), so bf16 error does not grow with C */
        float std = 0.85f / sqrtf((float)m->params[i].shape[m->params[i].ndim == 2 ? 1 : 0]);
        for (size_t j = 0; j < n; j++) w[j] = m->params[i].ndim == 2 ? std * cf_rng_normal(&r) : w[j] + 0.1f * cf_rng_normal(&r);
        cf_model_set_param(m, i, w);
        free(w);
    }
    return m;
}


/* per-tensor relative L2 error ||a - ref|| / ||ref||, the worst over tensors
 * (METHOD: bf16 operands land between 1e-3 and 1e-2 per op; two layers of
 * bf16 activations in the backward stay under a few percent) */
static double worst_tensor_err(cf_model *m, const float *a, const float *ref, const char **which) {
    double worst = 0;
    for (int i = 0; i < cf_model_num_tensors(m); i++) {
        const float *x = a + toff(m, i), *y = ref + toff(m, i);
        double num = 0, den = 1e-30;
        for (size_t j = 0; j < cf_model_tensor_numel(m, i); j++) {
            double d = (double)x[j] - y[j];
            num += d * d;
            den += (double)y[j] * y[j];
        }
        double e = isfinite(num) ? sqrt(num / den) : INFINITY;
        if (e > worst) { worst = e; *which = m->params[i].name; }
    }
    return worst;
}

/* A forward marked as followed by its backward, as the trainer's: with
 * head_save (the default) the LM head keeps g and the backward uses it. */
static float *run_s(cf_model *m, const int32_t *tok, int Sq, cf_mode mode, const uint8_t *keep, int stopgrad,
                    float *losses) {
    m->bwd_follows = 1;
    cf_forward(m, tok, B, Sq, losses);
    m->bwd_follows = 0;
    CHECK(m->head_g_fwd == (m->head_save ? m->fwd_id : 0));
    cf_zero_grad(m);
    int rc = backward_with_mask(m, mode, keep, stopgrad);
    CHECK_MSG(rc == 0, "backward: %s", cf_last_error());
    CHECK(m->head_g_fwd == 0);
    return all_grads(m);
}

static float *run(cf_model *m, const int32_t *tok, cf_mode mode, const uint8_t *keep, int stopgrad, float *losses) {
    return run_s(m, tok, S, mode, keep, stopgrad, losses);
}

/* Losses: |gpu - cpu| <= ltol + 1e-2 |cpu|. At S = 256 the bf16 error of
 * the longer softmax sums adds up: ltol 5e-2 there (seen: 0.030 for qwen3,
 * whose q/k norms amplify it), 3e-2 at S = 40 as before. fused = 0: the
 * GPU model with CF_FUSED_PROJ=0 (separate q/k/v and gate/up GEMMs); else
 * the default, checked to fuse q/k/v (but with qwen3's
 * q/k norms) and gate/up in every layer, so the fused ops run here.
 * head_save = 0: the GPU model with CF_HEAD_SAVE=0 (its LM head backward
 * recomputes the logits); else the default, the forward keeping g. */
static void model_matches_cpu(int Sq, double ltol, int fused, int head_save) {
    for (int ti = 0; ti < NTYPES; ti++) {
        cf_model *mc = cpu_model(TYPES[ti], 11 + ti);
        if (!fused) setenv("CF_FUSED_PROJ", "0", 1);
        if (!head_save) setenv("CF_HEAD_SAVE", "0", 1);
        cf_model *mg = mc ? cf_model_create(cf_model_config(mc), CF_BACKEND_CUDA, 1) : NULL;
        unsetenv("CF_FUSED_PROJ");
        unsetenv("CF_HEAD_SAVE");
        CHECK_MSG(mc && mg, "%s: %s", TYPES[ti], cf_last_error());
        if (!mc || !mg) { cf_model_free(mc); cf_model_free(mg); continue; }
        CHECK(mg->head_save == head_save);
        const cf_config *cc = cf_model_config(mc);
        for (int l = 0; l < cc->num_hidden_layers; l++)
            CHECK_MSG(mg->lp[l].fused_qkv == (fused && !cc->qk_norm) &&
                          mg->lp[l].fused_gate_up == fused,
                      "%s layer %d: fused q/k/v %d, gate/up %d", TYPES[ti], l, mg->lp[l].fused_qkv,
                      mg->lp[l].fused_gate_up);
        copy_weights(mg, mc);
        int V = cf_model_config(mc)->vocab_size;
        int32_t tok[B * (S + 1)];   /* room for the longest */
        cf_rng r;
        cf_rng_seed(&r, 77 + ti);
        for (int i = 0; i < B * (Sq + 1); i++) tok[i] = (int32_t)cf_rng_below(&r, (uint32_t)V);
        float lc[B * S], lg[B * S];
        uint8_t keep[B * S];
        cf_forward(mc, tok, B, Sq, lc);
        cf_select(lc, NULL, B, Sq, 0.5f, CF_SELECT_SELF, 0, 1, keep);
        /* uneven per-sequence counts: sequence 1 loses Sq/7 of its kept rows */
        for (int t = Sq, dropped = 0; t < 2 * Sq && dropped < Sq / 7; t++)
            if (keep[t]) { keep[t] = 0; dropped++; }
        const cf_mode modes[] = {CF_MODE_REGULAR, CF_MODE_LOSS_ONLY, CF_MODE_CENTRIFUGE, CF_MODE_STRAWMAN};
        for (int mi = 0; mi < 4; mi++) {
            float *gc = run_s(mc, tok, Sq, modes[mi], mi ? keep : NULL, 0, lc);
            float *gg = run_s(mg, tok, Sq, modes[mi], mi ? keep : NULL, 0, lg);
            /* worst_tensor_err passes a tensor that is zero on both sides */
            const char *zero = "";
            CHECK_MSG(every_tensor_nonzero(mc, gc, &zero), "%s %s: CPU gradient of %s is all zero", TYPES[ti],
                      cf_mode_name(modes[mi]), zero);
            double lerr = 0;
            for (int t = 0; t < B * Sq; t++) lerr = fmax(lerr, fabs(lg[t] - lc[t]) - 1e-2 * fabs(lc[t]));
            CHECK_MSG(lerr <= ltol, "%s %s: loss differs by %.3g", TYPES[ti], cf_mode_name(modes[mi]), lerr);
            const char *which = "";
            double gerr = worst_tensor_err(mc, gg, gc, &which);
            /* a bias gradient is a column sum of bf16 dq/dk/dv over all rows, with
             * cancellation: its relative error is larger than the rows' (seen:
             * 0.060 for a k_proj bias while every matrix stayed under 0.045) */
            double tol = strstr(which, ".bias") ? 1e-1 : 5e-2;
            CHECK_MSG(gerr <= tol, "%s %s: gradient of %s differs by %.3g", TYPES[ti], cf_mode_name(modes[mi]), which, gerr);
            printf("    S=%-4d %-12s %-10s loss err %.2e, worst grad err %.2e (%s)\n", Sq, TYPES[ti], cf_mode_name(modes[mi]), lerr, gerr, which);
            free(gc); free(gg);
        }
        cf_model_free(mc);
        cf_model_free(mg);
    }
}

TEST(gpu_model_losses_and_gradients_match_cpu_in_every_mode) { model_matches_cpu(S0, 3e-2, 1, 1); }

TEST(gpu_model_with_unfused_projections_matches_cpu_in_every_mode) { model_matches_cpu(S0, 3e-2, 0, 1); }

TEST(gpu_model_recomputing_the_lm_head_logits_matches_cpu_in_every_mode) { model_matches_cpu(S0, 3e-2, 1, 0); }

TEST(gpu_model_matches_cpu_over_several_attention_tiles_with_uneven_kept_counts) { model_matches_cpu(S, 5e-2, 1, 1); }

TEST(gpu_equivalences_of_design_section_1_hold_with_bf16_tolerances) {
    for (int ti = 0; ti < NTYPES; ti++) {
        cf_model *mc = cpu_model(TYPES[ti], 21 + ti);
        cf_model *m = mc ? cf_model_create(cf_model_config(mc), CF_BACKEND_CUDA, 1) : NULL;
        if (!m) { CHECK(0); cf_model_free(mc); continue; }
        copy_weights(m, mc);
        cf_model_free(mc);
        const cf_config *c = cf_model_config(m);
        int32_t tok[B * (S + 1)];
        cf_rng r;
        cf_rng_seed(&r, 99 + ti);
        for (int i = 0; i < B * (S + 1); i++) tok[i] = (int32_t)cf_rng_below(&r, (uint32_t)c->vocab_size);
        float l[B * S];
        cf_forward(m, tok, B, S, l);
        const char *which = "";
        float *reg = run(m, tok, CF_MODE_REGULAR, NULL, 0, l);
        CHECK_MSG(every_tensor_nonzero(m, reg, &which), "%s: regular gradient of %s is all zero", TYPES[ti], which);
        /* 1. keep = 1 */
        uint8_t all[B * S];
        memset(all, 1, sizeof all);
        float *lo1 = run(m, tok, CF_MODE_LOSS_ONLY, all, 0, l);
        float *cf1 = run(m, tok, CF_MODE_CENTRIFUGE, all, 0, l);
        CHECK_MSG(worst_tensor_err(m, lo1, reg, &which) < 3e-2, "%s keep=1 loss-only vs regular (%s)", TYPES[ti], which);
        CHECK_MSG(worst_tensor_err(m, cf1, reg, &which) < 3e-2, "%s keep=1 centrifuge vs regular (%s)", TYPES[ti], which);
        const float keeps[] = {0.5f, 0.1f, 1.0f / S};
        for (int k = 0; k < 3; k++)
            for (int pb = 0; pb < 2; pb++) {
                uint8_t keep[B * S];
                cf_select(l, NULL, B, S, keeps[k], CF_SELECT_SELF, pb, 3, keep);
                float *cf = run(m, tok, CF_MODE_CENTRIFUGE, keep, 0, l);
                float *sg = run(m, tok, CF_MODE_LOSS_ONLY, keep, 1, l);
                float *sw = run(m, tok, CF_MODE_STRAWMAN, keep, 0, l);
                /* 2. centrifuge = dense backward with stop-gradient on filtered K/V */
                double e = worst_tensor_err(m, cf, sg, &which);
                CHECK_MSG(e < 3e-2, "%s keep %.3f%s: centrifuge vs stop-grad reference %.3g (%s)", TYPES[ti], keeps[k], pb ? " per-batch" : "", e, which);
                /* 4. exact zeros for embedding rows of filtered-only tokens (untied) */
                if (!c->tie_word_embeddings) {
                    for (int v = 0; v < c->vocab_size; v++) {
                        int kept = 0, filt = 0;
                        for (int b = 0; b < B; b++)
                            for (int s = 0; s < S; s++)
                                if (tok[b * (S + 1) + s] == v) { if (keep[b * S + s]) kept = 1; else filt = 1; }
                        if (!filt || kept) continue;
                        int zero = 1;
                        for (int j = 0; j < c->hidden_size; j++) zero &= cf[toff(m, 0) + (size_t)v * c->hidden_size + j] == 0.0f;
                        CHECK_MSG(zero, "%s: embedding row %d of a filtered-only token has gradient", TYPES[ti], v);
                    }
                }
                /* 5. strawman differs from centrifuge */
                int nk = 0;
                for (int t = 0; t < B * S; t++) nk += keep[t];
                if (nk > B) CHECK_MSG(worst_tensor_err(m, sw, cf, &which) > 5e-2, "%s: strawman equals centrifuge", TYPES[ti]);
                free(cf); free(sg); free(sw);
            }
        free(reg); free(lo1); free(cf1);
        cf_model_free(m);
    }
}

TEST(gpu_batched_filter_gather_equals_per_tensor_gather) {
    cf_backend *g = cf_backend_cuda_create(0);
    if (!g) { CHECK(0); return; }
    CHECK(g->gather_rows_multi != NULL);
    enum { T = 300, K = 5 };
    const size_t rb[K] = {4, 12, 64, 4096, 11264};
    int rows[T / 2], n = 0;
    for (int t = 0; t < T; t++) if (t % 3 != 1 && n < T / 2) rows[n++] = t;
    int *drows = g->alloc(g, sizeof rows);
    g->upload(g, drows, rows, sizeof rows);
    void *src[K], *dst[K];
    unsigned char *host[K];
    cf_rng r;
    cf_rng_seed(&r, 5);
    for (int k = 0; k < K; k++) {
        host[k] = malloc(T * rb[k]);
        for (size_t i = 0; i < T * rb[k]; i++) host[k][i] = (unsigned char)cf_rng_below(&r, 256);
        src[k] = g->alloc(g, T * rb[k]);
        dst[k] = g->alloc(g, T * rb[k]);
        g->upload(g, src[k], host[k], T * rb[k]);
        g->memzero(g, dst[k], T * rb[k]);
    }
    g->gather_rows_multi(g, K, dst, (const void *const *)src, rb, drows, n);
    for (int k = 0; k < K; k++) {
        unsigned char *out = malloc(T * rb[k]);
        g->download(g, out, dst[k], (size_t)n * rb[k]);
        int ok = 1;
        for (int i = 0; i < n; i++) ok &= memcmp(out + i * rb[k], host[k] + (size_t)rows[i] * rb[k], rb[k]) == 0;
        CHECK_MSG(ok, "tensor %d (row %zu bytes) gathered wrong", k, rb[k]);
        free(out); free(host[k]);
        g->free(g, src[k]); g->free(g, dst[k]);
    }
    g->free(g, drows);
    g->destroy(g);
}

TEST(gpu_adamw_refreshes_bf16_weights_and_zeroes_gradients_in_one_pass_unless_kept) {
    cf_backend *g = cf_backend_cuda_create(0);
    if (!g) { CHECK(0); return; }
    enum { N = 1030 };   /* not a multiple of 4 for the tail: scalar path via odd offset below */
    float p[N], gr[N], z[N], pw[N], wf[N];
    cf_rng r;
    cf_rng_seed(&r, 9);
    for (int i = 0; i < N; i++) { p[i] = cf_rng_normal(&r); gr[i] = cf_rng_normal(&r); z[i] = 0; }
    float *dp = g->alloc(g, sizeof p), *dg = g->alloc(g, sizeof gr), *dm = g->alloc(g, sizeof z), *dv = g->alloc(g, sizeof z);
    void *dw = g->alloc(g, N * g->act_size);
    g->upload(g, dp, p, sizeof p); g->upload(g, dg, gr, sizeof gr);
    g->upload(g, dm, z, sizeof z); g->upload(g, dv, z, sizeof z);
    g->adamw(g, dp, dw, dg, dm, dv, 1024, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f, 1, 0);           /* vector path */
    g->adamw(g, dp + 1025, (char *)dw + 1025 * g->act_size, dg + 1025, dm + 1025, dv + 1025, 5, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f, 1, 0); /* scalar */
    g->download(g, pw, dp, sizeof p);
    g->act_to_f32(g, wf, dw, N);
    g->download(g, gr, dg, sizeof gr);
    int ok_w = 1, ok_g = 1;
    for (int i = 0; i < N; i++) {
        if (i == 1024) continue;   /* untouched */
        ok_w &= fabsf(wf[i] - pw[i]) <= 4e-3f * fabsf(pw[i]) + 1e-30f;
        ok_g &= gr[i] == 0.0f;
    }
    CHECK_MSG(ok_w, "compute copy is not bf16(master)");
    CHECK_MSG(ok_g, "gradients not zeroed");
    /* CF_ADAMW_KEEP_GRAD: the gradients are left as they were, both paths */
    for (int i = 0; i < N; i++) gr[i] = cf_rng_normal(&r);
    g->upload(g, dg, gr, sizeof gr);
    g->adamw(g, dp, dw, dg, dm, dv, 1024, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f, 2, CF_ADAMW_KEEP_GRAD);
    g->adamw(g, dp + 1025, (char *)dw + 1025 * g->act_size, dg + 1025, dm + 1025, dv + 1025, 5, 1e-2f, 0.9f, 0.95f,
             1e-8f, 0.1f, 1.0f, 2, CF_ADAMW_KEEP_GRAD);
    g->download(g, pw, dg, sizeof gr);
    CHECK_MSG(memcmp(pw, gr, sizeof gr) == 0, "KEEP_GRAD changed the gradients");
    g->free(g, dp); g->free(g, dg); g->free(g, dm); g->free(g, dv); g->free(g, dw);
    g->destroy(g);
}

/* Two GPU models with mc's weights trained in lockstep by the trainer
 * (mode, keep, mb micro-batches of one sequence of S rows, three steps):
 * losses, gradient norms (a lost or doubled row moves them by far more)
 * and the weights after each step must agree to summation order through
 * bf16 (1e-3). after_step, if set, runs on model a after each step. */
static void lockstep_steps(const char *what, cf_model *a, cf_model *b, cf_model *mc, cf_mode mode, double keep,
                           int mb, uint32_t seed, void (*after_step)(const char *, cf_model *, int)) {
    copy_weights(a, mc);
    copy_weights(b, mc);
    cf_train_opts o = {0};
    o.mode = mode;
    o.select = (cf_select_opts){CF_SELECT_SELF, keep, 0, 1};
    o.adamw = (cf_adamw_params){1e-2f, 0.9f, 0.95f, 1e-3f, 0.1f, 1.0f};
    o.batch = 1; o.seq = S; o.grad_accum = mb;
    cf_trainer *ta = cf_trainer_create(a, &o), *tb = cf_trainer_create(b, &o);
    CHECK(ta && tb);
    int32_t *tok = malloc((size_t)mb * (S + 1) * sizeof(int32_t));
    cf_micro_batch *mbs = malloc((size_t)mb * sizeof *mbs);
    size_t np = cf_model_num_params(a);
    float *wa = malloc(np * sizeof(float)), *wb = malloc(np * sizeof(float));
    for (int step = 0; step < 3 && ta && tb; step++) {
        random_tokens(tok, mb * (S + 1), cf_model_config(a)->vocab_size, seed + step);
        for (int i = 0; i < mb; i++) mbs[i] = (cf_micro_batch){tok + i * (S + 1), NULL};
        cf_step_stats sa, sb;
        CHECK(cf_trainer_step(ta, mbs, 1e-2f, &sa) == 0 && cf_trainer_step(tb, mbs, 1e-2f, &sb) == 0);
        CHECK_MSG(fabs(sa.loss - sb.loss) <= 1e-3 * fabs(sb.loss), "%s step %d: losses %.6g vs %.6g", what, step,
                  sa.loss, sb.loss);
        CHECK_MSG(fabs(sa.grad_norm - sb.grad_norm) <= 1e-3 * sb.grad_norm && sb.grad_norm > 0,
                  "%s step %d: gradient norms %.6g vs %.6g", what, step, sa.grad_norm, sb.grad_norm);
        for (int i = 0; i < cf_model_num_tensors(a); i++) {
            cf_model_get_param(a, i, wa + toff(a, i));
            cf_model_get_param(b, i, wb + toff(b, i));
        }
        const char *where = "?";
        double e = max_rel(a, wa, wb, &where);
        CHECK_MSG(e < 1e-3, "%s step %d: weights differ by %.3g at %s", what, step, e, where);
        if (after_step) after_step(what, a, step);
    }
    free(wa);
    free(wb);
    free(tok);
    free(mbs);
    cf_trainer_free(ta);
    cf_trainer_free(tb);
}

/* Two GPU models of mc's config for an A/B of one switch: *off opened with
 * var=0 in the environment, *on without it (NULL where mc is). */
static void gpu_pair_env(const cf_model *mc, const char *var, cf_model **on, cf_model **off) {
    setenv(var, "0", 1);
    *off = mc ? cf_model_create(cf_model_config(mc), CF_BACKEND_CUDA, 1) : NULL;
    unsetenv(var);
    *on = mc ? cf_model_create(cf_model_config(mc), CF_BACKEND_CUDA, 1) : NULL;
}

/* One switch's A/B: two GPU models (gpu_pair_env: *off opened with var=0)
 * with the weights of a CPU model of `name` (seed), trained in lockstep by
 * lockstep_steps (mode at keep 0.5, four micro-batches, tokens from
 * tok_seed). 0, after a failed check, where they could not be opened; the
 * caller checks its counters and frees *on and *off. */
static int switch_lockstep(const char *what, const char *name, uint64_t seed, const char *var, cf_mode mode,
                           uint32_t tok_seed, cf_model **on, cf_model **off) {
    cf_model *mc = cpu_model(name, seed);
    gpu_pair_env(mc, var, on, off);
    const int ok = *on && *off;
    if (ok) lockstep_steps(what, *on, *off, mc, mode, 0.5, 4, tok_seed, NULL);
    else CHECK_MSG(0, "%s", cf_last_error());
    cf_model_free(mc);
    return ok;
}

/* engine/dwpair.c on the GPU: the trainer's steps (centrifuge at keep 0.5,
 * in a stash of one micro-batch's rows, and regular, in one of two; four
 * micro-batches, three steps) with the MLP's weight gradients of two
 * micro-batches in one GEMM give the steps without (CF_DW_PAIR=0 at open)
 * (lockstep_steps), and pairs happen (two per step from the second step on). */
TEST(gpu_paired_mlp_weight_gradients_give_the_unpaired_steps) {
    const cf_mode modes[] = {CF_MODE_CENTRIFUGE, CF_MODE_REGULAR};
    for (int mi = 0; mi < 2; mi++) {
        cf_model *on, *off;
        if (switch_lockstep(cf_mode_name(modes[mi]), "tiny-llama", 81, "CF_DW_PAIR", modes[mi], 90, &on, &off))
            CHECK_MSG(on->dwp.joins == 4 && off->dwp.joins == 0 && on->dwp.cap == (mi ? 2 * S : S),
                      "%s: %lld joins (expected 4), %lld unpaired, a stash of %d rows", cf_mode_name(modes[mi]),
                      (long long)on->dwp.joins, (long long)off->dwp.joins, on->dwp.cap);
        cf_model_free(on);
        cf_model_free(off);
    }
}

/* The LM head's pairs (dwpair.c, second part: the filter puts the next
 * backward's g and lnf rows after the held ones, one GEMM over both) give
 * the steps without (CF_DW_PAIR_HEAD=0 at open) (lockstep_steps), in the
 * compact modes, with an LM head of its own (tiny-llama) and the
 * embedding's (tiny-qwen2); two joins per step of four micro-batches. */
TEST(gpu_paired_lm_head_weight_gradients_give_the_unpaired_steps) {
    static const char *const names[] = {"tiny-llama", "tiny-qwen2"};
    const cf_mode modes[] = {CF_MODE_CENTRIFUGE, CF_MODE_CENTRIFUGE_KV};
    char what[96];
    for (int ni = 0; ni < 2; ni++)
        for (int mi = 0; mi < 2; mi++) {
            cf_model *on, *off;
            snprintf(what, sizeof what, "LM head pairs, %s %s", names[ni], cf_mode_name(modes[mi]));
            if (switch_lockstep(what, names[ni], 91 + ni, "CF_DW_PAIR_HEAD", modes[mi], 101, &on, &off))
                CHECK_MSG(on->dwp.head_joins == 6 && off->dwp.head_joins == 0 && on->dwp.head_held == 0,
                          "%s: %lld joins (expected 6), %lld unpaired, %d rows held", what,
                          (long long)on->dwp.head_joins, (long long)off->dwp.head_joins, on->dwp.head_held);
            cf_model_free(on);
            cf_model_free(off);
        }
}

/* The joining GEMMs of the pairs on the backend's side stream (dwpair.c,
 * CUDA: cf_cuda_side_begin) give the steps with them in line
 * (CF_DW_SIDE=0 at open) (lockstep_steps), and the side stream was used
 * (created at the first section) by the one model only (both without the
 * early norm, whose sums are side sections too). */
TEST(gpu_paired_gradients_on_the_side_stream_give_the_in_line_steps) {
    cf_model *mc = cpu_model("tiny-llama", 83), *on, *off;
    setenv("CF_NORM_EARLY", "0", 1); /* the other user of side sections */
    gpu_pair_env(mc, "CF_DW_SIDE", &on, &off);
    unsetenv("CF_NORM_EARLY");
    if (on && off) {
        lockstep_steps("side", on, off, mc, CF_MODE_CENTRIFUGE, 0.5, 4, 95, NULL);
        const cf_cuda_ctx *con = (const cf_cuda_ctx *)on->b->state, *coff = (const cf_cuda_ctx *)off->b->state;
        CHECK_MSG(on->dwp.joins == 4 && off->dwp.joins == 4, "%lld and %lld joins (expected 4)",
                  (long long)on->dwp.joins, (long long)off->dwp.joins);
        CHECK_MSG(con->side_stream && !coff->side_stream && !con->side_open && !con->side_pending,
                  "side stream %p (in line: %p), open %d, pending %d", (void *)con->side_stream,
                  (void *)coff->side_stream, con->side_open, con->side_pending);
    } else {
        CHECK_MSG(0, "%s", cf_last_error());
    }
    cf_model_free(on);
    cf_model_free(off);
    cf_model_free(mc);
}

/* o's and q/k/v's weight gradients beside the backward (dwside.c: a side
 * section per GEMM, from per-layer copies of their dY) give the steps with
 * them in line (CF_DW_SIDE_ATTN=0 at open) (lockstep_steps), regular and
 * centrifuge, on Llama and on Qwen2 (q/k/v biases, whose gradient stays in
 * line), four micro-batches (the MLP's pairs beside too). By default the
 * path runs in every compact backward from the second step, and in the
 * full ones here too: these models' attention grid is under 1.5 waves
 * (test_gpu_ops: attention_bwd_leaves_idle_where_the_plan_is_under_one_and_a_half_waves has
 * the shapes that fill the GPU); forced (CF_DW_SIDE_ATTN=1, against
 * CF_DW_SIDE=0) in every backward; never in the model opened with it off. */
TEST(gpu_attention_weight_gradients_beside_give_the_in_line_steps) {
    static const char *const names[] = {"tiny-llama", "tiny-qwen2"};
    /* mode, forced, backwards beside expected */
    static const struct { cf_mode mode; int forced; long long beside; } cases[] = {
        {CF_MODE_REGULAR, 0, 8}, {CF_MODE_REGULAR, 1, 8}, {CF_MODE_CENTRIFUGE, 0, 8}};
    char what[128];
    for (int ni = 0; ni < 2; ni++)
        for (int ci = 0; ci < 3; ci++) {
            cf_model *on, *off;
            snprintf(what, sizeof what, "attention beside, %s %s%s", names[ni], cf_mode_name(cases[ci].mode),
                     cases[ci].forced ? " (forced)" : "");
            if (cases[ci].forced) setenv("CF_DW_SIDE_ATTN", "1", 1);
            const int ok = switch_lockstep(what, names[ni], 87 + ni, cases[ci].forced ? "CF_DW_SIDE" : "CF_DW_SIDE_ATTN",
                                           cases[ci].mode, 99, &on, &off);
            unsetenv("CF_DW_SIDE_ATTN");
            if (ok)
                CHECK_MSG(on->dws.backwards == cases[ci].beside && off->dws.backwards == 0,
                          "%s: %lld backwards beside (expected %lld), %lld in the model without", what,
                          (long long)on->dws.backwards, cases[ci].beside, (long long)off->dws.backwards);
            cf_model_free(on);
            cf_model_free(off);
        }
}

/* The early gradient norm (optim.c: cf_norm_pre_*; its squares summed in
 * side sections during the last backward) gives the steps of the
 * whole-buffer pass (CF_NORM_EARLY=0 at open) (lockstep_steps), regular
 * and centrifuge (both with pairs: the last backward joins, its MLP
 * gradients finished by GEMMs in side sections too), and was used in every
 * regular step and in no centrifuge one. */
TEST(gpu_early_gradient_norm_gives_the_whole_buffer_steps) {
    const cf_mode modes[] = {CF_MODE_REGULAR, CF_MODE_CENTRIFUGE};
    for (int mi = 0; mi < 2; mi++) {
        cf_model *on, *off;
        if (switch_lockstep("early norm", "tiny-qwen2", 85 + mi, "CF_NORM_EARLY", modes[mi], 97, &on, &off)) {
            const int64_t want = modes[mi] == CF_MODE_REGULAR ? 3 : 0; /* never in the compact modes */
            CHECK_MSG(on->opt.pre_steps == want && off->opt.pre_steps == 0, "%s: %lld early norms, %lld off",
                      cf_mode_name(modes[mi]), (long long)on->opt.pre_steps, (long long)off->opt.pre_steps);
        }
        cf_model_free(on);
        cf_model_free(off);
    }
}

/* AdamW as one launch over every tensor (optim.c: one_pass, the backend's
 * adamw_segments) gives the steps of a launch per tensor (CF_ADAMW_ONE_PASS=0
 * at open) (lockstep_steps), on Qwen2 (q/k/v biases: segments with and
 * without weight decay, zeroed and stale gradients side by side). */
TEST(gpu_adamw_in_one_launch_gives_the_per_tensor_steps) {
    cf_model *on, *off;
    if (switch_lockstep("adamw one pass", "tiny-qwen2", 83, "CF_ADAMW_ONE_PASS", CF_MODE_REGULAR, 96, &on, &off))
        CHECK_MSG(on->opt.one_pass == 1 && off->opt.one_pass == 0, "one_pass %d on, %d off", on->opt.one_pass,
                  off->opt.one_pass);
    cf_model_free(on);
    cf_model_free(off);
}

/* fills model m's STALE gradients with NaN; all of its set-only gradients
 * (the 7 linear weights of each layer) must be STALE after a step */
static void poison_stale(const char *what, cf_model *m, int step) {
    int stale = 0;
    for (int i = 0; i < m->ntensors; i++) {
        if (!m->params[i].trainable || m->opt.gstate[i] != CF_GRAD_STALE) continue;
        size_t n = m->params[i].numel;
        float *nan = malloc(n * sizeof(float));
        for (size_t j = 0; j < n; j++) nan[j] = NAN;
        m->b->upload(m->b, cf_grad(m, i), nan, n * sizeof(float));
        free(nan);
        stale += m->params[i].grad_set_only;
    }
    CHECK_MSG(stale == 7 * cf_model_config(m)->num_hidden_layers, "%s step %d: %d stale gradients", what, step, stale);
}

/* Gradients left STALE by AdamW (engine/model_internal.h) on the GPU: the
 * trainer's steps (regular and centrifuge, two micro-batches, a pair in
 * each step from the second on) with the set-only gradients not zeroed, and their memory
 * filled with NaN after every step, give the steps of the zeroing path
 * (cf_optim.keep_stale = 0) (lockstep_steps): every stale gradient is
 * overwritten by its first GEMM (CF_MM_DW_SET), never added to or read.
 * Attention's backward adds with atomics, so two runs agree to 1e-3, not
 * bitwise; a NaN that got through would not. */
TEST(gpu_stale_gradients_give_the_zeroing_steps_even_when_poisoned) {
    const cf_mode modes[] = {CF_MODE_REGULAR, CF_MODE_CENTRIFUGE};
    for (int mi = 0; mi < 2; mi++) {
        cf_model *mc = cpu_model("tiny-llama", 91);
        cf_model *on = mc ? cf_model_create(cf_model_config(mc), CF_BACKEND_CUDA, 1) : NULL;
        cf_model *off = mc ? cf_model_create(cf_model_config(mc), CF_BACKEND_CUDA, 1) : NULL;
        if (on && off) {
            on->opt.keep_stale = 1;
            off->opt.keep_stale = 0;
            lockstep_steps(cf_mode_name(modes[mi]), on, off, mc, modes[mi], mi ? 0.5 : 1.0, 2, 95, poison_stale);
            CHECK_MSG(on->dwp.joins == 2, "%lld joins (expected 2)", (long long)on->dwp.joins);
        } else {
            CHECK_MSG(0, "%s", cf_last_error());
        }
        cf_model_free(on);
        cf_model_free(off);
        cf_model_free(mc);
    }
}

/* The attention shapes of the model tests, alone: B=2, S=40, D in {8,16,32,64}. */
TEST(gpu_attention_fwd_matches_cpu_at_model_test_shapes) {
    cf_backend *c = cf_backend_cpu_create(), *g = cf_backend_cuda_create(0);
    if (!c || !g) { CHECK(0); return; }
    const int Ds[] = {8, 16, 32, 64};
    for (int di = 0; di < 4; di++) {
        for (int Bv = 1; Bv <= 2; Bv++) {
            int D = Ds[di], H = 4, Hkv = 2, Sv = 40, T = Bv * Sv;
            size_t nq = (size_t)T * H * D, nk = (size_t)T * Hkv * D;
            float *q = malloc(nq * 4), *k = malloc(nk * 4), *v = malloc(nk * 4), *oc = malloc(nq * 4), *og = malloc(nq * 4);
            float *lc = malloc((size_t)T * H * 4), *lg = malloc((size_t)T * H * 4);
            cf_rng r;
            cf_rng_seed(&r, 3 + di);
            for (size_t i = 0; i < nq; i++) q[i] = cf_rng_normal(&r);
            for (size_t i = 0; i < nk; i++) { k[i] = cf_rng_normal(&r); v[i] = cf_rng_normal(&r); }
            /* bf16-round the inputs so both sides see the same values */
            void *tq = g->alloc(g, nq * 2), *tk = g->alloc(g, nk * 2), *tv = g->alloc(g, nk * 2), *to = g->alloc(g, nq * 2);
            float *tl = g->alloc(g, (size_t)T * H * 4);
            g->act_from_f32(g, tq, q, nq); g->act_to_f32(g, q, tq, nq);
            g->act_from_f32(g, tk, k, nk); g->act_to_f32(g, k, tk, nk);
            g->act_from_f32(g, tv, v, nk); g->act_to_f32(g, v, tv, nk);
            cf_attn_shape sh = {Bv, Sv, H, Hkv, D, 1.0f / sqrtf((float)D), NULL};
            c->attention_fwd(c, oc, lc, q, k, v, &sh);
            g->attention_fwd(g, to, tl, tq, tk, tv, &sh);
            g->act_to_f32(g, og, to, nq);
            g->download(g, lg, tl, (size_t)T * H * 4);
            double eo = rel_err(og, oc, nq), el = rel_err(lg, lc, (size_t)T * H);
            CHECK_MSG(eo < 1e-2 && el < 1e-2, "attention fwd D=%d B=%d S=%d: out err %.3g lse err %.3g", D, Bv, Sv, eo, el);
            free(q); free(k); free(v); free(oc); free(og); free(lc); free(lg);
            g->free(g, tq); g->free(g, tk); g->free(g, tv); g->free(g, to); g->free(g, tl);
        }
    }
    c->destroy(c);
    g->destroy(g);
}

TEST(gpu_selection_equals_cpu_selection_with_ties_and_nan) {
    cf_backend *g = cf_backend_cuda_create(0);
    if (!g) { CHECK(0); return; }
    const int shapes[][2] = {{1, 4096}, {2, 40}, {3, 1000}, {8, 128}};
    const float keeps[] = {1.0f, 0.8f, 0.5f, 0.1f, 1e-4f};
    for (int si = 0; si < 4; si++) {
        int Bv = shapes[si][0], Sv = shapes[si][1], T = Bv * Sv;
        float *l = malloc((size_t)T * 4), *r = malloc((size_t)T * 4);
        uint8_t *kc = malloc((size_t)T), *kg = malloc((size_t)T);
        cf_rng rng;
        cf_rng_seed(&rng, 40 + si);
        for (int t = 0; t < T; t++) {
            l[t] = (float)cf_rng_below(&rng, 16) * 0.25f;   /* many exact ties */
            r[t] = (float)cf_rng_below(&rng, 4) * 0.25f;
        }
        l[T / 3] = NAN;
        float *dl = g->alloc(g, (size_t)T * 4), *dr = g->alloc(g, (size_t)T * 4);
        uint8_t *dk = g->alloc(g, (size_t)T);
        g->upload(g, dl, l, (size_t)T * 4);
        g->upload(g, dr, r, (size_t)T * 4);
        for (int ki = 0; ki < 5; ki++)
            for (int pb = 0; pb < 2; pb++)
                for (int useref = 0; useref < 2; useref++) {
                    int nc = cf_select(l, useref ? r : NULL, Bv, Sv, keeps[ki], useref ? CF_SELECT_REF : CF_SELECT_SELF, pb, 1, kc);
                    int group = pb ? T : Sv;
                    g->select_topk(g, dk, dl, useref ? dr : NULL, T, group, cf_select_kept_count(keeps[ki], group));
                    g->download(g, kg, dk, (size_t)T);
                    int ng = 0;
                    for (int t = 0; t < T; t++) ng += kg[t];
                    CHECK_MSG(nc == ng && memcmp(kc, kg, (size_t)T) == 0,
                              "B=%d S=%d keep %g per-batch %d ref %d: gpu keeps %d, cpu %d", Bv, Sv, keeps[ki], pb, useref, ng, nc);
                }
        g->free(g, dl); g->free(g, dr); g->free(g, dk);
        free(l); free(r); free(kc); free(kg);
    }
    g->destroy(g);
}

TEST(gpu_swiglu_bwd_rows_matches_cpu) {
    cf_backend *c = cf_backend_cpu_create(), *g = cf_backend_cuda_create(0);
    if (!c || !g) { CHECK(0); return; }
    const int Fs[] = {5632, 44};   /* vector and scalar paths */
    for (int fi = 0; fi < 2; fi++) {
        int T = 300, F = Fs[fi], n = 0;
        int *rows = malloc(T * sizeof(int));
        for (int t = 0; t < T; t++) if (t % 3) rows[n++] = t;
        size_t NF = (size_t)T * F;
        float *gate = malloc(NF * 4), *up = malloc(NF * 4), *dh = malloc(NF * 4);
        float *out_c[3], *out_g[3];
        cf_rng r;
        cf_rng_seed(&r, 12 + fi);
        for (size_t i = 0; i < NF; i++) { gate[i] = 2.0f * cf_rng_normal(&r); up[i] = cf_rng_normal(&r); dh[i] = cf_rng_normal(&r); }
        void *dgate = g->alloc(g, NF * 2), *dup = g->alloc(g, NF * 2), *ddh = g->alloc(g, NF * 2), *go[3];
        int *drows = g->alloc(g, (size_t)n * sizeof(int));
        g->act_from_f32(g, dgate, gate, NF); g->act_to_f32(g, gate, dgate, NF);   /* bf16-exact inputs */
        g->act_from_f32(g, dup, up, NF); g->act_to_f32(g, up, dup, NF);
        g->act_from_f32(g, ddh, dh, NF); g->act_to_f32(g, dh, ddh, NF);
        g->upload(g, drows, rows, (size_t)n * sizeof(int));
        for (int k = 0; k < 3; k++) {
            out_c[k] = malloc(NF * 4); out_g[k] = malloc(NF * 4);
            go[k] = g->alloc(g, NF * 2);
        }
        c->swiglu_bwd_rows(c, out_c[0], out_c[1], out_c[2], dh, gate, up, rows, n, F, F, F);
        g->swiglu_bwd_rows(g, go[0], go[1], go[2], ddh, dgate, dup, drows, n, F, F, F);
        /* ld = 2F: dgate and dup as the two halves of one [n, 2F] matrix
         * (the fused gate/up backward's input): the same bits per half */
        void *gp = g->alloc(g, (size_t)n * 2 * F * 2), *gh2 = g->alloc(g, NF * 2);
        g->swiglu_bwd_rows(g, gh2, gp, (char *)gp + (size_t)F * 2, ddh, dgate, dup, drows, n, F, F, 2 * F);
        float *pk = malloc((size_t)n * 2 * F * 4), *sep = malloc(NF * 4);
        g->act_to_f32(g, pk, gp, (size_t)n * 2 * F);
        int same = 1;
        for (int k = 1; k < 3; k++) {
            g->act_to_f32(g, sep, go[k], (size_t)n * F);
            for (int i = 0; i < n; i++)
                same &= memcmp(pk + (size_t)i * 2 * F + (k - 1) * F, sep + (size_t)i * F, (size_t)F * 4) == 0;
        }
        CHECK_MSG(same, "F=%d: ld = 2F halves differ from the separate outputs", F);
        free(pk); free(sep); g->free(g, gp); g->free(g, gh2);
        for (int k = 0; k < 3; k++) {
            g->act_to_f32(g, out_g[k], go[k], (size_t)n * F);
            double e = rel_err(out_g[k], out_c[k], (size_t)n * F);
            CHECK_MSG(e < 1e-2, "F=%d output %d: rel err %.3g", F, k, e);   /* bf16 outputs */
            free(out_c[k]); free(out_g[k]); g->free(g, go[k]);
        }
        g->free(g, dgate); g->free(g, dup); g->free(g, ddh); g->free(g, drows);
        free(gate); free(up); free(dh); free(rows);
    }
    c->destroy(c);
    g->destroy(g);
}

/* LoRA on the GPU: the adapters' forward and backward (bf16 GEMMs of rank r,
 * the scale op) against the CPU, in regular and centrifuge mode; the base
 * stays frozen on both. */
TEST(gpu_lora_losses_and_adapter_gradients_match_cpu) {
    cf_model_opts o = {0};
    o.config = "tiny-llama";
    o.seed = 3;
    o.lora = (cf_lora_opts){8, 16.0f, 0x7f, 0.0f, 0};
    o.backend = CF_BACKEND_CPU;
    cf_model *mc = cf_model_open(&o);
    o.backend = CF_BACKEND_CUDA;
    cf_model *mg = cf_model_open(&o);
    CHECK_MSG(mc && mg, "%s", cf_last_error());
    if (!mc || !mg) { cf_model_free(mc); cf_model_free(mg); return; }
    cf_rng r;
    cf_rng_seed(&r, 4);
    for (int i = 0; i < cf_model_num_tensors(mc); i++) {
        size_t n = cf_model_tensor_numel(mc, i);
        float *w = malloc(n * sizeof(float));
        cf_model_get_param(mc, i, w);
        if (strstr(cf_model_tensor_name(mc, i), "lora_B")) for (size_t j = 0; j < n; j++) w[j] = 0.05f * cf_rng_normal(&r);
        cf_model_set_param(mc, i, w);
        cf_model_set_param(mg, i, w);
        free(w);
    }
    int32_t tok[B * (S + 1)];
    for (int i = 0; i < B * (S + 1); i++) tok[i] = (int32_t)cf_rng_below(&r, (uint32_t)cf_model_config(mc)->vocab_size);
    float lc[B * S], lg[B * S];
    uint8_t keep[B * S];
    cf_forward(mc, tok, B, S, lc);
    cf_select(lc, NULL, B, S, 0.5f, CF_SELECT_SELF, 0, 1, keep);
    const cf_mode modes[] = {CF_MODE_REGULAR, CF_MODE_CENTRIFUGE};
    for (int mi = 0; mi < 2; mi++) {
        float *gc = run(mc, tok, modes[mi], mi ? keep : NULL, 0, lc);
        float *gg = run(mg, tok, modes[mi], mi ? keep : NULL, 0, lg);
        double lerr = 0;
        for (int t = 0; t < B * S; t++) lerr = fmax(lerr, fabs(lg[t] - lc[t]) - 1e-2 * fabs(lc[t]));
        const char *which = "";
        CHECK_MSG(every_tensor_nonzero(mc, gc, &which), "lora %s: CPU gradient of %s is all zero",
                  cf_mode_name(modes[mi]), which);
        double gerr = worst_tensor_err(mc, gg, gc, &which);
        CHECK_MSG(lerr <= 5e-2, "lora %s: loss differs by %.3g", cf_mode_name(modes[mi]), lerr);
        CHECK_MSG(gerr <= 5e-2, "lora %s: gradient of %s differs by %.3g", cf_mode_name(modes[mi]), which, gerr);
        printf("    lora %-10s loss err %.2e, worst adapter grad err %.2e (%s)\n", cf_mode_name(modes[mi]), lerr, gerr, which);
        free(gc); free(gg);
    }
    cf_model_free(mc);
    cf_model_free(mg);
}

/* CF_TEST_ONLY=word runs the tests whose name contains word (e.g. under
 * compute-sanitizer), as test_gpu_ops does. */
static const char *only;
#define RUN_IF(name) do { if (!only || strstr(#name, only)) RUN(name); } while (0)

int main(void) {
    only = getenv("CF_TEST_ONLY");
    RUN_IF(gpu_swiglu_bwd_rows_matches_cpu);
    RUN_IF(gpu_selection_equals_cpu_selection_with_ties_and_nan);
    RUN_IF(gpu_attention_fwd_matches_cpu_at_model_test_shapes);
    RUN_IF(gpu_adamw_refreshes_bf16_weights_and_zeroes_gradients_in_one_pass_unless_kept);
    RUN_IF(gpu_batched_filter_gather_equals_per_tensor_gather);
    RUN_IF(gpu_model_losses_and_gradients_match_cpu_in_every_mode);
    RUN_IF(gpu_model_with_unfused_projections_matches_cpu_in_every_mode);
    RUN_IF(gpu_model_recomputing_the_lm_head_logits_matches_cpu_in_every_mode);
    RUN_IF(gpu_model_matches_cpu_over_several_attention_tiles_with_uneven_kept_counts);
    RUN_IF(gpu_lora_losses_and_adapter_gradients_match_cpu);
    RUN_IF(gpu_equivalences_of_design_section_1_hold_with_bf16_tolerances);
    RUN_IF(gpu_paired_mlp_weight_gradients_give_the_unpaired_steps);
    RUN_IF(gpu_paired_lm_head_weight_gradients_give_the_unpaired_steps);
    RUN_IF(gpu_paired_gradients_on_the_side_stream_give_the_in_line_steps);
    RUN_IF(gpu_attention_weight_gradients_beside_give_the_in_line_steps);
    RUN_IF(gpu_early_gradient_norm_gives_the_whole_buffer_steps);
    RUN_IF(gpu_adamw_in_one_launch_gives_the_per_tensor_steps);
    RUN_IF(gpu_stale_gradients_give_the_zeroing_steps_even_when_poisoned);
    return test_summary();
}
