/*
 * checkpoint.c — training checkpoints: dir/step_NNNNNNNN/ holds the model
 * (config.json + model.safetensors, fp32) and state.bin (the AdamW moments
 * of the local optimizer shard, the optimizer's step count, the training
 * step and the data position); dir/latest names the newest complete one.
 * Every file is written atomically and `latest` moves only after the whole
 * checkpoint is on disk, so a crash at any point leaves the previous
 * checkpoint intact.
 */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/common.h"
#include "engine/model_internal.h"

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
    char path[4096], state[4096];
    if (m->opt.sync.world > 1) return cf_fail("checkpoint: a data-parallel model is saved by cf_dist_checkpoint_save");
    if (cf_checkpoint_dir(dir, step, path, sizeof path) != 0) return -1;
    if (cf_model_save(m, path, "float32", 0) != 0) return -1;
    size_t n = m->opt.lay.nlocal;
    float *mv = cf_malloc(2 * n * sizeof(float) + 1);
    if (!mv) return -1;
    if (cf_model_get_adam(m, mv, mv + n) != 0) { free(mv); return -1; }
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
    return cf_checkpoint_commit(dir, step, keep_last);
}

int cf_checkpoint_commit(const char *dir, int64_t step, int keep_last) {
    char sub[64];
    snprintf(sub, sizeof sub, "step_%08lld", (long long)step);
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

int cf_checkpoint_dir(const char *dir, int64_t step, char *out, size_t cap) {
    char sub[64];
    snprintf(sub, sizeof sub, "step_%08lld", (long long)step);
    if (cf_mkdir_p(dir) != 0 || cf_path_join(out, cap, dir, sub) != 0) return -1;
    remove_stale_temps(out);   /* from a killed earlier save of this step */
    return 0;
}

int cf_checkpoint_latest(const char *dir, char *out, size_t cap) {
    char latest[4096];
    if (cf_path_join(latest, sizeof latest, dir, "latest") != 0) return -1;
    char *name = cf_read_file(latest, NULL, 256);
    if (!name) return -1;
    name[strcspn(name, "\r\n")] = 0;
    if (!*name || strchr(name, '/')) { cf_fail("%s: malformed", latest); free(name); return -1; }
    int rc = cf_path_join(out, cap, dir, name);
    free(name);
    return rc;
}

cf_model *cf_checkpoint_load(const char *dir, const cf_model_opts *opts, int64_t *step, int64_t *data_pos) {
    char path[4096], state[4096];
    if (cf_checkpoint_latest(dir, path, sizeof path) != 0) return NULL;
    cf_model_opts o = *opts;
    o.config = NULL;
    o.model_dir = path;
    cf_model *m = cf_model_open(&o);
    if (!m) return NULL;
    size_t n = m->opt.lay.nlocal, len = 0;
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
    float *mv = cf_malloc(2 * n * sizeof(float) + 1);
    if (!mv) { free(buf); cf_model_free(m); return NULL; }
    memcpy(mv, buf + hbytes, 2 * n * sizeof(float));
    int rc2 = cf_model_set_adam(m, mv, mv + n, h.opt_steps);
    free(mv);
    if (rc2 != 0) { free(buf); cf_model_free(m); return NULL; }
    free(buf);
    *step = h.step;
    *data_pos = h.data_pos;
    return m;
}

