/*
 * model_internal.h — the model's private state, shared by the files of the
 * engine (model.c: parameters and forward; backward.c: filter and backward;
 * kept.c: selection; optim.c: optimizer state and step; linear.c: the
 * linear block; trainer.c: the training step). Not part of the public API:
 * commands use include/centrifuge.h only.
 *
 * State by lifetime (llama2.c style): the config and the parameter table
 * are fixed at open; the weights and optimizer state live as long as the
 * model; the activations are sized by the largest forward so far; the kept
 * rows live from one selection to the next forward.
 */
#ifndef CF_MODEL_INTERNAL_H
#define CF_MODEL_INTERNAL_H

#include "backend/backend.h"
#include "centrifuge.h"

/* ------------------------------------------------------------ parameters */

/* One parameter tensor. Every tensor has a compute copy in m->w at woff
 * (backend dtype). A trainable tensor also has an fp32 gradient at goff of
 * the optimizer's gradient buffer, and its master weights and AdamW moments
 * live in the optimizer's local shard (whole on one GPU). Trainable tensors
 * come first in w, laid out exactly like the gradient buffer (woff == goff),
 * so a data-parallel all-gather of updated weights can work in place. */
typedef struct {
    char name[96];
    int ndim;
    int64_t shape[2];
    size_t numel;
    int layer;          /* bucket key: -1 embedding, 0..L-1 layers, L final norm + lm head */
    int trainable;      /* has gradient, master weights and optimizer state */
    int decay;          /* AdamW weight decay applies (matrices only) */
    int tp_replicated;  /* tensor parallel: every TP rank holds all of it (norms,
                           the o bias); its gradient counts once in the norm */
    int adapter;        /* a LoRA adapter (saved in PEFT's files, not the model's) */
    int grad_set_only;  /* trainable, and every writer of its gradient is a weight-
                           gradient GEMM that takes cf_grad_take_zero's flag: the
                           weights of q, k, v, o, gate, up, down and LoRA's A, B
                           (optim.c, mark_set_only). The step may leave its
                           gradient STALE (cf_optim.gstate). */
    size_t woff;        /* in elements, into m->w */
    size_t goff;        /* in elements, into the gradient buffer (trainable only) */
} cf_param;

/* A linear layer y = x W^T (+ b) [+ scale (x A^T) B^T]: the parameter
 * indices of its weight, bias and LoRA adapter A, B (-1 = none), and the
 * saved activation holding scale * x A^T for the adapter's backward. All
 * linear layers of the model go through linear.c, which is where adapters
 * and tensor-parallel collectives plug in. */
typedef struct {
    int w, b;
    int la, lb;     /* LoRA A [rank, in], B [out, rank] */
    int su;         /* saved slot of u = scale * x A^T  [T, rank] */
    int row_tp;     /* tensor parallel, row-parallel (o, down): the output is a
                       partial sum, so only TP rank 0 adds the bias */
} cf_linear;

/* Parameters of one transformer layer (-1 = absent). fused_qkv and
 * fused_gate_up: the forward runs q, k, v as one GEMM and gate, up as one
 * (decided once the weights' offsets are known: model.c, plan_fused_proj). */
typedef struct {
    int ln1, ln2, qn, kn;                /* norm weights */
    cf_linear q, k, v, o, gate, up, down;
    int fused_qkv, fused_gate_up;
} cf_layer_params;

/* A contiguous piece of the optimizer's local shard: len elements at local
 * offset loff of master/m/v, at goff of the gradient and woff of the
 * compute weights, all of one tensor (so one weight-decay setting). */
typedef struct {
    size_t loff, goff, woff, len;
    int tensor;
} cf_segment;

/* Where each trainable tensor's gradient lives and which pieces of it this
 * process updates: whole (one process) or a ZeRO-1 shard plan. */
typedef struct {
    size_t ngrad;       /* gradient buffer length, elements (with padding) */
    size_t nlocal;      /* local shard length (master, m, v) */
    size_t *goff;       /* [ntensors], SIZE_MAX for frozen tensors */
    int nseg;
    cf_segment *seg;    /* the local shard, ascending loff */
} cf_optim_layout;

/* Device scalars read back once per step: the squared gradient norm and
 * the loss sum of the micro-batches so far. */
typedef struct {
    double sumsq;
    float loss_sum;
    float pad_;
    double sumsq_pre;   /* the layers' part, summed early (optim.c: cf_norm_pre_*) */
} cf_scalars;

/* Hooks of a gradient reduction (data parallel). NULL = one process. */
typedef struct {
    void *ctx;
    int rank, world;    /* this process among the data-parallel ones (0, 1 alone) */
    /* The gradients of bucket `layer` (cf_param.layer) are final for this
     * step: start reducing them (asynchronously). */
    int (*bucket_ready)(void *ctx, int layer);
    /* Every bucket has been handed over: wait until the reduced gradient of
     * the local shard is in place. */
    int (*finish)(void *ctx);
    /* Sum the device scalars (squared gradient norm, loss sum) over the
     * processes. */
    int (*sum_scalars)(void *ctx, cf_scalars *dev);
    /* Optional. AdamW has updated the local segments 0..s (cf_optim_layout
     * order): the buckets they complete may be shared already, overlapping
     * the update of the later segments. */
    int (*segment_updated)(void *ctx, int s);
    /* The local shard of the compute weights was updated: share what
     * segment_updated has not (all of it without that hook). */
    int (*weights_updated)(void *ctx);
    /* 1: after `finish`, the gradient outside the local shard is zero (the
     * hooks cleared each bucket's other slices once reduced), so the step
     * need not clear the whole buffer after the update. */
    int clears_nonlocal;
    /* 1: the reduction used the compute weights of each bucket as its
     * staging area (bf16 gradients on the wire), so they hold gradients
     * after the backward of the step's last micro-batch: a skipped step
     * must rebuild them from the master weights (cf_step_ex). */
    int weights_staged;
    /* Optional. On the last micro-batch the embedding's gradient (tied:
     * the shared embedding / LM-head one) is final after the LM head's
     * backward except for the embedding's scatter-add of this micro-batch,
     * so its bucket (key -1, the embedding alone) is handed over right then
     * (its reduction overlaps the whole backward) and this hook replaces
     * the scatter-add: every rank's rows (dout [n, C] act, tokens [n],
     * n <= cap rows, token ids global, the local table starting at
     * vocabulary row vbase) are added to the reduced slices of their owners. */
    int (*embedding_rows)(void *ctx, const void *dout, const int *tokens, int n, int cap, int vbase);
} cf_grad_sync;

/* Tensor parallelism (Megatron-style, dist/tp_plan.h says which rank holds
 * what; dist/tp.c supplies the collectives). size <= 1: none. m->cfg is
 * the rank's local model (its heads, FFN slice and vocabulary rows); full
 * is the whole model's config. Collectives run in stream order: start
 * enqueues on the communication stream once the compute stream has
 * produced x, the compute stream goes on, wait makes it wait for every
 * started collective. */
enum { CF_TP_ACT = 0, CF_TP_F32, CF_TP_F64 };            /* element types   */
enum { CF_TP_FWD = 0, CF_TP_BWD, CF_TP_STEP };          /* for the counters */
typedef struct {
    void *ctx;
    int rank, size;
    cf_config full;
    int vocab_start, vocab_len;     /* this rank's real vocabulary rows */
    /* x [count] summed over the TP group, in place */
    int (*allreduce_start)(void *ctx, void *x, size_t count, int type, int phase);
    int (*wait)(void *ctx);
    /* buf [size x count] fp32: this rank's piece at rank x count reaches every
     * rank (in stream order; the compute stream waits for it) */
    int (*allgather_f32)(void *ctx, float *buf, size_t count);
    /* the host waits, with the run's deadline, for every collective started
     * so far (NULL: nothing to wait for). Called before the host blocks on
     * the compute stream (an upload, a download), which waits for the
     * collectives without a deadline: a dead or hung peer must fail the run,
     * not hang it. */
    int (*settle)(void *ctx);
} cf_tp_sync;

typedef struct {
    cf_optim_layout lay;
    float *grad;        /* [ngrad]  */
    float *master;      /* [nlocal] */
    float *adam_m, *adam_v;
    int64_t step;
    cf_grad_sync sync;
    int last_micro;     /* the backward in flight is the step's last micro-batch */
    int more_micro;     /* another micro-batch's backward of this step follows
                         * (set by the trainer only: dwpair.c may hold rows) */
    /* [ntensors] each trainable tensor's gradient state (CF_GRAD_*): ZERO
     * where the buffer is zeroed (init, cf_zero_grad, AdamW's pass), STALE
     * where AdamW left a set-only tensor's gradient as it was, LIVE once
     * written (cf_grad_take_zero) and for all at the end of every backward. */
    uint8_t *gstate;
    /* 1: the step may leave set-only tensors' gradients STALE (skipping the
     * 4-byte zero store per element in AdamW's pass). From CF_GRAD_KEEP and
     * CF_GRAD_SET at open (either 0: never); tests may flip it. */
    int keep_stale;
    /* Early norm (optim.c: cf_norm_pre_*): pre_ok where the layout allows it
     * (one process, whole layout, each layer's gradients one range
     * [layer_lo[l], layer_hi[l]) in layer order) and CF_NORM_EARLY is not 0
     * at open; pre_on while the step's last backward sums layers early,
     * pre_layers of them so far; pre_steps: steps that used the sum. */
    int pre_ok, pre_on, pre_layers;
    size_t *layer_lo, *layer_hi;
    int64_t pre_steps;
    /* The step's AdamW as one backend call over every segment (the
     * backend's adamw_segments) where nothing waits for single segments
     * (no segment_updated hook); one_pass 0 (CF_ADAMW_ONE_PASS=0 at open):
     * a call per segment. aseg: the table, [lay.nseg]. */
    int one_pass;
    cf_adamw_seg *aseg;
} cf_optim;

/* The state of a trainable tensor's fp32 gradient (cf_optim.gstate). A
 * weight-gradient GEMM either adds to the gradient (dW += dY^T X) or writes
 * it (beta 0, CF_MM_DW_SET): writing is allowed where the gradient is
 * logically zero, and required where it is STALE. */
enum {
    CF_GRAD_LIVE = 0,  /* holds the step's sum so far: writers add to it */
    CF_GRAD_ZERO = 1,  /* holds zeros: the first writer may write instead of add */
    CF_GRAD_STALE = 2, /* logically zero, but the memory still holds the last
                          step's gradient (AdamW skipped its zeroing, which
                          saves 4 of the pass's 34 bytes per element). Only
                          set-only tensors: their first writer is a GEMM that
                          overwrites. Nothing reads it as a gradient:
                          cf_grad_settle zeroes it first. */
};

/* ------------------------------------------------ weight-gradient pairs */

/* dwpair.c: the MLP's weight gradients of two micro-batches in one GEMM */
enum { CF_PAIR_NONE, CF_PAIR_HOLD, CF_PAIR_JOIN };
typedef struct {
    int off;            /* CF_DW_PAIR=0 at open, or no memory for the stash */
    int phase;          /* of the backward in flight */
    int rows;           /* rows of the backward in flight */
    int held;           /* rows held for the next backward (0: none) */
    int cap;            /* rows per layer in the stash */
    void *buf;          /* backend memory: L stashes of layer_bytes */
    size_t layer_bytes;
    uint8_t *zero;      /* [2L] down's, gate/up's gradient was ZERO or STALE at
                           HOLD: the joining (or flushing) GEMM writes it */
    int64_t joins;      /* backwards that joined a held one */
    int max_rows;       /* a backward of fewer rows may hold (CF_DWPAIR_MAX_ROWS) */
    int side;           /* the joining GEMMs in a side section of the backend
                           (beside the rest of the backward; CF_DW_SIDE=0 at
                           open: in line) */
    int full;           /* backwards of more than half a micro-batch's rows
                           (the full ones: regular, loss-only) pair too, in a
                           stash of 2 cap_T rows (CF_DW_PAIR_FULL=0 at open,
                           or no memory for it: they do not) */
    /* the LM head's pair (dwpair.c, second part): no stash; the filter puts
     * the next compact backward's g and lnf rows after the held ones */
    int head_off;       /* CF_DW_PAIR_HEAD=0 at open */
    int head_phase;     /* of the backward in flight */
    int head_rows;      /* its kept rows */
    int head_held;      /* rows held: g and lnf at [0, head_held) of the filter's compact copies */
    int head_at;        /* the row at which the last filter put g's and lnf's rows */
    float head_scale;   /* the held rows' token weight (a join needs the same) */
    int head_set;       /* CF_MM_DW_SET: the gradient held zeros at HOLD, which the pair's GEMM writes */
    int64_t head_joins; /* backwards whose LM head joined a held one */
} cf_dwpair;

/* dwside.c: the attention projections' weight gradients beside the backward */
typedef struct {
    int off;            /* CF_DW_SIDE_ATTN=0 or CF_DW_SIDE=0 at open, or no memory */
    int force;          /* CF_DW_SIDE_ATTN=1: also without side sections, and in
                         * full backwards (tests, timing) */
    int on;             /* in the backward in flight */
    int cap;            /* rows per layer in the buffers */
    void *buf;          /* backend memory: L buffers of layer_bytes */
    size_t layer_bytes;
    int64_t backwards;  /* backwards that ran them beside */
} cf_dwside;

/* ----------------------------------------------------------- activations */

/* A saved activation: T token rows of row_bytes each. The filter operator
 * gathers `full` into `compact` (if `gather`); the backward reads `cur`.
 * Tensors with gather = 0 are read by their backward kernel through the
 * row index instead (the gather fused into that kernel). */
typedef struct {
    const char *what;
    void *full;
    void *compact;
    void *cur;
    size_t row_bytes;
    int gather;
} cf_saved;

/* Saved activations of one layer (token-major, T rows). With fused gate/up
 * (cf_layer_params.fused_gate_up) up == gate: one slot of [T, 2F] rows,
 * gate in columns 0..F-1 and up in F..2F-1 (cf_gate_up). */
typedef struct {
    int x_mid, ln1, rstd1, qpre, rstdq, kpre, rstdk, q, att, lse, ln2, rstd2, gate, up;
    void *k, *v;        /* full K (after norm and RoPE) and V: never compacted */
} cf_layer_acts;

#define CF_MAX_SAVED 1024

/* Issue 17: the largest g = softmax - onehot [T, V] (T V x bytes per act
 * element) a training forward keeps for its backward; above it the
 * backward recomputes the logits as before. */
#define CF_HEAD_SAVE_MAX_BYTES ((uint64_t)1 << 30)
/* 0 when CF_HEAD_SAVE=0 is in the environment (A/B timing, cross-checks). */
int cf_head_save_env(void);

struct cf_model {
    cf_config cfg;
    cf_backend *b;

    /* parameters */
    int ntensors;
    cf_param *params;
    size_t nparams;        /* real elements, all tensors */
    size_t nw;             /* length of w (with padding) */
    void *w;               /* compute copy, all tensors (backend dtype) */
    cf_optim opt;
    cf_dwpair dwp;         /* weight-gradient pairs (dwpair.c) */
    cf_dwside dws;         /* attention's weight gradients beside (dwside.c) */
    int side_narrow;       /* the backward in flight is compact: its side
                              sections leave part of the device to the chain
                              (backend.h: side_begin) */
    cf_layer_params *lp;
    int p_embed, p_norm, p_lm_head;   /* lm_head == embed when tied */
    cf_lora_opts lora;     /* rank 0: no adapters */
    float lora_scale;      /* alpha / rank, or alpha / sqrt(rank) */
    float *inv_freq;       /* backend memory, D/2 */

    /* activations, allocated for a capacity of T rows */
    int B, S, T, cap_T;
    int doc_mask_bos;      /* -1 off; else token id that starts a document */
    int nsaved;
    cf_saved saved[CF_MAX_SAVED];
    int *resid;            /* [L+1] saved indices of the residual stream */
    cf_layer_acts *la;
    int s_lnf, s_rstdf, s_tokens, s_targets, s_pos;
    int *doc;              /* backend [T] */
    float *losses;         /* backend [T] */
    cf_tp_sync tp;         /* tensor parallelism (size <= 1: none) */
    float *tp_stats;       /* backend [tp, T, 3]: the vocab slices' cross-entropy statistics */
    int s_lse;             /* saved [T] fp32: the whole vocabulary's log-sum-exp (TP) */
    /* Issue 17: a forward that a backward follows keeps the LM head's
     * g = softmax - onehot of every row, so that backward skips the logits
     * GEMM (model.c, cf_forward; backward.c) */
    int head_save;         /* CF_HEAD_SAVE not 0 at open, and no TP */
    int s_head;            /* saved [T, V] act: g; -1 until a forward keeps it */
    uint64_t head_g_fwd;   /* the forward whose g s_head holds, unconsumed; 0: none */
    float *dloss;          /* backend [T] */
    float *ref_dev;        /* backend [T]: reference losses for device selection */
    cf_scalars *scalars;   /* backend */
    /* LoRA scratch: the adapter's output [T, widest out] and its input
     * gradient scale * dy B [T, rank] (kept from bwd_input to bwd_weight) */
    void *lora_v, *lora_du;
    /* LoRA dropout (linear.c): the forward drops when `train` is on and
     * lora.dropout > 0, with the masks of counter drop_next (then counted
     * on); drop_on and drop_ctr say what the last forward did, so its
     * backward regenerates the same masks (key = f(drop_seed, drop_ctr, the
     * adapter's lora_A index), backend/dropout_mask.h) at the original rows
     * lora_rows (the kept rows of a compact backward; NULL: row i is i). */
    int train;              /* cf_model_set_train; the trainer's step only */
    int bwd_follows;        /* the trainer's step: a backward of this forward follows */
    int drop_on;
    uint64_t drop_seed, drop_next, drop_ctr;
    uint32_t drop_thr;      /* round(P 2^32) */
    float drop_scale;       /* 1 / (1 - P) */
    const int *lora_rows;
    /* backward scratch */
    void *d_resid, *d_ln, *d_att, *d_q, *d_qn, *d_k, *d_kn, *d_v, *d_h, *d_gate, *tmp;
    /* the fused q/k/v GEMM's output [T, qd + 2 kd]: its own buffer only
     * where tmp is too narrow (else NULL and tmp is used) */
    void *qkv;

    /* kept rows: one selection of one forward (kept.c) */
    uint64_t fwd_id;       /* counts forwards */
    uint64_t sel_id;       /* counts selections */
    uint64_t sel_fwd;      /* the forward the current selection belongs to */
    int n_kept, kept_max_len;
    uint8_t *keep_dev;     /* backend [T] mask */
    int *rows, *seq_start; /* backend [T], [B+1] */
    int filtered;          /* saved tensors are compacted to the current selection */
    float *host_losses;    /* [T], filled on demand (host selection, tests) */
    int host_losses_fwd;   /* host_losses belong to the current forward */

    /* stage timings: marks in stream order, resolved when read */
    int npending;
    struct { int stage, a, c; double host; } pending[64];
    cf_timings timings;    /* resolved sums since the last cf_model_timings */
    int profile, prof_phase;            /* phase 0 forward, 1 backward */
    double prof[2][CF_PROF_N];
    /* ops timed by time marks, resolved into prof by cf_model_timings */
    struct { int phase, cat, a, c; } *prof_ops;
    int nprof_ops, cap_prof_ops, prof_synced;
};

/* Pointer to parameter i's compute weights / fp32 gradient (NULL if i < 0
 * or the tensor is frozen). */
void *cf_weight(cf_model *m, int i);
float *cf_grad(cf_model *m, int i);
/* For the caller about to write tensor i's gradient with a weight-gradient
 * GEMM: CF_MM_DW_SET where the GEMM must (STALE) or may (ZERO; not with
 * CF_GRAD_SET=0) write instead of add, else 0; the tensor is LIVE after. */
int cf_grad_take_zero(cf_model *m, int i);
/* The same for one GEMM over the contiguous gradients of i and j (the fused
 * gate/up): CF_MM_DW_SET only where both may be written; else 0, and a
 * STALE one of the two is zeroed first, as the GEMM will add to it. */
int cf_grad_take_zero_pair(cf_model *m, int i, int j);
/* The same for n (at most 4) tensors, e.g. the fused q/k/v (0 for other n) */
int cf_grad_take_zero_group(cf_model *m, const int *idx, int n);
/* Every STALE gradient zeroed and marked ZERO: before anything reads the
 * gradient buffer as gradients (the step's norm, a backward's end). */
void cf_grad_settle(cf_model *m);
/* Every trainable tensor's gradient state set to `state` (CF_GRAD_*). */
void cf_grad_mark_all(cf_model *m, int state);
/* 0 when CF_GRAD_SET=0 is in the environment (read once): ZERO gradients
 * are added to, not written (A/B timing), and none is left STALE. */
int cf_grad_set_env(void);

/* Saved activation as the backward reads it. */
#define SAVED(m, idx) ((m)->saved[(idx)].cur)

/* Layer l's saved gate and up (never gathered, so full) and the distance
 * between their rows in elements: F, or 2F in the fused gate/up slot. */
static inline int cf_gate_up(cf_model *m, int l, void **gate, void **up) {
    const cf_layer_acts *a = &m->la[l];
    const int F = m->cfg.intermediate_size;
    *gate = m->saved[a->gate].full;
    if (!m->lp[l].fused_gate_up) {
        *up = m->saved[a->up].full;
        return F;
    }
    *up = (char *)*gate + (size_t)F * m->b->act_size;
    return 2 * F;
}

/* Per-op-category profiling: OP(cat, call) times `call` when profiling. */
double cf_prof_begin(cf_model *m);
void cf_prof_end(cf_model *m, int cat, double t0);
#define OP(cat, call)                                       \
    do {                                                    \
        double t_ = (m)->profile ? cf_prof_begin(m) : 0.0;  \
        call;                                               \
        if ((m)->profile) cf_prof_end(m, cat, t_);          \
    } while (0)

cf_attn_shape cf_model_attn_shape(cf_model *m);

/* Stage timing (forward, filter, backward, optimizer): marks in stream
 * order, no synchronisation; cf_model_timings resolves them. */
enum { CF_STAGE_FORWARD, CF_STAGE_FILTER, CF_STAGE_BACKWARD, CF_STAGE_OPTIMIZER };
void cf_stage_begin(cf_model *m, int stage);
void cf_stage_end(cf_model *m, int stage);
/* Saved tensors read full again (after a backward of a non-compact mode). */
void cf_model_reset_filter(cf_model *m);
cf_backend *cf_model_backend(cf_model *m);

/* ---- dwpair.c ---- */
void cf_dwpair_init(cf_model *m);
void cf_dwpair_free(cf_model *m);
/* At the start of a backward of n rows (eligible: its MLP can pair):
 * decides m->dwp.phase, flushing held rows that cannot join. */
int cf_dwpair_begin(cf_model *m, int eligible, int n);
/* At its end (ok: it succeeded): the rows now held, if any. */
void cf_dwpair_end(cf_model *m, int ok);
/* Layer l's three MLP weight gradients over the stash's first rows. */
void cf_dwpair_weight_grads(cf_model *m, int l, int rows);
/* The held rows' weight gradients alone (MLP and LM head); drop: forget them. */
int cf_dwpair_flush(cf_model *m);
void cf_dwpair_drop(cf_model *m);
/* The LM head's pair. place: at the filter of n kept rows, the row of the
 * compact copies at which g's and lnf's rows go (after held ones that leave
 * room; held ones that do not are flushed first), -1 on error. head_begin:
 * in a backward of n rows whose LM head reads the forward's g (eligible: it
 * may pair), decides m->dwp.head_phase (flushing held rows that cannot
 * join); its LM head then runs the input gradient alone where that is not
 * NONE, and at JOIN cf_dwpair_head_grads over the held and its own rows. */
int cf_dwpair_head_place(cf_model *m, int n);
int cf_dwpair_head_begin(cf_model *m, int eligible, int n, float scale);
void cf_dwpair_head_grads(cf_model *m, int rows, float scale, int flags);
/* Layer l's stash from row `row`: dgate|dup [., 2F], h [., F], ln2 and
 * the down projection's dY [., C]. */
void *cf_dwpair_dgu(cf_model *m, int l, int row);
void *cf_dwpair_h(cf_model *m, int l, int row);
void *cf_dwpair_ln2(cf_model *m, int l, int row);
void *cf_dwpair_dres(cf_model *m, int l, int row);
/* Backend memory of `bytes` that leaves 1 GiB free, or NULL (no error). */
void *cf_alloc_spare(cf_model *m, size_t bytes);

void cf_dwside_init(cf_model *m);
void cf_dwside_free(cf_model *m);
/* whether this backward runs o's and q/k/v's weight gradients beside
 * (eligible: backward.c's conditions), taking the buffers if needed */
int cf_dwside_begin(cf_model *m, int eligible, int compact);
void *cf_dwside_dres(cf_model *m, int l); /* [cap, C]: o's dY */
void *cf_dwside_dqkv(cf_model *m, int l); /* [cap, qd + 2 kd]: [dq dk dv] */

/* ---- kept.c ---- */
/* Fails unless kept is the current selection of the current forward. */
int cf_kept_check(cf_model *m, const cf_kept *kept);
/* Host copy of the last forward's losses (downloads once per forward). */
const float *cf_model_host_losses(cf_model *m);

typedef int (*cf_layout_fn)(void *ctx, const cf_model *m, cf_optim_layout *lay);

/* ---- tensor parallelism (model.c) ---- */
static inline int cf_tp_on(const cf_model *m) { return m->tp.size > 1; }
/* Sums x [count] of the given type over the TP group and makes the compute
 * stream wait for it (no-op without TP); 0 or -1 (cf_fail). */
int cf_tp_allreduce(cf_model *m, void *x, size_t count, int type, int phase);
/* m->tp.settle under TP (no-op otherwise); 0 or -1 (cf_fail). */
int cf_tp_settle(cf_model *m);
/* Opens the local model of TP rank `rank` of `size`, with the collectives
 * in *sync (ctx and functions): m->cfg is the local config, weights are
 * loaded from the whole HF tensors (or initialised as the whole model
 * would be) and split. The trainable tensors' layout comes from `layout`. */
cf_model *cf_model_open_tp(const cf_model_opts *o, const cf_tp_sync *sync, cf_layout_fn layout, void *lctx);
/* Writes the whole model (HF layout) to dir: every TP rank must call it
 * (the tensors are gathered); write = 1 on the one rank that writes. */
int cf_model_save_tp(cf_model *m, const char *dir, const char *dtype, int write);

/* ---- linear.c ---- */
void cf_linear_fwd(cf_model *m, const cf_linear *l, void *out, const void *in, int T, int K, int N);
/* out = resid + in W^T (+ b) (+ adapter): the residual add fused into the GEMM */
void cf_linear_fwd_residual(cf_model *m, const cf_linear *l, void *out, const void *in, const void *resid, int T,
                            int K, int N);
/* din (=, or += if accumulate) dout W; din may be NULL. */
void cf_linear_bwd_input(cf_model *m, const cf_linear *l, void *din, const void *dout, int T, int K, int N,
                         int accumulate);
/* dW += dout^T in, db += colsum(dout): only for trainable tensors. */
void cf_linear_bwd_weight(cf_model *m, const cf_linear *l, const void *dout, const void *in, int T, int K, int N);
/* Both, in one backend call where both are needed. */
void cf_linear_bwd(cf_model *m, const cf_linear *l, void *din, const void *dout, const void *in, int T, int K,
                   int N, int accumulate);

/* ---- optim.c ---- */
/* The whole-model layout (one process): trainable tensors packed in table
 * order, padded to 16-byte boundaries. */
int cf_optim_layout_whole(const cf_model *m, cf_optim_layout *lay);
/* The same with the tensors packed in order[0..ntensors) (a permutation of
 * the table's indices), e.g. an older table order (cf_param_order_v2). */
int cf_optim_layout_order(const cf_model *m, const int *order, cf_optim_layout *lay);
void cf_optim_layout_free(cf_optim_layout *lay);
/* Allocates the optimizer state for a layout (takes ownership of lay) and
 * assigns woff/goff of every tensor. Called once, before weights are set. */
int cf_optim_init(cf_model *m, cf_optim_layout *lay);
void cf_optim_free(cf_model *m);
/* Uploads fp32 host weights of tensor i (numel floats) into the compute
 * copy and, for the parts in the local shard, the master weights. */
int cf_optim_set_tensor(cf_model *m, int i, const float *host);
/* Optimizer state for checkpoints: the local shard's m and v (host fp32
 * arrays of opt.lay.nlocal) and the master weights. */
int cf_model_get_adam(cf_model *m, float *m_out, float *v_out);
int cf_model_set_adam(cf_model *m, const float *m_in, const float *v_in, int64_t step);
/* The early gradient norm. cf_norm_pre_begin, at every backward's start,
 * forgets an earlier early sum and, for the step's last micro-batch (one
 * process, a backward of every row), starts a new one;
 * cf_norm_pre_layer(m, l), once layer l's gradients are final, adds their
 * squares in a side section of the backend (beside the rest of the
 * backward); cf_step_ex then sums only the tensors outside the layers.
 * Not in the compact modes: their backward, of half the rows, has less
 * compute to hide the pass's reads under, and measured slower with it than
 * the optimizer got faster (docs/BENCHMARKS.md, run 19). */
void cf_norm_pre_begin(cf_model *m, int compact);
void cf_norm_pre_layer(cf_model *m, int l);
/* Zeroes the squared-norm and loss accumulators. */
void cf_model_clear_scalars(cf_model *m);
/* cf_step that also returns the loss sum accumulated since the scalars were
 * cleared (same transfer as the norm: one host sync per step). */
int cf_step_ex(cf_model *m, const cf_adamw_params *hp, float *grad_norm, double *loss_sum);

/* ---- backward.c ---- */
/* The backward with an explicit weight per counted token: d(loss)/d(l_t)
 * = token_weight for every counted row t. loss_sum accumulates on the
 * device (m->scalars). */
int cf_backward_weighted(cf_model *m, cf_mode mode, const cf_kept *kept, float token_weight);
/* Test reference for DESIGN §1 equivalence 2: the dense (all rows) backward
 * of the kept-position loss in which the K and V rows of filtered tokens are
 * constants (their dK, dV are zeroed). */
int cf_backward_reference_stopgrad(cf_model *m, const cf_kept *kept, float loss_scale, float *loss_out);
/* Test reference of centrifuge-kv (DESIGN §1): the same dense backward, but
 * only the INPUT of the K and V projections at filtered rows is a constant:
 * dK, dV of filtered rows reach the K/V weights, biases and k-norm weight,
 * and are zeroed before they would flow on into ln1. */
int cf_backward_reference_stopgrad_kv(cf_model *m, const cf_kept *kept, float loss_scale, float *loss_out);

/* ---- checkpoint.c ---- */
/* dir/step_NNNNNNNN created (stale temp files of a killed save removed).
 * With mark (one writer per checkpoint: rank 0), the directory must be new
 * or this run's, and gets this run's marker (run id from dir/run.json,
 * created if missing) before anything else is written. */
int cf_checkpoint_dir(const char *dir, int64_t step, char *out, size_t cap, int mark);
/* The run id of dir/run.json into id ("" if none); create: make one. */
int cf_checkpoint_run_id(const char *dir, char *id, size_t cap, int create);
/* 0 if the local optimizer shard's master weights, AdamW m and v (any may
 * be NULL; host arrays of opt.lay.nlocal) are finite and v >= 0; else
 * cf_fail("<what>: AdamW v of <tensor>[i] is nan"). */
int cf_checkpoint_check_state(const cf_model *m, const float *master, const float *am, const float *av,
                              const char *what);
/* Points dir/latest at step (atomically) and removes checkpoints older
 * than the newest keep_last. Call only when the checkpoint is complete. */
int cf_checkpoint_commit(const char *dir, int64_t step, int keep_last);
/* The directory that dir/latest names. */
int cf_checkpoint_latest(const char *dir, char *out, size_t cap);

/* ---- model.c ---- */
/* Opens with an optional optimizer layout builder (data parallel); NULL =
 * whole. The builder gets the parameter table and fills lay. */
cf_model *cf_model_open_with(const cf_model_opts *o, cf_layout_fn layout, void *layout_ctx);
/* The parameter table's indices in the order of versions before the q/k/v
 * biases moved behind the three weights (each bias right after its weight),
 * into order[0..ntensors); returns whether that differs from the table. */
int cf_param_order_v2(const cf_model *m, int *order);

#endif
