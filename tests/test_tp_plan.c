/* test_tp_plan.c — the tensor-parallel partition plan (src/dist/tp_plan.c):
 * which rows and columns of which tensor each rank owns, for every built-in
 * config and model_type and GQA ratio, the local model shapes, vocabulary
 * padding, the communication volume and the memory plan. */
#include "test.h"
#include "base/common.h"
#include "dist/tp_plan.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static int err_has(const char *s) { return strstr(cf_last_error(), s) != NULL; }
static int err_one_line(void) { return strchr(cf_last_error(), '\n') == NULL && cf_last_error()[0] != 0; }

static const int TPS[] = {1, 2, 4, 8};
#define NUM_TPS 4

/* Every built-in name, from cf_config_builtin_names(). */
static int builtin_names(char names[][32], int cap) {
    char copy[1024];
    snprintf(copy, sizeof copy, "%s", cf_config_builtin_names());
    int n = 0;
    for (char *save = NULL, *t = strtok_r(copy, ", ", &save); t && n < cap; t = strtok_r(NULL, ", ", &save))
        snprintf(names[n++], 32, "%s", t);
    return n;
}

/* A small config of the given type whose shape is chosen by the test. */
static cf_config small(cf_model_type type, int V, int C, int F, int H, int Hkv, int D) {
    cf_config c;
    CHECK(cf_config_builtin(&c, type == CF_MODEL_QWEN3 ? "tiny-qwen3" : type == CF_MODEL_QWEN2 ? "tiny-qwen2"
                                : type == CF_MODEL_MISTRAL ? "tiny-mistral" : "tiny-llama") == 0);
    c.vocab_size = V;
    c.hidden_size = C;
    c.intermediate_size = F;
    c.num_attention_heads = H;
    c.num_key_value_heads = Hkv;
    c.head_dim = D;
    c.bos_token_id = c.eos_token_id = -1;
    CHECK_MSG(cf_config_validate(&c) == 0, "%s", cf_last_error());
    return c;
}

static int divides_all(const cf_config *c, int tp) {
    return c->num_attention_heads % tp == 0 && c->num_key_value_heads % tp == 0 && c->intermediate_size % tp == 0;
}

/* The plan of one tensor over all ranks tiles it: a split tensor's ranges
 * in its split dimension follow each other from 0 to the full size with no
 * gap or overlap (vocab: real rows, then padding to equal local sizes); a
 * replicated tensor is whole on every rank. Returns the sum of the ranks'
 * local sizes, or -1 after a failed check. */
static int64_t check_tiling(const cf_config *c, int tp, const char *name) {
    int64_t next = 0, local_sum = 0, pad_sum = 0;
    cf_tp_slice s0;
    memset(&s0, 0, sizeof s0);
    for (int r = 0; r < tp; r++) {
        cf_tp_slice s;
        if (cf_tp_split(c, tp, name, r, &s) != 0) {
            CHECK_MSG(0, "%s tp %d rank %d: %s", name, tp, r, cf_last_error());
            return -1;
        }
        if (r == 0) s0 = s;
        int ok = s.kind == s0.kind && s.ndim == s0.ndim && s.shape[0] == s0.shape[0] && s.shape[1] == s0.shape[1] &&
                 s.local_shape[0] == s0.local_shape[0] && s.local_shape[1] == s0.local_shape[1];
        CHECK_MSG(ok, "%s tp %d: rank %d's kind or shapes differ from rank 0's", name, tp, r);
        CHECK(s.local_numel == s.local_shape[0] * (s.ndim == 2 ? s.local_shape[1] : 1));
        if (s.kind == CF_TP_REPLICATED) {
            CHECK_MSG(s.dim == -1 && s.start == 0 && s.len == s.shape[0] && s.pad == 0 &&
                      s.local_shape[0] == s.shape[0] && s.local_shape[1] == s.shape[1],
                      "%s tp %d rank %d: replicated but not whole", name, tp, r);
        } else {
            int d = s.dim, o = 1 - d;
            CHECK_MSG(d == (s.kind == CF_TP_ROW ? 1 : 0), "%s: %s split along dimension %d", name,
                      cf_tp_kind_name(s.kind), d);
            CHECK_MSG(s.start == next, "%s tp %d rank %d: starts at %lld, expected %lld", name, tp, r,
                      (long long)s.start, (long long)next);
            CHECK_MSG(s.local_shape[d] == s.len + s.pad, "%s tp %d rank %d: local %lld != len %lld + pad %lld", name,
                      tp, r, (long long)s.local_shape[d], (long long)s.len, (long long)s.pad);
            if (s.ndim == 2) CHECK(s.local_shape[o] == s.shape[o]);
            if (s.kind != CF_TP_VOCAB) CHECK(s.pad == 0);
            next += s.len;
            pad_sum += s.pad;
        }
        local_sum += s.local_numel;
    }
    if (s0.kind != CF_TP_REPLICATED) {
        CHECK_MSG(next == s0.shape[s0.dim], "%s tp %d: the ranks cover %lld of %lld", name, tp, (long long)next,
                  (long long)s0.shape[s0.dim]);
        if (s0.kind == CF_TP_VOCAB) CHECK(s0.shape[0] + pad_sum == cf_tp_vocab_padded(c, tp));
    }
    return local_sum;
}

/* ======================================================== every config */

TEST(tp_every_builtin_tensor_is_tiled_exactly_once_by_split_ranks_or_whole_on_every_rank) {
    char names[64][32];
    int n = builtin_names(names, 64), planned = 0;
    CHECK(n >= 15);
    for (int i = 0; i < n; i++) {
        cf_config c;
        CHECK(cf_config_builtin(&c, names[i]) == 0);
        for (int k = 0; k < NUM_TPS; k++) {
            int tp = TPS[k];
            if (!divides_all(&c, tp)) {
                CHECK_MSG(cf_tp_check(&c, tp) == -1 && err_one_line(), "%s tp %d should be refused", names[i], tp);
                continue;
            }
            CHECK_MSG(cf_tp_check(&c, tp) == 0, "%s tp %d: %s", names[i], tp, cf_last_error());
            planned++;
            /* sum over ranks of local sizes = split sizes + vocab padding + tp x replicated sizes */
            int64_t full = 0, expect_local = 0, got_local = 0;
            int nt = cf_tp_num_tensors(&c);
            for (int t = 0; t < nt; t++) {
                char name[128];
                CHECK(cf_tp_tensor_name(&c, t, name, sizeof name) == 0);
                cf_tp_slice s;
                CHECK(cf_tp_split(&c, tp, name, 0, &s) == 0);
                int64_t numel = s.shape[0] * (s.ndim == 2 ? s.shape[1] : 1);
                full += numel;
                if (s.kind == CF_TP_REPLICATED) expect_local += (int64_t)tp * numel;
                else if (s.kind == CF_TP_VOCAB) expect_local += cf_tp_vocab_padded(&c, tp) * s.shape[1];
                else expect_local += numel;
                got_local += check_tiling(&c, tp, name);
            }
            CHECK_MSG(full == (int64_t)cf_config_num_params(&c), "%s: the plan lists %lld parameters, the config %zu",
                      names[i], (long long)full, cf_config_num_params(&c));
            CHECK_MSG(got_local == expect_local, "%s tp %d: local sizes sum to %lld, expected %lld", names[i], tp,
                      (long long)got_local, (long long)expect_local);
            cf_tp_local l;
            CHECK(cf_tp_local_config(&c, tp, tp - 1, &l) == 0);
            CHECK_MSG(l.params * tp == got_local, "%s tp %d: local params %lld x tp != %lld", names[i], tp,
                      (long long)l.params, (long long)got_local);
        }
    }
    CHECK(planned >= 40);
}

/* The plan's list of tensors is model.c's parameter table: same names in
 * the same order with the same sizes, for every model_type, tied and
 * untied, with q/k/v biases (qwen2), q/k norms (qwen3), and llama's
 * attention_bias (o bias too). */
TEST(tp_tensor_list_is_the_model_parameter_table_for_every_model_type) {
    const char *builtins[] = {"tiny", "tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"};
    for (int i = 0; i < 6; i++) {
        cf_config c;
        if (i < 5) CHECK(cf_config_builtin(&c, builtins[i]) == 0);
        else { CHECK(cf_config_builtin(&c, "tiny-llama") == 0); c.qkv_bias = c.o_bias = 1; }
        cf_model *m = cf_model_create(&c, CF_BACKEND_CPU, 1);
        CHECK_MSG(m != NULL, "%s", cf_last_error());
        if (!m) continue;
        int n = cf_tp_num_tensors(&c);
        CHECK_MSG(n == cf_model_num_tensors(m), "config %d: %d tensors vs the model's %d", i, n, cf_model_num_tensors(m));
        for (int t = 0; t < n && t < cf_model_num_tensors(m); t++) {
            char name[128];
            CHECK(cf_tp_tensor_name(&c, t, name, sizeof name) == 0);
            CHECK_MSG(!strcmp(name, cf_model_tensor_name(m, t)), "tensor %d: %s vs %s", t, name,
                      cf_model_tensor_name(m, t));
            cf_tp_slice s;
            CHECK(cf_tp_split(&c, 1, name, 0, &s) == 0);
            CHECK((size_t)s.local_numel == cf_model_tensor_numel(m, t));
        }
        cf_model_free(m);
    }
}

/* Element by element on small models of every type at every valid tp:
 * extracting each rank's part of a tensor whose elements are their own
 * indices gives the expected rows/columns, inserting all ranks' parts back
 * rebuilds the tensor, and every element is written by exactly one rank
 * (split) or by all (replicated). */
static void check_elements(const cf_config *c, int tp) {
    int nt = cf_tp_num_tensors(c);
    for (int t = 0; t < nt; t++) {
        char name[128];
        cf_tp_slice s;
        CHECK(cf_tp_tensor_name(c, t, name, sizeof name) == 0);
        CHECK(cf_tp_split(c, tp, name, 0, &s) == 0);
        int64_t rows = s.shape[0], cols = s.ndim == 2 ? s.shape[1] : 1, numel = rows * cols;
        float *full = malloc((size_t)numel * sizeof(float)), *rebuilt = malloc((size_t)numel * sizeof(float));
        float *ones_in = malloc((size_t)numel * sizeof(float)), *count = calloc((size_t)numel, sizeof(float));
        float *local = malloc((size_t)(numel + 64 * cols) * sizeof(float));
        float *ones = malloc((size_t)(numel + 64 * cols) * sizeof(float));
        for (int64_t e = 0; e < numel; e++) { full[e] = (float)e; rebuilt[e] = -1; }
        int bad = 0;
        for (int r = 0; r < tp; r++) {
            CHECK(cf_tp_split(c, tp, name, r, &s) == 0);
            int64_t lr = s.local_shape[0], lc = s.ndim == 2 ? s.local_shape[1] : 1;
            for (int64_t e = 0; e < lr * lc; e++) { local[e] = NAN; ones[e] = 1; }
            cf_tp_extract(&s, full, local, sizeof(float));
            for (int64_t i = 0; i < lr; i++)
                for (int64_t j = 0; j < lc; j++) {
                    float want;
                    if (s.kind == CF_TP_ROW) want = (float)(i * cols + s.start + j);
                    else if (s.kind == CF_TP_REPLICATED) want = (float)(i * cols + j);
                    else want = i < s.len ? (float)((s.start + i) * cols + j) : 0.0f;   /* vocab padding: 0 */
                    bad += local[i * lc + j] != want;
                }
            cf_tp_insert(&s, local, rebuilt, sizeof(float));
            memset(ones_in, 0, (size_t)numel * sizeof(float));
            cf_tp_insert(&s, ones, ones_in, sizeof(float));
            for (int64_t e = 0; e < numel; e++) count[e] += ones_in[e];
        }
        float want_count = s.kind == CF_TP_REPLICATED ? (float)tp : 1.0f;
        for (int64_t e = 0; e < numel; e++) bad += rebuilt[e] != full[e] || count[e] != want_count;
        CHECK_MSG(bad == 0, "%s tp %d (%s): %d wrong elements", name, tp, cf_tp_kind_name(s.kind), bad);
        free(full); free(rebuilt); free(ones_in); free(count); free(local); free(ones);
    }
}

TEST(tp_extract_and_insert_give_each_element_to_exactly_one_rank_on_small_models_of_every_type) {
    cf_config cs[] = {
        small(CF_MODEL_LLAMA, 61, 16, 24, 8, 4, 4),     /* GQA 2, vocab 61 padded */
        small(CF_MODEL_MISTRAL, 64, 16, 32, 8, 8, 2),   /* MHA, tp 8 valid */
        small(CF_MODEL_QWEN2, 37, 16, 24, 8, 4, 4),     /* q/k/v biases, tied */
        small(CF_MODEL_QWEN3, 50, 12, 16, 8, 4, 6),     /* q/k norms, H*D != C */
        small(CF_MODEL_QWEN3, 5, 8, 8, 8, 8, 2),        /* vocab smaller than tp 8 */
    };
    cs[0].qkv_bias = cs[0].o_bias = 1;   /* llama attention_bias */
    int runs = 0;
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++)
        for (int k = 0; k < NUM_TPS; k++)
            if (divides_all(&cs[i], TPS[k])) { check_elements(&cs[i], TPS[k]); runs++; }
    char names[64][32];
    int n = builtin_names(names, 64);
    for (int i = 0; i < n; i++) {
        if (strcmp(names[i], "tiny") != 0 && strncmp(names[i], "tiny-", 5) != 0) continue;   /* small enough */
        cf_config c;
        CHECK(cf_config_builtin(&c, names[i]) == 0);
        for (int k = 0; k < NUM_TPS; k++)
            if (divides_all(&c, TPS[k])) { check_elements(&c, TPS[k]); runs++; }
    }
    CHECK(runs >= 18);
}

/* ================================================================= GQA */

TEST(tp_gqa_32_heads_8_kv_heads_gives_each_rank_whole_kv_groups_at_tp_2_4_8) {
    cf_config c;
    CHECK(cf_config_builtin(&c, "llama3.1-8b") == 0);
    for (int tp = 2; tp <= 8; tp *= 2) {
        for (int r = 0; r < tp; r++) {
            cf_tp_slice q, k, v, o;
            CHECK(cf_tp_split(&c, tp, "model.layers.3.self_attn.q_proj.weight", r, &q) == 0);
            CHECK(cf_tp_split(&c, tp, "model.layers.3.self_attn.k_proj.weight", r, &k) == 0);
            CHECK(cf_tp_split(&c, tp, "model.layers.3.self_attn.v_proj.weight", r, &v) == 0);
            CHECK(cf_tp_split(&c, tp, "model.layers.3.self_attn.o_proj.weight", r, &o) == 0);
            CHECK(q.kind == CF_TP_COLUMN && k.kind == CF_TP_COLUMN && v.kind == CF_TP_COLUMN && o.kind == CF_TP_ROW);
            CHECK(q.heads == 32 / tp && q.head_start == r * 32 / tp);
            CHECK(q.start == (int64_t)q.head_start * 128 && q.len == (int64_t)q.heads * 128);
            CHECK(k.heads == 8 / tp && k.head_start == r * 8 / tp && k.start == (int64_t)k.head_start * 128);
            CHECK(v.start == k.start && v.len == k.len);
            CHECK(o.start == q.start && o.len == q.len && o.local_shape[0] == 4096 && o.local_shape[1] == q.len);
            /* every query head of the rank uses a KV head of the same rank (group = H/Hkv = 4) */
            for (int h = q.head_start; h < q.head_start + q.heads; h++)
                CHECK(h / 4 >= k.head_start && h / 4 < k.head_start + k.heads);
            cf_tp_local l;
            CHECK(cf_tp_local_config(&c, tp, r, &l) == 0);
            CHECK(l.heads == q.heads && l.kv_heads == k.heads && l.q_dim == q.len && l.kv_dim == k.len);
            CHECK(l.heads / l.kv_heads == 4);   /* the GQA ratio is kept on every rank */
        }
    }
}

TEST(tp_8_with_4_kv_heads_fails_with_one_line_naming_the_kv_heads_and_the_tp_that_work) {
    cf_config c;
    CHECK(cf_config_builtin(&c, "tinyllama-1.1b") == 0);   /* H = 32, Hkv = 4 */
    CHECK(c.num_attention_heads == 32 && c.num_key_value_heads == 4);
    CHECK(cf_tp_check(&c, 8) == -1);
    CHECK(err_one_line());
    CHECK_MSG(err_has("--tp 8") && err_has("num_key_value_heads 4") && err_has("GQA") &&
              err_has("tp values that work: 1, 2, 4") && !err_has("num_attention_heads"), "%s", cf_last_error());
    cf_tp_slice s;
    CHECK(cf_tp_split(&c, 8, "model.embed_tokens.weight", 0, &s) == -1 && err_has("num_key_value_heads 4"));
    cf_tp_local l;
    CHECK(cf_tp_local_config(&c, 8, 0, &l) == -1);
    int64_t f, b;
    CHECK(cf_tp_comm_bytes(&c, 8, 16, 8, 2, &f, &b) == -1);
    CHECK(cf_tp_check(&c, 4) == 0);
}

TEST(tp_that_divides_neither_heads_nor_ffn_names_every_number_in_one_line) {
    cf_config c;
    CHECK(cf_config_builtin(&c, "qwen2.5-7b") == 0);   /* H 28, Hkv 4, F 18944 */
    CHECK(cf_tp_check(&c, 8) == -1 && err_one_line());
    CHECK_MSG(err_has("num_attention_heads 28") && err_has("num_key_value_heads 4") && !err_has("intermediate_size") &&
              err_has("1, 2, 4"), "%s", cf_last_error());
    CHECK(cf_config_builtin(&c, "llama3.1-8b") == 0);
    CHECK(cf_tp_check(&c, 3) == -1 && err_has("num_attention_heads 32") && err_has("num_key_value_heads 8") &&
          err_has("intermediate_size 14336") && err_has("1, 2, 4, 8"));
    CHECK(cf_tp_check(&c, 0) == -1 && err_has("--tp 0"));
    CHECK(cf_tp_check(&c, -2) == -1 && err_one_line());
    CHECK(cf_tp_check(&c, 16) == -1 && err_has("num_key_value_heads 8"));
}

TEST(tp_1_is_the_identity_whole_tensors_no_padding_and_no_communication) {
    char names[64][32];
    int n = builtin_names(names, 64);
    for (int i = 0; i < n; i++) {
        cf_config c;
        CHECK(cf_config_builtin(&c, names[i]) == 0);
        CHECK(cf_tp_check(&c, 1) == 0);
        int nt = cf_tp_num_tensors(&c);
        for (int t = 0; t < nt; t++) {
            char name[128];
            cf_tp_slice s;
            CHECK(cf_tp_tensor_name(&c, t, name, sizeof name) == 0);
            CHECK(cf_tp_split(&c, 1, name, 0, &s) == 0);
            CHECK_MSG(s.start == 0 && s.pad == 0 && s.local_shape[0] == s.shape[0] && s.local_shape[1] == s.shape[1],
                      "%s %s", names[i], name);
        }
        cf_tp_local l;
        CHECK(cf_tp_local_config(&c, 1, 0, &l) == 0);
        CHECK(l.heads == c.num_attention_heads && l.kv_heads == c.num_key_value_heads &&
              l.intermediate == c.intermediate_size && l.vocab_padded == c.vocab_size && l.vocab_len == c.vocab_size);
        CHECK(l.params == (int64_t)cf_config_num_params(&c));
        cf_tp_comm m;
        CHECK(cf_tp_comm_detail(&c, 1, 4096, 2048, 2, &m) == 0);
        CHECK(m.fwd == 0 && m.bwd == 0 && m.fwd_calls == 0 && m.bwd_calls == 0 && m.step_qk_norm == 0);
    }
}

/* ================================================ biases, norms, vocab */

TEST(tp_qwen2_qkv_biases_are_split_like_the_rows_of_their_weights) {
    const char *cfgs[] = {"qwen2.5-1.5b", "qwen2.5-7b", "tiny-qwen2"};
    for (int i = 0; i < 3; i++) {
        cf_config c;
        CHECK(cf_config_builtin(&c, cfgs[i]) == 0);
        for (int tp = 1; tp <= 4; tp *= 2) {
            if (!divides_all(&c, tp)) continue;
            for (int r = 0; r < tp; r++) {
                const char *p[] = {"q_proj", "k_proj", "v_proj"};
                for (int j = 0; j < 3; j++) {
                    char wn[96], bn[96];
                    snprintf(wn, sizeof wn, "model.layers.1.self_attn.%s.weight", p[j]);
                    snprintf(bn, sizeof bn, "model.layers.1.self_attn.%s.bias", p[j]);
                    cf_tp_slice w, b;
                    CHECK(cf_tp_split(&c, tp, wn, r, &w) == 0 && cf_tp_split(&c, tp, bn, r, &b) == 0);
                    CHECK(b.kind == CF_TP_COLUMN && b.dim == 0 && b.ndim == 1);
                    CHECK(b.start == w.start && b.len == w.len && b.local_shape[0] == w.local_shape[0]);
                    CHECK(b.head_start == w.head_start && b.heads == w.heads);
                }
            }
        }
        /* qwen2 has no o bias */
        cf_tp_slice s;
        CHECK(cf_tp_split(&c, 1, "model.layers.0.self_attn.o_proj.bias", 0, &s) == -1 && err_has("no such bias"));
    }
}

TEST(tp_qwen3_q_and_k_norms_are_replicated_with_gradients_summed_over_ranks) {
    const char *cfgs[] = {"qwen3-14b", "qwen3-32b", "tiny-qwen3"};
    for (int i = 0; i < 3; i++) {
        cf_config c;
        CHECK(cf_config_builtin(&c, cfgs[i]) == 0);
        int tp = i < 2 ? 8 : 2;
        for (int r = 0; r < tp; r++) {
            cf_tp_slice qn, kn, ln;
            CHECK(cf_tp_split(&c, tp, "model.layers.1.self_attn.q_norm.weight", r, &qn) == 0);
            CHECK(cf_tp_split(&c, tp, "model.layers.1.self_attn.k_norm.weight", r, &kn) == 0);
            CHECK(cf_tp_split(&c, tp, "model.layers.1.input_layernorm.weight", r, &ln) == 0);
            CHECK(qn.kind == CF_TP_REPLICATED && kn.kind == CF_TP_REPLICATED);
            CHECK(qn.shape[0] == c.head_dim && qn.local_shape[0] == c.head_dim && kn.local_shape[0] == c.head_dim);
            CHECK(qn.grad_allreduce == 1 && kn.grad_allreduce == 1);
            CHECK(ln.kind == CF_TP_REPLICATED && ln.grad_allreduce == 0 && ln.shape[0] == c.hidden_size);
        }
        cf_tp_comm m;
        CHECK(cf_tp_comm_detail(&c, tp, 64, 32, 2, &m) == 0);
        CHECK(m.step_qk_norm == 2LL * c.num_hidden_layers * c.head_dim * 4);
    }
    /* a model without q/k norms has no such tensors */
    cf_config c;
    CHECK(cf_config_builtin(&c, "llama3.1-8b") == 0);
    cf_tp_slice s;
    CHECK(cf_tp_split(&c, 2, "model.layers.0.self_attn.q_norm.weight", 0, &s) == -1 && err_has("no such bias or norm"));
}

TEST(tp_row_parallel_o_bias_is_replicated_and_added_once_after_the_all_reduce) {
    cf_config c;
    CHECK(cf_config_builtin(&c, "tiny-llama") == 0);
    c.qkv_bias = c.o_bias = 1;
    for (int r = 0; r < 2; r++) {
        cf_tp_slice ob, ow, down;
        CHECK(cf_tp_split(&c, 2, "model.layers.1.self_attn.o_proj.bias", r, &ob) == 0);
        CHECK(cf_tp_split(&c, 2, "model.layers.1.self_attn.o_proj.weight", r, &ow) == 0);
        CHECK(cf_tp_split(&c, 2, "model.layers.1.mlp.down_proj.weight", r, &down) == 0);
        CHECK(ob.kind == CF_TP_REPLICATED && ob.after_allreduce == 1 && ob.grad_allreduce == 0);
        CHECK(ob.local_shape[0] == c.hidden_size);
        CHECK(ow.kind == CF_TP_ROW && ow.dim == 1 && ow.after_allreduce == 0);
        CHECK(down.kind == CF_TP_ROW && down.start == r * c.intermediate_size / 2 && down.len == c.intermediate_size / 2);
    }
}

TEST(tp_vocab_that_tp_does_not_divide_is_padded_to_a_multiple_of_tp_on_the_last_rank) {
    cf_config c = small(CF_MODEL_LLAMA, 50257, 16, 32, 8, 8, 2);
    CHECK(cf_tp_check(&c, 8) == 0);
    CHECK(cf_tp_vocab_padded(&c, 8) == 50264);
    CHECK(cf_tp_vocab_padded(&c, 1) == 50257);
    for (int r = 0; r < 8; r++) {
        cf_tp_slice e, h;
        CHECK(cf_tp_split(&c, 8, "model.embed_tokens.weight", r, &e) == 0);
        CHECK(cf_tp_split(&c, 8, "lm_head.weight", r, &h) == 0);
        CHECK(e.kind == CF_TP_VOCAB && h.kind == CF_TP_VOCAB && e.local_shape[0] == 6283 && e.local_shape[1] == 16);
        CHECK(e.start == r * 6283LL && h.start == e.start && h.len == e.len && h.pad == e.pad);
        CHECK(e.len == (r < 7 ? 6283 : 50257 - 7 * 6283) && e.pad == (r < 7 ? 0 : 7));
        cf_tp_local l;
        CHECK(cf_tp_local_config(&c, 8, r, &l) == 0);
        CHECK(l.vocab_padded == 50264 && l.vocab_local == 6283 && l.vocab_start == e.start && l.vocab_len == e.len);
    }
    char buf[256];
    CHECK(strstr(cf_tp_describe(&c, 8, buf, sizeof buf), "vocab 50257 padded to 50264") != NULL);
    CHECK(strstr(buf, "the last 7 rows are padding") != NULL);
    cf_config l8;
    CHECK(cf_config_builtin(&l8, "llama3.1-8b") == 0);
    CHECK(strcmp(cf_tp_describe(&l8, 8, buf, sizeof buf),
                 "tp 8: 4 of 32 heads, 1 of 8 KV heads, 1792 of 14336 FFN, vocab 128256 (16032 rows per rank)") == 0);
    /* a vocabulary smaller than tp: the last ranks hold only padding */
    cf_config t = small(CF_MODEL_QWEN3, 5, 8, 8, 8, 8, 2);
    cf_tp_slice s;
    CHECK(cf_tp_split(&t, 8, "model.embed_tokens.weight", 6, &s) == 0);
    CHECK(s.len == 0 && s.pad == 1 && s.start == 5 && s.local_shape[0] == 1);
}

TEST(tp_tied_embedding_is_split_once_and_lm_head_is_not_a_separate_tensor) {
    cf_config c;
    CHECK(cf_config_builtin(&c, "qwen2.5-1.5b") == 0);
    CHECK(c.tie_word_embeddings == 1);
    cf_tp_slice s;
    CHECK(cf_tp_split(&c, 2, "lm_head.weight", 0, &s) == -1 && err_has("tied") && err_one_line());
    CHECK(cf_tp_split(&c, 2, "model.embed_tokens.weight", 1, &s) == 0 && s.kind == CF_TP_VOCAB);
    char last[128];
    CHECK(cf_tp_tensor_name(&c, cf_tp_num_tensors(&c) - 1, last, sizeof last) == 0);
    CHECK(!strcmp(last, "model.norm.weight"));
}

TEST(tp_split_refuses_bad_ranks_and_names_that_are_not_parameters_with_one_line) {
    cf_config c;
    CHECK(cf_config_builtin(&c, "llama3.1-8b") == 0);
    cf_tp_slice s;
    CHECK(cf_tp_split(&c, 8, "model.norm.weight", 8, &s) == -1 && err_has("rank 8") && err_one_line());
    CHECK(cf_tp_split(&c, 8, "model.norm.weight", -1, &s) == -1 && err_has("rank -1"));
    CHECK(cf_tp_split(&c, 8, "model.layers.32.mlp.up_proj.weight", 0, &s) == -1 && err_has("past the model's 32 layers"));
    CHECK(cf_tp_split(&c, 8, "model.layers.01.mlp.up_proj.weight", 0, &s) == -1 && err_has("not a parameter"));
    CHECK(cf_tp_split(&c, 8, "model.layers.1.mlp.up_proj", 0, &s) == -1 && err_has("not a parameter"));
    CHECK(cf_tp_split(&c, 8, "model.layers..mlp.up_proj.weight", 0, &s) == -1);
    CHECK(cf_tp_split(&c, 8, "model.layers.0.self_attn.q_proj.lora_A.weight", 0, &s) == -1 && err_has("LoRA"));
    CHECK(cf_tp_split(&c, 8, "", 0, &s) == -1 && err_one_line());
    CHECK(cf_tp_split(&c, 8, NULL, 0, &s) == -1);
    CHECK(cf_tp_split(&c, 8, "model.layers.31.mlp.up_proj.weight", 7, &s) == 0 && s.start == 7 * 1792);
    char name[8];
    CHECK(cf_tp_tensor_name(&c, 0, name, sizeof name) == -1);   /* does not fit */
    CHECK(cf_tp_tensor_name(&c, cf_tp_num_tensors(&c), name, sizeof name) == -1);
}

/* ======================================================= communication */

TEST(tp_comm_bytes_match_a_hand_computation_for_llama3_8b_at_tp_8) {
    cf_config c;
    CHECK(cf_config_builtin(&c, "llama3.1-8b") == 0);   /* L 32, C 4096 */
    cf_tp_comm m;
    /* T = 2048 tokens, n = 1024 kept rows, bf16 */
    CHECK(cf_tp_comm_detail(&c, 8, 2048, 1024, 2, &m) == 0);
    CHECK(m.fwd_layers == 2LL * 32 * 2048 * 4096 * 2);        /* 1,073,741,824 */
    CHECK(m.fwd_embed == 2048LL * 4096 * 2);                 /*    16,777,216 */
    CHECK(m.fwd_xent == 3LL * 2048 * 4);                     /*        24,576 */
    CHECK(m.fwd == 1090543616LL);
    CHECK(m.bwd_layers == 2LL * 32 * 1024 * 4096 * 2);        /*   536,870,912 */
    CHECK(m.bwd_lm_head == 1024LL * 4096 * 2);               /*     8,388,608 */
    CHECK(m.bwd == 545259520LL);
    CHECK(m.fwd_calls == 68 && m.bwd_calls == 65 && m.step_qk_norm == 0);
    int64_t f, b, f_reg, b_reg;
    CHECK(cf_tp_comm_bytes(&c, 8, 2048, 1024, 2, &f, &b) == 0 && f == m.fwd && b == m.bwd);
    /* regular: the backward runs on all T rows, twice centrifuge's at keep 0.5; the forward is the same */
    CHECK(cf_tp_comm_bytes(&c, 8, 2048, 2048, 2, &f_reg, &b_reg) == 0);
    CHECK(f_reg == f && b_reg == 2 * b);
    /* the volume does not depend on tp (> 1); the ring's wire bytes do */
    CHECK(cf_tp_comm_bytes(&c, 2, 2048, 1024, 2, &f, &b) == 0 && f == m.fwd && b == m.bwd);
    CHECK(cf_tp_ring_bytes(1000, 8) == 1750 && cf_tp_ring_bytes(1000, 2) == 1000 && cf_tp_ring_bytes(1000, 1) == 0);
    CHECK(cf_tp_ring_bytes(545259520LL, 8) == 545259520LL / 8 * 14);
    CHECK(cf_tp_comm_bytes(&c, 8, 2048, 0, 2, &f, &b) == -1 && err_one_line());
    CHECK(cf_tp_comm_bytes(&c, 8, 2048, 2049, 2, &f, &b) == -1);
    CHECK(cf_tp_comm_bytes(&c, 8, 2048, 1024, 0, &f, &b) == -1);
}

/* ============================================================== memory */

TEST(tp_memory_plan_of_llama3_8b_at_tp_8_matches_a_hand_count_and_zero1_splits_the_optimizer) {
    cf_config c;
    CHECK(cf_config_builtin(&c, "llama3.1-8b") == 0);
    /* per rank: embed + head 2 x 128256 x 4096 / 8; per layer q, o 4096 x 512, k, v 128 x 4096 (1 KV head),
     * gate, up, down 1792 x 4096, two norms 4096; final norm 4096 */
    int64_t layer = 2 * 4096LL * 512 + 2 * 128LL * 4096 + 3 * 1792LL * 4096 + 2 * 4096;
    int64_t P = 2 * 128256LL * 4096 / 8 + 32 * layer + 4096;
    CHECK(P == 1004015616LL);
    cf_tp_mem_opts o = {.tp = 8, .dp = 1, .batch = 1, .seq = 2048, .compact = 0, .keep = 0, .act_bytes = 2,
                        .reserve = 1 << 30};
    cf_tp_mem m;
    CHECK(cf_tp_memory(&c, &o, &m) == 0);
    CHECK(m.params == P && m.weights == (uint64_t)P * 2 && m.grads == (uint64_t)P * 4 && m.optimizer == (uint64_t)P * 12);
    CHECK(m.activations == 2048 * m.act_per_token && m.reserve == 1u << 30);
    CHECK(m.total == m.weights + m.grads + m.optimizer + m.activations + m.logits + m.reserve);
    /* the replicated residual stream alone is (L + 1) x C x 2 bytes per token */
    CHECK(m.act_per_token > 33ULL * 4096 * 2);
    cf_tp_mem z, cfm;
    o.dp = 2;
    CHECK(cf_tp_memory(&c, &o, &z) == 0 && z.optimizer == (uint64_t)P / 2 * 12 && z.weights == m.weights);
    o.dp = 1;
    o.compact = 1;
    o.keep = 0.5;
    CHECK(cf_tp_memory(&c, &o, &cfm) == 0 && cfm.act_per_token > m.act_per_token);
    /* tp 2 holds more of the model per rank than tp 8 */
    o.tp = 2;
    cf_tp_mem m2;
    CHECK(cf_tp_memory(&c, &o, &m2) == 0 && m2.params > 3 * m.params && m2.act_per_token > cfm.act_per_token);
    o.tp = 3;
    CHECK(cf_tp_memory(&c, &o, &m2) == -1 && err_has("--tp 3"));
}

/* The new built-ins of the paper's eight-GPU rows have the published sizes
 * (ALIA-40b: its model card's 40,433,885,184 parameters) and split at tp 8. */
TEST(tp_paper_8_gpu_models_have_their_published_parameter_counts_and_split_at_tp_8) {
    cf_config c;
    const char *names[] = {"qwen3-14b", "qwen3-32b", "alia-40b"};
    for (int i = 0; i < 3; i++)
        CHECK_MSG(cf_config_builtin(&c, names[i]) == 0 && cf_config_validate(&c) == 0, "%s: %s", names[i],
                  cf_last_error());
    CHECK(cf_config_builtin(&c, "alia-40b") == 0);
    CHECK(cf_config_num_params(&c) == 40433885184ULL);
    CHECK((uint64_t)c.vocab_size * c.hidden_size == 2097152000ULL);   /* the card's embedding parameters */
    CHECK(cf_tp_check(&c, 8) == 0 && cf_tp_vocab_padded(&c, 8) == 256000);
    CHECK(cf_config_builtin(&c, "qwen3-14b") == 0);
    CHECK(cf_config_num_params(&c) > 14700000000ULL && cf_config_num_params(&c) < 14800000000ULL);   /* 14.8B */
    CHECK(cf_tp_check(&c, 8) == 0 && c.qk_norm == 1 && c.head_dim == 128 && !c.tie_word_embeddings);
    CHECK(cf_config_builtin(&c, "qwen3-32b") == 0);
    CHECK(cf_config_num_params(&c) > 32700000000ULL && cf_config_num_params(&c) < 32800000000ULL);   /* 32.8B */
    CHECK(cf_tp_check(&c, 8) == 0 && c.num_attention_heads * c.head_dim != c.hidden_size);
}

/* train's memory check under --tp estimates one TP rank: weights, gradients
 * and optimizer state of the rank's slice (about 1/tp of the model, the
 * norms replicated), activations of its heads and FFN slice. */
TEST(memory_check_under_tp_estimates_one_rank_s_slice) {
    setenv("CENTRIFUGE_NO_MEMORY_CHECK", "1", 1);   /* the estimate, not the host's free memory */
    cf_model_opts mo = {0};
    mo.backend = CF_BACKEND_CPU;
    mo.config = "llama3.1-8b";
    cf_memory_opts o = {0};
    o.batch = 1; o.seq = 2048; o.grad_accum = 1; o.train = 1; o.world = 1;
    cf_memory_estimate whole, half;
    CHECK(cf_memory_check(&mo, &o, &whole) == 0);
    o.tp = 2;
    CHECK(cf_memory_check(&mo, &o, &half) == 0);
    CHECK(whole.weights > 0 && half.weights > 0);
    double r = (double)(half.weights + half.optimizer) / (double)(whole.weights + whole.optimizer);
    CHECK_MSG(r > 0.49 && r < 0.51, "TP=2 weights+optimizer / whole = %g", r);
    CHECK(half.activations < whole.activations);
    /* a TP degree the model cannot take leaves the check to the model's open */
    o.tp = 3;
    CHECK(cf_memory_check(&mo, &o, &half) == 0);
    unsetenv("CENTRIFUGE_NO_MEMORY_CHECK");
}

int main(void) {
    RUN(memory_check_under_tp_estimates_one_rank_s_slice);
    RUN(tp_every_builtin_tensor_is_tiled_exactly_once_by_split_ranks_or_whole_on_every_rank);
    RUN(tp_tensor_list_is_the_model_parameter_table_for_every_model_type);
    RUN(tp_extract_and_insert_give_each_element_to_exactly_one_rank_on_small_models_of_every_type);
    RUN(tp_gqa_32_heads_8_kv_heads_gives_each_rank_whole_kv_groups_at_tp_2_4_8);
    RUN(tp_8_with_4_kv_heads_fails_with_one_line_naming_the_kv_heads_and_the_tp_that_work);
    RUN(tp_that_divides_neither_heads_nor_ffn_names_every_number_in_one_line);
    RUN(tp_1_is_the_identity_whole_tensors_no_padding_and_no_communication);
    RUN(tp_qwen2_qkv_biases_are_split_like_the_rows_of_their_weights);
    RUN(tp_qwen3_q_and_k_norms_are_replicated_with_gradients_summed_over_ranks);
    RUN(tp_row_parallel_o_bias_is_replicated_and_added_once_after_the_all_reduce);
    RUN(tp_vocab_that_tp_does_not_divide_is_padded_to_a_multiple_of_tp_on_the_last_rank);
    RUN(tp_tied_embedding_is_split_once_and_lm_head_is_not_a_separate_tensor);
    RUN(tp_split_refuses_bad_ranks_and_names_that_are_not_parameters_with_one_line);
    RUN(tp_comm_bytes_match_a_hand_computation_for_llama3_8b_at_tp_8);
    RUN(tp_memory_plan_of_llama3_8b_at_tp_8_matches_a_hand_count_and_zero1_splits_the_optimizer);
    RUN(tp_paper_8_gpu_models_have_their_published_parameter_counts_and_split_at_tp_8);
    return test_summary();
}
