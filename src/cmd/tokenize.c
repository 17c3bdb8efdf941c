/*
 * tokenize.c — `centrifuge tokenize`: text or JSONL in, token shards out,
 * with a HF tokenizer.json (centrifuge_tokenizer.h).
 *
 *   centrifuge tokenize --tokenizer tok/ --input a.jsonl b.jsonl --out data/web
 *       -> data/web_000000.bin, data/web_000001.bin, ..., data/web_manifest.json
 *
 * Documents are made and separated as tools/prepare_data.py does, so that
 * the two paths write the same tokens from the same input:
 *   - JSONL: one object per line, the document in --field (default text);
 *     text: the whole file (default), each line, blank-line paragraphs, or
 *     the pieces between --delimiter strings. Line ends \r\n and \r read as
 *     \n (Python's universal newlines). Documents that are only whitespace
 *     are skipped (--keep-empty keeps them).
 *   - Each document is encoded without the tokenizer's post-processor, then
 *     EOS is appended (--no-eos: not) and, with --bos, BOS prepended; the ids
 *     come from --eos-token/--eos-id, else tokenizer_config.json beside the
 *     tokenizer, else a well-known name.
 *   - Shards hold at most --shard-tokens tokens (default 100M; a document may
 *     span two), uint16 when the vocabulary has at most 65536 tokens, else
 *     uint32 (src/formats/io.h). prepare_data's train/val split is not done
 *     here: give the validation documents as a separate run.
 * Every shard is written atomically; a failed or interrupted run removes the
 * shards it wrote and the directories it created. Shards of an earlier run
 * under the same prefix are an error unless --overwrite, which moves them
 * aside and removes them only once the run has succeeded (a failed run puts
 * them back).
 */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "base/common.h"
#include "centrifuge_tokenizer.h"
#include "cmd/cli.h"
#include "cmd/commands.h"
#include "formats/io.h"

static const char *const CMD = "tokenize";
static const char *const USAGE =
    "--tokenizer FILE|DIR --input FILE... --out PREFIX [options]\n\n"
    "Tokenizes text or JSONL files with a Hugging Face tokenizer.json into token shards\n"
    "PREFIX_000000.bin, PREFIX_000001.bin, ... (the format of `train --data`) and\n"
    "PREFIX_manifest.json. Documents as tools/prepare_data.py makes them: JSONL lines\n"
    "(--field), or text split by --text-split; EOS after each document, BOS before it\n"
    "with --bos. .jsonl/.json/.ndjson inputs are JSONL, the rest text (--format).";

#define DEFAULT_SHARD_TOKENS 100000000L
#define MAX_FILE_BYTES ((size_t)1 << 40)


static volatile sig_atomic_t g_interrupted = 0;
static void on_signal(int sig) { (void)sig; g_interrupted = 1; }

typedef enum { SPLIT_FILE, SPLIT_LINE, SPLIT_BLANK, SPLIT_DELIM } split_mode;

typedef struct {
    cf_tokenizer *tok;
    const char *out, *field, *delimiter;
    split_mode split;
    int fmt;                 /* 0 auto, 1 text, 2 jsonl */
    int keep_empty, skip_bad, quiet, tty;
    long eos, bos;           /* -1: none */
    int width;
    long shard_tokens;
    /* current shard */
    uint32_t *buf;
    size_t nbuf, capbuf;
    /* the document being encoded */
    uint32_t *doc;
    size_t ndoc, capdoc;
    /* shards written */
    char **shards;
    int64_t *shard_n;
    int nshards;
    /* counts */
    long long docs, empty, bad, tokens;
    double bytes_done, bytes_total, t0, last_print;
} tk_run;

/* --------------------------------------------------------------- progress */

static void fmt_secs(double s, char *out, size_t n) {
    if (s < 0 || s > 1e7) { snprintf(out, n, "?"); return; }
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(out, n, "%ldh%02ldm", t / 3600, (t / 60) % 60);
    else if (t >= 60) snprintf(out, n, "%ldm%02lds", t / 60, t % 60);
    else snprintf(out, n, "%lds", t);
}

static void progress(tk_run *r, int final) {
    if (r->quiet) return;
    double now = cf_now(), el = now - r->t0;
    /* a terminal gets a line redrawn 4 times a second; a log a line every 5 s */
    if (!final && now - r->last_print < (r->tty ? 0.25 : 5.0)) return;
    if (final && !r->tty) return;
    r->last_print = now;
    double rate = el > 0 ? r->bytes_done / el : 0;
    char eta[32];
    fmt_secs(rate > 0 ? (r->bytes_total - r->bytes_done) / rate : -1, eta, sizeof eta);
    fprintf(stderr, "%stokenize: %.1f / %.1f MB (%.0f%%), %lld docs, %lld tokens, %.1f MB/s, ETA %s%s",
            r->tty ? "\r" : "", r->bytes_done / 1e6, r->bytes_total / 1e6,
            r->bytes_total > 0 ? 100.0 * r->bytes_done / r->bytes_total : 100.0, r->docs, r->tokens, rate / 1e6, eta,
            r->tty ? (final ? "\n" : "\033[K") : "\n");
    fflush(stderr);
}

/* ----------------------------------------------------------------- shards */

static int write_shard(tk_run *r) {
    if (r->nbuf == 0) return 0;
    size_t n = strlen(r->out) + 32;
    char *path = cf_malloc(n);
    if (!path) return -1;
    snprintf(path, n, "%s_%06d.bin", r->out, r->nshards);
    char **s = realloc(r->shards, (size_t)(r->nshards + 1) * sizeof *s);
    int64_t *c = realloc(r->shard_n, (size_t)(r->nshards + 1) * sizeof *c);
    if (s) r->shards = s;
    if (c) r->shard_n = c;
    if (!s || !c) { free(path); return cf_fail("out of memory"); }
    if (cf_tokens_write(path, r->buf, (int64_t)r->nbuf, r->width) != 0) { free(path); return -1; }
    r->shards[r->nshards] = path;
    r->shard_n[r->nshards++] = (int64_t)r->nbuf;
    r->nbuf = 0;
    return 0;
}

static int add_tokens(tk_run *r, const uint32_t *ids, size_t n) {
    while (n) {
        if (r->nbuf == r->capbuf) {
            size_t cap = r->capbuf ? r->capbuf * 2 : (size_t)1 << 20;
            if (cap > (size_t)r->shard_tokens) cap = (size_t)r->shard_tokens;
            uint32_t *b = realloc(r->buf, cap * sizeof *b);
            if (!b) return cf_fail("out of memory (a shard buffer of %zu tokens)", cap);
            r->buf = b;
            r->capbuf = cap;
        }
        size_t k = CF_MIN(n, r->capbuf - r->nbuf);
        memcpy(r->buf + r->nbuf, ids, k * sizeof *ids);
        r->nbuf += k;
        ids += k;
        n -= k;
        if (r->nbuf == (size_t)r->shard_tokens && write_shard(r) != 0) return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- documents */

/* Python's str.isspace: what `doc.strip()` removes in prepare_data.py. */
static int py_space(uint32_t c) {
    return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
           c == 0x3000;
}

static uint32_t utf8_at(const unsigned char *s, size_t *i) {
    uint32_t c = s[*i];
    if (c < 0x80) { *i += 1; return c; }
    if (c < 0xE0) { *i += 2; return ((c & 0x1F) << 6) | (s[*i - 1] & 0x3F); }
    if (c < 0xF0) { *i += 3; return ((c & 0x0F) << 12) | ((s[*i - 2] & 0x3F) << 6) | (s[*i - 1] & 0x3F); }
    *i += 4;
    return ((c & 0x07) << 18) | ((s[*i - 3] & 0x3F) << 12) | ((s[*i - 2] & 0x3F) << 6) | (s[*i - 1] & 0x3F);
}

/* 1 if s (valid UTF-8) is empty or only whitespace. */
static int blank(const char *s, size_t n) {
    size_t i = 0;
    while (i < n)
        if (!py_space(utf8_at((const unsigned char *)s, &i))) return 0;
    return 1;
}

static int emit_doc(tk_run *r, const char *text, size_t len) {
    if (!r->keep_empty && blank(text, len)) {
        r->empty++;
        return 0;
    }
    r->ndoc = 0;
    if (r->bos >= 0) {
        if (r->ndoc == r->capdoc) {
            size_t cap = r->capdoc ? r->capdoc * 2 : 1024;
            uint32_t *d = realloc(r->doc, cap * sizeof *d);
            if (!d) return cf_fail("out of memory");
            r->doc = d;
            r->capdoc = cap;
        }
        r->doc[r->ndoc++] = (uint32_t)r->bos;
    }
    if (cf_tokenizer_encode_append(r->tok, text, len, 0, &r->doc, &r->ndoc, &r->capdoc) != 0) return -1;
    if (r->eos >= 0) {
        uint32_t e = (uint32_t)r->eos;
        if (add_tokens(r, r->doc, r->ndoc) != 0 || add_tokens(r, &e, 1) != 0) return -1;
        r->tokens += (long long)r->ndoc + 1;
    } else {
        if (add_tokens(r, r->doc, r->ndoc) != 0) return -1;
        r->tokens += (long long)r->ndoc;
    }
    r->docs++;
    return 0;
}

/* Turns \r\n and lone \r into \n in place (Python's universal newlines);
 * returns the new length. */
static size_t universal_newlines(char *s, size_t n) {
    size_t w = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '\r') {
            s[w++] = '\n';
            if (i + 1 < n && s[i + 1] == '\n') i++;
        } else {
            s[w++] = s[i];
        }
    }
    return w;
}

/* "\u0000" escapes (not after an escaping backslash) in a JSON line: cJSON
 * strings end at NUL, so such text would be cut silently. */
static int has_nul_escape(const char *s, size_t n) {
    for (size_t i = 0; i + 6 <= n; i++) {
        if (s[i] != '\\' || s[i + 1] != 'u' || memcmp(s + i + 2, "0000", 4) != 0) continue;
        size_t k = 0;
        while (k < i && s[i - 1 - k] == '\\') k++;
        if (k % 2 == 0) return 1;
    }
    return 0;
}

/* Raw control characters that Python's json rejects and cJSON accepts: any
 * inside a string, and outside strings all but \t \n \r. */
static int bad_control(const char *s, size_t n) {
    int in_str = 0, esc = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (in_str) {
            if (c < 0x20) return 1;
            if (esc) esc = 0;
            else if (c == '\\') esc = 1;
            else if (c == '"') in_str = 0;
        } else {
            if (c < 0x20 && c != '\t' && c != '\n' && c != '\r') return 1;
            if (c == '"') in_str = 1;
        }
    }
    return 0;
}

static int json_line(tk_run *r, const char *path, long lineno, char *line, size_t n) {
    if (blank(line, n)) return 0;
    char where[64];
    snprintf(where, sizeof where, "%ld", lineno);
    const char *why = NULL;
    char buf[160];
    cJSON *obj = NULL;
    if (memchr(line, 0, n) || bad_control(line, n)) {
        why = "not valid JSON (a raw control character)";
    } else {
        const char *end = NULL;
        obj = cJSON_ParseWithOpts(line, &end, 1);
        if (!obj) why = "not valid JSON";
    }
    const cJSON *val = NULL;
    if (obj) {
        if (!cJSON_IsObject(obj)) {
            why = "is not a JSON object";
        } else {
            /* Python's json keeps the last of duplicate keys */
            for (const cJSON *e = obj->child; e; e = e->next)
                if (e->string && !strcmp(e->string, r->field)) val = e;
            if (!val) {
                snprintf(buf, sizeof buf, "has no field '%.60s'", r->field);
                why = buf;
            } else if (!cJSON_IsString(val)) {
                snprintf(buf, sizeof buf, "field '%.60s' is not a string", r->field);
                why = buf;
            } else if (has_nul_escape(line, n)) {
                cJSON_Delete(obj);
                return cf_fail("%s:%ld: the text holds a \\u0000 (NUL) escape, which is not supported", path, lineno);
            }
        }
    }
    if (why) {
        int field_problem = obj && cJSON_IsObject(obj);
        cJSON_Delete(obj);
        if (r->skip_bad) { r->bad++; return 0; }
        return cf_fail("%s:%ld: %s (%s--skip-bad skips such lines)", path, lineno, why,
                       field_problem ? "use --field; " : "");
    }
    int rc = emit_doc(r, val->valuestring, strlen(val->valuestring));
    cJSON_Delete(obj);
    return rc;
}

/* Reads lines with universal newlines; calls fn per line (without its end). */
typedef int (*line_fn)(tk_run *r, const char *path, long lineno, char *line, size_t n, void *ctx);

static int for_lines(tk_run *r, const char *path, FILE *f, line_fn fn, void *ctx) {
    char *line = NULL;
    size_t cap = 0;
    ssize_t got;
    long lineno = 0;
    int rc = 0;
    while (rc == 0 && (got = getline(&line, &cap, f)) > 0) {
        size_t n = (size_t)got, ok = cf_utf8_valid_prefix(line, n);
        r->bytes_done += (double)n;
        if (ok != n) { rc = cf_fail("%s:%ld: not UTF-8 text (byte %zu of the line)", path, lineno + 1, ok); break; }
        /* a getline chunk ends at \n; lone \r inside it also end lines */
        size_t a = 0;
        for (size_t i = 0; i <= n && rc == 0; i++) {
            int end = i == n ? a < n : line[i] == '\r' || line[i] == '\n';
            if (!end) continue;
            size_t len = i - a;
            lineno++;
            rc = fn(r, path, lineno, line + a, len, ctx);
            if (i < n && line[i] == '\r' && i + 1 < n && line[i + 1] == '\n') i++;
            a = i + 1;
        }
        if (g_interrupted) rc = cf_fail("interrupted");
        progress(r, 0);
    }
    if (rc == 0 && ferror(f)) rc = cf_fail("%s: read error: %s", path, strerror(errno));
    free(line);
    return rc;
}

static int jsonl_cb(tk_run *r, const char *path, long lineno, char *line, size_t n, void *ctx) {
    (void)ctx;
    char saved = line[n];
    line[n] = 0;
    int rc = json_line(r, path, lineno, line, n);
    line[n] = saved;
    return rc;
}

static int line_cb(tk_run *r, const char *path, long lineno, char *line, size_t n, void *ctx) {
    (void)path; (void)lineno; (void)ctx;
    if (blank(line, n)) return 0;
    return emit_doc(r, line, n);
}

/* --text-split blank: paragraphs of non-blank lines, joined with \n. */
typedef struct { char *s; size_t n, cap; int open; } para;

static int para_flush(tk_run *r, para *p) {
    if (!p->open) return 0;
    p->open = 0;
    size_t n = p->n;
    while (n && p->s[n - 1] == '\n') n--;   /* "".join(buf).rstrip("\r\n") */
    p->n = 0;
    return emit_doc(r, p->s, n);
}

static int blank_cb(tk_run *r, const char *path, long lineno, char *line, size_t n, void *ctx) {
    (void)path; (void)lineno;
    para *p = ctx;
    if (blank(line, n)) return para_flush(r, p);
    if (p->n + n + 2 > p->cap) {
        size_t cap = p->cap ? p->cap : 4096;
        while (cap < p->n + n + 2) cap *= 2;
        char *s = realloc(p->s, cap);
        if (!s) return cf_fail("out of memory (a paragraph of %zu bytes)", p->n + n);
        p->s = s;
        p->cap = cap;
    }
    memcpy(p->s + p->n, line, n);
    p->n += n;
    p->s[p->n++] = '\n';
    p->open = 1;
    return 0;
}

static int is_jsonl(const tk_run *r, const char *path) {
    if (r->fmt) return r->fmt == 2;
    size_t n = strlen(path);
    const char *exts[] = {".jsonl", ".json", ".ndjson"};
    for (int i = 0; i < 3; i++) {
        size_t k = strlen(exts[i]);
        if (n >= k && !strcmp(path + n - k, exts[i])) return 1;
    }
    return 0;
}

static int process_file(tk_run *r, const char *path) {
    if (is_jsonl(r, path) || r->split == SPLIT_LINE || r->split == SPLIT_BLANK) {
        /* opened as an input: a FIFO or device is refused, not waited on */
        int fd = cf_open_input(path, NULL);
        if (fd < 0) return -1;
        FILE *f = fdopen(fd, "rb");
        if (!f) { close(fd); return cf_fail("%s: cannot open: %s", path, strerror(errno)); }
        int rc;
        if (is_jsonl(r, path)) {
            rc = for_lines(r, path, f, jsonl_cb, NULL);
        } else if (r->split == SPLIT_LINE) {
            rc = for_lines(r, path, f, line_cb, NULL);
        } else {
            para p = {0};
            rc = for_lines(r, path, f, blank_cb, &p);
            if (rc == 0) rc = para_flush(r, &p);
            free(p.s);
        }
        fclose(f);
        return rc;
    }
    /* the whole file: one document, or the pieces between delimiters */
    size_t len;
    char *text = cf_read_file(path, &len, MAX_FILE_BYTES);
    if (!text) return -1;
    size_t ok = cf_utf8_valid_prefix(text, len);
    if (ok != len) {
        free(text);
        return cf_fail("%s: not UTF-8 text (at byte %zu)", path, ok);
    }
    size_t n = universal_newlines(text, len);
    int rc = 0;
    if (r->split == SPLIT_FILE) {
        rc = emit_doc(r, text, n);
        r->bytes_done += (double)len;
    } else {
        size_t dl = strlen(r->delimiter), a = 0;
        double per_byte = n ? (double)len / (double)n : 0;
        while (rc == 0) {
            const char *hit = memmem(text + a, n - a, r->delimiter, dl);
            size_t b = hit ? (size_t)(hit - text) : n;
            rc = emit_doc(r, text + a, b - a);
            r->bytes_done += (double)(b - a + (hit ? dl : 0)) * per_byte;
            if (!hit) break;
            a = b + dl;
            if (g_interrupted) rc = cf_fail("interrupted");
            progress(r, 0);
        }
    }
    free(text);
    return rc;
}

/* --------------------------------------------------------------- the rest */

static int resolve_special(const cf_tokenizer *tok, const char *kind, const char *token, long id, int fallback,
                           long *out, int may_skip) {
    int vocab = cf_tokenizer_max_id(tok);
    if (id >= 0) {
        if ( id >= vocab || !cf_tokenizer_id_token(tok, (uint32_t)id))
            return cf_fail("--%s-id %ld is not a token id of the tokenizer", kind, id);
        *out = id;
        return 0;
    }
    if (token) {
        int i = cf_tokenizer_token_id(tok, token);
        char safe[65];
        if (i < 0)
            return cf_fail("%s: --%s-token '%s' is not in the tokenizer's vocabulary", cf_tokenizer_path(tok), kind,
                           cf_printable(token, safe, sizeof safe));
        *out = i;
        return 0;
    }
    if (fallback >= 0) { *out = fallback; return 0; }
    return cf_fail("%s: cannot tell the %s token; give --%s-token or --%s-id%s", cf_tokenizer_path(tok),
                   !strcmp(kind, "eos") ? "EOS" : "BOS", kind, kind, may_skip ? " (or --no-eos)" : "");
}

/* PREFIX_NNNNNN.bin files of an earlier run (names into *list). */
static int find_stale(const char *out, char ***list, int *n) {
    *list = NULL;
    *n = 0;
    const char *slash = strrchr(out, '/');
    char dir[4096];
    const char *base = slash ? slash + 1 : out;
    if (slash) snprintf(dir, sizeof dir, "%.*s", (int)(slash - out), out);
    else snprintf(dir, sizeof dir, ".");
    if (slash && slash == out) snprintf(dir, sizeof dir, "/");
    DIR *d = opendir(dir);
    if (!d) return 0;
    size_t bl = strlen(base);
    struct dirent *e;
    int rc = 0;
    while ((e = readdir(d)) && rc == 0) {
        const char *nm = e->d_name;
        size_t k = strlen(nm);
        if (k != bl + 11 || strncmp(nm, base, bl) != 0 || nm[bl] != '_' || strcmp(nm + k - 4, ".bin") != 0) continue;
        int digits = 1;
        for (size_t i = bl + 1; i < bl + 7; i++) digits &= nm[i] >= '0' && nm[i] <= '9';
        if (!digits) continue;
        char **l = realloc(*list, (size_t)(*n + 1) * sizeof *l);
        char *p = malloc(strlen(dir) + k + 2);
        if (!l || !p) { free(p); if (l) *list = l; rc = cf_fail("out of memory"); break; }
        *list = l;
        sprintf(p, "%s/%s", dir, nm);
        (*list)[(*n)++] = p;
    }
    closedir(d);
    return rc;
}

static int write_manifest(const tk_run *r, const char *tok_path, char **inputs, int ninputs) {
    cJSON *m = cJSON_CreateObject();
    if (!m) return cf_fail("out of memory");
    char fmt[96];
    snprintf(fmt, sizeof fmt, "centrifuge token shards (llm.c header, magic %d)", CF_TOKENS_MAGIC);
    cJSON_AddStringToObject(m, "format", fmt);
    cJSON_AddNumberToObject(m, "version", r->width == 2 ? 1 : 2);
    cJSON_AddStringToObject(m, "dtype", r->width == 2 ? "uint16" : "uint32");
    char *abs = realpath(tok_path, NULL);
    cJSON_AddStringToObject(m, "tokenizer", abs ? abs : tok_path);
    free(abs);
    cJSON_AddNumberToObject(m, "vocab_size", cf_tokenizer_vocab_size(r->tok));
    for (int k = 0; k < 2; k++) {
        long id = k ? r->bos : r->eos;
        if (id < 0) { cJSON_AddNullToObject(m, k ? "bos" : "eos"); continue; }
        cJSON *o = cJSON_AddObjectToObject(m, k ? "bos" : "eos");
        cJSON_AddNumberToObject(o, "id", (double)id);
        const char *t = cf_tokenizer_id_token(r->tok, (uint32_t)id);
        cJSON_AddStringToObject(o, "token", t ? t : "");
    }
    cJSON *in = cJSON_AddArrayToObject(m, "inputs");
    for (int i = 0; i < ninputs; i++) {
        char *a = realpath(inputs[i], NULL);
        cJSON_AddItemToArray(in, cJSON_CreateString(a ? a : inputs[i]));
        free(a);
    }
    cJSON_AddNumberToObject(m, "documents", (double)r->docs);
    cJSON_AddNumberToObject(m, "skipped_empty", (double)r->empty);
    cJSON_AddNumberToObject(m, "skipped_bad", (double)r->bad);
    cJSON_AddNumberToObject(m, "tokens", (double)r->tokens);
    cJSON_AddNumberToObject(m, "max_tokens_per_shard", (double)r->shard_tokens);
    cJSON *sh = cJSON_AddArrayToObject(m, "shards");
    for (int i = 0; i < r->nshards; i++) {
        cJSON *o = cJSON_CreateObject();
        const char *slash = strrchr(r->shards[i], '/');
        cJSON_AddStringToObject(o, "file", slash ? slash + 1 : r->shards[i]);
        cJSON_AddNumberToObject(o, "tokens", (double)r->shard_n[i]);
        cJSON_AddItemToArray(sh, o);
    }
    char *text = cJSON_Print(m);
    cJSON_Delete(m);
    if (!text) return cf_fail("out of memory (manifest)");
    size_t n = strlen(r->out) + 32;
    char *path = cf_malloc(n);
    int rc = -1;
    if (path) {
        snprintf(path, n, "%s_manifest.json", r->out);
        size_t tl = strlen(text);
        text[tl] = '\n';   /* replaces the NUL; the length below excludes it anyway */
        rc = cf_write_file_atomic(path, text, tl + 1);
        free(path);
    }
    free(text);
    return rc;
}

/* Collects every value after --input (until the next --flag) and removes
 * them from argv; --input may also be given several times. */
static int take_inputs(int *argc, char **argv, char ***inputs, int *ninputs) {
    int w = 1;
    *inputs = NULL;
    *ninputs = 0;
    for (int i = 1; i < *argc; i++) {
        const char *a = argv[i];
        int eq = !strncmp(a, "--input=", 8);
        if (strcmp(a, "--input") != 0 && !eq) { argv[w++] = argv[i]; continue; }
        char **l = realloc(*inputs, (size_t)(*ninputs + *argc) * sizeof *l);
        if (!l) return cf_fail("out of memory");
        *inputs = l;
        if (eq) {
            if (!a[8]) return cf_fail("--input: empty value");
            (*inputs)[(*ninputs)++] = argv[i] + 8;
        }
        int got = eq;
        while (!eq && i + 1 < *argc && strncmp(argv[i + 1], "--", 2) != 0) {
            (*inputs)[(*ninputs)++] = argv[++i];
            got = 1;
        }
        if (!got) return cf_fail("--input needs at least one file");
    }
    *argc = w;
    return 0;
}

/* The first directory of dir's path that does not exist yet (into top);
 * 0 if dir exists. What a failed run removes again (remove_made_dirs). */
static int first_missing_dir(const char *dir, char *top, size_t cap) {
    char buf[4096];
    if (snprintf(buf, sizeof buf, "%s", dir) >= (int)sizeof buf) return 0;
    for (char *p = buf + 1;; p++) {
        if (*p != '/' && *p) continue;
        char c = *p;
        *p = 0;
        if (!cf_path_exists(buf)) return snprintf(top, cap, "%s", buf) < (int)cap;
        if (!c) return 0;
        *p = c;
    }
}

/* rmdir from dir up to top, each only if empty: the directories a failed
 * run created and left nothing in. */
static void remove_made_dirs(const char *dir, const char *top) {
    char buf[4096];
    if (!*dir || !*top || snprintf(buf, sizeof buf, "%s", dir) >= (int)sizeof buf) return;
    for (;;) {
        if (rmdir(buf) != 0) return;
        char *slash = strrchr(buf, '/');
        if (!strcmp(buf, top) || !slash || slash == buf) return;
        *slash = 0;
    }
}

int cmd_tokenize(int argc, char **argv) {
    const char *tok_path = NULL, *out = NULL, *field = "text", *format = "auto", *text_split = NULL,
               *delimiter = NULL, *eos_token = NULL, *bos_token = NULL, *input_help = NULL;
    long shard_tokens = DEFAULT_SHARD_TOKENS, eos_id = -1, bos_id = -1;
    int jsonl = 0, no_eos = 0, bos = 0, overwrite = 0, skip_bad = 0, keep_empty = 0, quiet = 0;
    cf_opt opts[] = {
        {"--tokenizer", CF_OPT_STR, &tok_path, 0, 0, "tokenizer.json, or a directory holding one (required)", 0},
        {"--input", CF_OPT_STR, &input_help, 0, 0, "input files, one or more (required; .jsonl/.json/.ndjson are JSONL)", 0},
        {"--out", CF_OPT_STR, &out, 0, 0, "output prefix: PREFIX_000000.bin, ... and PREFIX_manifest.json (required)", 0},
        {"--format", CF_OPT_STR, &format, 0, 0, "auto (default: by extension), text or jsonl", 0},
        {"--jsonl", CF_OPT_FLAG, &jsonl, 0, 0, "inputs are JSONL (same as --format jsonl)", 0},
        {"--field", CF_OPT_STR, &field, 0, 0, "JSONL field holding the document (default text)", 0},
        {"--text-split", CF_OPT_STR, &text_split, 0, 0,
         "text inputs: file (default: one document per file), line, blank (paragraphs) or delimiter", 0},
        {"--delimiter", CF_OPT_STR, &delimiter, 0, 0, "document separator for text, e.g. '<|endoftext|>'", 0},
        {"--no-eos", CF_OPT_FLAG, &no_eos, 0, 0, "do not append EOS after each document", 0},
        {"--eos-token", CF_OPT_STR, &eos_token, 0, 0,
         "EOS token (default: tokenizer_config.json beside the tokenizer, else </s>, <|end_of_text|>, ...)", 0},
        {"--eos-id", CF_OPT_INT, &eos_id, 0, 1e9, "EOS token id", 0},
        {"--bos", CF_OPT_FLAG, &bos, 0, 0, "prepend BOS to each document (for train --doc-mask)", 0},
        {"--bos-token", CF_OPT_STR, &bos_token, 0, 0, "BOS token (default found like EOS)", 0},
        {"--bos-id", CF_OPT_INT, &bos_id, 0, 1e9, "BOS token id", 0},
        {"--shard-tokens", CF_OPT_COUNT, &shard_tokens, 1, 2147483647.0,
         "tokens per shard at most, suffixes k/M/G (default 100M)", 0},
        {"--overwrite", CF_OPT_FLAG, &overwrite, 0, 0, "replace the shards of an earlier run under PREFIX (put back if this run fails)", 0},
        {"--skip-bad", CF_OPT_FLAG, &skip_bad, 0, 0, "skip JSONL lines that are not JSON or lack --field", 0},
        {"--keep-empty", CF_OPT_FLAG, &keep_empty, 0, 0, "keep empty documents (as a lone EOS/BOS)", 0},
        {"--quiet", CF_OPT_FLAG, &quiet, 0, 0, "no progress or summary lines", 0},
    };
    const int nopts = (int)(sizeof opts / sizeof opts[0]);

    char **inputs = NULL;
    int ninputs = 0;
    if (take_inputs(&argc, argv, &inputs, &ninputs) != 0) { free(inputs); return cf_cli_error(CMD, 2); }
    int rc = cf_cli_parse(CMD, USAGE, opts, nopts, argc, argv);
    if (rc == 1) { free(inputs); return 0; }
    if (rc != 0) { free(inputs); return cf_cli_error(CMD, 2); }
    if (cf_cli_check_single_process(CMD) != 0) { free(inputs); return cf_cli_error(CMD, 2); }

    tk_run r;
    memset(&r, 0, sizeof r);
    /* what a failed run puts back: the directories it created, and the
     * shards of an earlier run that --overwrite moved aside */
    char made_dir[4096] = "", made_top[4096] = "";
    char **stale = NULL, **aside = NULL;
    int nstale = 0, naside = 0;
    r.eos = r.bos = -1;
    r.split = SPLIT_FILE;
    int code = 2;
    if (!tok_path) { cf_fail("--tokenizer is required (a tokenizer.json or the directory holding it)"); goto usage; }
    if (!ninputs) { cf_fail("--input is required (one or more text or JSONL files)"); goto usage; }
    if (!out) { cf_fail("--out is required (the shard prefix, e.g. data/web)"); goto usage; }
    if (out[strlen(out) - 1] == '/') { cf_fail("--out: '%s' is a directory; give a prefix such as %sdata", out, out); goto usage; }
    if (jsonl) format = "jsonl";
    if (!strcmp(format, "auto")) r.fmt = 0;
    else if (!strcmp(format, "text")) r.fmt = 1;
    else if (!strcmp(format, "jsonl")) r.fmt = 2;
    else { cf_fail("--format: '%s' is not auto, text or jsonl", format); goto usage; }
    if (text_split) {
        if (!strcmp(text_split, "file")) r.split = SPLIT_FILE;
        else if (!strcmp(text_split, "line")) r.split = SPLIT_LINE;
        else if (!strcmp(text_split, "blank")) r.split = SPLIT_BLANK;
        else if (!strcmp(text_split, "delimiter")) r.split = SPLIT_DELIM;
        else { cf_fail("--text-split: '%s' is not file, line, blank or delimiter", text_split); goto usage; }
    }
    if (delimiter) {
        if (text_split && r.split != SPLIT_DELIM) { cf_fail("--delimiter goes with --text-split delimiter"); goto usage; }
        r.split = SPLIT_DELIM;
    } else if (r.split == SPLIT_DELIM) {
        cf_fail("--text-split delimiter needs --delimiter");
        goto usage;
    }
    if (no_eos && (eos_token || eos_id >= 0)) { cf_fail("--no-eos and --eos-token/--eos-id contradict"); goto usage; }
    if (!bos && (bos_token || bos_id >= 0)) { cf_fail("--bos-token/--bos-id need --bos"); goto usage; }
    for (int i = 0; i < ninputs; i++) {
        struct stat st;
        size_t k = strlen(inputs[i]);
        if (k > 3 && !strcmp(inputs[i] + k - 3, ".gz")) {
            cf_fail("%s: gzip input is not read by centrifuge tokenize (gunzip it, or use tools/prepare_data.py)",
                    inputs[i]);
            goto usage;
        }
        if (stat(inputs[i], &st) != 0 || !S_ISREG(st.st_mode)) {
            cf_fail("%s: input file not found", inputs[i]);
            code = 1;
            goto usage;
        }
        r.bytes_total += (double)st.st_size;
    }

    code = 1;
    r.out = out;
    r.field = field;
    r.delimiter = delimiter;
    r.keep_empty = keep_empty;
    r.skip_bad = skip_bad;
    r.quiet = quiet;
    r.tty = isatty(2);
    r.shard_tokens = shard_tokens;
    r.tok = cf_tokenizer_load(tok_path);
    if (!r.tok) goto fail;
    /* the tokenizer's own BOS/EOS are found as prepare_data.py finds them:
     * tokenizer_config.json, then well-known names (cf_tokenizer_load) */
    if (!no_eos && resolve_special(r.tok, "eos", eos_token, eos_id, cf_tokenizer_eos_id(r.tok), &r.eos, 1) != 0)
        goto fail;
    if (bos && resolve_special(r.tok, "bos", bos_token, bos_id, cf_tokenizer_bos_id(r.tok), &r.bos, 0) != 0)
        goto fail;
    int vocab = cf_tokenizer_vocab_size(r.tok);
    r.width = vocab <= 65536 && cf_tokenizer_max_id(r.tok) <= 65536 ? 2 : 4;

    /* the output directory, and shards of an earlier run */
    const char *slash = strrchr(out, '/');
    if (slash && slash != out) {
        char dir[4096];
        snprintf(dir, sizeof dir, "%.*s", (int)(slash - out), out);
        if (first_missing_dir(dir, made_top, sizeof made_top)) snprintf(made_dir, sizeof made_dir, "%s", dir);
        if (cf_mkdir_p(dir) != 0) goto fail;
    }
    if (find_stale(out, &stale, &nstale) != 0) goto fail;
    if (nstale && !overwrite) {
        cf_fail("%s: shards of an earlier run are there (e.g. %s); use --overwrite or another --out", out, stale[0]);
        code = 2;
        goto fail;
    }
    /* --overwrite: the earlier run's shards are moved aside, and removed only
     * once this run has succeeded; a failed run puts them back, so that it
     * loses nothing (and their manifest still describes them) */
    aside = nstale ? calloc((size_t)nstale, sizeof *aside) : NULL;
    if (nstale && !aside) { cf_fail("out of memory"); goto fail; }
    for (int i = 0; i < nstale; i++) {
        size_t n = strlen(stale[i]) + 32;
        if (!(aside[i] = cf_malloc(n))) goto fail;
        snprintf(aside[i], n, "%s.old.%016llx", stale[i], (unsigned long long)cf_random_u64());
        if (rename(stale[i], aside[i]) != 0) {
            cf_fail("%s: cannot move the earlier shard aside: %s", stale[i], strerror(errno));
            goto fail;
        }
        naside++;
    }

    struct sigaction sa, old_int, old_term;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    r.t0 = r.last_print = cf_now();
    int prc = 0;
    for (int i = 0; i < ninputs && prc == 0; i++) prc = process_file(&r, inputs[i]);
    if (prc == 0 && g_interrupted) prc = cf_fail("interrupted");
    if (prc == 0) prc = write_shard(&r);
    if (prc == 0 && r.tokens == 0) prc = cf_fail("no tokens: every input document was empty");
    if (prc == 0) prc = write_manifest(&r, cf_tokenizer_path(r.tok), inputs, ninputs);
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    if (prc != 0) {
        if (r.tty && !quiet) fputc('\n', stderr);
        /* no partial output: remove the shards this run wrote (and put back
         * those of the earlier run) */
        for (int i = 0; i < r.nshards; i++) unlink(r.shards[i]);
        for (; naside > 0; naside--) rename(aside[naside - 1], stale[naside - 1]);
        remove_made_dirs(made_dir, made_top);
        if (g_interrupted) {
            fprintf(stderr, "centrifuge %s: interrupted; the %d shard(s) of this run were removed\n", CMD, r.nshards);
            code = 130;
            goto cleanup;
        }
        goto fail;
    }
    for (int i = 0; i < naside; i++) unlink(aside[i]);   /* replaced: the new manifest is in place */
    naside = 0;
    progress(&r, 1);
    code = 0;
    if (quiet) goto cleanup;
    double dt = cf_now() - r.t0;
    if (dt < 1e-9) dt = 1e-9;
    char last[64] = "";
    if (r.nshards > 1) snprintf(last, sizeof last, " .. %s_%06d.bin", slash ? slash + 1 : out, r.nshards - 1);
    printf("tokenize: %lld documents, %lld tokens (vocab %d, %s) in %d shard%s %s_000000.bin%s; "
           "%.1f MB in %.2f s (%.1f MB/s)\n",
           r.docs, r.tokens, vocab, r.width == 2 ? "uint16" : "uint32", r.nshards, r.nshards == 1 ? "" : "s", out,
           last, r.bytes_total / 1e6, dt, r.bytes_total / 1e6 / dt);
    if (r.empty || r.bad) printf("tokenize: skipped %lld empty and %lld bad documents\n", r.empty, r.bad);
    goto cleanup;
usage:
fail:
    for (; naside > 0; naside--) rename(aside[naside - 1], stale[naside - 1]);
    remove_made_dirs(made_dir, made_top);
    cf_cli_error(CMD, code);
cleanup:
    for (int i = 0; i < nstale; i++) { free(stale[i]); if (aside) free(aside[i]); }
    free(stale);
    free(aside);
    for (int i = 0; i < r.nshards; i++) free(r.shards[i]);
    free(r.shards);
    free(r.shard_n);
    free(r.buf);
    free(r.doc);
    cf_tokenizer_free(r.tok);
    free(inputs);
    return code;
}
