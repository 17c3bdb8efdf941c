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

/* -------------------------------------------------------------- convert */

/* `centrifuge convert`: rewrite a model directory in another dtype and/or
 * as shards with an index (what transformers writes for large models). */
int cmd_convert(int argc, char **argv) {
    const char *model_dir = NULL, *out = NULL, *dtype = "bfloat16";
    long shard_mb = 0;
    cf_opt opts[] = {
        {"--model", CF_OPT_STR, &model_dir, 0, 0, "model directory to read (required)", 0},
        {"--out", CF_OPT_STR, &out, 0, 0, "directory to write (required)", 0},
        {"--dtype", CF_OPT_STR, &dtype, 0, 0, "float32 or bfloat16 (default bfloat16)", 0},
        {"--max-shard-mb", CF_OPT_INT, &shard_mb, 0, 1L << 30, "split into shards of at most N MB (0 = one file)", 0},
    };
    int nopts = (int)(sizeof opts / sizeof *opts);
    int pr = cf_cli_parse("convert", "--model DIR --out DIR [--dtype bfloat16] [--max-shard-mb N]\n\n"
                          "Rewrites a model as float32 or bfloat16 safetensors, optionally sharded.",
                          opts, nopts, argc, argv);
    if (pr == 1) return 0;
    if (pr < 0) return cf_cli_error("convert", 2);
    if (!model_dir || !out) { cf_fail("--model and --out are required"); return cf_cli_error("convert", 2); }
    if (strcmp(dtype, "float32") != 0 && strcmp(dtype, "bfloat16") != 0) {
        cf_fail("--dtype: '%s' is not float32 or bfloat16", dtype);
        return cf_cli_error("convert", 2);
    }
    cf_model *m = cf_cli_open_model(NULL, model_dir, "cpu", 0, NULL);
    if (!m) return cf_cli_error("convert", 1);
    int rc = cf_model_save(m, out, dtype, (size_t)shard_mb << 20);
    if (rc == 0) printf("convert: wrote %s (%s, %.1fM parameters%s)\n", out, dtype, cf_model_num_params(m) / 1e6,
                        shard_mb ? ", sharded" : "");
    cf_model_free(m);
    return rc ? cf_cli_error("convert", 1) : 0;
}
