/*
 * attention/bwd.cu — the backward kernels shared by every mode (notation and
 * index spaces: common.cuh): the prep pass (D_i, zeroed dq accumulator), the
 * main kernel (dk, dv per key tile in registers, dq by fp32 atomics; the whole
 * FULL and STRAWMAN backward and part 1 of CENTRIFUGE), the dq conversion and
 * the GQA reduction of dk, dv.
 *
 * Speed (one H200, B=1, S=4096, H=32, median of 20, tests/gpu/bench_attention;
 * PyTorch 2.11 SDPA flash in the same session for comparison):
 *   D=64, Hkv=4:  fwd 0.295 ms (233 TFLOP/s; SDPA 0.30-0.31), bwd 0.987 ms
 *                 (174; SDPA 0.91-1.08), centrifuge bwd at keep 0.5: 0.449 ms
 *   D=128, Hkv=8: fwd 0.557 ms (247; SDPA 0.52), bwd 1.85 ms (186; SDPA 1.54-1.74),
 *                 centrifuge 0.795 ms (0.43 x full)
 * dq of FULL and of part 1 is summed with fp32 atomics, so it varies in the
 * last bits run to run; everything else is deterministic.
 *
 * Floors of the FULL backward at that shape (causal half; 790 TFLOP/s dense
 * bf16 by cuBLAS and 4.3 TB/s, both measured on this H200):
 *   D=64:  172 GFLOP -> 0.218 ms; bytes (q, k, v, o, dO read; dq, dk, dv
 *          written; lse, D) ~75 MB -> 0.017 ms. Compute-bound; at 0.987 ms we
 *          run at 22% of the FLOP floor, SDPA flash (FA2, 0.815) at 27%.
 *   D=128: 344 GFLOP -> 0.435 ms; ~150 MB -> 0.035 ms. 1.85 ms = 24%
 *          (SDPA 1.425 = 31%).
 * mma.sync reaches about 2/3 of the wgmma rate, and this kernel's warps
 * (16 keys x 64 queries) issue about 0.58 ldmatrix.x4 per mma (each warp
 * re-reads the whole Q and dO tiles, plainly and transposed), so shared-memory
 * bandwidth, not the dq atomics, looks like the limiter. Measured (H200,
 * medians of 20, two rounds each, same session as SDPA 0.815 / 1.425 ms):
 *   variant                                      D=64 full/cf    D=128 full/cf
 *   this kernel                                  0.987/0.450     1.849/0.796
 *   + skip warps whose keys follow the q tile    1.029/0.459     1.930/0.825
 *     (per-warp branch and a guarded dQ loop cost more than the diagonal
 *     work they save)
 *   128-key blocks, 8 warps (half the atomics;   1.228/0.497     2.025/0.839
 *     D=64: 1 block/SM, 255 regs; D=128: 2 bufs)  (prediction was a gain:
 *     atomics are not the bottleneck; 8 warps/SM and 8-warp barriers lose)
 *   same + K/V fragments kept in registers,      1.197/0.488     1.902/0.815
 *     D=128 1 buffer
 *   same at 2 blocks/SM for D=64 (128 regs)       spills 470 B: not timed
 *   dq in its own pass (no atomics, S and dP     1.111/0.451     1.934/0.730
 *     computed twice; centrifuge: dk/dv on kept x kept, dq of kept queries
 *     over all keys)
 *   both of the last two                         1.260/0.482     2.083/0.777
 * All of these passed the attention tests of test_gpu_ops; none beat this
 * kernel on FULL, so it stays. The dq pass does help centrifuge at D=128
 * (0.730 vs 0.796 ms, 0.39 x full): using it for CENTRIFUGE only, with this
 * kernel for FULL, is the next step, not yet validated on a GPU.
 */
#include "backend/cuda/attention/common.cuh"

/* ================================================ backward: dk, dv (+dq) */

template <int D>
constexpr size_t bwd_smem_bytes() {
    constexpr int NB = AttnCfg<D>::BWD_NBUF;
    return (size_t)(2 * TILE + 2 * NB * TILE) * (D + 8) * sizeof(bf16) +
           (size_t)TILE * (TILE + 8) * sizeof(bf16) + 4 * NB * TILE * sizeof(float);
}

/* D_i and the zeroing of the dq accumulator (common.cuh: attn_prep_body),
 * spread over the whole grid, so the backward needs no memset of its own */
static __global__ void attn_bwd_prep_kernel(const bf16 *dout, const bf16 *o, float *Dvec, float *zero, size_t nzero,
                                            int nrows, int D, int rpw) {
    griddep_trigger(); /* the main kernel may start its prologue (it waits before reading D_i) */
    if (threadIdx.x == 0) trace_mark(0);
    attn_prep_body(dout, o, Dvec, zero, nzero, nrows, D, rpw, blockIdx.x, gridDim.x);
    if (threadIdx.x == 0) trace_finish(TRACE_PREP, 0); /* thread 0's end (trace.cuh) */
}

/*
 * grid (H, k tiles, B). A block owns 64 keys of one query head; warp w owns
 * keys 16w..16w+15 and keeps their dk, dv in registers while it walks the
 * query tiles that can see them. Per query tile (64 queries):
 *   S^T = K Q^T, dP^T = V dO^T          (16 keys x 64 queries per warp)
 *   P^T = exp(x - lse), dS^T = P^T (dP^T - D)
 *   dV += P^T dO, dK += dS^T Q          (registers)
 *   dS^T -> shared, then warp w forms dQ for queries 16w..16w+15 over all
 *   64 keys and adds it to dq_acc with fp32 atomics.
 */
template <int D>
static __global__ void __launch_bounds__(NTHREADS, AttnCfg<D>::BWD_MINB) attn_bwd_kernel(const AttnArgs a) {
    constexpr int LD = D + 8, CH = D / 8, LDS = TILE + 8, NB = AttnCfg<D>::BWD_NBUF;
    extern __shared__ __align__(128) unsigned char smem[];
    bf16 *Ks = (bf16 *)smem;             /* [64][LD]     */
    bf16 *Vs = Ks + TILE * LD;           /* [64][LD]     */
    bf16 *Qs = Vs + TILE * LD;           /* [NB][64][LD] */
    bf16 *dOs = Qs + NB * TILE * LD;     /* [NB][64][LD] */
    bf16 *dSs = dOs + NB * TILE * LD;    /* [64 keys][LDS] */
    float *lse_s = (float *)(dSs + TILE * LDS); /* [NB][64], log2 units */
    float *D_s = lse_s + NB * TILE;             /* [NB][64] */
    int *qrow_s = (int *)(D_s + NB * TILE);     /* [NB][64] */
    int *qdoc_s = qrow_s + NB * TILE;           /* [NB][64] */

    const int h = blockIdx.x, b = blockIdx.z;
    const int k0 = blockIdx.y * TILE;
    const int ks = seq_begin(a.kstart, b, a.S), klen = seq_begin(a.kstart, b + 1, a.S) - ks;
    if (k0 >= klen) return;
    const int qs = seq_begin(a.qstart, b, a.S), qlen = seq_begin(a.qstart, b + 1, a.S) - qs;
    const int hk = h / (a.H / a.Hkv);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const size_t qstr = (size_t)a.H * D, kstr = (size_t)a.Hkv * D;
    const int kn = min(TILE, klen - k0);

    for (int c = tid; c < TILE * CH; c += NTHREADS) {
        int r = c / CH, col = (c % CH) * 8;
        int row = row_of(a.krow, ks + k0 + min(r, kn - 1));
        size_t off = (size_t)row * kstr + (size_t)hk * D + col;
        cp_async16(Ks + r * LD + col, a.k + off, r < kn ? 16 : 0);
        cp_async16(Vs + r * LD + col, a.v + off, r < kn ? 16 : 0);
    }
    cp_async_commit();

    int krow_t[2], kdoc_t[2];
    for (int r = 0; r < 2; r++) {
        int j = k0 + warp * 16 + g + 8 * r;
        krow_t[r] = j < klen ? row_of(a.krow, ks + j) : INT_MAX;
        kdoc_t[r] = (a.doc && j < klen) ? a.doc[krow_t[r]] : 0;
    }
    const int wk0 = k0 + warp * 16;
    const int warp_krow_max = wk0 < klen ? row_of(a.krow, ks + min(wk0 + 15, klen - 1)) : INT_MAX;

    /* query tiles that can see this key tile: from the first query whose row
     * is >= the first key's row, to the end of the sequence */
    const int first = count_le(a.qrow, qs, qlen, row_of(a.krow, ks + k0) - 1);
    const int qt_begin = first / TILE, qt_end = (qlen + TILE - 1) / TILE;

    auto load_q = [&](int qt, int buf) {
        const int i0 = qt * TILE, n = min(TILE, qlen - i0);
        bf16 *Qb = Qs + buf * TILE * LD, *dOb = dOs + buf * TILE * LD;
        for (int c = tid; c < TILE * CH; c += NTHREADS) {
            int r = c / CH, col = (c % CH) * 8;
            size_t off = (size_t)(qs + i0 + min(r, n - 1)) * qstr + (size_t)h * D + col;
            cp_async16(Qb + r * LD + col, a.q + off, r < n ? 16 : 0);
            cp_async16(dOb + r * LD + col, a.dout + off, r < n ? 16 : 0);
        }
        if (tid < TILE) {
            int i = i0 + tid;
            bool ok = tid < n;
            size_t idx = (size_t)(qs + i) * a.H + h;
            int row = ok ? row_of(a.qrow, qs + i) : -1;
            lse_s[buf * TILE + tid] = ok ? a.lse[idx] * LOG2E_F : 0.f;
            D_s[buf * TILE + tid] = ok ? a.Dvec[idx] : 0.f;
            qrow_s[buf * TILE + tid] = row;
            qdoc_s[buf * TILE + tid] = (ok && a.doc) ? a.doc[row] : 0;
        }
    };
    if (qt_begin < qt_end) load_q(qt_begin, 0);
    cp_async_commit();

    const int offx = ldsm_off_x(lane, LD), offy = ldsm_off_y(lane, LD);
    const int offy_s = ldsm_off_y(lane, LDS);
    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) dk[i][e] = dv[i][e] = 0.f;

    for (int qt = qt_begin; qt < qt_end; qt++) {
        const int buf = NB == 2 ? (qt - qt_begin) & 1 : 0;
        if (NB == 2) {
            if (qt + 1 < qt_end) load_q(qt + 1, buf ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>(); /* tile qt, issued at the end of the last step */
        }
        __syncthreads();
        const bf16 *Qb = Qs + buf * TILE * LD, *dOb = dOs + buf * TILE * LD;
        const float *lse_b = lse_s + buf * TILE, *D_b = D_s + buf * TILE;
        const int *qrow_b = qrow_s + buf * TILE, *qdoc_b = qdoc_s + buf * TILE;

        /* S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys */
        float st[TILE / 8][4], dpt[TILE / 8][4];
#pragma unroll
        for (int i = 0; i < TILE / 8; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) st[i][e] = dpt[i][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
            uint32_t ka[4], va[4];
            ldsm_x4(ka, Ks + warp * 16 * LD + kk * 16 + offx);
            ldsm_x4(va, Vs + warp * 16 * LD + kk * 16 + offx);
#pragma unroll
            for (int np = 0; np < TILE / 16; np++) {
                uint32_t bq[4], bo[4];
                ldsm_x4(bq, Qb + np * 16 * LD + kk * 16 + offy);
                ldsm_x4(bo, dOb + np * 16 * LD + kk * 16 + offy);
                mma16816(st[2 * np], ka, bq[0], bq[1]);
                mma16816(st[2 * np + 1], ka, bq[2], bq[3]);
                mma16816(dpt[2 * np], va, bo[0], bo[1]);
                mma16816(dpt[2 * np + 1], va, bo[2], bo[3]);
            }
        }
        const bool need_mask = a.doc != nullptr || qt * TILE + TILE > qlen || kn < TILE ||
                               warp_krow_max > qrow_b[0];
#pragma unroll
        for (int nt = 0; nt < TILE / 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int c = nt * 8 + 2 * t4 + (e & 1), r = e >> 1;
                float p = fast_exp2(fmaf(st[nt][e], a.scale_log2, -lse_b[c]));
                if (need_mask && !(krow_t[r] <= qrow_b[c] && (!a.doc || kdoc_t[r] == qdoc_b[c]))) p = 0.f;
                st[nt][e] = p;
                dpt[nt][e] = p * (dpt[nt][e] - D_b[c]);
            }
        /* dV += P^T dO, dK += dS^T Q (queries are the k dimension) */
#pragma unroll
        for (int kk = 0; kk < TILE / 16; kk++) {
            uint32_t pa[4] = {pack_bf16(st[2 * kk][0], st[2 * kk][1]), pack_bf16(st[2 * kk][2], st[2 * kk][3]),
                              pack_bf16(st[2 * kk + 1][0], st[2 * kk + 1][1]),
                              pack_bf16(st[2 * kk + 1][2], st[2 * kk + 1][3])};
            uint32_t da[4] = {pack_bf16(dpt[2 * kk][0], dpt[2 * kk][1]), pack_bf16(dpt[2 * kk][2], dpt[2 * kk][3]),
                              pack_bf16(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]),
                              pack_bf16(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3])};
#pragma unroll
            for (int np = 0; np < D / 16; np++) {
                uint32_t bo[4], bq[4];
                ldsm_x4_t(bo, dOb + kk * 16 * LD + np * 16 + offx);
                ldsm_x4_t(bq, Qb + kk * 16 * LD + np * 16 + offx);
                mma16816(dv[2 * np], pa, bo[0], bo[1]);
                mma16816(dv[2 * np + 1], pa, bo[2], bo[3]);
                mma16816(dk[2 * np], da, bq[0], bq[1]);
                mma16816(dk[2 * np + 1], da, bq[2], bq[3]);
            }
        }
        /* dS^T -> shared as [key][query] */
#pragma unroll
        for (int nt = 0; nt < TILE / 8; nt++) {
            *reinterpret_cast<uint32_t *>(dSs + (warp * 16 + g) * LDS + nt * 8 + 2 * t4) =
                pack_bf16(dpt[nt][0], dpt[nt][1]);
            *reinterpret_cast<uint32_t *>(dSs + (warp * 16 + g + 8) * LDS + nt * 8 + 2 * t4) =
                pack_bf16(dpt[nt][2], dpt[nt][3]);
        }
        __syncthreads();
        /* dQ (queries 16w..16w+15 of the tile) = dS K over the 64 keys */
        {
            float dqa[D / 8][4];
#pragma unroll
            for (int i = 0; i < D / 8; i++) dqa[i][0] = dqa[i][1] = dqa[i][2] = dqa[i][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < TILE / 16; kk++) {
                uint32_t sa[4];
                ldsm_x4_t(sa, dSs + kk * 16 * LDS + warp * 16 + offy_s);
#pragma unroll
                for (int np = 0; np < D / 16; np++) {
                    uint32_t bk[4];
                    ldsm_x4_t(bk, Ks + kk * 16 * LD + np * 16 + offx);
                    mma16816(dqa[2 * np], sa, bk[0], bk[1]);
                    mma16816(dqa[2 * np + 1], sa, bk[2], bk[3]);
                }
            }
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const int qi = qt * TILE + warp * 16 + g + 8 * r;
                if (qi < qlen) {
                    float *dst = a.dq_acc + ((size_t)(qs + qi) * a.H + h) * D + 2 * t4;
#pragma unroll
                    for (int nt = 0; nt < D / 8; nt++)
                        atomic_add_f2(dst + nt * 8, dqa[nt][2 * r] * a.scale, dqa[nt][2 * r + 1] * a.scale);
                }
            }
        }
        __syncthreads();
        if (NB == 1 && qt + 1 < qt_end) {
            load_q(qt + 1, 0);
            cp_async_commit();
        }
    }

#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int j = k0 + warp * 16 + g + 8 * r;
        if (j >= klen) continue;
        const size_t idx = (size_t)(ks + j);
        if (a.dkx) {
            float *dkp = a.dkx + (idx * a.H + h) * D + 2 * t4;
            float *dvp = a.dvx + (idx * a.H + h) * D + 2 * t4;
#pragma unroll
            for (int nt = 0; nt < D / 8; nt++) {
                *reinterpret_cast<float2 *>(dkp + nt * 8) =
                    make_float2(dk[nt][2 * r] * a.scale, dk[nt][2 * r + 1] * a.scale);
                *reinterpret_cast<float2 *>(dvp + nt * 8) = make_float2(dv[nt][2 * r], dv[nt][2 * r + 1]);
            }
        } else {
            bf16 *dkp = a.dk + idx * kstr + (size_t)hk * D + 2 * t4;
            bf16 *dvp = a.dv + idx * kstr + (size_t)hk * D + 2 * t4;
#pragma unroll
            for (int nt = 0; nt < D / 8; nt++) {
                *reinterpret_cast<__nv_bfloat162 *>(dkp + nt * 8) =
                    __floats2bfloat162_rn(dk[nt][2 * r] * a.scale, dk[nt][2 * r + 1] * a.scale);
                *reinterpret_cast<__nv_bfloat162 *>(dvp + nt * 8) =
                    __floats2bfloat162_rn(dv[nt][2 * r], dv[nt][2 * r + 1]);
            }
        }
    }
}

/* ============================================================ small kernels */

static __global__ void f32_to_bf16_kernel(bf16 *dst, const float *src, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}

/* the GQA reduction (common.cuh: gqa_reduce_body) over the whole grid */
template <int V>
static __global__ void gqa_reduce_kernel(bf16 *dk, bf16 *dv, const float *dkx, const float *dvx, size_t nk, int Hkv,
                                         int G, int D) {
    gqa_reduce_body<V>(dk, dv, dkx, dvx, nk, Hkv, G, D, blockIdx.x, gridDim.x);
}

/* =================================================================== host */

ATTN_TRACE_BINDER(attn_trace_bind_bwd)

void attn_bwd_prep(cudaStream_t st, const bf16 *dout, const bf16 *o, float *Dvec, float *zero, size_t nzero,
                   int nrows, int D) {
    const int rpw = attn_prep_rows_per_warp(D, dout, o);
    const size_t warps = ((size_t)nrows + rpw - 1) / rpw;
    attn_bwd_prep_kernel<<<(unsigned)((warps * 32 + 255) / 256), 256, 0, st>>>(dout, o, Dvec, zero, nzero, nrows, D,
                                                                             rpw);
}

void attn_dq_to_bf16(cudaStream_t st, bf16 *dq, const float *dq_acc, size_t n) {
    f32_to_bf16_kernel<<<attn_grid_for(n), 256, 0, st>>>(dq, dq_acc, n);
}

void attn_gqa_reduce(cudaStream_t st, bf16 *dk, bf16 *dv, const float *dkx, const float *dvx, size_t nk, int Hkv,
                     int G, int D) {
    if (D % 4 == 0) gqa_reduce_kernel<4><<<attn_grid_for(nk * Hkv * D / 4), 256, 0, st>>>(dk, dv, dkx, dvx, nk, Hkv, G, D);
    else gqa_reduce_kernel<1><<<attn_grid_for(nk * Hkv * D), 256, 0, st>>>(dk, dv, dkx, dvx, nk, Hkv, G, D);
}

template <int D>
static AttnKernel bwd_entry() {
    return AttnKernel{(const void *)attn_bwd_kernel<D>, bwd_smem_bytes<D>()};
}
AttnKernel attn_bwd_kernel_for(int D) { CF_ATTN_DISPATCH(D, bwd_entry) }
