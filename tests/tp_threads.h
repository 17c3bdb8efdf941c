/*
 * tp_threads.h — tensor parallelism inside one test process: each TP rank
 * is a thread with its own CPU model, and the collectives of cf_tp_sync are
 * done through shared memory and a barrier (test double of dist/tp.c, which
 * uses NCCL). Ranks must call the collectives in the same order, as with
 * NCCL. CPU activations are fp32, so CF_TP_ACT sums floats.
 *
 * The same for data parallelism (ZeRO-1): dpt_* are the cf_grad_sync hooks
 * of zero.c done with threads (reduce-scatter of each bucket's gradient,
 * the scalars' sum, the all-gather of the updated weights), over the
 * layout of dist/zero.h, so a TP x DP grid runs in one process.
 */
#ifndef CF_TP_THREADS_H
#define CF_TP_THREADS_H

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dist/zero.h"
#include "engine/model_internal.h"

#define TPT_MAX 8

typedef struct {
    int size;
    pthread_barrier_t bar;
    void *ptr[TPT_MAX];          /* each rank's buffer of the collective in flight */
    int64_t calls[3];            /* collectives by phase (fwd, bwd, step), rank 0 */
    int64_t bytes[3];
} tpt_group;

typedef struct {
    tpt_group *g;
    int rank;
    int64_t settles;             /* calls of the settle hook (nothing to wait for here) */
} tpt_rank;

static inline void tpt_group_init(tpt_group *g, int size) {
    memset(g, 0, sizeof *g);
    g->size = size;
    pthread_barrier_init(&g->bar, NULL, (unsigned)size);
}

static inline void tpt_group_destroy(tpt_group *g) { pthread_barrier_destroy(&g->bar); }

/* Sum in rank order into a private copy, then write back: every rank gets
 * bitwise the same result, as NCCL's all-reduce gives. */
static inline int tpt_allreduce(void *ctx, void *x, size_t count, int type, int phase) {
    tpt_rank *r = ctx;
    tpt_group *g = r->g;
    size_t es = type == CF_TP_F64 ? sizeof(double) : sizeof(float);
    g->ptr[r->rank] = x;
    pthread_barrier_wait(&g->bar);
    void *sum = malloc(count * es + 1);
    for (size_t i = 0; i < count; i++) {
        if (type == CF_TP_F64) {
            double s = 0;
            for (int k = 0; k < g->size; k++) s += ((const double *)g->ptr[k])[i];
            ((double *)sum)[i] = s;
        } else {
            float s = 0;
            for (int k = 0; k < g->size; k++) s += ((const float *)g->ptr[k])[i];
            ((float *)sum)[i] = s;
        }
    }
    pthread_barrier_wait(&g->bar);
    memcpy(x, sum, count * es);
    free(sum);
    if (r->rank == 0 && phase >= 0 && phase < 3) {
        g->calls[phase]++;
        g->bytes[phase] += (int64_t)(count * es);
    }
    pthread_barrier_wait(&g->bar);
    return 0;
}

static inline int tpt_wait(void *ctx) { (void)ctx; return 0; }

static inline int tpt_allgather(void *ctx, float *buf, size_t count) {
    tpt_rank *r = ctx;
    tpt_group *g = r->g;
    g->ptr[r->rank] = buf;
    pthread_barrier_wait(&g->bar);
    for (int k = 0; k < g->size; k++)
        if (k != r->rank) memcpy(buf + (size_t)k * count, (const float *)g->ptr[k] + (size_t)k * count, count * sizeof(float));
    pthread_barrier_wait(&g->bar);
    return 0;
}

/* Threads finish their collectives before returning: the settle hook (the
 * host's bounded wait before it blocks on the GPU) only counts its calls. */
static inline int tpt_settle(void *ctx) {
    ((tpt_rank *)ctx)->settles++;
    return 0;
}

/* The cf_tp_sync of rank r (the model copies it; r must outlive the model). */
static inline cf_tp_sync tpt_sync(tpt_rank *r) {
    cf_tp_sync s;
    memset(&s, 0, sizeof s);
    s.ctx = r;
    s.rank = r->rank;
    s.size = r->g->size;
    s.allreduce_start = tpt_allreduce;
    s.wait = tpt_wait;
    s.allgather_f32 = tpt_allgather;
    s.settle = tpt_settle;
    return s;
}

/* ------------------------------------------------------ data parallel */

typedef struct {
    int size;
    pthread_barrier_t bar;
    void *ptr[TPT_MAX];
} dpt_group;

typedef struct {
    dpt_group *g;
    int rank;
    cf_model *m;          /* set after the model is open */
    cf_zero_plan plan;    /* filled by dpt_layout */
    int *tensor_of;
    cf_zero_segment *seg; /* the local segments (dpt_install) */
    int nseg, gathered;   /* buckets [0, gathered) all-gathered this step */
} dpt_rank;

static inline void dpt_group_init(dpt_group *g, int size) {
    memset(g, 0, sizeof *g);
    g->size = size;
    pthread_barrier_init(&g->bar, NULL, (unsigned)size);
}

static inline void dpt_group_destroy(dpt_group *g) { pthread_barrier_destroy(&g->bar); }

/* cf_layout_fn: this DP rank's ZeRO-1 shard */
static inline int dpt_layout(void *ctx, const cf_model *m, cf_optim_layout *lay) {
    dpt_rank *r = ctx;
    return cf_zero_layout_build(m, r->g->size, r->rank, &r->plan, &r->tensor_of, lay);
}

/* Sums n floats at off of every rank's buffer into this rank's (the ranks'
 * order fixed, so the result does not depend on timing). */
static inline void dpt_sum_into(dpt_rank *r, float *mine, size_t off, size_t n) {
    dpt_group *g = r->g;
    g->ptr[r->rank] = mine;
    pthread_barrier_wait(&g->bar);
    float *sum = malloc(n * sizeof(float) + 1);
    for (size_t i = 0; i < n; i++) {
        float s = 0;
        for (int k = 0; k < g->size; k++) s += ((const float *)g->ptr[k])[off + i];
        sum[i] = s;
    }
    pthread_barrier_wait(&g->bar);
    memcpy(mine + off, sum, n * sizeof(float));
    free(sum);
    pthread_barrier_wait(&g->bar);
}

static inline int dpt_bucket_ready(void *ctx, int layer) {
    dpt_rank *r = ctx;
    for (int k = 0; k < r->plan.num_buckets; k++) {
        const cf_zero_bucket *bk = &r->plan.buckets[k];
        if (bk->key != layer) continue;
        /* reduce-scatter: this rank's slice of the bucket gets the sum */
        dpt_sum_into(r, r->m->opt.grad, (size_t)(bk->start + (int64_t)r->rank * bk->shard_len), (size_t)bk->shard_len);
        /* the other slices are cleared (clears_nonlocal), as zero.c does */
        int64_t st[2], len[2];
        int n = cf_zero_plan_others(&r->plan, r->rank, k, st, len);
        for (int i = 0; i < n; i++) memset(r->m->opt.grad + st[i], 0, (size_t)len[i] * sizeof(float));
    }
    return 0;
}

static inline int dpt_finish(void *ctx) { (void)ctx; return 0; }

static inline int dpt_sum_scalars(void *ctx, cf_scalars *sc) {
    dpt_rank *r = ctx;
    dpt_group *g = r->g;
    g->ptr[r->rank] = sc;
    pthread_barrier_wait(&g->bar);
    double sq = 0;
    float ls = 0;
    for (int k = 0; k < g->size; k++) {
        sq += ((const cf_scalars *)g->ptr[k])->sumsq;
        ls += ((const cf_scalars *)g->ptr[k])->loss_sum;
    }
    pthread_barrier_wait(&g->bar);
    sc->sumsq = sq;
    sc->loss_sum = ls;
    pthread_barrier_wait(&g->bar);
    return 0;
}

/* all-gather of the compute weights of buckets [gathered, upto): every
 * rank's slice, one bucket at a time (each a collective of all ranks, in
 * bucket order, reached at whatever segment completes it on each rank) */
static inline int dpt_gather(dpt_rank *r, int upto) {
    dpt_group *g = r->g;
    float *w = r->m->w;
    for (int b = r->gathered; b < upto; b++) {
        const cf_zero_bucket *bk = &r->plan.buckets[b];
        g->ptr[r->rank] = w;
        pthread_barrier_wait(&g->bar);
        for (int k = 0; k < g->size; k++) {
            if (k == r->rank) continue;
            size_t off = (size_t)(bk->start + (int64_t)k * bk->shard_len);
            memcpy(w + off, (const float *)g->ptr[k] + off, (size_t)bk->shard_len * sizeof(float));
        }
        pthread_barrier_wait(&g->bar);
    }
    if (upto > r->gathered) r->gathered = upto;
    return 0;
}

static inline int dpt_segment_updated(void *ctx, int s) {
    dpt_rank *r = ctx;
    return dpt_gather(r, cf_zero_plan_buckets_done(&r->plan, r->seg, r->nseg, s));
}

static inline int dpt_weights_updated(void *ctx) {
    dpt_rank *r = ctx;
    dpt_gather(r, r->plan.num_buckets);
    r->gathered = 0;
    return 0;
}

/* The embedding: every rank's rows are added, in rank then row order, to
 * the table rows this rank's reduced slice holds (zero.c's
 * hook_embedding_rows, with the all-gather done by shared pointers). */
typedef struct { const void *dout; const int *tokens; int n; } dpt_rows;
static inline int dpt_embedding_rows(void *ctx, const void *dout, const int *tokens, int n, int cap, int vbase) {
    dpt_rank *r = ctx;
    dpt_group *g = r->g;
    cf_model *m = r->m;
    (void)cap;
    dpt_rows mine = {dout, tokens, n};
    g->ptr[r->rank] = &mine;
    pthread_barrier_wait(&g->bar);
    int te = -1;
    for (int t = 0; t < r->plan.num_tensors; t++)
        if (r->tensor_of[t] == m->p_embed) te = t;
    int64_t r0 = 0, r1 = 0;
    if (te >= 0) cf_zero_plan_rows(&r->plan, r->rank, te, m->cfg.hidden_size, &r0, &r1);
    float *dembed = cf_grad(m, m->p_embed);
    for (int k = 0; k < g->size && r1 > r0; k++) {
        const dpt_rows *o = g->ptr[k];
        m->b->embedding_bwd(m->b, dembed + (size_t)r0 * m->cfg.hidden_size, o->dout, o->tokens, o->n,
                            m->cfg.hidden_size, vbase + (int)r0, (int)(r1 - r0));
    }
    int64_t st[2], len[2];
    int ns = te >= 0 ? cf_zero_plan_row_spill(&r->plan, r->rank, te, m->cfg.hidden_size, st, len) : 0;
    for (int i = 0; i < ns; i++) memset(m->opt.grad + st[i], 0, (size_t)len[i] * sizeof(float));
    pthread_barrier_wait(&g->bar);
    return te >= 0 ? 0 : -1;
}

/* Installs the hooks on an opened model (its layout from dpt_layout). */
static inline void dpt_install(dpt_rank *r, cf_model *m) {
    r->m = m;
    cf_grad_sync *s = &m->opt.sync;
    s->ctx = r;
    s->rank = r->rank;
    s->world = r->g->size;
    s->bucket_ready = dpt_bucket_ready;
    s->finish = dpt_finish;
    s->sum_scalars = dpt_sum_scalars;
    s->weights_updated = dpt_weights_updated;
    s->segment_updated = dpt_segment_updated;
    s->clears_nonlocal = 1;
    s->embedding_rows = dpt_embedding_rows;
    r->gathered = 0;
    if (cf_zero_plan_segments(&r->plan, r->rank, &r->seg, &r->nseg) != 0 || r->nseg != m->opt.lay.nseg) abort();
}

/* What dpt_layout and dpt_install allocated for a rank. */
static inline void dpt_rank_free(dpt_rank *r) {
    cf_zero_plan_free(&r->plan);
    free(r->tensor_of);
    free(r->seg);
    r->tensor_of = NULL;
    r->seg = NULL;
}

#endif
