/*
 * backend_cuda_stub.c — cf_backend_cuda_create for binaries built without
 * CUDA (plain `make`). `make cuda` compiles every C source with
 * -DCF_WITH_CUDA, which empties this file, and links the .cu files of
 * src/backend/cuda (backend.cu defines the real one).
 */
#ifndef CF_WITH_CUDA
#include <stddef.h>

#include "backend/backend.h"
#include "base/common.h"

cf_backend *cf_backend_cuda_create(int device) {
    (void)device;
    cf_fail("this binary was built without CUDA; build with make cuda");
    return NULL;
}
#else
/* ISO C forbids an empty translation unit. */
typedef int cf_backend_cuda_stub_unused;
#endif
