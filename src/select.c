/*
 * select.c — token selection (DESIGN §1): keep the top `keep` fraction of
 * positions by excess loss l(i) - r(i), per sequence or per micro-batch.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

typedef struct { float score; int idx; } scored;

/* Higher score first; equal scores by lower position (deterministic). NaN
 * sorts last so a broken loss is never preferred. */
static int by_score_desc(const void *a, const void *b) {
    const scored *x = a, *y = b;
    int xn = isnan(x->score), yn = isnan(y->score);
    if (xn != yn) return xn - yn;
    if (!xn && x->score != y->score) return x->score > y->score ? -1 : 1;
    return (x->idx > y->idx) - (x->idx < y->idx);
}

/* Number of positions kept out of n: round(keep * n), at least 1. */
int cf_select_kept_count(float keep, int n) {
    int k = (int)lround((double)keep * n);
    return k < 1 ? 1 : (k > n ? n : k);
}

int cf_select(const float *losses, const float *ref, int B, int S, float keep_frac,
              cf_select_kind kind, int per_batch, uint64_t seed, uint8_t *keep) {
    if (B <= 0 || S <= 0) return cf_fail("select: batch %d and sequence %d must be positive", B, S);
    if (!(keep_frac > 0.0f && keep_frac <= 1.0f))
        return cf_fail("--keep: %g is outside (0, 1]", (double)keep_frac);
    if (kind == CF_SELECT_REF && !ref) return cf_fail("select ref needs reference losses (--ref)");
    int T = B * S;
    scored *sc = cf_malloc((size_t)T * sizeof *sc);
    if (!sc) return -1;
    cf_rng rng;
    cf_rng_seed(&rng, seed);
    for (int t = 0; t < T; t++) {
        sc[t].idx = t;
        switch (kind) {
        case CF_SELECT_REF: sc[t].score = losses[t] - ref[t]; break;
        case CF_SELECT_SELF: sc[t].score = losses[t]; break;
        case CF_SELECT_RANDOM: sc[t].score = cf_rng_uniform(&rng); break;
        }
    }
    memset(keep, 0, (size_t)T);
    int total = 0;
    int groups = per_batch ? 1 : B, n = per_batch ? T : S;
    for (int g = 0; g < groups; g++) {
        scored *grp = sc + (size_t)g * n;
        qsort(grp, (size_t)n, sizeof *grp, by_score_desc);
        int k = cf_select_kept_count(keep_frac, n);
        for (int i = 0; i < k; i++) keep[grp[i].idx] = 1;
        total += k;
    }
    free(sc);
    return total;
}

const char *cf_select_name(cf_select_kind k) {
    return k == CF_SELECT_REF ? "ref" : k == CF_SELECT_SELF ? "self" : "random";
}

int cf_select_parse(const char *s, cf_select_kind *out) {
    if (!strcmp(s, "ref")) *out = CF_SELECT_REF;
    else if (!strcmp(s, "self")) *out = CF_SELECT_SELF;
    else if (!strcmp(s, "random")) *out = CF_SELECT_RANDOM;
    else return cf_fail("--select: unknown selection '%s' (ref, self, random)", s);
    return 0;
}
