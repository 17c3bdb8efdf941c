/*
 * attention/bwd_centrifuge_sm90.cu — centrifuge part 2 on Hopper (sm_90a):
 * what bwd_centrifuge.cu does (dq of the kept queries over the filtered
 * keys, added to part 1's dq; notation and index spaces: common.cuh), with
 * warpgroup matrix products. Layouts, fragments and ordering rules:
 * sm90.cuh.
 *
 * The filtered keys are scattered rows of K and V; the copy engine reads
 * boxes of contiguous rows, so their K and V rows are first gathered into
 * compact [nf, Hkv, D] arrays (a few MB), by cf_prep_kernel, which also
 * lists them and does the backward's prep. A work item is BM = 128 kept
 * queries of one head (two consumer warpgroups of 64) and the tiles of BN
 * filtered keys (128 at D = 64, 64 at D = 128) that precede its last
 * query. The grid is persistent: a block per SM takes items from a queue
 * (a counter the prep zeroes), longest first, until none is left, with
 * two items in flight:
 *   warpgroup 0: warp 1 claims the items and posts them to the block
 *     (slots, mbarriers posted / qempty) and stores the original rows and
 *     document ids of each key tile; warp 3 stores each item's query
 *     vectors (row, document, lse, D_i); thread 0 loads each item's Q and
 *     dO (TMA, two buffers, mbarriers full_q) and K, V per tile (a ring of
 *     KST stages across items, mbarriers full_k / full_v / empty).
 *   consumers, per tile:
 *     S = Q K^T, dP = dO V^T                 wgmma, operands in smem
 *     P = exp2(x - lse), dS = P (dP - D)     registers (the full-forward lse)
 *     dQ += dS K                             wgmma, A = dS from registers,
 *                                            B = K MN-major
 * and each item's epilogue adds scale dQ to bwd_sm90.cu's dq accumulator
 * (slot order) by float4 atomics while the next item's first tiles load;
 * the caller converts it to bf16 once part 1 has added its terms too.
 * A block per item paid the copy engine's latency before each item's
 * first tile (run 32's trace: about 2 us a block, 4-6% of the SMs' time
 * at S = 4096); the persistent blocks load the next item while this one
 * runs. The two parts are independent, so the caller runs this one on a
 * second stream beside part 1 (launch.cu): each fills the SMs the other's
 * uneven causal grid leaves idle.
 */
#include "backend/cuda/attention/sm90.cuh"

template <int D> struct DqSm90 {
    /* 128 keys per tile at D = 64 (fewer steps); 64 at D = 128 (registers) */
    static constexpr int NC = 2, BM = 64 * NC, BN = D == 64 ? 128 : 64, KST = 2, THREADS = 128 * (NC + 1);
    static constexpr int QB = 2; /* work items in flight: Q/dO buffers, query vectors, slots */
    static constexpr uint32_t Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2, SMALL_BYTES = 2 * BN * 4;
    static constexpr uint32_t QVEC_BYTES = 4 * BM * 4; /* row, document, lse, D_i of an item's queries */
    /* item i's Q at i * 2 Q_BYTES, its dO Q_BYTES further */
    static constexpr uint32_t OFF_Q = 0, OFF_K = 2 * QB * Q_BYTES, OFF_V = OFF_K + KST * KV_BYTES,
                              OFF_SMALL = OFF_V + KST * KV_BYTES, OFF_QVEC = OFF_SMALL + KST * SMALL_BYTES,
                              OFF_SLOT = OFF_QVEC + QB * QVEC_BYTES, OFF_BAR = OFF_SLOT + QB * 32;
    /* barriers: posted[QB], full_q[QB], qempty[QB], full_k[KST], full_v[KST], empty[KST] */
    static constexpr uint32_t SMEM = OFF_BAR + 8 * (3 * QB + 3 * KST) + 1024;
    static_assert(SMEM <= 227 * 1024, "part 2 fits an SM's shared memory");
};

namespace {

/* The number of kept rows before the j-th filtered row (sm90.cuh:
 * kept_search_*), searched by the whole warp */
__device__ __forceinline__ int kept_before_filtered(const int *rows, int n, int j, int lane) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int p = kept_search_probe(lo, hi, lane);
        const unsigned hit = __ballot_sync(0xffffffffu, p >= hi || rows[p] - p > j);
        if (!kept_search_narrow(&lo, &hi, hit)) break;
    }
    return lo;
}

/* Centrifuge's preparation on Hopper, three jobs in one grid (one launch,
 * one tail, instead of three kernels per layer):
 *   blocks [0, nr): warp j (< nf) finds the j-th filtered row r (the rows
 *     not kept, ascending: r = j + the kept rows before it), writes
 *     filt[j] = r and, when kf is set, copies r's K and V rows (every kv
 *     head) to row j of the compact kf, vf that part 2 reads through the
 *     copy engine; block 0 also writes fstart[b] = b S - seq_start[b]
 *     (filtered rows before sequence b) and sets part 2's queue to 0.
 *     First in the grid, so the searches' latency passes while the prep
 *     blocks run;
 *   blocks [nr, nr + np): D_i of the n kept query rows x H heads and the
 *     zeroing of the dq accumulator (common.cuh: attn_prep_body). */
struct CfPrep {
    const bf16 *dout, *o;
    float *Dvec, *zero;
    size_t nzero;
    int nrows, D, rpw, nr;       /* prep: rows (q rows x heads), head dim, rows per warp; blocks of the first range */
    const int *rows, *seq_start; /* the kept rows, ascending */
    int n, nf, B, S;
    int *filt, *fstart;
    const bf16 *k, *v;           /* [T, Hkv, D] */
    bf16 *kf, *vf;               /* [nf, Hkv, D], or NULL: no copy */
    int rowlen;                  /* Hkv D */
    int *queue;                  /* part 2's work queue: set to 0 */
};

/* the first range: this warp's filtered row */
__device__ __forceinline__ void cf_prep_filtered(const CfPrep &p) {
    if (blockIdx.x == 0) {
        for (int b = threadIdx.x; b <= p.B; b += blockDim.x) p.fstart[b] = b * p.S - p.seq_start[b];
        if (threadIdx.x == 0) *p.queue = 0;
    }
    const int j = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (j >= p.nf) return;
    const int r = j + kept_before_filtered(p.rows, p.n, j, lane);
    if (lane == 0) p.filt[j] = r;
    if (!p.kf) return;
    const pack8 *ks = reinterpret_cast<const pack8 *>(p.k + (size_t)r * p.rowlen);
    const pack8 *vs = reinterpret_cast<const pack8 *>(p.v + (size_t)r * p.rowlen);
    pack8 *kd = reinterpret_cast<pack8 *>(p.kf + (size_t)j * p.rowlen), *vd = reinterpret_cast<pack8 *>(p.vf + (size_t)j * p.rowlen);
    /* up to U 16-byte loads of K and of V per lane in flight before their
     * stores (the compiler cannot move a load above a store that may alias
     * it, so a plain copy loop waits for each load in turn) */
    constexpr int U = 4;
    const int n8 = p.rowlen / 8;
    for (int c0 = lane; c0 < n8; c0 += 32 * U) {
        pack8 kx[U], vx[U];
#pragma unroll
        for (int u = 0; u < U; u++)
            if (c0 + 32 * u < n8) {
                kx[u] = ks[c0 + 32 * u];
                vx[u] = vs[c0 + 32 * u];
            }
#pragma unroll
        for (int u = 0; u < U; u++)
            if (c0 + 32 * u < n8) {
                kd[c0 + 32 * u] = kx[u];
                vd[c0 + 32 * u] = vx[u];
            }
    }
}

__global__ void __launch_bounds__(256) cf_prep_kernel(const CfPrep p) {
    griddep_trigger(); /* part 1 may start its prologue (it waits before reading D_i) */
    if (threadIdx.x == 0) trace_mark(0);
    if ((int)blockIdx.x >= p.nr)
        attn_prep_body(p.dout, p.o, p.Dvec, p.zero, p.nzero, p.nrows, p.D, p.rpw, blockIdx.x - p.nr, gridDim.x - p.nr);
    else
        cf_prep_filtered(p);
    if (threadIdx.x == 0) trace_finish(TRACE_PREP, 0); /* thread 0's end (trace.cuh) */
}

/* One work item of part 2: a tile of BM kept queries of one head. Items
 * are numbered head first, then query tiles from the last (the longest:
 * most filtered keys before them), then sequences, and taken from a queue
 * in that order. slot: what the claiming warp passes to the others. */
struct DqItem {
    int it, nt, qs, qlen, ks, klen, pad0, pad1; /* it < 0: the queue is empty; 32 bytes (DqSm90::OFF_SLOT) */
};
static_assert(sizeof(DqItem) == 32, "a slot is 32 bytes (DqSm90: OFF_BAR)");
#if CF_SM90A_PATH /* its only callers: the kernel's sm_90a body */
__device__ __forceinline__ void dq_item_place(int it, int H, int qtiles, int BM, int *h, int *b, int *q0) {
    *h = it % H;
    *q0 = (qtiles - 1 - it / H % qtiles) * BM;
    *b = it / (H * qtiles);
}
#endif

template <int D, bool PINGPONG>
__global__ void __launch_bounds__(DqSm90<D>::THREADS, 1)
    attn_bwd_dq_sm90_kernel(const __grid_constant__ CUtensorMap tmQ, const __grid_constant__ CUtensorMap tmO,
                            const __grid_constant__ CUtensorMap tmK, const __grid_constant__ CUtensorMap tmV,
                            const AttnArgs a, int tps, int attn_nw, int *queue, int nitems, int qtiles) {
#if CF_SM90A_PATH
    using C = DqSm90<D>;
    constexpr int BM = C::BM, BN = C::BN, KST = C::KST, QB = C::QB, DB = D / 64;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    unsigned char *sbase = smem_raw + (base - smem_u32(smem_raw));
    const uint32_t sK = base + C::OFF_K, sV = base + C::OFF_V;
    auto sQ = [&](int i) { return base + C::OFF_Q + i * 2 * C::Q_BYTES; };
    auto sO = [&](int i) { return sQ(i) + C::Q_BYTES; };
    const uint32_t bar = base + C::OFF_BAR;
    auto posted = [&](int i) { return bar + 8 * i; };
    auto full_q = [&](int i) { return bar + 8 * (QB + i); };
    auto qempty = [&](int i) { return bar + 8 * (2 * QB + i); };
    auto full_k = [&](int s) { return bar + 8 * (3 * QB + s); };
    auto full_v = [&](int s) { return bar + 8 * (3 * QB + KST + s); };
    auto empty = [&](int s) { return bar + 8 * (3 * QB + 2 * KST + s); };
    auto small = [&](int s) { return reinterpret_cast<int *>(sbase + C::OFF_SMALL + s * C::SMALL_BYTES); };
    auto qvec = [&](int i) { return reinterpret_cast<float *>(sbase + C::OFF_QVEC + i * C::QVEC_BYTES); };
    auto slot = [&](int i) { return reinterpret_cast<DqItem *>(sbase + C::OFF_SLOT) + i; };

    const bool tracer = threadIdx.x == 128; /* trace.cuh: the first consumer thread */
    if (tracer) trace_mark(0);
    if (threadIdx.x == 0) {
        for (int i = 0; i < QB; i++) {
            mbar_init(posted(i), 1);
            mbar_init(full_q(i), 1 + 32);
            mbar_init(qempty(i), 4 * C::NC);
        }
        for (int s = 0; s < KST; s++) {
            mbar_init(full_k(s), 1 + 32);
            mbar_init(full_v(s), 1);
            mbar_init(empty(s), 4 * C::NC);
        }
        mbar_init_fence();
    }
    __syncthreads();

    /* Item k of this block uses Q/dO buffer, query vectors and slot k % QB,
     * at mbarrier parity (k / QB) & 1; the K/V ring's tiles are numbered
     * across items (u). */
    const int wg = threadIdx.x >> 7;
    if (wg == 0) {
        setmaxnreg_dec<40>();
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        if (warp == 1) {
            /* The claimer: stores the rows and documents of item k's key
             * tiles into the ring (the next tile's loaded while this one's
             * are stored, as in bwd_sm90.cu) and, before the last KST of
             * them (the consumers have then given back item k - 1's
             * buffers, or are about to), takes item k + 1 from the queue
             * and posts it: its Q and dO load while item k's last tiles
             * run. Not earlier: a block holding a second long item while
             * others start idle made the end of part 2 uneven (run 32:
             * +11% at Llama3.2-3B's shape, claims after the first KST). */
            auto claim = [&](int k) {
                const int i = k % QB, use = k / QB;
                if (use > 0) mbar_wait(qempty(i), (use - 1) & 1);
                int it = 0;
                if (lane == 0) it = atomicAdd(queue, 1);
                it = __shfl_sync(0xffffffffu, it, 0);
                DqItem m = {-1, 0, 0, 0, 0, 0, 0, 0};
                if (it < nitems) {
                    int h, b, q0;
                    dq_item_place(it, a.H, qtiles, BM, &h, &b, &q0);
                    m.it = it;
                    m.qs = seq_begin(a.qstart, b, a.S);
                    m.qlen = seq_begin(a.qstart, b + 1, a.S) - m.qs;
                    m.ks = seq_begin(a.kstart, b, a.S);
                    m.klen = seq_begin(a.kstart, b + 1, a.S) - m.ks;
                    if (q0 < m.qlen) {
                        /* the filtered keys up to the item's last query,
                         * row R: the k side is the complement of the kept
                         * rows in the sequence (rows b S .. b S + S - 1)
                         * and R is its (q0 + qn)-th kept row, so no search
                         * (run 32's trace: a binary search over the
                         * filtered rows made each block's prologue
                         * 2.6 / 3.0 us at D = 64 / 128, 1.9 / 2.2 without) */
                        const int qn = min(BM, m.qlen - q0), R = row_of(a.qrow, m.qs + q0 + qn - 1);
                        m.nt = (min(max(R - b * a.S + 1 - (q0 + qn), 0), m.klen) + BN - 1) / BN;
                    }
                }
                if (lane == 0) {
                    *slot(i) = m;
                    mbar_arrive(posted(i));
                }
                return m;
            };
            constexpr int PER = BN / 32;
            int row_r[PER], doc_r[PER];
            DqItem cur = claim(0);
            for (int k = 0, u = 0; cur.it >= 0; k++) {
                DqItem next;
                bool claimed = false;
                auto load = [&](int t) {
#pragma unroll
                    for (int e = 0; e < PER; e++) {
                        const int j = t * BN + lane + 32 * e;
                        row_r[e] = j < cur.klen ? row_of(a.krow, cur.ks + j) : INT_MAX;
                        doc_r[e] = (a.doc && j < cur.klen) ? a.doc[row_r[e]] : 0;
                    }
                };
                if (cur.nt > 0) load(0);
                for (int t = 0; t < cur.nt; t++, u++) {
                    if (t == max(cur.nt - KST, 0)) {
                        next = claim(k + 1);
                        claimed = true;
                    }
                    const int s = u % KST, n = u / KST;
                    if (n > 0) mbar_wait(empty(s), (n - 1) & 1);
                    int *sm = small(s);
#pragma unroll
                    for (int e = 0; e < PER; e++) {
                        sm[lane + 32 * e] = row_r[e];
                        sm[BN + lane + 32 * e] = doc_r[e];
                    }
                    mbar_arrive(full_k(s));
                    if (t + 1 < cur.nt) load(t + 1);
                }
                if (!claimed) next = claim(k + 1);
                cur = next;
            }
        } else if (warp == 3) {
            /* the query vectors of each item: original row, document id,
             * lse (log2 units) and D_i of its BM queries */
            for (int k = 0;; k++) {
                const int i = k % QB;
                mbar_wait(posted(i), (k / QB) & 1);
                const DqItem m = *slot(i);
                if (m.it >= 0 && m.nt > 0) {
                    int h, b, q0;
                    dq_item_place(m.it, a.H, qtiles, BM, &h, &b, &q0);
                    float *qv = qvec(i);
#pragma unroll
                    for (int e = 0; e < BM / 32; e++) {
                        const int c = lane + 32 * e, qi = q0 + c;
                        const bool ok = qi < m.qlen;
                        const size_t idx = (size_t)(m.qs + (ok ? qi : 0)) * a.H + h;
                        const int row = ok ? row_of(a.qrow, m.qs + qi) : -1;
                        reinterpret_cast<int *>(qv)[c] = row;
                        reinterpret_cast<int *>(qv)[BM + c] = (ok && a.doc) ? a.doc[row] : 0;
                        qv[2 * BM + c] = ok ? a.lse[idx] * LOG2E_F : 0.f;
                        qv[3 * BM + c] = ok ? a.Dvec[idx] : 0.f;
                    }
                }
                mbar_arrive(full_q(i));
                if (m.it < 0) break;
            }
        } else if (warp == 0 && lane == 0) {
            /* the copy engine's issuer: item k's K and V tiles into the
             * ring, and before the last KST of them (where the claimer
             * posts item k + 1) item k + 1's Q and dO */
            auto load_q = [&](int k) {
                const int i = k % QB;
                mbar_wait(posted(i), (k / QB) & 1);
                const DqItem m = *slot(i);
                if (m.it < 0 || m.nt == 0) {
                    mbar_arrive(full_q(i));
                    return m;
                }
                int h, b, q0;
                dq_item_place(m.it, a.H, qtiles, BM, &h, &b, &q0);
                mbar_arrive_tx(full_q(i), 2 * C::Q_BYTES);
                for (int cb = 0; cb < DB; cb++) {
                    tma_load_3d(sQ(i) + cb * BM * 128, &tmQ, cb * 64, h, m.qs + q0, full_q(i));
                    tma_load_3d(sO(i) + cb * BM * 128, &tmO, cb * 64, h, m.qs + q0, full_q(i));
                }
                return m;
            };
            DqItem cur = load_q(0);
            for (int k = 0, u = 0; cur.it >= 0; k++) {
                DqItem next;
                bool loaded = false;
                int h, b, q0;
                dq_item_place(cur.it, a.H, qtiles, BM, &h, &b, &q0);
                const int hk = h / (a.H / a.Hkv);
                for (int t = 0; t < cur.nt; t++, u++) {
                    if (t == max(cur.nt - KST, 0)) {
                        next = load_q(k + 1);
                        loaded = true;
                    }
                    const int s = u % KST, n = u / KST, row = cur.ks + t * BN;
                    if (n > 0) mbar_wait(empty(s), (n - 1) & 1);
                    mbar_arrive_tx(full_k(s), C::KV_BYTES);
                    for (int cb = 0; cb < DB; cb++)
                        tma_load_3d(sK + s * C::KV_BYTES + cb * BN * 128, &tmK, cb * 64, hk, row, full_k(s));
                    mbar_arrive_tx(full_v(s), C::KV_BYTES);
                    for (int cb = 0; cb < DB; cb++)
                        tma_load_3d(sV + s * C::KV_BYTES + cb * BN * 128, &tmV, cb * 64, hk, row, full_v(s));
                }
                if (!loaded) next = load_q(k + 1);
                cur = next;
            }
        }
        return;
    }

    setmaxnreg_inc<232>();
    const int w = wg - 1, tid = threadIdx.x & 127, v = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    /* With PINGPONG the consumers take turns (sm90.cuh: Turns) at both
     * issue points of a tile, S and dP, then dQ: 0's S, dP; 1's S, dP; 0's
     * dQ; 1's dQ; ..., so one's exponentials and dS run while the other's
     * products keep the tensor cores busy. */
    Turns<C::NC, 4, PINGPONG> turn{w};
    turn.open();
    int tiles = 0;
    for (int k = 0, u = 0;; k++) {
        const int i = k % QB;
        mbar_wait(full_q(i), (k / QB) & 1);
        const DqItem m = *slot(i);
        if (m.it < 0) break;
        int h, b, q0;
        dq_item_place(m.it, a.H, qtiles, BM, &h, &b, &q0);
        /* this thread's two query rows: 64 w + 16 v + g (+ 8) of the tile */
        int qi[2], qrow[2], qdoc[2];
        float lse2[2], Dv[2];
        const float *qv = qvec(i);
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int c = 64 * w + 16 * v + g + 8 * r;
            qi[r] = q0 + c;
            qrow[r] = reinterpret_cast<const int *>(qv)[c];
            qdoc[r] = reinterpret_cast<const int *>(qv)[BM + c];
            lse2[r] = qv[2 * BM + c];
            Dv[r] = qv[3 * BM + c];
        }
        /* the warp's first query row (rows ascend with the lanes' g, r; -1
         * when it is past the sequence, and then so are the others) */
        const int wqrow = __shfl_sync(0xffffffffu, qrow[0], 0);
        const uint32_t sQi = sQ(i), sOi = sO(i);
        float dq[D / 2];
#pragma unroll
        for (int e = 0; e < D / 2; e++) dq[e] = 0.f;
        for (int t = 0; t < m.nt; t++, u++) {
            const int st = u % KST, par = (u / KST) & 1;
            const uint32_t sKs = sK + st * C::KV_BYTES, sVs = sV + st * C::KV_BYTES;
            float s[BN / 2], dp[BN / 2];
            turn.take();
            mbar_wait(full_k(st), par);
            if (u == 0 && tracer) trace_mark(1);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++)
                wgmma_ss<0, 0>(s, desc_k(sQi, BM, 64 * w, kk), desc_k(sKs, BN, 0, kk), kk > 0);
            wgmma_commit();
            mbar_wait(full_v(st), par);
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++)
                wgmma_ss<0, 0>(dp, desc_k(sOi, BM, 64 * w, kk), desc_k(sVs, BN, 0, kk), kk > 0);
            wgmma_commit();
            turn.pass();
            const int *krow_s = small(st), *kdoc_s = krow_s + BN;
            /* Every key of the tile precedes the warp's first query (its
             * last row, INT_MAX past the sequence, is at most that row) and
             * no document mask: no mask. Most tiles of an item are such. */
            const bool need_mask = a.doc != nullptr || krow_s[BN - 1] > wqrow;
            wgmma_wait<1>();
            fence_regs(s);
            if (need_mask) {
                /* branch-free within (kdoc_s and qdoc are 0 without
                 * documents), the column pair (2 t4, 2 t4 + 1) read as one
                 * 8-byte load */
#pragma unroll
                for (int j = 0; j < BN / 8; j++) {
                    const int c = 8 * j + 2 * t4;
                    const int2 kr = *reinterpret_cast<const int2 *>(krow_s + c),
                               kd = *reinterpret_cast<const int2 *>(kdoc_s + c);
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int r = e >> 1, odd = e & 1;
                        const float p = fast_exp2(fmaf(s[4 * j + e], a.scale_log2, -lse2[r]));
                        const bool vis = ((odd ? kr.y : kr.x) <= qrow[r]) & ((odd ? kd.y : kd.x) == qdoc[r]);
                        s[4 * j + e] = vis ? p : 0.f;
                    }
                }
            } else {
#pragma unroll
                for (int e = 0; e < BN / 2; e++) s[e] = fast_exp2(fmaf(s[e], a.scale_log2, -lse2[(e >> 1) & 1]));
            }
            wgmma_wait<0>();
            fence_regs(dp);
            uint32_t da[BN / 16][4];
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++)
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const int i0 = 8 * kk + 2 * q, r = q & 1;
                    da[kk][q] = pack_bf16(s[i0] * (dp[i0] - Dv[r]), s[i0 + 1] * (dp[i0 + 1] - Dv[r]));
                }
            turn.take();
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BN / 16; kk++) wgmma_rs<1>(dq, da[kk], desc_mn(sKs, BN, 0, kk), 1);
            wgmma_commit();
            turn.pass();
            wgmma_wait<0>();
            fence_regs(dq);
            fence_regs(da);
            __syncwarp();
            if (lane == 0) mbar_arrive(empty(st));
        }
        tiles += m.nt;
        /* acc += scale * dQ in slot order, where float4 k holds (r, c), (r,
         * c + 1), (r + 8, c), (r + 8, c + 1): this thread's pairs of both
         * its rows in one vector reduction, or of the first row alone where
         * the second is past the sequence (none where both are). The next
         * item's Q, dO and first tiles load meanwhile. */
        if (m.nt > 0 && qi[0] < m.qlen) {
            float *acc = a.dq_acc + dq_slot_base(b, h, (q0 >> 6) + w, a.H, D, tps);
            const int nw = attn_nw, rr = 16 * v + g;
            const bool both = qi[1] < m.qlen;
#pragma unroll
            for (int j = 0; j < D / 8; j++) {
                float *p = acc + dq_slot_index(rr, 8 * j + 2 * t4, nw);
                const float x0 = a.scale * dq[4 * j], x1 = a.scale * dq[4 * j + 1];
                if (both)
                    atomic_add_f4(p, make_float4(x0, x1, a.scale * dq[4 * j + 2], a.scale * dq[4 * j + 3]));
                else
                    atomic_add_f2(p, x0, x1);
            }
        }
        /* the item's Q, dO, vectors and slot may be reused */
        __syncwarp();
        if (lane == 0) mbar_arrive(qempty(i));
    }
    turn.close();
    if (tracer) {
        trace_mark(2);
        trace_finish(TRACE_PART2, tiles);
    }
    /* chained (launch.cu): part 1 is this launch's prerequisite; the block
     * ends only after it, so the finish, this launch's dependent, sees
     * part 1's dq terms and partials too (without the chain: no wait) */
    if (threadIdx.x == 128) griddep_wait();
#endif
}

} // namespace

/* ==================================================================== host */

ATTN_TRACE_BINDER(attn_trace_bind_cf_sm90)

/* The consumers' ping-pong turns: off. Since part 2 masks only the tiles
 * that need it, they cost time at every shape timed (docs/BENCHMARKS.md,
 * run 30). ctx->attn_cf_pingpong = 1|2 forces them off|on per context
 * (tests), CF_ATTN_CF_PINGPONG=0|1 per process (timing; read once). */
static bool dq_pingpong(const cf_cuda_ctx *ctx) {
    static const int forced = attn_env_int("CF_ATTN_CF_PINGPONG", 0);
    if (ctx->attn_cf_pingpong == 1 || ctx->attn_cf_pingpong == 2) return ctx->attn_cf_pingpong == 2;
    return forced != 0;
}

/* Blocks of part 2: one per SM (persistent, the default), or one per work
 * item (each still takes items from the queue until it is empty, so a
 * block that ends early may take one that no block has started yet).
 * ctx->attn_cf_grid = 1|2|3 forces items|SMs|four blocks per context
 * (tests), CF_ATTN_CF_PERSIST=0|1 per process (timing; read once). */
static int dq_grid(const cf_cuda_ctx *ctx, int nitems) {
    static const int env = attn_env_int("CF_ATTN_CF_PERSIST", 1);
    if (ctx->attn_cf_grid == 3) return nitems < 4 ? nitems : 4;
    const bool persist = ctx->attn_cf_grid == 1 || ctx->attn_cf_grid == 2 ? ctx->attn_cf_grid == 2 : env != 0;
    return persist && ctx->sm_count < nitems ? ctx->sm_count : nitems;
}

/* the bit of each part-2 variant in ctx->attn_sm90_attr_done */
template <int D, bool PP> static constexpr int dq_variant_bit() {
    return D == 64 ? (PP ? SM90_ATTR_DQ64_TURNS : SM90_ATTR_DQ64) : (PP ? SM90_ATTR_DQ128_TURNS : SM90_ATTR_DQ128);
}

template <int D, bool PP>
static int dq_sm90_launch(cf_cuda_ctx *ctx, const AttnArgs &a, const CUtensorMap *maps, int maxlen, int tps,
                          cudaStream_t st, bool chained) {
    using C = DqSm90<D>;
    const void *fn = (const void *)attn_bwd_dq_sm90_kernel<D, PP>;
    if (!attn_sm90_prepare(ctx, fn, C::SMEM, dq_variant_bit<D, PP>())) return -1;
    int *queue = (int *)cf_cuda_scratch(ctx, CF_SCR_ATTN_SM90_QUEUE, sizeof(int)); /* zeroed by the prep */
    if (!queue) return -1;
    int qtiles = (maxlen + C::BM - 1) / C::BM, nitems = a.H * qtiles * a.B, nw = attn_sm90_bwd_nw(D);
    if (nitems <= 0) return 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(dq_grid(ctx, nitems));
    cfg.blockDim = dim3(C::THREADS);
    cfg.dynamicSmemBytes = C::SMEM;
    cfg.stream = st;
    cudaLaunchAttribute at[1] = {griddep_attr()};
    cfg.attrs = at;
    cfg.numAttrs = chained ? 1 : 0;
    void *args[] = {(void *)&maps[0], (void *)&maps[1], (void *)&maps[2], (void *)&maps[3], (void *)&a,
                    (void *)&tps,     (void *)&nw,      (void *)&queue,   (void *)&nitems,  (void *)&qtiles};
    return CF_CK(ctx, cudaLaunchKernelExC(&cfg, fn, args)) ? 1 : -1;
}

template <int D>
static int dq_sm90(cf_cuda_ctx *ctx, const AttnArgs &a, int nq_rows, int nk_rows, int maxlen, int tps,
                   cudaStream_t st, bool chained) {
    using C = DqSm90<D>;
    CUtensorMap m[4];
    if (!attn_sm90_map_rows(&m[0], a.q, nq_rows, a.H, D, C::BM) ||
        !attn_sm90_map_rows(&m[1], a.dout, nq_rows, a.H, D, C::BM) ||
        !attn_sm90_map_rows(&m[2], a.k, nk_rows, a.Hkv, D, C::BN) ||
        !attn_sm90_map_rows(&m[3], a.v, nk_rows, a.Hkv, D, C::BN))
        return 0;
    return dq_pingpong(ctx) ? dq_sm90_launch<D, true>(ctx, a, m, maxlen, tps, st, chained)
                            : dq_sm90_launch<D, false>(ctx, a, m, maxlen, tps, st, chained);
}

int attn_cf_sm90_prep(cf_cuda_ctx *ctx, const AttnArgs &a, int D, const cf_rows *kept, float *acc, size_t acc_n,
                      int *filt, int *fstart, AttnArgs *p2) {
    if (D != 64 && D != 128) return 0;
    const int n = kept->n, T = a.B * a.S, nf = T - n;
    const size_t rowlen = (size_t)a.Hkv * D;
    bf16 *kf = NULL, *vf = NULL;
    int *queue = (int *)cf_cuda_scratch(ctx, CF_SCR_ATTN_SM90_QUEUE, sizeof(int)); /* part 2's, zeroed here */
    if (!queue) return -1;
    if (nf > 0) { /* the filtered keys' K and V rows, compacted for the copy engine */
        kf = (bf16 *)cf_cuda_scratch(ctx, CF_SCR_ATTN_SM90_KF, (size_t)nf * rowlen * sizeof(bf16));
        vf = (bf16 *)cf_cuda_scratch(ctx, CF_SCR_ATTN_SM90_VF, (size_t)nf * rowlen * sizeof(bf16));
        if (!kf || !vf) return -1;
    }
    CfPrep p;
    p.dout = a.dout;
    p.o = a.o;
    p.Dvec = (float *)a.Dvec;
    p.zero = acc;
    p.nzero = acc_n;
    p.nrows = n * a.H;
    p.D = D;
    p.nr = (int)(((size_t)(nf > 0 ? nf : 1) * 32 + 255) / 256); /* a warp per filtered row; one block at least (fstart) */
    p.rows = kept->rows;
    p.seq_start = kept->seq_start;
    p.n = n;
    p.nf = nf;
    p.B = a.B;
    p.S = a.S;
    p.filt = filt;
    p.fstart = fstart;
    p.k = a.k;
    p.v = a.v;
    p.kf = kf;
    p.vf = vf;
    p.rowlen = (int)rowlen;
    p.queue = queue;
    p.rpw = attn_prep_rows_per_warp(D, a.dout, a.o);
    const int np = (int)((((size_t)p.nrows + p.rpw - 1) / p.rpw * 32 + 255) / 256);
    cf_prep_kernel<<<p.nr + np, 256, 0, ctx->stream>>>(p);
    if (!CF_CK_LAUNCH(ctx, "attention sm90 centrifuge prep")) return -1;
    *p2 = a;
    p2->kstart = fstart;
    p2->krow = filt;
    p2->dq_acc = acc;
    if (nf > 0) {
        p2->k = kf;
        p2->v = vf;
    }
    return 1;
}

int attn_bwd_dq_sm90(cf_cuda_ctx *ctx, const AttnArgs &p, int D, int nq_rows, int nf, int maxlen, int tps,
                     cudaStream_t st, bool chained) {
    if (D != 64 && D != 128) return 0;
    if (nf <= 0) return 1; /* no filtered key anywhere: nothing to add */
    return D == 64 ? dq_sm90<64>(ctx, p, nq_rows, nf, maxlen, tps, st, chained)
                   : dq_sm90<128>(ctx, p, nq_rows, nf, maxlen, tps, st, chained);
}
