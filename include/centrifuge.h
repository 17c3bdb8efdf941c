/*
 * centrifuge.h — public C API of the Centrifuge training engine.
 *
 * Centrifuge trains Llama-family language models with token filtering
 * (selective language modeling) and turns the filtering into speed: after a
 * full forward pass, the backward runs on the kept token rows only.
 *
 * Conventions
 *   - Every function that can fail returns 0 on success and -1 on failure;
 *     cf_last_error() then holds one line that says what went wrong.
 *   - Functions returning pointers return NULL on failure.
 *   - Activations are token-major: [T, C] with T = B * S rows.
 */
#ifndef CENTRIFUGE_H
#define CENTRIFUGE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CF_VERSION "0.1.0"

/* ------------------------------------------------------------------ errors */

/* The message of the last failure in this thread ("" if none). */
const char *cf_last_error(void);
/* Sets the message (printf-style) and returns -1, so callers can
 * `return cf_fail("...")`. */
int cf_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* ------------------------------------------------------------------ config */

typedef enum {
    CF_MODEL_LLAMA = 0,   /* TinyLlama, Llama 2, Llama 3.x                    */
    CF_MODEL_MISTRAL,     /* Mistral (Llama architecture, own model_type)     */
    CF_MODEL_QWEN2,       /* q/k/v projection biases                          */
    CF_MODEL_QWEN3,       /* per-head RMSNorm on q and k, explicit head_dim   */
} cf_model_type;

typedef struct {
    cf_model_type model_type;
    int vocab_size;
    int hidden_size;           /* C                                   */
    int intermediate_size;     /* F (SwiGLU width)                    */
    int num_hidden_layers;     /* L                                   */
    int num_attention_heads;   /* H                                   */
    int num_key_value_heads;   /* Hkv (GQA), divides H                */
    int head_dim;              /* D                                   */
    int max_position_embeddings;
    float rms_norm_eps;
    float rope_theta;
    int tie_word_embeddings;
    int qkv_bias;              /* biases on q/k/v projections (qwen2, llama attention_bias) */
    int o_bias;                /* bias on o_proj (llama attention_bias)                     */
    int qk_norm;               /* qwen3 per-head RMSNorm on q and k                          */
    /* rope_scaling with rope_type "llama3" */
    int rope_llama3;
    float rope_factor;
    float rope_low_freq_factor;
    float rope_high_freq_factor;
    int rope_original_max_pos;
    int sliding_window;        /* 0 = none; mistral only */
    int bos_token_id;          /* -1 if absent */
    int eos_token_id;          /* -1 if absent */
} cf_config;

const char *cf_model_type_name(cf_model_type t);
/* Reads a HF config.json. Unknown model types and unsupported features fail. */
int cf_config_load(cf_config *cfg, const char *path);
/* Writes a HF config.json that transformers can load. Atomic. The _as form
 * names the weights' dtype ("float32" or "bfloat16") for dtype="auto". */
int cf_config_save(const cf_config *cfg, const char *path);
int cf_config_save_as(const cf_config *cfg, const char *path, const char *dtype);
/* Built-in named configs: tiny, tinyllama-1.1b, qwen2.5-1.5b, llama3.2-3b,
 * qwen2.5-7b, llama3.1-8b (and tiny-<model_type> variants for tests). */
int cf_config_builtin(cf_config *cfg, const char *name);
/* Checks internal consistency (divisibility, positive sizes). */
int cf_config_validate(const cf_config *cfg);
/* A comma-separated list of the built-in names, for help texts. */
const char *cf_config_builtin_names(void);
size_t cf_config_num_params(const cf_config *cfg);

/* ------------------------------------------------------------------ model */

typedef enum { CF_BACKEND_CPU = 0, CF_BACKEND_CUDA = 1 } cf_backend_kind;

/* The four backward modes of DESIGN §1. */
typedef enum {
    CF_MODE_REGULAR = 0,   /* loss over all positions, full backward            */
    CF_MODE_LOSS_ONLY,     /* loss over kept positions, full dense backward     */
    CF_MODE_CENTRIFUGE,    /* loss over kept, backward on kept rows only        */
    CF_MODE_STRAWMAN,      /* as centrifuge, attention renormalised over kept   */
} cf_mode;
const char *cf_mode_name(cf_mode m);
int cf_mode_parse(const char *s, cf_mode *out);

typedef enum { CF_SELECT_REF = 0, CF_SELECT_SELF, CF_SELECT_RANDOM } cf_select_kind;
const char *cf_select_name(cf_select_kind k);
int cf_select_parse(const char *s, cf_select_kind *out);

typedef struct cf_model cf_model;

/* A model with freshly initialised weights (deterministic in seed). */
cf_model *cf_model_create(const cf_config *cfg, cf_backend_kind backend, uint64_t seed);
/* A model from a HF directory (config.json + model.safetensors or
 * model.safetensors.index.json + shards). */
cf_model *cf_model_load(const char *dir, cf_backend_kind backend);
/* Writes config.json and model.safetensors (dtype "float32" or "bfloat16"),
 * atomically. If max_shard_bytes > 0 the weights are split into shards
 * with an index file. */
int cf_model_save(cf_model *m, const char *dir, const char *dtype, size_t max_shard_bytes);
void cf_model_free(cf_model *m);
const cf_config *cf_model_config(const cf_model *m);

/* Parameter table (HF names), for tests and tools. */
int cf_model_num_tensors(const cf_model *m);
const char *cf_model_tensor_name(const cf_model *m, int i);
size_t cf_model_tensor_numel(const cf_model *m, int i);
/* fp32 host copies of a parameter tensor and of its gradient. */
int cf_model_get_param(cf_model *m, int i, float *out);
int cf_model_set_param(cf_model *m, int i, const float *in);
int cf_model_get_grad(cf_model *m, int i, float *out);
size_t cf_model_num_params(const cf_model *m);

/* Forward over B rows of S positions. tokens has B*(S+1) ids laid out as
 * B rows of S+1 (inputs are [0,S), targets [1,S]). Writes the per-token
 * loss of all B*S positions to losses (host, may be NULL) and returns 0. */
int cf_forward(cf_model *m, const int32_t *tokens, int B, int S, float *losses);

/* Selection: fills keep (host, B*S bytes of 0/1) from per-token target
 * losses and reference losses (ref may be NULL for select self/random).
 * keep_frac in (0,1]; per_batch selects over the whole micro-batch instead
 * of per sequence. Ties break by lower position. Returns kept count. */
int cf_select(const float *losses, const float *ref, int B, int S, float keep_frac,
              cf_select_kind kind, int per_batch, uint64_t seed, uint8_t *keep);

/* The filter operator: compacts every saved token-major activation of the
 * last forward to the kept rows (keep is host 0/1 of B*S). Needed before a
 * centrifuge or strawman backward. */
int cf_filter_backward(cf_model *m, const uint8_t *keep);

/* Backward of the last forward in the given mode. keep may be NULL for
 * regular. loss_scale multiplies the loss (1/grad_accum). Gradients are
 * accumulated into the model's gradient buffer. Returns 0. The mean loss
 * that was differentiated is written to *loss if non-NULL. */
int cf_backward(cf_model *m, cf_mode mode, const uint8_t *keep, float loss_scale, float *loss);

void cf_zero_grad(cf_model *m);

typedef struct {
    float lr, beta1, beta2, eps, weight_decay;
    float grad_clip;   /* 0 = no clipping */
} cf_adamw_params;

/* One AdamW step on the accumulated gradients (clipped to grad_clip by the
 * global norm). Returns the pre-clip gradient norm in *grad_norm. If the
 * norm is not finite the step is skipped and 1 is returned. */
int cf_step(cf_model *m, const cf_adamw_params *p, float *grad_norm);
/* Optimizer state for checkpoints: step count and the m, v moments. */
int64_t cf_optimizer_steps(const cf_model *m);

/* Learning rate of step `step` (0-based) with linear warmup then cosine
 * decay to min_lr at total_steps. */
float cf_lr_schedule(int step, int warmup, int total, float max_lr, float min_lr);

/* Timing of the last forward/filter/backward/step, in seconds. */
typedef struct { double forward, filter, backward, optimizer; } cf_timings;
void cf_model_timings(const cf_model *m, cf_timings *t);

#ifdef __cplusplus
}
#endif
#endif /* CENTRIFUGE_H */
