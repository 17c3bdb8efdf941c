/*
 * train_tiny.c — the library through its public header only: make a token
 * shard, train a tiny Llama for a few steps with token filtering
 * (centrifuge mode, the half of each sequence with the highest loss), save
 * it as a HF model directory, load it back and evaluate it.
 *
 *   cc train_tiny.c $(pkg-config --cflags --libs centrifuge) -o train_tiny
 *   ./train_tiny [steps]
 */
#define _POSIX_C_SOURCE 200809L   /* mkdtemp */
#include <centrifuge.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(const char *what) {
    fprintf(stderr, "train_tiny: %s: %s\n", what, cf_last_error());
    return 1;
}

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 20;
    enum { B = 4, S = 64, N = 40000 };

    /* 1. data: a shard of a repeating pattern with noise, so the loss falls */
    char dir[] = "/tmp/centrifuge_example_XXXXXX";
    if (!mkdtemp(dir)) { perror("mkdtemp"); return 1; }
    char shard[256], model_dir[256];
    snprintf(shard, sizeof shard, "%s/data.bin", dir);
    snprintf(model_dir, sizeof model_dir, "%s/model", dir);
    uint32_t *ids = malloc(N * sizeof *ids);
    if (!ids) return 1;
    uint64_t x = 88172645463325252ull;
    for (int i = 0; i < N; i++) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        ids[i] = (x % 10 == 0) ? (uint32_t)(x >> 32) % 256 : (uint32_t)('a' + i % 7);
    }
    if (cf_tokens_write(shard, ids, N, 0) != 0) return fail("write shard");
    free(ids);
    cf_tokens tok;
    if (cf_tokens_open(&tok, shard, 0) != 0) return fail("open shard");

    /* 2. a fresh tiny model on the CPU */
    cf_model_opts mo = {0};
    mo.config = "tiny";
    mo.backend = CF_BACKEND_CPU;
    mo.seed = 1;
    cf_model *m = cf_model_open(&mo);
    if (!m) return fail("open model");

    /* 3. the training step of the library: centrifuge, keep 0.5, self selection */
    cf_train_opts o = {0};
    o.mode = CF_MODE_CENTRIFUGE;
    o.select.kind = CF_SELECT_SELF;
    o.select.keep = 0.5;
    o.batch = B;
    o.seq = S;
    o.grad_accum = 2;
    o.adamw = (cf_adamw_params){3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f};
    cf_trainer *tr = cf_trainer_create(m, &o);
    if (!tr) return fail("trainer");
    cf_loader ld;
    if (cf_loader_init(&ld, &tok, NULL, B, S) != 0) return fail("loader");
    int32_t *batch = malloc(sizeof(int32_t) * 2 * B * (S + 1));
    cf_micro_batch mb[2] = {{batch, NULL}, {batch + B * (S + 1), NULL}};
    double first = 0, last = 0;
    for (int step = 0; step < steps; step++) {
        cf_loader_next(&ld, (int32_t *)mb[0].tokens, NULL);
        cf_loader_next(&ld, (int32_t *)mb[1].tokens, NULL);
        cf_step_stats st;
        if (cf_trainer_step(tr, mb, cf_lr_schedule(step, 2, steps, 3e-3f, 3e-4f), &st) != 0) return fail("step");
        if (step == 0) first = st.loss;
        last = st.loss;
        if (step % 5 == 0 || step == steps - 1)
            printf("step %3d  loss %.4f  kept %lld of %lld tokens  grad norm %.3f\n", step + 1, st.loss,
                   (long long)st.kept, (long long)st.tokens, st.grad_norm);
    }
    free(batch);
    cf_trainer_free(tr);

    /* 4. save as a HF directory, load back, evaluate */
    if (cf_model_save(m, model_dir, "float32", 0) != 0) return fail("save");
    cf_model_free(m);
    cf_model *m2 = cf_model_load(model_dir, CF_BACKEND_CPU);
    if (!m2) return fail("load");
    double mean;
    int64_t n;
    if (cf_evaluate(m2, &tok, B, S, 4, &mean, &n, NULL) != 0) return fail("evaluate");
    printf("evaluated %lld tokens of the reloaded model: loss %.4f\n", (long long)n, mean);
    cf_model_free(m2);
    cf_tokens_close(&tok);

    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) return 1;
    if (!(last < first)) {
        fprintf(stderr, "train_tiny: the loss did not fall (%.4f -> %.4f)\n", first, last);
        return 1;
    }
    return 0;
}
