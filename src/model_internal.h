/*
 * model_internal.h — the model's private state, shared by model.c (forward,
 * filter, backward, optimizer) and the tools built on it (train, score,
 * generate). Not part of the public API.
 */
#ifndef CF_MODEL_INTERNAL_H
#define CF_MODEL_INTERNAL_H

#include "backend.h"
#include "centrifuge.h"

typedef struct {
    char name[96];
    size_t offset;      /* in elements, into the flat parameter buffers */
    size_t numel;
    int ndim;
    int64_t shape[2];
    int decay;          /* AdamW weight decay applies (matrices only) */
} cf_param;

/* Indices into the parameter table for one transformer layer (-1 = absent). */
typedef struct {
    int ln1, q, qb, k, kb, v, vb, o, ob, qn, kn, ln2, gate, up, down;
} cf_layer_params;

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

/* Saved activations of one layer (token-major, T rows). */
typedef struct {
    int x_mid, ln1, rstd1, qpre, rstdq, kpre, rstdk, q, att, lse, ln2, rstd2, gate, up;
    void *k, *v;        /* full K (after norm and RoPE) and V: never compacted */
} cf_layer_acts;

#define CF_MAX_SAVED 1024

/* Op categories of the profiler (bench --profile). */
enum { CF_PROF_GEMM, CF_PROF_ATTN, CF_PROF_LMHEAD, CF_PROF_NORM, CF_PROF_ROPE, CF_PROF_ELTWISE, CF_PROF_N };

struct cf_model {
    cf_config cfg;
    cf_backend *b;

    /* parameters: one flat buffer each, same layout */
    int ntensors;
    cf_param *params;
    size_t nparams;
    float *master;      /* fp32, backend memory */
    void *w;            /* compute copy (cpu: == master) */
    float *grad, *adam_m, *adam_v;
    int64_t step;
    cf_layer_params *lp;
    int p_embed, p_norm, p_lm_head;   /* lm_head == embed when tied */
    float *inv_freq;    /* backend memory, D/2 */

    /* activations, allocated for a capacity of T rows */
    int B, S, T, cap_T;
    int doc_mask_bos;   /* -1 off; else token id that starts a document */
    int nsaved;
    cf_saved saved[CF_MAX_SAVED];
    int *resid;         /* [L+1] saved indices of the residual stream */
    cf_layer_acts *la;
    int s_lnf, s_rstdf, s_tokens, s_targets, s_pos;
    int *doc;           /* backend [T] or NULL */
    float *losses;      /* backend [T] */
    float *dloss;       /* backend [T] */
    float *ref_dev;     /* backend [T]: reference losses for device selection */
    uint8_t *keep_dev;  /* backend [T] */
    /* backward scratch */
    void *d_resid, *d_ln, *d_att, *d_q, *d_qn, *d_k, *d_kn, *d_v, *d_h, *d_gate, *d_up, *tmp;
    /* kept rows (filter operator) */
    int filtered;       /* saved tensors currently compacted */
    int n_kept;
    int *rows, *seq_start;          /* backend */
    int *host_rows, *host_seq_start;
    int32_t *host_tokens;           /* last forward's inputs+targets, B*(S+1) */
    float *host_losses;             /* last forward's losses, T */

    cf_timings timings;
    int profile, prof_phase;            /* phase 0 forward, 1 backward */
    double prof[2][CF_PROF_N];
};

/* Pointer to parameter i in compute dtype / its fp32 gradient. */
void *cf_weight(cf_model *m, int i);
float *cf_grad(cf_model *m, int i);

/* Logits of row t of the last forward into host out[V] (fp32). */
int cf_model_logits_row(cf_model *m, int t, float *out);
/* Enables document masking for later forwards: a token equal to bos starts
 * a new document (positions restart, no attention across documents). */
void cf_model_set_doc_mask(cf_model *m, int bos_token_id);
cf_backend *cf_model_backend(cf_model *m);
/* Optimizer state access for checkpoints (host fp32 arrays of nparams). */
int cf_model_get_adam(cf_model *m, float *m_out, float *v_out);
int cf_model_set_adam(cf_model *m, const float *m_in, const float *v_in, int64_t step);

/* Test reference for DESIGN §1 equivalence 2: the dense (all rows) backward
 * of the kept-position loss in which the K and V rows of filtered tokens are
 * constants (their dK, dV are zeroed). */
int cf_backward_reference_stopgrad(cf_model *m, const uint8_t *keep, float loss_scale, float *loss_out);

/* round(keep * n), at least 1: how many of n positions selection keeps. */
int cf_select_kept_count(float keep, int n);
/* Selection of the last forward's rows, on the device when the backend can
 * (select ref/self), else on the host (cf_select); keep is a host mask. */
int cf_select_rows(cf_model *m, const float *ref_host, float keep_frac, cf_select_kind kind, int per_batch,
                   uint64_t seed, uint8_t *keep);

/* Profiling of the op categories (seconds per phase of the last step). */
void cf_model_set_profile(cf_model *m, int on);
void cf_model_profile(const cf_model *m, double out[2][CF_PROF_N]);

#endif
