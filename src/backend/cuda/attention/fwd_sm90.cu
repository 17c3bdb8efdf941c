/*
 * attention/fwd_sm90.cu — the Hopper forward (sm_90a): the same function as
 * fwd.cu (notation: common.cuh) for the all-rows case (q side = k side =
 * every row of each sequence), with warpgroup matrix products fed by the
 * copy engine. Layouts, fragments and ordering rules: sm90.cuh.
 *
 * A block owns BM = 64 * NC queries of one head and one sequence (NC = 2
 * consumer warpgroups, or 3 at head dim 64 on large grids: fwd_wg64) and
 * walks the key tiles (BN keys) they can see:
 *   warpgroup 0 (producer): one thread issues TMA loads of the Q tile once
 *     and of K, V into a ring of KST stages. K and V of a stage complete on
 *     separate mbarriers (full_k, full_v), so that S = Q K^T can start
 *     before V has landed, and are released separately (empty_k, empty_v):
 *     K_t as soon as the softmax of S_t is done, V_t after P_t V_t, one
 *     step later. With one release for both, K_{t+1} could only be loaded
 *     once P_{t-1} V_{t-1} was done, at the end of step t, and step t + 1
 *     waited for it: 13% (D = 64) and 22% (D = 128) of the stall samples,
 *     about 2% after (run 23). With a
 *     document mask, warp 1 stores the document ids of the stage's keys
 *     (ordinary loads; K's mbarrier also waits for its 32 arrivals; they
 *     are read by the softmax, so they go with K). It keeps 40 registers
 *     (24 with three consumers).
 *   warpgroups 1..NC (consumers, 232 registers, 160 with three; that costs
 *     about 24 bytes of spills): warpgroup w owns queries
 *     64w..64w+63 of the block. Per key tile t:
 *       S_t = Q K_t^T          wgmma, A = Q and B = K from shared memory
 *       O  += P_{t-1} V_{t-1}  wgmma, A = P in registers, B = V (MN-major)
 *     are issued back to back; the softmax of S_t (mask, running max m,
 *     P_t = exp2(x - m), row sums) runs while the P V product is still in
 *     flight, and only the rescale of O by exp2(m_old - m_new) waits for it
 *     (the overlap of FlashAttention-3's "intra-warpgroup pipelining").
 * The epilogue divides O by the row sum and writes out (bf16) and
 * lse = (m + log2 l) ln 2 straight from the accumulator fragments.
 *
 * Scores and probabilities are in log2 units as in fwd.cu: x = s * scale *
 * log2(e), so P = exp2(x - m). A row that sees no key so far keeps m = -inf
 * and uses 0 as its base.
 */
#include "backend/cuda/attention/sm90.cuh"

template <int D, int NC_> struct FwdSm90 {
    static constexpr int NC = NC_;       /* consumer warpgroups           */
    static constexpr int BM = 64 * NC;   /* queries per block             */
    /* registers after setmaxnreg: 128 x PREGS + 128 NC x CREGS <= 64K */
    static constexpr int PREGS = NC == 3 ? 24 : 40, CREGS = NC == 3 ? 160 : 232;
    static_assert(128 * PREGS + 128 * NC * CREGS <= 65536, "setmaxnreg.inc would wait forever");
    static constexpr int BN = 128;       /* keys per tile                 */
    static constexpr int KST = 2;        /* stages of the K/V ring        */
    static constexpr int THREADS = 128 * (NC + 1);
    static constexpr uint32_t Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2, DOC_BYTES = BN * 4;
    /* offsets from the 1024-aligned base */
    static constexpr uint32_t OFF_Q = 0, OFF_K = Q_BYTES, OFF_V = OFF_K + KST * KV_BYTES,
                              OFF_DOC = OFF_V + KST * KV_BYTES, OFF_BAR = OFF_DOC + KST * DOC_BYTES;
    /* barriers: full_q, full_k[KST], full_v[KST], empty_k[KST], empty_v[KST] */
    static constexpr uint32_t SMEM = OFF_BAR + 8 * (1 + 4 * KST) + 1024; /* + alignment slack */
};

namespace {

template <int D, int NC, bool PINGPONG>
__global__ void __launch_bounds__(FwdSm90<D, NC>::THREADS, 1)
    attn_fwd_sm90_kernel(const __grid_constant__ CUtensorMap tmQ, const __grid_constant__ CUtensorMap tmK,
                         const __grid_constant__ CUtensorMap tmV, const AttnArgs a) {
#if CF_SM90A_PATH
    using C = FwdSm90<D, NC>;
    constexpr int BM = C::BM, BN = C::BN, KST = C::KST, DB = D / 64;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    unsigned char *sbase = smem_raw + (base - smem_u32(smem_raw));
    const uint32_t sQ = base + C::OFF_Q, sK = base + C::OFF_K, sV = base + C::OFF_V;
    const int *kdoc_s = reinterpret_cast<const int *>(sbase + C::OFF_DOC);
    const uint32_t bar = base + C::OFF_BAR;
    const uint32_t full_q = bar;
    auto full_k = [&](int s) { return bar + 8 * (1 + s); };
    auto full_v = [&](int s) { return bar + 8 * (1 + KST + s); };
    auto empty_k = [&](int s) { return bar + 8 * (1 + 2 * KST + s); };
    auto empty_v = [&](int s) { return bar + 8 * (1 + 3 * KST + s); };

    const int h = blockIdx.x, b = blockIdx.z;
    /* Tiles end at qlen, qlen - BM, ...: the last queries (most keys) go
     * first, and where BM does not divide qlen the short tile is the first
     * one (fewest keys), not the last: at BM = 192, S = 4096 a 64-row last
     * tile would walk all 4096 keys with two of its three consumers idle. */
    const int qs = b * a.S, qlen = a.S, ks = qs, klen = a.S;
    const int qhi = qlen - (int)blockIdx.y * BM; /* past this block's last query */
    if (qhi <= 0) return;
    const int q0 = max(0, qhi - BM);
    const int hk = h / (a.H / a.Hkv);
    const int nkeys = min(klen, qhi); /* causal: keys up to the last query */
    const int nt = (nkeys + BN - 1) / BN;

    if (threadIdx.x == 0) {
        mbar_init(full_q, 1);
        for (int s = 0; s < KST; s++) {
            mbar_init(full_k(s), a.doc ? 1 + 32 : 1); /* + warp 1's arrivals with the doc ids */
            mbar_init(full_v(s), 1);
            mbar_init(empty_k(s), 4 * C::NC); /* one arrival per consumer warp */
            mbar_init(empty_v(s), 4 * C::NC);
        }
        mbar_init_fence();
    }
    __syncthreads();

    const int wg = threadIdx.x >> 7;
    if (wg == 0) {
        /* ---------------------------------------------------- producer */
        setmaxnreg_dec<C::PREGS>();
        if (threadIdx.x == 0) {
            mbar_arrive_tx(full_q, C::Q_BYTES);
            for (int cb = 0; cb < DB; cb++) tma_load_3d(sQ + cb * BM * 128, &tmQ, cb * 64, h, qs + q0, full_q);
            for (int t = 0; t < nt; t++) {
                const int s = t % KST, n = t / KST;
                if (n > 0) mbar_wait(empty_k(s), (n - 1) & 1);
                const int row = ks + t * BN;
                mbar_arrive_tx(full_k(s), C::KV_BYTES);
                for (int cb = 0; cb < DB; cb++)
                    tma_load_3d(sK + s * C::KV_BYTES + cb * BN * 128, &tmK, cb * 64, hk, row, full_k(s));
                if (n > 0) mbar_wait(empty_v(s), (n - 1) & 1);
                mbar_arrive_tx(full_v(s), C::KV_BYTES);
                for (int cb = 0; cb < DB; cb++)
                    tma_load_3d(sV + s * C::KV_BYTES + cb * BN * 128, &tmV, cb * 64, hk, row, full_v(s));
            }
        } else if (a.doc && (threadIdx.x >> 5) == 1) {
            /* warp 1: the document ids of the keys of each stage, by
             * ordinary loads (a TMA box of ints must start 16-byte aligned,
             * which a sequence start need not be) */
            const int lane = threadIdx.x & 31;
            int *kd = reinterpret_cast<int *>(sbase + C::OFF_DOC);
            for (int t = 0; t < nt; t++) {
                const int s = t % KST, n = t / KST;
                if (n > 0) mbar_wait(empty_k(s), (n - 1) & 1);
                for (int c = lane; c < BN; c += 32) {
                    const int j = t * BN + c;
                    kd[s * BN + c] = j < klen ? a.doc[ks + j] : 0;
                }
                mbar_arrive(full_k(s));
            }
        }
        return;
    }

    /* ------------------------------------------------------- consumers */
    setmaxnreg_inc<C::CREGS>();
    const int w = wg - 1, tid = threadIdx.x & 127, v = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int wq0 = q0 + 64 * w + 16 * v; /* this warp's first query */
    int qi[2], qdoc[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        qi[r] = wq0 + g + 8 * r;
        qdoc[r] = (a.doc && qi[r] < qhi) ? a.doc[qs + qi[r]] : 0;
    }

    float o[D / 2], s[BN / 2];
    uint32_t p[BN / 16][4];
#pragma unroll
    for (int i = 0; i < D / 2; i++) o[i] = 0.f;
#pragma unroll
    for (int i = 0; i < BN / 2; i++) s[i] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

    auto issue_s = [&](int st) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
            wgmma_ss<0, 0>(s, desc_k(sQ, BM, 64 * w, kk), desc_k(sK + st * C::KV_BYTES, BN, 0, kk), kk > 0);
        wgmma_commit();
    };
    auto issue_pv = [&](int st) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) wgmma_rs<1>(o, p[kk], desc_mn(sV + st * C::KV_BYTES, BN, 0, kk), 1);
        wgmma_commit();
    };
    /* mask and exponentiate S_t in place; returns the rescale factor of
     * each row's old O and l */
    auto softmax = [&](int t, int st, float alpha[2]) {
        const int k0 = t * BN;
        const bool need_mask = a.doc != nullptr || k0 + BN > klen || k0 + BN - 1 > wq0;
        if (need_mask) {
            const int *kd = kdoc_s + st * BN;
#pragma unroll
            for (int j = 0; j < BN / 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int c = 8 * j + 2 * t4 + (e & 1), r = e >> 1, kj = k0 + c;
                    const bool vis = kj <= qi[r] && kj < klen && (!a.doc || kd[c] == qdoc[r]);
                    if (!vis) s[4 * j + e] = -INFINITY;
                }
        }
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float mx = -INFINITY;
#pragma unroll
            for (int j = 0; j < BN / 8; j++) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mnew = fmaxf(m[r], mx * a.scale_log2);
            const float mbase = mnew == -INFINITY ? 0.f : mnew;
            alpha[r] = fast_exp2(m[r] - mbase);
            m[r] = mnew;
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < BN / 8; j++) {
                const float p0 = fast_exp2(fmaf(s[4 * j + 2 * r], a.scale_log2, -mbase));
                const float p1 = fast_exp2(fmaf(s[4 * j + 2 * r + 1], a.scale_log2, -mbase));
                s[4 * j + 2 * r] = p0;
                s[4 * j + 2 * r + 1] = p1;
                sum += p0 + p1;
            }
            l[r] = l[r] * alpha[r] + sum;
        }
    };
    auto pack_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            p[kk][0] = pack_bf16(s[8 * kk + 0], s[8 * kk + 1]);
            p[kk][1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
            p[kk][2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
            p[kk][3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
        }
    };

    /* one arrival per warp on a stage's release barrier */
    auto release = [&](uint32_t empty) {
        __syncwarp();
        if (lane == 0) mbar_arrive(empty);
    };

    /* With PINGPONG the two consumers take turns to issue their products
     * (sm90.cuh: Turns), so one's softmax runs while the other's products
     * keep the tensor cores busy (FlashAttention-3's inter-warpgroup
     * overlap): 0.220 -> 0.205 ms at S = 4096, D = 64, 0.317 -> 0.301 at
     * D = 128 (H100, run 22). */
    Turns<C::NC, 4, PINGPONG> turn{w};
    turn.open();

    mbar_wait(full_q, 0);
    float alpha[2];
    turn.take();
    mbar_wait(full_k(0), 0);
    issue_s(0);
    turn.pass();
    wgmma_wait<0>();
    fence_regs(s);
    softmax(0, 0, alpha);
    release(empty_k(0));
    pack_p();
    for (int t = 1; t < nt; t++) {
        const int st = t % KST, sp = (t - 1) % KST;
        turn.take();
        mbar_wait(full_k(st), (t / KST) & 1);
        issue_s(st);
        mbar_wait(full_v(sp), ((t - 1) / KST) & 1);
        issue_pv(sp);
        turn.pass();
        wgmma_wait<1>(); /* S_t done, P V may still run */
        fence_regs(s);
        softmax(t, st, alpha);
        release(empty_k(st));
        wgmma_wait<0>();
        fence_regs(o);
        release(empty_v(sp));
#pragma unroll
        for (int j = 0; j < D / 8; j++) {
            o[4 * j + 0] *= alpha[0];
            o[4 * j + 1] *= alpha[0];
            o[4 * j + 2] *= alpha[1];
            o[4 * j + 3] *= alpha[1];
        }
        pack_p();
    }
    {
        const int sp = (nt - 1) % KST;
        turn.take();
        mbar_wait(full_v(sp), ((nt - 1) / KST) & 1);
        issue_pv(sp);
        turn.pass();
        wgmma_wait<0>();
        fence_regs(o);
        turn.close();
    }

    const size_t qstr = (size_t)a.H * D;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float lt = l[r];
        lt += __shfl_xor_sync(0xffffffffu, lt, 1);
        lt += __shfl_xor_sync(0xffffffffu, lt, 2);
        if (qi[r] < qhi) { /* rows past qhi are the next tile's */
            const float inv = lt > 0.f ? 1.f / lt : 0.f;
            bf16 *dst = a.out + (size_t)(qs + qi[r]) * qstr + (size_t)h * D + 2 * t4;
#pragma unroll
            for (int j = 0; j < D / 8; j++)
                *reinterpret_cast<__nv_bfloat162 *>(dst + 8 * j) =
                    __floats2bfloat162_rn(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
            if (t4 == 0) a.lse_out[(size_t)(qs + qi[r]) * a.H + h] = (m[r] + log2f(lt)) * LN2_F;
        }
    }
#endif
}

} // namespace

/* ==================================================================== host */

/* The consumers' ping-pong turns, on unless CF_ATTN_FWD_PINGPONG=0 (for
 * timing; read once). */
static bool fwd_pingpong() {
    static const bool on = attn_env_int("CF_ATTN_FWD_PINGPONG", 1) != 0;
    return on;
}

/* Consumer warpgroups at head dim 64, as FlashAttention-3 has them: three
 * (192 queries per block) where their grid is at least five waves, else
 * two. With three, each scheduler has three consumer warps to pick from
 * while one waits for its products or its exponentials, and the tensor pipe
 * is busier; but blocks are half as long again, and a small causal grid
 * ends in a longer tail. H100, run 29 (ms, 32 heads, 4 kv heads, B = 1):
 * S = 8192 0.645 -> 0.580 (1376 blocks), S = 4096 0.191 -> 0.180 (704),
 * S = 2048 0.064 -> 0.067 (352); on an H200 16 heads at S = 4096 (352
 * blocks) tied. ctx->attn_fwd_wg = 2|3 forces it per context (tests),
 * CF_ATTN_FWD_WG=2|3 per process (timing; read once). */
static int fwd_wg64(const cf_cuda_ctx *ctx, const AttnArgs &a) {
    static const int forced = attn_env_int("CF_ATTN_FWD_WG", 0);
    if (ctx->attn_fwd_wg == 2 || ctx->attn_fwd_wg == 3) return ctx->attn_fwd_wg;
    if (forced == 2 || forced == 3) return forced;
    constexpr int BM3 = FwdSm90<64, 3>::BM;
    const long long blocks = (long long)a.B * a.H * ((a.S + BM3 - 1) / BM3);
    return blocks >= 5LL * ctx->sm_count ? 3 : 2;
}

template <int D, int NC> static int fwd_sm90_launch(cf_cuda_ctx *ctx, const AttnArgs &a) {
    using C = FwdSm90<D, NC>;
    const int T = a.B * a.S;
    CUtensorMap mq, mk, mv;
    if (!attn_sm90_map_rows(&mq, a.q, T, a.H, D, C::BM) || !attn_sm90_map_rows(&mk, a.k, T, a.Hkv, D, C::BN) ||
        !attn_sm90_map_rows(&mv, a.v, T, a.Hkv, D, C::BN))
        return 0;
    /* one ping-pong variant per process (the switch is read once): one
     * attribute bit per head dim and consumer count */
    const void *fn = fwd_pingpong() ? (const void *)attn_fwd_sm90_kernel<D, NC, true>
                                    : (const void *)attn_fwd_sm90_kernel<D, NC, false>;
    if (!attn_sm90_prepare(ctx, fn, C::SMEM,
                           D == 128 ? SM90_ATTR_FWD128 : NC == 3 ? SM90_ATTR_FWD64_WG3 : SM90_ATTR_FWD64)) return -1;
    dim3 grid(a.H, (a.S + C::BM - 1) / C::BM, a.B), block(C::THREADS);
    void *args[] = {(void *)&mq, (void *)&mk, (void *)&mv, (void *)&a};
    return CF_CK(ctx, cudaLaunchKernel(fn, grid, block, args, C::SMEM, ctx->stream)) ? 1 : -1;
}

int attn_fwd_sm90(cf_cuda_ctx *ctx, const AttnArgs &a, int D) {
    if (a.qstart || a.kstart || a.qrow || a.krow) return 0; /* all rows only */
    if (D == 64) return fwd_wg64(ctx, a) == 3 ? fwd_sm90_launch<64, 3>(ctx, a) : fwd_sm90_launch<64, 2>(ctx, a);
    if (D == 128) return fwd_sm90_launch<128, 2>(ctx, a);
    return 0;
}
