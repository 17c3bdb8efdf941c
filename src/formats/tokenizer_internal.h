/*
 * tokenizer_internal.h — the parts of the tokenizer (tokenizer*.c) that are
 * shared between its files; the public API is include/centrifuge_tokenizer.h.
 *
 *   tokenizer_text.c  UTF-8 helpers, PCRE2 patterns, pattern splits with HF's
 *                     delimiter behaviours, normalizers (utf8proc)
 *   tokenizer_bpe.c   string and pair hash maps, the BPE merge loop, the
 *                     per-word cache
 *   tokenizer.c       tokenizer.json loading, the encode/decode pipeline and
 *                     the public functions
 */
#ifndef CF_TOKENIZER_INTERNAL_H
#define CF_TOKENIZER_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stddef.h>
#include <stdint.h>

#include "centrifuge_tokenizer.h"

/* ------------------------------------------------------------ byte buffers */

/* A growable byte buffer; functions return 0 or -1 (cf_fail). */
typedef struct { char *s; size_t len, cap; } tk_buf;
int tk_buf_reserve(tk_buf *b, size_t extra);
int tk_buf_put(tk_buf *b, const void *data, size_t n);
void tk_buf_free(tk_buf *b);

/* ------------------------------------------------------------------- UTF-8 */

/* (cf_utf8_valid_prefix, the length of the valid UTF-8 prefix, is public:
 * include/centrifuge_tokenizer.h) */
/* Decodes the code point at s[*i] (s valid UTF-8) and advances *i. */
uint32_t tk_utf8_next(const char *s, size_t *i);
/* Encodes cp into out (4 bytes of room); returns the byte count. */
int tk_utf8_put(uint32_t cp, char *out);
/* Appends src as UTF-8 with every ill-formed subsequence replaced by
 * U+FFFD, as Rust's String::from_utf8_lossy does (maximal subparts). */
int tk_utf8_lossy(tk_buf *out, const unsigned char *src, size_t n);
/* Unicode White_Space (Rust char::is_whitespace). */
int tk_is_whitespace(uint32_t cp);
/* General category N* (Rust char::is_numeric). */
int tk_is_numeric(uint32_t cp);
/* Word characters of the regex \w (letters, marks, decimal digits, Pc). */
int tk_is_word(uint32_t cp);

/* ---------------------------------------------------------------- patterns */

typedef enum { TK_PAT_STRING, TK_PAT_REGEX, TK_PAT_CHAR, TK_PAT_NUMERIC } tk_pat_kind;

typedef struct {
    tk_pat_kind kind;
    char *lit;                  /* STRING: the literal; CHAR: the UTF-8 char */
    size_t lit_len;
    pcre2_code *re;             /* REGEX */
    pcre2_match_data *md;
    pcre2_match_context *mctx;
    pcre2_jit_stack *jit;
} tk_pattern;

/* Compiles an HF regex (Oniguruma syntax) for PCRE2 with UTF and Unicode
 * properties; \s \w \h (and their complements, \b \B) are rewritten to
 * Oniguruma's meaning (tokenizer_text.c). */
int tk_pattern_regex(tk_pattern *p, const char *regex, const char *where);
int tk_pattern_string(tk_pattern *p, const char *lit, size_t n);
void tk_pattern_free(tk_pattern *p);

/* A segment of a split: [start, end) of the input, match or not. */
typedef struct { size_t start, end; int match; } tk_seg;
typedef struct { tk_seg *v; size_t n, cap; } tk_segs;

/* HF Pattern::find_matches: segments covering s[0, n) in order, with matches
 * flagged (an empty s gives one empty non-match). Invert flips the flags. */
int tk_find_matches(tk_pattern *p, const char *s, size_t n, int invert, tk_segs *out);

typedef enum { TK_SPLIT_REMOVED, TK_SPLIT_ISOLATED, TK_SPLIT_MERGED_PREV, TK_SPLIT_MERGED_NEXT,
               TK_SPLIT_CONTIGUOUS } tk_split_behavior;
/* HF NormalizedString::split: folds the segments by behaviour in place; the
 * segments with match == 1 afterwards are the removed ones. */
void tk_split_fold(tk_segs *segs, tk_split_behavior b);

/* ------------------------------------------------------------- normalizers */

typedef enum { TK_N_NFC, TK_N_NFD, TK_N_NFKC, TK_N_NFKD, TK_N_LOWERCASE, TK_N_STRIP, TK_N_STRIP_ACCENTS,
               TK_N_PREPEND, TK_N_REPLACE } tk_norm_kind;

typedef struct {
    tk_norm_kind kind;
    int left, right;            /* STRIP */
    char *str;                  /* PREPEND: the prefix; REPLACE: the content */
    size_t str_len;
    tk_pattern pat;             /* REPLACE */
} tk_norm;

/* Applies the steps in order to s[0, n), writing the result to out (reset
 * first). tmp is scratch. */
int tk_normalize(tk_norm *steps, size_t nsteps, const char *s, size_t n, tk_buf *out, tk_buf *tmp);

/* ---------------------------------------------------------------- hash maps */

/* String -> uint32 map with its own arena of keys. */
typedef struct {
    uint32_t *slot;             /* entry index + 1, 0 = empty */
    size_t cap;                 /* power of two */
    struct tk_sentry { uint64_t hash; size_t off; uint32_t len, val; } *e;
    size_t n, ecap;
    tk_buf keys;
} tk_strmap;

uint64_t tk_hash(const void *s, size_t n);
/* Returns 0 and sets *val if found, else -1 (no cf_fail). */
int tk_strmap_get(const tk_strmap *m, const char *s, size_t n, uint32_t *val);
/* Inserts; fails (cf_fail) if the key is already there (*dup = 1) or on OOM. */
int tk_strmap_put(tk_strmap *m, const char *s, size_t n, uint32_t val, int *dup);
const char *tk_strmap_key(const tk_strmap *m, size_t entry, uint32_t *len);
void tk_strmap_free(tk_strmap *m);

/* (left id, right id) -> (rank, new id). */
typedef struct {
    uint64_t *key;              /* UINT64_MAX = empty */
    uint32_t *rank, *nid;
    size_t cap, n;
} tk_pairmap;

int tk_pairmap_put(tk_pairmap *m, uint32_t a, uint32_t b, uint32_t rank, uint32_t nid);
int tk_pairmap_get(const tk_pairmap *m, uint32_t a, uint32_t b, uint32_t *rank, uint32_t *nid);
void tk_pairmap_free(tk_pairmap *m);

/* --------------------------------------------------------------------- BPE */

typedef struct { uint32_t id; int32_t prev, next; uint32_t len; } tk_sym;
typedef struct { uint32_t rank, pos, nid; } tk_merge;

typedef struct {
    tk_strmap vocab;
    tk_pairmap merges;
    int32_t unk_id;             /* -1: no unk token */
    int fuse_unk, byte_fallback, ignore_merges;
    int split_meta;             /* words may be cut before "▁" (tk_bpe_check_split) */
    char *prefix, *suffix;      /* continuing_subword_prefix, end_of_word_suffix */
    size_t prefix_len, suffix_len;
    int32_t byte_id[256];       /* ids of <0xXX>, -1 when absent */
    /* scratch */
    tk_sym *sym; size_t sym_cap;
    tk_merge *heap; size_t heap_cap;
    tk_buf piece;
    /* cache: word -> ids */
    tk_strmap cache;
    uint32_t *cache_ids; size_t cache_nids, cache_cap;
} tk_bpe;

/* Decides, once the vocabulary and merges are loaded, whether long words
 * may be cut before each "▁" without changing the ids (SentencePiece-style
 * files with no pre-tokenizer make a whole text one word). */
void tk_bpe_check_split(tk_bpe *m);
/* Appends the ids of one word (a pre-token) to *ids. */
int tk_bpe_word(tk_bpe *m, const char *w, size_t n, uint32_t **ids, size_t *nids, size_t *cap);
void tk_bpe_free(tk_bpe *m);

/* Growable id vector append. */
int tk_ids_push(uint32_t **ids, size_t *n, size_t *cap, uint32_t id);

#endif /* CF_TOKENIZER_INTERNAL_H */
