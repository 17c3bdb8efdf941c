/*
 * shards.c — token shards (llm.c-compatible) and reference-loss shards.
 *
 * Token shard: a header of 256 little-endian int32 — [0] magic 20240520,
 * [1] version (1: uint16 tokens, as llm.c writes; 2: uint32 tokens, for
 * vocabularies over 65535), [2] token count — then the tokens. Token shards
 * can be large, so they are mmapped, never copied.
 *
 * Reference-loss shard: the same header style — [0] magic 20251121,
 * [1] version 1, [2] count, [3]/[4] low/high 32 bits of the FNV-1a hash of
 * its token shard's payload — then count float32. ref[i] is the reference
 * model's loss of predicting token i from tokens < i, so ref[0] is 0 by
 * definition; a nonzero ref[0] is the signature of an off-by-one writer and
 * is refused. The hash ties a ref shard to the exact tokens it was scored
 * on: a ref shard of another (or a regenerated) token shard of the same
 * length would otherwise be accepted and train on wrong scores.
 *
 * All readers check the header against the real file size before touching
 * the payload; all writers are atomic (temp file + rename).
 */
#include "base/common.h"
#include "formats/io.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "shard I/O assumes a little-endian host"
#endif

#define HEADER_INTS 256
#define HEADER_BYTES (HEADER_INTS * 4)
#define CHUNK 65536
/* The writer clamps losses in [-LOSS_CLAMP, 0) to 0: a cross-entropy
 * computed as logsumexp - logit can come out a few ulps below zero when
 * the model is certain. Anything more negative is a bug and is refused. */
#define LOSS_CLAMP 1e-4f

static ssize_t pread_full(int fd, void *buf, size_t n, off_t off) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, (char *)buf + got, n - got, off + (off_t)got);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (r == 0) break;
        got += (size_t)r;
    }
    return (ssize_t)got;
}

static char *dup_str(const char *s) {
    char *p = cf_malloc(strlen(s) + 1);
    if (p) strcpy(p, s);
    return p;
}

/* Opens path as an input (cf_open_input: a regular file, registered until
 * cf_input_release; no hang on a FIFO) with a full header, and reads the
 * header. Returns the fd (caller closes) or -1. */
static int open_with_header(const char *path, int32_t hdr[HEADER_INTS], int64_t *size) {
    int64_t sz = 0;
    int fd = cf_open_input(path, &sz);
    if (fd < 0) return -1;
    if (sz < HEADER_BYTES) {
        close(fd);
        return cf_fail("%s: file has %lld bytes, too short for the %d-byte header", path, (long long)sz,
                       HEADER_BYTES);
    }
    if (pread_full(fd, hdr, HEADER_BYTES, 0) != HEADER_BYTES) {
        close(fd);
        return cf_fail("%s: cannot read the header", path);
    }
    *size = sz;
    return fd;
}

/* ----------------------------------------------------------- token shards */

static void tokens_free(cf_tokens *t) {
    if (t->map && t->map_len) munmap(t->map, t->map_len);   /* data points into the map */
    free(t->path);
    memset(t, 0, sizeof *t);
}

void cf_tokens_close(cf_tokens *t) {
    if (!t) return;
    if (t->path) cf_input_release(t->path);
    tokens_free(t);
}

static int tokens_open(cf_tokens *t, const char *path, int vocab_size);

int cf_tokens_open(cf_tokens *t, const char *path, int vocab_size) {
    if (!t || !path) return cf_fail("tokens: NULL argument");
    memset(t, 0, sizeof *t);
    int rc = tokens_open(t, path, vocab_size);
    if (rc != 0) cf_input_release(path);   /* registered by open_with_header */
    return rc;
}

static int tokens_open(cf_tokens *t, const char *path, int vocab_size) {
    int32_t hdr[HEADER_INTS];
    int64_t size;
    int fd = open_with_header(path, hdr, &size);
    if (fd < 0) return -1;

    if (hdr[0] != CF_TOKENS_MAGIC) {
        close(fd);
        if (hdr[0] == CF_REFLOSS_MAGIC)
            return cf_fail("%s: this is a reference-loss shard, not a token shard", path);
        return cf_fail("%s: bad magic %d (expected %d): not a token shard", path, hdr[0], CF_TOKENS_MAGIC);
    }
    if (hdr[1] != CF_TOKENS_V_U16 && hdr[1] != CF_TOKENS_V_U32) {
        close(fd);
        return cf_fail("%s: unsupported version %d (1 = uint16 tokens, 2 = uint32 tokens)", path, hdr[1]);
    }
    int width = hdr[1] == CF_TOKENS_V_U16 ? 2 : 4;
    int64_t n = hdr[2];
    if (n < 0) {
        close(fd);
        return cf_fail("%s: header says %lld tokens, which is negative", path, (long long)n);
    }
    int64_t expect = HEADER_BYTES + n * width;
    if (size != expect) {
        close(fd);
        return cf_fail("%s: file has %lld bytes, header says %lld tokens of %d bytes (expected %lld bytes)", path,
                       (long long)size, (long long)n, width, (long long)expect);
    }

    void *map = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);   /* the mapping keeps the file alive */
    if (map == MAP_FAILED) return cf_fail("%s: cannot mmap: %s", path, strerror(e));
    madvise(map, (size_t)size, MADV_SEQUENTIAL);   /* one pass now; a hint only */

    t->path = dup_str(path);
    if (!t->path) { munmap(map, (size_t)size); return -1; }
    t->map = map;
    t->map_len = (size_t)size;
    t->data = (char *)map + HEADER_BYTES;
    t->n = n;
    t->width = width;

    /* One pass for the largest id; the hash is over the payload bytes. */
    uint32_t max_id = 0;
    if (width == 2) {
        const uint16_t *p = t->data;
        for (int64_t i = 0; i < n; i++) if (p[i] > max_id) max_id = p[i];
    } else {
        const uint32_t *p = t->data;
        for (int64_t i = 0; i < n; i++) if (p[i] > max_id) max_id = p[i];
    }
    t->max_id = max_id;
    if (vocab_size > 0 && n > 0 && max_id >= (uint32_t)vocab_size) {
        int64_t i = 0;
        while (cf_tokens_get(t, i) < (uint32_t)vocab_size) i++;   /* terminates: some id is >= vocab */
        uint32_t id = cf_tokens_get(t, i);
        tokens_free(t);
        return cf_fail("%s: token id %u at position %lld is >= vocab_size %d", path, id, (long long)i, vocab_size);
    }
    t->hash = cf_fnv1a(CF_FNV_INIT, t->data, (size_t)n * (size_t)width);
    madvise(map, (size_t)size, MADV_NORMAL);
    return 0;
}

static int write_header(cf_atomic_file *af, int32_t magic, int32_t version, int64_t n, uint64_t hash,
                        int with_hash) {
    int32_t hdr[HEADER_INTS];
    memset(hdr, 0, sizeof hdr);
    hdr[0] = magic;
    hdr[1] = version;
    hdr[2] = (int32_t)n;
    if (with_hash) {
        hdr[3] = (int32_t)(uint32_t)(hash & 0xffffffffu);
        hdr[4] = (int32_t)(uint32_t)(hash >> 32);
    }
    return cf_atomic_write(af, hdr, sizeof hdr);
}

int cf_tokens_write(const char *path, const uint32_t *tokens, int64_t n, int width) {
    if (!path) return cf_fail("tokens: NULL path");
    if (n < 0 || n > INT32_MAX)
        return cf_fail("%s: token count %lld is outside [0, %d] (the header holds an int32)", path, (long long)n,
                       INT32_MAX);
    if (n > 0 && !tokens) return cf_fail("%s: NULL token buffer", path);
    if (width != 0 && width != 2 && width != 4) return cf_fail("%s: token width %d must be 0, 2 or 4", path, width);
    uint32_t max_id = 0;
    int64_t max_at = 0;
    for (int64_t i = 0; i < n; i++)
        if (tokens[i] > max_id) { max_id = tokens[i]; max_at = i; }
    if (width == 0) width = max_id <= 0xffffu ? 2 : 4;
    if (width == 2 && max_id > 0xffffu)
        return cf_fail("%s: token id %u at position %lld does not fit in uint16 (write with width 4)", path, max_id,
                       (long long)max_at);

    cf_atomic_file af;
    if (cf_atomic_open(&af, path) != 0) return -1;
    int rc = write_header(&af, CF_TOKENS_MAGIC, width == 2 ? CF_TOKENS_V_U16 : CF_TOKENS_V_U32, n, 0, 0);
    if (rc == 0 && width == 4) rc = cf_atomic_write(&af, tokens, (size_t)n * 4);
    if (rc == 0 && width == 2) {
        uint16_t *tmp = cf_malloc(CHUNK * sizeof *tmp);
        if (!tmp) rc = -1;
        for (int64_t done = 0; rc == 0 && done < n; done += CHUNK) {
            size_t m = (size_t)CF_MIN((int64_t)CHUNK, n - done);
            for (size_t k = 0; k < m; k++) tmp[k] = (uint16_t)tokens[done + (int64_t)k];
            rc = cf_atomic_write(&af, tmp, m * 2);
        }
        free(tmp);
    }
    if (rc != 0) { cf_atomic_abort(&af); return -1; }
    return cf_atomic_commit(&af);
}

/* --------------------------------------------------- reference-loss shards */

static void refloss_free(cf_refloss *r) {
    free(r->loss);
    free(r->path);
    memset(r, 0, sizeof *r);
}

void cf_refloss_close(cf_refloss *r) {
    if (!r) return;
    if (r->path) cf_input_release(r->path);
    free(r->loss);
    free(r->path);
    memset(r, 0, sizeof *r);
}

/* Checks one loss value; returns 0 or fails naming the position. */
static int check_loss(const char *path, const float *loss, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float v = loss[i];
        if (!isfinite(v))
            return cf_fail("%s: loss at position %lld is %s", path, (long long)i, isnan(v) ? "NaN" : "infinite");
        if (v < 0) return cf_fail("%s: loss at position %lld is negative (%g)", path, (long long)i, (double)v);
    }
    if (n > 0 && loss[0] != 0)
        return cf_fail("%s: loss at position 0 is %g, must be 0 (ref[i] is the loss of predicting token i, "
                       "and token 0 has nothing before it; off by one?)", path, (double)loss[0]);
    return 0;
}

int cf_refloss_open(cf_refloss *r, const char *path, const cf_tokens *tokens) {
    if (!r || !path) return cf_fail("refloss: NULL argument");
    memset(r, 0, sizeof *r);
    int32_t hdr[HEADER_INTS];
    int64_t size;
    int fd = open_with_header(path, hdr, &size);
    if (fd < 0) return -1;

    int rc = -1;
    if (hdr[0] != CF_REFLOSS_MAGIC) {
        if (hdr[0] == CF_TOKENS_MAGIC) cf_fail("%s: this is a token shard, not a reference-loss shard", path);
        else cf_fail("%s: bad magic %d (expected %d): not a reference-loss shard", path, hdr[0], CF_REFLOSS_MAGIC);
        goto done;
    }
    if (hdr[1] != CF_REFLOSS_VERSION) {
        cf_fail("%s: unsupported version %d (expected %d)", path, hdr[1], CF_REFLOSS_VERSION);
        goto done;
    }
    int64_t n = hdr[2];
    if (n < 0) { cf_fail("%s: header says %lld losses, which is negative", path, (long long)n); goto done; }
    int64_t expect = HEADER_BYTES + n * 4;
    if (size != expect) {
        cf_fail("%s: file has %lld bytes, header says %lld losses (expected %lld bytes)", path, (long long)size,
                (long long)n, (long long)expect);
        goto done;
    }
    uint64_t hash = (uint64_t)(uint32_t)hdr[3] | ((uint64_t)(uint32_t)hdr[4] << 32);
    if (tokens) {
        const char *tp = tokens->path ? tokens->path : "(token shard)";
        if (n != tokens->n) {
            cf_fail("%s does not belong to %s: it has %lld losses, the token shard has %lld tokens", path, tp,
                    (long long)n, (long long)tokens->n);
            goto done;
        }
        if (hash != tokens->hash) {
            cf_fail("%s does not belong to %s: it was scored on tokens with hash %016llx, the token shard's hash "
                    "is %016llx", path, tp, (unsigned long long)hash, (unsigned long long)tokens->hash);
            goto done;
        }
    }
    r->loss = cf_malloc((size_t)(n ? n : 1) * sizeof *r->loss);
    if (!r->loss) goto done;
    if (n > 0 && pread_full(fd, r->loss, (size_t)n * 4, HEADER_BYTES) != (ssize_t)(n * 4)) {
        cf_fail("%s: cannot read the losses", path);
        goto done;
    }
    if (check_loss(path, r->loss, n) != 0) goto done;
    r->path = dup_str(path);
    if (!r->path) goto done;
    r->n = n;
    r->token_hash = hash;
    rc = 0;
done:
    close(fd);
    if (rc != 0) {
        refloss_free(r);
        cf_input_release(path);   /* registered by open_with_header */
    }
    return rc;
}

int cf_refloss_write(const char *path, const float *loss, int64_t n, uint64_t token_hash) {
    if (!path) return cf_fail("refloss: NULL path");
    if (n < 0 || n > INT32_MAX)
        return cf_fail("%s: loss count %lld is outside [0, %d] (the header holds an int32)", path, (long long)n,
                       INT32_MAX);
    if (n > 0 && !loss) return cf_fail("%s: NULL loss buffer", path);
    /* Validate (after the rounding clamp) before creating anything, so a bad
     * buffer leaves no file behind. */
    for (int64_t i = 0; i < n; i++) {
        float v = loss[i];
        if (v < 0 && v >= -LOSS_CLAMP) v = 0;
        if (!isfinite(v))
            return cf_fail("%s: loss at position %lld is %s", path, (long long)i, isnan(v) ? "NaN" : "infinite");
        if (v < 0) return cf_fail("%s: loss at position %lld is negative (%g)", path, (long long)i, (double)v);
        if (i == 0 && v != 0)
            return cf_fail("%s: loss at position 0 is %g, must be 0 (ref[i] is the loss of predicting token i; "
                           "off by one?)", path, (double)v);
    }

    cf_atomic_file af;
    if (cf_atomic_open(&af, path) != 0) return -1;
    int rc = write_header(&af, CF_REFLOSS_MAGIC, CF_REFLOSS_VERSION, n, token_hash, 1);
    float *tmp = rc == 0 ? cf_malloc(CHUNK * sizeof *tmp) : NULL;
    if (rc == 0 && !tmp) rc = -1;
    for (int64_t done = 0; rc == 0 && done < n; done += CHUNK) {
        size_t m = (size_t)CF_MIN((int64_t)CHUNK, n - done);
        for (size_t k = 0; k < m; k++) {
            float v = loss[done + (int64_t)k];
            tmp[k] = v < 0 ? 0.0f : v;   /* only tiny negatives reach here */
        }
        rc = cf_atomic_write(&af, tmp, m * 4);
    }
    free(tmp);
    if (rc != 0) { cf_atomic_abort(&af); return -1; }
    return cf_atomic_commit(&af);
}
