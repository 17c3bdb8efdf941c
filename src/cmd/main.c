/* main.c — the `centrifuge` command line: dispatch to the subcommands. */
#include <stdio.h>
#include <string.h>

#include "centrifuge.h"
#include "cmd/commands.h"

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *what;
} COMMANDS[] = {
    {"demo", cmd_demo, "the whole pipeline on a synthetic math world, in about 90 s on 2 cores"},
    {"train", cmd_train, "train a model (regular, loss-only, centrifuge, strawman)"},
    {"score", cmd_score, "reference-model losses for a token shard"},
    {"eval", cmd_eval, "mean loss and perplexity over a token shard"},
    {"generate", cmd_generate, "greedy or sampled decoding from a prompt"},
    {"bench", cmd_bench, "time forward, filter, backward and step per mode"},
    {"gen-data", cmd_gen_data, "write the synthetic corpus as token shards"},
    {"convert", cmd_convert, "rewrite a model as bf16 or fp32, optionally sharded"},
    {"math-eval", cmd_math_eval, "answer accuracy of a model of the synthetic math world"},
};
#define NCOMMANDS (int)(sizeof COMMANDS / sizeof *COMMANDS)

static void usage(FILE *f) {
    fprintf(f, "centrifuge %s — token-filtered training of Llama-family models\n\n"
               "usage: centrifuge <command> [options]   (centrifuge <command> --help)\n\n", CF_VERSION);
    for (int i = 0; i < NCOMMANDS; i++) fprintf(f, "  %-10s %s\n", COMMANDS[i].name, COMMANDS[i].what);
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "--version")) { printf("centrifuge %s\n", CF_VERSION); return 0; }
    for (int i = 0; i < NCOMMANDS; i++)
        if (!strcmp(argv[1], COMMANDS[i].name)) return COMMANDS[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "centrifuge: error: unknown command '%s' (see centrifuge --help)\n", argv[1]);
    return 2;
}
