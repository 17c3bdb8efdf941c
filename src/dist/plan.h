/*
 * plan.h — the ZeRO-1 shard and bucket plan: where each trainable tensor
 * lives in the padded flat buffers (bf16 parameters, fp32 gradients), how the
 * buffer splits into communication buckets, and which elements each rank owns
 * (its fp32 master weights and AdamW moments).
 *
 *   flat buffer:  | bucket 0 (key -1)     | bucket 1 (key 0)    | ... | bucket K-1 (key L) |
 *   bucket k:     | rank 0 | rank 1 | ... | rank W-1 |    each slice len_k / W elements
 *   local shard:  | slice of bucket 0 | slice of bucket 1 | ... |   (the same layout on every rank)
 *
 * - A bucket is a run of consecutive tensors with the same key (the caller's
 *   layer index: -1 embedding, 0..L-1 layers, L final norm + LM head), so one
 *   backward layer's gradients are reduce-scattered as soon as it finishes.
 * - Every tensor starts at a multiple of `align` elements (A); every bucket's
 *   padded length is a multiple of W*A, so buckets and every rank's slice
 *   start at multiples of A. Padding elements belong to no tensor; they are
 *   reduced and gathered like the rest (callers keep them zero) and skipped
 *   by the optimizer through the segment list.
 * - Rank r owns, in bucket k, the flat range
 *       [start_k + r*len_k/W, start_k + (r+1)*len_k/W)
 *   so ncclReduceScatter(send = flat+start_k, recv = shard+local_start_k,
 *   recvcount = len_k/W) and ncclAllGather (the reverse) map every rank to a
 *   contiguous piece of each bucket. In place works too: rank r's slice sits
 *   at flat + start_k + r*len_k/W, which is what NCCL's in-place rule wants.
 * - local_start_k = start_k / W: the local shard is the concatenation of the
 *   rank's slices, shard_numel = total / W on every rank.
 * - W = 1: one shard that is the whole buffer; with A = 1 the offsets are the
 *   plain prefix sums of the tensor sizes (no padding at all).
 *
 * All sizes are int64 and every sum and product is overflow-checked.
 */
#ifndef CF_DIST_PLAN_H
#define CF_DIST_PLAN_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CF_ZERO_MAX_ALIGN (1 << 20)

typedef struct {
    int key;
    int first_tensor, num_tensors;
    int64_t start;        /* flat offset, a multiple of W*A */
    int64_t len;          /* padded length, a multiple of W*A */
    int64_t data_end;     /* flat offset just past its last tensor (<= start + len) */
    int64_t shard_len;    /* len / W: every rank's slice of this bucket */
    int64_t local_start;  /* start / W: the slice's offset in every local shard */
} cf_zero_bucket;

typedef struct {
    int world, align;
    int num_tensors, num_buckets;
    int64_t *numel;       /* [num_tensors] as given */
    int *key;             /* [num_tensors] as given */
    int64_t *offset;      /* [num_tensors] flat offset of each tensor */
    int *bucket;          /* [num_tensors] its bucket */
    cf_zero_bucket *buckets;
    int64_t total;        /* flat length, padding included (sum of bucket lengths) */
    int64_t numel_sum;    /* sum of the tensors' sizes */
    int64_t shard_numel;  /* total / W: the local shard of every rank */
    uint64_t hash;        /* cf_zero_plan_hash of the inputs */
} cf_zero_plan;

/* A contiguous run of one tensor inside a rank's local shard. */
typedef struct {
    int64_t local_off;    /* offset in the local shard */
    int64_t flat_off;     /* offset in the flat buffer */
    int64_t tensor_off;   /* offset inside the tensor (flat_off - offset[tensor]) */
    int64_t len;
    int tensor, bucket;
} cf_zero_segment;

/* Builds the plan for n tensors (numel[i] >= 0, key[i] any int), world size
 * `world` >= 1 and alignment `align` in [1, CF_ZERO_MAX_ALIGN] elements.
 * Free with cf_zero_plan_free (also safe on a zeroed or failed plan). */
int cf_zero_plan_build(cf_zero_plan *p, const int64_t *numel, const int *key, int n, int world, int align);
void cf_zero_plan_free(cf_zero_plan *p);

/* FNV-1a over a version tag, W, A, n and every (numel, key), each as a
 * little-endian int64: equal exactly when the plans are. For checkpoints. */
uint64_t cf_zero_plan_hash(const int64_t *numel, const int *key, int n, int world, int align);

/* Rank r's slice of bucket b: flat [*flat_start, +*len), local [*local_start, +*len). */
void cf_zero_plan_slice(const cf_zero_plan *p, int rank, int bucket, int64_t *flat_start, int64_t *local_start,
                        int64_t *len);

/* Tensor t seen as rows of row_len elements: the rows [*r0, *r1) that hold
 * any element of rank r's slice (*r0 == *r1: none). Whole rows, so the first
 * and last may reach into the neighbours' slices. */
void cf_zero_plan_rows(const cf_zero_plan *p, int rank, int tensor, int64_t row_len, int64_t *r0, int64_t *r1);

/* The parts of bucket b outside rank r's slice, as up to two flat ranges
 * (start[i], len[i]); returns their count. A rank clears them once the
 * bucket is reduce-scattered: their sums went to the other ranks. */
int cf_zero_plan_others(const cf_zero_plan *p, int rank, int bucket, int64_t start[2], int64_t len[2]);

/* The whole rows of cf_zero_plan_rows reach past rank r's slice at their
 * ends: those flat ranges (up to two), to clear after writing the rows. */
int cf_zero_plan_row_spill(const cf_zero_plan *p, int rank, int tensor, int64_t row_len, int64_t start[2],
                           int64_t len[2]);

/* After segment s of a rank's segments (cf_zero_plan_segments, local order)
 * is updated, buckets [0, returned) hold no segment still to update: they
 * can be all-gathered while the later ones are updated. */
int cf_zero_plan_buckets_done(const cf_zero_plan *p, const cf_zero_segment *seg, int nseg, int s);

/* The segments of rank r's local shard, in local order: its slices intersected
 * with the tensors. They cover every non-padding element of the shard exactly
 * once and no padding. *out is malloc'ed (free it); *count may be 0. */
int cf_zero_plan_segments(const cf_zero_plan *p, int rank, cf_zero_segment **out, int *count);

#ifdef __cplusplus
}
#endif

#endif /* CF_DIST_PLAN_H */
