/*
 * attention/launch_sm90.cu — host side of the Hopper attention kernels
 * (fwd_sm90.cu, bwd_sm90.cu): the choice of code path per device context,
 * tensor maps for the copy engine, and the kernels' shared-memory limits.
 *
 * Path. attn_sm90_enabled decides once per context, at its first attention
 * call: the Hopper kernels run when the device is compute capability 9.0,
 * the binary's sm_90a code runs there (a one-thread kernel reports
 * CF_SM90A_PATH as compiled for this device), the driver gives
 * cuTensorMapEncodeTiled, and the environment variable
 * CENTRIFUGE_ATTENTION is unset or "auto" / "hopper". "portable" forces
 * the mma.sync kernels (tests run both paths this way and compare them);
 * "hopper" on a device without them is an error of the first call.
 * Builds with CUDA_PORTABLE=1 never take the Hopper path.
 *
 * Tensor maps are encoded on the host for every call (the pointers change)
 * and passed to the kernels as __grid_constant__ parameters; the encoder
 * comes from the driver through cudaGetDriverEntryPointByVersion, so
 * nothing links libcuda.
 */
#include <stdlib.h>
#include <string.h>

#include "backend/cuda/attention/sm90.cuh"

typedef CUresult (*encode_tiled_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                    const cuuint64_t *, const cuuint32_t *, const cuuint32_t *,
                                    CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                    CUtensorMapFloatOOBfill);

static encode_tiled_fn load_encoder() {
    void *fn = NULL;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) !=
            cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
        cudaGetLastError();
        return NULL;
    }
    return (encode_tiled_fn)fn;
}
static encode_tiled_fn encoder() {
    static const encode_tiled_fn fn = load_encoder(); /* thread-safe static init */
    return fn;
}

bool attn_sm90_map_rows(CUtensorMap *map, const void *base, int rows, int heads, int D, int box_rows) {
    encode_tiled_fn enc = encoder();
    if (!enc || rows <= 0 || ((uintptr_t)base & 15)) return false;
    const cuuint64_t dims[3] = {(cuuint64_t)D, (cuuint64_t)heads, (cuuint64_t)rows};
    const cuuint64_t strides[2] = {(cuuint64_t)D * 2, (cuuint64_t)heads * D * 2};
    const cuuint32_t box[3] = {64, 1, (cuuint32_t)box_rows}, estr[3] = {1, 1, 1};
    return enc(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, (void *)base, dims, strides, box, estr,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

bool attn_sm90_map_ints(CUtensorMap *map, const void *base, int n, int box_n) {
    encode_tiled_fn enc = encoder();
    if (!enc || n <= 0 || ((uintptr_t)base & 15)) return false;
    const cuuint64_t dims[1] = {(cuuint64_t)n}, strides[1] = {4};
    const cuuint32_t box[1] = {(cuuint32_t)box_n}, estr[1] = {1};
    return enc(map, CU_TENSOR_MAP_DATA_TYPE_INT32, 1, (void *)base, dims, strides, box, estr,
               CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_NONE,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

int attn_env_int(const char *name, int dflt) {
    const char *e = getenv(name);
    return e && *e ? atoi(e) : dflt;
}

bool attn_sm90_prepare(cf_cuda_ctx *ctx, const void *fn, size_t smem, int which) {
    const unsigned bit = 1u << which;
    if (ctx->attn_sm90_attr_done & bit) return true;
    if (smem > ctx->smem_optin) {
        cf_cuda_ctx_fail(ctx, "attention (cuda, sm90): a kernel needs %zu bytes of shared memory; GPU %d (%s) allows %zu",
                         smem, ctx->device, ctx->device_name, ctx->smem_optin);
        return false;
    }
    if (!CF_CK(ctx, cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem))) return false;
    ctx->attn_sm90_attr_done |= bit;
    return true;
}

#if !(defined(CF_CUDA_PORTABLE) && CF_CUDA_PORTABLE)
static __global__ void sm90a_flag_kernel(int *flag) { *flag = CF_SM90A_PATH; }

/* 1 when the sm_90a code of this binary is what runs on the context's device */
static int runs_sm90a(cf_cuda_ctx *ctx) {
    int *d = NULL, h = 0;
    if (!CF_CK(ctx, cudaMalloc(&d, sizeof(int)))) return 0;
    sm90a_flag_kernel<<<1, 1, 0, ctx->stream>>>(d);
    const bool ok = CF_CK_LAUNCH(ctx, "sm90a flag") &&
                    CF_CK(ctx, cudaMemcpyAsync(&h, d, sizeof(int), cudaMemcpyDeviceToHost, ctx->stream)) &&
                    CF_CK(ctx, cudaStreamSynchronize(ctx->stream));
    CF_CK(ctx, cudaFree(d));
    return ok ? h : 0;
}
#endif

bool attn_sm90_enabled(cf_cuda_ctx *ctx) {
    if (ctx->attn_path == 0) {
        const char *env = getenv("CENTRIFUGE_ATTENTION");
        const bool portable = env && strcmp(env, "portable") == 0, hopper = env && strcmp(env, "hopper") == 0;
        if (env && *env && !portable && !hopper && strcmp(env, "auto") != 0) {
            cf_cuda_ctx_fail(ctx, "CENTRIFUGE_ATTENTION=%s: expected auto, hopper or portable", env);
            return false;
        }
        bool ok = false;
#if !(defined(CF_CUDA_PORTABLE) && CF_CUDA_PORTABLE)
        ok = !portable && ctx->cc_major == 9 && ctx->cc_minor == 0 && encoder() != NULL && runs_sm90a(ctx);
#endif
        if (ctx->failed) return false;
        if (hopper && !ok) {
            cf_cuda_ctx_fail(ctx,
                             "CENTRIFUGE_ATTENTION=hopper: GPU %d (%s, cc %d.%d) cannot run the sm_90a attention "
                             "kernels of this build",
                             ctx->device, ctx->device_name, ctx->cc_major, ctx->cc_minor);
            return false;
        }
        ctx->attn_path = ok ? 2 : 1;
    }
    return ctx->attn_path == 2;
}
