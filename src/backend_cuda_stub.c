/*
 * backend_cuda_stub.c — cf_backend_cuda_create for binaries built without
 * CUDA (plain `make`). `make cuda` compiles every C source with
 * -DCF_WITH_CUDA, which empties this file, and links backend_cuda.cu.
 */
#ifndef CF_WITH_CUDA
#include <stddef.h>

#include "backend.h"
#include "common.h"

cf_backend *cf_backend_cuda_create(void) {
    cf_fail("this binary was built without CUDA; build with make cuda");
    return NULL;
}
#else
/* ISO C forbids an empty translation unit. */
typedef int cf_backend_cuda_stub_unused;
#endif
