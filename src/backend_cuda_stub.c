/* backend_cuda_stub.c — cf_backend_cuda_create for binaries built without
 * CUDA (`make`); `make cuda` builds the real one from backend_cuda.cu. */
#ifndef CF_WITH_CUDA
#include "backend.h"
#include "common.h"

cf_backend *cf_backend_cuda_create(void) {
    cf_fail("this binary was built without CUDA; build centrifuge-cuda with `make cuda`");
    return NULL;
}
#endif
