/*
 * backend_cuda.cu — the CUDA backend: bf16 activations and compute weights,
 * fp32 master weights, gradients, optimizer state and statistics.
 *
 * Every op runs on the legacy default stream, in order, so the driver needs
 * no stream handling and a cudaEvent on stream 0 times anything. GEMMs go
 * through cuBLASLt (bf16 inputs, fp32 compute); everything else is a small
 * kernel in this file, except attention (attention_cuda.cu).
 *
 * Errors. The ops return void (backend.h), and a CUDA error leaves the
 * context unusable, so a failed CUDA or cuBLASLt call in an op is fatal: it
 * sets cf_fail("<call>: <error string>"), prints it and exits. alloc is the
 * exception: out of memory returns NULL with cf_fail, as backend.h says.
 *
 * Determinism. Every op gives bitwise-identical results run to run, except
 * attention backward's dq (fp32 atomics across key tiles) and whatever
 * cuBLASLt chooses (its heuristics pick the same algorithm for the same
 * problem, and no split-K reduction order changes between runs).
 */
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cublasLt.h>
#include <cub/device/device_radix_sort.cuh>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

extern "C" {
#include "common.h"
#include "backend.h"
}

typedef __nv_bfloat16 bf16;

/* ---- implemented in attention_cuda.cu ---- */
extern "C" void cf_cuda_attention_fwd(cf_backend *b, void *out, float *lse, const void *q, const void *k,
                                      const void *v, const cf_attn_shape *s);
extern "C" void cf_cuda_attention_bwd(cf_backend *b, void *dq, void *dk, void *dv, const void *dout,
                                      const void *q, const void *k, const void *v, const void *out,
                                      const float *lse, const cf_attn_shape *s, const cf_rows *kept,
                                      cf_attn_bwd_mode mode);

/* ================================================================ errors */

void cf_cuda_check(cudaError_t e, const char *what, const char *file, int line) {
    if (e == cudaSuccess) return;
    cf_fail("%s: %s (%s:%d)", what, cudaGetErrorString(e), file, line);
    fprintf(stderr, "centrifuge: fatal CUDA error: %s\n", cf_last_error());
    exit(1);
}
static void lt_check(cublasStatus_t s, const char *what, const char *file, int line) {
    if (s == CUBLAS_STATUS_SUCCESS) return;
    cf_fail("%s: %s (%s:%d)", what, cublasGetStatusString(s), file, line);
    fprintf(stderr, "centrifuge: fatal cuBLASLt error: %s\n", cf_last_error());
    exit(1);
}
#define CK(call) cf_cuda_check((call), #call, __FILE__, __LINE__)
#define CK_LAUNCH() cf_cuda_check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)
#define LT(call) lt_check((call), #call, __FILE__, __LINE__)

/* ================================================================= state */

#define NSCRATCH 32   /* slots 0..15 here, 16.. attention_cuda.cu */
enum { SCR_PARTIAL = 0, SCR_SUMSQ, SCR_SORT_KEYS, SCR_SORT_VALS, SCR_SORT_TMP, SCR_IOTA, SCR_LOGITS, SCR_DLOGITS,
       SCR_GATHER_DESC };

#define GEMM_CACHE 128
typedef struct {
    int key[16];
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c, d;
    cublasLtMatmulAlgo_t algo;
} gemm_plan;

typedef struct {
    cublasLtHandle_t lt;
    void *workspace;
    size_t workspace_size;
    int sm_count;
    struct { void *p; size_t cap; } scratch[NSCRATCH];
    gemm_plan plans[GEMM_CACHE];
    int nplans;
    size_t mem_peak;   /* device memory in use (cudaMemGetInfo), max over sync points */
} cuda_state;

static cuda_state *ST(cf_backend *b) { return (cuda_state *)b->state; }

/* A device buffer per slot that only grows. Growing frees the old buffer,
 * which synchronizes the device: fine, it happens in the first steps only. */
void *cf_cuda_scratch(cf_backend *b, int slot, size_t bytes) {
    cuda_state *st = ST(b);
    if (bytes == 0) bytes = 16;
    if (st->scratch[slot].cap < bytes) {
        if (st->scratch[slot].p) CK(cudaFree(st->scratch[slot].p));
        st->scratch[slot].p = NULL;
        size_t cap = (bytes + ((size_t)1 << 20) - 1) & ~(((size_t)1 << 20) - 1);
        CK(cudaMalloc(&st->scratch[slot].p, cap));
        st->scratch[slot].cap = cap;
    }
    return st->scratch[slot].p;
}

static int grid_for(size_t n, int threads) {
    size_t blocks = (n + threads - 1) / threads;
    if (blocks == 0) blocks = 1;
    return (int)(blocks < 65536 * 4 ? blocks : 65536 * 4);
}

/* ================================================================ memory */

static void *cu_alloc(cf_backend *b, size_t bytes) {
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 16);
    if (e != cudaSuccess) {
        cudaGetLastError();
        cf_fail("cudaMalloc(%zu bytes): %s", bytes, cudaGetErrorString(e));
        return NULL;
    }
    return p;
}
static void cu_free(cf_backend *b, void *p) {
    if (p) CK(cudaFree(p));
}
static void cu_memzero(cf_backend *b, void *p, size_t bytes) {
    if (bytes) CK(cudaMemsetAsync(p, 0, bytes, 0));
}
static void cu_upload(cf_backend *b, void *dst, const void *src, size_t bytes) {
    if (bytes) CK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}
static void cu_download(cf_backend *b, void *dst, const void *src, size_t bytes) {
    if (bytes) CK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}
static void cu_copy(cf_backend *b, void *dst, const void *src, size_t bytes) {
    if (bytes) CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, 0));
}

/* host fp32 <-> bf16, round to nearest even (NaN stays NaN) */
static uint16_t f32_to_bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static float bf16_bits_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static void cu_act_from_f32(cf_backend *b, void *dst, const float *src, size_t n) {
    if (!n) return;
    uint16_t *tmp = (uint16_t *)malloc(n * 2);
    if (!tmp) {
        cf_fail("out of memory (act_from_f32, %zu elements)", n);
        fprintf(stderr, "centrifuge: fatal: %s\n", cf_last_error());
        exit(1);
    }
    for (size_t i = 0; i < n; i++) tmp[i] = f32_to_bf16_bits(src[i]);
    CK(cudaMemcpy(dst, tmp, n * 2, cudaMemcpyHostToDevice));
    free(tmp);
}
static void cu_act_to_f32(cf_backend *b, float *dst, const void *src, size_t n) {
    if (!n) return;
    uint16_t *tmp = (uint16_t *)malloc(n * 2);
    if (!tmp) {
        cf_fail("out of memory (act_to_f32, %zu elements)", n);
        fprintf(stderr, "centrifuge: fatal: %s\n", cf_last_error());
        exit(1);
    }
    CK(cudaMemcpy(tmp, src, n * 2, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++) dst[i] = bf16_bits_to_f32(tmp[i]);
    free(tmp);
}
static void sample_memory(cf_backend *b) {
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess && total_b - free_b > ST(b)->mem_peak)
        ST(b)->mem_peak = total_b - free_b;
}
static void cu_synchronize(cf_backend *b) {
    CK(cudaDeviceSynchronize());
    sample_memory(b);
}
static size_t cu_memory_peak(cf_backend *b) {
    sample_memory(b);
    return ST(b)->mem_peak;
}

/* ============================================================= utilities */

/* 16 bytes = 8 bf16 */
struct __align__(16) pack8 { __nv_bfloat162 h[4]; };

__device__ __forceinline__ void unpack8(const pack8 &p, float f[8]) {
    for (int i = 0; i < 4; i++) {
        float2 v = __bfloat1622float2(p.h[i]);
        f[2 * i] = v.x;
        f[2 * i + 1] = v.y;
    }
}
__device__ __forceinline__ pack8 pack8_from(const float f[8]) {
    pack8 p;
    for (int i = 0; i < 4; i++) p.h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    return p;
}
static bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* ============================================= weights, elementwise ops */

static __global__ void f32_to_bf16_kernel(bf16 *w, const float *m, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        w[i] = __float2bfloat16_rn(m[i]);
}
/* 4 at a time: one 16-byte load, one 8-byte store */
static __global__ void f32_to_bf16_vec_kernel(uint2 *w, const float4 *m, size_t n4) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (size_t)gridDim.x * blockDim.x) {
        float4 f = m[i];
        __nv_bfloat162 lo = __floats2bfloat162_rn(f.x, f.y), hi = __floats2bfloat162_rn(f.z, f.w);
        uint2 u;
        u.x = *reinterpret_cast<uint32_t *>(&lo);
        u.y = *reinterpret_cast<uint32_t *>(&hi);
        w[i] = u;
    }
}
/* a grid-stride launch of at most 16 blocks per SM (elementwise passes over
 * the whole parameter vector) */
static int stream_grid(cf_backend *b, size_t n) {
    size_t cap = (size_t)ST(b)->sm_count * 16;
    size_t blocks = (n + 255) / 256;
    return (int)(blocks < 1 ? 1 : blocks < cap ? blocks : cap);
}
static void cu_weights_from_master(cf_backend *b, void *w, const float *master, size_t n) {
    if (!n) return;
    if (n % 4 == 0 && ((uintptr_t)w & 7) == 0 && aligned16(master))
        f32_to_bf16_vec_kernel<<<stream_grid(b, n / 4), 256>>>((uint2 *)w, (const float4 *)master, n / 4);
    else
        f32_to_bf16_kernel<<<grid_for(n, 256), 256>>>((bf16 *)w, master, n);
    CK_LAUNCH();
}

/* h = silu(g) * u, silu(g) = g * sigmoid(g) */
static __global__ void swiglu_fwd_kernel(bf16 *h, const bf16 *gate, const bf16 *up, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float g = __bfloat162float(gate[i]), u = __bfloat162float(up[i]);
        h[i] = __float2bfloat16_rn(g / (1.f + expf(-g)) * u);
    }
}
static __global__ void swiglu_fwd_vec_kernel(pack8 *h, const pack8 *gate, const pack8 *up, size_t n8) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
        float g[8], u[8], o[8];
        unpack8(gate[i], g);
        unpack8(up[i], u);
        for (int k = 0; k < 8; k++) o[k] = g[k] / (1.f + expf(-g[k])) * u[k];
        h[i] = pack8_from(o);
    }
}
/* dg = dh * u * sig * (1 + g (1 - sig)),  du = dh * silu(g) */
__device__ __forceinline__ void swiglu_grad(float g, float u, float dh, float *dg, float *du) {
    float sig = 1.f / (1.f + expf(-g));
    *dg = dh * u * sig * (1.f + g * (1.f - sig));
    *du = dh * g * sig;
}

/* SwiGLU backward with gate/up read through the row index; also writes the
 * recomputed product h (the down projection's input) for the kept rows. */
static __global__ void swiglu_bwd_rows_vec_kernel(pack8 *h, pack8 *dgate, pack8 *dup, const pack8 *dh, const pack8 *gate,
                                                  const pack8 *up, const int *rows, int n, int F8) {
    const size_t total = (size_t)n * F8;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (size_t)gridDim.x * blockDim.x) {
        const size_t i = idx / F8, c = idx % F8;
        const size_t src = (size_t)(rows ? rows[i] : (int)i) * F8 + c;
        float g[8], u[8], d[8], o[8], dg[8], du[8];
        unpack8(gate[src], g);
        unpack8(up[src], u);
        unpack8(dh[idx], d);
        for (int q = 0; q < 8; q++) {
            swiglu_grad(g[q], u[q], d[q], &dg[q], &du[q]);
            o[q] = g[q] / (1.f + __expf(-g[q])) * u[q];
        }
        h[idx] = pack8_from(o);
        dgate[idx] = pack8_from(dg);
        dup[idx] = pack8_from(du);
    }
}
static __global__ void swiglu_bwd_rows_kernel(bf16 *h, bf16 *dgate, bf16 *dup, const bf16 *dh, const bf16 *gate,
                                              const bf16 *up, const int *rows, int n, int F) {
    const size_t total = (size_t)n * F;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (size_t)gridDim.x * blockDim.x) {
        const size_t i = idx / F, c = idx % F;
        const size_t src = (size_t)(rows ? rows[i] : (int)i) * F + c;
        const float g = __bfloat162float(gate[src]), u = __bfloat162float(up[src]);
        float dg, du;
        swiglu_grad(g, u, __bfloat162float(dh[idx]), &dg, &du);
        h[idx] = __float2bfloat16_rn(g / (1.f + __expf(-g)) * u);
        dgate[idx] = __float2bfloat16_rn(dg);
        dup[idx] = __float2bfloat16_rn(du);
    }
}
static void cu_swiglu_bwd_rows(cf_backend *b, void *h, void *dgate, void *dup, const void *dh, const void *gate,
                               const void *up, const int *rows, int n, int F) {
    if (n <= 0 || F <= 0) return;
    if (F % 8 == 0 && aligned16(h) && aligned16(dgate) && aligned16(dup) && aligned16(dh) && aligned16(gate) &&
        aligned16(up))
        swiglu_bwd_rows_vec_kernel<<<grid_for((size_t)n * (F / 8), 256), 256>>>(
            (pack8 *)h, (pack8 *)dgate, (pack8 *)dup, (const pack8 *)dh, (const pack8 *)gate, (const pack8 *)up, rows, n,
            F / 8);
    else
        swiglu_bwd_rows_kernel<<<grid_for((size_t)n * F, 256), 256>>>((bf16 *)h, (bf16 *)dgate, (bf16 *)dup,
                                                                     (const bf16 *)dh, (const bf16 *)gate,
                                                                     (const bf16 *)up, rows, n, F);
    CK_LAUNCH();
}
static void cu_swiglu_fwd(cf_backend *b, void *h, const void *gate, const void *up, size_t n) {
    if (!n) return;
    if (n % 8 == 0 && aligned16(h) && aligned16(gate) && aligned16(up))
        swiglu_fwd_vec_kernel<<<grid_for(n / 8, 256), 256>>>((pack8 *)h, (const pack8 *)gate, (const pack8 *)up, n / 8);
    else
        swiglu_fwd_kernel<<<grid_for(n, 256), 256>>>((bf16 *)h, (const bf16 *)gate, (const bf16 *)up, n);
    CK_LAUNCH();
}

/* out = a + c */
static __global__ void add_kernel(bf16 *out, const bf16 *a, const bf16 *c, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16_rn(__bfloat162float(a[i]) + __bfloat162float(c[i]));
}
static __global__ void add_vec_kernel(pack8 *out, const pack8 *a, const pack8 *c, size_t n8) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n8; i += (size_t)gridDim.x * blockDim.x) {
        float x[8], y[8];
        unpack8(a[i], x);
        unpack8(c[i], y);
        for (int k = 0; k < 8; k++) x[k] += y[k];
        out[i] = pack8_from(x);
    }
}
static void cu_add(cf_backend *b, void *out, const void *a, const void *c, size_t n) {
    if (!n) return;
    if (n % 8 == 0 && aligned16(out) && aligned16(a) && aligned16(c))
        add_vec_kernel<<<grid_for(n / 8, 256), 256>>>((pack8 *)out, (const pack8 *)a, (const pack8 *)c, n / 8);
    else
        add_kernel<<<grid_for(n, 256), 256>>>((bf16 *)out, (const bf16 *)a, (const bf16 *)c, n);
    CK_LAUNCH();
}


/* ============================================================ selection */

/*
 * Top-k per group by rank: row t is kept iff fewer than k rows of its group
 * come before it in the order (score descending, NaN last, ties to the
 * lower row). Each block stages tiles of the group's scores in shared
 * memory; every thread counts the rows ahead of its own. O(group^2) work:
 * 17M comparisons for a 4096-token sequence, a few microseconds.
 */
#define SELECT_TILE 1024
static __device__ __forceinline__ float select_score(const float *losses, const float *ref, int t) {
    return ref ? losses[t] - ref[t] : losses[t];
}
static __global__ void select_rank_kernel(uint8_t *keep, const float *losses, const float *ref, int T, int group,
                                          int k) {
    __shared__ float tile[SELECT_TILE];
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    /* a block never straddles two groups when blockDim divides group; else
     * each thread handles its own group and tiles cover the union */
    const int g0 = (min(t, T - 1) / group) * group;
    const int gb = ((blockIdx.x * blockDim.x) / group) * group;             /* first group of the block */
    const int ge = min(T, ((min((int)(blockIdx.x * blockDim.x + blockDim.x), T) - 1) / group + 1) * group);
    const float st = t < T ? select_score(losses, ref, t) : 0.f;
    const bool nan_t = isnan(st);
    int rank = 0;
    for (int base = gb; base < ge; base += SELECT_TILE) {
        const int n = min(SELECT_TILE, ge - base);
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) tile[i] = select_score(losses, ref, base + i);
        __syncthreads();
        if (t < T) {
            const int lo = max(0, g0 - base), hi = min(n, g0 + group - base);
            for (int i = lo; i < hi; i++) {
                const float sj = tile[i];
                const int j = base + i;
                const bool nan_j = isnan(sj);
                const bool ahead = nan_j != nan_t ? nan_t
                                 : (!nan_j && sj != st) ? sj > st
                                                        : j < t;
                rank += ahead;
            }
        }
    }
    if (t < T) keep[t] = rank < k;
}
static void cu_select_topk(cf_backend *b, uint8_t *keep, const float *losses, const float *ref, int T, int group,
                           int k) {
    if (T <= 0) return;
    select_rank_kernel<<<(T + 255) / 256, 256>>>(keep, losses, ref, T, group, k);
    CK_LAUNCH();
}

/* ========================================================= gather rows */

/* The filter operator in one launch: block (i, k) copies row rows[i] of
 * tensor k. 16-byte copies when the tensor's rows and pointers allow it. */
typedef struct { void *dst; const void *src; size_t row_bytes; } gather_desc;

static __global__ void gather_multi_kernel(const gather_desc *desc, const int *rows) {
    const gather_desc d = desc[blockIdx.y];
    const size_t i = blockIdx.x, r = (size_t)rows[i];
    if (((d.row_bytes | (size_t)d.dst | (size_t)d.src) & 15) == 0) {
        const size_t w = d.row_bytes / 16;
        const uint4 *s = (const uint4 *)d.src + r * w;
        uint4 *o = (uint4 *)d.dst + i * w;
        for (size_t j = threadIdx.x; j < w; j += blockDim.x) o[j] = s[j];
    } else {
        const size_t w = d.row_bytes / 4;
        const uint32_t *s = (const uint32_t *)d.src + r * w;
        uint32_t *o = (uint32_t *)d.dst + i * w;
        for (size_t j = threadIdx.x; j < w; j += blockDim.x) o[j] = s[j];
    }
}

static void cu_gather_rows_multi(cf_backend *b, int count, void *const *dst, const void *const *src,
                                 const size_t *row_bytes, const int *rows, int n) {
    if (n <= 0 || count <= 0) return;
    gather_desc *host = (gather_desc *)malloc((size_t)count * sizeof(gather_desc));
    if (!host) { cf_fail("out of memory for gather descriptors"); fprintf(stderr, "centrifuge: fatal: %s\n", cf_last_error()); exit(1); }
    for (int k = 0; k < count; k++) { host[k].dst = dst[k]; host[k].src = src[k]; host[k].row_bytes = row_bytes[k]; }
    gather_desc *dev = (gather_desc *)cf_cuda_scratch(b, SCR_GATHER_DESC, (size_t)count * sizeof(gather_desc));
    CK(cudaMemcpy(dev, host, (size_t)count * sizeof(gather_desc), cudaMemcpyHostToDevice));
    free(host);
    for (int k0 = 0; k0 < count; k0 += 65535) {
        dim3 grid((unsigned)n, (unsigned)(count - k0 < 65535 ? count - k0 : 65535));
        gather_multi_kernel<<<grid, 128>>>(dev + k0, rows);
        CK_LAUNCH();
    }
}


/* dst[i, :] = src[rows[i], :], one block per row */
static __global__ void gather16_kernel(uint4 *dst, const uint4 *src, const int *rows, size_t row16) {
    const int i = blockIdx.x;
    const uint4 *s = src + (size_t)rows[i] * row16;
    uint4 *d = dst + (size_t)i * row16;
    for (size_t c = threadIdx.x; c < row16; c += blockDim.x) d[c] = s[c];
}
static __global__ void gather1_kernel(unsigned char *dst, const unsigned char *src, const int *rows, size_t rb) {
    const int i = blockIdx.x;
    const unsigned char *s = src + (size_t)rows[i] * rb;
    unsigned char *d = dst + (size_t)i * rb;
    for (size_t c = threadIdx.x; c < rb; c += blockDim.x) d[c] = s[c];
}
static void cu_gather_rows(cf_backend *b, void *dst, const void *src, const int *rows, int n, size_t row_bytes) {
    if (n <= 0 || !row_bytes) return;
    if (row_bytes % 16 == 0 && aligned16(dst) && aligned16(src))
        gather16_kernel<<<n, 256>>>((uint4 *)dst, (const uint4 *)src, rows, row_bytes / 16);
    else
        gather1_kernel<<<n, 256>>>((unsigned char *)dst, (const unsigned char *)src, rows, row_bytes);
    CK_LAUNCH();
}

/* ============================================================ embedding */

/* out[t, :] = wte[tokens[t], :] */
static __global__ void embedding_fwd_kernel(bf16 *out, const int *tokens, const bf16 *wte, int C, int vec) {
    const int t = blockIdx.x;
    const size_t src = (size_t)tokens[t] * C, dst = (size_t)t * C;
    if (vec) {
        for (int c = threadIdx.x * 8; c < C; c += blockDim.x * 8)
            *(pack8 *)(out + dst + c) = *(const pack8 *)(wte + src + c);
    } else {
        for (int c = threadIdx.x; c < C; c += blockDim.x) out[dst + c] = wte[src + c];
    }
}
static void cu_embedding_fwd(cf_backend *b, void *out, const int *tokens, const void *wte, int T, int C) {
    if (T <= 0) return;
    int vec = C % 8 == 0 && aligned16(out) && aligned16(wte);
    embedding_fwd_kernel<<<T, 256>>>((bf16 *)out, tokens, (const bf16 *)wte, C, vec);
    CK_LAUNCH();
}

static __global__ void iota_kernel(int *x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = i;
}
/*
 * Deterministic embedding backward. The (token, row) pairs are sorted by token
 * with a stable radix sort, so equal tokens form runs in row order. The block
 * of the first position of each run adds the run's rows, in row order, to
 * dwte[token] (one column per thread; grid.y covers the columns).
 */
static __global__ void embedding_bwd_kernel(float *dwte, const bf16 *dout, const int *tok_sorted, const int *row_sorted,
                                     int T, int C) {
    const int i = blockIdx.x;
    const int tok = tok_sorted[i];
    if (i > 0 && tok_sorted[i - 1] == tok) return;
    int end = i + 1;
    while (end < T && tok_sorted[end] == tok) end++;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float acc = dwte[(size_t)tok * C + c];
    for (int j = i; j < end; j++) acc += __bfloat162float(dout[(size_t)row_sorted[j] * C + c]);
    dwte[(size_t)tok * C + c] = acc;
}
static void cu_embedding_bwd(cf_backend *b, float *dwte, const void *dout, const int *tokens, int T, int C) {
    if (T <= 0) return;
    int *keys = (int *)cf_cuda_scratch(b, SCR_SORT_KEYS, (size_t)T * sizeof(int));
    int *vals = (int *)cf_cuda_scratch(b, SCR_SORT_VALS, (size_t)T * sizeof(int));
    int *iota = (int *)cf_cuda_scratch(b, SCR_IOTA, (size_t)T * sizeof(int));
    iota_kernel<<<(T + 255) / 256, 256>>>(iota, T);
    CK_LAUNCH();
    size_t tmp_bytes = 0;
    CK(cub::DeviceRadixSort::SortPairs(NULL, tmp_bytes, tokens, keys, iota, vals, T, 0, 31, (cudaStream_t)0));
    void *tmp = cf_cuda_scratch(b, SCR_SORT_TMP, tmp_bytes);
    CK(cub::DeviceRadixSort::SortPairs(tmp, tmp_bytes, tokens, keys, iota, vals, T, 0, 31, (cudaStream_t)0));
    dim3 grid(T, (C + 255) / 256);
    embedding_bwd_kernel<<<grid, 256>>>(dwte, (const bf16 *)dout, keys, vals, T, C);
    CK_LAUNCH();
}

/* ======================================= deterministic column sums */

/*
 * partial[chunk, c] = sum over rows t of the chunk of f(t, c), with
 *   f = dout[t,c]                      (bias gradient)
 *   f = dout[t,c] * x[t,c] * rstd[t]   (rmsnorm weight gradient)
 * block (32, 8): 64 columns (2 per thread), rows strided by 8, reduced in
 * shared memory in a fixed order. Then out[c] += sum_chunk partial[chunk, c],
 * chunks in order. Run to run identical.
 */
#define COLSUM_ROWS 64
static __global__ void colsum_partial_kernel(float *partial, const bf16 *dout, const bf16 *x, const float *rstd, int T,
                                      int C) {
    __shared__ float red[8][64];
    const int c0 = blockIdx.x * 64 + 2 * threadIdx.x;
    const int t0 = blockIdx.y * COLSUM_ROWS, t1 = min(T, t0 + COLSUM_ROWS);
    float s0 = 0.f, s1 = 0.f;
    for (int t = t0 + threadIdx.y; t < t1; t += 8) {
        const size_t base = (size_t)t * C;
        const float r = rstd ? rstd[t] : 1.f;
        if (c0 < C) {
            float v = __bfloat162float(dout[base + c0]);
            if (x) v *= __bfloat162float(x[base + c0]) * r;
            s0 += v;
        }
        if (c0 + 1 < C) {
            float v = __bfloat162float(dout[base + c0 + 1]);
            if (x) v *= __bfloat162float(x[base + c0 + 1]) * r;
            s1 += v;
        }
    }
    red[threadIdx.y][2 * threadIdx.x] = s0;
    red[threadIdx.y][2 * threadIdx.x + 1] = s1;
    __syncthreads();
    if (threadIdx.y == 0) {
        for (int k = 0; k < 2; k++) {
            int c = c0 + k;
            float s = 0.f;
            for (int y = 0; y < 8; y++) s += red[y][2 * threadIdx.x + k];
            if (c < C) partial[(size_t)blockIdx.y * C + c] = s;
        }
    }
}
static __global__ void colsum_final_kernel(float *out, const float *partial, int nchunks, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float s = 0.f;
    for (int k = 0; k < nchunks; k++) s += partial[(size_t)k * C + c];
    out[c] += s;
}
static void colsum(cf_backend *b, float *out, const bf16 *dout, const bf16 *x, const float *rstd, int T, int C) {
    if (T <= 0 || C <= 0) return;
    int nchunks = (T + COLSUM_ROWS - 1) / COLSUM_ROWS;
    float *partial = (float *)cf_cuda_scratch(b, SCR_PARTIAL, (size_t)nchunks * C * sizeof(float));
    dim3 grid((C + 63) / 64, nchunks), block(32, 8);
    colsum_partial_kernel<<<grid, block>>>(partial, dout, x, rstd, T, C);
    CK_LAUNCH();
    colsum_final_kernel<<<(C + 255) / 256, 256>>>(out, partial, nchunks, C);
    CK_LAUNCH();
}

/* ============================================================== rmsnorm */

/* One warp per row. out = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps). */
template <bool VEC>
static __global__ void rmsnorm_fwd_kernel(bf16 *out, float *rstd, const bf16 *inp, const bf16 *w, int T, int C, float eps) {
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (row >= T) return;
    const bf16 *x = inp + (size_t)row * C;
    bf16 *y = out + (size_t)row * C;
    float ss = 0.f;
    if (VEC) {
        for (int c = lane * 8; c < C; c += 256) {
            float f[8];
            unpack8(*(const pack8 *)(x + c), f);
            for (int k = 0; k < 8; k++) ss += f[k] * f[k];
        }
    } else {
        for (int c = lane; c < C; c += 32) {
            float f = __bfloat162float(x[c]);
            ss += f * f;
        }
    }
    ss = warp_sum(ss);
    const float r = rsqrtf(ss / C + eps);
    if (VEC) {
        for (int c = lane * 8; c < C; c += 256) {
            float f[8], wf[8];
            unpack8(*(const pack8 *)(x + c), f);
            unpack8(*(const pack8 *)(w + c), wf);
            for (int k = 0; k < 8; k++) f[k] = f[k] * r * wf[k];
            *(pack8 *)(y + c) = pack8_from(f);
        }
    } else {
        for (int c = lane; c < C; c += 32)
            y[c] = __float2bfloat16_rn(__bfloat162float(x[c]) * r * __bfloat162float(w[c]));
    }
    if (lane == 0) rstd[row] = r;
}
static void cu_rmsnorm_fwd(cf_backend *b, void *out, float *rstd, const void *inp, const void *w, int T, int C,
                           float eps) {
    if (T <= 0) return;
    int blocks = (T * 32 + 255) / 256;
    if (C % 8 == 0 && aligned16(out) && aligned16(inp) && aligned16(w))
        rmsnorm_fwd_kernel<true><<<blocks, 256>>>((bf16 *)out, rstd, (const bf16 *)inp, (const bf16 *)w, T, C, eps);
    else
        rmsnorm_fwd_kernel<false><<<blocks, 256>>>((bf16 *)out, rstd, (const bf16 *)inp, (const bf16 *)w, T, C, eps);
    CK_LAUNCH();
}

/* dx_c = r w_c g_c - r^3 x_c / C * sum_j g_j w_j x_j   (g = dout), one warp per row */
template <bool VEC>
static __global__ void rmsnorm_bwd_kernel(bf16 *dinp, const bf16 *dout, const bf16 *inp, const bf16 *w, const float *rstd,
                                   int T, int C, int accumulate) {
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (row >= T) return;
    const bf16 *x = inp + (size_t)row * C, *g = dout + (size_t)row * C;
    bf16 *dx = dinp + (size_t)row * C;
    const float r = rstd[row];
    float dot = 0.f;
    if (VEC) {
        for (int c = lane * 8; c < C; c += 256) {
            float xf[8], gf[8], wf[8];
            unpack8(*(const pack8 *)(x + c), xf);
            unpack8(*(const pack8 *)(g + c), gf);
            unpack8(*(const pack8 *)(w + c), wf);
            for (int k = 0; k < 8; k++) dot += gf[k] * wf[k] * xf[k];
        }
    } else {
        for (int c = lane; c < C; c += 32)
            dot += __bfloat162float(g[c]) * __bfloat162float(w[c]) * __bfloat162float(x[c]);
    }
    dot = warp_sum(dot);
    const float coef = r * r * r * dot / C;
    if (VEC) {
        for (int c = lane * 8; c < C; c += 256) {
            float xf[8], gf[8], wf[8], o[8];
            unpack8(*(const pack8 *)(x + c), xf);
            unpack8(*(const pack8 *)(g + c), gf);
            unpack8(*(const pack8 *)(w + c), wf);
            if (accumulate) unpack8(*(const pack8 *)(dx + c), o);
            for (int k = 0; k < 8; k++) {
                float v = r * wf[k] * gf[k] - coef * xf[k];
                o[k] = accumulate ? o[k] + v : v;
            }
            *(pack8 *)(dx + c) = pack8_from(o);
        }
    } else {
        for (int c = lane; c < C; c += 32) {
            float v = r * __bfloat162float(w[c]) * __bfloat162float(g[c]) - coef * __bfloat162float(x[c]);
            if (accumulate) v += __bfloat162float(dx[c]);
            dx[c] = __float2bfloat16_rn(v);
        }
    }
}
static void cu_rmsnorm_bwd(cf_backend *b, void *dinp, float *dw, const void *dout, const void *inp, const void *w,
                           const float *rstd, int T, int C, int accumulate) {
    if (T <= 0) return;
    int blocks = (T * 32 + 255) / 256;
    if (C % 8 == 0 && aligned16(dinp) && aligned16(dout) && aligned16(inp) && aligned16(w))
        rmsnorm_bwd_kernel<true><<<blocks, 256>>>((bf16 *)dinp, (const bf16 *)dout, (const bf16 *)inp,
                                                  (const bf16 *)w, rstd, T, C, accumulate);
    else
        rmsnorm_bwd_kernel<false><<<blocks, 256>>>((bf16 *)dinp, (const bf16 *)dout, (const bf16 *)inp,
                                                   (const bf16 *)w, rstd, T, C, accumulate);
    CK_LAUNCH();
    /* dw[c] += sum_t dout[t,c] * x[t,c] * rstd[t] */
    colsum(b, dw, (const bf16 *)dout, (const bf16 *)inp, rstd, T, C);
}

/* ================================================================= rope */

/*
 * Rotate-half RoPE, in place on x[T, nh, D]: for i < D/2, angle = pos * inv_freq[i],
 *   x1' = x1 cos - x2 sin,  x2' = x2 cos + x1 sin     (x1 = x[i], x2 = x[i + D/2])
 * bwd applies the transpose (angle -> -angle). One thread per (t, head, i).
 */
static __global__ void rope_kernel(bf16 *x, const int *pos, const float *inv_freq, int T, int nh, int D, float sign) {
    const int half = D / 2;
    const size_t n = (size_t)T * half;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n; idx += (size_t)gridDim.x * blockDim.x) {
        const int i = (int)(idx % half);
        const size_t t = idx / half;
        float s, c;
        sincosf((float)pos[t] * inv_freq[i], &s, &c);   /* once per (position, frequency), for all heads */
        s *= sign;
        bf16 *row = x + t * (size_t)nh * D;
        for (int h = 0; h < nh; h++) {
            bf16 *p = row + (size_t)h * D;
            float x1 = __bfloat162float(p[i]), x2 = __bfloat162float(p[i + half]);
            p[i] = __float2bfloat16_rn(x1 * c - x2 * s);
            p[i + half] = __float2bfloat16_rn(x2 * c + x1 * s);
        }
    }
}
static void cu_rope_fwd(cf_backend *b, void *x, const int *pos, const float *inv_freq, int T, int nh, int D) {
    if (T <= 0) return;
    rope_kernel<<<grid_for((size_t)T * (D / 2), 256), 256>>>((bf16 *)x, pos, inv_freq, T, nh, D, 1.f);
    CK_LAUNCH();
}
static void cu_rope_bwd(cf_backend *b, void *dx, const int *pos, const float *inv_freq, int T, int nh, int D) {
    if (T <= 0) return;
    rope_kernel<<<grid_for((size_t)T * (D / 2), 256), 256>>>((bf16 *)dx, pos, inv_freq, T, nh, D, -1.f);
    CK_LAUNCH();
}

/* ============================================================== matmul */

/*
 * cuBLASLt is column-major; a row-major [R, C] matrix is a column-major
 * [C, R] one. With W [N, K] and x [T, K] row-major:
 *   out^T [N,T] = W [N,K] (= colmajor [K,N], transposed) . x^T [K,T]
 *   dinp^T [K,T] = W^T [K,N] (colmajor as stored) . dout^T [N,T]
 *   dW^T [K,N]  = x^T [K,T] . dout [T,N] (colmajor [N,T], transposed)
 * Plans (descriptors + the heuristic's algorithm) are cached by shape,
 * dtypes, epilogue and pointer alignment.
 */
static int align_of(const void *p) {
    uintptr_t a = (uintptr_t)p;
    int al = 256;
    while (al > 1 && (a % al)) al >>= 1;
    return al;
}

static void gemm(cf_backend *bk, bool transa, bool transb, int m, int n, int k, const void *A, int lda,
                 const void *B, int ldb, void *D, cudaDataType_t dtype, int ldd, float beta, const void *bias) {
    cuda_state *st = ST(bk);
    if (m <= 0 || n <= 0) return;
    int key[16] = {transa, transb, m, n, k, lda, ldb, ldd, (int)dtype, bias != NULL,
                   align_of(A), align_of(B), align_of(D), bias ? align_of(bias) : 0, 0, 0};
    gemm_plan *pl = NULL;
    for (int i = 0; i < st->nplans; i++)
        if (!memcmp(st->plans[i].key, key, sizeof key)) {
            pl = &st->plans[i];
            break;
        }
    if (!pl) {
        if (st->nplans == GEMM_CACHE) { /* full: drop everything */
            for (int i = 0; i < st->nplans; i++) {
                gemm_plan *p = &st->plans[i];
                cublasLtMatmulDescDestroy(p->op);
                cublasLtMatrixLayoutDestroy(p->a);
                cublasLtMatrixLayoutDestroy(p->b);
                cublasLtMatrixLayoutDestroy(p->c);
                cublasLtMatrixLayoutDestroy(p->d);
            }
            st->nplans = 0;
        }
        pl = &st->plans[st->nplans];
        memcpy(pl->key, key, sizeof key);
        cublasOperation_t ta = transa ? CUBLAS_OP_T : CUBLAS_OP_N, tb = transb ? CUBLAS_OP_T : CUBLAS_OP_N;
        LT(cublasLtMatmulDescCreate(&pl->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        LT(cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
        LT(cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
        if (bias) {
            cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
            LT(cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
            cudaDataType_t bt = CUDA_R_16BF;
            LT(cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt));
        }
        /* stored shapes: op(A) is m x k, op(B) is k x n */
        LT(cublasLtMatrixLayoutCreate(&pl->a, CUDA_R_16BF, transa ? k : m, transa ? m : k, lda));
        LT(cublasLtMatrixLayoutCreate(&pl->b, CUDA_R_16BF, transb ? n : k, transb ? k : n, ldb));
        LT(cublasLtMatrixLayoutCreate(&pl->c, dtype, m, n, ldd));
        LT(cublasLtMatrixLayoutCreate(&pl->d, dtype, m, n, ldd));
        cublasLtMatmulPreference_t pref;
        LT(cublasLtMatmulPreferenceCreate(&pref));
        uint64_t ws = st->workspace_size;
        LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
        uint32_t al[4] = {(uint32_t)key[10], (uint32_t)key[11], (uint32_t)key[12], (uint32_t)key[12]};
        LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al[0], 4));
        LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al[1], 4));
        LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al[2], 4));
        LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al[3], 4));
        cublasLtMatmulHeuristicResult_t heur;
        int nres = 0;
        cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(st->lt, pl->op, pl->a, pl->b, pl->c, pl->d, pref, 1,
                                                          &heur, &nres);
        cublasLtMatmulPreferenceDestroy(pref);
        if (s != CUBLAS_STATUS_SUCCESS || nres == 0) {
            cf_fail("cublasLtMatmulAlgoGetHeuristic: no algorithm for m=%d n=%d k=%d (%s)", m, n, k,
                    cublasGetStatusString(s));
            fprintf(stderr, "centrifuge: fatal cuBLASLt error: %s\n", cf_last_error());
            exit(1);
        }
        pl->algo = heur.algo;
        st->nplans++;
    }
    if (bias) LT(cublasLtMatmulDescSetAttribute(pl->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
    const float alpha = 1.f;
    LT(cublasLtMatmul(st->lt, pl->op, &alpha, A, pl->a, B, pl->b, &beta, D, pl->c, D, pl->d, &pl->algo,
                      st->workspace, st->workspace_size, (cudaStream_t)0));
}

/* out[T,N] = inp[T,K] W[N,K]^T (+ bias) */
static void cu_matmul_fwd(cf_backend *b, void *out, const void *inp, const void *w, const void *bias, int T, int K,
                          int N) {
    if (T <= 0) return;
    gemm(b, true, false, N, T, K, w, K, inp, K, out, CUDA_R_16BF, N, 0.f, bias);
}
/* dinp[T,K] (+)= dout W ; dw[N,K] += dout^T inp ; dbias += colsum(dout) */
static void cu_matmul_bwd(cf_backend *b, void *dinp, float *dw, float *dbias, const void *dout, const void *inp,
                          const void *w, int T, int K, int N, int accumulate) {
    if (T <= 0) return;
    if (dinp) gemm(b, false, false, K, T, N, w, K, dout, N, dinp, CUDA_R_16BF, K, accumulate ? 1.f : 0.f, NULL);
    if (dw) gemm(b, false, true, K, N, T, inp, K, dout, N, dw, CUDA_R_32F, K, 1.f, NULL);
    if (dbias) colsum(b, dbias, (const bf16 *)dout, NULL, NULL, T, N);
}

/* ============================================================ lm head */

/*
 * One block per row of an fp32 logits chunk [rows, V]. Pass 1: per-thread
 * online (max, sum of exp), combined over the block -> lse; loss = lse -
 * logit[target]. For the backward, pass 2 writes the bf16 gradient
 *   dlogits_j = dloss * (exp(logit_j - lse) - [j == target])
 * (all zeros where dloss == 0). As on the CPU backend, a target outside
 * [0, V) gives a NaN loss and a gradient without the one-hot term.
 */
__device__ __forceinline__ void lse_combine(float &m, float &s, float m2, float s2) {
    float mm = fmaxf(m, m2);
    if (mm == -INFINITY) return;
    s = s * expf(m - mm) + s2 * expf(m2 - mm);
    m = mm;
}
static __global__ void lmhead_rows_kernel(float *losses, bf16 *dlogits, const float *logits, const int *targets,
                                   const float *dloss, int V) {
    __shared__ float sm[32], ss[32];
    const int row = blockIdx.x;
    const float *lg = logits + (size_t)row * V;
    const int tgt = targets[row];
    const bool bad = tgt < 0 || tgt >= V;
    float m = -INFINITY, s = 0.f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float x = lg[j];
        if (x > m) {
            s = s * expf(m - x) + 1.f;
            m = x;
        } else {
            s += expf(x - m);
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
        lse_combine(m, s, m2, s2);
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    if (lane == 0) {
        sm[warp] = m;
        ss[warp] = s;
    }
    __syncthreads();
    if (warp == 0) {
        m = lane < nw ? sm[lane] : -INFINITY;
        s = lane < nw ? ss[lane] : 0.f;
        for (int o = 16; o > 0; o >>= 1) {
            float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
            lse_combine(m, s, m2, s2);
        }
        if (lane == 0) {
            sm[0] = m + logf(s);
        }
    }
    __syncthreads();
    const float lse = sm[0];
    if (losses && threadIdx.x == 0) losses[row] = bad ? NAN : lse - lg[tgt];
    if (dlogits) {
        const float d = dloss ? dloss[row] : 0.f;
        bf16 *out = dlogits + (size_t)row * V;
        for (int j = threadIdx.x; j < V; j += blockDim.x) {
            float g = d == 0.f ? 0.f : d * (expf(lg[j] - lse) - (j == tgt ? 1.f : 0.f));
            out[j] = __float2bfloat16_rn(g);
        }
    }
}

/* rows per chunk: fp32 logits + bf16 dlogits of a chunk stay under ~1.5 GiB */
static int lm_chunk(int T, int V) {
    size_t budget = (size_t)3 << 29;
    size_t rows = budget / ((size_t)V * 6);
    if (rows < 1) rows = 1;
    return (int)(rows < (size_t)T ? rows : (size_t)T);
}

static void cu_lmhead_loss_fwd(cf_backend *b, float *losses, const void *x, const void *wlm, const int *targets,
                               int T, int C, int V) {
    if (T <= 0) return;
    const int chunk = lm_chunk(T, V);
    float *logits = (float *)cf_cuda_scratch(b, SCR_LOGITS, (size_t)chunk * V * sizeof(float));
    for (int r0 = 0; r0 < T; r0 += chunk) {
        const int rows = CF_MIN(chunk, T - r0);
        const bf16 *xc = (const bf16 *)x + (size_t)r0 * C;
        gemm(b, true, false, V, rows, C, wlm, C, xc, C, logits, CUDA_R_32F, V, 0.f, NULL);
        lmhead_rows_kernel<<<rows, 512>>>(losses + r0, NULL, logits, targets + r0, NULL, V);
        CK_LAUNCH();
    }
}

static void cu_lmhead_loss_bwd(cf_backend *b, void *dx, float *dwlm, const void *x, const void *wlm,
                               const int *targets, const float *dloss, int T, int C, int V) {
    if (T <= 0) return;
    const int chunk = lm_chunk(T, V);
    float *logits = (float *)cf_cuda_scratch(b, SCR_LOGITS, (size_t)chunk * V * sizeof(float));
    bf16 *dlogits = (bf16 *)cf_cuda_scratch(b, SCR_DLOGITS, (size_t)chunk * V * sizeof(bf16));
    for (int r0 = 0; r0 < T; r0 += chunk) {
        const int rows = CF_MIN(chunk, T - r0);
        const bf16 *xc = (const bf16 *)x + (size_t)r0 * C;
        gemm(b, true, false, V, rows, C, wlm, C, xc, C, logits, CUDA_R_32F, V, 0.f, NULL);
        lmhead_rows_kernel<<<rows, 512>>>(NULL, dlogits, logits, targets + r0, dloss + r0, V);
        CK_LAUNCH();
        /* dx = dlogits W ; dW += dlogits^T x */
        cu_matmul_bwd(b, (bf16 *)dx + (size_t)r0 * C, dwlm, NULL, dlogits, xc, wlm, rows, C, V, 0);
    }
}

/* ====================================================== sumsq, adamw */

/* per-block double partial sums of g^2 (fixed grid: deterministic) */
static __global__ void sumsq_partial_kernel(double *partial, const float *g, size_t n) {
    __shared__ double red[32];
    double acc = 0.0;
    const size_t n4 = ((uintptr_t)g & 15) == 0 ? n / 4 : 0; /* float4 part */
    const float4 *g4 = (const float4 *)g;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (size_t)gridDim.x * blockDim.x) {
        float4 f = g4[i];
        acc += (double)f.x * f.x + (double)f.y * f.y + (double)f.z * f.z + (double)f.w * f.w;
    }
    for (size_t i = 4 * n4 + (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        double v = g[i];
        acc += v * v;
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) red[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        double s = 0.0;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++) s += red[w];
        partial[blockIdx.x] = s;
    }
}
static __global__ void sumsq_final_kernel(double *out, const double *partial, int n) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        double s = 0.0;
        for (int i = 0; i < n; i++) s += partial[i];
        *out = s;
    }
}
static double cu_sumsq(cf_backend *b, const float *g, size_t n) {
    if (!n) return 0.0;
    const int blocks = ST(b)->sm_count * 4;
    double *partial = (double *)cf_cuda_scratch(b, SCR_SUMSQ, (size_t)(blocks + 1) * sizeof(double));
    sumsq_partial_kernel<<<blocks, 256>>>(partial + 1, g, n);
    CK_LAUNCH();
    sumsq_final_kernel<<<1, 32>>>(partial, partial + 1, blocks);
    CK_LAUNCH();
    double r = 0.0;
    CK(cudaMemcpy(&r, partial, sizeof r, cudaMemcpyDeviceToHost));
    return r;
}

/* g' = g s; m = b1 m + (1-b1) g'; v = b2 v + (1-b2) g'^2;
 * p -= lr (m/bc1 / (sqrt(v/bc2) + eps) + wd p) */
__device__ __forceinline__ void adamw_one(float &p, float g, float &m, float &v, float lr, float b1, float b2,
                                          float eps, float wd, float gs, float bc1, float bc2) {
    g *= gs;
    m = b1 * m + (1.f - b1) * g;
    v = b2 * v + (1.f - b2) * g * g;
    p = p - lr * ((m / bc1) / (sqrtf(v / bc2) + eps) + wd * p);
}
static __global__ void adamw_kernel(float *p, bf16 *w, float *g, float *m, float *v, size_t n, float lr, float b1,
                                    float b2, float eps, float wd, float gs, float bc1, float bc2) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float pi = p[i], mi = m[i], vi = v[i];
        adamw_one(pi, g[i], mi, vi, lr, b1, b2, eps, wd, gs, bc1, bc2);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        g[i] = 0.f;
        if (w) w[i] = __float2bfloat16_rn(pi);
    }
}
/* the same, four elements per 16-byte access */
static __global__ void adamw_vec_kernel(float4 *p, __nv_bfloat162 *w, float4 *g, float4 *m, float4 *v, size_t n4, float lr,
                                        float b1, float b2, float eps, float wd, float gs, float bc1, float bc2) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += (size_t)gridDim.x * blockDim.x) {
        float4 pi = p[i], gi = g[i], mi = m[i], vi = v[i];
        adamw_one(pi.x, gi.x, mi.x, vi.x, lr, b1, b2, eps, wd, gs, bc1, bc2);
        adamw_one(pi.y, gi.y, mi.y, vi.y, lr, b1, b2, eps, wd, gs, bc1, bc2);
        adamw_one(pi.z, gi.z, mi.z, vi.z, lr, b1, b2, eps, wd, gs, bc1, bc2);
        adamw_one(pi.w, gi.w, mi.w, vi.w, lr, b1, b2, eps, wd, gs, bc1, bc2);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        g[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (w) {
            w[2 * i] = __floats2bfloat162_rn(pi.x, pi.y);
            w[2 * i + 1] = __floats2bfloat162_rn(pi.z, pi.w);
        }
    }
}
/* One pass: update p, m, v; refresh the bf16 compute copy w; zero g. */
static void cu_adamw(cf_backend *b, float *p, void *w_, float *g, float *m, float *v, size_t n, float lr, float beta1,
                     float beta2, float eps, float wd, float grad_scale, int t) {
    if (!n) return;
    bf16 *w = (bf16 *)w_;
    float bc1 = (float)(1.0 - pow((double)beta1, (double)t));
    float bc2 = (float)(1.0 - pow((double)beta2, (double)t));
    if (n % 4 == 0 && aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v) && ((uintptr_t)w % 8) == 0)
        adamw_vec_kernel<<<stream_grid(b, n / 4), 256>>>((float4 *)p, (__nv_bfloat162 *)w, (float4 *)g, (float4 *)m,
                                                         (float4 *)v, n / 4, lr, beta1, beta2, eps, wd, grad_scale, bc1, bc2);
    else
        adamw_kernel<<<grid_for(n, 256), 256>>>(p, w, g, m, v, n, lr, beta1, beta2, eps, wd, grad_scale, bc1, bc2);
    CK_LAUNCH();
}

/* ============================================================ attention */

static void cu_attention_fwd(cf_backend *b, void *out, float *lse, const void *q, const void *k, const void *v,
                             const cf_attn_shape *s) {
    cf_cuda_attention_fwd(b, out, lse, q, k, v, s);
}
static void cu_attention_bwd(cf_backend *b, void *dq, void *dk, void *dv, const void *dout, const void *q,
                             const void *k, const void *v, const void *out, const float *lse,
                             const cf_attn_shape *s, const cf_rows *kept, cf_attn_bwd_mode mode) {
    cf_cuda_attention_bwd(b, dq, dk, dv, dout, q, k, v, out, lse, s, kept, mode);
}

/* ========================================================= lifecycle */

static void cu_destroy(cf_backend *b) {
    if (!b) return;
    cuda_state *st = ST(b);
    if (st) {
        cudaDeviceSynchronize();
        for (int i = 0; i < st->nplans; i++) {
            gemm_plan *p = &st->plans[i];
            cublasLtMatmulDescDestroy(p->op);
            cublasLtMatrixLayoutDestroy(p->a);
            cublasLtMatrixLayoutDestroy(p->b);
            cublasLtMatrixLayoutDestroy(p->c);
            cublasLtMatrixLayoutDestroy(p->d);
        }
        for (int i = 0; i < NSCRATCH; i++)
            if (st->scratch[i].p) cudaFree(st->scratch[i].p);
        if (st->workspace) cudaFree(st->workspace);
        if (st->lt) cublasLtDestroy(st->lt);
        free(st);
    }
    free(b);
}

extern "C" cf_backend *cf_backend_cuda_create(void) {
    int ndev = 0;
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess || ndev == 0) {
        cudaGetLastError();
        cf_fail("no CUDA device: %s", e != cudaSuccess ? cudaGetErrorString(e) : "device count is 0");
        return NULL;
    }
    int dev = 0;
    cudaDeviceProp prop;
    if ((e = cudaGetDevice(&dev)) != cudaSuccess || (e = cudaGetDeviceProperties(&prop, dev)) != cudaSuccess) {
        cf_fail("cudaGetDeviceProperties: %s", cudaGetErrorString(e));
        return NULL;
    }
    if (prop.major < 8) {
        cf_fail("CUDA device %s has compute capability %d.%d; bf16 tensor cores need 8.0 or newer", prop.name,
                prop.major, prop.minor);
        return NULL;
    }
    cf_backend *b = (cf_backend *)calloc(1, sizeof *b);
    cuda_state *st = (cuda_state *)calloc(1, sizeof *st);
    if (!b || !st) {
        free(b);
        free(st);
        cf_fail("out of memory creating the CUDA backend");
        return NULL;
    }
    b->state = st;
    st->sm_count = prop.multiProcessorCount;
    cublasStatus_t ls = cublasLtCreate(&st->lt);
    if (ls != CUBLAS_STATUS_SUCCESS) {
        cf_fail("cublasLtCreate: %s", cublasGetStatusString(ls));
        free(st);
        free(b);
        return NULL;
    }
    st->workspace_size = (size_t)32 << 20;
    if ((e = cudaMalloc(&st->workspace, st->workspace_size)) != cudaSuccess) {
        cf_fail("cudaMalloc(cuBLASLt workspace): %s", cudaGetErrorString(e));
        cublasLtDestroy(st->lt);
        free(st);
        free(b);
        return NULL;
    }

    b->name = "cuda";
    b->act_size = sizeof(bf16);
    b->alloc = cu_alloc;
    b->free = cu_free;
    b->memzero = cu_memzero;
    b->upload = cu_upload;
    b->download = cu_download;
    b->copy = cu_copy;
    b->act_from_f32 = cu_act_from_f32;
    b->act_to_f32 = cu_act_to_f32;
    b->weights_from_master = cu_weights_from_master;
    b->synchronize = cu_synchronize;
    b->destroy = cu_destroy;
    b->embedding_fwd = cu_embedding_fwd;
    b->embedding_bwd = cu_embedding_bwd;
    b->matmul_fwd = cu_matmul_fwd;
    b->matmul_bwd = cu_matmul_bwd;
    b->rmsnorm_fwd = cu_rmsnorm_fwd;
    b->rmsnorm_bwd = cu_rmsnorm_bwd;
    b->rope_fwd = cu_rope_fwd;
    b->rope_bwd = cu_rope_bwd;
    b->swiglu_fwd = cu_swiglu_fwd;
    b->add = cu_add;
    b->attention_fwd = cu_attention_fwd;
    b->attention_bwd = cu_attention_bwd;
    b->lmhead_loss_fwd = cu_lmhead_loss_fwd;
    b->lmhead_loss_bwd = cu_lmhead_loss_bwd;
    b->gather_rows = cu_gather_rows;
    b->gather_rows_multi = cu_gather_rows_multi;
    b->swiglu_bwd_rows = cu_swiglu_bwd_rows;
    b->select_topk = cu_select_topk;
    b->memory_peak = cu_memory_peak;
    b->sumsq = cu_sumsq;
    b->adamw = cu_adamw;
    return b;
}
