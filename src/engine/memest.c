/*
 * memest.c — how much memory a run will allocate, from the config alone,
 * and a check against what the device has free (issue 12: a too-large
 * config, batch or sequence must fail with one line, not be killed by the
 * OOM killer after minutes of loading).
 *
 * The estimate mirrors the allocations of the engine (model.c, optim.c,
 * backward.c) with A = bytes per activation element (fp32 on the CPU, bf16
 * on the GPU), N parameters of which Nt are trained, T = B x S rows:
 *
 *   weights      N x A (the compute copy of every tensor)
 *   optimizer    Nt x 4 (gradients) + Nt x 12 / world (master, m, v; on the
 *                CPU with one process the fp32 compute copy is the master)
 *   activations  T x (bytes per row of every saved tensor, their compact
 *                copies in centrifuge/strawman mode, the backward scratch;
 *                training without TP: the LM head's kept g = softmax -
 *                onehot, V x A per row, when T V A fits its budget)
 *   other        the LM head's logits chunk; host token buffers; on the CPU
 *                the host copies a checkpoint save makes (N x 4 + Nt x 8)
 *
 * Allocator overheads and library workspaces are not counted, so the
 * estimate is a little below the real peak: it refuses only runs that
 * cannot fit.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "base/common.h"
#include "centrifuge.h"
#include "dist/tp_plan.h"
#include "engine/model_internal.h"

/* ------------------------------------------------------------- parameters */

/* Whether a tensor name matches the --freeze list (comma-separated
 * substrings, as model.c applies it). */
static int frozen(const char *name, const char *spec) {
    if (!spec || !*spec) return 0;
    const char *p = spec;
    while (*p) {
        const char *end = strchr(p, ',');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n > 0 && n < 128) {
            char pat[128];
            memcpy(pat, p, n);
            pat[n] = 0;
            if (strstr(name, pat)) return 1;
        }
        if (!end) break;
        p = end + 1;
    }
    return 0;
}

/* Adds a tensor of numel elements to *all, and to *trained unless frozen. */
static void count(const char *name, uint64_t numel, const char *freeze, uint64_t *all, uint64_t *trained) {
    *all += numel;
    if (!frozen(name, freeze)) *trained += numel;
}

/* The parameter table of model.c (build_param_table), by name and size. */
static void param_counts(const cf_config *c, const char *freeze, uint64_t *all, uint64_t *trained) {
    uint64_t C = (uint64_t)c->hidden_size, F = (uint64_t)c->intermediate_size, V = (uint64_t)c->vocab_size;
    uint64_t qd = (uint64_t)c->num_attention_heads * (uint64_t)c->head_dim;
    uint64_t kd = (uint64_t)c->num_key_value_heads * (uint64_t)c->head_dim;
    *all = *trained = 0;
    count("model.embed_tokens.weight", V * C, freeze, all, trained);
    char n[160];
    for (int l = 0; l < c->num_hidden_layers; l++) {
        struct { const char *what; uint64_t numel; int present; } t[] = {
            {"input_layernorm.weight", C, 1},
            {"self_attn.q_proj.weight", qd * C, 1}, {"self_attn.k_proj.weight", kd * C, 1},
            {"self_attn.v_proj.weight", kd * C, 1}, {"self_attn.q_proj.bias", qd, c->qkv_bias},
            {"self_attn.k_proj.bias", kd, c->qkv_bias}, {"self_attn.v_proj.bias", kd, c->qkv_bias},
            {"self_attn.o_proj.weight", C * qd, 1}, {"self_attn.o_proj.bias", C, c->o_bias},
            {"self_attn.q_norm.weight", (uint64_t)c->head_dim, c->qk_norm},
            {"self_attn.k_norm.weight", (uint64_t)c->head_dim, c->qk_norm},
            {"post_attention_layernorm.weight", C, 1},
            {"mlp.gate_proj.weight", F * C, 1}, {"mlp.up_proj.weight", F * C, 1}, {"mlp.down_proj.weight", C * F, 1},
        };
        for (size_t i = 0; i < sizeof t / sizeof *t; i++) {
            if (!t[i].present) continue;
            snprintf(n, sizeof n, "model.layers.%d.%s", l, t[i].what);
            count(n, t[i].numel, freeze, all, trained);
        }
    }
    count("model.norm.weight", C, freeze, all, trained);
    if (!c->tie_word_embeddings) count("lm_head.weight", V * C, freeze, all, trained);
}

/* LoRA: the base is frozen; the adapters A [rank, in] and B [out, rank] of
 * every targeted projection are the trained parameters. */
static void lora_counts(const cf_config *c, const cf_lora_opts *l, uint64_t *all, uint64_t *trained) {
    uint64_t C = (uint64_t)c->hidden_size, F = (uint64_t)c->intermediate_size, r = (uint64_t)l->rank;
    uint64_t qd = (uint64_t)c->num_attention_heads * (uint64_t)c->head_dim;
    uint64_t kd = (uint64_t)c->num_key_value_heads * (uint64_t)c->head_dim;
    struct { unsigned bit; uint64_t in, out; } t[] = {
        {CF_LORA_Q, C, qd}, {CF_LORA_K, C, kd}, {CF_LORA_V, C, kd}, {CF_LORA_O, qd, C},
        {CF_LORA_GATE, C, F}, {CF_LORA_UP, C, F}, {CF_LORA_DOWN, F, C},
    };
    uint64_t per_layer = 0;
    for (size_t i = 0; i < sizeof t / sizeof *t; i++)
        if (l->targets & t[i].bit) per_layer += r * (t[i].in + t[i].out);
    *trained = per_layer * (uint64_t)c->num_hidden_layers;
    *all += *trained;
}

/* ------------------------------------------------------------ activations */

/* The GPU LM head's logit size in bytes: 2 (bf16) unless
 * CF_LMHEAD_LOGITS=fp32 (lmhead.cu: lm_logit_bytes, which rejects other
 * values when the model runs; the estimate takes them as bf16). */
static uint64_t lmhead_logit_bytes(void) {
    const char *e = getenv("CF_LMHEAD_LOGITS");
    return e && strcmp(e, "fp32") == 0 ? 4 : 2;
}

/* Bytes per token row of the forward's saved tensors: gathered (copied to
 * the kept rows by the filter) and not (read through the row index). */
static void saved_row_bytes(const cf_config *c, uint64_t A, uint64_t *gathered, uint64_t *other) {
    uint64_t L = (uint64_t)c->num_hidden_layers, C = (uint64_t)c->hidden_size, F = (uint64_t)c->intermediate_size;
    uint64_t H = (uint64_t)c->num_attention_heads, Hkv = (uint64_t)c->num_key_value_heads;
    uint64_t qd = H * (uint64_t)c->head_dim, kd = Hkv * (uint64_t)c->head_dim;
    uint64_t layer = C * A /* ln1 */ + qd * A /* q */ + qd * A /* attn */ + H * 4 /* lse */ + C * A /* ln2 */;
    if (c->qk_norm) layer += qd * A + H * 4 + kd * A + Hkv * 4;
    *gathered = L * layer + C * A /* final norm */ + 3 * 4 /* ids */;
    *other = L * (2 * F * A /* gate, up */ + 2 * kd * A /* K, V: never compacted */) +
             (L + 1) * C * A /* residual stream */ + L * (C * A /* x_mid */ + 2 * 4 /* rstd1, rstd2 */) +
             4 /* final rstd */;
}

int cf_memory_estimate_config(const cf_config *cfg, cf_backend_kind backend, const cf_memory_opts *o,
                              cf_memory_estimate *est) {
    if (!cfg || !o || !est) return cf_fail("memory estimate: NULL argument");
    memset(est, 0, sizeof *est);
    if (o->batch <= 0 || o->seq <= 0) return cf_fail("memory estimate: batch and sequence must be positive");
    uint64_t A = backend == CF_BACKEND_CUDA ? 2 : 4, world = o->world > 1 ? (uint64_t)o->world : 1;
    uint64_t all = 0, trained = 0;
    param_counts(cfg, o->freeze, &all, &trained);
    if (o->lora && o->lora->rank > 0) lora_counts(cfg, o->lora, &all, &trained);
    est->weights = all * A;
    if (o->train) {
        int master_in_place = A == 4 && world == 1;
        est->optimizer = trained * 4 /* gradients */ + trained * (master_in_place ? 8 : 12) / world;
    }
    /* activations for T rows; overflow-safe: T <= 2^40, bytes per row < 2^40 */
    uint64_t T = (uint64_t)o->batch * (uint64_t)o->seq;
    uint64_t C = (uint64_t)cfg->hidden_size, F = (uint64_t)cfg->intermediate_size, V = (uint64_t)cfg->vocab_size;
    uint64_t qd = (uint64_t)cfg->num_attention_heads * (uint64_t)cfg->head_dim;
    uint64_t kd = (uint64_t)cfg->num_key_value_heads * (uint64_t)cfg->head_dim;
    uint64_t g = 0, ng = 0;
    saved_row_bytes(cfg, A, &g, &ng);
    uint64_t row = g + ng;
    /* the fused q/k/v GEMM's output, where it is wider than the scratch
     * buffer it otherwise uses (model.c, alloc_acts; assumed fused) */
    uint64_t tmp_wide = C > qd ? C : qd;
    if (F > tmp_wide) tmp_wide = F;
    if (!cfg->qk_norm && qd + 2 * kd > tmp_wide) row += (qd + 2 * kd) * A;
    if (o->train) {
        /* issue 17: the training forward's g [T, V] for the LM head's
         * backward (model.c, cf_forward), gathered like the others */
        if (o->tp <= 1 && cf_head_save_env() && T * V * A <= CF_HEAD_SAVE_MAX_BYTES) {
            row += V * A;
            g += V * A;
        }
        /* the filter's compact copies: allocated for T rows, touched for the kept ones */
        if (o->compact) row += (uint64_t)((double)g * (o->keep > 0 && o->keep < 1 ? o->keep : 1.0) + 0.5);
        uint64_t wide = C > qd ? C : qd;
        if (F > wide) wide = F;
        row += 2 * C * A + 3 * qd * A + 3 * kd * A + 3 * F * A + wide * A /* backward scratch */ +
               3 * 4 + 1 + 3 * 4 + 4 /* losses, dloss, ref, keep, doc, rows, seq_start, host losses */;
    } else {
        row += F * A + (C > F ? C : F) * A + 4 * 4 + 4;   /* h, tmp, losses, doc, host losses */
    }
    est->activations = T * row;
    /* the LM head's logits chunk. GPU (lmhead.cu: lm_chunk): logits of
     * esz bytes (bf16, or fp32 with CF_LMHEAD_LOGITS=fp32) and bf16
     * dlogits per element, in rows that stay under 1.5 GiB, and with bf16
     * logits each row's exact target logit (fp32). CPU: fp32 logits and
     * dlogits, 8 MiB of rows, at most 256. */
    const uint64_t esz = lmhead_logit_bytes();
    const uint64_t per = backend == CF_BACKEND_CUDA ? esz + 2 : 8;
    uint64_t lm_rows = backend == CF_BACKEND_CUDA ? ((uint64_t)3 << 29) / (V * per) : (8ull << 20) / V;
    if (lm_rows < 1) lm_rows = 1;
    if (backend != CF_BACKEND_CUDA && lm_rows > 256) lm_rows = 256;
    if (lm_rows > T) lm_rows = T;
    est->other = lm_rows * V * per + (backend == CF_BACKEND_CUDA && esz == 2 ? lm_rows * 4 : 0);
    /* host buffers (counted where they compete: the CPU backend) */
    if (backend == CF_BACKEND_CPU) {
        uint64_t accum = o->grad_accum > 0 ? (uint64_t)o->grad_accum : 1;
        est->other += accum * (uint64_t)o->batch * ((uint64_t)o->seq + 1) * 4 + accum * T * 4;
        if (o->checkpoint && o->train) est->other += all * 4 + trained * 12;   /* host copies of a save */
    }
    est->total = est->weights + est->optimizer + est->activations + est->other;
    return 0;
}

/* --------------------------------------------------------------- checking */

static double gib(uint64_t b) { return (double)b / 1073741824.0; }

int cf_memory_check(const cf_model_opts *mo, const cf_memory_opts *o, cf_memory_estimate *out) {
    cf_memory_estimate est;
    cf_config cfg;
    if (!mo || !o) return cf_fail("memory check: NULL argument");
    /* a config or backend that cannot be had fails later, in
     * cf_model_open, with its own message: nothing to estimate here */
    char saved[1024];
    snprintf(saved, sizeof saved, "%s", cf_last_error());
    cf_memory_opts oo = *o;
    cf_lora_opts adapter;
    if (!oo.lora && mo->lora.rank > 0) oo.lora = &mo->lora;
    if (!oo.lora && mo->adapter_dir && cf_lora_read_config(mo->adapter_dir, &adapter) == 0) oo.lora = &adapter;
    cf_tp_local loc;
    if (cf_model_opts_config(mo, &cfg) != 0 || cf_config_validate(&cfg) != 0 ||
        (oo.tp > 1 && cf_tp_local_config(&cfg, oo.tp, 0, &loc) != 0)) {
        cf_fail("%s", saved);
        if (out) memset(out, 0, sizeof *out);
        return 0;
    }
    if (oo.tp > 1) {
        /* one TP rank: the local model of the partition plan (rank 0 holds
         * the most vocabulary rows; the replicated norms are negligible) */
        cfg.num_attention_heads = loc.heads;
        cfg.num_key_value_heads = loc.kv_heads;
        cfg.intermediate_size = loc.intermediate;
        cfg.vocab_size = loc.vocab_local;
    }
    if (cf_memory_estimate_config(&cfg, mo->backend, &oo, &est) != 0) {
        cf_fail("%s", saved);
        if (out) memset(out, 0, sizeof *out);
        return 0;
    }
    cf_backend *b = mo->backend == CF_BACKEND_CUDA ? cf_backend_cuda_create(mo->device) : cf_backend_cpu_create();
    if (b) {
        size_t fr = 0, tot = 0;
        if (b->memory_info && b->memory_info(b, &fr, &tot) == 0) {
            est.available = fr;
            est.device_total = tot;
        }
        b->destroy(b);
    }
    cf_fail("%s", saved);
    if (out) *out = est;
    const char *skip = getenv("CENTRIFUGE_NO_MEMORY_CHECK");
    if (skip && *skip && strcmp(skip, "0") != 0) return 0;
    if (!est.available || est.total <= est.available) return 0;
    const char *where = mo->backend == CF_BACKEND_CUDA ? "on the GPU" : "on the host (MemAvailable)";
    const char *hint;
    if (est.activations >= est.weights + est.optimizer)
        hint = "try a smaller --batch or --seq (--grad-accum keeps the batch per step)";
    else if (mo->backend == CF_BACKEND_CUDA)
        hint = "try a smaller model, --freeze, or more GPUs (data parallel shards the optimizer state, --tp the "
               "whole model)";
    else
        hint = "try a smaller model or --freeze";
    return cf_fail("memory: this run needs about %.1f GiB (weights %.1f, optimizer %.1f, activations %.1f for "
                   "%lld x %lld tokens, other %.1f) but %.1f GiB is free %s; %s (CENTRIFUGE_NO_MEMORY_CHECK=1 "
                   "skips this check)",
                   gib(est.total), gib(est.weights), gib(est.optimizer), gib(est.activations), (long long)o->batch,
                   (long long)o->seq, gib(est.other), gib(est.available), where, hint);
}
