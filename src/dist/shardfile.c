/* shardfile.c — ZeRO-1 optimizer shard files; see shardfile.h. */
#include "dist/shardfile.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/common.h"
#include "dist/launch.h"

#define FNV_PRIME 0x100000001b3ULL
#define MAX_NUMEL ((int64_t)1 << 58)       /* 12 * n + header stays far below 2^63 */
#define CHUNK_FLOATS ((size_t)1 << 22)     /* 16 MiB: a multiple of 32 bytes */

/* ------------------------------------------------------------ checksum */

void cf_shard_sum_init(cf_shard_sum *s) {
    for (int i = 0; i < 4; i++) s->lane[i] = CF_FNV_INIT + (uint64_t)i;
    s->bytes = 0;
}

static uint64_t load_le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

void cf_shard_sum_update(cf_shard_sum *s, const void *data, size_t n) {
    const unsigned char *p = data;
    size_t blocks = n / 32;
    uint64_t l0 = s->lane[0], l1 = s->lane[1], l2 = s->lane[2], l3 = s->lane[3];
    for (size_t b = 0; b < blocks; b++, p += 32) {
        l0 ^= load_le64(p);      l0 *= FNV_PRIME; l0 ^= l0 >> 32;
        l1 ^= load_le64(p + 8);  l1 *= FNV_PRIME; l1 ^= l1 >> 32;
        l2 ^= load_le64(p + 16); l2 *= FNV_PRIME; l2 ^= l2 >> 32;
        l3 ^= load_le64(p + 24); l3 *= FNV_PRIME; l3 ^= l3 >> 32;
    }
    for (size_t i = blocks * 32; i < n; i++, p++) { l0 ^= *p; l0 *= FNV_PRIME; l0 ^= l0 >> 32; }
    s->lane[0] = l0; s->lane[1] = l1; s->lane[2] = l2; s->lane[3] = l3;
    s->bytes += n;
}

uint64_t cf_shard_sum_final(const cf_shard_sum *s) {
    unsigned char b[40];
    for (int l = 0; l < 4; l++)
        for (int i = 0; i < 8; i++) b[8 * l + i] = (unsigned char)(s->lane[l] >> (8 * i));
    for (int i = 0; i < 8; i++) b[32 + i] = (unsigned char)(s->bytes >> (8 * i));
    return cf_fnv1a(CF_FNV_INIT, b, sizeof b);
}

static uint64_t fold3(uint64_t a, uint64_t b, uint64_t c) {
    uint64_t v[3] = {a, b, c};
    unsigned char buf[24];
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < 8; i++) buf[8 * k + i] = (unsigned char)(v[k] >> (8 * i));
    return cf_fnv1a(CF_FNV_INIT, buf, sizeof buf);
}

uint64_t cf_shard_checksum(const float *master, const float *adam_m, const float *adam_v, int64_t n) {
    const float *arr[3] = {master, adam_m, adam_v};
    uint64_t h[3];
    for (int k = 0; k < 3; k++) {
        cf_shard_sum s;
        cf_shard_sum_init(&s);
        cf_shard_sum_update(&s, arr[k], (size_t)n * sizeof(float));
        h[k] = cf_shard_sum_final(&s);
    }
    return fold3(h[0], h[1], h[2]);
}

/* ------------------------------------------------------------- header */

static void put_u32(unsigned char *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i)); }
static void put_u64(unsigned char *p, uint64_t v) { for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i)); }
static uint32_t get_u32(const unsigned char *p) {
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static void encode_header(unsigned char h[CF_SHARD_HEADER_BYTES], const cf_shard_meta *m) {
    memset(h, 0, CF_SHARD_HEADER_BYTES);
    memcpy(h, CF_SHARD_MAGIC, 8);
    put_u32(h + 8, CF_SHARD_VERSION);
    put_u32(h + 12, CF_SHARD_HEADER_BYTES);
    put_u32(h + 16, (uint32_t)m->world_size);
    put_u32(h + 20, (uint32_t)m->rank);
    put_u64(h + 24, m->plan_hash);
    put_u64(h + 32, (uint64_t)m->local_numel);
    put_u64(h + 40, (uint64_t)m->opt_steps);
    put_u64(h + 48, (uint64_t)m->step);
    put_u64(h + 56, (uint64_t)m->data_pos);
    put_u64(h + 120, cf_fnv1a(CF_FNV_INIT, h, 120));
}

int cf_shardfile_name(char *buf, size_t cap, int rank, int world) {
    int n = snprintf(buf, cap, "optim-rank-%05d-of-%05d.bin", rank, world);
    if (n < 0 || (size_t)n >= cap) return cf_fail("shard file name too long");
    return 0;
}

int64_t cf_shardfile_bytes(int64_t n) { return CF_SHARD_HEADER_BYTES + 12 * n + CF_SHARD_TRAILER_BYTES; }

static int meta_ok(const cf_shard_meta *m) {
    return m->world_size >= 1 && m->world_size <= CF_DIST_MAX_WORLD && m->rank >= 0 && m->rank < m->world_size &&
           m->local_numel >= 0 && m->local_numel <= MAX_NUMEL && m->opt_steps >= 0 && m->step >= 0 &&
           m->data_pos >= 0;
}

static int shard_path(char *out, size_t cap, const char *dir, int rank, int world) {
    char name[64];
    if (cf_shardfile_name(name, sizeof name, rank, world) != 0) return -1;
    return cf_path_join(out, cap, dir, name);
}

/* -------------------------------------------------------------- write */

static int write_array(cf_atomic_file *af, const float *a, int64_t n, cf_shard_sum *s) {
    for (int64_t i = 0; i < n; i += (int64_t)CHUNK_FLOATS) {
        size_t k = (size_t)(n - i < (int64_t)CHUNK_FLOATS ? n - i : (int64_t)CHUNK_FLOATS);
        cf_shard_sum_update(s, a + i, k * sizeof(float));
        if (cf_atomic_write(af, a + i, k * sizeof(float)) != 0) return -1;
    }
    return 0;
}

int cf_shardfile_write(const char *dir, const cf_shard_meta *m, const float *master, const float *adam_m,
                       const float *adam_v) {
    if (!meta_ok(m))
        return cf_fail("optimizer shard: invalid header (rank %d of %d, %lld elements, step %lld)", m->rank,
                       m->world_size, (long long)m->local_numel, (long long)m->step);
    if (m->local_numel > 0 && (!master || !adam_m || !adam_v)) return cf_fail("optimizer shard: missing data");
    char path[4096];
    if (cf_mkdir_p(dir) != 0 || shard_path(path, sizeof path, dir, m->rank, m->world_size) != 0) return -1;
    unsigned char h[CF_SHARD_HEADER_BYTES];
    encode_header(h, m);
    cf_atomic_file af;
    if (cf_atomic_open(&af, path) != 0) return -1;
    const float *arr[3] = {master, adam_m, adam_v};
    uint64_t sums[3];
    int rc = cf_atomic_write(&af, h, sizeof h);
    for (int k = 0; k < 3 && rc == 0; k++) {
        cf_shard_sum s;
        cf_shard_sum_init(&s);
        rc = write_array(&af, arr[k], m->local_numel, &s);
        sums[k] = cf_shard_sum_final(&s);
    }
    if (rc == 0) {
        unsigned char t[CF_SHARD_TRAILER_BYTES];
        memcpy(t, CF_SHARD_TRAILER_MAGIC, 8);
        put_u64(t + 8, fold3(sums[0], sums[1], sums[2]));
        rc = cf_atomic_write(&af, t, sizeof t);
    }
    if (rc != 0) {
        cf_atomic_abort(&af);
        return -1;
    }
    return cf_atomic_commit(&af);
}

/* --------------------------------------------------------------- read */

static int other_world(const char *dir, int world);

/* Opens path and checks its header; on success *f is positioned at the payload. */
static int open_checked(const char *path, cf_shard_meta *m, FILE **fp) {
    *fp = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return cf_fail("%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) != 0) { fclose(f); return cf_fail("%s: cannot stat: %s", path, strerror(errno)); }
    unsigned char h[CF_SHARD_HEADER_BYTES];
    if (st.st_size < CF_SHARD_HEADER_BYTES || fread(h, 1, sizeof h, f) != sizeof h) {
        fclose(f);
        return cf_fail("%s: %lld bytes, too short for an optimizer shard header (truncated)", path,
                       (long long)st.st_size);
    }
    if (memcmp(h, CF_SHARD_MAGIC, 8) != 0) {
        fclose(f);
        return cf_fail("%s: not a centrifuge optimizer shard (bad magic)", path);
    }
    uint32_t version = get_u32(h + 8), hbytes = get_u32(h + 12);
    if (version != CF_SHARD_VERSION || hbytes != CF_SHARD_HEADER_BYTES) {
        fclose(f);
        return cf_fail("%s: optimizer shard version %u (header %u bytes); this build reads version %d", path, version,
                       hbytes, CF_SHARD_VERSION);
    }
    if (load_le64(h + 120) != cf_fnv1a(CF_FNV_INIT, h, 120)) {
        fclose(f);
        return cf_fail("%s: optimizer shard header is corrupt (checksum mismatch)", path);
    }
    cf_shard_meta x;
    x.world_size = (int32_t)get_u32(h + 16);
    x.rank = (int32_t)get_u32(h + 20);
    x.plan_hash = load_le64(h + 24);
    x.local_numel = (int64_t)load_le64(h + 32);
    x.opt_steps = (int64_t)load_le64(h + 40);
    x.step = (int64_t)load_le64(h + 48);
    x.data_pos = (int64_t)load_le64(h + 56);
    if (!meta_ok(&x)) {
        fclose(f);
        return cf_fail("%s: optimizer shard header out of range (rank %d of %d, %lld elements)", path, x.rank,
                       x.world_size, (long long)x.local_numel);
    }
    int64_t want = cf_shardfile_bytes(x.local_numel);
    if ((int64_t)st.st_size != want) {
        fclose(f);
        return cf_fail("%s: %lld bytes, expected %lld for %lld elements per array (truncated or corrupt)", path,
                       (long long)st.st_size, (long long)want, (long long)x.local_numel);
    }
    *m = x;
    *fp = f;
    return 0;
}

int cf_shardfile_read_header(const char *path, cf_shard_meta *m) {
    FILE *f;
    if (open_checked(path, m, &f) != 0) return -1;
    fclose(f);
    return 0;
}

static int read_array(FILE *f, const char *path, float *a, int64_t n, cf_shard_sum *s) {
    for (int64_t i = 0; i < n; i += (int64_t)CHUNK_FLOATS) {
        size_t k = (size_t)(n - i < (int64_t)CHUNK_FLOATS ? n - i : (int64_t)CHUNK_FLOATS);
        if (fread(a + i, sizeof(float), k, f) != k) return cf_fail("%s: read failed (truncated?)", path);
        cf_shard_sum_update(s, a + i, k * sizeof(float));
    }
    return 0;
}

int cf_shardfile_read(const char *dir, const cf_shard_meta *expect, cf_shard_meta *got, float *master, float *adam_m,
                      float *adam_v) {
    char path[4096];
    if (shard_path(path, sizeof path, dir, expect->rank, expect->world_size) != 0) return -1;
    if (!cf_path_exists(path)) {
        int w = other_world(dir, expect->world_size);   /* written with another world size? */
        if (w)
            return cf_fail("%s: checkpoint was written by %d ranks, this run has %d: resume with the same world size",
                           dir, w, expect->world_size);
        return cf_fail("%s: missing (the checkpoint has no optimizer shard for rank %d of %d)", path, expect->rank,
                       expect->world_size);
    }
    cf_shard_meta m;
    FILE *f;
    if (open_checked(path, &m, &f) != 0) return -1;
    int rc = 0;
    if (m.world_size != expect->world_size)
        rc = cf_fail("%s: checkpoint was written by %d ranks, this run has %d: resume with the same world size", path,
                     m.world_size, expect->world_size);
    else if (m.rank != expect->rank)
        rc = cf_fail("%s: holds the optimizer shard of rank %d, this is rank %d (renamed or copied file?)", path, m.rank,
                     expect->rank);
    else if (m.plan_hash != expect->plan_hash)
        rc = cf_fail("%s: written for a different parameter layout (plan %016llx, this run %016llx): the model, its "
                     "trainable tensors or the alignment changed",
                     path, (unsigned long long)m.plan_hash, (unsigned long long)expect->plan_hash);
    else if (m.local_numel != expect->local_numel)
        rc = cf_fail("%s: holds %lld elements per array, this run's shard has %lld", path, (long long)m.local_numel,
                     (long long)expect->local_numel);
    float *arr[3] = {master, adam_m, adam_v};
    uint64_t sums[3];
    for (int k = 0; k < 3 && rc == 0; k++) {
        if (m.local_numel > 0 && !arr[k]) { rc = cf_fail("%s: no buffer to read into", path); break; }
        cf_shard_sum s;
        cf_shard_sum_init(&s);
        rc = read_array(f, path, arr[k], m.local_numel, &s);
        sums[k] = cf_shard_sum_final(&s);
    }
    if (rc == 0) {
        unsigned char t[CF_SHARD_TRAILER_BYTES];
        if (fread(t, 1, sizeof t, f) != sizeof t) rc = cf_fail("%s: read failed (truncated?)", path);
        else if (memcmp(t, CF_SHARD_TRAILER_MAGIC, 8) != 0 || load_le64(t + 8) != fold3(sums[0], sums[1], sums[2]))
            rc = cf_fail("%s: optimizer shard data is corrupt (checksum mismatch)", path);
    }
    fclose(f);
    if (rc == 0 && got) *got = m;
    return rc;
}

/* ----------------------------------------------------------- the set */

/* The world size of any optim-rank-*-of-N.bin in dir other than `world`; 0 if none. */
static int other_world(const char *dir, int world) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *e;
    int found = 0;
    while (!found && (e = readdir(d))) {
        int r, w, len = 0;
        if (sscanf(e->d_name, "optim-rank-%5d-of-%5d.bin%n", &r, &w, &len) == 2 && len > 0 &&
            e->d_name[len] == 0 && w != world && w >= 1)
            found = w;
    }
    closedir(d);
    return found;
}

int cf_shardfile_check_set(const char *dir, int world, uint64_t plan_hash, cf_shard_meta *rank0) {
    if (world < 1 || world > CF_DIST_MAX_WORLD) return cf_fail("%s: invalid world size %d", dir, world);
    char path[4096];
    int missing = 0, first_missing = -1;
    for (int r = 0; r < world; r++) {
        if (shard_path(path, sizeof path, dir, r, world) != 0) return -1;
        if (!cf_path_exists(path)) {
            if (first_missing < 0) first_missing = r;
            missing++;
        }
    }
    if (missing) {
        int w = other_world(dir, world);
        if (missing == world && w)
            return cf_fail("%s: checkpoint was written by %d ranks, this run has %d: resume with the same world size",
                           dir, w, world);
        char name[64];
        cf_shardfile_name(name, sizeof name, first_missing, world);
        return cf_fail("%s: incomplete checkpoint: %d of %d optimizer shard files missing (first: %s)", dir, missing,
                       world, name);
    }
    cf_shard_meta m0 = {0};
    for (int r = 0; r < world; r++) {
        cf_shard_meta m;
        if (shard_path(path, sizeof path, dir, r, world) != 0 || cf_shardfile_read_header(path, &m) != 0) return -1;
        if (m.world_size != world || m.rank != r)
            return cf_fail("%s: holds rank %d of %d, but its name says rank %d of %d", path, m.rank, m.world_size, r,
                           world);
        if (r == 0) {
            m0 = m;
            if (plan_hash && m.plan_hash != plan_hash)
                return cf_fail("%s: written for a different parameter layout (plan %016llx, this run %016llx): the "
                               "model, its trainable tensors or the alignment changed",
                               path, (unsigned long long)m.plan_hash, (unsigned long long)plan_hash);
            continue;
        }
        if (m.plan_hash != m0.plan_hash || m.local_numel != m0.local_numel)
            return cf_fail("%s: inconsistent checkpoint: rank %d's shard has plan %016llx with %lld elements, rank 0's "
                           "%016llx with %lld",
                           path, r, (unsigned long long)m.plan_hash, (long long)m.local_numel,
                           (unsigned long long)m0.plan_hash, (long long)m0.local_numel);
        if (m.step != m0.step || m.opt_steps != m0.opt_steps)
            return cf_fail("%s: inconsistent checkpoint: rank %d is at step %lld (optimizer step %lld), rank 0 at step "
                           "%lld (optimizer step %lld)",
                           path, r, (long long)m.step, (long long)m.opt_steps, (long long)m0.step,
                           (long long)m0.opt_steps);
    }
    if (rank0) *rank0 = m0;
    return 0;
}
