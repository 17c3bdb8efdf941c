/*
 * train.c — `centrifuge train`, `eval`, `score` and `convert`: argument
 * handling, data, checkpoints and progress around the library's training
 * step (cf_trainer_step) and evaluation.
 */
#include "centrifuge.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cmd/cli.h"
#include "base/common.h"
#include "cmd/datagen.h"
#include "cmd/progress.h"
#include "cmd/runfiles.h"
#include "centrifuge_tokenizer.h"

/* ---------------------------------------------------------------- train */

/* SIGINT and SIGTERM (what Slurm, Kubernetes and `timeout` send before
 * killing) stop the run the same way: the current step finishes, a
 * checkpoint is saved if --out, and the exit status is 128 + the signal
 * (130, 143). A second signal exits at once. */
static volatile sig_atomic_t g_stop = 0;
static void on_stop_signal(int sig) {
    if (g_stop) _exit(128 + sig);
    g_stop = sig;
}

static void stop_signals(int install) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = install ? on_stop_signal : SIG_DFL;
    sa.sa_flags = SA_RESTART;   /* a write in flight is not cut by EINTR */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
}

/* The checkpoint directory OUT/latest names into dir; 1 if there is one. */
static int latest_checkpoint(const char *out, char *dir, size_t cap) {
    char latest[4096];
    if (cf_path_join(latest, sizeof latest, out, "latest") != 0 || !cf_path_exists(latest)) return 0;
    char *name = cf_read_file(latest, NULL, 256);
    if (!name) return 0;
    name[strcspn(name, "\r\n")] = 0;
    int ok = *name && !strchr(name, '/') && cf_path_join(dir, cap, out, name) == 0;
    free(name);
    return ok;
}

/* The run manifest (OUT/run.json): the arguments that define a run. A
 * resume must match every field that --resume checks; the others (lr,
 * steps, ...) may change between resumes and are there for the record. */
static const struct { const char *key, *flag; } RUN_FIELDS[] = {
    {"model", "--config/--model"}, {"mode", "--mode"}, {"select", "--select"}, {"keep", "--keep"},
    {"per_batch", "--per-batch"}, {"doc_mask", "--doc-mask"}, {"batch", "--batch"}, {"seq", "--seq"},
    {"grad_accum", "--grad-accum"}, {"world_size", "the world size"}, {"tp", "--tp"}, {"seed", "--seed"},
    {"freeze", "--freeze"},
    {"lora", "--lora-rank/--lora-alpha/--lora-targets/--rslora"},
    {"data", "--data (or --shuffle, --data-seed, --builtin-tokens)"}, {"ref", "--ref"},
};

/* Fails naming the first checked field (or only the field `only`) in which
 * have and want differ; a field either lacks passes. */
static int check_manifest(const cf_manifest *have, const cf_manifest *want, const char *path, const char *only) {
    for (size_t i = 0; i < sizeof RUN_FIELDS / sizeof *RUN_FIELDS; i++) {
        const char *k = RUN_FIELDS[i].key;
        if (only && strcmp(only, k) != 0) continue;
        const char *h = cf_manifest_get(have, k), *w = cf_manifest_get(want, k);
        if (!h || !w || strcmp(h, w) == 0) continue;
        return cf_fail("--resume: %s was written by a run with %s '%s'; this command has '%s' (resume with the "
                       "same arguments, or train into another --out)", path, RUN_FIELDS[i].flag, h, w);
    }
    return 0;
}

/* Writes OUT/run.json: want's fields with the run id of an existing
 * manifest (or a new one). */
static int write_manifest(const char *out, const cf_manifest *want) {
    char path[4096];
    if (cf_path_join(path, sizeof path, out, "run.json") != 0) return -1;
    cf_manifest have, mf = {0};
    int r = cf_manifest_read(path, &have);
    if (r < 0) return -1;
    const char *id = r == 0 ? cf_manifest_get(&have, "run_id") : NULL;
    cf_manifest_set(&mf, "format", "centrifuge-run-1");
    if (id && *id) cf_manifest_set(&mf, "run_id", "%s", id);
    else cf_manifest_set(&mf, "run_id", "%016llx", (unsigned long long)cf_random_u64());
    for (int i = 0; i < want->n; i++) cf_manifest_set(&mf, want->kv[i].key, "%s", want->kv[i].val);
    return cf_manifest_write(path, &mf);
}

/* A model argument as the manifest records it: built-in names as given,
 * files and directories by their real path. */
static void model_field(char *buf, size_t cap, const char *config, const char *model_dir) {
    const char *arg = model_dir ? model_dir : config ? config : "tiny";
    int is_path = model_dir || strchr(arg, '/') || strstr(arg, ".json");
    char *real = is_path ? realpath(arg, NULL) : NULL;
    snprintf(buf, cap, "%s:%s", model_dir ? "model" : "config", real ? real : arg);
    free(real);
}

/* Whether path is one of the files the run keeps in --out (latest,
 * run.json, .lock, anything in a step_* directory): no log goes there. */
static int in_run_files(const char *path, const char *out) {
    char dir[4096], *rdir = NULL, *rout = realpath(out, NULL);
    const char *slash = strrchr(path, '/');
    snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - path) : 1, slash ? path : ".");
    if (slash == path) snprintf(dir, sizeof dir, "/");
    rdir = realpath(dir, NULL);
    const char *base = slash ? slash + 1 : path;
    int hit = 0;
    if (rout && rdir) {
        size_t n = strlen(rout);
        if (strcmp(rdir, rout) == 0)
            hit = !strcmp(base, "latest") || !strcmp(base, "run.json") || !strcmp(base, ".lock") || !strncmp(base, "step_", 5);
        else if (strncmp(rdir, rout, n) == 0 && rdir[n] == '/' && strncmp(rdir + n + 1, "step_", 5) == 0)
            hit = 1;
    }
    free(rout);
    free(rdir);
    return hit;
}

/* The reference losses a run reads, in its manifest: a hash of the
 * contents of every ref shard (a resume with other ref losses would train
 * on other scores than the run it continues). */
static int ref_fingerprint(const cf_dataset *ds, cf_manifest *mf) {
    uint64_t h = CF_FNV_INIT;
    size_t cap = (size_t)1 << 20;
    uint64_t *buf = cf_malloc(cap);
    if (!buf) return -1;
    int rc = 0;
    for (int i = 0; rc == 0 && i < cf_dataset_num_shards(ds); i++) {
        const char *p = cf_dataset_ref_path(ds, i);
        if (!p) continue;
        int fd = cf_open_input(p, NULL);
        if (fd < 0) { rc = -1; break; }
        for (;;) {
            ssize_t r = read(fd, buf, cap);
            if (r < 0 && errno == EINTR) continue;
            if (r < 0) { rc = cf_fail("%s: read failed: %s", p, strerror(errno)); break; }
            if (r == 0) break;
            size_t words = (size_t)r / 8;
            for (size_t k = 0; k < words; k++) h = (h ^ buf[k]) * 0x100000001b3ULL;
            h = cf_fnv1a(h, (const char *)buf + words * 8, (size_t)r - words * 8);
        }
        close(fd);
        cf_input_release(p);
    }
    free(buf);
    if (rc == 0) cf_manifest_set(mf, "ref", "%016llx", (unsigned long long)h);
    return rc;
}

/* The memory this run will allocate against what the device has free,
 * before the model is allocated (cf_memory_check: one line if too much). */
static int check_memory(const cf_model_opts *mo, long batch, long seq, long accum, cf_mode mode, double keep,
                        int dp, int tp, int saving) {
    cf_memory_opts o = {0};
    o.batch = batch;
    o.seq = seq;
    o.grad_accum = accum;
    o.train = 1;
    o.compact = cf_mode_is_compact(mode);
    o.keep = keep;
    o.world = dp;
    o.tp = tp;
    o.checkpoint = saving;
    o.freeze = mo->freeze;
    return cf_memory_check(mo, &o, NULL);
}

static void fmt_eta(char *buf, size_t n, double s) {
    if (!(s >= 0) || s > 1e7) { snprintf(buf, n, "?"); return; }
    int h = (int)(s / 3600), mi = (int)(s / 60) % 60, se = (int)s % 60;
    if (h) snprintf(buf, n, "%dh%02dm", h, mi);
    else snprintf(buf, n, "%dm%02ds", mi, se);
}

/* The largest token id of the training and validation data, and where. */
static uint32_t data_max_id(const cf_dataset *ds, const cf_dataset *vds, const char **path, int *is_val) {
    int sh = 0, vsh = 0;
    uint32_t a = cf_dataset_max_id(ds, &sh), b = vds ? cf_dataset_max_id(vds, &vsh) : 0;
    int v = vds && b > a;
    if (path) *path = v ? cf_dataset_shard(vds, vsh)->path : cf_dataset_shard(ds, sh)->path;
    if (is_val) *is_val = v;
    return v ? b : a;
}

/* Every id of the data must have a row in the embedding; if not, say how
 * to fix it rather than only what is wrong. */
static int check_vocab(const cf_config *cfg, const cf_dataset *ds, const cf_dataset *vds, const char *model_dir,
                       int resumed) {
    const char *where;
    int is_val;
    uint32_t mx = data_max_id(ds, vds, &where, &is_val);
    if ((int64_t)mx < cfg->vocab_size) return 0;
    if (model_dir || resumed)
        return cf_fail("%s holds token id %u, but the model has vocab_size %d: was %s tokenized with another "
                       "tokenizer than this model's? (tokenize with the model's tokenizer.json: centrifuge tokenize "
                       "--tokenizer %s)",
                       where, mx, cfg->vocab_size, is_val ? "--val" : "--data", model_dir ? model_dir : "DIR");
    return cf_fail("%s holds token id %u, but the config has vocab_size %d: add --vocab-from-data (vocab_size %u) "
                   "or --vocab-size N to size the config's vocabulary to the data, or start from the model the "
                   "data was tokenized for (--model DIR)",
                   where, mx, cfg->vocab_size, mx + 1);
}

/* Writes the config that --config names, with vocab_size v (0: as it is)
 * and BOS/EOS from the tokenizer (if any; ids the vocabulary does not
 * hold become -1), to a temporary config.json; path_out gets its path. */
static int write_config_with_vocab(const char *config, int v, cf_tokenizer *tkz, char *path_out, size_t cap) {
    cf_config c;
    const char *name = config ? config : "tiny";
    if (strchr(name, '/') || strstr(name, ".json")) {
        if (cf_config_load(&c, name) != 0) return -1;
    } else if (cf_config_builtin(&c, name) != 0) {
        return -1;
    }
    if (v > 0) c.vocab_size = v;
    if (tkz) {
        c.bos_token_id = cf_tokenizer_bos_id(tkz);
        c.eos_token_id = cf_tokenizer_eos_id(tkz);
    }
    if (c.bos_token_id >= c.vocab_size) c.bos_token_id = -1;
    if (c.eos_token_id >= c.vocab_size) c.eos_token_id = -1;
    if (cf_config_validate(&c) != 0) return -1;
    const char *tmp = getenv("TMPDIR");
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/centrifuge-config-XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(dir)) return cf_fail("%s: cannot create a temporary directory", dir);
    if (cf_path_join(path_out, cap, dir, "config.json") != 0 || cf_config_save(&c, path_out) != 0) {
        rmdir(dir);
        return -1;
    }
    return 0;
}

static void remove_config_tmp(const char *path) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    unlink(path);
    if (slash) { *slash = 0; rmdir(dir); }
}

/* Mean loss over the first nb micro-batches of the validation data (in
 * order; fewer if it holds fewer): for one shard what cf_evaluate gives. */
static int val_mean_loss(cf_model *m, cf_dataset *vds, long B, long S, long nb, double *mean) {
    int64_t avail = cf_dataset_epoch_tokens(vds) / (B * S);
    if (nb > avail) nb = (long)avail;
    int32_t *tk = cf_malloc((size_t)B * (S + 1) * sizeof(int32_t));
    float *ls = cf_malloc((size_t)B * S * sizeof(float));
    int rc = tk && ls ? 0 : -1;
    double sum = 0;
    if (rc == 0) rc = cf_dataset_seek(vds, 0);
    for (long i = 0; rc == 0 && i < nb; i++) {
        if (cf_dataset_next(vds, tk, NULL) != 0 || cf_forward(m, tk, (int)B, (int)S, ls) != 0) rc = -1;
        for (long t = 0; rc == 0 && t < B * S; t++) sum += ls[t];
    }
    free(tk);
    free(ls);
    *mean = nb > 0 ? sum / ((double)nb * B * S) : NAN;
    return rc;
}

/* The tokenizer files travel with the model: into OUT/step_N after its
 * checkpoint is saved. */
static int copy_tokenizer_to_checkpoint(const char *src, const char *out, int64_t step) {
    char sub[64], dir[4096];
    snprintf(sub, sizeof sub, "step_%08lld", (long long)step);
    if (cf_path_join(dir, sizeof dir, out, sub) != 0) return -1;
    return cf_copy_tokenizer_files(src, dir) < 0 ? -1 : 0;
}

static const char *TRAIN_USAGE =
    "[--config NAME|FILE | --model DIR] [--data SHARDS] [--ref auto|SHARDS] [options]\n"
    "\nTrains a Llama-family model with token filtering. Without --data, trains on the\n"
    "built-in synthetic math corpus (clean source). Modes: regular, loss-only, centrifuge,\n"
    "centrifuge-kv, strawman; the filtering flags (--ref, --keep, --drop-rate, --select,\n"
    "--per-batch) without --mode mean --mode centrifuge. --data and --val take a shard, a\n"
    "comma list or a quoted glob ('data/web_*.bin'); --ref auto reads X.ref.bin beside\n"
    "each X.bin.\n"
    "--model takes a HF directory or a run directory (its latest checkpoint).\n"
    "Checkpoints go to --out (resumable with --resume); without --out nothing is saved.";

int cmd_train(int argc, char **argv) {
    const char *config = NULL, *model_dir = NULL, *data = NULL, *ref_path = NULL, *val = NULL;
    const char *out = NULL, *log_path = NULL, *mode_s = NULL, *select_s = NULL, *device = "cpu";
    const char *freeze = NULL, *tokenizer = NULL, *dp_grad = "fp32";
    /* LoRA (PEFT's defaults where it has them: alpha 8 at rank 8) */
    const char *lora_targets = "q,k,v,o";
    long lora_rank = 0;
    double lora_alpha = -1, lora_dropout = 0;
    int rslora = 0;
    long batch = 4, seq = 64, steps = 50, accum = 1, warmup = -1, save_every = 0, eval_every = 0;
    long eval_batches = 8, seed = 1337, max_bad = 5, keep_last = 2, builtin_tokens = 1000000;
    long print_every = 1, vocab_size = 0, data_seed = -1, layers = 0;
    int shuffle = 0, vocab_from_data = 0, progress_only = 0;
    double lr = 1e-3, min_lr = -1, wd = 0.1, b1 = 0.9, b2 = 0.95, eps = 1e-8, clip = 1.0, keep = 0.5;
    double drop = -1, dist_timeout = 600;
    long tp = 1;
    int resume = 0, per_batch = 0, doc_mask = 0, quiet = 0;
    cf_opt opts[] = {
        {"--config", CF_OPT_STR, &config, 0, 0, "built-in name or config.json (fresh weights); default tiny", 0},
        {"--model", CF_OPT_STR, &model_dir, 0, 0, "HF model directory to start from", 0},
        {"--data", CF_OPT_STR, &data, 0, 0, "token shards: a file, a comma list or a quoted glob (default: built-in corpus)", 0},
        {"--ref", CF_OPT_STR, &ref_path, 0, 0, "reference losses of --data: auto (X.ref.bin beside X.bin) or shards in order", 0},
        {"--val", CF_OPT_STR, &val, 0, 0, "token shards for the validation loss", 0},
        {"--out", CF_OPT_STR, &out, 0, 0, "checkpoint directory (none: nothing is saved)", 0},
        {"--resume", CF_OPT_FLAG, &resume, 0, 0, "continue from the latest checkpoint in --out", 0},
        {"--log", CF_OPT_STR, &log_path, 0, 0, "JSON-lines metrics file", 0},
        /* torchrun's argument parser takes --log for an abbreviation of its
         * own --log-dir, even after the program name: use this name there */
        {"--log-file", CF_OPT_STR, &log_path, 0, 0, "the same as --log (use this one under torchrun)", 0},
        {"--device", CF_OPT_STR, &device, 0, 0, "cpu or cuda (default cpu)", 0},
        {"--mode", CF_OPT_STR, &mode_s, 0, 0, "regular | loss-only | centrifuge | centrifuge-kv | strawman (default regular; centrifuge with filtering flags)", 0},
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
        {"--eval-every", CF_OPT_INT, &eval_every, 0, 1L << 40, "validation every N steps (default with --val: steps/10, and the last)", 0},
        {"--eval-batches", CF_OPT_INT, &eval_batches, 1, 1L << 30, "validation batches (default 8)", 0},
        {"--max-bad-steps", CF_OPT_INT, &max_bad, 1, 1000000, "stop after N consecutive non-finite steps", 0},
        {"--builtin-tokens", CF_OPT_COUNT, &builtin_tokens, 1000, 1L << 31, "size of the built-in corpus", 0},
        {"--seed", CF_OPT_INT, &seed, 0, 1L << 62, "random seed (default 1337)", 0},
        {"--quiet", CF_OPT_FLAG, &quiet, 0, 0, "no progress lines", 0},
        {"--dist-timeout", CF_OPT_FLOAT, &dist_timeout, 1, 86400, "data parallel: seconds to wait for other ranks (default 600)", 0},
        {"--tp", CF_OPT_INT, &tp, 1, 1024, "tensor parallel degree: ranks per TP group (default 1; the rest data parallel)", 0},
        {"--dp-grad-dtype", CF_OPT_STR, &dp_grad, 0, 0, "data parallel: gradients on the wire, fp32 (default) or bf16", 0},
        {"--freeze", CF_OPT_STR, &freeze, 0, 0, "comma list of name parts to freeze (e.g. embed_tokens,lm_head)", 0},
        {"--lora-rank", CF_OPT_INT, &lora_rank, 1, 4096, "train LoRA adapters of this rank (base frozen); checkpoints are PEFT adapters", 0},
        {"--lora-alpha", CF_OPT_FLOAT, &lora_alpha, 1e-6, 1e6, "LoRA alpha (default: the rank); scale alpha/rank", 0},
        {"--lora-targets", CF_OPT_STR, &lora_targets, 0, 0, "modules: q,k,v,o,gate,up,down or all (default q,k,v,o)", 0},
        {"--lora-dropout", CF_OPT_FLOAT, &lora_dropout, 0, 0.999, "PEFT dropout P on the adapter input, training steps only (default 0)", 0},
        {"--rslora", CF_OPT_FLAG, &rslora, 0, 0, "rank-stabilised LoRA: scale alpha/sqrt(rank)", 0},
        {"--shuffle", CF_OPT_FLAG, &shuffle, 0, 0, "read rows of all shards in a seeded random order (default: in order)", 0},
        {"--data-seed", CF_OPT_INT, &data_seed, 0, 1L << 62, "seed of --shuffle (default --seed)", 0},
        {"--print-every", CF_OPT_INT, &print_every, 1, 1L << 40, "progress line every N steps (default 1)", 0},
        {"--progress", CF_OPT_FLAG, &progress_only, 0, 0, "one progress line with an ETA instead of a line per step", 0},
        {"--vocab-size", CF_OPT_INT, &vocab_size, 1, 1 << 30, "with --config: override its vocab_size", 0},
        {"--layers", CF_OPT_INT, &layers, 1, 4096, "with --config: only its first N layers (quick tests, dry runs)", 0},
        {"--vocab-from-data", CF_OPT_FLAG, &vocab_from_data, 0, 0, "with --config: vocab_size = largest id in --data (and --tokenizer) + 1", 0},
        {"--tokenizer", CF_OPT_STR, &tokenizer, 0, 0, "tokenizer.json or its directory: copied into every checkpoint", 0},
    };
    int nopts = (int)(sizeof opts / sizeof *opts);
    int pr = cf_cli_parse("train", TRAIN_USAGE, opts, nopts, argc, argv);
    if (pr == 1) return 0;
    if (pr < 0) return cf_cli_error("train", 2);
    if (cf_cli_check_model_flags(config, model_dir, device) != 0) return cf_cli_error("train", 2);

    cf_lora_opts lora = {0};
    if (lora_rank > 0) {
        lora.rank = (int)lora_rank;
        lora.alpha = lora_alpha > 0 ? (float)lora_alpha : (float)lora_rank;
        lora.dropout = (float)lora_dropout;
        lora.rslora = rslora;
        if (cf_lora_parse_targets(lora_targets, &lora.targets) != 0) return cf_cli_error("train", 2);
        if (freeze) { cf_fail("--freeze and --lora-rank: with LoRA every base tensor is frozen already"); return cf_cli_error("train", 2); }
    } else if (cf_opt_seen(opts, nopts, "--lora-alpha") || cf_opt_seen(opts, nopts, "--lora-targets") ||
               cf_opt_seen(opts, nopts, "--lora-dropout") || rslora) {
        cf_fail("LoRA options need --lora-rank");
        return cf_cli_error("train", 2);
    }
    /* a usage error here; the model would refuse it too, at run time */
    if (cf_list_check("--freeze", freeze) != 0) return cf_cli_error("train", 2);

    /* Safe defaults. The filtering flags ask for filtering: without --mode
     * they mean --mode centrifuge (the banner says so); next to an explicit
     * --mode regular they have no effect, and a note says that. */
    static const char *const FILTER_FLAGS[] = {"--ref", "--keep", "--drop-rate", "--select", "--per-batch"};
    char filter_given[80] = "";
    for (size_t f = 0; f < sizeof FILTER_FLAGS / sizeof *FILTER_FLAGS; f++)
        if (cf_opt_seen(opts, nopts, FILTER_FLAGS[f]))
            snprintf(filter_given + strlen(filter_given), sizeof filter_given - strlen(filter_given), "%s%s",
                     filter_given[0] ? ", " : "", FILTER_FLAGS[f]);
    int mode_implied = !mode_s && filter_given[0];
    if (!mode_s) mode_s = mode_implied ? "centrifuge" : "regular";
    cf_mode mode;
    cf_select_kind select;
    if (cf_mode_parse(mode_s, &mode) != 0) return cf_cli_error("train", 2);
    if (!select_s) select_s = ref_path ? "ref" : "self";
    if (cf_select_parse(select_s, &select) != 0) return cf_cli_error("train", 2);
    if (cf_opt_seen(opts, nopts, "--keep") && cf_opt_seen(opts, nopts, "--drop-rate")) { cf_fail("give --keep or --drop-rate, not both"); return cf_cli_error("train", 2); }
    if (drop >= 0) keep = 1.0 - drop;
    if (!(keep > 0)) { cf_fail("--keep: must be in (0, 1], got %g", keep); return cf_cli_error("train", 2); }
    if (select == CF_SELECT_REF && !ref_path && mode != CF_MODE_REGULAR) {
        cf_fail("--select ref needs --ref (make one with centrifuge score)");
        return cf_cli_error("train", 2);
    }
    if (ref_path && !data) { cf_fail("--ref needs --data (the token shard it was scored on)"); return cf_cli_error("train", 2); }
    if (resume && !out) { cf_fail("--resume needs --out"); return cf_cli_error("train", 2); }
    /* flags that would do nothing without another: said, not ignored */
    static const char *const NEEDS[][3] = {
        {"--save-every", "--out", "the directory checkpoints go to"},
        {"--keep-checkpoints", "--out", "the directory checkpoints go to"},
        {"--eval-every", "--val", "the shards evaluated"},
        {"--eval-batches", "--val", "the shards evaluated"},
        {"--data-seed", "--shuffle", "the seeded order it sets; without it rows are read in order"},
    };
    for (size_t k = 0; k < sizeof NEEDS / sizeof NEEDS[0]; k++)
        if (cf_opt_seen(opts, nopts, NEEDS[k][0]) && !cf_opt_seen(opts, nopts, NEEDS[k][1])) {
            cf_fail("%s needs %s (%s)", NEEDS[k][0], NEEDS[k][1], NEEDS[k][2]);
            return cf_cli_error("train", 2);
        }
    if (vocab_size && vocab_from_data) { cf_fail("give --vocab-size or --vocab-from-data, not both"); return cf_cli_error("train", 2); }
    if (strcmp(dp_grad, "fp32") != 0 && strcmp(dp_grad, "bf16") != 0) {
        cf_fail("--dp-grad-dtype: fp32 or bf16, got '%s'", dp_grad);
        return cf_cli_error("train", 2);
    }
    if (layers && model_dir) {
        cf_fail("--layers cuts a --config's layers; a --model directory keeps its own");
        return cf_cli_error("train", 2);
    }
    /* --tp: the launch it needs, and LoRA (the model would refuse them later,
     * after the data is read) */
    if (tp > 1 && lora_rank > 0) {
        cf_fail("--tp with LoRA adapters is not supported yet: use data parallelism (ZeRO-1) for LoRA");
        return cf_cli_error("train", 2);
    }
    if (cf_cli_check_tp((int)tp) != 0) return cf_cli_error("train", 2);
    if ((vocab_size || vocab_from_data) && model_dir) {
        cf_fail("--%s sizes a --config's vocabulary; a --model directory keeps its own",
                vocab_size ? "vocab-size" : "vocab-from-data");
        return cf_cli_error("train", 2);
    }
    if (warmup < 0) warmup = steps / 10;
    if (min_lr < 0) min_lr = lr / 10;
    if (val && !cf_opt_seen(opts, nopts, "--eval-every")) eval_every = steps >= 10 ? steps / 10 : 1;
    if (data_seed < 0) data_seed = seed;

    /* Before any work (docs/ROBUSTNESS.md §6): sizes, the inputs (so that no
     * output can be one of them), every output location, and what defines
     * the run (its manifest, which --resume checks). */
    g_stop = 0;
    if ((int64_t)batch * seq > (1 << 28)) {
        cf_fail("--batch %ld x --seq %ld = %lld tokens per micro-batch is more than the supported 2^28", batch, seq,
                (long long)batch * seq);
        return cf_cli_error("train", 2);
    }
    cf_inputs_begin_run();
    {
        const char *in[] = {data, ref_path, val, config, tokenizer};
        for (size_t i = 0; i < sizeof in / sizeof *in; i++) {
            /* shard lists and patterns: every file they name */
            char **paths = NULL;
            int np = 0;
            char err[1024];
            snprintf(err, sizeof err, "%s", cf_last_error());
            if (in[i] && (i == 0 || i == 2 || (i == 1 && strcmp(in[i], "auto") != 0)) &&
                cf_expand_paths(in[i], i == 1, &paths, &np) == 0) {
                for (int k = 0; k < np; k++) { cf_input_register(paths[k]); free(paths[k]); }
                free(paths);
            }
            cf_fail("%s", err);   /* a missing file is the reader's to report */
            cf_input_register(in[i]);
        }
        static const char *const MODEL_FILES[] = {"config.json", "model.safetensors", "model.safetensors.index.json"};
        char p[4096];
        for (size_t i = 0; model_dir && i < sizeof MODEL_FILES / sizeof *MODEL_FILES; i++)
            if (cf_path_join(p, sizeof p, model_dir, MODEL_FILES[i]) == 0) cf_input_register(p);
    }
    /* a log inside an --out that this run creates is checked once it exists */
    int log_in_new_out = 0;
    if (log_path && out && !cf_path_exists(out)) {
        size_t lo = strlen(out);
        while (lo > 1 && out[lo - 1] == '/') lo--;
        const char *slash = strrchr(log_path, '/');
        log_in_new_out = slash && (size_t)(slash - log_path) == lo && strncmp(log_path, out, lo) == 0;
    }
    if (log_path && !log_in_new_out && cf_output_check(log_path) != 0) return cf_cli_error("train", 1);
    if (log_path && out && in_run_files(log_path, out)) {
        cf_fail("--log %s: is one of the files the run keeps in --out %s; put the log elsewhere", log_path, out);
        return cf_cli_error("train", 2);
    }
    /* room below --out for OUT/step_NNNNNNNNNNNNN/model.safetensors.index.json.tmp.<16 hex> */
    if (out && cf_output_dir_check(out, 96) != 0) return cf_cli_error("train", 1);
    cf_manifest want = {0};
    {
        char mf[600];
        model_field(mf, sizeof mf, config, model_dir);
        if (layers > 0) {   /* (absent without --layers, as in manifests written before it existed) */
            size_t used = strlen(mf);
            snprintf(mf + used, sizeof mf - used, ", layers %ld", layers);
        }
        int filtering = mode != CF_MODE_REGULAR;
        cf_manifest_set(&want, "model", "%s", mf);
        cf_manifest_set(&want, "mode", "%s", cf_mode_name(mode));
        cf_manifest_set(&want, "select", "%s", filtering ? cf_select_name(select) : "-");
        cf_manifest_set(&want, "keep", "%s", "-");
        if (filtering) cf_manifest_set(&want, "keep", "%.17g", keep);
        cf_manifest_set(&want, "per_batch", "%d", filtering ? per_batch : 0);
        cf_manifest_set(&want, "doc_mask", "%d", doc_mask);
        cf_manifest_set(&want, "batch", "%ld", batch);
        cf_manifest_set(&want, "seq", "%ld", seq);
        cf_manifest_set(&want, "grad_accum", "%ld", accum);
        cf_manifest_set(&want, "seed", "%ld", seed);
        cf_manifest_set(&want, "freeze", "%s", freeze ? freeze : "");
        cf_manifest_set(&want, "lora", "none");
        if (lora.rank > 0) {
            char drop[48] = "";   /* (absent at 0, as in manifests written before dropout existed) */
            if (lora.dropout > 0) snprintf(drop, sizeof drop, ", dropout %g", (double)lora.dropout);
            cf_manifest_set(&want, "lora", "rank %d, alpha %g, targets 0x%x%s%s", lora.rank, (double)lora.alpha,
                            lora.targets, lora.rslora ? ", rslora" : "", drop);
        }
        cf_manifest_set(&want, "device", "%s", device);
        cf_manifest_set(&want, "lr", "%g", lr);
        cf_manifest_set(&want, "steps", "%ld", steps);
        cf_manifest_set(&want, "warmup", "%ld", warmup);
    }
    int lock_fd = -1, created_out = 0;
    int64_t saved_step = -1, done_step = 0;
    int stop_code = 0;
    stop_signals(1);

    /* data first: a bad file must fail before any work */
    cf_tokens tok = {0};          /* the built-in corpus, when there is no --data */
    int have_ref = ref_path != NULL;
    uint32_t *builtin = NULL;
    int rc = 1;
    cf_model *m = NULL;
    FILE *logf = NULL;
    int32_t *tokens = NULL;
    float *refb = NULL;
    cf_trainer *tr = NULL;
    cf_micro_batch *mbs = NULL;
    cf_dataset *ds = NULL, *vds = NULL;
    int have_val = 0;
    cf_dist *dist = NULL;
    int rank = 0, world = 1, dp = 1, dp_rank = 0;
    cf_tokenizer *tkz = NULL;
    char tok_src[4096] = "";      /* where the tokenizer files that travel with checkpoints are */
    char vocab_note[96] = "";

    /* Data parallel when a launcher (torchrun, srun, mpirun) started
     * several ranks: each rank trains on its GPU, rank 0 reports. */
    if (cf_dist_init_tp(&dist, (int)tp, dist_timeout) != 0) goto fail;
    if (cf_dist_set_grad_bf16(dist, !strcmp(dp_grad, "bf16")) != 0) goto fail;
    if (!dist && !strcmp(dp_grad, "bf16") && !quiet)
        fprintf(stderr, "train: note: --dp-grad-dtype bf16 has no effect in a single process (nothing is reduced)\n");
    rank = cf_dist_rank(dist);
    world = cf_dist_world(dist);
    dp = cf_dist_dp(dist);             /* the data is split over the DP ranks */
    dp_rank = cf_dist_dp_rank(dist);
    if (dist) {
        uint64_t h = CF_FNV_INIT;
        for (int i = 0; i < argc; i++) h = cf_fnv1a(h, argv[i], strlen(argv[i]) + 1);
        if (cf_dist_agree(dist, h, "the train arguments") != 0) goto fail;
        if (rank != 0) quiet = 1;
        if (!quiet) fprintf(stderr, "train: %s, %s\n", tp > 1 ? "tensor parallel" : "data parallel",
                            cf_dist_describe(dist));
    }
    cf_manifest_set(&want, "world_size", "%d", world);
    cf_manifest_set(&want, "tp", "%ld", tp);
    if (strcmp(dp_grad, "fp32") != 0) cf_manifest_set(&want, "dp_grad", "%s", dp_grad);   /* for the record */

    /* --out is this run's alone (a lock held until exit); a fresh run never
     * writes into another run's checkpoints; --resume continues only the run
     * its manifest describes */
    char have_latest[4096];
    if (out && rank == 0) {
        if ((lock_fd = cf_dir_lock(out, &created_out)) < 0) goto fail;
        if (log_in_new_out && cf_output_check(log_path) != 0) goto fail;
        if (log_in_new_out && in_run_files(log_path, out)) {
            cf_fail("--log %s: is one of the files the run keeps in --out %s; put the log elsewhere", log_path, out);
            goto fail;
        }
        int has_ckpt = latest_checkpoint(out, have_latest, sizeof have_latest);
        char mpath[4096];
        cf_manifest have;
        int mr = cf_path_join(mpath, sizeof mpath, out, "run.json") == 0 ? cf_manifest_read(mpath, &have) : -1;
        if (mr < 0) goto fail;
        if (has_ckpt && !resume) {
            cf_fail("%s already holds checkpoints of a run (latest: %s); continue it with --resume, or train into "
                    "another --out", out, have_latest + strlen(out) + 1);
            goto fail;
        }
        if (has_ckpt && mr == 0 && check_manifest(&have, &want, mpath, NULL) != 0) goto fail;
    }

    cf_dataset_opts dso = {(int)batch, (int)seq, shuffle, (uint64_t)data_seed};
    if (data) {
        if (!(ds = cf_dataset_open(data, ref_path, 0, &dso))) goto fail;
    } else {
        builtin = cf_malloc((size_t)builtin_tokens * sizeof(uint32_t));
        if (!builtin || cf_datagen_tokens(CF_DATA_CLEAN, (uint64_t)seed, builtin_tokens, builtin) != 0) goto fail;
        tok.path = "<built-in corpus>";
        tok.n = builtin_tokens;
        tok.width = 4;
        tok.data = builtin;
        tok.max_id = CF_TOK_VOCAB - 1;
        if (!(ds = cf_dataset_wrap(&tok, NULL, &dso))) goto fail;
    }
    if (val) {
        cf_dataset_opts vo = {(int)batch, (int)seq, 0, 0};
        if (!(vds = cf_dataset_open(val, NULL, 0, &vo))) goto fail;
        have_val = 1;
    }
    if (tokenizer) {
        if (!(tkz = cf_tokenizer_load(tokenizer))) goto fail;
        snprintf(tok_src, sizeof tok_src, "%s", tokenizer);
    }

    char model_ckpt[4096];   /* --model may be a run directory: its latest checkpoint */
    if (model_dir && !(model_dir = cf_resolve_model_dir(model_dir, model_ckpt, sizeof model_ckpt))) goto fail;
    if (!tok_src[0] && model_dir) snprintf(tok_src, sizeof tok_src, "%s", model_dir);

    int64_t step0 = 0, data_pos = 0;
    if (resume && out) {
        char latest[4096];
        if (cf_path_join(latest, sizeof latest, out, "latest") != 0) goto fail;
        if (cf_path_exists(latest)) {
            cf_model_opts mo = {0};
            if (cf_backend_parse(device, &mo.backend, &mo.device) != 0) goto fail;
            if (dist) mo.device = cf_dist_device(dist);   /* this rank's GPU (the memory check looks at it) */
            mo.seed = (uint64_t)seed;   /* a LoRA run on --config rebuilds its random base from the seed */
            mo.freeze = freeze;
            mo.lora = lora;
            if (lora.rank > 0) {   /* the base model as at the start; adapters from the checkpoint */
                mo.config = config;
                mo.model_dir = model_dir;
                mo.layers = (int)layers;
            }
            cf_model_opts mck = mo;
            char mck_dir[4096];
            mck.model_dir = latest_checkpoint(out, mck_dir, sizeof mck_dir) ? mck_dir : NULL;
            if (mck.model_dir && check_memory(&mck, batch, seq, accum, mode, keep, dp, (int)tp, 1) != 0) goto fail;
            m = cf_dist_checkpoint_load(dist, out, &mo, &step0, &data_pos);
            if (!m) goto fail;
            char ck[4096];
            if (!tokenizer && cf_resolve_model_dir(out, ck, sizeof ck)) {
                /* the checkpoint resumed from may be rotated out before the
                 * next one gets its tokenizer files: keep them in OUT */
                char stage[4096];
                int copied = -1;
                if (rank == 0 && cf_path_join(stage, sizeof stage, out, ".tokenizer") == 0 && cf_mkdir_p(stage) == 0)
                    copied = cf_copy_tokenizer_files(ck, stage);
                if (copied > 0) snprintf(tok_src, sizeof tok_src, "%s", stage);
                else if (copied == 0) rmdir(stage);   /* none to carry */
            }
        } else if (!quiet) {
            fprintf(stderr, "train: no checkpoint in %s yet; starting fresh\n", out);
        }
    }
    if (!m) {
        cf_model_opts mo = {0};
        if (cf_backend_parse(device, &mo.backend, &mo.device) != 0) goto fail;
        if (dist) mo.device = cf_dist_device(dist);   /* this rank's GPU (the memory check looks at it) */
        mo.config = config;
        mo.model_dir = model_dir;
        mo.seed = (uint64_t)seed;
        mo.freeze = freeze;
        mo.lora = lora;
        mo.layers = (int)layers;
        char cfg_tmp[4096] = "";
        if (!model_dir && (vocab_size || vocab_from_data || tkz)) {
            /* the config with its vocabulary (and BOS/EOS) sized to the data / tokenizer */
            long v = vocab_size;
            if (vocab_from_data) {
                v = (long)data_max_id(ds, vds, NULL, NULL) + 1;
                if (tkz && cf_tokenizer_max_id(tkz) > v) v = cf_tokenizer_max_id(tkz);
            }
            if (write_config_with_vocab(config, (int)v, tkz, cfg_tmp, sizeof cfg_tmp) != 0) goto fail;
            if (v) snprintf(vocab_note, sizeof vocab_note, ", vocab_size %ld%s", v, vocab_from_data ? " (from the data)" : "");
            mo.config = cfg_tmp;
        }
        if (check_memory(&mo, batch, seq, accum, mode, keep, dp, (int)tp, out != NULL) != 0) {
            if (cfg_tmp[0]) remove_config_tmp(cfg_tmp);
            goto fail;
        }
        m = cf_dist_open_model(dist, &mo);
        if (cfg_tmp[0]) remove_config_tmp(cfg_tmp);
    }
    if (!m) goto fail;
    const cf_config *cfg = cf_model_config(m);
    if (check_vocab(cfg, ds, vds, model_dir, resume && step0 > 0) != 0) goto fail;
    if (doc_mask) cf_model_set_doc_mask(m, cfg->bos_token_id >= 0 ? cfg->bos_token_id : CF_TOK_BOS);

    if (cf_dataset_set_rank(ds, dp_rank, dp) != 0) goto fail;
    if (data_pos && cf_dataset_seek(ds, data_pos) != 0) goto fail;
    /* what the run reads, in the manifest; a resume must read the same */
    cf_manifest_set(&want, "data", "%016llx", (unsigned long long)cf_dataset_fingerprint(ds));
    cf_manifest_set(&want, "data_args", "%s%s", data ? data : "<built-in corpus>", shuffle ? " (shuffled)" : "");
    cf_manifest_set(&want, "ref", "none");
    if (have_ref && ref_fingerprint(ds, &want) != 0) goto fail;
    if (out && rank == 0 && resume && step0 > 0) {
        char mpath[4096];
        cf_manifest have;
        if (cf_path_join(mpath, sizeof mpath, out, "run.json") != 0) goto fail;
        int mr = cf_manifest_read(mpath, &have);
        if (mr < 0 || (mr == 0 && (check_manifest(&have, &want, mpath, "data") != 0 ||
                                   check_manifest(&have, &want, mpath, "ref") != 0)))
            goto fail;
    }
    /* the log: replaced (or appended to, on --resume) only now that
     * everything else is known to be right; every write is checked */
    if (log_path && rank == 0 && !(logf = cf_output_stream(log_path, resume))) goto fail;
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

    if (!quiet && !progress_only)
        fprintf(stderr, "train: %s %s, %.2fM params (%.2fM trained)%s, %s backend | mode %s, select %s, keep %.2f%s | "
                        "%ld x %ld tokens x %ld accum x %d data-parallel ranks | %ld steps from %lld\n",
                cf_model_type_name(cfg->model_type), config ? config : (model_dir ? model_dir : "tiny"),
                cf_model_num_params(m) / 1e6, cf_model_num_trainable(m) / 1e6, tp > 1 ? " per TP rank" : "", device,
                cf_mode_name(mode),
                cf_select_name(select), mode == CF_MODE_REGULAR ? 1.0 : keep, per_batch ? " per batch" : "", batch,
                seq, accum, dp, steps, (long long)step0);
    if (!quiet && !progress_only) {
        /* what the defaults decided, said once, so nothing is silently ignored */
        if (mode_implied)
            fprintf(stderr, "train: mode centrifuge, implied by %s (give --mode to choose another)\n", filter_given);
        else if (mode == CF_MODE_REGULAR && filter_given[0])
            fprintf(stderr, "train: note: --mode regular trains on every token; %s %s no effect\n", filter_given,
                    strchr(filter_given, ',') ? "have" : "has");
        int nsh = cf_dataset_num_shards(ds);
        fprintf(stderr, "train: data %s%s: %d shard%s, %.1fM tokens, %s%s%s\n", data ? data : tok.path,
                vocab_note, nsh, nsh == 1 ? "" : "s", cf_dataset_num_tokens(ds) / 1e6,
                shuffle ? "shuffled rows" : "read in order", have_ref ? ", reference losses " : "",
                !have_ref ? "" : strcmp(ref_path, "auto") == 0 ? "X.ref.bin beside each X.bin" : ref_path);
        if (have_val)
            fprintf(stderr, "train: validation on %s every %ld steps and at the end (%ld batches)\n", val,
                    eval_every > 0 ? eval_every : steps, eval_batches);
        if (!out) fprintf(stderr, "train: no --out: nothing will be saved (give --out DIR to keep checkpoints)\n");
    }
    double t_start = cf_now();
    int bad_run = 0;
    cf_progress pg;
    cf_progress_start(&pg, "train", "steps", steps - step0, quiet);
    pg.delay = 1.0;
    for (int64_t step = step0; step < steps && !g_stop; step++) {
        double t0 = cf_now();
        for (long mi = 0; mi < accum; mi++)
            if (cf_dataset_next(ds, (int32_t *)mbs[mi].tokens, have_ref ? (float *)mbs[mi].ref : NULL) != 0) goto fail;
        float lr_now = cf_lr_schedule(step, warmup, steps, (float)lr, (float)min_lr);
        cf_step_stats st;
        if (cf_trainer_step(tr, mbs, lr_now, &st) != 0) goto fail;
        double loss = st.loss;
        float norm = st.grad_norm;
        int skipped = st.skipped;
        long long kept_sum = st.kept, ntok = st.tokens;
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
        /* validation on rank 0 (under TP its whole TP group, which computes together) */
        if (have_val && dp_rank == 0 && ((eval_every > 0 && (step + 1) % eval_every == 0) || step + 1 == steps)) {
            if (val_mean_loss(m, vds, batch, seq, eval_batches, &val_loss) != 0) goto fail;
        }
        int print_now = (step + 1) % print_every == 0 || step == step0 || step + 1 == steps || !isnan(val_loss);
        if (progress_only) {
            cf_progress_update(&pg, step + 1 - step0);
            print_now = 0;
        }
        if (!quiet && print_now) {
            char eta[32];
            double elapsed = cf_now() - t_start;
            fmt_eta(eta, sizeof eta, elapsed / (double)(step + 1 - step0) * (double)(steps - step - 1));
            fprintf(stderr, "step %5lld/%ld | loss %.4f | kept %lld/%lld | lr %.2e | norm %.3f | %.0f tok/s | "
                            "fwd %.1fms filt %.2fms bwd %.1fms opt %.1fms | ETA %s",
                    (long long)step + 1, steps, loss, kept_sum, ntok, hp.lr, norm, tps,
                    acc.forward * 1e3, acc.filter * 1e3, acc.backward * 1e3, acc.optimizer * 1e3, eta);
            if (!isnan(val_loss)) fprintf(stderr, " | val %.4f", val_loss);
            fputc('\n', stderr);
        }
        if (logf) {
            /* JSON has no NaN or infinity: a non-finite value is null */
            char jl[32], jr[32], jn[32], jt[32], jv[32];
            fprintf(logf, "{\"step\":%lld,\"loss\":%s,\"kept\":%lld,\"tokens\":%lld,\"lr\":%s,\"grad_norm\":%s,"
                          "\"tokens_per_s\":%s,\"forward_s\":%.6f,\"filter_s\":%.6f,\"backward_s\":%.6f,"
                          "\"optimizer_s\":%.6f,\"step_s\":%.6f,\"skipped\":%d",
                    (long long)step + 1, cf_json_num(jl, sizeof jl, "%.6f", loss), kept_sum, ntok,
                    cf_json_num(jr, sizeof jr, "%.6g", hp.lr), cf_json_num(jn, sizeof jn, "%.6g", norm),
                    cf_json_num(jt, sizeof jt, "%.1f", tps), acc.forward, acc.filter, acc.backward, acc.optimizer, dt,
                    skipped);
            if (!isnan(val_loss)) fprintf(logf, ",\"val_loss\":%s", cf_json_num(jv, sizeof jv, "%.6f", val_loss));
            /* what ran: every record names the device, commit, mode and parallelism */
            if (tp > 1) {
                /* TP all-reduce traffic of this step: payload bytes per rank and seconds on the
                 * communication stream, forward / backward / optimizer */
                cf_tp_traffic tt;
                if (cf_dist_tp_traffic(dist, &tt) != 0) goto fail;
                fprintf(logf, ",\"tp_fwd_bytes\":%lld,\"tp_bwd_bytes\":%lld,\"tp_step_bytes\":%lld,\"tp_fwd_calls\":%lld,"
                              "\"tp_bwd_calls\":%lld,\"tp_fwd_comm_s\":%.6f,\"tp_bwd_comm_s\":%.6f,\"tp_step_comm_s\":%.6f",
                        (long long)tt.bytes[0], (long long)tt.bytes[1], (long long)tt.bytes[2], (long long)tt.calls[0],
                        (long long)tt.calls[1], tt.seconds[0], tt.seconds[1], tt.seconds[2]);
            }
            fprintf(logf, ",\"peak_mem_bytes\":%zu", cf_model_memory_peak(m));
            fprintf(logf, ",\"mode\":\"%s\",\"gpu\":\"%s\",\"commit\":\"%s\",\"world_size\":%d,\"tp\":%ld,\"lora_rank\":%d}\n",
                    cf_mode_name(mode), cf_model_device_name(m), cf_build_commit(), world, tp, lora.rank);
            /* a full disk must not cut the log silently */
            if (cf_stream_check(logf, log_path) != 0) goto fail;
        }
        int last = step + 1 == steps || g_stop;
        if (out && ((save_every > 0 && (step + 1) % save_every == 0) || last)) {
            if (rank == 0 && saved_step < 0 && write_manifest(out, &want) != 0) goto fail;
            if (cf_dist_checkpoint_save(dist, m, out, step + 1, cf_dataset_tell(ds), (int)keep_last) != 0) goto fail;
            saved_step = step + 1;
            if (rank == 0 && tok_src[0] && copy_tokenizer_to_checkpoint(tok_src, out, step + 1) != 0) goto fail;
        }
        done_step = step + 1;
    }
    cf_progress_end(&pg);
    if (g_stop) {
        /* SIGINT or SIGTERM: the step in flight finished; save it (the
         * signal may have come after the loop's own save check) */
        stop_code = 128 + g_stop;
        int need = out && done_step > step0 && saved_step < done_step;
        if (need && rank == 0 && saved_step < 0 && write_manifest(out, &want) != 0) goto fail;
        if (need && cf_dist_checkpoint_save(dist, m, out, done_step, cf_dataset_tell(ds), (int)keep_last) != 0)
            goto fail;
        if (need) saved_step = done_step;
        if (need && rank == 0 && tok_src[0] && copy_tokenizer_to_checkpoint(tok_src, out, done_step) != 0) goto fail;
        fprintf(stderr, "train: %s after step %lld%s\n", stop_code == 143 ? "SIGTERM" : "interrupted",
                (long long)(done_step > step0 ? done_step : step0),
                out && saved_step >= 0 ? "; checkpoint saved" : out ? "; no new step to save" : "");
    }
    if (logf) {
        int e = cf_stream_close(logf, log_path);
        logf = NULL;
        if (e != 0) goto fail;
    }
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
        /* no partial output: an --out this run created and never
         * checkpointed into goes away */
        if (created_out && saved_step < 0) cf_remove_created_dir(out);
    }
    if (lock_fd >= 0) close(lock_fd);
    stop_signals(0);
    cf_inputs_end_run();
    if (logf) fclose(logf);
    free(tokens); free(refb); free(mbs);
    cf_trainer_free(tr);
    cf_dataset_free(ds);
    cf_dataset_free(vds);
    cf_tokenizer_free(tkz);
    free(builtin);
    cf_model_free(m);
    cf_dist_free(dist);
    return rc ? rc : stop_code;
}

