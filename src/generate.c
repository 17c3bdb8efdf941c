/*
 * generate.c — greedy and sampled decoding, batched over prompts, and the
 * `centrifuge generate` command.
 *
 * There is no KV cache: each new token reruns the forward over the batch.
 * Rows are right-padded; causal attention means the padding after a row's
 * last token never changes the logits that choose its next token.
 */
#include "generate.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "commands.h"
#include "common.h"
#include "datagen.h"
#include "model_internal.h"
#include "train.h"

/* Picks the next token from logits: argmax when temperature <= 0, else
 * softmax(logits / temperature) restricted to the top_k (0 = all). */
static int pick(float *logits, int V, float temperature, int top_k, cf_rng *rng) {
    int best = 0;
    for (int v = 1; v < V; v++) if (logits[v] > logits[best]) best = v;
    if (temperature <= 0) return best;
    float cutoff = -INFINITY;
    if (top_k > 0 && top_k < V) {
        /* the k-th largest logit, by partial selection on a copy */
        float *tmp = malloc((size_t)V * sizeof(float));
        if (!tmp) return best;
        memcpy(tmp, logits, (size_t)V * sizeof(float));
        for (int i = 0; i < top_k; i++) {
            int arg = i;
            for (int v = i + 1; v < V; v++) if (tmp[v] > tmp[arg]) arg = v;
            float t = tmp[i]; tmp[i] = tmp[arg]; tmp[arg] = t;
        }
        cutoff = tmp[top_k - 1];
        free(tmp);
    }
    double sum = 0;
    for (int v = 0; v < V; v++) sum += logits[v] >= cutoff ? exp((logits[v] - logits[best]) / temperature) : 0.0;
    double r = cf_rng_uniform(rng) * sum;
    for (int v = 0; v < V; v++) {
        if (logits[v] < cutoff) continue;
        r -= exp((logits[v] - logits[best]) / temperature);
        if (r <= 0) return v;
    }
    return best;
}

int cf_generate(cf_model *m, uint32_t **seqs, int *lens, int n, int cap, int max_new, float temperature,
                int top_k, int stop1, int stop2, uint64_t seed) {
    const cf_config *c = cf_model_config(m);
    int V = c->vocab_size;
    cf_rng rng;
    cf_rng_seed(&rng, seed);
    int *done = cf_calloc((size_t)n, sizeof(int));
    float *logits = cf_malloc((size_t)V * sizeof(float));
    if (!done || !logits) { free(done); free(logits); return -1; }
    int rc = 0;
    for (int step = 0; step < max_new; step++) {
        int S = 0, active = 0;
        for (int i = 0; i < n; i++) {
            if (lens[i] >= cap) done[i] = 1;
            if (!done[i]) active++;
            S = CF_MAX(S, lens[i]);
        }
        if (!active) break;
        /* batch only the active rows */
        int *idx = cf_malloc((size_t)active * sizeof(int));
        int32_t *tok = cf_calloc((size_t)active * (S + 1), sizeof(int32_t));
        if (!idx || !tok) { free(idx); free(tok); rc = -1; break; }
        int a = 0;
        for (int i = 0; i < n; i++) {
            if (done[i]) continue;
            idx[a] = i;
            for (int s = 0; s < lens[i]; s++) tok[a * (S + 1) + s] = (int32_t)seqs[i][s];
            a++;
        }
        if (cf_forward(m, tok, active, S, NULL) != 0) { free(idx); free(tok); rc = -1; break; }
        for (a = 0; a < active; a++) {
            int i = idx[a];
            if (cf_model_logits_row(m, a * S + lens[i] - 1, logits) != 0) { rc = -1; break; }
            int next = pick(logits, V, temperature, top_k, &rng);
            seqs[i][lens[i]++] = (uint32_t)next;
            if (next == stop1 || next == stop2) done[i] = 1;
        }
        free(idx);
        free(tok);
        if (rc) break;
    }
    free(done);
    free(logits);
    return rc;
}

int cmd_generate(int argc, char **argv) {
    const char *model_dir = NULL, *prompt = NULL, *ids = NULL, *device = "cpu";
    long max_new = 64, top_k = 0, seed = 1;
    double temperature = 0;
    cf_opt opts[] = {
        {"--model", CF_OPT_STR, &model_dir, 0, 0, "model directory (required)", 0},
        {"--prompt", CF_OPT_STR, &prompt, 0, 0, "prompt text (byte tokenizer of the demo models)", 0},
        {"--prompt-ids", CF_OPT_STR, &ids, 0, 0, "or comma-separated token ids (any model)", 0},
        {"--max-new", CF_OPT_INT, &max_new, 1, 1 << 20, "tokens to generate (default 64)", 0},
        {"--temperature", CF_OPT_FLOAT, &temperature, 0, 100, "0 = greedy (default)", 0},
        {"--top-k", CF_OPT_INT, &top_k, 0, 1 << 30, "sample from the k most likely (0 = all)", 0},
        {"--seed", CF_OPT_INT, &seed, 0, 1L << 62, "sampling seed", 0},
        {"--device", CF_OPT_STR, &device, 0, 0, "cpu or cuda", 0},
    };
    int nopts = (int)(sizeof opts / sizeof *opts);
    int pr = cf_cli_parse("generate", "--model DIR (--prompt TEXT | --prompt-ids 1,2,3) [options]\n\n"
                          "Greedy (default) or sampled decoding.", opts, nopts, argc, argv);
    if (pr == 1) return 0;
    if (pr < 0) return cf_cli_error("generate", 2);
    if (!model_dir) { cf_fail("--model is required"); return cf_cli_error("generate", 2); }
    if (!prompt == !ids) { cf_fail("give exactly one of --prompt and --prompt-ids"); return cf_cli_error("generate", 2); }
    cf_model *m = cf_open_model(NULL, model_dir, device, 0);
    if (!m) return cf_cli_error("generate", 1);
    const cf_config *c = cf_model_config(m);
    int cap = (int)CF_MIN((long)c->max_position_embeddings, 4096L + max_new);
    uint32_t *seq = cf_malloc((size_t)(cap + max_new + 1) * sizeof(uint32_t));
    int len = 0, rc = 0;
    if (!seq) { cf_model_free(m); return cf_cli_error("generate", 1); }
    int byte_model = c->vocab_size >= CF_TOK_VOCAB && c->bos_token_id == CF_TOK_BOS;
    if (prompt) {
        if (!byte_model) { cf_fail("--prompt needs a byte-tokenizer model (bos %d); use --prompt-ids", CF_TOK_BOS); rc = 1; }
        else {
            seq[len++] = CF_TOK_BOS;
            len += cf_tok_encode(prompt, seq + len, cap - len);
        }
    } else {
        char *copy = strdup(ids), *save = NULL;
        for (char *t = strtok_r(copy, ",", &save); t && rc == 0; t = strtok_r(NULL, ",", &save)) {
            long v;
            if (cf_parse_int(t, 0, c->vocab_size - 1, "--prompt-ids", &v) != 0) rc = 1;
            else if (len < cap) seq[len++] = (uint32_t)v;
        }
        free(copy);
        if (rc == 0 && len == 0) { cf_fail("--prompt-ids: empty"); rc = 1; }
    }
    int start = len;
    if (rc == 0 && cf_generate(m, &seq, &len, 1, cap + (int)max_new, (int)max_new, (float)temperature,
                               (int)top_k, c->eos_token_id, -2, (uint64_t)seed) != 0)
        rc = 1;
    if (rc == 0) {
        if (byte_model) {
            char *text = cf_malloc((size_t)len * 4 + 16);
            if (text) {
                cf_tok_decode(seq, start, text, len * 4 + 16);
                printf("%s", text);
                cf_tok_decode(seq + start, len - start, text, len * 4 + 16);
                printf("\033[1m%s\033[0m\n", text);
                free(text);
            }
        } else {
            for (int i = start; i < len; i++) printf("%s%u", i > start ? "," : "", seq[i]);
            printf("\n");
        }
    }
    free(seq);
    cf_model_free(m);
    return rc ? cf_cli_error("generate", rc) : 0;
}
