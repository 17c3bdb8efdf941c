/*
 * shardfile.h — the optimizer-state shard files of a ZeRO-1 checkpoint.
 *
 * Every rank writes, into the checkpoint directory (OUT/step_NNNNNNNN/),
 *
 *   optim-rank-RRRRR-of-WWWWW.bin      e.g. optim-rank-00001-of-00004.bin
 *
 * holding its slice of the fp32 master weights and of AdamW's m and v (the
 * local shard of a cf_zero_plan, padding included). Little-endian:
 *
 *   offset  size  field
 *        0     8  magic "CFZOPT01"
 *        8     4  u32 version (1)
 *       12     4  u32 header bytes (128)
 *       16     4  i32 world size
 *       20     4  i32 rank
 *       24     8  u64 plan hash (cf_zero_plan_hash)
 *       32     8  i64 local numel n
 *       40     8  i64 optimizer step count (AdamW bias correction; behind the
 *                 training step by the skipped non-finite steps)
 *       48     8  i64 training step
 *       56     8  i64 data position (this rank's loader position)
 *       64    56  reserved, zero
 *      120     8  u64 header checksum: FNV-1a over bytes 0..119
 *      128   4n   fp32 master weights
 *     +4n    4n   fp32 AdamW m
 *     +8n    4n   fp32 AdamW v
 *    +12n     8   trailer magic "CFZEND01"
 *    +12n+8   8   u64 payload checksum (cf_shard_checksum of master, m, v)
 *
 * Files are written atomically (temp file, fsync, rename: cf_atomic_*), so a
 * killed save leaves the previous file or the new one. A checkpoint with
 * ZeRO shards counts only when cf_shardfile_check_set finds all W files.
 */
#ifndef CF_DIST_SHARDFILE_H
#define CF_DIST_SHARDFILE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CF_SHARD_MAGIC "CFZOPT01"
#define CF_SHARD_TRAILER_MAGIC "CFZEND01"
#define CF_SHARD_VERSION 1
#define CF_SHARD_HEADER_BYTES 128
#define CF_SHARD_TRAILER_BYTES 16

typedef struct {
    int world_size, rank;
    uint64_t plan_hash;
    int64_t local_numel;
    int64_t opt_steps;    /* AdamW's own step count */
    int64_t step;         /* training step */
    int64_t data_pos;     /* data loader position of this rank */
} cf_shard_meta;

/* "optim-rank-00001-of-00004.bin" into buf. */
int cf_shardfile_name(char *buf, size_t cap, int rank, int world);

/* Bytes of a file holding n elements per array. */
int64_t cf_shardfile_bytes(int64_t local_numel);

/* Writes dir/<name for m->rank, m->world_size> atomically (creates dir).
 * master, adam_m, adam_v: m->local_numel floats each (host memory). */
int cf_shardfile_write(const char *dir, const cf_shard_meta *m, const float *master, const float *adam_m,
                       const float *adam_v);

/* Reads and checks a file's header: magic, version, header checksum, field
 * ranges and the file size the header implies (not the payload checksum). */
int cf_shardfile_read_header(const char *path, cf_shard_meta *m);

/* Reads this rank's file from dir. expect gives world_size, rank, plan_hash
 * and local_numel of this run; a mismatch fails with one line (e.g.
 * "checkpoint was written by 4 ranks, this run has 2: resume with the same
 * world size"). got receives the header (steps, data position). The payload
 * checksum is verified; on failure the buffers' contents are unspecified. */
int cf_shardfile_read(const char *dir, const cf_shard_meta *expect, cf_shard_meta *got, float *master, float *adam_m,
                      float *adam_v);

/* Checks that dir holds a complete, consistent set of shard files for world
 * size `world`: every rank's file present with a valid header, world and rank
 * as named, one plan hash (equal to plan_hash unless that is 0), one
 * local numel, one training step and optimizer step count. Payloads are not
 * read. rank0 (may be NULL) receives rank 0's header. */
int cf_shardfile_check_set(const char *dir, int world, uint64_t plan_hash, cf_shard_meta *rank0);

/* The payload checksum: 4 interleaved lanes over little-endian 64-bit words
 * (h = (h ^ w) * FNV prime; h ^= h >> 32), bytes past the last whole 32-byte
 * block into lane 0, lanes and length folded with FNV-1a. Streaming form:
 * feed chunks whose sizes are multiples of 32 bytes, except the last. */
typedef struct { uint64_t lane[4]; uint64_t bytes; } cf_shard_sum;
void cf_shard_sum_init(cf_shard_sum *s);
void cf_shard_sum_update(cf_shard_sum *s, const void *data, size_t n);
uint64_t cf_shard_sum_final(const cf_shard_sum *s);
uint64_t cf_shard_checksum(const float *master, const float *adam_m, const float *adam_v, int64_t n);

#ifdef __cplusplus
}
#endif

#endif /* CF_DIST_SHARDFILE_H */
