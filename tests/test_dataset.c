/* test_dataset.c — cf_dataset: several shards, sequential and shuffled
 * reading, ref shards following their token shards, resume by position,
 * data-parallel ranks. */
#include "test.h"
#include "base/common.h"
#include "centrifuge.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char g_dir[64];

static const char *tmp_path(const char *name) {
    static char bufs[8][600];
    static int k;
    char *p = bufs[k++ % 8];
    snprintf(p, sizeof bufs[0], "%s/%s", g_dir, name);
    return p;
}

/* A token shard whose token i is base + i (so every token says where it
 * came from) and its ref shard (loss of token i = i + base/1000, 0 at i=0). */
static void make_shard(const char *name, uint32_t base, int64_t n, int with_ref) {
    uint32_t *t = malloc((size_t)n * sizeof *t);
    for (int64_t i = 0; i < n; i++) t[i] = base + (uint32_t)i;
    char path[600];
    snprintf(path, sizeof path, "%s", tmp_path(name));
    if (cf_tokens_write(path, t, n, 4) != 0) { printf("write %s: %s\n", path, cf_last_error()); exit(2); }
    if (with_ref) {
        cf_tokens tok;
        if (cf_tokens_open(&tok, path, 0) != 0) exit(2);
        float *l = malloc((size_t)n * sizeof *l);
        for (int64_t i = 0; i < n; i++) l[i] = i ? (float)t[i] : 0.0f;
        char rp[620];
        snprintf(rp, sizeof rp, "%.*s.ref.bin", (int)(strlen(path) - 4), path);
        if (cf_refloss_write(rp, l, n, tok.hash) != 0) exit(2);
        cf_tokens_close(&tok);
        free(l);
    }
    free(t);
}

/* one shard read by cf_dataset (sequential) gives exactly what cf_loader gives */
TEST(sequential_one_shard_reads_what_the_loader_reads) {
    make_shard("one.bin", 0, 1000, 1);
    cf_tokens tok;
    cf_refloss ref;
    CHECK(cf_tokens_open(&tok, tmp_path("one.bin"), 0) == 0);
    CHECK(cf_refloss_open(&ref, tmp_path("one.ref.bin"), &tok) == 0);
    for (int world = 1; world <= 2; world++)
        for (int rank = 0; rank < world; rank++) {
            cf_loader ld;
            CHECK(cf_loader_init(&ld, &tok, &ref, 3, 16) == 0);
            CHECK(cf_loader_set_rank(&ld, rank, world) == 0);
            cf_dataset_opts o = {3, 16, 0, 0};
            cf_dataset *d = cf_dataset_open(tmp_path("one.bin"), "auto", 0, &o);
            CHECK(d != NULL);
            if (!d) return;
            CHECK(cf_dataset_set_rank(d, rank, world) == 0);
            int32_t a[3 * 17], b[3 * 17];
            float ra[3 * 16], rb[3 * 16];
            for (int step = 0; step < 50; step++) {
                cf_loader_next(&ld, a, ra);
                CHECK(cf_dataset_next(d, b, rb) == 0);
                CHECK(memcmp(a, b, sizeof a) == 0);
                CHECK(memcmp(ra, rb, sizeof ra) == 0);
                CHECK(ld.pos == cf_dataset_tell(d));
            }
            cf_dataset_free(d);
        }
    cf_refloss_close(&ref);
    cf_tokens_close(&tok);
}

/* a glob picks the token shards in order and skips their .ref.bin files;
 * sequential reading moves from shard to shard and wraps */
TEST(sequential_reads_shards_in_order_and_wraps) {
    make_shard("web_000000.bin", 100000, 200, 1);
    make_shard("web_000001.bin", 200000, 130, 1);
    make_shard("web_000002.bin", 300000, 10, 1);    /* too short for a batch: skipped */
    char spec[700];
    snprintf(spec, sizeof spec, "%s/web_*.bin", g_dir);
    cf_dataset_opts o = {2, 32, 0, 0};
    cf_dataset *d = cf_dataset_open(spec, "auto", 0, &o);
    CHECK(d != NULL);
    if (!d) { printf("    %s\n", cf_last_error()); return; }
    CHECK(cf_dataset_num_shards(d) == 3);
    CHECK(cf_dataset_num_tokens(d) == 340);
    CHECK(cf_dataset_has_ref(d));
    CHECK(strstr(cf_dataset_ref_path(d, 1), "web_000001.ref.bin") != NULL);
    int32_t t[2 * 33];
    float r[2 * 32];
    /* shard 0 holds 3 batches of 64 (+1), shard 1 holds 2, shard 2 none */
    uint32_t expect_base[] = {100000, 100064, 100128, 200000, 200064, 100000, 100064};
    for (int i = 0; i < 7; i++) {
        CHECK(cf_dataset_next(d, t, r) == 0);
        CHECK_MSG((uint32_t)t[0] == expect_base[i], "batch %d starts at %d, expected %u", i, t[0], expect_base[i]);
        CHECK((uint32_t)t[33] == expect_base[i] + 32);   /* row 1 starts where row 0 ended */
        CHECK(r[0] == (float)(expect_base[i] + 1));      /* ref of the first target */
    }
    CHECK(cf_dataset_epoch_tokens(d) == 5 * 64);
    uint32_t mx = cf_dataset_max_id(d, NULL);
    CHECK(mx == 300009);
    cf_dataset_free(d);
}

/* shuffled: every row of every shard exactly once per epoch, a different
 * order the next epoch, the same order from the same seed */
TEST(shuffled_epoch_visits_every_row_once) {
    make_shard("s_a.bin", 0, 16 * 37 + 1, 0);           /* 37 rows of 16 */
    make_shard("s_b.bin", 1000000, 16 * 20 + 5, 0);     /* 20 rows */
    char spec[1300];
    snprintf(spec, sizeof spec, "%s,%s", tmp_path("s_a.bin"), tmp_path("s_b.bin"));
    cf_dataset_opts o = {1, 16, 1, 42};
    cf_dataset *d = cf_dataset_open(spec, NULL, 0, &o);
    cf_dataset *d2 = cf_dataset_open(spec, NULL, 0, &o);
    CHECK(d && d2);
    if (!d || !d2) return;
    enum { R = 57 };
    CHECK(cf_dataset_epoch_tokens(d) == R * 16);
    int seen[R] = {0}, order0[R], same_as_sorted = 1, differ_next = 0;
    int32_t t[17], t2[17];
    for (int k = 0; k < R; k++) {
        CHECK(cf_dataset_next(d, t, NULL) == 0);
        CHECK(cf_dataset_next(d2, t2, NULL) == 0);
        CHECK(memcmp(t, t2, sizeof t) == 0);
        int row = t[0] >= 1000000 ? 37 + (t[0] - 1000000) / 16 : t[0] / 16;
        CHECK(t[0] % 16 == 0 && row >= 0 && row < R);
        CHECK(t[16] == t[0] + 16);   /* a whole row of consecutive tokens */
        if (row >= 0 && row < R) seen[row]++;
        order0[k] = row;
        if (row != k) same_as_sorted = 0;
    }
    for (int k = 0; k < R; k++) CHECK_MSG(seen[k] == 1, "row %d seen %d times", k, seen[k]);
    CHECK(!same_as_sorted);
    for (int k = 0; k < R; k++) {
        CHECK(cf_dataset_next(d, t, NULL) == 0);
        int row = t[0] >= 1000000 ? 37 + (t[0] - 1000000) / 16 : t[0] / 16;
        if (row != order0[k]) differ_next = 1;
    }
    CHECK(differ_next);
    /* another seed, another order */
    cf_dataset_opts o3 = {1, 16, 1, 43};
    cf_dataset *d3 = cf_dataset_open(spec, NULL, 0, &o3);
    int differ_seed = 0;
    for (int k = 0; k < R && d3; k++) {
        CHECK(cf_dataset_next(d3, t, NULL) == 0);
        int row = t[0] >= 1000000 ? 37 + (t[0] - 1000000) / 16 : t[0] / 16;
        if (row != order0[k]) differ_seed = 1;
    }
    CHECK(differ_seed);
    cf_dataset_free(d);
    cf_dataset_free(d2);
    cf_dataset_free(d3);
}

/* seek(tell()) resumes exactly, in both modes */
TEST(position_resumes_exactly) {
    char spec[700];
    snprintf(spec, sizeof spec, "%s/web_*.bin", g_dir);
    for (int shuffle = 0; shuffle <= 1; shuffle++) {
        cf_dataset_opts o = {2, 32, shuffle, 7};
        cf_dataset *a = cf_dataset_open(spec, "auto", 0, &o), *b = cf_dataset_open(spec, "auto", 0, &o);
        CHECK(a && b);
        if (!a || !b) return;
        int32_t ta[2 * 33], tb[2 * 33];
        float ra[64], rb[64];
        for (int i = 0; i < 13; i++) cf_dataset_next(a, ta, ra);
        CHECK(cf_dataset_seek(b, cf_dataset_tell(a)) == 0);
        for (int i = 0; i < 20; i++) {
            cf_dataset_next(a, ta, ra);
            cf_dataset_next(b, tb, rb);
            CHECK(memcmp(ta, tb, sizeof ta) == 0 && memcmp(ra, rb, sizeof ra) == 0);
        }
        cf_dataset_free(a);
        cf_dataset_free(b);
    }
}

/* with `world` ranks, rank r reads the r-th micro-batch of each group: the
 * union of one step is what one process reads in `world` micro-batches */
TEST(ranks_read_disjoint_micro_batches_of_one_stream) {
    char spec[700];
    snprintf(spec, sizeof spec, "%s/web_*.bin", g_dir);
    for (int shuffle = 0; shuffle <= 1; shuffle++) {
        cf_dataset_opts o = {1, 32, shuffle, 3};
        cf_dataset *one = cf_dataset_open(spec, NULL, 0, &o);
        cf_dataset *r0 = cf_dataset_open(spec, NULL, 0, &o), *r1 = cf_dataset_open(spec, NULL, 0, &o);
        CHECK(one && r0 && r1);
        if (!one || !r0 || !r1) return;
        CHECK(cf_dataset_set_rank(r0, 0, 2) == 0 && cf_dataset_set_rank(r1, 1, 2) == 0);
        int32_t a[33], b[33];
        for (int step = 0; step < 4; step++) {
            cf_dataset_next(one, a, NULL);
            cf_dataset_next(r0, b, NULL);
            CHECK(memcmp(a, b, sizeof a) == 0);
            cf_dataset_next(one, a, NULL);
            cf_dataset_next(r1, b, NULL);
            CHECK(memcmp(a, b, sizeof a) == 0);
        }
        cf_dataset_free(one);
        cf_dataset_free(r0);
        cf_dataset_free(r1);
    }
}

TEST(bad_lists_are_refused_with_a_reason) {
    cf_dataset_opts o = {2, 32, 0, 0};
    char spec[700];
    snprintf(spec, sizeof spec, "%s/nothing_*.bin", g_dir);
    CHECK(cf_dataset_open(spec, NULL, 0, &o) == NULL && strstr(cf_last_error(), "no file matches"));
    snprintf(spec, sizeof spec, "%s/missing.bin", g_dir);
    CHECK(cf_dataset_open(spec, NULL, 0, &o) == NULL && strstr(cf_last_error(), "no such file"));
    /* auto refs that are not there */
    CHECK(cf_dataset_open(tmp_path("s_a.bin"), "auto", 0, &o) == NULL && strstr(cf_last_error(), "centrifuge score"));
    /* a ref list of the wrong length */
    char toks[700], refs[700];
    snprintf(toks, sizeof toks, "%s/web_*.bin", g_dir);
    snprintf(refs, sizeof refs, "%s", tmp_path("web_000000.ref.bin"));
    CHECK(cf_dataset_open(toks, refs, 0, &o) == NULL && strstr(cf_last_error(), "one per token shard"));
    /* ref shards in the wrong order belong to other token shards */
    char two[1300], rtwo[1300];
    snprintf(two, sizeof two, "%s,%s", tmp_path("web_000000.bin"), tmp_path("web_000001.bin"));
    snprintf(rtwo, sizeof rtwo, "%s,%s", tmp_path("web_000001.ref.bin"), tmp_path("web_000000.ref.bin"));
    CHECK(cf_dataset_open(two, rtwo, 0, &o) == NULL && strstr(cf_last_error(), "does not belong"));
    /* in the right order they load */
    snprintf(rtwo, sizeof rtwo, "%s,%s", tmp_path("web_000000.ref.bin"), tmp_path("web_000001.ref.bin"));
    cf_dataset *d = cf_dataset_open(two, rtwo, 0, &o);
    CHECK(d != NULL);
    cf_dataset_free(d);
    /* ids beyond the vocabulary */
    CHECK(cf_dataset_open(two, NULL, 1000, &o) == NULL && strstr(cf_last_error(), "vocab_size"));
    /* a shard shorter than one row */
    make_shard("tiny.bin", 0, 8, 0);
    CHECK(cf_dataset_open(tmp_path("tiny.bin"), NULL, 0, &o) == NULL && strstr(cf_last_error(), "fewer than one batch"));
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/cf_test_dataset_XXXXXX");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }
    RUN(sequential_one_shard_reads_what_the_loader_reads);
    RUN(sequential_reads_shards_in_order_and_wraps);
    RUN(shuffled_epoch_visits_every_row_once);
    RUN(position_resumes_exactly);
    RUN(ranks_read_disjoint_micro_batches_of_one_stream);
    RUN(bad_lists_are_refused_with_a_reason);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    if (system(cmd) != 0) return 2;
    return test_summary();
}
