/*
 * zero.h — the ZeRO-1 optimizer layout of one data-parallel rank, built
 * from the model's parameter table and the shard plan (plan.h). zero.c's
 * data-parallel hooks use it; so do the CPU tests that run the DP
 * collectives with threads (tests/tp_threads.h).
 */
#ifndef CF_DIST_ZERO_H
#define CF_DIST_ZERO_H

#include "dist/plan.h"
#include "engine/model_internal.h"

#define CF_ZERO_ALIGN 8   /* elements: 16-byte bf16 and 32-byte fp32 slices */

/* Builds *plan over the trainable tensors of m (bucket key = layer) for
 * `world` ranks and fills *lay with rank's segments; *tensor_of (malloc'ed,
 * the caller frees) maps plan tensor -> model tensor index. */
int cf_zero_layout_build(const cf_model *m, int world, int rank, cf_zero_plan *plan, int **tensor_of,
                         cf_optim_layout *lay);

#endif
