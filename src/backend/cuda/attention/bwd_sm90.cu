/*
 * attention/bwd_sm90.cu — the Hopper backward (sm_90a): the main kernel of
 * bwd.cu (dk, dv of a key tile, dq by fp32 reductions; FULL, STRAWMAN,
 * CENTRIFUGE part 1 and CENTRIFUGE_KV, index spaces as in common.cuh) with
 * warpgroup matrix products, plus the conversion of its dq accumulator.
 * Layouts, fragments and ordering rules: sm90.cuh.
 *
 * A block owns BN = 128 keys (k side, any index space) of hpb query heads
 * and one sequence, and the queries of one of ns parts of the key tile's
 * query range (hpb and ns: attn_sm90_bwd_plan):
 *   warpgroup 0 (producer, 24 registers): thread 0 streams the Q and dO
 *     tiles (BM = 64 q-side rows; the q side is always contiguous rows, so
 *     TMA) into a ring of QST stages; warp 1 fills the per-query vectors of
 *     the stage (lse in log2 units, D_i, original row, document id) with
 *     ordinary loads and stores. Stage s completes on full[s] (the copy
 *     bytes plus 32 arrivals) and is refilled after empty[s].
 *   warpgroups 1, 2 (consumers, 240 registers): first gather the K and V
 *     rows of the tile once (cp.async: the k side may be a list of rows);
 *     warpgroup w owns keys 64w..64w+63 and keeps their dK, dV in
 *     registers. Per step of BM queries (64 or 128):
 *       S^T = K Q^T, dP^T = V dO^T          wgmma, all operands in smem
 *       P^T = exp2(x - lse)                  registers (fp32)
 *       dV += P^T dO                         wgmma, A = P^T from registers,
 *                                            B MN-major (issued here at
 *                                            BM = 64, after dS^T at 128)
 *       dS^T = P^T (dP^T - D)                registers, to shared (bf16,
 *                                            double-buffered), barrier of
 *                                            both consumers
 *       dQ = dS K over the 128 keys          wgmma, A = dS^T MN-major,
 *                                            B = K MN-major
 *       dK += dS^T Q                         wgmma, A = dS^T from registers;
 *                                            runs while dQ is stored
 *     where BM = 64: warpgroup w forms columns w D/2.. of the 64 rows;
 *     BM = 128: rows 64w.. with all D columns. Each stores its part of dQ
 *     (fp32) to shared memory; warp 2 of the producer adds the BM x D tile
 *     to the accumulator with one bulk reduction (cp.reduce.async.bulk
 *     .add.f32) while the consumers go on (named barriers 2 and 3 hand the
 *     buffer back and forth).
 * BM = 128 halves the per-step costs (barriers, hand-offs, waits) for the
 * same work but needs twice the score registers: D = 64 only.
 * dk, dv: bf16 rows where a block holds all of a key's terms; else fp32
 * partials for the finish launch's GQA reduction, except where there are
 * exactly two (pairs: clusters of two blocks sum them on chip, epilogue).
 *
 * dq accumulator layout ("slot order"). Per (sequence b, head h, 64-row
 * query tile q64) a slot of 64 x D floats at ((b H + h) TPS + q64) 64 D
 * (TPS: tiles per sequence, from the longest one, even), so a step's
 * BM x D tile is contiguous (one bulk reduction). A slot is D/NW blocks
 * of 64 x NW floats, NW = the dQ product's N (D/2 or D), one per
 * warpgroup's product; inside a block, float4 number (j 128 + thread)
 * holds accumulators 4j..4j+3 of that thread, so a warp's 16-byte stores
 * land on 512 contiguous bytes (no bank conflicts). dq_slot_index gives
 * the position of element (r, c); attn_sm90_dq_convert undoes it.
 * dq is a sum in nondeterministic order (as in bwd.cu); dk, dv are not.
 */
#include "backend/cuda/attention/sm90.cuh"

template <int D, int BM_> struct BwdSm90 {
    static_assert(BM_ == 64 || (BM_ == 128 && D == 64), "128-query steps for D = 64 only (registers)");
    static constexpr int BN = 128;     /* keys per block (64 per consumer) */
    static constexpr int BM = BM_;     /* queries per step                 */
    static constexpr int QST = 2;      /* stages of the Q/dO ring          */
    static constexpr int NW = BM == 64 ? D / 2 : D; /* N of a warpgroup's dQ product */
    static constexpr int THREADS = 384;
    static constexpr uint32_t KT_BYTES = BN * D * 2, QT_BYTES = BM * D * 2, DS_BYTES = BN * BM * 2;
    static constexpr uint32_t DQ_BYTES = BM * D * 4;     /* a step's dq tile, fp32 */
    static constexpr uint32_t SMALL_BYTES = 4 * BM * 4; /* lse, D, row, doc of a stage */
    static constexpr uint32_t OFF_K = 0, OFF_V = KT_BYTES, OFF_Q = 2 * KT_BYTES, OFF_DO = OFF_Q + QST * QT_BYTES,
                              OFF_DS = OFF_DO + QST * QT_BYTES, OFF_DQ = OFF_DS + 2 * DS_BYTES,
                              OFF_SMALL = OFF_DQ + DQ_BYTES, OFF_BAR = OFF_SMALL + QST * SMALL_BYTES;
    /* barriers: full[QST], empty[QST], then (pairs) xready, xdone */
    static constexpr uint32_t SMEM = OFF_BAR + 16 * QST + 16 + 1024;
    /* pairs: the fp32 dk or dv handed to the other block, [D/8][2][256]
     * float2, in the Q/dO ring (free after the last step) */
    static constexpr uint32_t GIVE_BYTES = 128 * D * 4;
    static_assert(GIVE_BYTES <= 2 * QST * QT_BYTES, "the handed-over tile fits the Q/dO ring");
};

namespace {

template <int D, int BM_>
__global__ void __launch_bounds__(384, 1)
    attn_bwd_sm90_kernel(const __grid_constant__ CUtensorMap tmQ, const __grid_constant__ CUtensorMap tmO,
                         const AttnArgs a, int tps, int hpb, int ns, int pair) {
#if CF_SM90A_PATH
    using C = BwdSm90<D, BM_>;
    constexpr int BN = C::BN, BM = C::BM, QST = C::QST, NW = C::NW, DB = D / 64;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    unsigned char *sbase = smem_raw + (base - smem_u32(smem_raw));
    const uint32_t sK = base + C::OFF_K, sV = base + C::OFF_V, sQ = base + C::OFF_Q, sO = base + C::OFF_DO,
                   sDS = base + C::OFF_DS;
    const uint32_t bar = base + C::OFF_BAR;
    auto full = [&](int s) { return bar + 8 * s; };
    auto empty = [&](int s) { return bar + 8 * (QST + s); };
    const uint32_t xready = bar + 16 * QST, xdone = xready + 8; /* pairs */
    auto small = [&](int s) { return reinterpret_cast<float *>(sbase + C::OFF_SMALL + s * C::SMALL_BYTES); };

    const int h0 = blockIdx.x * hpb, b = blockIdx.z; /* query heads h0 .. h0+hpb-1 */
    const int split = blockIdx.y % ns, k0 = blockIdx.y / ns * BN; /* part split of key tile k0 */
    const int ks = seq_begin(a.kstart, b, a.S), klen = seq_begin(a.kstart, b + 1, a.S) - ks;
    const bool tracer = threadIdx.x == 128; /* trace.cuh: the first consumer thread */
    if (tracer) trace_mark(0);
    if (k0 >= klen) {
        if (tracer) trace_finish(TRACE_MAIN, 0);
        return;
    }
    const int qs = seq_begin(a.qstart, b, a.S), qlen = seq_begin(a.qstart, b + 1, a.S) - qs;
    const int hk = h0 / (a.H / a.Hkv);
    /* query steps that can see this key tile: from the first query whose
     * row is >= the first key's row, to the end of the sequence; this
     * block takes part `split` of ns of them (nq query tiles from
     * qt_begin), then the same for each further head of the block (nsteps
     * in all) */
    /* Where both sides are one list (FULL: every row; centrifuge part 1 and
     * the strawman: the kept rows), query k0 is key k0's row: first = k0.
     * Else (centrifuge-kv) a binary search, a dozen dependent loads before
     * the block's first copy (run 32's trace: a search on every block made
     * part 1's median prologue 5.5 / 10.8 us at D = 64 / 128, the full
     * one's 5.3 / 3.0) */
    const int first =
        a.qrow == a.krow && a.qstart == a.kstart ? k0 : count_le(a.qrow, qs, qlen, row_of(a.krow, ks + k0) - 1);
    int qt_begin, nq;
    query_part((qlen + BM - 1) / BM - first / BM, split, ns, &qt_begin, &nq);
    qt_begin += first / BM;
    const int nsteps = nq * hpb;

    if (threadIdx.x == 0) {
        for (int s = 0; s < QST; s++) {
            mbar_init(full(s), 1 + 32);
            mbar_init(empty(s), 8); /* one arrival per consumer warp */
        }
        if (pair) {
            mbar_init(xready, 256); /* every consumer thread of the other block */
            mbar_init(xdone, 256);
        }
        mbar_init_fence();
    }
    /* pairs: both blocks' barriers are initialised before either arrives at
     * the other's (the two blocks of a pair share k0 and b: both are here) */
    if (pair) cluster_sync();
    else __syncthreads();

    const int wg = threadIdx.x >> 7;
    if (wg == 0) {
        /* ---------------------------------------------------- producer */
        /* 24 x 128 + 240 x 256 = 384 x 168, the block's registers at
         * launch: the consumers' setmaxnreg.inc waits for registers the
         * producer gives back, so more here would leave them waiting */
        setmaxnreg_dec<24>();
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        if (warp == 0 && lane == 0) {
            for (int i = 0; i < nsteps; i++) {
                const int h = h0 + i / nq, s = i % QST, n = i / QST, row = qs + (qt_begin + i % nq) * BM;
                if (n > 0) mbar_wait(empty(s), (n - 1) & 1);
                mbar_arrive_tx(full(s), 2 * C::QT_BYTES);
                for (int cb = 0; cb < DB; cb++) {
                    tma_load_3d(sQ + s * C::QT_BYTES + cb * BM * 128, &tmQ, cb * 64, h, row, full(s));
                    tma_load_3d(sO + s * C::QT_BYTES + cb * BM * 128, &tmO, cb * 64, h, row, full(s));
                }
            }
        } else if (warp == 1) {
            /* the next step's vectors are loaded into registers right
             * after this step's are stored, so the global loads' latency
             * is spent while the consumers work, not between a stage's
             * release and its refill (run 22: the consumers' wait for a
             * full stage grew to 8% of the samples once the mask loop got
             * faster, with this warp mostly waiting on its loads) */
            constexpr int PER = BM / 32;
            float lse_r[PER], d_r[PER];
            int row_r[PER], doc_r[PER];
            auto load = [&](int i) {
                const int h = h0 + i / nq;
#pragma unroll
                for (int k = 0; k < PER; k++) {
                    const int qi = (qt_begin + i % nq) * BM + lane + 32 * k;
                    const bool ok = qi < qlen;
                    const size_t idx = (size_t)(qs + qi) * a.H + h;
                    row_r[k] = ok ? row_of(a.qrow, qs + qi) : -1;
                    lse_r[k] = ok ? a.lse[idx] * LOG2E_F : 0.f;
                    d_r[k] = ok ? a.Dvec[idx] : 0.f;
                    doc_r[k] = (ok && a.doc) ? a.doc[row_r[k]] : 0;
                }
            };
            griddep_wait(); /* D_i: the prep launch before this one */
            /* the prep is done: a dependent launch (centrifuge's chained part 2,
             * or the finish) may start once every block has come this far */
            griddep_trigger();
            if (nsteps > 0) load(0);
            for (int i = 0; i < nsteps; i++) {
                const int s = i % QST, n = i / QST;
                if (n > 0) mbar_wait(empty(s), (n - 1) & 1);
                float *sm = small(s);
#pragma unroll
                for (int k = 0; k < PER; k++) {
                    const int c = lane + 32 * k;
                    sm[c] = lse_r[k];
                    sm[BM + c] = d_r[k];
                    reinterpret_cast<int *>(sm)[2 * BM + c] = row_r[k];
                    reinterpret_cast<int *>(sm)[3 * BM + c] = doc_r[k];
                }
                mbar_arrive(full(s));
                if (i + 1 < nsteps) load(i + 1);
            }
        } else if (warp == 2) {
            /* the dq writer: adds each step's dQ tile (BM x D fp32 in slot
             * order, written to shared memory by the consumers) to the
             * accumulator with one bulk reduction, off the consumers' path */
            griddep_wait(); /* the accumulator's zeros: the prep launch */
            for (int i = 0; i < nsteps; i++) {
                named_barrier(2, 256 + 32); /* the consumers' dQ of step i is in shared memory */
                if (lane == 0) {
                    /* slots of (b, h): 64-row tiles, a step covers BM / 64 of them */
                    float *dst = a.dq_acc + dq_slot_base(b, h0 + i / nq, 0, a.H, D, tps) +
                                 (size_t)(qt_begin + i % nq) * (BM * D);
                    bulk_reduce_add_f32(dst, base + C::OFF_DQ, C::DQ_BYTES);
                    bulk_commit();
                    bulk_wait_read();
                }
                __syncwarp();
                if (i + 1 < nsteps) named_barrier_arrive(3, 256 + 32); /* the buffer may be rewritten */
            }
            if (lane == 0) bulk_wait_all();
        }
        return;
    }

    /* ------------------------------------------------------- consumers */
    setmaxnreg_inc<240>();
    const int w = wg - 1, tid = threadIdx.x & 127, v = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int ctid = threadIdx.x - 128;
    const size_t kstr = (size_t)a.Hkv * D;
    /* The key tile: K and V rows gathered once (zeros past klen). The
     * rows of a kept list are read first, all of them, then the copies
     * issued: one load latency, not one per copy. The rows and documents
     * of this thread's keys load while the copies fly. */
    constexpr int GATHER = BN * D / 8 / 256; /* 16-byte pieces of K (and of V) per consumer thread */
    {
        int grow[GATHER];
#pragma unroll
        for (int u = 0; u < GATHER; u++) {
            const int j = k0 + (ctid + 256 * u) / (D / 8);
            grow[u] = row_of(a.krow, ks + (j < klen ? j : klen - 1));
        }
#pragma unroll
        for (int u = 0; u < GATHER; u++) {
            const int c = ctid + 256 * u, r = c / (D / 8), col = (c % (D / 8)) * 8;
            const bool ok = k0 + r < klen;
            const size_t off = (size_t)grow[u] * kstr + (size_t)hk * D + col;
            cp_async16(sbase + C::OFF_K + sw128_off(BN, r, col), a.k + off, ok ? 16 : 0);
            cp_async16(sbase + C::OFF_V + sw128_off(BN, r, col), a.v + off, ok ? 16 : 0);
        }
        cp_async_commit();
    }
    /* this thread's two keys (rows of S^T): 64w + 16v + g (+8) */
    int krow_t[2], kdoc_t[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int j = k0 + 64 * w + 16 * v + g + 8 * r;
        krow_t[r] = j < klen ? row_of(a.krow, ks + j) : INT_MAX;
        kdoc_t[r] = (a.doc && j < klen) ? a.doc[krow_t[r]] : 0;
    }
    const int wk_first = k0 + 64 * w;
    const int wkrow_max = wk_first < klen ? row_of(a.krow, ks + min(wk_first + 63, klen - 1)) : INT_MAX;
    cp_async_wait<0>();
    fence_async_smem();
    named_barrier(1, 256);
    /* this warpgroup's dQ product: rows (queries) from column qc0 of dS^T,
     * columns from kc0 of K; its block of the step's slot tile */
    const int qc0 = BM == 64 ? 0 : 64 * w, kc0 = BM == 64 ? w * (D / 2) : 0;
    float4 *dqs = reinterpret_cast<float4 *>(sbase + C::OFF_DQ) + w * (64 * NW / 4);

    float dk[D / 2], dv[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++) dk[i] = dv[i] = 0.f;

    for (int i = 0; i < nsteps; i++) {
        const int s = i % QST, db = i & 1, qt = qt_begin + i % nq;
        const uint32_t sQs = sQ + s * C::QT_BYTES, sOs = sO + s * C::QT_BYTES, sDSb = sDS + db * C::DS_BYTES;
        mbar_wait(full(s), (i / QST) & 1);
        if (i == 0 && tracer) trace_mark(1);
        const float *sm = small(s);
        const int *qrow_s = reinterpret_cast<const int *>(sm) + 2 * BM, *qdoc_s = qrow_s + BM;

        float st[BM / 2], dpt[BM / 2];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
            wgmma_ss<0, 0>(st, desc_k(sK, BN, 64 * w, kk), desc_k(sQs, BM, 0, kk), kk > 0);
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
            wgmma_ss<0, 0>(dpt, desc_k(sV, BN, 64 * w, kk), desc_k(sOs, BM, 0, kk), kk > 0);
        wgmma_commit();

        const bool need_mask = a.doc != nullptr || qt * BM + BM > qlen || k0 + BN > klen || wkrow_max > qrow_s[0];
        wgmma_wait<1>(); /* S^T */
        fence_regs(st);
        /* P^T = exp2(x - lse), zero where key row > query row or the
         * documents differ (kdoc_t and qdoc_s are 0 without documents).
         * Branch-free, with the column pair (2 t4, 2 t4 + 1) read as one
         * 8-byte load: a branch per element kept ptxas from interleaving
         * the exponentials (run 22: 26% of the kernel's stall samples
         * were in this loop at D = 128, a fifth of them resolving the
         * branches) */
        if (need_mask) {
#pragma unroll
            for (int j = 0; j < BM / 8; j++) {
                const int c = 8 * j + 2 * t4;
                const float2 l2 = *reinterpret_cast<const float2 *>(sm + c);
                const int2 qr = *reinterpret_cast<const int2 *>(qrow_s + c), qd = *reinterpret_cast<const int2 *>(qdoc_s + c);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = e >> 1, odd = e & 1;
                    const float p = fast_exp2(fmaf(st[4 * j + e], a.scale_log2, -(odd ? l2.y : l2.x)));
                    const bool vis = (krow_t[r] <= (odd ? qr.y : qr.x)) & (kdoc_t[r] == (odd ? qd.y : qd.x));
                    st[4 * j + e] = vis ? p : 0.f;
                }
            }
        } else {
#pragma unroll
            for (int j = 0; j < BM / 8; j++) {
                const float2 l2 = *reinterpret_cast<const float2 *>(sm + 8 * j + 2 * t4);
#pragma unroll
                for (int e = 0; e < 4; e++)
                    st[4 * j + e] = fast_exp2(fmaf(st[4 * j + e], a.scale_log2, -((e & 1) ? l2.y : l2.x)));
            }
        }
        /* P^T and dS^T as bf16 A fragments. At BM = 64 the dV product is
         * issued before dS^T is formed and runs meanwhile; at BM = 128 the
         * scores take too many registers for that (ptxas serialises the
         * products), so both are packed in one pass and dV goes after. */
        constexpr bool early_dv = BM == 64;
        uint32_t pa[BM / 16][4], da[BM / 16][4];
        if constexpr (early_dv) {
#pragma unroll
            for (int kk = 0; kk < BM / 16; kk++)
#pragma unroll
                for (int q = 0; q < 4; q++) pa[kk][q] = pack_bf16(st[8 * kk + 2 * q], st[8 * kk + 2 * q + 1]);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BM / 16; kk++) wgmma_rs<1>(dv, pa[kk], desc_mn(sOs, BM, 0, kk), 1);
            wgmma_commit();
        }
        wgmma_wait<early_dv ? 1 : 0>(); /* dP^T (the dV product may still run) */
        fence_regs(dpt);
#pragma unroll
        for (int kk = 0; kk < BM / 16; kk++) {
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const int i0 = 8 * kk + 2 * q, c = 16 * kk + 8 * (q >> 1) + 2 * t4;
                if constexpr (!early_dv) pa[kk][q] = pack_bf16(st[i0], st[i0 + 1]);
                const float2 d2 = *reinterpret_cast<const float2 *>(sm + BM + c);
                da[kk][q] = pack_bf16(st[i0] * (dpt[i0] - d2.x), st[i0 + 1] * (dpt[i0 + 1] - d2.y));
            }
        }
        /* dS^T -> shared, [128 keys][BM queries] swizzled */
#pragma unroll
        for (int j = 0; j < BM / 8; j++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int R = 64 * w + 16 * v + g + 8 * r;
                *reinterpret_cast<uint32_t *>(sbase + C::OFF_DS + db * C::DS_BYTES + sw128_off(BN, R, 8 * j + 2 * t4)) =
                    da[j >> 1][(j & 1) * 2 + r];
            }
        if constexpr (!early_dv) {
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BM / 16; kk++) wgmma_rs<1>(dv, pa[kk], desc_mn(sOs, BM, 0, kk), 1);
            wgmma_commit();
        }
        fence_async_smem();
        named_barrier(1, 256); /* both halves of dS^T written */

        /* dQ = dS K first, then dK += dS^T Q: dQ goes to shared memory
         * while the dK product still runs */
        float dq[NW / 2];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++)
            wgmma_ss<1, 1>(dq, desc_mn(sDSb, BN, qc0, kk), desc_mn(sK, BN, kc0, kk), kk > 0);
        wgmma_commit();
#pragma unroll
        for (int kk = 0; kk < BM / 16; kk++) wgmma_rs<1>(dk, da[kk], desc_mn(sQs, BM, 0, kk), 1);
        wgmma_commit();
        wgmma_wait<1>(); /* dV and dQ */
        fence_regs(dv);
        fence_regs(dq);
        fence_regs(pa);

        /* dQ -> shared in slot order, then to the writer warp */
        if (i > 0) named_barrier(3, 256 + 32); /* the writer has read the last one */
#pragma unroll
        for (int j = 0; j < NW / 8; j++)
            dqs[j * 128 + tid] = make_float4(dq[4 * j] * a.scale, dq[4 * j + 1] * a.scale, dq[4 * j + 2] * a.scale,
                                             dq[4 * j + 3] * a.scale);
        fence_async_smem();
        named_barrier_arrive(2, 256 + 32);
        wgmma_wait<0>(); /* dK: the stage's Q and dO are read */
        fence_regs(dk);
        fence_regs(da);
        __syncwarp();
        if (lane == 0) mbar_arrive(empty(s));
    }
    if (tracer) trace_mark(2);

    if (pair) {
        /* The pair's two blocks hold the two partial sums of the same dk, dv
         * rows (two groups of query heads, or two parts of the query range):
         * rank 0 finishes dk, rank 1 dv. Each hands the other its fp32
         * terms through shared memory (distributed: the cluster), adds the
         * other's to its own and writes bf16: no partials in global memory
         * and no reduction in the finish launch. (0 + mine) + theirs gives
         * the finish launch's bits for two partials, in either order (IEEE
         * addition commutes; 0 + x only turns -0 into +0). */
        const uint32_t rank = cluster_rank(), other = rank ^ 1u;
        named_barrier(1, 256); /* both consumers are past their last products: the ring is free */
        float2 *give = reinterpret_cast<float2 *>(sbase + C::OFF_Q);
#pragma unroll
        for (int n = 0; n < D / 8; n++)
#pragma unroll
            for (int r = 0; r < 2; r++)
                give[(n * 2 + r) * 256 + ctid] =
                    rank == 0 ? make_float2(dv[4 * n + 2 * r], dv[4 * n + 2 * r + 1])
                              : make_float2(__fmul_rn(dk[4 * n + 2 * r], a.scale), __fmul_rn(dk[4 * n + 2 * r + 1], a.scale));
        mbar_arrive_peer(peer_smem(xready, other));
        mbar_wait_cluster(xready, 0);
        const uint32_t theirs = peer_smem(base + C::OFF_Q, other);
        bf16 *out = rank == 0 ? a.dk : a.dv;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int j = k0 + 64 * w + 16 * v + g + 8 * r;
            if (j >= klen) continue;
            bf16 *op = out + (size_t)(ks + j) * kstr + (size_t)hk * D + 2 * t4;
            /* the row's remote terms first, all of them: each remote load
             * orders memory, so loads between the stores would wait for
             * the distributed shared memory's latency one by one (run 32's
             * trace: the pairs' epilogue took 7.2 us at D = 128, 5.9 after) */
            float2 tr[D / 8];
#pragma unroll
            for (int n = 0; n < D / 8; n++) tr[n] = ld_peer_f2(theirs + 8u * ((n * 2 + r) * 256 + ctid));
#pragma unroll
            for (int n = 0; n < D / 8; n++) {
                const float2 t = tr[n];
                const float m0 = rank == 0 ? __fmul_rn(dk[4 * n + 2 * r], a.scale) : dv[4 * n + 2 * r];
                const float m1 = rank == 0 ? __fmul_rn(dk[4 * n + 2 * r + 1], a.scale) : dv[4 * n + 2 * r + 1];
                *reinterpret_cast<__nv_bfloat162 *>(op + 8 * n) = __floats2bfloat162_rn(
                    __fadd_rn(__fadd_rn(0.f, m0), t.x), __fadd_rn(__fadd_rn(0.f, m1), t.y));
            }
        }
        /* this block may not exit while the other still reads its tile */
        mbar_arrive_peer(peer_smem(xdone, other));
        mbar_wait_cluster(xdone, 0);
        if (tracer) trace_finish(TRACE_MAIN, nsteps);
        return;
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int j = k0 + 64 * w + 16 * v + g + 8 * r;
        if (j >= klen) continue;
        const size_t idx = (size_t)(ks + j);
        if (a.dkx) { /* partial of heads h0.., query part split: [nk, H/hpb, ns, D] */
            const size_t part = (idx * (a.H / hpb) + blockIdx.x) * ns + split;
            float *dkp = a.dkx + part * D + 2 * t4;
            float *dvp = a.dvx + part * D + 2 * t4;
#pragma unroll
            for (int n = 0; n < D / 8; n++) {
                *reinterpret_cast<float2 *>(dkp + 8 * n) =
                    make_float2(dk[4 * n + 2 * r] * a.scale, dk[4 * n + 2 * r + 1] * a.scale);
                *reinterpret_cast<float2 *>(dvp + 8 * n) = make_float2(dv[4 * n + 2 * r], dv[4 * n + 2 * r + 1]);
            }
        } else {
            bf16 *dkp = a.dk + idx * kstr + (size_t)hk * D + 2 * t4;
            bf16 *dvp = a.dv + idx * kstr + (size_t)hk * D + 2 * t4;
#pragma unroll
            for (int n = 0; n < D / 8; n++) {
                *reinterpret_cast<__nv_bfloat162 *>(dkp + 8 * n) =
                    __floats2bfloat162_rn(dk[4 * n + 2 * r] * a.scale, dk[4 * n + 2 * r + 1] * a.scale);
                *reinterpret_cast<__nv_bfloat162 *>(dvp + 8 * n) =
                    __floats2bfloat162_rn(dv[4 * n + 2 * r], dv[4 * n + 2 * r + 1]);
            }
        }
    }
    if (tracer) trace_finish(TRACE_MAIN, nsteps);
#endif
}

/* dq (bf16, or fp32 when dqf) from the slot-ordered accumulator. A block
 * takes one slot (sequence b, head h, 64-row query tile q64): it reads
 * the slot in order as float4s (coalesced) into a
 * [64][D] shared tile, then writes whole rows (coalesced). Each float4 is
 * rows r, r + 8 and columns c, c + 1 (dq_slot_coords). The tile's rows
 * are padded by 8 floats, so a half-warp's 8-byte stores (4 rows x 4
 * column pairs) hit distinct banks. */
constexpr int FINISH_THREADS = 256; /* the finish launch's block */

template <int D>
__device__ __forceinline__ void dq_convert_slot(bf16 *dq, float *dqf, const float *acc, const int *qstart, int S,
                                                int H, int tps, int nw, int q64, int h, int b) {
    constexpr int LD = D + 8;
    __shared__ float tile[64 * LD];
    const int start = qstart ? qstart[b] : b * S, len = qstart ? qstart[b + 1] - start : S;
    if (q64 * 64 >= len) return;
    const float4 *src = reinterpret_cast<const float4 *>(acc + dq_slot_base(b, h, q64, H, D, tps));
    /* every load of the slot in flight before the first shared store (one
     * at a time, the launch waited on each load's latency) */
    constexpr int PER = 16 * D / FINISH_THREADS;
    float4 x[PER];
#pragma unroll
    for (int i = 0; i < PER; i++) x[i] = src[threadIdx.x + i * FINISH_THREADS];
#pragma unroll
    for (int i = 0; i < PER; i++) {
        int r, c;
        dq_slot_coords(threadIdx.x + i * FINISH_THREADS, nw, &r, &c);
        float *p = tile + r * LD + c;
        *reinterpret_cast<float2 *>(p) = make_float2(x[i].x, x[i].y);
        *reinterpret_cast<float2 *>(p + 8 * LD) = make_float2(x[i].z, x[i].w);
    }
    __syncthreads();
    const int rows = min(64, len - q64 * 64);
    for (int e = threadIdx.x; e < rows * (D / 4); e += FINISH_THREADS) {
        const int r = e / (D / 4), c = 4 * (e % (D / 4));
        const float4 x = *reinterpret_cast<const float4 *>(tile + r * LD + c);
        const size_t o = ((size_t)(start + q64 * 64 + r) * H + h) * D + c;
        if (dqf) {
            *reinterpret_cast<float4 *>(dqf + o) = x;
        } else {
            const __nv_bfloat162 lo = __floats2bfloat162_rn(x.x, x.y), hi = __floats2bfloat162_rn(x.z, x.w);
            uint2 u;
            u.x = *reinterpret_cast<const uint32_t *>(&lo);
            u.y = *reinterpret_cast<const uint32_t *>(&hi);
            *reinterpret_cast<uint2 *>(dq + o) = u;
        }
    }
}

/* The backward's last launch: blocks [0, nconv) convert one dq slot each
 * (nconv = tps H B; block x is slot (q64, h, b) = (x % tps, x / tps % H,
 * x / (tps H))); the rest, if any, reduce the GQA partials of dk, dv. Two
 * independent jobs in one grid: one launch and one tail instead of two. */
template <int D>
__global__ void __launch_bounds__(FINISH_THREADS)
    bwd_finish_kernel(bf16 *dq, float *dqf, const float *acc, const int *qstart, int S, int H, int tps, int nw,
                      int nconv, GqaReduce red) {
    if (threadIdx.x == 0) trace_mark(0);
    griddep_wait(); /* the main kernel's dq and partials (launched as its dependent) */
    if (threadIdx.x == 0) trace_mark(1);
    const int x = blockIdx.x;
    if (x < nconv)
        dq_convert_slot<D>(dq, dqf, acc, qstart, S, H, tps, nw, x % tps, x / tps % H, x / (tps * H));
    else
        gqa_reduce_body<4>(red.dk, red.dv, red.dkx, red.dvx, red.nk, red.Hkv, red.G, D, x - nconv, gridDim.x - nconv);
    if (threadIdx.x == 0) trace_finish(TRACE_FINISH, 0); /* thread 0's end (trace.cuh) */
}

} // namespace

/* ==================================================================== host */

ATTN_TRACE_BINDER(attn_trace_bind_sm90)

/* 128 queries per backward step at D = 64 (64 with CF_ATTN_SM90_BWD_BM=64,
 * for timing both; read once). Measured on an H100 (FULL, S = 4096, H = 32,
 * Hkv = 4, two query heads per block): 0.690 ms with 128, 0.753 with 64. */
static int bwd_bm_for(int D) {
    static const int bm64 = attn_env_int("CF_ATTN_SM90_BWD_BM", 128) == 64 ? 64 : 128;
    return D == 64 ? bm64 : 64;
}

/* The launch plan: hpb query heads per block and ns parts per key tile.
 * With GQA a block walks the query tiles of hpb heads of one group in turn
 * with the same K, V tile (loaded once) and writes one partial of dk, dv
 * for them: fewer blocks (each one's gather, prologue and epilogue shared
 * by hpb heads) and 1/hpb of the fp32 partials to write and reduce. With 2
 * parts each block takes half of its key tile's query tiles and writes a
 * partial of its own: causal blocks are uneven (the first key tile of a
 * sequence sees every query tile, the last one a few), and where the grid
 * is small the longest block sets the kernel's time while most SMs idle.
 * The two pull against each other (more heads make longer blocks; parts
 * shorter ones, and more partials), and the block scheduler hands blocks
 * out in launch order, sequence by sequence, so the plan is chosen by
 * sm90.cuh's bwd_plan, which plays that schedule with a cost per step,
 * block and MB of partials (checked on the CPU by
 * tests/gpu/host_bwd_parts.cu). Measured on an H100 (run 24 call 1, full
 * backward, ms, the plan's choice against the best of up to 8 plans):
 * Llama3.2-3B (group of 3) 3 heads x 2 parts 0.191, where one head per
 * block, the old rule's, took 0.212; 4 sequences 3 x 1 0.671 (0.763
 * before); Qwen2.5-1.5B x 4 sequences 3 x 2 0.360 (0.385 before); the
 * largest miss is Llama3.2-3B at S = 4096, 3 x 1 at 0.59-0.63 (three
 * timings) against 0.577-0.578 for 3 x 2. Beside centrifuge's part 2 the
 * model adds part 2's work, which fills the SMs part 1's blocks leave, and
 * counts no partials where pairs sum them (bwd_beside_cost): Llama3.2-3B's
 * centrifuge attention backward 0.087-0.088 ms with 3 x 2 (pairs) where
 * the earlier rule (the largest hpb leaving 1.5 blocks per SM, one part)
 * chose 1 x 1 at 0.098-0.099 (run 34 call 1, H200).
 * CF_ATTN_SM90_BWD_HPB=n and CF_ATTN_SM90_BWD_SPLIT=n force them (timing,
 * read once), ctx->attn_bwd_hpb and ctx->attn_bwd_split per context
 * (tests). Plans are kept per context for the last few shapes: a model
 * asks for the same shape in every layer. */
static_assert(BwdSm90<64, 128>::BN == BwdSm90<128, 64>::BN && BwdSm90<64, 64>::BN == BwdSm90<128, 64>::BN,
              "one key tile for every variant");
void attn_sm90_bwd_plan(cf_cuda_ctx *ctx, int D, int H, int Hkv, int B, int qmaxlen, int kmaxlen, int flen,
                        int *hpb, int *ns) {
    static const int env_hpb = attn_env_int("CF_ATTN_SM90_BWD_HPB", 0), env_ns = attn_env_int("CF_ATTN_SM90_BWD_SPLIT", 0);
    const int fh = ctx->attn_bwd_hpb > 0 ? ctx->attn_bwd_hpb : env_hpb;
    const int fs = ctx->attn_bwd_split > 0 ? ctx->attn_bwd_split : env_ns;
    const int key[CF_ATTN_PLAN_KEY] = {D, H, Hkv, B, qmaxlen, kmaxlen, flen, fh, fs};
    for (int i = 0; i < CF_ATTN_PLANS; i++)
        if (ctx->attn_plans[i].hpb > 0 && !memcmp(ctx->attn_plans[i].key, key, sizeof key)) {
            *hpb = ctx->attn_plans[i].hpb;
            *ns = ctx->attn_plans[i].ns;
            return;
        }
    const BwdPlan p = bwd_plan(D, BwdSm90<128, 64>::BN, bwd_bm_for(D), H, Hkv, B, qmaxlen, kmaxlen, ctx->sm_count,
                               flen, fh, fs);
    const int slot = ctx->attn_plan_next;
    ctx->attn_plan_next = (slot + 1) % CF_ATTN_PLANS;
    memcpy(ctx->attn_plans[slot].key, key, sizeof key);
    ctx->attn_plans[slot].hpb = p.hpb;
    ctx->attn_plans[slot].ns = p.ns;
    *hpb = p.hpb;
    *ns = p.ns;
}

/* Programmatic dependent launch of the main kernel after the prep and of
 * the finish after the main kernel (common.cuh: griddep_*), so a launch's
 * start overlaps the end of the one before. CF_ATTN_PDL=0 (read once)
 * launches them plainly, for timing. */
static bool bwd_pdl(void) {
    static const int on = attn_env_int("CF_ATTN_PDL", 1);
    return on != 0;
}

/* the bit of each main-kernel variant in ctx->attn_sm90_attr_done and in
 * the pairs' checked/ok masks */
template <int D, int BM> static constexpr int bwd_variant_bit() {
    return D == 128 ? SM90_ATTR_BWD128 : BM == 64 ? SM90_ATTR_BWD64_BM64 : SM90_ATTR_BWD64_BM128;
}

/* *at = clusters of two along the axis of `pair` (CF_PAIR_HEADS: x, the
 * head groups; CF_PAIR_PARTS: y, the parts of a key tile) */
static void pair_cluster_attr(cudaLaunchAttribute *at, int pair) {
    at->id = cudaLaunchAttributeClusterDimension;
    at->val.clusterDim.x = pair == CF_PAIR_HEADS ? 2 : 1;
    at->val.clusterDim.y = pair == CF_PAIR_PARTS ? 2 : 1;
    at->val.clusterDim.z = 1;
}

template <int D, int BM>
static int bwd_sm90_launch(cf_cuda_ctx *ctx, const AttnArgs &a, int nq_rows, int kmaxlen, int tps, int hpb, int ns,
                           int pair) {
    using C = BwdSm90<D, BM>;
    CUtensorMap mq, mo;
    if (!attn_sm90_map_rows(&mq, a.q, nq_rows, a.H, D, C::BM) || !attn_sm90_map_rows(&mo, a.dout, nq_rows, a.H, D, C::BM))
        return 0;
    const void *fn = (const void *)attn_bwd_sm90_kernel<D, BM>;
    if (!attn_sm90_prepare(ctx, fn, C::SMEM, bwd_variant_bit<D, BM>())) return -1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = attn_sm90_bwd_grid(a.H, hpb, ns, a.B, kmaxlen);
    cfg.blockDim = dim3(C::THREADS);
    cfg.dynamicSmemBytes = C::SMEM;
    cfg.stream = ctx->stream;
    cudaLaunchAttribute at[2];
    unsigned nat = 0;
    if (pair) pair_cluster_attr(&at[nat++], pair);
    if (bwd_pdl()) at[nat++] = griddep_attr(); /* its prologue while the prep launch ends (it waits before reading D_i, zeros) */
    cfg.attrs = at;
    cfg.numAttrs = nat;
    const int on = pair != 0;
    void *args[] = {(void *)&mq, (void *)&mo, (void *)&a, (void *)&tps, (void *)&hpb, (void *)&ns, (void *)&on};
    return CF_CK(ctx, cudaLaunchKernelExC(&cfg, fn, args)) ? 1 : -1;
}

/* Whether the kernel of head dim D runs in clusters of two blocks on this
 * device at one block per SM (asked once per variant; a refusal is not an
 * error: the partials path stays). */
template <int D, int BM> static bool pairs_fit(cf_cuda_ctx *ctx) {
    using C = BwdSm90<D, BM>;
    const int which = bwd_variant_bit<D, BM>();
    if (ctx->attn_pair_checked >> which & 1) return ctx->attn_pair_ok >> which & 1;
    const void *fn = (const void *)attn_bwd_sm90_kernel<D, BM>;
    if (!attn_sm90_prepare(ctx, fn, C::SMEM, which)) return false;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(2, 1, 1);
    cfg.blockDim = dim3(C::THREADS);
    cfg.dynamicSmemBytes = C::SMEM;
    cudaLaunchAttribute cl[1];
    pair_cluster_attr(&cl[0], CF_PAIR_HEADS);
    cfg.attrs = cl;
    cfg.numAttrs = 1;
    int n = 0;
    const bool ok = cudaOccupancyMaxActiveClusters(&n, fn, &cfg) == cudaSuccess && n > 0;
    cudaGetLastError();
    ctx->attn_pair_checked |= 1u << which;
    if (ok) ctx->attn_pair_ok |= 1u << which;
    return ok;
}

/* Pairs (see the kernel's epilogue) where a kv head's dk, dv have exactly
 * two partials: two groups of query heads in one part, or one group in
 * two parts. CF_ATTN_SM90_BWD_PAIR=0 (read once) or ctx->attn_bwd_nopair
 * keeps the partials, for timing and tests. */
int attn_sm90_bwd_pair(cf_cuda_ctx *ctx, int D, int H, int Hkv, int hpb, int ns) {
    static const int env = attn_env_int("CF_ATTN_SM90_BWD_PAIR", 1);
    if (!env || ctx->attn_bwd_nopair || hpb <= 0 || Hkv <= 0 || H % Hkv || (H / Hkv) % hpb) return CF_PAIR_NONE;
    const int groups = H / Hkv / hpb;
    const int axis = groups == 2 && ns == 1 ? CF_PAIR_HEADS : groups == 1 && ns == 2 ? CF_PAIR_PARTS : CF_PAIR_NONE;
    if (!axis) return CF_PAIR_NONE;
    bool fits = false;
    if (D == 64) fits = bwd_bm_for(64) == 128 ? pairs_fit<64, 128>(ctx) : pairs_fit<64, 64>(ctx);
    else if (D == 128) fits = pairs_fit<128, 64>(ctx);
    return fits ? axis : CF_PAIR_NONE;
}

int attn_sm90_bwd_nw(int D) { return bwd_bm_for(D) == 64 ? D / 2 : D; }

dim3 attn_sm90_bwd_grid(int H, int hpb, int ns, int B, int kmaxlen) {
    constexpr int BN = BwdSm90<128, 64>::BN; /* every variant's (static_assert above) */
    return dim3(H / hpb, (kmaxlen + BN - 1) / BN * ns, B);
}

int attn_bwd_sm90(cf_cuda_ctx *ctx, const AttnArgs &a, int D, int nq_rows, int kmaxlen, int tps, int hpb, int ns,
                  int pair) {
    if (kmaxlen <= 0) return 1;
    if (ns > 1 && !a.dkx && !pair) return 0; /* parts need the partials, or a pair */
    if (D == 64) return bwd_bm_for(64) == 128 ? bwd_sm90_launch<64, 128>(ctx, a, nq_rows, kmaxlen, tps, hpb, ns, pair)
                                              : bwd_sm90_launch<64, 64>(ctx, a, nq_rows, kmaxlen, tps, hpb, ns, pair);
    if (D == 128) return bwd_sm90_launch<128, 64>(ctx, a, nq_rows, kmaxlen, tps, hpb, ns, pair);
    return 0;
}

void attn_sm90_bwd_finish(cudaStream_t st, bf16 *dq, float *dqf, const float *acc, const int *qstart, int B, int S,
                          int H, int D, int tps, const GqaReduce *red, bool after_main) {
    if (B <= 0 || tps <= 0 || (D != 64 && D != 128)) return;
    const long long nconv = (long long)tps * H * B;
    /* the reduction: 4 columns per thread, grid-stride past 65536 blocks */
    const int nred = red ? attn_grid_for(red->nk * red->Hkv * D / 4) : 0;
    const GqaReduce r = red ? *red : GqaReduce{};
    const unsigned grid = (unsigned)(nconv + nred);
    int nw = attn_sm90_bwd_nw(D), nc = (int)nconv;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(FINISH_THREADS);
    cfg.stream = st;
    cudaLaunchAttribute at[1] = {griddep_attr()};
    cfg.attrs = at;
    cfg.numAttrs = after_main && bwd_pdl() ? 1 : 0;
    void *args[] = {(void *)&dq, (void *)&dqf, (void *)&acc, (void *)&qstart, (void *)&S, (void *)&H, (void *)&tps,
                    (void *)&nw, (void *)&nc, (void *)&r};
    const void *fn = D == 64 ? (const void *)bwd_finish_kernel<64> : (const void *)bwd_finish_kernel<128>;
    cudaLaunchKernelExC(&cfg, fn, args); /* an error shows in the caller's launch check */
}
