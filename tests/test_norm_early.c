/*
 * test_norm_early.c — the early gradient norm (engine/optim.c:
 * cf_norm_pre_*), on the CPU backend: the step's last backward adds each
 * layer's squared gradient as soon as the layer is done, and the step only
 * the tensors outside the layers. What is proved here:
 *   - the trainer's steps give the norms and weights of the whole-buffer
 *     pass (CF_NORM_EARLY=0 at open) in regular and centrifuge mode, 1, 2
 *     and 3 micro-batches, over three steps (pairs and STALE gradients from
 *     the second), with biases, a frozen layer and LoRA (its adapters
 *     are appended layer by layer): the norm to fp64 summation order and
 *     fp32 output (1e-6), the weights to the clip scale's last bits;
 *   - the early sum is what the step used (cf_optim.pre_steps counts it)
 *     in the full backwards, and never in the compact ones (centrifuge),
 *     and a step never uses a sum that a later backward, cf_zero_grad or a
 *     flush of held rows made stale: it sums the whole buffer then;
 *   - layouts it cannot split by layer keep the whole-buffer pass.
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

static cf_model *open_model(const char *name, uint64_t seed, const char *freeze, int lora, int early) {
    cf_model_opts o = {0};
    o.config = name;
    o.backend = CF_BACKEND_CPU;
    o.seed = seed;
    o.freeze = freeze;
    if (lora) o.lora = (cf_lora_opts){4, 8.0f, CF_LORA_Q | CF_LORA_V | CF_LORA_DOWN, 0.0f, 0};
    if (!early) setenv("CF_NORM_EARLY", "0", 1);
    cf_model *m = cf_model_open(&o);
    unsetenv("CF_NORM_EARLY");
    if (!m) { printf("    %s\n", cf_last_error()); return NULL; }
    randomize_weights(m, seed ^ 0x5eed, 0.25f, 0.2f);
    return m;
}

/* clip 0.5: the scale clip / norm acts in every step */
static cf_train_opts opts(cf_mode mode, int accum) {
    return test_train_opts(mode, mode == CF_MODE_REGULAR ? 1.0 : 0.5, S, accum, 0.5f);
}

TEST(early_norm_steps_give_the_whole_buffer_steps) {
    static const struct { const char *name, *freeze; int lora; } cs[] = {
        {"tiny-llama", NULL, 0},
        {"tiny-qwen2", NULL, 0},
        {"tiny-qwen3", "layers.1.", 0},   /* a layer with nothing to train */
        {"tiny-llama", NULL, 1},          /* LoRA: only the adapters train, appended layer by layer */
    };
    const cf_mode modes[] = {CF_MODE_REGULAR, CF_MODE_CENTRIFUGE};
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++)
        for (int mi = 0; mi < 2; mi++)
            for (int accum = 1; accum <= MAXMB; accum++) {
                cf_model *on = open_model(cs[ci].name, 31 + ci, cs[ci].freeze, cs[ci].lora, 1);
                cf_model *off = open_model(cs[ci].name, 31 + ci, cs[ci].freeze, cs[ci].lora, 0);
                if (!on || !off) { CHECK(0); cf_model_free(on); cf_model_free(off); return; }
                const char *what = cs[ci].lora ? "lora" : cs[ci].freeze ? "frozen layer" : cs[ci].name;
                CHECK_MSG(on->opt.pre_ok && !off->opt.pre_ok, "%s: pre_ok %d, off %d", what, on->opt.pre_ok,
                          off->opt.pre_ok);
                cf_train_opts o = opts(modes[mi], accum);
                cf_trainer *ton = cf_trainer_create(on, &o), *toff = cf_trainer_create(off, &o);
                CHECK(ton && toff);
                int32_t tok[MAXMB * (S + 1)];
                for (int step = 0; step < STEPS && ton && toff; step++) {
                    random_tokens(tok, MAXMB * (S + 1), cf_model_config(on)->vocab_size, 7 * step + accum);
                    cf_micro_batch mbs[MAXMB];
                    for (int i = 0; i < accum; i++) mbs[i] = (cf_micro_batch){tok + i * (S + 1), NULL};
                    cf_step_stats son, soff;
                    CHECK(cf_trainer_step(ton, mbs, 1e-2f, &son) == 0 && cf_trainer_step(toff, mbs, 1e-2f, &soff) == 0);
                    CHECK_MSG(fabs(son.grad_norm - soff.grad_norm) <= 1e-6 * soff.grad_norm && soff.grad_norm > 0.5f,
                              "%s %s x%d step %d: norms %.9g vs %.9g", what, cf_mode_name(modes[mi]), accum, step,
                              son.grad_norm, soff.grad_norm);
                    const double e = weights_max_rel(on, off);
                    CHECK_MSG(e < 1e-6, "%s %s x%d step %d: weights differ by %.3g", what, cf_mode_name(modes[mi]),
                              accum, step, e);
                }
                /* used in every step of the full backwards; never in the compact ones */
                const int64_t want = modes[mi] == CF_MODE_REGULAR ? STEPS : 0;
                CHECK_MSG(on->opt.pre_steps == want && off->opt.pre_steps == 0,
                          "%s %s x%d: %lld early norms (off: %lld)", what, cf_mode_name(modes[mi]), accum,
                          (long long)on->opt.pre_steps, (long long)off->opt.pre_steps);
                cf_trainer_free(ton);
                cf_trainer_free(toff);
                cf_model_free(on);
                cf_model_free(off);
            }
}

/* cf_step's norm after a last micro-batch's backward (the trainer's flag),
 * then optionally another backward that is not (a caller's own) and
 * optionally cf_zero_grad */
static float step_norm(cf_model *m, const int32_t *tok, int extra, int zero_after) {
    cf_adamw_params hp = {1e-2f, 0.9f, 0.95f, 1e-3f, 0.1f, 0.0f};
    float norm = -1.0f;
    m->opt.last_micro = 1;
    CHECK(cf_forward(m, tok, 1, S, NULL) == 0 && cf_backward(m, CF_MODE_REGULAR, NULL, 1.0f, NULL) == 0);
    m->opt.last_micro = 0;
    if (extra) CHECK(cf_forward(m, tok, 1, S, NULL) == 0 && cf_backward(m, CF_MODE_REGULAR, NULL, 0.5f, NULL) == 0);
    if (zero_after) cf_zero_grad(m);
    CHECK(cf_step(m, &hp, &norm) == 0);
    return norm;
}

TEST(a_step_never_uses_an_early_sum_that_later_gradients_outdate) {
    int32_t tok[S + 1];
    cf_model *m = open_model("tiny-llama", 5, NULL, 0, 1);
    if (!m) { CHECK(0); return; }
    random_tokens(tok, S + 1, cf_model_config(m)->vocab_size, 3);
    float *w0 = malloc(cf_model_num_params(m) * sizeof(float));
    for (int i = 0; i < cf_model_num_tensors(m); i++) cf_model_get_param(m, i, w0 + toff(m, i));
    /* the trainer's way: the last backward's sum is used */
    const float n1 = step_norm(m, tok, 0, 0);
    CHECK_MSG(m->opt.pre_steps == 1 && n1 > 0, "norm %.9g, %lld early", n1, (long long)m->opt.pre_steps);
    /* another backward after it: the whole buffer (1.5 x the gradient) */
    for (int i = 0; i < cf_model_num_tensors(m); i++) cf_model_set_param(m, i, w0 + toff(m, i));
    const float n2 = step_norm(m, tok, 1, 0);
    CHECK_MSG(m->opt.pre_steps == 1 && fabs(n2 - 1.5f * n1) <= 1e-5 * n2, "norms %.9g and %.9g, %lld early", n1, n2,
              (long long)m->opt.pre_steps);
    /* zeroed after the last backward: a zero norm, not the early sum */
    const float n3 = step_norm(m, tok, 0, 1);
    CHECK_MSG(m->opt.pre_steps == 1 && n3 == 0.0f, "norm after cf_zero_grad %.9g, %lld early", n3,
              (long long)m->opt.pre_steps);
    free(w0);
    cf_model_free(m);
}

int main(void) {
    RUN(early_norm_steps_give_the_whole_buffer_steps);
    RUN(a_step_never_uses_an_early_sum_that_later_gradients_outdate);
    return test_summary();
}
