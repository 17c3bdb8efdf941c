/*
 * fuzz_safetensors.c — libFuzzer target: the safetensors reader (cf_st_open, then
 * cf_st_read_f32 of every tensor), as a single file and as an index file.
 * The body lives in fuzz_targets.h (shared with tests/test_fuzz_regressions.c).
 * Build and run: make fuzz (robust.mk).
 */
#include "fuzz_targets.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *bad = fz_safetensors(data, size);
    if (bad) {
        fprintf(stderr, "fuzz_safetensors: %s\n", bad);
        abort();
    }
    return 0;
}
