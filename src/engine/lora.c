/*
 * lora.c — LoRA adapters in PEFT's file format, and merging them into the
 * base weights. (The adapters' math is in linear.c, their parameters in
 * model.c's add_adapters.)
 *
 * A PEFT LoRA adapter directory holds
 *   adapter_config.json        {"peft_type": "LORA", "r": 64, "lora_alpha": 128, "lora_dropout": 0.05,
 *                               "target_modules": ["q_proj", ...], "use_rslora": false, ...}
 *   adapter_model.safetensors  base_model.model.<module>.lora_A.weight  [r, in]
 *                              base_model.model.<module>.lora_B.weight  [out, r]
 * where <module> is the HF name, e.g. model.layers.3.self_attn.q_proj, so
 * PeftModel.from_pretrained(base, dir) loads what cf_lora_save writes.
 */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/common.h"
#include "engine/model_internal.h"
#include "formats/io.h"
#include "formats/json_util.h"

#define PEFT_PREFIX "base_model.model."

static const char *MODULES[7] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};

int cf_lora_save(cf_model *m, const char *dir, const char *base_name) {
    if (m->lora.rank <= 0) return cf_fail("the model has no LoRA adapters to save");
    if (cf_mkdir_p(dir) != 0) return -1;
    int n = 0;
    size_t total = 0;
    for (int i = 0; i < m->ntensors; i++)
        if (m->params[i].adapter) { n++; total += m->params[i].numel; }
    cf_st_item *items = cf_calloc((size_t)n, sizeof *items);
    float *host = cf_malloc(total * sizeof(float) + 1);
    char (*names)[160] = cf_calloc((size_t)n, sizeof *names);
    int rc = items && host && names ? 0 : -1;
    size_t off = 0;
    for (int i = 0, k = 0; rc == 0 && i < m->ntensors; i++) {
        const cf_param *p = &m->params[i];
        if (!p->adapter) continue;
        rc = cf_model_get_param(m, i, host + off);
        snprintf(names[k], sizeof names[k], PEFT_PREFIX "%s", p->name);
        items[k].name = names[k];
        items[k].data = host + off;
        items[k].ndim = 2;
        items[k].shape[0] = p->shape[0];
        items[k].shape[1] = p->shape[1];
        off += p->numel;
        k++;
    }
    char path[4096];
    if (rc == 0) rc = cf_path_join(path, sizeof path, dir, "adapter_model.safetensors");
    if (rc == 0) rc = cf_st_write(path, items, n, CF_DT_F32);
    free(items);
    free(host);
    free(names);
    if (rc != 0) return -1;
    /* adapter_config.json, with the fields PEFT reads */
    cf_sbuf b = {0};
    char printable[512];
    cf_sb_printf(&b, "{\n  \"peft_type\": \"LORA\",\n  \"task_type\": \"CAUSAL_LM\",\n");
    if (base_name) {
        /* a JSON string: the printable form has no quotes or backslashes left */
        cf_printable(base_name, printable, sizeof printable);
        for (char *c = printable; *c; c++)
            if (*c == '"' || *c == '\\') *c = '_';
        cf_sb_printf(&b, "  \"base_model_name_or_path\": \"%s\",\n", printable);
    } else {
        cf_sb_printf(&b, "  \"base_model_name_or_path\": null,\n");
    }
    cf_sb_printf(&b, "  \"r\": %d,\n  \"lora_alpha\": %.9g,\n  \"lora_dropout\": %.9g,\n  \"use_rslora\": %s,\n",
                 m->lora.rank, (double)m->lora.alpha, (double)m->lora.dropout, m->lora.rslora ? "true" : "false");
    cf_sb_printf(&b, "  \"target_modules\": [");
    int first = 1;
    for (int t = 0; t < 7; t++)
        if (m->lora.targets & (1u << t)) { cf_sb_printf(&b, "%s\"%s\"", first ? "" : ", ", MODULES[t]); first = 0; }
    cf_sb_printf(&b, "],\n  \"bias\": \"none\",\n  \"fan_in_fan_out\": false,\n  \"inference_mode\": true,\n"
                     "  \"init_lora_weights\": true,\n  \"modules_to_save\": null,\n  \"use_dora\": false,\n"
                     "  \"layers_to_transform\": null,\n  \"layers_pattern\": null,\n  \"rank_pattern\": {},\n"
                     "  \"alpha_pattern\": {},\n  \"revision\": null\n}\n");
    if (b.failed) { free(b.s); return cf_fail("out of memory writing adapter_config.json"); }
    rc = cf_path_join(path, sizeof path, dir, "adapter_config.json");
    if (rc == 0) rc = cf_write_file_atomic(path, b.s, b.len);
    free(b.s);
    return rc;
}

int cf_lora_read_config(const char *dir, cf_lora_opts *lo) {
    char path[4096];
    if (cf_path_join(path, sizeof path, dir, "adapter_config.json") != 0) return -1;
    char *text = cf_read_file(path, NULL, 1 << 20);
    if (!text) return -1;
    cJSON *j = cJSON_Parse(text);
    free(text);
    if (!j || !cJSON_IsObject(j)) { cJSON_Delete(j); return cf_fail("%s: not a JSON object", path); }
    int rc = 0;
    memset(lo, 0, sizeof *lo);
    const cJSON *v;
    if (!(v = cJSON_GetObjectItemCaseSensitive(j, "peft_type")) || !cJSON_IsString(v) || strcmp(v->valuestring, "LORA") != 0)
        rc = cf_fail("%s: peft_type is not \"LORA\"", path);
    if (rc == 0 && (!(v = cJSON_GetObjectItemCaseSensitive(j, "r")) || !cJSON_IsNumber(v) || v->valuedouble < 1 ||
                    v->valuedouble > 4096 || v->valuedouble != (int)v->valuedouble))
        rc = cf_fail("%s: \"r\" must be an integer in [1, 4096]", path);
    if (rc == 0) lo->rank = v->valueint;
    if (rc == 0 && (!(v = cJSON_GetObjectItemCaseSensitive(j, "lora_alpha")) || !cJSON_IsNumber(v) || !(v->valuedouble > 0)))
        rc = cf_fail("%s: \"lora_alpha\" must be a positive number", path);
    if (rc == 0) lo->alpha = (float)v->valuedouble;
    /* recorded as trained; only a training forward applies it (cf_model_set_train) */
    if (rc == 0 && (v = cJSON_GetObjectItemCaseSensitive(j, "lora_dropout")) && cJSON_IsNumber(v)) {
        lo->dropout = (float)v->valuedouble;
        if (!(v->valuedouble >= 0 && v->valuedouble < 1) || !(lo->dropout < 1))
            rc = cf_fail("%s: \"lora_dropout\" %g is outside [0, 1)", path, v->valuedouble);
    }
    /* flags that change the adapter's math must be booleans: a string
     * ("true") read as false would scale or build the adapter wrongly */
    static const char *const FLAGS[] = {"use_rslora", "use_dora"};
    for (size_t f = 0; rc == 0 && f < sizeof FLAGS / sizeof *FLAGS; f++)
        if ((v = cJSON_GetObjectItemCaseSensitive(j, FLAGS[f])) && !cJSON_IsNull(v) && !cJSON_IsBool(v))
            rc = cf_fail("%s: \"%s\" must be true or false, got %s", path, FLAGS[f], cf_json_kind(v));
    if (rc == 0 && (v = cJSON_GetObjectItemCaseSensitive(j, "use_rslora")) && cJSON_IsBool(v)) lo->rslora = cJSON_IsTrue(v);
    if (rc == 0 && (v = cJSON_GetObjectItemCaseSensitive(j, "use_dora")) && cJSON_IsTrue(v))
        rc = cf_fail("%s: DoRA adapters (use_dora) are not supported", path);
    /* PEFT features this engine does not apply: ignoring them would load a
     * different model than the adapter describes (full copies of modules
     * left out, other ranks or scales per module, adapters on every layer
     * instead of some), so they are refused */
    if (rc == 0 && (v = cJSON_GetObjectItemCaseSensitive(j, "modules_to_save")) && !cJSON_IsNull(v) &&
        !(cJSON_IsArray(v) && cJSON_GetArraySize(v) == 0))
        rc = cf_fail("%s: modules_to_save is not supported (the adapter holds full copies of modules)", path);
    static const char *const PATTERNS[] = {"rank_pattern", "alpha_pattern"};
    for (size_t f = 0; rc == 0 && f < sizeof PATTERNS / sizeof *PATTERNS; f++)
        if ((v = cJSON_GetObjectItemCaseSensitive(j, PATTERNS[f])) && !cJSON_IsNull(v) &&
            !(cJSON_IsObject(v) && !v->child))
            rc = cf_fail("%s: %s is not supported (one r and lora_alpha for every module)", path, PATTERNS[f]);
    if (rc == 0 && (v = cJSON_GetObjectItemCaseSensitive(j, "layers_to_transform")) && !cJSON_IsNull(v))
        rc = cf_fail("%s: layers_to_transform is not supported (adapters on every layer only)", path);
    /* newer PEFT fields with the same effect when set: a bias in lora_B, layers
     * stacked by replication, trained rows of the embedding, adapters on raw
     * parameters; their defaults (false, null, []) read */
    if (rc == 0 && (v = cJSON_GetObjectItemCaseSensitive(j, "lora_bias")) && !cJSON_IsNull(v) && !cJSON_IsFalse(v))
        rc = cf_fail("%s: lora_bias is not supported (adapters without a bias only)", path);
    static const char *const UNSET[] = {"layer_replication", "trainable_token_indices", "target_parameters"};
    for (size_t f = 0; rc == 0 && f < sizeof UNSET / sizeof *UNSET; f++)
        if ((v = cJSON_GetObjectItemCaseSensitive(j, UNSET[f])) && !cJSON_IsNull(v) &&
            !((cJSON_IsArray(v) || cJSON_IsObject(v)) && !v->child))
            rc = cf_fail("%s: %s is not supported", path, UNSET[f]);
    if (rc == 0 && (v = cJSON_GetObjectItemCaseSensitive(j, "bias")) && cJSON_IsString(v) && strcmp(v->valuestring, "none") != 0)
        rc = cf_fail("%s: bias \"%s\" is not supported (only \"none\")", path, v->valuestring);
    if (rc == 0) {
        const cJSON *tm = cJSON_GetObjectItemCaseSensitive(j, "target_modules"), *e;
        if (!tm || !cJSON_IsArray(tm)) rc = cf_fail("%s: \"target_modules\" must be a list of module names", path);
        cJSON_ArrayForEach(e, tm) {
            if (rc != 0) break;
            if (!cJSON_IsString(e)) { rc = cf_fail("%s: target_modules holds a non-string", path); break; }
            unsigned bit = 0;
            if (cf_lora_parse_targets(e->valuestring, &bit) != 0) { rc = cf_fail("%s: %s", path, cf_last_error()); break; }
            lo->targets |= bit;
        }
        if (rc == 0 && !lo->targets) rc = cf_fail("%s: target_modules is empty", path);
    }
    cJSON_Delete(j);
    return rc;
}

int cf_lora_load(cf_model *m, const char *dir) {
    if (m->lora.rank <= 0) return cf_fail("%s: the model was opened without LoRA adapters", dir);
    char path[4096];
    if (cf_path_join(path, sizeof path, dir, "adapter_model.safetensors") != 0) return -1;
    cf_st_archive ar;
    if (cf_st_open(&ar, path) != 0) return -1;
    int rc = 0;
    for (int i = 0; rc == 0 && i < m->ntensors; i++) {
        const cf_param *p = &m->params[i];
        if (!p->adapter) continue;
        char name[160];
        snprintf(name, sizeof name, PEFT_PREFIX "%s", p->name);
        int k = cf_st_find(&ar, name);
        /* PEFT also writes the adapter name into keys of some versions */
        if (k < 0) {
            char alt[200];
            const char *w = strstr(name, ".weight");
            if (w) {
                snprintf(alt, sizeof alt, "%.*s.default.weight", (int)(w - name), name);
                k = cf_st_find(&ar, alt);
            }
        }
        if (k < 0) { rc = cf_fail("%s: missing tensor '%s'", path, name); break; }
        const cf_st_tensor *t = &ar.tensors[k];
        if (t->ndim != 2 || t->shape[0] != p->shape[0] || t->shape[1] != p->shape[1]) {
            rc = cf_fail("%s: '%s' has shape [%lld, %lld], the model needs [%lld, %lld]", path, name,
                         (long long)t->shape[0], t->ndim > 1 ? (long long)t->shape[1] : 0LL, (long long)p->shape[0],
                         (long long)p->shape[1]);
            break;
        }
        float *host = cf_malloc(p->numel * sizeof(float));
        if (!host) { rc = -1; break; }
        rc = cf_st_read_f32(&ar, k, host, p->numel);
        for (size_t e = 0; rc == 0 && e < p->numel; e++)
            if (!isfinite(host[e])) rc = cf_fail("%s: '%s' holds a non-finite value", path, name);
        if (rc == 0) rc = cf_optim_set_tensor(m, i, host);
        free(host);
    }
    cf_st_close(&ar);
    return rc;
}

/* W += scale * B A on the host in fp32, then B = 0 so the adapter adds
 * nothing any more. */
int cf_model_merge_lora(cf_model *m) {
    if (m->lora.rank <= 0) return cf_fail("the model has no LoRA adapters to merge");
    int r = m->lora.rank;
    for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
        cf_layer_params *p = &m->lp[l];
        cf_linear *lin[7] = {&p->q, &p->k, &p->v, &p->o, &p->gate, &p->up, &p->down};
        for (int t = 0; t < 7; t++) {
            if (lin[t]->la < 0) continue;
            const cf_param *w = &m->params[lin[t]->w];
            size_t N = (size_t)w->shape[0], K = (size_t)w->shape[1];
            float *W = cf_malloc(N * K * sizeof(float)), *A = cf_malloc((size_t)r * K * sizeof(float)),
                  *B = cf_malloc(N * (size_t)r * sizeof(float));
            int rc = W && A && B ? 0 : -1;
            if (rc == 0) rc = cf_model_get_param(m, lin[t]->w, W);
            if (rc == 0) rc = cf_model_get_param(m, lin[t]->la, A);
            if (rc == 0) rc = cf_model_get_param(m, lin[t]->lb, B);
            if (rc == 0) {
#pragma omp parallel for schedule(static)
                for (size_t n = 0; n < N; n++)
                    for (int k = 0; k < r; k++) {
                        float bk = m->lora_scale * B[n * (size_t)r + k];
                        if (bk == 0.0f) continue;
                        const float *ak = A + (size_t)k * K;
                        float *wn = W + n * K;
                        for (size_t c = 0; c < K; c++) wn[c] += bk * ak[c];
                    }
                rc = cf_model_set_param(m, lin[t]->w, W);
            }
            if (rc == 0) {
                memset(B, 0, N * (size_t)r * sizeof(float));
                rc = cf_model_set_param(m, lin[t]->lb, B);
            }
            free(W); free(A); free(B);
            if (rc != 0) return -1;
        }
    }
    return 0;
}
