/*
 * fuzz_targets.h — the bodies of the three fuzz targets (config.json,
 * safetensors, token/ref-loss shards), shared by the libFuzzer entry points
 * in tests/fuzz/fuzz_*.c and by tests/test_fuzz_regressions.c, so a saved
 * input replays through exactly the code that found it.
 *
 * Each fz_* function takes the raw input bytes, makes them a file (a memfd,
 * reached by path through /proc/self/fd; a file in /dev/shm or $TMPDIR where
 * memfd_create is unavailable), runs the public reader on that path and
 * checks what DESIGN §5 promises:
 *   - on failure: cf_last_error() is one non-empty line, free of control
 *     bytes, that names the file;
 *   - on success: the result is self-consistent (a config validates and
 *     survives save -> load unchanged; every tensor reads back in full;
 *     every token id is below the vocabulary and the hash is right; every
 *     reference loss is finite and non-negative with ref[0] = 0).
 * A broken promise returns a description (the fuzz targets abort on it, the
 * regression test reports it); NULL means the input was handled correctly.
 * Crashes, hangs and leaks are the sanitizers' and libFuzzer's business.
 */
#ifndef CF_FUZZ_TARGETS_H
#define CF_FUZZ_TARGETS_H

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "centrifuge.h"
#include "base/common.h"
#include "formats/io.h"

/* The entry points; each program uses some of them. */
#define FZ_API static __attribute__((unused))

/* The vocabulary token shards are checked against (the `tiny` config's). */
#define FZ_VOCAB 320

/* ------------------------------------------------------------ input files */

typedef struct {
    int fd;
    char path[2048];
} fz_file;

/* A private scratch directory, removed at exit. */
static char fz_dir_path[1024];

static int fz_unlink_cb(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st; (void)flag; (void)ftw;
    remove(path);
    return 0;
}

static void fz_remove_tree(const char *dir) {
    if (strstr(dir, "/cf_fuzz_") == NULL) return;   /* only ever our own mkdtemp directory */
    nftw(dir, fz_unlink_cb, 16, FTW_DEPTH | FTW_PHYS);
}

static void fz_cleanup(void) {
    if (fz_dir_path[0]) fz_remove_tree(fz_dir_path);
    fz_dir_path[0] = 0;
}

static const char *fz_dir(void) {
    if (fz_dir_path[0]) return fz_dir_path;
    const char *bases[] = {"/dev/shm", getenv("TMPDIR"), "/tmp"};
    for (size_t i = 0; i < sizeof bases / sizeof bases[0]; i++) {
        if (!bases[i]) continue;
        snprintf(fz_dir_path, sizeof fz_dir_path, "%s/cf_fuzz_XXXXXX", bases[i]);
        if (mkdtemp(fz_dir_path)) {
            atexit(fz_cleanup);
            return fz_dir_path;
        }
    }
    fprintf(stderr, "fuzz: cannot create a scratch directory: %s\n", strerror(errno));
    abort();
}

static void fz_file_init(fz_file *f, const char *name) {
    f->fd = memfd_create(name, MFD_CLOEXEC);
    if (f->fd >= 0) {
        snprintf(f->path, sizeof f->path, "/proc/self/fd/%d", f->fd);
        if (access(f->path, R_OK) == 0) return;
        close(f->fd);
    }
    snprintf(f->path, sizeof f->path, "%s/%s", fz_dir(), name);
    f->fd = open(f->path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (f->fd < 0) {
        fprintf(stderr, "fuzz: cannot create %s: %s\n", f->path, strerror(errno));
        abort();
    }
}

/* Makes the file hold exactly these bytes. */
static void fz_file_set(fz_file *f, const uint8_t *data, size_t n) {
    if (ftruncate(f->fd, 0) != 0) abort();
    size_t off = 0;
    while (off < n) {
        ssize_t w = pwrite(f->fd, data + off, n - off, (off_t)off);
        if (w <= 0) {
            if (w < 0 && errno == EINTR) continue;
            fprintf(stderr, "fuzz: cannot write %s: %s\n", f->path, strerror(errno));
            abort();
        }
        off += (size_t)w;
    }
}

/* Writes a whole file at path (not atomically: only the harness reads it). */
static void fz_write_path(const char *path, const uint8_t *data, size_t n) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) { fprintf(stderr, "fuzz: cannot create %s\n", path); abort(); }
    size_t off = 0;
    while (off < n) {
        ssize_t w = write(fd, data + off, n - off);
        if (w <= 0) { fprintf(stderr, "fuzz: cannot write %s\n", path); abort(); }
        off += (size_t)w;
    }
    close(fd);
}

/* ------------------------------------------------------------- the checks */

/* What the last call accepted, for the corpus checks of the regression test:
 * config loaded; single safetensors opened; index opened; token shard
 * opened; ref-loss shard opened (without a token shard). */
static int fz_ok_config, fz_ok_st, fz_ok_index, fz_ok_tokens, fz_ok_ref;

static char fz_why[1400];

/* The failure message must be one line without control bytes and must name
 * the file (`name`, or any path under it). */
static const char *fz_check_error(const char *what, const char *name) {
    const char *e = cf_last_error();
    if (!*e) {
        snprintf(fz_why, sizeof fz_why, "%s failed with an empty error message", what);
        return fz_why;
    }
    for (const char *p = e; *p; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f) {
            snprintf(fz_why, sizeof fz_why, "%s: error message has control byte 0x%02x: %.1200s", what,
                     (unsigned char)*p, e);
            return fz_why;
        }
    if (!strstr(e, name)) {
        snprintf(fz_why, sizeof fz_why, "%s: error message does not name the file %s: %.1200s", what, name, e);
        return fz_why;
    }
    return NULL;
}

#define FZ_FAIL(...) do { snprintf(fz_why, sizeof fz_why, __VA_ARGS__); return fz_why; } while (0)

/* --------------------------------------------------------------- config */

static int fz_config_equal(const cf_config *a, const cf_config *b) {
#define EQ(f) if (a->f != b->f) return 0
    EQ(model_type); EQ(vocab_size); EQ(hidden_size); EQ(intermediate_size); EQ(num_hidden_layers);
    EQ(num_attention_heads); EQ(num_key_value_heads); EQ(head_dim); EQ(max_position_embeddings);
    EQ(rms_norm_eps); EQ(rope_theta); EQ(tie_word_embeddings); EQ(qkv_bias); EQ(o_bias); EQ(qk_norm);
    EQ(rope_llama3); EQ(rope_factor); EQ(rope_low_freq_factor); EQ(rope_high_freq_factor);
    EQ(rope_original_max_pos); EQ(sliding_window); EQ(bos_token_id); EQ(eos_token_id); EQ(num_extra_eos);
    for (int i = 0; i < a->num_extra_eos; i++) EQ(extra_eos_ids[i]);
#undef EQ
    return 1;
}

/* config.json: cf_config_load; a config that loads must validate and must
 * read back unchanged after cf_config_save. */
FZ_API const char *fz_config(const uint8_t *data, size_t n) {
    static fz_file f;
    static char saved[1200];
    if (!f.path[0]) {
        fz_file_init(&f, "config.json");
        snprintf(saved, sizeof saved, "%s/saved_config.json", fz_dir());
    }
    fz_file_set(&f, data, n);
    cf_config c, back;
    fz_ok_config = 0;
    if (cf_config_load(&c, f.path) != 0) return fz_check_error("cf_config_load", f.path);
    fz_ok_config = 1;
    if (cf_config_validate(&c) != 0) FZ_FAIL("a loaded config does not validate: %s", cf_last_error());
    (void)cf_config_num_params(&c);
    if (cf_config_save(&c, saved) != 0) FZ_FAIL("a loaded config cannot be saved: %s", cf_last_error());
    if (cf_config_load(&back, saved) != 0) FZ_FAIL("a saved config does not load: %s", cf_last_error());
    if (!fz_config_equal(&c, &back)) FZ_FAIL("config changed in a save -> load round trip");
    return NULL;
}

/* ----------------------------------------------------------- safetensors */

/* Everything an open archive promises: sorted unique names that cf_st_find
 * finds, sizes that match the shapes, and data that reads in full. */
static const char *fz_check_archive(const cf_st_archive *a) {
    for (int i = 0; i < a->ntensors; i++) {
        const cf_st_tensor *t = &a->tensors[i];
        if (t->file < 0 || t->file >= a->nfiles) FZ_FAIL("tensor %d: file index %d out of range", i, t->file);
        if (i > 0 && strcmp(a->tensors[i - 1].name, t->name) >= 0) FZ_FAIL("tensor names not sorted/unique");
        if (cf_st_find(a, t->name) != i) FZ_FAIL("cf_st_find does not find tensor '%s'", t->name);
        if (t->ndim < 0 || t->ndim > CF_ST_MAX_DIMS) FZ_FAIL("tensor '%s': ndim %d", t->name, t->ndim);
        uint64_t numel = 1;
        for (int d = 0; d < t->ndim; d++) {
            if (t->shape[d] < 0) FZ_FAIL("tensor '%s': negative dimension", t->name);
            numel *= (uint64_t)t->shape[d];
        }
        size_t es = cf_dtype_size(t->dtype);
        if (es == 0 || t->end < t->begin || t->end - t->begin != numel * es)
            FZ_FAIL("tensor '%s': data_offsets do not match its shape", t->name);
        float *buf = malloc((size_t)(numel ? numel : 1) * sizeof(float));
        if (!buf) FZ_FAIL("out of memory");
        int rc = cf_st_read_f32(a, i, buf, (size_t)numel);
        int wrong = cf_st_read_f32(a, i, buf, (size_t)numel + 1);
        free(buf);
        if (rc != 0) FZ_FAIL("tensor '%s' opened but does not read: %s", t->name, cf_last_error());
        if (wrong == 0) FZ_FAIL("tensor '%s' read with a wrong element count", t->name);
    }
    if (cf_st_find(a, "no such tensor, surely\x01") != -1) FZ_FAIL("cf_st_find finds a missing tensor");
    return NULL;
}

/* Two small valid shards that a fuzzed index can point at. */
static void fz_make_shards(const char *dir) {
    static const float a[6] = {1, 2, 3, 4, 5, 6}, b[4] = {-1, 0.5f, 0, 7};
    cf_st_item s1[] = {{"model.a", a, 2, {2, 3}}, {"model.b", b, 1, {4}}};
    cf_st_item s2[] = {{"model.c", b, 2, {2, 2}}};
    char p[2048];
    snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", dir);
    if (cf_st_write(p, s1, 2, CF_DT_F32) != 0) { fprintf(stderr, "fuzz: %s\n", cf_last_error()); abort(); }
    snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", dir);
    if (cf_st_write(p, s2, 1, CF_DT_BF16) != 0) { fprintf(stderr, "fuzz: %s\n", cf_last_error()); abort(); }
}

/* The input as a single .safetensors file; and, when it starts like JSON,
 * as a model.safetensors.index.json beside two valid shards. */
FZ_API const char *fz_safetensors(const uint8_t *data, size_t n) {
    static fz_file f;
    static char shard_dir[1200], index_path[1400];
    if (!f.path[0]) {
        fz_file_init(&f, "model.safetensors");
        snprintf(shard_dir, sizeof shard_dir, "%s/sharded", fz_dir());
        if (mkdir(shard_dir, 0700) != 0 && errno != EEXIST) abort();
        fz_make_shards(shard_dir);
        snprintf(index_path, sizeof index_path, "%s/model.safetensors.index.json", shard_dir);
    }
    fz_file_set(&f, data, n);
    cf_st_archive a;
    const char *bad;
    fz_ok_st = fz_ok_index = 0;
    if (cf_st_open(&a, f.path) == 0) {
        fz_ok_st = 1;
        bad = fz_check_archive(&a);
        cf_st_close(&a);
    } else {
        bad = fz_check_error("cf_st_open", f.path);
    }
    if (bad || n == 0 || data[0] != '{') return bad;

    fz_write_path(index_path, data, n);
    if (cf_st_open(&a, shard_dir) == 0) {
        fz_ok_index = 1;
        bad = fz_check_archive(&a);
        cf_st_close(&a);
    } else {
        bad = fz_check_error("cf_st_open (index)", shard_dir);
    }
    unlink(index_path);
    return bad;
}

/* ---------------------------------------------------------------- shards */

/* The input as a token shard (vocab FZ_VOCAB) and as a reference-loss shard,
 * alone and against a token shard of matching count and hash. */
FZ_API const char *fz_shards(const uint8_t *data, size_t n) {
    static fz_file f;
    if (!f.path[0]) fz_file_init(&f, "shard.bin");
    fz_file_set(&f, data, n);
    const char *bad = NULL;
    fz_ok_tokens = fz_ok_ref = 0;

    cf_tokens t;
    if (cf_tokens_open(&t, f.path, FZ_VOCAB) == 0) {
        fz_ok_tokens = 1;
        uint32_t max_id = 0;
        for (int64_t i = 0; i < t.n; i++) {
            uint32_t id = cf_tokens_get(&t, i);
            if (id > max_id) max_id = id;
        }
        if (t.width != 2 && t.width != 4) bad = "token shard opened with a bad width";
        else if (t.n > 0 && (max_id != t.max_id || max_id >= FZ_VOCAB)) bad = "token shard: wrong max_id or id >= vocab";
        else if (t.hash != cf_fnv1a(CF_FNV_INIT, t.data, (size_t)t.n * (size_t)t.width)) bad = "token shard: wrong hash";
        else if ((size_t)t.n * (size_t)t.width + 1024 != n) bad = "token shard: count does not match the file size";
        cf_tokens_close(&t);
        /* The same shard without a vocabulary bound must open too. */
        if (!bad && cf_tokens_open(&t, f.path, 0) != 0) bad = "token shard opens with a vocab bound but not without";
        else if (!bad) cf_tokens_close(&t);
    } else {
        bad = fz_check_error("cf_tokens_open", f.path);
    }
    if (bad) return bad;

    /* A token shard that matches the header's count and hash, so the loss
     * checks behind the ownership test are reached as well. */
    cf_tokens owner = {0};
    owner.path = "owner-tokens.bin";
    if (n >= 20) {
        int32_t h[5];
        memcpy(h, data, sizeof h);
        owner.n = h[2];
        owner.hash = (uint64_t)(uint32_t)h[3] | ((uint64_t)(uint32_t)h[4] << 32);
    }
    for (int pass = 0; pass < 2 && !bad; pass++) {
        cf_refloss r;
        if (cf_refloss_open(&r, f.path, pass ? &owner : NULL) == 0) {
            if (!pass) fz_ok_ref = 1;
            for (int64_t i = 0; i < r.n && !bad; i++)
                if (!isfinite(r.loss[i]) || r.loss[i] < 0 || (i == 0 && r.loss[0] != 0))
                    bad = "ref-loss shard opened with a bad loss";
            if (!bad && (size_t)r.n * 4 + 1024 != n) bad = "ref-loss shard: count does not match the file size";
            cf_refloss_close(&r);
        } else {
            bad = fz_check_error("cf_refloss_open", f.path);
        }
    }
    return bad;
}

#endif /* CF_FUZZ_TARGETS_H */
