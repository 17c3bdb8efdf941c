/*
 * zero.c — ZeRO-1 data parallelism: the public cf_dist_* API, the shard
 * layout of the optimizer state and the gradient reduction hooks that the
 * engine's training step calls (engine/model_internal.h, cf_grad_sync).
 *
 * One step on W ranks (plan.h for the buffers):
 *   backward, last micro-batch: as each layer's gradients are final, its
 *       bucket is reduce-scattered (sum) in place on the communication
 *       stream, overlapping the backward of the earlier layers; the other
 *       ranks' slices of it are then cleared there (the step never clears
 *       the whole buffer);
 *   optimizer: the compute stream waits for the reductions; the squared
 *       norm of the local shard and the loss sum are all-reduced (the host
 *       waits here, with a deadline, so a dead peer cannot hang the run);
 *       AdamW updates the local shard (fp32 master, m, v) and its bf16
 *       compute weights segment by segment, and each bucket of bf16
 *       weights is all-gathered in place as soon as its segments are done,
 *       overlapping the update of the next ones; the compute stream waits
 *       for the last before the next forward.
 * The gradient of every rank is the sum over ranks of its local gradient:
 * with the trainer's loss weight 1/(counted tokens of all ranks) that is the
 * one-process gradient of the global batch.
 *
 * Checkpoints: rank 0 writes the model (config.json + bf16 safetensors,
 * which a one-GPU run or transformers can load); every rank writes its
 * optimizer shard file (shardfile.h: master slice, m, v, steps, data
 * position); after a barrier rank 0 moves `latest`. A rank killed during
 * the save leaves `latest` on the previous complete checkpoint.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/common.h"
#include "dist/comm.h"
#include "dist/launch.h"
#include "dist/plan.h"
#include "dist/shardfile.h"
#include "dist/tp.h"
#include "dist/zero.h"
#include "engine/model_internal.h"

#ifdef CF_WITH_CUDA
#include <cuda_runtime.h>
#include "backend/cuda/context.h"
#endif


struct cf_dist {
    cf_dist_env env;
    cf_comm *comm;         /* the world */
    /* world = tp x dp, rank = dp_rank x tp + tp_rank (TP innermost) */
    int tp, dp, tp_rank, dp_rank;
    cf_comm *tp_comm;      /* this rank's TP group (NULL when tp = 1; the world when dp = 1) */
    cf_comm *dp_comm;      /* this rank's DP group (NULL when dp = 1; the world when tp = 1) */
    cf_tp_group *tpg;
    int device;
    double timeout_s;
    char describe[512];
    /* set by cf_dist_open_model */
    cf_model *m;
    cf_zero_plan plan;
    int *tensor_of;        /* plan tensor -> model tensor index */
    /* tied embeddings: the all-gathered rows of hook_embedding_rows */
    void *emb_rows;        /* [dp, emb_chunk, C] act */
    int *emb_tok;          /* [dp, emb_chunk] token ids, -1 = no row */
    int emb_chunk;
    int grad_bf16;         /* bf16 gradients on the wire (cf_dist_set_grad_bf16) */
    /* the local shard's segments (the optimizer's, same order) and the
     * buckets [0, gathered) already all-gathered in this step */
    cf_zero_segment *seg;
    int nseg, gathered;
};

int cf_dist_rank(const cf_dist *d) { return d ? d->env.rank : 0; }
int cf_dist_world(const cf_dist *d) { return d ? d->env.world_size : 1; }
int cf_dist_tp(const cf_dist *d) { return d ? d->tp : 1; }
int cf_dist_tp_rank(const cf_dist *d) { return d ? d->tp_rank : 0; }
int cf_dist_dp(const cf_dist *d) { return d ? d->dp : 1; }
int cf_dist_dp_rank(const cf_dist *d) { return d ? d->dp_rank : 0; }

int cf_dist_tp_traffic(cf_dist *d, cf_tp_traffic *out) {
    memset(out, 0, sizeof *out);
    return d && d->tpg ? cf_tp_group_traffic(d->tpg, out) : 0;
}

/* The checkpoint layout: the ZeRO plan and the TP degree (a resume with
 * another split would read the wrong shards). */
static uint64_t layout_hash(const cf_dist *d) { return d->plan.hash ^ ((uint64_t)d->tp * 0x9e3779b97f4a7c15ULL); }
int cf_dist_device(const cf_dist *d) { return d ? d->device : 0; }
int cf_dist_set_grad_bf16(cf_dist *d, int bf16) {
    if (!d) return 0;   /* one process: nothing is reduced */
    if (d->m) return cf_fail("data parallel: the gradient wire format is set before the model is opened");
    d->grad_bf16 = bf16 != 0;
    return 0;
}
const char *cf_dist_describe(const cf_dist *d) { return d ? d->describe : "single process"; }

void cf_dist_free(cf_dist *d) {
    if (!d) return;
    cf_tp_group_free(d->tpg);
    if (d->tp_comm && d->tp_comm != d->comm) cf_comm_destroy(d->tp_comm);
    if (d->dp_comm && d->dp_comm != d->comm) cf_comm_destroy(d->dp_comm);
    cf_comm_destroy(d->comm);
    cf_zero_plan_free(&d->plan);
    free(d->tensor_of);
    free(d->seg);
#ifdef CF_WITH_CUDA
    cudaFree(d->emb_rows);
    cudaFree(d->emb_tok);
#endif
    free(d);
}

void cf_dist_abort(cf_dist *d) {
    if (!d) return;
    if (d->tp_comm && d->tp_comm != d->comm) cf_comm_abort(d->tp_comm);
    if (d->dp_comm && d->dp_comm != d->comm) cf_comm_abort(d->dp_comm);
    if (d->comm) cf_comm_abort(d->comm);
}

int cf_dist_init(cf_dist **out, double timeout_s) { return cf_dist_init_tp(out, 1, timeout_s); }

int cf_dist_init_tp(cf_dist **out, int tp, double timeout_s) {
    *out = NULL;
    cf_dist_env env;
    if (tp < 1) return cf_fail("--tp %d must be at least 1", tp);
    if (cf_dist_env_parse(&env, NULL) != 0) return -1;
    if (cf_dist_check_tp(tp, env.world_size, env.launcher) != 0) return -1;
    if (env.world_size <= 1) return 0;
#ifndef CF_WITH_CUDA
    return cf_fail("%s started %d ranks, but this binary was built without CUDA: data parallel training needs "
                   "centrifuge-cuda (make cuda)", cf_launcher_name(env.launcher), env.world_size);
#else
    int visible = 0;
    cudaError_t e = cudaGetDeviceCount(&visible);
    if (e != cudaSuccess) {
        return cf_fail("rank %d of %d: no usable GPU (%s)", env.rank, env.world_size, cudaGetErrorString(e));
    }
    cf_dist *d = cf_calloc(1, sizeof *d);
    if (!d) return -1;
    d->env = env;
    d->timeout_s = timeout_s > 0 ? timeout_s : CF_COMM_DEFAULT_TIMEOUT_S;
    if (cf_dist_pick_device(&env, visible, &d->device) != 0) { free(d); return -1; }
    d->tp = tp;
    d->dp = env.world_size / tp;
    d->tp_rank = env.rank % tp;
    d->dp_rank = env.rank / tp;
    cf_dist_env_describe(&env, d->describe, (int)sizeof d->describe);
    if (tp > 1) {
        size_t used = strlen(d->describe);
        snprintf(d->describe + used, sizeof d->describe - used, "; tensor parallel %d x data parallel %d (TP rank %d, "
                 "DP rank %d)", tp, d->dp, d->tp_rank, d->dp_rank);
    }
    if (cf_comm_init(&d->comm, &env, d->device, d->timeout_s) != 0) { free(d); return -1; }
    /* 2-D: one split per dimension (collective over the world) */
    if (tp == 1) {
        d->dp_comm = d->comm;
    } else if (d->dp == 1) {
        d->tp_comm = d->comm;
    } else if (cf_comm_split(d->comm, d->dp_rank, d->tp_rank, &d->tp_comm, d->timeout_s) != 0 ||
               cf_comm_split(d->comm, d->tp_rank, d->dp_rank, &d->dp_comm, d->timeout_s) != 0) {
        cf_dist_free(d);
        return -1;
    }
    if (tp > 1 && !(d->tpg = cf_tp_group_create(d->tp_comm, d->timeout_s))) {
        cf_dist_free(d);
        return -1;
    }
    *out = d;
    return 0;
#endif
}

/* ------------------------------------------------------------- agreement */

int cf_dist_agree(cf_dist *d, uint64_t value, const char *what) {
    if (!d) return 0;
#ifdef CF_WITH_CUDA
    /* min and max of the value over ranks, as two int64 all-reduces */
    int64_t host[2] = {(int64_t)(value >> 1), -(int64_t)(value >> 1)};
    int64_t *dev = NULL;
    if (cudaMalloc((void **)&dev, sizeof host) != cudaSuccess) return cf_fail("rank %d: cudaMalloc failed", d->env.rank);
    int rc = cudaMemcpy(dev, host, sizeof host, cudaMemcpyHostToDevice) == cudaSuccess ? 0 : -1;
    if (rc == 0) rc = cf_comm_all_reduce(d->comm, dev, dev, 2, CF_COMM_I64, CF_COMM_MAX, NULL);
    if (rc == 0) rc = cf_comm_wait(d->comm, NULL, d->timeout_s);
    if (rc == 0 && cudaMemcpy(host, dev, sizeof host, cudaMemcpyDeviceToHost) != cudaSuccess) rc = -1;
    cudaFree(dev);
    if (rc != 0) return -1;
    int64_t hi = host[0], lo = -host[1];
    if (hi != lo || (uint64_t)hi != value >> 1)
        return cf_fail("rank %d of %d: the ranks disagree on %s (every rank must be started with the same "
                       "arguments and files)", d->env.rank, d->env.world_size, what);
    return 0;
#else
    (void)value; (void)what;
    return cf_fail("data parallel: built without CUDA");
#endif
}

/* ----------------------------------------------------------------- layout */

int cf_zero_layout_build(const cf_model *m, int world, int rank, cf_zero_plan *plan, int **tensor_of,
                         cf_optim_layout *lay) {
    int n = 0;
    for (int i = 0; i < m->ntensors; i++) n += m->params[i].trainable;
    int64_t *numel = cf_malloc((size_t)(n + 1) * sizeof *numel);
    int *key = cf_malloc((size_t)(n + 1) * sizeof *key);
    int *tof = cf_malloc((size_t)(n + 1) * sizeof *tof);
    *tensor_of = tof;
    if (!numel || !key || !tof) { free(numel); free(key); return -1; }
    int j = 0;
    for (int i = 0; i < m->ntensors; i++) {
        if (!m->params[i].trainable) continue;
        numel[j] = (int64_t)m->params[i].numel;
        key[j] = m->params[i].layer;
        tof[j++] = i;
    }
    int rc = cf_zero_plan_build(plan, numel, key, n, world, CF_ZERO_ALIGN);
    free(numel);
    free(key);
    if (rc != 0) return -1;
    cf_zero_segment *seg = NULL;
    int nseg = 0;
    if (cf_zero_plan_segments(plan, rank, &seg, &nseg) != 0) return -1;
    memset(lay, 0, sizeof *lay);
    lay->ngrad = (size_t)plan->total;
    lay->nlocal = (size_t)plan->shard_numel;
    lay->goff = cf_malloc((size_t)m->ntensors * sizeof(size_t));
    lay->seg = cf_calloc((size_t)nseg + 1, sizeof(cf_segment));
    if (!lay->goff || !lay->seg) { free(seg); cf_optim_layout_free(lay); return -1; }
    for (int i = 0; i < m->ntensors; i++) lay->goff[i] = SIZE_MAX;
    for (int t = 0; t < n; t++) lay->goff[tof[t]] = (size_t)plan->offset[t];
    for (int s = 0; s < nseg; s++) {
        cf_segment *g = &lay->seg[s];
        g->loff = (size_t)seg[s].local_off;
        g->goff = g->woff = (size_t)seg[s].flat_off;
        g->len = (size_t)seg[s].len;
        g->tensor = tof[seg[s].tensor];
    }
    lay->nseg = nseg;
    free(seg);
    return 0;
}

#ifdef CF_WITH_CUDA
/* The optimizer layout of this rank: its DP rank's ZeRO-1 shard. */
static int zero_layout(void *ctx, const cf_model *m, cf_optim_layout *lay) {
    cf_dist *d = ctx;
    return cf_zero_layout_build(m, d->dp, d->dp_rank, &d->plan, &d->tensor_of, lay);
}

/* ------------------------------------------------------------------ hooks */

static cf_cuda_ctx *ctx_of(cf_dist *d) { return (cf_cuda_ctx *)d->m->b->device_context(d->m->b); }

/* Zeroes the flat gradient ranges (start[i], len[i]) on `st`. */
static int clear_grad(cf_dist *d, cudaStream_t st, const int64_t *start, const int64_t *len, int n) {
    for (int i = 0; i < n; i++)
        if (cudaMemsetAsync(d->m->opt.grad + start[i], 0, (size_t)len[i] * sizeof(float), st) != cudaSuccess)
            return cf_fail("rank %d: cudaMemsetAsync of the gradient failed", d->env.rank);
    return 0;
}

static int hook_bucket_ready(void *p, int layer) {
    cf_dist *d = p;
    cf_cuda_ctx *cx = ctx_of(d);
    cf_model *m = d->m;
    float *grad = m->opt.grad;
    const size_t A = m->b->act_size;
    /* bf16 on the wire: each bucket rounded into its own compute weights
     * (the layer's backward, which read them, is enqueued before this;
     * nothing reads them again until the step's all-gather rewrites them) */
    if (d->grad_bf16)
        for (int k = 0; k < d->plan.num_buckets; k++) {
            const cf_zero_bucket *bk = &d->plan.buckets[k];
            if (bk->key == layer)
                m->b->weights_from_master(m->b, (char *)m->w + (size_t)bk->start * A, grad + bk->start, (size_t)bk->len);
        }
    if (cf_cuda_comm_wait_compute(cx) != 0) return -1;
    for (int k = 0; k < d->plan.num_buckets; k++) {
        const cf_zero_bucket *bk = &d->plan.buckets[k];
        if (bk->key != layer) continue;
        const int64_t mine = (int64_t)d->dp_rank * bk->shard_len;
        if (!d->grad_bf16) {
            float *start = grad + bk->start;
            if (cf_comm_reduce_scatter_f32(d->dp_comm, start, start + mine, (size_t)bk->shard_len, cx->comm_stream) != 0)
                return -1;
        } else {
            char *w = (char *)m->w + (size_t)bk->start * A;
            if (cf_comm_reduce_scatter(d->dp_comm, w, w + (size_t)mine * A, (size_t)bk->shard_len, CF_COMM_BF16,
                                       cx->comm_stream) != 0 ||
                cf_cuda_bf16_to_f32_comm(cx, grad + bk->start + mine, w + (size_t)mine * A, (size_t)bk->shard_len) != 0)
                return -1;
        }
        /* the other slices' sums are the other ranks': clear them here, on
         * the communication stream, so the step need not clear the whole
         * buffer (cf_grad_sync.clears_nonlocal) */
        int64_t st[2], len[2];
        if (clear_grad(d, cx->comm_stream, st, len, cf_zero_plan_others(&d->plan, d->dp_rank, k, st, len)) != 0)
            return -1;
    }
    return 0;
}

/* The embedding's gradient (cf_grad_sync.embedding_rows). The embedding rows of
 * every rank's last micro-batch go to every rank (all-gathered in chunks of
 * at most CF_EMB_GATHER_BYTES: [dp, chunk, C] act and [dp, chunk] token ids,
 * unused rows with token -1, which no table row matches); each rank adds
 * them into the table rows its reduced slice holds (cf_zero_plan_rows), in
 * chunk, rank and row order, so every rank's sum is the same deterministic
 * one. Rows outside the slice are written too and never read (the rest of
 * the full gradient buffer is zeroed after the step). This replaces
 * reducing the whole [V, C] fp32 gradient after the embedding backward, the
 * last thing of the backward, with nothing left to overlap it: for
 * Qwen2.5-1.5B (tied) that was 0.93 GB per step, for TinyLlama 0.26 GB,
 * against n x C bf16 rows. */
#define CF_EMB_GATHER_BYTES ((size_t)64 << 20)
/* The chunk budget: CF_EMB_GATHER_BYTES, or CF_DP_GATHER_BYTES from the
 * environment (tests/gpu/dp_check.sh makes it small to run several chunks). */
static size_t gather_budget(void) {
    static size_t v;
    if (!v) {
        const char *e = getenv("CF_DP_GATHER_BYTES");
        long long x = e && *e ? atoll(e) : 0;
        v = x > 0 ? (size_t)x : CF_EMB_GATHER_BYTES;
    }
    return v;
}
static int hook_embedding_rows(void *p, const void *dout, const int *tokens, int n, int cap, int vbase) {
    cf_dist *d = p;
    cf_model *m = d->m;
    cf_backend *b = m->b;
    cf_cuda_ctx *cx = ctx_of(d);
    const int C = m->cfg.hidden_size;
    const size_t A = b->act_size, row = (size_t)C * A;
    if (n < 0 || n > cap) return cf_fail("internal: %d embedding rows for a micro-batch of %d", n, cap);
    int te = -1;
    for (int t = 0; t < d->plan.num_tensors; t++)
        if (d->tensor_of[t] == m->p_embed) te = t;
    if (te < 0) return cf_fail("internal: the embedding is not in the ZeRO-1 plan");
    int64_t r0, r1;
    cf_zero_plan_rows(&d->plan, d->dp_rank, te, C, &r0, &r1);
    /* chunk rows per rank: the same on every rank (same C, dp, cap) */
    size_t fit = gather_budget() / ((size_t)d->dp * row);
    int chunk = (int)(fit < (size_t)cap ? (fit > 0 ? fit : 1) : (size_t)cap);
    if (chunk > d->emb_chunk) {
        cudaFree(d->emb_rows);
        cudaFree(d->emb_tok);
        d->emb_rows = NULL;
        d->emb_tok = NULL;
        d->emb_chunk = 0;
        if (cudaMalloc(&d->emb_rows, (size_t)d->dp * chunk * row) != cudaSuccess ||
            cudaMalloc((void **)&d->emb_tok, (size_t)d->dp * chunk * sizeof(int)) != cudaSuccess)
            return cf_fail("rank %d: out of GPU memory for the embedding rows (%.1f MiB)", d->env.rank,
                           (double)d->dp * chunk * (row + sizeof(int)) / 1048576.0);
        d->emb_chunk = chunk;
    }
    char *my_rows = (char *)d->emb_rows + (size_t)d->dp_rank * chunk * row;
    int *my_tok = d->emb_tok + (size_t)d->dp_rank * chunk;
    float *dembed = cf_grad(m, m->p_embed);
    cf_comm_dtype dt = A == 2 ? CF_COMM_BF16 : CF_COMM_F32;
    for (int c0 = 0; c0 < cap; c0 += chunk) {
        int mine = n - c0 < 0 ? 0 : n - c0 > chunk ? chunk : n - c0;
        if (mine > 0) {
            b->copy(b, my_rows, (const char *)dout + (size_t)c0 * row, (size_t)mine * row);
            b->copy(b, my_tok, tokens + c0, (size_t)mine * sizeof(int));
        }
        if (mine < chunk &&
            cudaMemsetAsync(my_tok + mine, 0xff, (size_t)(chunk - mine) * sizeof(int), cx->stream) != cudaSuccess)
            return cf_fail("rank %d: cudaMemsetAsync failed", d->env.rank);
        if (cf_cuda_comm_wait_compute(cx) != 0 || cf_comm_group_begin(d->dp_comm) != 0) return -1;
        int rc = cf_comm_all_gather(d->dp_comm, d->emb_rows, (size_t)chunk * C, dt, cx->comm_stream);
        if (rc == 0) rc = cf_comm_all_gather(d->dp_comm, d->emb_tok, (size_t)chunk, CF_COMM_I32, cx->comm_stream);
        if (cf_comm_group_end(d->dp_comm) != 0 || rc != 0) return -1;
        /* also after the reduction of the embedding's bucket (same stream) */
        if (cf_cuda_compute_wait_comm(cx) != 0) return -1;
        if (r1 > r0)
            b->embedding_bwd(b, dembed + (size_t)r0 * C, d->emb_rows, d->emb_tok, d->dp * chunk, C,
                             vbase + (int)r0, (int)(r1 - r0));
    }
    /* the first and last of those rows reach into the neighbours' slices,
     * which must stay zero (clears_nonlocal) */
    int64_t st[2], len[2];
    if (clear_grad(d, cx->stream, st, len, cf_zero_plan_row_spill(&d->plan, d->dp_rank, te, C, st, len)) != 0)
        return -1;
    return b->check(b);
}

static int hook_finish(void *p) {
    cf_dist *d = p;
    return cf_cuda_compute_wait_comm(ctx_of(d));
}

/* Fault injection for tests/gpu/dp_check.sh: CF_TEST_DIE_AFTER_NORM=N makes
 * DP rank 1 exit right after the norm's all-reduce of the step that follows
 * N updates (cf_optim.step == N), so
 * the other ranks meet a dead peer in the step's all-gathers (they must fail
 * within --dist-timeout, not hang). */
static void test_fault_after_norm(const cf_dist *d) {
    static long step = -2;
    if (step == -2) {
        const char *e = getenv("CF_TEST_DIE_AFTER_NORM");
        step = e && *e ? atol(e) : -1;
    }
    if (step >= 0 && d->dp_rank == 1 && d->m->opt.step == step) {
        fprintf(stderr, "rank %d: CF_TEST_DIE_AFTER_NORM=%ld: exiting after the norm's all-reduce\n", d->env.rank,
                step);
        _exit(3);
    }
}

static int hook_sum_scalars(void *p, cf_scalars *dev) {
    cf_dist *d = p;
    cf_cuda_ctx *cx = ctx_of(d);
    if (cf_cuda_comm_wait_compute(cx) != 0) return -1;
    /* over the DP group: the TP group already summed the norm (and holds
     * equal losses) */
    if (cf_comm_all_reduce(d->dp_comm, &dev->sumsq, &dev->sumsq, 1, CF_COMM_F64, CF_COMM_SUM, cx->comm_stream) != 0 ||
        cf_comm_all_reduce(d->dp_comm, &dev->loss_sum, &dev->loss_sum, 1, CF_COMM_F32, CF_COMM_SUM, cx->comm_stream) != 0)
        return -1;
    /* the host waits here, with a deadline: a dead peer fails the run */
    if (cf_comm_wait(d->dp_comm, cx->comm_stream, d->timeout_s) != 0) return -1;
    test_fault_after_norm(d);
    return cf_cuda_compute_wait_comm(cx);
}

/* All-gathers the bf16 weights of buckets [d->gathered, upto) in place
 * once the compute stream has updated their local slices. */
static int gather_buckets(cf_dist *d, int upto) {
    if (upto <= d->gathered) return 0;
    cf_cuda_ctx *cx = ctx_of(d);
    if (cf_cuda_comm_wait_compute(cx) != 0) return -1;
    char *w = d->m->w;
    size_t A = d->m->b->act_size;
    cf_comm_dtype dt = A == 2 ? CF_COMM_BF16 : CF_COMM_F32;
    if (cf_comm_group_begin(d->dp_comm) != 0) return -1;
    for (int k = d->gathered; k < upto; k++) {
        const cf_zero_bucket *bk = &d->plan.buckets[k];
        if (cf_comm_all_gather(d->dp_comm, w + (size_t)bk->start * A, (size_t)bk->shard_len, dt, cx->comm_stream) != 0) {
            cf_comm_group_end(d->dp_comm);
            return -1;
        }
    }
    if (cf_comm_group_end(d->dp_comm) != 0) return -1;
    d->gathered = upto;
    return 0;
}

/* AdamW updated segment s: the buckets it completed go out now, while the
 * compute stream updates the next ones (the all-gather of the last
 * bucket is all that is left at the end of the step). Every rank gathers
 * every bucket once per step, in bucket order, at whatever segment it
 * completes on that rank: the same collectives in the same order. */
static int hook_segment_updated(void *p, int s) {
    cf_dist *d = p;
    return gather_buckets(d, cf_zero_plan_buckets_done(&d->plan, d->seg, d->nseg, s));
}

static int hook_weights_updated(void *p) {
    cf_dist *d = p;
    cf_cuda_ctx *cx = ctx_of(d);
    if (gather_buckets(d, d->plan.num_buckets) != 0) return -1;
    d->gathered = 0;
    /* The host waits for the all-gathers here, with the deadline: the step's
     * timing read that follows waits for the compute stream without one,
     * and a peer that died after the norm's all-reduce would leave it
     * waiting forever. (It waited for them there anyway: nothing is lost.) */
    if (cf_comm_wait(d->dp_comm, cx->comm_stream, d->timeout_s) != 0) return -1;
    return cf_cuda_compute_wait_comm(cx);
}
#endif

cf_model *cf_dist_open_model(cf_dist *d, const cf_model_opts *o) {
    if (!d) return cf_model_open(o);
#ifndef CF_WITH_CUDA
    (void)o;
    cf_fail("data parallel: built without CUDA");
    return NULL;
#else
    if (o->backend != CF_BACKEND_CUDA) {
        cf_fail("distributed (data or tensor parallel) training runs on GPUs: add --device cuda (rank %d of %d)",
                d->env.rank, d->env.world_size);
        return NULL;
    }
    if (d->m) { cf_fail("data parallel: one model per run"); return NULL; }
    cf_model_opts oo = *o;
    oo.device = d->device;
    cf_zero_plan_free(&d->plan);
    free(d->tensor_of);
    d->tensor_of = NULL;
    cf_model *m;
    if (d->tp > 1) {
        cf_tp_sync ts = cf_tp_group_sync(d->tpg);
        m = cf_model_open_tp(&oo, &ts, zero_layout, d);
    } else {
        m = cf_model_open_with(&oo, zero_layout, d);
    }
    if (!m) return NULL;
    if (!m->b->device_context) { cf_model_free(m); cf_fail("data parallel: backend without a device context"); return NULL; }
    d->m = m;
    if (d->tpg) cf_tp_group_bind(d->tpg, m);
    if (d->dp > 1) {
        cf_grad_sync *s = &m->opt.sync;
        s->ctx = d;
        s->rank = d->dp_rank;
        s->world = d->dp;
        s->bucket_ready = hook_bucket_ready;
        s->finish = hook_finish;
        s->sum_scalars = hook_sum_scalars;
        s->weights_updated = hook_weights_updated;
        s->segment_updated = hook_segment_updated;
        s->clears_nonlocal = 1;
        s->embedding_rows = hook_embedding_rows;
        free(d->seg);
        d->seg = NULL;
        if (cf_zero_plan_segments(&d->plan, d->dp_rank, &d->seg, &d->nseg) != 0 || d->nseg != m->opt.lay.nseg) {
            cf_model_free(m);
            d->m = NULL;
            cf_fail("internal: the ZeRO-1 segments disagree with the optimizer layout");
            return NULL;
        }
        if (d->grad_bf16) {
            if (m->b->act_size != 2) {
                cf_model_free(m);
                d->m = NULL;
                cf_fail("data parallel: bf16 gradients need the bf16 (cuda) backend");
                return NULL;
            }
            s->weights_staged = 1;
        }
    }
    /* Every rank initialised or loaded the same weights (deterministic in
     * the seed and the files; cf_dist_agree on the arguments checks that
     * the ranks were started alike). */
    return m;
#endif
}

/* ------------------------------------------------------------ checkpoints */

/* Host copies of the local shard: master weights, m, v. */
static int local_state(cf_model *m, float **master, float **am, float **av) {
    size_t n = m->opt.lay.nlocal;
    *master = cf_malloc(n * sizeof(float) + 1);
    *am = cf_malloc(n * sizeof(float) + 1);
    *av = cf_malloc(n * sizeof(float) + 1);
    if (!*master || !*am || !*av) return -1;
    if (m->b->download(m->b, *master, m->opt.master, n * sizeof(float)) != 0) return -1;
    return cf_model_get_adam(m, *am, *av);
}

/* A barrier with a deadline that also agrees on success: every rank passes
 * its local result; all fail if one did. */
static int barrier_ok(cf_dist *d, int ok) {
    if (cf_dist_agree(d, ok ? 2 : 4, "whether the checkpoint was written") != 0) return -1;
    return ok ? 0 : cf_fail("rank %d: checkpoint not written", d->env.rank);
}

int cf_dist_checkpoint_save(cf_dist *d, cf_model *m, const char *dir, int64_t step, int64_t data_pos,
                            int keep_last) {
    if (!d) return cf_checkpoint_save(m, dir, step, data_pos, keep_last);
    char path[4096], err[1024], what[128];
    /* 1. every rank checks its shard (non-finite weights or moments never
     *    become a checkpoint) and rank 0 prepares the step directory (new
     *    or this run's, with its marker), before anyone writes a file */
    float *master = NULL, *am = NULL, *av = NULL;
    int rc = local_state(m, &master, &am, &av);
    snprintf(what, sizeof what, "rank %d: step %lld: checkpoint refused", d->env.rank, (long long)step);
    if (rc == 0 && cf_checkpoint_check_state(m, master, am, av, what) != 0) {
        cf_fail("%s (the run diverged: lower --lr, check the data); %s/latest still names the last good checkpoint",
                cf_last_error(), dir);
        rc = -1;
    }
    if (rc == 0) rc = cf_checkpoint_dir(dir, step, path, sizeof path, d->env.rank == 0);
    snprintf(err, sizeof err, "%s", cf_last_error());
    if (barrier_ok(d, rc == 0) != 0) {
        if (rc != 0) cf_fail("%s", err);
        free(master); free(am); free(av);
        return -1;
    }
    /* 2. rank 0 the model (under TP gathered over the first TP group, whose
     * TP rank 0 is rank 0), every rank its optimizer shard */
    if (d->tp > 1) {
        if (d->dp_rank == 0) rc = cf_model_save_tp(m, path, "bfloat16", d->tp_rank == 0);
    } else if (d->env.rank == 0) {
        rc = m->lora.rank > 0 ? cf_lora_save(m, path, NULL) : cf_model_save(m, path, "bfloat16", 0);
    }
    if (rc == 0) {
        cf_shard_meta meta = {d->env.world_size, d->env.rank, layout_hash(d), (int64_t)m->opt.lay.nlocal,
                              m->opt.step, step, data_pos};
        rc = cf_shardfile_write(path, &meta, master, am, av);
    }
    free(master); free(am); free(av);
    snprintf(err, sizeof err, "%s", cf_last_error());
    if (barrier_ok(d, rc == 0) != 0) {
        if (rc != 0) cf_fail("%s", err);
        return -1;
    }
    /* 3. every shard is on disk: rank 0 moves `latest` */
    if (d->env.rank == 0) {
        if (cf_shardfile_check_set(path, d->env.world_size, layout_hash(d), NULL) != 0) return -1;
        if (cf_checkpoint_commit(dir, step, keep_last) != 0) return -1;
    }
    return 0;
}

cf_model *cf_dist_checkpoint_load(cf_dist *d, const char *dir, const cf_model_opts *opts, int64_t *step,
                                  int64_t *data_pos) {
    if (!d) return cf_checkpoint_load(dir, opts, step, data_pos);
    char path[4096];
    if (cf_checkpoint_latest(dir, path, sizeof path) != 0) return NULL;
    cf_shard_meta r0;
    if (cf_shardfile_check_set(path, d->env.world_size, 0, &r0) != 0) return NULL;
    cf_model_opts o = *opts;
    if (opts->lora.rank > 0) {
        o.lora.rank = 0;
        o.adapter_dir = path;
    } else {
        o.config = NULL;
        o.layers = 0;   /* the checkpoint's config.json has them */
        o.model_dir = path;
    }
    cf_model *m = cf_dist_open_model(d, &o);
    if (!m) return NULL;
    size_t n = m->opt.lay.nlocal;
    float *master = cf_malloc(n * sizeof(float) + 1), *am = cf_malloc(n * sizeof(float) + 1),
          *av = cf_malloc(n * sizeof(float) + 1);
    cf_shard_meta want = {d->env.world_size, d->env.rank, layout_hash(d), (int64_t)n, 0, 0, 0}, got;
    int rc = master && am && av ? cf_shardfile_read(path, &want, &got, master, am, av) : -1;
    /* the exact fp32 master slice replaces the bf16 weights it was saved as */
    /* a shard whose state is not finite would poison every later update */
    if (rc == 0 && cf_checkpoint_check_state(m, master, am, av, path) != 0) {
        cf_fail("%s; the checkpoint is damaged, not resuming from it", cf_last_error());
        rc = -1;
    }
    if (rc == 0) rc = m->b->upload(m->b, m->opt.master, master, n * sizeof(float));
    if (rc == 0) rc = cf_model_set_adam(m, am, av, got.opt_steps);
    free(master); free(am); free(av);
    if (rc != 0) { cf_model_free(m); d->m = NULL; return NULL; }
    *step = got.step;
    *data_pos = got.data_pos;
    return m;
}
