/*
 * tp.c — tensor-parallel collectives over NCCL (see tp.h). Every collective
 * is enqueued on the device context's communication stream after it waits
 * for the compute stream; the compute stream waits for the communication
 * stream only when the engine asks (wait), so the backward's input-gradient
 * all-reduce overlaps the weight-gradient GEMMs. The optimizer step's
 * collective (the squared gradient norm) is waited for by the host with a
 * deadline: a dead or hung peer makes the run fail there, never hang.
 */
#include "dist/tp.h"

#include <stdlib.h>
#include <string.h>

#include "base/common.h"

#ifdef CF_WITH_CUDA
#include <cuda_runtime.h>

#include "backend/cuda/context.h"

#define TP_EVENTS 2048   /* timed collectives between two reads of the counters */

struct cf_tp_group {
    cf_comm *comm;
    double timeout_s;
    cf_model *m;
    cf_tp_traffic acc;
    int step_pending;            /* a STEP collective was started since the last wait */
    int nev;
    cudaEvent_t ev[2 * TP_EVENTS];
    int phase[TP_EVENTS];
    int have_events;
};

static cf_cuda_ctx *ctx_of(cf_tp_group *g) {
    if (!g->m) { cf_fail("internal: tensor-parallel collective before the model was bound"); return NULL; }
    return (cf_cuda_ctx *)g->m->b->device_context(g->m->b);
}

/* Moves the finished timed collectives into the counters. */
static int resolve_events(cf_tp_group *g) {
    if (!g->nev) return 0;
    /* the events follow collectives: wait for those with the deadline first */
    cf_cuda_ctx *cx = ctx_of(g);
    if (!cx || cf_comm_wait(g->comm, cx->comm_stream, g->timeout_s) != 0) return -1;
    if (cudaEventSynchronize(g->ev[2 * g->nev - 1]) != cudaSuccess)
        return cf_fail("tensor parallel: waiting for the collectives' timing events failed");
    for (int i = 0; i < g->nev; i++) {
        float ms = 0;
        if (cudaEventElapsedTime(&ms, g->ev[2 * i], g->ev[2 * i + 1]) == cudaSuccess)
            g->acc.seconds[g->phase[i]] += ms * 1e-3;
    }
    g->nev = 0;
    return 0;
}

static int timed_begin(cf_tp_group *g, cf_cuda_ctx *cx, int phase, int *slot) {
    *slot = -1;
    if (!g->have_events) return 0;
    if (g->nev == TP_EVENTS && resolve_events(g) != 0) return -1;
    *slot = g->nev++;
    g->phase[*slot] = phase;
    return cudaEventRecord(g->ev[2 * *slot], cx->comm_stream) == cudaSuccess ? 0 : cf_fail("cudaEventRecord failed");
}

static int timed_end(cf_tp_group *g, cf_cuda_ctx *cx, int slot) {
    if (slot < 0) return 0;
    return cudaEventRecord(g->ev[2 * slot + 1], cx->comm_stream) == cudaSuccess ? 0 : cf_fail("cudaEventRecord failed");
}

static int hook_allreduce_start(void *p, void *x, size_t count, int type, int phase) {
    cf_tp_group *g = p;
    cf_cuda_ctx *cx = ctx_of(g);
    if (!cx || cf_cuda_comm_wait_compute(cx) != 0) return -1;
    cf_comm_dtype dt = type == CF_TP_F64 ? CF_COMM_F64 : type == CF_TP_F32 ? CF_COMM_F32
                     : g->m->b->act_size == 2 ? CF_COMM_BF16 : CF_COMM_F32;
    size_t es = dt == CF_COMM_F64 ? 8 : dt == CF_COMM_BF16 ? 2 : 4;
    if (phase < 0 || phase > 2) phase = CF_TP_STEP;
    int slot;
    if (timed_begin(g, cx, phase, &slot) != 0) return -1;
    if (cf_comm_all_reduce(g->comm, x, x, count, dt, CF_COMM_SUM, cx->comm_stream) != 0) return -1;
    if (timed_end(g, cx, slot) != 0) return -1;
    g->acc.calls[phase]++;
    g->acc.bytes[phase] += (int64_t)(count * es);
    if (phase == CF_TP_STEP) g->step_pending = 1;
    return 0;
}

static int hook_wait(void *p) {
    cf_tp_group *g = p;
    cf_cuda_ctx *cx = ctx_of(g);
    if (!cx) return -1;
    if (g->step_pending) {
        /* the host waits here, with a deadline (once per optimizer step) */
        g->step_pending = 0;
        if (cf_comm_wait(g->comm, cx->comm_stream, g->timeout_s) != 0) return -1;
    }
    return cf_cuda_compute_wait_comm(cx);
}

static int hook_settle(void *p) {
    cf_tp_group *g = p;
    cf_cuda_ctx *cx = ctx_of(g);
    if (!cx) return -1;
    g->step_pending = 0;
    return cf_comm_wait(g->comm, cx->comm_stream, g->timeout_s);
}

static int hook_allgather_f32(void *p, float *buf, size_t count) {
    cf_tp_group *g = p;
    cf_cuda_ctx *cx = ctx_of(g);
    if (!cx || cf_cuda_comm_wait_compute(cx) != 0) return -1;
    int slot;
    if (timed_begin(g, cx, CF_TP_FWD, &slot) != 0) return -1;
    if (cf_comm_all_gather(g->comm, buf, count, CF_COMM_F32, cx->comm_stream) != 0) return -1;
    if (timed_end(g, cx, slot) != 0) return -1;
    g->acc.calls[CF_TP_FWD]++;
    g->acc.bytes[CF_TP_FWD] += (int64_t)(count * 4);
    return cf_cuda_compute_wait_comm(cx);
}

cf_tp_group *cf_tp_group_create(cf_comm *comm, double timeout_s) {
    cf_tp_group *g = cf_calloc(1, sizeof *g);
    if (!g) return NULL;
    g->comm = comm;
    g->timeout_s = timeout_s > 0 ? timeout_s : CF_COMM_DEFAULT_TIMEOUT_S;
    g->have_events = 1;
    for (int i = 0; i < 2 * TP_EVENTS && g->have_events; i++)
        if (cudaEventCreate(&g->ev[i]) != cudaSuccess) {
            for (int j = 0; j < i; j++) cudaEventDestroy(g->ev[j]);
            g->have_events = 0;   /* counters without times */
        }
    return g;
}

void cf_tp_group_free(cf_tp_group *g) {
    if (!g) return;
    if (g->have_events)
        for (int i = 0; i < 2 * TP_EVENTS; i++) cudaEventDestroy(g->ev[i]);
    free(g);
}

cf_tp_sync cf_tp_group_sync(cf_tp_group *g) {
    cf_tp_sync s;
    memset(&s, 0, sizeof s);
    s.ctx = g;
    s.rank = cf_comm_rank(g->comm);
    s.size = cf_comm_size(g->comm);
    s.allreduce_start = hook_allreduce_start;
    s.wait = hook_wait;
    s.allgather_f32 = hook_allgather_f32;
    s.settle = hook_settle;
    return s;
}

void cf_tp_group_bind(cf_tp_group *g, cf_model *m) { g->m = m; }

int cf_tp_group_traffic(cf_tp_group *g, cf_tp_traffic *out) {
    int rc = resolve_events(g);
    *out = g->acc;
    memset(&g->acc, 0, sizeof g->acc);
    return rc;
}

#else /* no CUDA: tensor parallelism needs GPUs; cf_dist_init_tp refuses first */

cf_tp_group *cf_tp_group_create(cf_comm *comm, double timeout_s) {
    (void)comm; (void)timeout_s;
    cf_fail("tensor parallel: built without CUDA");
    return NULL;
}
void cf_tp_group_free(cf_tp_group *g) { (void)g; }
cf_tp_sync cf_tp_group_sync(cf_tp_group *g) {
    cf_tp_sync s;
    (void)g;
    memset(&s, 0, sizeof s);
    return s;
}
void cf_tp_group_bind(cf_tp_group *g, cf_model *m) { (void)g; (void)m; }
int cf_tp_group_traffic(cf_tp_group *g, cf_tp_traffic *out) {
    (void)g;
    memset(out, 0, sizeof *out);
    return 0;
}
#endif
