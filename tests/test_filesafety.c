/* test_filesafety.c — issue 12: one way to read inputs and one way to create
 * outputs (src/base/common.c), checkpoint housekeeping (src/engine/
 * checkpoint.c), NUL characters in JSON, the memory estimate. */
#include "test.h"
#include "base/common.h"
#include "formats/io.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <time.h>
#include <unistd.h>

static char g_dir[64];

static const char *tmp_path(const char *name) {
    static char bufs[8][600];
    static int k;
    char *p = bufs[k++ % 8];
    snprintf(p, sizeof bufs[0], "%s/%s", g_dir, name);
    return p;
}

static int err_has(const char *s) { return strstr(cf_last_error(), s) != NULL; }

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    if (!f) { perror(path); exit(2); }
    fputs(text, f);
    fclose(f);
}

static int file_is(const char *path, const char *text) {
    size_t len = 0;
    char *s = cf_read_file(path, &len, 1 << 20);
    int ok = s && len == strlen(text) && memcmp(s, text, len) == 0;
    free(s);
    return ok;
}

static int count_temps(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) n += strstr(e->d_name, ".tmp.") != NULL;
    if (d) closedir(d);
    return n;
}

/* ------------------------------------------------------------- outputs */

TEST(atomic_temp_files_are_exclusive_unpredictable_and_honor_the_umask) {
    char p[600];
    snprintf(p, sizeof p, "%s", tmp_path("out.txt"));
    cf_atomic_file a, b;
    CHECK(cf_atomic_open(&a, p) == 0);
    CHECK(cf_atomic_open(&b, p) == 0);
    /* two writers of one target get two temp files, named by 64 random bits */
    CHECK(a.tmp && b.tmp && strcmp(a.tmp, b.tmp) != 0);
    const char *base = strrchr(a.tmp, '/') + 1;
    CHECK(cf_is_temp_name(base));
    CHECK(strncmp(base, "out.txt.tmp.", 12) == 0 && strlen(base) == 12 + 16);
    cf_atomic_abort(&b);
    CHECK(cf_atomic_write(&a, "new\n", 4) == 0);
    mode_t old = umask(077);
    cf_atomic_file c;
    CHECK(cf_atomic_open(&c, tmp_path("private.txt")) == 0);
    umask(old);
    CHECK(cf_atomic_write(&c, "x", 1) == 0 && cf_atomic_commit(&c) == 0);
    struct stat st;
    CHECK(stat(tmp_path("private.txt"), &st) == 0 && (st.st_mode & 0777) == 0600);
    CHECK(cf_atomic_commit(&a) == 0);
    CHECK(stat(p, &st) == 0 && (st.st_mode & 0777) == (0644 & ~old));
    CHECK(file_is(p, "new\n"));
    CHECK(count_temps(g_dir) == 0);
    CHECK(!cf_is_temp_name("notes.tmp.txt") && !cf_is_temp_name("x.tmp.123") && !cf_is_temp_name("x.tmp.0123456789ABCDEF"));
}

TEST(outputs_refuse_links_fifos_devices_and_directories_and_leave_them_alone) {
    write_text(tmp_path("victim.txt"), "precious\n");
    CHECK(symlink("victim.txt", tmp_path("link.txt")) == 0);
    CHECK(cf_write_file_atomic(tmp_path("link.txt"), "evil", 4) == -1 && err_has("symbolic link"));
    CHECK(file_is(tmp_path("victim.txt"), "precious\n"));
    struct stat st;
    CHECK(lstat(tmp_path("link.txt"), &st) == 0 && S_ISLNK(st.st_mode));
    CHECK(mkfifo(tmp_path("fifo"), 0644) == 0);
    CHECK(cf_write_file_atomic(tmp_path("fifo"), "x", 1) == -1 && err_has("FIFO"));
    CHECK(lstat(tmp_path("fifo"), &st) == 0 && S_ISFIFO(st.st_mode));
    CHECK(mkdir(tmp_path("adir"), 0755) == 0);
    CHECK(cf_write_file_atomic(tmp_path("adir"), "x", 1) == -1 && err_has("directory"));
    CHECK(cf_output_check(tmp_path("fifo")) == -1 && err_has("FIFO"));
    CHECK(cf_output_check(tmp_path("nodir/x.bin")) == -1 && err_has("nodir"));
    CHECK(cf_output_check(tmp_path("fresh.bin")) == 0);
    char longname[400];
    memset(longname, 'n', 300);
    longname[300] = 0;
    CHECK(cf_output_check(tmp_path(longname)) == -1 && err_has("longer than the file system allows"));
    CHECK(cf_output_dir_check(tmp_path("victim.txt"), 64) == -1 && err_has("not a directory"));
    CHECK(cf_output_dir_check(tmp_path("new/deeper"), 64) == 0);
    CHECK(!cf_path_exists(tmp_path("new")));   /* checked, not created */
    if (geteuid() == 0 && mknod(tmp_path("null"), S_IFCHR | 0666, makedev(1, 3)) == 0) {
        CHECK(cf_write_file_atomic(tmp_path("null"), "x", 1) == -1 && err_has("character device"));
        CHECK(lstat(tmp_path("null"), &st) == 0 && S_ISCHR(st.st_mode));
    }
    CHECK(count_temps(g_dir) == 0);
}

TEST(a_failed_write_removes_only_the_temp_file_never_the_target) {
    char p[600];
    snprintf(p, sizeof p, "%s", tmp_path("keep.txt"));
    write_text(p, "old\n");
    cf_atomic_file a;
    CHECK(cf_atomic_open(&a, p) == 0);
    CHECK(cf_atomic_write(&a, "half", 4) == 0);
    cf_atomic_abort(&a);
    CHECK(file_is(p, "old\n"));
    /* the target turned into a directory before the commit: refused, kept */
    const char *q = tmp_path("becomes_dir");
    CHECK(cf_atomic_open(&a, q) == 0);
    CHECK(mkdir(q, 0755) == 0);
    CHECK(cf_atomic_write(&a, "x", 1) == 0 && cf_atomic_commit(&a) == -1 && err_has("directory"));
    struct stat st;
    CHECK(stat(q, &st) == 0 && S_ISDIR(st.st_mode));
    CHECK(count_temps(g_dir) == 0);
}

/* -------------------------------------------------------------- inputs */

TEST(an_output_can_never_be_an_open_input_by_any_name) {
    char p[600], hard[600];
    snprintf(p, sizeof p, "%s", tmp_path("tok.bin"));
    snprintf(hard, sizeof hard, "%s", tmp_path("tok_hardlink.bin"));
    uint32_t tok[5] = {1, 2, 3, 4, 5};
    CHECK(cf_tokens_write(p, tok, 5, 2) == 0);
    CHECK(link(p, hard) == 0);
    cf_tokens t;
    CHECK(cf_tokens_open(&t, p, 0) == 0);
    CHECK(cf_tokens_write(p, tok, 3, 2) == -1 && err_has("input"));
    CHECK(cf_refloss_write(hard, (float[]){0, 1, 1, 1, 1}, 5, t.hash) == -1 && err_has("same file as the input"));
    CHECK(cf_output_check(hard) == -1);
    CHECK(cf_input_same_file(hard) != NULL);
    FILE *f = cf_output_stream(p, 1);
    CHECK(f == NULL && err_has("input"));
    cf_tokens_close(&t);
    /* outside a run, a closed input is no longer protected (libraries
     * rewrite files they read earlier) */
    CHECK(cf_tokens_write(p, tok, 4, 2) == 0);
    /* in a run, every input stays protected until the run ends */
    cf_inputs_begin_run();
    CHECK(cf_tokens_open(&t, p, 0) == 0);
    cf_tokens_close(&t);
    CHECK(cf_tokens_write(p, tok, 3, 2) == -1 && err_has("input"));
    CHECK(cf_input_register(tmp_path("registered.txt")) == 0);   /* missing: nothing to protect */
    cf_inputs_end_run();
    CHECK(cf_tokens_write(p, tok, 3, 2) == 0);
}

/* A deleted input (a rotated-out checkpoint's config.json) protects nothing:
 * a new file that gets its inode number is not that input. The file system
 * decides about reuse, so the test makes new files until one reuses it. */
TEST(a_deleted_input_does_not_protect_a_new_file_that_reuses_its_inode) {
    cf_inputs_begin_run();
    char in[600], out[600];
    snprintf(in, sizeof in, "%s", tmp_path("old_input.txt"));
    FILE *f = fopen(in, "w");
    CHECK(f && fputs("x", f) >= 0 && fclose(f) == 0);
    struct stat st;
    CHECK(stat(in, &st) == 0);
    CHECK(cf_input_register(in) == 0);
    CHECK(cf_input_same_file(in) != NULL);   /* protected while it exists */
    CHECK(unlink(in) == 0);
    int reused = 0;
    for (int i = 0; i < 200 && !reused; i++) {
        snprintf(out, sizeof out, "%s", tmp_path(i % 2 ? "new_a.txt" : "new_b.txt"));
        FILE *g = fopen(out, "w");
        if (!g) break;
        fclose(g);
        struct stat ns;
        if (stat(out, &ns) == 0 && ns.st_ino == st.st_ino && ns.st_dev == st.st_dev) reused = 1;
        else unlink(out);
    }
    if (reused) {
        CHECK(cf_input_same_file(out) == NULL);
        CHECK(cf_output_check(out) == 0);
        unlink(out);
    } else {
        printf("    (this file system did not reuse the inode in 200 tries: nothing to check)\n");
    }
    cf_inputs_end_run();
}

TEST(inputs_that_are_fifos_or_directories_fail_at_once_without_blocking) {
    CHECK(mkfifo(tmp_path("in_fifo"), 0644) == 0 || errno == EEXIST);
    double t0 = cf_now();
    cf_tokens t;
    CHECK(cf_tokens_open(&t, tmp_path("in_fifo"), 0) == -1 && err_has("is a FIFO, not a regular file"));
    CHECK(cf_read_file(tmp_path("in_fifo"), NULL, 100) == NULL && err_has("FIFO"));
    cf_config c;
    CHECK(cf_config_load(&c, tmp_path("in_fifo")) == -1 && err_has("FIFO"));
    CHECK(cf_open_input(g_dir, NULL) == -1 && err_has("is a directory"));
    CHECK(cf_now() - t0 < 5.0);
}

/* --------------------------------------------------------------- locks */

TEST(a_locked_directory_refuses_a_second_lock_at_once_naming_the_holder) {
    int created = 0;
    int fd = cf_dir_lock(tmp_path("run"), &created);
    CHECK(fd >= 0 && created == 1);
    int created2 = 0;
    CHECK(cf_dir_lock(tmp_path("run"), &created2) == -1 && err_has("in use by another run") && err_has("pid"));
    close(fd);
    fd = cf_dir_lock(tmp_path("run"), &created2);
    CHECK(fd >= 0 && created2 == 0);
    close(fd);
    write_text(tmp_path("run/a_file"), "x");
    CHECK(cf_remove_created_dir(tmp_path("run")) == 0 && !cf_path_exists(tmp_path("run")));
}

/* ------------------------------------------------------------ manifest */

TEST(a_run_manifest_round_trips_any_string) {
    cf_manifest m = {0}, r;
    cf_manifest_set(&m, "model", "config:/p/with \"quotes\" and \\ and \t tab");
    cf_manifest_set(&m, "batch", "%d", 8);
    cf_manifest_set(&m, "batch", "%d", 16);   /* replaces */
    CHECK(cf_manifest_write(tmp_path("run.json"), &m) == 0);
    CHECK(cf_manifest_read(tmp_path("run.json"), &r) == 0);
    CHECK(r.n == 2 && strcmp(cf_manifest_get(&r, "batch"), "16") == 0);
    CHECK(strcmp(cf_manifest_get(&r, "model"), cf_manifest_get(&m, "model")) == 0);
    CHECK(cf_manifest_get(&r, "seq") == NULL);
    CHECK(cf_manifest_read(tmp_path("no_such.json"), &r) == 1);
}

/* ---------------------------------------------------------------- JSON */

TEST(nul_characters_inside_json_strings_are_refused) {
    const char ok[] = "{\"a\\\\u0000\": \"x\\\"\"}";   /* an escaped backslash, then u0000: no NUL */
    CHECK(cf_json_check_nul("f", "header", ok, strlen(ok)) == 0);
    const char esc[] = "{\"name\\u0000x\": 1}";
    CHECK(cf_json_check_nul("f", "header", esc, strlen(esc)) == -1 && err_has("\\u0000") && err_has("f:"));
    const char raw[] = {'{', '"', 'a', 0, 'b', '"', ':', '1', '}'};
    CHECK(cf_json_check_nul("f", "header", raw, sizeof raw) == -1 && err_has("NUL byte"));
    const char outside[] = {'{', 0, '"', 'a', '"', ':', '1', '}'};   /* between tokens: cJSON's whitespace */
    CHECK(cf_json_check_nul("f", "header", outside, sizeof outside) == 0);

    /* config.json: a model_type "llama\u0000x" would read as "llama" */
    const char *cfgp = tmp_path("nul_config.json");
    write_text(cfgp, "{\"model_type\": \"llama\\u0000x\", \"vocab_size\": 64, \"hidden_size\": 16, "
                     "\"intermediate_size\": 32, \"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
                     "\"num_key_value_heads\": 2, \"max_position_embeddings\": 64, \"rms_norm_eps\": 1e-5}");
    cf_config c;
    CHECK(cf_config_load(&c, cfgp) == -1 && err_has("NUL") && err_has("nul_config.json"));

    /* safetensors: tensor names "a\u0000x" and "a" would both load as "a" */
    const char hdr[] = "{\"a\\u0000x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}";
    unsigned char buf[256];
    uint64_t n = sizeof hdr - 1;
    for (int i = 0; i < 8; i++) buf[i] = (unsigned char)(n >> (8 * i));
    memcpy(buf + 8, hdr, n);
    memset(buf + 8 + n, 0, 4);
    FILE *f = fopen(tmp_path("nul.safetensors"), "wb");
    fwrite(buf, 1, 8 + n + 4, f);
    fclose(f);
    cf_st_archive a;
    CHECK(cf_st_open(&a, tmp_path("nul.safetensors")) == -1 && err_has("NUL"));

    char b[32];
    CHECK(strcmp(cf_json_num(b, sizeof b, "%.6f", NAN), "null") == 0);
    CHECK(strcmp(cf_json_num(b, sizeof b, "%.6f", -INFINITY), "null") == 0);
    CHECK(strcmp(cf_json_num(b, sizeof b, "%.1f", 2.25), "2.2") == 0 || strcmp(b, "2.3") == 0);
}

/* ---------------------------------------------------------- safetensors */

TEST(resharding_in_place_never_overwrites_the_files_the_index_names) {
    char d[600];
    snprintf(d, sizeof d, "%s", tmp_path("inplace"));
    float w[64];
    for (int i = 0; i < 64; i++) w[i] = (float)i;
    cf_st_item items[3] = {{"a", w, 1, {16}}, {"b", w + 16, 1, {16}}, {"c", w + 32, 1, {32}}};
    CHECK(cf_st_write_dir(d, items, 3, CF_DT_F32, 160) == 0);   /* 2 shards, HF names */
    struct stat s1;
    CHECK(stat(tmp_path("inplace/model-00001-of-00002.safetensors"), &s1) == 0);
    /* the same layout again, but the index cannot be written: the save
     * fails, and the old layout is untouched and loads */
    CHECK(mkdir(tmp_path("inplace/model.safetensors.index.json.d"), 0755) == 0);
    char idx[600];
    snprintf(idx, sizeof idx, "%s", tmp_path("inplace/model.safetensors.index.json"));
    CHECK(rename(idx, tmp_path("inplace/saved_index")) == 0);
    CHECK(rename(tmp_path("inplace/model.safetensors.index.json.d"), idx) == 0);   /* a directory now */
    CHECK(cf_st_write_dir(d, items, 3, CF_DT_F32, 160) == -1);
    CHECK(rmdir(idx) == 0 && rename(tmp_path("inplace/saved_index"), idx) == 0);
    struct stat s2;
    CHECK(stat(tmp_path("inplace/model-00001-of-00002.safetensors"), &s2) == 0 && s2.st_ino == s1.st_ino);
    cf_st_archive a;
    CHECK(cf_st_open(&a, d) == 0 && a.ntensors == 3);
    cf_st_close(&a);
    CHECK(count_temps(d) == 0);
    /* a successful re-save with as many shards: a new layout, loadable */
    CHECK(cf_st_write_dir(d, items, 3, CF_DT_BF16, 80) == 0);
    CHECK(!cf_path_exists(tmp_path("inplace/model-00001-of-00002.safetensors")));   /* named by its save */
    CHECK(cf_st_open(&a, d) == 0 && a.ntensors == 3);
    cf_st_close(&a);
}

/* ---------------------------------------------------------- checkpoints */

static cf_model *tiny_model(void) {
    cf_config c;
    if (cf_config_builtin(&c, "tiny-llama") != 0) return NULL;
    return cf_model_create(&c, CF_BACKEND_CPU, 7);
}

static int latest_is(const char *dir, const char *want) {
    char p[700], line[64];
    snprintf(p, sizeof p, "%s/latest", dir);
    snprintf(line, sizeof line, "%s\n", want);
    return file_is(p, line);
}

TEST(checkpoint_housekeeping_touches_only_this_runs_checkpoints) {
    char d[600];
    snprintf(d, sizeof d, "%s", tmp_path("ck"));
    cf_model *m = tiny_model();
    CHECK(m != NULL);
    if (!m) return;
    /* the user's files and another run's checkpoint share the directory */
    CHECK(cf_mkdir_p(tmp_path("ck/step_00000001")) == 0);
    write_text(tmp_path("ck/step_00000001/mine.txt"), "user");
    write_text(tmp_path("ck/notes.tmp.txt"), "user");
    write_text(tmp_path("ck/step_00000002.txt"), "user");
    for (int s = 2; s <= 6; s++) CHECK(cf_checkpoint_save(m, d, s, 10 * s, 2) == 0);
    CHECK(latest_is(d, "step_00000006"));
    CHECK(file_is(tmp_path("ck/step_00000001/mine.txt"), "user"));
    CHECK(file_is(tmp_path("ck/notes.tmp.txt"), "user") && file_is(tmp_path("ck/step_00000002.txt"), "user"));
    CHECK(!cf_path_exists(tmp_path("ck/step_00000004")) && cf_path_exists(tmp_path("ck/step_00000005")));
    CHECK(cf_path_exists(tmp_path("ck/run.json")));
    CHECK(cf_path_exists(tmp_path("ck/step_00000006/centrifuge_checkpoint.json")));
    /* `latest` never moves backwards */
    CHECK(cf_checkpoint_save(m, d, 3, 30, 2) == -1 && err_has("not moving it back"));
    CHECK(latest_is(d, "step_00000006"));
    /* a step directory of another run is never written into */
    CHECK(cf_mkdir_p(tmp_path("other")) == 0 && cf_mkdir_p(tmp_path("other/step_00000009")) == 0);
    write_text(tmp_path("other/step_00000009/model.safetensors"), "not ours");
    CHECK(cf_checkpoint_save(m, tmp_path("other"), 9, 0, 2) == -1 && err_has("another run"));
    CHECK(file_is(tmp_path("other/step_00000009/model.safetensors"), "not ours"));
    /* starting a run over removes the run's own files only */
    CHECK(cf_remove_run_dir(d) == 0);
    CHECK(!cf_path_exists(tmp_path("ck/latest")) && !cf_path_exists(tmp_path("ck/run.json")) &&
          !cf_path_exists(tmp_path("ck/step_00000006")) && !cf_path_exists(tmp_path("ck/step_00000005")));
    CHECK(file_is(tmp_path("ck/step_00000001/mine.txt"), "user") && file_is(tmp_path("ck/notes.tmp.txt"), "user"));
    CHECK(cf_checkpoint_save(m, tmp_path("alone"), 1, 0, 2) == 0);
    CHECK(cf_remove_run_dir(tmp_path("alone")) == 0 && !cf_path_exists(tmp_path("alone")));
    CHECK(cf_remove_run_dir(tmp_path("never_was")) == 0);
    cf_model_free(m);
}

/* A rotation killed half-way through removing a checkpoint: with its marker
 * still there (removed last) the next rotation finishes the job; killed
 * after the marker, an empty directory is left, which rotation removes; a
 * markerless directory holding files is never touched. */
TEST(rotation_finishes_a_removal_that_was_killed_half_way) {
    char d[600];
    snprintf(d, sizeof d, "%s", tmp_path("ck_kill"));
    cf_model *m = tiny_model();
    CHECK(m != NULL);
    if (!m) return;
    for (int s = 1; s <= 3; s++) CHECK(cf_checkpoint_save(m, d, s, 0, 3) == 0);
    /* step 1 half removed: its state.bin gone, the marker still there */
    CHECK(unlink(tmp_path("ck_kill/step_00000001/state.bin")) == 0);
    CHECK(cf_path_exists(tmp_path("ck_kill/step_00000001/centrifuge_checkpoint.json")));
    /* step 2 killed after its marker: nothing left in it */
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "rm -f %s/*", tmp_path("ck_kill/step_00000002"));
    CHECK(system(cmd) == 0);
    /* a markerless directory of someone else's, with a file */
    CHECK(cf_mkdir_p(tmp_path("ck_kill/step_00000000")) == 0);
    write_text(tmp_path("ck_kill/step_00000000/mine.txt"), "user");
    CHECK(cf_checkpoint_save(m, d, 4, 0, 2) == 0);
    CHECK(!cf_path_exists(tmp_path("ck_kill/step_00000001")));
    CHECK(!cf_path_exists(tmp_path("ck_kill/step_00000002")));
    CHECK(cf_path_exists(tmp_path("ck_kill/step_00000003/state.bin")) && latest_is(d, "step_00000004"));
    CHECK(file_is(tmp_path("ck_kill/step_00000000/mine.txt"), "user"));
    cf_model_free(m);
}

TEST(non_finite_weights_never_become_a_checkpoint_and_non_finite_state_is_refused) {
    char d[600];
    snprintf(d, sizeof d, "%s", tmp_path("nan_ck"));
    cf_model *m = tiny_model();
    CHECK(m != NULL);
    if (!m) return;
    CHECK(cf_checkpoint_save(m, d, 1, 0, 1) == 0);
    int i = cf_model_num_tensors(m) - 1;
    size_t n = cf_model_tensor_numel(m, i);
    float *w = calloc(n, sizeof *w);
    CHECK(cf_model_get_param(m, i, w) == 0);
    w[n / 2] = NAN;
    CHECK(cf_model_set_param(m, i, w) == 0);
    CHECK(cf_checkpoint_save(m, d, 2, 0, 1) == -1 && err_has("checkpoint refused") && err_has("is nan") &&
          err_has(cf_model_tensor_name(m, i)));
    CHECK(latest_is(d, "step_00000001") && cf_path_exists(tmp_path("nan_ck/step_00000001/state.bin")));
    CHECK(!cf_path_exists(tmp_path("nan_ck/step_00000002")));
    free(w);
    cf_model_free(m);
    /* a state.bin whose Adam v holds a NaN: refused on resume */
    cf_model_opts o = {0};
    int64_t step = 0, pos = 0;
    cf_model *r = cf_checkpoint_load(d, &o, &step, &pos);
    CHECK(r != NULL && step == 1);
    cf_model_free(r);
    int fd = open(tmp_path("nan_ck/step_00000001/state.bin"), O_WRONLY);
    float nanv = NAN;
    struct stat st;
    CHECK(fd >= 0 && fstat(fd, &st) == 0 && pwrite(fd, &nanv, 4, st.st_size - 8) == 4);
    close(fd);
    r = cf_checkpoint_load(d, &o, &step, &pos);
    CHECK(r == NULL && err_has("AdamW v") && err_has("is nan") && err_has("damaged"));
    cf_model_free(r);
}

/* ------------------------------------------------------ memory estimate */

TEST(the_memory_estimate_counts_weights_state_and_activations) {
    cf_config c;
    CHECK(cf_config_builtin(&c, "llama3.1-8b") == 0);
    cf_memory_opts o = {0};
    o.batch = 1;
    o.seq = 1024;
    o.train = 1;
    o.world = 1;
    cf_memory_estimate cpu, gpu, frozen, compact, dp;
    CHECK(cf_memory_estimate_config(&c, CF_BACKEND_CPU, &o, &cpu) == 0);
    size_t n = cf_config_num_params(&c);
    CHECK(cpu.weights == 4 * (uint64_t)n && cpu.optimizer == 12 * (uint64_t)n);
    CHECK(cf_memory_estimate_config(&c, CF_BACKEND_CUDA, &o, &gpu) == 0);
    CHECK(gpu.weights == 2 * (uint64_t)n && gpu.optimizer == 16 * (uint64_t)n);
    o.freeze = "embed_tokens,lm_head";
    CHECK(cf_memory_estimate_config(&c, CF_BACKEND_CUDA, &o, &frozen) == 0);
    uint64_t emb = (uint64_t)c.vocab_size * (uint64_t)c.hidden_size;
    CHECK(frozen.optimizer == 16 * ((uint64_t)n - 2 * emb));
    o.freeze = NULL;
    o.compact = 1;
    o.keep = 0.5;
    CHECK(cf_memory_estimate_config(&c, CF_BACKEND_CUDA, &o, &compact) == 0);
    CHECK(compact.activations > gpu.activations && compact.activations < 2 * gpu.activations);
    o.compact = 0;
    o.world = 8;
    CHECK(cf_memory_estimate_config(&c, CF_BACKEND_CUDA, &o, &dp) == 0);
    CHECK(dp.optimizer == 4 * (uint64_t)n + 12 * (uint64_t)n / 8);
    /* activations grow with B x S; totals add up */
    o.world = 1;
    o.seq = 2048;
    cf_memory_estimate longer;
    CHECK(cf_memory_estimate_config(&c, CF_BACKEND_CUDA, &o, &longer) == 0);
    CHECK(longer.activations == 2 * gpu.activations);
    CHECK(gpu.total == gpu.weights + gpu.optimizer + gpu.activations + gpu.other);
    /* the LM head's chunk (lmhead.cu: lm_chunk): bf16 logits, bf16 dlogits
     * and an fp32 target logit per row, T = 1024 rows of them here; fp32
     * logits (CF_LMHEAD_LOGITS=fp32) two bytes more per logit, no target */
    const uint64_t V = (uint64_t)c.vocab_size;
    CHECK(gpu.other == 1024 * V * 4 + 1024 * 4);
    cf_memory_estimate f32;
    o.seq = 1024;
    setenv("CF_LMHEAD_LOGITS", "fp32", 1);
    CHECK(cf_memory_estimate_config(&c, CF_BACKEND_CUDA, &o, &f32) == 0);
    unsetenv("CF_LMHEAD_LOGITS");
    CHECK(f32.other == 1024 * V * 6 && f32.activations == gpu.activations);
    CHECK(longer.other == 2048 * V * 4 + 2048 * 4);
    /* issue 17: the LM head's kept g, T V A, counted within its budget only */
    cf_memory_estimate nog, big, bignog;
    o.seq = 1024;
    setenv("CF_HEAD_SAVE", "0", 1);
    CHECK(cf_memory_estimate_config(&c, CF_BACKEND_CUDA, &o, &nog) == 0);
    o.seq = 8192;   /* T V A = 2 GiB: over the budget */
    CHECK(cf_memory_estimate_config(&c, CF_BACKEND_CUDA, &o, &bignog) == 0);
    unsetenv("CF_HEAD_SAVE");
    CHECK(cf_memory_estimate_config(&c, CF_BACKEND_CUDA, &o, &big) == 0);
    CHECK(gpu.activations - nog.activations == 1024 * (uint64_t)c.vocab_size * 2);
    CHECK(big.activations == bignog.activations);
    /* at T = 8192 the chunk is capped near 1.5 GiB: 3139 rows */
    CHECK(big.other == 3139 * V * 4 + 3139 * 4 && big.other <= ((uint64_t)3 << 29) + 3139 * 4);
    /* an 8B model with a long batch cannot fit a CI machine: one line */
    cf_model_opts mo = {0};
    mo.config = "llama3.1-8b";
    o.batch = 64;
    o.seq = 8192;
    cf_memory_estimate e;
    CHECK(cf_memory_check(&mo, &o, &e) == -1 && err_has("memory: this run needs about") && err_has("GiB") &&
          err_has("--batch"));
    CHECK(e.available > 0);
    setenv("CENTRIFUGE_NO_MEMORY_CHECK", "1", 1);
    CHECK(cf_memory_check(&mo, &o, NULL) == 0);
    unsetenv("CENTRIFUGE_NO_MEMORY_CHECK");
    mo.config = "tiny";
    o.batch = 2;
    o.seq = 32;
    CHECK(cf_memory_check(&mo, &o, NULL) == 0);
}

static int rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb; (void)flag; (void)ftw;
    return remove(p);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/cf_test_filesafety_XXXXXX");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }
    RUN(atomic_temp_files_are_exclusive_unpredictable_and_honor_the_umask);
    RUN(outputs_refuse_links_fifos_devices_and_directories_and_leave_them_alone);
    RUN(a_failed_write_removes_only_the_temp_file_never_the_target);
    RUN(an_output_can_never_be_an_open_input_by_any_name);
    RUN(a_deleted_input_does_not_protect_a_new_file_that_reuses_its_inode);
    RUN(inputs_that_are_fifos_or_directories_fail_at_once_without_blocking);
    RUN(a_locked_directory_refuses_a_second_lock_at_once_naming_the_holder);
    RUN(a_run_manifest_round_trips_any_string);
    RUN(nul_characters_inside_json_strings_are_refused);
    RUN(resharding_in_place_never_overwrites_the_files_the_index_names);
    RUN(checkpoint_housekeeping_touches_only_this_runs_checkpoints);
    RUN(rotation_finishes_a_removal_that_was_killed_half_way);
    RUN(non_finite_weights_never_become_a_checkpoint_and_non_finite_state_is_refused);
    RUN(the_memory_estimate_counts_weights_state_and_activations);
    nftw(g_dir, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
    return test_summary();
}
