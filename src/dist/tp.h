/*
 * tp.h — the collectives of tensor parallelism over NCCL: the cf_tp_sync
 * hooks the engine calls (engine/model_internal.h) for one TP group, with
 * traffic counters (bytes and calls per phase, time on the communication
 * stream from CUDA events). Which rank holds what is tp_plan.h's; the
 * launch, the communicators and checkpoints are zero.c's (cf_dist).
 */
#ifndef CF_DIST_TP_H
#define CF_DIST_TP_H

#include "dist/comm.h"
#include "engine/model_internal.h"

typedef struct cf_tp_group cf_tp_group;

/* A group over comm (not owned); timeout_s bounds the host's wait in the
 * optimizer step. NULL + cf_fail on failure. */
cf_tp_group *cf_tp_group_create(cf_comm *comm, double timeout_s);
void cf_tp_group_free(cf_tp_group *g);
/* The hooks for cf_model_open_tp; bind the opened model before its first
 * forward (the hooks reach the streams through its backend). */
cf_tp_sync cf_tp_group_sync(cf_tp_group *g);
void cf_tp_group_bind(cf_tp_group *g, cf_model *m);
/* Counters since the last call (waits for the timed collectives). */
int cf_tp_group_traffic(cf_tp_group *g, cf_tp_traffic *out);

#endif
