/*
 * train.h — shared pieces of the train / eval / score / bench commands:
 * opening a model from a name, a config.json or a checkpoint directory, the
 * batch loader over a token shard, and checkpoints with training state.
 */
#ifndef CF_TRAIN_H
#define CF_TRAIN_H

#include <stdint.h>
#include <stdio.h>

#include "centrifuge.h"
#include "io.h"

/* --config NAME|FILE (fresh weights from seed) or --model DIR (load). */
cf_model *cf_open_model(const char *config, const char *model_dir, const char *device,
                        uint64_t seed);
int cf_parse_device(const char *s, cf_backend_kind *out);

/* Sequential batches of B rows of S+1 tokens (rows overlap by one token, as
 * in llm.c); wraps around at the end of the shard. */
typedef struct {
    const cf_tokens *tok;
    const cf_refloss *ref;  /* may be NULL */
    int B, S;
    int64_t pos;            /* index of the next batch's first token */
} cf_loader;

int cf_loader_init(cf_loader *ld, const cf_tokens *tok, const cf_refloss *ref, int B, int S);
/* Fills tokens[B*(S+1)] and, if ref_out, ref_out[B*S] (ref loss of each
 * target), then advances. */
void cf_loader_next(cf_loader *ld, int32_t *tokens, float *ref_out);

/* Checkpoint: dir/step_NNNNNNNN/{config.json, model.safetensors, state.bin}
 * and dir/latest naming it; state.bin holds the AdamW moments, the step and
 * the data position. */
int cf_checkpoint_save(cf_model *m, const char *dir, int64_t step, int64_t data_pos, int keep_last);
/* Loads the newest checkpoint of dir into a new model; sets *step, *data_pos. */
cf_model *cf_checkpoint_load(const char *dir, const char *device, int64_t *step, int64_t *data_pos);

/* Mean per-token loss over up to max_batches batches of a shard (0 = all);
 * each per-token loss is also written to losses_out when it is not NULL. */
int cf_evaluate(cf_model *m, const cf_tokens *tok, int B, int S, int max_batches, double *mean_loss,
                int64_t *ntokens, FILE *losses_out);

#endif
