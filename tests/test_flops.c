/* test_flops.c — model FLOPs per token for MFU (cf_config_train_flops_per_token)
 * against hand counts of the published models. */
#include "test.h"
#include "centrifuge.h"

/* TinyLlama-1.1B, untied: V 32000, C 2048, F 5632, L 22, 32 heads, 4 KV
 * heads of 64. Per layer: q, o 2048*2048 = 4,194,304 each; k, v 2048*256 =
 * 524,288 each; gate, up, down 3*2048*5632 = 34,603,008; two RMSNorms 4,096:
 * 44,044,288. N = 22 layers 968,974,336 + final norm 2,048 + LM head
 * 32000*2048 = 65,536,000 -> 1,034,512,384 (the input embedding, another
 * 65,536,000, is left out: 1,100,048,384 parameters in all). */
TEST(tinyllama_flops_per_token_is_6N_plus_6LSH) {
    cf_config c;
    CHECK(cf_config_builtin(&c, "tinyllama-1.1b") == 0);
    CHECK(!c.tie_word_embeddings);
    CHECK(cf_config_num_params(&c) == 1100048384u);
    double N = 1034512384.0;
    CHECK_CLOSE(cf_config_train_flops_per_token(&c, 0), 6 * N, 1e-15);
    /* @4096: 6,207,074,304 + 6*22*4096*2048 = 1,107,296,256 */
    CHECK_CLOSE(cf_config_train_flops_per_token(&c, 4096), 7314370560.0, 1e-15);
    CHECK_CLOSE(cf_config_train_flops_per_token(&c, 2048), 6 * N + 6.0 * 22 * 2048 * 2048, 1e-15);
}

/* Qwen2.5-1.5B, tied embeddings and q/k/v biases: V 151936, C 1536, F 8960,
 * L 28, 12 heads, 2 KV heads of 128. Per layer: q, o 1536*1536 = 2,359,296
 * each; k, v 1536*256 = 393,216 each; biases 1536 + 256 + 256 = 2,048; MLP
 * 3*1536*8960 = 41,287,680; norms 3,072: 46,797,824. N = 28 layers
 * 1,310,339,072 + final norm 1,536 + the tied LM head 151936*1536 =
 * 233,373,696 counted once -> 1,543,714,304 (= all its parameters). */
TEST(tied_qwen_counts_the_lm_head_once) {
    cf_config c;
    CHECK(cf_config_builtin(&c, "qwen2.5-1.5b") == 0);
    CHECK(c.tie_word_embeddings && c.qkv_bias);
    CHECK(cf_config_num_params(&c) == 1543714304u);
    /* @2048: 6N = 9,262,285,824 + 6*28*2048*1536 = 528,482,304 */
    CHECK_CLOSE(cf_config_train_flops_per_token(&c, 2048), 9790768128.0, 1e-15);
}

/* The 4-layer test config, tied: per layer 128*128*2 + 128*64*2 +
 * 3*128*384 + 256 = 196,864; N = 4 * 196,864 + 128 + 320*128 = 828,544. */
TEST(tiny_tied_config) {
    cf_config c;
    CHECK(cf_config_builtin(&c, "tiny") == 0);
    CHECK(c.tie_word_embeddings);
    /* @64: 6 * 828,544 = 4,971,264 + 6*4*64*128 = 196,608 */
    CHECK_CLOSE(cf_config_train_flops_per_token(&c, 64), 5167872.0, 1e-15);
}

int main(void) {
    RUN(tinyllama_flops_per_token_is_6N_plus_6LSH);
    RUN(tied_qwen_counts_the_lm_head_once);
    RUN(tiny_tied_config);
    return test_summary();
}
