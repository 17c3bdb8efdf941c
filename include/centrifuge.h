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
#include <stdio.h>

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

/* The most end-of-sequence ids a config.json may list (eos_token_id as a list). */
#define CF_MAX_EOS_IDS 16

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
    int bos_token_id;          /* -1 if absent (a list in config.json: its first id) */
    int eos_token_id;          /* -1 if absent (a list in config.json: its first id) */
    /* eos_token_id given as a list (Llama 3.1: [128001, 128008, 128009]):
     * the ids after the first. Generation stops at any of them, as in
     * transformers. At most CF_MAX_EOS_IDS ids in all; 0 extras for a plain
     * id; extras need an eos_token_id. config.json writes them back as a list. */
    int num_extra_eos;
    int extra_eos_ids[CF_MAX_EOS_IDS - 1];
} cf_config;

const char *cf_model_type_name(cf_model_type t);
/* Reads a HF config.json. Unknown model types and unsupported features fail. */
int cf_config_load(cf_config *cfg, const char *path);
/* The eos ids DIR/generation_config.json names (an id or a list; transformers'
 * generate stops at these rather than config.json's when the file names
 * any): up to cap into ids, their count in *n. 0 with *n = 0 where the file
 * is absent or names none; -1 and one line for a file that is not a JSON
 * object, an id that is not an integer of [0, vocab_size), or more than cap. */
int cf_generation_config_eos(const char *dir, int vocab_size, int *ids, int cap, int *n);
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
/* Model FLOPs per token of a dense training step (forward + backward) at
 * sequence length seq, for MFU: 6 N + 6 L seq C, N = all parameters but the
 * input embedding (the LM head counted once, tied or not), L layers, C the
 * hidden size (src/engine/flops.c). */
double cf_config_train_flops_per_token(const cf_config *cfg, int seq);

/* ------------------------------------------------------------------ model */

typedef enum { CF_BACKEND_CPU = 0, CF_BACKEND_CUDA = 1 } cf_backend_kind;
/* "cpu" or "cuda" (also "cuda:N", setting *device to N when device != NULL). */
int cf_backend_parse(const char *s, cf_backend_kind *out, int *device);

/* The backward modes of DESIGN §1. */
typedef enum {
    CF_MODE_REGULAR = 0,   /* loss over all positions, full backward            */
    CF_MODE_LOSS_ONLY,     /* loss over kept positions, full dense backward     */
    CF_MODE_CENTRIFUGE,    /* loss over kept, backward on kept rows only        */
    CF_MODE_STRAWMAN,      /* as centrifuge, attention renormalised over kept   */
    CF_MODE_CENTRIFUGE_KV, /* as centrifuge, plus the K/V projection gradients  */
                           /* of filtered rows (stop-gradient at their input)   */
} cf_mode;
const char *cf_mode_name(cf_mode m);
int cf_mode_parse(const char *s, cf_mode *out);
/* Modes whose backward runs on the kept rows only (centrifuge, strawman,
 * centrifuge-kv). */
int cf_mode_is_compact(cf_mode m);

typedef enum { CF_SELECT_REF = 0, CF_SELECT_SELF, CF_SELECT_RANDOM } cf_select_kind;
const char *cf_select_name(cf_select_kind k);
int cf_select_parse(const char *s, cf_select_kind *out);

typedef struct cf_model cf_model;

/* LoRA adapters (PEFT's LoRA): on each targeted projection W [out, in],
 * y = x W^T + scale * (x A^T) B^T with A [rank, in], B [out, rank],
 * scale = alpha / rank (alpha / sqrt(rank) with rslora). Base weights are
 * then frozen (compute copy only); A starts kaiming-uniform, B at zero. */
enum {
    CF_LORA_Q = 1 << 0, CF_LORA_K = 1 << 1, CF_LORA_V = 1 << 2, CF_LORA_O = 1 << 3,
    CF_LORA_GATE = 1 << 4, CF_LORA_UP = 1 << 5, CF_LORA_DOWN = 1 << 6,
};
typedef struct {
    int rank;          /* 0 = no adapters                                   */
    float alpha;
    unsigned targets;  /* CF_LORA_* bits                                    */
    float dropout;     /* PEFT's lora_dropout on the adapter input, [0, 1):
                          training forwards only (cf_model_set_train)     */
    int rslora;
} cf_lora_opts;
/* "q,k,v,o" or "q_proj,v_proj,..." (also "all") -> CF_LORA_* bits. */
int cf_lora_parse_targets(const char *s, unsigned *out);

/* How to open a model: from a built-in name or config.json (fresh weights
 * from seed), or from a HF model directory. */
typedef struct {
    const char *config;        /* built-in name or path of a config.json, or NULL   */
    const char *model_dir;     /* HF directory (config.json + safetensors), or NULL  */
    cf_backend_kind backend;
    int device;                /* GPU index for CF_BACKEND_CUDA                      */
    uint64_t seed;             /* initialisation of fresh weights                    */
    /* Comma-separated substrings of parameter names to freeze (no master
     * copy, gradient or optimizer state), e.g. "embed_tokens,lm_head"; or NULL. */
    const char *freeze;
    cf_lora_opts lora;         /* rank > 0: LoRA adapters, everything else frozen   */
    /* A PEFT adapter directory (adapter_config.json + adapter_model.safetensors)
     * to load onto the model; its config sets `lora` (which must then be unset). */
    const char *adapter_dir;
    /* With `config`: keep only its first `layers` transformer layers (0: all),
     * a smaller model of the same width for quick tests and dry runs. Not
     * with model_dir (a directory's config.json says its own). */
    int layers;
} cf_model_opts;

/* The config a model opened with opts gets (config or model_dir, layers
 * applied), without opening it. */
int cf_model_opts_config(const cf_model_opts *opts, cf_config *out);

/* Opens a model as opts says; config and model_dir exclusive (neither:
 * the built-in "tiny"). */
cf_model *cf_model_open(const cf_model_opts *opts);
/* A model with freshly initialised weights (deterministic in seed). */
cf_model *cf_model_create(const cf_config *cfg, cf_backend_kind backend, uint64_t seed);
/* A model from a HF directory (config.json + model.safetensors or
 * model.safetensors.index.json + shards). */
cf_model *cf_model_load(const char *dir, cf_backend_kind backend);
/* Writes config.json and model.safetensors (dtype "float32" or "bfloat16"),
 * atomically. If max_shard_bytes > 0 the weights are split into shards
 * with an index file. The base model only: adapters are saved apart. */
int cf_model_save(cf_model *m, const char *dir, const char *dtype, size_t max_shard_bytes);
/* The model's LoRA settings (rank 0 without adapters). */
const cf_lora_opts *cf_model_lora(const cf_model *m);
/* Training mode (off by default): while on, cf_forward applies the LoRA
 * dropout of the model's cf_lora_opts (a fresh mask each forward; the
 * backward of that forward uses the same mask). cf_trainer_step turns it on
 * for its own forwards only, so evaluation, generation and scoring never
 * drop. */
void cf_model_set_train(cf_model *m, int on);
/* PEFT adapter files: adapter_config.json + adapter_model.safetensors with
 * PEFT's names (base_model.model.<module>.lora_A.weight, [rank, in]) and
 * shapes, loadable by PeftModel.from_pretrained. base_name goes into
 * base_model_name_or_path (may be NULL). */
int cf_lora_save(cf_model *m, const char *dir, const char *base_name);
/* Reads adapter_config.json of dir into *lora (rank, alpha, targets, ...). */
int cf_lora_read_config(const char *dir, cf_lora_opts *lora);
/* Loads the adapter weights of dir into a model opened with the same LoRA
 * settings. */
int cf_lora_load(cf_model *m, const char *dir);
/* Folds every adapter into its base weight (W += scale * B A) and removes
 * nothing else: cf_model_save then writes the merged HF model. */
int cf_model_merge_lora(cf_model *m);
void cf_model_free(cf_model *m);
const cf_config *cf_model_config(const cf_model *m);

/* Parameter table (HF names), for tests and tools. */
int cf_model_num_tensors(const cf_model *m);
const char *cf_model_tensor_name(const cf_model *m, int i);
size_t cf_model_tensor_numel(const cf_model *m, int i);
/* Whether tensor i is trained (has a gradient and optimizer state). */
int cf_model_tensor_trainable(const cf_model *m, int i);
/* fp32 host copies of a parameter tensor and of its gradient (a frozen
 * tensor has no gradient: cf_model_get_grad fails). */
int cf_model_get_param(cf_model *m, int i, float *out);
int cf_model_set_param(cf_model *m, int i, const float *in);
int cf_model_get_grad(cf_model *m, int i, float *out);
size_t cf_model_num_params(const cf_model *m);
size_t cf_model_num_trainable(const cf_model *m);

/* Enables document masking for later forwards: a token equal to bos starts
 * a new document (positions restart, no attention across documents). */
void cf_model_set_doc_mask(cf_model *m, int bos_token_id);

/* Forward over B rows of S positions. tokens has B*(S+1) ids laid out as
 * B rows of S+1 (inputs are [0,S), targets [1,S]). Writes the per-token
 * loss of all B*S positions to losses (host) if losses != NULL; with NULL
 * the losses stay on the device (no host synchronisation). */
int cf_forward(cf_model *m, const int32_t *tokens, int B, int S, float *losses);

/* Selection on the host: fills keep (B*S bytes of 0/1) from per-token
 * target losses and reference losses (ref may be NULL for select
 * self/random). keep_frac in (0,1]; per_batch selects over the whole
 * micro-batch instead of per sequence. Ties break by lower position.
 * Returns the kept count. */
int cf_select(const float *losses, const float *ref, int B, int S, double keep_frac,
              cf_select_kind kind, int per_batch, uint64_t seed, uint8_t *keep);
/* How many of n positions selection keeps: round(keep * n), at least 1,
 * with keep taken as the decimal the user wrote (0.35 of 10 is 4). */
int cf_select_kept_count(double keep, int n);

/* The kept rows of one forward pass: made by selection (or from a mask),
 * consumed by the filter and the backward of that same forward. Later
 * forwards and selections invalidate it: using it then fails. */
typedef struct {
    uint64_t id;   /* which selection of this model made it */
    int n;         /* number of kept rows                    */
} cf_kept;

typedef struct {
    cf_select_kind kind;
    double keep;       /* fraction kept per group, (0, 1]                 */
    int per_batch;     /* one group per micro-batch instead of per sequence */
    uint64_t seed;     /* for CF_SELECT_RANDOM                            */
} cf_select_opts;

/* Selects from the last forward's losses (and ref, host [B*S], for select
 * ref); on the device where the backend can (no host round trip). */
int cf_select_kept(cf_model *m, const float *ref, const cf_select_opts *o, cf_kept *out);
/* Kept rows from a host mask (B*S bytes of 0/1) of the last forward. */
int cf_kept_from_mask(cf_model *m, const uint8_t *mask, cf_kept *out);
/* Host copy of the mask of kept rows (B*S bytes). */
int cf_kept_mask(cf_model *m, const cf_kept *kept, uint8_t *mask);

/* The filter operator: compacts every saved token-major activation of the
 * last forward to the kept rows. cf_backward in a compact mode does it
 * itself when it has not been done; call it to time it separately. */
int cf_filter(cf_model *m, const cf_kept *kept);

/* Backward of the last forward in the given mode. kept may be NULL for
 * regular. The differentiated loss is the mean over the counted rows
 * (all for regular, kept otherwise) times loss_scale (e.g. 1/grad_accum).
 * Gradients accumulate into the model's gradient buffer. The mean loss
 * is written to *loss if loss != NULL (a host synchronisation). */
int cf_backward(cf_model *m, cf_mode mode, const cf_kept *kept, float loss_scale, float *loss);

void cf_zero_grad(cf_model *m);

typedef struct {
    float lr, beta1, beta2, eps, weight_decay;
    float grad_clip;   /* 0 = no clipping */
} cf_adamw_params;

/* One AdamW step on the accumulated gradients (clipped to grad_clip by the
 * global norm). Returns the pre-clip gradient norm in *grad_norm. If the
 * norm is not finite the step is skipped and 1 is returned. Weight decay
 * applies to matrices only. */
int cf_step(cf_model *m, const cf_adamw_params *p, float *grad_norm);
/* Optimizer state for checkpoints: step count and the m, v moments. */
int64_t cf_optimizer_steps(const cf_model *m);

/* Learning rate of step `step` (0-based) with linear warmup then cosine
 * decay to min_lr at total_steps. */
float cf_lr_schedule(int64_t step, int64_t warmup, int64_t total, float max_lr, float min_lr);

/* Timing of the last forward/filter/backward/step, in seconds. */
typedef struct { double forward, filter, backward, optimizer; } cf_timings;
/* The stage times recorded since the last call (waits for the device). */
void cf_model_timings(cf_model *m, cf_timings *t);

/* Per-op-category profiling (each op bracketed by a device sync). */
enum { CF_PROF_GEMM, CF_PROF_ATTN, CF_PROF_LMHEAD, CF_PROF_NORM, CF_PROF_ROPE, CF_PROF_ELTWISE, CF_PROF_N };
const char *cf_prof_name(int category);
void cf_model_set_profile(cf_model *m, int on);
/* Seconds per category of the last forward (out[0]) and backward (out[1]). */
void cf_model_profile(const cf_model *m, double out[2][CF_PROF_N]);
/* The device the model runs on ("NVIDIA H200", "cpu"), for records. */
const char *cf_model_device_name(const cf_model *m);
/* The commit this library was built from ("unknown" outside a git checkout). */
const char *cf_build_commit(void);
/* Peak device bytes allocated (0 where the backend does not track it). */
size_t cf_model_memory_peak(const cf_model *m);

/* Logits of row t of the last forward into host out[vocab_size] (fp32). */
int cf_model_logits_row(cf_model *m, int t, float *out);

/* ------------------------------------------------------ memory estimate */
/* (issue 12, src/engine/memest.c) What a run will allocate, computed from
 * the config before anything is allocated, and a check against the free
 * memory of the device (the host's MemAvailable for the CPU backend), so a
 * run too large for the machine fails with one line instead of being
 * killed by the OOM killer. Sizes in bytes. */
typedef struct {
    int64_t batch, seq;      /* micro-batch B x S                                */
    int64_t grad_accum;      /* micro-batches per step (host token buffers)      */
    int train;               /* 1: gradients and optimizer state; 0: inference   */
    int compact;             /* centrifuge/strawman: compact activation copies   */
    double keep;             /* fraction kept in compact modes (0: all)          */
    int world;               /* data-parallel ranks (ZeRO-1 shards the state)    */
    int checkpoint;          /* host buffers of checkpoint saves (CPU backend)   */
    const char *freeze;      /* as cf_model_opts.freeze (frozen: no state)       */
    const cf_lora_opts *lora;/* adapters (rank > 0): only they are trained       */
    int tp;                  /* tensor parallel degree (0, 1: none): the estimate */
                             /* is one TP rank's (its heads, FFN and vocabulary   */
                             /* slices); world is then the data-parallel ranks    */
} cf_memory_opts;

typedef struct {
    uint64_t weights;        /* compute copy of every parameter                  */
    uint64_t optimizer;      /* fp32 gradients, master weights, AdamW m and v    */
    uint64_t activations;    /* saved activations and backward scratch, B x S    */
    uint64_t other;          /* LM-head chunk, host buffers, checkpoint buffers  */
    uint64_t total;
    uint64_t available;      /* free memory of the device (0: unknown)           */
    uint64_t device_total;
} cf_memory_estimate;

/* The estimate for a config on a backend (available is not filled). */
int cf_memory_estimate_config(const cf_config *cfg, cf_backend_kind backend, const cf_memory_opts *o,
                              cf_memory_estimate *est);
/* Reads the config that mo names (as cf_model_open would), estimates, asks
 * the backend for its free memory and fails with one line (the estimate,
 * what is available, what to try) when the estimate exceeds it. est may be
 * NULL. The environment variable CENTRIFUGE_NO_MEMORY_CHECK=1 skips the
 * comparison. */
int cf_memory_check(const cf_model_opts *mo, const cf_memory_opts *o, cf_memory_estimate *est);

/* ------------------------------------------------------------- training */

/* The training step of the library: for each micro-batch forward ->
 * selection -> filter -> backward (gradients accumulate), then gradient
 * reduction (data parallel) -> clipping -> AdamW. The loss of a step is
 * the mean over every counted token of the step's micro-batches, so the
 * gradient does not depend on how the batch is split. */
typedef struct {
    cf_mode mode;
    cf_select_opts select;   /* ignored in regular mode                    */
    int batch, seq;          /* micro-batch shape B x S                    */
    int grad_accum;          /* micro-batches per optimizer step (>= 1)    */
    cf_adamw_params adamw;   /* lr is overridden by cf_trainer_step's lr   */
} cf_train_opts;

typedef struct {
    const int32_t *tokens;   /* B*(S+1) ids, rows of S+1                   */
    const float *ref;        /* B*S reference losses (select ref) or NULL  */
} cf_micro_batch;

typedef struct {
    double loss;             /* mean loss over the counted tokens          */
    int64_t tokens;          /* tokens in the step (all micro-batches)     */
    int64_t kept;            /* counted (kept) tokens                      */
    float grad_norm;         /* before clipping                            */
    int skipped;             /* 1 if the step was skipped (non-finite)     */
    cf_timings t;            /* summed over micro-batches                  */
} cf_step_stats;

typedef struct cf_trainer cf_trainer;
cf_trainer *cf_trainer_create(cf_model *m, const cf_train_opts *o);
void cf_trainer_free(cf_trainer *t);
/* One optimizer step over mb[0 .. grad_accum). A step whose loss or
 * gradient norm is not finite is skipped (no update, gradients cleared)
 * and reported in st->skipped; that is not an error (returns 0). */
int cf_trainer_step(cf_trainer *t, const cf_micro_batch *mb, float lr, cf_step_stats *st);
/* The index of the next step (0 for a fresh run; the checkpoint's step on
 * resume): random selection is seeded by it, so a resumed run selects as
 * the uninterrupted one would. */
void cf_trainer_set_step(cf_trainer *t, int64_t step);
/* Data-parallel rank and world size of the trainer (0 and 1 alone). */
int cf_trainer_rank(const cf_trainer *t);
int cf_trainer_world(const cf_trainer *t);

/* ------------------------------------------------------- data parallel */

/* Data-parallel training with ZeRO-1 over NCCL, one process per GPU,
 * launched by torchrun, srun or mpirun (docs/DISTRIBUTED.md). */
typedef struct cf_dist cf_dist;

/* Reads the launch environment. A single process (no launcher variables,
 * or a world of 1) gives *out = NULL and returns 0. Otherwise picks this
 * rank's GPU (its local rank) and creates the communicator, waiting at most
 * timeout_s for the other ranks (<= 0: 600 s); every later collective has
 * the same bound, so a dead or hung rank makes the others fail, not hang. */
int cf_dist_init(cf_dist **out, double timeout_s);
/* As cf_dist_init, with tensor parallelism of degree tp (Megatron-style,
 * docs/DISTRIBUTED.md): the world splits into world/tp data-parallel
 * groups of tp consecutive ranks (TP innermost, so a TP group shares a
 * host's NVLink); ZeRO-1 runs across the groups. tp must divide the world
 * size; tp = 1 is plain data parallelism; tp > 1 with a single process is
 * refused (it needs a launcher). */
int cf_dist_init_tp(cf_dist **out, int tp, double timeout_s);
void cf_dist_free(cf_dist *d);
/* Aborts the communicator at once (peers then fail fast). */
void cf_dist_abort(cf_dist *d);
int cf_dist_rank(const cf_dist *d);
int cf_dist_world(const cf_dist *d);
/* Tensor- and data-parallel coordinates: world = tp x dp; data (the
 * loader's part of each batch) is split by the data-parallel rank. */
int cf_dist_tp(const cf_dist *d);
int cf_dist_tp_rank(const cf_dist *d);
int cf_dist_dp(const cf_dist *d);
int cf_dist_dp_rank(const cf_dist *d);
/* Tensor-parallel all-reduce traffic since the last call (then reset):
 * payload bytes per rank, calls and seconds on the communication stream,
 * for the forward, the backward and the optimizer step. */
typedef struct {
    int64_t calls[3], bytes[3];
    double seconds[3];
} cf_tp_traffic;
int cf_dist_tp_traffic(cf_dist *d, cf_tp_traffic *out);
int cf_dist_device(const cf_dist *d);
/* The data-parallel gradient reduction's wire format, before
 * cf_dist_open_model: 0 fp32 (the default: the exact sum of the ranks'
 * fp32 gradients), 1 bf16 (half the bytes, as PyTorch's DDP reduces bf16
 * models: each bucket is rounded to bf16 into the bf16 weights of its own
 * layer, which are dead until the step's all-gather rewrites them, summed
 * in bf16 by NCCL and widened back to fp32 in the local shard). */
int cf_dist_set_grad_bf16(cf_dist *d, int bf16);
/* "torchrun: rank 1 of 2 (local 1 of 2), rendezvous ..." */
const char *cf_dist_describe(const cf_dist *d);
/* Opens the model on this rank's GPU with its ZeRO-1 shard of master
 * weights and AdamW state and the gradient reduction installed:
 * cf_trainer_step then trains the global batch of all ranks. */
cf_model *cf_dist_open_model(cf_dist *d, const cf_model_opts *o);
/* Fails on every rank unless all ranks pass the same value (e.g. a hash of
 * the arguments): "ranks disagree on <what>". */
int cf_dist_agree(cf_dist *d, uint64_t value, const char *what);
/* Checkpoints of a data-parallel run: rank 0 writes the model (bf16) and
 * `latest`, every rank its optimizer shard; `latest` moves only when every
 * rank's shard is on disk. Collective: all ranks call it. */
int cf_dist_checkpoint_save(cf_dist *d, cf_model *m, const char *dir, int64_t step, int64_t data_pos,
                            int keep_last);
/* Loads the newest checkpoint of dir written with the same world size
 * (another world size is refused with a clear message). Collective. */
cf_model *cf_dist_checkpoint_load(cf_dist *d, const char *dir, const cf_model_opts *opts, int64_t *step,
                                  int64_t *data_pos);

/* --------------------------------------------------------------- data */

/* Token shards: header of 256 int32 little-endian ([0] magic, [1] version,
 * [2] token count), then the tokens: version 1 = uint16 (llm.c), 2 =
 * uint32. */
#define CF_TOKENS_MAGIC 20240520
#define CF_TOKENS_V_U16 1
#define CF_TOKENS_V_U32 2

typedef struct {
    char *path;
    int64_t n;          /* token count */
    int width;          /* 2 or 4 bytes */
    void *data;         /* n tokens, inside the mapping (not owned) */
    size_t map_len;     /* total mapping length */
    void *map;          /* mmap base */
    uint32_t max_id;    /* largest token id in the shard */
    uint64_t hash;      /* FNV-1a of the token payload as stored */
} cf_tokens;

/* Opens and validates a token shard. If vocab_size > 0, any id >= vocab_size
 * fails (naming the first offending position). */
int cf_tokens_open(cf_tokens *t, const char *path, int vocab_size);
void cf_tokens_close(cf_tokens *t);
static inline uint32_t cf_tokens_get(const cf_tokens *t, int64_t i) {
    return t->width == 2 ? ((const uint16_t *)t->data)[i] : ((const uint32_t *)t->data)[i];
}
/* Writes a shard; width 0 picks uint16 when every id fits, else uint32. Atomic. */
int cf_tokens_write(const char *path, const uint32_t *tokens, int64_t n, int width);

/* Reference-loss shards: header of 256 int32 ([0] magic, [1] version 1,
 * [2] count == token count, [3],[4] low/high 32 bits of the token shard's
 * hash), then count float32: ref[i] is the reference loss of predicting
 * token i (ref[0] = 0). */
#define CF_REFLOSS_MAGIC 20251121
#define CF_REFLOSS_VERSION 1

typedef struct {
    char *path;
    int64_t n;
    float *loss;        /* heap copy, n floats */
    uint64_t token_hash;
} cf_refloss;

/* Opens and validates a ref-loss shard; if tokens != NULL it must belong to
 * that token shard (same count and hash). Non-finite or negative losses fail. */
int cf_refloss_open(cf_refloss *r, const char *path, const cf_tokens *tokens);
void cf_refloss_close(cf_refloss *r);
int cf_refloss_write(const char *path, const float *loss, int64_t n, uint64_t token_hash);

/* Sequential micro-batches of B rows of S+1 tokens (rows overlap by one
 * token, as in llm.c); wraps around at the end of the shard. With
 * rank/world (data parallel) rank r reads the r-th micro-batch of every
 * group of `world` consecutive ones, so the ranks read disjoint data. */
typedef struct {
    const cf_tokens *tok;
    const cf_refloss *ref;  /* may be NULL */
    int B, S;
    int rank, world;
    int64_t pos;            /* index of the next group's first token */
} cf_loader;

int cf_loader_init(cf_loader *ld, const cf_tokens *tok, const cf_refloss *ref, int B, int S);
/* Makes this loader rank `rank` of `world` (after init; fails if the shard
 * holds less than one micro-batch per rank). */
int cf_loader_set_rank(cf_loader *ld, int rank, int world);
/* Fills tokens[B*(S+1)] and, if ref_out, ref_out[B*S] (ref loss of each
 * target), then advances. */
void cf_loader_next(cf_loader *ld, int32_t *tokens, float *ref_out);

/* A training set: one or more token shards (with their reference-loss
 * shards) read as micro-batches of B rows of S+1 tokens, in order or in a
 * seeded shuffle. Its whole reading state is one int64 position
 * (cf_dataset_tell / cf_dataset_seek), which checkpoints save, so a resumed
 * run reads exactly what the uninterrupted one would have read.
 *
 *   sequential (shuffle = 0): the shards one after the other; inside a
 *     shard, micro-batches of B*S consecutive tokens plus the next one (rows
 *     overlap by one token, as in llm.c); a shard's tail too short for a
 *     whole group of `world` micro-batches is skipped, and after the last
 *     shard reading starts again at the first. Position = token offset in
 *     the shards laid end to end. With one shard this reads exactly what
 *     cf_loader reads, and the position means the same.
 *   shuffled (shuffle = 1): the unit is a row of S+1 tokens at stride S
 *     (row j of a shard starts at token j*S). Every epoch visits every row
 *     of every shard once, in an order that a keyed bijection of the row
 *     index gives (new key each epoch, from seed and epoch): no index table,
 *     so any position is reached in O(1). Position = rows read so far.
 *
 * Data parallel (cf_dataset_set_rank): as cf_loader, rank r reads the r-th
 * micro-batch of each group of `world` consecutive ones. */
typedef struct cf_dataset cf_dataset;

typedef struct {
    int B, S;            /* micro-batch shape                               */
    int shuffle;         /* 0 sequential, 1 shuffled rows                   */
    uint64_t seed;       /* of the shuffle                                  */
} cf_dataset_opts;

/* Opens the token shards that `tokens` names: a comma-separated list of
 * paths and glob patterns (each pattern's matches in byte order; files
 * ending in .ref.bin are never token shards and are skipped by patterns).
 * `ref` names their reference-loss shards: NULL for none; "auto" for X.ref.bin
 * beside every X.bin; or a list/patterns with one ref shard per token shard,
 * in the same order. Each ref shard must belong to its token shard (count
 * and hash). vocab_size > 0 refuses ids >= vocab_size. A shard too short
 * for one row (sequential: one group of micro-batches) is never read; if no
 * shard can be read, opening fails. */
cf_dataset *cf_dataset_open(const char *tokens, const char *ref, int vocab_size, const cf_dataset_opts *o);
/* A dataset over one shard already open (not owned: keep tok and ref open
 * while the dataset lives), e.g. tokens generated in memory. */
cf_dataset *cf_dataset_wrap(const cf_tokens *tok, const cf_refloss *ref, const cf_dataset_opts *o);
void cf_dataset_free(cf_dataset *d);
/* Makes this dataset rank `rank` of `world` (fails if the data holds less
 * than one micro-batch per rank). */
int cf_dataset_set_rank(cf_dataset *d, int rank, int world);
/* Fills tokens[B*(S+1)] and, if ref_out, ref_out[B*S] (the reference loss
 * of each target), then advances. Fails only if ref_out is asked of a
 * dataset without ref shards. */
int cf_dataset_next(cf_dataset *d, int32_t *tokens, float *ref_out);
int64_t cf_dataset_tell(const cf_dataset *d);
/* Sets the position (a value cf_dataset_tell returned, or 0). */
int cf_dataset_seek(cf_dataset *d, int64_t pos);

int cf_dataset_num_shards(const cf_dataset *d);
const cf_tokens *cf_dataset_shard(const cf_dataset *d, int i);
/* Path of ref shard i, or NULL without ref shards. */
const char *cf_dataset_ref_path(const cf_dataset *d, int i);
int cf_dataset_has_ref(const cf_dataset *d);
int64_t cf_dataset_num_tokens(const cf_dataset *d);
/* Largest token id over all shards, and the shard holding it. */
uint32_t cf_dataset_max_id(const cf_dataset *d, int *shard);
/* Tokens that one pass (epoch) reads: every row in shuffled mode; in
 * sequential mode the tokens of the groups that fit in each shard. */
int64_t cf_dataset_epoch_tokens(const cf_dataset *d);
/* A hash of what the reading depends on: the shards' contents in order,
 * B, S, shuffle, seed and world (for resume checks). */
uint64_t cf_dataset_fingerprint(const cf_dataset *d);

/* Expands a comma-separated list of paths and glob patterns into paths
 * (patterns: matches in byte order, *.ref.bin skipped unless want_ref).
 * A pattern that matches nothing, or a missing plain path, fails. *out is
 * an array of malloc'd strings (free each, then the array). */
int cf_expand_paths(const char *spec, int want_ref, char ***out, int *n);

/* ---------------------------------------------------------- checkpoints */

/* dir/step_NNNNNNNN/{config.json, model.safetensors, state.bin} and
 * dir/latest naming the newest complete one; state.bin holds the AdamW
 * moments, the step and the data position. */
int cf_checkpoint_save(cf_model *m, const char *dir, int64_t step, int64_t data_pos, int keep_last);
/* Loads the newest checkpoint of dir into a new model; sets *step, *data_pos. */
cf_model *cf_checkpoint_load(const char *dir, const cf_model_opts *opts, int64_t *step, int64_t *data_pos);

/* ----------------------------------------------------- evaluate, decode */

/* Mean per-token loss over up to max_batches batches of a shard (0 = all);
 * each per-token loss is also written to losses_out when it is not NULL. */
int cf_evaluate(cf_model *m, const cf_tokens *tok, int B, int S, int max_batches, double *mean_loss,
                int64_t *ntokens, FILE *losses_out);

/* Extends each of the n sequences seqs[i][0..lens[i]) by up to max_new
 * tokens (never past cap), greedy if temperature <= 0 (else sampled from
 * the top_k, 0 = all). A row stops after emitting stop1 or stop2 (-2 for
 * none). */
int cf_generate(cf_model *m, uint32_t **seqs, int *lens, int n, int cap, int max_new, float temperature,
                int top_k, int stop1, int stop2, uint64_t seed);
/* The same with any number of stop ids: a row stops after emitting any of
 * stops[0..nstops) (negative entries never match). */
int cf_generate_stops(cf_model *m, uint32_t **seqs, int *lens, int n, int cap, int max_new, float temperature,
                      int top_k, const int *stops, int nstops, uint64_t seed);

#ifdef __cplusplus
}
#endif
#endif /* CENTRIFUGE_H */
