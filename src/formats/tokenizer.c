/*
 * tokenizer.c — HF tokenizer.json: loading, the encode and decode pipelines,
 * and the public API of include/centrifuge_tokenizer.h.
 *
 * Encoding follows `tokenizers` step by step, so that ids are identical:
 *   1. added tokens that are special or not normalized are cut out of the
 *      raw text (leftmost-longest, lstrip/rstrip/single_word);
 *   2. each remaining piece is normalized, then the normalized added tokens
 *      are cut out of it;
 *   3. the pre-tokenizer splits each remaining piece into words;
 *   4. the BPE model turns each word into ids (tokenizer_bpe.c);
 *   5. with add_special, the post-processor adds its tokens (e.g. BOS).
 * Decoding maps ids to token strings (added tokens first), drops special
 * tokens on request and runs the decoder chain.
 *
 * Loading refuses, with one line naming it, every feature that it does not
 * implement: an unsupported file fails instead of tokenizing differently.
 */
#include "formats/tokenizer_internal.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/common.h"
#include "formats/json_util.h"

#define TOKENIZER_MAX_BYTES ((size_t)512 << 20)
#define MAX_TOKEN_ID ((1u << 31) - 2)

/* GPT-2's pre-tokenizer regex, used by ByteLevel with use_regex. */
static const char *const GPT2_REGEX =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* ------------------------------------------------------------------ types */

typedef enum { PT_SPLIT, PT_BYTELEVEL, PT_METASPACE, PT_DIGITS } pt_kind;
enum { PREPEND_NEVER = 0, PREPEND_FIRST, PREPEND_ALWAYS };

typedef struct {
    pt_kind kind;
    tk_pattern pat;             /* SPLIT, DIGITS, BYTELEVEL (use_regex), METASPACE (split) */
    int has_pat;
    int invert;
    tk_split_behavior behavior;
    int add_prefix_space;       /* BYTELEVEL */
    char rep[8];                /* METASPACE: the replacement character */
    size_t rep_len;
    int prepend, split;
} tk_pre;

typedef enum { D_BYTELEVEL, D_REPLACE, D_BYTEFALLBACK, D_FUSE, D_STRIP, D_METASPACE } dec_kind;

typedef struct {
    dec_kind kind;
    tk_pattern pat;             /* REPLACE */
    int has_pat;
    char *content;              /* REPLACE */
    size_t content_len;
    uint32_t strip_char;        /* STRIP */
    size_t start, stop;
    char rep[8];                /* METASPACE */
    size_t rep_len;
    int prepend;
} tk_dec;

/* One item of a post-processing template: the sequence ($A) or ids. */
typedef struct { int is_seq; uint32_t *ids; size_t n; } tk_titem;
typedef struct { tk_titem *items; size_t n; } tk_template;

typedef struct {
    char *content;
    size_t len;
    char *ncontent;             /* normalized content (normalized tokens) */
    size_t nlen;
    uint32_t id;
    int special, lstrip, rstrip, single_word, normalized;
} tk_added;

/* A byte trie over added-token contents (leftmost-longest matching). */
typedef struct { int32_t child, sibling, tok; unsigned char byte; } tk_tnode;
typedef struct { tk_tnode *v; size_t n, cap; unsigned char first[256]; int empty; } tk_trie;

typedef struct { size_t off, len; int32_t id; int first; } tk_piece;
typedef struct { tk_buf text; tk_piece *p; size_t n, cap; } tk_plist;

typedef struct { const char *s; uint32_t len; int present, special; } tk_idtok;

struct cf_tokenizer {
    char *path;
    tk_bpe bpe;
    tk_added *added;
    size_t nadded;
    tk_strmap added_map;        /* content -> index into added */
    tk_trie raw_trie, norm_trie;
    tk_norm *norm;
    size_t nnorm;
    tk_pre *pre;
    size_t npre;
    tk_template *post;
    size_t npost;
    tk_dec *dec;
    size_t ndec;
    int has_decoder;
    tk_idtok *idtok;
    size_t nids;                /* max id + 1 */
    int vocab_size;
    int bos_id, eos_id;
    /* scratch */
    tk_plist pl[2];
    tk_buf nb, nt, wb;
    tk_segs segs;
};

/* Bytes <-> the printable characters of GPT-2's byte-level alphabet. */
static uint32_t g_byte_char[256];
static int g_char_byte[324];   /* code point -> byte, -1 if none */

static void init_byte_level(void) {
    if (g_byte_char['!']) return;
    int n = 0;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        g_byte_char[b] = printable ? (uint32_t)b : (uint32_t)(256 + n++);
    }
    for (int c = 0; c < 324; c++) g_char_byte[c] = -1;
    for (int b = 0; b < 256; b++) g_char_byte[g_byte_char[b]] = b;
}

/* ------------------------------------------------------------ JSON helpers */

static const cJSON *jget(const cJSON *o, const char *key) {
    return cJSON_IsObject(o) ? cJSON_GetObjectItemCaseSensitive(o, key) : NULL;
}

/* A boolean field; absent or null gives def. */
static int jbool(const char *path, const char *where, const cJSON *o, const char *key, int def, int *out) {
    const cJSON *v = jget(o, key);
    if (!v || cJSON_IsNull(v)) { *out = def; return 0; }
    if (!cJSON_IsBool(v)) return cf_fail("%s: %s.%s must be a boolean, got %s", path, where, key, cf_json_kind(v));
    *out = cJSON_IsTrue(v);
    return 0;
}

/* A string field; absent or null gives NULL. */
static int jstr(const char *path, const char *where, const cJSON *o, const char *key, const char **out) {
    const cJSON *v = jget(o, key);
    *out = NULL;
    if (!v || cJSON_IsNull(v)) return 0;
    if (!cJSON_IsString(v)) return cf_fail("%s: %s.%s must be a string, got %s", path, where, key, cf_json_kind(v));
    *out = v->valuestring;
    return 0;
}

/* A non-negative integer field; absent or null gives def. */
static int jint(const char *path, const char *where, const cJSON *o, const char *key, double max, long def,
                long *out) {
    const cJSON *v = jget(o, key);
    if (!v || cJSON_IsNull(v)) { *out = def; return 0; }
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble > max || v->valuedouble != (double)(long)v->valuedouble)
        return cf_fail("%s: %s.%s must be an integer in [0, %.0f]", path, where, key, max);
    *out = (long)v->valuedouble;
    return 0;
}

/* The "type" of a component, which must be a string. */
static int jtype(const char *path, const char *where, const cJSON *o, const char **out) {
    if (!cJSON_IsObject(o)) return cf_fail("%s: %s must be an object or null, got %s", path, where, cf_json_kind(o));
    if (jstr(path, where, o, "type", out) != 0) return -1;
    if (!*out) return cf_fail("%s: %s has no \"type\"", path, where);
    return 0;
}

static char *dup_str(const char *s, size_t n) {
    char *d = cf_malloc(n + 1);
    if (!d) return NULL;
    memcpy(d, s, n);
    d[n] = 0;
    return d;
}

/* A single character given as a JSON string (Metaspace replacement, Strip
 * content); returns its UTF-8 in out. */
static int jchar(const char *path, const char *where, const cJSON *o, const char *key, const char *def, char out[8],
                 size_t *len) {
    const char *s;
    if (jstr(path, where, o, key, &s) != 0) return -1;
    if (!s) s = def;
    if (!s) return cf_fail("%s: %s has no \"%s\"", path, where, key);
    size_t n = strlen(s);
    if (n == 0 || n > 4 || cf_utf8_valid_prefix(s, n) != n) goto bad;
    size_t i = 0;
    (void)tk_utf8_next(s, &i);
    if (i != n) goto bad;
    memcpy(out, s, n);
    out[n] = 0;
    *len = n;
    return 0;
bad:
    return cf_fail("%s: %s.%s must be a single character", path, where, key);
}

/* A {"String": s} or {"Regex": r} pattern. */
static int jpattern(const char *path, const char *where, const cJSON *o, tk_pattern *p) {
    const cJSON *v = jget(o, "pattern");
    char w[160];
    snprintf(w, sizeof w, "%s.pattern", where);
    if (!cJSON_IsObject(v)) return cf_fail("%s: %s must be {\"String\": ...} or {\"Regex\": ...}", path, w);
    const cJSON *s = jget(v, "String"), *r = jget(v, "Regex");
    if (s && cJSON_IsString(s)) {
        if (!*s->valuestring) return cf_fail("%s: %s is an empty string (not supported)", path, w);
        return tk_pattern_string(p, s->valuestring, strlen(s->valuestring));
    }
    if (r && cJSON_IsString(r)) {
        char at[200];
        snprintf(at, sizeof at, "%s: %s", path, w);
        return tk_pattern_regex(p, r->valuestring, at);
    }
    return cf_fail("%s: %s must be {\"String\": ...} or {\"Regex\": ...}", path, w);
}

/* -------------------------------------------------------------- normalizer */

static int load_normalizer(cf_tokenizer *t, const cJSON *o, const char *where) {
    if (!o || cJSON_IsNull(o)) return 0;
    const char *type;
    if (jtype(t->path, where, o, &type) != 0) return -1;
    if (!strcmp(type, "Sequence")) {
        const cJSON *list = jget(o, "normalizers");
        if (!cJSON_IsArray(list)) return cf_fail("%s: %s.normalizers must be an array", t->path, where);
        int k = 0;
        for (const cJSON *e = list->child; e; e = e->next, k++) {
            char w[160];
            snprintf(w, sizeof w, "%s.normalizers[%d]", where, k);
            if (load_normalizer(t, e, w) != 0) return -1;
        }
        return 0;
    }
    tk_norm st;
    memset(&st, 0, sizeof st);
    if (!strcmp(type, "NFC")) st.kind = TK_N_NFC;
    else if (!strcmp(type, "NFD")) st.kind = TK_N_NFD;
    else if (!strcmp(type, "NFKC")) st.kind = TK_N_NFKC;
    else if (!strcmp(type, "NFKD")) st.kind = TK_N_NFKD;
    else if (!strcmp(type, "Lowercase")) st.kind = TK_N_LOWERCASE;
    else if (!strcmp(type, "StripAccents")) st.kind = TK_N_STRIP_ACCENTS;
    else if (!strcmp(type, "Strip")) {
        st.kind = TK_N_STRIP;
        if (jbool(t->path, where, o, "strip_left", 1, &st.left) != 0) return -1;
        if (jbool(t->path, where, o, "strip_right", 1, &st.right) != 0) return -1;
    } else if (!strcmp(type, "Prepend")) {
        const char *s;
        st.kind = TK_N_PREPEND;
        if (jstr(t->path, where, o, "prepend", &s) != 0) return -1;
        if (!s) return cf_fail("%s: %s (Prepend) has no \"prepend\"", t->path, where);
        st.str_len = strlen(s);
        if (!(st.str = dup_str(s, st.str_len))) return -1;
    } else if (!strcmp(type, "Replace")) {
        const char *s;
        st.kind = TK_N_REPLACE;
        if (jstr(t->path, where, o, "content", &s) != 0) return -1;
        if (!s) return cf_fail("%s: %s (Replace) has no \"content\"", t->path, where);
        st.str_len = strlen(s);
        if (!(st.str = dup_str(s, st.str_len))) return -1;
        if (jpattern(t->path, where, o, &st.pat) != 0) { free(st.str); return -1; }
    } else {
        char safe[65];
        return cf_fail("%s: %s: normalizer type '%s' is not supported (supported: Sequence, Prepend, Replace, NFC, "
                       "NFD, NFKC, NFKD, Lowercase, Strip, StripAccents)",
                       t->path, where, cf_printable(type, safe, sizeof safe));
    }
    tk_norm *v = realloc(t->norm, (t->nnorm + 1) * sizeof *v);
    if (!v) {
        free(st.str);
        tk_pattern_free(&st.pat);
        return cf_fail("out of memory");
    }
    t->norm = v;
    t->norm[t->nnorm++] = st;
    return 0;
}

/* ----------------------------------------------------------- pre-tokenizer */

static int prepend_scheme(const char *path, const char *where, const cJSON *o, int *out) {
    const char *s;
    if (jstr(path, where, o, "prepend_scheme", &s) != 0) return -1;
    if (s) {
        if (!strcmp(s, "always")) *out = PREPEND_ALWAYS;
        else if (!strcmp(s, "first")) *out = PREPEND_FIRST;
        else if (!strcmp(s, "never")) *out = PREPEND_NEVER;
        else return cf_fail("%s: %s.prepend_scheme must be always, first or never", path, where);
        return 0;
    }
    int aps;   /* files written before prepend_scheme existed */
    if (jbool(path, where, o, "add_prefix_space", 1, &aps) != 0) return -1;
    *out = aps ? PREPEND_ALWAYS : PREPEND_NEVER;
    return 0;
}

static int push_pre(cf_tokenizer *t, tk_pre *st) {
    tk_pre *v = realloc(t->pre, (t->npre + 1) * sizeof *v);
    if (!v) {
        tk_pattern_free(&st->pat);
        return cf_fail("out of memory");
    }
    t->pre = v;
    t->pre[t->npre++] = *st;
    return 0;
}

static int load_pre(cf_tokenizer *t, const cJSON *o, const char *where) {
    if (!o || cJSON_IsNull(o)) return 0;
    const char *type;
    if (jtype(t->path, where, o, &type) != 0) return -1;
    tk_pre st;
    memset(&st, 0, sizeof st);
    if (!strcmp(type, "Sequence")) {
        const cJSON *list = jget(o, "pretokenizers");
        if (!cJSON_IsArray(list)) return cf_fail("%s: %s.pretokenizers must be an array", t->path, where);
        int k = 0;
        for (const cJSON *e = list->child; e; e = e->next, k++) {
            char w[160];
            snprintf(w, sizeof w, "%s.pretokenizers[%d]", where, k);
            if (load_pre(t, e, w) != 0) return -1;
        }
        return 0;
    }
    if (!strcmp(type, "Split")) {
        const char *b;
        st.kind = PT_SPLIT;
        if (jbool(t->path, where, o, "invert", 0, &st.invert) != 0) return -1;
        if (jstr(t->path, where, o, "behavior", &b) != 0) return -1;
        if (!b) return cf_fail("%s: %s (Split) has no \"behavior\"", t->path, where);
        if (!strcmp(b, "Removed")) st.behavior = TK_SPLIT_REMOVED;
        else if (!strcmp(b, "Isolated")) st.behavior = TK_SPLIT_ISOLATED;
        else if (!strcmp(b, "MergedWithPrevious")) st.behavior = TK_SPLIT_MERGED_PREV;
        else if (!strcmp(b, "MergedWithNext")) st.behavior = TK_SPLIT_MERGED_NEXT;
        else if (!strcmp(b, "Contiguous")) st.behavior = TK_SPLIT_CONTIGUOUS;
        else {
            char safe[65];
            return cf_fail("%s: %s.behavior '%s' is not a split behaviour (Removed, Isolated, MergedWithPrevious, "
                           "MergedWithNext, Contiguous)", t->path, where, cf_printable(b, safe, sizeof safe));
        }
        if (jpattern(t->path, where, o, &st.pat) != 0) return -1;
        st.has_pat = 1;
        return push_pre(t, &st);
    }
    if (!strcmp(type, "ByteLevel")) {
        int use_regex;
        st.kind = PT_BYTELEVEL;
        if (jbool(t->path, where, o, "add_prefix_space", 1, &st.add_prefix_space) != 0) return -1;
        if (jbool(t->path, where, o, "use_regex", 1, &use_regex) != 0) return -1;
        if (use_regex) {
            char at[200];
            snprintf(at, sizeof at, "%s: %s", t->path, where);
            if (tk_pattern_regex(&st.pat, GPT2_REGEX, at) != 0) return -1;
            st.has_pat = 1;
        }
        init_byte_level();
        return push_pre(t, &st);
    }
    if (!strcmp(type, "Metaspace")) {
        st.kind = PT_METASPACE;
        if (jchar(t->path, where, o, "replacement", NULL, st.rep, &st.rep_len) != 0) return -1;
        if (prepend_scheme(t->path, where, o, &st.prepend) != 0) return -1;
        if (jbool(t->path, where, o, "split", 1, &st.split) != 0) return -1;
        if (st.split) {
            if (tk_pattern_string(&st.pat, st.rep, st.rep_len) != 0) return -1;
            st.pat.kind = TK_PAT_CHAR;
            st.has_pat = 1;
        }
        return push_pre(t, &st);
    }
    if (!strcmp(type, "Digits")) {
        int individual;
        st.kind = PT_DIGITS;
        if (jbool(t->path, where, o, "individual_digits", 0, &individual) != 0) return -1;
        st.behavior = individual ? TK_SPLIT_ISOLATED : TK_SPLIT_CONTIGUOUS;
        st.pat.kind = TK_PAT_NUMERIC;
        st.has_pat = 1;
        return push_pre(t, &st);
    }
    char safe[65];
    return cf_fail("%s: %s: pre-tokenizer type '%s' is not supported (supported: Sequence, Split, ByteLevel, "
                   "Metaspace, Digits)", t->path, where, cf_printable(type, safe, sizeof safe));
}

/* ------------------------------------------------------------------- model */

static int load_bpe(cf_tokenizer *t, const cJSON *m) {
    const char *path = t->path;
    tk_bpe *b = &t->bpe;
    b->unk_id = -1;
    for (int i = 0; i < 256; i++) b->byte_id[i] = -1;
    if (!cJSON_IsObject(m)) return cf_fail("%s: \"model\" must be an object", path);
    const char *type;
    if (jstr(path, "model", m, "type", &type) != 0) return -1;
    if (!type && !jget(m, "merges"))
        return cf_fail("%s: model has no \"type\" (only BPE models are supported)", path);
    if (type && strcmp(type, "BPE") != 0) {
        char safe[65];
        return cf_fail("%s: model type '%s' is not supported (only BPE: Llama, Mistral, Qwen, GPT-2 style)", path,
                       cf_printable(type, safe, sizeof safe));
    }
    const cJSON *drop = jget(m, "dropout");
    if (drop && !cJSON_IsNull(drop) && !(cJSON_IsNumber(drop) && drop->valuedouble == 0))
        return cf_fail("%s: model.dropout (BPE dropout) is not supported: it makes tokenization random", path);
    if (jbool(path, "model", m, "fuse_unk", 0, &b->fuse_unk) != 0) return -1;
    if (jbool(path, "model", m, "byte_fallback", 0, &b->byte_fallback) != 0) return -1;
    if (jbool(path, "model", m, "ignore_merges", 0, &b->ignore_merges) != 0) return -1;
    const char *prefix, *suffix, *unk;
    if (jstr(path, "model", m, "continuing_subword_prefix", &prefix) != 0) return -1;
    if (jstr(path, "model", m, "end_of_word_suffix", &suffix) != 0) return -1;
    if (jstr(path, "model", m, "unk_token", &unk) != 0) return -1;
    if (prefix && *prefix) {
        b->prefix_len = strlen(prefix);
        if (!(b->prefix = dup_str(prefix, b->prefix_len))) return -1;
    }
    if (suffix && *suffix) {
        b->suffix_len = strlen(suffix);
        if (!(b->suffix = dup_str(suffix, b->suffix_len))) return -1;
    }

    const cJSON *vocab = jget(m, "vocab");
    if (!cJSON_IsObject(vocab)) return cf_fail("%s: model.vocab must be an object {token: id}", path);
    for (const cJSON *e = vocab->child; e; e = e->next) {
        char safe[65];
        if (!cJSON_IsNumber(e) || e->valuedouble < 0 || e->valuedouble > MAX_TOKEN_ID ||
            e->valuedouble != (double)(uint32_t)e->valuedouble)
            return cf_fail("%s: model.vocab['%s'] must be a token id (an integer >= 0)", path,
                           cf_printable(e->string, safe, sizeof safe));
        int dup;
        if (tk_strmap_put(&b->vocab, e->string, strlen(e->string), (uint32_t)e->valuedouble, &dup) != 0) {
            if (dup) return cf_fail("%s: model.vocab has '%s' twice", path, cf_printable(e->string, safe, sizeof safe));
            return -1;
        }
    }
    if (b->vocab.n == 0) return cf_fail("%s: model.vocab is empty", path);

    if (unk) {
        uint32_t id;
        char safe[65];
        if (tk_strmap_get(&b->vocab, unk, strlen(unk), &id) != 0)
            return cf_fail("%s: model.unk_token '%s' is not in the vocabulary", path, cf_printable(unk, safe, sizeof safe));
        b->unk_id = (int32_t)id;
    }
    if (b->byte_fallback)
        for (int i = 0; i < 256; i++) {
            char name[8];
            uint32_t id;
            snprintf(name, sizeof name, "<0x%02X>", i);
            if (tk_strmap_get(&b->vocab, name, 6, &id) == 0) b->byte_id[i] = (int32_t)id;
        }

    const cJSON *merges = jget(m, "merges");
    if (!merges || cJSON_IsNull(merges)) { tk_bpe_check_split(b); return 0; }
    if (!cJSON_IsArray(merges)) return cf_fail("%s: model.merges must be an array", path);
    tk_buf cat = {0};
    size_t k = 0;
    int rc = 0;
    for (const cJSON *e = merges->child; e && rc == 0; e = e->next, k++) {
        const char *a, *bb;
        size_t alen, blen;
        if (cJSON_IsString(e)) {
            /* "a b": exactly one space, as tokenizers requires */
            const char *s = e->valuestring, *sp = strchr(s, ' ');
            if (!sp || strchr(sp + 1, ' ')) {
                char safe[65];
                rc = cf_fail("%s: model.merges[%zu] '%s' is not two tokens separated by one space", path, k,
                             cf_printable(s, safe, sizeof safe));
                break;
            }
            a = s; alen = (size_t)(sp - s);
            bb = sp + 1; blen = strlen(bb);
        } else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 && cJSON_IsString(e->child) &&
                   cJSON_IsString(e->child->next)) {
            a = e->child->valuestring; alen = strlen(a);
            bb = e->child->next->valuestring; blen = strlen(bb);
        } else {
            rc = cf_fail("%s: model.merges[%zu] must be \"a b\" or [\"a\", \"b\"], got %s", path, k, cf_json_kind(e));
            break;
        }
        uint32_t ia, ib, in;
        cat.len = 0;
        const char *rest = bb;
        size_t rlen = blen;
        if (b->prefix_len && blen >= b->prefix_len && memcmp(bb, b->prefix, b->prefix_len) == 0) {
            rest += b->prefix_len;
            rlen -= b->prefix_len;
        }
        if (tk_buf_put(&cat, a, alen) != 0 || tk_buf_put(&cat, rest, rlen) != 0) { rc = -1; break; }
        const char *missing = NULL;
        size_t mlen = 0;
        if (tk_strmap_get(&b->vocab, a, alen, &ia) != 0) { missing = a; mlen = alen; }
        else if (tk_strmap_get(&b->vocab, bb, blen, &ib) != 0) { missing = bb; mlen = blen; }
        else if (tk_strmap_get(&b->vocab, cat.s, cat.len, &in) != 0) { missing = cat.s; mlen = cat.len; }
        if (missing) {
            char tokbuf[65], safe[65];
            size_t c = CF_MIN(mlen, sizeof tokbuf - 1);
            memcpy(tokbuf, missing, c);
            tokbuf[c] = 0;
            rc = cf_fail("%s: model.merges[%zu]: token '%s' is not in the vocabulary", path, k,
                         cf_printable(tokbuf, safe, sizeof safe));
            break;
        }
        if (k > UINT32_MAX - 1) { rc = cf_fail("%s: too many merges", path); break; }
        rc = tk_pairmap_put(&b->merges, ia, ib, (uint32_t)k, in);
    }
    tk_buf_free(&cat);
    if (rc == 0) tk_bpe_check_split(b);
    return rc;
}

/* ------------------------------------------------------------ added tokens */

static int trie_node(tk_trie *tr, unsigned char byte) {
    if (tr->n == tr->cap) {
        size_t cap = tr->cap ? tr->cap * 2 : 256;
        tk_tnode *v = realloc(tr->v, cap * sizeof *v);
        if (!v) return cf_fail("out of memory (added-token trie)");
        tr->v = v;
        tr->cap = cap;
    }
    tr->v[tr->n] = (tk_tnode){-1, -1, -1, byte};
    return (int)tr->n++;
}

static int trie_add(tk_trie *tr, const char *s, size_t n, int tok) {
    if (tr->n == 0 && trie_node(tr, 0) < 0) return -1;
    int cur = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        int ch = tr->v[cur].child;
        while (ch >= 0 && tr->v[ch].byte != c) ch = tr->v[ch].sibling;
        if (ch < 0) {
            if ((ch = trie_node(tr, c)) < 0) return -1;
            tr->v[ch].sibling = tr->v[cur].child;
            tr->v[cur].child = ch;
        }
        cur = ch;
    }
    if (tr->v[cur].tok < 0) tr->v[cur].tok = tok;   /* same content twice: the first one */
    tr->first[(unsigned char)s[0]] = 1;
    tr->empty = 0;
    return 0;
}

/* The longest added token starting at s[0, n): its index, *len its bytes. */
static int trie_longest(const tk_trie *tr, const char *s, size_t n, size_t *len) {
    int cur = 0, best = -1;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        int ch = tr->v[cur].child;
        while (ch >= 0 && tr->v[ch].byte != c) ch = tr->v[ch].sibling;
        if (ch < 0) break;
        cur = ch;
        if (tr->v[cur].tok >= 0) { best = tr->v[cur].tok; *len = i + 1; }
    }
    return best;
}

/* Added tokens get their ids as tokenizers gives them: the model's id when
 * the content is in the vocabulary, else the next id after the vocabulary,
 * in file order. A file whose "id" fields disagree is refused (tokenizers
 * would silently use its own ids). A content listed twice keeps its first
 * id and takes the later flags, as in tokenizers. */
static int load_added(cf_tokenizer *t, const cJSON *list) {
    if (!list || cJSON_IsNull(list)) return 0;
    if (!cJSON_IsArray(list)) return cf_fail("%s: added_tokens must be an array", t->path);
    size_t n = (size_t)cJSON_GetArraySize(list), k = 0;
    t->added = cf_calloc(n ? n : 1, sizeof *t->added);
    if (!t->added) return -1;
    uint32_t next_id = (uint32_t)t->bpe.vocab.n;
    for (const cJSON *e = list->child; e; e = e->next, k++) {
        char where[48];
        snprintf(where, sizeof where, "added_tokens[%zu]", k);
        if (!cJSON_IsObject(e)) return cf_fail("%s: %s must be an object", t->path, where);
        const char *content;
        long id = 0;
        tk_added a;
        memset(&a, 0, sizeof a);
        if (jstr(t->path, where, e, "content", &content) != 0) return -1;
        if (!content) return cf_fail("%s: %s has no \"content\"", t->path, where);
        if (!jget(e, "id")) return cf_fail("%s: %s has no \"id\"", t->path, where);
        if (jint(t->path, where, e, "id", MAX_TOKEN_ID, 0, &id) != 0) return -1;
        if (jbool(t->path, where, e, "special", 0, &a.special) != 0) return -1;
        if (jbool(t->path, where, e, "lstrip", 0, &a.lstrip) != 0) return -1;
        if (jbool(t->path, where, e, "rstrip", 0, &a.rstrip) != 0) return -1;
        if (jbool(t->path, where, e, "single_word", 0, &a.single_word) != 0) return -1;
        if (jbool(t->path, where, e, "normalized", !a.special, &a.normalized) != 0) return -1;
        if (!*content) continue;   /* tokenizers ignores empty added tokens */
        a.len = strlen(content);
        uint32_t v, expect;
        const char *why;
        int known = tk_strmap_get(&t->added_map, content, a.len, &v) == 0;
        if (known) {
            expect = t->added[v].id;
            why = "the id of its first listing";
        } else if (tk_strmap_get(&t->bpe.vocab, content, a.len, &expect) == 0) {
            why = "its id in model.vocab";
        } else {
            expect = next_id++;
            why = "added tokens outside the vocabulary are numbered from its size on, in file order";
        }
        if ((uint32_t)id != expect) {
            char safe[65];
            return cf_fail("%s: %s '%s' has id %ld, but tokenizers gives it id %u (%s): the file is inconsistent",
                           t->path, where, cf_printable(content, safe, sizeof safe), id, expect, why);
        }
        a.id = expect;
        if (known) {   /* later flags win */
            tk_added *old = &t->added[v];
            old->special |= a.special;   /* stays in the special set */
            old->lstrip = a.lstrip; old->rstrip = a.rstrip;
            old->single_word = a.single_word; old->normalized = a.normalized;
            continue;
        }
        if (!(a.content = dup_str(content, a.len))) return -1;
        if (tk_strmap_put(&t->added_map, a.content, a.len, (uint32_t)t->nadded, NULL) != 0) {
            free(a.content);
            return -1;
        }
        t->added[t->nadded++] = a;
    }
    return 0;
}

/* Builds the two tries; normalized tokens are matched in normalized text,
 * so their content is normalized first (as tokenizers does). */
static int build_added(cf_tokenizer *t) {
    t->raw_trie.empty = t->norm_trie.empty = 1;
    for (size_t i = 0; i < t->nadded; i++) {
        tk_added *a = &t->added[i];
        if (!a->normalized) {
            if (trie_add(&t->raw_trie, a->content, a->len, (int)i) != 0) return -1;
            continue;
        }
        if (tk_normalize(t->norm, t->nnorm, a->content, a->len, &t->nb, &t->nt) != 0) return -1;
        if (!(a->ncontent = dup_str(t->nb.s ? t->nb.s : "", t->nb.len))) return -1;
        a->nlen = t->nb.len;
        if (a->nlen && trie_add(&t->norm_trie, a->ncontent, a->nlen, (int)i) != 0) return -1;
    }
    return 0;
}

/* --------------------------------------------------------- post-processor */

static int push_template(cf_tokenizer *t, tk_template *tp) {
    tk_template *v = realloc(t->post, (t->npost + 1) * sizeof *v);
    if (!v) {
        for (size_t i = 0; i < tp->n; i++) free(tp->items[i].ids);
        free(tp->items);
        return cf_fail("out of memory");
    }
    t->post = v;
    t->post[t->npost++] = *tp;
    return 0;
}

static void free_template(tk_template *tp) {
    for (size_t i = 0; i < tp->n; i++) free(tp->items[i].ids);
    free(tp->items);
    memset(tp, 0, sizeof *tp);
}

static int template_add(tk_template *tp, int is_seq, const uint32_t *ids, size_t n) {
    tk_titem *v = realloc(tp->items, (tp->n + 1) * sizeof *v);
    if (!v) return cf_fail("out of memory");
    tp->items = v;
    tk_titem it = {is_seq, NULL, n};
    if (n) {
        if (!(it.ids = cf_malloc(n * sizeof *ids))) return -1;
        memcpy(it.ids, ids, n * sizeof *ids);
    }
    tp->items[tp->n++] = it;
    return 0;
}

/* BertProcessing / RobertaProcessing: "cls": [token, id], "sep": [token, id]. */
static int special_pair(const char *path, const char *where, const cJSON *o, const char *key, uint32_t *id) {
    const cJSON *v = jget(o, key);
    if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) != 2 || !cJSON_IsNumber(v->child->next) ||
        v->child->next->valuedouble < 0 || v->child->next->valuedouble > MAX_TOKEN_ID)
        return cf_fail("%s: %s.%s must be [token, id]", path, where, key);
    *id = (uint32_t)v->child->next->valuedouble;
    return 0;
}

static int load_template(cf_tokenizer *t, const cJSON *o, const char *where) {
    const cJSON *single = jget(o, "single"), *specials = jget(o, "special_tokens");
    if (!cJSON_IsArray(single)) return cf_fail("%s: %s.single must be an array", t->path, where);
    tk_template tp = {0};
    int k = 0;
    for (const cJSON *e = single->child; e; e = e->next, k++) {
        const cJSON *sp = jget(e, "SpecialToken"), *sq = jget(e, "Sequence");
        if (sq) {
            const char *id;
            if (jstr(t->path, where, sq, "id", &id) != 0) goto fail;
            if (!id || strcmp(id, "A") != 0) {
                cf_fail("%s: %s.single[%d] refers to sequence %s (a single template has only A)", t->path, where,
                        k, id ? id : "?");
                goto fail;
            }
            if (template_add(&tp, 1, NULL, 0) != 0) goto fail;
        } else if (sp) {
            const char *name;
            if (jstr(t->path, where, sp, "id", &name) != 0) goto fail;
            const cJSON *def = name ? jget(specials, name) : NULL;
            const cJSON *ids = jget(def, "ids");
            char safe[65];
            if (!cJSON_IsArray(ids)) {
                cf_fail("%s: %s.single[%d]: special token '%s' is not in special_tokens", t->path, where, k,
                        name ? cf_printable(name, safe, sizeof safe) : "?");
                goto fail;
            }
            size_t n = (size_t)cJSON_GetArraySize(ids), j = 0;
            uint32_t *v = cf_malloc((n ? n : 1) * sizeof *v);
            if (!v) goto fail;
            for (const cJSON *x = ids->child; x; x = x->next, j++) {
                if (!cJSON_IsNumber(x) || x->valuedouble < 0 || x->valuedouble > MAX_TOKEN_ID) {
                    free(v);
                    cf_fail("%s: %s.special_tokens['%s'].ids must hold token ids", t->path, where,
                            cf_printable(name, safe, sizeof safe));
                    goto fail;
                }
                v[j] = (uint32_t)x->valuedouble;
            }
            int rc = template_add(&tp, 0, v, n);
            free(v);
            if (rc != 0) goto fail;
        } else {
            cf_fail("%s: %s.single[%d] must be {\"SpecialToken\": ...} or {\"Sequence\": ...}", t->path, where, k);
            goto fail;
        }
    }
    return push_template(t, &tp);
fail:
    free_template(&tp);
    return -1;
}

static int load_post(cf_tokenizer *t, const cJSON *o, const char *where) {
    if (!o || cJSON_IsNull(o)) return 0;
    const char *type;
    if (jtype(t->path, where, o, &type) != 0) return -1;
    if (!strcmp(type, "Sequence")) {
        const cJSON *list = jget(o, "processors");
        if (!cJSON_IsArray(list)) return cf_fail("%s: %s.processors must be an array", t->path, where);
        int k = 0;
        for (const cJSON *e = list->child; e; e = e->next, k++) {
            char w[160];
            snprintf(w, sizeof w, "%s.processors[%d]", where, k);
            if (load_post(t, e, w) != 0) return -1;
        }
        return 0;
    }
    if (!strcmp(type, "ByteLevel")) return 0;   /* offsets only: no ids change */
    if (!strcmp(type, "TemplateProcessing")) return load_template(t, o, where);
    if (!strcmp(type, "BertProcessing") || !strcmp(type, "RobertaProcessing")) {
        uint32_t cls, sep;
        if (special_pair(t->path, where, o, "cls", &cls) != 0) return -1;
        if (special_pair(t->path, where, o, "sep", &sep) != 0) return -1;
        tk_template tp = {0};
        if (template_add(&tp, 0, &cls, 1) != 0 || template_add(&tp, 1, NULL, 0) != 0 ||
            template_add(&tp, 0, &sep, 1) != 0) {
            free_template(&tp);
            return -1;
        }
        return push_template(t, &tp);
    }
    char safe[65];
    return cf_fail("%s: %s: post-processor type '%s' is not supported (supported: Sequence, TemplateProcessing, "
                   "ByteLevel, BertProcessing, RobertaProcessing)", t->path, where, cf_printable(type, safe, sizeof safe));
}

/* ----------------------------------------------------------------- decoder */

static int push_dec(cf_tokenizer *t, tk_dec *d) {
    tk_dec *v = realloc(t->dec, (t->ndec + 1) * sizeof *v);
    if (!v) {
        tk_pattern_free(&d->pat);
        free(d->content);
        return cf_fail("out of memory");
    }
    t->dec = v;
    t->dec[t->ndec++] = *d;
    return 0;
}

static int load_decoder(cf_tokenizer *t, const cJSON *o, const char *where) {
    if (!o || cJSON_IsNull(o)) return 0;
    const char *type;
    if (jtype(t->path, where, o, &type) != 0) return -1;
    t->has_decoder = 1;
    tk_dec d;
    memset(&d, 0, sizeof d);
    if (!strcmp(type, "Sequence")) {
        const cJSON *list = jget(o, "decoders");
        if (!cJSON_IsArray(list)) return cf_fail("%s: %s.decoders must be an array", t->path, where);
        int k = 0;
        for (const cJSON *e = list->child; e; e = e->next, k++) {
            char w[160];
            snprintf(w, sizeof w, "%s.decoders[%d]", where, k);
            if (load_decoder(t, e, w) != 0) return -1;
        }
        return 0;
    }
    if (!strcmp(type, "ByteLevel")) { d.kind = D_BYTELEVEL; init_byte_level(); return push_dec(t, &d); }
    if (!strcmp(type, "ByteFallback")) { d.kind = D_BYTEFALLBACK; return push_dec(t, &d); }
    if (!strcmp(type, "Fuse")) { d.kind = D_FUSE; return push_dec(t, &d); }
    if (!strcmp(type, "Replace")) {
        const char *s;
        d.kind = D_REPLACE;
        if (jstr(t->path, where, o, "content", &s) != 0) return -1;
        if (!s) return cf_fail("%s: %s (Replace) has no \"content\"", t->path, where);
        d.content_len = strlen(s);
        if (!(d.content = dup_str(s, d.content_len))) return -1;
        if (jpattern(t->path, where, o, &d.pat) != 0) { free(d.content); return -1; }
        d.has_pat = 1;
        return push_dec(t, &d);
    }
    if (!strcmp(type, "Strip")) {
        char c[8];
        size_t n;
        long start = 0, stop = 0;
        d.kind = D_STRIP;
        if (jchar(t->path, where, o, "content", NULL, c, &n) != 0) return -1;
        size_t i = 0;
        d.strip_char = tk_utf8_next(c, &i);
        if (jint(t->path, where, o, "start", 1e9, 0, &start) != 0) return -1;
        if (jint(t->path, where, o, "stop", 1e9, 0, &stop) != 0) return -1;
        d.start = (size_t)start;
        d.stop = (size_t)stop;
        return push_dec(t, &d);
    }
    if (!strcmp(type, "Metaspace")) {
        d.kind = D_METASPACE;
        if (jchar(t->path, where, o, "replacement", NULL, d.rep, &d.rep_len) != 0) return -1;
        if (prepend_scheme(t->path, where, o, &d.prepend) != 0) return -1;
        return push_dec(t, &d);
    }
    char safe[65];
    return cf_fail("%s: %s: decoder type '%s' is not supported (supported: Sequence, ByteLevel, Replace, "
                   "ByteFallback, Fuse, Strip, Metaspace)", t->path, where, cf_printable(type, safe, sizeof safe));
}

/* -------------------------------------------------------- special tokens */

/* bos_token / eos_token of a tokenizer_config.json beside the tokenizer. */
static char *config_special(const char *tok_path, const char *key) {
    const char *slash = strrchr(tok_path, '/');
    size_t dlen = slash ? (size_t)(slash - tok_path) : 0;
    char *cfg = cf_malloc(dlen + 32);
    if (!cfg) return NULL;
    if (slash) {
        memcpy(cfg, tok_path, dlen);
        strcpy(cfg + dlen, "/tokenizer_config.json");
    } else {
        strcpy(cfg, "tokenizer_config.json");
    }
    char saved[1024];
    snprintf(saved, sizeof saved, "%s", cf_last_error());
    size_t len;
    char *text = cf_path_exists(cfg) ? cf_read_file(cfg, &len, (size_t)64 << 20) : NULL;
    free(cfg);
    char *out = NULL;
    if (text) {
        cJSON *root = cJSON_ParseWithLength(text, len);
        const cJSON *v = jget(root, key);
        if (cJSON_IsObject(v)) v = jget(v, "content");
        if (cJSON_IsString(v) && *v->valuestring) out = dup_str(v->valuestring, strlen(v->valuestring));
        cJSON_Delete(root);
        free(text);
    }
    cf_fail("%s", saved);   /* an unreadable config is not an error */
    return out;
}

static int resolve_special(cf_tokenizer *t, const char *key, const char *const *guesses) {
    char *name = config_special(t->path, key);
    int id = name ? cf_tokenizer_token_id(t, name) : -1;
    free(name);
    for (size_t i = 0; id < 0 && guesses[i]; i++) id = cf_tokenizer_token_id(t, guesses[i]);
    return id;
}

/* ------------------------------------------------------------------- load */

static int build_id_table(cf_tokenizer *t) {
    uint32_t max = 0;
    for (size_t i = 0; i < t->bpe.vocab.n; i++) max = CF_MAX(max, t->bpe.vocab.e[i].val);
    for (size_t i = 0; i < t->nadded; i++) max = CF_MAX(max, t->added[i].id);
    t->nids = (size_t)max + 1;
    t->idtok = cf_calloc(t->nids, sizeof *t->idtok);
    if (!t->idtok) return -1;
    for (size_t i = 0; i < t->bpe.vocab.n; i++) {
        uint32_t len;
        const char *s = tk_strmap_key(&t->bpe.vocab, i, &len);
        tk_idtok *e = &t->idtok[t->bpe.vocab.e[i].val];
        if (e->present) {
            char safe[65];
            return cf_fail("%s: model.vocab gives id %u to two tokens (e.g. '%s')", t->path, t->bpe.vocab.e[i].val,
                           cf_printable(s, safe, sizeof safe));
        }
        *e = (tk_idtok){s, len, 1, 0};
    }
    /* distinct token strings, as get_vocab_size(with_added_tokens=True) */
    size_t distinct = t->bpe.vocab.n;
    for (size_t i = 0; i < t->nadded; i++) {
        tk_added *a = &t->added[i];
        uint32_t v;
        if (tk_strmap_get(&t->bpe.vocab, a->content, a->len, &v) != 0) distinct++;
        /* decoding uses the normalized form of a normalized token */
        if (a->ncontent)
            t->idtok[a->id] = (tk_idtok){a->ncontent, (uint32_t)a->nlen, 1, 0};
        else
            t->idtok[a->id] = (tk_idtok){a->content, (uint32_t)a->len, 1, 0};
    }
    /* skip_special drops every id whose string is a special token's content */
    for (size_t id = 0; id < t->nids; id++) {
        tk_idtok *e = &t->idtok[id];
        uint32_t v;
        if (e->present && tk_strmap_get(&t->added_map, e->s, e->len, &v) == 0) e->special = t->added[v].special;
    }
    if (distinct > (size_t)MAX_TOKEN_ID) return cf_fail("%s: vocabulary too large", t->path);
    t->vocab_size = (int)distinct;
    return 0;
}

static const char *const KNOWN_TOP[] = {"version", "truncation", "padding", "added_tokens", "normalizer",
                                        "pre_tokenizer", "model", "post_processor", "decoder", NULL};

static int load_json(cf_tokenizer *t, const cJSON *root) {
    if (!cJSON_IsObject(root)) return cf_fail("%s: not a JSON object", t->path);
    for (const cJSON *e = root->child; e; e = e->next) {
        int known = 0;
        for (int i = 0; KNOWN_TOP[i]; i++) known |= !strcmp(e->string, KNOWN_TOP[i]);
        if (!known) {
            char safe[65];
            return cf_fail("%s: unknown top-level key '%s' (is this a tokenizer.json?)", t->path,
                           cf_printable(e->string, safe, sizeof safe));
        }
    }
    const cJSON *model = jget(root, "model");
    if (!model) return cf_fail("%s: no \"model\" (is this a HF tokenizer.json?)", t->path);
    const cJSON *tr = jget(root, "truncation"), *pad = jget(root, "padding");
    if (tr && !cJSON_IsNull(tr))
        return cf_fail("%s: truncation is set: not supported (set \"truncation\": null; centrifuge cuts documents "
                       "into windows itself)", t->path);
    if (pad && !cJSON_IsNull(pad)) return cf_fail("%s: padding is set: not supported (set \"padding\": null)", t->path);
    if (load_bpe(t, model) != 0) return -1;
    if (load_added(t, jget(root, "added_tokens")) != 0) return -1;
    if (load_normalizer(t, jget(root, "normalizer"), "normalizer") != 0) return -1;
    if (load_pre(t, jget(root, "pre_tokenizer"), "pre_tokenizer") != 0) return -1;
    if (load_post(t, jget(root, "post_processor"), "post_processor") != 0) return -1;
    if (load_decoder(t, jget(root, "decoder"), "decoder") != 0) return -1;
    if (build_added(t) != 0) return -1;
    return build_id_table(t);
}

cf_tokenizer *cf_tokenizer_load(const char *path_or_dir) {
    if (!path_or_dir || !*path_or_dir) { cf_fail("tokenizer: no path given"); return NULL; }
    cf_tokenizer *t = cf_calloc(1, sizeof *t);
    if (!t) return NULL;
    t->bos_id = t->eos_id = -1;
    struct stat st;
    size_t plen = strlen(path_or_dir);
    if (stat(path_or_dir, &st) == 0 && S_ISDIR(st.st_mode)) {
        t->path = cf_malloc(plen + 16);
        if (!t->path) goto fail;
        snprintf(t->path, plen + 16, "%s%stokenizer.json", path_or_dir,
                 path_or_dir[plen - 1] == '/' ? "" : "/");
        if (!cf_path_exists(t->path)) {
            cf_fail("%s: no tokenizer.json in this directory (a tokenizer.model alone is not supported: save the "
                    "tokenizer with transformers' save_pretrained to get one)", path_or_dir);
            goto fail;
        }
    } else {
        if (!(t->path = dup_str(path_or_dir, plen))) goto fail;
        if (!cf_path_exists(t->path)) {
            cf_fail("%s: tokenizer file not found (give a tokenizer.json or the directory holding it)", t->path);
            goto fail;
        }
    }
    size_t len;
    char *text = cf_read_file(t->path, &len, TOKENIZER_MAX_BYTES);
    if (!text) goto fail;
    cJSON *root = cJSON_ParseWithLength(text, len);
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        size_t off = at && at >= text && at <= text + len ? (size_t)(at - text) : 0;
        size_t line = 1;
        for (size_t i = 0; i < off; i++) line += text[i] == '\n';
        free(text);
        cf_fail("%s: not valid JSON (error near byte %zu, line %zu)", t->path, off, line);
        goto fail;
    }
    free(text);
    int rc = load_json(t, root);
    cJSON_Delete(root);
    if (rc != 0) goto fail;
    static const char *const bos_guesses[] = {"<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[CLS]", NULL};
    static const char *const eos_guesses[] = {"<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>",
                                              "[SEP]", NULL};
    t->bos_id = resolve_special(t, "bos_token", bos_guesses);
    t->eos_id = resolve_special(t, "eos_token", eos_guesses);
    return t;
fail:
    cf_tokenizer_free(t);
    return NULL;
}

void cf_tokenizer_free(cf_tokenizer *t) {
    if (!t) return;
    tk_bpe_free(&t->bpe);
    for (size_t i = 0; i < t->nadded; i++) { free(t->added[i].content); free(t->added[i].ncontent); }
    free(t->added);
    tk_strmap_free(&t->added_map);
    free(t->raw_trie.v);
    free(t->norm_trie.v);
    for (size_t i = 0; i < t->nnorm; i++) { free(t->norm[i].str); tk_pattern_free(&t->norm[i].pat); }
    free(t->norm);
    for (size_t i = 0; i < t->npre; i++) tk_pattern_free(&t->pre[i].pat);
    free(t->pre);
    for (size_t i = 0; i < t->npost; i++) free_template(&t->post[i]);
    free(t->post);
    for (size_t i = 0; i < t->ndec; i++) { tk_pattern_free(&t->dec[i].pat); free(t->dec[i].content); }
    free(t->dec);
    free(t->idtok);
    for (int i = 0; i < 2; i++) { tk_buf_free(&t->pl[i].text); free(t->pl[i].p); }
    tk_buf_free(&t->nb);
    tk_buf_free(&t->nt);
    tk_buf_free(&t->wb);
    free(t->segs.v);
    free(t->path);
    free(t);
}

/* ----------------------------------------------------------------- encode */

static int pl_add(tk_plist *l, const char *s, size_t n, int32_t id, int first) {
    if (n == 0) return 0;   /* tokenizers drops empty splits */
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 256;
        tk_piece *p = realloc(l->p, cap * sizeof *p);
        if (!p) return cf_fail("out of memory (pre-tokens)");
        l->p = p;
        l->cap = cap;
    }
    size_t off = l->text.len;
    if (tk_buf_put(&l->text, s, n) != 0) return -1;
    l->p[l->n++] = (tk_piece){off, n, id, first};
    return 0;
}

static void pl_reset(tk_plist *l) {
    l->n = 0;
    l->text.len = 0;
}

static uint32_t last_char(const char *s, size_t n) {
    size_t j = n - 1;
    while (j > 0 && ((unsigned char)s[j] & 0xC0) == 0x80) j--;
    return tk_utf8_next(s, &j);
}

/* tokenizers' AddedVocabulary::find_matches + split: cuts the added tokens
 * out of s[0, n) into out. */
static int split_added(cf_tokenizer *t, const tk_trie *tr, const char *s, size_t n, int first, tk_plist *out) {
    if (tr->empty) return pl_add(out, s, n, -1, first);
    size_t start_offset = 0, pos = 0;
    while (pos < n) {
        if (!tr->first[(unsigned char)s[pos]]) { pos++; continue; }
        size_t mlen = 0;
        int k = trie_longest(tr, s + pos, n - pos, &mlen);
        if (k < 0) { pos++; continue; }
        const tk_added *a = &t->added[k];
        size_t start = pos, stop = pos + mlen;
        pos = stop;   /* the search goes on after the match, used or not */
        if (a->single_word) {
            size_t i = stop;
            int start_space = start == 0 || !tk_is_word(last_char(s, start));
            int stop_space = stop == n || !tk_is_word(tk_utf8_next(s, &i));
            if (!start_space || !stop_space) continue;
        }
        if (a->lstrip) {
            size_t ns = start;
            while (ns > 0) {
                size_t j = ns - 1;
                while (j > 0 && ((unsigned char)s[j] & 0xC0) == 0x80) j--;
                size_t i = j;
                if (!tk_is_whitespace(tk_utf8_next(s, &i))) break;
                ns = j;
            }
            start = CF_MAX(ns, start_offset);
        }
        if (a->rstrip)
            while (stop < n) {
                size_t i = stop;
                if (!tk_is_whitespace(tk_utf8_next(s, &i))) break;
                stop = i;
            }
        if (start > start_offset && pl_add(out, s + start_offset, start - start_offset, -1, first && start_offset == 0) != 0)
            return -1;
        if (stop > start && pl_add(out, s + start, stop - start, (int32_t)a->id, first && start == 0) != 0) return -1;
        start_offset = stop;
    }
    if (start_offset < n && pl_add(out, s + start_offset, n - start_offset, -1, first && start_offset == 0) != 0)
        return -1;
    return 0;
}

/* Adds the segments of seg (those not removed) of s as pieces. */
static int add_segments(tk_plist *out, const char *s, const tk_segs *sg, int first) {
    for (size_t k = 0; k < sg->n; k++)
        if (!sg->v[k].match &&
            pl_add(out, s + sg->v[k].start, sg->v[k].end - sg->v[k].start, -1, first && sg->v[k].start == 0) != 0)
            return -1;
    return 0;
}

static int byte_level_map(tk_buf *b, const char *s, size_t n) {
    if (tk_buf_reserve(b, 2 * n + 1) != 0) return -1;
    for (size_t i = 0; i < n; i++) {
        char u[4];
        int k = tk_utf8_put(g_byte_char[(unsigned char)s[i]], u);
        memcpy(b->s + b->len, u, (size_t)k);
        b->len += (size_t)k;
    }
    b->s[b->len] = 0;
    return 0;
}

static int pre_step(cf_tokenizer *t, tk_pre *st, const char *s, size_t n, int first, tk_plist *out) {
    tk_buf *w = &t->wb;
    switch (st->kind) {
    case PT_SPLIT:
    case PT_DIGITS:
        if (tk_find_matches(&st->pat, s, n, st->invert, &t->segs) != 0) return -1;
        tk_split_fold(&t->segs, st->behavior);
        return add_segments(out, s, &t->segs, first);
    case PT_BYTELEVEL: {
        w->len = 0;
        if (st->add_prefix_space && (n == 0 || s[0] != ' ') && tk_buf_put(w, " ", 1) != 0) return -1;
        if (tk_buf_put(w, s, n) != 0) return -1;
        size_t wl = w->len;
        if (st->has_pat) {
            if (tk_find_matches(&st->pat, w->s, wl, 0, &t->segs) != 0) return -1;
            tk_split_fold(&t->segs, TK_SPLIT_ISOLATED);
        } else {
            t->segs.n = 0;
            if (t->segs.cap == 0) {
                if (!(t->segs.v = cf_malloc(sizeof *t->segs.v))) return -1;
                t->segs.cap = 1;
            }
            t->segs.v[t->segs.n++] = (tk_seg){0, wl, 0};
        }
        /* map each word's bytes to the byte-level alphabet */
        for (size_t k = 0; k < t->segs.n; k++) {
            size_t a = t->segs.v[k].start, b = t->segs.v[k].end;
            if (a == b) continue;
            if (out->n == out->cap) {
                size_t cap = out->cap ? out->cap * 2 : 256;
                tk_piece *p = realloc(out->p, cap * sizeof *p);
                if (!p) return cf_fail("out of memory (pre-tokens)");
                out->p = p;
                out->cap = cap;
            }
            size_t off = out->text.len;
            if (byte_level_map(&out->text, w->s + a, b - a) != 0) return -1;
            out->p[out->n++] = (tk_piece){off, out->text.len - off, -1, first && a == 0};
        }
        return 0;
    }
    case PT_METASPACE: {
        w->len = 0;
        size_t i = 0;
        int starts = n >= st->rep_len && memcmp(s, st->rep, st->rep_len) == 0;
        /* ' ' -> replacement; the prefix check is on the replaced text */
        if (!starts && n > 0 && s[0] == ' ') starts = 1;
        if (!starts && (st->prepend == PREPEND_ALWAYS || (st->prepend == PREPEND_FIRST && first)))
            if (tk_buf_put(w, st->rep, st->rep_len) != 0) return -1;
        while (i < n) {
            size_t j = i;
            while (j < n && s[j] != ' ') j++;
            if (tk_buf_put(w, s + i, j - i) != 0) return -1;
            if (j < n && tk_buf_put(w, st->rep, st->rep_len) != 0) return -1;
            i = j + (j < n);
        }
        if (!st->split) return pl_add(out, w->s, w->len, -1, first);
        if (tk_find_matches(&st->pat, w->s, w->len, 0, &t->segs) != 0) return -1;
        tk_split_fold(&t->segs, TK_SPLIT_MERGED_NEXT);
        return add_segments(out, w->s, &t->segs, first);
    }
    }
    return cf_fail("internal: unknown pre-tokenizer step");
}

int cf_tokenizer_encode_append(cf_tokenizer *t, const char *text, size_t len, int add_special, uint32_t **ids,
                               size_t *n, size_t *cap) {
    if (!t || !ids || !n || !cap || (!text && len)) return cf_fail("tokenizer encode: NULL argument");
    size_t bad = cf_utf8_valid_prefix(text, len);
    if (bad != len) return cf_fail("text is not valid UTF-8 (at byte %zu)", bad);
    size_t start = *n;
    tk_plist *a = &t->pl[0], *b = &t->pl[1];
    pl_reset(a);
    pl_reset(b);
    /* 1. added tokens in the raw text */
    if (split_added(t, &t->raw_trie, text, len, 1, a) != 0) return -1;
    /* 2. normalize the rest, then the normalized added tokens */
    if (t->nnorm || !t->norm_trie.empty) {
        for (size_t k = 0; k < a->n; k++) {
            tk_piece p = a->p[k];
            if (p.id >= 0) {
                if (pl_add(b, a->text.s + p.off, p.len, p.id, p.first) != 0) return -1;
                continue;
            }
            if (tk_normalize(t->norm, t->nnorm, a->text.s + p.off, p.len, &t->nb, &t->nt) != 0) return -1;
            if (split_added(t, &t->norm_trie, t->nb.s, t->nb.len, p.first, b) != 0) return -1;
        }
        tk_plist *x = a; a = b; b = x;
    }
    /* 3. pre-tokenizer steps, each over all pieces */
    for (size_t s = 0; s < t->npre; s++) {
        pl_reset(b);
        for (size_t k = 0; k < a->n; k++) {
            tk_piece p = a->p[k];
            int rc = p.id >= 0 ? pl_add(b, a->text.s + p.off, p.len, p.id, p.first)
                               : pre_step(t, &t->pre[s], a->text.s + p.off, p.len, p.first, b);
            if (rc != 0) return -1;
        }
        tk_plist *x = a; a = b; b = x;
    }
    /* 4. the model */
    for (size_t k = 0; k < a->n; k++) {
        tk_piece p = a->p[k];
        int rc = p.id >= 0 ? tk_ids_push(ids, n, cap, (uint32_t)p.id)
                           : tk_bpe_word(&t->bpe, a->text.s + p.off, p.len, ids, n, cap);
        if (rc != 0) return -1;
    }
    /* 5. the post-processor's special tokens */
    if (add_special)
        for (size_t s = 0; s < t->npost; s++) {
            const tk_template *tp = &t->post[s];
            size_t seq = *n - start;
            uint32_t *tmp = cf_malloc((seq ? seq : 1) * sizeof *tmp);
            if (!tmp) return -1;
            if (seq) memcpy(tmp, *ids + start, seq * sizeof *tmp);
            *n = start;
            int rc = 0;
            for (size_t i = 0; i < tp->n && rc == 0; i++) {
                const uint32_t *src = tp->items[i].is_seq ? tmp : tp->items[i].ids;
                size_t m = tp->items[i].is_seq ? seq : tp->items[i].n;
                for (size_t j = 0; j < m && rc == 0; j++) rc = tk_ids_push(ids, n, cap, src[j]);
            }
            free(tmp);
            if (rc != 0) return -1;
        }
    return 0;
}

int cf_tokenizer_encode(cf_tokenizer *t, const char *text, size_t len, int add_special, uint32_t **ids, size_t *n) {
    if (!ids || !n) return cf_fail("tokenizer encode: NULL argument");
    uint32_t *v = NULL;
    size_t m = 0, cap = 0;
    if (cf_tokenizer_encode_append(t, text, len, add_special, &v, &m, &cap) != 0) {
        free(v);
        return -1;
    }
    if (!v && !(v = cf_malloc(sizeof *v))) return -1;
    *ids = v;
    *n = m;
    return 0;
}

/* ----------------------------------------------------------------- decode */

/* A list of strings in one buffer. */
typedef struct { tk_buf text; size_t *off, *len; size_t n, cap; } tk_slist;

static int sl_add(tk_slist *l, const char *s, size_t n) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 64;
        size_t *o = realloc(l->off, cap * sizeof *o);
        if (!o) return cf_fail("out of memory (decode)");
        l->off = o;
        size_t *ln = realloc(l->len, cap * sizeof *ln);
        if (!ln) return cf_fail("out of memory (decode)");
        l->len = ln;
        l->cap = cap;
    }
    size_t off = l->text.len;
    if (tk_buf_put(&l->text, s, n) != 0) return -1;
    l->off[l->n] = off;
    l->len[l->n++] = n;
    return 0;
}

static void sl_free(tk_slist *l) {
    tk_buf_free(&l->text);
    free(l->off);
    free(l->len);
    memset(l, 0, sizeof *l);
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* "<0xXX>" -> the byte, else -1 (Rust u8::from_str_radix on the two chars). */
static int byte_token(const char *s, size_t n) {
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return -1;
    int h = hexval(s[3]), l = hexval(s[4]);
    if (s[3] == '+' && l >= 0) return l;
    if (h < 0 || l < 0) return -1;
    return h * 16 + l;
}

static int flush_bytes(tk_slist *out, tk_buf *bytes) {
    if (!bytes->len) return 0;
    int rc = 0;
    if (cf_utf8_valid_prefix(bytes->s, bytes->len) == bytes->len) rc = sl_add(out, bytes->s, bytes->len);
    else
        for (size_t i = 0; i < bytes->len && rc == 0; i++) rc = sl_add(out, "\xEF\xBF\xBD", 3);
    bytes->len = 0;
    return rc;
}

static int dec_step(const tk_dec *d, const tk_slist *in, tk_slist *out, tk_buf *tmp, tk_segs *sg) {
    switch (d->kind) {
    case D_BYTELEVEL: {
        tmp->len = 0;
        for (size_t k = 0; k < in->n; k++) {
            const char *s = in->text.s + in->off[k];
            size_t n = in->len[k], i = 0, mark = tmp->len;
            int all = 1;
            while (i < n) {
                uint32_t c = tk_utf8_next(s, &i);
                int b = c < 324 ? g_char_byte[c] : -1;
                if (b < 0) { all = 0; break; }
                char ch = (char)b;
                if (tk_buf_put(tmp, &ch, 1) != 0) return -1;
            }
            if (!all) {
                tmp->len = mark;
                if (tk_buf_put(tmp, s, n) != 0) return -1;
            }
        }
        tk_buf lossy = {0};
        if (tk_utf8_lossy(&lossy, (const unsigned char *)tmp->s, tmp->len) != 0) { tk_buf_free(&lossy); return -1; }
        int rc = sl_add(out, lossy.s, lossy.len);
        tk_buf_free(&lossy);
        return rc;
    }
    case D_REPLACE:
        for (size_t k = 0; k < in->n; k++) {
            const char *s = in->text.s + in->off[k];
            size_t n = in->len[k];
            if (tk_find_matches((tk_pattern *)&d->pat, s, n, 0, sg) != 0) return -1;
            tmp->len = 0;
            for (size_t j = 0; j < sg->n; j++) {
                int rc = sg->v[j].match ? tk_buf_put(tmp, d->content, d->content_len)
                                        : tk_buf_put(tmp, s + sg->v[j].start, sg->v[j].end - sg->v[j].start);
                if (rc != 0) return -1;
            }
            if (sl_add(out, tmp->s ? tmp->s : "", tmp->len) != 0) return -1;
        }
        return 0;
    case D_BYTEFALLBACK: {
        tmp->len = 0;
        for (size_t k = 0; k < in->n; k++) {
            const char *s = in->text.s + in->off[k];
            int b = byte_token(s, in->len[k]);
            if (b >= 0) {
                char c = (char)b;
                if (tk_buf_put(tmp, &c, 1) != 0) return -1;
                continue;
            }
            if (flush_bytes(out, tmp) != 0 || sl_add(out, s, in->len[k]) != 0) return -1;
        }
        return flush_bytes(out, tmp);
    }
    case D_FUSE:
        tmp->len = 0;
        for (size_t k = 0; k < in->n; k++)
            if (tk_buf_put(tmp, in->text.s + in->off[k], in->len[k]) != 0) return -1;
        return sl_add(out, tmp->s ? tmp->s : "", tmp->len);
    case D_STRIP:
        for (size_t k = 0; k < in->n; k++) {
            const char *s = in->text.s + in->off[k];
            size_t n = in->len[k], a = 0, b = n;
            for (size_t c = 0; c < d->start && a < n; c++) {
                size_t i = a;
                if (tk_utf8_next(s, &i) != d->strip_char) break;
                a = i;
            }
            for (size_t c = 0; c < d->stop && b > a; c++) {
                size_t j = b - 1;
                while (j > a && ((unsigned char)s[j] & 0xC0) == 0x80) j--;
                size_t i = j;
                if (tk_utf8_next(s, &i) != d->strip_char) break;
                b = j;
            }
            if (sl_add(out, s + a, b - a) != 0) return -1;
        }
        return 0;
    case D_METASPACE:
        for (size_t k = 0; k < in->n; k++) {
            const char *s = in->text.s + in->off[k];
            size_t n = in->len[k], i = 0;
            tmp->len = 0;
            while (i < n) {
                if (n - i >= d->rep_len && memcmp(s + i, d->rep, d->rep_len) == 0) {
                    i += d->rep_len;
                    if (k == 0 && d->prepend != PREPEND_NEVER) continue;
                    if (tk_buf_put(tmp, " ", 1) != 0) return -1;
                    continue;
                }
                size_t j = i;
                (void)tk_utf8_next(s, &j);
                if (tk_buf_put(tmp, s + i, j - i) != 0) return -1;
                i = j;
            }
            if (sl_add(out, tmp->s ? tmp->s : "", tmp->len) != 0) return -1;
        }
        return 0;
    }
    return cf_fail("internal: unknown decoder step");
}

int cf_tokenizer_decode(cf_tokenizer *t, const uint32_t *ids, size_t n, int skip_special, char **text, size_t *len) {
    if (!t || !text || (!ids && n)) return cf_fail("tokenizer decode: NULL argument");
    *text = NULL;
    tk_slist l[2];
    memset(l, 0, sizeof l);
    tk_buf tmp = {0};
    tk_segs sg = {0};
    int rc = 0;
    for (size_t k = 0; k < n && rc == 0; k++) {
        if (ids[k] >= t->nids || !t->idtok[ids[k]].present) {
            rc = cf_fail("token id %u (at position %zu) is not in the tokenizer's vocabulary", ids[k], k);
            break;
        }
        const tk_idtok *e = &t->idtok[ids[k]];
        if (skip_special && e->special) continue;
        rc = sl_add(&l[0], e->s, e->len);
    }
    int cur = 0;
    for (size_t s = 0; s < t->ndec && rc == 0; s++) {
        tk_slist *in = &l[cur], *out = &l[1 - cur];
        out->n = 0;
        out->text.len = 0;
        rc = dec_step(&t->dec[s], in, out, &tmp, &sg);
        cur = 1 - cur;
    }
    tk_buf res = {0};
    if (rc == 0) rc = tk_buf_put(&res, "", 0);
    for (size_t k = 0; k < l[cur].n && rc == 0; k++) {
        if (!t->has_decoder && k > 0) rc = tk_buf_put(&res, " ", 1);
        if (rc == 0) rc = tk_buf_put(&res, l[cur].text.s + l[cur].off[k], l[cur].len[k]);
    }
    sl_free(&l[0]);
    sl_free(&l[1]);
    tk_buf_free(&tmp);
    free(sg.v);
    if (rc != 0) { tk_buf_free(&res); return -1; }
    *text = res.s;
    if (len) *len = res.len;
    return 0;
}

/* ------------------------------------------------------------------ misc */

const char *cf_tokenizer_path(const cf_tokenizer *t) { return t ? t->path : NULL; }
int cf_tokenizer_vocab_size(const cf_tokenizer *t) { return t ? t->vocab_size : 0; }
int cf_tokenizer_max_id(const cf_tokenizer *t) { return t ? (int)t->nids : 0; }
int cf_tokenizer_bos_id(const cf_tokenizer *t) { return t ? t->bos_id : -1; }
int cf_tokenizer_eos_id(const cf_tokenizer *t) { return t ? t->eos_id : -1; }

int cf_tokenizer_token_id(const cf_tokenizer *t, const char *token) {
    if (!t || !token) return -1;
    size_t n = strlen(token);
    uint32_t v;
    if (tk_strmap_get(&t->added_map, token, n, &v) == 0) return (int)t->added[v].id;
    if (tk_strmap_get(&t->bpe.vocab, token, n, &v) == 0) return (int)v;
    return -1;
}

const char *cf_tokenizer_id_token(const cf_tokenizer *t, uint32_t id) {
    if (!t || id >= t->nids || !t->idtok[id].present) return NULL;
    return t->idtok[id].s;
}

int cf_tokenizer_is_special(const cf_tokenizer *t, uint32_t id) {
    return t && id < t->nids && t->idtok[id].present && t->idtok[id].special;
}
