/*
 * tokenizer_text.c — text helpers of the tokenizer: UTF-8, PCRE2 patterns,
 * splits with HF's delimiter behaviours, and the normalizers (utf8proc).
 *
 * Each function mirrors what `tokenizers` (Rust) does with the same input,
 * including its corner cases (empty matches, char-wise lowercase, ...), so
 * that ids agree; the comments say which Rust function is mirrored.
 */
#include "formats/tokenizer_internal.h"

#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "base/common.h"

/* ------------------------------------------------------------ byte buffers */

int tk_buf_reserve(tk_buf *b, size_t extra) {
    if (b->len + extra <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra) {
        if (cap > SIZE_MAX / 2) return cf_fail("out of memory (buffer of %zu bytes)", b->len + extra);
        cap *= 2;
    }
    char *s = realloc(b->s, cap);
    if (!s) return cf_fail("out of memory allocating %zu bytes", cap);
    b->s = s;
    b->cap = cap;
    return 0;
}

int tk_buf_put(tk_buf *b, const void *data, size_t n) {
    if (tk_buf_reserve(b, n + 1) != 0) return -1;
    if (n) memcpy(b->s + b->len, data, n);
    b->len += n;
    b->s[b->len] = 0;
    return 0;
}

void tk_buf_free(tk_buf *b) {
    free(b->s);
    memset(b, 0, sizeof *b);
}

/* ------------------------------------------------------------------- UTF-8 */

/* The shape of a multi-byte sequence by its lead byte (Unicode Table 3-7):
 * need continuation bytes, the first of them in [lo, hi], the rest in
 * [0x80, 0xBF]. 0 for a byte that cannot start one. */
static int utf8_lead(unsigned char b, size_t *need, unsigned char *lo, unsigned char *hi) {
    *lo = 0x80;
    *hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) *need = 1;
    else if (b == 0xE0) { *need = 2; *lo = 0xA0; }
    else if (b == 0xED) { *need = 2; *hi = 0x9F; }
    else if (b >= 0xE1 && b <= 0xEF) *need = 2;
    else if (b == 0xF0) { *need = 3; *lo = 0x90; }
    else if (b >= 0xF1 && b <= 0xF3) *need = 3;
    else if (b == 0xF4) { *need = 3; *hi = 0x8F; }
    else return 0;
    return 1;
}

/* Length of the valid sequence at s[0, n), or 0 if ill-formed. */
static size_t utf8_seq(const unsigned char *s, size_t n) {
    if (s[0] < 0x80) return 1;
    size_t need;
    unsigned char lo, hi;
    if (!utf8_lead(s[0], &need, &lo, &hi)) return 0;
    if (n < need + 1) return 0;
    if (s[1] < lo || s[1] > hi) return 0;
    for (size_t k = 2; k <= need; k++)
        if ((s[k] & 0xC0) != 0x80) return 0;
    return need + 1;
}

size_t cf_utf8_valid_prefix(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        if (u[i] < 0x80) { i++; continue; }
        size_t k = utf8_seq(u + i, n - i);
        if (!k) return i;
        i += k;
    }
    return n;
}

uint32_t tk_utf8_next(const char *s, size_t *i) {
    const unsigned char *u = (const unsigned char *)s + *i;
    uint32_t c = u[0];
    if (c < 0x80) { *i += 1; return c; }
    if (c < 0xE0) { *i += 2; return ((c & 0x1F) << 6) | (u[1] & 0x3F); }
    if (c < 0xF0) { *i += 3; return ((c & 0x0F) << 12) | ((u[1] & 0x3F) << 6) | (u[2] & 0x3F); }
    *i += 4;
    return ((c & 0x07) << 18) | ((u[1] & 0x3F) << 12) | ((u[2] & 0x3F) << 6) | (u[3] & 0x3F);
}

int tk_utf8_put(uint32_t cp, char *out) {
    unsigned char *o = (unsigned char *)out;
    if (cp < 0x80) { o[0] = (unsigned char)cp; return 1; }
    if (cp < 0x800) { o[0] = (unsigned char)(0xC0 | (cp >> 6)); o[1] = (unsigned char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xE0 | (cp >> 12));
        o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (unsigned char)(0xF0 | (cp >> 18));
    o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

int tk_utf8_lossy(tk_buf *out, const unsigned char *s, size_t n) {
    static const char fffd[3] = {(char)0xEF, (char)0xBF, (char)0xBD};
    size_t i = 0;
    while (i < n) {
        size_t run = i;   /* copy runs of valid sequences in one go */
        while (run < n) {
            size_t k = s[run] < 0x80 ? 1 : utf8_seq(s + run, n - run);
            if (!k) break;
            run += k;
        }
        if (run > i && tk_buf_put(out, s + i, run - i) != 0) return -1;
        i = run;
        if (i >= n) break;
        /* an ill-formed sequence: its maximal subpart (the lead byte and the
         * continuation bytes that were still acceptable) becomes one U+FFFD */
        size_t need = 0;
        unsigned char lo, hi;
        if (!utf8_lead(s[i], &need, &lo, &hi)) need = 0;
        size_t j = i + 1;
        for (size_t k = 0; k < need && j < n; k++) {
            unsigned char c = s[j];
            if (k == 0 ? (c < lo || c > hi) : (c & 0xC0) != 0x80) break;
            j++;
        }
        if (tk_buf_put(out, fffd, 3) != 0) return -1;
        i = j;
    }
    return tk_buf_reserve(out, 1);
}

int tk_is_whitespace(uint32_t c) {
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
           c == 0x3000;
}

int tk_is_numeric(uint32_t c) {
    utf8proc_category_t k = utf8proc_category((utf8proc_int32_t)c);
    return k == UTF8PROC_CATEGORY_ND || k == UTF8PROC_CATEGORY_NL || k == UTF8PROC_CATEGORY_NO;
}

int tk_is_word(uint32_t c) {
    if (c == '_' || c == 0x200C || c == 0x200D) return 1;
    switch (utf8proc_category((utf8proc_int32_t)c)) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_MN: case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_PC:
        return 1;
    default:
        return 0;
    }
}

/* ---------------------------------------------------------------- patterns */

/* Code points assigned in Unicode 15.0-16.0 that Oniguruma in `tokenizers`
 * 0.23 puts in these general categories and PCRE2 10.42 (Debian 12, Unicode
 * 14) does not know (CJK Extension H, new scripts, ...). Found by matching
 * every code point with both engines (tools/test_tokenizer_parity.py checks
 * the classes); with a newer PCRE2 they are already in the class. */
static const struct { const char *name, *extra; } NEW_CODE_POINTS[] = {
    {"L",
     "\\x{1C89}-\\x{1C8A}\\x{A7CB}-\\x{A7CD}\\x{A7DA}-\\x{A7DC}\\x{105C0}-\\x{105F3}"
     "\\x{10D4A}-\\x{10D65}\\x{10D6F}-\\x{10D85}\\x{10EC2}-\\x{10EC4}\\x{1123F}-\\x{11240}"
     "\\x{11380}-\\x{11389}\\x{1138B}\\x{1138E}\\x{11390}-\\x{113B5}\\x{113B7}\\x{113D1}\\x{113D3}"
     "\\x{11BC0}-\\x{11BE0}\\x{11F02}\\x{11F04}-\\x{11F10}\\x{11F12}-\\x{11F33}\\x{1342F}"
     "\\x{13441}-\\x{13446}\\x{13460}-\\x{143FA}\\x{16100}-\\x{1611D}\\x{16D40}-\\x{16D6C}"
     "\\x{18CFF}\\x{1B132}\\x{1B155}\\x{1DF25}-\\x{1DF2A}\\x{1E030}-\\x{1E06D}"
     "\\x{1E4D0}-\\x{1E4EB}\\x{1E5D0}-\\x{1E5ED}\\x{1E5F0}\\x{2B739}\\x{2EBF0}-\\x{2EE5D}"
     "\\x{31350}-\\x{323AF}"},
    {"Lu",
     "\\x{1C89}\\x{A7CB}-\\x{A7CC}\\x{A7DA}\\x{A7DC}\\x{10D50}-\\x{10D65}"},
    {"Ll",
     "\\x{1C8A}\\x{A7CD}\\x{A7DB}\\x{10D70}-\\x{10D85}\\x{1DF25}-\\x{1DF2A}"},
    {"Lm",
     "\\x{10D4E}\\x{10D6F}\\x{16D40}-\\x{16D42}\\x{16D6B}-\\x{16D6C}\\x{1E030}-\\x{1E06D}"
     "\\x{1E4EB}"},
    {"Lo",
     "\\x{105C0}-\\x{105F3}\\x{10D4A}-\\x{10D4D}\\x{10D4F}\\x{10EC2}-\\x{10EC4}"
     "\\x{1123F}-\\x{11240}\\x{11380}-\\x{11389}\\x{1138B}\\x{1138E}\\x{11390}-\\x{113B5}"
     "\\x{113B7}\\x{113D1}\\x{113D3}\\x{11BC0}-\\x{11BE0}\\x{11F02}\\x{11F04}-\\x{11F10}"
     "\\x{11F12}-\\x{11F33}\\x{1342F}\\x{13441}-\\x{13446}\\x{13460}-\\x{143FA}"
     "\\x{16100}-\\x{1611D}\\x{16D43}-\\x{16D6A}\\x{18CFF}\\x{1B132}\\x{1B155}"
     "\\x{1E4D0}-\\x{1E4EA}\\x{1E5D0}-\\x{1E5ED}\\x{1E5F0}\\x{2B739}\\x{2EBF0}-\\x{2EE5D}"
     "\\x{31350}-\\x{323AF}"},
    {"M",
     "\\x{897}\\x{CF3}\\x{ECE}\\x{10D69}-\\x{10D6D}\\x{10EFC}-\\x{10EFF}\\x{11241}"
     "\\x{113B8}-\\x{113C0}\\x{113C2}\\x{113C5}\\x{113C7}-\\x{113CA}\\x{113CC}-\\x{113D0}"
     "\\x{113D2}\\x{113E1}-\\x{113E2}\\x{11F00}-\\x{11F01}\\x{11F03}\\x{11F34}-\\x{11F3A}"
     "\\x{11F3E}-\\x{11F42}\\x{11F5A}\\x{13440}\\x{13447}-\\x{13455}\\x{1611E}-\\x{1612F}"
     "\\x{1E08F}\\x{1E4EC}-\\x{1E4EF}\\x{1E5EE}-\\x{1E5EF}"},
    {"N",
     "\\x{10D40}-\\x{10D49}\\x{116D0}-\\x{116E3}\\x{11BF0}-\\x{11BF9}\\x{11F50}-\\x{11F59}"
     "\\x{16130}-\\x{16139}\\x{16D70}-\\x{16D79}\\x{1CCF0}-\\x{1CCF9}\\x{1D2C0}-\\x{1D2D3}"
     "\\x{1E4F0}-\\x{1E4F9}\\x{1E5F1}-\\x{1E5FA}"},
    {"Nd",
     "\\x{10D40}-\\x{10D49}\\x{116D0}-\\x{116E3}\\x{11BF0}-\\x{11BF9}\\x{11F50}-\\x{11F59}"
     "\\x{16130}-\\x{16139}\\x{16D70}-\\x{16D79}\\x{1CCF0}-\\x{1CCF9}\\x{1E4F0}-\\x{1E4F9}"
     "\\x{1E5F1}-\\x{1E5FA}"},
    {"P",
     "\\x{1B4E}-\\x{1B4F}\\x{1B7F}\\x{10D6E}\\x{113D4}-\\x{113D5}\\x{113D7}-\\x{113D8}"
     "\\x{11B00}-\\x{11B09}\\x{11BE1}\\x{11F43}-\\x{11F4F}\\x{16D6D}-\\x{16D6F}\\x{1E5FF}"},
    {"S",
     "\\x{2427}-\\x{2429}\\x{2FFC}-\\x{2FFF}\\x{31E4}-\\x{31E5}\\x{31EF}\\x{10D8E}-\\x{10D8F}"
     "\\x{1CC00}-\\x{1CCEF}\\x{1CD00}-\\x{1CEB3}\\x{1F6DC}\\x{1F774}-\\x{1F776}"
     "\\x{1F77B}-\\x{1F77F}\\x{1F7D9}\\x{1F8B2}-\\x{1F8BB}\\x{1F8C0}-\\x{1F8C1}"
     "\\x{1FA75}-\\x{1FA77}\\x{1FA87}-\\x{1FA89}\\x{1FA8F}\\x{1FAAD}-\\x{1FAAF}"
     "\\x{1FABB}-\\x{1FABF}\\x{1FAC6}\\x{1FACE}-\\x{1FACF}\\x{1FADA}-\\x{1FADC}\\x{1FADF}"
     "\\x{1FAE8}-\\x{1FAE9}\\x{1FAF7}-\\x{1FAF8}\\x{1FBCB}-\\x{1FBEF}"},
};

static const char *new_code_points(const char *name, size_t n) {
    for (size_t i = 0; i < sizeof NEW_CODE_POINTS / sizeof NEW_CODE_POINTS[0]; i++)
        if (strlen(NEW_CODE_POINTS[i].name) == n && !memcmp(NEW_CODE_POINTS[i].name, name, n))
            return NEW_CODE_POINTS[i].extra;
    return NULL;
}

/* Oniguruma (the regex engine of `tokenizers`) and PCRE2 differ on a few
 * Unicode escapes; they are rewritten to Oniguruma's meaning:
 *   \s  is White_Space less U+180E, with U+0085 (PCRE2: U+180E, no U+0085)
 *   \w  is Alphabetic, marks, Nd, Pc and ¹²³¼½¾ (PCRE2's \w has no marks)
 *   \h  is a hex digit (PCRE2: horizontal space) -> [0-9a-fA-F]
 *   \d \p{L} \p{N} ... also take the code points of NEW_CODE_POINTS
 *   \S \W \H \D \P{..} are their complements, \b \B word boundaries on \w.
 * Inside a character class the positive forms are spliced in; a negated
 * one there cannot be, and is refused. PCRE2 before 10.40 has no
 * \p{Alphabetic}: letters and Nl stand in (136 symbols such as circled
 * letters differ). */
static const char *word_class(void) {
    static char cls[2048];
    if (!cls[0]) {
        int err;
        PCRE2_SIZE off;
        pcre2_code *c = pcre2_compile((PCRE2_SPTR) "\\p{Alphabetic}", PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                                      &err, &off, NULL);
        snprintf(cls, sizeof cls, "%s\\p{M}\\p{Nd}\\p{Pc}\\x{B2}\\x{B3}\\x{B9}\\x{BC}-\\x{BE}%s%s%s",
                 c ? "\\p{Alphabetic}" : "\\p{L}\\p{Nl}", new_code_points("L", 1), new_code_points("M", 1),
                 new_code_points("Nd", 2));
        if (c) pcre2_code_free(c);
    }
    return cls;
}

/* Oniguruma's \s, spelled out: PCRE2's also has U+180E and lacks U+0085. */
static const char SPACE[] = "\\t\\n\\x{B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
                            "\\x{202F}\\x{205F}\\x{3000}";

static int put_str(tk_buf *out, const char *s) { return tk_buf_put(out, s, strlen(s)); }

/* \p{Name}, \pN, \P{Name}, \PN at re[i] ('\\'): writes the rewritten form
 * and returns the escape's length, or 0 to copy it unchanged. */
static size_t unicode_property(const char *re, size_t i, size_t n, int in_class, tk_buf *out, const char *where,
                               int *err) {
    char kind = re[i + 1];
    const char *name;
    size_t nlen, len;
    if (i + 2 >= n) return 0;
    if (re[i + 2] == '{') {
        const char *close = memchr(re + i + 3, '}', n - i - 3);
        if (!close) return 0;
        name = re + i + 3;
        nlen = (size_t)(close - name);
        len = (size_t)(close + 1 - (re + i));
    } else {
        /* Oniguruma (Ruby syntax) does not read \pL as a property */
        *err = cf_fail("%s: \\%c%c without braces is not supported (write \\%c{%c})", where, kind, re[i + 2], kind,
                       re[i + 2]);
        return 0;
    }
    const char *extra = new_code_points(name, nlen);
    if (!extra) return 0;
    int neg = kind == 'P';
    if (neg && in_class) {
        *err = cf_fail("%s: \\P{%.*s} inside a character class is not supported", where, (int)nlen, name);
        return 0;
    }
    char head[32];
    snprintf(head, sizeof head, "%s\\p{%.*s}", in_class ? "" : neg ? "[^" : "[", (int)nlen, name);
    if (put_str(out, head) != 0 || put_str(out, extra) != 0 || (!in_class && put_str(out, "]") != 0)) *err = -1;
    return len;
}

static int translate_regex(const char *re, tk_buf *out, const char *where) {
    size_t n = strlen(re);
    int in_class = 0;
    const char *W = word_class(), *Nd = new_code_points("Nd", 2);
    char wpos[2100], wneg[2100], dpos[512], dneg[512], *bnd = NULL, *nbnd = NULL;
    snprintf(wpos, sizeof wpos, "[%s]", W);
    snprintf(wneg, sizeof wneg, "[^%s]", W);
    snprintf(dpos, sizeof dpos, "[\\p{Nd}%s]", Nd);
    snprintf(dneg, sizeof dneg, "[^\\p{Nd}%s]", Nd);
    char din[512], spos[128], sneg[128];
    snprintf(din, sizeof din, "\\p{Nd}%s", Nd);
    snprintf(spos, sizeof spos, "[%s]", SPACE);
    snprintf(sneg, sizeof sneg, "[^%s]", SPACE);
    out->len = 0;
    int rc = 0;
    for (size_t i = 0; i < n && rc == 0; i++) {
        char c = re[i];
        if (c == '\\' && i + 1 < n) {
            char d = re[i + 1];
            const char *rep = NULL;
            if (d == 'p' || d == 'P') {
                size_t k = unicode_property(re, i, n, in_class, out, where, &rc);
                if (rc != 0) break;
                if (k) { i += k - 1; continue; }
            }
            if (in_class) {
                if (d == 's') rep = SPACE;
                else if (d == 'w') rep = W;
                else if (d == 'h') rep = "0-9a-fA-F";
                else if (d == 'd') rep = din;
                else if (d == 'S' || d == 'W' || d == 'H' || d == 'D') {
                    rc = cf_fail("%s: \\%c inside a character class is not supported", where, d);
                    break;
                }
            } else {
                if (d == 's') rep = spos;
                else if (d == 'S') rep = sneg;
                else if (d == 'w') rep = wpos;
                else if (d == 'W') rep = wneg;
                else if (d == 'h') rep = "[0-9a-fA-F]";
                else if (d == 'H') rep = "[^0-9a-fA-F]";
                else if (d == 'd') rep = dpos;
                else if (d == 'D') rep = dneg;
                else if (d == 'b' || d == 'B') {
                    char **slot = d == 'b' ? &bnd : &nbnd;
                    if (!*slot) {
                        size_t m = 4 * strlen(wpos) + 64;
                        if (!(*slot = cf_malloc(m))) { rc = -1; break; }
                        if (d == 'b') snprintf(*slot, m, "(?:(?<=%s)(?!%s)|(?<!%s)(?=%s))", wpos, wpos, wpos, wpos);
                        else snprintf(*slot, m, "(?:(?<=%s)(?=%s)|(?<!%s)(?!%s))", wpos, wpos, wpos, wpos);
                    }
                    rep = *slot;
                }
            }
            if (rep) rc = put_str(out, rep);
            else rc = tk_buf_put(out, re + i, 2);
            i++;
            continue;
        }
        if (!in_class && c == '[') {
            in_class = 1;
            rc = tk_buf_put(out, "[", 1);
            /* a leading ^ and a leading ] belong to the class */
            if (rc == 0 && i + 1 < n && re[i + 1] == '^') { rc = tk_buf_put(out, "^", 1); i++; }
            if (rc == 0 && i + 1 < n && re[i + 1] == ']') { rc = tk_buf_put(out, "]", 1); i++; }
            continue;
        }
        if (in_class && c == '[' && i + 1 < n && re[i + 1] == ':') {   /* [:alpha:] */
            const char *end = strstr(re + i + 2, ":]");
            if (end) {
                size_t k = (size_t)(end + 2 - (re + i));
                rc = tk_buf_put(out, re + i, k);
                i += k - 1;
                continue;
            }
        }
        if (in_class && c == ']') in_class = 0;
        rc = tk_buf_put(out, &c, 1);
    }
    free(bnd);
    free(nbnd);
    return rc == 0 ? tk_buf_put(out, "", 0) : -1;
}

int tk_pattern_regex(tk_pattern *p, const char *regex, const char *where) {
    memset(p, 0, sizeof *p);
    p->kind = TK_PAT_REGEX;
    tk_buf tr = {0};
    if (translate_regex(regex, &tr, where) != 0) { tk_buf_free(&tr); return -1; }
    int err = 0;
    PCRE2_SIZE off = 0;
    p->re = pcre2_compile((PCRE2_SPTR)tr.s, tr.len, PCRE2_UTF | PCRE2_UCP, &err, &off, NULL);
    tk_buf_free(&tr);
    if (!p->re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        char safe[81];
        return cf_fail("%s: regex '%s' does not compile (PCRE2: %s)", where, cf_printable(regex, safe, sizeof safe),
                       (const char *)msg);
    }
    /* JIT where the library has it; the interpreter gives the same matches */
    if (pcre2_jit_compile(p->re, PCRE2_JIT_COMPLETE) == 0) {
        p->jit = pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, NULL);
        p->mctx = pcre2_match_context_create(NULL);
        if (p->jit && p->mctx) pcre2_jit_stack_assign(p->mctx, NULL, p->jit);
    }
    if (!p->mctx) p->mctx = pcre2_match_context_create(NULL);
    p->md = pcre2_match_data_create_from_pattern(p->re, NULL);
    if (!p->md || !p->mctx) { tk_pattern_free(p); return cf_fail("out of memory (regex match data)"); }
    /* the interpreter's backtracking memory: generous, but bounded */
    pcre2_set_heap_limit(p->mctx, 1024 * 1024);   /* KiB: 1 GiB */
    return 0;
}

int tk_pattern_string(tk_pattern *p, const char *lit, size_t n) {
    memset(p, 0, sizeof *p);
    p->kind = TK_PAT_STRING;
    p->lit = cf_malloc(n + 1);
    if (!p->lit) return -1;
    memcpy(p->lit, lit, n);
    p->lit[n] = 0;
    p->lit_len = n;
    return 0;
}

void tk_pattern_free(tk_pattern *p) {
    if (!p) return;
    free(p->lit);
    if (p->md) pcre2_match_data_free(p->md);
    if (p->mctx) pcre2_match_context_free(p->mctx);
    if (p->jit) pcre2_jit_stack_free(p->jit);
    if (p->re) pcre2_code_free(p->re);
    memset(p, 0, sizeof *p);
}

static int segs_push(tk_segs *o, size_t a, size_t b, int m) {
    if (o->n == o->cap) {
        size_t cap = o->cap ? o->cap * 2 : 64;
        tk_seg *v = realloc(o->v, cap * sizeof *v);
        if (!v) return cf_fail("out of memory (split segments)");
        o->v = v;
        o->cap = cap;
    }
    o->v[o->n++] = (tk_seg){a, b, m};
    return 0;
}

/* Adds the match [s, e) and the gap before it. */
static int add_match(tk_segs *o, size_t *prev, size_t s, size_t e) {
    if (*prev != s && segs_push(o, *prev, s, 0) != 0) return -1;
    if (segs_push(o, s, e, 1) != 0) return -1;
    *prev = e;
    return 0;
}

static int find_regex(tk_pattern *p, const char *s, size_t n, tk_segs *o, size_t *prev) {
    /* the iteration of the onig crate's find_iter: an empty match right
     * where the last match ended is skipped by advancing one character */
    size_t last_end = 0, last_match_end = 0;
    int have_last = 0;
    while (last_end <= n) {
        int rc = pcre2_match(p->re, (PCRE2_SPTR)s, n, last_end, PCRE2_NO_UTF_CHECK, p->md, p->mctx);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return cf_fail("regex match failed at byte %zu of a %zu-byte piece (PCRE2: %s)", last_end, n,
                           (const char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(p->md);
        size_t ms = ov[0], me = ov[1];
        if (ms == me && have_last && last_match_end == me) {
            if (last_end >= n) break;
            size_t i = last_end;
            (void)tk_utf8_next(s, &i);
            last_end = i;
            continue;
        }
        last_end = me;
        last_match_end = me;
        have_last = 1;
        if (add_match(o, prev, ms, me) != 0) return -1;
        if (ms == me && me >= n) break;
    }
    return 0;
}

int tk_find_matches(tk_pattern *p, const char *s, size_t n, int invert, tk_segs *o) {
    o->n = 0;
    if (n == 0) return segs_push(o, 0, 0, invert ? 1 : 0) == 0 ? 0 : -1;
    size_t prev = 0;
    switch (p->kind) {
    case TK_PAT_REGEX:
        if (find_regex(p, s, n, o, &prev) != 0) return -1;
        break;
    case TK_PAT_STRING: {
        if (p->lit_len == 0) break;   /* refused at load; no match */
        size_t i = 0;
        while (i + p->lit_len <= n) {
            const char *f = memmem(s + i, n - i, p->lit, p->lit_len);
            if (!f) break;
            size_t at = (size_t)(f - s);
            if (add_match(o, &prev, at, at + p->lit_len) != 0) return -1;
            i = at + p->lit_len;
        }
        break;
    }
    case TK_PAT_CHAR:
    case TK_PAT_NUMERIC: {
        size_t i = 0;
        while (i < n) {
            size_t at = i;
            uint32_t c = tk_utf8_next(s, &i);
            int hit = p->kind == TK_PAT_NUMERIC ? tk_is_numeric(c)
                                                : (i - at == p->lit_len && memcmp(s + at, p->lit, p->lit_len) == 0);
            if (hit && add_match(o, &prev, at, i) != 0) return -1;
        }
        break;
    }
    }
    if (prev != n && segs_push(o, prev, n, 0) != 0) return -1;
    if (invert)
        for (size_t k = 0; k < o->n; k++) o->v[k].match = !o->v[k].match;
    return 0;
}

void tk_split_fold(tk_segs *sg, tk_split_behavior b) {
    tk_seg *v = sg->v;
    size_t n = sg->n, k = 0;
    int prev_match = 0;
    switch (b) {
    case TK_SPLIT_ISOLATED:
        for (size_t i = 0; i < n; i++) v[i].match = 0;
        return;
    case TK_SPLIT_REMOVED:
        return;
    case TK_SPLIT_CONTIGUOUS:
        for (size_t i = 0; i < n; i++) {
            int m = v[i].match;
            if (m == prev_match && k > 0) v[k - 1].end = v[i].end;
            else v[k++] = (tk_seg){v[i].start, v[i].end, 0};
            prev_match = m;
        }
        break;
    case TK_SPLIT_MERGED_PREV:
        for (size_t i = 0; i < n; i++) {
            int m = v[i].match;
            if (m && !prev_match && k > 0) v[k - 1].end = v[i].end;
            else v[k++] = (tk_seg){v[i].start, v[i].end, 0};
            prev_match = m;
        }
        break;
    case TK_SPLIT_MERGED_NEXT: {
        /* folded from the right: a match joins the segment after it */
        size_t w = n;   /* output grows downwards in v[w..n) */
        for (size_t i = n; i-- > 0;) {
            int m = v[i].match;
            tk_seg cur = v[i];
            if (m && !prev_match && w < n) v[w].start = cur.start;
            else v[--w] = (tk_seg){cur.start, cur.end, 0};
            prev_match = m;
        }
        memmove(v, v + w, (n - w) * sizeof *v);
        k = n - w;
        break;
    }
    }
    sg->n = k;
}

/* ------------------------------------------------------------- normalizers */

static int norm_utf8proc(const char *s, size_t n, utf8proc_option_t opt, tk_buf *out) {
    utf8proc_uint8_t *res = NULL;
    utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &res, opt);
    if (r < 0) return cf_fail("Unicode normalization failed: %s", utf8proc_errmsg(r));
    int rc = tk_buf_put(out, res, (size_t)r);
    free(res);
    return rc;
}

static int norm_step(tk_norm *st, const char *s, size_t n, tk_buf *out) {
    out->len = 0;
    if (tk_buf_reserve(out, n + 1) != 0) return -1;
    switch (st->kind) {
    case TK_N_NFC: return n ? norm_utf8proc(s, n, UTF8PROC_STABLE | UTF8PROC_COMPOSE, out) : tk_buf_put(out, "", 0);
    case TK_N_NFD: return n ? norm_utf8proc(s, n, UTF8PROC_STABLE | UTF8PROC_DECOMPOSE, out) : tk_buf_put(out, "", 0);
    case TK_N_NFKC:
        return n ? norm_utf8proc(s, n, UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT, out) : tk_buf_put(out, "", 0);
    case TK_N_NFKD:
        return n ? norm_utf8proc(s, n, UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT, out)
                 : tk_buf_put(out, "", 0);
    case TK_N_LOWERCASE: {
        /* char by char, full mapping (Rust char::to_lowercase): U+0130 is the
         * one character whose lowercase is two characters */
        size_t i = 0;
        while (i < n) {
            uint32_t c = tk_utf8_next(s, &i);
            char b[8];
            int k;
            if (c == 0x130) { memcpy(b, "i\xCC\x87", 3); k = 3; }
            else k = tk_utf8_put((uint32_t)utf8proc_tolower((utf8proc_int32_t)c), b);
            if (tk_buf_put(out, b, (size_t)k) != 0) return -1;
        }
        return tk_buf_put(out, "", 0);
    }
    case TK_N_STRIP: {
        size_t a = 0, b = n;
        if (st->left)
            while (a < b) {
                size_t i = a;
                if (!tk_is_whitespace(tk_utf8_next(s, &i))) break;
                a = i;
            }
        if (st->right)
            while (b > a) {
                size_t j = b - 1;
                while (j > a && ((unsigned char)s[j] & 0xC0) == 0x80) j--;
                size_t i = j;
                if (!tk_is_whitespace(tk_utf8_next(s, &i))) break;
                b = j;
            }
        return tk_buf_put(out, s + a, b - a);
    }
    case TK_N_STRIP_ACCENTS: {
        size_t i = 0;
        while (i < n) {
            size_t at = i;
            uint32_t c = tk_utf8_next(s, &i);
            utf8proc_category_t k = utf8proc_category((utf8proc_int32_t)c);
            if (k == UTF8PROC_CATEGORY_MN || k == UTF8PROC_CATEGORY_MC || k == UTF8PROC_CATEGORY_ME) continue;
            if (tk_buf_put(out, s + at, i - at) != 0) return -1;
        }
        return tk_buf_put(out, "", 0);
    }
    case TK_N_PREPEND:
        if (n && tk_buf_put(out, st->str, st->str_len) != 0) return -1;
        return tk_buf_put(out, s, n);
    case TK_N_REPLACE: {
        tk_segs sg = {0};
        if (tk_find_matches(&st->pat, s, n, 0, &sg) != 0) { free(sg.v); return -1; }
        int rc = 0;
        for (size_t k = 0; k < sg.n && rc == 0; k++)
            rc = sg.v[k].match ? tk_buf_put(out, st->str, st->str_len)
                               : tk_buf_put(out, s + sg.v[k].start, sg.v[k].end - sg.v[k].start);
        free(sg.v);
        return rc ? -1 : tk_buf_put(out, "", 0);
    }
    }
    return cf_fail("internal: unknown normalizer step");
}

int tk_normalize(tk_norm *steps, size_t nsteps, const char *s, size_t n, tk_buf *out, tk_buf *tmp) {
    out->len = 0;
    if (nsteps == 0) return tk_buf_put(out, s, n);
    /* ping-pong between out and tmp so that the last step lands in out */
    tk_buf *bufs[2] = {(nsteps % 2) ? out : tmp, (nsteps % 2) ? tmp : out};
    const char *src = s;
    size_t len = n;
    for (size_t k = 0; k < nsteps; k++) {
        tk_buf *dst = bufs[k % 2];
        if (norm_step(&steps[k], src, len, dst) != 0) return -1;
        src = dst->s;
        len = dst->len;
    }
    return 0;
}
