/*
 * fuzz_config.c — libFuzzer target: the config.json reader (cf_config_load), with a
 * save -> load round trip of every config that loads.
 * The body lives in fuzz_targets.h (shared with tests/test_fuzz_regressions.c).
 * Build and run: make fuzz (robust.mk).
 */
#include "fuzz_targets.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *bad = fz_config(data, size);
    if (bad) {
        fprintf(stderr, "fuzz_config: %s\n", bad);
        abort();
    }
    return 0;
}
