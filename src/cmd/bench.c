/*
 * bench.c — `centrifuge bench`: per-stage timings of a training step in each
 * mode (forward, filter operator, backward, optimizer, step), as a table and
 * as JSON lines, with sweeps over --keep and --seq.
 *
 * Method (docs/BENCHMARKS.md): all modes in one process on the same weights
 * and data, their steps interleaved round by round; `--warmup` untimed
 * rounds, then the median of `--steps` timed steps per stage and mode. Selection is random by default (the speed of the
 * backward does not depend on which tokens are kept, only how many).
 * A step is one optimizer step over --grad-accum micro-batches of --batch
 * sequences (cf_trainer_step): its stage times are sums over the
 * micro-batches. MFU counts the FLOPs of a dense step
 * (cf_config_train_flops_per_token) in every mode, so for the filtered
 * modes it is a dense-equivalent MFU: the rate at which they get through
 * the tokens, not the FLOPs they actually do.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmd/cli.h"
#include "cmd/commands.h"
#include "base/common.h"
#include "centrifuge.h"

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Splits a comma list into at most cap items (in place); -1 (cf_fail) if it
 * holds more, or an empty item: either would change the benchmark without a
 * word. */
static int split_list(const char *flag, char *s, char **items, int cap) {
    if (cf_list_check(flag, s) != 0) return -1;
    int n = 0;
    for (char *tok = strtok(s, ","); tok; tok = strtok(NULL, ",")) {
        if (n == cap) return cf_fail("%s: more than %d values in the list", flag, cap);
        items[n++] = tok;
    }
    return n;
}

typedef struct { double fwd, filter, bwd, opt, step; } stage_times;

static cf_trainer *make_trainer(cf_model *m, cf_mode mode, int A, int B, int S, double keep, cf_select_kind sel,
                               uint64_t seed) {
    cf_train_opts o = {0};
    o.mode = mode;
    o.select.kind = sel;
    o.select.keep = keep;
    o.select.seed = seed;
    o.batch = B;
    o.seq = S;
    o.grad_accum = A;
    /* lr 0: the weights stay the same across modes, only the time counts */
    o.adamw = (cf_adamw_params){0.0f, 0.9f, 0.95f, 1e-8f, 0.0f, 1.0f};
    return cf_trainer_create(m, &o);
}

/* One extra step of one micro-batch (A only labels the output) with
 * per-op-category timing, after an untimed one in the same configuration:
 * a profiled step runs every op in line (no side sections: dwside.c,
 * dwpair.c), so it uses GEMM plans the timed steps never did (the side
 * sections' are planned for fewer SMs: cuda/gemm.cu side_sms), and plans
 * are chosen, by timing, at first use. Profiling is on for the untimed
 * step too (each forward restarts the counts), so that choosing them is
 * not charged to the profiled step's GEMMs (BENCHMARKS.md run 35). */
static void print_profile(cf_model *m, cf_mode mode, int A, int B, int S, double keep, cf_select_kind sel, uint64_t seed) {
    int V = cf_model_config(m)->vocab_size;
    int32_t *tokens = cf_malloc((size_t)B * (S + 1) * sizeof(int32_t));
    cf_trainer *tr = make_trainer(m, mode, 1, B, S, keep, sel, seed);
    if (!tokens || !tr) { free(tokens); cf_trainer_free(tr); return; }
    cf_rng rng;
    cf_rng_seed(&rng, seed);
    for (int i = 0; i < B * (S + 1); i++) tokens[i] = (int32_t)cf_rng_below(&rng, (uint32_t)V);
    cf_micro_batch mb = {tokens, NULL};
    cf_step_stats st;
    cf_model_set_profile(m, 1);
    int rc = cf_trainer_step(tr, &mb, 0.0f, &st);
    if (rc == 0 && cf_trainer_step(tr, &mb, 0.0f, &st) == 0) {
        double prof[2][CF_PROF_N];
        cf_model_profile(m, prof);
        printf("      profile %-11s", cf_mode_name(mode));
        double sum[2] = {0, 0};
        for (int c = 0; c < CF_PROF_N; c++) {
            printf(" %s %.2f/%.2f", cf_prof_name(c), prof[0][c] * 1e3, prof[1][c] * 1e3);
            sum[0] += prof[0][c];
            sum[1] += prof[1][c];
        }
        /* other: the stage's time outside every op's marks, i.e. the GPU
         * waiting for the host to launch (an op's mark is recorded just
         * before it, so such a gap is charged to no op) plus the few ops
         * outside the categories: an upper bound of what fewer launches
         * (CUDA graphs) could save */
        printf(" other %.2f/%.2f", (st.t.forward - sum[0]) * 1e3, (st.t.backward - sum[1]) * 1e3);
        printf("  (ms fwd/bwd%s)\n", A > 1 ? ", one micro-batch" : "");
    }
    cf_model_set_profile(m, 0);
    cf_trainer_free(tr);
    free(tokens);
}

/* Runs warmup + steps training steps of every mode, interleaved (one step
 * of each mode per round), so slow drifts of the machine (clocks, other
 * load) hit all modes alike; per-stage medians into out[mode]. A step is
 * A micro-batches of B x S tokens (different tokens in each) and one
 * optimizer update; kept_out is the kept count of the whole step. */
static int bench_point(cf_model *m, const cf_mode *modes, int nm, int A, int B, int S, double keep,
                       cf_select_kind sel, int warmup, int steps, uint64_t seed, stage_times *out, int64_t *kept_out) {
    int V = cf_model_config(m)->vocab_size;
    size_t per_mb = (size_t)B * (S + 1);
    int32_t *tokens = cf_malloc((size_t)A * per_mb * sizeof(int32_t));
    cf_micro_batch *mb = cf_calloc((size_t)A, sizeof *mb);
    double *v = cf_malloc(5 * (size_t)steps * nm * sizeof(double));
    cf_trainer *tr[8] = {0};
    int rc = tokens && mb && v ? 0 : -1;
    for (int mi = 0; mi < nm && rc == 0; mi++)
        if (!(tr[mi] = make_trainer(m, modes[mi], A, B, S, keep, sel, seed))) rc = -1;
    if (rc == 0) {
        cf_rng rng;
        cf_rng_seed(&rng, seed);
        for (size_t i = 0; i < (size_t)A * per_mb; i++) tokens[i] = (int32_t)cf_rng_below(&rng, (uint32_t)V);
        for (int a = 0; a < A; a++) mb[a] = (cf_micro_batch){tokens + (size_t)a * per_mb, NULL};
    }
    for (int it = 0; it < warmup + steps && rc == 0; it++) {
        for (int mi = 0; mi < nm && rc == 0; mi++) {
            cf_step_stats st;
            double t0 = cf_now();
            if (cf_trainer_step(tr[mi], mb, 0.0f, &st) != 0) { rc = -1; break; }
            double step = cf_now() - t0;
            kept_out[mi] = st.kept;
            if (it >= warmup) {
                double *vm = v + (size_t)mi * 5 * steps;
                int k = it - warmup;
                vm[k] = st.t.forward; vm[steps + k] = st.t.filter; vm[2 * steps + k] = st.t.backward;
                vm[3 * steps + k] = st.t.optimizer; vm[4 * steps + k] = step;
            }
        }
    }
    for (int mi = 0; rc == 0 && mi < nm; mi++) {
        double *vm = v + (size_t)mi * 5 * steps;
        out[mi].fwd = median(vm, steps);
        out[mi].filter = median(vm + steps, steps);
        out[mi].bwd = median(vm + 2 * steps, steps);
        out[mi].opt = median(vm + 3 * steps, steps);
        out[mi].step = median(vm + 4 * steps, steps);
    }
    for (int mi = 0; mi < nm; mi++) cf_trainer_free(tr[mi]);
    free(tokens); free(mb); free(v);
    return rc;
}

int cmd_bench(int argc, char **argv) {
    const char *config = "cpu-20m", *model_dir = NULL, *device = "cpu", *modes_s = "regular,loss-only,centrifuge";
    const char *lora_targets = "q,k,v,o";
    long lora_rank = 0, layers = 0;
    double lora_alpha = -1;
    const char *keeps_s = "0.5", *seqs_s = "512", *json = NULL, *select_s = "random";
    long batch = 1, grad_accum = 1, steps = 10, warmup = 2, seed = 1;
    int profile = 0;
    double peak_tflops = -1;
    cf_opt opts[] = {
        {"--config", CF_OPT_STR, &config, 0, 0, "built-in name or config.json (default cpu-20m)", 0},
        {"--model", CF_OPT_STR, &model_dir, 0, 0, "or a model directory", 0},
        {"--device", CF_OPT_STR, &device, 0, 0, "cpu or cuda", 0},
        {"--modes", CF_OPT_STR, &modes_s, 0, 0, "comma list (default regular,loss-only,centrifuge)", 0},
        {"--keep", CF_OPT_STR, &keeps_s, 0, 0, "comma list of keep fractions (default 0.5)", 0},
        {"--seq", CF_OPT_STR, &seqs_s, 0, 0, "comma list of sequence lengths (default 512)", 0},
        {"--batch", CF_OPT_INT, &batch, 1, 65536, "sequences per micro-batch (default 1)", 0},
        {"--grad-accum", CF_OPT_INT, &grad_accum, 1, 65536,
         "micro-batches per optimizer step (default 1); times are per step", 0},
        {"--steps", CF_OPT_INT, &steps, 1, 100000, "timed steps per point (default 10)", 0},
        {"--warmup", CF_OPT_INT, &warmup, 0, 100000, "untimed steps first (default 2)", 0},
        {"--select", CF_OPT_STR, &select_s, 0, 0, "random (default) or self", 0},
        {"--json", CF_OPT_STR, &json, 0, 0, "write JSON lines here", 0},
        {"--seed", CF_OPT_INT, &seed, 0, 1L << 62, "seed", 0},
        {"--profile", CF_OPT_FLAG, &profile, 0, 0, "also print time per op category (one extra step, every op in line)", 0},
        {"--layers", CF_OPT_INT, &layers, 1, 4096, "with --config: only its first N layers", 0},
        {"--lora-rank", CF_OPT_INT, &lora_rank, 1, 4096, "LoRA adapters of this rank (base frozen)", 0},
        {"--lora-alpha", CF_OPT_FLOAT, &lora_alpha, 1e-6, 1e6, "LoRA alpha (default: the rank)", 0},
        {"--lora-targets", CF_OPT_STR, &lora_targets, 0, 0, "LoRA modules (default q,k,v,o)", 0},
        {"--peak-tflops", CF_OPT_FLOAT, &peak_tflops, 0, 1e6,
         "peak TFLOP/s for MFU (default 989 on cuda: H100/H200 dense bf16; on cpu MFU only with this flag; 0: no MFU)", 0},
    };
    int nopts = (int)(sizeof opts / sizeof *opts);
    int pr = cf_cli_parse("bench", "[--config NAME] [--seq 512,1024] [--keep 0.5,0.4] [options]\n\n"
                          "Per-stage step timings per mode (median of --steps after --warmup). A step is one\n"
                          "optimizer update over --grad-accum micro-batches of --batch sequences; stage times\n"
                          "are summed over its micro-batches.\n"
                          "MFU = model FLOPs / step time / peak, with FLOPs per token 6N + 6*L*S*H (N: all\n"
                          "parameters but the input embedding, L layers, S sequence length, H hidden size),\n"
                          "counted for every token of the step: for the filtered modes this is a\n"
                          "dense-equivalent MFU (the FLOPs a dense step would do on the same tokens).",
                          opts, nopts, argc, argv);
    if (pr == 1) return 0;
    if (pr < 0) return cf_cli_error("bench", 2);
    if (cf_cli_check_single_process("bench") != 0) return cf_cli_error("bench", 2);
    /* --config has a default; given with --model, one of them would be ignored */
    if (cf_cli_check_model_flags(opts[0].seen ? config : NULL, opts[1].seen ? model_dir : NULL, device) != 0)
        return cf_cli_error("bench", 2);
    if (opts[1].seen) config = NULL;
    /* usage errors, as in train (the model would refuse --layers only once
     * it opens, and LoRA options without a rank were ignored) */
    if (layers && model_dir) {
        cf_fail("--layers cuts a --config's layers; a --model directory keeps its own");
        return cf_cli_error("bench", 2);
    }
    int lora_opts_seen = 0;
    for (int i = 0; i < nopts; i++)
        if (opts[i].seen && (!strcmp(opts[i].name, "--lora-alpha") || !strcmp(opts[i].name, "--lora-targets")))
            lora_opts_seen = 1;
    if (lora_opts_seen && lora_rank == 0) { cf_fail("LoRA options need --lora-rank"); return cf_cli_error("bench", 2); }
    unsigned lora_mask = 0;
    if (lora_rank > 0 && cf_lora_parse_targets(lora_targets, &lora_mask) != 0) return cf_cli_error("bench", 2);

    char mbuf[256], kbuf[256], sbuf[256];
    char *mitems[8], *kitems[16], *sitems[16];
    if (strlen(modes_s) >= sizeof mbuf || strlen(keeps_s) >= sizeof kbuf || strlen(seqs_s) >= sizeof sbuf) {
        cf_fail("--modes, --keep or --seq: a list of more than %zu characters", sizeof mbuf - 1);
        return cf_cli_error("bench", 2);
    }
    snprintf(mbuf, sizeof mbuf, "%s", modes_s);
    snprintf(kbuf, sizeof kbuf, "%s", keeps_s);
    snprintf(sbuf, sizeof sbuf, "%s", seqs_s);
    int nm = split_list("--modes", mbuf, mitems, 8), nk = split_list("--keep", kbuf, kitems, 16),
        ns = split_list("--seq", sbuf, sitems, 16);
    if (nm < 0 || nk < 0 || ns < 0) return cf_cli_error("bench", 2);
    cf_mode modes[8];
    double keeps[16];
    long seqs[16];
    cf_select_kind sel;
    if (cf_select_parse(select_s, &sel) != 0 || sel == CF_SELECT_REF) {
        if (sel == CF_SELECT_REF) cf_fail("--select: bench supports random or self");
        return cf_cli_error("bench", 2);
    }
    for (int i = 0; i < nm; i++) if (cf_mode_parse(mitems[i], &modes[i]) != 0) return cf_cli_error("bench", 2);
    for (int i = 0; i < nk; i++) if (cf_parse_float(kitems[i], 1e-6, 1.0, "--keep", &keeps[i]) != 0) return cf_cli_error("bench", 2);
    for (int i = 0; i < ns; i++) if (cf_parse_int(sitems[i], 1, 1 << 20, "--seq", &seqs[i]) != 0) return cf_cli_error("bench", 2);
    if (nm == 0 || nk == 0 || ns == 0) { cf_fail("empty --modes, --keep or --seq list"); return cf_cli_error("bench", 2); }

    {   /* the memory estimate of the largest point, before anything is allocated */
        cf_model_opts mo = {0};
        cf_memory_opts mem = {0};
        if (cf_backend_parse(device, &mo.backend, &mo.device) != 0) return cf_cli_error("bench", 2);
        mo.config = config;
        mo.model_dir = model_dir;
        mo.layers = (int)layers;
        mem.batch = batch;
        mem.grad_accum = grad_accum;
        mem.train = 1;
        for (int i = 0; i < ns; i++) mem.seq = seqs[i] > mem.seq ? seqs[i] : mem.seq;
        for (int i = 0; i < nm; i++) mem.compact |= cf_mode_is_compact(modes[i]);
        for (int i = 0; i < nk; i++) mem.keep = keeps[i] > mem.keep ? keeps[i] : mem.keep;
        if (cf_memory_check(&mo, &mem, NULL) != 0) return cf_cli_error("bench", 1);
    }
    cf_model_opts mo = {0};
    if (cf_backend_parse(device, &mo.backend, &mo.device) != 0) return cf_cli_error("bench", 2);
    mo.config = config;
    mo.model_dir = model_dir;
    mo.layers = (int)layers;
    mo.seed = (uint64_t)seed;
    if (lora_rank > 0) {
        mo.lora.rank = (int)lora_rank;
        mo.lora.alpha = lora_alpha > 0 ? (float)lora_alpha : (float)lora_rank;
        mo.lora.targets = lora_mask;
    }
    cf_model *m = cf_model_open(&mo);
    if (!m) return cf_cli_error("bench", 1);
    FILE *jf = NULL;
    if (json && !(jf = cf_output_stream(json, 0))) { cf_model_free(m); return cf_cli_error("bench", 1); }
    const cf_config *c = cf_model_config(m);
    if (peak_tflops < 0) peak_tflops = mo.backend == CF_BACKEND_CUDA ? 989.0 : 0.0;
    char cut[48] = "";
    if (layers) snprintf(cut, sizeof cut, " (first %d layers)", c->num_hidden_layers);
    printf("bench: %s%s, %.1fM params, device %s, batch %ld, median of %ld steps after %ld warm-up\n",
           config ? config : model_dir, cut, cf_model_num_params(m) / 1e6, device, batch, steps, warmup);
    if (grad_accum > 1)
        printf("       grad-accum %ld: a step is %ld micro-batches of %ld sequences and one optimizer update; "
               "stage times summed over them\n", grad_accum, grad_accum, batch);
    if (peak_tflops > 0)   /* at S = 0 only the 6N term is left */
        printf("       MFU against %g TFLOP/s, FLOPs per token 6N + 6*L*S*H (N = %.1fM); dense-equivalent "
               "for filtered modes%s\n", peak_tflops, cf_config_train_flops_per_token(c, 0) / 6 / 1e6,
               lora_rank > 0 ? "; with LoRA still the FLOPs of full fine-tuning" : "");
    printf("%6s %5s %-11s %8s %9s %9s %9s %9s %9s %8s %8s\n", "seq", "keep", "mode", "kept", "fwd ms",
           "filter ms", "bwd ms", "opt ms", "step ms", "bwd/reg", "step/reg");
    int rc = 0;
    for (int si = 0; si < ns && rc == 0; si++) {
        for (int ki = 0; ki < nk && rc == 0; ki++) {
            stage_times reg = {0}, all[8];
            int64_t kepts[8];
            if (bench_point(m, modes, nm, (int)grad_accum, (int)batch, (int)seqs[si], keeps[ki], sel, (int)warmup,
                            (int)steps, (uint64_t)seed, all, kepts) != 0) { rc = 1; break; }
            double flops_tok = cf_config_train_flops_per_token(c, (int)seqs[si]);
            for (int mi = 0; mi < nm; mi++)
                if (modes[mi] == CF_MODE_REGULAR) reg = all[mi];
            for (int mi = 0; mi < nm && rc == 0; mi++) {
                stage_times st = all[mi];
                int64_t kept = kepts[mi];
                double T = (double)grad_accum * batch * seqs[si];   /* tokens per optimizer step */
                printf("%6ld %5.2f %-11s %8lld %9.2f %9.3f %9.2f %9.2f %9.2f", seqs[si], keeps[ki],
                       cf_mode_name(modes[mi]), (long long)kept, st.fwd * 1e3, st.filter * 1e3, st.bwd * 1e3,
                       st.opt * 1e3, st.step * 1e3);
                if (reg.step > 0) printf(" %8.3f %8.3f", st.bwd / reg.bwd, st.step / reg.step);
                else printf(" %8s %8s", "-", "-");
                /* model FLOP/s of a dense step on the same tokens, in every mode */
                double model_flops = flops_tok * T / st.step;
                double mfu = peak_tflops > 0 ? model_flops / (peak_tflops * 1e12) : 0;
                size_t peak = cf_model_memory_peak(m);
                printf(" %9.0f tok/s", T / st.step);
                if (mfu > 0) printf(" MFU %.1f%%", 100 * mfu);
                if (peak) printf(" peak %.2f GiB", peak / 1073741824.0);
                printf("\n");
                fflush(stdout);
                if (profile) print_profile(m, modes[mi], (int)grad_accum, (int)batch, (int)seqs[si], keeps[ki], sel, (uint64_t)seed);
                if (jf) {
                    fprintf(jf, "{\"model\":\"%s\",\"params\":%zu,\"device\":\"%s\",\"batch\":%ld,\"seq\":%ld,"
                                "\"keep\":%.4f,\"mode\":\"%s\",\"kept\":%lld,\"forward_s\":%.6f,\"filter_s\":%.6f,"
                                "\"backward_s\":%.6f,\"optimizer_s\":%.6f,\"step_s\":%.6f,\"tokens_per_s\":%.1f,"
                                "\"s_per_1M_tokens\":%.4f,\"layers\":%d,\"steps\":%ld,\"mfu\":%.4f,\"peak_bytes\":%zu,"
                                "\"gpu\":\"%s\",\"commit\":\"%s\",\"world_size\":1,\"tp\":1,\"lora_rank\":%ld,"
                                "\"grad_accum\":%ld,\"tokens_per_step\":%.0f,\"flops_per_token\":%.6g,"
                                "\"model_tflops\":%.4f,\"peak_tflops\":%.1f,\"mfu_kind\":\"%s\"}\n",
                            config ? config : model_dir, cf_model_num_params(m), device, batch, seqs[si],
                            keeps[ki], cf_mode_name(modes[mi]), (long long)kept, st.fwd, st.filter, st.bwd, st.opt,
                            st.step, T / st.step, st.step / T * 1e6, c->num_hidden_layers, steps, mfu, peak,
                            cf_model_device_name(m), cf_build_commit(), lora_rank, grad_accum, T, flops_tok,
                            model_flops / 1e12, peak_tflops > 0 ? peak_tflops : 0.0,
                            modes[mi] == CF_MODE_REGULAR ? "dense" : "dense-equivalent");
                    fflush(jf);
                }
            }
        }
    }
    if (jf && cf_stream_close(jf, json) != 0 && rc == 0) rc = 1;
    cf_model_free(m);
    return rc ? cf_cli_error("bench", 1) : 0;
}
