/*
 * tp_plan.h — the tensor-parallel (Megatron-style) partition plan: which
 * part of every parameter tensor each of the tp ranks of a tensor-parallel
 * group holds, each rank's local model shape, the communication volume of
 * one micro-batch, and the per-GPU memory of a TP x DP (ZeRO-1) plan.
 * Pure C, no device: the NCCL implementation (issue 16) builds on it.
 *
 *   column-parallel  q, k, v, gate, up: W [out, in], rows (out) split;
 *                    their biases (qwen2 q/k/v) split the same way.
 *                    q rows of rank r = query heads [r*H/tp, (r+1)*H/tp),
 *                    k/v rows = KV heads [r*Hkv/tp, (r+1)*Hkv/tp), both in
 *                    units of head_dim; with tp | Hkv the query heads of a
 *                    rank use exactly the rank's KV heads (GQA group H/Hkv).
 *                    gate/up rows [r*F/tp, (r+1)*F/tp).
 *   row-parallel     o, down: W [out, in], columns (in) split like the
 *                    producer's rows (o: the rank's query heads; down: its
 *                    F slice). The o bias (llama attention_bias) is NOT
 *                    split: every rank holds it and adds it once, after the
 *                    forward all-reduce; its gradient is computed from the
 *                    replicated output gradient and is equal on all ranks.
 *   vocab-parallel   embed_tokens and lm_head [V, C]: rows split by
 *                    vocabulary range. V is padded up to Vp, the next
 *                    multiple of tp; rank r holds rows [r*Vp/tp, (r+1)*Vp/tp)
 *                    of the padded table, of which those >= V are padding
 *                    (zero, never looked up; their logits are masked out of
 *                    the vocab-parallel cross-entropy). Tied embeddings:
 *                    the one tensor serves both and is split once.
 *   replicated       input/post_attention layernorms, the final norm, the
 *                    o bias; qwen3's q_norm/k_norm act per head on head_dim
 *                    and are replicated too, but each rank's gradient is a
 *                    partial sum over its own heads, so it must be
 *                    all-reduced (sum) over the TP group before the step
 *                    (cf_tp_slice.grad_allreduce). The other replicated
 *                    tensors get identical gradients on every rank.
 *
 * Communication of one micro-batch, per layer (Megatron TP without sequence
 * parallelism), T = tokens of the micro-batch, n = rows the backward runs on
 * (the kept rows in a compact mode — centrifuge, strawman, centrifuge-kv —
 * T in regular and loss-only):
 *   forward   all-reduce [T, C] after o_proj, all-reduce [T, C] after down_proj
 *   backward  all-reduce [n, C] of the input gradient of q/k/v (summed over
 *             the three), all-reduce [n, C] of the input gradient of gate/up
 * and once per micro-batch: the vocab-parallel embedding's all-reduce [T, C]
 * (forward), the vocab-parallel cross-entropy's three all-reduces on [T]
 * fp32 (row max, sum of exp, target logit; forward — every token's loss is
 * needed for selection, and all ranks then hold the same losses, so they
 * select the same rows), and the LM head's input-gradient all-reduce
 * [n, C] (backward). cf_tp_comm counts the payload (the buffer handed to
 * the all-reduce) on each rank; a ring all-reduce sends 2 (tp-1)/tp times
 * that per rank (cf_tp_ring_bytes).
 */
#ifndef CF_DIST_TP_PLAN_H
#define CF_DIST_TP_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "centrifuge.h"

#ifdef __cplusplus
extern "C" {
#endif

#define CF_TP_MAX 1024   /* no model has more KV heads than MAX_HEADS (1024) */

typedef enum {
    CF_TP_REPLICATED = 0,   /* every rank holds the whole tensor                */
    CF_TP_COLUMN,           /* rows of W [out, in] (and of its bias [out]) split */
    CF_TP_ROW,              /* columns of W [out, in] split                     */
    CF_TP_VOCAB,            /* rows of [V, C] split by vocabulary range, padded  */
} cf_tp_kind;

const char *cf_tp_kind_name(cf_tp_kind k);   /* "replicated", "column", "row", "vocab" */

/* Rank r's part of one HF tensor. */
typedef struct {
    cf_tp_kind kind;
    int layer;                /* -1 embedding, 0..L-1, L final norm / LM head      */
    int ndim;                 /* 1 or 2, as in the HF file                         */
    int64_t shape[2];         /* the full HF shape (shape[1] = 0 when ndim = 1)    */
    int dim;                  /* the split dimension: 0 rows, 1 columns; -1 none   */
    int64_t start, len;       /* the rank's real range in dimension dim of the HF  */
                              /* tensor (replicated: 0, shape[0])                  */
    int64_t local_shape[2];   /* the rank's local tensor (vocab: padding included) */
    int64_t pad;              /* vocab: padding rows at the end of the local tensor */
    int64_t local_numel;      /* local_shape[0] * max(local_shape[1], 1)           */
    int head_start, heads;    /* q/k/v/o (and their biases): the rank's heads, in  */
                              /* units of head_dim (KV heads for k/v); else 0, 0   */
    int grad_allreduce;       /* 1: its gradient is a partial sum on each rank and */
                              /* must be all-reduced over the group (q/k norms)    */
    int after_allreduce;      /* 1: a row-parallel bias, added once after the      */
                              /* forward all-reduce (o_proj.bias)                  */
} cf_tp_slice;

/* Rank r's local model. */
typedef struct {
    int tp, rank;
    int hidden;                          /* C, replicated                          */
    int head_dim;                        /* D                                      */
    int heads, head_start;               /* H/tp query heads from head_start       */
    int kv_heads, kv_head_start;         /* Hkv/tp KV heads from kv_head_start     */
    int q_dim, kv_dim;                   /* heads*D, kv_heads*D: local q rows, k/v */
                                         /* rows, o columns                        */
    int intermediate, ffn_start;         /* F/tp gate/up rows, down columns        */
    int vocab_size, vocab_padded;        /* V, Vp (Vp = V rounded up to tp)        */
    int vocab_local;                     /* Vp/tp rows of the local embedding/head  */
    int vocab_start, vocab_len;          /* real vocabulary [start, start+len),    */
                                         /* vocab_len <= vocab_local (may be 0)    */
    int64_t params;                      /* local parameter count (padding too)     */
} cf_tp_local;

/* 0 when tp can split the model, else -1 with one cf_fail line naming every
 * number tp does not divide (num_attention_heads, num_key_value_heads,
 * intermediate_size) and the tp values that would work. The vocabulary
 * never blocks: it is padded (cf_tp_vocab_padded). */
int cf_tp_check(const cf_config *c, int tp);

/* V rounded up to a multiple of tp (tp >= 1). */
int64_t cf_tp_vocab_padded(const cf_config *c, int tp);

/* One line for logs, e.g. "tp 8: 4 of 32 heads, 1 of 8 KV heads, 1792 of
 * 14336 FFN, vocab 128256 (16032 rows per rank)" or "... vocab 50257 padded
 * to 50264 (6283 rows per rank, 7 padding rows on rank 7)". Assumes
 * cf_tp_check passed. Returns buf. */
const char *cf_tp_describe(const cf_config *c, int tp, char *buf, size_t cap);

/* The parameter tensors of the model, in the order and with the HF names of
 * model.c's build_param_table (no LoRA adapters). */
int cf_tp_num_tensors(const cf_config *c);
/* Name of tensor i into buf; 0, or -1 (cf_fail) if i is out of range or the
 * name does not fit. */
int cf_tp_tensor_name(const cf_config *c, int i, char *buf, size_t cap);

/* Rank's part of the tensor called name. -1 (cf_fail, one line) for a tp
 * that cannot split the model, a rank outside [0, tp), or a name that is not
 * a parameter of this model (a bias or norm its config does not have,
 * lm_head.weight of a tied model, a layer past the last, LoRA adapters). */
int cf_tp_split(const cf_config *c, int tp, const char *name, int rank, cf_tp_slice *out);

/* Rank's local model shape. -1 (cf_fail) as cf_tp_split. */
int cf_tp_local_config(const cf_config *c, int tp, int rank, cf_tp_local *out);

/* Copies the rank's part of a full row-major HF tensor (elem bytes per
 * element) into its local row-major tensor, zero-filling vocab padding. */
void cf_tp_extract(const cf_tp_slice *s, const void *full, void *local, size_t elem);
/* The reverse: writes the local tensor's real elements (padding dropped) to
 * their places in the full tensor. Every element of a split tensor is
 * written by exactly one rank; a replicated tensor by every rank. */
void cf_tp_insert(const cf_tp_slice *s, const void *local, void *full, size_t elem);

/* ------------------------------------------------------- communication */

/* All-reduce payload bytes per rank for one micro-batch (forward and
 * backward), broken down as in the header comment. act_bytes: bytes per
 * activation element of the all-reduced tensors (2 for bf16); the
 * cross-entropy's statistics and the q/k norm gradients are fp32. */
typedef struct {
    int64_t fwd_layers;    /* 2 L x [T, C] x act_bytes: after o_proj and down_proj     */
    int64_t fwd_embed;     /* [T, C] x act_bytes: the vocab-parallel embedding         */
    int64_t fwd_xent;      /* 3 x [T] x 4: row max, sum of exp, target logit           */
    int64_t bwd_layers;    /* 2 L x [n, C] x act_bytes: input grads of q/k/v, gate/up  */
    int64_t bwd_lm_head;   /* [n, C] x act_bytes: the LM head's input gradient         */
    int64_t fwd, bwd;      /* the sums                                                 */
    int fwd_calls, bwd_calls;   /* 2L + 1 + 3, 2L + 1                                  */
    int64_t step_qk_norm;  /* qwen3: 2 L x D x 4, the q/k norm gradients, once per     */
                           /* optimizer step (not in fwd/bwd)                          */
} cf_tp_comm;

/* All zero for tp = 1 (no communication). T >= 1, 1 <= n <= T. */
int cf_tp_comm_detail(const cf_config *c, int tp, int64_t T, int64_t n, int act_bytes, cf_tp_comm *out);
/* fwd and bwd of cf_tp_comm_detail. */
int cf_tp_comm_bytes(const cf_config *c, int tp, int64_t T, int64_t n, int act_bytes, int64_t *fwd, int64_t *bwd);
/* What a ring all-reduce of payload bytes sends from each of tp ranks:
 * 2 (tp-1)/tp x payload (rounded down). */
int64_t cf_tp_ring_bytes(int64_t payload, int tp);

/* --------------------------------------------------------------- memory */

/* Per-GPU memory of training with tensor parallelism tp and dp data-parallel
 * ranks (ZeRO-1: the fp32 master weights and AdamW moments of the rank's
 * TP shard are split over its dp ranks). docs/MEMORY_PLANS.md gives the
 * formulas; the activation model is memest.c's per-row bytes with the
 * per-head and per-FFN-column tensors divided by tp. */
typedef struct {
    int tp, dp;              /* >= 1                                             */
    int64_t batch, seq;      /* micro-batch per rank                             */
    int compact;             /* centrifuge/strawman: compact copies of the kept  */
    double keep;             /* fraction kept (compact)                          */
    int act_bytes;           /* 2: bf16 weights and activations                  */
    uint64_t reserve;        /* CUDA context, cuBLAS and NCCL workspaces         */
} cf_tp_mem_opts;

typedef struct {
    int64_t params;          /* the rank's parameters (cf_tp_local.params)       */
    uint64_t weights;        /* params x act_bytes                               */
    uint64_t grads;          /* params x 4                                       */
    uint64_t optimizer;      /* ceil(params / dp) x 12: master, m, v             */
    uint64_t act_per_token;  /* activation bytes per token of the micro-batch    */
    uint64_t activations;    /* batch x seq x act_per_token                      */
    uint64_t logits;         /* the LM head's logits chunk (<= 1.5 GiB)          */
    uint64_t reserve;
    uint64_t total;
} cf_tp_mem;

int cf_tp_memory(const cf_config *c, const cf_tp_mem_opts *o, cf_tp_mem *out);

#ifdef __cplusplus
}
#endif

#endif /* CF_DIST_TP_PLAN_H */
