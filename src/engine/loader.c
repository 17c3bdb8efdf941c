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
