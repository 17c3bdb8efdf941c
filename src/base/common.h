/*
 * common.h — small shared utilities: errors, allocation, RNG, timing,
 * atomic file writes, strict number parsing.
 */
#ifndef CF_COMMON_H
#define CF_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include "centrifuge.h"

#define CF_MIN(a, b) ((a) < (b) ? (a) : (b))
#define CF_MAX(a, b) ((a) > (b) ? (a) : (b))

/* malloc/calloc that set cf_fail("out of memory ...") and return NULL. */
void *cf_malloc(size_t bytes);
void *cf_calloc(size_t n, size_t size);

/* Deterministic RNG (xoshiro256** seeded through splitmix64). */
typedef struct { uint64_t s[4]; } cf_rng;
void cf_rng_seed(cf_rng *r, uint64_t seed);
uint64_t cf_rng_u64(cf_rng *r);
uint32_t cf_rng_below(cf_rng *r, uint32_t n);   /* uniform in [0, n) */
float cf_rng_uniform(cf_rng *r);                /* uniform in [0, 1) */
float cf_rng_normal(cf_rng *r);                 /* standard normal   */

/* Monotonic wall clock in seconds. */
double cf_now(void);

/* 64-bit FNV-1a over bytes, chainable (start with CF_FNV_INIT). */
#define CF_FNV_INIT 0xcbf29ce484222325ULL
uint64_t cf_fnv1a(uint64_t h, const void *data, size_t n);

/* Atomic file writes: write to "<path>.tmp.<pid>", then fsync + rename.
 * A crash leaves either the old file or the new one, never a torn one. */
typedef struct { FILE *f; char *path; char *tmp; } cf_atomic_file;
int cf_atomic_open(cf_atomic_file *af, const char *path);
int cf_atomic_write(cf_atomic_file *af, const void *data, size_t n);
int cf_atomic_commit(cf_atomic_file *af);   /* fsync, rename, fsync dir */
void cf_atomic_abort(cf_atomic_file *af);   /* remove the temp file     */
/* Whole-file helpers. */
int cf_write_file_atomic(const char *path, const void *data, size_t n);
/* Reads a whole file (NUL-terminated for convenience); limit caps the size. */
char *cf_read_file(const char *path, size_t *len, size_t limit);
int cf_mkdir_p(const char *dir);
int cf_path_exists(const char *path);
/* snprintf into a fixed buffer, failing (cf_fail) on truncation. */
int cf_path_join(char *out, size_t cap, const char *dir, const char *name);

/* A growable string (for writing JSON); the first failure sticks, so the
 * caller checks `failed` once at the end. Free `s` when done. */
typedef struct { char *s; size_t len, cap; int failed; } cf_sbuf;
void cf_sb_printf(cf_sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* A copy of s fit for a one-line message (control bytes become '?'),
 * truncated to cap - 1 bytes; returns buf. */
const char *cf_printable(const char *s, char *buf, size_t cap);

/* Strict parsing: the whole string must be a number in [lo, hi]. On failure
 * cf_fail("<what>: ...") and return -1. */
int cf_parse_int(const char *s, long lo, long hi, const char *what, long *out);
int cf_parse_float(const char *s, double lo, double hi, const char *what, double *out);

#endif /* CF_COMMON_H */
