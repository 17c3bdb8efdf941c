/*
 * dwside.c — the attention projections' weight gradients beside the
 * backward (issue 17).
 *
 * Why. A layer's o and joined q/k/v weight gradients,
 *   dWo += dY^T att,   [dWq; dWk; dWv] += [dq dk dv]^T ln1,
 * feed nothing later in the backward, yet in line they sit on its chain of
 * input gradients: two GEMMs per layer that at the compact modes' few rows
 * run at a third to a half of the matmul rate (part-wave grids, the fp32
 * gradient's read and write in the epilogue). In a side section of the
 * backend (backend.h: side_begin; CUDA: a second stream at the lowest
 * priority) they fill the SMs that the chain leaves idle: attention's
 * small and uneven grids, the norm and element-wise kernels.
 *
 * Where. In the compact backwards (kept rows: attention's grids are halved
 * and leave SMs idle), and in the full ones whose attention grid is under
 * one and a half waves (backend.h: attention_bwd_leaves_idle). Where
 * attention's grid fills the GPU, which runs at its power cap
 * (BENCHMARKS.md run 25), side GEMMs only contend (H200, run 26):
 * TinyLlama's and Llama3.2-3B's regular steps (1.94 waves) were 0.3%
 * faster in line, Qwen2.5-1.5B's (1.45 waves) 0.2-0.7% faster beside; in
 * the centrifuge steps beside was 2% faster at Qwen2.5-1.5B and the same
 * at the others.
 *
 * How. A side GEMM's inputs must stay as they are until the backward's end,
 * where backward.c joins the side work. att and ln1 are saved activations,
 * left alone until the next forward. [dq dk dv] is written by the joined
 * RoPE backward straight into this layer's buffer instead of the shared
 * scratch. o's dY is the residual gradient, which the chain goes on
 * updating in place, so it is copied into the layer's buffer (n x C, the
 * one extra pass). Nothing is paired: each backward's GEMMs take its own
 * rows (dwpair.c pairs the MLP's).
 *
 * Buffers, per layer (backend memory, cap rows each, activation dtype):
 * dres [cap, C] | dqkv [cap, qd + 2 kd]. Taken from the second optimizer
 * step on with 1 GiB left free after them (as dwpair.c's stash), else the
 * gradients stay in line for the model. CF_DW_SIDE_ATTN=0 at open keeps
 * them in line (A/B timing); so do --profile (per-op times) and CF_DW_SIDE=0.
 * A backend without side sections (the CPU) keeps them in line too, unless
 * CF_DW_SIDE_ATTN=1 (tests: this path's buffers, in issue order), which
 * also takes the full backwards beside.
 */
#include <stdlib.h>
#include <string.h>

#include "base/common.h"
#include "engine/model_internal.h"

void cf_dwside_init(cf_model *m) {
    const char *e = getenv("CF_DW_SIDE_ATTN"), *s = getenv("CF_DW_SIDE");
    memset(&m->dws, 0, sizeof m->dws);
    m->dws.off = (e && *e == '0') || (s && *s == '0');
    m->dws.force = e && *e == '1';
}

void cf_dwside_free(cf_model *m) {
    if (m->b && m->dws.buf) m->b->free(m->b, m->dws.buf);
    m->dws.buf = NULL;
    m->dws.cap = 0;
    m->dws.on = 0;
}

/* elements of a row of a layer's buffers: dres C | dqkv qd + 2 kd */
static size_t row_elems(const cf_config *c) {
    return (size_t)c->hidden_size + (size_t)(c->num_attention_heads + 2 * c->num_key_value_heads) * c->head_dim;
}

/* Buffers of cap_T rows per layer (again when cap_T grew): 0, or -1 where
 * there are none (yet). No side work is pending here: the last backward
 * joined it. */
static int ensure_buffers(cf_model *m) {
    cf_dwside *d = &m->dws;
    if (d->buf && d->cap >= m->cap_T) return 0;
    if (m->opt.step < 1) return -1;
    cf_dwside_free(m);
    d->layer_bytes = (size_t)m->cap_T * row_elems(&m->cfg) * m->b->act_size;
    d->buf = cf_alloc_spare(m, d->layer_bytes * (size_t)m->cfg.num_hidden_layers);
    if (!d->buf) {
        d->off = 1; /* no memory for them: the gradients stay in line */
        return -1;
    }
    d->cap = m->cap_T;
    return 0;
}

/* Whether a full backward's attention leaves SMs idle all through it (the
 * backend's answer for this forward's shape; 0 where it has none) */
static int full_leaves_sms(cf_model *m) {
    if (!m->b->attention_bwd_leaves_idle) return 0;
    const cf_attn_shape s = cf_model_attn_shape(m);
    return m->b->attention_bwd_leaves_idle(m->b, &s);
}

int cf_dwside_begin(cf_model *m, int eligible, int compact) {
    cf_dwside *d = &m->dws;
    /* a backend without side sections runs them in line: only through the
     * buffers when forced (CF_DW_SIDE_ATTN=1, the CPU tests of this path);
     * so does a full backward whose attention fills the GPU, unless forced
     * (see the top of the file) */
    d->on = eligible && !d->off && (compact || d->force || full_leaves_sms(m)) && !m->profile &&
            (m->b->side_begin || d->force) && ensure_buffers(m) == 0;
    if (d->on) d->backwards++;
    return d->on;
}

void *cf_dwside_dres(cf_model *m, int l) { return (char *)m->dws.buf + m->dws.layer_bytes * (size_t)l; }

void *cf_dwside_dqkv(cf_model *m, int l) {
    return (char *)cf_dwside_dres(m, l) + (size_t)m->dws.cap * (size_t)m->cfg.hidden_size * m->b->act_size;
}
