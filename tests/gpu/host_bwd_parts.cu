/*
 * host_bwd_parts.cu — the Hopper backward's query-range parts
 * (attention/sm90.cuh: query_part, bwd_query_parts), checked on the CPU:
 * nvcc compiles it and it runs without a GPU (`make test-cuda-host`, which
 * CI runs).
 *
 * query_part must hand every query tile of a key tile to exactly one block
 * (a tile lost or taken twice is a wrong dk, dv); bwd_query_parts must
 * split where the grid is small and uneven and nowhere else (a split costs
 * partials: fp32 dk, dv traffic), at the model shapes of issue 17 on an
 * H100 (132 SMs). bwd_heads_per_block must pick 4 query heads per block
 * only where the grid stays full with it and the head dim is 64, and only
 * divisors of the GQA group (a non-divisor mixes kv heads in one block).
 */
#include "backend/cuda/attention/common.cuh"
#include "backend/cuda/attention/sm90.cuh"
#include "test.h"

TEST(query_parts_cover_each_tile_once_in_order_and_even) {
    for (int ns = 1; ns <= 4; ns++)
        for (int n = 0; n <= 70; n++) {
            int next = 0, lmin = n + 1, lmax = -1;
            for (int p = 0; p < ns; p++) {
                int b, len;
                query_part(n, p, ns, &b, &len);
                CHECK_MSG(b == next && len >= 0, "n=%d ns=%d part %d: begins at %d (expected %d), %d tiles", n, ns,
                          p, b, next, len);
                next = b + len;
                lmin = len < lmin ? len : lmin;
                lmax = len > lmax ? len : lmax;
            }
            CHECK_MSG(next == n, "n=%d ns=%d: the parts cover %d tiles", n, ns, next);
            CHECK_MSG(lmax - lmin <= 1, "n=%d ns=%d: part lengths %d..%d", n, ns, lmin, lmax);
        }
}

/* (BN, BM, H, hpb, B, qmaxlen, kmaxlen) -> parts, 132 SMs. BM = 64 at
 * D = 128, 128 at D = 64; hpb as attn_sm90_bwd_hpb picks it there. */
TEST(query_parts_split_only_small_uneven_grids) {
    static const struct { const char *what; int BM, H, hpb, B, q, k, want; } cs[] = {
        {"Qwen2.5-1.5B centrifuge part 1 (96 blocks, 16 vs 6.5 steps)", 64, 12, 1, 1, 1024, 1024, 2},
        {"Qwen2.5-1.5B full (192 blocks, 32 vs 24.7 steps: 2 parts were 9% slower)", 64, 12, 1, 1, 2048, 2048, 1},
        {"Llama3.2-3B centrifuge part 1 (192 blocks, 16 vs 13.1 steps)", 64, 24, 1, 1, 1024, 1024, 1},
        {"Llama3.2-3B full", 64, 24, 1, 1, 2048, 2048, 1},
        {"S=4096 D=128 H=32 full, hpb 2", 64, 32, 2, 1, 4096, 4096, 1},
        {"S=4096 D=128 H=32 centrifuge part 1, hpb 2", 64, 32, 2, 1, 2048, 2048, 1},
        {"TinyLlama full (D=64, hpb 4)", 128, 32, 4, 1, 4096, 4096, 1},
        {"TinyLlama centrifuge part 1", 128, 32, 2, 1, 2048, 2048, 1},
        {"Qwen2.5-1.5B centrifuge, 2 sequences (192 blocks)", 64, 12, 1, 2, 1024, 1024, 1},
        {"one key tile, one head: a lone block", 64, 1, 1, 1, 100, 100, 2},
        {"centrifuge-kv shape: all keys, half the queries (16 vs 12.4 steps)", 64, 12, 1, 1, 1024, 2048, 1},
        {"Qwen2.5-1.5B at keep 0.25 (4 key tiles, 8 vs 2 steps)", 64, 12, 1, 1, 512, 512, 2},
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        const int got = bwd_query_parts(128, cs[i].BM, cs[i].H, cs[i].hpb, cs[i].B, cs[i].q, cs[i].k, 132);
        CHECK_MSG(got == cs[i].want, "%s: %d parts, expected %d", cs[i].what, got, cs[i].want);
    }
}

TEST(query_parts_are_one_for_empty_or_invalid_shapes) {
    CHECK(bwd_query_parts(128, 64, 12, 1, 1, 0, 1024, 132) == 1);
    CHECK(bwd_query_parts(128, 64, 12, 1, 1, 1024, 0, 132) == 1);
    CHECK(bwd_query_parts(128, 64, 12, 1, 0, 1024, 1024, 132) == 1);
    CHECK(bwd_query_parts(128, 64, 12, 0, 1, 1024, 1024, 132) == 1);
}

/* (D, H, Hkv, B, kmaxlen) -> query heads per block, BN = 128, 132 SMs */
TEST(heads_per_block_keep_the_grid_full_and_divide_the_group) {
    static const struct { const char *what; int D, H, Hkv, B, k, want; } cs[] = {
        {"TinyLlama full (256 blocks at 4: 0.618 -> 0.601 ms)", 64, 32, 4, 1, 4096, 4},
        {"TinyLlama centrifuge part 1 (128 blocks at 4 were 0.298 -> 0.401 ms)", 64, 32, 4, 1, 2048, 2},
        {"TinyLlama centrifuge, 2 sequences (256 blocks at 4)", 64, 32, 4, 2, 2048, 4},
        {"S=4096 D=128 H=32 Hkv=8 full (4 was 1.095 vs 1.057 ms)", 128, 32, 8, 1, 4096, 2},
        {"S=4096 D=128 centrifuge part 1", 128, 32, 8, 1, 2048, 2},
        {"Llama3.2-3B (group of 3)", 128, 24, 8, 1, 2048, 1},
        {"Qwen2.5-1.5B full (96 blocks at 2)", 128, 12, 2, 1, 2048, 1},
        {"Qwen2.5-1.5B centrifuge", 128, 12, 2, 1, 1024, 1},
        {"no GQA", 64, 32, 32, 1, 4096, 1},
        {"group of 2 at D=64", 64, 32, 16, 1, 4096, 2},
        {"group of 6 at D=64: 4 does not divide it", 64, 48, 8, 1, 4096, 2},
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        const int got = bwd_heads_per_block(cs[i].D, cs[i].H, cs[i].Hkv, cs[i].B, cs[i].k, 128, 132);
        CHECK_MSG(got == cs[i].want, "%s: %d heads per block, expected %d", cs[i].what, got, cs[i].want);
        CHECK_MSG((cs[i].H / cs[i].Hkv) % got == 0, "%s: %d does not divide the group", cs[i].what, got);
    }
}

TEST(heads_per_block_is_one_for_empty_or_invalid_shapes) {
    CHECK(bwd_heads_per_block(64, 32, 4, 1, 0, 128, 132) == 1);
    CHECK(bwd_heads_per_block(64, 32, 4, 0, 4096, 128, 132) == 1);
    CHECK(bwd_heads_per_block(64, 32, 0, 1, 4096, 128, 132) == 1);
    CHECK(bwd_heads_per_block(64, 32, 5, 1, 4096, 128, 132) == 1);
    CHECK(bwd_heads_per_block(64, 0, 4, 1, 4096, 128, 132) == 1);
}

int main(void) {
    RUN(query_parts_cover_each_tile_once_in_order_and_even);
    RUN(query_parts_split_only_small_uneven_grids);
    RUN(query_parts_are_one_for_empty_or_invalid_shapes);
    RUN(heads_per_block_keep_the_grid_full_and_divide_the_group);
    RUN(heads_per_block_is_one_for_empty_or_invalid_shapes);
    return test_summary();
}
