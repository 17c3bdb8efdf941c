/*
 * evaluate.c — what a trained model is used for: the mean loss over a shard
 * and decoding (greedy or sampled, batched over prompts).
 *
 * Decoding has no KV cache: each new token reruns the forward over the
 * batch. Rows are right-padded; causal attention means the padding after a
 * row's last token never changes the logits that choose its next token.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/common.h"
#include "centrifuge.h"

int cf_evaluate(cf_model *m, const cf_tokens *tok, int B, int S, int max_batches, double *mean_loss,
                int64_t *ntokens, FILE *losses_out) {
    cf_loader ld = {0};
    if (cf_loader_init(&ld, tok, NULL, B, S) != 0) return -1;
    int64_t avail = (tok->n - 1) / ((int64_t)B * S);
    int nb = max_batches > 0 && max_batches < avail ? max_batches : (int)avail;
    int32_t *tokens = cf_malloc((size_t)B * (S + 1) * sizeof(int32_t));
    float *losses = cf_malloc((size_t)B * S * sizeof(float));
    if (!tokens || !losses) { free(tokens); free(losses); return -1; }
    double sum = 0;
    int64_t count = 0;
    for (int i = 0; i < nb; i++) {
        cf_loader_next(&ld, tokens, NULL);
        if (cf_forward(m, tokens, B, S, losses) != 0) { free(tokens); free(losses); return -1; }
        for (int t = 0; t < B * S; t++) {
            sum += losses[t];
            if (losses_out) fprintf(losses_out, "%.7f\n", losses[t]);
        }
        count += (int64_t)B * S;
    }
    free(tokens);
    free(losses);
    *mean_loss = count ? sum / count : NAN;
    if (ntokens) *ntokens = count;
    return 0;
}


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
    int stops[2] = {stop1, stop2};
    return cf_generate_stops(m, seqs, lens, n, cap, max_new, temperature, top_k, stops, 2, seed);
}

static int is_stop(int id, const int *stops, int nstops) {
    for (int i = 0; i < nstops; i++)
        if (stops[i] >= 0 && stops[i] == id) return 1;
    return 0;
}

int cf_generate_stops(cf_model *m, uint32_t **seqs, int *lens, int n, int cap, int max_new, float temperature,
                      int top_k, const int *stops, int nstops, uint64_t seed) {
    if (nstops > 0 && !stops) return cf_fail("cf_generate_stops: stops is NULL");
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
            if (is_stop(next, stops, nstops)) done[i] = 1;
        }
        free(idx);
        free(tok);
        if (rc) break;
    }
    free(done);
    free(logits);
    return rc;
}

