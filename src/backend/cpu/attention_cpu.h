/*
 * attention_cpu.h — fp32 causal GQA attention for the CPU backend
 * (memory-efficient: no S x S matrix, only O(S) scratch per task).
 * Semantics are those of attention_fwd / attention_bwd in backend.h.
 */
#ifndef CF_ATTENTION_CPU_H
#define CF_ATTENTION_CPU_H

#include "backend/backend.h"

/* Both return 0, or -1 with cf_fail (bad shape or kept rows, no memory). */

/* q[T,H,D], k,v[T,Hkv,D] -> out[T,H,D], lse[T,H]. */
int cf_cpu_attention_fwd(float *out, float *lse, const float *q, const float *k, const float *v,
                         const cf_attn_shape *s);

/* FULL: every array has T rows. CENTRIFUGE / STRAWMAN: q, out, dout, lse,
 * dq, dk, dv have kept->n rows (compacted); k, v have T rows. dq, dk, dv
 * are overwritten. Deterministic for any thread count. */
int cf_cpu_attention_bwd(float *dq, float *dk, float *dv, const float *dout, const float *q,
                         const float *k, const float *v, const float *out, const float *lse,
                         const cf_attn_shape *s, const cf_rows *kept, cf_attn_bwd_mode mode);

#endif /* CF_ATTENTION_CPU_H */
