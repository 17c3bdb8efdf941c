/*
 * generate.c — greedy and sampled decoding, batched over prompts, and the
 * `centrifuge generate` command.
 *
 * There is no KV cache: each new token reruns the forward over the batch.
 * Rows are right-padded; causal attention means the padding after a row's
 * last token never changes the logits that choose its next token.
 */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmd/cli.h"
#include "cmd/commands.h"
#include "base/common.h"
#include "cmd/datagen.h"
#include "centrifuge.h"

int cmd_generate(int argc, char **argv) {
    const char *model_dir = NULL, *prompt = NULL, *ids = NULL, *device = "cpu";
    long max_new = 64, top_k = 0, seed = 1;
    double temperature = 0;
    cf_opt opts[] = {
        {"--model", CF_OPT_STR, &model_dir, 0, 0, "model directory (required)", 0},
        {"--prompt", CF_OPT_STR, &prompt, 0, 0, "prompt text (byte tokenizer of the demo models)", 0},
        {"--prompt-ids", CF_OPT_STR, &ids, 0, 0, "or comma-separated token ids (any model)", 0},
        {"--max-new", CF_OPT_INT, &max_new, 1, 1 << 20, "tokens to generate (default 64)", 0},
        {"--temperature", CF_OPT_FLOAT, &temperature, 0, 100, "0 = greedy (default)", 0},
        {"--top-k", CF_OPT_INT, &top_k, 0, 1 << 30, "sample from the k most likely (0 = all)", 0},
        {"--seed", CF_OPT_INT, &seed, 0, 1L << 62, "sampling seed", 0},
        {"--device", CF_OPT_STR, &device, 0, 0, "cpu or cuda", 0},
    };
    int nopts = (int)(sizeof opts / sizeof *opts);
    int pr = cf_cli_parse("generate", "--model DIR (--prompt TEXT | --prompt-ids 1,2,3) [options]\n\n"
                          "Greedy (default) or sampled decoding.", opts, nopts, argc, argv);
    if (pr == 1) return 0;
    if (pr < 0) return cf_cli_error("generate", 2);
    if (!model_dir) { cf_fail("--model is required"); return cf_cli_error("generate", 2); }
    if (!prompt == !ids) { cf_fail("give exactly one of --prompt and --prompt-ids"); return cf_cli_error("generate", 2); }
    cf_model *m = cf_cli_open_model(NULL, model_dir, device, 0, NULL);
    if (!m) return cf_cli_error("generate", 1);
    const cf_config *c = cf_model_config(m);
    int cap = (int)CF_MIN((long)c->max_position_embeddings, 4096L + max_new);
    uint32_t *seq = cf_malloc((size_t)(cap + max_new + 1) * sizeof(uint32_t));
    int len = 0, rc = 0;
    if (!seq) { cf_model_free(m); return cf_cli_error("generate", 1); }
    int byte_model = c->vocab_size >= CF_TOK_VOCAB && c->bos_token_id == CF_TOK_BOS;
    if (prompt) {
        if (!byte_model) { cf_fail("--prompt needs a byte-tokenizer model (bos %d); use --prompt-ids", CF_TOK_BOS); rc = 1; }
        else {
            seq[len++] = CF_TOK_BOS;
            len += cf_tok_encode(prompt, seq + len, cap - len);
        }
    } else {
        char *copy = strdup(ids), *save = NULL;
        for (char *t = strtok_r(copy, ",", &save); t && rc == 0; t = strtok_r(NULL, ",", &save)) {
            long v;
            if (cf_parse_int(t, 0, c->vocab_size - 1, "--prompt-ids", &v) != 0) rc = 1;
            else if (len < cap) seq[len++] = (uint32_t)v;
        }
        free(copy);
        if (rc == 0 && len == 0) { cf_fail("--prompt-ids: empty"); rc = 1; }
    }
    int start = len;
    if (rc == 0 && cf_generate(m, &seq, &len, 1, cap + (int)max_new, (int)max_new, (float)temperature,
                               (int)top_k, c->eos_token_id, -2, (uint64_t)seed) != 0)
        rc = 1;
    if (rc == 0) {
        if (byte_model) {
            char *text = cf_malloc((size_t)len * 4 + 16);
            if (text) {
                cf_tok_decode(seq, start, text, len * 4 + 16);
                printf("%s", text);
                cf_tok_decode(seq + start, len - start, text, len * 4 + 16);
                printf("\033[1m%s\033[0m\n", text);
                free(text);
            }
        } else {
            for (int i = start; i < len; i++) printf("%s%u", i > start ? "," : "", seq[i]);
            printf("\n");
        }
    }
    free(seq);
    cf_model_free(m);
    return rc ? cf_cli_error("generate", rc) : 0;
}
