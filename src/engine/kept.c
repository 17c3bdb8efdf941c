/*
 * kept.c — token selection (DESIGN §1): keep the top `keep` fraction of
 * positions by excess loss l(i) - r(i), per sequence or per micro-batch,
 * and the kept-rows object that the filter and the backward consume.
 *
 * One selection of one forward: the mask, the ascending kept row indices
 * and each sequence's slice of them live on the device (m->keep_dev,
 * m->rows, m->seq_start). The caller holds a cf_kept ticket naming that
 * selection; the filter and the backward refuse a ticket of an earlier
 * selection or of an earlier forward, so they can never disagree.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/common.h"
#include "engine/model_internal.h"

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

/* Number of positions kept out of n: round(keep * n), at least 1. keep is
 * the decimal the user wrote, whose binary double can be a hair below it
 * (0.35 * 10 = 3.4999999999999996): the tolerance rounds such halves up as
 * the decimal would. */
int cf_select_kept_count(double keep, int n) {
    double x = keep * n;
    int k = (int)floor(x + 0.5 + 1e-9 * (x > 1 ? x : 1));
    return k < 1 ? 1 : (k > n ? n : k);
}

int cf_select(const float *losses, const float *ref, int B, int S, double keep_frac,
              cf_select_kind kind, int per_batch, uint64_t seed, uint8_t *keep) {
    if (B <= 0 || S <= 0) return cf_fail("select: batch %d and sequence %d must be positive", B, S);
    if (!(keep_frac > 0.0 && keep_frac <= 1.0)) return cf_fail("--keep: %g is outside (0, 1]", keep_frac);
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

/* ------------------------------------------------------------ kept rows */

const float *cf_model_host_losses(cf_model *m) {
    if (m->T == 0) { cf_fail("no forward pass"); return NULL; }
    if (!m->host_losses_fwd) {
        if (cf_tp_settle(m) != 0 ||
            m->b->download(m->b, m->host_losses, m->losses, (size_t)m->T * sizeof(float)) != 0)
            return NULL;
        m->host_losses_fwd = 1;
    }
    return m->host_losses;
}

int cf_kept_check(cf_model *m, const cf_kept *kept) {
    if (!kept) return cf_fail("kept rows: none given");
    if (kept->id == 0 || kept->id != m->sel_id)
        return cf_fail("kept rows #%llu are not the model's current selection (#%llu): select again after "
                       "each forward", (unsigned long long)kept->id, (unsigned long long)m->sel_id);
    if (m->sel_fwd != m->fwd_id)
        return cf_fail("kept rows #%llu belong to an earlier forward pass: select again after each forward",
                       (unsigned long long)kept->id);
    if (kept->n != m->n_kept) return cf_fail("kept rows #%llu: count %d was changed (selection kept %d)",
                                             (unsigned long long)kept->id, kept->n, m->n_kept);
    return 0;
}

/* The mask is on the device: build the row index there and hand out a
 * new ticket. n and max_len are known on the host from the rule. */
static int finish_selection(cf_model *m, int n, int max_len, cf_kept *out) {
    cf_backend *b = m->b;
    if (n <= 0) return cf_fail("select: no token is kept");
    b->keep_to_rows(b, m->rows, m->seq_start, m->keep_dev, m->B, m->S);
    m->sel_id++;
    m->sel_fwd = m->fwd_id;
    m->n_kept = n;
    m->kept_max_len = max_len;
    m->filtered = 0;
    cf_model_reset_filter(m);
    out->id = m->sel_id;
    out->n = n;
    return b->check(b);
}

int cf_select_kept(cf_model *m, const float *ref, const cf_select_opts *o, cf_kept *out) {
    cf_backend *b = m->b;
    memset(out, 0, sizeof *out);
    if (m->T == 0) return cf_fail("select: no forward pass");
    if (!(o->keep > 0.0 && o->keep <= 1.0)) return cf_fail("--keep: %g is outside (0, 1]", o->keep);
    if (o->kind == CF_SELECT_REF && !ref) return cf_fail("select ref needs reference losses (--ref)");
    int group = o->per_batch ? m->T : m->S;
    int k = cf_select_kept_count(o->keep, group);
    int n = k * (m->T / group);
    int max_len = o->per_batch ? CF_MIN(k, m->S) : k;
    if (b->select_topk && o->kind != CF_SELECT_RANDOM) {
        if (o->kind == CF_SELECT_REF && b->upload(b, m->ref_dev, ref, (size_t)m->T * sizeof(float)) != 0) return -1;
        b->select_topk(b, m->keep_dev, m->losses, o->kind == CF_SELECT_REF ? m->ref_dev : NULL, m->T, group, k);
        return finish_selection(m, n, max_len, out);
    }
    /* on the host: random selection, or a backend without select_topk */
    const float *losses = NULL;
    if (o->kind != CF_SELECT_RANDOM && !(losses = cf_model_host_losses(m))) return -1;
    uint8_t *mask = cf_malloc((size_t)m->T);
    if (!mask) return -1;
    int got = cf_select(losses, ref, m->B, m->S, o->keep, o->kind, o->per_batch, o->seed,
                        mask);
    int rc = got < 0 ? -1 : b->upload(b, m->keep_dev, mask, (size_t)m->T);
    free(mask);
    if (rc != 0) return -1;
    return finish_selection(m, got, max_len, out);
}

int cf_kept_from_mask(cf_model *m, const uint8_t *mask, cf_kept *out) {
    memset(out, 0, sizeof *out);
    if (m->T == 0) return cf_fail("kept rows: no forward pass");
    int n = 0, max_len = 0;
    for (int bi = 0; bi < m->B; bi++) {
        int len = 0;
        for (int s = 0; s < m->S; s++) len += mask[(size_t)bi * m->S + s] != 0;
        n += len;
        max_len = CF_MAX(max_len, len);
    }
    uint8_t *norm = cf_malloc((size_t)m->T);
    if (!norm) return -1;
    for (int t = 0; t < m->T; t++) norm[t] = mask[t] != 0;
    int rc = m->b->upload(m->b, m->keep_dev, norm, (size_t)m->T);
    free(norm);
    if (rc != 0) return -1;
    return finish_selection(m, n, max_len, out);
}

int cf_kept_mask(cf_model *m, const cf_kept *kept, uint8_t *mask) {
    if (cf_kept_check(m, kept) != 0 || cf_tp_settle(m) != 0) return -1;
    return m->b->download(m->b, mask, m->keep_dev, (size_t)m->T);
}
