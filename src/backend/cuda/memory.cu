/*
 * memory.cu — device memory: alloc/free, memzero, host <-> device copies,
 * device copies, the host fp32 <-> bf16 conversions, and the fp32 master ->
 * bf16 compute-weight refresh.
 *
 * Every transfer runs on the context's compute stream, ordered with the ops.
 * upload returns once the host buffer may be reused (the copy is issued on the
 * stream and the stream is synchronized, as the legacy-stream cudaMemcpy did);
 * download synchronizes the stream and reports any error so far.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/cuda_common.cuh"

/* ================================================================ alloc */

void *cf_cuda_alloc(cf_backend *b, size_t bytes) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx) {
        cf_fail("%s", ((cf_cuda_ctx *)b->state)->error);
        return NULL;
    }
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 16);
    if (e != cudaSuccess) {
        cudaGetLastError(); /* out of memory is not sticky in CUDA; nor here */
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        char want[32], fr[32], tot[32];
        cf_fail("cudaMalloc of %s on GPU %d (%s) failed: %s; %s of %s free; try a smaller --batch or --seq, "
                "gradient accumulation, or more GPUs (data/tensor parallel)",
                cf_cuda_format_bytes(bytes, want, sizeof want), ctx->device, ctx->device_name,
                e == cudaErrorMemoryAllocation ? "out of memory" : cudaGetErrorString(e),
                cf_cuda_format_bytes(free_b, fr, sizeof fr), cf_cuda_format_bytes(total_b, tot, sizeof tot));
        return NULL;
    }
    return p;
}

/* Frees also after a failure (teardown); errors then are not reported. */
void cf_cuda_free(cf_backend *b, void *p) {
    if (!p) return;
    cf_cuda_ctx *ctx = (cf_cuda_ctx *)b->state;
    if (cf_cuda_ctx_use(ctx) != 0) {
        cudaSetDevice(ctx->device);
        cudaFree(p);
        cudaGetLastError();
        return;
    }
    CF_CK(ctx, cudaFree(p));
}

/* ============================================================== transfers */

void cf_cuda_memzero(cf_backend *b, void *p, size_t bytes) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || !bytes) return;
    CF_CK(ctx, cudaMemsetAsync(p, 0, bytes, ctx->stream));
}

int cf_cuda_upload(cf_backend *b, void *dst, const void *src, size_t bytes) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx) return cf_fail("%s", ((cf_cuda_ctx *)b->state)->error);
    if (!bytes) return 0;
    if (!CF_CK(ctx, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, ctx->stream)) ||
        !CF_CK(ctx, cudaStreamSynchronize(ctx->stream)))
        return -1;
    return 0;
}

int cf_cuda_download(cf_backend *b, void *dst, const void *src, size_t bytes) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx) return cf_fail("%s", ((cf_cuda_ctx *)b->state)->error);
    if (bytes && !CF_CK(ctx, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, ctx->stream))) return -1;
    if (!CF_CK(ctx, cudaStreamSynchronize(ctx->stream))) return -1;
    return 0;
}

void cf_cuda_copy(cf_backend *b, void *dst, const void *src, size_t bytes) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || !bytes) return;
    CF_CK(ctx, cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, ctx->stream));
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

void cf_cuda_act_from_f32(cf_backend *b, void *dst, const float *src, size_t n) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || !n) return;
    uint16_t *tmp = (uint16_t *)malloc(n * 2);
    if (!tmp) {
        cf_cuda_ctx_fail(ctx, "out of host memory (act_from_f32, %zu elements)", n);
        return;
    }
    for (size_t i = 0; i < n; i++) tmp[i] = f32_to_bf16_bits(src[i]);
    if (CF_CK(ctx, cudaMemcpyAsync(dst, tmp, n * 2, cudaMemcpyHostToDevice, ctx->stream)))
        CF_CK(ctx, cudaStreamSynchronize(ctx->stream));
    free(tmp);
}

void cf_cuda_act_to_f32(cf_backend *b, float *dst, const void *src, size_t n) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || !n) return;
    uint16_t *tmp = (uint16_t *)malloc(n * 2);
    if (!tmp) {
        cf_cuda_ctx_fail(ctx, "out of host memory (act_to_f32, %zu elements)", n);
        return;
    }
    if (CF_CK(ctx, cudaMemcpyAsync(tmp, src, n * 2, cudaMemcpyDeviceToHost, ctx->stream)) &&
        CF_CK(ctx, cudaStreamSynchronize(ctx->stream)))
        for (size_t i = 0; i < n; i++) dst[i] = bf16_bits_to_f32(tmp[i]);
    free(tmp);
}

/* ===================================================== weights from master */

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

void cf_cuda_weights_from_master(cf_backend *b, void *w, const float *master, size_t n) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || !n) return;
    if (n % 4 == 0 && ((uintptr_t)w & 7) == 0 && cf_aligned16(master))
        f32_to_bf16_vec_kernel<<<cf_stream_grid(ctx, n / 4), 256, 0, ctx->stream>>>((uint2 *)w,
                                                                                    (const float4 *)master, n / 4);
    else
        f32_to_bf16_kernel<<<cf_grid_for(n, 256), 256, 0, ctx->stream>>>((bf16 *)w, master, n);
    CF_CK_LAUNCH(ctx, "f32_to_bf16");
}

static __global__ void bf16_to_f32_kernel(float *dst, const bf16 *src, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __bfloat162float(src[i]);
}

int cf_cuda_bf16_to_f32_comm(cf_cuda_ctx *ctx, float *dst, const void *src, size_t n) {
    if (!n) return 0;
    if (cf_cuda_ctx_use(ctx) != 0) return -1;
    bf16_to_f32_kernel<<<cf_grid_for(n, 256), 256, 0, ctx->comm_stream>>>(dst, (const bf16 *)src, n);
    return CF_CK_LAUNCH(ctx, "bf16_to_f32 (communication stream)") ? 0 : -1;
}

/* ================================================================= status */

size_t cf_cuda_memory_peak(cf_backend *b) {
    cf_cuda_ctx *ctx = (cf_cuda_ctx *)b->state;
    if (cf_cuda_ctx_use(ctx) == 0) {
        size_t free_b = 0, total_b = 0;
        if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess && total_b - free_b > ctx->mem_peak)
            ctx->mem_peak = total_b - free_b;
    }
    return ctx->mem_peak;
}

int cf_cuda_memory_info(cf_backend *b, size_t *free_bytes, size_t *total_bytes) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx) return cf_fail("%s", ((cf_cuda_ctx *)b->state)->error);
    size_t f = 0, t = 0;
    if (!CF_CK(ctx, cudaMemGetInfo(&f, &t))) return -1;
    if (free_bytes) *free_bytes = f;
    if (total_bytes) *total_bytes = t;
    return 0;
}
