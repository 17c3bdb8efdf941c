/* test_safetensors.c — safetensors read/write, sharding, bad files. */
#include "test.h"
#include "base/common.h"
#include "formats/io.h"

#include <cjson/cJSON.h>
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

/* A hand-made safetensors file: header JSON (unpadded) then data. */
static void craft(const char *path, const char *header, const void *data, size_t ndata) {
    size_t h = strlen(header);
    unsigned char *buf = malloc(8 + h + ndata + 1);
    for (int i = 0; i < 8; i++) buf[i] = (unsigned char)((uint64_t)h >> (8 * i));
    memcpy(buf + 8, header, h);
    if (ndata) memcpy(buf + 8 + h, data, ndata);
    write_bytes(path, buf, 8 + h + ndata);
    free(buf);
}

/* Opening must fail with a message naming the file and containing frag. */
#define CHECK_OPEN_FAILS(path, frag) do { \
    cf_st_archive a_; \
    int rc_ = cf_st_open(&a_, path); \
    CHECK(rc_ == -1); \
    if (rc_ == 0) cf_st_close(&a_); \
    CHECK_MSG(err_has(path), "message does not name %s: %s", path, cf_last_error()); \
    CHECK_MSG(err_has(frag), "message lacks '%s': %s", frag, cf_last_error()); \
    CHECK(a_.ntensors == 0 && a_.tensors == NULL && a_.files == NULL); \
} while (0)

static int count_matching(const char *dir, const char *sub) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) if (strstr(e->d_name, sub)) n++;
    if (d) closedir(d);
    return n;
}

static long file_size(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 ? (long)st.st_size : -1;
}

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb; (void)flag; (void)ftw;
    return remove(p);
}

/* A fresh empty subdirectory of g_dir (one at a time: the buffer is
 * static, and not shared with tmp_path's rotating ones). */
static const char *fresh_dir(const char *name) {
    static char p[600];
    snprintf(p, sizeof p, "%s/%s", g_dir, name);
    nftw(p, rm_entry, 8, FTW_DEPTH | FTW_PHYS);
    mkdir(p, 0755);
    return p;
}

/* Three tensors, deterministic contents. */
typedef struct { float a[6], b[4], c[3]; cf_st_item items[3]; } three;

static void make_three(three *t, int bf16_exact) {
    for (int i = 0; i < 6; i++) t->a[i] = (float)i * 0.5f - 1.25f;
    for (int i = 0; i < 4; i++) t->b[i] = 1.0f / (float)(i + 3);
    for (int i = 0; i < 3; i++) t->c[i] = -100.0f * (float)i + 0.1f;
    if (bf16_exact) {   /* snap to bf16-representable values */
        float *all[] = {t->a, t->b, t->c};
        int ns[] = {6, 4, 3};
        for (int k = 0; k < 3; k++)
            for (int i = 0; i < ns[k]; i++) all[k][i] = cf_bf16_to_f32(cf_f32_to_bf16(all[k][i]));
    }
    t->items[0] = (cf_st_item){"model.embed_tokens.weight", t->a, 2, {2, 3}};
    t->items[1] = (cf_st_item){"model.norm.weight", t->b, 1, {4}};
    t->items[2] = (cf_st_item){"lm_head.weight", t->c, 2, {3, 1}};
}

/* Opens path and checks every item reads back bit-exactly. */
static int reads_back_exactly(const char *path, const cf_st_item *items, int n) {
    cf_st_archive a;
    if (cf_st_open(&a, path) != 0) { printf("    open: %s\n", cf_last_error()); return 0; }
    int ok = a.ntensors == n;
    for (int i = 0; i < n && ok; i++) {
        int k = cf_st_find(&a, items[i].name);
        if (k < 0) { ok = 0; break; }
        size_t numel = 1;
        for (int d = 0; d < items[i].ndim; d++) numel *= (size_t)items[i].shape[d];
        ok = a.tensors[k].ndim == items[i].ndim;
        for (int d = 0; d < items[i].ndim && ok; d++) ok = a.tensors[k].shape[d] == items[i].shape[d];
        float *buf = malloc((numel ? numel : 1) * sizeof *buf);
        if (ok && cf_st_read_f32(&a, k, buf, numel) != 0) { printf("    read: %s\n", cf_last_error()); ok = 0; }
        if (ok && numel && memcmp(buf, items[i].data, numel * 4) != 0) ok = 0;
        free(buf);
    }
    cf_st_close(&a);
    return ok;
}

/* ------------------------------------------------------------ conversions */

TEST(safetensors_bf16_conversion_rounds_to_nearest_even) {
    /* 1 + 2^-8 is halfway between bf16 1.0 and 1 + 2^-7: ties to even (1.0) */
    CHECK(cf_f32_to_bf16(1.0f + 0x1p-8f) == 0x3f80);
    /* 1 + 3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6 (even): up */
    CHECK(cf_f32_to_bf16(1.0f + 3 * 0x1p-8f) == 0x3f82);
    /* just above the halfway point rounds up */
    CHECK(cf_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f) == 0x3f81);
    CHECK(cf_f32_to_bf16(-2.0f) == 0xc000);
    CHECK(cf_f32_to_bf16(INFINITY) == 0x7f80 && cf_f32_to_bf16(-INFINITY) == 0xff80);
    /* NaN stays NaN (its payload must not carry into infinity) */
    uint32_t nanbits = 0x7fffffffu;
    float nan_in;
    memcpy(&nan_in, &nanbits, 4);
    CHECK(isnan(cf_bf16_to_f32(cf_f32_to_bf16(nan_in))));
    CHECK(isnan(cf_bf16_to_f32(cf_f32_to_bf16(NAN))));
    /* the largest finite float rounds to infinity under RNE */
    CHECK(isinf(cf_bf16_to_f32(cf_f32_to_bf16(3.4028235e38f))));
    /* every bf16 value survives bf16 -> f32 -> bf16 (NaNs stay NaN) */
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = cf_bf16_to_f32((uint16_t)h);
        if (isnan(f)) { if (!isnan(cf_bf16_to_f32(cf_f32_to_bf16(f)))) bad++; }
        else if (cf_f32_to_bf16(f) != h) bad++;
    }
    CHECK(bad == 0);
}

TEST(safetensors_f16_conversion_is_exact_for_all_65536_values) {
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        int sign = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
        double want;
        if (e == 0) want = ldexp(m, -24);
        else if (e == 31) want = m ? NAN : INFINITY;
        else want = ldexp(1024 + m, e - 25);
        if (sign) want = -want;
        float got = cf_f16_to_f32((uint16_t)h);
        if (isnan(want) ? !isnan(got) : (got != (float)want || !signbit(got) != !signbit(want))) bad++;
    }
    CHECK(bad == 0);
    CHECK(cf_f16_to_f32(0x3c00) == 1.0f && cf_f16_to_f32(0xc000) == -2.0f && cf_f16_to_f32(0x0001) == 0x1p-24f);
}

TEST(safetensors_dtype_names_and_sizes) {
    CHECK(strcmp(cf_dtype_name(CF_DT_F32), "F32") == 0 && cf_dtype_size(CF_DT_F32) == 4);
    CHECK(strcmp(cf_dtype_name(CF_DT_F16), "F16") == 0 && cf_dtype_size(CF_DT_F16) == 2);
    CHECK(strcmp(cf_dtype_name(CF_DT_BF16), "BF16") == 0 && cf_dtype_size(CF_DT_BF16) == 2);
}

/* ------------------------------------------------------------ round trips */

TEST(safetensors_f32_round_trip_is_exact) {
    three t;
    make_three(&t, 0);
    t.a[0] = -0.0f; t.a[1] = 1e-42f /* subnormal */; t.a[2] = 3.4028235e38f; t.b[0] = INFINITY;
    const char *p = tmp_path("f32.safetensors");
    CHECK(cf_st_write(p, t.items, 3, CF_DT_F32) == 0);
    CHECK(reads_back_exactly(p, t.items, 3));
    cf_st_archive a;
    CHECK(cf_st_open(&a, p) == 0);
    for (int i = 0; i < a.ntensors; i++) CHECK(a.tensors[i].dtype == CF_DT_F32);
    cf_st_close(&a);
}

TEST(safetensors_bf16_round_trip_is_exact_for_bf16_values) {
    three t;
    make_three(&t, 1);
    const char *p = tmp_path("bf16.safetensors");
    CHECK(cf_st_write(p, t.items, 3, CF_DT_BF16) == 0);
    CHECK(reads_back_exactly(p, t.items, 3));
    cf_st_archive a;
    CHECK(cf_st_open(&a, p) == 0);
    for (int i = 0; i < a.ntensors; i++) CHECK(a.tensors[i].dtype == CF_DT_BF16);
    /* 13 elements * 2 bytes of data */
    long hdr = 0;
    FILE *f = fopen(p, "rb");
    unsigned char lb[8];
    CHECK(f && fread(lb, 1, 8, f) == 8);
    if (f) fclose(f);
    for (int i = 7; i >= 0; i--) hdr = hdr * 256 + lb[i];
    CHECK(file_size(p) == 8 + hdr + 13 * 2);
    cf_st_close(&a);
}

TEST(safetensors_bf16_write_rounds_values_to_nearest_even) {
    float v[3] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 0.1f};
    cf_st_item it = {"x", v, 1, {3}};
    const char *p = tmp_path("round.safetensors");
    CHECK(cf_st_write(p, &it, 1, CF_DT_BF16) == 0);
    cf_st_archive a;
    float out[3] = {0};
    CHECK(cf_st_open(&a, p) == 0 && cf_st_read_f32(&a, 0, out, 3) == 0);
    CHECK(out[0] == 1.0f && out[1] == 1.0f + 0x1p-6f);
    CHECK(fabsf(out[2] - 0.1f) < 0.1f * 0x1p-8f && out[2] != 0.1f);
    cf_st_close(&a);
}

TEST(safetensors_f16_file_is_read_into_fp32) {
    /* 1.0, -2.0, 65504 (max), 2^-24 (smallest subnormal), +inf, 0.5 */
    uint16_t d[6] = {0x3c00, 0xc000, 0x7bff, 0x0001, 0x7c00, 0x3800};
    const char *p = tmp_path("f16.safetensors");
    craft(p, "{\"w\":{\"dtype\":\"F16\",\"shape\":[2,3],\"data_offsets\":[0,12]}}", d, sizeof d);
    cf_st_archive a;
    CHECK(cf_st_open(&a, p) == 0);
    CHECK(a.ntensors == 1 && a.tensors[0].dtype == CF_DT_F16 && a.tensors[0].ndim == 2);
    float out[6];
    CHECK(cf_st_read_f32(&a, 0, out, 6) == 0);
    CHECK(out[0] == 1.0f && out[1] == -2.0f && out[2] == 65504.0f && out[3] == 0x1p-24f);
    CHECK(isinf(out[4]) && out[4] > 0 && out[5] == 0.5f);
    cf_st_close(&a);
}

TEST(safetensors_large_tensor_round_trips_across_conversion_chunks) {
    /* more elements than one conversion chunk, odd count */
    size_t n = 200003;
    float *x = malloc(n * sizeof *x);
    for (size_t i = 0; i < n; i++) x[i] = cf_bf16_to_f32(cf_f32_to_bf16(sinf((float)i) * 3.0f));
    cf_st_item it = {"big", x, 1, {(int64_t)n}};
    const char *p = tmp_path("big.safetensors");
    CHECK(cf_st_write(p, &it, 1, CF_DT_BF16) == 0);
    CHECK(reads_back_exactly(p, &it, 1));
    CHECK(cf_st_write(p, &it, 1, CF_DT_F32) == 0);
    CHECK(reads_back_exactly(p, &it, 1));
    free(x);
}

TEST(safetensors_scalar_and_empty_tensors_round_trip) {
    float s = 42.0f;
    cf_st_item items[3] = {{"scalar", &s, 0, {0}}, {"empty", NULL, 2, {0, 5}}, {"after", &s, 1, {1}}};
    const char *p = tmp_path("scalar.safetensors");
    CHECK(cf_st_write(p, items, 3, CF_DT_F32) == 0);
    CHECK(reads_back_exactly(p, items, 3));
    cf_st_archive a;
    CHECK(cf_st_open(&a, p) == 0);
    int k = cf_st_find(&a, "scalar");
    CHECK(k >= 0 && a.tensors[k].ndim == 0);
    k = cf_st_find(&a, "empty");
    CHECK(k >= 0 && a.tensors[k].begin == a.tensors[k].end);
    cf_st_close(&a);
}

TEST(safetensors_written_header_is_aligned_contiguous_and_has_format_pt) {
    three t;
    make_three(&t, 0);
    const char *p = tmp_path("layout.safetensors");
    CHECK(cf_st_write(p, t.items, 3, CF_DT_F32) == 0);
    size_t len;
    char *buf = cf_read_file(p, &len, 1 << 20);
    CHECK(buf != NULL);
    if (!buf) return;
    uint64_t h = 0;
    for (int i = 7; i >= 0; i--) h = (h << 8) | (unsigned char)buf[i];
    CHECK((8 + h) % 8 == 0);
    CHECK(8 + h + 13 * 4 == len);
    cJSON *j = cJSON_ParseWithLength(buf + 8, h);
    CHECK(j != NULL);
    if (j) {
        cJSON *m = cJSON_GetObjectItemCaseSensitive(j, "__metadata__");
        CHECK(m && strcmp(cJSON_GetObjectItemCaseSensitive(m, "format")->valuestring, "pt") == 0);
        /* tensors tile [0, 52) in the given order with no gaps */
        uint64_t at = 0;
        for (int i = 0; i < 3; i++) {
            cJSON *e = cJSON_GetObjectItemCaseSensitive(j, t.items[i].name);
            cJSON *o = e ? cJSON_GetObjectItemCaseSensitive(e, "data_offsets") : NULL;
            CHECK(o && (uint64_t)cJSON_GetArrayItem(o, 0)->valuedouble == at);
            if (o) at = (uint64_t)cJSON_GetArrayItem(o, 1)->valuedouble;
        }
        CHECK(at == 13 * 4);
        cJSON_Delete(j);
    }
    free(buf);
}

TEST(safetensors_find_returns_index_or_minus_one) {
    three t;
    make_three(&t, 0);
    const char *p = tmp_path("find.safetensors");
    CHECK(cf_st_write(p, t.items, 3, CF_DT_F32) == 0);
    cf_st_archive a;
    CHECK(cf_st_open(&a, p) == 0);
    for (int i = 0; i < 3; i++) {
        int k = cf_st_find(&a, t.items[i].name);
        CHECK(k >= 0 && strcmp(a.tensors[k].name, t.items[i].name) == 0);
    }
    CHECK(cf_st_find(&a, "model.nope") == -1);
    CHECK(cf_st_find(&a, "") == -1);
    cf_st_close(&a);
}

TEST(safetensors_open_directory_reads_model_safetensors) {
    three t;
    make_three(&t, 0);
    const char *d = fresh_dir("single_dir");
    CHECK(cf_st_write_dir(d, t.items, 3, CF_DT_F32, 0) == 0);
    CHECK(cf_path_exists(tmp_path("single_dir/model.safetensors")));
    CHECK(!cf_path_exists(tmp_path("single_dir/model.safetensors.index.json")));
    CHECK(reads_back_exactly(d, t.items, 3));
}

TEST(safetensors_sharded_write_and_read_round_trip) {
    three t;
    make_three(&t, 1);
    const char *d = fresh_dir("sharded");
    /* 24 + 16 + 12 bytes of fp32 with a 30-byte limit: [a], [b, c] */
    CHECK(cf_st_write_dir(d, t.items, 3, CF_DT_F32, 30) == 0);
    CHECK(cf_path_exists(tmp_path("sharded/model-00001-of-00002.safetensors")));
    CHECK(cf_path_exists(tmp_path("sharded/model-00002-of-00002.safetensors")));
    CHECK(cf_path_exists(tmp_path("sharded/model.safetensors.index.json")));
    CHECK(!cf_path_exists(tmp_path("sharded/model.safetensors")));
    CHECK(reads_back_exactly(d, t.items, 3));
    /* the index file itself can be opened too */
    CHECK(reads_back_exactly(tmp_path("sharded/model.safetensors.index.json"), t.items, 3));

    cf_st_archive a;
    CHECK(cf_st_open(&a, d) == 0);
    CHECK(a.nfiles == 2);
    int k = cf_st_find(&a, "model.embed_tokens.weight");
    CHECK(k >= 0 && strstr(a.files[a.tensors[k].file], "model-00001-of-00002"));
    k = cf_st_find(&a, "lm_head.weight");
    CHECK(k >= 0 && strstr(a.files[a.tensors[k].file], "model-00002-of-00002"));
    cf_st_close(&a);

    /* the index is HF's layout: metadata.total_size and a weight_map */
    size_t len;
    char *txt = cf_read_file(tmp_path("sharded/model.safetensors.index.json"), &len, 1 << 20);
    cJSON *j = txt ? cJSON_Parse(txt) : NULL;
    CHECK(j != NULL);
    if (j) {
        cJSON *m = cJSON_GetObjectItemCaseSensitive(j, "metadata");
        CHECK(m && cJSON_GetObjectItemCaseSensitive(m, "total_size")->valuedouble == 13 * 4);
        cJSON *wm = cJSON_GetObjectItemCaseSensitive(j, "weight_map");
        CHECK(cJSON_GetArraySize(wm) == 3);
        CHECK(strcmp(cJSON_GetObjectItemCaseSensitive(wm, "model.norm.weight")->valuestring,
                     "model-00002-of-00002.safetensors") == 0);
        cJSON_Delete(j);
    }
    free(txt);
}

TEST(safetensors_sharded_bf16_with_one_oversized_tensor_per_shard) {
    three t;
    make_three(&t, 1);
    const char *d = fresh_dir("sharded_bf16");
    /* limit 1 byte: every tensor is its own shard */
    CHECK(cf_st_write_dir(d, t.items, 3, CF_DT_BF16, 1) == 0);
    CHECK(cf_path_exists(tmp_path("sharded_bf16/model-00003-of-00003.safetensors")));
    CHECK(reads_back_exactly(d, t.items, 3));
}

TEST(safetensors_open_directory_prefers_the_index_over_model_safetensors) {
    /* Both layouts present (a save interrupted between writing the index
     * and removing the old single file): the index is the newer one. */
    three t, other;
    make_three(&t, 0);
    make_three(&other, 0);
    other.a[0] = 99.0f;
    const char *d = fresh_dir("both");
    CHECK(cf_st_write_dir(d, t.items, 3, CF_DT_F32, 30) == 0);
    CHECK(cf_st_write(tmp_path("both/model.safetensors"), other.items, 3, CF_DT_F32) == 0);
    CHECK(reads_back_exactly(d, t.items, 3));
}

TEST(safetensors_single_write_removes_stale_index_and_shards) {
    three t;
    make_three(&t, 0);
    const char *d = fresh_dir("relayout");
    CHECK(cf_st_write_dir(d, t.items, 3, CF_DT_F32, 1) == 0);   /* 3 shards */
    CHECK(count_matching(d, "-of-00003") == 3);
    CHECK(cf_st_write_dir(d, t.items, 3, CF_DT_F32, 0) == 0);   /* single */
    CHECK(count_matching(d, "-of-") == 0);
    CHECK(!cf_path_exists(tmp_path("relayout/model.safetensors.index.json")));
    CHECK(reads_back_exactly(d, t.items, 3));
}

TEST(safetensors_sharded_write_removes_stale_single_file_and_extra_shards) {
    three t;
    make_three(&t, 0);
    const char *d = fresh_dir("relayout2");
    CHECK(cf_st_write_dir(d, t.items, 3, CF_DT_F32, 0) == 0);
    CHECK(cf_st_write_dir(d, t.items, 3, CF_DT_F32, 1) == 0);    /* 3 shards */
    CHECK(!cf_path_exists(tmp_path("relayout2/model.safetensors")));
    CHECK(cf_st_write_dir(d, t.items, 3, CF_DT_F32, 30) == 0);   /* 2 shards */
    CHECK(count_matching(d, "-of-00003") == 0);
    CHECK(count_matching(d, "-of-00002") == 2);
    CHECK(reads_back_exactly(d, t.items, 3));
}

TEST(safetensors_atomic_writes_leave_no_temp_files) {
    three t;
    make_three(&t, 0);
    const char *d = fresh_dir("atomic");
    CHECK(cf_st_write_dir(d, t.items, 3, CF_DT_F32, 30) == 0);
    CHECK(cf_st_write_dir(d, t.items, 3, CF_DT_BF16, 0) == 0);
    CHECK(cf_st_write(tmp_path("atomic/x.safetensors"), t.items, 3, CF_DT_F32) == 0);
    CHECK(count_matching(d, ".tmp.") == 0);
}

TEST(safetensors_write_rejects_bad_items_and_writes_nothing) {
    three t;
    make_three(&t, 0);
    const char *p = tmp_path("bad_write.safetensors");
    cf_st_item dup[2] = {t.items[0], t.items[0]};
    CHECK(cf_st_write(p, dup, 2, CF_DT_F32) == -1 && err_has("duplicate tensor name") && err_has(p));
    cf_st_item neg = {"neg", t.a, 1, {-1}};
    CHECK(cf_st_write(p, &neg, 1, CF_DT_F32) == -1);
    cf_st_item nodata = {"nodata", NULL, 1, {4}};
    CHECK(cf_st_write(p, &nodata, 1, CF_DT_F32) == -1 && err_has("NULL data"));
    cf_st_item meta = {"__metadata__", t.a, 1, {1}};
    CHECK(cf_st_write(p, &meta, 1, CF_DT_F32) == -1);
    cf_st_item quote = {"a\"b", t.a, 1, {1}};
    CHECK(cf_st_write(p, &quote, 1, CF_DT_F32) == 0);   /* escaped properly */
    CHECK(reads_back_exactly(p, &quote, 1));
    unlink(p);
    CHECK(cf_st_write(p, t.items, 3, CF_DT_F16) == -1 && err_has("F16"));
    CHECK(!cf_path_exists(p));
    const char *d = fresh_dir("bad_write_dir");
    CHECK(cf_st_write_dir(d, dup, 2, CF_DT_F32, 1) == -1);
    CHECK(count_matching(d, "safetensors") == 0);
}

/* --------------------------------------------------------------- bad files */

TEST(safetensors_rejects_file_shorter_than_8_bytes) {
    const char *p = tmp_path("short.safetensors");
    write_bytes(p, "abc", 3);
    CHECK_OPEN_FAILS(p, "too short");
    write_bytes(p, "", 0);
    CHECK_OPEN_FAILS(p, "too short");
}

TEST(safetensors_rejects_header_longer_than_file) {
    const char *p = tmp_path("hdrlen.safetensors");
    unsigned char buf[16] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, '{', '}'};
    write_bytes(p, buf, 10);
    CHECK_OPEN_FAILS(p, "goes beyond the end of the file");
    /* just one byte too long */
    unsigned char b2[10] = {3, 0, 0, 0, 0, 0, 0, 0, '{', '}'};
    write_bytes(p, b2, 10);
    CHECK_OPEN_FAILS(p, "header length 3");
}

TEST(safetensors_rejects_truncated_file) {
    three t;
    make_three(&t, 0);
    const char *p = tmp_path("trunc.safetensors");
    CHECK(cf_st_write(p, t.items, 3, CF_DT_F32) == 0);
    CHECK(truncate(p, file_size(p) - 4) == 0);
    CHECK_OPEN_FAILS(p, "beyond the data section");
    /* cut inside the header */
    CHECK(truncate(p, 20) == 0);
    CHECK_OPEN_FAILS(p, "goes beyond the end of the file");
}

TEST(safetensors_read_detects_file_truncated_after_open) {
    three t;
    make_three(&t, 0);
    const char *p = tmp_path("trunc_late.safetensors");
    CHECK(cf_st_write(p, t.items, 3, CF_DT_F32) == 0);
    cf_st_archive a;
    CHECK(cf_st_open(&a, p) == 0);
    CHECK(truncate(p, file_size(p) - 40) == 0);
    float out[6];
    int k = cf_st_find(&a, "lm_head.weight");   /* written last */
    CHECK(cf_st_read_f32(&a, k, out, 3) == -1 && err_has(p) && err_has("truncated"));
    cf_st_close(&a);
}

TEST(safetensors_rejects_bad_json) {
    const char *p = tmp_path("badjson.safetensors");
    craft(p, "{\"w\":{\"dtype\":\"F32\",", NULL, 0);
    CHECK_OPEN_FAILS(p, "not valid JSON");
    craft(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}} junk", "abcd", 4);
    CHECK_OPEN_FAILS(p, "not valid JSON");
    craft(p, "[1,2,3]", NULL, 0);
    CHECK_OPEN_FAILS(p, "not a safetensors file");
    craft(p, "{\"w\": 5}", NULL, 0);
    CHECK_OPEN_FAILS(p, "expected an object");
    craft(p, "{\"__metadata__\": {\"format\": 5}}", NULL, 0);
    CHECK_OPEN_FAILS(p, "__metadata__");
}

TEST(safetensors_rejects_unsupported_dtype) {
    const char *p = tmp_path("i8.safetensors");
    craft(p, "{\"w\":{\"dtype\":\"I8\",\"shape\":[4],\"data_offsets\":[0,4]}}", "abcd", 4);
    CHECK_OPEN_FAILS(p, "unsupported dtype 'I8'");
    craft(p, "{\"w\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]}}", "abcdefgh", 8);
    CHECK_OPEN_FAILS(p, "unsupported dtype 'F64'");
    craft(p, "{\"w\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,4]}}", "abcd", 4);
    CHECK_OPEN_FAILS(p, "dtype");
}

TEST(safetensors_rejects_shape_that_does_not_match_the_byte_size) {
    const char *p = tmp_path("shape.safetensors");
    float d[6] = {0};
    craft(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,24]}}", d, 24);
    CHECK_OPEN_FAILS(p, "shape [2, 2] in F32 needs 16 bytes, but data_offsets span 24");
    craft(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[2,-3],\"data_offsets\":[0,24]}}", d, 24);
    CHECK_OPEN_FAILS(p, "shape[1]");
    craft(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[2.5],\"data_offsets\":[0,24]}}", d, 24);
    CHECK_OPEN_FAILS(p, "shape[0]");
    craft(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":\"6\",\"data_offsets\":[0,24]}}", d, 24);
    CHECK_OPEN_FAILS(p, "shape");
    /* a product that overflows 64 bits */
    craft(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4],\"data_offsets\":[0,24]}}", d, 24);
    CHECK_OPEN_FAILS(p, "too large");
}

TEST(safetensors_rejects_offsets_beyond_data_or_reversed) {
    const char *p = tmp_path("offs.safetensors");
    float d[4] = {0};
    craft(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[4,20]}}", d, 16);
    CHECK_OPEN_FAILS(p, "beyond the data section");
    craft(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,4]}}", d, 16);
    CHECK_OPEN_FAILS(p, "begin after they end");
    craft(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0]}}", d, 16);
    CHECK_OPEN_FAILS(p, "data_offsets");
    craft(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[-16,0]}}", d, 16);
    CHECK_OPEN_FAILS(p, "data_offsets");
    craft(p, "{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[1e300,1e300]}}", d, 16);
    CHECK_OPEN_FAILS(p, "data_offsets");
}

TEST(safetensors_rejects_overlapping_offsets) {
    const char *p = tmp_path("overlap.safetensors");
    float d[4] = {0};
    craft(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,12]},"
             "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", d, 16);
    CHECK_OPEN_FAILS(p, "overlap");
    /* an identical range twice overlaps too; empty tensors do not */
    craft(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
             "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", d, 16);
    CHECK_OPEN_FAILS(p, "overlap");
    craft(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
             "\"e\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,4]}}", d, 8);
    cf_st_archive a;
    CHECK(cf_st_open(&a, p) == 0);
    cf_st_close(&a);
}

TEST(safetensors_rejects_duplicate_names) {
    const char *p = tmp_path("dup.safetensors");
    float d[4] = {0};
    craft(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
             "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}", d, 16);
    CHECK_OPEN_FAILS(p, "duplicate tensor name 'a'");
}

TEST(safetensors_rejects_more_than_8_dims_and_long_names) {
    const char *p = tmp_path("dims.safetensors");
    float d[1] = {0};
    craft(p, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", d, 4);
    CHECK_OPEN_FAILS(p, "9 dimensions");
    char hdr[1024], name[300];
    memset(name, 'n', 299);
    name[299] = 0;
    snprintf(hdr, sizeof hdr, "{\"%s\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", name);
    craft(p, hdr, d, 4);
    CHECK_OPEN_FAILS(p, "longer than the limit");
    craft(p, "{\"\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", d, 4);
    CHECK_OPEN_FAILS(p, "empty name");
    /* a JSON escape must not smuggle a newline into the one-line message */
    craft(p, "{\"a\\nb\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", d, 4);
    CHECK_OPEN_FAILS(p, "control characters");
    CHECK(strchr(cf_last_error(), '\n') == NULL);
    craft(p, "{\"a\":{\"dtype\":\"I\\n8\",\"shape\":[1],\"data_offsets\":[0,4]}}", d, 4);
    CHECK_OPEN_FAILS(p, "unsupported dtype 'I?8'");
}

TEST(safetensors_read_rejects_wrong_numel_and_bad_index) {
    three t;
    make_three(&t, 0);
    const char *p = tmp_path("numel.safetensors");
    CHECK(cf_st_write(p, t.items, 3, CF_DT_F32) == 0);
    cf_st_archive a;
    CHECK(cf_st_open(&a, p) == 0);
    float out[8];
    int k = cf_st_find(&a, "model.embed_tokens.weight");
    CHECK(cf_st_read_f32(&a, k, out, 5) == -1 && err_has(p) && err_has("6 elements"));
    CHECK(cf_st_read_f32(&a, 99, out, 6) == -1);
    CHECK(cf_st_read_f32(&a, -1, out, 6) == -1);
    cf_st_close(&a);
}

TEST(safetensors_open_rejects_missing_paths_and_empty_dirs) {
    const char *p = tmp_path("missing.safetensors");
    CHECK_OPEN_FAILS(p, "cannot open");
    const char *d = fresh_dir("empty_dir");
    CHECK_OPEN_FAILS(d, "no model.safetensors");
}

/* --------------------------------------------------------------- bad index */

static void write_text(const char *path, const char *s) { write_bytes(path, s, strlen(s)); }

TEST(safetensors_index_rejects_missing_shard_and_unlisted_tensors) {
    three t;
    make_three(&t, 0);
    const char *d = fresh_dir("idx");
    CHECK(cf_st_write(tmp_path("idx/s1.safetensors"), t.items, 2, CF_DT_F32) == 0);
    const char *idx = tmp_path("idx/model.safetensors.index.json");
    /* a correct hand-written index (no save id: foreign checkpoints have none) */
    write_text(idx, "{\"metadata\":{\"total_size\":40},\"weight_map\":{"
                    "\"model.embed_tokens.weight\":\"s1.safetensors\",\"model.norm.weight\":\"s1.safetensors\"}}");
    cf_st_archive a;
    CHECK(cf_st_open(&a, d) == 0);
    cf_st_close(&a);
    /* a shard that does not exist */
    write_text(idx, "{\"weight_map\":{\"model.embed_tokens.weight\":\"s1.safetensors\","
                    "\"model.norm.weight\":\"s2.safetensors\"}}");
    CHECK(cf_st_open(&a, d) == -1 && err_has("s2.safetensors") && err_has("cannot open"));
    /* a tensor the map lists but the file lacks */
    write_text(idx, "{\"weight_map\":{\"model.embed_tokens.weight\":\"s1.safetensors\","
                    "\"model.norm.weight\":\"s1.safetensors\",\"lm_head.weight\":\"s1.safetensors\"}}");
    CHECK(cf_st_open(&a, d) == -1 && err_has(idx) && err_has("'lm_head.weight'") && err_has("no such tensor"));
    /* a tensor in the file the map does not list */
    write_text(idx, "{\"weight_map\":{\"model.embed_tokens.weight\":\"s1.safetensors\"}}");
    CHECK(cf_st_open(&a, d) == -1 && err_has(idx) && err_has("not in the weight_map"));
}

TEST(safetensors_index_rejects_path_traversal_and_malformed_maps) {
    const char *d = fresh_dir("idx2");
    const char *idx = tmp_path("idx2/model.safetensors.index.json");
    cf_st_archive a;
    write_text(idx, "{\"weight_map\":{\"w\":\"../secret.safetensors\"}}");
    CHECK(cf_st_open(&a, d) == -1 && err_has(idx) && err_has("plain file name"));
    write_text(idx, "{\"weight_map\":{\"w\":\"/etc/passwd\"}}");
    CHECK(cf_st_open(&a, d) == -1 && err_has("plain file name"));
    write_text(idx, "{\"weight_map\":{\"w\":3}}");
    CHECK(cf_st_open(&a, d) == -1 && err_has(idx));
    write_text(idx, "{\"metadata\":{}}");
    CHECK(cf_st_open(&a, d) == -1 && err_has("weight_map"));
    write_text(idx, "{\"weight_map\":{}}");
    CHECK(cf_st_open(&a, d) == -1 && err_has("empty"));
    write_text(idx, "{\"weight_map\":");
    CHECK(cf_st_open(&a, d) == -1 && err_has("not valid JSON"));
}

TEST(safetensors_index_rejects_same_tensor_in_two_shards) {
    three t;
    make_three(&t, 0);
    const char *d = fresh_dir("idx3");
    CHECK(cf_st_write(tmp_path("idx3/s1.safetensors"), t.items, 2, CF_DT_F32) == 0);
    CHECK(cf_st_write(tmp_path("idx3/s2.safetensors"), t.items + 1, 2, CF_DT_F32) == 0);
    write_text(tmp_path("idx3/model.safetensors.index.json"),
               "{\"weight_map\":{\"model.embed_tokens.weight\":\"s1.safetensors\","
               "\"model.norm.weight\":\"s1.safetensors\",\"lm_head.weight\":\"s2.safetensors\"}}");
    cf_st_archive a;
    CHECK(cf_st_open(&a, d) == -1 && err_has("model.norm.weight") && err_has("s1.safetensors") &&
          err_has("s2.safetensors"));
}

TEST(safetensors_index_detects_shard_from_another_save) {
    three t;
    make_three(&t, 0);
    const char *d = fresh_dir("mixed");
    CHECK(cf_st_write_dir(d, t.items, 3, CF_DT_F32, 30) == 0);
    /* keep shard 1 of the first save, then save again (new id) */
    const char *s1 = tmp_path("mixed/model-00001-of-00002.safetensors");
    size_t len;
    char *old = cf_read_file(s1, &len, 1 << 20);
    CHECK(old != NULL);
    CHECK(cf_st_write_dir(d, t.items, 3, CF_DT_F32, 30) == 0);
    /* that save did not overwrite the files of the first (its shards carry
     * its id in their names); a third one uses HF's names again */
    CHECK(cf_st_write_dir(d, t.items, 3, CF_DT_F32, 30) == 0);
    cf_st_archive a;
    CHECK(cf_st_open(&a, d) == 0);
    cf_st_close(&a);
    /* an interrupted save: the old shard 1 beside the new index */
    if (old) write_bytes(s1, old, len);
    free(old);
    CHECK(cf_st_open(&a, d) == -1 && err_has("different save") && err_has("model-00001-of-00002"));
}

/* Random corruptions of a valid file: open and read must either succeed or
 * fail with a message naming the file; ASan/UBSan watch for the rest. */
TEST(safetensors_fuzzed_files_never_crash) {
    three t;
    make_three(&t, 0);
    const char *good = tmp_path("fuzz_good.safetensors"), *p = tmp_path("fuzz.safetensors");
    CHECK(cf_st_write(good, t.items, 3, CF_DT_BF16) == 0);
    size_t len;
    unsigned char *orig = (unsigned char *)cf_read_file(good, &len, 1 << 20);
    unsigned char *buf = malloc(len);
    uint64_t s = 0x9e3779b97f4a7c15ull;
    int unnamed = 0, opened = 0;
    for (int iter = 0; iter < 3000; iter++) {
        memcpy(buf, orig, len);
        size_t n = len;
        int flips = 1 + iter % 4;
        for (int f = 0; f < flips; f++) {
            s ^= s << 13; s ^= s >> 7; s ^= s << 17;
            size_t at = (size_t)(s % (iter % 3 == 0 ? 8 : len));   /* a third hit the length field */
            buf[at] = (unsigned char)(s >> 40);
        }
        if (iter % 5 == 0) n = (size_t)(s % len);   /* also truncate */
        write_bytes(p, buf, n);
        cf_st_archive a;
        if (cf_st_open(&a, p) != 0) { if (!err_has(p) || strchr(cf_last_error(), '\n')) unnamed++; continue; }
        opened++;
        for (int i = 0; i < a.ntensors; i++) {
            size_t numel = (size_t)((a.tensors[i].end - a.tensors[i].begin) / cf_dtype_size(a.tensors[i].dtype));
            if (numel > (1u << 20)) continue;
            float *out = malloc((numel ? numel : 1) * sizeof *out);
            if (cf_st_read_f32(&a, i, out, numel) != 0 && !err_has(p)) unnamed++;
            free(out);
        }
        cf_st_close(&a);
    }
    free(buf);
    free(orig);
    CHECK_MSG(unnamed == 0, "%d failures did not name the file in one line", unnamed);
    CHECK(opened > 0);   /* some mutations (data bytes) are still valid files */
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/cf_test_st_XXXXXX");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }

    RUN(safetensors_bf16_conversion_rounds_to_nearest_even);
    RUN(safetensors_f16_conversion_is_exact_for_all_65536_values);
    RUN(safetensors_dtype_names_and_sizes);
    RUN(safetensors_f32_round_trip_is_exact);
    RUN(safetensors_bf16_round_trip_is_exact_for_bf16_values);
    RUN(safetensors_bf16_write_rounds_values_to_nearest_even);
    RUN(safetensors_f16_file_is_read_into_fp32);
    RUN(safetensors_large_tensor_round_trips_across_conversion_chunks);
    RUN(safetensors_scalar_and_empty_tensors_round_trip);
    RUN(safetensors_written_header_is_aligned_contiguous_and_has_format_pt);
    RUN(safetensors_find_returns_index_or_minus_one);
    RUN(safetensors_open_directory_reads_model_safetensors);
    RUN(safetensors_sharded_write_and_read_round_trip);
    RUN(safetensors_sharded_bf16_with_one_oversized_tensor_per_shard);
    RUN(safetensors_open_directory_prefers_the_index_over_model_safetensors);
    RUN(safetensors_single_write_removes_stale_index_and_shards);
    RUN(safetensors_sharded_write_removes_stale_single_file_and_extra_shards);
    RUN(safetensors_atomic_writes_leave_no_temp_files);
    RUN(safetensors_write_rejects_bad_items_and_writes_nothing);
    RUN(safetensors_rejects_file_shorter_than_8_bytes);
    RUN(safetensors_rejects_header_longer_than_file);
    RUN(safetensors_rejects_truncated_file);
    RUN(safetensors_read_detects_file_truncated_after_open);
    RUN(safetensors_rejects_bad_json);
    RUN(safetensors_rejects_unsupported_dtype);
    RUN(safetensors_rejects_shape_that_does_not_match_the_byte_size);
    RUN(safetensors_rejects_offsets_beyond_data_or_reversed);
    RUN(safetensors_rejects_overlapping_offsets);
    RUN(safetensors_rejects_duplicate_names);
    RUN(safetensors_rejects_more_than_8_dims_and_long_names);
    RUN(safetensors_read_rejects_wrong_numel_and_bad_index);
    RUN(safetensors_open_rejects_missing_paths_and_empty_dirs);
    RUN(safetensors_index_rejects_missing_shard_and_unlisted_tensors);
    RUN(safetensors_index_rejects_path_traversal_and_malformed_maps);
    RUN(safetensors_index_rejects_same_tensor_in_two_shards);
    RUN(safetensors_index_detects_shard_from_another_save);
    RUN(safetensors_fuzzed_files_never_crash);

    nftw(g_dir, rm_entry, 8, FTW_DEPTH | FTW_PHYS);
    return test_summary();
}
