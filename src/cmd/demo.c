/*
 * demo.c — `centrifuge demo`: the whole pipeline on the synthetic math
 * world, in about a minute on a laptop CPU.
 *
 *   1. data      clean problems (reference data), noisy web (target data),
 *                held-out clean text and held-out problems
 *   2. reference a tiny model trained on clean data
 *   3. score     its per-token losses on the noisy corpus
 *   4. targets   the same tiny model trained on the noisy corpus, in
 *                `regular` and in `centrifuge` mode (keep 0.5, select ref)
 *   5. evaluate  held-out clean loss and answer accuracy by greedy decoding
 *
 * Each phase runs the real subcommand (train, score) with real files in
 * --out, so the demo is also a worked example of the CLI.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmd/cli.h"
#include "cmd/commands.h"
#include "base/common.h"
#include "cmd/datagen.h"
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
} eval_result;

/* Held-out clean loss and greedy-decoding accuracy of the model in dir. */
static int evaluate_model(const char *dir, const char *device, const char *val_path, const cf_problem *probs,
                          int nprob, eval_result *r) {
    memset(r, 0, sizeof *r);
    r->clean_loss = NAN;
    cf_model *m = cf_cli_open_model(NULL, dir, device, 0, NULL);
    if (!m) return -1;
    int rc = 0;
    if (val_path) {
        cf_tokens val;
        rc = cf_tokens_open(&val, val_path, cf_model_config(m)->vocab_size);
        if (rc == 0) {
            rc = cf_evaluate(m, &val, 8, 128, 0, &r->clean_loss, NULL, NULL);
            cf_tokens_close(&val);
        }
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
    /* greedy; a row ends at EOS or at the newline that ends the solution */
    if (rc == 0) rc = cf_generate(m, seqs, lens, nprob, CAP, NEW, 0.0f, 0, CF_TOK_EOS, '\n', 0);
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

int cmd_demo(int argc, char **argv) {
    const char *out = "runs/demo";
    long steps = 180, ref_steps = 150, seed = 1, nprob = 24;
    cf_opt opts[] = {
        {"--out", CF_OPT_STR, &out, 0, 0, "working directory (default runs/demo)", 0},
        {"--steps", CF_OPT_INT, &steps, 1, 1000000, "target training steps per mode (default 180)", 0},
        {"--ref-steps", CF_OPT_INT, &ref_steps, 1, 1000000, "reference training steps (default 150)", 0},
        {"--problems", CF_OPT_INT, &nprob, 4, 100000, "held-out problems to decode (default 24)", 0},
        {"--seed", CF_OPT_INT, &seed, 0, 1L << 40, "seed of data and models (default 1)", 0},
    };
    int nopts = (int)(sizeof opts / sizeof *opts);
    int pr = cf_cli_parse("demo", "[--out DIR] [--steps N]\n\n"
                          "Trains a reference on clean math, scores a noisy web corpus with it, trains\n"
                          "the target in regular and centrifuge mode, and compares speed and quality.",
                          opts, nopts, argc, argv);
    if (pr == 1) return 0;
    if (pr < 0) return cf_cli_error("demo", 2);
    if (cf_mkdir_p(out) != 0) return cf_cli_error("demo", 1);
    double t0 = cf_now();
    char clean[4096], noisy[4096], val[4096], refl[4096], refdir[4096], dir_reg[4096], dir_cf[4096];
    char log_reg[4096], log_cf[4096], seed_s[32], steps_s[32], ref_steps_s[32];
    if (cf_path_join(clean, sizeof clean, out, "clean.bin") || cf_path_join(noisy, sizeof noisy, out, "noisy.bin") ||
        cf_path_join(val, sizeof val, out, "val_clean.bin") || cf_path_join(refl, sizeof refl, out, "noisy.ref.bin") ||
        cf_path_join(refdir, sizeof refdir, out, "reference") || cf_path_join(dir_reg, sizeof dir_reg, out, "regular") ||
        cf_path_join(dir_cf, sizeof dir_cf, out, "centrifuge") || cf_path_join(log_reg, sizeof log_reg, out, "regular.jsonl") ||
        cf_path_join(log_cf, sizeof log_cf, out, "centrifuge.jsonl"))
        return cf_cli_error("demo", 1);
    snprintf(seed_s, sizeof seed_s, "%ld", seed);
    snprintf(steps_s, sizeof steps_s, "%ld", steps);
    snprintf(ref_steps_s, sizeof ref_steps_s, "%ld", ref_steps);

    /* sizes: B*S tokens per step; enough data that no run repeats much */
    const int64_t batch_tokens = 8 * 128;
    int64_t n_clean = CF_MAX((int64_t)200000, ref_steps * batch_tokens);
    int64_t n_noisy = CF_MAX((int64_t)200000, steps * batch_tokens);

    printf("[1/5] data: %lld clean tokens (reference), %lld noisy-web tokens (target), held-out clean set (%.1fs)\n",
           (long long)n_clean, (long long)n_noisy, cf_now() - t0);
    fflush(stdout);
    if (write_corpus(clean, CF_DATA_CLEAN, (uint64_t)seed, n_clean) != 0 ||
        write_corpus(noisy, CF_DATA_NOISY, (uint64_t)seed + 1, n_noisy) != 0 ||
        write_corpus(val, CF_DATA_CLEAN, (uint64_t)seed + 1000, 8 * 128 * 8 + 1) != 0)
        return cf_cli_error("demo", 1);
    cf_problem *probs = cf_malloc((size_t)nprob * sizeof *probs);
    if (!probs) return cf_cli_error("demo", 1);
    cf_datagen_eval_problems((uint64_t)seed, (int)nprob, probs);

    printf("[2/5] reference: tiny model, %ld steps on clean problems (%.1fs)\n", ref_steps, cf_now() - t0);
    fflush(stdout);
    char *train_ref[] = {"train", "--config", "tiny", "--data", clean, "--out", refdir, "--steps", ref_steps_s,
                         "--batch", "8", "--seq", "128", "--lr", "3e-3", "--seed", seed_s, "--quiet", NULL};
    if (run_cmd(cmd_train, train_ref) != 0) { free(probs); return 1; }
    char ref_model[4200];
    snprintf(ref_model, sizeof ref_model, "%s/step_%08ld", refdir, ref_steps);

    printf("[3/5] score: reference losses for every noisy-web token (%.1fs)\n", cf_now() - t0);
    fflush(stdout);
    char *score[] = {"score", "--model", ref_model, "--data", noisy, "--out", refl, "--batch", "16", "--seq", "128", NULL};
    if (run_cmd(cmd_score, score) != 0) { free(probs); return 1; }

    printf("[4/5] targets: %ld steps on noisy web, regular then centrifuge (keep 0.5, select ref) (%.1fs)\n", steps,
           cf_now() - t0);
    fflush(stdout);
    char *train_reg[] = {"train", "--config", "tiny", "--data", noisy, "--out", dir_reg, "--steps", steps_s,
                         "--batch", "8", "--seq", "128", "--lr", "3e-3", "--seed", seed_s, "--log", log_reg,
                         "--mode", "regular", "--quiet", NULL};
    char *train_cf[] = {"train", "--config", "tiny", "--data", noisy, "--ref", refl, "--out", dir_cf, "--steps",
                        steps_s, "--batch", "8", "--seq", "128", "--lr", "3e-3", "--seed", seed_s, "--log", log_cf,
                        "--mode", "centrifuge", "--keep", "0.5", "--quiet", NULL};
    if (run_cmd(cmd_train, train_reg) != 0 || run_cmd(cmd_train, train_cf) != 0) { free(probs); return 1; }

    printf("[5/5] evaluate: held-out clean loss, greedy decoding of %ld held-out problems (%.1fs)\n", nprob, cf_now() - t0);
    fflush(stdout);
    char m_ref[4200], m_reg[4200], m_cf[4200];
    snprintf(m_ref, sizeof m_ref, "%s", ref_model);
    snprintf(m_reg, sizeof m_reg, "%s/step_%08ld", dir_reg, steps);
    snprintf(m_cf, sizeof m_cf, "%s/step_%08ld", dir_cf, steps);
    eval_result er[3];
    const char *dirs[3] = {m_reg, m_cf, m_ref};
    /* the reference gets its clean loss only: decoding is the slow part */
    for (int i = 0; i < 3; i++)
        if (evaluate_model(dirs[i], "cpu", val, probs, i < 2 ? (int)nprob : 0, &er[i]) != 0) { free(probs); return cf_cli_error("demo", 1); }
    free(probs);

    double bwd[2] = {log_median(log_reg, "backward_s"), log_median(log_cf, "backward_s")};
    double stp[2] = {log_median(log_reg, "step_s"), log_median(log_cf, "step_s")};
    double flt = log_median(log_cf, "filter_s");
    printf("\nCentrifuge demo — tiny Llama (%s), %ld steps of 8 x 128 tokens on noisy web data, CPU\n\n",
           "4 layers, 0.8M params", steps);
    printf("%-22s %9s %9s %11s", "model", "bwd ms", "step ms", "clean loss");
    for (int f = 0; f < CF_NUM_FAMILIES; f++) printf(" %9s", cf_family_name(f));
    printf(" %9s\n", "accuracy");
    const char *names[3] = {"target, regular", "target, centrifuge", "reference (clean)"};
    for (int i = 0; i < 3; i++) {
        if (i < 2) printf("%-22s %9.2f %9.2f %11.4f", names[i], bwd[i] * 1e3, stp[i] * 1e3, er[i].clean_loss);
        else { printf("%-22s %9s %9s %11.4f\n", names[i], "", "", er[i].clean_loss); continue; }
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
    printf("(medians over steps; accuracy = greedy decoding of held-out problems, answer parsed from\n"
           " \"The answer is N.\"; files in %s; total %.1fs)\n", out, cf_now() - t0);
    return 0;
}

/* `centrifuge math-eval`: held-out clean loss and greedy-decoding accuracy
 * per template family of a model of the synthetic math world. */
int cmd_math_eval(int argc, char **argv) {
    const char *model_dir = NULL, *val = NULL, *device = "cpu", *json = NULL, *label = NULL;
    long nprob = 200, seed = 1;
    cf_opt opts[] = {
        {"--model", CF_OPT_STR, &model_dir, 0, 0, "model directory (required)", 0},
        {"--val", CF_OPT_STR, &val, 0, 0, "held-out clean token shard for the loss (optional)", 0},
        {"--problems", CF_OPT_INT, &nprob, 4, 1000000, "held-out problems to decode (default 200)", 0},
        {"--seed", CF_OPT_INT, &seed, 0, 1L << 40, "seed of the held-out problems (default 1)", 0},
        {"--device", CF_OPT_STR, &device, 0, 0, "cpu or cuda", 0},
        {"--json", CF_OPT_STR, &json, 0, 0, "append one JSON line with the results", 0},
        {"--label", CF_OPT_STR, &label, 0, 0, "label for the JSON line", 0},
    };
    int nopts = (int)(sizeof opts / sizeof *opts);
    int pr = cf_cli_parse("math-eval", "--model DIR [--val X.bin] [--problems N]\n\n"
                          "Answer accuracy by greedy decoding on held-out problems, per family.", opts, nopts, argc, argv);
    if (pr == 1) return 0;
    if (pr < 0) return cf_cli_error("math-eval", 2);
    if (!model_dir) { cf_fail("--model is required"); return cf_cli_error("math-eval", 2); }
    cf_problem *probs = cf_malloc((size_t)nprob * sizeof *probs);
    if (!probs) return cf_cli_error("math-eval", 1);
    cf_datagen_eval_problems((uint64_t)seed, (int)nprob, probs);
    eval_result r;
    double t0 = cf_now();
    int rc = evaluate_model(model_dir, device, val, probs, (int)nprob, &r);
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
        FILE *f = fopen(json, "a");
        if (!f) { cf_fail("%s: cannot open", json); return cf_cli_error("math-eval", 1); }
        fprintf(f, "{\"label\":\"%s\",\"model\":\"%s\",\"clean_loss\":%.6f,\"accuracy\":%.4f", label ? label : "",
                model_dir, r.clean_loss, (double)c / t);
        for (int fam = 0; fam < CF_NUM_FAMILIES; fam++)
            fprintf(f, ",\"acc_%s\":%.4f", cf_family_name(fam), (double)r.correct[fam] / r.total[fam]);
        fprintf(f, "}\n");
        fclose(f);
    }
    return 0;
}
