/*
 * train.c — `centrifuge train`, `eval`, `score` and `convert`: argument
 * handling, data, checkpoints and progress around the library's training
 * step (cf_trainer_step) and evaluation.
 */
#include "centrifuge.h"

#include <dirent.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cmd/cli.h"
#include "base/common.h"
#include "cmd/datagen.h"

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
    const char *freeze = NULL;
    long batch = 4, seq = 64, steps = 50, accum = 1, warmup = -1, save_every = 0, eval_every = 0;
    long eval_batches = 8, seed = 1337, max_bad = 5, keep_last = 2, builtin_tokens = 1000000;
    double lr = 1e-3, min_lr = -1, wd = 0.1, b1 = 0.9, b2 = 0.95, eps = 1e-8, clip = 1.0, keep = 0.5;
    double drop = -1, dist_timeout = 600;
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
        {"--dist-timeout", CF_OPT_FLOAT, &dist_timeout, 1, 86400, "data parallel: seconds to wait for other ranks (default 600)", 0},
        {"--freeze", CF_OPT_STR, &freeze, 0, 0, "comma list of name parts to freeze (e.g. embed_tokens,lm_head)", 0},
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
    float *refb = NULL;
    cf_trainer *tr = NULL;
    cf_micro_batch *mbs = NULL;
    cf_tokens valtok = {0};
    int have_val = 0;
    cf_dist *dist = NULL;
    int rank = 0, world = 1;

    /* Data parallel when a launcher (torchrun, srun, mpirun) started
     * several ranks: each rank trains on its GPU, rank 0 reports. */
    if (cf_dist_init(&dist, dist_timeout) != 0) goto fail;
    rank = cf_dist_rank(dist);
    world = cf_dist_world(dist);
    if (dist) {
        uint64_t h = CF_FNV_INIT;
        for (int i = 0; i < argc; i++) h = cf_fnv1a(h, argv[i], strlen(argv[i]) + 1);
        if (cf_dist_agree(dist, h, "the train arguments") != 0) goto fail;
        if (rank != 0) quiet = 1;
        if (!quiet) fprintf(stderr, "train: data parallel, %s\n", cf_dist_describe(dist));
    }

    int64_t step0 = 0, data_pos = 0;
    if (resume && out) {
        char latest[4096];
        if (cf_path_join(latest, sizeof latest, out, "latest") != 0) goto fail;
        if (cf_path_exists(latest)) {
            cf_model_opts mo = {0};
            if (cf_backend_parse(device, &mo.backend, &mo.device) != 0) goto fail;
            mo.freeze = freeze;
            m = cf_dist_checkpoint_load(dist, out, &mo, &step0, &data_pos);
            if (!m) goto fail;
        } else if (!quiet) {
            fprintf(stderr, "train: no checkpoint in %s yet; starting fresh\n", out);
        }
    }
    if (!m) {
        cf_model_opts mo = {0};
        if (cf_backend_parse(device, &mo.backend, &mo.device) != 0) goto fail;
        mo.config = config;
        mo.model_dir = model_dir;
        mo.seed = (uint64_t)seed;
        mo.freeze = freeze;
        m = cf_dist_open_model(dist, &mo);
    }
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
    if (cf_loader_set_rank(&ld, rank, world) != 0) goto fail;
    ld.pos = data_pos;
    if (log_path && rank == 0) {
        logf = fopen(log_path, resume ? "a" : "w");
        if (!logf) { cf_fail("%s: cannot open log file", log_path); goto fail; }
    }
    int T = (int)(batch * seq);
    tokens = cf_malloc((size_t)accum * batch * (seq + 1) * sizeof(int32_t));
    refb = cf_malloc((size_t)accum * T * sizeof(float));
    mbs = cf_calloc((size_t)accum, sizeof *mbs);
    if (!tokens || !refb || !mbs) goto fail;
    for (long mi = 0; mi < accum; mi++) {
        mbs[mi].tokens = tokens + (size_t)mi * batch * (seq + 1);
        mbs[mi].ref = have_ref ? refb + (size_t)mi * T : NULL;
    }
    cf_train_opts to = {0};
    to.mode = mode;
    to.select.kind = select;
    to.select.keep = keep;
    to.select.per_batch = per_batch;
    to.select.seed = (uint64_t)seed;
    to.batch = (int)batch;
    to.seq = (int)seq;
    to.grad_accum = (int)accum;
    to.adamw = (cf_adamw_params){(float)lr, (float)b1, (float)b2, (float)eps, (float)wd, (float)clip};
    tr = cf_trainer_create(m, &to);
    if (!tr) goto fail;
    cf_trainer_set_step(tr, step0);

    if (!quiet)
        fprintf(stderr, "train: %s %s, %.2fM params (%.2fM trained), %s backend | mode %s, select %s, keep %.2f%s | "
                        "%ld x %ld tokens x %ld accum x %d ranks | %ld steps from %lld\n",
                cf_model_type_name(cfg->model_type), config ? config : (model_dir ? model_dir : "tiny"),
                cf_model_num_params(m) / 1e6, cf_model_num_trainable(m) / 1e6, device, cf_mode_name(mode),
                cf_select_name(select), mode == CF_MODE_REGULAR ? 1.0 : keep, per_batch ? " per batch" : "", batch,
                seq, accum, world, steps, (long long)step0);
    signal(SIGINT, on_sigint);
    double t_start = cf_now();
    int bad_run = 0;
    for (int64_t step = step0; step < steps && !g_stop; step++) {
        double t0 = cf_now();
        for (long mi = 0; mi < accum; mi++)
            cf_loader_next(&ld, (int32_t *)mbs[mi].tokens, have_ref ? (float *)mbs[mi].ref : NULL);
        float lr_now = cf_lr_schedule(step, warmup, steps, (float)lr, (float)min_lr);
        cf_step_stats st;
        if (cf_trainer_step(tr, mbs, lr_now, &st) != 0) goto fail;
        double loss = st.loss;
        float norm = st.grad_norm;
        int skipped = st.skipped;
        int kept_sum = (int)st.kept;
        cf_timings acc = st.t;
        struct { float lr; } hp = {lr_now};
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
        double tps = (double)st.tokens / dt;
        double val_loss = NAN;
        if (have_val && rank == 0 && eval_every > 0 && ((step + 1) % eval_every == 0 || step + 1 == steps)) {
            if (cf_evaluate(m, &valtok, (int)batch, (int)seq, (int)eval_batches, &val_loss, NULL, NULL) != 0) goto fail;
        }
        if (!quiet) {
            char eta[32];
            double elapsed = cf_now() - t_start;
            fmt_eta(eta, sizeof eta, elapsed / (double)(step + 1 - step0) * (double)(steps - step - 1));
            fprintf(stderr, "step %5lld/%ld | loss %.4f | kept %d/%d | lr %.2e | norm %.3f | %.0f tok/s | "
                            "fwd %.1fms filt %.2fms bwd %.1fms opt %.1fms | ETA %s",
                    (long long)step + 1, steps, loss, kept_sum, (int)st.tokens, hp.lr, norm, tps,
                    acc.forward * 1e3, acc.filter * 1e3, acc.backward * 1e3, acc.optimizer * 1e3, eta);
            if (!isnan(val_loss)) fprintf(stderr, " | val %.4f", val_loss);
            fputc('\n', stderr);
        }
        if (logf) {
            fprintf(logf, "{\"step\":%lld,\"loss\":%.6f,\"kept\":%d,\"tokens\":%d,\"lr\":%.6g,\"grad_norm\":%.6g,"
                          "\"tokens_per_s\":%.1f,\"forward_s\":%.6f,\"filter_s\":%.6f,\"backward_s\":%.6f,"
                          "\"optimizer_s\":%.6f,\"step_s\":%.6f,\"skipped\":%d",
                    (long long)step + 1, loss, kept_sum, (int)st.tokens, hp.lr, norm, tps, acc.forward,
                    acc.filter, acc.backward, acc.optimizer, dt, skipped);
            if (!isnan(val_loss)) fprintf(logf, ",\"val_loss\":%.6f", val_loss);
            fprintf(logf, "}\n");
            fflush(logf);
        }
        int last = step + 1 == steps || g_stop;
        if (out && ((save_every > 0 && (step + 1) % save_every == 0) || last)) {
            if (cf_dist_checkpoint_save(dist, m, out, step + 1, ld.pos, (int)keep_last) != 0) goto fail;
        }
    }
    if (g_stop) fprintf(stderr, "train: interrupted%s\n", out ? "; checkpoint saved" : "");
    rc = 0;
fail:
    if (rc) {
        if (dist) {
            /* name the rank; abort so the other ranks fail fast, not at a timeout */
            char msg[1024];
            snprintf(msg, sizeof msg, "%s", cf_last_error());
            if (!strstr(msg, "rank ")) cf_fail("rank %d of %d: %s", rank, world, msg);
            cf_dist_abort(dist);
        }
        cf_cli_error("train", 1);
    }
    if (logf) fclose(logf);
    free(tokens); free(refb); free(mbs);
    cf_trainer_free(tr);
    if (have_ref) cf_refloss_close(&ref);
    if (have_val) cf_tokens_close(&valtok);
    if (builtin) free(builtin);
    else if (tok.path) cf_tokens_close(&tok);
    cf_model_free(m);
    cf_dist_free(dist);
    return rc;
}

