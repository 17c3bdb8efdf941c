/*
 * tokenizer_bpe.c — the BPE model: hash maps for the vocabulary and the
 * merge ranks, the merge loop, and a cache of word -> ids.
 *
 * The merge loop is the one of `tokenizers` (Word::merge_all): a min-heap of
 * candidate merges ordered by (rank, position); an entry is applied only if
 * the pair at its position still merges into the same new token. This picks
 * the lowest-ranked adjacent pair, leftmost first, at every step.
 */
#include "formats/tokenizer_internal.h"

#include <stdlib.h>
#include <string.h>

#include "base/common.h"

/* ---------------------------------------------------------------- hash maps */

uint64_t tk_hash(const void *s, size_t n) {
    /* FNV-1a, 8 bytes at a time where possible, then a final mix */
    const unsigned char *p = s;
    uint64_t h = 0xcbf29ce484222325ULL ^ (n * 0x9E3779B97F4A7C15ULL);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0x100000001b3ULL;
        h ^= h >> 29;
        p += 8;
        n -= 8;
    }
    while (n--) h = (h ^ *p++) * 0x100000001b3ULL;
    h ^= h >> 32;
    h *= 0xd6e8feb86659fd93ULL;
    h ^= h >> 32;
    return h;
}

static int strmap_grow(tk_strmap *m) {
    size_t cap = m->cap ? m->cap * 2 : 1024;
    uint32_t *slot = calloc(cap, sizeof *slot);
    if (!slot) return cf_fail("out of memory (hash table of %zu slots)", cap);
    for (size_t i = 0; i < m->n; i++) {
        size_t j = m->e[i].hash & (cap - 1);
        while (slot[j]) j = (j + 1) & (cap - 1);
        slot[j] = (uint32_t)(i + 1);
    }
    free(m->slot);
    m->slot = slot;
    m->cap = cap;
    return 0;
}

int tk_strmap_get(const tk_strmap *m, const char *s, size_t n, uint32_t *val) {
    if (!m->cap) return -1;
    uint64_t h = tk_hash(s, n);
    size_t j = h & (m->cap - 1);
    while (m->slot[j]) {
        const struct tk_sentry *e = &m->e[m->slot[j] - 1];
        if (e->hash == h && e->len == n && memcmp(m->keys.s + e->off, s, n) == 0) {
            *val = e->val;
            return 0;
        }
        j = (j + 1) & (m->cap - 1);
    }
    return -1;
}

int tk_strmap_put(tk_strmap *m, const char *s, size_t n, uint32_t val, int *dup) {
    if (dup) *dup = 0;
    if (n > UINT32_MAX) return cf_fail("token of %zu bytes is too long", n);
    if ((m->n + 1) * 2 > m->cap && strmap_grow(m) != 0) return -1;
    uint64_t h = tk_hash(s, n);
    size_t j = h & (m->cap - 1);
    while (m->slot[j]) {
        const struct tk_sentry *e = &m->e[m->slot[j] - 1];
        if (e->hash == h && e->len == n && memcmp(m->keys.s + e->off, s, n) == 0) {
            if (dup) *dup = 1;
            return -1;
        }
        j = (j + 1) & (m->cap - 1);
    }
    if (m->n == m->ecap) {
        size_t ecap = m->ecap ? m->ecap * 2 : 1024;
        struct tk_sentry *e = realloc(m->e, ecap * sizeof *e);
        if (!e) return cf_fail("out of memory (hash entries)");
        m->e = e;
        m->ecap = ecap;
    }
    size_t off = m->keys.len;
    if (tk_buf_put(&m->keys, s, n) != 0) return -1;
    m->keys.len++;   /* keep the NUL after each key */
    m->e[m->n] = (struct tk_sentry){h, off, (uint32_t)n, val};
    m->slot[j] = (uint32_t)(++m->n);
    return 0;
}

const char *tk_strmap_key(const tk_strmap *m, size_t entry, uint32_t *len) {
    if (len) *len = m->e[entry].len;
    return m->keys.s + m->e[entry].off;
}

void tk_strmap_free(tk_strmap *m) {
    free(m->slot);
    free(m->e);
    tk_buf_free(&m->keys);
    memset(m, 0, sizeof *m);
}

static uint64_t pair_key(uint32_t a, uint32_t b) { return ((uint64_t)a << 32) | b; }

static size_t pair_slot(uint64_t k, size_t cap) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return (size_t)k & (cap - 1);
}

static int pairmap_grow(tk_pairmap *m) {
    size_t cap = m->cap ? m->cap * 2 : 1024;
    uint64_t *key = malloc(cap * sizeof *key);
    uint32_t *rank = malloc(cap * sizeof *rank), *nid = malloc(cap * sizeof *nid);
    if (!key || !rank || !nid) {
        free(key); free(rank); free(nid);
        return cf_fail("out of memory (merge table of %zu slots)", cap);
    }
    for (size_t i = 0; i < cap; i++) key[i] = UINT64_MAX;
    for (size_t i = 0; i < m->cap; i++) {
        if (m->key[i] == UINT64_MAX) continue;
        size_t j = pair_slot(m->key[i], cap);
        while (key[j] != UINT64_MAX) j = (j + 1) & (cap - 1);
        key[j] = m->key[i];
        rank[j] = m->rank[i];
        nid[j] = m->nid[i];
    }
    free(m->key); free(m->rank); free(m->nid);
    m->key = key; m->rank = rank; m->nid = nid;
    m->cap = cap;
    return 0;
}

int tk_pairmap_put(tk_pairmap *m, uint32_t a, uint32_t b, uint32_t rank, uint32_t nid) {
    if ((m->n + 1) * 2 > m->cap && pairmap_grow(m) != 0) return -1;
    uint64_t k = pair_key(a, b);
    size_t j = pair_slot(k, m->cap);
    while (m->key[j] != UINT64_MAX && m->key[j] != k) j = (j + 1) & (m->cap - 1);
    if (m->key[j] == UINT64_MAX) m->n++;
    /* a pair listed twice keeps its last rank, as a Rust HashMap collect does */
    m->key[j] = k;
    m->rank[j] = rank;
    m->nid[j] = nid;
    return 0;
}

int tk_pairmap_get(const tk_pairmap *m, uint32_t a, uint32_t b, uint32_t *rank, uint32_t *nid) {
    if (!m->cap) return -1;
    uint64_t k = pair_key(a, b);
    size_t j = pair_slot(k, m->cap);
    while (m->key[j] != UINT64_MAX) {
        if (m->key[j] == k) {
            *rank = m->rank[j];
            *nid = m->nid[j];
            return 0;
        }
        j = (j + 1) & (m->cap - 1);
    }
    return -1;
}

void tk_pairmap_free(tk_pairmap *m) {
    free(m->key); free(m->rank); free(m->nid);
    memset(m, 0, sizeof *m);
}

int tk_ids_push(uint32_t **ids, size_t *n, size_t *cap, uint32_t id) {
    if (*n == *cap) {
        size_t c = *cap ? *cap * 2 : 256;
        uint32_t *v = realloc(*ids, c * sizeof *v);
        if (!v) return cf_fail("out of memory (%zu token ids)", c);
        *ids = v;
        *cap = c;
    }
    (*ids)[(*n)++] = id;
    return 0;
}

/* --------------------------------------------------------------------- heap */

static int merge_less(const tk_merge *a, const tk_merge *b) {
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(tk_merge *h, size_t *n, tk_merge m) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!merge_less(&m, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = m;
}

static tk_merge heap_pop(tk_merge *h, size_t *n) {
    tk_merge top = h[0], last = h[--(*n)];
    size_t i = 0, m = *n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= m) break;
        if (c + 1 < m && merge_less(&h[c + 1], &h[c])) c++;
        if (!merge_less(&h[c], &last)) break;
        h[i] = h[c];
        i = c;
    }
    if (m) h[i] = last;
    return top;
}

/* ---------------------------------------------------------------------- BPE */

#define CACHE_MAX_WORD 256            /* longer words are not cached         */
#define CACHE_MAX_ENTRIES (1u << 20)  /* the cache is emptied past this, ... */
#define CACHE_MAX_IDS (1u << 24)      /* ... or past 64 MB of ids            */
#define CACHE_MAX_KEYS (64u << 20)    /* ... or past 64 MB of words          */

static int sym_reserve(tk_bpe *m, size_t n) {
    if (n <= m->sym_cap) return 0;
    size_t cap = m->sym_cap ? m->sym_cap : 64;
    while (cap < n) cap *= 2;
    tk_sym *s = realloc(m->sym, cap * sizeof *s);
    if (!s) return cf_fail("out of memory (BPE word of %zu symbols)", n);
    m->sym = s;
    /* the heap gets the initial pairs plus at most two pairs per merge */
    tk_merge *h = realloc(m->heap, cap * 3 * sizeof *h);
    if (!h) return cf_fail("out of memory (BPE heap)");
    m->heap = h;
    m->sym_cap = cap;
    m->heap_cap = cap * 3;
    return 0;
}

static int sym_add(tk_bpe *m, size_t *ns, uint32_t id, uint32_t len) {
    if (sym_reserve(m, *ns + 1) != 0) return -1;
    size_t i = (*ns)++;
    m->sym[i] = (tk_sym){id, (int32_t)i - 1, -1, len};
    if (i > 0) m->sym[i - 1].next = (int32_t)i;
    return 0;
}

/* HF BPE::merge_word up to the merges: one symbol per character (with the
 * subword prefix / word suffix), byte fallback, unknown-token fusion. */
static int initial_symbols(tk_bpe *m, const char *w, size_t n, size_t *ns) {
    *ns = 0;
    int have_unk = 0;
    uint32_t unk_len = 0;
    size_t i = 0;
    while (i < n) {
        size_t at = i;
        (void)tk_utf8_next(w, &i);
        uint32_t clen = (uint32_t)(i - at);
        const char *s = w + at;
        size_t slen = clen;
        if ((at > 0 && m->prefix_len) || (i == n && m->suffix_len)) {
            m->piece.len = 0;
            if (at > 0 && m->prefix_len && tk_buf_put(&m->piece, m->prefix, m->prefix_len) != 0) return -1;
            if (tk_buf_put(&m->piece, s, clen) != 0) return -1;
            if (i == n && m->suffix_len && tk_buf_put(&m->piece, m->suffix, m->suffix_len) != 0) return -1;
            s = m->piece.s;
            slen = m->piece.len;
        }
        uint32_t id;
        if (tk_strmap_get(&m->vocab, s, slen, &id) == 0) {
            if (have_unk) {
                if (sym_add(m, ns, (uint32_t)m->unk_id, unk_len) != 0) return -1;
                have_unk = 0;
            }
            if (sym_add(m, ns, id, clen) != 0) return -1;
            continue;
        }
        if (m->byte_fallback) {
            int all = 1;
            for (size_t k = 0; k < slen; k++)
                if (m->byte_id[(unsigned char)s[k]] < 0) all = 0;
            if (all) {
                /* as in tokenizers, a pending unknown token is not flushed here */
                for (size_t k = 0; k < slen; k++)
                    if (sym_add(m, ns, (uint32_t)m->byte_id[(unsigned char)s[k]], 1) != 0) return -1;
                continue;
            }
        }
        if (m->unk_id >= 0) {
            if (have_unk && m->fuse_unk) {
                unk_len += clen;
            } else {
                if (have_unk && sym_add(m, ns, (uint32_t)m->unk_id, unk_len) != 0) return -1;
                have_unk = 1;
                unk_len = clen;
            }
        }
        /* without an unk token the character is dropped, as in tokenizers */
    }
    if (have_unk && sym_add(m, ns, (uint32_t)m->unk_id, unk_len) != 0) return -1;
    return 0;
}

static void merge_all(tk_bpe *m, size_t ns) {
    tk_sym *sym = m->sym;
    tk_merge *heap = m->heap;
    size_t nh = 0;
    uint32_t rank, nid;
    for (size_t i = 0; i + 1 < ns; i++)
        if (tk_pairmap_get(&m->merges, sym[i].id, sym[i + 1].id, &rank, &nid) == 0)
            heap_push(heap, &nh, (tk_merge){rank, (uint32_t)i, nid});
    while (nh) {
        tk_merge top = heap_pop(heap, &nh);
        tk_sym *cur = &sym[top.pos];
        if (cur->len == 0 || cur->next < 0) continue;
        tk_sym right = sym[cur->next];
        if (tk_pairmap_get(&m->merges, cur->id, right.id, &rank, &nid) != 0 || nid != top.nid) continue;
        /* merge right into cur */
        sym[cur->next].len = 0;
        cur->id = top.nid;
        cur->len += right.len;
        cur->next = right.next;
        if (right.next >= 0) sym[right.next].prev = (int32_t)top.pos;
        if (cur->prev >= 0 &&
            tk_pairmap_get(&m->merges, sym[cur->prev].id, cur->id, &rank, &nid) == 0)
            heap_push(heap, &nh, (tk_merge){rank, (uint32_t)cur->prev, nid});
        if (cur->next >= 0 && tk_pairmap_get(&m->merges, cur->id, sym[cur->next].id, &rank, &nid) == 0)
            heap_push(heap, &nh, (tk_merge){rank, top.pos, nid});
    }
}

static int cache_store(tk_bpe *m, const char *w, size_t n, const uint32_t *ids, size_t k) {
    if (m->cache.n >= CACHE_MAX_ENTRIES || m->cache_nids + k + 1 > CACHE_MAX_IDS ||
        m->cache.keys.len + n + 1 > CACHE_MAX_KEYS) {
        tk_strmap_free(&m->cache);
        m->cache_nids = 0;
    }
    if (m->cache_nids + k + 1 > m->cache_cap) {
        size_t cap = m->cache_cap ? m->cache_cap : 4096;
        while (cap < m->cache_nids + k + 1) cap *= 2;
        uint32_t *v = realloc(m->cache_ids, cap * sizeof *v);
        if (!v) return 0;   /* the cache is an optimisation only */
        m->cache_ids = v;
        m->cache_cap = cap;
    }
    uint32_t off = (uint32_t)m->cache_nids;
    int dup = 0;
    if (tk_strmap_put(&m->cache, w, n, off, &dup) != 0) return dup ? 0 : -1;
    m->cache_ids[off] = (uint32_t)k;
    memcpy(m->cache_ids + off + 1, ids, k * sizeof *ids);
    m->cache_nids += k + 1;
    return 0;
}

static int bpe_word_one(tk_bpe *m, const char *w, size_t n, uint32_t **ids, size_t *nids, size_t *cap) {
    if (n == 0) return 0;
    uint32_t v;
    int cacheable = n <= CACHE_MAX_WORD;
    if (cacheable && tk_strmap_get(&m->cache, w, n, &v) == 0) {
        uint32_t k = m->cache_ids[v];
        for (uint32_t j = 0; j < k; j++)
            if (tk_ids_push(ids, nids, cap, m->cache_ids[v + 1 + j]) != 0) return -1;
        return 0;
    }
    size_t start = *nids;
    if (m->ignore_merges && tk_strmap_get(&m->vocab, w, n, &v) == 0) {
        if (tk_ids_push(ids, nids, cap, v) != 0) return -1;
    } else {
        size_t ns = 0;
        if (initial_symbols(m, w, n, &ns) != 0) return -1;
        merge_all(m, ns);
        for (int32_t i = ns ? 0 : -1; i >= 0; i = m->sym[i].next)
            if (tk_ids_push(ids, nids, cap, m->sym[i].id) != 0) return -1;
    }
    if (cacheable) return cache_store(m, w, n, *ids + start, *nids - start);
    return 0;
}

/* U+2581 (SentencePiece's word marker) in UTF-8 */
#define META "\xE2\x96\x81"

void tk_bpe_check_split(tk_bpe *m) {
    /* Splitting a word before each "▁" that follows another character gives
     * the same ids as merging the whole word when no merge can join the two
     * sides: "▁" is a token (so the right side starts with a token that
     * starts with "▁"), no subword prefix or word suffix changes the
     * symbols, ignore_merges is off (it looks at whole words only), and no
     * merge (a, b) has b starting with "▁" while a does not end with "▁".
     * Each side then goes through the same merges in the same order as
     * inside the whole word, since the merge loop orders by (rank,
     * position) and never pairs symbols across the split. */
    uint32_t id;
    m->split_meta = 0;
    if (m->prefix_len || m->suffix_len || m->ignore_merges || tk_strmap_get(&m->vocab, META, 3, &id) != 0) return;
    uint32_t max = 0;
    for (size_t i = 0; i < m->vocab.n; i++) max = CF_MAX(max, m->vocab.e[i].val);
    const char **byid = cf_calloc((size_t)max + 1, sizeof *byid);
    uint32_t *lenid = byid ? cf_calloc((size_t)max + 1, sizeof *lenid) : NULL;
    int ok = lenid != NULL;
    for (size_t i = 0; ok && i < m->vocab.n; i++) {
        uint32_t l;
        const char *k = tk_strmap_key(&m->vocab, i, &l);
        byid[m->vocab.e[i].val] = k;
        lenid[m->vocab.e[i].val] = l;
    }
    for (size_t j = 0; ok && j < m->merges.cap; j++) {
        if (m->merges.key[j] == UINT64_MAX) continue;
        uint32_t a = (uint32_t)(m->merges.key[j] >> 32), b = (uint32_t)m->merges.key[j];
        const char *sa = byid[a], *sb = byid[b];
        int b_meta = lenid[b] >= 3 && memcmp(sb, META, 3) == 0;
        int a_meta = lenid[a] >= 3 && memcmp(sa + lenid[a] - 3, META, 3) == 0;
        if (b_meta && !a_meta) ok = 0;
    }
    m->split_meta = ok;   /* out of memory here only turns the shortcut off */
    free(byid);
    free(lenid);
}

int tk_bpe_word(tk_bpe *m, const char *w, size_t n, uint32_t **ids, size_t *nids, size_t *cap) {
    if (!m->split_meta || n <= 64) return bpe_word_one(m, w, n, ids, nids, cap);
    size_t seg = 0, i = 0;
    int prev_meta = 1;
    while (i < n) {
        int meta = n - i >= 3 && memcmp(w + i, META, 3) == 0;
        if (meta && !prev_meta) {
            if (bpe_word_one(m, w + seg, i - seg, ids, nids, cap) != 0) return -1;
            seg = i;
        }
        prev_meta = meta;
        if (meta) i += 3;
        else (void)tk_utf8_next(w, &i);
    }
    return bpe_word_one(m, w + seg, n - seg, ids, nids, cap);
}

void tk_bpe_free(tk_bpe *m) {
    tk_strmap_free(&m->vocab);
    tk_pairmap_free(&m->merges);
    free(m->prefix);
    free(m->suffix);
    free(m->sym);
    free(m->heap);
    tk_buf_free(&m->piece);
    tk_strmap_free(&m->cache);
    free(m->cache_ids);
    memset(m, 0, sizeof *m);
}
