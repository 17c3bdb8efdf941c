/*
 * cli.h — declarative flag parsing for the subcommands. Each subcommand
 * lists its options in a table; cf_cli_parse fills them, rejecting unknown
 * flags, missing values and out-of-range numbers with one clear line.
 */
#ifndef CF_CLI_H
#define CF_CLI_H

#include <stdint.h>

typedef enum { CF_OPT_STR, CF_OPT_INT, CF_OPT_FLOAT, CF_OPT_FLAG, CF_OPT_COUNT } cf_opt_type;

typedef struct {
    const char *name;       /* "--keep" */
    cf_opt_type type;
    void *dst;              /* const char **, long *, double *, int * */
    double lo, hi;          /* bounds for INT / FLOAT / COUNT */
    const char *help;
    int seen;               /* set by the parser */
} cf_opt;

/* Parses argv[1..argc) (argv[0] is the subcommand). Returns 0 on success,
 * 1 if --help was printed, -1 on error (cf_last_error has the message). */
int cf_cli_parse(const char *cmd, const char *usage, cf_opt *opts, int nopts, int argc, char **argv);
void cf_cli_print_help(const char *cmd, const char *usage, const cf_opt *opts, int nopts);
/* Parses a count with optional k/M/G suffix (powers of 1000). */
int cf_parse_count(const char *s, long lo, long hi, const char *what, long *out);

/* The model and device flags, before any work: an unknown --device, or
 * both --config and --model, is a usage error (exit 2), not a run-time one.
 * config/device may be NULL (the command has no such flag). 0 or -1. */
int cf_cli_check_model_flags(const char *config, const char *model_dir, const char *device);

/* Whether the option called name was given on the command line. */
int cf_opt_seen(const cf_opt *opts, int n, const char *name);

/* Every command but train runs in one process: started by a launcher
 * (torchrun, srun, mpirun) with a world size above 1, each rank would do the
 * whole work and write the same outputs. -1 then ("started as rank 1 of 2 by
 * torchrun (WORLD_SIZE=2); eval runs in one process: ..."), and -1 with the
 * launch parser's line when the rank and size variables contradict each
 * other; 0 for no launcher or a world of one. Local-rank and rendezvous
 * variables are not read (cf_dist_env_world). Called right after the flags
 * are parsed; a usage error (exit 2). */
int cf_cli_check_single_process(const char *cmd);

/* train --tp against the launch, before anything is read: tp > 1 needs a
 * launcher with a world size that tp divides (cf_dist_check_tp's line). A
 * launch environment that cannot be read passes here (train's data-parallel
 * setup reports it, a run-time error). 0 or -1; a usage error (exit 2). */
int cf_cli_check_tp(int tp);

/* Prints "centrifuge <cmd>: error: <last error>" to stderr; returns code. */
int cf_cli_error(const char *cmd, int code);

/* Opens the model that --config/--model/--device/--seed/--freeze name
 * (config and model_dir exclusive; neither: the built-in "tiny"). */
struct cf_model;
struct cf_model *cf_cli_open_model(const char *config, const char *model_dir, const char *device, uint64_t seed,
                                   const char *freeze);
/* The same with a PEFT LoRA adapter directory (or a LoRA run directory:
 * its newest checkpoint) on top; adapter NULL = none. */
struct cf_model *cf_cli_open_model_adapter(const char *config, const char *model_dir, const char *device,
                                           uint64_t seed, const char *adapter);

#endif
