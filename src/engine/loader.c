/*
 * loader.c — micro-batches from a token shard (and its reference losses).
 *
 * Rows of S+1 tokens overlap by one token, as in llm.c: a micro-batch is
 * B*S consecutive tokens plus the one after. With data parallelism the
 * shard is read in groups of `world` consecutive micro-batches and rank r
 * takes the r-th of each group, so the ranks read disjoint data, and the
 * union over ranks of one step is what one process would read in `world`
 * steps of gradient accumulation. The position wraps to 0 when a whole
 * group no longer fits.
 */
#include "base/common.h"
#include "centrifuge.h"

int cf_loader_init(cf_loader *ld, const cf_tokens *tok, const cf_refloss *ref, int B, int S) {
    if (B <= 0 || S <= 0) return cf_fail("loader: batch %d and sequence %d must be positive", B, S);
    if ((int64_t)B * S + 1 > tok->n)
        return cf_fail("%s: %lld tokens is fewer than one batch of %d x %d + 1", tok->path,
                       (long long)tok->n, B, S);
    ld->tok = tok; ld->ref = ref; ld->B = B; ld->S = S; ld->pos = 0;
    ld->rank = 0; ld->world = 1;
    return 0;
}

int cf_loader_set_rank(cf_loader *ld, int rank, int world) {
    if (world < 1 || rank < 0 || rank >= world) return cf_fail("loader: rank %d of %d", rank, world);
    if ((int64_t)world * ld->B * ld->S + 1 > ld->tok->n)
        return cf_fail("%s: %lld tokens is fewer than one batch of %d x %d + 1 for each of %d ranks",
                       ld->tok->path, (long long)ld->tok->n, ld->B, ld->S, world);
    ld->rank = rank;
    ld->world = world;
    return 0;
}

void cf_loader_next(cf_loader *ld, int32_t *tokens, float *ref_out) {
    int B = ld->B, S = ld->S;
    int64_t mb = (int64_t)B * S;
    if (ld->pos + mb * ld->world + 1 > ld->tok->n) ld->pos = 0;
    int64_t p0 = ld->pos + mb * ld->rank;
    for (int b = 0; b < B; b++)
        for (int s = 0; s <= S; s++)
            tokens[(int64_t)b * (S + 1) + s] = (int32_t)cf_tokens_get(ld->tok, p0 + (int64_t)b * S + s);
    if (ref_out)
        for (int b = 0; b < B; b++)
            for (int s = 0; s < S; s++)
                ref_out[(int64_t)b * S + s] = ld->ref->loss[p0 + (int64_t)b * S + s + 1];
    ld->pos += mb * ld->world;
}

/* ---------------------------------------------------------------- dataset
 *
 * cf_dataset (centrifuge.h): several shards, read in order or as a seeded
 * shuffle of rows. The shuffle is a keyed bijection on [0, rows): a
 * balanced Feistel network on the smallest even number of bits that covers
 * the row count, with cycle walking (re-apply until the value falls inside
 * [0, rows)), so every epoch is a permutation without an index table and
 * position k of any epoch is computed directly. */
#include <glob.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

struct cf_dataset {
    int n;                    /* shards */
    cf_tokens *tok;           /* [n] */
    cf_refloss *ref;          /* [n] or NULL */
    char **ref_paths;         /* [n] or NULL */
    int owned;                /* tok/ref opened here (else wrapped) */
    int64_t *cum_tok;         /* [n+1] token offsets of the shards laid end to end */
    int64_t *cum_rows;        /* [n+1] row offsets (shuffle) */
    cf_dataset_opts o;
    int rank, world;
    int64_t pos;
};

static char *dup_s(const char *s) {
    char *p = cf_malloc(strlen(s) + 1);
    if (p) strcpy(p, s);
    return p;
}

static int ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int push_path(char ***v, int *n, int *cap, const char *p) {
    if (*n == *cap) {
        int nc = *cap ? 2 * *cap : 8;
        char **nv = realloc(*v, (size_t)nc * sizeof *nv);
        if (!nv) return cf_fail("out of memory");
        *v = nv;
        *cap = nc;
    }
    if (!((*v)[*n] = dup_s(p))) return -1;
    (*n)++;
    return 0;
}

static void free_paths(char **v, int n) {
    if (!v) return;
    for (int i = 0; i < n; i++) free(v[i]);
    free(v);
}

int cf_expand_paths(const char *spec, int want_ref, char ***out, int *nout) {
    *out = NULL;
    *nout = 0;
    if (!spec || !*spec) return cf_fail("empty list of files");
    if (cf_list_has_empty_item(spec)) return cf_fail("'%s': an empty item in the list of files (two commas, or one at an end)", spec);
    char *copy = dup_s(spec);
    if (!copy) return -1;
    char **v = NULL;
    int n = 0, cap = 0, rc = 0;
    char *save = NULL;
    for (char *item = strtok_r(copy, ",", &save); item && rc == 0; item = strtok_r(NULL, ",", &save)) {
        if (!*item) continue;
        if (strpbrk(item, "*?[")) {
            glob_t g;
            int gr = glob(item, GLOB_NOSORT, NULL, &g);
            if (gr == GLOB_NOMATCH) { rc = cf_fail("%s: no file matches this pattern", item); break; }
            if (gr != 0) { rc = cf_fail("%s: cannot expand the pattern", item); break; }
            int first = n;
            for (size_t k = 0; k < g.gl_pathc && rc == 0; k++) {
                const char *p = g.gl_pathv[k];
                if (ends_with(p, ".ref.bin") != !!want_ref) continue;
                rc = push_path(&v, &n, &cap, p);
            }
            globfree(&g);
            if (rc == 0 && n == first)
                rc = cf_fail("%s: matches only %s", item, want_ref ? "files that are not .ref.bin" : ".ref.bin files");
            if (rc == 0) qsort(v + first, (size_t)(n - first), sizeof *v, cmp_str);
        } else {
            struct stat st;
            if (stat(item, &st) != 0) { rc = cf_fail("%s: no such file", item); break; }
            rc = push_path(&v, &n, &cap, item);
        }
    }
    free(copy);
    if (rc == 0 && n == 0) rc = cf_fail("'%s' names no file", spec);
    if (rc != 0) { free_paths(v, n); return -1; }
    *out = v;
    *nout = n;
    return 0;
}

static int dataset_finish(cf_dataset *d, const cf_dataset_opts *o) {
    if (o->B <= 0 || o->S <= 0) return cf_fail("dataset: batch %d and sequence %d must be positive", o->B, o->S);
    d->o = *o;
    d->rank = 0;
    d->world = 1;
    d->pos = 0;
    d->cum_tok = cf_calloc((size_t)d->n + 1, sizeof(int64_t));
    d->cum_rows = cf_calloc((size_t)d->n + 1, sizeof(int64_t));
    if (!d->cum_tok || !d->cum_rows) return -1;
    for (int i = 0; i < d->n; i++) {
        /* a shard shorter than one row is never read (nor, in sequential
         * mode, one shorter than a group); set_rank fails if no shard is read */
        const cf_tokens *t = &d->tok[i];
        d->cum_tok[i + 1] = d->cum_tok[i] + t->n;
        d->cum_rows[i + 1] = d->cum_rows[i] + (t->n > o->S ? (t->n - 1) / o->S : 0);
    }
    return cf_dataset_set_rank(d, 0, 1);
}

cf_dataset *cf_dataset_open(const char *tokens, const char *ref, int vocab_size, const cf_dataset_opts *o) {
    char **tp = NULL, **rp = NULL;
    int nt = 0, nr = 0;
    cf_dataset *d = NULL;
    if (cf_expand_paths(tokens, 0, &tp, &nt) != 0) return NULL;
    if (ref && strcmp(ref, "auto") == 0) {
        rp = cf_calloc((size_t)nt, sizeof *rp);
        if (!rp) goto fail;
        nr = nt;
        for (int i = 0; i < nt; i++) {
            size_t L = strlen(tp[i]);
            size_t stem = ends_with(tp[i], ".bin") ? L - 4 : L;
            if (!(rp[i] = cf_malloc(stem + 9))) goto fail;
            memcpy(rp[i], tp[i], stem);
            strcpy(rp[i] + stem, ".ref.bin");
        }
    } else if (ref) {
        if (cf_expand_paths(ref, 1, &rp, &nr) != 0) goto fail;
        if (nr != nt) {
            cf_fail("--ref names %d reference-loss shard%s for %d token shard%s (give one per token shard, in the "
                    "same order, or 'auto' for X.ref.bin beside each X.bin)",
                    nr, nr == 1 ? "" : "s", nt, nt == 1 ? "" : "s");
            goto fail;
        }
    }
    d = cf_calloc(1, sizeof *d);
    if (!d) goto fail;
    d->owned = 1;
    d->tok = cf_calloc((size_t)nt, sizeof *d->tok);
    if (!d->tok) goto fail;
    if (rp && !(d->ref = cf_calloc((size_t)nt, sizeof *d->ref))) goto fail;
    for (int i = 0; i < nt; i++) {
        if (cf_tokens_open(&d->tok[i], tp[i], vocab_size) != 0) goto fail;
        d->n = i + 1;
        if (rp && cf_refloss_open(&d->ref[i], rp[i], &d->tok[i]) != 0) {
            if (ref && strcmp(ref, "auto") == 0 && !cf_path_exists(rp[i]))
                cf_fail("%s: no reference losses for %s (--ref auto looks for X.ref.bin beside X.bin; write them "
                        "with centrifuge score --data %s)", rp[i], tp[i], tp[i]);
            goto fail;
        }
    }
    d->ref_paths = rp;
    rp = NULL;
    free_paths(tp, nt);
    tp = NULL;
    if (dataset_finish(d, o) != 0) goto fail;
    return d;
fail:
    /* d->n token shards are open (a failed open leaves its struct zeroed,
     * which closes as a no-op); the ref paths are freed below */
    cf_dataset_free(d);
    free_paths(tp, nt);
    free_paths(rp, nr);
    return NULL;
}

cf_dataset *cf_dataset_wrap(const cf_tokens *tok, const cf_refloss *ref, const cf_dataset_opts *o) {
    cf_dataset *d = cf_calloc(1, sizeof *d);
    if (!d) return NULL;
    d->n = 1;
    d->owned = 0;
    d->tok = (cf_tokens *)tok;
    d->ref = (cf_refloss *)ref;
    if (dataset_finish(d, o) != 0) { cf_dataset_free(d); return NULL; }
    return d;
}

void cf_dataset_free(cf_dataset *d) {
    if (!d) return;
    if (d->owned) {
        for (int i = 0; i < d->n; i++) {
            cf_tokens_close(&d->tok[i]);
            if (d->ref) cf_refloss_close(&d->ref[i]);
        }
        free(d->tok);
        free(d->ref);
        if (d->ref_paths) free_paths(d->ref_paths, d->n);
    }
    free(d->cum_tok);
    free(d->cum_rows);
    free(d);
}

/* Sequential mode: can shard i hold a whole group of `world` micro-batches? */
static int seq_group_fits(const cf_dataset *d, int i) {
    return (int64_t)d->o.B * d->o.S * d->world + 1 <= d->tok[i].n;
}

int cf_dataset_set_rank(cf_dataset *d, int rank, int world) {
    if (world < 1 || rank < 0 || rank >= world) return cf_fail("dataset: rank %d of %d", rank, world);
    int old_r = d->rank, old_w = d->world;
    d->rank = rank;
    d->world = world;
    int ok = 0;
    if (d->o.shuffle) ok = d->cum_rows[d->n] >= (int64_t)d->o.B * world;
    else
        for (int i = 0; i < d->n && !ok; i++) ok = seq_group_fits(d, i);
    if (!ok) {
        d->rank = old_r;
        d->world = old_w;
        if (d->n == 1)
            return cf_fail("%s: %lld tokens is fewer than one batch of %d x %d + 1%s", d->tok[0].path,
                           (long long)d->tok[0].n, d->o.B, d->o.S, world > 1 ? " for each rank" : "");
        return cf_fail("%s: no shard of the %d holds one batch of %d x %d + 1 tokens%s", d->tok[0].path, d->n,
                       d->o.B, d->o.S, world > 1 ? " for each rank" : "");
    }
    return 0;
}

/* --- the keyed permutation of [0, n) */

static uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static uint64_t permute(uint64_t i, uint64_t n, uint64_t key) {
    if (n <= 1) return 0;
    int bits = 0;
    while (bits < 64 && ((uint64_t)1 << bits) < n) bits++;
    if (bits & 1) bits++;
    int half = bits / 2;
    uint64_t mask = half >= 64 ? ~0ULL : ((uint64_t)1 << half) - 1;
    do {
        uint64_t l = i >> half, r = i & mask;
        for (int round = 0; round < 4; round++) {
            uint64_t f = mix64(key ^ mix64(r + ((uint64_t)round << 56))) & mask;
            uint64_t t = l ^ f;
            l = r;
            r = t;
        }
        i = (l << half) | r;
    } while (i >= n);
    return i;
}

/* Shuffled mode: the shard and first token of stream row k. */
static void shuffled_row(const cf_dataset *d, int64_t k, int *shard, int64_t *tok0) {
    int64_t R = d->cum_rows[d->n];
    uint64_t epoch = (uint64_t)(k / R);
    uint64_t key = mix64(d->o.seed ^ mix64(epoch + 0x5851f42d4c957f2dULL));
    int64_t g = (int64_t)permute((uint64_t)(k % R), (uint64_t)R, key);
    int lo = 0, hi = d->n - 1;   /* the shard with cum_rows[s] <= g < cum_rows[s+1] */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (d->cum_rows[mid] <= g) lo = mid;
        else hi = mid - 1;
    }
    *shard = lo;
    *tok0 = (g - d->cum_rows[lo]) * d->o.S;
}

static void copy_row(const cf_dataset *d, int s, int64_t t0, int32_t *tokens, float *ref_out) {
    const cf_tokens *t = &d->tok[s];
    int S = d->o.S;
    for (int j = 0; j <= S; j++) tokens[j] = (int32_t)cf_tokens_get(t, t0 + j);
    if (ref_out) memcpy(ref_out, d->ref[s].loss + t0 + 1, (size_t)S * sizeof(float));
}

/* Sequential mode: the shard holding position pos, moved to the start of
 * the next shard that fits a whole group when pos's shard has no room. */
static int64_t seq_normalise(const cf_dataset *d, int64_t pos, int *shard) {
    int64_t total = d->cum_tok[d->n];
    if (pos < 0 || pos >= total) pos = 0;
    int s = 0;
    while (s + 1 < d->n && d->cum_tok[s + 1] <= pos) s++;
    int64_t group = (int64_t)d->o.B * d->o.S * d->world;
    for (int tries = 0; tries <= d->n; tries++) {
        if (seq_group_fits(d, s) && pos - d->cum_tok[s] + group + 1 <= d->tok[s].n) break;
        s = (s + 1) % d->n;
        pos = d->cum_tok[s];
    }
    *shard = s;
    return pos;
}

int cf_dataset_next(cf_dataset *d, int32_t *tokens, float *ref_out) {
    if (ref_out && !d->ref) return cf_fail("dataset: reference losses asked of a dataset without ref shards");
    int B = d->o.B, S = d->o.S;
    if (d->o.shuffle) {
        int64_t k0 = d->pos + (int64_t)B * d->rank;
        for (int b = 0; b < B; b++) {
            int s;
            int64_t t0;
            shuffled_row(d, k0 + b, &s, &t0);
            copy_row(d, s, t0, tokens + (int64_t)b * (S + 1), ref_out ? ref_out + (int64_t)b * S : NULL);
        }
        d->pos += (int64_t)B * d->world;
        return 0;
    }
    int s;
    d->pos = seq_normalise(d, d->pos, &s);
    int64_t mb = (int64_t)B * S;
    int64_t p0 = d->pos - d->cum_tok[s] + mb * d->rank;
    for (int b = 0; b < B; b++)
        copy_row(d, s, p0 + (int64_t)b * S, tokens + (int64_t)b * (S + 1), ref_out ? ref_out + (int64_t)b * S : NULL);
    d->pos += mb * d->world;
    return 0;
}

int64_t cf_dataset_tell(const cf_dataset *d) { return d->pos; }

int cf_dataset_seek(cf_dataset *d, int64_t pos) {
    if (pos < 0) return cf_fail("dataset: negative position %lld", (long long)pos);
    if (!d->o.shuffle && pos > d->cum_tok[d->n])
        return cf_fail("dataset: position %lld is beyond the %lld tokens of the data (other --data than the run "
                       "that saved it?)",
                       (long long)pos, (long long)d->cum_tok[d->n]);
    /* rows read so far: far below 2^62 in any real run; above, the
     * position arithmetic of the next reads would overflow */
    if (pos > INT64_MAX / 2)
        return cf_fail("dataset: position %lld is out of range (a damaged checkpoint?)", (long long)pos);
    d->pos = pos;
    return 0;
}

int cf_dataset_num_shards(const cf_dataset *d) { return d->n; }
const cf_tokens *cf_dataset_shard(const cf_dataset *d, int i) { return i >= 0 && i < d->n ? &d->tok[i] : NULL; }
const char *cf_dataset_ref_path(const cf_dataset *d, int i) {
    if (!d->ref || i < 0 || i >= d->n) return NULL;
    return d->ref_paths ? d->ref_paths[i] : d->ref[i].path;
}
int cf_dataset_has_ref(const cf_dataset *d) { return d->ref != NULL; }
int64_t cf_dataset_num_tokens(const cf_dataset *d) { return d->cum_tok[d->n]; }

uint32_t cf_dataset_max_id(const cf_dataset *d, int *shard) {
    uint32_t m = 0;
    int at = 0;
    for (int i = 0; i < d->n; i++)
        if (d->tok[i].n > 0 && d->tok[i].max_id > m) {
            m = d->tok[i].max_id;
            at = i;
        }
    if (shard) *shard = at;
    return m;
}

int64_t cf_dataset_epoch_tokens(const cf_dataset *d) {
    if (d->o.shuffle) return d->cum_rows[d->n] * d->o.S;
    int64_t group = (int64_t)d->o.B * d->o.S * d->world, sum = 0;
    for (int i = 0; i < d->n; i++)
        if (seq_group_fits(d, i)) sum += (d->tok[i].n - 1) / group * group;
    return sum;
}

uint64_t cf_dataset_fingerprint(const cf_dataset *d) {
    uint64_t h = CF_FNV_INIT;
    for (int i = 0; i < d->n; i++) {
        h = cf_fnv1a(h, &d->tok[i].hash, sizeof d->tok[i].hash);
        h = cf_fnv1a(h, &d->tok[i].n, sizeof d->tok[i].n);
    }
    int64_t v[5] = {d->o.B, d->o.S, d->o.shuffle, (int64_t)d->o.seed, d->world};
    return cf_fnv1a(h, v, sizeof v);
}
