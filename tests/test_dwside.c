/*
 * test_dwside.c — o's and q/k/v's weight gradients through dwside.c's
 * buffers (engine/dwside.c), on the CPU backend, which has no side
 * sections: CF_DW_SIDE_ATTN=1 forces the path there (in issue order), so
 * what is checked is its data flow: o's dY copied per layer, [dq dk dv]
 * written to the layer's buffer, the weight gradients taken apart from the
 * input and bias gradients, their set-or-add flags (STALE gradients from
 * the second step on). The trainer's steps with the path give the steps
 * without it (CF_DW_SIDE_ATTN=0) in every mode where it applies (the GEMMs
 * are the same, so to fp32 rounding of nothing: 1e-6), at 1 and 3
 * micro-batches (with and without MLP pairs), on Llama, Qwen2 (q/k/v biases:
 * their gradient stays in line) and Mistral; it runs from the second step
 * in each of them, and never in centrifuge-kv (q/k/v not joined there), with
 * LoRA (frozen projections), or on Qwen3 (q/k norms: not joined).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/common.h"
#include "engine/model_internal.h"
#include "model_helpers.h"
#include "test.h"

enum { S = 12, MAXMB = 3 };

static cf_model *model(const char *name, int side, uint64_t seed) {
    setenv("CF_DW_SIDE_ATTN", side ? "1" : "0", 1);
    cf_model *m = make_model(name, seed);
    unsetenv("CF_DW_SIDE_ATTN");
    return m;
}

/* three steps of `accum` micro-batches on both models: losses, gradient
 * norms and weights agree after each step */
static void lockstep(const char *what, cf_model *on, cf_model *off, cf_mode mode, int accum) {
    cf_train_opts o = test_train_opts(mode, 0.5, S, accum, 1.0f);
    cf_trainer *ton = cf_trainer_create(on, &o), *toff = cf_trainer_create(off, &o);
    CHECK(ton && toff);
    int32_t tok[MAXMB * (S + 1)];
    for (int step = 0; step < 3 && ton && toff; step++) {
        random_tokens(tok, accum * (S + 1), cf_model_config(on)->vocab_size, 70 + 10 * step + accum);
        cf_micro_batch mbs[MAXMB];
        for (int i = 0; i < accum; i++) mbs[i] = (cf_micro_batch){tok + i * (S + 1), NULL};
        cf_step_stats son, soff;
        CHECK(cf_trainer_step(ton, mbs, 1e-2f, &son) == 0 && cf_trainer_step(toff, mbs, 1e-2f, &soff) == 0);
        CHECK_MSG(fabs(son.loss - soff.loss) <= 1e-6 * fabs(soff.loss), "%s step %d: losses %.9g vs %.9g", what,
                  step, son.loss, soff.loss);
        CHECK_MSG(fabs(son.grad_norm - soff.grad_norm) <= 1e-6 * soff.grad_norm && soff.grad_norm > 0,
                  "%s step %d: gradient norms %.9g vs %.9g", what, step, son.grad_norm, soff.grad_norm);
        const double e = weights_max_rel(on, off);
        CHECK_MSG(e < 1e-6, "%s step %d: weights differ by %.3g", what, step, e);
    }
    cf_trainer_free(ton);
    cf_trainer_free(toff);
}

TEST(attention_weight_gradients_through_the_side_buffers_give_the_in_line_steps) {
    static const char *const names[] = {"tiny-llama", "tiny-qwen2", "tiny-mistral"};
    const cf_mode modes[] = {CF_MODE_REGULAR, CF_MODE_LOSS_ONLY, CF_MODE_CENTRIFUGE, CF_MODE_STRAWMAN};
    char what[128];
    for (int ni = 0; ni < 3; ni++)
        for (int mi = 0; mi < 4; mi++)
            for (int accum = 1; accum <= MAXMB; accum += 2) {
                cf_model *on = model(names[ni], 1, 5 + ni), *off = model(names[ni], 0, 5 + ni);
                if (!on || !off) { CHECK(0); cf_model_free(on); cf_model_free(off); return; }
                snprintf(what, sizeof what, "%s %s x%d", names[ni], cf_mode_name(modes[mi]), accum);
                lockstep(what, on, off, modes[mi], accum);
                /* from the second step on (the buffers wait for it), every backward */
                CHECK_MSG(on->dws.backwards == 2 * accum && off->dws.backwards == 0 && on->dws.cap == S,
                          "%s: %lld backwards beside (expected %d), %lld in line, buffers of %d rows", what,
                          (long long)on->dws.backwards, 2 * accum, (long long)off->dws.backwards, on->dws.cap);
                cf_model_free(on);
                cf_model_free(off);
            }
}

TEST(no_side_buffers_where_q_k_v_do_not_join_or_the_projections_are_frozen) {
    /* centrifuge-kv's q/k/v backward takes every row's dk, dv: not joined */
    cf_model *m = model("tiny-llama", 1, 9), *ref = model("tiny-llama", 0, 9);
    if (m && ref) {
        lockstep("tiny-llama centrifuge-kv", m, ref, CF_MODE_CENTRIFUGE_KV, 1);
        CHECK_MSG(m->dws.backwards == 0 && !m->dws.buf, "centrifuge-kv: %lld backwards beside",
                  (long long)m->dws.backwards);
    } else {
        CHECK(0);
    }
    cf_model_free(m);
    cf_model_free(ref);
    /* Qwen3's q/k norms: q/k/v not joined */
    m = model("tiny-qwen3", 1, 10);
    ref = model("tiny-qwen3", 0, 10);
    if (m && ref) {
        lockstep("tiny-qwen3 regular", m, ref, CF_MODE_REGULAR, 1);
        CHECK_MSG(m->dws.backwards == 0 && !m->dws.buf, "qwen3: %lld backwards beside", (long long)m->dws.backwards);
    } else {
        CHECK(0);
    }
    cf_model_free(m);
    cf_model_free(ref);
    /* LoRA on every projection: the base weights are frozen */
    setenv("CF_DW_SIDE_ATTN", "1", 1);
    cf_model_opts o = {0};
    o.config = "tiny-llama";
    o.backend = CF_BACKEND_CPU;
    o.seed = 11;
    o.lora = (cf_lora_opts){4, 8.0f, 0x7f, 0.0f, 0};
    m = cf_model_open(&o);
    unsetenv("CF_DW_SIDE_ATTN");
    if (m) {
        cf_train_opts to = test_train_opts(CF_MODE_REGULAR, 0.5, S, 1, 1.0f);
        cf_trainer *t = cf_trainer_create(m, &to);
        int32_t tok[S + 1];
        random_tokens(tok, S + 1, cf_model_config(m)->vocab_size, 12);
        cf_micro_batch mb = {tok, NULL};
        cf_step_stats st;
        for (int step = 0; step < 2 && t; step++) CHECK(cf_trainer_step(t, &mb, 1e-2f, &st) == 0);
        CHECK_MSG(t && m->dws.backwards == 0 && !m->dws.buf, "LoRA: %lld backwards beside",
                  (long long)m->dws.backwards);
        cf_trainer_free(t);
    } else {
        CHECK_MSG(0, "%s", cf_last_error());
    }
    cf_model_free(m);
}

int main(void) {
    RUN(attention_weight_gradients_through_the_side_buffers_give_the_in_line_steps);
    RUN(no_side_buffers_where_q_k_v_do_not_join_or_the_projections_are_frozen);
    return test_summary();
}
