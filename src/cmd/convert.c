/*
 * convert.c — `centrifuge convert`: rewrite a model directory as float32
 * or bfloat16 safetensors, optionally sharded with an index.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/common.h"
#include "centrifuge.h"
#include "cmd/cli.h"
#include "cmd/commands.h"
#include "cmd/runfiles.h"

/* -------------------------------------------------------------- convert */

/* `centrifuge convert`: rewrite a model directory in another dtype and/or
 * as shards with an index (what transformers writes for large models). */
int cmd_convert(int argc, char **argv) {
    const char *model_dir = NULL, *out = NULL, *dtype = "bfloat16", *adapter = NULL;
    long shard_mb = 0;
    int merge = 0;
    cf_opt opts[] = {
        {"--model", CF_OPT_STR, &model_dir, 0, 0, "model directory to read (required)", 0},
        {"--out", CF_OPT_STR, &out, 0, 0, "directory to write (required)", 0},
        {"--dtype", CF_OPT_STR, &dtype, 0, 0, "float32 or bfloat16 (default bfloat16)", 0},
        {"--max-shard-mb", CF_OPT_INT, &shard_mb, 0, 1L << 30, "split into shards of at most N MB (0 = one file)", 0},
        {"--adapter", CF_OPT_STR, &adapter, 0, 0, "PEFT LoRA adapter (or LoRA run directory) for --merge-lora", 0},
        {"--merge-lora", CF_OPT_FLAG, &merge, 0, 0, "fold the adapter into the weights: a plain HF model", 0},
    };
    int nopts = (int)(sizeof opts / sizeof *opts);
    int pr = cf_cli_parse("convert", "--model DIR --out DIR [--dtype bfloat16] [--max-shard-mb N]\n\n"
                          "Rewrites a model as float32 or bfloat16 safetensors, optionally sharded.",
                          opts, nopts, argc, argv);
    if (pr == 1) return 0;
    if (pr < 0) return cf_cli_error("convert", 2);
    if (cf_cli_check_single_process("convert") != 0) return cf_cli_error("convert", 2);
    if (!model_dir || !out) { cf_fail("--model and --out are required"); return cf_cli_error("convert", 2); }
    if (merge != (adapter != NULL)) {
        cf_fail(merge ? "--merge-lora needs --adapter DIR" : "--adapter needs --merge-lora (the output is a merged model)");
        return cf_cli_error("convert", 2);
    }
    if (strcmp(dtype, "float32") != 0 && strcmp(dtype, "bfloat16") != 0) {
        cf_fail("--dtype: '%s' is not float32 or bfloat16", dtype);
        return cf_cli_error("convert", 2);
    }
    /* --out is checked before the model is read. Converting in place (--out
     * = --model) is safe: the model is read whole first, every file is
     * replaced atomically, a re-sharded save never overwrites the shards the
     * current index names, and the index moves last, so a kill or a full
     * disk leaves the old model or the new one. */
    if (cf_output_dir_check(out, 64) != 0) return cf_cli_error("convert", 1);
    char ckpt[4096];   /* a run directory stands for its newest checkpoint */
    if (!(model_dir = cf_resolve_model_dir(model_dir, ckpt, sizeof ckpt))) return cf_cli_error("convert", 1);
    if (adapter) cf_input_register(adapter);
    cf_model *m = cf_cli_open_model_adapter(NULL, model_dir, "cpu", 0, adapter);
    if (!m) return cf_cli_error("convert", 1);
    /* W += (alpha/r) B A in fp32 on the CPU, then the base tensors are saved */
    int rc = merge ? cf_model_merge_lora(m) : 0;
    if (rc == 0) rc = cf_model_save(m, out, dtype, (size_t)shard_mb << 20);
    /* the tokenizer files travel with the model */
    if (rc == 0 && cf_copy_tokenizer_files(model_dir, out) < 0) rc = -1;
    if (rc == 0) {
        /* a model smaller than one shard is written as one file, without an index: say which */
        char index[4096];
        int sharded = shard_mb && cf_path_join(index, sizeof index, out, "model.safetensors.index.json") == 0 &&
                      cf_path_exists(index);
        double params = (double)(cf_model_num_params(m) - (merge ? cf_model_num_trainable(m) : 0));
        printf("convert: wrote %s (%s, %.*fM parameters%s%s)\n", out, dtype, params < 1e6 ? 3 : 1, params / 1e6,
               sharded ? ", sharded with an index" : shard_mb ? ", one file: the model fits in one shard" : "",
               merge ? ", LoRA merged" : "");
    }
    cf_model_free(m);
    return rc ? cf_cli_error("convert", 1) : 0;
}
