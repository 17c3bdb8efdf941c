/*
 * test_stale_grad.c — gradients the optimizer leaves STALE (engine/
 * model_internal.h, CF_GRAD_STALE), on the CPU backend.
 *
 * AdamW's pass does not zero the gradient of a set-only tensor (the weights
 * of the linear layers and LoRA adapters: every writer is a weight-gradient
 * GEMM) in a plain one-process run; its first writer of the next step
 * overwrites it instead (CF_MM_DW_SET), and whatever reads the buffer as a
 * gradient first zeroes it (cf_grad_settle). What is proved here:
 *   - training with stale gradients gives bitwise the steps of the zeroing
 *     path (cf_optim.keep_stale = 0): losses, norms, weights, AdamW moments,
 *     over several steps of 2-3 micro-batches in every mode, with biases,
 *     q/k norms, frozen tensors, LoRA (with dropout) and dwpair.c's pairs;
 *   - it does so with the stale memory poisoned (NaN) after every step, so
 *     every stale gradient really is overwritten, never added to or read;
 *   - after a step the set-only tensors are STALE (their memory still holds
 *     the old gradient), every other one ZERO; cf_model_get_grad reads zeros;
 *   - a step with no backward since the last one sees a zero gradient;
 *   - held dwpair rows over stale gradients are written by the flush; one
 *     GEMM over a STALE and a LIVE gradient (fused gate/up) zeroes the
 *     STALE one first; CF_GRAD_KEEP=0 at open turns the whole thing off;
 *   - AdamW in one call over every segment gives the per-segment steps.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/common.h"
#include "engine/model_internal.h"
#include "model_helpers.h"
#include "test.h"

enum { S = 12, MAXMB = 3, STEPS = 3 };

/* A builtin config with random weights; freeze and LoRA targets optional. */
static cf_model *open_model(const char *name, uint64_t seed, const char *freeze, unsigned lora_targets) {
    cf_model_opts o = {0};
    o.config = name;
    o.backend = CF_BACKEND_CPU;
    o.seed = seed;
    o.freeze = freeze;
    if (lora_targets) o.lora = (cf_lora_opts){4, 8.0f, lora_targets, 0.1f, 0};
    cf_model *m = cf_model_open(&o);
    if (!m) { printf("    %s\n", cf_last_error()); return NULL; }
    randomize_weights(m, seed ^ 0x5eed, 0.25f, 0.2f);
    return m;
}

static cf_train_opts opts(cf_mode mode, int accum) {
    return test_train_opts(mode, mode == CF_MODE_REGULAR ? 1.0 : 0.5, S, accum, 1.0f);
}

/* The tensors whose gradient is STALE, their memory filled with NaN (a
 * GEMM that added to it, or a reader, would spread it); how many. */
static int poison_stale(cf_model *m) {
    int n = 0;
    for (int i = 0; i < m->ntensors; i++) {
        if (!m->params[i].trainable || m->opt.gstate[i] != CF_GRAD_STALE) continue;
        size_t k = m->params[i].numel;
        float *nan = malloc(k * sizeof(float));
        for (size_t j = 0; j < k; j++) nan[j] = NAN;
        m->b->upload(m->b, cf_grad(m, i), nan, k * sizeof(float));
        free(nan);
        n++;
    }
    return n;
}

/* 1 if every trainable tensor's state is the one a step leaves: STALE for
 * set-only tensors when stale (else ZERO), ZERO for the others. */
static int states_after_step(const cf_model *m, int stale, const char **bad) {
    for (int i = 0; i < m->ntensors; i++) {
        const cf_param *p = &m->params[i];
        if (!p->trainable) continue;
        int want = stale && p->grad_set_only ? CF_GRAD_STALE : CF_GRAD_ZERO;
        if (m->opt.gstate[i] != want) { *bad = p->name; return 0; }
    }
    return 1;
}

/* Every weight, and AdamW's m and v, of a and b bitwise equal. */
static int same_state(cf_model *a, cf_model *b) {
    size_t np = cf_model_num_params(a), nl = a->opt.lay.nlocal;
    float *wa = malloc(np * sizeof(float)), *wb = malloc(np * sizeof(float));
    float *ma = malloc(nl * sizeof(float)), *va = malloc(nl * sizeof(float));
    float *mb = malloc(nl * sizeof(float)), *vb = malloc(nl * sizeof(float));
    for (int i = 0; i < cf_model_num_tensors(a); i++) {
        cf_model_get_param(a, i, wa + toff(a, i));
        cf_model_get_param(b, i, wb + toff(b, i));
    }
    cf_model_get_adam(a, ma, va);
    cf_model_get_adam(b, mb, vb);
    int same = !memcmp(wa, wb, np * sizeof(float)) && !memcmp(ma, mb, nl * sizeof(float)) &&
               !memcmp(va, vb, nl * sizeof(float));
    free(wa); free(wb); free(ma); free(va); free(mb); free(vb);
    return same;
}

/* STEPS trainer steps of `on` (stale gradients; poisoned after each step
 * if `poison`) and `off` (zeroed) on the same micro-batches: bitwise the
 * same losses, norms, weights and moments after every step, and the states
 * a step leaves. */
static void compare_steps(cf_model *on, cf_model *off, cf_mode mode, int accum, int poison, const char *what) {
    on->opt.keep_stale = 1;
    off->opt.keep_stale = 0;
    cf_train_opts o = opts(mode, accum);
    cf_trainer *ton = cf_trainer_create(on, &o), *toff = cf_trainer_create(off, &o);
    CHECK_MSG(ton && toff, "%s: trainer: %s", what, cf_last_error());
    if (!ton || !toff) { cf_trainer_free(ton); cf_trainer_free(toff); return; }
    int32_t tok[MAXMB * (S + 1)];
    for (int step = 0; step < STEPS; step++) {
        random_tokens(tok, MAXMB * (S + 1), cf_model_config(on)->vocab_size, 1000 * step + 7 * accum + mode);
        cf_micro_batch mbs[MAXMB];
        for (int i = 0; i < accum; i++) mbs[i] = (cf_micro_batch){tok + i * (S + 1), NULL};
        cf_step_stats son, soff;
        CHECK(cf_trainer_step(ton, mbs, 1e-2f, &son) == 0);
        CHECK(cf_trainer_step(toff, mbs, 1e-2f, &soff) == 0);
        CHECK_MSG(son.loss == soff.loss && son.grad_norm == soff.grad_norm && isfinite(son.grad_norm) &&
                      son.grad_norm > 0 && !son.skipped,
                  "%s step %d: loss %.9g vs %.9g, norm %.9g vs %.9g", what, step, son.loss, soff.loss,
                  son.grad_norm, soff.grad_norm);
        CHECK_MSG(same_state(on, off), "%s step %d: weights or moments differ", what, step);
        const char *bad = "";
        CHECK_MSG(states_after_step(on, 1, &bad), "%s step %d: %s is not in the state a stale step leaves", what,
                  step, bad);
        CHECK_MSG(states_after_step(off, 0, &bad), "%s step %d: %s is not ZERO after a zeroing step", what, step,
                  bad);
        if (poison) CHECK_MSG(poison_stale(on) > 0, "%s step %d: no stale gradient to poison", what, step);
    }
    cf_trainer_free(ton);
    cf_trainer_free(toff);
}

static const cf_mode MODES[] = {CF_MODE_REGULAR, CF_MODE_LOSS_ONLY, CF_MODE_CENTRIFUGE, CF_MODE_STRAWMAN,
                                CF_MODE_CENTRIFUGE_KV};

/* With and without poison, every mode, 2 and 3 micro-batches;
 * llama (fused gate/up, tied or not as built in), qwen2 (q/k/v biases:
 * their gradient stays ZERO-cleared), qwen3 (q/k norms). From the second
 * step the compact modes pair the MLP's weight gradients (dwpair.c), whose
 * held GEMMs take the stale flags at HOLD. */
TEST(stale_gradients_give_bitwise_the_zeroing_steps_even_when_poisoned_in_every_mode) {
    static const char *const names[] = {"tiny-llama", "tiny-qwen2", "tiny-qwen3"};
    for (int ni = 0; ni < 3; ni++)
        for (size_t mi = 0; mi < sizeof MODES / sizeof MODES[0]; mi++)
            for (int accum = 2; accum <= MAXMB; accum++)
                for (int poison = 0; poison < 2; poison++) {
                    char what[96];
                    snprintf(what, sizeof what, "%s %s x%d%s", names[ni], cf_mode_name(MODES[mi]), accum,
                             poison ? " poisoned" : "");
                    cf_model *on = open_model(names[ni], 50 + ni, NULL, 0), *off = open_model(names[ni], 50 + ni, NULL, 0);
                    if (!on || !off) { CHECK(0); cf_model_free(on); cf_model_free(off); return; }
                    compare_steps(on, off, MODES[mi], accum, poison, what);
                    if (cf_mode_is_compact(MODES[mi]))
                        CHECK_MSG(on->dwp.joins > 0 && on->dwp.joins == off->dwp.joins,
                                  "%s: %lld joins vs %lld: the pairs were not exercised", what,
                                  (long long)on->dwp.joins, (long long)off->dwp.joins);
                    cf_model_free(on);
                    cf_model_free(off);
                }
}

/* Frozen tensors have no state; with the up projection frozen, gate and up
 * no longer fuse, so gate's weight gradient goes through linear.c alone. */
TEST(stale_gradients_give_bitwise_the_zeroing_steps_with_frozen_tensors_and_unfused_gate_up) {
    const cf_mode modes[] = {CF_MODE_REGULAR, CF_MODE_CENTRIFUGE};
    for (int mi = 0; mi < 2; mi++) {
        const char *freeze = "mlp.up_proj,embed_tokens,layers.1.self_attn.o_proj";
        cf_model *on = open_model("tiny-mistral", 61, freeze, 0), *off = open_model("tiny-mistral", 61, freeze, 0);
        if (!on || !off) { CHECK(0); cf_model_free(on); cf_model_free(off); return; }
        CHECK(!on->params[on->lp[0].up.w].trainable && !on->params[on->lp[0].up.w].grad_set_only);
        CHECK(on->params[on->lp[0].gate.w].grad_set_only);
        compare_steps(on, off, modes[mi], 2, 1, cf_mode_name(modes[mi]));
        cf_model_free(on);
        cf_model_free(off);
    }
}

/* LoRA (all seven projections, dropout 0.1): the adapters' A and B are
 * set-only, the base is frozen. centrifuge-kv refuses adapters on k/v. */
TEST(stale_lora_adapter_gradients_give_bitwise_the_zeroing_steps_even_when_poisoned) {
    const cf_mode modes[] = {CF_MODE_REGULAR, CF_MODE_CENTRIFUGE};
    for (int mi = 0; mi < 2; mi++) {
        cf_model *on = open_model("tiny-llama", 71, NULL, 0x7f), *off = open_model("tiny-llama", 71, NULL, 0x7f);
        if (!on || !off) { CHECK(0); cf_model_free(on); cf_model_free(off); return; }
        int adapters = 0;
        for (int i = 0; i < on->ntensors; i++) {
            CHECK_MSG(on->params[i].grad_set_only == on->params[i].adapter, "%s: set-only %d", on->params[i].name,
                      on->params[i].grad_set_only);
            adapters += on->params[i].adapter;
        }
        CHECK(adapters == 2 * 7 * cf_model_config(on)->num_hidden_layers);
        compare_steps(on, off, modes[mi], 2, 1, cf_mode_name(modes[mi]));
        cf_model_free(on);
        cf_model_free(off);
    }
}

/* Which tensors are set-only, what a step leaves: the set-only
 * gradients STALE with their memory still holding the step's gradient (the
 * zero store really was skipped), every other one ZERO and zeroed; reading
 * a STALE gradient gives zeros and leaves it STALE. */
TEST(a_step_leaves_set_only_gradients_stale_holding_old_values_others_zero_and_reads_give_zeros) {
    cf_model *m = open_model("tiny-qwen2", 81, NULL, 0);
    if (!m) { CHECK(0); return; }
    CHECK(m->opt.keep_stale == 1);
    static const char *const set_only[] = {"q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                                           "gate_proj.weight", "up_proj.weight", "down_proj.weight"};
    for (int i = 0; i < m->ntensors; i++) {
        int want = 0;
        for (int k = 0; k < 7; k++) want |= strstr(m->params[i].name, set_only[k]) != NULL;
        CHECK_MSG(m->params[i].grad_set_only == want, "%s: set-only %d", m->params[i].name, m->params[i].grad_set_only);
    }
    cf_train_opts o = opts(CF_MODE_REGULAR, 2);
    cf_trainer *t = cf_trainer_create(m, &o);
    int32_t tok[2 * (S + 1)];
    random_tokens(tok, 2 * (S + 1), cf_model_config(m)->vocab_size, 82);
    cf_micro_batch mbs[2] = {{tok, NULL}, {tok + S + 1, NULL}};
    cf_step_stats st;
    CHECK(t && cf_trainer_step(t, mbs, 1e-2f, &st) == 0);
    const char *bad = "";
    CHECK_MSG(states_after_step(m, 1, &bad), "%s is not in the state a stale step leaves", bad);
    int stale = 0;
    for (int i = 0; i < m->ntensors; i++) {
        const cf_param *p = &m->params[i];
        float *raw = malloc(p->numel * sizeof(float)), *got = malloc(p->numel * sizeof(float));
        CHECK(m->b->download(m->b, raw, cf_grad(m, i), p->numel * sizeof(float)) == 0);
        CHECK(cf_model_get_grad(m, i, got) == 0);
        double raw_norm = grad_norm(raw, p->numel), got_norm = grad_norm(got, p->numel);
        CHECK_MSG(got_norm == 0, "%s: cf_model_get_grad gives |g| %g after a step", p->name, got_norm);
        if (p->grad_set_only) {
            stale++;
            CHECK_MSG(raw_norm > 0, "%s: the stale memory was zeroed", p->name);
            CHECK_MSG(m->opt.gstate[i] == CF_GRAD_STALE, "%s: a read settled it", p->name);
        } else {
            CHECK_MSG(raw_norm == 0, "%s: |g| %g in memory after a step", p->name, raw_norm);
        }
        free(raw);
        free(got);
    }
    CHECK(stale == 7 * cf_model_config(m)->num_hidden_layers);
    /* cf_grad_settle zeroes them: ZERO in state and memory */
    cf_grad_settle(m);
    CHECK_MSG(states_after_step(m, 0, &bad), "%s is not ZERO after cf_grad_settle", bad);
    float *all = all_grads(m);
    size_t np = cf_model_num_params(m);
    float *raw = malloc(m->opt.lay.ngrad * sizeof(float));
    CHECK(m->b->download(m->b, raw, m->opt.grad, m->opt.lay.ngrad * sizeof(float)) == 0);
    CHECK(grad_norm(all, np) == 0 && grad_norm(raw, m->opt.lay.ngrad) == 0);
    free(all);
    free(raw);
    cf_trainer_free(t);
    cf_model_free(m);
}

/* A second cf_step with no backward since the first: the gradient is
 * zero (norm exactly 0, AdamW's moments only decay: m = b1 m, v = b2 v),
 * the same bits as the zeroing path, even with the stale memory poisoned. */
TEST(a_step_without_backward_sees_a_zero_gradient_even_over_poisoned_stale_memory) {
    cf_model *on = open_model("tiny-llama", 91, NULL, 0), *off = open_model("tiny-llama", 91, NULL, 0);
    if (!on || !off) { CHECK(0); cf_model_free(on); cf_model_free(off); return; }
    compare_steps(on, off, CF_MODE_CENTRIFUGE, 2, 0, "first step");
    CHECK(poison_stale(on) > 0);
    const cf_adamw_params hp = opts(CF_MODE_REGULAR, 1).adamw;
    size_t nl = on->opt.lay.nlocal;
    float *m0 = malloc(nl * sizeof(float)), *v0 = malloc(nl * sizeof(float));
    float *m1 = malloc(nl * sizeof(float)), *v1 = malloc(nl * sizeof(float));
    CHECK(cf_model_get_adam(on, m0, v0) == 0);
    float non = -1, noff = -1;
    CHECK(cf_step(on, &hp, &non) == 0 && cf_step(off, &hp, &noff) == 0);
    CHECK_MSG(non == 0.0f && noff == 0.0f, "norms %g and %g of a step without backward", non, noff);
    CHECK_MSG(same_state(on, off), "the step without backward differs from the zeroing path's");
    CHECK(cf_model_get_adam(on, m1, v1) == 0);
    int decay_only = 1;
    for (size_t i = 0; i < nl; i++) decay_only &= m1[i] == hp.beta1 * m0[i] && v1[i] == hp.beta2 * v0[i];
    CHECK_MSG(decay_only, "AdamW's moments saw a nonzero gradient");
    const char *bad = "";
    CHECK_MSG(states_after_step(on, 1, &bad), "%s is not in the state a stale step leaves", bad);
    free(m0); free(v0); free(m1); free(v1);
    cf_model_free(on);
    cf_model_free(off);
}

/* (model_helpers.h) at this file's S */
static int centrifuge_backward(cf_model *m, const int32_t *tok, int more) {
    return centrifuge_backward_of(m, tok, S, more);
}

/* Rows held over poisoned stale MLP gradients: the HOLD took their
 * flags (LIVE after, so the backward's settle leaves them), and the flush
 * (by cf_model_get_grad, or by the step) writes them. Same bits as the
 * zeroing path. */
TEST(held_dwpair_rows_over_stale_gradients_are_written_by_the_flush) {
    int32_t tok[2 * (S + 1)];
    for (int c = 0; c < 2; c++) {
        cf_model *on = open_model("tiny-llama", 101 + c, NULL, 0), *off = open_model("tiny-llama", 101 + c, NULL, 0);
        if (!on || !off) { CHECK(0); cf_model_free(on); cf_model_free(off); return; }
        compare_steps(on, off, CF_MODE_REGULAR, 2, 1, "first step");
        random_tokens(tok, 2 * (S + 1), cf_model_config(on)->vocab_size, 102 + c);
        cf_model *ms[2] = {on, off};
        float *g[2] = {NULL, NULL};
        for (int k = 0; k < 2; k++) {
            CHECK(centrifuge_backward(ms[k], tok, 1) == 0);
            CHECK_MSG(ms[k]->dwp.held == S / 2, "%d rows held", ms[k]->dwp.held);
            /* the HOLD took the flags: the flush writes down's and gate/up's gradients */
            CHECK(ms[k]->dwp.zero[0] && ms[k]->dwp.zero[1]);
            if (c == 0) g[k] = all_grads(ms[k]); /* flushes */
        }
        if (c == 0) {
            CHECK_MSG(!memcmp(g[0], g[1], cf_model_num_params(on) * sizeof(float)) &&
                          grad_norm(g[0], cf_model_num_params(on)) > 0,
                      "the flushed gradients differ");
        }
        const cf_adamw_params hp = opts(CF_MODE_REGULAR, 1).adamw;
        float non = -1, noff = -1;
        CHECK(cf_step(on, &hp, &non) == 0 && cf_step(off, &hp, &noff) == 0);
        CHECK_MSG(non == noff && isfinite(non) && non > 0, "case %d: norms %.9g vs %.9g", c, non, noff);
        CHECK_MSG(same_state(on, off), "case %d: weights or moments differ", c);
        free(g[0]);
        free(g[1]);
        cf_model_free(on);
        cf_model_free(off);
    }
}

/* One GEMM over two contiguous gradients (the fused gate/up) that may not
 * write both adds to both: a STALE one is zeroed first, the LIVE one kept;
 * where both may be written, CF_MM_DW_SET, both LIVE after. */
TEST(one_gemm_over_a_stale_and_a_live_gradient_zeroes_the_stale_one_first) {
    cf_model *m = open_model("tiny-llama", 111, NULL, 0);
    if (!m) { CHECK(0); return; }
    const int gate = m->lp[0].gate.w, up = m->lp[0].up.w;
    const size_t n = m->params[gate].numel;
    float *h = malloc(n * sizeof(float)), *back = malloc(n * sizeof(float));
    for (size_t j = 0; j < n; j++) h[j] = 1.5f;
    m->b->upload(m->b, cf_grad(m, up), h, n * sizeof(float));
    for (size_t j = 0; j < n; j++) h[j] = NAN;
    m->b->upload(m->b, cf_grad(m, gate), h, n * sizeof(float));
    m->opt.gstate[gate] = CF_GRAD_STALE;
    m->opt.gstate[up] = CF_GRAD_LIVE;
    CHECK(cf_grad_take_zero_pair(m, gate, up) == 0);
    CHECK(m->opt.gstate[gate] == CF_GRAD_LIVE && m->opt.gstate[up] == CF_GRAD_LIVE);
    m->b->download(m->b, back, cf_grad(m, gate), n * sizeof(float));
    CHECK_MSG(grad_norm(back, n) == 0, "the stale gradient was not zeroed");
    m->b->download(m->b, back, cf_grad(m, up), n * sizeof(float));
    int kept = 1;
    for (size_t j = 0; j < n; j++) kept &= back[j] == 1.5f;
    CHECK_MSG(kept, "the live gradient changed");
    m->opt.gstate[gate] = CF_GRAD_STALE;
    m->opt.gstate[up] = CF_GRAD_ZERO;
    CHECK(cf_grad_take_zero_pair(m, gate, up) == (cf_grad_set_env() ? CF_MM_DW_SET : 0));
    m->opt.gstate[gate] = m->opt.gstate[up] = CF_GRAD_STALE;
    CHECK(cf_grad_take_zero_pair(m, gate, up) == CF_MM_DW_SET);
    CHECK(m->opt.gstate[gate] == CF_GRAD_LIVE && m->opt.gstate[up] == CF_GRAD_LIVE);
    free(h);
    free(back);
    cf_model_free(m);
}

/* AdamW in one backend call over every segment (cf_optim.one_pass, the
 * backend's adamw_segments) gives bitwise the steps of a call per segment
 * (CF_ADAMW_ONE_PASS=0 at open): losses, norms, weights, moments and the
 * gradient states, with stale and zeroed gradients side by side (qwen2's
 * biases), a frozen layer, and LoRA (only the adapters train). */
TEST(adamw_in_one_call_gives_bitwise_the_per_segment_steps) {
    static const struct { const char *name, *freeze; unsigned lora; } cs[] = {
        {"tiny-qwen2", NULL, 0}, {"tiny-llama", "layers.1.", 0}, {"tiny-llama", NULL, CF_LORA_Q | CF_LORA_DOWN}};
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        cf_model *on = open_model(cs[ci].name, 130 + ci, cs[ci].freeze, cs[ci].lora);
        setenv("CF_ADAMW_ONE_PASS", "0", 1);
        cf_model *off = open_model(cs[ci].name, 130 + ci, cs[ci].freeze, cs[ci].lora);
        unsetenv("CF_ADAMW_ONE_PASS");
        if (!on || !off) { CHECK(0); cf_model_free(on); cf_model_free(off); return; }
        CHECK_MSG(on->opt.one_pass == 1 && off->opt.one_pass == 0, "%s: one_pass %d, off %d", cs[ci].name,
                  on->opt.one_pass, off->opt.one_pass);
        cf_train_opts o = opts(CF_MODE_CENTRIFUGE, 2);
        cf_trainer *ton = cf_trainer_create(on, &o), *toff = cf_trainer_create(off, &o);
        CHECK(ton && toff);
        int32_t tok[MAXMB * (S + 1)];
        for (int step = 0; step < STEPS && ton && toff; step++) {
            random_tokens(tok, MAXMB * (S + 1), cf_model_config(on)->vocab_size, 140 + step);
            cf_micro_batch mbs[2] = {{tok, NULL}, {tok + S + 1, NULL}};
            cf_step_stats son, soff;
            CHECK(cf_trainer_step(ton, mbs, 1e-2f, &son) == 0 && cf_trainer_step(toff, mbs, 1e-2f, &soff) == 0);
            CHECK_MSG(son.loss == soff.loss && son.grad_norm == soff.grad_norm && son.grad_norm > 0,
                      "%s step %d: loss %.9g vs %.9g, norm %.9g vs %.9g", cs[ci].name, step, son.loss, soff.loss,
                      son.grad_norm, soff.grad_norm);
            CHECK_MSG(same_state(on, off), "%s step %d: weights or moments differ", cs[ci].name, step);
            const char *bad = "";
            CHECK_MSG(states_after_step(on, 1, &bad), "%s step %d: %s not in a step's state", cs[ci].name, step, bad);
        }
        cf_trainer_free(ton);
        cf_trainer_free(toff);
        cf_model_free(on);
        cf_model_free(off);
    }
}

/* CF_GRAD_KEEP=0 at open: every gradient is zeroed by the step (ZERO). */
TEST(grad_keep_0_in_the_environment_turns_stale_gradients_off) {
    setenv("CF_GRAD_KEEP", "0", 1);
    cf_model *m = open_model("tiny-llama", 121, NULL, 0);
    unsetenv("CF_GRAD_KEEP");
    if (!m) { CHECK(0); return; }
    CHECK(m->opt.keep_stale == 0);
    cf_train_opts o = opts(CF_MODE_REGULAR, 1);
    cf_trainer *t = cf_trainer_create(m, &o);
    int32_t tok[S + 1];
    random_tokens(tok, S + 1, cf_model_config(m)->vocab_size, 122);
    cf_micro_batch mb = {tok, NULL};
    cf_step_stats st;
    CHECK(t && cf_trainer_step(t, &mb, 1e-2f, &st) == 0);
    const char *bad = "";
    CHECK_MSG(states_after_step(m, 0, &bad), "%s is not ZERO", bad);
    cf_trainer_free(t);
    cf_model_free(m);
}

int main(void) {
    RUN(stale_gradients_give_bitwise_the_zeroing_steps_even_when_poisoned_in_every_mode);
    RUN(stale_gradients_give_bitwise_the_zeroing_steps_with_frozen_tensors_and_unfused_gate_up);
    RUN(stale_lora_adapter_gradients_give_bitwise_the_zeroing_steps_even_when_poisoned);
    RUN(a_step_leaves_set_only_gradients_stale_holding_old_values_others_zero_and_reads_give_zeros);
    RUN(a_step_without_backward_sees_a_zero_gradient_even_over_poisoned_stale_memory);
    RUN(held_dwpair_rows_over_stale_gradients_are_written_by_the_flush);
    RUN(one_gemm_over_a_stale_and_a_live_gradient_zeroes_the_stale_one_first);
    RUN(grad_keep_0_in_the_environment_turns_stale_gradients_off);
    RUN(adamw_in_one_call_gives_bitwise_the_per_segment_steps);
    return test_summary();
}
