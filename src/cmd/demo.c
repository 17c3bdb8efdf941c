/*
 * demo.c — `centrifuge demo`: the whole pipeline on the synthetic math
 * world (its small variant: one-digit numbers, short questions), in about a
 * minute on two CPU cores.
 *
 *   1. data      clean problems (reference data), noisy web (target data),
 *                held-out clean text and held-out problems
 *   2. reference a 2-layer model trained from scratch on clean problems
 *   3. score     its per-token losses on the noisy corpus
 *   4. targets   the reference trained on, on the noisy corpus, in `regular`
 *                and in `centrifuge` mode (keep 0.5, select ref): continued
 *                pretraining on web data, the setting of RHO-1, with the
 *                starting model as its own reference
 *   5. evaluate  held-out clean loss and result accuracy (teacher-forced:
 *                every "= N" of the worked solution predicted right)
 *
 * Why these choices: a model this small learns the arithmetic facts only
 * after ~0.4M tokens of clean problems (measured: none before 400 steps of
 * 512 tokens, most by 800-1000), and it never learns in a minute the
 * long-range copying that free decoding needs (repeating an operand from the
 * question). Training targets from scratch on the noisy corpus would need
 * ~3x more tokens again. Continued training from a model that knows some
 * facts shows the effect in the budget: regular training on the noisy web
 * loses accuracy, centrifuge keeps it (docs/DEMO.md has runs of 3 seeds).
 *
 * Each phase runs the real subcommand (train, score) with real files in
 * --out, so the demo is also a worked example of the CLI.
 */
#include <ftw.h>
#include <math.h>
#include <stdarg.h>
#include <sys/stat.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "cmd/cli.h"
#include "cmd/commands.h"
#include "base/common.h"
#include "cmd/datagen.h"
#include "cmd/progress.h"
#include "formats/io.h"
#include "centrifuge.h"

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median of a numeric field over the JSON lines of a train --log file. */
static double log_median(const char *path, const char *field) {
    FILE *f = fopen(path, "r");
    if (!f) return NAN;
    char line[4096], key[64];
    snprintf(key, sizeof key, "\"%s\":", field);
    enum { MAXV = 1 << 20 };
    double *v = malloc(MAXV * sizeof(double));
    int n = 0;
    if (!v) { fclose(f); return NAN; }
    while (fgets(line, sizeof line, f) && n < MAXV) {
        char *p = strstr(line, key);
        if (p) v[n++] = strtod(p + strlen(key), NULL);
    }
    fclose(f);
    if (n == 0) { free(v); return NAN; }
    /* skip the first steps (warm-up: allocation, page faults) */
    int skip = n > 10 ? 3 : 0;
    qsort(v + skip, (size_t)(n - skip), sizeof *v, cmp_double);
    double med = v[skip + (n - skip) / 2];
    free(v);
    return med;
}

static int write_corpus(const char *path, cf_data_source src, uint64_t seed, int64_t n) {
    uint32_t *tok = cf_malloc((size_t)n * sizeof(uint32_t));
    if (!tok) return -1;
    int rc = cf_datagen_tokens(src, seed, n, tok);
    if (rc == 0) rc = cf_tokens_write(path, tok, n, 0);
    free(tok);
    return rc;
}

typedef struct {
    double clean_loss;
    int correct[CF_NUM_FAMILIES], total[CF_NUM_FAMILIES];
    char device[128];   /* what ran it, for records */
} eval_result;

/* Teacher-forced result accuracy: each problem's question and correct
 * worked solution go through one forward pass, and the problem counts as
 * solved when the model's most likely next token is right at every digit of
 * every result ("= 12") of the solution: the arithmetic of each step, given
 * the steps before it. Cheap (no decoding), and it needs no long-range
 * copying, which a tiny model on a CPU does not learn in a minute. */
static int result_accuracy(cf_model *m, const cf_problem *probs, int nprob, eval_result *r, cf_progress *pg) {
    enum { G = 8, L = 384, MAXD = 16 };
    int V = cf_model_config(m)->vocab_size;
    int32_t *tok = cf_malloc((size_t)G * L * sizeof(int32_t));
    float *logits = cf_malloc((size_t)V * sizeof(float));
    int rc = tok && logits ? 0 : -1;
    for (int i0 = 0; rc == 0 && i0 < nprob; i0 += G) {
        int k = nprob - i0 < G ? nprob - i0 : G;
        uint32_t ids[G][L];
        int len[G], dpos[G][MAXD], dval[G][MAXD], nd[G], S = 1;
        for (int b = 0; b < k; b++) {
            const cf_problem *p = &probs[i0 + b];
            int n = 0;
            ids[b][n++] = CF_TOK_BOS;
            int np = cf_tok_encode(p->prompt, ids[b] + n, L - 2 - n);
            n += np;
            int ns = cf_tok_encode(p->solution, ids[b] + n, L - 1 - n);
            /* the digits after each "= " of the solution */
            nd[b] = 0;
            for (int j = 0; j + 1 < ns && nd[b] < MAXD; j++) {
                if (p->solution[j] != '=' || p->solution[j + 1] != ' ') continue;
                for (int q = j + 2; q < ns && p->solution[q] >= '0' && p->solution[q] <= '9' && nd[b] < MAXD; q++) {
                    dpos[b][nd[b]] = n + q;       /* token index of the digit */
                    dval[b][nd[b]++] = (unsigned char)p->solution[q];
                }
            }
            n += ns;
            ids[b][n++] = CF_TOK_EOS;
            len[b] = n;
            if (n - 1 > S) S = n - 1;
        }
        /* rows of S+1 tokens, right-padded with EOS (causal: padding never
         * changes the logits of the positions before it) */
        for (int b = 0; b < k; b++)
            for (int t = 0; t <= S; t++) tok[b * (S + 1) + t] = (int32_t)(t < len[b] ? ids[b][t] : CF_TOK_EOS);
        if (cf_forward(m, tok, k, S, NULL) != 0) { rc = -1; break; }
        for (int b = 0; b < k && rc == 0; b++) {
            int ok = nd[b] > 0;
            for (int d = 0; d < nd[b] && ok && rc == 0; d++) {
                if (cf_model_logits_row(m, b * S + dpos[b][d] - 1, logits) != 0) { rc = -1; break; }
                int best = 0;
                for (int v = 1; v < V; v++) if (logits[v] > logits[best]) best = v;
                ok = best == dval[b][d];
            }
            int f = probs[i0 + b].family;
            r->total[f]++;
            r->correct[f] += ok;
        }
        cf_progress_update(pg, i0 + k);
    }
    free(tok);
    free(logits);
    return rc;
}

/* Held-out clean loss and accuracy of the model in dir: greedy decoding
 * (the answer parsed from "The answer is N."), or with teacher_forced the
 * result accuracy above. Progress on stderr as `what` unless quiet. */
static int evaluate_model(const char *dir, const char *device, const char *val_path, const cf_problem *probs,
                          int nprob, eval_result *r, const char *what, int quiet, int teacher_forced) {
    memset(r, 0, sizeof *r);
    r->clean_loss = NAN;
    cf_model *m = cf_cli_open_model(NULL, dir, device, 0, NULL);
    if (!m) return -1;
    snprintf(r->device, sizeof r->device, "%s", cf_model_device_name(m));
    int rc = 0;
    if (val_path) {
        cf_tokens val;
        rc = cf_tokens_open(&val, val_path, cf_model_config(m)->vocab_size);
        if (rc == 0) {
            rc = cf_evaluate(m, &val, 8, 128, 0, &r->clean_loss, NULL, NULL);
            cf_tokens_close(&val);
        }
    }
    if (teacher_forced) {
        cf_progress pg;
        cf_progress_start(&pg, what, "problems", nprob, quiet);
        if (rc == 0 && nprob > 0) rc = result_accuracy(m, probs, nprob, r, &pg);
        cf_progress_end(&pg);
        cf_model_free(m);
        return rc;
    }
    enum { CAP = 384, NEW = 56 };   /* two-step solutions run to ~50 bytes */
    uint32_t **seqs = cf_calloc((size_t)nprob, sizeof *seqs);
    int *lens = cf_calloc((size_t)nprob, sizeof *lens), *starts = cf_calloc((size_t)nprob, sizeof *starts);
    if (!seqs || !lens || !starts) rc = -1;
    for (int i = 0; rc == 0 && i < nprob; i++) {
        seqs[i] = cf_malloc(CAP * sizeof(uint32_t));
        if (!seqs[i]) { rc = -1; break; }
        seqs[i][0] = CF_TOK_BOS;
        lens[i] = 1 + cf_tok_encode(probs[i].prompt, seqs[i] + 1, CAP - NEW - 1);
        starts[i] = lens[i];
    }
    /* greedy; a row ends at EOS or at the newline that ends the solution.
     * In groups of 8 problems (the batch of one forward), for the progress line. */
    cf_progress pg;
    cf_progress_start(&pg, what, "problems", nprob, quiet);
    for (int i0 = 0; rc == 0 && i0 < nprob; i0 += 8) {
        int k = nprob - i0 < 8 ? nprob - i0 : 8;
        rc = cf_generate(m, seqs + i0, lens + i0, k, CAP, NEW, 0.0f, 0, CF_TOK_EOS, '\n', 0);
        cf_progress_update(&pg, i0 + k);
    }
    cf_progress_end(&pg);
    for (int i = 0; rc == 0 && i < nprob; i++) {
        char text[4 * CAP];
        cf_tok_decode(seqs[i] + starts[i], lens[i] - starts[i], text, sizeof text);
        long ans;
        int f = probs[i].family;
        r->total[f]++;
        if (cf_parse_answer(text, &ans) == 0 && ans == probs[i].answer) r->correct[f]++;
    }
    if (seqs) for (int i = 0; i < nprob; i++) free(seqs[i]);
    free(seqs); free(lens); free(starts);
    cf_model_free(m);
    return rc;
}

static int run_cmd(int (*fn)(int, char **), char **args) {
    int argc = 0;
    while (args[argc]) argc++;
    return fn(argc, args);
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st; (void)flag; (void)ftw;
    return remove(path) != 0 ? -1 : 0;
}

/* Removes what an earlier demo wrote in out (its three run directories and
 * two logs, and nothing else), so that `make demo` runs again: train refuses
 * an --out that holds another run's checkpoints. */
static int clear_previous(char *const *dirs, int n) {
    int found = 0;
    for (int i = 0; i < n; i++) {
        struct stat st;
        if (lstat(dirs[i], &st) != 0) continue;
        if (!found++) printf("demo: replacing the files of the previous demo\n");
        int rc = S_ISDIR(st.st_mode) ? nftw(dirs[i], rm_entry, 16, FTW_DEPTH | FTW_PHYS) : remove(dirs[i]);
        if (rc != 0) return cf_fail("%s: cannot remove the previous demo's files", dirs[i]);
    }
    return 0;
}

/* "[k/5] text (elapsed)" on stdout, at once */
static void stage(double t0, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void stage(double t0, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf(" (%.0fs)\n", cf_now() - t0);
    fflush(stdout);
}

int cmd_demo(int argc, char **argv) {
    const char *out = "runs/demo";
    long steps = 500, ref_steps = 1000, seed = 1, nprob = 192, batch = 4, seq = 128, layers = 2;
    double lr = 5e-4, ref_lr = 3e-3;
    cf_opt opts[] = {
        {"--out", CF_OPT_STR, &out, 0, 0, "working directory (default runs/demo)", 0},
        {"--steps", CF_OPT_INT, &steps, 1, 1000000, "target training steps per mode (default 500)", 0},
        {"--ref-steps", CF_OPT_INT, &ref_steps, 1, 1000000, "reference training steps (default 1000)", 0},
        {"--batch", CF_OPT_INT, &batch, 1, 1024, "sequences per step (default 4)", 0},
        {"--seq", CF_OPT_INT, &seq, 16, 1024, "tokens per sequence (default 128)", 0},
        {"--lr", CF_OPT_FLOAT, &lr, 1e-6, 1, "peak learning rate of the targets (default 5e-4)", 0},
        {"--ref-lr", CF_OPT_FLOAT, &ref_lr, 1e-6, 1, "peak learning rate of the reference (default 3e-3)", 0},
        {"--layers", CF_OPT_INT, &layers, 1, 64, "layers of the model (the tiny config's width; default 2)", 0},
        {"--problems", CF_OPT_INT, &nprob, 4, 100000, "held-out problems to evaluate (default 192)", 0},
        {"--seed", CF_OPT_INT, &seed, 0, 1L << 40, "seed of data and models (default 1)", 0},
    };
    int nopts = (int)(sizeof opts / sizeof *opts);
    int pr = cf_cli_parse("demo", "[--out DIR] [--steps N]\n\n"
                          "Trains a small model on clean math problems (the reference), scores a noisy web\n"
                          "corpus with it, continues training it on that corpus in regular and in centrifuge\n"
                          "mode, and compares speed and quality. The world is the synthetic math world with\n"
                          "one-digit numbers and short questions (gen-data --world small).",
                          opts, nopts, argc, argv);
    if (pr == 1) return 0;
    if (pr < 0) return cf_cli_error("demo", 2);
    if (cf_cli_check_single_process("demo") != 0) return cf_cli_error("demo", 2);
    if (cf_mkdir_p(out) != 0) return cf_cli_error("demo", 1);
    cf_datagen_set_world(CF_WORLD_SMALL);
    double t0 = cf_now();
    char clean[4096], noisy[4096], val[4096], refl[4096], refdir[4096], dir_reg[4096], dir_cf[4096];
    char log_reg[4096], log_cf[4096], seed_s[32], steps_s[32], ref_steps_s[32], batch_s[32], seq_s[32], lr_s[32];
    char ref_lr_s[32];
    char cfg_path[4096];
    if (cf_path_join(clean, sizeof clean, out, "clean.bin") || cf_path_join(noisy, sizeof noisy, out, "noisy.bin") ||
        cf_path_join(val, sizeof val, out, "val_clean.bin") || cf_path_join(refl, sizeof refl, out, "noisy.ref.bin") ||
        cf_path_join(refdir, sizeof refdir, out, "reference") || cf_path_join(dir_reg, sizeof dir_reg, out, "regular") ||
        cf_path_join(dir_cf, sizeof dir_cf, out, "centrifuge") || cf_path_join(log_reg, sizeof log_reg, out, "regular.jsonl") ||
        cf_path_join(log_cf, sizeof log_cf, out, "centrifuge.jsonl") ||
        cf_path_join(cfg_path, sizeof cfg_path, out, "config.json"))
        return cf_cli_error("demo", 1);
    /* the model: the built-in tiny config with 2 layers (twice the steps per
     * second of its 4, and the arithmetic needs no more) */
    cf_config mc;
    if (cf_config_builtin(&mc, "tiny") != 0) return cf_cli_error("demo", 1);
    mc.num_hidden_layers = (int)layers;
    if (cf_config_save(&mc, cfg_path) != 0) return cf_cli_error("demo", 1);
    char *previous[] = {refdir, dir_reg, dir_cf, log_reg, log_cf};
    if (clear_previous(previous, 5) != 0) return cf_cli_error("demo", 1);
    snprintf(seed_s, sizeof seed_s, "%ld", seed);
    snprintf(steps_s, sizeof steps_s, "%ld", steps);
    snprintf(ref_steps_s, sizeof ref_steps_s, "%ld", ref_steps);
    snprintf(batch_s, sizeof batch_s, "%ld", batch);
    snprintf(seq_s, sizeof seq_s, "%ld", seq);
    snprintf(lr_s, sizeof lr_s, "%g", lr);
    snprintf(ref_lr_s, sizeof ref_lr_s, "%g", ref_lr);

    /* sizes: B*S tokens per step, enough data that no run repeats any */
    const int64_t batch_tokens = batch * seq;
    int64_t n_clean = CF_MAX((int64_t)100000, ref_steps * batch_tokens + 1);
    int64_t n_noisy = CF_MAX((int64_t)100000, steps * batch_tokens + 1);

    stage(t0, "[1/5] data: %lld clean tokens (reference), %lld noisy-web tokens (target), held-out set",
          (long long)n_clean, (long long)n_noisy);
    if (write_corpus(clean, CF_DATA_CLEAN, (uint64_t)seed, n_clean) != 0 ||
        write_corpus(noisy, CF_DATA_NOISY, (uint64_t)seed + 1, n_noisy) != 0 ||
        write_corpus(val, CF_DATA_CLEAN, (uint64_t)seed + 1000, 8 * 128 * 8 + 1) != 0)
        return cf_cli_error("demo", 1);
    cf_problem *probs = cf_malloc((size_t)nprob * sizeof *probs);
    if (!probs) return cf_cli_error("demo", 1);
    cf_datagen_eval_problems((uint64_t)seed, (int)nprob, probs);

    stage(t0, "[2/5] reference: a %ld-layer model trained from scratch on clean problems, %ld steps of %ld x %ld tokens",
          layers, ref_steps, batch, seq);
    char *train_ref[] = {"train", "--config", cfg_path, "--data", clean, "--out", refdir, "--steps", ref_steps_s,
                         "--batch", batch_s, "--seq", seq_s, "--lr", ref_lr_s, "--seed", seed_s, "--progress", NULL};
    if (run_cmd(cmd_train, train_ref) != 0) { free(probs); return 1; }
    char ref_model[4200];
    snprintf(ref_model, sizeof ref_model, "%s/step_%08ld", refdir, ref_steps);

    stage(t0, "[3/5] score: reference loss of every noisy-web token");
    char *score[] = {"score", "--model", ref_model, "--data", noisy, "--out", refl, "--batch", "16", "--seq", "128", NULL};
    if (run_cmd(cmd_score, score) != 0) { free(probs); return 1; }

    stage(t0, "[4/5] targets: the reference trained on for %ld steps on noisy web, regular then centrifuge (keep 0.5)",
          steps);
    char *train_reg[] = {"train", "--model", ref_model, "--data", noisy, "--out", dir_reg, "--steps", steps_s,
                         "--batch", batch_s, "--seq", seq_s, "--lr", lr_s, "--seed", seed_s, "--log", log_reg,
                         "--mode", "regular", "--progress", NULL};
    char *train_cf[] = {"train", "--model", ref_model, "--data", noisy, "--ref", refl, "--out", dir_cf, "--steps",
                        steps_s, "--batch", batch_s, "--seq", seq_s, "--lr", lr_s, "--seed", seed_s, "--log", log_cf,
                        "--mode", "centrifuge", "--keep", "0.5", "--progress", NULL};
    if (run_cmd(cmd_train, train_reg) != 0 || run_cmd(cmd_train, train_cf) != 0) { free(probs); return 1; }

    stage(t0, "[5/5] evaluate: held-out clean loss, result accuracy on %ld held-out problems", nprob);
    char m_ref[4200], m_reg[4200], m_cf[4200];
    snprintf(m_ref, sizeof m_ref, "%s", ref_model);
    snprintf(m_reg, sizeof m_reg, "%s/step_%08ld", dir_reg, steps);
    snprintf(m_cf, sizeof m_cf, "%s/step_%08ld", dir_cf, steps);
    eval_result er[3];
    const char *dirs[3] = {m_reg, m_cf, m_ref};
    for (int i = 0; i < 3; i++)
        if (evaluate_model(dirs[i], "cpu", val, probs, (int)nprob, &er[i], "evaluate", 0, 1) != 0) {
            free(probs);
            return cf_cli_error("demo", 1);
        }
    free(probs);

    double bwd[2] = {log_median(log_reg, "backward_s"), log_median(log_cf, "backward_s")};
    double stp[2] = {log_median(log_reg, "step_s"), log_median(log_cf, "step_s")};
    double flt = log_median(log_cf, "filter_s");
    printf("\nCentrifuge demo — tiny Llama (%ld layers, %.2fM params), %ld steps of %ld x %ld tokens on noisy web data, CPU\n\n",
           layers, cf_config_num_params(&mc) / 1e6, steps, batch, seq);
    printf("%-22s %9s %9s %11s", "model", "bwd ms", "step ms", "clean loss");
    for (int f = 0; f < CF_NUM_FAMILIES; f++) printf(" %9s", cf_family_name(f));
    printf(" %9s\n", "accuracy");
    const char *names[3] = {"target, regular", "target, centrifuge", "reference (the start)"};
    for (int i = 0; i < 3; i++) {
        if (i < 2) printf("%-22s %9.2f %9.2f %11.4f", names[i], bwd[i] * 1e3, stp[i] * 1e3, er[i].clean_loss);
        else printf("%-22s %9s %9s %11.4f", names[i], "", "", er[i].clean_loss);
        int c = 0, t = 0;
        for (int f = 0; f < CF_NUM_FAMILIES; f++) {
            printf("    %2d/%-3d", er[i].correct[f], er[i].total[f]);
            c += er[i].correct[f];
            t += er[i].total[f];
        }
        printf(" %8.1f%%\n", t ? 100.0 * c / t : 0.0);
    }
    printf("\ncentrifuge backward = %.2f x regular; step = %.2f x; filter operator %.3f ms (%.1f%% of its step)\n",
           bwd[1] / bwd[0], stp[1] / stp[0], flt * 1e3, 100 * flt / stp[1]);
    printf("(medians over steps; accuracy = held-out problems whose every result (\"= N\") the model predicts\n"
           " given the question and the steps before it; files in %s; total %.0fs)\n", out, cf_now() - t0);
    return 0;
}

/* `centrifuge math-eval`: held-out clean loss and greedy-decoding accuracy
 * per template family of a model of the synthetic math world. */
int cmd_math_eval(int argc, char **argv) {
    const char *model_dir = NULL, *val = NULL, *device = "cpu", *json = NULL, *label = NULL, *world = "standard";
    long nprob = 200, seed = 1;
    int quiet = 0, teacher_forced = 0;
    cf_opt opts[] = {
        {"--model", CF_OPT_STR, &model_dir, 0, 0, "model directory (required)", 0},
        {"--val", CF_OPT_STR, &val, 0, 0, "held-out clean token shard for the loss (optional)", 0},
        {"--teacher-forced", CF_OPT_FLAG, &teacher_forced, 0, 0, "result accuracy given the worked solution (the demo's measure), not greedy decoding", 0},
        {"--problems", CF_OPT_INT, &nprob, 4, 1000000, "held-out problems to decode (default 200)", 0},
        {"--seed", CF_OPT_INT, &seed, 0, 1L << 40, "seed of the held-out problems (default 1)", 0},
        {"--device", CF_OPT_STR, &device, 0, 0, "cpu or cuda", 0},
        {"--json", CF_OPT_STR, &json, 0, 0, "append one JSON line with the results", 0},
        {"--label", CF_OPT_STR, &label, 0, 0, "label for the JSON line", 0},
        {"--world", CF_OPT_STR, &world, 0, 0, "standard, or small for the demo's models (default standard)", 0},
        {"--quiet", CF_OPT_FLAG, &quiet, 0, 0, "no progress line", 0},
    };
    int nopts = (int)(sizeof opts / sizeof *opts);
    int pr = cf_cli_parse("math-eval", "--model DIR [--val X.bin] [--problems N]\n\n"
                          "Answer accuracy by greedy decoding on held-out problems, per family.", opts, nopts, argc, argv);
    if (pr == 1) return 0;
    if (pr < 0) return cf_cli_error("math-eval", 2);
    if (cf_cli_check_single_process("math-eval") != 0) return cf_cli_error("math-eval", 2);
    if (!model_dir) { cf_fail("--model is required"); return cf_cli_error("math-eval", 2); }
    cf_world w;
    if (cf_world_parse(world, &w) != 0) return cf_cli_error("math-eval", 2);
    if (cf_cli_check_model_flags(NULL, model_dir, device) != 0) return cf_cli_error("math-eval", 2);
    /* before the work; an output that cannot be written is a run-time error (1), as in every command */
    if (json && cf_output_check(json) != 0) return cf_cli_error("math-eval", 1);
    cf_datagen_set_world(w);
    cf_problem *probs = cf_malloc((size_t)nprob * sizeof *probs);
    if (!probs) return cf_cli_error("math-eval", 1);
    cf_datagen_eval_problems((uint64_t)seed, (int)nprob, probs);
    eval_result r;
    double t0 = cf_now();
    int rc = evaluate_model(model_dir, device, val, probs, (int)nprob, &r, "math-eval", quiet, teacher_forced);
    free(probs);
    if (rc != 0) return cf_cli_error("math-eval", 1);
    int c = 0, t = 0;
    printf("math-eval: %s | clean loss %.4f |", model_dir, r.clean_loss);
    for (int f = 0; f < CF_NUM_FAMILIES; f++) {
        printf(" %s %d/%d", cf_family_name(f), r.correct[f], r.total[f]);
        c += r.correct[f];
        t += r.total[f];
    }
    printf(" | accuracy %.1f%% | %.1fs\n", 100.0 * c / t, cf_now() - t0);
    if (json) {
        /* one record, its strings escaped by cJSON, appended through the
         * checked output path; it names what ran it */
        cJSON *o = cJSON_CreateObject();
        char *line = NULL;
        if (o) {
            cJSON_AddStringToObject(o, "label", label ? label : "");
            cJSON_AddStringToObject(o, "model", model_dir);
            cJSON_AddNumberToObject(o, "clean_loss", r.clean_loss);
            cJSON_AddNumberToObject(o, "accuracy", (double)c / t);
            for (int fam = 0; fam < CF_NUM_FAMILIES; fam++) {
                char key[64];
                snprintf(key, sizeof key, "acc_%s", cf_family_name(fam));
                cJSON_AddNumberToObject(o, key, (double)r.correct[fam] / r.total[fam]);
            }
            cJSON_AddStringToObject(o, "mode", "eval");
            cJSON_AddStringToObject(o, "gpu", r.device);
            cJSON_AddStringToObject(o, "commit", cf_build_commit());
            cJSON_AddNumberToObject(o, "world_size", 1);
            cJSON_AddNumberToObject(o, "tp", 1);
            line = cJSON_PrintUnformatted(o);
            cJSON_Delete(o);
        }
        FILE *f = line ? cf_output_stream(json, 1) : NULL;
        int ok = f && fprintf(f, "%s\n", line) >= 0;
        ok = f ? cf_stream_close(f, json) == 0 && ok : 0;
        free(line);
        if (!ok) return cf_cli_error("math-eval", 1);
    }
    return 0;
}
