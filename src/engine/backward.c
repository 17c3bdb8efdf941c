/*
 * backward.c — the filter operator and the backward pass in the modes of
 * DESIGN §1, written once against the backend interface.
 *
 * Layer l backward (reverse of model.c's forward; n rows: all T, or the
 * kept rows in the compact modes, where the filter has gathered the saved
 * activations to those rows; not K, V, gate and up, nor the norms' inputs
 * and rstd: their readers take the row index):
 *   MLP:  dh = dx' Wd; (dgate, dup) = swiglu'(gate, up) dh; dln2 = dgate Wg + dup Wu
 *         dx_mid = dx' + rmsnorm'(dln2)
 *   attn: datt = dx_mid Wo; (dq, dk, dv) = attention'(...)   (centrifuge: dq of
 *         kept queries over all keys, dk/dv of kept keys from kept queries)
 *         rope', (qwen3) q/k-norm'; dln1 = dq Wq + dk Wk + dv Wv
 *         dx = dx_mid + rmsnorm'(dln1)
 * centrifuge-kv: as centrifuge, but attention gives dk, dv of EVERY key
 * (from the kept queries); rope' and k-norm' run on all T rows, the K/V
 * weight gradients take all T rows (dW += dk^T ln1 with the full ln1, which
 * the filter leaves intact), and only the kept rows of dk, dv go on into
 * dln1: the filtered rows' residual stream still gets nothing.
 * Every projection goes through the linear block (linear.c); a frozen
 * tensor gets no gradient.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/common.h"
#include "engine/model_internal.h"

/* ------------------------------------------------------- filter operator */

int cf_filter(cf_model *m, const cf_kept *kept) {
    if (m->T == 0) return cf_fail("filter: no forward pass to filter");
    if (cf_kept_check(m, kept) != 0) return -1;
    if (m->filtered) return 0;
    cf_backend *b = m->b;
    /* the LM head's g and lnf go after rows held for a pair (dwpair.c) */
    const int head_at = cf_dwpair_head_place(m, m->n_kept);
    if (head_at < 0) return -1;
    cf_stage_begin(m, CF_STAGE_FILTER);
    /* One pass over the registry: every saved token-major activation is
     * gathered to the kept rows. K and V are not in the registry. */
    void *dst[CF_MAX_SAVED];
    const void *src[CF_MAX_SAVED];
    size_t row_bytes[CF_MAX_SAVED];
    int count = 0;
    for (int i = 0; i < m->nsaved; i++) {
        cf_saved *s = &m->saved[i];
        if (!s->gather) continue;
        if (!s->compact) {
            s->compact = b->alloc(b, (size_t)m->cap_T * s->row_bytes);
            if (!s->compact) return -1;
        }
        dst[count] = (char *)s->compact + (i == m->s_head || i == m->s_lnf ? (size_t)head_at * s->row_bytes : 0);
        src[count] = s->full;
        row_bytes[count++] = s->row_bytes;
        s->cur = dst[count - 1];
    }
    if (b->gather_rows_multi) {
        b->gather_rows_multi(b, count, dst, src, row_bytes, m->rows, m->n_kept);
    } else {
        for (int i = 0; i < count; i++) b->gather_rows(b, dst[i], src[i], m->rows, m->n_kept, row_bytes[i]);
    }
    m->filtered = 1;
    cf_stage_end(m, CF_STAGE_FILTER);
    return b->check(b);
}

/* ------------------------------------------------------------- backward */

void cf_zero_grad(cf_model *m) {
    cf_dwpair_drop(m); /* held rows are part of the gradient being cleared */
    m->opt.pre_on = 0; /* and so is an early norm's sum */
    if (m->opt.grad) m->b->memzero(m->b, m->opt.grad, m->opt.lay.ngrad * sizeof(float));
    cf_grad_mark_all(m, CF_GRAD_ZERO);
}

/* Zeroes the rows of x [T, row_elems] whose keep flag is 0 (reference
 * stop-gradient path only; goes through the host, so it is slow on purpose). */
static int zero_filtered_rows(cf_model *m, void *x, size_t row_elems, const uint8_t *keep) {
    cf_backend *b = m->b;
    size_t n = (size_t)m->T * row_elems;
    float *h = cf_malloc(n * sizeof(float));
    if (!h) return -1;
    b->act_to_f32(b, h, x, n);
    for (int t = 0; t < m->T; t++)
        if (!keep[t]) memset(h + (size_t)t * row_elems, 0, row_elems * sizeof(float));
    b->act_from_f32(b, x, h, n);
    free(h);
    return b->check(b);
}

/* The gradient of bucket `layer` is final for this step: hand it to the
 * data-parallel reduction, if any. */
static int bucket_ready(cf_model *m, int layer) {
    const cf_grad_sync *s = &m->opt.sync;
    if (!s->bucket_ready || !m->opt.last_micro) return 0;
    return s->bucket_ready(s->ctx, layer);
}

/* A dense stop-gradient reference (tests only). keep: the kept mask on the
 * host. input_only = 0: the K and V rows of filtered tokens are constants
 * (dK, dV of filtered rows zeroed right after attention: centrifuge's
 * definition). input_only = 1: only the input of the K and V projections
 * at filtered rows is a constant (dK, dV of filtered rows still reach the
 * K/V weights, biases and k-norm, and are zeroed just before the input
 * GEMM: centrifuge-kv's definition). */
typedef struct {
    const uint8_t *keep;
    int input_only;
} stopgrad;

static int backward_impl(cf_model *m, cf_mode mode, const cf_kept *kept, float token_weight,
                         const stopgrad *sg);

int cf_backward(cf_model *m, cf_mode mode, const cf_kept *kept, float loss_scale, float *loss_out) {
    if (m->T == 0) return cf_fail("backward: no forward pass");
    int counted = mode == CF_MODE_REGULAR ? m->T : (kept ? kept->n : 0);
    if (mode != CF_MODE_REGULAR && !kept) return cf_fail("backward: mode %s needs kept rows", cf_mode_name(mode));
    if (counted <= 0) return cf_fail("backward: no position is kept");
    if (loss_out) cf_model_clear_scalars(m);
    if (backward_impl(m, mode, kept, loss_scale / counted, NULL) != 0) return -1;
    if (loss_out) {
        cf_scalars sc;
        if (cf_tp_settle(m) != 0 || m->b->download(m->b, &sc, m->scalars, sizeof sc) != 0) return -1;
        *loss_out = sc.loss_sum / counted;
    }
    return 0;
}

int cf_backward_weighted(cf_model *m, cf_mode mode, const cf_kept *kept, float token_weight) {
    return backward_impl(m, mode, kept, token_weight, NULL);
}

static int reference_stopgrad(cf_model *m, const cf_kept *kept, float loss_scale, float *loss_out,
                              int input_only) {
    if (cf_kept_check(m, kept) != 0) return -1;
    uint8_t *keep = cf_malloc((size_t)m->T);
    if (!keep) return -1;
    int rc = cf_kept_mask(m, kept, keep);
    if (rc == 0 && loss_out) cf_model_clear_scalars(m);
    stopgrad sg = {keep, input_only};
    if (rc == 0) rc = backward_impl(m, CF_MODE_LOSS_ONLY, kept, loss_scale / kept->n, &sg);
    free(keep);
    if (rc == 0 && loss_out) {
        cf_scalars sc;
        if (cf_tp_settle(m) != 0 || m->b->download(m->b, &sc, m->scalars, sizeof sc) != 0) return -1;
        *loss_out = sc.loss_sum / kept->n;
    }
    return rc;
}

int cf_backward_reference_stopgrad(cf_model *m, const cf_kept *kept, float loss_scale, float *loss_out) {
    return reference_stopgrad(m, kept, loss_scale, loss_out, 0);
}

int cf_backward_reference_stopgrad_kv(cf_model *m, const cf_kept *kept, float loss_scale, float *loss_out) {
    return reference_stopgrad(m, kept, loss_scale, loss_out, 1);
}

int cf_mode_is_compact(cf_mode mode) {
    return mode == CF_MODE_CENTRIFUGE || mode == CF_MODE_STRAWMAN || mode == CF_MODE_CENTRIFUGE_KV;
}

/* The K and V projections' backward when dk (after rope' and k-norm') and
 * m->d_v hold every row [T, kd] (centrifuge-kv, and its dense reference):
 * the weight and bias gradients over all T rows, with the full ln1 (the
 * filter leaves saved[].full intact); then the input gradient of the rows
 * that get one into m->d_ln [n, C] (accumulated): in centrifuge-kv the
 * kept rows (dk, dv gathered to them), in the reference all rows with the
 * filtered rows' dk, dv zeroed (the stop-gradient at the input). */
static int kv_proj_bwd(cf_model *m, const cf_layer_params *p, const cf_layer_acts *a, void *dk, int n,
                       const stopgrad *sg) {
    cf_backend *b = m->b;
    const cf_config *c = &m->cfg;
    int T = m->T, C = c->hidden_size, kd = c->num_key_value_heads * c->head_dim;
    const void *ln1 = m->saved[a->ln1].full;
    /* all T rows here, not m->lora_rows: fine only because these modes
     * refuse adapters on k and v (backward_impl) */
    OP(CF_PROF_GEMM, cf_linear_bwd_weight(m, &p->k, dk, ln1, T, C, kd));
    OP(CF_PROF_GEMM, cf_linear_bwd_weight(m, &p->v, m->d_v, ln1, T, C, kd));
    void *gk = dk, *gv = m->d_v;
    if (sg) {
        if (zero_filtered_rows(m, dk, (size_t)kd, sg->keep) != 0 ||
            zero_filtered_rows(m, m->d_v, (size_t)kd, sg->keep) != 0)
            return -1;
    } else {
        /* free here: tmp (the MLP's h) and d_att (attention's dout) */
        gk = m->tmp;
        gv = m->d_att;
        size_t rb = (size_t)kd * b->act_size;
        if (b->gather_rows_multi) {
            void *dst[2] = {gk, gv};
            const void *src[2] = {dk, m->d_v};
            size_t rbs[2] = {rb, rb};
            OP(CF_PROF_ELTWISE, b->gather_rows_multi(b, 2, dst, src, rbs, m->rows, n));
        } else {
            OP(CF_PROF_ELTWISE, b->gather_rows(b, gk, dk, m->rows, n, rb));
            OP(CF_PROF_ELTWISE, b->gather_rows(b, gv, m->d_v, m->rows, n, rb));
        }
    }
    OP(CF_PROF_GEMM, cf_linear_bwd_input(m, &p->k, m->d_ln, gk, n, C, kd, 1));
    OP(CF_PROF_GEMM, cf_linear_bwd_input(m, &p->v, m->d_ln, gv, n, C, kd, 1));
    return 0;
}

static int backward_body(cf_model *m, cf_mode mode, const cf_kept *kept, float token_weight,
                         const stopgrad *sg);

/* Whether the gate and up projections' backward can run as one GEMM each
 * for the input and the weight gradient (issue 17): plain linears (no
 * adapter, no bias, no tensor parallelism), the up weight stored right after
 * the gate weight, and their gradients likewise (or both frozen). The
 * parameter table puts them back to back, and so does the one-process
 * gradient layout; a ZeRO-1 layout may not. CF_FUSE_GATE_UP=0 in the
 * environment turns it off. */
static int gate_up_fused(cf_model *m, const cf_layer_params *p) {
    static int env = -1;
    if (env < 0) {
        const char *e = getenv("CF_FUSE_GATE_UP");
        env = !(e && *e == '0');
    }
    if (!env || cf_tp_on(m) || p->gate.la >= 0 || p->up.la >= 0 || p->gate.b >= 0 || p->up.b >= 0) return 0;
    const cf_param *g = &m->params[p->gate.w], *u = &m->params[p->up.w];
    if (g->numel != u->numel || g->shape[1] != u->shape[1]) return 0;
    if ((char *)cf_weight(m, p->up.w) != (char *)cf_weight(m, p->gate.w) + g->numel * m->b->act_size) return 0;
    float *gg = cf_grad(m, p->gate.w), *gu = cf_grad(m, p->up.w);
    if (!gg != !gu) return 0;
    return !gg || gu == gg + g->numel;
}

/* Whether three gradients (of tensors i, j, k) are all absent (frozen) or
 * back to back. */
static int grads_joined(cf_model *m, int i, int j, int k) {
    float *gi = cf_grad(m, i), *gj = cf_grad(m, j), *gk = cf_grad(m, k);
    if (!gi != !gj || !gj != !gk) return 0;
    return !gi || (gj == gi + m->params[i].numel && gk == gj + m->params[j].numel);
}

/* Whether the q, k, v projections' backward can run as one GEMM each for
 * the input and the weight gradient, as their forward does (model.c:
 * plan_fused_proj: no adapter or q/k norm, the three weights and biases
 * back to back): their gradients back to back too (or all frozen), and dk,
 * dv of the backward's own rows (not centrifuge-kv's every row). The input
 * is [dq dk dv] joined row by row with RoPE undone (qkv_join_rope_bwd), in
 * the slot the forward's fused output used; the bias gradient is its column
 * sum. CF_FUSED_PROJ=0 turns it off with the forward's. */
static int qkv_fused_bwd(cf_model *m, const cf_layer_params *p, int kv_all) {
    if (!p->fused_qkv || kv_all || cf_tp_on(m) || !m->b->qkv_join_rope_bwd) return 0;
    if (!grads_joined(m, p->q.w, p->k.w, p->v.w)) return 0;
    return p->q.b < 0 || grads_joined(m, p->q.b, p->k.b, p->v.b);
}

/* Layer l's MLP after swiglu' in a paired backward (dwpair.c), whose
 * dgate|dup and h are in the layer's stash at rows r0..r0+n-1 already:
 * the down projection's dY (the residual gradient) and the gate/up input
 * (ln2) are copied there too; dln2 = [dgate dup] [Wg; Wu] for these rows;
 * with JOIN, the three weight gradients over the r0 + n rows of both
 * backwards: dWd += dres^T h, [dWg; dWu] += [dgate dup]^T ln2. */
static void mlp_paired_grads(cf_model *m, int l, int n, int r0, int pair) {
    cf_backend *b = m->b;
    const cf_layer_params *p = &m->lp[l];
    const int C = m->cfg.hidden_size, F = m->cfg.intermediate_size;
    const size_t rb = (size_t)C * b->act_size;
    OP(CF_PROF_ELTWISE, b->copy(b, cf_dwpair_dres(m, l, r0), m->d_resid, (size_t)n * rb));
    OP(CF_PROF_ELTWISE, b->copy(b, cf_dwpair_ln2(m, l, r0), SAVED(m, m->la[l].ln2), (size_t)n * rb));
    OP(CF_PROF_GEMM, b->matmul_bwd(b, m->d_ln, NULL, NULL, cf_dwpair_dgu(m, l, r0), NULL, cf_weight(m, p->gate.w), n,
                                   C, 2 * F, 0));
    if (pair == CF_PAIR_JOIN) {
        /* beside the rest of the backward (dwpair.c), joined at its end */
        const int side = m->dwp.side && !m->profile && b->side_begin;
        if (side) b->side_begin(b, m->side_narrow);
        OP(CF_PROF_GEMM, cf_dwpair_weight_grads(m, l, r0 + n));
        if (side) b->side_end(b);
    }
}

/* Whether a backward may reorder a gradient's sum (weight gradients paired
 * across micro-batches or computed beside the chain): not a stop-gradient
 * reference, and one process without TP (data parallel's bucket hooks with
 * these paths are not yet checked against one GPU on two:
 * tests/gpu/dp_check.sh; TP splits the projections) */
static int solo(cf_model *m, const stopgrad *sg) {
    return !sg && !cf_tp_on(m) && m->opt.sync.world <= 1;
}

/* Whether this backward's MLP weight gradients may pair with another
 * micro-batch's (dwpair.c, which also decides by the number of rows): every
 * layer's gate/up fused and trainable, a plain down projection; solo. */
static int mlp_pairs(cf_model *m, const stopgrad *sg) {
    if (!solo(m, sg)) return 0;
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        const cf_layer_params *p = &m->lp[l];
        if (!gate_up_fused(m, p) || !cf_grad(m, p->gate.w) || !cf_grad(m, p->down.w) || p->down.la >= 0 ||
            p->down.b >= 0)
            return 0;
    }
    return 1;
}

/* Whether the LM head's weight gradient may pair (dwpair.c; compact
 * backwards only): a trainable LM head; solo. */
static int head_pairs(cf_model *m, const stopgrad *sg) {
    return solo(m, sg) && cf_grad(m, m->p_lm_head);
}

/* Whether o's and the joined q/k/v's weight gradients may run beside this
 * backward (dwside.c): in every layer q/k/v join (qkv_fused_bwd), o is a
 * plain trainable projection without a bias, and the q/k/v weights train;
 * solo (data parallel's buckets reduce a layer's gradient when its backward
 * ends; TP joins no q/k/v). */
static int attn_side(cf_model *m, int kv_all, const stopgrad *sg) {
    if (!solo(m, sg)) return 0;
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        const cf_layer_params *p = &m->lp[l];
        if (!qkv_fused_bwd(m, p, kv_all) || p->o.la >= 0 || p->o.b >= 0 || !cf_grad(m, p->o.w) ||
            !cf_grad(m, p->q.w))
            return 0;
    }
    return 1;
}

/* The backward; afterwards no gradient counts as zero any more (every
 * trainable tensor may have been written, by whatever op). A STALE one this
 * backward did not write (rows held by dwpair.c took theirs at HOLD) is
 * zeroed first: LIVE memory must hold the sum so far. */
static int backward_impl(cf_model *m, cf_mode mode, const cf_kept *kept, float token_weight,
                         const stopgrad *sg) {
    int rc = backward_body(m, mode, kept, token_weight, sg);
    if (m->b->side_join) m->b->side_join(m->b);   /* also where the body failed */
    cf_dwpair_end(m, rc == 0);
    cf_grad_settle(m);
    cf_grad_mark_all(m, CF_GRAD_LIVE);
    return rc;
}

static int backward_body(cf_model *m, cf_mode mode, const cf_kept *kept, float token_weight,
                         const stopgrad *sg) {
    if (m->T == 0) return cf_fail("backward: no forward pass");
    if (!m->opt.grad) return cf_fail("backward: the model has no trainable parameter");
    const cf_config *c = &m->cfg;
    cf_backend *b = m->b;
    int compact = cf_mode_is_compact(mode);
    /* dk, dv of every row: centrifuge-kv and its reference */
    int kv_all = mode == CF_MODE_CENTRIFUGE_KV || (sg && sg->input_only);
    if (mode != CF_MODE_REGULAR && cf_kept_check(m, kept) != 0) return -1;
    if (kv_all)
        for (int l = 0; l < c->num_hidden_layers; l++)
            if (m->lp[l].k.la >= 0 || m->lp[l].v.la >= 0)
                return cf_fail("mode %s: LoRA adapters on k_proj/v_proj are not supported (their filtered-row "
                               "gradient needs the adapter's input of every row); use centrifuge, or adapters "
                               "on other projections", cf_mode_name(CF_MODE_CENTRIFUGE_KV));
    if (compact && cf_filter(m, kept) != 0) return -1;
    if (!compact) cf_model_reset_filter(m);
    cf_stage_begin(m, CF_STAGE_BACKWARD);
    m->prof_phase = 1;
    cf_norm_pre_begin(m, compact);
    /* the compact backwards' chain (small GEMMs, attention's small grids)
     * needs SMs while side GEMMs run; a full one's is mostly GEMMs that
     * fill the device (gemm.cu: side_sms, measured there) */
    m->side_narrow = compact;
    int T = m->T;
    int n = compact ? m->n_kept : T;
    /* hold this backward's MLP rows for the next one, join held ones, or
     * neither (held rows that cannot join are flushed first) */
    if (cf_dwpair_begin(m, mlp_pairs(m, sg), n) != 0) return -1;
    const int pair = m->dwp.phase, r0 = pair == CF_PAIR_JOIN ? m->dwp.held : 0;
    /* o's and q/k/v's weight gradients beside the chain (dwside.c), or in line */
    const int aside = cf_dwside_begin(m, attn_side(m, kv_all, sg), compact);
    /* the forward's row of each backward row, for LoRA dropout's mask */
    m->lora_rows = compact ? m->rows : NULL;
    const uint8_t *keep = mode == CF_MODE_REGULAR ? NULL : m->keep_dev;

    /* Per-row loss weights d(loss)/d(l_t), and the loss sum of the counted
     * rows, on the device. Compact: one weight per kept row. */
    b->fill_dloss(b, m->dloss, compact ? NULL : keep, token_weight, n);
    b->loss_sum(b, &m->scalars->loss_sum, m->losses, keep, T);

    int L = c->num_hidden_layers, C = c->hidden_size, F = c->intermediate_size;
    int H = c->num_attention_heads, Hkv = c->num_key_value_heads, D = c->head_dim;
    int qd = H * D, kd = Hkv * D;
    const int *pos = SAVED(m, m->s_pos);
    cf_attn_shape shape = cf_model_attn_shape(m);
    cf_rows rows = {m->n_kept, m->kept_max_len, m->rows, m->seq_start};
    cf_attn_bwd_mode amode = mode == CF_MODE_CENTRIFUGE    ? CF_ATTN_BWD_CENTRIFUGE
                           : mode == CF_MODE_STRAWMAN      ? CF_ATTN_BWD_STRAWMAN
                           : mode == CF_MODE_CENTRIFUGE_KV ? CF_ATTN_BWD_CENTRIFUGE_KV
                                                           : CF_ATTN_BWD_FULL;
    /* rows of dk, dv and the saved tensors read with them: the rows of the
     * backward, or every row (centrifuge-kv) */
    int nk = kv_all ? T : n;
    const int *kpos = kv_all ? m->saved[m->s_pos].full : pos;
#define KSAVED(idx) (kv_all ? m->saved[(idx)].full : SAVED(m, (idx)))
    /* the norms' inputs and rstd stay uncompacted (model.c): their rows */
    const int *norm_rows = compact ? m->rows : NULL;

    /* LM head and final norm: dresid = d(loss)/d(x_L) */
    /* TP: the rank's vocabulary slice with the whole vocabulary's lse; its
     * input gradient is a partial sum */
    const int tp = cf_tp_on(m);
    const int v0 = tp ? m->tp.vocab_start : 0, vn = tp ? m->tp.vocab_len : c->vocab_size;
    const int head_saved = m->head_g_fwd == m->fwd_id && token_weight != 0.0f && isfinite(token_weight);
    /* compact, from the forward's g: the weight gradient may wait for the
     * next backward's rows, or take held ones' with its own (dwpair.c);
     * held rows that cannot join are flushed */
    if (cf_dwpair_head_begin(m, head_saved && compact && head_pairs(m, sg), n, token_weight) != 0) return -1;
    if (head_saved) {
        /* issue 17: the forward kept g = softmax - onehot (never under TP;
         * of the kept rows after the filter): the two GEMMs carry the token
         * weight; only where a keep mask zeroes rows (loss-only's full
         * backward) are they reweighted in g first. g is consumed; another
         * backward of this forward recomputes. */
        const float *dl = keep && !compact ? m->dloss : NULL;
        const int head_pair = m->dwp.head_phase;
        float *dw = head_pair == CF_PAIR_NONE ? cf_grad(m, m->p_lm_head) : NULL;
        OP(CF_PROF_LMHEAD, b->lmhead_loss_bwd_saved(b, m->d_ln, dw, SAVED(m, m->s_head), SAVED(m, m->s_lnf),
                           cf_weight(m, m->p_lm_head), dl, token_weight, n, C, vn,
                           dw ? cf_grad_take_zero(m, m->p_lm_head) : 0));
        if (head_pair == CF_PAIR_JOIN)
            OP(CF_PROF_LMHEAD, cf_dwpair_head_grads(m, m->dwp.head_held + n, token_weight, m->dwp.head_set));
        m->head_g_fwd = 0;
    } else {
        OP(CF_PROF_LMHEAD, b->lmhead_loss_bwd(b, m->d_ln, cf_grad(m, m->p_lm_head), SAVED(m, m->s_lnf),
                           cf_weight(m, m->p_lm_head), SAVED(m, m->s_targets), m->dloss,
                           tp ? SAVED(m, m->s_lse) : NULL, n, C, vn, v0, cf_grad_take_zero(m, m->p_lm_head)));
    }
    /* Data parallel: the embedding's gradient (tied: shared with the LM
     * head, now final) lacks only this micro-batch's embedding rows, which
     * the hook adds after the reduction; reducing it here, not after the
     * embedding backward at the very end, overlaps its bucket (the largest
     * one) with the whole backward (cf_grad_sync.embedding_rows). */
    const cf_grad_sync *gs = &m->opt.sync;
    float *dembed = cf_grad(m, m->p_embed);
    const int defer_embed = dembed && gs->embedding_rows && gs->bucket_ready && m->opt.last_micro;
    if (defer_embed && bucket_ready(m, m->params[m->p_embed].layer) != 0) return -1;
    if (tp && cf_tp_allreduce(m, m->d_ln, (size_t)n * C, CF_TP_ACT, CF_TP_BWD) != 0) return -1;
    OP(CF_PROF_NORM, b->rmsnorm_bwd(b, m->d_resid, cf_grad(m, m->p_norm), m->d_ln, SAVED(m, m->resid[L]),
                   cf_weight(m, m->p_norm), SAVED(m, m->s_rstdf), norm_rows, n, C, 0));
    if (bucket_ready(m, L) != 0) return -1;
    for (int l = L - 1; l >= 0; l--) {
        cf_layer_params *p = &m->lp[l];
        cf_layer_acts *a = &m->la[l];
        /* MLP: x' = x_mid + down(silu(gate(ln2)) * up(ln2)) */
        OP(CF_PROF_GEMM, cf_linear_bwd_input(m, &p->down, m->d_h, m->d_resid, n, F, C, 0));
        /* gate and up of the kept rows are read through the row index; the
         * kernel also recomputes h for the down projection's weight gradient.
         * Fused: dgate | dup as one [n, 2F] matrix for one GEMM each of the
         * input and weight gradients (gate and up stored back to back);
         * else two [n, F] matrices. */
        const int fused = gate_up_fused(m, p);
        /* paired (dwpair.c; every layer fused then): dgate|dup and h go to
         * the layer's stash at this backward's rows r0.., and so do the
         * down projection's dY and the gate/up input; the weight
         * gradients wait (HOLD) or take both backwards' rows (JOIN) */
        void *d_gate = pair ? cf_dwpair_dgu(m, l, r0) : m->d_gate;
        void *h = pair ? cf_dwpair_h(m, l, r0) : m->tmp;
        void *d_up = (char *)d_gate + (fused ? (size_t)F : (size_t)n * F) * b->act_size;
        void *gate, *up;
        const int ldgu = cf_gate_up(m, l, &gate, &up);
        OP(CF_PROF_ELTWISE, b->swiglu_bwd_rows(b, h, d_gate, d_up, m->d_h, gate, up, compact ? m->rows : NULL, n,
                                               F, ldgu, fused ? 2 * F : F));
        if (pair) {
            mlp_paired_grads(m, l, n, r0, pair);
        } else if (fused) {
            OP(CF_PROF_GEMM, cf_linear_bwd_weight(m, &p->down, m->d_resid, h, n, F, C));
            /* dln2 = [dgate dup] [Wg; Wu],  [dWg; dWu] += [dgate dup]^T ln2 */
            float *dw = cf_grad(m, p->gate.w);
            int zero = cf_grad_take_zero_pair(m, p->gate.w, p->up.w);
            OP(CF_PROF_GEMM, b->matmul_bwd(b, m->d_ln, dw, NULL, d_gate, SAVED(m, a->ln2), cf_weight(m, p->gate.w), n,
                                           C, 2 * F, zero));
        } else if (tp) {
            OP(CF_PROF_GEMM, cf_linear_bwd_weight(m, &p->down, m->d_resid, h, n, F, C));
            /* column-parallel gate/up: their input gradient is a partial sum;
             * its all-reduce runs while the weight gradients are computed */
            OP(CF_PROF_GEMM, cf_linear_bwd_input(m, &p->gate, m->d_ln, d_gate, n, C, F, 0));
            OP(CF_PROF_GEMM, cf_linear_bwd_input(m, &p->up, m->d_ln, d_up, n, C, F, 1));
            if (m->tp.allreduce_start(m->tp.ctx, m->d_ln, (size_t)n * C, CF_TP_ACT, CF_TP_BWD) != 0) return -1;
            OP(CF_PROF_GEMM, cf_linear_bwd_weight(m, &p->gate, d_gate, SAVED(m, a->ln2), n, C, F));
            OP(CF_PROF_GEMM, cf_linear_bwd_weight(m, &p->up, d_up, SAVED(m, a->ln2), n, C, F));
            if (m->tp.wait(m->tp.ctx) != 0) return -1;
        } else {
            OP(CF_PROF_GEMM, cf_linear_bwd_weight(m, &p->down, m->d_resid, h, n, F, C));
            OP(CF_PROF_GEMM, cf_linear_bwd(m, &p->gate, m->d_ln, d_gate, SAVED(m, a->ln2), n, C, F, 0));
            OP(CF_PROF_GEMM, cf_linear_bwd(m, &p->up, m->d_ln, d_up, SAVED(m, a->ln2), n, C, F, 1));
        }
        OP(CF_PROF_NORM, b->rmsnorm_bwd(b, m->d_resid, cf_grad(m, p->ln2), m->d_ln, SAVED(m, a->x_mid),
                       cf_weight(m, p->ln2), SAVED(m, a->rstd2), norm_rows, n, C, 1));
        /* attention: x_mid = x + o(attn(q, k, v)) */
        if (aside) {
            /* dWo += dY^T att beside, from a copy of dY (the chain updates
             * the residual gradient in place); dY Wo here */
            void *dres = cf_dwside_dres(m, l);
            OP(CF_PROF_ELTWISE, b->copy(b, dres, m->d_resid, (size_t)n * C * b->act_size));
            OP(CF_PROF_GEMM, cf_linear_bwd_input(m, &p->o, m->d_att, m->d_resid, n, qd, C, 0));
            const int zero = cf_grad_take_zero(m, p->o.w);
            if (b->side_begin) b->side_begin(b, m->side_narrow);
            OP(CF_PROF_GEMM, b->matmul_bwd(b, NULL, cf_grad(m, p->o.w), NULL, dres, SAVED(m, a->att),
                                           cf_weight(m, p->o.w), n, qd, C, zero));
            if (b->side_end) b->side_end(b);
        } else {
            OP(CF_PROF_GEMM, cf_linear_bwd(m, &p->o, m->d_att, m->d_resid, SAVED(m, a->att), n, qd, C, 0));
        }
        OP(CF_PROF_ATTN, b->attention_bwd(b, m->d_q, m->d_k, m->d_v, m->d_att, SAVED(m, a->q), a->k, a->v,
                         SAVED(m, a->att), SAVED(m, a->lse), &shape, compact ? &rows : NULL, amode));
        if (sg && !sg->input_only &&
            (zero_filtered_rows(m, m->d_k, (size_t)kd, sg->keep) != 0 ||
             zero_filtered_rows(m, m->d_v, (size_t)kd, sg->keep) != 0))
            return -1;
        if (qkv_fused_bwd(m, p, kv_all)) {
            /* dln1 = [dq dk dv] [Wq; Wk; Wv],  [dWq; dWk; dWv] (+)= [dq dk dv]^T ln1,
             * [dbq; dbk; dbv] += colsum [dq dk dv] */
            /* beside (dwside.c): [dq dk dv] in the layer's buffer, the
             * weight gradient in a side section; dln1 and dbias here */
            void *dqkv = aside ? cf_dwside_dqkv(m, l) : m->qkv ? m->qkv : m->tmp;
            OP(CF_PROF_ROPE, b->qkv_join_rope_bwd(b, dqkv, m->d_q, m->d_k, m->d_v, pos, n, H, Hkv, m->inv_freq, D));
            const int qkv[3] = {p->q.w, p->k.w, p->v.w};
            const int zero = cf_grad_take_zero_group(m, qkv, 3);
            float *dbias = p->q.b >= 0 ? cf_grad(m, p->q.b) : NULL;
            float *dw = cf_grad(m, p->q.w);
            OP(CF_PROF_GEMM, b->matmul_bwd(b, m->d_ln, aside ? NULL : dw, dbias, dqkv, SAVED(m, a->ln1),
                                           cf_weight(m, p->q.w), n, C, qd + 2 * kd, aside ? 0 : zero));
            if (aside) {
                if (b->side_begin) b->side_begin(b, m->side_narrow);
                OP(CF_PROF_GEMM, b->matmul_bwd(b, NULL, dw, NULL, dqkv, SAVED(m, a->ln1), cf_weight(m, p->q.w), n,
                                               C, qd + 2 * kd, zero));
                if (b->side_end) b->side_end(b);
            }
        } else {
            OP(CF_PROF_ROPE, b->rope_qk(b, m->d_q, pos, n, H, m->d_k, kpos, nk, Hkv, m->inv_freq, D, 1));
            void *dq = m->d_q, *dk = m->d_k;
            if (c->qk_norm) {
                OP(CF_PROF_NORM, b->rmsnorm_bwd(b, m->d_qn, cf_grad(m, p->qn), m->d_q, SAVED(m, a->qpre),
                               cf_weight(m, p->qn), SAVED(m, a->rstdq), NULL, n * H, D, 0));
                OP(CF_PROF_NORM, b->rmsnorm_bwd(b, m->d_kn, cf_grad(m, p->kn), m->d_k, KSAVED(a->kpre),
                               cf_weight(m, p->kn), KSAVED(a->rstdk), NULL, nk * Hkv, D, 0));
                dq = m->d_qn;
                dk = m->d_kn;
            }
            if (kv_all) {
                OP(CF_PROF_GEMM, cf_linear_bwd(m, &p->q, m->d_ln, dq, SAVED(m, a->ln1), n, C, qd, 0));
                if (kv_proj_bwd(m, p, a, dk, n, sg) != 0) return -1;
                if (tp && cf_tp_allreduce(m, m->d_ln, (size_t)n * C, CF_TP_ACT, CF_TP_BWD) != 0) return -1;
            } else if (tp) {
                /* column-parallel q/k/v, as gate/up above */
                OP(CF_PROF_GEMM, cf_linear_bwd_input(m, &p->q, m->d_ln, dq, n, C, qd, 0));
                OP(CF_PROF_GEMM, cf_linear_bwd_input(m, &p->k, m->d_ln, dk, n, C, kd, 1));
                OP(CF_PROF_GEMM, cf_linear_bwd_input(m, &p->v, m->d_ln, m->d_v, n, C, kd, 1));
                if (m->tp.allreduce_start(m->tp.ctx, m->d_ln, (size_t)n * C, CF_TP_ACT, CF_TP_BWD) != 0) return -1;
                OP(CF_PROF_GEMM, cf_linear_bwd_weight(m, &p->q, dq, SAVED(m, a->ln1), n, C, qd));
                OP(CF_PROF_GEMM, cf_linear_bwd_weight(m, &p->k, dk, SAVED(m, a->ln1), n, C, kd));
                OP(CF_PROF_GEMM, cf_linear_bwd_weight(m, &p->v, m->d_v, SAVED(m, a->ln1), n, C, kd));
                if (m->tp.wait(m->tp.ctx) != 0) return -1;
            } else {
                OP(CF_PROF_GEMM, cf_linear_bwd(m, &p->q, m->d_ln, dq, SAVED(m, a->ln1), n, C, qd, 0));
                OP(CF_PROF_GEMM, cf_linear_bwd(m, &p->k, m->d_ln, dk, SAVED(m, a->ln1), n, C, kd, 1));
                OP(CF_PROF_GEMM, cf_linear_bwd(m, &p->v, m->d_ln, m->d_v, SAVED(m, a->ln1), n, C, kd, 1));
            }
        }
        OP(CF_PROF_NORM, b->rmsnorm_bwd(b, m->d_resid, cf_grad(m, p->ln1), m->d_ln, SAVED(m, m->resid[l]),
                       cf_weight(m, p->ln1), SAVED(m, a->rstd1), norm_rows, n, C, 1));
        if (bucket_ready(m, l) != 0) return -1;
        cf_norm_pre_layer(m, l); /* layer l's gradients are final in the step's last backward */
    }
    if (defer_embed) {
        if (gs->embedding_rows(gs->ctx, m->d_resid, SAVED(m, m->s_tokens), n, m->cap_T, v0) != 0) return -1;
    } else {
        if (dembed) OP(CF_PROF_ELTWISE, b->embedding_bwd(b, dembed, m->d_resid, SAVED(m, m->s_tokens), n, C, v0, vn));
        if (bucket_ready(m, -1) != 0) return -1;
    }
    if (b->side_join) b->side_join(b);   /* the stage's time includes the pairs' GEMMs */
    cf_stage_end(m, CF_STAGE_BACKWARD);
    return b->check(b);
#undef KSAVED
}

/* ---------------------------------------------------------------- names */

const char *cf_mode_name(cf_mode md) {
    switch (md) {
    case CF_MODE_REGULAR: return "regular";
    case CF_MODE_LOSS_ONLY: return "loss-only";
    case CF_MODE_CENTRIFUGE: return "centrifuge";
    case CF_MODE_STRAWMAN: return "strawman";
    case CF_MODE_CENTRIFUGE_KV: return "centrifuge-kv";
    }
    return "?";
}

int cf_mode_parse(const char *s, cf_mode *out) {
    for (int i = 0; i <= CF_MODE_CENTRIFUGE_KV; i++)
        if (!strcmp(s, cf_mode_name((cf_mode)i))) { *out = (cf_mode)i; return 0; }
    return cf_fail("--mode: unknown mode '%s' (regular, loss-only, centrifuge, strawman, centrifuge-kv)", s);
}
