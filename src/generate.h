/* generate.h — batched decoding on top of the model's forward. */
#ifndef CF_GENERATE_H
#define CF_GENERATE_H
#include <stdint.h>
#include "centrifuge.h"

/* Extends each of the n sequences seqs[i][0..lens[i]) by up to max_new
 * tokens (never past cap), greedy if temperature <= 0. A row stops after
 * emitting stop1 or stop2 (pass -2 for none). */
int cf_generate(cf_model *m, uint32_t **seqs, int *lens, int n, int cap, int max_new, float temperature,
                int top_k, int stop1, int stop2, uint64_t seed);
#endif
