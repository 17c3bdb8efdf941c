/*
 * model.c — the Llama-family model driver, written once against the backend
 * interface (backend/backend.h): the parameter table, opening and saving a
 * model, the activations and the forward pass. The filter and the backward
 * are in backward.c, selection in kept.c, the optimizer in optim.c.
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
 * Where the weights lie back to back, q/k/v are one GEMM (split and rotated
 * by one op) and gate/up one GEMM (plan_fused_proj).
 *
 * Filtering (DESIGN §1-2): after the full forward, cf_filter_backward
 * gathers the saved activations the GEMMs and attention read to the kept
 * rows (not K and V, nor what element-wise ops read through the row index:
 * gate, up, and the norms' inputs and rstd), and the backward then runs
 * with M = kept rows in every GEMM.
 */
#include "engine/model_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/dropout_mask.h"
#include "base/common.h"
#include "dist/tp_plan.h"
#include "formats/io.h"

static void free_acts(cf_model *m);

/* ----------------------------------------------------------- parameters */

static int add_param(cf_model *m, int cap, int layer, const char *name, int64_t d0, int64_t d1) {
    if (m->ntensors >= cap) return cf_fail("internal: parameter table overflow");
    cf_param *p = &m->params[m->ntensors];
    snprintf(p->name, sizeof p->name, "%s", name);
    p->ndim = d1 > 0 ? 2 : 1;
    p->shape[0] = d0;
    p->shape[1] = d1 > 0 ? d1 : 0;
    p->numel = (size_t)d0 * (size_t)(d1 > 0 ? d1 : 1);
    p->layer = layer;
    p->trainable = 1;
    p->decay = p->ndim == 2;
    p->woff = p->goff = SIZE_MAX;   /* assigned by cf_optim_init */
    m->nparams += p->numel;
    return m->ntensors++;
}

static int layer_param(cf_model *m, int cap, int l, const char *suffix, int64_t d0, int64_t d1) {
    char name[96];
    snprintf(name, sizeof name, "model.layers.%d.%s", l, suffix);
    return add_param(m, cap, l, name, d0, d1);
}

static int layer_bias(cf_model *m, int cap, int l, const char *proj, int64_t out) {
    char name[64];
    snprintf(name, sizeof name, "%s.bias", proj);
    return layer_param(m, cap, l, name, out, 0);
}

static cf_linear layer_linear(cf_model *m, int cap, int l, const char *proj, int64_t out, int64_t in, int bias) {
    char name[64];
    cf_linear lin = {-1, -1, -1, -1, -1, 0};
    snprintf(name, sizeof name, "%s.weight", proj);
    lin.w = layer_param(m, cap, l, name, out, in);
    if (bias) lin.b = layer_bias(m, cap, l, proj, out);
    return lin;
}

/* Builds the parameter table in HF naming and in HF order, except that
 * q, k, v biases (qwen2, llama attention_bias) follow all three weights:
 * Wq, Wk, Wv back to back let the projections run as one GEMM, and bq, bk,
 * bv back to back are that GEMM's bias (plan_fused_proj). Training states
 * written in the older order (state.bin v1, v2) are permuted on load
 * (cf_param_order_v2). dist/tp_plan.c lists the same order. */
static int build_param_table(cf_model *m) {
    const cf_config *c = &m->cfg;
    int L = c->num_hidden_layers, C = c->hidden_size, F = c->intermediate_size;
    int qd = c->num_attention_heads * c->head_dim, kd = c->num_key_value_heads * c->head_dim;
    int cap = 3 + L * 16;
    m->params = cf_calloc((size_t)cap, sizeof(cf_param));
    m->lp = cf_calloc((size_t)L, sizeof(cf_layer_params));
    if (!m->params || !m->lp) return -1;
    m->p_embed = add_param(m, cap, -1, "model.embed_tokens.weight", c->vocab_size, C);
    for (int l = 0; l < L; l++) {
        cf_layer_params *p = &m->lp[l];
        p->qn = p->kn = -1;
        p->ln1 = layer_param(m, cap, l, "input_layernorm.weight", C, 0);
        p->q = layer_linear(m, cap, l, "self_attn.q_proj", qd, C, 0);
        p->k = layer_linear(m, cap, l, "self_attn.k_proj", kd, C, 0);
        p->v = layer_linear(m, cap, l, "self_attn.v_proj", kd, C, 0);
        if (c->qkv_bias) {
            p->q.b = layer_bias(m, cap, l, "self_attn.q_proj", qd);
            p->k.b = layer_bias(m, cap, l, "self_attn.k_proj", kd);
            p->v.b = layer_bias(m, cap, l, "self_attn.v_proj", kd);
        }
        p->o = layer_linear(m, cap, l, "self_attn.o_proj", C, qd, c->o_bias);
        if (c->qk_norm) {
            p->qn = layer_param(m, cap, l, "self_attn.q_norm.weight", c->head_dim, 0);
            p->kn = layer_param(m, cap, l, "self_attn.k_norm.weight", c->head_dim, 0);
        }
        p->ln2 = layer_param(m, cap, l, "post_attention_layernorm.weight", C, 0);
        p->gate = layer_linear(m, cap, l, "mlp.gate_proj", F, C, 0);
        p->up = layer_linear(m, cap, l, "mlp.up_proj", F, C, 0);
        p->down = layer_linear(m, cap, l, "mlp.down_proj", C, F, 0);
        if (p->down.w < 0) return -1;
    }
    m->p_norm = add_param(m, cap, L, "model.norm.weight", C, 0);
    m->p_lm_head = c->tie_word_embeddings ? m->p_embed
                                          : add_param(m, cap, L, "lm_head.weight", c->vocab_size, C);
    return m->p_lm_head < 0 ? -1 : 0;
}

int cf_param_order_v2(const cf_model *m, int *order) {
    int n = 0, moved = 0;
    for (int i = 0; i < m->ntensors; i++) {
        const int l = m->params[i].layer;
        const cf_layer_params *p = l >= 0 && l < m->cfg.num_hidden_layers ? &m->lp[l] : NULL;
        if (p && p->q.b >= 0 && (i == p->q.b || i == p->k.b || i == p->v.b)) continue;
        order[n++] = i;
        if (!p || p->q.b < 0) continue;
        const int b = i == p->q.w ? p->q.b : i == p->k.w ? p->k.b : i == p->v.w ? p->v.b : -1;
        if (b >= 0) {
            order[n++] = b;
            moved |= b != n - 1;
        }
    }
    return moved;
}

int cf_lora_parse_targets(const char *s, unsigned *out) {
    static const struct { const char *name; unsigned bit; } T[] = {
        {"q", CF_LORA_Q}, {"k", CF_LORA_K}, {"v", CF_LORA_V}, {"o", CF_LORA_O},
        {"gate", CF_LORA_GATE}, {"up", CF_LORA_UP}, {"down", CF_LORA_DOWN}};
    char buf[256];
    if (!s || !*s || strlen(s) >= sizeof buf) return cf_fail("--lora-targets: give a list such as q,k,v,o");
    if (cf_list_check("--lora-targets", s) != 0) return -1;
    snprintf(buf, sizeof buf, "%s", s);
    unsigned bits = 0;
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (!strcmp(t, "all")) { bits |= 0x7f; continue; }
        size_t n = strlen(t);
        if (n > 5 && !strcmp(t + n - 5, "_proj")) t[n - 5] = 0;   /* q_proj -> q */
        unsigned bit = 0;
        for (size_t i = 0; i < sizeof T / sizeof *T; i++)
            if (!strcmp(t, T[i].name)) bit = T[i].bit;
        if (!bit) return cf_fail("--lora-targets: unknown module '%s' (q, k, v, o, gate, up, down, all)", t);
        bits |= bit;
    }
    *out = bits;
    return 0;
}

/* LoRA: appends adapters A [r, in], B [out, r] for every targeted
 * projection (named as PEFT names them, without PEFT's "base_model.model."
 * prefix) and freezes every base tensor. */
static int add_adapters(cf_model *m, const cf_lora_opts *lo) {
    if (lo->rank <= 0) return 0;
    const cf_config *c = &m->cfg;
    if (lo->rank > 4096) return cf_fail("--lora-rank %d is out of range", lo->rank);
    if (!(lo->alpha > 0)) return cf_fail("--lora-alpha must be positive");
    if (!lo->targets) return cf_fail("--lora-targets: no module targeted");
    if (!(lo->dropout >= 0 && lo->dropout < 1)) return cf_fail("--lora-dropout %g is outside [0, 1)", lo->dropout);
    int L = c->num_hidden_layers;
    int cap = m->ntensors + L * 14;
    cf_param *np = realloc(m->params, (size_t)cap * sizeof(cf_param));
    if (!np) return cf_fail("out of memory for the parameter table");
    m->params = np;
    for (int i = 0; i < m->ntensors; i++) m->params[i].trainable = 0;
    static const char *names[7] = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"};
    for (int l = 0; l < L; l++) {
        cf_layer_params *p = &m->lp[l];
        cf_linear *lin[7] = {&p->q, &p->k, &p->v, &p->o, &p->gate, &p->up, &p->down};
        for (int t = 0; t < 7; t++) {
            if (!(lo->targets & (1u << t))) continue;
            const cf_param *w = &m->params[lin[t]->w];
            char name[64];
            snprintf(name, sizeof name, "%s.lora_A.weight", names[t]);
            lin[t]->la = layer_param(m, cap, l, name, lo->rank, w->shape[1]);
            snprintf(name, sizeof name, "%s.lora_B.weight", names[t]);
            lin[t]->lb = layer_param(m, cap, l, name, w->shape[0], lo->rank);
            if (lin[t]->lb < 0) return -1;
            m->params[lin[t]->la].adapter = m->params[lin[t]->lb].adapter = 1;
        }
    }
    m->lora = *lo;
    m->lora_scale = lo->rslora ? lo->alpha / sqrtf((float)lo->rank) : lo->alpha / (float)lo->rank;
    /* dropout (training forwards only, linear.c): drop when the hash's top
     * 32 bits are below round(P 2^32), scale the kept by 1/(1-P) */
    m->drop_thr = cf_dropout_threshold(lo->dropout);
    m->drop_scale = 1.0f / (1.0f - lo->dropout);
    return 0;
}

const cf_lora_opts *cf_model_lora(const cf_model *m) { return &m->lora; }

void cf_model_set_train(cf_model *m, int on) { m->train = on != 0; }

/* Marks the tensors whose names contain one of the comma-separated
 * patterns as frozen; a pattern that matches nothing is an error. */
static int apply_freeze(cf_model *m, const char *spec) {
    if (!spec || !*spec) return 0;
    char buf[1024];
    if (strlen(spec) >= sizeof buf) return cf_fail("--freeze: list too long");
    /* strtok skips empty items: "," would freeze nothing without a word */
    if (cf_list_check("--freeze", spec) != 0) return -1;
    snprintf(buf, sizeof buf, "%s", spec);
    for (char *save = NULL, *pat = strtok_r(buf, ",", &save); pat; pat = strtok_r(NULL, ",", &save)) {
        int hits = 0;
        for (int i = 0; i < m->ntensors; i++)
            if (*pat && strstr(m->params[i].name, pat)) { m->params[i].trainable = 0; hits++; }
        if (!hits) return cf_fail("--freeze: '%s' matches no parameter name (e.g. embed_tokens, lm_head, layers.0.)", pat);
    }
    int trainable = 0;
    for (int i = 0; i < m->ntensors; i++) trainable += m->params[i].trainable;
    if (!trainable) return cf_fail("--freeze: every parameter is frozen; nothing would train");
    return 0;
}

void *cf_weight(cf_model *m, int i) {
    if (i < 0) return NULL;
    return (char *)m->w + m->params[i].woff * m->b->act_size;
}

float *cf_grad(cf_model *m, int i) {
    if (i < 0 || !m->params[i].trainable) return NULL;
    return m->opt.grad + m->params[i].goff;
}

/* 0 when CF_GRAD_SET=0 is in the environment: a ZERO gradient is added to,
 * not written (A/B timing); a STALE one is written regardless (correctness). */
int cf_grad_set_env(void) {
    static int env = -1;
    if (env < 0) {
        const char *e = getenv("CF_GRAD_SET");
        env = !(e && *e == '0');
    }
    return env;
}

int cf_grad_take_zero(cf_model *m, int i) {
    if (i < 0 || !m->params[i].trainable || !m->opt.gstate) return 0;
    const int state = m->opt.gstate[i];
    m->opt.gstate[i] = CF_GRAD_LIVE;
    if (state == CF_GRAD_STALE) return CF_MM_DW_SET;
    return state == CF_GRAD_ZERO && cf_grad_set_env() ? CF_MM_DW_SET : 0;
}

static int grad_state(const cf_model *m, int i) {
    return i >= 0 && m->params[i].trainable && m->opt.gstate ? m->opt.gstate[i] : CF_GRAD_LIVE;
}

static void grad_memzero(cf_model *m, int i) {
    m->b->memzero(m->b, cf_grad(m, i), m->params[i].numel * sizeof(float));
}

int cf_grad_take_zero_group(cf_model *m, const int *idx, int n) {
    int stale[4] = {0}, set = CF_MM_DW_SET;
    if (n < 1 || n > 4) return 0;
    for (int k = 0; k < n; k++) stale[k] = grad_state(m, idx[k]) == CF_GRAD_STALE;
    for (int k = 0; k < n; k++) set &= cf_grad_take_zero(m, idx[k]);
    if (!set) /* the GEMM adds to all of them: a STALE one must hold zeros first */
        for (int k = 0; k < n; k++)
            if (stale[k]) grad_memzero(m, idx[k]);
    return set;
}

int cf_grad_take_zero_pair(cf_model *m, int i, int j) {
    const int idx[2] = {i, j};
    return cf_grad_take_zero_group(m, idx, 2);
}

void cf_grad_settle(cf_model *m) {
    for (int i = 0; i < m->ntensors; i++)
        if (grad_state(m, i) == CF_GRAD_STALE) {
            grad_memzero(m, i);
            m->opt.gstate[i] = CF_GRAD_ZERO;
        }
}

void cf_grad_mark_all(cf_model *m, int state) {
    if (m->opt.gstate) memset(m->opt.gstate, state, (size_t)m->ntensors);
}

/* Per-op-category profiling (bench --profile). With time marks (CUDA
 * events on the compute stream) each op is bracketed by two marks and
 * nothing synchronises: an op's time is the device time from the end of
 * the previous op to its own end, so the categories add up to the
 * unprofiled stage times (launch gaps included, charged to the op after
 * them). Without marks (CPU), or when they run out, each op is bracketed
 * by a device synchronisation, which adds each op's launch latency. The
 * marks are read in cf_model_timings (end of the step). */
double cf_prof_begin(cf_model *m) {
    cf_backend *b = m->b;
    if (b->mark && !m->prof_synced) {
        int a = b->mark(b);
        if (a >= 0) return -(double)a - 1.0;
    }
    b->synchronize(b);
    return cf_now();
}

void cf_prof_end(cf_model *m, int cat, double t0) {
    cf_backend *b = m->b;
    if (t0 < 0) {
        int c = b->mark(b);
        if (c >= 0 && m->nprof_ops == m->cap_prof_ops) {
            int cap = m->cap_prof_ops ? 2 * m->cap_prof_ops : 1024;
            void *p = realloc(m->prof_ops, (size_t)cap * sizeof *m->prof_ops);
            if (p) { m->prof_ops = p; m->cap_prof_ops = cap; }
        }
        if (c >= 0 && m->nprof_ops < m->cap_prof_ops) {
            m->prof_ops[m->nprof_ops].phase = m->prof_phase;
            m->prof_ops[m->nprof_ops].cat = cat;
            m->prof_ops[m->nprof_ops].a = (int)(-t0 - 1.0);
            m->prof_ops[m->nprof_ops++].c = c;
            return;
        }
        /* out of marks: this op is lost, the rest of the step synchronises */
        m->prof_synced = 1;
        return;
    }
    b->synchronize(b);
    m->prof[m->prof_phase][cat] += cf_now() - t0;
}

/* Adds the marked ops' times into m->prof (before the marks are reset). */
static void prof_resolve(cf_model *m) {
    cf_backend *b = m->b;
    for (int i = 0; i < m->nprof_ops; i++)
        m->prof[m->prof_ops[i].phase][m->prof_ops[i].cat] +=
            b->mark_elapsed(b, m->prof_ops[i].a, m->prof_ops[i].c);
    m->nprof_ops = 0;
    m->prof_synced = 0;
}

void cf_model_set_profile(cf_model *m, int on) { m->profile = on; }

void cf_model_profile(const cf_model *m, double out[2][CF_PROF_N]) {
    memcpy(out, m->prof, sizeof m->prof);
}

const char *cf_prof_name(int c) {
    static const char *names[CF_PROF_N] = {"gemm", "attention", "lm-head+ce", "rmsnorm", "rope", "elementwise"};
    return c >= 0 && c < CF_PROF_N ? names[c] : "?";
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

static cf_backend *make_backend(cf_backend_kind kind, int device) {
    if (kind == CF_BACKEND_CPU) return cf_backend_cpu_create();
    if (kind == CF_BACKEND_CUDA) return cf_backend_cuda_create(device);
    cf_fail("unknown backend %d", (int)kind);
    return NULL;
}

int cf_backend_parse(const char *s, cf_backend_kind *out, int *device) {
    if (!strcmp(s, "cpu")) { *out = CF_BACKEND_CPU; return 0; }
    if (!strncmp(s, "cuda", 4)) {
        long d = 0;
        if (s[4] == ':' && cf_parse_int(s + 5, 0, 1023, "--device cuda:N", &d) != 0) return -1;
        if (s[4] != 0 && s[4] != ':') return cf_fail("--device: unknown device '%s' (cpu, cuda, cuda:N)", s);
        *out = CF_BACKEND_CUDA;
        if (device) *device = (int)d;
        return 0;
    }
    return cf_fail("--device: unknown device '%s' (cpu, cuda, cuda:N)", s);
}

/* Allocates the model with uninitialised weights: the parameter table, the
 * optimizer layout (whole, or the builder's), the compute weights and the
 * optimizer state of the trainable tensors. */
/* Tensor parallel: the local config of the rank (its heads, FFN slice and
 * vocabulary rows), the split kinds in the parameter table. */
static int tp_setup(cf_model *m, const cf_config *full, const cf_tp_sync *tp) {
    cf_tp_local loc;
    if (cf_tp_check(full, tp->size) != 0 || cf_tp_local_config(full, tp->size, tp->rank, &loc) != 0) return -1;
    if (loc.vocab_len < 1)
        return cf_fail("--tp %d: rank %d would hold no vocabulary row (vocabulary %d)", tp->size, tp->rank,
                       full->vocab_size);
    m->tp = *tp;
    m->tp.full = *full;
    m->tp.vocab_start = loc.vocab_start;
    m->tp.vocab_len = loc.vocab_len;
    m->cfg.num_attention_heads = loc.heads;
    m->cfg.num_key_value_heads = loc.kv_heads;
    m->cfg.intermediate_size = loc.intermediate;
    m->cfg.vocab_size = loc.vocab_local;
    return 0;
}

static int tp_mark_params(cf_model *m) {
    for (int i = 0; i < m->ntensors; i++) {
        cf_tp_slice sl;
        if (cf_tp_split(&m->tp.full, m->tp.size, m->params[i].name, m->tp.rank, &sl) != 0) return -1;
        m->params[i].tp_replicated = sl.kind == CF_TP_REPLICATED;
    }
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) m->lp[l].o.row_tp = m->lp[l].down.row_tp = 1;
    return 0;
}

/* Whether tensor j's compute weights follow tensor i's in m->w. */
static int stored_after(const cf_model *m, int i, int j) {
    return m->params[j].woff == m->params[i].woff + m->params[i].numel;
}

/* Issue 17: the forward runs q, k, v as one GEMM with [Wq; Wk; Wv] (and
 * bias [bq; bk; bv] where they have biases; its split fused with RoPE) and
 * gate, up as one with [Wg; Wu], where the layout allows. The parameter
 * table puts each group back to back, but whether their compute weights
 * stay so depends on the optimizer layout (a ZeRO-1 plan pads between
 * tensors, frozen and trainable tensors live apart), so it is checked here,
 * per layer, on the offsets of this process (under TP its column slices).
 * An adapter or (qwen3) a per-head norm between the GEMM and RoPE keeps the
 * projections apart. CF_FUSED_PROJ=0 in the environment turns both off
 * (A/B timing, cross-checks). */
static int qkv_bias_joined(const cf_model *m, const cf_layer_params *p) {
    if (p->q.b < 0 && p->k.b < 0 && p->v.b < 0) return 1;
    return p->q.b >= 0 && p->k.b >= 0 && p->v.b >= 0 && stored_after(m, p->q.b, p->k.b) &&
           stored_after(m, p->k.b, p->v.b);
}

static void plan_fused_proj(cf_model *m) {
    const char *e = getenv("CF_FUSED_PROJ");
    const int on = !(e && *e == '0');
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        cf_layer_params *p = &m->lp[l];
        p->fused_qkv = on && !m->cfg.qk_norm && qkv_bias_joined(m, p) && p->q.la < 0 && p->k.la < 0 &&
                       p->v.la < 0 && stored_after(m, p->q.w, p->k.w) && stored_after(m, p->k.w, p->v.w);
        p->fused_gate_up = on && p->gate.b < 0 && p->up.b < 0 && p->gate.la < 0 && p->up.la < 0 &&
                           stored_after(m, p->gate.w, p->up.w);
    }
}

int cf_head_save_env(void) {
    const char *e = getenv("CF_HEAD_SAVE");
    return !(e && *e == '0');
}

static cf_model *model_alloc(const cf_config *cfg, const cf_model_opts *o, const cf_tp_sync *tp,
                             cf_layout_fn layout, void *lctx) {
    if (cf_config_validate(cfg) != 0) return NULL;
    cf_model *m = cf_calloc(1, sizeof *m);
    if (!m) return NULL;
    m->cfg = *cfg;
    m->doc_mask_bos = -1;
    m->s_lse = -1;
    m->drop_seed = o->seed;
    cf_dwpair_init(m);
    cf_dwside_init(m);
    if (tp && tp->size > 1) {
        if (o->lora.rank > 0 || o->adapter_dir) {
            cf_fail("--tp with LoRA adapters is not supported yet: use data parallelism (ZeRO-1) for LoRA");
            free(m);
            return NULL;
        }
        if (tp_setup(m, cfg, tp) != 0) { free(m); return NULL; }
    }
    m->b = make_backend(o->backend, o->device);
    if (!m->b || build_param_table(m) != 0 || (cf_tp_on(m) && tp_mark_params(m) != 0) ||
        apply_freeze(m, o->freeze) != 0 || add_adapters(m, &o->lora) != 0) {
        cf_model_free(m);
        return NULL;
    }
    cf_backend *b = m->b;
    cf_optim_layout lay;
    memset(&lay, 0, sizeof lay);
    int rc = layout ? layout(lctx, m, &lay) : cf_optim_layout_whole(m, &lay);
    if (rc != 0 || cf_optim_init(m, &lay) != 0) { cf_model_free(m); return NULL; }
    plan_fused_proj(m);
    m->head_save = cf_head_save_env() && !cf_tp_on(m);
    m->inv_freq = b->alloc(b, (size_t)cfg->head_dim / 2 * sizeof(float));
    m->scalars = b->alloc(b, sizeof(cf_scalars));
    if (!m->inv_freq || !m->scalars) { cf_model_free(m); return NULL; }
    float inv[1024];
    if (cfg->head_dim / 2 > 1024) { cf_fail("head_dim %d too large", cfg->head_dim); cf_model_free(m); return NULL; }
    rope_inv_freq(cfg, inv);
    if (b->upload(b, m->inv_freq, inv, (size_t)cfg->head_dim / 2 * sizeof(float)) != 0) { cf_model_free(m); return NULL; }
    cf_model_clear_scalars(m);
    return m;
}

/* HF init: normal(0, 0.02) matrices, ones for norms, zeros for biases, in
 * chunks of 2^20 elements, each with its own stream seeded by (seed,
 * tensor, chunk): deterministic whatever the thread count, and fast enough
 * for billions of parameters. */
/* Tensor parallel: rank's slice of tensor i (its whole HF shape in *sl). */
static int tp_slice(cf_model *m, int i, cf_tp_slice *sl) {
    return cf_tp_split(&m->tp.full, m->tp.size, m->params[i].name, m->tp.rank, sl);
}

/* Elements of tensor i as the whole model has it (TP: before the split). */
static size_t whole_numel(cf_model *m, int i) {
    cf_tp_slice sl;
    if (!cf_tp_on(m) || m->params[i].adapter) return m->params[i].numel;
    if (tp_slice(m, i, &sl) != 0) return 0;
    return (size_t)sl.shape[0] * (size_t)(sl.ndim == 2 ? sl.shape[1] : 1);
}

/* Sets tensor i from its whole values: split first under TP (local is
 * scratch of the local size). */
static int set_whole(cf_model *m, int i, const float *whole, float *local) {
    if (!cf_tp_on(m)) return cf_optim_set_tensor(m, i, whole);
    cf_tp_slice sl;
    if (tp_slice(m, i, &sl) != 0) return -1;
    cf_tp_extract(&sl, whole, local, sizeof(float));
    return cf_optim_set_tensor(m, i, local);
}

static int init_weights(cf_model *m, uint64_t seed) {
    size_t maxn = 0;
    for (int i = 0; i < m->ntensors; i++) maxn = CF_MAX(maxn, whole_numel(m, i));
    float *host = cf_malloc(maxn * sizeof(float));
    float *local = cf_tp_on(m) ? cf_malloc(maxn * sizeof(float)) : NULL;
    if (!host || (cf_tp_on(m) && !local)) { free(host); return -1; }
    const size_t CHUNK = (size_t)1 << 20;
    int rc = 0;
    for (int i = 0; i < m->ntensors && rc == 0; i++) {
        cf_param *p = &m->params[i];
        if (p->adapter) continue;   /* init_adapters */
        int is_norm = strstr(p->name, "norm") != NULL;
        /* TP: the whole tensor from the same streams, then the rank's slice */
        size_t numel = whole_numel(m, i);
        long nchunks = (long)((numel + CHUNK - 1) / CHUNK);
#pragma omp parallel for schedule(dynamic)
        for (long ch = 0; ch < nchunks; ch++) {
            cf_rng rng;
            cf_rng_seed(&rng, seed ^ ((uint64_t)(i + 1) << 40) ^ ((uint64_t)ch * 0x9e3779b97f4a7c15ULL));
            size_t end = CF_MIN(numel, (size_t)(ch + 1) * CHUNK);
            for (size_t j = (size_t)ch * CHUNK; j < end; j++)
                host[j] = p->ndim == 2 ? 0.02f * cf_rng_normal(&rng) : (is_norm ? 1.0f : 0.0f);
        }
        rc = set_whole(m, i, host, local);
    }
    free(host);
    free(local);
    return rc;
}

/* PEFT's init: A ~ kaiming_uniform(a = sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)),
 * B = 0, so the adapted model starts as the base model. */
static int init_adapters(cf_model *m, uint64_t seed) {
    int rc = 0;
    for (int i = 0; i < m->ntensors && rc == 0; i++) {
        cf_param *p = &m->params[i];
        if (!p->adapter) continue;
        float *host = cf_calloc(p->numel, sizeof(float));
        if (!host) return -1;
        if (strstr(p->name, "lora_A")) {
            cf_rng rng;
            cf_rng_seed(&rng, seed ^ 0x10a1ULL ^ ((uint64_t)(i + 1) << 32));
            float bound = 1.0f / sqrtf((float)p->shape[1]);
            for (size_t j = 0; j < p->numel; j++) host[j] = bound * (2.0f * cf_rng_uniform(&rng) - 1.0f);
        }
        rc = cf_optim_set_tensor(m, i, host);
        free(host);
    }
    return rc;
}

/* Reads every tensor of a HF directory into the model. */
/* Reads every tensor of a HF directory into the model (TP: the whole
 * tensor, then the rank's slice). */
static int load_weights(cf_model *m, const char *dir) {
    cf_st_archive ar;
    if (cf_st_open(&ar, dir) != 0) return -1;
    size_t maxn = 0;
    for (int i = 0; i < m->ntensors; i++) maxn = CF_MAX(maxn, whole_numel(m, i));
    float *host = cf_malloc(maxn * sizeof(float));
    float *local = cf_tp_on(m) ? cf_malloc(maxn * sizeof(float)) : NULL;
    int rc = host && (local || !cf_tp_on(m)) ? 0 : -1;
    for (int i = 0; rc == 0 && i < m->ntensors; i++) {
        cf_param *p = &m->params[i];
        if (p->adapter) continue;
        int64_t shape[2] = {p->shape[0], p->shape[1]};
        cf_tp_slice sl;
        if (cf_tp_on(m)) {
            if (tp_slice(m, i, &sl) != 0) { rc = -1; break; }
            shape[0] = sl.shape[0];
            shape[1] = sl.shape[1];
        }
        int j = cf_st_find(&ar, p->name);
        if (j < 0) { rc = cf_fail("%s: missing tensor '%s'", dir, p->name); break; }
        const cf_st_tensor *t = &ar.tensors[j];
        int ok = t->ndim == p->ndim && t->shape[0] == shape[0] && (p->ndim == 1 || t->shape[1] == shape[1]);
        if (!ok) {
            rc = cf_fail("%s: tensor '%s' has shape [%lld%s%lld], config needs [%lld%s%lld]", dir,
                         p->name, (long long)t->shape[0], t->ndim > 1 ? ", " : "",
                         t->ndim > 1 ? (long long)t->shape[1] : 0LL, (long long)shape[0],
                         p->ndim > 1 ? ", " : "", p->ndim > 1 ? (long long)shape[1] : 0LL);
            break;
        }
        rc = cf_st_read_f32(&ar, j, host, (size_t)shape[0] * (size_t)(p->ndim > 1 ? shape[1] : 1));
        if (rc == 0) rc = set_whole(m, i, host, local);
    }
    cf_st_close(&ar);
    free(host);
    free(local);
    return rc;
}

int cf_model_opts_config(const cf_model_opts *o, cf_config *cfg) {
    if (o->config && o->model_dir) return cf_fail("give --config or --model, not both");
    if (o->layers < 0) return cf_fail("--layers %d: must be at least 1", o->layers);
    if (o->model_dir) {
        if (o->layers > 0)
            return cf_fail("--layers cuts a --config; %s has its own config.json (and weights for every layer)",
                           o->model_dir);
        char path[4096];
        if (cf_path_join(path, sizeof path, o->model_dir, "config.json") != 0) return -1;
        return cf_config_load(cfg, path);
    }
    const char *name = o->config ? o->config : "tiny";
    int rc = strchr(name, '/') || strstr(name, ".json") ? cf_config_load(cfg, name) : cf_config_builtin(cfg, name);
    if (rc != 0 || o->layers == 0) return rc;
    if (o->layers > cfg->num_hidden_layers)
        return cf_fail("--layers %d: %s has %d layers", o->layers, name, cfg->num_hidden_layers);
    cfg->num_hidden_layers = o->layers;
    return cf_config_validate(cfg);
}

static cf_model *model_open(const cf_model_opts *o, const cf_tp_sync *tp, cf_layout_fn layout, void *lctx) {
    cf_config cfg;
    if (cf_model_opts_config(o, &cfg) != 0) return NULL;
    cf_model_opts oo = *o;
    if (o->adapter_dir) {
        if (o->lora.rank > 0) { cf_fail("give an adapter directory or LoRA settings, not both"); return NULL; }
        if (cf_lora_read_config(o->adapter_dir, &oo.lora) != 0) return NULL;
    }
    o = &oo;
    cf_model *m = model_alloc(&cfg, o, tp, layout, lctx);
    if (!m) return NULL;
    int rc = o->model_dir ? load_weights(m, o->model_dir) : init_weights(m, o->seed);
    if (rc == 0 && m->lora.rank > 0) rc = o->adapter_dir ? cf_lora_load(m, o->adapter_dir) : init_adapters(m, o->seed);
    if (rc != 0) { cf_model_free(m); return NULL; }
    return m;
}

cf_model *cf_model_open_with(const cf_model_opts *o, cf_layout_fn layout, void *lctx) {
    return model_open(o, NULL, layout, lctx);
}

cf_model *cf_model_open_tp(const cf_model_opts *o, const cf_tp_sync *sync, cf_layout_fn layout, void *lctx) {
    return model_open(o, sync, layout, lctx);
}

cf_model *cf_model_open(const cf_model_opts *o) { return cf_model_open_with(o, NULL, NULL); }

cf_model *cf_model_create(const cf_config *cfg, cf_backend_kind kind, uint64_t seed) {
    cf_model_opts o = {0};
    o.backend = kind;
    o.seed = seed;
    cf_model *m = model_alloc(cfg, &o, NULL, NULL, NULL);
    if (m && init_weights(m, seed) != 0) { cf_model_free(m); return NULL; }
    return m;
}

cf_model *cf_model_load(const char *dir, cf_backend_kind kind) {
    cf_model_opts o = {0};
    o.model_dir = dir;
    o.backend = kind;
    return cf_model_open(&o);
}

int cf_model_save(cf_model *m, const char *dir, const char *dtype, size_t max_shard_bytes) {
    if (cf_tp_on(m)) return cf_fail("internal: a tensor-parallel model is saved by every rank (cf_model_save_tp)");
    cf_dtype dt;
    if (!strcmp(dtype, "float32")) dt = CF_DT_F32;
    else if (!strcmp(dtype, "bfloat16")) dt = CF_DT_BF16;
    else return cf_fail("unsupported save dtype '%s' (float32 or bfloat16)", dtype);
    if (cf_mkdir_p(dir) != 0) return -1;
    float *host = cf_malloc(m->nparams * sizeof(float));
    cf_st_item *items = cf_calloc((size_t)m->ntensors, sizeof *items);
    if (!host || !items) { free(host); free(items); return -1; }
    size_t off = 0;
    int rc = 0, n = 0;
    for (int i = 0; i < m->ntensors && rc == 0; i++) {
        cf_param *p = &m->params[i];
        if (p->adapter) continue;   /* cf_lora_save */
        rc = cf_model_get_param(m, i, host + off);
        items[n].name = p->name;
        items[n].data = host + off;
        items[n].ndim = p->ndim;
        items[n].shape[0] = p->shape[0];
        items[n].shape[1] = p->shape[1];
        off += p->numel;
        n++;
    }
    char path[4096];
    if (rc == 0) rc = cf_st_write_dir(dir, items, n, dt, max_shard_bytes);
    if (rc == 0) rc = cf_path_join(path, sizeof path, dir, "config.json");
    if (rc == 0) rc = cf_config_save_as(&m->cfg, path, dtype);
    free(host);
    free(items);
    return rc;
}

int cf_tp_settle(cf_model *m) {
    if (!cf_tp_on(m) || !m->tp.settle) return 0;
    return m->tp.settle(m->tp.ctx);
}

int cf_tp_allreduce(cf_model *m, void *x, size_t count, int type, int phase) {
    if (!cf_tp_on(m)) return 0;
    if (m->tp.allreduce_start(m->tp.ctx, x, count, type, phase) != 0) return -1;
    return m->tp.wait(m->tp.ctx);
}

/* Every rank: its slice of each tensor (fp32) is gathered over the TP group;
 * the writing rank puts the slices in place (tp_plan's insert) and writes
 * the whole model with the whole config. */
int cf_model_save_tp(cf_model *m, const char *dir, const char *dtype, int write) {
    if (!cf_tp_on(m)) return write ? cf_model_save(m, dir, dtype, 0) : 0;
    cf_dtype dt;
    if (!strcmp(dtype, "float32")) dt = CF_DT_F32;
    else if (!strcmp(dtype, "bfloat16")) dt = CF_DT_BF16;
    else return cf_fail("unsupported save dtype '%s' (float32 or bfloat16)", dtype);
    cf_backend *b = m->b;
    const int P = m->tp.size;
    size_t maxl = 0, total = 0;
    for (int i = 0; i < m->ntensors; i++) {
        maxl = CF_MAX(maxl, m->params[i].numel);
        total += whole_numel(m, i);
    }
    float *dev = b->alloc(b, (size_t)P * maxl * sizeof(float));
    float *parts = cf_malloc((size_t)P * maxl * sizeof(float));
    float *whole = write ? cf_malloc(total * sizeof(float) + 1) : NULL;
    cf_st_item *items = write ? cf_calloc((size_t)m->ntensors, sizeof *items) : NULL;
    int rc = dev && parts && (!write || (whole && items)) ? 0 : -1;
    size_t off = 0;
    int n = 0;
    for (int i = 0; i < m->ntensors && rc == 0; i++) {
        cf_param *p = &m->params[i];
        size_t ln = p->numel;
        rc = cf_model_get_param(m, i, parts);
        if (rc == 0) rc = b->upload(b, dev + (size_t)m->tp.rank * ln, parts, ln * sizeof(float));
        if (rc == 0) rc = m->tp.allgather_f32(m->tp.ctx, dev, ln);
        if (rc == 0) rc = b->download(b, parts, dev, (size_t)P * ln * sizeof(float));
        if (rc != 0 || !write) continue;
        cf_tp_slice sl;
        for (int r = 0; r < P && rc == 0; r++) {
            rc = cf_tp_split(&m->tp.full, P, p->name, r, &sl);
            if (rc == 0) cf_tp_insert(&sl, parts + (size_t)r * ln, whole + off, sizeof(float));
        }
        items[n].name = p->name;
        items[n].data = whole + off;
        items[n].ndim = sl.ndim;
        items[n].shape[0] = sl.shape[0];
        items[n].shape[1] = sl.ndim == 2 ? sl.shape[1] : 0;
        off += whole_numel(m, i);
        n++;
    }
    char path[4096];
    if (rc == 0 && write) rc = cf_mkdir_p(dir);
    if (rc == 0 && write) rc = cf_st_write_dir(dir, items, n, dt, 0);
    if (rc == 0 && write) rc = cf_path_join(path, sizeof path, dir, "config.json");
    if (rc == 0 && write) rc = cf_config_save_as(&m->tp.full, path, dtype);
    b->free(b, dev);
    free(parts);
    free(whole);
    free(items);
    return rc;
}

void cf_model_free(cf_model *m) {
    if (!m) return;
    if (m->b) {
        cf_backend *b = m->b;
        free_acts(m);
        cf_dwpair_free(m);
        cf_dwside_free(m);
        cf_optim_free(m);
        b->free(b, m->w);
        b->free(b, m->inv_freq);
        b->free(b, m->scalars);
        b->destroy(b);
    }
    free(m->params);
    free(m->lp);
    free(m->prof_ops);
    free(m);
}

/* The model's config (under TP the whole model's, not the rank's slice). */
const cf_config *cf_model_config(const cf_model *m) { return cf_tp_on(m) ? &m->tp.full : &m->cfg; }
int cf_model_num_tensors(const cf_model *m) { return m->ntensors; }
const char *cf_model_tensor_name(const cf_model *m, int i) { return m->params[i].name; }
size_t cf_model_tensor_numel(const cf_model *m, int i) { return m->params[i].numel; }
int cf_model_tensor_trainable(const cf_model *m, int i) { return m->params[i].trainable; }
size_t cf_model_num_params(const cf_model *m) { return m->nparams; }
size_t cf_model_num_trainable(const cf_model *m) {
    size_t n = 0;
    for (int i = 0; i < m->ntensors; i++) n += m->params[i].trainable ? m->params[i].numel : 0;
    return n;
}
cf_backend *cf_model_backend(cf_model *m) { return m->b; }

/* ---------------------------------------------------------------- timing */

void cf_stage_begin(cf_model *m, int stage) {
    cf_backend *b = m->b;
    if (m->npending >= (int)(sizeof m->pending / sizeof *m->pending)) {
        cf_timings t;
        cf_model_timings(m, &t);   /* resolve what is pending into m->timings */
        m->timings.forward += t.forward; m->timings.filter += t.filter;
        m->timings.backward += t.backward; m->timings.optimizer += t.optimizer;
    }
    int i = m->npending;
    m->pending[i].stage = stage;
    m->pending[i].a = b->mark ? b->mark(b) : -1;
    m->pending[i].c = -1;
    if (m->pending[i].a < 0) {
        b->synchronize(b);
        m->pending[i].host = cf_now();
    }
}

void cf_stage_end(cf_model *m, int stage) {
    cf_backend *b = m->b;
    int i = m->npending;
    if (m->pending[i].stage != stage) return;
    if (m->pending[i].a >= 0) {
        m->pending[i].c = b->mark(b);
    } else {
        b->synchronize(b);
        m->pending[i].host = cf_now() - m->pending[i].host;
    }
    m->npending++;
}

/* Sums the stages recorded since the last call (waits for the last mark). */
void cf_model_timings(cf_model *m, cf_timings *t) {
    cf_backend *b = m->b;
    prof_resolve(m);
    cf_timings r = m->timings;
    for (int i = 0; i < m->npending; i++) {
        double s = m->pending[i].a < 0 ? m->pending[i].host
                 : m->pending[i].c < 0 ? 0.0 : b->mark_elapsed(b, m->pending[i].a, m->pending[i].c);
        switch (m->pending[i].stage) {
        case CF_STAGE_FORWARD: r.forward += s; break;
        case CF_STAGE_FILTER: r.filter += s; break;
        case CF_STAGE_BACKWARD: r.backward += s; break;
        default: r.optimizer += s; break;
        }
    }
    m->npending = 0;
    if (b->marks_reset) b->marks_reset(b);
    memset(&m->timings, 0, sizeof m->timings);
    *t = r;
}
void cf_model_set_doc_mask(cf_model *m, int bos) { m->doc_mask_bos = bos; }
const char *cf_model_device_name(const cf_model *m) {
    return m->b->device_name ? m->b->device_name : m->b->name;
}

#ifndef CF_GIT_COMMIT
#define CF_GIT_COMMIT "unknown"
#endif
const char *cf_build_commit(void) { return CF_GIT_COMMIT; }

size_t cf_model_memory_peak(const cf_model *m) { return m->b->memory_peak ? m->b->memory_peak(m->b) : 0; }

/* The values of a tensor: from the master weights where this process holds
 * all of them (exact fp32), else from the compute copy. */
int cf_model_get_param(cf_model *m, int i, float *out) {
    if (i < 0 || i >= m->ntensors) return cf_fail("parameter index %d out of range", i);
    cf_param *p = &m->params[i];
    cf_backend *b = m->b;
    if (p->trainable) {
        /* the local segments of this tensor, in order */
        size_t have = 0;
        for (int s = 0; s < m->opt.lay.nseg; s++) {
            const cf_segment *g = &m->opt.lay.seg[s];
            if (g->tensor == i) have += g->len;
        }
        if (have == p->numel) {
            for (int s = 0; s < m->opt.lay.nseg; s++) {
                const cf_segment *g = &m->opt.lay.seg[s];
                if (g->tensor != i) continue;
                if (b->download(b, out + (g->goff - p->goff), m->opt.master + g->loff, g->len * sizeof(float)) != 0)
                    return -1;
            }
            return 0;
        }
    }
    b->act_to_f32(b, out, cf_weight(m, i), p->numel);
    return b->check(b);
}

int cf_model_set_param(cf_model *m, int i, const float *in) {
    if (i < 0 || i >= m->ntensors) return cf_fail("parameter index %d out of range", i);
    return cf_optim_set_tensor(m, i, in);
}

int cf_model_get_grad(cf_model *m, int i, float *out) {
    if (i < 0 || i >= m->ntensors) return cf_fail("parameter index %d out of range", i);
    if (!m->params[i].trainable) return cf_fail("%s is frozen: it has no gradient", m->params[i].name);
    if (cf_dwpair_flush(m) != 0) return -1; /* the whole gradient, held rows included */
    if (grad_state(m, i) == CF_GRAD_STALE) {
        /* logically zero; its memory is left for the next backward to overwrite */
        memset(out, 0, m->params[i].numel * sizeof(float));
        return m->b->check(m->b);
    }
    return m->b->download(m->b, out, cf_grad(m, i), m->params[i].numel * sizeof(float));
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

static void free_acts(cf_model *m) {
    cf_backend *b = m->b;
    for (int i = 0; i < m->nsaved; i++) {
        b->free(b, m->saved[i].full);
        b->free(b, m->saved[i].compact);
    }
    m->nsaved = 0;
    m->s_head = -1;
    if (m->la)
        for (int l = 0; l < m->cfg.num_hidden_layers; l++) { b->free(b, m->la[l].k); b->free(b, m->la[l].v); }
    free(m->la); m->la = NULL;
    free(m->resid); m->resid = NULL;
    void **bufs[] = {&m->d_resid, &m->d_ln, &m->d_att, &m->d_q, &m->d_qn, &m->d_k, &m->d_kn, &m->d_v, &m->d_h,
                     &m->d_gate, &m->tmp, &m->qkv, (void **)&m->losses, (void **)&m->dloss, (void **)&m->doc,
                     (void **)&m->ref_dev, (void **)&m->keep_dev, (void **)&m->rows, (void **)&m->seq_start,
                     &m->lora_v, &m->lora_du, (void **)&m->tp_stats};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++) { b->free(b, *bufs[i]); *bufs[i] = NULL; }
    free(m->host_losses); m->host_losses = NULL;
    m->cap_T = 0;
}

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
    /* The norms' inputs and rstd are read through the row index by
     * rmsnorm_bwd (the only reader in the backward): never gathered */
    for (int l = 0; l <= L; l++) bad |= (m->resid[l] = save_slot_as(m, "residual", C * A, 0)) < 0;
    for (int l = 0; l < L && !bad; l++) {
        cf_layer_acts *a = &m->la[l];
        memset(a, -1, sizeof *a);
        a->k = a->v = NULL;
        bad |= (a->x_mid = save_slot_as(m, "x_mid", C * A, 0)) < 0;
        bad |= (a->ln1 = save_slot(m, "ln1", C * A)) < 0;
        bad |= (a->rstd1 = save_slot_as(m, "rstd1", F4, 0)) < 0;
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
        bad |= (a->rstd2 = save_slot_as(m, "rstd2", F4, 0)) < 0;
        /* read through the row index by swiglu_bwd_rows: never gathered.
         * Fused: the gate/up GEMM's [T, 2F] output itself (cf_gate_up). */
        if (m->lp[l].fused_gate_up) {
            bad |= (a->gate = a->up = save_slot_as(m, "gate_up", 2 * F * A, 0)) < 0;
        } else {
            bad |= (a->gate = save_slot_as(m, "gate", F * A, 0)) < 0;
            bad |= (a->up = save_slot_as(m, "up", F * A, 0)) < 0;
        }
        a->k = b->alloc(b, (size_t)T * kd * A);
        a->v = b->alloc(b, (size_t)T * kd * A);
        bad |= !a->k || !a->v;
    }
    if (bad) return -1;
    if ((m->s_lnf = save_slot(m, "lnf", C * A)) < 0) return -1;
    if ((m->s_rstdf = save_slot_as(m, "rstdf", F4, 0)) < 0) return -1;
    if ((m->s_tokens = save_slot(m, "tokens", sizeof(int))) < 0) return -1;
    if ((m->s_targets = save_slot(m, "targets", sizeof(int))) < 0) return -1;
    if ((m->s_pos = save_slot(m, "positions", sizeof(int))) < 0) return -1;
    if (cf_tp_on(m)) {
        if ((m->s_lse = save_slot(m, "xent_lse", F4)) < 0) return -1;
        m->tp_stats = b->alloc(b, (size_t)m->tp.size * T * 3 * F4);
        if (!m->tp_stats) return -1;
    }
    size_t wide = CF_MAX((size_t)C, CF_MAX(qd, (size_t)F));
    if (m->lora.rank > 0) {
        /* LoRA: u = scale * x A^T of every adapted projection, saved (and
         * gathered by the filter); the adapter's output and input gradient */
        for (int l = 0; l < L; l++) {
            cf_layer_params *p = &m->lp[l];
            cf_linear *lin[7] = {&p->q, &p->k, &p->v, &p->o, &p->gate, &p->up, &p->down};
            for (int t = 0; t < 7; t++)
                if (lin[t]->la >= 0 && (lin[t]->su = save_slot(m, "lora_u", (size_t)m->lora.rank * A)) < 0) return -1;
        }
        m->lora_v = b->alloc(b, (size_t)T * wide * A);
        m->lora_du = b->alloc(b, (size_t)T * m->lora.rank * A);
        if (!m->lora_v || !m->lora_du) return -1;
    }
    m->d_resid = b->alloc(b, (size_t)T * C * A);
    m->d_ln = b->alloc(b, (size_t)T * C * A);
    m->d_att = b->alloc(b, (size_t)T * qd * A);
    m->d_q = b->alloc(b, (size_t)T * qd * A);
    m->d_qn = b->alloc(b, (size_t)T * qd * A);
    m->d_k = b->alloc(b, (size_t)T * kd * A);
    m->d_kn = b->alloc(b, (size_t)T * kd * A);
    m->d_v = b->alloc(b, (size_t)T * kd * A);
    m->d_h = b->alloc(b, (size_t)T * F * A);
    /* dgate and dup of the SwiGLU backward: one [T, 2F] buffer, read as two
     * [T, F] matrices (d_up = d_gate + T F) or, for the fused gate/up
     * backward, as one [T, 2F] matrix with the halves interleaved by row */
    m->d_gate = b->alloc(b, (size_t)T * 2 * F * A);
    m->tmp = b->alloc(b, (size_t)T * wide * A);
    int any_qkv = 0;
    for (int l = 0; l < L; l++) any_qkv |= m->lp[l].fused_qkv;
    if (any_qkv && qd + 2 * kd > wide && !(m->qkv = b->alloc(b, (size_t)T * (qd + 2 * kd) * A))) return -1;
    m->losses = b->alloc(b, (size_t)T * F4);
    m->dloss = b->alloc(b, (size_t)T * F4);
    m->ref_dev = b->alloc(b, (size_t)T * F4);
    m->keep_dev = b->alloc(b, (size_t)T);
    m->doc = b->alloc(b, (size_t)T * sizeof(int));
    m->rows = b->alloc(b, (size_t)T * sizeof(int));
    m->seq_start = b->alloc(b, ((size_t)T + 1) * sizeof(int));
    m->host_losses = cf_malloc((size_t)T * F4);
    if (!m->d_resid || !m->d_ln || !m->d_att || !m->d_q || !m->d_qn || !m->d_k || !m->d_kn ||
        !m->d_v || !m->d_h || !m->d_gate || !m->tmp || !m->losses || !m->dloss || !m->ref_dev || !m->keep_dev ||
        !m->doc || !m->rows || !m->seq_start || !m->host_losses)
        return -1;
    return 0;
}

/* Un-compacts: the backward reads the full tensors again. */
void cf_model_reset_filter(cf_model *m) {
    for (int i = 0; i < m->nsaved; i++) m->saved[i].cur = m->saved[i].full;
    m->filtered = 0;
}

/* -------------------------------------------------------------- forward */

cf_attn_shape cf_model_attn_shape(cf_model *m) {
    cf_attn_shape s;
    s.B = m->B; s.S = m->S;
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
    const int V = cf_model_config(m)->vocab_size;   /* the whole vocabulary (TP) */
    for (int64_t i = 0; i < (int64_t)B * (S + 1); i++)
        if (tokens[i] < 0 || tokens[i] >= V)
            return cf_fail("token id %d at position %lld is outside the vocabulary [0, %d)",
                           tokens[i], (long long)i, V);
    cf_backend *b = m->b;
    int T = B * S;
    memset(m->prof, 0, sizeof m->prof);
    m->prof_phase = 0;
    /* held LM head rows (dwpair.c) lie in the compact copies that a larger
     * micro-batch reallocates */
    if (T > m->cap_T && (cf_dwpair_flush(m) != 0 || alloc_acts(m, T) != 0)) return -1;
    cf_model_reset_filter(m);
    m->B = B; m->S = S; m->T = T;
    m->fwd_id++;               /* invalidates the kept rows of earlier forwards */
    /* LoRA dropout in training forwards only: a fresh counter, so fresh masks */
    m->drop_on = m->train && m->lora.rank > 0 && m->lora.dropout > 0;
    if (m->drop_on) m->drop_ctr = m->drop_next++;
    m->host_losses_fwd = 0;
    /* Issue 17: a forward that a backward follows (the trainer's) also
     * writes g = softmax - onehot [T, V] from the logits it computes anyway,
     * so that backward runs only dx = (dloss g) W and dW += (dloss g)^T x,
     * a third less than recomputing the logits. g is a saved slot, gathered
     * by the filter like the others, and allocated at the first such
     * forward (inference never pays for it); within the memory budget only. */
    const int save_g = m->bwd_follows && m->head_save &&
                       (uint64_t)m->cap_T * (uint64_t)c->vocab_size * b->act_size <= CF_HEAD_SAVE_MAX_BYTES;
    if (save_g && m->s_head < 0 &&
        (m->s_head = save_slot(m, "lm_head_grad", (size_t)c->vocab_size * b->act_size)) < 0)
        return -1;
    if (m->s_head >= 0) m->saved[m->s_head].gather = save_g;   /* nothing to gather without it */
    cf_stage_begin(m, CF_STAGE_FORWARD);

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
    /* the uploads wait for the compute stream, which may wait for the last
     * micro-batch's TP collectives: those first, with a deadline */
    int up = cf_tp_settle(m);
    if (up == 0) up = b->upload(b, m->saved[m->s_tokens].full, hin, (size_t)T * sizeof(int));
    if (up == 0) up = b->upload(b, m->saved[m->s_targets].full, htg, (size_t)T * sizeof(int));
    if (up == 0) up = b->upload(b, m->saved[m->s_pos].full, hpos, (size_t)T * sizeof(int));
    if (up == 0) up = b->upload(b, m->doc, hdoc, (size_t)T * sizeof(int));
    free(hin);
    if (up != 0) return -1;

    int L = c->num_hidden_layers, C = c->hidden_size, F = c->intermediate_size;
    int H = c->num_attention_heads, Hkv = c->num_key_value_heads, D = c->head_dim;
    int qd = H * D, kd = Hkv * D;
    const int *pos = m->saved[m->s_pos].full;
    cf_attn_shape shape = cf_model_attn_shape(m);

    /* TP: each rank looks up its vocabulary rows (zero elsewhere); the sum
     * over ranks is the embedding. Row-parallel o and down likewise give
     * partial sums that are all-reduced before the residual add. */
    const int tp = cf_tp_on(m), v0 = tp ? m->tp.vocab_start : 0, vn = tp ? m->tp.vocab_len : V;
    OP(CF_PROF_ELTWISE, b->embedding_fwd(b, m->saved[m->resid[0]].full, m->saved[m->s_tokens].full,
                     cf_weight(m, m->p_embed), T, C, v0, vn));
    if (tp && cf_tp_allreduce(m, m->saved[m->resid[0]].full, (size_t)T * C, CF_TP_ACT, CF_TP_FWD) != 0) return -1;
    /* under TP the residual adds stay separate ops (after the all-reduce),
     * each fused with the RMSNorm that reads its sum; normed: the layer's
     * input norm was done so by the layer before */
    int normed = 0;
    for (int l = 0; l < L; l++) {
        cf_layer_params *p = &m->lp[l];
        cf_layer_acts *a = &m->la[l];
        void *x = m->saved[m->resid[l]].full;
        void *ln1 = m->saved[a->ln1].full, *q = m->saved[a->q].full;
        void *xmid = m->saved[a->x_mid].full, *ln2 = m->saved[a->ln2].full;
        /* h = silu(gate) * up is not saved: the backward recomputes it */
        void *gate, *up, *h = m->d_h;
        const int ldgu = cf_gate_up(m, l, &gate, &up);
        if (!normed)
            OP(CF_PROF_NORM, b->rmsnorm_fwd(b, ln1, m->saved[a->rstd1].full, x, cf_weight(m, p->ln1), T, C, c->rms_norm_eps));
        normed = 0;
        if (p->fused_qkv) {
            /* q | k | v rows from one GEMM (no adapter; [bq; bk; bv] in
             * its epilogue), split into their slots with RoPE in one pass */
            void *qkv = m->qkv ? m->qkv : m->tmp;
            const void *bias = p->q.b >= 0 ? cf_weight(m, p->q.b) : NULL;
            OP(CF_PROF_GEMM, b->matmul_fwd(b, qkv, ln1, cf_weight(m, p->q.w), bias, T, C, qd + 2 * kd));
            OP(CF_PROF_ROPE, b->qkv_split_rope(b, q, a->k, a->v, qkv, pos, T, H, Hkv, m->inv_freq, D));
        } else {
            if (c->qk_norm) {
                void *qpre = m->saved[a->qpre].full, *kpre = m->saved[a->kpre].full;
                OP(CF_PROF_GEMM, cf_linear_fwd(m, &p->q, qpre, ln1, T, C, qd));
                OP(CF_PROF_GEMM, cf_linear_fwd(m, &p->k, kpre, ln1, T, C, kd));
                OP(CF_PROF_NORM, b->rmsnorm_fwd(b, q, m->saved[a->rstdq].full, qpre, cf_weight(m, p->qn), T * H, D, c->rms_norm_eps));
                OP(CF_PROF_NORM, b->rmsnorm_fwd(b, a->k, m->saved[a->rstdk].full, kpre, cf_weight(m, p->kn), T * Hkv, D, c->rms_norm_eps));
            } else {
                OP(CF_PROF_GEMM, cf_linear_fwd(m, &p->q, q, ln1, T, C, qd));
                OP(CF_PROF_GEMM, cf_linear_fwd(m, &p->k, a->k, ln1, T, C, kd));
            }
            OP(CF_PROF_GEMM, cf_linear_fwd(m, &p->v, a->v, ln1, T, C, kd));
            OP(CF_PROF_ROPE, b->rope_qk(b, q, pos, T, H, a->k, pos, T, Hkv, m->inv_freq, D, 0));
        }
        OP(CF_PROF_ATTN, b->attention_fwd(b, m->saved[a->att].full, m->saved[a->lse].full, q, a->k, a->v, &shape));
        /* x_mid = x + attn W_o^T: one GEMM with the add in its epilogue, except
         * under TP, where the partial sums are all-reduced before the add */
        if (tp) {
            OP(CF_PROF_GEMM, cf_linear_fwd(m, &p->o, m->tmp, m->saved[a->att].full, T, qd, C));
            if (cf_tp_allreduce(m, m->tmp, (size_t)T * C, CF_TP_ACT, CF_TP_FWD) != 0) return -1;
            OP(CF_PROF_NORM, b->add_rmsnorm_fwd(b, xmid, ln2, m->saved[a->rstd2].full, x, m->tmp, cf_weight(m, p->ln2),
                                                T, C, c->rms_norm_eps));
        } else {
            OP(CF_PROF_GEMM, cf_linear_fwd_residual(m, &p->o, xmid, m->saved[a->att].full, x, T, qd, C));
            OP(CF_PROF_NORM, b->rmsnorm_fwd(b, ln2, m->saved[a->rstd2].full, xmid, cf_weight(m, p->ln2), T, C,
                                            c->rms_norm_eps));
        }
        if (p->fused_gate_up) {
            /* [gate | up] rows = ln2 [Wg; Wu]^T, straight into the saved slot */
            OP(CF_PROF_GEMM, b->matmul_fwd(b, gate, ln2, cf_weight(m, p->gate.w), NULL, T, C, 2 * F));
        } else {
            OP(CF_PROF_GEMM, cf_linear_fwd(m, &p->gate, gate, ln2, T, C, F));
            OP(CF_PROF_GEMM, cf_linear_fwd(m, &p->up, up, ln2, T, C, F));
        }
        OP(CF_PROF_ELTWISE, b->swiglu_fwd(b, h, gate, up, T, F, ldgu));
        void *xnext = m->saved[m->resid[l + 1]].full;
        if (tp) {
            OP(CF_PROF_GEMM, cf_linear_fwd(m, &p->down, m->tmp, h, T, F, C));
            if (cf_tp_allreduce(m, m->tmp, (size_t)T * C, CF_TP_ACT, CF_TP_FWD) != 0) return -1;
            /* the norm that reads x_{l+1}: the next layer's input norm, or the final one */
            const int last = l + 1 == L;
            void *nout = m->saved[last ? m->s_lnf : m->la[l + 1].ln1].full;
            float *nrstd = m->saved[last ? m->s_rstdf : m->la[l + 1].rstd1].full;
            const void *nw = cf_weight(m, last ? m->p_norm : m->lp[l + 1].ln1);
            OP(CF_PROF_NORM, b->add_rmsnorm_fwd(b, xnext, nout, nrstd, xmid, m->tmp, nw, T, C, c->rms_norm_eps));
            normed = 1;
        } else {
            OP(CF_PROF_GEMM, cf_linear_fwd_residual(m, &p->down, xnext, h, xmid, T, F, C));
        }
    }
    if (!normed)
        OP(CF_PROF_NORM, b->rmsnorm_fwd(b, m->saved[m->s_lnf].full, m->saved[m->s_rstdf].full,
                                        m->saved[m->resid[L]].full, cf_weight(m, m->p_norm), T, C, c->rms_norm_eps));
    if (tp) {
        /* vocab-parallel cross-entropy: each rank's (max, sum of exp, target
         * logit) of its slice, gathered; every rank then combines the same
         * numbers in the same order, so all hold identical losses and select
         * identical rows */
        float *mine = m->tp_stats + (size_t)m->tp.rank * T * 3;
        OP(CF_PROF_LMHEAD, b->lmhead_stats_fwd(b, mine, m->saved[m->s_lnf].full, cf_weight(m, m->p_lm_head),
                           m->saved[m->s_targets].full, T, C, vn, v0));
        if (m->tp.allgather_f32(m->tp.ctx, m->tp_stats, (size_t)T * 3) != 0) return -1;
        OP(CF_PROF_LMHEAD, b->xent_combine(b, m->losses, m->saved[m->s_lse].full, m->tp_stats,
                           m->saved[m->s_targets].full, T, m->tp.size, V));
    } else if (save_g) {
        OP(CF_PROF_LMHEAD, b->lmhead_loss_fwd_grad(b, m->losses, m->saved[m->s_head].full, m->saved[m->s_lnf].full,
                           cf_weight(m, m->p_lm_head), m->saved[m->s_targets].full, T, C, c->vocab_size));
        m->head_g_fwd = m->fwd_id;
    } else {
        OP(CF_PROF_LMHEAD, b->lmhead_loss_fwd(b, m->losses, m->saved[m->s_lnf].full, cf_weight(m, m->p_lm_head),
                           m->saved[m->s_targets].full, T, C, c->vocab_size));
    }
    cf_stage_end(m, CF_STAGE_FORWARD);
    if (losses) {
        const float *h = cf_model_host_losses(m);
        if (!h) return -1;
        memcpy(losses, h, (size_t)T * sizeof(float));
    }
    return b->check(b);
}

int cf_model_logits_row(cf_model *m, int t, float *out) {
    if (cf_tp_on(m)) return cf_fail("logits: not available under tensor parallelism (each rank holds a slice)");
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
    return b->check(b);
}

