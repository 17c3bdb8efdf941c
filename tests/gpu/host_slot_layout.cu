/*
 * host_slot_layout.cu — the Hopper backward's dq accumulator layout
 * ("slot order", attention/sm90.cuh), checked on the CPU: nvcc compiles it,
 * and it runs without a GPU (`make test-cuda-host`, which CI runs).
 *
 * Three maps must agree, or dq lands on the wrong (row, column):
 *   - the writer: bwd_sm90.cu's consumers store accumulators 4j..4j+3 of
 *     warpgroup thread tid as float4 number j*128 + tid of their 64 x nw
 *     block, and wgmma's fragment map puts accumulator 4j+e of that thread
 *     at row 16v+g (+8 for e >= 2), column 8j+2t (+1 for odd e);
 *   - dq_slot_index(r, c, nw), the readers' (part 2, tests) position;
 *   - dq_slot_coords(k, nw), the conversion's inverse by float4.
 */
#include "backend/cuda/attention/common.cuh"
#include "backend/cuda/attention/sm90.cuh"
#include "test.h"

/* position in the slot where the consumers' store puts element (r, c) of
 * the dQ product, following the fragment map (independent of sm90.cuh) */
static int writer_position(int r, int c, int nw) {
    const int blk = c / nw, cc = c % nw;
    const int v = r / 16, g = r % 8, hi = (r % 16) >= 8; /* row 16v + g + 8 hi */
    const int j = cc / 8, t = (cc % 8) / 2, odd = cc % 2;
    const int tid = 32 * v + 4 * g + t, e = 2 * hi + odd;
    return blk * 64 * nw + 4 * (j * 128 + tid) + e;
}

TEST(dq_slot_index_is_the_position_the_consumers_store_each_element_at) {
    for (int D = 64; D <= 128; D *= 2)
        for (int nw = D / 2; nw <= D; nw *= 2) {
            int bad = 0;
            for (int r = 0; r < 64; r++)
                for (int c = 0; c < D; c++) bad += dq_slot_index(r, c, nw) != writer_position(r, c, nw);
            CHECK_MSG(bad == 0, "D=%d nw=%d: %d of %d elements differ", D, nw, bad, 64 * D);
        }
}

TEST(dq_slot_index_covers_each_position_of_a_slot_once) {
    for (int D = 64; D <= 128; D *= 2)
        for (int nw = D / 2; nw <= D; nw *= 2) {
            int *seen = (int *)calloc(64 * D, sizeof(int));
            int out = 0, twice = 0;
            for (int r = 0; r < 64; r++)
                for (int c = 0; c < D; c++) {
                    const int p = dq_slot_index(r, c, nw);
                    if (p < 0 || p >= 64 * D) out++;
                    else twice += seen[p]++ > 0;
                }
            CHECK_MSG(out == 0 && twice == 0, "D=%d nw=%d: %d outside, %d twice", D, nw, out, twice);
            free(seen);
        }
}

TEST(dq_slot_coords_inverts_dq_slot_index_for_each_float4) {
    for (int D = 64; D <= 128; D *= 2)
        for (int nw = D / 2; nw <= D; nw *= 2) {
            int bad = 0;
            for (int k = 0; k < 16 * D; k++) {
                int r, c;
                dq_slot_coords(k, nw, &r, &c);
                if (r < 0 || r + 8 >= 64 || c < 0 || c + 1 >= D) {
                    bad++;
                    continue;
                }
                bad += dq_slot_index(r, c, nw) != 4 * k;
                bad += dq_slot_index(r, c + 1, nw) != 4 * k + 1;
                bad += dq_slot_index(r + 8, c, nw) != 4 * k + 2;
                bad += dq_slot_index(r + 8, c + 1, nw) != 4 * k + 3;
            }
            CHECK_MSG(bad == 0, "D=%d nw=%d: %d mismatches", D, nw, bad);
        }
}

TEST(slots_of_a_sequence_and_head_are_consecutive_and_disjoint) {
    /* slot (b, h, q64) starts at ((b H + h) tps + q64) 64 D: the next
     * tile, head and sequence follow without a gap or an overlap */
    const int H = 12, D = 128, tps = 32;
    CHECK(dq_slot_base(0, 0, 1, H, D, tps) == (size_t)64 * D);
    CHECK(dq_slot_base(0, 1, 0, H, D, tps) == dq_slot_base(0, 0, tps - 1, H, D, tps) + 64 * D);
    CHECK(dq_slot_base(1, 0, 0, H, D, tps) == dq_slot_base(0, H - 1, tps - 1, H, D, tps) + 64 * D);
}

int main(void) {
    RUN(dq_slot_index_is_the_position_the_consumers_store_each_element_at);
    RUN(dq_slot_index_covers_each_position_of_a_slot_once);
    RUN(dq_slot_coords_inverts_dq_slot_index_for_each_float4);
    RUN(slots_of_a_sequence_and_head_are_consecutive_and_disjoint);
    return test_summary();
}
