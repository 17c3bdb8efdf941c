/* test_config.c — config.json parsing, validation, built-ins, saving. */
#include "test.h"
#include "base/common.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <ftw.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char g_dir[64];
static char g_path[512];   /* <g_dir>/config.json */

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    if (!f) { perror(path); exit(2); }
    fputs(text, f);
    fclose(f);
}

/* Writes json to <dir>/config.json and loads it. */
static int load_json(const char *json, cf_config *c) {
    write_text(g_path, json);
    memset(c, 0x5a, sizeof *c);
    return cf_config_load(c, g_path);
}

static int err_has(const char *s) { return strstr(cf_last_error(), s) != NULL; }

/* Checks that loading json fails with a message naming the file and
 * containing each of the given fragments. */
#define CHECK_LOAD_FAILS(json, ...) do { \
    cf_config c_; \
    CHECK(load_json(json, &c_) == -1); \
    CHECK_MSG(err_has(g_path), "message does not name the file: %s", cf_last_error()); \
    const char *frags_[] = {__VA_ARGS__}; \
    for (size_t k_ = 0; k_ < sizeof frags_ / sizeof frags_[0]; k_++) \
        CHECK_MSG(err_has(frags_[k_]), "message lacks '%s': %s", frags_[k_], cf_last_error()); \
} while (0)

static int same_config(const cf_config *a, const cf_config *b) {
    return a->model_type == b->model_type && a->vocab_size == b->vocab_size && a->hidden_size == b->hidden_size &&
           a->intermediate_size == b->intermediate_size && a->num_hidden_layers == b->num_hidden_layers &&
           a->num_attention_heads == b->num_attention_heads && a->num_key_value_heads == b->num_key_value_heads &&
           a->head_dim == b->head_dim && a->max_position_embeddings == b->max_position_embeddings &&
           a->rms_norm_eps == b->rms_norm_eps && a->rope_theta == b->rope_theta &&
           a->tie_word_embeddings == b->tie_word_embeddings && a->qkv_bias == b->qkv_bias && a->o_bias == b->o_bias &&
           a->qk_norm == b->qk_norm && a->rope_llama3 == b->rope_llama3 && a->rope_factor == b->rope_factor &&
           a->rope_low_freq_factor == b->rope_low_freq_factor && a->rope_high_freq_factor == b->rope_high_freq_factor &&
           a->rope_original_max_pos == b->rope_original_max_pos && a->sliding_window == b->sliding_window &&
           a->bos_token_id == b->bos_token_id && a->eos_token_id == b->eos_token_id &&
           a->num_extra_eos == b->num_extra_eos &&
           !memcmp(a->extra_eos_ids, b->extra_eos_ids, (size_t)a->num_extra_eos * sizeof(int));
}

static int count_temp_files(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) if (strstr(e->d_name, ".tmp.")) n++;
    if (d) closedir(d);
    return n;
}

/* ------------------------------------------------------- real HF configs */

/* TinyLlama-1.1B's config.json as published (transformers 4.35). */
static const char *TINYLLAMA_JSON =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"attention_bias\": false, \"bos_token_id\": 1,\n"
    " \"eos_token_id\": 2, \"hidden_act\": \"silu\", \"hidden_size\": 2048, \"initializer_range\": 0.02,\n"
    " \"intermediate_size\": 5632, \"max_position_embeddings\": 2048, \"model_type\": \"llama\",\n"
    " \"num_attention_heads\": 32, \"num_hidden_layers\": 22, \"num_key_value_heads\": 4, \"pretraining_tp\": 1,\n"
    " \"rms_norm_eps\": 1e-05, \"rope_scaling\": null, \"rope_theta\": 10000.0, \"tie_word_embeddings\": false,\n"
    " \"torch_dtype\": \"bfloat16\", \"transformers_version\": \"4.35.0\", \"use_cache\": true, \"vocab_size\": 32000}\n";

static const char *LLAMA31_JSON =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"attention_bias\": false, \"attention_dropout\": 0.0,\n"
    " \"bos_token_id\": 128000, \"eos_token_id\": 128001, \"hidden_act\": \"silu\", \"hidden_size\": 4096,\n"
    " \"initializer_range\": 0.02, \"intermediate_size\": 14336, \"max_position_embeddings\": 131072,\n"
    " \"mlp_bias\": false, \"model_type\": \"llama\", \"num_attention_heads\": 32, \"num_hidden_layers\": 32,\n"
    " \"num_key_value_heads\": 8, \"pretraining_tp\": 1, \"rms_norm_eps\": 1e-05,\n"
    " \"rope_scaling\": {\"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0,\n"
    "   \"original_max_position_embeddings\": 8192, \"rope_type\": \"llama3\"},\n"
    " \"rope_theta\": 500000.0, \"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\",\n"
    " \"use_cache\": true, \"vocab_size\": 128256}\n";

TEST(config_tinyllama_json_matches_builtin_tinyllama) {
    cf_config c, b;
    CHECK(load_json(TINYLLAMA_JSON, &c) == 0);
    CHECK(cf_config_builtin(&b, "tinyllama-1.1b") == 0);
    CHECK(same_config(&c, &b));
    CHECK(c.model_type == CF_MODEL_LLAMA && c.head_dim == 64 && c.tie_word_embeddings == 0);
    CHECK(c.bos_token_id == 1 && c.eos_token_id == 2 && c.rope_llama3 == 0);
}

TEST(config_llama3_rope_scaling_is_read) {
    cf_config c, b;
    CHECK(load_json(LLAMA31_JSON, &c) == 0);
    CHECK(c.rope_llama3 == 1);
    CHECK(c.rope_factor == 8.0f && c.rope_low_freq_factor == 1.0f && c.rope_high_freq_factor == 4.0f);
    CHECK(c.rope_original_max_pos == 8192 && c.rope_theta == 500000.0f);
    CHECK(cf_config_builtin(&b, "llama3.1-8b") == 0);
    CHECK(same_config(&c, &b));
}

TEST(config_transformers5_rope_parameters_are_read) {
    cf_config c;
    CHECK(load_json("{\"model_type\": \"llama\", \"vocab_size\": 100, \"hidden_size\": 64, \"intermediate_size\": 96,"
                    " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2,"
                    " \"rope_parameters\": {\"rope_type\": \"llama3\", \"rope_theta\": 500000.0, \"factor\": 32.0,"
                    " \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0,"
                    " \"original_max_position_embeddings\": 8192}}", &c) == 0);
    CHECK(c.rope_llama3 == 1 && c.rope_factor == 32.0f && c.rope_theta == 500000.0f);
    CHECK(c.rope_original_max_pos == 8192);
    CHECK(load_json("{\"model_type\": \"llama\", \"vocab_size\": 100, \"hidden_size\": 64, \"intermediate_size\": 96,"
                    " \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
                    " \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 1234.5}}", &c) == 0);
    CHECK(c.rope_llama3 == 0 && c.rope_theta == 1234.5f);
}

TEST(config_legacy_rope_scaling_type_key_is_accepted) {
    cf_config c;
    CHECK(load_json("{\"model_type\": \"llama\", \"vocab_size\": 100, \"hidden_size\": 64, \"intermediate_size\": 96,"
                    " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"max_position_embeddings\": 512,"
                    " \"rope_scaling\": {\"type\": \"llama3\", \"factor\": 4, \"low_freq_factor\": 1,"
                    " \"high_freq_factor\": 4}}", &c) == 0);
    CHECK(c.rope_llama3 == 1 && c.rope_factor == 4.0f);
    /* transformers 5 falls back to max_position_embeddings when the
     * original length is missing */
    CHECK(c.rope_original_max_pos == 512);
}

TEST(config_defaults_kv_heads_head_dim_theta_eps_and_untied) {
    cf_config c;
    CHECK(load_json("{\"model_type\": \"llama\", \"vocab_size\": 100, \"hidden_size\": 64, \"intermediate_size\": 96,"
                    " \"num_hidden_layers\": 2, \"num_attention_heads\": 4}", &c) == 0);
    CHECK(c.num_key_value_heads == 4);
    CHECK(c.head_dim == 16);
    CHECK(c.rope_theta == 10000.0f);
    CHECK(c.rms_norm_eps == 1e-6f);
    CHECK(c.max_position_embeddings == 2048);
    CHECK(c.tie_word_embeddings == 0);
    CHECK(c.qkv_bias == 0 && c.o_bias == 0 && c.qk_norm == 0 && c.sliding_window == 0);
    CHECK(c.bos_token_id == -1 && c.eos_token_id == -1);
    /* null means absent */
    CHECK(load_json("{\"model_type\": \"llama\", \"vocab_size\": 100, \"hidden_size\": 64, \"intermediate_size\": 96,"
                    " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": null,"
                    " \"head_dim\": null, \"bos_token_id\": null}", &c) == 0);
    CHECK(c.num_key_value_heads == 4 && c.head_dim == 16 && c.bos_token_id == -1);
}

TEST(config_mistral_sliding_window_null_is_zero_and_int_is_read) {
    cf_config c;
    const char *base = "{\"model_type\": \"mistral\", \"vocab_size\": 32000, \"hidden_size\": 4096,"
                       " \"intermediate_size\": 14336, \"num_hidden_layers\": 32, \"num_attention_heads\": 32,"
                       " \"num_key_value_heads\": 8, \"rms_norm_eps\": 1e-05, \"rope_theta\": 1000000.0,"
                       " \"sliding_window\": %s, \"max_position_embeddings\": 32768}";
    char json[1024];
    snprintf(json, sizeof json, base, "null");
    CHECK(load_json(json, &c) == 0);
    CHECK(c.model_type == CF_MODEL_MISTRAL && c.sliding_window == 0 && c.head_dim == 128);
    CHECK(c.rope_theta == 1e6f && c.qkv_bias == 0 && c.o_bias == 0);
    snprintf(json, sizeof json, base, "4096");
    CHECK(load_json(json, &c) == 0);
    CHECK(c.sliding_window == 4096);
    snprintf(json, sizeof json, base, "\"4096\"");
    CHECK_LOAD_FAILS(json, "sliding_window");
}

TEST(config_qwen2_has_qkv_bias_but_no_o_bias) {
    cf_config c, b;
    CHECK(load_json("{\"architectures\": [\"Qwen2ForCausalLM\"], \"attention_dropout\": 0.0,"
                    " \"bos_token_id\": 151643, \"eos_token_id\": 151643, \"hidden_act\": \"silu\","
                    " \"hidden_size\": 1536, \"initializer_range\": 0.02, \"intermediate_size\": 8960,"
                    " \"max_position_embeddings\": 32768, \"max_window_layers\": 21, \"model_type\": \"qwen2\","
                    " \"num_attention_heads\": 12, \"num_hidden_layers\": 28, \"num_key_value_heads\": 2,"
                    " \"rms_norm_eps\": 1e-06, \"rope_theta\": 1000000.0, \"sliding_window\": 32768,"
                    " \"tie_word_embeddings\": true, \"torch_dtype\": \"bfloat16\", \"use_cache\": true,"
                    " \"use_sliding_window\": false, \"vocab_size\": 151936}", &c) == 0);
    CHECK(c.model_type == CF_MODEL_QWEN2 && c.qkv_bias == 1 && c.o_bias == 0 && c.qk_norm == 0);
    CHECK(c.sliding_window == 0);   /* qwen2's window is off unless use_sliding_window */
    CHECK(cf_config_builtin(&b, "qwen2.5-1.5b") == 0);
    CHECK(same_config(&c, &b));
}

TEST(config_qwen3_explicit_head_dim_is_read) {
    cf_config c;
    /* Qwen3-0.6B: 16 heads x 128 = 2048 != hidden 1024 */
    CHECK(load_json("{\"architectures\": [\"Qwen3ForCausalLM\"], \"attention_bias\": false,"
                    " \"bos_token_id\": 151643, \"eos_token_id\": 151645, \"head_dim\": 128, \"hidden_act\": \"silu\","
                    " \"hidden_size\": 1024, \"intermediate_size\": 3072, \"max_position_embeddings\": 40960,"
                    " \"max_window_layers\": 28, \"model_type\": \"qwen3\", \"num_attention_heads\": 16,"
                    " \"num_hidden_layers\": 28, \"num_key_value_heads\": 8, \"rms_norm_eps\": 1e-06,"
                    " \"rope_scaling\": null, \"rope_theta\": 1000000, \"sliding_window\": null,"
                    " \"tie_word_embeddings\": true, \"use_cache\": true, \"use_sliding_window\": false,"
                    " \"vocab_size\": 151936}", &c) == 0);
    CHECK(c.model_type == CF_MODEL_QWEN3 && c.head_dim == 128 && c.qk_norm == 1);
    CHECK(c.qkv_bias == 0 && c.o_bias == 0 && c.tie_word_embeddings == 1);
    CHECK(c.num_attention_heads * c.head_dim != c.hidden_size);
    CHECK(c.eos_token_id == 151645 && c.rope_theta == 1e6f);
}

TEST(config_qwen3_missing_head_dim_defaults_to_128_like_transformers) {
    cf_config c;
    CHECK(load_json("{\"model_type\": \"qwen3\", \"vocab_size\": 100, \"hidden_size\": 64, \"intermediate_size\": 96,"
                    " \"num_hidden_layers\": 2, \"num_attention_heads\": 4}", &c) == 0);
    CHECK(c.head_dim == 128);
}

TEST(config_attention_bias_sets_qkv_and_o_bias_for_llama_and_qwen3) {
    cf_config c;
    CHECK(load_json("{\"model_type\": \"llama\", \"vocab_size\": 100, \"hidden_size\": 64, \"intermediate_size\": 96,"
                    " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"attention_bias\": true}", &c) == 0);
    CHECK(c.qkv_bias == 1 && c.o_bias == 1);
    CHECK(load_json("{\"model_type\": \"qwen3\", \"vocab_size\": 100, \"hidden_size\": 64, \"intermediate_size\": 96,"
                    " \"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"head_dim\": 16,"
                    " \"attention_bias\": true}", &c) == 0);
    CHECK(c.qkv_bias == 1 && c.o_bias == 1 && c.qk_norm == 1);
}

TEST(config_eos_list_takes_first_and_null_is_minus_one) {
    cf_config c;
    CHECK(load_json("{\"model_type\": \"llama\", \"vocab_size\": 200000, \"hidden_size\": 64,"
                    " \"intermediate_size\": 96, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
                    " \"bos_token_id\": 128000, \"eos_token_id\": [128001, 128008, 128009]}", &c) == 0);
    CHECK(c.bos_token_id == 128000 && c.eos_token_id == 128001);
    /* the others are kept (generation stops at each) and saved as a list */
    CHECK(c.num_extra_eos == 2 && c.extra_eos_ids[0] == 128008 && c.extra_eos_ids[1] == 128009);
    cf_config back;
    CHECK(cf_config_save(&c, g_path) == 0 && cf_config_load(&back, g_path) == 0 && same_config(&c, &back));
    CHECK(back.num_extra_eos == 2 && back.extra_eos_ids[1] == 128009);
    CHECK(load_json("{\"model_type\": \"llama\", \"vocab_size\": 200000, \"hidden_size\": 64,"
                    " \"intermediate_size\": 96, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
                    " \"bos_token_id\": null, \"eos_token_id\": []}", &c) == 0);
    CHECK(c.bos_token_id == -1 && c.eos_token_id == -1 && c.num_extra_eos == 0);
}

/* ------------------------------------------------------------ bad inputs */

#define SMALL(extra) "{\"model_type\": \"llama\", \"vocab_size\": 100, \"hidden_size\": 64," \
    " \"intermediate_size\": 96, \"num_hidden_layers\": 2, \"num_attention_heads\": 4" extra "}"

TEST(config_rejects_unsupported_model_type_naming_it) {
    CHECK_LOAD_FAILS("{\"model_type\": \"gpt2\", \"vocab_size\": 100}",
                     "unsupported model_type 'gpt2' (supported: llama, mistral, qwen2, qwen3)");
    CHECK_LOAD_FAILS("{\"vocab_size\": 100}", "model_type");
    CHECK_LOAD_FAILS("{\"model_type\": 7}", "model_type", "string");
    /* one line even when the file smuggles a newline into the value */
    CHECK_LOAD_FAILS("{\"model_type\": \"gpt\\n2\"}", "unsupported model_type 'gpt?2'");
    CHECK(strchr(cf_last_error(), '\n') == NULL);
}

TEST(config_rejects_string_where_number_belongs_naming_the_key) {
    CHECK_LOAD_FAILS("{\"model_type\": \"llama\", \"vocab_size\": 100, \"hidden_size\": \"64\","
                     " \"intermediate_size\": 96, \"num_hidden_layers\": 2, \"num_attention_heads\": 4}",
                     "'hidden_size'", "integer", "string");
    CHECK_LOAD_FAILS(SMALL(", \"rms_norm_eps\": \"1e-5\""), "'rms_norm_eps'", "number");
    CHECK_LOAD_FAILS(SMALL(", \"rope_theta\": true"), "'rope_theta'");
    CHECK_LOAD_FAILS(SMALL(", \"tie_word_embeddings\": 1"), "'tie_word_embeddings'", "true or false");
    CHECK_LOAD_FAILS(SMALL(", \"eos_token_id\": [1, \"x\"]"), "'eos_token_id[1]' must be an integer, got a string");
}

TEST(config_rejects_fractional_negative_and_huge_sizes) {
    CHECK_LOAD_FAILS("{\"model_type\": \"llama\", \"vocab_size\": 100.5, \"hidden_size\": 64,"
                     " \"intermediate_size\": 96, \"num_hidden_layers\": 2, \"num_attention_heads\": 4}",
                     "'vocab_size'", "integer");
    CHECK_LOAD_FAILS("{\"model_type\": \"llama\", \"vocab_size\": 100, \"hidden_size\": 64,"
                     " \"intermediate_size\": -96, \"num_hidden_layers\": 2, \"num_attention_heads\": 4}",
                     "intermediate_size");
    CHECK_LOAD_FAILS("{\"model_type\": \"llama\", \"vocab_size\": 100, \"hidden_size\": 64,"
                     " \"intermediate_size\": 96, \"num_hidden_layers\": 0, \"num_attention_heads\": 4}",
                     "num_hidden_layers");
    CHECK_LOAD_FAILS("{\"model_type\": \"llama\", \"vocab_size\": 1e30, \"hidden_size\": 64,"
                     " \"intermediate_size\": 96, \"num_hidden_layers\": 2, \"num_attention_heads\": 4}",
                     "vocab_size");
    CHECK_LOAD_FAILS(SMALL(", \"rms_norm_eps\": 0"), "rms_norm_eps");
    CHECK_LOAD_FAILS(SMALL(", \"rope_theta\": -1"), "rope_theta");
}

TEST(config_rejects_missing_required_size) {
    CHECK_LOAD_FAILS("{\"model_type\": \"llama\", \"vocab_size\": 100, \"hidden_size\": 64,"
                     " \"num_hidden_layers\": 2, \"num_attention_heads\": 4}",
                     "missing required key 'intermediate_size'");
}

TEST(config_rejects_heads_not_divisible_by_kv_heads) {
    CHECK_LOAD_FAILS(SMALL(", \"num_key_value_heads\": 3"), "num_attention_heads 4", "num_key_value_heads 3");
}

TEST(config_rejects_odd_head_dim_and_indivisible_hidden_size) {
    CHECK_LOAD_FAILS(SMALL(", \"head_dim\": 15"), "head_dim 15", "odd");
    CHECK_LOAD_FAILS("{\"model_type\": \"llama\", \"vocab_size\": 100, \"hidden_size\": 66,"
                     " \"intermediate_size\": 96, \"num_hidden_layers\": 2, \"num_attention_heads\": 4}",
                     "hidden_size 66", "num_attention_heads 4");
}

TEST(config_rejects_tensor_over_2_31_elements) {
    /* vocab 2^20 x hidden 4096 = 2^32 elements */
    CHECK_LOAD_FAILS("{\"model_type\": \"llama\", \"vocab_size\": 1048576, \"hidden_size\": 4096,"
                     " \"intermediate_size\": 96, \"num_hidden_layers\": 2, \"num_attention_heads\": 32}",
                     "embed_tokens", "2^31");
}

TEST(config_rejects_mlp_bias_and_other_unsupported_features) {
    CHECK_LOAD_FAILS(SMALL(", \"mlp_bias\": true"), "mlp_bias");
    CHECK_LOAD_FAILS(SMALL(", \"hidden_act\": \"gelu\""), "hidden_act 'gelu'");
    CHECK_LOAD_FAILS(SMALL(", \"quantization_config\": {\"bits\": 4}"), "quantization_config");
    CHECK_LOAD_FAILS(SMALL(", \"partial_rotary_factor\": 0.5"), "partial_rotary_factor");
    CHECK_LOAD_FAILS("{\"model_type\": \"mistral\", \"vocab_size\": 100, \"hidden_size\": 64,"
                     " \"intermediate_size\": 96, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
                     " \"attention_bias\": true}", "attention_bias", "mistral");
    CHECK_LOAD_FAILS("{\"model_type\": \"qwen2\", \"vocab_size\": 100, \"hidden_size\": 64,"
                     " \"intermediate_size\": 96, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
                     " \"use_sliding_window\": true}", "use_sliding_window");
    CHECK_LOAD_FAILS("{\"model_type\": \"qwen3\", \"vocab_size\": 100, \"hidden_size\": 64,"
                     " \"intermediate_size\": 96, \"num_hidden_layers\": 2, \"num_attention_heads\": 4,"
                     " \"layer_types\": [\"full_attention\", \"sliding_attention\"]}", "layer_types");
}

TEST(config_rejects_rope_types_other_than_llama3) {
    CHECK_LOAD_FAILS(SMALL(", \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4.0}"),
                     "rope_type 'yarn' is not supported");
    CHECK_LOAD_FAILS(SMALL(", \"rope_scaling\": {\"type\": \"linear\", \"factor\": 2.0}"), "'linear'");
    CHECK_LOAD_FAILS(SMALL(", \"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 2.0}"), "'dynamic'");
    CHECK_LOAD_FAILS(SMALL(", \"rope_scaling\": \"llama3\""), "rope_scaling");
    /* llama3 without its factors, or with high <= low */
    CHECK_LOAD_FAILS(SMALL(", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0}"),
                     "rope_scaling.low_freq_factor");
    CHECK_LOAD_FAILS(SMALL(", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0,"
                           " \"low_freq_factor\": 4.0, \"high_freq_factor\": 1.0,"
                           " \"original_max_position_embeddings\": 8192}"), "high_freq_factor");
}

TEST(config_rejects_invalid_json_and_non_object_naming_the_file) {
    CHECK_LOAD_FAILS("{\"model_type\": \"llama\", ", "not valid JSON");
    CHECK_LOAD_FAILS("[1, 2]", "JSON object");
    CHECK_LOAD_FAILS(SMALL("") " trailing", "not valid JSON");
    CHECK_LOAD_FAILS("", "not valid JSON");
}

TEST(config_rejects_duplicate_keys) {
    CHECK_LOAD_FAILS(SMALL(", \"vocab_size\": 200"), "duplicate key 'vocab_size'");
}

TEST(config_rejects_missing_file_naming_it) {
    cf_config c;
    char p[600];
    snprintf(p, sizeof p, "%s/does-not-exist.json", g_dir);
    CHECK(cf_config_load(&c, p) == -1);
    CHECK(err_has(p));
}

TEST(config_rejects_token_ids_outside_vocab) {
    CHECK_LOAD_FAILS(SMALL(", \"eos_token_id\": 100"), "eos_token_id");
    CHECK_LOAD_FAILS(SMALL(", \"bos_token_id\": -5"), "bos_token_id");
}

/* A list (Llama 3: [128001, 128008, 128009]) is checked item by item, not
 * only its first item; -1 (no id) is not an item. */
TEST(config_rejects_token_id_lists_with_any_item_outside_vocab) {
    CHECK_LOAD_FAILS(SMALL(", \"eos_token_id\": [1, 2, 100]"),
                     "eos_token_id[2] = 100 is outside the vocabulary (0..99)");
    CHECK_LOAD_FAILS(SMALL(", \"eos_token_id\": [1, -1]"), "eos_token_id[1] = -1 is outside the vocabulary");
    CHECK_LOAD_FAILS(SMALL(", \"eos_token_id\": [-1]"), "eos_token_id[0] = -1 is outside the vocabulary");
    CHECK_LOAD_FAILS(SMALL(", \"bos_token_id\": [1, 200000]"),
                     "bos_token_id[1] = 200000 is outside the vocabulary (0..99)");
    CHECK_LOAD_FAILS(SMALL(", \"eos_token_id\": [1, 2, 3.5]"), "'eos_token_id[2]' must be an integer, got 3.5");
    /* up to CF_MAX_EOS_IDS (16) ids are kept; more are refused, not cut */
    cf_config c;
    CHECK(load_json(SMALL(", \"eos_token_id\": [1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16]"), &c) == 0);
    CHECK(c.eos_token_id == 1 && c.num_extra_eos == 15 && c.extra_eos_ids[14] == 16);
    CHECK_LOAD_FAILS(SMALL(", \"eos_token_id\": [1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]"),
                     "eos_token_id lists 17 ids, more than the 16 supported");
    /* the same rules for a config built in code */
    CHECK(cf_config_builtin(&c, "tiny") == 0);
    c.num_extra_eos = 1;
    c.extra_eos_ids[0] = c.vocab_size;
    CHECK(cf_config_validate(&c) == -1 && err_has("eos_token_id[1]") && err_has("outside the vocabulary"));
    c.extra_eos_ids[0] = 3;
    c.eos_token_id = -1;
    CHECK(cf_config_validate(&c) == -1 && err_has("no eos_token_id"));
}

TEST(config_fuzzed_json_never_crashes) {
    /* Truncations and byte flips of a real config: each load must return
     * 0 or -1 with a message, never crash (ASan/UBSan watch this). */
    size_t n = strlen(LLAMA31_JSON);
    char *buf = malloc(n + 1);
    unsigned seed = 12345;
    int failures_named = 1;
    for (int iter = 0; iter < 400; iter++) {
        memcpy(buf, LLAMA31_JSON, n + 1);
        seed = seed * 1103515245u + 12345u;
        if (iter % 2) buf[(seed >> 8) % n] = (char)(seed >> 20);
        else buf[(seed >> 8) % n] = 0;   /* truncation */
        cf_config c;
        if (load_json(buf, &c) != 0 && (!err_has(g_path) || strchr(cf_last_error(), '\n'))) failures_named = 0;
    }
    free(buf);
    CHECK(failures_named);
}

/* --------------------------------------------------------------- builtins */

static const char *ALL_BUILTINS[] = {"tiny", "cpu-20m", "math-25m", "tinyllama-1.1b", "qwen2.5-1.5b", "llama3.2-3b",
                                     "qwen2.5-7b", "llama3.1-8b", "qwen3-14b", "qwen3-32b", "alia-40b", "tiny-llama", "tiny-mistral", "tiny-qwen2",
                                     "tiny-qwen3"};
#define NUM_ALL ((int)(sizeof ALL_BUILTINS / sizeof ALL_BUILTINS[0]))

TEST(config_every_builtin_validates) {
    for (int i = 0; i < NUM_ALL; i++) {
        cf_config c;
        CHECK_MSG(cf_config_builtin(&c, ALL_BUILTINS[i]) == 0, "%s: %s", ALL_BUILTINS[i], cf_last_error());
        CHECK_MSG(cf_config_validate(&c) == 0, "%s: %s", ALL_BUILTINS[i], cf_last_error());
    }
}

TEST(config_builtin_names_lists_every_builtin_and_only_those) {
    const char *list = cf_config_builtin_names();
    char copy[1024];
    snprintf(copy, sizeof copy, "%s", list);
    int count = 0;
    for (char *tok = strtok(copy, ", "); tok; tok = strtok(NULL, ", ")) {
        cf_config c;
        CHECK_MSG(cf_config_builtin(&c, tok) == 0, "listed name '%s' does not load", tok);
        count++;
    }
    CHECK(count == NUM_ALL);
}

TEST(config_unknown_builtin_fails_listing_the_names) {
    cf_config c;
    CHECK(cf_config_builtin(&c, "llama-7b") == -1);
    CHECK(err_has("llama-7b") && err_has("tinyllama-1.1b"));
}

TEST(config_builtins_have_the_published_hf_values) {
    cf_config c;
    CHECK(cf_config_builtin(&c, "qwen2.5-7b") == 0);
    CHECK(c.model_type == CF_MODEL_QWEN2 && c.vocab_size == 152064 && c.hidden_size == 3584 &&
          c.intermediate_size == 18944 && c.num_hidden_layers == 28 && c.num_attention_heads == 28 &&
          c.num_key_value_heads == 4 && c.head_dim == 128 && c.tie_word_embeddings == 0 && c.qkv_bias == 1 &&
          c.rope_theta == 1e6f && c.rms_norm_eps == 1e-6f && c.max_position_embeddings == 32768);
    CHECK(cf_config_builtin(&c, "llama3.2-3b") == 0);
    CHECK(c.vocab_size == 128256 && c.hidden_size == 3072 && c.intermediate_size == 8192 &&
          c.num_hidden_layers == 28 && c.num_attention_heads == 24 && c.num_key_value_heads == 8 &&
          c.head_dim == 128 && c.tie_word_embeddings == 1 && c.rope_llama3 == 1 && c.rope_factor == 32.0f &&
          c.rope_original_max_pos == 8192 && c.rope_theta == 500000.0f && c.max_position_embeddings == 131072);
    CHECK(cf_config_builtin(&c, "tiny") == 0);
    CHECK(c.vocab_size == 320 && c.hidden_size == 128 && c.intermediate_size == 384 && c.num_hidden_layers == 4 &&
          c.num_attention_heads == 4 && c.num_key_value_heads == 2 && c.head_dim == 32 &&
          c.tie_word_embeddings == 1 && c.bos_token_id == 256 && c.eos_token_id == 257);
    CHECK(cf_config_builtin(&c, "tiny-llama") == 0);
    CHECK(c.rope_llama3 == 1 && c.rope_factor == 8.0f && c.rope_original_max_pos == 16 && c.head_dim == 8);
    CHECK(cf_config_builtin(&c, "tiny-qwen3") == 0);
    CHECK(c.qk_norm == 1 && c.head_dim == 16 && c.num_attention_heads * c.head_dim != c.hidden_size);
    CHECK(cf_config_builtin(&c, "tiny-qwen2") == 0);
    CHECK(c.qkv_bias == 1 && c.o_bias == 0 && c.tie_word_embeddings == 1);
}

TEST(config_num_params_of_tinyllama_is_1100048384) {
    cf_config c;
    CHECK(cf_config_builtin(&c, "tinyllama-1.1b") == 0);
    CHECK(cf_config_num_params(&c) == 1100048384u);
}

TEST(config_num_params_counts_biases_qk_norms_and_untied_head) {
    cf_config c;
    /* V=64 C=32 F=48 L=2 H=4 Hkv=2 D=8, tied, qkv bias */
    CHECK(cf_config_builtin(&c, "tiny-qwen2") == 0);
    size_t layer = 2 * 32 + 32 * 32 + 2 * 32 * 16 + 32 * 32 + (32 + 2 * 16) + 3 * 32 * 48;
    CHECK(cf_config_num_params(&c) == 64 * 32 + 2 * layer + 32);
    /* D=16: q is 32 -> 64, k/v 32 -> 32, o 64 -> 32, q/k norms of 16, untied */
    CHECK(cf_config_builtin(&c, "tiny-qwen3") == 0);
    layer = 2 * 32 + 32 * 64 + 2 * 32 * 32 + 64 * 32 + 2 * 16 + 3 * 32 * 48;
    CHECK(cf_config_num_params(&c) == 2 * 64 * 32 + 2 * layer + 32);
    /* attention_bias on llama adds the o_proj bias too */
    CHECK(cf_config_builtin(&c, "tiny-llama") == 0);
    size_t before = cf_config_num_params(&c);
    c.qkv_bias = c.o_bias = 1;
    CHECK(cf_config_num_params(&c) == before + 2 * (32 + 2 * 16 + 32));
    /* cpu-20m is about 22M */
    CHECK(cf_config_builtin(&c, "cpu-20m") == 0);
    CHECK(cf_config_num_params(&c) > 21000000 && cf_config_num_params(&c) < 23000000);
}

TEST(config_validate_rejects_inconsistent_layouts) {
    cf_config c;
    CHECK(cf_config_builtin(&c, "tiny-qwen2") == 0);
    c.qkv_bias = 0;
    CHECK(cf_config_validate(&c) == -1 && err_has("qwen2"));
    CHECK(cf_config_builtin(&c, "tiny-llama") == 0);
    c.qkv_bias = 1;   /* llama attention_bias is all-or-nothing */
    CHECK(cf_config_validate(&c) == -1);
    CHECK(cf_config_builtin(&c, "tiny-llama") == 0);
    c.sliding_window = 16;
    CHECK(cf_config_validate(&c) == -1 && err_has("sliding_window"));
    CHECK(cf_config_builtin(&c, "tiny-qwen3") == 0);
    c.qk_norm = 0;
    CHECK(cf_config_validate(&c) == -1);
    CHECK(cf_config_builtin(&c, "tiny") == 0);
    c.num_key_value_heads = 3;
    CHECK(cf_config_validate(&c) == -1);
}

/* ----------------------------------------------------------------- saving */

TEST(config_save_then_load_is_identical_for_every_builtin) {
    for (int i = 0; i < NUM_ALL; i++) {
        cf_config a, b;
        CHECK(cf_config_builtin(&a, ALL_BUILTINS[i]) == 0);
        CHECK_MSG(cf_config_save(&a, g_path) == 0, "%s: %s", ALL_BUILTINS[i], cf_last_error());
        CHECK_MSG(cf_config_load(&b, g_path) == 0, "%s: %s", ALL_BUILTINS[i], cf_last_error());
        CHECK_MSG(same_config(&a, &b), "%s: round trip differs", ALL_BUILTINS[i]);
    }
    /* mistral with a sliding window, llama with attention_bias */
    cf_config a, b;
    CHECK(cf_config_builtin(&a, "tiny-mistral") == 0);
    a.sliding_window = 64;
    CHECK(cf_config_save(&a, g_path) == 0 && cf_config_load(&b, g_path) == 0 && same_config(&a, &b));
    CHECK(cf_config_builtin(&a, "tiny-llama") == 0);
    a.qkv_bias = a.o_bias = 1;
    a.rms_norm_eps = 3.3e-7f;
    a.rope_theta = 12345.678f;
    CHECK(cf_config_save(&a, g_path) == 0 && cf_config_load(&b, g_path) == 0 && same_config(&a, &b));
}

/* The fields transformers needs to build the right model class. */
TEST(config_save_writes_the_fields_transformers_reads) {
    cf_config a;
    CHECK(cf_config_builtin(&a, "llama3.2-3b") == 0);
    CHECK(cf_config_save(&a, g_path) == 0);
    size_t len;
    char *txt = cf_read_file(g_path, &len, 1 << 20);
    CHECK(txt != NULL);
    cJSON *j = txt ? cJSON_Parse(txt) : NULL;
    CHECK(j != NULL);
    if (j) {
        cJSON *arch = cJSON_GetObjectItemCaseSensitive(j, "architectures");
        CHECK(cJSON_IsArray(arch) && strcmp(cJSON_GetArrayItem(arch, 0)->valuestring, "LlamaForCausalLM") == 0);
        CHECK(strcmp(cJSON_GetObjectItemCaseSensitive(j, "model_type")->valuestring, "llama") == 0);
        CHECK(strcmp(cJSON_GetObjectItemCaseSensitive(j, "hidden_act")->valuestring, "silu") == 0);
        CHECK(strcmp(cJSON_GetObjectItemCaseSensitive(j, "torch_dtype")->valuestring, "float32") == 0);
        CHECK(strcmp(cJSON_GetObjectItemCaseSensitive(j, "dtype")->valuestring, "float32") == 0);
        CHECK(cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(j, "tie_word_embeddings")));
        CHECK(cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(j, "attention_bias")));
        CHECK(cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(j, "use_cache")));
        CHECK(cJSON_GetObjectItemCaseSensitive(j, "head_dim")->valueint == 128);
        cJSON *rs = cJSON_GetObjectItemCaseSensitive(j, "rope_scaling");
        CHECK(cJSON_IsObject(rs) && strcmp(cJSON_GetObjectItemCaseSensitive(rs, "rope_type")->valuestring, "llama3") == 0);
        cJSON *rp = cJSON_GetObjectItemCaseSensitive(j, "rope_parameters");
        CHECK(cJSON_IsObject(rp) && cJSON_GetObjectItemCaseSensitive(rp, "rope_theta")->valuedouble == 500000.0);
        cJSON_Delete(j);
    }
    /* floats are written as floats, e.g. 500000.0 and 1e-05, not 9.99999975e-06 */
    CHECK(txt && strstr(txt, "\"rope_theta\": 500000.0"));
    CHECK(txt && strstr(txt, "\"rms_norm_eps\": 1e-05"));
    free(txt);

    const char *arch_of[] = {"tiny-mistral", "MistralForCausalLM", "tiny-qwen2", "Qwen2ForCausalLM",
                             "tiny-qwen3", "Qwen3ForCausalLM"};
    for (int i = 0; i < 6; i += 2) {
        CHECK(cf_config_builtin(&a, arch_of[i]) == 0 && cf_config_save(&a, g_path) == 0);
        txt = cf_read_file(g_path, &len, 1 << 20);
        CHECK_MSG(txt && strstr(txt, arch_of[i + 1]), "%s lacks %s", arch_of[i], arch_of[i + 1]);
        free(txt);
    }
}

TEST(config_save_refuses_invalid_config_and_writes_nothing) {
    cf_config a;
    CHECK(cf_config_builtin(&a, "tiny") == 0);
    a.num_key_value_heads = 3;
    char p[600];
    snprintf(p, sizeof p, "%s/invalid.json", g_dir);
    CHECK(cf_config_save(&a, p) == -1);
    CHECK(err_has(p));
    CHECK(!cf_path_exists(p));
    CHECK(count_temp_files(g_dir) == 0);
}

TEST(config_save_is_atomic_and_leaves_no_temp_files) {
    cf_config a, b;
    CHECK(cf_config_builtin(&a, "tiny") == 0);
    for (int i = 0; i < 3; i++) CHECK(cf_config_save(&a, g_path) == 0);
    CHECK(count_temp_files(g_dir) == 0);
    CHECK(cf_config_load(&b, g_path) == 0 && same_config(&a, &b));
    /* a directory that does not exist: fails, names the path */
    char p[600];
    snprintf(p, sizeof p, "%s/no/such/dir/config.json", g_dir);
    CHECK(cf_config_save(&a, p) == -1 && err_has(p));
}

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb; (void)flag; (void)ftw;
    return remove(p);
}

/* cf_model_opts.layers: the config a model would open with keeps the
 * first N layers of a --config and nothing else changes; a model directory,
 * a count beyond the config and a negative count are refused. */
TEST(model_opts_layers_cut_a_config_and_are_refused_elsewhere) {
    cf_config full, cut;
    CHECK(cf_config_builtin(&full, "qwen3-32b") == 0);
    cf_model_opts o = {0};
    o.config = "qwen3-32b";
    o.layers = 4;
    CHECK(cf_model_opts_config(&o, &cut) == 0);
    CHECK(cut.num_hidden_layers == 4);
    cut.num_hidden_layers = full.num_hidden_layers;
    CHECK(memcmp(&cut, &full, sizeof cut) == 0);
    o.layers = full.num_hidden_layers + 1;
    CHECK(cf_model_opts_config(&o, &cut) != 0 && strstr(cf_last_error(), "layers") != NULL);
    o.layers = -1;
    CHECK(cf_model_opts_config(&o, &cut) != 0);
    o.layers = 2;
    o.config = NULL;
    o.model_dir = "/nonexistent";
    CHECK(cf_model_opts_config(&o, &cut) != 0 && strstr(cf_last_error(), "own config.json") != NULL);
    o.model_dir = NULL;   /* neither: the built-in tiny, cut */
    CHECK(cf_model_opts_config(&o, &cut) == 0 && cut.num_hidden_layers == 2);
}

/* generation_config.json (transformers' generate reads its eos ids there
 * first): absent, no eos or null give none; an id or a list gives them all;
 * a bad file, an id outside the vocabulary or too many ids are refused
 * naming the file. */
TEST(generation_config_eos_ids_are_read_and_checked) {
    char gpath[600];
    snprintf(gpath, sizeof gpath, "%s/generation_config.json", g_dir);
    int ids[4], n = -1;
    remove(gpath);
    CHECK(cf_generation_config_eos(g_dir, 100, ids, 4, &n) == 0 && n == 0);
    static const struct { const char *json; int n, id0, id1; } ok[] = {
        {"{\"bos_token_id\": 1}", 0, 0, 0},
        {"{\"eos_token_id\": null}", 0, 0, 0},
        {"{\"eos_token_id\": 7}", 1, 7, 0},
        {"{\"eos_token_id\": [7, 99], \"do_sample\": true}", 2, 7, 99},
        {"{\"eos_token_id\": [0, 1, 2, 3]}", 4, 0, 1},
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        write_text(gpath, ok[i].json);
        n = -1;
        const int rc = cf_generation_config_eos(g_dir, 100, ids, 4, &n);
        CHECK_MSG(rc == 0 && n == ok[i].n && (n < 1 || ids[0] == ok[i].id0) && (n < 2 || ids[1] == ok[i].id1),
                  "%s: rc %d, %d ids (%d, %d)", ok[i].json, rc, n, n > 0 ? ids[0] : -1, n > 1 ? ids[1] : -1);
    }
    static const struct { const char *json, *err; } bad[] = {
        {"{\"eos_token_id\": [7, ", "not valid JSON"},
        {"[7]", "JSON object"},
        {"{\"eos_token_id\": 100}", "eos_token_id = 100 is outside the vocabulary (0..99)"},
        {"{\"eos_token_id\": -3}", "eos_token_id = -3 is outside"},
        {"{\"eos_token_id\": [7, 100]}", "eos_token_id[1] = 100 is outside the vocabulary"},
        {"{\"eos_token_id\": [7, \"x\"]}", "eos_token_id[1]"},
        {"{\"eos_token_id\": [0, 1, 2, 3, 4]}", "more than the 4 ids supported"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_text(gpath, bad[i].json);
        n = -1;
        const int rc = cf_generation_config_eos(g_dir, 100, ids, 4, &n);
        CHECK_MSG(rc == -1 && n == 0 && err_has(bad[i].err) && err_has("generation_config.json"),
                  "%s: rc %d, %d ids, error '%s'", bad[i].json, rc, n, cf_last_error());
    }
    remove(gpath);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/cf_test_config_XXXXXX");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }
    snprintf(g_path, sizeof g_path, "%s/config.json", g_dir);

    RUN(config_tinyllama_json_matches_builtin_tinyllama);
    RUN(config_llama3_rope_scaling_is_read);
    RUN(config_transformers5_rope_parameters_are_read);
    RUN(config_legacy_rope_scaling_type_key_is_accepted);
    RUN(config_defaults_kv_heads_head_dim_theta_eps_and_untied);
    RUN(config_mistral_sliding_window_null_is_zero_and_int_is_read);
    RUN(config_qwen2_has_qkv_bias_but_no_o_bias);
    RUN(config_qwen3_explicit_head_dim_is_read);
    RUN(config_qwen3_missing_head_dim_defaults_to_128_like_transformers);
    RUN(config_attention_bias_sets_qkv_and_o_bias_for_llama_and_qwen3);
    RUN(config_eos_list_takes_first_and_null_is_minus_one);
    RUN(config_rejects_unsupported_model_type_naming_it);
    RUN(config_rejects_string_where_number_belongs_naming_the_key);
    RUN(config_rejects_fractional_negative_and_huge_sizes);
    RUN(config_rejects_missing_required_size);
    RUN(config_rejects_heads_not_divisible_by_kv_heads);
    RUN(config_rejects_odd_head_dim_and_indivisible_hidden_size);
    RUN(config_rejects_tensor_over_2_31_elements);
    RUN(config_rejects_mlp_bias_and_other_unsupported_features);
    RUN(config_rejects_rope_types_other_than_llama3);
    RUN(config_rejects_invalid_json_and_non_object_naming_the_file);
    RUN(config_rejects_duplicate_keys);
    RUN(config_rejects_missing_file_naming_it);
    RUN(config_rejects_token_ids_outside_vocab);
    RUN(config_rejects_token_id_lists_with_any_item_outside_vocab);
    RUN(config_fuzzed_json_never_crashes);
    RUN(config_every_builtin_validates);
    RUN(config_builtin_names_lists_every_builtin_and_only_those);
    RUN(config_unknown_builtin_fails_listing_the_names);
    RUN(config_builtins_have_the_published_hf_values);
    RUN(config_num_params_of_tinyllama_is_1100048384);
    RUN(config_num_params_counts_biases_qk_norms_and_untied_head);
    RUN(config_validate_rejects_inconsistent_layouts);
    RUN(config_save_then_load_is_identical_for_every_builtin);
    RUN(config_save_writes_the_fields_transformers_reads);
    RUN(config_save_refuses_invalid_config_and_writes_nothing);
    RUN(config_save_is_atomic_and_leaves_no_temp_files);
    RUN(model_opts_layers_cut_a_config_and_are_refused_elsewhere);
    RUN(generation_config_eos_ids_are_read_and_checked);

    nftw(g_dir, rm_entry, 8, FTW_DEPTH | FTW_PHYS);
    return test_summary();
}
