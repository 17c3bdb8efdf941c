/*
 * test_dwpair.c — the MLP's weight gradients of two micro-batches in one
 * GEMM (engine/dwpair.c), on the CPU backend: the trainer's step with
 * pairing gives the step without it (CF_DW_PAIR=0 at open) in every
 * mode, compact and full, at 2, 3 and 4 micro-batches and over three steps (the first one
 * never pairs; in the later ones AdamW has left the MLP's gradients STALE:
 * the joining GEMM writes them); pairing happens where it should (the join
 * count) and nowhere else; rows held for a join that never comes are
 * flushed by the step or by a backward that cannot join, and dropped with
 * the gradient by cf_zero_grad. fp32: only the GEMMs' summation order
 * differs, so ~1e-6.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/common.h"
#include "engine/model_internal.h"
#include "model_helpers.h"
#include "test.h"

enum { S = 12, MAXMB = 4 };

/* pair: 0 no MLP pairs (CF_DW_PAIR=0), 1 every mode, 2 the compact modes
 * at keep <= 0.5 only (CF_DW_PAIR_FULL=0), 3 no LM head pairs
 * (CF_DW_PAIR_HEAD=0; the MLP's as in 1) */
static cf_model *model(const char *name, int pair, uint64_t seed) {
    if (!pair) setenv("CF_DW_PAIR", "0", 1);
    if (pair == 2) setenv("CF_DW_PAIR_FULL", "0", 1);
    if (pair == 3) setenv("CF_DW_PAIR_HEAD", "0", 1);
    cf_model *m = make_model(name, seed);
    unsetenv("CF_DW_PAIR");
    unsetenv("CF_DW_PAIR_FULL");
    unsetenv("CF_DW_PAIR_HEAD");
    return m;
}

static cf_train_opts opts(cf_mode mode, double keep, int accum) {
    return test_train_opts(mode, keep, S, accum, 1.0f);
}

/* Three trainer steps of `accum` micro-batches at keep 0.5 on two models of
 * the same weights, on (the path under test) and off (without it): the
 * first step's losses are equal (the same forward), then losses, gradient
 * norms and weights agree to fp32 summation order (~1e-7). */
static void steps_agree(const char *what, cf_model *on, cf_model *off, cf_mode mode, int accum, uint64_t seed) {
    cf_train_opts o = opts(mode, 0.5, accum);
    cf_trainer *ton = cf_trainer_create(on, &o), *toff = cf_trainer_create(off, &o);
    CHECK(ton && toff);
    int32_t tok[MAXMB * (S + 1)];
    for (int step = 0; step < 3 && ton && toff; step++) {
        random_tokens(tok, MAXMB * (S + 1), cf_model_config(on)->vocab_size, seed + 100 * step);
        cf_micro_batch mbs[MAXMB];
        for (int i = 0; i < accum; i++) mbs[i] = (cf_micro_batch){tok + i * (S + 1), NULL};
        cf_step_stats son, soff;
        CHECK(cf_trainer_step(ton, mbs, 1e-2f, &son) == 0);
        CHECK(cf_trainer_step(toff, mbs, 1e-2f, &soff) == 0);
        CHECK_MSG(step ? fabs(son.loss - soff.loss) <= 1e-6 * fabs(soff.loss) : son.loss == soff.loss,
                  "%s %s x%d step %d: losses %.9g vs %.9g", what, cf_mode_name(mode), accum, step, son.loss,
                  soff.loss);
        CHECK_MSG(fabs(son.grad_norm - soff.grad_norm) <= 1e-5 * soff.grad_norm && soff.grad_norm > 0,
                  "%s %s x%d step %d: gradient norms %.9g vs %.9g", what, cf_mode_name(mode), accum, step,
                  son.grad_norm, soff.grad_norm);
        double e = weights_max_rel(on, off);
        CHECK_MSG(e < 1e-5, "%s %s x%d step %d: weights differ by %.3g", what, cf_mode_name(mode), accum, step, e);
    }
    cf_trainer_free(ton);
    cf_trainer_free(toff);
}

TEST(paired_steps_give_the_unpaired_steps_in_every_mode) {
    static const char *const names[] = {"tiny-llama", "tiny-qwen2", "tiny-mistral"};
    const cf_mode modes[] = {CF_MODE_CENTRIFUGE, CF_MODE_STRAWMAN, CF_MODE_CENTRIFUGE_KV, CF_MODE_REGULAR,
                             CF_MODE_LOSS_ONLY};
    for (int ni = 0; ni < 3; ni++)
        for (int mi = 0; mi < 5; mi++)
            for (int accum = 2; accum <= MAXMB; accum++) {
                cf_model *on = model(names[ni], 1, 11 + ni), *off = model(names[ni], 0, 11 + ni);
                if (!on || !off) { CHECK(0); cf_model_free(on); cf_model_free(off); return; }
                CHECK(!on->dwp.off && off->dwp.off);
                steps_agree(names[ni], on, off, modes[mi], accum, accum);
                /* from the second step on (dwpair.c: the stash), a pair per two
                 * micro-batches, the odd last one alone; none held after a step */
                CHECK_MSG(on->dwp.joins == 2 * (accum / 2) && off->dwp.joins == 0 && on->dwp.held == 0,
                          "%s %s x%d: %lld joins in steps 2 and 3 (expected %d), %lld unpaired, %d rows held",
                          names[ni], cf_mode_name(modes[mi]), accum, (long long)on->dwp.joins, 2 * (accum / 2),
                          (long long)off->dwp.joins, on->dwp.held);
                /* the LM head pairs in the compact modes, from the first step */
                const int head = cf_mode_is_compact(modes[mi]) ? 3 * (accum / 2) : 0;
                CHECK_MSG(on->dwp.head_joins == head && off->dwp.head_joins == head && on->dwp.head_held == 0,
                          "%s %s x%d: %lld and %lld LM head joins (expected %d), %d rows held", names[ni],
                          cf_mode_name(modes[mi]), accum, (long long)on->dwp.head_joins,
                          (long long)off->dwp.head_joins, head, on->dwp.head_held);
                cf_model_free(on);
                cf_model_free(off);
            }
}

/* Two backwards of at most half a micro-batch's rows (centrifuge at keep
 * 0.5) pair in a stash of one micro-batch's capacity; regular, loss-only
 * and keep 0.75 take more rows: they pair in a stash of twice that, and not
 * at all with CF_DW_PAIR_FULL=0. A single micro-batch has nothing to pair
 * with. A backward of max_rows rows or more is left to the GEMM alone
 * (dwpair.c: CF_DWPAIR_MAX_ROWS, 4096: a centrifuge sequence of 8192 or a
 * regular one of 4096 stays unpaired, TinyLlama @4096's 2048 kept rows
 * pair). The bound is scaled down here (CF_DWPAIR_MAX_ROWS=64 at open, a
 * factor 64) so the sequences at and around it stay short enough for the
 * CPU attention under ASan; the default bound is checked on its own. */
enum { MAXR = 64 };
TEST(pairing_only_where_two_backwards_fit_the_stash_and_have_few_rows) {
    static const struct { cf_mode mode; double keep; int accum, seq, pair, want, cap2; } cs[] = {
        {CF_MODE_REGULAR, 1.0, 2, S, 1, 1, 1},            {CF_MODE_LOSS_ONLY, 0.5, 2, S, 1, 1, 1},
        {CF_MODE_CENTRIFUGE, 0.75, 2, S, 1, 1, 1},        {CF_MODE_REGULAR, 1.0, 2, S, 2, 0, 0},
        {CF_MODE_LOSS_ONLY, 0.5, 2, S, 2, 0, 0},          {CF_MODE_CENTRIFUGE, 0.75, 2, S, 2, 0, 0},
        {CF_MODE_CENTRIFUGE, 0.5, 1, S, 1, 0, 0},         {CF_MODE_CENTRIFUGE, 0.5, 2, 2 * MAXR, 1, 0, 0},
        {CF_MODE_REGULAR, 1.0, 2, MAXR, 1, 0, 0},         {CF_MODE_CENTRIFUGE, 0.5, 2, S, 2, 1, 0},
        {CF_MODE_CENTRIFUGE, 0.5, 2, MAXR, 1, 1, 0},      {CF_MODE_REGULAR, 1.0, 2, MAXR / 2, 1, 1, 1},
        {CF_MODE_REGULAR, 1.0, 2, MAXR - 1, 1, 1, 1},     {CF_MODE_CENTRIFUGE, 0.5, 2, 2 * MAXR - 2, 1, 1, 0}};
    static int32_t tok[2 * (2 * MAXR + 1)];
    {   /* without the variable, the bound is the measured one */
        cf_model *m = model("tiny-llama", 1, 21);
        CHECK_MSG(m && m->dwp.max_rows == 4096, "default bound %d rows, expected 4096", m ? m->dwp.max_rows : -1);
        cf_model_free(m);
    }
    setenv("CF_DWPAIR_MAX_ROWS", "64", 1);
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        cf_model *m = model("tiny-llama", cs[i].pair, 21);
        if (!m) { CHECK(0); break; }
        CHECK(m->dwp.max_rows == MAXR);
        cf_train_opts o = opts(cs[i].mode, cs[i].keep, cs[i].accum);
        o.seq = cs[i].seq;
        cf_trainer *t = cf_trainer_create(m, &o);
        random_tokens(tok, 2 * (cs[i].seq + 1), cf_model_config(m)->vocab_size, 22);
        cf_micro_batch mbs[2] = {{tok, NULL}, {tok + cs[i].seq + 1, NULL}};
        cf_step_stats st;
        /* two steps: the first one never pairs (the stash waits for it) */
        CHECK(t && cf_trainer_step(t, mbs, 1e-2f, &st) == 0 && cf_trainer_step(t, mbs, 1e-2f, &st) == 0);
        CHECK_MSG(m->dwp.joins == cs[i].want, "%s keep %.2f x%d, %d rows, pair %d: %lld joins, expected %d",
                  cf_mode_name(cs[i].mode), cs[i].keep, cs[i].accum, cs[i].seq, cs[i].pair, (long long)m->dwp.joins,
                  cs[i].want);
        /* the stash: none, one micro-batch's capacity, or twice that */
        const int cap = cs[i].want ? (cs[i].cap2 ? 2 : 1) * cs[i].seq : 0;
        CHECK_MSG(m->dwp.cap == cap, "%s keep %.2f, %d rows: a stash of %d rows, expected %d",
                  cf_mode_name(cs[i].mode), cs[i].keep, cs[i].seq, m->dwp.cap, cap);
        cf_trainer_free(t);
        cf_model_free(m);
    }
    unsetenv("CF_DWPAIR_MAX_ROWS");
}

/* (model_helpers.h) at this file's S */
static int centrifuge_backward(cf_model *m, const int32_t *tok, int more) {
    return centrifuge_backward_of(m, tok, S, more);
}

TEST(held_rows_are_flushed_by_the_step_or_a_backward_that_cannot_join_and_dropped_by_zero_grad) {
    int32_t tok[3 * (S + 1)];
    cf_adamw_params hp = {1e-2f, 0.9f, 0.95f, 1e-3f, 0.1f, 0.0f};
    for (int c = 0; c < 3; c++) {
        cf_model *on = model("tiny-llama", 1, 31 + c), *off = model("tiny-llama", 0, 31 + c);
        if (!on || !off) { CHECK(0); cf_model_free(on); cf_model_free(off); return; }
        random_tokens(tok, 3 * (S + 1), cf_model_config(on)->vocab_size, 40 + c);
        for (int k = 0; k < 2; k++) {
            cf_model *m = k ? off : on;
            /* a first step of the trainer (one micro-batch), after which the model may hold */
            cf_train_opts o = opts(CF_MODE_CENTRIFUGE, 0.5, 1);
            cf_trainer *t = cf_trainer_create(m, &o);
            cf_micro_batch mb = {tok, NULL};
            cf_step_stats st;
            CHECK(t && cf_trainer_step(t, &mb, 1e-2f, &st) == 0 && m->dwp.joins == 0);
            cf_trainer_free(t);
            cf_zero_grad(m);
            CHECK(centrifuge_backward(m, tok, 1) == 0);
            CHECK_MSG(m->dwp.held == (k ? 0 : S / 2), "case %d: %d rows held", c, m->dwp.held);
            if (c == 1) {
                /* a regular backward cannot join: it flushes first */
                float l[S];
                CHECK(cf_forward(m, tok + S + 1, 1, S, l) == 0);
                CHECK(cf_backward(m, CF_MODE_REGULAR, NULL, 1.0f, NULL) == 0);
                CHECK(m->dwp.held == 0 && m->dwp.joins == 0);
            } else if (c == 2) {
                /* cleared with the gradient; the next backward starts afresh */
                cf_zero_grad(m);
                CHECK(m->dwp.held == 0);
                CHECK(centrifuge_backward(m, tok + 2 * (S + 1), 0) == 0);
                CHECK(m->dwp.held == 0 && m->dwp.joins == 0);
            }
            /* c == 0: the step flushes what is held */
            float *g = all_grads(m);
            CHECK(grad_norm(g, cf_model_num_params(m)) > 0);
            free(g);
            CHECK(cf_step(m, &hp, NULL) == 0);
            CHECK(m->dwp.held == 0);
        }
        double e = weights_max_rel(on, off);
        CHECK_MSG(e < 1e-5, "case %d: weights after the step differ by %.3g", c, e);
        cf_model_free(on);
        cf_model_free(off);
    }
}

/* ------------------------------------------------------ the LM head */

TEST(lm_head_pairs_give_the_unpaired_steps_in_the_compact_modes) {
    /* tiny-llama: an LM head of its own; tiny-qwen2: the embedding's */
    static const char *const names[] = {"tiny-llama", "tiny-qwen2"};
    const cf_mode modes[] = {CF_MODE_CENTRIFUGE, CF_MODE_STRAWMAN, CF_MODE_CENTRIFUGE_KV};
    for (int ni = 0; ni < 2; ni++)
        for (int mi = 0; mi < 3; mi++)
            for (int accum = 2; accum <= MAXMB; accum++) {
                cf_model *on = model(names[ni], 1, 51 + ni), *off = model(names[ni], 3, 51 + ni);
                if (!on || !off) { CHECK(0); cf_model_free(on); cf_model_free(off); return; }
                CHECK(!on->dwp.head_off && off->dwp.head_off);
                steps_agree(names[ni], on, off, modes[mi], accum, 300 + accum);
                CHECK_MSG(on->dwp.head_joins == 3 * (accum / 2) && off->dwp.head_joins == 0 &&
                              on->dwp.head_held == 0,
                          "%s %s x%d: %lld LM head joins (expected %d), %lld unpaired, %d rows held", names[ni],
                          cf_mode_name(modes[mi]), accum, (long long)on->dwp.head_joins, 3 * (accum / 2),
                          (long long)off->dwp.head_joins, on->dwp.head_held);
                cf_model_free(on);
                cf_model_free(off);
            }
}

/* A training forward (its LM head keeps g) of seq tokens, the rows of the
 * highest loss kept (the top `keep` of them), a centrifuge backward with
 * loss_scale; more: another micro-batch of the step follows. */
static cf_kept last_kept; /* head_backward's, for another backward of its forward */
static int head_backward(cf_model *m, const int32_t *tok, int seq, double keep, float scale, int more) {
    float l[4 * S];
    uint8_t mask[4 * S];
    m->bwd_follows = 1;
    int rc = cf_forward(m, tok, 1, seq, l);
    m->bwd_follows = 0;
    if (rc != 0) return rc;
    cf_select(l, NULL, 1, seq, keep, CF_SELECT_SELF, 0, 3, mask);
    if (cf_kept_from_mask(m, mask, &last_kept) != 0) return -1;
    m->opt.more_micro = more;
    rc = cf_backward(m, CF_MODE_CENTRIFUGE, &last_kept, scale, NULL);
    m->opt.more_micro = 0;
    return rc;
}

/* The gradients of two models, tensor by tensor (relative L2; the largest,
 * and whether every one of b is nonzero where a's is) */
static double grads_max_rel(cf_model *a, cf_model *b, const char **where) {
    float *ga = all_grads(a), *gb = all_grads(b);
    double e = ga && gb ? max_rel(a, ga, gb, where) : 1.0;
    if (ga && gb && !(grad_norm(gb, cf_model_num_params(b)) > 0)) e = 1.0;
    free(ga);
    free(gb);
    return e;
}

/* After a backward that held its LM head rows: the held rows reach the
 * gradient by a join, or by a flush where none can come: a step's
 * gradient read (c 0), a regular backward (1), a centrifuge backward of
 * another token weight (2), a longer micro-batch, whose forward reallocates
 * the compact copies (3), more kept rows than room after the held ones
 * (4), another backward of the same forward (5); cf_zero_grad drops them
 * (6). Against the same calls with CF_DW_PAIR_HEAD=0, untied and tied. */
TEST(held_lm_head_rows_join_or_are_flushed_where_no_join_can_come) {
    static const char *const names[] = {"tiny-llama", "tiny-qwen2"};
    int32_t tok[4 * (2 * S + 1)];
    for (int ni = 0; ni < 2; ni++)
        for (int c = -1; c <= 6; c++) {
            cf_model *on = model(names[ni], 1, 61 + c), *off = model(names[ni], 3, 61 + c);
            if (!on || !off) { CHECK(0); cf_model_free(on); cf_model_free(off); return; }
            random_tokens(tok, 4 * (2 * S + 1), cf_model_config(on)->vocab_size, 70 + c);
            const int32_t *t2 = tok + 2 * S + 1;
            for (int k = 0; k < 2; k++) {
                cf_model *m = k ? off : on;
                cf_zero_grad(m);
                CHECK(head_backward(m, tok, S, 0.5, 1.0f, 1) == 0);
                CHECK_MSG(m->dwp.head_held == (k ? 0 : S / 2), "%s case %d: %d LM head rows held", names[ni], c,
                          m->dwp.head_held);
                int rc = 0;
                if (c == -1) rc = head_backward(m, t2, S, 0.5, 1.0f, 0); /* the join */
                else if (c == 1) {
                    float l[S];
                    rc = cf_forward(m, t2, 1, S, l);
                    if (rc == 0) rc = cf_backward(m, CF_MODE_REGULAR, NULL, 1.0f, NULL);
                } else if (c == 2) rc = head_backward(m, t2, S, 0.5, 2.0f, 0);
                else if (c == 3) rc = head_backward(m, t2, 2 * S, 0.5, 1.0f, 0);
                else if (c == 4) rc = head_backward(m, t2, S, 0.75, 1.0f, 0);
                else if (c == 5) rc = cf_backward(m, CF_MODE_CENTRIFUGE, &last_kept, 1.0f, NULL);
                else if (c == 6) {
                    cf_zero_grad(m);
                    CHECK(m->dwp.head_held == 0);
                    rc = head_backward(m, t2, S, 0.5, 1.0f, 0);
                }
                CHECK_MSG(rc == 0, "%s case %d: %s", names[ni], c, cf_last_error());
                /* c == 0: the gradient read below flushes */
                if (c > 0) CHECK_MSG(m->dwp.head_held == 0, "%s case %d: %d rows still held", names[ni], c,
                                     m->dwp.head_held);
            }
            CHECK_MSG(on->dwp.head_joins == (c == -1) && off->dwp.head_joins == 0, "%s case %d: %lld joins",
                      names[ni], c, (long long)on->dwp.head_joins);
            const char *where = "?";
            double e = grads_max_rel(on, off, &where);
            CHECK_MSG(e < 1e-5, "%s case %d: gradients differ by %.3g (%s)", names[ni], c, e, where);
            CHECK(on->dwp.head_held == 0);
            cf_model_free(on);
            cf_model_free(off);
        }
}

int main(void) {
    RUN(paired_steps_give_the_unpaired_steps_in_every_mode);
    RUN(pairing_only_where_two_backwards_fit_the_stash_and_have_few_rows);
    RUN(held_rows_are_flushed_by_the_step_or_a_backward_that_cannot_join_and_dropped_by_zero_grad);
    RUN(lm_head_pairs_give_the_unpaired_steps_in_the_compact_modes);
    RUN(held_lm_head_rows_join_or_are_flushed_where_no_join_can_come);
    return test_summary();
}
