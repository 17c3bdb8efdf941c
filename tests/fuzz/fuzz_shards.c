/*
 * fuzz_shards.c — libFuzzer target: the token-shard and reference-loss-shard readers
 * (cf_tokens_open, cf_refloss_open).
 * The body lives in fuzz_targets.h (shared with tests/test_fuzz_regressions.c).
 * Build and run: make fuzz (robust.mk).
 */
#include "fuzz_targets.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *bad = fz_shards(data, size);
    if (bad) {
        fprintf(stderr, "fuzz_shards: %s\n", bad);
        abort();
    }
    return 0;
}
