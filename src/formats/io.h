/*
 * io.h — the safetensors format (read bf16/fp16/fp32, write fp32/bf16,
 * sharded with an index) and dtype conversions. config.json (config.c) and
 * the token and reference-loss shards (shards.c) have their API in
 * include/centrifuge.h.
 *
 * Every reader validates everything it reads and fails with one line naming
 * the file and the problem (cf_fail), never crashing on a bad file.
 */
#ifndef CF_IO_H
#define CF_IO_H

#include <stddef.h>
#include <stdint.h>

#include "centrifuge.h"

/* ------------------------------------------------------------ safetensors */

typedef enum { CF_DT_F32 = 0, CF_DT_F16, CF_DT_BF16 } cf_dtype;
const char *cf_dtype_name(cf_dtype d);      /* "F32", "F16", "BF16" */
size_t cf_dtype_size(cf_dtype d);

#define CF_ST_MAX_DIMS 8
#define CF_ST_MAX_NAME 256

typedef struct {
    char name[CF_ST_MAX_NAME];
    cf_dtype dtype;
    int ndim;
    int64_t shape[CF_ST_MAX_DIMS];
    uint64_t begin, end;   /* byte offsets within the file's data section */
    int file;              /* index into cf_st_archive.files              */
} cf_st_tensor;

typedef struct {
    int ntensors;
    cf_st_tensor *tensors;
    int nfiles;
    char **files;              /* paths of the .safetensors files          */
    uint64_t *data_offset;     /* per file: 8 + header length              */
} cf_st_archive;

/* Opens a model directory (model.safetensors, or model.safetensors.index.json
 * with its shards) or a single .safetensors file, reading only headers.
 * Validates: header length within the file, JSON well-formed, dtypes
 * known, shapes non-negative, offsets within the data section, sizes equal
 * numel * dtype size, no overlapping tensors, no duplicate names. */
int cf_st_open(cf_st_archive *a, const char *path);
void cf_st_close(cf_st_archive *a);
/* Index of the tensor with this name, or -1. */
int cf_st_find(const cf_st_archive *a, const char *name);
/* Reads tensor i converted to fp32; numel must match the tensor's. */
int cf_st_read_f32(const cf_st_archive *a, int i, float *out, size_t numel);

typedef struct {
    const char *name;
    const float *data;      /* fp32 host data */
    int ndim;
    int64_t shape[CF_ST_MAX_DIMS];
} cf_st_item;

/* Writes one .safetensors file (dtype CF_DT_F32 or CF_DT_BF16, round to
 * nearest even), atomically. metadata {"format":"pt"} is included. */
int cf_st_write(const char *path, const cf_st_item *items, int n, cf_dtype dtype);
/* Writes into dir: model.safetensors if everything fits in max_shard_bytes
 * (or max_shard_bytes == 0), else model-0000k-of-0000N.safetensors plus
 * model.safetensors.index.json (HF layout). Atomic per file; the index is
 * written last. Removes a stale single/sharded layout of the other kind. */
int cf_st_write_dir(const char *dir, const cf_st_item *items, int n, cf_dtype dtype,
                    size_t max_shard_bytes);

/* bf16/fp16 <-> fp32 conversions (round to nearest even on the way down). */
float cf_bf16_to_f32(uint16_t h);
uint16_t cf_f32_to_bf16(float f);
float cf_f16_to_f32(uint16_t h);

/* Token shards and reference-loss shards (shards.c) are public: see
 * include/centrifuge.h. */

#endif /* CF_IO_H */
