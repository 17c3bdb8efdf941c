/*
 * optim.c — parameter groups and the optimizer: where each trainable
 * tensor's gradient, master weights and AdamW moments live, and the step.
 *
 * Layout. The gradient buffer holds every trainable tensor at goff (with
 * padding that no tensor uses); the compute weights w hold the trainable
 * tensors at the same offsets, then the frozen ones. This process updates
 * the segments of its local shard: with one process, all of them; with
 * ZeRO-1 data parallelism (dist/), a 1/world slice of every bucket. The
 * step walks those contiguous segments:
 *   g' = g * clip_scale;  m = b1 m + (1-b1) g';  v = b2 v + (1-b2) g'^2
 *   p -= lr * (m/(1-b1^t) / (sqrt(v/(1-b2^t)) + eps) + wd * p)
 * with wd = 0 for vectors (norms, biases), then refreshes w from p.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/common.h"
#include "engine/model_internal.h"

/* Offsets padded to 8 elements: 32-byte aligned fp32, 16-byte bf16. */
#define CF_ALIGN 8
static size_t align_up(size_t n) { return (n + CF_ALIGN - 1) / CF_ALIGN * CF_ALIGN; }

int cf_optim_layout_whole(const cf_model *m, cf_optim_layout *lay) { return cf_optim_layout_order(m, NULL, lay); }

int cf_optim_layout_order(const cf_model *m, const int *order, cf_optim_layout *lay) {
    memset(lay, 0, sizeof *lay);
    lay->goff = cf_malloc((size_t)m->ntensors * sizeof(size_t));
    lay->seg = cf_calloc((size_t)m->ntensors + 1, sizeof(cf_segment));
    if (!lay->goff || !lay->seg) { cf_optim_layout_free(lay); return -1; }
    size_t off = 0;
    for (int k = 0; k < m->ntensors; k++) {
        const int i = order ? order[k] : k;
        const cf_param *p = &m->params[i];
        if (!p->trainable) { lay->goff[i] = SIZE_MAX; continue; }
        lay->goff[i] = off;
        cf_segment *s = &lay->seg[lay->nseg++];
        s->loff = s->goff = s->woff = off;
        s->len = p->numel;
        s->tensor = i;
        off = align_up(off + p->numel);
    }
    lay->ngrad = lay->nlocal = off;
    return 0;
}

void cf_optim_layout_free(cf_optim_layout *lay) {
    free(lay->goff);
    free(lay->seg);
    memset(lay, 0, sizeof *lay);
}

/* Checks a layout (a builder's, e.g. a shard plan) before trusting it. */
static int layout_check(const cf_model *m, const cf_optim_layout *lay) {
    for (int i = 0; i < m->ntensors; i++) {
        const cf_param *p = &m->params[i];
        if (!p->trainable) continue;
        if (lay->goff[i] == SIZE_MAX || lay->goff[i] + p->numel > lay->ngrad)
            return cf_fail("internal: optimizer layout puts %s outside the gradient buffer", p->name);
    }
    for (int s = 0; s < lay->nseg; s++) {
        const cf_segment *g = &lay->seg[s];
        if (g->tensor < 0 || g->tensor >= m->ntensors || !m->params[g->tensor].trainable ||
            g->loff + g->len > lay->nlocal || g->goff < lay->goff[g->tensor] ||
            g->goff + g->len > lay->goff[g->tensor] + m->params[g->tensor].numel)
            return cf_fail("internal: optimizer layout segment %d is inconsistent", s);
    }
    return 0;
}

/* The set-only tensors (cf_param.grad_set_only): the trainable weights of
 * the linear layers and their LoRA adapters. Their gradients' only writers
 * are weight-gradient GEMMs that take cf_grad_take_zero's flag (linear.c,
 * the fused gate/up GEMM in backward.c, dwpair.c). Not the embedding (a
 * scatter-add), the LM head (tied: the embedding's gradient; kept out
 * untied too), norm weights or biases (their kernels only add). */
static void mark_set_only(cf_model *m) {
    for (int i = 0; i < m->ntensors; i++) m->params[i].grad_set_only = 0;
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        const cf_layer_params *p = &m->lp[l];
        const cf_linear *lin[7] = {&p->q, &p->k, &p->v, &p->o, &p->gate, &p->up, &p->down};
        for (int t = 0; t < 7; t++) {
            const int idx[3] = {lin[t]->w, lin[t]->la, lin[t]->lb};
            for (int k = 0; k < 3; k++)
                if (idx[k] >= 0 && m->params[idx[k]].trainable) m->params[idx[k]].grad_set_only = 1;
        }
    }
}

/* Whether segment g holds its tensor whole (with one process: always). */
static int segment_whole(const cf_model *m, const cf_segment *g) {
    return g->goff == m->opt.lay.goff[g->tensor] && g->len == m->params[g->tensor].numel;
}

/* Whether the whole-layout gradient of each layer is one range, layers in
 * order (the table's: embedding, layers 0..L-1, final norm, LM head; with
 * LoRA only the adapters train, appended layer by layer: also in order):
 * fills layer_lo/hi (lo = hi: nothing trainable in the layer).
 * CF_NORM_EARLY=0 in the environment: never (A/B timing, cross-checks). */
static int plan_norm_pre(cf_model *m) {
    cf_optim *o = &m->opt;
    const char *e = getenv("CF_NORM_EARLY");
    const int L = m->cfg.num_hidden_layers;
    if ((e && *e == '0') || o->lay.nlocal != o->lay.ngrad) return 0;
    o->layer_lo = cf_calloc((size_t)L, sizeof(size_t));
    o->layer_hi = cf_calloc((size_t)L, sizeof(size_t));
    if (!o->layer_lo || !o->layer_hi) return 0;
    int last = -1; /* the layer of the previous segment; -1 before layer 0 */
    for (int s = 0; s < o->lay.nseg; s++) {
        const cf_segment *g = &o->lay.seg[s];
        const int l = m->params[g->tensor].layer;
        if (g->loff != g->goff || !segment_whole(m, g)) return 0;
        if (l < 0) {
            if (last >= 0) return 0;
            continue;
        }
        if (l < last) return 0;
        if (l >= L) { last = L; continue; }
        if (l != last) {
            if (last == L) return 0;
            o->layer_lo[l] = g->goff;
        }
        o->layer_hi[l] = g->goff + g->len;
        last = l;
    }
    return 1;
}

void cf_norm_pre_begin(cf_model *m, int compact) {
    cf_optim *o = &m->opt;
    o->pre_on = 0;
    /* --profile times op by op: nothing runs beside them */
    if (!o->pre_ok || compact || m->profile || !o->last_micro || o->sync.bucket_ready || o->sync.finish ||
        cf_tp_on(m))
        return;
    m->b->memzero(m->b, &m->scalars->sumsq_pre, sizeof(double));
    o->pre_on = 1;
    o->pre_layers = 0;
}

void cf_norm_pre_layer(cf_model *m, int l) {
    cf_optim *o = &m->opt;
    if (!o->pre_on) return;
    /* a STALE gradient's memory is last step's: only the end of the backward
     * (cf_grad_settle) zeroes it, so such a layer waits for the step */
    for (int i = 0; i < m->ntensors; i++)
        if (m->params[i].layer == l && m->params[i].trainable && o->gstate[i] == CF_GRAD_STALE) {
            o->pre_on = 0;
            return;
        }
    cf_backend *b = m->b;
    if (o->layer_hi[l] > o->layer_lo[l]) {
        const int side = b->side_begin != NULL;
        if (side) b->side_begin(b, 0);
        b->sumsq(b, &m->scalars->sumsq_pre, o->grad + o->layer_lo[l], o->layer_hi[l] - o->layer_lo[l]);
        if (side) b->side_end(b);
    }
    o->pre_layers++;
}

/* 0 when CF_GRAD_KEEP=0 is in the environment: AdamW zeroes every gradient
 * (A/B timing, cross-checks). */
static int keep_stale_env(void) {
    const char *e = getenv("CF_GRAD_KEEP");
    return !(e && *e == '0');
}

/* 0 when CF_ADAMW_ONE_PASS=0 is in the environment: a backend call per
 * segment (A/B timing, cross-checks). */
static int one_pass_env(void) {
    const char *e = getenv("CF_ADAMW_ONE_PASS");
    return !(e && *e == '0');
}

int cf_optim_init(cf_model *m, cf_optim_layout *lay) {
    cf_backend *b = m->b;
    cf_optim *o = &m->opt;
    if (layout_check(m, lay) != 0) { cf_optim_layout_free(lay); return -1; }
    o->lay = *lay;
    memset(lay, 0, sizeof *lay);
    /* w: the trainable region (as the gradient buffer), then frozen tensors */
    size_t off = o->lay.ngrad;
    for (int i = 0; i < m->ntensors; i++) {
        cf_param *p = &m->params[i];
        if (p->trainable) {
            p->goff = p->woff = o->lay.goff[i];
        } else {
            p->goff = SIZE_MAX;
            p->woff = off;
            off = align_up(off + p->numel);
        }
    }
    m->nw = off;
    m->w = b->alloc(b, CF_MAX(m->nw, (size_t)1) * b->act_size);
    if (!m->w) return -1;
    b->memzero(b, m->w, m->nw * b->act_size);
    if (o->lay.ngrad == 0) return 0;   /* everything frozen: inference only */
    o->grad = b->alloc(b, o->lay.ngrad * sizeof(float));
    o->adam_m = b->alloc(b, CF_MAX(o->lay.nlocal, (size_t)1) * sizeof(float));
    o->adam_v = b->alloc(b, CF_MAX(o->lay.nlocal, (size_t)1) * sizeof(float));
    if (!o->grad || !o->adam_m || !o->adam_v) return -1;
    /* CPU computes in fp32: where the local shard is the whole trainable
     * region in place, the compute weights are the master weights. */
    int in_place = b->act_size == sizeof(float) && o->lay.nlocal == o->lay.ngrad;
    for (int s = 0; in_place && s < o->lay.nseg; s++)
        in_place = o->lay.seg[s].loff == o->lay.seg[s].woff;
    o->master = in_place ? (float *)m->w : b->alloc(b, CF_MAX(o->lay.nlocal, (size_t)1) * sizeof(float));
    if (!o->master) return -1;
    b->memzero(b, o->grad, o->lay.ngrad * sizeof(float));
    o->gstate = cf_malloc((size_t)m->ntensors);
    if (!o->gstate) return -1;
    cf_grad_mark_all(m, CF_GRAD_ZERO);
    mark_set_only(m);
    o->keep_stale = keep_stale_env() && cf_grad_set_env();
    o->pre_ok = plan_norm_pre(m);
    o->one_pass = one_pass_env() && b->adamw_segments != NULL;
    o->aseg = cf_calloc((size_t)CF_MAX(o->lay.nseg, 1), sizeof(cf_adamw_seg));
    if (!o->aseg) return -1;
    b->memzero(b, o->adam_m, o->lay.nlocal * sizeof(float));
    b->memzero(b, o->adam_v, o->lay.nlocal * sizeof(float));
    if (!in_place) b->memzero(b, o->master, o->lay.nlocal * sizeof(float));
    return b->check(b);
}

void cf_optim_free(cf_model *m) {
    cf_backend *b = m->b;
    cf_optim *o = &m->opt;
    if (o->master != (float *)m->w) b->free(b, o->master);
    b->free(b, o->grad);
    b->free(b, o->adam_m);
    b->free(b, o->adam_v);
    free(o->gstate);
    o->gstate = NULL;
    free(o->layer_lo);
    free(o->layer_hi);
    o->layer_lo = o->layer_hi = NULL;
    free(o->aseg);
    o->aseg = NULL;
    cf_optim_layout_free(&o->lay);
    o->master = o->grad = o->adam_m = o->adam_v = NULL;
}

int cf_optim_set_tensor(cf_model *m, int i, const float *host) {
    cf_backend *b = m->b;
    cf_param *p = &m->params[i];
    cf_optim *o = &m->opt;
    /* master pieces of this tensor that are local */
    for (int s = 0; p->trainable && s < o->lay.nseg; s++) {
        const cf_segment *g = &o->lay.seg[s];
        if (g->tensor != i) continue;
        if (b->upload(b, o->master + g->loff, host + (g->goff - p->goff), g->len * sizeof(float)) != 0) return -1;
    }
    /* the compute copy of the whole tensor */
    if (p->trainable && o->master == (float *)m->w) return b->check(b);
    b->act_from_f32(b, cf_weight(m, i), host, p->numel);
    return b->check(b);
}

int cf_model_get_adam(cf_model *m, float *m_out, float *v_out) {
    cf_backend *b = m->b;
    size_t n = m->opt.lay.nlocal * sizeof(float);
    if (b->download(b, m_out, m->opt.adam_m, n) != 0) return -1;
    return b->download(b, v_out, m->opt.adam_v, n);
}

int cf_model_set_adam(cf_model *m, const float *m_in, const float *v_in, int64_t step) {
    cf_backend *b = m->b;
    size_t n = m->opt.lay.nlocal * sizeof(float);
    if (b->upload(b, m->opt.adam_m, m_in, n) != 0 || b->upload(b, m->opt.adam_v, v_in, n) != 0) return -1;
    m->opt.step = step;
    return 0;
}

int64_t cf_optimizer_steps(const cf_model *m) { return m->opt.step; }

void cf_model_clear_scalars(cf_model *m) { m->b->memzero(m->b, m->scalars, sizeof(cf_scalars)); }

/* ------------------------------------------------------------------ step */

float cf_lr_schedule(int64_t step, int64_t warmup, int64_t total, float max_lr, float min_lr) {
    if (warmup > 0 && step < warmup) return max_lr * (float)((double)(step + 1) / (double)warmup);
    if (total <= warmup) return max_lr;
    double progress = (double)(step - warmup) / (double)(total - warmup);
    if (progress > 1.0) progress = 1.0;
    return min_lr + 0.5f * (max_lr - min_lr) * (1.0f + (float)cos(M_PI * progress));
}

/* Whether the step may leave the gradient of segment g's tensor STALE: a
 * set-only tensor that the segment holds whole, in one plain process (no
 * gradient reduction hooks, no tensor parallelism: their collectives and
 * buckets read and clear the buffer on their own terms). */
static int may_leave_stale(const cf_model *m, const cf_segment *g) {
    const cf_grad_sync *s = &m->opt.sync;
    if (!m->opt.keep_stale || !m->params[g->tensor].grad_set_only || cf_tp_on(m)) return 0;
    if (s->world > 1 || s->bucket_ready || s->finish || s->sum_scalars || s->segment_updated ||
        s->weights_updated || s->embedding_rows)
        return 0;
    return segment_whole(m, g);
}

/* The step, also reporting the loss sum accumulated since the scalars were
 * last cleared (read in the same transfer as the gradient norm: one host
 * synchronisation per step). */
int cf_step_ex(cf_model *m, const cf_adamw_params *hp, float *grad_norm, double *loss_sum) {
    cf_backend *b = m->b;
    cf_optim *o = &m->opt;
    if (!o->grad) return cf_fail("step: the model has no trainable parameter");
    cf_stage_begin(m, CF_STAGE_OPTIMIZER);
    /* gradients the last step left STALE and no backward has written since
     * are zero: the norm and AdamW must read zeros there */
    cf_grad_settle(m);
    /* the layers' squares, summed by the last backward (cf_norm_pre_*),
     * unless held rows are flushed into their gradients now */
    const int pre = o->pre_on && o->pre_layers == m->cfg.num_hidden_layers && !m->dwp.held &&
                    !m->dwp.head_held;
    o->pre_on = 0;
    /* rows held for a join that never came (the trainer's last micro-batch
     * never holds, so only a caller of its own gets here with some) */
    if (cf_dwpair_flush(m) != 0) return -1;
    if (o->sync.finish && o->sync.finish(o->sync.ctx) != 0) return -1;
    double *acc = pre ? &m->scalars->sumsq_pre : &m->scalars->sumsq;
    if (!pre) b->memzero(b, acc, sizeof(double));
    const int tp = cf_tp_on(m);
    if (tp && m->cfg.qk_norm) {
        /* qwen3's q/k norm weights act on every head: each TP rank's gradient
         * is the sum over its own heads, the whole gradient their sum */
        for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
            float *gq = cf_grad(m, m->lp[l].qn), *gk = cf_grad(m, m->lp[l].kn);
            size_t D = (size_t)m->cfg.head_dim;
            if ((gq && m->tp.allreduce_start(m->tp.ctx, gq, D, CF_TP_F32, CF_TP_STEP) != 0) ||
                (gk && m->tp.allreduce_start(m->tp.ctx, gk, D, CF_TP_F32, CF_TP_STEP) != 0))
                return -1;
        }
        if (m->tp.wait(m->tp.ctx) != 0) return -1;
    }
    /* one reduction per contiguous run of segments: a gap shorter than the
     * alignment is padding between two tensors, always zero (a gap between
     * two buckets' slices of one rank is at least the alignment long).
     * TP: a replicated tensor's gradient is the same on every TP rank, so
     * only TP rank 0 counts it; the split ones are summed over the group. */
    const int skip_replicated = tp && m->tp.rank != 0;
#define SKIP_SEG(s) ((skip_replicated && m->params[o->lay.seg[s].tensor].tp_replicated) || \
                     (pre && m->params[o->lay.seg[s].tensor].layer >= 0 &&                   \
                      m->params[o->lay.seg[s].tensor].layer < m->cfg.num_hidden_layers))
    for (int s = 0; s < o->lay.nseg;) {
        if (SKIP_SEG(s)) { s++; continue; }
        size_t g0 = o->lay.seg[s].goff, g1 = g0 + o->lay.seg[s].len;
        for (s++; s < o->lay.nseg && o->lay.seg[s].goff >= g1 && o->lay.seg[s].goff - g1 < CF_ALIGN && !SKIP_SEG(s); s++)
            g1 = o->lay.seg[s].goff + o->lay.seg[s].len;
        b->sumsq(b, acc, o->grad + g0, g1 - g0);
    }
#undef SKIP_SEG
    o->pre_steps += pre;
    if (tp && cf_tp_allreduce(m, &m->scalars->sumsq, 1, CF_TP_F64, CF_TP_STEP) != 0) return -1;
    if (o->sync.sum_scalars && o->sync.sum_scalars(o->sync.ctx, m->scalars) != 0) return -1;
    cf_scalars sc;
    if (b->download(b, &sc, m->scalars, sizeof sc) != 0) return -1;
    double norm = sqrt(pre ? sc.sumsq_pre : sc.sumsq);
    if (grad_norm) *grad_norm = (float)norm;
    if (loss_sum) *loss_sum = sc.loss_sum;
    if (!isfinite(norm) || !isfinite(sc.loss_sum)) {
        cf_zero_grad(m);
        if (o->sync.weights_staged && o->sync.weights_updated) {
            /* the weights served as the reduction's staging area: the local
             * shard again from the (unchanged) master, then everyone's */
            for (int s = 0; s < o->lay.nseg; s++) {
                const cf_segment *g = &o->lay.seg[s];
                b->weights_from_master(b, (char *)m->w + g->woff * b->act_size, o->master + g->loff, g->len);
            }
            if (o->sync.weights_updated(o->sync.ctx) != 0) return -1;
        }
        cf_stage_end(m, CF_STAGE_OPTIMIZER);
        return b->check(b) != 0 ? -1 : 1;
    }
    float scale = 1.0f;
    if (hp->grad_clip > 0 && norm > hp->grad_clip) scale = (float)(hp->grad_clip / norm);
    o->step++;
    /* Per segment: update, refresh the compute copy, zero the grad; not the
     * grad of a set-only tensor, whose next writer overwrites it anyway (4
     * bytes per element fewer). All segments in one backend call where no
     * hook waits for single segments (data parallel's all-gathers do). */
    const int one_pass = o->one_pass && !o->sync.segment_updated;
    for (int s = 0; s < o->lay.nseg; s++) {
        const cf_segment *g = &o->lay.seg[s];
        const cf_param *p = &m->params[g->tensor];
        const int stale = may_leave_stale(m, g);
        const float wd = p->decay ? hp->weight_decay : 0.0f;
        const int flags = stale ? CF_ADAMW_KEEP_GRAD : 0;
        if (one_pass)
            o->aseg[s] = (cf_adamw_seg){g->loff, g->goff, g->woff, g->len, wd, flags};
        else
            b->adamw(b, o->master + g->loff, (char *)m->w + g->woff * b->act_size, o->grad + g->goff,
                     o->adam_m + g->loff, o->adam_v + g->loff, g->len, hp->lr, hp->beta1, hp->beta2, hp->eps, wd,
                     scale, (int)o->step, flags);
        /* a tensor the segment holds whole holds zeros now, or is STALE */
        if (stale) o->gstate[g->tensor] = CF_GRAD_STALE;
        else if (segment_whole(m, g)) o->gstate[g->tensor] = CF_GRAD_ZERO;
        if (o->sync.segment_updated && o->sync.segment_updated(o->sync.ctx, s) != 0) return -1;
    }
    if (one_pass)
        b->adamw_segments(b, o->master, m->w, o->grad, o->adam_m, o->adam_v, o->aseg, o->lay.nseg, hp->lr, hp->beta1,
                          hp->beta2, hp->eps, scale, (int)o->step);
    if (o->sync.weights_updated) {
        /* the non-local parts of the gradient were reduced elsewhere: they
         * are zero already, or zeroed here */
        if (!o->sync.clears_nonlocal) cf_zero_grad(m);
        else cf_grad_mark_all(m, CF_GRAD_ZERO);
        if (o->sync.weights_updated(o->sync.ctx) != 0) return -1;
    }
    cf_stage_end(m, CF_STAGE_OPTIMIZER);
    return b->check(b);
}

int cf_step(cf_model *m, const cf_adamw_params *hp, float *grad_norm) {
    return cf_step_ex(m, hp, grad_norm, NULL);
}
