/* test_shards.c — token shards (llm.c format) and reference-loss shards. */
#include "test.h"
#include "base/common.h"
#include "formats/io.h"

#include <dirent.h>
#include <ftw.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_dir[64];

static const char *tmp_path(const char *name) {
    static char bufs[4][600];
    static int k;
    char *p = bufs[k++ % 4];
    snprintf(p, sizeof bufs[0], "%s/%s", g_dir, name);
    return p;
}

static int err_has(const char *s) { return strstr(cf_last_error(), s) != NULL; }

static void write_bytes(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) { perror(path); exit(2); }
    if (n) fwrite(data, 1, n, f);
    fclose(f);
}

static long file_size(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 ? (long)st.st_size : -1;
}

/* A raw shard: 256-int header with the given fields, then payload. */
static void craft(const char *path, int32_t magic, int32_t version, int32_t count, const void *payload, size_t n) {
    int32_t hdr[256] = {0};
    hdr[0] = magic;
    hdr[1] = version;
    hdr[2] = count;
    unsigned char *buf = malloc(sizeof hdr + n + 1);
    memcpy(buf, hdr, sizeof hdr);
    if (n) memcpy(buf + sizeof hdr, payload, n);
    write_bytes(path, buf, sizeof hdr + n);
    free(buf);
}

static int count_temp_files(void) {
    DIR *d = opendir(g_dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) if (strstr(e->d_name, ".tmp.")) n++;
    if (d) closedir(d);
    return n;
}

#define CHECK_TOKENS_FAIL(file_, vocab, ...) do { \
    cf_tokens t_; \
    int rc_ = cf_tokens_open(&t_, file_, vocab); \
    CHECK(rc_ == -1); \
    if (rc_ == 0) cf_tokens_close(&t_); \
    CHECK_MSG(err_has(file_), "message does not name %s: %s", file_, cf_last_error()); \
    const char *frags_[] = {__VA_ARGS__}; \
    for (size_t k_ = 0; k_ < sizeof frags_ / sizeof frags_[0]; k_++) \
        CHECK_MSG(err_has(frags_[k_]), "message lacks '%s': %s", frags_[k_], cf_last_error()); \
    CHECK(t_.map == NULL && t_.path == NULL); \
} while (0)

#define CHECK_REF_FAIL(file_, tokens, ...) do { \
    cf_refloss r_; \
    int rc_ = cf_refloss_open(&r_, file_, tokens); \
    CHECK(rc_ == -1); \
    if (rc_ == 0) cf_refloss_close(&r_); \
    CHECK_MSG(err_has(file_), "message does not name %s: %s", file_, cf_last_error()); \
    const char *frags_[] = {__VA_ARGS__}; \
    for (size_t k_ = 0; k_ < sizeof frags_ / sizeof frags_[0]; k_++) \
        CHECK_MSG(err_has(frags_[k_]), "message lacks '%s': %s", frags_[k_], cf_last_error()); \
    CHECK(r_.loss == NULL && r_.path == NULL); \
} while (0)

/* ----------------------------------------------------------- token shards */

TEST(tokens_u16_round_trip_and_llm_c_header) {
    uint32_t tok[5] = {0, 1, 65535, 257, 42};
    const char *p = tmp_path("u16.bin");
    CHECK(cf_tokens_write(p, tok, 5, 2) == 0);
    CHECK(file_size(p) == 1024 + 5 * 2);
    /* the header is exactly llm.c's: magic, version 1, count */
    FILE *f = fopen(p, "rb");
    int32_t hdr[256];
    CHECK(f && fread(hdr, 4, 256, f) == 256);
    uint16_t raw[5];
    CHECK(f && fread(raw, 2, 5, f) == 5);
    if (f) fclose(f);
    CHECK(hdr[0] == 20240520 && hdr[1] == 1 && hdr[2] == 5);
    CHECK(raw[2] == 65535 && raw[4] == 42);

    cf_tokens t;
    CHECK(cf_tokens_open(&t, p, 0) == 0);
    CHECK(t.n == 5 && t.width == 2 && t.max_id == 65535);
    for (int i = 0; i < 5; i++) CHECK(cf_tokens_get(&t, i) == tok[i]);
    CHECK(strcmp(t.path, p) == 0);
    cf_tokens_close(&t);
    CHECK(t.map == NULL && t.path == NULL && t.n == 0);
}

TEST(tokens_u32_round_trip_for_vocab_over_65535) {
    uint32_t tok[4] = {151935, 3, 70000, 0};
    const char *p = tmp_path("u32.bin");
    CHECK(cf_tokens_write(p, tok, 4, 0) == 0);   /* width 0 picks uint32 */
    CHECK(file_size(p) == 1024 + 4 * 4);
    cf_tokens t;
    CHECK(cf_tokens_open(&t, p, 151936) == 0);
    CHECK(t.width == 4 && t.n == 4 && t.max_id == 151935);
    for (int i = 0; i < 4; i++) CHECK(cf_tokens_get(&t, i) == tok[i]);
    cf_tokens_close(&t);
}

TEST(tokens_width_0_picks_u16_when_every_id_fits) {
    uint32_t tok[3] = {65535, 0, 7};
    const char *p = tmp_path("auto16.bin");
    CHECK(cf_tokens_write(p, tok, 3, 0) == 0);
    CHECK(file_size(p) == 1024 + 3 * 2);
    cf_tokens t;
    CHECK(cf_tokens_open(&t, p, 0) == 0 && t.width == 2);
    cf_tokens_close(&t);
}

TEST(tokens_hash_is_fnv1a_of_the_stored_payload) {
    uint32_t tok[6] = {5, 4, 3, 2, 1, 0};
    uint16_t as16[6] = {5, 4, 3, 2, 1, 0};
    const char *p = tmp_path("hash.bin");
    CHECK(cf_tokens_write(p, tok, 6, 2) == 0);
    cf_tokens t;
    CHECK(cf_tokens_open(&t, p, 0) == 0);
    CHECK(t.hash == cf_fnv1a(CF_FNV_INIT, as16, sizeof as16));
    uint64_t h16 = t.hash;
    cf_tokens_close(&t);
    /* a one-token change changes the hash */
    tok[3] = 9;
    CHECK(cf_tokens_write(p, tok, 6, 2) == 0);
    CHECK(cf_tokens_open(&t, p, 0) == 0 && t.hash != h16);
    cf_tokens_close(&t);
}

TEST(tokens_large_shard_round_trips_across_write_chunks) {
    int64_t n = 200001;
    uint32_t *tok = malloc((size_t)n * sizeof *tok);
    for (int64_t i = 0; i < n; i++) tok[i] = (uint32_t)((i * 2654435761u) % 50257u);
    const char *p = tmp_path("large.bin");
    CHECK(cf_tokens_write(p, tok, n, 0) == 0);
    cf_tokens t;
    CHECK(cf_tokens_open(&t, p, 50257) == 0);
    int bad = 0;
    for (int64_t i = 0; i < n; i++) bad += cf_tokens_get(&t, i) != tok[i];
    CHECK(t.n == n && bad == 0);
    cf_tokens_close(&t);
    free(tok);
}

TEST(tokens_empty_shard_is_valid) {
    const char *p = tmp_path("empty.bin");
    CHECK(cf_tokens_write(p, NULL, 0, 2) == 0);
    cf_tokens t;
    CHECK(cf_tokens_open(&t, p, 100) == 0 && t.n == 0 && t.max_id == 0);
    cf_tokens_close(&t);
}

TEST(tokens_rejects_id_at_or_above_vocab) {
    uint32_t tok[6] = {1, 2, 3, 100, 4, 250};
    const char *p = tmp_path("vocab.bin");
    CHECK(cf_tokens_write(p, tok, 6, 2) == 0);
    /* names the first offending position and its id */
    CHECK_TOKENS_FAIL(p, 100, "token id 100 at position 3", ">= vocab_size 100");
    cf_tokens t;
    CHECK(cf_tokens_open(&t, p, 101) == -1 && err_has("token id 250 at position 5"));
    CHECK(cf_tokens_open(&t, p, 251) == 0);   /* just above the max: fine */
    cf_tokens_close(&t);
    CHECK(cf_tokens_open(&t, p, 0) == 0);     /* 0 = no vocab check */
    cf_tokens_close(&t);
}

TEST(tokens_rejects_bad_magic) {
    uint16_t d[2] = {1, 2};
    const char *p = tmp_path("magic.bin");
    craft(p, 20240521, 1, 2, d, sizeof d);
    CHECK_TOKENS_FAIL(p, 0, "bad magic 20240521", "20240520");
    /* a ref-loss shard given as tokens says so */
    craft(p, CF_REFLOSS_MAGIC, 1, 1, d, 4);
    CHECK_TOKENS_FAIL(p, 0, "reference-loss shard");
}

TEST(tokens_rejects_unknown_version) {
    uint16_t d[2] = {1, 2};
    const char *p = tmp_path("version.bin");
    craft(p, CF_TOKENS_MAGIC, 3, 2, d, sizeof d);
    CHECK_TOKENS_FAIL(p, 0, "unsupported version 3");
    craft(p, CF_TOKENS_MAGIC, 0, 2, d, sizeof d);
    CHECK_TOKENS_FAIL(p, 0, "unsupported version 0");
}

TEST(tokens_rejects_file_shorter_than_header) {
    const char *p = tmp_path("short.bin");
    int32_t hdr[10] = {CF_TOKENS_MAGIC, 1, 0};
    write_bytes(p, hdr, sizeof hdr);
    CHECK_TOKENS_FAIL(p, 0, "file has 40 bytes", "too short");
    write_bytes(p, "", 0);
    CHECK_TOKENS_FAIL(p, 0, "file has 0 bytes");
}

TEST(tokens_rejects_misaligned_counts_too_short_and_too_long) {
    uint16_t d[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    const char *p = tmp_path("count.bin");
    craft(p, CF_TOKENS_MAGIC, 1, 10, d, sizeof d);   /* says 10, holds 8 */
    CHECK_TOKENS_FAIL(p, 0, "file has 1040 bytes, header says 10 tokens");
    craft(p, CF_TOKENS_MAGIC, 1, 4, d, sizeof d);    /* says 4, holds 8 */
    CHECK_TOKENS_FAIL(p, 0, "file has 1040 bytes, header says 4 tokens");
    craft(p, CF_TOKENS_MAGIC, 1, 8, d, 15);          /* half a token at the end */
    CHECK_TOKENS_FAIL(p, 0, "file has 1039 bytes");
    craft(p, CF_TOKENS_MAGIC, 2, 4, d, sizeof d);    /* v2: 4 uint32 = 16 bytes: fits */
    cf_tokens t;
    CHECK(cf_tokens_open(&t, p, 0) == 0 && t.n == 4 && t.width == 4);
    cf_tokens_close(&t);
    craft(p, CF_TOKENS_MAGIC, 1, -5, d, sizeof d);
    CHECK_TOKENS_FAIL(p, 0, "negative");
}

TEST(tokens_rejects_missing_file_and_directory) {
    const char *p = tmp_path("nope.bin");
    CHECK_TOKENS_FAIL(p, 0, "cannot open");
    CHECK_TOKENS_FAIL(g_dir, 0, "not a regular file");
}

TEST(tokens_write_rejects_u16_overflow_and_bad_args_and_writes_nothing) {
    uint32_t tok[3] = {1, 70000, 2};
    const char *p = tmp_path("overflow.bin");
    CHECK(cf_tokens_write(p, tok, 3, 2) == -1);
    CHECK(err_has(p) && err_has("70000") && err_has("position 1"));
    CHECK(!cf_path_exists(p));
    CHECK(cf_tokens_write(p, tok, 3, 3) == -1 && err_has("width"));
    CHECK(cf_tokens_write(p, tok, -1, 0) == -1);
    CHECK(cf_tokens_write(p, NULL, 3, 0) == -1);
    CHECK(cf_tokens_write(p, tok, (int64_t)INT32_MAX + 1, 0) == -1);
    CHECK(!cf_path_exists(p));
    CHECK(count_temp_files() == 0);
}

TEST(tokens_fuzzed_headers_never_crash) {
    uint32_t tok[16];
    for (int i = 0; i < 16; i++) tok[i] = (uint32_t)i * 3;
    const char *good = tmp_path("fuzz_good.bin"), *p = tmp_path("fuzz.bin");
    CHECK(cf_tokens_write(good, tok, 16, 2) == 0);
    size_t len;
    unsigned char *orig = (unsigned char *)cf_read_file(good, &len, 1 << 20);
    unsigned char *buf = malloc(len);
    uint64_t s = 88172645463325252ull;
    int unnamed = 0;
    for (int iter = 0; iter < 2000; iter++) {
        memcpy(buf, orig, len);
        s ^= s << 13; s ^= s >> 7; s ^= s << 17;
        buf[s % 12] = (unsigned char)(s >> 32);   /* magic, version, count bytes */
        size_t n = iter % 3 == 0 ? (size_t)((s >> 16) % len) : len;
        write_bytes(p, buf, n);
        cf_tokens t;
        if (cf_tokens_open(&t, p, 40) == 0) {
            uint64_t sum = 0;
            for (int64_t i = 0; i < t.n; i++) sum += cf_tokens_get(&t, i);
            (void)sum;
            cf_tokens_close(&t);
        } else if (!err_has(p)) unnamed++;
    }
    free(buf);
    free(orig);
    CHECK(unnamed == 0);
}

/* --------------------------------------------------- reference-loss shards */

/* A token shard and matching losses (ref[0] = 0). */
static void make_pair(const char *tok_path, const char *ref_path, int n, cf_tokens *t, float *loss) {
    uint32_t *tok = malloc((size_t)n * sizeof *tok);
    for (int i = 0; i < n; i++) tok[i] = (uint32_t)(i * 7 % 300);
    CHECK(cf_tokens_write(tok_path, tok, n, 0) == 0);
    free(tok);
    CHECK(cf_tokens_open(t, tok_path, 300) == 0);
    for (int i = 0; i < n; i++) loss[i] = i == 0 ? 0.0f : 0.25f * (float)(i % 13);
    if (ref_path) CHECK(cf_refloss_write(ref_path, loss, n, t->hash) == 0);
}

TEST(refloss_round_trip_and_belongs_to_its_token_shard) {
    cf_tokens t;
    float loss[50];
    const char *tp = tmp_path("a.bin"), *rp = tmp_path("a.ref.bin");
    make_pair(tp, rp, 50, &t, loss);
    CHECK(file_size(rp) == 1024 + 50 * 4);
    cf_refloss r;
    CHECK(cf_refloss_open(&r, rp, &t) == 0);
    CHECK(r.n == 50 && r.token_hash == t.hash && strcmp(r.path, rp) == 0);
    CHECK(memcmp(r.loss, loss, sizeof loss) == 0);
    cf_refloss_close(&r);
    CHECK(r.loss == NULL && r.path == NULL);
    /* without a token shard, only the file itself is checked */
    CHECK(cf_refloss_open(&r, rp, NULL) == 0);
    cf_refloss_close(&r);
    cf_tokens_close(&t);
}

TEST(refloss_rejects_wrong_token_shard_by_hash) {
    cf_tokens a, b;
    float loss[40];
    const char *ap = tmp_path("x.bin"), *rp = tmp_path("x.ref.bin"), *bp = tmp_path("y.bin");
    make_pair(ap, rp, 40, &a, loss);
    /* y.bin: same length, different tokens */
    uint32_t tok[40];
    for (int i = 0; i < 40; i++) tok[i] = (uint32_t)(i + 1);
    CHECK(cf_tokens_write(bp, tok, 40, 0) == 0);
    CHECK(cf_tokens_open(&b, bp, 0) == 0);
    char want[700];
    snprintf(want, sizeof want, "x.ref.bin does not belong to %s", bp);
    CHECK_REF_FAIL(rp, &b, want, "hash");
    cf_tokens_close(&a);
    cf_tokens_close(&b);
}

TEST(refloss_rejects_count_mismatch_with_token_shard) {
    cf_tokens a, b;
    float loss[40];
    const char *ap = tmp_path("c.bin"), *rp = tmp_path("c.ref.bin"), *bp = tmp_path("d.bin");
    make_pair(ap, rp, 40, &a, loss);
    make_pair(bp, NULL, 39, &b, loss);
    CHECK_REF_FAIL(rp, &b, "does not belong to", "40 losses", "39 tokens");
    cf_tokens_close(&a);
    cf_tokens_close(&b);
}

TEST(refloss_rejects_nan_inf_and_negative_losses_naming_the_position) {
    float good[4] = {0, 1, 2, 3};
    const char *p = tmp_path("bad.ref.bin");
    float d[4];
    memcpy(d, good, sizeof d);
    d[2] = NAN;
    craft(p, CF_REFLOSS_MAGIC, 1, 4, d, sizeof d);
    CHECK_REF_FAIL(p, NULL, "position 2", "NaN");
    memcpy(d, good, sizeof d);
    d[3] = INFINITY;
    craft(p, CF_REFLOSS_MAGIC, 1, 4, d, sizeof d);
    CHECK_REF_FAIL(p, NULL, "position 3", "infinite");
    memcpy(d, good, sizeof d);
    d[1] = -0.5f;
    craft(p, CF_REFLOSS_MAGIC, 1, 4, d, sizeof d);
    CHECK_REF_FAIL(p, NULL, "position 1", "negative");
}

TEST(refloss_rejects_nonzero_first_loss_as_off_by_one) {
    float d[3] = {1.5f, 1, 2};
    const char *p = tmp_path("off1.ref.bin");
    craft(p, CF_REFLOSS_MAGIC, 1, 3, d, sizeof d);
    CHECK_REF_FAIL(p, NULL, "position 0", "off by one");
    CHECK(cf_refloss_write(p, d, 3, 0) == -1 && err_has("position 0"));
}

TEST(refloss_rejects_bad_magic_version_and_misaligned_count) {
    float d[4] = {0, 1, 2, 3};
    const char *p = tmp_path("hdr.ref.bin");
    craft(p, 12345, 1, 4, d, sizeof d);
    CHECK_REF_FAIL(p, NULL, "bad magic 12345");
    craft(p, CF_TOKENS_MAGIC, 1, 4, d, sizeof d);
    CHECK_REF_FAIL(p, NULL, "token shard, not a reference-loss shard");
    craft(p, CF_REFLOSS_MAGIC, 2, 4, d, sizeof d);
    CHECK_REF_FAIL(p, NULL, "unsupported version 2");
    craft(p, CF_REFLOSS_MAGIC, 1, 5, d, sizeof d);
    CHECK_REF_FAIL(p, NULL, "file has 1040 bytes, header says 5 losses");
    craft(p, CF_REFLOSS_MAGIC, 1, 4, d, 14);
    CHECK_REF_FAIL(p, NULL, "file has 1038 bytes");
    craft(p, CF_REFLOSS_MAGIC, 1, -1, d, sizeof d);
    CHECK_REF_FAIL(p, NULL, "negative");
    write_bytes(p, d, 8);
    CHECK_REF_FAIL(p, NULL, "too short");
}

TEST(refloss_write_rejects_bad_losses_and_writes_nothing) {
    float d[4] = {0, 1, NAN, 3};
    const char *p = tmp_path("w.ref.bin");
    CHECK(cf_refloss_write(p, d, 4, 7) == -1 && err_has(p) && err_has("position 2"));
    d[2] = -1.0f;
    CHECK(cf_refloss_write(p, d, 4, 7) == -1 && err_has("negative"));
    CHECK(cf_refloss_write(p, NULL, 4, 7) == -1);
    CHECK(cf_refloss_write(p, d, -1, 7) == -1);
    CHECK(!cf_path_exists(p));
    CHECK(count_temp_files() == 0);
}

TEST(refloss_write_clamps_rounding_negatives_to_zero) {
    /* logsumexp - logit can land a few ulps below zero */
    float d[3] = {0, -1e-7f, 2};
    const char *p = tmp_path("clamp.ref.bin");
    CHECK(cf_refloss_write(p, d, 3, 7) == 0);
    cf_refloss r;
    CHECK(cf_refloss_open(&r, p, NULL) == 0);
    CHECK(r.loss[1] == 0.0f && r.loss[2] == 2.0f && r.token_hash == 7);
    cf_refloss_close(&r);
}

TEST(refloss_hash_is_stored_in_header_words_3_and_4) {
    float d[2] = {0, 1};
    const char *p = tmp_path("hw.ref.bin");
    uint64_t h = 0x0123456789abcdefull;
    CHECK(cf_refloss_write(p, d, 2, h) == 0);
    FILE *f = fopen(p, "rb");
    int32_t hdr[256];
    CHECK(f && fread(hdr, 4, 256, f) == 256);
    if (f) fclose(f);
    CHECK(hdr[0] == CF_REFLOSS_MAGIC && hdr[1] == 1 && hdr[2] == 2);
    CHECK((uint32_t)hdr[3] == 0x89abcdefu && (uint32_t)hdr[4] == 0x01234567u);
    cf_refloss r;
    CHECK(cf_refloss_open(&r, p, NULL) == 0 && r.token_hash == h);
    cf_refloss_close(&r);
}

TEST(shards_atomic_writes_leave_no_temp_files) {
    uint32_t tok[3] = {1, 2, 3};
    float d[3] = {0, 1, 2};
    for (int i = 0; i < 3; i++) {
        CHECK(cf_tokens_write(tmp_path("at.bin"), tok, 3, 0) == 0);
        CHECK(cf_refloss_write(tmp_path("at.ref.bin"), d, 3, 1) == 0);
    }
    CHECK(count_temp_files() == 0);
    /* unwritable destination: fails naming it */
    char p[700];
    snprintf(p, sizeof p, "%s/no/such/dir/t.bin", g_dir);
    CHECK(cf_tokens_write(p, tok, 3, 0) == -1 && err_has(p));
}

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb; (void)flag; (void)ftw;
    return remove(p);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/cf_test_shards_XXXXXX");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }

    RUN(tokens_u16_round_trip_and_llm_c_header);
    RUN(tokens_u32_round_trip_for_vocab_over_65535);
    RUN(tokens_width_0_picks_u16_when_every_id_fits);
    RUN(tokens_hash_is_fnv1a_of_the_stored_payload);
    RUN(tokens_large_shard_round_trips_across_write_chunks);
    RUN(tokens_empty_shard_is_valid);
    RUN(tokens_rejects_id_at_or_above_vocab);
    RUN(tokens_rejects_bad_magic);
    RUN(tokens_rejects_unknown_version);
    RUN(tokens_rejects_file_shorter_than_header);
    RUN(tokens_rejects_misaligned_counts_too_short_and_too_long);
    RUN(tokens_rejects_missing_file_and_directory);
    RUN(tokens_write_rejects_u16_overflow_and_bad_args_and_writes_nothing);
    RUN(tokens_fuzzed_headers_never_crash);
    RUN(refloss_round_trip_and_belongs_to_its_token_shard);
    RUN(refloss_rejects_wrong_token_shard_by_hash);
    RUN(refloss_rejects_count_mismatch_with_token_shard);
    RUN(refloss_rejects_nan_inf_and_negative_losses_naming_the_position);
    RUN(refloss_rejects_nonzero_first_loss_as_off_by_one);
    RUN(refloss_rejects_bad_magic_version_and_misaligned_count);
    RUN(refloss_write_rejects_bad_losses_and_writes_nothing);
    RUN(refloss_write_clamps_rounding_negatives_to_zero);
    RUN(refloss_hash_is_stored_in_header_words_3_and_4);
    RUN(shards_atomic_writes_leave_no_temp_files);

    nftw(g_dir, rm_entry, 8, FTW_DEPTH | FTW_PHYS);
    return test_summary();
}
