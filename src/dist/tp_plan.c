/* tp_plan.c — the tensor-parallel partition plan; see tp_plan.h. */
#include "dist/tp_plan.h"

#include <stdio.h>
#include <string.h>

#include "base/common.h"

const char *cf_tp_kind_name(cf_tp_kind k) {
    switch (k) {
    case CF_TP_REPLICATED: return "replicated";
    case CF_TP_COLUMN: return "column";
    case CF_TP_ROW: return "row";
    case CF_TP_VOCAB: return "vocab";
    }
    return "unknown";
}

/* ------------------------------------------------------------- the check */

static int divides(int tp, int x) { return x % tp == 0; }

/* "1, 2, 4, 8": every t <= CF_TP_MAX dividing H, Hkv and F. */
static void valid_list(const cf_config *c, char *buf, size_t cap) {
    size_t used = 0;
    buf[0] = 0;
    for (int t = 1; t <= CF_TP_MAX && t <= c->num_key_value_heads; t++) {
        if (!divides(t, c->num_attention_heads) || !divides(t, c->num_key_value_heads) ||
            !divides(t, c->intermediate_size))
            continue;
        int w = snprintf(buf + used, cap - used, "%s%d", used ? ", " : "", t);
        if (w < 0 || (size_t)w >= cap - used) break;
        used += (size_t)w;
    }
}

/* The shape fields the plan reads are positive (cf_config_validate holds
 * more; this keeps the plan safe on any input). */
static int shape_ok(const cf_config *c) {
    if (!c) return cf_fail("tensor parallel: no config");
    if (c->vocab_size < 1 || c->hidden_size < 1 || c->intermediate_size < 1 || c->num_hidden_layers < 1 ||
        c->num_attention_heads < 1 || c->num_key_value_heads < 1 || c->head_dim < 1)
        return cf_fail("tensor parallel: the config has a non-positive size (vocab %d, hidden %d, intermediate %d, "
                       "layers %d, heads %d, KV heads %d, head_dim %d)", c->vocab_size, c->hidden_size,
                       c->intermediate_size, c->num_hidden_layers, c->num_attention_heads, c->num_key_value_heads,
                       c->head_dim);
    if (c->num_attention_heads % c->num_key_value_heads != 0)
        return cf_fail("tensor parallel: num_attention_heads %d is not a multiple of num_key_value_heads %d",
                       c->num_attention_heads, c->num_key_value_heads);
    return 0;
}

int cf_tp_check(const cf_config *c, int tp) {
    if (shape_ok(c) != 0) return -1;
    if (tp < 1 || tp > CF_TP_MAX) return cf_fail("--tp %d is outside [1, %d]", tp, CF_TP_MAX);
    char bad[256] = "";
    size_t used = 0;
    struct { const char *what; int n; const char *why; } need[] = {
        {"num_attention_heads", c->num_attention_heads, "each rank takes whole query heads"},
        {"num_key_value_heads", c->num_key_value_heads, "GQA: each rank takes whole KV heads"},
        {"intermediate_size", c->intermediate_size, "each rank takes an equal slice of the MLP"},
    };
    for (size_t i = 0; i < sizeof need / sizeof need[0]; i++) {
        if (divides(tp, need[i].n)) continue;
        int w = snprintf(bad + used, sizeof bad - used, "%s%s %d (%s)", used ? ", " : "", need[i].what, need[i].n,
                         need[i].why);
        if (w > 0 && (size_t)w < sizeof bad - used) used += (size_t)w;
    }
    if (!used) return 0;
    char ok[256];
    valid_list(c, ok, sizeof ok);
    return cf_fail("--tp %d cannot split this %s model: %d does not divide %s; tp values that work: %s", tp,
                   cf_model_type_name(c->model_type), tp, bad, ok);
}

int64_t cf_tp_vocab_padded(const cf_config *c, int tp) {
    int64_t V = c->vocab_size, t = tp < 1 ? 1 : tp;
    return (V + t - 1) / t * t;
}

/* ---------------------------------------------------------- the tensors */

typedef enum {
    T_EMBED, T_LM_HEAD, T_NORM,   /* outside the layers */
    T_LN1, T_QW, T_QB, T_KW, T_KB, T_VW, T_VB, T_OW, T_OB, T_QN, T_KN, T_LN2, T_GATE, T_UP, T_DOWN,
} tensor_id;

/* One layer's tensors in build_param_table order (q/k/v biases after the
 * three weights). */
static const struct { tensor_id id; const char *suffix; } LAYER[] = {
    {T_LN1, "input_layernorm.weight"},
    {T_QW, "self_attn.q_proj.weight"}, {T_KW, "self_attn.k_proj.weight"}, {T_VW, "self_attn.v_proj.weight"},
    {T_QB, "self_attn.q_proj.bias"}, {T_KB, "self_attn.k_proj.bias"}, {T_VB, "self_attn.v_proj.bias"},
    {T_OW, "self_attn.o_proj.weight"}, {T_OB, "self_attn.o_proj.bias"},
    {T_QN, "self_attn.q_norm.weight"}, {T_KN, "self_attn.k_norm.weight"},
    {T_LN2, "post_attention_layernorm.weight"},
    {T_GATE, "mlp.gate_proj.weight"}, {T_UP, "mlp.up_proj.weight"}, {T_DOWN, "mlp.down_proj.weight"},
};
#define NUM_LAYER ((int)(sizeof LAYER / sizeof LAYER[0]))

static int present(const cf_config *c, tensor_id id) {
    switch (id) {
    case T_QB: case T_KB: case T_VB: return c->qkv_bias != 0;
    case T_OB: return c->o_bias != 0;
    case T_QN: case T_KN: return c->qk_norm != 0;
    case T_LM_HEAD: return !c->tie_word_embeddings;
    default: return 1;
    }
}

static int per_layer(const cf_config *c) {
    int n = 0;
    for (int i = 0; i < NUM_LAYER; i++) n += present(c, LAYER[i].id);
    return n;
}

int cf_tp_num_tensors(const cf_config *c) {
    return 2 + c->num_hidden_layers * per_layer(c) + present(c, T_LM_HEAD);
}

int cf_tp_tensor_name(const cf_config *c, int i, char *buf, size_t cap) {
    int n = cf_tp_num_tensors(c), pl = per_layer(c), L = c->num_hidden_layers, w;
    if (i < 0 || i >= n) return cf_fail("tensor parallel: tensor index %d is outside [0, %d)", i, n);
    if (i == 0) w = snprintf(buf, cap, "model.embed_tokens.weight");
    else if (i == 1 + L * pl) w = snprintf(buf, cap, "model.norm.weight");
    else if (i == 2 + L * pl) w = snprintf(buf, cap, "lm_head.weight");
    else {
        int l = (i - 1) / pl, k = (i - 1) % pl, j = 0;
        for (; j < NUM_LAYER; j++)
            if (present(c, LAYER[j].id) && k-- == 0) break;
        w = snprintf(buf, cap, "model.layers.%d.%s", l, LAYER[j].suffix);
    }
    if (w < 0 || (size_t)w >= cap) return cf_fail("tensor parallel: a tensor name does not fit in %zu bytes", cap);
    return 0;
}

/* The tensor called name: its id and layer, or -1 (cf_fail). */
static int parse_name(const cf_config *c, const char *name, tensor_id *id, int *layer) {
    if (!name) return cf_fail("tensor parallel: no tensor name");
    if (!strcmp(name, "model.embed_tokens.weight")) { *id = T_EMBED; *layer = -1; return 0; }
    if (!strcmp(name, "model.norm.weight")) { *id = T_NORM; *layer = c->num_hidden_layers; return 0; }
    if (!strcmp(name, "lm_head.weight")) {
        if (c->tie_word_embeddings)
            return cf_fail("tensor parallel: lm_head.weight is tied to model.embed_tokens.weight in this model "
                           "(split the embedding)");
        *id = T_LM_HEAD;
        *layer = c->num_hidden_layers;
        return 0;
    }
    static const char prefix[] = "model.layers.";
    if (!strncmp(name, prefix, sizeof prefix - 1)) {
        const char *p = name + sizeof prefix - 1;
        long l = 0;
        int digits = 0;
        for (; *p >= '0' && *p <= '9' && digits < 8; p++, digits++) l = l * 10 + (*p - '0');
        if (digits > 0 && *p == '.' && !(digits > 1 && p[-digits] == '0')) {
            if (l >= c->num_hidden_layers)
                return cf_fail("tensor parallel: '%.96s': layer %ld is past the model's %d layers", name, l,
                               c->num_hidden_layers);
            for (int j = 0; j < NUM_LAYER; j++) {
                if (strcmp(p + 1, LAYER[j].suffix) != 0) continue;
                if (!present(c, LAYER[j].id))
                    return cf_fail("tensor parallel: '%.96s' is not a parameter of this %s model (its config has "
                                   "no such bias or norm)", name, cf_model_type_name(c->model_type));
                *id = LAYER[j].id;
                *layer = (int)l;
                return 0;
            }
        }
    }
    if (strstr(name, "lora_"))
        return cf_fail("tensor parallel: '%.96s': LoRA adapters have no tensor-parallel plan", name);
    return cf_fail("tensor parallel: '%.96s' is not a parameter of this model", name);
}

/* -------------------------------------------------------------- splits */

static void set_shape(cf_tp_slice *s, int64_t d0, int64_t d1) {
    s->ndim = d1 > 0 ? 2 : 1;
    s->shape[0] = d0;
    s->shape[1] = d1 > 0 ? d1 : 0;
}

static void finish(cf_tp_slice *s) {
    if (s->kind == CF_TP_REPLICATED) {
        s->dim = -1;
        s->start = 0;
        s->len = s->shape[0];
        s->local_shape[0] = s->shape[0];
        s->local_shape[1] = s->shape[1];
    }
    s->local_numel = s->local_shape[0] * (s->ndim == 2 ? s->local_shape[1] : 1);
}

/* Rows [start, start+len) of [d0, d1] (a bias when d1 = 0). */
static void column(cf_tp_slice *s, int64_t d0, int64_t d1, int64_t start, int64_t len) {
    s->kind = CF_TP_COLUMN;
    set_shape(s, d0, d1);
    s->dim = 0;
    s->start = start;
    s->len = len;
    s->local_shape[0] = len;
    s->local_shape[1] = s->shape[1];
}

/* Columns [start, start+len) of [d0, d1]. */
static void row(cf_tp_slice *s, int64_t d0, int64_t d1, int64_t start, int64_t len) {
    s->kind = CF_TP_ROW;
    set_shape(s, d0, d1);
    s->dim = 1;
    s->start = start;
    s->len = len;
    s->local_shape[0] = d0;
    s->local_shape[1] = len;
}

int cf_tp_split(const cf_config *c, int tp, const char *name, int rank, cf_tp_slice *out) {
    if (cf_tp_check(c, tp) != 0) return -1;
    if (rank < 0 || rank >= tp) return cf_fail("tensor parallel: rank %d is outside [0, %d)", rank, tp);
    tensor_id id = T_EMBED;
    int layer = -1;
    if (parse_name(c, name, &id, &layer) != 0) return -1;
    cf_tp_slice s;
    memset(&s, 0, sizeof s);
    s.layer = layer;
    const int64_t C = c->hidden_size, D = c->head_dim, F = c->intermediate_size;
    const int H = c->num_attention_heads, Hkv = c->num_key_value_heads;
    const int hq = H / tp, hkv = Hkv / tp;
    const int64_t qd = (int64_t)H * D, kd = (int64_t)Hkv * D, f = F / tp;
    switch (id) {
    case T_EMBED:
    case T_LM_HEAD: {
        const int64_t V = c->vocab_size, Vl = cf_tp_vocab_padded(c, tp) / tp, lo = (int64_t)rank * Vl;
        int64_t real = V - lo;
        real = real < 0 ? 0 : real > Vl ? Vl : real;
        s.kind = CF_TP_VOCAB;
        set_shape(&s, V, C);
        s.dim = 0;
        s.start = lo < V ? lo : V;
        s.len = real;
        s.local_shape[0] = Vl;
        s.local_shape[1] = C;
        s.pad = Vl - real;
        break;
    }
    case T_NORM: case T_LN1: case T_LN2:
        s.kind = CF_TP_REPLICATED;
        set_shape(&s, C, 0);
        break;
    case T_QN: case T_KN:
        s.kind = CF_TP_REPLICATED;
        set_shape(&s, D, 0);
        s.grad_allreduce = 1;
        break;
    case T_OB:
        s.kind = CF_TP_REPLICATED;
        set_shape(&s, C, 0);
        s.after_allreduce = 1;
        break;
    case T_QW: case T_QB:
        column(&s, qd, id == T_QW ? C : 0, (int64_t)rank * hq * D, hq * D);
        s.head_start = rank * hq;
        s.heads = hq;
        break;
    case T_KW: case T_KB: case T_VW: case T_VB:
        column(&s, kd, id == T_KW || id == T_VW ? C : 0, (int64_t)rank * hkv * D, hkv * D);
        s.head_start = rank * hkv;
        s.heads = hkv;
        break;
    case T_OW:
        row(&s, C, qd, (int64_t)rank * hq * D, hq * D);
        s.head_start = rank * hq;
        s.heads = hq;
        break;
    case T_GATE: case T_UP:
        column(&s, F, C, rank * f, f);
        break;
    case T_DOWN:
        row(&s, C, F, rank * f, f);
        break;
    }
    finish(&s);
    *out = s;
    return 0;
}

int cf_tp_local_config(const cf_config *c, int tp, int rank, cf_tp_local *out) {
    if (cf_tp_check(c, tp) != 0) return -1;
    if (rank < 0 || rank >= tp) return cf_fail("tensor parallel: rank %d is outside [0, %d)", rank, tp);
    cf_tp_local l;
    memset(&l, 0, sizeof l);
    l.tp = tp;
    l.rank = rank;
    l.hidden = c->hidden_size;
    l.head_dim = c->head_dim;
    l.heads = c->num_attention_heads / tp;
    l.head_start = rank * l.heads;
    l.kv_heads = c->num_key_value_heads / tp;
    l.kv_head_start = rank * l.kv_heads;
    l.q_dim = l.heads * c->head_dim;
    l.kv_dim = l.kv_heads * c->head_dim;
    l.intermediate = c->intermediate_size / tp;
    l.ffn_start = rank * l.intermediate;
    l.vocab_size = c->vocab_size;
    l.vocab_padded = (int)cf_tp_vocab_padded(c, tp);
    l.vocab_local = l.vocab_padded / tp;
    int lo = rank * l.vocab_local, real = c->vocab_size - lo;
    l.vocab_start = lo < c->vocab_size ? lo : c->vocab_size;
    l.vocab_len = real < 0 ? 0 : real > l.vocab_local ? l.vocab_local : real;
    int n = cf_tp_num_tensors(c);
    for (int i = 0; i < n; i++) {
        char name[128];
        cf_tp_slice s;
        if (cf_tp_tensor_name(c, i, name, sizeof name) != 0 || cf_tp_split(c, tp, name, rank, &s) != 0) return -1;
        l.params += s.local_numel;
    }
    *out = l;
    return 0;
}

const char *cf_tp_describe(const cf_config *c, int tp, char *buf, size_t cap) {
    if (!buf || cap == 0) return buf;
    if (tp < 1 || cf_tp_check(c, tp) != 0) {
        snprintf(buf, cap, "tp %d: cannot split this model", tp);
        return buf;
    }
    int64_t Vp = cf_tp_vocab_padded(c, tp);
    int n = snprintf(buf, cap, "tp %d: %d of %d heads, %d of %d KV heads, %d of %d FFN, vocab %d", tp,
                     c->num_attention_heads / tp, c->num_attention_heads, c->num_key_value_heads / tp,
                     c->num_key_value_heads, c->intermediate_size / tp, c->intermediate_size, c->vocab_size);
    if (n < 0 || (size_t)n >= cap) return buf;
    if (Vp == c->vocab_size)
        snprintf(buf + n, cap - (size_t)n, " (%lld rows per rank)", (long long)(Vp / tp));
    else
        snprintf(buf + n, cap - (size_t)n, " padded to %lld (%lld rows per rank; the last %lld rows are padding)",
                 (long long)Vp, (long long)(Vp / tp), (long long)(Vp - c->vocab_size));
    return buf;
}

/* ------------------------------------------------------ extract, insert */

/* Copies the rank's rows/columns between the full and the local tensor:
 * to_local = 1 extracts, 0 inserts. */
static void move(const cf_tp_slice *s, void *full, void *local, size_t elem, int to_local) {
    unsigned char *F = full, *Lc = local;
    const int64_t cols = s->ndim == 2 ? s->shape[1] : 1;
    if (s->kind == CF_TP_REPLICATED || s->kind == CF_TP_COLUMN || s->kind == CF_TP_VOCAB) {
        /* a contiguous run of whole rows */
        size_t bytes = (size_t)(s->len * cols) * elem;
        unsigned char *f = F + (size_t)(s->start * cols) * elem;
        if (to_local) {
            if (bytes) memcpy(Lc, f, bytes);
            size_t pad = (size_t)(s->pad * cols) * elem;
            if (pad) memset(Lc + bytes, 0, pad);
        } else if (bytes) {
            memcpy(f, Lc, bytes);
        }
        return;
    }
    /* CF_TP_ROW: columns [start, start+len) of every row */
    size_t run = (size_t)s->len * elem;
    for (int64_t r = 0; r < s->shape[0]; r++) {
        unsigned char *f = F + (size_t)(r * cols + s->start) * elem, *l = Lc + (size_t)r * run;
        if (to_local) memcpy(l, f, run);
        else memcpy(f, l, run);
    }
}

void cf_tp_extract(const cf_tp_slice *s, const void *full, void *local, size_t elem) {
    move(s, (void *)full, local, elem, 1);
}

void cf_tp_insert(const cf_tp_slice *s, const void *local, void *full, size_t elem) {
    move(s, full, (void *)local, elem, 0);
}

/* ------------------------------------------------------- communication */

int cf_tp_comm_detail(const cf_config *c, int tp, int64_t T, int64_t n, int act_bytes, cf_tp_comm *out) {
    if (cf_tp_check(c, tp) != 0) return -1;
    if (T < 1 || T > ((int64_t)1 << 40) || n < 1 || n > T)
        return cf_fail("tensor parallel: %lld rows of %lld tokens is not a valid backward (1 <= n <= T <= 2^40)",
                       (long long)n, (long long)T);
    if (act_bytes < 1 || act_bytes > 8) return cf_fail("tensor parallel: %d bytes per element", act_bytes);
    cf_tp_comm m;
    memset(&m, 0, sizeof m);
    if (tp > 1) {
        const int64_t L = c->num_hidden_layers, C = c->hidden_size, A = act_bytes;
        m.fwd_layers = 2 * L * T * C * A;
        m.fwd_embed = T * C * A;
        m.fwd_xent = 3 * T * 4;
        m.bwd_layers = 2 * L * n * C * A;
        m.bwd_lm_head = n * C * A;
        m.fwd_calls = (int)(2 * L + 1 + 3);
        m.bwd_calls = (int)(2 * L + 1);
        if (c->qk_norm) m.step_qk_norm = 2 * L * (int64_t)c->head_dim * 4;
    }
    m.fwd = m.fwd_layers + m.fwd_embed + m.fwd_xent;
    m.bwd = m.bwd_layers + m.bwd_lm_head;
    *out = m;
    return 0;
}

int cf_tp_comm_bytes(const cf_config *c, int tp, int64_t T, int64_t n, int act_bytes, int64_t *fwd, int64_t *bwd) {
    cf_tp_comm m;
    if (cf_tp_comm_detail(c, tp, T, n, act_bytes, &m) != 0) return -1;
    if (fwd) *fwd = m.fwd;
    if (bwd) *bwd = m.bwd;
    return 0;
}

int64_t cf_tp_ring_bytes(int64_t payload, int tp) {
    if (tp <= 1 || payload <= 0) return 0;
    return payload / tp * 2 * (tp - 1) + payload % tp * 2 * (tp - 1) / tp;
}

/* --------------------------------------------------------------- memory */

int cf_tp_memory(const cf_config *c, const cf_tp_mem_opts *o, cf_tp_mem *out) {
    if (!o || !out) return cf_fail("tensor parallel memory: NULL argument");
    if (cf_tp_check(c, o->tp) != 0) return -1;
    if (o->dp < 1 || o->dp > 65536) return cf_fail("tensor parallel memory: %d data-parallel ranks", o->dp);
    if (o->batch < 1 || o->seq < 1 || o->batch > ((int64_t)1 << 20) || o->seq > ((int64_t)1 << 24))
        return cf_fail("tensor parallel memory: micro-batch %lld x %lld is out of range", (long long)o->batch,
                       (long long)o->seq);
    if (o->act_bytes < 1 || o->act_bytes > 8) return cf_fail("tensor parallel memory: %d bytes per element", o->act_bytes);
    cf_tp_local loc;
    if (cf_tp_local_config(c, o->tp, 0, &loc) != 0) return -1;
    cf_tp_mem m;
    memset(&m, 0, sizeof m);
    const uint64_t A = (uint64_t)o->act_bytes, t = (uint64_t)o->tp, P = (uint64_t)loc.params;
    m.params = loc.params;
    m.weights = P * A;
    m.grads = P * 4;
    m.optimizer = (P + (uint64_t)o->dp - 1) / (uint64_t)o->dp * 12;

    /* Per token: memest.c's saved_row_bytes and backward scratch, with every
     * per-head or per-FFN-column tensor divided by tp and the rest (the
     * residual stream, the norms' inputs and outputs) whole on every rank. */
    const uint64_t L = (uint64_t)c->num_hidden_layers, C = (uint64_t)c->hidden_size, F = (uint64_t)c->intermediate_size;
    const uint64_t H = (uint64_t)c->num_attention_heads, Hkv = (uint64_t)c->num_key_value_heads;
    const uint64_t qd = H * (uint64_t)c->head_dim, kd = Hkv * (uint64_t)c->head_dim;
    uint64_t rep_layer = 3 * C * A + 2 * 4;                 /* x_mid, ln1, ln2; rstd1, rstd2 */
    uint64_t split_layer = 2 * qd * A + H * 4;              /* q, attn out; lse */
    if (c->qk_norm) split_layer += qd * A + H * 4 + kd * A + Hkv * 4;
    uint64_t gathered = (L + 1) * C * A + L * rep_layer + C * A + 4 + 3 * 4 + L * split_layer / t;
    uint64_t other = L * (2 * F * A + 2 * kd * A) / t;     /* gate, up, K, V: never compacted */
    uint64_t row_b = gathered + other;
    if (o->compact) row_b += (uint64_t)((double)gathered * (o->keep > 0 && o->keep < 1 ? o->keep : 1.0) + 0.5);
    uint64_t wide = C;
    if (qd / t > wide) wide = qd / t;
    if (F / t > wide) wide = F / t;
    row_b += 2 * C * A + (3 * qd + 3 * kd + 3 * F) * A / t + wide * A + 3 * 4 + 1 + 3 * 4 + 4;
    m.act_per_token = row_b;
    const uint64_t T = (uint64_t)o->batch * (uint64_t)o->seq;
    m.activations = T * row_b;
    /* the logits chunk: rows of the local vocabulary, bf16 logits + fp32, <= 1.5 GiB */
    uint64_t Vl = (uint64_t)loc.vocab_local, rows = ((uint64_t)3 << 29) / (Vl * 6);
    if (rows < 1) rows = 1;
    if (rows > T) rows = T;
    m.logits = rows * Vl * 6;
    m.reserve = o->reserve;
    m.total = m.weights + m.grads + m.optimizer + m.activations + m.logits + m.reserve;
    *out = m;
    return 0;
}
