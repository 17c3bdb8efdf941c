/*
 * train.c — the training loop and the commands built on the model:
 * `centrifuge train`, `centrifuge eval`, `centrifuge score`.
 */
#include "train.h"

#include <dirent.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "common.h"
#include "datagen.h"
#include "model_internal.h"

/* ----------------------------------------------------------- model open */

int cf_parse_device(const char *s, cf_backend_kind *out) {
    if (!strcmp(s, "cpu")) *out = CF_BACKEND_CPU;
    else if (!strcmp(s, "cuda")) *out = CF_BACKEND_CUDA;
    else return cf_fail("--device: unknown device '%s' (cpu, cuda)", s);
    return 0;
}

cf_model *cf_open_model(const char *config, const char *model_dir, const char *device, uint64_t seed) {
    cf_backend_kind kind = CF_BACKEND_CPU;
    if (cf_parse_device(device, &kind) != 0) return NULL;
    if (config && model_dir) { cf_fail("give --config or --model, not both"); return NULL; }
    if (model_dir) return cf_model_load(model_dir, kind);
    cf_config cfg;
    if (!config) config = "tiny";
    if (strchr(config, '/') || strstr(config, ".json")) {
        if (cf_config_load(&cfg, config) != 0) return NULL;
    } else if (cf_config_builtin(&cfg, config) != 0) {
        return NULL;
    }
    return cf_model_create(&cfg, kind, seed);
}

/* --------------------------------------------------------------- loader */

int cf_loader_init(cf_loader *ld, const cf_tokens *tok, const cf_refloss *ref, int B, int S) {
    if ((int64_t)B * S + 1 > tok->n)
        return cf_fail("%s: %lld tokens is fewer than one batch of %d x %d + 1", tok->path,
                       (long long)tok->n, B, S);
    ld->tok = tok; ld->ref = ref; ld->B = B; ld->S = S; ld->pos = 0;
    return 0;
}

void cf_loader_next(cf_loader *ld, int32_t *tokens, float *ref_out) {
    int B = ld->B, S = ld->S;
    if (ld->pos + (int64_t)B * S + 1 > ld->tok->n) ld->pos = 0;
    for (int b = 0; b < B; b++)
        for (int s = 0; s <= S; s++)
            tokens[b * (S + 1) + s] = (int32_t)cf_tokens_get(ld->tok, ld->pos + (int64_t)b * S + s);
    if (ref_out)
        for (int b = 0; b < B; b++)
            for (int s = 0; s < S; s++)
                ref_out[b * S + s] = ld->ref->loss[ld->pos + (int64_t)b * S + s + 1];
    ld->pos += (int64_t)B * S;
}

/* ----------------------------------------------------------- checkpoints */

/* state.bin: this header, then Adam's m and v (nparams floats each).
 * opt_steps (version 2) is the optimizer's own step count, which Adam's bias
 * correction uses: it falls behind `step` by the number of skipped
 * (non-finite) steps, so an exact resume needs it. Version 1 files, without
 * it, still load (opt_steps = step). */
#define STATE_MAGIC "CFSTATE2"
#define STATE_MAGIC_V1 "CFSTATE1"
typedef struct {
    char magic[8];
    int64_t nparams, step, data_pos;
    int64_t opt_steps;
} state_header;
#define STATE_HEADER_V1_BYTES (8 + 3 * sizeof(int64_t))

/* Removes the temp files ("<name>.tmp.<pid>") a killed save left in dir. */
static void remove_stale_temps(const char *dir) {
    DIR *d = opendir(dir);
    struct dirent *e;
    char f[4096 + 256];
    while (d && (e = readdir(d)))
        if (strstr(e->d_name, ".tmp.") && cf_path_join(f, sizeof f, dir, e->d_name) == 0) unlink(f);
    if (d) closedir(d);
}

/* Removes an old checkpoint directory with everything in it: the three
 * checkpoint files and whatever temp files a killed save left there. */
static void remove_checkpoint(const char *victim) {
    DIR *d = opendir(victim);
    struct dirent *e;
    char f[4096 + 256];
    while (d && (e = readdir(d)))
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0 &&
            cf_path_join(f, sizeof f, victim, e->d_name) == 0)
            unlink(f);
    if (d) closedir(d);
    rmdir(victim);
}

int cf_checkpoint_save(cf_model *m, const char *dir, int64_t step, int64_t data_pos, int keep_last) {
    char sub[64], path[4096], state[4096];
    snprintf(sub, sizeof sub, "step_%08lld", (long long)step);
    if (cf_mkdir_p(dir) != 0 || cf_path_join(path, sizeof path, dir, sub) != 0) return -1;
    remove_stale_temps(path);   /* from a killed earlier save of this step */
    if (cf_model_save(m, path, "float32", 0) != 0) return -1;
    size_t n = cf_model_num_params(m);
    float *mv = cf_malloc(2 * n * sizeof(float));
    if (!mv) return -1;
    cf_model_get_adam(m, mv, mv + n);
    state_header h = {STATE_MAGIC, (int64_t)n, step, data_pos, cf_optimizer_steps(m)};
    memcpy(h.magic, STATE_MAGIC, 8);
    cf_atomic_file af;
    int rc = cf_path_join(state, sizeof state, path, "state.bin");
    if (rc == 0) rc = cf_atomic_open(&af, state);
    if (rc == 0) {
        rc = cf_atomic_write(&af, &h, sizeof h);
        if (rc == 0) rc = cf_atomic_write(&af, mv, 2 * n * sizeof(float));
        if (rc == 0) rc = cf_atomic_commit(&af);
        else cf_atomic_abort(&af);
    }
    free(mv);
    if (rc != 0) return -1;
    /* The checkpoint is complete: only now point `latest` at it. */
    char latest[4096], line[80];
    if (cf_path_join(latest, sizeof latest, dir, "latest") != 0) return -1;
    int len = snprintf(line, sizeof line, "%s\n", sub);
    if (cf_write_file_atomic(latest, line, (size_t)len) != 0) return -1;
    remove_stale_temps(dir);    /* e.g. latest.tmp.<pid> of a killed run */
    /* Remove checkpoints older than the newest keep_last ones. */
    if (keep_last > 0 && step > 0) {
        DIR *d = opendir(dir);
        struct dirent *e;
        while (d && (e = readdir(d))) {
            long long s;
            char extra;
            if (sscanf(e->d_name, "step_%lld%c", &s, &extra) != 1 || s >= step) continue;
            /* count newer ones */
            int newer = 0;
            DIR *d2 = opendir(dir);
            struct dirent *e2;
            while (d2 && (e2 = readdir(d2))) {
                long long s2;
                if (sscanf(e2->d_name, "step_%lld%c", &s2, &extra) == 1 && s2 > s) newer++;
            }
            if (d2) closedir(d2);
            if (newer >= keep_last) {
                char victim[4096];
                if (cf_path_join(victim, sizeof victim, dir, e->d_name) != 0) continue;
                remove_checkpoint(victim);
            }
        }
        if (d) closedir(d);
    }
    return 0;
}

cf_model *cf_checkpoint_load(const char *dir, const char *device, int64_t *step, int64_t *data_pos) {
    char latest[4096], path[4096], state[4096];
    if (cf_path_join(latest, sizeof latest, dir, "latest") != 0) return NULL;
    char *name = cf_read_file(latest, NULL, 256);
    if (!name) return NULL;
    name[strcspn(name, "\r\n")] = 0;
    if (!*name || strchr(name, '/')) { cf_fail("%s: malformed", latest); free(name); return NULL; }
    int rc = cf_path_join(path, sizeof path, dir, name);
    free(name);
    if (rc != 0) return NULL;
    cf_backend_kind kind = CF_BACKEND_CPU;
    if (cf_parse_device(device, &kind) != 0) return NULL;
    cf_model *m = cf_model_load(path, kind);
    if (!m) return NULL;
    size_t n = cf_model_num_params(m), len = 0;
    if (cf_path_join(state, sizeof state, path, "state.bin") != 0) { cf_model_free(m); return NULL; }
    char *buf = cf_read_file(state, &len, sizeof(state_header) + 2 * n * sizeof(float));
    if (!buf) { cf_model_free(m); return NULL; }
    state_header h;
    memset(&h, 0, sizeof h);
    int v1 = len >= 8 && memcmp(buf, STATE_MAGIC_V1, 8) == 0;
    size_t hbytes = v1 ? STATE_HEADER_V1_BYTES : sizeof h;
    if (len != hbytes + 2 * n * sizeof(float)) {
        cf_fail("%s: %zu bytes, expected %zu for %zu parameters", state, len, hbytes + 2 * n * sizeof(float), n);
        free(buf); cf_model_free(m); return NULL;
    }
    memcpy(&h, buf, hbytes);
    if (v1) {
        memcpy(h.magic, STATE_MAGIC, 8);
        h.opt_steps = h.step;
    }
    if (memcmp(h.magic, STATE_MAGIC, 8) != 0 || h.nparams != (int64_t)n || h.step < 0 || h.data_pos < 0 ||
        h.opt_steps < 0) {
        cf_fail("%s: not a centrifuge training state for this model", state);
        free(buf); cf_model_free(m); return NULL;
    }
    float *mv = cf_malloc(2 * n * sizeof(float));
    if (!mv) { free(buf); cf_model_free(m); return NULL; }
    memcpy(mv, buf + hbytes, 2 * n * sizeof(float));
    cf_model_set_adam(m, mv, mv + n, h.opt_steps);
    free(mv);
    free(buf);
    *step = h.step;
    *data_pos = h.data_pos;
    return m;
}

/* ------------------------------------------------------------- evaluate */

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

/* ---------------------------------------------------------------- train */

static volatile sig_atomic_t g_stop = 0;
static void on_sigint(int sig) { (void)sig; g_stop = 1; }

static void fmt_eta(char *buf, size_t n, double s) {
    if (!(s >= 0) || s > 1e7) { snprintf(buf, n, "?"); return; }
    int h = (int)(s / 3600), mi = (int)(s / 60) % 60, se = (int)s % 60;
    if (h) snprintf(buf, n, "%dh%02dm", h, mi);
    else snprintf(buf, n, "%dm%02ds", mi, se);
}

static const char *TRAIN_USAGE =
    "[--config NAME|FILE | --model DIR] [--data X.bin] [--ref X.ref.bin] [options]\n"
    "\nTrains a Llama-family model with token filtering. Without --data, trains on the\n"
    "built-in synthetic math corpus (clean source). Modes: regular, loss-only, centrifuge,\n"
    "strawman. Checkpoints go to --out (resumable with --resume).";

int cmd_train(int argc, char **argv) {
    const char *config = NULL, *model_dir = NULL, *data = NULL, *ref_path = NULL, *val = NULL;
    const char *out = NULL, *log_path = NULL, *mode_s = "regular", *select_s = NULL, *device = "cpu";
    long batch = 4, seq = 64, steps = 50, accum = 1, warmup = -1, save_every = 0, eval_every = 0;
    long eval_batches = 8, seed = 1337, max_bad = 5, keep_last = 2, builtin_tokens = 1000000;
    double lr = 1e-3, min_lr = -1, wd = 0.1, b1 = 0.9, b2 = 0.95, eps = 1e-8, clip = 1.0, keep = 0.5;
    double drop = -1;
    int resume = 0, per_batch = 0, doc_mask = 0, quiet = 0;
    cf_opt opts[] = {
        {"--config", CF_OPT_STR, &config, 0, 0, "built-in name or config.json (fresh weights); default tiny", 0},
        {"--model", CF_OPT_STR, &model_dir, 0, 0, "HF model directory to start from", 0},
        {"--data", CF_OPT_STR, &data, 0, 0, "token shard (default: built-in synthetic corpus)", 0},
        {"--ref", CF_OPT_STR, &ref_path, 0, 0, "reference-loss shard of --data (centrifuge score)", 0},
        {"--val", CF_OPT_STR, &val, 0, 0, "token shard for validation loss", 0},
        {"--out", CF_OPT_STR, &out, 0, 0, "checkpoint directory", 0},
        {"--resume", CF_OPT_FLAG, &resume, 0, 0, "continue from the latest checkpoint in --out", 0},
        {"--log", CF_OPT_STR, &log_path, 0, 0, "JSON-lines metrics file", 0},
        {"--device", CF_OPT_STR, &device, 0, 0, "cpu or cuda (default cpu)", 0},
        {"--mode", CF_OPT_STR, &mode_s, 0, 0, "regular | loss-only | centrifuge | strawman", 0},
        {"--select", CF_OPT_STR, &select_s, 0, 0, "ref | self | random (default ref with --ref, else self)", 0},
        {"--keep", CF_OPT_FLOAT, &keep, 0, 1, "fraction of positions kept, in (0,1] (default 0.5)", 0},
        {"--drop-rate", CF_OPT_FLOAT, &drop, 0, 0.999999, "1 - keep", 0},
        {"--per-batch", CF_OPT_FLAG, &per_batch, 0, 0, "select over the micro-batch, not per sequence", 0},
        {"--doc-mask", CF_OPT_FLAG, &doc_mask, 0, 0, "no attention across documents (BOS starts one)", 0},
        {"--batch", CF_OPT_INT, &batch, 1, 65536, "sequences per micro-batch (default 4)", 0},
        {"--seq", CF_OPT_INT, &seq, 1, 1 << 20, "positions per sequence (default 64)", 0},
        {"--steps", CF_OPT_INT, &steps, 1, 1L << 40, "optimizer steps (default 50)", 0},
        {"--grad-accum", CF_OPT_INT, &accum, 1, 65536, "micro-batches per step (default 1)", 0},
        {"--lr", CF_OPT_FLOAT, &lr, 0, 10, "peak learning rate (default 1e-3)", 0},
        {"--min-lr", CF_OPT_FLOAT, &min_lr, 0, 10, "final learning rate (default lr/10)", 0},
        {"--warmup", CF_OPT_INT, &warmup, 0, 1L << 40, "warmup steps (default steps/10)", 0},
        {"--weight-decay", CF_OPT_FLOAT, &wd, 0, 10, "AdamW decoupled weight decay (default 0.1)", 0},
        {"--beta1", CF_OPT_FLOAT, &b1, 0, 0.999999, "AdamW beta1 (default 0.9)", 0},
        {"--beta2", CF_OPT_FLOAT, &b2, 0, 0.999999, "AdamW beta2 (default 0.95)", 0},
        {"--eps", CF_OPT_FLOAT, &eps, 1e-30, 1, "AdamW epsilon (default 1e-8)", 0},
        {"--grad-clip", CF_OPT_FLOAT, &clip, 0, 1e9, "global grad-norm clip, 0 = off (default 1)", 0},
        {"--save-every", CF_OPT_INT, &save_every, 0, 1L << 40, "checkpoint every N steps (default: end only)", 0},
        {"--keep-checkpoints", CF_OPT_INT, &keep_last, 1, 1000, "checkpoints kept (default 2)", 0},
        {"--eval-every", CF_OPT_INT, &eval_every, 0, 1L << 40, "validation every N steps", 0},
        {"--eval-batches", CF_OPT_INT, &eval_batches, 1, 1L << 30, "validation batches (default 8)", 0},
        {"--max-bad-steps", CF_OPT_INT, &max_bad, 1, 1000000, "stop after N consecutive non-finite steps", 0},
        {"--builtin-tokens", CF_OPT_COUNT, &builtin_tokens, 1000, 1L << 31, "size of the built-in corpus", 0},
        {"--seed", CF_OPT_INT, &seed, 0, 1L << 62, "random seed (default 1337)", 0},
        {"--quiet", CF_OPT_FLAG, &quiet, 0, 0, "no progress lines", 0},
    };
    int nopts = (int)(sizeof opts / sizeof *opts);
    int pr = cf_cli_parse("train", TRAIN_USAGE, opts, nopts, argc, argv);
    if (pr == 1) return 0;
    if (pr < 0) return cf_cli_error("train", 2);

    cf_mode mode;
    cf_select_kind select;
    if (cf_mode_parse(mode_s, &mode) != 0) return cf_cli_error("train", 2);
    if (!select_s) select_s = ref_path ? "ref" : "self";
    if (cf_select_parse(select_s, &select) != 0) return cf_cli_error("train", 2);
    if (opts[11].seen && opts[12].seen) { cf_fail("give --keep or --drop-rate, not both"); return cf_cli_error("train", 2); }
    if (drop >= 0) keep = 1.0 - drop;
    if (!(keep > 0)) { cf_fail("--keep: must be in (0, 1], got %g", keep); return cf_cli_error("train", 2); }
    if (select == CF_SELECT_REF && !ref_path && mode != CF_MODE_REGULAR) {
        cf_fail("--select ref needs --ref (make one with centrifuge score)");
        return cf_cli_error("train", 2);
    }
    if (ref_path && !data) { cf_fail("--ref needs --data (the token shard it was scored on)"); return cf_cli_error("train", 2); }
    if (resume && !out) { cf_fail("--resume needs --out"); return cf_cli_error("train", 2); }
    if (warmup < 0) warmup = steps / 10;
    if (min_lr < 0) min_lr = lr / 10;

    /* data first: a bad file must fail before any work */
    cf_tokens tok = {0};
    cf_refloss ref = {0};
    int have_ref = 0;
    uint32_t *builtin = NULL;
    int rc = 1;
    cf_model *m = NULL;
    FILE *logf = NULL;
    int32_t *tokens = NULL;
    float *losses = NULL, *refb = NULL;
    uint8_t *keepmask = NULL;
    cf_tokens valtok = {0};
    int have_val = 0;

    int64_t step0 = 0, data_pos = 0;
    if (resume && out) {
        char latest[4096];
        if (cf_path_join(latest, sizeof latest, out, "latest") != 0) goto fail;
        if (cf_path_exists(latest)) {
            m = cf_checkpoint_load(out, device, &step0, &data_pos);
            if (!m) goto fail;
        } else if (!quiet) {
            fprintf(stderr, "train: no checkpoint in %s yet; starting fresh\n", out);
        }
    }
    if (!m) m = cf_open_model(config, model_dir, device, (uint64_t)seed);
    if (!m) goto fail;
    const cf_config *cfg = cf_model_config(m);
    if (data) {
        if (cf_tokens_open(&tok, data, cfg->vocab_size) != 0) goto fail;
    } else {
        if (cfg->vocab_size < CF_TOK_VOCAB) {
            cf_fail("the built-in corpus needs vocab_size >= %d (model has %d); give --data", CF_TOK_VOCAB, cfg->vocab_size);
            goto fail;
        }
        builtin = cf_malloc((size_t)builtin_tokens * sizeof(uint32_t));
        if (!builtin || cf_datagen_tokens(CF_DATA_CLEAN, (uint64_t)seed, builtin_tokens, builtin) != 0) goto fail;
        tok.path = "<built-in corpus>";
        tok.n = builtin_tokens;
        tok.width = 4;
        tok.data = builtin;
    }
    if (ref_path) {
        if (cf_refloss_open(&ref, ref_path, &tok) != 0) goto fail;
        have_ref = 1;
    }
    if (val) {
        if (cf_tokens_open(&valtok, val, cfg->vocab_size) != 0) goto fail;
        have_val = 1;
    }
    if (doc_mask) cf_model_set_doc_mask(m, cfg->bos_token_id >= 0 ? cfg->bos_token_id : CF_TOK_BOS);

    cf_loader ld;
    if (cf_loader_init(&ld, &tok, have_ref ? &ref : NULL, (int)batch, (int)seq) != 0) goto fail;
    ld.pos = data_pos;
    if (log_path) {
        logf = fopen(log_path, resume ? "a" : "w");
        if (!logf) { cf_fail("%s: cannot open log file", log_path); goto fail; }
    }
    int T = (int)(batch * seq);
    tokens = cf_malloc((size_t)batch * (seq + 1) * sizeof(int32_t));
    losses = cf_malloc((size_t)T * sizeof(float));
    refb = cf_malloc((size_t)T * sizeof(float));
    keepmask = cf_malloc((size_t)T);
    if (!tokens || !losses || !refb || !keepmask) goto fail;

    if (!quiet)
        fprintf(stderr, "train: %s %s, %.2fM params, %s backend | mode %s, select %s, keep %.2f%s | "
                        "%ld x %ld tokens x %ld accum | %ld steps from %lld\n",
                cf_model_type_name(cfg->model_type), config ? config : (model_dir ? model_dir : "tiny"),
                cf_model_num_params(m) / 1e6, device, cf_mode_name(mode), cf_select_name(select),
                mode == CF_MODE_REGULAR ? 1.0 : keep, per_batch ? " per batch" : "", batch, seq, accum,
                steps, (long long)step0);
    signal(SIGINT, on_sigint);
    cf_adamw_params hp = {(float)lr, (float)b1, (float)b2, (float)eps, (float)wd, (float)clip};
    double t_start = cf_now();
    int bad_run = 0;
    for (int64_t step = step0; step < steps && !g_stop; step++) {
        double t0 = cf_now();
        double loss_sum = 0;
        int kept_sum = 0;
        cf_timings acc = {0, 0, 0, 0};
        for (int mi = 0; mi < accum; mi++) {
            cf_loader_next(&ld, tokens, have_ref ? refb : NULL);
            if (cf_forward(m, tokens, (int)batch, (int)seq, losses) != 0) goto fail;
            int kept = T;
            if (mode != CF_MODE_REGULAR) {
                kept = cf_select_rows(m, have_ref ? refb : NULL, (float)keep, select, per_batch,
                                      (uint64_t)seed * 1000003u + (uint64_t)step * accum + mi, keepmask);
                if (kept < 0) goto fail;
                if ((mode == CF_MODE_CENTRIFUGE || mode == CF_MODE_STRAWMAN) &&
                    cf_filter_backward(m, keepmask) != 0)
                    goto fail;
            }
            float l;
            if (cf_backward(m, mode, mode == CF_MODE_REGULAR ? NULL : keepmask, 1.0f / accum, &l) != 0) goto fail;
            cf_timings t;
            cf_model_timings(m, &t);
            acc.forward += t.forward;
            acc.backward += t.backward;
            if (mode == CF_MODE_CENTRIFUGE || mode == CF_MODE_STRAWMAN) acc.filter += t.filter;
            loss_sum += l;
            kept_sum += kept;
        }
        hp.lr = cf_lr_schedule((int)step, (int)warmup, (int)steps, (float)lr, (float)min_lr);
        float norm = NAN;
        double loss = loss_sum / accum;
        int skipped = 1;
        if (isfinite(loss)) skipped = cf_step(m, &hp, &norm);   /* skips itself on a non-finite grad norm */
        else cf_zero_grad(m);
        cf_timings t;
        cf_model_timings(m, &t);
        acc.optimizer = skipped ? 0.0 : t.optimizer;
        if (skipped) {
            bad_run++;
            fprintf(stderr, "train: step %lld: non-finite %s (%g); step skipped (%d in a row)\n",
                    (long long)step + 1, isfinite(loss) ? "gradient norm" : "loss", isfinite(loss) ? norm : loss, bad_run);
            if (bad_run >= max_bad) {
                cf_fail("%d consecutive non-finite steps; stopping (lower --lr, check the data)", bad_run);
                goto fail;
            }
        } else {
            bad_run = 0;
        }
        double dt = cf_now() - t0;
        double tps = (double)T * accum / dt;
        double val_loss = NAN;
        if (have_val && eval_every > 0 && ((step + 1) % eval_every == 0 || step + 1 == steps)) {
            if (cf_evaluate(m, &valtok, (int)batch, (int)seq, (int)eval_batches, &val_loss, NULL, NULL) != 0) goto fail;
        }
        if (!quiet) {
            char eta[32];
            double elapsed = cf_now() - t_start;
            fmt_eta(eta, sizeof eta, elapsed / (double)(step + 1 - step0) * (double)(steps - step - 1));
            fprintf(stderr, "step %5lld/%ld | loss %.4f | kept %d/%d | lr %.2e | norm %.3f | %.0f tok/s | "
                            "fwd %.1fms filt %.2fms bwd %.1fms opt %.1fms | ETA %s",
                    (long long)step + 1, steps, loss, kept_sum, T * (int)accum, hp.lr, norm, tps,
                    acc.forward * 1e3, acc.filter * 1e3, acc.backward * 1e3, acc.optimizer * 1e3, eta);
            if (!isnan(val_loss)) fprintf(stderr, " | val %.4f", val_loss);
            fputc('\n', stderr);
        }
        if (logf) {
            fprintf(logf, "{\"step\":%lld,\"loss\":%.6f,\"kept\":%d,\"tokens\":%d,\"lr\":%.6g,\"grad_norm\":%.6g,"
                          "\"tokens_per_s\":%.1f,\"forward_s\":%.6f,\"filter_s\":%.6f,\"backward_s\":%.6f,"
                          "\"optimizer_s\":%.6f,\"step_s\":%.6f,\"skipped\":%d",
                    (long long)step + 1, loss, kept_sum, T * (int)accum, hp.lr, norm, tps, acc.forward,
                    acc.filter, acc.backward, acc.optimizer, dt, skipped);
            if (!isnan(val_loss)) fprintf(logf, ",\"val_loss\":%.6f", val_loss);
            fprintf(logf, "}\n");
            fflush(logf);
        }
        int last = step + 1 == steps || g_stop;
        if (out && ((save_every > 0 && (step + 1) % save_every == 0) || last)) {
            if (cf_checkpoint_save(m, out, step + 1, ld.pos, (int)keep_last) != 0) goto fail;
        }
    }
    if (g_stop) fprintf(stderr, "train: interrupted%s\n", out ? "; checkpoint saved" : "");
    rc = 0;
fail:
    if (rc) cf_cli_error("train", 1);
    if (logf) fclose(logf);
    free(tokens); free(losses); free(refb); free(keepmask);
    if (have_ref) cf_refloss_close(&ref);
    if (have_val) cf_tokens_close(&valtok);
    if (builtin) free(builtin);
    else if (tok.path) cf_tokens_close(&tok);
    cf_model_free(m);
    return rc;
}

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
    cf_model *m = cf_open_model(config, model_dir, device, (uint64_t)seed);
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
    cf_model *m = cf_open_model(NULL, model_dir, device, 0);
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

/* -------------------------------------------------------------- convert */

/* `centrifuge convert`: rewrite a model directory in another dtype and/or
 * as shards with an index (what transformers writes for large models). */
int cmd_convert(int argc, char **argv) {
    const char *model_dir = NULL, *out = NULL, *dtype = "bfloat16";
    long shard_mb = 0;
    cf_opt opts[] = {
        {"--model", CF_OPT_STR, &model_dir, 0, 0, "model directory to read (required)", 0},
        {"--out", CF_OPT_STR, &out, 0, 0, "directory to write (required)", 0},
        {"--dtype", CF_OPT_STR, &dtype, 0, 0, "float32 or bfloat16 (default bfloat16)", 0},
        {"--max-shard-mb", CF_OPT_INT, &shard_mb, 0, 1L << 30, "split into shards of at most N MB (0 = one file)", 0},
    };
    int nopts = (int)(sizeof opts / sizeof *opts);
    int pr = cf_cli_parse("convert", "--model DIR --out DIR [--dtype bfloat16] [--max-shard-mb N]\n\n"
                          "Rewrites a model as float32 or bfloat16 safetensors, optionally sharded.",
                          opts, nopts, argc, argv);
    if (pr == 1) return 0;
    if (pr < 0) return cf_cli_error("convert", 2);
    if (!model_dir || !out) { cf_fail("--model and --out are required"); return cf_cli_error("convert", 2); }
    if (strcmp(dtype, "float32") != 0 && strcmp(dtype, "bfloat16") != 0) {
        cf_fail("--dtype: '%s' is not float32 or bfloat16", dtype);
        return cf_cli_error("convert", 2);
    }
    cf_model *m = cf_open_model(NULL, model_dir, "cpu", 0);
    if (!m) return cf_cli_error("convert", 1);
    int rc = cf_model_save(m, out, dtype, (size_t)shard_mb << 20);
    if (rc == 0) printf("convert: wrote %s (%s, %.1fM parameters%s)\n", out, dtype, cf_model_num_params(m) / 1e6,
                        shard_mb ? ", sharded" : "");
    cf_model_free(m);
    return rc ? cf_cli_error("convert", 1) : 0;
}
