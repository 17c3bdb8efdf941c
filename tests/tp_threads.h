/*
 * tp_threads.h — tensor parallelism inside one test process: each TP rank
 * is a thread with its own CPU model, and the collectives of cf_tp_sync are
 * done through shared memory and a barrier (test double of dist/tp.c, which
 * uses NCCL). Ranks must call the collectives in the same order, as with
 * NCCL. CPU activations are fp32, so CF_TP_ACT sums floats.
 */
#ifndef CF_TP_THREADS_H
#define CF_TP_THREADS_H

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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
    return s;
}

#endif
