/*
 * attention/fwd.cu — the forward kernel: one block per (query head, 64-query
 * tile, sequence) walks the key tiles its queries can see with an online
 * softmax (notation and index spaces: common.cuh). Also the kept-only
 * forward of the strawman backward (q and k side = the kept rows).
 */
#include "backend/cuda/attention/common.cuh"

/* ================================================================ forward */

template <int D>
constexpr size_t fwd_smem_bytes() {
    constexpr int NB = AttnCfg<D>::FWD_NBUF;
    return (size_t)(TILE + 2 * NB * TILE) * (D + 8) * sizeof(bf16) + 2 * NB * TILE * sizeof(int);
}

/* grid (H, q tiles, B); the last q tiles (most keys) are scheduled first. */
template <int D>
static __global__ void __launch_bounds__(NTHREADS, AttnCfg<D>::FWD_MINB) attn_fwd_kernel(const AttnArgs a) {
    constexpr int LD = D + 8, CH = D / 8, NB = AttnCfg<D>::FWD_NBUF;
    extern __shared__ __align__(128) unsigned char smem[];
    bf16 *Qs = (bf16 *)smem;            /* [64][LD]     */
    bf16 *Ks = Qs + TILE * LD;          /* [NB][64][LD] */
    bf16 *Vs = Ks + NB * TILE * LD;     /* [NB][64][LD] */
    int *krow_s = (int *)(Vs + NB * TILE * LD); /* [NB][64] */
    int *kdoc_s = krow_s + NB * TILE;           /* [NB][64] */

    const int h = blockIdx.x, b = blockIdx.z;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * TILE;
    const int qs = seq_begin(a.qstart, b, a.S), qlen = seq_begin(a.qstart, b + 1, a.S) - qs;
    if (q0 >= qlen) return;
    const int ks = seq_begin(a.kstart, b, a.S), klen = seq_begin(a.kstart, b + 1, a.S) - ks;
    const int hk = h / (a.H / a.Hkv);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const size_t qstr = (size_t)a.H * D;
    const int qn = min(TILE, qlen - q0);

    for (int c = tid; c < TILE * CH; c += NTHREADS) {
        int r = c / CH, col = (c % CH) * 8;
        const bf16 *src = a.q + (size_t)(qs + q0 + min(r, qn - 1)) * qstr + (size_t)h * D + col;
        cp_async16(Qs + r * LD + col, src, r < qn ? 16 : 0);
    }
    cp_async_commit();

    /* keys needed: those with row <= the last query's row */
    const int nkeys = count_le(a.krow, ks, klen, row_of(a.qrow, qs + q0 + qn - 1));
    const int ntiles = (nkeys + TILE - 1) / TILE;
    if (ntiles > 0) load_kv_tile<D>(a, Ks, Vs, krow_s, kdoc_s, ks, klen, 0, hk);
    cp_async_commit();

    /* this thread's two query rows: warp*16 + g and + 8 */
    int qi[2], qrow[2], qdoc[2];
    for (int r = 0; r < 2; r++) {
        qi[r] = q0 + warp * 16 + g + 8 * r;
        qrow[r] = qi[r] < qlen ? row_of(a.qrow, qs + qi[r]) : -1;
        qdoc[r] = (a.doc && qi[r] < qlen) ? a.doc[qrow[r]] : 0;
    }
    const int wq0 = q0 + warp * 16;
    const int warp_qrow_min = wq0 < qlen ? row_of(a.qrow, qs + wq0) : -1;

    cp_async_wait<1>();
    __syncthreads();
    const int offx = ldsm_off_x(lane, LD), offy = ldsm_off_y(lane, LD);
    uint32_t qf[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) ldsm_x4(qf[kk], Qs + warp * 16 * LD + kk * 16 + offx);

    float o[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.f, 0.f};

    for (int kt = 0; kt < ntiles; kt++) {
        const int buf = NB == 2 ? kt & 1 : 0;
        if (NB == 2) {
            if (kt + 1 < ntiles)
                load_kv_tile<D>(a, Ks + (buf ^ 1) * TILE * LD, Vs + (buf ^ 1) * TILE * LD,
                                krow_s + (buf ^ 1) * TILE, kdoc_s + (buf ^ 1) * TILE, ks, klen,
                                (kt + 1) * TILE, hk);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>(); /* tile kt, issued at the end of the last step */
        }
        __syncthreads();
        const bf16 *Kb = Ks + buf * TILE * LD, *Vb = Vs + buf * TILE * LD;
        const int *krb = krow_s + buf * TILE, *kdb = kdoc_s + buf * TILE;

        /* S = Q K^T  (16 x 64 per warp) */
        float s[TILE / 8][4];
#pragma unroll
        for (int i = 0; i < TILE / 8; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
#pragma unroll
            for (int np = 0; np < TILE / 16; np++) {
                uint32_t bb[4];
                ldsm_x4(bb, Kb + np * 16 * LD + kk * 16 + offy);
                mma16816(s[2 * np], qf[kk], bb[0], bb[1]);
                mma16816(s[2 * np + 1], qf[kk], bb[2], bb[3]);
            }
        }
        /* mask: only tiles that reach past this warp's first row, tails, docs */
        const bool need_mask = a.doc != nullptr || kt * TILE + TILE > klen || krb[TILE - 1] > warp_qrow_min;
        if (need_mask) {
#pragma unroll
            for (int nt = 0; nt < TILE / 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int c = nt * 8 + 2 * t4 + (e & 1), r = e >> 1;
                    bool vis = krb[c] <= qrow[r] && (!a.doc || kdb[c] == qdoc[r]);
                    if (!vis) s[nt][e] = -INFINITY;
                }
        }
        /* online softmax in log2 units: m = running max of scale*log2e*s */
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float mx = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < TILE / 8; nt++) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mnew = fmaxf(mrow[r], mx * a.scale_log2);
            const float mbase = mnew == -INFINITY ? 0.f : mnew; /* row fully masked so far */
            const float alpha = fast_exp2(mrow[r] - mbase);
            mrow[r] = mnew;
            lrow[r] *= alpha;
#pragma unroll
            for (int nt = 0; nt < D / 8; nt++) {
                o[nt][2 * r] *= alpha;
                o[nt][2 * r + 1] *= alpha;
            }
#pragma unroll
            for (int nt = 0; nt < TILE / 8; nt++) {
                float p0 = fast_exp2(fmaf(s[nt][2 * r], a.scale_log2, -mbase));
                float p1 = fast_exp2(fmaf(s[nt][2 * r + 1], a.scale_log2, -mbase));
                s[nt][2 * r] = p0;
                s[nt][2 * r + 1] = p1;
                lrow[r] += p0 + p1;
            }
        }
        /* O += P V: the C fragments of two adjacent n-tiles of P are the A
         * fragment of one k-step. */
#pragma unroll
        for (int kk = 0; kk < TILE / 16; kk++) {
            uint32_t pa[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                              pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int np = 0; np < D / 16; np++) {
                uint32_t bb[4];
                ldsm_x4_t(bb, Vb + kk * 16 * LD + np * 16 + offx);
                mma16816(o[2 * np], pa, bb[0], bb[1]);
                mma16816(o[2 * np + 1], pa, bb[2], bb[3]);
            }
        }
        __syncthreads();
        if (NB == 1 && kt + 1 < ntiles) {
            load_kv_tile<D>(a, Ks, Vs, krow_s, kdoc_s, ks, klen, (kt + 1) * TILE, hk);
            cp_async_commit();
        }
    }

#pragma unroll
    for (int r = 0; r < 2; r++) {
        float lt = lrow[r];
        lt += __shfl_xor_sync(0xffffffffu, lt, 1);
        lt += __shfl_xor_sync(0xffffffffu, lt, 2);
        if (qi[r] < qlen) {
            const float inv = lt > 0.f ? 1.f / lt : 0.f;
            bf16 *dst = a.out + (size_t)(qs + qi[r]) * qstr + (size_t)h * D + 2 * t4;
#pragma unroll
            for (int nt = 0; nt < D / 8; nt++)
                *reinterpret_cast<__nv_bfloat162 *>(dst + nt * 8) =
                    __floats2bfloat162_rn(o[nt][2 * r] * inv, o[nt][2 * r + 1] * inv);
            if (t4 == 0) a.lse_out[(size_t)(qs + qi[r]) * a.H + h] = (mrow[r] + log2f(lt)) * LN2_F;
        }
    }
}

template <int D>
static AttnKernel fwd_entry() {
    return AttnKernel{(const void *)attn_fwd_kernel<D>, fwd_smem_bytes<D>()};
}
AttnKernel attn_fwd_kernel_for(int D) { CF_ATTN_DISPATCH(D, fwd_entry) }
