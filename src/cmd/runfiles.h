/*
 * runfiles.h — what the commands share about model and run directories:
 * a training run directory (OUT of `train --out`) stands for its newest
 * checkpoint, and a model's tokenizer files travel with it into every
 * checkpoint and conversion.
 */
#ifndef CF_RUNFILES_H
#define CF_RUNFILES_H

#include <stddef.h>

/* If dir is a training run directory (a `latest` file and no config.json),
 * writes the checkpoint directory `latest` names into out and returns out;
 * otherwise returns dir unchanged. NULL (cf_last_error set) when `latest`
 * is unreadable or names no directory. */
const char *cf_resolve_model_dir(const char *dir, char *out, size_t cap);

/* Copies the tokenizer files of a HF model directory (tokenizer.json,
 * tokenizer_config.json, special_tokens_map.json, tokenizer.model,
 * vocab.json, merges.txt, added_tokens.json, generation_config.json,
 * chat_template.jinja) from src into dst, each atomically. src may also be
 * a tokenizer.json file (then that file, and a tokenizer_config.json beside
 * it). Files src does not have are skipped. Returns the number copied, or
 * -1 on a read or write failure. */
int cf_copy_tokenizer_files(const char *src, const char *dst);

#endif
