/*
 * test_tp_model.c — tensor parallelism (Megatron-style) on the CPU: TP=2
 * ranks as threads (tests/tp_threads.h) against the one-process model with
 * the same weights, for every model_type and mode:
 *   - every rank's per-token losses equal the one-process losses (and are
 *     bitwise equal across ranks, so selection agrees);
 *   - every rank's gradient of every tensor equals its slice of the
 *     one-process gradient (per-tensor relative L2), q/k norms after the
 *     group sum;
 *   - after an optimizer step (global-norm clipping active) every rank's
 *     weights equal their slice of the one-process weights;
 *   - the backward all-reduces carry n x C per call: half the payload at
 *     keep 0.5 in the compact modes;
 *   - the saved model (gathered to the HF layout) holds every rank's slices.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dist/tp_plan.h"
#include "model_helpers.h"
#include "tp_threads.h"

enum { B = 2, S = 24, T = B * S, P = 2 };

typedef struct {
    const char *name;       /* builtin */
    int vocab;              /* override (0: keep) — odd: vocabulary padding */
    int o_bias;
} tp_case;

typedef struct {
    /* inputs */
    tpt_rank r;
    const char *dir;
    cf_mode mode;
    const int32_t *tokens;
    const uint8_t *mask;
    /* outputs */
    int ok;
    char err[512];
    float losses[T];
    float *grads;           /* packed local gradients (after the q/k-norm sum) */
    float *weights;         /* packed local weights after one step */
    float norm;
    int64_t bwd_bytes;
    cf_model *m;
} rank_job;

static const cf_adamw_params HP = {1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.05f};

static float *pack(cf_model *m, int grads) {
    float *g = calloc(cf_model_num_params(m) + 1, sizeof(float));
    for (int i = 0; i < cf_model_num_tensors(m); i++) {
        if (grads) CHECK(cf_model_get_grad(m, i, g + toff(m, i)) == 0);
        else CHECK(cf_model_get_param(m, i, g + toff(m, i)) == 0);
    }
    return g;
}

/* One forward, backward and step; records what the test compares. */
static int run_model(cf_model *m, rank_job *j) {
    if (cf_forward(m, j->tokens, B, S, j->losses) != 0) return -1;
    cf_kept kept;
    if (j->mode != CF_MODE_REGULAR && cf_kept_from_mask(m, j->mask, &kept) != 0) return -1;
    cf_zero_grad(m);
    float loss;
    if (cf_backward(m, j->mode, j->mode == CF_MODE_REGULAR ? NULL : &kept, 1.0f, &loss) != 0) return -1;
    /* the q/k norm gradient sum happens in the step: do it here too, so the
     * gradients compared are the whole model's */
    if (cf_tp_on(m) && m->cfg.qk_norm)
        for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
            cf_tp_allreduce(m, cf_grad(m, m->lp[l].qn), (size_t)m->cfg.head_dim, CF_TP_F32, -1);
            cf_tp_allreduce(m, cf_grad(m, m->lp[l].kn), (size_t)m->cfg.head_dim, CF_TP_F32, -1);
        }
    j->grads = pack(m, 1);
    if (cf_tp_on(m) && m->cfg.qk_norm)   /* undo: the step sums them again */
        for (int l = 0; l < m->cfg.num_hidden_layers; l++) {
            float *gq = cf_grad(m, m->lp[l].qn), *gk = cf_grad(m, m->lp[l].kn);
            for (int d = 0; d < m->cfg.head_dim; d++) { gq[d] /= P; gk[d] /= P; }
        }
    if (cf_step(m, &HP, &j->norm) != 0) return -1;
    j->weights = pack(m, 0);
    return 0;
}

/* Rank's local model of the whole model saved in dir. */
static cf_model *open_rank(const char *dir, const cf_tp_sync *sync, cf_layout_fn layout, void *lctx) {
    cf_model_opts o = {0};
    o.backend = CF_BACKEND_CPU;
    o.model_dir = dir;
    return cf_model_open_tp(&o, sync, layout, lctx);
}

static void rm_rf(const char *dir) {
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    CHECK(system(cmd) == 0);
}

static void *rank_main(void *p) {
    rank_job *j = p;
    cf_tp_sync sync = tpt_sync(&j->r);
    cf_model *m = open_rank(j->dir, &sync, NULL, NULL);
    j->m = m;
    if (m && run_model(m, j) == 0) j->ok = 1;
    else snprintf(j->err, sizeof j->err, "%s", cf_last_error());
    return NULL;
}

/* The largest per-tensor relative L2 error of rank r's packed values
 * against its slices of the one-process values. */
static double slice_err(cf_model *one, cf_model *loc, int r, const float *whole, const float *local,
                        const char **where) {
    const cf_config *full = cf_model_config(one);
    double worst = 0;
    for (int i = 0; i < cf_model_num_tensors(loc); i++) {
        cf_tp_slice sl;
        if (cf_tp_split(full, P, cf_model_tensor_name(loc, i), r, &sl) != 0) return 1e9;
        float *want = calloc((size_t)sl.local_numel + 1, sizeof(float));
        cf_tp_extract(&sl, whole + toff(one, i), want, sizeof(float));
        /* both all zero gives 0: the callers check that the gradients they
         * compare are not (every_tensor_nonzero) */
        double e = rel_l2(local + toff(loc, i), want, (size_t)sl.local_numel);
        if (e > worst) { worst = e; *where = cf_model_tensor_name(loc, i); }
        free(want);
    }
    return worst;
}

typedef struct { cf_model *m; const char *d; int w; int rc; } saver;
static void *save_main(void *p) {
    saver *s = p;
    s->rc = cf_model_save_tp(s->m, s->d, "float32", s->w);
    return NULL;
}

static void run_case(const tp_case *tc, cf_mode mode, uint64_t seed) {
    cf_config cfg;
    CHECK(cf_config_builtin(&cfg, tc->name) == 0);
    if (tc->vocab) cfg.vocab_size = tc->vocab;
    if (tc->o_bias) cfg.qkv_bias = cfg.o_bias = 1;   /* llama attention_bias */
    cf_model *one = cf_model_create(&cfg, CF_BACKEND_CPU, seed);
    CHECK_MSG(one != NULL, "%s", cf_last_error());
    if (!one) return;
    randomize_weights(one, seed ^ 0x5eed, 0.25f, 0.2f);
    char dir[] = "/tmp/cf_tp_modelXXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    CHECK(cf_model_save(one, dir, "float32", 0) == 0);

    int32_t tokens[B * (S + 1)];
    random_tokens(tokens, B * (S + 1), cfg.vocab_size, seed + 1);
    uint8_t mask[T];
    cf_rng rng;
    cf_rng_seed(&rng, seed + 2);
    int kept = 0;
    for (int t = 0; t < T; t++) kept += mask[t] = cf_rng_uniform(&rng) < (t < S ? 0.3f : 0.7f);   /* uneven */

    rank_job ref = {0};
    ref.mode = mode; ref.tokens = tokens; ref.mask = mask;
    int ref_ok = run_model(one, &ref) == 0;
    CHECK_MSG(ref_ok, "one process: %s", cf_last_error());

    tpt_group g;
    tpt_group_init(&g, P);
    rank_job jobs[P];
    pthread_t th[P];
    memset(jobs, 0, sizeof jobs);
    for (int r = 0; r < P; r++) {
        jobs[r].r.g = &g; jobs[r].r.rank = r;
        jobs[r].dir = dir; jobs[r].mode = mode; jobs[r].tokens = tokens; jobs[r].mask = mask;
        pthread_create(&th[r], NULL, rank_main, &jobs[r]);
    }
    for (int r = 0; r < P; r++) pthread_join(th[r], NULL);
    for (int r = 0; r < P; r++) CHECK_MSG(jobs[r].ok, "%s %s rank %d: %s", tc->name, cf_mode_name(mode), r, jobs[r].err);
    /* each rank's column slices of q/k/v and gate/up lie back to back: the
     * forward fuses them (model.c, plan_fused_proj), so that path is the
     * one compared here (but q/k/v with q/k norms) */
    for (int r = 0; r < P; r++)
        for (int l = 0; jobs[r].m && l < jobs[r].m->cfg.num_hidden_layers; l++) {
            const cf_model *m = jobs[r].m;
            CHECK_MSG(m->lp[l].fused_qkv == !m->cfg.qk_norm && m->lp[l].fused_gate_up,
                      "%s rank %d layer %d: fused q/k/v %d, gate/up %d", tc->name, r, l, m->lp[l].fused_qkv,
                      m->lp[l].fused_gate_up);
        }
    if (ref_ok && jobs[0].ok && jobs[1].ok) {
        double lerr = 0;
        for (int t = 0; t < T; t++) lerr = fmax(lerr, fabs(jobs[0].losses[t] - ref.losses[t]));
        CHECK_MSG(lerr < 1e-4, "%s %s: losses differ from one process by %g", tc->name, cf_mode_name(mode), lerr);
        CHECK(memcmp(jobs[0].losses, jobs[1].losses, sizeof jobs[0].losses) == 0);
        CHECK_CLOSE(jobs[0].norm, ref.norm, 1e-4);
        CHECK(jobs[0].norm == jobs[1].norm);
        CHECK(ref.norm > HP.grad_clip);   /* clipping is active: the norm matters */
        for (int r = 0; r < P; r++) {
            const char *wg = "", *ww = "";
            double eg = slice_err(one, jobs[r].m, r, ref.grads, jobs[r].grads, &wg);
            double ew = slice_err(one, jobs[r].m, r, ref.weights, jobs[r].weights, &ww);
            CHECK_MSG(eg < 2e-5, "%s %s rank %d: gradient of %s off by %g", tc->name, cf_mode_name(mode), r, wg, eg);
            /* AdamW divides by sqrt(v): summation-order noise of tiny
             * gradient elements grows to ~1e-5 in the update */
            CHECK_MSG(ew < 2e-4, "%s %s rank %d: weights of %s off by %g after a step", tc->name,
                      cf_mode_name(mode), r, ww, ew);
        }
        /* non-zero gradients in every tensor, the one process's and each
         * rank's: slice_err passes a tensor that is zero on both sides */
        const char *zero = "";
        CHECK_MSG(every_tensor_nonzero(one, ref.grads, &zero), "%s %s: one-process gradient of %s is all zero",
                  tc->name, cf_mode_name(mode), zero);
        for (int r = 0; r < P; r++)
            CHECK_MSG(every_tensor_nonzero(jobs[r].m, jobs[r].grads, &zero), "%s %s rank %d: gradient of %s is all zero",
                      tc->name, cf_mode_name(mode), r, zero);
        /* backward payload: 2 L + 1 all-reduces of n x C */
        int n = cf_mode_is_compact(mode) ? kept : T;
        int64_t want = (int64_t)(2 * cfg.num_hidden_layers + 1) * n * cfg.hidden_size * (int64_t)sizeof(float);
        CHECK_MSG(g.bytes[CF_TP_BWD] == want, "%s %s: backward all-reduce bytes %lld, expected %lld", tc->name,
                  cf_mode_name(mode), (long long)g.bytes[CF_TP_BWD], (long long)want);
        /* the gathered save (HF layout) holds exactly every rank's slices */
        if (mode == CF_MODE_CENTRIFUGE) {
            char out[] = "/tmp/cf_tp_saveXXXXXX";
            CHECK(mkdtemp(out) != NULL);
            /* both ranks take part; rank 0 writes */
            saver sv[P];
            pthread_t st[P];
            for (int r = 0; r < P; r++) {
                sv[r].m = jobs[r].m; sv[r].d = out; sv[r].w = r == 0; sv[r].rc = -1;
                pthread_create(&st[r], NULL, save_main, &sv[r]);
            }
            for (int r = 0; r < P; r++) { pthread_join(st[r], NULL); CHECK(sv[r].rc == 0); }
            cf_model *back = cf_model_load(out, CF_BACKEND_CPU);
            CHECK_MSG(back != NULL, "load of the gathered save: %s", cf_last_error());
            if (back) {
                /* exactly every rank's slices */
                float *w = pack(back, 0);
                for (int r = 0; r < P; r++) {
                    const char *where = "";
                    double e = slice_err(one, jobs[r].m, r, w, jobs[r].weights, &where);
                    CHECK_MSG(e == 0, "gathered save differs from rank %d at %s by %g", r, where, e);
                }
                free(w);
                cf_model_free(back);
            }
            rm_rf(out);
        }
    }
    for (int r = 0; r < P; r++) {
        free(jobs[r].grads); free(jobs[r].weights);
        cf_model_free(jobs[r].m);
    }
    tpt_group_destroy(&g);
    free(ref.grads); free(ref.weights);
    cf_model_free(one);
    rm_rf(dir);
}

/* ---------------------------------------------- 2-D: TP = 2 x DP = 2 */

enum { GRID_STEPS = 2, GRID_MAX_ACCUM = 2, DPX_MAX = 4 };

typedef struct {
    tpt_rank tr;
    dpt_rank dr;
    const char *dir;
    cf_mode mode;
    int accum;                       /* micro-batches per rank and step */
    int32_t (*tokens)[2 * GRID_MAX_ACCUM][S + 1];   /* [step][micro-batch][S + 1] */
    int ok;
    char err[512];
    double loss[GRID_STEPS];
    float norm[GRID_STEPS];
    float *weights;
    cf_model *m;
} grid_job;

static cf_train_opts grid_opts(cf_mode mode, int accum) {
    cf_train_opts o;
    memset(&o, 0, sizeof o);
    o.mode = mode;
    o.select.kind = CF_SELECT_SELF;
    o.select.keep = 0.5;
    o.batch = 1;
    o.seq = S;
    o.grad_accum = accum;
    o.adamw = HP;
    return o;
}

/* Whether the step left some gradient STALE (engine/model_internal.h): only
 * a plain one-process run may; DP hooks and TP zero every gradient. */
static int any_stale(const cf_model *m) {
    for (int i = 0; i < m->ntensors; i++)
        if (m->params[i].trainable && m->opt.gstate[i] == CF_GRAD_STALE) return 1;
    return 0;
}

/* GRID_STEPS training steps of m on micro-batches first .. first+accum-1 of
 * each step (micro-batch i of step st at tokens + (st * per_step + i) rows of
 * S + 1); their losses and gradient norms in loss, norm. 0, or -1 with the
 * error in err. The one process and every rank of the tests below. */
static int train_steps(cf_model *m, cf_mode mode, int accum, const int32_t *tokens, int per_step, int first,
                       double *loss, float *norm, char *err, size_t errlen) {
    cf_train_opts to = grid_opts(mode, accum);
    cf_trainer *tr = cf_trainer_create(m, &to);
    int rc = tr && accum <= DPX_MAX * GRID_MAX_ACCUM ? 0 : -1;
    for (int st = 0; rc == 0 && st < GRID_STEPS; st++) {
        cf_micro_batch mb[DPX_MAX * GRID_MAX_ACCUM];
        for (int i = 0; i < accum; i++)
            mb[i] = (cf_micro_batch){tokens + ((size_t)st * per_step + first + i) * (S + 1), NULL};
        cf_step_stats ss;
        rc = cf_trainer_step(tr, mb, HP.lr, &ss);
        loss[st] = ss.loss;
        norm[st] = ss.grad_norm;
        const int distributed = cf_tp_on(m) || m->opt.sync.world > 1;
        if (rc == 0 && any_stale(m) != !distributed) rc = cf_fail("step %d left %s gradient STALE", st,
                                                                  distributed ? "a DP/TP" : "no one-process");
    }
    if (rc != 0) snprintf(err, errlen, "%s", cf_last_error());
    cf_trainer_free(tr);
    return rc;
}

/* One rank of the grid: its TP slice, its DP shard, its micro-batch. */
static void *grid_main(void *p) {
    grid_job *j = p;
    cf_tp_sync sync = tpt_sync(&j->tr);
    cf_model *m = open_rank(j->dir, &sync, dpt_layout, &j->dr);
    j->m = m;
    if (!m) { snprintf(j->err, sizeof j->err, "%s", cf_last_error()); return NULL; }
    dpt_install(&j->dr, m);
    j->ok = train_steps(m, j->mode, j->accum, &j->tokens[0][0][0], 2 * GRID_MAX_ACCUM, j->dr.rank * j->accum, j->loss,
                        j->norm, j->err, sizeof j->err) == 0;
    if (j->ok) j->weights = pack(m, 0);
    return NULL;
}

static void run_grid_vocab(const char *name, int vocab, cf_mode mode, int accum, uint64_t seed) {
    cf_config cfg;
    CHECK(cf_config_builtin(&cfg, name) == 0);
    if (vocab > 0) cfg.vocab_size = vocab;
    cf_model *one = cf_model_create(&cfg, CF_BACKEND_CPU, seed);
    CHECK(one != NULL);
    if (!one) return;
    randomize_weights(one, seed ^ 0x5eed, 0.25f, 0.2f);
    char dir[] = "/tmp/cf_grid_modelXXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    CHECK(cf_model_save(one, dir, "float32", 0) == 0);
    int32_t tokens[GRID_STEPS][2 * GRID_MAX_ACCUM][S + 1];
    random_tokens(&tokens[0][0][0], GRID_STEPS * 2 * GRID_MAX_ACCUM * (S + 1), cfg.vocab_size, seed + 1);

    /* one process: every micro-batch of every step, accumulated */
    double ref_loss[GRID_STEPS];
    float ref_norm[GRID_STEPS];
    char err[512];
    CHECK_MSG(train_steps(one, mode, 2 * accum, &tokens[0][0][0], 2 * GRID_MAX_ACCUM, 0, ref_loss, ref_norm, err,
                          sizeof err) == 0, "one process: %s", err);
    float *ref_w = pack(one, 0);

    /* 4 ranks: global g = dp * 2 + tp (TP innermost) */
    tpt_group tg[2];
    dpt_group dg[2];
    for (int i = 0; i < 2; i++) { tpt_group_init(&tg[i], 2); dpt_group_init(&dg[i], 2); }
    grid_job jobs[4];
    pthread_t th[4];
    memset(jobs, 0, sizeof jobs);
    for (int g = 0; g < 4; g++) {
        int tp = g % 2, dp = g / 2;
        jobs[g].tr.g = &tg[dp]; jobs[g].tr.rank = tp;
        jobs[g].dr.g = &dg[tp]; jobs[g].dr.rank = dp;
        jobs[g].dir = dir; jobs[g].mode = mode; jobs[g].tokens = tokens; jobs[g].accum = accum;
        pthread_create(&th[g], NULL, grid_main, &jobs[g]);
    }
    for (int g = 0; g < 4; g++) pthread_join(th[g], NULL);
    for (int g = 0; g < 4; g++) {
        grid_job *j = &jobs[g];
        CHECK_MSG(j->ok, "%s %s rank %d: %s", name, cf_mode_name(mode), g, j->err);
        if (!j->ok) continue;
        /* every forward first waits (bounded) for the TP collectives before
         * its uploads block on the device */
        CHECK_MSG(j->tr.settles >= (int64_t)GRID_STEPS * accum, "rank %d: %lld settles for %d forwards", g,
                  (long long)j->tr.settles, GRID_STEPS * accum);
        for (int st = 0; st < GRID_STEPS; st++) {
            CHECK_CLOSE(j->loss[st], ref_loss[st], 1e-5);
            CHECK_CLOSE(j->norm[st], ref_norm[st], 1e-4);
        }
        const char *where = "";
        double e = slice_err(one, j->m, g % 2, ref_w, j->weights, &where);
        CHECK_MSG(e < 2e-4, "%s %s rank %d (TP %d, DP %d): weights of %s off by %g after %d steps", name,
                  cf_mode_name(mode), g, g % 2, g / 2, where, e, GRID_STEPS);
    }
    CHECK(ref_norm[0] > HP.grad_clip);   /* clipping is active */
    for (int g = 0; g < 4; g++) {
        free(jobs[g].weights);
        cf_model_free(jobs[g].m);
        dpt_rank_free(&jobs[g].dr);
    }
    for (int i = 0; i < 2; i++) { tpt_group_destroy(&tg[i]); dpt_group_destroy(&dg[i]); }
    free(ref_w);
    cf_model_free(one);
    rm_rf(dir);
}

/* The 2-D layout of --tp 2 on four ranks: each DP group's ZeRO-1 shards of
 * each TP slice, trained on its micro-batches per DP rank, equal the one
 * process trained on all micro-batches of each step. The embedding's
 * gradient (tiny-qwen2: tied, shared with the LM head) is reduced right
 * after the LM head and the embedding rows of the last micro-batch are
 * added to the reduced slices afterwards (cf_grad_sync.embedding_rows),
 * also after accumulation. */
static void run_grid(const char *name, cf_mode mode, int accum, uint64_t seed) {
    run_grid_vocab(name, 0, mode, accum, seed);
}

TEST(tp2_by_dp2_grid_with_zero1_equals_one_process_on_the_global_batch) {
    run_grid("tiny-qwen3", CF_MODE_CENTRIFUGE, 1, 501);
    run_grid("tiny-llama", CF_MODE_REGULAR, 1, 502);
    run_grid("tiny-qwen2", CF_MODE_CENTRIFUGE_KV, 1, 503);
    run_grid("tiny-qwen2", CF_MODE_CENTRIFUGE, 2, 504);
    run_grid("tiny-qwen2", CF_MODE_REGULAR, 2, 505);
    run_grid("tiny-llama", CF_MODE_CENTRIFUGE, 2, 506);   /* untied */
    /* 62 rows: 31 per TP rank, so each DP slice ends mid-row and the
     * embedding rows spill into the neighbour's slice (cleared again) */
    run_grid_vocab("tiny-qwen2", 62, CF_MODE_CENTRIFUGE, 2, 507);
    run_grid_vocab("tiny-llama", 62, CF_MODE_REGULAR, 2, 508);
}

/* ------------------------------------------ data parallel alone: 3, 4 ranks */

typedef struct {
    dpt_rank dr;
    const char *dir;
    cf_mode mode;
    int accum;
    int32_t (*tokens)[DPX_MAX * GRID_MAX_ACCUM][S + 1];
    int ok;
    char err[512];
    double loss[GRID_STEPS];
    float norm[GRID_STEPS];
    float *weights;
    cf_model *m;
} dpx_job;

static void *dpx_main(void *p) {
    dpx_job *j = p;
    cf_model_opts o = {0};
    o.backend = CF_BACKEND_CPU;
    o.model_dir = j->dir;
    cf_model *m = cf_model_open_with(&o, dpt_layout, &j->dr);
    j->m = m;
    if (!m) { snprintf(j->err, sizeof j->err, "%s", cf_last_error()); return NULL; }
    dpt_install(&j->dr, m);
    j->ok = train_steps(m, j->mode, j->accum, &j->tokens[0][0][0], DPX_MAX * GRID_MAX_ACCUM,
                        j->dr.rank * j->accum, j->loss, j->norm, j->err, sizeof j->err) == 0;
    if (j->ok) j->weights = pack(m, 0);
    return NULL;
}

/* dp ranks of ZeRO-1 (no TP), each on its micro-batches, against one
 * process on all of them. With 3 and 4 ranks the buckets' slices fall at
 * other places than with 2: slices that end mid-row of the embedding, ranks
 * whose slice of a small bucket is all padding (no segment: gathered when a
 * later bucket completes or at the end), and ranks reaching each bucket's
 * all-gather at different segments of the pipelined step. */
static void run_dp(const char *name, int vocab, int dp, cf_mode mode, int accum, uint64_t seed) {
    cf_config cfg;
    CHECK(cf_config_builtin(&cfg, name) == 0);
    if (vocab > 0) cfg.vocab_size = vocab;
    cf_model *one = cf_model_create(&cfg, CF_BACKEND_CPU, seed);
    CHECK(one != NULL && dp <= DPX_MAX && accum <= GRID_MAX_ACCUM);
    if (!one || dp > DPX_MAX || accum > GRID_MAX_ACCUM) { cf_model_free(one); return; }
    randomize_weights(one, seed ^ 0x5eed, 0.25f, 0.2f);
    char dir[] = "/tmp/cf_dpx_modelXXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    CHECK(cf_model_save(one, dir, "float32", 0) == 0);
    static int32_t tokens[GRID_STEPS][DPX_MAX * GRID_MAX_ACCUM][S + 1];
    random_tokens(&tokens[0][0][0], GRID_STEPS * DPX_MAX * GRID_MAX_ACCUM * (S + 1), cfg.vocab_size, seed + 1);

    double ref_loss[GRID_STEPS];
    float ref_norm[GRID_STEPS];
    char err[512];
    CHECK_MSG(train_steps(one, mode, dp * accum, &tokens[0][0][0], DPX_MAX * GRID_MAX_ACCUM, 0, ref_loss, ref_norm,
                          err, sizeof err) == 0, "one process: %s", err);
    float *ref_w = pack(one, 0);

    dpt_group g;
    dpt_group_init(&g, dp);
    dpx_job jobs[DPX_MAX];
    pthread_t th[DPX_MAX];
    memset(jobs, 0, sizeof jobs);
    for (int r = 0; r < dp; r++) {
        jobs[r].dr.g = &g;
        jobs[r].dr.rank = r;
        jobs[r].dir = dir; jobs[r].mode = mode; jobs[r].tokens = tokens; jobs[r].accum = accum;
        pthread_create(&th[r], NULL, dpx_main, &jobs[r]);
    }
    for (int r = 0; r < dp; r++) pthread_join(th[r], NULL);
    const size_t nw = cf_model_num_params(one);
    for (int r = 0; r < dp; r++) {
        dpx_job *j = &jobs[r];
        CHECK_MSG(j->ok, "%s %s DP=%d rank %d: %s", name, cf_mode_name(mode), dp, r, j->err);
        if (!j->ok) continue;
        for (int st = 0; st < GRID_STEPS; st++) {
            CHECK_CLOSE(j->loss[st], ref_loss[st], 1e-5);
            CHECK_CLOSE(j->norm[st], ref_norm[st], 1e-4);
        }
        double e = 0;
        for (size_t i = 0; i < nw; i++) e = fmax(e, fabs((double)j->weights[i] - ref_w[i]));
        CHECK_MSG(e < 2e-4, "%s %s DP=%d rank %d: weights off by %g after %d steps", name, cf_mode_name(mode), dp, r,
                  e, GRID_STEPS);
    }
    CHECK(ref_norm[0] > HP.grad_clip);   /* clipping is active */
    for (int r = 0; r < dp; r++) {
        free(jobs[r].weights);
        cf_model_free(jobs[r].m);
        dpt_rank_free(&jobs[r].dr);
    }
    dpt_group_destroy(&g);
    free(ref_w);
    cf_model_free(one);
    rm_rf(dir);
}

TEST(dp3_and_dp4_with_zero1_equal_one_process_on_the_global_batch) {
    run_dp("tiny-qwen2", 61, 3, CF_MODE_CENTRIFUGE, 2, 601);   /* tied, odd vocabulary */
    run_dp("tiny-llama", 0, 3, CF_MODE_REGULAR, 1, 602);       /* untied */
    run_dp("tiny-qwen3", 0, 4, CF_MODE_CENTRIFUGE_KV, 2, 603);
    run_dp("tiny-llama", 61, 4, CF_MODE_LOSS_ONLY, 1, 604);
}

static const tp_case CASES[] = {
    {"tiny-llama", 63, 1},    /* padded vocabulary (63 -> 64), o_proj bias on the row-parallel side */
    {"tiny-qwen2", 0, 0},     /* q/k/v biases split, tied embeddings split once */
    {"tiny-qwen3", 0, 0},     /* q/k norms summed over the group */
};

TEST(tp2_equals_one_process_in_every_mode_and_model_type) {
    const cf_mode modes[] = {CF_MODE_REGULAR, CF_MODE_LOSS_ONLY, CF_MODE_CENTRIFUGE, CF_MODE_STRAWMAN,
                             CF_MODE_CENTRIFUGE_KV};
    for (size_t c = 0; c < sizeof CASES / sizeof *CASES; c++)
        for (size_t k = 0; k < sizeof modes / sizeof *modes; k++) run_case(&CASES[c], modes[k], 300 + 10 * c + k);
}

TEST(tp_refuses_what_it_cannot_split) {
    cf_config cfg;
    CHECK(cf_config_builtin(&cfg, "tiny-llama") == 0);   /* 4 heads, 2 KV heads */
    cf_model *one = cf_model_create(&cfg, CF_BACKEND_CPU, 1);
    char dir[] = "/tmp/cf_tp_badXXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    CHECK(cf_model_save(one, dir, "float32", 0) == 0);
    tpt_group g;
    tpt_group_init(&g, 4);
    tpt_rank r = {&g, 0, 0};
    cf_tp_sync sync = tpt_sync(&r);   /* tp 4 > 2 KV heads */
    cf_model_opts o = {0};
    o.backend = CF_BACKEND_CPU;
    o.model_dir = dir;
    CHECK(cf_model_open_tp(&o, &sync, NULL, NULL) == NULL);
    CHECK(strstr(cf_last_error(), "num_key_value_heads") != NULL);
    /* LoRA under TP: a clear refusal */
    sync.size = 2;
    o.lora.rank = 4; o.lora.alpha = 8; o.lora.targets = CF_LORA_Q;
    CHECK(cf_model_open_tp(&o, &sync, NULL, NULL) == NULL);
    CHECK(strstr(cf_last_error(), "LoRA") != NULL);
    tpt_group_destroy(&g);
    cf_model_free(one);
    rm_rf(dir);
}

int main(void) {
    RUN(tp2_equals_one_process_in_every_mode_and_model_type);
    RUN(dp3_and_dp4_with_zero1_equal_one_process_on_the_global_batch);
    RUN(tp_refuses_what_it_cannot_split);
    RUN(tp2_by_dp2_grid_with_zero1_equals_one_process_on_the_global_batch);
    return test_summary();
}
