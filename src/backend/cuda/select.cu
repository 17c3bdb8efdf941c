/*
 * select.cu — token selection and the filter operator on the device: top-k
 * per group (select_topk), the keep mask to the kept-row index
 * (keep_to_rows), the loss bookkeeping of a filtered step (fill_dloss,
 * loss_sum), and the row gathers of the filter (gather_rows,
 * gather_rows_multi).
 */
#include "backend/cuda/cuda_common.cuh"

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
void cf_cuda_select_topk(cf_backend *b, uint8_t *keep, const float *losses, const float *ref, int T, int group,
                         int k) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || T <= 0) return;
    select_rank_kernel<<<(T + 255) / 256, 256, 0, ctx->stream>>>(keep, losses, ref, T, group, k);
    CF_CK_LAUNCH(ctx, "select_rank");
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

void cf_cuda_gather_rows_multi(cf_backend *b, int count, void *const *dst, const void *const *src,
                               const size_t *row_bytes, const int *rows, int n) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || n <= 0 || count <= 0) return;
    /* descriptors: host -> pinned staging -> device, asynchronously on the stream */
    const size_t bytes = (size_t)count * sizeof(gather_desc);
    gather_desc *host = (gather_desc *)cf_cuda_staging(ctx, bytes);
    gather_desc *dev = (gather_desc *)cf_cuda_scratch(ctx, CF_SCR_GATHER_DESC, bytes);
    if (!host || !dev) return;
    for (int k = 0; k < count; k++) { host[k].dst = dst[k]; host[k].src = src[k]; host[k].row_bytes = row_bytes[k]; }
    if (!CF_CK(ctx, cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, ctx->stream)) ||
        cf_cuda_staging_issued(ctx) != 0)
        return;
    for (int k0 = 0; k0 < count; k0 += 65535) {
        dim3 grid((unsigned)n, (unsigned)(count - k0 < 65535 ? count - k0 : 65535));
        gather_multi_kernel<<<grid, 128, 0, ctx->stream>>>(dev + k0, rows);
        if (!CF_CK_LAUNCH(ctx, "gather_multi")) return;
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
void cf_cuda_gather_rows(cf_backend *b, void *dst, const void *src, const int *rows, int n, size_t row_bytes) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || n <= 0 || !row_bytes) return;
    if (row_bytes % 16 == 0 && cf_aligned16(dst) && cf_aligned16(src))
        gather16_kernel<<<n, 256, 0, ctx->stream>>>((uint4 *)dst, (const uint4 *)src, rows, row_bytes / 16);
    else
        gather1_kernel<<<n, 256, 0, ctx->stream>>>((unsigned char *)dst, (const unsigned char *)src, rows, row_bytes);
    CF_CK_LAUNCH(ctx, "gather_rows");
}

/* ============================================== kept rows, dloss, loss sum */

#define KEEP_THREADS 256
#define KEEP_ITEMS 4

/* Kept count of sequence blockIdx.x (integer sums: exact in any order). */
static __global__ void keep_count_kernel(int *counts, const uint8_t *keep, int S) {
    __shared__ int red[KEEP_THREADS / 32];
    const uint8_t *k = keep + (size_t)blockIdx.x * S;
    int c = 0;
    for (int s = threadIdx.x; s < S; s += KEEP_THREADS) c += k[s] != 0;
    for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = c;
    __syncthreads();
    if (threadIdx.x == 0) {
        int total = 0;
        for (int w = 0; w < KEEP_THREADS / 32; w++) total += red[w];
        counts[blockIdx.x] = total;
    }
}

/* Exclusive prefix sum of v over the block's KEEP_THREADS threads (thread
 * order); *total gets the block's sum. All threads must call it. */
__device__ __forceinline__ int block_exclusive_scan(int v, int *total, int *warp_sums) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int x = v; /* inclusive scan within the warp */
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    int before = 0, sum = 0;
    for (int w = 0; w < KEEP_THREADS / 32; w++) {
        before += w < warp ? warp_sums[w] : 0;
        sum += warp_sums[w];
    }
    __syncthreads(); /* warp_sums is reused by the next call */
    *total = sum;
    return before + x - v;
}

/*
 * One block per sequence b: its offset is the kept count of the sequences
 * before it (seq_start[b]; the last block also writes seq_start[B]); then a
 * block-wide exclusive scan over the sequence's flags, KEEP_THREADS *
 * KEEP_ITEMS positions at a time (KEEP_ITEMS consecutive ones per thread),
 * places each kept row b*S + s at rows[offset + #kept before s]. Ascending,
 * and the same result every run.
 */
static __global__ void keep_rows_kernel(int *rows, int *seq_start, const uint8_t *keep, const int *counts, int B,
                                        int S) {
    __shared__ int warp_sums[KEEP_THREADS / 32];
    const int b = blockIdx.x;
    int c = 0;
    for (int i = threadIdx.x; i < b; i += KEEP_THREADS) c += counts[i];
    int base;
    block_exclusive_scan(c, &base, warp_sums);
    if (threadIdx.x == 0) {
        seq_start[b] = base;
        if (b == B - 1) seq_start[B] = base + counts[b];
    }
    const uint8_t *k = keep + (size_t)b * S;
    int running = base;
    for (int s0 = 0; s0 < S; s0 += KEEP_THREADS * KEEP_ITEMS) {
        const int first = s0 + threadIdx.x * KEEP_ITEMS;
        int flag[KEEP_ITEMS], mine = 0;
        for (int j = 0; j < KEEP_ITEMS; j++) {
            flag[j] = first + j < S && k[first + j] != 0;
            mine += flag[j];
        }
        int total;
        int pos = running + block_exclusive_scan(mine, &total, warp_sums);
        for (int j = 0; j < KEEP_ITEMS; j++)
            if (flag[j]) rows[pos++] = b * S + first + j;
        running += total;
    }
}

void cf_cuda_keep_to_rows(cf_backend *b, int *rows, int *seq_start, const uint8_t *keep, int B, int S) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx) return;
    if (B <= 0 || S <= 0) {
        if (B >= 0) CF_CK(ctx, cudaMemsetAsync(seq_start, 0, (size_t)(B + 1) * sizeof(int), ctx->stream));
        return;
    }
    int *counts = (int *)cf_cuda_scratch(ctx, CF_SCR_KEEP_COUNTS, (size_t)B * sizeof(int));
    if (!counts) return;
    keep_count_kernel<<<B, KEEP_THREADS, 0, ctx->stream>>>(counts, keep, S);
    if (!CF_CK_LAUNCH(ctx, "keep_count")) return;
    keep_rows_kernel<<<B, KEEP_THREADS, 0, ctx->stream>>>(rows, seq_start, keep, counts, B, S);
    CF_CK_LAUNCH(ctx, "keep_rows");
}

/* dloss[t] = keep == NULL || keep[t] ? value : 0 */
static __global__ void fill_dloss_kernel(float *dloss, const uint8_t *keep, float value, int n) {
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < n; t += gridDim.x * blockDim.x)
        dloss[t] = (!keep || keep[t]) ? value : 0.f;
}

void cf_cuda_fill_dloss(cf_backend *b, float *dloss, const uint8_t *keep, float value, int n) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || n <= 0) return;
    fill_dloss_kernel<<<cf_grid_for((size_t)n, 256), 256, 0, ctx->stream>>>(dloss, keep, value, n);
    CF_CK_LAUNCH(ctx, "fill_dloss");
}

/*
 * acc[0] += sum of the kept losses. One block of LOSS_THREADS threads: thread
 * i adds rows i, i + LOSS_THREADS, ... in double, then a fixed shuffle tree
 * and warp 0 combine the partials. The grid and the tree depend only on n,
 * so the result is the same every run.
 */
#define LOSS_THREADS 1024
static __global__ void loss_sum_kernel(float *acc, const float *losses, const uint8_t *keep, int n) {
    __shared__ double red[LOSS_THREADS / 32];
    double s = 0.0;
    for (int t = threadIdx.x; t < n; t += LOSS_THREADS)
        if (!keep || keep[t]) s += (double)losses[t];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) red[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = red[lane];
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) acc[0] = (float)((double)acc[0] + s);
    }
}

void cf_cuda_loss_sum(cf_backend *b, float *acc, const float *losses, const uint8_t *keep, int n) {
    cf_cuda_ctx *ctx = cf_cuda_enter(b);
    if (!ctx || n <= 0) return;
    loss_sum_kernel<<<1, LOSS_THREADS, 0, ctx->stream>>>(acc, losses, keep, n);
    CF_CK_LAUNCH(ctx, "loss_sum");
}
