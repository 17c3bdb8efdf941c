/*
 * context.cu — the CUDA device context (context.h): creation on a device,
 * the sticky error state, scratch buffers by name, pinned staging, stream
 * ordering, teardown.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_common.cuh"

/* ================================================================ errors */

int cf_cuda_ctx_fail(cf_cuda_ctx *ctx, const char *fmt, ...) {
    if (!ctx->failed) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(ctx->error, sizeof ctx->error, fmt, ap);
        va_end(ap);
        ctx->failed = 1;
    }
    return cf_fail("%s", ctx->error);
}

int cf_cuda_check_call(cf_cuda_ctx *ctx, cudaError_t e, const char *what, const char *file, int line) {
    if (e == cudaSuccess) return 0;
    /* clear a non-sticky error so that a later query does not see it again */
    cudaGetLastError();
    return cf_cuda_ctx_fail(ctx, "%s: %s (%s:%d)", what, cudaGetErrorString(e), file, line);
}

int cf_cublaslt_check_call(cf_cuda_ctx *ctx, cublasStatus_t s, const char *what, const char *file, int line) {
    if (s == CUBLAS_STATUS_SUCCESS) return 0;
    return cf_cuda_ctx_fail(ctx, "%s: %s (%s:%d)", what, cublasGetStatusString(s), file, line);
}

int cf_cuda_ctx_use(cf_cuda_ctx *ctx) {
    if (ctx->failed) return -1;
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur == ctx->device) return 0;
    return cf_cuda_check_call(ctx, cudaSetDevice(ctx->device), "cudaSetDevice", __FILE__, __LINE__);
}

int cf_cuda_ctx_check(cf_cuda_ctx *ctx) {
    if (cf_cuda_ctx_use(ctx) != 0) return cf_fail("%s", ctx->error);
    /* an asynchronous fault the runtime already knows about; cudaErrorNotReady
     * only means work is still running */
    cudaError_t e = cudaStreamQuery(ctx->stream);
    if (e != cudaSuccess && e != cudaErrorNotReady)
        return cf_cuda_check_call(ctx, e, "CUDA stream", __FILE__, __LINE__);
    return 0;
}

int cf_cuda_ctx_synchronize(cf_cuda_ctx *ctx) {
    if (cf_cuda_ctx_use(ctx) != 0) return cf_fail("%s", ctx->error);
    if (!CF_CK(ctx, cudaStreamSynchronize(ctx->stream)) || !CF_CK(ctx, cudaStreamSynchronize(ctx->comm_stream)) ||
        !CF_CK(ctx, cudaStreamSynchronize(ctx->aux_stream)) ||
        (ctx->side_stream && !CF_CK(ctx, cudaStreamSynchronize(ctx->side_stream))))
        return -1;
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess && total_b - free_b > ctx->mem_peak)
        ctx->mem_peak = total_b - free_b;
    return 0;
}

const char *cf_cuda_format_bytes(size_t bytes, char *buf, size_t cap) {
    const double gib = 1024.0 * 1024.0 * 1024.0, mib = 1024.0 * 1024.0;
    if (bytes >= ((size_t)1 << 30)) snprintf(buf, cap, "%.1f GiB", (double)bytes / gib);
    else if (bytes >= ((size_t)1 << 20)) snprintf(buf, cap, "%.1f MiB", (double)bytes / mib);
    else snprintf(buf, cap, "%zu bytes", bytes);
    return buf;
}

/* ================================================================ scratch */

static const char *const scratch_names[] = {
    "colsum partials", "sumsq partials", "sort keys", "sort values", "sort temporary", "iota",
    "LM-head logits", "LM-head dlogits", "LM-head target logits", "gather descriptors", "keep counts",
    "attention dq accumulator", "attention D", "attention dk (GQA)", "attention dv (GQA)",
    "attention filtered rows", "attention filtered starts", "attention kept out", "attention kept lse",
    "attention padded q", "attention padded k", "attention padded v", "attention padded out",
    "attention padded dout", "attention padded dq", "attention padded dk", "attention padded dv",
    "attention sm90 dq accumulator", "attention sm90 filtered k", "attention sm90 filtered v",
    "attention sm90 part 2 queue",
    "AdamW segments", "rmsnorm_bwd input rows", "rmsnorm_bwd input rstd",
};
static_assert(sizeof scratch_names / sizeof scratch_names[0] == CF_SCR_COUNT, "a name per scratch id");

/* Growing frees the old buffer after the stream's work is done: fine, it
 * happens in the first steps only. */
void *cf_cuda_scratch(cf_cuda_ctx *ctx, cf_cuda_scratch_id id, size_t bytes) {
    if (ctx->failed) return NULL;
    if (bytes == 0) bytes = 16;
    if (ctx->scratch[id].cap < bytes) {
        if (ctx->scratch[id].p) {
            if (!CF_CK(ctx, cudaStreamSynchronize(ctx->stream)) || !CF_CK(ctx, cudaFree(ctx->scratch[id].p)))
                return NULL;
        }
        ctx->scratch[id].p = NULL;
        ctx->scratch[id].cap = 0;
        size_t cap = (bytes + ((size_t)1 << 20) - 1) & ~(((size_t)1 << 20) - 1);
        void *p = NULL;
        cudaError_t e = cudaMalloc(&p, cap);
        if (e != cudaSuccess) {
            cudaGetLastError();
            char need[32], fr[32], tot[32];
            size_t free_b = 0, total_b = 0;
            cudaMemGetInfo(&free_b, &total_b);
            cf_cuda_ctx_fail(ctx,
                             "cudaMalloc of %s (scratch: %s) on GPU %d (%s) failed: %s; %s of %s free; "
                             "try a smaller --batch or --seq, gradient accumulation, or more GPUs "
                             "(data/tensor parallel)",
                             cf_cuda_format_bytes(cap, need, sizeof need), scratch_names[id], ctx->device,
                             ctx->device_name,
                             cudaGetErrorString(e), cf_cuda_format_bytes(free_b, fr, sizeof fr),
                             cf_cuda_format_bytes(total_b, tot, sizeof tot));
            return NULL;
        }
        ctx->scratch[id].p = p;
        ctx->scratch[id].cap = cap;
    }
    return ctx->scratch[id].p;
}

void *cf_cuda_staging(cf_cuda_ctx *ctx, size_t bytes) {
    if (ctx->failed) return NULL;
    if (bytes == 0) bytes = 16;
    /* the previous copy out of the area must have read it */
    if (!CF_CK(ctx, cudaEventSynchronize(ctx->ev_staging))) return NULL;
    if (ctx->staging_cap < bytes) {
        if (ctx->staging && !CF_CK(ctx, cudaFreeHost(ctx->staging))) return NULL;
        ctx->staging = NULL;
        ctx->staging_cap = 0;
        size_t cap = (bytes + 4095) & ~(size_t)4095;
        if (!CF_CK(ctx, cudaHostAlloc(&ctx->staging, cap, cudaHostAllocDefault))) {
            ctx->staging = NULL;
            return NULL;
        }
        ctx->staging_cap = cap;
    }
    return ctx->staging;
}

int cf_cuda_staging_issued(cf_cuda_ctx *ctx) {
    return CF_CK(ctx, cudaEventRecord(ctx->ev_staging, ctx->stream)) ? 0 : -1;
}

/* ================================================================ streams */

int cf_cuda_comm_wait_compute(cf_cuda_ctx *ctx) {
    if (cf_cuda_ctx_use(ctx) != 0) return -1;
    if (!CF_CK(ctx, cudaEventRecord(ctx->ev_compute, ctx->stream)) ||
        !CF_CK(ctx, cudaStreamWaitEvent(ctx->comm_stream, ctx->ev_compute, 0)))
        return -1;
    return 0;
}

int cf_cuda_compute_wait_comm(cf_cuda_ctx *ctx) {
    if (cf_cuda_ctx_use(ctx) != 0) return -1;
    if (!CF_CK(ctx, cudaEventRecord(ctx->ev_comm, ctx->comm_stream)) ||
        !CF_CK(ctx, cudaStreamWaitEvent(ctx->stream, ctx->ev_comm, 0)))
        return -1;
    return 0;
}

/* ============================================================== lifecycle */

void cf_cuda_ctx_destroy(cf_cuda_ctx *ctx) {
    if (!ctx) return;
    /* best effort, also after a failure: errors here are ignored */
    cudaSetDevice(ctx->device);
    if (ctx->stream) cudaStreamSynchronize(ctx->stream);
    if (ctx->comm_stream) cudaStreamSynchronize(ctx->comm_stream);
    if (ctx->aux_stream) cudaStreamSynchronize(ctx->aux_stream);
    if (ctx->side_stream) cudaStreamSynchronize(ctx->side_stream);
    if (ctx->side_open) {
        ctx->stream = ctx->side_main;
        ctx->workspace = ctx->side_main_ws;
    }
    cf_cuda_gemm_release(ctx);
    for (int i = 0; i < CF_SCR_COUNT; i++)
        if (ctx->scratch[i].p) cudaFree(ctx->scratch[i].p);
    if (ctx->staging) cudaFreeHost(ctx->staging);
    if (ctx->workspace) cudaFree(ctx->workspace);
    if (ctx->side_workspace) cudaFree(ctx->side_workspace);
    if (ctx->lt) cublasLtDestroy(ctx->lt);
    if (ctx->ev_compute) cudaEventDestroy(ctx->ev_compute);
    if (ctx->ev_comm) cudaEventDestroy(ctx->ev_comm);
    if (ctx->ev_staging) cudaEventDestroy(ctx->ev_staging);
    if (ctx->ev_fork) cudaEventDestroy(ctx->ev_fork);
    if (ctx->ev_join) cudaEventDestroy(ctx->ev_join);
    if (ctx->ev_side_fork) cudaEventDestroy(ctx->ev_side_fork);
    if (ctx->ev_side_done) cudaEventDestroy(ctx->ev_side_done);
    for (int i = 0; i < CF_CUDA_MARKS; i++)
        if (ctx->marks[i]) cudaEventDestroy(ctx->marks[i]);
    if (ctx->stream) cudaStreamDestroy(ctx->stream);
    if (ctx->comm_stream) cudaStreamDestroy(ctx->comm_stream);
    if (ctx->aux_stream) cudaStreamDestroy(ctx->aux_stream);
    if (ctx->side_stream) cudaStreamDestroy(ctx->side_stream);
    cudaGetLastError();
    free(ctx);
}

/* ========================================================= side sections */

/* The side stream, its events and workspace, at the first section; on any
 * failure none (side_off: sections then run on the compute stream). */
static int side_ready(cf_cuda_ctx *ctx) {
    if (ctx->side_stream) return 1;
    if (ctx->side_off) return 0;
    bool ok = cudaStreamCreateWithPriority(&ctx->side_stream, cudaStreamNonBlocking, ctx->side_prio) == cudaSuccess &&
              cudaEventCreateWithFlags(&ctx->ev_side_fork, cudaEventDisableTiming) == cudaSuccess &&
              cudaEventCreateWithFlags(&ctx->ev_side_done, cudaEventDisableTiming) == cudaSuccess &&
              cudaMalloc(&ctx->side_workspace, ctx->workspace_size) == cudaSuccess;
    if (ok) return 1;
    cudaGetLastError();
    if (ctx->side_stream) cudaStreamDestroy(ctx->side_stream);
    if (ctx->ev_side_fork) cudaEventDestroy(ctx->ev_side_fork);
    if (ctx->ev_side_done) cudaEventDestroy(ctx->ev_side_done);
    if (ctx->side_workspace) cudaFree(ctx->side_workspace);
    ctx->side_stream = NULL;
    ctx->ev_side_fork = ctx->ev_side_done = NULL;
    ctx->side_workspace = NULL;
    ctx->side_off = 1;
    return 0;
}

void cf_cuda_side_begin(cf_cuda_ctx *ctx, int narrow) {
    if (ctx->side_open || ctx->failed || !side_ready(ctx)) return;
    if (!CF_CK(ctx, cudaEventRecord(ctx->ev_side_fork, ctx->stream)) ||
        !CF_CK(ctx, cudaStreamWaitEvent(ctx->side_stream, ctx->ev_side_fork, 0)))
        return;
    ctx->side_main = ctx->stream;
    ctx->side_main_ws = ctx->workspace;
    ctx->stream = ctx->side_stream;
    ctx->workspace = ctx->side_workspace;
    ctx->side_open = 1;
    ctx->side_narrow = narrow != 0;
}

void cf_cuda_side_end(cf_cuda_ctx *ctx) {
    if (!ctx->side_open) return;
    ctx->stream = ctx->side_main;
    ctx->workspace = ctx->side_main_ws;
    ctx->side_open = 0;
    if (CF_CK(ctx, cudaEventRecord(ctx->ev_side_done, ctx->side_stream))) ctx->side_pending = 1;
}

void cf_cuda_side_join(cf_cuda_ctx *ctx) {
    if (!ctx->side_pending) return;
    ctx->side_pending = 0;
    CF_CK(ctx, cudaStreamWaitEvent(ctx->stream, ctx->ev_side_done, 0));
}

cf_cuda_ctx *cf_cuda_ctx_create(int device) {
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0) {
        cudaGetLastError();
        cf_fail("no CUDA device: %s", e != cudaSuccess ? cudaGetErrorString(e) : "device count is 0");
        return NULL;
    }
    if (device < 0 || device >= ndev) {
        cf_fail("no CUDA device %d: %d visible (CUDA_VISIBLE_DEVICES selects them)", device, ndev);
        return NULL;
    }
    cudaDeviceProp prop;
    if ((e = cudaGetDeviceProperties(&prop, device)) != cudaSuccess) {
        cudaGetLastError();
        cf_fail("cudaGetDeviceProperties(%d): %s", device, cudaGetErrorString(e));
        return NULL;
    }
    if (prop.major < 8) {
        cf_fail("CUDA device %d (%s) has compute capability %d.%d; bf16 tensor cores need 8.0 or newer", device,
                prop.name, prop.major, prop.minor);
        return NULL;
    }
    cf_cuda_ctx *ctx = (cf_cuda_ctx *)calloc(1, sizeof *ctx);
    if (!ctx) {
        cf_fail("out of memory creating the CUDA device context");
        return NULL;
    }
    ctx->device = device;
    snprintf(ctx->device_name, sizeof ctx->device_name, "%s", prop.name);
    ctx->cc_major = prop.major;
    ctx->cc_minor = prop.minor;
    ctx->sm_count = prop.multiProcessorCount;
    ctx->smem_optin = prop.sharedMemPerBlockOptin;
    ctx->workspace_size = (size_t)32 << 20;

    /* CF_COMM_PRIORITY=high: the communication stream at the device's
     * highest priority, so that a collective's blocks are scheduled as soon
     * as compute blocks retire instead of queueing behind a whole GEMM wave
     * (an experiment of issue 14; default: the same priority as compute,
     * since high measured within noise of it at DP=2: BENCHMARKS run 14) */
    const char *pe = getenv("CF_COMM_PRIORITY");
    if (pe && *pe && strcmp(pe, "high") != 0 && strcmp(pe, "normal") != 0) {
        free(ctx);
        cf_fail("CF_COMM_PRIORITY=%s: expected high or normal", pe);
        return NULL;
    }
    /* Side sections (backend.h: side_begin) run at the lowest priority and
     * the compute streams one above it, so that the block scheduler gives
     * SMs that free up to the backward's own next kernel before the side
     * work; the communication stream stays level with compute (or at the
     * top with CF_COMM_PRIORITY=high). CF_SIDE_PRIORITY=normal: all level
     * (A/B timing). */
    const char *se = getenv("CF_SIDE_PRIORITY");
    if (se && *se && strcmp(se, "low") != 0 && strcmp(se, "normal") != 0) {
        free(ctx);
        cf_fail("CF_SIDE_PRIORITY=%s: expected low or normal", se);
        return NULL;
    }
    int lo_prio = 0, hi_prio = 0;
    if (cudaDeviceGetStreamPriorityRange(&lo_prio, &hi_prio) != cudaSuccess) {
        cudaGetLastError();
        lo_prio = hi_prio = 0;
    }
    /* CUDA: a smaller number is a higher priority */
    const int main_prio = hi_prio < lo_prio && !(se && strcmp(se, "normal") == 0) ? lo_prio - 1 : lo_prio;
    const int comm_prio = pe && strcmp(pe, "high") == 0 ? hi_prio : main_prio;
    ctx->side_prio = lo_prio;
    int prev = -1;
    if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
    int ok = CF_CK(ctx, cudaSetDevice(device)) &&
             CF_CK(ctx, cudaStreamCreateWithPriority(&ctx->stream, cudaStreamNonBlocking, main_prio)) &&
             CF_CK(ctx, cudaStreamCreateWithPriority(&ctx->comm_stream, cudaStreamNonBlocking, comm_prio)) &&
             CF_CK(ctx, cudaEventCreateWithFlags(&ctx->ev_compute, cudaEventDisableTiming)) &&
             CF_CK(ctx, cudaEventCreateWithFlags(&ctx->ev_comm, cudaEventDisableTiming)) &&
             CF_CK(ctx, cudaEventCreateWithFlags(&ctx->ev_staging, cudaEventDisableTiming)) &&
             CF_CK(ctx, cudaStreamCreateWithPriority(&ctx->aux_stream, cudaStreamNonBlocking, main_prio)) &&
             CF_CK(ctx, cudaEventCreateWithFlags(&ctx->ev_fork, cudaEventDisableTiming)) &&
             CF_CK(ctx, cudaEventCreateWithFlags(&ctx->ev_join, cudaEventDisableTiming)) &&
             CF_LT(ctx, cublasLtCreate(&ctx->lt));
    if (ok) {
        e = cudaMalloc(&ctx->workspace, ctx->workspace_size);
        if (e != cudaSuccess) {
            cudaGetLastError();
            ctx->workspace = NULL;
            cf_cuda_ctx_fail(ctx, "cudaMalloc of the cuBLASLt workspace (32 MiB) on GPU %d (%s): %s", device,
                             prop.name, cudaGetErrorString(e));
            ok = 0;
        }
    }
    if (!ok) {
        char msg[sizeof ctx->error + 512];
        snprintf(msg, sizeof msg, "creating the CUDA context on GPU %d (%s): %s", device, prop.name, ctx->error);
        cf_cuda_ctx_destroy(ctx);
        if (prev >= 0) cudaSetDevice(prev);
        cf_fail("%s", msg);
        return NULL;
    }
    if (prev >= 0 && prev != device) cudaSetDevice(prev);
    return ctx;
}
