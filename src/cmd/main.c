/* main.c — the `centrifuge` command line: dispatch to the subcommands. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "centrifuge.h"
#include "cmd/commands.h"

static const struct {
    const char *name;
    int (*fn)(int, char **);
    const char *what;
} COMMANDS[] = {
    {"demo", cmd_demo, "the whole pipeline on a synthetic math world, in about 75 s on 2 cores"},
    {"train", cmd_train, "train a model (regular, loss-only, centrifuge, centrifuge-kv, strawman; LoRA; data parallel)"},
    {"score", cmd_score, "reference-model losses for a token shard"},
    {"eval", cmd_eval, "mean loss and perplexity over a token shard"},
    {"generate", cmd_generate, "greedy or sampled decoding from a prompt"},
    {"bench", cmd_bench, "time forward, filter, backward and step per mode"},
    {"gen-data", cmd_gen_data, "write the synthetic corpus as token shards"},
    {"convert", cmd_convert, "rewrite a model as bf16 or fp32, optionally sharded"},
    {"math-eval", cmd_math_eval, "answer accuracy of a model of the synthetic math world"},
    {"tokenize", cmd_tokenize, "text or JSONL to token shards with a HF tokenizer.json"},
};
#define NCOMMANDS (int)(sizeof COMMANDS / sizeof *COMMANDS)

static void usage(FILE *f) {
    fprintf(f, "centrifuge %s — token-filtered training of Llama-family models\n\n"
               "usage: centrifuge <command> [options]   (centrifuge <command> --help)\n\n", CF_VERSION);
    for (int i = 0; i < NCOMMANDS; i++) fprintf(f, "  %-10s %s\n", COMMANDS[i].name, COMMANDS[i].what);
}

/* OpenMP threads that wait at a barrier spin by default (libgomp: about
 * 300000 polls before sleeping). On a machine where another process wants
 * the cores, the spinning threads take the CPU from the threads doing the
 * work: 30 steps of the tiny model took 8.5 s instead of 1.1 s beside one
 * busy loop on 2 cores (docs/BENCHMARKS.md, "The CPU under load"). Passive
 * waiting (sleep at once) costs little when the machine is idle and does not
 * collapse when it is shared. libgomp reads OMP_WAIT_POLICY when it is
 * loaded, before main(), so the setting takes a re-exec of this binary with
 * the variable set. A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT is left
 * alone (no re-exec), as is CF_NO_REEXEC=1. */
static void passive_openmp(char **argv) {
    if (getenv("OMP_WAIT_POLICY") || getenv("GOMP_SPINCOUNT") || getenv("CF_NO_REEXEC")) return;
    if (setenv("OMP_WAIT_POLICY", "passive", 1) != 0) return;
    execv("/proc/self/exe", argv);
    /* no /proc (or exec refused): run on with the runtime's default */
    unsetenv("OMP_WAIT_POLICY");
}

int main(int argc, char **argv) {
    passive_openmp(argv);
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
