/*
 * backend.cu — the CUDA backend: bf16 activations and compute weights, fp32
 * master weights, gradients, optimizer state and statistics. This file only
 * builds the cf_backend table over one device context (context.h); each op
 * family lives in its own file:
 *
 *   memory.cu     alloc/free, transfers, dtype conversions, weights_from_master
 *   gemm.cu       cuBLASLt matmul forward/backward, deterministic column sums
 *   norm.cu       RMSNorm           rope.cu        RoPE, q/k/v split
 *   swiglu.cu     SwiGLU, add       embedding.cu   embedding
 *   dropout.cu    LoRA dropout (counter-based mask, backend/dropout_mask.h)
 *   lmhead.cu     LM head + cross-entropy
 *   select.cu     select_topk, keep_to_rows, fill_dloss, loss_sum, gathers
 *   adamw.cu      AdamW, sumsq
 *   attention/    flash-style attention: common.cuh (tile / mma helpers),
 *                 fwd.cu, bwd.cu, bwd_centrifuge.cu, launch.cu (host side)
 *
 * Ordering. Every op runs on the context's compute stream, in call order, so
 * the driver needs no stream handling; download and synchronize wait for it.
 *
 * Errors. Ops never exit: the first failing CUDA or cuBLASLt call is recorded
 * in the context (sticky) and every later op is a no-op; check, synchronize
 * and download return -1 with the message (backend.h).
 *
 * Determinism. Every op gives bitwise-identical results run to run, except
 * attention backward's dq (fp32 atomics across key tiles) and whatever
 * cuBLASLt chooses (its heuristics pick the same algorithm for the same
 * problem, and no split-K reduction order changes between runs).
 */
#include <stdlib.h>

#include "backend/cuda/cuda_common.cuh"

static int cu_synchronize(cf_backend *b) { return cf_cuda_ctx_synchronize((cf_cuda_ctx *)b->state); }
static int cu_check(cf_backend *b) { return cf_cuda_ctx_check((cf_cuda_ctx *)b->state); }
static void *cu_device_context(cf_backend *b) { return b->state; }
static void cu_side_begin(cf_backend *b, int narrow) {
    if (cf_cuda_ctx *ctx = cf_cuda_enter(b)) cf_cuda_side_begin(ctx, narrow);
}
static void cu_side_end(cf_backend *b) { cf_cuda_side_end((cf_cuda_ctx *)b->state); }
static void cu_side_join(cf_backend *b) {
    if (cf_cuda_ctx *ctx = cf_cuda_enter(b)) cf_cuda_side_join(ctx);
}

/* Time marks: events recorded on the compute stream; the driver reads the
 * elapsed times once per step, so timing costs no synchronisation. */
static int cu_mark(cf_backend *b) {
    cf_cuda_ctx *ctx = (cf_cuda_ctx *)b->state;
    if (ctx->nmarks >= CF_CUDA_MARKS || cf_cuda_ctx_use(ctx) != 0) return -1;
    int i = ctx->nmarks;
    if (!ctx->marks[i] && !CF_CK(ctx, cudaEventCreate(&ctx->marks[i]))) return -1;
    if (!CF_CK(ctx, cudaEventRecord(ctx->marks[i], ctx->stream))) return -1;
    return ctx->nmarks++;
}

static double cu_mark_elapsed(cf_backend *b, int a, int c) {
    cf_cuda_ctx *ctx = (cf_cuda_ctx *)b->state;
    if (a < 0 || c < 0 || a >= ctx->nmarks || c >= ctx->nmarks || cf_cuda_ctx_use(ctx) != 0) return 0.0;
    float ms = 0.0f;
    if (!CF_CK(ctx, cudaEventSynchronize(ctx->marks[c])) ||
        !CF_CK(ctx, cudaEventElapsedTime(&ms, ctx->marks[a], ctx->marks[c])))
        return 0.0;
    return ms * 1e-3;
}

static void cu_marks_reset(cf_backend *b) { ((cf_cuda_ctx *)b->state)->nmarks = 0; }

static void cu_destroy(cf_backend *b) {
    if (!b) return;
    cf_cuda_ctx_destroy((cf_cuda_ctx *)b->state);
    free(b);
}

extern "C" cf_backend *cf_backend_cuda_create(int device) {
    cf_cuda_ctx *ctx = cf_cuda_ctx_create(device);
    if (!ctx) return NULL;
    cf_backend *b = (cf_backend *)calloc(1, sizeof *b);
    if (!b) {
        cf_cuda_ctx_destroy(ctx);
        cf_fail("out of memory creating the CUDA backend");
        return NULL;
    }
    b->state = ctx;
    b->name = "cuda";
    b->device_name = ctx->device_name;
    b->act_size = sizeof(bf16);

    b->alloc = cf_cuda_alloc;
    b->free = cf_cuda_free;
    b->memzero = cf_cuda_memzero;
    b->upload = cf_cuda_upload;
    b->download = cf_cuda_download;
    b->copy = cf_cuda_copy;
    b->act_from_f32 = cf_cuda_act_from_f32;
    b->act_to_f32 = cf_cuda_act_to_f32;
    b->weights_from_master = cf_cuda_weights_from_master;
    b->synchronize = cu_synchronize;
    b->check = cu_check;
    b->destroy = cu_destroy;
    b->side_begin = cu_side_begin;
    b->side_end = cu_side_end;
    b->side_join = cu_side_join;

    b->embedding_fwd = cf_cuda_embedding_fwd;
    b->embedding_bwd = cf_cuda_embedding_bwd;
    b->matmul_fwd = cf_cuda_matmul_fwd;
    b->matmul_fwd_residual = cf_cuda_matmul_fwd_residual;
    b->matmul_bwd = cf_cuda_matmul_bwd;
    b->rmsnorm_fwd = cf_cuda_rmsnorm_fwd;
    b->add_rmsnorm_fwd = cf_cuda_add_rmsnorm_fwd;
    b->rmsnorm_bwd = cf_cuda_rmsnorm_bwd;
    b->rope_fwd = cf_cuda_rope_fwd;
    b->rope_bwd = cf_cuda_rope_bwd;
    b->rope_qk = cf_cuda_rope_qk;
    b->qkv_split_rope = cf_cuda_qkv_split_rope;
    b->qkv_join_rope_bwd = cf_cuda_qkv_join_rope_bwd;
    b->swiglu_fwd = cf_cuda_swiglu_fwd;
    b->swiglu_bwd_rows = cf_cuda_swiglu_bwd_rows;
    b->add = cf_cuda_add;
    b->scale = cf_cuda_scale;
    b->dropout = cf_cuda_dropout;
    b->attention_fwd = cf_cuda_attention_fwd;
    b->attention_bwd = cf_cuda_attention_bwd;
    b->attention_bwd_leaves_idle = cf_cuda_attention_bwd_leaves_idle;
    b->lmhead_loss_fwd = cf_cuda_lmhead_loss_fwd;
    b->lmhead_loss_bwd = cf_cuda_lmhead_loss_bwd;
    b->lmhead_loss_fwd_grad = cf_cuda_lmhead_loss_fwd_grad;
    b->lmhead_loss_bwd_saved = cf_cuda_lmhead_loss_bwd_saved;
    b->lmhead_stats_fwd = cf_cuda_lmhead_stats_fwd;
    b->xent_combine = cf_cuda_xent_combine;
    b->gather_rows = cf_cuda_gather_rows;
    b->sumsq = cf_cuda_sumsq;
    b->adamw = cf_cuda_adamw;
    b->adamw_segments = cf_cuda_adamw_segments;

    b->keep_to_rows = cf_cuda_keep_to_rows;
    b->fill_dloss = cf_cuda_fill_dloss;
    b->loss_sum = cf_cuda_loss_sum;

    b->gather_rows_multi = cf_cuda_gather_rows_multi;
    b->select_topk = cf_cuda_select_topk;
    b->memory_peak = cf_cuda_memory_peak;
    b->memory_info = cf_cuda_memory_info;
    b->device_context = cu_device_context;
    b->mark = cu_mark;
    b->mark_elapsed = cu_mark_elapsed;
    b->marks_reset = cu_marks_reset;
    return b;
}
