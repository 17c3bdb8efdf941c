/*
 * datagen.h — the synthetic "math world" of the demo and the utility
 * experiment, and its byte-level tokenizer.
 *
 * Tokenizer: ids 0..255 are bytes; CF_TOK_BOS and CF_TOK_EOS are specials.
 * A document is BOS + utf-8 bytes + EOS.
 *
 * Clean source: arithmetic word problems with worked solutions ending in
 *   "The answer is N." in several template families.
 * Noisy web source: clean problems mixed with problems whose arithmetic is
 *   wrong, boilerplate and spam, random digit strings, and unrelated text.
 * Everything is deterministic in the seed.
 */
#ifndef CF_DATAGEN_H
#define CF_DATAGEN_H

#include <stddef.h>
#include <stdint.h>

#define CF_TOK_BOS 256
#define CF_TOK_EOS 257
#define CF_TOK_VOCAB 258   /* ids in use; model vocab_size must be >= this */

/* Encodes text as bytes (no specials); returns the count written (<= cap). */
int cf_tok_encode(const char *text, uint32_t *out, int cap);
/* Decodes ids to text, skipping specials; always NUL-terminates; returns length. */
int cf_tok_decode(const uint32_t *ids, int n, char *out, int cap);

typedef enum { CF_DATA_CLEAN = 0, CF_DATA_NOISY = 1 } cf_data_source;

/* Which problems the world makes. standard: operands up to 99 and the full
 * question templates (the utility experiment's world). small: the world of
 * `centrifuge demo`, where a tiny model on a CPU learns the facts in about a
 * minute: short questions (two templates per family) and one-digit operands
 * (add 1..5 + 1..5, sub 2..6 - smaller, mul 2..4 x 2..4, two-step from those).
 * Same answer format, noise mix and held-out split. The setting is
 * process-wide (default standard); the standard world's output is unchanged. */
typedef enum { CF_WORLD_STANDARD = 0, CF_WORLD_SMALL = 1 } cf_world;
void cf_datagen_set_world(cf_world w);
cf_world cf_datagen_world(void);
int cf_world_parse(const char *s, cf_world *out);   /* "standard", "small" */
int cf_data_source_parse(const char *s, cf_data_source *out);   /* "clean", "noisy" */

enum { CF_FAM_ADD = 0, CF_FAM_SUB, CF_FAM_MUL, CF_FAM_TWOSTEP, CF_NUM_FAMILIES };
const char *cf_family_name(int family);

/* Fills out[0..n) with documents of the source, back to back, cut at n. */
int cf_datagen_tokens(cf_data_source src, uint64_t seed, int64_t n, uint32_t *out);

/* A held-out clean problem: the prompt is the question up to and including
 * the start of the worked solution, so greedy decoding must produce the
 * solution and "The answer is N.". */
typedef struct {
    char prompt[256];
    char solution[256];   /* the reference continuation */
    long answer;
    int family;
} cf_problem;

/* Held-out problems, drawn from a stream disjoint from the training seeds. */
void cf_datagen_eval_problems(uint64_t seed, int n, cf_problem *out);
/* Extracts N from the first "The answer is N." in text; returns 0 and sets
 * *answer, or -1 if there is none. */
int cf_parse_answer(const char *text, long *answer);

#endif /* CF_DATAGEN_H */
