/*
 * context.h — the CUDA device context: everything one CUDA backend owns on
 * one GPU. Plain C (it only needs the CUDA runtime and cuBLASLt headers), so
 * C modules such as the collectives can include it and reach the streams
 * through cf_backend.device_context.
 *
 * A context is bound to one device. Every op of the backend runs on its
 * compute stream and first makes that device current (cf_cuda_ctx_use), so
 * several contexts on several GPUs can be driven from one host thread. The
 * communication stream is for collectives; cf_cuda_comm_wait_compute and
 * cf_cuda_compute_wait_comm order the two streams with the context's events.
 * Both streams are non-blocking: nothing in the backend uses the legacy
 * default stream.
 *
 * Errors are sticky per context: the first failing CUDA / cuBLASLt call (or
 * any cf_cuda_ctx_fail) records "what: error string (file:line)" and sets
 * cf_fail with it; from then on every op is a no-op and check, synchronize
 * and download return -1 with that message.
 */
#ifndef CF_CUDA_CONTEXT_H
#define CF_CUDA_CONTEXT_H

#include <stddef.h>
#include <cublasLt.h>
#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Scratch buffers by name. Each one is a device buffer that only grows
 * (cf_cuda_scratch); a name is used by one op family only, so two live
 * uses never share a buffer. */
typedef enum {
    CF_SCR_COLSUM = 0,     /* column-sum partials (dbias, rmsnorm dw)       gemm.cu    */
    CF_SCR_SUMSQ,          /* sumsq per-block partials                      adamw.cu   */
    CF_SCR_SORT_KEYS,      /* embedding backward: sorted tokens             embedding  */
    CF_SCR_SORT_VALS,      /*   rows in token order                                    */
    CF_SCR_SORT_TMP,       /*   cub radix sort temporary                               */
    CF_SCR_IOTA,           /*   0..T-1                                                 */
    CF_SCR_LOGITS,         /* LM head: bf16 (or fp32) logits of a row chunk lmhead.cu  */
    CF_SCR_DLOGITS,        /*   bf16 dlogits of a row chunk                            */
    CF_SCR_LM_TARGET,      /*   exact target logits of a row chunk (bf16 logits)       */
    CF_SCR_GATHER_DESC,    /* gather_rows_multi descriptors                 select.cu  */
    CF_SCR_KEEP_COUNTS,    /* keep_to_rows: kept count per sequence                    */
    CF_SCR_ATTN_DQ_ACC,    /* attention backward: fp32 dq accumulator       attention/ */
    CF_SCR_ATTN_DVEC,      /*   D_i = dO_i . O_i                                       */
    CF_SCR_ATTN_DKX,       /*   GQA: fp32 dk per query head                            */
    CF_SCR_ATTN_DVX,       /*   GQA: fp32 dv per query head                            */
    CF_SCR_ATTN_FILT,      /*   centrifuge: filtered rows                              */
    CF_SCR_ATTN_FSTART,    /*   centrifuge: filtered rows' sequence starts             */
    CF_SCR_ATTN_O_KEPT,    /*   strawman: out of the kept-only forward                 */
    CF_SCR_ATTN_LSE_KEPT,  /*   strawman: lse of the kept-only forward                 */
    CF_SCR_ATTN_PAD_Q,     /*   head-dim padding (head dims without a kernel)          */
    CF_SCR_ATTN_PAD_K,
    CF_SCR_ATTN_PAD_V,
    CF_SCR_ATTN_PAD_O,
    CF_SCR_ATTN_PAD_DO,
    CF_SCR_ATTN_PAD_DQ,
    CF_SCR_ATTN_PAD_DK,
    CF_SCR_ATTN_PAD_DV,
    CF_SCR_ATTN_SM90_DQ,   /*   Hopper backward: dq accumulator in slot order          */
    CF_SCR_ATTN_SM90_KF,   /*   Hopper centrifuge: K rows of the filtered keys         */
    CF_SCR_ATTN_SM90_VF,   /*   Hopper centrifuge: V rows of the filtered keys         */
    CF_SCR_ATTN_SM90_QUEUE, /*  Hopper centrifuge part 2: its work queue's counter     */
    CF_SCR_ADAMW_SEGS,     /* adamw_segments: the segment table             adamw.cu   */
    CF_SCR_NORM_X,         /* rmsnorm_bwd by a row map: the input's rows    norm.cu    */
    CF_SCR_NORM_RSTD,      /*   and their rstd, for the column-sum fallback            */
    CF_SCR_COUNT
} cf_cuda_scratch_id;

/* A cached cuBLASLt plan: descriptors and the chosen algorithm for one
 * problem (shape, dtypes, epilogue, pointer alignment, beta 0 or not);
 * choice: its index among the heuristic's results, candidates: how many of
 * them were bit-identical to the first (gemm.cu). */
typedef struct {
    int key[16];
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c, d;
    cublasLtMatmulAlgo_t algo;
    int choice, candidates;
} cf_gemm_plan;
#define CF_GEMM_CACHE 256
#define CF_ATTN_PLANS 4    /* attention backward plans kept (attn_plans) */
#define CF_ATTN_PLAN_KEY 9 /* ints in a plan's key */

typedef struct cf_cuda_ctx {
    /* the device */
    int device;                 /* index among the visible GPUs            */
    char device_name[256];
    int cc_major, cc_minor;     /* compute capability                      */
    int sm_count;
    size_t smem_optin;          /* max dynamic shared memory per block     */

    /* streams and events */
    cudaStream_t stream;        /* compute: every op of the backend        */
    cudaStream_t comm_stream;   /* communication (collectives)             */
    cudaEvent_t ev_compute;     /* compute -> comm ordering                */
    cudaEvent_t ev_comm;        /* comm -> compute ordering                */
    cudaEvent_t ev_staging;     /* last async copy out of the staging area */
    /* a second compute stream for independent kernels inside one op
     * (attention/launch.cu: centrifuge part 2 beside part 1), forked from
     * and joined back into `stream` within the op */
    cudaStream_t aux_stream;
    cudaEvent_t ev_fork, ev_join;
    /* side sections (backend.h: side_begin): weight-gradient GEMMs and
     * squared norms on a stream of their own with a cuBLASLt workspace of
     * their own (sumsq's scratch is used by nothing else), created
     * at the first section. While a section is open, `stream` and
     * `workspace` are the side ones and side_main, side_main_ws hold the
     * compute stream's; ev_side_done marks the end of the last section. */
    cudaStream_t side_stream, side_main;
    cudaEvent_t ev_side_fork, ev_side_done;
    void *side_workspace, *side_main_ws;
    int side_open, side_pending, side_off;
    int side_narrow;            /* the open section's GEMMs leave SMs free (gemm.cu: side_sms) */
    int side_prio;              /* the side stream's priority (the lowest)  */

    /* cuBLASLt */
    cublasLtHandle_t lt;
    void *workspace;
    size_t workspace_size;
    cf_gemm_plan plans[CF_GEMM_CACHE];
    int nplans;

    /* scratch buffers by name, and pinned host staging for small async
     * host -> device copies (gather descriptors) */
    struct { void *p; size_t cap; } scratch[CF_SCR_COUNT];
    void *staging;
    size_t staging_cap;

    /* one bit per (attention kernel, head dim) whose shared-memory limit
     * has been raised on this device (attention/launch.cu) */
    unsigned attn_attr_done;
    /* attention's code path on this device, chosen at its first call
     * (attention/launch.cu: 0 = not yet, 1 = portable, 2 = Hopper), and one
     * bit per Hopper kernel whose shared-memory limit has been raised
     * (attention/sm90.cuh: SM90_ATTR_*) */
    int attn_path;
    unsigned attn_sm90_attr_done;
    /* query heads per Hopper backward block and parts of a key tile's
     * query range: 0 = chosen by the plan (attention/bwd_sm90.cu:
     * attn_sm90_bwd_plan); tests set 1 to 4 heads, 1 or 2 parts */
    int attn_bwd_hpb;
    int attn_bwd_split;
    /* consumer warpgroups of the Hopper forward at head dim 64: 0 = chosen
     * by the grid's size (attention/fwd_sm90.cu: fwd_wg64); tests set 2, 3 */
    int attn_fwd_wg;
    /* the ping-pong turns of centrifuge part 2's consumers on Hopper
     * (attention/bwd_centrifuge_sm90.cu: dq_pingpong): 0 = the default,
     * 1 = off, 2 = on (tests) */
    int attn_cf_pingpong;
    /* the grid of centrifuge part 2 on Hopper (attention/
     * bwd_centrifuge_sm90.cu: dq_grid): 0 = the default, 1 = a block per
     * work item, 2 = a block per SM, 3 = four blocks (tests) */
    int attn_cf_grid;
    /* how centrifuge's Hopper parts run (attention/launch.cu: parts_mode):
     * 0 = the default, 1 = part 2 after part 1, 2 = beside it on the second
     * stream, 3 = chained on one stream (tests) */
    int attn_cf_parts;
    /* 1: no pairs of blocks for the dk, dv partials (attention/bwd_sm90.cu:
     * attn_sm90_bwd_pair; tests); and per Hopper backward kernel, whether
     * its clusters of two were asked about and fit */
    int attn_bwd_nopair;
    unsigned attn_pair_checked, attn_pair_ok;
    /* the plans of the last CF_ATTN_PLANS shapes (attn_sm90_bwd_plan):
     * key = D, H, Hkv, B, q and k max lengths, filtered keys per sequence beside, forced hpb, ns */
    struct {
        int key[CF_ATTN_PLAN_KEY];
        int hpb, ns; /* hpb 0: empty */
    } attn_plans[CF_ATTN_PLANS];
    int attn_plan_next;
    /* the LM head's cluster kernel (lmhead.cu: lmhead_cluster_plan): the
     * vocabulary size, logit bytes and asked cluster size last planned for
     * (zeros: none yet; the attribute and placement queries run once per
     * vocabulary, not at every chunk) and its cluster size (0: the
     * one-block kernel) */
    int lmhead_cluster_key[3], lmhead_cluster_cl;

    /* time marks on the compute stream (backend.h: mark), created lazily */
#define CF_CUDA_MARKS 4096
    cudaEvent_t marks[CF_CUDA_MARKS];
    int nmarks;

    /* sticky error */
    int failed;
    char error[1024];

    /* device memory in use (cudaMemGetInfo), max over sync points */
    size_t mem_peak;
} cf_cuda_ctx;

/* Creates a context on visible device `device`; NULL with cf_fail. */
cf_cuda_ctx *cf_cuda_ctx_create(int device);
void cf_cuda_ctx_destroy(cf_cuda_ctx *ctx);

/* Makes the context's device current (if it is not). 0, or -1 when the
 * context has failed before or the switch fails. Every op starts with it. */
int cf_cuda_ctx_use(cf_cuda_ctx *ctx);

/* Records a failure (the first one sticks) and sets cf_fail with the first
 * message; returns -1. */
int cf_cuda_ctx_fail(cf_cuda_ctx *ctx, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* 0 if the call succeeded; else records "what: <error string> (file:line)"
 * and returns -1. */
int cf_cuda_check_call(cf_cuda_ctx *ctx, cudaError_t e, const char *what, const char *file, int line);
int cf_cublaslt_check_call(cf_cuda_ctx *ctx, cublasStatus_t s, const char *what, const char *file, int line);

/* The first error so far without waiting (an asynchronous kernel fault
 * already known to the runtime counts): 0, or -1 with cf_fail set. */
int cf_cuda_ctx_check(cf_cuda_ctx *ctx);

/* Side sections (backend.h): begin, end, join. Without a side stream (it
 * could not be created) the section's work stays on the compute stream. */
void cf_cuda_side_begin(cf_cuda_ctx *ctx, int narrow);
void cf_cuda_side_end(cf_cuda_ctx *ctx);
void cf_cuda_side_join(cf_cuda_ctx *ctx);

/* Waits for the compute and communication streams; 0, or -1 (sticky). */
int cf_cuda_ctx_synchronize(cf_cuda_ctx *ctx);

/* The scratch buffer `id`, at least `bytes` long (grows, never shrinks;
 * growing synchronizes). NULL on failure (recorded). */
void *cf_cuda_scratch(cf_cuda_ctx *ctx, cf_cuda_scratch_id id, size_t bytes);

/* Pinned host memory of at least `bytes` for one async host -> device copy
 * on the compute stream: waits until the previous such copy has read the
 * area. Call cf_cuda_staging_issued after issuing the copy. NULL on failure. */
void *cf_cuda_staging(cf_cuda_ctx *ctx, size_t bytes);
int cf_cuda_staging_issued(cf_cuda_ctx *ctx);

/* Orders the communication stream after the compute work issued so far, or
 * the compute stream after the communication work issued so far. */
int cf_cuda_comm_wait_compute(cf_cuda_ctx *ctx);
int cf_cuda_compute_wait_comm(cf_cuda_ctx *ctx);

/* dst[i] = src[i] (bf16 -> fp32) for i < n, on the communication stream
 * (after the collective that produced src); 0, or -1 (recorded). */
int cf_cuda_bf16_to_f32_comm(cf_cuda_ctx *ctx, float *dst, const void *src, size_t n);

/* Writes "3.2 GiB" / "512.0 MiB" / "100 bytes" into buf; returns buf. */
const char *cf_cuda_format_bytes(size_t bytes, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif

#endif /* CF_CUDA_CONTEXT_H */
