/*
 * host_bwd_parts.cu — the Hopper backward's launch plan
 * (attention/sm90.cuh: query_part, bwd_grid_cost, bwd_plan), checked on
 * the CPU: nvcc compiles it and it runs without a GPU (`make
 * test-cuda-host`, which CI runs).
 *
 * query_part must hand every query tile of a key tile to exactly one block
 * (a tile lost or taken twice is a wrong dk, dv). bwd_grid_cost must play
 * the block schedule it claims to (hand-counted grids). bwd_plan must pick,
 * at the shapes timed on an H100 (132 SMs), the plan that was fastest or
 * within noise of it; only divisors of the GQA group (a non-divisor mixes
 * kv heads in one block), 4 heads only at head dim 64, one part beside
 * centrifuge's part 2, and what a test or timing run forces.
 */
#include <math.h>

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

/* An H100's or H200's plan (132 SMs, BN = 128, BM = 128 at D = 64 and 64
 * at D = 128, as the kernel's), nothing forced; beside: centrifuge at keep
 * 0.5 (as many filtered keys per sequence as kept ones) */
static BwdPlan plan_of(int D, int H, int Hkv, int B, int q, int k, bool beside) {
    return bwd_plan(D, 128, D == 64 ? 128 : 64, H, Hkv, B, q, k, 132, beside ? k : 0, 0, 0);
}

/* Hand-counted grids, no partials (H == Hkv, one part): 132 equal blocks
 * of one step on 132 SMs end together; 133 take two rounds; and in launch
 * order the longest blocks start first */
TEST(grid_cost_plays_the_block_schedule) {
    const double blk = BWD_COST_BLOCK;
    /* one key tile of 64 queries (one BM = 64 step) per head, 132 heads */
    CHECK(fabs(bwd_grid_cost(128, 64, 132, 132, 128, 1, 64, 64, 1, 1, 132) - (1 + blk)) < 1e-9);
    CHECK(fabs(bwd_grid_cost(128, 64, 133, 133, 128, 1, 64, 64, 1, 1, 132) - 2 * (1 + blk)) < 1e-9);
    /* 2 key tiles of 128 on 256 queries, 1 head, 2 SMs: tile 0 sees 4
     * steps, tile 1 sees 2; each on its own SM */
    CHECK(fabs(bwd_grid_cost(128, 64, 1, 1, 128, 1, 256, 256, 1, 1, 2) - (4 + blk)) < 1e-9);
    /* the same on one SM: one after the other */
    CHECK(fabs(bwd_grid_cost(128, 64, 1, 1, 128, 1, 256, 256, 1, 1, 1) - (6 + 2 * blk)) < 1e-9);
    /* 2 parts on 4 SMs: tile 0's 4 steps as 2 + 2, tile 1's 2 as 1 + 1;
     * partials now (ns > 1): 256 keys x 1 x 2 x 128 x 8 bytes */
    const double part = BWD_COST_MB * 256.0 * 2 * 128 * 8 / 1e6;
    CHECK(fabs(bwd_grid_cost(128, 64, 1, 1, 128, 1, 256, 256, 1, 2, 4) - (2 + blk + part)) < 1e-9);
    /* GQA partials with one part: [nk, H/hpb, D] for dk and dv */
    const double gqa = BWD_COST_MB * 256.0 * 2 * 1 * 128 * 8 / 1e6;
    CHECK(fabs(bwd_grid_cost(128, 64, 2, 1, 128, 1, 256, 256, 1, 1, 4) - (4 + blk + gqa)) < 1e-9);
    /* both heads of the group in one block, one part: it writes dk, dv
     * itself, no partials (tile 0: 2 heads x 4 steps) */
    CHECK(fabs(bwd_grid_cost(128, 64, 2, 1, 128, 1, 256, 256, 2, 1, 4) - (8 + blk)) < 1e-9);
    /* more SMs never cost more */
    for (int sms = 1; sms < 200; sms++)
        CHECK(bwd_grid_cost(128, 64, 24, 8, 128, 2, 2048, 2048, 3, 2, sms + 1) <=
              bwd_grid_cost(128, 64, 24, 8, 128, 2, 2048, 2048, 3, 2, sms) + 1e-9);
}

/* (D, H, Hkv, B, qmaxlen, kmaxlen, beside) -> heads per block x parts;
 * times are ms of the full backward (or centrifuge, beside), H100 */
/* Centrifuge's part 2 counted by hand: 256 kept queries (two items) over
 * 256 filtered keys at D = 64 (128-key tiles): the first item's last query
 * halfway, 128 filtered keys before it (one tile), the second's at the end
 * (two); at D = 128 (64-key tiles) two and four. Side by side, the parts
 * end no earlier than part 1 alone, and no earlier than all the work spread
 * over the SMs. */
TEST(beside_cost_adds_part_2_where_part_1_leaves_room) {
    CHECK(fabs(bwd_part2_cost(64, 1, 1, 256, 256) - 3 * BWD_COST_PART2) < 1e-9);
    CHECK(fabs(bwd_part2_cost(128, 3, 2, 256, 256) - 6 * 3 * 2 * BWD_COST_PART2) < 1e-9);
    CHECK(bwd_part2_cost(64, 32, 1, 2048, 0) == 0.0);
    for (int flen = 0; flen <= 8192; flen += 1024)
        for (int hpb = 1; hpb <= 4; hpb *= 2)
            for (int ns = 1; ns <= 2; ns++) {
                double busy;
                const double span = bwd_grid_play(128, 128, 32, 1, 2048, 2048, hpb, ns, 132, &busy);
                const double c = bwd_beside_cost(128, 128, 32, 4, 64, 1, 2048, 2048, flen, hpb, ns, 132);
                CHECK_MSG(c >= span - 1e-9 && c >= (busy + bwd_part2_cost(64, 32, 1, 2048, flen)) / 132 - 1e-9,
                          "flen=%d %d x %d: %g (span %g)", flen, hpb, ns, c, span);
            }
    /* two partials per kv head (2 groups x 1 part) are summed by pairs:
     * no partials cost; four (2 x 2) are not */
    double busy;
    const double s21 = bwd_grid_play(128, 128, 8, 1, 256, 256, 2, 1, 1000, &busy);
    CHECK(fabs(bwd_beside_cost(128, 128, 8, 2, 64, 1, 256, 256, 1, 2, 1, 1000) - s21) < 1e-9);
    const double s12 = bwd_grid_play(128, 128, 8, 1, 256, 256, 1, 2, 1000, &busy);
    CHECK(fabs(bwd_beside_cost(128, 128, 8, 2, 64, 1, 256, 256, 1, 1, 2, 1000) - s12 -
               BWD_COST_MB_BESIDE * 256.0 * 8 * 2 * 64 * 8 / 1e6) < 1e-9);
}

TEST(plan_picks_the_fastest_timed_plan) {
    static const struct { const char *what; int D, H, Hkv, B, q, k; bool beside; int hpb, ns; } cs[] = {
        {"Llama3.2-3B (group of 3): 3 x 2 0.191, 1 x 1 0.212 (run 24)", 128, 24, 8, 1, 2048, 2048, false, 3, 2},
        {"Llama3.2-3B, 4 sequences: 3 x 1 0.671, 3 x 2 0.704, 1 x 1 0.763", 128, 24, 8, 4, 2048, 2048, false, 3, 1},
        {"Llama3.2-3B @1024: 1 x 1 0.081, 3 x 2 0.095", 128, 24, 8, 1, 1024, 1024, false, 1, 1},
        {"Qwen2.5-1.5B, 4 sequences: 3 x 2 0.360, 2 x 1 0.385, 3 x 1 0.436", 128, 12, 2, 4, 2048, 2048, false, 3, 2},
        {"Qwen2.5-1.5B @4096: 3 x 2 0.292, 1 x 1 0.329", 128, 12, 2, 1, 4096, 4096, false, 3, 2},
        {"S=4096 D=128 H=32 Hkv=8: 2 x 1 0.751, 2 x 2 0.816", 128, 32, 8, 1, 4096, 4096, false, 2, 1},
        {"TinyLlama: 4 x 1 0.426, 4 x 2 0.448 (run 22)", 64, 32, 4, 1, 4096, 4096, false, 4, 1},
        {"TinyLlama, 2 sequences: 4 x 1 0.261, 2 x 1 0.276", 64, 32, 4, 2, 2048, 2048, false, 4, 1},
        {"group of 3 at D=64: 3 x 1 0.324, 1 x 1 0.359", 64, 24, 8, 1, 4096, 4096, false, 3, 1},
        {"group of 6 at D=64: 3 x 1 0.637, 2 x 1 0.664", 64, 48, 8, 1, 4096, 4096, false, 3, 1},
        {"no GQA at D=64: 1 x 1", 64, 32, 32, 1, 4096, 4096, false, 1, 1},
        {"TinyLlama centrifuge (run 34): 4 x 2 and 2 x 1 0.191-0.193, 4 x 1 0.210-0.212", 64, 32, 4, 1, 2048, 2048,
         true, 4, 2},
        {"TinyLlama centrifuge, 2 sequences (run 34): 4 x 1 0.348-0.351, 2 x 1 0.366, 4 x 2 0.373", 64, 32, 4, 2,
         2048, 2048, true, 4, 1},
        {"S=4096 D=128 centrifuge (run 34): 2 x 1 0.307-0.309, 2 x 2 0.338-0.342", 128, 32, 8, 1, 2048, 2048, true, 2,
         1},
        {"Llama3.2-3B centrifuge (run 34): 3 x 2 0.087-0.088, 1 x 1 0.098-0.099, 3 x 1 0.141-0.143", 128, 24, 8, 1,
         1024, 1024, true, 3, 2},
        {"Llama3.2-3B centrifuge, 4 sequences (run 34): 3 x 1 0.294, 3 x 2 0.310, 1 x 1 0.352", 128, 24, 8, 4, 1024,
         1024, true, 3, 1},
        {"Qwen2.5-1.5B centrifuge (run 34): 2 x 2 0.061-0.062, 1 x 1 0.063-0.067, 1 x 2 0.065 (and slower in the "
         "model), 3 x 2 0.079-0.081",
         128, 12, 2, 1, 1024, 1024, true, 2, 2},
        {"Qwen2.5-1.5B centrifuge, 4 sequences (run 34): 3 x 1 0.159, 2 x 1 0.165, 3 x 2 0.169, 1 x 1 0.186", 128,
         12, 2, 4, 1024, 1024, true, 3, 1},
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        const BwdPlan p = plan_of(cs[i].D, cs[i].H, cs[i].Hkv, cs[i].B, cs[i].q, cs[i].k, cs[i].beside);
        CHECK_MSG(p.hpb == cs[i].hpb && p.ns == cs[i].ns, "%s: %d x %d, expected %d x %d", cs[i].what, p.hpb, p.ns,
                  cs[i].hpb, cs[i].ns);
    }
    /* Qwen2.5-1.5B full: 1 x 1 0.115 and 2 x 2 0.113 are equals; 1 x 2
     * (0.134) and 2 x 1 (0.179) are not */
    const BwdPlan q = plan_of(128, 12, 2, 1, 2048, 2048, false);
    CHECK_MSG(q.hpb == q.ns && q.hpb <= 2, "Qwen2.5-1.5B full: %d x %d", q.hpb, q.ns);
}

/* Whatever the shape: hpb divides the group, 4 only at D = 64, 1 or 2
 * parts */
TEST(plan_divides_the_group_and_keeps_its_limits) {
    for (int D = 64; D <= 128; D += 64)
        for (int Hkv = 1; Hkv <= 8; Hkv++)
            for (int G = 1; G <= 12; G++)
                for (int S = 256; S <= 8192; S *= 4)
                    for (int B = 1; B <= 4; B *= 2)
                        for (int beside = 0; beside < 2; beside++) {
                            const BwdPlan p = plan_of(D, G * Hkv, Hkv, B, S, S, beside);
                            CHECK_MSG(p.hpb >= 1 && G % p.hpb == 0 && (p.hpb <= 3 || D == 64) && p.ns >= 1 &&
                                          p.ns <= 2,
                                      "D=%d G=%d Hkv=%d S=%d B=%d beside=%d: %d x %d", D, G, Hkv, S, B, beside, p.hpb,
                                      p.ns);
                        }
}

/* Forced through the context or the environment: hpb falls to the next
 * lower divisor of the group (4 -> 3 in a group of 3, 2 -> 1), 4 is
 * allowed at D = 128 when asked for, parts are capped at 2 */
TEST(plan_takes_what_is_forced) {
    BwdPlan p = bwd_plan(128, 128, 64, 24, 8, 1, 2048, 2048, 132, 0, 4, 1);
    CHECK(p.hpb == 3 && p.ns == 1);
    p = bwd_plan(128, 128, 64, 24, 8, 1, 2048, 2048, 132, 0, 2, 2);
    CHECK(p.hpb == 1 && p.ns == 2);
    p = bwd_plan(128, 128, 64, 32, 8, 1, 4096, 4096, 132, 0, 4, 0);
    CHECK(p.hpb == 4 && (p.ns == 1 || p.ns == 2));
    p = bwd_plan(64, 128, 128, 32, 4, 1, 4096, 4096, 132, 4096, 0, 3);
    CHECK(p.ns == 2);
    p = bwd_plan(64, 128, 128, 32, 4, 1, 4096, 4096, 132, 0, 9, 0);
    CHECK(p.hpb == 8);
}

TEST(plan_is_one_by_one_for_empty_or_invalid_shapes) {
    static const int bad[][6] = {{32, 4, 1, 4096, 0}, {32, 4, 0, 4096, 4096}, {32, 0, 1, 4096, 4096},
                                 {32, 5, 1, 4096, 4096}, {0, 4, 1, 4096, 4096}, {32, 4, 1, 0, 4096}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const BwdPlan p = plan_of(64, bad[i][0], bad[i][1], bad[i][2], bad[i][3], bad[i][4], false);
        CHECK_MSG(p.hpb == 1 && p.ns == 1, "case %zu: %d x %d", i, p.hpb, p.ns);
    }
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
    RUN(grid_cost_plays_the_block_schedule);
    RUN(beside_cost_adds_part_2_where_part_1_leaves_room);
    RUN(plan_picks_the_fastest_timed_plan);
    RUN(plan_divides_the_group_and_keeps_its_limits);
    RUN(plan_takes_what_is_forced);
    RUN(plan_is_one_by_one_for_empty_or_invalid_shapes);
    RUN(kept_search_finds_the_kept_rows_before_each_filtered_row);
    return test_summary();
}
