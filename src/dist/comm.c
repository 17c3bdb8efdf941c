/*
 * comm.c — the NCCL wrapper of comm.h. Compiled with NCCL under
 * -DCF_WITH_CUDA (make cuda); plain builds get the stubs at the end.
 *
 * Bootstrap through NCCL_COMM_ID (read in NCCL 2.28.3 and 2.28.9, src/bootstrap.cc and
 * src/init.cc; the variable is read with getenv at each call, so setting it
 * before the first NCCL call is enough):
 *   - ncclGetUniqueId -> bootstrapGetUniqueId: when NCCL_COMM_ID is set it
 *     starts no root; it parses "host:port" ("[v6]:port") into the id's
 *     address and uses the fixed NCCL_MAGIC, so every rank computes the same
 *     id on its own and no id has to be exchanged.
 *   - ncclCommInitRank[Config] -> ncclCommInitRankDev: when NCCL_COMM_ID is
 *     set and myrank == 0, it starts the bootstrap root itself
 *     (bootstrapCreateRoot(id, idFromEnv = true)), listening on exactly that
 *     address and port (SO_REUSEADDR | SO_REUSEPORT); the other ranks connect
 *     to it, retrying a refused connect NCCL_SOCKET_RETRY_CNT (34) times with
 *     growing sleeps (about a minute in all). The root thread closes its
 *     socket once all ranks have checked in.
 *   - bootstrapNetInit picks the bootstrap interface in the subnet of the
 *     NCCL_COMM_ID address (127.0.0.1 -> lo on one host).
 * So rank 0 must run on the host of that address, and the port must be free
 * there: MASTER_PORT + 1, since torchrun's store listens on MASTER_PORT.
 * Because the magic is fixed and the port is shared with SO_REUSEPORT, two
 * jobs rendezvousing on the same host and port at once could meet: rank 0
 * first checks with a plain bind that nothing listens there (probe_port).
 */
#include "dist/comm.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/common.h"

#ifdef CF_WITH_CUDA

#include <cuda_runtime.h>
#include <errno.h>
#include <netdb.h>
#include <nccl.h>
#include <sched.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

struct cf_comm {
    ncclComm_t nc;        /* NULL once aborted or destroyed */
    int rank, size, device;
    double timeout_s;
    int aborted;
    int in_group;
    unsigned long long seq;   /* collectives issued */
    char last_op[160];        /* the last one, for messages */
};

static const char *dtype_name(cf_comm_dtype t) {
    switch (t) {
    case CF_COMM_F32: return "f32";
    case CF_COMM_F64: return "f64";
    case CF_COMM_BF16: return "bf16";
    case CF_COMM_I32: return "i32";
    case CF_COMM_I64: return "i64";
    case CF_COMM_U8: return "u8";
    }
    return "?";
}

static int nccl_dtype(cf_comm_dtype t, ncclDataType_t *out) {
    switch (t) {
    case CF_COMM_F32: *out = ncclFloat32; return 0;
    case CF_COMM_F64: *out = ncclFloat64; return 0;
    case CF_COMM_BF16: *out = ncclBfloat16; return 0;
    case CF_COMM_I32: *out = ncclInt32; return 0;
    case CF_COMM_I64: *out = ncclInt64; return 0;
    case CF_COMM_U8: *out = ncclUint8; return 0;
    }
    return cf_fail("NCCL: unknown data type %d", (int)t);
}

static int nccl_op(cf_comm_op op, ncclRedOp_t *out) {
    switch (op) {
    case CF_COMM_SUM: *out = ncclSum; return 0;
    case CF_COMM_MAX: *out = ncclMax; return 0;
    case CF_COMM_MIN: *out = ncclMin; return 0;
    }
    return cf_fail("NCCL: unknown reduction %d", (int)op);
}

static const char *op_name(cf_comm_op op) { return op == CF_COMM_SUM ? "sum" : op == CF_COMM_MAX ? "max" : "min"; }

static void backoff(double waited) {
    if (waited < 1e-3) { sched_yield(); return; }
    struct timespec ts = {0, waited < 0.1 ? 20000 : 200000};
    nanosleep(&ts, NULL);
}

/* Aborts the communicator and fails with "rank R of W: <message>". */
static int fail_abort(cf_comm *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail_abort(cf_comm *c, const char *fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (c->nc) {
        if (c->in_group) { ncclGroupEnd(); c->in_group = 0; }
        (void)ncclCommAbort(c->nc);
        c->nc = NULL;
    }
    c->aborted = 1;
    return cf_fail("rank %d of %d: %s; NCCL communicator aborted", c->rank, c->size, msg);
}

static const char *nccl_detail(ncclComm_t nc) {
    const char *s = ncclGetLastError(nc);
    return s && *s ? s : "no detail";
}

/* Polls until the communicator is no longer ncclInProgress (a non-blocking
 * init, split, group end, enqueue or finalize finished). */
static int settle(cf_comm *c, ncclComm_t nc, const char *what, double timeout_s) {
    double t0 = cf_now();
    for (;;) {
        ncclResult_t st = ncclInProgress;
        ncclResult_t r = ncclCommGetAsyncError(nc, &st);
        if (r != ncclSuccess) st = r;
        if (st == ncclSuccess) return 0;
        double waited = cf_now() - t0;
        if (st != ncclInProgress)
            return fail_abort(c, "NCCL error during %s after %.1f s: %s (%s)", what, waited, ncclGetErrorString(st),
                              nccl_detail(nc));
        if (waited > timeout_s) return fail_abort(c, "%s did not complete within %.0f s", what, timeout_s);
        backoff(waited);
    }
}

static int usable(cf_comm *c) {
    if (!c) return cf_fail("NCCL: no communicator");
    if (c->aborted || !c->nc)
        return cf_fail("rank %d of %d: the NCCL communicator was aborted after an earlier error", c->rank, c->size);
    return 0;
}

/* The result of enqueueing a collective. */
static int enqueued(cf_comm *c, ncclResult_t r) {
    if (r == ncclSuccess) return 0;
    if (r == ncclInProgress) return c->in_group ? 0 : settle(c, c->nc, c->last_op, c->timeout_s);
    return fail_abort(c, "NCCL %s failed: %s (%s)", c->last_op, ncclGetErrorString(r), nccl_detail(c->nc));
}

/* Rank 0: is host:port of the NCCL_COMM_ID free on this host? NCCL would
 * share a port that another job listens on (SO_REUSEPORT). */
static int probe_port(const char *comm_id) {
    char host[300], port[16];
    const char *colon = strrchr(comm_id, ':');
    if (!colon || strlen(colon + 1) >= sizeof port) return 0;
    size_t hl = (size_t)(colon - comm_id);
    if (hl >= sizeof host) return 0;
    memcpy(host, comm_id, hl);
    host[hl] = 0;
    snprintf(port, sizeof port, "%s", colon + 1);
    if (host[0] == '[' && hl >= 2 && host[hl - 1] == ']') {
        memmove(host, host + 1, hl - 2);
        host[hl - 2] = 0;
    }
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host, port, &hints, &res) != 0 || !res) return 0;   /* NCCL will say more */
    int rc = 0;
    int fd = socket(res->ai_family, SOCK_STREAM, 0);
    if (fd >= 0) {
        /* SO_REUSEADDR: a port left in TIME_WAIT by an earlier run is free;
         * only a socket listening there makes the bind fail */
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, res->ai_addr, res->ai_addrlen) != 0) {
            int e = errno;
            if (e == EADDRINUSE)
                rc = cf_fail("rank 0: %s, NCCL's rendezvous (NCCL_COMM_ID), is in use on this host (another job?): "
                             "export MASTER_PORT=<free port>; NCCL uses MASTER_PORT+1",
                             comm_id);
            else if (e == EADDRNOTAVAIL)
                rc = cf_fail("rank 0: %s, NCCL's rendezvous (NCCL_COMM_ID), is not an address of this host: rank 0 "
                             "must run on the MASTER_ADDR host",
                             comm_id);
        }
        close(fd);
    }
    freeaddrinfo(res);
    return rc;
}

int cf_comm_init(cf_comm **out, const cf_dist_env *env, int device, double timeout_s) {
    *out = NULL;
    if (timeout_s <= 0) timeout_s = CF_COMM_DEFAULT_TIMEOUT_S;
    if (env->world_size < 1 || env->rank < 0 || env->rank >= env->world_size)
        return cf_fail("NCCL: invalid rank %d of %d", env->rank, env->world_size);
    cudaError_t ce = cudaSetDevice(device);
    if (ce != cudaSuccess)
        return cf_fail("rank %d: cannot use GPU %d: %s", env->rank, device, cudaGetErrorString(ce));
    const char *cid = getenv("NCCL_COMM_ID");
    if (!cid || !*cid) {
        if (!env->nccl_comm_id[0]) return cf_fail("rank %d: no NCCL rendezvous address", env->rank);
        if (setenv("NCCL_COMM_ID", env->nccl_comm_id, 1) != 0)
            return cf_fail("rank %d: cannot set NCCL_COMM_ID", env->rank);
        cid = getenv("NCCL_COMM_ID");
    }
    if (env->rank == 0 && env->world_size > 1 && probe_port(cid) != 0) return -1;

    cf_comm *c = cf_calloc(1, sizeof *c);
    if (!c) return -1;
    c->rank = env->rank;
    c->size = env->world_size;
    c->device = device;
    c->timeout_s = timeout_s;
    snprintf(c->last_op, sizeof c->last_op, "communicator setup");

    ncclUniqueId id;
    ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) {
        cf_fail("rank %d of %d: ncclGetUniqueId with NCCL_COMM_ID=%s failed: %s (%s)", c->rank, c->size, cid,
                ncclGetErrorString(r), nccl_detail(NULL));
        free(c);
        return -1;
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    r = ncclCommInitRankConfig(&c->nc, c->size, id, c->rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
        if (c->nc) (void)ncclCommAbort(c->nc);
        cf_fail("rank %d of %d: NCCL communicator setup (NCCL_COMM_ID=%s) failed: %s (%s)", c->rank, c->size, cid,
                ncclGetErrorString(r), nccl_detail(c->nc));
        free(c);
        return -1;
    }
    char what[400];
    snprintf(what, sizeof what, "NCCL communicator setup with %d ranks at NCCL_COMM_ID=%s (are all ranks started, and "
             "is rank 0's host reachable there?)", c->size, cid);
    if (settle(c, c->nc, what, timeout_s) != 0) {
        free(c);
        return -1;
    }
    *out = c;
    return 0;
}

int cf_comm_rank(const cf_comm *c) { return c->rank; }
int cf_comm_size(const cf_comm *c) { return c->size; }
int cf_comm_device(const cf_comm *c) { return c->device; }
int cf_comm_aborted(const cf_comm *c) { return c->aborted; }

int cf_comm_reduce_scatter(cf_comm *c, const void *send, void *recv, size_t recv_count, cf_comm_dtype dtype,
                           void *stream) {
    ncclDataType_t t = ncclFloat32;
    if (usable(c) != 0 || nccl_dtype(dtype, &t) != 0) return -1;
    if (dtype != CF_COMM_F32 && dtype != CF_COMM_BF16) return cf_fail("reduce_scatter: f32 or bf16 only");
    c->seq++;
    snprintf(c->last_op, sizeof c->last_op, "reduce_scatter of %zu %s per rank (sum, collective #%llu)", recv_count,
             dtype_name(dtype), c->seq);
    return enqueued(c, ncclReduceScatter(send, recv, recv_count, t, ncclSum, c->nc, (cudaStream_t)stream));
}

int cf_comm_reduce_scatter_f32(cf_comm *c, const float *send, float *recv, size_t recv_count, void *stream) {
    return cf_comm_reduce_scatter(c, send, recv, recv_count, CF_COMM_F32, stream);
}

int cf_comm_all_gather(cf_comm *c, void *buf, size_t count_per_rank, cf_comm_dtype dtype, void *stream) {
    ncclDataType_t t = ncclFloat32;
    if (usable(c) != 0 || nccl_dtype(dtype, &t) != 0) return -1;
    size_t esize = dtype == CF_COMM_BF16 ? 2 : dtype == CF_COMM_U8 ? 1 : (dtype == CF_COMM_F64 || dtype == CF_COMM_I64) ? 8 : 4;
    c->seq++;
    snprintf(c->last_op, sizeof c->last_op, "all_gather of %zu %s per rank (collective #%llu)", count_per_rank,
             dtype_name(dtype), c->seq);
    const char *mine = (const char *)buf + (size_t)c->rank * count_per_rank * esize;
    return enqueued(c, ncclAllGather(mine, buf, count_per_rank, t, c->nc, (cudaStream_t)stream));
}

int cf_comm_all_reduce(cf_comm *c, const void *send, void *recv, size_t count, cf_comm_dtype dtype, cf_comm_op op,
                       void *stream) {
    ncclDataType_t t = ncclFloat32;
    ncclRedOp_t o = ncclSum;
    if (usable(c) != 0 || nccl_dtype(dtype, &t) != 0 || nccl_op(op, &o) != 0) return -1;
    c->seq++;
    snprintf(c->last_op, sizeof c->last_op, "all_reduce of %zu %s (%s, collective #%llu)", count, dtype_name(dtype),
             op_name(op), c->seq);
    return enqueued(c, ncclAllReduce(send, recv, count, t, o, c->nc, (cudaStream_t)stream));
}

int cf_comm_broadcast(cf_comm *c, const void *send, void *recv, size_t count, cf_comm_dtype dtype, int root,
                      void *stream) {
    ncclDataType_t t = ncclFloat32;
    if (usable(c) != 0 || nccl_dtype(dtype, &t) != 0) return -1;
    if (root < 0 || root >= c->size) return cf_fail("rank %d of %d: broadcast from rank %d", c->rank, c->size, root);
    c->seq++;
    snprintf(c->last_op, sizeof c->last_op, "broadcast of %zu %s from rank %d (collective #%llu)", count,
             dtype_name(dtype), root, c->seq);
    return enqueued(c, ncclBroadcast(send, recv, count, t, root, c->nc, (cudaStream_t)stream));
}

int cf_comm_group_begin(cf_comm *c) {
    if (usable(c) != 0) return -1;
    if (c->in_group) return cf_fail("rank %d of %d: NCCL group already open", c->rank, c->size);
    ncclResult_t r = ncclGroupStart();
    if (r != ncclSuccess) return fail_abort(c, "ncclGroupStart failed: %s", ncclGetErrorString(r));
    c->in_group = 1;
    return 0;
}

int cf_comm_group_end(cf_comm *c) {
    if (usable(c) != 0) return -1;
    if (!c->in_group) return cf_fail("rank %d of %d: no NCCL group open", c->rank, c->size);
    c->in_group = 0;
    ncclResult_t r = ncclGroupEnd();
    if (r == ncclSuccess) return 0;
    if (r == ncclInProgress) return settle(c, c->nc, c->last_op, c->timeout_s);
    return fail_abort(c, "NCCL group ending with %s failed: %s (%s)", c->last_op, ncclGetErrorString(r),
                      nccl_detail(c->nc));
}

int cf_comm_check(cf_comm *c) {
    if (usable(c) != 0) return -1;
    ncclResult_t st = ncclSuccess, r = ncclCommGetAsyncError(c->nc, &st);
    if (r != ncclSuccess) st = r;
    if (st != ncclSuccess && st != ncclInProgress)
        return fail_abort(c, "NCCL error after %s: %s (%s)", c->last_op, ncclGetErrorString(st), nccl_detail(c->nc));
    return 0;
}

int cf_comm_wait(cf_comm *c, void *stream, double timeout_s) {
    if (usable(c) != 0) return -1;
    if (c->in_group) return cf_fail("rank %d of %d: cf_comm_wait inside an open NCCL group", c->rank, c->size);
    if (timeout_s <= 0) timeout_s = c->timeout_s;
    double t0 = cf_now();
    for (;;) {
        cudaError_t q = cudaStreamQuery((cudaStream_t)stream);
        if (q == cudaSuccess) return 0;
        double waited = cf_now() - t0;
        if (q != cudaErrorNotReady)
            return fail_abort(c, "CUDA error while waiting %.1f s for %s: %s", waited, c->last_op,
                              cudaGetErrorString(q));
        ncclResult_t st = ncclSuccess, r = ncclCommGetAsyncError(c->nc, &st);
        if (r != ncclSuccess) st = r;
        if (st != ncclSuccess && st != ncclInProgress)
            return fail_abort(c, "NCCL error after %.1f s waiting for %s: %s (%s)", waited, c->last_op,
                              ncclGetErrorString(st), nccl_detail(c->nc));
        if (waited > timeout_s)
            return fail_abort(c, "%s did not finish within %.0f s: a peer rank died or hangs", c->last_op, timeout_s);
        backoff(waited);
    }
}

int cf_comm_split(cf_comm *c, int color, int key, cf_comm **out, double timeout_s) {
    *out = NULL;
    if (usable(c) != 0) return -1;
    if (c->in_group) return cf_fail("rank %d of %d: cf_comm_split inside an open NCCL group", c->rank, c->size);
    if (timeout_s <= 0) timeout_s = c->timeout_s;
    /* NCCL writes the new communicator into s->nc from its own thread when
     * the split completes (ncclCommInitChildComm: *newcomm stays NULL until
     * then), and the split runs as an asynchronous job of the parent: so the
     * parent is polled, and s is not freed on a failure (NCCL may still write
     * into it; the process is exiting anyway). */
    cf_comm *s = cf_calloc(1, sizeof *s);
    if (!s) return -1;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    c->seq++;
    snprintf(c->last_op, sizeof c->last_op, "communicator split (color %d, key %d, collective #%llu)", color, key,
             c->seq);
    ncclResult_t r = ncclCommSplit(c->nc, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &s->nc, &config);
    if (r != ncclSuccess && r != ncclInProgress)
        return fail_abort(c, "NCCL %s failed: %s (%s)", c->last_op, ncclGetErrorString(r), nccl_detail(c->nc));
    if (settle(c, c->nc, c->last_op, timeout_s) != 0) return -1;
    if (!s->nc) {   /* NCCL_SPLIT_NOCOLOR: part of the split, in no group */
        free(s);
        return 0;
    }
    s->rank = c->rank;   /* for messages until the real values are known */
    s->size = c->size;
    s->device = c->device;
    s->timeout_s = c->timeout_s;
    snprintf(s->last_op, sizeof s->last_op, "setup of a communicator split from this one");
    int rank = 0, size = 0;
    if (settle(s, s->nc, s->last_op, timeout_s) != 0) {   /* s is aborted; abort the parent too */
        free(s);
        cf_comm_abort(c);
        return -1;
    }
    if (ncclCommUserRank(s->nc, &rank) != ncclSuccess || ncclCommCount(s->nc, &size) != ncclSuccess) {
        cf_comm_abort(s);
        free(s);
        return fail_abort(c, "cannot query the split communicator");
    }
    s->rank = rank;
    s->size = size;
    *out = s;
    return 0;
}

void cf_comm_abort(cf_comm *c) {
    if (!c || !c->nc) return;
    if (c->in_group) { ncclGroupEnd(); c->in_group = 0; }
    (void)ncclCommAbort(c->nc);
    c->nc = NULL;
    c->aborted = 1;
}

void cf_comm_destroy(cf_comm *c) {
    if (!c) return;
    if (c->nc) {
        if (c->in_group) { ncclGroupEnd(); c->in_group = 0; }
        char err[1024];
        snprintf(err, sizeof err, "%s", cf_last_error());   /* keep the caller's message */
        ncclResult_t r = ncclCommFinalize(c->nc);
        snprintf(c->last_op, sizeof c->last_op, "communicator finalize");
        if ((r == ncclSuccess || r == ncclInProgress) && settle(c, c->nc, c->last_op, c->timeout_s) == 0)
            (void)ncclCommDestroy(c->nc);
        else if (c->nc)
            (void)ncclCommAbort(c->nc);
        c->nc = NULL;
        cf_fail("%s", err);
    }
    free(c);
}

#else /* !CF_WITH_CUDA: stubs */

#define CF_NO_CUDA "this binary was built without CUDA, so it cannot run on several GPUs; build with make cuda"

int cf_comm_init(cf_comm **out, const cf_dist_env *env, int device, double timeout_s) {
    *out = NULL;
    return cf_fail(CF_NO_CUDA);
}
int cf_comm_rank(const cf_comm *c) { return 0; }
int cf_comm_size(const cf_comm *c) { return 1; }
int cf_comm_device(const cf_comm *c) { return -1; }
int cf_comm_aborted(const cf_comm *c) { return 0; }
int cf_comm_reduce_scatter_f32(cf_comm *c, const float *send, float *recv, size_t recv_count, void *stream) {
    return cf_fail(CF_NO_CUDA);
}
int cf_comm_reduce_scatter(cf_comm *c, const void *send, void *recv, size_t recv_count, cf_comm_dtype dtype,
                           void *stream) {
    return cf_fail(CF_NO_CUDA);
}
int cf_comm_all_gather(cf_comm *c, void *buf, size_t count_per_rank, cf_comm_dtype dtype, void *stream) {
    return cf_fail(CF_NO_CUDA);
}
int cf_comm_all_reduce(cf_comm *c, const void *send, void *recv, size_t count, cf_comm_dtype dtype, cf_comm_op op,
                       void *stream) {
    return cf_fail(CF_NO_CUDA);
}
int cf_comm_broadcast(cf_comm *c, const void *send, void *recv, size_t count, cf_comm_dtype dtype, int root,
                      void *stream) {
    return cf_fail(CF_NO_CUDA);
}
int cf_comm_group_begin(cf_comm *c) { return cf_fail(CF_NO_CUDA); }
int cf_comm_group_end(cf_comm *c) { return cf_fail(CF_NO_CUDA); }
int cf_comm_wait(cf_comm *c, void *stream, double timeout_s) { return cf_fail(CF_NO_CUDA); }
int cf_comm_check(cf_comm *c) { return cf_fail(CF_NO_CUDA); }
int cf_comm_split(cf_comm *c, int color, int key, cf_comm **out, double timeout_s) {
    *out = NULL;
    return cf_fail(CF_NO_CUDA);
}
void cf_comm_destroy(cf_comm *c) {}
void cf_comm_abort(cf_comm *c) {}

#endif
