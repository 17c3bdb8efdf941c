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
#include "cmd/progress.h"
#include "cmd/runfiles.h"
#include "centrifuge.h"
#include "centrifuge_tokenizer.h"

/* The text that ids[start..n) add to the decoding of ids[0..start): decoding
 * the continuation alone could drop a leading space (SentencePiece decoders
 * strip the first one). Returns a malloc'd string, or NULL. */
static char *continuation_text(cf_tokenizer *tk, const uint32_t *ids, int start, int n) {
    char *all = NULL, *head = NULL;
    size_t la = 0, lh = 0;
    if (cf_tokenizer_decode(tk, ids, (size_t)n, 1, &all, &la) != 0) return NULL;
    if (cf_tokenizer_decode(tk, ids, (size_t)start, 1, &head, &lh) != 0) { free(all); return NULL; }
    char *r;
    if (lh <= la && memcmp(all, head, lh) == 0) {
        r = strdup(all + lh);
    } else {
        free(all);
        all = NULL;
        if (cf_tokenizer_decode(tk, ids + start, (size_t)(n - start), 1, &all, &la) != 0) { free(head); return NULL; }
        r = strdup(all);
    }
    free(all);
    free(head);
    if (!r) cf_fail("out of memory");
    return r;
}

int cmd_generate(int argc, char **argv) {
    const char *model_dir = NULL, *prompt = NULL, *ids = NULL, *device = "cpu", *tokenizer = NULL;
    long max_new = 64, top_k = 0, seed = 1;
    double temperature = 0;
    int show_ids = 0;
    cf_opt opts[] = {
        {"--model", CF_OPT_STR, &model_dir, 0, 0, "model or run directory (required)", 0},
        {"--prompt", CF_OPT_STR, &prompt, 0, 0, "prompt text", 0},
        {"--prompt-ids", CF_OPT_STR, &ids, 0, 0, "or comma-separated token ids (any model)", 0},
        {"--tokenizer", CF_OPT_STR, &tokenizer, 0, 0, "tokenizer.json or its directory (default: the model's own, if it has one)", 0},
        {"--ids", CF_OPT_FLAG, &show_ids, 0, 0, "print the new token ids, not text", 0},
        {"--max-new", CF_OPT_INT, &max_new, 1, 1 << 20, "tokens to generate (default 64)", 0},
        {"--temperature", CF_OPT_FLOAT, &temperature, 0, 100, "0 = greedy (default)", 0},
        {"--top-k", CF_OPT_INT, &top_k, 0, 1 << 30, "sample from the k most likely (0 = all)", 0},
        {"--seed", CF_OPT_INT, &seed, 0, 1L << 62, "sampling seed", 0},
        {"--device", CF_OPT_STR, &device, 0, 0, "cpu or cuda", 0},
    };
    int nopts = (int)(sizeof opts / sizeof *opts);
    int pr = cf_cli_parse("generate", "--model DIR (--prompt TEXT | --prompt-ids 1,2,3) [options]\n\n"
                          "Greedy (default) or sampled decoding. Text goes through the model's tokenizer.json\n"
                          "(or --tokenizer); the synthetic-world models use their byte tokenizer. The new text\n"
                          "is printed after the prompt, in bold on a terminal.", opts, nopts, argc, argv);
    if (pr == 1) return 0;
    if (pr < 0) return cf_cli_error("generate", 2);
    if (cf_cli_check_single_process("generate") != 0) return cf_cli_error("generate", 2);
    if (!model_dir) { cf_fail("--model is required"); return cf_cli_error("generate", 2); }
    /* greedy decoding draws nothing: a sampling flag with it would be ignored */
    if (temperature == 0 && (cf_opt_seen(opts, nopts, "--top-k") || cf_opt_seen(opts, nopts, "--seed"))) {
        cf_fail("%s samples, and --temperature 0 (the default) is greedy: give --temperature > 0",
                cf_opt_seen(opts, nopts, "--top-k") ? "--top-k" : "--seed");
        return cf_cli_error("generate", 2);
    }
    if (!prompt == !ids) { cf_fail("give exactly one of --prompt and --prompt-ids"); return cf_cli_error("generate", 2); }
    /* strtok below skips empty items: "5,,6" would silently be the prompt 5,6 */
    if (ids && !*ids) { cf_fail("--prompt-ids: empty"); return cf_cli_error("generate", 2); }
    if (cf_list_check("--prompt-ids", ids) != 0) return cf_cli_error("generate", 2);
    /* every item a token id, before the model is read (whether it is in the
     * model's vocabulary is known only then) */
    for (const char *p = ids; p && *p;) {
        char item[64];
        size_t k = strcspn(p, ",");
        snprintf(item, sizeof item, "%.*s", (int)(k < sizeof item ? k : sizeof item - 1), p);
        long v;
        if (k >= sizeof item) { cf_fail("--prompt-ids: '%.20s...' is not an integer", p); return cf_cli_error("generate", 2); }
        if (cf_parse_int(item, 0, INT32_MAX, "--prompt-ids", &v) != 0) return cf_cli_error("generate", 2);
        p += k + (p[k] == ',');
    }
    if (cf_cli_check_model_flags(NULL, model_dir, device) != 0) return cf_cli_error("generate", 2);
    char ckpt[4096];
    if (!(model_dir = cf_resolve_model_dir(model_dir, ckpt, sizeof ckpt))) return cf_cli_error("generate", 1);
    cf_tokenizer *tk = NULL;
    if (tokenizer) {
        if (!(tk = cf_tokenizer_load(tokenizer))) return cf_cli_error("generate", 1);
    } else {
        char tj[4096];
        if (cf_path_join(tj, sizeof tj, model_dir, "tokenizer.json") == 0 && cf_path_exists(tj) &&
            !(tk = cf_tokenizer_load(model_dir)))
            return cf_cli_error("generate", 1);
    }
    cf_model *m = cf_cli_open_model(NULL, model_dir, device, 0, NULL);
    if (!m) { cf_tokenizer_free(tk); return cf_cli_error("generate", 1); }
    const cf_config *c = cf_model_config(m);
    if (tk && cf_tokenizer_max_id(tk) > c->vocab_size) {
        /* ids beyond the embedding would be refused by the model anyway;
         * say which file disagrees with which */
        cf_fail("%s has ids up to %d, the model's vocab_size is %d: not this model's tokenizer",
                cf_tokenizer_path(tk), cf_tokenizer_max_id(tk) - 1, c->vocab_size);
        cf_tokenizer_free(tk);
        cf_model_free(m);
        return cf_cli_error("generate", 1);
    }
    int cap = (int)CF_MIN((long)c->max_position_embeddings, 4096L + max_new);
    uint32_t *seq = cf_malloc((size_t)(cap + max_new + 1) * sizeof(uint32_t));
    int len = 0, rc = 0;
    if (!seq) { cf_tokenizer_free(tk); cf_model_free(m); return cf_cli_error("generate", 1); }
    int byte_model = !tk && c->vocab_size >= CF_TOK_VOCAB && c->bos_token_id == CF_TOK_BOS;
    if (prompt && tk) {
        uint32_t *pid = NULL;
        size_t np = 0;
        if (cf_tokenizer_encode(tk, prompt, strlen(prompt), 1, &pid, &np) != 0) rc = 1;
        else if (np == 0) { cf_fail("--prompt: encodes to no tokens"); rc = 1; }
        else if ((int)np > cap) { cf_fail("--prompt: %zu tokens, more than the %d positions available", np, cap); rc = 1; }
        else {
            for (size_t i = 0; i < np; i++) {
                if ((int64_t)pid[i] >= c->vocab_size) {
                    cf_fail("--prompt: token id %u is beyond the model's vocab_size %d", pid[i], c->vocab_size);
                    rc = 1;
                    break;
                }
                seq[len++] = pid[i];
            }
        }
        free(pid);
    } else if (prompt) {
        if (!byte_model) {
            cf_fail("--prompt needs a tokenizer: %s has no tokenizer.json; give --tokenizer FILE|DIR (or --prompt-ids)",
                    model_dir);
            rc = 1;
        } else {
            /* one token per byte, after BOS: a longer prompt is refused, not cut */
            size_t np = strlen(prompt) + 1;
            if (np > (size_t)cap) {
                cf_fail("--prompt: %zu tokens, more than the %d positions available", np, cap);
                rc = 1;
            } else {
                seq[len++] = CF_TOK_BOS;
                len += cf_tok_encode(prompt, seq + len, cap - len);
            }
        }
    } else {
        char *copy = strdup(ids), *save = NULL;
        if (!copy) { cf_fail("out of memory"); rc = 1; }
        long given = 0;
        for (char *t = copy ? strtok_r(copy, ",", &save) : NULL; t && rc == 0; t = strtok_r(NULL, ",", &save)) {
            long v;
            given++;
            if (cf_parse_int(t, 0, c->vocab_size - 1, "--prompt-ids", &v) != 0) rc = 1;
            else if (len < cap) seq[len++] = (uint32_t)v;
        }
        free(copy);
        /* ids beyond the positions were dropped above: generating from the
         * cut prompt would answer another prompt than the one given */
        if (rc == 0 && given > cap) {
            cf_fail("--prompt-ids: %ld tokens, more than the %d positions available", given, cap);
            rc = 1;
        }
        if (rc == 0 && len == 0) { cf_fail("--prompt-ids: empty"); rc = 1; }
    }
    int start = len;
    /* stop at every eos id generation_config.json names, else at every one
     * config.json lists (as transformers' generate), and at the tokenizer's
     * own: an instruct model's end of turn is often named only there */
    int stops[CF_MAX_EOS_IDS + 1], nstops = 0;
    if (rc == 0 && cf_generation_config_eos(model_dir, c->vocab_size, stops, CF_MAX_EOS_IDS, &nstops) != 0) rc = 1;
    if (nstops == 0) {
        stops[nstops++] = c->eos_token_id;
        for (int i = 0; i < c->num_extra_eos && i < CF_MAX_EOS_IDS - 1; i++) stops[nstops++] = c->extra_eos_ids[i];
    }
    if (tk) stops[nstops++] = cf_tokenizer_eos_id(tk);
    if (rc == 0 && cf_generate_stops(m, &seq, &len, 1, cap + (int)max_new, (int)max_new, (float)temperature,
                                     (int)top_k, stops, nstops, (uint64_t)seed) != 0)
        rc = 1;
    /* bold for the new text, and only on a terminal: a pipe gets plain text */
    const char *on = cf_color_ok(1) ? "\033[1m" : "", *off = *on ? "\033[0m" : "";
    if (rc == 0 && !show_ids && tk) {
        char *cont = continuation_text(tk, seq, start, len);
        if (!cont) rc = 1;
        else {
            if (prompt) printf("%s", prompt);
            printf("%s%s%s\n", on, cont, off);
            free(cont);
        }
    } else if (rc == 0) {
        if (byte_model && !show_ids) {
            char *text = cf_malloc((size_t)len * 4 + 16);
            if (text) {
                cf_tok_decode(seq, start, text, len * 4 + 16);
                printf("%s", text);
                cf_tok_decode(seq + start, len - start, text, len * 4 + 16);
                printf("%s%s%s\n", on, text, off);
                free(text);
            }
        } else {
            for (int i = start; i < len; i++) printf("%s%u", i > start ? "," : "", seq[i]);
            printf("\n");
        }
    }
    free(seq);
    cf_tokenizer_free(tk);
    cf_model_free(m);
    return rc ? cf_cli_error("generate", rc) : 0;
}
