/*
 * comm.h — a thin NCCL wrapper for data-parallel training, with bounded waits.
 *
 * Every call takes the caller's CUDA stream as void* (a cudaStream_t; NULL =
 * the legacy default stream), so C callers need no CUDA headers. The
 * communicator is non-blocking (ncclConfig_t.blocking = 0): initialisation,
 * enqueueing and waiting all poll with a deadline, and on an error or a
 * timeout the communicator is aborted (ncclCommAbort) and the call fails with
 * one line naming this rank, the operation and the time waited — a peer that
 * died or hangs never makes the others wait forever. After that every call on
 * the communicator fails; destroy it and exit.
 *
 * Bootstrap: NCCL's own, through NCCL_COMM_ID (see comm.c and launch.h). Call
 * cf_comm_init once per process, early (before loading the model: ranks that
 * reach it wait at most about a minute, NCCL's connect retries, for rank 0 to
 * open the rendezvous); make further groups with cf_comm_split.
 *
 * Builds without CUDA (plain `make`) get stubs that fail with
 * "this binary was built without CUDA ...".
 */
#ifndef CF_DIST_COMM_H
#define CF_DIST_COMM_H

#include <stddef.h>

#include "dist/launch.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct cf_comm cf_comm;

typedef enum { CF_COMM_F32 = 0, CF_COMM_F64, CF_COMM_BF16, CF_COMM_I32, CF_COMM_I64, CF_COMM_U8 } cf_comm_dtype;
typedef enum { CF_COMM_SUM = 0, CF_COMM_MAX, CF_COMM_MIN } cf_comm_op;

#define CF_COMM_DEFAULT_TIMEOUT_S 600.0

/* Sets NCCL_COMM_ID from env (unless already set), makes `device` current,
 * creates the communicator of env->world_size ranks and waits for it at most
 * timeout_s seconds (<= 0: CF_COMM_DEFAULT_TIMEOUT_S). The timeout is also the
 * deadline for enqueueing each later collective. */
int cf_comm_init(cf_comm **out, const cf_dist_env *env, int device, double timeout_s);

int cf_comm_rank(const cf_comm *c);
int cf_comm_size(const cf_comm *c);
int cf_comm_device(const cf_comm *c);
/* 1 once the communicator was aborted after an error or timeout. */
int cf_comm_aborted(const cf_comm *c);

/* ZeRO gradients: recv[i] = sum over ranks of send[rank * recv_count + i].
 * In place when recv == send + rank * recv_count (NCCL's rule). */
int cf_comm_reduce_scatter_f32(cf_comm *c, const float *send, float *recv, size_t recv_count, void *stream);
/* The same for dtype F32 or BF16 (sum). */
int cf_comm_reduce_scatter(cf_comm *c, const void *send, void *recv, size_t recv_count, cf_comm_dtype dtype,
                           void *stream);

/* In-place all-gather: buf holds size * count_per_rank elements; this rank's
 * piece, at buf + rank * count_per_rank, goes to every rank. dtype BF16 or F32. */
int cf_comm_all_gather(cf_comm *c, void *buf, size_t count_per_rank, cf_comm_dtype dtype, void *stream);

/* recv = op over ranks of send (in place when recv == send). F32 / F64 sum
 * (gradient norms, losses, token counts), I32 / I64 / U8 sum or max
 * (non-finite flags, kept counts); MIN is accepted too. */
int cf_comm_all_reduce(cf_comm *c, const void *send, void *recv, size_t count, cf_comm_dtype dtype, cf_comm_op op,
                       void *stream);

/* recv = root's send on every rank (send is read on root only; in place when equal). */
int cf_comm_broadcast(cf_comm *c, const void *send, void *recv, size_t count, cf_comm_dtype dtype, int root,
                      void *stream);

/* Several collectives as one NCCL group (e.g. one reduce-scatter per bucket).
 * Calls between begin and end only enqueue; end waits for the group to be
 * launched (not for it to finish: use cf_comm_wait). */
int cf_comm_group_begin(cf_comm *c);
int cf_comm_group_end(cf_comm *c);

/* Waits until all work on `stream` has finished, polling cudaStreamQuery and
 * ncclCommGetAsyncError; after timeout_s (<= 0: the communicator's timeout)
 * or on an NCCL error, aborts the communicator and fails with e.g.
 * "rank 1 of 2: all_reduce of 1 f32 (sum) did not finish within 600 s: a peer
 * rank died or hangs; NCCL communicator aborted". */
int cf_comm_wait(cf_comm *c, void *stream, double timeout_s);

/* Without blocking: fails (and aborts) if NCCL reported an asynchronous error. */
int cf_comm_check(cf_comm *c);

/* A sub-communicator (ncclCommSplit): ranks with the same color form one,
 * ordered by key; color < 0 (NCCL_SPLIT_NOCOLOR) takes part but gets *out = NULL.
 * Collective over all ranks of c. */
int cf_comm_split(cf_comm *c, int color, int key, cf_comm **out, double timeout_s);

/* Finalizes (waiting at most the communicator's timeout) and destroys; aborts
 * instead when it was aborted, failed or does not finish in time. NULL is fine. */
void cf_comm_destroy(cf_comm *c);
/* Aborts at once (e.g. on SIGTERM or a local error): peers then fail fast. */
void cf_comm_abort(cf_comm *c);

#ifdef __cplusplus
}
#endif

#endif /* CF_DIST_COMM_H */
