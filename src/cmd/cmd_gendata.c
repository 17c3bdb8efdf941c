/*
 * cmd_gendata.c — `centrifuge gen-data`: writes the synthetic math world
 * (datagen.h) as a token shard.
 *
 *   centrifuge gen-data --source noisy --tokens 50M --seed 1 --out data/noisy.bin
 *
 * The shard is written with width 0 (uint16, since every id < 65536). The
 * tokens are generated into one uint32 buffer before writing, so memory is
 * 4 bytes per token; --tokens is capped at GEN_MAX_TOKENS (2 GB of buffer).
 * Larger corpora would need a streaming shard writer in io.h.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmd/cli.h"
#include "cmd/commands.h"
#include "base/common.h"
#include "cmd/datagen.h"
#include "formats/io.h"

#define GEN_MAX_TOKENS 500000000L

static const char *const CMD = "gen-data";
static const char *const USAGE =
    "--source clean|noisy --tokens N --out FILE [--seed S]\n\n"
    "Writes the synthetic math world as a token shard (byte tokens, BOS 256, EOS 257).\n"
    "  clean: arithmetic word problems with worked solutions (add, sub, mul, two-step)\n"
    "  noisy: 35% clean problems, 20% with wrong arithmetic, 15% spam, 15% digit\n"
    "         strings, 15% unrelated text (shares of documents)\n"
    "The same seed gives the same tokens; evaluation problems are never in the output.";

int cmd_gen_data(int argc, char **argv) {
    const char *source = NULL, *out = NULL, *world = "standard";
    long tokens = 0, seed = 1;
    cf_opt opts[] = {
        {"--source", CF_OPT_STR, &source, 0, 0, "clean or noisy (required)", 0},
        {"--tokens", CF_OPT_COUNT, &tokens, 0, 1e15,
         "token count, suffixes k/M/G are powers of 1000, e.g. 50M (required, at most 500M)", 0},
        {"--seed", CF_OPT_INT, &seed, 0, 1e18, "random seed, >= 0 (default 1)", 0},
        {"--out", CF_OPT_STR, &out, 0, 0, "output token shard (required)", 0},
        {"--world", CF_OPT_STR, &world, 0, 0, "standard (operands up to 99) or small (one-digit, the demo's)", 0},
    };
    const int nopts = (int)(sizeof opts / sizeof opts[0]);

    int rc = cf_cli_parse(CMD, USAGE, opts, nopts, argc, argv);
    if (rc == 1) return 0;   /* --help */
    if (rc != 0) return cf_cli_error(CMD, 2);
    if (cf_cli_check_single_process(CMD) != 0) return cf_cli_error(CMD, 2);

    cf_world w;
    if (cf_world_parse(world, &w) != 0) return cf_cli_error(CMD, 2);
    cf_datagen_set_world(w);
    cf_data_source src;
    if (!source) {
        cf_fail("--source is required (clean or noisy)");
        return cf_cli_error(CMD, 2);
    }
    if (cf_data_source_parse(source, &src) != 0) {
        cf_fail("--source: '%s' is not a data source (expected clean or noisy)", source);
        return cf_cli_error(CMD, 2);
    }
    if (!opts[1].seen) {
        cf_fail("--tokens is required (a count such as 1000000 or 50M)");
        return cf_cli_error(CMD, 2);
    }
    if (tokens < 1) {
        cf_fail("--tokens: must be at least 1");
        return cf_cli_error(CMD, 2);
    }
    if (tokens > GEN_MAX_TOKENS) {
        cf_fail("--tokens: %ld is more than the limit of %ld (tokens are buffered in memory, "
                "4 bytes each)", tokens, GEN_MAX_TOKENS);
        return cf_cli_error(CMD, 2);
    }
    if (!out) {
        cf_fail("--out is required (the token shard to write)");
        return cf_cli_error(CMD, 2);
    }

    uint32_t *buf = cf_malloc((size_t)tokens * sizeof *buf);
    if (!buf) return cf_cli_error(CMD, 1);

    double t0 = cf_now();
    if (cf_datagen_tokens(src, (uint64_t)seed, tokens, buf) != 0) {
        free(buf);
        return cf_cli_error(CMD, 1);
    }
    double t1 = cf_now();

    long docs = 0;   /* documents begun, the last one possibly cut */
    for (long i = 0; i < tokens; i++) docs += buf[i] == CF_TOK_BOS;

    /* the output's directory is made if it is missing, as tokenize does */
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", out);
    char *slash = strrchr(dir, '/');
    if (slash && slash != dir) *slash = 0;
    if ((slash && slash != dir && cf_mkdir_p(dir) != 0) || cf_tokens_write(out, buf, tokens, 0) != 0) {
        free(buf);
        return cf_cli_error(CMD, 1);
    }
    double t2 = cf_now();
    free(buf);

    double gen_s = t1 - t0 > 1e-9 ? t1 - t0 : 1e-9;
    printf("gen-data: wrote %ld tokens (%ld documents, %s, seed %ld) to %s; "
           "generated in %.2f s (%.1fM tokens/s), written in %.2f s\n",
           tokens, docs, source, seed, out, t1 - t0, tokens / gen_s / 1e6, t2 - t1);
    return 0;
}
