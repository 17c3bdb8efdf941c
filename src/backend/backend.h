/*
 * backend.h — the interface between the model driver (engine/model.c) and a
 * compute backend (cpu: fp32 C + OpenMP + OpenBLAS; cuda: bf16 + fp32).
 *
 * The driver writes the Llama-family forward, filter and backward once, as a
 * sequence of these calls; a backend only knows how to run each op.
 *
 * Ordering and errors. A backend runs its ops in call order (the CUDA
 * backend: all on its device context's compute stream). Ops return void and
 * never exit: the first failure is recorded (sticky, with its cf_fail
 * message) and every later call of `check`, `synchronize` or `download`
 * returns -1 with that message. alloc returns NULL with cf_fail on failure.
 *
 * Data types, per pointer kind:
 *   act    activations and their gradients, backend dtype (cpu fp32, cuda bf16);
 *          element size is `act_size`.
 *   w      compute copy of weights, backend dtype (cpu: the fp32 master itself).
 *   float  statistics (rstd, lse, losses, dloss) and all parameter gradients:
 *          always fp32.
 *   int    token ids, positions, row indices: int32.
 * All pointers are backend memory (allocated by b->alloc) unless named
 * host_*.
 *
 * Shapes: T rows (tokens), token-major. Matrices follow HF's nn.Linear
 * layout: W is [N, K] (out_features, in_features), y = x W^T + b.
 */
#ifndef CF_BACKEND_H
#define CF_BACKEND_H

#include <stddef.h>
#include <stdint.h>

typedef struct cf_backend cf_backend;

/* matmul_bwd and lmhead_loss_bwd flags */
#define CF_MM_ACC_DINP 1 /* dinp += instead of =                                  */
#define CF_MM_DW_SET 2   /* dw = instead of +=: dw is logically zero (its memory
                            may hold anything, even NaN: it is never read)       */

/* adamw flags */
#define CF_ADAMW_KEEP_GRAD 1 /* leave g as it is (the caller's next writer of g
                                overwrites it): g is read, not zeroed           */

/* One tensor's piece of a multi-segment AdamW pass (adamw_segments): n
 * elements at p + poff, m + poff, v + poff (the optimizer state), g + goff
 * (the gradient) and w + woff (the compute copy), offsets in elements. */
typedef struct {
    size_t poff, goff, woff, n;
    float wd;  /* this tensor's weight decay (0 for norms and biases) */
    int flags; /* CF_ADAMW_KEEP_GRAD or 0, as adamw's */
} cf_adamw_seg;

/* Attention problem description. Rows are b*S + s. */
typedef struct {
    int B, S;       /* sequences, positions per sequence             */
    int H, Hkv, D;  /* query heads, key/value heads, head dimension  */
    float scale;    /* softmax scale, 1/sqrt(D)                       */
    const int *doc; /* [B*S] document id per row, or NULL (one doc per sequence).
                       Key j is visible to query i iff same sequence, j <= i,
                       and doc[j] == doc[i]. */
} cf_attn_shape;

/* Kept rows of a filtered backward. rows are ascending original row indices
 * (b*S + s); seq_start[b] .. seq_start[b+1] is sequence b's slice of them. */
typedef struct {
    int n;                  /* number of kept rows                         */
    int max_len;            /* upper bound of seq_start[b+1]-seq_start[b]  */
    const int *rows;        /* [n] backend memory                          */
    const int *seq_start;   /* [B+1] backend memory                        */
} cf_rows;

typedef enum {
    /* dq, dk, dv for all T rows from all queries (regular, loss-only). */
    CF_ATTN_BWD_FULL = 0,
    /* Queries restricted to kept rows: q, out, dout, lse, dq, dk, dv are
     * compacted [n, ...]; k, v are full [T, ...].
     * dq(kept i) = exact, over all visible keys, with the full-forward lse.
     * dk, dv(kept j) = contributions from kept queries only.               */
    CF_ATTN_BWD_CENTRIFUGE = 1,
    /* As centrifuge (same compacted layout), but the softmax is
     * renormalised over kept keys only: the exact backward of attention on
     * the compacted sequence, so dq misses the filtered keys (wrong).       */
    CF_ATTN_BWD_STRAWMAN = 2,
    /* Queries as centrifuge (q, out, dout, lse, dq compacted [n, ...], dq
     * exact over all visible keys with the full-forward lse), but dk, dv
     * are [T, Hkv, D] for ALL rows, indexed by original row: every key j,
     * kept or filtered, gets the contributions of the kept queries,
     *   dk_j = scale sum_{kept i} dS_ij q_i,  dv_j = sum_{kept i} P_ij do_i.
     * On kept rows these are centrifuge's dk, dv; a key no kept query sees
     * gets 0. (The centrifuge-kv mode: DESIGN §1.)                         */
    CF_ATTN_BWD_CENTRIFUGE_KV = 3,
} cf_attn_bwd_mode;

struct cf_backend {
    const char *name;
    const char *device_name;  /* e.g. "NVIDIA H200" or "cpu", for records */
    size_t act_size;  /* bytes per activation element */
    void *state;      /* backend-private (cublas handles, streams, ...) */

    /* ---- memory ---- */
    void *(*alloc)(cf_backend *b, size_t bytes);          /* NULL + cf_fail on OOM */
    void (*free)(cf_backend *b, void *p);
    void (*memzero)(cf_backend *b, void *p, size_t bytes);
    /* upload returns once host_src may be reused; download waits for the
     * ops before it and returns -1 if any op so far failed. */
    int (*upload)(cf_backend *b, void *dst, const void *host_src, size_t bytes);
    int (*download)(cf_backend *b, void *host_dst, const void *src, size_t bytes);
    void (*copy)(cf_backend *b, void *dst, const void *src, size_t bytes);
    /* host fp32 <-> backend act dtype (n elements) */
    void (*act_from_f32)(cf_backend *b, void *dst, const float *host_src, size_t n);
    void (*act_to_f32)(cf_backend *b, float *host_dst, const void *src, size_t n);
    /* device fp32 master -> device compute weights (cpu: no-op when same ptr) */
    void (*weights_from_master)(cf_backend *b, void *w, const float *master, size_t n);
    /* Waits for every op issued so far; 0, or -1 with the first error. */
    int (*synchronize)(cf_backend *b);
    /* The first error so far without waiting; 0, or -1 (cf_fail set). */
    int (*check)(cf_backend *b);
    void (*destroy)(cf_backend *b);
    /* Optional (NULL: ops run in issue order). The matmul_bwd calls (no
     * dinp, no dbias) and sumsq calls issued between side_begin and
     * side_end may run beside the ops issued after side_end: they follow
     * everything issued before side_begin, and everything issued after
     * side_join follows them. Until side_join the caller leaves their
     * inputs and outputs alone. Sections never nest. narrow: the section's
     * work may take only part of the device, leaving the rest to the ops
     * issued after it (CUDA: its GEMMs planned for fewer SMs; gemm.cu:
     * side_sms). */
    void (*side_begin)(cf_backend *b, int narrow);
    void (*side_end)(cf_backend *b);
    void (*side_join)(cf_backend *b);
    /* Optional (NULL: 0). 1 where the full attention backward of shape s
     * leaves many SMs idle: its grid is under one and a half waves, so its
     * last wave fills at most half the device (CUDA: the Hopper plan's
     * blocks against the SMs); the engine then runs weight gradients
     * beside it in full backwards too (dwside.c). */
    int (*attention_bwd_leaves_idle)(cf_backend *b, const cf_attn_shape *s);

    /* ---- ops ---- */
    /* out[t,:] = wte[tokens[t] - vstart,:] for tokens in [vstart, vstart+vlen),
     * else 0 (a vocab-parallel slice of the table; vstart 0, vlen V whole) */
    void (*embedding_fwd)(cf_backend *b, void *out, const int *tokens, const void *wte,
                          int T, int C, int vstart, int vlen);
    /* dwte[tokens[t]-vstart,:] += dout[t,:] for tokens in the slice
     * (deterministic: rows with equal token are summed in row order) */
    void (*embedding_bwd)(cf_backend *b, float *dwte, const void *dout, const int *tokens,
                          int T, int C, int vstart, int vlen);
    /* out[T,N] = inp[T,K] W[N,K]^T (+ bias[N]) */
    void (*matmul_fwd)(cf_backend *b, void *out, const void *inp, const void *w,
                       const void *bias, int T, int K, int N);
    /* out[T,N] = resid[T,N] + inp[T,K] W[N,K]^T (+ bias[N]); out may alias
     * resid (the residual stream's add, fused into the GEMM on the GPU) */
    void (*matmul_fwd_residual)(cf_backend *b, void *out, const void *inp, const void *w,
                                const void *bias, const void *resid, int T, int K, int N);
    /* dinp[T,K] (=, or += if flags & CF_MM_ACC_DINP) dout W ;
     * dw[N,K] += dout^T inp (= if flags & CF_MM_DW_SET: dw is written without
     * being read, whatever it held) ;
     * dbias[N] += colsum(dout) if dbias != NULL. dinp may be NULL.
     * With CF_MM_DW_SET, dw (N K > 0) is written even when T <= 0: zeros,
     * the product over no rows (the engine relies on it: a STALE gradient's
     * first writer must overwrite it, engine/model_internal.h). */
    void (*matmul_bwd)(cf_backend *b, void *dinp, float *dw, float *dbias, const void *dout,
                       const void *inp, const void *w, int T, int K, int N, int flags);
    /* out = x * rstd * w, rstd[t] = 1/sqrt(mean(x^2)+eps), over rows of C */
    void (*rmsnorm_fwd)(cf_backend *b, void *out, float *rstd, const void *inp, const void *w,
                        int T, int C, float eps);
    /* The residual add and the RMSNorm after it in one pass: sum = a + c
     * (rounded to the act dtype), then out, rstd = rmsnorm_fwd(sum, w). sum
     * may alias a. (Under TP, where the add cannot go into the GEMM.) */
    void (*add_rmsnorm_fwd)(cf_backend *b, void *sum, void *out, float *rstd, const void *a, const void *c,
                            const void *w, int T, int C, float eps);
    /* dinp (=, or += if accumulate); dw[C] += . Row t's input and rstd are
     * row rows[t] of inp and rstd (rows NULL: row t): the filter leaves the
     * norms' inputs where the forward wrote them */
    void (*rmsnorm_bwd)(cf_backend *b, void *dinp, float *dw, const void *dout, const void *inp,
                        const void *w, const float *rstd, const int *rows, int T, int C, int accumulate);
    /* In-place rotate-half RoPE on x[T, nh, D] at positions pos[T] with
     * inv_freq[D/2] (llama3 scaling already folded in). bwd applies the
     * transposed rotation (angle -theta) to dx. */
    void (*rope_fwd)(cf_backend *b, void *x, const int *pos, const float *inv_freq, int T,
                     int nh, int D);
    void (*rope_bwd)(cf_backend *b, void *dx, const int *pos, const float *inv_freq, int T,
                     int nh, int D);
    /* rope_fwd (bwd = 0) or rope_bwd (bwd = 1) of q[Tq, Hq, D] at qpos and of
     * k[Tk, Hk, D] at kpos in one call (one launch on the GPU) */
    void (*rope_qk)(cf_backend *b, void *q, const int *qpos, int Tq, int Hq, void *k, const int *kpos,
                    int Tk, int Hk, const float *inv_freq, int D, int bwd);
    /* The fused q/k/v projection's split, with RoPE: qkv[T, (Hq + 2 Hk) D]
     * holds each row's q | k | v (the output of one GEMM with [Wq; Wk; Wv]);
     * q[T, Hq, D] and k[T, Hk, D] get their parts rotated as rope_fwd at
     * pos[T] (the same arithmetic, so the same values), v[T, Hk, D] a copy. */
    void (*qkv_split_rope)(cf_backend *b, void *q, void *k, void *v, const void *qkv, const int *pos, int T,
                           int Hq, int Hk, const float *inv_freq, int D);
    /* Its backward: dqkv[T, (Hq + 2 Hk) D] rows = dq | dk | dv, with dq and
     * dk rotated back as rope_bwd at pos[T] (the same arithmetic as
     * rope_qk's backward, so the same values), dv copied: the input of the
     * fused projection's two backward GEMMs. */
    void (*qkv_join_rope_bwd)(cf_backend *b, void *dqkv, const void *dq, const void *dk, const void *dv,
                              const int *pos, int T, int Hq, int Hk, const float *inv_freq, int D);
    /* h[t, c] = silu(gate[t, c]) * up[t, c] for t < T, c < F: h has rows of
     * F; gate and up rows ld_in >= F elements apart (ld_in = 2F with up =
     * gate + F: the [T, 2F] output of the fused gate/up GEMM). */
    void (*swiglu_fwd)(cf_backend *b, void *h, const void *gate, const void *up, int T, int F, int ld_in);
    /* The SwiGLU backward of the MLP, reading gate and up of the forward
     * through the row index (so the filter never copies them): for i < n,
     * r = rows ? rows[i] : i, over F columns:
     *   h[i]     = silu(gate[r]) * up[r]        (the down projection's input, recomputed)
     *   dgate[i] = dh[i] * up[r] * silu'(gate[r]),  dup[i] = dh[i] * silu(gate[r])
     * h and dh have rows of F; gate and up rows ld_in >= F elements apart
     * (as swiglu_fwd); dgate and dup rows ld >= F elements apart (ld = 2F
     * with dup = dgate + F: the [n, 2F] input of the fused gate/up backward
     * GEMM). */
    void (*swiglu_bwd_rows)(cf_backend *b, void *h, void *dgate, void *dup, const void *dh, const void *gate,
                            const void *up, const int *rows, int n, int F, int ld_in, int ld);
    /* out = a + c (out may alias a) */
    void (*add)(cf_backend *b, void *out, const void *a, const void *c, size_t n);
    /* x = s * x over n elements (LoRA's scale on its rank-r activations) */
    void (*scale)(cf_backend *b, void *x, float s, size_t n);
    /* LoRA dropout (inverted), with the mask of dropout_mask.h: for i < n
     * and c < C, r = rows ? rows[i] : i (the row's index in the forward),
     *   out[i,c] = keep(key, threshold, r, c) ? x[i,c] * scale : 0
     * (scale = 1/(1-P), the product rounded once to the act dtype). The
     * mask depends only on (key, r, c), so every backend drops the same
     * elements and a backward on kept rows regenerates the forward's mask.
     * out may alias x. */
    void (*dropout)(cf_backend *b, void *out, const void *x, uint64_t key, uint32_t threshold, float scale,
                    const int *rows, int n, int C);
    /* Causal GQA attention. q[T,H,D] k,v[T,Hkv,D] -> out[T,H,D], lse[T,H]
     * (natural log of the softmax denominator of the scaled scores). */
    void (*attention_fwd)(cf_backend *b, void *out, float *lse, const void *q, const void *k,
                          const void *v, const cf_attn_shape *s);
    /* See cf_attn_bwd_mode for layouts. dq, dk, dv are overwritten. kept is
     * NULL for CF_ATTN_BWD_FULL. */
    void (*attention_bwd)(cf_backend *b, void *dq, void *dk, void *dv, const void *dout,
                          const void *q, const void *k, const void *v, const void *out,
                          const float *lse, const cf_attn_shape *s, const cf_rows *kept,
                          cf_attn_bwd_mode mode);
    /* Per-token cross-entropy of the LM head, chunked over rows so no [T,V]
     * buffer is kept: losses[t] = logsumexp(x_t W^T) - (x_t W^T)[targets[t]]. */
    void (*lmhead_loss_fwd)(cf_backend *b, float *losses, const void *x, const void *wlm,
                            const int *targets, int T, int C, int V);
    /* For rows t with dloss[t] != 0 contribution:
     * dlogits = dloss[t] * (softmax - onehot); dx[T,C] = dlogits W (overwrite);
     * dwlm[V,C] += dlogits^T x. Rows with dloss 0 give dx 0.
     * Vocab-parallel (lse != NULL): W holds the vocabulary rows [vstart,
     * vstart+V) of a larger table and softmax_j = exp(logit_j - lse[t]) with
     * the whole vocabulary's log-sum-exp; the one-hot term applies only when
     * the target is in the slice; dx is this slice's partial sum. lse NULL:
     * vstart must be 0. flags & CF_MM_DW_SET: dwlm = instead of += (it holds
     * zeros). */
    void (*lmhead_loss_bwd)(cf_backend *b, void *dx, float *dwlm, const void *x, const void *wlm,
                            const int *targets, const float *dloss, const float *lse, int T, int C,
                            int V, int vstart, int flags);
    /* lmhead_loss_fwd (the same losses), and for a backward that follows
     * (issue 17) the unscaled gradient of each row's loss w.r.t. its logits,
     *   g[t,:] = softmax(x_t W^T) - onehot(targets[t])   (act dtype, [T, V]),
     * written from the logits the forward computes anyway, so that the
     * backward (lmhead_loss_bwd_saved) need not recompute them. A target
     * outside [0, V) gives a NaN loss and g without the one-hot term. */
    void (*lmhead_loss_fwd_grad)(cf_backend *b, float *losses, void *g, const void *x, const void *wlm,
                                 const int *targets, int T, int C, int V);
    /* lmhead_loss_bwd from the forward's g (whole vocabulary, no TP), with
     * dlogits[t] = dloss[t] g[t] (dloss NULL: every row's dloss is scale):
     *   g[t,:] *= dloss[t] / scale   (in place, rounded to the act dtype;
     *                                 skipped where dloss[t] == scale,
     *                                 exactly 0 where dloss[t] == 0)
     *   dx[T,C] = scale g W (overwrite), dwlm[V,C] += scale g^T x
     * (= with CF_MM_DW_SET; dwlm NULL: a frozen LM head, or its weight
     * gradient left for later; dx NULL: the weight gradient alone). The
     * common weight rides on the GEMMs (fp32), so g is rounded to bf16 once,
     * as the recompute path's dlogits are. scale: finite, nonzero. With a
     * dloss g may be rewritten; without one it is left as it is, so that a
     * later call can read its rows again (engine/dwpair.c: LM head pairs). */
    void (*lmhead_loss_bwd_saved)(cf_backend *b, void *dx, float *dwlm, void *g, const void *x, const void *wlm,
                                  const float *dloss, float scale, int T, int C, int V, int flags);
    /* Vocab-parallel forward, first half: for the slice [vstart, vstart+V)
     * held in wlm, stats[t] = {max_j z_tj, sum_j exp(z_tj - max), z_t,target
     * if the target is in the slice else 0} (z = x W^T). */
    void (*lmhead_stats_fwd)(cf_backend *b, float *stats, const void *x, const void *wlm,
                             const int *targets, int T, int C, int V, int vstart);
    /* Second half, after the slices' stats were gathered: parts [parts, T, 3]
     * -> lse[t] = M + log(sum_p s_p exp(m_p - M)), M = max_p m_p, and
     * losses[t] = lse[t] - sum_p target_p (NaN for a target outside [0, V)). */
    void (*xent_combine)(cf_backend *b, float *losses, float *lse, const float *parts, const int *targets,
                         int T, int nparts, int V);
    /* dst[i,:] = src[rows[i],:] for i < n; row_bytes bytes per row (the
     * filter operator's primitive). */
    void (*gather_rows)(cf_backend *b, void *dst, const void *src, const int *rows, int n,
                        size_t row_bytes);
    /* acc[0] += sum of squares of g[0..n) (fp32 gradients); acc is one
     * double in backend memory, so the norm of a sharded gradient can be
     * all-reduced before it reaches the host. */
    void (*sumsq)(cf_backend *b, double *acc, const float *g, size_t n);
    /* AdamW with decoupled weight decay and bias correction, on n elements:
     * g' = g * grad_scale; m = b1 m + (1-b1) g'; v = b2 v + (1-b2) g'^2;
     * p -= lr * (mhat / (sqrt(vhat) + eps) + wd * p), mhat = m/(1-b1^t), ...
     * In the same pass (one read of each buffer): the compute copy w is
     * refreshed from p (unless w is NULL or w == p) and g is zeroed for the
     * next accumulation, unless flags & CF_ADAMW_KEEP_GRAD (g left as it
     * is: 4 of the pass's 34 bytes per element on the GPU saved). */
    void (*adamw)(cf_backend *b, float *p, void *w, float *g, float *m, float *v, size_t n, float lr,
                  float beta1, float beta2, float eps, float wd, float grad_scale, int t, int flags);

    /* ---- selection and loss bookkeeping (no host round trip) ---- */
    /* From keep[B*S] (0/1): rows[] = the kept row indices ascending and
     * seq_start[b] = number of kept rows before sequence b (B+1 entries). */
    void (*keep_to_rows)(cf_backend *b, int *rows, int *seq_start, const uint8_t *keep, int B, int S);
    /* dloss[t] = keep == NULL || keep[t] ? value : 0, for t < n. */
    void (*fill_dloss)(cf_backend *b, float *dloss, const uint8_t *keep, float value, int n);
    /* acc[0] += sum of losses[t] over t < n with keep == NULL || keep[t]
     * (fp32 accumulator in backend memory; deterministic order). */
    void (*loss_sum)(cf_backend *b, float *acc, const float *losses, const uint8_t *keep, int n);

    /* ---- optional (may be NULL) ---- */
    /* Timing without synchronising: mark records a time point in stream
     * order and returns its id (-1 if none is left); mark_elapsed gives the
     * seconds from mark a to mark c, waiting for c; marks_reset forgets all
     * marks. The driver falls back to synchronize + wall clock without them. */
    int (*mark)(cf_backend *b);
    double (*mark_elapsed)(cf_backend *b, int a, int c);
    void (*marks_reset)(cf_backend *b);
    /* The filter operator in one call: for k < count, dst[k][i,:] =
     * src[k][rows[i],:] with row_bytes[k] bytes per row (multiples of 4).
     * dst, src, row_bytes are host arrays of backend pointers. */
    void (*gather_rows_multi)(cf_backend *b, int count, void *const *dst, const void *const *src,
                              const size_t *row_bytes, const int *rows, int n);
    /* Token selection on the device: keep[t] = 1 for the k rows of highest
     * score = losses[t] - (ref ? ref[t] : 0) within each group of `group`
     * consecutive rows (group = S per sequence, T per micro-batch); equal
     * scores go to the lower row, NaN scores last (as cf_select). keep is
     * backend memory of T bytes. */
    void (*select_topk)(cf_backend *b, uint8_t *keep, const float *losses, const float *ref, int T, int group,
                        int k);
    /* adamw on every segment of segs[0..nseg) (a host array), the same
     * arithmetic bit for bit, in one pass over the buffers instead of one
     * call per tensor; w NULL or w == p: no compute copy. */
    void (*adamw_segments)(cf_backend *b, float *p, void *w, float *g, float *m, float *v, const cf_adamw_seg *segs,
                           int nseg, float lr, float beta1, float beta2, float eps, float grad_scale, int t);
    /* Peak bytes of device memory allocated through this backend. */
    size_t (*memory_peak)(cf_backend *b);
    /* Free and total bytes of the device's memory (for memory estimates). */
    int (*memory_info)(cf_backend *b, size_t *free_bytes, size_t *total_bytes);
    /* The CUDA device context (backend/cuda/context.h), NULL elsewhere: the
     * collectives module reaches its streams through it. */
    void *(*device_context)(cf_backend *b);
};

cf_backend *cf_backend_cpu_create(void);
/* The CUDA backend on device `device` (an index into the visible GPUs).
 * Returns NULL with cf_fail(...) if CUDA support was not built, there is no
 * such GPU, or its context cannot be created. */
cf_backend *cf_backend_cuda_create(int device);

#endif /* CF_BACKEND_H */
