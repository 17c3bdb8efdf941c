/*
 * dwpair.c — the MLP's weight gradients of two micro-batches in one GEMM
 * each (issue 17: the centrifuge backward at M = kept rows).
 *
 * Why. A weight-gradient GEMM dW += dY^T X over n rows reads and writes
 * the fp32 gradient (8 bytes per weight) whatever n is; at the kept rows
 * of a filtered micro-batch (n = T/2) that traffic is as large as the
 * product's own time on an H100 (run 14's analysis: ~3.5 ms of Llama3.2-3B's
 * 33 ms centrifuge backward per micro-batch is the gradient's read alone).
 * Two micro-batches' rows in one GEMM halve it: dW += [dY_a; dY_b]^T [X_a; X_b].
 *
 * How. A micro-batch whose backward another one of the same step follows
 * (the trainer says so: cf_optim.more_micro) and whose rows (kept rows in
 * the compact modes, all rows in a full backward) number fewer than
 * CF_DWPAIR_MAX_ROWS, HOLDs: its
 * MLP writes dgate|dup and h straight into a per-layer stash at rows
 * [0, n), copies the down projection's dY (the residual gradient) and the
 * gate/up input (ln2) there, and skips the MLP's three weight gradients
 * (the input gradients run as always). The next backward JOINs: the same
 * at rows [held, held + n), then one GEMM per weight over held + n rows.
 * Of the layers only the MLP (3/4 of a Llama layer's weights) pairs;
 * attention's projections do not (their copies would cost about what the
 * halved traffic saves). The LM head pairs in the compact modes without a
 * copy (second part, below).
 *
 * Every gradient is the same sum in another order. Held rows never reach
 * the optimizer or a reader unflushed: cf_step_ex and cf_model_get_grad
 * flush them (the held rows' GEMMs alone), so does a backward that cannot
 * join, and cf_zero_grad drops them. The last micro-batch of a step never
 * holds, so data parallel's buckets would be final when their layer's
 * backward ends, as before; still, pairs run in one process only until
 * tests/gpu/dp_check.sh has run with them (backward.c: mlp_pairs).
 * CF_DW_PAIR=0 in the environment at open turns pairing off (A/B timing).
 *
 * The joining GEMMs depend on nothing the rest of the backward computes
 * and nothing in it reads their gradients, so they run in a side section
 * of the backend (backend.h: side_begin; CUDA: a second stream), beside the
 * backward's chain of input gradients, whose small kernels and part-wave
 * GEMMs leave SMs idle; backward.c joins them at its end, before anything
 * may read the gradients or refill the stash. CF_DW_SIDE=0 at open keeps
 * them in line (A/B timing); so does --profile (per-op times).
 * The stash is taken from the second optimizer step on, where 1 GiB stays
 * free after it; else pairing is off for the model (memory is never traded
 * for it, and cf_memory_check's estimate leaves it out).
 *
 * Stash of layer l (backend memory, cap rows each): dgu [cap, 2F] | h
 * [cap, F] | ln2 [cap, C] | dres [cap, C], activation dtype; cap is the
 * micro-batch's capacity cap_T (two compact backwards' kept rows), or
 * 2 cap_T once a full backward pairs (CF_DW_PAIR_FULL=0: never).
 */
#include <stdlib.h>
#include <string.h>

#include "base/common.h"
#include "engine/model_internal.h"

/* Rows from which a backward no longer holds. With n rows a weight's
 * gradient costs 2n FLOPs against 8 bytes of fp32 read and write; from
 * n = 2048 (512 FLOPs per byte, about twice an H100's ~270 at 800 TFLOP/s
 * and 3 TB/s) the GEMM hides that traffic, and in line pairs gained nothing
 * there (TinyLlama @4096 at keep 0.5, 2048 kept rows: 187.3 against 188.3
 * ms per step, run 17). Beside the backward (a side section) they do: the
 * same 181.2, 183.5 -> 177.7, 175.6 ms (-3.1%, run 19, 3.5 GiB of stash),
 * as Llama3.2-3B's and Qwen2.5-1.5B's 1024 rows gained 5-7% in line (run
 * 17) and 1.5-2% more beside (run 19). Full backwards too (run 20,
 * regular, ms per backward of 8 micro-batches): Llama3.2-3B's 2048 rows
 * 446.2, 447.3 -> 435.8, 434.5 (-2.5%, 6.6 GiB of stash), Qwen2.5-1.5B's
 * 225.6, 227.0 -> 224.5, 220.4; TinyLlama's 4096 (with this bound at
 * 8192) 355.6, 352.7 -> 354.7, 354.2: nothing, so 4096 rows stay unpaired. */
#define CF_DWPAIR_MAX_ROWS 4096

void cf_dwpair_init(cf_model *m) {
    const char *e = getenv("CF_DW_PAIR"), *s = getenv("CF_DW_SIDE"), *r = getenv("CF_DWPAIR_MAX_ROWS");
    const char *f = getenv("CF_DW_PAIR_FULL"), *h = getenv("CF_DW_PAIR_HEAD");
    memset(&m->dwp, 0, sizeof m->dwp);
    m->dwp.off = e && *e == '0';
    m->dwp.head_off = h && *h == '0';
    m->dwp.side = !(s && *s == '0');
    m->dwp.full = !(f && *f == '0');
    /* CF_DWPAIR_MAX_ROWS=n at open replaces the bound (timing only) */
    const long v = r && *r ? strtol(r, NULL, 10) : 0;
    m->dwp.max_rows = v >= 1 && v <= (1L << 30) ? (int)v : CF_DWPAIR_MAX_ROWS;
}

void cf_dwpair_free(cf_model *m) {
    if (m->b && m->dwp.buf) m->b->free(m->b, m->dwp.buf);
    free(m->dwp.zero);
    m->dwp.buf = NULL;
    m->dwp.zero = NULL;
    m->dwp.held = m->dwp.cap = 0;
}

static size_t row_elems(const cf_model *m) {
    const size_t C = (size_t)m->cfg.hidden_size, F = (size_t)m->cfg.intermediate_size;
    return 3 * F + 2 * C;
}

/* layer l's stash region `part` (0 dgu, 1 h, 2 ln2, 3 dres) from row `row` */
static void *stash(cf_model *m, int l, int part, int row) {
    const size_t A = m->b->act_size, C = (size_t)m->cfg.hidden_size, F = (size_t)m->cfg.intermediate_size;
    const size_t cap = (size_t)m->dwp.cap, width[4] = {2 * F, F, C, C};
    size_t off = 0;
    for (int i = 0; i < part; i++) off += cap * width[i];
    off += (size_t)row * width[part];
    return (char *)m->dwp.buf + m->dwp.layer_bytes * (size_t)l + off * A;
}
void *cf_dwpair_dgu(cf_model *m, int l, int row) { return stash(m, l, 0, row); }
void *cf_dwpair_h(cf_model *m, int l, int row) { return stash(m, l, 1, row); }
void *cf_dwpair_ln2(cf_model *m, int l, int row) { return stash(m, l, 2, row); }
void *cf_dwpair_dres(cf_model *m, int l, int row) { return stash(m, l, 3, row); }

/* Backend memory of `bytes` that leaves 1 GiB free (where the backend
 * reports its free memory), or NULL: the buffers of dwpair.c and dwside.c
 * take memory no step needs, never memory a step might. A failed
 * allocation's message is cleared: it is not an error of the step. */
void *cf_alloc_spare(cf_model *m, size_t bytes) {
    size_t free_b = 0, total_b = 0;
    if (m->b->memory_info && m->b->memory_info(m->b, &free_b, &total_b) == 0 && free_b < bytes + ((size_t)1 << 30))
        return NULL;
    void *p = m->b->alloc(m->b, bytes);
    if (!p) cf_fail("%s", "");
    return p;
}

/* no stash of `want` rows: no pairs for the model, or for its full
 * backwards where those wanted the larger one */
static void stash_refused(cf_model *m, int want) {
    if (want > m->cap_T) m->dwp.full = 0;
    else m->dwp.off = 1;
}

/* A stash of `want` rows per layer (cap_T for the compact modes' kept
 * rows, 2 cap_T once a full backward pairs), once (again only when none is
 * held and more rows are wanted); 0, or -1 where there is none (yet). Only from the
 * second optimizer step on: by then the first one has allocated every
 * buffer a step allocates lazily (the filter's compact copies, attention's
 * scratch), so the stash takes memory that no step needs; and only with
 * 1 GiB left free after it, else pairing is off for the model (for its
 * full backwards only, where those wanted the larger stash). */
static int ensure_stash(cf_model *m, int want) {
    cf_dwpair *p = &m->dwp;
    if (p->buf && p->cap >= want) return 0;
    if (p->held || m->opt.step < 1) return -1;
    cf_dwpair_free(m);
    const int L = m->cfg.num_hidden_layers;
    p->layer_bytes = (size_t)want * row_elems(m) * m->b->act_size;
    p->zero = cf_calloc((size_t)2 * L, 1);
    p->buf = p->zero ? cf_alloc_spare(m, p->layer_bytes * (size_t)L) : NULL;
    if (!p->buf) {
        /* not enough memory for the stash: train without pairing (a failed
         * allocation's message is not an error of the step) */
        cf_fail("%s", "");
        free(p->zero);
        p->zero = NULL;
        stash_refused(m, want);
        return -1;
    }
    p->cap = want;
    return 0;
}

/* Layer l's three MLP weight gradients over the stash's first `rows` rows:
 * dWd += dres^T h, [dWg; dWu] += [dgate dup]^T ln2 (written, not added,
 * where they held zeros at HOLD) */
void cf_dwpair_weight_grads(cf_model *m, int l, int rows) {
    cf_backend *b = m->b;
    const cf_layer_params *lp = &m->lp[l];
    const int C = m->cfg.hidden_size, F = m->cfg.intermediate_size;
    const uint8_t *z = m->dwp.zero + 2 * l;
    b->matmul_bwd(b, NULL, cf_grad(m, lp->down.w), NULL, cf_dwpair_dres(m, l, 0), cf_dwpair_h(m, l, 0),
                  cf_weight(m, lp->down.w), rows, F, C, z[0] ? CF_MM_DW_SET : 0);
    b->matmul_bwd(b, NULL, cf_grad(m, lp->gate.w), NULL, cf_dwpair_dgu(m, l, 0), cf_dwpair_ln2(m, l, 0),
                  cf_weight(m, lp->gate.w), rows, C, 2 * F, z[1] ? CF_MM_DW_SET : 0);
}

static int head_flush(cf_model *m);

/* The held rows' weight gradients alone (no join came) */
int cf_dwpair_flush(cf_model *m) {
    cf_dwpair *p = &m->dwp;
    if (head_flush(m) != 0) return -1;
    if (!p->held) return 0;
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) cf_dwpair_weight_grads(m, l, p->held);
    p->held = 0;
    return m->b->check(m->b);
}

void cf_dwpair_drop(cf_model *m) { m->dwp.held = m->dwp.head_held = 0; }

int cf_dwpair_begin(cf_model *m, int eligible, int n) {
    cf_dwpair *p = &m->dwp;
    /* two backwards of at most half a micro-batch's rows (the compact
     * modes' kept rows at keep <= 0.5) fit a stash of cap_T rows; more
     * (a full backward's) take 2 cap_T, unless CF_DW_PAIR_FULL=0 */
    const int small = 2 * n <= m->cap_T, want = small ? m->cap_T : 2 * m->cap_T;
    p->phase = CF_PAIR_NONE;
    p->rows = n;
    if (p->held) {
        if (eligible && !p->off && p->held + n <= p->cap) {
            p->phase = CF_PAIR_JOIN;
            return 0;
        }
        if (cf_dwpair_flush(m) != 0) return -1;
    }
    if (eligible && !p->off && m->opt.more_micro && n > 0 && n < p->max_rows && (small || (p->full && n <= m->cap_T)) &&
        ensure_stash(m, want) == 0) {
        p->phase = CF_PAIR_HOLD;
        for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
            /* whether the gradients may (ZERO) or must (STALE) be written
             * rather than added to: the joining GEMM does so then
             * (nothing else writes them in between) */
            p->zero[2 * l] = cf_grad_take_zero(m, m->lp[l].down.w) != 0;
            p->zero[2 * l + 1] = cf_grad_take_zero_pair(m, m->lp[l].gate.w, m->lp[l].up.w) != 0;
        }
    }
    return 0;
}

/* A failed backward that held or joined: the MLP gradients whose joining
 * GEMM was to write them (ZERO or STALE at HOLD) may never have been
 * written, so their memory may be stale: STALE again, for the settle at the
 * backward's end (backward.c) to zero. */
static void restale(cf_model *m) {
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        const cf_layer_params *lp = &m->lp[l];
        if (m->dwp.zero[2 * l]) m->opt.gstate[lp->down.w] = CF_GRAD_STALE;
        if (m->dwp.zero[2 * l + 1]) m->opt.gstate[lp->gate.w] = m->opt.gstate[lp->up.w] = CF_GRAD_STALE;
    }
}

void cf_dwpair_end(cf_model *m, int ok) {
    cf_dwpair *p = &m->dwp;
    if (!ok) {
        /* the failed step's gradient is lost anyway (the LM head's
         * gradient is never STALE: nothing to restale there) */
        if (p->phase != CF_PAIR_NONE) restale(m);
        p->held = p->head_held = 0;
    } else {
        if (p->phase == CF_PAIR_HOLD) p->held = p->rows;
        else if (p->phase == CF_PAIR_JOIN) {
            p->held = 0;
            p->joins++;
        }
        if (p->head_phase == CF_PAIR_HOLD) p->head_held = p->head_rows;
        else if (p->head_phase == CF_PAIR_JOIN) {
            p->head_held = 0;
            p->head_joins++;
        }
    }
    p->phase = p->head_phase = CF_PAIR_NONE;
}

/*
 * The LM head's pair. Its weight gradient dWlm += s g^T lnf (g: the
 * forward's softmax - onehot of the kept rows, s the token weight) reads
 * and writes the fp32 [V, C] gradient whatever the row count: at Qwen2.5-
 * 1.5B's 1024 kept rows 1.9 GB against a 0.48 TFLOP product, and the GEMM
 * ran at 425 TFLOP/s (ncu, run 19) against 640 at 2048 rows. A compact
 * backward that another one follows HOLDs: its LM head runs the input
 * gradient alone and leaves g's and lnf's rows where the filter put them,
 * at rows [0, n) of their compact copies (which hold cap_T rows). The next
 * filter puts its rows right after them (cf_dwpair_head_place), so the
 * JOIN's GEMM runs over both micro-batches' rows in place: no copy, no
 * stash. Only the backend's g is read again: lmhead_loss_bwd_saved leaves
 * g as it is without a dloss (backend.h), as in the compact modes.
 * Held rows that cannot join (no room for the next rows, another token
 * weight, a backward that recomputes the logits or is not compact) are
 * flushed: their GEMM alone, as cf_dwpair_flush's callers do.
 * The gradient: untied, nothing else writes it between HOLD and JOIN, so
 * HOLD takes its zero flag for the pair's GEMM; tied (the embedding's), the
 * embedding's backward adds to it at the end of the HOLD, so the pair's
 * GEMM adds too.
 */
static void *compact_row(cf_model *m, int slot, int row) {
    const cf_saved *s = &m->saved[slot];
    return (char *)s->compact + (size_t)row * s->row_bytes;
}

void cf_dwpair_head_grads(cf_model *m, int rows, float scale, int flags) {
    cf_backend *b = m->b;
    b->lmhead_loss_bwd_saved(b, NULL, cf_grad(m, m->p_lm_head), compact_row(m, m->s_head, 0), compact_row(m, m->s_lnf, 0),
                             cf_weight(m, m->p_lm_head), NULL, scale, rows, m->cfg.hidden_size, m->cfg.vocab_size,
                             flags);
}

static int head_flush(cf_model *m) {
    cf_dwpair *p = &m->dwp;
    if (!p->head_held) return 0;
    cf_dwpair_head_grads(m, p->head_held, p->head_scale, p->head_set);
    p->head_held = 0;
    return m->b->check(m->b);
}

int cf_dwpair_head_place(cf_model *m, int n) {
    cf_dwpair *p = &m->dwp;
    p->head_at = 0;
    if (!p->head_held) return 0;
    if (p->head_held + n <= m->cap_T) return p->head_at = p->head_held;
    return head_flush(m);
}

int cf_dwpair_head_begin(cf_model *m, int eligible, int n, float scale) {
    cf_dwpair *p = &m->dwp;
    /* g's and lnf's rows of this backward lie after the held ones (the
     * filter put them there) or at row 0 */
    const int at = m->filtered ? p->head_at : -1;
    p->head_phase = CF_PAIR_NONE;
    p->head_rows = n;
    eligible = eligible && !p->head_off && m->s_head >= 0 && n > 0;
    if (p->head_held) {
        if (eligible && at == p->head_held && scale == p->head_scale) {
            p->head_phase = CF_PAIR_JOIN;
            return 0;
        }
        if (head_flush(m) != 0) return -1;
    }
    if (eligible && at == 0 && m->opt.more_micro && 2 * n <= m->cap_T && n < p->max_rows) {
        p->head_phase = CF_PAIR_HOLD;
        p->head_scale = scale;
        p->head_set = m->p_lm_head == m->p_embed ? 0 : cf_grad_take_zero(m, m->p_lm_head);
    }
    return 0;
}
