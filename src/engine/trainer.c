/*
 * trainer.c — the training step of the library, used by every command that
 * trains or times training (train, bench, demo):
 *
 *   for each micro-batch:  forward (training: LoRA dropout on) -> selection
 *                          -> filter -> backward
 *                          (gradients accumulate; on the last micro-batch
 *                           each finished bucket goes to the gradient
 *                           reduction hook, if data parallel)
 *   then:                  reduction done -> global norm -> clip -> AdamW
 *
 * Loss normalisation. The step's loss is the mean over every counted token
 * of the step (all tokens in regular mode, the kept ones otherwise) of all
 * micro-batches on all ranks:
 *     L = (1/N) sum_{counted t} l_t,   N = counted per micro-batch x accum x world
 * so every counted token's loss gets the weight 1/N in the backward, and
 * the summed gradient is the one-process gradient of the same global batch
 * however it is split. N is known before the first backward: selection
 * keeps round(keep * group) tokens of every group.
 *
 * Host synchronisation: none until the optimizer reads the gradient norm
 * and the loss sum back in one transfer.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/common.h"
#include "engine/model_internal.h"

struct cf_trainer {
    cf_model *m;
    cf_train_opts o;
    int64_t step;
};

cf_trainer *cf_trainer_create(cf_model *m, const cf_train_opts *o) {
    if (!m) { cf_fail("trainer: no model"); return NULL; }
    if (o->batch <= 0 || o->seq <= 0) { cf_fail("trainer: batch %d and sequence %d must be positive", o->batch, o->seq); return NULL; }
    if ((int64_t)o->batch * o->seq > (1 << 28)) { cf_fail("trainer: %d x %d tokens per micro-batch is too many", o->batch, o->seq); return NULL; }
    if (o->grad_accum <= 0) { cf_fail("trainer: grad_accum %d must be positive", o->grad_accum); return NULL; }
    if (o->mode != CF_MODE_REGULAR && !(o->select.keep > 0.0 && o->select.keep <= 1.0)) {
        cf_fail("--keep: %g is outside (0, 1]", o->select.keep);
        return NULL;
    }
    if (!m->opt.grad) { cf_fail("trainer: the model has no trainable parameter"); return NULL; }
    cf_trainer *t = cf_calloc(1, sizeof *t);
    if (!t) return NULL;
    t->m = m;
    t->o = *o;
    return t;
}

void cf_trainer_free(cf_trainer *t) { free(t); }
void cf_trainer_set_step(cf_trainer *t, int64_t step) { t->step = step; }
int cf_trainer_rank(const cf_trainer *t) { return t->m->opt.sync.world > 1 ? t->m->opt.sync.rank : 0; }
int cf_trainer_world(const cf_trainer *t) { return t->m->opt.sync.world > 1 ? t->m->opt.sync.world : 1; }

/* Counted tokens of one micro-batch, from the selection rule. */
static int64_t counted_per_micro(const cf_train_opts *o) {
    int T = o->batch * o->seq;
    if (o->mode == CF_MODE_REGULAR) return T;
    int group = o->select.per_batch ? T : o->seq;
    return (int64_t)cf_select_kept_count(o->select.keep, group) * (T / group);
}

int cf_trainer_step(cf_trainer *t, const cf_micro_batch *mb, float lr, cf_step_stats *st) {
    cf_model *m = t->m;
    const cf_train_opts *o = &t->o;
    int world = cf_trainer_world(t), rank = cf_trainer_rank(t);
    memset(st, 0, sizeof *st);
    int64_t local = counted_per_micro(o) * o->grad_accum;
    float weight = (float)(1.0 / ((double)local * world));
    cf_model_clear_scalars(m);
    for (int mi = 0; mi < o->grad_accum; mi++) {
        m->opt.last_micro = mi == o->grad_accum - 1;
        /* training forward: LoRA dropout on, with masks per (seed, rank,
         * step, micro-batch), so a resumed run draws the masks the
         * uninterrupted one would; off again for any other forward */
        int was_train = m->train;
        m->train = 1;
        m->bwd_follows = 1;   /* its backward follows: the LM head keeps g (issue 17) */
        m->drop_seed = o->select.seed;
        m->drop_next = ((uint64_t)rank << 48) + (uint64_t)t->step * (uint64_t)o->grad_accum + (uint64_t)mi;
        int frc = cf_forward(m, mb[mi].tokens, o->batch, o->seq, NULL);
        m->train = was_train;
        m->bwd_follows = 0;
        if (frc != 0) return -1;
        cf_kept kept = {0, 0};
        if (o->mode != CF_MODE_REGULAR) {
            cf_select_opts so = o->select;
            /* random selection: a stream per (seed, step, micro-batch, rank) */
            so.seed = o->select.seed * 1000003u + (uint64_t)t->step * (uint64_t)o->grad_accum + (uint64_t)mi +
                      ((uint64_t)rank << 48);
            if (cf_select_kept(m, mb[mi].ref, &so, &kept) != 0) return -1;
        }
        /* another backward follows: dwpair.c may hold this one's MLP rows */
        m->opt.more_micro = mi + 1 < o->grad_accum;
        int brc = cf_backward_weighted(m, o->mode, o->mode == CF_MODE_REGULAR ? NULL : &kept, weight);
        m->opt.more_micro = 0;
        if (brc != 0) return -1;
    }
    m->opt.last_micro = 0;
    cf_adamw_params hp = o->adamw;
    hp.lr = lr;
    double loss_sum = 0;
    int rc = cf_step_ex(m, &hp, &st->grad_norm, &loss_sum);
    if (rc < 0) return -1;
    st->skipped = rc == 1;
    st->loss = loss_sum / ((double)local * world);
    st->tokens = (int64_t)o->batch * o->seq * o->grad_accum * world;
    st->kept = local * world;
    cf_model_timings(m, &st->t);
    t->step++;
    return 0;
}
