/*
 * attention_cuda.cu — flash-style causal GQA attention on tensor cores.
 *
 * All matrix products are mma.sync.m16n8k16 (bf16 inputs, fp32 accumulate),
 * fed from shared memory with ldmatrix. No S x S matrix exists anywhere: a
 * score tile lives in registers for one step of a loop.
 *
 * Notation (per sequence, per query head h, kv head hk = h / (H/Hkv)):
 *   s_ij  = q_i . k_j                    raw score
 *   x_ij  = scale * s_ij                 scaled score
 *   lse_i = log sum_j exp(x_ij)          over visible keys j (natural log)
 *   P_ij  = exp(x_ij - lse_i)
 *   out_i = sum_j P_ij v_j
 * Backward, with dO = dL/dout:
 *   dP_ij = dO_i . v_j
 *   D_i   = sum_j P_ij dP_ij = dO_i . out_i
 *   dS_ij = P_ij (dP_ij - D_i)
 *   dq_i  = scale sum_j dS_ij k_j,  dk_j = scale sum_i dS_ij q_i,  dv_j = sum_i P_ij dO_i
 * Key j is visible to query i iff same sequence, row_j <= row_i and (with a
 * document mask) doc[row_j] == doc[row_i].
 *
 * Index spaces. Each kernel sees a "q side" and a "k side", each a list of
 * sequences given by a start array ([B+1], NULL = b*S) and an optional map
 * from index to original row (NULL = identity). q, out, dout, lse, dq are
 * indexed by the q-side index; k and v are always the full [T, Hkv, D]
 * tensors, read at the original row of each k-side index; dk, dv are written
 * at the k-side index. Both lists are ascending in row, so "row_j <= row_i"
 * is also a prefix condition in either index space, which is what makes tile
 * skipping work on compacted lists.
 *
 *   mode        q side             k side            kernels
 *   forward     all rows           all rows          fwd
 *   FULL        all rows           all rows          prep, bwd (dk,dv,dq atomics), dq convert
 *   CENTRIFUGE  kept rows          kept rows         prep, bwd (part 1: dk, dv, kept-key dq)
 *               kept rows          filtered rows     bwd_dq (part 2: filtered-key dq, + part 1)
 *   STRAWMAN    kept rows          kept rows         fwd (kept-only lse and out), prep, bwd, convert
 *
 * Part 1 of centrifuge is exact for the kept-key terms because compaction
 * keeps order (the causal structure among kept rows is the compacted causal
 * mask) and it uses the full-forward lse and D_i = dO_i . out_i of the full
 * output, so P_ij and dS_ij are the full-attention values. Part 2 adds the
 * terms of filtered keys to dq; nothing flows to filtered keys.
 *
 * Tiles: 4 warps per block, 64 rows per tile, each warp owns 16 rows (one m16
 * fragment). Shared-memory rows are padded by 16 bytes so that ldmatrix and
 * the 16-byte cp.async stores are free of bank conflicts. Head dims 16, 32,
 * 64, 96, 128 have kernels; others up to 128 run zero-padded.
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
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "common.h"
#include "backend.h"
}

typedef __nv_bfloat16 bf16;

/* ---- from backend_cuda.cu ---- */
void *cf_cuda_scratch(cf_backend *b, int slot, size_t bytes);
void cf_cuda_check(cudaError_t e, const char *what, const char *file, int line);
#define CK(call) cf_cuda_check((call), #call, __FILE__, __LINE__)
#define CK_LAUNCH() cf_cuda_check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)
/* scratch slots 16.. belong to attention (backend_cuda.cu uses 0..15) */
enum { SCR_DQACC = 16, SCR_DVEC, SCR_DKX, SCR_DVX, SCR_FILT, SCR_FSTART, SCR_OKEPT, SCR_LSEKEPT,
       SCR_PAD_Q = 24, SCR_PAD_K, SCR_PAD_V, SCR_PAD_O, SCR_PAD_DO, SCR_PAD_DQ, SCR_PAD_DK, SCR_PAD_DV };

#define LOG2E_F 1.4426950408889634f
#define LN2_F 0.6931471805599453f

struct AttnArgs {
    /* q side */
    const bf16 *q, *o, *dout;
    bf16 *out;            /* fwd output                       */
    float *lse_out;       /* fwd lse                          */
    const float *lse;     /* bwd: lse used to form P          */
    const float *Dvec;    /* bwd: D_i per (q index, head)     */
    float *dq_acc;        /* bwd: fp32 dq accumulator [nq,H,D] */
    bf16 *dq;             /* bwd_dq: final dq                 */
    const int *qstart, *qrow;
    /* k side */
    const bf16 *k, *v;
    const int *kstart, *krow;
    bf16 *dk, *dv;        /* [nk, Hkv, D] when H == Hkv */
    float *dkx, *dvx;     /* [nk, H, D] fp32, per query head, when H != Hkv */
    const int *doc;       /* by original row, or NULL */
    int B, S, H, Hkv;
    float scale, scale_log2;
};

/* ------------------------------------------------------------ primitives */

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}
/* 16-byte async copy global -> shared; src_bytes 0 writes zeros. */
__device__ __forceinline__ void cp_async16(void *smem, const void *gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)),
                 "l"(__cvta_generic_to_global(gmem)), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
/* Four 8x8 b16 matrices; lane l gives the row address of matrix l/8. */
__device__ __forceinline__ void ldsm_x4(uint32_t r[4], const bf16 *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t r[4], const bf16 *p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
}
/* c[16x8] += a[16x16] b[16x8]. Fragments (g = lane/4, t = lane%4):
 *   a: a0 (g, 2t..2t+1) a1 (g+8, 2t..) a2 (g, 2t+8..) a3 (g+8, 2t+8..)   [row, k]
 *   b: b0 (k 2t..2t+1, n g)  b1 (k 2t+8.., n g)
 *   c: c0 c1 (g, 2t..2t+1)  c2 c3 (g+8, 2t..2t+1)                       [row, n]  */
__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
/*
 * ldmatrix address patterns. For a 16x16 bf16 block at (r0, c0) of a
 * row-major shared array with row stride ld, lane l points at
 *   X: row r0 + (l&7) + ((l>>3)&1)*8, col c0 + (l>>4)*8
 *   Y: row r0 + (l&7) + (l>>4)*8,      col c0 + ((l>>3)&1)*8
 * and the four registers come out as:
 *   A stored [m][k], X, no trans  -> a0 a1 a2 a3
 *   A stored [k][m], Y, trans     -> a0 a1 a2 a3
 *   B stored [n][k], Y, no trans  -> b0 b1 of n-tile c0.., b0 b1 of n-tile +8
 *   B stored [k][n], X, trans     -> b0 b1 of n-tile c0.., b0 b1 of n-tile +8
 */
__device__ __forceinline__ int ldsm_off_x(int lane, int ld) {
    return ((lane & 7) + ((lane >> 3) & 1) * 8) * ld + (lane >> 4) * 8;
}
__device__ __forceinline__ int ldsm_off_y(int lane, int ld) {
    return ((lane & 7) + (lane >> 4) * 8) * ld + ((lane >> 3) & 1) * 8;
}

__device__ __forceinline__ int seq_begin(const int *start, int b, int S) {
    return start ? start[b] : b * S;
}
__device__ __forceinline__ int row_of(const int *map, int idx) { return map ? map[idx] : idx; }
/* Number of entries j in [0, len) with row(base + j) <= r (rows ascending). */
__device__ __forceinline__ int count_le(const int *map, int base, int len, int r) {
    if (!map) return min(max(r - base + 1, 0), len);
    int lo = 0, hi = len;
    while (lo < hi) {
        int mid = (lo + hi) >> 1;
        if (map[base + mid] <= r) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* --------------------------------------------------------- shared tiles */

constexpr int NTHREADS = 128;  /* 4 warps */
constexpr int TILE = 64;       /* rows per q tile and per k tile */

/* Loads rows [j0, j0+64) of the k side (keys and values of kv head hk) into
 * Ks/Vs, zero-filling rows at or past klen; records their original rows
 * (INT_MAX past klen) and document ids. */
template <int D>
__device__ __forceinline__ void load_kv_tile(const AttnArgs &a, bf16 *Ks, bf16 *Vs, int *krow_s,
                                             int *kdoc_s, int ks, int klen, int j0, int hk) {
    constexpr int LD = D + 8, CH = D / 8;
    const size_t kstr = (size_t)a.Hkv * D;
    for (int c = threadIdx.x; c < TILE * CH; c += NTHREADS) {
        int r = c / CH, col = (c % CH) * 8;
        int j = j0 + r;
        int ok = j < klen;
        int row = row_of(a.krow, ks + (ok ? j : klen - 1));
        size_t off = (size_t)row * kstr + (size_t)hk * D + col;
        cp_async16(Ks + r * LD + col, a.k + off, ok ? 16 : 0);
        cp_async16(Vs + r * LD + col, a.v + off, ok ? 16 : 0);
    }
    if (threadIdx.x < TILE) {
        int j = j0 + threadIdx.x;
        int row = j < klen ? row_of(a.krow, ks + j) : INT_MAX;
        krow_s[threadIdx.x] = row;
        kdoc_s[threadIdx.x] = (a.doc && j < klen) ? a.doc[row] : 0;
    }
}

/* ----------------------------------------------------------- tuning */

/* Per head-dim choices: buffers of the streamed tiles (2 = load the next
 * tile while computing on this one; 1 = less shared memory, so more blocks
 * per SM) and the minimum blocks per SM the register budget must allow.
 * The CF_ATTN_* macros exist for A/B timing builds (cuda.mk: CUDA_DEFS).
 * Measured on one H200, S=4096, B=1, H=32 (median of 20):
 *   fwd D=64, 4 blocks/SM (128 registers) vs 3:        0.298 vs 0.314 ms
 *   bwd D=64, 3 blocks/SM (168 registers, 24 B spill) vs 2:
 *                                  full 0.987 vs 1.055 ms, centrifuge 0.449 vs 0.454 ms
 *   bwd D=128, 1 buffer (2 blocks/SM) vs 2 (1 block):   1.849 vs 1.896 ms
 *   fwd D=128, 1 buffer and 3 blocks/SM vs 2 buffers:   0.562 vs 0.561 ms (kept 2)
 */
#ifndef CF_ATTN_FWD_NBUF_128
#define CF_ATTN_FWD_NBUF_128 2
#endif
#ifndef CF_ATTN_FWD_MINB_128
#define CF_ATTN_FWD_MINB_128 1
#endif
#ifndef CF_ATTN_FWD_MINB_64
#define CF_ATTN_FWD_MINB_64 4
#endif
#ifndef CF_ATTN_BWD_NBUF_128
#define CF_ATTN_BWD_NBUF_128 1
#endif
#ifndef CF_ATTN_BWD_MINB_64
#define CF_ATTN_BWD_MINB_64 3
#endif
template <int D> struct AttnCfg {
    static constexpr int FWD_NBUF = D >= 128 ? CF_ATTN_FWD_NBUF_128 : 2;
    static constexpr int FWD_MINB = D >= 128 ? CF_ATTN_FWD_MINB_128 : D == 64 ? CF_ATTN_FWD_MINB_64 : 1;
    static constexpr int BWD_NBUF = D >= 128 ? CF_ATTN_BWD_NBUF_128 : 2;
    static constexpr int BWD_MINB = D == 64 ? CF_ATTN_BWD_MINB_64 : 1;
};

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

/* ================================================ backward: dk, dv (+dq) */

template <int D>
constexpr size_t bwd_smem_bytes() {
    constexpr int NB = AttnCfg<D>::BWD_NBUF;
    return (size_t)(2 * TILE + 2 * NB * TILE) * (D + 8) * sizeof(bf16) +
           (size_t)TILE * (TILE + 8) * sizeof(bf16) + 4 * NB * TILE * sizeof(float);
}

/* D_i = dO_i . O_i per (q index, head), one warp each; also zeroes dq_acc. */
static __global__ void attn_bwd_prep_kernel(const bf16 *dout, const bf16 *o, float *Dvec, float *dq_acc,
                                     int nrows, int D) {
    int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (w >= nrows) return;
    const bf16 *a = dout + (size_t)w * D, *c = o + (size_t)w * D;
    float acc = 0.f;
    for (int d = 2 * lane; d < D; d += 64) {
        float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(a + d));
        float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(c + d));
        acc += x.x * y.x + x.y * y.y;
        *reinterpret_cast<float2 *>(dq_acc + (size_t)w * D + d) = make_float2(0.f, 0.f);
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) Dvec[w] = acc;
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
                        atomicAdd(reinterpret_cast<float2 *>(dst + nt * 8),
                                  make_float2(dqa[nt][2 * r] * a.scale, dqa[nt][2 * r + 1] * a.scale));
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

/* ============================================================ small kernels */

static __global__ void f32_to_bf16_kernel(bf16 *dst, const float *src, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16_rn(src[i]);
}

/* dk[j, hk, :] = sum over the G query heads of group hk of dkx[j, h, :] */
static __global__ void gqa_reduce_kernel(bf16 *dk, bf16 *dv, const float *dkx, const float *dvx, size_t nk,
                                  int Hkv, int G, int D) {
    const size_t n = nk * Hkv * D;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t j = i / ((size_t)Hkv * D);
        int rem = (int)(i % ((size_t)Hkv * D)), hk = rem / D, d = rem % D;
        const size_t base = (j * Hkv * G + (size_t)hk * G) * D + d;
        float sk = 0.f, sv = 0.f;
        for (int gi = 0; gi < G; gi++) {
            sk += dkx[base + (size_t)gi * D];
            sv += dvx[base + (size_t)gi * D];
        }
        dk[i] = __float2bfloat16_rn(sk);
        dv[i] = __float2bfloat16_rn(sv);
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

static int grid_for(size_t n) {
    size_t blocks = (n + 255) / 256;
    return (int)(blocks < 65536 ? (blocks ? blocks : 1) : 65536);
}

template <int D>
static void set_smem_limits() {
    static bool done = false;
    if (done) return;
    CK(cudaFuncSetAttribute(attn_fwd_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            (int)fwd_smem_bytes<D>()));
    CK(cudaFuncSetAttribute(attn_bwd_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            (int)bwd_smem_bytes<D>()));
    CK(cudaFuncSetAttribute(attn_bwd_dq_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            (int)bwd_dq_smem_bytes<D>()));
    done = true;
}

enum { K_FWD, K_BWD, K_BWD_DQ };

template <int D>
static void launch_d(int which, const AttnArgs &a, int ntiles) {
    set_smem_limits<D>();
    dim3 grid(a.H, ntiles, a.B), block(NTHREADS);
    if (which == K_FWD) attn_fwd_kernel<D><<<grid, block, fwd_smem_bytes<D>()>>>(a);
    else if (which == K_BWD) attn_bwd_kernel<D><<<grid, block, bwd_smem_bytes<D>()>>>(a);
    else attn_bwd_dq_kernel<D><<<grid, block, bwd_dq_smem_bytes<D>()>>>(a);
    CK_LAUNCH();
}

static void launch(int which, const AttnArgs &a, int D, int ntiles) {
    if (ntiles <= 0) return;
    switch (D) {
    case 16: launch_d<16>(which, a, ntiles); break;
    case 32: launch_d<32>(which, a, ntiles); break;
    case 64: launch_d<64>(which, a, ntiles); break;
    case 96: launch_d<96>(which, a, ntiles); break;
    case 128: launch_d<128>(which, a, ntiles); break;
    default:
        cf_fail("attention (cuda): no kernel for head_dim %d", D);
        fprintf(stderr, "centrifuge: fatal: %s\n", cf_last_error());
        exit(1);
    }
}

/* head dims with kernels; others (up to 128) run zero-padded to the next one,
 * which leaves scores and outputs unchanged */
static int kernel_dim(int D) {
    return D <= 16 ? 16 : D <= 32 ? 32 : D <= 64 ? 64 : D <= 96 ? 96 : D <= 128 ? 128 : 0;
}

static bf16 *pad(cf_backend *bk, int slot, const void *src, size_t rows, int D, int Dp) {
    bf16 *dst = (bf16 *)cf_cuda_scratch(bk, slot, rows * Dp * sizeof(bf16));
    pad_rows_kernel<<<grid_for(rows * Dp), 256>>>(dst, (const bf16 *)src, rows, D, Dp);
    CK_LAUNCH();
    return dst;
}
static void unpad(void *dst, const bf16 *src, size_t rows, int D, int Dp) {
    unpad_rows_kernel<<<grid_for(rows * D), 256>>>((bf16 *)dst, src, rows, D, Dp);
    CK_LAUNCH();
}

static void check_shape(const cf_attn_shape *s) {
    if (s->B <= 0 || s->S <= 0 || s->H <= 0 || s->Hkv <= 0 || s->H % s->Hkv != 0 || s->D <= 0 ||
        kernel_dim(s->D) == 0) {
        cf_fail("attention (cuda): bad shape B=%d S=%d H=%d Hkv=%d D=%d (head_dim at most 128)", s->B, s->S,
                s->H, s->Hkv, s->D);
        fprintf(stderr, "centrifuge: fatal: %s\n", cf_last_error());
        exit(1);
    }
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

/* most rows of any sequence in a host start array (NULL: S) */
static int max_len(const int *host_start, int B, int S) {
    if (!host_start) return S;
    int m = 0;
    for (int b = 0; b < B; b++) m = CF_MAX(m, host_start[b + 1] - host_start[b]);
    return m;
}

extern "C" void cf_cuda_attention_fwd(cf_backend *bk, void *out, float *lse, const void *q, const void *k,
                                      const void *v, const cf_attn_shape *s) {
    check_shape(s);
    const int Dp = kernel_dim(s->D);
    if (Dp != s->D) {
        const size_t T = (size_t)s->B * s->S;
        cf_attn_shape sp = *s;
        sp.D = Dp;
        bf16 *qp = pad(bk, SCR_PAD_Q, q, T * s->H, s->D, Dp);
        bf16 *kp = pad(bk, SCR_PAD_K, k, T * s->Hkv, s->D, Dp);
        bf16 *vp = pad(bk, SCR_PAD_V, v, T * s->Hkv, s->D, Dp);
        bf16 *op = (bf16 *)cf_cuda_scratch(bk, SCR_PAD_O, T * s->H * Dp * sizeof(bf16));
        cf_cuda_attention_fwd(bk, op, lse, qp, kp, vp, &sp);
        unpad(out, op, T * s->H, s->D, Dp);
        return;
    }
    AttnArgs a = base_args(s);
    a.q = (const bf16 *)q;
    a.k = (const bf16 *)k;
    a.v = (const bf16 *)v;
    a.out = (bf16 *)out;
    a.lse_out = lse;
    launch(K_FWD, a, s->D, (s->S + TILE - 1) / TILE);
}

extern "C" void cf_cuda_attention_bwd(cf_backend *bk, void *dq, void *dk, void *dv, const void *dout,
                                      const void *q, const void *k, const void *v, const void *out,
                                      const float *lse, const cf_attn_shape *s, const cf_rows *kept,
                                      cf_attn_bwd_mode mode) {
    check_shape(s);
    const int D = s->D, H = s->H, Hkv = s->Hkv, B = s->B, S = s->S, T = B * S;
    const bool full = mode == CF_ATTN_BWD_FULL;
    if (!full && !kept) {
        cf_fail("attention_bwd (cuda): mode %d needs the kept rows", (int)mode);
        fprintf(stderr, "centrifuge: fatal: %s\n", cf_last_error());
        exit(1);
    }
    const int n = full ? T : kept->n; /* rows on the q side and on the k side of part 1 */
    if (n <= 0) return;
    const int Dp = kernel_dim(D);
    if (Dp != D) {
        cf_attn_shape sp = *s;
        sp.D = Dp;
        bf16 *qp = pad(bk, SCR_PAD_Q, q, (size_t)n * H, D, Dp);
        bf16 *op = pad(bk, SCR_PAD_O, out, (size_t)n * H, D, Dp);
        bf16 *dop = pad(bk, SCR_PAD_DO, dout, (size_t)n * H, D, Dp);
        bf16 *kp = pad(bk, SCR_PAD_K, k, (size_t)T * Hkv, D, Dp);
        bf16 *vp = pad(bk, SCR_PAD_V, v, (size_t)T * Hkv, D, Dp);
        bf16 *dqp = (bf16 *)cf_cuda_scratch(bk, SCR_PAD_DQ, (size_t)n * H * Dp * sizeof(bf16));
        bf16 *dkp = (bf16 *)cf_cuda_scratch(bk, SCR_PAD_DK, (size_t)n * Hkv * Dp * sizeof(bf16));
        bf16 *dvp = (bf16 *)cf_cuda_scratch(bk, SCR_PAD_DV, (size_t)n * Hkv * Dp * sizeof(bf16));
        cf_cuda_attention_bwd(bk, dqp, dkp, dvp, dop, qp, kp, vp, op, lse, &sp, kept, mode);
        unpad(dq, dqp, (size_t)n * H, D, Dp);
        unpad(dk, dkp, (size_t)n * Hkv, D, Dp);
        unpad(dv, dvp, (size_t)n * Hkv, D, Dp);
        return;
    }
    const int maxlen = full ? S : max_len(kept->host_seq_start, B, S);

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

    if (mode == CF_ATTN_BWD_STRAWMAN) {
        /* forward on the kept sequence: lse and out renormalised over kept keys */
        bf16 *o_kept = (bf16 *)cf_cuda_scratch(bk, SCR_OKEPT, (size_t)n * H * D * sizeof(bf16));
        float *lse_kept = (float *)cf_cuda_scratch(bk, SCR_LSEKEPT, (size_t)n * H * sizeof(float));
        AttnArgs f = a;
        f.out = o_kept;
        f.lse_out = lse_kept;
        launch(K_FWD, f, D, (maxlen + TILE - 1) / TILE);
        a.o = o_kept;
        a.lse = lse_kept;
    }

    float *dq_acc = (float *)cf_cuda_scratch(bk, SCR_DQACC, (size_t)n * H * D * sizeof(float));
    float *Dvec = (float *)cf_cuda_scratch(bk, SCR_DVEC, (size_t)n * H * sizeof(float));
    a.dq_acc = dq_acc;
    a.Dvec = Dvec;
    {
        size_t rows = (size_t)n * H;
        attn_bwd_prep_kernel<<<(unsigned)((rows * 32 + 255) / 256), 256>>>(a.dout, a.o, Dvec, dq_acc, (int)rows, D);
        CK_LAUNCH();
    }
    if (H != Hkv) {
        a.dkx = (float *)cf_cuda_scratch(bk, SCR_DKX, (size_t)n * H * D * sizeof(float));
        a.dvx = (float *)cf_cuda_scratch(bk, SCR_DVX, (size_t)n * H * D * sizeof(float));
    } else {
        a.dk = (bf16 *)dk;
        a.dv = (bf16 *)dv;
    }
    /* part 1 / the whole backward: dk, dv, and dq over the k side */
    launch(K_BWD, a, D, (maxlen + TILE - 1) / TILE);

    if (mode == CF_ATTN_BWD_CENTRIFUGE) {
        /* part 2: dq over the filtered keys, plus dq_acc, to bf16 */
        int nf = T - n;
        int *filt = (int *)cf_cuda_scratch(bk, SCR_FILT, (size_t)(nf > 0 ? nf : 1) * sizeof(int));
        int *fstart = (int *)cf_cuda_scratch(bk, SCR_FSTART, (size_t)(B + 1) * sizeof(int));
        filtered_rows_kernel<<<grid_for((size_t)CF_MAX(T, B + 1)), 256>>>(filt, fstart, kept->rows,
                                                                        kept->seq_start, n, B, S);
        CK_LAUNCH();
        AttnArgs p = a;
        p.kstart = fstart;
        p.krow = filt;
        p.dq = (bf16 *)dq;
        launch(K_BWD_DQ, p, D, (maxlen + TILE - 1) / TILE);
    } else {
        size_t nel = (size_t)n * H * D;
        f32_to_bf16_kernel<<<grid_for(nel), 256>>>((bf16 *)dq, dq_acc, nel);
        CK_LAUNCH();
    }
    if (H != Hkv) {
        size_t nel = (size_t)n * Hkv * D;
        gqa_reduce_kernel<<<grid_for(nel), 256>>>((bf16 *)dk, (bf16 *)dv, a.dkx, a.dvx, (size_t)n, Hkv,
                                                  H / Hkv, D);
        CK_LAUNCH();
    }
}
