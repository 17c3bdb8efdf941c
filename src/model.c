/*
 * model.c — the Llama-family model driver, written once against the backend
 * interface (backend.h): parameters, forward, the filter operator, the four
 * backward modes, and the AdamW step.
 *
 * Layer l (x = residual stream, token-major [T, C]):
 *   ln1   = rmsnorm(x) * w_ln1
 *   q,k,v = ln1 Wq^T (+bq), ln1 Wk^T (+bk), ln1 Wv^T (+bv)
 *   (qwen3) q,k = per-head rmsnorm(q) * w_qn, rmsnorm(k) * w_kn
 *   q,k   = rope(q), rope(k)
 *   att   = causal_gqa_attention(q, k, v)          (saves lse)
 *   x_mid = x + att Wo^T (+bo)
 *   ln2   = rmsnorm(x_mid) * w_ln2
 *   h     = silu(ln2 Wg^T) * (ln2 Wu^T)
 *   x'    = x_mid + h Wd^T
 * then lnf = rmsnorm(x_L) * w_norm and per-token cross-entropy of lnf Wlm^T.
 *
 * Filtering (DESIGN §1-2): after the full forward, cf_filter_backward
 * gathers every saved activation except K and V to the kept rows, and the
 * backward then runs with M = kept rows in every GEMM.
 */
#include "model_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "io.h"

/* ----------------------------------------------------------- parameters */

static int add_param(cf_model *m, int cap, const char *name, int64_t d0, int64_t d1) {
    if (m->ntensors >= cap) return cf_fail("internal: parameter table overflow");
    cf_param *p = &m->params[m->ntensors];
    snprintf(p->name, sizeof p->name, "%s", name);
    p->ndim = d1 > 0 ? 2 : 1;
    p->shape[0] = d0;
    p->shape[1] = d1 > 0 ? d1 : 0;
    p->numel = (size_t)d0 * (size_t)(d1 > 0 ? d1 : 1);
    p->offset = m->nparams;
    p->decay = p->ndim == 2;
    m->nparams += p->numel;
    return m->ntensors++;
}

static int layer_param(cf_model *m, int cap, int l, const char *suffix, int64_t d0, int64_t d1) {
    char name[96];
    snprintf(name, sizeof name, "model.layers.%d.%s", l, suffix);
    return add_param(m, cap, name, d0, d1);
}

/* Builds the parameter table in HF order and naming. */
static int build_param_table(cf_model *m) {
    const cf_config *c = &m->cfg;
    int L = c->num_hidden_layers, C = c->hidden_size, F = c->intermediate_size;
    int qd = c->num_attention_heads * c->head_dim, kd = c->num_key_value_heads * c->head_dim;
    int cap = 3 + L * 16;
    m->params = cf_calloc((size_t)cap, sizeof(cf_param));
    m->lp = cf_calloc((size_t)L, sizeof(cf_layer_params));
    if (!m->params || !m->lp) return -1;
    m->p_embed = add_param(m, cap, "model.embed_tokens.weight", c->vocab_size, C);
    for (int l = 0; l < L; l++) {
        cf_layer_params *p = &m->lp[l];
        memset(p, -1, sizeof *p);
        p->ln1 = layer_param(m, cap, l, "input_layernorm.weight", C, 0);
        p->q = layer_param(m, cap, l, "self_attn.q_proj.weight", qd, C);
        if (c->qkv_bias) p->qb = layer_param(m, cap, l, "self_attn.q_proj.bias", qd, 0);
        p->k = layer_param(m, cap, l, "self_attn.k_proj.weight", kd, C);
        if (c->qkv_bias) p->kb = layer_param(m, cap, l, "self_attn.k_proj.bias", kd, 0);
        p->v = layer_param(m, cap, l, "self_attn.v_proj.weight", kd, C);
        if (c->qkv_bias) p->vb = layer_param(m, cap, l, "self_attn.v_proj.bias", kd, 0);
        p->o = layer_param(m, cap, l, "self_attn.o_proj.weight", C, qd);
        if (c->o_bias) p->ob = layer_param(m, cap, l, "self_attn.o_proj.bias", C, 0);
        if (c->qk_norm) {
            p->qn = layer_param(m, cap, l, "self_attn.q_norm.weight", c->head_dim, 0);
            p->kn = layer_param(m, cap, l, "self_attn.k_norm.weight", c->head_dim, 0);
        }
        p->ln2 = layer_param(m, cap, l, "post_attention_layernorm.weight", C, 0);
        p->gate = layer_param(m, cap, l, "mlp.gate_proj.weight", F, C);
        p->up = layer_param(m, cap, l, "mlp.up_proj.weight", F, C);
        p->down = layer_param(m, cap, l, "mlp.down_proj.weight", C, F);
        if (p->down < 0) return -1;
    }
    m->p_norm = add_param(m, cap, "model.norm.weight", C, 0);
    m->p_lm_head = c->tie_word_embeddings ? m->p_embed
                                          : add_param(m, cap, "lm_head.weight", c->vocab_size, C);
    return m->p_lm_head < 0 ? -1 : 0;
}

void *cf_weight(cf_model *m, int i) {
    if (i < 0) return NULL;
    return (char *)m->w + m->params[i].offset * m->b->act_size;
}

float *cf_grad(cf_model *m, int i) { return i < 0 ? NULL : m->grad + m->params[i].offset; }

/* Per-op-category profiling (bench --profile): each op is bracketed by a
 * device synchronisation, so the sum is slightly above the unprofiled time. */
static double prof_begin(cf_model *m) {
    m->b->synchronize(m->b);
    return cf_now();
}

static void prof_end(cf_model *m, int cat, double t0) {
    m->b->synchronize(m->b);
    m->prof[m->prof_phase][cat] += cf_now() - t0;
}

#define OP(cat, call)                                  \
    do {                                               \
        double t_ = m->profile ? prof_begin(m) : 0.0;  \
        call;                                          \
        if (m->profile) prof_end(m, cat, t_);          \
    } while (0)

void cf_model_set_profile(cf_model *m, int on) { m->profile = on; }

void cf_model_profile(const cf_model *m, double out[2][CF_PROF_N]) {
    memcpy(out, m->prof, sizeof m->prof);
}

/* RoPE inverse frequencies, with Llama 3 frequency-dependent scaling:
 * wavelengths longer than orig/low_freq_factor are divided by `factor`,
 * shorter than orig/high_freq_factor are kept, in between interpolated. */
static void rope_inv_freq(const cf_config *c, float *out) {
    int D = c->head_dim;
    for (int i = 0; i < D / 2; i++) {
        double f = 1.0 / pow((double)c->rope_theta, (2.0 * i) / D);
        if (c->rope_llama3) {
            double low_wl = c->rope_original_max_pos / c->rope_low_freq_factor;
            double high_wl = c->rope_original_max_pos / c->rope_high_freq_factor;
            double wl = 2.0 * M_PI / f;
            if (wl > low_wl) {
                f = f / c->rope_factor;
            } else if (wl >= high_wl) {
                double smooth = (c->rope_original_max_pos / wl - c->rope_low_freq_factor) /
                                (c->rope_high_freq_factor - c->rope_low_freq_factor);
                f = (1.0 - smooth) * f / c->rope_factor + smooth * f;
            }
        }
        out[i] = (float)f;
    }
}

static cf_backend *make_backend(cf_backend_kind kind) {
    if (kind == CF_BACKEND_CPU) return cf_backend_cpu_create();
    if (kind == CF_BACKEND_CUDA) return cf_backend_cuda_create();
    cf_fail("unknown backend %d", (int)kind);
    return NULL;
}

/* Allocates the model with uninitialised weights. */
static cf_model *model_alloc(const cf_config *cfg, cf_backend_kind kind) {
    if (cf_config_validate(cfg) != 0) return NULL;
    cf_model *m = cf_calloc(1, sizeof *m);
    if (!m) return NULL;
    m->cfg = *cfg;
    m->doc_mask_bos = -1;
    m->b = make_backend(kind);
    if (!m->b || build_param_table(m) != 0) { cf_model_free(m); return NULL; }
    cf_backend *b = m->b;
    size_t n = m->nparams;
    m->master = b->alloc(b, n * sizeof(float));
    m->grad = b->alloc(b, n * sizeof(float));
    m->adam_m = b->alloc(b, n * sizeof(float));
    m->adam_v = b->alloc(b, n * sizeof(float));
    m->inv_freq = b->alloc(b, (size_t)cfg->head_dim / 2 * sizeof(float));
    if (!m->master || !m->grad || !m->adam_m || !m->adam_v || !m->inv_freq) {
        cf_model_free(m);
        return NULL;
    }
    /* CPU computes in fp32: the compute weights are the master weights. */
    m->w = b->act_size == sizeof(float) ? (void *)m->master : b->alloc(b, n * b->act_size);
    if (!m->w) { cf_model_free(m); return NULL; }
    b->memzero(b, m->grad, n * sizeof(float));
    b->memzero(b, m->adam_m, n * sizeof(float));
    b->memzero(b, m->adam_v, n * sizeof(float));
    float inv[1024];
    if (cfg->head_dim / 2 > 1024) { cf_fail("head_dim %d too large", cfg->head_dim); cf_model_free(m); return NULL; }
    rope_inv_freq(cfg, inv);
    b->upload(b, m->inv_freq, inv, (size_t)cfg->head_dim / 2 * sizeof(float));
    return m;
}

cf_model *cf_model_create(const cf_config *cfg, cf_backend_kind kind, uint64_t seed) {
    cf_model *m = model_alloc(cfg, kind);
    if (!m) return NULL;
    /* HF init: normal(0, 0.02) matrices, ones for norms, zeros for biases. */
    float *host = cf_malloc(m->nparams * sizeof(float));
    if (!host) { cf_model_free(m); return NULL; }
    /* Chunks of 2^20 elements, each with its own stream seeded by (seed,
     * tensor, chunk): deterministic whatever the thread count, and fast
     * enough for billions of parameters. */
    const size_t CHUNK = (size_t)1 << 20;
    for (int i = 0; i < m->ntensors; i++) {
        cf_param *p = &m->params[i];
        float *dst = host + p->offset;
        int is_norm = strstr(p->name, "norm") != NULL;
        long nchunks = (long)((p->numel + CHUNK - 1) / CHUNK);
#pragma omp parallel for schedule(dynamic)
        for (long ch = 0; ch < nchunks; ch++) {
            cf_rng rng;
            cf_rng_seed(&rng, seed ^ ((uint64_t)(i + 1) << 40) ^ ((uint64_t)ch * 0x9e3779b97f4a7c15ULL));
            size_t end = CF_MIN(p->numel, (size_t)(ch + 1) * CHUNK);
            for (size_t j = (size_t)ch * CHUNK; j < end; j++)
                dst[j] = p->ndim == 2 ? 0.02f * cf_rng_normal(&rng) : (is_norm ? 1.0f : 0.0f);
        }
    }
    m->b->upload(m->b, m->master, host, m->nparams * sizeof(float));
    m->b->weights_from_master(m->b, m->w, m->master, m->nparams);
    free(host);
    return m;
}

cf_model *cf_model_load(const char *dir, cf_backend_kind kind) {
    char path[4096];
    cf_config cfg;
    if (cf_path_join(path, sizeof path, dir, "config.json") != 0) return NULL;
    if (cf_config_load(&cfg, path) != 0) return NULL;
    cf_st_archive ar;
    if (cf_st_open(&ar, dir) != 0) return NULL;
    cf_model *m = model_alloc(&cfg, kind);
    if (!m) { cf_st_close(&ar); return NULL; }
    float *host = cf_malloc(m->nparams * sizeof(float));
    int rc = host ? 0 : -1;
    for (int i = 0; rc == 0 && i < m->ntensors; i++) {
        cf_param *p = &m->params[i];
        int j = cf_st_find(&ar, p->name);
        if (j < 0) { rc = cf_fail("%s: missing tensor '%s'", dir, p->name); break; }
        const cf_st_tensor *t = &ar.tensors[j];
        int ok = t->ndim == p->ndim && t->shape[0] == p->shape[0] &&
                 (p->ndim == 1 || t->shape[1] == p->shape[1]);
        if (!ok) {
            rc = cf_fail("%s: tensor '%s' has shape [%lld%s%lld], config needs [%lld%s%lld]", dir,
                         p->name, (long long)t->shape[0], t->ndim > 1 ? ", " : "",
                         t->ndim > 1 ? (long long)t->shape[1] : 0LL, (long long)p->shape[0],
                         p->ndim > 1 ? ", " : "", p->ndim > 1 ? (long long)p->shape[1] : 0LL);
            break;
        }
        rc = cf_st_read_f32(&ar, j, host + p->offset, p->numel);
    }
    cf_st_close(&ar);
    if (rc != 0) { free(host); cf_model_free(m); return NULL; }
    m->b->upload(m->b, m->master, host, m->nparams * sizeof(float));
    m->b->weights_from_master(m->b, m->w, m->master, m->nparams);
    free(host);
    return m;
}

int cf_model_save(cf_model *m, const char *dir, const char *dtype, size_t max_shard_bytes) {
    cf_dtype dt;
    if (!strcmp(dtype, "float32")) dt = CF_DT_F32;
    else if (!strcmp(dtype, "bfloat16")) dt = CF_DT_BF16;
    else return cf_fail("unsupported save dtype '%s' (float32 or bfloat16)", dtype);
    if (cf_mkdir_p(dir) != 0) return -1;
    float *host = cf_malloc(m->nparams * sizeof(float));
    cf_st_item *items = cf_calloc((size_t)m->ntensors, sizeof *items);
    if (!host || !items) { free(host); free(items); return -1; }
    m->b->download(m->b, host, m->master, m->nparams * sizeof(float));
    for (int i = 0; i < m->ntensors; i++) {
        cf_param *p = &m->params[i];
        items[i].name = p->name;
        items[i].data = host + p->offset;
        items[i].ndim = p->ndim;
        items[i].shape[0] = p->shape[0];
        items[i].shape[1] = p->shape[1];
    }
    char path[4096];
    int rc = cf_st_write_dir(dir, items, m->ntensors, dt, max_shard_bytes);
    if (rc == 0) rc = cf_path_join(path, sizeof path, dir, "config.json");
    if (rc == 0) rc = cf_config_save_as(&m->cfg, path, dtype);
    free(host);
    free(items);
    return rc;
}

static void free_acts(cf_model *m) {
    cf_backend *b = m->b;
    for (int i = 0; i < m->nsaved; i++) {
        b->free(b, m->saved[i].full);
        b->free(b, m->saved[i].compact);
    }
    m->nsaved = 0;
    if (m->la)
        for (int l = 0; l < m->cfg.num_hidden_layers; l++) { b->free(b, m->la[l].k); b->free(b, m->la[l].v); }
    free(m->la); m->la = NULL;
    free(m->resid); m->resid = NULL;
    void **scratch[] = {&m->d_resid, &m->d_ln, &m->d_att, &m->d_q, &m->d_qn, &m->d_k, &m->d_kn,
                        &m->d_v, &m->d_h, &m->d_gate, &m->d_up, &m->tmp};
    for (size_t i = 0; i < sizeof scratch / sizeof *scratch; i++) { b->free(b, *scratch[i]); *scratch[i] = NULL; }
    b->free(b, m->losses); b->free(b, m->dloss); b->free(b, m->doc);
    b->free(b, m->ref_dev); b->free(b, m->keep_dev);
    m->ref_dev = NULL; m->keep_dev = NULL;
    b->free(b, m->rows); b->free(b, m->seq_start);
    m->losses = m->dloss = NULL; m->doc = m->rows = m->seq_start = NULL;
    free(m->host_rows); free(m->host_seq_start); free(m->host_tokens); free(m->host_losses);
    m->host_rows = m->host_seq_start = NULL; m->host_tokens = NULL; m->host_losses = NULL;
    m->cap_T = 0;
}

void cf_model_free(cf_model *m) {
    if (!m) return;
    if (m->b) {
        cf_backend *b = m->b;
        free_acts(m);
        if (m->w != (void *)m->master) b->free(b, m->w);
        b->free(b, m->master); b->free(b, m->grad); b->free(b, m->adam_m); b->free(b, m->adam_v);
        b->free(b, m->inv_freq);
        b->destroy(b);
    }
    free(m->params);
    free(m->lp);
    free(m);
}

const cf_config *cf_model_config(const cf_model *m) { return &m->cfg; }
int cf_model_num_tensors(const cf_model *m) { return m->ntensors; }
const char *cf_model_tensor_name(const cf_model *m, int i) { return m->params[i].name; }
size_t cf_model_tensor_numel(const cf_model *m, int i) { return m->params[i].numel; }
size_t cf_model_num_params(const cf_model *m) { return m->nparams; }
cf_backend *cf_model_backend(cf_model *m) { return m->b; }
int64_t cf_optimizer_steps(const cf_model *m) { return m->step; }
void cf_model_timings(const cf_model *m, cf_timings *t) { *t = m->timings; }
void cf_model_set_doc_mask(cf_model *m, int bos) { m->doc_mask_bos = bos; }

int cf_model_get_param(cf_model *m, int i, float *out) {
    if (i < 0 || i >= m->ntensors) return cf_fail("parameter index %d out of range", i);
    m->b->download(m->b, out, m->master + m->params[i].offset, m->params[i].numel * sizeof(float));
    return 0;
}

int cf_model_set_param(cf_model *m, int i, const float *in) {
    if (i < 0 || i >= m->ntensors) return cf_fail("parameter index %d out of range", i);
    cf_param *p = &m->params[i];
    m->b->upload(m->b, m->master + p->offset, in, p->numel * sizeof(float));
    m->b->weights_from_master(m->b, (char *)m->w + p->offset * m->b->act_size, m->master + p->offset,
                              p->numel);
    return 0;
}

int cf_model_get_grad(cf_model *m, int i, float *out) {
    if (i < 0 || i >= m->ntensors) return cf_fail("parameter index %d out of range", i);
    m->b->download(m->b, out, m->grad + m->params[i].offset, m->params[i].numel * sizeof(float));
    return 0;
}

int cf_model_get_adam(cf_model *m, float *m_out, float *v_out) {
    m->b->download(m->b, m_out, m->adam_m, m->nparams * sizeof(float));
    m->b->download(m->b, v_out, m->adam_v, m->nparams * sizeof(float));
    return 0;
}

int cf_model_set_adam(cf_model *m, const float *m_in, const float *v_in, int64_t step) {
    m->b->upload(m->b, m->adam_m, m_in, m->nparams * sizeof(float));
    m->b->upload(m->b, m->adam_v, v_in, m->nparams * sizeof(float));
    m->step = step;
    return 0;
}

/* ---------------------------------------------------------- activations */

/* Registers a saved activation of T rows x row_bytes; returns its index. */
static int save_slot_as(cf_model *m, const char *what, size_t row_bytes, int gather) {
    if (m->nsaved >= CF_MAX_SAVED) return cf_fail("internal: too many saved activations");
    cf_saved *s = &m->saved[m->nsaved];
    s->what = what;
    s->row_bytes = row_bytes;
    s->full = m->b->alloc(m->b, (size_t)m->cap_T * row_bytes);
    s->compact = NULL;   /* allocated by the first filter */
    s->cur = s->full;
    s->gather = gather;
    if (!s->full) return -1;
    return m->nsaved++;
}

static int save_slot(cf_model *m, const char *what, size_t row_bytes) { return save_slot_as(m, what, row_bytes, 1); }

#define SAVED(m, idx) ((m)->saved[(idx)].cur)

static int alloc_acts(cf_model *m, int T) {
    free_acts(m);
    const cf_config *c = &m->cfg;
    cf_backend *b = m->b;
    size_t A = b->act_size, F4 = sizeof(float);
    int L = c->num_hidden_layers, C = c->hidden_size, F = c->intermediate_size;
    int H = c->num_attention_heads, Hkv = c->num_key_value_heads, D = c->head_dim;
    size_t qd = (size_t)H * D, kd = (size_t)Hkv * D;
    m->cap_T = T;
    m->resid = cf_calloc((size_t)L + 1, sizeof(int));
    m->la = cf_calloc((size_t)L, sizeof(cf_layer_acts));
    if (!m->resid || !m->la) return -1;
    int bad = 0;
    for (int l = 0; l <= L; l++) bad |= (m->resid[l] = save_slot(m, "residual", C * A)) < 0;
    for (int l = 0; l < L && !bad; l++) {
        cf_layer_acts *a = &m->la[l];
        memset(a, -1, sizeof *a);
        a->k = a->v = NULL;
        bad |= (a->x_mid = save_slot(m, "x_mid", C * A)) < 0;
        bad |= (a->ln1 = save_slot(m, "ln1", C * A)) < 0;
        bad |= (a->rstd1 = save_slot(m, "rstd1", F4)) < 0;
        if (c->qk_norm) {
            bad |= (a->qpre = save_slot(m, "q_pre_norm", qd * A)) < 0;
            bad |= (a->rstdq = save_slot(m, "rstd_q", H * F4)) < 0;
            bad |= (a->kpre = save_slot(m, "k_pre_norm", kd * A)) < 0;
            bad |= (a->rstdk = save_slot(m, "rstd_k", Hkv * F4)) < 0;
        }
        bad |= (a->q = save_slot(m, "q", qd * A)) < 0;
        bad |= (a->att = save_slot(m, "attn_out", qd * A)) < 0;
        bad |= (a->lse = save_slot(m, "lse", H * F4)) < 0;
        bad |= (a->ln2 = save_slot(m, "ln2", C * A)) < 0;
        bad |= (a->rstd2 = save_slot(m, "rstd2", F4)) < 0;
        /* read through the row index by swiglu_bwd_rows: never gathered */
        bad |= (a->gate = save_slot_as(m, "gate", F * A, 0)) < 0;
        bad |= (a->up = save_slot_as(m, "up", F * A, 0)) < 0;
        a->k = b->alloc(b, (size_t)T * kd * A);
        a->v = b->alloc(b, (size_t)T * kd * A);
        bad |= !a->k || !a->v;
    }
    if (bad) return -1;
    if ((m->s_lnf = save_slot(m, "lnf", C * A)) < 0) return -1;
    if ((m->s_rstdf = save_slot(m, "rstdf", F4)) < 0) return -1;
    if ((m->s_tokens = save_slot(m, "tokens", sizeof(int))) < 0) return -1;
    if ((m->s_targets = save_slot(m, "targets", sizeof(int))) < 0) return -1;
    if ((m->s_pos = save_slot(m, "positions", sizeof(int))) < 0) return -1;
    size_t wide = CF_MAX((size_t)C, CF_MAX(qd, (size_t)F));
    m->d_resid = b->alloc(b, (size_t)T * C * A);
    m->d_ln = b->alloc(b, (size_t)T * C * A);
    m->d_att = b->alloc(b, (size_t)T * qd * A);
    m->d_q = b->alloc(b, (size_t)T * qd * A);
    m->d_qn = b->alloc(b, (size_t)T * qd * A);
    m->d_k = b->alloc(b, (size_t)T * kd * A);
    m->d_kn = b->alloc(b, (size_t)T * kd * A);
    m->d_v = b->alloc(b, (size_t)T * kd * A);
    m->d_h = b->alloc(b, (size_t)T * F * A);
    m->d_gate = b->alloc(b, (size_t)T * F * A);
    m->d_up = b->alloc(b, (size_t)T * F * A);
    m->tmp = b->alloc(b, (size_t)T * wide * A);
    m->losses = b->alloc(b, (size_t)T * F4);
    m->dloss = b->alloc(b, (size_t)T * F4);
    m->ref_dev = b->alloc(b, (size_t)T * F4);
    m->keep_dev = b->alloc(b, (size_t)T);
    m->doc = b->alloc(b, (size_t)T * sizeof(int));
    m->rows = b->alloc(b, (size_t)T * sizeof(int));
    m->seq_start = b->alloc(b, ((size_t)T + 1) * sizeof(int));
    m->host_rows = cf_malloc((size_t)T * sizeof(int));
    m->host_seq_start = cf_malloc(((size_t)T + 1) * sizeof(int));
    m->host_losses = cf_malloc((size_t)T * F4);
    if (!m->d_resid || !m->d_ln || !m->d_att || !m->d_q || !m->d_qn || !m->d_k || !m->d_kn ||
        !m->d_v || !m->d_h || !m->d_gate || !m->d_up || !m->tmp || !m->losses || !m->dloss || !m->ref_dev || !m->keep_dev ||
        !m->doc || !m->rows || !m->seq_start || !m->host_rows || !m->host_seq_start ||
        !m->host_losses)
        return -1;
    return 0;
}

/* Un-compacts: the backward reads the full tensors again. */
static void reset_filter(cf_model *m) {
    for (int i = 0; i < m->nsaved; i++) m->saved[i].cur = m->saved[i].full;
    m->filtered = 0;
}

/* -------------------------------------------------------------- forward */

static cf_attn_shape attn_shape(cf_model *m, int B, int S) {
    cf_attn_shape s;
    s.B = B; s.S = S;
    s.H = m->cfg.num_attention_heads; s.Hkv = m->cfg.num_key_value_heads; s.D = m->cfg.head_dim;
    s.scale = 1.0f / sqrtf((float)s.D);
    s.doc = m->doc_mask_bos >= 0 ? m->doc : NULL;
    return s;
}

int cf_forward(cf_model *m, const int32_t *tokens, int B, int S, float *losses) {
    const cf_config *c = &m->cfg;
    if (B <= 0 || S <= 0) return cf_fail("forward: batch %d and sequence %d must be positive", B, S);
    if ((int64_t)B * S > (1 << 28)) return cf_fail("forward: %d x %d tokens is too many", B, S);
    if (c->sliding_window > 0 && S > c->sliding_window)
        return cf_fail("sequence length %d exceeds the model's sliding_window %d (not supported)", S,
                       c->sliding_window);
    for (int64_t i = 0; i < (int64_t)B * (S + 1); i++)
        if (tokens[i] < 0 || tokens[i] >= c->vocab_size)
            return cf_fail("token id %d at position %lld is outside the vocabulary [0, %d)",
                           tokens[i], (long long)i, c->vocab_size);
    double t0 = cf_now();
    cf_backend *b = m->b;
    int T = B * S;
    memset(m->prof, 0, sizeof m->prof);
    m->prof_phase = 0;
    if (T > m->cap_T && alloc_acts(m, T) != 0) return -1;
    reset_filter(m);
    m->B = B; m->S = S; m->T = T;
    free(m->host_tokens);
    m->host_tokens = cf_malloc((size_t)B * (S + 1) * sizeof(int32_t));
    if (!m->host_tokens) return -1;
    memcpy(m->host_tokens, tokens, (size_t)B * (S + 1) * sizeof(int32_t));

    /* inputs, targets, positions (and document ids) on the host, then upload */
    int *hin = cf_malloc((size_t)T * 4 * sizeof(int));
    if (!hin) return -1;
    int *htg = hin + T, *hpos = hin + 2 * T, *hdoc = hin + 3 * T;
    for (int bi = 0; bi < B; bi++) {
        int doc = 0, start = 0;
        for (int s = 0; s < S; s++) {
            int t = bi * S + s;
            hin[t] = tokens[bi * (S + 1) + s];
            htg[t] = tokens[bi * (S + 1) + s + 1];
            if (m->doc_mask_bos >= 0 && hin[t] == m->doc_mask_bos && s > 0) { doc++; start = s; }
            hpos[t] = s - start;
            hdoc[t] = doc;
        }
    }
    b->upload(b, m->saved[m->s_tokens].full, hin, (size_t)T * sizeof(int));
    b->upload(b, m->saved[m->s_targets].full, htg, (size_t)T * sizeof(int));
    b->upload(b, m->saved[m->s_pos].full, hpos, (size_t)T * sizeof(int));
    b->upload(b, m->doc, hdoc, (size_t)T * sizeof(int));
    free(hin);

    int L = c->num_hidden_layers, C = c->hidden_size, F = c->intermediate_size;
    int H = c->num_attention_heads, Hkv = c->num_key_value_heads, D = c->head_dim;
    int qd = H * D, kd = Hkv * D;
    const int *pos = m->saved[m->s_pos].full;
    cf_attn_shape shape = attn_shape(m, B, S);

    OP(CF_PROF_ELTWISE, b->embedding_fwd(b, m->saved[m->resid[0]].full, m->saved[m->s_tokens].full,
                     cf_weight(m, m->p_embed), T, C));
    for (int l = 0; l < L; l++) {
        cf_layer_params *p = &m->lp[l];
        cf_layer_acts *a = &m->la[l];
        void *x = m->saved[m->resid[l]].full;
        void *ln1 = m->saved[a->ln1].full, *q = m->saved[a->q].full;
        void *xmid = m->saved[a->x_mid].full, *ln2 = m->saved[a->ln2].full;
        /* h = silu(gate) * up is not saved: the backward recomputes it */
        void *gate = m->saved[a->gate].full, *up = m->saved[a->up].full, *h = m->d_h;
        OP(CF_PROF_NORM, b->rmsnorm_fwd(b, ln1, m->saved[a->rstd1].full, x, cf_weight(m, p->ln1), T, C, c->rms_norm_eps));
        if (c->qk_norm) {
            void *qpre = m->saved[a->qpre].full, *kpre = m->saved[a->kpre].full;
            OP(CF_PROF_GEMM, b->matmul_fwd(b, qpre, ln1, cf_weight(m, p->q), cf_weight(m, p->qb), T, C, qd));
            OP(CF_PROF_GEMM, b->matmul_fwd(b, kpre, ln1, cf_weight(m, p->k), cf_weight(m, p->kb), T, C, kd));
            OP(CF_PROF_NORM, b->rmsnorm_fwd(b, q, m->saved[a->rstdq].full, qpre, cf_weight(m, p->qn), T * H, D, c->rms_norm_eps));
            OP(CF_PROF_NORM, b->rmsnorm_fwd(b, a->k, m->saved[a->rstdk].full, kpre, cf_weight(m, p->kn), T * Hkv, D, c->rms_norm_eps));
        } else {
            OP(CF_PROF_GEMM, b->matmul_fwd(b, q, ln1, cf_weight(m, p->q), cf_weight(m, p->qb), T, C, qd));
            OP(CF_PROF_GEMM, b->matmul_fwd(b, a->k, ln1, cf_weight(m, p->k), cf_weight(m, p->kb), T, C, kd));
        }
        OP(CF_PROF_GEMM, b->matmul_fwd(b, a->v, ln1, cf_weight(m, p->v), cf_weight(m, p->vb), T, C, kd));
        OP(CF_PROF_ROPE, b->rope_fwd(b, q, pos, m->inv_freq, T, H, D));
        OP(CF_PROF_ROPE, b->rope_fwd(b, a->k, pos, m->inv_freq, T, Hkv, D));
        OP(CF_PROF_ATTN, b->attention_fwd(b, m->saved[a->att].full, m->saved[a->lse].full, q, a->k, a->v, &shape));
        OP(CF_PROF_GEMM, b->matmul_fwd(b, m->tmp, m->saved[a->att].full, cf_weight(m, p->o), cf_weight(m, p->ob), T, qd, C));
        OP(CF_PROF_ELTWISE, b->add(b, xmid, x, m->tmp, (size_t)T * C));
        OP(CF_PROF_NORM, b->rmsnorm_fwd(b, ln2, m->saved[a->rstd2].full, xmid, cf_weight(m, p->ln2), T, C, c->rms_norm_eps));
        OP(CF_PROF_GEMM, b->matmul_fwd(b, gate, ln2, cf_weight(m, p->gate), NULL, T, C, F));
        OP(CF_PROF_GEMM, b->matmul_fwd(b, up, ln2, cf_weight(m, p->up), NULL, T, C, F));
        OP(CF_PROF_ELTWISE, b->swiglu_fwd(b, h, gate, up, (size_t)T * F));
        OP(CF_PROF_GEMM, b->matmul_fwd(b, m->tmp, h, cf_weight(m, p->down), NULL, T, F, C));
        OP(CF_PROF_ELTWISE, b->add(b, m->saved[m->resid[l + 1]].full, xmid, m->tmp, (size_t)T * C));
    }
    OP(CF_PROF_NORM, b->rmsnorm_fwd(b, m->saved[m->s_lnf].full, m->saved[m->s_rstdf].full, m->saved[m->resid[L]].full,
                   cf_weight(m, m->p_norm), T, C, c->rms_norm_eps));
    OP(CF_PROF_LMHEAD, b->lmhead_loss_fwd(b, m->losses, m->saved[m->s_lnf].full, cf_weight(m, m->p_lm_head),
                       m->saved[m->s_targets].full, T, C, c->vocab_size));
    b->download(b, m->host_losses, m->losses, (size_t)T * sizeof(float));
    if (losses) memcpy(losses, m->host_losses, (size_t)T * sizeof(float));
    m->timings.forward = cf_now() - t0;
    return 0;
}

int cf_model_logits_row(cf_model *m, int t, float *out) {
    if (t < 0 || t >= m->T) return cf_fail("logits: row %d outside the last forward's %d rows", t, m->T);
    cf_backend *b = m->b;
    const cf_config *c = &m->cfg;
    size_t A = b->act_size;
    /* logits[1, V] = lnf[t] Wlm^T into a buffer of its own (decoding only) */
    void *buf = b->alloc(b, (size_t)c->vocab_size * A);
    if (!buf) return -1;
    b->matmul_fwd(b, buf, (char *)m->saved[m->s_lnf].full + (size_t)t * c->hidden_size * A,
                  cf_weight(m, m->p_lm_head), NULL, 1, c->hidden_size, c->vocab_size);
    b->act_to_f32(b, out, buf, (size_t)c->vocab_size);
    b->free(b, buf);
    return 0;
}

/* ------------------------------------------------------------ selection */

int cf_select_rows(cf_model *m, const float *ref_host, float keep_frac, cf_select_kind kind, int per_batch,
                   uint64_t seed, uint8_t *keep) {
    cf_backend *b = m->b;
    if (m->T == 0) return cf_fail("select: no forward pass");
    if (!b->select_topk || kind == CF_SELECT_RANDOM)
        return cf_select(m->host_losses, ref_host, m->B, m->S, keep_frac, kind, per_batch, seed, keep);
    if (!(keep_frac > 0.0f && keep_frac <= 1.0f)) return cf_fail("--keep: %g is outside (0, 1]", (double)keep_frac);
    if (kind == CF_SELECT_REF && !ref_host) return cf_fail("select ref needs reference losses (--ref)");
    int group = per_batch ? m->T : m->S;
    int k = cf_select_kept_count(keep_frac, group);
    if (kind == CF_SELECT_REF) b->upload(b, m->ref_dev, ref_host, (size_t)m->T * sizeof(float));
    b->select_topk(b, m->keep_dev, m->losses, kind == CF_SELECT_REF ? m->ref_dev : NULL, m->T, group, k);
    b->download(b, keep, m->keep_dev, (size_t)m->T);
    return k * (m->T / group);
}

/* ------------------------------------------------------- filter operator */

int cf_filter_backward(cf_model *m, const uint8_t *keep) {
    if (m->T == 0) return cf_fail("filter: no forward pass to filter");
    double t0 = cf_now();
    cf_backend *b = m->b;
    int n = 0;
    for (int bi = 0; bi < m->B; bi++) {
        m->host_seq_start[bi] = n;
        for (int s = 0; s < m->S; s++)
            if (keep[bi * m->S + s]) m->host_rows[n++] = bi * m->S + s;
    }
    m->host_seq_start[m->B] = n;
    if (n == 0) return cf_fail("filter: no token is kept");
    m->n_kept = n;
    b->upload(b, m->rows, m->host_rows, (size_t)n * sizeof(int));
    b->upload(b, m->seq_start, m->host_seq_start, ((size_t)m->B + 1) * sizeof(int));
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
        dst[count] = s->compact;
        src[count] = s->full;
        row_bytes[count++] = s->row_bytes;
        s->cur = s->compact;
    }
    if (b->gather_rows_multi) {
        b->gather_rows_multi(b, count, dst, src, row_bytes, m->rows, n);
    } else {
        for (int i = 0; i < count; i++) b->gather_rows(b, dst[i], src[i], m->rows, n, row_bytes[i]);
    }
    m->filtered = 1;
    b->synchronize(b);
    m->timings.filter = cf_now() - t0;
    return 0;
}

/* ------------------------------------------------------------- backward */

void cf_zero_grad(cf_model *m) { m->b->memzero(m->b, m->grad, m->nparams * sizeof(float)); }

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
    return 0;
}

static int backward_impl(cf_model *m, cf_mode mode, const uint8_t *keep, float loss_scale,
                         float *loss_out, int stopgrad_reference);

int cf_backward(cf_model *m, cf_mode mode, const uint8_t *keep, float loss_scale, float *loss_out) {
    return backward_impl(m, mode, keep, loss_scale, loss_out, 0);
}

int cf_backward_reference_stopgrad(cf_model *m, const uint8_t *keep, float loss_scale, float *loss_out) {
    return backward_impl(m, CF_MODE_LOSS_ONLY, keep, loss_scale, loss_out, 1);
}

static int backward_impl(cf_model *m, cf_mode mode, const uint8_t *keep, float loss_scale,
                         float *loss_out, int stopgrad_reference) {
    if (m->T == 0) return cf_fail("backward: no forward pass");
    const cf_config *c = &m->cfg;
    cf_backend *b = m->b;
    int compact = mode == CF_MODE_CENTRIFUGE || mode == CF_MODE_STRAWMAN;
    if (mode != CF_MODE_REGULAR && !keep) return cf_fail("backward: mode %s needs a keep mask", cf_mode_name(mode));
    if (compact && !m->filtered && cf_filter_backward(m, keep) != 0) return -1;
    if (!compact) reset_filter(m);
    double t0 = cf_now();
    m->prof_phase = 1;
    int T = m->T;
    int n = compact ? m->n_kept : T;

    /* Per-row loss weights: d(mean loss)/d(loss_t). */
    int counted = 0;
    for (int t = 0; t < T; t++) counted += mode == CF_MODE_REGULAR || keep[t];
    if (counted == 0) return cf_fail("backward: no position is kept");
    float *hd = cf_malloc((size_t)T * sizeof(float));
    if (!hd) return -1;
    double loss = 0;
    for (int t = 0; t < T; t++) {
        int in = mode == CF_MODE_REGULAR || keep[t];
        if (in) loss += m->host_losses[t];
        if (!compact) hd[t] = in ? loss_scale / counted : 0.0f;
    }
    if (compact)
        for (int i = 0; i < n; i++) hd[i] = loss_scale / counted;
    b->upload(b, m->dloss, hd, (size_t)n * sizeof(float));
    free(hd);
    if (loss_out) *loss_out = (float)(loss / counted);

    int L = c->num_hidden_layers, C = c->hidden_size, F = c->intermediate_size;
    int H = c->num_attention_heads, Hkv = c->num_key_value_heads, D = c->head_dim;
    int qd = H * D, kd = Hkv * D;
    const int *pos = SAVED(m, m->s_pos);
    cf_attn_shape shape = attn_shape(m, m->B, m->S);
    cf_rows kept = {m->n_kept, m->rows, m->seq_start, m->host_rows, m->host_seq_start};
    cf_attn_bwd_mode amode = mode == CF_MODE_CENTRIFUGE ? CF_ATTN_BWD_CENTRIFUGE
                           : mode == CF_MODE_STRAWMAN   ? CF_ATTN_BWD_STRAWMAN
                                                        : CF_ATTN_BWD_FULL;

    /* LM head and final norm: dresid = d(loss)/d(x_L) */
    OP(CF_PROF_LMHEAD, b->lmhead_loss_bwd(b, m->d_ln, cf_grad(m, m->p_lm_head), SAVED(m, m->s_lnf),
                       cf_weight(m, m->p_lm_head), SAVED(m, m->s_targets), m->dloss, n, C,
                       c->vocab_size));
    OP(CF_PROF_NORM, b->rmsnorm_bwd(b, m->d_resid, cf_grad(m, m->p_norm), m->d_ln, SAVED(m, m->resid[L]),
                   cf_weight(m, m->p_norm), SAVED(m, m->s_rstdf), n, C, 0));
    for (int l = L - 1; l >= 0; l--) {
        cf_layer_params *p = &m->lp[l];
        cf_layer_acts *a = &m->la[l];
        /* MLP: x' = x_mid + down(silu(gate(ln2)) * up(ln2)) */
        OP(CF_PROF_GEMM, b->matmul_bwd(b, m->d_h, NULL, NULL, m->d_resid, NULL, cf_weight(m, p->down), n, F, C, 0));
        /* gate and up of the kept rows are read through the row index; the
         * kernel also recomputes h for the down projection's weight gradient */
        OP(CF_PROF_ELTWISE, b->swiglu_bwd_rows(b, m->tmp, m->d_gate, m->d_up, m->d_h, SAVED(m, a->gate),
                                               SAVED(m, a->up), compact ? m->rows : NULL, n, F));
        OP(CF_PROF_GEMM, b->matmul_bwd(b, NULL, cf_grad(m, p->down), NULL, m->d_resid, m->tmp,
                                       cf_weight(m, p->down), n, F, C, 0));
        OP(CF_PROF_GEMM, b->matmul_bwd(b, m->d_ln, cf_grad(m, p->gate), NULL, m->d_gate, SAVED(m, a->ln2),
                      cf_weight(m, p->gate), n, C, F, 0));
        OP(CF_PROF_GEMM, b->matmul_bwd(b, m->d_ln, cf_grad(m, p->up), NULL, m->d_up, SAVED(m, a->ln2),
                      cf_weight(m, p->up), n, C, F, 1));
        OP(CF_PROF_NORM, b->rmsnorm_bwd(b, m->d_resid, cf_grad(m, p->ln2), m->d_ln, SAVED(m, a->x_mid),
                       cf_weight(m, p->ln2), SAVED(m, a->rstd2), n, C, 1));
        /* attention: x_mid = x + o(attn(q, k, v)) */
        OP(CF_PROF_GEMM, b->matmul_bwd(b, m->d_att, cf_grad(m, p->o), cf_grad(m, p->ob), m->d_resid, SAVED(m, a->att),
                      cf_weight(m, p->o), n, qd, C, 0));
        OP(CF_PROF_ATTN, b->attention_bwd(b, m->d_q, m->d_k, m->d_v, m->d_att, SAVED(m, a->q), a->k, a->v,
                         SAVED(m, a->att), SAVED(m, a->lse), &shape, compact ? &kept : NULL, amode));
        if (stopgrad_reference &&
            (zero_filtered_rows(m, m->d_k, (size_t)kd, keep) != 0 ||
             zero_filtered_rows(m, m->d_v, (size_t)kd, keep) != 0))
            return -1;
        OP(CF_PROF_ROPE, b->rope_bwd(b, m->d_q, pos, m->inv_freq, n, H, D));
        OP(CF_PROF_ROPE, b->rope_bwd(b, m->d_k, pos, m->inv_freq, n, Hkv, D));
        void *dq = m->d_q, *dk = m->d_k;
        if (c->qk_norm) {
            OP(CF_PROF_NORM, b->rmsnorm_bwd(b, m->d_qn, cf_grad(m, p->qn), m->d_q, SAVED(m, a->qpre),
                           cf_weight(m, p->qn), SAVED(m, a->rstdq), n * H, D, 0));
            OP(CF_PROF_NORM, b->rmsnorm_bwd(b, m->d_kn, cf_grad(m, p->kn), m->d_k, SAVED(m, a->kpre),
                           cf_weight(m, p->kn), SAVED(m, a->rstdk), n * Hkv, D, 0));
            dq = m->d_qn;
            dk = m->d_kn;
        }
        OP(CF_PROF_GEMM, b->matmul_bwd(b, m->d_ln, cf_grad(m, p->q), cf_grad(m, p->qb), dq, SAVED(m, a->ln1),
                      cf_weight(m, p->q), n, C, qd, 0));
        OP(CF_PROF_GEMM, b->matmul_bwd(b, m->d_ln, cf_grad(m, p->k), cf_grad(m, p->kb), dk, SAVED(m, a->ln1),
                      cf_weight(m, p->k), n, C, kd, 1));
        OP(CF_PROF_GEMM, b->matmul_bwd(b, m->d_ln, cf_grad(m, p->v), cf_grad(m, p->vb), m->d_v, SAVED(m, a->ln1),
                      cf_weight(m, p->v), n, C, kd, 1));
        OP(CF_PROF_NORM, b->rmsnorm_bwd(b, m->d_resid, cf_grad(m, p->ln1), m->d_ln, SAVED(m, m->resid[l]),
                       cf_weight(m, p->ln1), SAVED(m, a->rstd1), n, C, 1));
    }
    OP(CF_PROF_ELTWISE, b->embedding_bwd(b, cf_grad(m, m->p_embed), m->d_resid, SAVED(m, m->s_tokens), n, C));
    b->synchronize(b);
    m->timings.backward = cf_now() - t0;
    return 0;
}

/* ------------------------------------------------------------ optimizer */

float cf_lr_schedule(int step, int warmup, int total, float max_lr, float min_lr) {
    if (warmup > 0 && step < warmup) return max_lr * (float)(step + 1) / (float)warmup;
    if (total <= warmup) return max_lr;
    float progress = (float)(step - warmup) / (float)(total - warmup);
    if (progress > 1.0f) progress = 1.0f;
    return min_lr + 0.5f * (max_lr - min_lr) * (1.0f + cosf((float)M_PI * progress));
}

int cf_step(cf_model *m, const cf_adamw_params *hp, float *grad_norm) {
    double t0 = cf_now();
    cf_backend *b = m->b;
    double norm = sqrt(b->sumsq(b, m->grad, m->nparams));
    if (grad_norm) *grad_norm = (float)norm;
    if (!isfinite(norm)) { cf_zero_grad(m); return 1; }
    float scale = 1.0f;
    if (hp->grad_clip > 0 && norm > hp->grad_clip) scale = (float)(hp->grad_clip / norm);
    m->step++;
    for (int i = 0; i < m->ntensors; i++) {
        cf_param *p = &m->params[i];
        /* one pass per tensor: update, refresh the compute copy, zero the grad */
        b->adamw(b, m->master + p->offset, (char *)m->w + p->offset * b->act_size, m->grad + p->offset,
                 m->adam_m + p->offset, m->adam_v + p->offset, p->numel, hp->lr, hp->beta1, hp->beta2,
                 hp->eps, p->decay ? hp->weight_decay : 0.0f, scale, (int)m->step);
    }
    b->synchronize(b);
    m->timings.optimizer = cf_now() - t0;
    return 0;
}

/* ---------------------------------------------------------------- names */

const char *cf_mode_name(cf_mode md) {
    switch (md) {
    case CF_MODE_REGULAR: return "regular";
    case CF_MODE_LOSS_ONLY: return "loss-only";
    case CF_MODE_CENTRIFUGE: return "centrifuge";
    case CF_MODE_STRAWMAN: return "strawman";
    }
    return "?";
}

int cf_mode_parse(const char *s, cf_mode *out) {
    for (int i = 0; i <= CF_MODE_STRAWMAN; i++)
        if (!strcmp(s, cf_mode_name((cf_mode)i))) { *out = (cf_mode)i; return 0; }
    return cf_fail("--mode: unknown mode '%s' (regular, loss-only, centrifuge, strawman)", s);
}
