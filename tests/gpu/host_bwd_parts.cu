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
 * H100 (132 SMs). bwd_heads_per_block must pick several query heads per
 * block only where the grid, with its parts, stays full, 4 only at head
 * dim 64, and only divisors of the GQA group (a non-divisor mixes kv heads
 * in one block).
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
        {"Qwen2.5-1.5B centrifuge part 1 without part 2 beside (96 blocks, 16 vs 6.5 steps)", 64, 12, 1, 1, 1024, 1024, 2},
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
        {"Llama3.2-3B full, 3 heads per block (96 vs 49.5 steps: 0.279 -> 0.194 ms with 2)", 64, 24, 3, 1, 2048, 2048, 2},
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        const int got = bwd_query_parts(128, cs[i].BM, cs[i].H, cs[i].hpb, cs[i].B, cs[i].q, cs[i].k, 132, false);
        CHECK_MSG(got == cs[i].want, "%s: %d parts, expected %d", cs[i].what, got, cs[i].want);
    }
}

TEST(query_parts_are_one_for_empty_or_invalid_shapes) {
    CHECK(bwd_query_parts(128, 64, 12, 1, 1, 0, 1024, 132, false) == 1);
    CHECK(bwd_query_parts(128, 64, 12, 1, 1, 1024, 0, 132, false) == 1);
    CHECK(bwd_query_parts(128, 64, 12, 1, 0, 1024, 1024, 132, false) == 1);
    CHECK(bwd_query_parts(128, 64, 12, 0, 1, 1024, 1024, 132, false) == 1);
}

/* With centrifuge's part 2 running beside part 1, its blocks fill the SMs
 * part 1's uneven grid leaves: 1 part where the grid alone would take 2
 * (Qwen2.5-1.5B's centrifuge attention backward: 0.079 ms with 2 parts,
 * 0.069 with 1; H100, run 23) */
TEST(query_parts_are_one_beside_centrifuge_part_2) {
    CHECK(bwd_query_parts(128, 64, 12, 1, 1, 1024, 1024, 132, false) == 2);
    CHECK(bwd_query_parts(128, 64, 12, 1, 1, 1024, 1024, 132, true) == 1);
    CHECK(bwd_query_parts(128, 64, 12, 1, 1, 512, 512, 132, true) == 1);
    CHECK(bwd_query_parts(128, 64, 1, 1, 1, 100, 100, 132, true) == 1);
}

/* (D, H, Hkv, B, qmaxlen, kmaxlen, beside) -> query heads per block,
 * BN = 128, BM as the kernel's (128 at D = 64, 64 at D = 128), 132 SMs */
static int hpb_of(int D, int H, int Hkv, int B, int q, int k, bool beside) {
    return bwd_heads_per_block(D, 128, D == 64 ? 128 : 64, H, Hkv, B, q, k, 132, beside);
}

TEST(heads_per_block_keep_the_grid_full_and_divide_the_group) {
    static const struct { const char *what; int D, H, Hkv, B, q, k; bool beside; int want; } cs[] = {
        {"TinyLlama full (256 blocks at 4: 0.618 -> 0.601 ms)", 64, 32, 4, 1, 4096, 4096, false, 4},
        {"TinyLlama centrifuge part 1 (128 blocks at 4 were 0.298 -> 0.401 ms)", 64, 32, 4, 1, 2048, 2048, true, 2},
        {"TinyLlama centrifuge, 2 sequences (256 blocks at 4)", 64, 32, 4, 2, 2048, 2048, true, 4},
        {"S=4096 D=128 H=32 Hkv=8 full (4 was 1.095 vs 1.057 ms)", 128, 32, 8, 1, 4096, 4096, false, 2},
        {"S=4096 D=128 centrifuge part 1", 128, 32, 8, 1, 2048, 2048, true, 2},
        {"Llama3.2-3B full (group of 3; 256 blocks at 3 with 2 parts: 0.214 -> 0.194 ms)", 128, 24, 8, 1, 2048, 2048,
         false, 3},
        {"Llama3.2-3B centrifuge part 1 (64 blocks at 3)", 128, 24, 8, 1, 1024, 1024, true, 1},
        {"Qwen2.5-1.5B full (192 blocks at 2 with 2 parts)", 128, 12, 2, 1, 2048, 2048, false, 1},
        {"Qwen2.5-1.5B centrifuge part 1", 128, 12, 2, 1, 1024, 1024, true, 1},
        {"no GQA", 64, 32, 32, 1, 4096, 4096, false, 1},
        {"group of 2 at D=64", 64, 32, 16, 1, 4096, 4096, false, 2},
        {"group of 6 at D=64: 4 does not divide it", 64, 48, 8, 1, 4096, 4096, false, 3},
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        const int got = hpb_of(cs[i].D, cs[i].H, cs[i].Hkv, cs[i].B, cs[i].q, cs[i].k, cs[i].beside);
        CHECK_MSG(got == cs[i].want, "%s: %d heads per block, expected %d", cs[i].what, got, cs[i].want);
        CHECK_MSG((cs[i].H / cs[i].Hkv) % got == 0, "%s: %d does not divide the group", cs[i].what, got);
    }
}

/* 4 heads per block only at D = 64; 3 and 2 at both; never a non-divisor
 * of the group, whatever the shape */
TEST(heads_per_block_divide_the_group_and_take_4_only_at_d64) {
    for (int D = 64; D <= 128; D += 64)
        for (int Hkv = 1; Hkv <= 8; Hkv++)
            for (int G = 1; G <= 12; G++)
                for (int S = 256; S <= 8192; S *= 2) {
                    const int got = hpb_of(D, G * Hkv, Hkv, 1, S, S, false);
                    CHECK_MSG(got >= 1 && G % got == 0 && (got <= 3 || D == 64), "D=%d G=%d Hkv=%d S=%d: %d", D, G,
                              Hkv, S, got);
                }
}

TEST(heads_per_block_is_one_for_empty_or_invalid_shapes) {
    CHECK(hpb_of(64, 32, 4, 1, 4096, 0, false) == 1);
    CHECK(hpb_of(64, 32, 4, 0, 4096, 4096, false) == 1);
    CHECK(hpb_of(64, 32, 0, 1, 4096, 4096, false) == 1);
    CHECK(hpb_of(64, 32, 5, 1, 4096, 4096, false) == 1);
    CHECK(hpb_of(64, 0, 4, 1, 4096, 4096, false) == 1);
}

/* The warp's search of centrifuge's prep (kept_search_probe / _narrow),
 * with the 32 lanes and the ballot played on the CPU, against a count: for
 * every filtered row j of kept lists of every density (none filtered, one
 * kept, runs, random; up to 40000 rows), the kept rows before it, in at most
 * ceil(log32(n + 1)) + 1 rounds. */
static int warp_search(const int *rows, int n, int j, int *rounds) {
    int lo = 0, hi = n;
    *rounds = 0;
    while (lo < hi) {
        unsigned hit = 0;
        for (int lane = 0; lane < 32; lane++) {
            const int p = kept_search_probe(lo, hi, lane);
            if (p >= hi || rows[p] - p > j) hit |= 1u << lane;
        }
        ++*rounds;
        if (!kept_search_narrow(&lo, &hi, hit)) break;
    }
    return lo;
}

TEST(kept_search_finds_the_kept_rows_before_each_filtered_row) {
    static const struct { int T; double keep; int pattern; } cs[] = {
        {1, 1.0, 0},     {7, 0.0, 3},    {64, 0.5, 0},   {100, 1.0, 0}, {333, 0.2, 0},
        {2048, 0.5, 0},  {4096, 0.9, 0}, {5000, 0.5, 1}, {4097, 0.5, 2}, {40000, 0.5, 0},
        {40000, 0.02, 0}, {1000, 0.0, 4},
    };
    unsigned seed = 12345;
    for (size_t ci = 0; ci < sizeof cs / sizeof cs[0]; ci++) {
        const int T = cs[ci].T;
        int *rows = (int *)malloc(sizeof(int) * (size_t)T), *before = (int *)malloc(sizeof(int) * (size_t)T);
        int n = 0, nf = 0;
        for (int r = 0; r < T; r++) {
            seed = seed * 1103515245u + 12345u;
            int take;
            switch (cs[ci].pattern) {
            case 1: take = (r / 37) % 2; break;           /* runs of 37 */
            case 2: take = r == T / 2; break;             /* one kept row */
            case 3: take = 1; break;                      /* all kept: no filtered row */
            case 4: take = r == 0 || r == T - 1; break;   /* the ends only */
            default: take = (seed >> 8) % 1000 < cs[ci].keep * 1000;
            }
            if (take) rows[n++] = r;
            else before[nf++] = n; /* filtered row nf has n kept rows before it */
        }
        int worst = 0, maxr = 1;
        for (int m = n + 1; m > 1; m = (m + 31) / 32) maxr++;
        for (int j = 0; j < nf; j++) {
            int rounds;
            const int got = warp_search(rows, n, j, &rounds);
            CHECK_MSG(got == before[j], "T=%d n=%d: filtered row %d has %d kept rows before it, search says %d", T, n,
                      j, before[j], got);
            if (got != before[j]) break;
            worst = rounds > worst ? rounds : worst;
        }
        CHECK_MSG(worst <= maxr, "T=%d n=%d: %d rounds (at most %d expected)", T, n, worst, maxr);
        free(rows);
        free(before);
    }
}

int main(void) {
    RUN(query_parts_cover_each_tile_once_in_order_and_even);
    RUN(query_parts_split_only_small_uneven_grids);
    RUN(query_parts_are_one_for_empty_or_invalid_shapes);
    RUN(query_parts_are_one_beside_centrifuge_part_2);
    RUN(heads_per_block_keep_the_grid_full_and_divide_the_group);
    RUN(heads_per_block_divide_the_group_and_take_4_only_at_d64);
    RUN(heads_per_block_is_one_for_empty_or_invalid_shapes);
    RUN(kept_search_finds_the_kept_rows_before_each_filtered_row);
    return test_summary();
}
