/*
 * attention/common.cuh — flash-style causal GQA attention on tensor cores:
 * what the kernels share (arguments, tile / mma.sync / ldmatrix helpers,
 * tile loads, tuning), written once.
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
 *               kept rows          filtered rows     bwd_dq (part 2: filtered-key dq, + part 1;
 *                                                    Hopper: into part 1's accumulator, beside it)
 *   STRAWMAN    kept rows          kept rows         fwd (kept-only lse and out), prep, bwd, convert
 *   CENTRIFUGE_KV kept rows        all rows          prep, bwd (dk, dv of every key from the kept
 *                                                    queries, dq by atomics), dq convert
 *
 * Part 1 of centrifuge is exact for the kept-key terms because compaction
 * keeps order (the causal structure among kept rows is the compacted causal
 * mask) and it uses the full-forward lse and D_i = dO_i . out_i of the full
 * output, so P_ij and dS_ij are the full-attention values. Part 2 adds the
 * terms of filtered keys to dq; nothing flows to filtered keys.
 * CENTRIFUGE_KV runs the main kernel once over kept queries and every key
 * (no kept-list on the k side, so dk, dv land at original rows [T, Hkv, D]):
 * the kept x kept work of part 1 plus the kept x filtered work of part 2,
 * with dK, dV formed for the filtered keys too (two more mma groups per
 * tile than part 2's dq-only pass). The kernels of the other modes are
 * unchanged.
 *
 * Tiles: 4 warps per block, 64 rows per tile, each warp owns 16 rows (one m16
 * fragment). Shared-memory rows are padded by 16 bytes so that ldmatrix and
 * the 16-byte cp.async stores are free of bank conflicts. Head dims 16, 32,
 * 64, 96, 128 have kernels; others up to 128 run zero-padded.
 *
 * Speed and the variants tried: bwd.cu.
 *
 * Files: fwd.cu (forward), bwd.cu (prep, the dk/dv/dq backward of FULL,
 * STRAWMAN and centrifuge part 1, the dq conversion and GQA reduction),
 * bwd_centrifuge.cu (centrifuge part 2: dq over the filtered keys),
 * launch.cu (host side: shape checks, head-dim padding, per-device
 * shared-memory limits, the launches of each mode).
 *
 * Architectures: everything above is sm_80 (cp.async, ldmatrix, mma.sync
 * bf16): the portable path. The one sm_90 instruction, the float2 atomic
 * add of dq, has a portable two-float fallback (atomic_add_f2).
 * On Hopper (cc 9.0, sm_90a code in the binary) head dims 64 and 128 run
 * kernels of their own with the same semantics, built from sm90.cuh
 * (wgmma, TMA, mbarriers, warp specialisation): fwd_sm90.cu (forward, all
 * rows), bwd_sm90.cu (the main backward kernel of every mode, its dq
 * accumulator in "slot order"), bwd_centrifuge_sm90.cu (centrifuge part 2),
 * launch_sm90.cu (path choice per context, tensor maps). launch.cu calls
 * them where they apply and the portable kernels otherwise (other head
 * dims, the strawman's kept-only forward, CENTRIFUGE_ATTENTION=portable).
 * Design and measurements: docs/HOPPER_ATTENTION.md.
 */
#ifndef CF_ATTENTION_COMMON_CUH
#define CF_ATTENTION_COMMON_CUH

#include <limits.h>
#include <math.h>

#include "backend/cuda/attention/trace.cuh"
#include "backend/cuda/cuda_common.cuh"

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

/* dst[0] += x, dst[1] += y, atomically per float (8-byte aligned dst) */
__device__ __forceinline__ void atomic_add_f2(float *dst, float x, float y) {
#if CF_SM90_PATH
    atomicAdd(reinterpret_cast<float2 *>(dst), make_float2(x, y));
#else
    atomicAdd(dst, x);
    atomicAdd(dst + 1, y);
#endif
}
/* dst[0..3] += v, atomically per float (16-byte aligned dst): one vector
 * reduction on Hopper, four elsewhere */
__device__ __forceinline__ void atomic_add_f4(float *dst, float4 v) {
#if CF_SM90_PATH
    atomicAdd(reinterpret_cast<float4 *>(dst), v);
#else
    atomicAdd(dst, v.x);
    atomicAdd(dst + 1, v.y);
    atomicAdd(dst + 2, v.z);
    atomicAdd(dst + 3, v.w);
#endif
}

/* Programmatic dependent launch (sm_90; bwd_sm90.cu: bwd_pdl). A kernel
 * launched with it may start while the kernel before it in the stream
 * still runs, once every block of that one has called griddep_trigger()
 * (or exited): griddep_wait() then waits until it has completed and its
 * writes are visible. Both are no-ops below sm_90 and without it. */
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void griddep_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
/* the launch attribute that makes a launch the programmatic dependent of
 * the launch before it in its stream (host side of the two above) */
static inline cudaLaunchAttribute griddep_attr(void) {
    cudaLaunchAttribute at = {};
    at.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at.val.programmaticStreamSerializationAllowed = 1;
    return at;
}

/* ------------------------------------------- bodies of the small kernels
 * (bwd.cu's own kernels, and the one-launch variants of the Hopper path in
 * bwd_sm90.cu and bwd_centrifuge_sm90.cu, which run several of them as
 * block ranges of one grid: blk, nblk = this block's place in its range) */

/* Rows of D_i per warp in attn_prep_body: 256 / D where a row is D/8
 * lanes of 16-byte loads that divide the warp (D = 16, 32, 64, 128; rows
 * 16-byte aligned), else 1 (a warp per row, 4-byte loads). The launches
 * size their grids with it. */
__host__ __device__ __forceinline__ int attn_prep_rows_per_warp(int D, const void *dout, const void *o) {
    const bool vec = D % 8 == 0 && D >= 16 && D <= 256 && 32 % (D / 8) == 0 && ((uintptr_t)dout & 15) == 0 &&
                     ((uintptr_t)o & 15) == 0;
    return vec ? 256 / D : 1;
}

/* D_i = dO_i . O_i per (q index, head), rpw rows per warp
 * (attn_prep_rows_per_warp), and zero[0 .. nzero) = 0 spread over the
 * range's threads (a dq accumulator; none when NULL) */
__device__ __forceinline__ void attn_prep_body(const bf16 *dout, const bf16 *o, float *Dvec, float *zero, size_t nzero,
                                               int nrows, int D, int rpw, int blk, int nblk) {
    if (zero) {
        const size_t nthreads = (size_t)nblk * blockDim.x, tid = (size_t)blk * blockDim.x + threadIdx.x;
        float4 *z4 = reinterpret_cast<float4 *>(zero);
        for (size_t i = tid; i < nzero / 4; i += nthreads) z4[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        for (size_t i = nzero / 4 * 4 + tid; i < nzero; i += nthreads) zero[i] = 0.f;
    }
    const size_t w = ((size_t)blk * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (rpw > 1) {
        /* D/8 lanes per row, each one 16-byte load of dO and of O; the
         * warp's rows are disjoint lane groups, summed within the group */
        const int per = 32 / rpw, sub = lane % per;
        const size_t row = w * rpw + lane / per;
        float acc = 0.f;
        if (row < (size_t)nrows) {
            float x[8], y[8];
            unpack8(*reinterpret_cast<const pack8 *>(dout + row * D + 8 * sub), x);
            unpack8(*reinterpret_cast<const pack8 *>(o + row * D + 8 * sub), y);
#pragma unroll
            for (int k = 0; k < 8; k++) acc += x[k] * y[k];
        }
        for (int off = per / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
        if (row < (size_t)nrows && sub == 0) Dvec[row] = acc;
        return;
    }
    if (w >= (size_t)nrows) return;
    const bf16 *x = dout + w * D, *y = o + w * D;
    float acc = 0.f;
    for (int d = 2 * lane; d < D; d += 64) {
        const float2 u = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(x + d));
        const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(y + d));
        acc += u.x * v.x + u.y * v.y;
    }
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) Dvec[w] = acc;
}

/* dk, dv of kv head hk = the sums of the G fp32 partials of its query-head
 * groups ([nk, Hkv, G, D] -> [nk, Hkv, D]), in partial order (so the result
 * does not depend on the launch); V columns per thread (4 when D allows:
 * float4 loads, the work is reading the partials) */
template <int V>
__device__ __forceinline__ void gqa_reduce_body(bf16 *dk, bf16 *dv, const float *dkx, const float *dvx, size_t nk,
                                                int Hkv, int G, int D, int blk, int nblk) {
    const int DV = D / V;
    const size_t n = nk * Hkv * DV;
    for (size_t i = (size_t)blk * blockDim.x + threadIdx.x; i < n; i += (size_t)nblk * blockDim.x) {
        const size_t jh = i / DV; /* (key row, kv head) */
        const int d = (int)(i - jh * DV) * V;
        const size_t base = jh * G * D + d, out = jh * D + d;
        float sk[V], sv[V];
#pragma unroll
        for (int e = 0; e < V; e++) sk[e] = sv[e] = 0.f;
        for (int gi = 0; gi < G; gi++) {
            if constexpr (V == 4) {
                const float4 a = *reinterpret_cast<const float4 *>(dkx + base + (size_t)gi * D);
                const float4 c = *reinterpret_cast<const float4 *>(dvx + base + (size_t)gi * D);
                sk[0] += a.x, sk[1] += a.y, sk[2] += a.z, sk[3] += a.w;
                sv[0] += c.x, sv[1] += c.y, sv[2] += c.z, sv[3] += c.w;
            } else {
                sk[0] += dkx[base + (size_t)gi * D];
                sv[0] += dvx[base + (size_t)gi * D];
            }
        }
        if constexpr (V == 4) {
#pragma unroll
            for (int e = 0; e < 4; e += 2) {
                *reinterpret_cast<__nv_bfloat162 *>(dk + out + e) = __floats2bfloat162_rn(sk[e], sk[e + 1]);
                *reinterpret_cast<__nv_bfloat162 *>(dv + out + e) = __floats2bfloat162_rn(sv[e], sv[e + 1]);
            }
        } else {
            dk[out] = __float2bfloat16_rn(sk[0]);
            dv[out] = __float2bfloat16_rn(sv[0]);
        }
    }
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

/* ======================================================== kernel table */

/* A kernel for one head dim: its address (for cudaFuncSetAttribute and
 * cudaLaunchKernel) and its dynamic shared memory. fn is NULL for head dims
 * without a kernel. The grid of each is (H, tiles, B), NTHREADS threads. */
struct AttnKernel {
    const void *fn;
    size_t smem;
};
AttnKernel attn_fwd_kernel_for(int D);    /* fwd.cu            */
AttnKernel attn_bwd_kernel_for(int D);    /* bwd.cu            */
AttnKernel attn_bwd_dq_kernel_for(int D); /* bwd_centrifuge.cu */

/* The head dims with kernels, as a switch over D calling F<D>(). */
#define CF_ATTN_DISPATCH(D, F)                 \
    switch (D) {                               \
    case 16: return F<16>();                   \
    case 32: return F<32>();                   \
    case 64: return F<64>();                   \
    case 96: return F<96>();                   \
    case 128: return F<128>();                 \
    default: return AttnKernel{nullptr, 0};    \
    }

/* blocks of 256 threads for n items, at most 65536 (grid-stride kernels) */
static inline int attn_grid_for(size_t n) {
    size_t blocks = (n + 255) / 256;
    return (int)(blocks < 65536 ? (blocks ? blocks : 1) : 65536);
}

/* ------------------------------------ Hopper kernels (sm_90a), by file
 * Each returns 1 when it launched, 0 when it does not take this call (the
 * caller runs the portable kernels instead), -1 on a CUDA error (recorded
 * in ctx). launch.cu calls them only when attn_sm90_enabled(ctx). */

/* launch_sm90.cu: whether this context runs the Hopper kernels: a cc 9.0
 * device, the binary's sm_90a code runs on it, the driver encodes tensor
 * maps, and CENTRIFUGE_ATTENTION is not "portable" (read once per context) */
bool attn_sm90_enabled(cf_cuda_ctx *ctx);
/* launch_sm90.cu: the integer in environment variable `name`, or dflt where
 * it is unset or empty (the kernels' timing switches; each caller reads its
 * switch once) */
int attn_env_int(const char *name, int dflt);
/* fwd_sm90.cu: the forward, all rows (no kept lists), D = 64 or 128 */
int attn_fwd_sm90(cf_cuda_ctx *ctx, const AttnArgs &a, int D);
/* bwd_sm90.cu: the main backward kernel (as bwd.cu's) over k-side tiles of
 * up to kmaxlen rows per sequence, q side of nq_rows rows in all; dq goes
 * to a.dq_acc in slot order with tps query tiles (64 rows) per sequence,
 * tps even (sm90.cuh: dq_slot_base); hpb query heads per block and ns
 * parts of each key tile's query range, from attn_sm90_bwd_plan (the
 * caller sizes and reduces the partials with them; ns > 1 needs a.dkx,
 * a.dvx), unless `pair` (attn_sm90_bwd_pair): then dk, dv go to a.dk, a.dv
 * as bf16 */
int attn_bwd_sm90(cf_cuda_ctx *ctx, const AttnArgs &a, int D, int nq_rows, int kmaxlen, int tps, int hpb, int ns,
                  int pair);
/* bwd_sm90.cu: pairs of blocks that sum a kv head's two dk, dv partials
 * between them (clusters of two along the heads or the parts: the
 * kernel's epilogue), or CF_PAIR_NONE: the partials path */
enum { CF_PAIR_NONE = 0, CF_PAIR_HEADS = 1, CF_PAIR_PARTS = 2 };
int attn_sm90_bwd_pair(cf_cuda_ctx *ctx, int D, int H, int Hkv, int hpb, int ns);
/* bwd_sm90.cu: the launch plan of attn_bwd_sm90 at head dim D for B
 * sequences of up to qmaxlen q-side and kmaxlen k-side rows: *hpb query
 * heads per block (a divisor of H/Hkv) and *ns parts (1 or 2) of each key
 * tile's query range, each its own block; flen > 0 where centrifuge's
 * part 2 runs beside over flen filtered keys per sequence (their mean). With
 * GQA or ns > 1 dk, dv go to a.dkx, a.dvx as [nk, H/hpb, ns, D] fp32
 * partials, unless a block holds a whole group in one part or pairs sum
 * them (attn_sm90_bwd_pair) */
void attn_sm90_bwd_plan(cf_cuda_ctx *ctx, int D, int H, int Hkv, int B, int qmaxlen, int kmaxlen, int flen,
                        int *hpb, int *ns);
/* bwd_centrifuge_sm90.cu: centrifuge on Hopper. attn_cf_sm90_prep, one
 * launch on ctx->stream: what attn_bwd_prep does for the n = kept->n query
 * rows (a.Dvec, and acc[0 .. acc_n) zeroed), what attn_filtered_rows does
 * (filt, fstart), and the filtered rows' K and V compacted for part 2; *p2
 * = a with the filtered rows as its k side, reading the compact copies, and
 * acc as its dq accumulator (1;
 * 0: no Hopper kernel for D; -1 on an error). attn_bwd_dq_sm90: part 2 on
 * stream st, adding the filtered keys' dq terms to the slot-order
 * accumulator p.dq_acc (1; 0: the driver refused a tensor map, nothing
 * launched; -1 on an error). chained: st is ctx->stream and part 1 the
 * launch before it; part 2 is then its programmatic dependent (it starts
 * once every block of part 1 has started, and ends only after part 1) */
int attn_cf_sm90_prep(cf_cuda_ctx *ctx, const AttnArgs &a, int D, const cf_rows *kept, float *acc, size_t acc_n,
                      int *filt, int *fstart, AttnArgs *p2);
int attn_bwd_dq_sm90(cf_cuda_ctx *ctx, const AttnArgs &p, int D, int nq_rows, int nf, int maxlen, int tps,
                     cudaStream_t st, bool chained);
/* bwd_sm90.cu: the width of the dQ products at head dim D (slot order) */
int attn_sm90_bwd_nw(int D);
/* bwd_sm90.cu: the main backward kernel's blocks for a plan (hpb heads per
 * block, ns parts) over B sequences of up to kmaxlen k-side rows: its grid */
dim3 attn_sm90_bwd_grid(int H, int hpb, int ns, int B, int kmaxlen);
/* The GQA reduction of dk, dv: [nk, Hkv, G, D] fp32 partials summed into
 * [nk, Hkv, D] bf16 (bwd.cu: attn_gqa_reduce; bwd_sm90.cu's finish) */
struct GqaReduce {
    bf16 *dk, *dv;
    const float *dkx, *dvx;
    size_t nk;
    int Hkv, G;
};
/* bwd_sm90.cu: the Hopper backward's last launch. dq of the q-side rows
 * (sequence starts qstart, B + 1 of them; NULL = b*S) from the
 * slot-ordered accumulator, bf16 into dq or fp32 into dqf, and, in the same
 * grid, the GQA reduction red (none when NULL); D = 64 or 128. after_main:
 * it follows the main kernel, or centrifuge's chained part 2, directly in
 * the stream (then a programmatic dependent launch; not after another
 * stream's event) */
void attn_sm90_bwd_finish(cudaStream_t st, bf16 *dq, float *dqf, const float *acc, const int *qstart, int B, int S,
                          int H, int D, int tps, const GqaReduce *red, bool after_main);

/* ----------------------------------------- small kernels, by file */

/* bwd.cu: D_i = dO_i . O_i per (q index, head), and zero[0 .. nzero) = 0
 * (a dq accumulator; none when zero is NULL) */
void attn_bwd_prep(cudaStream_t st, const bf16 *dout, const bf16 *o, float *Dvec, float *zero, size_t nzero,
                   int nrows, int D);
/* bwd.cu: dq = bf16(dq_acc) */
void attn_dq_to_bf16(cudaStream_t st, bf16 *dq, const float *dq_acc, size_t n);
/* bwd.cu: dk, dv of each kv head = sums over its G query heads */
void attn_gqa_reduce(cudaStream_t st, bf16 *dk, bf16 *dv, const float *dkx, const float *dvx, size_t nk, int Hkv,
                     int G, int D);
/* bwd_centrifuge.cu: the filtered rows (complement of the kept ones) and
 * their sequence starts */
void attn_filtered_rows(cudaStream_t st, int *filt, int *fstart, const int *rows, const int *seq_start, int n, int B,
                        int S);

#endif /* CF_ATTENTION_COMMON_CUH */
