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
#include "cmd/progress.h"

/* Registers the files a command reads (docs/ROBUSTNESS.md §6), so that an
 * output that is one of them fails before any work. */
static void register_inputs(const char *model_dir, const char *data) {
    cf_inputs_begin_run();
    cf_input_register(data);
    char **paths = NULL, err[1024];
    int np = 0;
    snprintf(err, sizeof err, "%s", cf_last_error());
    if (data && cf_expand_paths(data, 0, &paths, &np) == 0) {   /* lists and patterns: every shard */
        for (int i = 0; i < np; i++) { cf_input_register(paths[i]); free(paths[i]); }
        free(paths);
    }
    cf_fail("%s", err);   /* a missing shard is the reader's to report */
    static const char *const MODEL_FILES[] = {"config.json", "model.safetensors", "model.safetensors.index.json"};
    char p[4096];
    for (size_t i = 0; model_dir && i < sizeof MODEL_FILES / sizeof *MODEL_FILES; i++)
        if (cf_path_join(p, sizeof p, model_dir, MODEL_FILES[i]) == 0) cf_input_register(p);
}

/* ----------------------------------------------------------------- eval */

int cmd_eval(int argc, char **argv) {
    const char *config = NULL, *model_dir = NULL, *data = NULL, *device = "cpu", *losses_out = NULL;
    const char *adapter = NULL;
    long batch = 4, seq = 256, max_batches = 0, seed = 1337;
    int quiet = 0;
    cf_opt opts[] = {
        {"--model", CF_OPT_STR, &model_dir, 0, 0, "HF model directory or run directory", 0},
        {"--config", CF_OPT_STR, &config, 0, 0, "or a config (random weights from --seed)", 0},
        {"--adapter", CF_OPT_STR, &adapter, 0, 0, "PEFT LoRA adapter directory (or LoRA run directory) on --model", 0},
        {"--data", CF_OPT_STR, &data, 0, 0, "token shards: a file, a comma list or a quoted glob (required)", 0},
        {"--batch", CF_OPT_INT, &batch, 1, 65536, "sequences per batch (default 4)", 0},
        {"--seq", CF_OPT_INT, &seq, 1, 1 << 20, "positions per sequence (default 256)", 0},
        {"--max-batches", CF_OPT_INT, &max_batches, 0, 1L << 30, "0 = the whole shard", 0},
        {"--losses-out", CF_OPT_STR, &losses_out, 0, 0, "write per-token losses (text, one per line)", 0},
        {"--device", CF_OPT_STR, &device, 0, 0, "cpu or cuda", 0},
        {"--seed", CF_OPT_INT, &seed, 0, 1L << 62, "seed for --config", 0},
        {"--quiet", CF_OPT_FLAG, &quiet, 0, 0, "no progress line", 0},
    };
    int nopts = (int)(sizeof opts / sizeof *opts);
    int pr = cf_cli_parse("eval", "--model DIR --data SHARDS [options]\n\nMean per-token loss and perplexity over token shards "
                          "(windows of --batch x --seq\nin order; --model takes a model or a run directory).",
                          opts, nopts, argc, argv);
    if (pr == 1) return 0;
    if (pr < 0) return cf_cli_error("eval", 2);
    if (cf_cli_check_single_process("eval") != 0) return cf_cli_error("eval", 2);
    if (cf_cli_check_model_flags(config, model_dir, device) != 0) return cf_cli_error("eval", 2);
    if (!data) { cf_fail("--data is required"); return cf_cli_error("eval", 2); }
    if (!model_dir && !config) { cf_fail("--model (or --config) is required"); return cf_cli_error("eval", 2); }
    register_inputs(model_dir, data);
    if (config) cf_input_register(config);
    if (losses_out && cf_output_check(losses_out) != 0) return cf_cli_error("eval", 1);
    if (adapter) cf_input_register(adapter);
    cf_model *m = cf_cli_open_model_adapter(config, model_dir, device, (uint64_t)seed, adapter);
    if (!m) return cf_cli_error("eval", 1);
    cf_dataset_opts dso = {(int)batch, (int)seq, 0, 0};
    cf_dataset *ds = cf_dataset_open(data, NULL, cf_model_config(m)->vocab_size, &dso);
    if (!ds) { cf_model_free(m); return cf_cli_error("eval", 1); }
    int rc = 0;
    /* an atomic file: a failure leaves no partial output, and an old file
     * of that name as it was */
    cf_atomic_file laf = {0};
    if (losses_out && cf_atomic_open(&laf, losses_out) != 0) rc = 1;
    FILE *lf = laf.f;
    double mean = 0;
    int64_t n = 0;
    /* windows in order through the shards (for one shard, what cf_evaluate
     * reads); per-token losses (for parity checks) in window order */
    int64_t avail = cf_dataset_epoch_tokens(ds) / (batch * seq);
    int64_t nb = max_batches > 0 && max_batches < avail ? max_batches : avail;
    int32_t *tk = rc == 0 ? cf_malloc((size_t)batch * (seq + 1) * sizeof(int32_t)) : NULL;
    float *ls = rc == 0 ? cf_malloc((size_t)batch * seq * sizeof(float)) : NULL;
    if (!tk || !ls) rc = 1;
    cf_progress pg;
    cf_progress_start(&pg, "eval", "tokens", nb * batch * seq, quiet);
    double sum = 0;
    for (int64_t i = 0; rc == 0 && i < nb; i++) {
        if (cf_dataset_next(ds, tk, NULL) != 0 || cf_forward(m, tk, (int)batch, (int)seq, ls) != 0) { rc = 1; break; }
        for (int64_t t = 0; t < batch * seq; t++) {
            sum += ls[t];
            if (lf) fprintf(lf, "%.7f\n", ls[t]);
        }
        n += batch * seq;
        cf_progress_update(&pg, n);
    }
    cf_progress_end(&pg);
    mean = n ? sum / n : NAN;
    free(tk);
    free(ls);
    if (lf) {
        if (rc == 0) rc = cf_atomic_commit(&laf) != 0;
        else cf_atomic_abort(&laf);
    }
    if (rc == 0) printf("eval: %lld tokens | loss %.6f | perplexity %.4f\n", (long long)n, mean, exp(mean));
    cf_dataset_free(ds);
    cf_model_free(m);
    return rc ? cf_cli_error("eval", 1) : 0;
}

/* ---------------------------------------------------------------- score */

/* X.bin -> X.ref.bin (X.ref.bin beside any other name). */
static int ref_path_of(const char *tokens, char *out, size_t cap) {
    size_t L = strlen(tokens);
    size_t stem = L > 4 && strcmp(tokens + L - 4, ".bin") == 0 ? L - 4 : L;
    if (stem + 9 > cap) return cf_fail("%s: path too long", tokens);
    memcpy(out, tokens, stem);
    strcpy(out + stem, ".ref.bin");
    return 0;
}

/* Reference losses of one shard: windows of seq+1 tokens with stride seq,
 * so token j (j >= 1) is predicted exactly once; the tail that does not
 * fill a window is scored with a shorter one. */
static int score_shard(cf_model *m, const cf_tokens *tok, const char *out, long batch, long seq, cf_progress *pg,
                       int64_t *done, double *mean) {
    int rc = 0;
    float *ref = cf_calloc((size_t)(tok->n ? tok->n : 1), sizeof(float));
    int32_t *tk = cf_malloc((size_t)batch * (seq + 1) * sizeof(int32_t));
    float *ls = cf_malloc((size_t)batch * seq * sizeof(float));
    if (!ref || !tk || !ls) rc = 1;
    int64_t j0 = 0;
    while (rc == 0 && j0 + 1 < tok->n) {
        int64_t remaining = tok->n - 1 - j0;   /* predictions left */
        int S = remaining >= seq ? (int)seq : (int)remaining;
        int B = (int)CF_MIN((int64_t)batch, remaining / S);
        for (int b = 0; b < B; b++)
            for (int s = 0; s <= S; s++) tk[b * (S + 1) + s] = (int32_t)cf_tokens_get(tok, j0 + (int64_t)b * S + s);
        if (cf_forward(m, tk, B, S, ls) != 0) { rc = 1; break; }
        for (int b = 0; b < B; b++)
            for (int s = 0; s < S; s++) ref[j0 + (int64_t)b * S + s + 1] = ls[b * S + s];
        j0 += (int64_t)B * S;
        cf_progress_update(pg, *done + j0);
    }
    *done += tok->n;
    if (rc == 0 && cf_refloss_write(out, ref, tok->n, tok->hash) != 0) rc = 1;
    if (rc == 0) {
        double sum = 0;
        for (int64_t j = 1; j < tok->n; j++) sum += ref[j];
        *mean = tok->n > 1 ? sum / (tok->n - 1) : 0.0;
    }
    free(ref); free(tk); free(ls);
    return rc ? -1 : 0;
}

int cmd_score(int argc, char **argv) {
    const char *model_dir = NULL, *data = NULL, *out = NULL, *device = "cpu";
    long batch = 8, seq = 256;
    int quiet = 0;
    cf_opt opts[] = {
        {"--model", CF_OPT_STR, &model_dir, 0, 0, "reference model or run directory (required)", 0},
        {"--data", CF_OPT_STR, &data, 0, 0, "token shards to score: a file, a comma list or a quoted glob (required)", 0},
        {"--out", CF_OPT_STR, &out, 0, 0, "reference-loss shard to write (one --data shard; default X.ref.bin)", 0},
        {"--batch", CF_OPT_INT, &batch, 1, 65536, "windows per forward (default 8)", 0},
        {"--seq", CF_OPT_INT, &seq, 1, 1 << 20, "window length (default 256)", 0},
        {"--device", CF_OPT_STR, &device, 0, 0, "cpu or cuda", 0},
        {"--quiet", CF_OPT_FLAG, &quiet, 0, 0, "no progress line", 0},
    };
    int nopts = (int)(sizeof opts / sizeof *opts);
    int pr = cf_cli_parse("score", "--model REF --data SHARDS [--out X.ref.bin] [options]\n\n"
                          "Per-token losses of a reference model, aligned to the token each predicts. Each\n"
                          "X.bin gets X.ref.bin beside it (what train --ref auto reads), or --out for one shard.",
                          opts, nopts, argc, argv);
    if (pr == 1) return 0;
    if (pr < 0) return cf_cli_error("score", 2);
    if (cf_cli_check_single_process("score") != 0) return cf_cli_error("score", 2);
    if (!model_dir || !data) { cf_fail("--model and --data are required"); return cf_cli_error("score", 2); }
    if (cf_cli_check_model_flags(NULL, model_dir, device) != 0) return cf_cli_error("score", 2);
    char **paths = NULL;
    int np = 0;
    /* a pattern that matches nothing is a missing file (run time), as in eval and train */
    if (cf_expand_paths(data, 0, &paths, &np) != 0) return cf_cli_error("score", 1);
    if (out && np > 1) {
        for (int i = 0; i < np; i++) free(paths[i]);
        free(paths);
        cf_fail("--out names one file, but --data names %d shards: leave --out out and each X.bin gets X.ref.bin", np);
        return cf_cli_error("score", 2);
    }
    /* every output is checked before any work: one that is an input (say
     * --out equal to --data) would destroy it */
    int rc = 0;
    register_inputs(model_dir, NULL);
    for (int i = 0; i < np; i++) cf_input_register(paths[i]);
    for (int i = 0; rc == 0 && i < np; i++) {
        char rp[4096];
        const char *o = out;
        if (!o && ref_path_of(paths[i], rp, sizeof rp) != 0) { rc = 1; break; }
        if (cf_output_check(o ? o : rp) != 0) rc = 1;
    }
    cf_model *m = rc == 0 ? cf_cli_open_model(NULL, model_dir, device, 0, NULL) : NULL;
    cf_tokens *toks = cf_calloc((size_t)np, sizeof *toks);
    if (!m || !toks) rc = 1;
    int64_t total = 0;
    for (int i = 0; rc == 0 && i < np; i++) {
        if (cf_tokens_open(&toks[i], paths[i], cf_model_config(m)->vocab_size) != 0) rc = 1;
        else total += toks[i].n;
    }
    double t0 = cf_now();
    cf_progress pg;
    cf_progress_start(&pg, "score", "tokens", total, quiet);
    int64_t done = 0;
    for (int i = 0; rc == 0 && i < np; i++) {
        char rp[4096];
        const char *o = out;
        if (!o) {
            if (ref_path_of(paths[i], rp, sizeof rp) != 0) { rc = 1; break; }
            o = rp;
        }
        double mean = 0, ts = cf_now();
        if (score_shard(m, &toks[i], o, batch, seq, &pg, &done, &mean) != 0) { rc = 1; break; }
        cf_progress_end(&pg);
        printf("score: wrote %s: %lld losses, mean %.4f, %.1fs\n", o, (long long)toks[i].n, mean, cf_now() - ts);
        fflush(stdout);
    }
    cf_progress_end(&pg);
    if (rc == 0 && np > 1)
        printf("score: %d shards, %lld tokens, %.1fs\n", np, (long long)total, cf_now() - t0);
    for (int i = 0; i < np; i++) {
        if (toks && toks[i].path) cf_tokens_close(&toks[i]);
        free(paths[i]);
    }
    free(paths);
    free(toks);
    cf_model_free(m);
    return rc ? cf_cli_error("score", 1) : 0;
}
