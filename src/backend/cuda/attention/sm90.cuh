/*
 * attention/sm90.cuh — Hopper (sm_90a) building blocks of the attention
 * kernels in fwd_sm90.cu and bwd_sm90.cu: warpgroup matrix products
 * (wgmma), shared-memory matrix descriptors, the 128-byte swizzled tile
 * layout they read, bulk tensor copies (TMA) completing on mbarriers, named
 * barriers and register reallocation (setmaxnreg).
 *
 * Everything that emits an sm_90a-only instruction is compiled only where
 * CF_SM90A_PATH is 1 (device code for sm_90a, portable path not forced);
 * elsewhere the helpers are empty and the kernels built from them do
 * nothing: the host launches them only after attn_sm90_available() said the
 * device runs this code (launch.cu).
 *
 * ---------------------------------------------------------------- tiles
 * A tile of R rows x C bf16 columns (C a multiple of 64) is stored as C/64
 * column blocks, each R rows of 128 bytes, with the 128-byte swizzle: the
 * 16-byte chunk c (8 columns) of row r sits at chunk c ^ (r % 8) of that
 * row. Element (r, col) of the tile is at byte
 *     (col/64) * R*128 + r*128 + (((col%64)/8) ^ (r%8)) * 16 + (col%8) * 2
 * from a 1024-byte aligned base (the swizzle is a function of the address
 * bits, so every 8-row group must start on 1024 bytes). This is what a TMA
 * load with CU_TENSOR_MAP_SWIZZLE_128B and a box of 64 columns x R rows
 * writes, and what wgmma reads through a descriptor with swizzle mode
 * "128B", in either of two roles:
 *
 *   K-major operand (rows = M or N, columns = the reduction index k):
 *     k-step kk (columns 16kk..16kk+15) starts at
 *         base + (kk/4) * R*128 + (kk%4) * 32
 *     stride byte offset (SBO) = 1024 (the next 8 rows), leading byte
 *     offset unused. Rows 64w.. of the tile: + w * 64*128.
 *   MN-major operand (rows = k, columns = M or N; transpose bit set):
 *     k-step kk (rows 16kk..16kk+15) starts at base + kk * 16*128,
 *     SBO = 1024 (the next 8 rows of k), LBO = R*128 (the next 64
 *     columns of M/N). Columns c0.. (c0 % 8 == 0): + (c0/64)*R*128 +
 *     (c0%64)*2.
 *
 * ---------------------------------------------------------- fragments
 * wgmma m64nNk16 with fp32 accumulators: warp v (0..3) of the warpgroup
 * owns rows 16v..16v+15; lane l, g = l/4, t = l%4, holds for each 8-column
 * block j (0..N/8-1)
 *     d[4j+0], d[4j+1] at (row 16v+g,   cols 8j+2t, 8j+2t+1)
 *     d[4j+2], d[4j+3] at (row 16v+g+8, cols 8j+2t, 8j+2t+1)
 * (the mma.sync m16n8 C layout, per warp). A register A operand (m64k16
 * bf16, 4 x 32 bits) has the mma.sync A layout: a0 (g, 2t..2t+1), a1
 * (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..). So the accumulators of
 * columns 16kk..16kk+15 packed as pairs, (d[8kk], d[8kk+1]), (d[8kk+2],
 * d[8kk+3]), (d[8kk+4], d[8kk+5]), (d[8kk+6], d[8kk+7]), are the A operand
 * of k-step kk of the next product (P of S = Q K^T feeds O += P V).
 *
 * Ordering rules used by the kernels: wgmma_fence() before a batch of
 * wgmma whose accumulator or A registers were written by ordinary code;
 * wgmma_commit() after the batch; wgmma_wait<N>() before ordinary code
 * touches its accumulators, followed by fence_regs() on them so the
 * compiler cannot hoist those uses above the wait; shared memory written
 * by ordinary stores or cp.async and read by wgmma needs fence_async_smem()
 * in the writing thread (after its writes completed) before the barrier.
 */
#ifndef CF_ATTENTION_SM90_CUH
#define CF_ATTENTION_SM90_CUH

#include <math.h>
#include <string.h>

#include <cuda.h> /* CUtensorMap (a type only: nothing of libcuda is linked) */

#include "backend/cuda/attention/common.cuh"

/* True in device code compiled for sm_90a (wgmma, setmaxnreg), unless the
 * portable path is forced. */
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL) && !(defined(CF_CUDA_PORTABLE) && CF_CUDA_PORTABLE)
#define CF_SM90A_PATH 1
#else
#define CF_SM90A_PATH 0
#endif

/* ------------------------------------------------------------ layouts */

/* byte offset of element (r, col) in a swizzled tile of R rows */
__host__ __device__ __forceinline__ uint32_t sw128_off(int R, int r, int col) {
    return (uint32_t)((col >> 6) * R * 128 + r * 128 + ((((col & 63) >> 3) ^ (r & 7)) << 4) + (col & 7) * 2);
}

/* wgmma shared-memory descriptor, 128-byte swizzle (layout type 1 in bits
 * 62-63): start address, LBO and SBO in 16-byte units. */
__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
    return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}
/* K-major operand: k-step kk of a tile of R rows at saddr (rows r0.. with r0 % 8 == 0) */
__device__ __forceinline__ uint64_t desc_k(uint32_t saddr, int R, int r0, int kk) {
    return wg_desc(saddr + (kk >> 2) * R * 128 + r0 * 128 + (kk & 3) * 32, 16, 1024);
}
/* MN-major operand: k-step kk (rows 16kk..) of a tile of R rows, columns c0.. */
__device__ __forceinline__ uint64_t desc_mn(uint32_t saddr, int R, int c0, int kk) {
    return wg_desc(saddr + (c0 >> 6) * R * 128 + (c0 & 63) * 2 + kk * 2048, R * 128, 1024);
}

#if CF_SM90A_PATH
#define CF_SM90_ASM(...) asm volatile(__VA_ARGS__)
#else
#define CF_SM90_ASM(...) do { } while (0)
#endif

/* ------------------------------------------------------------- wgmma */

__device__ __forceinline__ void wgmma_fence() { CF_SM90_ASM("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { CF_SM90_ASM("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
    CF_SM90_ASM("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
/* makes the compiler treat d as written here (after a wgmma_wait) */
template <int R> __device__ __forceinline__ void fence_regs(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; i++) asm volatile("" : "+f"(d[i])::"memory");
}
template <int R> __device__ __forceinline__ void fence_regs(uint32_t (&d)[R][4]) {
#pragma unroll
    for (int i = 0; i < R; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) asm volatile("" : "+r"(d[i][e])::"memory");
}

/*
 * d (m64 x N fp32) (+)= A (m64 x k16) B (k16 x N), bf16.
 *   wgmma_ss<TA, TB>(d, desc A, desc B, accumulate): A and B in shared memory
 *   wgmma_rs<TB>(d, a regs, desc B, accumulate):      A in registers
 * TA / TB = 1: that operand is MN-major (transposed). accumulate = 0
 * ignores d's old value. N = 2 * (size of d): 32, 64 or 128.
 */
#if CF_SM90A_PATH
template <int TA, int TB>
__device__ __forceinline__ void wgmma_ss(float (&d)[16], uint64_t da, uint64_t db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, %19, %20;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "r"(accumulate), "n"(TA), "n"(TB)
        : "memory");
}

template <int TB>
__device__ __forceinline__ void wgmma_rs(float (&d)[16], const uint32_t (&a)[4], uint64_t db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, %22;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate), "n"(TB)
        : "memory");
}

template <int TA, int TB>
__device__ __forceinline__ void wgmma_ss(float (&d)[32], uint64_t da, uint64_t db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, %35, %36;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(accumulate), "n"(TA), "n"(TB)
        : "memory");
}

template <int TB>
__device__ __forceinline__ void wgmma_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate), "n"(TB)
        : "memory");
}

template <int TA, int TB>
__device__ __forceinline__ void wgmma_ss(float (&d)[64], uint64_t da, uint64_t db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %67, %68;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(accumulate), "n"(TA), "n"(TB)
        : "memory");
}

template <int TB>
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate), "n"(TB)
        : "memory");
}

#else
template <int TA, int TB, int R> __device__ __forceinline__ void wgmma_ss(float (&)[R], uint64_t, uint64_t, int) {}
template <int TB, int R> __device__ __forceinline__ void wgmma_rs(float (&)[R], const uint32_t (&)[4], uint64_t, int) {}
#endif

/* ----------------------------------------------------- async proxy, TMA */

/* orders this thread's shared-memory writes (ordinary or cp.async, already
 * complete) before later reads by wgmma or the copy engine */
__device__ __forceinline__ void fence_async_smem() { CF_SM90_ASM("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    CF_SM90_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
    CF_SM90_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    CF_SM90_ASM("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_tx(uint32_t bar, uint32_t bytes) {
    CF_SM90_ASM("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar),
                "r"(bytes)
                : "memory");
}
/* the try_wait loop of mbar_wait and mbar_wait_cluster; SEM: the ordering qualifiers */
#define CF_MBAR_WAIT_LOOP(SEM)                                                                                         \
    "{\n.reg .pred done;\n"                                                                                         \
    "LAB_WAIT:\n"                                                                                                     \
    "mbarrier.try_wait.parity" SEM ".shared::cta.b64 done, [%0], %1;\n"                                              \
    "@!done bra LAB_WAIT;\n}\n"
/* waits until the phase of the given parity has completed */
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
    CF_SM90_ASM(CF_MBAR_WAIT_LOOP("") ::"r"(bar), "r"(parity) : "memory");
}
/* TMA: a box of a 3-D tensor map at coordinates (c0, c1, c2), innermost
 * first, into shared memory, completing `bytes` on mbarrier bar */
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap *map, int c0, int c1, int c2,
                                            uint32_t bar) {
    CF_SM90_ASM(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(dst),
        "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
        : "memory");
}
__device__ __forceinline__ void tma_load_1d(uint32_t dst, const CUtensorMap *map, int c0, uint32_t bar) {
    CF_SM90_ASM(
        "cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2}], [%3];\n" ::"r"(
            dst),
        "l"((uint64_t)map), "r"(c0), "r"(bar)
        : "memory");
}

/* bulk reduction: dst[0 .. bytes/4) += src[...] (fp32, global <- shared),
 * issued by one thread; both addresses 16-byte aligned */
__device__ __forceinline__ void bulk_reduce_add_f32(float *dst, uint32_t src, uint32_t bytes) {
    CF_SM90_ASM("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
                "r"(bytes)
                : "memory");
}
__device__ __forceinline__ void bulk_commit() { CF_SM90_ASM("cp.async.bulk.commit_group;\n" ::: "memory"); }
/* waits until the issuing thread's bulk operations have read their source */
__device__ __forceinline__ void bulk_wait_read() { CF_SM90_ASM("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
/* waits until they have completed */
__device__ __forceinline__ void bulk_wait_all() { CF_SM90_ASM("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

/* --------------------------------------------- clusters of two blocks */

/* this block's rank in its cluster */
__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r = 0;
    CF_SM90_ASM("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}
/* every thread of every block of the cluster (release, then acquire) */
__device__ __forceinline__ void cluster_sync() {
    CF_SM90_ASM("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
/* the address of the same shared-memory byte in block `rank` of the cluster */
__device__ __forceinline__ uint32_t peer_smem(uint32_t saddr, uint32_t rank) {
    uint32_t r = 0;
    CF_SM90_ASM("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(saddr), "r"(rank));
    return r;
}
/* an arrival at another block's mbarrier (an address from peer_smem),
 * releasing this thread's earlier writes to the cluster */
__device__ __forceinline__ void mbar_arrive_peer(uint32_t bar) {
    CF_SM90_ASM("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
/* mbar_wait, acquiring what the cluster's arrivals released */
__device__ __forceinline__ void mbar_wait_cluster(uint32_t bar, int parity) {
    CF_SM90_ASM(CF_MBAR_WAIT_LOOP(".acquire.cluster") ::"r"(bar), "r"(parity) : "memory");
}
/* two floats from another block's shared memory (an address from peer_smem) */
__device__ __forceinline__ float2 ld_peer_f2(uint32_t addr) {
    float2 v = make_float2(0.f, 0.f);
    CF_SM90_ASM("ld.shared::cluster.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
    return v;
}

/* --------------------------------------------------- warps, registers */

/* barrier `id` (1..15) among `count` threads (whole warps) */
__device__ __forceinline__ void named_barrier(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
/* arrives at barrier `id` without waiting (producer side of a hand-off) */
__device__ __forceinline__ void named_barrier_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
/* Ping-pong turns among N consumer warpgroups (w = 0..N-1), on named
 * barriers BAR0 .. BAR0+N-1: warpgroup w takes its turn (waits), issues
 * its products, passes the turn to w+1 (mod N), in the order 0, 1, ..,
 * N-1, 0, ... Barrier w completes with warpgroup w's 128 threads waiting
 * and warpgroup w-1's 128 arriving. Warpgroup N-1 opens the first turn
 * and warpgroup 0 closes after the last one (so every barrier ends
 * complete; every warpgroup takes the same number of turns). No branch
 * around a pass: ptxas serialises the products when its own warpgroup
 * arrives fall in a divergent path. ON = false makes every call nothing. */
template <int N, int BAR0, bool ON> struct Turns {
    int w;
    __device__ __forceinline__ void open() const {
        if (ON && w == N - 1) named_barrier_arrive(BAR0, 256);
    }
    __device__ __forceinline__ void take() const {
        if (ON) named_barrier(BAR0 + w, 256);
    }
    __device__ __forceinline__ void pass() const {
        if (ON) named_barrier_arrive(BAR0 + (w + 1) % N, 256);
    }
    __device__ __forceinline__ void close() const {
        if (ON && w == 0) named_barrier(BAR0, 256);
    }
};
template <int N> __device__ __forceinline__ void setmaxnreg_inc() {
    CF_SM90_ASM("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void setmaxnreg_dec() {
    CF_SM90_ASM("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
/* ------------------------------------------- dq accumulator, slot order
 * (bwd_sm90.cu): the start of the slot of (sequence b, head h, 64-row
 * query tile q64), and the position of element (r, c) in it when the dQ
 * products are nw columns wide */
__host__ __device__ __forceinline__ size_t dq_slot_base(int b, int h, int q64, int H, int D, int tps) {
    return (((size_t)b * H + h) * tps + q64) * (64 * (size_t)D);
}
__host__ __device__ __forceinline__ int dq_slot_index(int r, int c, int nw) {
    const int cc = c % nw, j = cc >> 3, t = (cc & 7) >> 1;
    return (c / nw) * (64 * nw) + ((j * 128 + (r >> 4) * 32 + (r & 7) * 4 + t) * 4 + ((r >> 3) & 1) * 2 + (c & 1));
}
/* The inverse, by float4: float4 k of a slot holds (r, c), (r, c + 1),
 * (r + 8, c), (r + 8, c + 1). Within a 64 x nw block (16 nw float4s),
 * k = 128 j + 32 v + 4 g + t is accumulators 4j.. of warpgroup thread
 * 32 v + 4 g + t: r = 16 v + g, c = 8 j + 2 t (the fragment map above). */
__host__ __device__ __forceinline__ void dq_slot_coords(int k, int nw, int *r, int *c) {
    const int blk = k / (16 * nw), F = k % (16 * nw);
    *r = 16 * ((F >> 5) & 3) + ((F >> 2) & 7);
    *c = blk * nw + 8 * (F >> 7) + 2 * (F & 3);
}

/* Part `part` of ns of a key tile's n query tiles: tiles [*begin, *begin +
 * *len) counted from the first; the parts cover the n tiles once, in order,
 * their lengths differing by at most one (a part may be empty). */
__host__ __device__ __forceinline__ void query_part(int n, int part, int ns, int *begin, int *len) {
    *begin = part * n / ns;
    *len = (part + 1) * n / ns - *begin;
}

/* A search by a warp for the number of kept rows before the j-th filtered
 * row (centrifuge's prep, bwd_centrifuge_sm90.cu): the smallest i in [0, n]
 * with rows[i] - i > j (kept row i has rows[i] - i filtered rows before it;
 * n if none). The answer stays in [lo, hi], from [0, n]; each round lane l
 * probes p = kept_search_probe(lo, hi, l) (a hit: p >= hi or rows[p] - p >
 * j), the warp's hits go to kept_search_narrow as a ballot mask, until lo
 * == hi. 32 probes a round, so three dependent loads cover 32768 kept rows
 * where a binary search would wait on 15. */
__host__ __device__ __forceinline__ int kept_search_probe(int lo, int hi, int lane) {
    return lo + (hi - lo + 31) / 32 * (lane + 1) - 1;
}
/* false when the search is over (no hit: lane 31 probed hi - 1 and missed,
 * so the answer is hi; lo = hi then) */
__host__ __device__ __forceinline__ bool kept_search_narrow(int *lo, int *hi, unsigned hit) {
    if (!hit) {
        *lo = *hi;
        return false;
    }
#ifdef __CUDA_ARCH__
    const int k = __ffs(hit) - 1; /* the first lane with a hit */
#else
    const int k = __builtin_ctz(hit);
#endif
    const int step = (*hi - *lo + 31) / 32;
    *hi = *lo + step * (k + 1) - 1 < *hi ? *lo + step * (k + 1) - 1 : *hi;
    *lo += step * k;
    return true;
}

/* ---------------------------------------- the backward's launch plan
 * (bwd_sm90.cu: attn_sm90_bwd_plan, which documents the why). hpb query
 * heads of one kv group per block, and ns parts of each key tile's query
 * range, each its own block. Host only. */
struct BwdPlan {
    int hpb, ns;
};

/* The plan's cost model, in units of one step (BM queries x BN keys, five
 * products; about 2 us on an H100): a block costs BWD_COST_BLOCK plus one
 * per step, and each MB of fp32 dk, dv partials (written by the kernel,
 * read by the reduction) BWD_COST_MB. Fitted to 12 shapes x up to 8
 * plans timed on an H100 (runs 22-24, docs/HOPPER_ATTENTION.md); the plans
 * at those shapes stay the same for any block cost in 1 .. 4 steps and
 * 0.15 .. 0.35 steps per MB (tests/gpu/host_bwd_parts.cu). */
#define BWD_COST_BLOCK 2.25
#define BWD_COST_MB 0.25
#define BWD_COST_MAX_SMS 1024

/* The main backward kernel's grid played as the block scheduler plays it:
 * its blocks, in launch order (head groups fastest, then key tiles and
 * their parts, then sequences), each go to the SM that frees first (a
 * min-heap of the SMs' finishing times). Key tiles of BN rows up to kmaxlen
 * per sequence; tile j sees the query tiles (BM rows) after the fraction
 * j BN / kmaxlen of qmaxlen (exact for the causal full backward, the mean
 * for kept lists). Returns the span (the last SM's finish); *busy the
 * SMs' busy time summed. */
inline double bwd_grid_play(int BN, int BM, int H, int B, int qmaxlen, int kmaxlen, int hpb, int ns, int sms,
                            double *busy) {
    double heap[BWD_COST_MAX_SMS];
    const int m = sms < 1 ? 1 : sms > BWD_COST_MAX_SMS ? BWD_COST_MAX_SMS : sms;
    for (int i = 0; i < m; i++) heap[i] = 0.0;
    const int ktiles = (kmaxlen + BN - 1) / BN, qtiles = (qmaxlen + BM - 1) / BM;
    for (int b = 0; b < B; b++)
        for (int j = 0; j < ktiles; j++) {
            const int n = qtiles - (int)((long long)qmaxlen * j * BN / kmaxlen / BM);
            for (int sp = 0; sp < ns; sp++) {
                int begin, len;
                query_part(n, sp, ns, &begin, &len);
                const double dur = (double)hpb * len + BWD_COST_BLOCK;
                for (int x = 0; x < H / hpb; x++) {
                    /* the SM that frees first takes the block: its time
                     * grows, sift it down */
                    double v = heap[0] + dur;
                    int i = 0;
                    for (;;) {
                        int c = 2 * i + 1;
                        if (c >= m) break;
                        if (c + 1 < m && heap[c + 1] < heap[c]) c++;
                        if (heap[c] >= v) break;
                        heap[i] = heap[c];
                        i = c;
                    }
                    heap[i] = v;
                }
            }
        }
    double span = 0.0, sum = 0.0;
    for (int i = 0; i < m; i++) {
        span = heap[i] > span ? heap[i] : span;
        sum += heap[i];
    }
    if (busy) *busy = sum;
    return span;
}

/* The MB of fp32 dk, dv partials: H/hpb x ns of them per key row, written
 * by the kernel and read by the reduction; none where one block holds a kv
 * head's whole group in one part (hpb = H / Hkv, ns = 1: it writes dk, dv
 * itself) */
inline double bwd_partials_mb(int H, int Hkv, int D, int B, int kmaxlen, int hpb, int ns) {
    if (H / hpb == Hkv && ns == 1) return 0.0;
    return ((double)B * kmaxlen * (H / hpb) * ns * D * 8) / 1e6;
}

/* The estimated time of the main backward kernel alone: the grid's span
 * plus the partials (pairs, which sum two partials on chip, are not
 * modelled: the plans this chooses were fitted without them) */
inline double bwd_grid_cost(int BN, int BM, int H, int Hkv, int D, int B, int qmaxlen, int kmaxlen, int hpb, int ns,
                            int sms) {
    return bwd_grid_play(BN, BM, H, B, qmaxlen, kmaxlen, hpb, ns, sms, NULL) +
           BWD_COST_MB * bwd_partials_mb(H, Hkv, D, B, kmaxlen, hpb, ns);
}

/* Centrifuge's part 2 (bwd_centrifuge_sm90.cu) in the same units: per
 * sequence and head, items of 128 kept queries, each over the filtered
 * keys before its last query in tiles of 128 (D = 64) or 64 keys (D = 128),
 * one step's area either way; BWD_COST_PART2 of a step each (three
 * products to part 1's five: 1.57 against 2.77 us at D = 64 in run 32's
 * timeline). Kept rows spread evenly: item i's last query is at the
 * fraction (i + 1) 128 / qmaxlen of its sequence. */
#define BWD_COST_PART2 0.57
inline double bwd_part2_cost(int D, int H, int B, int qmaxlen, int flen) {
    const int BN2 = D == 64 ? 128 : 64, items = (qmaxlen + 127) / 128;
    double tiles = 0.0;
    for (int i = 0; i < items; i++) {
        const double before = (double)flen * ((i + 1) * 128.0 < qmaxlen ? (i + 1) * 128.0 / qmaxlen : 1.0);
        tiles += ceil(before / BN2);
    }
    return tiles * H * B * BWD_COST_PART2;
}

/* The estimated time of centrifuge's two parts side by side: part 2 is a
 * persistent grid that fills whatever time part 1's blocks leave on the
 * SMs, so the two end at the later of part 1's span and their summed work
 * spread over every SM. Partials at BWD_COST_MB_BESIDE per MB, except where
 * a kv head has exactly two (two groups in one part, or one group in two
 * parts): pairs of blocks sum those on chip. Fitted to 42 plans timed at
 * the three models' shapes with 1, 2 and 4 sequences (run 34, H200): it
 * picks the fastest at every shape, or one within 1%, for a partials cost
 * of 0.38 .. 0.7 steps per MB (the plans of Qwen2.5-1.5B's shape and of
 * TinyLlama's bound it; tests/gpu/host_bwd_parts.cu). */
#define BWD_COST_MB_BESIDE 0.5
inline double bwd_beside_cost(int BN, int BM, int H, int Hkv, int D, int B, int qmaxlen, int kmaxlen, int flen,
                              int hpb, int ns, int sms) {
    double busy;
    const double span = bwd_grid_play(BN, BM, H, B, qmaxlen, kmaxlen, hpb, ns, sms, &busy);
    const int m = sms < 1 ? 1 : sms > BWD_COST_MAX_SMS ? BWD_COST_MAX_SMS : sms;
    const double fill = (busy + bwd_part2_cost(D, H, B, qmaxlen, flen)) / m;
    const int groups = H / Hkv / hpb;
    const bool pair = (groups == 2 && ns == 1) || (groups == 1 && ns == 2);
    const double partials = pair ? 0.0 : BWD_COST_MB_BESIDE * bwd_partials_mb(H, Hkv, D, B, kmaxlen, hpb, ns);
    return (span > fill ? span : fill) + partials;
}

/* The plan (bwd_sm90.cu: attn_sm90_bwd_plan). Candidates: hpb of 4 (head
 * dim 64 only: slower at 128 on a full grid), 3, 2 and 1 that divide the
 * GQA group H / Hkv, ns of 1 and 2; the cheapest by bwd_grid_cost, or by
 * bwd_beside_cost where centrifuge's part 2 runs beside this kernel over
 * flen > 0 filtered keys per sequence (their mean) (0: it does not); the first
 * of equals (more heads, fewer parts). hpb_forced / ns_forced > 0 force
 * them (a forced hpb falls to the next lower divisor of the group; ns at
 * most 2); arguments as bwd_grid_cost's. */
inline BwdPlan bwd_plan(int D, int BN, int BM, int H, int Hkv, int B, int qmaxlen, int kmaxlen, int sms, int flen,
                        int hpb_forced, int ns_forced) {
    BwdPlan best = {1, 1};
    if (H <= 0 || Hkv <= 0 || H % Hkv || B <= 0 || qmaxlen <= 0 || kmaxlen <= 0 || BN <= 0 || BM <= 0) return best;
    const int G = H / Hkv;
    int hmax = D == 64 ? 4 : 3, hmin = 1;
    if (hpb_forced > 0) {
        hmax = hpb_forced < G ? hpb_forced : G;
        while (hmax > 1 && G % hmax) hmax--;
        hmin = hmax;
    }
    const int nmin = ns_forced > 0 ? (ns_forced > 2 ? 2 : ns_forced) : 1;
    const int nmax = ns_forced > 0 ? nmin : 2;
    double cost = 0.0;
    bool any = false;
    for (int hpb = hmax; hpb >= hmin; hpb--) {
        if (G % hpb) continue;
        for (int ns = nmin; ns <= nmax; ns++) {
            const double c = flen > 0
                                 ? bwd_beside_cost(BN, BM, H, Hkv, D, B, qmaxlen, kmaxlen, flen, hpb, ns, sms)
                                 : bwd_grid_cost(BN, BM, H, Hkv, D, B, qmaxlen, kmaxlen, hpb, ns, sms);
            if (!any || c < cost) {
                best = BwdPlan{hpb, ns};
                cost = c;
                any = true;
            }
        }
    }
    return best;
}

/* ---------------------------------------------------------- host side */

/* Tensor maps for the kernels: a [rows, heads, D] bf16 tensor read in
 * boxes of 64 columns x 1 head x box_rows rows with the 128-byte swizzle,
 * and a [n] int32 vector read in boxes of box_n. Elements past the end
 * read as zero. false when the driver refuses (the caller falls back to the
 * portable kernels). Defined in launch_sm90.cu. */
bool attn_sm90_map_rows(CUtensorMap *map, const void *base, int rows, int heads, int D, int box_rows);
bool attn_sm90_map_ints(CUtensorMap *map, const void *base, int n, int box_n);
/* Raises the dynamic shared-memory limit of kernel fn once per context
 * (bit `which` of ctx->attn_sm90_attr_done, one per kernel variant that
 * may run: SM90_ATTR_*); false on an error (recorded). */
bool attn_sm90_prepare(cf_cuda_ctx *ctx, const void *fn, size_t smem, int which);
enum {
    SM90_ATTR_FWD64 = 0,          /* forward, D = 64, two consumers   */
    SM90_ATTR_FWD128 = 1,         /* forward, D = 128                 */
    SM90_ATTR_BWD128 = 2,         /* backward main kernel, D = 128    */
    SM90_ATTR_BWD64_BM64 = 3,     /* backward, D = 64, 64-query steps */
    SM90_ATTR_DQ64 = 4,           /* centrifuge part 2, D = 64        */
    SM90_ATTR_DQ128_TURNS = 5,    /* part 2, D = 128, ping-pong turns */
    SM90_ATTR_BWD64_BM128 = 6,    /* backward, D = 64, 128-query steps */
    SM90_ATTR_FWD64_WG3 = 7,      /* forward, D = 64, three consumers */
    SM90_ATTR_DQ64_TURNS = 8,     /* part 2, D = 64, ping-pong turns  */
    SM90_ATTR_DQ128 = 9,          /* part 2, D = 128                  */
};

#endif /* CF_ATTENTION_SM90_CUH */
