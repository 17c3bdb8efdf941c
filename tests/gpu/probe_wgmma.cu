/*
 * probe_wgmma.cu — unit checks of the Hopper building blocks in
 * src/backend/cuda/attention/sm90.cuh, each against a CPU product in double:
 *   1. wgmma, A and B from shared memory, both K-major (S = Q K^T), N = 128,
 *      head dim 128 (two 64-column blocks: the k-step addressing)
 *   2. wgmma, A from registers, B MN-major (O = P V), N = 128 (LBO: the
 *      second 64-column block); also with LBO and SBO swapped, to report
 *      which one the hardware reads if the first fails
 *   3. wgmma, A and B MN-major (dQ = dS K from dS^T in shared memory), N = 32
 *      at column 32 (a start inside a swizzle row) and N = 64 at column 64
 *   4. TMA: a box of a [rows, heads, 128] tensor into the swizzled layout
 *      (rows past the end read as zero), and a box of an int vector
 * Needs an sm_90 GPU; prints one line per check and exits 1 on a failure.
 *   build/cuda/tests/probe_wgmma
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "backend/cuda/attention/sm90.cuh"

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
    printf("%s: %s\n", #x, cudaGetErrorString(e_)); exit(1); } } while (0)

static __device__ __forceinline__ uint32_t pack2(const bf16 *p) {
    return *reinterpret_cast<const uint32_t *>(p);
}

/* stores a row-major [R][C] global array into a swizzled tile at s */
static __device__ void fill_tile(unsigned char *s, const bf16 *g, int R, int C) {
    for (int i = threadIdx.x; i < R * C; i += blockDim.x) {
        int r = i / C, c = i % C;
        *reinterpret_cast<bf16 *>(s + sw128_off(R, r, c)) = g[i];
    }
}
/* writes accumulators d (m64 x N) to row-major out with leading dim ld */
template <int R>
static __device__ void store_acc(float *out, int ld, const float (&d)[R]) {
    const int v = threadIdx.x >> 5, l = threadIdx.x & 31, g = l >> 2, t = l & 3;
#pragma unroll
    for (int j = 0; j < R / 4; j++) {
        out[(16 * v + g) * ld + 8 * j + 2 * t] = d[4 * j];
        out[(16 * v + g) * ld + 8 * j + 2 * t + 1] = d[4 * j + 1];
        out[(16 * v + g + 8) * ld + 8 * j + 2 * t] = d[4 * j + 2];
        out[(16 * v + g + 8) * ld + 8 * j + 2 * t + 1] = d[4 * j + 3];
    }
}
static __device__ unsigned char *aligned_smem() {
    extern __shared__ unsigned char smem_raw[];
    return smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
}

/* 1: C[64][128] = A[64][128] B[128][128]^T */
static __global__ void probe_ss_k(const bf16 *A, const bf16 *B, float *C) {
    unsigned char *s = aligned_smem();
    unsigned char *sa = s, *sb = s + 64 * 128 * 2;
    fill_tile(sa, A, 64, 128);
    fill_tile(sb, B, 128, 128);
    fence_async_smem();
    __syncthreads();
    float d[64];
#pragma unroll
    for (int i = 0; i < 64; i++) d[i] = 0.f;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 8; kk++) wgmma_ss<0, 0>(d, desc_k(smem_u32(sa), 64, 0, kk), desc_k(smem_u32(sb), 128, 0, kk), kk > 0);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(d);
    store_acc(C, 128, d);
}

/* 2: C[64][128] = A[64][64] (registers) B[64][128] (MN-major); swap: LBO <-> SBO */
static __global__ void probe_rs_mn(const bf16 *A, const bf16 *B, float *C, int swap) {
    unsigned char *s = aligned_smem();
    fill_tile(s, B, 64, 128);
    fence_async_smem();
    __syncthreads();
    const int v = threadIdx.x >> 5, l = threadIdx.x & 31, g = l >> 2, t = l & 3;
    uint32_t a[4][4];
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        const bf16 *r0 = A + (16 * v + g) * 64 + 16 * kk + 2 * t, *r8 = r0 + 8 * 64;
        a[kk][0] = pack2(r0);
        a[kk][1] = pack2(r8);
        a[kk][2] = pack2(r0 + 8);
        a[kk][3] = pack2(r8 + 8);
    }
    float d[64];
#pragma unroll
    for (int i = 0; i < 64; i++) d[i] = 0.f;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        uint64_t db = swap ? wg_desc(smem_u32(s) + kk * 2048, 1024, 64 * 128) : desc_mn(smem_u32(s), 64, 0, kk);
        wgmma_rs<1>(d, a[kk], db, 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(d);
    store_acc(C, 128, d);
}

/* 3: At = A^T stored [128][64]; C1[64][32] = A B[:, 32:64], C2[64][64] = A B[:, 64:128], B [128][128] */
static __global__ void probe_ss_mn(const bf16 *At, const bf16 *B, float *C1, float *C2) {
    unsigned char *s = aligned_smem();
    unsigned char *sa = s, *sb = s + 128 * 64 * 2;
    fill_tile(sa, At, 128, 64);
    fill_tile(sb, B, 128, 128);
    fence_async_smem();
    __syncthreads();
    float d1[16], d2[32];
#pragma unroll
    for (int i = 0; i < 16; i++) d1[i] = 0.f;
#pragma unroll
    for (int i = 0; i < 32; i++) d2[i] = 0.f;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 8; kk++) {
        wgmma_ss<1, 1>(d1, desc_mn(smem_u32(sa), 128, 0, kk), desc_mn(smem_u32(sb), 128, 32, kk), kk > 0);
        wgmma_ss<1, 1>(d2, desc_mn(smem_u32(sa), 128, 0, kk), desc_mn(smem_u32(sb), 128, 64, kk), kk > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(d1);
    fence_regs(d2);
    store_acc(C1, 32, d1);
    store_acc(C2, 64, d2);
}

/* 4: TMA box (64 cols from col 64, head 1, 128 rows from row 100) of X [200][3][128];
 * and ints 64..79 of a vector of 70 */
static __global__ void probe_tma(const __grid_constant__ CUtensorMap mx, const __grid_constant__ CUtensorMap mi,
                                 bf16 *out, int *iout) {
    unsigned char *s = aligned_smem();
    __shared__ __align__(8) uint64_t bar;
    const uint32_t b = smem_u32(&bar);
    if (threadIdx.x == 0) {
        mbar_init(b, 1);
        mbar_init_fence();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbar_arrive_tx(b, 128 * 128 + 16 * 4);
        tma_load_3d(smem_u32(s), &mx, 64, 1, 100, b);
        tma_load_1d(smem_u32(s) + 128 * 128, &mi, 64, b);
    }
    mbar_wait(b, 0);
    for (int i = threadIdx.x; i < 128 * 64; i += blockDim.x)
        out[i] = *reinterpret_cast<const bf16 *>(s + sw128_off(128, i / 64, i % 64));
    if (threadIdx.x < 16) iout[threadIdx.x] = reinterpret_cast<const int *>(s + 128 * 128)[threadIdx.x];
}

static __global__ void probe_arch(int *flag) { *flag = CF_SM90A_PATH; }

/* ------------------------------------------------------------------ host */

static float bf(float x) { return __bfloat162float(__float2bfloat16(x)); }
static bf16 *dev_rand(float *h, size_t n, unsigned *seed) {
    bf16 *hb = (bf16 *)malloc(n * sizeof(bf16));
    for (size_t i = 0; i < n; i++) {
        *seed = *seed * 1664525u + 1013904223u;
        h[i] = bf(((int)(*seed >> 9) % 2001 - 1000) / 500.f);
        hb[i] = __float2bfloat16(h[i]);
    }
    bf16 *d;
    CK(cudaMalloc(&d, n * sizeof(bf16)));
    CK(cudaMemcpy(d, hb, n * sizeof(bf16), cudaMemcpyHostToDevice));
    free(hb);
    return d;
}
static float *dev_f(size_t n) {
    float *d;
    CK(cudaMalloc(&d, n * 4));
    CK(cudaMemset(d, 0xff, n * 4)); /* NaN: unwritten elements fail */
    return d;
}
/* rel = max |got - ref| / max |ref| for C = op(A) op(B) given as ref */
static int report(const char *name, const float *dgot, const double *ref, size_t n) {
    float *got = (float *)malloc(n * 4);
    CK(cudaMemcpy(got, dgot, n * 4, cudaMemcpyDeviceToHost));
    double md = 0, mr = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs(got[i] - ref[i]);
        if (!(e <= md)) md = e; /* NaN sticks */
        if (fabs(ref[i]) > mr) mr = fabs(ref[i]);
    }
    double rel = md / mr;
    int ok = rel < 1e-3;
    printf("%-58s rel %.2e  %s\n", name, rel, ok ? "PASS" : "FAIL");
    free(got);
    return ok;
}

int main(void) {
    int dev = 0;
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, dev));
    printf("device: %s (cc %d.%d)\n", prop.name, prop.major, prop.minor);
    int *dflag, flag = 0;
    CK(cudaMalloc(&dflag, 4));
    probe_arch<<<1, 1>>>(dflag);
    CK(cudaMemcpy(&flag, dflag, 4, cudaMemcpyDeviceToHost));
    printf("sm_90a code in this binary runs here: %s\n", flag ? "yes" : "no");
    if (!flag) return 1;
    const int SM = 100 * 1024;
    CK(cudaFuncSetAttribute(probe_ss_k, cudaFuncAttributeMaxDynamicSharedMemorySize, SM));
    CK(cudaFuncSetAttribute(probe_rs_mn, cudaFuncAttributeMaxDynamicSharedMemorySize, SM));
    CK(cudaFuncSetAttribute(probe_ss_mn, cudaFuncAttributeMaxDynamicSharedMemorySize, SM));
    CK(cudaFuncSetAttribute(probe_tma, cudaFuncAttributeMaxDynamicSharedMemorySize, SM));
    unsigned seed = 12345;
    int ok = 1;

    { /* 1 */
        float *A = (float *)malloc(64 * 128 * 4), *B = (float *)malloc(128 * 128 * 4);
        bf16 *dA = dev_rand(A, 64 * 128, &seed), *dB = dev_rand(B, 128 * 128, &seed);
        float *dC = dev_f(64 * 128);
        probe_ss_k<<<1, 128, SM>>>(dA, dB, dC);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        double *ref = (double *)malloc(64 * 128 * 8);
        for (int m = 0; m < 64; m++)
            for (int n = 0; n < 128; n++) {
                double s = 0;
                for (int k = 0; k < 128; k++) s += (double)A[m * 128 + k] * B[n * 128 + k];
                ref[m * 128 + n] = s;
            }
        ok &= report("1 ss K-major x K-major, m64n128, K=128", dC, ref, 64 * 128);
    }
    { /* 2 */
        float *A = (float *)malloc(64 * 64 * 4), *B = (float *)malloc(64 * 128 * 4);
        bf16 *dA = dev_rand(A, 64 * 64, &seed), *dB = dev_rand(B, 64 * 128, &seed);
        double *ref = (double *)malloc(64 * 128 * 8);
        for (int m = 0; m < 64; m++)
            for (int n = 0; n < 128; n++) {
                double s = 0;
                for (int k = 0; k < 64; k++) s += (double)A[m * 64 + k] * B[k * 128 + n];
                ref[m * 128 + n] = s;
            }
        for (int swap = 0; swap < 2; swap++) {
            float *dC = dev_f(64 * 128);
            probe_rs_mn<<<1, 128, SM>>>(dA, dB, dC, swap);
            CK(cudaGetLastError());
            CK(cudaDeviceSynchronize());
            int r = report(swap ? "2b rs x MN-major, LBO/SBO swapped (expected to fail)"
                                : "2 rs x MN-major, m64n128, K=64", dC, ref, 64 * 128);
            if (!swap) ok &= r;
        }
    }
    { /* 3 */
        float *At = (float *)malloc(128 * 64 * 4), *B = (float *)malloc(128 * 128 * 4);
        bf16 *dAt = dev_rand(At, 128 * 64, &seed), *dB = dev_rand(B, 128 * 128, &seed);
        float *dC1 = dev_f(64 * 32), *dC2 = dev_f(64 * 64);
        probe_ss_mn<<<1, 128, SM>>>(dAt, dB, dC1, dC2);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        double *r1 = (double *)malloc(64 * 32 * 8), *r2 = (double *)malloc(64 * 64 * 8);
        for (int m = 0; m < 64; m++) {
            for (int n = 0; n < 32; n++) {
                double s = 0;
                for (int k = 0; k < 128; k++) s += (double)At[k * 64 + m] * B[k * 128 + 32 + n];
                r1[m * 32 + n] = s;
            }
            for (int n = 0; n < 64; n++) {
                double s = 0;
                for (int k = 0; k < 128; k++) s += (double)At[k * 64 + m] * B[k * 128 + 64 + n];
                r2[m * 64 + n] = s;
            }
        }
        ok &= report("3a ss MN-major x MN-major, m64n32 at column 32, K=128", dC1, r1, 64 * 32);
        ok &= report("3b ss MN-major x MN-major, m64n64 at column 64, K=128", dC2, r2, 64 * 64);
    }
    { /* 4 */
        const int rows = 200, heads = 3, D = 128;
        float *X = (float *)malloc((size_t)rows * heads * D * 4);
        bf16 *dX = dev_rand(X, (size_t)rows * heads * D, &seed);
        int hi[70], *di, *dio;
        for (int i = 0; i < 70; i++) hi[i] = 1000 + 7 * i;
        CK(cudaMalloc(&di, sizeof hi));
        CK(cudaMemcpy(di, hi, sizeof hi, cudaMemcpyHostToDevice));
        CK(cudaMalloc(&dio, 16 * 4));
        CUtensorMap mx, mi;
        if (!attn_sm90_map_rows(&mx, dX, rows, heads, D, 128) || !attn_sm90_map_ints(&mi, di, 70, 16)) {
            printf("4 TMA: tensor map encoding failed  FAIL\n");
            return 1;
        }
        bf16 *dout;
        CK(cudaMalloc(&dout, 128 * 64 * 2));
        probe_tma<<<1, 128, SM>>>(mx, mi, dout, dio);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        bf16 *ho = (bf16 *)malloc(128 * 64 * 2);
        int io[16];
        CK(cudaMemcpy(ho, dout, 128 * 64 * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(io, dio, sizeof io, cudaMemcpyDeviceToHost));
        int bad = 0;
        for (int r = 0; r < 128; r++)
            for (int c = 0; c < 64; c++) {
                int row = 100 + r;
                float want = row < rows ? X[((size_t)row * heads + 1) * D + 64 + c] : 0.f;
                if (__bfloat162float(ho[r * 64 + c]) != want) bad++;
            }
        for (int i = 0; i < 16; i++)
            if (io[i] != (64 + i < 70 ? hi[64 + i] : 0)) bad++;
        printf("%-58s %d wrong  %s\n", "4 TMA box into the swizzled tile, int vector box", bad, bad ? "FAIL" : "PASS");
        ok &= bad == 0;
    }
    printf("probe_wgmma: %s\n", ok ? "all passed" : "FAILED");
    return ok ? 0 : 1;
}
