/*
 * dropout.cu — LoRA dropout on the adapter input:
 *   out[i,c] = keep(key, r, c) ? x[i,c] * scale : 0,   r = rows ? rows[i] : i
 * with the counter-based mask of backend/dropout_mask.h (the same function
 * the CPU backend calls, so both drop the same elements), the product in
 * fp32 rounded once to bf16. Nothing is stored: the backward calls this
 * again with the forward's key and the kept rows' original indices.
 */
#include "backend/cuda/cuda_common.cuh"
#include "backend/dropout_mask.h"

/* 8 columns per thread (C % 8 == 0, 16-byte aligned) */
static __global__ void dropout_vec_kernel(pack8 *out, const pack8 *x, uint64_t key, uint32_t threshold, float scale,
                                          const int *rows, int n, int C8) {
    const size_t total = (size_t)n * C8;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (size_t)gridDim.x * blockDim.x) {
        const size_t i = idx / C8;
        const uint32_t r = (uint32_t)(rows ? rows[i] : (int)i), c0 = (uint32_t)(idx % C8) * 8;
        float v[8];
        unpack8(x[idx], v);
        for (int q = 0; q < 8; q++) v[q] = cf_dropout_keep(key, threshold, r, c0 + q) ? v[q] * scale : 0.f;
        out[idx] = pack8_from(v);
    }
}
static __global__ void dropout_kernel(bf16 *out, const bf16 *x, uint64_t key, uint32_t threshold, float scale,
                                      const int *rows, int n, int C) {
    const size_t total = (size_t)n * C;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (size_t)gridDim.x * blockDim.x) {
        const size_t i = idx / C;
        const uint32_t r = (uint32_t)(rows ? rows[i] : (int)i), c = (uint32_t)(idx % C);
        out[idx] = cf_dropout_keep(key, threshold, r, c) ? __float2bfloat16_rn(__bfloat162float(x[idx]) * scale)
                                                          : __float2bfloat16_rn(0.f);
    }
}
void cf_cuda_dropout(cf_backend *b, void *out, const void *x, uint64_t key, uint32_t threshold, float scale,
                     const int *rows, int n, int C) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || n <= 0 || C <= 0) return;
    if (C % 8 == 0 && cf_aligned16(out) && cf_aligned16(x))
        dropout_vec_kernel<<<cf_grid_for((size_t)n * (C / 8), 256), 256, 0, ctx->stream>>>(
            (pack8 *)out, (const pack8 *)x, key, threshold, scale, rows, n, C / 8);
    else
        dropout_kernel<<<cf_grid_for((size_t)n * C, 256), 256, 0, ctx->stream>>>(
            (bf16 *)out, (const bf16 *)x, key, threshold, scale, rows, n, C);
    CF_CK_LAUNCH(ctx, "dropout");
}
