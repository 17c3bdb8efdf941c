/*
 * config.c — model configuration: HF config.json in and out, built-in named
 * configs, validation and the exact parameter count.
 *
 * Reading follows what transformers does with the same file, so that a
 * config.json means the same model to both of us:
 *   - model_type picks the family (llama, mistral, qwen2, qwen3); anything
 *     else is refused, as is any feature that would change the math and that
 *     the engine does not implement (mlp_bias, rope types other than llama3,
 *     sliding-window layers in qwen2/qwen3, quantized checkpoints, ...).
 *   - RoPE is read from transformers 5's "rope_parameters" or from the older
 *     "rope_theta" + "rope_scaling" (transformers 5 still accepts both; when
 *     "rope_scaling" is a dict it wins, as it does there).
 *   - Every value is type-checked: a string where a number belongs is an
 *     error that names the key. Duplicate keys are errors (Python's json
 *     keeps the last, cJSON the first: refuse rather than guess).
 *
 * Writing produces a config.json that transformers 4.4x and 5.x both load:
 * legacy "rope_theta"/"rope_scaling" plus v5's "rope_parameters", "dtype"
 * plus the older "torch_dtype". Floats are printed as the shortest decimal
 * that reads back to the same fp32 value, so save -> load is exact.
 */
#include "base/common.h"
#include "formats/json_util.h"

#include <cjson/cJSON.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

/* A config.json is a few KB; anything over this is not a config. */
#define CONFIG_MAX_BYTES (4u << 20)

/* Sanity bounds. Generous (Llama 3.1 405B fits with room to spare), but they
 * keep every size product far from int overflow in the rest of the engine. */
#define MAX_VOCAB      (1 << 24)
#define MAX_HIDDEN     (1 << 16)
#define MAX_FFN        (1 << 18)
#define MAX_LAYERS     1024
#define MAX_HEADS      1024
#define MAX_HEAD_DIM   1024
#define MAX_POSITIONS  (1 << 24)
#define MAX_TENSOR_ELEMS ((int64_t)INT32_MAX)   /* < 2^31 elements per tensor */

const char *cf_model_type_name(cf_model_type t) {
    switch (t) {
    case CF_MODEL_LLAMA: return "llama";
    case CF_MODEL_MISTRAL: return "mistral";
    case CF_MODEL_QWEN2: return "qwen2";
    case CF_MODEL_QWEN3: return "qwen3";
    }
    return "unknown";
}

static const char *architecture_name(cf_model_type t) {
    switch (t) {
    case CF_MODEL_LLAMA: return "LlamaForCausalLM";
    case CF_MODEL_MISTRAL: return "MistralForCausalLM";
    case CF_MODEL_QWEN2: return "Qwen2ForCausalLM";
    case CF_MODEL_QWEN3: return "Qwen3ForCausalLM";
    }
    return "unknown";
}

/* ---------------------------------------------------------------- builtins */

/* One row per named config, every field spelled out so that nothing is left
 * at an accidental zero (bos/eos 0 would be a valid token id). Values are
 * the published HF config.json values of each model. */
typedef struct {
    const char *name;
    cf_model_type type;
    int V, C, F, L, H, Hkv, D, maxpos;
    float eps, theta;
    int tied, qkv_bias, o_bias, qk_norm;
    int llama3;
    float factor, low, high;
    int orig;
    int bos, eos;
} builtin_row;

static const builtin_row g_builtins[] = {
    /* name            type              V       C     F      L   H   Hkv D    maxpos  eps   theta  tie qkv o  qkn  l3 fac  lo  hi  orig  bos     eos */
    {"tiny",           CF_MODEL_LLAMA,   320,    128,  384,   4,  4,  2,  32,  1024,   1e-5f, 1e4f, 1,  0,  0, 0,   0, 0,   0,  0,  0,    256,    257},
    {"cpu-20m",        CF_MODEL_LLAMA,   8192,   512,  1536,  6,  8,  2,  64,  2048,   1e-5f, 1e4f, 1,  0,  0, 0,   0, 0,   0,  0,  0,    -1,     -1},
    /* the utility experiment's model: byte vocabulary, ~25M parameters */
    {"math-25m",       CF_MODEL_LLAMA,   320,    512,  1536,  8,  8,  4,  64,  2048,   1e-5f, 1e4f, 1,  0,  0, 0,   0, 0,   0,  0,  0,    256,    257},
    {"tinyllama-1.1b", CF_MODEL_LLAMA,   32000,  2048, 5632,  22, 32, 4,  64,  2048,   1e-5f, 1e4f, 0,  0,  0, 0,   0, 0,   0,  0,  0,    1,      2},
    {"qwen2.5-1.5b",   CF_MODEL_QWEN2,   151936, 1536, 8960,  28, 12, 2,  128, 32768,  1e-6f, 1e6f, 1,  1,  0, 0,   0, 0,   0,  0,  0,    151643, 151643},
    {"llama3.2-3b",    CF_MODEL_LLAMA,   128256, 3072, 8192,  28, 24, 8,  128, 131072, 1e-5f, 5e5f, 1,  0,  0, 0,   1, 32,  1,  4,  8192, 128000, 128001},
    {"qwen2.5-7b",     CF_MODEL_QWEN2,   152064, 3584, 18944, 28, 28, 4,  128, 32768,  1e-6f, 1e6f, 0,  1,  0, 0,   0, 0,   0,  0,  0,    151643, 151643},
    {"llama3.1-8b",    CF_MODEL_LLAMA,   128256, 4096, 14336, 32, 32, 8,  128, 131072, 1e-5f, 5e5f, 0,  0,  0, 0,   1, 8,   1,  4,  8192, 128000, 128001},
    /* the paper's 8-GPU rows (issue 20): Qwen/Qwen3-14B and Qwen/Qwen3-32B config.json; BSC-LT/ALIA-40b's
     * shape from its model card (48 x 8192, 64 heads, 8 KV groups, vocab 256000, 40,433,885,184 parameters,
     * which with untied embeddings gives F = 24576); its theta/eps are the Salamandra family's (unverified) */
    {"qwen3-14b",      CF_MODEL_QWEN3,   151936, 5120, 17408, 40, 40, 8,  128, 40960,  1e-6f, 1e6f, 0,  0,  0, 1,   0, 0,   0,  0,  0,    151643, 151645},
    {"qwen3-32b",      CF_MODEL_QWEN3,   151936, 5120, 25600, 64, 64, 8,  128, 40960,  1e-6f, 1e6f, 0,  0,  0, 1,   0, 0,   0,  0,  0,    151643, 151645},
    {"alia-40b",       CF_MODEL_LLAMA,   256000, 8192, 24576, 48, 64, 8,  128, 32768,  1e-5f, 1e4f, 0,  0,  0, 0,   0, 0,   0,  0,  0,    1,      2},
    /* 2-layer configs for gradient checks, one per model_type. tiny-llama
     * turns on llama3 scaling so that code path is exercised; tiny-qwen3 has
     * an explicit head_dim with H*D != C. */
    {"tiny-llama",     CF_MODEL_LLAMA,   64,     32,   48,    2,  4,  2,  8,   128,    1e-5f, 1e4f, 0,  0,  0, 0,   1, 8,   1,  4,  16,   -1,     -1},
    {"tiny-mistral",   CF_MODEL_MISTRAL, 64,     32,   48,    2,  4,  2,  8,   128,    1e-5f, 1e4f, 0,  0,  0, 0,   0, 0,   0,  0,  0,    -1,     -1},
    {"tiny-qwen2",     CF_MODEL_QWEN2,   64,     32,   48,    2,  4,  2,  8,   128,    1e-6f, 1e4f, 1,  1,  0, 0,   0, 0,   0,  0,  0,    -1,     -1},
    {"tiny-qwen3",     CF_MODEL_QWEN3,   64,     32,   48,    2,  4,  2,  16,  128,    1e-6f, 1e4f, 0,  0,  0, 1,   0, 0,   0,  0,  0,    -1,     -1},
};
#define NUM_BUILTINS ((int)(sizeof g_builtins / sizeof g_builtins[0]))

/* Kept in sync with g_builtins by a test. */
const char *cf_config_builtin_names(void) {
    return "tiny, cpu-20m, math-25m, tinyllama-1.1b, qwen2.5-1.5b, llama3.2-3b, qwen2.5-7b, llama3.1-8b, "
           "qwen3-14b, qwen3-32b, alia-40b, tiny-llama, tiny-mistral, tiny-qwen2, tiny-qwen3";
}

int cf_config_builtin(cf_config *cfg, const char *name) {
    if (!cfg || !name) return cf_fail("config: no name given (built-in configs: %s)", cf_config_builtin_names());
    for (int i = 0; i < NUM_BUILTINS; i++) {
        const builtin_row *r = &g_builtins[i];
        if (strcmp(r->name, name) != 0) continue;
        cf_config c;
        memset(&c, 0, sizeof c);
        c.model_type = r->type;
        c.vocab_size = r->V;
        c.hidden_size = r->C;
        c.intermediate_size = r->F;
        c.num_hidden_layers = r->L;
        c.num_attention_heads = r->H;
        c.num_key_value_heads = r->Hkv;
        c.head_dim = r->D;
        c.max_position_embeddings = r->maxpos;
        c.rms_norm_eps = r->eps;
        c.rope_theta = r->theta;
        c.tie_word_embeddings = r->tied;
        c.qkv_bias = r->qkv_bias;
        c.o_bias = r->o_bias;
        c.qk_norm = r->qk_norm;
        c.rope_llama3 = r->llama3;
        c.rope_factor = r->factor;
        c.rope_low_freq_factor = r->low;
        c.rope_high_freq_factor = r->high;
        c.rope_original_max_pos = r->orig;
        c.sliding_window = 0;
        c.bos_token_id = r->bos;
        c.eos_token_id = r->eos;
        *cfg = c;
        return 0;
    }
    return cf_fail("config: unknown built-in config '%.64s' (built-in configs: %s)", name,
                   cf_config_builtin_names());   /* name comes from the CLI, not a file */
}

/* -------------------------------------------------------------- validation */

/* A token-id list of config.json (bos_token_id or eos_token_id given as a
 * list): every item, not only the first (which is the id), must be an id of
 * the vocabulary. The items are known integers (get_token_id). */
static int check_id_list(const char *what, const char *key, const cJSON *list, int vocab) {
    int i = 0;
    for (const cJSON *e = list->child; e; e = e->next, i++) {
        int id = (int)e->valuedouble;
        if (id < 0 || id >= vocab)
            return cf_fail("%s: %s[%d] = %d is outside the vocabulary (0..%d)", what, key, i, id, vocab - 1);
    }
    return 0;
}

/* `what` names the source in messages: a file path or "config". bos_list,
 * eos_list: the lists config.json gave for these ids (NULL: a plain id, or
 * a config not read from a file). */
static int validate_named(const cf_config *c, const char *what, const cJSON *bos_list, const cJSON *eos_list) {
    if ((unsigned)c->model_type > (unsigned)CF_MODEL_QWEN3)
        return cf_fail("%s: invalid model_type %d", what, (int)c->model_type);

#define CHECK_RANGE(field, lo, hi)                                                          \
    do {                                                                                    \
        if (c->field < (lo) || c->field > (hi))                                             \
            return cf_fail("%s: " #field " = %d is outside [%d, %d]", what, c->field,       \
                           (int)(lo), (int)(hi));                                           \
    } while (0)
    CHECK_RANGE(vocab_size, 1, MAX_VOCAB);
    CHECK_RANGE(hidden_size, 1, MAX_HIDDEN);
    CHECK_RANGE(intermediate_size, 1, MAX_FFN);
    CHECK_RANGE(num_hidden_layers, 1, MAX_LAYERS);
    CHECK_RANGE(num_attention_heads, 1, MAX_HEADS);
    CHECK_RANGE(num_key_value_heads, 1, MAX_HEADS);
    CHECK_RANGE(head_dim, 2, MAX_HEAD_DIM);
    CHECK_RANGE(max_position_embeddings, 1, MAX_POSITIONS);
    CHECK_RANGE(sliding_window, 0, INT_MAX);
    if (bos_list) {
        if (check_id_list(what, "bos_token_id", bos_list, c->vocab_size) != 0) return -1;
    } else {
        CHECK_RANGE(bos_token_id, -1, c->vocab_size - 1);
    }
    if (eos_list) {
        if (check_id_list(what, "eos_token_id", eos_list, c->vocab_size) != 0) return -1;
    } else {
        CHECK_RANGE(eos_token_id, -1, c->vocab_size - 1);
    }
    CHECK_RANGE(num_extra_eos, 0, CF_MAX_EOS_IDS - 1);
#undef CHECK_RANGE
    if (c->num_extra_eos > 0 && c->eos_token_id < 0)
        return cf_fail("%s: %d further eos ids but no eos_token_id", what, c->num_extra_eos);
    for (int i = 0; i < c->num_extra_eos; i++)
        if (c->extra_eos_ids[i] < 0 || c->extra_eos_ids[i] >= c->vocab_size)
            return cf_fail("%s: eos_token_id[%d] = %d is outside the vocabulary (0..%d)", what, i + 1,
                           c->extra_eos_ids[i], c->vocab_size - 1);

    if (c->num_attention_heads % c->num_key_value_heads != 0)
        return cf_fail("%s: num_attention_heads %d is not a multiple of num_key_value_heads %d",
                       what, c->num_attention_heads, c->num_key_value_heads);
    /* RoPE rotates pairs (rotate-half), so the head dimension must be even. */
    if (c->head_dim % 2 != 0)
        return cf_fail("%s: head_dim %d is odd; RoPE needs an even head dimension", what, c->head_dim);

    /* Every weight matrix must stay below 2^31 elements: kernels index
     * tensors with int, and nothing real comes close. */
    struct { const char *name; int64_t n; } tensors[] = {
        {"embed_tokens (vocab_size x hidden_size)", (int64_t)c->vocab_size * c->hidden_size},
        {"mlp (intermediate_size x hidden_size)", (int64_t)c->intermediate_size * c->hidden_size},
        {"q_proj (num_attention_heads*head_dim x hidden_size)",
         (int64_t)c->num_attention_heads * c->head_dim * c->hidden_size},
    };
    for (size_t i = 0; i < sizeof tensors / sizeof tensors[0]; i++)
        if (tensors[i].n > MAX_TENSOR_ELEMS)
            return cf_fail("%s: %s has %lld elements, more than the supported 2^31 - 1", what,
                           tensors[i].name, (long long)tensors[i].n);

    if (!(isfinite(c->rms_norm_eps) && c->rms_norm_eps > 0 && c->rms_norm_eps < 1))
        return cf_fail("%s: rms_norm_eps = %g must be in (0, 1)", what, (double)c->rms_norm_eps);
    if (!(isfinite(c->rope_theta) && c->rope_theta >= 1 && c->rope_theta <= 1e12f))
        return cf_fail("%s: rope_theta = %g must be in [1, 1e12]", what, (double)c->rope_theta);

    int flags[] = {c->tie_word_embeddings, c->qkv_bias, c->o_bias, c->qk_norm, c->rope_llama3};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++)
        if (flags[i] != 0 && flags[i] != 1)
            return cf_fail("%s: boolean fields must be 0 or 1", what);

    if (c->rope_llama3) {
        if (!(isfinite(c->rope_factor) && c->rope_factor >= 1))
            return cf_fail("%s: rope_scaling.factor = %g must be >= 1", what, (double)c->rope_factor);
        if (!(isfinite(c->rope_low_freq_factor) && c->rope_low_freq_factor > 0))
            return cf_fail("%s: rope_scaling.low_freq_factor = %g must be > 0", what,
                           (double)c->rope_low_freq_factor);
        /* The llama3 smoothing divides by (high - low). */
        if (!(isfinite(c->rope_high_freq_factor) && c->rope_high_freq_factor > c->rope_low_freq_factor))
            return cf_fail("%s: rope_scaling.high_freq_factor = %g must be > low_freq_factor = %g", what,
                           (double)c->rope_high_freq_factor, (double)c->rope_low_freq_factor);
        if (c->rope_original_max_pos < 1 || c->rope_original_max_pos > MAX_POSITIONS)
            return cf_fail("%s: rope_scaling.original_max_position_embeddings = %d is outside [1, %d]",
                           what, c->rope_original_max_pos, MAX_POSITIONS);
    }

    /* The bias/norm flags are not free: each model_type has a fixed layout
     * in transformers, and a config that cannot be written back as a
     * config.json transformers understands is refused here. */
    const char *mt = cf_model_type_name(c->model_type);
    switch (c->model_type) {
    case CF_MODEL_QWEN2:
        if (!c->qkv_bias || c->o_bias || c->qk_norm)
            return cf_fail("%s: qwen2 has q/k/v biases, no o_proj bias and no q/k norm "
                           "(got qkv_bias=%d o_bias=%d qk_norm=%d)", what, c->qkv_bias, c->o_bias, c->qk_norm);
        break;
    case CF_MODEL_QWEN3:
        if (!c->qk_norm)
            return cf_fail("%s: qwen3 always has q/k norms (qk_norm must be 1)", what);
        if (c->qkv_bias != c->o_bias)
            return cf_fail("%s: qwen3 attention_bias puts biases on q, k, v and o alike "
                           "(got qkv_bias=%d o_bias=%d)", what, c->qkv_bias, c->o_bias);
        break;
    case CF_MODEL_LLAMA:
        if (c->qk_norm) return cf_fail("%s: %s has no q/k norm (qk_norm must be 0)", what, mt);
        if (c->qkv_bias != c->o_bias)
            return cf_fail("%s: llama attention_bias puts biases on q, k, v and o alike "
                           "(got qkv_bias=%d o_bias=%d)", what, c->qkv_bias, c->o_bias);
        break;
    case CF_MODEL_MISTRAL:
        if (c->qk_norm || c->qkv_bias || c->o_bias)
            return cf_fail("%s: mistral has no attention biases and no q/k norm", what);
        break;
    }
    if (c->sliding_window != 0 && c->model_type != CF_MODEL_MISTRAL)
        return cf_fail("%s: sliding_window is only supported for mistral", what);
    return 0;
}

int cf_config_validate(const cf_config *cfg) {
    if (!cfg) return cf_fail("config: NULL");
    return validate_named(cfg, "config", NULL, NULL);
}

size_t cf_config_num_params(const cf_config *c) {
    size_t V = (size_t)c->vocab_size, C = (size_t)c->hidden_size, F = (size_t)c->intermediate_size;
    size_t H = (size_t)c->num_attention_heads, Hkv = (size_t)c->num_key_value_heads, D = (size_t)c->head_dim;
    size_t layer = 2 * C;                                  /* input + post-attention RMSNorm */
    layer += C * H * D + C * Hkv * D * 2 + H * D * C;      /* q, k, v, o weights             */
    if (c->qkv_bias) layer += H * D + 2 * Hkv * D;
    if (c->o_bias) layer += C;
    if (c->qk_norm) layer += 2 * D;                        /* q_norm, k_norm (per head_dim)  */
    layer += 3 * C * F;                                    /* gate, up, down                 */
    size_t n = V * C + (size_t)c->num_hidden_layers * layer + C;   /* embed, layers, final norm */
    if (!c->tie_word_embeddings) n += V * C;               /* lm_head                        */
    return n;
}

/* ---------------------------------------------------------------- loading */


/* Present and not null. */
static const cJSON *get(const cJSON *obj, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return (v && !cJSON_IsNull(v)) ? v : NULL;
}

/* Reads an integer value; `key` is the name shown in messages. */
static int as_int(const char *path, const char *key, const cJSON *v, int *out) {
    if (!cJSON_IsNumber(v))
        return cf_fail("%s: '%s' must be an integer, got %s", path, key, cf_json_kind(v));
    double d = v->valuedouble;
    if (!isfinite(d) || d != floor(d))
        return cf_fail("%s: '%s' must be an integer, got %g", path, key, d);
    if (d < INT_MIN || d > INT_MAX)
        return cf_fail("%s: '%s' = %g is out of range", path, key, d);
    *out = (int)d;
    return 0;
}

static int get_int(const char *path, const cJSON *obj, const char *key, int required, int def, int *out) {
    const cJSON *v = get(obj, key);
    if (!v) {
        if (required) return cf_fail("%s: missing required key '%s'", path, key);
        *out = def;
        return 0;
    }
    return as_int(path, key, v, out);
}

static int as_float(const char *path, const char *key, const cJSON *v, float *out) {
    if (!cJSON_IsNumber(v))
        return cf_fail("%s: '%s' must be a number, got %s", path, key, cf_json_kind(v));
    double d = v->valuedouble;
    if (!isfinite(d) || fabs(d) > 3.0e38)
        return cf_fail("%s: '%s' = %g is not a finite fp32 number", path, key, d);
    *out = (float)d;
    return 0;
}

static int get_float(const char *path, const cJSON *obj, const char *key, float def, float *out) {
    const cJSON *v = get(obj, key);
    if (!v) { *out = def; return 0; }
    return as_float(path, key, v, out);
}

static int get_bool(const char *path, const cJSON *obj, const char *key, int def, int *out) {
    const cJSON *v = get(obj, key);
    if (!v) { *out = def; return 0; }
    if (!cJSON_IsBool(v))
        return cf_fail("%s: '%s' must be true or false, got %s", path, key, cf_json_kind(v));
    *out = cJSON_IsTrue(v) ? 1 : 0;
    return 0;
}

/* bos/eos: an int, a list of ints (the first is the id), or null/absent
 * (-1). Every item of a list must be an integer; *list is set to the list
 * (NULL for a plain id) so that validation, which knows the vocabulary,
 * range-checks every item. */
static int get_token_id(const char *path, const cJSON *obj, const char *key, int *out, const cJSON **list) {
    const cJSON *v = get(obj, key);
    *out = -1;
    *list = NULL;
    if (!v) return 0;
    if (cJSON_IsArray(v)) {
        int i = 0;
        for (const cJSON *e = v->child; e; e = e->next, i++) {
            char item[64];
            int tmp = -1;
            snprintf(item, sizeof item, "%s[%d]", key, i);
            if (as_int(path, item, e, &tmp) != 0) return -1;
            if (i == 0) *out = tmp;
        }
        *list = v;
        return 0;
    }
    return as_int(path, key, v, out);
}

static int cmp_str_ptr(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Refuses duplicate keys in one object (cJSON keeps them all). Sorting keeps
 * this O(n log n) even for a hostile file with many keys. */
static int check_duplicate_keys(const char *path, const cJSON *obj) {
    size_t n = 0;
    for (const cJSON *e = obj->child; e; e = e->next) n++;
    if (n < 2) return 0;
    const char **keys = cf_malloc(n * sizeof *keys);
    if (!keys) return -1;
    size_t k = 0;
    for (const cJSON *e = obj->child; e; e = e->next) keys[k++] = e->string ? e->string : "";
    qsort(keys, n, sizeof *keys, cmp_str_ptr);
    int rc = 0;
    for (size_t i = 1; i < n && rc == 0; i++)
        if (strcmp(keys[i - 1], keys[i]) == 0) {
            char safe[65];
            rc = cf_fail("%s: duplicate key '%s'", path, cf_printable(keys[i], safe, sizeof safe));
        }
    free(keys);
    return rc;
}

/* Features that change the math and that the engine does not implement.
 * Refusing them is better than training a different model silently. */
static int check_unsupported(const char *path, const cJSON *root, cf_model_type mt) {
    int b = 0;
    if (get_bool(path, root, "mlp_bias", 0, &b) != 0) return -1;
    if (b) return cf_fail("%s: mlp_bias = true is not supported (no MLP biases in this engine)", path);
    if (get(root, "quantization_config"))
        return cf_fail("%s: quantized checkpoints (quantization_config) are not supported", path);
    const cJSON *act = get(root, "hidden_act");
    if (act) {
        if (!cJSON_IsString(act))
            return cf_fail("%s: 'hidden_act' must be a string, got %s", path, cf_json_kind(act));
        if (strcmp(act->valuestring, "silu") != 0 && strcmp(act->valuestring, "swish") != 0)
        {
            char safe[65];
            return cf_fail("%s: hidden_act '%s' is not supported (only silu)", path,
                           cf_printable(act->valuestring, safe, sizeof safe));
        }
    }
    if (mt == CF_MODEL_QWEN2 || mt == CF_MODEL_QWEN3) {
        /* Their sliding window applies to some layers only; not supported. */
        if (get_bool(path, root, "use_sliding_window", 0, &b) != 0) return -1;
        if (b) return cf_fail("%s: use_sliding_window = true is not supported for %s", path,
                              cf_model_type_name(mt));
        const cJSON *lt = get(root, "layer_types");
        if (lt) {
            if (!cJSON_IsArray(lt))
                return cf_fail("%s: 'layer_types' must be an array, got %s", path, cf_json_kind(lt));
            for (const cJSON *e = lt->child; e; e = e->next)
                if (!cJSON_IsString(e) || strcmp(e->valuestring, "full_attention") != 0)
                    return cf_fail("%s: layer_types: only \"full_attention\" layers are supported", path);
        }
    }
    if (mt == CF_MODEL_MISTRAL) {
        /* transformers' Mistral has no attention biases whatever the config
         * says; honouring the flag would expect tensors that do not exist. */
        if (get_bool(path, root, "attention_bias", 0, &b) != 0) return -1;
        if (b) return cf_fail("%s: attention_bias = true is not supported for mistral "
                              "(transformers' MistralForCausalLM has no attention biases)", path);
    }
    return 0;
}

/* RoPE: theta and optional llama3 scaling, from either config format. */
static int parse_rope(const char *path, const cJSON *root, cf_config *c) {
    const cJSON *scaling = get(root, "rope_scaling");
    const cJSON *params = get(root, "rope_parameters");
    if (scaling && !cJSON_IsObject(scaling))
        return cf_fail("%s: 'rope_scaling' must be an object or null, got %s", path, cf_json_kind(scaling));
    if (params && !cJSON_IsObject(params))
        return cf_fail("%s: 'rope_parameters' must be an object or null, got %s", path, cf_json_kind(params));
    /* transformers 5: `rope_scaling or rope_parameters`. */
    const cJSON *rope = scaling ? scaling : params;
    const char *rope_key = scaling ? "rope_scaling" : "rope_parameters";
    if (rope) {
        /* Per-layer-type rope parameters (a dict of dicts) are not supported. */
        for (const cJSON *e = rope->child; e; e = e->next)
            if (cJSON_IsObject(e))
                return cf_fail("%s: %s: per-layer-type RoPE parameters are not supported", path, rope_key);
        if (check_duplicate_keys(path, rope) != 0) return -1;
    }

    float theta_top = 10000.0f;
    if (get_float(path, root, "rope_theta", 10000.0f, &theta_top) != 0) return -1;
    c->rope_theta = theta_top;
    if (rope && get(rope, "rope_theta")) {
        char key[64];
        snprintf(key, sizeof key, "%s.rope_theta", rope_key);
        if (as_float(path, key, get(rope, "rope_theta"), &c->rope_theta) != 0) return -1;
    }
    float partial = 1.0f;
    const cJSON *prf = rope && get(rope, "partial_rotary_factor") ? get(rope, "partial_rotary_factor")
                                                                  : get(root, "partial_rotary_factor");
    if (prf && as_float(path, "partial_rotary_factor", prf, &partial) != 0) return -1;
    if (partial != 1.0f)
        return cf_fail("%s: partial_rotary_factor = %g is not supported (only 1)", path, (double)partial);

    c->rope_llama3 = 0;
    c->rope_factor = c->rope_low_freq_factor = c->rope_high_freq_factor = 0;
    c->rope_original_max_pos = 0;
    if (!rope) return 0;

    const cJSON *type = get(rope, "rope_type");
    if (!type) type = get(rope, "type");   /* pre-4.45 spelling */
    const char *tname = "default";
    if (type) {
        if (!cJSON_IsString(type))
            return cf_fail("%s: %s.rope_type must be a string, got %s", path, rope_key, cf_json_kind(type));
        tname = type->valuestring;
    }
    if (strcmp(tname, "default") == 0) return 0;
    if (strcmp(tname, "llama3") != 0) {
        char safe[33];
        return cf_fail("%s: %s rope_type '%s' is not supported (supported: default, llama3)", path, rope_key,
                       cf_printable(tname, safe, sizeof safe));
    }

    char key[96];
    const cJSON *v;
#define ROPE_FLOAT(name, field)                                                            \
    do {                                                                                   \
        snprintf(key, sizeof key, "%s.%s", rope_key, name);                                \
        if (!(v = get(rope, name))) return cf_fail("%s: missing required key '%s'", path, key); \
        if (as_float(path, key, v, &c->field) != 0) return -1;                             \
    } while (0)
    ROPE_FLOAT("factor", rope_factor);
    ROPE_FLOAT("low_freq_factor", rope_low_freq_factor);
    ROPE_FLOAT("high_freq_factor", rope_high_freq_factor);
#undef ROPE_FLOAT
    /* transformers 5 falls back to max_position_embeddings when the
     * original length is not given; so do we. */
    snprintf(key, sizeof key, "%s.original_max_position_embeddings", rope_key);
    if ((v = get(rope, "original_max_position_embeddings"))) {
        if (as_int(path, key, v, &c->rope_original_max_pos) != 0) return -1;
    } else if ((v = get(root, "original_max_position_embeddings"))) {
        if (as_int(path, "original_max_position_embeddings", v, &c->rope_original_max_pos) != 0) return -1;
    } else {
        c->rope_original_max_pos = c->max_position_embeddings;
    }
    c->rope_llama3 = 1;
    return 0;
}

static int parse_model_type(const char *path, const cJSON *root, cf_model_type *out) {
    const cJSON *v = get(root, "model_type");
    if (!v) return cf_fail("%s: missing required key 'model_type'", path);
    if (!cJSON_IsString(v))
        return cf_fail("%s: 'model_type' must be a string, got %s", path, cf_json_kind(v));
    static const cf_model_type all[] = {CF_MODEL_LLAMA, CF_MODEL_MISTRAL, CF_MODEL_QWEN2, CF_MODEL_QWEN3};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (strcmp(v->valuestring, cf_model_type_name(all[i])) == 0) { *out = all[i]; return 0; }
    char safe[65];
    return cf_fail("%s: unsupported model_type '%s' (supported: llama, mistral, qwen2, qwen3)", path,
                   cf_printable(v->valuestring, safe, sizeof safe));
}

/* Fills c from a parsed config object. */
static int parse_config(const char *path, const cJSON *root, cf_config *c) {
    memset(c, 0, sizeof *c);
    if (check_duplicate_keys(path, root) != 0) return -1;
    if (parse_model_type(path, root, &c->model_type) != 0) return -1;
    cf_model_type mt = c->model_type;
    if (check_unsupported(path, root, mt) != 0) return -1;

    if (get_int(path, root, "vocab_size", 1, 0, &c->vocab_size) != 0) return -1;
    if (get_int(path, root, "hidden_size", 1, 0, &c->hidden_size) != 0) return -1;
    if (get_int(path, root, "intermediate_size", 1, 0, &c->intermediate_size) != 0) return -1;
    if (get_int(path, root, "num_hidden_layers", 1, 0, &c->num_hidden_layers) != 0) return -1;
    if (get_int(path, root, "num_attention_heads", 1, 0, &c->num_attention_heads) != 0) return -1;
    if (c->num_attention_heads <= 0)
        return cf_fail("%s: num_attention_heads = %d must be positive", path, c->num_attention_heads);
    if (get_int(path, root, "num_key_value_heads", 0, c->num_attention_heads, &c->num_key_value_heads) != 0)
        return -1;

    /* head_dim: explicit if given; qwen3's class default is 128, the others
     * derive it from hidden_size / num_attention_heads. */
    if (get(root, "head_dim")) {
        if (get_int(path, root, "head_dim", 1, 0, &c->head_dim) != 0) return -1;
    } else if (mt == CF_MODEL_QWEN3) {
        c->head_dim = 128;
    } else {
        if (c->hidden_size % c->num_attention_heads != 0)
            return cf_fail("%s: hidden_size %d is not a multiple of num_attention_heads %d "
                           "(and no head_dim is given)", path, c->hidden_size, c->num_attention_heads);
        c->head_dim = c->hidden_size / c->num_attention_heads;
    }

    /* Class defaults of transformers for keys a config.json may omit. */
    int def_maxpos = mt == CF_MODEL_LLAMA ? 2048 : mt == CF_MODEL_MISTRAL ? 131072 : 32768;
    if (get_int(path, root, "max_position_embeddings", 0, def_maxpos, &c->max_position_embeddings) != 0)
        return -1;
    if (get_float(path, root, "rms_norm_eps", 1e-6f, &c->rms_norm_eps) != 0) return -1;
    if (get_bool(path, root, "tie_word_embeddings", 0, &c->tie_word_embeddings) != 0) return -1;

    int attention_bias = 0;
    if (mt != CF_MODEL_QWEN2 && get_bool(path, root, "attention_bias", 0, &attention_bias) != 0) return -1;
    switch (mt) {
    case CF_MODEL_QWEN2: c->qkv_bias = 1; c->o_bias = 0; break;
    case CF_MODEL_QWEN3: c->qk_norm = 1; c->qkv_bias = c->o_bias = attention_bias; break;
    case CF_MODEL_LLAMA:
    case CF_MODEL_MISTRAL: c->qkv_bias = c->o_bias = attention_bias; break;
    }

    if (parse_rope(path, root, c) != 0) return -1;

    c->sliding_window = 0;
    if (mt == CF_MODEL_MISTRAL &&
        get_int(path, root, "sliding_window", 0, 0, &c->sliding_window) != 0) return -1;
    if (c->sliding_window < 0)
        return cf_fail("%s: sliding_window = %d must be >= 0 or null", path, c->sliding_window);

    const cJSON *bos_list, *eos_list;
    if (get_token_id(path, root, "bos_token_id", &c->bos_token_id, &bos_list) != 0) return -1;
    if (get_token_id(path, root, "eos_token_id", &c->eos_token_id, &eos_list) != 0) return -1;
    /* every listed eos id ends generation: keep them all (bos: the first) */
    if (eos_list) {
        int n = cJSON_GetArraySize(eos_list);
        if (n > CF_MAX_EOS_IDS)
            return cf_fail("%s: eos_token_id lists %d ids, more than the %d supported", path, n, CF_MAX_EOS_IDS);
        int i = 0;
        for (const cJSON *e = eos_list->child; e; e = e->next, i++)
            if (i > 0) c->extra_eos_ids[i - 1] = (int)e->valuedouble;
        c->num_extra_eos = n > 0 ? n - 1 : 0;
    }
    return validate_named(c, path, bos_list, eos_list);
}

/* path as one JSON object (only white space after it, no NUL inside a
 * string): the parsed object, or NULL and one line naming the file. */
static cJSON *read_json_object(const char *path, const char *what) {
    size_t len = 0;
    char *buf = cf_read_input(path, &len, CONFIG_MAX_BYTES);   /* a regular file, registered as an input */
    if (!buf) return NULL;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(buf, len, &end, 0);
    int ok = 0;
    if (!root) {
        const char *at = end ? end : cJSON_GetErrorPtr();
        long off = (at && at >= buf && at <= buf + len) ? (long)(at - buf) : -1;
        cf_fail("%s: not valid JSON (error near byte %ld)", path, off);
        goto done;
    }
    /* Only whitespace may follow the object. */
    for (const char *p = end; p && p < buf + len; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            cf_fail("%s: not valid JSON (trailing data at byte %ld)", path, (long)(p - buf));
            goto done;
        }
    if (!cJSON_IsObject(root)) {
        cf_fail("%s: expected a JSON object, got %s", path, cf_json_kind(root));
        goto done;
    }
    /* cJSON cuts a string at a NUL: "llama\u0000x" would read as "llama" */
    if (cf_json_check_nul(path, what, buf, len) != 0) goto done;
    ok = 1;
done:
    free(buf);
    if (!ok) cJSON_Delete(root);
    return ok ? root : NULL;
}

int cf_config_load(cf_config *cfg, const char *path) {
    cJSON *root = read_json_object(path, "config");
    if (!root) return -1;
    cf_config c;
    int rc = parse_config(path, root, &c);
    if (rc == 0) *cfg = c;
    cJSON_Delete(root);
    return rc;
}

int cf_generation_config_eos(const char *dir, int vocab_size, int *ids, int cap, int *n) {
    char path[4096];
    *n = 0;
    if (cf_path_join(path, sizeof path, dir, "generation_config.json") != 0) return -1;
    if (!cf_path_exists(path)) return 0;
    cJSON *root = read_json_object(path, "generation config");
    if (!root) return -1;
    int first, rc = 0;
    const cJSON *list;
    if (get_token_id(path, root, "eos_token_id", &first, &list) != 0) rc = -1;
    else if (list) {
        int i = 0;
        for (const cJSON *e = list->child; e && rc == 0; e = e->next, i++) {
            const int id = (int)e->valuedouble;   /* an integer: get_token_id checked */
            if (id < 0 || id >= vocab_size)
                rc = cf_fail("%s: eos_token_id[%d] = %d is outside the vocabulary (0..%d)", path, i, id,
                             vocab_size - 1);
            else if (i >= cap)
                rc = cf_fail("%s: eos_token_id lists more than the %d ids supported", path, cap);
            else
                ids[(*n)++] = id;
        }
    } else if (first != -1) {   /* -1: none, as in config.json */
        if (first < 0 || first >= vocab_size)
            rc = cf_fail("%s: eos_token_id = %d is outside the vocabulary (0..%d)", path, first, vocab_size - 1);
        else if (cap < 1)
            rc = cf_fail("%s: no room for an eos id", path);
        else
            ids[(*n)++] = first;
    }
    if (rc != 0) *n = 0;
    cJSON_Delete(root);
    return rc;
}

/* ----------------------------------------------------------------- saving */


/* Shortest decimal that reads back as the same fp32 value, always with a
 * '.' or an exponent so Python reads it as a float (500000.0, 1e-05). */
static void fmt_float(char *out, size_t cap, float f) {
    if (f == floorf(f) && fabsf(f) < 1e15f) {
        snprintf(out, cap, "%.1f", (double)f);
        return;
    }
    for (int prec = 1; prec <= 9; prec++) {
        snprintf(out, cap, "%.*g", prec, (double)f);
        if (strtof(out, NULL) == f) break;
    }
    if (!strpbrk(out, ".eE")) {
        size_t n = strlen(out);
        if (n + 2 < cap) memcpy(out + n, ".0", 3);
    }
}

static void sb_key_float(cf_sbuf *b, const char *indent, const char *key, float f, const char *sep) {
    char num[64];
    fmt_float(num, sizeof num, f);
    cf_sb_printf(b, "%s\"%s\": %s%s\n", indent, key, num, sep);
}

/* An id, null for none, or a list: the id and `nextra` further ids. */
static void sb_token_id(cf_sbuf *b, const char *key, int id, const int *extra, int nextra) {
    if (id < 0) cf_sb_printf(b, "  \"%s\": null,\n", key);
    else if (nextra <= 0) cf_sb_printf(b, "  \"%s\": %d,\n", key, id);
    else {
        cf_sb_printf(b, "  \"%s\": [\n    %d", key, id);
        for (int i = 0; i < nextra; i++) cf_sb_printf(b, ",\n    %d", extra[i]);
        cf_sb_printf(b, "\n  ],\n");
    }
}

/* The rope dict, in the llama3 layout both transformers 4.4x and 5 read. */
static void sb_rope_dict(cf_sbuf *b, const cf_config *c, int with_theta) {
    cf_sb_printf(b, "{\n");
    sb_key_float(b, "    ", "factor", c->rope_factor, ",");
    sb_key_float(b, "    ", "high_freq_factor", c->rope_high_freq_factor, ",");
    sb_key_float(b, "    ", "low_freq_factor", c->rope_low_freq_factor, ",");
    cf_sb_printf(b, "    \"original_max_position_embeddings\": %d,\n", c->rope_original_max_pos);
    if (with_theta) sb_key_float(b, "    ", "rope_theta", c->rope_theta, ",");
    cf_sb_printf(b, "    \"rope_type\": \"llama3\"\n  }");
}

int cf_config_save(const cf_config *cfg, const char *path) { return cf_config_save_as(cfg, path, "float32"); }

int cf_config_save_as(const cf_config *cfg, const char *path, const char *dtype) {
    if (strcmp(dtype, "float32") != 0 && strcmp(dtype, "bfloat16") != 0)
        return cf_fail("%s: unsupported dtype '%s' (float32 or bfloat16)", path, dtype);
    if (!cfg || !path) return cf_fail("config save: NULL argument");
    if (validate_named(cfg, path, NULL, NULL) != 0) return -1;
    const cf_config *c = cfg;
    cf_model_type mt = c->model_type;
    cf_sbuf b = {0};

    cf_sb_printf(&b, "{\n  \"architectures\": [\n    \"%s\"\n  ],\n", architecture_name(mt));
    if (mt != CF_MODEL_QWEN2)   /* qwen2's biases are fixed by the architecture */
        cf_sb_printf(&b, "  \"attention_bias\": %s,\n", c->qkv_bias ? "true" : "false");
    cf_sb_printf(&b, "  \"attention_dropout\": 0.0,\n");
    sb_token_id(&b, "bos_token_id", c->bos_token_id, NULL, 0);
    cf_sb_printf(&b, "  \"dtype\": \"%s\",\n", dtype);
    sb_token_id(&b, "eos_token_id", c->eos_token_id, c->extra_eos_ids, c->num_extra_eos);
    cf_sb_printf(&b, "  \"head_dim\": %d,\n", c->head_dim);
    cf_sb_printf(&b, "  \"hidden_act\": \"silu\",\n");
    cf_sb_printf(&b, "  \"hidden_size\": %d,\n", c->hidden_size);
    cf_sb_printf(&b, "  \"initializer_range\": 0.02,\n");
    cf_sb_printf(&b, "  \"intermediate_size\": %d,\n", c->intermediate_size);
    cf_sb_printf(&b, "  \"max_position_embeddings\": %d,\n", c->max_position_embeddings);
    if (mt == CF_MODEL_QWEN2 || mt == CF_MODEL_QWEN3)
        cf_sb_printf(&b, "  \"max_window_layers\": %d,\n", c->num_hidden_layers);
    if (mt == CF_MODEL_LLAMA) cf_sb_printf(&b, "  \"mlp_bias\": false,\n");
    cf_sb_printf(&b, "  \"model_type\": \"%s\",\n", cf_model_type_name(mt));
    cf_sb_printf(&b, "  \"num_attention_heads\": %d,\n", c->num_attention_heads);
    cf_sb_printf(&b, "  \"num_hidden_layers\": %d,\n", c->num_hidden_layers);
    cf_sb_printf(&b, "  \"num_key_value_heads\": %d,\n", c->num_key_value_heads);
    sb_key_float(&b, "  ", "rms_norm_eps", c->rms_norm_eps, ",");
    /* transformers 5 layout ... */
    cf_sb_printf(&b, "  \"rope_parameters\": ");
    if (c->rope_llama3) sb_rope_dict(&b, c, 1);
    else {
        char num[64];
        fmt_float(num, sizeof num, c->rope_theta);
        cf_sb_printf(&b, "{\n    \"rope_theta\": %s,\n    \"rope_type\": \"default\"\n  }", num);
    }
    cf_sb_printf(&b, ",\n");
    /* ... and the legacy one, which 5.x still accepts and 4.x needs. */
    cf_sb_printf(&b, "  \"rope_scaling\": ");
    if (c->rope_llama3) sb_rope_dict(&b, c, 0);
    else cf_sb_printf(&b, "null");
    cf_sb_printf(&b, ",\n");
    sb_key_float(&b, "  ", "rope_theta", c->rope_theta, ",");
    if (mt == CF_MODEL_MISTRAL) {
        if (c->sliding_window > 0) cf_sb_printf(&b, "  \"sliding_window\": %d,\n", c->sliding_window);
        else cf_sb_printf(&b, "  \"sliding_window\": null,\n");
    }
    if (mt == CF_MODEL_QWEN2 || mt == CF_MODEL_QWEN3)
        cf_sb_printf(&b, "  \"sliding_window\": null,\n");
    cf_sb_printf(&b, "  \"tie_word_embeddings\": %s,\n", c->tie_word_embeddings ? "true" : "false");
    cf_sb_printf(&b, "  \"torch_dtype\": \"%s\",\n", dtype);
    cf_sb_printf(&b, "  \"use_cache\": true,\n");
    if (mt == CF_MODEL_QWEN2 || mt == CF_MODEL_QWEN3)
        cf_sb_printf(&b, "  \"use_sliding_window\": false,\n");
    cf_sb_printf(&b, "  \"vocab_size\": %d\n}\n", c->vocab_size);

    int rc;
    if (b.failed) rc = cf_fail("%s: out of memory formatting config.json", path);
    else rc = cf_write_file_atomic(path, b.s, b.len);
    free(b.s);
    return rc;
}
