/*
 * safetensors.c — reading and writing HF safetensors files (single or
 * sharded with model.safetensors.index.json).
 *
 * File layout: 8-byte little-endian header length N, N bytes of JSON
 *   {"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets"}}
 * then the data section; data_offsets are [begin, end) within it.
 *
 * Reading trusts nothing: every size from the file is checked against the
 * file's real size before it is used, and each problem is one cf_fail line
 * that names the file. Only headers are read at open; tensor data is read
 * with pread when asked for, so opening a 16 GB checkpoint costs nothing.
 *
 * The reader is deliberately a little more lenient than the reference
 * loader in one way only: gaps between tensors and bytes after the last
 * one are allowed (harmless: nothing reads them). Overlaps, offsets past
 * the end and size/shape mismatches are errors.
 *
 * Writing follows the reference implementation's layout (header padded with
 * spaces to an 8-byte boundary, tensors back to back with no gaps, so the
 * Rust loader's strict checks pass) and is atomic per file.
 *
 * Sharded saves stamp one random "centrifuge_save_id" into the index and
 * into every shard's __metadata__. Shard files keep HF's fixed names, so an
 * interrupted re-save can leave new shards beside an old index; the stamp
 * turns that silent mix of two checkpoints into a clear error at load.
 */
#include "base/common.h"
#include "formats/json_util.h"
#include "formats/io.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors I/O assumes a little-endian host"
#endif

#define ST_MAX_HEADER  (100ull << 20)   /* the reference implementation's limit */
#define ST_MAX_INDEX   (64u << 20)
#define ST_MAX_TENSORS (1 << 20)
#define ST_MAX_FILES   100000
#define ST_MAX_SAFE_INT 9007199254740992.0   /* 2^53: larger JSON numbers lose bits */
#define ST_SAVE_ID_KEY "centrifuge_save_id"
#define ST_SINGLE_NAME "model.safetensors"
#define ST_INDEX_NAME  "model.safetensors.index.json"
#define ST_CHUNK 65536                   /* elements converted per step */

/* ------------------------------------------------------------------ dtypes */

const char *cf_dtype_name(cf_dtype d) {
    switch (d) {
    case CF_DT_F32: return "F32";
    case CF_DT_F16: return "F16";
    case CF_DT_BF16: return "BF16";
    }
    return "?";
}

size_t cf_dtype_size(cf_dtype d) {
    switch (d) {
    case CF_DT_F32: return 4;
    case CF_DT_F16: return 2;
    case CF_DT_BF16: return 2;
    }
    return 0;
}

static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

float cf_bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t cf_f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    /* NaN must stay NaN: rounding could carry its payload into the
     * exponent and turn it into infinity. Keep the sign, make it quiet. */
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    /* Round to nearest, ties to even: add 0x7fff plus the lowest kept bit. */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float cf_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0) {
        /* zero or subnormal: mant * 2^-24, exact in fp32 */
        float v = (float)mant * 0x1p-24f;
        return sign ? -v : v;
    }
    if (exp == 31) return bits_f32(sign | 0x7f800000u | (mant << 13));   /* inf / NaN */
    return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

/* ---------------------------------------------------------------- helpers */

/* pread until n bytes or EOF; returns bytes read or -1 (errno set). */
static ssize_t pread_full(int fd, void *buf, size_t n, uint64_t off) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, (char *)buf + got, n - got, (off_t)(off + got));
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (r == 0) break;
        got += (size_t)r;
    }
    return (ssize_t)got;
}


/* A JSON number that is an exact non-negative integer below 2^53. */
static int json_u64(const cJSON *v, uint64_t *out) {
    if (!cJSON_IsNumber(v)) return -1;
    double d = v->valuedouble;
    if (!(d >= 0 && d <= ST_MAX_SAFE_INT) || d != floor(d)) return -1;
    *out = (uint64_t)d;
    return 0;
}

/* Parses JSON text of exactly len bytes: one value, then only whitespace. */
static cJSON *parse_json(const char *path, const char *what, const char *buf, size_t len) {
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(buf, len, &end, 0);
    if (!root) {
        const char *at = end ? end : cJSON_GetErrorPtr();
        long off = (at && at >= buf && at <= buf + len) ? (long)(at - buf) : -1;
        cf_fail("%s: %s is not valid JSON (error near byte %ld)", path, what, off);
        return NULL;
    }
    for (const char *p = end; p < buf + len; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            cJSON_Delete(root);
            cf_fail("%s: %s is not valid JSON (trailing data at byte %ld)", path, what, (long)(p - buf));
            return NULL;
        }
    if (!cJSON_IsObject(root)) {
        cf_fail("%s: %s must be a JSON object, got %s", path, what, cf_json_kind(root));
        cJSON_Delete(root);
        return NULL;
    }
    return root;
}

/* Writes "[2, 3]" into out, for messages. */
static void fmt_shape(char *out, size_t cap, const int64_t *shape, int ndim) {
    size_t n = (size_t)snprintf(out, cap, "[");
    for (int d = 0; d < ndim && n < cap; d++)
        n += (size_t)snprintf(out + n, cap - n, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (n < cap) snprintf(out + n, cap - n, "]");
}

/* numel of a shape, failing on overflow of uint64. */
static int shape_numel(const int64_t *shape, int ndim, uint64_t *out) {
    uint64_t n = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0) return -1;
        if (__builtin_mul_overflow(n, (uint64_t)shape[d], &n)) return -1;
    }
    *out = n;
    return 0;
}

static int cmp_tensor_name(const void *a, const void *b) {
    return strcmp(((const cf_st_tensor *)a)->name, ((const cf_st_tensor *)b)->name);
}

/* -------------------------------------------------------------- archive */

void cf_st_close(cf_st_archive *a) {
    if (!a) return;
    for (int i = 0; i < a->nfiles; i++) free(a->files[i]);
    free(a->files);
    free(a->data_offset);
    free(a->tensors);
    memset(a, 0, sizeof *a);
}

static int archive_add_file(cf_st_archive *a, const char *path) {
    if (a->nfiles >= ST_MAX_FILES) return cf_fail("%s: more than %d files", path, ST_MAX_FILES);
    char **files = realloc(a->files, (size_t)(a->nfiles + 1) * sizeof *files);
    if (!files) return cf_fail("out of memory");
    a->files = files;
    uint64_t *offs = realloc(a->data_offset, (size_t)(a->nfiles + 1) * sizeof *offs);
    if (!offs) return cf_fail("out of memory");
    a->data_offset = offs;
    char *copy = strdup(path);
    if (!copy) return cf_fail("out of memory");
    a->files[a->nfiles] = copy;
    a->data_offset[a->nfiles] = 0;
    return a->nfiles++;
}

/* Parses one tensor entry of a header into t. data_size bounds the offsets. */
static int parse_tensor(const char *path, const cJSON *e, uint64_t data_size, cf_st_tensor *t) {
    const char *name = e->string ? e->string : "";
    size_t nlen = strlen(name);
    memset(t, 0, sizeof *t);
    if (nlen == 0) return cf_fail("%s: a tensor has an empty name", path);
    char safe[64];
    if (nlen >= CF_ST_MAX_NAME)
        return cf_fail("%s: tensor name '%.40s...' is %zu bytes, longer than the limit of %d", path,
                       cf_printable(name, safe, sizeof safe), nlen, CF_ST_MAX_NAME - 1);
    for (size_t i = 0; i < nlen; i++)   /* names go into one-line messages */
        if ((unsigned char)name[i] < 0x20 || name[i] == 0x7f)
            return cf_fail("%s: tensor name '%s' contains control characters", path,
                           cf_printable(name, safe, sizeof safe));
    memcpy(t->name, name, nlen + 1);
    if (!cJSON_IsObject(e))
        return cf_fail("%s: tensor '%s': expected an object, got %s", path, name, cf_json_kind(e));

    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    if (!cJSON_IsString(dt))
        return cf_fail("%s: tensor '%s': 'dtype' missing or not a string", path, name);
    if (strcmp(dt->valuestring, "F32") == 0) t->dtype = CF_DT_F32;
    else if (strcmp(dt->valuestring, "F16") == 0) t->dtype = CF_DT_F16;
    else if (strcmp(dt->valuestring, "BF16") == 0) t->dtype = CF_DT_BF16;
    else
        return cf_fail("%s: tensor '%s': unsupported dtype '%s' (supported: F32, F16, BF16)", path, name,
                       cf_printable(dt->valuestring, safe, 17));

    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(e, "shape");
    if (!cJSON_IsArray(sh)) return cf_fail("%s: tensor '%s': 'shape' missing or not an array", path, name);
    int ndim = cJSON_GetArraySize(sh);
    if (ndim > CF_ST_MAX_DIMS)
        return cf_fail("%s: tensor '%s': shape has %d dimensions, more than the supported %d", path, name,
                       ndim, CF_ST_MAX_DIMS);
    int d = 0;
    for (const cJSON *x = sh->child; x; x = x->next, d++) {
        uint64_t v;
        if (json_u64(x, &v) != 0)
            return cf_fail("%s: tensor '%s': shape[%d] is not a non-negative integer", path, name, d);
        t->shape[d] = (int64_t)v;
    }
    t->ndim = ndim;
    uint64_t numel, nbytes;
    if (shape_numel(t->shape, ndim, &numel) != 0 ||
        __builtin_mul_overflow(numel, (uint64_t)cf_dtype_size(t->dtype), &nbytes))
        return cf_fail("%s: tensor '%s': shape is too large", path, name);

    const cJSON *off = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!cJSON_IsArray(off) || cJSON_GetArraySize(off) != 2 || json_u64(off->child, &t->begin) != 0 ||
        json_u64(off->child->next, &t->end) != 0)
        return cf_fail("%s: tensor '%s': 'data_offsets' must be two non-negative integers", path, name);
    if (t->begin > t->end)
        return cf_fail("%s: tensor '%s': data_offsets [%llu, %llu] begin after they end", path, name,
                       (unsigned long long)t->begin, (unsigned long long)t->end);
    if (t->end > data_size)
        return cf_fail("%s: tensor '%s': data_offsets [%llu, %llu] go beyond the data section (%llu bytes); "
                       "truncated file?", path, name, (unsigned long long)t->begin,
                       (unsigned long long)t->end, (unsigned long long)data_size);
    if (t->end - t->begin != nbytes) {
        char s[160];
        fmt_shape(s, sizeof s, t->shape, ndim);
        return cf_fail("%s: tensor '%s': shape %s in %s needs %llu bytes, but data_offsets span %llu", path,
                       name, s, cf_dtype_name(t->dtype), (unsigned long long)nbytes,
                       (unsigned long long)(t->end - t->begin));
    }
    return 0;
}

/* __metadata__ must map strings to strings (as in the reference loader).
 * Copies our save id, if present, into save_id ("" if absent). */
static int parse_metadata(const char *path, const cJSON *m, char *save_id, size_t cap) {
    save_id[0] = 0;
    if (!cJSON_IsObject(m)) return cf_fail("%s: __metadata__ must be an object, got %s", path, cf_json_kind(m));
    for (const cJSON *e = m->child; e; e = e->next) {
        if (!cJSON_IsString(e))
        {
            char safe[65];
            return cf_fail("%s: __metadata__ value '%s' must be a string, got %s", path,
                           cf_printable(e->string ? e->string : "", safe, sizeof safe), cf_json_kind(e));
        }
        if (e->string && strcmp(e->string, ST_SAVE_ID_KEY) == 0)
            snprintf(save_id, cap, "%s", e->valuestring);
    }
    return 0;
}

typedef struct { uint64_t begin, end; const char *name; } st_range;

static int cmp_range(const void *a, const void *b) {
    const st_range *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* No two non-empty tensors of one file may share a byte. */
static int check_overlaps(const char *path, const cf_st_tensor *t, int n) {
    if (n < 2) return 0;
    st_range *r = cf_malloc((size_t)n * sizeof *r);
    if (!r) return -1;
    int m = 0;
    for (int i = 0; i < n; i++)
        if (t[i].end > t[i].begin) r[m++] = (st_range){t[i].begin, t[i].end, t[i].name};
    qsort(r, (size_t)m, sizeof *r, cmp_range);
    int rc = 0;
    for (int i = 1; i < m && rc == 0; i++)
        if (r[i].begin < r[i - 1].end)
            rc = cf_fail("%s: tensors '%s' [%llu, %llu) and '%s' [%llu, %llu) overlap", path, r[i - 1].name,
                         (unsigned long long)r[i - 1].begin, (unsigned long long)r[i - 1].end, r[i].name,
                         (unsigned long long)r[i].begin, (unsigned long long)r[i].end);
    free(r);
    return rc;
}

/* Reads and validates the header of one .safetensors file, appending its
 * tensors to the archive as file index fi. */
static int parse_file(cf_st_archive *a, int fi, char *save_id, size_t save_id_cap) {
    const char *path = a->files[fi];
    char *buf = NULL;
    cJSON *root = NULL;
    int rc = -1;
    int64_t fsize = 0;
    int fd = cf_open_input(path, &fsize);   /* a regular file; registered while parsed */
    if (fd < 0) return -1;
    uint64_t size = (uint64_t)fsize;
    if (size < 8) {
        cf_fail("%s: file has %llu bytes, too short for a safetensors header", path, (unsigned long long)size);
        goto done;
    }
    unsigned char lenbuf[8];
    if (pread_full(fd, lenbuf, 8, 0) != 8) { cf_fail("%s: cannot read the header length", path); goto done; }
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | lenbuf[i];
    if (n > size - 8) {
        cf_fail("%s: header length %llu goes beyond the end of the file (%llu bytes); truncated or not "
                "a safetensors file", path, (unsigned long long)n, (unsigned long long)size);
        goto done;
    }
    if (n > ST_MAX_HEADER) {
        cf_fail("%s: header length %llu is over the limit of %llu bytes", path, (unsigned long long)n,
                (unsigned long long)ST_MAX_HEADER);
        goto done;
    }
    if (n < 2) { cf_fail("%s: header length %llu is too short for a JSON header", path, (unsigned long long)n); goto done; }
    buf = cf_malloc((size_t)n + 1);
    if (!buf) goto done;
    if (pread_full(fd, buf, (size_t)n, 8) != (ssize_t)n) { cf_fail("%s: cannot read the header", path); goto done; }
    buf[n] = 0;
    if (buf[0] != '{') { cf_fail("%s: header does not start with '{'; not a safetensors file", path); goto done; }
    root = parse_json(path, "header", buf, (size_t)n);
    if (!root) goto done;
    /* cJSON cuts a string at a NUL: "a\u0000b" would load as tensor "a" */
    if (cf_json_check_nul(path, "header", buf, (size_t)n) != 0) goto done;

    uint64_t data_size = size - 8 - n;
    a->data_offset[fi] = 8 + n;
    int count = 0;
    for (const cJSON *e = root->child; e; e = e->next) count++;
    if (count > ST_MAX_TENSORS) { cf_fail("%s: %d header entries, more than the limit of %d", path, count, ST_MAX_TENSORS); goto done; }
    if (a->ntensors > ST_MAX_TENSORS - count) { cf_fail("%s: too many tensors in total", path); goto done; }
    cf_st_tensor *grown = realloc(a->tensors, (size_t)(a->ntensors + count + 1) * sizeof *grown);
    if (!grown) { cf_fail("out of memory reading %s", path); goto done; }
    a->tensors = grown;

    int first = a->ntensors;
    save_id[0] = 0;
    int have_meta = 0;
    for (const cJSON *e = root->child; e; e = e->next) {
        if (e->string && strcmp(e->string, "__metadata__") == 0) {
            if (have_meta++) { cf_fail("%s: duplicate __metadata__", path); goto done; }
            if (parse_metadata(path, e, save_id, save_id_cap) != 0) goto done;
            continue;
        }
        cf_st_tensor *t = &a->tensors[a->ntensors];
        if (parse_tensor(path, e, data_size, t) != 0) goto done;
        t->file = fi;
        a->ntensors++;
    }
    if (check_overlaps(path, a->tensors + first, a->ntensors - first) != 0) goto done;
    rc = 0;
done:
    cJSON_Delete(root);
    free(buf);
    close(fd);
    cf_input_release(path);
    return rc;
}

/* Sorts tensors by name (cf_st_find is a binary search) and refuses
 * duplicate names, within a file or across shards. */
static int sort_and_check_names(cf_st_archive *a) {
    if (a->ntensors > 1) qsort(a->tensors, (size_t)a->ntensors, sizeof *a->tensors, cmp_tensor_name);
    for (int i = 1; i < a->ntensors; i++) {
        const cf_st_tensor *x = &a->tensors[i - 1], *y = &a->tensors[i];
        if (strcmp(x->name, y->name) != 0) continue;
        if (x->file == y->file) return cf_fail("%s: duplicate tensor name '%s'", a->files[x->file], x->name);
        return cf_fail("%s and %s: both hold a tensor named '%s'", a->files[x->file], a->files[y->file], x->name);
    }
    return 0;
}

static int open_single(cf_st_archive *a, const char *path) {
    char save_id[64];
    int fi = archive_add_file(a, path);
    if (fi < 0) return -1;
    if (parse_file(a, fi, save_id, sizeof save_id) != 0) return -1;
    return sort_and_check_names(a);
}

/* A shard name from an index must be a plain file name in the same
 * directory: no separators, no "..", nothing that escapes the model dir. */
static int check_shard_name(const char *index_path, const char *name) {
    size_t n = strlen(name);
    int bad = n == 0 || n >= 256 || strchr(name, '/') || strcmp(name, ".") == 0 || strcmp(name, "..") == 0;
    for (size_t i = 0; i < n && !bad; i++) bad = (unsigned char)name[i] < 0x20 || name[i] == 0x7f;
    char safe[65];
    if (bad)
        return cf_fail("%s: weight_map names an invalid shard file '%s' (must be a plain file name)",
                       index_path, cf_printable(name, safe, sizeof safe));
    return 0;
}

typedef struct { const char *tensor, *file; } st_entry;

static int cmp_entry_tensor(const void *a, const void *b) {
    return strcmp(((const st_entry *)a)->tensor, ((const st_entry *)b)->tensor);
}
static int cmp_entry_file(const void *a, const void *b) {
    return strcmp(((const st_entry *)a)->file, ((const st_entry *)b)->file);
}

static const char *base_name(const char *path) {
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

static int open_index(cf_st_archive *a, const char *index_path) {
    size_t len = 0;
    char *buf = cf_read_input(index_path, &len, ST_MAX_INDEX);
    if (!buf) return -1;
    cJSON *root = parse_json(index_path, "index", buf, len);
    if (root && cf_json_check_nul(index_path, "index", buf, len) != 0) {
        cJSON_Delete(root);
        root = NULL;
    }
    st_entry *ents = NULL, *byfile = NULL;
    int rc = -1;
    if (!root) goto done;

    /* The directory the shards live in. */
    char dir[4096];
    const char *slash = strrchr(index_path, '/');
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if ((size_t)(slash - index_path) >= sizeof dir) { cf_fail("%s: path too long", index_path); goto done; }
    else if (slash == index_path) snprintf(dir, sizeof dir, "/");
    else snprintf(dir, sizeof dir, "%.*s", (int)(slash - index_path), index_path);

    const char *index_id = NULL;
    const cJSON *meta = cJSON_GetObjectItemCaseSensitive(root, "metadata");
    if (meta && !cJSON_IsNull(meta)) {
        if (!cJSON_IsObject(meta)) { cf_fail("%s: 'metadata' must be an object, got %s", index_path, cf_json_kind(meta)); goto done; }
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(meta, ST_SAVE_ID_KEY);
        if (cJSON_IsString(id)) index_id = id->valuestring;
    }
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(wm)) {
        cf_fail("%s: 'weight_map' missing or not an object", index_path);
        goto done;
    }
    int n = cJSON_GetArraySize(wm);
    if (n > ST_MAX_TENSORS) { cf_fail("%s: weight_map has more than %d entries", index_path, ST_MAX_TENSORS); goto done; }
    ents = cf_malloc((size_t)(n ? n : 1) * sizeof *ents);
    byfile = cf_malloc((size_t)(n ? n : 1) * sizeof *byfile);
    if (!ents || !byfile) goto done;
    int k = 0;
    for (const cJSON *e = wm->child; e; e = e->next, k++) {
        char safe[65];
        if (!cJSON_IsString(e)) {
            cf_fail("%s: weight_map['%s'] must be a file name, got %s", index_path,
                    cf_printable(e->string ? e->string : "", safe, sizeof safe), cf_json_kind(e));
            goto done;
        }
        if (check_shard_name(index_path, e->valuestring) != 0) goto done;
        ents[k] = (st_entry){e->string ? e->string : "", e->valuestring};
    }
    if (n == 0) { cf_fail("%s: weight_map is empty", index_path); goto done; }

    /* Open each distinct shard once, in file-name order. */
    memcpy(byfile, ents, (size_t)n * sizeof *ents);
    qsort(byfile, (size_t)n, sizeof *byfile, cmp_entry_file);
    for (int i = 0; i < n; i++) {
        if (i > 0 && strcmp(byfile[i].file, byfile[i - 1].file) == 0) continue;
        char path[4096 + 256];
        if (cf_path_join(path, sizeof path, dir, byfile[i].file) != 0) goto done;
        int fi = archive_add_file(a, path);
        if (fi < 0) goto done;
        char shard_id[64];
        if (parse_file(a, fi, shard_id, sizeof shard_id) != 0) goto done;
        if (index_id && strcmp(shard_id, index_id) != 0) {
            cf_fail("%s: shard %s was written by a different save than the index (an interrupted save?); "
                    "the checkpoint mixes two saves", index_path, byfile[i].file);
            goto done;
        }
    }
    if (sort_and_check_names(a) != 0) goto done;

    /* The weight_map and the shards must list exactly the same tensors,
     * each in the file the map names. Both lists are sorted by name. */
    qsort(ents, (size_t)n, sizeof *ents, cmp_entry_tensor);
    for (int i = 1; i < n; i++)
        if (strcmp(ents[i].tensor, ents[i - 1].tensor) == 0) {
            char safe[201];
            cf_fail("%s: duplicate weight_map entry '%s'", index_path, cf_printable(ents[i].tensor, safe, sizeof safe));
            goto done;
        }
    int i = 0, j = 0;
    while (i < n || j < a->ntensors) {
        int c = i >= n ? 1 : j >= a->ntensors ? -1 : strcmp(ents[i].tensor, a->tensors[j].name);
        char safe[201];
        if (c < 0) {
            cf_fail("%s: weight_map says '%s' is in %s, but that file has no such tensor", index_path,
                    cf_printable(ents[i].tensor, safe, sizeof safe), ents[i].file);
            goto done;
        }
        if (c > 0) {
            cf_fail("%s: tensor '%s' is in %s but not in the weight_map", index_path, a->tensors[j].name,
                    a->files[a->tensors[j].file]);
            goto done;
        }
        if (strcmp(ents[i].file, base_name(a->files[a->tensors[j].file])) != 0) {
            cf_fail("%s: weight_map says '%s' is in %s, but that file has no such tensor", index_path,
                    cf_printable(ents[i].tensor, safe, sizeof safe), ents[i].file);
            goto done;
        }
        i++, j++;
    }
    rc = 0;
done:
    free(ents);
    free(byfile);
    cJSON_Delete(root);
    free(buf);
    return rc;
}

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

int cf_st_open(cf_st_archive *a, const char *path) {
    if (!a || !path) return cf_fail("safetensors: NULL argument");
    memset(a, 0, sizeof *a);
    struct stat st;
    if (stat(path, &st) != 0) return cf_fail("%s: cannot open: %s", path, strerror(errno));
    int rc;
    if (S_ISDIR(st.st_mode)) {
        char p[4096 + 64];
        if (cf_path_join(p, sizeof p, path, ST_INDEX_NAME) != 0) return -1;
        if (cf_path_exists(p)) rc = open_index(a, p);
        else {
            if (cf_path_join(p, sizeof p, path, ST_SINGLE_NAME) != 0) return -1;
            if (!cf_path_exists(p))
                return cf_fail("%s: no %s or %s in this directory", path, ST_SINGLE_NAME, ST_INDEX_NAME);
            rc = open_single(a, p);
        }
    } else if (ends_with(path, ".json")) {
        rc = open_index(a, path);
    } else {
        rc = open_single(a, path);
    }
    if (rc != 0) cf_st_close(a);
    return rc;
}

int cf_st_find(const cf_st_archive *a, const char *name) {
    if (!a || !name) return -1;
    int lo = 0, hi = a->ntensors - 1;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        int c = strcmp(a->tensors[mid].name, name);
        if (c == 0) return mid;
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return -1;
}

int cf_st_read_f32(const cf_st_archive *a, int i, float *out, size_t numel) {
    if (!a || i < 0 || i >= a->ntensors) return cf_fail("safetensors: tensor index %d out of range", i);
    const cf_st_tensor *t = &a->tensors[i];
    const char *path = a->files[t->file];
    size_t es = cf_dtype_size(t->dtype);
    uint64_t have = (t->end - t->begin) / es;
    if (have != numel)
        return cf_fail("%s: tensor '%s' has %llu elements, but %zu were asked for", path, t->name,
                       (unsigned long long)have, numel);
    if (numel == 0) return 0;
    if (!out) return cf_fail("%s: tensor '%s': NULL output buffer", path, t->name);

    int fd = cf_open_input(path, NULL);
    if (fd < 0) return -1;
    uint64_t off = a->data_offset[t->file] + t->begin;
    int rc = 0;
    errno = 0;
    if (t->dtype == CF_DT_F32) {
        ssize_t r = pread_full(fd, out, numel * 4, off);
        if (r != (ssize_t)(numel * 4)) rc = -1;
    } else {
        uint16_t *tmp = cf_malloc(ST_CHUNK * sizeof *tmp);
        if (!tmp) { close(fd); cf_input_release(path); return -1; }
        for (size_t done = 0; done < numel && rc == 0; done += ST_CHUNK) {
            size_t m = CF_MIN((size_t)ST_CHUNK, numel - done);
            if (pread_full(fd, tmp, m * 2, off + done * 2) != (ssize_t)(m * 2)) { rc = -1; break; }
            if (t->dtype == CF_DT_BF16) for (size_t k = 0; k < m; k++) out[done + k] = cf_bf16_to_f32(tmp[k]);
            else for (size_t k = 0; k < m; k++) out[done + k] = cf_f16_to_f32(tmp[k]);
        }
        free(tmp);
    }
    int e = errno;
    close(fd);
    cf_input_release(path);
    if (rc != 0)
        return cf_fail("%s: tensor '%s': cannot read its data (%s); was the file truncated after opening?",
                       path, t->name, e ? strerror(e) : "short read");
    return 0;
}

/* ----------------------------------------------------------------- writing */


/* Names we write are printable ASCII, so JSON escaping is just " and \. */
static void sb_json_string(cf_sbuf *b, const char *s) {
    cf_sb_printf(b, "\"");
    for (; *s; s++) {
        if (*s == '"' || *s == '\\') cf_sb_printf(b, "\\%c", *s);
        else cf_sb_printf(b, "%c", *s);
    }
    cf_sb_printf(b, "\"");
}

static uint64_t item_numel(const cf_st_item *it) {
    uint64_t n = 1;
    for (int d = 0; d < it->ndim; d++) n *= (uint64_t)it->shape[d];
    return n;
}

static int cmp_cstr(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Checks everything about the items before a single byte is written. */
static int validate_items(const char *path, const cf_st_item *items, int n, cf_dtype dtype) {
    if (dtype != CF_DT_F32 && dtype != CF_DT_BF16)
        return cf_fail("%s: cannot write dtype %s (F32 or BF16 only)", path, cf_dtype_name(dtype));
    if (n < 0 || n > ST_MAX_TENSORS) return cf_fail("%s: invalid tensor count %d", path, n);
    if (n > 0 && !items) return cf_fail("%s: NULL tensor list", path);
    uint64_t total = 0;
    for (int i = 0; i < n; i++) {
        const cf_st_item *it = &items[i];
        if (!it->name) return cf_fail("%s: tensor %d has no name", path, i);
        size_t len = strlen(it->name);
        if (len == 0 || len >= CF_ST_MAX_NAME)
            return cf_fail("%s: tensor %d: name length %zu is outside [1, %d]", path, i, len, CF_ST_MAX_NAME - 1);
        for (const char *c = it->name; *c; c++)
            if (*c < 0x20 || *c > 0x7e) {
                char safe[65];
                return cf_fail("%s: tensor '%s': names must be printable ASCII", path,
                               cf_printable(it->name, safe, sizeof safe));
            }
        if (strcmp(it->name, "__metadata__") == 0) return cf_fail("%s: '__metadata__' is not a tensor name", path);
        if (it->ndim < 0 || it->ndim > CF_ST_MAX_DIMS)
            return cf_fail("%s: tensor '%s': ndim %d is outside [0, %d]", path, it->name, it->ndim, CF_ST_MAX_DIMS);
        uint64_t numel, bytes;
        if (shape_numel(it->shape, it->ndim, &numel) != 0 ||
            __builtin_mul_overflow(numel, (uint64_t)cf_dtype_size(dtype), &bytes) ||
            __builtin_add_overflow(total, bytes, &total) || total > (uint64_t)ST_MAX_SAFE_INT)
            return cf_fail("%s: tensor '%s': negative or too large shape", path, it->name);
        if (numel > 0 && !it->data) return cf_fail("%s: tensor '%s': NULL data", path, it->name);
    }
    if (n < 2) return 0;
    const char **names = cf_malloc((size_t)n * sizeof *names);
    if (!names) return -1;
    for (int i = 0; i < n; i++) names[i] = items[i].name;
    qsort(names, (size_t)n, sizeof *names, cmp_cstr);
    int rc = 0;
    for (int i = 1; i < n && rc == 0; i++)
        if (strcmp(names[i], names[i - 1]) == 0) rc = cf_fail("%s: duplicate tensor name '%s'", path, names[i]);
    free(names);
    return rc;
}

/* Header JSON padded with spaces so the data section starts 8-aligned. */
static char *build_header(const cf_st_item *items, int n, cf_dtype dtype, const char *save_id, size_t *len) {
    cf_sbuf b = {0};
    cf_sb_printf(&b, "{\"__metadata__\":{\"format\":\"pt\"");
    if (save_id) cf_sb_printf(&b, ",\"" ST_SAVE_ID_KEY "\":\"%s\"", save_id);
    cf_sb_printf(&b, "}");
    uint64_t off = 0;
    for (int i = 0; i < n; i++) {
        uint64_t bytes = item_numel(&items[i]) * cf_dtype_size(dtype);
        cf_sb_printf(&b, ",");
        sb_json_string(&b, items[i].name);
        cf_sb_printf(&b, ":{\"dtype\":\"%s\",\"shape\":[", cf_dtype_name(dtype));
        for (int d = 0; d < items[i].ndim; d++) cf_sb_printf(&b, "%s%lld", d ? "," : "", (long long)items[i].shape[d]);
        cf_sb_printf(&b, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off, (unsigned long long)(off + bytes));
        off += bytes;
    }
    cf_sb_printf(&b, "}");
    while (!b.failed && (8 + b.len) % 8 != 0) cf_sb_printf(&b, " ");
    if (b.failed) {
        free(b.s);
        cf_fail("out of memory building a safetensors header");
        return NULL;
    }
    *len = b.len;
    return b.s;
}

static int write_data(cf_atomic_file *af, const cf_st_item *it, cf_dtype dtype) {
    uint64_t numel = item_numel(it);
    if (numel == 0) return 0;
    if (dtype == CF_DT_F32) return cf_atomic_write(af, it->data, (size_t)numel * 4);
    uint16_t *tmp = cf_malloc(ST_CHUNK * sizeof *tmp);
    if (!tmp) return -1;
    int rc = 0;
    for (uint64_t done = 0; done < numel && rc == 0; done += ST_CHUNK) {
        size_t m = (size_t)CF_MIN((uint64_t)ST_CHUNK, numel - done);
        for (size_t k = 0; k < m; k++) tmp[k] = cf_f32_to_bf16(it->data[done + k]);
        rc = cf_atomic_write(af, tmp, m * 2);
    }
    free(tmp);
    return rc;
}

/* Writes one file; items must already be validated. */
static int write_file(const char *path, const cf_st_item *items, int n, cf_dtype dtype, const char *save_id) {
    size_t hlen = 0;
    char *hdr = build_header(items, n, dtype, save_id, &hlen);
    if (!hdr) return -1;
    unsigned char lenbuf[8];
    for (int i = 0; i < 8; i++) lenbuf[i] = (unsigned char)((uint64_t)hlen >> (8 * i));
    cf_atomic_file af;
    if (cf_atomic_open(&af, path) != 0) { free(hdr); return -1; }
    int rc = cf_atomic_write(&af, lenbuf, 8);
    if (rc == 0) rc = cf_atomic_write(&af, hdr, hlen);
    for (int i = 0; i < n && rc == 0; i++) rc = write_data(&af, &items[i], dtype);
    free(hdr);
    if (rc != 0) { cf_atomic_abort(&af); return -1; }
    return cf_atomic_commit(&af);
}

int cf_st_write(const char *path, const cf_st_item *items, int n, cf_dtype dtype) {
    if (!path) return cf_fail("safetensors: NULL path");
    if (validate_items(path, items, n, dtype) != 0) return -1;
    return write_file(path, items, n, dtype, NULL);
}

/* "model-00001-of-00003.safetensors" (HF's names) or, when a re-save into
 * the same directory must not overwrite the files the current index names,
 * "model-00001-of-00003-<8 hex>.safetensors": returns 1 and sets k, total. */
static int is_shard_name(const char *name, int *k, int *total) {
    const char *pre = "model-", *mid = "-of-", *suf = ".safetensors";
    size_t len = strlen(name), base = 6 + 5 + 4 + 5;
    if (len != base + 12 && len != base + 9 + 12) return 0;
    if (strncmp(name, pre, 6) != 0 || strncmp(name + 11, mid, 4) != 0 || strcmp(name + len - 12, suf) != 0) return 0;
    if (len == base + 9 + 12) {
        if (name[base] != '-') return 0;
        for (int i = 1; i <= 8; i++) {
            char c = name[base + i];
            if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return 0;
        }
    }
    int a = 0, b = 0;
    for (int i = 0; i < 5; i++) {
        if (name[6 + i] < '0' || name[6 + i] > '9' || name[15 + i] < '0' || name[15 + i] > '9') return 0;
        a = a * 10 + (name[6 + i] - '0');
        b = b * 10 + (name[15 + i] - '0');
    }
    *k = a;
    *total = b;
    return 1;
}

/* The shard file name of shard s of n: HF's, or with the save id when
 * `alt` (see is_shard_name). */
static void shard_name(char *out, size_t cap, int s, int n, int alt, const char *save_id) {
    if (alt) snprintf(out, cap, "model-%05d-of-%05d-%.8s.safetensors", s + 1, n, save_id);
    else snprintf(out, cap, "model-%05d-of-%05d.safetensors", s + 1, n);
}

/* Removes shard files other than the nkeep names in keep (nkeep 0 removes
 * every shard). Best effort: a leftover file is harmless because the
 * index, or model.safetensors, says what to load. */
static void remove_stale_shards(const char *dir, char (*keep)[64], int nkeep) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        int k, total, kept = 0;
        if (!is_shard_name(e->d_name, &k, &total)) continue;
        for (int i = 0; i < nkeep && !kept; i++) kept = strcmp(keep[i], e->d_name) == 0;
        if (kept) continue;
        char p[4096 + 256];
        if (cf_path_join(p, sizeof p, dir, e->d_name) == 0) unlink(p);
    }
    closedir(d);
}

static void make_save_id(char *out, size_t cap, const cf_st_item *items, int n) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t h = CF_FNV_INIT;
    h = cf_fnv1a(h, &ts, sizeof ts);
    pid_t pid = getpid();
    h = cf_fnv1a(h, &pid, sizeof pid);
    static uint64_t counter;   /* distinct ids for saves within one clock tick */
    uint64_t c = __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED);
    h = cf_fnv1a(h, &c, sizeof c);
    for (int i = 0; i < n; i++) h = cf_fnv1a(h, items[i].name, strlen(items[i].name));
    snprintf(out, cap, "%016llx", (unsigned long long)h);
}

typedef struct { const char *name; int idx; } named_index;

static int cmp_named_index(const void *a, const void *b) {
    return strcmp(((const named_index *)a)->name, ((const named_index *)b)->name);
}

static int write_index(const char *path, const cf_st_item *items, int n, const int *shard_of, int nshards,
                       uint64_t total, const char *save_id, char (*names)[64]) {
    /* HF sorts the weight_map by tensor name. */
    named_index *order = cf_malloc((size_t)(n ? n : 1) * sizeof *order);
    if (!order) return -1;
    for (int i = 0; i < n; i++) order[i] = (named_index){items[i].name, i};
    qsort(order, (size_t)n, sizeof *order, cmp_named_index);
    cf_sbuf b = {0};
    cf_sb_printf(&b, "{\n  \"metadata\": {\n    \"" ST_SAVE_ID_KEY "\": \"%s\",\n    \"total_size\": %llu\n  },\n"
                  "  \"weight_map\": {\n", save_id, (unsigned long long)total);
    for (int i = 0; i < n; i++) {
        int j = order[i].idx;
        cf_sb_printf(&b, "    ");
        sb_json_string(&b, items[j].name);
        cf_sb_printf(&b, ": \"%s\"%s\n", names[shard_of[j]], i + 1 < n ? "," : "");
    }
    cf_sb_printf(&b, "  }\n}\n");
    free(order);
    int rc;
    if (b.failed) rc = cf_fail("%s: out of memory building the index", path);
    else rc = cf_write_file_atomic(path, b.s, b.len);
    free(b.s);
    return rc;
}

int cf_st_write_dir(const char *dir, const cf_st_item *items, int n, cf_dtype dtype, size_t max_shard_bytes) {
    if (!dir) return cf_fail("safetensors: NULL directory");
    if (validate_items(dir, items, n, dtype) != 0) return -1;
    if (cf_mkdir_p(dir) != 0) return -1;
    char single[4096 + 64], index[4096 + 64];
    if (cf_path_join(single, sizeof single, dir, ST_SINGLE_NAME) != 0) return -1;
    if (cf_path_join(index, sizeof index, dir, ST_INDEX_NAME) != 0) return -1;

    /* Plan shards greedily in item order (as transformers does): start a
     * new shard when the next tensor would overflow a non-empty one. A
     * tensor larger than the limit gets a shard of its own. */
    int *shard_of = cf_malloc((size_t)(n ? n : 1) * sizeof *shard_of);
    if (!shard_of) return -1;
    int nshards = 1;
    uint64_t cur = 0, total = 0;
    for (int i = 0; i < n; i++) {
        uint64_t bytes = item_numel(&items[i]) * cf_dtype_size(dtype);
        if (max_shard_bytes > 0 && cur > 0 && cur + bytes > (uint64_t)max_shard_bytes) { nshards++; cur = 0; }
        shard_of[i] = nshards - 1;
        cur += bytes;
        total += bytes;
    }
    if (nshards > 99999) {
        free(shard_of);
        return cf_fail("%s: %d shards is more than the naming scheme allows (99999)", dir, nshards);
    }

    int rc = 0;
    if (nshards == 1) {
        rc = write_file(single, items, n, dtype, NULL);
        /* Only after the new file is in place: drop the sharded layout, index
         * first, so no moment exists where neither layout is complete. */
        if (rc == 0) {
            if (unlink(index) != 0 && errno != ENOENT)
                rc = cf_fail("%s: cannot remove the stale index: %s", index, strerror(errno));
            remove_stale_shards(dir, NULL, 0);
        }
    } else {
        char save_id[32];
        make_save_id(save_id, sizeof save_id, items, n);
        char (*names)[64] = cf_calloc((size_t)nshards, sizeof *names);
        if (!names) { free(shard_of); return -1; }
        /* The files the current layout uses are never overwritten: if a
         * shard of HF's name is there (say, rewriting a model in place with
         * as many shards), this save's shards carry its id in their names,
         * and until the new index is renamed into place the old layout
         * stays complete. */
        int alt = 0;
        for (int s = 0; s < nshards && !alt; s++) {
            char path[4096 + 64];
            shard_name(names[s], sizeof names[s], s, nshards, 0, save_id);
            struct stat st;
            alt = cf_path_join(path, sizeof path, dir, names[s]) == 0 && lstat(path, &st) == 0;
        }
        for (int s = 0; s < nshards; s++) shard_name(names[s], sizeof names[s], s, nshards, alt, save_id);
        int written = 0;
        for (int s = 0, first = 0; s < nshards && rc == 0; s++) {
            int last = first;
            while (last < n && shard_of[last] == s) last++;
            char path[4096 + 64];
            rc = cf_path_join(path, sizeof path, dir, names[s]);
            if (rc == 0) rc = write_file(path, items + first, last - first, dtype, save_id);
            if (rc == 0) written++;
            first = last;
        }
        /* The index last: until it is renamed into place the old layout
         * (single file or old index) is what a loader sees. */
        if (rc == 0) rc = write_index(index, items, n, shard_of, nshards, total, save_id, names);
        if (rc == 0) {
            if (unlink(single) != 0 && errno != ENOENT)
                rc = cf_fail("%s: cannot remove the stale single file: %s", single, strerror(errno));
            remove_stale_shards(dir, names, nshards);
        } else {
            /* the new shards are this save's own files: nothing names them */
            char err[1024];
            snprintf(err, sizeof err, "%s", cf_last_error());
            for (int s = 0; s < written; s++) {
                char path[4096 + 64];
                if (cf_path_join(path, sizeof path, dir, names[s]) == 0) unlink(path);
            }
            cf_fail("%s", err);
        }
        free(names);
    }
    free(shard_of);
    return rc;
}
