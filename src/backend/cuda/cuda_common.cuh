/*
 * cuda_common.cuh — what every file of the CUDA backend shares: the bf16
 * type, error-check macros bound to the device context, the op-entry guard,
 * small vector helpers, and the prototypes of the ops (one family per file)
 * that backend.cu puts into the cf_backend table.
 *
 * Errors. Every CUDA or cuBLASLt call goes through CF_CK / CF_LT / CF_CK_LAUNCH,
 * which record the first failure in the context (sticky, see context.h) and
 * evaluate to false. An op starts with
 *     cf_cuda_ctx *ctx = cf_cuda_enter(b); if (!ctx) return;
 * so after a failure every op is a no-op; nothing in the backend exits.
 *
 * Streams. Every kernel, copy, memset, cuBLASLt and cub call of an op runs on
 * ctx->stream.
 *
 * Portability. The default build is a fat binary: sm_80 SASS (A100, RTX
 * 30xx/40xx, L4), sm_90a SASS (H100/H200) and compute_90 PTX. Code that only
 * exists on sm_90 is guarded with CF_SM90_PATH; -DCF_CUDA_PORTABLE=1 (cuda.mk:
 * CUDA_PORTABLE=1) forces the portable sm_80 code on every architecture.
 */
#ifndef CF_CUDA_COMMON_CUH
#define CF_CUDA_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

extern "C" {
#include "backend/backend.h"
#include "base/common.h"
}
#include "backend/cuda/context.h"

typedef __nv_bfloat16 bf16;

/* True in device code compiled for sm_90 or newer, unless the portable
 * path is forced. */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !(defined(CF_CUDA_PORTABLE) && CF_CUDA_PORTABLE)
#define CF_SM90_PATH 1
#else
#define CF_SM90_PATH 0
#endif

/* ------------------------------------------------------------------ errors */

static inline bool cf_ok(int status) { return status == 0; }
#define CF_CK(ctx, call) cf_ok(cf_cuda_check_call((ctx), (call), #call, __FILE__, __LINE__))
#define CF_LT(ctx, call) cf_ok(cf_cublaslt_check_call((ctx), (call), #call, __FILE__, __LINE__))
#define CF_CK_LAUNCH(ctx, name) \
    cf_ok(cf_cuda_check_call((ctx), cudaGetLastError(), "kernel launch (" name ")", __FILE__, __LINE__))

/* The context of backend b with its device current, or NULL when an error
 * is recorded (the op is then a no-op). */
static inline cf_cuda_ctx *cf_cuda_enter(cf_backend *b) {
    cf_cuda_ctx *ctx = (cf_cuda_ctx *)b->state;
    return cf_cuda_ctx_use(ctx) == 0 ? ctx : NULL;
}

/* ------------------------------------------------------------- launch size */

/* blocks for n items of `threads` threads each, at least 1, at most
 * CF_GRID_MAX_BLOCKS (the kernels are grid-stride loops) */
#define CF_GRID_MAX_BLOCKS (65536 * 4)
static inline int cf_grid_for(size_t n, int threads) {
    size_t blocks = (n + threads - 1) / threads;
    if (blocks == 0) blocks = 1;
    return (int)(blocks < CF_GRID_MAX_BLOCKS ? blocks : CF_GRID_MAX_BLOCKS);
}

/* a grid-stride launch of at most 16 blocks per SM (elementwise passes over
 * the whole parameter vector) */
static inline int cf_stream_grid(const cf_cuda_ctx *ctx, size_t n) {
    size_t cap = (size_t)ctx->sm_count * 16;
    size_t blocks = (n + 255) / 256;
    return (int)(blocks < 1 ? 1 : blocks < cap ? blocks : cap);
}

static inline bool cf_aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* ---------------------------------------------------------- vector helpers */

/* 16 bytes = 8 bf16, element 2i in the low half of word i and 2i + 1 in
 * the high half (a __nv_bfloat162's x and y). The words are plain integers
 * so that the type is trivially copyable: a load or store of a pack8 is one
 * 16-byte access. (With __nv_bfloat162 members, whose copy operators are
 * user-defined, nvcc moved a pack8 as four 4-byte accesses, and a copy
 * loop as dependent load-store pairs.) */
struct __align__(16) pack8 { uint32_t w[4]; };

/* bf16 -> fp32 is exact: the bf16 bits are the float's upper half. p by
 * value, so the caller's *(const pack8 *) is one load, not four */
__device__ __forceinline__ void unpack8(const pack8 p, float f[8]) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(p.w[i] << 16);
        f[2 * i + 1] = __uint_as_float(p.w[i] & 0xffff0000u);
    }
}
__device__ __forceinline__ pack8 pack8_from(const float f[8]) {
    pack8 p;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
        p.w[i] = *reinterpret_cast<const uint32_t *>(&h);
    }
    return p;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* ------------------------------------------- shared host functions */

/* gemm.cu: D (=, or beta *) op(A) op(B) on the context's stream, column-major
 * (see the comment there); bf16 A and B, D of dtype. */
void cf_cuda_gemm(cf_cuda_ctx *ctx, bool transa, bool transb, int m, int n, int k, const void *A, int lda,
                  const void *B, int ldb, void *D, cudaDataType_t dtype, int ldd, float beta, const void *bias);
/* gemm.cu: destroys the cached cuBLASLt plans (context teardown) */
void cf_cuda_gemm_release(cf_cuda_ctx *ctx);
/* gemm.cu: out[c] += sum_t f(t, c) (dbias: dout; rmsnorm dw: dout * x * rstd),
 * deterministic */
void cf_cuda_colsum(cf_cuda_ctx *ctx, float *out, const bf16 *dout, const bf16 *x, const float *rstd, int T, int C);
/* gemm.cu: out[c] += sum_k partial[k, c] over k < nchunks, in a fixed order
 * (the last step of cf_cuda_colsum; norm.cu writes its own partials) */
void cf_cuda_colsum_final(cf_cuda_ctx *ctx, float *out, const float *partial, int nchunks, int C);

/* -------------------------------------------- ops, by file (backend.cu) */

/* memory.cu */
void *cf_cuda_alloc(cf_backend *b, size_t bytes);
void cf_cuda_free(cf_backend *b, void *p);
void cf_cuda_memzero(cf_backend *b, void *p, size_t bytes);
int cf_cuda_upload(cf_backend *b, void *dst, const void *src, size_t bytes);
int cf_cuda_download(cf_backend *b, void *dst, const void *src, size_t bytes);
void cf_cuda_copy(cf_backend *b, void *dst, const void *src, size_t bytes);
void cf_cuda_act_from_f32(cf_backend *b, void *dst, const float *src, size_t n);
void cf_cuda_act_to_f32(cf_backend *b, float *dst, const void *src, size_t n);
void cf_cuda_weights_from_master(cf_backend *b, void *w, const float *master, size_t n);
size_t cf_cuda_memory_peak(cf_backend *b);
int cf_cuda_memory_info(cf_backend *b, size_t *free_bytes, size_t *total_bytes);
/* gemm.cu */
void cf_cuda_matmul_fwd(cf_backend *b, void *out, const void *inp, const void *w, const void *bias, int T, int K,
                        int N);
void cf_cuda_matmul_bwd_scaled(cf_cuda_ctx *ctx, void *dinp, float *dw, const void *dout, const void *inp,
                               const void *w, int T, int K, int N, int flags, float alpha);
void cf_cuda_matmul_fwd_residual(cf_backend *b, void *out, const void *inp, const void *w, const void *bias,
                                 const void *resid, int T, int K, int N);
void cf_cuda_matmul_bwd(cf_backend *b, void *dinp, float *dw, float *dbias, const void *dout, const void *inp,
                        const void *w, int T, int K, int N, int flags);
/* norm.cu */
void cf_cuda_add_rmsnorm_fwd(cf_backend *b, void *sum, void *out, float *rstd, const void *a, const void *c,
                             const void *w, int T, int C, float eps);
void cf_cuda_rmsnorm_fwd(cf_backend *b, void *out, float *rstd, const void *inp, const void *w, int T, int C,
                         float eps);
void cf_cuda_rmsnorm_bwd(cf_backend *b, void *dinp, float *dw, const void *dout, const void *inp, const void *w,
                         const float *rstd, const int *rows, int T, int C, int accumulate);
/* rope.cu */
void cf_cuda_rope_fwd(cf_backend *b, void *x, const int *pos, const float *inv_freq, int T, int nh, int D);
void cf_cuda_rope_bwd(cf_backend *b, void *dx, const int *pos, const float *inv_freq, int T, int nh, int D);
void cf_cuda_rope_qk(cf_backend *b, void *q, const int *qpos, int Tq, int Hq, void *k, const int *kpos, int Tk,
                     int Hk, const float *inv_freq, int D, int bwd);
void cf_cuda_qkv_split_rope(cf_backend *b, void *q, void *k, void *v, const void *qkv, const int *pos, int T,
                            int Hq, int Hk, const float *inv_freq, int D);
void cf_cuda_qkv_join_rope_bwd(cf_backend *b, void *dqkv, const void *dq, const void *dk, const void *dv,
                               const int *pos, int T, int Hq, int Hk, const float *inv_freq, int D);
/* swiglu.cu */
void cf_cuda_swiglu_fwd(cf_backend *b, void *h, const void *gate, const void *up, int T, int F, int ld_in);
void cf_cuda_swiglu_bwd_rows(cf_backend *b, void *h, void *dgate, void *dup, const void *dh, const void *gate,
                             const void *up, const int *rows, int n, int F, int ld_in, int ld);
void cf_cuda_add(cf_backend *b, void *out, const void *a, const void *c, size_t n);
void cf_cuda_scale(cf_backend *b, void *x, float s, size_t n);
/* dropout.cu */
void cf_cuda_dropout(cf_backend *b, void *out, const void *x, uint64_t key, uint32_t threshold, float scale,
                     const int *rows, int n, int C);
/* embedding.cu */
void cf_cuda_embedding_fwd(cf_backend *b, void *out, const int *tokens, const void *wte, int T, int C, int vstart,
                           int vlen);
void cf_cuda_embedding_bwd(cf_backend *b, float *dwte, const void *dout, const int *tokens, int T, int C, int vstart,
                           int vlen);
/* lmhead.cu */
void cf_cuda_lmhead_loss_fwd(cf_backend *b, float *losses, const void *x, const void *wlm, const int *targets, int T,
                             int C, int V);
void cf_cuda_lmhead_loss_bwd(cf_backend *b, void *dx, float *dwlm, const void *x, const void *wlm,
                             const int *targets, const float *dloss, const float *lse, int T, int C, int V,
                             int vstart, int flags);
void cf_cuda_lmhead_loss_fwd_grad(cf_backend *b, float *losses, void *g, const void *x, const void *wlm,
                                  const int *targets, int T, int C, int V);
void cf_cuda_lmhead_loss_bwd_saved(cf_backend *b, void *dx, float *dwlm, void *g, const void *x, const void *wlm,
                                   const float *dloss, float scale, int T, int C, int V, int flags);
void cf_cuda_lmhead_stats_fwd(cf_backend *b, float *stats, const void *x, const void *wlm, const int *targets, int T,
                              int C, int V, int vstart);
void cf_cuda_xent_combine(cf_backend *b, float *losses, float *lse, const float *parts, const int *targets, int T,
                          int nparts, int V);
/* select.cu */
void cf_cuda_select_topk(cf_backend *b, uint8_t *keep, const float *losses, const float *ref, int T, int group,
                         int k);
void cf_cuda_keep_to_rows(cf_backend *b, int *rows, int *seq_start, const uint8_t *keep, int B, int S);
void cf_cuda_fill_dloss(cf_backend *b, float *dloss, const uint8_t *keep, float value, int n);
void cf_cuda_loss_sum(cf_backend *b, float *acc, const float *losses, const uint8_t *keep, int n);
void cf_cuda_gather_rows(cf_backend *b, void *dst, const void *src, const int *rows, int n, size_t row_bytes);
void cf_cuda_gather_rows_multi(cf_backend *b, int count, void *const *dst, const void *const *src,
                               const size_t *row_bytes, const int *rows, int n);
/* adamw.cu */
void cf_cuda_sumsq(cf_backend *b, double *acc, const float *g, size_t n);
void cf_cuda_adamw(cf_backend *b, float *p, void *w, float *g, float *m, float *v, size_t n, float lr, float beta1,
                   float beta2, float eps, float wd, float grad_scale, int t, int flags);
void cf_cuda_adamw_segments(cf_backend *b, float *p, void *w, float *g, float *m, float *v, const cf_adamw_seg *segs,
                            int nseg, float lr, float beta1, float beta2, float eps, float grad_scale, int t);
/* attention/launch.cu */
void cf_cuda_attention_fwd(cf_backend *b, void *out, float *lse, const void *q, const void *k, const void *v,
                           const cf_attn_shape *s);
void cf_cuda_attention_bwd(cf_backend *b, void *dq, void *dk, void *dv, const void *dout, const void *q,
                           const void *k, const void *v, const void *out, const float *lse, const cf_attn_shape *s,
                           const cf_rows *kept, cf_attn_bwd_mode mode);
int cf_cuda_attention_bwd_leaves_idle(cf_backend *b, const cf_attn_shape *s);

#endif /* CF_CUDA_COMMON_CUH */
