/* plan.c — the ZeRO-1 shard and bucket plan; see plan.h. */
#include "dist/plan.h"

#include <stdlib.h>
#include <string.h>

#include "base/common.h"
#include "dist/launch.h"

#define PLAN_TAG "cf-zero1-plan-v1"
/* Sizes stay below 2^62 so that a sum of two never overflows int64. */
#define PLAN_MAX ((int64_t)1 << 62)

static int add_ok(int64_t a, int64_t b, int64_t *out) {
    return !__builtin_add_overflow(a, b, out) && *out <= PLAN_MAX;
}

/* x rounded up to a multiple of m (m >= 1). */
static int round_up(int64_t x, int64_t m, int64_t *out) {
    int64_t r = x % m, y;
    if (r == 0) { *out = x; return 1; }
    if (!add_ok(x, m - r, &y)) return 0;
    *out = y;
    return 1;
}

static uint64_t hash_i64(uint64_t h, int64_t v) {
    unsigned char b[8];
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)v >> (8 * i));
    return cf_fnv1a(h, b, 8);
}

uint64_t cf_zero_plan_hash(const int64_t *numel, const int *key, int n, int world, int align) {
    uint64_t h = cf_fnv1a(CF_FNV_INIT, PLAN_TAG, sizeof PLAN_TAG - 1);
    h = hash_i64(h, world);
    h = hash_i64(h, align);
    h = hash_i64(h, n);
    for (int i = 0; i < n; i++) {
        h = hash_i64(h, numel[i]);
        h = hash_i64(h, key[i]);
    }
    return h;
}

void cf_zero_plan_free(cf_zero_plan *p) {
    if (!p) return;
    free(p->numel);
    free(p->key);
    free(p->offset);
    free(p->bucket);
    free(p->buckets);
    memset(p, 0, sizeof *p);
}

int cf_zero_plan_build(cf_zero_plan *p, const int64_t *numel, const int *key, int n, int world, int align) {
    memset(p, 0, sizeof *p);
    if (n < 1) return cf_fail("ZeRO plan: no trainable tensors");
    if (world < 1 || world > CF_DIST_MAX_WORLD)
        return cf_fail("ZeRO plan: world size %d is outside [1, %d]", world, CF_DIST_MAX_WORLD);
    if (align < 1 || align > CF_ZERO_MAX_ALIGN)
        return cf_fail("ZeRO plan: alignment %d is outside [1, %d] elements", align, CF_ZERO_MAX_ALIGN);
    for (int i = 0; i < n; i++)
        if (numel[i] < 0 || numel[i] > PLAN_MAX)
            return cf_fail("ZeRO plan: tensor %d has %lld elements", i, (long long)numel[i]);

    int nb = 1;
    for (int i = 1; i < n; i++) nb += key[i] != key[i - 1];
    p->world = world;
    p->align = align;
    p->num_tensors = n;
    p->num_buckets = nb;
    p->numel = cf_malloc((size_t)n * sizeof *p->numel);
    p->key = cf_malloc((size_t)n * sizeof *p->key);
    p->offset = cf_malloc((size_t)n * sizeof *p->offset);
    p->bucket = cf_malloc((size_t)n * sizeof *p->bucket);
    p->buckets = cf_calloc((size_t)nb, sizeof *p->buckets);
    if (!p->numel || !p->key || !p->offset || !p->bucket || !p->buckets) { cf_zero_plan_free(p); return -1; }
    memcpy(p->numel, numel, (size_t)n * sizeof *numel);
    memcpy(p->key, key, (size_t)n * sizeof *key);

    const int64_t unit = (int64_t)world * align;   /* <= 2^36: no overflow */
    int64_t cursor = 0, sum = 0;
    int b = -1;
    for (int i = 0; i < n; i++) {
        if (i == 0 || key[i] != key[i - 1]) {
            if (b >= 0) {
                cf_zero_bucket *k = &p->buckets[b];
                k->data_end = cursor;
                if (!round_up(cursor, unit, &cursor)) goto overflow;
                k->len = cursor - k->start;
            }
            b++;
            p->buckets[b].key = key[i];
            p->buckets[b].first_tensor = i;
            p->buckets[b].start = cursor;   /* a multiple of unit */
        }
        if (!round_up(cursor, align, &cursor)) goto overflow;
        p->offset[i] = cursor;
        p->bucket[i] = b;
        p->buckets[b].num_tensors++;
        if (!add_ok(cursor, numel[i], &cursor) || !add_ok(sum, numel[i], &sum)) goto overflow;
    }
    cf_zero_bucket *last = &p->buckets[b];
    last->data_end = cursor;
    if (!round_up(cursor, unit, &cursor)) goto overflow;
    last->len = cursor - last->start;
    for (int k = 0; k < nb; k++) {
        p->buckets[k].shard_len = p->buckets[k].len / world;
        p->buckets[k].local_start = p->buckets[k].start / world;
    }
    p->total = cursor;
    p->numel_sum = sum;
    p->shard_numel = cursor / world;
    p->hash = cf_zero_plan_hash(numel, key, n, world, align);
    return 0;
overflow:
    cf_zero_plan_free(p);
    return cf_fail("ZeRO plan: the parameter count overflows 2^62 elements");
}

void cf_zero_plan_slice(const cf_zero_plan *p, int rank, int bucket, int64_t *flat_start, int64_t *local_start,
                        int64_t *len) {
    const cf_zero_bucket *k = &p->buckets[bucket];
    *flat_start = k->start + (int64_t)rank * k->shard_len;
    *local_start = k->local_start;
    *len = k->shard_len;
}

void cf_zero_plan_rows(const cf_zero_plan *p, int rank, int tensor, int64_t row_len, int64_t *r0, int64_t *r1) {
    *r0 = *r1 = 0;
    if (tensor < 0 || tensor >= p->num_tensors || row_len <= 0 || rank < 0 || rank >= p->world) return;
    int64_t lo, local, len;
    cf_zero_plan_slice(p, rank, p->bucket[tensor], &lo, &local, &len);
    const int64_t t0 = p->offset[tensor], t1 = t0 + p->numel[tensor];
    int64_t a = lo > t0 ? lo : t0, z = lo + len < t1 ? lo + len : t1;
    if (a >= z) return;
    *r0 = (a - t0) / row_len;
    *r1 = (z - t0 + row_len - 1) / row_len;
}

int cf_zero_plan_others(const cf_zero_plan *p, int rank, int bucket, int64_t start[2], int64_t len[2]) {
    const cf_zero_bucket *k = &p->buckets[bucket];
    int64_t lo, local, n;
    cf_zero_plan_slice(p, rank, bucket, &lo, &local, &n);
    int c = 0;
    if (lo > k->start) { start[c] = k->start; len[c++] = lo - k->start; }
    if (lo + n < k->start + k->len) { start[c] = lo + n; len[c++] = k->start + k->len - (lo + n); }
    return c;
}

int cf_zero_plan_row_spill(const cf_zero_plan *p, int rank, int tensor, int64_t row_len, int64_t start[2],
                           int64_t len[2]) {
    int64_t r0, r1;
    cf_zero_plan_rows(p, rank, tensor, row_len, &r0, &r1);
    if (r1 <= r0) return 0;
    int64_t lo, local, n;
    cf_zero_plan_slice(p, rank, p->bucket[tensor], &lo, &local, &n);
    const int64_t a = p->offset[tensor] + r0 * row_len, z = p->offset[tensor] + r1 * row_len;
    int c = 0;
    if (a < lo) { start[c] = a; len[c++] = lo - a; }
    if (z > lo + n) { start[c] = lo + n; len[c++] = z - (lo + n); }
    return c;
}

int cf_zero_plan_buckets_done(const cf_zero_plan *p, const cf_zero_segment *seg, int nseg, int s) {
    return s + 1 < nseg ? seg[s + 1].bucket : p->num_buckets;
}

/* Counts the segments of rank r, filling seg[] when it is not NULL. */
static int64_t walk_segments(const cf_zero_plan *p, int rank, cf_zero_segment *seg) {
    int64_t count = 0;
    for (int b = 0; b < p->num_buckets; b++) {
        const cf_zero_bucket *k = &p->buckets[b];
        int64_t lo, local, len;
        cf_zero_plan_slice(p, rank, b, &lo, &local, &len);
        int64_t hi = lo + len;
        for (int t = k->first_tensor; t < k->first_tensor + k->num_tensors; t++) {
            int64_t a = p->offset[t], e = a + p->numel[t];
            if (e <= lo || e == a) continue;   /* before the slice, or an empty tensor */
            if (a >= hi) break;    /* tensors are in increasing offset order */
            int64_t s0 = a > lo ? a : lo, s1 = e < hi ? e : hi;
            if (seg) {
                cf_zero_segment *s = &seg[count];
                s->local_off = local + (s0 - lo);
                s->flat_off = s0;
                s->tensor_off = s0 - a;
                s->len = s1 - s0;
                s->tensor = t;
                s->bucket = b;
            }
            count++;
        }
    }
    return count;
}

int cf_zero_plan_segments(const cf_zero_plan *p, int rank, cf_zero_segment **out, int *count) {
    *out = NULL;
    *count = 0;
    if (rank < 0 || rank >= p->world)
        return cf_fail("ZeRO plan: rank %d is outside [0, %d)", rank, p->world);
    int64_t n = walk_segments(p, rank, NULL);
    if (n > (int64_t)1 << 30) return cf_fail("ZeRO plan: %lld segments is too many", (long long)n);
    cf_zero_segment *seg = cf_malloc((size_t)(n ? n : 1) * sizeof *seg);
    if (!seg) return -1;
    walk_segments(p, rank, seg);
    *out = seg;
    *count = (int)n;
    return 0;
}
