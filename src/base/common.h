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

/* ------------------------------------------------------------ file safety
 * (docs/ROBUSTNESS.md §6) One way to read inputs and one way to create
 * outputs, so that no output can destroy an input, write through a link,
 * replace a device or a directory, or leave a torn file. */

/* Inputs. cf_open_input opens path read-only without blocking (O_NONBLOCK:
 * a FIFO cannot hang open()), refuses anything but a regular file (FIFO,
 * socket, device, directory) with one line, and records the file's
 * (st_dev, st_ino) in the registry of inputs until cf_input_release(path).
 * Returns the fd (blocking again) or -1; *size gets the file size. */
int cf_open_input(const char *path, int64_t *size);
void cf_input_release(const char *path);
/* Records path (if it exists) as an input for the whole run. */
int cf_input_register(const char *path);
/* A command is one run: cf_inputs_begin_run() empties the registry and
 * keeps every input opened from then on registered after it is closed,
 * until cf_inputs_end_run(). Outside a run (library use) an input counts
 * while it is open. */
void cf_inputs_begin_run(void);
void cf_inputs_end_run(void);
/* The registered input that is the same file as path (by device and
 * inode, so links and other spellings count), or NULL. */
const char *cf_input_same_file(const char *path);

/* Outputs. cf_output_check says whether path may be created or replaced:
 * not an input of this run, not a directory, FIFO, socket, device or
 * symbolic link, its directory exists and is writable (probed by creating
 * and removing a temp file), its name not too long. One line if not. */
int cf_output_check(const char *path);
/* The same for a directory of outputs (train --out): an existing directory
 * or one that can be created (the nearest existing ancestor is a writable
 * directory), with room for names of up to `extra` more bytes below it. */
int cf_output_dir_check(const char *dir, size_t extra);

/* Atomic file writes, the one way outputs are created: a temp file
 * "<path>.tmp.<16 random hex>" created exclusively (O_CREAT | O_EXCL |
 * O_NOFOLLOW, mode 0644 less the umask) in the target's directory, written,
 * fsynced, renamed over the target, and the directory fsynced. The target
 * is checked first (cf_output_check, without the probe) and again before
 * the rename. A crash leaves the old file or the new one, never a torn one;
 * a failure removes only the temp file, never the target. */
typedef struct { FILE *f; char *path; char *tmp; } cf_atomic_file;
int cf_atomic_open(cf_atomic_file *af, const char *path);
int cf_atomic_write(cf_atomic_file *af, const void *data, size_t n);
int cf_atomic_commit(cf_atomic_file *af);   /* fsync, rename, fsync dir */
void cf_atomic_abort(cf_atomic_file *af);   /* remove the temp file     */
/* Whole-file helpers. */
int cf_write_file_atomic(const char *path, const void *data, size_t n);
/* A file written as it goes (a log): append = 0 creates an empty file as
 * above and renames it into place at once (replacing an old one); append =
 * 1 opens an existing regular file for appending (O_NOFOLLOW, same checks)
 * or creates it. NULL with cf_fail on failure. Check every write
 * (cf_stream_check) and the close (cf_stream_close): a full disk must fail. */
FILE *cf_output_stream(const char *path, int append);
/* 0, or cf_fail("<path>: write failed: ...") if any write on f failed. */
int cf_stream_check(FILE *f, const char *path);
/* fflush + fsync + fclose, each checked. */
int cf_stream_close(FILE *f, const char *path);
/* Whether a directory entry name is a temp file of cf_atomic_open. */
int cf_is_temp_name(const char *name);

/* Reads a whole regular file (NUL-terminated for convenience); limit caps
 * the size. Opened like an input (no hang on a FIFO), not registered. */
char *cf_read_file(const char *path, size_t *len, size_t limit);
/* cf_read_file of an input: registered like cf_open_input (and released
 * when read; in a run it stays registered). */
char *cf_read_input(const char *path, size_t *len, size_t limit);
int cf_mkdir_p(const char *dir);
int cf_path_exists(const char *path);

/* 1 if the comma list s has an empty item (",a", "a,", "a,,b"; "" and NULL
 * count as none): strtok would skip it silently, so lists given by users
 * refuse it. cf_list_check: 0, or -1 with cf_fail naming the option `what`. */
int cf_list_has_empty_item(const char *s);
int cf_list_check(const char *what, const char *s);
/* snprintf into a fixed buffer, failing (cf_fail) on truncation. */
int cf_path_join(char *out, size_t cap, const char *dir, const char *name);

/* An exclusive lock on dir/.lock (flock), held while the fd stays open:
 * creates dir if missing (*created = 1). Fails at once if another process
 * holds it ("<dir> is in use by another run (pid N holds <dir>/.lock)").
 * Returns the fd or -1. */
int cf_dir_lock(const char *dir, int *created);
/* Removes a directory this process created, with the files in it and in
 * its direct subdirectories (links are removed, never followed). */
int cf_remove_created_dir(const char *dir);

/* Removes a training run's own files from dir (under its lock): latest,
 * run.json, .lock, .tokenizer and every step_* directory whose marker has
 * the run's id; then dir itself if nothing else is left. Other files stay.
 * 0 if dir is gone or held nothing of a run. For a command that starts the
 * same run over (the demo). */
int cf_remove_run_dir(const char *dir);

/* 64 unpredictable bits (getrandom; /dev/urandom; clock and pid). */
uint64_t cf_random_u64(void);

/* A run manifest (OUT/run.json): a flat JSON object of string values. */
#define CF_MANIFEST_MAX 48
typedef struct {
    int n;
    struct { char key[32]; char val[512]; } kv[CF_MANIFEST_MAX];
} cf_manifest;
void cf_manifest_set(cf_manifest *m, const char *key, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
const char *cf_manifest_get(const cf_manifest *m, const char *key);   /* NULL if absent */
/* 0, 1 if the file does not exist, -1 (cf_fail) if it cannot be read. */
int cf_manifest_read(const char *path, cf_manifest *m);
int cf_manifest_write(const char *path, const cf_manifest *m);

/* JSON text: fails ("<path>: a string in the <what> holds a NUL character
 * ...") if a string holds a NUL byte or the escape backslash-u0000, which a C
 * string would silently cut. */
int cf_json_check_nul(const char *path, const char *what, const char *buf, size_t len);
/* v printed with fmt, or "null" if v is not finite (JSON has no NaN). */
const char *cf_json_num(char *buf, size_t cap, const char *fmt, double v);

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
