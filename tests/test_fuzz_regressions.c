/*
 * test_fuzz_regressions.c — replays saved inputs through the fuzz targets'
 * own code (tests/fuzz/fuzz_targets.h): every file in tests/fuzz/regressions/
 * (inputs that once broke a reader, plus hand-made hostile ones) and every
 * seed of tests/fuzz/corpus/ goes through all three readers — config.json,
 * safetensors (single file and index), token and ref-loss shards — and must
 * be handled: no crash (the ASan build, `make test-asan`, also catches
 * memory errors and leaks), a one-line error naming the file, or a result
 * that is self-consistent. The seed corpora double as the bad-input
 * catalogue of DESIGN §5: a seed named bad_* must be refused by its reader,
 * any other seed must be accepted.
 *
 * Run from the repository root (as `make test` does); CF_FUZZ_DIR overrides
 * the location of tests/fuzz.
 */
#include "test.h"
#include "fuzz/fuzz_targets.h"

#include <dirent.h>

static const char *fuzz_root(void) {
    const char *r = getenv("CF_FUZZ_DIR");
    return r && *r ? r : "tests/fuzz";
}

static int cmp_names(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Sorted names of the regular files in dir (README* and dot files skipped). */
static int list_files(const char *dir, char ***out) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    char **names = NULL;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.' || strncmp(e->d_name, "README", 6) == 0) continue;
        char path[4096];
        struct stat st;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (stat(path, &st) != 0 || !S_ISREG(st.st_mode)) continue;
        names = realloc(names, (size_t)(n + 1) * sizeof *names);
        names[n++] = strdup(e->d_name);
    }
    closedir(d);
    if (n) qsort(names, (size_t)n, sizeof *names, cmp_names);
    *out = names;
    return n;
}

static uint8_t *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 4096, len = 0;
    uint8_t *buf = malloc(cap);
    size_t r;
    while (buf && (r = fread(buf + len, 1, cap - len, f)) > 0) {
        len += r;
        if (len == cap) buf = realloc(buf, cap *= 2);
    }
    fclose(f);
    *n = len;
    return buf;
}

typedef enum { ANY = 0, CONFIG, SAFETENSORS, SHARDS } corpus_kind;

/* Replays every file of dir through all three targets; with a kind, also
 * checks that its own reader accepts valid seeds and refuses bad_* ones. */
static int replay_dir(const char *dir, corpus_kind kind) {
    char **names = NULL;
    int n = list_files(dir, &names);
    CHECK_MSG(n >= 0, "%s: cannot list the directory", dir);
    for (int i = 0; i < n; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        size_t len = 0;
        uint8_t *data = slurp(path, &len);
        CHECK_MSG(data != NULL, "%s: cannot read", path);
        if (data) {
            const char *bad;
            bad = fz_config(data, len);
            CHECK_MSG(bad == NULL, "%s (config reader): %s", path, bad);
            int ok_config = fz_ok_config;
            bad = fz_safetensors(data, len);
            CHECK_MSG(bad == NULL, "%s (safetensors reader): %s", path, bad);
            int ok_st = fz_ok_st, ok_index = fz_ok_index;
            bad = fz_shards(data, len);
            CHECK_MSG(bad == NULL, "%s (shard readers): %s", path, bad);
            int ok_tokens = fz_ok_tokens, ok_ref = fz_ok_ref;

            int want = strncmp(names[i], "bad_", 4) != 0 && strncmp(names[i], "index_bad_", 10) != 0;
            int got = -1;
            if (kind == CONFIG) got = ok_config;
            else if (kind == SAFETENSORS) got = strncmp(names[i], "index_", 6) == 0 ? ok_index : ok_st;
            else if (kind == SHARDS) got = strstr(names[i], "ref") ? ok_ref : ok_tokens;
            if (got >= 0)
                CHECK_MSG(got == want, "%s: the reader %s it, the seed's name says it is %s", path,
                          got ? "accepts" : "refuses", want ? "valid" : "bad");
            free(data);
        }
        free(names[i]);
    }
    free(names);
    return n;
}

TEST(every_regression_input_is_handled_by_all_three_readers) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/regressions", fuzz_root());
    int n = replay_dir(dir, ANY);
    CHECK_MSG(n > 0, "%s: no regression inputs found (run from the repository root)", dir);
    printf("    %d regression inputs\n", n);
}

static void corpus(const char *name, corpus_kind kind) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/corpus/%s", fuzz_root(), name);
    int n = replay_dir(dir, kind);
    CHECK_MSG(n > 0, "%s: empty seed corpus", dir);
    printf("    %d seeds in corpus/%s\n", n, name);
}

TEST(config_seeds_valid_load_and_bad_are_refused) { corpus("config", CONFIG); }
TEST(safetensors_seeds_valid_open_and_bad_are_refused) { corpus("safetensors", SAFETENSORS); }
TEST(shard_seeds_valid_open_and_bad_are_refused) { corpus("shards", SHARDS); }

int main(void) {
    RUN(every_regression_input_is_handled_by_all_three_readers);
    RUN(config_seeds_valid_load_and_bad_are_refused);
    RUN(safetensors_seeds_valid_open_and_bad_are_refused);
    RUN(shard_seeds_valid_open_and_bad_are_refused);
    return test_summary();
}
