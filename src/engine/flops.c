/*
 * flops.c — model FLOPs of a dense training step, for MFU in `bench` and in
 * tools/bench_pytorch.py (which repeats the same formula).
 */
#include "centrifuge.h"

/* FLOPs per token of one dense training step (forward + backward) at
 * sequence length S:
 *
 *   6 * N  +  6 * L * S * H
 *
 * N: every parameter except the input embedding table (the lookup costs no
 * FLOPs), so the LM head counts, once, also when it is tied to the
 * embedding. Each weight is a multiply-add per token forward (2N) and two
 * backward (input and weight gradient, 4N). Attention per token and
 * layer: QK^T and PV are 2 * S * H FLOPs each over all S keys (4SH), half
 * of that under the causal mask (2SH) forward, twice that backward: 6SH.
 * H is the hidden size (as in the PaLM / Megatron MFU convention; where
 * heads x head_dim differs from it, as in some Qwen3 configs, this is the
 * convention, not an exact attention count). */
double cf_config_train_flops_per_token(const cf_config *c, int seq) {
    double V = c->vocab_size, C = c->hidden_size;
    double all = (double)cf_config_num_params(c);   /* embedding once; + lm_head if untied */
    double N = c->tie_word_embeddings ? all : all - V * C;
    return 6.0 * N + 6.0 * c->num_hidden_layers * (double)seq * C;
}
