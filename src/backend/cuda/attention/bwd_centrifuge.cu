/*
 * attention/bwd_centrifuge.cu — the part of the centrifuge backward that the
 * other modes do not have (notation and index spaces: common.cuh). Part 1
 * (bwd.cu's kernel on the kept rows, q side and k side) gives dk, dv of the
 * kept keys and the kept-key terms of dq; part 2 here adds the terms of the
 * filtered keys to dq: the filtered rows are listed (filtered_rows_kernel)
 * and a kernel over the kept queries walks them as its k side.
 */
#include "backend/cuda/attention/common.cuh"

/* ======================================= backward: dq over other keys */

template <int D>
constexpr size_t bwd_dq_smem_bytes() {
    return (size_t)(2 * TILE + 4 * TILE) * (D + 8) * sizeof(bf16) + 4 * TILE * sizeof(int);
}

/*
 * Centrifuge part 2. grid (H, q tiles, B). A block owns 64 queries (warp w:
 * 16 of them, with q and dO fragments in registers) and walks the k-side
 * tiles (the filtered keys) that precede its last query:
 *   S = Q K^T, dP = dO V^T, P = exp(x - lse), dS = P (dP - D), dQ += dS K
 * then writes dq = dq_acc (part 1) + scale * dQ in bf16. With no k-side keys
 * it only converts dq_acc.
 */
template <int D>
static __global__ void __launch_bounds__(NTHREADS) attn_bwd_dq_kernel(const AttnArgs a) {
    constexpr int LD = D + 8, CH = D / 8;
    extern __shared__ __align__(128) unsigned char smem[];
    bf16 *Qs = (bf16 *)smem;           /* [64][LD] */
    bf16 *dOs = Qs + TILE * LD;        /* [64][LD] */
    bf16 *Ks = dOs + TILE * LD;        /* [2][64][LD] */
    bf16 *Vs = Ks + 2 * TILE * LD;     /* [2][64][LD] */
    int *krow_s = (int *)(Vs + 2 * TILE * LD);
    int *kdoc_s = krow_s + 2 * TILE;

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
        size_t off = (size_t)(qs + q0 + min(r, qn - 1)) * qstr + (size_t)h * D + col;
        cp_async16(Qs + r * LD + col, a.q + off, r < qn ? 16 : 0);
        cp_async16(dOs + r * LD + col, a.dout + off, r < qn ? 16 : 0);
    }
    cp_async_commit();
    const int nkeys = count_le(a.krow, ks, klen, row_of(a.qrow, qs + q0 + qn - 1));
    const int ntiles = (nkeys + TILE - 1) / TILE;
    if (ntiles > 0) load_kv_tile<D>(a, Ks, Vs, krow_s, kdoc_s, ks, klen, 0, hk);
    cp_async_commit();

    int qi[2], qrow[2], qdoc[2];
    float lse2[2], Dv[2];
    for (int r = 0; r < 2; r++) {
        qi[r] = q0 + warp * 16 + g + 8 * r;
        const bool ok = qi[r] < qlen;
        const size_t idx = (size_t)(qs + (ok ? qi[r] : 0)) * a.H + h;
        qrow[r] = ok ? row_of(a.qrow, qs + qi[r]) : -1;
        qdoc[r] = (ok && a.doc) ? a.doc[qrow[r]] : 0;
        lse2[r] = ok ? a.lse[idx] * LOG2E_F : 0.f;
        Dv[r] = ok ? a.Dvec[idx] : 0.f;
    }
    const int wq0 = q0 + warp * 16;
    const int warp_qrow_min = wq0 < qlen ? row_of(a.qrow, qs + wq0) : -1;

    cp_async_wait<1>();
    __syncthreads();
    const int offx = ldsm_off_x(lane, LD), offy = ldsm_off_y(lane, LD);
    uint32_t qf[D / 16][4], of[D / 16][4];
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        ldsm_x4(qf[kk], Qs + warp * 16 * LD + kk * 16 + offx);
        ldsm_x4(of[kk], dOs + warp * 16 * LD + kk * 16 + offx);
    }
    float dqa[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; i++) dqa[i][0] = dqa[i][1] = dqa[i][2] = dqa[i][3] = 0.f;

    for (int kt = 0; kt < ntiles; kt++) {
        const int buf = kt & 1;
        if (kt + 1 < ntiles)
            load_kv_tile<D>(a, Ks + (buf ^ 1) * TILE * LD, Vs + (buf ^ 1) * TILE * LD,
                            krow_s + (buf ^ 1) * TILE, kdoc_s + (buf ^ 1) * TILE, ks, klen,
                            (kt + 1) * TILE, hk);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const bf16 *Kb = Ks + buf * TILE * LD, *Vb = Vs + buf * TILE * LD;
        const int *krb = krow_s + buf * TILE, *kdb = kdoc_s + buf * TILE;

        float s[TILE / 8][4], dp[TILE / 8][4];
#pragma unroll
        for (int i = 0; i < TILE / 8; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[i][e] = dp[i][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
#pragma unroll
            for (int np = 0; np < TILE / 16; np++) {
                uint32_t bk[4], bv[4];
                ldsm_x4(bk, Kb + np * 16 * LD + kk * 16 + offy);
                ldsm_x4(bv, Vb + np * 16 * LD + kk * 16 + offy);
                mma16816(s[2 * np], qf[kk], bk[0], bk[1]);
                mma16816(s[2 * np + 1], qf[kk], bk[2], bk[3]);
                mma16816(dp[2 * np], of[kk], bv[0], bv[1]);
                mma16816(dp[2 * np + 1], of[kk], bv[2], bv[3]);
            }
        }
        const bool need_mask = a.doc != nullptr || kt * TILE + TILE > klen || krb[TILE - 1] > warp_qrow_min;
#pragma unroll
        for (int nt = 0; nt < TILE / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int c = nt * 8 + 2 * t4 + (e & 1), r = e >> 1;
                float p = fast_exp2(fmaf(s[nt][e], a.scale_log2, -lse2[r]));
                if (need_mask && !(krb[c] <= qrow[r] && (!a.doc || kdb[c] == qdoc[r]))) p = 0.f;
                s[nt][e] = p * (dp[nt][e] - Dv[r]); /* dS */
            }
#pragma unroll
        for (int kk = 0; kk < TILE / 16; kk++) {
            uint32_t da[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                              pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int np = 0; np < D / 16; np++) {
                uint32_t bk[4];
                ldsm_x4_t(bk, Kb + kk * 16 * LD + np * 16 + offx);
                mma16816(dqa[2 * np], da, bk[0], bk[1]);
                mma16816(dqa[2 * np + 1], da, bk[2], bk[3]);
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (qi[r] >= qlen) continue;
        const size_t base = (size_t)(qs + qi[r]) * qstr + (size_t)h * D + 2 * t4;
#pragma unroll
        for (int nt = 0; nt < D / 8; nt++) {
            float2 acc = *reinterpret_cast<const float2 *>(a.dq_acc + base + nt * 8);
            *reinterpret_cast<__nv_bfloat162 *>(a.dq + base + nt * 8) = __floats2bfloat162_rn(
                acc.x + a.scale * dqa[nt][2 * r], acc.y + a.scale * dqa[nt][2 * r + 1]);
        }
    }
}

/* Filtered rows (the complement of the ascending kept list), ascending:
 * row r with k = #kept rows < r goes to filt[r - k]. fstart[b] = b*S - seq_start[b]. */
static __global__ void filtered_rows_kernel(int *filt, int *fstart, const int *rows, const int *seq_start, int n,
                                     int B, int S) {
    const int T = B * S;
    for (int r = blockIdx.x * blockDim.x + threadIdx.x; r < T; r += gridDim.x * blockDim.x) {
        int lo = 0, hi = n;
        while (lo < hi) {
            int mid = (lo + hi) >> 1;
            if (rows[mid] < r) lo = mid + 1;
            else hi = mid;
        }
        if (!(lo < n && rows[lo] == r)) filt[r - lo] = r;
    }
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= B) fstart[i] = i * S - seq_start[i];
}

/* =================================================================== host */

void attn_filtered_rows(cudaStream_t st, int *filt, int *fstart, const int *rows, const int *seq_start, int n, int B,
                        int S) {
    filtered_rows_kernel<<<attn_grid_for((size_t)CF_MAX(B * S, B + 1)), 256, 0, st>>>(filt, fstart, rows, seq_start,
                                                                                   n, B, S);
}

template <int D>
static AttnKernel bwd_dq_entry() {
    return AttnKernel{(const void *)attn_bwd_dq_kernel<D>, bwd_dq_smem_bytes<D>()};
}
AttnKernel attn_bwd_dq_kernel_for(int D) { CF_ATTN_DISPATCH(D, bwd_dq_entry) }
