/*
 * embedding.cu — token embedding lookup and its deterministic backward
 * (a stable radix sort by token, then one run of equal tokens per block).
 */
#include <cub/device/device_radix_sort.cuh>

#include "backend/cuda/cuda_common.cuh"

/* out[t, :] = wte[tokens[t] - vstart, :] for tokens in the slice, else 0 */
static __global__ void embedding_fwd_kernel(bf16 *out, const int *tokens, const bf16 *wte, int C, int vec,
                                            int vstart, int vlen) {
    const int t = blockIdx.x;
    const int r = tokens[t] - vstart;
    const size_t src = (size_t)r * C, dst = (size_t)t * C;
    if (r < 0 || r >= vlen) {
        for (int c = threadIdx.x; c < C; c += blockDim.x) out[dst + c] = __float2bfloat16_rn(0.f);
    } else if (vec) {
        for (int c = threadIdx.x * 8; c < C; c += blockDim.x * 8)
            *(pack8 *)(out + dst + c) = *(const pack8 *)(wte + src + c);
    } else {
        for (int c = threadIdx.x; c < C; c += blockDim.x) out[dst + c] = wte[src + c];
    }
}
void cf_cuda_embedding_fwd(cf_backend *b, void *out, const int *tokens, const void *wte, int T, int C, int vstart,
                           int vlen) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0) return;
    int vec = C % 8 == 0 && cf_aligned16(out) && cf_aligned16(wte);
    embedding_fwd_kernel<<<T, 256, 0, ctx->stream>>>((bf16 *)out, tokens, (const bf16 *)wte, C, vec, vstart, vlen);
    CF_CK_LAUNCH(ctx, "embedding_fwd");
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
                                     int T, int C, int vstart, int vlen) {
    const int i = blockIdx.x;
    const int tok = tok_sorted[i];
    if (i > 0 && tok_sorted[i - 1] == tok) return;
    if (tok - vstart < 0 || tok - vstart >= vlen) return;   /* another rank's slice */
    int end = i + 1;
    while (end < T && tok_sorted[end] == tok) end++;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float *dst = dwte + (size_t)(tok - vstart) * C + c;
    float acc = *dst;
    for (int j = i; j < end; j++) acc += __bfloat162float(dout[(size_t)row_sorted[j] * C + c]);
    *dst = acc;
}
void cf_cuda_embedding_bwd(cf_backend *b, float *dwte, const void *dout, const int *tokens, int T, int C, int vstart,
                           int vlen) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0) return;
    int *keys = (int *)cf_cuda_scratch(ctx, CF_SCR_SORT_KEYS, (size_t)T * sizeof(int));
    int *vals = (int *)cf_cuda_scratch(ctx, CF_SCR_SORT_VALS, (size_t)T * sizeof(int));
    int *iota = (int *)cf_cuda_scratch(ctx, CF_SCR_IOTA, (size_t)T * sizeof(int));
    if (!keys || !vals || !iota) return;
    iota_kernel<<<(T + 255) / 256, 256, 0, ctx->stream>>>(iota, T);
    if (!CF_CK_LAUNCH(ctx, "iota")) return;
    size_t tmp_bytes = 0;
    if (!CF_CK(ctx, cub::DeviceRadixSort::SortPairs(NULL, tmp_bytes, tokens, keys, iota, vals, T, 0, 31, ctx->stream)))
        return;
    void *tmp = cf_cuda_scratch(ctx, CF_SCR_SORT_TMP, tmp_bytes);
    if (!tmp ||
        !CF_CK(ctx, cub::DeviceRadixSort::SortPairs(tmp, tmp_bytes, tokens, keys, iota, vals, T, 0, 31, ctx->stream)))
        return;
    dim3 grid(T, (C + 255) / 256);
    embedding_bwd_kernel<<<grid, 256, 0, ctx->stream>>>(dwte, (const bf16 *)dout, keys, vals, T, C, vstart, vlen);
    CF_CK_LAUNCH(ctx, "embedding_bwd");
}
