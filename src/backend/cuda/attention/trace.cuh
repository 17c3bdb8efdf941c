/*
 * attention/trace.cuh — a per-block timeline of the attention backward's
 * kernels, for a timing build only:
 *
 *   make BUILD=build/trace CUDA_DEFS=-DCF_ATTN_TRACE=1 build/trace/cuda/tests/bench_attention
 *   CF_ATTN_TRACE_FILE=t.txt build/trace/cuda/tests/bench_attention ...
 *   python3 tools/attn_timeline.py t.txt
 *
 * Without CF_ATTN_TRACE (every other build) trace_mark and trace_finish
 * are empty and compile to nothing.
 *
 * With it, one thread of each block of the traced kernels (the prep, the
 * main kernel, centrifuge part 2, the finish) writes a record: the SM, the
 * global timer (ns) at entry and exit, and the SM's cycle counter at four
 * marks: entry, the first step's operands in shared memory (the end of the
 * prologue), the end of the step loop, exit. Cycle counts are exact within
 * a block; the global timer orders blocks across SMs. launch.cu empties
 * the buffer before each backward and appends its records to
 * CF_ATTN_TRACE_FILE after it (it synchronises: the build's own timings
 * mean nothing). The file format is tools/attn_timeline.py's docstring.
 *
 * The buffer's address is a __device__ variable, one per compilation unit
 * (no relocatable device code), so each unit with traced kernels defines a
 * binder (ATTN_TRACE_BINDER) that launch.cu calls once.
 */
#pragma once

#include <stdint.h>

enum AttnTraceKernel { TRACE_PREP = 1, TRACE_MAIN = 2, TRACE_PART2 = 3, TRACE_FINISH = 4 };

#if CF_ATTN_TRACE
struct AttnTraceRec {
    uint32_t kernel, block, smid, steps;
    uint64_t g0, g1;         /* global timer, ns: entry, exit */
    uint64_t c0, c1, c2, c3; /* cycles: entry, operands of the first step in, loop done, exit */
};
struct AttnTraceBuf {
    unsigned n, cap, pad[14];
    AttnTraceRec rec[1]; /* cap of them */
};
static __device__ AttnTraceBuf *attn_trace_buf;

#define ATTN_TRACE_BINDER(name)                                                                                        \
    void name(void *buf) { cudaMemcpyToSymbol(attn_trace_buf, &buf, sizeof buf); }

/* the binders (each in its unit) and launch.cu's calls around a backward */
void attn_trace_bind_bwd(void *buf);     /* bwd.cu: the prep of every mode but Hopper centrifuge */
void attn_trace_bind_sm90(void *buf);    /* bwd_sm90.cu: main kernel, finish */
void attn_trace_bind_cf_sm90(void *buf); /* bwd_centrifuge_sm90.cu: prep, part 2 */

__device__ __forceinline__ uint64_t trace_globaltimer() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ uint32_t trace_smid() {
    uint32_t s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    return s;
}

/* The marks live in shared memory, not in registers (the consumers of the
 * main kernel have none to spare). One thread of a block makes all of
 * them, in order: 0 at entry, 1 and 2 if the kernel has a step loop, then
 * trace_finish. */
__device__ __forceinline__ uint64_t *trace_marks() {
    __shared__ uint64_t m[4]; /* global timer at entry; cycles at marks 0, 1, 2 */
    return m;
}
/* mark i, and the later ones until they are made (a kernel without a
 * step loop makes 0 and maybe 1: its loop then takes no time) */
__device__ __forceinline__ void trace_mark(int i) {
    uint64_t *m = trace_marks();
    const uint64_t c = clock64();
    if (i == 0) m[0] = trace_globaltimer();
    for (int j = i; j < 3; j++) m[1 + j] = c;
}
__device__ __forceinline__ void trace_finish(int kernel, int steps) {
    AttnTraceBuf *b = attn_trace_buf;
    if (!b) return;
    const uint64_t *m = trace_marks();
    const uint64_t c3 = clock64(), g1 = trace_globaltimer();
    const unsigned i = atomicAdd(&b->n, 1u);
    if (i >= b->cap) return;
    AttnTraceRec r;
    r.kernel = kernel;
    r.block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    r.smid = trace_smid();
    r.steps = steps;
    r.g0 = m[0];
    r.g1 = g1;
    r.c0 = m[1];
    r.c1 = m[2];
    r.c2 = m[3];
    r.c3 = c3;
    b->rec[i] = r;
}
#else
#define ATTN_TRACE_BINDER(name)
__device__ __forceinline__ void trace_mark(int) {}
__device__ __forceinline__ void trace_finish(int, int) {}
#endif
