/* common.c — errors, allocation, RNG, timing, atomic files, parsing. */
#include "base/common.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ errors */

static _Thread_local char g_err[1024];

const char *cf_last_error(void) { return g_err; }

int cf_fail(const char *fmt, ...) {
    char tmp[sizeof g_err];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof tmp, fmt, ap);   /* fmt may reference g_err itself */
    va_end(ap);
    memcpy(g_err, tmp, sizeof g_err);
    return -1;
}

void *cf_malloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) cf_fail("out of memory allocating %zu bytes", bytes);
    return p;
}

void *cf_calloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) cf_fail("out of memory allocating %zu x %zu bytes", n, size);
    return p;
}

/* --------------------------------------------------------------------- rng */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

void cf_rng_seed(cf_rng *r, uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&x);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t cf_rng_u64(cf_rng *r) {
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

uint32_t cf_rng_below(cf_rng *r, uint32_t n) {
    if (n <= 1) return 0;
    /* Lemire's multiply-shift; the bias is below 2^-32 and irrelevant here. */
    return (uint32_t)(((cf_rng_u64(r) >> 32) * (uint64_t)n) >> 32);
}

float cf_rng_uniform(cf_rng *r) { return (float)(cf_rng_u64(r) >> 40) * (1.0f / 16777216.0f); }

float cf_rng_normal(cf_rng *r) {
    /* Box-Muller; u1 in (0,1] so log is finite. */
    double u1 = ((cf_rng_u64(r) >> 11) + 1.0) * (1.0 / 9007199254740992.0);
    double u2 = (cf_rng_u64(r) >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

double cf_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

uint64_t cf_fnv1a(uint64_t h, const void *data, size_t n) {
    const unsigned char *p = data;
    for (size_t i = 0; i < n; i++) { h ^= p[i]; h *= 0x100000001b3ULL; }
    return h;
}

/* ------------------------------------------------------------ atomic files */

int cf_atomic_open(cf_atomic_file *af, const char *path) {
    memset(af, 0, sizeof *af);
    size_t n = strlen(path) + 32;
    af->path = cf_malloc(strlen(path) + 1);
    af->tmp = cf_malloc(n);
    if (!af->path || !af->tmp) { free(af->path); free(af->tmp); return -1; }
    strcpy(af->path, path);
    snprintf(af->tmp, n, "%s.tmp.%ld", path, (long)getpid());
    af->f = fopen(af->tmp, "wb");
    if (!af->f) {
        int e = errno;
        free(af->path); free(af->tmp);
        af->path = af->tmp = NULL;
        return cf_fail("%s: cannot create: %s", path, strerror(e));
    }
    return 0;
}

int cf_atomic_write(cf_atomic_file *af, const void *data, size_t n) {
    if (n && fwrite(data, 1, n, af->f) != n)
        return cf_fail("%s: write failed: %s", af->path, strerror(errno));
    return 0;
}

static void fsync_parent_dir(const char *path) {
    char *copy = strdup(path);
    if (!copy) return;
    int fd = open(dirname(copy), O_RDONLY);
    if (fd >= 0) { fsync(fd); close(fd); }
    free(copy);
}

int cf_atomic_commit(cf_atomic_file *af) {
    int rc = 0;
    if (fflush(af->f) != 0 || fsync(fileno(af->f)) != 0)
        rc = cf_fail("%s: flush failed: %s", af->path, strerror(errno));
    if (fclose(af->f) != 0 && rc == 0)
        rc = cf_fail("%s: close failed: %s", af->path, strerror(errno));
    af->f = NULL;
    if (rc == 0 && rename(af->tmp, af->path) != 0)
        rc = cf_fail("%s: rename failed: %s", af->path, strerror(errno));
    if (rc != 0) unlink(af->tmp);
    else fsync_parent_dir(af->path);
    free(af->path); free(af->tmp);
    af->path = af->tmp = NULL;
    return rc;
}

void cf_atomic_abort(cf_atomic_file *af) {
    if (af->f) fclose(af->f);
    if (af->tmp) unlink(af->tmp);
    free(af->path); free(af->tmp);
    memset(af, 0, sizeof *af);
}

int cf_write_file_atomic(const char *path, const void *data, size_t n) {
    cf_atomic_file af;
    if (cf_atomic_open(&af, path) != 0) return -1;
    if (cf_atomic_write(&af, data, n) != 0) { cf_atomic_abort(&af); return -1; }
    return cf_atomic_commit(&af);
}

char *cf_read_file(const char *path, size_t *len, size_t limit) {
    FILE *f = fopen(path, "rb");
    if (!f) { cf_fail("%s: cannot open: %s", path, strerror(errno)); return NULL; }
    if (fseek(f, 0, SEEK_END) != 0) { fclose(f); cf_fail("%s: cannot seek", path); return NULL; }
    long sz = ftell(f);
    if (sz < 0) { fclose(f); cf_fail("%s: cannot determine size", path); return NULL; }
    if ((size_t)sz > limit) {
        fclose(f);
        cf_fail("%s: file is %ld bytes, more than the limit of %zu", path, sz, limit);
        return NULL;
    }
    rewind(f);
    char *buf = cf_malloc((size_t)sz + 1);
    if (!buf) { fclose(f); return NULL; }
    if (sz && fread(buf, 1, (size_t)sz, f) != (size_t)sz) {
        fclose(f); free(buf); cf_fail("%s: read failed", path); return NULL;
    }
    fclose(f);
    buf[sz] = 0;
    if (len) *len = (size_t)sz;
    return buf;
}

int cf_mkdir_p(const char *dir) {
    char buf[4096];
    if (snprintf(buf, sizeof buf, "%s", dir) >= (int)sizeof buf)
        return cf_fail("%s: path too long", dir);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST)
            return cf_fail("%s: cannot create directory: %s", buf, strerror(errno));
        *p = '/';
    }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST)
        return cf_fail("%s: cannot create directory: %s", buf, strerror(errno));
    struct stat st;
    if (stat(buf, &st) != 0 || !S_ISDIR(st.st_mode))
        return cf_fail("%s: exists and is not a directory", buf);
    return 0;
}

int cf_path_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

int cf_path_join(char *out, size_t cap, const char *dir, const char *name) {
    int n = snprintf(out, cap, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= cap) return cf_fail("%s/%s: path too long", dir, name);
    return 0;
}

/* --------------------------------------------------------------- strings */

void cf_sb_printf(cf_sbuf *b, const char *fmt, ...) {
    if (b->failed) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->s ? b->s + b->len : NULL, b->s ? b->cap - b->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0) { b->failed = 1; return; }
        if (b->s && b->len + (size_t)n < b->cap) { b->len += (size_t)n; return; }
        size_t cap = (b->cap ? b->cap * 2 : 4096) + (size_t)n;
        char *s = realloc(b->s, cap);
        if (!s) { b->failed = 1; return; }
        b->s = s;
        b->cap = cap;
    }
}

const char *cf_printable(const char *s, char *buf, size_t cap) {
    size_t i = 0;
    for (; s[i] && i + 1 < cap; i++) buf[i] = (unsigned char)s[i] < 0x20 || s[i] == 0x7f ? '?' : s[i];
    buf[i] = 0;
    return buf;
}

/* ---------------------------------------------------------------- parsing */

int cf_parse_int(const char *s, long lo, long hi, const char *what, long *out) {
    if (!s || !*s) return cf_fail("%s: expected an integer, got an empty value", what);
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (*end || errno) return cf_fail("%s: '%s' is not an integer", what, s);
    if (v < lo || v > hi) return cf_fail("%s: %ld is outside [%ld, %ld]", what, v, lo, hi);
    *out = v;
    return 0;
}

int cf_parse_float(const char *s, double lo, double hi, const char *what, double *out) {
    if (!s || !*s) return cf_fail("%s: expected a number, got an empty value", what);
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (*end || errno || !isfinite(v)) return cf_fail("%s: '%s' is not a finite number", what, s);
    if (v < lo || v > hi) return cf_fail("%s: %g is outside [%g, %g]", what, v, lo, hi);
    *out = v;
    return 0;
}
