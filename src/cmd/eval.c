/*
 * eval.c — `centrifuge eval` (mean loss and perplexity over a shard, and
 * per-token losses for parity checks) and `centrifuge score` (a reference
 * model's per-token losses, the input of --select ref).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/common.h"
#include "centrifuge.h"
#include "cmd/cli.h"
#include "cmd/commands.h"

/* ----------------------------------------------------------------- eval */

int cmd_eval(int argc, char **argv) {
    const char *config = NULL, *model_dir = NULL, *data = NULL, *device = "cpu", *losses_out = NULL;
    long batch = 4, seq = 256, max_batches = 0, seed = 1337;
    cf_opt opts[] = {
        {"--model", CF_OPT_STR, &model_dir, 0, 0, "HF model directory", 0},
        {"--config", CF_OPT_STR, &config, 0, 0, "or a config (random weights from --seed)", 0},
        {"--data", CF_OPT_STR, &data, 0, 0, "token shard (required)", 0},
        {"--batch", CF_OPT_INT, &batch, 1, 65536, "sequences per batch (default 4)", 0},
        {"--seq", CF_OPT_INT, &seq, 1, 1 << 20, "positions per sequence (default 256)", 0},
        {"--max-batches", CF_OPT_INT, &max_batches, 0, 1L << 30, "0 = the whole shard", 0},
        {"--losses-out", CF_OPT_STR, &losses_out, 0, 0, "write per-token losses (text, one per line)", 0},
        {"--device", CF_OPT_STR, &device, 0, 0, "cpu or cuda", 0},
        {"--seed", CF_OPT_INT, &seed, 0, 1L << 62, "seed for --config", 0},
    };
    int nopts = (int)(sizeof opts / sizeof *opts);
    int pr = cf_cli_parse("eval", "--model DIR --data X.bin [options]\n\nMean per-token loss and perplexity over a shard.",
                          opts, nopts, argc, argv);
    if (pr == 1) return 0;
    if (pr < 0) return cf_cli_error("eval", 2);
    if (!data) { cf_fail("--data is required"); return cf_cli_error("eval", 2); }
    if (!model_dir && !config) { cf_fail("--model (or --config) is required"); return cf_cli_error("eval", 2); }
    cf_model *m = cf_cli_open_model(config, model_dir, device, (uint64_t)seed, NULL);
    if (!m) return cf_cli_error("eval", 1);
    cf_tokens tok;
    if (cf_tokens_open(&tok, data, cf_model_config(m)->vocab_size) != 0) { cf_model_free(m); return cf_cli_error("eval", 1); }
    int rc = 0;
    FILE *lf = NULL;
    if (losses_out && !(lf = fopen(losses_out, "w"))) {
        cf_fail("%s: cannot create", losses_out);
        rc = 1;
    }
    double mean = 0;
    int64_t n = 0;
    /* per-token losses (for parity checks) in window order, one per line */
    if (rc == 0) rc = cf_evaluate(m, &tok, (int)batch, (int)seq, (int)max_batches, &mean, &n, lf) != 0;
    if (lf && fclose(lf) != 0 && rc == 0) rc = cf_fail("%s: write failed", losses_out) != 0;
    if (rc && lf) remove(losses_out);   /* no partial output */
    if (rc == 0) printf("eval: %lld tokens | loss %.6f | perplexity %.4f\n", (long long)n, mean, exp(mean));
    cf_tokens_close(&tok);
    cf_model_free(m);
    return rc ? cf_cli_error("eval", 1) : 0;
}

/* ---------------------------------------------------------------- score */

int cmd_score(int argc, char **argv) {
    const char *model_dir = NULL, *data = NULL, *out = NULL, *device = "cpu";
    long batch = 8, seq = 256;
    cf_opt opts[] = {
        {"--model", CF_OPT_STR, &model_dir, 0, 0, "reference model directory (required)", 0},
        {"--data", CF_OPT_STR, &data, 0, 0, "token shard to score (required)", 0},
        {"--out", CF_OPT_STR, &out, 0, 0, "reference-loss shard to write (required)", 0},
        {"--batch", CF_OPT_INT, &batch, 1, 65536, "windows per forward (default 8)", 0},
        {"--seq", CF_OPT_INT, &seq, 1, 1 << 20, "window length (default 256)", 0},
        {"--device", CF_OPT_STR, &device, 0, 0, "cpu or cuda", 0},
    };
    int nopts = (int)(sizeof opts / sizeof *opts);
    int pr = cf_cli_parse("score", "--model REF --data X.bin --out X.ref.bin [options]\n\n"
                          "Per-token losses of a reference model, aligned to the token each predicts.",
                          opts, nopts, argc, argv);
    if (pr == 1) return 0;
    if (pr < 0) return cf_cli_error("score", 2);
    if (!model_dir || !data || !out) { cf_fail("--model, --data and --out are required"); return cf_cli_error("score", 2); }
    cf_model *m = cf_cli_open_model(NULL, model_dir, device, 0, NULL);
    if (!m) return cf_cli_error("score", 1);
    cf_tokens tok;
    if (cf_tokens_open(&tok, data, cf_model_config(m)->vocab_size) != 0) { cf_model_free(m); return cf_cli_error("score", 1); }
    int rc = 0;
    float *ref = cf_calloc((size_t)tok.n, sizeof(float));
    int32_t *tk = cf_malloc((size_t)batch * (seq + 1) * sizeof(int32_t));
    float *ls = cf_malloc((size_t)batch * seq * sizeof(float));
    if (!ref || !tk || !ls) rc = 1;
    /* Windows of seq+1 tokens with stride seq: token j (j >= 1) is predicted
     * exactly once. The tail that does not fill a window is scored with a
     * shorter one. */
    int64_t j0 = 0;
    double t0 = cf_now(), last = t0;
    while (rc == 0 && j0 + 1 < tok.n) {
        int64_t remaining = tok.n - 1 - j0;   /* predictions left */
        int S = remaining >= seq ? (int)seq : (int)remaining;
        int B = (int)CF_MIN((int64_t)batch, remaining / S);
        for (int b = 0; b < B; b++)
            for (int s = 0; s <= S; s++) tk[b * (S + 1) + s] = (int32_t)cf_tokens_get(&tok, j0 + (int64_t)b * S + s);
        if (cf_forward(m, tk, B, S, ls) != 0) { rc = 1; break; }
        for (int b = 0; b < B; b++)
            for (int s = 0; s < S; s++) ref[j0 + (int64_t)b * S + s + 1] = ls[b * S + s];
        j0 += (int64_t)B * S;
        if (cf_now() - last > 2.0) {
            last = cf_now();
            fprintf(stderr, "score: %lld/%lld tokens (%.0f tok/s)\n", (long long)j0, (long long)tok.n, j0 / (last - t0));
        }
    }
    if (rc == 0 && cf_refloss_write(out, ref, tok.n, tok.hash) != 0) rc = 1;
    if (rc == 0) {
        double sum = 0;
        for (int64_t j = 1; j < tok.n; j++) sum += ref[j];
        printf("score: wrote %s: %lld losses, mean %.4f, %.1fs\n", out, (long long)tok.n,
               tok.n > 1 ? sum / (tok.n - 1) : 0.0, cf_now() - t0);
    }
    free(ref); free(tk); free(ls);
    cf_tokens_close(&tok);
    cf_model_free(m);
    return rc ? cf_cli_error("score", 1) : 0;
}

