/*
 * attention/launch.cu — the host side of attention: shape checks, head-dim
 * padding (head dims without a kernel run zero-padded to the next one), the
 * per-device shared-memory limits of the kernels, and the launch sequence of
 * the forward and of each backward mode (the table in common.cuh), all on the
 * context's compute stream.
 *
 * Grids over a filtered list are sized by kept->max_len (an upper bound of
 * the kept rows of any one sequence, known on the host without reading the
 * device); every kernel returns at once for a tile past its sequence's count.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/attention/common.cuh"

/* Head-dim padding for sizes without a kernel: dst[r, :Dp] = (src[r, :D], 0...). */
static __global__ void pad_rows_kernel(bf16 *dst, const bf16 *src, size_t rows, int D, int Dp) {
    const size_t n = rows * Dp;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / Dp;
        int d = (int)(i % Dp);
        dst[i] = d < D ? src[r * D + d] : __float2bfloat16_rn(0.f);
    }
}
static __global__ void unpad_rows_kernel(bf16 *dst, const bf16 *src, size_t rows, int D, int Dp) {
    const size_t n = rows * D;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = src[(i / D) * Dp + i % D];
}

/* ================================================================== host */

enum { K_FWD, K_BWD, K_BWD_DQ, K_COUNT };
static const char *const kernel_names[K_COUNT] = {"forward", "backward", "centrifuge dq"};

/* head dims with kernels; others (up to 128) run zero-padded to the next one,
 * which leaves scores and outputs unchanged */
static int kernel_dim(int D) {
    return D <= 16 ? 16 : D <= 32 ? 32 : D <= 64 ? 64 : D <= 96 ? 96 : D <= 128 ? 128 : 0;
}
static int dim_index(int D) { return D == 16 ? 0 : D == 32 ? 1 : D == 64 ? 2 : D == 96 ? 3 : 4; }

/* Raises the kernel's dynamic shared-memory limit (an attribute of the
 * device the call runs on) once per context: a flag per context, not per
 * process, so a second context on another GPU sets it there too. */
static bool prepare_kernel(cf_cuda_ctx *ctx, int which, int D, const AttnKernel &k) {
    if (!k.fn) {
        cf_cuda_ctx_fail(ctx, "attention (cuda): no %s kernel for head_dim %d", kernel_names[which], D);
        return false;
    }
    const unsigned bit = 1u << (which * 5 + dim_index(D));
    if (ctx->attn_attr_done & bit) return true;
    if (k.smem > ctx->smem_optin) {
        cf_cuda_ctx_fail(ctx,
                         "attention (cuda): the %s kernel for head_dim %d needs %zu bytes of shared memory per "
                         "block; GPU %d (%s) allows %zu",
                         kernel_names[which], D, k.smem, ctx->device, ctx->device_name, ctx->smem_optin);
        return false;
    }
    if (!CF_CK(ctx, cudaFuncSetAttribute(k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)k.smem)))
        return false;
    ctx->attn_attr_done |= bit;
    return true;
}

/* grid (H, ntiles, B) of kernel `which` */
static bool launch(cf_cuda_ctx *ctx, int which, const AttnArgs &a, int D, int ntiles) {
    if (ntiles <= 0) return true;
    const AttnKernel k = which == K_FWD   ? attn_fwd_kernel_for(D)
                         : which == K_BWD ? attn_bwd_kernel_for(D)
                                          : attn_bwd_dq_kernel_for(D);
    if (!prepare_kernel(ctx, which, D, k)) return false;
    dim3 grid(a.H, ntiles, a.B), block(NTHREADS);
    void *args[] = {(void *)&a};
    return CF_CK(ctx, cudaLaunchKernel(k.fn, grid, block, args, k.smem, ctx->stream));
}

static bf16 *pad(cf_cuda_ctx *ctx, cf_cuda_scratch_id id, const void *src, size_t rows, int D, int Dp) {
    bf16 *dst = (bf16 *)cf_cuda_scratch(ctx, id, rows * Dp * sizeof(bf16));
    if (!dst) return NULL;
    pad_rows_kernel<<<attn_grid_for(rows * Dp), 256, 0, ctx->stream>>>(dst, (const bf16 *)src, rows, D, Dp);
    return CF_CK_LAUNCH(ctx, "attention pad") ? dst : NULL;
}
static bool unpad(cf_cuda_ctx *ctx, void *dst, const bf16 *src, size_t rows, int D, int Dp) {
    unpad_rows_kernel<<<attn_grid_for(rows * D), 256, 0, ctx->stream>>>((bf16 *)dst, src, rows, D, Dp);
    return CF_CK_LAUNCH(ctx, "attention unpad");
}

static bool check_shape(cf_cuda_ctx *ctx, const cf_attn_shape *s) {
    if (s->B <= 0 || s->S <= 0 || s->H <= 0 || s->Hkv <= 0 || s->H % s->Hkv != 0 || s->D <= 0 ||
        kernel_dim(s->D) == 0) {
        cf_cuda_ctx_fail(ctx, "attention (cuda): bad shape B=%d S=%d H=%d Hkv=%d D=%d (head_dim at most 128)", s->B,
                         s->S, s->H, s->Hkv, s->D);
        return false;
    }
    return true;
}

static AttnArgs base_args(const cf_attn_shape *s) {
    AttnArgs a;
    memset(&a, 0, sizeof a);
    a.B = s->B;
    a.S = s->S;
    a.H = s->H;
    a.Hkv = s->Hkv;
    a.doc = s->doc;
    a.scale = s->scale;
    a.scale_log2 = s->scale * LOG2E_F;
    return a;
}

/* ================================================================ forward */

static void attn_fwd(cf_cuda_ctx *ctx, void *out, float *lse, const void *q, const void *k, const void *v,
                     const cf_attn_shape *s) {
    if (!check_shape(ctx, s)) return;
    const int Dp = kernel_dim(s->D);
    if (Dp != s->D) {
        const size_t T = (size_t)s->B * s->S;
        cf_attn_shape sp = *s;
        sp.D = Dp;
        bf16 *qp = pad(ctx, CF_SCR_ATTN_PAD_Q, q, T * s->H, s->D, Dp);
        bf16 *kp = qp ? pad(ctx, CF_SCR_ATTN_PAD_K, k, T * s->Hkv, s->D, Dp) : NULL;
        bf16 *vp = kp ? pad(ctx, CF_SCR_ATTN_PAD_V, v, T * s->Hkv, s->D, Dp) : NULL;
        bf16 *op = vp ? (bf16 *)cf_cuda_scratch(ctx, CF_SCR_ATTN_PAD_O, T * s->H * Dp * sizeof(bf16)) : NULL;
        if (!op) return;
        attn_fwd(ctx, op, lse, qp, kp, vp, &sp);
        if (!ctx->failed) unpad(ctx, out, op, T * s->H, s->D, Dp);
        return;
    }
    AttnArgs a = base_args(s);
    a.q = (const bf16 *)q;
    a.k = (const bf16 *)k;
    a.v = (const bf16 *)v;
    a.out = (bf16 *)out;
    a.lse_out = lse;
    if (attn_sm90_enabled(ctx)) {
        const int r = attn_fwd_sm90(ctx, a, s->D);
        if (r != 0) return; /* launched, or failed (recorded) */
    }
    if (ctx->failed) return;
    launch(ctx, K_FWD, a, s->D, (s->S + TILE - 1) / TILE);
}

void cf_cuda_attention_fwd(cf_backend *b, void *out, float *lse, const void *q, const void *k, const void *v,
                           const cf_attn_shape *s) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx) return;
    attn_fwd(ctx, out, lse, q, k, v, s);
}

/* =============================================================== backward */

/* How centrifuge's Hopper parts run (CF_ATTN_CF_SIDE_BY_SIDE in the
 * environment, read once; for timing):
 *   2 (default): chained on the one stream: part 2 the programmatic
 *     dependent of part 1 (it may start once every block of part 1 has
 *     started, and its blocks end only after part 1), the finish part 2's;
 *   1: part 2 on the second stream, forked after the prep and joined
 *     before the finish (runs 17-35);
 *   0: part 2 after part 1 on the one stream, plain launches.
 * In 2 and 1 part 2 fills the SMs part 1's last blocks leave (the beside
 * plan, sm90.cuh). Run 36's timeline: on the second stream part 2's first
 * block started only when part 1's last blocks had been handed out anyway;
 * the chain keeps that overlap without the fork and the join: the
 * centrifuge backward 1-5% faster at every shape timed (H200: S = 4096,
 * D = 64 0.193 -> 0.188 ms; D = 128 0.307 -> 0.304; Llama3.2-3B's 0.087
 * -> 0.085; docs/BENCHMARKS.md run 36). CF_ATTN_PDL=0 (bwd_sm90.cu) makes
 * the main kernel's and the finish's launches plain, not part 2's. */
enum { CF_PARTS_AFTER = 0, CF_PARTS_BESIDE = 1, CF_PARTS_CHAINED = 2 };
static int parts_mode(const cf_cuda_ctx *ctx) {
    static int mode = -1;
    if (ctx->attn_cf_parts >= 1 && ctx->attn_cf_parts <= 3) return ctx->attn_cf_parts - 1; /* tests */
    if (mode < 0) {
        const char *e = getenv("CF_ATTN_CF_SIDE_BY_SIDE");
        mode = e && *e == '0' ? CF_PARTS_AFTER : e && *e == '1' ? CF_PARTS_BESIDE : CF_PARTS_CHAINED;
    }
    return mode;
}

static void attn_bwd(cf_cuda_ctx *ctx, void *dq, void *dk, void *dv, const void *dout, const void *q, const void *k,
                     const void *v, const void *out, const float *lse, const cf_attn_shape *s, const cf_rows *kept,
                     cf_attn_bwd_mode mode) {
    if (!check_shape(ctx, s)) return;
    const int D = s->D, H = s->H, Hkv = s->Hkv, B = s->B, S = s->S, T = B * S;
    const bool full = mode == CF_ATTN_BWD_FULL, kv = mode == CF_ATTN_BWD_CENTRIFUGE_KV;
    if (mode != CF_ATTN_BWD_FULL && mode != CF_ATTN_BWD_CENTRIFUGE && mode != CF_ATTN_BWD_STRAWMAN && !kv) {
        cf_cuda_ctx_fail(ctx, "attention_bwd (cuda): unknown mode %d", (int)mode);
        return;
    }
    if (!full) {
        if (!kept || kept->n < 0 || kept->n > T || (kept->n > 0 && (!kept->rows || !kept->seq_start))) {
            cf_cuda_ctx_fail(ctx, "attention_bwd (cuda): mode %d needs the kept rows (n in [0, %d])", (int)mode, T);
            return;
        }
        if (kept->n > 0 && (kept->max_len < 1 || kept->max_len > S)) {
            cf_cuda_ctx_fail(ctx, "attention_bwd (cuda): kept->max_len %d outside [1, S=%d]", kept->max_len, S);
            return;
        }
    }
    const int n = full ? T : kept->n; /* rows on the q side and on the k side of part 1 */
    const int nk = kv ? T : n;        /* rows of dk, dv (centrifuge-kv: every row) */
    if (n <= 0) {
        if (kv) {
            /* no query: every key's gradient is zero */
            CF_CK(ctx, cudaMemsetAsync(dk, 0, (size_t)T * Hkv * D * sizeof(bf16), ctx->stream));
            CF_CK(ctx, cudaMemsetAsync(dv, 0, (size_t)T * Hkv * D * sizeof(bf16), ctx->stream));
        }
        return;
    }
    const int Dp = kernel_dim(D);
    if (Dp != D) {
        cf_attn_shape sp = *s;
        sp.D = Dp;
        bf16 *qp = pad(ctx, CF_SCR_ATTN_PAD_Q, q, (size_t)n * H, D, Dp);
        bf16 *op = qp ? pad(ctx, CF_SCR_ATTN_PAD_O, out, (size_t)n * H, D, Dp) : NULL;
        bf16 *dop = op ? pad(ctx, CF_SCR_ATTN_PAD_DO, dout, (size_t)n * H, D, Dp) : NULL;
        bf16 *kp = dop ? pad(ctx, CF_SCR_ATTN_PAD_K, k, (size_t)T * Hkv, D, Dp) : NULL;
        bf16 *vp = kp ? pad(ctx, CF_SCR_ATTN_PAD_V, v, (size_t)T * Hkv, D, Dp) : NULL;
        bf16 *dqp = (bf16 *)cf_cuda_scratch(ctx, CF_SCR_ATTN_PAD_DQ, (size_t)n * H * Dp * sizeof(bf16));
        bf16 *dkp = (bf16 *)cf_cuda_scratch(ctx, CF_SCR_ATTN_PAD_DK, (size_t)nk * Hkv * Dp * sizeof(bf16));
        bf16 *dvp = (bf16 *)cf_cuda_scratch(ctx, CF_SCR_ATTN_PAD_DV, (size_t)nk * Hkv * Dp * sizeof(bf16));
        if (!vp || !dqp || !dkp || !dvp) return;
        attn_bwd(ctx, dqp, dkp, dvp, dop, qp, kp, vp, op, lse, &sp, kept, mode);
        if (!ctx->failed && unpad(ctx, dq, dqp, (size_t)n * H, D, Dp) && unpad(ctx, dk, dkp, (size_t)nk * Hkv, D, Dp))
            unpad(ctx, dv, dvp, (size_t)nk * Hkv, D, Dp);
        return;
    }
    /* rows of one sequence on the q side, and on the k side of the main kernel */
    const int maxlen = full ? S : kept->max_len;
    const int kmaxlen = full || kv ? S : kept->max_len;

    AttnArgs a = base_args(s);
    a.q = (const bf16 *)q;
    a.k = (const bf16 *)k;
    a.v = (const bf16 *)v;
    a.dout = (const bf16 *)dout;
    a.lse = lse;
    a.o = (const bf16 *)out;
    if (!full) {
        a.qstart = a.kstart = kept->seq_start;
        a.qrow = a.krow = kept->rows;
    }
    if (kv) {
        /* the main kernel over kept queries and ALL keys: dk, dv of every
         * key from the kept queries, dq over all keys by atomics */
        a.kstart = NULL;
        a.krow = NULL;
    }

    if (mode == CF_ATTN_BWD_STRAWMAN) {
        /* forward on the kept sequence: lse and out renormalised over kept keys */
        bf16 *o_kept = (bf16 *)cf_cuda_scratch(ctx, CF_SCR_ATTN_O_KEPT, (size_t)n * H * D * sizeof(bf16));
        float *lse_kept = (float *)cf_cuda_scratch(ctx, CF_SCR_ATTN_LSE_KEPT, (size_t)n * H * sizeof(float));
        if (!o_kept || !lse_kept) return;
        AttnArgs f = a;
        f.out = o_kept;
        f.lse_out = lse_kept;
        if (!launch(ctx, K_FWD, f, D, (maxlen + TILE - 1) / TILE)) return;
        a.o = o_kept;
        a.lse = lse_kept;
    }

    float *dq_acc = (float *)cf_cuda_scratch(ctx, CF_SCR_ATTN_DQ_ACC, (size_t)n * H * D * sizeof(float));
    float *Dvec = (float *)cf_cuda_scratch(ctx, CF_SCR_ATTN_DVEC, (size_t)n * H * sizeof(float));
    if (!dq_acc || !Dvec) return;
    a.dq_acc = dq_acc;
    a.Dvec = Dvec;
    /* the Hopper kernels have a dq accumulator of their own (bwd_sm90.cu) */
    /* the Hopper backward reads K and V rows by 16-byte copies (the main
     * kernel's cp.async gather, the centrifuge prep's compaction) */
    const bool try_hopper = (D == 64 || D == 128) && cf_aligned16(k) && cf_aligned16(v) && attn_sm90_enabled(ctx);
    if (ctx->failed) return;
    /* the Hopper kernel's dq accumulator (its own layout, bwd_sm90.cu):
     * tps 64-row query tiles per sequence, even (a step may cover two) */
    const int tps = try_hopper ? 2 * ((maxlen + 127) / 128) : 0;
    const size_t acc_n = (size_t)B * tps * 64 * H * D;
    float *acc = try_hopper ? (float *)cf_cuda_scratch(ctx, CF_SCR_ATTN_SM90_DQ, acc_n * sizeof(float)) : NULL;
    if (try_hopper && !acc) return;
    /* GQA: fp32 partials of dk, dv per group of hpb query heads (1 on the
     * portable path) and part of the query range (ns, Hopper), summed by
     * the GQA reduction; partials also without GQA when ns > 1. None where
     * one block holds a kv head's whole group and range (hpb = H / Hkv,
     * ns = 1): it writes dk, dv itself */
    const int parts = parts_mode(ctx);
    const bool cf_beside = mode == CF_ATTN_BWD_CENTRIFUGE && T > n && parts != CF_PARTS_AFTER; /* part 2 fills part 1's tail */
    const int flen = cf_beside ? (T - n + B - 1) / B : 0; /* its filtered keys per sequence, the mean */
    int hpb = 1, ns = 1, pair = CF_PAIR_NONE;
    if (try_hopper) {
        attn_sm90_bwd_plan(ctx, D, H, Hkv, B, maxlen, kmaxlen, flen, &hpb, &ns);
        pair = attn_sm90_bwd_pair(ctx, D, H, Hkv, hpb, ns); /* two partials: summed by pairs of blocks */
        if (ctx->failed) return;
    }
    /* [nk, H/hpb, ns, D], or [nk, H, D] for a fallback: the larger */
    auto alloc_partials = [&]() {
        const size_t per_row = (size_t)H / hpb * ns > (size_t)H ? (size_t)H / hpb * ns : (size_t)H;
        const size_t np = (size_t)nk * per_row * D;
        a.dkx = (float *)cf_cuda_scratch(ctx, CF_SCR_ATTN_DKX, np * sizeof(float));
        a.dvx = (float *)cf_cuda_scratch(ctx, CF_SCR_ATTN_DVX, np * sizeof(float));
        return a.dkx && a.dvx;
    };
    bool partials = (H / hpb != Hkv || ns > 1) && !pair;
    if (partials) {
        if (!alloc_partials()) return;
    } else {
        a.dk = (bf16 *)dk;
        a.dv = (bf16 *)dv;
    }
    /* D_i, the accumulator the backward adds dq to set to zero, and for
     * centrifuge the filtered rows (part 2's k side). On Hopper centrifuge
     * does all that in one launch, with the filtered rows' K and V
     * gathered for part 2: the two parts are then independent and run side
     * by side */
    const bool cf = mode == CF_ATTN_BWD_CENTRIFUGE;
    const int nf = T - n;
    int *filt = NULL, *fstart = NULL;
    AttnArgs p2 = a; /* part 2's arguments (Hopper): set by attn_cf_sm90_prep */
    int prepared = 0;
    if (cf) {
        filt = (int *)cf_cuda_scratch(ctx, CF_SCR_ATTN_FILT, (size_t)(nf > 0 ? nf : 1) * sizeof(int));
        fstart = (int *)cf_cuda_scratch(ctx, CF_SCR_ATTN_FSTART, (size_t)(B + 1) * sizeof(int));
        if (!filt || !fstart) return;
        if (try_hopper && (prepared = attn_cf_sm90_prep(ctx, a, D, kept, acc, acc_n, filt, fstart, &p2)) < 0) return;
    }
    if (!prepared) {
        attn_bwd_prep(ctx->stream, a.dout, a.o, Dvec, try_hopper ? acc : dq_acc, try_hopper ? acc_n : (size_t)n * H * D,
                      n * H, D);
        if (!CF_CK_LAUNCH(ctx, "attention bwd prep")) return;
        if (cf) {
            attn_filtered_rows(ctx->stream, filt, fstart, kept->rows, kept->seq_start, n, B, S);
            if (!CF_CK_LAUNCH(ctx, "attention filtered rows")) return;
        }
    }
    if (prepared && parts == CF_PARTS_BESIDE && !CF_CK(ctx, cudaEventRecord(ctx->ev_fork, ctx->stream))) return;
    /* part 1 / the whole backward: dk, dv, and dq over the k side; on
     * Hopper into a dq accumulator of its own layout (bwd_sm90.cu) */
    int hopper = 0;
    if (try_hopper) {
        AttnArgs h = a;
        h.dq_acc = acc;
        hopper = attn_bwd_sm90(ctx, h, D, n, kmaxlen, tps, hpb, ns, pair);
        if (hopper < 0) return;
        a.dq_acc = acc;
    }
    if (ctx->failed) return;
    if (!hopper) {
        if (try_hopper) { /* the Hopper kernel declined (tensor maps): the portable one */
            hpb = ns = 1;
            if (!partials && H != Hkv) { /* the portable kernel writes per-head partials */
                pair = CF_PAIR_NONE;
                partials = true;
                a.dk = a.dv = NULL;
                if (!alloc_partials()) return;
            }
            if (!CF_CK(ctx, cudaMemsetAsync(dq_acc, 0, (size_t)n * H * D * sizeof(float), ctx->stream))) return;
        }
        a.dq_acc = dq_acc;
        if (!launch(ctx, K_BWD, a, D, (kmaxlen + TILE - 1) / TILE)) return;
    }
    const GqaReduce red = {(bf16 *)dk, (bf16 *)dv, a.dkx, a.dvx, (size_t)nk, Hkv, H / Hkv / hpb * ns};

    /* part 2 (centrifuge): dq over the filtered keys. Hopper: into the
     * same accumulator, converted once both parts are done; chained after
     * part 1 (parts_mode), or beside it on the second stream, or after it;
     * else the portable kernel after part 1 (it adds dq_acc [n, H, D] fp32
     * and writes bf16) */
    int r = 0;
    const bool chained = cf && hopper && prepared && parts == CF_PARTS_CHAINED;
    if (cf && hopper && prepared) {
        const bool side = parts == CF_PARTS_BESIDE;
        cudaStream_t st = side ? ctx->aux_stream : ctx->stream;
        if (side && !CF_CK(ctx, cudaStreamWaitEvent(st, ctx->ev_fork, 0))) return;
        r = attn_bwd_dq_sm90(ctx, p2, D, n, nf, maxlen, tps, st, chained);
        if (side && (!CF_CK(ctx, cudaEventRecord(ctx->ev_join, st)) ||
                     !CF_CK(ctx, cudaStreamWaitEvent(ctx->stream, ctx->ev_join, 0))))
            return;
        if (r < 0) return;
    }
    if (hopper) {
        /* the last launch: dq (bf16; fp32 for a portable part 2 to add to)
         * and the GQA reduction in one grid */
        const bool dq_final = !cf || r;
        attn_sm90_bwd_finish(ctx->stream, dq_final ? (bf16 *)dq : NULL, dq_final ? NULL : dq_acc, a.dq_acc, a.qstart,
                             B, S, H, D, tps, partials ? &red : NULL, !cf || chained);
        if (!CF_CK_LAUNCH(ctx, "attention sm90 backward finish")) return;
    } else if (!cf) {
        attn_dq_to_bf16(ctx->stream, (bf16 *)dq, dq_acc, (size_t)n * H * D);
        if (!CF_CK_LAUNCH(ctx, "attention dq to bf16")) return;
    }
    if (cf && !r) {
        AttnArgs p = a;
        p.kstart = fstart;
        p.krow = filt;
        p.dq = (bf16 *)dq;
        p.dq_acc = dq_acc;
        if (!launch(ctx, K_BWD_DQ, p, D, (maxlen + TILE - 1) / TILE)) return;
    }
    if (partials && !hopper) {
        attn_gqa_reduce(ctx->stream, (bf16 *)dk, (bf16 *)dv, a.dkx, a.dvx, (size_t)nk, Hkv, H / Hkv / hpb * ns, D);
        CF_CK_LAUNCH(ctx, "attention GQA reduce");
    }
}

#if CF_ATTN_TRACE
/* The timing build's per-block timeline (trace.cuh): one buffer for the
 * process, bound to the traced units at the first backward; emptied before
 * each backward, appended to CF_ATTN_TRACE_FILE after every
 * CF_ATTN_TRACE_EVERY-th one (default 1). */
static AttnTraceBuf *trace_buf;
static long trace_calls;
static const unsigned TRACE_CAP = 1u << 16;

static void trace_begin(cf_cuda_ctx *ctx) {
    const char *f = getenv("CF_ATTN_TRACE_FILE");
    if (!f || !*f) return;
    if (!trace_buf) {
        const size_t bytes = sizeof(AttnTraceBuf) + (size_t)TRACE_CAP * sizeof(AttnTraceRec);
        if (!CF_CK(ctx, cudaMalloc((void **)&trace_buf, bytes))) return;
        const unsigned hdr[2] = {0, TRACE_CAP};
        if (!CF_CK(ctx, cudaMemcpy(trace_buf, hdr, sizeof hdr, cudaMemcpyHostToDevice))) return;
        attn_trace_bind_bwd(trace_buf);
        attn_trace_bind_sm90(trace_buf);
        attn_trace_bind_cf_sm90(trace_buf);
    }
    CF_CK(ctx, cudaMemsetAsync(trace_buf, 0, sizeof(unsigned), ctx->stream));
}

static void trace_end(cf_cuda_ctx *ctx, const cf_attn_shape *s, const cf_rows *kept, cf_attn_bwd_mode mode) {
    static const char *const names[] = {"full", "centrifuge", "strawman", "centrifuge-kv"};
    const char *f = getenv("CF_ATTN_TRACE_FILE");
    const long every = attn_env_int("CF_ATTN_TRACE_EVERY", 1), call = trace_calls++;
    if (!trace_buf || !f || !*f || ctx->failed || (every > 1 && call % every != every - 1)) return;
    unsigned n = 0;
    if (!CF_CK(ctx, cudaStreamSynchronize(ctx->stream)) ||
        !CF_CK(ctx, cudaMemcpy(&n, trace_buf, sizeof n, cudaMemcpyDeviceToHost)))
        return;
    const unsigned kept_n = n < TRACE_CAP ? n : TRACE_CAP;
    AttnTraceRec *r = (AttnTraceRec *)cf_malloc((size_t)(kept_n ? kept_n : 1) * sizeof *r);
    if (!r || !CF_CK(ctx, cudaMemcpy(r, trace_buf->rec, (size_t)kept_n * sizeof *r, cudaMemcpyDeviceToHost))) {
        if (!r) cf_cuda_ctx_fail(ctx, "attention trace: %s", cf_last_error());
        free(r);
        return;
    }
    /* the project's one way to write an output (base/common.h), appending */
    FILE *out = cf_output_stream(f, 1);
    if (out) {
        fprintf(out, "# call %ld mode %s B %d S %d H %d Hkv %d D %d kept %d sms %d records %u lost %u\n", call,
                (unsigned)mode < 4 ? names[mode] : "?", s->B, s->S, s->H, s->Hkv, s->D,
                mode == CF_ATTN_BWD_FULL || !kept ? s->B * s->S : kept->n, ctx->sm_count, kept_n, n - kept_n);
        for (unsigned i = 0; i < kept_n; i++)
            fprintf(out, "%u %u %u %u %llu %llu %llu %llu %llu %llu\n", r[i].kernel, r[i].block, r[i].smid, r[i].steps,
                    (unsigned long long)r[i].g0, (unsigned long long)r[i].g1, (unsigned long long)r[i].c0,
                    (unsigned long long)r[i].c1, (unsigned long long)r[i].c2, (unsigned long long)r[i].c3);
    }
    if (!out || cf_stream_close(out, f) != 0) /* the close checks the writes, and closes either way */
        cf_cuda_ctx_fail(ctx, "attention trace: %s", cf_last_error());
    free(r);
}
#else
static void trace_begin(cf_cuda_ctx *) {}
static void trace_end(cf_cuda_ctx *, const cf_attn_shape *, const cf_rows *, cf_attn_bwd_mode) {}
#endif

void cf_cuda_attention_bwd(cf_backend *b, void *dq, void *dk, void *dv, const void *dout, const void *q,
                           const void *k, const void *v, const void *out, const float *lse, const cf_attn_shape *s,
                           const cf_rows *kept, cf_attn_bwd_mode mode) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx) return;
    trace_begin(ctx);
    attn_bwd(ctx, dq, dk, dv, dout, q, k, v, out, lse, s, kept, mode);
    trace_end(ctx, s, kept, mode);
}

/* The full backward's main grid at shape s against the SMs: the Hopper
 * plan's blocks (H/hpb x key tiles x parts x B, the plan the backward
 * itself will take and keep), or the portable kernel's (H x 64-key tiles x
 * B), under 1.5 waves. On 132 SMs TinyLlama @4096 and Llama3.2-3B @2048
 * plan 256 blocks (1.94 waves: side GEMMs only contended, run 26) and
 * Qwen2.5-1.5B @2048 192 (1.45: they gained). */
int cf_cuda_attention_bwd_leaves_idle(cf_backend *b, const cf_attn_shape *s) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || s->B <= 0 || s->S <= 0 || s->H <= 0 || s->Hkv <= 0 || s->H % s->Hkv) return 0;
    const int D = kernel_dim(s->D);
    long long blocks = (long long)s->H * ((s->S + TILE - 1) / TILE) * s->B;
    if ((D == 64 || D == 128) && attn_sm90_enabled(ctx)) {
        int hpb = 1, ns = 1;
        attn_sm90_bwd_plan(ctx, D, s->H, s->Hkv, s->B, s->S, s->S, 0, &hpb, &ns);
        const dim3 g = attn_sm90_bwd_grid(s->H, hpb, ns, s->B, s->S);
        blocks = (long long)g.x * g.y * g.z;
    }
    return !ctx->failed && 2 * blocks < 3LL * ctx->sm_count;
}
