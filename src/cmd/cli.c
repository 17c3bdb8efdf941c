/* cli.c — flag parsing shared by all subcommands. */
#include "cmd/cli.h"

#include <stdio.h>
#include <string.h>

#include "base/common.h"
#include "centrifuge.h"
#include "cmd/runfiles.h"
#include "dist/launch.h"

int cf_parse_count(const char *s, long lo, long hi, const char *what, long *out) {
    char buf[64];
    size_t n = s ? strlen(s) : 0;
    if (n == 0 || n >= sizeof buf) return cf_parse_int(s, lo, hi, what, out);
    memcpy(buf, s, n + 1);
    long mult = 1;
    char last = buf[n - 1];
    if (last == 'k' || last == 'K') mult = 1000L;
    else if (last == 'M') mult = 1000000L;
    else if (last == 'G') mult = 1000000000L;
    if (mult > 1) buf[n - 1] = 0;
    long v;
    if (cf_parse_int(buf, 0, hi / mult, what, &v) != 0) {
        if (mult > 1) return cf_fail("%s: '%s' is not a count (examples: 1000, 50k, 2M)", what, cf_printable(s, buf, sizeof buf));
        return -1;
    }
    v *= mult;
    if (v < lo || v > hi) return cf_fail("%s: %ld is outside [%ld, %ld]", what, v, lo, hi);
    *out = v;
    return 0;
}

void cf_cli_print_help(const char *cmd, const char *usage, const cf_opt *opts, int nopts) {
    printf("usage: centrifuge %s %s\n\n", cmd, usage);
    for (int i = 0; i < nopts; i++) {
        const char *arg = opts[i].type == CF_OPT_FLAG ? "" : opts[i].type == CF_OPT_STR ? " X" : " N";
        printf("  %s%-*s %s\n", opts[i].name, (int)(22 - strlen(opts[i].name)), arg, opts[i].help);
    }
    printf("  --help%-18s this text\n", "");
}

int cf_cli_parse(const char *cmd, const char *usage, cf_opt *opts, int nopts, int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            cf_cli_print_help(cmd, usage, opts, nopts);
            return 1;
        }
        /* accept --name=value as well as --name value */
        char name[64];
        const char *val = NULL;
        const char *eq = strchr(a, '=');
        size_t nlen = eq ? (size_t)(eq - a) : strlen(a);
        if (nlen >= sizeof name) return cf_fail("unknown option '%.40s...' (see centrifuge %s --help)", a, cmd);
        memcpy(name, a, nlen);
        name[nlen] = 0;
        if (eq) val = eq + 1;
        cf_opt *o = NULL;
        for (int j = 0; j < nopts; j++)
            if (!strcmp(opts[j].name, name)) o = &opts[j];
        if (!o) {
            if (a[0] != '-' && i >= 2 && argv[i - 2][0] == '-' && strchr(a, '.'))
                return cf_fail("unexpected argument '%s' after %s %s: did the shell expand a pattern? quote it, "
                               "e.g. %s 'data/web_*.bin'", a, argv[i - 2], argv[i - 1], argv[i - 2]);
            if (a[0] != '-') return cf_fail("unexpected argument '%s' (see centrifuge %s --help)", a, cmd);
            return cf_fail("unknown option '%s' (see centrifuge %s --help)", name, cmd);
        }
        if (o->seen) return cf_fail("%s given twice", o->name);
        o->seen = 1;
        if (o->type == CF_OPT_FLAG) {
            if (val) return cf_fail("%s takes no value", o->name);
            *(int *)o->dst = 1;
            continue;
        }
        if (!val) {
            if (i + 1 >= argc) return cf_fail("%s needs a value", o->name);
            val = argv[++i];
        }
        switch (o->type) {
        case CF_OPT_STR:
            if (!*val) return cf_fail("%s: empty value", o->name);
            *(const char **)o->dst = val;
            break;
        case CF_OPT_INT:
            if (cf_parse_int(val, (long)o->lo, (long)o->hi, o->name, (long *)o->dst) != 0) return -1;
            break;
        case CF_OPT_COUNT:
            if (cf_parse_count(val, (long)o->lo, (long)o->hi, o->name, (long *)o->dst) != 0) return -1;
            break;
        case CF_OPT_FLOAT:
            if (cf_parse_float(val, o->lo, o->hi, o->name, (double *)o->dst) != 0) return -1;
            break;
        case CF_OPT_FLAG: break;
        }
    }
    return 0;
}

int cf_cli_check_model_flags(const char *config, const char *model_dir, const char *device) {
    if (config && model_dir) return cf_fail("give --config or --model, not both");
    cf_backend_kind kind;
    int dev = 0;
    return device ? cf_backend_parse(device, &kind, &dev) : 0;
}

int cf_opt_seen(const cf_opt *opts, int n, const char *name) {
    for (int i = 0; i < n; i++)
        if (!strcmp(opts[i].name, name)) return opts[i].seen;
    return 0;
}

int cf_cli_check_single_process(const char *cmd) {
    cf_launcher l;
    int rank, world;
    /* only the rank and world size: a stray rendezvous or local-rank variable
     * in the shell does not matter to one process */
    if (cf_dist_env_world(NULL, &l, &rank, &world) != 0) return -1;   /* cannot tell: the parser's line */
    if (world <= 1) return 0;
    const char *by = "srun", *size_var = "SLURM_STEP_NUM_TASKS";
    if (l == CF_LAUNCH_TORCHRUN) by = "torchrun", size_var = "WORLD_SIZE";
    else if (l == CF_LAUNCH_MPI) by = "mpirun", size_var = "OMPI_COMM_WORLD_SIZE";
    return cf_fail("started as rank %d of %d by %s (%s=%d); %s runs in one process: start it without a launcher, "
                   "or with one process", rank, world, by, size_var, world, cmd);
}

int cf_cli_check_tp(int tp) {
    if (tp <= 1) return 0;
    cf_launcher l;
    int rank, world;
    if (cf_dist_env_world(NULL, &l, &rank, &world) != 0) return 0;   /* a bad environment: train reports it */
    return cf_dist_check_tp(tp, world, l);
}

int cf_cli_error(const char *cmd, int code) {
    fprintf(stderr, "centrifuge %s: error: %s\n", cmd, cf_last_error());
    return code;
}

/* --config/--model/--device/--seed/--freeze/--adapter to a model; a run
 * directory (as --model or --adapter) stands for its newest checkpoint. */
static cf_model *open_model(const char *config, const char *model_dir, const char *device, uint64_t seed,
                            const char *freeze, const char *adapter) {
    cf_model_opts o = {0};
    if (cf_backend_parse(device, &o.backend, &o.device) != 0) return NULL;
    char ckpt[4096], actk[4096];
    if (model_dir && !(model_dir = cf_resolve_model_dir(model_dir, ckpt, sizeof ckpt))) return NULL;
    if (adapter && !(adapter = cf_resolve_model_dir(adapter, actk, sizeof actk))) return NULL;
    o.config = config;
    o.model_dir = model_dir;
    o.seed = seed;
    o.freeze = freeze;
    o.adapter_dir = adapter;
    return cf_model_open(&o);
}

cf_model *cf_cli_open_model(const char *config, const char *model_dir, const char *device, uint64_t seed,
                            const char *freeze) {
    return open_model(config, model_dir, device, seed, freeze, NULL);
}

cf_model *cf_cli_open_model_adapter(const char *config, const char *model_dir, const char *device, uint64_t seed,
                                    const char *adapter) {
    return open_model(config, model_dir, device, seed, NULL, adapter);
}

