/*
 * checkpoint.c — training checkpoints: dir/step_NNNNNNNN/ holds the model
 * (config.json + model.safetensors, fp32), state.bin (the AdamW moments
 * of the local optimizer shard, the optimizer's step count, the training
 * step and the data position) and a marker, centrifuge_checkpoint.json,
 * naming the run that wrote it; dir/latest names the newest complete one;
 * dir/run.json is the run's manifest (its id, and the arguments that
 * define the run when `centrifuge train` wrote it).
 *
 * Every file is written atomically and `latest` moves only after the whole
 * checkpoint is on disk, so a crash at any point leaves the previous
 * checkpoint intact. Housekeeping never touches what is not this run's:
 *   - a checkpoint is written only into a step directory that is new or
 *     carries this run's marker;
 *   - rotation removes only step directories with this run's marker;
 *   - `latest` never moves backwards;
 *   - only this code's temp files (cf_is_temp_name) are cleaned up;
 *   - weights or optimizer state that are not finite never become a
 *     checkpoint, and a checkpoint whose state is not finite is refused.
 */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/common.h"
#include "engine/model_internal.h"

/* state.bin: this header, then Adam's m and v (nparams floats each), in
 * the optimizer's whole layout (cf_optim_layout_whole: the parameter
 * table's order). opt_steps (version 2) is the optimizer's own step count,
 * which Adam's bias correction uses: it falls behind `step` by the number
 * of skipped (non-finite) steps, so an exact resume needs it. Version 1
 * files, without it, still load (opt_steps = step). Version 3 has version
 * 2's header; its moments follow the table in which q/k/v biases come after
 * the three weights (model.c): older files are permuted on load. */
#define STATE_MAGIC "CFSTATE3"
#define STATE_MAGIC_V2 "CFSTATE2"
#define STATE_MAGIC_V1 "CFSTATE1"
typedef struct {
    char magic[8];
    int64_t nparams, step, data_pos;
    int64_t opt_steps;
} state_header;
#define STATE_HEADER_V1_BYTES (8 + 3 * sizeof(int64_t))

#define MARKER_NAME "centrifuge_checkpoint.json"
#define MANIFEST_NAME "run.json"
#define RUN_FORMAT "centrifuge-run-1"

/* ----------------------------------------------------------- run identity */

int cf_checkpoint_run_id(const char *dir, char *id, size_t cap, int create) {
    char path[4096];
    if (cf_path_join(path, sizeof path, dir, MANIFEST_NAME) != 0) return -1;
    cf_manifest mf;
    int rc = cf_manifest_read(path, &mf);
    if (rc < 0) return -1;
    const char *have = rc == 0 ? cf_manifest_get(&mf, "run_id") : NULL;
    if (have && *have) {
        snprintf(id, cap, "%s", have);
        return 0;
    }
    if (!create) {
        if (cap) id[0] = 0;
        return 0;
    }
    if (rc == 1) memset(&mf, 0, sizeof mf);
    char fresh[32];
    snprintf(fresh, sizeof fresh, "%016llx", (unsigned long long)cf_random_u64());
    cf_manifest out = {0};
    cf_manifest_set(&out, "format", RUN_FORMAT);
    cf_manifest_set(&out, "run_id", "%s", fresh);
    for (int i = 0; i < mf.n; i++)
        if (strcmp(mf.kv[i].key, "format") != 0 && strcmp(mf.kv[i].key, "run_id") != 0)
            cf_manifest_set(&out, mf.kv[i].key, "%s", mf.kv[i].val);
    if (cf_manifest_write(path, &out) != 0) return -1;
    snprintf(id, cap, "%s", fresh);
    return 0;
}

/* The run id in step directory sub's marker ("" if it has none); -1 if
 * the marker exists but cannot be read. */
static int marker_run_id(const char *sub, char *id, size_t cap) {
    char path[4096 + 64];
    id[0] = 0;
    if (cf_path_join(path, sizeof path, sub, MARKER_NAME) != 0) return -1;
    cf_manifest mf;
    int rc = cf_manifest_read(path, &mf);
    if (rc < 0) return -1;
    const char *v = rc == 0 ? cf_manifest_get(&mf, "run_id") : NULL;
    if (v) snprintf(id, cap, "%s", v);
    return 0;
}

/* "step_NNNNNNNN" exactly (8 or more digits): returns 1 and sets *step. */
static int parse_step_name(const char *name, long long *step) {
    if (strncmp(name, "step_", 5) != 0) return 0;
    const char *d = name + 5;
    size_t n = strlen(d);
    if (n < 8 || n > 18) return 0;
    long long v = 0;
    for (size_t i = 0; i < n; i++) {
        if (d[i] < '0' || d[i] > '9') return 0;
        v = v * 10 + (d[i] - '0');
    }
    *step = v;
    return 1;
}

/* ------------------------------------------------------------ cleaning up */

/* Removes the temp files (cf_atomic_open's) a killed save left in dir. */
static void remove_stale_temps(const char *dir) {
    DIR *d = opendir(dir);
    struct dirent *e;
    char f[4096 + 256];
    while (d && (e = readdir(d)))
        if (cf_is_temp_name(e->d_name) && cf_path_join(f, sizeof f, dir, e->d_name) == 0) unlink(f);
    if (d) closedir(d);
}

/* Removes a checkpoint directory of this run with everything in it: the
 * checkpoint's files and whatever temp files a killed save left there. The
 * marker goes last, so a removal killed half-way leaves a directory that
 * the next rotation still knows as this run's and removes (a kill between
 * the marker and the rmdir leaves an empty one: rotation removes those). */
static void remove_checkpoint(const char *victim) {
    DIR *d = opendir(victim);
    struct dirent *e;
    char f[4096 + 256];
    while (d && (e = readdir(d))) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0 || strcmp(e->d_name, MARKER_NAME) == 0)
            continue;
        struct stat st;
        if (cf_path_join(f, sizeof f, victim, e->d_name) == 0 && lstat(f, &st) == 0 && !S_ISDIR(st.st_mode))
            unlink(f);
    }
    if (d) closedir(d);
    if (cf_path_join(f, sizeof f, victim, MARKER_NAME) == 0) unlink(f);
    rmdir(victim);
}

/* ------------------------------------------------------- finiteness checks */

/* The tensor of local shard element i, or NULL (padding). */
static const char *tensor_at(const cf_model *m, size_t i, size_t *elem) {
    const cf_optim_layout *lay = &m->opt.lay;
    for (int s = 0; s < lay->nseg; s++) {
        const cf_segment *g = &lay->seg[s];
        if (i >= g->loff && i < g->loff + g->len) {
            const cf_param *p = &m->params[g->tensor];
            *elem = g->goff - lay->goff[g->tensor] + (i - g->loff);
            return p->name;
        }
    }
    return NULL;
}

int cf_checkpoint_check_state(const cf_model *m, const float *master, const float *am, const float *av,
                              const char *what) {
    size_t n = m->opt.lay.nlocal;
    const float *arr[3] = {master, am, av};
    const char *name[3] = {"weight", "AdamW m", "AdamW v"};
    for (int k = 0; k < 3; k++) {
        const float *a = arr[k];
        if (!a) continue;
        for (size_t i = 0; i < n; i++) {
            float v = a[i];
            if (isfinite(v) && !(k == 2 && v < 0)) continue;
            size_t elem = 0;
            const char *t = tensor_at(m, i, &elem);
            char val[32];
            snprintf(val, sizeof val, "%s", isnan(v) ? "nan" : isinf(v) ? (v > 0 ? "inf" : "-inf") : "negative");
            if (t) return cf_fail("%s: %s of %s[%zu] is %s", what, name[k], t, elem, val);
            return cf_fail("%s: %s at shard element %zu is %s", what, name[k], i, val);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ saving */

int cf_checkpoint_dir(const char *dir, int64_t step, char *out, size_t cap, int mark) {
    char sub[64];
    snprintf(sub, sizeof sub, "step_%08lld", (long long)step);
    if (cf_mkdir_p(dir) != 0 || cf_path_join(out, cap, dir, sub) != 0) return -1;
    if (!mark) return cf_mkdir_p(out);
    char run[64], have[64];
    if (cf_checkpoint_run_id(dir, run, sizeof run, 1) != 0) return -1;
    struct stat st;
    if (lstat(out, &st) == 0) {
        if (!S_ISDIR(st.st_mode)) return cf_fail("%s: exists and is not a checkpoint directory; not replacing it", out);
        if (marker_run_id(out, have, sizeof have) != 0) return -1;
        if (strcmp(have, run) != 0) {
            /* an empty directory (a save killed before its marker) is fine */
            DIR *d = opendir(out);
            struct dirent *e;
            int entries = 0;
            while (d && (e = readdir(d)))
                entries += strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0 && !cf_is_temp_name(e->d_name);
            if (d) closedir(d);
            if (entries)
                return cf_fail("%s: holds a checkpoint of another run (%s); not overwriting it (use another --out)",
                               out, *have ? have : "no run id");
        }
        remove_stale_temps(out);   /* from a killed earlier save of this step */
    } else if (cf_mkdir_p(out) != 0) {
        return -1;
    }
    /* The marker first: a save killed half-way leaves a directory that this
     * run's rotation may still remove. */
    char marker[4096 + 64];
    if (cf_path_join(marker, sizeof marker, out, MARKER_NAME) != 0) return -1;
    cf_manifest mf = {0};
    cf_manifest_set(&mf, "format", "centrifuge-checkpoint-1");
    cf_manifest_set(&mf, "run_id", "%s", run);
    cf_manifest_set(&mf, "step", "%lld", (long long)step);
    return cf_manifest_write(marker, &mf);
}

int cf_checkpoint_save(cf_model *m, const char *dir, int64_t step, int64_t data_pos, int keep_last) {
    char path[4096], state[4096];
    if (m->opt.sync.world > 1) return cf_fail("checkpoint: a data-parallel model is saved by cf_dist_checkpoint_save");
    if (step < 0 || data_pos < 0) return cf_fail("checkpoint: step %lld and data position %lld must be >= 0",
                                                 (long long)step, (long long)data_pos);
    /* Everything is checked before the first byte is written: non-finite
     * weights or moments never become a checkpoint, and the last good one
     * stays where `latest` points. */
    size_t n = m->opt.lay.nlocal;
    float *mv = cf_malloc(3 * n * sizeof(float) + 1);
    if (!mv) return -1;
    int rc = cf_model_get_adam(m, mv, mv + n);
    if (rc == 0 && n) rc = m->b->download(m->b, mv + 2 * n, m->opt.master, n * sizeof(float));
    char what[128];
    snprintf(what, sizeof what, "step %lld: checkpoint refused", (long long)step);
    if (rc == 0 && cf_checkpoint_check_state(m, mv + 2 * n, mv, mv + n, what) != 0) {
        cf_fail("%s (the run diverged: lower --lr, check the data); %s/latest still names the last good checkpoint",
                cf_last_error(), dir);
        rc = -1;
    }
    if (rc == 0) rc = cf_checkpoint_dir(dir, step, path, sizeof path, 1);
    /* LoRA: the adapters only (PEFT files); the base model is the run's --model */
    if (rc == 0) rc = m->lora.rank > 0 ? cf_lora_save(m, path, NULL) : cf_model_save(m, path, "float32", 0);
    state_header h = {STATE_MAGIC, (int64_t)n, step, data_pos, cf_optimizer_steps(m)};
    memcpy(h.magic, STATE_MAGIC, 8);
    cf_atomic_file af;
    if (rc == 0) rc = cf_path_join(state, sizeof state, path, "state.bin");
    if (rc == 0) rc = cf_atomic_open(&af, state);
    if (rc == 0) {
        rc = cf_atomic_write(&af, &h, sizeof h);
        if (rc == 0) rc = cf_atomic_write(&af, mv, 2 * n * sizeof(float));
        if (rc == 0) rc = cf_atomic_commit(&af);
        else cf_atomic_abort(&af);
    }
    free(mv);
    if (rc != 0) return -1;
    return cf_checkpoint_commit(dir, step, keep_last);
}

typedef struct { long long step; char name[64]; } step_dir;

static int cmp_step_desc(const void *a, const void *b) {
    long long x = ((const step_dir *)a)->step, y = ((const step_dir *)b)->step;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* The step `latest` names (-1 if there is none or it is unreadable). */
static long long latest_step(const char *dir) {
    char latest[4096];
    if (cf_path_join(latest, sizeof latest, dir, "latest") != 0) return -1;
    struct stat st;
    if (lstat(latest, &st) != 0) return -1;
    char *name = cf_read_file(latest, NULL, 256);
    if (!name) return -1;
    name[strcspn(name, "\r\n")] = 0;
    long long s = -1;
    if (!parse_step_name(name, &s)) s = -1;
    free(name);
    return s;
}

int cf_checkpoint_commit(const char *dir, int64_t step, int keep_last) {
    char sub[64];
    snprintf(sub, sizeof sub, "step_%08lld", (long long)step);
    /* `latest` never moves backwards */
    long long cur = latest_step(dir);
    if (cur > step)
        return cf_fail("%s/latest names step %lld, newer than this checkpoint's step %lld; not moving it back "
                       "(is another run writing to %s?)", dir, cur, (long long)step, dir);
    /* The checkpoint is complete: only now point `latest` at it. */
    char latest[4096], line[80];
    if (cf_path_join(latest, sizeof latest, dir, "latest") != 0) return -1;
    int len = snprintf(line, sizeof line, "%s\n", sub);
    if (cf_write_file_atomic(latest, line, (size_t)len) != 0) return -1;
    remove_stale_temps(dir);    /* e.g. latest.tmp.<random> of a killed run */
    if (keep_last <= 0) return 0;
    /* Rotation: of this run's step directories (marker with its run id) at
     * or before this step, keep the newest keep_last. Nothing else is
     * touched: not other runs' checkpoints, not the user's files. */
    char run[64];
    if (cf_checkpoint_run_id(dir, run, sizeof run, 0) != 0 || !run[0]) return 0;
    DIR *d = opendir(dir);
    if (!d) return 0;
    step_dir *mine = NULL;
    int n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        long long s;
        if (!parse_step_name(e->d_name, &s) || s > step) continue;
        char p[4096 + 256], have[64];
        struct stat st;
        if (cf_path_join(p, sizeof p, dir, e->d_name) != 0 || lstat(p, &st) != 0 || !S_ISDIR(st.st_mode)) continue;
        if (marker_run_id(p, have, sizeof have) != 0) continue;
        if (!have[0] && s < step) {
            rmdir(p);   /* empty (a removal killed after its marker): gone; with files: kept */
            continue;
        }
        if (strcmp(have, run) != 0) continue;
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            step_dir *g = realloc(mine, (size_t)cap * sizeof *g);
            if (!g) break;
            mine = g;
        }
        mine[n].step = s;
        snprintf(mine[n].name, sizeof mine[n].name, "%.63s", e->d_name);
        n++;
    }
    closedir(d);
    if (n > 1) qsort(mine, (size_t)n, sizeof *mine, cmp_step_desc);
    for (int i = keep_last; i < n; i++) {
        if (mine[i].step >= step) continue;   /* never the one `latest` names */
        char victim[4096 + 64];
        if (cf_path_join(victim, sizeof victim, dir, mine[i].name) == 0) remove_checkpoint(victim);
    }
    free(mine);
    return 0;
}

int cf_checkpoint_latest(const char *dir, char *out, size_t cap) {
    char latest[4096];
    if (cf_path_join(latest, sizeof latest, dir, "latest") != 0) return -1;
    char *name = cf_read_file(latest, NULL, 256);
    if (!name) return -1;
    name[strcspn(name, "\r\n")] = 0;
    if (!*name || strchr(name, '/') || strcmp(name, "..") == 0 || strcmp(name, ".") == 0) {
        cf_fail("%s: malformed", latest);
        free(name);
        return -1;
    }
    int rc = cf_path_join(out, cap, dir, name);
    free(name);
    return rc;
}

/* Moments of a version 1 or 2 state.bin, written when each q/k/v bias
 * followed its own weight in the table, into this table's layout (m, then
 * v, n floats each; in place). Nothing to do for models without those
 * biases, or with them frozen (LoRA). */
static int state_from_v2_order(cf_model *m, float *mv, size_t n) {
    int *order = cf_malloc((size_t)m->ntensors * sizeof(int));
    if (!order) return -1;
    cf_optim_layout old;
    memset(&old, 0, sizeof old);
    float *tmp = NULL;
    size_t cap = 0;
    int rc = 0;
    if (cf_param_order_v2(m, order) && (rc = cf_optim_layout_order(m, order, &old)) == 0) {
        if (old.nlocal != n || m->opt.lay.nlocal != n)
            rc = cf_fail("internal: state.bin of %zu parameters does not match the layout", n);
        /* the orders differ only inside a layer, whose tensors fill the
         * same span in both layouts: each span goes through a buffer once
         * (the largest span's, not the whole state's) */
        for (int l = -1; rc == 0 && l <= m->cfg.num_hidden_layers; l++) {
            size_t lo = SIZE_MAX, hi = 0;
            for (int i = 0; i < m->ntensors; i++) {
                if (!m->params[i].trainable || m->params[i].layer != l) continue;
                lo = CF_MIN(lo, m->opt.lay.goff[i]);
                hi = CF_MAX(hi, m->opt.lay.goff[i] + m->params[i].numel);
            }
            if (lo >= hi) continue;
            for (int i = 0; rc == 0 && i < m->ntensors; i++)
                if (m->params[i].trainable && m->params[i].layer == l &&
                    (old.goff[i] < lo || old.goff[i] + m->params[i].numel > hi))
                    rc = cf_fail("internal: %s moves out of its layer's span of the optimizer state", m->params[i].name);
            if (rc == 0 && hi - lo > cap) {
                free(tmp);
                cap = hi - lo;
                tmp = cf_malloc(cap * sizeof(float));
                if (!tmp) rc = -1;
            }
            for (size_t half = 0; rc == 0 && half < 2 * n; half += n) { /* m, then v */
                memcpy(tmp, mv + half + lo, (hi - lo) * sizeof(float));
                memset(mv + half + lo, 0, (hi - lo) * sizeof(float)); /* padding stays zero */
                for (int i = 0; i < m->ntensors; i++)
                    if (m->params[i].trainable && m->params[i].layer == l)
                        memcpy(mv + half + m->opt.lay.goff[i], tmp + (old.goff[i] - lo),
                               m->params[i].numel * sizeof(float));
            }
        }
    }
    free(tmp);
    cf_optim_layout_free(&old);
    free(order);
    return rc;
}

cf_model *cf_checkpoint_load(const char *dir, const cf_model_opts *opts, int64_t *step, int64_t *data_pos) {
    char path[4096], state[4096];
    if (cf_checkpoint_latest(dir, path, sizeof path) != 0) return NULL;
    cf_model_opts o = *opts;
    if (opts->lora.rank > 0) {
        /* LoRA: the base model as the run opens it, the adapters of the checkpoint */
        o.lora.rank = 0;
        o.adapter_dir = path;
    } else {
        o.config = NULL;
        o.layers = 0;   /* the checkpoint's config.json has them */
        o.model_dir = path;
    }
    cf_model *m = cf_model_open(&o);
    if (!m) return NULL;
    size_t n = m->opt.lay.nlocal, len = 0;
    if (cf_path_join(state, sizeof state, path, "state.bin") != 0) { cf_model_free(m); return NULL; }
    char *buf = cf_read_file(state, &len, sizeof(state_header) + 2 * n * sizeof(float));
    if (!buf) { cf_model_free(m); return NULL; }
    state_header h;
    memset(&h, 0, sizeof h);
    int v1 = len >= 8 && memcmp(buf, STATE_MAGIC_V1, 8) == 0;
    int v2 = len >= 8 && memcmp(buf, STATE_MAGIC_V2, 8) == 0;
    size_t hbytes = v1 ? STATE_HEADER_V1_BYTES : sizeof h;
    if (len != hbytes + 2 * n * sizeof(float)) {
        cf_fail("%s: %zu bytes, expected %zu for %zu parameters", state, len, hbytes + 2 * n * sizeof(float), n);
        free(buf); cf_model_free(m); return NULL;
    }
    memcpy(&h, buf, hbytes);
    if (v1) h.opt_steps = h.step;
    if (v1 || v2) memcpy(h.magic, STATE_MAGIC, 8);
    if (memcmp(h.magic, STATE_MAGIC, 8) != 0 || h.nparams != (int64_t)n || h.step < 0 || h.data_pos < 0 ||
        h.opt_steps < 0) {
        cf_fail("%s: not a centrifuge training state for this model", state);
        free(buf); cf_model_free(m); return NULL;
    }
    float *mv = cf_malloc(2 * n * sizeof(float) + 1);
    if (!mv) { free(buf); cf_model_free(m); return NULL; }
    memcpy(mv, buf + hbytes, 2 * n * sizeof(float));
    free(buf);
    if ((v1 || v2) && state_from_v2_order(m, mv, n) != 0) { free(mv); cf_model_free(m); return NULL; }
    /* moments that are not finite would poison every later update */
    int rc2 = cf_checkpoint_check_state(m, NULL, mv, mv + n, state);
    if (rc2 != 0) cf_fail("%s; the checkpoint is damaged, not resuming from it", cf_last_error());
    if (rc2 == 0) rc2 = cf_model_set_adam(m, mv, mv + n, h.opt_steps);
    free(mv);
    if (rc2 != 0) { cf_model_free(m); return NULL; }
    *step = h.step;
    *data_pos = h.data_pos;
    return m;
}
